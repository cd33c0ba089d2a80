//! Certificates for TLS tests: a CA, a server and a client certificate, an
//! unrelated "wrong" CA and a key that matches nothing, generated in memory
//! with rcgen and written as PEM files.

use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::util::{chown_to_server, ctx, err};

/// The names a server certificate carries unless told otherwise: the host
/// name tests connect to for `verify-full`, and the address the servers
/// listen on.
pub const DEFAULT_SERVER_NAMES: [&str; 2] = ["localhost", "127.0.0.1"];

/// How a [`Cluster`](crate::Cluster) speaks TLS
/// ([`ClusterOptions::tls`](crate::ClusterOptions::tls)). Every mode sets
/// `ssl = on` with a [`TestCerts`] server certificate; the `pg_hba.conf`
/// lines differ:
///
/// | mode | TCP lines of `pg_hba.conf` |
/// | --- | --- |
/// | `Offered` | `host all all 127.0.0.1/32 scram-sha-256` (and `::1/128`): TLS and plain both accepted |
/// | `Required` | `hostssl all all 127.0.0.1/32 scram-sha-256` (and `::1/128`), then `hostnossl all all 0.0.0.0/0 reject` (and `::/0`) |
/// | `ClientCert { user }` | `hostssl all "user" 127.0.0.1/32 cert` (and `::1/128`) first, then as `Required`; `ssl_ca_file` is the CA |
///
/// A plain connection to a `Required` or `ClientCert` cluster is refused
/// with `pg_hba.conf rejects connection for host "127.0.0.1", user "…",
/// database "…", no encryption` (SQLSTATE 28000).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TlsMode {
    /// TLS offered, plain connections accepted too.
    Offered,
    /// TLS required: plain TCP connections are rejected by `pg_hba.conf`.
    Required,
    /// As [`Required`](TlsMode::Required), and `user` must log in with a
    /// client certificate whose CN is `user`
    /// ([`TestCerts::client_cert`]), no password; other users use their
    /// password. The cluster creates the role (`LOGIN`, no password, not a
    /// superuser) when it first starts.
    ClientCert {
        /// The database user that authenticates with its certificate.
        user: String,
    },
}

/// A certificate and its private key, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
}

impl CertFiles {
    /// The certificate (PEM, mode 0644).
    pub fn cert(&self) -> &Path {
        &self.cert
    }

    /// Its private key (PEM, PKCS#8, mode 0600).
    pub fn key(&self) -> &Path {
        &self.key
    }
}

/// Certificates for one TLS test server, written as PEM files into one
/// directory (`<cluster dir>/tls` for a [`Cluster`](crate::Cluster)):
///
/// | file | what |
/// | --- | --- |
/// | `ca.crt` | the CA that signs everything below ([`ca_cert`](TestCerts::ca_cert)) |
/// | `server.crt`, `server.key` | the server's certificate, SANs [`DEFAULT_SERVER_NAMES`] unless told otherwise |
/// | `client.crt`, `client.key` | a client certificate whose CN is [`client_user`](TestCerts::client_user) (for `cert` authentication) |
/// | `mismatched-client.key` | a key that does not match `client.crt` |
/// | `wrong-ca.crt` | an unrelated CA that signed nothing the server uses |
///
/// All keys are ECDSA P-256 (accepted by OpenSSL in every supported
/// PostgreSQL and PgBouncer, and by rustls). Certificates are valid from
/// 2020 to 2100. Private keys are mode 0600 and certificates 0644; when the
/// test process is root, every file is owned by the unprivileged server
/// user (PostgreSQL refuses a key it does not own, and PgBouncer must read
/// its own), and root reads them all the same.
///
/// The CA's key stays in memory, so more certificates can be issued later
/// ([`issue_server_cert`](TestCerts::issue_server_cert) for a wrong host
/// name, [`issue_client_cert`](TestCerts::issue_client_cert) for another
/// user). Generating the whole set takes a few milliseconds.
pub struct TestCerts {
    dir: PathBuf,
    ca: Issuer<'static, KeyPair>,
    wrong_ca: Issuer<'static, KeyPair>,
    ca_cert: PathBuf,
    wrong_ca_cert: PathBuf,
    server: CertFiles,
    server_names: Vec<String>,
    client: CertFiles,
    client_user: String,
    mismatched_client_key: PathBuf,
}

