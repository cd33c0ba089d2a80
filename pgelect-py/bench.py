"""Measures the Python layer next to the Rust library, in one run, on a
throwaway PostgreSQL (the test kit's pgelect-throwaway):

* crash failover (session backend, ttl 2 s): a leader process SIGKILLed,
  until a standby's ``acquire`` returns in Python;
* voluntary handoff: ``lead.resign()`` until the standby's ``acquire``
  returns (Python) — next to the same through the Rust library
  (``pgelect-bench failover --series voluntary,crash-standard-2s``, same
  server, same run) when ``--rust`` is given;
* a fenced write's overhead: a psycopg transaction with ``lead.fence`` and
  one INSERT, against the same without the fence.

    target/py-venv/bin/python pgelect-py/bench.py [--trials N] [--rust]

Figures from a loaded or idle machine differ a lot: say which.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg

import pgelect

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "pgelect-py" / "tests" / "_child.py"


def ms(xs: list) -> str:
    xs = sorted(xs)
    p = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return f"median {1000 * statistics.median(xs):8.1f} ms  p90 {1000 * p(0.9):8.1f} ms  (n={len(xs)})"


def wait_standing(url: str, role: str, node: str) -> None:
    """Until the standby is registered and waits in the role's lock queue."""
    with psycopg.connect(url, autocommit=True) as c:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reg = c.execute("SELECT count(*) FROM pgelect.candidates WHERE role = %s AND node = %s", (role, node)).fetchone()[0]
            waiting = c.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()[0]
            if reg and waiting:
                return
            time.sleep(0.01)
    raise RuntimeError("the standby did not reach its lock wait")


def crash_failover(url: str) -> float:
    role = f"bench-{uuid.uuid4().hex[:8]}"
    leader = subprocess.Popen([sys.executable, str(CHILD), "lead", url, role, "session", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert leader.stdout is not None
    leader.stdout.readline()
    standby = pgelect.Elector(url, role, ttl=2)
    got = {}

    def stand() -> None:
        lead = standby.acquire(timeout=30)
        got["at"] = time.monotonic()
        lead.resign()

    t = threading.Thread(target=stand)
    t.start()
    wait_standing(url, role, standby.node_id)
    killed = time.monotonic()
    leader.send_signal(signal.SIGKILL)
    t.join(30)
    leader.wait(10)
    standby.close()
    return got["at"] - killed


def handoff(url: str) -> float:
    role = f"bench-{uuid.uuid4().hex[:8]}"
    a, b = pgelect.Elector(url, role), pgelect.Elector(url, role)
    lead = a.acquire(timeout=30)
    got = {}

    def stand() -> None:
        lb = b.acquire(timeout=30)
        got["at"] = time.monotonic()
        lb.resign()

    t = threading.Thread(target=stand)
    t.start()
    wait_standing(url, role, b.node_id)
    resigned = time.monotonic()
    lead.resign()
    t.join(30)
    a.close()
    b.close()
    return got["at"] - resigned


def fence_overhead(url: str, n: int) -> tuple:
    role = f"bench-{uuid.uuid4().hex[:8]}"
    table = "bench_" + uuid.uuid4().hex[:8]
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (v int)")
    e = pgelect.Elector(url, role)
    lead = e.acquire(timeout=30)
    plain, fenced = [], []
    with psycopg.connect(url) as conn:
        for i in range(n):
            for kind, out in (("plain", plain), ("fenced", fenced)):
                t0 = time.perf_counter()
                with conn.transaction():
                    if kind == "fenced":
                        lead.fence(conn)
                    conn.execute(f"INSERT INTO {table} VALUES (%s)", (i,))
                out.append(time.perf_counter() - t0)
    lead.resign()
    e.close()
    return plain, fenced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--writes", type=int, default=500)
    ap.add_argument("--rust", action="store_true")
    args = ap.parse_args()
    server = subprocess.Popen([str(ROOT / "target/debug/pgelect-throwaway")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    url = json.loads(server.stdout.readline())["url"]
    pgelect.migrate(url)
    try:
        print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print("python  crash failover (session, ttl 2 s):", ms([crash_failover(url) for _ in range(args.trials)]))
        print("python  voluntary handoff (resign):       ", ms([handoff(url) for _ in range(args.trials)]))
        plain, fenced = fence_overhead(url, args.writes)
        print("python  transaction, one INSERT:          ", ms(plain))
        print("python  same, fenced:                     ", ms(fenced))
        print(f"python  fence overhead (median):           {1000 * (statistics.median(fenced) - statistics.median(plain)):8.2f} ms")
        if args.rust:
            bench = ROOT / "target/debug/pgelect-bench"
            env = {**os.environ, "PGELECT_BENCH_DATABASE_URL": url}
            subprocess.run([str(bench), "failover", "--series", "crash-standard-2s,voluntary", "--trials", str(args.trials)], env=env, check=False)
        print(f"load average at end: {os.getloadavg()[0]:.1f}")
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(60)


if __name__ == "__main__":
    main()
