//! Partitioned workers: a queue split into 6 partitions, each led by exactly
//! one member of the fleet, spread evenly over the live members. A member
//! starts a worker for each partition it gains and stops it when the
//! partition is lost or handed over to a member that joined.
//!
//! ```sh
//! DATABASE_URL=postgres://app:secret@localhost/app \
//!     cargo run -p pgelect --example partitioned_workers -- worker-1
//! ```
//!
//! Run it in two or three terminals with different member names: the
//! partitions move until each member leads its share (2 or 3 of them), and
//! move back when one stops (Ctrl-C leaves the group cleanly).
//!
//! With `PGELECT_EXAMPLE_SECONDS=N` it leaves the group after N seconds
//! and prints a summary (`scripts/run-examples.sh` runs two members at
//! once that way).
//!
//! Each worker fences its writes with its partition's term, through a
//! plain tokio-postgres connection (`NoTls`; use a TLS connector for a
//! remote database).

use std::error::Error;
use std::time::Duration;

use pgelect::{
    partitions::HeldPartition, partitions::PartitionEvent, partitions::PartitionGroup,
    ConnectOptions,
};
use tokio_postgres::NoTls;

type BoxError = Box<dyn Error + Send + Sync>;

const PARTITIONS: u32 = 6;

/// Works on one partition until its token is cancelled, then returns: the
/// partition is released to its next leader once `held` is dropped.
async fn work(url: String, held: HeldPartition) -> Result<u64, BoxError> {
    let (mut db, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    let stop = held.token();
    let mut batches = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(batches),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        // One batch of this partition's queue, fenced with its term.
        let tx = db.transaction().await?;
        match held.fence(&tx).await {
            Err(e) if e.is_leadership_lost() => return Ok(batches), // a newer term began
            other => other?,
        }
        tx.execute(
            "INSERT INTO partition_batches (partition, term) VALUES ($1, $2)",
            &[&(held.partition() as i32), &held.term().get()],
        )
        .await?;
        tx.commit().await?;
        batches += 1;
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let member = std::env::args()
        .nth(1)
        .unwrap_or_else(|| format!("worker-{}", std::process::id()));
    let seconds: Option<u64> = std::env::var("PGELECT_EXAMPLE_SECONDS")
        .ok()
        .map(|s| s.parse())
        .transpose()?;
    let options = ConnectOptions::from_url(&url)?;
    pgelect::migrate(&options).await?; // idempotent; usually a deploy step
    let (db, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS partition_batches (
             partition int NOT NULL, term bigint NOT NULL, at timestamptz NOT NULL DEFAULT now())",
    )
    .await?;

    let group = PartitionGroup::builder(options, "example-queue", PARTITIONS)
        .member(&member)
        .build()?;
    let mut events = group.join()?;
    println!("{member} joined example-queue ({PARTITIONS} partitions)");
    // Leaving hands every partition over at once (no handover delay). It
    // runs beside the event loop, which keeps handling the Lost events.
    let leave = async {
        match seconds {
            Some(s) => tokio::time::sleep(Duration::from_secs(s)).await,
            None => drop(tokio::signal::ctrl_c().await),
        }
        group.leave().await
    };
    tokio::pin!(leave);
    let (mut gained, mut lost, mut left) = (0, 0, false);
    let mut workers = tokio::task::JoinSet::new();
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            result = &mut leave, if !left => {
                left = true;
                result?;
                continue;
            }
        };
        match event {
            Some(PartitionEvent::Gained(held)) => {
                gained += 1;
                let (partition, term) = (held.partition(), held.term());
                println!("{member}: gained partition {partition} (term {term})");
                let (url, member) = (url.clone(), member.clone());
                workers.spawn(async move {
                    match work(url, held).await {
                        Ok(n) => {
                            println!("{member}: partition {partition} stopped after {n} batches")
                        }
                        Err(e) => eprintln!("{member}: partition {partition} (term {term}): {e}"),
                    }
                });
            }
            Some(PartitionEvent::Lost {
                partition,
                term,
                reason,
            }) => {
                lost += 1;
                println!("{member}: lost partition {partition} (term {term}): {reason}");
            }
            Some(_) => {}  // the enum is non-exhaustive
            None => break, // left the group
        }
    }
    while workers.join_next().await.is_some() {}
    println!("{member}: done, {gained} partitions gained, {lost} lost");
    Ok(())
}
