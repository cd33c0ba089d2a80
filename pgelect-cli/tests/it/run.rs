//! `pgelect run` (the real binary) against a real PostgreSQL: the command
//! runs on one node at a time when a supervisor is SIGKILLed, SIGTERMed, cut
//! off or partitioned, or the database restarts; its environment; the
//! `--on-exit` policies; bad input.
//!
//! Every test gets its own database with the schema installed and its own
//! directory `$D`. The supervised commands are `sh -c` scripts that log
//! `start <node> <term> <unix ns> <pid>` to `$D/log` when they begin (and
//! `stop …` when SIGTERM ends them), and keep `$D/held/<pid>` while they run.
//! A [`Detector`] thread looks at `held/` every 2 ms and records any moment
//! at which two of those pids are alive; a SIGKILLed command cannot remove
//! its file, which is why liveness, not the file, counts. The command also
//! checks at its own start that no other holder is alive. At the end the
//! acting intervals from the log (ends: the `stop` line, or the detector's
//! first sight of the pid dead) must not overlap and terms must rise.
//!
//! Waits are bounded polls on those files, on `pg_locks`, or on process
//! exit; measured times are printed (`cargo test -- --nocapture`).

use crate::support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgelect_testkit::{Cluster, FaultProxy, TestDb, TEST_PASSWORD};
use support::{
    await_advisory_locks, migrate, pgelect, process_alive, run, unix_ns, wait_until, Background,
    TempDir,
};

const ROLE: &str = "r";
/// Bound on a command starting: connect, campaign, handover delay, spawn.
const START: Duration = Duration::from_secs(15);
/// Bound on a supervisor exiting after SIGTERM or by itself.
const EXIT: Duration = Duration::from_secs(10);
/// Bound for runs that must fail fast.
const QUICK: Duration = Duration::from_secs(10);

/// The supervised command of the overlap tests (see the module docs).
const DUTY: &str = r#"
trap 'echo "stop $PGELECT_NODE $PGELECT_TERM $(date +%s%N) $$" >> "$D/log"; rm -f "$D/held/$$"; exit 0' TERM
now=$(date +%s%N)
for f in "$D"/held/*; do
  [ -e "$f" ] || continue
  p=${f##*/}
  st=$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | cut -c1)
  case "$st" in ''|Z|X) ;; *) echo "overlap: $$ started while $p ($st) held" >> "$D/violations";; esac
done
: > "$D/held/$$"
echo "start $PGELECT_NODE $PGELECT_TERM $now $$" >> "$D/log"
while :; do sleep 1 & wait $!; done
"#;

/// A fresh database with the schema installed, and a directory with `held/`.
async fn setup(hint: &str) -> (TestDb, TempDir) {
    let db = TestDb::new(hint).await;
    migrate(&db.url()).await;
    let dir = TempDir::new(hint);
    std::fs::create_dir(dir.join("held")).expect("create held/");
    (db, dir)
}

/// The URL of `db` through `proxy`.
fn url_via(db: &TestDb, proxy: &FaultProxy) -> String {
    format!(
        "postgres://postgres:{TEST_PASSWORD}@127.0.0.1:{}/{}",
        proxy.port(),
        db.name()
    )
}

/// `pgelect -v run --role r --id NODE EXTRA… -- sh -c SCRIPT` on `url`.
fn supervisor(url: &str, dir: &TempDir, node: &str, extra: &[&str], script: &str) -> Background {
    let mut cmd = pgelect(["-v", "run", "--role", ROLE, "--id", node]);
    cmd.args(extra)
        .args(["--database-url", url, "--", "sh", "-c", script])
        .env("D", dir.path());
    Background::spawn(node, cmd)
}

/// `pgelect status --json --role r` on `url`, parsed.
async fn status_json(url: &str) -> serde_json::Value {
    let mut cmd = pgelect(["status", "--json", "--role", ROLE, "--database-url", url]);
    cmd.env("D", "/nonexistent");
    let out = run(cmd, QUICK).await;
    out.assert_code(0);
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json: {e}\n{}", out.stdout))
}

