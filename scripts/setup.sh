#!/usr/bin/env bash
# Makes sure this machine has what pgelect's demo and tests need: the
# PostgreSQL server binaries and PgBouncer (from the system's packages) and a
# Rust toolchain. Installs what is missing where it can (as root, with apt-get)
# and otherwise says exactly what to install. Safe to run again.
#
# `scripts/setup.sh --promtool` instead makes sure of `promtool` alone (for
# scripts/check-deploy.sh), from Debian's `prometheus` package: the demo and
# the tests do not need it.
set -euo pipefail

only_promtool=false
case "${1:-}" in
  --promtool) only_promtool=true ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--promtool]" >&2; exit 64 ;;
esac

have_pg() {
  if [ -n "${PGELECT_PG_BIN:-}" ] && [ -x "$PGELECT_PG_BIN/initdb" ]; then return 0; fi
  if command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir 2>/dev/null)/initdb" ]; then return 0; fi
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}
have_pgbouncer() { command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; }
# pg_auto_failover (the HA manager the tests under pgelect-testkit's
# AutoFailover run): its command and its extension for the installed server.
pg_major() {
  local bin
  for bin in /usr/lib/postgresql/*/bin; do [ -x "$bin/initdb" ] && basename "$(dirname "$bin")"; done | sort -n | tail -1
}
have_autofailover() {
  command -v pg_autoctl >/dev/null 2>&1 || return 1
  compgen -G "/usr/share/postgresql/*/extension/pgautofailover.control" >/dev/null
}

missing=()
if $only_promtool; then
  # Debian and Ubuntu have no smaller package with promtool than the server's.
  command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
else
  have_pg || missing+=(postgresql)
  have_pgbouncer || missing+=(pgbouncer)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]} from the system's packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    # policy-rc.d keeps the packages from starting a system-wide server: the
    # tests and the demo start their own throwaway clusters, and only
    # promtool is wanted from prometheus.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
      trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing ${missing[*]}. Install them with:" >&2
    echo "  sudo apt-get install ${missing[*]}        # Debian/Ubuntu" >&2
    if $only_promtool; then
      echo "(the package's server is not needed: promtool alone, from any Prometheus 2.x release, on PATH is enough)" >&2
    else
      echo "or point PGELECT_PG_BIN at a directory holding initdb and postgres." >&2
    fi
    exit 69
  fi
fi

$only_promtool && exit 0

# pg_auto_failover, for the tests under a real HA manager (pgelect-testkit's
# AutoFailover; those tests are skipped, saying so, without it): Debian's
# pg-auto-failover-cli and the extension for the newest installed server.
if ! have_autofailover; then
  major=$(pg_major || true)
  pkgs=(pg-auto-failover-cli)
  [ -n "$major" ] && pkgs+=("postgresql-$major-auto-failover")
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${pkgs[*]} (for the tests under pg_auto_failover)" >&2
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
      trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null; } \
      || echo "setup: could not install ${pkgs[*]}; the tests under pg_auto_failover will be skipped" >&2
  else
    echo "setup: pg_auto_failover is missing (optional: the tests under it are skipped; sudo apt-get install ${pkgs[*]})" >&2
  fi
fi

# libfaketime, for `pgelect chaos`'s clock-jump fault only (Debian's
# `faketime`): installed where we can, otherwise that fault is reported
# skipped; nothing else needs it.
if ! compgen -G "/usr/lib/*/faketime/libfaketimeMT.so.1" >/dev/null \
   && ! [ -e /usr/lib/faketime/libfaketimeMT.so.1 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing faketime (for pgelect chaos's clock jumps)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends faketime >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends faketime >/dev/null; } \
      || echo "setup: could not install faketime; pgelect chaos will skip clock jumps" >&2
  else
    echo "setup: faketime is missing (optional: pgelect chaos skips clock jumps without it; sudo apt-get install faketime)" >&2
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo is missing; install a Rust toolchain (https://rustup.rs) and run this again" >&2
  exit 69
fi
