#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds once, then runs every
# test against real, throwaway PostgreSQL clusters (and PgBouncer) that the
# tests start themselves. Set PGELECT_TEST_DATABASE_URL to use an existing
# server instead (tests that restart a server then skip, saying so).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

features=(--workspace --features pgelect/sqlx,pgelect-cli/throwaway)
cargo build "${features[@]}" --all-targets
if cargo nextest --version >/dev/null 2>&1; then
  # Each test runs in its own process with its own throwaway cluster.
  cargo nextest run "${features[@]}" --no-fail-fast --test-threads "${PGELECT_TEST_THREADS:-4}"
else
  cargo test "${features[@]}" --no-fail-fast
fi
cargo test "${features[@]}" --doc