impl TestCerts {
    /// Generates a fresh CA, a server certificate for `server_names` (DNS
    /// names or IP addresses), a client certificate with CN `client_user`,
    /// a key matching no certificate and an unrelated CA, and writes them
    /// into `dir` (created mode 0700 if missing).
    ///
    /// # Errors
    ///
    /// `InvalidInput` if `server_names` is empty or holds a name that is not
    /// a valid DNS name or IP address; otherwise if a file cannot be written.
    pub fn generate(dir: &Path, server_names: &[&str], client_user: &str) -> io::Result<TestCerts> {
        if server_names.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a server certificate needs at least one name",
            ));
        }
        if !dir.exists() {
            fs::create_dir_all(dir).map_err(|e| ctx(e, format!("create {}", dir.display())))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
            chown_to_server(dir)?;
        }
        let (ca, ca_pem) = new_ca("pgelect-testkit CA")?;
        let (wrong_ca, wrong_ca_pem) = new_ca("pgelect-testkit wrong CA")?;
        let ca_cert = dir.join("ca.crt");
        write_file(&ca_cert, &ca_pem, 0o644)?;
        let wrong_ca_cert = dir.join("wrong-ca.crt");
        write_file(&wrong_ca_cert, &wrong_ca_pem, 0o644)?;
        let server = issue(&ca, dir, "server", &Leaf::Server(server_names))?;
        let client = issue(&ca, dir, "client", &Leaf::Client(client_user))?;
        let mismatched_client_key = dir.join("mismatched-client.key");
        write_file(&mismatched_client_key, &new_key()?.serialize_pem(), 0o600)?;
        Ok(TestCerts {
            dir: dir.to_owned(),
            ca,
            wrong_ca,
            ca_cert,
            wrong_ca_cert,
            server,
            server_names: server_names.iter().map(|&n| n.to_owned()).collect(),
            client,
            client_user: client_user.to_owned(),
            mismatched_client_key,
        })
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA certificate: what `sslrootcert` names for `verify-ca` and
    /// `verify-full`.
    pub fn ca_cert(&self) -> &Path {
        &self.ca_cert
    }

    /// A CA certificate unrelated to the server's: `verify-ca` and
    /// `verify-full` with it as `sslrootcert` must fail.
    pub fn wrong_ca_cert(&self) -> &Path {
        &self.wrong_ca_cert
    }

    /// The server's certificate.
    pub fn server_cert(&self) -> &Path {
        self.server.cert()
    }

    /// The server's private key.
    pub fn server_key(&self) -> &Path {
        self.server.key()
    }

    /// The names in the server certificate (its SANs).
    pub fn server_names(&self) -> &[String] {
        &self.server_names
    }

    /// The client certificate, CN [`client_user`](TestCerts::client_user),
    /// signed by the CA.
    pub fn client_cert(&self) -> &Path {
        self.client.cert()
    }

    /// The client certificate's private key.
    pub fn client_key(&self) -> &Path {
        self.client.key()
    }

    /// The CN of [`client_cert`](TestCerts::client_cert): the database user
    /// it authenticates as.
    pub fn client_user(&self) -> &str {
        &self.client_user
    }

    /// A valid P-256 private key that does not match
    /// [`client_cert`](TestCerts::client_cert) (nor any other certificate).
    pub fn mismatched_client_key(&self) -> &Path {
        &self.mismatched_client_key
    }

    /// Issues another server certificate from the CA, for `names`, as
    /// `<dir>/<stem>.crt` and `<dir>/<stem>.key` (replacing them if they
    /// exist).
    ///
    /// E.g. for a wrong-host-name test on a running cluster: issue into
    /// [`dir`](TestCerts::dir) with stem `server`, run `SELECT
    /// pg_reload_conf()`, and new connections get the new certificate once
    /// the server has reloaded (poll: the reload is asynchronous).
    /// [`server_names`](TestCerts::server_names) keeps listing the first
    /// certificate's names.
    ///
    /// # Errors
    ///
    /// As [`generate`](TestCerts::generate).
    pub fn issue_server_cert(
        &self,
        dir: &Path,
        stem: &str,
        names: &[&str],
    ) -> io::Result<CertFiles> {
        if names.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a server certificate needs at least one name",
            ));
        }
        issue(&self.ca, dir, stem, &Leaf::Server(names))
    }

    /// Issues a client certificate with CN `user` from the CA, as
    /// `<dir>/<stem>.crt` and `<dir>/<stem>.key`.
    ///
    /// # Errors
    ///
    /// If a file cannot be written.
    pub fn issue_client_cert(&self, dir: &Path, stem: &str, user: &str) -> io::Result<CertFiles> {
        issue(&self.ca, dir, stem, &Leaf::Client(user))
    }

    /// Issues a client certificate with CN `user` from the *wrong* CA (the
    /// server must refuse it), as `<dir>/<stem>.crt` and `<dir>/<stem>.key`.
    ///
    /// # Errors
    ///
    /// If a file cannot be written.
    pub fn issue_client_cert_from_wrong_ca(
        &self,
        dir: &Path,
        stem: &str,
        user: &str,
    ) -> io::Result<CertFiles> {
        issue(&self.wrong_ca, dir, stem, &Leaf::Client(user))
    }
}

