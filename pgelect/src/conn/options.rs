//! [`ConnectOptions`]: where and how to connect, read from a URL, a
//! key/value string, the environment or a driver configuration, with the
//! password never shown.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::config::SslMode as DriverSsl;
use tokio_postgres::config::TargetSessionAttrs;
use tokio_postgres::Config;

use super::tls::{self, SslMode, TlsSettings};
use super::{params, passfile};
use crate::error::{Error, Result};
use crate::schema::SchemaName;

/// Default bound on establishing a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how to connect, plus the schema pgelect's tables live in.
///
/// Built from a URL (`postgres://user:password@host:port/db?...`), a libpq
/// key/value string, the environment, or a [`tokio_postgres::Config`].
/// `Debug` and every error render the target as `host:port/database user=NAME`
/// and never show the password.
///
/// ```
/// use pgelect::ConnectOptions;
/// let o = ConnectOptions::from_url("postgres://app:s3cret@db.internal:5432/app").unwrap();
/// assert_eq!(o.target(), "db.internal:5432/app user=app");
/// assert!(!format!("{o:?}").contains("s3cret"));
/// assert!(ConnectOptions::from_url("postgres://app:s3cret@db:notaport/app").is_err());
/// ```
#[derive(Clone)]
pub struct ConnectOptions {
    pub(super) config: Config,
    pub(super) schema: SchemaName,
    pub(super) connect_timeout: Duration,
    /// Shared: clones of the options share one cached connector.
    pub(super) tls: Arc<TlsSettings>,
}

impl ConnectOptions {
    /// Parses a `postgres://` (or `postgresql://`) URL or a libpq key/value
    /// connection string (`host=db user=app password='a b' dbname=app`).
    ///
    /// When it holds no password, the password is taken, as libpq does, from
    /// `PGPASSWORD`, else from the password file (`PGPASSFILE`, else
    /// `~/.pgpass`; see [`ConnectOptions::password_file`]).
    ///
    /// Errors never repeat a password: a URL is shown with its user info
    /// redacted (`postgres://app:***@db/app`), a key/value string not at
    /// all, and the driver's complaint only when it names a known option. A
    /// URL with more than one `@` is refused before anything is looked up:
    /// libpq and the driver both split at the *first* `@`, so a password
    /// holding an unescaped `@` would turn its tail into a host name (shown
    /// in errors, sent to DNS). Percent-encode it as `%40`.
    ///
    /// TLS settings are libpq's: `sslmode` (see [`SslMode`]; default
    /// `prefer`), `sslrootcert` (a PEM file, or `system`), `sslcert` and
    /// `sslkey`, `sslcrl`, `sslsni`, `ssl_min_protocol_version` and
    /// `ssl_max_protocol_version`, from the string, else from `PGSSLMODE`,
    /// `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`, `PGSSLCRL`, `PGSSLSNI`,
    /// `PGSSLMINPROTOCOLVERSION`, `PGSSLMAXPROTOCOLVERSION`, else the
    /// files under `~/.postgresql/` when they exist. Files are read and
    /// checked here: a missing one, a key that is not the certificate's or
    /// a key others may read is an [`Error::Config`] naming the setting.
    ///
    /// ```
    /// use pgelect::{ConnectOptions, conn::SslMode};
    /// let o = ConnectOptions::from_url("postgres://app@db/app?sslmode=require").unwrap();
    /// assert_eq!(o.ssl_mode(), SslMode::Require);
    /// let e = ConnectOptions::from_url("postgres://app@db/app?sslmode=verify-full&sslrootcert=/nonexistent.crt").unwrap_err();
    /// assert!(e.to_string().contains("sslrootcert"));
    /// ```
    ///
    /// ```
    /// use pgelect::ConnectOptions;
    /// let e = ConnectOptions::from_url("postgres://app:se@cret@db/app").unwrap_err();
    /// assert!(e.to_string().contains("%40"));
    /// assert!(!e.to_string().contains("cret"));
    /// let o = ConnectOptions::from_url("host=db port=5433 user=app password='a b' dbname=app").unwrap();
    /// assert_eq!(o.target(), "db:5433/app user=app");
    /// ```
    pub fn from_url(url: &str) -> Result<ConnectOptions> {
        let (config, tls_found) = parse_connection_string(url.trim())?;
        let tls = TlsSettings::resolve(&tls_found, true, SslMode::Prefer)?;
        let mut options = ConnectOptions::with_tls(config, tls);
        options.fill_password(passfile::default_path().as_deref());
        Ok(options)
    }

