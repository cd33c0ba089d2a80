//! Who holds what: the holders of a key or a semaphore, and every lock that
//! a named lock session holds or waits for (what `pgelect status` lists).
//!
//! A lock session may carry a *lock name and node* in its
//! `application_name` ([`lock_session_name`]), as `pgelect lock` does:
//! `pgelect:lock:<name>@<node>`. That is how [`HeldLock`] learns a holder's
//! lock name and node; a claim the client chose, like any application name.

use std::time::{Duration, SystemTime};

use tokio_postgres::GenericClient;

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::lock::{LockHolder, LockMode, PermitHolder, Semaphore, MAX_SEMAPHORE_LIMIT};

/// Lists the backends of this database, other than the caller's own, that
/// hold `key` (granted, in either mode). Waiters are not listed.
///
/// Needs no privilege: `pg_locks` and the pid, user and application name of
/// `pg_stat_activity` are visible to every user; client address and state
/// need `pg_read_all_stats` (or the same user) and are `None` otherwise.
///
/// ```no_run
/// # async fn f(client: &tokio_postgres::Client) -> Result<(), pgelect::Error> {
/// let key = pgelect::LockKey::from_name("nightly-report")?;
/// for holder in pgelect::admin::lock_holders(client, key).await? {
///     eprintln!("held by {holder}");
/// }
/// # Ok(()) }
/// ```
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn lock_holders<C: GenericClient + Sync>(
    client: &C,
    key: LockKey,
) -> Result<Vec<LockHolder>> {
    crate::lock::holders::lock_holders(client, key).await
}

/// Lists the sessions of this database that hold permits of `semaphore`,
/// by slot, the caller's own included (see [`lock_holders`] for what is
/// visible to whom).
///
/// ```no_run
/// # async fn f(client: &tokio_postgres::Client) -> Result<(), pgelect::Error> {
/// let jobs = pgelect::lock::Semaphore::new("nightly-jobs", 3)?;
/// for p in pgelect::admin::semaphore_holders(client, &jobs).await? {
///     eprintln!("slot {} held by {}", p.slot, p.holder);
/// }
/// # Ok(()) }
/// ```
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn semaphore_holders<C: GenericClient + Sync>(
    client: &C,
    semaphore: &Semaphore,
) -> Result<Vec<PermitHolder>> {
    crate::lock::semaphore_holders(client, semaphore).await
}

/// What `application_name` starts with for a lock session named by
/// [`lock_session_name`].
const LOCK_SESSION_PREFIX: &str = "pgelect:lock:";

/// The `application_name` of a library [`LockSession`](crate::LockSession)
/// left with its default name.
const DEFAULT_LOCK_SESSION: &str = "pgelect:locks";

/// PostgreSQL keeps at most 63 bytes of `application_name`.
const APPLICATION_NAME_BYTES: usize = 63;

/// The name to give a lock session
/// ([`LockSessionBuilder::name`](crate::lock::LockSessionBuilder::name)) so that
/// [`AdminClient::held_locks`](super::AdminClient::held_locks) and waiters
/// can say which lock it holds and for which node: `lock:<name>@<node>`
/// (the session prefixes `pgelect:`), cut to fit `application_name`
/// (63 bytes): the lock's name first (at most 40 characters), the node
/// after the last `@`. Characters PostgreSQL would not keep (non-ASCII,
/// controls) are left out.
///
/// ```
/// let name = pgelect::admin::lock_session_name("deploy", "node-a");
/// assert_eq!(name, "lock:deploy@node-a");
/// ```
pub fn lock_session_name(lock: &str, node: &str) -> String {
    let kept = |c: &char| c.is_ascii() && !c.is_ascii_control();
    let lock: String = lock.chars().filter(kept).take(40).collect();
    let mut out = format!("lock:{lock}@");
    for c in node.chars().filter(kept) {
        if out.len() + "pgelect:".len() + c.len_utf8() > APPLICATION_NAME_BYTES {
            break;
        }
        out.push(c);
    }
    out
}

/// The lock name and node an `application_name` claims
/// (`pgelect:lock:<name>@<node>`, see [`lock_session_name`]), if it is one.
pub(crate) fn parse_lock_session_name(application_name: &str) -> Option<(&str, &str)> {
    application_name
        .strip_prefix(LOCK_SESSION_PREFIX)?
        .rsplit_once('@')
}

/// What a key held or waited for by a named lock session is, given the
/// lock name its session recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HeldLockKind {
    /// The lock of that name (`LockKey::from_name(name)`).
    Lock,
    /// Slot `i` of the semaphore of that name: a permit.
    Permit(u32),
    /// The semaphore's gate: its holder is the first waiter for a permit,
    /// its waiters the others.
    PermitQueue,
    /// Something else: a name cut to fit `application_name`, a key the
    /// session took otherwise, or a session with no recorded name.
    Other,
}

