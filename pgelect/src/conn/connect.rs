//! Establishing a connection from [`ConnectOptions`]: TLS tried and
//! retried as libpq does, the whole attempt bounded, and run off the
//! runtime's workers; plain connections for tools.

use std::fmt;
use std::time::Duration;

use tokio_postgres::config::SslMode as DriverSsl;
use tokio_postgres::config::{Host, LoadBalanceHosts};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{AsyncMessage, Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::options::{target_of, ConnectOptions};
use super::tls::{self, SslMode};
use crate::error::{Error, Result};

/// The driver's connection over pgelect's TLS connector.
pub(super) type TlsConnection =
    Connection<Socket, <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream>;

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

impl ConnectOptions {
    /// Opens a plain connection named `application_name`, bounded by the
    /// connect timeout, for observers of pgelect's tables (the admin
    /// client, a partition group's status). The caller drives the
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
    pub(crate) async fn connect_plain(
        &self,
        application_name: &str,
    ) -> Result<(Client, PlainConnection)> {
        let mut config = self.config.clone();
        config.application_name(application_name);
        let (client, connection) = self.open(config).await?;
        Ok((client, PlainConnection { connection }))
    }

    /// Connects with `config`: to its one host, or to each host of a
    /// multi-host configuration in turn (in a random order with
    /// `load_balance_hosts=random`) until one accepts the connection and
    /// its `target_session_attrs`, as libpq does.
    ///
    /// pgelect tries the hosts itself, rather than leaving it to the
    /// driver, so that a failure names the host that failed: the driver
    /// reports the last host's error alone, and the message used to name
    /// the first host of the URL whatever happened there (a standby that
    /// answered, while the second host refused). The error returned is a
    /// refused login or a TLS failure if a host gave one (settings to fix),
    /// else the last host's; its target names that host, followed by what
    /// the other hosts answered.
    pub(super) async fn open(&self, config: Config) -> Result<(Client, TlsConnection)> {
        self.open_reaching(config)
            .await
            .map(|(client, connection, _)| (client, connection))
    }

    /// [`open`](ConnectOptions::open), also returning the one host the
    /// connection reached as a single-host configuration (every other
    /// setting kept): where a cancel request for it must go.
    pub(super) async fn open_reaching(
        &self,
        config: Config,
    ) -> Result<(Client, TlsConnection, Config)> {
        let count = config.get_hosts().len().max(config.get_hostaddrs().len());
        if count <= 1 {
            let (client, connection) = self.open_one(config.clone(), self.target()).await?;
            return Ok((client, connection, config));
        }
        let mut order: Vec<usize> = (0..count).collect();
        if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
            rand::seq::SliceRandom::shuffle(order.as_mut_slice(), &mut rand::rng());
        }
        let mut failed: Vec<(String, Error)> = Vec::with_capacity(count);
        for i in order {
            let target = target_of(&config, Some(i));
            let host = single_host(&config, i);
            match self.open_one(host.clone(), target.clone()).await {
                Ok((client, connection)) => {
                    if !failed.is_empty() {
                        tracing::debug!(host = %target, tried_before = %others(&failed, None), "connected to a later host of the URL");
                    }
                    return Ok((client, connection, host));
                }
                Err(e) => failed.push((target, e)),
            }
        }
        let pick = failed
            .iter()
            .position(|(_, e)| matches!(e, Error::Auth { .. } | Error::Tls { .. }))
            .unwrap_or(failed.len() - 1);
        let also = others(&failed, Some(pick));
        let (_, mut e) = failed.swap_remove(pick);
        if let Error::Connect { target, .. }
        | Error::ConnectTimeout { target, .. }
        | Error::Auth { target, .. }
        | Error::Tls { target, .. } = &mut e
        {
            target.push_str(&format!(" (the other hosts: {also})"));
        }
        Err(e)
    }

    /// One connection attempt at `config` (a single host), named `target`
    /// in errors, bounding the whole attempt (TCP connect and startup): the
    /// driver's `connect_timeout` covers the TCP connect only, so a server
    /// that accepts and never answers is caught by the outer bound.
    ///
    /// TLS follows libpq: `allow` tries plain text and then TLS if the
    /// server refused; `prefer` tries TLS and then plain text if the
    /// handshake or the server refused; the other modes try once. Unix
    /// sockets never use TLS (the server does not offer it there).
    async fn open_one(
        &self,
        mut config: Config,
        target: String,
    ) -> Result<(Client, TlsConnection)> {
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
                        target,
                        timeout: self.connect_timeout,
                        source: None,
                    })
                }
                Ok(Ok(pair)) => {
                    if i > 0 {
                        tracing::debug!(sslmode = %mode, target = %target, "connected on the second try, {}", if *ssl == DriverSsl::Disable { "without TLS" } else { "with TLS" });
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
            .tls_error(&e, mode, &target)
            .unwrap_or_else(|| Error::from_connect(target, self.connect_timeout, e)))
    }

    /// A failed connection explained in terms of TLS, when TLS is why.
    fn tls_error(&self, e: &tokio_postgres::Error, mode: SslMode, target: &str) -> Option<Error> {
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
            target: target.to_owned(),
            reason,
            source: None,
        })
    }
}

