//! The session backend against a real server: mutual exclusion, handover,
//! release, fencing, preemption, pooler detection, configuration errors.
//!
//! Timing assertions use generous bounds and print what they measured.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgelect::{
    election::StandbyMode, loss::LossReason, ConnectOptions, Elector, ElectorBuilder, Error,
    Leadership, Term,
};
use pgelect_testkit::{Cluster, FaultProxy, PgBouncer, PoolMode, TestDb};

use crate::support;
use support::{fast_session as fast, migrated, options, Intervals};

async fn holder_pid(db: &TestDb, role: &str) -> i32 {
    let c = db.connect().await;
    c.query_typed_one(
        "SELECT holder_pid FROM pgelect.leaders WHERE role = $1",
        &[(&role, tokio_postgres::types::Type::TEXT)],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_one_of_eight_candidates_leads_repeatedly() {
    let (_db, o) = migrated("elect_eight").await;
    let started = Instant::now();
    for round in 0..20 {
        let role = format!("eight-{round}");
        let log = Intervals::default();
        let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for n in 0..8 {
            let e = fast(&o, &role, &format!("n{n}")).build().unwrap();
            let log = log.clone();
            let active = active.clone();
            tasks.push(tokio::spawn(async move {
                let l = e.leadership().await.expect("elected");
                let was = active.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                assert_eq!(was, 0, "two leaders at once");
                let i = log.start(e.node_id(), l.term());
                tokio::time::sleep(Duration::from_millis(5)).await;
                assert!(!l.is_lost(), "{:?}", l.loss().map(|l| l.reason()));
                active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                log.end(i);
                l.resign().await.expect("resign");
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("all eight lead in turn")
                .unwrap();
        }
        log.assert_disjoint();
        let v = log.0.lock().unwrap();
        assert_eq!(v.len(), 8);
        // Clean releases: every successor acted without a handover delay.
        let gaps: Vec<u128> = v
            .windows(2)
            .map(|w| (w[1].2 - w[0].3.unwrap()).as_millis())
            .collect();
        assert!(gaps.iter().all(|g| *g < 1000), "{gaps:?}");
        if round == 0 {
            println!("round 0: clean handover gaps (ms): {gaps:?}");
        }
    }
    println!("20 rounds of 8 candidates in {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_leader_is_never_preempted() {
    let (_db, o) = migrated("elect_healthy").await;
    let ttl = Duration::from_secs(1);
    let b = |node: &str| {
        Elector::builder(o.clone(), "healthy")
            .node_id(node)
            .ttl(ttl)
            .session(|s| {
                s.heartbeat(Duration::from_millis(100))
                    .heartbeat_timeout(Duration::from_millis(300))
            })
            .check_every(Duration::from_millis(50))
    };
    let leader = b("leader").build().unwrap().leadership().await.unwrap();
    let blocking = b("blocking").build().unwrap();
    let polling = b("polling")
        .session(|s| {
            s.standby(StandbyMode::Polling {
                interval: Duration::from_millis(50),
            })
        })
        .build()
        .unwrap();
    let watch = blocking.watch();
    let hold = ttl * 6;
    tokio::select! {
        l = blocking.leadership() => panic!("blocking standby elected: {:?}", l.map(|l| l.term())),
        l = polling.leadership() => panic!("polling standby elected: {:?}", l.map(|l| l.term())),
        _ = leader.lost() => panic!("healthy leader lost: {:?}", leader.loss().map(|l| l.reason())),
        _ = tokio::time::sleep(hold) => {}
    }
    let seen = watch.borrow().clone().expect("watchers see the leader");
    assert_eq!(seen.holder, "leader");
    assert_eq!(seen.term, leader.term());
    assert!(!seen.lease_expired);
    println!(
        "leader kept term {} for {hold:?} (6 TTLs) with two standbys checking every 50 ms",
        leader.term()
    );
    leader.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_at_once_and_watchers_follow() {
    let (_db, o) = migrated("elect_release").await;
    let a = fast(&o, "release", "a").build().unwrap();
    let b = fast(&o, "release", "b").build().unwrap();
    let la = a.leadership().await.unwrap();
    let mut watch = a.watch();
    let standby = tokio::spawn(async move {
        let l = b.leadership().await.unwrap();
        (Instant::now(), l)
    });
    _db.wait_for_advisory_waiters(1).await;
    let term_a = la.term();
    let t0 = Instant::now();
    la.resign().await.unwrap();
    let (elected_at, lb) = standby.await.unwrap();
    let took = elected_at - t0;
    println!("clean release -> standby elected in {took:?}");
    assert!(took < Duration::from_millis(500), "{took:?}");
    assert_eq!(lb.term().get(), term_a.get() + 1);
    // The watcher converges on b.
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if watch
                .borrow_and_update()
                .as_ref()
                .map(|i| i.holder.as_str())
                == Some("b")
            {
                break;
            }
            watch.changed().await.unwrap();
        }
    })
    .await
    .expect("watch shows the new leader");
    let now = pgelect::admin::current_leader(&o, "release")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(now.holder, "b");
    assert_eq!(now.term, lb.term());
    lb.resign().await.unwrap();
    assert!(pgelect::admin::current_leader(&o, "release")
        .await
        .unwrap()
        .is_none());
}

/// Waits (bounded) until the server shows `want` observer connections of
/// `role`, and returns how long that took.
async fn await_observers(db: &TestDb, role: &str, want: i64) -> Duration {
    let c = db.connect().await;
    let app = format!("pgelect:observe:{role}");
    let t0 = Instant::now();
    loop {
        let n: i64 = c
            .query_typed_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                &[(&app, tokio_postgres::types::Type::TEXT)],
            )
            .await
            .unwrap()
            .get(0);
        if n == want {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{n} observer connections of {role}, expected {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_holds_one_backend_and_publishes_its_renewals() {
    let (db, o) = migrated("elect_one_backend").await;
    let a = fast(&o, "one", "a").build().unwrap();
    let mut watch = a.watch();
    println!("observer up in {:?}", await_observers(&db, "one", 1).await);
    let la = a.leadership().await.unwrap();
    // While leading, the observer connection is closed: the leader process
    // holds its lock connection only.
    println!(
        "observer closed {:?} after the election",
        await_observers(&db, "one", 0).await
    );
    let lock_app = "pgelect:one:a";
    let c = db.connect().await;
    let held: i64 = c
        .query_typed_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[(&lock_app, tokio_postgres::types::Type::TEXT)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, 1, "the lock connection is open");
    // Watchers still follow the lease: the leader publishes each renewal.
    let first = watch.borrow_and_update().clone().expect("leader published");
    assert_eq!(first.holder, "a");
    let renewed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            watch.changed().await.unwrap();
            let cur = watch.borrow_and_update().clone();
            if let Some(cur) = cur {
                if cur.renewed_at > first.renewed_at {
                    return cur;
                }
            }
        }
    })
    .await
    .expect("a renewal reaches the watchers");
    assert_eq!(renewed.term, la.term());
    assert!(renewed.lease_until > first.lease_until);
    let row = pgelect::admin::current_leader(&o, "one")
        .await
        .unwrap()
        .unwrap();
    assert!(row.renewed_at >= renewed.renewed_at);
    // After the release the observer comes back and sees nobody lead.
    la.resign().await.unwrap();
    println!(
        "observer back {:?} after the release",
        await_observers(&db, "one", 1).await
    );
    assert!(watch.borrow().is_none());
}

/// The xmin a backend of this test's database holds, by application name.
async fn backend_xmin(c: &tokio_postgres::Client, app: &str) -> Option<i64> {
    c.query_typed_one(
        "SELECT backend_xmin::text::bigint FROM pg_stat_activity
          WHERE application_name = $1 AND datname = current_database()",
        &[(&app, tokio_postgres::types::Type::TEXT)],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_standby_does_not_hold_back_vacuum() {
    let (db, o) = migrated("elect_xmin").await;
    let a = fast(&o, "xmin", "a").build().unwrap();
    let b = fast(&o, "xmin", "b")
        .session(|s| s.wait_slice(Duration::from_millis(300)))
        .build()
        .unwrap();
    let la = a.leadership().await.unwrap();
    let standby = tokio::spawn(async move { b.leadership().await });
    db.wait_for_advisory_waiters(1).await;
    let c = db.connect().await;
    // The wait runs in slices: between two of them the backend is briefly
    // idle and holds no snapshot, so read until a slice is in progress.
    let t_first = Instant::now();
    let first = loop {
        if let Some(x) = backend_xmin(&c, "pgelect:xmin:b").await {
            break x;
        }
        assert!(
            t_first.elapsed() < Duration::from_secs(5),
            "a waiting statement holds a snapshot within a few slices"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Transactions go on elsewhere; the standby's horizon must follow them
    // within a few slices rather than stay where its wait began.
    let t0 = Instant::now();
    let moved = loop {
        let xid: i64 = c
            .query_typed_one("SELECT txid_current()", &[])
            .await
            .unwrap()
            .get(0);
        if let Some(now) = backend_xmin(&c, "pgelect:xmin:b").await {
            if now > first {
                break now;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the standby's xmin stayed at {first} while xids reached {xid}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!(
        "standby xmin moved from {first} to {moved} in {:?} (slice 300 ms)",
        t0.elapsed()
    );
    // Still a blocking standby: a clean release is taken at once.
    let t1 = Instant::now();
    la.resign().await.unwrap();
    let lb = tokio::time::timeout(Duration::from_secs(5), standby)
        .await
        .expect("the standby takes over")
        .unwrap()
        .unwrap();
    println!("released -> standby elected in {:?}", t1.elapsed());
    assert!(
        t1.elapsed() < Duration::from_millis(500),
        "{:?}",
        t1.elapsed()
    );
    lb.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lock_connection_is_reused_unless_it_died() {
    let (db, o) = migrated("elect_reuse").await;
    let a = fast(&o, "reuse", "a").build().unwrap();
    let first = a.leadership().await.unwrap();
    let pid = holder_pid(&db, "reuse").await;
    let first_term = first.term().get();
    first.resign().await.unwrap();
    // The next campaign runs on the same server backend.
    let second = a.leadership().await.unwrap();
    assert_eq!(holder_pid(&db, "reuse").await, pid);
    assert_eq!(second.term().get(), first_term + 1);
    second.resign().await.unwrap();
    let c = db.connect().await;
    let idle: i64 = c
        .query_typed_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE pid = $1 AND state = 'idle'",
            &[(&pid, tokio_postgres::types::Type::INT4)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(idle, 1, "the spare connection stays open and idle");
    // A spare connection that died is replaced.
    c.query_typed(
        "SELECT pg_terminate_backend($1)",
        &[(&pid, tokio_postgres::types::Type::INT4)],
    )
    .await
    .unwrap();
    let third = tokio::time::timeout(Duration::from_secs(10), a.leadership())
        .await
        .expect("a new connection is opened")
        .unwrap();
    assert_ne!(holder_pid(&db, "reuse").await, pid);
    third.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_leader_renewal_and_fence_fail_after_takeover() {
    let (db, o) = migrated("elect_stale").await;
    let a = fast(&o, "stale", "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let client = db.connect().await;
    // The fence passes for the current term.
    client.batch_execute("BEGIN").await.unwrap();
    la.fence(&client).await.expect("current term is fenced in");
    client.batch_execute("COMMIT").await.unwrap();
    // Another party takes the row over (as a takeover does: term bump).
    client
        .batch_execute(
            "UPDATE pgelect.leaders SET term = term + 1, holder = 'intruder' WHERE role = 'stale'",
        )
        .await
        .unwrap();
    // Before the leader notices, the server already refuses its term.
    client.batch_execute("BEGIN").await.unwrap();
    let e = la.fence(&client).await.unwrap_err();
    client.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        e.is_stale_term() || matches!(e, Error::LeadershipLost { .. }),
        "{e}"
    );
    // The next renewal finds no row: preempted, at once.
    let t0 = Instant::now();
    tokio::time::timeout(Duration::from_secs(3), la.lost())
        .await
        .expect("renewal notices the takeover");
    println!("stale leader noticed the takeover in {:?}", t0.elapsed());
    assert_eq!(la.loss().map(|l| l.reason()), Some(LossReason::Preempted));
    let e = la.fence(&client).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::LeadershipLost {
                reason: LossReason::Preempted,
                ..
            }
        ),
        "{e}"
    );
    // SQL fence with the old term fails too.
    let old = la.term().get();
    let r = client
        .query_typed(
            "SELECT pgelect.fence('stale', $1)",
            &[(&old, tokio_postgres::types::Type::INT8)],
        )
        .await;
    assert_eq!(
        r.unwrap_err().code().unwrap().code(),
        pgelect::schema::SQLSTATE_STALE_TERM
    );
    la.resign().await.unwrap();
}

/// A fenced transaction whose client goes silent in the middle (a frozen
/// leader, or one cut off where the server does not see it yet) holds the
/// role's row FOR SHARE, and the next term's bump waits for it: the fence
/// caps the transaction's idle time at the lease's length, so the server
/// ends that session and a standby takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_transaction_left_open_does_not_hold_back_the_next_leader() {
    let (db, o) = migrated("elect_fence_idle").await;
    let a = fast(&o, "fidle", "a").build().unwrap();
    let b = fast(&o, "fidle", "b").build().unwrap();
    let la = a.leadership().await.unwrap();
    let fencer = db.connect().await;
    fencer.batch_execute("BEGIN").await.unwrap();
    la.fence(&fencer).await.unwrap();
    let idle: String = fencer
        .query_one("SHOW idle_in_transaction_session_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        idle, "2s",
        "capped at the lease (ttl 2s) for this transaction"
    );
    // The fencer now says nothing more; the leader's lock connection ends.
    let standby = tokio::spawn(async move { b.leadership().await.unwrap() });
    db.wait_for_advisory_waiters(1).await;
    let pid = holder_pid(&db, "fidle").await;
    let t0 = Instant::now();
    db.connect()
        .await
        .query_typed(
            "SELECT pg_terminate_backend($1)",
            &[(&pid, tokio_postgres::types::Type::INT4)],
        )
        .await
        .unwrap();
    let lb = tokio::time::timeout(Duration::from_secs(30), standby)
        .await
        .expect("the standby leads although a fenced transaction was left open")
        .unwrap();
    let took = t0.elapsed();
    println!("a fenced transaction left open: the standby led {took:?} after the leader's connection ended");
    assert!(lb.term() > la.term());
    // The server ended the silent session; the other sessions keep the
    // default (the cap was this transaction's only).
    let e = fencer.batch_execute("COMMIT").await.unwrap_err();
    assert!(fencer.is_closed(), "{e}");
    let other: String = db
        .connect()
        .await
        .query_one("SHOW idle_in_transaction_session_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(other, "0");
    lb.resign().await.unwrap();
}

/// The fence compares the session's own idle-in-transaction timeout
/// (whatever its unit) with the lease: a longer one is capped at the lease
/// for the transaction, a shorter one is left as the session set it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_caps_a_longer_idle_timeout_and_keeps_a_shorter_one() {
    let (db, o) = migrated("elect_fence_units").await;
    let a = fast(&o, "funits", "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let fencer = db.connect().await;
    for (session, in_transaction) in [
        ("1min", "2s"),
        ("86400000", "2s"),
        ("2147483647", "2s"),
        ("1500ms", "1500ms"),
        ("0", "2s"),
    ] {
        fencer
            .batch_execute(&format!(
                "SET idle_in_transaction_session_timeout = '{session}'; BEGIN"
            ))
            .await
            .unwrap();
        la.fence(&fencer).await.unwrap();
        let idle: String = fencer
            .query_one("SHOW idle_in_transaction_session_timeout", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(idle, in_transaction, "session value {session}, ttl 2s");
        fencer.batch_execute("ROLLBACK").await.unwrap();
    }
    la.resign().await.unwrap();
}

/// A fenced transaction of the leader's own holds the role's row FOR
/// SHARE while it runs. The renewal skips the locked row instead of
/// waiting behind it: the server answered, so the leader keeps its
/// connection (it used to give it up once a fenced transaction outlasted
/// the heartbeat timeout: the fast profile's needless losses under
/// `pgelect chaos`), the lease is not extended while the row is held, and
/// it is renewed once the transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_fenced_transaction_does_not_cost_the_leader_its_connection() {
    let (db, o) = migrated("elect_fence_busy").await;
    let a = Elector::builder(o.clone(), "fbusy")
        .node_id("a")
        .ttl(Duration::from_secs(4))
        .renew_every(Duration::from_millis(500))
        .session(|s| {
            s.heartbeat(Duration::from_millis(200))
                .heartbeat_timeout(Duration::from_millis(300))
        })
        .build()
        .unwrap();
    let la = a.leadership().await.unwrap();
    let lease_until = || async {
        let c = db.connect().await;
        let t: std::time::SystemTime = c
            .query_one(
                "SELECT lease_until FROM pgelect.leaders WHERE role = 'fbusy'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        t
    };
    let fencer = db.connect().await;
    fencer.batch_execute("BEGIN").await.unwrap();
    la.fence(&fencer).await.unwrap();
    let held = lease_until().await;
    // Held for a renewal period plus four answer limits: a renewal that
    // waited for the row would miss its limit by far.
    let hold = Duration::from_millis(1700);
    tokio::select! {
        _ = la.lost() => panic!("the leader lost while its own fenced transaction held the row: {:?}", la.loss().map(|l| l.reason())),
        _ = tokio::time::sleep(hold) => {}
    }
    assert_eq!(
        lease_until().await,
        held,
        "no renewal extended the lease while the row was held"
    );
    fencer.batch_execute("COMMIT").await.unwrap();
    let t0 = Instant::now();
    let renewed = loop {
        tokio::select! {
            _ = la.lost() => panic!("the leader lost after the fenced transaction ended: {:?}", la.loss().map(|l| l.reason())),
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        if lease_until().await > held {
            break t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the lease was not renewed after the fenced transaction ended"
        );
    };
    println!("a fenced transaction held the row for {hold:?}: the leader kept term {}, and renewed {renewed:?} after it ended", la.term());
    assert!(la.loss().map(|l| l.reason()).is_none());
    la.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_leader_backend_hands_over_after_the_delay() {
    let (db, o) = migrated("elect_terminate").await;
    let a = fast(&o, "term", "a").build().unwrap();
    let b = fast(&o, "term", "b").build().unwrap();
    let log = Intervals::default();
    let la = a.leadership().await.unwrap();
    let ia = log.start("a", la.term());
    let log2 = log.clone();
    let standby = tokio::spawn(async move {
        let l = b.leadership().await.unwrap();
        let i = log2.start("b", l.term());
        (l, i)
    });
    db.wait_for_advisory_waiters(1).await;
    let pid = holder_pid(&db, "term").await;
    let c = db.connect().await;
    let t0 = Instant::now();
    c.query_typed(
        "SELECT pg_terminate_backend($1)",
        &[(&pid, tokio_postgres::types::Type::INT4)],
    )
    .await
    .unwrap();
    la.lost().await;
    log.end_at(ia, la.loss().map(|l| l.at()).expect("lost"));
    let noticed = t0.elapsed();
    let (lb, ib) = standby.await.unwrap();
    let took = t0.elapsed();
    println!("terminated backend: leader noticed in {noticed:?}, standby acting after {took:?} (handover delay {:?})", a.handover_delay());
    assert_eq!(
        la.loss().map(|l| l.reason()),
        Some(LossReason::ConnectionLost)
    );
    assert!(noticed < Duration::from_millis(500), "{noticed:?}");
    assert!(
        took >= a.handover_delay(),
        "unclean takeover waits the handover delay"
    );
    assert!(lb.term() > la.term());
    log.end(ib);
    log.assert_disjoint();
    lb.resign().await.unwrap();
}

/// A leader `a` (built by `build` on the options it gets) whose connection
/// goes through a proxy, a standby `b` on a direct one; the proxy is
/// blackholed once `b` waits. Returns once `b` leads (within `within`).
struct CutOff {
    a: Elector,
    la: Leadership,
    lb: Leadership,
    /// From the cut until `a` saw its loss, until `b` acted.
    noticed: Duration,
    took: Duration,
    log: Intervals,
    ib: usize,
    proxy: FaultProxy,
}

async fn cut_off_leader(
    hint: &str,
    within: Duration,
    build: impl Fn(&ConnectOptions, &str) -> Elector,
) -> CutOff {
    let (db, o) = migrated(hint).await;
    let proxy = FaultProxy::start(db.server_addr()).unwrap();
    let via_proxy = ConnectOptions::from_config(db.config_via(proxy.port()));
    let (a, b) = (build(&via_proxy, "a"), build(&o, "b"));
    let log = Intervals::default();
    let la = a.leadership().await.unwrap();
    let ia = log.start("a", la.term());
    let log2 = log.clone();
    let standby = tokio::spawn(async move {
        let l = b.leadership().await.unwrap();
        let i = log2.start("b", l.term());
        (l, i)
    });
    db.wait_for_advisory_waiters(1).await;
    let t0 = Instant::now();
    proxy.blackhole();
    la.lost().await;
    log.end_at(ia, la.loss().map(|l| l.at()).expect("lost"));
    let noticed = t0.elapsed();
    let (lb, ib) = tokio::time::timeout(within, standby)
        .await
        .expect("standby takes over from a partitioned leader")
        .unwrap();
    let took = t0.elapsed();
    CutOff {
        a,
        la,
        lb,
        noticed,
        took,
        log,
        ib,
        proxy,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_leader_demotes_before_the_standby_acts() {
    let c = cut_off_leader("elect_blackhole", Duration::from_secs(20), |o, node| {
        fast(o, "bh", node).build().unwrap()
    })
    .await;
    let (noticed, took) = (c.noticed, c.took);
    println!(
        "blackhole: leader demoted after {noticed:?} ({:?}), standby acting after {took:?}",
        c.la.loss().map(|l| l.reason())
    );
    assert!(
        noticed <= c.a.deadline_budget() + Duration::from_millis(200),
        "{noticed:?}"
    );
    assert!(c.lb.term() > c.la.term());
    c.log.end(c.ib);
    c.log.assert_disjoint();
    c.proxy.heal();
    c.lb.resign().await.unwrap();
}

/// A standby that takes over from a cut-off leader once its lease has
/// expired on the server's clock acts at once: the old leader's deadline
/// has passed, so there is no handover delay to wait (it would add 400 ms
/// to a partition failover at a 2 s TTL). Here the handover delay is 8 s,
/// so a standby that waited it could not lead within the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_taking_over_an_expired_lease_acts_without_the_handover_delay() {
    let delay = Duration::from_secs(8);
    let CutOff {
        la,
        lb,
        took,
        log,
        ib,
        proxy,
        ..
    } = cut_off_leader("elect_expired", delay * 2, |o, node| {
        let e = fast(o, "exp", node)
            .session(|s| s.handover_delay(delay))
            .build()
            .unwrap();
        assert_eq!(e.handover_delay(), delay);
        e
    })
    .await;
    println!(
        "expired lease: standby acting {took:?} after the cut (ttl 2 s, handover delay {delay:?})"
    );
    // Quiet machine: about 2.2 s (the lease's expiry, then the watch's
    // next look). Waiting the delay as well would take over 8 s.
    assert!(took < delay, "{took:?}: waited the handover delay");
    assert!(lb.term() > la.term());
    log.end(ib);
    log.assert_disjoint();
    proxy.heal();
    lb.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_restart_ends_in_exactly_one_leader_with_a_higher_term() {
    if pgelect_testkit::skip_without_own_server("database_restart_ends_in_exactly_one_leader") {
        return;
    }
    let cluster = Cluster::start().unwrap();
    let db = TestDb::on(&cluster, "elect_restart").await;
    let o = options(&db.url());
    pgelect::migrate(&o).await.unwrap();
    let log = Intervals::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut tasks = Vec::new();
    for n in 0..3 {
        let e = fast(&o, "restart", &format!("n{n}")).build().unwrap();
        let log = log.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let l = tokio::select! {
                    _ = stop.cancelled() => return,
                    l = e.leadership() => l.unwrap(),
                };
                let i = log.start(e.node_id(), l.term());
                tokio::select! {
                    _ = l.lost() => log.end_at(i, l.loss().map(|l| l.at()).expect("lost")),
                    _ = stop.cancelled() => { log.end(i); let _ = l.resign().await; return; }
                }
            }
        }));
    }
    let wait_leader = |min: Term| {
        let log = log.clone();
        async move {
            loop {
                if let Some(t) = log
                    .0
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|x| x.1 > min && x.3.is_none())
                    .map(|x| x.1)
                {
                    return t;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let first = tokio::time::timeout(Duration::from_secs(10), wait_leader(Term::new(0)))
        .await
        .unwrap();
    let t0 = Instant::now();
    tokio::task::block_in_place(|| cluster.restart()).unwrap();
    let second = tokio::time::timeout(Duration::from_secs(30), wait_leader(first))
        .await
        .expect("a leader after the restart");
    println!("database restart: term {first} -> {second}, new leader acting {:?} after the restart began", t0.elapsed());
    // Stay a while: still exactly one.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let open = log
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|x| x.3.is_none())
        .count();
    assert_eq!(open, 1);
    stop.cancel();
    for t in tasks {
        t.await.unwrap();
    }
    log.assert_disjoint();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_demotes_after_duties_stop_and_resign_can_be_requested() {
    let (_db, o) = migrated("elect_run").await;
    let events = Arc::new(Mutex::new(Vec::<String>::new()));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let e = fast(&o, "run", "runner").build().unwrap();
    let ev1 = events.clone();
    let ev2 = events.clone();
    let runner = tokio::spawn(e.run(
        shutdown.clone(),
        move |ctx| {
            let ev = ev1.clone();
            async move {
                ev.lock().unwrap().push(format!("elected {}", ctx.term()));
                ctx.lost().await;
                // Duties take a while to stop.
                tokio::time::sleep(Duration::from_millis(100)).await;
                ev.lock().unwrap().push(format!(
                    "duties stopped {:?}",
                    ctx.loss().map(|l| l.reason())
                ));
            }
        },
        move || {
            let ev = ev2.clone();
            async move { ev.lock().unwrap().push("demoted".into()) }
        },
    ));
    let standby = fast(&o, "run", "standby").build().unwrap();
    let mut watch = standby.watch();
    tokio::time::timeout(Duration::from_secs(5), async {
        while watch.borrow_and_update().as_ref().map(|i| i.holder.clone()) != Some("runner".into())
        {
            watch.changed().await.unwrap();
        }
    })
    .await
    .unwrap();
    // The standby waits in the lock queue before the request, so it is
    // granted the lock ahead of the runner standing again.
    let standby_task = tokio::spawn(async move {
        let l = standby.leadership().await.unwrap();
        (Instant::now(), l)
    });
    _db.wait_for_advisory_waiters(1).await;
    let t0 = Instant::now();
    let asked = pgelect::admin::request_resign(&o, "run").await.unwrap();
    assert_eq!(asked.unwrap().holder, "runner");
    let (at, l) = tokio::time::timeout(Duration::from_secs(10), standby_task)
        .await
        .expect("standby takes over after the requested resign")
        .unwrap();
    let took = at - t0;
    println!("requested resign -> standby elected in {took:?} (duties take 100 ms to stop)");
    // Clean release: no handover delay (1.2 s); duties took 100 ms.
    assert!(took < Duration::from_millis(1000), "{took:?}");
    // `run` releases the lock before it calls `on_demoted`, so the standby
    // may be elected a moment before "demoted" is recorded: wait for it.
    tokio::time::timeout(Duration::from_secs(5), async {
        while events.lock().unwrap().len() < 3 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("on_demoted runs after the release");
    {
        let ev = events.lock().unwrap();
        assert_eq!(ev[1], "duties stopped Some(Resigned)");
        assert_eq!(ev[2], "demoted");
    }
    l.resign().await.unwrap();
    // The runner stands again and leads; shutdown stops it cleanly.
    tokio::time::timeout(Duration::from_secs(5), async {
        while events.lock().unwrap().len() < 4 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    shutdown.cancel();
    runner.await.unwrap().unwrap();
    let ev = events.lock().unwrap().clone();
    assert_eq!(ev[4], "duties stopped Some(Shutdown)", "{ev:?}");
    assert_eq!(ev[5], "demoted");
    assert!(pgelect::admin::current_leader(&o, "run")
        .await
        .unwrap()
        .is_none());
}

#[tokio::test]
async fn transaction_pooler_is_refused_session_pooler_works() {
    if pgelect_testkit::skip_without_own_server("transaction_pooler_is_refused") {
        return;
    }
    let (db, _) = migrated("elect_pooler").await;
    let tx_pool = PgBouncer::start(Cluster::shared(), PoolMode::Transaction).unwrap();
    let o = options(&tx_pool.url(db.name()));
    let e = fast(&o, "pooled", "p").build().unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), e.leadership())
        .await
        .expect("refused promptly")
        .unwrap_err();
    assert!(matches!(err, Error::Pooler(_)), "{err}");
    assert!(err.to_string().contains("lease backend"), "{err}");
    println!("transaction pool: {err}");

    let session_pool = PgBouncer::start(Cluster::shared(), PoolMode::Session).unwrap();
    let o = options(&session_pool.url(db.name()));
    let l = fast(&o, "pooled", "s")
        .build()
        .unwrap()
        .leadership()
        .await
        .unwrap();
    assert!(!l.is_lost());
    l.resign().await.unwrap();
}

#[tokio::test]
async fn missing_schema_says_to_migrate() {
    let db = TestDb::new("elect_noschema").await;
    let e = fast(&options(&db.url()), "r", "n").build().unwrap();
    let err = e.leadership().await.unwrap_err();
    assert!(matches!(err, Error::SchemaMissing { .. }), "{err}");
    assert!(err.to_string().contains("pgelect migrate"), "{err}");
}

#[test]
fn bad_configurations_are_rejected_naming_the_values() {
    let o = options("postgres://u@localhost/db");
    let err = |b: ElectorBuilder| b.build().unwrap_err().to_string();
    let e = err(Elector::builder(o.clone(), "r").ttl(Duration::ZERO));
    assert!(e.contains("ttl must be positive"), "{e}");
    let e = err(Elector::builder(o.clone(), "r").renew_every(Duration::ZERO));
    assert!(e.contains("renew_every must be positive"), "{e}");
    let e = err(Elector::builder(o.clone(), "r").session(|s| s.wait_slice(Duration::ZERO)));
    assert!(e.contains("wait_slice must be positive"), "{e}");
    let e = err(Elector::builder(o.clone(), "r")
        .session(|s| s.wait_slice(Duration::from_secs(2 * 24 * 3600))));
    assert!(
        e.contains("wait_slice 172800s is longer than the maximum"),
        "{e}"
    );
    let e = err(Elector::builder(o.clone(), "r")
        .ttl(Duration::from_secs(5))
        .renew_every(Duration::from_secs(5)));
    assert!(
        e.contains("renew_every 5s must be shorter than ttl 5s"),
        "{e}"
    );
    let e =
        err(Elector::builder(o.clone(), "r")
            .session(|s| s.handover_delay(Duration::from_millis(10))));
    assert!(e.contains("handover_delay 10ms"), "{e}");
    let e = err(Elector::builder(o.clone(), "r").session(|s| {
        s.tcp_timeouts(pgelect::conn::TcpTimeouts {
            keepalive_idle: Duration::from_secs(1),
            keepalive_interval: Duration::from_secs(1),
            keepalive_count: 2,
            user_timeout: Duration::from_secs(60),
        })
    }));
    assert!(e.contains("keepalive_idle 1s"), "{e}");
    let e = err(Elector::builder(o.clone(), "r").session(|s| {
        s.standby(StandbyMode::Polling {
            interval: Duration::ZERO,
        })
    }));
    assert!(e.contains("polling interval"), "{e}");
    for role in ["", "a\0b"] {
        let e = Elector::builder(o.clone(), role).build().unwrap_err();
        assert!(matches!(e, Error::InvalidName { what: "role", .. }), "{e}");
    }
    let long = "r".repeat(pgelect::election::MAX_ROLE_BYTES + 1);
    let e = Elector::builder(o.clone(), &long).build().unwrap_err();
    assert!(matches!(e, Error::InvalidName { what: "role", .. }), "{e}");
    let e = Elector::builder(o.clone(), "r")
        .node_id("")
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidName {
                what: "node id",
                ..
            }
        ),
        "{e}"
    );
    // Defaults are valid and the node id is unique per process, not the host.
    let a = Elector::builder(o.clone(), "r").build().unwrap();
    let b = Elector::builder(o, "r").build().unwrap();
    assert_ne!(a.node_id(), b.node_id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_standbys_take_over_after_a_release_and_after_a_terminated_leader() {
    let (db, o) = migrated("elect_polling").await;
    let polling = |node: &str| {
        fast(&o, "poll", node).session(|s| {
            s.standby(StandbyMode::Polling {
                interval: Duration::from_millis(300),
            })
        })
    };
    let a = fast(&o, "poll", "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let b = polling("b").build().unwrap();
    let standby = tokio::spawn(async move {
        let l = b.leadership().await.unwrap();
        (Instant::now(), l)
    });
    // A polling standby holds no lock entry; let it connect and listen.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    la.resign().await.unwrap();
    let (at, lb) = tokio::time::timeout(Duration::from_secs(10), standby)
        .await
        .expect("the polling standby takes over")
        .unwrap();
    println!("polling standby after a clean release: {:?}", at - t0);
    assert_eq!(lb.term().get(), la_term(&db).await);
    // Liveness only (the NOTIFY wake-up makes it milliseconds when quiet).
    assert!(at - t0 < Duration::from_secs(3), "{:?}", at - t0);

    // An unclean loss: the leader's backend is terminated; the next polling
    // standby takes over with a higher term, only after the handover delay.
    let c = polling("c").build().unwrap();
    let handover = c.handover_delay();
    let next = tokio::spawn(async move {
        let l = c.leadership().await.unwrap();
        (Instant::now(), l)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = holder_pid(&db, "poll").await;
    let admin = db.connect().await;
    let t1 = Instant::now();
    admin
        .query_typed_one(
            "SELECT pg_terminate_backend($1)",
            &[(&pid, tokio_postgres::types::Type::INT4)],
        )
        .await
        .unwrap();
    lb.lost().await;
    assert_eq!(
        lb.loss().map(|l| l.reason()),
        Some(LossReason::ConnectionLost)
    );
    let (at, lc) = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("the second polling standby takes over")
        .unwrap();
    println!(
        "polling standby after a terminated leader: {:?} (handover delay {handover:?})",
        at - t1
    );
    assert!(lc.term() > lb.term());
    assert!(
        at - t1 >= handover,
        "unclean takeover waits the handover delay"
    );
    lc.resign().await.unwrap();
}

async fn la_term(db: &TestDb) -> i64 {
    let c = db.connect().await;
    c.query_typed_one("SELECT term FROM pgelect.leaders WHERE role = 'poll'", &[])
        .await
        .unwrap()
        .get(0)
}

/// A session leader with polling standbys that resigns and stands again at
/// once does not win back the role it gave up while a polling standby
/// waits for it (the lease backend's stand-aside, on the session backend).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resigning_leader_with_polling_standbys_hands_the_role_to_the_waiting_standby() {
    let (_db, o) = migrated("sess_aside").await;
    let role = "aside-polling";
    // Polling every second: the resigned leader stands aside for 1.25 s,
    // room for the woken standby on a loaded machine (at 200 ms, a CI run
    // beside a build saw the standby act after the 250 ms were over).
    let polling = |node: &str| {
        support::fast_session(&o, role, node)
            .session(|s| {
                s.standby(pgelect::election::StandbyMode::Polling {
                    interval: Duration::from_secs(1),
                })
            })
            .build()
            .unwrap()
    };
    let electors = [Arc::new(polling("a")), Arc::new(polling("b"))];
    // A polling standby shows nothing on the server between polls: let it
    // make its first one.
    let settle = tokio::time::sleep(Duration::from_millis(400));
    let rounds = 4;
    let (handed, took, leader, standby) =
        support::resign_rounds(&electors, settle, rounds, None).await;
    println!(
        "session, polling standbys: the waiting standby took over in {handed} of {rounds} rounds, after {took:?}"
    );
    assert_eq!(handed, rounds);
    standby.abort();
    leader.resign().await.unwrap();
}