    /// Uses `DATABASE_URL` if set (as [`ConnectOptions::from_url`]), else
    /// the libpq variables `PGHOST`, `PGPORT` (comma-separated lists for
    /// several hosts), `PGUSER`, `PGPASSWORD`, `PGDATABASE`, `PGAPPNAME`,
    /// `PGTARGETSESSIONATTRS` (defaults: localhost, 5432, the OS user, no
    /// password, the user name, any). Without `PGPASSWORD` the password comes
    /// from the password file (`PGPASSFILE`, else `~/.pgpass`), as in libpq.
    pub fn from_env() -> Result<ConnectOptions> {
        if let Some(url) = std::env::var("DATABASE_URL").ok().filter(|s| !s.is_empty()) {
            return ConnectOptions::from_url(&url);
        }
        let var = |k: &str| std::env::var(k).ok().filter(|s| !s.is_empty());
        let mut c = Config::new();
        // Comma-separated lists, as in libpq: several hosts are tried in
        // turn, with one port for all or one per host (empty: 5432).
        for host in var("PGHOST").as_deref().unwrap_or("localhost").split(',') {
            c.host(if host.is_empty() { "localhost" } else { host });
        }
        if let Some(p) = var("PGPORT") {
            for part in p.split(',') {
                let port: u16 = if part.is_empty() {
                    5432
                } else {
                    part.parse().map_err(|_| {
                        Error::config(format!(
                            "PGPORT={p:?} is not a port number or a list of them"
                        ))
                    })?
                };
                c.port(port);
            }
        }
        if let Some(v) = var("PGTARGETSESSIONATTRS") {
            c.target_session_attrs(target_session_attrs(&v, "PGTARGETSESSIONATTRS")?);
        }
        let user = var("PGUSER")
            .or_else(|| var("USER"))
            .unwrap_or_else(|| "postgres".into());
        c.user(&user);
        c.dbname(var("PGDATABASE").as_deref().unwrap_or(&user));
        if let Some(app) = var("PGAPPNAME") {
            c.application_name(app);
        }
        let tls = TlsSettings::resolve(&[], true, SslMode::Prefer)?;
        let mut options = ConnectOptions::with_tls(c, tls);
        options.fill_password(passfile::default_path().as_deref());
        Ok(options)
    }

    /// If no password is set yet, looks one up in the libpq password file
    /// at `path` (format `hostname:port:database:username:password`, `*`
    /// matches anything, `\:` and `\\` escape, first match wins; see the
    /// [PostgreSQL manual](https://www.postgresql.org/docs/current/libpq-pgpass.html)).
    ///
    /// A missing file, or no matching line, changes nothing. As in libpq, a
    /// file that is not a plain file or that group or others may access
    /// (mode beyond `0600`) is ignored with a warning in the log.
    ///
    /// [`from_url`](ConnectOptions::from_url) and
    /// [`from_env`](ConnectOptions::from_env) already consult `PGPASSFILE`
    /// or `~/.pgpass`; [`from_config`](ConnectOptions::from_config) does not.
    /// Only the first host is looked up (the driver has one password for
    /// all hosts).
    pub fn password_file(mut self, path: impl AsRef<Path>) -> ConnectOptions {
        self.fill_password_from_file(path.as_ref());
        self
    }

    /// True when a password is set (from the string, the environment or a
    /// password file). The password itself is never shown.
    pub fn has_password(&self) -> bool {
        self.config.get_password().is_some()
    }