/// One `start` or `stop` line of `$D/log`.
#[derive(Clone, Debug, PartialEq)]
struct Event {
    what: String,
    node: String,
    term: i64,
    at_ns: u128,
    pid: u32,
}

fn events(dir: &TempDir) -> Vec<Event> {
    let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
    log.lines()
        .filter(|l| l.ends_with(|c: char| c.is_ascii_digit()))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 5, "bad log line {l:?}");
            Event {
                what: f[0].to_owned(),
                node: f[1].to_owned(),
                term: f[2].parse().expect("term"),
                at_ns: f[3].parse().expect("ns"),
                pid: f[4].parse().expect("pid"),
            }
        })
        .collect()
}

fn starts(dir: &TempDir) -> Vec<Event> {
    events(dir)
        .into_iter()
        .filter(|e| e.what == "start")
        .collect()
}

/// Waits for the `n`th (1-based) start of the command and returns it.
async fn nth_start(dir: &TempDir, n: usize, limit: Duration) -> Event {
    let what = format!("start number {n} of the command");
    wait_until(&what, limit, || async { starts(dir).len() >= n }).await;
    starts(dir)[n - 1].clone()
}

fn ms_between(from_ns: u128, to_ns: u128) -> f64 {
    (to_ns as f64 - from_ns as f64) / 1e6
}

/// Watches `held/` every 2 ms from its own thread (independent of the test's
/// runtime and of blocking calls in the test).
struct Detector {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Sightings>>,
}

#[derive(Debug, Default)]
struct Sightings {
    samples: u64,
    /// Moments at which more than one holder was alive.
    overlaps: Vec<String>,
    /// When each pid was first seen dead (unix ns).
    dead_at: HashMap<u32, u128>,
}

impl Detector {
    fn start(held: PathBuf) -> Detector {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut s = Sightings::default();
            while !flag.load(Ordering::Relaxed) {
                let now = unix_ns();
                let mut live = Vec::new();
                for entry in std::fs::read_dir(&held).into_iter().flatten().flatten() {
                    let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                        continue;
                    };
                    if process_alive(pid) {
                        live.push(pid);
                    } else {
                        s.dead_at.entry(pid).or_insert(now);
                    }
                }
                if live.len() > 1 {
                    s.overlaps.push(format!("at {now}: live holders {live:?}"));
                }
                s.samples += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            s
        });
        Detector {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling; checks the samples, the command's own check and the
    /// intervals in the log. Call once every command has ended.
    fn finish(mut self, dir: &TempDir) {
        // One last sample after the commands ended, so every pid has a death.
        std::thread::sleep(Duration::from_millis(10));
        self.stop.store(true, Ordering::Relaxed);
        let s = self.thread.take().expect("once").join().expect("detector");
        println!("detector: {} samples", s.samples);
        assert!(
            s.overlaps.is_empty(),
            "two commands alive at once: {:?}",
            s.overlaps
        );
        let violations = std::fs::read_to_string(dir.join("violations")).unwrap_or_default();
        assert!(violations.is_empty(), "{violations}");
        check_intervals(&events(dir), &s.dead_at);
    }
}

impl Drop for Detector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Acting intervals, in start order, must not overlap, and terms must rise.
fn check_intervals(events: &[Event], dead_at: &HashMap<u32, u128>) {
    let mut starts: Vec<&Event> = events.iter().filter(|e| e.what == "start").collect();
    starts.sort_by_key(|e| e.at_ns);
    for pair in starts.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let end = events
            .iter()
            .find(|e| e.what == "stop" && e.pid == a.pid)
            .map(|e| e.at_ns)
            .or_else(|| dead_at.get(&a.pid).copied())
            .unwrap_or_else(|| panic!("no end seen for {a:?}"));
        println!(
            "{} (term {}) acted for {:.1} ms; {} (term {}) began {:.1} ms after that",
            a.node,
            a.term,
            ms_between(a.at_ns, end),
            b.node,
            b.term,
            ms_between(end, b.at_ns)
        );
        assert!(
            end <= b.at_ns,
            "{a:?} still acted (until {end}) when {b:?} began"
        );
        assert!(b.term > a.term, "terms did not rise: {a:?} then {b:?}");
    }
}

