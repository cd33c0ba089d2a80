//! TLS for every connection pgelect opens, with libpq's settings and their
//! meaning: `sslmode`, `sslrootcert`, `sslcert`, `sslkey`, `sslcrl`,
//! `sslsni`, `ssl_min_protocol_version` and `ssl_max_protocol_version`,
//! from the connection string or the `PGSSL*` environment variables.
//!
//! The handshake is rustls (with the `ring` provider: no system OpenSSL to
//! build or run) through `tokio-postgres-rustls`, which also gives SCRAM its
//! channel binding. libpq's levels of checking map onto three verifiers:
//! none (`prefer`, `require` and `allow` without a root certificate), the
//! chain only (`verify-ca`, and the weaker modes when a root certificate
//! file exists, as in libpq) and chain plus host name (`verify-full`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{
    CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime,
};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, Result};

/// How much TLS a connection insists on, with libpq's names and meaning
/// (see the [PostgreSQL manual](https://www.postgresql.org/docs/current/libpq-ssl.html#LIBPQ-SSL-PROTECTION)).
///
/// | mode | encrypted | server checked | protects against |
/// | --- | --- | --- | --- |
/// | `disable` | never | no | nothing |
/// | `allow` | only if the server insists | no | nothing (a passive eavesdropper, if the server insists) |
/// | `prefer` (default) | if the server offers it | no | a passive eavesdropper; an active attacker can *downgrade* it to plain text |
/// | `require` | always | no (the chain, if a root certificate is given) | a passive eavesdropper; not an impostor |
/// | `verify-ca` | always | the chain leads to `sslrootcert` | an impostor without a certificate from that CA |
/// | `verify-full` | always | the chain and the host name | an impostor, including one with another certificate from the same CA |
///
/// ```
/// use pgelect::conn::SslMode;
/// assert_eq!("verify-full".parse::<SslMode>().unwrap(), SslMode::VerifyFull);
/// assert_eq!(SslMode::default(), SslMode::Prefer);
/// assert!("verify_full".parse::<SslMode>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SslMode {
    /// Plain text only.
    Disable,
    /// Plain text first; TLS only if the server refuses plain text.
    Allow,
    /// TLS if the server offers it, else plain text. The default, as in
    /// libpq; an active attacker can downgrade it.
    #[default]
    Prefer,
    /// TLS always; the server's certificate is not checked unless a root
    /// certificate is given (then as `VerifyCa`).
    Require,
    /// TLS always; the server's certificate must chain to `sslrootcert`.
    VerifyCa,
    /// TLS always; the certificate must chain to `sslrootcert` and name the
    /// host connected to.
    VerifyFull,
}

impl SslMode {
    /// The libpq spelling: `disable`, `allow`, `prefer`, `require`,
    /// `verify-ca`, `verify-full`.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// True for the modes that never fall back to plain text.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SslMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<SslMode> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => {
                return Err(Error::config(format!(
                    "sslmode {:?} is not one of disable, allow, prefer, require, verify-ca, verify-full",
                    shown(s)
                )))
            }
        })
    }
}

/// A value for a message: at most 64 characters, control characters escaped.
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(64).collect();
    if s.chars().count() > 64 {
        out.push('…');
    }
    out
}

/// The TLS settings libpq reads from a connection string, in the names it
/// uses there, with the `PGSSL*` variable each falls back to.
pub(crate) const TLS_KEYS: [(&str, &str); 10] = [
    ("sslmode", "PGSSLMODE"),
    ("sslrootcert", "PGSSLROOTCERT"),
    ("sslcert", "PGSSLCERT"),
    ("sslkey", "PGSSLKEY"),
    ("sslcrl", "PGSSLCRL"),
    ("sslcrldir", "PGSSLCRLDIR"),
    ("sslsni", "PGSSLSNI"),
    ("ssl_min_protocol_version", "PGSSLMINPROTOCOLVERSION"),
    ("ssl_max_protocol_version", "PGSSLMAXPROTOCOLVERSION"),
    ("sslpassword", ""),
];

/// Where a setting came from, for messages: `sslrootcert` or `PGSSLROOTCERT`.
#[derive(Clone, Debug)]
struct Setting {
    value: String,
    from: String,
}

/// How the server's certificate is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verify {
    None,
    Chain,
    Full,
}

#[derive(Clone, Debug)]
enum Roots {
    File(PathBuf, String),
    System,
}

