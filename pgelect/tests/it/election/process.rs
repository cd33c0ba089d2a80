//! Leaders in other processes (the `candidate` example): SIGKILLed, and
//! frozen with SIGSTOP (zombie preemption, as superuser and as an
//! unprivileged role, and the fence of the frozen leader's term).

use std::time::{Duration, Instant};

use pgelect::{ConnectOptions, Elector};
use pgelect_testkit::{TestDb, TEST_PASSWORD};

use crate::support;
use support::{fast_session as fast, term_of, Candidate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_leader_process_is_replaced_with_a_higher_term() {
    let db = TestDb::new("proc_kill").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let leader = Candidate::spawn(&[&db.url(), "killed", "2000"]);
    let elected = leader.expect("ELECTED", Duration::from_secs(20));
    let old = term_of(&elected);
    let standby = fast(&o, "killed", "standby").build().unwrap();
    let handover = standby.handover_delay();
    let task = tokio::spawn(async move { (standby.leadership().await.unwrap(), Instant::now()) });
    db.wait_for_advisory_waiters(1).await;
    let t0 = Instant::now();
    leader.signal("-KILL");
    let (l, at) = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap();
    let took = at - t0;
    println!(
        "SIGKILLed leader process: standby acting after {took:?} (handover delay {handover:?})"
    );
    assert!(l.term() > old);
    // The dead leader stopped acting when it died (t0); the standby acts
    // only after the handover delay.
    assert!(took >= handover);
    assert!(took < handover + Duration::from_secs(2), "{took:?}");
    l.resign().await.unwrap();
}

/// Freezes a leader process; the standby (as `standby_url`'s role) must
/// preempt it only if allowed. Returns the standby's leadership.
async fn freeze_leader(
    db: &TestDb,
    standby_url: &str,
    role: &str,
    expect_takeover: bool,
) -> Option<pgelect::Leadership> {
    let leader = Candidate::spawn(&[&db.url(), role, "1000"]);
    let old = term_of(&leader.expect("ELECTED", Duration::from_secs(20)));
    let so = ConnectOptions::from_url(standby_url).unwrap();
    let standby = Elector::builder(so, role)
        .node_id("standby")
        .ttl(Duration::from_secs(1))
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(Duration::from_millis(300))
        .check_every(Duration::from_millis(100))
        .build()
        .unwrap();
    let task = tokio::spawn(async move { (standby.leadership().await, Instant::now()) });
    db.wait_for_advisory_waiters(1).await;
    let t0 = Instant::now();
    leader.signal("-STOP");
    let client = db.connect().await;
    if !expect_takeover {
        // Several TTLs: the refusal is logged, the standby keeps waiting.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(
            !task.is_finished(),
            "an unprivileged standby cannot preempt"
        );
        leader.signal("-CONT");
        drop(leader);
        let (l, _) = tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .unwrap()
            .unwrap();
        let l = l.unwrap();
        assert!(l.term() > old);
        return Some(l);
    }
    let (l, at) = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap();
    let l = l.unwrap();
    println!(
        "frozen leader (ttl 1 s): standby preempted it and acts after {:?}",
        at - t0
    );
    // The lease (1 s after the last renewal, which was at most renew_every
    // = 333 ms before the stop) had expired before the takeover.
    assert!(at - t0 >= Duration::from_millis(650), "{:?}", at - t0);
    assert!(l.term() > old);
    // The frozen leader's term is fenced off.
    client.batch_execute("BEGIN").await.unwrap();
    let r = client
        .query_typed(
            &format!("SELECT pgelect.fence('{role}', $1)"),
            &[(&old.get(), tokio_postgres::types::Type::INT8)],
        )
        .await;
    client.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        r.unwrap_err().code().unwrap().code(),
        pgelect::schema::SQLSTATE_STALE_TERM
    );
    // Thawed, it finds its leadership gone.
    let t1 = Instant::now();
    leader.signal("-CONT");
    let lost = leader.expect("LOST", Duration::from_secs(5));
    println!(
        "thawed old leader reported {lost:?} after {:?}",
        t1.elapsed()
    );
    Some(l)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_leader_is_preempted_by_a_superuser_standby_and_fenced() {
    let db = TestDb::new("proc_frozen").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let l = freeze_leader(&db, &db.url(), "frozen", true).await.unwrap();
    l.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprivileged_standby_logs_the_refusal_and_keeps_waiting() {
    let db = TestDb::new("proc_unpriv").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let url = db.create_role("standby", TEST_PASSWORD, false).await;
    let role = db.role_name("standby");
    let c = db.connect().await;
    c.batch_execute(&format!(
        "GRANT USAGE ON SCHEMA pgelect TO {role};
         GRANT SELECT, INSERT, UPDATE ON pgelect.leaders TO {role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON pgelect.candidates TO {role};
         GRANT SELECT ON pgelect.migrations TO {role};
         GRANT EXECUTE ON FUNCTION pgelect.lock_wait_slice(bigint, integer) TO {role};"
    ))
    .await
    .unwrap();
    let l = freeze_leader(&db, &url, "unpriv", false).await.unwrap();
    l.resign().await.unwrap();
}
