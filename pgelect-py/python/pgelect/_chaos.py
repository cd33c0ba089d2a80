"""The Python candidate of ``pgelect chaos --python PYTHON``:
``PYTHON -m pgelect._chaos ...``, started by the command in place of a
``pgelect run`` supervisor and its ``chaos-worker``.

One process is both: an :class:`~pgelect.Elector` of this package (the Rust
library underneath) stands for the role, and while it leads the process
ticks every 5 ms and makes a fenced write every tenth tick
(``lead.fence(conn)`` in a psycopg transaction), logging each in the
worker's format, ``WHAT NODE TERM AT_NS PID`` (``start``, ``tick``,
``write:SEQ:ok|refused|failed``, ``stop``). The command's checker reads
these logs and the committed rows exactly as it reads the Rust workers':
the same independent judgement of overlaps, stale and lost writes.

It stops acting the moment its leadership is lost (``lead.lost``: the
library's local deadline, a lost connection, a preemption) and stands
again; on SIGTERM it logs ``stop``, resigns and exits 0. Nothing is logged
once the leadership is known lost, not even the outcome of a write that was
in flight: a ``pgelect run`` supervisor kills its worker at that moment, and
the checker counts every line as acting. Such a write is judged by the
table alone (the fence). Not a public interface: its arguments follow the
command.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import psycopg

import pgelect
from pgelect import errors

TICK = 0.005
WRITE_EVERY = 10


class _Stop(BaseException):
    """SIGTERM: stop acting, resign, exit."""


def _on_term(signum: int, frame: object) -> None:
    raise _Stop()


def _read_url(path: str) -> str:
    return Path(path).read_text().strip()


class _Log:
    """The worker's log: one ``write`` per line on an ``O_APPEND`` file, so
    that lines never interleave."""

    def __init__(self, path: str, node: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._node = node
        self._pid = os.getpid()

    def line(self, what: str, term: int) -> None:
        os.write(self._fd, f"{what} {self._node} {term} {time.time_ns()} {self._pid}\n".encode())


def _connect(url: str) -> Optional[psycopg.Connection]:
    try:
        # No prepared statements: through PgBouncer in transaction mode a
        # prepared statement would outlive its server connection.
        return psycopg.connect(url, connect_timeout=1, prepare_threshold=None)
    except psycopg.Error:
        return None


def _refused(e: BaseException) -> bool:
    """Whether the server decided about the transaction (the fence: stale
    term, no holder; or anything else it refused) rather than the
    connection failing (class 08, also what PgBouncer sends when it cannot
    serve) or the server shutting down (57)."""
    if isinstance(e, errors.LeadershipLostError):
        # The fence: a stale term or no holder (or known lost here).
        return True
    state = getattr(e, "sqlstate", None)
    return bool(state) and not state.startswith(("08", "57"))


def _lead(args: argparse.Namespace, lead: pgelect.Leadership, log: _Log, url: str) -> None:
    """Acts while ``lead`` lasts: ticks and fenced writes, each logged only
    while the leadership is not known lost."""
    term = lead.term

    def act(what: str) -> None:
        if not lead.is_lost:
            log.line(what, term)

    act("start")
    insert = f"INSERT INTO {args.table} (role, node, term, seq) VALUES (%s, %s, %s, %s)"
    idle = (
        f"SET LOCAL idle_in_transaction_session_timeout = {args.idle_in_transaction_ms}"
        if args.idle_in_transaction_ms > 0
        else None
    )
    conn = _connect(url)
    n = seq = 0
    try:
        while not lead.lost.wait(TICK):
            act("tick")
            n += 1
            if n % WRITE_EVERY:
                continue
            seq += 1
            if conn is None or conn.closed or conn.broken:
                conn = _connect(url)
                if conn is None:
                    act(f"write:{seq}:failed")
                    continue
            try:
                with conn.transaction():
                    if idle:
                        conn.execute(idle)
                    lead.fence(conn)
                    conn.execute(insert, (args.role, args.node, term, seq))
                act(f"write:{seq}:ok")
            except (psycopg.Error, errors.PgelectError) as e:
                act(f"write:{seq}:{'refused' if _refused(e) else 'failed'}")
    except _Stop:
        act("stop")
        raise
    finally:
        if conn is not None:
            conn.close()


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pgelect._chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url-file", required=True, help="the elector's database URL, in a private file")
    ap.add_argument("--worker-url-file", required=True, help="the fenced writes' URL")
    ap.add_argument("--listen-url-file", help="a direct URL for the lease backend's LISTEN connection")
    ap.add_argument("--role", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--backend", choices=["session", "lease"], required=True)
    ap.add_argument("--profile", choices=["standard", "fast"], default="standard")
    ap.add_argument("--ttl-ms", type=int, required=True)
    ap.add_argument("--schema", default="pgelect")
    ap.add_argument("--table", required=True)
    ap.add_argument("--idle-in-transaction-ms", type=int, default=0)
    ap.add_argument("--log", required=True)
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, _on_term)
    log = _Log(args.log, args.node)
    elector = pgelect.Elector(
        _read_url(args.url_file),
        args.role,
        backend=args.backend,
        ttl=args.ttl_ms / 1000,
        node_id=args.node,
        # The profile is a session-backend option (the binding refuses it
        # for the lease backend, as the library does).
        profile=args.profile if args.backend == "session" else None,
        schema=args.schema,
        listen_url=_read_url(args.listen_url_file) if args.listen_url_file else None,
    )
    worker_url = _read_url(args.worker_url_file)
    try:
        while True:
            try:
                lead = elector.acquire()
            except errors.ConfigurationError:
                raise
            except errors.PgelectError as e:
                # The server or the pooler is restarting: stand again.
                print(f"pgelect._chaos: {e}", file=sys.stderr, flush=True)
                time.sleep(0.1)
                continue
            try:
                _lead(args, lead, log, worker_url)
            except _Stop:
                lead.resign()
                raise
            print(f"pgelect._chaos: leadership of term {lead.term} lost: {lead.loss_reason}", file=sys.stderr, flush=True)
    except _Stop:
        elector.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
