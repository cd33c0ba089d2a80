//! Many blocking candidates of one role cost the database little: one
//! connection per standby, and statements that do not grow with a read per
//! standby per check. The standbys queue for the role's watch key; only its
//! holder (the watch) waits in the role's lock queue and observes. The
//! server counts what they cost: connections in `pg_stat_activity`,
//! transactions in `pg_stat_database`.
//!
//! Timing assertions use generous bounds (CI has 2 cores and runs 4 tests
//! at once) and print what they measured.

use std::time::{Duration, Instant};

use pgelect::{election::StandbyMode, ConnectOptions, Elector, ElectorBuilder, Leadership};
use tokio::sync::mpsc;
use tokio_postgres::{Client, NoTls};

use crate::support;
use support::{migrated, transactions, Log};

const STANDBYS: usize = 20;

/// ttl 3 s, renewals every second, heartbeats every 500 ms, a check every
/// second, wait slices of 5 s.
fn crowd(o: &ConnectOptions, role: &str, node: &str) -> ElectorBuilder {
    Elector::builder(o.clone(), role)
        .node_id(node)
        .ttl(Duration::from_secs(3))
        .renew_every(Duration::from_secs(1))
        .heartbeat(Duration::from_millis(500))
        .heartbeat_timeout(Duration::from_millis(500))
        .check_every(Duration::from_secs(1))
        .wait_slice(Duration::from_secs(5))
        .standby(StandbyMode::Blocking)
}

/// Starts `n` candidates of `role`; each sends its leadership (with its
/// index) on the channel when elected, and keeps standing afterwards.
fn start(
    o: &ConnectOptions,
    role: &str,
    n: usize,
) -> (
    Vec<std::sync::Arc<Elector>>,
    mpsc::UnboundedReceiver<(usize, Leadership)>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut electors = Vec::new();
    for i in 0..n {
        let e = std::sync::Arc::new(crowd(o, role, &format!("node-{i}")).build().unwrap());
        let c = e.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Ok(l) = c.leadership().await {
                let lost = l.context();
                if tx.send((i, l)).is_err() {
                    return;
                }
                lost.lost().await;
            }
        });
        electors.push(e);
    }
    (electors, rx)
}

