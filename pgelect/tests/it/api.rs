//! The public API cannot be misused in the ways a review found: handles that
//! move across tasks are `Send + Sync`, the leadership token a caller gets
//! cannot end leadership, and fence refusals keep their kind and the
//! caller's role.

use std::time::Duration;

use pgelect::{ConnectOptions, Elector, Error};
use pgelect_testkit::TestDb;

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn handles_users_move_across_tasks_are_send_and_sync() {
    assert_send_sync::<pgelect::Elector>();
    assert_send_sync::<pgelect::ElectorBuilder>();
    assert_send_sync::<pgelect::Leadership>();
    assert_send_sync::<pgelect::election::LeaderContext>();
    assert_send_sync::<pgelect::LockSession>();
    assert_send_sync::<pgelect::lock::LockGuard>();
    assert_send_sync::<pgelect::election::SharedConnection>();
    assert_send_sync::<pgelect::ConnectOptions>();
    assert_send_sync::<pgelect::Error>();
}

#[test]
fn watch_outside_a_runtime_does_not_panic() {
    let o = ConnectOptions::from_url("postgres://app@127.0.0.1:1/app").unwrap();
    let elector = Elector::builder(o, "no-runtime").build().unwrap();
    let rx = elector.watch();
    assert!(rx.borrow().is_none());
}

async fn leader(hint: &str, role: &str) -> (TestDb, Elector, pgelect::Leadership) {
    let db = TestDb::new(hint).await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let elector = Elector::builder(o, role)
        .node_id("a")
        .ttl(Duration::from_secs(5))
        .build()
        .unwrap();
    let leadership = elector.leadership().await.unwrap();
    (db, elector, leadership)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_the_handed_out_token_does_not_end_leadership() {
    let (_db, _elector, leadership) = leader("api_token", "token").await;
    let token = leadership.token();
    token.cancel();
    assert!(token.is_cancelled());
    assert!(!leadership.is_lost(), "a caller's cancel ended leadership");
    assert_eq!(leadership.loss_reason(), None);
    // Tokens handed out still follow the real leadership.
    let second = leadership.token();
    assert!(!second.is_cancelled());
    leadership.resign().await.unwrap();
    assert!(second.is_cancelled(), "a resign did not reach the token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_refusals_keep_their_kind_and_the_callers_role() {
    // A quote in the role: the role must come from the caller, not from
    // parsing the server's message.
    let role = "we\"ird role";
    let (db, _elector, leadership) = leader("api_fence", role).await;
    let admin = db.connect().await;

    // A newer term: stale.
    admin
        .execute(
            "UPDATE pgelect.leaders SET term = term + 1 WHERE role = $1",
            &[&role],
        )
        .await
        .unwrap();
    admin.batch_execute("BEGIN").await.unwrap();
    let e = leadership.fence(&admin).await.unwrap_err();
    admin.batch_execute("ROLLBACK").await.unwrap();
    match &e {
        Error::StaleTerm { role: r, .. } => assert_eq!(r, role),
        other => panic!("expected StaleTerm, got {other:?}"),
    }
    assert_eq!(e.sqlstate(), Some(pgelect::schema::SQLSTATE_STALE_TERM));
    assert!(e.is_leadership_lost());

    // No row at all: no leader, a distinct error with its own SQLSTATE.
    let (db2, _elector2, leadership2) = leader("api_noleader", role).await;
    let admin2 = db2.connect().await;
    admin2
        .execute("DELETE FROM pgelect.leaders WHERE role = $1", &[&role])
        .await
        .unwrap();
    admin2.batch_execute("BEGIN").await.unwrap();
    let e = leadership2.fence(&admin2).await.unwrap_err();
    admin2.batch_execute("ROLLBACK").await.unwrap();
    match &e {
        Error::NoLeader { role: r, .. } => assert_eq!(r, role),
        other => panic!("expected NoLeader, got {other:?}"),
    }
    assert_eq!(e.sqlstate(), Some(pgelect::schema::SQLSTATE_NO_LEADER));
    assert!(!e.is_stale_term());
    assert!(e.is_leadership_lost());
}
