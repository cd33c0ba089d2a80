//! Squatted keys are visible: another database user with CONNECT only takes
//! a role's, a lock's or the migration's advisory key with
//! `pg_advisory_lock` on its own connection, and pgelect says who holds it
//! (pid, user, application name) instead of waiting without a word.
//!
//! Warnings are read from a tracing capture installed per test (each test
//! runs on its own current-thread runtime, so the capture sees only its own
//! tasks).

use std::time::{Duration, Instant};

use pgelect::conn::TcpTimeouts;
use pgelect::election::{SharedConnection, StandbyMode};
use pgelect::{ConnectOptions, Error, LockKey, LockSession};
use pgelect_testkit::TestDb;
use tokio_postgres::{Client, NoTls};

use crate::support;
use pgelect::lock::{LockMode, Wait};
use support::{fast_session as fast, migrated, Log};

/// A login role with CONNECT only, connected on its own: the squatter.
/// Returns its client, its backend pid and its role name.
async fn squatter(db: &TestDb, app: &str) -> (Client, i32, String) {
    let url = db.create_role("squatter", "squat-pw", false).await;
    let mut config: tokio_postgres::Config = url.parse().unwrap();
    config.application_name(app);
    let (client, connection) = config.connect(NoTls).await.expect("squatter connects");
    tokio::spawn(connection);
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    (client, pid, db.role_name("squatter"))
}

async fn take(client: &Client, key: LockKey) {
    let LockKey::Single(k) = key else {
        panic!("single keys only here")
    };
    client
        .execute("SELECT pg_advisory_lock($1)", &[&k])
        .await
        .expect("the squatter takes the key");
}

async fn let_go(client: &Client, key: LockKey) {
    let LockKey::Single(k) = key else {
        panic!("single keys only here")
    };
    let row = client
        .query_one("SELECT pg_advisory_unlock($1)", &[&k])
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0), "the squatter held the key");
}

async fn standby_warns_about_a_squatter(mode: StandbyMode, hint: &str) {
    let log = Log::default();
    let _capture = log.capture(tracing::Level::WARN);
    let (db, o) = migrated(hint).await;
    let elector = fast(&o, "squatted", "node-a")
        .session(|s| s.standby(mode).wait_slice(Duration::from_millis(500)))
        .build()
        .unwrap();
    let (sq, pid, user) = squatter(&db, "psql").await;
    let key = elector.lock_key();
    take(&sq, key).await;

    let started = Instant::now();
    let standing = tokio::spawn(async move {
        let l = elector
            .leadership()
            .await
            .expect("elected once the squatter lets go");
        (elector, l)
    });
    let line = log
        .wait_for_line(
            &[
                "WARN",
                &format!("pid {pid} "),
                &format!("{user:?}"),
                "\"psql\"",
                "not the leader the lease row names",
            ],
            // Polling standbys look every 10 s; a fresh holder is named at
            // the second look.
            Duration::from_secs(30),
        )
        .await;
    let seen_after = started.elapsed();
    println!("warned after {seen_after:?}: {line}");
    assert!(
        line.contains("role \"squatted\""),
        "the line names the role: {line}"
    );

    // Once per squatting pid, not every check: let more checks pass (a
    // blocking standby looks after every 500 ms slice, a polling one every
    // 10 s), then count.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let count = log
        .text()
        .lines()
        .filter(|l| l.contains(&format!("pid {pid} ")) && l.contains("not the leader"))
        .count();
    assert_eq!(count, 1, "one warning per squatter:\n{}", log.text());
    assert!(
        !standing.is_finished(),
        "the standby waits while the key is held"
    );

    let_go(&sq, key).await;
    let (_elector, leadership) = tokio::time::timeout(Duration::from_secs(20), standing)
        .await
        .expect("elected after the squatter let go")
        .unwrap();
    assert_eq!(leadership.term().get(), 1);
}

