//! The connection a session-backend candidate stands on ([`LockConn`]): a
//! [`SharedSession`], either of one candidate (its own connection) or
//! shared by the candidates of many roles (a
//! [`SharedConnection`](crate::election::SharedConnection)). Both run the
//! same statements the same way: registrations, elections, renewals and
//! heartbeats go through the session's batches, a lone candidate's a batch
//! of one. What a session of one may do that a shared one may not is
//! [`SharedSession::alone`]'s to say: wait in the server (a blocking
//! standby, and a polling one's own look for squatters), listen while it
//! leads only, and be dropped whole when its candidate lets the role go.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, SemaphorePermit};
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};

use super::campaign::{lock_connection, poll_in_batch, ElectOutcome, ElectStatement};
use super::{BatchMember, SharedSession};
use crate::conn::Notice;
use crate::election::elector::SessionState;
use crate::election::registry::{self, Register};
use crate::election::watch::RESIGN_CHANNEL;
use crate::election::ElectorState;
use crate::error::{Error, Result};
use crate::key::LockKey;

/// The connection a candidate stands on: a session of its own, or a share
/// of a shared one.
pub(crate) struct LockConn(Arc<SharedSession>);

impl std::ops::Deref for LockConn {
    type Target = SharedSession;

    fn deref(&self) -> &SharedSession {
        &self.0
    }
}

impl LockConn {
    /// The connection a campaign of `shared` stands on: a share of its
    /// shared connection; else the session of its last clean release, if
    /// still open (warmed up and checked already, no backend to start);
    /// else a new session of one.
    pub(super) async fn open(
        shared: &ElectorState,
        session: &SessionState,
        elect: &ElectStatement,
    ) -> Result<LockConn> {
        if let Some(host) = &session.host {
            return Ok(LockConn(Box::pin(host.client().get()).await?));
        }
        if let Some(spare) = session.take_spare() {
            return Ok(spare);
        }
        let conn = Box::pin(lock_connection(shared, elect)).await?;
        Ok(LockConn(SharedSession::start(
            conn,
            shared.options.schema_name(),
            true,
        )))
    }

    /// Whether the session is still open.
    pub(crate) fn is_open(&self) -> bool {
        !self.0.is_closed()
    }

    /// Closes a session of one (after a last statement on it); a share of
    /// a shared one is just dropped.
    pub(crate) async fn close(self) {
        if !self.0.alone() {
            return;
        }
        match Arc::try_unwrap(self.0) {
            Ok(session) => session.conn.close().await,
            Err(session) => session.kill(),
        }
    }

    /// Registers a polling standby in the session's batched registration
    /// (the leaders' renewals and heartbeats on a shared session must not
    /// queue behind a thousand registrations). A failed batch is run alone
    /// (a few at a time) to learn and report this role's error.
    pub(super) async fn register_polling(
        &self,
        shared: &ElectorState,
        register: &Register,
    ) -> Result<()> {
        if self.0.register(register.entry(shared)).await {
            return Ok(());
        }
        let _turn = self.campaign_turn().await;
        Box::pin(register.run(shared, self)).await
    }

    /// Waits as a polling standby in the session's batched poll until the
    /// role's lock is granted.
    pub(super) async fn poll_until_granted(
        &self,
        shared: &ElectorState,
        interval: Duration,
    ) -> Result<()> {
        Box::pin(poll_in_batch(shared, &self.0, interval)).await
    }

    /// Records the term of a candidate granted the lock, and lets go of the
    /// role's watch key (`watch_held`) if it still holds it. Returns what
    /// the election did, the notices that carry resign requests to the
    /// leader, and the moment the election was sent (the deadline counts
    /// from it: a wait for the batch's statement is no time led).
    pub(super) async fn record_term(
        &self,
        shared: &ElectorState,
        elect: &ElectStatement,
        watch_held: Option<i64>,
    ) -> Result<(ElectOutcome, broadcast::Receiver<Notice>, Instant)> {
        let s = shared.options.schema_name().as_str();
        let c = &self.0;
        // The session hands this role's resign requests to this candidate
        // from the subscription on. A session of one starts listening now
        // (it may have waited in the server, where a listening backend
        // holds back the notification queue); a shared one listens all its
        // life. A request sent just before this term costs at most an
        // early check of the row, which carries it only if it names this
        // term.
        let hints = c.hints(&registry::hint_payload(s, &shared.role));
        // Sent in this order in one go (run in order by the server) on a
        // session of one, whose batch of one is sent at once: the LISTEN,
        // the election, then the watch key let go of (the next standby in
        // its queue then finds the row naming this term).
        let unwatched = async {
            match watch_held {
                Some(w) => unwatch(c.client(), w)
                    .await
                    .map_err(|e| Error::db("let go of the role's watch key", s, e)),
                None => Ok(()),
            }
        };
        let listened = async {
            match self.listens_for_life() {
                true => Ok(()),
                false => c
                    .client()
                    .batch_execute(&format!("LISTEN {RESIGN_CHANNEL}"))
                    .await
                    .map_err(|e| Error::db("listen for resign requests", s, e)),
            }
        };
        let (listened, elected, unwatched) =
            tokio::join!(listened, c.elect(elect.entry(shared)), unwatched);
        unwatched?;
        listened?;
        let (elected, sent_at) = match elected {
            Some((sent_at, row)) => (elect.outcome(shared, &row, 1)?, sent_at),
            None => {
                // Failed: alone, a few at a time, to learn this role's
                // error (a failed statement wrote nothing).
                let _turn = c.campaign_turn().await;
                let sent_at = Instant::now();
                (Box::pin(elect.run(shared, c)).await?, sent_at)
            }
        };
        if let (ElectOutcome::Yield(_), false) = (&elected, self.listens_for_life()) {
            c.client()
                .batch_execute(&format!("UNLISTEN {RESIGN_CHANNEL}"))
                .await
                .map_err(|e| Error::db("stop listening", s, e))?;
        }
        Ok((elected, hints, sent_at))
    }