/// The TLS part of [`ConnectOptions`](crate::ConnectOptions): validated
/// when the options are made (so a missing file is a configuration error,
/// not a failed connection), and turned into a connector at each connect
/// (so rotated certificates are picked up).
#[derive(Clone)]
pub(crate) struct TlsSettings {
    mode: SslMode,
    mode_from: &'static str,
    roots: Option<Roots>,
    client: Option<(PathBuf, PathBuf, String)>,
    crl: Option<(PathBuf, String)>,
    sni: bool,
    min_tls13: bool,
    max_tls12: bool,
    connector: Arc<Mutex<Option<(Stamp, MakeRustlsConnect)>>>,
}

impl fmt::Debug for TlsSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsSettings")
            .field("sslmode", &self.mode)
            .field("verify", &self.verify())
            .field("client_cert", &self.client.as_ref().map(|c| &c.0))
            .finish()
    }
}

/// Modification times of the files a connector was built from.
type Stamp = Vec<Option<SystemTime>>;

impl TlsSettings {
    /// Settings from the connection string's TLS keys (`found`, as taken
    /// out of it), falling back to the `PGSSL*` variables (when `env`) and
    /// libpq's default files under `~/.postgresql/`.
    pub(crate) fn resolve(
        found: &[(String, String)],
        env: bool,
        fallback_mode: SslMode,
    ) -> Result<TlsSettings> {
        let get = |key: &str| -> Option<Setting> {
            if let Some((_, v)) = found.iter().rev().find(|(k, _)| k == key) {
                return Some(Setting {
                    value: v.clone(),
                    from: key.to_owned(),
                });
            }
            let var = TLS_KEYS.iter().find(|(k, _)| *k == key)?.1;
            if !env || var.is_empty() {
                return None;
            }
            let value = std::env::var(var).ok().filter(|v| !v.is_empty())?;
            Some(Setting {
                value,
                from: var.to_owned(),
            })
        };
        if let Some(s) = get("sslpassword") {
            return Err(Error::config(format!(
                "{} is set, but encrypted client keys are not supported: decrypt the key (openssl pkey -in key.pem -out plain.pem) and keep it mode 0600",
                s.from
            )));
        }
        if let Some(s) = get("sslcrldir") {
            return Err(Error::config(format!(
                "{} is not supported: give the revocation list as one PEM file with sslcrl",
                s.from
            )));
        }
        let home = home_postgresql_dir();
        let root_setting = get("sslrootcert");
        let (mode, mode_from) = match get("sslmode") {
            Some(s) => (
                s.value.parse::<SslMode>().map_err(|_| {
                    Error::config(format!(
                        "{}={:?} is not one of disable, allow, prefer, require, verify-ca, verify-full",
                        s.from,
                        shown(&s.value)
                    ))
                })?,
                if s.from == "sslmode" {
                    "sslmode"
                } else {
                    "PGSSLMODE"
                },
            ),
            // libpq 16: with the platform's roots, the default is to check
            // the host name too.
            None if root_setting.as_ref().is_some_and(|s| s.value == "system") => {
                (SslMode::VerifyFull, "default")
            }
            None => (fallback_mode, "default"),
        };
        if mode == SslMode::Disable {
            // libpq reads no TLS file when it will not use TLS.
            let mut plain = TlsSettings::plain(mode);
            plain.mode_from = mode_from;
            return Ok(plain);
        }
        let roots = match root_setting {
            Some(s) if s.value == "system" => {
                if mode != SslMode::VerifyFull {
                    return Err(Error::config(format!(
                        "sslmode={mode} may not be used with {}=system: the platform's roots vouch for any host on the internet, so use sslmode=verify-full (as libpq does)",
                        s.from
                    )));
                }
                Some(Roots::System)
            }
            Some(s) => {
                let path = PathBuf::from(&s.value);
                check_readable(&path, &s.from)?;
                Some(Roots::File(path, s.from))
            }
            None => home
                .as_ref()
                .map(|h| h.join("root.crt"))
                .filter(|p| p.is_file())
                .map(|p| Roots::File(p, "sslrootcert (default ~/.postgresql/root.crt)".into())),
        };
        if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) && roots.is_none() {
            return Err(Error::config(format!(
                "sslmode={mode} checks the server's certificate, but no root certificate is given: set sslrootcert=/path/to/ca.crt (the CA that signed the server's certificate) or sslrootcert=system for the platform's roots; ~/.postgresql/root.crt does not exist"
            )));
        }
        let cert = get("sslcert");
        let key = get("sslkey");
        let client = match (cert, key) {
            (Some(c), k) => {
                let cert_path = PathBuf::from(&c.value);
                check_readable(&cert_path, &c.from)?;
                let (key_path, key_from) = match k {
                    Some(k) => (PathBuf::from(&k.value), k.from),
                    None => match home.as_ref().map(|h| h.join("postgresql.key")) {
                        Some(p) if p.is_file() => {
                            (p, "sslkey (default ~/.postgresql/postgresql.key)".to_owned())
                        }
                        _ => {
                            return Err(Error::config(format!(
                                "{} is set but no key is: set sslkey to the client certificate's private key",
                                c.from
                            )))
                        }
                    },
                };
                check_key_file(&key_path, &key_from)?;
                Some((cert_path, key_path, format!("{}/{}", c.from, key_from)))
            }
            (None, Some(k)) => {
                return Err(Error::config(format!(
                    "{} is set but sslcert is not: set both, or neither",
                    k.from
                )))
            }
            (None, None) => match home.as_ref() {
                Some(h)
                    if h.join("postgresql.crt").is_file() && h.join("postgresql.key").is_file() =>
                {
                    let key = h.join("postgresql.key");
                    check_key_file(&key, "sslkey (default ~/.postgresql/postgresql.key)")?;
                    Some((
                        h.join("postgresql.crt"),
                        key,
                        "the default client certificate ~/.postgresql/postgresql.crt".to_owned(),
                    ))
                }
                _ => None,
            },
        };
        let crl = match get("sslcrl") {
            Some(s) => {
                let path = PathBuf::from(&s.value);
                check_readable(&path, &s.from)?;
                Some((path, s.from))
            }
            None => None,
        };
        let sni = match get("sslsni") {
            None => true,
            Some(s) if s.value == "1" => true,
            Some(s) if s.value == "0" => false,
            Some(s) => {
                return Err(Error::config(format!(
                    "{}={:?} must be 0 or 1",
                    s.from,
                    shown(&s.value)
                )))
            }
        };
        let version = |key: &str| -> Result<Option<(u8, String)>> {
            let Some(s) = get(key) else { return Ok(None) };
            let v = match s.value.as_str() {
                "TLSv1" => 10,
                "TLSv1.1" => 11,
                "TLSv1.2" => 12,
                "TLSv1.3" => 13,
                "" => return Ok(None),
                other => {
                    return Err(Error::config(format!(
                        "{}={:?} is not one of TLSv1, TLSv1.1, TLSv1.2, TLSv1.3",
                        s.from,
                        shown(other)
                    )))
                }
            };
            Ok(Some((v, s.from)))
        };
        let min = version("ssl_min_protocol_version")?;
        let max = version("ssl_max_protocol_version")?;
        if let Some((v, from)) = &max {
            if *v < 12 {
                return Err(Error::config(format!(
                    "{from} allows nothing pgelect can speak: TLS 1.0 and 1.1 are not supported, use TLSv1.2 or TLSv1.3"
                )));
            }
            if let Some((m, mfrom)) = &min {
                if m > v {
                    return Err(Error::config(format!(
                        "{mfrom} is above {from}: no TLS version is left"
                    )));
                }
            }
        }
        let min_tls13 = min.is_some_and(|(v, _)| v >= 13);
        let max_tls12 = max.is_some_and(|(v, _)| v == 12);
        if min_tls13 && max_tls12 {
            return Err(Error::config("ssl_min_protocol_version is above ssl_max_protocol_version: no TLS version is left"));
        }
        let settings = TlsSettings {
            mode,
            mode_from,
            roots,
            client,
            crl,
            sni,
            min_tls13,
            max_tls12,
            connector: Arc::new(Mutex::new(None)),
        };
        if mode != SslMode::Disable {
            // Build once now, so that bad files are a configuration error
            // when the options are made, not a failed connection later.
            let built = settings.build()?;
            *settings.connector.lock().unwrap_or_else(|p| p.into_inner()) =
                Some((settings.stamp(), built));
        }
        Ok(settings)
    }

    /// Settings that use no file: `mode` with nothing to check against.
    pub(crate) fn plain(mode: SslMode) -> TlsSettings {
        let settings = TlsSettings {
            mode,
            mode_from: "default",
            roots: None,
            client: None,
            crl: None,
            sni: true,
            min_tls13: false,
            max_tls12: false,
            connector: Arc::new(Mutex::new(None)),
        };
        let built = settings
            .build()
            .expect("BUG: TLS settings without files always build");
        *settings.connector.lock().unwrap_or_else(|p| p.into_inner()) = Some((Vec::new(), built));
        settings
    }

    /// The mode.
    pub(crate) fn mode(&self) -> SslMode {
        self.mode
    }

    /// How the server's certificate is checked under this mode.
    pub(crate) fn verify(&self) -> Verify {
        match self.mode {
            SslMode::VerifyFull => Verify::Full,
            SslMode::VerifyCa => Verify::Chain,
            // libpq: a root certificate file, when there is one, is used to
            // check the chain in every mode that encrypts.
            _ if self.roots.is_some() => Verify::Chain,
            _ => Verify::None,
        }
    }

    /// Where the mode came from (`sslmode`, `PGSSLMODE`, `default`).
    pub(crate) fn mode_from(&self) -> &'static str {
        self.mode_from
    }

    /// The root certificates named in messages.
    pub(crate) fn roots_shown(&self) -> String {
        match &self.roots {
            Some(Roots::File(p, _)) => format!("sslrootcert={}", p.display()),
            Some(Roots::System) => "sslrootcert=system".into(),
            None => "no sslrootcert".into(),
        }
    }

    /// The connector for a connection now: rebuilt when a file it was made
    /// from changed since (a rotated certificate), else the cached one. A
    /// rebuild that fails (a file half-written by a rotation) keeps the
    /// previous connector, with a warning.
    pub(crate) fn connector(&self) -> Result<MakeRustlsConnect> {
        let stamp = self.stamp();
        let mut cached = self.connector.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((s, c)) = cached.as_ref() {
            if *s == stamp {
                return Ok(c.clone());
            }
        }
        match self.build() {
            Ok(c) => {
                *cached = Some((stamp, c.clone()));
                Ok(c)
            }
            Err(e) => match cached.as_ref() {
                Some((_, c)) => {
                    tracing::warn!(error = %e, "TLS files changed and cannot be read; keeping the previous ones");
                    Ok(c.clone())
                }
                None => Err(e),
            },
        }
    }

    fn files(&self) -> Vec<&Path> {
        let mut files = Vec::new();
        if let Some(Roots::File(p, _)) = &self.roots {
            files.push(p.as_path());
        }
        if let Some((c, k, _)) = &self.client {
            files.push(c.as_path());
            files.push(k.as_path());
        }
        if let Some((p, _)) = &self.crl {
            files.push(p.as_path());
        }
        files
    }

    fn stamp(&self) -> Stamp {
        self.files()
            .iter()
            .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
            .collect()
    }

    fn build(&self) -> Result<MakeRustlsConnect> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let versions: &[&'static rustls::SupportedProtocolVersion] = if self.min_tls13 {
            &[&rustls::version::TLS13]
        } else if self.max_tls12 {
            &[&rustls::version::TLS12]
        } else {
            &[&rustls::version::TLS13, &rustls::version::TLS12]
        };
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(|e| Error::config(format!("TLS protocol versions: {e}")))?;
        let verifier: Arc<dyn ServerCertVerifier> = match self.verify() {
            Verify::None => Arc::new(Lenient {
                provider: provider.clone(),
                chain: None,
            }),
            level => {
                let roots = self.root_store()?;
                let mut b =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone());
                if let Some((path, from)) = &self.crl {
                    let crls = read_pem_all::<CertificateRevocationListDer<'static>>(path, from)?;
                    b = b.with_crls(crls);
                }
                let inner = b.build().map_err(|e| {
                    Error::config(format!("the TLS root certificates cannot be used: {e}"))
                })?;
                if level == Verify::Full {
                    inner
                } else {
                    Arc::new(Lenient {
                        provider,
                        chain: Some(inner),
                    })
                }
            }
        };
        let builder = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match &self.client {
            None => builder.with_no_client_auth(),
            Some((cert, key, from)) => {
                let chain = read_pem_all::<CertificateDer<'static>>(cert, from)?;
                let key = read_key(key, from)?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    Error::config(format!(
                        "{from}: the client certificate and key cannot be used together ({}): check that sslkey is the key of sslcert",
                        tls_text(&e)
                    ))
                })?
            }
        };
        config.enable_sni = self.sni;
        Ok(MakeRustlsConnect::new(config))
    }

    fn root_store(&self) -> Result<RootCertStore> {
        let mut store = RootCertStore::empty();
        match &self.roots {
            Some(Roots::File(path, from)) => {
                let certs = read_pem_all::<CertificateDer<'static>>(path, from)?;
                let (added, _ignored) = store.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(Error::config(format!(
                        "{from}: {} holds no usable CA certificate",
                        path.display()
                    )));
                }
            }
            Some(Roots::System) => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = store.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(Error::config(format!(
                        "sslrootcert=system: no certificate found in the platform's trust store{}",
                        found
                            .errors
                            .first()
                            .map(|e| format!(" ({e})"))
                            .unwrap_or_default()
                    )));
                }
            }
            None => {}
        }
        Ok(store)
    }
}

