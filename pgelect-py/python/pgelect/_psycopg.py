"""What runs on the caller's psycopg 3 connection: the fence and the
transaction locks. The statements are the Rust library's (its
``LeaderContext::fence`` and ``lock/xact.rs``) in psycopg's placeholders;
the keys, the refusals' exceptions and their messages come from the
library. psycopg is not imported here: any object with psycopg's
``execute`` (a connection or cursor, sync or async) will do."""

from __future__ import annotations

import inspect
import time
from typing import Any, Optional, Sequence, Tuple

from . import _native
from .errors import ConfigurationError

# SQLSTATEs of a lock wait that ran out: lock_not_available (lock_timeout)
# and query_canceled (statement_timeout or a cancel request).
_WAIT_TIMEOUT = ("55P03", "57014")


def _connection(conn: Any) -> Any:
    """The connection of a connection or a cursor."""
    return getattr(conn, "connection", conn)


def _require_transaction(conn: Any, what: str) -> None:
    status = getattr(getattr(_connection(conn), "info", None), "transaction_status", None)
    if status is not None and getattr(status, "name", "") == "IDLE":
        raise ConfigurationError(
            f"invalid configuration: {what} ran outside a transaction (an autocommit connection): "
            "it would end with its own statement and protect nothing; run it inside "
            "`with conn.transaction():` or on a connection with autocommit off"
        )


def _execute(conn: Any, sql: str, params: Sequence[Any]) -> Any:
    # Unprepared, as the library's statements are: it works through
    # PgBouncer in transaction mode.
    return conn.execute(sql, params, prepare=False)


# ---- the fence ------------------------------------------------------------


def fence(native_leadership: "_native.Leadership", conn: Any) -> Any:
    sql, role, term = native_leadership.fence_statement()
    try:
        result = _execute(conn, sql, (role, term))
    except Exception as e:  # a sync psycopg connection
        _raise_fence_refusal(role, e)
        raise
    if inspect.isawaitable(result):
        return _fence_async(result, conn, role)
    _require_transaction(conn, "the fence")
    return None


async def _fence_async(pending: Any, conn: Any, role: str) -> None:
    try:
        await pending
    except Exception as e:
        _raise_fence_refusal(role, e)
        raise
    _require_transaction(conn, "the fence")


def _raise_fence_refusal(role: str, e: Exception) -> None:
    diag = getattr(e, "diag", None)
    message = getattr(diag, "message_primary", None) or str(e)
    refusal = _native.fence_error(role, getattr(e, "sqlstate", None), message)
    if refusal is not None:
        raise refusal from e


# ---- transaction locks ----------------------------------------------------


def _key_sql(params: Sequence[int]) -> str:
    return "%s::int8" if len(params) == 1 else "%s::int4, %s::int4"


def _lock_sql(params: Sequence[int], shared: bool, try_only: bool) -> str:
    name = "pg_" + ("try_" if try_only else "") + "advisory_xact_lock" + ("_shared" if shared else "")
    return f"SELECT {name}({_key_sql(params)})"


def _bounded_sql(params: Sequence[int], shared: bool) -> str:
    # The library's bounded wait (lock/xact.rs): lock_timeout capped to the
    # wait for this one statement, the caller's setting restored after.
    return f"""SELECT set_config('lock_timeout', l.setting, true)
           FROM (SELECT c.setting, pg_advisory_xact_lock{'_shared' if shared else ''}({_key_sql(params)})::text
                   FROM (SELECT o.setting,
                                set_config('lock_timeout',
                                           CASE WHEN o.ms > 0 AND o.ms <= %s::int8 THEN o.setting
                                                ELSE %s::int8::text || 'ms'
                                           END,
                                           true)
                           FROM (SELECT s.setting,
                                        (extract(epoch FROM s.setting::interval) * 1000)::int8 AS ms
                                   FROM (SELECT current_setting('lock_timeout') AS setting) AS s
                                 OFFSET 0) AS o
                         OFFSET 0) AS c
                 OFFSET 0) AS l"""


def _timeout_ms(timeout: float) -> int:
    if not timeout >= 0 or timeout == float("inf"):
        raise ConfigurationError(
            f"invalid configuration: the lock wait timeout must be a finite, non-negative number of seconds, got {timeout}"
        )
    return max(1, int(timeout * 1000))


def try_xact_lock(conn: Any, key: Any, *, shared: bool = False) -> Any:
    display, params = _native.lock_key(key)
    result = _execute(conn, _lock_sql(params, shared, True), params)
    if inspect.isawaitable(result):
        return _fetch_bool_async(result, conn)
    _require_transaction(conn, "a transaction lock")
    return bool(result.fetchone()[0])


async def _fetch_bool_async(pending: Any, conn: Any) -> bool:
    cursor = await pending
    _require_transaction(conn, "a transaction lock")
    row = await cursor.fetchone()
    return bool(row[0])


def xact_lock(conn: Any, key: Any, *, shared: bool = False, timeout: Optional[float] = None) -> Any:
    display, params = _native.lock_key(key)
    if timeout is None:
        statements: Tuple[Tuple[str, Sequence[Any]], ...] = ((_lock_sql(params, shared, False), params),)
    else:
        ms = _timeout_ms(timeout)
        # Uncontended, the plain try is all it takes (as in the library).
        statements = (
            (_lock_sql(params, shared, True), params),
            (_bounded_sql(params, shared), (*params, ms, ms)),
        )
    first_sql, first_params = statements[0]
    started = time.monotonic()
    try:
        result = _execute(conn, first_sql, first_params)
    except Exception as e:
        _raise_lock_timeout(display, started, e)
        raise
    if inspect.isawaitable(result):
        return _xact_lock_async(result, conn, statements, display, started)
    _require_transaction(conn, "a transaction lock")
    if len(statements) == 1 or result.fetchone()[0]:
        return None
    started = time.monotonic()
    try:
        _execute(conn, *statements[1])
    except Exception as e:
        _raise_lock_timeout(display, started, e)
        raise
    return None


async def _xact_lock_async(pending: Any, conn: Any, statements: Any, display: str, started: float) -> None:
    try:
        cursor = await pending
    except Exception as e:
        _raise_lock_timeout(display, started, e)
        raise
    _require_transaction(conn, "a transaction lock")
    if len(statements) == 1 or (await cursor.fetchone())[0]:
        return
    started = time.monotonic()
    try:
        await _execute(conn, *statements[1])
    except Exception as e:
        _raise_lock_timeout(display, started, e)
        raise


def _raise_lock_timeout(display: str, started: float, e: Exception) -> None:
    if getattr(e, "sqlstate", None) in _WAIT_TIMEOUT:
        raise _native.lock_timeout_error(display, time.monotonic() - started) from e
