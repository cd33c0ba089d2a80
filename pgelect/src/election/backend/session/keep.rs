//! Keeping a session-backend leadership ([`SessionKeep`]): renewal scoped
//! to the backend pid, heartbeats, a dead connection ends leadership,
//! release by clearing the row and unlocking; and a shared connection's
//! batched renewal and heartbeat tasks.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};

use crate::conn::probe::{self, each_wanted, Probed, Wanted};
use crate::conn::DedicatedConnection;
use crate::error::{Error, Result};

use super::sql::*;
use super::*;
use crate::election::driver::{Answer, Failed, KeepBackend, Statement};
use crate::election::support::{is_read_only, is_transient};
use crate::election::watch::{LEADER_CHANNEL, RESIGN_CHANNEL};
use crate::election::ElectorState;
use crate::loss::LossReason;

/// Prepares the renewal on the lock connection and runs it once for no
/// leader, before the lock wait, for the reason
/// [`ElectStatement::warm_up`](super::campaign) gives: the first renewal
/// on a new backend otherwise also loads the registry's catalog entries,
/// which under the fast profile's 25 ms answer limit cost leaders their
/// first renewal (the book's design notes, "Renewals and fenced
/// transactions"); and every renewal after it runs the kept plan. The
/// release's clearing and announcing statements are prepared and run too,
/// for term 0 (no term has that number: they clear and announce nothing),
/// so that a planned handover does not wait for their plans either
/// (0.2-0.4 ms).
pub(super) async fn warm_up_renewal(
    shared: &ElectorState,
    conn: &DedicatedConnection,
) -> Result<()> {
    let s = shared.options.schema_name().as_str();
    let sql = batch_renew_sql(s);
    let (clear, announce) = (clear_sql(s), announce_sql(s));
    let warm = async {
        conn.keep_statement(&sql, &Renewals::TYPES).await?;
        Renewals::default().run(conn, &sql, 0..0).await?;
        conn.keep_statement(&clear, &CLEAR_TYPES).await?;
        conn.keep_statement(&announce, &ANNOUNCE_TYPES).await?;
        let no_term = 0i64;
        let [t0, t1, t2] = CLEAR_TYPES;
        let args = [
            (&shared.role as _, t0),
            (&shared.node as _, t1),
            (&no_term as _, t2),
        ];
        conn.query_kept_one(&clear, &args).await?;
        let [t0, t1, t2] = ANNOUNCE_TYPES;
        let args = [(&shared.role as _, t0), (&no_term as _, t1), (&"" as _, t2)];
        conn.query_kept_one(&announce, &args).await.map(|_| ())
    };
    warm.await
        .map_err(|e| Error::db("prepare the renewal", s, e))?;
    Ok(())
}

/// The renewal statement's rows for `shared`'s leader alone, at `term`.
fn renewal_of(shared: &ElectorState, term: i64, ttl_ms: i64) -> Renewals {
    let (classid, objid, _) = shared.key.pg_locks_ids();
    let mut rows = Renewals::default();
    rows.push(
        &shared.role,
        &shared.node,
        term,
        ttl_ms,
        shared.priority,
        (i64::from(classid), i64::from(objid)),
    );
    rows
}

/// How the session backend keeps a leadership: on the lock connection,
/// renewing the lease row (scoped to holder, term and backend pid) and
/// heartbeating; the connection's death ends leadership at once.
pub(super) struct SessionKeep {
    shared: Arc<ElectorState>,
    conn: LockConn,
    term: i64,
    /// This leader's place in the session's batched renewal (one
    /// statement renews every leader on a shared session).
    batch: BatchMember,
}

impl SessionKeep {
    pub(super) fn new(shared: Arc<ElectorState>, conn: LockConn, term: i64) -> SessionKeep {
        let ttl_ms = shared.timing.ttl.as_millis() as i64;
        // A renewal request waits a little for others to share its batch;
        // the keeper's answer limit (the heartbeat timeout) runs from the
        // request, so the wait is a small part of it. Leaders renewed by
        // one batch ask again at the same moment (each is handed every
        // batch's outcome), so a short wait is enough.
        let share_wait = (shared.timing.heartbeat_timeout / 10).min(Duration::from_millis(20));
        let batch = conn.join_renewals(
            &shared.role,
            &shared.node,
            term,
            ttl_ms,
            shared.priority,
            shared.key,
            share_wait,
        );
        SessionKeep {
            shared,
            conn,
            term,
            batch,
        }
    }

