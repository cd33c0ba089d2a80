//! The lease backend: its statements ([`LeaseSql`]), its campaign (take the
//! lease when it is free or expired on the server's clock), its behaviour
//! while leading ([`LeaseKeep`]: renewals retried until the deadline on a
//! connection reopened at will, release) and the optional `LISTEN`
//! connection.
//!
//! Every step is one statement, hence one transaction, so the backend works
//! through PgBouncer in transaction mode: no session state (no advisory
//! lock, no `SET`, no named prepared statement — `query_typed` uses the
//! unnamed statement) is relied upon between two statements. Every time
//! comparison uses the server's `now()`, and the remaining lease is computed
//! by the server, so the candidates' clocks never need to agree.
//!
//! The leader's loop is the shared [`driver`](crate::election::driver); all
//! decisions about the leader's deadline are taken by the pure
//! [`Keeper`](crate::election::keeper::Keeper), with
//! [`Liveness::statements`](crate::election::keeper::Liveness::statements)
//! (no heartbeats, each statement bounded here).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::conn::{ConnectOptions, DedicatedConnection, Notice};
use crate::error::{Error, Result};
use crate::metrics;
use crate::schema::{check_schema, SchemaName};

use crate::election::config::random_u64;
use crate::election::driver::{
    Activation, Answer, Failed, Keep, KeepBackend, Preferred, Statement,
};
use crate::election::keeper::{Action, Keeper, Liveness};
use crate::election::leadership::{LeaderContext, LeaderState, Leadership, LossReason};
use crate::election::registry::{self, Register, Waits};
use crate::election::support::{
    backoff, is_read_only, is_transient, listen_for, nap, NapEnd, WakeLimit, WakeOn,
};
use crate::election::term::{next_term_sql, rearm_lease_sql, stale_row_sql, TIMELINE_SQL};
use crate::election::timing::Timing;
use crate::election::watch::{LeaderInfo, LEADER_CHANNEL, RESIGN_CHANNEL};
use crate::election::{LeaseState, Shared, Term};

use super::shared_lease::{renewal_answer, RenewMember, Renewal, SharedLease};

/// The largest jitter added to a standby's wake-up after the lease's
/// server-reported expiry, so that standbys do not all fire at once. A
/// twentieth of the TTL below a TTL of 1 s (25 ms at 500 ms), so that a
/// short lease is taken over within `ttl` + 50 ms, round trips included.
pub(crate) const MAX_JITTER: Duration = Duration::from_millis(50);

fn max_jitter(ttl: Duration) -> Duration {
    MAX_JITTER.min(ttl / 20)
}

/// The lease backend's three statements, exactly as the driver sends them.
///
/// Exposed (hidden from the docs) so that integration tests run the very
/// statements the driver runs. Parameters:
///
/// * `acquire`: `$1` role (text), `$2` node (text), `$3` holder meta
///   (jsonb), `$4` ttl in ms (int8), `$5` NOTIFY payload (text), `$6` a
///   random token for this attempt (int8), `$7` the tokens of this
///   campaign's earlier attempts that got no answer (int8[]): a lease one of
///   them took is taken again; `$8` this candidate's priority (int4): a free
///   or expired lease is not taken while a ready candidate of strictly
///   higher priority is registered. One row:
///   won term (int8, NULL if not won), acquired_at, lease_until, remaining
///   ms of our new lease (float8), then the row as it was before: holder,
///   backend, remaining ms (float8, negative if expired); then the NOTIFY
///   (text) and the preferred candidate it deferred to (text, NULL if none).
/// * `renew`: `$1` role, `$2` node, `$3` term (int8), `$4` ttl ms, `$5`
///   priority (int4). A row (remaining ms, resign_requested, the node of a
///   ready candidate of strictly higher priority or NULL) if the lease is
///   still ours; none otherwise.
/// * `release`: `$1` role, `$2` node, `$3` term, `$4` NOTIFY payload. One
///   row: the number of rows cleared (int8, 0 or 1).
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct LeaseSql {
    /// Takes the lease if free or expired (inserts the row with term 1 if
    /// missing).
    pub acquire: String,
    /// Renews the lease if holder and term are still ours.
    pub renew: String,
    /// Clears the holder if holder and term are still ours.
    pub release: String,
}

