//! Secrets stay off command lines (the real binary): the demo's random
//! password never appears in any process's `/proc/PID/cmdline` nor in its
//! candidates' environments; `pgelect run` given its URL through
//! `DATABASE_URL`, `--database-url-file` or `--listen-url-file` shows no
//! password either; a password on the command line is warned about once;
//! URL files fail with exit 78 naming the path, never the content; a
//! password can come from `PGPASSFILE` alone.

use crate::support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pgelect_testkit::{TestDb, TEST_PASSWORD};
use support::{pgelect, run, wait_for_file, Background, TempDir};

/// Bound on a command starting (connect, campaign, spawn).
const START: Duration = Duration::from_secs(20);
/// Bound for runs that must fail or finish fast.
const QUICK: Duration = Duration::from_secs(15);

/// Every process's command line, as `(pid, arguments joined by spaces)`.
fn all_cmdlines() -> Vec<(u32, String)> {
    std::fs::read_dir("/proc")
        .expect("read /proc")
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let raw = std::fs::read(e.path().join("cmdline")).ok()?;
            Some((pid, String::from_utf8_lossy(&raw).replace('\0', " ")))
        })
        .collect()
}

/// Processes whose command line holds `needle`.
fn cmdlines_with(needle: &str) -> Vec<(u32, String)> {
    all_cmdlines()
        .into_iter()
        .filter(|(_, c)| c.contains(needle))
        .collect()
}

/// The environment of `pid` (empty if it is gone).
fn environ(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', "\n"))
        .unwrap_or_default()
}

/// Every process below `pid`.
fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for c in children(p) {
            found.push(c);
            next.push(c);
        }
    }
    found
}

/// The children of `pid` (from `/proc/*/stat`).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("read /proc")
        .flatten()
        .filter_map(|e| {
            let child: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == pid).then_some(child)
        })
        .collect()
}

