//! Session-level advisory locks ([`LockSession`]) against a real PostgreSQL.
//!
//! Every test gets its own database on the per-process test cluster (or on
//! `PGELECT_TEST_DATABASE_URL`). Waits for events are bounded; timings the
//! tests measure are printed (`cargo test -- --nocapture`).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use pgelect::{lock::LockMode, ConnectOptions, Error, LockKey, LockSession};
use pgelect_testkit::{FaultProxy, TestDb};
use tokio_postgres::Client;

use crate::support::database as setup;
use pgelect::lock::Wait;

/// `(granted, waiting)` advisory locks of backend `pid`.
async fn advisory_locks(admin: &Client, pid: i32) -> (i64, i64) {
    let row = admin
        .query_one(
            "SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted)
               FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
            &[&pid],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Polls `pg_locks` until `pid` has `want` (granted, waiting) advisory
/// locks; panics after 10 s. Used where the event happens on the server and
/// has no client-side signal (a cancel taking effect, a wait starting).
async fn await_advisory_locks(admin: &Client, pid: i32, want: (i64, i64)) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = advisory_locks(admin, pid).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid}: advisory locks (granted, waiting) = {got:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_try_fails_while_another_session_holds_the_key() {
    let (_db, options, _admin) = setup("lock_contention").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_name("contended").unwrap();

    let held = a
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .expect("free key is taken");
    assert_eq!(held.mode(), LockMode::Exclusive);
    assert!(b
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .is_none());
    assert!(b
        .acquire(key, LockMode::Shared, Wait::Never)
        .await
        .unwrap()
        .is_none());

    assert!(held.release().await.unwrap(), "postgres released the lock");
    let now_b = b
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .expect("free after release");
    assert!(a
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .is_none());
    assert_eq!(b.held(), vec![(key, LockMode::Exclusive)]);
    assert!(now_b.release().await.unwrap());
    assert!(b.held().is_empty());
}

#[tokio::test]
async fn shared_locks_coexist_and_exclude_exclusive_ones() {
    let (_db, options, _admin) = setup("lock_shared").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let c = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_pair(7, -7);

    let sa = a
        .acquire(key, LockMode::Shared, Wait::Never)
        .await
        .unwrap()
        .expect("shared on a free key");
    let sb = b
        .acquire(key, LockMode::Shared, Wait::Never)
        .await
        .unwrap()
        .expect("shared + shared");
    assert_eq!(sb.mode(), LockMode::Shared);
    assert!(
        c.acquire(key, LockMode::Exclusive, Wait::Never)
            .await
            .unwrap()
            .is_none(),
        "shared blocks exclusive"
    );
    let err = c
        .acquire(
            key,
            LockMode::Exclusive,
            Wait::AtMost(Duration::from_millis(100)),
        )
        .await
        .map(Option::unwrap)
        .unwrap_err();
    assert!(matches!(err, Error::LockTimeout { .. }), "{err}");

    assert!(sa.release().await.unwrap());
    assert!(
        c.acquire(key, LockMode::Exclusive, Wait::Never)
            .await
            .unwrap()
            .is_none(),
        "one shared holder is enough"
    );
    assert!(sb.release().await.unwrap());

    let ex = c
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .expect("exclusive once shared gone");
    assert!(
        a.acquire(key, LockMode::Shared, Wait::Never)
            .await
            .unwrap()
            .is_none(),
        "exclusive blocks shared"
    );
    assert!(ex.release().await.unwrap());
}

#[tokio::test]
async fn release_reports_what_postgres_did() {
    let (_db, options, admin) = setup("lock_release_report").await;
    let a = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(11);

    let g = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (1, 0));
    assert!(g.release().await.unwrap(), "held, so released");
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (0, 0));

    let g = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    a.unlock_all_behind_guards_for_tests().await.unwrap();
    assert!(
        !g.release().await.unwrap(),
        "not held any more, so not released"
    );
    assert!(a.held().is_empty());
}