/// The lease statements for `schema`; see [`LeaseSql`].
#[doc(hidden)]
pub fn lease_sql(schema: &SchemaName) -> LeaseSql {
    let s = schema.as_str();
    // `cur` reads the row as of the statement's snapshot; the upsert locks
    // the latest version and re-checks its WHERE on it (READ COMMITTED), so
    // of concurrent candidates exactly one wins, whatever `cur` showed.
    let (first, next) = (next_term_sql("0"), next_term_sql("l.term"));
    let pref = registry::preferred_lease_sql(s, "$1", "$2", "$8");
    // `stale`: the row may lack the old primary's last writes (a promoted
    // server): it is re-armed for a full TTL instead of taken over, once
    // per timeline (see term.rs). `lost` rows (our own unanswered attempt)
    // are taken again as before: nobody acts on them.
    let tl = "(SELECT t FROM tl)";
    let stale_cur = stale_row_sql("l", tl);
    let rearm = rearm_lease_sql("l", "$4", tl);
    let acquire = format!(
        "WITH tl AS (
             SELECT {TIMELINE_SQL} AS t
         ), pref AS (
             SELECT {pref} AS node
         ), cur AS (
             SELECT l.holder, l.backend, l.lease_until,
                    {stale_cur} AND NOT coalesce(l.holder = $2 AND l.lease_token = ANY($7), false) AS stale
               FROM {s}.leaders l WHERE l.role = $1
         ), rearm AS (
             UPDATE {s}.leaders AS l SET {rearm}
              WHERE l.role = $1 AND coalesce((SELECT stale FROM cur), false) AND {stale_cur}
             RETURNING l.lease_until
         ), up AS (
             INSERT INTO {s}.leaders AS l
                    (role, holder, holder_meta, term, backend, holder_pid,
                     acquired_at, renewed_at, lease_until, resign_requested, lease_token)
             SELECT $1, $2, $3, {first}, 'lease', NULL, now(), now(),
                    now() + $4 * interval '1 millisecond', false, $6
              WHERE NOT coalesce((SELECT stale FROM cur), false)
             ON CONFLICT (role) DO UPDATE
                SET holder = EXCLUDED.holder, holder_meta = EXCLUDED.holder_meta,
                    term = {next}, backend = 'lease', holder_pid = NULL,
                    acquired_at = EXCLUDED.acquired_at, renewed_at = EXCLUDED.renewed_at,
                    lease_until = EXCLUDED.lease_until, resign_requested = false,
                    lease_token = EXCLUDED.lease_token
              WHERE ((l.holder IS NULL AND l.lease_timeline IS DISTINCT FROM {tl}
                      OR l.lease_until IS NULL OR l.lease_until < now())
                     AND NOT {stale_cur}
                     -- a preferred candidate stands: leave the lease to it
                     AND (SELECT node FROM pref) IS NULL)
                 -- a lease taken by one of our own unanswered attempts:
                 -- nobody acts on it, take it again with a new term
                 OR (l.holder = $2 AND l.lease_token = ANY($7::int8[]))
             RETURNING l.term, l.acquired_at, l.lease_until
         )
         SELECT up.term, up.acquired_at, up.lease_until,
                (extract(epoch FROM up.lease_until - now()) * 1000)::float8,
                CASE WHEN rearm.lease_until IS NOT NULL THEN coalesce(cur.holder, '') ELSE cur.holder END,
                cur.backend,
                (extract(epoch FROM coalesce(rearm.lease_until, cur.lease_until) - now()) * 1000)::float8,
                CASE WHEN up.term IS NOT NULL THEN pg_notify('{LEADER_CHANNEL}', $5)::text END,
                CASE WHEN up.term IS NULL THEN (SELECT node FROM pref) END,
                rearm.lease_until IS NOT NULL
           FROM (SELECT 1) AS one
           LEFT JOIN up ON true
           LEFT JOIN cur ON true
           LEFT JOIN rearm ON true"
    );
    // `greatest`: a renewal that was given up on the client but ran late on
    // the server (after a retry on a new connection) never moves the lease
    // back in time below what a later renewal promised.
    let renew = format!(
        "UPDATE {s}.leaders
            SET renewed_at = greatest(renewed_at, now()),
                lease_until = greatest(lease_until, now() + $4 * interval '1 millisecond')
          WHERE role = $1 AND holder = $2 AND term = $3
         RETURNING (extract(epoch FROM lease_until - now()) * 1000)::float8, resign_requested,
                   {}",
        registry::preferred_lease_sql(s, "$1", "$2", "$5")
    );
    let release = format!(
        "WITH c AS (
             UPDATE {s}.leaders
                SET holder = NULL, holder_pid = NULL, holder_meta = NULL, lease_token = NULL,
                    renewed_at = now(), lease_until = now(), resign_requested = false
              WHERE role = $1 AND holder = $2 AND term = $3
             RETURNING 1
         )
         SELECT count(*), CASE WHEN count(*) > 0 THEN pg_notify('{LEADER_CHANNEL}', $4)::text END
           FROM c"
    );
    LeaseSql {
        acquire,
        renew,
        release,
    }
}

fn ms(f: f64) -> Duration {
    if f.is_finite() && f > 0.0 {
        Duration::from_secs_f64((f / 1000.0).min(1e9))
    } else {
        Duration::ZERO
    }
}

