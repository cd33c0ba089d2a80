"""Bad input, cancellation (Ctrl-C, a cancelled task) and fork."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import pytest

import pgelect
from pgelect_support import CtrlC, connect, eventually, with_database, with_user


# ---- bad input: the library's own clear errors ------------------------------


def test_wrong_url_port_and_password(url: str, role: str) -> None:
    with pytest.raises(pgelect.ConnectionError, match="could not connect to 127.0.0.1:1/") as e:
        pgelect.migrate("postgres://app:secret@127.0.0.1:1/app", connect_timeout=5)
    assert "secret" not in str(e.value)
    with pytest.raises(pgelect.AuthenticationError, match="authentication failed") as e:
        pgelect.Elector(with_user(url, "postgres", "wrong-password"), role).acquire(timeout=20)
    assert "wrong-password" not in str(e.value)
    assert e.value.sqlstate == "28P01"
    with pytest.raises(pgelect.ConfigurationError, match="cannot be parsed"):
        pgelect.Elector("postgres://[", role)


def test_missing_schema(url: str, role: str) -> None:
    name = "noschema_" + uuid.uuid4().hex[:8]
    with connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    bare = with_database(url, name)
    with pytest.raises(pgelect.SchemaError, match=r"not installed in this database: run `pgelect migrate`"):
        pgelect.Elector(bare, role).acquire(timeout=20)
    with pytest.raises(pgelect.SchemaError):
        pgelect.admin.status(bare, role)


def test_missing_grant(url: str, role: str) -> None:
    user = "nogrant_" + uuid.uuid4().hex[:8]
    with connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {user} LOGIN PASSWORD 'pw-{user}'")
    with pytest.raises(pgelect.PermissionDenied, match="permission denied") as e:
        pgelect.Elector(with_user(url, user, f"pw-{user}"), role).acquire(timeout=20)
    assert isinstance(e.value, PermissionError)
    assert e.value.sqlstate == "42501"


def test_ttl_that_breaks_the_timing_inequality(url: str, role: str) -> None:
    with pytest.raises(pgelect.ConfigurationError, match="renew_every 5s must be shorter than ttl 2s"):
        pgelect.Elector(url, role, ttl=2, renew_every=5)
    with pytest.raises(pgelect.ConfigurationError, match="ttl must be a finite, non-negative"):
        pgelect.Elector(url, role, ttl=-1)
    with pytest.raises(pgelect.ConfigurationError, match='backend must be "session" or "lease"'):
        pgelect.Elector(url, role, backend="etcd")
    with pytest.raises(pgelect.ConfigurationError, match="profile applies to the session backend only"):
        pgelect.Elector(url, role, backend="lease", profile="fast")
    with pytest.raises(pgelect.ConfigurationError, match="retry_every applies to the lease backend only"):
        pgelect.Elector(url, role, backend="session", retry_every=0.5)


def test_session_backend_through_a_transaction_pooler(bouncer_url: str, role: str) -> None:
    with pytest.raises(pgelect.PoolerError):
        pgelect.Elector(bouncer_url, role).acquire(timeout=20)


# ---- cancellation: nothing held, nothing left running ----------------------


def test_ctrl_c_while_waiting_for_a_lock(url: str, role: str) -> None:
    key = f"ctrlc:{role}"
    threads = threading.active_count()
    with pgelect.LockSession(url) as holder, pgelect.LockSession(url) as waiter:
        held = holder.lock(key).acquire()
        start = time.monotonic()
        with CtrlC() as ctrl_c, pytest.raises(KeyboardInterrupt):
            try:
                with waiter.lock(key):
                    pytest.fail("the lock was granted while the holder held it")
            finally:
                ctrl_c.caught()
        print(f"interrupted after {ctrl_c.sent} Ctrl-C")
        assert time.monotonic() - start < 5
        held.release()
        # The waiter's session must not have taken the key on its way out.
        with pgelect.LockSession(url) as third:
            took = eventually(lambda: _try_and_release(third, key), "the key is free after the interrupt")
            print(f"key free {1000 * took:.0f} ms after the holder released it")
        assert waiter.try_lock(key) is not None  # the waiter's session still works
    assert threading.active_count() == threads


def _try_and_release(session: pgelect.LockSession, key: str) -> bool:
    lock = session.try_lock(key)
    if lock is None:
        return False
    lock.release()
    return True


def test_ctrl_c_while_campaigning(url: str, role: str) -> None:
    leader = pgelect.Elector(url, role)
    standby = pgelect.Elector(url, role)
    lead = leader.acquire(timeout=10)
    with CtrlC() as ctrl_c, pytest.raises(KeyboardInterrupt):
        try:
            standby.acquire()
        finally:
            ctrl_c.caught()
    lead.resign()
    # The interrupted standby does not lead: a third candidate is elected.
    third = pgelect.Elector(url, role)
    with third.leadership(timeout=10) as l3:
        info = pgelect.admin.status(url, role)
        assert info is not None and info.holder == third.node_id and l3.term > lead.term
    for e in (leader, standby, third):
        e.close()


def test_cancelled_asyncio_task_leaves_nothing_held(url: str, role: str) -> None:
    async def main() -> None:
        leader = pgelect.Elector(url, role)
        standby = pgelect.Elector(url, role)
        lead = await leader.acquire_async(timeout=10)
        task = asyncio.ensure_future(standby.acquire_async())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # A lock wait, cancelled the same way.
        async with await pgelect.LockSession.connect_async(url) as s1, await pgelect.LockSession.connect_async(url) as s2:
            held = await s1.lock(f"t:{role}").acquire_async()
            waiting = asyncio.ensure_future(s2.lock(f"t:{role}").acquire_async())
            await asyncio.sleep(0.2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await held.release_async()
            start = time.monotonic()
            while True:
                got = await s1.try_lock_async(f"t:{role}")
                if got is not None:
                    await got.release_async()
                    break
                assert time.monotonic() - start < 10, "the cancelled waiter kept the key"
                await asyncio.sleep(0.02)
        await lead.resign_async()
        third = pgelect.Elector(url, role)
        async with third.leadership(timeout=10):
            info = await pgelect.admin.status_async(url, role)
            assert info is not None and info.holder == third.node_id
        for e in (leader, standby, third):
            e.close()

    asyncio.run(main())


def test_wait_for_on_an_election_times_out_cleanly(url: str, role: str) -> None:
    async def main() -> None:
        leader = pgelect.Elector(url, role)
        lead = await leader.acquire_async()
        standby = pgelect.Elector(url, role)
        with pytest.raises(TimeoutError):
            await standby.acquire_async(timeout=0.3)
        await lead.resign_async()
        leader.close()
        standby.close()

    asyncio.run(main())


# ---- fork -----------------------------------------------------------------


def test_objects_from_before_a_fork_refuse_in_the_child(url: str, role: str) -> None:
    elector = pgelect.Elector(url, role)
    lead = elector.acquire(timeout=10)
    session = pgelect.LockSession(url)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 0
        try:
            results = []
            for name, use in (
                ("elector", lambda: elector.acquire(timeout=1)),
                ("leadership", lead.resign),
                ("session", lambda: session.try_lock("x")),
                ("lost", lambda: lead.lost.wait(0.1)),
            ):
                try:
                    use()
                    results.append(f"{name}:no-error")
                except pgelect.ForkError as e:
                    results.append(f"{name}:ForkError:{'create a new one in the child' in str(e)}")
                except BaseException as e:  # noqa: BLE001
                    results.append(f"{name}:{type(e).__name__}")
            # A fresh elector in the child works (its own runtime and connection).
            fresh = pgelect.Elector(url, role + "-child")
            with fresh.leadership(timeout=20) as child_lead:
                results.append(f"fresh:{child_lead.term > 0}")
            os.write(w, ";".join(results).encode())
        except BaseException as e:  # noqa: BLE001
            os.write(w, f"child failed: {e!r}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        report = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, report
    assert report.split(";") == [
        "elector:ForkError:True",
        "leadership:ForkError:True",
        "session:ForkError:True",
        "lost:ForkError:False",
        "fresh:True",
    ], report
    # The parent's leadership and session were not disturbed by the child.
    assert not lead.lost.is_set()
    assert session.try_lock(f"after-fork:{role}") is not None
    lead.resign()
    session.close()
    elector.close()