    /// This leader's own renewal statement, after a failed batch: the
    /// renewal, for this leader alone (a batch of one). Its text and rows
    /// are built for each such renewal rather than kept: the text alone
    /// took about 5 KB of each of a shared session's thousands of leaders.
    async fn renew_alone(&self) -> (Instant, Result<Answer>) {
        let ttl_ms = self.shared.timing.ttl.as_millis() as i64;
        let rows = renewal_of(&self.shared, self.term, ttl_ms);
        let sql = batch_renew_sql(self.schema());
        let sent = Instant::now();
        let r = rows
            .run(&self.conn, &sql, 0..1)
            .await
            .and_then(|rows| Renewals::outcomes(&rows))
            .map(|mut found| {
                found
                    .remove(&self.shared.role)
                    .map_or(Answer::NotOurs, batched_answer)
            })
            .map_err(|e| Error::db("renew the lease", self.schema(), e));
        (sent, r)
    }

    fn schema(&self) -> &str {
        self.shared.options.schema_name().as_str()
    }
}

/// What a batched renewal found, as the keeper's answer.
pub(super) fn batched_answer(b: Batched) -> Answer {
    match b {
        Batched::Renewed {
            row,
            resign_requested,
            preferred,
        } => Answer::Renewed {
            row: Some(row),
            resign_requested,
            preferred,
        },
        Batched::NotOurs => Answer::NotOurs,
        Batched::Busy => Answer::Busy,
        Batched::Failed => unreachable!("BUG: a failed batch is renewed alone"),
    }
}

impl KeepBackend for SessionKeep {
    const FINISH_IN_FLIGHT_BEFORE_RELEASE: bool = false;

