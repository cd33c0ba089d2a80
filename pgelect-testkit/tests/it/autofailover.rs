//! Tests of the kit's pg_auto_failover formation, against the real manager:
//! the settings it promises, the manager's switchover, a node's death and
//! its return, and that nothing is left behind.

use std::time::{Duration, Instant};

use pgelect_testkit::{autofailover_available, AutoFailover};

use crate::support::{connect, scalar};

/// Whether the formation can run here; prints a visible `SKIPPED` otherwise.
fn available(test: &str) -> bool {
    match autofailover_available() {
        Ok(()) => true,
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            false
        }
    }
}

/// Processes whose command line mentions `dir`.
fn processes_in(dir: &std::path::Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&needle) && !c.contains("pgelect-testkit-reaper"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formation_settings_switchover_node_death_and_cleanup() {
    if !available("formation_settings_switchover_node_death_and_cleanup") {
        return;
    }
    let t0 = Instant::now();
    let haf = tokio::task::spawn_blocking(AutoFailover::start)
        .await
        .unwrap()
        .expect("start a pg_auto_failover formation");
    eprintln!("formation ready in {:?}", t0.elapsed());
    let dir = haf.dir().to_owned();
    assert_eq!(haf.primary().unwrap(), 0);

    // The settings pg_autoctl would size for a production host.
    let n0 = connect(&haf.node_config(0, "postgres")).await;
    for (setting, want) in [
        ("listen_addresses", "127.0.0.1".to_owned()),
        ("shared_buffers", "16MB".to_owned()),
        ("unix_socket_directories", dir.display().to_string()),
        ("pg_is_in_recovery()", "f".to_owned()),
    ] {
        let sql = if setting.ends_with(')') {
            format!("SELECT {setting}")
        } else {
            format!("SELECT current_setting('{setting}')")
        };
        assert_eq!(scalar(&n0, &sql).await, want, "{setting}");
    }
    let sync = scalar(&n0, "SELECT current_setting('synchronous_standby_names')").await;
    assert!(
        sync.starts_with("ANY 1"),
        "synchronous replication: {sync:?}"
    );
    let n1 = connect(&haf.node_config(1, "postgres")).await;
    assert_eq!(scalar(&n1, "SELECT pg_is_in_recovery()").await, "t");
    drop((n0, n1));
    // Only the kit's password over TCP.
    let mut wrong = haf.node_config(0, "postgres");
    wrong.password("wrong");
    assert!(wrong.connect(tokio_postgres::NoTls).await.is_err());

    // The multi-host URL reaches the primary, before and after a switchover.
    haf.create_database("kit_haf").unwrap();
    let url: tokio_postgres::Config = haf.url("kit_haf").parse().unwrap();
    let c = connect(&url).await;
    assert_eq!(
        scalar(&c, "SELECT current_setting('port')").await,
        haf.ports()[0].to_string()
    );
    drop(c);
    let haf = std::sync::Arc::new(haf);
    let h = haf.clone();
    let t = Instant::now();
    tokio::task::spawn_blocking(move || h.perform_switchover())
        .await
        .unwrap()
        .expect("perform switchover");
    eprintln!("switchover took {:?}", t.elapsed());
    let h = haf.clone();
    let primary = tokio::task::spawn_blocking(move || h.wait_stable(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(primary, 1);
    let c = connect(&url).await;
    assert_eq!(
        scalar(&c, "SELECT current_setting('port')").await,
        haf.ports()[1].to_string()
    );
    drop(c);

    // The primary's machine dies: the monitor promotes the other node.
    let h = haf.clone();
    let t = Instant::now();
    let promoted = tokio::task::spawn_blocking(move || {
        h.kill_node(1)?;
        h.wait_for("node 0 promoted", Duration::from_secs(60), |s| {
            s[0].accepts_writes()
        })
    })
    .await
    .unwrap()
    .expect("failover after a node kill");
    eprintln!("node kill -> primary in {:?}: {promoted:?}", t.elapsed());
    let h = haf.clone();
    tokio::task::spawn_blocking(move || {
        h.restart_node(1)?;
        h.wait_stable(Duration::from_secs(90))
    })
    .await
    .unwrap()
    .expect("the killed node rejoins");

    // A postmaster kill: the keeper restarts it in place.
    let pid = haf.kill_postmaster(0).unwrap();
    let c = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Ok((c, conn)) = url.connect(tokio_postgres::NoTls).await {
                tokio::spawn(conn);
                return c;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("a primary again after a postmaster kill");
    let pid_now: u32 = scalar(&c, "SELECT pg_backend_pid()").await.parse().unwrap();
    assert_ne!(pid_now, pid);
    assert_eq!(
        scalar(&c, "SELECT current_setting('port')").await,
        haf.ports()[0].to_string()
    );
    drop(c);

    // Nothing left once dropped.
    let haf = std::sync::Arc::into_inner(haf).expect("last handle");
    assert!(!processes_in(&dir).is_empty());
    haf.stop();
    assert_eq!(processes_in(&dir), Vec::<String>::new());
    assert!(!dir.exists(), "{} removed", dir.display());
}

/// `keep_in`: the formation's evidence is kept when it stops (the
/// monitor's events, the keepers' and the servers' logs, with every
/// statement logged), and its directory is removed all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_formation_leaves_its_events_and_logs() {
    if !available("a_kept_formation_leaves_its_events_and_logs") {
        return;
    }
    let keep = std::env::temp_dir().join(format!("pgelect-testkit-kept-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&keep);
    let options = pgelect_testkit::AutoFailoverOptions::new().keep_in(&keep);
    let haf = tokio::task::spawn_blocking(move || AutoFailover::start_with(options))
        .await
        .unwrap()
        .expect("start a pg_auto_failover formation");
    let dir = haf.dir().to_owned();
    let n0 = connect(&haf.node_config(0, "postgres")).await;
    assert_eq!(
        scalar(&n0, "SELECT current_setting('log_min_duration_statement')").await,
        "0"
    );
    scalar(&n0, "SELECT 'kept-formation-marker'").await;
    drop(n0);
    tokio::task::spawn_blocking(move || haf.stop())
        .await
        .unwrap();
    assert!(!dir.exists(), "{} left behind", dir.display());
    let read = |f: &str| std::fs::read_to_string(keep.join(f)).unwrap_or_default();
    assert!(
        read("events.txt").contains("node1"),
        "{}",
        read("events.txt")
    );
    assert!(read("events.json").trim_start().starts_with('['));
    assert!(
        read("node1.log").contains("pg_autoctl"),
        "{}",
        read("node1.log")
    );
    let server_logs: String = std::fs::read_dir(keep.join("pglog"))
        .expect("the servers' logs")
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
    assert!(
        server_logs.contains("kept-formation-marker"),
        "the statement is in a server's log"
    );
    let _ = std::fs::remove_dir_all(&keep);
}
