//! A semaphore around a fragile upstream: however many callers there are,
//! across every process of the fleet, at most 2 call the upstream at once;
//! the others queue in arrival order, and a caller that would wait more than
//! its budget gives up instead of piling up.
//!
//! ```sh
//! DATABASE_URL=postgres://app:secret@localhost/app \
//!     cargo run -p pgelect --example semaphore
//! ```
//!
//! It starts 6 callers in this process (run it in two terminals at once to
//! see the limit hold across processes), each waiting at most 3 s for a
//! permit, plus one impatient caller that waits at most 50 ms. It ends by
//! itself and prints how many callers were served, how many gave up, and
//! the most calls this process saw in flight at once (never more than 2).
//!
//! No schema is needed: permits are advisory locks. A permit is held on a
//! `LockSession`, one dedicated connection per concurrent caller.

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgelect::{lock::Semaphore, ConnectOptions, LockSession};

type BoxError = Box<dyn Error + Send + Sync>;

const LIMIT: u32 = 2;

/// Calls in flight in this process, and the most seen at once.
#[derive(Default)]
struct InFlight {
    now: AtomicUsize,
    most: AtomicUsize,
}

/// The fragile upstream: a slow call that must not run more than
/// `LIMIT` times at once.
async fn call_upstream(in_flight: &InFlight) {
    let now = in_flight.now.fetch_add(1, Ordering::SeqCst) + 1;
    in_flight.most.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    in_flight.now.fetch_sub(1, Ordering::SeqCst);
}

/// One caller: waits at most `budget` for a permit, then calls the
/// upstream while holding it. `Ok(false)` when it gave up.
async fn caller(
    options: ConnectOptions,
    upstream: Semaphore,
    budget: Duration,
    in_flight: Arc<InFlight>,
) -> Result<bool, BoxError> {
    let session = LockSession::connect(&options).await?;
    let permit = match session.acquire_permit_timeout(&upstream, budget).await {
        Ok(permit) => permit,
        Err(e) if e.is_timeout() => return Ok(false), // upstream busy: shed the load
        Err(e) => return Err(e.into()),
    };
    tokio::select! {
        // The permit's connection died: the slot is free for someone else
        // already, so stop calling.
        _ = permit.lost() => return Err("permit lost during the call".into()),
        _ = call_upstream(&in_flight) => {}
    }
    permit.release().await?;
    Ok(true)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let options = ConnectOptions::from_url(&url)?;
    // Every user of the name must give the same limit.
    let upstream = Semaphore::new("example-fragile-upstream", LIMIT)?;
    let in_flight = Arc::new(InFlight::default());

    let mut callers = tokio::task::JoinSet::new();
    let budgets = [Duration::from_secs(3); 6]
        .into_iter()
        .chain([Duration::from_millis(50)]);
    for budget in budgets {
        let task = caller(options.clone(), upstream.clone(), budget, in_flight.clone());
        callers.spawn(task);
    }
    let (mut served, mut gave_up) = (0, 0);
    while let Some(outcome) = callers.join_next().await {
        match outcome? {
            Ok(true) => served += 1,
            Ok(false) => gave_up += 1,
            Err(e) => eprintln!("caller failed: {e}"),
        }
    }
    let most = in_flight.most.load(Ordering::SeqCst);
    println!("served {served}, gave up {gave_up}, at most {most} calls in flight at once (limit {LIMIT})");
    if most > LIMIT as usize {
        return Err(format!("the limit was exceeded: {most} > {LIMIT}").into());
    }
    Ok(())
}
