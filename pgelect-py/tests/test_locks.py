"""Session locks, semaphores and transaction locks."""

from __future__ import annotations

import asyncio

import pytest

import pgelect
from pgelect_support import connect


def test_session_lock_excludes_and_releases(url: str, role: str) -> None:
    key = f"lock:{role}"
    with pgelect.LockSession(url) as s1, pgelect.LockSession(url) as s2:
        with s1.lock(key) as held:
            assert not held.lost.is_set()
            assert s2.try_lock(key) is None
            # Hashed as SQL pgelect.key(name) hashes it: psycopg sees the same key taken.
            with connect(url, autocommit=True) as conn:
                taken = conn.execute("SELECT pg_try_advisory_lock(pgelect.key(%s))", (key,)).fetchone()[0]
                assert taken is False
            with pytest.raises(pgelect.LockTimeout, match="timed out after"):
                with s2.lock(key, timeout=0.2):
                    pass
        again = s2.try_lock(key)
        assert again is not None
        assert again.release() is True


def test_shared_locks_share_and_exclude_exclusive(url: str, role: str) -> None:
    with pgelect.LockSession(url) as s1, pgelect.LockSession(url) as s2:
        with s1.lock(42, shared=True), s2.lock(42, shared=True):
            with pgelect.LockSession(url) as s3:
                assert s3.try_lock(42) is None
        with s1.lock((7, 8)):
            assert s2.try_lock((7, 8)) is None


def test_lost_is_set_when_the_session_is_killed(url: str, role: str) -> None:
    with pgelect.LockSession(url) as s:
        held = s.lock(f"lost:{role}").acquire()
        with connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (s.backend_pid,))
        assert held.lost.wait(10)
        assert s.lost.is_set()


def test_semaphore_limits_holders(url: str, role: str) -> None:
    sem = pgelect.Semaphore(f"sem-{role}", 2)
    with pgelect.LockSession(url) as a, pgelect.LockSession(url) as b, pgelect.LockSession(url) as c:
        with a.acquire_permit(sem) as pa, b.acquire_permit(sem, timeout=5) as pb:
            assert {pa.slot, pb.slot} == {0, 1}
            assert c.try_acquire_permit(sem) is None
            with pytest.raises(pgelect.LockTimeout):
                with c.acquire_permit(sem, timeout=0.2):
                    pass
        pc = c.try_acquire_permit(sem)
        assert pc is not None and not pc.lost.is_set()
        pc.release()


def test_async_locks(url: str, role: str) -> None:
    async def main() -> None:
        async with await pgelect.LockSession.connect_async(url) as s1:
            async with s1.lock(f"async:{role}") as held:
                s2 = await pgelect.LockSession.connect_async(url)
                assert await s2.try_lock_async(f"async:{role}") is None
                s2.close()
                assert not held.lost.is_set()

    asyncio.run(main())


def test_transaction_locks_on_psycopg(url: str, role: str) -> None:
    key = f"xact:{role}"
    with connect(url) as c1, connect(url) as c2:
        with c1.transaction():
            pgelect.xact_lock(c1, key)
            with c2.transaction():
                assert pgelect.try_xact_lock(c2, key) is False
            with pytest.raises(pgelect.LockTimeout, match=r"timed out after .* waiting for lock"):
                with c2.transaction():
                    pgelect.xact_lock(c2, key, timeout=0.2)
            # The same key as the session lock of that name.
            with pgelect.LockSession(url) as s:
                assert s.try_lock(key) is None
        # Committed: released.
        with c2.transaction():
            pgelect.xact_lock(c2, key, timeout=5)
            # The caller's lock_timeout is restored after a bounded wait.
            assert c2.execute("SHOW lock_timeout").fetchone()[0] == "0"


def test_transaction_lock_outside_a_transaction_is_refused(url: str) -> None:
    with connect(url, autocommit=True) as conn:
        with pytest.raises(pgelect.ConfigurationError, match="outside a transaction"):
            pgelect.xact_lock(conn, "autocommit")


def test_async_transaction_locks(url: str, role: str) -> None:
    import psycopg

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(url) as c1, await psycopg.AsyncConnection.connect(url) as c2:
            async with c1.transaction():
                await pgelect.xact_lock(c1, f"ax:{role}", shared=True)
                async with c2.transaction():
                    assert await pgelect.try_xact_lock(c2, f"ax:{role}", shared=True) is True
                    assert await pgelect.try_xact_lock(c2, f"ax:{role}") is False

    asyncio.run(main())


def test_bad_keys_are_refused() -> None:
    with pytest.raises(pgelect.ConfigurationError, match="out of the bigint range"):
        pgelect._native.lock_key(2**70)
    with pytest.raises(pgelect.ConfigurationError, match="a lock key is"):
        pgelect._native.lock_key(1.5)
    with pytest.raises(pgelect.ConfigurationError):
        pgelect._native.lock_key("")
