#!/usr/bin/env bash
# The names of every test in the workspace (ignored ones included), as
# `cargo nextest list` gives them, against the committed list
# .ci/test-names.txt: a test that is renamed, moved or deleted fails the
# check until the list is updated in the same commit, so that no test
# disappears unnoticed.
#
#   scripts/test-names.sh --check    # fail if a listed test is gone
#   scripts/test-names.sh --update   # rewrite the list from the code
set -euo pipefail
cd "$(dirname "$0")/.."

list=.ci/test-names.txt
current() {
  cargo nextest list --workspace --features pgelect/sqlx,pgelect-cli/throwaway \
    --run-ignored all --message-format oneline 2>/dev/null | LC_ALL=C sort
}

case "${1:-}" in
  --update)
    current >"$list"
    echo "$list: $(wc -l <"$list") tests"
    ;;
  --check)
    now=$(mktemp)
    trap 'rm -f "$now"' EXIT
    current >"$now"
    gone=$(LC_ALL=C comm -23 "$list" "$now")
    new=$(LC_ALL=C comm -13 "$list" "$now")
    echo "test names: $(wc -l <"$now") now, $(wc -l <"$list") in $list"
    if [ -n "$new" ]; then
      echo "new tests, not yet in $list (scripts/test-names.sh --update adds them):"
      printf '%s\n' "$new" | sed 's/^/  + /'
    fi
    if [ -n "$gone" ]; then
      echo "tests in $list that no longer exist (a rename or a move updates the list, a deletion says why in its commit):" >&2
      printf '%s\n' "$gone" | sed 's/^/  - /' >&2
      exit 1
    fi
    ;;
  *) echo "usage: scripts/test-names.sh --check|--update" >&2; exit 64 ;;
esac