#[tokio::test]
async fn a_blocking_standby_warns_once_with_the_squatters_pid_user_and_application() {
    standby_warns_about_a_squatter(StandbyMode::Blocking, "squat_blocking").await;
}

#[tokio::test]
async fn a_polling_standby_warns_once_with_the_squatters_pid_user_and_application() {
    standby_warns_about_a_squatter(
        StandbyMode::Polling {
            interval: Duration::from_millis(200),
        },
        "squat_polling",
    )
    .await;
}

#[tokio::test]
async fn a_standby_behind_a_live_pgelect_leader_does_not_warn() {
    let log = Log::default();
    let _capture = log.capture(tracing::Level::WARN);
    let (_db, o) = migrated("squat_none").await;
    let a = fast(&o, "busy", "node-a").build().unwrap();
    let leader = a.leadership().await.unwrap();
    let b = fast(&o, "busy", "node-b")
        .session(|s| s.wait_slice(Duration::from_millis(500)))
        .build()
        .unwrap();
    let c = fast(&o, "busy", "node-c")
        .session(|s| {
            s.standby(StandbyMode::Polling {
                interval: Duration::from_millis(200),
            })
        })
        .build()
        .unwrap();
    let standing_b = tokio::spawn(async move { b.leadership().await.map(|l| (b, l)) });
    let standing_c = tokio::spawn(async move { c.leadership().await.map(|l| (c, l)) });
    // Many slices and polls, two lookups of the polling standby (every
    // 10 s), more than the grace three times over.
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(!leader.is_lost());
    assert!(!standing_b.is_finished() && !standing_c.is_finished());
    let text = log.text();
    assert!(
        !text.contains("not the leader the lease row names"),
        "a live leader was taken for a squatter:\n{text}"
    );
    standing_b.abort();
    standing_c.abort();
}