/// `~/.postgresql`, where libpq looks for default certificate files.
fn home_postgresql_dir() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".postgresql"))
}

fn check_readable(path: &Path, from: &str) -> Result<()> {
    if path.as_os_str().is_empty() {
        return Err(Error::config(format!("{from} is empty: give a file path")));
    }
    match std::fs::File::open(path) {
        Ok(f) => match f.metadata() {
            Ok(m) if m.is_file() => Ok(()),
            Ok(_) => Err(Error::config(format!(
                "{from}: {} is not a file",
                path.display()
            ))),
            Err(e) => Err(Error::config(format!(
                "{from}: cannot read {}: {e}",
                path.display()
            ))),
        },
        Err(e) => Err(Error::config(format!(
            "{from}: cannot read {}: {}",
            path.display(),
            io_text(&e)
        ))),
    }
}

/// libpq's rule for a private key file: no access for others, and none for
/// the group unless the file belongs to root (then at most `0640`).
fn check_key_file(path: &Path, from: &str) -> Result<()> {
    check_readable(path, from)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)
            .map_err(|e| Error::config(format!("{from}: cannot read {}: {e}", path.display())))?;
        let mode = m.mode() & 0o777;
        let too_open = if m.uid() == 0 {
            mode & 0o037 != 0
        } else {
            mode & 0o077 != 0
        };
        if too_open {
            return Err(Error::config(format!(
                "{from}: private key file {} has group or world access (mode {mode:04o}); it must be 0600 or less if owned by the current user, or 0640 or less if owned by root",
                path.display()
            )));
        }
    }
    Ok(())
}

