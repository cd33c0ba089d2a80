"""What the Python layer costs, next to the Rust library, in one run on one
throwaway PostgreSQL (the test kit's ``pgelect-throwaway``):

* voluntary handoff: ``lead.resign()`` in one thread until the standby's
  ``acquire()`` returns in another (Python), against
  ``pgelect-bench failover --series voluntary`` (the same two electors,
  library defaults, role and node names, in one Rust process: from the
  ``resign()`` call until the standby's ``leadership()`` returns);
* crash failover (session backend, standard profile, ttl 2 s): the same
  leader, a ``pgelect-bench failover --child leader`` process, is SIGKILLed
  in both series; the standby is a Python ``Elector`` (until ``acquire()``
  returns) or the Rust bench's own (``--series crash-standard-2s``);
* a fenced write: a psycopg transaction with ``lead.fence(conn)`` and one
  INSERT, against the same without the fence and against the same with a
  statement of the fence's shape that calls no function (one round trip).

The Python and the Rust trials run in blocks, alternately (``--blocks``),
so that drift in the machine's load hits both. For the handoff it also
measures the Python layer alone in every trial: from the moment the
library's campaign future returned (inside the extension) until
``acquire()`` has returned the ``Leadership`` to the Python thread.

    target/py-bench-venv/bin/python pgelect-py/bench.py [--trials N] [--blocks B]
        [--writes N] [--rust-bench PATH] [--json PATH]

It prints a table, then one JSON line (also written to ``--json PATH``).
Figures from a loaded machine differ a lot from an idle one's: the table
and the JSON give the load average at start and end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import psycopg

import pgelect
from pgelect import _calls

ROOT = Path(__file__).resolve().parents[1]
#: The Rust bench's role and node names (pgelect-bench/src/failover.rs),
#: used by the Python series too: the same rows, the same keys.
ROLE = "bench-failover"
TARGET_MS = 1.0


def stats(xs: List[float]) -> Dict[str, Any]:
    """Nearest-rank percentiles, as pgelect-bench computes them."""
    v = sorted(xs)

    def rank(p: float) -> float:
        return v[min(max(math.ceil(p / 100 * len(v)), 1), len(v)) - 1]

    return {"n": len(v), "p50": round(rank(50), 3), "p99": round(rank(99), 3), "min": round(v[0], 3), "max": round(v[-1], 3)}


def load() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def executable(flag: Optional[str], name: str) -> Path:
    """``flag``, else the release build, else the debug build of ``name``."""
    if flag:
        return Path(flag)
    for build in ("release", "debug"):
        p = ROOT / "target" / build / name
        if p.exists():
            return p
    raise SystemExit(f"bench.py: no target/release/{name} or target/debug/{name}: build it (cargo build --release -p ...)")


class Observer:
    """A connection that watches pg_locks, open for the whole run (a
    connection opened and closed per trial would end a backend on the
    server in the middle of the next handover)."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)

    def until_standing(self, node: str) -> None:
        """Until ``node`` is registered for ROLE and someone waits for an
        advisory lock (only the benchmark's candidates run on this server)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = self.conn.execute(
                "SELECT (SELECT count(*) FROM pgelect.candidates WHERE role = %s AND node = %s),"
                " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted)",
                (ROLE, node),
            ).fetchone()
            if row is not None and row[0] and row[1]:
                return
            time.sleep(0.002)
        raise RuntimeError(f"the standby {node} did not reach its lock wait within 30 s")


class Standby(threading.Thread):
    """``elector.acquire()`` in a thread of its own, timed: ``at`` when it
    returned, ``layer`` the seconds from the library's campaign future
    returning (in the extension) until then. It runs ``acquire``'s own
    code (``_elected(wait(leadership()))``) to keep the native call."""

    def __init__(self, elector: pgelect.Elector) -> None:
        super().__init__()
        self.elector = elector
        self.at = 0.0
        self.layer = 0.0
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            call = self.elector._native.leadership()
            lead = self.elector._elected(_calls.wait(call, 30.0, "the standby's election"))
            self.at = time.monotonic()
            self.layer = call.completed_ago() or 0.0
            lead.resign()
        except BaseException as e:  # reported by the trial
            self.error = e


def handoff_trial(url: str, obs: Observer) -> Dict[str, float]:
    a = pgelect.Elector(url, ROLE, node_id="bench-a")
    b = pgelect.Elector(url, ROLE, node_id="bench-b")
    try:
        lead = a.acquire(timeout=30)
        standby = Standby(b)
        standby.start()
        obs.until_standing("bench-b")
        t0 = time.monotonic()
        lead.resign()
        standby.join(60)
        if standby.error is not None:
            raise standby.error
        return {"ms": 1000 * (standby.at - t0), "layer_ms": 1000 * standby.layer}
    finally:
        a.close()
        b.close()


def crash_trial(url: str, obs: Observer, rust_bench: Path) -> Optional[float]:
    """One crash of the Rust bench's leader child; ``None`` if the leader
    had lost its leadership before the kill (the trial measures nothing)."""
    leader = subprocess.Popen(
        [str(rust_bench), "failover", "--child", "leader", url, "standard-2s"], stdout=subprocess.PIPE, text=True
    )
    standby_elector = pgelect.Elector(url, ROLE, profile="standard", ttl=2, node_id="bench-standby")
    try:
        assert leader.stdout is not None
        line = leader.stdout.readline()
        if not line.startswith("ELECTED"):
            raise RuntimeError(f"the leader child said {line!r}")
        standby = Standby(standby_elector)
        standby.start()
        obs.until_standing("bench-standby")
        killed = time.monotonic()
        leader.send_signal(signal.SIGKILL)
        standby.join(60)
        if standby.error is not None:
            raise standby.error
        rest = leader.stdout.read()
        leader.wait(10)
        if "LOST" in rest or standby.at < killed:
            return None
        return 1000 * (standby.at - killed)
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait(10)
        standby_elector.close()


def python_block(url: str, obs: Observer, rust_bench: Path, k: int, out: Dict[str, List[float]]) -> None:
    for _ in range(k):
        for _attempt in range(k + 1):
            ms = crash_trial(url, obs, rust_bench)
            if ms is not None:
                out["crash"].append(ms)
                break
            out["crash_discarded"].append(1.0)
        else:
            raise RuntimeError("every crash trial of a block measured nothing (the leader lost its leadership first)")
        h = handoff_trial(url, obs)
        out["handoff"].append(h["ms"])
        out["layer"].append(h["layer_ms"])


def rust_block(url: str, rust_bench: Path, k: int, out: Dict[str, List[float]]) -> None:
    env = {**os.environ, "PGELECT_BENCH_DATABASE_URL": url}
    run = subprocess.run(
        [str(rust_bench), "failover", "--series", "crash-standard-2s,voluntary", "--trials", str(k), "--json"],
        env=env,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise RuntimeError(f"pgelect-bench failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    line = json.loads(run.stdout.strip().splitlines()[-1])
    out["crash"] += line["samples"]["failover/crash-standard-2s"]
    out["handoff"] += line["samples"]["failover/voluntary"]
    out["crash_discarded"] += [1.0] * line["crash"]["standard-2s"]["ms"]["discarded"]


def fence_overhead(url: str, n: int) -> Dict[str, Any]:
    """``n`` transactions of each kind, interleaved: plain (BEGIN, INSERT,
    COMMIT), probe (the same plus ``SELECT %s::text, %s::int8``: a round
    trip of the fence's shape that calls no function), fenced (the same
    with ``lead.fence(conn)``). Plus the server's own time per fence call
    (pg_stat_user_functions), when this role may set track_functions."""
    table = "bench_" + uuid.uuid4().hex[:8]
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (v int)")
    e = pgelect.Elector(url, f"bench-fence-{uuid.uuid4().hex[:8]}")
    lead = e.acquire(timeout=30)
    times: Dict[str, List[float]] = {"plain": [], "probe": [], "fenced": []}
    server_ms = None
    try:
        with psycopg.connect(url) as conn:
            try:
                conn.execute("SET track_functions = 'pl'")
                conn.commit()
                tracked = True
            except psycopg.Error:
                conn.rollback()
                tracked = False
            for i in range(n):
                for kind, out in times.items():
                    t0 = time.perf_counter()
                    with conn.transaction():
                        if kind == "fenced":
                            lead.fence(conn)
                        elif kind == "probe":
                            conn.execute("SELECT %s::text, %s::int8", (lead.role, lead.term), prepare=False)
                        conn.execute(f"INSERT INTO {table} VALUES (%s)", (i,))
                    out.append(1000 * (time.perf_counter() - t0))
            if tracked:
                conn.execute("SELECT pg_stat_force_next_flush()")
                conn.commit()
                conn.execute("SELECT 1")
                conn.commit()
                row = conn.execute(
                    "SELECT calls, self_time FROM pg_stat_user_functions WHERE schemaname = 'pgelect' AND funcname = 'fence'"
                ).fetchone()
                conn.commit()
                if row and row[0]:
                    server_ms = row[1] / row[0]
    finally:
        lead.resign()
        e.close()
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f"DROP TABLE {table}")
    s = {k: stats(v) for k, v in times.items()}
    return {
        "ms": s,
        "overhead_p50_ms": round(s["fenced"]["p50"] - s["plain"]["p50"], 3),
        "round_trip_p50_ms": round(s["probe"]["p50"] - s["plain"]["p50"], 3),
        "server_fence_call_ms": None if server_ms is None else round(server_ms, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=30, help="trials of each series and language (default 30)")
    ap.add_argument("--blocks", type=int, default=3, help="alternate Python and Rust in this many blocks (default 3)")
    ap.add_argument("--writes", type=int, default=500, help="transactions of each kind for the fence (default 500)")
    ap.add_argument("--rust-bench", help="the pgelect-bench binary (default: target/release, else target/debug)")
    ap.add_argument("--json", help="also write the JSON line to this file")
    args = ap.parse_args()
    if args.trials < 1 or args.blocks < 1 or args.writes < 1:
        raise SystemExit("bench.py: --trials, --blocks and --writes must be at least 1")
    rust_bench = executable(args.rust_bench, "pgelect-bench")
    throwaway = executable(None, "pgelect-throwaway")
    blocks = min(args.blocks, args.trials)
    sizes = [args.trials // blocks + (1 if i < args.trials % blocks else 0) for i in range(blocks)]

    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = load()
    server = subprocess.Popen([str(throwaway)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = json.loads(server.stdout.readline())["url"]
        pgelect.migrate(url)
        obs = Observer(url)
        py: Dict[str, List[float]] = {"crash": [], "crash_discarded": [], "handoff": [], "layer": []}
        rs: Dict[str, List[float]] = {"crash": [], "crash_discarded": [], "handoff": []}
        for i, k in enumerate(sizes):
            # Alternate which language goes first.
            if i % 2 == 0:
                python_block(url, obs, rust_bench, k, py)
                rust_block(url, rust_bench, k, rs)
            else:
                rust_block(url, rust_bench, k, rs)
                python_block(url, obs, rust_bench, k, py)
            print(f"bench.py: block {i + 1} of {blocks} done", file=sys.stderr)
        fence = fence_overhead(url, args.writes)
        obs.conn.close()
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(60)
    load_end = load()

    series = {}
    for name, key in (("handoff", "handoff"), ("crash_standard_2s", "crash")):
        p, r = stats(py[key]), stats(rs[key])
        series[name] = {
            "python_ms": {**p, "discarded": len(py.get(key + "_discarded", []))},
            "rust_ms": {**r, "discarded": len(rs.get(key + "_discarded", []))},
            "diff_p50_ms": round(p["p50"] - r["p50"], 3),
            "diff_p99_ms": round(p["p99"] - r["p99"], 3),
        }
    handoff = series["handoff"]
    handoff["python_layer_ms"] = stats(py["layer"])
    handoff["target_ms"] = TARGET_MS
    handoff["target_met"] = handoff["diff_p50_ms"] <= TARGET_MS
    result = {
        "bench": "python",
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average": {"start": load_start, "end": load_end},
        "trials": args.trials,
        "blocks": blocks,
        "rust_bench": str(rust_bench.relative_to(ROOT) if rust_bench.is_relative_to(ROOT) else rust_bench),
        "series": series,
        "fence": fence,
    }

    def row(label: str, s: Dict[str, Any]) -> str:
        return f"  {label:<34}{s['n']:>5}{s['p50']:>10.2f}{s['p99']:>10.2f}{s['min']:>10.2f}{s['max']:>10.2f}"

    print(f"pgelect Python layer vs Rust library, {result['date']}, commit {result['commit']}")
    print(
        f"{os.cpu_count()} cores, load average {' '.join(map(str, load_start))} at start, "
        f"{' '.join(map(str, load_end))} at end; {args.trials} trials per series in {blocks} alternating blocks; "
        f"Rust: {result['rust_bench']}"
    )
    print()
    print(f"  {'(ms)':<34}{'n':>5}{'p50':>10}{'p99':>10}{'min':>10}{'max':>10}")
    print("voluntary handoff (resign until the standby's acquire returns)")
    print(row("python", handoff["python_ms"]))
    print(row("rust", handoff["rust_ms"]))
    print(row("python layer (done -> returned)", handoff["python_layer_ms"]))
    print(
        f"  python - rust: p50 {handoff['diff_p50_ms']:+.2f} ms, p99 {handoff['diff_p99_ms']:+.2f} ms; "
        f"target p50 <= {TARGET_MS} ms: {'met' if handoff['target_met'] else 'NOT met'}"
    )
    crash = series["crash_standard_2s"]
    print("crash failover (session, standard, ttl 2 s; the same Rust leader child SIGKILLed)")
    print(row("python", crash["python_ms"]))
    print(row("rust", crash["rust_ms"]))
    print(f"  python - rust: p50 {crash['diff_p50_ms']:+.2f} ms, p99 {crash['diff_p99_ms']:+.2f} ms")
    print("psycopg transaction with one INSERT")
    print(row("plain", fence["ms"]["plain"]))
    print(row("+ a round trip (SELECT of 2 params)", fence["ms"]["probe"]))
    print(row("+ lead.fence(conn)", fence["ms"]["fenced"]))
    server_call = fence["server_fence_call_ms"]
    print(
        f"  fence overhead p50 {fence['overhead_p50_ms']:.2f} ms, of which a round trip {fence['round_trip_p50_ms']:.2f} ms; "
        f"the server's time in pgelect.fence(): {'not measured' if server_call is None else f'{server_call:.3f} ms a call'}"
    )
    print()
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