impl HeldLockKind {
    /// Classifies `key` for the lock or semaphore called `name`.
    fn of(name: &str, key: LockKey) -> HeldLockKind {
        if LockKey::from_name(name).ok() == Some(key) {
            return HeldLockKind::Lock;
        }
        let Ok(semaphore) = Semaphore::new(name, MAX_SEMAPHORE_LIMIT) else {
            return HeldLockKind::Other;
        };
        if semaphore.gate_key() == key {
            return HeldLockKind::PermitQueue;
        }
        (0..semaphore.limit())
            .find(|i| semaphore.slot_key(*i) == Some(key))
            .map_or(HeldLockKind::Other, HeldLockKind::Permit)
    }
}

/// An advisory lock held or waited for by a lock session that names
/// itself: `pgelect lock` ([`lock_session_name`]), or a library
/// [`LockSession`](crate::LockSession) under its default name.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldLock {
    /// The lock's name as the session recorded it (cut at 40 characters);
    /// `None` for a library session under its default name, which records
    /// none.
    pub name: Option<String>,
    /// The key.
    pub key: LockKey,
    /// The node the session names; `None` as for `name`.
    pub node: Option<String>,
    /// The client's address; `None` over a Unix socket or when this user
    /// may not see it.
    pub client_addr: Option<String>,
    /// The server process serving the session (`pg_locks.pid`).
    pub backend_pid: i32,
    /// The mode held or asked for.
    pub mode: LockMode,
    /// True when held, false when waited for.
    pub granted: bool,
    /// When the holder took it, on the server's clock (its session went
    /// idle then); `None` for a waiter, a busy session, or when this user
    /// may not see it.
    pub since: Option<SystemTime>,
    /// A lock, or a semaphore's permit or queue.
    pub kind: HeldLockKind,
}

/// Every advisory lock held or waited for by a named lock session of this
/// database, by key, holders first, then by the sessions' age.
pub(crate) async fn held_locks<C: GenericClient + Sync>(client: &C) -> Result<Vec<HeldLock>> {
    const WHAT: &str = "read pg_locks";
    let sql = "SELECT a.application_name, ((l.classid::bigint << 32) | l.objid::bigint) AS key,
            host(a.client_addr), l.pid, l.mode, l.granted,
            CASE WHEN l.granted AND a.state = 'idle' THEN a.state_change END
       FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
      WHERE l.locktype = 'advisory' AND l.objsubid = 1
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND (starts_with(a.application_name, $1) OR a.application_name = $2)
      ORDER BY 2, l.granted DESC, a.backend_start";
    let rows = client
        .query(sql, &[&LOCK_SESSION_PREFIX, &DEFAULT_LOCK_SESSION])
        .await
        .map_err(|e| Error::db(WHAT, "\0", e))?;
    let decode =
        |row: &tokio_postgres::Row| -> std::result::Result<HeldLock, tokio_postgres::Error> {
            let app: String = row.try_get(0)?;
            let key = LockKey::from_i64(row.try_get(1)?);
            let (name, node) = match parse_lock_session_name(&app) {
                Some((name, node)) => (Some(name.to_owned()), Some(node.to_owned())),
                None => (None, None),
            };
            Ok(HeldLock {
                kind: name
                    .as_deref()
                    .map_or(HeldLockKind::Other, |n| HeldLockKind::of(n, key)),
                name,
                key,
                node,
                client_addr: row.try_get(2)?,
                backend_pid: row.try_get(3)?,
                mode: if row.try_get::<_, &str>(4)? == "ShareLock" {
                    LockMode::Shared
                } else {
                    LockMode::Exclusive
                },
                granted: row.try_get(5)?,
                since: row.try_get(6)?,
            })
        };
    rows.iter()
        .map(|r| decode(r).map_err(|e| Error::db(WHAT, "\0", e)))
        .collect()
}

/// A duration in seconds from the server, if it makes sense.
pub(crate) fn seconds(s: Option<f64>) -> Option<Duration> {
    s.filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_told_apart() {
        let plain = LockKey::from_name("jobs").unwrap();
        assert_eq!(HeldLockKind::of("jobs", plain), HeldLockKind::Lock);
        let sem = Semaphore::new("jobs", 3).unwrap();
        assert_eq!(
            HeldLockKind::of("jobs", sem.slot_key(2).unwrap()),
            HeldLockKind::Permit(2)
        );
        assert_eq!(
            HeldLockKind::of("jobs", sem.gate_key()),
            HeldLockKind::PermitQueue
        );
        assert_eq!(
            HeldLockKind::of("jobs", LockKey::from_i64(42)),
            HeldLockKind::Other
        );
    }

    #[test]
    fn lock_session_names_fit_and_parse_back() {
        let a = lock_session_name("deploy", "node-a");
        assert_eq!(a, "lock:deploy@node-a");
        let full = format!("pgelect:{a}");
        assert_eq!(parse_lock_session_name(&full), Some(("deploy", "node-a")));
        let long = lock_session_name(&"n".repeat(100), &"h".repeat(100));
        assert!(long.len() + "pgelect:".len() <= 63, "{long}");
        assert!(long.contains(&format!("{}@h", "n".repeat(40))), "{long}");
        assert_eq!(parse_lock_session_name("pgelect:r:node"), None);
    }
}