/// The answer to the acquire statement.
struct Acquired {
    /// Won: the new term, `acquired_at` and `lease_until`.
    won: Option<(i64, SystemTime, SystemTime)>,
    /// The row as it was before: holder, backend, remaining ms.
    prev_holder: Option<String>,
    prev_backend: Option<String>,
    prev_remaining: Option<f64>,
    /// Not won because this ready candidate of higher priority stands.
    deferred_to: Option<String>,
    /// Not won because the row was last written before this server's
    /// promotion: its lease was re-armed for a full TTL.
    rearmed: bool,
}

impl Acquired {
    /// The statement returns exactly one row (a `LEFT JOIN` of a constant).
    /// No row (which the statement never returns) reads as "not won,
    /// nobody seen": the standby tries again shortly.
    fn decode(rows: &[Row]) -> std::result::Result<Acquired, tokio_postgres::Error> {
        let Some(row) = rows.first() else {
            return Ok(Acquired {
                won: None,
                prev_holder: None,
                prev_backend: None,
                prev_remaining: None,
                deferred_to: None,
                rearmed: false,
            });
        };
        let term: Option<i64> = row.try_get(0)?;
        let won = match term {
            Some(term) => Some((term, row.try_get(1)?, row.try_get(2)?)),
            None => None,
        };
        Ok(Acquired {
            won,
            prev_holder: row.try_get(4)?,
            prev_backend: row.try_get(5)?,
            prev_remaining: row.try_get(6)?,
            deferred_to: row.try_get(8)?,
            rearmed: row.try_get::<_, Option<bool>>(9)?.unwrap_or(false),
        })
    }
}

/// The lease state of an elector that campaigns with the lease backend.
fn lease_state(shared: &Shared) -> &LeaseState {
    shared
        .lease()
        .expect("BUG: the lease backend campaigns for lease electors only")
}

fn jitter(ttl: Duration) -> Duration {
    Duration::from_millis(random_u64() % (max_jitter(ttl).as_millis() as u64 + 1))
}

/// The least time allowed for connecting and for a standby's attempt.
const PATIENT_BOUND: Duration = Duration::from_secs(2);

/// The statements the lease backend sends: each has its time bound and its
/// metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LeaseOp {
    /// A trivial statement that opens the connection before the schema
    /// check.
    Connect,
    /// The `acquire` statement.
    Acquire,
    /// The `renew` statement.
    Renew,
    /// The `release` statement.
    Release,
    /// The candidate registry's upsert.
    Register,
}

impl LeaseOp {
    /// What pgelect was doing, for errors.
    fn operation(self) -> &'static str {
        match self {
            LeaseOp::Connect => "connect",
            LeaseOp::Acquire => "take the lease",
            LeaseOp::Renew => "renew the lease",
            LeaseOp::Release => "release the lease",
            LeaseOp::Register => "register as a candidate",
        }
    }

    /// The `kind` label of [`LEASE_STATEMENTS`](crate::metrics::LEASE_STATEMENTS).
    fn metric_kind(self) -> &'static str {
        match self {
            LeaseOp::Connect => "other",
            LeaseOp::Acquire => "acquire",
            LeaseOp::Renew => "renew",
            LeaseOp::Release => "release",
            LeaseOp::Register => "other",
        }
    }

    /// How long the statement (with connecting, if needed) may take.
    ///
    /// Renewals and releases are bounded by `heartbeat_timeout`, so that a
    /// leader retries within its deadline budget. Connecting, and a
    /// standby's attempt, may take longer on a loaded machine (a connection
    /// through PgBouncer with SCRAM took over 200 ms in CI) without risk:
    /// a deadline counts from before the connection, and a standby holds
    /// nothing while it waits.
    fn bound(self, timing: &Timing) -> Duration {
        match self {
            LeaseOp::Connect | LeaseOp::Acquire | LeaseOp::Register => patient(timing),
            LeaseOp::Renew | LeaseOp::Release => timing.heartbeat_timeout,
        }
    }
}

/// The bound of connecting and of a standby's attempt.
fn patient(timing: &Timing) -> Duration {
    timing.heartbeat_timeout.max(PATIENT_BOUND)
}

