#!/usr/bin/env bash
# Builds the Python package's wheel and runs its tests and the Python
# examples against a throwaway PostgreSQL and PgBouncer (the test kit's
# pgelect-throwaway, started by the pytest fixture). scripts/test.sh runs
# it after the Rust suite; alone:
#
#   pgelect-py/test.sh                 # build, install, pytest
#   pgelect-py/test.sh -k fence        # anything after goes to pytest
#
# Everything lives under target/: the virtualenv (target/py-venv, with the
# pinned tools of pgelect-py/requirements-dev.txt and
# examples/python/requirements.txt), the wheel (target/wheels). The wheel
# is a debug build: it builds in about half the time of a release build,
# and the tests exercise the library, not its speed. It is an abi3 wheel
# (cp39-abi3): one file for CPython 3.9 and every later version.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/py-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" || {
    echo "pgelect-py/test.sh: cannot create a virtualenv: install python3-venv (apt-get install python3-venv)" >&2
    exit 69
  }
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -r pgelect-py/requirements-dev.txt -r examples/python/requirements.txt

cargo build --quiet -p pgelect-testkit --bin pgelect-throwaway
rm -f target/wheels/pgelect-*.whl
"$venv/bin/maturin" build --quiet -m pgelect-py/Cargo.toml -o target/wheels
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps target/wheels/pgelect-*.whl

# From outside the source tree, so that the installed wheel is what runs.
"$venv/bin/python" -m pytest -p no:cacheprovider --rootdir pgelect-py/tests -q \
  pgelect-py/tests examples/python "$@"
