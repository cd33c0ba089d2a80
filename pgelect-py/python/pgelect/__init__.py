"""pgelect for Python: leader election, fencing tokens and advisory locks
on PostgreSQL, built on the pgelect Rust library (a binding, not a second
implementation: every guarantee of the library holds).

::

    import pgelect, psycopg

    pgelect.migrate(url)                       # once, installs the schema
    elector = pgelect.Elector(url, "scheduler", backend="session", ttl=10)
    with elector.leadership() as lead:         # or: async with
        while not lead.lost.wait(1.0):         # or: await lead.lost
            with psycopg.connect(url) as conn, conn.transaction():
                lead.fence(conn)               # refused once a newer term began
                conn.execute("INSERT ...")

Waits release the GIL. Ctrl-C (KeyboardInterrupt) or a cancelled asyncio
task stops a wait and leaves nothing held. Objects made before
``os.fork()`` raise :class:`~pgelect.errors.ForkError` in the child: make
new ones there. Errors are the exceptions of :mod:`pgelect.errors`.
"""

from __future__ import annotations

from typing import Optional

from . import _native, admin, errors
from ._calls import Seconds, seconds, wait, wait_async
from ._election import Elector, Leadership
from ._locks import Key, Lock, LockSession, Permit, Semaphore
from ._psycopg import try_xact_lock, xact_lock
from ._signal import LossSignal
from .admin import LeaderInfo
from .errors import (
    AlreadyHeldError,
    AuthenticationError,
    CancelledError,
    ConfigurationError,
    ConnectionError,
    ConnectTimeout,
    DatabaseError,
    ForkError,
    LeadershipLostError,
    LockTimeout,
    NoLeaderError,
    PermissionDenied,
    PgelectError,
    PoolerError,
    SchemaError,
    StaleTermError,
)

__version__: str = _native.__version__
#: The schema version this pgelect needs.
SCHEMA_VERSION: int = _native.SCHEMA_VERSION

__all__ = [
    "Elector",
    "Leadership",
    "LossSignal",
    "LockSession",
    "Lock",
    "Semaphore",
    "Permit",
    "Key",
    "xact_lock",
    "try_xact_lock",
    "migrate",
    "migrate_async",
    "admin",
    "LeaderInfo",
    "errors",
    "PgelectError",
    "ConfigurationError",
    "PoolerError",
    "ConnectionError",
    "ConnectTimeout",
    "AuthenticationError",
    "PermissionDenied",
    "SchemaError",
    "LockTimeout",
    "AlreadyHeldError",
    "LeadershipLostError",
    "StaleTermError",
    "NoLeaderError",
    "DatabaseError",
    "ForkError",
    "CancelledError",
    "SCHEMA_VERSION",
]


def migrate(url: str, *, schema: Optional[str] = None, connect_timeout: Optional[Seconds] = None) -> int:
    """Installs or upgrades pgelect's schema (idempotent, safe to run from
    many processes at once); returns the number of migrations applied."""
    return wait(_native.migrate(url, schema=schema, connect_timeout=seconds(connect_timeout)))


async def migrate_async(url: str, *, schema: Optional[str] = None, connect_timeout: Optional[Seconds] = None) -> int:
    """:func:`migrate` for asyncio."""
    return await wait_async(_native.migrate(url, schema=schema, connect_timeout=seconds(connect_timeout)))


