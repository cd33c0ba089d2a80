//! The one error type of the crate.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::error::{DbError, SqlState};

use crate::election::ConfigError;

/// SQLSTATE raised by `pgelect.fence` when the term is not the current one.
pub const SQLSTATE_STALE_TERM: &str = "PE001";
/// SQLSTATE raised by `pgelect.fence` when the role has no leader row or no holder.
pub const SQLSTATE_NO_LEADER: &str = "PE002";

/// Everything that can go wrong in pgelect.
///
/// Messages are lower-case, name what went wrong and, where it is known, what
/// to do. No variant ever carries a connection password: connection targets
/// are rendered as `host:port/database user=NAME`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value or argument is out of range or malformed:
    /// [`ConfigError`] names the rule broken and the values.
    #[error("invalid configuration: {0}")]
    Config(ConfigError),

    /// A name (lock name, role, node id, schema) is empty, too long, or has a
    /// forbidden character.
    #[error("invalid {what} {shown}: {reason}")]
    InvalidName {
        /// What kind of name: "lock name", "role", "node id", "schema".
        what: &'static str,
        /// The name, shortened and escaped for display.
        shown: String,
        /// Why it is refused.
        reason: String,
    },

    /// The server could not be reached or refused the connection.
    #[error("could not connect to {target}: {}; {}", driver_text(.source), connect_hint(.source))]
    Connect {
        /// `host:port/database user=NAME`, never the password.
        target: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// The connection attempt did not finish in time.
    #[error("could not connect to {target} within {}: the server does not answer; check the host, port and firewall", rounded(*.timeout))]
    ConnectTimeout {
        /// `host:port/database user=NAME`, never the password.
        target: String,
        /// The bound that passed.
        timeout: Duration,
        /// The driver's error when it gave up itself (its own connect
        /// timeout); `None` when pgelect's bound around the whole attempt
        /// (TCP connect and startup) ran out first.
        #[source]
        source: Option<tokio_postgres::Error>,
    },

    /// TLS could not be set up, or the server's certificate was refused,
    /// or the server wants TLS the connection did not offer: `reason` says
    /// which and what to change (`sslmode`, `sslrootcert`, the host name).
    /// Not retried: it is configuration, on one side or the other.
    #[error("TLS with {target} failed: {reason}")]
    Tls {
        /// `host:port/database user=NAME`.
        target: String,
        /// What went wrong and what to do.
        reason: String,
        /// The driver's error, where there is one.
        #[source]
        source: Option<tokio_postgres::Error>,
    },
    /// The server rejected the credentials.
    #[error("authentication failed for {target}: {}; {}", driver_text(.source), auth_hint(.source))]
    Auth {
        /// `host:port/database user=NAME`, never the password.
        target: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// The pgelect schema is not installed in this database.
    #[error("schema \"{schema}\" of pgelect is not installed in this database: run `pgelect migrate` (or `pgelect::migrate`) first")]
    SchemaMissing {
        /// The schema looked for.
        schema: String,
    },

    /// The installed schema is older or newer than this library.
    #[error(
        "schema \"{schema}\" is at version {found}, this pgelect needs version {expected}: {hint}"
    )]
    SchemaVersion {
        /// The schema looked at.
        schema: String,
        /// The version found in the database.
        found: i32,
        /// The version this library was built for.
        expected: i32,
        /// What to do.
        hint: &'static str,
    },

    /// The database user lacks a privilege the operation needs.
    #[error("permission denied while trying to {operation}: {}; grant the role the needed privileges (see the book's privileges chapter, docs/src/operations/privileges.md, or `pgelect grants`)", driver_text(.source))]
    Permission {
        /// What pgelect was doing.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// A bounded wait for a lock ran out.
    #[error("timed out after {} waiting for lock {key}{}", rounded(*.waited), holders_suffix(.holders))]
    LockTimeout {
        /// The lock, as `LockKey`'s display form.
        key: String,
        /// How long pgelect waited.
        waited: Duration,
        /// Who held the lock when the wait ran out, where pgelect looked
        /// (session locks); empty when it did not look or saw nobody.
        holders: Vec<crate::lock::LockHolder>,
    },

    /// `migrate` waited its bound for the migration lock, which another
    /// session holds.
    #[error(
        "timed out after {} waiting for the migration lock of schema \"{schema}\": {}; another `pgelect migrate` may be running, or another database user took the key (advisory locks are database-wide): end that session with pg_terminate_backend(pid), or give pgelect a database of its own (see the book's security chapter, docs/src/security.md)",
        rounded(*.waited), crate::lock::holders::describe(.holders)
    )]
    MigrationLockTimeout {
        /// The schema being migrated.
        schema: String,
        /// How long pgelect waited.
        waited: Duration,
        /// Who held the migration lock when the wait ran out.
        holders: Vec<crate::lock::LockHolder>,
    },

    /// The same lock key is already held through this connection, and taking it
    /// again would stack the lock silently.
    #[error("lock {key} is already held through this connection; release it first or use another connection")]
    AlreadyHeld {
        /// The lock, as `LockKey`'s display form.
        key: String,
    },

    /// A fenced statement ran with a term that is no longer the current one.
    #[error("stale fencing term for role {role}: {message}")]
    StaleTerm {
        /// The role whose fence refused.
        role: String,
        /// The server's message (names the stale and the current term).
        message: String,
    },

    /// A fence found no leader for the role: no row, or the term was
    /// released and nobody holds it (SQLSTATE `PE002`).
    #[error("no leader for role {role:?}: {message}")]
    NoLeader {
        /// The role whose fence refused, as the caller named it.
        role: String,
        /// The server's message.
        message: String,
    },

    /// The leadership a fence or an operation relied on has already ended.
    #[error(
        "leadership of role {role:?} (term {term}) has ended ({reason}); stop acting as leader"
    )]
    LeadershipLost {
        /// The role.
        role: String,
        /// The term that ended.
        term: i64,
        /// Why it ended.
        reason: crate::loss::LossReason,
    },

    /// A dedicated connection was lost (terminated, reset, timed out).
    #[error("connection lost while trying to {operation}{}", cause_suffix(.source.as_deref()))]
    ConnectionLost {
        /// What pgelect was doing.
        operation: &'static str,
        /// What ended the connection, where pgelect saw it: the driver's
        /// error for the statement that found it closed, or the error the
        /// connection itself ended with (the server's `FATAL`, an I/O
        /// error). `None` when the end was noticed otherwise: a statement
        /// that did not answer within its bound, or a runtime shutting down.
        /// Shared (`Arc`) because every lock and handle on one connection
        /// reports the same end.
        #[source]
        source: Option<Arc<tokio_postgres::Error>>,
    },

    /// A statement failed.
    #[error("database error while trying to {operation}: {}", driver_text(.source))]
    Database {
        /// What pgelect was doing.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// A statement on the caller's sqlx connection failed.
    #[cfg(feature = "sqlx")]
    #[error("database error while trying to {operation}: {source}")]
    Sqlx {
        /// What pgelect was doing.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// The connection goes through a pooler in transaction mode, where session
    /// state (advisory locks, LISTEN) does not stay on one server backend.
    #[error("{0}")]
    Pooler(String),

    /// An operator's call ([`admin`](crate::admin)) named a role that nobody
    /// leads, stands for or has led in this schema.
    #[error("no role {role:?} in schema {schema}: nobody leads, stands for or has led it; {}", known_roles(.known))]
    UnknownRole {
        /// The role asked for.
        role: String,
        /// The schema looked in.
        schema: String,
        /// The roles the schema knows, sorted.
        known: Vec<String>,
    },
}

/// `known roles: "a", "b"`, or why there are none.
fn known_roles(known: &[String]) -> String {
    if known.is_empty() {
        return "there are no roles yet (a role appears when a candidate first stands for it)"
            .to_owned();
    }
    let list: Vec<String> = known.iter().map(|r| format!("{r:?}")).collect();
    format!("known roles: {}", list.join(", "))
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// True when an operator's call named a role the schema does not know
    /// ([`Error::UnknownRole`]).
    pub fn is_unknown_role(&self) -> bool {
        matches!(self, Error::UnknownRole { .. })
    }

    /// True for a bounded wait that ran out (lock timeout, connect timeout).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Error::LockTimeout { .. }
                | Error::MigrationLockTimeout { .. }
                | Error::ConnectTimeout { .. }
        )
    }

    /// True when the cause is a lost or unreachable connection: retrying later
    /// on a new connection may succeed.
    pub fn is_connection(&self) -> bool {
        match self {
            Error::Connect { .. } | Error::ConnectTimeout { .. } | Error::ConnectionLost { .. } => {
                true
            }
            // Closed, or an I/O failure underneath (reading, writing,
            // parsing the stream). Not a row that does not decode, a bad
            // column or parameter: those are bugs or schema drift, and a
            // new connection would fail alike.
            Error::Database { source, .. } => source.is_closed() || has_io_error(source),
            _ => false,
        }
    }

    /// True when the server refused the login (SQLSTATE class 28: wrong
    /// password, no such user, no `pg_hba.conf` entry): retrying will not
    /// help.
    pub fn is_auth(&self) -> bool {
        matches!(self, Error::Auth { .. })
    }

    /// True when the database user lacks a privilege
    /// ([`Error::Permission`]).
    pub fn is_permission(&self) -> bool {
        matches!(self, Error::Permission { .. })
    }

    /// True when pgelect's schema is missing or at another version: run
    /// `pgelect migrate` (or upgrade pgelect).
    pub fn is_schema(&self) -> bool {
        matches!(
            self,
            Error::SchemaMissing { .. } | Error::SchemaVersion { .. }
        )
    }

    /// True for a refused configuration: a value out of range, a malformed
    /// name or URL, a connection through a transaction-mode pooler where a
    /// session is needed, TLS that cannot be set up ([`Error::Tls`]).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            Error::Config(_) | Error::InvalidName { .. } | Error::Pooler(_) | Error::Tls { .. }
        )
    }

    /// True when a fence refused a stale term.
    pub fn is_stale_term(&self) -> bool {
        matches!(self, Error::StaleTerm { .. })
    }

    /// True when a fence refused because this process knows its leadership
    /// ended ([`Error::LeadershipLost`]), the server found the term stale
    /// ([`Error::StaleTerm`]) or the role has no leader now
    /// ([`Error::NoLeader`]): in every case, stop acting as leader.
    pub fn is_leadership_lost(&self) -> bool {
        matches!(
            self,
            Error::StaleTerm { .. } | Error::NoLeader { .. } | Error::LeadershipLost { .. }
        )
    }

    /// The SQLSTATE of the server's error, where there is one.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Auth { source, .. }
            | Error::Permission { source, .. }
            | Error::Connect { source, .. }
            | Error::Database { source, .. } => source.code().map(SqlState::code),
            Error::ConnectTimeout { source, .. } => source
                .as_ref()
                .and_then(tokio_postgres::Error::code)
                .map(SqlState::code),
            Error::ConnectionLost { source, .. } => source
                .as_deref()
                .and_then(tokio_postgres::Error::code)
                .map(SqlState::code),
            Error::StaleTerm { .. } => Some(SQLSTATE_STALE_TERM),
            Error::NoLeader { .. } => Some(SQLSTATE_NO_LEADER),
            _ => None,
        }
    }

    /// Classifies a driver error raised by a statement of `operation` on
    /// pgelect's tables in `schema`: a closed connection becomes
    /// [`Error::ConnectionLost`] (the driver's error kept as its source), a
    /// missing privilege [`Error::Permission`], a missing table or function
    /// *of that schema* [`Error::SchemaMissing`], anything else
    /// [`Error::Database`]. Decided by SQLSTATE and the driver's own
    /// predicates, never by message text (the one exception: whether the
    /// missing object is in `schema`, which the server names only in its
    /// message; without that mention it stays a [`Error::Database`]).
    ///
    /// This is the classifier pgelect uses for its own statements; tools
    /// that run statements on pgelect's tables themselves (the `pgelect`
    /// command) use it too, so that both report alike.
    ///
    /// ```
    /// // A row-type mismatch (`Row::try_get`) is a plain database error.
    /// # fn f(e: tokio_postgres::Error) {
    /// let e = pgelect::Error::from_driver("read the leaders table", "pgelect", e);
    /// # }
    /// ```
    pub fn from_driver(
        operation: &'static str,
        schema: &str,
        source: tokio_postgres::Error,
    ) -> Error {
        if source.is_closed() {
            return Error::connection_lost_by(operation, Some(Arc::new(source)));
        }
        match source.code() {
            Some(c) if *c == SqlState::INSUFFICIENT_PRIVILEGE => {
                Error::Permission { operation, source }
            }
            Some(c)
                if *c == SqlState::UNDEFINED_TABLE
                    || *c == SqlState::INVALID_SCHEMA_NAME
                    || *c == SqlState::UNDEFINED_FUNCTION =>
            {
                let mentions = source
                    .as_db_error()
                    .map(|d| d.message().contains(schema))
                    .unwrap_or(false);
                if mentions {
                    Error::SchemaMissing {
                        schema: schema.to_owned(),
                    }
                } else {
                    Error::Database { operation, source }
                }
            }
            _ => Error::Database { operation, source },
        }
    }

    /// [`Error::from_driver`], under the name the crate's code uses.
    pub(crate) fn db(
        operation: &'static str,
        schema: &str,
        source: tokio_postgres::Error,
    ) -> Error {
        Error::from_driver(operation, schema, source)
    }

    /// Classifies the error of a connection attempt to `target` (from
    /// [`ConnectOptions::target`](crate::ConnectOptions::target)) whose
    /// bound was `timeout`: a refused login (SQLSTATE class 28) is
    /// [`Error::Auth`], the driver's own connect timeout (an I/O error of
    /// kind `TimedOut` in its source chain) [`Error::ConnectTimeout`],
    /// anything else [`Error::Connect`].
    pub fn from_connect(target: String, timeout: Duration, source: tokio_postgres::Error) -> Error {
        if source.code().is_some_and(|c| c.code().starts_with("28")) {
            return Error::Auth { target, source };
        }
        if io_kind_in_chain(&source, std::io::ErrorKind::TimedOut) {
            return Error::ConnectTimeout {
                target,
                timeout,
                source: Some(source),
            };
        }
        Error::Connect { target, source }
    }

    /// A lost connection whose cause pgelect did not see.
    pub(crate) fn connection_lost(operation: &'static str) -> Error {
        Error::ConnectionLost {
            operation,
            source: None,
        }
    }

    /// A lost connection, with what ended it where known (see
    /// [`Error::ConnectionLost`]).
    pub(crate) fn connection_lost_by(
        operation: &'static str,
        source: Option<Arc<tokio_postgres::Error>>,
    ) -> Error {
        Error::ConnectionLost { operation, source }
    }

    /// Classifies the error of a `fence(role, term)` statement: the fence's
    /// own SQLSTATEs become [`Error::StaleTerm`] and [`Error::NoLeader`] for
    /// `role` (the caller's, never parsed back out of the message);
    /// anything else as [`Error::db`].
    pub(crate) fn fence(role: &str, schema: &str, source: tokio_postgres::Error) -> Error {
        let fence_refusal = source
            .as_db_error()
            .map(|d| (d.code().code(), d.message().to_owned()));
        match fence_refusal {
            Some((SQLSTATE_STALE_TERM, message)) => Error::StaleTerm {
                role: role.to_owned(),
                message,
            },
            Some((SQLSTATE_NO_LEADER, message)) => Error::NoLeader {
                role: role.to_owned(),
                message,
            },
            _ => Error::db("fence a transaction", schema, source),
        }
    }

    /// The same for a refusal read from another driver: the SQLSTATE and
    /// message of the server's error, if it was one.
    #[cfg(feature = "sqlx")]
    pub(crate) fn fence_refusal(role: &str, code: Option<&str>, message: &str) -> Option<Error> {
        match code? {
            SQLSTATE_STALE_TERM => Some(Error::StaleTerm {
                role: role.to_owned(),
                message: message.to_owned(),
            }),
            SQLSTATE_NO_LEADER => Some(Error::NoLeader {
                role: role.to_owned(),
                message: message.to_owned(),
            }),
            _ => None,
        }
    }

    /// A refused value outside the elector's configuration (connection
    /// URL, TLS, lock, semaphore or partition arguments):
    /// [`ConfigError::Invalid`].
    pub(crate) fn config(msg: impl Into<String>) -> Error {
        Error::Config(ConfigError::Invalid(msg.into()))
    }

    /// The configuration error, if this is one ([`Error::Config`]).
    pub fn config_error(&self) -> Option<&ConfigError> {
        match self {
            Error::Config(c) => Some(c),
            _ => None,
        }
    }

    /// A copy of an error that carries no driver error (a driver error
    /// cannot be copied): the schema's state, a configuration or name
    /// refused, a pooler found. `None` for the others.
    pub(crate) fn copied(&self) -> Option<Error> {
        Some(match self {
            Error::Config(c) => Error::Config(c.clone()),
            Error::Pooler(m) => Error::Pooler(m.clone()),
            Error::InvalidName {
                what,
                shown,
                reason,
            } => Error::InvalidName {
                what,
                shown: shown.clone(),
                reason: reason.clone(),
            },
            Error::SchemaMissing { schema } => Error::SchemaMissing {
                schema: schema.clone(),
            },
            Error::SchemaVersion {
                schema,
                found,
                expected,
                hint,
            } => Error::SchemaVersion {
                schema: schema.clone(),
                found: *found,
                expected: *expected,
                hint,
            },
            _ => return None,
        })
    }
}