#[tokio::test]
async fn migrate_fails_within_its_bound_naming_whoever_holds_the_migration_lock() {
    let db = TestDb::new("squat_migrate").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    let (sq, pid, user) = squatter(&db, "migration-squatter").await;
    let key = LockKey::from_name("pgelect.migrate.pgelect").unwrap();
    take(&sq, key).await;

    let bound = Duration::from_secs(1);
    let started = Instant::now();
    let err = pgelect::schema::migrate_timeout(&o, bound)
        .await
        .expect_err("the migration lock is held");
    let took = started.elapsed();
    println!("failed after {took:?}: {err}");
    assert!(
        took >= bound && took < bound + Duration::from_secs(5),
        "{took:?}"
    );
    assert!(err.is_timeout(), "{err:?}");
    match &err {
        Error::MigrationLockTimeout { holders, .. } => {
            assert_eq!(holders.len(), 1, "{holders:?}");
            assert_eq!(holders[0].pid, pid);
            assert_eq!(holders[0].user.as_deref(), Some(user.as_str()));
            assert_eq!(holders[0].application_name, "migration-squatter");
        }
        other => panic!("expected MigrationLockTimeout, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains(&format!("pid {pid} ")) && text.contains("pg_terminate_backend"),
        "{text}"
    );
    assert!(text.contains("1.0s"), "a rounded duration: {text}");

    // Once it lets go, migrate works.
    let_go(&sq, key).await;
    assert!(pgelect::schema::migrate_timeout(&o, bound).await.unwrap() > 0);
}

#[tokio::test]
async fn a_lock_session_wait_names_the_holder_in_its_timeout_and_its_log() {
    let log = Log::default();
    let _capture = log.capture(tracing::Level::WARN);
    let db = TestDb::new("squat_lock").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    let (sq, pid, user) = squatter(&db, "lock-squatter").await;
    let key = LockKey::from_name("nightly").unwrap();
    take(&sq, key).await;
    let session = LockSession::connect(&o).await.unwrap();

    // try: the session says who holds it.
    assert!(session
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .is_none());
    let holders = session.holders(key).await.unwrap();
    assert_eq!(holders.iter().map(|h| h.pid).collect::<Vec<_>>(), [pid]);
    assert_eq!(holders[0].claims_pgelect_candidate(), None);

    // A bounded wait: the error names the holder, with a rounded duration.
    let err = session
        .acquire(
            key,
            LockMode::Exclusive,
            Wait::AtMost(Duration::from_millis(300)),
        )
        .await
        .map(Option::unwrap)
        .expect_err("held");
    let text = err.to_string();
    println!("{text}");
    match &err {
        Error::LockTimeout { holders, .. } => {
            assert_eq!(holders.len(), 1);
            assert_eq!(holders[0].pid, pid);
            assert_eq!(holders[0].user.as_deref(), Some(user.as_str()));
        }
        other => panic!("expected LockTimeout, got {other:?}"),
    }
    // Rounded to the millisecond, not "0.301234567s".
    assert!(
        text.starts_with("timed out after 3") && text.contains("ms waiting"),
        "{text}"
    );
    assert!(text.contains("\"lock-squatter\""), "{text}");

    // An unbounded wait logs the holder after a few seconds, then is
    // granted when the squatter lets go.
    let waiting = {
        let session = session.clone();
        tokio::spawn(async move {
            session
                .acquire(key, LockMode::Exclusive, Wait::Forever)
                .await
                .map(Option::unwrap)
        })
    };
    let line = log
        .wait_for_line(
            &[
                "WARN",
                "still waiting for a lock",
                &format!("pid {pid} "),
                "\"lock-squatter\"",
            ],
            Duration::from_secs(20),
        )
        .await;
    println!("{line}");
    let_go(&sq, key).await;
    let guard = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("granted after the squatter let go")
        .unwrap()
        .unwrap();
    assert!(guard.release().await.unwrap());
}

/// A session of the candidates' own database user that holds the role's
/// key without a lease naming it: to the server, exactly a candidate frozen
/// (SIGSTOP, a VM pause) between the grant of the lock and its term
/// transaction, which no row names and which zombie preemption used to
/// miss. Returns its client and pid.
async fn frozen_candidate(db: &TestDb, key: LockKey) -> (Client, i32) {
    let client = db.connect().await;
    client
        .batch_execute("SET application_name = 'pgelect:lock:frozen:node-z'")
        .await
        .unwrap();
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    take(&client, key).await;
    (client, pid)
}

/// The frozen holder is ended within the TTL (its session idle that long)
/// plus a check, and the standby leads.
async fn standby_preempts_a_frozen_candidate(mode: StandbyMode, hint: &str) {
    standby_on_preempts_a_frozen_candidate(mode, false, hint).await;
}

/// [`standby_preempts_a_frozen_candidate`], the standby on a connection of
/// its own or (`shared`) on a [`SharedConnection`], whose batched poll
/// runs the preemption for all its vacant roles in one statement.
async fn standby_on_preempts_a_frozen_candidate(mode: StandbyMode, shared: bool, hint: &str) {
    let log = Log::default();
    let _capture = log.capture(tracing::Level::WARN);
    let (db, o) = migrated(hint).await;
    let host = shared.then(|| SharedConnection::new(&o, TcpTimeouts::default()));
    let elector = fast(&o, "frozen", "node-a")
        .session(|s| {
            let s = s.standby(mode);
            match &host {
                Some(host) => s.shared_connection(host),
                None => s,
            }
        })
        .build()
        .unwrap();
    let ttl = Duration::from_secs(2);
    let (frozen, pid) = frozen_candidate(&db, elector.lock_key()).await;
    let started = Instant::now();
    let leadership = tokio::time::timeout(ttl + Duration::from_secs(20), elector.leadership())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the frozen holder (pid {pid}) still blocks the role:\n{}",
                log.text()
            )
        })
        .expect("elected");
    let took = started.elapsed();
    println!("led {took:?} after the frozen holder took the key (ttl {ttl:?})");
    assert_eq!(leadership.term().get(), 1);
    // Not before the holder was idle for a TTL: a live candidate gets that
    // long to run its term transaction.
    assert!(took >= ttl, "preempted after {took:?}, before a TTL");
    assert!(
        frozen.query_one("SELECT 1", &[]).await.is_err(),
        "the frozen holder's session was ended"
    );
    log.wait_for_line(
        &[
            "WARN",
            &format!("pid={pid}"),
            "held the role's lock for a TTL without taking the lease",
        ],
        Duration::from_secs(5),
    )
    .await;
}

