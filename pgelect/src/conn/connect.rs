//! Establishing a connection from [`ConnectOptions`]: TLS tried and
//! retried as libpq does, the whole attempt bounded, and run off the
//! runtime's workers; plain connections for tools.

use std::fmt;
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::config::SslMode as DriverSsl;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{AsyncMessage, Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::options::ConnectOptions;
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

    /// Connects with `config`, bounding the whole attempt (TCP connect and
    /// startup): the driver's `connect_timeout` covers the TCP connect
    /// only, so a server that accepts and never answers is caught by the
    /// outer bound.
    ///
    /// TLS follows libpq: `allow` tries plain text and then TLS if the
    /// server refused; `prefer` tries TLS and then plain text if the
    /// handshake or the server refused; the other modes try once. Unix
    /// sockets never use TLS (the server does not offer it there).
    pub(super) async fn open(&self, mut config: Config) -> Result<(Client, TlsConnection)> {
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