fn write_private(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// The password in a postgres:// URL.
fn password_of(url: &str) -> String {
    let creds = url
        .split_once("://")
        .and_then(|(_, rest)| rest.rsplit_once('@'))
        .map(|(creds, _)| creds)
        .expect("the URL has user info");
    creds
        .split_once(':')
        .map(|(_, pw)| pw.to_owned())
        .expect("the URL has a password")
}

#[cfg(feature = "throwaway")] // the demo's own server needs the feature
#[tokio::test]
async fn demo_puts_its_random_password_on_no_command_line_and_ignores_database_url() {
    // A DATABASE_URL that could be production: the demo must not use it,
    // and its candidates must not inherit it.
    let production = "postgres://prod:prod-secret-XYZ@192.0.2.1:5432/prod";
    let mut cmd = pgelect(["demo"]);
    cmd.env("DATABASE_URL", production);
    let mut demo = Background::spawn("demo", cmd);
    demo.next_line("the note that DATABASE_URL is not used", QUICK, |l| {
        l.contains("is set but not used")
    })
    .await;
    let port: u16 = demo
        // initdb and a start, in a debug build: 15 s was once not enough
        // in CI beside five other tests (load average 19).
        .next_line("the throwaway server", QUICK * 4, |l| {
            l.contains("PostgreSQL on 127.0.0.1:")
        })
        .await
        .split_once("127.0.0.1:")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .expect("a port");
    let file_line = demo
        .next_line("the URL file", QUICK, |l| l.contains("read the URL from"))
        .await;
    let file = PathBuf::from(
        file_line
            .split_once("read the URL from ")
            .and_then(|(_, rest)| rest.split_once(" (mode"))
            .map(|(path, _)| path)
            .expect("the URL file's path"),
    );
    // While the candidates run: the file is private and holds the URL.
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", file.display());
    let url = std::fs::read_to_string(&file).unwrap();
    let password = password_of(&url);
    assert!(password.len() >= 16, "a short password: {password:?}");
    assert_ne!(
        password, TEST_PASSWORD,
        "the demo uses the kit's public password"
    );
    assert!(url.contains(&format!("127.0.0.1:{port}/")), "{url}");

    for (pid, cmdline) in all_cmdlines() {
        assert!(
            !cmdline.contains(&password),
            "process {pid} shows the demo's password on its command line: {cmdline}"
        );
        assert!(!cmdline.contains("prod-secret"), "process {pid}: {cmdline}");
    }
    // This demo's candidates (not leftovers of another run), and every
    // process below them: a process just forked still shows the demo's
    // command line or an empty environment. So the processes are read
    // again (bounded) until at least two candidates and three environments
    // are in: twice, in loaded CI runs, a single reading found only two.
    // Read from the moment the URL file is announced (the candidates start
    // after it), not after the first leader: once, in a loaded CI run, the
    // test read that line after the demo had already stopped its
    // candidates, and found none for 20 s.
    let waited = std::time::Instant::now();
    loop {
        let ours = children(demo.pid());
        let candidates: Vec<(u32, String)> = cmdlines_with("run --role demo")
            .into_iter()
            .filter(|(pid, _)| ours.contains(pid))
            .collect();
        for (_, cmdline) in &candidates {
            assert!(
                cmdline.contains(&format!("--database-url-file {}", file.display())),
                "{cmdline}"
            );
        }
        let mut checked = 0;
        for (pid, _) in &candidates {
            for p in std::iter::once(*pid).chain(descendants(*pid)) {
                let env = environ(p);
                if env.is_empty() {
                    continue;
                }
                checked += 1;
                assert!(
                    !env.contains(&password),
                    "process {p}'s environment holds the password"
                );
                assert!(
                    !env.contains("prod-secret") && !env.contains("DATABASE_URL="),
                    "process {p} inherited DATABASE_URL:\n{env}"
                );
            }
        }
        if candidates.len() >= 2 && checked >= 3 {
            break;
        }
        assert!(
            waited.elapsed() < START,
            "after {START:?}: {} candidates ({candidates:?}), {checked} environments read\n{}",
            candidates.len(),
            demo.output()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    demo.next_line("the first leader", START, |l| {
        l.contains("leads with term 1")
    })
    .await;

    // The kit's well-known password no longer opens the throwaway server.
    let mut config = tokio_postgres::Config::new();
    config
        .host("127.0.0.1")
        .port(port)
        .user("postgres")
        .password(TEST_PASSWORD)
        .dbname("postgres")
        .connect_timeout(Duration::from_secs(5));
    assert!(
        config.connect(tokio_postgres::NoTls).await.is_err(),
        "the throwaway server accepts TEST_PASSWORD"
    );

    assert_eq!(
        demo.wait(Duration::from_secs(120)).await,
        Some(0),
        "{}",
        demo.output()
    );
    assert!(!file.exists(), "{} is left behind", file.display());
    assert!(
        !demo.output().contains(&password),
        "the demo printed its password"
    );
}

async fn migrated(hint: &str) -> TestDb {
    let db = TestDb::new(hint).await;
    let options = pgelect::ConnectOptions::from_url(&db.url()).expect("test URL parses");
    pgelect::migrate(&options).await.expect("migrate");
    db
}

/// `pgelect run` leading role `r` with a command that writes its pid to
/// `marker`; waits until it runs.
async fn leader(name: &str, mut cmd: tokio::process::Command, marker: &Path) -> Background {
    cmd.args(["--", "sh", "-c", r#"echo $$ > "$M"; exec sleep 600"#])
        .env("M", marker);
    let mut sup = Background::spawn(name, cmd);
    tokio::select! {
        _ = wait_for_file(marker, START) => {}
        code = sup.wait(START) => panic!("{name} exited with {code:?}\n{}", sup.output()),
    }
    sup
}

#[tokio::test]
async fn run_given_its_urls_by_environment_or_file_shows_no_password() {
    let db = migrated("secrets_run").await;
    let dir = TempDir::new("secrets-run");
    let url = db.url();
    assert!(
        url.contains(TEST_PASSWORD),
        "the test URL should hold the password"
    );

    // 1. DATABASE_URL, and the lease backend's direct URL from a file.
    let listen_file = dir.join("listen-url");
    write_private(&listen_file, &format!("{url}\n"));
    let mut cmd = pgelect(["-v", "run", "--role", "env", "--backend", "lease"]);
    cmd.arg("--listen-url-file")
        .arg(&listen_file)
        .env("DATABASE_URL", &url);
    let mut by_env = leader("by-env", cmd, &dir.join("env.pid")).await;

    // 2. --database-url-file, and the listen URL from PGELECT_LISTEN_URL.
    let url_file = dir.join("database-url");
    write_private(&url_file, &format!("{url}\n"));
    let mut cmd = pgelect(["-v", "run", "--role", "file", "--backend", "lease"]);
    cmd.arg("--database-url-file")
        .arg(&url_file)
        .env("PGELECT_LISTEN_URL", &url);
    let mut by_file = leader("by-file", cmd, &dir.join("file.pid")).await;

    // Only this test's supervisors and what they started: tests running in
    // parallel may put the kit's password on their own command lines.
    let ours = [by_env.pid(), by_file.pid()];
    let tree: Vec<u32> = ours
        .iter()
        .flat_map(|&pid| std::iter::once(pid).chain(descendants(pid)))
        .collect();
    let mut seen = 0;
    for (pid, cmdline) in all_cmdlines() {
        if !tree.contains(&pid) {
            continue;
        }
        if ours.contains(&pid) {
            seen += 1;
            assert!(cmdline.contains(" run "), "{cmdline}");
        }
        assert!(
            !cmdline.contains(TEST_PASSWORD),
            "process {pid} shows the password on its command line: {cmdline}"
        );
    }
    assert_eq!(seen, 2, "both supervisors' command lines were read");
    // Each tree: supervisor, watcher, the command's shell (or its sleep).
    assert!(tree.len() >= 6, "the supervisors' process trees: {tree:?}");
    for sup in [&by_env, &by_file] {
        assert!(
            !sup.output().contains("holds a password"),
            "warned although no password was on the command line\n{}",
            sup.output()
        );
    }
    for sup in [&mut by_env, &mut by_file] {
        sup.signal("TERM");
        assert_eq!(sup.wait(QUICK).await, Some(0), "{}", sup.output());
    }
}

#[tokio::test]
async fn a_password_on_the_command_line_is_warned_about_once() {
    let db = migrated("secrets_warn").await;
    let out = run(pgelect(["status", "--database-url", &db.url()]), QUICK).await;
    out.assert_code(0);
    assert_eq!(
        out.stderr.matches("holds a password").count(),
        1,
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("DATABASE_URL"), "{}", out.stderr);
    assert!(out.stderr.contains("--database-url-file"), "{}", out.stderr);
    assert!(!out.output().contains(TEST_PASSWORD), "{}", out.output());

    // A key=value string is accepted too, and warned about alike.
    let addr = db.server_addr();
    let kv = format!(
        "host={} port={} user=postgres password='{TEST_PASSWORD}' dbname={}",
        addr.ip(),
        addr.port(),
        db.name()
    );
    let out = run(pgelect(["status", "--database-url", &kv]), QUICK).await;
    out.assert_code(0);
    assert_eq!(
        out.stderr.matches("holds a password").count(),
        1,
        "{}",
        out.stderr
    );

    // The same URL through the environment: no warning.
    let mut cmd = pgelect(["status"]);
    cmd.env("DATABASE_URL", db.url());
    let out = run(cmd, QUICK).await;
    out.assert_code(0);
    assert!(!out.stderr.contains("holds a password"), "{}", out.stderr);
}

#[tokio::test]
async fn url_files_fail_with_78_naming_the_path_never_the_content() {
    let dir = TempDir::new("secrets-files");
    let missing = dir.join("no-such-file");
    let out = run(
        pgelect([
            "status",
            "--database-url-file",
            &missing.display().to_string(),
        ]),
        QUICK,
    )
    .await;
    out.assert_code(78);
    assert!(
        out.stderr.contains(&missing.display().to_string()),
        "{}",
        out.stderr
    );

    // Through the environment variable, and for --listen-url-file.
    let mut cmd = pgelect(["status"]);
    cmd.env("PGELECT_DATABASE_URL_FILE", &missing);
    run(cmd, QUICK).await.assert_code(78);
    let url_file = dir.join("db-url");
    // A syntactically fine URL to an unused port: the listen file must fail first.
    write_private(&url_file, "postgres://x:y@127.0.0.1:9/x");
    let mut cmd = pgelect([
        "run",
        "--role",
        "r",
        "--backend",
        "lease",
        "--listen-url-file",
    ]);
    cmd.arg(&missing)
        .arg("--database-url-file")
        .arg(&url_file)
        .args(["--", "true"]);
    let out = run(cmd, QUICK).await;
    out.assert_code(78);
    assert!(out.stderr.contains("--listen-url-file"), "{}", out.stderr);

    // --listen-url is for the lease backend: a usage error on the command
    // line, but ignored from the environment (shared by both kinds of
    // candidates), so this run gets as far as connecting (69).
    let mut cmd = pgelect([
        "run",
        "--role",
        "r",
        "--listen-url",
        "postgres://x@127.0.0.1:9/x",
    ]);
    cmd.arg("--database-url-file")
        .arg(&url_file)
        .args(["--", "true"]);
    run(cmd, QUICK).await.assert_code(64);
    let mut cmd = pgelect(["run", "--role", "r", "--database-url-file"]);
    cmd.arg(&url_file)
        .env("PGELECT_LISTEN_URL", "postgres://x@127.0.0.1:9/x")
        .args(["--", "true"]);
    run(cmd, QUICK).await.assert_code(69);

    // An ambiguous password: refused (78), no part of it shown, advice given.
    let bad = dir.join("bad-url");
    write_private(&bad, "postgres://app:se@cret-tail@db.invalid/app\n");
    let out = run(
        pgelect(["status", "--database-url-file", &bad.display().to_string()]),
        QUICK,
    )
    .await;
    out.assert_code(78);
    assert!(!out.output().contains("cret-tail"), "{}", out.output());
    assert!(out.stderr.contains("%40"), "{}", out.stderr);

    let empty = dir.join("empty");
    write_private(&empty, "\n");
    let out = run(
        pgelect([
            "status",
            "--database-url-file",
            &empty.display().to_string(),
        ]),
        QUICK,
    )
    .await;
    out.assert_code(78);
    assert!(out.stderr.contains("empty"), "{}", out.stderr);

    // Both forms on the command line: a usage error.
    let out = run(
        pgelect([
            "status",
            "--database-url",
            "postgres://a@b/c",
            "--database-url-file",
            &bad.display().to_string(),
        ]),
        QUICK,
    )
    .await;
    out.assert_code(64);
}

#[tokio::test]
async fn a_password_from_pgpassfile_alone_is_used() {
    let db = TestDb::new("secrets_pgpass").await;
    let password = "only-in-the-pgpass-file";
    db.create_role("pp", password, true).await;
    let role = db.role_name("pp");
    let addr = db.server_addr();
    let url = format!(
        "postgres://{role}@{}:{}/{}",
        addr.ip(),
        addr.port(),
        db.name()
    );
    let dir = TempDir::new("secrets-pgpass");
    let passfile = dir.join("pgpass");
    write_private(
        &passfile,
        &format!("{}:{}:*:{role}:{password}\n", addr.ip(), addr.port()),
    );

    // Without the file: no password, no connection.
    let mut cmd = pgelect(["migrate", "--database-url", &url]);
    cmd.env("HOME", dir.path());
    let out = run(cmd, QUICK).await;
    assert_ne!(out.code, Some(0), "{}", out.output());

    let mut cmd = pgelect(["migrate", "--database-url", &url]);
    cmd.env("PGPASSFILE", &passfile);
    let out = run(cmd, QUICK).await;
    out.assert_code(0);
    // No password on the command line: no warning.
    assert!(!out.stderr.contains("holds a password"), "{}", out.stderr);

    // ~/.pgpass, group-readable: ignored with libpq's warning.
    let home = dir.join("home");
    std::fs::create_dir(&home).unwrap();
    std::fs::write(home.join(".pgpass"), format!("*:*:*:{role}:{password}\n")).unwrap();
    std::fs::set_permissions(home.join(".pgpass"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut cmd = pgelect(["migrate", "--database-url", &url]);
    cmd.env("HOME", &home);
    let out = run(cmd, QUICK).await;
    assert_ne!(out.code, Some(0), "{}", out.output());
    assert!(
        out.stderr.contains("group or world access"),
        "{}",
        out.stderr
    );
    std::fs::set_permissions(home.join(".pgpass"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut cmd = pgelect(["migrate", "--database-url", &url]);
    cmd.env("HOME", &home);
    run(cmd, QUICK).await.assert_code(0);
}
