//! A lock held across a long job, with its loss handled: one process of the
//! fleet at a time runs the nightly job, and if the lock is lost midway (the
//! lock's connection dies with a database restart or a network failure, and
//! another process may take the lock), the job is cancelled at once instead
//! of running on unprotected.
//!
//! ```sh
//! DATABASE_URL=postgres://app:secret@localhost/app \
//!     cargo run -p pgelect --example long_job_lock
//! ```
//!
//! Run it twice at once: the second waits up to 10 s for the lock, then
//! gives up. The job is 20 steps of 500 ms.
//!
//! With `PGELECT_EXAMPLE_ONCE=1` (as `scripts/run-examples.sh` runs it) the
//! example ends its own lock connection after 1 s, from a second
//! connection with `pg_terminate_backend`, as a database restart would,
//! and shows the job being cancelled (it exits 0 when the job was
//! cancelled, as expected).
//!
//! No schema is needed: the lock is a session advisory lock on a
//! connection the `LockSession` owns.

use std::error::Error;
use std::time::Duration;

use pgelect::lock::{LockMode, Wait};
use pgelect::{ConnectOptions, LockKey, LockSession};
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn Error + Send + Sync>;

const STEPS: u32 = 20;

/// The long job: checks `cancel` between steps and stops when it fires.
/// Returns the number of steps done.
async fn nightly_job(cancel: CancellationToken) -> u32 {
    for step in 0..STEPS {
        tokio::select! {
            _ = cancel.cancelled() => return step, // a step never half-runs
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        println!("step {} of {STEPS} done", step + 1);
    }
    STEPS
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let once = std::env::var_os("PGELECT_EXAMPLE_ONCE").is_some();
    let options = ConnectOptions::from_url(&url)?;

    let locks = LockSession::connect(&options).await?;
    let key = LockKey::from_name("example-nightly-job")?;
    let wait = Wait::AtMost(Duration::from_secs(10));
    let guard = match locks.acquire(key, LockMode::Exclusive, wait).await {
        Ok(Some(guard)) => guard,
        Ok(None) => unreachable!("only Wait::Never answers None"),
        Err(e) if e.is_timeout() => {
            println!("another process runs the job: {e}");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    println!(
        "lock taken (server pid {}), job starting",
        guard.backend_pid()
    );
    if once {
        tokio::spawn(end_connection_soon(url, guard.backend_pid()));
    }

    // Cancelled when the lock is lost: hand it to the job (and to whatever
    // tasks it spawns).
    let done = nightly_job(guard.token()).await;
    if let Some(loss) = guard.loss() {
        // `connection_lost`: the only way a lock is lost.
        let reason = loss.reason();
        println!("lock lost after {done} of {STEPS} steps: job cancelled ({reason})");
        // Nothing to release: the lock went with its connection. Rerun the
        // job from its last checkpoint under a new lock.
        return if once {
            Ok(())
        } else {
            Err("lock lost, job cancelled".into())
        };
    }
    // True if PostgreSQL really released it (false: it was already gone).
    let released = guard.release().await?;
    println!("job done, lock released: {released}");
    if once {
        return Err("expected the lock to be lost in PGELECT_EXAMPLE_ONCE mode".into());
    }
    Ok(())
}

/// Plays the database restart: terminates the lock's connection after 1 s.
async fn end_connection_soon(url: String, pid: i32) -> Result<(), BoxError> {
    let (db, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    tokio::time::sleep(Duration::from_secs(1)).await;
    println!("(ending the lock's connection, pid {pid})");
    db.execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await?;
    Ok(())
}
