//! The loss API (`lost`, `token`, `is_lost`, `loss`), the same on every
//! handle that can be lost: a leadership, a held partition, a lock
//! session, a lock guard and a semaphore permit. Each is lost by
//! terminating its connection on the server (`pg_terminate_backend`), and
//! must report it with the right reason, at a moment between the kill and
//! the report, with `is_lost` and `loss` agreeing before and after.

use std::time::{Duration, Instant};

use pgelect::lock::Semaphore;
use pgelect::lock::{LockMode, Wait};
use pgelect::loss::{Loss, LossReason, Lost};
use pgelect::partitions::{PartitionEvent, PartitionGroup};
use pgelect::{LockKey, LockSession};
use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;

use crate::support::{fast_session, migrated};

/// Generous: a terminated backend is seen in milliseconds (pushed by the
/// driver task); the bound only keeps a broken test from hanging.
const WITHIN: Duration = Duration::from_secs(10);

/// Terminates backend `pid` as a superuser would.
async fn terminate(admin: &tokio_postgres::Client, pid: i32) {
    let terminated: bool = admin
        .query_typed_one("SELECT pg_terminate_backend($1)", &[(&pid, Type::INT4)])
        .await
        .unwrap()
        .get(0);
    assert!(terminated, "backend {pid} was there to terminate");
}

/// The backend holding `role`'s lock, as its leader row says.
async fn holder_pid(admin: &tokio_postgres::Client, role: &str) -> i32 {
    admin
        .query_typed_one(
            "SELECT holder_pid FROM pgelect.leaders WHERE role = $1",
            &[(&role, Type::TEXT)],
        )
        .await
        .unwrap()
        .get(0)
}

/// What a handle answered before its loss, and checks it: not lost.
fn assert_held(what: &str, is_lost: bool, loss: Option<Loss>, token: &CancellationToken) {
    assert!(!is_lost, "{what}: lost before the kill");
    assert_eq!(loss, None, "{what}: a loss before the kill");
    assert!(
        !token.is_cancelled(),
        "{what}: token cancelled before the kill"
    );
}

/// Awaits `lost` and checks the loss against the handle's other answers:
/// the reason, a moment between the kill and now, `is_lost` and `loss`
/// agreeing, the token cancelled. Returns the loss.
async fn assert_lost(
    what: &str,
    lost: Lost,
    killed: Instant,
    reason: LossReason,
    is_lost: impl Fn() -> bool,
    loss: impl Fn() -> Option<Loss>,
    token: &CancellationToken,
) -> Loss {
    let got = tokio::time::timeout(WITHIN, lost)
        .await
        .unwrap_or_else(|_| panic!("{what}: lost() did not fire within {WITHIN:?} of the kill"));
    let seen = Instant::now();
    println!(
        "{what}: lost ({}) {:?} after pg_terminate_backend",
        got.reason(),
        got.at().saturating_duration_since(killed)
    );
    assert_eq!(got.reason(), reason, "{what}");
    assert!(
        killed <= got.at() && got.at() <= seen,
        "{what}: lost at {:?}, outside the kill ({killed:?}) .. report ({seen:?})",
        got.at()
    );
    assert!(is_lost(), "{what}: lost() fired but is_lost() is false");
    assert_eq!(loss(), Some(got), "{what}: loss() disagrees with lost()");
    assert!(token.is_cancelled(), "{what}: the token was not cancelled");
    got
}

#[tokio::test]
async fn a_leadership_is_lost_with_its_connection() {
    let (db, o) = migrated("loss_leadership").await;
    let admin = db.connect().await;
    let elector = fast_session(&o, "loss", "a").build().unwrap();
    let leadership = elector.leadership().await.unwrap();
    let context = leadership.context();
    let token = leadership.token();
    assert_held(
        "leadership",
        leadership.is_lost(),
        leadership.loss(),
        &token,
    );
    let lost = leadership.lost();

    let pid = holder_pid(&admin, "loss").await;
    let killed = Instant::now();
    terminate(&admin, pid).await;
    let loss = assert_lost(
        "leadership",
        lost,
        killed,
        LossReason::ConnectionLost,
        || leadership.is_lost(),
        || leadership.loss(),
        &token,
    )
    .await;
    // Every view of one leadership tells the same story.
    assert!(context.is_lost());
    assert_eq!(context.loss(), Some(loss));
    assert_eq!(context.lost().await, loss);
    leadership.resign().await.unwrap();
}

#[tokio::test]
async fn a_lock_session_and_its_guard_are_lost_with_their_connection() {
    let (db, o) = migrated("loss_lock").await;
    let admin = db.connect().await;
    let session = LockSession::connect(&o).await.unwrap();
    let guard = session
        .acquire(LockKey::from_i64(31), LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .expect("a free key");
    let (guard_token, session_token) = (guard.token(), session.token());
    assert_held("guard", guard.is_lost(), guard.loss(), &guard_token);
    assert_held("session", session.is_lost(), session.loss(), &session_token);
    let (guard_lost, session_lost) = (guard.lost(), session.lost());

    let killed = Instant::now();
    terminate(&admin, session.backend_pid()).await;
    let by_guard = assert_lost(
        "guard",
        guard_lost,
        killed,
        LossReason::ConnectionLost,
        || guard.is_lost(),
        || guard.loss(),
        &guard_token,
    )
    .await;
    let by_session = assert_lost(
        "session",
        session_lost,
        killed,
        LossReason::ConnectionLost,
        || session.is_lost(),
        || session.loss(),
        &session_token,
    )
    .await;
    assert_eq!(by_guard, by_session, "one connection, one loss");
    assert!(guard.release().await.unwrap_err().is_connection());
}

#[tokio::test]
async fn a_permit_is_lost_with_its_connection() {
    let (db, o) = migrated("loss_permit").await;
    let admin = db.connect().await;
    let session = LockSession::connect(&o).await.unwrap();
    let upstream = Semaphore::new("loss-upstream", 2).unwrap();
    let permit = session
        .acquire_permit(&upstream, Wait::Never)
        .await
        .unwrap()
        .expect("a free permit");
    let token = permit.token();
    assert_held("permit", permit.is_lost(), permit.loss(), &token);
    let lost = permit.lost();

    let killed = Instant::now();
    terminate(&admin, permit.backend_pid()).await;
    let loss = assert_lost(
        "permit",
        lost,
        killed,
        LossReason::ConnectionLost,
        || permit.is_lost(),
        || permit.loss(),
        &token,
    )
    .await;
    assert_eq!(session.loss(), Some(loss), "the permit's session agrees");
    assert!(permit.release().await.unwrap_err().is_connection());
}

#[tokio::test]
async fn a_held_partition_is_lost_with_its_connection() {
    let (db, o) = migrated("loss_partition").await;
    let admin = db.connect().await;
    let group = PartitionGroup::builder(o.clone(), "loss-group", 1)
        .member("a")
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
    let mut events = group.join().unwrap();
    let held = loop {
        match tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("partition 0 gained within 30 s")
            .expect("the member runs")
        {
            PartitionEvent::Gained(held) => break held,
            other => println!("before the gain: {other:?}"),
        }
    };
    let token = held.token();
    assert_held("held partition", held.is_lost(), held.loss(), &token);
    let lost = held.lost();

    let pid = holder_pid(&admin, held.role()).await;
    let killed = Instant::now();
    terminate(&admin, pid).await;
    assert_lost(
        "held partition",
        lost,
        killed,
        LossReason::ConnectionLost,
        || held.is_lost(),
        || held.loss(),
        &token,
    )
    .await;
    drop(held);
    group.leave().await.unwrap();
}
