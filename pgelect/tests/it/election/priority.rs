//! Preferred leaders: a candidate of strictly higher
//! priority that stands and is ready to take the lock makes the leader hand
//! over cleanly (new term, no overlap); equal priorities never flap; a
//! registered candidate that does not wait, and anything another database
//! user does, moves nothing.
//!
//! Timings are printed; bounds are generous (a loaded 2-core machine).

use std::time::{Duration, Instant};

use pgelect::{
    election::Backend, election::StandbyMode, loss::LossReason, ConnectOptions, Elector,
    ElectorBuilder,
};
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::support;
use support::{fast_session, migrated, Intervals};

/// Renewals 10 s apart (ttl 30 s): a handover sooner than that was brought
/// about by the preferred candidate's hint, not by a regular renewal.
fn slow(o: &ConnectOptions, role: &str, node: &str, priority: i32) -> ElectorBuilder {
    Elector::builder(o.clone(), role)
        .node_id(node)
        .ttl(Duration::from_secs(30))
        .renew_every(Duration::from_secs(10))
        .priority(priority)
}

/// Backends waiting (not granted) on `role`'s lock.
async fn waiters(admin: &Client, role: &str) -> Vec<i32> {
    admin
        .query_typed(
            "WITH k AS (SELECT pgelect.key('election:pgelect:' || $1::text) AS k)
             SELECT l.pid FROM pg_locks l, k
              WHERE l.locktype = 'advisory' AND NOT l.granted AND l.objsubid = 1
                AND l.classid = ((k.k >> 32) & 4294967295)::oid
                AND l.objid = (k.k & 4294967295)::oid
              ORDER BY l.pid",
            &[(&role, Type::TEXT)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Waits (polling pg_locks every 5 ms) until `n` backends wait on `role`'s
/// lock.
async fn await_waiters(admin: &Client, role: &str, n: usize) {
    let t0 = Instant::now();
    while waiters(admin, role).await.len() < n {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{n} waiters on {role}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn term_of_row(admin: &Client, role: &str) -> (Option<String>, i64) {
    let r = admin
        .query_typed_one(
            "SELECT holder, term FROM pgelect.leaders WHERE role = $1",
            &[(&role, Type::TEXT)],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

/// Leader `old-a` (priority 0) with a standby `old-b` (priority 0) queued
/// first; `new-c` (priority 10) starts standing. The leader hands over at
/// `new-c`'s hint (long before its next renewal), `old-b` is granted the
/// lock first (FIFO) but gives it back without a term, and `new-c` leads
/// with the next term; no overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_priority_candidate_joining_takes_over_with_the_next_term() {
    let captured = support::Log::install_global(tracing::Level::DEBUG);
    let (db, o) = migrated("prio_handover").await;
    let admin = db.connect().await;
    let role = "deploy";
    let log = Intervals::default();

    let a = slow(&o, role, "old-a", 0).build().unwrap();
    let la = a.leadership().await.unwrap();
    let term_a = la.term();
    let ia = log.start("old-a", term_a);
    let a_duties = tokio::spawn(async move {
        la.lost().await;
        let at = la.loss().map(|l| l.at()).unwrap();
        let reason = la.loss().map(|l| l.reason());
        la.resign().await.expect("a clean release");
        (reason, at, Instant::now())
    });

    let b = slow(&o, role, "old-b", 0).build().unwrap();
    let b_task = tokio::spawn(async move {
        let l = b.leadership().await.unwrap();
        (l.term(), b)
    });
    await_waiters(&admin, role, 1).await;

    let t0 = Instant::now();
    let c = slow(&o, role, "new-c", 10).build().unwrap();
    let lc = tokio::time::timeout(Duration::from_secs(8), c.leadership())
        .await
        .expect("the preferred candidate leads long before the next renewal (10 s)")
        .unwrap();
    let elected_after = t0.elapsed();
    let ic = log.start("new-c", lc.term());
    let (reason, lost_at, released_at) = a_duties.await.unwrap();
    log.end_at(ia, lost_at);
    assert_eq!(reason, Some(LossReason::HandedOver));
    assert_eq!(
        lc.term().get(),
        term_a.get() + 1,
        "old-b gave the lock back without a term"
    );
    assert!(!b_task.is_finished(), "old-b still stands");
    assert_eq!(
        term_of_row(&admin, role).await,
        (Some("new-c".to_owned()), term_a.get() + 1)
    );
    println!(
        "handover: new-c leads {elected_after:?} after it began standing; old-a's duties stopped {:?} after that, its release took {:?}",
        lost_at.saturating_duration_since(t0),
        released_at.saturating_duration_since(lost_at),
    );
    if let Some(log) = &captured {
        for l in log.text().lines().filter(|l| {
            [
                "preferred",
                "higher priority",
                "handing",
                "elected",
                "hint",
                "released",
                "lock granted",
            ]
            .iter()
            .any(|n| l.contains(n))
        }) {
            println!("  {l}");
        }
        assert_eq!(
            log.count("giving it back"),
            1,
            "old-b was granted first and yielded"
        );
    }
    assert!(elected_after < Duration::from_secs(3), "{elected_after:?}");
    // The new leader keeps it: old-b (priority 0) waits behind.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!lc.is_lost());
    lc.resign().await.unwrap();
    log.end(ic);
    let (term_b, _b) = tokio::time::timeout(Duration::from_secs(5), b_task)
        .await
        .expect("old-b leads after new-c resigns")
        .unwrap();
    assert_eq!(term_b.get(), term_a.get() + 2);
    log.assert_disjoint();
}

/// Equal priorities never take over from each other, and lower ones never
/// from higher ones: the leader keeps its term over six renewal periods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_priorities_do_not_flap() {
    let (db, o) = migrated("prio_equal").await;
    let admin = db.connect().await;
    let role = "equal";
    let a = fast_session(&o, role, "a").priority(5).build().unwrap();
    let la = a.leadership().await.unwrap();
    let mut standbys = Vec::new();
    for (node, priority) in [("b", 5), ("c", 1), ("d", -3)] {
        let e = fast_session(&o, role, node)
            .priority(priority)
            .build()
            .unwrap();
        standbys.push(tokio::spawn(async move {
            let l = e.leadership().await.unwrap();
            (l, e)
        }));
    }
    await_waiters(&admin, role, 3).await;
    let registered: i64 = admin
        .query_one(
            "SELECT count(*) FROM pgelect.candidates WHERE role = 'equal'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(registered, 4);
    // Renewals every 500 ms: six of them, each reading the registry.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!la.is_lost(), "{:?}", la.loss().map(|l| l.reason()));
    assert!(standbys.iter().all(|t| !t.is_finished()));
    assert_eq!(
        term_of_row(&admin, role).await,
        (Some("a".to_owned()), la.term().get())
    );
    la.resign().await.unwrap();
    // The best of the rest (b, 5) is next, whatever the queue order.
    let (lb, _) = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            for t in &mut standbys {
                if t.is_finished() {
                    return t.await.unwrap();
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(
        term_of_row(&admin, role).await,
        (Some("b".to_owned()), lb.term().get())
    );
}

/// A preferred candidate that registered and then died (its campaign
/// dropped: the lock connection is killed), and a row whose backend lives
/// but waits for nothing, are not ready: hints or not, the leader stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_candidate_that_does_not_wait_moves_nothing() {
    let (db, o) = migrated("prio_not_ready").await;
    let admin = db.connect().await;
    let role = "idle";
    // `top` (20) leads while `gone` (10) queues up; `gone` then dies, and
    // `low` (0) takes over when `top` resigns.
    let top = fast_session(&o, role, "top").priority(20).build().unwrap();
    let ltop = top.leadership().await.unwrap();
    let gone = fast_session(&o, role, "gone").priority(10).build().unwrap();
    let campaign = tokio::spawn(async move { gone.leadership().await });
    await_waiters(&admin, role, 1).await;
    let gone_pid = waiters(&admin, role).await[0];
    // `low` registers while `gone` lives (registrations delete the rows of
    // dead candidates), then `gone` dies.
    let low = fast_session(&o, role, "low").build().unwrap();
    let low_task = tokio::spawn(async move { (low.leadership().await.unwrap(), low) });
    await_waiters(&admin, role, 2).await;
    campaign.abort();
    let _ = campaign.await;
    let t0 = Instant::now();
    while waiters(&admin, role).await.contains(&gone_pid) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "gone's backend ends"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    ltop.resign().await.unwrap();
    let (llow, _low) = tokio::time::timeout(Duration::from_secs(5), low_task)
        .await
        .unwrap()
        .unwrap();
    // `gone`'s row stays; and rows of priorities 30 and 40 on a live
    // backend that neither waits nor polls.
    let idle = db.connect().await;
    let idle_pid: i32 = idle
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    admin
        .execute(
            "INSERT INTO pgelect.candidates (role, node, backend_pid, priority, backend, standby, seen_at)
             VALUES ('idle', 'alive-not-waiting', $1, 30, 'session', 'blocking', now()),
                    -- a polling candidate whose backend lives on (a shared
                    -- connection) but that stopped polling a minute ago
                    ('idle', 'alive-not-polling', $1, 40, 'session', 'polling',
                     now() - interval '1 minute')",
            &[&idle_pid],
        )
        .await
        .unwrap();
    let rows: Vec<(String, i32)> = admin
        .query(
            "SELECT node, priority FROM pgelect.candidates WHERE role = 'idle' ORDER BY node",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(rows.contains(&("gone".to_owned(), 10)), "{rows:?}");
    // Hints bring checks forward; each finds nobody ready.
    for _ in 0..5 {
        admin
            .batch_execute("NOTIFY pgelect_resign, 'pgelect:idle'")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!llow.is_lost(), "{:?}", llow.loss().map(|l| l.reason()));
    assert_eq!(
        term_of_row(&admin, role).await,
        (Some("low".to_owned()), llow.term().get())
    );
    llow.resign().await.unwrap();
}

/// Another database user (CONNECT only) cannot register, and neither its
/// hints, nor its own wait on the role's public key, nor a stale row that
/// names its backend's pid (a recycled pid) make the leader hand over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_user_cannot_make_the_leader_hand_over() {
    let (db, o) = migrated("prio_hostile").await;
    let admin = db.connect().await;
    let role = "guarded";
    let url = db.create_role("mallory", "mallory-pw-13", false).await;
    let (mallory, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);

    let a = fast_session(&o, role, "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let term = la.term();

    for sql in [
        "INSERT INTO pgelect.candidates (role, node, backend_pid, priority, backend, standby)
         VALUES ('guarded', 'evil', pg_backend_pid(), 1000, 'session', 'polling')",
        "UPDATE pgelect.candidates SET priority = 1000",
        "DELETE FROM pgelect.candidates",
        "SELECT * FROM pgelect.candidates",
    ] {
        let e = mallory.batch_execute(sql).await.unwrap_err();
        assert_eq!(
            e.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{sql}: {e:?}"
        );
    }
    // Mallory queues on the role's key (public), then hints.
    let key = a.lock_key();
    let pgelect::LockKey::Single(k) = key else {
        unreachable!()
    };
    let (mallory2, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let mallory_pid: i32 = mallory2
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let queued = tokio::spawn(async move {
        let _ = mallory2.query("SELECT pg_advisory_lock($1)", &[&k]).await;
        mallory2
    });
    await_waiters(&admin, role, 1).await;
    // A stale row of a candidate whose pid mallory's backend now has
    // (written as the candidates' user would have: same db_user as `a`).
    admin
        .execute(
            "INSERT INTO pgelect.candidates (role, node, backend_pid, priority, backend, standby, db_user)
             VALUES ('guarded', 'recycled', $1, 1000, 'session', 'blocking', current_user)",
            &[&mallory_pid],
        )
        .await
        .unwrap();
    for _ in 0..20 {
        mallory
            .batch_execute("NOTIFY pgelect_resign, 'pgelect:guarded'")
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!la.is_lost(), "{:?}", la.loss().map(|l| l.reason()));
    assert_eq!(
        term_of_row(&admin, role).await,
        (Some("a".to_owned()), term.get())
    );
    la.resign().await.unwrap();
    drop(queued);
}

/// A polling preferred candidate (ready while its backend lives) takes over
/// from a blocking leader; a blocking lower-priority standby granted first
/// gives the lock back until the poller takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_preferred_candidate_takes_over() {
    let (db, o) = migrated("prio_polling").await;
    let admin = db.connect().await;
    let role = "poll";
    let a = fast_session(&o, role, "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let term = la.term();
    let b = fast_session(&o, role, "b").build().unwrap();
    let _b_task = tokio::spawn(async move { (b.leadership().await, b) });
    await_waiters(&admin, role, 1).await;
    let a_task = tokio::spawn(async move {
        la.lost().await;
        let reason = la.loss().map(|l| l.reason());
        la.resign().await.unwrap();
        reason
    });
    let t0 = Instant::now();
    let p = fast_session(&o, role, "poller")
        .priority(1)
        .session(|s| {
            s.standby(StandbyMode::Polling {
                interval: Duration::from_millis(300),
            })
        })
        .build()
        .unwrap();
    let lp = tokio::time::timeout(Duration::from_secs(5), p.leadership())
        .await
        .unwrap()
        .unwrap();
    println!("polling preferred candidate leads after {:?}", t0.elapsed());
    assert_eq!(a_task.await.unwrap(), Some(LossReason::HandedOver));
    assert_eq!(lp.term().get(), term.get() + 1);
    lp.resign().await.unwrap();
}

/// The registry holds each candidate's timing (milliseconds), and a
/// candidate that stops for good withdraws its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_holds_the_timing_and_withdraw_removes_the_row() {
    let (db, o) = migrated("prio_registry").await;
    let admin = db.connect().await;
    let a = fast_session(&o, "reg", "a").priority(-2).build().unwrap();
    let la = a.leadership().await.unwrap();
    let row = admin
        .query_one(
            "SELECT priority, backend, standby, timing, backend_pid = $1 FROM pgelect.candidates
              WHERE role = 'reg' AND node = 'a'",
            &[&holder_pid(&admin, "reg").await],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), -2);
    assert_eq!(row.get::<_, String>(1), "session");
    assert_eq!(row.get::<_, String>(2), "blocking");
    let timing: serde_json::Value = row.get(3);
    assert_eq!(timing["ttl_ms"], 2000);
    assert_eq!(timing["renew_every_ms"], 500);
    assert_eq!(timing["heartbeat_ms"], 200);
    assert!(row.get::<_, bool>(4), "the lock connection's backend pid");
    la.resign().await.unwrap();
    a.withdraw().await.unwrap();
    let left: i64 = admin
        .query_one("SELECT count(*) FROM pgelect.candidates", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

async fn holder_pid(admin: &Client, role: &str) -> i32 {
    admin
        .query_typed_one(
            "SELECT holder_pid FROM pgelect.leaders WHERE role = $1",
            &[(&role, Type::TEXT)],
        )
        .await
        .unwrap()
        .get(0)
}

/// Waits (bounded) until `node` has a row in the candidate registry.
async fn await_registered(admin: &Client, node: &str) {
    pgelect_testkit::wait_until(
        "the candidate's registration",
        Duration::from_secs(10),
        || async {
            admin
                .query_one(
                    "SELECT count(*) FROM pgelect.candidates WHERE node = $1",
                    &[&node],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1
        },
    )
    .await;
}

/// Lease backend, with a `LISTEN` connection: a standby of higher priority
/// registers and hints; the leader hands over at once, a lower standby
/// leaves the released lease to it, and it leads with the next term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_backend_hands_over_to_a_higher_priority_standby() {
    let (db, o) = migrated("prio_lease").await;
    let admin = db.connect().await;
    let role = "lease-deploy";
    let lease = |node: &str, priority: i32| {
        slow(&o, role, node, priority)
            .backend(Backend::Lease)
            .lease(|l| l.listen_via(o.clone()))
    };
    let a = lease("old-a", 0).build().unwrap();
    let la = a.leadership().await.unwrap();
    let term = la.term();
    let a_task = tokio::spawn(async move {
        la.lost().await;
        let reason = la.loss().map(|l| l.reason());
        la.resign().await.unwrap();
        reason
    });
    let b = lease("old-b", 0).build().unwrap();
    let b_task = tokio::spawn(async move { (b.leadership().await.unwrap(), b) });
    // old-b is registered (and so seen) before new-c stands.
    await_registered(&admin, "old-b").await;
    let t0 = Instant::now();
    let c = lease("new-c", 10).build().unwrap();
    let lc = tokio::time::timeout(Duration::from_secs(8), c.leadership())
        .await
        .expect("the preferred candidate leads long before the next renewal (10 s)")
        .unwrap();
    let took = t0.elapsed();
    println!("lease handover: new-c leads {took:?} after it began standing");
    assert_eq!(a_task.await.unwrap(), Some(LossReason::HandedOver));
    assert_eq!(lc.term().get(), term.get() + 1);
    assert!(!b_task.is_finished(), "old-b left the lease to new-c");
    assert!(took < Duration::from_secs(3), "{took:?}");
    // Equal or lower priorities leave the new leader alone.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!lc.is_lost());
    assert_eq!(
        term_of_row(&admin, role).await,
        (Some("new-c".to_owned()), term.get() + 1)
    );
    lc.resign().await.unwrap();
}

/// Lease backend: a leader of higher priority that gives the role up (and
/// stands no more, without withdrawing) is no ready candidate any more: its
/// release marks its registration as not seen, so the standby of lower
/// priority woken by the release takes the role at once, rather than defer
/// to the node that just left until its registration ages out (a TTL,
/// 30 s here) or its own next poll (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_standby_takes_over_from_a_preferred_leader_that_resigned() {
    let (db, o) = migrated("prio_lease_left").await;
    let admin = db.connect().await;
    let role = "lease-left";
    let lease = |node: &str, priority: i32| {
        slow(&o, role, node, priority)
            .backend(Backend::Lease)
            .lease(|l| l.listen_via(o.clone()).retry_every(Duration::from_secs(10)))
    };
    let a = lease("preferred", 10).build().unwrap();
    let la = a.leadership().await.unwrap();
    let term = la.term();
    let b = lease("standby", 0).build().unwrap();
    let b_task = tokio::spawn(async move { (b.leadership().await.unwrap(), b) });
    await_registered(&admin, "standby").await;
    // The leader's own registration is there and fresh: without the
    // release's mark it would be a ready candidate of priority 10.
    let fresh: bool = admin
        .query_one(
            "SELECT seen_at > now() - interval '30 seconds' FROM pgelect.candidates
              WHERE role = $1 AND node = 'preferred'",
            &[&role],
        )
        .await
        .unwrap()
        .get(0);
    assert!(fresh);
    let t0 = Instant::now();
    la.resign().await.unwrap();
    drop(a);
    let (lb, _b) = tokio::time::timeout(Duration::from_secs(8), b_task)
        .await
        .expect("the standby leads long before its next poll (10 s)")
        .unwrap();
    let took = t0.elapsed();
    println!("the standby leads {took:?} after the preferred leader resigned");
    assert_eq!(lb.term().get(), term.get() + 1);
    assert!(took < Duration::from_secs(3), "{took:?}");
    lb.resign().await.unwrap();
}

/// No livelock when the preferred candidate is gone: a polling candidate of
/// priority 10 is ready (its backend lives and its row is fresh), so the
/// leader hands over to it and the standby granted the lock gives it back,
/// again and again while it stays ready but never takes the lock. The
/// moment its backend ends, readiness (read at each grant) fails and the
/// standby leads, with the very next term: yielding bumps no term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_yields_only_while_the_preferred_candidate_is_ready() {
    let captured = support::Log::install_global(tracing::Level::INFO);
    let (db, o) = migrated("prio_gone").await;
    let admin = db.connect().await;
    let role = "gone";
    let a = fast_session(&o, role, "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let term = la.term();
    let a_task = tokio::spawn(async move {
        la.lost().await;
        let reason = la.loss().map(|l| l.reason());
        la.resign().await.unwrap();
        reason
    });
    let b = fast_session(&o, role, "b").build().unwrap();
    let b_task = tokio::spawn(async move { (b.leadership().await.unwrap(), b) });
    await_waiters(&admin, role, 1).await;
    // The preferred candidate: a registered polling standby (a live
    // backend, a fresh row) that never tries the lock.
    let idle = db.connect().await;
    let idle_pid: i32 = idle
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    admin
        .execute(
            "INSERT INTO pgelect.candidates (role, node, backend_pid, priority, backend, standby, timing)
             VALUES ('gone', 'vanishing', $1, 10, 'session', 'polling', '{\"poll_interval_ms\": 100}')",
            &[&idle_pid],
        )
        .await
        .unwrap();
    // At its next renewal (500 ms) the leader hands over.
    let reason = tokio::time::timeout(Duration::from_secs(5), a_task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reason, Some(LossReason::HandedOver));
    if let Some(log) = &captured {
        log.wait_for_line(&["giving it back", "vanishing"], Duration::from_secs(5))
            .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!b_task.is_finished(), "b yields while `vanishing` is ready");
    // `vanishing` goes away.
    let t0 = Instant::now();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&idle_pid])
        .await
        .unwrap();
    let (lb, _b) = tokio::time::timeout(Duration::from_secs(5), b_task)
        .await
        .expect("b leads once the preferred candidate is gone")
        .unwrap();
    let took = t0.elapsed();
    let yields = captured.as_ref().map(|l| l.count("giving it back"));
    println!("b leads {took:?} after the preferred candidate's backend ended; it gave the lock back {yields:?} times before");
    assert_eq!(lb.term().get(), term.get() + 1, "yields bump no term");
    // The pause between two yields is at most 1 s.
    assert!(took < Duration::from_millis(2500), "{took:?}");
    lb.resign().await.unwrap();
}
