//! How `pgelect lock` and `pgelect run` (the real binaries) treat the
//! command they supervise: its environment holds database variables only
//! with `--pass-database-env`; its arguments arrive byte for byte; whatever
//! it starts, even in a session of its own (`setsid`), dies when the
//! supervisor stops it, when it exits, and when the supervisor is
//! SIGKILLed; a killed watcher is noticed. And a wrong password exits 77.

use crate::support;

use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use pgelect_testkit::{TestDb, TEST_PASSWORD};
use support::{
    pgelect, process_alive, read_pid_file, run, setup, wait_for_file, wait_until, Background,
    TempDir,
};

/// Bound on a whole run in these tests.
const LIMIT: Duration = Duration::from_secs(30);
/// Bound on the command starting.
const START: Duration = Duration::from_secs(15);
/// Bound on a process dying after its killer acted.
const DEATH: Duration = Duration::from_secs(5);

/// `pgelect lock --key k EXTRA… -- ARGV…` with the URL in `DATABASE_URL`.
fn lock<S: AsRef<std::ffi::OsStr>>(
    db: &TestDb,
    dir: &TempDir,
    extra: &[&str],
    argv: &[S],
) -> tokio::process::Command {
    let mut cmd = pgelect(["lock", "--key", "k"]);
    cmd.args(extra)
        .arg("--")
        .args(argv)
        .env("DATABASE_URL", db.url())
        .env("D", dir.path());
    cmd
}

/// `pgelect run --role r --on-exit exit EXTRA… -- ARGV…` with the URL in
/// `DATABASE_URL`.
fn run_cmd<S: AsRef<std::ffi::OsStr>>(
    db: &TestDb,
    dir: &TempDir,
    extra: &[&str],
    argv: &[S],
) -> tokio::process::Command {
    let mut cmd = pgelect(["run", "--role", "r", "--ttl", "3s", "--on-exit", "exit"]);
    cmd.args(extra)
        .arg("--")
        .args(argv)
        .env("DATABASE_URL", db.url())
        .env("D", dir.path());
    cmd
}

