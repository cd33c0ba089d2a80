//! Connection settings and the dedicated connections pgelect owns.
//!
//! Locks and leadership live on connections that pgelect opens itself and
//! never returns to a pool. Each one is driven by a background task that reads
//! the socket all the time, so the server's goodbye (a terminated backend, a
//! restart) is noticed within milliseconds with no query in flight; the task
//! also forwards `LISTEN` notifications.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::future::poll_fn;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio_postgres::config::Host;
use tokio_postgres::config::SslMode as DriverSsl;
use tokio_postgres::config::TargetSessionAttrs;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{AsyncMessage, Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::schema::SchemaName;

mod params;
mod passfile;
mod tls;

pub use tls::SslMode;
use tls::TlsSettings;

/// The driver's connection over pgelect's TLS connector.
type TlsConnection = Connection<Socket, <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream>;

/// Runs one connection attempt (TCP connect, TLS handshake, password
/// exchange, startup), bounded by `bound`, on a thread of tokio's blocking
/// pool rather than on the caller's task.
///
/// The SCRAM password exchange hashes the password 4,096 times in one poll
/// of the driver's connect future (65-95 ms in a debug build here, a few
/// milliseconds in a release build), and a TLS handshake is also work done
/// in a poll. Polled on a runtime worker, that poll holds the worker, and
/// a task polled in the same select (a leader's keeper reconnecting) or
/// waiting for that worker (a keeper whose local deadline passes, a
/// leadership's `lost()`) is late by as much. A leader that learns of its
/// deadline late acts past it: that overlap was seen in CI (170 ms) when
/// three lease candidates reconnected at once through a restarted
/// PgBouncer. Off the workers, the deadline timers fire on time.
///
/// The attempt runs on the runtime's IO and timer drivers (a
/// `current_thread` runtime drives them while the caller awaits). Dropping
/// the returned future ends the attempt at its next poll: the half-open
/// connection is dropped.
///
/// `Err(Elapsed)` when `bound` passed, counted from the call (a pool busy
/// with the application's blocking work delays the start of the attempt,
/// never the bound).
async fn connect_off_the_workers(
    config: Config,
    tls: MakeRustlsConnect,
    bound: Duration,
) -> std::result::Result<
    std::result::Result<(Client, TlsConnection), tokio_postgres::Error>,
    tokio::time::error::Elapsed,
> {
    let handle = tokio::runtime::Handle::current();
    // Dropped with the returned future: ends the attempt on the pool.
    let (_abandon, abandoned) = tokio::sync::oneshot::channel::<()>();
    let attempt = tokio::task::spawn_blocking(move || {
        handle.block_on(async move {
            tokio::select! {
                r = tokio::time::timeout(bound, config.connect(tls)) => Some(r),
                _ = abandoned => None,
            }
        })
    });
    // The pool may be busy with the application's own blocking work: the
    // attempt is bounded from here too, queueing included.
    let attempt = match tokio::time::timeout(bound, attempt).await {
        Ok(joined) => joined,
        Err(elapsed) => return Err(elapsed),
    };
    match attempt {
        Ok(Some(r)) => r,
        // Only when the caller dropped this future, which then awaits no
        // more; or the runtime shuts down. Either way nobody waits for it.
        Ok(None) => std::future::pending().await,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // The runtime is shutting down and cancelled the attempt.
        Err(_) => std::future::pending().await,
    }
}

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
    config: Config,
    schema: SchemaName,
    connect_timeout: Duration,
    /// Shared: clones of the options share one cached connector.
    tls: Arc<TlsSettings>,
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
    /// use pgelect::{ConnectOptions, SslMode};
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
    /// password file). The password itself is only in
    /// [`driver_config`](ConnectOptions::driver_config).
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

    /// The TLS mode connections use (`sslmode`, else `PGSSLMODE`, else
    /// `prefer`); see [`SslMode`] for what each protects against.
    pub fn ssl_mode(&self) -> SslMode {
        self.tls.mode()
    }

    /// The schema name.
    pub fn schema_name(&self) -> &SchemaName {
        &self.schema
    }

    /// The driver configuration (with the password; do not log it).
    pub fn driver_config(&self) -> &Config {
        &self.config
    }

    /// The one TCP server these settings name, if they name exactly one
    /// (no `hostaddr`): where [`Canceller`] sends its requests itself.
    fn cancel_target(&self) -> Option<CancelTarget> {
        let hosts = self.config.get_hosts();
        if hosts.len() != 1 || !self.config.get_hostaddrs().is_empty() {
            return None;
        }
        let Host::Tcp(host) = &hosts[0] else {
            return None;
        };
        let port = match self.config.get_ports() {
            [] => 5432,
            [p] => *p,
            _ => return None,
        };
        Some(CancelTarget {
            host: host.clone(),
            port,
            connect_timeout: self
                .config
                .get_connect_timeout()
                .copied()
                .unwrap_or(Duration::from_secs(5)),
        })
    }

    /// `host:port/database user=NAME`, for messages. Never holds the password.
    pub fn target(&self) -> String {
        let host = match self.config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
            None => "localhost".into(),
        };
        let port = self.config.get_ports().first().copied().unwrap_or(5432);
        let db = self
            .config
            .get_dbname()
            .or(self.config.get_user())
            .unwrap_or("?");
        let user = self.config.get_user().unwrap_or("?");
        format!("{host}:{port}/{db} user={user}")
    }

    /// Opens a connection that pgelect owns, names it `pgelect:<purpose>`
    /// unless an application name was set, starts its driver task, and
    /// switches off the server's idle timeouts for it (see
    /// [`OWNED_SESSION_SETTINGS`]).
    pub(crate) async fn connect(&self, purpose: &str) -> Result<DedicatedConnection> {
        self.connect_with(purpose, None, &owned_session_settings(), NOTICES)
            .await
    }

    /// Like [`ConnectOptions::connect`], for a connection that will wait for
    /// and hold locks: applies `tcp` on the client side and, through session
    /// settings, on the server side, and switches off every server timeout
    /// that would end a wait or a held lock (see [`lock_session_settings`]),
    /// in the same round trip.
    pub(crate) async fn connect_for_locks(
        &self,
        purpose: &str,
        tcp: &TcpTimeouts,
    ) -> Result<DedicatedConnection> {
        self.connect_with(purpose, Some(tcp), &lock_session_settings(tcp), NOTICES)
            .await
    }

    /// Like [`ConnectOptions::connect_for_locks`], for the one connection
    /// that the candidates of thousands of roles share: it keeps up to
    /// `notices` unread notifications (every election of every role is
    /// announced on it, hundreds in one commit).
    pub(crate) async fn connect_for_shared_locks(
        &self,
        purpose: &str,
        tcp: &TcpTimeouts,
        notices: usize,
    ) -> Result<DedicatedConnection> {
        self.connect_with(purpose, Some(tcp), &lock_session_settings(tcp), notices)
            .await
    }

    /// Opens a plain connection named `application_name`, bounded by the
    /// connect timeout, for tools that observe pgelect's tables (the
    /// `pgelect` command's `status` and `resign`). The caller drives the
    /// returned [`Connection`] (spawn it, or poll its messages for `LISTEN`
    /// notifications).
    ///
    /// Failures are classified as [`Error::from_connect`] does:
    /// [`Error::Auth`], [`Error::ConnectTimeout`] (the driver's connect
    /// timeout, or no finished startup within the timeout plus one second,
    /// as from a server that accepts and never answers) or
    /// [`Error::Connect`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-open connection.
    pub async fn connect_plain(&self, application_name: &str) -> Result<(Client, PlainConnection)> {
        let mut config = self.config.clone();
        config.application_name(application_name);
        let (client, connection) = self.open(config).await?;
        Ok((client, PlainConnection { connection }))
    }

    /// Connects with `config`, bounding the whole attempt (TCP connect and
    /// startup): the driver's `connect_timeout` covers the TCP connect
    /// only, so a server that accepts and never answers is caught by the
    /// outer bound.
    ///
    /// TLS follows libpq: `allow` tries plain text and then TLS if the
    /// server refused; `prefer` tries TLS and then plain text if the
    /// handshake or the server refused; the other modes try once. Unix
    /// sockets never use TLS (the server does not offer it there).
    async fn open(&self, mut config: Config) -> Result<(Client, TlsConnection)> {
        config.connect_timeout(self.connect_timeout);
        let unix_only = !config.get_hosts().is_empty()
            && config.get_hostaddrs().is_empty()
            && config
                .get_hosts()
                .iter()
                .all(|h| !matches!(h, Host::Tcp(_)));
        let mode = if unix_only {
            SslMode::Disable
        } else {
            self.tls.mode()
        };
        let attempts: &[DriverSsl] = match mode {
            SslMode::Disable => &[DriverSsl::Disable],
            SslMode::Allow => &[DriverSsl::Disable, DriverSsl::Require],
            SslMode::Prefer => &[DriverSsl::Prefer, DriverSsl::Disable],
            _ => &[DriverSsl::Require],
        };
        let tls = self.tls.connector()?;
        let mut last = None;
        for (i, ssl) in attempts.iter().enumerate() {
            config.ssl_mode(*ssl);
            let bound = self.connect_timeout + Duration::from_secs(1);
            let e = match connect_off_the_workers(config.clone(), tls.clone(), bound).await {
                Err(_) => {
                    return Err(Error::ConnectTimeout {
                        target: self.target(),
                        timeout: self.connect_timeout,
                        source: None,
                    })
                }
                Ok(Ok(pair)) => {
                    if i > 0 {
                        tracing::debug!(sslmode = %mode, target = %self.target(), "connected on the second try, {}", if *ssl == DriverSsl::Disable { "without TLS" } else { "with TLS" });
                    }
                    return Ok(pair);
                }
                Ok(Err(e)) => e,
            };
            // A second try only after the server (or the handshake) said
            // no: a timeout or an unreachable host would fail again.
            let refused = e.as_db_error().is_some() || tls::rustls_error_in(&e).is_some();
            last = Some(e);
            if !refused {
                break;
            }
        }
        let e = last.expect("BUG: at least one connection attempt");
        Err(self
            .tls_error(&e, mode)
            .unwrap_or_else(|| Error::from_connect(self.target(), self.connect_timeout, e)))
    }

    /// A failed connection explained in terms of TLS, when TLS is why.
    fn tls_error(&self, e: &tokio_postgres::Error, mode: SslMode) -> Option<Error> {
        let reason = if let Some(r) = tls::rustls_error_in(e) {
            format!(
                "{} (sslmode={mode} from {}, {})",
                tls::tls_text(r),
                self.tls.mode_from(),
                self.tls.roots_shown()
            )
        } else if e.as_db_error().is_some_and(|d| {
            // "no encryption" from PostgreSQL 14 on, "SSL off" before.
            d.code().code() == "28000"
                && (d.message().contains("no encryption") || d.message().contains("SSL off"))
        }) && !mode.requires_tls()
        {
            format!(
                "the server accepts only TLS connections from here (its pg_hba.conf has hostssl lines only) and sslmode={mode} did not use TLS: use sslmode=require or, better, verify-full with sslrootcert"
            )
        } else if crate::error::driver_text(e).contains("server does not support TLS") {
            format!(
                "the server does not offer TLS and sslmode={mode} requires it: turn ssl on at the server, or (unprotected) use sslmode=prefer"
            )
        } else {
            return None;
        };
        Some(Error::Tls {
            target: self.target(),
            reason,
            source: None,
        })
    }

    /// Connects, then in one round trip reads the backend's pid and applies
    /// `settings` for the session (those the server does not know are
    /// skipped, as in [`DedicatedConnection::set_session`]).
    async fn connect_with(
        &self,
        purpose: &str,
        tcp: Option<&TcpTimeouts>,
        settings: &[(&str, String)],
        notices: usize,
    ) -> Result<DedicatedConnection> {
        let mut config = self.config.clone();
        if let Some(tcp) = tcp {
            tcp.apply_client(&mut config);
        }
        if config.get_application_name().is_none() {
            config.application_name(format!("pgelect:{purpose}"));
        }
        let schema = self.schema.as_str();
        let names: Vec<&str> = settings.iter().map(|(n, _)| *n).collect();
        let values: Vec<&str> = settings.iter().map(|(_, v)| v.as_str()).collect();
        // The server's idle_session_timeout runs from the end of the
        // startup until the settings arrive: a client slower than that (a
        // loaded machine, a timeout of a few hundred milliseconds) finds
        // its new connection ended before its first statement. That is
        // worth another connection or two, not an error.
        let mut attempts = 0;
        let (mut conn, row) = loop {
            attempts += 1;
            let (client, connection) = self.open(config.clone()).await?;
            let conn = DedicatedConnection::drive(
                client,
                connection,
                self.tls.connector()?,
                self.cancel_target(),
                notices,
            );
            let started = conn
                .client
                .query_typed_one(
                    START_SESSION_SQL,
                    &[
                        (&names, tokio_postgres::types::Type::TEXT_ARRAY),
                        (&values, tokio_postgres::types::Type::TEXT_ARRAY),
                    ],
                )
                .await;
            match started {
                Ok(row) => break (conn, row),
                // Ended before or as the statement arrived: a closed
                // connection, or the FATAL 57P05 the server sends first.
                Err(e)
                    if (e.is_closed()
                        || e.code()
                            == Some(&tokio_postgres::error::SqlState::IDLE_SESSION_TIMEOUT))
                        && attempts < 3 =>
                {
                    tracing::debug!(error = %e, attempts, "the server ended a new connection before its first statement (idle_session_timeout?); connecting again");
                }
                Err(e) => return Err(Error::db("start a session", schema, e)),
            }
        };
        conn.pid = row
            .try_get(0)
            .map_err(|e| Error::db("start a session", schema, e))?;
        let addr: Option<String> = row.try_get(1).unwrap_or(None);
        let port: Option<i32> = row.try_get(2).unwrap_or(None);
        conn.server = addr.zip(port).map(Box::new);
        if self.config.get_hosts().len() + self.config.get_hostaddrs().len() > 1 {
            let addr: Option<String> = row.try_get(1).unwrap_or(None);
            let port: Option<i32> = row.try_get(2).unwrap_or(None);
            tracing::info!(
                purpose,
                server = %format!("{}:{}", addr.as_deref().unwrap_or("local socket"), port.unwrap_or(0)),
                "connected to one of several hosts"
            );
        }
        Ok(conn)
    }
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