/// Runs one statement on the lease connection, (re)connecting first if
/// needed; the whole is bounded by the operation's bound
/// ([`LeaseOp::bound`]). On a timeout or a connection failure the
/// connection is dropped (the running statement cancelled), so the next
/// attempt starts on a fresh one.
async fn exec(
    shared: &Shared,
    conn: &mut Option<DedicatedConnection>,
    op: LeaseOp,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<Row>> {
    let schema = shared.options.schema_name().as_str();
    let operation = op.operation();
    let patient = patient(&shared.timing);
    let bound = op.bound(&shared.timing);
    if let Some(lease) = shared.lease() {
        lease.statements.fetch_add(1, AtomicOrdering::Relaxed);
    }
    metrics::lease_statement(&shared.role, op.metric_kind());
    let open = async {
        let purpose = format!("lease:{}:{}", shared.role, shared.node);
        shared.options.connect(&purpose).await
    };
    reopen(conn, patient, operation, open).await?;
    let c = conn.as_ref().expect("BUG: connected above");
    let run = async {
        c.client()
            .query_typed(sql, params)
            .await
            .map_err(|e| Error::db(operation, schema, e))
    };
    let r = tokio::time::timeout(bound, run).await;
    let rows = settle(conn, operation, r)?;
    shared.contact.touch();
    Ok(rows)
}

/// Opens a lease connection with `open`, bounded by `bound`, unless one is
/// open.
pub(super) async fn reopen(
    conn: &mut Option<DedicatedConnection>,
    bound: Duration,
    operation: &'static str,
    open: impl std::future::Future<Output = Result<DedicatedConnection>>,
) -> Result<()> {
    if conn.as_ref().is_some_and(|c| c.is_closed()) {
        conn.take();
    }
    if conn.is_none() {
        match tokio::time::timeout(bound, open).await {
            Ok(c) => *conn = Some(c?),
            Err(_) => return Err(Error::connection_lost(operation)),
        }
    }
    Ok(())
}

/// The result of a statement run on a lease connection within its bound.
/// After a timeout or a transient failure the connection is dropped (a
/// statement still running is cancelled on the server), so the next
/// statement starts on a fresh one.
pub(super) fn settle<T>(
    conn: &mut Option<DedicatedConnection>,
    operation: &'static str,
    r: std::result::Result<Result<T>, tokio::time::error::Elapsed>,
) -> Result<T> {
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            if is_transient(&e) {
                if let Some(c) = conn.take() {
                    c.kill();
                }
            }
            Err(e)
        }
        Err(_) => {
            if let Some(c) = conn.take() {
                // The statement may still run on the server: ask it to stop.
                let cancel = c.canceller();
                tokio::spawn(async move {
                    let _ = cancel.cancel().await;
                });
                c.kill();
            }
            Err(Error::connection_lost(operation))
        }
    }
}

