//! `pgelect resign` is authenticated by the database: without EXECUTE on
//! the schema's `request_resign` it exits 77 and names the grant to ask
//! for; with the operator's grants it moves the leader.

use crate::support;

use std::time::Duration;

use pgelect::{ConnectOptions, Elector};
use pgelect_testkit::TestDb;
use support::{pgelect, run};

const PASSWORD: &str = "op-secret-77";

async fn operator(db: &TestDb, name: &str, grants: &[&str]) -> String {
    let url = db.create_role(name, PASSWORD, false).await;
    let r = db.role_name(name);
    let admin = db.connect().await;
    for g in grants {
        admin.batch_execute(&g.replace("{r}", &r)).await.unwrap();
    }
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resign_needs_execute_on_request_resign_and_exits_77_without_it() {
    let db = TestDb::new("cli_resign_auth").await;
    let owner = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&owner).await.unwrap();
    // A leader that releases when asked and stands again (re-elected).
    let elector = Elector::builder(owner.clone(), "r")
        .node_id("leader")
        .build()
        .unwrap();
    let (elected_tx, mut elected) = tokio::sync::mpsc::unbounded_channel();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let leader = tokio::spawn(elector.run(
        shutdown.clone(),
        move |ctx| {
            let tx = elected_tx.clone();
            async move {
                let _ = tx.send(ctx.term());
                ctx.lost().await;
            }
        },
        || async {},
    ));
    let first = elected.recv().await.unwrap();

    let usage_only = operator(&db, "op_usage", &["GRANT USAGE ON SCHEMA pgelect TO {r}"]).await;
    let out = run(
        pgelect(["resign", "--role", "r", "--database-url", &usage_only]),
        Duration::from_secs(10),
    )
    .await;
    out.assert_code(77);
    println!("{}", out.stderr);
    assert!(
        out.stderr
            .contains("GRANT EXECUTE ON FUNCTION pgelect.request_resign(text)"),
        "{}",
        out.stderr
    );
    assert!(!out.output().contains(PASSWORD), "{}", out.output());

    let allowed = operator(
        &db,
        "op",
        &[
            "GRANT USAGE ON SCHEMA pgelect TO {r}",
            "GRANT EXECUTE ON FUNCTION pgelect.request_resign(text) TO {r}",
            "GRANT SELECT ON pgelect.leaders TO {r}",
        ],
    )
    .await;
    let out = run(
        pgelect(["resign", "--role", "r", "--database-url", &allowed]),
        Duration::from_secs(20),
    )
    .await;
    out.assert_code(0);
    assert!(out.stdout.contains("is now led by"), "{}", out.stdout);
    println!("{}", out.stdout);
    let second = tokio::time::timeout(Duration::from_secs(10), elected.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(second > first);
    shutdown.cancel();
    leader.await.unwrap().unwrap();
}

/// A statement refused by the server reads as the server said it, once:
/// severity and message, without the driver's bare "db error".
#[tokio::test]
async fn status_without_select_shows_the_servers_refusal_once() {
    let db = TestDb::new("cli_status_noperm").await;
    let owner = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&owner).await.unwrap();
    let usage_only = operator(&db, "op_blind", &["GRANT USAGE ON SCHEMA pgelect TO {r}"]).await;
    let out = run(
        pgelect(["status", "--database-url", &usage_only]),
        Duration::from_secs(10),
    )
    .await;
    println!("{}", out.stderr);
    out.assert_code(77);
    assert!(
        out.stderr.contains(": ERROR: permission denied for "),
        "{}",
        out.stderr
    );
    assert_eq!(
        out.stderr.matches("permission denied for ").count(),
        1,
        "the server's words once: {}",
        out.stderr
    );
    assert!(!out.stderr.contains("db error"), "{}", out.stderr);
    assert!(!out.output().contains(PASSWORD), "{}", out.output());
}