/// The connection half of [`ConnectOptions::connect_plain`]: poll it (or
/// spawn it as a future) for the client to make progress.
#[must_use = "the client makes no progress unless the connection is polled"]
pub struct PlainConnection {
    connection: TlsConnection,
}

impl PlainConnection {
    /// The next message from the server that is not a reply to a statement
    /// (a `LISTEN` notification, a notice), or `None` when the connection
    /// has ended; see [`tokio_postgres::Connection::poll_message`].
    pub fn poll_message(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<std::result::Result<AsyncMessage, tokio_postgres::Error>>> {
        self.connection.poll_message(cx)
    }
}

impl std::future::Future for PlainConnection {
    type Output = std::result::Result<(), tokio_postgres::Error>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.connection).poll(cx)
    }
}

impl fmt::Debug for PlainConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlainConnection").finish_non_exhaustive()
    }
}

/// A `LISTEN` notification received on a dedicated connection.
#[derive(Clone, Debug)]
pub(crate) struct Notice {
    pub(crate) channel: String,
    pub(crate) payload: String,
}

/// A connection pgelect owns, with its driver task.
///
/// `closed()` is cancelled the moment the driver task sees the connection end
/// (server FATAL, EOF, reset) or the owner kills it.
pub(crate) struct DedicatedConnection {
    client: Client,
    closed: CancellationToken,
    /// The error the connection ended with, set before `closed` fires.
    ended_by: Arc<OnceLock<Arc<tokio_postgres::Error>>>,
    notices: broadcast::Sender<Notice>,
    task: JoinHandle<()>,
    pid: i32,
    /// The server's address and port as it reports them
    /// (`inet_server_addr()`, `inet_server_port()`; `None` over a socket).
    server: Option<Box<(String, i32)>>,
    tls: MakeRustlsConnect,
    cancel_target: Option<CancelTarget>,
}

