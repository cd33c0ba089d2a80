//! The `pgelect` binary when another database user squats a key, and what
//! `status` prints from the database: a login role with CONNECT only takes
//! a role's, a lock's or the migration's key with `pg_advisory_lock` on its
//! own connection, and `run -v`, `status`, `migrate` and `lock` name it (pid,
//! user, application name); `status` escapes control characters and says
//! why it could not connect.

use crate::support;

use std::time::{Duration, Instant};

use pgelect::LockKey;
use pgelect_testkit::TestDb;
use support::{pgelect, run, wait_until, Background};
use tokio_postgres::{Client, NoTls};

/// Bound on a quick command (status, migrate, lock that gives up).
const QUICK: Duration = Duration::from_secs(20);

/// A login role with CONNECT only, connected on its own, naming itself
/// `app`: its client, backend pid and role name.
async fn squatter(db: &TestDb, app: &str) -> (Client, i32, String) {
    let url = db.create_role("squatter", "squat-pw", false).await;
    let mut config: tokio_postgres::Config = url.parse().unwrap();
    config.application_name(app);
    let (client, connection) = config.connect(NoTls).await.expect("squatter connects");
    tokio::spawn(connection);
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    (client, pid, db.role_name("squatter"))
}

async fn take(client: &Client, name: &str) {
    let LockKey::Single(k) = LockKey::from_name(name).unwrap() else {
        unreachable!("names hash to single keys")
    };
    client
        .execute("SELECT pg_advisory_lock($1)", &[&k])
        .await
        .expect("the squatter takes the key");
}

/// `pgelect ARGS` on `db`; `lock` gets the command `true` after `--`.
fn command(db: &TestDb, args: &[&str]) -> tokio::process::Command {
    let mut cmd = pgelect(args);
    cmd.args(["--database-url", &db.url()]);
    if args.first() == Some(&"lock") {
        cmd.args(["--", "true"]);
    }
    cmd
}

async fn migrated(hint: &str) -> TestDb {
    let db = TestDb::new(hint).await;
    let options = pgelect::ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&options).await.expect("migrate");
    db
}

