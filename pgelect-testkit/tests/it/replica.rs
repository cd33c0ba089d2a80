//! Tests of the kit's primary with a streaming replica and its `promote`
//! fault, against real servers.

use std::time::{Duration, Instant};

use pgelect_testkit::{ReplicaSet, Replication, REPLICA_NAME};
use tokio::time::timeout;

use crate::support::{connect, scalar};

fn start(mode: Replication) -> ReplicaSet {
    let t0 = Instant::now();
    let set = ReplicaSet::start(mode).expect("start a primary and a replica");
    eprintln!("{mode:?} primary + replica streaming in {:?}", t0.elapsed());
    set
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_replica_streams_and_promote_keeps_replayed_commits() {
    let set = start(Replication::Async);
    assert_eq!(set.mode(), Replication::Async);
    let primary = connect(&set.primary().config("postgres")).await;
    let replica = connect(&set.replica().config("postgres")).await;
    assert_eq!(scalar(&replica, "SELECT pg_is_in_recovery()").await, "t");
    assert_eq!(
        scalar(
            &primary,
            &format!(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = '{REPLICA_NAME}'"
            )
        )
        .await,
        "async"
    );
    scalar(
        &primary,
        "CREATE TABLE t (v int); INSERT INTO t VALUES (1); SELECT 1",
    )
    .await;
    set.wait_replayed().unwrap();
    assert_eq!(scalar(&replica, "SELECT count(*) FROM t").await, "1");
    // A standby refuses writes with read_only_sql_transaction.
    let e = replica
        .simple_query("INSERT INTO t VALUES (2)")
        .await
        .unwrap_err();
    assert_eq!(e.code().map(|c| c.code()), Some("25006"), "{e}");
    assert_eq!(set.replica_timeline().unwrap(), 1);

    let took = set.promote().expect("promote");
    eprintln!("promote: primary killed to replica writable in {took:?}");
    assert!(
        primary.simple_query("SELECT 1").await.is_err(),
        "the old primary is down"
    );
    let new = connect(&set.replica().config("postgres")).await;
    assert_eq!(scalar(&new, "SELECT pg_is_in_recovery()").await, "f");
    scalar(&new, "INSERT INTO t VALUES (3); SELECT 1").await;
    assert_eq!(
        scalar(&new, "SELECT string_agg(v::text, ',' ORDER BY v) FROM t").await,
        "1,3"
    );
    // The insert timeline moves at once; pg_control_checkpoint() may lag.
    assert_eq!(set.replica_timeline().unwrap(), 2);
    assert_eq!(
        scalar(
            &new,
            "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::int8"
        )
        .await,
        "2"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_replication_loses_a_commit_across_promote() {
    let set = start(Replication::Async);
    let primary = connect(&set.primary().config("postgres")).await;
    scalar(
        &primary,
        "CREATE TABLE t (v int); INSERT INTO t VALUES (1); SELECT 1",
    )
    .await;
    set.wait_replayed().unwrap();
    set.hold_replication();
    // Acknowledged by the primary, never received by the replica.
    scalar(&primary, "INSERT INTO t VALUES (2); SELECT 1").await;
    // A negative check: replaying a received commit takes milliseconds.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let replica = connect(&set.replica().config("postgres")).await;
    assert_eq!(
        scalar(&replica, "SELECT count(*) FROM t").await,
        "1",
        "the replica got the held commit"
    );
    set.promote().expect("promote");
    let new = connect(&set.replica().config("postgres")).await;
    assert_eq!(
        scalar(&new, "SELECT string_agg(v::text, ',' ORDER BY v) FROM t").await,
        "1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_replica_has_every_acknowledged_commit() {
    let set = start(Replication::Sync);
    let primary = connect(&set.primary().config("postgres")).await;
    assert_eq!(
        scalar(
            &primary,
            &format!(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = '{REPLICA_NAME}'"
            )
        )
        .await,
        "sync"
    );
    scalar(
        &primary,
        "CREATE TABLE t (v int); INSERT INTO t VALUES (1); SELECT 1",
    )
    .await;
    // No wait for replay: a synchronous commit is on the replica's disk
    // when it returns, and a promotion replays it.
    let took = set.promote().expect("promote");
    eprintln!("promote (sync): primary killed to replica writable in {took:?}");
    let new = connect(&set.replica().config("postgres")).await;
    assert_eq!(scalar(&new, "SELECT count(*) FROM t").await, "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_commit_waits_while_replication_is_held() {
    let set = start(Replication::Sync);
    let primary = connect(&set.primary().config("postgres")).await;
    scalar(&primary, "CREATE TABLE t (v int); SELECT 1").await;
    set.hold_replication();
    let insert = primary.simple_query("INSERT INTO t VALUES (1)");
    assert!(
        timeout(Duration::from_millis(500), insert).await.is_err(),
        "a synchronous commit returned while the replica received nothing"
    );
    set.release_replication();
    set.wait_replayed().unwrap();
}