/// True when an I/O error is somewhere in `e`'s source chain.
fn has_io_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut link = Some(e);
    while let Some(l) = link {
        if l.is::<std::io::Error>() {
            return true;
        }
        link = l.source();
    }
    false
}

/// True when an I/O error of `kind` is somewhere in `e`'s source chain.
fn io_kind_in_chain(e: &(dyn std::error::Error + 'static), kind: std::io::ErrorKind) -> bool {
    let mut link = Some(e);
    while let Some(l) = link {
        if l.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == kind)
        {
            return true;
        }
        link = l.source();
    }
    false
}

/// The server's error as a person should read it: `ERROR: message`, then
/// `DETAIL: …` and `HINT: …` where the server gave them, on one line.
pub(crate) fn server_text(db: &DbError) -> String {
    let mut out = format!("{}: {}", db.severity(), db.message());
    if let Some(detail) = db.detail() {
        out.push_str(&format!(" (DETAIL: {detail})"));
    }
    if let Some(hint) = db.hint() {
        out.push_str(&format!(" (HINT: {hint})"));
    }
    out
}

/// A driver error as a person should read it: the server's words alone
/// when the server answered (without the driver's bare "db error"),
/// otherwise the driver's text followed by its causes ("error connecting
/// to server: Connection refused (os error 111)").
pub(crate) fn driver_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return server_text(db);
    }
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// What to check after a refused login: the client certificate when the
/// server asked for one, else the credentials.
fn auth_hint(e: &tokio_postgres::Error) -> &'static str {
    match e.as_db_error() {
        Some(d) if d.message().contains("certificate") => {
            "give the client certificate the server expects (sslcert and sslkey, with sslmode=require or stronger)"
        }
        _ => "check the user name and password",
    }
}

