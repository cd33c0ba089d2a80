"""The examples' tests use the Python package's fixtures (a throwaway
PostgreSQL from the test kit, with pgelect's schema installed)."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "pgelect-py" / "tests" / "conftest.py"
_spec = importlib.util.spec_from_file_location("pgelect_py_fixtures", _path)
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

servers = _fixtures.servers
url = _fixtures.url
