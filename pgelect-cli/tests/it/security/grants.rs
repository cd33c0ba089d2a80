//! `pgelect grants` (the real binary): its output, piped into `psql` as a
//! superuser (or, for the candidate of a fresh database, as its non-superuser
//! owner), gives a fresh database user with an awkward name (upper case, a
//! space, both quote characters) exactly what its kind needs: each user then
//! does its job with the `pgelect` command, and is refused (exit 77) the
//! jobs of the other kinds. Bad user names exit 64 without a database.

use crate::support;

use std::process::Stdio;
use std::time::Duration;

use pgelect_testkit::TestDb;
use support::{pgelect, run, Background};
use tokio::io::AsyncWriteExt;
use tokio_postgres::NoTls;

const PASSWORD: &str = "grants-pw-1";
const LIMIT: Duration = Duration::from_secs(30);

/// `name` as an SQL identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A libpq key/value connection string for `user` on `db`.
fn conn_str(db: &TestDb, user: &str) -> String {
    let addr = db.server_addr();
    let quoted = user.replace('\\', "\\\\").replace('\'', "\\'");
    format!(
        "host={} port={} dbname={} user='{quoted}' password={PASSWORD}",
        addr.ip(),
        addr.port(),
        db.name()
    )
}

/// A login role named awkwardly (upper case, a space, `"` and `'`), unique
/// to `db`, with CONNECT on it and nothing else.
async fn awkward_user(db: &TestDb, kind: &str) -> String {
    let name = format!("{kind} \"X\" O'Neil {}", db.role_name("u"));
    let admin = db.connect().await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE {u} LOGIN PASSWORD '{PASSWORD}'; GRANT CONNECT ON DATABASE {d} TO {u}",
            u = ident(&name),
            d = ident(db.name())
        ))
        .await
        .unwrap();
    name
}

/// `pgelect grants ARGS`: its standard output (exit 0 asserted).
async fn grants(args: &[&str]) -> String {
    let mut all = vec!["grants"];
    all.extend_from_slice(args);
    let out = run(pgelect(all), LIMIT).await;
    out.assert_code(0);
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    out.stdout
}

