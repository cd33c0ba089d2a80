//! `pgelect chaos` against a database the test names: it runs, finds no
//! violation, writes its JSON, cleans up after itself, replays a seed's
//! schedule, and refuses a role that already has a leader.

use crate::support;

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

/// A dead run's last leader leaves its row, lease still running, behind
/// (a SIGKILLed supervisor here): that is no leader to refuse for. CI once
/// failed `chaos_finds_no_violation_writes_json_and_cleans_up` this way,
/// when its second run with the same seed began half a second after the
/// first, whose last leader had not released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_runs_on_a_role_whose_last_leader_died() {
    let db = TestDb::new("chaos_dead").await;
    let o = pgelect::ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let mut cmd = pgelect(["run", "--role", "chaos-6-session", "--id", "gone"]);
    cmd.args(["--database-url", &db.url(), "--", "sleep", "600"]);
    let mut sup = support::Background::spawn("gone", cmd);
    support::wait_until("the supervisor leads", Duration::from_secs(30), || {
        let o = o.clone();
        async move {
            pgelect::admin::current_leader(&o, "chaos-6-session")
                .await
                .ok()
                .flatten()
                .is_some()
        }
    })
    .await;
    let pid = pgelect::admin::current_leader(&o, "chaos-6-session")
        .await
        .unwrap()
        .unwrap()
        .holder_pid
        .expect("a session leader names its backend");
    sup.kill().await;
    let c = db.connect().await;
    support::wait_until("its backend ends", Duration::from_secs(15), || {
        let c = &c;
        async move {
            !c.query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
                &[&pid],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
        }
    })
    .await;
    let row = pgelect::admin::current_leader(&o, "chaos-6-session")
        .await
        .unwrap()
        .expect("the dead leader's row stays");
    assert!(!row.lease_expired, "its lease still runs: {row:?}");

    let r = run(
        chaos(
            &db,
            &["--duration", "2s", "--seed", "6", "--backends", "session"],
        ),
        CHAOS,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(0);
    assert!(r.stdout.contains("fenced writes committed"), "{}", r.stdout);
}

