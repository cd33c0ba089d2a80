from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from . import _native
from ._calls import Seconds, seconds, wait, wait_async
from ._signal import LossSignal

#: A lock key: a name (hashed as SQL ``pgelect.key(name)``), an int (the
#: bigint key space) or a pair of ints (the two-integer key space).
Key = Union[str, int, Tuple[int, int]]


class Lock:
    """A session advisory lock held on a :class:`LockSession`'s connection.

    ``lost`` is set if the session's connection is lost (the server then
    released the lock): stop relying on it. ``with lock:`` releases at the
    end of the block; so does ``release()``.
    """

    def __init__(self, native: "_native.Lock") -> None:
        self._native = native
        self.key: str = native.key()
        self.lost: LossSignal = LossSignal(native.lost_signal())

    def release(self) -> bool:
        """Releases the lock; returns whether the server still held it."""
        return wait(self._native.release())

    async def release_async(self) -> bool:
        return await wait_async(self._native.release())

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    async def __aenter__(self) -> "Lock":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release_async()

    def __repr__(self) -> str:
        return f"<Lock {self.key} lost={self.lost.is_set()}>"


class Semaphore:
    """At most ``limit`` holders of its permits at once, across every
    process, waiters served in order (the library's ``Semaphore``)."""

    def __init__(self, name: str, limit: int) -> None:
        self._native = _native.Semaphore(name, limit)
        self.name: str = name
        self.limit: int = limit


class Permit:
    """A permit of a :class:`Semaphore`, held on a :class:`LockSession`."""

    def __init__(self, native: "_native.Permit") -> None:
        self._native = native
        self.semaphore: str = native.semaphore()
        #: Which of the ``limit`` slots it holds.
        self.slot: int = native.slot()
        self.lost: LossSignal = LossSignal(native.lost_signal())

    def release(self) -> bool:
        return wait(self._native.release())

    async def release_async(self) -> bool:
        return await wait_async(self._native.release())

    def __enter__(self) -> "Permit":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    async def __aenter__(self) -> "Permit":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release_async()

    def __repr__(self) -> str:
        return f"<Permit {self.semaphore!r} slot={self.slot} lost={self.lost.is_set()}>"


class _Acquire:
    """``with session.lock(key) as lock:`` / ``async with``; or
    ``session.lock(key).acquire()`` for a lock to release yourself."""

    def __init__(self, start: Any, wrap: Any, what: str) -> None:
        self._start = start
        self._wrap = wrap
        self._what = what
        self._held: Any = None

    def acquire(self) -> Any:
        return self._wrap(wait(self._start(), None, self._what))

    async def acquire_async(self) -> Any:
        return self._wrap(await wait_async(self._start()))

    def __enter__(self) -> Any:
        self._held = self.acquire()
        return self._held

    def __exit__(self, *exc: Any) -> None:
        if self._held is not None:
            self._held.release()

    async def __aenter__(self) -> Any:
        self._held = await self.acquire_async()
        return self._held

    async def __aexit__(self, *exc: Any) -> None:
        if self._held is not None:
            await self._held.release_async()


def _maybe(wrap: Any) -> Any:
    return lambda native: None if native is None else wrap(native)


class LockSession:
    """A connection of its own for session advisory locks and semaphore
    permits (the library's ``LockSession``). Connects on creation (or
    ``await LockSession.connect_async(url)``); ``close()`` or ``with``
    ends it, and the server releases whatever it still holds.

    Waits release the GIL; Ctrl-C or a cancelled task stops a wait and
    leaves the key not held.
    """

    def __init__(
        self,
        url: str,
        *,
        name: Optional[str] = None,
        schema: Optional[str] = None,
        connect_timeout: Optional[Seconds] = None,
        _native_session: Any = None,
    ) -> None:
        if _native_session is None:
            _native_session = wait(
                _native.LockSession.connect(url, name=name, schema=schema, connect_timeout=seconds(connect_timeout))
            )
        self._native = _native_session
        #: Set when the session's connection is lost, with every lock on it.
        self.lost: LossSignal = LossSignal(self._native.lost_signal())

    @classmethod
    async def connect_async(
        cls,
        url: str,
        *,
        name: Optional[str] = None,
        schema: Optional[str] = None,
        connect_timeout: Optional[Seconds] = None,
    ) -> "LockSession":
        native = await wait_async(
            _native.LockSession.connect(url, name=name, schema=schema, connect_timeout=seconds(connect_timeout))
        )
        return cls(url, _native_session=native)

    @property
    def backend_pid(self) -> int:
        """The server process of the session's connection."""
        return self._native.backend_pid()

    def lock(self, key: Key, *, shared: bool = False, timeout: Optional[Seconds] = None) -> _Acquire:
        """Takes ``key`` (exclusive, or ``shared=True``), waiting for ever or
        at most ``timeout`` seconds (then :class:`~pgelect.errors.LockTimeout`).
        A context manager (``with`` / ``async with``) giving a :class:`Lock`."""
        t = seconds(timeout)
        return _Acquire(
            lambda: self._native.lock(key, shared=shared, timeout=t), Lock, f"lock {key!r}"
        )

    def try_lock(self, key: Key, *, shared: bool = False) -> Optional[Lock]:
        """Takes ``key`` if it is free; ``None`` if it is not."""
        return _maybe(Lock)(wait(self._native.try_lock(key, shared=shared)))

    async def try_lock_async(self, key: Key, *, shared: bool = False) -> Optional[Lock]:
        return _maybe(Lock)(await wait_async(self._native.try_lock(key, shared=shared)))

    def acquire_permit(self, semaphore: Semaphore, *, timeout: Optional[Seconds] = None) -> _Acquire:
        """Takes a permit of ``semaphore``, waiting for ever or at most
        ``timeout`` seconds. A context manager giving a :class:`Permit`."""
        t = seconds(timeout)
        return _Acquire(
            lambda: self._native.acquire_permit(semaphore._native, timeout=t),
            Permit,
            f"a permit of semaphore {semaphore.name!r}",
        )

    def try_acquire_permit(self, semaphore: Semaphore) -> Optional[Permit]:
        return _maybe(Permit)(wait(self._native.try_acquire_permit(semaphore._native)))

    async def try_acquire_permit_async(self, semaphore: Semaphore) -> Optional[Permit]:
        return _maybe(Permit)(await wait_async(self._native.try_acquire_permit(semaphore._native)))

    def close(self) -> None:
        """Closes the connection: the server releases every lock of it."""
        self._native.close()

    def __enter__(self) -> "LockSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "LockSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
