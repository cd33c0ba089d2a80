//! [`AdminClient`]: one connection for an operator's tool, and every call
//! it makes about pgelect's tables.

use std::fmt;

use futures_util::future::poll_fn;
use tokio::sync::watch;
use tokio_postgres::types::Type;
use tokio_postgres::{AsyncMessage, Client};

use super::forget::ForgetOutcome;
use super::locks::HeldLock;
use super::status::{RoleStatus, ServerInfo, Status, FORGOTTEN};
use crate::conn::ConnectOptions;
use crate::election::{LeaderInfo, Term, LEADER_CHANNEL};
use crate::error::{Error, Result};
use crate::schema::SchemaName;

/// The `application_name` of an [`AdminClient`]'s connection.
const APPLICATION_NAME: &str = "pgelect:admin";

/// A connection for operators' tools (`pgelect status`, `resign`,
/// `forget`): reads the state of every role as typed rows, forgets roles,
/// asks leaders to resign, and wakes on every change of leader.
///
/// The connection is a plain one, not a candidate's: it holds no lock and
/// takes no part in any election. The server's idle timeouts
/// (`idle_session_timeout`, `idle_in_transaction_session_timeout`) are
/// turned off for it, since a tool that watches sits idle between
/// changes. It listens on [`LEADER_CHANNEL`] from the start, so that
/// [`changed`](AdminClient::changed) misses no change made after
/// [`connect`](AdminClient::connect) returned.
///
/// The privileges each call needs are in the book's privileges chapter:
/// [`status`](AdminClient::status) those of a watcher
/// ([`UserKind::Watcher`](super::UserKind::Watcher)),
/// [`request_resign`](AdminClient::request_resign) and
/// [`lease_row`](AdminClient::lease_row) an operator's,
/// [`forget`](AdminClient::forget) the schema owner's.
///
/// ```no_run
/// # async fn f() -> pgelect::Result<()> {
/// let options = pgelect::ConnectOptions::from_url("postgres://ops@db/app")?;
/// let admin = pgelect::admin::AdminClient::connect(&options).await?;
/// for role in admin.status().await?.roles {
///     println!("{} led by {:?} in term {}", role.role, role.holder, role.term);
/// }
/// # Ok(()) }
/// ```
pub struct AdminClient {
    client: Client,
    schema: SchemaName,
    /// Counts the notifications on [`LEADER_CHANNEL`]; closed when the
    /// connection ends.
    changes: watch::Receiver<u64>,
}

impl AdminClient {
    /// Connects, bounded by the connect timeout of `options`.
    ///
    /// Failures are those of every pgelect connection: [`Error::Auth`],
    /// [`Error::ConnectTimeout`] (no answer within the timeout, as from a
    /// server that accepts and never answers), [`Error::Tls`] or
    /// [`Error::Connect`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-open connection.
    pub async fn connect(options: &ConnectOptions) -> Result<AdminClient> {
        let (client, mut connection) = options.connect_plain(APPLICATION_NAME).await?;
        let (tx, changes) = watch::channel(0u64);
        tokio::spawn(async move {
            while let Some(message) = poll_fn(|cx| connection.poll_message(cx)).await {
                match message {
                    Ok(AsyncMessage::Notification(n)) if n.channel() == LEADER_CHANNEL => {
                        tx.send_modify(|n| *n = n.wrapping_add(1));
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        let schema = options.schema_name().clone();
        // Names the server does not know are skipped (PostgreSQL 13 has no
        // idle_session_timeout).
        client
            .batch_execute(&format!(
                "SELECT count(set_config(n, '0', false))
                   FROM unnest(ARRAY['idle_session_timeout', 'idle_in_transaction_session_timeout']) AS n
                  WHERE current_setting(n, true) IS NOT NULL;
                 LISTEN {LEADER_CHANNEL}"
            ))
            .await
            .map_err(|e| Error::db("configure the session", schema.as_str(), e))?;
        Ok(AdminClient {
            client,
            schema,
            changes,
        })
    }

    /// The connection, for statements of the tool's own (a drill's fenced
    /// write, a check of its own).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The connection alone, for a tool that needs it mutably (its own
    /// transactions); it stays open while the returned client lives.
    pub fn into_client(self) -> Client {
        self.client
    }

    /// The schema these calls read.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// The server, every role and the locks of named lock sessions, read
    /// one after the other.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn status(&self) -> Result<Status> {
        Ok(Status {
            roles: self.roles().await?,
            locks: self.held_locks().await?,
            server: self.server().await?,
        })
    }

    /// Every role the schema knows: those with a lease row (but for the
    /// forgotten ones), and those whose lock a backend claiming to stand
    /// for it holds or waits for. By name.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn roles(&self) -> Result<Vec<RoleStatus>> {
        super::status::roles(&self.client, &self.schema, None).await
    }

    /// One role. Fails with [`Error::UnknownRole`] (naming the roles that
    /// exist) for a role nobody leads, stands for or has led, and with
    /// [`Error::InvalidName`] for a name no role can have.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn role(&self, role: &str) -> Result<RoleStatus> {
        crate::election::validate_name("role", role)?;
        match super::status::roles(&self.client, &self.schema, Some(role))
            .await?
            .pop()
        {
            Some(status) => Ok(status),
            None => Err(super::status::unknown_role(&self.client, &self.schema, role).await),
        }
    }

    /// Every advisory lock held or waited for by a named lock session
    /// ([`lock_session_name`](super::lock_session_name), or a library
    /// [`LockSession`](crate::LockSession) under its default name), by key.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn held_locks(&self) -> Result<Vec<HeldLock>> {
        super::locks::held_locks(&self.client).await
    }

    /// The server that answered.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn server(&self) -> Result<ServerInfo> {
        super::status::server(&self.client).await
    }