/// SIGKILLs the leading supervisor of three started with `timing`, twice;
/// returns the milliseconds from each kill until the successor's command
/// started. No two commands ever run at once.
async fn crash_failovers(hint: &str, timing: &[&str]) -> Vec<f64> {
    let (db, dir) = setup(hint).await;
    let admin = db.connect().await;
    let detector = Detector::start(dir.join("held"));
    let mut sups: Vec<Background> = ["a", "b", "c"]
        .iter()
        .map(|n| supervisor(&db.url(), &dir, n, timing, DUTY))
        .collect();
    let mut took = Vec::new();
    nth_start(&dir, 1, START).await;
    for standing in [3, 2] {
        // Settled: one holder, the others waiting. (Under load the fast
        // profile may hand over by itself; the latest start is the leader.)
        await_advisory_locks(&admin, 1, standing - 1).await;
        let leader = starts(&dir).pop().expect("a start");
        let killed_ns = unix_ns();
        find(&mut sups, &leader.node).kill().await;
        let what = "a start after the kill";
        wait_until(what, START, || async {
            starts(&dir).iter().any(|e| e.at_ns > killed_ns)
        })
        .await;
        let next = starts(&dir)
            .into_iter()
            .find(|e| e.at_ns > killed_ns)
            .expect("seen");
        assert_ne!(next.node, leader.node);
        assert!(next.term > leader.term, "{leader:?} then {next:?}");
        took.push(ms_between(killed_ns, next.at_ns));
        sups.retain(|s| s.name != leader.node);
    }
    let last = starts(&dir).pop().expect("a start");
    stop_all(&mut sups).await;
    await_death("the last command", last.pid, Duration::from_secs(3)).await;
    detector.finish(&dir);
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_ttl_or_the_fast_profile_shortens_crash_failover_without_overlap() {
    // Before the timing followed the TTL, `--ttl 2s` waited a 2.1 s handover
    // delay after a crash; now 399 ms (fast: 70 ms). The bound is generous
    // and applies to the quicker of two failovers: on a loaded machine a
    // fast-profile successor may lose its first term to a late heartbeat
    // (safely) and take longer. The benchmark measures the real figures.
    for (timing, hint, bound_ms) in [
        (&["--ttl", "2s"][..], "run_crash_ttl2", 1_800.0),
        (
            &["--ttl", "2s", "--profile", "fast"][..],
            "run_crash_fast",
            1_000.0,
        ),
    ] {
        let took = crash_failovers(hint, timing).await;
        println!("{timing:?}: SIGKILL of the leader's supervisor -> successor's command started after {took:.1?} ms");
        let quickest = took.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(quickest < bound_ms, "{timing:?}: {took:.0?} ms");
    }
}

/// Waits for the process `pid` to die; returns when it was seen dead.
async fn await_death(what: &str, pid: u32, limit: Duration) -> u128 {
    wait_until(what, limit, || async { !process_alive(pid) }).await;
    unix_ns()
}

fn find<'a>(sups: &'a mut [Background], node: &str) -> &'a mut Background {
    sups.iter_mut()
        .find(|s| s.name == node)
        .unwrap_or_else(|| panic!("no supervisor {node}"))
}

