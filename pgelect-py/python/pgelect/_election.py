from __future__ import annotations

import inspect
import json
from typing import Any, Awaitable, Callable, Dict, Optional, Union

from . import _native, _psycopg
from ._calls import Seconds, seconds, wait, wait_async
from ._signal import LossSignal
from .errors import CancelledError, PgelectError


class Leadership:
    """Leadership of a role, from :meth:`Elector.leadership` (or given to
    ``on_elected`` by :meth:`Elector.run`).

    It lasts until :attr:`lost` is set: a lost connection, the local
    deadline, a preemption, a resign request from another process, or
    :meth:`resign`. Stop acting as leader when it is set; guard the writes
    that must never overlap with :meth:`fence`.
    """

    def __init__(self, native: "_native.Leadership", lost: Optional["_native.Signal"] = None) -> None:
        self._native = native
        #: The fencing term: greater than every earlier term of the role.
        self.term: int = native.term()
        #: The role led.
        self.role: str = native.role()
        #: Set when leadership ends (an event, awaitable from asyncio).
        self.lost: LossSignal = LossSignal(lost if lost is not None else native.lost_signal())

    @property
    def is_lost(self) -> bool:
        """True once leadership has ended."""
        return self._native.is_lost()

    @property
    def loss_reason(self) -> Optional[str]:
        """Why leadership ended (``None`` while it lasts)."""
        return self._native.loss_reason()

    def resign(self) -> None:
        """Steps down cleanly: standbys take over at once. Stop the leader's
        work first. Does nothing after a first call."""
        wait(self._native.resign())

    async def resign_async(self) -> None:
        """:meth:`resign` for asyncio."""
        await wait_async(self._native.resign())

    def fence(self, conn: Any) -> Any:
        """Fences the caller's psycopg 3 transaction with this term: runs
        ``SELECT pgelect.fence(role, term)`` in it, which fails with
        :class:`~pgelect.errors.StaleTermError` (or ``NoLeaderError``) once
        a newer term began, and holds the role's row ``FOR SHARE`` until
        the transaction ends, so that no takeover completes while it is
        open. Call it before the writes, inside the transaction
        (``with conn.transaction():``).

        ``conn`` is a psycopg ``Connection`` or ``Cursor``; with an
        ``AsyncConnection`` or ``AsyncCursor`` it returns a coroutine to
        await. Raises :class:`~pgelect.errors.LeadershipLostError` at once,
        without a statement, once this leadership is known lost.
        """
        return _psycopg.fence(self._native, conn)

    def __repr__(self) -> str:
        return f"<Leadership role={self.role!r} term={self.term} lost={self.lost.is_set()}>"


class _LeadershipContext:
    """What :meth:`Elector.leadership` returns: ``with`` / ``async with``."""

    def __init__(self, elector: "Elector", timeout: Optional[float]) -> None:
        self._elector = elector
        self._timeout = timeout
        self._lead: Optional[Leadership] = None

    def __enter__(self) -> Leadership:
        self._lead = self._elector.acquire(timeout=self._timeout)
        return self._lead

    def __exit__(self, *exc: Any) -> None:
        if self._lead is not None:
            self._lead.resign()

    async def __aenter__(self) -> Leadership:
        self._lead = await self._elector.acquire_async(timeout=self._timeout)
        return self._lead

    async def __aexit__(self, *exc: Any) -> None:
        if self._lead is not None:
            await self._lead.resign_async()


