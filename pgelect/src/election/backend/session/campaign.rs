//! Gaining leadership in the session backend: the campaign loop, the
//! blocking standby (on a connection of one candidate), polling standbys
//! and the batched statements of a shared connection's standbys
//! (registration, poll, election, zombie preemption).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use tracing::Instrument;

use crate::conn::probe::{each_wanted, Wanted};
use crate::conn::{DedicatedConnection, Notice};
use crate::election::config_error::ConfigError;
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::lock::holders::{query_holders, SquatWatch};
use crate::metrics;
use crate::schema::check_schema;

use super::keep::{warm_up_renewal, SessionKeep};
use super::sql::*;
use super::*;
use crate::election::config::watch_key;
use crate::election::driver::{Activation, Keep};
use crate::election::elector::SessionState;
use crate::election::keeper::{Keeper, Liveness};
use crate::election::leadership::{LeaderContext, LeaderState, Leadership};
use crate::election::registry::{self, yield_pause, Register, Waits};
use crate::election::support::{
    check_not_transaction_pooled, is_transient, retry_backoff, step_aside, Counted, WakeLimit,
};
use crate::election::watch::{
    leader_info_at, read_leader_mode_and_lease, LeaderInfo, LEADER_CHANNEL,
};
use crate::election::{Backend, ElectorState, StandbyMode, Term};