/// Host `i` of a multi-host `config` as a configuration of its own, every
/// other setting kept (the driver's `Config` cannot drop hosts).
fn single_host(config: &Config, i: usize) -> Config {
    let mut c = Config::new();
    if let Some(v) = config.get_user() {
        c.user(v);
    }
    if let Some(v) = config.get_password() {
        c.password(v);
    }
    if let Some(v) = config.get_dbname() {
        c.dbname(v);
    }
    if let Some(v) = config.get_options() {
        c.options(v);
    }
    if let Some(v) = config.get_application_name() {
        c.application_name(v);
    }
    c.ssl_mode(config.get_ssl_mode());
    c.ssl_negotiation(config.get_ssl_negotiation());
    match config.get_hosts().get(i) {
        Some(Host::Tcp(h)) => {
            c.host(h);
        }
        Some(Host::Unix(p)) => {
            c.host_path(p);
        }
        None => {}
    }
    if let Some(a) = config.get_hostaddrs().get(i) {
        c.hostaddr(*a);
    }
    let ports = config.get_ports();
    if let Some(p) = ports.get(i).or(ports.first()) {
        c.port(*p);
    }
    if let Some(v) = config.get_connect_timeout() {
        c.connect_timeout(*v);
    }
    if let Some(v) = config.get_tcp_user_timeout() {
        c.tcp_user_timeout(*v);
    }
    c.keepalives(config.get_keepalives());
    c.keepalives_idle(config.get_keepalives_idle());
    if let Some(v) = config.get_keepalives_interval() {
        c.keepalives_interval(v);
    }
    if let Some(v) = config.get_keepalives_retries() {
        c.keepalives_retries(v);
    }
    c.target_session_attrs(config.get_target_session_attrs());
    c.channel_binding(config.get_channel_binding());
    c.load_balance_hosts(config.get_load_balance_hosts());
    c
}

/// What the hosts in `failed` other than `except` answered, for a message:
/// `h1:5432: a standby (accepts no writes); h3:5432: connection refused`.
fn others(failed: &[(String, Error)], except: Option<usize>) -> String {
    failed
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != except)
        .map(|(_, (target, e))| {
            let host = target.split('/').next().unwrap_or(target);
            format!("{host}: {}", short_reason(e))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why one host's connection failed, in a few words.
fn short_reason(e: &Error) -> String {
    match e {
        Error::Connect { source, .. } | Error::Auth { source, .. } => {
            if crate::error::driver_text(source).contains("does not allow writes") {
                "a standby or read-only (accepts no writes)".into()
            } else {
                crate::error::driver_text(source)
            }
        }
        Error::ConnectTimeout { timeout, .. } => {
            format!("no answer within {}", crate::error::rounded(*timeout))
        }
        Error::Tls { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// The connection half of [`ConnectOptions::connect_plain`]: poll it (or
/// spawn it as a future) for the client to make progress.
#[must_use = "the client makes no progress unless the connection is polled"]
pub(crate) struct PlainConnection {
    connection: TlsConnection,
}

impl PlainConnection {
    /// The next message from the server that is not a reply to a statement
    /// (a `LISTEN` notification, a notice), or `None` when the connection
    /// has ended; see [`tokio_postgres::Connection::poll_message`].
    pub(crate) fn poll_message(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every setting of a multi-host configuration survives the split (a
    /// setting the driver adds would show in `Debug` and fail this).
    #[test]
    fn single_host_keeps_every_other_setting() {
        let text = "host=h1,/run/pg port=5433,5434 user=u password=p dbname=d options=-cx=1 \
                    application_name=app connect_timeout=3 tcp_user_timeout=4 keepalives=0 \
                    keepalives_idle=5 keepalives_interval=6 keepalives_retries=7 \
                    target_session_attrs=read-write channel_binding=require \
                    load_balance_hosts=random sslmode=require";
        let config: Config = text.parse().unwrap();
        for (i, host) in ["host=h1 port=5433", "host=/run/pg port=5434"]
            .iter()
            .enumerate()
        {
            let rest = text.replace("host=h1,/run/pg port=5433,5434", host);
            let want: Config = rest.parse().unwrap();
            assert_eq!(
                format!("{:?}", single_host(&config, i)),
                format!("{want:?}"),
                "host {i}"
            );
        }
        // hostaddr and one port for every host.
        let config: Config = "host=a,b hostaddr=127.0.0.1,127.0.0.2 port=7 user=u"
            .parse()
            .unwrap();
        let want: Config = "host=b hostaddr=127.0.0.2 port=7 user=u".parse().unwrap();
        assert_eq!(
            format!("{:?}", single_host(&config, 1)),
            format!("{want:?}")
        );
        assert_eq!(target_of(&config, Some(1)), "b:7/u user=u");
        assert_eq!(target_of(&config, None), "a:7,b:7/u user=u");
    }
}
