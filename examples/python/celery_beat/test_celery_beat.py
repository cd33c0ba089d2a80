"""CI run of the Celery example: two replicas, then a rolling restart of
both; at every moment at most one of them sends, terms only rise,
and the schedule goes on across the restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent


class Replica:
    def __init__(self, name: str, url: str, broker: Path, events: List[Tuple[float, str, int]]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "leader_beat.py"), name],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "DATABASE_URL": url, "BROKER_DIR": str(broker), "TTL": "4"},
        )
        self.sent = threading.Condition()
        self.count = 0
        self.lines: List[str] = []
        self.reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self.reader.start()

    def _read(self, events: List[Tuple[float, str, int]]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith("sent "):
                _, at, name, term = line.split()
                with self.sent:
                    events.append((float(at), name, int(term)))
                    self.count += 1
                    self.sent.notify_all()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0, self.lines
        self.reader.join(10)


def wait_for_sends(replicas: List[Replica], events: List[Tuple[float, str, int]], more: int) -> None:
    """Waits until `more` sends beyond those seen so far were printed."""
    target = len(events) + more
    done = threading.Event()

    def watch(r: Replica) -> None:
        with r.sent:
            while len(events) < target and not done.is_set():
                r.sent.wait(0.2)
        done.set()

    threads = [threading.Thread(target=watch, args=(r,), daemon=True) for r in replicas]
    for t in threads:
        t.start()
    assert done.wait(60), f"no {more} more sends; replicas said: {[r.lines for r in replicas]}"


def test_beat_runs_on_the_leader_only_across_a_rolling_restart(url: str, tmp_path: Path) -> None:
    events: List[Tuple[float, str, int]] = []
    broker = tmp_path / "broker"
    replicas = [Replica(f"r{i}", url, broker, events) for i in (1, 2)]
    try:
        wait_for_sends(replicas, events, 2)
        for i in (1, 2):
            old = replicas[i - 1]
            old.stop()
            replicas[i - 1] = Replica(f"r{i}b", url, broker, events)
            wait_for_sends(replicas, events, 2)
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                r.stop()
    events.sort()
    by_term: Dict[int, set] = {}
    for _, name, term in events:
        by_term.setdefault(term, set()).add(name)
    # One sender per term, terms only rise in time: never two beats at once.
    assert all(len(names) == 1 for names in by_term.values()), by_term
    terms = [term for _, _, term in events]
    assert terms == sorted(terms), terms
    # The rolling restart restarted the leader at least once: handed over.
    assert len(by_term) >= 2, by_term
    # Every send reached the broker.
    assert len(list(broker.glob("*.celery.msg"))) == len(events)
    print(f"{len(events)} sends by {len(by_term)} leaders in turn: {sorted(by_term.items())}")