#[tokio::test]
async fn dropping_a_guard_releases_the_lock() {
    let (_db, options, admin) = setup("lock_drop").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(12);

    // Another session, already waiting, gets the lock once the guard is gone.
    let g = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move {
            b.acquire(
                key,
                LockMode::Exclusive,
                Wait::AtMost(Duration::from_secs(10)),
            )
            .await
            .map(Option::unwrap)
        })
    };
    await_advisory_locks(&admin, b.backend_pid(), (0, 1)).await;
    drop(g);
    let got = waiter.await.unwrap().expect("granted after the drop");
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (0, 0));
    drop(got);

    // The same session may take the key again right after a drop: the
    // queued release runs before its next statement.
    let g = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    drop(g);
    let again = a
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap();
    assert!(again.is_some(), "the dropped guard's key is free again");
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (1, 0));
}

#[tokio::test]
async fn taking_a_held_key_again_is_refused() {
    let (_db, options, admin) = setup("lock_already_held").await;
    let a = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(13);

    let g = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    for result in [
        a.acquire(key, LockMode::Exclusive, Wait::Never).await,
        a.acquire(key, LockMode::Shared, Wait::Never).await,
        a.acquire(
            key,
            LockMode::Exclusive,
            Wait::AtMost(Duration::from_secs(1)),
        )
        .await
        .map(Option::unwrap)
        .map(Some),
        a.acquire(key, LockMode::Exclusive, Wait::Forever)
            .await
            .map(Option::unwrap)
            .map(Some),
    ] {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::AlreadyHeld { .. }), "{err}");
        assert!(err.to_string().contains("13"), "{err}");
    }
    // Nothing stacked on the server: one release frees the key.
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (1, 0));
    assert!(g.release().await.unwrap());
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (0, 0));
    let shared = a
        .acquire(key, LockMode::Shared, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    assert!(shared.release().await.unwrap());
}

#[tokio::test]
async fn a_bounded_wait_gives_up_after_about_the_bound() {
    let (_db, options, admin) = setup("lock_timeout").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(14);
    let held = b
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();

    let bound = Duration::from_millis(300);
    let started = Instant::now();
    let err = a
        .acquire(key, LockMode::Exclusive, Wait::AtMost(bound))
        .await
        .map(Option::unwrap)
        .unwrap_err();
    let took = started.elapsed();
    println!("lock_timeout({bound:?}) gave up after {took:?}: {err}");
    match &err {
        Error::LockTimeout { waited, .. } => assert!(*waited >= bound, "{waited:?}"),
        other => panic!("expected LockTimeout, got {other}"),
    }
    assert!(err.is_timeout());
    assert!(
        took >= bound && took < bound + Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (0, 0));
    assert!(a.held().is_empty());

    // The session's lock_timeout is back to unlimited: a plain wait outlasts
    // the old bound.
    let release_later = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        held.release().await
    });
    let started = Instant::now();
    let g = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .expect("unbounded wait after a timed-out one");
    println!(
        "unbounded wait after the timeout took {:?}",
        started.elapsed()
    );
    assert!(started.elapsed() > bound);
    assert!(release_later.await.unwrap().unwrap());
    assert!(g.release().await.unwrap());

    let zero = a
        .acquire(key, LockMode::Exclusive, Wait::AtMost(Duration::ZERO))
        .await
        .map(Option::unwrap)
        .unwrap_err();
    assert!(matches!(zero, Error::Config(_)), "{zero}");
}

#[tokio::test]
async fn a_bounded_wait_succeeds_when_released_within_the_bound() {
    let (_db, options, _admin) = setup("lock_timeout_ok").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_pair(1, 2);
    let held = b
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let release_soon = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        held.release().await
    });
    let g = a
        .acquire(key, LockMode::Shared, Wait::AtMost(Duration::from_secs(10)))
        .await
        .map(Option::unwrap)
        .expect("granted within the bound");
    assert_eq!(g.mode(), LockMode::Shared);
    assert!(release_soon.await.unwrap().unwrap());
    assert!(g.release().await.unwrap());
}