    /// A turn for a statement of this role's own among the session's
    /// campaigns (a few at a time, so that the leaders' renewals on a
    /// shared session do not queue behind them).
    pub(super) async fn campaign_turn(&self) -> SemaphorePermit<'_> {
        self.0.campaign_turn().await
    }

    /// After a clean release or a lock given back: a session of one is
    /// kept for the elector's next campaign rather than closed now (a
    /// backend ending on the server is work that would compete with the
    /// successor's election); a share of a shared session is just dropped.
    pub(super) fn keep_for_next_campaign(self, session: &SessionState) {
        if self.0.alone() {
            session.put_spare(self);
        }
    }

    /// The leader of `role` at `term` enters the session's batched
    /// renewal (`share_wait` bounds how long its requests wait for others
    /// on a shared session).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn join_renewals(
        &self,
        role: &str,
        node: &str,
        term: i64,
        ttl_ms: i64,
        priority: i32,
        key: LockKey,
        share_wait: Duration,
    ) -> BatchMember {
        self.0
            .join_batch(role, node, term, ttl_ms, priority, key, share_wait)
    }

    /// Whether the connection listens for resign requests all its life (a
    /// shared session, which never waits in a lock); a session of one
    /// listens while it leads only, since a listening backend that does not
    /// read (a later lock wait) would hold back the server's notification
    /// queue.
    pub(super) fn listens_for_life(&self) -> bool {
        !self.0.alone()
    }

    /// Lets go of `key` without a clean release: the lease row still names
    /// this candidate, so the next leader waits the handover delay. A
    /// session of one is dropped whole (the server releases the lock); on
    /// a shared one only this role's lock is unlocked.
    pub(super) fn abandon(&self, key: LockKey) {
        if self.0.alone() {
            self.0.kill();
            return;
        }
        let c = self.0.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            c.kill();
            return;
        };
        rt.spawn(async move {
            // Only if held: a campaign dropped while polling holds
            // nothing, and an unlock of a lock not held makes the server
            // log a warning.
            let sql = unlock_if_held_sql(key);
            let params = key.params();
            let args: Vec<(&(dyn ToSql + Sync), Type)> =
                params.iter().map(|p| p.as_sql()).collect();
            let unlocked = c
                .client()
                .query_typed_one(&sql, &args)
                .await
                .and_then(|row| row.try_get::<_, bool>(0));
            match unlocked {
                Ok(true) => {}
                Ok(false) => tracing::warn!(%key, "an abandoned role's lock was not held on the shared connection"),
                Err(e) => {
                    // A lock that cannot be released must not stay with a
                    // session that no longer renews it.
                    tracing::warn!(%key, error = %e, "could not unlock an abandoned role; dropping the shared connection");
                    c.kill();
                }
            }
        });
    }
}

/// Lets go of the role's watch key `w` (see [`Place`](super::campaign::Place)).
async fn unwatch(
    client: &tokio_postgres::Client,
    w: i64,
) -> std::result::Result<(), tokio_postgres::Error> {
    client
        .query_typed_one("SELECT pg_advisory_unlock($1)", &[(&w, Type::INT8)])
        .await
        .map(|_| ())
}

/// Unlocks `key` (bound as [`LockKey::params`](crate::key::LockKey::params))
/// if this session holds it; true when unlocked or not held. No warning in
/// the server's log for a lock not held.
pub(super) fn unlock_if_held_sql(key: LockKey) -> String {
    let (classid, objid, objsubid) = key.pg_locks_ids();
    format!(
        "SELECT CASE WHEN EXISTS (
             SELECT 1 FROM pg_locks
              WHERE locktype = 'advisory' AND pid = pg_backend_pid()
                AND granted AND mode = 'ExclusiveLock' AND classid = {classid}
                AND objid = {objid} AND objsubid = {objsubid})
         THEN pg_advisory_unlock({}) ELSE true END",
        key.sql_args(1)
    )
}

/// Undoes a campaign dropped half-way, unless disarmed: a session of one
/// has its statement in flight cancelled and is dropped (no waiting
/// backend left behind); on a shared session the role's lock is released
/// if it was taken.
pub(super) struct KillOnDrop<'a> {
    pub(super) conn: Option<&'a LockConn>,
    pub(super) key: LockKey,
}

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if conn.0.alone() {
            let cancel = conn.canceller();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = cancel.cancel().await;
                });
            }
        }
        conn.abandon(self.key);
    }
}