fn environ(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[tokio::test]
async fn the_command_gets_database_variables_only_with_pass_database_env() {
    let (db, dir) = setup("child_env").await;
    let script = ["sh", "-c", r#"env > "$D/$1""#, "sh"];
    for (sub, flag, file) in [
        ("lock", None, "lock-plain"),
        ("lock", Some("--pass-database-env"), "lock-passed"),
        ("run", None, "run-plain"),
        ("run", Some("--pass-database-env"), "run-passed"),
    ] {
        let extra: Vec<&str> = flag.into_iter().collect();
        let argv: Vec<&str> = script.iter().copied().chain([file]).collect();
        let mut cmd = match sub {
            "lock" => lock(&db, &dir, &extra, &argv),
            _ => run_cmd(&db, &dir, &extra, &argv),
        };
        cmd.env("PGPASSWORD", TEST_PASSWORD)
            .env("PGUSER", "postgres")
            .env("PGPASSFILE", "/nonexistent/pgpass");
        run(cmd, LIMIT).await.assert_code(0);
        let env = environ(&dir.join(file));
        if flag.is_none() {
            assert!(
                !env.contains(TEST_PASSWORD),
                "{sub}: the password leaked:\n{env}"
            );
            for var in ["DATABASE_URL=", "PGPASSWORD=", "PGUSER=", "PGPASSFILE="] {
                assert!(
                    !env.lines().any(|l| l.starts_with(var)),
                    "{sub}: {var} reached the command"
                );
            }
        } else {
            assert!(
                env.lines()
                    .any(|l| l == format!("PGPASSWORD={TEST_PASSWORD}")),
                "{sub} --pass-database-env: no PGPASSWORD\n{env}"
            );
            assert!(
                env.lines()
                    .any(|l| l == format!("DATABASE_URL={}", db.url())),
                "{sub} --pass-database-env: no DATABASE_URL\n{env}"
            );
        }
        // pgelect's own variables always arrive.
        let own = if sub == "lock" {
            "PGELECT_LOCK=k"
        } else {
            "PGELECT_ROLE=r"
        };
        assert!(env.lines().any(|l| l == own), "{sub}: no {own}\n{env}");
    }
}

#[tokio::test]
async fn a_non_utf8_argument_reaches_the_command_byte_for_byte() {
    let (db, dir) = setup("child_bytes").await;
    let odd = std::ffi::OsStr::from_bytes(b"\xff\xfe-caf\xc3\xa9-\x80");
    for (sub, file) in [("lock", "lock-arg"), ("run", "run-arg")] {
        let out = dir.join(file);
        let argv: Vec<&std::ffi::OsStr> = vec![
            "sh".as_ref(),
            "-c".as_ref(),
            r#"printf %s "$1" > "$2""#.as_ref(),
            "sh".as_ref(),
            odd,
            out.as_os_str(),
        ];
        let cmd = match sub {
            "lock" => lock(&db, &dir, &[], &argv),
            _ => run_cmd(&db, &dir, &[], &argv),
        };
        run(cmd, LIMIT).await.assert_code(0);
        assert_eq!(
            std::fs::read(&out).expect("the command wrote its argument"),
            odd.as_bytes(),
            "{sub}"
        );
    }
}

/// The command: starts `setsid sleep 1000` (a new session, so a new process
/// group too), records its pid in `$D/gc`, marks `$D/ready`, then idles
/// (or exits at once with `exit`).
fn setsid_script(then: &str) -> String {
    format!(
        r#"setsid sleep 1000 < /dev/null > /dev/null 2>&1 &
echo $! > "$D/gc.tmp"; mv "$D/gc.tmp" "$D/gc"; echo $$ > "$D/cmd"
: > "$D/ready"
{then}"#
    )
}

/// Waits for the command's grandchild and checks it left the command's
/// session; returns its pid.
async fn grandchild(dir: &TempDir) -> u32 {
    wait_for_file(&dir.join("ready"), START).await;
    let gc = read_pid_file(&dir.join("gc"));
    let cmd = read_pid_file(&dir.join("cmd"));
    // setsid runs as the background job's process: wait for its exec.
    wait_until("setsid to have run", DEATH, || async {
        let sid = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, r)| r.split_whitespace().nth(3).map(str::to_owned))
                })
        };
        sid(gc).is_some() && sid(gc) != sid(cmd)
    })
    .await;
    assert!(process_alive(gc));
    gc
}

async fn await_death(pid: u32, what: &str) {
    wait_until(what, DEATH, || async { !process_alive(pid) }).await;
}

#[tokio::test]
async fn a_setsid_grandchild_dies_when_the_supervisor_is_sigkilled() {
    let (db, dir) = setup("child_sigkill").await;
    for sub in ["lock", "run"] {
        let _ = std::fs::remove_file(dir.join("ready"));
        let script = setsid_script("while :; do sleep 1; done");
        let argv = ["sh", "-c", &script];
        let cmd = match sub {
            "lock" => lock(&db, &dir, &[], &argv),
            _ => run_cmd(&db, &dir, &[], &argv),
        };
        let mut sup = Background::spawn(sub, cmd);
        let gc = grandchild(&dir).await;
        sup.kill().await;
        await_death(
            gc,
            &format!("{sub}: the setsid grandchild to die with its SIGKILLed supervisor"),
        )
        .await;
    }
}

#[tokio::test]
async fn a_setsid_grandchild_dies_on_a_normal_stop_and_when_the_command_exits() {
    let (db, dir) = setup("child_stop").await;
    // SIGTERM to the supervisor: the command stops, its grandchild dies.
    for sub in ["lock", "run"] {
        let _ = std::fs::remove_file(dir.join("ready"));
        let script = setsid_script("trap 'exit 0' TERM; while :; do sleep 1 & wait $!; done");
        let argv = ["sh", "-c", &script];
        let cmd = match sub {
            "lock" => lock(&db, &dir, &[], &argv),
            _ => run_cmd(&db, &dir, &[], &argv),
        };
        let mut sup = Background::spawn(sub, cmd);
        let gc = grandchild(&dir).await;
        sup.signal("TERM");
        assert_eq!(sup.wait(LIMIT).await, Some(0), "{}", sup.output());
        assert!(
            !process_alive(gc),
            "{sub}: the setsid grandchild outlived a stopped supervisor"
        );
    }
    // The command exits by itself, leaving the grandchild behind.
    for sub in ["lock", "run"] {
        let _ = std::fs::remove_file(dir.join("ready"));
        let script = setsid_script("exit 3");
        let argv = ["sh", "-c", &script];
        let cmd = match sub {
            "lock" => lock(&db, &dir, &[], &argv),
            _ => run_cmd(&db, &dir, &[], &argv),
        };
        run(cmd, LIMIT).await.assert_code(3);
        let gc = read_pid_file(&dir.join("gc"));
        assert!(
            !process_alive(gc),
            "{sub}: the setsid grandchild outlived its command"
        );
    }
}