/// The names of this machine's network namespaces and links that carry
/// `pid` the way `pgelect chaos` names its own.
fn netns_leftovers(pid: &str) -> Vec<String> {
    let out = |args: &[&str]| {
        std::process::Command::new("ip")
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    let ns = format!("pgelect-chaos-{pid}-");
    let links = [format!("pgcb{pid}"), format!("pgch{pid}x")];
    let mut left: Vec<String> = out(&["netns", "list"])
        .lines()
        .filter(|l| l.starts_with(&ns))
        .map(str::to_owned)
        .collect();
    left.extend(
        out(&["-o", "link", "show"])
            .lines()
            .filter(|l| links.iter().any(|n| l.contains(&format!(": {n}"))))
            .map(str::to_owned),
    );
    left
}

/// Root with `ip netns`: what the partition phase needs.
fn partitions_possible() -> bool {
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    root && std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A real partition on the throwaway server `pgelect chaos` starts itself:
/// each candidate in a network namespace of its own, the leader's link
/// cut until another leads, once with and once without `pg_signal_backend`,
/// on both backends; every failover within its bound, and nothing left of
/// the namespaces afterwards. Without root the faults are reported skipped,
/// with the reason, in the output and the JSON.
#[cfg(feature = "throwaway")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_partitions_candidates_in_namespaces_with_and_without_preemption() {
    let dir = TempDir::new("chaos_netns");
    let json = dir.join("out.json");
    let logs = dir.join("logs");
    let r = run(
        pgelect([
            "chaos",
            "--duration",
            "6s",
            "--seed",
            "5",
            "--faults",
            "partition,partition-nopreempt",
            "--every-fault",
            "--json",
            json.to_str().unwrap(),
            "--logs",
            logs.to_str().unwrap(),
        ]),
        CHAOS * 2,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(0);
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    assert_eq!(rows.len(), 4, "two faults × two backends: {rows:?}");
    if !partitions_possible() {
        println!("not root or no `ip netns`: checking that partitions are reported skipped");
        assert!(
            r.stdout.contains("partition faults skipped: "),
            "{}",
            r.stdout
        );
        for row in &rows {
            assert_eq!(row["skipped"], row["trials"], "{row}");
            assert!(
                row["skipped_reason"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty()),
                "{row}"
            );
        }
        return;
    }
    for row in &rows {
        assert_eq!(row["seed"], 5, "{row}");
        assert_eq!(row["skipped"], 0, "{row}");
        let trials = row["trials"].as_u64().unwrap();
        assert!(trials > 0, "{row}");
        // Every partition ended in a new leader, from timers alone.
        assert_eq!(row["failovers"].as_u64(), Some(trials), "{row}");
        for zero in ["overlaps", "stale_writes_committed", "lost_writes"] {
            assert_eq!(row[zero], 0, "{zero}: {row}");
        }
        assert_eq!(row["within_bound"], true, "{row}");
        println!(
            "{} {}: max gap {} ms (bound {} ms)",
            row["fault"], row["backend"], row["max_gap_ms"], row["bound_ms"]
        );
    }
    // Without the privilege no session standby ended a partitioned
    // leader's backend (their supervisors log each preemption): the
    // server's TCP timers freed the lock.
    let session_logs: String = std::fs::read_dir(logs.join("session"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "stderr"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    let unprivileged: Vec<(String, String)> = r
        .stdout
        .lines()
        .take_while(|l| !l.starts_with("session: "))
        .filter_map(|l| l.trim().strip_prefix("partition-nopreempt on "))
        .filter_map(|l| {
            let (node, rest) = l.split_once(" (term ")?;
            Some((node.to_owned(), rest.split(')').next()?.to_owned()))
        })
        .collect();
    assert!(!unprivileged.is_empty(), "{}", r.stdout);
    for (node, term) in &unprivileged {
        let preempted = format!("term={term} holder={node}");
        assert!(
            !session_logs
                .lines()
                .any(|l| l.contains("terminated the backend") && l.contains(&preempted)),
            "{node} (term {term}) was preempted without pg_signal_backend:\n{session_logs}"
        );
    }
    // No URL (with its password) is kept with the logs.
    for backend in ["session", "lease"] {
        for e in std::fs::read_dir(logs.join(backend)).unwrap().flatten() {
            assert!(
                e.path().extension().is_none_or(|x| x != "url"),
                "{} kept",
                e.path().display()
            );
        }
    }
    let pid = r
        .stdout
        .split("on bridge pgcb")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("the bridge is named")
        .to_owned();
    assert_eq!(netns_leftovers(&pid), Vec::<String>::new());
}

/// SIGINT in the middle of the partition phase: the run stops (75), and
/// its namespaces, veths and bridge are gone.
#[cfg(feature = "throwaway")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_interrupted_removes_its_namespaces() {
    if !partitions_possible() {
        println!("skipped: not root or no `ip netns` (the partition test checks the skip)");
        return;
    }
    let mut bg = support::Background::spawn(
        "chaos",
        pgelect([
            "chaos",
            "--duration",
            "60s",
            "--backends",
            "lease",
            "--faults",
            "partition",
        ]),
    );
    let line = bg
        .next_line("the bridge", CHAOS, |l| l.contains("on bridge pgcb"))
        .await;
    let pid = line
        .split("on bridge pgcb")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .to_owned();
    bg.next_line("candidates in namespaces", CHAOS, |l| {
        l.contains("candidates in network namespaces")
    })
    .await;
    assert!(!netns_leftovers(&pid).is_empty(), "the namespaces exist");
    bg.signal("INT");
    assert_eq!(bg.wait(CHAOS).await, Some(75), "{}", bg.output());
    assert_eq!(
        netns_leftovers(&pid),
        Vec::<String>::new(),
        "{}",
        bg.output()
    );
}

/// The run that fails on purpose: a worker outside any supervisor acts all
/// along with term 1 (`--rogue`, hidden, for this test). The checker must
/// exit 70 and name the rogue's events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_fails_a_run_with_a_second_leader() {
    let db = TestDb::new("chaos_rogue").await;
    let r = run(
        chaos(
            &db,
            &[
                "--duration",
                "2s",
                "--seed",
                "9",
                "--backends",
                "session",
                "--faults",
                "term",
                "--rogue",
            ],
        ),
        CHAOS,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(70);
    let proof = r
        .stdout
        .lines()
        .find(|l| l.starts_with("VIOLATION session: two leaders at once") && l.contains("rogue"))
        .unwrap_or_else(|| panic!("no overlap with the rogue named:\n{}", r.stdout));
    println!("{proof}");
    assert!(!r.stdout.contains("no violation"), "{}", r.stdout);
}

/// The same in a partition group (`--partitions`): the rogue acts for
/// partition 0 only. The checker judges each partition on its own: it names
/// the overlap in partition 0, and nothing in the others, whose workers
/// act at the same time as the rogue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_fails_a_partition_group_run_with_a_second_leader_of_one_partition() {
    let db = TestDb::new("chaos_group_rogue").await;
    let r = run(
        chaos(
            &db,
            &[
                "--partitions",
                "3",
                "--members",
                "3",
                "--duration",
                "2s",
                "--seed",
                "10",
                "--faults",
                "term",
                "--rogue",
            ],
        ),
        CHAOS,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(70);
    let violations: Vec<&str> = r
        .stdout
        .lines()
        .filter(|l| l.starts_with("VIOLATION"))
        .collect();
    assert!(
        violations.iter().any(|l| l
            .starts_with("VIOLATION lease-group: chaos-a-lease-group/0: two leaders at once")
            && l.contains("rogue")),
        "no overlap with the rogue in partition 0:\n{}",
        r.stdout
    );
    assert!(
        violations.iter().all(|l| l.contains("lease-group/0: ")),
        "a violation outside partition 0:\n{}",
        r.stdout
    );
}

/// On its own throwaway server, the lease backend's supervisors and their
/// workers' fenced writes go through a PgBouncer in transaction mode that
/// chaos starts in front of it (the header says so, every lease row of the
/// JSON carries `pooler: true`, and PgBouncer's own counters show at least
/// a transaction per committed write), and the
/// `pgbouncer-restart` fault is injected and judged like any other: no
/// overlap, no lost write, within its bound. Without PgBouncer installed,
/// the lease backend runs directly and the fault is reported skipped.
#[cfg(feature = "throwaway")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_runs_the_lease_backend_through_its_own_pgbouncer_and_restarts_it() {
    let dir = TempDir::new("chaos_pooler");
    let json = dir.join("out.json");
    let r = run(
        pgelect([
            "chaos",
            "--duration",
            "2s",
            "--seed",
            "21",
            "--backends",
            "lease",
            "--faults",
            "pgbouncer-restart,kill",
            "--every-fault",
            "--json",
            json.to_str().unwrap(),
        ]),
        CHAOS,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(0);
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    assert_eq!(rows.len(), 2, "two faults, one backend: {rows:?}");
    let row = |fault: &str| {
        rows.iter()
            .find(|r| r["fault"] == fault)
            .unwrap_or_else(|| panic!("no {fault} row: {rows:?}"))
    };
    if !pgelect_testkit::pgbouncer_available() {
        println!("PgBouncer not installed: checking that its restart is reported skipped");
        assert!(
            r.stdout
                .contains("lease backend direct (PgBouncer is not installed"),
            "{}",
            r.stdout
        );
        let restart = row("pgbouncer-restart");
        assert_eq!(restart["skipped"], restart["trials"], "{restart}");
        return;
    }
    assert!(
        r.stdout
            .contains("lease backend through PgBouncer in transaction mode on 127.0.0.1:"),
        "{}",
        r.stdout
    );
    for row in &rows {
        assert_eq!(row["backend"], "lease", "{row}");
        assert_eq!(row["pooler"], true, "{row}");
        assert_eq!(row["skipped"], 0, "{row}");
        assert!(row["trials"].as_u64().unwrap() > 0, "{row}");
        for zero in ["overlaps", "stale_writes_committed", "lost_writes"] {
            assert_eq!(row[zero], 0, "{zero}: {row}");
        }
        assert_eq!(row["within_bound"], true, "{row}");
        println!(
            "{}: {} trials, {} moved, max gap {} ms (bound {} ms)",
            row["fault"], row["trials"], row["failovers"], row["max_gap_ms"], row["bound_ms"]
        );
    }
    // A killed leader is replaced through the pooler too.
    let kill = row("kill");
    assert_eq!(kill["failovers"], kill["trials"], "{kill}");
    // The restart was injected on a leader and its outcome printed.
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with("  pgbouncer-restart on c")
                && (l.contains(" began ") || l.contains("no new term"))),
        "{}",
        r.stdout
    );
    // The supervisors' statements really went through PgBouncer: its own
    // counters (its readiness checks count one transaction per start).
    let served: u64 = r
        .stdout
        .split("PgBouncer served ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no PgBouncer count printed:\n{}", r.stdout));
    println!("PgBouncer served {served} transactions");
    assert!(served >= 20, "{served} transactions through PgBouncer");
    // The workers' fenced writes went through it too: each committed one
    // is a transaction PgBouncer served (the supervisors' come on top).
    let committed: u64 = r
        .stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("lease: ")?
                .split(" faults, ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no count of committed writes:\n{}", r.stdout));
    println!("{committed} fenced writes committed");
    assert!(committed > 0, "{}", r.stdout);
    assert!(
        served >= committed,
        "PgBouncer served {served} transactions, fewer than the {committed} fenced writes committed: the workers went around it"
    );
}

