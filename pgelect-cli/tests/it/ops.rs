//! The command as an operator meets it : `run` narrates at the
//! default level without colour on a pipe; errors name their cause and the
//! next step; `status` and `resign` refuse unknown roles; `forget` removes a
//! stale role and refuses a live one; `pgelect lock` has flock's habits and
//! its holders show in `status`.

use crate::support;

use std::time::Duration;

use pgelect_testkit::TestDb;
use support::{pgelect, run, wait_until, Background, TempDir};

const START: Duration = Duration::from_secs(15);
const QUICK: Duration = Duration::from_secs(10);

/// The leader's command: marks that it runs, exits 0 on SIGTERM.
const IDLE: &str = r#"trap 'exit 0' TERM
: > "$D/leading-$N"
while :; do sleep 1 & wait $!; done"#;

async fn migrated(hint: &str) -> TestDb {
    let db = TestDb::new(hint).await;
    let options = pgelect::ConnectOptions::from_url(&db.url()).expect("test URL parses");
    pgelect::migrate(&options).await.expect("migrate");
    db
}

fn candidate(db: &TestDb, dir: &TempDir, role: &str, node: &str, extra: &[&str]) -> Background {
    let mut cmd = pgelect(extra.iter().copied());
    cmd.args(["run", "--role", role, "--id", node, "--ttl", "3s"])
        .args(["--database-url", &db.url(), "--", "sh", "-c", IDLE])
        .env("D", dir.path())
        .env("N", node);
    Background::spawn(node, cmd)
}

async fn stderr_has(sup: &Background, what: &str) {
    wait_until(
        &format!("{what:?} on {}'s stderr", sup.name),
        START,
        || async { sup.output().contains(what) },
    )
    .await;
}

#[tokio::test]
async fn run_narrates_at_the_default_level_without_colour_on_a_pipe() {
    let db = migrated("ops_narrate").await;
    let dir = TempDir::new("ops_narrate");
    let mut a = candidate(&db, &dir, "r", "node-a", &[]);
    support::wait_for_file(&dir.join("leading-node-a"), START).await;
    let mut b = candidate(&db, &dir, "r", "node-b", &["--log-format", "json"]);
    stderr_has(&b, "\"event\":\"standing\"").await;
    // node-b waits for the role's lock before the resign, or node-a, standing
    // again at once, could win once more.
    support::await_advisory_locks(&db.connect().await, 1, 1).await;
    stderr_has(&a, "command started (watcher pid").await;
    let resign = run(
        pgelect(["resign", "--role", "r", "--database-url", &db.url()]),
        START,
    )
    .await;
    resign.assert_code(0);
    support::wait_for_file(&dir.join("leading-node-b"), START).await;
    stderr_has(&a, "handed over role \"r\" (term 1)").await;
    stderr_has(&b, "\"event\":\"child_started\"").await;
    a.signal("TERM");
    b.signal("TERM");
    assert_eq!(a.wait(QUICK).await, Some(0));
    assert_eq!(b.wait(QUICK).await, Some(0));
    let text = a.output();
    for line in [
        "standing for role \"r\" as node \"node-a\" (session backend, standard timing: ttl 3s, heartbeat 200ms answered within 200ms, handover delay 600ms)",
        "elected leader of role \"r\" with term 1 after",
        "command started (watcher pid",
        "resign requested for role \"r\" (term 1)",
        "command exited with code 0",
        "handed over role \"r\" (term 1)",
        "standing for role \"r\" again as node \"node-a\"",
    ] {
        assert!(text.contains(line), "{line:?} missing\n{text}");
    }
    let resign_line = text
        .lines()
        .find(|l| l.contains("resign requested"))
        .expect("checked above");
    assert!(resign_line.contains("INFO"), "{resign_line}");
    let json = b.output();
    for event in [
        "standing",
        "elected",
        "child_started",
        "child_exited",
        "handed_over",
    ] {
        assert!(
            json.contains(&format!("\"event\":\"{event}\"")),
            "{event} missing\n{json}"
        );
    }
    assert!(json.contains("\"term\":2"), "{json}");
    for out in [&text, &json] {
        assert!(!out.contains('\u{1b}'), "colour codes on a pipe\n{out}");
    }
}

/// Each command that reaches the database, with its own arguments.
fn commands() -> Vec<Vec<&'static str>> {
    vec![
        vec!["migrate"],
        vec!["status"],
        vec!["resign", "--role", "r"],
        vec!["lock", "--key", "k", "--", "true"],
        vec!["run", "--role", "r", "--", "true"],
    ]
}

