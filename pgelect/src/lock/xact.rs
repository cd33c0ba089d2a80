//! Transaction-scoped advisory locks on the caller's tokio-postgres client or
//! transaction.

use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

use super::{timeout_millis, LockMode};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::schema::DEFAULT_SCHEMA;

/// Caps `lock_timeout` for the current transaction only and returns the
/// caller's value, in one statement.
///
/// `$1` is the cap in milliseconds. The caller's value is kept when it is
/// already at least as strict (non-zero and not above the cap); `0` means
/// "no limit", so it is always capped. The previous value is read in a
/// subquery fenced by `OFFSET 0`, before `set_config` changes it, and is
/// returned as PostgreSQL prints it so that the restore puts back exactly
/// that text. `current_setting` prints `lock_timeout` with a unit (`100ms`,
/// `5s`, `1min`) or as `0`, all of which read as an `interval`.
#[cfg(feature = "sqlx")]
pub(super) const CAP_LOCK_TIMEOUT_SQL: &str = "\
SELECT caller.setting,
       set_config('lock_timeout',
                  CASE WHEN caller.ms > 0 AND caller.ms <= $1::int8 THEN caller.setting
                       ELSE $1::int8::text || 'ms'
                  END,
                  true)
  FROM (SELECT s.setting,
               (extract(epoch FROM s.setting::interval) * 1000)::int8 AS ms
          FROM (SELECT current_setting('lock_timeout') AS setting) AS s
        OFFSET 0) AS caller";

/// Puts back the caller's `lock_timeout` (transaction-local, like the cap).
#[cfg(feature = "sqlx")]
pub(super) const RESTORE_LOCK_TIMEOUT_SQL: &str =
    "SELECT set_config('lock_timeout', $1::text, true)";

/// Cap, wait and restore in one statement, for tokio-postgres: key
/// parameters first, then the cap in milliseconds. The nested subqueries
/// (`OFFSET 0` keeps the planner from merging them) run inside out: the
/// caller's value is read,
/// the cap set, the lock waited for under it, and the caller's value put
/// back. If the wait fails the statement fails, the transaction is aborted
/// and the capped value goes with it.
fn bounded_sql(key: &LockKey, mode: LockMode) -> String {
    let ms = key.params().len() + 1;
    format!(
        "SELECT set_config('lock_timeout', l.setting, true)
           FROM (SELECT c.setting, pg_advisory_xact_lock{}({})::text
                   FROM (SELECT o.setting,
                                set_config('lock_timeout',
                                           CASE WHEN o.ms > 0 AND o.ms <= ${ms}::int8 THEN o.setting
                                                ELSE ${ms}::int8::text || 'ms'
                                           END,
                                           true)
                           FROM (SELECT s.setting,
                                        (extract(epoch FROM s.setting::interval) * 1000)::int8 AS ms
                                   FROM (SELECT current_setting('lock_timeout') AS setting) AS s
                                 OFFSET 0) AS o
                         OFFSET 0) AS c
                 OFFSET 0) AS l",
        mode.suffix(),
        key.sql_args(1)
    )
}

/// `SELECT pg_[try_]advisory_xact_lock[_shared](<key>)` with parameters from `$1`.
///
/// Static text: no formatting per call, and sqlx accepts it as safe SQL.
pub(super) fn xact_sql(key: &LockKey, mode: LockMode, try_only: bool) -> &'static str {
    let pair = matches!(key, LockKey::Pair(..));
    match (try_only, mode, pair) {
        (true, LockMode::Exclusive, false) => "SELECT pg_try_advisory_xact_lock($1::int8)",
        (true, LockMode::Exclusive, true) => "SELECT pg_try_advisory_xact_lock($1::int4, $2::int4)",
        (true, LockMode::Shared, false) => "SELECT pg_try_advisory_xact_lock_shared($1::int8)",
        (true, LockMode::Shared, true) => {
            "SELECT pg_try_advisory_xact_lock_shared($1::int4, $2::int4)"
        }
        (false, LockMode::Exclusive, false) => "SELECT pg_advisory_xact_lock($1::int8)",
        (false, LockMode::Exclusive, true) => "SELECT pg_advisory_xact_lock($1::int4, $2::int4)",
        (false, LockMode::Shared, false) => "SELECT pg_advisory_xact_lock_shared($1::int8)",
        (false, LockMode::Shared, true) => {
            "SELECT pg_advisory_xact_lock_shared($1::int4, $2::int4)"
        }
    }
}

/// True for the SQLSTATEs a lock wait ends with when a timeout or a cancel
/// fires: `55P03` (lock_not_available) and `57014` (query_canceled).
pub(super) fn is_wait_timeout_code(code: &str) -> bool {
    code == SqlState::LOCK_NOT_AVAILABLE.code() || code == SqlState::QUERY_CANCELED.code()
}

