#!/usr/bin/env bash
# Builds the Python package's wheel and runs its tests and the Python
# examples against a throwaway PostgreSQL and PgBouncer (the test kit's
# pgelect-throwaway, started by the pytest fixture). scripts/test.sh runs
# it after the Rust suite; alone:
#
#   pgelect-py/test.sh                 # build, install, pytest
#   pgelect-py/test.sh -k fence        # anything after goes to pytest
#   pgelect-py/test.sh --build-only    # the virtualenv and the wheel, no tests
#   pgelect-py/test.sh --no-build      # the tests of the wheel installed last
#
# scripts/test.sh builds the wheel (--build-only) before the Rust suite and
# runs the tests (--no-build) after it.
#
# Everything lives under target/: the virtualenv (target/py-venv, with the
# pinned tools of pgelect-py/requirements-dev.txt and
# examples/python/requirements.txt), the wheel (target/wheels). The wheel
# is a debug build: it builds in about half the time of a release build,
# and the tests exercise the library, not its speed. It is an abi3 wheel
# (cp39-abi3): one file for CPython 3.9 and every later version.
set -euo pipefail
cd "$(dirname "$0")/.."

phase=all
case "${1:-}" in
  --build-only) phase=build; shift ;;
  --no-build) phase=test; shift ;;
esac

venv=target/py-venv
run_tests() {
  # From outside the source tree, so that the installed wheel is what runs.
  # Never a silent hang: a test still running after 5 minutes has every
  # thread's stack dumped (pytest's faulthandler), and the whole run is
  # ended after 20 (about a minute is usual).
  timeout -k 10 1200 "$venv/bin/python" -m pytest -p no:cacheprovider --rootdir pgelect-py/tests -q \
    -o faulthandler_timeout=300 pgelect-py/tests examples/python "$@"
}
if [ "$phase" = test ]; then
  if ! "$venv/bin/python" -c 'import pgelect' 2>/dev/null; then
    echo "pgelect-py/test.sh: no wheel installed in $venv: run pgelect-py/test.sh --build-only first" >&2
    exit 69
  fi
  run_tests "$@"
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" || {
    echo "pgelect-py/test.sh: cannot create a virtualenv: install python3-venv (apt-get install python3-venv)" >&2
    exit 69
  }
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -r pgelect-py/requirements-dev.txt -r examples/python/requirements.txt

# With the workspace's features, as scripts/test.sh built it: the same
# artefact, not a second build of the kit and its dependencies.
cargo build --quiet --workspace --features pgelect/sqlx,pgelect-cli/throwaway --bin pgelect-throwaway
rm -f target/wheels/pgelect-*.whl
# In the workspace's target folder: after scripts/test.sh's build, only
# the few crates whose features differ when the binding is built alone
# (pgelect without sqlx, tokio's and tokio-postgres's feature sets) and the
# extension itself are compiled, about a minute on two cores, where a
# folder of its own rebuilt every dependency (four to seven minutes).
"$venv/bin/maturin" build --quiet -m pgelect-py/Cargo.toml -o target/wheels
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps target/wheels/pgelect-*.whl

[ "$phase" = build ] && exit 0
run_tests "$@"