/// SIGTERM every supervisor still running; each must exit 0.
async fn stop_all(sups: &mut [Background]) {
    for s in sups.iter() {
        s.signal("TERM");
    }
    for s in sups.iter_mut() {
        let code = s.wait(EXIT).await;
        assert_eq!(code, Some(0), "{} after SIGTERM\n{}", s.name, s.output());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_then_sigterm_of_the_leaders_supervisor_never_runs_two_commands() {
    let (db, dir) = setup("run_kill_term").await;
    let admin = db.connect().await;
    let detector = Detector::start(dir.join("held"));
    let mut sups: Vec<Background> = ["a", "b", "c"]
        .iter()
        .map(|n| supervisor(&db.url(), &dir, n, &["--ttl", "3s"], DUTY))
        .collect();
    let first = nth_start(&dir, 1, START).await;
    await_advisory_locks(&admin, 1, 2).await;

    // A crash: the supervisor gets no chance to clean up; the command dies
    // with it (PR_SET_PDEATHSIG, the group watcher).
    let killed_ns = unix_ns();
    find(&mut sups, &first.node).kill().await;
    let dead_ns = await_death(
        "the old command to die with its supervisor",
        first.pid,
        Duration::from_secs(3),
    )
    .await;
    let second = nth_start(&dir, 2, START).await;
    println!(
        "SIGKILL of {}'s supervisor: its command gone within {:.1} ms; {} leads with term {} (command started {:.0} ms after the kill)",
        first.node,
        ms_between(killed_ns, dead_ns),
        second.node,
        second.term,
        ms_between(killed_ns, second.at_ns)
    );
    assert_ne!(second.node, first.node);
    assert!(second.term > first.term, "{first:?} then {second:?}");
    assert!(
        second.at_ns > dead_ns,
        "new command before the old one was seen dead"
    );

    // A planned stop: SIGTERM to the command, exit 0, a standby at once.
    await_advisory_locks(&admin, 1, 1).await;
    let termed_ns = unix_ns();
    let leader = find(&mut sups, &second.node);
    leader.signal("TERM");
    let code = leader.wait(EXIT).await;
    assert_eq!(code, Some(0), "{}", leader.output());
    let third = nth_start(&dir, 3, START).await;
    let stop = events(&dir)
        .into_iter()
        .find(|e| e.what == "stop" && e.pid == second.pid)
        .expect("the command logged its SIGTERM");
    let takeover = ms_between(stop.at_ns, third.at_ns);
    println!(
        "SIGTERM of {}'s supervisor: command stopped {:.1} ms after the signal; {} leads with term {} {takeover:.1} ms after that",
        second.node,
        ms_between(termed_ns, stop.at_ns),
        third.node,
        third.term
    );
    assert!(third.term > second.term);
    // A clean release is taken over without the handover delay (2.5 s here).
    assert!(
        takeover < 1500.0,
        "takeover after a clean release took {takeover:.0} ms"
    );

    sups.retain(|s| s.name != first.node && s.name != second.node);
    stop_all(&mut sups).await;
    await_death("the last command", third.pid, Duration::from_secs(3)).await;
    detector.finish(&dir);
}

/// Starts a leader `p` whose connection goes through `proxy` and a direct
/// standby `s`; returns them with `p`'s start.
async fn proxied_leader_and_standby(
    db: &TestDb,
    dir: &TempDir,
    proxy: &FaultProxy,
) -> (Vec<Background>, Event) {
    let admin = db.connect().await;
    let p = supervisor(&url_via(db, proxy), dir, "p", &["--ttl", "3s"], DUTY);
    let first = nth_start(dir, 1, START).await;
    assert_eq!(first.node, "p");
    let s = supervisor(&db.url(), dir, "s", &["--ttl", "3s"], DUTY);
    await_advisory_locks(&admin, 1, 1).await;
    (vec![p, s], first)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_kills_the_command_at_once_and_a_standby_takes_over() {
    let (db, dir) = setup("run_cut").await;
    let proxy = FaultProxy::start(db.server_addr()).expect("start the fault proxy");
    let detector = Detector::start(dir.join("held"));
    let (mut sups, first) = proxied_leader_and_standby(&db, &dir, &proxy).await;

    let cut_ns = unix_ns();
    proxy.cut();
    let dead_ns = await_death(
        "the leader's command to be killed",
        first.pid,
        Duration::from_secs(3),
    )
    .await;
    let killed_ms = ms_between(cut_ns, dead_ns);
    let second = nth_start(&dir, 2, START).await;
    println!(
        "connection cut: p's command killed within {killed_ms:.1} ms; {} leads with term {} {:.0} ms after the cut",
        second.node,
        second.term,
        ms_between(cut_ns, second.at_ns)
    );
    // "At once": the reset is seen by the connection task, not by a timer.
    assert!(killed_ms < 1000.0, "killed {killed_ms:.0} ms after the cut");
    assert_eq!(second.node, "s");
    assert!(second.term > first.term);

    stop_all(&mut sups).await;
    await_death("the last command", second.pid, Duration::from_secs(3)).await;
    detector.finish(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leader_kills_its_command_before_its_lease_ends() {
    let (db, dir) = setup("run_blackhole").await;
    let proxy = FaultProxy::start(db.server_addr()).expect("start the fault proxy");
    let detector = Detector::start(dir.join("held"));
    let (mut sups, first) = proxied_leader_and_standby(&db, &dir, &proxy).await;

    let partitioned = Instant::now();
    let partitioned_ns = unix_ns();
    proxy.blackhole();
    let dead_ns = await_death(
        "the partitioned leader's command to be killed",
        first.pid,
        Duration::from_secs(6),
    )
    .await;
    let killed_after = partitioned.elapsed();
    let second = nth_start(&dir, 2, Duration::from_secs(20)).await;
    println!(
        "partition: p's command killed {killed_after:?} after it began (ttl 3s); {} leads with term {} {:.0} ms after the partition, {:.0} ms after p's command died",
        second.node,
        second.term,
        ms_between(partitioned_ns, second.at_ns),
        ms_between(dead_ns, second.at_ns)
    );
    // Why the supervisor gave up (heartbeat timeout or local deadline).
    let p = &sups[0];
    wait_until("p to log its loss", Duration::from_secs(2), || async {
        p.output().contains("leadership lost")
    })
    .await;
    let output = p.output();
    let why = output
        .lines()
        .find(|l| l.contains("leadership lost"))
        .expect("checked");
    println!("p logged: {why}");
    // Its last renewal was sent before the partition: the lease on the server
    // ends within the TTL, and the leader must have stopped by then.
    assert!(
        killed_after < Duration::from_secs(3),
        "killed after {killed_after:?}"
    );
    assert_eq!(second.node, "s");
    assert!(second.term > first.term);
    assert!(second.at_ns > dead_ns);

    // p is still partitioned, standing again; SIGTERM ends it at once.
    stop_all(&mut sups).await;
    await_death("the last command", second.pid, Duration::from_secs(3)).await;
    detector.finish(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_kills_the_command_and_a_leader_returns_with_a_higher_term() {
    if pgelect_testkit::skip_without_own_server("cli database restart") {
        return;
    }
    let cluster = tokio::task::spawn_blocking(Cluster::start)
        .await
        .expect("join")
        .expect("start a private cluster");
    let db = TestDb::on(&cluster, "run_restart").await;
    migrate(&db.url()).await;
    let dir = TempDir::new("run_restart");
    std::fs::create_dir(dir.join("held")).expect("create held/");
    let detector = Detector::start(dir.join("held"));
    let mut sups: Vec<Background> = ["a", "b"]
        .iter()
        .map(|n| supervisor(&db.url(), &dir, n, &["--ttl", "3s"], DUTY))
        .collect();
    let first = nth_start(&dir, 1, START).await;

    let restarting = Instant::now();
    let cluster = Arc::new(cluster);
    let c = cluster.clone();
    let restart = tokio::task::spawn_blocking(move || c.restart());
    let dead_ns = await_death(
        "the command to be killed by the restart",
        first.pid,
        Duration::from_secs(10),
    )
    .await;
    println!(
        "database restart: the command was killed {:?} after the restart began",
        restarting.elapsed()
    );
    restart.await.expect("join").expect("restart the cluster");
    let restarted = restarting.elapsed();
    let second = nth_start(&dir, 2, Duration::from_secs(30)).await;
    println!(
        "database restart took {restarted:?}; {} leads with term {} {:.0} ms after the old command died",
        second.node,
        second.term,
        ms_between(dead_ns, second.at_ns)
    );
    assert!(second.term > first.term, "{first:?} then {second:?}");

    stop_all(&mut sups).await;
    await_death("the last command", second.pid, Duration::from_secs(3)).await;
    detector.finish(&dir);
}

#[tokio::test]
async fn the_command_sees_its_role_node_and_the_term_status_shows() {
    let (db, dir) = setup("run_env").await;
    let script = r#"printf '%s|%s|%s\n' "$PGELECT_ROLE" "$PGELECT_NODE" "$PGELECT_TERM" > "$D/env.tmp"
mv "$D/env.tmp" "$D/env"; exec sleep 30"#;
    // No --id: the default node id must be what the command and status see.
    let mut cmd = pgelect([
        "run",
        "--role",
        ROLE,
        "--database-url",
        &db.url(),
        "--",
        "sh",
        "-c",
        script,
    ]);
    cmd.env("D", dir.path());
    let mut sup = Background::spawn("default-id", cmd);
    support::wait_for_file(&dir.join("env"), START).await;
    let env = std::fs::read_to_string(dir.join("env")).expect("read env");
    let [role, node, term]: [&str; 3] = env
        .trim_end()
        .split('|')
        .collect::<Vec<_>>()
        .try_into()
        .unwrap_or_else(|_| panic!("env file {env:?}"));
    let status = status_json(&db.url()).await;
    let r = &status["roles"][0];
    println!("command env: role={role} node={node} term={term}; status: {r}");
    assert_eq!(role, ROLE);
    assert!(!node.is_empty());
    assert_eq!(r["holder"], node);
    assert_eq!(
        r["term"].as_i64().map(|t| t.to_string()).as_deref(),
        Some(term)
    );

    sup.signal("TERM");
    assert_eq!(sup.wait(EXIT).await, Some(0), "{}", sup.output());
}

#[tokio::test]
async fn on_exit_exit_returns_the_commands_code_and_releases() {
    let (db, dir) = setup("run_on_exit_exit").await;
    let mut cmd = pgelect([
        "run",
        "--role",
        ROLE,
        "--on-exit",
        "exit",
        "--database-url",
        &db.url(),
        "--",
        "sh",
        "-c",
        "exit 7",
    ]);
    cmd.env("D", dir.path());
    let out = run(cmd, START).await;
    out.assert_code(7);
    let status = status_json(&db.url()).await;
    println!("after --on-exit exit: {status}");
    assert_eq!(
        status["roles"][0]["holder"],
        serde_json::Value::Null,
        "{status}"
    );
    assert!(status["roles"][0]["term"].as_i64() >= Some(1));
}

/// Runs the command three times under `policy`; returns `(term, pid)` per run.
async fn three_runs(hint: &str, policy: &str) -> Vec<(i64, u32)> {
    let (db, dir) = setup(hint).await;
    let script = r#"echo "$PGELECT_TERM $$" >> "$D/runs"
if [ "$(wc -l < "$D/runs")" -ge 3 ]; then : > "$D/third"; exec sleep 30; fi
exit 0"#;
    let started = Instant::now();
    let mut sup = supervisor(
        &db.url(),
        &dir,
        "a",
        &["--ttl", "3s", "--on-exit", policy],
        script,
    );
    support::wait_for_file(&dir.join("third"), START).await;
    println!("--on-exit {policy}: three runs in {:?}", started.elapsed());
    sup.signal("TERM");
    assert_eq!(sup.wait(EXIT).await, Some(0), "{}", sup.output());
    std::fs::read_to_string(dir.join("runs"))
        .expect("read runs")
        .lines()
        .map(|l| {
            let (term, pid) = l.split_once(' ').expect("`term pid`");
            (term.parse().expect("term"), pid.parse().expect("pid"))
        })
        .collect()
}

#[tokio::test]
async fn on_exit_release_stands_again_with_a_new_term_each_time() {
    let runs = three_runs("run_on_exit_release", "release").await;
    assert_eq!(runs.len(), 3, "{runs:?}");
    assert!(
        runs.windows(2).all(|w| w[1].0 > w[0].0),
        "terms did not rise: {runs:?}"
    );
}

#[tokio::test]
async fn on_exit_rerun_restarts_the_command_within_one_term() {
    let runs = three_runs("run_on_exit_rerun", "rerun").await;
    assert_eq!(runs.len(), 3, "{runs:?}");
    assert!(
        runs.iter().all(|r| r.0 == runs[0].0),
        "term changed: {runs:?}"
    );
    assert!(
        runs.windows(2).all(|w| w[1].1 != w[0].1),
        "not restarted: {runs:?}"
    );
}

/// Runs `pgelect run ARGS` where it must fail fast with `code` and say
/// `says`; prints the time it took.
async fn fails(args: &[&str], url: Option<&str>, code: i32, says: &str) {
    let mut cmd = pgelect(["run"]);
    cmd.args(args);
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    let out = run(cmd, QUICK).await;
    println!(
        "run {args:?}: exit {:?} after {:?}: {}",
        out.code,
        out.elapsed,
        out.stderr.trim()
    );
    out.assert_code(code);
    assert!(
        out.stderr.contains(says),
        "{args:?}: stderr does not say {says:?}:\n{}",
        out.stderr
    );
    assert!(
        !out.output().contains(TEST_PASSWORD),
        "password printed:\n{}",
        out.output()
    );
}

#[tokio::test]
async fn bad_input_fails_fast_with_a_clear_message() {
    let (db, dir) = setup("run_bad_input").await;
    let url = db.url();
    let url = Some(url.as_str());
    fails(
        &["--role", "r", "--ttl", "0", "--", "true"],
        url,
        64,
        "zero",
    )
    .await;
    fails(
        &["--role", "r", "--ttl", "2s", "--grace", "5s", "--", "true"],
        url,
        64,
        "--grace 5s",
    )
    .await;
    fails(&["--role", "r", "true"], url, 64, "unexpected argument").await;
    fails(&["--role", "r", "--"], url, 64, "<CMD>").await;
    fails(&["--role", "", "--", "true"], url, 64, "--role is empty").await;
    fails(
        &["--role", "a\nb", "--", "true"],
        url,
        64,
        "control character",
    )
    .await;
    fails(
        &["--role", "r", "--id", "x\x1b[31m", "--", "true"],
        url,
        64,
        "control character",
    )
    .await;
    fails(
        &["--role", "r", "--", "no-such-command-pgelect"],
        url,
        127,
        "command not found",
    )
    .await;
    let script = dir.join("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").expect("write script");
    fails(
        &["--role", "r", "--", script.to_str().expect("utf-8")],
        url,
        126,
        "permission denied",
    )
    .await;
    // None of these stood for election: the role is unknown
    // (`status --role` of an unknown role exits 66; it was 0 and an empty list).
    let out = run(
        pgelect([
            "status",
            "--json",
            "--role",
            ROLE,
            "--database-url",
            &db.url(),
        ]),
        QUICK,
    )
    .await;
    out.assert_code(66);
    assert!(out.stdout.is_empty(), "{}", out.stdout);

    // The schema is missing: say how to install it.
    let bare = TestDb::new("run_no_schema").await;
    fails(
        &["--role", "r", "--", "true"],
        Some(&bare.url()),
        78,
        "pgelect migrate",
    )
    .await;
}

/// At start an unreachable database is most likely a wrong URL: exit 69
/// after the connect timeout instead of retrying for ever. (Once running,
/// the supervisor stays in the election through outages: see the cut,
/// partition and restart tests.)
#[tokio::test]
async fn a_database_that_does_not_answer_at_start_exits_69() {
    let db = TestDb::new("run_unreachable").await;
    let proxy = FaultProxy::start(db.server_addr()).expect("start the fault proxy");
    proxy.blackhole();
    let url = format!("{}?connect_timeout=2", url_via(&db, &proxy));
    let started = Instant::now();
    fails(
        &["--role", "r", "--", "true"],
        Some(&url),
        69,
        "could not connect",
    )
    .await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(5),
        "took {took:?}"
    );

    let closed = format!(
        "postgres://postgres:{TEST_PASSWORD}@127.0.0.1:{}/{}",
        pgelect_testkit::free_port(),
        db.name()
    );
    fails(
        &["--role", "r", "--", "true"],
        Some(&closed),
        69,
        "could not connect",
    )
    .await;
}
