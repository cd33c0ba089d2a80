"""CI run of the Django example: a writer paused long enough to be
replaced cannot commit a fenced write after its successor began."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg

import pgelect

HERE = Path(__file__).resolve().parent


def manage(url: str, *args: str, **kw: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / "manage.py"), *args],
        cwd=HERE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "DATABASE_URL": url, "PYTHONUNBUFFERED": "1"},
        **kw,  # type: ignore[arg-type]
    )


def test_a_replaced_writer_cannot_commit(url: str) -> None:
    assert manage(url, "migrate", "--verbosity", "0").wait(120) == 0
    writer = manage(url, "post_entries", "--count", "100000", "--every", "0.05", "--ttl", "2")
    assert writer.stdout is not None
    try:
        first = writer.stdout.readline()
        assert first.startswith("elected term "), first
        old_term = int(first.split()[2])
        assert writer.stdout.readline().startswith("wrote 0")
        writer.send_signal(signal.SIGSTOP)  # paused: a GC pause, a frozen VM
        successor = pgelect.Elector(url, "ledger-writer", backend="lease", ttl=2)
        lead = successor.acquire(timeout=30)
        assert lead.term > old_term
        with psycopg.connect(url) as conn, conn.transaction():
            lead.fence(conn)
            new_first = conn.execute(
                "INSERT INTO ledger_entry (term, n) VALUES (%s, -1) RETURNING id", (lead.term,)
            ).fetchone()[0]
        writer.send_signal(signal.SIGCONT)
        rest = writer.stdout.read()
        assert writer.wait(30) == 0
        last = rest.strip().splitlines()[-1]
        # Stopped by the fence (server or local deadline) or by its loss signal.
        assert last.startswith(("refused StaleTermError", "refused LeadershipLostError", "refused NoLeaderError", "lost ")), rest
        with psycopg.connect(url) as conn:
            late = conn.execute(
                "SELECT count(*) FROM ledger_entry WHERE term = %s AND id > %s", (old_term, new_first)
            ).fetchone()[0]
        assert late == 0, "the replaced writer committed after its successor began"
        print(f"replaced writer stopped with: {last}")
        lead.resign()
        successor.close()
    finally:
        if writer.poll() is None:
            writer.send_signal(signal.SIGCONT)
            writer.kill()
            writer.wait(10)