/// Campaigns until elected. Transient failures are retried with backoff;
/// configuration, schema, permission and pooler errors are returned.
pub(crate) async fn campaign(
    shared: &Arc<ElectorState>,
    session: &SessionState,
) -> Result<Leadership> {
    let span = tracing::info_span!("pgelect.campaign", role = %shared.role, node = %shared.node);
    async {
        let mut failures = 0u32;
        let mut yields = 0u32;
        loop {
            match Box::pin(attempt(shared, session)).await {
                Ok(Attempt::Elected(l)) => return Ok(l),
                Ok(Attempt::Again) => {
                    // Lost during the handover delay: stand again at once.
                    failures = 0;
                }
                Ok(Attempt::Yielded) => {
                    // Gave the lock to a preferred candidate: let it take
                    // it before queueing again (a polling one needs time
                    // to try; a vanished one costs at most this pause).
                    failures = 0;
                    yields = yields.saturating_add(1);
                    tokio::time::sleep(yield_pause(yields)).await;
                }
                Err(e) if is_transient(&e) => {
                    failures = failures.saturating_add(1);
                    let wait = retry_backoff(&shared.options, failures);
                    tracing::warn!(error = %e, retry_in = ?wait, "campaign interrupted; reconnecting");
                    tokio::time::sleep(wait).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
    .instrument(span)
    .await
}

/// How one attempt at the lock ended, short of an error.
pub(super) enum Attempt {
    /// Elected, and the handover delay (if any) has passed.
    Elected(Leadership),
    /// Lost during the handover delay: stand again.
    Again,
    /// Granted the lock while a ready candidate of higher priority waited:
    /// gave it back without a new term.
    Yielded,
}

/// Opens and prepares a lock connection: session settings, schema and
/// pooler checks, and the election statement planned once.
pub(super) async fn lock_connection(
    shared: &ElectorState,
    elect: &ElectStatement,
) -> Result<DedicatedConnection> {
    let schema = shared.options.schema_name();
    let s = schema.as_str();
    let purpose = format!("{}:{}", shared.role, shared.node);
    let conn = shared
        .options
        .connect_for_locks(&purpose, &shared.timing.tcp)
        .await?;
    let prepared = async {
        // A backend blocked in a lock wait notices a vanished client only if
        // it checks the socket (PostgreSQL 14+); skipped on older servers.
        conn.set_session(
            &[(
                "client_connection_check_interval",
                shared.timing.heartbeat.as_millis().max(1).to_string(),
            )],
            s,
        )
        .await?;
        check_schema(conn.client(), schema).await?;
        check_not_transaction_pooled(&shared.options, &conn).await?;
        elect.warm_up(shared, &conn).await?;
        warm_up_renewal(shared, &conn).await?;
        shared.contact.touch();
        Ok(())
    }
    .await;
    conn.kept_if(prepared)
}

pub(super) async fn attempt(shared: &Arc<ElectorState>, session: &SessionState) -> Result<Attempt> {
    let schema = shared.options.schema_name().clone();
    let s = schema.as_str();
    let elect = ElectStatement::new(shared);
    let register = Register::new(
        shared,
        match session.standby {
            StandbyMode::Blocking => Waits::Blocking,
            StandbyMode::Polling { .. } => Waits::Polling,
        },
    );
    let conn = LockConn::open(shared, session, &elect).await?;
    let mut guard = KillOnDrop {
        conn: Some(&conn),
        key: shared.key,
    };

    let key = shared.key;
    let params = key.params();
    let args: Vec<(&(dyn ToSql + Sync), Type)> = params.iter().map(|p| p.as_sql()).collect();
    let wait_started = Instant::now();
    // The watch key this standby still holds when granted the lock: let go
    // of after the term transaction, in the same round trip.
    let mut watch_held = None;
    match session.standby {
        StandbyMode::Blocking => {
            watch_held = Box::pin(wait_blocking(shared, &conn, &register)).await?
        }
        StandbyMode::Polling { interval } => {
            conn.register_polling(shared, &register).await?;
            conn.poll_until_granted(shared, interval).await?;
        }
    }
    metrics::squatters(&shared.role, 0);
    tracing::debug!(waited = ?wait_started.elapsed(), "lock granted");
    let granted_at = Instant::now();

    let (elected, notices, sent_at) =
        Box::pin(conn.record_term(shared, &elect, watch_held)).await?;
    let answered = Instant::now();
    shared.contact.touch();
    let elected = match elected {
        ElectOutcome::Elected(e) => e,
        ElectOutcome::Yield(preferred) => {
            // Nobody was told and the term did not move: give the lock back
            // to the preferred candidate (FIFO queues hand it to whoever
            // waited longest, not to the best). Readiness was read from
            // pg_locks just now, so a vanished candidate is never yielded
            // to: whoever is granted next checks again.
            tracing::info!(%preferred, "granted the lock while a ready candidate of higher priority waits; giving it back");
            let unlock = format!("SELECT pg_advisory_unlock({})", key.sql_args(1));
            let _turn = conn.campaign_turn().await;
            let unlocked: bool = Box::pin(conn.client().query_typed_one(&unlock, &args))
                .await
                .and_then(|row| row.try_get(0))
                .map_err(|e| Error::db("unlock the leader's lock", s, e))?;
            drop(_turn);
            if !unlocked {
                return Err(Error::Pooler(format!(
                    "the role's advisory lock was not held by this session (role {:?}); is a pooler in transaction mode between pgelect and {}?",
                    shared.role,
                    shared.options.target()
                )));
            }
            guard.conn = None;
            drop(guard);
            conn.keep_for_next_campaign(session);
            return Ok(Attempt::Yielded);
        }
    };
    // The statement names a previous holder only while its lease runs (or
    // for a row written before a promotion): see `previous_holder_sql`.
    let unclean = elected.previous_holder.is_some();
    if let Some(prev) = &elected.previous_holder {
        tracing::info!(term = elected.term.get(), previous = %prev, delay = ?shared.timing.handover_delay,
            "elected after an unclean loss; waiting the handover delay before acting");
    } else {
        tracing::info!(
            term = elected.term.get(),
            "elected after a clean release or an expired lease; acting at once"
        );
    }
    shared.publish(Some(LeaderInfo {
        role: shared.role.clone(),
        holder: shared.node.clone(),
        holder_meta: shared.meta.clone(),
        term: elected.term,
        backend: Some("session".into()),
        acquired_at: elected.acquired_at,
        renewed_at: elected.acquired_at,
        lease_until: elected.lease_until,
        lease_expired: false,
        holder_pid: Some(conn.pid()),
    }));

    guard.conn = None;
    drop(guard);
    let timing = (sent_at, answered, granted_at, unclean);
    let (leadership, activated_rx) = start_keep(shared, conn, elected.term, notices, timing);
    match activated_rx.await {
        Ok(true) => Ok(Attempt::Elected(leadership)),
        _ => Ok(Attempt::Again),
    }
}

/// Starts the keep task of a new term and returns the leadership and
/// the receiver of its activation (after the handover delay). Not async:
/// none of what it builds lives in the campaign's future, which thousands
/// of standbys of a shared connection each hold.
pub(super) fn start_keep(
    shared: &Arc<ElectorState>,
    conn: LockConn,
    term: Term,
    notices: broadcast::Receiver<Notice>,
    (sent_at, answered, granted_at, unclean): (Instant, Instant, Instant, bool),
) -> (Leadership, oneshot::Receiver<bool>) {
    let schema = shared.options.schema_name();
    let keeper = Keeper::new(
        shared.timing,
        Liveness::session(&shared.timing),
        sent_at,
        answered,
        unclean,
    )
    .handover_counted_from(granted_at);
    let state = Arc::new(LeaderState::new(
        shared.role.clone(),
        schema.clone(),
        term,
        keeper.deadline(),
    ));
    let (commands, rx) = mpsc::unbounded_channel();
    let (activated_tx, activated_rx) = oneshot::channel();
    let span = tracing::info_span!("pgelect.leader", role = %shared.role, node = %shared.node, term = term.get());
    let backend = SessionKeep::new(shared.clone(), conn, term.get());
    let mut keep = Keep::new(shared.clone(), backend, keeper, state.clone(), rx, notices);
    keep.activation = Activation::Pending {
        tx: activated_tx,
        granted_at,
    };
    keep.count_leading = true;
    keep.spawn(span);
    let leadership = Leadership {
        context: LeaderContext::new(state),
        commands,
    };
    (leadership, activated_rx)
}

/// Where a blocking standby waits.
///
/// The candidates of a role that stand with the default priority do not all
/// wait in the role's lock queue with an observer connection each (two
/// connections and a read per `check_every` per standby: a hundred
/// standbys would not fit a default `max_connections`). They queue for the
/// role's *watch key* instead; its one holder, the watch, waits in the
/// role's lock queue in slices of `check_every` and between them does what
/// every standby's observer did: reads the row, preempts a zombie leader,
/// notices a read-only server, looks for squatters. When the watch is
/// granted the role's lock it lets go of the watch key, and the next
/// standby in that queue is granted it at once. A crashed leader's lock is
/// granted to the watch at once, as before; each other standby costs one
/// statement per wait slice and one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place {
    /// Waiting for the watch key, in slices of `wait_slice`.
    Queue,
    /// Holding the watch key, waiting for the role's lock in slices of
    /// `check_every`.
    Watch,
    /// Waiting for the role's lock directly, in slices of `wait_slice`,
    /// with an observer connection: a candidate with a priority (a leader
    /// hands over only to a candidate it sees waiting for the role's lock),
    /// or one whose role's watch key another database user holds.
    Direct,
}

/// Milliseconds of a validated duration (at most 24 h) for an `int4`.
pub(super) fn slice_ms(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// Awaits `slice`, with `first` (the registration, pipelined ahead of the
/// first slice: the server runs the slice right after the registration
/// commits, so a leader woken by its hint finds this candidate already
/// waiting) if it is still to run.
pub(super) async fn after_registration<T>(
    first: Option<impl Future<Output = Result<()>>>,
    slice: impl Future<Output = T>,
) -> Result<T> {
    match first {
        Some(registered) => {
            let (registered, r) = tokio::join!(registered, slice);
            registered.map(|()| r)
        }
        None => Ok(slice.await),
    }
}

/// Waits as a blocking standby (see [`Place`]) until this candidate holds
/// the role's lock (and no longer the watch key).
/// Waits in the role's lock queue, or as the role's watch, until granted
/// the lock. Returns the watch key if this standby still holds it (the
/// caller lets go of it with its term transaction).
pub(super) async fn wait_blocking(
    shared: &Arc<ElectorState>,
    conn: &LockConn,
    register: &Register,
) -> Result<Option<i64>> {
    let schema = shared.options.schema_name().clone();
    let s = schema.as_str();
    // (A blocking standby stands on a connection of its own.)
    *shared
        .lock_server
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = conn.server().cloned();
    let (LockKey::Single(k), LockKey::Single(w)) = (shared.key, watch_key(s, &shared.role)) else {
        unreachable!("BUG: role keys are hashed names, which are single keys")
    };
    let (w_classid, w_objid, w_objsubid) = watch_key(s, &shared.role).pg_locks_ids();
    let queue_ms = slice_ms(shared.timing.wait_slice);
    let watch_ms = slice_ms(shared.timing.check_every.min(shared.timing.wait_slice));
    let grace_ms = shared.timing.ttl.as_millis().min(i64::MAX as u128) as i64;
    let queue_sql = queue_slice_sql(s);
    let wait_sql = format!("SELECT {s}.lock_wait_slice($1, $2)");
    let mut place = if shared.priority == 0 {
        Place::Queue
    } else {
        Place::Direct
    };
    let mut standing = None;
    let mut squat = SquatWatch::default();
    let mut warned_watch_squatter = false;
    let mut registration = Some(register.run(shared, conn));
    // The watch's next slice, when the holder's lease runs out before a
    // whole one: it then ends just after the expiry, so a cut-off or
    // frozen leader is preempted at the expiry, not up to `check_every`
    // after it.
    let mut until_expiry: Option<i32> = None;
    loop {
        if place == Place::Direct && standing.is_none() {
            shared.ensure_observer();
            standing = Some(Counted::new(&shared.activity, |a| &mut a.standing));
        }
        let first = registration.take();
        let waited = async {
            match place {
                Place::Queue => {
                    let args: [(&(dyn ToSql + Sync), Type); 6] = [
                        (&w, Type::INT8),
                        (&queue_ms, Type::INT4),
                        (&grace_ms, Type::INT8),
                        (&w_classid, Type::OID),
                        (&w_objid, Type::OID),
                        (&w_objsubid, Type::INT2),
                    ];
                    let r =
                        after_registration(first, conn.client().query_typed_one(&queue_sql, &args))
                            .await?;
                    let found: serde_json::Value = r
                        .and_then(|row| row.try_get(0))
                        .map_err(|e| Error::db("wait for the watch of the leader's lock", s, e))?;
                    Ok(Err(found))
                }
                Place::Watch | Place::Direct => {
                    let ms = if place == Place::Watch {
                        until_expiry.take().map_or(watch_ms, |ms| ms.min(watch_ms))
                    } else {
                        queue_ms
                    };
                    let args: [(&(dyn ToSql + Sync), Type); 2] =
                        [(&k, Type::INT8), (&ms, Type::INT4)];
                    let r =
                        after_registration(first, conn.client().query_typed_one(&wait_sql, &args))
                            .await?;
                    let granted: bool = r
                        .and_then(|row| row.try_get(0))
                        .map_err(|e| Error::db("wait for the leader's lock", s, e))?;
                    Ok(Ok(granted))
                }
            }
        };
        let outcome: Result<std::result::Result<bool, serde_json::Value>> = tokio::select! {
            r = waited => r,
            _ = conn.closed().cancelled() => {
                return Err(Error::connection_lost("wait for the leader's lock"));
            }
            _ = shared.server_read_only.notified(), if place == Place::Direct => {
                return Err(Error::connection_lost(
                    "wait for the leader's lock: the server became read-only",
                ));
            }
        };
        shared.contact.touch();
        match outcome {
            // The watch key: this standby is the watch now.
            Ok(Err(found)) if found.get("granted").is_some() => {
                tracing::debug!("holding the role's watch key; waiting for its lock");
                place = Place::Watch;
            }
            Ok(Err(found)) => {
                let pid = found.get("pid").and_then(serde_json::Value::as_i64);
                let ours = found.get("ours").and_then(serde_json::Value::as_bool);
                let ended = found.get("ended").and_then(serde_json::Value::as_bool);
                match (pid, ours, ended) {
                    (Some(pid), _, Some(true)) => {
                        metrics::preempted_zombie(&shared.role);
                        tracing::warn!(pid, "ended the role's watch, whose session had done nothing for a TTL (a candidate frozen while it watched, or before its term)");
                    }
                    (Some(pid), Some(false), _) => {
                        // Not a pgelect candidate of this database user:
                        // a neighbour's session took the public key. Wait
                        // in the role's queue itself, as before watches.
                        if !warned_watch_squatter {
                            warned_watch_squatter = true;
                            tracing::warn!(role = %shared.role, pid, "the watch key of role {:?} is held by pid {pid}, a session of another database user; this standby waits in the role's lock queue directly, with an observer connection. Advisory keys are public and database-wide (see the book's security chapter, docs/src/security.md)", shared.role);
                        }
                        place = Place::Direct;
                    }
                    _ => {}
                }
            }
            Ok(Ok(true)) => return Ok((place == Place::Watch).then_some(w)),
            Ok(Ok(false)) => {
                // A slice passed without the lock: look at the row, and
                // (the watch) preempt a zombie or leave a read-only server.
                let (leader, read_only, runs) =
                    read_leader_mode_and_lease(conn.client(), &schema, &shared.role).await?;
                let row_pid = leader.as_ref().and_then(|l| l.holder_pid);
                let vacant = leader.as_ref().is_none_or(|l| l.lease_expired);
                // 5 ms past the expiry: the server's `now()` in the next
                // read must be past it.
                until_expiry = runs.map(|r| slice_ms(r + Duration::from_millis(5)));
                if place == Place::Watch {
                    shared.publish(leader);
                    if read_only {
                        tracing::warn!(role = %shared.role, "the server became read-only (a demoted or fenced primary) while this standby waits on it; reconnecting");
                        return Err(Error::connection_lost(
                            "wait for the leader's lock: the server is read-only",
                        ));
                    }
                    if vacant {
                        preempt_one(shared, conn.client()).await?;
                    }
                }
                if place == Place::Direct || squat.due(std::time::Instant::now()) {
                    check_squatters(shared, conn, &mut squat, row_pid).await?;
                }
            }
            Err(e) => {
                if place == Place::Queue && matches!(e, Error::Permission { .. }) {
                    tracing::warn!(role = %shared.role, error = %e, "cannot watch the role's lock; this standby waits in its queue directly, with an observer connection");
                    place = Place::Direct;
                    continue;
                }
                return Err(e);
            }
        }
    }
}

/// What the election statement did.
pub(super) enum ElectOutcome {
    /// Recorded a new term.
    Elected(Elected),
    /// Wrote nothing: this ready candidate of higher priority waits.
    Yield(String),
}

pub(super) struct Elected {
    term: Term,
    previous_holder: Option<String>,
    acquired_at: SystemTime,
    lease_until: SystemTime,
}

/// The statement that records a new term: bumps the term and writes the
/// lease row naming this candidate, returns the previous holder (set when
/// the last leader did not release cleanly) and notifies watchers.
///
/// Alone (on a connection of the candidate's own, or after a failed batch)
/// it is the backend's one election statement ([`batch_elect_sql`]) with
/// one row; a shared connection's candidates elect in its batches of the
/// same statement.
pub(super) struct ElectStatement {
    ttl_ms: i64,
    payload: String,
}

impl ElectStatement {
    fn new(shared: &ElectorState) -> Self {
        let s = shared.options.schema_name().as_str();
        ElectStatement {
            ttl_ms: shared.timing.ttl.as_millis() as i64,
            payload: format!("{s}:elected:{}", shared.role),
        }
    }

    /// The election statement, with this candidate's role as its one row.
    fn rows(&self, shared: &ElectorState) -> Elections {
        let mut rows = Elections::default();
        rows.push(&self.entry(shared));
        rows
    }

    /// Prepares the statement on the lock connection and runs it once for
    /// no role, before the lock wait: the server parses it, loads the
    /// catalog entries of the lease table, its indexes and the functions,
    /// and plans it (a generic plan, kept: see
    /// [`GENERIC_PLANS`](crate::conn::dedicated::GENERIC_PLANS)). About 3 ms
    /// of a 2-core machine's time that would otherwise fall between the
    /// lock grant and the new term, at every election.
    async fn warm_up(&self, shared: &ElectorState, conn: &DedicatedConnection) -> Result<()> {
        let s = shared.options.schema_name().as_str();
        let sql = batch_elect_sql(s);
        let warm = async {
            conn.keep_statement(&sql, &Elections::types()).await?;
            Elections::default().run(conn, &sql).await
        };
        warm.await
            .map_err(|e| Error::db("prepare the election statement", s, e))?;
        Ok(())
    }

    pub(super) async fn run(
        &self,
        shared: &ElectorState,
        conn: &DedicatedConnection,
    ) -> Result<ElectOutcome> {
        let s = shared.options.schema_name().as_str();
        let row = self
            .rows(shared)
            .run_one(conn, &batch_elect_sql(s))
            .await
            .map_err(|e| Error::db("record the new term", s, e))?;
        self.outcome(shared, &row, 1)
    }

    /// This election as an entry of a shared session's batched election,
    /// which does what this statement does, for many roles at once.
    pub(super) fn entry(&self, shared: &ElectorState) -> Election {
        Election {
            role: shared.role.clone(),
            node: shared.node.clone(),
            meta: shared.meta.clone(),
            ttl_ms: self.ttl_ms,
            payload: self.payload.clone(),
            priority: shared.priority,
            key: shared.key,
        }
    }

    /// Decodes the statement's row, whose columns start at `at` (0 for
    /// this statement's own, 1 in the batched election's).
    pub(super) fn outcome(
        &self,
        shared: &ElectorState,
        row: &Row,
        at: usize,
    ) -> Result<ElectOutcome> {
        let s = shared.options.schema_name().as_str();
        let preferred: Option<String> = row
            .try_get(at + 5)
            .map_err(|e| Error::db("record the new term", s, e))?;
        if let Some(node) = preferred {
            return Ok(ElectOutcome::Yield(node));
        }
        let term: Option<i64> = row
            .try_get(at)
            .map_err(|e| Error::db("record the new term", s, e))?;
        let Some(term) = term else {
            return Err(Error::Config(ConfigError::OtherBackendLeads {
                role: shared.role.clone(),
                holder: None,
                leader: Backend::Lease,
            }));
        };
        let decode = || {
            Ok::<_, tokio_postgres::Error>(Elected {
                term: Term::new(term),
                previous_holder: row.try_get(at + 1)?,
                acquired_at: row.try_get(at + 2)?,
                lease_until: row.try_get(at + 3)?,
            })
        };
        decode()
            .map(ElectOutcome::Elected)
            .map_err(|e| Error::db("record the new term", s, e))
    }
}

/// One standby's poll on `conn`, a batch of one of the session backend's
/// poll ([`batch_poll_sql`]): tries the role's lock, refreshes the
/// standby's registry row (`seen_at`) when `refresh`, and reads the role's
/// row. Returns whether the lock was granted and, if not, the leader the
/// row names (`None` when it names none).
pub(super) async fn poll_one(
    shared: &ElectorState,
    conn: &DedicatedConnection,
    refresh: bool,
) -> Result<(bool, Option<LeaderInfo>)> {
    let s = shared.options.schema_name().as_str();
    let LockKey::Single(key) = shared.key else {
        unreachable!("BUG: role keys are hashed names, which are single keys")
    };
    let one = |v: &str| vec![v.to_owned()];
    let (roles, nodes, keys) = (one(&shared.role), one(&shared.node), vec![key]);
    // Nothing known: the row comes back whatever it holds.
    let (terms, holders): (Vec<Option<i64>>, Vec<Option<String>>) = (vec![None], vec![None]);
    let (seen_roles, seen_nodes) = match refresh {
        true => (roles.clone(), nodes.clone()),
        false => (Vec::new(), Vec::new()),
    };
    let rows = conn
        .client()
        .query_typed(
            &batch_poll_sql(s),
            &[
                (&roles, Type::TEXT_ARRAY),
                (&nodes, Type::TEXT_ARRAY),
                (&keys, Type::INT8_ARRAY),
                (&terms, Type::INT8_ARRAY),
                (&holders, Type::TEXT_ARRAY),
                (&seen_roles, Type::TEXT_ARRAY),
                (&seen_nodes, Type::TEXT_ARRAY),
            ],
        )
        .await;
    let decode = |rows: Vec<Row>| {
        let Some(row) = rows.first() else {
            return Ok((false, None));
        };
        let granted: bool = row.try_get(1)?;
        let holder: Option<String> = row.try_get(2)?;
        let info = match (granted, holder) {
            (false, Some(_)) => Some(leader_info_at(&shared.role, row, 2)?),
            _ => None,
        };
        Ok::<_, tokio_postgres::Error>((granted, info))
    };
    rows.and_then(decode)
        .map_err(|e| Error::db("try the leader's lock", s, e))
}

/// A polling standby: stands aside first if it gave the role up (see
/// `support::step_aside`), then waits in its session's batched poll (one
/// statement tries the locks of all its standbys; a lone candidate's is a
/// batch of one) until this role's lock is granted. Publishes the leader
/// row as the poll reports it (on a shared session when it changes, on a
/// session of one at every poll); zombie preemption is the session's, one
/// statement per poll for every vacant row (the standby preempts alone
/// only where that statement leaves it to the role); on a failed batch
/// polls alone once to learn (and return) the error.
///
/// A session of one listens for releases while it polls (see
/// [`SharedSession::alone`]), and looks for squatters (sessions other than
/// the named leader holding the role's key): a statement per role, which a
/// connection standing for thousands of roles cannot afford at every poll.
pub(super) async fn poll_in_batch(
    shared: &ElectorState,
    session: &Arc<SharedSession>,
    interval: Duration,
) -> Result<()> {
    let s = shared.options.schema_name().as_str();
    let alone = session.alone();
    let listen = |what: &'static str| async move {
        session
            .client()
            .batch_execute(&format!("{what} {LEADER_CHANNEL}"))
            .await
            .map_err(|e| Error::db("listen for leader changes", s, e))
    };
    if alone {
        listen("LISTEN").await?;
    }
    if let Some(state) = shared.session() {
        let sql = format!("SELECT term FROM {s}.leaders WHERE role = $1");
        let term_of = || async {
            let row = session
                .client()
                .query_typed_opt(&sql, &[(&shared.role, Type::TEXT)])
                .await;
            row.and_then(|r| r.map(|r| r.try_get::<_, i64>(0)).transpose())
                .map_err(|e| Error::db("read the role's term", s, e))
        };
        let notices = || session.notices();
        Box::pin(step_aside(
            shared,
            &state.stepped_aside,
            interval,
            notices,
            term_of,
        ))
        .await;
    }
    let mut squat = SquatWatch::default();
    let refresh_ms = registry::polling_refresh(interval).as_millis() as i64;
    let mut member = session.join_poll(
        &shared.role,
        &shared.node,
        shared.key,
        refresh_ms,
        interval,
        shared.timing.ttl,
    );
    loop {
        let Some(polled) = member.next().await else {
            return Err(Error::connection_lost("wait for the leader's lock"));
        };
        shared.contact.touch();
        match polled {
            Polled::Granted if alone => return listen("UNLISTEN").await,
            Polled::Granted => return Ok(()),
            Polled::Leader {
                info,
                preempt_alone,
            } => {
                if alone && squat.due(std::time::Instant::now()) {
                    let row_pid = info.as_ref().and_then(|i| i.holder_pid);
                    Box::pin(check_squatters(shared, session, &mut squat, row_pid)).await?;
                }
                shared.publish(info);
                // The session's batched preemption ran for this vacant
                // row; it leaves to the role what it cannot do for all (a
                // holder of another database user: may this one end it?).
                // (The rare branches' futures are boxed: thousands of
                // standbys of a shared connection each hold this one.)
                if preempt_alone {
                    let _turn = session.campaign_turn().await;
                    let ended = Box::pin(preempt_one(shared, session.client())).await?;
                    if let Some(pid) = ended.first() {
                        tracing::debug!(pid, "preempted; trying the lock again");
                        session.poll_soon(Duration::ZERO);
                    }
                }
            }
            Polled::Failed => {
                // The single standby's poll, to learn this role's error (or
                // be granted after all); a few at a time.
                let _turn = session.campaign_turn().await;
                let (granted, _) = Box::pin(poll_one(shared, session, true)).await?;
                if granted {
                    return Ok(());
                }
            }
        }
    }
}

/// Looks up who holds the role's lock while this standby waits, and warns
/// (once per pid) about a holder that is not the leader the lease row names
/// (`row_pid`): another database user, or a stray session, that took the
/// role's public key. Advisory locks are database-wide; see the book's
/// security section.
///
/// Only a lost connection is returned as an error; other failures of the
/// lookup are logged and the wait goes on.
pub(super) async fn check_squatters(
    shared: &ElectorState,
    conn: &DedicatedConnection,
    watch: &mut SquatWatch,
    row_pid: Option<i32>,
) -> Result<()> {
    let s = shared.options.schema_name().as_str();
    let holders = match query_holders(conn.client(), shared.key).await {
        Ok(h) => h,
        Err(e) => {
            let e = Error::db("find who holds the leader's lock", s, e);
            if is_transient(&e) {
                return Err(e);
            }
            tracing::debug!(error = %e, "could not look up who holds the role's lock");
            return Ok(());
        }
    };
    for h in watch.check(std::time::Instant::now(), holders, row_pid) {
        let claim = match h.claims_pgelect_candidate() {
            Some((role, node)) => format!(
                "it claims to be pgelect candidate {node:?} of role {role:?} (application_name is set by the client), but the lease row names pid {}",
                row_pid.map_or_else(|| "none".to_owned(), |p| p.to_string())
            ),
            None => "it does not claim to be a pgelect candidate".to_owned(),
        };
        tracing::warn!(
            role = %shared.role,
            pid = h.pid,
            user = ?h.user,
            application_name = ?h.application_name,
            client_addr = ?h.client_addr,
            "the lock of role {:?} is held by {h}, which is not the leader the lease row names: {claim}; this standby waits until it lets go. Advisory keys are public and database-wide: end that session with pg_terminate_backend({}) and isolate pgelect (see the book's security chapter, docs/src/security.md)",
            shared.role,
            h.pid
        );
    }
    metrics::squatters(&shared.role, watch.squatting());
    Ok(())
}

/// How long a poll waits for more new standbys to share it: candidates
/// that stand for many roles at once try all their locks in a few
/// statements.
pub(crate) const NEW_STANDBY_WAIT: Duration = Duration::from_millis(20);

impl PollMember {
    /// The next outcome of a batched poll for this standby; `None` when
    /// the session's connection ended.
    pub(crate) async fn next(&mut self) -> Option<Polled> {
        let seen = self.seen;
        let closed = self.session.conn.closed().clone();
        let found = tokio::select! {
            o = self.outcome.wait_for(|o| o.as_ref().is_some_and(|(n, _)| *n > seen)) => {
                o.ok().and_then(|o| o.clone())
            }
            _ = closed.cancelled() => None,
        };
        let (n, polled) = found?;
        self.seen = n;
        Some(polled)
    }
}

impl Drop for PollMember {
    fn drop(&mut self) {
        self.session.standbys().remove(&self.role);
    }
}

/// The polling task of a shared session: when a poll is wanted (a new
/// standby, a standby's interval, an announced release of a waiting role),
/// sends one statement for every standby on the session and hands each its
/// outcome; ends with the session or when its connection fails.
pub(super) async fn poll_batches(session: std::sync::Weak<SharedSession>, schema: String) {
    let (mut wanted, closed, mut notices) = match session.upgrade() {
        Some(s) => (
            s.poll_wanted.subscribe(),
            s.conn.closed().clone(),
            s.conn.notices(),
        ),
        None => return,
    };
    // Release announcements bring a poll forward; anyone may send them, so
    // a flood costs at most the wake limit's rate.
    let mut wakes = WakeLimit::default();
    let mut round = 0u64;
    // When every standby is polled next.
    let mut regular: Option<Instant> = None;
    loop {
        loop {
            let by = *wanted.borrow_and_update();
            // Due already (a new standby of a session of one, a release
            // heard): at once, not at the timer's next millisecond tick.
            if by.is_some_and(|b| b <= Instant::now()) {
                break;
            }
            let changed = tokio::select! {
                _ = closed.cancelled() => return,
                r = wanted.changed() => r.is_ok(),
                n = notices.recv() => {
                    let early = match n {
                        Ok(n) if n.channel == LEADER_CHANNEL => {
                            parse_leader_event(&schema, &n.payload).is_some_and(|(e, role)| {
                                e == "released"
                                    && session
                                        .upgrade()
                                        .is_some_and(|s| s.standbys().contains_key(role))
                            })
                        }
                        Ok(_) => false,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => true,
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    };
                    if early && by.is_none_or(|b| b > Instant::now()) {
                        let at = wakes.reserve(Instant::now());
                        if let Some(s) = session.upgrade() {
                            s.poll_all.store(true, Ordering::Relaxed);
                            s.poll_wanted_by(at);
                        }
                    }
                    true
                }
                _ = async {
                    match by {
                        Some(by) => tokio::time::sleep_until(by).await,
                        None => std::future::pending().await,
                    }
                } => break,
            };
            if !changed {
                return;
            }
        }
        let Some(s) = session.upgrade() else {
            return;
        };
        // Every standby at the regular poll and when asked; between them,
        // only the new ones (thousands that join at a start would
        // otherwise each bring a poll of all that joined before them).
        let now = Instant::now();
        let all = s.poll_all.swap(false, Ordering::Relaxed) || regular.is_none_or(|r| now >= r);
        let mut roles = Vec::new();
        let mut nodes = Vec::new();
        let mut keys = Vec::new();
        let mut due = Vec::new();
        let mut terms = Vec::new();
        let mut holders = Vec::new();
        let mut interval: Option<Duration> = None;
        for (role, w) in s.standbys().iter_mut() {
            interval = Some(interval.map_or(w.interval, |i| i.min(w.interval)));
            if !(all || w.fresh) {
                continue;
            }
            w.fresh = false;
            roles.push(role.clone());
            nodes.push(w.node.clone());
            keys.push(w.key);
            due.push(now >= w.refreshed + w.refresh);
            let (term, holder) = w.known.clone().unwrap_or((Some(-1), Some(String::new())));
            terms.push(term);
            holders.push(holder);
        }
        // The next regular poll; sooner when asked for meanwhile.
        let next = interval.map(|i| now + i);
        regular = match all {
            true => next,
            false => match (regular, next) {
                (Some(r), Some(n)) => Some(r.min(n)),
                (r, n) => r.or(n),
            },
        };
        s.poll_wanted.send_replace(regular);
        wanted.borrow_and_update();
        if roles.is_empty() {
            continue;
        }
        round += 1;
        let mut found = PollFound::new();
        let mut failed: HashSet<String> = HashSet::new();
        let mut refreshed: Vec<Option<Instant>> = vec![None; roles.len()];
        // In chunks, one in flight at a time: a leader's renewal or
        // heartbeat waits behind one chunk, not behind every standby's
        // lock.
        for chunk in chunks(roles.len(), POLL_ROWS) {
            let (mut seen_roles, mut seen_nodes) = (Vec::new(), Vec::new());
            for i in chunk.clone().filter(|&i| due[i]) {
                seen_roles.push(roles[i].as_str());
                seen_nodes.push(nodes[i].as_str());
            }
            let lane = s.lane().await;
            let sent = Instant::now();
            let rows = s
                .conn
                .client()
                .query_typed(
                    &s.poll_sql,
                    &[
                        (&&roles[chunk.clone()], Type::TEXT_ARRAY),
                        (&&nodes[chunk.clone()], Type::TEXT_ARRAY),
                        (&&keys[chunk.clone()], Type::INT8_ARRAY),
                        (&&terms[chunk.clone()], Type::INT8_ARRAY),
                        (&&holders[chunk.clone()], Type::TEXT_ARRAY),
                        (&seen_roles, Type::TEXT_ARRAY),
                        (&seen_nodes, Type::TEXT_ARRAY),
                    ],
                )
                .await;
            drop(lane);
            let what = if s.alone {
                "poll of a session of one"
            } else {
                "batched poll"
            };
            tracing::debug!(pid = s.conn.pid(), standbys = chunk.len(), took = ?sent.elapsed(), "{what}");
            if rows.is_ok() {
                s.answered(sent);
            }
            let decoded = rows.and_then(|rows| {
                rows.iter()
                    .map(|row| {
                        let role: String = row.try_get(0)?;
                        let granted: bool = row.try_get(1)?;
                        let holder: Option<String> = row.try_get(2)?;
                        let known = (row.try_get::<_, Option<i64>>(4)?, holder.clone());
                        let info = match (granted, &holder) {
                            (false, Some(_)) => Some(leader_info_at(&role, row, 2)?),
                            _ => None,
                        };
                        let polled = match granted {
                            true => Polled::Granted,
                            false => Polled::Leader {
                                info,
                                preempt_alone: false,
                            },
                        };
                        Ok((role, (polled, known)))
                    })
                    .collect::<std::result::Result<Vec<_>, tokio_postgres::Error>>()
            });
            match decoded {
                Ok(rows) => {
                    found.extend(rows);
                    for i in chunk.filter(|&i| due[i]) {
                        refreshed[i] = Some(sent);
                    }
                }
                Err(e) => {
                    // Locks this chunk took stay taken (session locks
                    // outlive a failed statement); its standbys poll alone,
                    // and a lock taken twice is held by the same session.
                    tracing::warn!(error = %e, cause = ?e.as_db_error().map(|d| d.message()), standbys = chunk.len(), "the batched poll failed; each standby polls alone");
                    failed.extend(roles[chunk].iter().cloned());
                }
            }
        }
        preempt_vacant(&s, &mut found).await;
        let (orphans, failed) = {
            let mut standbys = s.standbys();
            // Locks granted to standbys that left since the poll read them:
            // nobody would ever unlock them (see below).
            let mut orphans = Vec::new();
            for ((role, refreshed), key) in roles.iter().zip(refreshed).zip(&keys) {
                // A standby that left after this poll read the standbys may
                // have been granted its lock. Its campaign's clean-up unlocks
                // it only if that clean-up ran after this statement on the
                // connection; it may have run before (while this poll waited
                // for its lane), finding nothing to unlock, and the lock would
                // stay with the session, its role led by nobody (a partition
                // unled for good after a rebalance, in the partition tests).
                // So it is unlocked here too, if still held.
                let Some(w) = standbys.get_mut(role) else {
                    if let Some((Polled::Granted, _)) = found.remove(role) {
                        orphans.push(*key);
                    }
                    continue;
                };
                if let Some(at) = refreshed {
                    w.refreshed = at;
                }
                let polled = if failed.contains(role) {
                    Polled::Failed
                } else {
                    match found.remove(role) {
                        Some((p, known)) => {
                            // A session of one reports its row at
                            // every poll, changed or not.
                            if !s.alone {
                                w.known = Some(known);
                            }
                            p
                        }
                        None => continue,
                    }
                };
                w.outcome.send_replace(Some((round, polled)));
            }
            (orphans, !failed.is_empty())
        };
        for key in orphans {
            let key = crate::key::LockKey::Single(key);
            let _lane = s.lane().await;
            let params = key.params();
            let args: Vec<(&(dyn ToSql + Sync), Type)> =
                params.iter().map(|p| p.as_sql()).collect();
            let unlocked = s
                .conn
                .client()
                .query_typed_one(&unlock_if_held_sql(key), &args)
                .await;
            match unlocked {
                Ok(_) => tracing::debug!(%key, "unlocked a lock granted to a standby that left"),
                Err(e) => {
                    // A lock that cannot be released must not stay with a
                    // session that no candidate of its role uses.
                    tracing::warn!(%key, error = %e, "could not unlock a lock granted to a standby that left; dropping the shared connection");
                    s.conn.kill();
                    return;
                }
            }
        }
        if failed && s.conn.is_closed() {
            return;
        }
    }
}

impl SharedSession {
    /// Sends one registration statement for `entries` (at most
    /// [`BATCH_ROWS`]); true when it ran.
    pub(super) async fn send_registrations<'a>(
        &self,
        entries: impl ExactSizeIterator<Item = &'a Registration>,
    ) -> bool {
        let n = entries.len();
        let rows = registry::Registrations::of(entries);
        let lane = self.campaign_lane().await;
        let sent = Instant::now();
        let r = self
            .conn
            .client()
            .query_typed(&self.register_sql, &rows.params())
            .await;
        drop(lane);
        tracing::debug!(pid = self.conn.pid(), candidates = n, took = ?sent.elapsed(), "batched registration");
        match r {
            Ok(rows) => {
                self.answered(sent);
                let stale: i64 = rows.first().and_then(|r| r.try_get(0).ok()).unwrap_or(0);
                if stale > 0 {
                    tracing::debug!(stale, "deleted registry rows of candidates that died");
                }
                true
            }
            Err(e) => {
                self.batch_failed("registration", &e, n);
                false
            }
        }
    }

    /// Sends one election statement for `entries` (at most
    /// [`BATCH_ROWS`]): its send time and each elected role's row, or
    /// `None` when it failed.
    pub(super) async fn send_elections<'a>(
        &self,
        entries: impl Iterator<Item = &'a Election>,
    ) -> Option<(Instant, HashMap<String, Row>)> {
        let mut rows = Elections::default();
        for e in entries {
            rows.push(e);
        }
        let lane = self.campaign_lane().await;
        let sent = Instant::now();
        let r = rows.run(&self.conn, &self.elect_sql).await;
        drop(lane);
        tracing::debug!(pid = self.conn.pid(), candidates = rows.len(), took = ?sent.elapsed(), "batched election");
        let found = r.and_then(|found| {
            found
                .into_iter()
                .map(|row| Ok((row.try_get::<_, String>(0)?, row)))
                .collect::<Result<HashMap<_, _>, tokio_postgres::Error>>()
        });
        match found {
            Ok(found) => {
                self.answered(sent);
                Some((sent, found))
            }
            Err(e) => {
                self.batch_failed("election", &e, rows.len());
                None
            }
        }
    }

    /// Logs a failed batched `statement` of `n` candidates, which each
    /// candidate then runs alone to learn its error: a warning on a shared
    /// session, where that is news; on a session of one the candidate's own
    /// statement reports it.
    fn batch_failed(&self, statement: &str, e: &tokio_postgres::Error, n: usize) {
        let cause = e.as_db_error().map(|d| d.message());
        match self.alone {
            true => {
                tracing::debug!(error = %e, ?cause, statement, "the statement failed; running it again to report why")
            }
            false => {
                tracing::warn!(error = %e, ?cause, statement, candidates = n, "a batched statement failed; each candidate runs it alone")
            }
        }
    }
}

/// The registration task of a shared session: sends the queued
/// registrations, [`BATCH_ROWS`] at a time, and tells each whether it was
/// registered; ends with the session or its connection.
pub(super) async fn register_batches(session: std::sync::Weak<SharedSession>) {
    fn wanted(s: &SharedSession) -> Wanted<'_> {
        (&s.registrations.wanted, &s.conn)
    }
    each_wanted(session, wanted, async |s: Arc<SharedSession>| {
        let mut batch = s.registrations.take();
        if batch.is_empty() {
            return true;
        }
        // In role order: two candidates registering the same roles lock
        // the registry's rows in the same order.
        batch.sort_by(|a, b| a.0.role.cmp(&b.0.role));
        // Elections first: a granted role waits for its term, while a
        // registration only announces a standby (at a start, thousands of
        // them queue for roles that others will lead).
        let mut elections = s.elections.wanted.subscribe();
        tokio::select! {
            _ = elections.wait_for(Option::is_none) => {}
            _ = s.conn.closed().cancelled() => return false,
        }
        let ok = s.send_registrations(batch.iter().map(|(r, _)| r)).await;
        for (_, done) in batch {
            let _ = done.send(ok);
        }
        ok || !s.conn.is_closed()
    })
    .await;
}

