"""The exceptions of pgelect: one per kind of the Rust library's ``Error``.

Messages are the library's own (lower-case, saying what went wrong and what
to do; never a password). Each exception has ``sqlstate``: the server's
SQLSTATE where there is one (``PE001`` for a stale term), else ``None``.

::

    PgelectError
    ├── ConfigurationError (also ValueError): a value out of range, a bad name or URL
    │   └── PoolerError: a session needed, a transaction-mode pooler found
    ├── ConnectionError (also builtins.ConnectionError): unreachable, lost
    │   └── ConnectTimeout (also TimeoutError)
    ├── AuthenticationError: the server refused the login
    ├── PermissionDenied (also builtins.PermissionError): a missing grant
    ├── SchemaError: run ``pgelect.migrate(url)`` (or upgrade pgelect)
    ├── LockTimeout (also TimeoutError): a bounded wait ran out
    ├── AlreadyHeldError: the key is held through this session already
    ├── LeadershipLostError: stop acting as leader
    │   ├── StaleTermError: a fence found a newer term
    │   └── NoLeaderError: a fence found no leader
    ├── DatabaseError: any other failed statement
    ├── ForkError (also RuntimeError): an object of the parent used after os.fork()
    └── CancelledError: the operation was cancelled
"""

from __future__ import annotations

import builtins
from typing import Optional

__all__ = [
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
]


class PgelectError(Exception):
    """Base class of every pgelect error."""

    #: The server's SQLSTATE, where the error came from the server.
    sqlstate: Optional[str] = None

    def __init__(self, message: str) -> None:
        super().__init__(message)


class ConfigurationError(PgelectError, ValueError):
    """A configuration value, name or URL is refused (the library's ``is_config``)."""


class PoolerError(ConfigurationError):
    """The connection goes through a pooler in transaction mode where a session is needed."""


class ConnectionError(PgelectError, builtins.ConnectionError):  # noqa: A001
    """The server cannot be reached, or a connection pgelect owns was lost."""


class ConnectTimeout(ConnectionError, builtins.TimeoutError):
    """The connection attempt did not finish in time."""


class AuthenticationError(PgelectError):
    """The server refused the credentials (retrying will not help)."""


class PermissionDenied(PgelectError, builtins.PermissionError):
    """The database user lacks a privilege (see ``pgelect grants``)."""


class SchemaError(PgelectError):
    """pgelect's schema is missing or at another version."""


class LockTimeout(PgelectError, builtins.TimeoutError):
    """A bounded wait for a lock ran out."""


class AlreadyHeldError(PgelectError):
    """The key is already held through this session."""


class LeadershipLostError(PgelectError):
    """The leadership relied on has ended: stop acting as leader."""


class StaleTermError(LeadershipLostError):
    """A fence refused: a newer term began (SQLSTATE ``PE001``)."""


class NoLeaderError(LeadershipLostError):
    """A fence refused: the role has no leader now (SQLSTATE ``PE002``)."""


class DatabaseError(PgelectError):
    """A statement of pgelect's failed."""


class ForkError(PgelectError, RuntimeError):
    """An elector, leadership or lock made before ``os.fork()`` was used in the child."""


class CancelledError(PgelectError):
    """The operation was cancelled before it completed."""