/// Campaigns until elected. Transient failures (connection refused or
/// reset, pooler restarting, timeouts) are retried with backoff; a missing
/// schema, a permission error or a role held by the session backend are
/// returned.
pub(crate) async fn campaign(shared: &Arc<Shared>) -> Result<Leadership> {
    let span = tracing::info_span!("pgelect.campaign", role = %shared.role, node = %shared.node, backend = "lease");
    if let Some(host) = &lease_state(shared).host {
        return campaign_shared(shared, host.client())
            .instrument(span)
            .await;
    }
    async {
        let schema = shared.options.schema_name().clone();
        let s = schema.as_str();
        let sql = Arc::new(lease_sql(&schema));
        let mut notices = lease_state(shared).notices.subscribe();
        shared.ensure_lease_listener();
        let mut conn: Option<DedicatedConnection> = None;
        let mut failures = 0u32;
        let mut schema_checked = false;
        // Tokens of attempts that got no answer (timeout, lost connection):
        // one of them may have committed, leaving a lease with our name
        // that nobody acts on; the next attempts may take it again at once
        // instead of waiting a TTL for it to expire.
        let mut unanswered: Vec<i64> = Vec::new();
        let ttl_ms = shared.timing.ttl.as_millis() as i64;
        let payload = format!("{s}:elected:{}", shared.role);
        // Release notifications wake the standby early; anyone may send them.
        let mut wakes = WakeLimit::default();
        // The registry row is refreshed at most every ttl/2: readiness is
        // "seen within ttl" on the server's clock.
        let register = Register::new(shared, Waits::Lease);
        let mut registered_at: Option<Instant> = None;
        loop {
            let token = random_u64() as i64;
            let mut pending = false;
            let attempt = async {
                if !schema_checked {
                    let c = conn.as_ref().filter(|c| !c.is_closed());
                    if c.is_none() {
                        // exec connects; a trivial statement does it here.
                        exec(shared, &mut conn, LeaseOp::Connect, "SELECT 1", &[]).await?;
                    }
                    let c = conn.as_ref().expect("BUG: connected above");
                    // Bounded like every statement: a pooler may queue it
                    // for a long time while the server is down.
                    let checked = tokio::time::timeout(
                        patient(&shared.timing),
                        check_schema(c.client(), &schema),
                    )
                    .await;
                    match checked {
                        Ok(r) => r?,
                        Err(_) => {
                            if let Some(c) = conn.take() {
                                c.kill();
                            }
                            return Err(Error::connection_lost("check the schema"));
                        }
                    }
                    schema_checked = true;
                }
                if registered_at.is_none_or(|t| t.elapsed() >= shared.timing.ttl / 2) {
                    let (sql, args) = register.statement(shared);
                    exec(shared, &mut conn, LeaseOp::Register, &sql, &args).await?;
                    registered_at = Some(Instant::now());
                }
                let sent = Instant::now();
                let rows = exec(
                    shared,
                    &mut conn,
                    LeaseOp::Acquire,
                    &sql.acquire,
                    &[
                        (&shared.role, Type::TEXT),
                        (&shared.node, Type::TEXT),
                        (&shared.meta, Type::JSONB),
                        (&ttl_ms, Type::INT8),
                        (&payload, Type::TEXT),
                        (&token, Type::INT8),
                        (&unanswered, Type::INT8_ARRAY),
                        (&shared.priority, Type::INT4),
                    ],
                )
                .await
                .inspect_err(|e| {
                    if !matches!(e, Error::Database { source, .. } if source.as_db_error().is_some()) {
                        pending = true;
                    }
                })?;
                Ok::<_, Error>((sent, rows))
            };
            let outcome = attempt.await;
            if pending {
                if unanswered.len() >= 8 {
                    unanswered.remove(0);
                }
                unanswered.push(token);
            }
            let wait = match outcome {
                Ok((sent, rows)) => {
                    failures = 0;
                    let Acquired { won, prev_holder, prev_backend, prev_remaining, deferred_to, rearmed } = match Acquired::decode(&rows) {
                        Ok(a) => a,
                        Err(e) => {
                            if let Some(c) = conn.take() {
                                c.close().await;
                            }
                            return Err(Error::db(LeaseOp::Acquire.operation(), s, e));
                        }
                    };
                    if let Some((term, acquired_at, lease_until)) = won {
                        if prev_holder.is_some() && prev_backend.as_deref() == Some("session") {
                            tracing::warn!(previous = ?prev_holder, "took over an expired lease of a session-backend leader: all candidates of a role should use one backend");
                        }
                        if let Some(l) = elected(
                            shared,
                            Carrier::Own(conn.take()),
                            &sql,
                            Term::new(term),
                            sent,
                            acquired_at,
                            lease_until,
                        )
                        .await
                        {
                            return Ok(l);
                        }
                        Duration::ZERO
                    } else if let Some(preferred) = deferred_to {
                        // Free or expired, but left to a candidate of higher
                        // priority seen within its TTL; if it never takes
                        // it, its registration goes stale within a TTL.
                        tracing::debug!(%preferred, "lease free, left to a ready candidate of higher priority");
                        shared.timing.retry_every
                    } else {
                        let remaining = prev_remaining.unwrap_or(0.0);
                        if rearmed {
                            tracing::info!(holder = ?prev_holder, lease = ?ms(remaining), "the lease row was last written before this server's promotion and may lack the old primary's last renewals: re-armed it for a full TTL before anyone takes it over");
                        }
                        if prev_holder.is_some()
                            && prev_backend.as_deref() == Some("session")
                            && remaining > 0.0
                        {
                            return Err(Error::config(format!(
                                "role {:?} is held by {:?}, a leader using the session backend, but this candidate uses the lease backend: all candidates of a role must use the same backend",
                                shared.role,
                                prev_holder.unwrap_or_default()
                            )));
                        }
                        let left = if prev_holder.is_some() { ms(remaining) } else { Duration::ZERO };
                        tracing::trace!(holder = ?prev_holder, ?left, "lease held; sleeping until it expires");
                        (left + jitter(shared.timing.ttl)).min(shared.timing.retry_every)
                    }
                }
                Err(e) if is_transient(&e) => {
                    failures = failures.saturating_add(1);
                    let wait = backoff(failures).min(shared.timing.retry_every);
                    tracing::warn!(error = %e, retry_in = ?wait, "lease attempt failed; retrying");
                    wait
                }
                Err(e) => {
                    if let Some(c) = conn.take() {
                        c.close().await;
                    }
                    return Err(e);
                }
            };
            if wait.is_zero() {
                continue;
            }
            let until = Instant::now() + wait;
            let released = WakeOn::Released {
                schema: s,
                role: &shared.role,
            };
            // A few ms of jitter spread the standbys' attempts.
            let ttl = shared.timing.ttl;
            let end = nap(until, &mut notices, released, &mut wakes, || jitter(ttl) / 10).await;
            if end == NapEnd::ChannelClosed {
                // Never: the sender lives in `shared`.
                tokio::time::sleep_until(until).await;
            }
        }
    }
    .instrument(span)
    .await
}

