"""Election, failover and fencing from Python, on both backends."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import psycopg
import pytest

import pgelect
from pgelect_support import child, connect, eventually

BACKENDS = ["session", "lease"]


def backend_url(request: pytest.FixtureRequest, backend: str) -> str:
    # The lease backend is the one for PgBouncer in transaction mode.
    fixture = "bouncer_url" if backend == "lease" else "url"
    return request.getfixturevalue(fixture)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_leader_and_failover_after_a_crash(request: pytest.FixtureRequest, backend: str, role: str) -> None:
    url = backend_url(request, backend)
    leader = child("lead", url, role, backend, "2")
    try:
        assert leader.stdout is not None
        line = leader.stdout.readline().split()
        assert line[0] == "term", line
        first = int(line[1])
        standby = pgelect.Elector(url, role, backend=backend, ttl=2)
        # While the leader lives, the standby is not elected.
        with pytest.raises(TimeoutError):
            standby.acquire(timeout=0.5)
        info = pgelect.admin.status(url, role)
        assert info is not None and info.term == first and not info.lease_expired
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        start = time.monotonic()
        with standby.leadership(timeout=15) as lead:
            took = time.monotonic() - start
            assert lead.term > first
            assert not lead.lost.is_set()
            print(f"{backend}: elected {took:.2f} s after the leader was killed (ttl 2 s, machine loaded)")
        standby.close()
    finally:
        leader.kill()
        leader.wait(10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resign_hands_over_at_once(request: pytest.FixtureRequest, backend: str, role: str) -> None:
    url = backend_url(request, backend)
    # Through PgBouncer, the lease standbys listen for the release on a
    # direct connection (as the library's listen_via).
    listen = request.getfixturevalue("url") if backend == "lease" else None
    a = pgelect.Elector(url, role, backend=backend, ttl=5, listen_url=listen)
    b = pgelect.Elector(url, role, backend=backend, ttl=5, listen_url=listen)
    lead_a = a.acquire(timeout=10)
    got = {}

    def standby() -> None:
        with b.leadership(timeout=20) as lead:
            got["term"] = lead.term
            got["at"] = time.monotonic()

    t = threading.Thread(target=standby)
    t.start()
    # b waits on the server: the leader's row shows a (nobody else).
    assert pgelect.admin.status(url, role).holder == a.node_id  # type: ignore[union-attr]
    # b stands: registered (lease) or waiting on the role's lock (session).
    with connect(url, autocommit=True) as conn:

        def standing() -> bool:
            row = conn.execute(
                "SELECT count(*) FROM pgelect.candidates WHERE role = %s AND node = %s", (role, b.node_id)
            ).fetchone()
            waiting = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()
            return row[0] == 1 and (backend == "lease" or waiting[0] >= 1)

        eventually(standing, "the standby stands")
    resigned = time.monotonic()
    lead_a.resign()
    assert lead_a.lost.is_set() and lead_a.loss_reason == "resigned"
    t.join(20)
    assert got["term"] > lead_a.term
    print(f"{backend}: handover {1000 * (got['at'] - resigned):.1f} ms after resign (machine loaded)")
    # A clean resign needs no TTL: well under the 5 s lease.
    assert got["at"] - resigned < 4.0
    a.close()
    b.close()


def test_async_leadership_and_lost(url: str, role: str) -> None:
    async def main() -> None:
        elector = pgelect.Elector(url, role)
        async with elector.leadership() as lead:
            assert lead.term > 0
            waiter = asyncio.ensure_future(_wait(lead))
            await asyncio.sleep(0)
            assert not waiter.done()
            # Another process asks the leader to step down.
            info = await pgelect.admin.resign_async(url, role)
            assert info is not None and info.term == lead.term
            await asyncio.wait_for(waiter, 10)
            assert lead.lost.is_set() and lead.loss_reason is not None
        elector.close()

    async def _wait(lead: pgelect.Leadership) -> None:
        await lead.lost

    asyncio.run(main())


def test_run_callbacks_and_shutdown(url: str, role: str) -> None:
    elector = pgelect.Elector(url, role)
    events = []
    elected = threading.Event()

    def on_elected(lead: pgelect.Leadership) -> None:
        events.append(("elected", lead.term))
        elected.set()
        assert lead.lost.wait(30), "shutdown did not set lead.lost"
        events.append(("lost", lead.lost.reason))

    def on_demoted() -> None:
        events.append(("demoted",))

    t = threading.Thread(target=elector.run, args=(on_elected, on_demoted))
    t.start()
    assert elected.wait(15)
    elector.shutdown()
    t.join(15)
    assert not t.is_alive()
    assert [e[0] for e in events] == ["elected", "lost", "demoted"], events
    assert events[1][1] == "shutdown"
    # Released cleanly: nobody holds the role now.
    info = pgelect.admin.status(url, role)
    assert info is None or info.holder is None or info.lease_expired, info
    elector.close()


def test_fence_passes_for_the_leader_and_refuses_a_stale_term(url: str, role: str) -> None:
    table = "fenced_" + role.replace("-", "_")
    with connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (v text)")
    elector = pgelect.Elector(url, role, backend="lease", ttl=10)
    lead = elector.acquire(timeout=10)
    with connect(url) as conn:
        with conn.transaction():
            lead.fence(conn)
            conn.execute(f"INSERT INTO {table} VALUES ('leader')")
        # A takeover this process has not heard of yet (as after a pause):
        # the term moves on the server.
        with connect(url, autocommit=True) as admin:
            admin.execute("UPDATE pgelect.leaders SET term = term + 1 WHERE role = %s", (role,))
        with pytest.raises(pgelect.StaleTermError) as refused:
            with conn.transaction():
                lead.fence(conn)
                conn.execute(f"INSERT INTO {table} VALUES ('stale')")
        assert refused.value.sqlstate == "PE001"
        assert f"stale fencing term for role {role}" in str(refused.value), str(refused.value)
        assert isinstance(refused.value.__cause__, psycopg.Error)
        rows = conn.execute(f"SELECT v FROM {table}").fetchall()
        assert rows == [("leader",)]
    elector.close()


def test_fenced_write_of_a_paused_leader_is_refused_after_a_takeover(bouncer_url: str, url: str, role: str) -> None:
    table = "paused_" + role.replace("-", "_")
    with connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (v text)")
    leader = child("lead", bouncer_url, role, "lease", "2")
    try:
        assert leader.stdout is not None and leader.stdin is not None
        first = int(leader.stdout.readline().split()[1])
        leader.send_signal(signal.SIGSTOP)  # a long GC pause, a frozen VM
        standby = pgelect.Elector(bouncer_url, role, backend="lease", ttl=2)
        lead = standby.acquire(timeout=20)
        assert lead.term > first
        with connect(bouncer_url) as conn, conn.transaction():
            lead.fence(conn)
            conn.execute(f"INSERT INTO {table} VALUES ('new leader')")
        leader.send_signal(signal.SIGCONT)
        leader.stdin.write(f"fence {table} old-leader\n")
        leader.stdin.flush()
        outcome = leader.stdout.readline().strip()
        # Refused: by the server (StaleTermError) or, if its deadline
        # watchdog ran first, locally (LeadershipLostError).
        assert outcome in ("StaleTermError", "LeadershipLostError", "NoLeaderError"), outcome
        with connect(url) as conn:
            assert conn.execute(f"SELECT v FROM {table}").fetchall() == [("new leader",)]
        lead.resign()
        standby.close()
    finally:
        leader.kill()
        leader.wait(10)


def test_fence_outside_a_transaction_is_refused(url: str, role: str) -> None:
    elector = pgelect.Elector(url, role)
    with elector.leadership(timeout=10) as lead:
        with connect(url, autocommit=True) as conn:
            with pytest.raises(pgelect.ConfigurationError, match="outside a transaction"):
                lead.fence(conn)
    # After resign the fence refuses without a statement.
    with connect(url) as conn:
        with pytest.raises(pgelect.LeadershipLostError, match="has ended"):
            lead.fence(conn)
    elector.close()


def test_async_fence(url: str, role: str) -> None:
    async def main() -> None:
        elector = pgelect.Elector(url, role)
        async with elector.leadership() as lead:
            async with await psycopg.AsyncConnection.connect(url) as conn:
                async with conn.transaction():
                    await lead.fence(conn)
        elector.close()

    asyncio.run(main())


def test_observed_status_names_the_leader(url: str, role: str) -> None:
    assert pgelect.admin.status(url, role) is None
    elector = pgelect.Elector(url, role, meta={"host": "py"})
    with elector.leadership(timeout=10) as lead:
        info = pgelect.admin.status(url, role)
        assert info is not None
        assert (info.role, info.term, info.holder) == (role, lead.term, elector.node_id)
        assert info.holder_meta == {"host": "py"}
        assert info.backend == "session"
    elector.close()


def test_timing_is_the_library_s(url: str, role: str) -> None:
    elector = pgelect.Elector(url, role, ttl=4)
    assert elector.timing["ttl_ms"] == 4000
    elector.close()


def test_a_call_tells_how_long_ago_it_completed(url: str, role: str) -> None:
    # What bench.py measures the Python layer from: unset while the
    # campaign runs, then the time since the library's future returned.
    a, b = pgelect.Elector(url, role), pgelect.Elector(url, role)
    lead = a.acquire(timeout=10)
    call = b._native.leadership()
    assert not call.wait(0.2)
    assert call.completed_ago() is None
    lead.resign()
    assert call.wait(10)
    first = call.completed_ago()
    assert first is not None and 0 <= first < 5
    time.sleep(0.01)
    later = call.completed_ago()
    assert later is not None and later >= first + 0.01
    call.result().resign().wait(10)
    a.close()
    b.close()