fn io_text(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}

fn read_pem_all<T>(path: &Path, from: &str) -> Result<Vec<T>>
where
    T: PemObject,
{
    let items: std::result::Result<Vec<T>, _> = T::pem_file_iter(path)
        .map_err(|e| Error::config(format!("{from}: cannot read {}: {e}", path.display())))?
        .collect();
    let items = items
        .map_err(|e| Error::config(format!("{from}: {} is not valid PEM: {e}", path.display())))?;
    if items.is_empty() {
        return Err(Error::config(format!(
            "{from}: {} holds no PEM item of the expected kind",
            path.display()
        )));
    }
    Ok(items)
}

fn read_key(path: &Path, from: &str) -> Result<PrivateKeyDer<'static>> {
    let text = std::fs::read(path)
        .map_err(|e| Error::config(format!("{from}: cannot read {}: {e}", path.display())))?;
    if text
        .windows(b"ENCRYPTED PRIVATE KEY".len())
        .any(|w| w == b"ENCRYPTED PRIVATE KEY")
        || text
            .windows(b"Proc-Type: 4,ENCRYPTED".len())
            .any(|w| w == b"Proc-Type: 4,ENCRYPTED")
    {
        return Err(Error::config(format!(
            "{from}: {} is an encrypted key, which is not supported: decrypt it (openssl pkey -in key.pem -out plain.pem) and keep it mode 0600",
            path.display()
        )));
    }
    PrivateKeyDer::from_pem_slice(&text).map_err(|e| {
        Error::config(format!(
            "{from}: {} holds no usable private key (PKCS#8, PKCS#1 or SEC1 PEM): {e}",
            path.display()
        ))
    })
}

