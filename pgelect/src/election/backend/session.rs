//! The session backend: its campaign (lock wait, term bump, handover) and
//! its statements and behaviour while leading ([`SessionKeep`]: renewal
//! scoped to the backend pid, heartbeats, a dead connection ends
//! leadership, release by clearing the row and unlocking).
//!
//! The leader's loop is the shared [`driver`](crate::election::driver);
//! all timing decisions are taken by the pure
//! [`Keeper`](crate::election::keeper::Keeper).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use tracing::Instrument;

use crate::conn::{DedicatedConnection, Notice};
use crate::election::config_error::ConfigError;
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::lock::holders::{query_holders, SquatWatch};
use crate::metrics;
use crate::schema::check_schema;

use super::shared::{BatchMember, Batched, Election, Polled, SharedSession};
use crate::election::config::watch_key;
use crate::election::driver::{
    Activation, Answer, Failed, Keep, KeepBackend, Preferred, Statement,
};
use crate::election::keeper::{Keeper, Liveness};
use crate::election::leadership::{LeaderContext, LeaderState, Leadership};
use crate::election::registry::{self, yield_pause, Register, Waits};
use crate::election::support::{
    check_not_transaction_pooled, is_read_only, is_transient, retry_backoff, sleep_until_woken,
    Counted, WakeLimit, WakeOn,
};
use crate::election::term::{next_term_sql, previous_holder_sql};
use crate::election::watch::{
    preempt_zombie, read_leader, read_leader_and_mode, LeaderInfo, LEADER_CHANNEL, RESIGN_CHANNEL,
};
use crate::election::{Backend, ElectorState, StandbyMode, Term};
use crate::loss::LossReason;

