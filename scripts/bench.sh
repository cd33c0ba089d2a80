#!/usr/bin/env bash
# The benchmarks behind the README's numbers (not part of CI: they take
# minutes). Each prints a table and a JSON line; this script also records the
# machine and the commit. Extra arguments go to every benchmark, e.g.
#   scripts/bench.sh --trials 10
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release -q -p pgelect-bench
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB"
bench=target/release/pgelect-bench
"$bench" xact-lock
"$bench" failover "$@"
"$bench" lease-failover "$@"