/// A rustls error in words a user can act on.
pub(crate) fn tls_text(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => {
                "the server's certificate is not signed by a CA in the root certificates (wrong sslrootcert, or the server uses another CA)".into()
            }
            CertificateError::NotValidForNameContext { expected, presented } => {
                let names: Vec<String> = presented.iter().map(|p| name_shown(p)).collect();
                format!(
                    "the server's certificate does not name the host connected to: it names {}, not {}; sslmode=verify-full checks the host name, so connect by a name the certificate carries",
                    names.join(", "),
                    name_shown(&format!("{expected:?}"))
                )
            }
            CertificateError::NotValidForName => {
                "the server's certificate does not name the host connected to; sslmode=verify-full checks the host name, so connect by a name the certificate carries".into()
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "the server's certificate has expired".into()
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "the server's certificate is not valid yet (check the clocks)".into()
            }
            CertificateError::Revoked => "the server's certificate is revoked (sslcrl)".into(),
            other => format!("the server's certificate is refused: {other:?}"),
        },
        rustls::Error::InconsistentKeys(_) => "the private key does not match the certificate".into(),
        rustls::Error::AlertReceived(alert) => {
            format!("the server refused the handshake ({alert:?}): with a client certificate, check that it is signed by a CA the server trusts (ssl_ca_file)")
        }
        other => other.to_string(),
    }
}