    /// The role's current leader ([`current_leader`](super::current_leader)
    /// on this connection).
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn leader(&self, role: &str) -> Result<Option<LeaderInfo>> {
        crate::election::validate_name("role", role)?;
        crate::election::read_leader(&self.client, &self.schema, role).await
    }

    /// The role's lease row alone: its last term and its holder, `None`
    /// when it has no row (or was forgotten). Needs only `SELECT` on the
    /// leaders table, as an operator has (to see the term a resign
    /// request moves).
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn lease_row(&self, role: &str) -> Result<Option<LeaseRow>> {
        crate::election::validate_name("role", role)?;
        const WHAT: &str = "read the leaders table";
        let schema = &self.schema;
        let row = self
            .client
            .query_typed_opt(
                &format!(
                    "SELECT term, holder FROM {schema}.leaders
                      WHERE role = $1 AND NOT (holder IS NULL AND coalesce(holder_meta ? $2::text, false))"
                ),
                &[(&role, Type::TEXT), (&FORGOTTEN, Type::TEXT)],
            )
            .await
            .map_err(|e| Error::db(WHAT, schema.as_str(), e))?;
        row.map(|r| {
            Ok(LeaseRow {
                term: Term::new(r.try_get(0)?),
                holder: r.try_get(1)?,
            })
        })
        .transpose()
        .map_err(|e: tokio_postgres::Error| Error::db(WHAT, schema.as_str(), e))
    }

    /// Asks the role's leader to resign
    /// ([`request_resign`](super::request_resign) on this connection):
    /// the leader that was asked, or `None` when the role has no leader.
    ///
    /// # Cancel safety
    /// Cancel safe: the request is made by one statement or not at all.
    pub async fn request_resign(&self, role: &str) -> Result<Option<LeaderInfo>> {
        crate::election::validate_name("role", role)?;
        super::leader::request_resign_on(&self.client, &self.schema, role).await
    }

    /// Forgets a role nobody holds or stands for: it is no longer listed,
    /// and its last term is kept, so that a candidate that stands for it
    /// again continues above it (terms never repeat). A role in use is
    /// left alone and the outcome says why. Fails with
    /// [`Error::UnknownRole`] for a role the schema does not know (or
    /// forgot already).
    ///
    /// Needs `SELECT` and `UPDATE` on the leaders table (the schema
    /// owner's rights, or a candidate's); naming the known roles of an
    /// unknown one needs a watcher's.
    ///
    /// # Cancel safety
    /// Cancel safe: everything happens in one transaction, rolled back if
    /// the future is dropped before its commit.
    pub async fn forget(&mut self, role: &str) -> Result<ForgetOutcome> {
        super::forget::forget(&mut self.client, &self.schema, role).await
    }

    /// Waits for the next change of leader of any role of any schema on
    /// this database (a notification on [`LEADER_CHANNEL`]), or returns at
    /// once if one came since the last call (or since
    /// [`connect`](AdminClient::connect)). Changes are not counted: read
    /// the state again after each.
    ///
    /// Fails with a connection error when the connection ended.
    ///
    /// # Cancel safety
    /// Cancel safe: a change that arrives meanwhile is kept for the next
    /// call.
    pub async fn changed(&mut self) -> Result<()> {
        self.changes
            .changed()
            .await
            .map_err(|_| Error::connection_lost("wait for a change of leader"))
    }
}

impl fmt::Debug for AdminClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminClient")
            .field("schema", &self.schema.as_str())
            .field("closed", &self.client.is_closed())
            .finish_non_exhaustive()
    }
}

/// A role's lease row, read alone ([`AdminClient::lease_row`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseRow {
    /// The role's last term.
    pub term: Term,
    /// The leader's node; `None` when nobody leads.
    pub holder: Option<String>,
}