/// Campaigns on a [`SharedLease`]: the client's batched acquire tries the
/// role at every poll; the first win that arrives in time is kept, with
/// this elector's renewals in the client's batched renewal.
async fn campaign_shared(shared: &Arc<Shared>, client: SharedLease) -> Result<Leadership> {
    let sql = Arc::new(lease_sql(shared.options.schema_name()));
    let mut failures = 0u32;
    loop {
        let mut member = client.join_standbys(shared);
        let won = match member.won().await {
            Ok(won) => won,
            Err(e) if is_transient(&e) => {
                // The client's task is gone (never while it lives): wait
                // and stand again.
                failures = failures.saturating_add(1);
                tokio::time::sleep(backoff(failures).min(shared.timing.retry_every)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        drop(member);
        if won.prev_holder.is_some() && won.prev_backend.as_deref() == Some("session") {
            tracing::warn!(previous = ?won.prev_holder, "took over an expired lease of a session-backend leader: all candidates of a role should use one backend");
        }
        if let Some(l) = elected(
            shared,
            Carrier::Shared(client.clone()),
            &sql,
            Term::new(won.term),
            won.sent,
            won.acquired_at,
            won.lease_until,
        )
        .await
        {
            return Ok(l);
        }
    }
}

/// What carries a new leader's statements.
// Built once per election and consumed at once: the size difference
// between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum Carrier {
    /// Its own connection, reopened at will.
    Own(Option<DedicatedConnection>),
    /// A shared lease client's batched renewal.
    Shared(SharedLease),
}

/// The lease was won by a statement sent at `sent`: starts the keeper task
/// and returns the handle, or `None` if the answer came so late that the
/// local deadline already passed (the lease is then released unused).
async fn elected(
    shared: &Arc<Shared>,
    carrier: Carrier,
    sql: &Arc<LeaseSql>,
    term: Term,
    sent: Instant,
    acquired_at: SystemTime,
    lease_until: SystemTime,
) -> Option<Leadership> {
    // Active at once: a lease is taken over only after it expired on the
    // server or was released, so there is no handover delay to wait.
    let mut keeper = Keeper::new(shared.timing, Liveness::statements(), sent, sent, false);
    let now = Instant::now();
    match keeper.poll(now) {
        Some(Action::Activate) => {}
        other => {
            tracing::warn!(term = term.get(), action = ?other, "won the lease past the local deadline; releasing it unused");
            match carrier {
                Carrier::Own(mut conn) => {
                    let _ = release(shared, &mut conn, sql, term.get()).await;
                    if let Some(c) = conn {
                        c.close().await;
                    }
                }
                Carrier::Shared(client) => {
                    let _ = client.release(shared, term.get()).await;
                }
            }
            return None;
        }
    }
    tracing::info!(
        term = term.get(),
        took = ?now - sent,
        "leadership begins (lease)"
    );
    metrics::leader_on(&shared.role, term.get(), now - sent);
    shared.publish(Some(LeaderInfo {
        role: shared.role.clone(),
        holder: shared.node.clone(),
        holder_meta: shared.meta.clone(),
        term,
        backend: Some("lease".into()),
        acquired_at,
        renewed_at: acquired_at,
        lease_until,
        lease_expired: false,
        holder_pid: None,
    }));
    let state = Arc::new(LeaderState::new(
        shared.role.clone(),
        shared.options.schema_name().clone(),
        term,
        keeper.deadline(),
    ));
    let (commands, rx) = mpsc::unbounded_channel();
    let notices = lease_state(shared).notices.subscribe();
    let span = tracing::info_span!("pgelect.leader", role = %shared.role, node = %shared.node, term = term.get(), backend = "lease");
    let keep = Keep {
        shared: shared.clone(),
        backend: LeaseKeep {
            shared: shared.clone(),
            via: match carrier {
                Carrier::Own(conn) => Via::Own(Mutex::new(conn)),
                Carrier::Shared(client) => {
                    let member = client.join_renewals(shared, term.get());
                    Via::Shared { client, member }
                }
            },
            sql: sql.clone(),
            term: term.get(),
            refused_read_only: AtomicBool::new(false),
        },
        keeper,
        state: state.clone(),
        commands: rx,
        notices,
        activation: Activation::Done,
        count_leading: false,
    };
    keep.spawn(span);
    Some(Leadership {
        context: LeaderContext::new(state),
        commands,
    })
}

/// How the lease backend keeps a leadership: one renewal statement per
/// `renew_every` on a connection reopened at will, each bounded by the
/// statement timeout; failures are retried until the deadline.
struct LeaseKeep {
    shared: Arc<Shared>,
    via: Via,
    sql: Arc<LeaseSql>,
    term: i64,
    /// A shared client's batched renewal was refused by a server that
    /// accepts no writes: the error the keeper gets for it (the batch's
    /// own error went to the whole batch) is to be taken as such.
    refused_read_only: AtomicBool,
}

/// What carries a leader's renewals.
enum Via {
    /// Its own connection between two statements; a statement in flight
    /// holds it, and gives it back when done.
    Own(Mutex<Option<DedicatedConnection>>),
    /// A shared lease client: this leader's place in its batched renewal.
    Shared {
        client: SharedLease,
        member: RenewMember,
    },
}

impl LeaseKeep {
    fn take_conn(&self) -> Option<DedicatedConnection> {
        match &self.via {
            Via::Own(conn) => conn.lock().unwrap_or_else(PoisonError::into_inner).take(),
            Via::Shared { .. } => None,
        }
    }

    fn put_conn(&self, conn: Option<DedicatedConnection>) {
        if let Via::Own(slot) = &self.via {
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = conn;
        }
    }

    /// The renewal through the shared client's batch: asks for a batch sent
    /// within the member's share wait and takes its outcome with the batch's
    /// own send time (taken by the batch task right before it sent the
    /// statement). Bounded like a renewal of its own, plus the share wait
    /// and one batch ahead of it.
    async fn renew_shared(&self, member: &RenewMember) -> (Instant, Result<Answer>) {
        let requested = Instant::now();
        let bound = self.shared.timing.heartbeat_timeout * 2;
        match tokio::time::timeout(bound, member.renewal(requested)).await {
            Ok(Some((sent, r))) => {
                match r {
                    Renewal::Renewed { .. } => tracing::trace!("lease renewed in a batch"),
                    Renewal::Failed { read_only: true } => {
                        self.refused_read_only.store(true, AtomicOrdering::Relaxed);
                    }
                    _ => {}
                }
                (sent, renewal_answer(r))
            }
            _ => (
                requested,
                Err(Error::connection_lost(LeaseOp::Renew.operation())),
            ),
        }
    }
}

impl KeepBackend for LeaseKeep {
    const FINISH_IN_FLIGHT_BEFORE_RELEASE: bool = true;

    fn renew(&self) -> Statement<'_> {
        Box::pin(async move {
            if let Via::Shared { member, .. } = &self.via {
                return self.renew_shared(member).await;
            }
            let shared = &self.shared;
            let mut conn = self.take_conn();
            let ttl_ms = shared.timing.ttl.as_millis() as i64;
            let sent = Instant::now();
            let r = exec(
                shared,
                &mut conn,
                LeaseOp::Renew,
                &self.sql.renew,
                &[
                    (&shared.role, Type::TEXT),
                    (&shared.node, Type::TEXT),
                    (&self.term, Type::INT8),
                    (&ttl_ms, Type::INT8),
                    (&shared.priority, Type::INT4),
                ],
            )
            .await
            .and_then(|rows| {
                let s = shared.options.schema_name().as_str();
                let Some(row) = rows.first() else {
                    return Ok(Answer::NotOurs);
                };
                let decode = || {
                    Ok::<_, tokio_postgres::Error>((
                        row.try_get::<_, f64>(0)?,
                        row.try_get::<_, bool>(1)?,
                        row.try_get::<_, Option<String>>(2)?,
                    ))
                };
                let (remaining_ms, resign_requested, ready) =
                    decode().map_err(|e| Error::db(LeaseOp::Renew.operation(), s, e))?;
                tracing::trace!(server_remaining = ?ms(remaining_ms), "lease renewed");
                Ok(Answer::Renewed {
                    row: None,
                    resign_requested,
                    preferred: Preferred {
                        ready,
                        pending: false,
                    },
                })
            });
            self.put_conn(conn);
            (sent, r)
        })
    }

    async fn pushed(&self) -> (Instant, Result<Answer>) {
        match &self.via {
            Via::Shared { member, .. } => {
                let (sent, r) = member.pushed().await;
                (sent, renewal_answer(r))
            }
            Via::Own(_) => std::future::pending().await,
        }
    }

    fn heartbeat(&self) -> Statement<'_> {
        // Never asked for: a lease has no session to keep alive.
        Box::pin(std::future::ready((Instant::now(), Ok(Answer::Alive))))
    }

    fn closed(&self) -> impl Future<Output = ()> + Send + '_ {
        // The connection is reopened at will: its end ends nothing.
        std::future::pending()
    }

    fn failed(&self, error: &Error, failures: u32) -> Failed {
        if is_read_only(error) || self.refused_read_only.swap(false, AtomicOrdering::Relaxed) {
            // Not an outage to ride out: the lease is on a server that
            // cannot renew it (demoted or fenced); the next campaign opens
            // a new connection.
            self.put_conn(None);
            return Failed::ServerReadOnly;
        }
        // Retries are cheap (one statement or a refused connection): keep
        // them frequent, so that a short outage is ridden out.
        let cap = (self.shared.timing.renew_every / 4).max(Duration::from_millis(50));
        Failed::RetryAfter(backoff(failures).min(cap))
    }

    fn let_go(&self, _reason: Option<LossReason>) {
        // Nothing to drop: the lease expires on its own, after the local
        // deadline, unless released. A shared client's batch stops
        // renewing it at once.
        if let Via::Shared { member, .. } = &self.via {
            member.leave();
        }
    }

    fn releasable_after(&self, reason: LossReason) -> bool {
        // After a deadline loss the lease may still be ours on the server
        // (the database was unreachable for a while). After a preemption
        // there is nothing left to release.
        reason == LossReason::Deadline
    }

    async fn release(self, ended: Option<LossReason>) -> Result<()> {
        if let Via::Shared { client, member } = &self.via {
            member.leave();
            let result = if ended == Some(LossReason::Preempted) {
                Ok(())
            } else {
                client.release(&self.shared, self.term).await.map(|_| ())
            };
            if let Err(e) = &result {
                tracing::warn!(error = %e, "clean release failed; the lease will expire on its own");
            }
            return result;
        }
        let mut conn = self.take_conn();
        let result = if ended == Some(LossReason::Preempted) {
            Ok(())
        } else {
            release(&self.shared, &mut conn, &self.sql, self.term)
                .await
                .map(|_| ())
        };
        if let Err(e) = &result {
            tracing::warn!(error = %e, "clean release failed; the lease will expire on its own");
        }
        if let Some(c) = conn {
            c.close().await;
        }
        result
    }

    async fn close(self) {
        if let Via::Shared { member, .. } = &self.via {
            member.leave();
        }
        if let Some(c) = self.take_conn() {
            c.close().await;
        }
    }
}