/// Cancels the statement running on a [`DedicatedConnection`].
pub(crate) struct Canceller {
    token: tokio_postgres::CancelToken,
    tls: MakeRustlsConnect,
    target: Option<CancelTarget>,
}

/// The one TCP server a connection's settings name: where pgelect sends a
/// cancel request itself, so that it can wait for the server's answer.
#[derive(Clone, Debug)]
struct CancelTarget {
    host: String,
    port: u16,
    connect_timeout: Duration,
}

/// How many notifications a connection keeps for a receiver that has not
/// read them yet; one that falls further behind is told it lagged.
const NOTICES: usize = 256;

/// How long a cancel request may take, connecting included. The server
/// (or pooler) closes the connection as soon as it has acted on it.
const CANCEL_BOUND: Duration = Duration::from_secs(10);

impl Canceller {
    /// Sends the cancel request and, like libpq, waits (bounded by
    /// [`CANCEL_BOUND`]) until the server closes the cancel connection,
    /// which it does once it acted on the request; the statement may still
    /// finish first.
    ///
    /// tokio-postgres closes its side right after sending. PgBouncer up to
    /// at least 1.18 can then free the cancelling client while it still
    /// forwards the request, and exits ("FATAL … disconnect_client(): bad
    /// client state: 0", pgbouncer/pgbouncer#801): a pooler every other
    /// client depends on, brought down by a lease renewal's timeout. So
    /// with a single TCP host pgelect opens the connection itself and
    /// keeps it until the other side has closed it. With several hosts
    /// (which one the statement's connection reached is not known here)
    /// or a Unix socket, the driver's own request is sent.
    pub(crate) async fn cancel(self) -> std::io::Result<()> {
        let Some(t) = self.target else {
            return tokio::time::timeout(CANCEL_BOUND, self.token.cancel_query(self.tls))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
                .map_err(std::io::Error::other);
        };
        let mut tls = self.tls;
        let token = self.token;
        let sent = async move {
            let stream = tokio::time::timeout(
                t.connect_timeout,
                tokio::net::TcpStream::connect((t.host.as_str(), t.port)),
            )
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
            let _ = stream.set_nodelay(true);
            let connector = MakeTlsConnect::<AwaitClose<tokio::net::TcpStream>>::make_tls_connect(
                &mut tls, &t.host,
            )
            .map_err(std::io::Error::other)?;
            token
                .cancel_query_raw(AwaitClose(stream), connector)
                .await
                .map_err(std::io::Error::other)
        };
        tokio::time::timeout(CANCEL_BOUND, sent)
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    }
}

