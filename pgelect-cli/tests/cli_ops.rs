//! The command as an operator meets it (issue 12): `run` narrates at the
//! default level without colour on a pipe; errors name their cause and the
//! next step; `status` and `resign` refuse unknown roles; `forget` removes a
//! stale role and refuses a live one; `pgelect lock` has flock's habits and
//! its holders show in `status`.

mod support;

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
        "standing for role \"r\" as node \"node-a\" (session backend, ttl 3s)",
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