/// The election task of a shared session: sends the queued elections,
/// [`BATCH_ROWS`] at a time, and hands each its role's row and the
/// statement's send time; ends with the session or its connection.
pub(super) async fn elect_batches(session: std::sync::Weak<SharedSession>) {
    fn wanted(s: &SharedSession) -> Wanted<'_> {
        (&s.elections.wanted, &s.conn)
    }
    each_wanted(session, wanted, async |s: Arc<SharedSession>| {
        let mut batch = s.elections.take();
        // A campaign dropped while queued (its role's lock is being let go
        // of) must not be elected after the unlock: its row would name a
        // leader that holds nothing.
        batch.retain(|(_, done)| !done.is_closed());
        if batch.is_empty() {
            return true;
        }
        // In role order, for the reason the registrations are.
        batch.sort_by(|a, b| a.0.role.cmp(&b.0.role));
        let mut found = s.send_elections(batch.iter().map(|(e, _)| e)).await;
        let failed = found.is_none();
        for (e, done) in batch {
            let row = found
                .as_mut()
                .and_then(|(sent, rows)| Some((*sent, rows.remove(&e.role)?)));
            let _ = done.send(row);
        }
        !failed || !s.conn.is_closed()
    })
    .await;
}

/// The zombie preemption, for the roles in `zombies` (see
/// [`preempt_sql`]), the same for a standby alone (a batch of one) and
/// for a shared session's vacant roles: logs and counts
/// ([`metrics::preempted_zombie`]) what it terminated.
///
/// With `others` (`Some(refused)`), the backends of other database users
/// are ended too (for one role at a time: a refusal fails the statement).
/// A refusal (no `pg_signal_backend` and another database user's backend,
/// or a superuser's) is then not an error: the standby keeps waiting,
/// safely, until the zombie's connection dies. The first refusal is logged
/// as a warning that preemption is unavailable (degraded) and sets
/// `refused`; later ones only at debug level, as a standby retries every
/// check. Without `others`, such holders are returned in
/// [`Preempted::others`], untouched, and any failure is an error.
pub(crate) async fn preempt(
    client: &tokio_postgres::Client,
    schema: &SchemaName,
    zombies: &Zombies,
    others: Option<&AtomicBool>,
) -> Result<Preempted> {
    let mut done = Preempted::default();
    if zombies.len() == 0 {
        return Ok(done);
    }
    let sent = Instant::now();
    let found = zombies
        .run(client, &preempt_sql(schema.as_str()), others.is_some())
        .await;
    tracing::debug!(roles = zombies.len(), took = ?sent.elapsed(), "zombie preemption");
    let found = match found {
        Ok(found) => found,
        Err(e) => {
            return match (
                Error::db("preempt an expired leader", schema.as_str(), e),
                others,
            ) {
                (Error::Permission { source, .. }, Some(refused)) => {
                    let role = zombies.roles().join(", ");
                    if refused.swap(true, Ordering::Relaxed) {
                        tracing::debug!(role, error = %source, "still not allowed to preempt the expired leader; waiting for its connection to die");
                    } else {
                        tracing::warn!(role, error = %source, "zombie preemption unavailable (degraded): not allowed to terminate the backend of a leader whose lease expired, as it belongs to another database user; GRANT pg_signal_backend to this user to preempt frozen leaders. Until then such a leader keeps its lock, and nobody else leads, until its connection dies (TCP keepalives, the server's tcp_user_timeout, a restart)");
                    }
                    Ok(done)
                }
                (other, _) => Err(other),
            };
        }
    };
    for z in found {
        let Zombie {
            role,
            pid,
            term,
            holder,
            ..
        } = &z;
        if !z.own && others.is_none() {
            done.others.push(z.role);
        } else if z.ended && !z.named {
            tracing::warn!(role, pid, "terminated a backend that held the role's lock for a TTL without taking the lease (a candidate frozen before its term, or a squatter)");
            metrics::preempted_zombie(role);
            done.ended.push(*pid);
        } else if z.ended {
            tracing::warn!(role, pid, term, holder = %holder, "terminated the backend of a leader whose lease expired on the server");
            metrics::preempted_zombie(role);
            done.ended.push(*pid);
        } else {
            tracing::warn!(role, pid, term, holder = %holder, "could not terminate the backend of a leader whose lease expired; waiting");
        }
    }
    Ok(done)
}

