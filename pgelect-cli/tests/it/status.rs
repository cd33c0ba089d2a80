//! `pgelect status`, `pgelect resign` and `pgelect demo` (the real binary)
//! against a real PostgreSQL, with real `pgelect run` candidates.
//!
//! The candidates' command writes `$D/term-<term>` holding its node when it
//! starts; tests await those files and rows in `pg_locks` in bounded
//! polling loops. Measured times are printed (`cargo test -- --nocapture`).

use crate::support;

use std::time::{Duration, Instant};

use pgelect_testkit::TestDb;
use support::{await_advisory_locks, pgelect, run, setup, wait_for_file, Background, TempDir};

const ROLE: &str = "r";
const START: Duration = Duration::from_secs(15);
const EXIT: Duration = Duration::from_secs(10);
const QUICK: Duration = Duration::from_secs(10);

/// Announces the term it runs under, then runs until SIGTERM.
const ANNOUNCE: &str = r#"trap 'exit 0' TERM
echo "$PGELECT_NODE" > "$D/t.$PGELECT_TERM"; mv "$D/t.$PGELECT_TERM" "$D/term-$PGELECT_TERM"
while :; do sleep 1 & wait $!; done"#;

fn candidate(db: &TestDb, dir: &TempDir, node: &str, extra: &[&str], script: &str) -> Background {
    let mut cmd = pgelect(["-v", "run", "--role", ROLE, "--id", node, "--ttl", "3s"]);
    cmd.args(extra)
        .args(["--database-url", &db.url(), "--", "sh", "-c", script])
        .env("D", dir.path());
    Background::spawn(node, cmd)
}

/// Waits for the command to start under `term`; returns the node running it.
async fn leader_of_term(dir: &TempDir, term: i64) -> String {
    let path = dir.join(&format!("term-{term}"));
    wait_for_file(&path, START).await;
    std::fs::read_to_string(path)
        .expect("read term file")
        .trim()
        .to_owned()
}

fn command(db: &TestDb, args: &[&str]) -> tokio::process::Command {
    let mut cmd = pgelect(args);
    cmd.args(["--database-url", &db.url()]);
    cmd
}

async fn stop(sups: &mut [Background]) {
    for s in sups.iter() {
        s.signal("TERM");
    }
    for s in sups.iter_mut() {
        let code = s.wait(EXIT).await;
        assert_eq!(code, Some(0), "{} after SIGTERM\n{}", s.name, s.output());
    }
}

#[tokio::test]
async fn status_shows_the_holder_and_the_waiting_candidate_as_a_table_and_as_json() {
    let (db, dir) = setup("status_two").await;
    let admin = db.connect().await;
    let mut sups = vec![candidate(&db, &dir, "node-a", &[], ANNOUNCE)];
    assert_eq!(leader_of_term(&dir, 1).await, "node-a");
    sups.push(candidate(&db, &dir, "node-b", &[], ANNOUNCE));
    await_advisory_locks(&admin, 1, 1).await;

    let table = run(command(&db, &["status"]), QUICK).await;
    table.assert_code(0);
    println!("{}", table.stdout);
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", table.stdout);
    assert!(lines[0].starts_with("server 127.0.0.1:"), "{}", lines[0]);
    let lines = &lines[1..];
    for column in [
        "ROLE",
        "LEADER",
        "TERM",
        "SINCE (UTC)",
        "LEASE LEFT",
        "CANDIDATES",
    ] {
        assert!(
            lines[0].contains(column),
            "no {column} column:\n{}",
            table.stdout
        );
    }
    let cells: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(&cells[..3], ["r", "node-a", "1"], "{}", lines[1]);
    assert_eq!(
        lines[0].find("LEADER"),
        lines[1].find("node-a"),
        "columns do not line up"
    );
    assert!(
        lines[1].contains("node-a (holding)") && lines[1].contains("node-b (waiting)"),
        "{}",
        lines[1]
    );
    // The leader is not counted among those standing by.
    assert!(
        lines[1].contains("node-a (holding); 1 standing by: node-b (waiting)"),
        "{}",
        lines[1]
    );

    let json = run(command(&db, &["status", "--json", "--role", ROLE]), QUICK).await;
    json.assert_code(0);
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("status --json is JSON");
    println!("{v}");
    let roles = v["roles"].as_array().expect("roles[]");
    assert_eq!(roles.len(), 1);
    let r = &roles[0];
    let mut keys: Vec<&str> = r
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "acquired_at",
            "backend",
            "candidates",
            "holder",
            "lease_expired",
            "lease_remaining_ms",
            "role",
            "squatters",
            "term"
        ]
    );
    assert_eq!(r["squatters"], serde_json::json!([]), "no squatter here");
    assert_eq!(r["role"], ROLE);
    assert_eq!(r["holder"], "node-a");
    assert_eq!(r["term"], 1);
    assert_eq!(r["lease_expired"], false);
    let left = r["lease_remaining_ms"]
        .as_i64()
        .expect("lease_remaining_ms");
    // Up to the TTL, plus slack: status's `now()` is its transaction start,
    // which can precede a renewal that commits before its snapshot.
    assert!(
        left > 0 && left <= 3500,
        "lease_remaining_ms {left} with ttl 3s"
    );
    let at = r["acquired_at"].as_str().expect("acquired_at");
    assert!(
        at.len() == 24 && at.ends_with('Z') && at.as_bytes()[10] == b'T',
        "acquired_at {at:?}"
    );
    let mut states: Vec<(String, String)> = r["candidates"]
        .as_array()
        .expect("candidates[]")
        .iter()
        .map(|c| {
            // The server's backend pid, named as such (was "pid").
            assert!(c["backend_pid"].as_i64().is_some_and(|p| p > 0), "{c}");
            (
                c["node"].as_str().expect("node").to_owned(),
                c["state"].as_str().expect("state").to_owned(),
            )
        })
        .collect();
    states.sort();
    assert_eq!(
        states,
        [
            ("node-a".into(), "holding".into()),
            ("node-b".into(), "waiting".into())
        ]
    );

    let other = run(
        command(&db, &["status", "--json", "--role", "other"]),
        QUICK,
    )
    .await;
    // An unknown role is an error naming the known ones (was
    // exit 0 with an empty list).
    other.assert_code(66);
    assert!(other.stdout.is_empty(), "{}", other.stdout);
    assert!(
        other.stderr.contains("known roles: \"r\""),
        "{}",
        other.stderr
    );
    stop(&mut sups).await;
}