#[tokio::test]
async fn a_blocking_standby_preempts_a_candidate_frozen_before_its_term() {
    standby_preempts_a_frozen_candidate(StandbyMode::Blocking, "frozen_blocking").await;
}

#[tokio::test]
async fn a_polling_standby_preempts_a_candidate_frozen_before_its_term() {
    standby_preempts_a_frozen_candidate(
        StandbyMode::Polling {
            interval: Duration::from_millis(200),
        },
        "frozen_polling",
    )
    .await;
}

#[tokio::test]
async fn a_standby_on_a_shared_connection_preempts_a_candidate_frozen_before_its_term() {
    standby_on_preempts_a_frozen_candidate(
        StandbyMode::Polling {
            interval: Duration::from_millis(200),
        },
        true,
        "frozen_shared",
    )
    .await;
}

/// The case the model found: the leader's connection ends, the lock goes
/// to a candidate that freezes before its term, and the row still names
/// the old leader (whose pid no longer holds anything) until its lease
/// expires. The standby behind them leads with the next term.
#[tokio::test]
async fn after_a_lost_leader_a_candidate_frozen_before_its_term_is_preempted() {
    let log = Log::default();
    let _capture = log.capture(tracing::Level::WARN);
    let (db, o) = migrated("frozen_after_leader").await;
    let a = fast(&o, "frozen2", "node-a").build().unwrap();
    let first = a.leadership().await.unwrap();
    let key = a.lock_key();
    let admin = db.connect().await;
    let old_pid: i32 = admin
        .query_one(
            "SELECT holder_pid FROM pgelect.leaders WHERE role = 'frozen2'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // The frozen candidate queues for the key first, then the standby.
    let frozen = db.connect().await;
    let frozen_pid: i32 = frozen
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let LockKey::Single(k) = key else {
        panic!("single keys only here")
    };
    let waiting = tokio::spawn(async move {
        frozen
            .execute("SELECT pg_advisory_lock($1)", &[&k])
            .await
            .map(|_| frozen)
    });
    support_wait_waiting(&admin, frozen_pid).await;
    let b = fast(&o, "frozen2", "node-b").build().unwrap();
    let standing = tokio::spawn(async move { b.leadership().await.map(|l| (b, l)) });
    // The leader's connection ends: the lock goes to the first waiter.
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&old_pid])
        .await
        .unwrap();
    let frozen = waiting
        .await
        .unwrap()
        .expect("the frozen candidate got the key");
    tokio::time::timeout(Duration::from_secs(5), first.lost())
        .await
        .expect("the old leader learns it lost");
    let started = Instant::now();
    let (_b, second) = tokio::time::timeout(Duration::from_secs(25), standing)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the frozen holder (pid {frozen_pid}) still blocks the role:\n{}",
                log.text()
            )
        })
        .unwrap()
        .expect("elected");
    println!(
        "node-b led term {} {:?} after the frozen candidate took the key",
        second.term(),
        started.elapsed()
    );
    assert_eq!(second.term().get(), 2);
    assert!(frozen.query_one("SELECT 1", &[]).await.is_err());
}

/// Waits until `pid` waits for a lock.
async fn support_wait_waiting(admin: &Client, pid: i32) {
    let t0 = Instant::now();
    loop {
        let n: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted",
                &[&pid],
            )
            .await
            .unwrap()
            .get(0);
        if n > 0 {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "pid {pid} never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