/// A pooler needs the database behind it named: usage error, before
/// anything starts.
#[tokio::test]
async fn chaos_refuses_a_pooler_url_without_a_database_url() {
    let r = run(
        pgelect([
            "chaos",
            "--pooler-url",
            "postgres://u@127.0.0.1:1/db",
            "--duration",
            "1s",
        ]),
        CHAOS,
    )
    .await;
    r.assert_code(64);
    assert!(
        r.stderr.contains("--pooler-url needs --database-url"),
        "{}",
        r.stderr
    );
}

/// `--profile fast` with the lease backend (the default backends include
/// it, and a partition group is the lease backend's) is refused at once,
/// not after a phase without a leader (the candidates refuse it).
#[tokio::test]
async fn chaos_refuses_the_fast_profile_with_the_lease_backend() {
    for extra in [
        &[][..],
        &["--backends", "lease"][..],
        &["--partitions", "4"][..],
    ] {
        let mut args = vec!["chaos", "--profile", "fast", "--duration", "1s"];
        args.extend_from_slice(extra);
        let r = run(pgelect(args), CHAOS).await;
        r.assert_code(64);
        assert!(
            r.stderr
                .contains("--profile fast is for the session backend"),
            "{extra:?}: {}",
            r.stderr
        );
    }
}

