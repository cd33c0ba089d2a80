//! Tests of the test kit itself: each feature against real servers.

use std::io::ErrorKind;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use pgelect_testkit::{
    pg_bin_dir, pgbouncer_available, Cluster, FaultProxy, PgBouncer, PoolMode, TestDb, SUPERUSER,
    TEST_PASSWORD,
};
use tokio::time::timeout;

use crate::support::{connect, scalar};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Config, NoTls, SimpleQueryMessage};

/// Runs `sql` (simple protocol, works through transaction pooling) and
/// returns the first column of every row.
async fn column(client: &Client, sql: &str) -> Vec<String> {
    timeout(Duration::from_secs(10), client.simple_query(sql))
        .await
        .expect("query timed out")
        .expect("query failed")
        .into_iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row.get(0).unwrap_or("").to_owned()),
            _ => None,
        })
        .collect()
}

/// Rows of a pgbouncer admin console `SHOW` command, as (name, value) maps.
async fn show(client: &Client, what: &str) -> Vec<Vec<(String, String)>> {
    let mut rows = Vec::new();
    for msg in client.simple_query(&format!("SHOW {what}")).await.unwrap() {
        if let SimpleQueryMessage::Row(row) = msg {
            rows.push(
                row.columns()
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (c.name().to_owned(), row.get(i).unwrap_or("").to_owned()))
                    .collect(),
            );
        }
    }
    rows
}

fn field<'a>(row: &'a [(String, String)], name: &str) -> &'a str {
    row.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no column {name} in {row:?}"))
}

