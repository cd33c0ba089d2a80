//! `pgelect status --partitions GROUP:N` (the real binary) against a real
//! PostgreSQL, with members of a partition group run by the library in this
//! process.

use crate::support;

use std::time::Duration;

use pgelect::{partitions::PartitionGroup, ConnectOptions};
use pgelect_testkit::{Cluster, PgBouncer, PoolMode, TestDb};
use support::{pgelect, run, wait_until, Background, TempDir};

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
                .session(|s| {
                    s.heartbeat(Duration::from_millis(200))
                        .heartbeat_timeout(Duration::from_millis(500))
                })
        })
        .build()
        .unwrap();
    let mut events = g.join().unwrap();
    // The application: drops each partition as soon as it must.
    tokio::spawn(async move {
        while let Some(e) = events.recv().await {
            if let pgelect::partitions::PartitionEvent::Gained(held) = e {
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

/// Each partition's command: writes `$D/run-<partition>-<node>-<term>`
/// when it starts and `$D/stop-<partition>-<node>-<term>` on SIGTERM.
const WORKER: &str = r#"f="$PGELECT_PARTITION-$PGELECT_NODE-$PGELECT_TERM"
trap 'touch "$D/stop-$f"; exit 0' TERM
touch "$D/run-$f"
while :; do sleep 1 & wait $!; done"#;

fn member_process(db: &TestDb, dir: &TempDir, node: &str) -> Background {
    member_process_at(&db.url(), dir, node, &[])
}

/// A `pgelect run --partitions jobs:4` member on `url`, with `more`
/// options.
fn member_process_at(url: &str, dir: &TempDir, node: &str, more: &[&str]) -> Background {
    let mut cmd = pgelect([
        "run",
        "--partitions",
        "jobs:4",
        "--id",
        node,
        "--ttl",
        "2s",
        "--database-url",
        url,
    ]);
    cmd.args(more).args(["--", "sh", "-c", WORKER]);
    cmd.env("D", dir.path());
    Background::spawn(node, cmd)
}

/// The files named `<prefix>-*` in `dir`, as (partition, node).
fn files(dir: &TempDir, prefix: &str) -> Vec<(u32, String)> {
    let mut v: Vec<(u32, String)> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let rest = name.strip_prefix(&format!("{prefix}-"))?;
            let mut parts = rest.splitn(3, '-');
            Some((parts.next()?.parse().ok()?, parts.next()?.to_owned()))
        })
        .collect();
    v.sort();
    v
}

/// The partitions whose commands b runs; a's commands for exactly those
/// were stopped (and no other command).
fn moved_to_b_after_a_stopped(dir: &TempDir) -> Vec<u32> {
    let stopped = files(dir, "stop");
    let moved: Vec<u32> = files(dir, "run")
        .into_iter()
        .filter(|(_, n)| n == "b")
        .map(|(p, _)| p)
        .collect();
    assert_eq!(
        stopped,
        moved
            .iter()
            .map(|p| (*p, "a".to_owned()))
            .collect::<Vec<_>>(),
        "a's commands for the moved partitions got SIGTERM before b started"
    );
    moved
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_starts_one_command_per_partition_held_and_hands_over() {
    let db = TestDb::new("cli_partitions_run").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let dir = TempDir::new("cli_partitions_run");

    let mut a = member_process(&db, &dir, "a");
    let took = wait_until("a runs 4 commands", Duration::from_secs(30), || async {
        files(&dir, "run").len() == 4
    })
    .await;
    println!("a alone: 4 commands after {took:?}");
    assert!(files(&dir, "run").iter().all(|(_, n)| n == "a"));

    // b joins: two partitions move to it, a's commands for them are
    // stopped with SIGTERM first.
    let mut b = member_process(&db, &dir, "b");
    let took = wait_until("b runs 2 commands", Duration::from_secs(30), || async {
        files(&dir, "run").iter().filter(|(_, n)| n == "b").count() == 2
    })
    .await;
    println!("b joined: 2 commands moved to it after {took:?}");
    let moved = moved_to_b_after_a_stopped(&dir);
    let shown = pgelect::partitions::partition_assignment(&o, "jobs", 4)
        .await
        .unwrap();
    assert_eq!(shown.by_member()["b"], moved);

    // b stops (SIGTERM): its commands stop, a takes its partitions back.
    b.signal("TERM");
    assert_eq!(
        b.wait(Duration::from_secs(20)).await,
        Some(0),
        "{}",
        b.output()
    );
    let took = wait_until(
        "a runs 6 commands in all",
        Duration::from_secs(30),
        || async { files(&dir, "run").iter().filter(|(_, n)| n == "a").count() == 6 },
    )
    .await;
    println!("b left: a runs its partitions again after {took:?}");
    assert_eq!(
        files(&dir, "stop").iter().filter(|(_, n)| n == "b").count(),
        2
    );
    a.signal("TERM");
    assert_eq!(
        a.wait(Duration::from_secs(20)).await,
        Some(0),
        "{}",
        a.output()
    );

    let r = run(
        command(
            &db,
            &["run", "--partitions", "jobs:4", "--role", "x", "--", "true"],
        ),
        QUICK,
    )
    .await;
    r.assert_code(64);
    let r = run(
        command(&db, &["run", "--partitions", "jobs", "--", "true"]),
        QUICK,
    )
    .await;
    r.assert_code(64);
    assert!(r.stderr.contains("expected GROUP:N"), "{}", r.stderr);
}

/// A migrated database `name` with PgBouncer in transaction mode in
/// front of it: the database, its direct options, the pooler (kept
/// running while held), the pooled URL and a directory for the commands'
/// files.
async fn pooled_group(name: &str) -> (TestDb, ConnectOptions, PgBouncer, String, TempDir) {
    let cluster = tokio::task::spawn_blocking(Cluster::shared).await.unwrap();
    let db = TestDb::on(cluster, name).await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let bouncer = PgBouncer::start(cluster, PoolMode::Transaction).expect("pgbouncer starts");
    let url = bouncer.url(db.name());
    let dir = TempDir::new(name);
    (db, o, bouncer, url, dir)
}

/// SIGTERMs each member, which must exit 0, and checks that `stops`
/// commands in all were stopped.
async fn sigterm_and_every_command_stopped(
    members: [&mut Background; 2],
    dir: &TempDir,
    stops: usize,
) {
    for m in members {
        m.signal("TERM");
        assert_eq!(
            m.wait(Duration::from_secs(20)).await,
            Some(0),
            "{}",
            m.output()
        );
    }
    assert_eq!(files(dir, "stop").len(), stops, "every command stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_on_the_lease_backend_through_pgbouncer_spreads_partitions_over_processes() {
    let (_db, o, _bouncer, url, dir) = pooled_group("cli_partitions_lease").await;
    let lease = ["--backend", "lease"];

    let mut a = member_process_at(&url, &dir, "a", &lease);
    let took = wait_until("a runs 4 commands", Duration::from_secs(30), || async {
        files(&dir, "run").len() == 4
    })
    .await;
    println!("lease, a alone: 4 commands after {took:?}");
    let mut b = member_process_at(&url, &dir, "b", &lease);
    let took = wait_until("b runs 2 commands", Duration::from_secs(30), || async {
        files(&dir, "run").iter().filter(|(_, n)| n == "b").count() == 2
    })
    .await;
    println!("lease, b joined: 2 commands moved to it after {took:?}");
    let moved = moved_to_b_after_a_stopped(&dir);
    let shown = pgelect::partitions::partition_assignment(&o, "jobs", 4)
        .await
        .unwrap();
    assert_eq!(shown.members, vec!["a", "b"]);
    assert_eq!(shown.by_member()["b"], moved);
    sigterm_and_every_command_stopped([&mut a, &mut b], &dir, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_on_the_lease_backend_with_a_listen_url_listens_directly_and_hands_over() {
    let (db, _o, _bouncer, url, dir) = pooled_group("cli_partitions_listen").await;
    let direct = db.url();
    let lease = ["--backend", "lease", "--listen-url", direct.as_str()];

    let mut a = member_process_at(&url, &dir, "a", &lease);
    wait_until("a runs 4 commands", Duration::from_secs(30), || async {
        files(&dir, "run").len() == 4
    })
    .await;
    let mut b = member_process_at(&url, &dir, "b", &lease);
    let took = wait_until("b runs 2 commands", Duration::from_secs(30), || async {
        files(&dir, "run").iter().filter(|(_, n)| n == "b").count() == 2
    })
    .await;
    println!("lease with --listen-url, b joined: 2 commands moved to it after {took:?}");
    moved_to_b_after_a_stopped(&dir);
    // Each member holds a LISTEN on a direct connection (through the pooler
    // in transaction mode it could not).
    let admin = db.connect().await;
    let listening: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(listening, 2, "direct LISTEN connections, one per member");
    sigterm_and_every_command_stopped([&mut a, &mut b], &dir, 6).await;
}
