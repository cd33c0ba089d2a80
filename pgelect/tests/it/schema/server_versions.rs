//! The server's major version: what pgelect does without on an older server
//! is logged once, and the connection works all the same. Run on every
//! supported version with `scripts/test.sh --pg all`.

use pgelect::{ConnectOptions, LockKey, LockSession};
use pgelect_testkit::TestDb;

use crate::support;
use pgelect::lock::{LockMode, Wait};
use support::Log;

#[tokio::test]
async fn an_older_server_is_used_and_what_it_lacks_is_logged_once() {
    let db = TestDb::new("versions").await;
    let admin = db.connect().await;
    let version_num: i32 = admin
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    let major = version_num / 10_000;
    let has_check_interval: bool = admin
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_settings WHERE name = 'client_connection_check_interval')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(has_check_interval, major >= 14, "server {version_num}");

    let log = Log::default();
    let _guard = log.capture(tracing::Level::INFO);

    let options = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&options).await.unwrap();
    // Two lock sessions: the settings this server lacks are skipped, the
    // locks work, and the gap is logged once, not per connection.
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let key = LockKey::from_name("versions").unwrap();
    let held = a
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .expect("a free key is taken");
    assert!(b
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .is_none());
    assert!(held.release().await.unwrap());
    assert!(b
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .is_some());

    let text = log.text();
    let degraded: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("pgelect degraded"))
        .collect();
    println!("PostgreSQL {version_num}: {degraded:#?}");
    if major >= 14 {
        assert!(degraded.is_empty(), "nothing is missing on {major}: {text}");
    } else {
        assert_eq!(degraded.len(), 1, "logged once: {text}");
        assert!(
            degraded[0].contains("client_connection_check_interval")
                && degraded[0].contains(" INFO "),
            "{}",
            degraded[0]
        );
    }
}
