//! One lock connection for the polling candidates of many roles.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex};

use tokio::sync::Mutex as AsyncMutex;

use crate::conn::{ConnectOptions, DedicatedConnection, TcpTimeouts};
use crate::error::{Error, Result};
use crate::schema::check_schema;

use super::watch::{LEADER_CHANNEL, RESIGN_CHANNEL};

/// One server session shared by the session-backend candidates of many
/// roles, so that a process standing for a hundred roles holds one
/// connection, not a hundred.
///
/// Candidates on a shared connection stand in polling mode
/// ([`StandbyMode::Polling`](crate::StandbyMode::Polling)): a blocking wait
/// would occupy the session. Each role's leader still renews its own lease
/// row and keeps its own deadline; the advisory locks of all roles live in
/// the one session. The roles share the connection's fate: when it dies, or
/// a leader on it must drop it (its deadline passed, a heartbeat timed
/// out), every role led on it is lost, and the candidates stand again on a
/// new connection.
///
/// A role may have only one candidate per shared connection (advisory locks
/// are re-entrant within a session, so two would both win):
/// [`ElectorBuilder::build`](crate::ElectorBuilder::build) refuses a second
/// one while the first elector, or a leadership it handed out, lives.
///
/// ```no_run
/// # async fn example() -> pgelect::Result<()> {
/// use std::time::Duration;
/// use pgelect::{ConnectOptions, Elector, SharedConnection, TcpTimeouts};
/// let options = ConnectOptions::from_url("postgres://app@db/app")?;
/// let connection = SharedConnection::new(&options, TcpTimeouts::default());
/// let mut shards = Vec::new();
/// for shard in 0..64 {
///     let elector = Elector::builder(options.clone(), &format!("shard-{shard}"))
///         .shared_connection(&connection)
///         .build()?;
///     shards.push(tokio::spawn(async move {
///         let leadership = elector.leadership().await?;
///         leadership.lost().await;
///         Ok::<_, pgelect::Error>(())
///     }));
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SharedConnection {
    inner: Arc<Inner>,
}

struct Inner {
    options: ConnectOptions,
    tcp: TcpTimeouts,
    /// The live connection, opened on first use and again after it died.
    current: AsyncMutex<Option<Arc<DedicatedConnection>>>,
    /// Roles with a live elector on this connection.
    roles: Mutex<HashSet<String>>,
}

impl SharedConnection {
    /// A shared connection to `options`' database; it connects on first
    /// use. The TCP settings apply to both sides of the connection, and
    /// every elector on it is validated against them (the local deadline
    /// must end before the server can declare the client gone).
    pub fn new(options: &ConnectOptions, tcp: TcpTimeouts) -> SharedConnection {
        SharedConnection {
            inner: Arc::new(Inner {
                options: options.clone(),
                tcp,
                current: AsyncMutex::new(None),
                roles: Mutex::new(HashSet::new()),
            }),
        }
    }

    /// The TCP settings of the connection.
    pub fn tcp_timeouts(&self) -> TcpTimeouts {
        self.inner.tcp
    }

    /// The server process id of the current connection, if one is open.
    pub async fn backend_pid(&self) -> Option<i32> {
        let current = self.inner.current.lock().await;
        current.as_ref().filter(|c| !c.is_closed()).map(|c| c.pid())
    }

    pub(crate) fn options(&self) -> &ConnectOptions {
        &self.inner.options
    }

    /// Claims `role` for one elector; refused while another holds it.
    pub(crate) fn claim(&self, role: &str) -> Result<RoleClaim> {
        let mut roles = self.inner.roles.lock().expect("BUG: poisoned role set");
        if !roles.insert(role.to_owned()) {
            return Err(Error::config(format!(
                "role {role:?} already has a candidate on this shared connection; advisory locks are re-entrant within a session, so a second one would win too"
            )));
        }
        Ok(RoleClaim {
            inner: self.inner.clone(),
            role: role.to_owned(),
        })
    }

    /// The live connection, opened (and checked) if there is none.
    pub(crate) async fn get(&self) -> Result<Arc<DedicatedConnection>> {
        let mut current = self.inner.current.lock().await;
        if let Some(c) = current.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let conn = Arc::new(self.open().await?);
        *current = Some(conn.clone());
        Ok(conn)
    }

    async fn open(&self) -> Result<DedicatedConnection> {
        let options = &self.inner.options;
        let schema = options.schema_name();
        let s = schema.as_str();
        let conn = options.connect_for_locks("shared", &self.inner.tcp).await?;
        let prepared = async {
            check_schema(conn.client(), schema).await?;
            super::session::check_not_transaction_pooled(options, &conn).await?;
            // Both channels for the connection's whole life: leaders hear
            // resign requests, standbys hear releases. The connection never
            // blocks in a wait, so it reads its notifications.
            conn.client()
                .batch_execute(&format!("LISTEN {LEADER_CHANNEL}; LISTEN {RESIGN_CHANNEL}"))
                .await
                .map_err(|e| Error::db("listen on the shared connection", s, e))
        }
        .await;
        match prepared {
            Ok(()) => Ok(conn),
            Err(e) => {
                conn.kill();
                Err(e)
            }
        }
    }
}

impl fmt::Debug for SharedConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedConnection")
            .field("target", &self.inner.options.target())
            .field("tcp", &self.inner.tcp)
            .field(
                "roles",
                &self.inner.roles.lock().map(|r| r.len()).unwrap_or(0),
            )
            .finish()
    }
}

/// A role's place on a shared connection, given back when dropped.
pub(crate) struct RoleClaim {
    inner: Arc<Inner>,
    role: String,
}

impl RoleClaim {
    pub(crate) fn connection(&self) -> SharedConnection {
        SharedConnection {
            inner: self.inner.clone(),
        }
    }
}

impl Drop for RoleClaim {
    fn drop(&mut self) {
        if let Ok(mut roles) = self.inner.roles.lock() {
            roles.remove(&self.role);
        }
    }
}