/// Tries to take an exclusive transaction-level advisory lock on `client`,
/// without waiting.
///
/// Returns `true` when the lock was taken. PostgreSQL releases it when the
/// transaction ends (commit or rollback); there is no way to release it
/// earlier. `client` must be inside a transaction: a [`tokio_postgres::Transaction`],
/// or a `Client` after `BEGIN`. In autocommit mode the lock would be released
/// again as soon as the statement finishes.
///
/// Taking a key the transaction already holds succeeds again (PostgreSQL
/// counts transaction locks; all are released together at the end).
///
/// Issues one unnamed statement, so it works through PgBouncer in
/// transaction mode.
///
/// # Cancel safety
/// Cancel safe in the sense that dropping the future leaves nothing behind
/// but what the transaction holds: if the statement already ran, the lock is
/// held until the transaction ends.
///
/// ```no_run
/// # async fn f(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use pgelect::{lock::try_xact_lock, LockKey};
/// let tx = client.transaction().await?;
/// if try_xact_lock(&tx, LockKey::from_name("invoice-42")?).await? {
///     // ... work that only one transaction may do at a time ...
/// }
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn try_xact_lock<C>(client: &C, key: LockKey) -> Result<bool>
where
    C: GenericClient + Sync,
{
    try_xact(client, key, LockMode::Exclusive).await
}

/// Like [`try_xact_lock`], in shared mode: succeeds while no one holds the
/// key exclusively.
///
/// # Cancel safety
/// As for [`try_xact_lock`].
pub async fn try_xact_lock_shared<C>(client: &C, key: LockKey) -> Result<bool>
where
    C: GenericClient + Sync,
{
    try_xact(client, key, LockMode::Shared).await
}

/// Takes an exclusive transaction-level advisory lock on `client`, waiting as
/// long as it takes.
///
/// The wait is bounded only by the session's own `lock_timeout` or
/// `statement_timeout`, if any; when one of them fires (SQLSTATE `55P03` or
/// `57014`) the error is [`Error::LockTimeout`] and the transaction is
/// aborted: roll it back. For a bound of your own use [`xact_lock_timeout`].
/// Released by PostgreSQL at commit or rollback. `client` must be inside a
/// transaction (see [`try_xact_lock`]).
///
/// # Cancel safety
/// Not cancel safe: dropping the future does not stop the wait on the
/// server. The statement stays in flight on your connection until the lock
/// is granted or the transaction ends; roll back or drop the transaction (or
/// the connection) after abandoning a wait. Prefer [`xact_lock_timeout`],
/// which the server itself bounds.
///
/// ```no_run
/// # async fn f(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use pgelect::{lock::xact_lock, LockKey};
/// let tx = client.transaction().await?;
/// xact_lock(&tx, LockKey::from_i64(7)).await?;
/// tx.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 7", &[]).await?;
/// tx.commit().await?; // releases the lock
/// # Ok(()) }
/// ```
pub async fn xact_lock<C>(client: &C, key: LockKey) -> Result<()>
where
    C: GenericClient + Sync,
{
    wait_xact(client, key, LockMode::Exclusive).await
}

/// Like [`xact_lock`], in shared mode.
///
/// # Cancel safety
/// As for [`xact_lock`]: not cancel safe.
pub async fn xact_lock_shared<C>(client: &C, key: LockKey) -> Result<()>
where
    C: GenericClient + Sync,
{
    wait_xact(client, key, LockMode::Shared).await
}

/// Takes an exclusive transaction-level advisory lock on `client`, waiting
/// at most about `timeout`.
///
/// The bound is enforced by the server: `lock_timeout` is capped to
/// `timeout` **for this transaction only** (`set_config(.., true)`), in the
/// same statement that reads the caller's value, and the caller's value is
/// put back once the lock is held. A stricter caller value (non-zero and not
/// longer than `timeout`) is kept; `0` (no limit) is capped. So the wait is
/// never longer than the caller asked for, and statements after this one run
/// under the caller's own `lock_timeout` again.
///
/// This runs in the caller's transaction, so pgelect changes no other
/// setting there: the caller's `statement_timeout` (its own, its role's or
/// its database's, as managed services often set) still bounds the whole
/// statement, wait included. Under a 300 ms `statement_timeout` a 5 s bound
/// ends after about 300 ms with [`Error::LockTimeout`]. To wait longer, lift
/// it for the transaction first (`SET LOCAL statement_timeout = '10s'`;
/// `pgelect/tests/server_timeouts.rs` shows both).
///
/// When the wait ends with SQLSTATE `55P03` (lock timeout) or `57014`
/// (statement timeout or a cancel) the error is [`Error::LockTimeout`]. The
/// transaction is then aborted, as after any error: roll it back (the
/// `lock_timeout` change goes with it). A zero `timeout` is refused with
/// [`Error::Config`]; sub-millisecond values round up to 1 ms.
///
/// A free lock costs one short statement (`pg_try_advisory_xact_lock`,
/// which PostgreSQL refuses while a conflicting request waits, so it never
/// jumps the queue); a held one costs one more, which caps, waits and
/// restores. All are unnamed, so it works through PgBouncer in transaction
/// mode.
///
/// # Cancel safety
/// Dropping the future does not stop a wait already sent, but the server
/// ends it within `timeout`. If it is dropped after the cap and before the
/// restore, the transaction keeps the capped `lock_timeout` until it ends.
///
/// ```no_run
/// # async fn f(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use pgelect::{lock::xact_lock_timeout, LockKey};
/// let tx = client.transaction().await?;
/// match xact_lock_timeout(&tx, LockKey::from_i64(7), Duration::from_secs(2)).await {
///     Ok(()) => tx.commit().await?,
///     Err(e) if e.is_timeout() => tx.rollback().await?, // busy: try later
///     Err(e) => return Err(e.into()),
/// }
/// # Ok(()) }
/// ```
pub async fn xact_lock_timeout<C>(client: &C, key: LockKey, timeout: Duration) -> Result<()>
where
    C: GenericClient + Sync,
{
    bounded_xact(client, key, LockMode::Exclusive, timeout).await
}