    /// `PGPASSWORD`, else the password file, when the configuration has no
    /// password (libpq's order).
    fn fill_password(&mut self, passfile: Option<&Path>) {
        if self.has_password() {
            return;
        }
        if let Some(pw) = std::env::var("PGPASSWORD").ok().filter(|s| !s.is_empty()) {
            self.config.password(pw);
            return;
        }
        if let Some(path) = passfile {
            self.fill_password_from_file(path);
        }
    }

    fn fill_password_from_file(&mut self, path: &Path) {
        if self.has_password() {
            return;
        }
        let host = match (
            self.config.get_hosts().first(),
            self.config.get_hostaddrs().first(),
        ) {
            (Some(Host::Tcp(h)), _) => h.clone(),
            (Some(Host::Unix(p)), _) => p.display().to_string(),
            (None, Some(addr)) => addr.to_string(),
            (None, None) => String::new(),
        };
        let Some(user) = self.config.get_user() else {
            return;
        };
        let what = passfile::Lookup {
            host: &host,
            port: self.config.get_ports().first().copied().unwrap_or(5432),
            database: self.config.get_dbname().unwrap_or(user),
            user,
        };
        if let Some(pw) = passfile::lookup(path, &what) {
            tracing::debug!(path = %path.display(), target = %self.target(), "password taken from the password file");
            self.config.password(pw);
        }
    }

    /// Wraps a driver configuration.
    ///
    /// A `connect_timeout` set in the configuration (or the URL's
    /// `connect_timeout=` parameter) is kept; otherwise it is
    /// [`DEFAULT_CONNECT_TIMEOUT`].
    pub fn from_config(config: Config) -> ConnectOptions {
        let mode = match config.get_ssl_mode() {
            DriverSsl::Disable => SslMode::Disable,
            DriverSsl::Require => SslMode::Require,
            _ => SslMode::Prefer,
        };
        // The default files under ~/.postgresql are consulted as libpq
        // does; if they cannot be used, neither are they here.
        let tls = TlsSettings::resolve(&[], false, mode).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the default TLS files cannot be used; connecting without them");
            TlsSettings::plain(mode)
        });
        ConnectOptions::with_tls(config, tls)
    }

    fn with_tls(config: Config, tls: TlsSettings) -> ConnectOptions {
        let connect_timeout = config
            .get_connect_timeout()
            .copied()
            .filter(|t| !t.is_zero())
            .unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        ConnectOptions {
            config,
            schema: SchemaName::default(),
            connect_timeout,
            tls: Arc::new(tls),
        }
    }

    /// The schema pgelect's tables live in. Default: `pgelect`.
    pub fn schema(mut self, schema: &str) -> Result<ConnectOptions> {
        self.schema = SchemaName::new(schema)?;
        Ok(self)
    }

    /// Bound on establishing a connection. Default: `10s`. Must be positive.
    pub fn connect_timeout(mut self, timeout: Duration) -> Result<ConnectOptions> {
        if timeout.is_zero() {
            return Err(Error::config("connect_timeout must be positive"));
        }
        self.connect_timeout = timeout;
        Ok(self)
    }

    /// The bound on establishing a connection ([`connect_timeout`](Self::connect_timeout)).
    pub(crate) fn connect_bound(&self) -> Duration {
        self.connect_timeout
    }

    /// The TLS mode connections use (`sslmode`, else `PGSSLMODE`, else
    /// `prefer`); see [`SslMode`] for what each protects against.
    pub fn ssl_mode(&self) -> SslMode {
        self.tls.mode()
    }

    /// The schema name.
    pub fn schema_name(&self) -> &SchemaName {
        &self.schema
    }

    /// Test hook, not API (feature `test-hooks`): the driver configuration
    /// (with the password; do not log it).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn driver_config(&self) -> &Config {
        &self.config
    }

    /// How many hosts the connection string names (a multi-host URL names
    /// several, tried in turn).
    pub(crate) fn host_count(&self) -> usize {
        self.config
            .get_hosts()
            .len()
            .max(self.config.get_hostaddrs().len())
            .max(1)
    }

    /// The one TCP server these settings name, as `(host, port)`: `None`
    /// when they name several hosts or ports, a Unix socket, or a
    /// `hostaddr`. For tools that point the same settings at another
    /// address (a proxy) and must know which server they replace.
    ///
    /// ```
    /// let o = pgelect::ConnectOptions::from_url("postgres://app@db.internal:6432/app").unwrap();
    /// assert_eq!(o.single_tcp_server(), Some(("db.internal".to_owned(), 6432)));
    /// let o = pgelect::ConnectOptions::from_url("postgres://app@a,b/app").unwrap();
    /// assert_eq!(o.single_tcp_server(), None);
    /// ```
    pub fn single_tcp_server(&self) -> Option<(String, u16)> {
        if !self.config.get_hostaddrs().is_empty() {
            return None;
        }
        let [Host::Tcp(host)] = self.config.get_hosts() else {
            return None;
        };
        let port = match self.config.get_ports() {
            [] => 5432,
            [p] => *p,
            _ => return None,
        };
        Some((host.clone(), port))
    }

    /// `host:port/database user=NAME`, for messages (every host of a
    /// multi-host URL: `h1:5432,h2:5432/app user=app`). Never holds the
    /// password.
    pub fn target(&self) -> String {
        target_of(&self.config, None)
    }
}