#[tokio::test]
async fn run_warns_about_a_squatter_and_status_shows_it_in_text_and_json() {
    let db = migrated("cli_squat_run").await;
    let (sq, pid, user) = squatter(&db, "psql").await;
    take(&sq, "election:pgelect:squatted").await;

    let mut cmd = pgelect(["-v", "run", "--role", "squatted", "--id", "node-a"]);
    cmd.args(["--database-url", &db.url(), "--", "sh", "-c", "exit 0"]);
    let mut candidate = Background::spawn("node-a", cmd);
    // A blocking standby looks after each 10 s slice of its wait.
    let needle = format!("pid {pid} ");
    let waited = wait_until("the standby's warning", Duration::from_secs(40), || {
        let out = candidate.output();
        let found = out.lines().any(|l| {
            l.contains("WARN")
                && l.contains(&needle)
                && l.contains(&format!("{user:?}"))
                && l.contains("\"psql\"")
        });
        async move { found }
    })
    .await;
    println!("warned after {waited:?}");

    let text = run(command(&db, &["status"]), QUICK).await;
    text.assert_code(0);
    println!("{}", text.stdout);
    let warning = text
        .stdout
        .lines()
        .find(|l| l.starts_with("WARNING: role squatted"))
        .unwrap_or_else(|| panic!("no squatter warning:\n{}", text.stdout));
    assert!(
        warning.contains(&needle) && warning.contains(&user) && warning.contains("\"psql\""),
        "{warning}"
    );
    assert!(
        text.stdout.contains("node-a (waiting)") || text.stdout.contains("node-a (standing)"),
        "the standby is still listed:\n{}",
        text.stdout
    );

    let json = run(command(&db, &["status", "--json"]), QUICK).await;
    json.assert_code(0);
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("JSON");
    let role = &v["roles"][0];
    assert_eq!(role["role"], "squatted", "{v}");
    assert_eq!(role["holder"], serde_json::Value::Null);
    assert_eq!(role["squatters"][0]["backend_pid"], pid, "{v}");
    assert_eq!(role["squatters"][0]["user"], user.as_str());
    assert_eq!(role["squatters"][0]["application_name"], "psql");
    assert_eq!(role["squatters"][0]["claims_pgelect"], false);
    // The standby is listed (waiting, or for the milliseconds between two
    // slices of its wait, standing); the squatter is not a candidate.
    let candidates = role["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 1, "{v}");
    assert_eq!(candidates[0]["node"], "node-a", "{v}");
    assert_ne!(candidates[0]["backend_pid"], pid, "{v}");

    // Without the candidate, asking for the role still shows the squatter.
    candidate.kill().await;
    let alone = run(
        command(&db, &["status", "--json", "--role", "squatted"]),
        QUICK,
    )
    .await;
    alone.assert_code(0);
    let v: serde_json::Value = serde_json::from_str(&alone.stdout).expect("JSON");
    assert_eq!(v["roles"][0]["squatters"][0]["backend_pid"], pid, "{v}");
}

#[tokio::test]
async fn migrate_with_its_lock_squatted_exits_75_within_its_bound_naming_the_holder() {
    let db = TestDb::new("cli_squat_migrate").await;
    let (sq, pid, user) = squatter(&db, "migration-squatter").await;
    take(&sq, "pgelect.migrate.pgelect").await;
    let started = Instant::now();
    let out = run(command(&db, &["migrate", "--timeout", "1s"]), QUICK).await;
    println!("{:?} {}", started.elapsed(), out.stderr);
    out.assert_code(75);
    assert!(out.elapsed < Duration::from_secs(10), "{:?}", out.elapsed);
    for needle in [
        "migration lock",
        &format!("pid {pid} "),
        &user,
        "\"migration-squatter\"",
        "pg_terminate_backend",
    ] {
        assert!(
            out.stderr.contains(needle),
            "{needle:?} missing: {}",
            out.stderr
        );
    }
}

#[tokio::test]
async fn lock_no_wait_and_timeout_name_the_holder() {
    let db = TestDb::new("cli_squat_lock").await;
    let (sq, pid, user) = squatter(&db, "lock-squatter").await;
    take(&sq, "nightly").await;
    let needle = format!("held by pid {pid} (user {user:?}, application \"lock-squatter\"");

    let out = run(
        command(&db, &["lock", "--key", "nightly", "--no-wait"]),
        QUICK,
    )
    .await;
    out.assert_code(75);
    println!("{}", out.stderr);
    assert!(out.stderr.contains(&needle), "{}", out.stderr);
    assert!(out.stderr.contains("--no-wait"), "{}", out.stderr);

    let out = run(
        command(&db, &["lock", "--key", "nightly", "--timeout", "500ms"]),
        QUICK,
    )
    .await;
    out.assert_code(75);
    println!("{}", out.stderr);
    assert!(
        out.stderr
            // The wording flock users expect.
            .contains("timed out after 0.5s waiting for lock \"nightly\" (not acquired), held by "),
        "a rounded duration and the lock's name: {}",
        out.stderr
    );
    assert!(out.stderr.contains(&needle), "{}", out.stderr);
}

#[tokio::test]
async fn status_escapes_control_characters_from_the_database() {
    let db = migrated("cli_squat_escape").await;
    let admin = db.connect().await;
    let role = "evil\u{1b}[2J\u{7f}\u{9b}31m";
    let holder = "node\u{1b}]0;pwned\u{7}\u{202e}";
    admin
        .execute(
            "INSERT INTO pgelect.leaders (role, holder, term, backend, holder_pid, acquired_at, renewed_at, lease_until)
             VALUES ($1, $2, 3, 'session', 0, now(), now(), now() + interval '1 minute')",
            &[&role, &holder],
        )
        .await
        .unwrap();
    for args in [&["status"][..], &["status", "--json"][..]] {
        let out = run(command(&db, args), QUICK).await;
        out.assert_code(0);
        println!("{}", out.stdout.escape_debug());
        for bad in ['\u{1b}', '\u{7}', '\u{7f}', '\u{9b}', '\u{202e}'] {
            assert!(
                !out.stdout.contains(bad),
                "{args:?} printed {bad:?} raw: {}",
                out.stdout.escape_debug()
            );
        }
        if args.len() == 1 {
            assert!(out.stdout.contains("evil\\u{1b}[2J"), "{}", out.stdout);
        } else {
            let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("JSON");
            assert_eq!(v["roles"][0]["role"], role, "the JSON value is exact");
            assert_eq!(v["roles"][0]["holder"], holder);
        }
    }
}

#[tokio::test]
async fn status_and_resign_print_the_real_cause_of_a_failure() {
    let db = TestDb::new("cli_squat_causes").await;
    let url = db.create_role("reader", "right-pw", false).await;
    assert!(
        url.contains("right-pw"),
        "the role's URL carries its password"
    );
    let wrong_db = url.replace(db.name(), "no_such_database_here");
    let wrong_pw = url.replace("right-pw", "wrong-pw");
    let cases: [(&str, &str, &str); 3] = [
        (
            &wrong_db,
            "database \"no_such_database_here\" does not exist",
            "right-pw",
        ),
        (&wrong_pw, "password authentication failed", "wrong-pw"),
        // The schema was never installed in this database.
        (&url, "run `pgelect migrate`", "right-pw"),
    ];
    for (target, cause, password) in cases {
        for sub in [&["status"][..], &["resign", "--role", "r"][..]] {
            let mut cmd = pgelect(sub);
            cmd.args(["--database-url", target]);
            let out = run(cmd, QUICK).await;
            println!("{sub:?}: {:?} {}", out.code, out.stderr);
            assert_ne!(out.code, Some(0));
            assert!(
                out.stderr.contains(cause),
                "{sub:?} does not say {cause:?}: {}",
                out.stderr
            );
            assert!(!out.output().contains(password), "password printed");
            assert!(
                !out.stderr.contains("db error"),
                "the driver's empty words: {}",
                out.stderr
            );
        }
    }
}

#[tokio::test]
async fn resign_escapes_the_holder_it_names() {
    let db = migrated("cli_squat_resign_escape").await;
    let admin = db.connect().await;
    let holder = "node\u{1b}]0;pwned\u{7}\u{202e}";
    admin
        .execute(
            "INSERT INTO pgelect.leaders (role, holder, term, backend, holder_pid, acquired_at, renewed_at, lease_until)
             VALUES ('r', $1, 3, 'session', 0, now(), now(), now() + interval '1 minute')",
            &[&holder],
        )
        .await
        .unwrap();
    // Nobody is listening: the request is made, no new term follows (75).
    let out = run(
        command(&db, &["resign", "--role", "r", "--timeout", "1s"]),
        QUICK,
    )
    .await;
    println!("{}", out.output().escape_debug());
    out.assert_code(75);
    // (Standard error carries the log, coloured when asked.)
    for bad in ['\u{1b}', '\u{7}', '\u{202e}'] {
        assert!(
            !out.stdout.contains(bad),
            "{bad:?} printed raw: {}",
            out.stdout.escape_debug()
        );
    }
    assert!(
        out.stdout
            .contains("asked node\\u{1b}]0;pwned\\u{7}\\u{202e} (term 3)"),
        "{}",
        out.stdout
    );
}

/// A column whose type is not the one pgelect reads (a schema altered by
/// hand) is an error naming the column, not a panic.
#[tokio::test]
async fn status_reports_a_column_of_the_wrong_type_without_panicking() {
    let db = migrated("cli_squat_wrong_type").await;
    let admin = db.connect().await;
    admin
        .batch_execute(
            "ALTER TABLE pgelect.leaders ALTER COLUMN term TYPE int4;
             INSERT INTO pgelect.leaders (role, holder, term, backend) VALUES ('r', 'a', 1, 'lease')",
        )
        .await
        .unwrap();
    let out = run(command(&db, &["status"]), QUICK).await;
    println!("{:?} {}", out.code, out.stderr);
    out.assert_code(70);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    assert!(
        out.stderr.contains("error deserializing column 2"),
        "{}",
        out.stderr
    );
}
