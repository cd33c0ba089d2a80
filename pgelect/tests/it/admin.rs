//! `pgelect::admin` against a real server: what an operator's tool reads
//! (leaders, terms, candidates, squatters, held locks), forgetting a role,
//! resign requests, and the errors of bad input.
//!
//! States that no event announces (a standby queued on the lock, a lock
//! taken on another connection) are awaited by reading the status in a
//! bounded loop.

use std::time::{Duration, Instant, SystemTime};

use pgelect::admin::{AdminClient, CandidateState, ForgetOutcome, HeldLockKind, RoleStatus};
use pgelect::lock::{LockMode, Semaphore, Wait};
use pgelect::{Error, LockKey, LockSession};
use pgelect_testkit::TestDb;
use tokio_postgres::{Client, NoTls};

use crate::support::{fast_session as fast, migrated};

const WITHIN: Duration = Duration::from_secs(15);

/// Reads `role` until `done` says so (bounded); the last status read.
async fn role_until(
    admin: &AdminClient,
    role: &str,
    done: impl Fn(&RoleStatus) -> bool,
) -> RoleStatus {
    let started = Instant::now();
    loop {
        let status = admin.role(role).await.expect("status of the role");
        if done(&status) {
            return status;
        }
        assert!(
            started.elapsed() < WITHIN,
            "not seen within {WITHIN:?}: {status:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A login role with CONNECT only, connected on its own.
async fn stranger(db: &TestDb, name: &str) -> (Client, i32, String) {
    let url = db.create_role(name, "stranger-pw", false).await;
    let mut config: tokio_postgres::Config = url.parse().unwrap();
    config.application_name("psql");
    let (client, connection) = config.connect(NoTls).await.expect("connects");
    tokio::spawn(connection);
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    (client, pid, db.role_name(name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_leader_its_term_a_waiting_standby_and_a_squatter() {
    let (db, o) = migrated("admin_status").await;
    let a = fast(&o, "jobs", "node-a").build().unwrap();
    let leading = a.leadership().await.unwrap();
    let b = fast(&o, "jobs", "node-b").build().unwrap();
    let standby = tokio::spawn(async move { (b.leadership().await, b) });

    // A role led once and released, whose key a stranger then takes.
    let c = fast(&o, "squatted", "node-c").build().unwrap();
    let led = c.leadership().await.unwrap();
    let squatted_term = led.term();
    led.resign().await.unwrap();
    let (sq, sq_pid, sq_user) = stranger(&db, "mallory").await;
    let LockKey::Single(k) = c.lock_key() else {
        panic!("a role's key is a single bigint")
    };
    sq.execute("SELECT pg_advisory_lock($1)", &[&k])
        .await
        .unwrap();

    let admin = AdminClient::connect(&o).await.unwrap();
    let before = SystemTime::now();
    let jobs = role_until(&admin, "jobs", |r| {
        r.candidates
            .iter()
            .any(|c| c.node == "node-b" && c.state == CandidateState::Waiting)
    })
    .await;
    println!("{jobs:#?}");
    assert_eq!(jobs.holder.as_deref(), Some("node-a"));
    assert_eq!(jobs.term, leading.term());
    assert_eq!(jobs.backend.as_deref(), Some("session"));
    assert_eq!(jobs.lease_expired(), Some(false));
    let left = jobs.lease_remaining_ms.expect("a live lease");
    assert!(left > 0 && left <= 2500, "lease left {left} ms with ttl 2s");
    let since = jobs.acquired_at.expect("acquired_at");
    let until = jobs.lease_until.expect("lease_until");
    assert!(since < until, "{since:?} < {until:?}");
    // The server's clock and this one agree here to well within a minute.
    let skew = |t: SystemTime| {
        t.duration_since(before)
            .or_else(|e| Ok::<_, ()>(e.duration()))
            .unwrap()
    };
    assert!(skew(since) < Duration::from_secs(60), "{since:?}");
    let holder = &jobs.candidates[0];
    assert_eq!(
        (holder.node.as_str(), holder.state),
        ("node-a", CandidateState::Holding)
    );
    assert!(holder.backend_pid.is_some_and(|p| p > 0), "{holder:?}");
    assert!(holder.timing.is_some(), "registered with its timing");
    assert!(jobs.squatters.is_empty(), "{:?}", jobs.squatters);

    let status = admin.status().await.unwrap();
    let names: Vec<&str> = status.roles.iter().map(|r| r.role.as_str()).collect();
    assert_eq!(names, ["jobs", "squatted"]);
    let squatted = &status.roles[1];
    assert_eq!(squatted.holder, None);
    assert_eq!(squatted.term, squatted_term);
    assert_eq!(squatted.lease_remaining_ms, None);
    let [q] = &squatted.squatters[..] else {
        panic!("one squatter: {:?}", squatted.squatters)
    };
    assert_eq!(q.pid, sq_pid);
    assert_eq!(q.user.as_deref(), Some(sq_user.as_str()));
    assert_eq!(q.application_name, "psql");
    assert_eq!(q.mode, LockMode::Exclusive);
    assert_eq!(status.server.kind(), "primary");
    assert!(status.server.timeline.is_some_and(|t| t >= 1));

    drop(sq);
    leading.resign().await.unwrap();
    let (next, b) = standby.await.unwrap();
    next.unwrap().resign().await.unwrap();
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_locks_list_the_locks_and_permits_of_other_sessions() {
    let (_db, o) = migrated("admin_locks").await;
    let named = LockSession::builder(&o)
        .name(pgelect::admin::lock_session_name("deploy", "node-c"))
        .connect()
        .await
        .unwrap();
    let deploy = LockKey::from_name("deploy").unwrap();
    let guard = named
        .acquire(deploy, LockMode::Exclusive, Wait::Forever)
        .await
        .unwrap()
        .expect("granted");
    let uploads = Semaphore::new("uploads", 2).unwrap();
    let permits = LockSession::builder(&o)
        .name(pgelect::admin::lock_session_name("uploads", "node-d"))
        .connect()
        .await
        .unwrap();
    let permit = permits
        .acquire_permit(&uploads, Wait::Forever)
        .await
        .unwrap()
        .expect("granted");
    let plain = LockSession::connect(&o).await.unwrap();
    let plain_guard = plain
        .acquire(LockKey::from_i64(42), LockMode::Exclusive, Wait::Forever)
        .await
        .unwrap()
        .expect("granted");

    let admin = AdminClient::connect(&o).await.unwrap();
    let locks = admin.held_locks().await.unwrap();
    println!("{locks:#?}");
    let l = locks
        .iter()
        .find(|l| l.key == deploy)
        .expect("the deploy lock is listed");
    assert_eq!(l.name.as_deref(), Some("deploy"));
    assert_eq!(l.node.as_deref(), Some("node-c"));
    assert_eq!(l.kind, HeldLockKind::Lock);
    assert_eq!(l.mode, LockMode::Exclusive);
    assert!(l.granted && l.backend_pid > 0, "{l:?}");
    assert!(l.since.is_some(), "an idle holder has a since: {l:?}");
    let slot = permit.slot();
    assert!(
        locks.iter().any(|l| l.name.as_deref() == Some("uploads")
            && l.kind == HeldLockKind::Permit(slot)
            && l.granted),
        "permit {slot} of uploads: {locks:#?}"
    );
    let p = locks
        .iter()
        .find(|l| l.key == LockKey::from_i64(42))
        .expect("the default-named session's lock");
    assert_eq!((p.name.as_deref(), p.kind), (None, HeldLockKind::Other));

    let holders = pgelect::admin::lock_holders(admin.client(), deploy)
        .await
        .unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert_eq!(holders[0].pid, l.backend_pid);
    assert_eq!(holders[0].claims_lock_session(), Some(("deploy", "node-c")));
    let by_slot = pgelect::admin::semaphore_holders(admin.client(), &uploads)
        .await
        .unwrap();
    assert_eq!(
        by_slot.iter().map(|p| p.slot).collect::<Vec<_>>(),
        [slot],
        "{by_slot:?}"
    );

    guard.release().await.unwrap();
    permit.release().await.unwrap();
    plain_guard.release().await.unwrap();
    let locks = admin.held_locks().await.unwrap();
    assert!(
        locks.iter().all(|l| l.key != deploy),
        "released: {locks:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_refuses_a_led_role_and_forgets_a_released_one_keeping_its_term() {
    let (_db, o) = migrated("admin_forget").await;
    let mut admin = AdminClient::connect(&o).await.unwrap();
    let a = fast(&o, "old", "node-a").build().unwrap();
    let leading = a.leadership().await.unwrap();
    let term = leading.term();
    match admin.forget("old").await.unwrap() {
        ForgetOutcome::Led {
            holder,
            term: t,
            lease_until,
        } => {
            assert_eq!((holder.as_str(), t), ("node-a", term));
            assert!(lease_until.is_some());
        }
        other => panic!("a led role was not refused: {other:?}"),
    }
    assert!(!leading.is_lost(), "forget left the leader alone");
    leading.resign().await.unwrap();
    drop(a);
    // Its connection ends in the background: until then it still stands.
    role_until(&admin, "old", |r| r.candidates.is_empty()).await;

    assert_eq!(
        admin.forget("old").await.unwrap(),
        ForgetOutcome::Forgotten { last_term: term }
    );
    assert!(admin.roles().await.unwrap().is_empty(), "no longer listed");
    let e = admin.role("old").await.unwrap_err();
    assert!(e.is_unknown_role(), "{e:?}");
    let e = admin.forget("old").await.unwrap_err();
    assert!(e.is_unknown_role(), "forgotten twice: {e:?}");
    assert_eq!(admin.lease_row("old").await.unwrap(), None);

    // Terms never repeat: the next leader continues above the kept one.
    let b = fast(&o, "old", "node-b").build().unwrap();
    let again = b.leadership().await.unwrap();
    assert!(again.term() > term, "{} after {term}", again.term());
    assert_eq!(admin.role("old").await.unwrap().term, again.term());
    again.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_resign_moves_leadership_to_the_standby_and_wakes_the_watcher() {
    let (_db, o) = migrated("admin_resign").await;
    let a = fast(&o, "r", "node-a").build().unwrap();
    let leading = a.leadership().await.unwrap();
    let b = fast(&o, "r", "node-b").build().unwrap();
    let standby = tokio::spawn(async move { (b.leadership().await, b) });
    let mut admin = AdminClient::connect(&o).await.unwrap();
    role_until(&admin, "r", |r| r.candidates.len() == 2).await;

    let asked = admin
        .request_resign("r")
        .await
        .unwrap()
        .expect("a leader to ask");
    assert_eq!(
        (asked.holder.as_str(), asked.term),
        ("node-a", leading.term())
    );
    tokio::time::timeout(WITHIN, leading.lost())
        .await
        .expect("the leader steps down");
    leading.resign().await.unwrap();
    let (next, b) = tokio::time::timeout(WITHIN, standby)
        .await
        .expect("the standby takes over")
        .unwrap();
    let next = next.unwrap();
    assert!(next.term() > asked.term);
    // The change was announced: the watcher wakes (at once, since it came
    // after connect).
    tokio::time::timeout(WITHIN, admin.changed())
        .await
        .expect("a change of leader is announced")
        .unwrap();
    let row = admin.lease_row("r").await.unwrap().expect("a row");
    assert_eq!(
        (row.term, row.holder.as_deref()),
        (next.term(), Some("node-b"))
    );
    let leader = admin.leader("r").await.unwrap().expect("a leader");
    assert_eq!(leader.holder, "node-b");
    next.resign().await.unwrap();
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_errors_that_say_what_is_wrong() {
    let (db, o) = migrated("admin_bad_input").await;
    let mut admin = AdminClient::connect(&o).await.unwrap();
    let e = admin.role("nope").await.unwrap_err();
    assert!(e.is_unknown_role(), "{e:?}");
    assert!(
        e.to_string()
            .contains("no role \"nope\" in schema pgelect: nobody leads, stands for or has led it; there are no roles yet"),
        "{e}"
    );
    let a = fast(&o, "jobs", "node-a").build().unwrap();
    let l = a.leadership().await.unwrap();
    let e = admin.forget("nope").await.unwrap_err();
    assert!(e.to_string().contains("known roles: \"jobs\""), "{e}");
    l.resign().await.unwrap();

    for e in [
        admin.role("a\0b").await.unwrap_err(),
        admin.forget("a\0b").await.unwrap_err(),
        admin.request_resign("a\0b").await.unwrap_err(),
        admin.lease_row("a\0b").await.unwrap_err(),
        pgelect::admin::request_resign(&o, "a\0b")
            .await
            .unwrap_err(),
        pgelect::admin::current_leader(&o, "").await.unwrap_err(),
    ] {
        assert!(matches!(e, Error::InvalidName { .. }), "{e:?}");
    }

    // No schema: say to migrate.
    let bare = TestDb::new("admin_no_schema").await;
    let no_schema = AdminClient::connect(&crate::support::db_options(&bare))
        .await
        .unwrap();
    let e = no_schema.status().await.unwrap_err();
    assert!(
        e.is_schema() && e.to_string().contains("pgelect migrate"),
        "{e:?}"
    );

    // No grant: a permission error that names the grants.
    let url = db.create_role("nobody", "nobody-pw", false).await;
    let nobody = pgelect::ConnectOptions::from_url(&url).unwrap();
    let nobody = AdminClient::connect(&nobody).await.unwrap();
    let e = nobody.roles().await.unwrap_err();
    assert!(e.is_permission(), "{e:?}");
    assert!(e.to_string().contains("privileges"), "{e}");
    let e = nobody.request_resign("jobs").await.unwrap_err();
    assert!(
        e.is_permission() && e.to_string().contains("request_resign"),
        "{e}"
    );
}
