//! [`migrate`], the one schema function at the crate root (the rest of the
//! schema's API is in [`crate::schema`]).

use super::{migrate_timeout, MIGRATE_LOCK_TIMEOUT};
use crate::conn::ConnectOptions;
use crate::error::Result;

/// Installs or upgrades the pgelect schema on the database `options` point at.
///
/// Idempotent, and safe to run from many processes at once: the migration is
/// serialised by a session advisory lock on a dedicated connection. The
/// wait for that lock is bounded by [`MIGRATE_LOCK_TIMEOUT`](crate::schema::MIGRATE_LOCK_TIMEOUT) (30 s; see
/// [`migrate_timeout`](crate::schema::migrate_timeout) for another bound): advisory keys are public and
/// database-wide, so any user who can connect could hold it forever.
///
/// # Cancel safety
/// Not cancel safe in the sense that a cancelled call may leave the dedicated
/// connection's advisory lock to be released by the connection's closing;
/// every migration itself runs in a transaction, so the schema is never left
/// half-migrated.
///
/// ```no_run
/// # async fn f() -> Result<(), pgelect::Error> {
/// let options = pgelect::ConnectOptions::from_url("postgres://app@db/app")?;
/// let applied = pgelect::migrate(&options).await?;
/// println!("applied {applied} migrations");
/// # Ok(()) }
/// ```
pub async fn migrate(options: &ConnectOptions) -> Result<u32> {
    migrate_timeout(options, MIGRATE_LOCK_TIMEOUT).await
}
