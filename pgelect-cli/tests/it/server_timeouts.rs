//! The `pgelect` command under a database's session timeouts: with
//! `idle_session_timeout`, `statement_timeout`,
//! `idle_in_transaction_session_timeout` and `lock_timeout` at 300 ms,
//! `status --watch` keeps watching (its connection sits idle between reads),
//! `lock` waits seconds for a held key and `run` leads and hands over as
//! with stock settings.

use crate::support;

use std::time::{Duration, Instant};

use pgelect_testkit::TestDb;
use support::{pgelect, process_alive, run, Background};

const LIMIT: Duration = Duration::from_secs(20);

async fn timed_db(hint: &str) -> TestDb {
    let db = TestDb::new(hint).await;
    run(pgelect(["migrate", "--database-url", &db.url()]), LIMIT)
        .await
        .assert_code(0);
    let admin = db.connect().await;
    for s in [
        "idle_session_timeout",
        "statement_timeout",
        "idle_in_transaction_session_timeout",
        "lock_timeout",
    ] {
        if !has_setting(&admin, s).await {
            continue;
        }
        admin
            .batch_execute(&format!(
                "ALTER DATABASE \"{}\" SET {s} = '300ms'",
                db.name()
            ))
            .await
            .unwrap();
    }
    db
}

fn with_db(db: &TestDb, args: &[&str]) -> tokio::process::Command {
    let mut cmd = pgelect(args);
    cmd.env("DATABASE_URL", db.url());
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_watch_run_and_lock_outlast_the_servers_timeouts() {
    let db = timed_db("cli_tmo").await;
    let mut a = Background::spawn(
        "a",
        with_db(
            &db,
            &[
                "run",
                "--role",
                "r",
                "--id",
                "a",
                "--ttl",
                "3s",
                "--",
                "sh",
                "-c",
                "echo led; exec sleep 60",
            ],
        ),
    );
    a.next_line("a leads", LIMIT, |l| l == "led").await;
    let mut b = Background::spawn(
        "b",
        with_db(
            &db,
            &[
                "run",
                "--role",
                "r",
                "--id",
                "b",
                "--ttl",
                "3s",
                "--",
                "sh",
                "-c",
                "echo led; exec sleep 60",
            ],
        ),
    );
    let mut watch = Background::spawn(
        "watch",
        with_db(&db, &["status", "--watch", "--json", "--role", "r"]),
    );
    let first: serde_json::Value =
        serde_json::from_str(&watch.next_line("a snapshot", LIMIT, |_| true).await).unwrap();
    assert_eq!(first["roles"][0]["holder"], "a", "{first}");

    // A held key: a second `lock` waits seconds for it.
    let holder = Background::spawn(
        "holder",
        with_db(
            &db,
            &[
                "lock",
                "--key",
                "k",
                "--",
                "sh",
                "-c",
                "echo held; exec sleep 2",
            ],
        ),
    );
    let mut holder = holder;
    holder
        .next_line("the key held", LIMIT, |l| l == "held")
        .await;
    let t = Instant::now();
    let waited = run(
        with_db(
            &db,
            &["lock", "--key", "k", "--timeout", "10s", "--", "true"],
        ),
        LIMIT,
    )
    .await;
    waited.assert_code(0);
    println!(
        "lock waited {:?} for the held key (lock_timeout and statement_timeout 300 ms)",
        t.elapsed()
    );
    assert!(t.elapsed() > Duration::from_secs(1));
    assert_eq!(holder.wait(LIMIT).await, Some(0));

    // Seconds later the watch and both supervisors are still there.
    assert!(
        process_alive(watch.pid()),
        "status --watch ended\n{}",
        watch.output()
    );
    assert!(process_alive(a.pid()) && process_alive(b.pid()));

    let t = Instant::now();
    run(with_db(&db, &["resign", "--role", "r"]), LIMIT)
        .await
        .assert_code(0);
    b.next_line("b leads", LIMIT, |l| l == "led").await;
    let line = watch
        .next_line("a snapshot naming b", LIMIT, |l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["roles"][0]["holder"] == "b"
        })
        .await;
    println!(
        "b led and the watch showed it {:?} after the resign: {line}",
        t.elapsed()
    );
    watch.signal("TERM");
    assert_eq!(watch.wait(LIMIT).await, Some(0), "{}", watch.output());
    a.kill().await;
    b.kill().await;
}

/// Whether the server has the setting `s` (PostgreSQL 13 has no
/// `idle_session_timeout`: there is nothing to switch off, so nothing to test).
async fn has_setting(c: &tokio_postgres::Client, s: &str) -> bool {
    let known: bool = c
        .query_one(
            "SELECT count(*) > 0 FROM pg_settings WHERE name = $1",
            &[&s],
        )
        .await
        .unwrap()
        .get(0);
    if !known {
        println!("this server has no {s}: not set");
    }
    known
}
