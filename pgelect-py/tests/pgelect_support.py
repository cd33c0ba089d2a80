"""Fixtures and helpers of the Python tests and the examples' tests: a
throwaway PostgreSQL and a PgBouncer (transaction mode) in front of it, from the test kit's `pgelect-throwaway` (the servers the Rust
tests use, started the same way; as an unprivileged user when run as root),
with pgelect's schema installed. `scripts/test.sh` builds it and the wheel.

PGELECT_THROWAWAY names the binary (default: target/debug/pgelect-throwaway).
"""

from __future__ import annotations

import _thread
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

import pgelect

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def servers() -> Iterator[Dict[str, Optional[str]]]:
    binary = os.environ.get("PGELECT_THROWAWAY") or str(ROOT / "target" / "debug" / "pgelect-throwaway")
    if not Path(binary).exists():
        pytest.fail(f"{binary} is missing: build it with `cargo build -p pgelect-testkit --bin pgelect-throwaway`")
    proc = subprocess.Popen([binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        pytest.fail(f"pgelect-throwaway did not start (exit status {proc.returncode}); see its stderr above")
    info = json.loads(line)
    pgelect.migrate(info["url"])
    try:
        yield info
    finally:
        proc.stdin.close()
        proc.wait(60)


@pytest.fixture
def url(servers: Dict[str, Optional[str]]) -> str:
    u = servers["url"]
    assert u is not None
    return u


@pytest.fixture
def bouncer_url(servers: Dict[str, Optional[str]]) -> str:
    u = servers["bouncer_url"]
    if u is None:
        pytest.skip("pgbouncer is not installed (scripts/setup.sh installs it)")
    return u


@pytest.fixture
def role() -> str:
    return f"py-{uuid.uuid4().hex[:12]}"


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + database))


def with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def eventually(check: Callable[[], bool], what: str, within: float = 10.0) -> float:
    """Polls `check` (a database state, which nothing notifies us of) until
    it holds; returns how long that took."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > within:
            raise AssertionError(f"{what}: not within {within} s")
        time.sleep(0.02)
    return time.monotonic() - start


def child(*args: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """A Python child running tests/_child.py (a leader to kill or pause)."""
    return subprocess.Popen(
        [sys.executable, str(HERE / "_child.py"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def connect(url: str, **kw: object) -> psycopg.Connection:
    return psycopg.connect(url, **kw)  # type: ignore[arg-type]


class CtrlC:
    """Ctrl-C for the main thread, as the terminal sends it: the first after
    ``after`` seconds, then again every ``every`` seconds until ``caught()``.
    Once, in a loaded CI run, a single interrupt was never raised in the
    waiting main thread and the test waited for ever; the repeats bound
    that. Use as a context manager around the wait that is to be
    interrupted; call ``caught()`` as soon as the KeyboardInterrupt is in."""

    def __init__(self, after: float = 0.3, every: float = 2.0) -> None:
        self._after, self._every = after, every
        self._caught = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if self._caught.wait(self._after):
            return
        while not self._caught.is_set():
            self.sent += 1
            _thread.interrupt_main()
            self._caught.wait(self._every)

    def caught(self) -> None:
        self._caught.set()

    def __enter__(self) -> "CtrlC":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._caught.set()
        self._thread.join()