/// `--python` with an interpreter that is missing, or that cannot import
/// the Python candidate, is refused before anything starts, saying what
/// to install.
#[tokio::test]
async fn chaos_refuses_a_python_that_cannot_run_the_candidate() {
    let missing = run(
        pgelect([
            "chaos",
            "--python",
            "/nonexistent/python3",
            "--duration",
            "1s",
        ]),
        CHAOS,
    )
    .await;
    missing.assert_code(64);
    assert!(
        missing
            .stderr
            .contains("--python /nonexistent/python3: cannot run it"),
        "{}",
        missing.stderr
    );
    // The system's python3, without the pgelect wheel.
    let bare = run(
        pgelect(["chaos", "--python", "/usr/bin/python3", "--duration", "1s"]),
        CHAOS,
    )
    .await;
    bare.assert_code(64);
    assert!(
        bare.stderr
            .contains("cannot import the Python candidate (pgelect._chaos)")
            && bare.stderr.contains("ModuleNotFoundError"),
        "{}",
        bare.stderr
    );
}

/// Against a database named with --database-url, the lease backend's
/// supervisors go through the pooler named with --pooler-url-file (here
/// PgBouncer in transaction mode in front of the test cluster), the rows
/// say so, a killed leader is replaced through it, and `pgbouncer-restart`
/// is reported skipped (the pooler is not chaos's own to restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_runs_the_lease_backend_through_a_given_pooler() {
    use pgelect_testkit::{pgbouncer_available, Cluster, PgBouncer, PoolMode};
    if !pgbouncer_available() || pgelect_testkit::external_url().is_some() {
        println!("skipped: no PgBouncer, or an external test server");
        return;
    }
    let cluster = tokio::task::spawn_blocking(Cluster::shared).await.unwrap();
    let db = TestDb::on(cluster, "chaos_pooler_given").await;
    let bouncer = tokio::task::spawn_blocking(move || {
        PgBouncer::start(cluster, PoolMode::Transaction).expect("pgbouncer starts")
    })
    .await
    .unwrap();
    let dir = TempDir::new("chaos_pooler_given");
    let (json, url_file) = (dir.join("out.json"), dir.join("pooler.url"));
    std::fs::write(&url_file, bouncer.tcp_url(db.name())).unwrap();
    let r = run(
        chaos(
            &db,
            &[
                "--duration",
                "5s",
                "--seed",
                "23",
                "--backends",
                "lease",
                "--faults",
                "kill,pgbouncer-restart",
                "--every-fault",
                "--pooler-url-file",
                url_file.to_str().unwrap(),
                "--json",
                json.to_str().unwrap(),
            ],
        ),
        CHAOS,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(0);
    assert!(
        r.stdout.contains(&format!(
            "lease backend through the pooler at 127.0.0.1:{} (--pooler-url)",
            bouncer.port()
        )),
        "{}",
        r.stdout
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    let row = |fault: &str| {
        rows.iter()
            .find(|r| r["fault"] == fault)
            .unwrap_or_else(|| panic!("no {fault} row: {rows:?}"))
            .clone()
    };
    let kill = row("kill");
    assert_eq!(kill["pooler"], true, "{kill}");
    assert_eq!(kill["skipped"], 0, "{kill}");
    assert_eq!(kill["failovers"], kill["trials"], "{kill}");
    assert_eq!(kill["lost_writes"], 0, "{kill}");
    // The workers (directly connected) made fenced writes meanwhile.
    let committed: u64 = r
        .stdout
        .split(" fenced writes committed")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of fenced writes:\n{}", r.stdout));
    assert!(committed > 0, "{}", r.stdout);
    // The supervisors' statements went through the pooler: its counters.
    let (console, connection) = bouncer
        .config("pgbouncer")
        .connect(tokio_postgres::NoTls)
        .await
        .expect("pgbouncer's console");
    tokio::spawn(connection);
    let served: u64 = console
        .simple_query("SHOW STATS")
        .await
        .unwrap()
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) if r.get("database") == Some(db.name()) => {
                r.get("total_xact_count")?.parse().ok()
            }
            _ => None,
        })
        .unwrap_or(0);
    println!("PgBouncer served {served} transactions on {}", db.name());
    assert!(served >= 20, "{served} transactions through PgBouncer");
    let restart = row("pgbouncer-restart");
    assert_eq!(restart["skipped"], restart["trials"], "{restart}");
    assert!(
        restart["skipped_reason"]
            .as_str()
            .is_some_and(|s| s.contains("not chaos's own")),
        "{restart}"
    );
}

