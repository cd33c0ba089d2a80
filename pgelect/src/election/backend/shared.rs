//! One lock connection for the polling candidates of many roles.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{watch, Mutex as AsyncMutex};
use tokio::time::Instant;

use crate::conn::{ConnectOptions, DedicatedConnection, TcpTimeouts};
use crate::error::{Error, Result};
use crate::schema::check_schema;

use crate::election::watch::{LEADER_CHANNEL, RESIGN_CHANNEL};

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
    current: AsyncMutex<Option<Arc<SharedSession>>>,
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
        // The set is only inserted into and removed from: a panic elsewhere
        // that poisoned the lock left it consistent.
        let mut roles = self
            .inner
            .roles
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
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
    pub(crate) async fn get(&self) -> Result<Arc<SharedSession>> {
        let mut current = self.inner.current.lock().await;
        if let Some(c) = current.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let session = SharedSession::start(self.open().await?);
        *current = Some(session.clone());
        Ok(session)
    }

    async fn open(&self) -> Result<DedicatedConnection> {
        let options = &self.inner.options;
        let schema = options.schema_name();
        let s = schema.as_str();
        let conn = options.connect_for_locks("shared", &self.inner.tcp).await?;
        let prepared = async {
            check_schema(conn.client(), schema).await?;
            crate::election::support::check_not_transaction_pooled(options, &conn).await?;
            // Both channels for the connection's whole life: leaders hear
            // resign requests, standbys hear releases. The connection never
            // blocks in a wait, so it reads its notifications.
            conn.client()
                .batch_execute(&format!("LISTEN {LEADER_CHANNEL}; LISTEN {RESIGN_CHANNEL}"))
                .await
                .map_err(|e| Error::db("listen on the shared connection", s, e))
        }
        .await;
        conn.kept_if(prepared)
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

/// A live shared connection and its one heartbeat.
///
/// Each leader on the connection asks for a heartbeat at its own pace. A
/// request made at `r` is answered by a `SELECT 1` *sent* at or after `r`,
/// and the send waits a little (a quarter of the asking leader's heartbeat
/// timeout, at most 100 ms) for other requests to share it. The leader's
/// timeout still runs from `r`, so it learns of a dead connection no later
/// than with a heartbeat of its own; leaders answered by one statement ask
/// again together, so after a few beats one statement serves them all.
pub(crate) struct SharedSession {
    conn: DedicatedConnection,
    /// The earliest moment by which a pending request wants its heartbeat
    /// sent; `None` when no request is pending.
    wanted: watch::Sender<Option<Instant>>,
    /// The last heartbeat answered: when it was sent, whether it succeeded.
    beats: watch::Sender<Option<(Instant, bool)>>,
}

impl std::ops::Deref for SharedSession {
    type Target = DedicatedConnection;

    fn deref(&self) -> &DedicatedConnection {
        &self.conn
    }
}

impl SharedSession {
    fn start(conn: DedicatedConnection) -> Arc<SharedSession> {
        let session = Arc::new(SharedSession {
            conn,
            wanted: watch::Sender::new(None),
            beats: watch::Sender::new(None),
        });
        tokio::spawn(beat(Arc::downgrade(&session)));
        session
    }

    /// True when a heartbeat sent at or after `requested` was answered;
    /// false when it failed. The heartbeat is sent within `wait` of
    /// `requested`.
    pub(crate) async fn beat(&self, requested: Instant, wait: Duration) -> bool {
        let mut beats = self.beats.subscribe();
        let by = requested + wait;
        self.wanted
            .send_modify(|w| *w = Some(w.map_or(by, |x| x.min(by))));
        let answered = beats
            .wait_for(|b| b.is_some_and(|(sent, _)| sent >= requested))
            .await
            .map(|b| b.is_some_and(|(_, ok)| ok));
        answered.unwrap_or(false)
    }
}

/// The heartbeat task of a shared session: sends `SELECT 1` when the
/// earliest pending request wants it, for every request pending then; ends
/// with the session or at the first failure.
async fn beat(session: std::sync::Weak<SharedSession>) {
    let (mut wanted, closed) = match session.upgrade() {
        Some(s) => (s.wanted.subscribe(), s.conn.closed().clone()),
        None => return,
    };
    loop {
        // Wait for the earliest pending request's moment, following new
        // requests that want theirs sooner.
        loop {
            let by = *wanted.borrow_and_update();
            let changed = tokio::select! {
                _ = closed.cancelled() => return,
                r = wanted.changed() => r,
                _ = async {
                    match by {
                        Some(by) => tokio::time::sleep_until(by).await,
                        None => std::future::pending().await,
                    }
                } => break,
            };
            if changed.is_err() {
                return;
            }
        }
        let Some(s) = session.upgrade() else {
            return;
        };
        s.wanted.send_replace(None);
        let sent = Instant::now();
        let ok = s.conn.client().simple_query("SELECT 1").await.is_ok();
        s.beats.send_replace(Some((sent, ok)));
        if !ok {
            return;
        }
    }
}