/// Pipes `sql` into `psql -v ON_ERROR_STOP=1` connected with `conn`.
async fn psql(conn: &str, sql: &str) {
    let psql = psql_path();
    let mut child = tokio::process::Command::new(psql)
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", conn])
        .env_remove("PGPASSWORD")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run psql");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(sql.as_bytes()).await.unwrap();
    drop(stdin);
    let out = tokio::time::timeout(LIMIT, child.wait_with_output())
        .await
        .expect("psql finishes")
        .unwrap();
    assert!(
        out.status.success(),
        "psql failed on:\n{sql}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `pgelect ARGS` as the user of `conn` (in `DATABASE_URL`).
async fn as_user(conn: &str, args: &[&str]) -> support::Run {
    let mut cmd = pgelect(args);
    cmd.env("DATABASE_URL", conn);
    run(cmd, LIMIT).await
}

/// A `pgelect run` candidate for role `jobs` as the user of `conn`, whose
/// command prints `term=<term>` and sleeps.
fn candidate(conn: &str, id: &str) -> Background {
    let mut cmd = pgelect([
        "run",
        "--role",
        "jobs",
        "--id",
        id,
        "--ttl",
        "5s",
        "--",
        "sh",
        "-c",
        "echo term=$PGELECT_TERM; exec sleep 60",
    ]);
    cmd.env("DATABASE_URL", conn);
    Background::spawn(id, cmd)
}

async fn term_of(c: &mut Background) -> i64 {
    let line = c
        .next_line("a term", LIMIT, |l| l.starts_with("term="))
        .await;
    line["term=".len()..].parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kinds_grants_let_a_fresh_user_do_its_job_and_no_other() {
    let db = TestDb::new("cli_grants").await;
    let superuser = db.url();
    let m = run(pgelect(["migrate", "--database-url", &superuser]), LIMIT).await;
    m.assert_code(0);

    let mut conns = std::collections::HashMap::new();
    for kind in ["candidate", "fencer", "operator", "watcher"] {
        let user = awkward_user(&db, kind).await;
        let sql = grants(&["--user", &user, "--role-kind", kind]).await;
        println!("--- pgelect grants --user {user:?} --role-kind {kind}\n{sql}");
        assert!(sql.contains(&ident(&user)), "{sql}");
        psql(&superuser, &sql).await;
        conns.insert(kind, conn_str(&db, &user));
    }

    // Candidates: a leader and a blocking standby.
    let mut a = candidate(&conns["candidate"], "a");
    let term = term_of(&mut a).await;
    let mut b = candidate(&conns["candidate"], "b");
    support::wait_until("the standby waits", LIMIT, || async {
        db.connect()
            .await
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;

    // The watcher sees it, and may not resign it or stand.
    let s = as_user(&conns["watcher"], &["status", "--role", "jobs"]).await;
    s.assert_code(0);
    assert!(s.stdout.contains(&term.to_string()), "{}", s.stdout);
    as_user(&conns["watcher"], &["resign", "--role", "jobs"])
        .await
        .assert_code(77);

    // The fencer fences with the term, and reads nothing.
    let (fencer, conn) = conns["fencer"]
        .parse::<tokio_postgres::Config>()
        .unwrap()
        .connect(NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    fencer
        .query("SELECT pgelect.fence('jobs', $1)", &[&term])
        .await
        .expect("the fencer fences with the current term");
    let stale = fencer
        .query("SELECT pgelect.fence('jobs', $1)", &[&(term - 1)])
        .await
        .unwrap_err();
    assert_eq!(stale.code().map(|c| c.code()), Some("PE001"));
    as_user(&conns["fencer"], &["status"]).await.assert_code(77);

    // Neither the candidate nor the watcher may resign; the operator may,
    // and the standby takes over.
    as_user(&conns["candidate"], &["resign", "--role", "jobs"])
        .await
        .assert_code(77);
    let r = as_user(&conns["operator"], &["resign", "--role", "jobs"]).await;
    r.assert_code(0);
    let next = term_of(&mut b).await;
    assert!(next > term, "{next} after {term}");
    println!(
        "operator's resign: term {term} -> {next} in {:?}",
        r.elapsed
    );

    // Nobody but the candidate may stand.
    for kind in ["fencer", "operator", "watcher"] {
        let r = as_user(&conns[kind], &["run", "--role", "other", "--", "true"]).await;
        assert_eq!(r.code, Some(77), "{kind} may not stand: {}", r.output());
    }
    // Advisory locks need no grant: every one of these users may `lock`.
    for kind in ["candidate", "fencer", "operator", "watcher"] {
        let r = as_user(&conns[kind], &["lock", "--key", "k", "--", "true"]).await;
        assert_eq!(r.code, Some(0), "{kind} takes a lock: {}", r.output());
    }
    a.kill().await;
    b.kill().await;
}

/// `pgelect migrate` by a user that is not a superuser, with the owner's
/// grants (`CREATE` on the database) piped in by a superuser; that owner
/// then pipes a candidate's grants in itself, and the candidate leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_without_superuser_migrates_and_grants_a_candidate() {
    let db = TestDb::new("cli_grants_owner").await;
    let owner = awkward_user(&db, "Owner").await;
    let sql = grants(&["--user", &owner, "--role-kind", "owner"]).await;
    println!("--- pgelect grants --user {owner:?} --role-kind owner\n{sql}");
    psql(&db.url(), &sql).await;
    let owner_conn = conn_str(&db, &owner);
    let m = as_user(&owner_conn, &["migrate"]).await;
    m.assert_code(0);
    let admin = db.connect().await;
    let super_: bool = admin
        .query_one(
            "SELECT rolsuper FROM pg_roles WHERE rolname = $1",
            &[&owner],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!super_);
    let schema_owner: String = admin
        .query_one(
            "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pgelect'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(schema_owner, ident(&owner));

    let cand = awkward_user(&db, "Cand").await;
    psql(&owner_conn, &grants(&["--user", &cand]).await).await;
    let r = as_user(
        &conn_str(&db, &cand),
        &[
            "run",
            "--role",
            "jobs",
            "--",
            "sh",
            "-c",
            "echo term=$PGELECT_TERM",
        ],
    )
    .await;
    r.assert_code(0);
    assert!(r.stdout.contains("term=1"), "{}", r.output());
}

#[tokio::test]
async fn bad_user_names_exit_64_without_a_database() {
    let long = "x".repeat(64);
    for (args, why) in [
        (vec!["grants", "--user", ""], "empty"),
        (vec!["grants", "--user", &long], "64 bytes"),
        (vec!["grants"], "--user"),
        (
            vec!["grants", "--user", "a", "--role-kind", "admin"],
            "admin",
        ),
        (
            vec![
                "grants",
                "--user",
                "a",
                "--role-kind",
                "watcher",
                "--zombie-preemption",
            ],
            "candidate",
        ),
    ] {
        let r = run(pgelect(&args), LIMIT).await;
        r.assert_code(64);
        assert!(r.stderr.contains(why), "{args:?}: {}", r.stderr);
    }
    // Not UTF-8: refused, not mangled.
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"a\xffb");
    let r = run(
        pgelect([
            std::ffi::OsStr::new("grants"),
            std::ffi::OsStr::new("--user"),
            bad,
        ]),
        LIMIT,
    )
    .await;
    r.assert_code(64);
    // 63 bytes is fine, and --help explains each kind.
    grants(&["--user", &"y".repeat(63)]).await;
    let help = run(pgelect(["grants", "--help"]), LIMIT).await;
    help.assert_code(0);
    for kind in ["owner", "candidate", "fencer", "operator", "watcher"] {
        assert!(help.stdout.contains(kind), "{}", help.stdout);
    }
}

#[tokio::test]
async fn zombie_preemption_is_a_comment_unless_asked_for() {
    let plain = grants(&["--user", "app"]).await;
    assert!(
        plain.contains("\n-- GRANT pg_signal_backend TO \"app\";"),
        "{plain}"
    );
    let with = grants(&["--user", "app", "--zombie-preemption"]).await;
    assert!(
        with.contains("\nGRANT pg_signal_backend TO \"app\";"),
        "{with}"
    );
}

/// `psql` beside the server binaries, else the system's (the npm server
/// packages used for other versions carry none; any psql from 13 on speaks
/// to any server from 13 on), else from `PATH`.
fn psql_path() -> std::path::PathBuf {
    let beside = pgelect_testkit::pg_bin_dir()
        .expect("PostgreSQL binaries")
        .join("psql");
    if beside.is_file() {
        return beside;
    }
    let mut system: Vec<std::path::PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/psql"))
        .filter(|p| p.is_file())
        .collect();
    system.sort();
    system.pop().unwrap_or_else(|| "psql".into())
}