/// Processes whose command line mentions `path` (servers with their data
/// directory under it, supervisors and workers with their logs in it).
#[cfg(feature = "throwaway")]
fn processes_under(path: &std::path::Path) -> Vec<String> {
    let needle = path.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(&needle)
                .then(|| format!("{}: {cmd}", e.file_name().to_string_lossy()))
        })
        .collect()
}

/// `promote` on the primary-with-replica pair that chaos starts itself:
/// on both backends the primary is killed and the replica promoted at least
/// once (the second time on a replica rebuilt from the first promoted
/// server), the candidates follow through their two-host URL, and the
/// checker finds no overlap, no stale or lost write, every gap within the
/// bound; the session backend's terms rise past 2^32 × the promotions (the
/// WAL timeline in the high bits), every backend's terms rise strictly
/// across them. Writes are acknowledged again after every promotion. The
/// lease backend's supervisors and workers go through a PgBouncer in
/// transaction mode in front of the primary address that chaos re-points
/// (the phase line says so, its row carries `pooler: true`, PgBouncer
/// served at least a transaction per fenced write committed in the phase);
/// without PgBouncer installed they connect directly and the line says why.
/// Nothing is left behind: no process, no directory.
#[cfg(feature = "throwaway")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_promotes_the_replica_and_candidates_follow_with_rising_terms() {
    let dir = TempDir::new("chaos_promote");
    let (json, logs, tmp) = (dir.join("out.json"), dir.join("logs"), dir.join("tmp"));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut cmd = pgelect([
        "chaos",
        "--duration",
        "5s",
        "--seed",
        "31",
        "--faults",
        "promote",
        "--every-fault",
        "--json",
        json.to_str().unwrap(),
        "--logs",
        logs.to_str().unwrap(),
    ]);
    // Its servers' directories and its private files go under `tmp`,
    // checked empty at the end.
    cmd.env("TMPDIR", &tmp).env_remove("PGELECT_TEST_TMPDIR");
    let r = run(cmd, CHAOS * 2).await;
    println!("{}", r.stdout);
    r.assert_code(0);
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    assert_eq!(rows.len(), 2, "one fault × two backends: {rows:?}");
    // PostgreSQL builds without pg_basebackup (the npm packages the
    // version runs use) cannot make a replica: then the fault must be
    // reported skipped, saying so, and nothing else is checked here.
    let basebackup = pgelect_testkit::pg_bin_dir()
        .map(|d| d.join("pg_basebackup").is_file())
        .unwrap_or(false);
    if !basebackup {
        for row in &rows {
            assert_eq!(row["skipped"], 1, "{row}");
            let why = row["skipped_reason"].as_str().unwrap_or_default();
            assert!(why.contains("pg_basebackup"), "{row}");
        }
        println!("promote skipped here: no pg_basebackup beside this PostgreSQL");
        return;
    }
    let pooled = pgelect_testkit::pgbouncer_available();
    for row in &rows {
        assert_eq!(row["fault"], "promote", "{row}");
        assert_eq!(row["skipped"], 0, "{row}");
        assert_eq!(row["pooler"], pooled && row["backend"] == "lease", "{row}");
        let trials = row["trials"].as_u64().unwrap();
        assert!(trials >= 1, "{row}");
        for zero in ["overlaps", "stale_writes_committed", "lost_writes"] {
            assert_eq!(row[zero], 0, "{zero}: {row}");
        }
        assert_eq!(row["within_bound"], true, "{row}");
        // The promoted server acknowledged fenced writes again, also where
        // a lease leader kept its term (no new start to time).
        let resumed = row["writes_resumed_max_ms"].as_f64();
        assert!(
            resumed.is_some_and(|ms| ms <= row["bound_ms"].as_f64().unwrap()),
            "{row}"
        );
        if row["backend"] == "session" {
            // A session leader's lock dies with the server: a new term
            // every time.
            assert_eq!(row["failovers"].as_u64(), Some(trials), "{row}");
        }
        println!(
            "{} {}: {} trials, {} moved, p50 {} ms, max gap {} ms, writes again within {} ms (bound {} ms), {} unreplicated",
            row["fault"],
            row["backend"],
            trials,
            row["failovers"],
            row["failover_p50_ms"],
            row["max_gap_ms"],
            row["writes_resumed_max_ms"],
            row["bound_ms"],
            row["unreplicated_writes"]
        );
        // Terms from the workers' own logs, in the order they started.
        let backend = row["backend"].as_str().unwrap();
        let mut starts: Vec<(u128, i64)> =
            std::fs::read_dir(logs.join(format!("{backend}-promote")))
                .unwrap()
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
                .flat_map(|e| {
                    std::fs::read_to_string(e.path())
                        .unwrap()
                        .lines()
                        .filter_map(|l| {
                            let f: Vec<&str> = l.split_whitespace().collect();
                            match f[..] {
                                // The sixth field, the role, is the
                                // run's one role here.
                                ["start", _, term, at, _] | ["start", _, term, at, _, _] => {
                                    Some((at.parse().ok()?, term.parse().ok()?))
                                }
                                _ => None,
                            }
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
        starts.sort();
        assert!(!starts.is_empty(), "{backend}: no worker started");
        for w in starts.windows(2) {
            assert!(w[1].1 > w[0].1, "{backend}: terms did not rise: {starts:?}");
        }
        if backend == "session" {
            let last = starts.last().unwrap().1;
            assert!(
                last >= (trials as i64) << 32,
                "session: after {trials} promotion(s) the last term {last} is below 2^32 × {trials}: {starts:?}"
            );
        }
    }
    // The lease backend's part of the output: from its phase line to its
    // summary.
    let lease = r
        .stdout
        .split("  lease: candidates ")
        .nth(1)
        .and_then(|s| s.split("\nlease: ").next())
        .unwrap_or_else(|| panic!("no lease promote phase printed:\n{}", r.stdout));
    // Writes were acknowledged again after every promotion, each printed.
    let promotions = lease
        .lines()
        .filter(|l| l.starts_with("  promote   on c"))
        .collect::<Vec<_>>();
    let lease_row = rows.iter().find(|r| r["backend"] == "lease").unwrap();
    assert_eq!(
        promotions.len() as u64,
        lease_row["trials"].as_u64().unwrap(),
        "{lease}"
    );
    for l in &promotions {
        assert!(l.contains("; writes acknowledged again "), "{l}");
    }
    if !pooled {
        assert!(
            lease.starts_with("on ") && lease.contains("directly: PgBouncer is not installed"),
            "{lease}"
        );
    } else {
        assert!(
            lease.starts_with("through PgBouncer in transaction mode on 127.0.0.1:")
                && lease.contains(" in front of the primary address 127.0.0.1:"),
            "{lease}"
        );
        // Supervisors and workers went through it: PgBouncer's own
        // counters, at least one transaction per fenced write committed
        // in the phase (the supervisors' come on top).
        let (served, committed): (u64, u64) = lease
            .split("PgBouncer served ")
            .nth(1)
            .and_then(|s| {
                let n = s.split_whitespace().next()?.parse().ok()?;
                let c = s
                    .split(", where ")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()?;
                Some((n, c))
            })
            .unwrap_or_else(|| panic!("no PgBouncer count printed:\n{lease}"));
        println!("lease promote: PgBouncer served {served} transactions, {committed} fenced writes committed");
        assert!(committed > 0, "{lease}");
        assert!(
            served >= committed,
            "PgBouncer served {served} transactions, fewer than the {committed} fenced writes committed in the promote phase: the lease candidates went around it"
        );
    }
    // Two promotions per backend need a rebuilt replica: it was made.
    assert!(
        r.stdout.contains("a new replica of the primary"),
        "{}",
        r.stdout
    );
    assert_eq!(
        processes_under(&tmp),
        Vec::<String>::new(),
        "servers left running"
    );
    assert_eq!(
        processes_under(&logs),
        Vec::<String>::new(),
        "supervisors left running"
    );
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Against a database the user names there is no replica to promote:
/// `promote` is reported skipped with the reason, in the output and the
/// JSON, never silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_reports_promote_skipped_against_a_given_database() {
    let db = TestDb::new("chaos_promote_skip").await;
    let dir = TempDir::new("chaos_promote_skip");
    let json = dir.join("out.json");
    let r = run(
        chaos(
            &db,
            &[
                "--duration",
                "1s",
                "--seed",
                "33",
                "--faults",
                "promote",
                "--json",
                json.to_str().unwrap(),
            ],
        ),
        CHAOS,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(0);
    assert!(
        r.stdout
            .contains("promote skipped: promote needs a primary with a streaming replica"),
        "{}",
        r.stdout
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    assert_eq!(rows.len(), 2, "one fault × two backends: {rows:?}");
    for row in &rows {
        assert_eq!(row["fault"], "promote", "{row}");
        assert!(row["trials"].as_u64().unwrap() >= 1, "{row}");
        assert_eq!(row["skipped"], row["trials"], "{row}");
        assert!(
            row["skipped_reason"]
                .as_str()
                .is_some_and(|s| s.contains("run without --database-url")),
            "{row}"
        );
    }
}

/// Under a real HA manager (`--ha pg_auto_failover`: a formation chaos
/// starts): a switchover, a failover, a killed postmaster and a killed
/// node, once each per backend, and no violation; every fault's row says
/// how long the manager left no primary and when a leader wrote again.
/// Slow (about a minute): only with `PGELECT_HA_TESTS=1`; reported skipped
/// when pg_autoctl is not installed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_under_pg_auto_failover_finds_no_violation_after_each_managers_fault() {
    if std::env::var("PGELECT_HA_TESTS").map_or(true, |v| v != "1") {
        eprintln!("SKIPPED: slow; set PGELECT_HA_TESTS=1");
        return;
    }
    let dir = TempDir::new("chaos-ha");
    let json = dir.join("ha.json");
    let r = run(
        pgelect([
            "chaos",
            "--ha",
            "pg_auto_failover",
            "--every-fault",
            "--duration",
            "1s",
            "--seed",
            "36",
            "--faults",
            "switchover,failover,postmaster-kill,node-kill",
            "--json",
            json.to_str().unwrap(),
        ]),
        CHAOS * 3,
    )
    .await;
    println!("{}", r.stdout);
    r.assert_code(0);
    if r.stdout.contains("--ha pg_auto_failover: skipped: ") {
        eprintln!("SKIPPED: {}", r.stdout.lines().next().unwrap_or(""));
        return;
    }
    assert!(r.stdout.contains("no violation"), "{}", r.stdout);
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    assert_eq!(rows.len(), 8, "four faults, two backends: {rows:?}");
    for row in &rows {
        assert_eq!(row["trials"], 1, "{row}");
        assert_eq!(row["skipped"], 0, "{row}");
        assert_eq!(row["lost_writes"], 0, "{row}");
        assert_eq!(row["overlaps"], 0, "{row}");
        assert_eq!(row["within_bound"], true, "{row}");
        assert!(row["manager_outage_max_ms"].is_number(), "{row}");
        assert!(row["writes_resumed_max_ms"].is_number(), "{row}");
        // The leader's write again after the new primary's first: never
        // longer than the whole gap from the fault.
        let after = row["after_writable_max_ms"]
            .as_f64()
            .expect("after_writable_max_ms");
        assert!(
            after <= row["writes_resumed_max_ms"].as_f64().unwrap(),
            "{row}"
        );
    }
}
