//! The connection a session-backend candidate stands on ([`LockConn`]):
//! one of its own, or a share of a [`SharedConnection`](crate::election::SharedConnection).
//! Every step in which the two differ is a method here, so that the
//! campaign and the keep call them the same way whichever it is: opening
//! (a kept spare, a new connection, or the shared session), a polling
//! standby's registration and wait, the term's statement, a statement of
//! one role's own on a shared session, the leader's place in the batched
//! renewal and its heartbeat, a release's `UNLISTEN`, giving the role up
//! without a clean release, and keeping the connection for the next
//! campaign.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, SemaphorePermit};
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};

use super::campaign::{
    lock_connection, poll_for_lock, poll_in_batch, ElectOutcome, ElectStatement,
};
use super::{BatchMember, SharedSession};
use crate::conn::{DedicatedConnection, Notice};
use crate::election::elector::SessionState;
use crate::election::registry::{self, Register};
use crate::election::watch::RESIGN_CHANNEL;
use crate::election::ElectorState;
use crate::error::{Error, Result};
use crate::key::LockKey;

/// The connection a candidate stands on.
pub(crate) enum LockConn {
    /// Its own: dropped leadership kills it (the server releases the lock),
    /// a clean release keeps it for the next campaign. Boxed: every
    /// campaign and every leader's keep task holds a `LockConn`, thousands
    /// of them on a shared connection, where it is one pointer.
    Own(Box<DedicatedConnection>),
    /// A [`SharedConnection`](crate::election::SharedConnection), also holding other
    /// roles' locks: dropped leadership unlocks this role's key only.
    Shared(Arc<SharedSession>),
}

impl std::ops::Deref for LockConn {
    type Target = DedicatedConnection;

    fn deref(&self) -> &DedicatedConnection {
        match self {
            LockConn::Own(c) => c,
            LockConn::Shared(c) => c,
        }
    }
}

impl LockConn {
    /// The connection a campaign of `shared` stands on: a share of its
    /// shared connection; else the connection of its last clean release,
    /// if still open (warmed up and checked already, no backend to
    /// start); else a new one.
    pub(super) async fn open(
        shared: &ElectorState,
        session: &SessionState,
        elect: &ElectStatement,
    ) -> Result<LockConn> {
        Ok(match &session.host {
            Some(host) => LockConn::Shared(Box::pin(host.client().get()).await?),
            None => LockConn::Own(Box::new(match session.take_spare() {
                Some(conn) => conn,
                None => Box::pin(lock_connection(shared, elect)).await?,
            })),
        })
    }

    /// Registers a polling standby. On a shared connection, one statement
    /// registers the standbys of many roles: the leaders' renewals and
    /// heartbeats on it must not queue behind a thousand registrations. A
    /// failed batch is run alone (a few at a time) to learn and report
    /// this role's error.
    pub(super) async fn register_polling(
        &self,
        shared: &ElectorState,
        register: &Register,
    ) -> Result<()> {
        if let LockConn::Shared(session) = self {
            if session.register(register.entry(shared)).await {
                return Ok(());
            }
            let _turn = session.campaign_turn().await;
            return Box::pin(register.run(shared, self)).await;
        }
        Box::pin(register.run(shared, self)).await
    }

    /// Waits as a polling standby until the role's lock is granted: alone
    /// on a connection of its own, in the shared session's batched poll
    /// otherwise.
    pub(super) async fn poll_until_granted(
        &self,
        shared: &ElectorState,
        interval: Duration,
    ) -> Result<()> {
        match self {
            LockConn::Own(own) => Box::pin(poll_for_lock(shared, own, interval)).await,
            LockConn::Shared(session) => Box::pin(poll_in_batch(shared, session, interval)).await,
        }
    }

    /// Records the term of a candidate granted the lock, and lets go of the
    /// role's watch key (`watch_held`) if it still holds it. Returns what
    /// the election did, the notices that carry resign requests to the
    /// leader, and the moment the election was sent (the deadline counts
    /// from it: a wait for a shared session's statement is no time led).
    pub(super) async fn record_term(
        &self,
        shared: &ElectorState,
        elect: &ElectStatement,
        watch_held: Option<i64>,
    ) -> Result<(ElectOutcome, broadcast::Receiver<Notice>, Instant)> {
        let s = shared.options.schema_name().as_str();
        match self {
            LockConn::Own(own) => {
                // The term bump and the lease row, in one transaction.
                // LISTEN for resign requests commits with it: requests are
                // delivered from the moment the row names us, and none
                // meant for the previous leader.
                let sent_at = Instant::now();
                let notices = own.notices();
                // The requests are pipelined (sent in this order in one
                // go, run in order by the server): one round trip.
                let listen = format!("BEGIN; LISTEN {RESIGN_CHANNEL}");
                let unwatched = async {
                    match watch_held {
                        Some(w) => unwatch(own.client(), w).await,
                        None => Ok(()),
                    }
                };
                let (begun, elected, committed, unwatched) = tokio::join!(
                    own.client().batch_execute(&listen),
                    elect.run(shared, own),
                    own.client().batch_execute("COMMIT"),
                    unwatched,
                );
                unwatched.map_err(|e| Error::db("let go of the role's watch key", s, e))?;
                begun.map_err(|e| Error::db("record the new term", s, e))?;
                let elected = elected?;
                committed.map_err(|e| Error::db("record the new term", s, e))?;
                if let ElectOutcome::Yield(_) = &elected {
                    // The LISTEN committed with the (empty) transaction.
                    own.client()
                        .batch_execute(&format!("UNLISTEN {RESIGN_CHANNEL}"))
                        .await
                        .map_err(|e| Error::db("stop listening", s, e))?;
                }
                Ok((elected, notices, sent_at))
            }
            LockConn::Shared(c) => {
                if let Some(w) = watch_held {
                    unwatch(c.client(), w)
                        .await
                        .map_err(|e| Error::db("let go of the role's watch key", s, e))?;
                }
                // Other roles' statements run on this connection too: no
                // explicit transaction, one statement. The connection
                // listens for resign requests all along and hands this
                // role's to this candidate from the subscription on: one
                // sent just before this term costs at most an early check
                // of the row, which carries the request only if it names
                // this term.
                let hints = c.hints(&registry::hint_payload(s, &shared.role));
                // One statement elects every role of this connection
                // granted meanwhile.
                match c.elect(elect.entry(shared)).await {
                    Some((sent_at, row)) => Ok((elect.outcome(shared, &row, 1)?, hints, sent_at)),
                    None => {
                        // Failed: alone, a few at a time, to learn this
                        // role's error (a failed statement wrote nothing).
                        let _turn = c.campaign_turn().await;
                        let sent_at = Instant::now();
                        let elected = Box::pin(elect.run(shared, c)).await?;
                        Ok((elected, hints, sent_at))
                    }
                }
            }
        }
    }

