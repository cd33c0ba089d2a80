#!/usr/bin/env bash
# The demo: a throwaway local PostgreSQL, three candidates, the leader killed,
# the failover timed, then a planned resign timed; everything cleaned up.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release -q -p pgelect-cli --features throwaway
exec target/release/pgelect demo "$@"