/// What to check after a failed connection, by what the failure was.
fn connect_hint(e: &tokio_postgres::Error) -> &'static str {
    match e.code().map(SqlState::code) {
        Some("3D000") => "check the database name",
        Some(c) if c.starts_with("28") => "check the user name and password",
        Some(_) => "see the server's message",
        // The driver's refusal of a server that accepts no writes under
        // target_session_attrs=read-write.
        None if io_kind_in_chain(e, std::io::ErrorKind::PermissionDenied) => {
            "it is a standby or read-only and target_session_attrs asks for a primary: during a failover one appears when the HA manager promotes a standby; otherwise list the primary's host in the URL"
        }
        None => "check that PostgreSQL is running there and that the URL is right",
    }
}

fn cause_suffix(cause: Option<&tokio_postgres::Error>) -> String {
    match cause {
        // A statement on a closed connection says only "connection closed":
        // nothing to add to "connection lost".
        Some(e) if e.is_closed() => String::new(),
        Some(e) => format!(": {}", driver_text(e)),
        None => String::new(),
    }
}

/// A duration for a message, rounded: `250ms`, `1.0s`, `30s`.
pub(crate) fn rounded(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 10_000 {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        format!("{}s", d.as_secs_f64().round() as u64)
    }
}

fn holders_suffix(holders: &[crate::lock::LockHolder]) -> String {
    if holders.is_empty() {
        String::new()
    } else {
        format!(": {}", crate::lock::holders::describe(holders))
    }
}

