"""The examples' tests use the Python package's fixtures (a throwaway
PostgreSQL from the test kit, with pgelect's schema installed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pgelect-py" / "tests"))

from pgelect_support import servers, url  # noqa: E402,F401
