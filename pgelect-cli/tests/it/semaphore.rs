//! `pgelect lock --limit N` (the real binary) against a real PostgreSQL:
//! never more than N commands at once, also while holders are SIGKILLed;
//! the conflict and timeout messages name the holders; bad input.
//!
//! Every test gets its own database. Commands are `sh -c` scripts that
//! report through files in per-test directories (`$D`); the tests await
//! those files and rows in `pg_locks` in bounded polling loops. Measured
//! times are printed (`cargo test -- --nocapture`).

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgelect::{lock::Permit, lock::Semaphore, ConnectOptions, LockKey, LockSession};
use pgelect_testkit::TestDb;
use support::{
    finish, pgelect, process_alive, run, wait_for_file, wait_until, Background, TempDir,
};
use tokio::process::Command;
use tokio_postgres::Client;

/// Bound on a whole `pgelect lock` run in these tests.
const LIMIT: Duration = Duration::from_secs(60);
/// Bound on a command starting (connect, permit, spawn).
const START: Duration = Duration::from_secs(15);

/// `pgelect lock --key KEY --limit N EXTRA… -- sh -c SCRIPT` on `db`, with
/// `D=dir`.
fn lock(db: &TestDb, dir: &TempDir, key: &str, n: u32, extra: &[&str], script: &str) -> Command {
    let mut cmd = pgelect(["lock", "--key", key, "--limit", &n.to_string()]);
    cmd.args(extra)
        .args(["--", "sh", "-c", script])
        .env("DATABASE_URL", db.url())
        .env("D", dir.path());
    cmd
}

/// Takes a permit from the test process through the library.
async fn hold(db: &TestDb, key: &str, n: u32) -> (LockSession, Permit) {
    let options = ConnectOptions::from_url(&db.url()).expect("test URL parses");
    let session = LockSession::connect(&options).await.expect("connect");
    let sem = Semaphore::new(key, n).expect("valid semaphore");
    let permit = session
        .try_acquire_permit(&sem)
        .await
        .expect("try_acquire_permit")
        .expect("a free permit");
    (session, permit)
}

/// Granted slot locks of semaphore `key` (and of 4 slots beyond `n`), as
/// one `pg_locks` snapshot counts them.
async fn slots_held(admin: &Client, key: &str, n: u32) -> i64 {
    let wide = Semaphore::new(key, n + 4).expect("valid semaphore");
    let keys: Vec<i64> = (0..wide.limit())
        .filter_map(|i| match wide.slot_key(i) {
            Some(LockKey::Single(k)) => Some(k),
            _ => None,
        })
        .collect();
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks l
              WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
                AND ((l.classid::int8 << 32) | l.objid::int8) = ANY($1)",
            &[&keys],
        )
        .await
        .expect("read pg_locks")
        .get(0)
}

/// Advisory locks (granted or not) in this database.
async fn advisory_locks(admin: &Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
              WHERE l.locktype = 'advisory' AND d.datname = current_database()",
            &[],
        )
        .await
        .expect("read pg_locks")
        .get(0)
}

/// Reads `pg_locks` until stopped; the most slots seen held at once.
fn sample(
    admin: Client,
    key: &'static str,
    n: u32,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(i64, u64)> {
    tokio::spawn(async move {
        let (mut most, mut reads) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            most = most.max(slots_held(&admin, key, n).await);
            reads += 1;
        }
        (most, reads)
    })
}