/// A stream whose shutdown first waits for the other side to close: the
/// driver shuts the cancel connection down right after writing the
/// request; this makes that wait for the server's close, as libpq does.
struct AwaitClose<S>(S);

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for AwaitClose<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite
    for AwaitClose<S>
{
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        // Read (and drop) until the server's end of stream or an error.
        let mut scratch = [0u8; 64];
        loop {
            let mut buf = tokio::io::ReadBuf::new(&mut scratch);
            match std::pin::Pin::new(&mut self.0).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) if buf.filled().is_empty() => break,
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(_)) => break,
            }
        }
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl DedicatedConnection {
    fn drive(
        client: Client,
        mut connection: TlsConnection,
        tls: MakeRustlsConnect,
        cancel_target: Option<CancelTarget>,
        notices: usize,
    ) -> DedicatedConnection {
        crate::server::note_version(connection.parameter("server_version"));
        let closed = CancellationToken::new();
        let ended_by = Arc::new(OnceLock::new());
        let end = ended_by.clone();
        let (notices, _) = broadcast::channel(notices);
        let tx = notices.clone();
        let done = closed.clone();
        let task = tokio::spawn(async move {
            loop {
                match poll_fn(|cx| connection.poll_message(cx)).await {
                    Some(Ok(AsyncMessage::Notification(n))) => {
                        let _ = tx.send(Notice {
                            channel: n.channel().to_owned(),
                            payload: n.payload().to_owned(),
                        });
                    }
                    Some(Ok(AsyncMessage::Notice(n))) => {
                        tracing::debug!(message = n.message(), "server notice");
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "dedicated connection ended with an error");
                        let _ = end.set(Arc::new(e));
                        break;
                    }
                    None => break,
                }
            }
            done.cancel();
        });
        DedicatedConnection {
            client,
            closed,
            ended_by,
            notices,
            task,
            pid: 0,
            server: None,
            tls,
            cancel_target,
        }
    }

    /// The client to run statements with.
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// The server backend's process id.
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// The server's address and port as it reported them at the start.
    pub(crate) fn server(&self) -> Option<&(String, i32)> {
        self.server.as_deref()
    }

    /// Cancelled when the connection has ended.
    pub(crate) fn closed(&self) -> &CancellationToken {
        &self.closed
    }

    /// The error the connection ended with (the server's `FATAL`, an I/O
    /// error), once it has ended with one; `None` while it is open, after a
    /// clean end, or after [`kill`](DedicatedConnection::kill).
    pub(crate) fn ended_by(&self) -> Option<Arc<tokio_postgres::Error>> {
        self.ended_by.get().cloned()
    }

    /// [`Error::ConnectionLost`] for `operation`, with what ended the
    /// connection where known.
    pub(crate) fn lost(&self, operation: &'static str) -> Error {
        Error::connection_lost_by(operation, self.ended_by())
    }

    /// True once the connection has ended.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.is_cancelled() || self.client.is_closed()
    }

    /// A receiver of `LISTEN` notifications from now on.
    pub(crate) fn notices(&self) -> broadcast::Receiver<Notice> {
        self.notices.subscribe()
    }

    /// Drops the socket at once (the server sees the client vanish and
    /// releases its session locks). Used after a heartbeat timed out.
    pub(crate) fn kill(&self) {
        self.task.abort();
        self.closed.cancel();
    }

    /// What it takes to cancel the statement running on this connection:
    /// a cancel request over a new connection with the same TLS settings.
    pub(crate) fn canceller(&self) -> Canceller {
        Canceller {
            token: self.client.cancel_token(),
            tls: self.tls.clone(),
            target: self.cancel_target.clone(),
        }
    }

    /// Sets server-side settings for this session only, skipping those the
    /// server does not know (older versions), and returns nothing.
    pub(crate) async fn set_session(
        &self,
        settings: &[(&str, String)],
        schema: &str,
    ) -> Result<()> {
        if settings.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = settings.iter().map(|(n, _)| *n).collect();
        let values: Vec<&str> = settings.iter().map(|(_, v)| v.as_str()).collect();
        self.client
            .query_typed(
                "SELECT set_config(s.name, v.value, false)
                   FROM unnest($1::text[], $2::text[]) AS v(name, value)
                   JOIN pg_settings s ON s.name = v.name",
                &[
                    (&names, tokio_postgres::types::Type::TEXT_ARRAY),
                    (&values, tokio_postgres::types::Type::TEXT_ARRAY),
                ],
            )
            .await
            .map_err(|e| Error::db("configure the session", schema, e))?;
        Ok(())
    }

    /// The connection, if its preparation (`prepared`) succeeded; otherwise
    /// it is dropped at once and the error returned.
    pub(crate) fn kept_if(self, prepared: Result<()>) -> Result<DedicatedConnection> {
        match prepared {
            Ok(()) => Ok(self),
            Err(e) => {
                self.kill();
                Err(e)
            }
        }
    }

    /// Closes the connection politely and waits for the driver task.
    pub(crate) async fn close(self) {
        let DedicatedConnection { client, task, .. } = self;
        drop(client);
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
}