/// The zombie preemption of `shared`'s role alone, on `client` (a batch
/// of one, ending other database users' backends too where allowed): the
/// pids it terminated.
pub(crate) async fn preempt_one(
    shared: &ElectorState,
    client: &tokio_postgres::Client,
) -> Result<Vec<i32>> {
    let zombies = Zombies::one(&shared.role, shared.key, shared.timing.ttl);
    let schema = shared.options.schema_name();
    let done = preempt(client, schema, &zombies, Some(&shared.preemption_refused)).await?;
    Ok(done.ended)
}

/// What [`preempt`] did.
#[derive(Default)]
pub(crate) struct Preempted {
    /// The pids it terminated.
    pub(crate) ended: Vec<i32>,
    /// The roles whose holder is another database user's, left alone
    /// (without `others`).
    pub(crate) others: Vec<String>,
}

/// Runs the zombie preemption for the roles a poll found vacant (`found`,
/// not granted, no live lease) in one statement: asks for a poll at once
/// if it terminated anything, and marks the roles whose standby must try
/// alone (the holder is another database user's: may this one end it?
/// or the statement failed). A session needs at most one such statement
/// per poll; while every role is led, none.
pub(super) async fn preempt_vacant(s: &SharedSession, found: &mut PollFound) {
    let mut zombies = Zombies::default();
    {
        let standbys = s.standbys();
        for (role, (p, _)) in found.iter() {
            let vacant = match p {
                Polled::Leader { info, .. } => info.as_ref().is_none_or(|i| i.lease_expired),
                _ => false,
            };
            if let (true, Some(w)) = (vacant, standbys.get(role)) {
                zombies.push(role, w.lock_ids, w.grace);
            }
        }
    }
    if zombies.len() == 0 {
        return;
    }
    let lane = s.lane().await;
    let r = preempt(s.conn.client(), &s.schema, &zombies, None).await;
    drop(lane);
    let alone = match r {
        Ok(done) => {
            if !done.ended.is_empty() {
                s.poll_soon(Duration::ZERO);
            }
            done.others
        }
        Err(e) => {
            tracing::warn!(error = %e, roles = zombies.len(), "the batched zombie preemption failed; each vacant role's standby preempts alone");
            zombies.roles().to_vec()
        }
    };
    for role in alone {
        if let Some((Polled::Leader { preempt_alone, .. }, _)) = found.get_mut(&role) {
            *preempt_alone = true;
        }
    }
}
