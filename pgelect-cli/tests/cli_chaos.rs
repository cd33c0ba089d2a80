//! `pgelect chaos` against a database the test names: it runs, finds no
//! violation, writes its JSON, cleans up after itself, replays a seed's
//! schedule, and refuses a role that already has a leader.

mod support;

use std::time::Duration;

use pgelect_testkit::TestDb;
use support::{pgelect, run, TempDir};

/// Long enough for a few faults of each kind drawn; bounded generously.
const CHAOS: Duration = Duration::from_secs(120);

fn chaos(db: &TestDb, args: &[&str]) -> tokio::process::Command {
    let mut cmd = pgelect(["chaos", "--database-url", &db.url()]);
    cmd.args(args);
    cmd
}

/// The fault kinds a run printed, in order.
fn schedule(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| l.starts_with("  ") && l.contains(" on c"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_finds_no_violation_writes_json_and_cleans_up() {
    let db = TestDb::new("chaos_run").await;
    let dir = TempDir::new("chaos");
    let json = dir.join("out.json");
    let r = run(
        chaos(
            &db,
            &[
                "--duration",
                "8s",
                "--seed",
                "11",
                "--json",
                json.to_str().unwrap(),
            ],
        ),
        CHAOS,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(0);
    assert!(r.stdout.contains("no violation"), "{}", r.stdout);
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    assert!(!rows.is_empty());
    let mut backends = std::collections::HashSet::new();
    for row in &rows {
        for field in [
            "fault",
            "backend",
            "trials",
            "overlaps",
            "stale_writes_committed",
            "lost_writes",
            "failover_p50_ms",
            "failover_p99_ms",
            "max_gap_ms",
        ] {
            assert!(row.get(field).is_some(), "{field} missing in {row}");
        }
        assert_eq!(row["overlaps"], 0, "{row}");
        assert!(row["trials"].as_u64().unwrap() > 0);
        backends.insert(row["backend"].as_str().unwrap().to_owned());
    }
    assert_eq!(backends.len(), 2, "both backends ran: {rows:?}");
    // Fenced writes were made and checked, and the table is gone again.
    assert!(r.stdout.contains("fenced writes committed"));
    let c = db.connect().await;
    let left: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'pgelect_chaos_%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "the chaos table was not dropped");
    let sessions: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pgelect:%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(sessions, 0, "supervisors or workers left connected");

    // The same seed draws the same faults (as far as both runs went).
    let again = run(
        chaos(
            &db,
            &["--duration", "4s", "--seed", "11", "--backends", "session"],
        ),
        CHAOS,
    )
    .await;
    again.assert_code(0);
    let (a, b) = (schedule(&r.stdout), schedule(&again.stdout));
    let n = a.len().min(b.len());
    assert!(n > 0, "{a:?} {b:?}");
    assert_eq!(a[..n], b[..n], "seed 11 replayed a different schedule");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_refuses_a_role_that_already_has_a_leader() {
    let db = TestDb::new("chaos_busy").await;
    let o = pgelect::ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let squatter = pgelect::Elector::builder(o, "chaos-5-session")
        .build()
        .unwrap();
    let held = squatter.leadership().await.unwrap();
    let r = run(chaos(&db, &["--duration", "2s", "--seed", "5"]), CHAOS).await;
    r.assert_code(64);
    assert!(r.stderr.contains("already has a leader"), "{}", r.stderr);
    held.resign().await.unwrap();
}
