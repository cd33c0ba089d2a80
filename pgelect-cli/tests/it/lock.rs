//! `pgelect lock` (the real binary) against a real PostgreSQL: exit codes,
//! mutual exclusion, shared mode, waiting and giving up, losing the
//! connection, and what happens to the command when pgelect is signalled or
//! killed.
//!
//! Every test gets its own database (advisory locks are per database, so
//! tests cannot disturb each other) on which `pgelect migrate` never ran:
//! `lock` needs no schema. Commands are `sh -c` scripts that report their
//! progress through files in a per-test directory (`$D`); the tests await
//! those files and rows in `pg_locks` in bounded polling loops. Measured
//! times are printed (`cargo test -- --nocapture`).

use crate::support;

use std::time::{Duration, Instant};

use pgelect::{ConnectOptions, LockKey, LockSession};
use pgelect_testkit::TestDb;
use support::{
    advisory_locks, await_advisory_locks, finish, pgelect, process_alive, run, schema_exists,
    send_signal, wait_for_file, wait_until, TempDir,
};
use tokio::process::Command;

/// Bound on a whole `pgelect lock` run in these tests.
const LIMIT: Duration = Duration::from_secs(30);
/// Bound on the command starting (connect, lock, spawn).
const START: Duration = Duration::from_secs(10);

/// Shell: wait (at most 30 s) for `$D/go` to exist.
const AWAIT_GO: &str =
    r#"i=0; while [ ! -e "$D/go" ] && [ $i -lt 1500 ]; do sleep 0.02; i=$((i+1)); done"#;

/// Shell: write the shell's pid to `$D/pid` atomically.
const WRITE_PID: &str = r#"echo $$ > "$D/pid.tmp" && mv "$D/pid.tmp" "$D/pid""#;

/// `pgelect lock --key KEY EXTRA… -- sh -c SCRIPT` on `db`, with `D=dir`.
fn lock(db: &TestDb, dir: &TempDir, key: &str, extra: &[&str], script: &str) -> Command {
    let mut cmd = pgelect(["lock", "--key", key]);
    cmd.args(extra)
        .args(["--", "sh", "-c", script])
        .env("DATABASE_URL", db.url())
        .env("D", dir.path());
    cmd
}

/// Holds `key` from the test process through the library.
async fn hold(db: &TestDb, key: &str) -> (LockSession, pgelect::lock::LockGuard) {
    let options = ConnectOptions::from_url(&db.url()).expect("test URL parses");
    let session = LockSession::connect(&options).await.expect("connect");
    let guard = session
        .try_lock(LockKey::from_name(key).expect("valid key"))
        .await
        .expect("try_lock")
        .expect("the key is free");
    (session, guard)
}

/// True when `key` can be taken right now (taken and released at once).
async fn is_free(db: &TestDb, key: &str) -> bool {
    let options = ConnectOptions::from_url(&db.url()).expect("test URL parses");
    let session = LockSession::connect(&options).await.expect("connect");
    let key = LockKey::from_name(key).expect("valid key");
    match session.try_lock(key).await.expect("try_lock") {
        Some(guard) => {
            guard.release().await.expect("release");
            true
        }
        None => false,
    }
}

fn read_pid(dir: &TempDir) -> u32 {
    std::fs::read_to_string(dir.join("pid"))
        .expect("read pid file")
        .trim()
        .parse()
        .expect("pid file holds a number")
}

#[tokio::test]
async fn the_commands_exit_code_is_pgelects() {
    let db = TestDb::new("cli_lock_code").await;
    let dir = TempDir::new("code");
    for (script, want) in [("exit 0", 0), ("exit 7", 7), ("kill -KILL $$", 128 + 9)] {
        run(lock(&db, &dir, "k", &[], script), LIMIT)
            .await
            .assert_code(want);
    }
}