#[tokio::test]
async fn at_most_n_commands_run_at_once_each_with_its_own_slot() {
    let db = TestDb::new("cli_limit_n").await;
    let dir = TempDir::new("limit_n");
    // Each slot's directory can be made by one command at a time: the
    // command exits 99 if its slot is in use. The log has every start and
    // end, to count the commands running at once.
    let script = r#"case "$PGELECT_PERMIT" in 0|1) ;; *) exit 98;; esac
mkdir "$D/slot-$PGELECT_PERMIT" || exit 99
echo "start $(date +%s%N)" >> "$D/log"
sleep 0.3
echo "end $(date +%s%N)" >> "$D/log"
rmdir "$D/slot-$PGELECT_PERMIT""#;
    const N: usize = 6;
    let started = Instant::now();
    let children: Vec<_> = (0..N)
        .map(|_| lock(&db, &dir, "k", 2, &[], script).spawn().expect("spawn"))
        .collect();
    for child in children {
        finish(child, started, LIMIT).await.assert_code(0);
    }
    let elapsed = started.elapsed();
    let log = std::fs::read_to_string(dir.join("log")).expect("read log");
    let mut events: Vec<(u128, i32)> = log
        .lines()
        .map(|l| {
            let (what, at) = l.split_once(' ').expect("`what time` line");
            let at: u128 = at.parse().expect("nanoseconds");
            (at, if what == "start" { 1 } else { -1 })
        })
        .collect();
    assert_eq!(events.len(), 2 * N, "{log}");
    // Ends before starts at the same instant.
    events.sort();
    let (mut running, mut most) = (0, 0);
    for (_, d) in events {
        running += d;
        most = most.max(running);
    }
    println!("{N} commands with --limit 2, 300 ms each, took {elapsed:?}; at most {most} at once");
    assert_eq!(most, 2, "never more than 2, and 2 did run together:\n{log}");
    assert!(elapsed >= Duration::from_millis(300 * N as u64 / 2));
}

#[tokio::test]
async fn no_wait_and_timeout_exit_75_naming_the_holders() {
    let db = TestDb::new("cli_limit_busy").await;
    let dir = TempDir::new("limit_busy");
    let (a, _pa) = hold(&db, "k", 2).await;
    let (b, _pb) = hold(&db, "k", 2).await;

    let out = run(
        lock(&db, &dir, "k", 2, &["--no-wait"], r#"touch "$D/ran""#),
        LIMIT,
    )
    .await;
    println!(
        "--no-wait, both permits held: exit {:?} after {:?}: {}",
        out.code, out.elapsed, out.stderr
    );
    out.assert_code(75);
    assert!(
        out.elapsed < Duration::from_secs(5),
        "took {:?}",
        out.elapsed
    );
    for pid in [a.backend_pid(), b.backend_pid()] {
        assert!(
            out.stderr.contains(&format!("pid {pid}")),
            "names holder {pid}: {}",
            out.stderr
        );
    }
    assert!(out.stderr.contains("2 of 2 permits"), "{}", out.stderr);

    let out = run(
        lock(
            &db,
            &dir,
            "k",
            2,
            &["-w", "0.3", "-E", "3"],
            r#"touch "$D/ran""#,
        ),
        LIMIT,
    )
    .await;
    println!(
        "-w 0.3 -E 3: exit {:?} after {:?}: {}",
        out.code, out.elapsed, out.stderr
    );
    out.assert_code(3);
    assert!(out.stderr.contains("timed out after"), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!("pid {}", a.backend_pid())),
        "{}",
        out.stderr
    );
    assert!(
        out.elapsed >= Duration::from_millis(300),
        "{:?}",
        out.elapsed
    );
    assert!(
        !dir.join("ran").exists(),
        "the command ran without a permit"
    );
}