/// `host:port/database user=NAME` of `config`: of its host `only` (an
/// index into its hosts), or of every host, comma-separated.
pub(super) fn target_of(config: &Config, only: Option<usize>) -> String {
    let hosts = config.get_hosts();
    let ports = config.get_ports();
    let count = hosts.len().max(config.get_hostaddrs().len()).max(1);
    let one = |i: usize| {
        let host = match hosts.get(i) {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
            None => config
                .get_hostaddrs()
                .get(i)
                .map_or_else(|| "localhost".into(), |a| a.to_string()),
        };
        let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
        format!("{host}:{port}")
    };
    let hosts = match only {
        Some(i) => one(i),
        None => (0..count).map(one).collect::<Vec<_>>().join(","),
    };
    let db = config.get_dbname().or(config.get_user()).unwrap_or("?");
    let user = config.get_user().unwrap_or("?");
    format!("{hosts}/{db} user={user}")
}

/// Parses a URL or key/value string, refusing an ambiguous URL and keeping
/// every fragment of the input out of the error (see
/// [`ConnectOptions::from_url`]). The TLS settings, which the driver does
/// not know, are returned apart.
fn parse_connection_string(text: &str) -> Result<(Config, Vec<(String, String)>)> {
    let url_rest = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|scheme| text.strip_prefix(scheme));
    if let Some(rest) = url_rest {
        if rest.matches('@').count() > 1 {
            return Err(Error::config(format!(
                "the database URL {} contains more than one '@': a password or user name that contains '@' must be percent-encoded as %40 (refused rather than guess where the host begins)",
                redact_url(text)
            )));
        }
    }
    let mut keys: Vec<&str> = tls::TLS_KEYS.iter().map(|(k, _)| *k).collect();
    keys.push("target_session_attrs");
    let (driver_text, mut tls_found) = params::take(text, &keys);
    let attrs = match tls_found
        .iter()
        .rposition(|(k, _)| k == "target_session_attrs")
    {
        Some(i) => Some((tls_found.remove(i).1, "target_session_attrs")),
        None => std::env::var("PGTARGETSESSIONATTRS")
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| (v, "PGTARGETSESSIONATTRS")),
    };
    tls_found.retain(|(k, _)| k != "target_session_attrs");
    let mut config = driver_text.parse::<Config>().map_err(|e| {
        let detail = parse_error_detail(&e)
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        match url_rest {
            Some(_) => Error::config(format!(
                "the database URL {} cannot be parsed{detail}; expected postgres://user:password@host:port/database, with '@', ':', '/', '?' and '&' in the password percent-encoded",
                redact_url(text)
            )),
            None => Error::config(format!(
                "the database connection string (key=value form, not shown) cannot be parsed{detail}; expected a postgres:// URL or pairs such as host=db user=app password='a b' dbname=app"
            )),
        }
    })?;
    if let Some((value, from)) = attrs {
        config.target_session_attrs(target_session_attrs(&value, from)?);
    }
    Ok((config, tls_found))
}

