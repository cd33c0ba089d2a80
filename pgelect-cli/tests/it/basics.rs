//! The real `pgelect` binary: help, usage errors, `migrate`, where the
//! database URL comes from, and that passwords are never printed.
//!
//! Every test gets its own database on the per-process test cluster (or on
//! `PGELECT_TEST_DATABASE_URL`). Every run is bounded; measured times are
//! printed (`cargo test -- --nocapture`).

use crate::support;

use std::time::Duration;

use pgelect_testkit::{free_port, FaultProxy, TestDb, TEST_PASSWORD};
use support::{pgelect, run, schema_exists, Run};

/// Bound for commands that need no database.
const QUICK: Duration = Duration::from_secs(10);
/// Bound for commands that talk to the test database.
const DB_RUN: Duration = Duration::from_secs(30);

/// A URL for `db` with `password` instead of the real one.
fn with_password(db: &TestDb, password: &str) -> String {
    let url = db.url();
    assert!(url.contains(TEST_PASSWORD), "test URL carries the password");
    url.replace(TEST_PASSWORD, password)
}

/// A URL for `db`'s database on a port where nothing listens.
fn closed_port_url(db: &TestDb, password: &str) -> String {
    format!(
        "postgres://postgres:{password}@127.0.0.1:{}/{}",
        free_port(),
        db.name()
    )
}

#[tokio::test]
async fn help_on_every_command_exits_0_and_shows_examples() {
    for args in [
        &["--help"][..],
        &["help"][..],
        &["lock", "--help"][..],
        &["migrate", "--help"][..],
        &["help", "lock"][..],
    ] {
        let out = run(pgelect(args), QUICK).await;
        out.assert_code(0);
        assert!(
            out.stdout.contains("Examples:"),
            "`pgelect {}` shows no examples:\n{}",
            args.join(" "),
            out.stdout
        );
        assert!(
            out.stderr.is_empty(),
            "help wrote to stderr: {}",
            out.stderr
        );
    }
    let lock = run(pgelect(["lock", "--help"]), QUICK).await;
    for needle in [
        "--key",
        "--no-wait",
        "--timeout",
        "--shared",
        "--grace",
        "75",
    ] {
        assert!(lock.stdout.contains(needle), "lock --help lacks {needle}");
    }
    run(pgelect(["--version"]), QUICK).await.assert_code(0);
}

#[tokio::test]
async fn an_unknown_flag_is_a_usage_error() {
    for args in [
        &["--no-such-flag", "migrate"][..],
        &["migrate", "--no-such-flag"][..],
        &["lock", "--key", "k", "--no-such-flag", "--", "true"][..],
        &["no-such-command"][..],
        &[][..],
    ] {
        let out = run(pgelect(args), QUICK).await;
        out.assert_code(64);
        assert!(
            out.stderr.contains("Usage:"),
            "`pgelect {}`: no usage on stderr:\n{}",
            args.join(" "),
            out.stderr
        );
    }
}

/// Every duration flag of every command names the flag and says why a
/// negative or zero value is refused (a negative one used to get clap's
/// "unexpected argument '-1'" instead).
#[tokio::test]
async fn a_negative_or_zero_duration_is_refused_by_name_on_every_command() {
    let run_ = |flag: &'static str, v: &'static str| {
        vec![
            "run",
            "--role",
            "r",
            "--backend",
            "lease",
            flag,
            v,
            "--",
            "true",
        ]
    };
    let mut cases: Vec<Vec<&str>> = Vec::new();
    for flag in [
        "--ttl",
        "--retry-every",
        "--renew-every",
        "--grace",
        "--heartbeat",
        "--heartbeat-timeout",
        "--handover-delay",
        "--safety-margin",
    ] {
        cases.push(run_(flag, "-1s"));
        cases.push(run_(flag, "0s"));
    }
    cases.push(vec!["resign", "--role", "r", "--timeout", "-2s"]);
    cases.push(vec!["migrate", "--timeout", "-2s"]);
    cases.push(vec!["demo", "--ttl", "-2s"]);
    cases.push(vec!["chaos", "--duration", "-2s"]);
    for args in cases {
        let out = run(pgelect(&args[..]), QUICK).await;
        out.assert_code(64);
        let flag = args
            .iter()
            .find(|a| a.starts_with("--") && **a != "--role" && **a != "--backend")
            .unwrap();
        let why = if args.contains(&"0s") {
            "zero"
        } else {
            "negative"
        };
        assert!(
            out.stderr.contains(flag) && out.stderr.contains(why),
            "`pgelect {}`: stderr does not name {flag} and say {why:?}:\n{}",
            args.join(" "),
            out.stderr
        );
    }
}