#[tokio::test]
async fn dropping_a_lock_future_cancels_the_wait_on_the_server() {
    let (_db, options, admin) = setup("lock_cancel").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(15);
    let held = b
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();

    let mut wait = Box::pin(a.acquire(key, LockMode::Exclusive, Wait::Forever));
    tokio::select! {
        r = &mut wait => panic!("the wait ended while the key was held: {r:?}"),
        _ = await_advisory_locks(&admin, a.backend_pid(), (0, 1)) => {}
    }
    drop(wait);
    // The cancel request reaches the server asynchronously.
    await_advisory_locks(&admin, a.backend_pid(), (0, 0)).await;

    // Once the holder lets go nothing is granted to the abandoned wait, and
    // the session works and can take the key.
    assert!(held.release().await.unwrap());
    let other = a
        .acquire(LockKey::from_i64(16), LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (1, 0));
    assert!(other.release().await.unwrap());
    let g = a
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .expect("free now");
    assert!(g.release().await.unwrap());
    assert!(!a.is_lost());
}

#[tokio::test]
async fn a_lock_granted_as_its_wait_is_dropped_is_released() {
    let (_db, options, admin) = setup("lock_cancel_granted").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let c = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(20);
    for _ in 0..5 {
        let held = b
            .acquire(key, LockMode::Exclusive, Wait::Forever)
            .await
            .map(Option::unwrap)
            .unwrap();
        let mut wait = Box::pin(a.acquire(key, LockMode::Exclusive, Wait::Forever));
        tokio::select! {
            r = &mut wait => panic!("the wait ended while the key was held: {r:?}"),
            _ = await_advisory_locks(&admin, a.backend_pid(), (0, 1)) => {}
        }
        // The server grants the lock to `a` now; its answer races the drop.
        assert!(held.release().await.unwrap());
        drop(wait);
        await_advisory_locks(&admin, a.backend_pid(), (0, 0)).await;
        let g = c
            .acquire(
                key,
                LockMode::Exclusive,
                Wait::AtMost(Duration::from_secs(5)),
            )
            .await
            .map(Option::unwrap)
            .unwrap();
        assert!(g.release().await.unwrap());
        assert!(a.held().is_empty());
    }
}

#[tokio::test]
async fn blocking_lock_is_granted_when_the_holder_releases() {
    let (_db, options, admin) = setup("lock_blocking").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(17);
    let held = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move {
            b.acquire(key, LockMode::Exclusive, Wait::Forever)
                .await
                .map(Option::unwrap)
        })
    };
    await_advisory_locks(&admin, b.backend_pid(), (0, 1)).await;
    let released_at = Instant::now();
    assert!(held.release().await.unwrap());
    let g = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("waiter granted")
        .unwrap()
        .unwrap();
    println!(
        "waiter granted {:?} after the release",
        released_at.elapsed()
    );
    assert_eq!(advisory_locks(&admin, b.backend_pid()).await, (1, 0));
    assert!(g.release().await.unwrap());
}

#[tokio::test]
async fn terminating_the_backend_fires_lost() {
    let (_db, options, admin) = setup("lock_terminate").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(18);
    let g = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let session_lost = a.lost();
    let token = g.token();
    assert!(!g.is_lost());

    let started = Instant::now();
    let terminated: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&a.backend_pid()])
        .await
        .unwrap()
        .get(0);
    assert!(terminated);
    tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .expect("lost() fires within 5 s of pg_terminate_backend");
    let took = started.elapsed();
    println!("lost() fired {took:?} after pg_terminate_backend");
    assert!(
        took < Duration::from_secs(1),
        "push detection, not heartbeat: {took:?}"
    );
    session_lost.await;
    assert!(token.is_cancelled() && g.is_lost() && a.is_lost());

    let err = g.release().await.unwrap_err();
    assert!(matches!(err, Error::ConnectionLost { .. }), "{err}");
    let err = a
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap_err();
    assert!(err.is_connection(), "{err}");
    let taken = b
        .acquire(
            key,
            LockMode::Exclusive,
            Wait::AtMost(Duration::from_secs(5)),
        )
        .await
        .map(Option::unwrap);
    assert!(taken.is_ok(), "the server released the lock: {taken:?}");
}