/// Campaigns until elected. Transient failures are retried with backoff;
/// configuration, schema, permission and pooler errors are returned.
pub(crate) async fn campaign(shared: &Arc<ElectorState>) -> Result<Leadership> {
    let span = tracing::info_span!("pgelect.campaign", role = %shared.role, node = %shared.node);
    async {
        let mut failures = 0u32;
        let mut yields = 0u32;
        loop {
            match Box::pin(attempt(shared)).await {
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
enum Attempt {
    /// Elected, and the handover delay (if any) has passed.
    Elected(Leadership),
    /// Lost during the handover delay: stand again.
    Again,
    /// Granted the lock while a ready candidate of higher priority waited:
    /// gave it back without a new term.
    Yielded,
}

/// The connection a candidate stands on.
// One per campaign, built once and borrowed: the size difference costs
// nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub(crate) enum LockConn {
    /// Its own: dropped leadership kills it (the server releases the lock),
    /// a clean release keeps it for the next campaign.
    Own(DedicatedConnection),
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
    /// Lets go of `key` without a clean release: the lease row still names
    /// this candidate, so the next leader waits the handover delay.
    fn abandon(&self, key: LockKey) {
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
                    let (classid, objid, objsubid) = key.pg_locks_ids();
                    let sql = format!(
                        "SELECT CASE WHEN EXISTS (
                             SELECT 1 FROM pg_locks
                              WHERE locktype = 'advisory' AND pid = pg_backend_pid()
                                AND granted AND mode = 'ExclusiveLock' AND classid = {classid}
                                AND objid = {objid} AND objsubid = {objsubid})
                         THEN pg_advisory_unlock({}) ELSE true END",
                        key.sql_args(1)
                    );
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

/// Undoes a campaign dropped half-way, unless disarmed: its own connection
/// is killed (no waiting backend left behind); on a shared connection the
/// role's lock is released if it was taken.
struct KillOnDrop<'a> {
    conn: Option<&'a LockConn>,
    key: LockKey,
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

/// Opens and prepares a lock connection: session settings, schema and
/// pooler checks, and the election statement planned once.
async fn lock_connection(
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

async fn attempt(shared: &Arc<ElectorState>) -> Result<Attempt> {
    let schema = shared.options.schema_name().clone();
    let s = schema.as_str();
    let elect = ElectStatement::new(shared);
    let session = shared
        .session()
        .expect("BUG: the session backend campaigns for session electors only");
    let register = Register::new(
        shared,
        match session.standby {
            StandbyMode::Blocking => Waits::Blocking,
            StandbyMode::Polling { .. } => Waits::Polling,
        },
    );
    let conn = match &session.host {
        Some(host) => LockConn::Shared(Box::pin(host.client().get()).await?),
        // The connection of this elector's last clean release, if it is
        // still open: warmed up and checked already, no backend to start.
        None => LockConn::Own(match session.take_spare() {
            Some(conn) => conn,
            None => Box::pin(lock_connection(shared, &elect)).await?,
        }),
    };
    let mut guard = KillOnDrop {
        conn: Some(&conn),
        key: shared.key,
    };

    let key = shared.key;
    let params = key.params();
    let args: Vec<(&(dyn ToSql + Sync), Type)> = params.iter().map(|p| p.as_sql()).collect();
    let wait_started = Instant::now();
    match session.standby {
        StandbyMode::Blocking => Box::pin(wait_blocking(shared, &conn, &register)).await?,
        StandbyMode::Polling { interval } => {
            match &conn {
                // On a shared connection, one statement registers the
                // standbys of many roles: the leaders' renewals and
                // heartbeats on it must not queue behind a thousand
                // registrations. A failed batch is run alone (a few at a
                // time) to learn and report this role's error.
                LockConn::Shared(session) => {
                    if !session.register(register.entry(shared)).await {
                        let _turn = session.campaign_turn().await;
                        Box::pin(register.run(shared, &conn)).await?;
                    }
                }
                LockConn::Own(_) => Box::pin(register.run(shared, &conn)).await?,
            }
            match &conn {
                LockConn::Own(own) => {
                    Box::pin(poll_for_lock(shared, own, interval, &args, true)).await?
                }
                LockConn::Shared(session) => {
                    Box::pin(poll_in_batch(shared, session, interval, &args)).await?
                }
            }
        }
    }
    metrics::squatters(&shared.role, 0);
    tracing::debug!(waited = ?wait_started.elapsed(), "lock granted");
    let granted_at = Instant::now();

    // The term bump and the lease row, in one transaction. LISTEN for
    // resign requests commits with it: requests are delivered from the
    // moment the row names us, and none meant for the previous leader.
    let (elected, notices, sent_at) = match &conn {
        LockConn::Own(own) => {
            let sent_at = Instant::now();
            let notices = own.notices();
            // The three requests are pipelined (sent in this order in one
            // go, run in order by the server): one round trip, not three.
            let listen = format!("BEGIN; LISTEN {RESIGN_CHANNEL}");
            // Boxed, as the other long or rare steps of an attempt: a
            // standby's future, thousands of them on a shared connection,
            // holds only the step it waits in.
            let (begun, elected, committed) = Box::pin(async {
                tokio::join!(
                    own.client().batch_execute(&listen),
                    elect.run(shared, own),
                    own.client().batch_execute("COMMIT"),
                )
            })
            .await;
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
            (elected, notices, sent_at)
        }
        LockConn::Shared(c) => {
            // Other roles' statements run on this connection too: no
            // explicit transaction, one statement. The connection listens
            // for resign requests all along and hands this role's to this
            // candidate from the subscription on: one sent just before
            // this term costs at most an early check of the row, which
            // carries the request only if it names this term.
            let hints = c.hints(&registry::hint_payload(s, &shared.role));
            // One statement elects every role of this connection granted
            // meanwhile. The deadline counts from its sending: a wait for
            // it is no time led.
            match c.elect(elect.entry(shared)).await {
                Some((sent_at, row)) => (elect.outcome(shared, &row, 1)?, hints, sent_at),
                None => {
                    // Failed: alone, a few at a time, to learn this role's
                    // error (a failed statement wrote nothing).
                    let _turn = c.campaign_turn().await;
                    let sent_at = Instant::now();
                    let elected = Box::pin(elect.run(shared, c)).await?;
                    (elected, hints, sent_at)
                }
            }
        }
    };
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
            let _turn = match &conn {
                LockConn::Shared(c) => Some(c.campaign_turn().await),
                LockConn::Own(_) => None,
            };
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
            if let LockConn::Own(own) = conn {
                session.put_spare(own);
            }
            return Ok(Attempt::Yielded);
        }
    };
    let unclean = elected.previous_holder.is_some();
    if let Some(prev) = &elected.previous_holder {
        tracing::info!(term = elected.term.get(), previous = %prev, delay = ?shared.timing.handover_delay,
            "elected after an unclean loss; waiting the handover delay before acting");
    } else {
        tracing::info!(
            term = elected.term.get(),
            "elected after a clean release; acting at once"
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
fn start_keep(
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
    let keep = Keep {
        shared: shared.clone(),
        backend: SessionKeep::new(shared.clone(), conn, term.get()),
        keeper,
        state: state.clone(),
        commands: rx,
        notices,
        activation: Activation::Pending {
            tx: activated_tx,
            granted_at,
        },
        count_leading: true,
    };
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
enum Place {
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

/// The statement of a slice of the wait for the watch key: `$1` the watch
/// key, `$2` the slice (ms), `$3` the grace (ms: the TTL), `$4`..`$6` the
/// watch key's `pg_locks` ids. One jsonb value: `{"granted": true}`; or,
/// after a slice that timed out, the key's holder (`pid`; `ours`: of this
/// database user; `ended`: terminated here because its session had done
/// nothing for the grace, a watch frozen (or stuck) for a TTL); `{}` when
/// nobody holds it.
///
/// The holder is looked up after the wait (`CASE` runs its branches in
/// order; the sub-select is run only when its branch is taken), on the
/// wall clock (`now()` is the statement's start, a slice earlier). A
/// healthy watch is `active` for the whole of each of its slices (it waits
/// on the role's lock inside a statement) and idle only for the moment
/// between two of them and while it reads the row, so it is never idle for
/// a TTL, whatever `check_every` is; one that is has no term (it lets go of
/// the watch key before its term transaction) and ending it costs nobody
/// anything.
fn queue_slice_sql(s: &str) -> String {
    format!(
        "SELECT CASE WHEN {s}.lock_wait_slice($1, $2) THEN '{{\"granted\": true}}'::jsonb
                ELSE coalesce((
                    SELECT pg_catalog.jsonb_build_object(
                               'pid', k.pid,
                               'ours', a.usename IS NOT DISTINCT FROM session_user,
                               'ended', CASE WHEN a.usename = session_user
                                              AND a.state IN ('idle', 'idle in transaction',
                                                              'idle in transaction (aborted)')
                                              AND a.state_change < pg_catalog.clock_timestamp()
                                                                   - $3 * interval '1 millisecond'
                                             THEN pg_catalog.pg_terminate_backend(k.pid)
                                             ELSE false END)
                      FROM pg_catalog.pg_locks k
                      LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = k.pid
                     WHERE k.locktype = 'advisory' AND k.granted AND k.mode = 'ExclusiveLock'
                       AND k.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                          WHERE d.datname = pg_catalog.current_database())
                       AND k.classid = $4 AND k.objid = $5 AND k.objsubid = $6
                       AND k.pid <> pg_catalog.pg_backend_pid()
                     LIMIT 1), '{{}}'::jsonb) END"
    )
}

/// Milliseconds of a validated duration (at most 24 h) for an `int4`.
fn slice_ms(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// Awaits `slice`, with `first` (the registration, pipelined ahead of the
/// first slice: the server runs the slice right after the registration
/// commits, so a leader woken by its hint finds this candidate already
/// waiting) if it is still to run.
async fn after_registration<T>(
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
async fn wait_blocking(
    shared: &Arc<ElectorState>,
    conn: &LockConn,
    register: &Register,
) -> Result<()> {
    let schema = shared.options.schema_name().clone();
    let s = schema.as_str();
    if let LockConn::Own(own) = conn {
        *shared
            .lock_server
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = own.server().cloned();
    }
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
                        watch_ms
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
            Ok(Ok(true)) => {
                if place == Place::Watch {
                    let unlocked: bool = conn
                        .client()
                        .query_typed_one("SELECT pg_advisory_unlock($1)", &[(&w, Type::INT8)])
                        .await
                        .and_then(|row| row.try_get(0))
                        .map_err(|e| Error::db("let go of the role's watch key", s, e))?;
                    if !unlocked {
                        tracing::debug!("the role's watch key was not held at election");
                    }
                }
                return Ok(());
            }
            Ok(Ok(false)) => {
                // A slice passed without the lock: look at the row, and
                // (the watch) preempt a zombie or leave a read-only server.
                let (leader, read_only) =
                    read_leader_and_mode(conn.client(), &schema, &shared.role).await?;
                let row_pid = leader.as_ref().and_then(|l| l.holder_pid);
                let vacant = leader.as_ref().is_none_or(|l| l.lease_expired);
                if place == Place::Watch {
                    shared.publish(leader);
                    if read_only {
                        tracing::warn!(role = %shared.role, "the server became read-only (a demoted or fenced primary) while this standby waits on it; reconnecting");
                        return Err(Error::connection_lost(
                            "wait for the leader's lock: the server is read-only",
                        ));
                    }
                    if vacant
                        && preempt_zombie(
                            conn.client(),
                            &schema,
                            &shared.role,
                            shared.key,
                            &shared.preemption_refused,
                            shared.timing.ttl,
                        )
                        .await?
                        .is_some()
                    {
                        metrics::preempted_zombie(&shared.role);
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
enum ElectOutcome {
    /// Recorded a new term.
    Elected(Elected),
    /// Wrote nothing: this ready candidate of higher priority waits.
    Yield(String),
}

struct Elected {
    term: Term,
    previous_holder: Option<String>,
    acquired_at: SystemTime,
    lease_until: SystemTime,
}

/// The statement that records a new term: bumps the term and writes the
/// lease row naming this candidate, returns the previous holder (set when
/// the last leader did not release cleanly) and notifies watchers.
///
/// The statement's text is built when it runs alone (on a connection of
/// the candidate's own, or after a failed batch): a shared connection's
/// thousands of candidates elect in its batched statement.
struct ElectStatement {
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

    /// The single election statement of `shared`'s role.
    fn sql(shared: &ElectorState) -> String {
        let s = shared.options.schema_name().as_str();
        // No FOR UPDATE in `old`: a row locked after `up` updated it in the
        // same statement is skipped, which hid the previous holder (and with
        // it the handover delay). The advisory lock already serialises
        // electors, and `up` locks the row itself.
        let (first, next) = (next_term_sql("0"), next_term_sql("l.term"));
        // `pref`: a ready candidate of strictly higher priority, read from
        // pg_locks in this very statement; if there is one, nothing is
        // written and the lock is given back.
        let pref = registry::preferred_session_sql(s, shared.key, "$1", "$2", "$6", true);
        let previous = previous_holder_sql("l");
        format!(
            "WITH pref AS (
                 SELECT {pref} AS node
             ), old AS (
                 SELECT {previous} AS holder FROM {s}.leaders l WHERE l.role = $1
             ), up AS (
                 INSERT INTO {s}.leaders AS l
                        (role, holder, holder_meta, term, backend, holder_pid, acquired_at, renewed_at, lease_until)
                 SELECT $1, $2, $3, {first}, 'session', pg_backend_pid(), now(), now(),
                        now() + $4 * interval '1 millisecond'
                  WHERE (SELECT node FROM pref) IS NULL
                 ON CONFLICT (role) DO UPDATE
                    SET holder = EXCLUDED.holder, holder_meta = EXCLUDED.holder_meta,
                        term = {next}, backend = EXCLUDED.backend,
                        holder_pid = EXCLUDED.holder_pid, acquired_at = EXCLUDED.acquired_at,
                        renewed_at = EXCLUDED.renewed_at, lease_until = EXCLUDED.lease_until,
                        resign_requested = false, lease_token = NULL
                  -- A live lease-backend leader is not protected by the advisory
                  -- lock: never take its row (all candidates of a role must use
                  -- one backend; refused below).
                  WHERE NOT (l.backend = 'lease' AND l.holder IS NOT NULL AND l.lease_until >= now())
                 RETURNING l.term, l.acquired_at, l.lease_until
             )
             SELECT up.term, (SELECT holder FROM old), up.acquired_at, up.lease_until,
                    CASE WHEN up.term IS NOT NULL THEN pg_notify('{LEADER_CHANNEL}', $5)::text END,
                    (SELECT node FROM pref)
               FROM (SELECT 1) AS one LEFT JOIN up ON true"
        )
    }

    fn args<'a>(&'a self, shared: &'a ElectorState) -> [(&'a (dyn ToSql + Sync), Type); 6] {
        [
            (&shared.role, Type::TEXT),
            (&shared.node, Type::TEXT),
            (&shared.meta, Type::JSONB),
            (&self.ttl_ms, Type::INT8),
            (&self.payload, Type::TEXT),
            (&shared.priority, Type::INT4),
        ]
    }

    /// Plans the statement without running it (`EXPLAIN`), before the lock
    /// wait. A new server backend loads the catalog entries of the lease
    /// table, its indexes and the functions on first use: about 1.5 ms of a
    /// 2-core machine's time (measured with pgbench), which would otherwise
    /// fall between the lock grant and the new term.
    async fn warm_up(&self, shared: &ElectorState, conn: &DedicatedConnection) -> Result<()> {
        let s = shared.options.schema_name().as_str();
        conn.client()
            .query_typed(
                &format!("EXPLAIN {}", Self::sql(shared)),
                &self.args(shared),
            )
            .await
            .map_err(|e| Error::db("prepare the election statement", s, e))?;
        Ok(())
    }

    async fn run(&self, shared: &ElectorState, conn: &DedicatedConnection) -> Result<ElectOutcome> {
        let s = shared.options.schema_name().as_str();
        let row = conn
            .client()
            .query_typed_one(&Self::sql(shared), &self.args(shared))
            .await
            .map_err(|e| Error::db("record the new term", s, e))?;
        self.outcome(shared, &row, 0)
    }

    /// This election as an entry of a shared session's batched election,
    /// which does what this statement does, for many roles at once.
    fn entry(&self, shared: &ElectorState) -> Election {
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
    fn outcome(&self, shared: &ElectorState, row: &Row, at: usize) -> Result<ElectOutcome> {
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

async fn poll_for_lock(
    shared: &ElectorState,
    conn: &DedicatedConnection,
    interval: Duration,
    args: &[(&(dyn ToSql + Sync), Type)],
    listen: bool,
) -> Result<()> {
    let schema = shared.options.schema_name();
    let s = schema.as_str();
    let mut notices = conn.notices();
    if listen {
        conn.client()
            .batch_execute(&format!("LISTEN {LEADER_CHANNEL}"))
            .await
            .map_err(|e| Error::db("listen for leader changes", s, e))?;
    }
    // Each poll also proves, every few seconds, that this standby still
    // polls (see the registry): a row that stops being refreshed is not
    // ready, so nobody hands over or yields to a candidate that is gone.
    let sql = registry::poll_sql(s, &shared.key.sql_args(1));
    let refresh_ms = registry::polling_refresh(interval).as_millis() as i64;
    let mut poll_args: Vec<(&(dyn ToSql + Sync), Type)> = args.to_vec();
    poll_args.push((&shared.role, Type::TEXT));
    poll_args.push((&shared.node, Type::TEXT));
    poll_args.push((&refresh_ms, Type::INT8));
    let mut squat = SquatWatch::default();
    // Release notifications wake the standby early; anyone may send them.
    let mut wakes = WakeLimit::default();
    loop {
        let granted: bool = conn
            .client()
            .query_typed_one(&sql, &poll_args)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(|e| Error::db("try the leader's lock", s, e))?;
        shared.contact.touch();
        if granted {
            if listen {
                conn.client()
                    .batch_execute(&format!("UNLISTEN {LEADER_CHANNEL}"))
                    .await
                    .map_err(|e| Error::db("stop listening", s, e))?;
            }
            return Ok(());
        }
        let info = read_leader(conn.client(), schema, &shared.role).await?;
        // The lock is taken but no live lease names its holder: a zombie
        // leader, or a candidate frozen before its term.
        if info.as_ref().is_none_or(|i| i.lease_expired) {
            if let Some(pid) = preempt_zombie(
                conn.client(),
                schema,
                &shared.role,
                shared.key,
                &shared.preemption_refused,
                shared.timing.ttl,
            )
            .await?
            {
                metrics::preempted_zombie(&shared.role);
                tracing::debug!(pid, "preempted; trying the lock again");
                continue;
            }
        }
        if squat.due(std::time::Instant::now()) {
            let row_pid = info.as_ref().and_then(|i| i.holder_pid);
            check_squatters(shared, conn, &mut squat, row_pid).await?;
        }
        shared.publish(info);
        let released = WakeOn::Released {
            schema: s,
            role: &shared.role,
        };
        let until = Instant::now() + interval;
        tokio::select! {
            _ = conn.closed().cancelled() => {
                return Err(Error::connection_lost("wait for the leader's lock"));
            }
            // A closed channel ends the nap: try the lock again.
            _ = sleep_until_woken(until, &mut notices, released, &mut wakes, || Duration::ZERO) => {}
        }
    }
}

/// A polling standby on a shared connection: waits in the session's
/// batched poll (one statement tries the locks of all its standbys) until
/// this role's lock is granted. Publishes the leader row when it changes;
/// zombie preemption is the session's, one statement per poll for every
/// vacant row (the standby preempts alone only where that statement leaves
/// it to the role); on a failed batch polls alone once to learn (and
/// return) the error.
///
/// Unlike a standby on its own connection it does not look for squatters
/// (sessions other than the named leader holding the role's key): that is
/// a statement per role, which a connection standing for thousands of
/// roles cannot afford at every poll.
async fn poll_in_batch(
    shared: &ElectorState,
    session: &Arc<SharedSession>,
    interval: Duration,
    args: &[(&(dyn ToSql + Sync), Type)],
) -> Result<()> {
    let schema = shared.options.schema_name();
    let s = schema.as_str();
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
            Polled::Granted => return Ok(()),
            Polled::Leader {
                info,
                preempt_alone,
            } => {
                shared.publish(info);
                // The session's batched preemption ran for this vacant
                // row; it leaves to the role what it cannot do for all (a
                // holder of another database user: may this one end it?).
                if preempt_alone {
                    let _turn = session.campaign_turn().await;
                    if let Some(pid) = preempt_zombie(
                        session.client(),
                        schema,
                        &shared.role,
                        shared.key,
                        &shared.preemption_refused,
                        shared.timing.ttl,
                    )
                    .await?
                    {
                        metrics::preempted_zombie(&shared.role);
                        tracing::debug!(pid, "preempted; trying the lock again");
                        session.poll_soon(Duration::ZERO);
                    }
                }
            }
            Polled::Failed => {
                // The single standby's poll, to learn this role's error (or
                // be granted after all); a few at a time.
                let _turn = session.campaign_turn().await;
                let sql = registry::poll_sql(s, &shared.key.sql_args(1));
                let mut poll_args: Vec<(&(dyn ToSql + Sync), Type)> = args.to_vec();
                poll_args.push((&shared.role, Type::TEXT));
                poll_args.push((&shared.node, Type::TEXT));
                poll_args.push((&refresh_ms, Type::INT8));
                let granted: bool = session
                    .client()
                    .query_typed_one(&sql, &poll_args)
                    .await
                    .and_then(|row| row.try_get(0))
                    .map_err(|e| Error::db("try the leader's lock", s, e))?;
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
async fn check_squatters(
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

/// A leader's own renewal: `$1` role, `$2` node, `$3` term, `$4` ttl ms,
/// `$5` priority. Every renewal also reads the candidate registry: a ready
/// candidate of strictly higher priority makes the leader hand over.
///
/// The row is locked with `SKIP LOCKED`, never waited for: a fenced
/// transaction of this leader's own (`pgelect.fence` holds the row `FOR
/// SHARE` until it ends) would otherwise hold the renewal back for as long
/// as it runs, past the fast profile's 25 ms answer limit (the chaos run
/// that showed it: the book's design notes, "Renewals and fenced
/// transactions"). A row that is still ours but locked comes back with
/// `renewed` false: the connection answered, the lease was not extended,
/// and the keeper retries soon ([`Answer::Busy`]). No row at all means it
/// is not ours.
fn renew_sql(shared: &ElectorState) -> String {
    let s = shared.options.schema_name().as_str();
    let ready = registry::preferred_session_sql(s, shared.key, "$1", "$2", "$5", true);
    let alive = registry::preferred_session_sql(s, shared.key, "$1", "$2", "$5", false);
    format!(
        "WITH o AS (
             SELECT role FROM {s}.leaders
              WHERE role = $1 AND holder = $2 AND term = $3 AND holder_pid = pg_backend_pid()
                FOR NO KEY UPDATE SKIP LOCKED
         ), u AS (
             UPDATE {s}.leaders l
                SET renewed_at = now(), lease_until = now() + $4 * interval '1 millisecond'
               FROM o
              WHERE l.role = o.role
             RETURNING l.renewed_at, l.lease_until, l.resign_requested
         )
         SELECT renewed_at, lease_until, resign_requested, {ready}, {alive} IS NOT NULL,
                true AS renewed
           FROM u
         UNION ALL
         SELECT l.renewed_at, l.lease_until, l.resign_requested, NULL::text, false, false
           FROM {s}.leaders l
          WHERE l.role = $1 AND l.holder = $2 AND l.term = $3
            AND l.holder_pid = pg_backend_pid() AND NOT EXISTS (SELECT FROM u)"
    )
}

/// Plans the renewal without running it (`EXPLAIN`), before the lock
/// wait, for the reason [`ElectStatement::warm_up`] gives: the first
/// renewal on a new backend otherwise also loads the registry's catalog
/// entries, which under the fast profile's 25 ms answer limit cost
/// leaders their first renewal (the book's design notes, "Renewals and
/// fenced transactions").
async fn warm_up_renewal(shared: &ElectorState, conn: &DedicatedConnection) -> Result<()> {
    let s = shared.options.schema_name().as_str();
    let ttl_ms = shared.timing.ttl.as_millis() as i64;
    conn.client()
        .query_typed(
            &format!("EXPLAIN {}", renew_sql(shared)),
            &[
                (&shared.role, Type::TEXT),
                (&shared.node, Type::TEXT),
                (&0i64, Type::INT8),
                (&ttl_ms, Type::INT8),
                (&shared.priority, Type::INT4),
            ],
        )
        .await
        .map_err(|e| Error::db("prepare the renewal", s, e))?;
    Ok(())
}

/// How the session backend keeps a leadership: on the lock connection,
/// renewing the lease row (scoped to holder, term and backend pid) and
/// heartbeating; the connection's death ends leadership at once.
struct SessionKeep {
    shared: Arc<ElectorState>,
    conn: LockConn,
    renew_sql: String,
    ttl_ms: i64,
    term: i64,
    /// On a shared connection: this leader's place in the session's
    /// batched renewal (one statement renews every leader on it).
    batch: Option<BatchMember>,
}

impl SessionKeep {
    fn new(shared: Arc<ElectorState>, conn: LockConn, term: i64) -> SessionKeep {
        let renew_sql = renew_sql(&shared);
        let ttl_ms = shared.timing.ttl.as_millis() as i64;
        // A renewal request waits a little for others to share its batch;
        // the keeper's answer limit (the heartbeat timeout) runs from the
        // request, so the wait is a small part of it. Leaders renewed by
        // one batch ask again at the same moment (each is handed every
        // batch's outcome), so a short wait is enough.
        let share_wait = (shared.timing.heartbeat_timeout / 10).min(Duration::from_millis(20));
        let batch = match &conn {
            LockConn::Shared(session) => Some(session.join_batch(
                &shared.role,
                &shared.node,
                term,
                ttl_ms,
                shared.priority,
                shared.key,
                share_wait,
            )),
            LockConn::Own(_) => None,
        };
        SessionKeep {
            shared,
            conn,
            renew_sql,
            ttl_ms,
            term,
            batch,
        }
    }

    /// This leader's own renewal statement.
    async fn renew_alone(&self) -> (Instant, Result<Answer>) {
        let sent = Instant::now();
        let r = self
            .conn
            .client()
            .query_typed(
                &self.renew_sql,
                &[
                    (&self.shared.role, Type::TEXT),
                    (&self.shared.node, Type::TEXT),
                    (&self.term, Type::INT8),
                    (&self.ttl_ms, Type::INT8),
                    (&self.shared.priority, Type::INT4),
                ],
            )
            .await
            .and_then(|rows| renewal(&rows))
            .map_err(|e| Error::db("renew the lease", self.schema(), e));
        (sent, r)
    }

    fn schema(&self) -> &str {
        self.shared.options.schema_name().as_str()
    }
}

/// What a batched renewal found, as the keeper's answer.
fn batched_answer(b: Batched) -> Answer {
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

/// Whether `SHOW transaction_read_only` said `on`.
fn read_only_answer(msgs: &[tokio_postgres::SimpleQueryMessage]) -> bool {
    msgs.iter().any(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0) == Some("on"),
        _ => false,
    })
}

/// The renewal's rows: one if the lease is still ours (renewed, or busy
/// when the row was locked), none otherwise.
fn renewal(rows: &[Row]) -> std::result::Result<Answer, tokio_postgres::Error> {
    match rows {
        [row] if !row.try_get::<_, bool>(5)? => Ok(Answer::Busy),
        [row] => Ok(Answer::Renewed {
            row: Some((row.try_get(0)?, row.try_get(1)?)),
            resign_requested: row.try_get(2)?,
            preferred: Preferred {
                ready: row.try_get(3)?,
                pending: row.try_get(4)?,
            },
        }),
        _ => Ok(Answer::NotOurs),
    }
}

impl KeepBackend for SessionKeep {
    const FINISH_IN_FLIGHT_BEFORE_RELEASE: bool = false;

    fn renew(&self) -> Statement<'_> {
        Box::pin(async move {
            let Some(batch) = &self.batch else {
                return self.renew_alone().await;
            };
            let requested = Instant::now();
            match batch.renewal(requested).await {
                Some((sent, Batched::Failed)) => {
                    // Run alone to learn (and report) why it failed.
                    tracing::debug!(batch_sent = ?sent, "the batched renewal failed; renewing alone");
                    self.renew_alone().await
                }
                Some((sent, b)) => (sent, Ok(batched_answer(b))),
                None => (requested, Err(Error::connection_lost("renew the lease"))),
            }
        })
    }

    async fn pushed(&self) -> (Instant, Result<Answer>) {
        match &self.batch {
            Some(batch) => {
                let (sent, b) = batch.pushed().await;
                (sent, Ok(batched_answer(b)))
            }
            None => std::future::pending().await,
        }
    }

    fn heartbeat(&self) -> Statement<'_> {
        let share_wait = (self.shared.timing.heartbeat_timeout / 4).min(Duration::from_millis(100));
        Box::pin(async move {
            let sent = Instant::now();
            // On a shared connection, one heartbeat answers all its leaders;
            // a failed one is run again here to get the error to report.
            if let LockConn::Shared(session) = &self.conn {
                if session.heartbeat_answered(sent, share_wait).await {
                    return (sent, Ok(Answer::Alive));
                }
            }
            // `transaction_read_only` is on in a standby and on a primary
            // fenced with `default_transaction_read_only`: a lock there
            // protects nothing.
            let r = self
                .conn
                .client()
                .simple_query("SHOW transaction_read_only")
                .await
                .map(|msgs| match read_only_answer(&msgs) {
                    true => Answer::ReadOnly,
                    false => Answer::Alive,
                })
                .map_err(|e| Error::db("renew the lease", self.schema(), e));
            (sent, r)
        })
    }

    async fn answered(&self) -> Instant {
        match &self.conn {
            LockConn::Shared(session) => session.next_answer().await,
            LockConn::Own(_) => std::future::pending().await,
        }
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
        if let Some(b) = &self.batch {
            b.leave();
        }
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

    async fn release(self, _ended: Option<LossReason>) -> Result<()> {
        if let Some(b) = &self.batch {
            b.leave();
        }
        let bound = self.shared.timing.heartbeat_timeout * 2;
        let released = release(&self.shared, &self.conn, self.term);
        let result = match tokio::time::timeout(bound, released).await {
            Ok(r) => r,
            Err(_) => Err(Error::connection_lost("release the leadership")),
        };
        match &result {
            Ok(()) => {
                // Kept for this elector's next campaign rather than
                // closed now: a backend ending on the server is work
                // that would compete with the successor's election
                // (measured in the failover benchmark); it is closed
                // when the elector is dropped.
                if let (LockConn::Own(own), Some(session)) = (self.conn, self.shared.session()) {
                    session.put_spare(own);
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

async fn release(shared: &ElectorState, conn: &LockConn, term: i64) -> Result<()> {
    let s = shared.options.schema_name().as_str();
    let sql = format!(
        "WITH c AS (
             UPDATE {s}.leaders
                SET holder = NULL, holder_pid = NULL, holder_meta = NULL,
                    renewed_at = now(), lease_until = now()
              WHERE role = $1 AND holder = $2 AND term = $3
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM c), pg_notify('{LEADER_CHANNEL}', $4)::text"
    );
    let payload = format!("{s}:released:{}", shared.role);
    let params = shared.key.params();
    let args: Vec<(&(dyn ToSql + Sync), Type)> = params.iter().map(|p| p.as_sql()).collect();
    let unlock_sql = format!("SELECT pg_advisory_unlock({})", shared.key.sql_args(1));
    // Pipelined: the clearing transaction commits before the unlock runs
    // (the server runs them in order), in one round trip.
    let clear_args: [(&(dyn ToSql + Sync), Type); 4] = [
        (&shared.role, Type::TEXT),
        (&shared.node, Type::TEXT),
        (&term, Type::INT8),
        (&payload, Type::TEXT),
    ];
    // A listening backend that does not read (a later lock wait) would
    // hold back the server's notification queue. A shared connection
    // listens for its whole life and never waits.
    let unlisten = match conn {
        LockConn::Own(_) => format!("UNLISTEN {RESIGN_CHANNEL}"),
        LockConn::Shared(_) => String::new(),
    };
    let (cleared, unlocked, unlistened) = tokio::join!(
        conn.client().query_typed_one(&sql, &clear_args),
        conn.client().query_typed_one(&unlock_sql, &args),
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
    unlistened.map_err(|e| Error::db("stop listening for resign requests", s, e))?;
    Ok(())
}
