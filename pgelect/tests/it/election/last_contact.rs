//! `Elector::last_contact`: when the elector's connections last heard the
//! server, for health checks that open no connection of their own.

use std::time::Duration;

use pgelect::{election::Backend, Elector};

use crate::support;
use support::{fast_session, migrated};

/// Polls until `last_contact` is recent, then checks that it stays recent
/// over `for_at_least` (the elector keeps hearing the server).
async fn stays_recent(e: &Elector, what: &str, for_at_least: Duration) {
    let limit = Duration::from_secs(2);
    tokio::time::timeout(Duration::from_secs(10), async {
        while e.last_contact().is_none_or(|d| d >= limit) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: no recent contact: {:?}", e.last_contact()));
    let until = tokio::time::Instant::now() + for_at_least;
    while tokio::time::Instant::now() < until {
        let d = e.last_contact().expect("contact once made is kept");
        assert!(d < limit, "{what}: last contact {d:?} ago");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("{what}: last contact {:?} ago", e.last_contact().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standing_and_leading_electors_report_recent_contact_and_none_before() {
    let (db, o) = migrated("last_contact").await;
    let leader = fast_session(&o, "r", "a").build().unwrap();
    let standby = fast_session(&o, "r", "b").build().unwrap();
    assert_eq!(leader.last_contact(), None, "never connected");
    assert_eq!(standby.last_contact(), None, "never connected");

    let l = leader.leadership().await.unwrap();
    let standby = std::sync::Arc::new(standby);
    let s = standby.clone();
    let waiting = tokio::spawn(async move { s.leadership().await });
    db.wait_for_advisory_waiters(1).await;
    // Longer than the ttl (2 s): a leader keeps hearing the server, so does
    // a standby blocked in its lock wait (through its observer).
    stays_recent(&leader, "session leader", Duration::from_secs(3)).await;
    stays_recent(&standby, "blocking standby", Duration::from_secs(1)).await;
    l.resign().await.unwrap();
    let l2 = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    l2.resign().await.unwrap();

    let lease = Elector::builder(o.clone(), "l")
        .backend(Backend::Lease)
        .ttl(Duration::from_secs(2))
        .renew_every(Duration::from_millis(500))
        .build()
        .unwrap();
    assert_eq!(lease.last_contact(), None);
    let ll = lease.leadership().await.unwrap();
    stays_recent(&lease, "lease leader", Duration::from_secs(3)).await;
    ll.resign().await.unwrap();
}