class Elector:
    """A candidate for leadership of ``role`` (the Rust library's
    ``Elector``, one leader at a time across every process).

    ``backend="session"`` holds an advisory lock on a connection of its own
    (fast failover); ``"lease"`` keeps only a lease row (safe through
    PgBouncer in transaction mode). Durations are seconds (or
    ``timedelta``); unset ones take the library's defaults, and the
    combination is checked (a ``ttl`` that breaks the timing inequalities
    raises :class:`~pgelect.errors.ConfigurationError`). Through PgBouncer
    in transaction mode, ``listen_url`` (a direct connection to the server)
    lets lease standbys hear a release at once instead of polling.

    Use it from the process that made it: in a child of ``os.fork()`` every
    method raises :class:`~pgelect.errors.ForkError`; make a new one there.
    """

    def __init__(
        self,
        url: str,
        role: str,
        *,
        backend: str = "session",
        ttl: Optional[Seconds] = None,
        renew_every: Optional[Seconds] = None,
        retry_every: Optional[Seconds] = None,
        handover_delay: Optional[Seconds] = None,
        safety_margin: Optional[Seconds] = None,
        check_every: Optional[Seconds] = None,
        node_id: Optional[str] = None,
        priority: Optional[int] = None,
        profile: Optional[str] = None,
        schema: Optional[str] = None,
        meta: Optional[Dict[str, Any]] = None,
        connect_timeout: Optional[Seconds] = None,
        listen_url: Optional[str] = None,
    ) -> None:
        self._native = _native.Elector(
            url,
            role,
            backend=backend,
            ttl=seconds(ttl),
            renew_every=seconds(renew_every),
            retry_every=seconds(retry_every),
            handover_delay=seconds(handover_delay),
            safety_margin=seconds(safety_margin),
            check_every=seconds(check_every),
            node_id=node_id,
            priority=priority,
            profile=profile,
            schema=schema,
            meta=None if meta is None else json.dumps(meta),
            connect_timeout=seconds(connect_timeout),
            listen_url=listen_url,
        )

    @property
    def role(self) -> str:
        return self._native.role()

    @property
    def node_id(self) -> str:
        return self._native.node_id()

    @property
    def backend(self) -> str:
        return self._native.backend()

    @property
    def timing(self) -> Dict[str, Any]:
        """The timing in force, defaults filled in (milliseconds)."""
        return json.loads(self._native.timing_json())

    # ---- one leadership ------------------------------------------------

    def acquire(self, timeout: Optional[Seconds] = None) -> Leadership:
        """Campaigns until elected (GIL released; Ctrl-C stops the campaign
        and leaves nothing held). With ``timeout``, raises ``TimeoutError``
        when not elected in time."""
        return self._elected(
            wait(self._native.leadership(), seconds(timeout), f"election as leader of role {self.role!r}")
        )

    async def acquire_async(self, timeout: Optional[Seconds] = None) -> Leadership:
        """:meth:`acquire` for asyncio; cancelling the task stops the
        campaign and leaves nothing held."""
        import asyncio

        call = wait_async(self._native.leadership())
        limit = seconds(timeout)
        try:
            native = await (call if limit is None else asyncio.wait_for(call, limit))
        except asyncio.TimeoutError:
            raise TimeoutError(f"election as leader of role {self.role!r}: not done within {limit} s") from None
        return self._elected(native)

    def _elected(self, native: Optional["_native.Leadership"]) -> Leadership:
        if native is None:
            raise CancelledError(f"the elector of role {self.role!r} was shut down")
        return Leadership(native)

    def leadership(self, timeout: Optional[Seconds] = None) -> _LeadershipContext:
        """``with elector.leadership() as lead:`` (or ``async with``):
        campaigns until elected, and resigns cleanly when the block ends."""
        return _LeadershipContext(self, seconds(timeout))

    # ---- the callback form ---------------------------------------------

    def run(
        self,
        on_elected: Callable[[Leadership], Any],
        on_demoted: Optional[Callable[[], Any]] = None,
    ) -> None:
        """Leads whenever elected, until :meth:`shutdown` (as the Go
        elector's ``OnStartedLeading`` / ``OnStoppedLeading``).

        On every election ``on_elected(lead)`` runs in this thread: these
        are the duties, which must return soon after ``lead.lost`` is set
        (leadership lost, or :meth:`shutdown` called). When they return,
        leadership is resigned cleanly, then ``on_demoted()`` runs; then it
        campaigns again, or returns after a shutdown. KeyboardInterrupt
        resigns and re-raises.
        """
        while not self._native.is_shutdown():
            native = wait(self._native.leadership())
            if native is None:
                break
            lead = Leadership(native, lost=native.duties_signal(self._native))
            try:
                on_elected(lead)
            finally:
                try:
                    lead.resign()
                finally:
                    if on_demoted is not None:
                        on_demoted()
        self._withdraw_quietly()

    async def run_async(
        self,
        on_elected: Callable[[Leadership], Awaitable[Any]],
        on_demoted: Optional[Callable[[], Union[Awaitable[Any], Any]]] = None,
    ) -> None:
        """:meth:`run` for asyncio: ``await on_elected(lead)``; cancelling
        the task cancels the duties, resigns, and re-raises."""
        while not self._native.is_shutdown():
            native = await wait_async(self._native.leadership())
            if native is None:
                break
            lead = Leadership(native, lost=native.duties_signal(self._native))
            try:
                await on_elected(lead)
            finally:
                try:
                    await lead.resign_async()
                finally:
                    if on_demoted is not None:
                        result = on_demoted()
                        if inspect.isawaitable(result):
                            await result
        self._withdraw_quietly()

    def shutdown(self) -> None:
        """Stops :meth:`run` (sets the duties' ``lead.lost``, reason
        ``"shutdown"``) and any campaign in progress. Safe from any thread
        and from a signal handler."""
        self._native.shutdown()

    def _withdraw_quietly(self) -> None:
        try:
            wait(self._native.withdraw())
        except PgelectError:
            pass  # the row is left stale (never ready), as in the library

    def close(self) -> None:
        """Shuts down and drops the library's elector."""
        self._native.close()

    def __enter__(self) -> "Elector":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Elector role={self.role!r} backend={self.backend!r}>"
