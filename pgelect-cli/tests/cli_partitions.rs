//! `pgelect status --partitions GROUP:N` (the real binary) against a real
//! PostgreSQL, with members of a partition group run by the library in this
//! process.

mod support;

use std::time::Duration;

use pgelect::{ConnectOptions, PartitionGroup};
use pgelect_testkit::TestDb;
use support::{pgelect, run, wait_until};

const QUICK: Duration = Duration::from_secs(10);

fn command(db: &TestDb, args: &[&str]) -> tokio::process::Command {
    let mut cmd = pgelect(args);
    cmd.args(["--database-url", &db.url()]);
    cmd
}

fn member(o: &ConnectOptions, node: &str) -> PartitionGroup {
    let g = PartitionGroup::builder(o.clone(), "orders", 4)
        .member(node)
        .poll_interval(Duration::from_millis(200))
        .rebalance_every(Duration::from_millis(500))
        .elector(|b| {
            b.ttl(Duration::from_secs(2))
                .renew_every(Duration::from_millis(500))
                .heartbeat(Duration::from_millis(200))
                .heartbeat_timeout(Duration::from_millis(500))
        })
        .build()
        .unwrap();
    let mut events = g.join().unwrap();
    // The application: drops each partition as soon as it must.
    tokio::spawn(async move {
        while let Some(e) = events.recv().await {
            if let pgelect::PartitionEvent::Gained(held) = e {
                tokio::spawn(async move { held.token().cancelled().await });
            }
        }
    });
    g
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_a_partition_groups_assignment() {
    let db = TestDb::new("cli_partitions").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let a = member(&o, "a");
    let b = member(&o, "b");
    let took = wait_until("2 partitions each", Duration::from_secs(30), || async {
        a.held().len() == 2 && b.held().len() == 2
    })
    .await;
    println!("balanced after {took:?}");

    let r = run(
        command(&db, &["status", "--partitions", "orders:4", "--json"]),
        QUICK,
    )
    .await;
    r.assert_code(0);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).expect(&r.stdout);
    assert_eq!(j["group"], "orders");
    assert_eq!(j["partitions"], 4);
    assert_eq!(j["share"], 2);
    assert_eq!(j["members"], serde_json::json!(["a", "b"]));
    assert_eq!(j["unled"], serde_json::json!([]));
    for m in [&a, &b] {
        let held: Vec<u32> = m.held().keys().copied().collect();
        assert_eq!(j["by_member"][m.member()], serde_json::json!(held));
        for p in held {
            assert_eq!(j["assignment"][p as usize]["holder"], m.member());
            assert_eq!(j["assignment"][p as usize]["role"], format!("orders/{p}"));
            assert!(j["assignment"][p as usize]["term"].as_i64().unwrap() >= 1);
        }
    }

    let r = run(command(&db, &["status", "--partitions", "orders:4"]), QUICK).await;
    r.assert_code(0);
    print!("{}", r.stdout);
    assert!(
        r.stdout
            .starts_with("partition group orders: 4 partitions, 2 live members, share 2\n"),
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("unled"), "{}", r.stdout);

    // Both leave: no live member, every partition unled.
    b.leave().await.unwrap();
    a.leave().await.unwrap();
    let r = run(command(&db, &["status", "--partitions", "orders:4"]), QUICK).await;
    r.assert_code(0);
    assert!(r.stdout.contains("0 live members"), "{}", r.stdout);
    assert!(r.stdout.contains("unled: 0 1 2 3"), "{}", r.stdout);

    for bad in ["orders", "orders:0", "a/b:3", "orders:x"] {
        let r = run(command(&db, &["status", "--partitions", bad]), QUICK).await;
        r.assert_code(64);
        assert!(r.stderr.contains("expected GROUP:N"), "{}", r.stderr);
    }
    let r = run(
        command(&db, &["status", "--partitions", "orders:4", "--role", "x"]),
        QUICK,
    )
    .await;
    r.assert_code(64);
}