impl fmt::Debug for DedicatedConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedicatedConnection")
            .field("pid", &self.pid)
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// The first statement on every connection pgelect owns: the backend's pid,
/// and `$1`/`$2` (names, values) applied with `set_config(.., false)` for
/// the session, skipping names the server does not know (PostgreSQL 13 has
/// no `idle_session_timeout`, 14 added `client_connection_check_interval`).
/// One round trip, however many settings.
const START_SESSION_SQL: &str = "\
SELECT pg_backend_pid(), host(inet_server_addr()), inet_server_port(),
       (SELECT count(set_config(s.name, v.value, false))
          FROM unnest($1::text[], $2::text[]) AS v(name, value)
          JOIN pg_settings s ON s.name = v.name)";

/// Server-side settings for every connection pgelect owns: no idle
/// timeouts. A database or role may set `idle_session_timeout` or
/// `idle_in_transaction_session_timeout` (managed services often do); the
/// server would then end pgelect's connections between two statements: a
/// `LISTEN` connection would miss notifications while it reconnects, an
/// observer or lease connection would reconnect before nearly every
/// statement. pgelect's connections are idle by design and end when their
/// owner does.
///
/// `statement_timeout` and `lock_timeout` are left as the server sets them
/// on these connections: their statements are short (a lease renewal, an
/// observer's read), bounded on the client side, and through a pooler in
/// transaction mode a session setting lands on a pooled server connection
/// that other clients use next, so pgelect changes only the idle timeouts
/// there (which the pooler, not the server, should manage anyway).
pub(crate) const OWNED_SESSION_SETTINGS: [(&str, &str); 2] = [
    ("idle_session_timeout", "0"),
    ("idle_in_transaction_session_timeout", "0"),
];

