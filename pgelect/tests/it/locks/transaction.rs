//! Transaction-level advisory locks on the caller's transaction, through
//! tokio-postgres and (feature `sqlx`) sqlx, against a real PostgreSQL.

use std::time::{Duration, Instant};

use pgelect::{
    lock::try_xact_lock, lock::try_xact_lock_shared, lock::xact_lock, lock::xact_lock_shared,
    lock::xact_lock_shared_timeout, lock::xact_lock_timeout, Error, LockKey,
};
use pgelect_testkit::TestDb;
use tokio_postgres::{Client, GenericClient};

async fn lock_timeout_of<C: GenericClient>(client: &C) -> String {
    client
        .query_typed_one("SELECT current_setting('lock_timeout')", &[])
        .await
        .unwrap()
        .get(0)
}

/// Number of backends waiting for an advisory lock in this database.
async fn advisory_waiters(admin: &Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks
              WHERE locktype = 'advisory' AND NOT granted
                AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

async fn await_advisory_waiters(admin: &Client, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while advisory_waiters(admin).await != want {
        assert!(
            Instant::now() < deadline,
            "never saw {want} advisory waiter(s)"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn try_xact_lock_contends_and_ends_with_the_transaction() {
    let db = TestDb::new("xact_try").await;
    let mut c1 = db.connect().await;
    let mut c2 = db.connect().await;
    let key = LockKey::from_name("xact-try").unwrap();

    let t1 = c1.transaction().await.unwrap();
    assert!(try_xact_lock(&t1, key).await.unwrap());
    {
        let t2 = c2.transaction().await.unwrap();
        assert!(!try_xact_lock(&t2, key).await.unwrap());
        assert!(!try_xact_lock_shared(&t2, key).await.unwrap());
        t2.rollback().await.unwrap();
    }
    t1.commit().await.unwrap();

    // Released at commit; now hold it and release it by rollback.
    let t2 = c2.transaction().await.unwrap();
    assert!(try_xact_lock(&t2, key).await.unwrap());
    let t1 = c1.transaction().await.unwrap();
    assert!(!try_xact_lock(&t1, key).await.unwrap());
    t2.rollback().await.unwrap();
    assert!(try_xact_lock(&t1, key).await.unwrap());
    t1.commit().await.unwrap();
}

#[tokio::test]
async fn shared_xact_locks_coexist_and_exclude_exclusive_ones() {
    let db = TestDb::new("xact_shared").await;
    let mut c1 = db.connect().await;
    let mut c2 = db.connect().await;
    let mut c3 = db.connect().await;
    let key = LockKey::from_pair(3, 4);

    let t1 = c1.transaction().await.unwrap();
    let t2 = c2.transaction().await.unwrap();
    xact_lock_shared(&t1, key).await.unwrap();
    assert!(try_xact_lock_shared(&t2, key).await.unwrap());
    let t3 = c3.transaction().await.unwrap();
    assert!(!try_xact_lock(&t3, key).await.unwrap());
    t1.commit().await.unwrap();
    assert!(!try_xact_lock(&t3, key).await.unwrap());
    t2.commit().await.unwrap();
    assert!(try_xact_lock(&t3, key).await.unwrap());
    let t1 = c1.transaction().await.unwrap();
    assert!(!try_xact_lock_shared(&t1, key).await.unwrap());
    t3.commit().await.unwrap();
    t1.commit().await.unwrap();
}

/// A bounded wait tries first (one short statement when the lock is free);
/// that try must not overtake a conflicting request already waiting: a
/// shared request behind a waiting exclusive one waits its turn.
#[tokio::test]
async fn a_bounded_wait_does_not_overtake_a_waiting_request() {
    let db = TestDb::new("xact_queue").await;
    let admin = db.connect().await;
    let mut c1 = db.connect().await;
    let c2 = db.connect().await;
    let mut c3 = db.connect().await;
    let key = LockKey::from_i64(33);

    let t1 = c1.transaction().await.unwrap();
    xact_lock_shared(&t1, key).await.unwrap();
    let writer = tokio::spawn(async move {
        c2.batch_execute("BEGIN").await.unwrap();
        xact_lock(&c2, key).await.unwrap();
        c2.batch_execute("COMMIT").await.unwrap();
    });
    await_advisory_waiters(&admin, 1).await;
    // Free for a shared request if only the holder counted; not while the
    // exclusive request waits.
    let t3 = c3.transaction().await.unwrap();
    let started = Instant::now();
    let err = xact_lock_shared_timeout(&t3, key, Duration::from_millis(300))
        .await
        .expect_err("a shared request queued behind a waiting exclusive one");
    assert!(err.is_timeout(), "{err}");
    println!(
        "queued shared request timed out after {:?}",
        started.elapsed()
    );
    t3.rollback().await.unwrap();
    t1.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("the exclusive waiter is granted after the holder commits")
        .unwrap();
    // Uncontended, the same call succeeds at once.
    let t3 = c3.transaction().await.unwrap();
    xact_lock_shared_timeout(&t3, key, Duration::from_millis(300))
        .await
        .unwrap();
    t3.commit().await.unwrap();
}

#[tokio::test]
async fn blocking_xact_lock_waits_for_the_holders_commit() {
    let db = TestDb::new("xact_blocking").await;
    let admin = db.connect().await;
    let mut c1 = db.connect().await;
    let c2 = db.connect().await;
    let key = LockKey::from_i64(21);

    let t1 = c1.transaction().await.unwrap();
    xact_lock(&t1, key).await.unwrap();
    // A plain Client inside an explicit BEGIN works as well.
    let waiter = tokio::spawn(async move {
        c2.batch_execute("BEGIN").await.unwrap();
        let r = xact_lock(&c2, key).await;
        c2.batch_execute("COMMIT").await.unwrap();
        r
    });
    await_advisory_waiters(&admin, 1).await;
    assert!(!waiter.is_finished());
    t1.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("waiter granted after the commit")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn bounded_xact_wait_times_out_with_a_typed_error() {
    let db = TestDb::new("xact_timeout").await;
    let mut c1 = db.connect().await;
    let mut c2 = db.connect().await;
    let key = LockKey::from_i64(22);
    let t1 = c1.transaction().await.unwrap();
    xact_lock(&t1, key).await.unwrap();

    for shared in [false, true] {
        let t2 = c2.transaction().await.unwrap();
        let bound = Duration::from_millis(300);
        let started = Instant::now();
        let err = if shared {
            xact_lock_shared_timeout(&t2, key, bound).await
        } else {
            xact_lock_timeout(&t2, key, bound).await
        }
        .unwrap_err();
        let took = started.elapsed();
        println!(
            "xact_lock{}_timeout({bound:?}) gave up after {took:?}: {err}",
            if shared { "_shared" } else { "" }
        );
        assert!(matches!(err, Error::LockTimeout { .. }), "{err}");
        assert!(
            took >= bound && took < bound + Duration::from_secs(2),
            "{took:?}"
        );
        t2.rollback().await.unwrap();
    }
    // After the rollback the connection's own setting is untouched.
    assert_eq!(lock_timeout_of(&c2).await, "0");

    let t2 = c2.transaction().await.unwrap();
    let err = xact_lock_timeout(&t2, key, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    t2.rollback().await.unwrap();
    t1.commit().await.unwrap();
}

#[tokio::test]
async fn bounded_xact_wait_keeps_a_stricter_caller_timeout() {
    let db = TestDb::new("xact_stricter").await;
    let mut c1 = db.connect().await;
    let mut c2 = db.connect().await;
    let key = LockKey::from_i64(23);
    let t1 = c1.transaction().await.unwrap();
    xact_lock(&t1, key).await.unwrap();

    let t2 = c2.transaction().await.unwrap();
    t2.batch_execute("SET LOCAL lock_timeout = '100ms'")
        .await
        .unwrap();
    let started = Instant::now();
    let err = xact_lock_timeout(&t2, key, Duration::from_secs(5))
        .await
        .unwrap_err();
    let took = started.elapsed();
    println!("caller's 100ms kept under a 5s bound: gave up after {took:?}");
    assert!(matches!(err, Error::LockTimeout { .. }), "{err}");
    assert!(
        took < Duration::from_secs(2),
        "the caller's 100ms applied: {took:?}"
    );
    t2.rollback().await.unwrap();
    t1.commit().await.unwrap();

    // Uncontended: the stricter value is still in force afterwards.
    let t2 = c2.transaction().await.unwrap();
    t2.batch_execute("SET LOCAL lock_timeout = '100ms'")
        .await
        .unwrap();
    xact_lock_timeout(&t2, key, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(lock_timeout_of(&t2).await, "100ms");
    t2.commit().await.unwrap();
}

#[tokio::test]
async fn bounded_xact_wait_caps_unlimited_and_longer_timeouts_and_restores_them() {
    let db = TestDb::new("xact_cap").await;
    let mut c1 = db.connect().await;
    let mut c2 = db.connect().await;
    let key = LockKey::from_i64(24);

    // 0 (unlimited, the default) and a longer 10s are both capped ...
    for caller in ["0", "10s"] {
        let t1 = c1.transaction().await.unwrap();
        xact_lock(&t1, key).await.unwrap();
        let t2 = c2.transaction().await.unwrap();
        t2.batch_execute(&format!("SET LOCAL lock_timeout = '{caller}'"))
            .await
            .unwrap();
        let started = Instant::now();
        let err = xact_lock_timeout(&t2, key, Duration::from_millis(200))
            .await
            .unwrap_err();
        println!(
            "caller lock_timeout {caller}: capped wait gave up after {:?}",
            started.elapsed()
        );
        assert!(matches!(err, Error::LockTimeout { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
        t2.rollback().await.unwrap();
        t1.commit().await.unwrap();

        // ... and the caller's value is back once the lock is held.
        let t2 = c2.transaction().await.unwrap();
        t2.batch_execute(&format!("SET LOCAL lock_timeout = '{caller}'"))
            .await
            .unwrap();
        xact_lock_timeout(&t2, key, Duration::from_millis(200))
            .await
            .unwrap();
        assert_eq!(lock_timeout_of(&t2).await, caller);
        // The lock is held until the end of the transaction.
        let t1 = c1.transaction().await.unwrap();
        assert!(!try_xact_lock(&t1, key).await.unwrap());
        t1.rollback().await.unwrap();
        t2.commit().await.unwrap();
    }
    // The session-level value was never touched.
    assert_eq!(lock_timeout_of(&c2).await, "0");
}

#[tokio::test]
async fn statement_timeout_during_a_wait_is_a_lock_timeout() {
    let db = TestDb::new("xact_statement_timeout").await;
    let mut c1 = db.connect().await;
    let mut c2 = db.connect().await;
    let key = LockKey::from_i64(25);
    let t1 = c1.transaction().await.unwrap();
    xact_lock(&t1, key).await.unwrap();
    let t2 = c2.transaction().await.unwrap();
    t2.batch_execute("SET LOCAL statement_timeout = '150ms'")
        .await
        .unwrap();
    let err = xact_lock(&t2, key).await.unwrap_err(); // 57014
    assert!(matches!(err, Error::LockTimeout { .. }), "{err}");
    t2.rollback().await.unwrap();
    t1.commit().await.unwrap();
}

#[cfg(feature = "sqlx")]
mod with_sqlx {
    use super::*;
    use pgelect::lock::sqlx as locks;
    use sqlx::{Connection, PgConnection};

    async fn sqlx_lock_timeout(conn: &mut PgConnection) -> String {
        sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(conn)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn sqlx_transaction_locks_behave_like_tokio_postgres_ones() {
        let db = TestDb::new("xact_sqlx").await;
        let mut c1 = PgConnection::connect(&db.url()).await.unwrap();
        let mut c2 = PgConnection::connect(&db.url()).await.unwrap();
        let key = LockKey::from_i64(26);

        let mut t1 = c1.begin().await.unwrap();
        assert!(locks::try_xact_lock(&mut t1, key).await.unwrap());
        let mut t2 = c2.begin().await.unwrap();
        assert!(!locks::try_xact_lock_shared(&mut t2, key).await.unwrap());

        let started = Instant::now();
        let err = locks::xact_lock_timeout(&mut t2, key, Duration::from_millis(300))
            .await
            .unwrap_err();
        println!(
            "sqlx xact_lock_timeout(300ms) gave up after {:?}",
            started.elapsed()
        );
        assert!(matches!(err, Error::LockTimeout { .. }), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(300));
        t2.rollback().await.unwrap();
        t1.commit().await.unwrap(); // releases

        let mut t2 = c2.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '100ms'")
            .execute(&mut *t2)
            .await
            .unwrap();
        locks::xact_lock_timeout(&mut t2, key, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(
            sqlx_lock_timeout(&mut t2).await,
            "100ms",
            "stricter kept and restored"
        );
        let mut t1 = c1.begin().await.unwrap();
        assert!(!locks::try_xact_lock(&mut t1, key).await.unwrap());
        t2.rollback().await.unwrap(); // releases
        locks::xact_lock(&mut t1, key).await.unwrap();
        locks::xact_lock_shared(&mut t1, LockKey::from_pair(1, 1))
            .await
            .unwrap();
        locks::xact_lock_shared_timeout(&mut t1, LockKey::from_pair(1, 2), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(sqlx_lock_timeout(&mut t1).await, "0", "unlimited restored");
        t1.commit().await.unwrap();
        assert_eq!(sqlx_lock_timeout(&mut c1).await, "0");
    }

    #[tokio::test]
    async fn sqlx_statement_timeout_during_a_wait_is_a_lock_timeout() {
        let db = TestDb::new("xact_sqlx_57014").await;
        let mut c1 = PgConnection::connect(&db.url()).await.unwrap();
        let mut c2 = PgConnection::connect(&db.url()).await.unwrap();
        let key = LockKey::from_i64(27);
        let mut t1 = c1.begin().await.unwrap();
        locks::xact_lock(&mut t1, key).await.unwrap();
        let mut t2 = c2.begin().await.unwrap();
        sqlx::query("SET LOCAL statement_timeout = '150ms'")
            .execute(&mut *t2)
            .await
            .unwrap();
        let err = locks::xact_lock(&mut t2, key).await.unwrap_err();
        assert!(matches!(err, Error::LockTimeout { .. }), "{err}");
        t2.rollback().await.unwrap();
        t1.commit().await.unwrap();
    }
}
