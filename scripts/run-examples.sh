#!/usr/bin/env bash
# Runs the library's examples (pgelect/examples/) against a throwaway
# PostgreSQL and checks what each prints:
#
#   scripts/run-examples.sh                        # every example below
#   scripts/run-examples.sh semaphore long_job_lock
#
# The server is `pgelect demo --keep` (feature `throwaway`): it starts a
# PostgreSQL from the system's binaries (as the postgres user when run as
# root), installs the schema, and writes the URL, with a random password, to
# a private file whose path it prints; SIGTERM stops and removes it. The
# examples read that URL from DATABASE_URL (never printed) and run with
# PGELECT_EXAMPLE_ONCE=1, which makes each one end by itself.
#
# Builds what it runs with CI's feature set (a no-op after CI's build step).
set -euo pipefail
cd "$(dirname "$0")/.."

all=(singleton_scheduler long_job_lock semaphore leader_only_route partitioned_workers)
if [ $# -gt 0 ]; then want=("$@"); else want=("${all[@]}"); fi
for w in "${want[@]}"; do
  # Not `printf | grep -q`, which pipefail turns into a race (SIGPIPE).
  known=false
  for a in "${all[@]}"; do [ "$a" = "$w" ] && known=true; done
  if ! $known; then
    echo "run-examples: unknown example '$w'; these run here: ${all[*]}" >&2
    exit 64
  fi
done

start=$(date +%s)
cargo build -q --workspace --features pgelect/sqlx,pgelect-cli/throwaway --bins --examples
bin=target/debug
logs=target/examples-logs
rm -rf "$logs"
mkdir -p "$logs"

# The throwaway server; a short demo (two candidates, ttl 2s) before it is kept.
# Created here, not by the redirect below: the background process opens it
# after the fork, and the first read of it may come before that.
: >"$logs/server.log"
"$bin/pgelect" demo --keep --candidates 2 --ttl 2s >"$logs/server.log" 2>&1 &
server=$!
background=() # examples running in the background, stopped on exit too
stop_server() {
  local p
  for p in "${background[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  if kill -0 "$server" 2>/dev/null; then
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
}
trap stop_server EXIT
trap "exit 130" INT TERM
url_file=
for _ in $(seq 120); do
  url_file=$(sed -n 's/.*password, is in \(.*\), mode 0600.*/\1/p' "$logs/server.log")
  [ -n "$url_file" ] && break
  if ! kill -0 "$server" 2>/dev/null; then break; fi
  sleep 0.5
done
if [ -z "$url_file" ] || [ ! -r "$url_file" ]; then
  echo "run-examples: the throwaway PostgreSQL did not come up; its log:" >&2
  cat "$logs/server.log" >&2
  exit 1
fi
"$bin/pgelect" --database-url-file "$url_file" -q migrate
DATABASE_URL=$(cat "$url_file")
export DATABASE_URL PGELECT_EXAMPLE_ONCE=1
echo "throwaway PostgreSQL up and migrated after $(($(date +%s) - start)) s"

failed=()
# expect LOG PATTERN...: every extended regex matches a line of LOG.
expect() {
  local log=$1 p
  shift
  for p in "$@"; do
    if ! grep -Eq -- "$p" "$log"; then
      echo "  missing in $log: /$p/" >&2
      return 1
    fi
  done
}
# run NAME ARGS...: one example, at most 60 s, its output in $logs/NAME.log.
run() {
  local name=$1
  shift
  timeout 60 "$bin/examples/$name" "$@" >"$logs/$name.log" 2>&1
}

check() {
  case "$1" in
    singleton_scheduler)
      run singleton_scheduler &&
        expect "$logs/singleton_scheduler.log" '^job 3 done' 'refuses it too: .*term [0-9]+ is stale' \
          'write fenced with term [0-9]+ committed' ;;
    long_job_lock)
      run long_job_lock && expect "$logs/long_job_lock.log" 'lock lost after [0-9]+ of 20 steps: job cancelled' ;;
    semaphore)
      run semaphore && expect "$logs/semaphore.log" 'served [67], gave up [01], at most [12] calls in flight' ;;
    leader_only_route)
      run leader_only_route &&
        expect "$logs/leader_only_route.log" 'while other-replica leads: HTTP/1.1 503' 'while this replica leads: HTTP/1.1 200' ;;
    partitioned_workers)
      # Two members: b joins a's group, takes its share, then leaves.
      local pa a=0 b=0
      PGELECT_EXAMPLE_SECONDS=9 timeout 60 "$bin/examples/partitioned_workers" worker-a \
        >"$logs/partitioned_workers-a.log" 2>&1 &
      pa=$!
      background+=("$pa")
      sleep 2
      PGELECT_EXAMPLE_SECONDS=5 timeout 60 "$bin/examples/partitioned_workers" worker-b \
        >"$logs/partitioned_workers-b.log" 2>&1 || b=$?
      wait "$pa" || a=$?
      [ "$a" = 0 ] && [ "$b" = 0 ] &&
        expect "$logs/partitioned_workers-a.log" 'worker-a: lost partition [0-5] \(term [0-9]+\): handed_over' \
          'worker-a: done' &&
        expect "$logs/partitioned_workers-b.log" 'worker-b: gained partition' 'worker-b: done' ;;
  esac
}

for w in "${want[@]}"; do
  t=$(date +%s)
  if check "$w"; then
    echo "ok      $w ($(($(date +%s) - t)) s)"
  else
    echo "FAILED  $w ($(($(date +%s) - t)) s); its output:" >&2
    cat "$logs/$w"*.log >&2
    failed+=("$w")
  fi
done
stop_server
echo "examples: ${#want[@]} run, ${#failed[@]} failed, $(($(date +%s) - start)) s in all (logs in $logs)"
[ ${#failed[@]} -eq 0 ]