#[tokio::test]
async fn lock_without_a_command_after_the_separator_is_a_usage_error() {
    let missing = run(pgelect(["lock", "--key", "x"]), QUICK).await;
    missing.assert_code(64);
    assert!(missing.stderr.contains("<CMD>"), "{}", missing.stderr);

    let empty = run(pgelect(["lock", "--key", "x", "--"]), QUICK).await;
    empty.assert_code(64);

    // Without `--` the command is refused rather than guessed at.
    let no_separator = run(pgelect(["lock", "--key", "x", "true"]), QUICK).await;
    no_separator.assert_code(64);
    assert!(
        no_separator.stderr.contains("--"),
        "{}",
        no_separator.stderr
    );

    let no_key = run(pgelect(["lock", "--", "true"]), QUICK).await;
    no_key.assert_code(64);
    assert!(no_key.stderr.contains("--key"), "{}", no_key.stderr);
}

#[tokio::test]
async fn migrate_creates_the_schema_and_can_run_again() {
    let db = TestDb::new("cli_migrate").await;
    assert!(!schema_exists(&db, "pgelect").await);

    let first = run(pgelect(["migrate", "--database-url", &db.url()]), DB_RUN).await;
    first.assert_code(0);
    assert!(first.stdout.contains("applied"), "{}", first.stdout);
    assert!(schema_exists(&db, "pgelect").await);
    println!("first migrate took {:?}", first.elapsed);

    let again = run(pgelect(["migrate", "--database-url", &db.url()]), DB_RUN).await;
    again.assert_code(0);
    assert!(again.stdout.contains("up to date"), "{}", again.stdout);
}

#[tokio::test]
async fn migrate_into_another_schema() {
    let db = TestDb::new("cli_migrate_schema").await;
    let out = run(
        pgelect([
            "migrate",
            "--schema",
            "my_locks",
            "--database-url",
            &db.url(),
        ]),
        DB_RUN,
    )
    .await;
    out.assert_code(0);
    assert!(out.stdout.contains("my_locks"), "{}", out.stdout);
    assert!(schema_exists(&db, "my_locks").await);
    assert!(!schema_exists(&db, "pgelect").await);
}

#[tokio::test]
async fn a_bad_schema_name_is_a_configuration_error() {
    let db = TestDb::new("cli_bad_schema").await;
    let out = run(
        pgelect([
            "migrate",
            "--schema",
            "Bad-Name",
            "--database-url",
            &db.url(),
        ]),
        DB_RUN,
    )
    .await;
    out.assert_code(78);
    assert!(out.stderr.contains("Bad-Name"), "{}", out.stderr);
    assert!(!schema_exists(&db, "Bad-Name").await);
    assert!(!schema_exists(&db, "bad-name").await);
}

#[tokio::test]
async fn a_wrong_password_exits_77_and_is_never_printed() {
    let db = TestDb::new("cli_wrong_password").await;
    let wrong = "wrong-Pa55word-x91";
    let out = run(
        pgelect([
            "-vvv",
            "migrate",
            "--database-url",
            &with_password(&db, wrong),
        ]),
        DB_RUN,
    )
    .await;
    out.assert_code(77);
    assert!(out.stderr.contains("password"), "{}", out.stderr);
    let all = out.output();
    assert!(!all.contains(wrong), "password printed:\n{all}");
    assert!(
        !all.contains(TEST_PASSWORD),
        "real password printed:\n{all}"
    );
    assert!(!schema_exists(&db, "pgelect").await);
}

#[tokio::test]
async fn an_unparsable_url_is_a_configuration_error_and_is_never_printed() {
    let secret = "s3cret-in-a-bad-url";
    let url = format!("postgres://app:{secret}@127.0.0.1:notaport/app");
    let out = run(pgelect(["-vvv", "migrate", "--database-url", &url]), QUICK).await;
    out.assert_code(78);
    assert!(!out.output().contains(secret), "{}", out.output());
}