#[tokio::test]
async fn the_command_sees_pgelect_lock_and_runs_without_any_schema() {
    let db = TestDb::new("cli_lock_env").await;
    let dir = TempDir::new("env");
    let key = "nightly report";
    let out = run(
        lock(&db, &dir, key, &[], r#"printf 'lock=%s\n' "$PGELECT_LOCK""#),
        LIMIT,
    )
    .await;
    out.assert_code(0);
    assert_eq!(out.stdout, format!("lock={key}\n"));

    // Advisory locks need no tables: no schema before, none after, whatever
    // --schema says.
    let custom = lock(&db, &dir, key, &["--schema", "elsewhere"], "true");
    run(custom, LIMIT).await.assert_code(0);
    assert!(!schema_exists(&db, "pgelect").await);
    assert!(!schema_exists(&db, "elsewhere").await);
}

#[tokio::test]
async fn concurrent_holders_of_one_key_never_overlap() {
    let db = TestDb::new("cli_lock_exclusive").await;
    let dir = TempDir::new("exclusive");
    // `mkdir` fails if another command is inside: the command then exits 99.
    let script = r#"mkdir "$D/held" || exit 99
echo "start $(date +%s%N)" >> "$D/log"
sleep 0.3
echo "end $(date +%s%N)" >> "$D/log"
rmdir "$D/held""#;
    const N: usize = 4;
    let started = Instant::now();
    let children: Vec<_> = (0..N)
        .map(|_| lock(&db, &dir, "k", &[], script).spawn().expect("spawn"))
        .collect();
    for child in children {
        finish(child, started, LIMIT).await.assert_code(0);
    }
    let elapsed = started.elapsed();
    println!("{N} holders of one key, 300 ms each, took {elapsed:?}");

    let log = std::fs::read_to_string(dir.join("log")).expect("read log");
    let lines: Vec<(&str, u128)> = log
        .lines()
        .map(|l| {
            let (what, at) = l.split_once(' ').expect("`what time` line");
            (what, at.parse().expect("nanoseconds"))
        })
        .collect();
    assert_eq!(lines.len(), 2 * N, "{log}");
    for (i, pair) in lines.windows(2).enumerate() {
        let want = if i % 2 == 0 {
            ("start", "end")
        } else {
            ("end", "start")
        };
        assert_eq!((pair[0].0, pair[1].0), want, "runs interleaved:\n{log}");
        assert!(pair[0].1 <= pair[1].1, "time went backwards:\n{log}");
    }
    assert!(elapsed >= Duration::from_millis(300 * N as u64));
}

#[tokio::test]
async fn no_wait_exits_75_at_once_when_the_lock_is_held_elsewhere() {
    let db = TestDb::new("cli_lock_no_wait").await;
    let dir = TempDir::new("no_wait");
    let (_session, guard) = hold(&db, "k").await;

    for extra in [&["--no-wait"][..], &["-n", "--shared"][..]] {
        let out = run(lock(&db, &dir, "k", extra, r#"touch "$D/ran""#), LIMIT).await;
        println!(
            "{extra:?} while held: exit {:?} after {:?}",
            out.code, out.elapsed
        );
        out.assert_code(75);
        assert!(
            out.elapsed < Duration::from_secs(3),
            "took {:?}",
            out.elapsed
        );
        assert!(
            out.stderr.contains("is held by pid") && out.stderr.contains("\"pgelect:locks\""),
            "names the holder: {}",
            out.stderr
        );
        assert!(
            !dir.join("ran").exists(),
            "the command ran without the lock"
        );
    }

    assert!(guard.release().await.expect("release"));
    run(
        lock(&db, &dir, "k", &["--no-wait"], r#"touch "$D/ran""#),
        LIMIT,
    )
    .await
    .assert_code(0);
    assert!(dir.join("ran").exists());
}

#[tokio::test]
async fn timeout_exits_75_after_waiting_that_long() {
    let db = TestDb::new("cli_lock_timeout").await;
    let dir = TempDir::new("timeout");
    let (_session, _guard) = hold(&db, "k").await;
    let admin = db.connect().await;

    let out = run(
        lock(&db, &dir, "k", &["--timeout", "300ms"], r#"touch "$D/ran""#),
        LIMIT,
    )
    .await;
    println!(
        "--timeout 300ms while held: exit {:?} after {:?}",
        out.code, out.elapsed
    );
    out.assert_code(75);
    assert!(
        out.elapsed >= Duration::from_millis(300),
        "gave up after {:?}",
        out.elapsed
    );
    assert!(
        out.elapsed < Duration::from_secs(5),
        "took {:?}",
        out.elapsed
    );
    assert!(out.stderr.contains("not acquired"), "{}", out.stderr);
    assert!(
        !dir.join("ran").exists(),
        "the command ran without the lock"
    );
    // Only the test's own lock is left: no abandoned wait.
    await_advisory_locks(&admin, 1, 0).await;
}

#[tokio::test]
async fn shared_holders_run_together_while_an_exclusive_one_waits() {
    let db = TestDb::new("cli_lock_shared").await;
    let dir = TempDir::new("shared");
    let admin = db.connect().await;
    let shared_script = format!(
        r#"echo shared-start >> "$D/log"; touch "$D/ready-$N"; {AWAIT_GO}; echo shared-end >> "$D/log""#
    );
    let started = Instant::now();
    let shared: Vec<_> = (0..2)
        .map(|n| {
            let mut cmd = lock(&db, &dir, "k", &["--shared"], &shared_script);
            cmd.env("N", n.to_string());
            cmd.spawn().expect("spawn")
        })
        .collect();
    // Both shared commands are running at the same time.
    wait_for_file(&dir.join("ready-0"), START).await;
    wait_for_file(&dir.join("ready-1"), START).await;

    let mut exclusive = lock(&db, &dir, "k", &[], r#"echo exclusive >> "$D/log""#)
        .spawn()
        .expect("spawn");
    await_advisory_locks(&admin, 2, 1).await;
    assert!(exclusive.try_wait().expect("try_wait").is_none());
    let log = std::fs::read_to_string(dir.join("log")).expect("read log");
    assert!(
        !log.contains("exclusive"),
        "exclusive ran beside shared:\n{log}"
    );

    std::fs::write(dir.join("go"), "").expect("write go");
    for child in shared {
        finish(child, started, LIMIT).await.assert_code(0);
    }
    finish(exclusive, started, LIMIT).await.assert_code(0);
    let log = std::fs::read_to_string(dir.join("log")).expect("read log");
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(
        lines,
        [
            "shared-start",
            "shared-start",
            "shared-end",
            "shared-end",
            "exclusive"
        ],
        "{log}"
    );
}

#[tokio::test]
async fn a_command_that_cannot_run_exits_127_or_126_with_a_message() {
    let db = TestDb::new("cli_lock_no_command").await;
    let dir = TempDir::new("no_command");
    let mut missing = pgelect(["lock", "--key", "k", "--", "no-such-command-pgelect"]);
    missing.env("DATABASE_URL", db.url());
    let out = run(missing, LIMIT).await;
    out.assert_code(127);
    assert!(out.stderr.contains("command not found"), "{}", out.stderr);
    assert!(
        out.stderr.contains("no-such-command-pgelect"),
        "{}",
        out.stderr
    );

    let script = dir.join("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").expect("write script");
    let mut denied = pgelect(["lock", "--key", "k", "--"]);
    denied.arg(&script).env("DATABASE_URL", db.url());
    let out = run(denied, LIMIT).await;
    out.assert_code(126);
    assert!(out.stderr.contains("permission denied"), "{}", out.stderr);

    assert!(is_free(&db, "k").await);
}

#[tokio::test]
async fn bad_durations_are_usage_errors() {
    // No database is needed: these fail while parsing.
    for (args, says) in [
        (&["--timeout", "0"][..], "zero"),
        (&["--timeout", "0s"][..], "zero"),
        (&["--timeout", "-1s"][..], "negative"),
        (&["--timeout=-1s"][..], "negative"),
        (&["--timeout", "soon"][..], "not a duration"),
        (&["--timeout", "5 parsecs"][..], "unit"),
        (&["--grace", "0"][..], "zero"),
        (&["--grace", "-5s"][..], "negative"),
        (&["--timeout", "1s", "--no-wait"][..], "cannot be used with"),
    ] {
        let mut cmd = pgelect(["lock", "--key", "k"]);
        cmd.args(args).args(["--", "true"]);
        let out = run(cmd, Duration::from_secs(10)).await;
        out.assert_code(64);
        assert!(
            out.stderr.contains(says),
            "{args:?}: stderr does not say {says:?}:\n{}",
            out.stderr
        );
    }
}

#[tokio::test]
async fn the_lock_is_held_by_a_connection_named_pgelect() {
    let db = TestDb::new("cli_lock_app_name").await;
    let dir = TempDir::new("app_name");
    let admin = db.connect().await;
    let script = format!(r#"touch "$D/running"; {AWAIT_GO}"#);
    let started = Instant::now();
    let child = lock(&db, &dir, "k", &[], &script).spawn().expect("spawn");
    wait_for_file(&dir.join("running"), START).await;

    let locks = advisory_locks(&admin).await;
    assert_eq!(locks.len(), 1, "{locks:?}");
    assert!(
        locks[0].granted && locks[0].mode == "ExclusiveLock",
        "{locks:?}"
    );
    assert!(
        locks[0].application_name.starts_with("pgelect:"),
        "application_name {:?}",
        locks[0].application_name
    );
    println!("holder application_name: {:?}", locks[0].application_name);

    std::fs::write(dir.join("go"), "").expect("write go");
    finish(child, started, LIMIT).await.assert_code(0);
    await_advisory_locks(&admin, 0, 0).await;
}

#[tokio::test]
async fn a_terminated_backend_kills_the_command_at_once_and_exits_69() {
    let db = TestDb::new("cli_lock_terminate").await;
    let dir = TempDir::new("terminate");
    let admin = db.connect().await;
    let script = format!("{WRITE_PID}; exec sleep 30");
    let started = Instant::now();
    let child = lock(&db, &dir, "k", &[], &script).spawn().expect("spawn");
    wait_for_file(&dir.join("pid"), START).await;
    let command_pid = read_pid(&dir);
    assert!(process_alive(command_pid));

    let locks = advisory_locks(&admin).await;
    assert_eq!(locks.len(), 1, "{locks:?}");
    let terminated_at = Instant::now();
    let row = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&locks[0].pid])
        .await
        .expect("pg_terminate_backend");
    assert!(row.get::<_, bool>(0));

    let out = finish(child, started, LIMIT).await;
    let took = terminated_at.elapsed();
    println!(
        "backend terminated -> pgelect exited {:?} after {took:?}",
        out.code
    );
    out.assert_code(69);
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(out.stderr.contains("lost lock"), "{}", out.stderr);
    assert!(!process_alive(command_pid), "the command outlived the lock");
}

#[tokio::test]
async fn sigterm_stops_the_command_and_releases_the_lock() {
    let db = TestDb::new("cli_lock_sigterm").await;
    let dir = TempDir::new("sigterm");
    let script =
        format!(r#"trap 'echo term >> "$D/log"; exit 3' TERM; touch "$D/running"; {AWAIT_GO}"#);
    let started = Instant::now();
    let child = lock(&db, &dir, "k", &[], &script).spawn().expect("spawn");
    wait_for_file(&dir.join("running"), START).await;
    assert!(!is_free(&db, "k").await);

    let signalled = Instant::now();
    send_signal(child.id().expect("pgelect pid"), "TERM");
    let out = finish(child, started, LIMIT).await;
    println!(
        "SIGTERM -> exit {:?} after {:?}",
        out.code,
        signalled.elapsed()
    );
    out.assert_code(3);
    assert_eq!(
        std::fs::read_to_string(dir.join("log")).expect("read log"),
        "term\n"
    );
    assert!(is_free(&db, "k").await);
}

#[tokio::test]
async fn sigterm_escalates_to_sigkill_after_the_grace() {
    let db = TestDb::new("cli_lock_grace").await;
    let dir = TempDir::new("grace");
    // An ignored signal stays ignored across exec.
    let script = format!("trap '' TERM; {WRITE_PID}; exec sleep 30");
    let started = Instant::now();
    let child = lock(&db, &dir, "k", &["--grace", "500ms"], &script)
        .spawn()
        .expect("spawn");
    wait_for_file(&dir.join("pid"), START).await;
    let command_pid = read_pid(&dir);

    let signalled = Instant::now();
    send_signal(child.id().expect("pgelect pid"), "TERM");
    let out = finish(child, started, LIMIT).await;
    let took = signalled.elapsed();
    println!(
        "SIGTERM with --grace 500ms, TERM ignored -> exit {:?} after {took:?}",
        out.code
    );
    out.assert_code(128 + 9);
    assert!(took >= Duration::from_millis(500), "killed after {took:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(!process_alive(command_pid));
    assert!(is_free(&db, "k").await);
}

#[tokio::test]
async fn sigterm_while_waiting_exits_75_and_withdraws_the_wait() {
    let db = TestDb::new("cli_lock_term_waiting").await;
    let dir = TempDir::new("term_waiting");
    let admin = db.connect().await;
    let (_session, _guard) = hold(&db, "k").await;
    let started = Instant::now();
    let child = lock(&db, &dir, "k", &[], r#"touch "$D/ran""#)
        .spawn()
        .expect("spawn");
    await_advisory_locks(&admin, 1, 1).await;

    send_signal(child.id().expect("pgelect pid"), "TERM");
    let out = finish(child, started, LIMIT).await;
    out.assert_code(75);
    assert!(out.stderr.contains("SIGTERM"), "{}", out.stderr);
    assert!(!dir.join("ran").exists());
    await_advisory_locks(&admin, 1, 0).await;
}

#[tokio::test]
async fn sigkill_of_pgelect_kills_the_command_and_frees_the_lock() {
    let db = TestDb::new("cli_lock_sigkill").await;
    let dir = TempDir::new("sigkill");
    let admin = db.connect().await;
    let script = format!("{WRITE_PID}; exec sleep 30");
    let mut child = lock(&db, &dir, "k", &[], &script).spawn().expect("spawn");
    wait_for_file(&dir.join("pid"), START).await;
    let command_pid = read_pid(&dir);
    assert!(process_alive(command_pid));
    await_advisory_locks(&admin, 1, 0).await;

    let killed = Instant::now();
    child.start_kill().expect("SIGKILL pgelect");
    child.wait().await.expect("reap pgelect");
    let gone = wait_until(
        "the command to die with pgelect",
        Duration::from_secs(5),
        || async { !process_alive(command_pid) },
    )
    .await;
    println!("SIGKILL of pgelect -> command gone after {gone:?}");
    await_advisory_locks(&admin, 0, 0).await;
    println!(
        "SIGKILL of pgelect -> lock free on the server after {:?}",
        killed.elapsed()
    );
}

/// `PR_SET_PDEATHSIG` covers only the direct child; the process-group
/// watcher also ends what the command started in the background, so nothing
/// of it runs on without the lock after pgelect is SIGKILLed.
#[tokio::test]
async fn sigkill_of_pgelect_kills_the_commands_children_too() {
    let db = TestDb::new("cli_lock_sigkill_tree").await;
    let dir = TempDir::new("sigkill_tree");
    let script = r#"sleep 30 & echo $! > "$D/pid.tmp"; mv "$D/pid.tmp" "$D/pid"; wait"#;
    let mut child = lock(&db, &dir, "k", &[], script).spawn().expect("spawn");
    wait_for_file(&dir.join("pid"), START).await;
    let grandchild = read_pid(&dir);
    child.start_kill().expect("SIGKILL pgelect");
    child.wait().await.expect("reap pgelect");
    let deadline = Instant::now() + Duration::from_secs(3);
    while process_alive(grandchild) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if process_alive(grandchild) {
        send_signal(grandchild, "KILL");
        panic!("the command's child {grandchild} outlived pgelect");
    }
}
