//! `pgelect lock`: flock(1) for a fleet.

use std::time::Duration;

use clap::Args;
use pgelect::lock::{LockGuard, LockMode, Permit, Semaphore, Wait};
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
    /// Let up to N holders run at once (a semaphore, as `consul lock -n`):
    /// the command runs while holding one of NAME's N permits. Every user
    /// of NAME must give the same N. Waiters are served in order.
    #[arg(long, value_name = "N", conflicts_with = "shared", value_parser = clap::value_parser!(u32).range(1..=pgelect::lock::MAX_SEMAPHORE_LIMIT as i64))]
    pub limit: Option<u32>,
    /// Give up after waiting this long: seconds as flock(1) takes them
    /// (`-w 5`, `-w 0.5`) or with a unit (500ms, 10s, 2m); then exit with
    /// --conflict-exit-code.
    // allow_hyphen_values: `--timeout -1s` reaches the parser and gets its
    // "is negative" message instead of clap's advice to write `-- -1`, which
    // would make `-1` the command.
    #[arg(long, short = 'w', alias = "wait", value_parser = crate::duration::parse_positive, conflicts_with = "no_wait", value_name = "DURATION", allow_hyphen_values = true)]
    pub timeout: Option<Duration>,
    /// Do not wait: exit with --conflict-exit-code at once if the lock is
    /// held elsewhere, naming the holder.
    #[arg(long, short = 'n')]
    pub no_wait: bool,
    /// Exit code when the lock was not acquired (--no-wait, --timeout), as
    /// flock -E. Default: 75 (EX_TEMPFAIL).
    #[arg(long, short = 'E', default_value_t = exit::TEMPFAIL, value_name = "N")]
    pub conflict_exit_code: u8,
    /// This machine's name as other commands show the holder (`status`,
    /// a waiting `pgelect lock`). Default: the host name.
    #[arg(long = "id", value_name = "NODE")]
    pub node: Option<String>,
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

/// The permit or lock the command runs under.
enum Held {
    Lock(LockGuard),
    Permit(Permit),
}

impl Held {
    async fn lost(&self) -> pgelect::loss::Loss {
        match self {
            Held::Lock(g) => g.lost().await,
            Held::Permit(p) => p.lost().await,
        }
    }

    async fn release(self) -> pgelect::Result<bool> {
        match self {
            Held::Lock(g) => g.release().await,
            Held::Permit(p) => p.release().await,
        }
    }
}

pub async fn run(global: &Global, args: LockArgs) -> Result<u8, Failure> {
    let semaphore = match args.limit {
        Some(limit) => Some(Semaphore::new(args.key.as_str(), limit)?),
        None => None,
    };
    let key = LockKey::from_name(&args.key)?;
    let node = match &args.node {
        Some(node) => {
            crate::run::check_name("--id", node)?;
            node.clone()
        }
        None => host_name(),
    };
    let options = global.connect_options()?;
    let mut signals = Signals::install()?;
    let session = LockSession::builder(&options)
        .name(pgelect::admin::lock_session_name(&args.key, &node))
        .connect()
        .await?;
    let conflict = args.conflict_exit_code;
    if let Some(semaphore) = &semaphore {
        let permit = tokio::select! {
            got = acquire_permit(&session, semaphore, &args) => got?,
            sig = signals.recv() => {
                withdraw_permit_wait(&session, semaphore).await;
                return Err(Failure::new(exit::TEMPFAIL, format!("interrupted by {sig} while waiting for a permit of {:?}", args.key)));
            }
        };
        let env = [
            ("PGELECT_LOCK", args.key.clone()),
            ("PGELECT_PERMIT", permit.slot().to_string()),
        ];
        tracing::info!(key = %args.key, slot = permit.slot(), "permit acquired; starting the command");
        return run_command(&args, &env, &mut signals, Held::Permit(permit)).await;
    }
    let acquiring = session.acquire(key, mode(&args), wait(&args));
    let guard = tokio::select! {
        got = acquiring => match got {
            Ok(Some(guard)) => guard,
            Ok(None) => {
                let holders = session.holders(key).await.unwrap_or_default();
                return Err(Failure::new(conflict, format!(
                    "lock {:?} is {}; not waiting (--no-wait)",
                    args.key, describe(&holders)
                )));
            }
            Err(pgelect::Error::LockTimeout { waited, holders, .. }) => {
                // The bound the user gave, as flock(1) reports it: the
                // measured wait overshoots it on a busy machine.
                let waited = args.timeout.unwrap_or(waited);
                return Err(Failure::new(conflict, format!(
                    "timed out after {:.1}s waiting for lock {:?} (not acquired), {}",
                    waited.as_secs_f64(), args.key, describe(&holders)
                )));
            }
            Err(e) if e.is_timeout() => {
                return Err(Failure::new(conflict, format!("lock {:?} not acquired: {e}", args.key)));
            }
            Err(e) => return Err(e.into()),
        },
        sig = signals.recv() => {
            withdraw_wait(&session, key, mode(&args)).await;
            return Err(Failure::new(exit::TEMPFAIL, format!("interrupted by {sig} while waiting for lock {:?}", args.key)));
        }
    };
    tracing::info!(key = %args.key, "lock acquired; starting the command");
    let env = [("PGELECT_LOCK", args.key.clone())];
    run_command(&args, &env, &mut signals, Held::Lock(guard)).await
}

/// The lock mode the flags ask for.
fn mode(args: &LockArgs) -> LockMode {
    if args.shared {
        LockMode::Shared
    } else {
        LockMode::Exclusive
    }
}