    /// A turn for a statement of this role's own, among the campaigns of a
    /// shared session (a few at a time, so that the leaders' renewals do
    /// not queue behind them); none is needed on a connection of its own.
    pub(super) async fn campaign_turn(&self) -> Option<SemaphorePermit<'_>> {
        match self {
            LockConn::Shared(c) => Some(c.campaign_turn().await),
            LockConn::Own(_) => None,
        }
    }

    /// After a clean release or a lock given back: a connection of its own
    /// is kept for the elector's next campaign rather than closed now (a
    /// backend ending on the server is work that would compete with the
    /// successor's election); a share of a shared connection is just
    /// dropped.
    pub(super) fn keep_for_next_campaign(self, session: &SessionState) {
        if let LockConn::Own(own) = self {
            session.put_spare(*own);
        }
    }

    /// The leader of `role` at `term` enters the shared session's batched
    /// renewal (`share_wait` bounds how long its requests wait for others);
    /// on a connection of its own it renews alone (`None`).
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
    ) -> Option<BatchMember> {
        match self {
            LockConn::Shared(session) => {
                Some(session.join_batch(role, node, term, ttl_ms, priority, key, share_wait))
            }
            LockConn::Own(_) => None,
        }
    }

    /// A heartbeat answered by a shared session's probe, which answers
    /// all its leaders: true if it answered within `share_wait` of `sent`.
    /// Always false on a connection of its own, whose leader asks itself.
    pub(super) async fn probe_answered(&self, sent: Instant, share_wait: Duration) -> bool {
        match self {
            LockConn::Shared(session) => session.probe().answer(sent, share_wait).await.is_some(),
            LockConn::Own(_) => false,
        }
    }

    /// The next answer of the shared session's probe (any statement's
    /// answer on it shows it alive); never on a connection of its own.
    pub(super) async fn next_probe_answer(&self) -> Instant {
        match self {
            LockConn::Shared(session) => session.probe().next_answer().await,
            LockConn::Own(_) => std::future::pending().await,
        }
    }

    /// Whether the connection listens for resign requests all its life (a
    /// shared session, which never waits in a lock); a connection of its
    /// own listens while it leads only, since a listening backend that does
    /// not read (a later lock wait) would hold back the server's
    /// notification queue.
    pub(super) fn listens_for_life(&self) -> bool {
        matches!(self, LockConn::Shared(_))
    }

    /// Lets go of `key` without a clean release: the lease row still names
    /// this candidate, so the next leader waits the handover delay.
    pub(super) fn abandon(&self, key: LockKey) {
        match self {
            LockConn::Own(c) => c.kill(),
            LockConn::Shared(c) => {
                let c = c.clone();
                let Ok(rt) = tokio::runtime::Handle::try_current() else {
                    c.kill();
                    return;
                };
                rt.spawn(async move {
                    // Only if held: a campaign dropped while polling holds
                    // nothing, and an unlock of a lock not held makes the
                    // server log a warning.
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
                            // A lock that cannot be released must not stay
                            // with a session that no longer renews it.
                            tracing::warn!(%key, error = %e, "could not unlock an abandoned role; dropping the shared connection");
                            c.kill();
                        }
                    }
                });
            }
        }
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

/// Undoes a campaign dropped half-way, unless disarmed: its own connection
/// is killed (no waiting backend left behind); on a shared connection the
/// role's lock is released if it was taken.
pub(super) struct KillOnDrop<'a> {
    pub(super) conn: Option<&'a LockConn>,
    pub(super) key: LockKey,
}

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        match self.conn.take() {
            Some(LockConn::Own(conn)) => {
                let cancel = conn.canceller();
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move {
                        let _ = cancel.cancel().await;
                    });
                }
                conn.kill();
            }
            Some(shared @ LockConn::Shared(_)) => shared.abandon(self.key),
            None => {}
        }
    }
}
