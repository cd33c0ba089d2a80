#!/usr/bin/env python3
"""The lines of the election backends, lock/session.rs and conn/, tests left out.

    scripts/backend-lines.py [REV]

Issue 29's size measure: every .rs file under pgelect/src/election/backend/,
pgelect/src/lock/session.rs and pgelect/src/conn* (a file or a folder), as
they are in the work tree or, given REV, at that commit (read with
`git show`, nothing checked out). Files named tests.rs and `#[cfg(test)]
mod ... { ... }` blocks are left out. Prints the total, split into doc
comments (/// and //!), other comments and the rest (code and blank lines),
then the largest files by their non-blank code lines. Standard library only.
"""

import os
import subprocess
import sys


def is_counted(path):
    if not path.endswith(".rs") or os.path.basename(path) == "tests.rs":
        return False
    return (
        path.startswith("pgelect/src/election/backend/")
        or path == "pgelect/src/lock/session.rs"
        or path.startswith("pgelect/src/conn")
    )


def sources(rev):
    """(path, text) of every counted file."""
    if rev is None:
        paths = []
        for d, _, files in os.walk("pgelect/src"):
            paths += [os.path.join(d, f) for f in files]
        for p in sorted(p for p in paths if is_counted(p)):
            with open(p, encoding="utf-8") as f:
                yield p, f.read()
        return
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "pgelect/src"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    for p in sorted(p for p in listing if is_counted(p)):
        text = subprocess.run(
            ["git", "show", f"{rev}:{p}"], check=True, capture_output=True, text=True
        ).stdout
        yield p, text


def count(text):
    """(doc, comment, code and blank, non-blank code) lines of one file."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    doc = comment = code = nonblank = 0
    i = 0
    while i < len(lines):
        s = lines[i].strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if s == "#[cfg(test)]" and nxt.startswith("mod ") and nxt.endswith("{"):
            depth, j = 0, i + 1
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                j += 1
                if depth == 0:
                    break
            i = j
            continue
        if s.startswith("///") or s.startswith("//!"):
            doc += 1
        elif s.startswith("//"):
            comment += 1
        else:
            code += 1
            nonblank += bool(s)
        i += 1
    return doc, comment, code, nonblank


def main():
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        sys.exit(64)
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    rev = sys.argv[1] if len(sys.argv) == 2 else None
    total = [0, 0, 0]
    largest = []
    for path, text in sources(rev):
        doc, comment, code, nonblank = count(text)
        total[0] += doc
        total[1] += comment
        total[2] += code
        largest.append((nonblank, path))
    print(
        f"{sum(total)} lines: {total[0]} doc comments, {total[1]} other comments, "
        f"{total[2]} code and blank ({rev or 'work tree'})"
    )
    for nonblank, path in sorted(largest, reverse=True)[:10]:
        print(f"{nonblank:6}  {path}")


if __name__ == "__main__":
    main()