    fn renew(&self) -> Statement<'_> {
        Box::pin(async move {
            // (Alone, the statement's future is boxed: the statement in
            // flight is held by each of a shared session's thousands of
            // leaders.)
            let requested = Instant::now();
            match self.batch.renewal(requested).await {
                Some((sent, Batched::Failed)) => {
                    // Run alone to learn (and report) why it failed.
                    tracing::debug!(batch_sent = ?sent, "the batched renewal failed; renewing alone");
                    Box::pin(self.renew_alone()).await
                }
                Some((sent, b)) => (sent, Ok(batched_answer(b))),
                None => (requested, Err(Error::connection_lost("renew the lease"))),
            }
        })
    }

    async fn pushed(&self) -> (Instant, Result<Answer>) {
        let (sent, b) = self.batch.pushed().await;
        (sent, Ok(batched_answer(b)))
    }

    fn heartbeat(&self) -> Statement<'_> {
        let share_wait = (self.shared.timing.heartbeat_timeout / 4).min(Duration::from_millis(100));
        Box::pin(async move {
            let sent = Instant::now();
            let answer = |p| match p {
                Probed::ReadOnly => Answer::ReadOnly,
                Probed::Alive => Answer::Alive,
            };
            // The session's probe answers all its leaders; a failed one is
            // asked again here to get the error to report.
            if let Some(p) = self
                .conn
                .probe()
                .answer(sent, self.conn.share_wait(share_wait))
                .await
            {
                return (sent, Ok(answer(p)));
            }
            let r = Box::pin(probe::ask(self.conn.client()))
                .await
                .map(answer)
                .map_err(|e| Error::db("renew the lease", self.schema(), e));
            (sent, r)
        })
    }

    async fn answered(&self) -> Instant {
        self.conn.probe().next_answer().await
    }

    fn closed(&self) -> impl Future<Output = ()> + Send + '_ {
        self.conn.closed().cancelled()
    }

    fn failed(&self, error: &Error, _failures: u32) -> Failed {
        if is_read_only(error) {
            Failed::ServerReadOnly
        } else if is_transient(error) || self.conn.is_closed() {
            Failed::ConnectionLost
        } else {
            Failed::RetrySoon
        }
    }

    fn let_go(&self, reason: Option<LossReason>) {
        self.batch.leave();
        // A dead connection goes; otherwise only this role's lock (on its
        // own connection, the same).
        if matches!(
            reason,
            Some(LossReason::ConnectionLost | LossReason::ServerReadOnly)
        ) {
            self.conn.kill();
        } else {
            self.conn.abandon(self.shared.key);
        }
    }

    fn releasable_after(&self, _reason: LossReason) -> bool {
        // The lock went with the connection (or was unlocked).
        false
    }

    async fn release(self, ended: Option<LossReason>) -> Result<()> {
        self.batch.leave();
        let bound = self.shared.timing.heartbeat_timeout * 2;
        let released = release(&self.shared, &self.conn, self.term);
        let result = match tokio::time::timeout(bound, released).await {
            Ok(r) => r,
            Err(_) => Err(Error::connection_lost("release the leadership")),
        };
        match &result {
            Ok(()) => {
                // Given up of its own accord (resigned, or released while
                // leading): a polling candidate's next campaign lets the
                // woken standbys take the role first.
                if let Some(session) = self.shared.session() {
                    if matches!(ended, None | Some(LossReason::Resigned)) {
                        *session
                            .stepped_aside
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) =
                            Some((Instant::now(), self.term));
                    }
                }
                // Kept for this elector's next campaign rather than
                // closed now: a backend ending on the server is work
                // that would compete with the successor's election
                // (measured in the failover benchmark); it is closed
                // when the elector is dropped.
                if let Some(session) = self.shared.session() {
                    self.conn.keep_for_next_campaign(session);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "clean release failed; dropping the lock connection");
                self.conn.kill();
            }
        }
        result
    }

    fn close(self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// The release's clearing statement: the row of role `$1` no longer names
/// holder `$2` at term `$3`; returns how many rows it cleared (0 or 1).
fn clear_sql(s: &str) -> String {
    format!(
        "WITH c AS (
             UPDATE {s}.leaders
                SET holder = NULL, holder_pid = NULL, holder_meta = NULL,
                    renewed_at = now(), lease_until = now()
              WHERE role = $1 AND holder = $2 AND term = $3
             RETURNING 1
         )
         SELECT count(*) FROM c"
    )
}

/// The types of [`clear_sql`]'s parameters.
const CLEAR_TYPES: [Type; 3] = [Type::TEXT, Type::TEXT, Type::INT8];

/// The release's announcement, sent after the unlock: `$3` on the leader
/// channel if the row of role `$1` is vacant at term `$2` (cleared by this
/// release, not taken since). Announced only once the lock is free, so
/// that a polling standby woken by it finds the lock free (announced by
/// the clearing commit, ahead of the unlock, a standby's poll often came
/// first and found it held: a whole poll interval lost).
fn announce_sql(s: &str) -> String {
    format!(
        "SELECT count(pg_notify('{LEADER_CHANNEL}', $3)) FROM {s}.leaders
          WHERE role = $1 AND term = $2 AND holder IS NULL"
    )
}

/// The types of [`announce_sql`]'s parameters.
const ANNOUNCE_TYPES: [Type; 3] = [Type::TEXT, Type::INT8, Type::TEXT];

