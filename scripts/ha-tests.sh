#!/usr/bin/env bash
# The slow tests under a real HA manager (pg_auto_failover from the test
# kit's AutoFailover: a monitor and two data nodes on loopback): for each
# backend on the data nodes' multi-host URL, and for the lease backend
# through one PgBouncer per data node, a switchover, a failover, a
# postmaster kill and a node kill issued through the manager, with safety
# checked and availability printed as HA-RESULT lines (summarised at the
# end), then `pgelect chaos` under the
# manager (the end-to-end test of `--ha pg_auto_failover`). About 3-5 minutes on an idle
# machine. The default suite (scripts/test.sh) runs only the kit's own
# formation test and the multi-host tests on ordinary servers.
#
#   scripts/ha-tests.sh                 # every HA-manager test
#   scripts/ha-tests.sh -- -E 'test(/session/)'   # anything after -- goes to nextest
set -euo pipefail
cd "$(dirname "$0")/.."

extra=()
case "${1:-}" in
  --) shift; extra=("$@") ;;
  "") ;;
  *) echo "usage: scripts/ha-tests.sh [-- NEXTEST-ARGS...]" >&2; exit 64 ;;
esac

scripts/setup.sh
command -v cargo-nextest >/dev/null 2>&1 || { echo "scripts/ha-tests.sh: needs cargo-nextest (cargo install cargo-nextest)" >&2; exit 69; }

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
filter=(-E 'test(/^ha::(manager|pooled)::/)')
[ ${#extra[@]} -gt 0 ] && filter=()
PGELECT_HA_TESTS=1 cargo nextest run -p pgelect --test it --no-capture --test-threads 1 --no-fail-fast \
  "${filter[@]}" "${extra[@]}" 2>&1 | tee "$log" || status=$?
# pgelect chaos under the manager, end to end (about a minute).
if [ ${#extra[@]} -eq 0 ]; then
  PGELECT_HA_TESTS=1 cargo nextest run -p pgelect-cli --test it --features pgelect/sqlx,pgelect-cli/throwaway \
    --no-capture -E 'test(/chaos_under_pg_auto_failover/)' 2>&1 | tee -a "$log" || status=$?
fi
echo
echo "== availability under pg_auto_failover (leader acting again after the new primary accepted a write) =="
grep -h '^HA-RESULT' "$log" || echo "(no HA-RESULT lines: the tests were skipped or failed early)"
exit "$status"