fn owned_session_settings() -> Vec<(&'static str, String)> {
    OWNED_SESSION_SETTINGS
        .iter()
        .map(|(n, v)| (*n, (*v).to_owned()))
        .collect()
}

/// Server-side settings for a connection that waits for or holds locks:
/// TCP timeouts so that the server notices a vanished client and releases
/// its locks, and no idle, statement or lock timeouts that would end a
/// long-held lock or a long wait (a blocking standby's slice and
/// `LockSession`'s bounded waits set `lock_timeout` for one statement
/// themselves).
pub(crate) fn lock_session_settings(tcp: &TcpTimeouts) -> Vec<(&'static str, String)> {
    vec![
        (
            "tcp_keepalives_idle",
            tcp.keepalive_idle.as_secs().max(1).to_string(),
        ),
        (
            "tcp_keepalives_interval",
            tcp.keepalive_interval.as_secs().max(1).to_string(),
        ),
        ("tcp_keepalives_count", tcp.keepalive_count.to_string()),
        ("tcp_user_timeout", tcp.user_timeout.as_millis().to_string()),
        ("idle_session_timeout", "0".into()),
        ("idle_in_transaction_session_timeout", "0".into()),
        ("statement_timeout", "0".into()),
        ("lock_timeout", "0".into()),
        // PostgreSQL 14+: a backend blocked in a lock wait checks every
        // second whether its client is still there, so a waiter whose
        // process died does not stay queued (and granted) as a ghost.
        ("client_connection_check_interval", "1000".into()),
        // Every statement on these connections is short, but the batched
        // ones of a shared connection join pg_locks and pg_stat_activity,
        // which the planner costs high: past `jit_optimize_above_cost`
        // the server compiled a 200-role election for about 1 s of its
        // 10 ms, a heartbeat queued behind it timed out, and every role
        // on the connection stood again. Nobody else's statements run on
        // these connections.
        ("jit", "off".into()),
    ]
}