pub(super) async fn release(shared: &ElectorState, conn: &LockConn, term: i64) -> Result<()> {
    let s = shared.options.schema_name().as_str();
    let (clear, announce) = (clear_sql(s), announce_sql(s));
    let payload = format!("{s}:released:{}", shared.role);
    let params = shared.key.params();
    let args: Vec<(&(dyn ToSql + Sync), Type)> = params.iter().map(|p| p.as_sql()).collect();
    let unlock_sql = format!("SELECT pg_advisory_unlock({})", shared.key.sql_args(1));
    // Pipelined: the clearing transaction commits before the unlock runs,
    // and the announcement after it (the server runs them in order), in
    // one round trip.
    let [t0, t1, t2] = CLEAR_TYPES;
    let clear_args = [
        (&shared.role as _, t0),
        (&shared.node as _, t1),
        (&term as _, t2),
    ];
    let [t0, t1, t2] = ANNOUNCE_TYPES;
    let announce_args = [
        (&shared.role as _, t0),
        (&term as _, t1),
        (&payload as _, t2),
    ];
    // A listening backend that does not read (a later lock wait) would
    // hold back the server's notification queue. A shared connection
    // listens for its whole life and never waits.
    let unlisten = match conn.listens_for_life() {
        true => String::new(),
        false => format!("UNLISTEN {RESIGN_CHANNEL}"),
    };
    // A session-level advisory lock is counted: a lock a poll was granted
    // once more while the standby turned leader would stay held after one
    // unlock (its successor refused until this session's next campaign
    // took the role back), so the lock is unlocked again if still held.
    let again = super::lock_conn::unlock_if_held_sql(shared.key);
    let (cleared, unlocked, _, announced, unlistened) = tokio::join!(
        conn.query_kept_one(&clear, &clear_args),
        conn.client().query_typed_one(&unlock_sql, &args),
        conn.client().query_typed_one(&again, &args),
        conn.query_kept_one(&announce, &announce_args),
        conn.client().batch_execute(&unlisten),
    );
    let cleared: i64 = cleared
        .and_then(|row| row.try_get(0))
        .map_err(|e| Error::db("release the leadership", s, e))?;
    if cleared == 0 {
        tracing::warn!(term, "the lease row no longer named this leader at release");
    }
    let unlocked: bool = unlocked
        .and_then(|row| row.try_get(0))
        .map_err(|e| Error::db("unlock the leader's lock", s, e))?;
    if !unlocked {
        return Err(Error::Pooler(format!(
            "the leader's advisory lock was not held by this session at release (role {:?}); is a pooler in transaction mode between pgelect and {}?",
            shared.role,
            shared.options.target()
        )));
    }
    announced.map_err(|e| Error::db("announce the release", s, e))?;
    unlistened.map_err(|e| Error::db("stop listening for resign requests", s, e))?;
    Ok(())
}

/// The renewal task of a shared session: when the earliest renewal
/// request wants it, sends one statement renewing every leader on the
/// session, and hands each its outcome; ends with the session or when its
/// connection fails.
pub(super) async fn renew_batches(session: std::sync::Weak<SharedSession>) {
    fn wanted(s: &SharedSession) -> Wanted<'_> {
        (&s.renew_wanted, &s.conn)
    }
    each_wanted(session, wanted, async |s: Arc<SharedSession>| {
        s.renew_wanted.send_replace(None);
        let mut rows = Renewals::default();
        let mut outcomes = HashMap::new();
        for (role, l) in s.leaders().iter() {
            rows.push(role, &l.node, l.term, l.ttl_ms, l.priority, l.lock_ids);
            outcomes.insert(role.clone(), (l.term, l.outcome.clone()));
        }
        let roles = &rows.roles;
        if roles.is_empty() {
            return true;
        }
        // In chunks, one in flight at a time, as the polls: a heartbeat
        // waits behind one chunk, and every chunk's answer shows the
        // session alive to the leaders still waiting for theirs.
        for chunk in chunks(roles.len(), RENEW_ROWS) {
            let sent = Instant::now();
            let answer = rows.run(&s.conn, &s.renew_sql, chunk.clone()).await;
            tracing::debug!(pid = s.conn.pid(), leaders = chunk.len(), took = ?sent.elapsed(), "batched renewal");
            if answer.is_ok() {
                s.answered(sent);
            }
            let mut found = match answer.and_then(|rows| Renewals::outcomes(&rows)) {
                Ok(found) => Some(found),
                Err(e) => {
                    tracing::warn!(error = %e, cause = ?e.as_db_error().map(|d| d.message()), leaders = chunk.len(), "the batched renewal failed; each leader renews alone");
                    None
                }
            };
            let failed = found.is_none();
            for role in &roles[chunk] {
                let Some((_, tx)) = outcomes.remove(role) else {
                    continue;
                };
                let b = match &mut found {
                    None => Batched::Failed,
                    Some(found) => found.remove(role).unwrap_or(Batched::NotOurs),
                };
                tx.send_replace(Some((sent, b)));
            }
            if failed && s.conn.is_closed() {
                return false;
            }
        }
        true
    })
    .await;
}