/// `DnsName("db")` or `IpAddress(10.0.0.1)` (rustls's debug forms) as `db`
/// or `10.0.0.1`.
fn name_shown(debug: &str) -> String {
    let inner = debug
        .split_once('(')
        .and_then(|(_, rest)| rest.strip_suffix(')'))
        .unwrap_or(debug);
    inner.trim_matches('"').to_owned()
}

/// Finds a rustls error in an error's chain (handshake errors travel as
/// `io::Error`s holding one).
pub(crate) fn rustls_error_in<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    let mut cur: Option<&'a (dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(r) = c.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                if let Some(r) = inner.downcast_ref::<rustls::Error>() {
                    return Some(r);
                }
            }
        }
        cur = c.source();
    }
    None
}

/// The two checks weaker than `verify-full` (libpq's meanings; see
/// [`SslMode`]). Both check the handshake's signatures.
/// * `require` without a root certificate (`chain` `None`): encrypt,
///   trust any certificate;
/// * `verify-ca`: the full check, except that a certificate naming another
///   host is accepted (the chain is checked before the name, so a name
///   error means the chain was good).
#[derive(Debug)]
struct Lenient {
    provider: Arc<CryptoProvider>,
    chain: Option<Arc<WebPkiServerVerifier>>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_with_libpq_names_only() {
        for m in [
            SslMode::Disable,
            SslMode::Allow,
            SslMode::Prefer,
            SslMode::Require,
            SslMode::VerifyCa,
            SslMode::VerifyFull,
        ] {
            assert_eq!(m.as_str().parse::<SslMode>().unwrap(), m);
        }
        let e = "verify_full".parse::<SslMode>().unwrap_err().to_string();
        assert!(e.contains("verify-full"), "{e}");
    }

    #[test]
    fn bad_settings_name_the_setting() {
        let kv = |k: &str, v: &str| vec![(k.to_owned(), v.to_owned())];
        let e = TlsSettings::resolve(&kv("sslmode", "sometimes"), false, SslMode::Prefer)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sslmode=\"sometimes\""), "{e}");
        let e = TlsSettings::resolve(
            &kv("sslrootcert", "/nonexistent/ca.pem"),
            false,
            SslMode::Prefer,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("sslrootcert") && e.contains("no such file"),
            "{e}"
        );
        let e = TlsSettings::resolve(&kv("sslsni", "yes"), false, SslMode::Prefer)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sslsni"), "{e}");
        let e = TlsSettings::resolve(&kv("sslpassword", "x"), false, SslMode::Prefer)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sslpassword") && !e.contains("=x"), "{e}");
        let e = TlsSettings::resolve(&kv("sslkey", "/tmp/k"), false, SslMode::Prefer)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sslcert"), "{e}");
    }

    #[test]
    fn system_roots_imply_verify_full_and_refuse_weaker_modes() {
        let found = vec![("sslrootcert".to_owned(), "system".to_owned())];
        let s = TlsSettings::resolve(&found, false, SslMode::Prefer);
        // The platform may have no roots at all (a minimal container): then
        // the error says so; otherwise the mode is verify-full.
        match s {
            Ok(s) => assert_eq!(s.mode(), SslMode::VerifyFull),
            Err(e) => assert!(e.to_string().contains("trust store"), "{e}"),
        }
        let mut weaker = found.clone();
        weaker.push(("sslmode".into(), "require".into()));
        let e = TlsSettings::resolve(&weaker, false, SslMode::Prefer)
            .unwrap_err()
            .to_string();
        assert!(e.contains("verify-full"), "{e}");
    }
}
