//! A singleton scheduler: of all the processes running this program, one at
//! a time runs the scheduled job, and every write of the job is fenced with
//! the leader's term, so that a deposed leader (paused by a GC, a SIGSTOP or
//! a VM migration, or cut off) can never commit after its successor began.
//!
//! ```sh
//! DATABASE_URL=postgres://app:secret@localhost/app \
//!     cargo run -p pgelect --example singleton_scheduler
//! ```
//!
//! Start it in several terminals: one schedules, the others stand by. Stop
//! the leader with Ctrl-C (a clean handover) or kill it, and another one
//! takes over with a higher term.
//!
//! With `PGELECT_EXAMPLE_ONCE=1` (as `scripts/run-examples.sh` runs it) it
//! runs three jobs, then plays the deposed leader: it resigns, is elected
//! again with a new term, shows that a write fenced with the old term is
//! refused, and exits.
//!
//! The job writes through a plain tokio-postgres connection (`NoTls`; use a
//! TLS connector for a remote database).

use std::error::Error;
use std::time::Duration;

use pgelect::{election::LeaderContext, ConnectOptions, Elector};
use tokio_postgres::{Client, NoTls};

type BoxError = Box<dyn Error + Send + Sync>;

const EVERY: Duration = Duration::from_secs(1);

/// One run of the scheduled job. Its write commits only while `leader`'s
/// term is the role's current term: `fence` fails with `Error::StaleTerm`
/// (or `NoLeader`) otherwise, and holds the term until the commit.
async fn run_job(db: &mut Client, leader: &LeaderContext) -> Result<(), BoxError> {
    let tx = db.transaction().await?;
    leader.fence(&tx).await?;
    tx.execute(
        "INSERT INTO scheduler_runs (term) VALUES ($1)",
        &[&leader.term().get()],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// True when `e` says a newer term began (or nobody leads): stop writing.
fn deposed(e: &BoxError) -> bool {
    e.downcast_ref::<pgelect::Error>()
        .is_some_and(pgelect::Error::is_leadership_lost)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let once = std::env::var_os("PGELECT_EXAMPLE_ONCE").is_some();
    let options = ConnectOptions::from_url(&url)?;
    pgelect::migrate(&options).await?; // idempotent; usually a deploy step

    let (mut db, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS scheduler_runs (
             term bigint NOT NULL, at timestamptz NOT NULL DEFAULT now())",
    )
    .await?;

    let elector = Elector::builder(options, "example-scheduler").build()?;
    println!("{} standing for example-scheduler", elector.node_id());
    loop {
        let leadership = tokio::select! {
            l = elector.leadership() => l?,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let leader = leadership.context();
        println!("elected with term {}", leader.term());
        let mut jobs = 0;
        loop {
            tokio::select! {
                _ = leadership.lost() => break,
                _ = tokio::signal::ctrl_c() => {
                    leadership.resign().await?; // standbys take over at once
                    println!("resigned");
                    return Ok(());
                }
                _ = tokio::time::sleep(EVERY) => {}
            }
            match run_job(&mut db, &leader).await {
                Ok(()) => {
                    jobs += 1;
                    println!("job {jobs} done with term {}", leader.term());
                }
                Err(e) if deposed(&e) => break,
                Err(e) => eprintln!("job failed, retrying next time: {e}"),
            }
            if once && jobs == 3 {
                return deposed_leader_demo(&elector, leadership, &mut db).await;
            }
        }
        println!(
            "leadership ended ({:?}): jobs stopped",
            leadership.loss_reason()
        );
        leadership.resign().await?; // nothing left to release after a loss
    }
}

/// What a deposed leader sees. One that knows it lost is refused by the
/// library without a statement; one that does not know yet (paused through
/// its successor's election) is refused by the database: here its fence
/// statement, sent by hand with the old term.
async fn deposed_leader_demo(
    elector: &Elector,
    old: pgelect::Leadership,
    db: &mut Client,
) -> Result<(), BoxError> {
    let stale = old.context();
    old.resign().await?;
    let new = elector.leadership().await?;
    println!("elected again with term {}", new.term());
    match run_job(db, &stale).await {
        Err(e) if deposed(&e) => println!("write with old term {} refused: {e}", stale.term()),
        other => return Err(format!("expected a refusal, got {other:?}").into()),
    }
    let tx = db.transaction().await?;
    let fence = "SELECT pgelect.fence($1, $2)";
    let refused = tx
        .execute(fence, &[&stale.role(), &stale.term().get()])
        .await
        .err();
    match refused
        .as_ref()
        .and_then(tokio_postgres::Error::as_db_error)
    {
        Some(e) if e.code().code() == pgelect::schema::SQLSTATE_STALE_TERM => {
            println!("the database refuses it too: {}", e.message())
        }
        _ => return Err(format!("expected SQLSTATE PE001, got {refused:?}").into()),
    }
    drop(tx); // rolled back
    run_job(db, &new.context()).await?;
    println!("write fenced with term {} committed", new.term());
    new.resign().await?;
    Ok(())
}