#[tokio::test]
async fn a_killed_watcher_is_noticed_and_what_it_watched_is_killed() {
    let (db, dir) = setup("child_watcher").await;
    let script = setsid_script("while :; do sleep 1; done");
    let argv = ["sh", "-c", &script];
    let mut sup = Background::spawn("lock", lock(&db, &dir, &[], &argv));
    let gc = grandchild(&dir).await;
    let cmd = read_pid_file(&dir.join("cmd"));
    let watcher: u32 = std::fs::read_to_string(format!("/proc/{cmd}/stat"))
        .expect("the command runs")
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().nth(1)?.parse().ok())
        .expect("a parent pid");
    let cmdline = std::fs::read(format!("/proc/{watcher}/cmdline")).expect("watcher cmdline");
    assert!(
        String::from_utf8_lossy(&cmdline).contains("__pgelect-watch"),
        "the command's parent is not the watcher: {}",
        String::from_utf8_lossy(&cmdline)
    );
    support::send_signal(watcher, "KILL");
    // The command dies with its watcher; the supervisor says so, kills the
    // orphan it inherited, and reports the command's death.
    let code = sup.wait(LIMIT).await;
    let out = sup.output();
    assert_eq!(code, Some(137), "{out}");
    assert!(
        out.contains("the process watcher was killed"),
        "no warning about the watcher\n{out}"
    );
    assert!(!process_alive(cmd), "the command outlived its watcher");
    await_death(
        gc,
        "the setsid grandchild to die after its watcher was killed",
    )
    .await;
}

#[tokio::test]
async fn a_wrong_password_exits_77_everywhere() {
    let (db, dir) = setup("child_auth").await;
    let url = db.url().replacen(TEST_PASSWORD, "wrong-password", 1);
    assert_ne!(url, db.url(), "the test URL carries the test password");
    for args in [
        vec!["migrate"],
        vec!["status"],
        vec!["resign", "--role", "r"],
        vec!["lock", "--key", "k", "--", "true"],
        vec!["run", "--role", "r", "--", "true"],
    ] {
        let mut cmd = pgelect(&args);
        cmd.env("DATABASE_URL", &url).env("D", dir.path());
        let out = run(cmd, LIMIT).await;
        out.assert_code(77);
        // Commands that connect through the library name the cause (the
        // others' "db error" is covered elsewhere).
        if matches!(args[0], "migrate" | "lock") {
            assert!(
                out.stderr.contains("authentication"),
                "{args:?}: {}",
                out.stderr
            );
        }
        assert!(
            !out.output().contains("wrong-password"),
            "{args:?} printed the password"
        );
    }
}