/// How long the flags let an acquisition wait (`--no-wait`, `--timeout`).
fn wait(args: &LockArgs) -> Wait {
    match (args.no_wait, args.timeout) {
        (true, _) => Wait::Never,
        (false, Some(t)) => Wait::AtMost(t),
        (false, None) => Wait::Forever,
    }
}

/// Runs the command while `held` lasts; releases it after a normal end.
async fn run_command(
    args: &LockArgs,
    env: &[(&str, String)],
    signals: &mut Signals,
    held: Held,
) -> Result<u8, Failure> {
    let mut child = child::spawn(&child::Spec {
        argv: &args.command,
        env,
        pass_database_env: args.pass_database_env,
    })?;
    tracing::debug!(watcher = child.watcher_pid(), "command started");
    let outcome = tokio::select! {
        status = child.wait() => {
            let status = status.map_err(|e| Failure::new(exit::SOFTWARE, format!("waiting for the command failed: {e}")))?;
            Ok(child::exit_code(status))
        }
        _ = held.lost() => {
            let _ = child.kill_now().await;
            let what = if args.limit.is_some() { "a permit of" } else { "lock" };
            Err(Failure::new(exit::UNAVAILABLE, format!("lost {what} {:?}: its database connection ended; the command was killed", args.key)))
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
        match held.release().await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(key = %args.key, "the lock was no longer held at release"),
            Err(e) => {
                tracing::warn!(key = %args.key, error = %e, "releasing the lock failed; the server frees it when the connection closes")
            }
        }
    }
    outcome
}

/// Takes a permit as the flags say; a permit not acquired is a failure with
/// --conflict-exit-code naming who holds the permits.
async fn acquire_permit(
    session: &LockSession,
    semaphore: &Semaphore,
    args: &LockArgs,
) -> Result<Permit, Failure> {
    let conflict = args.conflict_exit_code;
    match session.acquire_permit(semaphore, wait(args)).await {
        Ok(Some(permit)) => Ok(permit),
        Ok(None) => {
            let holders = session.permit_holders(semaphore).await.unwrap_or_default();
            Err(Failure::new(
                conflict,
                format!(
                    "no permit of {:?} for a newcomer (limit {}): {}; not waiting (--no-wait)",
                    args.key,
                    semaphore.limit(),
                    describe_permits(semaphore, &holders)
                ),
            ))
        }
        Err(pgelect::Error::LockTimeout { waited, .. }) => {
            let waited = args.timeout.unwrap_or(waited);
            let holders = session.permit_holders(semaphore).await.unwrap_or_default();
            Err(Failure::new(
                conflict,
                format!(
                    "timed out after {:.1}s waiting for a permit of {:?} (limit {}, not acquired): {}",
                    waited.as_secs_f64(),
                    args.key,
                    semaphore.limit(),
                    describe_permits(semaphore, &holders)
                ),
            ))
        }
        Err(e) => Err(e.into()),
    }
}

/// `2 of 3 permits held by …; others may wait first` for a message.
fn describe_permits(semaphore: &Semaphore, holders: &[pgelect::lock::PermitHolder]) -> String {
    let list: Vec<pgelect::lock::LockHolder> = holders.iter().map(|p| p.holder.clone()).collect();
    let n = holders.len();
    let held = if n == 0 {
        "no permit held (holders let go, or could not be seen)".to_owned()
    } else {
        let by = describe(&list);
        format!("{n} of {} permits {by}", semaphore.limit(),)
    };
    if n < semaphore.limit() as usize {
        format!("{held}; other sessions may be waiting for a permit, and they come first")
    } else {
        held
    }
}

/// As [`withdraw_wait`], for a permit wait: the next acquisition on the
/// session runs once the abandoned one has withdrawn its wait and released
/// what it held.
async fn withdraw_permit_wait(session: &LockSession, semaphore: &Semaphore) {
    let barrier = async {
        if let Ok(Some(permit)) = session.acquire_permit(semaphore, Wait::Never).await {
            let _ = permit.release().await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(5), barrier)
        .await
        .is_err()
    {
        tracing::warn!("the abandoned permit wait was not withdrawn in 5s; the server ends it when the gate is granted");
    }
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
async fn withdraw_wait(session: &LockSession, key: LockKey, mode: LockMode) {
    let barrier = async {
        if let Ok(Some(guard)) = session.acquire(key, mode, Wait::Never).await {
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

/// Who holds a lock, for a message: `held by node-a (host 10.0.0.7, pid
/// 4242, for 3.2s)` for another `pgelect lock`, `held by pid 4242 (user
/// "mallory", application "psql", for 3.2s)` for anything else. The text the
/// client chose is escaped (`{:?}` or `LockHolder`'s `Display`).
fn describe(holders: &[pgelect::lock::LockHolder]) -> String {
    if holders.is_empty() {
        return "held elsewhere (its holder let go or could not be seen)".to_owned();
    }
    let list: Vec<String> = holders
        .iter()
        .map(|h| {
            // An idle holder's state last changed when it took the lock.
            let held = h
                .state_age
                .map(|d| format!(", for {:.1}s", d.as_secs_f64()))
                .unwrap_or_default();
            match h.claims_lock_session() {
                Some((_, node)) => {
                    let host = h.client_addr.as_deref().unwrap_or("local socket");
                    format!("{node:?} (host {host}, pid {}{held})", h.pid)
                }
                None => {
                    let shown = h.to_string();
                    format!("{}{held})", shown.strip_suffix(')').unwrap_or(&shown))
                }
            }
        })
        .collect();
    format!("held by {}", list.join(", "))
}

/// This machine's host name (`/proc/sys/kernel/hostname`), else `unknown`.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}