/// Like [`xact_lock_timeout`], in shared mode.
///
/// # Cancel safety
/// As for [`xact_lock_timeout`].
pub async fn xact_lock_shared_timeout<C>(client: &C, key: LockKey, timeout: Duration) -> Result<()>
where
    C: GenericClient + Sync,
{
    bounded_xact(client, key, LockMode::Shared, timeout).await
}

fn db(operation: &'static str, e: tokio_postgres::Error) -> Error {
    Error::db(operation, DEFAULT_SCHEMA, e)
}

fn wait_error(key: &LockKey, started: Instant, e: tokio_postgres::Error) -> Error {
    match e.code() {
        Some(code) if is_wait_timeout_code(code.code()) => Error::LockTimeout {
            key: key.to_string(),
            waited: started.elapsed(),
            holders: Vec::new(),
        },
        _ => db("take a transaction lock", e),
    }
}

async fn try_xact<C>(client: &C, key: LockKey, mode: LockMode) -> Result<bool>
where
    C: GenericClient + Sync,
{
    let params = key.params();
    let args: Vec<_> = params.iter().map(|p| p.as_sql()).collect();
    let row = client
        .query_typed_one(xact_sql(&key, mode, true), &args)
        .await
        .map_err(|e| db("try a transaction lock", e))?;
    row.try_get(0).map_err(|e| db("try a transaction lock", e))
}

async fn wait_xact<C>(client: &C, key: LockKey, mode: LockMode) -> Result<()>
where
    C: GenericClient + Sync,
{
    let params = key.params();
    let args: Vec<_> = params.iter().map(|p| p.as_sql()).collect();
    let started = Instant::now();
    client
        .query_typed(xact_sql(&key, mode, false), &args)
        .await
        .map_err(|e| wait_error(&key, started, e))?;
    Ok(())
}

async fn bounded_xact<C>(client: &C, key: LockKey, mode: LockMode, timeout: Duration) -> Result<()>
where
    C: GenericClient + Sync,
{
    let ms = timeout_millis("the lock wait timeout", timeout)?;
    // Uncontended, the plain try is all it takes: one short statement, as
    // cheap as a bare `pg_advisory_xact_lock` (the capped wait below costs
    // about twice as much to parse and run). A try never jumps the queue:
    // PostgreSQL refuses it while a conflicting request is waiting.
    if try_xact(client, key, mode).await? {
        return Ok(());
    }
    let params = key.params();
    let mut args: Vec<_> = params.iter().map(|p| p.as_sql()).collect();
    args.push((&ms, Type::INT8));
    let started = Instant::now();
    client
        .query_typed(&bounded_sql(&key, mode), &args)
        .await
        .map_err(|e| wait_error(&key, started, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_matches_the_key_kind() {
        for mode in [LockMode::Exclusive, LockMode::Shared] {
            for try_only in [true, false] {
                for key in [LockKey::from_i64(1), LockKey::from_pair(1, 2)] {
                    let sql = xact_sql(&key, mode, try_only);
                    assert!(sql.ends_with(&format!("({})", key.sql_args(1))), "{sql}");
                    assert_eq!(sql.contains("_shared"), mode == LockMode::Shared, "{sql}");
                    assert_eq!(sql.contains("try_"), try_only, "{sql}");
                }
            }
        }
    }

    #[test]
    fn sql_names_the_right_function() {
        let k = LockKey::from_i64(1);
        assert_eq!(
            xact_sql(&k, LockMode::Exclusive, true),
            "SELECT pg_try_advisory_xact_lock($1::int8)"
        );
        assert_eq!(
            xact_sql(&LockKey::from_pair(1, 2), LockMode::Shared, false),
            "SELECT pg_advisory_xact_lock_shared($1::int4, $2::int4)"
        );
    }

    #[test]
    fn timeout_codes() {
        assert!(is_wait_timeout_code("55P03"));
        assert!(is_wait_timeout_code("57014"));
        assert!(!is_wait_timeout_code("40P01"));
    }
}
