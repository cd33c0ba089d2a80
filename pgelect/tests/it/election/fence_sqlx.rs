//! The fence on a caller's sqlx transaction (feature `sqlx`): the same
//! guarantee as the tokio-postgres form.

use std::time::Duration;

use pgelect::{ConnectOptions, Elector, Error};
use pgelect_testkit::TestDb;
use sqlx::Connection;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_fence_passes_for_the_current_term_and_refuses_a_stale_one() {
    let db = TestDb::new("fence_sqlx").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let elector = Elector::builder(o, "fenced")
        .node_id("a")
        .ttl(Duration::from_secs(5))
        .build()
        .unwrap();
    let leadership = elector.leadership().await.unwrap();
    let mut conn = sqlx::PgConnection::connect(&db.url()).await.unwrap();

    let mut tx = conn.begin().await.unwrap();
    leadership
        .fence_sqlx(&mut tx)
        .await
        .expect("current term passes");
    tx.commit().await.unwrap();

    // Another leader's term begins (as a takeover would bump it).
    let admin = db.connect().await;
    admin
        .batch_execute("UPDATE pgelect.leaders SET term = term + 1 WHERE role = 'fenced'")
        .await
        .unwrap();
    let mut tx = conn.begin().await.unwrap();
    let e = leadership.fence_sqlx(&mut tx).await.unwrap_err();
    assert!(matches!(e, Error::StaleTerm { .. }), "{e:?}");
    assert!(e.to_string().contains("stale"), "{e}");
    tx.rollback().await.unwrap();
}