#[tokio::test]
async fn the_command_starts_with_no_blocked_signal_and_its_term_trap_runs() {
    // The watcher blocks the signals it waits for; a command that inherited
    // that mask would never see SIGTERM (dash saves its mask at start). The
    // shell reads its own mask with builtins only: while it forks, dash
    // blocks every signal for a moment.
    let (db, dir) = setup("child_mask").await;
    let script = r#"trap 'echo stop >> "$D/log"; exit 0' TERM
while IFS= read -r l; do case $l in SigBlk*) echo "$l" > "$D/mask";; esac; done < /proc/$$/status
: > "$D/ready"
while :; do sleep 1 & wait $!; done"#;
    for sub in ["lock", "run"] {
        let _ = std::fs::remove_file(dir.join("ready"));
        let _ = std::fs::remove_file(dir.join("log"));
        let argv = ["sh", "-c", script];
        let cmd = match sub {
            "lock" => lock(&db, &dir, &[], &argv),
            _ => run_cmd(&db, &dir, &[], &argv),
        };
        let mut sup = Background::spawn(sub, cmd);
        wait_for_file(&dir.join("ready"), START).await;
        let mask = std::fs::read_to_string(dir.join("mask")).expect("mask written");
        assert_eq!(mask.trim(), "SigBlk:\t0000000000000000", "{sub}");
        sup.signal("TERM");
        assert_eq!(sup.wait(LIMIT).await, Some(0), "{}", sup.output());
        let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
        assert_eq!(
            log,
            "stop\n",
            "{sub}: the command's TERM trap did not run\n{}",
            sup.output()
        );
    }
}

/// The children of `pid` whose command line holds `needle`.
fn children_with(pid: u32, needle: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let parent = std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok())
                });
            let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            parent == Some(pid) && String::from_utf8_lossy(&cmdline).contains(needle)
        })
        .collect()
}

/// A standby's watcher, started while it stands by.
async fn armed_watcher(standby: &Background) -> u32 {
    let pid = standby.pid();
    let mut found = Vec::new();
    wait_until("the standby's watcher to be started ahead", START, || {
        found = children_with(pid, "__pgelect-watch");
        let one = found.len() == 1;
        async move { one }
    })
    .await;
    found[0]
}

#[tokio::test]
async fn a_standbys_watcher_started_ahead_starts_nothing_until_elected_and_then_gets_the_term() {
    let (db, dir) = setup("child_armed").await;
    let leader_script = r#"echo "$PGELECT_TERM" > "$D/leader"; trap 'exit 0' TERM; while :; do sleep 1 & wait $!; done"#;
    let standby_script = r#"echo "$PGELECT_TERM $PPID" > "$D/standby.tmp"; mv "$D/standby.tmp" "$D/standby"; trap 'exit 0' TERM; while :; do sleep 1 & wait $!; done"#;
    let mut leader = Background::spawn(
        "leader",
        run_cmd(&db, &dir, &[], &["sh", "-c", leader_script]),
    );
    wait_for_file(&dir.join("leader"), START).await;
    let leader_term: i64 = std::fs::read_to_string(dir.join("leader"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    // A standby SIGKILLed while standing: its watcher, waiting ahead, ends
    // with it and never starts the command.
    let mut doomed = Background::spawn(
        "doomed",
        run_cmd(&db, &dir, &[], &["sh", "-c", standby_script]),
    );
    let watcher = armed_watcher(&doomed).await;
    doomed.kill().await;
    await_death(
        watcher,
        "the watcher started ahead to end with its SIGKILLed supervisor",
    )
    .await;
    assert!(
        !dir.join("standby").exists(),
        "a standby's command ran while it stood by"
    );

    // A standby elected after the leader stops: the watcher it started
    // ahead starts the command, with the new term.
    let mut standby = Background::spawn(
        "standby",
        run_cmd(&db, &dir, &[], &["sh", "-c", standby_script]),
    );
    let watcher = armed_watcher(&standby).await;
    assert!(
        !dir.join("standby").exists(),
        "a standby's command ran while it stood by"
    );
    leader.signal("TERM");
    assert_eq!(leader.wait(LIMIT).await, Some(0), "{}", leader.output());
    wait_for_file(&dir.join("standby"), START).await;
    let got = std::fs::read_to_string(dir.join("standby")).unwrap();
    let (term, parent) = got.trim().split_once(' ').expect("term and parent");
    assert_eq!(
        term.parse::<i64>().unwrap(),
        leader_term + 1,
        "the elected standby's command got the wrong PGELECT_TERM\n{}",
        standby.output()
    );
    assert_eq!(
        parent.parse::<u32>().unwrap(),
        watcher,
        "the command was not started by the watcher started ahead"
    );
    standby.signal("TERM");
    assert_eq!(standby.wait(LIMIT).await, Some(0), "{}", standby.output());
}
