//! Balanced partitions against a real server: N = 12 over 3 members, a 4th
//! joining by clean handoffs, a member leaving, a member dying, terms and
//! fences per partition, bad input.
//!
//! Acting intervals are recorded per partition as the application sees
//! them (from the `Gained` event to its token's cancellation, before the
//! handle is dropped) and checked disjoint with rising terms. Timing bounds
//! are generous; the measured values are printed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgelect::{
    election::Backend, loss::LossReason, partitions::partition_assignment,
    partitions::PartitionEvent, partitions::PartitionEvents, partitions::PartitionGroup,
    ConnectOptions, Term,
};
use pgelect_testkit::{Cluster, PgBouncer, PoolMode, TestDb};

use crate::support;
use support::{migrated, Intervals};

const N: u32 = 12;
const GROUP: &str = "orders";
/// How long the test's application takes to stop working on a partition
/// once its token is cancelled.
const WIND_DOWN: Duration = Duration::from_millis(100);

type Losses = Arc<Mutex<Vec<(String, u32, LossReason)>>>;

/// A member and what its application saw.
struct Member {
    group: PartitionGroup,
}

/// What every member's application saw: intervals per partition, losses.
#[derive(Clone)]
struct Seen {
    logs: Arc<Vec<Intervals>>,
    losses: Losses,
    /// `Refused` events: member, reason.
    refusals: Arc<Mutex<Vec<(String, String)>>>,
}

impl Seen {
    fn new() -> Seen {
        Seen {
            logs: Arc::new((0..N).map(|_| Intervals::default()).collect()),
            losses: Arc::default(),
            refusals: Arc::default(),
        }
    }

    fn assert_disjoint(&self) {
        for log in self.logs.iter() {
            log.assert_disjoint();
        }
    }

    fn losses(&self) -> Vec<(String, u32, LossReason)> {
        self.losses.lock().unwrap().clone()
    }
}

/// Records `events` of member `node`: an interval per gain, ended
/// [`WIND_DOWN`] after its token is cancelled, then the handle is dropped
/// (which lets a handover release it).
fn record(mut events: PartitionEvents, node: &str, seen: &Seen) {
    let node = node.to_owned();
    let seen = seen.clone();
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            match ev {
                PartitionEvent::Gained(held) => {
                    let p = held.partition() as usize;
                    let i = seen.logs[p].start(&node, held.term());
                    let logs = seen.logs.clone();
                    tokio::spawn(async move {
                        held.token().cancelled().await;
                        // The application takes a while to wind its work
                        // down; a handover must wait for it.
                        tokio::time::sleep(WIND_DOWN).await;
                        logs[p].end(i);
                        drop(held);
                    });
                }
                PartitionEvent::Lost {
                    partition, reason, ..
                } => seen
                    .losses
                    .lock()
                    .unwrap()
                    .push((node.clone(), partition, reason)),
                PartitionEvent::Refused { reason } => {
                    seen.refusals.lock().unwrap().push((node.clone(), reason))
                }
                _ => {}
            }
        }
    });
}

/// Session timings for tests (ttl 6 s, handover delay 2.5 s: a heartbeat
/// answered within 1.5 s, so that a machine running four tests on two cores
/// does not end every member's connection at once), polling every 200 ms,
/// rebalancing every 500 ms.
fn join(o: &ConnectOptions, node: &str, seen: &Seen) -> Member {
    let group = PartitionGroup::builder(o.clone(), GROUP, N)
        .member(node)
        .poll_interval(Duration::from_millis(200))
        .rebalance_every(Duration::from_millis(500))
        .elector(|b| {
            b.ttl(Duration::from_secs(6))
                .renew_every(Duration::from_secs(2))
                .session(|s| {
                    s.heartbeat(Duration::from_millis(500))
                        .heartbeat_timeout(Duration::from_millis(1500))
                })
        })
        .build()
        .unwrap();
    record(group.join().unwrap(), node, seen);
    Member { group }
}