/// Renders a name for an error message: escaped, and cut to 64 characters.
pub(crate) fn shown(name: &str) -> String {
    let mut out: String = name.chars().take(64).collect::<String>();
    if out.len() < name.len() {
        out.push('…');
    }
    format!("{out:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_rounded_for_people() {
        assert_eq!(rounded(Duration::from_micros(250_400)), "250ms");
        assert_eq!(rounded(Duration::from_nanos(1_003_140_012)), "1.0s");
        assert_eq!(rounded(Duration::from_millis(30_004)), "30s");
    }

    /// A connect failure keeps its cause in the text (the driver alone says
    /// only "error connecting to server"), and its hint fits the cause.
    #[tokio::test]
    async fn a_refused_connection_names_its_cause() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let config = format!("host=127.0.0.1 port={port} user=u connect_timeout=5");
        let Err(e) = tokio_postgres::connect(&config, tokio_postgres::NoTls).await else {
            panic!("connected to a closed port");
        };
        let text = driver_text(&e);
        assert!(text.starts_with("error connecting to server: "), "{text}");
        assert!(text.len() > "error connecting to server: ".len(), "{text}");
        let e = Error::from_connect("127.0.0.1 user=u".into(), Duration::from_secs(5), e);
        assert!(
            matches!(e, Error::Connect { .. }) && e.is_connection(),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .ends_with("check that PostgreSQL is running there and that the URL is right"),
            "{e}"
        );
    }

    #[test]
    fn shown_cuts_and_escapes() {
        assert_eq!(shown("a\0b"), "\"a\\0b\"");
        let long = "x".repeat(200);
        let s = shown(&long);
        assert!(s.chars().count() < 70, "{s}");
        assert!(s.contains('…'));
    }
}