#[tokio::test]
async fn a_port_where_nothing_listens_exits_69_quickly() {
    let db = TestDb::new("cli_closed_port").await;
    let secret = "closed-port-Secret-4";
    for args in [&["migrate"][..], &["lock", "--key", "k", "--", "true"][..]] {
        let mut cmd = pgelect(["--database-url", &closed_port_url(&db, secret)]);
        cmd.args(args);
        let out = run(cmd, QUICK).await;
        println!(
            "`{}` on a closed port: exit {:?} after {:?}",
            args[0], out.code, out.elapsed
        );
        out.assert_code(69);
        assert!(
            out.elapsed < Duration::from_secs(5),
            "took {:?}",
            out.elapsed
        );
        assert!(!out.output().contains(secret), "{}", out.output());
        assert!(
            out.stderr.contains("127.0.0.1"),
            "names the target: {}",
            out.stderr
        );
    }
}

#[tokio::test]
async fn a_server_that_never_answers_exits_69_after_the_connect_timeout() {
    let db = TestDb::new("cli_blackhole").await;
    let proxy = FaultProxy::start(db.server_addr()).expect("start the fault proxy");
    proxy.blackhole();
    let url = format!(
        "postgres://postgres:{TEST_PASSWORD}@127.0.0.1:{}/{}",
        proxy.port(),
        db.name()
    );
    let out = run(pgelect(["migrate", "--database-url", &url]), DB_RUN).await;
    println!(
        "blackholed server: exit {:?} after {:?}",
        out.code, out.elapsed
    );
    out.assert_code(69);
    assert!(!out.output().contains(TEST_PASSWORD), "{}", out.output());
}

#[tokio::test]
async fn the_database_url_flag_wins_over_the_environment() {
    let db = TestDb::new("cli_url_precedence").await;

    // The flag names the real database, the environment a dead port: 0.
    let mut good_flag = pgelect(["migrate", "--database-url", &db.url()]);
    good_flag.env("DATABASE_URL", closed_port_url(&db, "env-secret"));
    run(good_flag, DB_RUN).await.assert_code(0);

    // And the other way round: the flag is used, so it fails.
    let mut bad_flag = pgelect([
        "migrate",
        "--database-url",
        &closed_port_url(&db, "flag-secret"),
    ]);
    bad_flag.env("DATABASE_URL", db.url());
    let out = run(bad_flag, DB_RUN).await;
    out.assert_code(69);
    assert!(!out.output().contains("flag-secret"));
    assert!(!out.output().contains(TEST_PASSWORD));
}

#[tokio::test]
async fn database_url_alone_works() {
    let db = TestDb::new("cli_env_url").await;
    let mut cmd = pgelect(["migrate"]);
    cmd.env("DATABASE_URL", db.url());
    run(cmd, DB_RUN).await.assert_code(0);
    assert!(schema_exists(&db, "pgelect").await);
}

#[tokio::test]
async fn the_libpq_variables_work_without_a_url() {
    if pgelect_testkit::external_url().is_some() {
        // The external server's superuser is not necessarily `postgres`.
        println!("external server: not checking the PG* variables");
        return;
    }
    let db = TestDb::new("cli_pg_env").await;
    let addr = db.server_addr();
    let mut cmd = pgelect(["migrate"]);
    cmd.env("PGHOST", addr.ip().to_string())
        .env("PGPORT", addr.port().to_string())
        .env("PGUSER", "postgres")
        .env("PGPASSWORD", TEST_PASSWORD)
        .env("PGDATABASE", db.name());
    run(cmd, DB_RUN).await.assert_code(0);
    assert!(schema_exists(&db, "pgelect").await);
}

#[tokio::test]
async fn help_never_prints_the_database_url_from_the_environment() {
    let secret = "help-Must-not-show-7";
    let url = format!("postgres://app:{secret}@db.example.invalid:5432/app");
    for args in [
        &["--help"][..],
        &["lock", "--help"][..],
        &["migrate", "--help"][..],
        &["lock", "--key", "x"][..],
        &["migrate", "--bogus"][..],
    ] {
        let mut cmd = pgelect(args);
        cmd.env("DATABASE_URL", &url);
        let out: Run = run(cmd, QUICK).await;
        let all = out.output();
        assert!(
            !all.contains(secret) && !all.contains("db.example.invalid"),
            "`pgelect {}` printed DATABASE_URL:\n{all}",
            args.join(" ")
        );
    }
}