fn upstream_of(db: &TestDb) -> SocketAddr {
    let config = db.config();
    let host = match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        other => panic!("the fault proxy needs a TCP test server, got {other:?}"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    (host.as_str(), port)
        .to_socket_addrs()
        .unwrap()
        .next()
        .unwrap()
}

#[tokio::test]
async fn blackholed_connection_fires_lost_through_the_heartbeat() {
    let db = TestDb::new("lock_blackhole").await;
    let proxy = FaultProxy::start(upstream_of(&db)).unwrap();
    let mut config = tokio_postgres::Config::new();
    let base = db.config();
    config
        .host("127.0.0.1")
        .port(proxy.port())
        .user(base.get_user().unwrap())
        .dbname(db.name());
    if let Some(pw) = base.get_password() {
        config.password(pw);
    }
    let options = ConnectOptions::from_config(config);
    let heartbeat = Duration::from_millis(200);
    let heartbeat_timeout = Duration::from_millis(500);
    let a = LockSession::builder(&options)
        .heartbeat(heartbeat)
        .heartbeat_timeout(heartbeat_timeout)
        .connect()
        .await
        .unwrap();
    let g = a
        .acquire(LockKey::from_i64(19), LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();

    let started = Instant::now();
    proxy.blackhole();
    tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .expect("lost() fires within 5 s of a blackhole");
    let took = started.elapsed();
    println!(
        "lost() fired {took:?} after the blackhole (heartbeat {heartbeat:?}, timeout {heartbeat_timeout:?})"
    );
    assert!(took >= heartbeat_timeout, "{took:?}");
    assert!(
        took < Duration::from_secs(3),
        "the heartbeat noticed, not TCP (seconds later): {took:?}"
    );
    let err = g.release().await.unwrap_err();
    assert!(err.is_connection(), "{err}");
    proxy.heal();
}

#[tokio::test]
async fn one_session_holds_many_locks() {
    let (_db, options, admin) = setup("lock_many").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let keys: Vec<LockKey> = (0..150)
        .map(LockKey::from_i64)
        .chain((0..50).map(|i| LockKey::from_pair(i, i)))
        .collect();

    // Concurrent callers on one session are served one statement at a time.
    let guards = futures_util::future::join_all(
        keys.iter()
            .map(|k| a.acquire(*k, LockMode::Exclusive, Wait::Never)),
    )
    .await;
    let guards: Vec<_> = guards.into_iter().map(|g| g.unwrap().unwrap()).collect();
    assert_eq!(a.held().len(), keys.len());
    assert_eq!(
        advisory_locks(&admin, a.backend_pid()).await,
        (keys.len() as i64, 0)
    );
    for k in keys.iter().step_by(17) {
        assert!(b
            .acquire(*k, LockMode::Shared, Wait::Never)
            .await
            .unwrap()
            .is_none());
    }
    let released = futures_util::future::join_all(guards.into_iter().map(|g| g.release())).await;
    assert!(released.into_iter().all(|r| r.unwrap()));
    assert_eq!(advisory_locks(&admin, a.backend_pid()).await, (0, 0));
}

#[tokio::test]
async fn an_unbounded_wait_does_not_hold_back_vacuum() {
    let (_db, options, admin) = setup("lock_xmin").await;
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::builder(&options)
        .wait_slice(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let key = LockKey::from_pair(7, -7);
    let held = a
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move {
            b.acquire(key, LockMode::Exclusive, Wait::Forever)
                .await
                .map(Option::unwrap)
        })
    };
    await_advisory_locks(&admin, b.backend_pid(), (0, 1)).await;
    let xmin = |pid: i32| {
        let admin = &admin;
        async move {
            admin
                .query_one(
                    "SELECT backend_xmin::text::bigint FROM pg_stat_activity WHERE pid = $1",
                    &[&pid],
                )
                .await
                .unwrap()
                .get::<_, Option<i64>>(0)
        }
    };
    let first = xmin(b.backend_pid())
        .await
        .expect("a waiting statement holds a snapshot");
    let t0 = Instant::now();
    loop {
        admin.query_one("SELECT txid_current()", &[]).await.unwrap();
        if xmin(b.backend_pid()).await.is_some_and(|x| x > first) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the waiter's xmin stayed at {first}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "waiter's xmin moved on after {:?} (slice 300 ms)",
        t0.elapsed()
    );
    // Still one wait as far as the caller sees: granted when released.
    let released_at = Instant::now();
    assert!(held.release().await.unwrap());
    let g = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("waiter granted")
        .unwrap()
        .unwrap();
    println!("granted {:?} after the release", released_at.elapsed());
    assert_eq!(advisory_locks(&admin, b.backend_pid()).await, (1, 0));
    assert!(g.release().await.unwrap());
}

#[tokio::test]
async fn zero_durations_are_refused() {
    let (_db, options, _admin) = setup("lock_bad_input").await;
    // Each builder setting refused before connecting, naming itself.
    type Set = fn(pgelect::lock::LockSessionBuilder) -> pgelect::lock::LockSessionBuilder;
    let cases: [(&str, Set); 3] = [
        ("heartbeat", |b| b.heartbeat(Duration::ZERO)),
        ("heartbeat_timeout", |b| b.heartbeat_timeout(Duration::ZERO)),
        ("wait_slice", |b| b.wait_slice(Duration::ZERO)),
    ];
    for (name, set) in cases {
        let err = set(LockSession::builder(&options))
            .connect()
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Config(_)) && err.to_string().contains(name),
            "{name}: {err}"
        );
    }
    let a = LockSession::connect(&options).await.unwrap();
    let err = a
        .acquire(
            LockKey::from_i64(1),
            LockMode::Shared,
            Wait::AtMost(Duration::ZERO),
        )
        .await
        .map(Option::unwrap)
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    let err = a
        .acquire(
            LockKey::from_i64(1),
            LockMode::Exclusive,
            Wait::AtMost(Duration::from_secs(30 * 24 * 3600)),
        )
        .await
        .map(Option::unwrap)
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
}

