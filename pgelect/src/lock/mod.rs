//! Advisory locks: session-scoped on dedicated connections, and
//! transaction-scoped on the caller's transaction.
//!
//! PostgreSQL's [advisory locks](https://www.postgresql.org/docs/current/explicit-locking.html#ADVISORY-LOCKS)
//! come in two scopes, and pgelect offers both:
//!
//! * **Session locks** ([`LockSession`](crate::LockSession), [`LockGuard`]) live as long as the
//!   server session that took them. pgelect takes them on a connection it
//!   opens itself and never hands to a pool, so a lock cannot leak into an
//!   unrelated request that later borrows the same pooled connection. The
//!   guard's [`lost()`](LockGuard::lost) tells you when that connection died
//!   (and with it the lock, on the server); see [`loss`](crate::loss).
//! * **Transaction locks** ([`xact_lock`]) are taken on *your* transaction
//!   and released by PostgreSQL at its commit or rollback. They need no
//!   dedicated connection and work through PgBouncer in transaction mode.
//!   With the `sqlx` feature, `pgelect::lock::sqlx::xact_lock` does the same
//!   over `&mut sqlx::PgConnection`.
//! * **Semaphores** ([`Semaphore`], [`Permit`]): at most N holders of a
//!   named resource, each holding a permit on its [`LockSession`](crate::LockSession) like a
//!   session lock (with [`lost()`](Permit::lost)); waiters are served in
//!   order of arrival.
//!
//! Every acquisition has one shape: a key (or a semaphore), a [`LockMode`]
//! and a [`Wait`] policy (not at all, forever, or at most a duration), and
//! the same kind of answer: granted, not granted at once (only with
//! [`Wait::Never`]), or an error ([`Error::LockTimeout`](crate::Error::LockTimeout) when a bounded wait
//! ran out).
//!
//! All use the keys of [`LockKey`], and share key
//! spaces with any other client that calls `pg_advisory_lock` and friends.
//!
//! ```no_run
//! use std::time::Duration;
//! use pgelect::lock::{xact_lock, LockMode, Wait};
//! use pgelect::{ConnectOptions, LockKey, LockSession};
//!
//! # async fn f(client: &mut tokio_postgres::Client) -> pgelect::Result<()> {
//! let options = ConnectOptions::from_url("postgres://app@db/app")?;
//! // A session lock, on a connection pgelect owns: one nightly report at a time.
//! let locks = LockSession::connect(&options).await?;
//! let key = LockKey::from_name("nightly-report")?;
//! if let Some(guard) = locks.acquire(key, LockMode::Exclusive, Wait::Never).await? {
//!     // ... the work, stopping if guard.lost() fires ...
//!     guard.release().await?;
//! }
//! // A transaction lock, on your transaction: released at its end.
//! let tx = client.transaction().await.expect("a transaction");
//! let wait = Wait::AtMost(Duration::from_secs(5));
//! xact_lock(&tx, LockKey::from(42i64), LockMode::Exclusive, wait).await?;
//! tx.commit().await.expect("commit");
//! # Ok(()) }
//! ```
//!
//! The book's [locks chapter](../../../book/guide/locks.html) has more.
//!
//! # Sharp edges
//! * Advisory locks are per database: the same key in two databases of one
//!   cluster is two different locks.
//! * Within a database they are shared by every user who can connect, and
//!   keys are public (a name's key is a hash anyone can compute): any such
//!   user can take a key pgelect uses and make it wait. Waits therefore say
//!   who holds their key ([`admin::lock_holders`](crate::admin::lock_holders), [`LockSession::holders`](crate::LockSession::holders), the
//!   holders of [`Error::LockTimeout`](crate::Error::LockTimeout), a warning
//!   after 5 s); to rule it out, give pgelect a database of its own or
//!   `REVOKE CONNECT ON DATABASE … FROM PUBLIC`.
//! * A session lock guards nothing by itself once its connection is gone:
//!   watch [`LockGuard::lost`] and stop the protected work when it fires.
//!   For writes that must never happen after a loss, use the fencing of the
//!   election module, not a bare lock.
//! * Release on drop is a best-effort fallback, not immediate: prefer
//!   [`LockGuard::release`], which reports what PostgreSQL did.

pub(crate) mod holders;
mod semaphore;
pub(crate) mod session;
#[cfg(feature = "sqlx")]
pub mod sqlx;
mod wait;
mod xact;

pub use crate::key::MAX_KEY_NAME_BYTES;
pub use holders::LockHolder;
pub(crate) use semaphore::semaphore_holders;
pub use semaphore::{Permit, PermitHolder, Semaphore, MAX_SEMAPHORE_LIMIT};
pub use session::{LockGuard, LockSessionBuilder};
pub use wait::Wait;
pub use xact::xact_lock;

pub(crate) use wait::{timeout_millis, wait_millis};

use crate::key::LockKey;

/// The mode of an advisory lock.
///
/// Any number of sessions or transactions may hold a key in
/// [`Shared`](LockMode::Shared) mode at once; [`Exclusive`](LockMode::Exclusive)
/// excludes every other holder, shared or exclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// One holder at a time (`pg_advisory_lock`).
    Exclusive,
    /// Many shared holders, no exclusive one (`pg_advisory_lock_shared`).
    Shared,
}

impl LockMode {
    /// The suffix PostgreSQL's function names carry for this mode.
    fn suffix(self) -> &'static str {
        match self {
            LockMode::Exclusive => "",
            LockMode::Shared => "_shared",
        }
    }

    /// The `pg_locks.mode` of a granted advisory lock in this mode.
    fn pg_locks_mode(self) -> &'static str {
        match self {
            LockMode::Exclusive => "ExclusiveLock",
            LockMode::Shared => "ShareLock",
        }
    }
}

/// The key as SQL literals, for the simple-query protocol: `'42'::int8` or
/// `'1'::int4, '2'::int4`. Integers only, so nothing to escape.
fn key_literals(key: &LockKey) -> String {
    match *key {
        LockKey::Single(k) => format!("'{k}'::int8"),
        LockKey::Pair(a, b) => format!("'{a}'::int4, '{b}'::int4"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_literals_cover_the_extremes() {
        assert_eq!(
            key_literals(&LockKey::from_i64(i64::MIN)),
            "'-9223372036854775808'::int8"
        );
        assert_eq!(
            key_literals(&LockKey::from_pair(-1, i32::MAX)),
            "'-1'::int4, '2147483647'::int4"
        );
    }

    #[test]
    fn modes_map_to_postgres_names() {
        assert_eq!(LockMode::Shared.suffix(), "_shared");
        assert_eq!(LockMode::Exclusive.pg_locks_mode(), "ExclusiveLock");
        assert_eq!(LockMode::Shared.pg_locks_mode(), "ShareLock");
    }
}
