//! `pgelect lock`: flock(1) for a fleet.

use std::time::Duration;

use clap::Args;
use pgelect::{LockKey, LockSession};

use crate::child;
use crate::cli::Global;
use crate::exit::{self, Failure};
use crate::signals::Signals;

#[derive(Debug, Args)]
pub struct LockArgs {
    /// Name of the lock; the same name locks the same key on every machine
    /// (and in SQL: pgelect.key(NAME)).
    #[arg(long, value_name = "NAME")]
    pub key: String,
    /// Take the lock in shared mode (many shared holders, no exclusive one).
    #[arg(long)]
    pub shared: bool,
    /// Give up after waiting this long (500ms, 10s, 2m); exit 75.
    // allow_hyphen_values: `--timeout -1s` reaches the parser and gets its
    // "is negative" message instead of clap's advice to write `-- -1`, which
    // would make `-1` the command.
    #[arg(long, value_parser = crate::duration::parse_positive, conflicts_with = "no_wait", value_name = "DURATION", allow_hyphen_values = true)]
    pub timeout: Option<Duration>,
    /// Do not wait: exit 75 at once if the lock is held elsewhere.
    #[arg(long, short = 'n')]
    pub no_wait: bool,
    /// Time the command gets between SIGTERM and SIGKILL when pgelect is
    /// asked to stop.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "10s", value_name = "DURATION", allow_hyphen_values = true)]
    pub grace: Duration,
    /// Give the command the database variables pgelect was started with
    /// (DATABASE_URL, PGPASSWORD, PGPASSFILE, PGUSER, PGHOST and the rest of
    /// libpq's set); without this flag they are removed from its environment.
    #[arg(long)]
    pub pass_database_env: bool,
    /// The command to run while holding the lock, after `--` (passed byte
    /// for byte).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<std::ffi::OsString>,
}

pub async fn run(global: &Global, args: LockArgs) -> Result<u8, Failure> {
    let key = LockKey::from_name(&args.key)?;
    let options = global.connect_options()?;
    let mut signals = Signals::install()?;
    let session = LockSession::builder(&options)
        .name(format!("lock:{}", short(&args.key)))
        .connect()
        .await?;
    let acquiring = async {
        match (args.no_wait, args.timeout, args.shared) {
            (true, _, false) => session.try_lock(key).await,
            (true, _, true) => session.try_lock_shared(key).await,
            (false, Some(t), false) => session.lock_timeout(key, t).await.map(Some),
            (false, Some(t), true) => session.lock_shared_timeout(key, t).await.map(Some),
            (false, None, false) => session.lock(key).await.map(Some),
            (false, None, true) => session.lock_shared(key).await.map(Some),
        }
    };
    let guard = tokio::select! {
        got = acquiring => match got {
            Ok(Some(guard)) => guard,
            Ok(None) => {
                let holders = session.holders(key).await.unwrap_or_default();
                return Err(Failure::new(exit::TEMPFAIL, format!(
                    "lock {:?} is {}; not waiting (--no-wait)",
                    args.key, describe(&holders)
                )));
            }
            Err(pgelect::Error::LockTimeout { waited, holders, .. }) => {
                return Err(Failure::new(exit::TEMPFAIL, format!(
                    "lock {:?} not acquired within {:.1}s: {}",
                    args.key, waited.as_secs_f64(), describe(&holders)
                )));
            }
            Err(e) if e.is_timeout() => {
                return Err(Failure::new(exit::TEMPFAIL, format!("lock {:?} not acquired: {e}", args.key)));
            }
            Err(e) => return Err(e.into()),
        },
        sig = signals.recv() => {
            withdraw_wait(&session, key, args.shared).await;
            return Err(Failure::new(exit::TEMPFAIL, format!("interrupted by {sig} while waiting for lock {:?}", args.key)));
        }
    };
    tracing::info!(key = %args.key, "lock acquired; starting the command");
    let env = [("PGELECT_LOCK", args.key.clone())];
    let mut child = child::spawn(&child::Spec {
        argv: &args.command,
        env: &env,
        pass_database_env: args.pass_database_env,
    })?;
    tracing::debug!(watcher = child.watcher_pid(), "command started");
    let outcome = tokio::select! {
        status = child.wait() => {
            let status = status.map_err(|e| Failure::new(exit::SOFTWARE, format!("waiting for the command failed: {e}")))?;
            Ok(child::exit_code(status))
        }
        _ = guard.lost() => {
            let _ = child.kill_now().await;
            Err(Failure::new(exit::UNAVAILABLE, format!("lost lock {:?}: its database connection ended; the command was killed", args.key)))
        }
        sig = signals.recv() => {
            tracing::info!(%sig, "stopping the command");
            let status = child.stop(args.grace).await.map_err(|e| Failure::new(exit::SOFTWARE, format!("stopping the command failed: {e}")))?;
            Ok(child::exit_code(status))
        }
    };
    // What the command left running in the background must not outlive the
    // lock: its watcher killed all of it before reporting the command's
    // exit (and `kill_now` waited for that).
    drop(child);
    if outcome.is_ok() {
        match guard.release().await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(key = %args.key, "the lock was no longer held at release"),
            Err(e) => {
                tracing::warn!(key = %args.key, error = %e, "releasing the lock failed; the server frees it when the connection closes")
            }
        }
    }
    outcome
}

/// Returns once a lock wait abandoned by dropping its future has been
/// withdrawn on the server (at most 5 s).
///
/// The library cancels an abandoned wait in a background task. PostgreSQL
/// does not notice a client that goes away while its backend waits for a
/// lock, so exiting before that task ran would leave a ghost waiter queued
/// on the server until the lock is granted, and an exclusive ghost blocks
/// every later shared request meanwhile. A session runs its operations in
/// order, so the next one completes only after the cancel: a `try_lock` is
/// that barrier (and is released at once should it win the lock).
async fn withdraw_wait(session: &LockSession, key: LockKey, shared: bool) {
    let barrier = async {
        let got = if shared {
            session.try_lock_shared(key).await
        } else {
            session.try_lock(key).await
        };
        if let Ok(Some(guard)) = got {
            let _ = guard.release().await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(5), barrier)
        .await
        .is_err()
    {
        tracing::warn!("the abandoned lock wait was not withdrawn in 5s; the server ends it when the lock is granted");
    }
}

/// Who holds a lock, for a message: `held by pid 4242 (user "mallory",
/// application "psql")`. The text the client chose is escaped by
/// `LockHolder`'s `Display`.
fn describe(holders: &[pgelect::LockHolder]) -> String {
    if holders.is_empty() {
        return "held elsewhere (its holder let go or could not be seen)".to_owned();
    }
    let list: Vec<String> = holders.iter().map(ToString::to_string).collect();
    format!("held by {}", list.join(", "))
}

/// A name cut to fit `application_name` (63 bytes) with room for a prefix.
fn short(name: &str) -> String {
    name.chars().take(40).collect()
}