/// `pgelect run --priority`: a candidate of higher priority that starts
/// standing takes over (the leader's command is stopped gracefully, then it
/// releases); `pgelect status` shows each candidate's priority, and
/// `--json` its priority and timing.
#[tokio::test]
async fn a_higher_priority_candidate_takes_over_and_status_shows_priorities() {
    let (db, dir) = setup("status_priority").await;
    let admin = db.connect().await;
    let mut sups = vec![candidate(&db, &dir, "node-a", &[], ANNOUNCE)];
    assert_eq!(leader_of_term(&dir, 1).await, "node-a");
    let t0 = Instant::now();
    sups.push(candidate(
        &db,
        &dir,
        "node-b",
        &["--priority", "5"],
        ANNOUNCE,
    ));
    assert_eq!(leader_of_term(&dir, 2).await, "node-b");
    println!(
        "node-b (priority 5) runs its command {:?} after it was started",
        t0.elapsed()
    );
    // node-a stands again, waiting behind the new leader.
    await_advisory_locks(&admin, 1, 1).await;

    let table = run(command(&db, &["status"]), QUICK).await;
    table.assert_code(0);
    println!("{}", table.stdout);
    assert!(
        table
            .stdout
            .contains("node-b (holding, priority 5); 1 standing by: node-a (waiting)"),
        "{}",
        table.stdout
    );
    let json = run(command(&db, &["status", "--json", "--role", ROLE]), QUICK).await;
    json.assert_code(0);
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("JSON");
    let candidates = v["roles"][0]["candidates"].as_array().expect("candidates");
    let mut seen: Vec<(String, i64, i64)> = candidates
        .iter()
        .map(|c| {
            (
                c["node"].as_str().unwrap().to_owned(),
                c["priority"].as_i64().expect("priority"),
                c["timing"]["ttl_ms"].as_i64().expect("timing.ttl_ms"),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [("node-a".into(), 0, 3000), ("node-b".into(), 5, 3000)],
        "{}",
        json.stdout
    );
    for c in candidates {
        let t = &c["timing"];
        for key in [
            "safety_margin_ms",
            "renew_every_ms",
            "heartbeat_ms",
            "heartbeat_timeout_ms",
            "handover_delay_ms",
        ] {
            assert!(t[key].as_i64().is_some(), "{key} in {t}");
        }
    }
    stop(&mut sups).await;
    let a = sups[0].output();
    assert!(
        a.contains("a candidate of higher priority is ready"),
        "node-a says why it stopped its command:\n{a}"
    );
    assert!(
        !a.contains("lost leadership"),
        "a planned handover, not a loss:\n{a}"
    );
    // Both withdrew from the registry when stopped.
    let left: i64 = admin
        .query_one("SELECT count(*) FROM pgelect.candidates", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

/// Lease-backend candidates hold no connection: status lists those
/// registered within their TTL, with priority and timing (and no backend
/// pid); a negative --priority is accepted.
#[tokio::test]
async fn status_lists_lease_candidates_from_the_registry() {
    let (db, dir) = setup("status_lease_prio").await;
    let lease = ["--backend", "lease", "--priority", "-1"];
    let mut sups = vec![candidate(&db, &dir, "lease-a", &lease, ANNOUNCE)];
    assert_eq!(leader_of_term(&dir, 1).await, "lease-a");
    sups.push(candidate(&db, &dir, "lease-b", &lease, ANNOUNCE));
    let t0 = Instant::now();
    let v = loop {
        let json = run(command(&db, &["status", "--json", "--role", ROLE]), QUICK).await;
        json.assert_code(0);
        let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("JSON");
        if v["roles"][0]["candidates"].as_array().map(Vec::len) == Some(2) {
            break v;
        }
        assert!(t0.elapsed() < QUICK, "{v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut seen: Vec<(String, String, i64, i64)> = v["roles"][0]["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert!(c["backend_pid"].is_null(), "{c}");
            (
                c["node"].as_str().unwrap().to_owned(),
                c["state"].as_str().unwrap().to_owned(),
                c["priority"].as_i64().unwrap(),
                c["timing"]["ttl_ms"].as_i64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("lease-a".into(), "holding".into(), -1, 3000),
            ("lease-b".into(), "standing".into(), -1, 3000)
        ]
    );
    let table = run(command(&db, &["status"]), QUICK).await;
    assert!(
        table.stdout.contains(
            "lease-a (holding, priority -1); 1 standing by: lease-b (standing, priority -1)"
        ),
        "{}",
        table.stdout
    );
    stop(&mut sups).await;
}

#[tokio::test]
async fn status_watch_prints_a_snapshot_per_change_and_shows_the_new_leader_after_a_resign() {
    let (db, dir) = setup("status_watch").await;
    let admin = db.connect().await;
    let mut sups = vec![candidate(&db, &dir, "node-a", &[], ANNOUNCE)];
    assert_eq!(leader_of_term(&dir, 1).await, "node-a");
    sups.push(candidate(&db, &dir, "node-b", &[], ANNOUNCE));
    await_advisory_locks(&admin, 1, 1).await;

    // Standard output is a pipe: no terminal redraws, one line per snapshot.
    let mut watch = Background::spawn(
        "watch",
        command(&db, &["status", "--watch", "--json", "--role", ROLE]),
    );
    let parse = |line: &str| -> serde_json::Value {
        serde_json::from_str(line).expect("a JSON snapshot per line")
    };
    let first = parse(&watch.next_line("the first snapshot", QUICK, |_| true).await);
    assert_eq!(first["roles"][0]["holder"], "node-a", "{first}");
    // Nothing changes (only the lease counts down): nothing is printed.
    let quiet = tokio::time::timeout(
        Duration::from_millis(2500),
        watch.next_line("no line", Duration::from_secs(3), |_| true),
    )
    .await;
    assert!(
        quiet.is_err(),
        "printed a snapshot with nothing changed: {quiet:?}"
    );

    let asked = Instant::now();
    run(command(&db, &["resign", "--role", ROLE]), QUICK)
        .await
        .assert_code(0);
    let line = watch
        .next_line("a snapshot naming node-b", QUICK, |l| {
            parse(l)["roles"][0]["holder"] == "node-b"
        })
        .await;
    println!(
        "watch showed the new leader {:?} after the resign: {line}",
        asked.elapsed()
    );
    assert_eq!(parse(&line)["roles"][0]["term"], 2);

    watch.signal("TERM");
    assert_eq!(watch.wait(EXIT).await, Some(0), "{}", watch.output());
    stop(&mut sups).await;
}

#[tokio::test]
async fn resign_hands_over_to_the_standby_and_prints_the_new_term() {
    let (db, dir) = setup("resign_handover").await;
    let admin = db.connect().await;
    let mut sups = vec![candidate(&db, &dir, "node-a", &[], ANNOUNCE)];
    assert_eq!(leader_of_term(&dir, 1).await, "node-a");
    sups.push(candidate(&db, &dir, "node-b", &[], ANNOUNCE));
    await_advisory_locks(&admin, 1, 1).await;

    let out = run(command(&db, &["resign", "--role", ROLE]), QUICK).await;
    println!(
        "resign: exit {:?} after {:?}\n{}",
        out.code, out.elapsed, out.stdout
    );
    out.assert_code(0);
    assert!(
        out.stdout.contains("asked node-a (term 1)"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("now led by node-b with term 2"),
        "{}",
        out.stdout
    );
    assert_eq!(leader_of_term(&dir, 2).await, "node-b");
    assert!(
        out.elapsed < Duration::from_secs(3),
        "took {:?}",
        out.elapsed
    );
    stop(&mut sups).await;
}

#[tokio::test]
async fn resign_of_a_role_nobody_has_led_fails_and_says_so() {
    let (db, _dir) = setup("resign_nobody").await;
    // A typo must not pass for success (was exit 0, "has no leader").
    for role in ["never-led", ROLE] {
        let out = run(command(&db, &["resign", "--role", role]), QUICK).await;
        out.assert_code(66);
        assert!(
            out.stderr
                .contains("nobody leads, stands for or has led it"),
            "{}",
            out.stderr
        );
    }
    let empty = run(command(&db, &["resign", "--role", ""]), QUICK).await;
    empty.assert_code(64);
    assert!(empty.stderr.contains("--role is empty"), "{}", empty.stderr);
}

/// Alone, a resigning leader stands again and wins a new term at once.
#[tokio::test]
async fn resign_without_a_standby_sees_the_same_node_reelected() {
    let (db, dir) = setup("resign_alone").await;
    let mut sups = vec![candidate(&db, &dir, "node-a", &[], ANNOUNCE)];
    assert_eq!(leader_of_term(&dir, 1).await, "node-a");
    let out = run(
        command(&db, &["resign", "--role", ROLE, "--timeout", "5s"]),
        QUICK,
    )
    .await;
    println!(
        "resign, no standby: exit {:?} after {:?}\n{}",
        out.code, out.elapsed, out.stdout
    );
    out.assert_code(0);
    assert!(
        out.stdout.contains("now led by node-a with term 2"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("re-elected"), "{}", out.stdout);
    assert_eq!(leader_of_term(&dir, 2).await, "node-a");
    stop(&mut sups).await;
}

/// A leader whose command takes longer than `--timeout` to stop: 75.
#[tokio::test]
async fn resign_exits_75_when_no_new_term_comes_within_the_timeout() {
    let (db, dir) = setup("resign_timeout").await;
    let stubborn = r#"trap '' TERM
echo "$PGELECT_NODE" > "$D/t.$PGELECT_TERM"; mv "$D/t.$PGELECT_TERM" "$D/term-$PGELECT_TERM"
exec sleep 30"#;
    let mut sups = vec![candidate(
        &db,
        &dir,
        "node-a",
        &["--grace", "1500ms"],
        stubborn,
    )];
    assert_eq!(leader_of_term(&dir, 1).await, "node-a");
    let out = run(
        command(&db, &["resign", "--role", ROLE, "--timeout", "300ms"]),
        QUICK,
    )
    .await;
    println!(
        "resign --timeout 300ms: exit {:?} after {:?}\n{}{}",
        out.code, out.elapsed, out.stdout, out.stderr
    );
    out.assert_code(75);
    assert!(
        out.elapsed >= Duration::from_millis(300) && out.elapsed < Duration::from_secs(3),
        "took {:?}",
        out.elapsed
    );
    assert!(out.stderr.contains("no new term"), "{}", out.stderr);
    // The leader still steps down, after its grace.
    assert_eq!(leader_of_term(&dir, 2).await, "node-a");
    stop(&mut sups).await;
}

#[cfg(feature = "throwaway")] // the demo's own server needs the feature
#[tokio::test]
async fn demo_completes_and_leaves_no_server_behind() {
    let out = run(pgelect(["demo"]), Duration::from_secs(120)).await;
    println!(
        "demo: exit {:?} after {:?}\n{}{}",
        out.code, out.elapsed, out.stdout, out.stderr
    );
    out.assert_code(0);
    for needle in [
        "leads with term 1",
        "after the kill",
        "is refused",
        "after the request",
        "Done.",
    ] {
        assert!(out.stdout.contains(needle), "demo output lacks {needle:?}");
    }
    let data = out
        .stdout
        .split_once("(data in ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(path, _)| std::path::PathBuf::from(path))
        .expect("the demo prints its data directory");
    assert!(!data.exists(), "{} is still there", data.display());
    let needle = data.display().to_string();
    let leftovers: Vec<String> = std::fs::read_dir("/proc")
        .expect("read /proc")
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&needle))
        .collect();
    assert!(
        leftovers.is_empty(),
        "processes of the demo's server left: {leftovers:?}"
    );
}

/// One HTTP/1.1 GET on `port`; returns the status code and the body.
async fn http_get(port: u16, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream =
        tokio::time::timeout(QUICK, tokio::net::TcpStream::connect(("127.0.0.1", port)))
            .await
            .expect("connect in time")
            .expect("the metrics listener accepts");
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = String::new();
    tokio::time::timeout(QUICK, stream.read_to_string(&mut raw))
        .await
        .expect("answer in time")
        .unwrap();
    let code = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {raw:?}"));
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

#[tokio::test]
async fn metrics_addr_serves_metrics_health_and_the_leader() {
    let (db, dir) = setup("status_http").await;
    let admin = db.connect().await;
    let (pa, pb) = (pgelect_testkit::free_port(), pgelect_testkit::free_port());
    let addr_a = format!("127.0.0.1:{pa}");
    let addr_b = format!("127.0.0.1:{pb}");
    let mut sups = vec![candidate(
        &db,
        &dir,
        "node-a",
        &["--metrics-addr", &addr_a],
        ANNOUNCE,
    )];
    assert_eq!(leader_of_term(&dir, 1).await, "node-a");
    sups.push(candidate(
        &db,
        &dir,
        "node-b",
        &["--metrics-addr", &addr_b],
        ANNOUNCE,
    ));
    await_advisory_locks(&admin, 1, 1).await;

    let (code, body) = http_get(pa, "/healthz").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("leading with term 1"), "{body}");
    let (code, body) = http_get(pb, "/healthz").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("standing by"), "{body}");

    let (code, body) = http_get(pa, "/metrics").await;
    assert_eq!(code, 200);
    assert!(body.contains("pgelect_is_leader{role=\"r\"} 1"), "{body}");
    assert!(body.contains("pgelect_term{role=\"r\"} 1"), "{body}");

    let (code, body) = http_get(pa, "/leader").await;
    assert_eq!(code, 200);
    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(json["is_leader"], true, "{json}");
    assert_eq!(json["term"], 1, "{json}");
    // The standby's view comes from its observer, which follows the row.
    support::wait_until("the standby's /leader to name node-a", QUICK, || async {
        let (_, body) = http_get(pb, "/leader").await;
        let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        json["is_leader"] == false && json["leader"]["holder"] == "node-a"
    })
    .await;
    assert_eq!(http_get(pa, "/nope").await.0, 404);
    stop(&mut sups).await;
}

/// With several hosts, `status` says which server it read (the one the
/// candidates it lists are connected to): its address, primary or standby,
/// the WAL timeline; after a promotion, the new primary on timeline 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_the_server_it_read_and_follows_a_promotion() {
    use pgelect_testkit::{ReplicaSet, Replication, SUPERUSER, TEST_PASSWORD};
    let set = match tokio::task::block_in_place(|| ReplicaSet::start(Replication::Async)) {
        Ok(set) => set,
        // The npm builds of other PostgreSQL versions (scripts/fetch-pg.sh)
        // ship no pg_basebackup; the system's server (the main run) does.
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                && std::env::var_os("PGELECT_PG_BIN").is_some() =>
        {
            eprintln!("skipped: no replica with these server binaries: {e}");
            return;
        }
        Err(e) => panic!("primary and replica: {e}"),
    };
    let url = format!(
        "postgres://{SUPERUSER}:{TEST_PASSWORD}@127.0.0.1:{},127.0.0.1:{}/postgres\
         ?target_session_attrs=read-write&connect_timeout=2",
        set.replica().port(),
        set.primary().port()
    );
    let o = pgelect::ConnectOptions::from_url(&url).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let status = |json: bool| {
        let mut cmd = pgelect(["status", "--database-url", &url]);
        if json {
            cmd.arg("--json");
        }
        cmd
    };
    let r = run(status(true), QUICK).await;
    r.assert_code(0);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("json");
    assert_eq!(
        v["server"]["addr"],
        format!("127.0.0.1:{}", set.primary().port()),
        "{v}"
    );
    assert_eq!(v["server"]["kind"], "primary");
    assert_eq!(v["server"]["timeline"], 1);
    let r = run(status(false), QUICK).await;
    r.assert_code(0);
    let first = r.stdout.lines().next().unwrap_or_default().to_owned();
    assert!(
        first.starts_with(&format!(
            "server 127.0.0.1:{} (primary, timeline 1, PostgreSQL ",
            set.primary().port()
        )),
        "{first}"
    );
    tokio::task::block_in_place(|| set.promote()).expect("promote");
    let r = run(status(true), QUICK).await;
    r.assert_code(0);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("json");
    assert_eq!(
        v["server"]["addr"],
        format!("127.0.0.1:{}", set.replica().port()),
        "{v}"
    );
    assert_eq!(v["server"]["timeline"], 2, "{v}");
}