/// Clears the holder where holder and term are ours, with a NOTIFY in the
/// same transaction. Up to three attempts (transient failures), each bounded
/// by the statement timeout. Returns whether the row was still ours.
async fn release(
    shared: &Shared,
    conn: &mut Option<DedicatedConnection>,
    sql: &LeaseSql,
    term: i64,
) -> Result<bool> {
    let s = shared.options.schema_name().as_str();
    let payload = format!("{s}:released:{}", shared.role);
    let mut failures = 0;
    loop {
        let r = exec(
            shared,
            conn,
            LeaseOp::Release,
            &sql.release,
            &[
                (&shared.role, Type::TEXT),
                (&shared.node, Type::TEXT),
                (&term, Type::INT8),
                (&payload, Type::TEXT),
            ],
        )
        .await;
        match r {
            Ok(rows) => {
                let cleared: i64 = rows
                    .first()
                    .map(|r| r.try_get(0))
                    .transpose()
                    .map_err(|e| Error::db(LeaseOp::Release.operation(), s, e))?
                    .unwrap_or(0);
                if cleared == 0 {
                    tracing::warn!(term, "the lease row no longer named this leader at release");
                }
                return Ok(cleared > 0);
            }
            Err(e) if is_transient(&e) && failures < 2 => {
                failures += 1;
                tokio::time::sleep(backoff(failures)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The `LISTEN` connection of a lease-backend elector (see
/// `ElectorBuilder::listen_via`): forwards notifications on
/// [`LEADER_CHANNEL`] and [`RESIGN_CHANNEL`] to the elector's broadcast
/// channel; reconnects with backoff; ends when the elector is dropped.
pub(crate) async fn listen(shared: Weak<Shared>, options: ConnectOptions, stop: CancellationToken) {
    let purpose = match shared.upgrade() {
        Some(s) => format!("listen:{}:{}", s.role, s.node),
        None => return,
    };
    let channels = [LEADER_CHANNEL, RESIGN_CHANNEL];
    listen_for(&options, &purpose, &channels, &stop, |n| {
        let Some(s) = shared.upgrade() else {
            return false;
        };
        // A release sent before the LISTEN took effect (the first one, or
        // after a reconnection), or missed, was not heard: a standby that
        // found the lease held would sleep until its next retry. Wake it
        // as if it had been heard; it reads the row again (a hint like any
        // other, within the wake-up limit).
        let n = n.unwrap_or_else(|| Notice {
            channel: LEADER_CHANNEL.to_owned(),
            payload: format!("{}:released:{}", s.options.schema_name().as_str(), s.role),
        });
        if let Some(lease) = s.lease() {
            let _ = lease.notices.send(n);
        }
        true
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_reported_milliseconds_are_clamped() {
        assert_eq!(ms(-5.0), Duration::ZERO);
        assert_eq!(ms(f64::NAN), Duration::ZERO);
        assert_eq!(ms(1500.0), Duration::from_millis(1500));
        for _ in 0..100 {
            assert!(jitter(Duration::from_secs(15)) <= MAX_JITTER);
            assert!(jitter(Duration::from_millis(500)) <= Duration::from_millis(25));
        }
        assert_eq!(max_jitter(Duration::from_secs(1)), MAX_JITTER);
    }

    #[test]
    fn statements_are_scoped_to_holder_and_term() {
        let sql = lease_sql(&SchemaName::default());
        assert!(sql
            .renew
            .contains("WHERE role = $1 AND holder = $2 AND term = $3"));
        assert!(sql
            .release
            .contains("WHERE role = $1 AND holder = $2 AND term = $3"));
        assert!(sql.acquire.contains("l.lease_until < now()"));
        for s in [&sql.acquire, &sql.renew, &sql.release] {
            assert!(!s.contains(';'), "one statement each: {s}");
        }
    }
}