#[tokio::test]
async fn bad_limits_are_usage_errors_and_a_different_limit_is_refused() {
    let db = TestDb::new("cli_limit_bad").await;
    let dir = TempDir::new("limit_bad");
    for bad in [
        &["--limit", "0"][..],
        &["--limit", "1025"],
        &["--limit", "x"],
        &["--limit", "2", "--shared"],
    ] {
        let mut cmd = pgelect(["lock", "--key", "k"]);
        cmd.args(bad)
            .args(["--", "true"])
            .env("DATABASE_URL", db.url());
        let out = run(cmd, LIMIT).await;
        println!(
            "{bad:?}: exit {:?}: {}",
            out.code,
            out.stderr.lines().next().unwrap_or("")
        );
        out.assert_code(64);
    }
    let (holder, _p) = hold(&db, "k", 2).await;
    let out = run(lock(&db, &dir, "k", 3, &[], r#"touch "$D/ran""#), LIMIT).await;
    println!(
        "--limit 3 while used with 2: exit {:?}: {}",
        out.code, out.stderr
    );
    out.assert_code(78);
    assert!(out.stderr.contains("in use with limit 2"), "{}", out.stderr);
    assert!(
        out.stderr.contains(&holder.backend_pid().to_string()),
        "{}",
        out.stderr
    );
    assert!(!dir.join("ran").exists());
}

#[tokio::test]
async fn sigterm_while_waiting_exits_75_and_withdraws_the_wait() {
    let db = TestDb::new("cli_limit_term").await;
    let dir = TempDir::new("limit_term");
    let admin = db.connect().await;
    let (_s, _p) = hold(&db, "k", 1).await;
    let before = advisory_locks(&admin).await; // the slot and the limit key
    let mut head = Background::spawn("head", lock(&db, &dir, "k", 1, &[], r#"touch "$D/ran""#));
    let mut queued = Background::spawn("queued", lock(&db, &dir, "k", 1, &[], r#"touch "$D/ran""#));
    // The head holds the gate and the limit key; the queued one the limit
    // key and a wait for the gate.
    wait_until("both to wait", START, || async {
        advisory_locks(&admin).await == before + 4
    })
    .await;
    queued.signal("TERM");
    head.signal("TERM");
    assert_eq!(queued.wait(LIMIT).await, Some(75), "{}", queued.output());
    assert_eq!(head.wait(LIMIT).await, Some(75), "{}", head.output());
    assert!(queued.output().contains("SIGTERM"), "{}", queued.output());
    // The server ends an exited client's backend, and drops its locks, a
    // moment after the process is gone (a CI run on PostgreSQL 18 still
    // saw them at once): wait for it, bounded.
    let took = wait_until("the waits to leave nothing behind", START, || async {
        advisory_locks(&admin).await == before
    })
    .await;
    println!("the waits' locks were gone {took:?} after both exited");
    assert!(!dir.join("ran").exists());
}

#[tokio::test]
async fn sigkilled_holders_never_let_more_than_n_commands_hold() {
    let db = TestDb::new("cli_limit_kill").await;
    let admin = db.connect().await;
    const N: u32 = 2;
    const PROCESSES: usize = 5;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample(db.connect().await, "k", N, stop.clone());
    let dirs: Vec<TempDir> = (0..PROCESSES)
        .map(|i| TempDir::new(&format!("limit_kill_{i}")))
        .collect();
    let script = r#"echo $$ > "$D/pid.tmp" && mv "$D/pid.tmp" "$D/pid"; exec sleep 60"#;
    let mut procs: Vec<Background> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| Background::spawn(&format!("holder-{i}"), lock(&db, d, "k", N, &[], script)))
        .collect();
    let running = |dirs: &[TempDir]| -> Vec<usize> {
        (0..dirs.len())
            .filter(|i| dirs[*i].join("pid").exists())
            .collect()
    };
    wait_until("2 commands to run", START, || async {
        running(&dirs).len() == N as usize
    })
    .await;
    let mut killed: Vec<usize> = Vec::new();
    let mut takeovers = Vec::new();
    for _ in 0..PROCESSES - N as usize {
        let victim = *running(&dirs)
            .iter()
            .find(|i| !killed.contains(i))
            .expect("a live holder");
        let command = std::fs::read_to_string(dirs[victim].join("pid"))
            .unwrap()
            .trim()
            .parse::<u32>()
            .unwrap();
        let t = Instant::now();
        procs[victim].kill().await;
        killed.push(victim);
        let took = wait_until("another command to start", START, || async {
            running(&dirs).len() == N as usize + killed.len()
        })
        .await;
        takeovers.push(t.elapsed());
        println!("SIGKILL of holder-{victim}: the next command started after {took:?}");
        wait_until(
            "the killed holder's command to die",
            Duration::from_secs(5),
            || async { !process_alive(command) },
        )
        .await;
        assert!(slots_held(&admin, "k", N).await <= N as i64);
    }
    stop.store(true, Ordering::Relaxed);
    let (most, reads) = sampler.await.unwrap();
    println!(
        "{PROCESSES} `pgelect lock --limit {N}`, {} SIGKILLed: takeovers {takeovers:?} (the default 500 ms poll: \
         a killed holder sends no NOTIFY); most slots held at once {most} ({reads} pg_locks reads)",
        killed.len()
    );
    assert_eq!(most, N as i64, "never more than {N}, and {N} were held");
    for t in &takeovers {
        assert!(*t < Duration::from_secs(5), "a takeover took {t:?}");
    }
    for (i, p) in procs.iter_mut().enumerate() {
        if !killed.contains(&i) {
            p.signal("TERM");
            // The command dies of the SIGTERM: 128 + 15.
            assert_eq!(p.wait(LIMIT).await, Some(143), "{}", p.output());
        }
    }
}

#[tokio::test]
async fn a_released_permit_goes_to_the_waiting_command_at_once() {
    let db = TestDb::new("cli_limit_handoff").await;
    let dir = TempDir::new("limit_handoff");
    let (_s, permit) = hold(&db, "k", 1).await;
    let mut waiter = Background::spawn("waiter", lock(&db, &dir, "k", 1, &[], r#"touch "$D/ran""#));
    let admin = db.connect().await;
    // The waiter is the head: it holds the gate.
    let gate = match Semaphore::new("k", 1).unwrap().gate_key() {
        LockKey::Single(k) => k,
        LockKey::Pair(..) => unreachable!(),
    };
    wait_until("the waiter to hold the gate", START, || async {
        admin
            .query_one(
                "SELECT count(*) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
                   AND ((l.classid::int8 << 32) | l.objid::int8) = $1",
                &[&gate],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
    let t = Instant::now();
    assert!(permit.release().await.unwrap());
    let took = wait_for_file(&dir.join("ran"), START).await;
    println!(
        "release -> the waiting command ran after {took:?} ({:?} with the wait for the file)",
        t.elapsed()
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "woken by the release's NOTIFY, not later"
    );
    assert_eq!(waiter.wait(LIMIT).await, Some(0), "{}", waiter.output());
}

#[tokio::test]
async fn status_lists_the_permits_and_the_first_in_line() {
    let db = TestDb::new("cli_limit_status").await;
    let options = ConnectOptions::from_url(&db.url()).expect("test URL parses");
    pgelect::migrate(&options).await.expect("migrate");
    let holder_dir = TempDir::new("limit_status_holder");
    let script = r#"touch "$D/running"; exec sleep 60"#;
    let mut holder = Background::spawn(
        "holder",
        lock(&db, &holder_dir, "jobs", 1, &["--id", "node-a"], script),
    );
    wait_for_file(&holder_dir.join("running"), START).await;
    let waiter_dir = TempDir::new("limit_status_waiter");
    let mut waiter = Background::spawn(
        "waiter",
        lock(&db, &waiter_dir, "jobs", 1, &["--id", "node-b"], script),
    );
    let admin = db.connect().await;
    // The holder's slot and limit key, the waiter's gate and limit key.
    wait_until("the waiter to be first in line", START, || async {
        advisory_locks(&admin).await == 4
    })
    .await;
    let mut cmd = pgelect(["status"]);
    cmd.env("DATABASE_URL", db.url());
    let table = run(cmd, LIMIT).await;
    table.assert_code(0);
    println!("{}", table.stdout);
    assert!(
        table.stdout.contains("\"jobs\" permit 0: held by node-a"),
        "{}",
        table.stdout
    );
    assert!(
        table
            .stdout
            .contains("\"jobs\" permits: waited for (first in line) by node-b"),
        "{}",
        table.stdout
    );
    let mut cmd = pgelect(["status", "--json"]);
    cmd.env("DATABASE_URL", db.url());
    let json = run(cmd, LIMIT).await;
    json.assert_code(0);
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("json");
    let locks = v["locks"].as_array().expect("locks");
    assert!(
        locks
            .iter()
            .any(|l| l["node"] == "node-a" && l["permit"]["slot"] == 0),
        "{locks:?}"
    );
    assert!(
        locks
            .iter()
            .any(|l| l["node"] == "node-b" && l["permit"]["queue"] == true),
        "{locks:?}"
    );
    holder.kill().await;
    waiter.kill().await;
}