/// libpq's `target_session_attrs` for a candidate, which must write: `any`
/// takes the first server that answers; `read-write` and `primary` skip a
/// server that is read-only or in recovery (pgelect cannot lead on either,
/// so `primary` is checked as `read-write`); the read-only choices are
/// refused, since pgelect writes its lease row and terms.
fn target_session_attrs(value: &str, from: &str) -> Result<TargetSessionAttrs> {
    match value {
        "any" => Ok(TargetSessionAttrs::Any),
        "read-write" | "primary" => Ok(TargetSessionAttrs::ReadWrite),
        "read-only" | "standby" | "prefer-standby" => Err(Error::config(format!(
            "{from}={value}: pgelect writes its lease row and fencing terms, so it must reach the primary; use read-write or primary (with several hosts), or any"
        ))),
        other => Err(Error::config(format!(
            "{from}={other:?} is not a target_session_attrs value; use any, read-write or primary"
        ))),
    }
}

/// libpq options the driver does not support: an unknown option with one
/// of these names may be shown. Any other name may be a fragment of a
/// password (`password=a b`), so it is not.
const KNOWN_UNSUPPORTED_OPTIONS: [&str; 13] = [
    "passfile",
    "service",
    "sslcertmode",
    "sslcompression",
    "requirepeer",
    "require_auth",
    "gssencmode",
    "gsslib",
    "krbsrvname",
    "client_encoding",
    "fallback_application_name",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
];

/// The part of the driver's parse error that is safe to show. The driver's
/// causes are private types, so this reads their text; anything not
/// recognised is dropped rather than risk echoing a value.
fn parse_error_detail(e: &tokio_postgres::Error) -> Option<String> {
    let cause = std::error::Error::source(e)?.to_string();
    let name_in = |prefix: &str| {
        cause
            .strip_prefix(prefix)?
            .strip_suffix('`')
            .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .map(str::to_owned)
    };
    if let Some(name) = name_in("invalid value for option `") {
        return Some(format!("invalid value for option `{name}`"));
    }
    if cause.starts_with("unknown option `") {
        return Some(match name_in("unknown option `") {
            Some(name) if KNOWN_UNSUPPORTED_OPTIONS.contains(&name.as_str()) => {
                format!("option `{name}` is not supported")
            }
            _ => "an unknown option, whose name is not shown in case it is part of a password: quote values that contain spaces".to_owned(),
        });
    }
    match cause.as_str() {
        "unexpected EOF" | "unterminated parameter" => Some(cause),
        _ if cause.starts_with("unexpected character") => Some(
            "a syntax error: quote values that contain spaces or quotes, as key='it\\'s'"
                .to_owned(),
        ),
        _ => None,
    }
}

/// A URL for messages: the user name kept, the password replaced by `***`,
/// the query (which may hold `password=`) by `?…`, and everything after the
/// first `@` by `…` when another `@` follows (it may be the password's tail).
fn redact_url(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let hide_query = |s: &str| match s.split_once('?') {
        Some((head, _)) => format!("{head}?…"),
        None => s.to_owned(),
    };
    let Some((creds, host)) = rest.split_once('@') else {
        return format!("{scheme}://{}", hide_query(rest));
    };
    let user = match creds.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => creds.to_owned(),
    };
    let host = if host.contains('@') {
        "…".to_owned()
    } else {
        hide_query(host)
    };
    format!("{scheme}://{user}@{host}")
}

impl fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("target", &self.target())
            .field(
                "password",
                &self.config.get_password().map(|_| "<redacted>"),
            )
            .field("schema", &self.schema.as_str())
            .field("connect_timeout", &self.connect_timeout)
            .field("tls", &self.tls)
            .finish()
    }
}