/// Runs every command against `env` (name, value pairs) and checks that
/// each says all of `said` and exits `code`.
async fn each_command_says(what: &str, env: &[(&str, String)], said: &[&str], code: i32) {
    for c in commands() {
        let mut cmd = pgelect(&c);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let r = run(cmd, QUICK).await;
        for s in said {
            assert!(
                r.stderr.contains(s),
                "{what}: {c:?} does not say {s:?}\n{}",
                r.stderr
            );
        }
        assert!(
            !r.stderr.contains("db error"),
            "{what}: {c:?}\n{}",
            r.stderr
        );
        assert_eq!(r.code, Some(code), "{what}: {c:?}\n{}", r.stderr);
    }
}

#[tokio::test]
async fn a_missing_database_is_named_by_every_command_and_exits_78() {
    let db = migrated("ops_no_db").await;
    let url = format!(
        "postgres://postgres:{}@{}/no_such_db",
        pgelect_testkit::TEST_PASSWORD,
        db.server_addr()
    );
    let said = [
        "database \"no_such_db\" does not exist",
        "check the database name",
    ];
    each_command_says("missing database", &[("DATABASE_URL", url)], &said, 78).await;
}

#[tokio::test]
async fn an_unknown_user_and_a_wrong_password_get_the_servers_words_and_exit_77() {
    let db = migrated("ops_auth").await;
    let (addr, name) = (db.server_addr(), db.name().to_owned());
    let pw = pgelect_testkit::TEST_PASSWORD;
    let unknown = format!("postgres://no_such_user:{pw}@{addr}/{name}");
    // With password authentication the server does not tell an unknown user
    // from a wrong password (so as not to reveal which users exist).
    let said = [
        "authentication failed for user \"no_such_user\"",
        "check the user name and password",
    ];
    each_command_says("unknown user", &[("DATABASE_URL", unknown)], &said, 77).await;
    let wrong = format!("postgres://postgres:wrong@{addr}/{name}");
    let said = [
        "password authentication failed for user \"postgres\"",
        "check the user name and password",
    ];
    each_command_says("wrong password", &[("DATABASE_URL", wrong)], &said, 77).await;
}

#[tokio::test]
async fn a_refused_connection_names_host_and_port_and_exits_69() {
    let free = pgelect_testkit::free_port();
    let url = format!("postgres://postgres:x@127.0.0.1:{free}/x");
    let at = format!("127.0.0.1:{free}");
    let said = [
        at.as_str(),
        "Connection refused",
        "check that PostgreSQL is running there",
    ];
    each_command_says("refused", &[("DATABASE_URL", url)], &said, 69).await;
}

#[tokio::test]
async fn without_a_url_the_error_says_what_was_tried_and_how_to_name_a_database() {
    let free = pgelect_testkit::free_port();
    let env = [
        ("PGHOST", "127.0.0.1".to_owned()),
        ("PGPORT", free.to_string()),
    ];
    let at = format!("127.0.0.1:{free}");
    let said = [
        at.as_str(),
        "no database was named (no --database-url, --database-url-file or DATABASE_URL)",
        "pgelect used PGHOST, PGPORT and libpq's defaults for the rest",
        "name the database with --database-url URL or DATABASE_URL=URL",
    ];
    each_command_says("no URL", &env, &said, 69).await;
    // A URL given: no such hint.
    let mut cmd = pgelect(["status"]);
    cmd.env("DATABASE_URL", format!("postgres://u:p@{at}/x"));
    let r = run(cmd, QUICK).await;
    r.assert_code(69);
    assert!(!r.stderr.contains("no database was named"), "{}", r.stderr);
}

