//! The connections pgelect owns and never returns to a pool, each driven
//! by a background task that reads the socket all the time, so that the
//! server's goodbye (a terminated backend, a restart) is noticed within
//! milliseconds with no query in flight; the task also forwards `LISTEN`
//! notifications. And the session settings they start with.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use futures_util::future::poll_fn;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{AsyncMessage, Client, Row, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

use super::cancel::{cancel_target, CancelTarget, Canceller};
use super::connect::TlsConnection;
use super::options::ConnectOptions;
use super::tcp::TcpTimeouts;
use crate::error::{Error, Result};
use crate::loss::{LossReason, LossSignal};

impl ConnectOptions {
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
    ///
    /// Its parameterised statements get generic plans
    /// ([`GENERIC_PLANS`]): a statement kept with
    /// [`DedicatedConnection::keep_statement`] is then planned once.
    pub(crate) async fn connect_for_locks(
        &self,
        purpose: &str,
        tcp: &TcpTimeouts,
    ) -> Result<DedicatedConnection> {
        let mut settings = lock_session_settings(tcp);
        settings.push((GENERIC_PLANS.0, GENERIC_PLANS.1.to_owned()));
        self.connect_with(purpose, Some(tcp), &settings, NOTICES)
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
            let (client, connection, reached) = self.open_reaching(config.clone()).await?;
            let conn = DedicatedConnection::drive(
                client,
                connection,
                self.tls.connector()?,
                cancel_target(&reached),
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

/// A `LISTEN` notification received on a dedicated connection.
#[derive(Clone, Debug)]
pub(crate) struct Notice {
    pub(crate) channel: String,
    pub(crate) payload: String,
}

/// A connection pgelect owns, with its driver task.
///
/// `closed()` is cancelled the moment the driver task sees the connection end
/// (server FATAL, EOF, reset) or the owner kills it; `signal()` records that
/// moment as a [`LossReason::ConnectionLost`] first (a lock session's loss).
pub(crate) struct DedicatedConnection {
    client: Client,
    closed: LossSignal,
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
    /// Statements prepared once on this connection, by their text
    /// ([`DedicatedConnection::keep_statement`]).
    kept: Mutex<HashMap<String, Statement>>,
}

/// The session setting that makes the server plan a prepared statement
/// once, for any parameters, and keep that plan (PostgreSQL 12+). By
/// default it plans the first five runs for their parameters and keeps
/// doing so while those plans look cheaper, which they do for the
/// election's and the renewal's one-row arrays: 2 to 3 ms of a 2-core
/// machine's time at every run, against 0.5 ms with the kept plan
/// (measured with `EXPLAIN ANALYZE` and `PREPARE`; the book's design notes,
/// "Statements the server plans once"). Set on lock connections, whose
/// statements are all pgelect's own; not on a shared connection, whose
/// batches of thousands of rows are planned for their size.
pub(crate) const GENERIC_PLANS: (&str, &str) = ("plan_cache_mode", "force_generic_plan");

/// How many notifications a connection keeps for a receiver that has not
/// read them yet; one that falls further behind is told it lagged.
const NOTICES: usize = 256;

impl DedicatedConnection {
    fn drive(
        client: Client,
        mut connection: TlsConnection,
        tls: MakeRustlsConnect,
        cancel_target: Option<CancelTarget>,
        notices: usize,
    ) -> DedicatedConnection {
        crate::server::note_version(connection.parameter("server_version"));
        let closed = LossSignal::new();
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
            done.end(LossReason::ConnectionLost);
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
            kept: Mutex::default(),
        }
    }

    /// Prepares `sql` (its parameters of `types`) on this connection once
    /// and keeps it: [`query_kept`](Self::query_kept) then runs it without
    /// the server parsing it again, and on a lock connection
    /// ([`GENERIC_PLANS`]) without planning it after its first run.
    pub(crate) async fn keep_statement(
        &self,
        sql: &str,
        types: &[Type],
    ) -> std::result::Result<(), tokio_postgres::Error> {
        if self.kept_statement(sql).is_some() {
            return Ok(());
        }
        let statement = self.client.prepare_typed(sql, types).await?;
        self.kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sql.to_owned(), statement);
        Ok(())
    }

    fn kept_statement(&self, sql: &str) -> Option<Statement> {
        self.kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(sql)
            .cloned()
    }

    /// Runs `sql` with `params`: the statement kept for that text if there
    /// is one, otherwise an unnamed one, with the same rows either way. The
    /// request is sent when the future is first polled, so it can be
    /// pipelined with others.
    pub(crate) async fn query_kept(
        &self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> std::result::Result<Vec<Row>, tokio_postgres::Error> {
        match self.kept_statement(sql) {
            Some(statement) => {
                let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
                self.client.query(&statement, &values).await
            }
            None => self.client.query_typed(sql, params).await,
        }
    }

    /// [`query_kept`](Self::query_kept) for a statement that returns
    /// exactly one row (an error otherwise).
    pub(crate) async fn query_kept_one(
        &self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> std::result::Result<Row, tokio_postgres::Error> {
        match self.kept_statement(sql) {
            Some(statement) => {
                let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
                self.client.query_one(&statement, &values).await
            }
            None => self.client.query_typed_one(sql, params).await,
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
        self.closed.raw_token()
    }

    /// The connection's end as a loss ([`LossReason::ConnectionLost`], and
    /// when): what a lock session and its guards report.
    pub(crate) fn signal(&self) -> &LossSignal {
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
        self.closed.is_lost() || self.client.is_closed()
    }

    /// A receiver of `LISTEN` notifications from now on.
    pub(crate) fn notices(&self) -> broadcast::Receiver<Notice> {
        self.notices.subscribe()
    }

    /// Drops the socket at once (the server sees the client vanish and
    /// releases its session locks). Used after a heartbeat timed out.
    pub(crate) fn kill(&self) {
        self.task.abort();
        self.closed.end(LossReason::ConnectionLost);
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
                "SELECT set_config(v.name, v.value, false)
                   FROM unnest($1::text[], $2::text[]) AS v(name, value)
                  WHERE current_setting(v.name, true) IS NOT NULL",
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
/// One round trip, however many settings. Known names are found with
/// `current_setting(name, true)` (NULL for an unknown one), not by joining
/// the `pg_settings` view, which builds a row for each of the server's
/// ~350 settings: 2.7 ms of a fresh backend's time on the project's
/// machine, against about 0.1 ms.
const START_SESSION_SQL: &str = "\
SELECT pg_backend_pid(), host(inet_server_addr()), inet_server_port(),
       (SELECT count(set_config(v.name, v.value, false))
          FROM unnest($1::text[], $2::text[]) AS v(name, value)
         WHERE current_setting(v.name, true) IS NOT NULL)";

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
