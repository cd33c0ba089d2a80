//! Transaction-level advisory locks on the caller's sqlx connection or
//! transaction (feature `sqlx`).
//!
//! The same functions as [`xact_lock`](crate::lock::xact_lock) and friends, with
//! the same semantics, over `&mut sqlx::PgConnection`. A
//! `sqlx::Transaction<'_, Postgres>` and a pooled connection dereference to
//! it: pass `&mut *tx`. Statements are sent unprepared
//! (`persistent(false)`), and nothing is left on the connection after the
//! transaction ends, so a pooled connection returns to its pool clean and
//! PgBouncer in transaction mode works.
//!
//! Unlike tokio-postgres, sqlx cannot cancel a statement on the server: a
//! dropped future leaves the wait running on the server until it is granted
//! or the connection closes. Prefer the `_timeout` forms, which the server
//! itself bounds.
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use pgelect::LockKey;
//! let mut tx = pool.begin().await?;
//! pgelect::lock::sqlx::xact_lock_timeout(&mut *tx, LockKey::from_i64(7), Duration::from_secs(2)).await?;
//! // ... work serialised on key 7 ...
//! tx.commit().await?; // releases the lock
//! # Ok(()) }
//! ```

use std::time::{Duration, Instant};

use ::sqlx::PgConnection;

use super::xact::{is_wait_timeout_code, xact_sql, CAP_LOCK_TIMEOUT_SQL, RESTORE_LOCK_TIMEOUT_SQL};
use super::{timeout_millis, LockMode};
use crate::error::{Error, Result};
use crate::key::LockKey;

/// Like [`try_xact_lock`](crate::lock::try_xact_lock), on an sqlx connection.
///
/// # Cancel safety
/// Cancel safe in the sense that a lock taken is held until the transaction
/// ends, as for the tokio-postgres form.
pub async fn try_xact_lock(conn: &mut PgConnection, key: LockKey) -> Result<bool> {
    try_xact(conn, key, LockMode::Exclusive).await
}

/// Like [`try_xact_lock_shared`](crate::lock::try_xact_lock_shared), on an sqlx
/// connection.
///
/// # Cancel safety
/// As for [`try_xact_lock`].
pub async fn try_xact_lock_shared(conn: &mut PgConnection, key: LockKey) -> Result<bool> {
    try_xact(conn, key, LockMode::Shared).await
}

/// Like [`xact_lock`](crate::lock::xact_lock), on an sqlx connection.
///
/// # Cancel safety
/// Not cancel safe: a dropped future leaves the wait running on the server
/// (sqlx has no query cancel). Drop the transaction and its connection
/// after abandoning a wait, or use [`xact_lock_timeout`].
pub async fn xact_lock(conn: &mut PgConnection, key: LockKey) -> Result<()> {
    wait_xact(conn, key, LockMode::Exclusive).await
}

/// Like [`xact_lock_shared`](crate::lock::xact_lock_shared), on an sqlx connection.
///
/// # Cancel safety
/// As for [`xact_lock`]: not cancel safe.
pub async fn xact_lock_shared(conn: &mut PgConnection, key: LockKey) -> Result<()> {
    wait_xact(conn, key, LockMode::Shared).await
}

/// Like [`xact_lock_timeout`](crate::lock::xact_lock_timeout), on an sqlx
/// connection: caps `lock_timeout` for this transaction only (keeping a
/// stricter caller value, capping `0`), restores the caller's value once the
/// lock is held, and turns SQLSTATE `55P03`/`57014` into
/// [`Error::LockTimeout`].
///
/// # Cancel safety
/// Dropping the future does not stop a wait already sent, but the server
/// ends it within `timeout`; if dropped between cap and restore, the capped
/// value stays until the transaction ends.
pub async fn xact_lock_timeout(
    conn: &mut PgConnection,
    key: LockKey,
    timeout: Duration,
) -> Result<()> {
    bounded_xact(conn, key, LockMode::Exclusive, timeout).await
}

/// Like [`xact_lock_shared_timeout`](crate::lock::xact_lock_shared_timeout), on an
/// sqlx connection.
///
/// # Cancel safety
/// As for [`xact_lock_timeout`].
pub async fn xact_lock_shared_timeout(
    conn: &mut PgConnection,
    key: LockKey,
    timeout: Duration,
) -> Result<()> {
    bounded_xact(conn, key, LockMode::Shared, timeout).await
}

fn bind_key<'q, O>(
    query: ::sqlx::query::QueryScalar<'q, ::sqlx::Postgres, O, ::sqlx::postgres::PgArguments>,
    key: LockKey,
) -> ::sqlx::query::QueryScalar<'q, ::sqlx::Postgres, O, ::sqlx::postgres::PgArguments> {
    match key {
        LockKey::Single(k) => query.bind(k),
        LockKey::Pair(a, b) => query.bind(a).bind(b),
    }
}

fn db(operation: &'static str, source: ::sqlx::Error) -> Error {
    Error::Sqlx { operation, source }
}

fn is_wait_timeout(e: &::sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| is_wait_timeout_code(&code))
}

async fn try_xact(conn: &mut PgConnection, key: LockKey, mode: LockMode) -> Result<bool> {
    let query = ::sqlx::query_scalar::<_, bool>(xact_sql(&key, mode, true)).persistent(false);
    bind_key(query, key)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| db("try a transaction lock", e))
}

async fn wait_xact(conn: &mut PgConnection, key: LockKey, mode: LockMode) -> Result<()> {
    let sql = xact_sql(&key, mode, false);
    let query = match key {
        LockKey::Single(k) => ::sqlx::query(sql).bind(k),
        LockKey::Pair(a, b) => ::sqlx::query(sql).bind(a).bind(b),
    };
    let started = Instant::now();
    match query.persistent(false).execute(&mut *conn).await {
        Ok(_) => Ok(()),
        Err(e) if is_wait_timeout(&e) => Err(Error::LockTimeout {
            key: key.to_string(),
            waited: started.elapsed(),
            holders: Vec::new(),
        }),
        Err(e) => Err(db("take a transaction lock", e)),
    }
}

async fn bounded_xact(
    conn: &mut PgConnection,
    key: LockKey,
    mode: LockMode,
    timeout: Duration,
) -> Result<()> {
    let ms = timeout_millis("the lock wait timeout", timeout)?;
    // Uncontended, one short statement instead of three (see the
    // tokio-postgres form).
    if try_xact(conn, key, mode).await? {
        return Ok(());
    }
    let (caller, _applied): (String, String) = ::sqlx::query_as(CAP_LOCK_TIMEOUT_SQL)
        .persistent(false)
        .bind(ms)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| db("cap lock_timeout for the transaction", e))?;
    wait_xact(conn, key, mode).await?;
    ::sqlx::query(RESTORE_LOCK_TIMEOUT_SQL)
        .persistent(false)
        .bind(caller)
        .execute(&mut *conn)
        .await
        .map_err(|e| db("restore lock_timeout", e))?;
    Ok(())
}