#[tokio::test]
async fn a_ttl_too_short_says_the_shortest_accepted_in_the_commands_terms() {
    let db = migrated("ops_ttl").await;
    // The lease backend's statements have no heartbeat to fit in: it accepts
    // shorter TTLs, so the session backend (the default) is the case here.
    for backend in ["session"] {
        let mut cmd = pgelect([
            "run",
            "--role",
            "r",
            "--ttl",
            "20ms",
            "--backend",
            backend,
            "--",
            "true",
        ]);
        cmd.env("DATABASE_URL", db.url());
        let r = run(cmd, QUICK).await;
        r.assert_code(64);
        assert!(
            r.stderr
                .contains("--ttl 20ms is too short: the shortest --ttl accepted is 26ms"),
            "{}",
            r.stderr
        );
        for internal in ["heartbeat_timeout", "safety_margin"] {
            assert!(!r.stderr.contains(internal), "{}", r.stderr);
        }
        // The value it names is accepted (the command then runs and exits 0).
        let shortest = r
            .stderr
            .split("accepted is ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .expect("a value");
        let mut cmd = pgelect([
            "run",
            "--role",
            "r",
            "--ttl",
            shortest,
            "--backend",
            backend,
            "--",
            "true",
        ]);
        cmd.env("DATABASE_URL", db.url());
        // Accepted: it stands. It then normally leads, runs `true` and
        // exits 0; on a loaded machine a 30 ms lease may be lost before
        // the command starts, again and again, which is no refusal.
        let mut shortest_run = Background::spawn("shortest ttl", cmd);
        match tokio::time::timeout(START, shortest_run.wait(START * 4)).await {
            Ok(code) => assert_eq!(code, Some(0), "{}", shortest_run.output()),
            Err(_) => {
                println!("--ttl {shortest}: still standing after {START:?} (its lease lost before acting on a loaded machine)");
                shortest_run.kill().await;
            }
        }
        let out = shortest_run.output();
        assert!(out.contains("standing for role"), "{out}");
        assert!(!out.contains("too short"), "{out}");
    }
}

#[tokio::test]
async fn timing_options_are_checked_in_the_commands_terms_and_logged() {
    let db = migrated("ops_timing").await;
    let refused = |args: &[&str]| {
        let mut cmd = pgelect(["run", "--role", "r"]);
        cmd.args(args)
            .args(["--", "true"])
            .env("DATABASE_URL", db.url());
        cmd
    };
    // A handover delay below detection: the inequality and the values.
    let r = run(
        refused(&[
            "--heartbeat",
            "500ms",
            "--heartbeat-timeout",
            "300ms",
            "--handover-delay",
            "100ms",
        ]),
        QUICK,
    )
    .await;
    r.assert_code(64);
    for needle in [
        "--handover-delay 100ms must be at least",
        "--heartbeat 500ms + --heartbeat-timeout 300ms",
        "= 800ms",
    ] {
        assert!(r.stderr.contains(needle), "{needle:?} in {}", r.stderr);
    }
    assert!(!r.stderr.contains("heartbeat_timeout"), "{}", r.stderr);
    // A renewal interval past the deadline.
    let r = run(refused(&["--ttl", "2s", "--renew-every", "1800ms"]), QUICK).await;
    r.assert_code(64);
    assert!(
        r.stderr
            .contains("--renew-every 1.800s must be shorter than --ttl 2s")
            || r.stderr.contains("--renew-every 1.8s"),
        "{}",
        r.stderr
    );
    // The fast profile is the session backend's.
    let r = run(refused(&["--profile", "fast", "--backend", "lease"]), QUICK).await;
    r.assert_code(64);
    assert!(
        r.stderr.contains("fast profile is for the session backend"),
        "{}",
        r.stderr
    );
    // So are the other session-only options, naming them (the lease
    // backend has nothing they could set).
    for flag in ["--heartbeat", "--handover-delay"] {
        let r = run(refused(&[flag, "200ms", "--backend", "lease"]), QUICK).await;
        r.assert_code(64);
        assert!(
            r.stderr
                .contains(&format!("{flag} is for --backend session")),
            "{}",
            r.stderr
        );
    }
    // Accepted timing is logged when standing: the profile's derived values.
    for (args, needle) in [
        (
            &["--profile", "fast"][..],
            "fast timing: ttl 15s, heartbeat 20ms answered within 25ms, handover delay 70ms",
        ),
        (
            &["--ttl", "2s"][..],
            "standard timing: ttl 2s, heartbeat 133ms answered within 133ms, handover delay 399ms",
        ),
        (
            &[][..],
            "standard timing: ttl 15s, heartbeat 1s answered within 1s, handover delay 2.500s",
        ),
    ] {
        let r = run(refused(args), START).await;
        r.assert_code(0);
        assert!(r.stderr.contains(needle), "{needle:?} in {}", r.stderr);
    }
}

/// `pgelect lock --key NAME --id NODE` holding until `$D/release` exists.
fn holding_lock(db: &TestDb, dir: &TempDir, key: &str, node: &str) -> Background {
    let mut cmd = pgelect(["lock", "--key", key, "--id", node, "--", "sh", "-c"]);
    cmd.arg(r#": > "$D/held-$N"; while [ ! -e "$D/release" ]; do sleep 0.05; done"#)
        .env("DATABASE_URL", db.url())
        .env("D", dir.path())
        .env("N", node);
    Background::spawn(node, cmd)
}

#[tokio::test]
async fn lock_has_flocks_habits_and_names_the_holder() {
    let db = migrated("ops_flock").await;
    let dir = TempDir::new("ops_flock");
    let mut holder = holding_lock(&db, &dir, "deploy", "node-a");
    support::wait_for_file(&dir.join("held-node-a"), START).await;
    let try_lock = |extra: &[&str]| {
        let mut cmd = pgelect(["lock", "--key", "deploy"]);
        cmd.args(extra)
            .args(["--", "true"])
            .env("DATABASE_URL", db.url());
        cmd
    };
    // -w takes plain seconds as flock does; -E picks the conflict code.
    let r = run(try_lock(&["-w", "0.5", "-E", "3"]), QUICK).await;
    r.assert_code(3);
    assert!(
        r.stderr.contains("timed out after 0.5s waiting for lock \"deploy\" (not acquired), held by \"node-a\" (host 127.0.0.1, pid "),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains(", for "), "how long: {}", r.stderr);
    assert!(!r.stderr.contains("0.50"), "human units: {}", r.stderr);
    // --no-wait: the default code 75, the holder named.
    let r = run(try_lock(&["--no-wait"]), QUICK).await;
    r.assert_code(75);
    assert!(
        r.stderr
            .contains("lock \"deploy\" is held by \"node-a\" (host 127.0.0.1, pid "),
        "{}",
        r.stderr
    );
    let r = run(try_lock(&["--no-wait", "--conflict-exit-code", "1"]), QUICK).await;
    r.assert_code(1);
    std::fs::write(dir.join("release"), "").expect("release");
    assert_eq!(holder.wait(QUICK).await, Some(0));
    run(try_lock(&["-w", "1"]), QUICK).await.assert_code(0);
}

fn cmd(db: &TestDb, args: &[&str]) -> tokio::process::Command {
    let mut cmd = pgelect(args);
    cmd.env("DATABASE_URL", db.url());
    cmd
}

#[tokio::test]
async fn status_resign_and_forget_cannot_mislead() {
    let db = migrated("ops_status").await;
    let dir = TempDir::new("ops_status");
    let admin = db.connect().await;
    let mut a = candidate(&db, &dir, "r", "node-a", &[]);
    support::wait_for_file(&dir.join("leading-node-a"), START).await;
    let mut b = candidate(&db, &dir, "r", "node-b", &[]);
    support::await_advisory_locks(&admin, 1, 1).await;
    let mut locker = holding_lock(&db, &dir, "deploy", "node-c");
    support::wait_for_file(&dir.join("held-node-c"), START).await;

    // The table: the leader apart, the standby waiting, the lock and its holder.
    let r = run(cmd(&db, &["status"]), QUICK).await;
    r.assert_code(0);
    assert!(
        r.stdout
            .contains("node-a (holding); 1 standing by: node-b (waiting)"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("\"deploy\": held by node-c (host 127.0.0.1, backend pid "),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("exclusive, since 20"), "{}", r.stdout);
    // JSON says which pid it is and where from.
    let r = run(cmd(&db, &["status", "--json"]), QUICK).await;
    r.assert_code(0);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("JSON");
    let c = &v["roles"][0]["candidates"][0];
    assert!(
        c["backend_pid"].as_i64().is_some() && c.get("pid").is_none(),
        "{v}"
    );
    assert_eq!(c["client_addr"], "127.0.0.1", "{v}");
    let l = &v["locks"][0];
    assert_eq!(
        (l["name"].as_str(), l["node"].as_str(), l["state"].as_str()),
        (Some("deploy"), Some("node-c"), Some("holding")),
        "{v}"
    );
    assert!(
        l["since"].as_str().is_some() && l["backend_pid"].as_i64().is_some(),
        "{v}"
    );

    // Unknown roles are errors that name the known ones.
    for args in [
        &["status", "--role", "nope"][..],
        &["resign", "--role", "nope"],
        &["forget", "--role", "nope"],
    ] {
        let r = run(cmd(&db, args), QUICK).await;
        r.assert_code(66);
        assert!(
            r.stderr.contains("no role \"nope\" in schema pgelect")
                && r.stderr.contains("known roles: \"r\""),
            "{args:?}: {}",
            r.stderr
        );
    }
    // A live role cannot be forgotten.
    let r = run(cmd(&db, &["forget", "--role", "r"]), QUICK).await;
    r.assert_code(75);
    assert!(
        r.stderr
            .contains("role \"r\" not removed: node-a leads it with term 1"),
        "{}",
        r.stderr
    );
    // node-a gone: node-b takes over; still refused (it leads, node-a stands no more).
    a.signal("TERM");
    assert_eq!(a.wait(QUICK).await, Some(0));
    support::wait_for_file(&dir.join("leading-node-b"), START).await;
    let r = run(cmd(&db, &["forget", "--role", "r"]), QUICK).await;
    r.assert_code(75);
    assert!(
        r.stderr.contains("node-b leads it with term 2"),
        "{}",
        r.stderr
    );
    b.signal("TERM");
    assert_eq!(b.wait(QUICK).await, Some(0));
    // No leader now: resign fails clearly.
    let r = run(cmd(&db, &["resign", "--role", "r"]), QUICK).await;
    r.assert_code(75);
    assert!(
        r.stderr
            .contains("role \"r\" has no leader (last term 2); nothing to resign"),
        "{}",
        r.stderr
    );
    // One more term, then nobody.
    let mut p = candidate(&db, &dir, "r", "node-p", &[]);
    support::wait_for_file(&dir.join("leading-node-p"), START).await;
    p.signal("TERM");
    assert_eq!(p.wait(QUICK).await, Some(0));
    // Nobody left: forgotten, and then unknown.
    let r = run(cmd(&db, &["forget", "--role", "r"]), QUICK).await;
    r.assert_code(0);
    assert!(
        r.stdout.contains("forgot role \"r\"") && r.stdout.contains("last term 3 is kept"),
        "{}",
        r.stdout
    );
    let r = run(cmd(&db, &["status", "--role", "r"]), QUICK).await;
    r.assert_code(66);
    assert!(r.stderr.contains("there are no roles yet"), "{}", r.stderr);
    let r = run(cmd(&db, &["forget", "--role", "r"]), QUICK).await;
    r.assert_code(66);
    // A forgotten role's terms never repeat: the next leader continues.
    let mut q = candidate(&db, &dir, "r", "node-q", &[]);
    support::wait_for_file(&dir.join("leading-node-q"), START).await;
    let admin = db.connect().await;
    let term: i64 = admin
        .query_one("SELECT term FROM pgelect.leaders WHERE role = 'r'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(term > 3, "term {term} after forgetting a role at term 3");
    q.signal("TERM");
    assert_eq!(q.wait(QUICK).await, Some(0));
    std::fs::write(dir.join("release"), "").expect("release");
    assert_eq!(locker.wait(QUICK).await, Some(0));
}

/// `demo --keep` keeps its own server for trying things by hand, says how to
/// reach it and how to stop it, never uses DATABASE_URL, and leaves nothing
/// behind: not its data, not the test kit's initdb template (nothing in
/// `/dev/shm`).
#[cfg(feature = "throwaway")]
#[tokio::test]
async fn demo_keep_keeps_its_server_until_sigterm_and_leaves_nothing_behind() {
    let mut cmd = pgelect(["demo", "--keep", "--ttl", "2s"]);
    cmd.env("DATABASE_URL", "postgres://prod:secret@192.0.2.1:5432/prod");
    let mut demo = Background::spawn("demo", cmd);
    let data = demo
        // initdb and a first start: slower than a command's start on a
        // loaded machine (CI once took over 15 s).
        .next_line("the throwaway server", START * 2, |l| {
            l.contains("(data in ")
        })
        .await;
    let data = std::path::PathBuf::from(
        data.split_once("(data in ")
            .and_then(|(_, r)| r.split_once(')'))
            .map(|(p, _)| p)
            .expect("a data directory"),
    );
    assert!(!data.starts_with("/dev/shm"), "{}", data.display());
    let base = data
        .ancestors()
        .find(|a| {
            a.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pgelect-demo-server-"))
        })
        .unwrap_or_else(|| panic!("{} is not in the demo's own directory", data.display()))
        .to_owned();
    demo.next_line("the kept server", Duration::from_secs(120), |l| {
        l.contains("keeps running on 127.0.0.1:")
    })
    .await;
    let status_line = demo
        .next_line("how to reach it", QUICK, |l| {
            l.trim_end().ends_with(" status")
        })
        .await;
    let file = status_line
        .split_once("--database-url-file ")
        .and_then(|(_, r)| r.split_whitespace().next())
        .expect("the URL file")
        .to_owned();
    let r = run(
        pgelect(["--database-url-file", &file, "status", "--role", "demo"]),
        QUICK,
    )
    .await;
    r.assert_code(0);
    assert!(r.stdout.contains("demo"), "{}", r.stdout);
    demo.signal("TERM");
    assert_eq!(
        demo.wait(Duration::from_secs(30)).await,
        Some(0),
        "{}",
        demo.output()
    );
    assert!(
        demo.output().contains("throwaway PostgreSQL removed"),
        "{}",
        demo.output()
    );
    assert!(!base.exists(), "{} left behind", base.display());
    assert!(!std::path::Path::new(&file).exists(), "{file} left behind");
}
