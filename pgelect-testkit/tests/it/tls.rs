//! The kit's TLS servers, proved with real clients: tokio-postgres over
//! rustls with ring (what the library uses) and, when installed, `psql`
//! (libpq over OpenSSL).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgelect_testkit::{
    pg_bin_dir, pgbouncer_available, BouncerTls, Cluster, ClusterOptions, PgBouncer, PoolMode,
    TestDb, TlsMode, SUPERUSER, TEST_PASSWORD,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::time::timeout;

use crate::support::scalar;
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Config, NoTls, SimpleQueryMessage};
use tokio_postgres_rustls::MakeRustlsConnect;

/// A rustls connector (ring) trusting `ca`, with a client certificate if
/// given.
fn connector(ca: &Path, client: Option<(&Path, &Path)>) -> MakeRustlsConnect {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).expect("read the CA") {
        roots.add(cert.expect("parse the CA")).expect("add the CA");
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .expect("read the client certificate")
                .collect::<Result<Vec<_>, _>>()
                .expect("parse the client certificate");
            let key = PrivateKeyDer::from_pem_file(key).expect("read the client key");
            builder
                .with_client_auth_cert(chain, key)
                .expect("client certificate and key")
        }
    };
    MakeRustlsConnect::new(config)
}

/// Connects with TLS required (bounded) and spawns the connection task.
async fn connect_tls(
    config: &Config,
    tls: MakeRustlsConnect,
) -> Result<Client, tokio_postgres::Error> {
    let mut config = config.clone();
    config
        .ssl_mode(SslMode::Require)
        .connect_timeout(Duration::from_secs(10));
    let (client, connection) = timeout(Duration::from_secs(15), config.connect(tls))
        .await
        .expect("connect timed out")?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// Connects without TLS (bounded).
async fn connect_plain(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let mut config = config.clone();
    config
        .ssl_mode(SslMode::Disable)
        .connect_timeout(Duration::from_secs(10));
    let (client, connection) = timeout(Duration::from_secs(15), config.connect(NoTls))
        .await
        .expect("connect timed out")?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// Whether this session's connection to the server is TLS.
const SESSION_SSL: &str = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";

/// The full text of an error: its message and its source chain.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn start(options: ClusterOptions) -> Cluster {
    let t0 = Instant::now();
    let cluster = Cluster::start_with(options.clone()).expect("start the cluster");
    eprintln!("{options:?} started in {:?}", t0.elapsed());
    cluster
}

#[tokio::test]
async fn required_refuses_plain_and_accepts_verified_tls() {
    let cluster = start(ClusterOptions::new().tls(TlsMode::Required));
    let certs = cluster.certs().unwrap();

    let e = connect_plain(&cluster.tcp_config("postgres"))
        .await
        .expect_err("a plain TCP connection must be refused");
    let db = e.as_db_error().unwrap_or_else(|| panic!("{}", chain(&e)));
    assert_eq!(db.code(), &SqlState::INVALID_AUTHORIZATION_SPECIFICATION);
    assert!(
        db.message().contains("pg_hba.conf") && db.message().contains("no encryption"),
        "{}",
        db.message()
    );

    let client = connect_tls(
        &cluster.tcp_config("postgres"),
        connector(certs.ca_cert(), None),
    )
    .await
    .unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert_eq!(scalar(&client, SESSION_SSL).await, "t");

    let e = connect_tls(
        &cluster.tcp_config("postgres"),
        connector(certs.wrong_ca_cert(), None),
    )
    .await
    .expect_err("the wrong CA must fail");
    assert!(chain(&e).contains("UnknownIssuer"), "{}", chain(&e));

    // The kit's own helpers go through its private socket, in plain text.
    let db = TestDb::on(&cluster, "tls_required").await;
    assert_eq!(scalar(&db.connect().await, "SELECT 1").await, "1");
    let url = cluster.tcp_url(db.name());
    assert!(
        url.starts_with("postgres://postgres:") && url.contains("@localhost:"),
        "{url}"
    );
    assert!(!url.contains('?'), "{url}");
    let config: Config = url.parse().unwrap();
    let client = connect_tls(&config, connector(certs.ca_cert(), None))
        .await
        .unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert_eq!(
        scalar(&client, "SELECT current_database()").await,
        db.name()
    );
    assert_eq!(scalar(&client, SESSION_SSL).await, "t");

    // A role made by the TestDb logs in over TLS with its password.
    let role_url = db.create_role("app", "pw-app", false).await;
    let role = db.role_name("app");
    let config: Config = cluster
        .tcp_url_as(&role, Some("pw-app"), db.name())
        .parse()
        .unwrap();
    let client = connect_tls(&config, connector(certs.ca_cert(), None))
        .await
        .unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert_eq!(scalar(&client, "SELECT current_user").await, role);
    // ... and TestDb's own URL for it (the socket) works in plain text.
    let config: Config = role_url.parse().unwrap();
    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(connection);
    assert_eq!(scalar(&client, "SELECT current_user").await, role);
}

#[tokio::test]
async fn offered_accepts_both_and_checks_the_host_name() {
    // The certificate names only `localhost`: TLS to 127.0.0.1 must fail
    // on the host name.
    let cluster = start(
        ClusterOptions::new()
            .tls(TlsMode::Offered)
            .server_names(["localhost"]),
    );
    let certs = cluster.certs().unwrap();
    let plain = connect_plain(&cluster.tcp_config("postgres"))
        .await
        .unwrap();
    assert_eq!(scalar(&plain, SESSION_SSL).await, "f");
    let tls = connect_tls(
        &cluster.tcp_config("postgres"),
        connector(certs.ca_cert(), None),
    )
    .await
    .unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert_eq!(scalar(&tls, SESSION_SSL).await, "t");

    let mut by_ip_only = Config::new();
    by_ip_only
        .host("127.0.0.1")
        .port(cluster.port())
        .user(SUPERUSER)
        .password(TEST_PASSWORD)
        .dbname("postgres");
    let e = connect_tls(&by_ip_only, connector(certs.ca_cert(), None))
        .await
        .expect_err("a certificate without 127.0.0.1 must fail for 127.0.0.1");
    assert!(chain(&e).contains("not valid for name"), "{}", chain(&e));

    // Swapping the certificate files and reloading changes the certificate
    // new connections see: now only 127.0.0.1 is valid.
    certs
        .issue_server_cert(certs.dir(), "server", &["127.0.0.1"])
        .unwrap();
    scalar(&plain, "SELECT pg_reload_conf()").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while connect_tls(
        &cluster.tcp_config("postgres"),
        connector(certs.ca_cert(), None),
    )
    .await
    .is_ok()
    {
        assert!(
            Instant::now() < deadline,
            "the new certificate was not loaded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = connect_tls(&by_ip_only, connector(certs.ca_cert(), None))
        .await
        .unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert_eq!(scalar(&client, SESSION_SSL).await, "t");
}

#[tokio::test]
async fn client_certificate_user_needs_its_certificate() {
    let user = "cert_user";
    let cluster = start(ClusterOptions::new().tls(TlsMode::ClientCert {
        user: user.to_owned(),
    }));
    let certs = cluster.certs().unwrap();
    assert_eq!(certs.client_user(), user);
    let config: Config = cluster.tcp_url_as(user, None, "postgres").parse().unwrap();

    let with_cert = connector(
        certs.ca_cert(),
        Some((certs.client_cert(), certs.client_key())),
    );
    let client = connect_tls(&config, with_cert)
        .await
        .unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert_eq!(scalar(&client, "SELECT current_user").await, user);
    assert_eq!(scalar(&client, SESSION_SSL).await, "t");
    assert_eq!(
        scalar(
            &client,
            "SELECT client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
        )
        .await,
        format!("/CN={user}")
    );

    let e = connect_tls(&config, connector(certs.ca_cert(), None))
        .await
        .expect_err("without a certificate the cert user must be refused");
    let db = e.as_db_error().unwrap_or_else(|| panic!("{}", chain(&e)));
    assert_eq!(db.code(), &SqlState::INVALID_AUTHORIZATION_SPECIFICATION);
    assert!(db.message().contains("certificate"), "{}", db.message());

    // A certificate from another CA is refused in the handshake.
    let other = certs
        .issue_client_cert_from_wrong_ca(certs.dir(), "stranger", user)
        .unwrap();
    let e = connect_tls(
        &config,
        connector(certs.ca_cert(), Some((other.cert(), other.key()))),
    )
    .await
    .expect_err("a certificate from the wrong CA must be refused");
    eprintln!("wrong-CA client certificate: {}", chain(&e));

    // The key that does not match the certificate is refused by rustls
    // before anything is sent.
    let chain_der = CertificateDer::pem_file_iter(certs.client_cert())
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let wrong_key = PrivateKeyDer::from_pem_file(certs.mismatched_client_key()).unwrap();
    let mismatch = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_client_auth_cert(chain_der, wrong_key);
    assert!(
        mismatch.is_err(),
        "rustls accepted a key that does not match"
    );

    // Everybody else still logs in with a password, over TLS only.
    let client = connect_tls(
        &cluster.tcp_config("postgres"),
        connector(certs.ca_cert(), None),
    )
    .await
    .unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert_eq!(scalar(&client, "SELECT current_user").await, SUPERUSER);
    assert!(connect_plain(&cluster.tcp_config("postgres"))
        .await
        .is_err());
}

#[tokio::test]
async fn pgbouncer_speaks_tls_on_both_sides() {
    if !pgbouncer_available() {
        eprintln!("SKIPPED pgbouncer_speaks_tls_on_both_sides: pgbouncer is not installed");
        return;
    }
    let cluster = start(ClusterOptions::new().tls(TlsMode::Required));
    let db = TestDb::on(&cluster, "bouncer_tls").await;
    let t0 = Instant::now();
    let bouncer =
        PgBouncer::start_with(&cluster, PoolMode::Transaction, BouncerTls::Required).unwrap();
    eprintln!("TLS pgbouncer started in {:?}", t0.elapsed());
    assert_eq!(bouncer.server_tls_sslmode(), Some("verify-full"));
    let ca = bouncer.ca_cert().unwrap();

    let e = connect_plain(&bouncer.tcp_config(db.name()))
        .await
        .expect_err("pgbouncer must refuse a plain client");
    eprintln!("plain client to pgbouncer: {}", chain(&e));

    let config: Config = bouncer.tcp_url(db.name()).parse().unwrap();
    let client = connect_tls(&config, connector(ca, None))
        .await
        .unwrap_or_else(|e| panic!("{}", chain(&e)));
    // pg_stat_ssl on the server describes pgbouncer's server connection.
    assert_eq!(scalar(&client, SESSION_SSL).await, "t");
    assert_eq!(
        scalar(&client, "SELECT current_database()").await,
        db.name()
    );

    // pgbouncer's console (over its private socket) shows the client's TLS.
    let (admin, connection) = bouncer.config("pgbouncer").connect(NoTls).await.unwrap();
    tokio::spawn(connection);
    let mut tls_clients = 0;
    for msg in admin.simple_query("SHOW CLIENTS").await.unwrap() {
        if let SimpleQueryMessage::Row(row) = msg {
            let idx = row.columns().iter().position(|c| c.name() == "tls");
            if idx
                .and_then(|i| row.get(i))
                .is_some_and(|v| v.starts_with("TLS"))
            {
                tls_clients += 1;
            }
        }
    }
    assert!(tls_clients >= 1, "SHOW CLIENTS shows no TLS client");

    // The wrong CA does not verify pgbouncer's certificate.
    let certs = cluster.certs().unwrap();
    assert!(connect_tls(&config, connector(certs.wrong_ca_cert(), None))
        .await
        .is_err());
    drop(client);
    drop(bouncer);
}

#[test]
fn start_with_refuses_unusable_options() {
    let e = Cluster::start_with(ClusterOptions::new().server_names(["localhost"])).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("server_names"), "{e}");
    let e = Cluster::start_with(ClusterOptions::new().tls(TlsMode::ClientCert {
        user: "a\"b".into(),
    }))
    .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    let e = PgBouncer::start_with(Cluster::shared(), PoolMode::Session, BouncerTls::Required)
        .expect_err("client TLS in front of a plain cluster");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
}

/// `psql` next to the server binaries, if installed.
fn psql() -> Option<PathBuf> {
    let psql = pg_bin_dir().ok()?.join("psql");
    psql.is_file().then_some(psql)
}

/// Runs `psql` with a key-value connection string; its trimmed output, or
/// its stderr as the error.
fn run_psql(
    psql: &Path,
    conninfo: &str,
    password: Option<&str>,
    sql: &str,
) -> Result<String, String> {
    let mut cmd = Command::new(psql);
    cmd.args(["-X", "-A", "-t", "-d", conninfo, "-c", sql])
        .env_remove("PGSSLMODE")
        .env_remove("PGSSLROOTCERT")
        .env("PGCONNECT_TIMEOUT", "10");
    match password {
        Some(p) => cmd.env("PGPASSWORD", p),
        None => cmd.env_remove("PGPASSWORD"),
    };
    let out = cmd.output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn psql_verifies_the_kit_certificates() {
    let Some(psql) = psql() else {
        eprintln!("SKIPPED psql_verifies_the_kit_certificates: psql is not installed");
        return;
    };
    let user = "psql_cert_user";
    let cluster = start(ClusterOptions::new().tls(TlsMode::ClientCert {
        user: user.to_owned(),
    }));
    let certs = cluster.certs().unwrap();
    let port = cluster.port();
    let ca = certs.ca_cert().display().to_string();
    let base = format!("host=localhost port={port} dbname=postgres sslrootcert={ca}");

    let out = run_psql(
        &psql,
        &format!("{base} user={SUPERUSER} sslmode=verify-full"),
        Some(TEST_PASSWORD),
        SESSION_SSL,
    );
    assert_eq!(out.as_deref(), Ok("t"));

    let refused = run_psql(
        &psql,
        &format!("{base} user={SUPERUSER} sslmode=disable"),
        Some(TEST_PASSWORD),
        "SELECT 1",
    )
    .unwrap_err();
    assert!(refused.contains("no encryption"), "{refused}");

    let wrong_ca = run_psql(
        &psql,
        &format!(
            "host=localhost port={port} dbname=postgres user={SUPERUSER} sslmode=verify-full sslrootcert={}",
            certs.wrong_ca_cert().display()
        ),
        Some(TEST_PASSWORD),
        "SELECT 1",
    )
    .unwrap_err();
    assert!(wrong_ca.contains("certificate verify failed"), "{wrong_ca}");

    let out = run_psql(
        &psql,
        &format!(
            "{base} user={user} sslmode=verify-full sslcert={} sslkey={}",
            certs.client_cert().display(),
            certs.client_key().display()
        ),
        None,
        "SELECT current_user",
    );
    assert_eq!(out.as_deref(), Ok(user));

    let mismatch = run_psql(
        &psql,
        &format!(
            "{base} user={user} sslmode=verify-full sslcert={} sslkey={}",
            certs.client_cert().display(),
            certs.mismatched_client_key().display()
        ),
        None,
        "SELECT 1",
    )
    .unwrap_err();
    assert!(
        mismatch.contains("mismatch") || mismatch.contains("does not match"),
        "{mismatch}"
    );

    if !pgbouncer_available() {
        eprintln!("SKIPPED the pgbouncer part: pgbouncer is not installed");
        return;
    }
    let bouncer = PgBouncer::start_with(&cluster, PoolMode::Session, BouncerTls::Required).unwrap();
    let out = run_psql(
        &psql,
        &format!(
            "host=localhost port={} dbname=postgres user={SUPERUSER} sslmode=verify-full sslrootcert={}",
            bouncer.port(),
            bouncer.ca_cert().unwrap().display()
        ),
        Some(TEST_PASSWORD),
        SESSION_SSL,
    );
    assert_eq!(out.as_deref(), Ok("t"));
}