/// TCP timeouts applied on both ends of a lock-holding connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpTimeouts {
    /// Idle time before the first keepalive probe. Default: `5s`.
    pub keepalive_idle: Duration,
    /// Time between probes. Default: `2s`.
    pub keepalive_interval: Duration,
    /// Unanswered probes before the peer is declared gone. Default: `3`.
    pub keepalive_count: u32,
    /// Longest time sent data may stay unacknowledged (`TCP_USER_TIMEOUT`).
    /// Default: `10s`.
    pub user_timeout: Duration,
}

impl Default for TcpTimeouts {
    fn default() -> Self {
        TcpTimeouts {
            keepalive_idle: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(2),
            keepalive_count: 3,
            user_timeout: Duration::from_secs(10),
        }
    }
}

impl TcpTimeouts {
    /// The timeouts an elector of this `ttl` sets on a connection of its
    /// own: the server can declare a silent client gone no sooner than the
    /// TTL (`TCP_USER_TIMEOUT` = `ttl`, keepalives ending after it), which
    /// the safety inequalities need. Give them to a [`SharedConnection`]
    /// whose candidates use this TTL; [`TcpTimeouts::default`] (10 s) suits
    /// TTLs up to about 12 s only.
    ///
    /// [`SharedConnection`]: crate::SharedConnection
    ///
    /// ```
    /// use std::time::Duration;
    /// use pgelect::{ConnectOptions, Elector, SharedConnection, TcpTimeouts};
    /// # fn main() -> pgelect::Result<()> {
    /// let options = ConnectOptions::from_url("postgres://app@db/app")?;
    /// let ttl = Duration::from_secs(15);
    /// let shared = SharedConnection::new(&options, TcpTimeouts::for_ttl(ttl));
    /// let elector = Elector::builder(options, "shard-1")
    ///     .ttl(ttl)
    ///     .shared_connection(&shared)
    ///     .build()?;
    /// # drop(elector);
    /// # Ok(()) }
    /// ```
    pub fn for_ttl(ttl: Duration) -> TcpTimeouts {
        crate::election::default_tcp_for(ttl)
    }

    /// The longest time either end can take to declare a silent peer gone:
    /// the larger of the keepalive path and the user timeout.
    pub fn detection_bound(&self) -> Duration {
        let keepalive = self.keepalive_idle + self.keepalive_interval * self.keepalive_count;
        keepalive.max(self.user_timeout)
    }

    /// Applies the client-side half to a driver configuration.
    pub(crate) fn apply_client(&self, config: &mut Config) {
        config
            .keepalives(true)
            .keepalives_idle(self.keepalive_idle)
            .keepalives_interval(self.keepalive_interval)
            .keepalives_retries(self.keepalive_count)
            .tcp_user_timeout(self.user_timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared connection's batched statements join pg_locks and
    /// pg_stat_activity; past the JIT thresholds the server spent about a
    /// second compiling each (see `lock_session_settings`).
    #[test]
    fn lock_connections_switch_jit_off() {
        let settings = lock_session_settings(&TcpTimeouts::default());
        assert!(
            settings.iter().any(|(n, v)| *n == "jit" && v == "off"),
            "{settings:?}"
        );
    }
}