impl fmt::Debug for TestCerts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestCerts")
            .field("dir", &self.dir)
            .field("server_names", &self.server_names)
            .field("client_user", &self.client_user)
            .finish_non_exhaustive()
    }
}

/// What a leaf certificate is for.
enum Leaf<'a> {
    /// A server certificate for these names.
    Server(&'a [&'a str]),
    /// A client certificate for this user (the CN).
    Client(&'a str),
}

fn rcgen_err(what: &str, e: rcgen::Error) -> io::Error {
    err(format!("{what}: {e}"))
}

fn new_key() -> io::Result<KeyPair> {
    // P-256: the one key type every OpenSSL PostgreSQL links against and
    // rustls (ring) both accept.
    KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
        .map_err(|e| rcgen_err("generate a P-256 key", e))
}

fn base_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2100, 1, 1);
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
}

/// A self-signed CA named `name`; returns it and its certificate's PEM.
fn new_ca(name: &str) -> io::Result<(Issuer<'static, KeyPair>, String)> {
    let key = new_key()?;
    let mut params = base_params();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params
        .self_signed(&key)
        .map_err(|e| rcgen_err("self-sign the test CA", e))?;
    Ok((Issuer::new(params, key), cert.pem()))
}

/// Issues a leaf certificate from `ca` into `<dir>/<stem>.crt` / `.key`.
fn issue(
    ca: &Issuer<'static, KeyPair>,
    dir: &Path,
    stem: &str,
    leaf: &Leaf<'_>,
) -> io::Result<CertFiles> {
    let key = new_key()?;
    let mut params = base_params();
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    match leaf {
        Leaf::Server(names) => {
            let names: Vec<String> = names.iter().map(|&n| n.to_owned()).collect();
            params.subject_alt_names = CertificateParams::new(names.clone())
                .map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("server certificate names {names:?}: {e}"),
                    )
                })?
                .subject_alt_names;
            params
                .distinguished_name
                .push(DnType::CommonName, names[0].as_str());
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        }
        Leaf::Client(user) => {
            params.distinguished_name.push(DnType::CommonName, *user);
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        }
    }
    let cert = params
        .signed_by(&key, ca)
        .map_err(|e| rcgen_err(&format!("sign the {stem} certificate"), e))?;
    let files = CertFiles {
        cert: dir.join(format!("{stem}.crt")),
        key: dir.join(format!("{stem}.key")),
    };
    write_file(&files.cert, &cert.pem(), 0o644)?;
    write_file(&files.key, &key.serialize_pem(), 0o600)?;
    Ok(files)
}

/// Writes `contents` to a new `path` with `mode`, owned by the server user.
fn write_file(path: &Path, contents: &str, mode: u32) -> io::Result<()> {
    let _ = fs::remove_file(path);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| ctx(e, format!("create {}", path.display())))?;
    f.write_all(contents.as_bytes())?;
    // The umask may have taken bits away from a certificate's 0644.
    fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
    chown_to_server(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn writes_every_file_with_its_mode() {
        let dir = crate::util::make_temp_dir("certs-test").unwrap();
        let t0 = std::time::Instant::now();
        let certs = TestCerts::generate(&dir.join("tls"), &DEFAULT_SERVER_NAMES, "alice").unwrap();
        eprintln!("generated in {:?}", t0.elapsed());
        for (path, mode) in [
            (certs.ca_cert(), 0o644),
            (certs.wrong_ca_cert(), 0o644),
            (certs.server_cert(), 0o644),
            (certs.server_key(), 0o600),
            (certs.client_cert(), 0o644),
            (certs.client_key(), 0o600),
            (certs.mismatched_client_key(), 0o600),
        ] {
            let meta = fs::metadata(path).unwrap();
            assert_eq!(meta.mode() & 0o777, mode, "{}", path.display());
            assert_eq!(meta.uid(), crate::util::server_uid(), "{}", path.display());
            let text = fs::read_to_string(path).unwrap();
            assert!(text.starts_with("-----BEGIN "), "{}", path.display());
        }
        assert_ne!(
            fs::read(certs.client_key()).unwrap(),
            fs::read(certs.mismatched_client_key()).unwrap()
        );
        let extra = certs
            .issue_server_cert(certs.dir(), "other", &["elsewhere.test"])
            .unwrap();
        assert!(extra.cert().ends_with("other.crt") && extra.key().is_file());
        let bad = certs.issue_server_cert(certs.dir(), "bad", &["caf\u{e9}.test"]);
        assert_eq!(bad.unwrap_err().kind(), io::ErrorKind::InvalidInput);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn is_send_sync() {
        fn is<T: Send + Sync>() {}
        is::<TestCerts>();
    }
}