/// Waits until every partition is held by exactly one of `members` and each
/// holds at most `share`; returns how long it took.
async fn balanced(members: &[&Member], share: usize, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let held: Vec<BTreeMap<u32, Term>> = members.iter().map(|m| m.group.held()).collect();
        let total: usize = held.iter().map(BTreeMap::len).sum();
        let mut all: Vec<u32> = held.iter().flat_map(|h| h.keys().copied()).collect();
        all.sort();
        all.dedup();
        if total == N as usize && all.len() == N as usize && held.iter().all(|h| h.len() <= share) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < within,
            "not balanced within {within:?} (share {share}): {:?}",
            held.iter()
                .map(|h| h.keys().copied().collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The fence refuses `term` for `role`.
async fn fenced_off(db: &TestDb, role: &str, term: Term) -> bool {
    let mut c = db.connect().await;
    let tx = c.transaction().await.unwrap();
    tx.query("SELECT pgelect.fence($1, $2)", &[&role, &term.get()])
        .await
        .is_err()
}

/// Each partition's holder and term among `members`.
fn holders(members: &[&Member]) -> BTreeMap<u32, (String, Term)> {
    members
        .iter()
        .flat_map(|m| {
            m.group
                .held()
                .into_iter()
                .map(|(p, t)| (p, (m.group.member().to_owned(), t)))
        })
        .collect()
}

/// Every loss since the first `losses_before` was a clean handoff.
fn assert_clean_handoffs(seen: &Seen, losses_before: usize) {
    let handoffs: Vec<_> = seen.losses()[losses_before..].to_vec();
    println!("handoffs on join: {handoffs:?}");
    assert!(
        handoffs
            .iter()
            .all(|(_, _, r)| *r == LossReason::HandedOver),
        "only clean handoffs: {handoffs:?}"
    );
}

/// Each partition that moved since `before`: the new term is higher and
/// the old one is fenced off. Returns how many moved.
async fn moved_and_fenced(
    db: &TestDb,
    members: &[&Member],
    before: &BTreeMap<u32, (String, Term)>,
) -> usize {
    let mut moved = 0;
    for m in members {
        for (p, t) in m.group.held() {
            let (old_node, old_term) = &before[&p];
            if old_node != m.group.member() {
                moved += 1;
                assert!(t > *old_term, "partition {p}: term {t} after {old_term}");
                assert!(fenced_off(db, &format!("{GROUP}/{p}"), *old_term).await);
            }
        }
    }
    moved
}

/// Each of a dead member's `victims` is held by one of `survivors` with a
/// higher term, and its old term is fenced off.
async fn taken_over_and_fenced(db: &TestDb, survivors: &[&Member], victims: &BTreeMap<u32, Term>) {
    for (p, old) in victims {
        let now = survivors
            .iter()
            .find_map(|m| m.group.held().get(p).copied())
            .expect("taken over");
        assert!(now > *old, "partition {p}: {now} after {old}");
        assert!(fenced_off(db, &format!("{GROUP}/{p}"), *old).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twelve_partitions_spread_over_members_that_join_and_leave() {
    let (db, o) = migrated("partitions_join").await;
    let seen = Seen::new();

    // Three members: 4 partitions each.
    let t0 = Instant::now();
    let a = join(&o, "a", &seen);
    let b = join(&o, "b", &seen);
    let c = join(&o, "c", &seen);
    balanced(&[&a, &b, &c], 4, Duration::from_secs(30)).await;
    println!(
        "3 members: every partition led, at most 4 each, {:?} after start",
        t0.elapsed()
    );
    for m in [&a, &b, &c] {
        assert_eq!(m.group.held().len(), 4, "{}", m.group.member());
    }
    // The assignment as the database shows it agrees.
    let shown = a.group.assignment().await.unwrap();
    assert_eq!(shown.members, vec!["a", "b", "c"]);
    for m in [&a, &b, &c] {
        let mine: Vec<u32> = m.group.held().keys().copied().collect();
        assert_eq!(shown.by_member()[m.group.member()], mine);
    }
    let before = holders(&[&a, &b, &c]);
    let losses_before = seen.losses().len();

    // A fourth joins: 3 each, by clean handoffs.
    let t1 = Instant::now();
    let d = join(&o, "d", &seen);
    let took = balanced(&[&a, &b, &c, &d], 3, Duration::from_secs(30)).await;
    println!("4th member: balanced (3 each) {took:?} after it joined");
    assert_eq!(d.group.held().len(), 3);
    assert_clean_handoffs(&seen, losses_before);
    let moved = moved_and_fenced(&db, &[&a, &b, &c, &d], &before).await;
    println!(
        "partitions moved: {moved} (of {N}); join to balance {:?}",
        t1.elapsed()
    );
    assert!(moved >= 3);
    seen.assert_disjoint();
    // The handoff itself: from the old holder's end of work (its token
    // cancelled + WIND_DOWN) to the new holder's start.
    let gaps: Vec<Duration> = seen
        .logs
        .iter()
        .filter_map(|log| {
            let v = log.0.lock().unwrap().clone();
            let last = v.iter().max_by_key(|x| x.2)?;
            let prev = v.iter().filter(|x| x.2 < last.2).max_by_key(|x| x.2)?;
            (last.0 == "d").then(|| last.2 - prev.3.expect("ended"))
        })
        .collect();
    println!("handoff gaps to d (old holder's end of work to d's start): {gaps:?}");
    assert_eq!(gaps.len(), 3);

    // c leaves cleanly: its 3 go to the others (at most 4 each).
    let losses_before = seen.losses().len();
    let t2 = Instant::now();
    c.group.leave().await.unwrap();
    let left = t2.elapsed();
    assert!(c.group.held().is_empty());
    let took = balanced(&[&a, &b, &d], 4, Duration::from_secs(30)).await;
    println!("c left in {left:?}; its partitions led again {took:?} after leave() began");
    let gone: Vec<_> = seen.losses()[losses_before..]
        .iter()
        .filter(|(n, _, _)| n == "c")
        .cloned()
        .collect();
    assert_eq!(gone.len(), 3, "{gone:?}");
    assert!(gone.iter().all(|(_, _, r)| *r == LossReason::Shutdown));
    let shown = partition_assignment(&o, GROUP, N).await.unwrap();
    assert_eq!(shown.members, vec!["a", "b", "d"]);
    seen.assert_disjoint();

    for m in [&a, &b, &d] {
        m.group.leave().await.unwrap();
    }
    seen.assert_disjoint();
    assert!(seen.logs.iter().all(|l| l.open().is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_members_partitions_are_taken_over_by_the_others() {
    let (db, o) = migrated("partitions_kill").await;
    let seen = Seen::new();
    let a = join(&o, "a", &seen);
    let b = join(&o, "b", &seen);
    let c = join(&o, "c", &seen);
    balanced(&[&a, &b, &c], 4, Duration::from_secs(30)).await;
    let victims: BTreeMap<u32, Term> = b.group.held();

    // b dies: its task stops and its lock connection is terminated.
    let killer = db.connect().await;
    let pids: Vec<i32> = killer
        .query(
            "SELECT DISTINCT backend_pid FROM pgelect.candidates WHERE node = 'b'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(!pids.is_empty());
    let killed_at = Instant::now();
    drop(b);
    for pid in &pids {
        killer
            .query("SELECT pg_terminate_backend($1)", &[pid])
            .await
            .unwrap();
    }
    let took = balanced(&[&a, &c], 6, Duration::from_secs(30)).await;
    println!(
        "b's {} partitions led again {took:?} after the kill (handover delay 2.5 s)",
        victims.len()
    );
    assert!(took >= Duration::from_millis(2500), "{took:?}");
    let _ = killed_at;
    taken_over_and_fenced(&db, &[&a, &c], &victims).await;
    let shown = partition_assignment(&o, GROUP, N).await.unwrap();
    assert_eq!(shown.members, vec!["a", "c"]);
    seen.assert_disjoint();
    a.group.leave().await.unwrap();
    c.group.leave().await.unwrap();
}

#[tokio::test]
async fn bad_input_is_refused_with_a_clear_error() {
    let o = ConnectOptions::from_url("postgres://app@localhost/app").unwrap();
    let err = |g: &str, n: u32| {
        PartitionGroup::builder(o.clone(), g, n)
            .build()
            .unwrap_err()
            .to_string()
    };
    for (g, n, needle) in [
        ("orders", 0, "1 to 4096 partitions, not 0"),
        ("orders", 5000, "not 5000"),
        ("a/b", 4, "'/'"),
        ("", 4, "empty"),
        ("nul\0", 4, "NUL"),
        (&"x".repeat(253), 12, "the limit is 255"),
    ] {
        let e = err(g, n);
        println!("{g:?} {n}: {e}");
        assert!(e.contains(needle), "{e}");
    }
    // The longest role fits: 253 bytes + "/9".
    PartitionGroup::builder(o.clone(), &"x".repeat(253), 10)
        .build()
        .unwrap();
    let e = PartitionGroup::builder(o.clone(), "g", 4)
        .poll_interval(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(
        e.to_string().contains("poll_interval must be positive"),
        "{e}"
    );
    let e = PartitionGroup::builder(o.clone(), "g", 4)
        .member("")
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    // An elector configuration that does not validate is refused up front.
    let e = PartitionGroup::builder(o.clone(), "g", 4)
        .elector(|b| b.ttl(Duration::from_millis(1)))
        .build()
        .unwrap_err();
    assert!(e.is_config(), "{e}");
    // listen_via is the lease backend's.
    let e = PartitionGroup::builder(o.clone(), "g", 4)
        .listen_via(o.clone())
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("listen_via is for partition groups on the lease backend"),
        "{e}"
    );
    PartitionGroup::builder(o.clone(), "g", 4)
        .elector(|b| b.backend(Backend::Lease))
        .listen_via(o.clone())
        .build()
        .expect("listen_via on the lease backend");
    // Joining twice.
    let g = PartitionGroup::builder(o.clone(), "g", 4).build().unwrap();
    let _events = g.join().unwrap();
    assert!(g.join().unwrap_err().to_string().contains("already joined"));
    assert!(partition_assignment(&o, "a/b", 3).await.is_err());
    assert!(partition_assignment(&o, "g", 0).await.is_err());
}

#[test]
fn joining_outside_a_runtime_is_an_error_not_a_panic() {
    let o = ConnectOptions::from_url("postgres://app@localhost/app").unwrap();
    let g = PartitionGroup::builder(o, "g", 4).build().unwrap();
    let e = g.join().unwrap_err();
    assert!(e.to_string().contains("Tokio runtime"), "{e}");
}

/// A member on the lease backend through `pooled` (PgBouncer in
/// transaction mode): ttl 3 s, renewals every 750 ms, statements bounded by
/// 1 s, standbys looking every 200 ms, rebalancing every 500 ms.
fn join_lease(o: &ConnectOptions, node: &str, seen: &Seen) -> Member {
    join_lease_of(o, node, seen, N)
}

/// [`join_lease`] declaring `partitions` partitions.
fn join_lease_of(o: &ConnectOptions, node: &str, seen: &Seen, partitions: u32) -> Member {
    let group = PartitionGroup::builder(o.clone(), GROUP, partitions)
        .member(node)
        .poll_interval(Duration::from_millis(200))
        .rebalance_every(Duration::from_millis(500))
        .elector(|b| {
            b.backend(Backend::Lease)
                .ttl(Duration::from_secs(3))
                .renew_every(Duration::from_millis(750))
                .lease(|l| l.statement_timeout(Duration::from_secs(1)))
        })
        .build()
        .unwrap();
    record(group.join().unwrap(), node, seen);
    Member { group }
}

/// A migrated database and a PgBouncer in transaction mode in front of
/// it: the database, the options through PgBouncer, the bouncer.
async fn pooled(hint: &str) -> (TestDb, ConnectOptions, PgBouncer) {
    let cluster = tokio::task::spawn_blocking(Cluster::shared).await.unwrap();
    let db = TestDb::on(cluster, hint).await;
    pgelect::migrate(&support::options(&db.url()))
        .await
        .expect("migrate");
    let bouncer = PgBouncer::start(cluster, PoolMode::Transaction).expect("pgbouncer starts");
    let pooled = support::options(&bouncer.url(db.name()));
    (db, pooled, bouncer)
}

/// The server connections of `db` (PgBouncer's and everyone's).
async fn server_connections(db: &TestDb) -> i64 {
    db.connect()
        .await
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_the_lease_backend_through_pgbouncer_partitions_spread_and_rebalance_by_clean_handoffs()
{
    let (db, o, _bouncer) = pooled("partitions_lease_join").await;
    let seen = Seen::new();

    // Three members through the pooler: 4 partitions each.
    let a = join_lease(&o, "a", &seen);
    let b = join_lease(&o, "b", &seen);
    let c = join_lease(&o, "c", &seen);
    let took = balanced(&[&a, &b, &c], 4, Duration::from_secs(30)).await;
    println!("lease, 3 members: every partition led, at most 4 each, {took:?} after start");
    for m in [&a, &b, &c] {
        assert_eq!(m.group.held().len(), 4, "{}", m.group.member());
        for (p, t) in m.group.held() {
            assert!(
                !fenced_off(&db, &format!("{GROUP}/{p}"), t).await,
                "{p} {t}"
            );
        }
    }
    // The database shows the same (read through the pooler).
    let shown = partition_assignment(&o, GROUP, N).await.unwrap();
    assert_eq!(shown.members, vec!["a", "b", "c"]);
    for m in [&a, &b, &c] {
        let mine: Vec<u32> = m.group.held().keys().copied().collect();
        assert_eq!(shown.by_member()[m.group.member()], mine);
    }
    println!(
        "server connections of the database: {}",
        server_connections(&db).await
    );
    let before = holders(&[&a, &b, &c]);
    let losses_before = seen.losses().len();

    // A fourth joins: 3 each, by clean handoffs only.
    let t1 = Instant::now();
    let d = join_lease(&o, "d", &seen);
    let took = balanced(&[&a, &b, &c, &d], 3, Duration::from_secs(30)).await;
    println!("lease, 4th member: balanced (3 each) {took:?} after it joined");
    assert_clean_handoffs(&seen, losses_before);
    let moved = moved_and_fenced(&db, &[&a, &b, &c, &d], &before).await;
    println!(
        "partitions moved: {moved}; join to balance {:?}",
        t1.elapsed()
    );
    assert!(moved >= 3);
    seen.assert_disjoint();

    // c leaves cleanly: its 3 go to the others at once (no expiry wait).
    let t2 = Instant::now();
    c.group.leave().await.unwrap();
    let took = balanced(&[&a, &b, &d], 4, Duration::from_secs(30)).await;
    println!("lease: c left; its partitions led again {took:?} after leave() began (ttl 3 s)");
    assert!(t2.elapsed() < Duration::from_secs(30));
    for m in [&a, &b, &d] {
        m.group.leave().await.unwrap();
    }
    seen.assert_disjoint();
    assert!(seen.logs.iter().all(|l| l.open().is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_the_lease_backend_a_dead_members_partitions_are_taken_over_after_their_leases_expire() {
    let (db, o, _bouncer) = pooled("partitions_lease_kill").await;
    let seen = Seen::new();
    let a = join_lease(&o, "a", &seen);
    let b = join_lease(&o, "b", &seen);
    let c = join_lease(&o, "c", &seen);
    balanced(&[&a, &b, &c], 4, Duration::from_secs(30)).await;
    let victims: BTreeMap<u32, Term> = b.group.held();

    // b dies: its task is aborted, its leases are neither renewed nor
    // released; the others wait for them to expire (ttl 3 s).
    drop(b);
    let took = balanced(&[&a, &c], 6, Duration::from_secs(30)).await;
    println!(
        "lease: b's {} partitions led again {took:?} after b died (ttl 3 s)",
        victims.len()
    );
    assert!(
        took >= Duration::from_secs(2),
        "before the leases expired: {took:?}"
    );
    taken_over_and_fenced(&db, &[&a, &c], &victims).await;
    seen.assert_disjoint();
    a.group.leave().await.unwrap();
    c.group.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_declaring_another_partition_count_is_refused_and_takes_nothing() {
    let (_db, o, _bouncer) = pooled("partitions_lease_mismatch").await;
    let seen = Seen::new();
    let a = join_lease(&o, "a", &seen);
    let b = join_lease(&o, "b", &seen);
    balanced(&[&a, &b], 6, Duration::from_secs(30)).await;

    // c declares 8 partitions where a and b, earlier, declare 12.
    let t0 = Instant::now();
    let c = join_lease_of(&o, "c", &seen, 8);
    let reason = loop {
        if let Some((node, reason)) = seen.refusals.lock().unwrap().first().cloned() {
            assert_eq!(node, "c");
            break reason;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "c was not refused within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!("refused after {:?}: {reason}", t0.elapsed());
    assert!(reason.contains("declares 8 partitions"), "{reason}");
    assert!(reason.contains("a declares 12 partitions"), "{reason}");
    // It takes nothing for as long as a and b run; they keep all 12.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(c.group.held().is_empty(), "{:?}", c.group.held());
    balanced(&[&a, &b], 6, Duration::from_secs(1)).await;
    assert_eq!(seen.refusals.lock().unwrap().len(), 1, "once per conflict");
    // a and b leave: c takes part again, with its 8.
    a.group.leave().await.unwrap();
    b.group.leave().await.unwrap();
    let t1 = Instant::now();
    while c.group.held().len() < 8 {
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "c did not take its 8 partitions after the others left: {:?}",
            c.group.held()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "c leads its 8 partitions {:?} after the others left",
        t1.elapsed()
    );
    c.group.leave().await.unwrap();
    seen.assert_disjoint();
}