/// The error of a lock whose connection the server ended keeps the cause:
/// its source chain reaches the driver's error and the server's `FATAL`.
#[tokio::test]
async fn a_lost_connection_keeps_the_servers_reason_as_its_source() {
    let (_db, options, admin) = setup("lock_lost_cause").await;
    let a = LockSession::connect(&options).await.unwrap();
    let g = a
        .acquire(LockKey::from_i64(19), LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&a.backend_pid()])
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), a.lost())
        .await
        .expect("lost() fires after pg_terminate_backend");

    let err = g.release().await.unwrap_err();
    println!("{err}");
    assert!(matches!(err, Error::ConnectionLost { .. }), "{err:?}");
    assert!(err.is_connection(), "{err:?}");
    let mut chain = Vec::new();
    let mut link = std::error::Error::source(&err);
    while let Some(l) = link {
        chain.push(l);
        link = l.source();
    }
    assert!(
        chain.iter().any(|l| l
            .downcast_ref::<std::sync::Arc<tokio_postgres::Error>>()
            .is_some()),
        "the driver's error is the source: {err:?}"
    );
    let server = chain
        .iter()
        .find_map(|l| l.downcast_ref::<tokio_postgres::error::DbError>())
        .expect("the server's error is in the chain");
    assert_eq!(
        server.code(),
        &tokio_postgres::error::SqlState::ADMIN_SHUTDOWN
    );
    assert_eq!(err.sqlstate(), Some("57P01"));
    // Said once, in the server's words, without the driver's "db error".
    let text = err.to_string();
    assert!(
        text.contains("FATAL: terminating connection due to administrator command"),
        "{text}"
    );
    assert!(!text.contains("db error"), "{text}");

    // The next operation says the same.
    let err = a
        .acquire(LockKey::from_i64(20), LockMode::Exclusive, Wait::Never)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ConnectionLost {
                source: Some(_),
                ..
            }
        ),
        "{err:?}"
    );
}