async fn wait_closed(client: &Client) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !client.is_closed() {
        assert!(Instant::now() < deadline, "client connection not closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn shared_cluster() -> &'static Cluster {
    tokio::task::spawn_blocking(Cluster::shared).await.unwrap()
}

fn require_pgbouncer() {
    assert!(
        pgbouncer_available(),
        "pgbouncer is not installed: apt-get install pgbouncer (or set PGELECT_PGBOUNCER)"
    );
}

#[test]
fn finds_pg_binaries() {
    let dir = pg_bin_dir().unwrap();
    assert!(dir.join("initdb").is_file() && dir.join("pg_ctl").is_file());
}

#[tokio::test]
async fn testdb_isolation() {
    let a = TestDb::new("iso").await;
    let b = TestDb::new("iso").await;
    assert_ne!(a.name(), b.name());
    assert!(a.name().starts_with("t_iso_"), "{}", a.name());
    let ca = a.connect().await;
    let cb = b.connect().await;
    assert_eq!(scalar(&ca, "SELECT current_database()").await, a.name());
    assert_eq!(scalar(&cb, "SELECT current_database()").await, b.name());
    ca.batch_execute("CREATE TABLE only_in_a (x int)")
        .await
        .unwrap();
    assert_eq!(
        scalar(&ca, "SELECT to_regclass('only_in_a') IS NULL").await,
        "f"
    );
    assert_eq!(
        scalar(&cb, "SELECT to_regclass('only_in_a') IS NULL").await,
        "t"
    );
    // url() and config() point at the same database.
    let via_url = connect(&a.url().parse().unwrap()).await;
    assert_eq!(
        scalar(&via_url, "SELECT current_database()").await,
        a.name()
    );
    // Prepared statements work on a direct connection.
    let row = ca.query_one("SELECT $1::int + 1", &[&41i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 42);
}

#[tokio::test]
async fn testdb_drop_removes_database_and_roles() {
    let cluster = shared_cluster().await;
    let db = TestDb::on(cluster, "dropme").await;
    let name = db.name().to_owned();
    let _role_url = db.create_role("gone", "pw", false).await;
    let role = db.role_name("gone");
    let client = db.connect().await;
    drop(db); // WITH (FORCE): terminates `client`
    wait_closed(&client).await;
    let admin = connect(&cluster.config("postgres")).await;
    let sql = format!("SELECT count(*) FROM pg_database WHERE datname = '{name}'");
    assert_eq!(scalar(&admin, &sql).await, "0");
    let sql = format!("SELECT count(*) FROM pg_roles WHERE rolname = '{role}'");
    assert_eq!(scalar(&admin, &sql).await, "0");
}

#[tokio::test]
async fn wrong_password_fails() {
    let db = TestDb::new("pw").await;
    let mut config = db.config();
    config.password("not-the-password");
    let err = config
        .connect(NoTls)
        .await
        .err()
        .expect("wrong password accepted");
    assert_eq!(err.code(), Some(&SqlState::INVALID_PASSWORD), "{err}");

    let url = db.create_role("app", "app-secret", false).await;
    let app = connect(&url.parse().unwrap()).await;
    assert_eq!(
        scalar(&app, "SELECT current_user").await,
        db.role_name("app")
    );
    assert_eq!(scalar(&app, "SELECT current_database()").await, db.name());
    assert_eq!(
        scalar(
            &app,
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        )
        .await,
        "f"
    );
    let mut wrong: Config = url.parse().unwrap();
    wrong.password("app-wrong");
    let err = wrong
        .connect(NoTls)
        .await
        .err()
        .expect("wrong password accepted");
    assert_eq!(err.code(), Some(&SqlState::INVALID_PASSWORD), "{err}");

    // Idempotent: same name again alters the role.
    let url2 = db.create_role("app", "new-secret", true).await;
    let app2 = connect(&url2.parse().unwrap()).await;
    assert_eq!(
        scalar(
            &app2,
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        )
        .await,
        "t"
    );
    assert!(url.parse::<Config>().unwrap().connect(NoTls).await.is_err());
}

#[tokio::test]
async fn cluster_kill_restart_same_port() {
    let started = Instant::now();
    let cluster = Cluster::start().unwrap();
    eprintln!("private Cluster::start took {:?}", started.elapsed());
    assert_eq!(cluster.host(), "127.0.0.1");
    let port = cluster.port();
    let db = TestDb::on(&cluster, "restart").await;
    let client = db.connect().await;
    column(
        &client,
        "CREATE TABLE survives (x int); INSERT INTO survives VALUES (7)",
    )
    .await;

    cluster.kill().unwrap();
    assert!(
        client.simple_query("SELECT 1").await.is_err(),
        "connection survived kill"
    );
    wait_closed(&client).await;
    assert!(db.config().connect(NoTls).await.is_err(), "server still up");
    cluster.kill().unwrap(); // no-op when down

    let started = Instant::now();
    cluster.start_again().unwrap();
    eprintln!("start_again after kill took {:?}", started.elapsed());
    assert_eq!(cluster.port(), port);
    let client = db.connect().await;
    assert_eq!(scalar(&client, "SELECT x FROM survives").await, "7");
    let err = cluster.start_again().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::AlreadyExists, "{err}");

    let started = Instant::now();
    cluster.restart().unwrap();
    eprintln!("restart took {:?}", started.elapsed());
    assert!(
        client.simple_query("SELECT 1").await.is_err(),
        "connection survived restart"
    );
    let client = db.connect().await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");

    cluster.stop().unwrap();
    cluster.stop().unwrap(); // no-op when down
    cluster.start_again().unwrap();
    let client = db.connect().await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    assert!(cluster.data_dir().join("server.log").is_file());
}

#[test]
fn start_again_reports_a_taken_port_with_the_log() {
    let cluster = Cluster::start().unwrap();
    cluster.stop().unwrap();
    let _squatter = std::net::TcpListener::bind(("127.0.0.1", cluster.port())).unwrap();
    let started = Instant::now();
    let msg = cluster.start_again().unwrap_err().to_string();
    eprintln!("{msg}");
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(msg.contains("server.log"), "{msg}");
    assert!(msg.contains("could not bind"), "{msg}");
}

#[test]
fn cluster_drop_removes_everything() {
    let cluster = Cluster::start().unwrap();
    let data = cluster.data_dir().to_owned();
    let pid = postmaster_pid(&data);
    assert!(process_exists(pid));
    let kids = children_of(pid);
    assert!(!kids.is_empty());
    drop(cluster);
    assert!(!data.exists(), "{} still exists", data.display());
    assert!(!data.parent().unwrap().exists());
    assert!(!process_exists(pid), "postmaster left");
    let left: Vec<_> = kids.iter().filter(|k| process_exists(**k)).collect();
    assert!(left.is_empty(), "postgres processes left: {left:?}");
}

#[tokio::test]
async fn pgbouncer_transaction_mode() {
    require_pgbouncer();
    let cluster = shared_cluster().await;
    let db = TestDb::on(cluster, "bnc_tx").await;
    let bouncer = PgBouncer::start(cluster, PoolMode::Transaction).unwrap();

    let console = connect(&bouncer.config("pgbouncer")).await;
    let config = show(&console, "CONFIG").await;
    let mode = config
        .iter()
        .find(|r| field(r, "key") == "pool_mode")
        .unwrap();
    assert_eq!(field(mode, "value"), "transaction");

    let a = connect(&bouncer.config(db.name())).await;
    let b = connect(&bouncer.config(db.name())).await;
    let pid_a1 = scalar(&a, "SELECT pg_backend_pid()").await;
    // B's transaction gets the server connection A just released...
    column(&b, "BEGIN").await;
    let pid_b = scalar(&b, "SELECT pg_backend_pid()").await;
    assert_eq!(
        pid_b, pid_a1,
        "server connection not shared between clients"
    );
    // ...so while B holds it, A runs on another one.
    let pid_a2 = scalar(&a, "SELECT pg_backend_pid()").await;
    assert_ne!(pid_a2, pid_a1, "client kept its server connection");
    column(&b, "COMMIT").await;

    let pools = show(&console, "POOLS").await;
    let pool = pools
        .iter()
        .find(|r| field(r, "database") == db.name())
        .unwrap();
    assert_eq!(field(pool, "pool_mode"), "transaction");

    // Roles other than the superuser log in via auth_query.
    let url = db.create_role("bncuser", "bnc-secret", false).await;
    let role_url: Config = url.parse().unwrap();
    let mut role_config = Config::new();
    role_config
        .host("127.0.0.1")
        .port(bouncer.port())
        .user(role_url.get_user().unwrap())
        .password(role_url.get_password().unwrap())
        .dbname(db.name());
    let r = connect(&role_config).await;
    assert_eq!(
        scalar(&r, "SELECT current_user").await,
        db.role_name("bncuser")
    );
    role_config.password("wrong");
    assert!(
        role_config.connect(NoTls).await.is_err(),
        "wrong password accepted"
    );
    let mut su = bouncer.config(db.name());
    su.password("wrong");
    assert!(su.connect(NoTls).await.is_err(), "wrong password accepted");
}

#[tokio::test]
async fn pgbouncer_session_mode_and_restart() {
    require_pgbouncer();
    let cluster = shared_cluster().await;
    let db = TestDb::on(cluster, "bnc_session").await;
    let bouncer = PgBouncer::start(cluster, PoolMode::Session).unwrap();
    assert!(bouncer
        .url(db.name())
        .contains(&format!(":{}/", bouncer.port())));
    assert!(bouncer
        .url("x")
        .starts_with(&format!("postgres://{SUPERUSER}:{TEST_PASSWORD}@")));

    let console = connect(&bouncer.config("pgbouncer")).await;
    let config = show(&console, "CONFIG").await;
    let mode = config
        .iter()
        .find(|r| field(r, "key") == "pool_mode")
        .unwrap();
    assert_eq!(field(mode, "value"), "session");

    let a = connect(&bouncer.url(db.name()).parse().unwrap()).await;
    let b = connect(&bouncer.config(db.name())).await;
    let pid_a1 = scalar(&a, "SELECT pg_backend_pid()").await;
    let pid_b = scalar(&b, "SELECT pg_backend_pid()").await;
    let pid_a2 = scalar(&a, "SELECT pg_backend_pid()").await;
    assert_ne!(pid_a1, pid_b);
    assert_eq!(
        pid_a1, pid_a2,
        "session mode must keep the server connection"
    );
    // Prepared statements work in session mode.
    let row = a.query_one("SELECT $1::text", &[&"hi"]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "hi");

    let port = bouncer.port();
    bouncer.restart().unwrap();
    assert_eq!(bouncer.port(), port);
    assert!(
        a.simple_query("SELECT 1").await.is_err(),
        "connection survived restart"
    );
    let c = connect(&bouncer.config(db.name())).await;
    assert_eq!(scalar(&c, "SELECT 1").await, "1");

    bouncer.stop().unwrap();
    assert!(bouncer.config(db.name()).connect(NoTls).await.is_err());
    bouncer.restart().unwrap();
    let c = connect(&bouncer.config(db.name())).await;
    assert_eq!(scalar(&c, "SELECT 1").await, "1");
}

#[tokio::test]
async fn fault_proxy_blackhole_and_heal() {
    let cluster = shared_cluster().await;
    let db = TestDb::on(cluster, "proxy_bh").await;
    assert_eq!(db.server_addr(), cluster.addr());
    let proxy = FaultProxy::start(db.server_addr()).unwrap();
    assert_eq!(proxy.addr().port(), proxy.port());
    let config = db.config_via(proxy.port());

    let client = connect(&config).await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    assert_eq!(proxy.connections(), 1);

    proxy.blackhole();
    let q = timeout(Duration::from_millis(500), client.simple_query("SELECT 2")).await;
    assert!(q.is_err(), "query answered through a blackhole: {q:?}");
    let c = timeout(Duration::from_millis(500), config.connect(NoTls)).await;
    assert!(c.is_err(), "connected through a blackhole");
    assert!(!client.is_closed(), "blackhole must not close connections");

    proxy.heal();
    let fresh = connect(&config).await;
    assert_eq!(scalar(&fresh, "SELECT 3").await, "3");
    // Bytes were held, not dropped: the old connection resumes.
    assert_eq!(scalar(&client, "SELECT 4").await, "4");
}

#[tokio::test]
async fn fault_proxy_cut_and_refuse() {
    let cluster = shared_cluster().await;
    let db = TestDb::on(cluster, "proxy_cut").await;
    let proxy = FaultProxy::start(cluster.addr()).unwrap();
    let config = db.config_via(proxy.port());

    let c1 = connect(&config).await;
    let c2 = connect(&config).await;
    assert_eq!(scalar(&c1, "SELECT 1").await, "1");
    assert_eq!(proxy.connections(), 2);
    proxy.cut();
    assert_eq!(proxy.connections(), 0);
    assert!(
        c1.simple_query("SELECT 1").await.is_err(),
        "query after cut"
    );
    wait_closed(&c1).await;
    wait_closed(&c2).await;

    // New connections still work after a cut.
    let c3 = connect(&config).await;
    assert_eq!(scalar(&c3, "SELECT 1").await, "1");

    proxy.refuse(true);
    let started = Instant::now();
    let r = timeout(Duration::from_secs(5), config.connect(NoTls)).await;
    assert!(matches!(r, Ok(Err(_))), "connection not refused");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(
        scalar(&c3, "SELECT 1").await,
        "1",
        "refuse affects old connections"
    );
    proxy.refuse(false);
    let c4 = connect(&config).await;
    assert_eq!(scalar(&c4, "SELECT 1").await, "1");
    assert_eq!(proxy.connections(), 2);
}

#[tokio::test]
async fn fault_proxy_upstream_down() {
    let cluster = Cluster::start().unwrap();
    let proxy = FaultProxy::start(cluster.addr()).unwrap();
    let mut config = Config::new();
    config
        .host("127.0.0.1")
        .port(proxy.port())
        .user(SUPERUSER)
        .password(TEST_PASSWORD)
        .dbname("postgres");
    let client = connect(&config).await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    cluster.kill().unwrap();
    assert!(client.simple_query("SELECT 1").await.is_err());
    let r = timeout(Duration::from_secs(5), config.connect(NoTls)).await;
    assert!(matches!(r, Ok(Err(_))), "connected to a dead upstream");
    cluster.start_again().unwrap();
    let client = connect(&config).await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
}

// --- cleanup when the test process dies -----------------------------------

fn postmaster_pid(data: &std::path::Path) -> u32 {
    std::fs::read_to_string(data.join("postmaster.pid"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Live processes whose command line contains `needle` (pgbouncer, the
/// postmaster and the reapers name their directory).
fn processes_matching(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) && process_exists(pid) {
            found.push(format!("{pid}: {cmdline}"));
        }
    }
    found
}

/// Pids of the children of `pid` (a postmaster's backends and workers).
fn children_of(pid: u32) -> Vec<u32> {
    let mut kids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(kid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let after = stat.rsplit(')').next().unwrap_or("");
        if after
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok())
            == Some(pid)
        {
            kids.push(kid);
        }
    }
    kids
}

/// Whether `pid` exists and is not a zombie.
fn process_exists(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .next();
    matches!(state, Some(s) if s != "Z")
}

/// Not a real test: run by `reaper_cleans_up_after_crash` in a child process,
/// it starts a cluster and a pgbouncer, then aborts (no destructors run).
#[test]
fn crash_helper() {
    if std::env::var_os("PGELECT_TESTKIT_CRASH_HELPER").is_none() {
        return;
    }
    let cluster = Cluster::start().unwrap();
    let bouncer = PgBouncer::start(&cluster, PoolMode::Session).unwrap();
    let shared = Cluster::shared();
    let (pm, shared_pm) = (
        postmaster_pid(cluster.data_dir()),
        postmaster_pid(shared.data_dir()),
    );
    let kids: Vec<String> = children_of(pm)
        .into_iter()
        .chain(children_of(shared_pm))
        .map(|k| k.to_string())
        .collect();
    println!(
        "CRASH_HELPER pid={} pm={pm} shared_pm={shared_pm} kids={} data={} shared_data={} bouncer_port={}",
        std::process::id(),
        kids.join(","),
        cluster.data_dir().display(),
        shared.data_dir().display(),
        bouncer.port(),
    );
    std::process::abort();
}

#[test]
fn reaper_cleans_up_after_crash() {
    require_pgbouncer();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            // The helper's full name in this binary (`kit::crash_helper`).
            &format!(
                "{}::crash_helper",
                module_path!().split_once("::").unwrap().1
            ),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PGELECT_TESTKIT_CRASH_HELPER", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "helper did not abort: {stdout}");
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("CRASH_HELPER ").map(|(_, rest)| rest))
        .unwrap_or_else(|| {
            panic!(
                "no helper output: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let get = |key: &str| -> String {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .unwrap()
            .to_owned()
    };
    let helper_pid = get("pid");
    let pms: Vec<u32> = vec![
        get("pm").parse().unwrap(),
        get("shared_pm").parse().unwrap(),
    ];
    let dirs: Vec<PathBuf> = [get("data"), get("shared_data")]
        .iter()
        .map(|d| PathBuf::from(d).parent().unwrap().to_owned())
        .collect();
    // <base>/pgelect-testkit-pg-<pid>-<n>-<nanos>/data
    let base = dirs[0].parent().unwrap().to_owned();
    let kids: Vec<u32> = get("kids").split(',').map(|k| k.parse().unwrap()).collect();
    assert!(kids.len() >= 8, "{kids:?}");
    let bouncer_needle = format!("pgelect-testkit-pgbouncer-{helper_pid}-");

    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut left: Vec<String> = Vec::new();
        for pid in pms.iter().chain(&kids) {
            if process_exists(*pid) {
                left.push(format!("postgres process {pid}"));
            }
        }
        left.extend(processes_matching(&bouncer_needle));
        left.extend(processes_matching(&format!(
            "pgelect-testkit-pg-{helper_pid}-"
        )));
        let temp_left: Vec<String> = std::fs::read_dir(&base)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("pgelect-testkit-") && n.contains(&format!("-{helper_pid}-")))
            .collect();
        let dirs_left: Vec<&PathBuf> = dirs.iter().filter(|d| d.exists()).collect();
        if left.is_empty() && temp_left.is_empty() && dirs_left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not cleaned up after crash: processes {left:?}, dirs {dirs_left:?} {temp_left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