/// Backends connected to the test database, the asking one left out.
async fn backends(admin: &Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()
                AND backend_type = 'client backend'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The pid holding the role's watch key, if any.
async fn watch_holder(admin: &Client, role: &str) -> Option<i32> {
    admin
        .query_opt(
            "SELECT k.pid FROM pg_locks k
              WHERE k.locktype = 'advisory' AND k.granted
                AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND k.classid = ((pgelect.key($1) >> 32) & 4294967295)::oid
                AND k.objid = (pgelect.key($1) & 4294967295)::oid AND k.objsubid = 1",
            &[&format!("election-watch:pgelect:{role}")],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// Polls `what` every 50 ms until it returns `Some`, for at most `within`.
async fn until<T, F: std::future::Future<Output = Option<T>>>(
    within: Duration,
    mut what: impl FnMut() -> F,
) -> Option<T> {
    let end = Instant::now() + within;
    loop {
        if let Some(v) = what().await {
            return Some(v);
        }
        if Instant::now() > end {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_blocking_standbys_hold_one_connection_each_and_cost_few_statements() {
    let log = Log::default();
    let _capture = log.capture(tracing::Level::WARN);
    let (db, o) = migrated("crowd").await;
    let admin = db.connect().await;
    let (_electors, mut elected) = start(&o, "crowd", STANDBYS);
    let (first, leadership) = tokio::time::timeout(Duration::from_secs(20), elected.recv())
        .await
        .expect("a leader within 20 s")
        .unwrap();
    let term = leadership.term();

    // Every candidate connected and waiting: one watch in the role's queue,
    // the others queued for the watch key.
    let waiting = until(Duration::from_secs(30), || async {
        let n: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_locks k JOIN pg_stat_activity a ON a.pid = k.pid
                  WHERE a.datname = current_database() AND k.locktype = 'advisory'
                    AND NOT k.granted",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (n == STANDBYS as i64 - 1).then_some(n)
    })
    .await;
    assert!(
        waiting.is_some(),
        "all {} standbys waiting within 30 s",
        STANDBYS - 1
    );
    let connections = backends(&admin).await;
    // A backend reports its counts to pg_stat_database when it goes idle,
    // and a standby's first wait follows its start-up statements without
    // a pause: they are counted only after its first slice. Measure from
    // a slice later.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let window = Duration::from_secs(10);
    let before = transactions(&admin).await;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let after = transactions(&admin).await;
    let per_second = (after - before - 1) as f64 / started.elapsed().as_secs_f64();
    let connections_after = backends(&admin).await;
    println!(
        "{STANDBYS} candidates of one role: {connections} connections, then {connections_after}; {per_second:.1} statements/s over {:?}",
        started.elapsed()
    );
    // One connection each (an observer per standby would double it).
    assert!(
        connections <= STANDBYS as i64 && connections_after <= STANDBYS as i64,
        "at most one connection per candidate: {connections}, {connections_after}"
    );
    // Leader: 2 heartbeats and a renewal per second; the watch: a slice
    // and a read per second; 18 standbys: a slice per 5 s. About 8.6/s;
    // a read per standby per check would add 19/s.
    assert!(
        per_second < 14.0,
        "{per_second:.1} statements/s for {STANDBYS} candidates"
    );

    // The leader's backend ends: the watch is granted the lock and leads.
    let leader_pid: i32 = admin
        .query_one(
            "SELECT holder_pid FROM pgelect.leaders WHERE role = 'crowd'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let watch_before = watch_holder(&admin, "crowd").await;
    assert!(watch_before.is_some(), "a standby holds the watch key");
    let killed = Instant::now();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&leader_pid])
        .await
        .unwrap();
    let (second, next) = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let (i, l) = elected.recv().await.unwrap();
            if l.term() > term {
                return (i, l);
            }
        }
    })
    .await
    .expect("a new leader within 15 s of the leader's backend ending");
    println!(
        "node-{second} led term {} {:?} after node-{first}'s backend ended (handover delay included)",
        next.term(),
        killed.elapsed()
    );
    assert!(second != first);
    assert!(leadership.is_lost(), "the old leader knows it lost");
    // The next standby in the queue watches at once.
    let watch_after = until(Duration::from_secs(10), || async {
        watch_holder(&admin, "crowd")
            .await
            .filter(|p| Some(*p) != watch_before)
    })
    .await;
    assert!(
        watch_after.is_some(),
        "another standby holds the watch key within 10 s"
    );
    assert!(
        !log.text().contains("ERROR"),
        "no error logged:\n{}",
        log.text()
    );
}

/// A session of the candidates' own database user that holds the watch key
/// and does nothing (a candidate frozen while it watched) is ended by the
/// next queued standby once it has been idle for a TTL, and the role is led
/// again although nobody else waited in its lock queue.
#[tokio::test]
async fn a_frozen_watch_is_ended_and_the_next_standby_watches_and_leads() {
    let log = Log::default();
    let _capture = log.capture(tracing::Level::WARN);
    let (db, o) = migrated("frozen_watch").await;
    let a = crowd(&o, "fw", "node-a").build().unwrap();
    let first = a.leadership().await.unwrap();
    let admin = db.connect().await;
    // The frozen watch: holds the watch key, then nothing.
    let frozen = db.connect().await;
    let frozen_pid: i32 = frozen
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    frozen
        .execute(
            "SELECT pg_advisory_lock(pgelect.key('election-watch:pgelect:fw'))",
            &[],
        )
        .await
        .unwrap();
    let b = crowd(&o, "fw", "node-b").build().unwrap();
    let standing = tokio::spawn(async move { b.leadership().await.map(|l| (b, l)) });
    db.wait_for_advisory_waiters(1).await;
    // The leader's connection ends; nobody waits in the role's queue.
    let leader_pid: i32 = admin
        .query_one(
            "SELECT holder_pid FROM pgelect.leaders WHERE role = 'fw'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let ended = Instant::now();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&leader_pid])
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), first.lost())
        .await
        .expect("the old leader learns it lost");
    let (_b, second) = tokio::time::timeout(Duration::from_secs(25), standing)
        .await
        .unwrap_or_else(|_| panic!("the frozen watch still blocks the role:\n{}", log.text()))
        .unwrap()
        .expect("elected");
    println!(
        "node-b led term {} {:?} after the leader's backend ended (ttl 3 s, wait slice 5 s, handover delay included)",
        second.term(),
        ended.elapsed()
    );
    assert!(second.term() > first.term());
    let alive: bool = admin
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
            &[&frozen_pid],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!alive, "the frozen watch's session was ended");
    assert!(
        log.text().contains("ended the role's watch"),
        "the standby said so:\n{}",
        log.text()
    );
}

/// Another database user with CONNECT only holds the watch key: the
/// standbys say so and wait in the role's lock queue directly, so the role
/// is still led again when its leader's connection ends.
#[tokio::test]
async fn a_watch_key_squatted_by_another_user_sends_standbys_to_the_lock_queue() {
    let log = Log::default();
    let _capture = log.capture(tracing::Level::WARN);
    let (db, o) = migrated("squat_watch").await;
    let url = db.create_role("watcher", "watch-pw", false).await;
    let (squatter, connection) = url
        .parse::<tokio_postgres::Config>()
        .unwrap()
        .connect(NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let key: i64 = db
        .connect()
        .await
        .query_one("SELECT pgelect.key('election-watch:pgelect:sw')", &[])
        .await
        .unwrap()
        .get(0);
    squatter
        .execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .unwrap();
    let a = crowd(&o, "sw", "node-a").build().unwrap();
    let first = a.leadership().await.unwrap();
    let b = crowd(&o, "sw", "node-b").build().unwrap();
    let standing = tokio::spawn(async move { b.leadership().await.map(|l| (b, l)) });
    log.wait_for_line(
        &["WARN", "watch key", "another database user"],
        Duration::from_secs(20),
    )
    .await;
    let admin = db.connect().await;
    let leader_pid: i32 = admin
        .query_one(
            "SELECT holder_pid FROM pgelect.leaders WHERE role = 'sw'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // B waits in the role's queue now.
    db.wait_for_advisory_waiters(1).await;
    let ended = Instant::now();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&leader_pid])
        .await
        .unwrap();
    let (_b, second) = tokio::time::timeout(Duration::from_secs(15), standing)
        .await
        .expect("node-b leads within 15 s")
        .unwrap()
        .expect("elected");
    println!(
        "node-b led term {} {:?} after the leader's backend ended, the watch key squatted",
        second.term(),
        ended.elapsed()
    );
    assert!(second.term() > first.term());
    let still: bool = squatter
        .query_one("SELECT true", &[])
        .await
        .map(|r| r.get(0))
        .unwrap_or(false);
    assert!(still, "another user's session is never ended");
}