/// Abandoned waits are cancelled through PgBouncer, and PgBouncer stays
/// up. The driver's own cancel closes its connection right after sending
/// the request; PgBouncer 1.18 then drops the request ("client unexpected
/// eof" before forwarding it: the wait goes on) or exits ("bad client
/// state: 0"). pgelect waits for the close, as libpq does. Each round
/// cancels a wait through a PgBouncer in session mode, then checks that
/// the wait ended on the server and that PgBouncer still runs. With the
/// driver's cancel the first or second round fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waits_through_pgbouncer_leave_it_running() {
    cancelled_waits_through_pgbouncer(false, "lock_cancel_bouncer").await;
}

/// The same on a multi-host URL whose first host is the PgBouncer (the
/// second, the server itself, is never reached): one PgBouncer per data
/// node of an HA pair, named together in the URL, is the usual deployment
/// with an HA manager. The cancel goes to the host the connection reached,
/// and waits for the close there too; the driver's request (which the
/// library sent with several hosts) took a PgBouncer down in an HA test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waits_through_pgbouncer_on_a_multi_host_url_leave_it_running() {
    cancelled_waits_through_pgbouncer(true, "lock_cancel_bouncer_multi").await;
}

async fn cancelled_waits_through_pgbouncer(multi_host: bool, hint: &str) {
    use pgelect_testkit::{Cluster, PgBouncer, PoolMode};
    let (db, options, admin) = setup(hint).await;
    let cluster = tokio::task::spawn_blocking(Cluster::shared).await.unwrap();
    let bouncer = PgBouncer::start(cluster, PoolMode::Session).expect("pgbouncer starts");
    let url = if multi_host {
        let url = bouncer.url(db.name());
        let first = format!("127.0.0.1:{}/", bouncer.port());
        assert!(url.contains(&first), "{url}");
        url.replace(
            &first,
            &format!("127.0.0.1:{},127.0.0.1:{}/", bouncer.port(), cluster.port()),
        )
    } else {
        bouncer.url(db.name())
    };
    let pooled = ConnectOptions::from_url(&url).unwrap();
    let holder = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_i64(17);
    let held = holder
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let rounds = 25;
    for round in 0..rounds {
        let a = LockSession::connect(&pooled).await.unwrap_or_else(|e| {
            panic!(
                "round {round}: cannot connect through pgbouncer: {e}\n{}",
                bouncer.diagnose(20)
            )
        });
        let mut wait = Box::pin(a.acquire(key, LockMode::Exclusive, Wait::Forever));
        tokio::select! {
            r = &mut wait => panic!("the wait ended while the key was held: {r:?}"),
            _ = await_advisory_locks(&admin, a.backend_pid(), (0, 1)) => {}
        }
        drop(wait);
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            while advisory_locks(&admin, a.backend_pid()).await != (0, 0) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            ended.is_ok(),
            "round {round}: the cancelled wait still waits on the server; {}",
            bouncer.diagnose(20)
        );
        assert!(
            bouncer.diagnose(0).contains(": running"),
            "round {round}: {}",
            bouncer.diagnose(20)
        );
        assert!(
            !a.is_lost(),
            "round {round}: the session survives its cancel"
        );
    }
    assert!(held.release().await.unwrap());
    println!(
        "{rounds} waits cancelled through pgbouncer; {}",
        bouncer.diagnose(0)
    );
}
