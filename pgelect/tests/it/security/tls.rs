//! TLS against real servers that speak it: a cluster whose `pg_hba.conf`
//! accepts only `hostssl` (and, for one user, only a client certificate),
//! certificates from a CA the test kit generates, and a PgBouncer with TLS on
//! both sides. Each test starts its own cluster.

use std::path::Path;
use std::time::Duration;

use pgelect::lock::{LockMode, Wait};
use pgelect::{
    conn::SslMode, election::Backend, ConnectOptions, Elector, Error, LockKey, LockSession,
};
use pgelect_testkit::{
    BouncerTls, Cluster, ClusterOptions, PgBouncer, PoolMode, TestDb, TlsMode, SUPERUSER,
    TEST_PASSWORD,
};

async fn tls_cluster(mode: TlsMode) -> Cluster {
    tokio::task::spawn_blocking(move || Cluster::start_with(ClusterOptions::new().tls(mode)))
        .await
        .unwrap()
        .expect("a TLS cluster starts")
}

fn with_params(url: &str, params: &[(&str, &Path)], mode: &str) -> String {
    let mut url = format!("{url}?sslmode={mode}");
    for (k, v) in params {
        url.push_str(&format!("&{k}={}", v.display()));
    }
    url
}

/// Every connection pgelect opened for this test database uses TLS (the
/// kit's own connections go through a Unix socket and are not counted).
async fn assert_all_pgelect_connections_encrypted(db: &TestDb) -> i64 {
    let admin = db.connect().await;
    let rows = admin
        .query(
            "SELECT a.application_name, coalesce(s.ssl, false), coalesce(s.version, '')
               FROM pg_stat_activity a LEFT JOIN pg_stat_ssl s USING (pid)
              WHERE a.datname = $1 AND a.application_name LIKE 'pgelect:%'",
            &[&db.name()],
        )
        .await
        .unwrap();
    for r in &rows {
        let (app, ssl, version): (String, bool, String) = (r.get(0), r.get(1), r.get(2));
        assert!(ssl, "{app} is not encrypted");
        println!("{app}: TLS {version}");
    }
    rows.len() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn verify_full_with_the_right_ca_carries_every_connection() {
    let cluster = tls_cluster(TlsMode::Required).await;
    let db = TestDb::on(&cluster, "tls_full").await;
    let ca = cluster.certs().unwrap().ca_cert().to_owned();
    let url = with_params(
        &cluster.tcp_url(db.name()),
        &[("sslrootcert", &ca)],
        "verify-full",
    );
    let o = ConnectOptions::from_url(&url).unwrap();
    assert_eq!(o.ssl_mode(), SslMode::VerifyFull);
    pgelect::migrate(&o).await.expect("migrate over TLS");

    // Session backend: a leader and a blocking standby, an observer.
    let a = Elector::builder(o.clone(), "tls-role")
        .node_id("a")
        .build()
        .unwrap();
    let b = Elector::builder(o.clone(), "tls-role")
        .node_id("b")
        .build()
        .unwrap();
    let la = a.leadership().await.expect("a leads over TLS");
    let b_task = tokio::spawn(async move {
        let l = b.leadership().await.expect("b leads after a");
        (l.term(), b)
    });
    let seen = pgelect::admin::current_leader(&o, "tls-role")
        .await
        .unwrap();
    assert_eq!(seen.map(|l| l.holder), Some("a".to_owned()));
    // Locks on a session of their own.
    let locks = LockSession::connect(&o).await.unwrap();
    let key = LockKey::from_name("tls-lock").unwrap();
    let guard = locks
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    // The standby is waiting by now or soon: count connections once it is.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let counted = loop {
        let n = assert_all_pgelect_connections_encrypted(&db).await;
        if n >= 3 || tokio::time::Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(counted >= 3, "only {counted} pgelect connections seen");
    guard.release().await.unwrap();
    let first = la.term();
    la.resign().await.unwrap();
    let (second, _b) = tokio::time::timeout(Duration::from_secs(10), b_task)
        .await
        .expect("handover within 10 s")
        .unwrap();
    assert!(second > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrong_ca_is_refused_and_the_error_says_so() {
    let cluster = tls_cluster(TlsMode::Required).await;
    let db = TestDb::on(&cluster, "tls_wrong_ca").await;
    let certs = cluster.certs().unwrap();
    for mode in ["verify-full", "verify-ca", "require"] {
        // `require` with a root certificate checks the chain, as in libpq.
        let url = with_params(
            &cluster.tcp_url(db.name()),
            &[("sslrootcert", certs.wrong_ca_cert())],
            mode,
        );
        let o = ConnectOptions::from_url(&url).unwrap();
        let e = pgelect::migrate(&o).await.unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::Tls { .. }), "{mode}: {e:?}");
        assert!(e.is_config(), "{mode}");
        assert!(text.contains("not signed by a CA"), "{mode}: {text}");
        assert!(text.contains(&format!("sslmode={mode}")), "{text}");
        assert!(!text.contains(TEST_PASSWORD), "{text}");
        println!("{mode}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let cluster = tls_cluster(TlsMode::Required).await;
    let db = TestDb::on(&cluster, "tls_host").await;
    let ca = cluster.certs().unwrap().ca_cert().display().to_string();
    // Connect to 127.0.0.1 while checking a name the certificate lacks.
    let kv = |mode: &str| {
        format!(
            "host=not-the-server.invalid hostaddr=127.0.0.1 port={} user={SUPERUSER} password={TEST_PASSWORD} dbname={} sslmode={mode} sslrootcert='{ca}'",
            cluster.port(),
            db.name()
        )
    };
    let o = ConnectOptions::from_url(&kv("verify-full")).unwrap();
    let e = pgelect::admin::current_leader(&o, "r").await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    assert!(text.contains("does not name the host"), "{text}");
    println!("verify-full: {text}");

    let o = ConnectOptions::from_url(&kv("verify-ca")).unwrap();
    pgelect::migrate(&o)
        .await
        .expect("verify-ca ignores the name");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_works_without_a_ca_and_prefer_uses_tls_when_offered() {
    let cluster = tls_cluster(TlsMode::Offered).await;
    let db = TestDb::on(&cluster, "tls_require").await;
    for mode in ["require", "prefer", "allow"] {
        let o =
            ConnectOptions::from_url(&with_params(&cluster.tcp_url(db.name()), &[], mode)).unwrap();
        pgelect::migrate(&o).await.expect(mode);
        let locks = LockSession::connect(&o).await.unwrap();
        let (ssl,): (bool,) = {
            let admin = db.connect().await;
            let row = admin
                .query_one(
                    "SELECT coalesce(bool_or(s.ssl), false) FROM pg_stat_activity a
                       JOIN pg_stat_ssl s USING (pid)
                      WHERE a.datname = $1 AND a.application_name = 'pgelect:locks'",
                    &[&db.name()],
                )
                .await
                .unwrap();
            (row.get(0),)
        };
        // allow starts in plain text and the server accepts it.
        assert_eq!(ssl, mode != "allow", "{mode}");
        drop(locks);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostssl_only_server_refuses_plain_text_with_a_clear_message() {
    let cluster = tls_cluster(TlsMode::Required).await;
    let db = TestDb::on(&cluster, "tls_plain").await;
    let o = ConnectOptions::from_url(&with_params(&cluster.tcp_url(db.name()), &[], "disable"))
        .unwrap();
    let e = pgelect::migrate(&o).await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    assert!(text.contains("accepts only TLS"), "{text}");
    assert!(text.contains("sslmode=disable"), "{text}");
    println!("{text}");
    // allow falls back to TLS when refused, as libpq does.
    let o =
        ConnectOptions::from_url(&with_params(&cluster.tcp_url(db.name()), &[], "allow")).unwrap();
    pgelect::migrate(&o).await.expect("allow retries with TLS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_in_without_a_password() {
    let user = "cert_user";
    let cluster = tls_cluster(TlsMode::ClientCert { user: user.into() }).await;
    let db = TestDb::on(&cluster, "tls_cert").await;
    let certs = cluster.certs().unwrap();
    let base = cluster.tcp_url_as(user, None, db.name());
    let url = with_params(
        &base,
        &[
            ("sslrootcert", certs.ca_cert()),
            ("sslcert", certs.client_cert()),
            ("sslkey", certs.client_key()),
        ],
        "verify-full",
    );
    let o = ConnectOptions::from_url(&url).unwrap();
    assert!(!o.has_password() || std::env::var_os("PGPASSWORD").is_some());
    let locks = LockSession::connect(&o).await.expect("certificate login");
    let key = LockKey::from_name("cert-lock").unwrap();
    let guard = locks
        .acquire(key, LockMode::Exclusive, Wait::Never)
        .await
        .unwrap()
        .expect("free");
    guard.release().await.unwrap();

    // Without the certificate the server refuses the login.
    let bare = with_params(&base, &[("sslrootcert", certs.ca_cert())], "verify-full");
    let e = LockSession::connect(&ConnectOptions::from_url(&bare).unwrap())
        .await
        .unwrap_err();
    assert!(e.is_auth(), "{e:?}");
    println!("without a certificate: {e}");

    // A key that is not the certificate's is refused before connecting.
    let bad = with_params(
        &base,
        &[
            ("sslrootcert", certs.ca_cert()),
            ("sslcert", certs.client_cert()),
            ("sslkey", certs.mismatched_client_key()),
        ],
        "verify-full",
    );
    let e = ConnectOptions::from_url(&bad).unwrap_err();
    let text = e.to_string();
    assert!(e.is_config(), "{e:?}");
    assert!(
        text.contains("sslkey") && text.contains("does not match"),
        "{text}"
    );
    println!("mismatched key: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lease_backend_works_through_pgbouncer_with_tls_on_both_sides() {
    if !pgelect_testkit::pgbouncer_available() {
        panic!("pgbouncer is required (scripts/setup.sh installs it)");
    }
    let cluster = tls_cluster(TlsMode::Required).await;
    let db = TestDb::on(&cluster, "tls_bouncer").await;
    let ca = cluster.certs().unwrap().ca_cert().to_owned();
    let direct = ConnectOptions::from_url(&with_params(
        &cluster.tcp_url(db.name()),
        &[("sslrootcert", &ca)],
        "verify-full",
    ))
    .unwrap();
    pgelect::migrate(&direct).await.unwrap();
    let bouncer = PgBouncer::start_with(&cluster, PoolMode::Transaction, BouncerTls::Required)
        .expect("pgbouncer starts");
    let pooled = ConnectOptions::from_url(&with_params(
        &bouncer.tcp_url(db.name()),
        &[("sslrootcert", bouncer.ca_cert().unwrap())],
        "verify-full",
    ))
    .unwrap();
    let fast = |node: &str| {
        Elector::builder(pooled.clone(), "tls-lease")
            .backend(Backend::Lease)
            .node_id(node)
            .ttl(Duration::from_secs(2))
            .renew_every(Duration::from_millis(500))
            .lease(|l| {
                l.statement_timeout(Duration::from_millis(900))
                    .retry_every(Duration::from_millis(200))
            })
            .check_every(Duration::from_millis(200))
            .lease(|l| l.listen_via(direct.clone()))
            .build()
            .unwrap()
    };
    let a = fast("a");
    let b = fast("b");
    let la = a.leadership().await.expect("a leads through the pooler");
    let b_task = tokio::spawn(async move { b.leadership().await.map(|l| l.term()) });
    // Several renewals go through the pooler's TLS.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!la.is_lost(), "{:?}", la.loss().map(|l| l.reason()));
    let first = la.term();
    la.resign().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), b_task)
        .await
        .expect("b leads within 10 s")
        .unwrap()
        .unwrap();
    assert!(second > first);
    // The pooler's server connections are TLS too (the cluster refuses plain).
    let admin = db.connect().await;
    let row = admin
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a
               JOIN pg_stat_ssl s USING (pid)
              WHERE a.datname = $1 AND a.client_addr IS NOT NULL",
            &[&db.name()],
        )
        .await
        .unwrap();
    let (all, ssl): (i64, i64) = (row.get(0), row.get(1));
    assert!(
        all > 0 && all == ssl,
        "{ssl} of {all} TCP connections use TLS"
    );
    println!("{ssl} of {all} server connections use TLS");
}

#[test]
fn bad_tls_input_names_the_setting() {
    let dir = std::env::temp_dir().join(format!("pgelect-tls-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = "postgres://app:hunter2@db.invalid:5432/app";
    let cases: Vec<(String, &str)> = vec![
        (format!("{base}?sslmode=verify_full"), "sslmode"),
        (format!("{base}?sslmode=verify-full"), "sslrootcert"),
        (
            format!("{base}?sslrootcert=/nonexistent/ca.pem&sslmode=verify-ca"),
            "sslrootcert",
        ),
        (
            format!("{base}?sslrootcert={}", dir.display()),
            "sslrootcert",
        ),
        (
            format!("{base}?sslcert=/nonexistent/c.pem&sslkey=/nonexistent/k.pem"),
            "sslcert",
        ),
        (format!("{base}?sslkey=/nonexistent/k.pem"), "sslkey"),
        (format!("{base}?sslsni=maybe"), "sslsni"),
        (
            format!("{base}?ssl_min_protocol_version=TLSv9"),
            "ssl_min_protocol_version",
        ),
        (format!("{base}?sslpassword=x"), "sslpassword"),
        (
            format!("{base}?sslrootcert=system&sslmode=require"),
            "verify-full",
        ),
        (
            "host=db.invalid user=app password=hunter2 sslmode=nope".to_string(),
            "sslmode",
        ),
    ];
    for (url, setting) in cases {
        let e = ConnectOptions::from_url(&url).unwrap_err();
        let text = e.to_string();
        assert!(e.is_config(), "{url}: {e:?}");
        assert!(text.contains(setting), "{url}: {text}");
        assert!(!text.contains("hunter2"), "{text}");
    }
    // A key file others can read is refused, as libpq refuses it.
    let cert = dir.join("c.pem");
    let key = dir.join("k.pem");
    std::fs::write(&cert, "not a certificate").unwrap();
    std::fs::write(&key, "not a key").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = ConnectOptions::from_url(&format!(
        "{base}?sslcert={}&sslkey={}",
        cert.display(),
        key.display()
    ))
    .unwrap_err();
    assert!(e.to_string().contains("group or world access"), "{e}");
    // Garbage in the files is named too.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let e = ConnectOptions::from_url(&format!(
        "{base}?sslcert={}&sslkey={}",
        cert.display(),
        key.display()
    ))
    .unwrap_err();
    assert!(e.to_string().contains("sslcert"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
