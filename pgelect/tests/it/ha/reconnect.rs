//! Multi-host URLs on the kit's ordinary servers (a primary and a streaming
//! replica): the connection error names the host that failed, and a
//! candidate that found no primary for a while reconnects within moments
//! of one accepting writes instead of sleeping a grown backoff.

use std::time::{Duration, Instant};

use pgelect::admin::AdminClient;
use pgelect::{election::Backend, ConnectOptions, Elector};
use pgelect_testkit::{free_port, ReplicaSet, Replication, TestDb, SUPERUSER, TEST_PASSWORD};
use tokio::time::timeout;

use crate::support::{fast_lease, fast_session};

fn url(ports: &[u16], db: &str) -> String {
    let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    format!(
        "postgres://{SUPERUSER}:{TEST_PASSWORD}@{}/{db}?target_session_attrs=read-write&connect_timeout=2",
        hosts.join(",")
    )
}

/// A port nothing listens on (refused at once).
fn closed_port() -> u16 {
    free_port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_error_names_the_host_that_refused() {
    let set = tokio::task::block_in_place(|| ReplicaSet::start(Replication::Async))
        .expect("primary and replica");
    let db = TestDb::on(set.primary(), "ha_error_host").await;
    tokio::task::block_in_place(|| set.wait_replayed()).expect("replica caught up");
    let (standby, primary, closed) = (set.replica().port(), set.primary().port(), closed_port());
    let host = |p: u16| format!("127.0.0.1:{p}");

    // The standby answered first, the second host refused: the error is
    // the second host's, and says what the first one answered.
    let e = ConnectOptions::from_url(&url(&[standby, closed], db.name()))
        .map(|o| async move { AdminClient::connect(&o).await })
        .unwrap()
        .await
        .expect_err("no primary among the hosts")
        .to_string();
    eprintln!("{e}");
    assert!(
        e.starts_with(&format!("could not connect to {}/", host(closed))),
        "{e}"
    );
    assert!(
        e.contains(&format!(
            "{}: a standby or read-only (accepts no writes)",
            host(standby)
        )),
        "{e}"
    );
    assert!(!e.contains(TEST_PASSWORD), "{e}");

    // The other order: the standby's refusal is the error, named as such.
    let e = ConnectOptions::from_url(&url(&[closed, standby], db.name()))
        .map(|o| async move { AdminClient::connect(&o).await })
        .unwrap()
        .await
        .expect_err("no primary among the hosts")
        .to_string();
    eprintln!("{e}");
    assert!(
        e.starts_with(&format!("could not connect to {}/", host(standby))),
        "{e}"
    );
    assert!(
        e.contains("does not allow writes") && e.contains("standby"),
        "{e}"
    );
    assert!(
        e.contains(&format!("the other hosts: {}: ", host(closed))),
        "{e}"
    );

    // One host: named, with the hint for a standby.
    let e = ConnectOptions::from_url(&url(&[standby], db.name()))
        .map(|o| async move { AdminClient::connect(&o).await })
        .unwrap()
        .await
        .expect_err("a standby alone")
        .to_string();
    assert!(
        e.starts_with(&format!("could not connect to {}/", host(standby))),
        "{e}"
    );
    assert!(e.contains("target_session_attrs asks for a primary"), "{e}");

    // A standby listed first is skipped for the primary.
    let admin = AdminClient::connect(
        &ConnectOptions::from_url(&url(&[closed, standby, primary], db.name())).unwrap(),
    )
    .await
    .expect("the primary, third");
    let c = admin.client();
    let port: String = c
        .query_one("SELECT current_setting('port')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(port, primary.to_string());
}

/// A candidate whose URL finds no primary for 4 s (its standby answers
/// read-only, the other host refuses), then the standby is promoted:
/// elected soon after the promoted server accepts writes. With the old
/// backoff (100 ms doubling to 5 s) it slept up to 3.2 s by then.
async fn reconnects_soon_after_a_promotion(backend: Backend, hint: &str) {
    let set = tokio::task::block_in_place(|| ReplicaSet::start(Replication::Async))
        .expect("primary and replica");
    let db = TestDb::on(set.primary(), hint).await;
    let primary_url = url(&[set.primary().port()], db.name());
    pgelect::migrate(&ConnectOptions::from_url(&primary_url).unwrap())
        .await
        .expect("migrate");
    tokio::task::block_in_place(|| set.wait_replayed()).expect("replica caught up");
    let o =
        ConnectOptions::from_url(&url(&[set.replica().port(), closed_port()], db.name())).unwrap();
    let elector: Elector = match backend {
        Backend::Session => fast_session(&o, "ha_reconnect", "node-a").build().unwrap(),
        _ => fast_lease(&o, "ha_reconnect", "node-a").build().unwrap(),
    };
    let standing = tokio::spawn(async move {
        let l = elector.leadership().await;
        (elector, l)
    });
    tokio::time::sleep(Duration::from_secs(4)).await; // the outage to ride out
    assert!(!standing.is_finished(), "elected with no primary");
    tokio::task::block_in_place(|| set.promote()).expect("promote the replica");
    let writable = Instant::now();
    let (_elector, l) = timeout(Duration::from_secs(15), standing)
        .await
        .expect("elected after the promotion")
        .unwrap();
    let took = writable.elapsed();
    let l = l.expect("elected");
    eprintln!("{backend:?}: elected {took:?} after the promoted server accepted writes");
    // The fast retry is 125-250 ms; the rest is a connection (SCRAM in a
    // debug build) and the election's statements, on a loaded machine.
    assert!(took < Duration::from_millis(2_000), "took {took:?}");
    l.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_candidate_reconnects_soon_after_a_promotion() {
    reconnects_soon_after_a_promotion(Backend::Session, "ha_reconnect_session").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_candidate_reconnects_soon_after_a_promotion() {
    reconnects_soon_after_a_promotion(Backend::Lease, "ha_reconnect_lease").await;
}
