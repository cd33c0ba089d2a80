//! The command over TLS: settings from the URL, from a key/value string and
//! from the `PGSSL*` variables, against a cluster that accepts only TLS; bad
//! TLS settings exit 78 (configuration) naming the setting.

use crate::support;

use std::time::Duration;

use pgelect_testkit::{Cluster, ClusterOptions, TestDb, TlsMode, SUPERUSER, TEST_PASSWORD};
use support::{pgelect, run};

const LIMIT: Duration = Duration::from_secs(60);

async fn tls_cluster() -> Cluster {
    tokio::task::spawn_blocking(|| {
        Cluster::start_with(ClusterOptions::new().tls(TlsMode::Required))
    })
    .await
    .unwrap()
    .expect("a TLS cluster starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_lock_and_status_over_verify_full() {
    let cluster = tls_cluster().await;
    let db = TestDb::on(&cluster, "cli_tls").await;
    let ca = cluster.certs().unwrap().ca_cert().display().to_string();
    // The URL form.
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={ca}",
        cluster.tcp_url(db.name())
    );
    run(pgelect(["migrate", "--database-url", &url]), LIMIT)
        .await
        .assert_code(0);
    // The key/value form, with a quoted path.
    let kv = format!(
        "host=localhost port={} user={SUPERUSER} password={TEST_PASSWORD} dbname={} sslmode=verify-full sslrootcert='{ca}'",
        cluster.port(),
        db.name()
    );
    let mut cmd = pgelect(["lock", "--key", "cli-tls-lock", "--", "true"]);
    cmd.env("DATABASE_URL", &kv);
    run(cmd, LIMIT).await.assert_code(0);
    // The PGSSL* variables, with a URL that says nothing about TLS.
    let mut cmd = pgelect(["status"]);
    cmd.env("DATABASE_URL", cluster.tcp_url(db.name()))
        .env("PGSSLMODE", "verify-full")
        .env("PGSSLROOTCERT", &ca);
    let r = run(cmd, LIMIT).await;
    r.assert_code(0);
    println!("{}", r.output());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_failures_exit_78_and_say_which_setting() {
    let cluster = tls_cluster().await;
    let db = TestDb::on(&cluster, "cli_tls_bad").await;
    let certs = cluster.certs().unwrap();
    let cases: Vec<(Vec<(&str, String)>, &str)> = vec![
        (
            vec![
                ("PGSSLMODE", "verify-full".into()),
                ("PGSSLROOTCERT", certs.wrong_ca_cert().display().to_string()),
            ],
            "not signed by a CA",
        ),
        (vec![("PGSSLMODE", "verify-fulll".into())], "PGSSLMODE"),
        (
            vec![
                ("PGSSLMODE", "verify-ca".into()),
                ("PGSSLROOTCERT", "/nonexistent/ca.crt".into()),
            ],
            "PGSSLROOTCERT",
        ),
        (vec![("PGSSLMODE", "disable".into())], "accepts only TLS"),
    ];
    for (vars, expected) in cases {
        let mut cmd = pgelect(["status"]);
        cmd.env("DATABASE_URL", cluster.tcp_url(db.name()));
        for (k, v) in &vars {
            cmd.env(k, v);
        }
        let r = run(cmd, LIMIT).await;
        r.assert_code(78);
        let out = r.output();
        assert!(out.contains(expected), "{vars:?}: {out}");
        assert!(!out.contains(TEST_PASSWORD), "{out}");
        println!("{vars:?}: {}", out.trim());
    }
}
