//! The lease backend's engine: one connection for the lease-backend
//! candidates of many roles, with batched acquires, registrations and
//! renewals. A candidate not built on a shared client gets a client of its
//! own that carries it alone: a single candidate is a batch of one, and
//! every lease statement ([`LeaseSql`]) is sent from here.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::{oneshot, watch, Mutex as AsyncMutex, Notify};
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use tokio_util::sync::CancellationToken;

use crate::conn::{ConnectOptions, DedicatedConnection};
use crate::error::{Error, Result};
use crate::schema::check_schema;

use crate::election::backend::shared::Registration;
use crate::election::config::random_u64;
use crate::election::registry::{self, Register, Waits};
use crate::election::support::{backoff, is_read_only, is_transient, listen_for, WakeLimit};
use crate::election::term::{next_term_sql, rearm_lease_sql, stale_row_sql, TIMELINE_SQL};
use crate::election::watch::{parse_leader_event, LEADER_CHANNEL};
use crate::election::Shared;
use crate::schema::SchemaName;

use super::batch::{chunks, remove_if_term, until_wanted, Batch, Member, Outcome, Termed};
use super::claim::{Claim, Roles};

/// One connection that carries the statements of the lease-backend
/// candidates of many roles in one process, batched: a process standing
/// for thousands of roles holds one connection and sends a few statements
/// a second, not one connection and several statements a second per role.
///
/// The name says what it shares: the lease backend's traffic, as
/// [`SharedConnection`](crate::SharedConnection) shares the session
/// backend's session. Unlike that one, nothing lives in the connection's
/// session: every statement is one transaction, the connection is reopened
/// at will after a failure, and it works through PgBouncer in transaction
/// mode, as the lease backend does.
///
/// What goes over it, for every candidate built with
/// [`ElectorBuilder::shared_lease`](crate::ElectorBuilder::shared_lease):
///
/// * **Renewals**: one `UPDATE … FROM unnest(…)` renews every leader on
///   the client (in chunks of 2,000), each for its own TTL, and tells each
///   role on its own whether its row was still its own: a role whose row
///   was taken is lost alone. Leaders renewed by one statement ask again
///   together, so at steady state one statement per renewal period serves
///   them all. Each role keeps its own term and its own local deadline,
///   counted from the moment that statement was sent.
/// * **Standbys**: one batched acquire per poll tries every standby role
///   (in chunks of 5,000) and takes those whose lease is free or expired
///   on the server's clock, under the rules of a single candidate's
///   acquire (a ready candidate of strictly higher priority goes first; a
///   role held by a session-backend leader is refused). A poll is sent at
///   the earliest server-reported expiry among the standbys, at least
///   every `retry_every` (1 s by default), and, with
///   [`listen_via`](SharedLease::listen_via), at once when a leader
///   announces the release of a role one of them waits for.
/// * **Registrations** in the candidate registry: one statement per
///   `ttl / 2` for all standbys.
/// * **Releases**: one statement per role.
///
/// Only one statement is in flight at a time: a renewal waits behind one
/// chunk of polls at most.
///
/// # Takeover bound
///
/// A lease has no server session whose end the server would notice: when
/// the process of a `SharedLease` dies (or loses its database), each of its
/// roles is taken over once its lease expired on the server, that is
/// within `ttl` after its last renewal, plus one poll of the other
/// candidates (`retry_every` at most, plus a few milliseconds of jitter).
///
/// # Cost
///
/// One connection, and one more used only to `LISTEN` with
/// [`listen_via`](SharedLease::listen_via). At steady state, per process: one renewal statement per
/// `renew_every` per 2,000 leaders, one acquire per `retry_every` per 5,000
/// standbys and one registration per `ttl / 2` per 2,000 standbys.
///
/// A lease-backend candidate built without a `SharedLease` stands on a
/// client of its own, the same engine carrying that one role on a
/// connection named `pgelect:lease:<role>:<node>`.
///
/// A role may have only one candidate per `SharedLease`:
/// [`ElectorBuilder::build`](crate::ElectorBuilder::build) refuses a second
/// one while the first elector, or a leadership it handed out, lives.
///
/// ```no_run
/// # async fn example() -> pgelect::Result<()> {
/// use std::time::Duration;
/// use pgelect::{Backend, ConnectOptions, Elector, SharedLease};
/// // Through PgBouncer in transaction mode, if need be.
/// let options = ConnectOptions::from_url("postgres://app@pgbouncer:6432/app")?;
/// let client = SharedLease::new(&options);
/// let mut shards = Vec::new();
/// for shard in 0..1000 {
///     let elector = Elector::builder(options.clone(), &format!("shard-{shard}"))
///         .backend(Backend::Lease)
///         .ttl(Duration::from_secs(15))
///         .shared_lease(&client)
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
pub struct SharedLease {
    inner: Arc<Inner>,
}

struct Inner {
    options: ConnectOptions,
    /// The connection's `application_name` without the `pgelect:` prefix:
    /// `shared-lease:<8 hex digits>`, unique per client, or
    /// `lease:<role>:<node>` for a candidate's own client.
    purpose: String,
    /// The `role` label of the statement metric: empty on a shared client,
    /// the role on a candidate's own.
    metric_role: String,
    /// Whether requests wait a moment for others to share their statement:
    /// not on a candidate's own client, which carries one role.
    shares: bool,
    /// The connection between two statements; a statement holds the lock
    /// while in flight, so one statement at a time is sent.
    conn: AsyncMutex<Option<DedicatedConnection>>,
    /// Roles with a live elector on this client.
    roles: Roles,
    /// The leaders on this client, by role: every batched renewal renews
    /// them all.
    leaders: Mutex<HashMap<String, Leader>>,
    /// The earliest moment by which a leader wants its renewal sent.
    renew_wanted: watch::Sender<Option<Instant>>,
    /// The standbys on this client, by role: every batched acquire tries
    /// them all.
    standbys: Mutex<HashMap<String, Standby>>,
    /// Wakes the standby task when a standby joins.
    joined: Arc<Notify>,
    /// The tokens of the last batched acquires that got no answer (timed
    /// out, connection lost): one of them may have committed, leaving
    /// leases with our node's name that nobody acts on. The next polls may
    /// take those again at once.
    unanswered: Mutex<VecDeque<i64>>,
    sql: Statements,
    started: AtomicBool,
    /// Where the client listens for release announcements, if anywhere
    /// ([`SharedLease::listen_via`]).
    listen_via: Mutex<Option<ConnectOptions>>,
    /// Set once the listening task runs.
    listening: AtomicBool,
    /// Early acquires brought by release announcements.
    wakes: Mutex<Wakes>,
    /// Cancelled when the last handle is dropped: ends the tasks.
    stop: CancellationToken,
    /// Statements sent on the connection.
    statements: AtomicU64,
    /// Release announcements heard on the listen connection.
    releases_heard: AtomicU64,
    /// Tells standbys apart across a role's re-joins.
    next_standby: AtomicU64,
    /// How many standbys the next acquire chunk carries: halved after a
    /// chunk that got no answer in time, doubled back after one that did.
    acquire_rows: std::sync::atomic::AtomicUsize,
    /// Where in role order this client's polls start (random): candidates
    /// that start together take different roles first instead of queueing
    /// behind each other's inserts of the same rows.
    offset: usize,
}

/// The client's statements: the lease backend's, one SQL text per
/// operation, each taking one array element per role (see [`LeaseSql`]).
struct Statements {
    sql: LeaseSql,
    register: String,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// How many rows one chunk of a batched renewal or registration carries
/// at most (see the session backend's `RENEW_ROWS`: a chunk must stay well
/// under the heartbeat timeout on a loaded machine).
const CHUNK_ROWS: usize = 2000;

/// How many standbys one chunk of the batched acquire tries at most. At
/// steady state the acquire only reads the rows of led roles (one index
/// probe each), and it is sent every `retry_every`: with 10,000 roles over
/// 3 candidates, chunks of 2,000 would make 4 acquires a second per
/// candidate, chunks of 5,000 make 2 (as the session backend's polls).
const ACQUIRE_ROWS: usize = 5000;

/// The fewest standbys an acquire chunk is cut down to after timeouts.
const MIN_ACQUIRE_ROWS: usize = 250;

/// How long a new standby waits for others to share its first poll.
const NEW_STANDBY_WAIT: Duration = Duration::from_millis(20);

/// How soon a standby tries again when its role was announced released
/// while an acquire that included it was in flight (that acquire may have
/// read the row before the release). At most one such retry follows each
/// acquire, so forged announcements cost at most 10 acquires a second.
const REWAKE_GAP: Duration = Duration::from_millis(100);

/// How soon a leader whose row a fenced transaction held is tried again
/// (see [`renew_batches`]): a fencing transaction's end is followed by
/// the leader's renewal within this, plus a round trip.
const BUSY_RETRY: Duration = Duration::from_millis(25);

/// How many unanswered acquire tokens are remembered.
const UNANSWERED_TOKENS: usize = 16;

/// The least time allowed for connecting and for a standby's statement.
const PATIENT_BOUND: Duration = Duration::from_secs(2);

/// The largest jitter added to a standby's next acquire after the lease's
/// server-reported expiry, so that standbys do not all fire at once. A
/// twentieth of the TTL below a TTL of 1 s (25 ms at 500 ms), so that a
/// short lease is taken over within `ttl` + 50 ms, round trips included.
const MAX_JITTER: Duration = Duration::from_millis(50);

/// The statements of the client, for errors and bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Renew,
    Acquire,
    Register,
    Release,
}

impl Op {
    fn operation(self) -> &'static str {
        match self {
            Op::Renew => "renew the lease",
            Op::Acquire => "take the lease",
            Op::Register => "register as a candidate",
            Op::Release => "release the lease",
        }
    }
}

impl SharedLease {
    /// A shared lease client for `options`' database; it connects on first
    /// use (and again after any failure).
    pub fn new(options: &ConnectOptions) -> SharedLease {
        let purpose = format!("shared-lease:{:08x}", random_u64() as u32);
        SharedLease::with(options, purpose, String::new(), true)
    }

    /// The client of a lone candidate (one not built on a shared client):
    /// the same engine carrying one role, on a connection of its own named
    /// `pgelect:lease:<role>:<node>`, with no wait for others to share a
    /// statement.
    pub(crate) fn own(options: &ConnectOptions, role: &str, node: &str) -> SharedLease {
        SharedLease::with(
            options,
            format!("lease:{role}:{node}"),
            role.to_owned(),
            false,
        )
    }

    fn with(options: &ConnectOptions, purpose: String, metric_role: String, shares: bool) -> Self {
        let schema = options.schema_name();
        SharedLease {
            inner: Arc::new(Inner {
                options: options.clone(),
                purpose,
                metric_role,
                shares,
                conn: AsyncMutex::new(None),
                roles: Roles::default(),
                leaders: Mutex::new(HashMap::new()),
                renew_wanted: watch::Sender::new(None),
                standbys: Mutex::new(HashMap::new()),
                joined: Arc::new(Notify::new()),
                unanswered: Mutex::new(VecDeque::new()),
                sql: Statements {
                    sql: lease_sql(schema),
                    register: registry::batch_register_sql_for(schema.as_str(), Waits::Lease),
                },
                started: AtomicBool::new(false),
                listen_via: Mutex::new(None),
                listening: AtomicBool::new(false),
                wakes: Mutex::new(Wakes::default()),
                stop: CancellationToken::new(),
                statements: AtomicU64::new(0),
                releases_heard: AtomicU64::new(0),
                next_standby: AtomicU64::new(0),
                acquire_rows: std::sync::atomic::AtomicUsize::new(ACQUIRE_ROWS),
                offset: random_u64() as usize,
            }),
        }
    }

    /// The `application_name` of the client's connection (unless the
    /// connection options set one): `pgelect:shared-lease:<8 hex digits>`,
    /// unique per client.
    pub fn application_name(&self) -> String {
        format!("pgelect:{}", self.purpose())
    }

    /// The number of statements sent on the connection so far (renewals,
    /// acquires, registrations, releases; not the schema check of a new
    /// connection).
    pub fn statements(&self) -> u64 {
        self.inner.statements.load(Ordering::Relaxed)
    }

    /// The number of release announcements (for any role) heard so far on
    /// the connection of [`listen_via`](SharedLease::listen_via); always 0
    /// without one.
    pub fn releases_heard(&self) -> u64 {
        self.inner.releases_heard.load(Ordering::Relaxed)
    }

    /// The server process id of the current connection, if one is open
    /// (through a pooler: the pooler's id for the client connection).
    pub async fn backend_pid(&self) -> Option<i32> {
        let conn = self.inner.conn.lock().await;
        conn.as_ref().filter(|c| !c.is_closed()).map(|c| c.pid())
    }

    fn purpose(&self) -> String {
        self.inner.purpose.clone()
    }

    pub(crate) fn options(&self) -> &ConnectOptions {
        &self.inner.options
    }

    /// Claims `role` for one elector; refused while another holds it.
    pub(crate) fn claim(&self, role: &str) -> Result<LeaseClaim> {
        self.inner.roles.claim(
            self.clone(),
            role,
            "already has a candidate on this shared lease client; the batched statements carry one candidate per role",
        )
    }

    /// Starts the renewal and standby tasks, once.
    fn ensure_started(&self) {
        if self.inner.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        let stop = self.inner.stop.clone();
        tokio::spawn(renew_batches(
            weak.clone(),
            self.inner.renew_wanted.subscribe(),
            stop.clone(),
        ));
        tokio::spawn(standby_batches(weak, self.inner.joined.clone(), stop));
        self.start_listening();
    }

    /// Listens on a connection that bypasses the pooler (directly to
    /// PostgreSQL, or through a session-mode pool) for the releases that
    /// leaders announce: a release of a role that one of this client's
    /// standbys waits for brings the next batched acquire forward, so a
    /// voluntary release is taken over in milliseconds instead of within
    /// `retry_every`. One connection for all the client's candidates, used
    /// only to `LISTEN` (through a pooler in transaction mode `LISTEN` does
    /// not work); losing it never affects leadership, and it is reopened
    /// with backoff. Anyone who can connect may `NOTIFY`: a flood of
    /// announcements costs at most ten acquires a second.
    ///
    /// Refused for another schema than the client's.
    ///
    /// ```no_run
    /// # fn example() -> pgelect::Result<()> {
    /// use pgelect::{ConnectOptions, SharedLease};
    /// let pooled = ConnectOptions::from_url("postgres://app@pgbouncer:6432/app")?;
    /// let direct = ConnectOptions::from_url("postgres://app@db:5432/app")?;
    /// let client = SharedLease::new(&pooled).listen_via(direct)?;
    /// # let _ = client;
    /// # Ok(()) }
    /// ```
    pub fn listen_via(self, options: ConnectOptions) -> Result<SharedLease> {
        if options.schema_name() != self.inner.options.schema_name() {
            return Err(Error::config(format!(
                "listen_via uses schema {:?} but the shared lease client uses {:?}; they must match",
                options.schema_name().as_str(),
                self.inner.options.schema_name().as_str()
            )));
        }
        *self
            .inner
            .listen_via
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(options);
        if self.inner.started.load(Ordering::Acquire) {
            self.start_listening();
        }
        Ok(self)
    }

    /// Starts the listening task, once, if the client listens.
    fn start_listening(&self) {
        let options = self
            .inner
            .listen_via
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(options) = options else {
            return;
        };
        if self.inner.listening.swap(true, Ordering::AcqRel) {
            return;
        }
        let purpose = format!("{}-listen", self.purpose());
        tokio::spawn(listen_releases(
            Arc::downgrade(&self.inner),
            options,
            purpose,
            self.inner.stop.clone(),
        ));
    }

    /// Runs one statement, (re)connecting first if needed, bounded by
    /// `bound` (connecting by at least [`PATIENT_BOUND`]). Returns the
    /// moment the statement was handed to the connection — taken right
    /// before it, never later — and its rows. On a timeout or a connection
    /// failure the connection is dropped (the running statement cancelled),
    /// so the next statement starts on a fresh one.
    async fn exec(
        &self,
        op: Op,
        bound: Duration,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> (Instant, Result<Vec<Row>>) {
        let inner = &self.inner;
        let schema = inner.options.schema_name();
        let operation = op.operation();
        let mut conn = inner.conn.lock().await;
        let open = async {
            let c = inner.options.connect(&self.purpose()).await?;
            let checked = check_schema(c.client(), schema).await;
            c.kept_if(checked)
        };
        if let Err(e) = reopen(&mut conn, bound.max(PATIENT_BOUND), operation, open).await {
            return (Instant::now(), Err(e));
        }
        let c = conn.as_ref().expect("BUG: connected above");
        inner.statements.fetch_add(1, Ordering::Relaxed);
        crate::metrics::lease_statement(&inner.metric_role, op_kind(op));
        // Taken before the statement is written to the socket: the
        // server's `now()` in it is at or after this moment.
        let sent = Instant::now();
        // In a transaction of its own with JIT off: the planner costs the
        // batched statements' joins of thousands of rows high, and past
        // `jit_above_cost` the server compiled an acquire of 2,000 roles
        // for 2.2 s of its 2.8 (a 10,000-role start took 5 s on one
        // client). `SET LOCAL` ends with the transaction, so through a
        // pooler in transaction mode no other client's session is changed.
        // The three are pipelined: one round trip.
        let run = async {
            let (begun, rows, committed) = tokio::join!(
                c.client().batch_execute("BEGIN; SET LOCAL jit = off"),
                c.client().query_typed(sql, params),
                c.client().batch_execute("COMMIT"),
            );
            begun
                .and(rows)
                .and_then(|rows| committed.map(|()| rows))
                .map_err(|e| Error::db(operation, schema.as_str(), e))
        };
        let r = tokio::time::timeout(bound, run).await;
        let r = settle(&mut conn, operation, r);
        (sent, r)
    }

    /// Enters the leader of `shared`'s role, with `term`, into the batched
    /// renewal.
    pub(crate) fn join_renewals(&self, shared: &Shared, term: i64) -> RenewMember {
        self.ensure_started();
        let (tx, rx) = watch::channel(None);
        self.inner.leaders().insert(
            shared.role.clone(),
            Leader {
                node: shared.node.clone(),
                term,
                ttl_ms: shared.timing.ttl.as_millis() as i64,
                priority: shared.priority,
                bound: shared.timing.heartbeat_timeout,
                outcome: tx,
            },
        );
        // As on a shared connection: a short wait for others to share the
        // statement, a small part of the answer limit.
        let share_wait = if self.inner.shares {
            (shared.timing.heartbeat_timeout / 10).min(Duration::from_millis(20))
        } else {
            Duration::ZERO
        };
        Member::new(self.clone(), &shared.role, term, rx, share_wait)
    }

    /// Enters the standby of `shared`'s role into the batched acquire
    /// (and registration); its first poll is sent within
    /// [`NEW_STANDBY_WAIT`].
    pub(crate) fn join_standbys(&self, shared: &Arc<Shared>) -> StandbyMember {
        self.ensure_started();
        let s = shared.options.schema_name().as_str();
        let (tx, rx) = oneshot::channel();
        let id = self.inner.next_standby.fetch_add(1, Ordering::Relaxed);
        let first = Instant::now()
            + if self.inner.shares {
                NEW_STANDBY_WAIT
            } else {
                Duration::ZERO
            };
        let register = Register::new(shared, Waits::Lease);
        self.inner.standbys().insert(
            shared.role.clone(),
            Standby {
                id,
                node: shared.node.clone(),
                meta: shared.meta.clone(),
                ttl_ms: shared.timing.ttl.as_millis() as i64,
                ttl: shared.timing.ttl,
                priority: shared.priority,
                payload: format!("{s}:elected:{}", shared.role),
                retry_every: shared.timing.retry_every,
                due: first,
                register_due: first,
                woken_at: None,
                registration: register.entry(shared),
                shared: Arc::downgrade(shared),
                won: Some(tx),
            },
        );
        self.inner.joined.notify_one();
        StandbyMember {
            client: self.clone(),
            role: shared.role.clone(),
            id,
            outcome: rx,
        }
    }

    /// Clears the holder where holder and term are still ours, with a
    /// NOTIFY in the same transaction; up to three attempts (transient
    /// failures). Returns whether the row was still ours.
    pub(crate) async fn release(&self, shared: &Shared, term: i64) -> Result<bool> {
        self.release_role(
            &shared.role,
            &shared.node,
            term,
            shared.timing.heartbeat_timeout,
        )
        .await
    }

    async fn release_role(
        &self,
        role: &str,
        node: &str,
        term: i64,
        bound: Duration,
    ) -> Result<bool> {
        let s = self.inner.options.schema_name().as_str();
        let payload = format!("{s}:released:{role}");
        let (roles, nodes, terms, payloads) = (vec![role], vec![node], vec![term], vec![payload]);
        let mut failures = 0;
        loop {
            let (_, r) = self
                .exec(
                    Op::Release,
                    bound,
                    &self.inner.sql.sql.release,
                    &[
                        (&roles, Type::TEXT_ARRAY),
                        (&nodes, Type::TEXT_ARRAY),
                        (&terms, Type::INT8_ARRAY),
                        (&payloads, Type::TEXT_ARRAY),
                    ],
                )
                .await;
            match r {
                Ok(rows) => {
                    let cleared: i64 = rows
                        .first()
                        .map(|r| r.try_get(0))
                        .transpose()
                        .map_err(|e| Error::db(Op::Release.operation(), s, e))?
                        .unwrap_or(0);
                    if cleared == 0 {
                        tracing::warn!(
                            role,
                            term,
                            "the lease row no longer named this leader at release"
                        );
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
}

/// Opens a lease connection with `open`, bounded by `bound`, unless one is
/// open.
async fn reopen(
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
fn settle<T>(
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

fn op_kind(op: Op) -> &'static str {
    match op {
        Op::Renew => "renew",
        Op::Acquire => "acquire",
        Op::Release => "release",
        Op::Register => "other",
    }
}

impl Inner {
    fn leaders(&self) -> std::sync::MutexGuard<'_, HashMap<String, Leader>> {
        // Entries are inserted and removed whole: a poisoned lock left the
        // map consistent.
        self.leaders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn standbys(&self) -> std::sync::MutexGuard<'_, HashMap<String, Standby>> {
        // As for `leaders`; fields are updated one by one, each consistent.
        self.standbys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn unanswered(&self) -> std::sync::MutexGuard<'_, VecDeque<i64>> {
        self.unanswered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for SharedLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedLease")
            .field("target", &self.inner.options.target())
            .field("application_name", &self.application_name())
            .field("roles", &self.inner.roles.len())
            .field("leaders", &self.inner.leaders().len())
            .field("standbys", &self.inner.standbys().len())
            .field("statements", &self.statements())
            .finish()
    }
}

/// A role's place on a shared lease client, given back when dropped.
pub(crate) type LeaseClaim = Claim<SharedLease>;

/// A leader's entry in the batched renewal.
struct Leader {
    node: String,
    term: i64,
    ttl_ms: i64,
    priority: i32,
    /// The leader's statement bound (its heartbeat timeout).
    bound: Duration,
    /// The last batch that included this leader: when it was sent and
    /// what it found for this role.
    outcome: watch::Sender<Option<(Instant, Renewal)>>,
}

/// What one batched renewal found for one role.
#[derive(Clone, Debug)]
pub(crate) enum Renewal {
    /// The row still named this leader and term, and was renewed.
    Renewed {
        row: (SystemTime, SystemTime),
        resign_requested: bool,
        /// A ready candidate of strictly higher priority.
        ready: Option<String>,
    },
    /// The row no longer names this leader and term.
    NotOurs,
    /// The row still names this leader and term but was locked (a fenced
    /// transaction's `FOR SHARE`): not renewed this time.
    Busy,
    /// The statement failed or got no answer; `read_only` when the server
    /// refused it as accepting no writes (SQLSTATE 25006).
    Failed { read_only: bool },
}

/// A leader's place in the batched renewal; leaves it when dropped.
pub(crate) type RenewMember = Member<SharedLease, Renewal>;

impl Outcome for Renewal {
    fn failed(&self) -> bool {
        matches!(self, Renewal::Failed { .. })
    }
}

impl Termed for Leader {
    fn term(&self) -> i64 {
        self.term
    }
}

impl Batch for SharedLease {
    fn renewals_wanted(&self) -> &watch::Sender<Option<Instant>> {
        &self.inner.renew_wanted
    }

    fn closed(&self) -> Option<&CancellationToken> {
        // Reconnects at will: no end but the client's own.
        None
    }

    fn leave(&self, role: &str, term: i64) {
        remove_if_term(&mut self.inner.leaders(), role, term);
    }
}

/// A standby's entry in the batched acquire and registration.
struct Standby {
    id: u64,
    node: String,
    meta: Option<serde_json::Value>,
    ttl_ms: i64,
    ttl: Duration,
    priority: i32,
    payload: String,
    retry_every: Duration,
    /// When the next acquire of this role is due.
    due: Instant,
    /// When the next registration of this standby is due.
    register_due: Instant,
    /// When its role was last announced released (or announcements may
    /// have been missed): an acquire sent before then may not have seen it.
    woken_at: Option<Instant>,
    registration: Registration,
    /// For the elector's last-contact time.
    shared: Weak<Shared>,
    /// Where a win (or a refusal) goes; taken when sent.
    won: Option<oneshot::Sender<Result<Won>>>,
}

/// A lease won by a batched acquire.
#[derive(Debug)]
pub(crate) struct Won {
    /// When the statement that won it was sent.
    pub(crate) sent: Instant,
    pub(crate) term: i64,
    pub(crate) acquired_at: SystemTime,
    pub(crate) lease_until: SystemTime,
    /// The row as it was before: holder and backend.
    pub(crate) prev_holder: Option<String>,
    pub(crate) prev_backend: Option<String>,
}

/// A standby's place in the batched acquire; leaves it when dropped.
pub(crate) struct StandbyMember {
    client: SharedLease,
    role: String,
    id: u64,
    outcome: oneshot::Receiver<Result<Won>>,
}

impl StandbyMember {
    /// Completes when a batched acquire won the role's lease, or with the
    /// error that refused the role to this standby.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a lease won after the member was dropped is released
    /// by the client.
    pub(crate) async fn won(&mut self) -> Result<Won> {
        match (&mut self.outcome).await {
            Ok(r) => r,
            // The client's task ended (never while a handle lives).
            Err(_) => Err(Error::connection_lost("take the lease")),
        }
    }
}

impl Drop for StandbyMember {
    fn drop(&mut self) {
        let mut standbys = self.client.inner.standbys();
        if standbys.get(&self.role).is_some_and(|s| s.id == self.id) {
            standbys.remove(&self.role);
        }
    }
}

/// The lease backend's statements, exactly as the client sends them: one
/// SQL text per operation, each taking one array element per role, for a
/// lone candidate (a batch of one) as for thousands on a shared client.
///
/// Exposed (hidden from the docs) so that integration tests run the very
/// statements the client runs. Parameters and rows:
///
/// * `acquire`: `$1` roles (text[]), `$2` nodes (text[]), `$3` holder
///   metas (jsonb[]), `$4` TTLs in ms (int8[]), `$5` NOTIFY payloads
///   (text[]), `$6` priorities (int4[]); then `$7` this attempt's random
///   token (int8) and `$8` the tokens of this client's earlier attempts
///   that got no answer (int8[]): a lease one of them took (it names the
///   same node) is taken again. A role is taken when its row is missing,
///   has no holder, or its lease expired on the server's clock, and no
///   ready candidate of strictly higher priority is registered. One row
///   per role: won term (int8, NULL if not won), acquired_at, lease_until,
///   remaining ms of the new lease (float8), then the row as it was
///   before: holder, backend, remaining ms (float8, negative if expired);
///   then the NOTIFY (text), the preferred candidate it deferred to (text,
///   NULL if none), whether the row was re-armed instead (bool) and the
///   role (text).
/// * `renew`: `$1` roles, `$2` nodes, `$3` terms (int8[]), `$4` TTLs in ms,
///   `$5` priorities. A row per role whose lease is still its node's with
///   its term: role, remaining ms (float8), resign_requested, the node of a
///   ready candidate of strictly higher priority (or NULL), renewed_at,
///   lease_until, renewed (bool: false when a fenced transaction holds the
///   row, which is then skipped, not waited for). No row: not ours.
/// * `release`: `$1` roles, `$2` nodes, `$3` terms, `$4` NOTIFY payloads.
///   One row: the number of rows cleared (int8).
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct LeaseSql {
    /// Takes the leases that are free or expired (inserting missing rows
    /// with term 1).
    pub acquire: String,
    /// Renews the leases whose holder and term are still the given ones.
    pub renew: String,
    /// Clears the holders whose holder and term are still the given ones.
    pub release: String,
}

/// The lease statements for `schema`; see [`LeaseSql`].
#[doc(hidden)]
pub fn lease_sql(schema: &SchemaName) -> LeaseSql {
    let s = schema.as_str();
    LeaseSql {
        acquire: acquire_sql(s),
        renew: renew_sql(s),
        release: release_sql(s),
    }
}

/// `<l>.role = ANY (ARRAY(SELECT role FROM <batch>))`: the condition by
/// which every statement reaches the leaders' rows of its batch. The array
/// is an init plan whose size the planner cannot know (it assumes a few
/// elements), so it probes the primary key whatever the batch's size.
/// Joined on the batch alone, whose size it reads from the parameter, it
/// scanned the whole table instead, from a batch of 100 roles in 10,000
/// (see the `election::plans` test).
fn among(l: &str, batch: &str) -> String {
    format!("{l}.role = ANY (ARRAY(SELECT {batch}.role FROM {batch}))")
}

/// The acquire (see [`LeaseSql::acquire`]). `cur` reads the rows as of the
/// statement's snapshot; the upsert locks the latest version and re-checks
/// its WHERE on it (READ COMMITTED), so of concurrent candidates exactly
/// one wins a role, whatever `cur` showed. Rows that are held are only
/// read, never locked or written: a poll of thousands of led roles writes
/// nothing.
fn acquire_sql(s: &str) -> String {
    let (first, next) = (next_term_sql("0"), next_term_sql("l.term"));
    let pref = registry::preferred_lease_sql(s, "a.role", "a.node", "a.priority");
    // `stale`: rows that may lack the old primary's last writes (a promoted
    // server) are re-armed for a full TTL instead of taken over, once per
    // timeline (see term.rs). `lost` rows (our own unanswered attempt) are
    // taken again as before: nobody acts on them.
    let tl = "(SELECT t FROM tl)";
    let stale = stale_row_sql("l", tl);
    let rearm = rearm_lease_sql("l", "c.ttl_ms", tl);
    let (of_a, of_stale) = (among("l", "a"), among("l", "cur"));
    format!(
        "WITH tl AS (
             SELECT {TIMELINE_SQL} AS t
         ), a AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::jsonb[], $4::int8[], $5::text[],
                                  $6::int4[])
                        AS a(role, node, meta, ttl_ms, payload, priority)
         ), cur AS (
             SELECT a.role, a.ttl_ms, l.holder, l.backend, l.lease_until,
                    (l.role IS NULL OR l.holder IS NULL AND l.lease_timeline IS DISTINCT FROM {tl}
                     OR l.lease_until IS NULL OR l.lease_until < now()) AS free,
                    coalesce(l.holder = a.node AND l.lease_token = ANY($8::int8[]), false) AS lost,
                    coalesce({stale}, false) AS stale
               FROM a LEFT JOIN {s}.leaders l ON l.role = a.role AND {of_a}
         ), rearm AS (
             UPDATE {s}.leaders AS l SET {rearm}
               FROM cur c
              WHERE l.role = c.role AND c.stale AND NOT c.lost AND {stale} AND {of_stale}
             RETURNING l.role, l.lease_until
         ), try AS (
             SELECT a.*, cur.lost, CASE WHEN cur.free THEN {pref} END AS pref
               FROM a JOIN cur ON cur.role = a.role
              WHERE (cur.free AND NOT cur.stale) OR cur.lost
         ), up AS (
             INSERT INTO {s}.leaders AS l
                    (role, holder, holder_meta, term, backend, holder_pid,
                     acquired_at, renewed_at, lease_until, resign_requested, lease_token)
             SELECT t.role, t.node, t.meta, {first}, 'lease', NULL, now(), now(),
                    now() + t.ttl_ms * interval '1 millisecond', false, $7
               FROM try t
              WHERE t.pref IS NULL OR t.lost
              ORDER BY t.role
             ON CONFLICT (role) DO UPDATE
                SET holder = EXCLUDED.holder, holder_meta = EXCLUDED.holder_meta,
                    term = {next}, backend = 'lease', holder_pid = NULL,
                    acquired_at = EXCLUDED.acquired_at, renewed_at = EXCLUDED.renewed_at,
                    lease_until = EXCLUDED.lease_until, resign_requested = false,
                    lease_token = EXCLUDED.lease_token
              WHERE ((l.holder IS NULL AND l.lease_timeline IS DISTINCT FROM {tl}
                      OR l.lease_until IS NULL OR l.lease_until < now())
                     AND NOT {stale})
                 -- a lease taken by one of our own unanswered acquires:
                 -- nobody acts on it, take it again with a new term
                 OR (l.holder = EXCLUDED.holder AND l.lease_token = ANY($8::int8[]))
             RETURNING l.role, l.term, l.acquired_at, l.lease_until
         )
         SELECT up.term, up.acquired_at, up.lease_until,
                (extract(epoch FROM up.lease_until - now()) * 1000)::float8,
                CASE WHEN rearm.lease_until IS NOT NULL THEN coalesce(cur.holder, '') ELSE cur.holder END,
                cur.backend,
                (extract(epoch FROM coalesce(rearm.lease_until, cur.lease_until) - now()) * 1000)::float8,
                CASE WHEN up.term IS NOT NULL
                     THEN pg_catalog.pg_notify('{LEADER_CHANNEL}', a.payload)::text END,
                CASE WHEN up.term IS NULL THEN try.pref END,
                rearm.lease_until IS NOT NULL,
                a.role
           FROM a LEFT JOIN up ON up.role = a.role
                  LEFT JOIN cur ON cur.role = a.role
                  LEFT JOIN try ON try.role = a.role
                  LEFT JOIN rearm ON rearm.role = a.role"
    )
}

/// The renewal (see [`LeaseSql::renew`]): where a row still names the node
/// with the term, extends the lease to the server's `now()` + the role's
/// TTL. `greatest`: a renewal that was given up on the client but ran late
/// on the server (after a retry on a new connection) never moves the lease
/// back in time below what a later renewal promised.
///
/// A row still ours but locked (a fenced transaction of the leader's own
/// holds it `FOR SHARE` until it ends) is skipped, not waited for, and
/// returned with `renewed` false: the keeper retries soon
/// ([`Answer::Busy`](crate::election::driver::Answer::Busy)), as the
/// session backend's renewal does. Waiting would hold up every role of a
/// batch behind one application transaction, and a lone leader's
/// renewal behind a transaction that may outlast its statement bound.
///
/// The skipped rows are found with `NOT IN` over `u`, which the planner
/// runs as one hashed sub-plan (it guesses one row for `u`); as `NOT
/// EXISTS` it chose a nested anti-join that rescanned `u` for every row
/// (see the shared connection's renewal).
fn renew_sql(s: &str) -> String {
    let pref = registry::preferred_lease_sql(s, "m.role", "m.node", "m.priority");
    let (of_m, of_o) = (among("l", "m"), among("l", "o"));
    format!(
        "WITH m AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int4[])
                        AS m(role, node, term, ttl_ms, priority)
         ), o AS (
             SELECT l.role, m.ttl_ms
               FROM {s}.leaders l JOIN m
                 ON l.role = m.role AND l.holder = m.node AND l.term = m.term
              WHERE {of_m}
                FOR NO KEY UPDATE OF l SKIP LOCKED
         ), u AS (
             UPDATE {s}.leaders l
                SET renewed_at = greatest(l.renewed_at, now()),
                    lease_until = greatest(l.lease_until, now() + o.ttl_ms * interval '1 millisecond')
               FROM o
              WHERE l.role = o.role AND {of_o}
             RETURNING l.role, l.renewed_at, l.lease_until, l.resign_requested
         )
         SELECT u.role, (extract(epoch FROM u.lease_until - now()) * 1000)::float8,
                u.resign_requested, {pref}, u.renewed_at, u.lease_until, true AS renewed
           FROM u JOIN m ON m.role = u.role
         UNION ALL
         SELECT l.role, NULL::float8, false, NULL::text, l.renewed_at, l.lease_until, false
           FROM {s}.leaders l JOIN m
             ON l.role = m.role AND l.holder = m.node AND l.term = m.term
          WHERE {of_m} AND l.role NOT IN (SELECT u.role FROM u)"
    )
}

/// The release (see [`LeaseSql::release`]): clears the holder where holder
/// and term are still the given ones, with a NOTIFY per cleared row in the
/// same transaction.
fn release_sql(s: &str) -> String {
    let of_m = among("l", "m");
    format!(
        "WITH m AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[])
                        AS m(role, node, term, payload)
         ), c AS (
             UPDATE {s}.leaders l
                SET holder = NULL, holder_pid = NULL, holder_meta = NULL, lease_token = NULL,
                    renewed_at = now(), lease_until = now(), resign_requested = false
               FROM m
              WHERE l.role = m.role AND l.holder = m.node AND l.term = m.term AND {of_m}
             RETURNING m.payload
         )
         SELECT count(*), count(pg_catalog.pg_notify('{LEADER_CHANNEL}', c.payload)::text)
           FROM c"
    )
}

/// The renewal task: when the earliest renewal request wants it, sends one
/// statement per chunk renewing every leader on the client, and hands each
/// its outcome with the statement's send time; ends with the client.
///
/// A leader whose row a fenced transaction holds (the statement skips it,
/// see [`renew_sql`]) is not handed `Busy` at once: it is tried again alone
/// every [`BUSY_RETRY`], its outcome held back, until renewed or until
/// half its statement bound has passed since it was first found busy. So a
/// leader whose application fences in short transactions is renewed right
/// after one ends, as a renewal that waited for the lock would be, without
/// holding up the other leaders' renewals.
async fn renew_batches(
    inner: Weak<Inner>,
    mut wanted: watch::Receiver<Option<Instant>>,
    stop: CancellationToken,
) {
    // Leaders found busy and not handed their outcome yet: role -> term and
    // the send time of the statement that first found the row held.
    let mut busy: HashMap<String, (i64, Instant)> = HashMap::new();
    loop {
        let all = if busy.is_empty() {
            if !until_wanted(&mut wanted, &stop).await {
                return;
            }
            true
        } else {
            tokio::select! {
                w = until_wanted(&mut wanted, &stop) => {
                    if !w {
                        return;
                    }
                    true
                }
                _ = tokio::time::sleep(BUSY_RETRY) => false,
            }
        };
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let client = SharedLease { inner };
        if all {
            client.inner.renew_wanted.send_replace(None);
        }
        // Leaders that left (or lead with another term now) wait no more.
        {
            let leaders = client.inner.leaders();
            busy.retain(|role, (term, _)| leaders.get(role).is_some_and(|l| l.term == *term));
        }
        let mut leaders: Vec<(String, String, i64, i64, i32, Duration, watch::Sender<_>)> = client
            .inner
            .leaders()
            .iter()
            .filter(|(role, _)| all || busy.contains_key(*role))
            .map(|(role, l)| {
                (
                    role.clone(),
                    l.node.clone(),
                    l.term,
                    l.ttl_ms,
                    l.priority,
                    l.bound,
                    l.outcome.clone(),
                )
            })
            .collect();
        if leaders.is_empty() {
            continue;
        }
        leaders.sort_by(|a, b| a.0.cmp(&b.0));
        for chunk in chunks(leaders.len(), CHUNK_ROWS) {
            let part = &leaders[chunk];
            let roles: Vec<&str> = part.iter().map(|l| l.0.as_str()).collect();
            let nodes: Vec<&str> = part.iter().map(|l| l.1.as_str()).collect();
            let terms: Vec<i64> = part.iter().map(|l| l.2).collect();
            let ttls: Vec<i64> = part.iter().map(|l| l.3).collect();
            let priorities: Vec<i32> = part.iter().map(|l| l.4).collect();
            let bound = part
                .iter()
                .map(|l| l.5)
                .min()
                .expect("BUG: chunks are not empty");
            let (sent, rows) = client
                .exec(
                    Op::Renew,
                    bound,
                    &client.inner.sql.sql.renew,
                    &[
                        (&roles, Type::TEXT_ARRAY),
                        (&nodes, Type::TEXT_ARRAY),
                        (&terms, Type::INT8_ARRAY),
                        (&ttls, Type::INT8_ARRAY),
                        (&priorities, Type::INT4_ARRAY),
                    ],
                )
                .await;
            tracing::debug!(leaders = part.len(), took = ?sent.elapsed(), "batched lease renewal");
            let mut found: HashMap<String, Renewal> = HashMap::new();
            let failed: Option<bool> = match rows {
                Ok(rows) => rows
                    .iter()
                    .try_for_each(|row| {
                        let role: String = row.try_get(0)?;
                        if !row.try_get::<_, bool>(6)? {
                            found.insert(role, Renewal::Busy);
                            return Ok(());
                        }
                        let r = Renewal::Renewed {
                            row: (row.try_get(4)?, row.try_get(5)?),
                            resign_requested: row.try_get(2)?,
                            ready: row.try_get(3)?,
                        };
                        found.insert(role, r);
                        Ok::<_, tokio_postgres::Error>(())
                    })
                    .err()
                    .map(|_| false),
                Err(e) => {
                    tracing::warn!(error = %e, leaders = part.len(), "the batched lease renewal failed");
                    Some(is_read_only(&e))
                }
            };
            for (role, _, term, _, _, bound, tx) in part {
                let r = match failed {
                    Some(read_only) => Renewal::Failed { read_only },
                    None => found.remove(role).unwrap_or(Renewal::NotOurs),
                };
                if matches!(r, Renewal::Busy) {
                    let first = busy.entry(role.clone()).or_insert((*term, sent));
                    if first.0 != *term {
                        *first = (*term, sent);
                    }
                    if sent.saturating_duration_since(first.1) < *bound / 2 {
                        continue;
                    }
                }
                busy.remove(role);
                tx.send_replace(Some((sent, r)));
            }
        }
    }
}

/// The standby task: registers the standbys that are due and sends the
/// batched acquire for all standbys when the earliest one is due; ends
/// with the client.
async fn standby_batches(inner: Weak<Inner>, joined: Arc<Notify>, stop: CancellationToken) {
    let mut failures = 0u32;
    loop {
        let next = match inner.upgrade() {
            Some(i) => {
                let standbys = i.standbys();
                standbys.values().map(|s| s.due.min(s.register_due)).min()
            }
            None => return,
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = joined.notified() => continue,
            _ = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let client = SharedLease { inner };
        register_due(&client).await;
        let now = Instant::now();
        let due = client.inner.standbys().values().any(|s| s.due <= now);
        if !due {
            continue;
        }
        if acquire_all(&client).await {
            failures = 0;
        } else {
            failures = failures.saturating_add(1);
            let wait = backoff(failures);
            let now = Instant::now();
            for s in client.inner.standbys().values_mut() {
                s.due = now + wait.min(s.retry_every);
            }
        }
    }
}

/// The listening task of [`SharedLease::listen_via`]: `LISTEN`s for
/// leader events and brings the standbys' next acquire forward when a
/// role one of them waits for is announced released; ends with the client.
async fn listen_releases(
    inner: Weak<Inner>,
    options: ConnectOptions,
    purpose: String,
    stop: CancellationToken,
) {
    let schema = options.schema_name().as_str().to_owned();
    let wake = |role: Option<&str>| match inner.upgrade() {
        Some(i) => {
            SharedLease { inner: i }.wake_standbys(role);
            true
        }
        None => false,
    };
    listen_for(&options, &purpose, &[LEADER_CHANNEL], &stop, |n| match n {
        // Missed (before the LISTEN took effect, or the notices lagged):
        // poll as if one was ours.
        None => wake(None),
        Some(n) => match parse_leader_event(&schema, &n.payload) {
            Some(("released", role)) if n.channel == LEADER_CHANNEL => {
                let alive = wake(Some(role));
                if let Some(i) = inner.upgrade() {
                    i.releases_heard.fetch_add(1, Ordering::Relaxed);
                }
                alive
            }
            _ => inner.strong_count() > 0,
        },
    })
    .await
}

/// Early acquires brought by release announcements, within the wake-up
/// limit.
#[derive(Default)]
struct Wakes {
    limit: WakeLimit,
    /// The early acquire already scheduled: it tries every standby, so
    /// announcements until then need no other.
    pending: Option<Instant>,
}

impl SharedLease {
    /// Brings the next acquire forward for the standby of `role` (for any
    /// standby when `None`: announcements may have been missed), if there
    /// is one, within the wake-up limit: its role was announced released.
    pub(crate) fn wake_standbys(&self, role: Option<&str>) {
        let inner = &self.inner;
        let now = Instant::now();
        {
            let mut wakes = inner.wakes.lock().unwrap_or_else(PoisonError::into_inner);
            let mut standbys = inner.standbys();
            // Marked in every case: an acquire in flight now may have read
            // the row before the release, and its outcome would put the
            // next try off by up to `retry_every`.
            match role {
                Some(r) => {
                    if let Some(s) = standbys.get_mut(r) {
                        s.woken_at = Some(now);
                    }
                }
                None => standbys.values_mut().for_each(|s| s.woken_at = Some(now)),
            }
            if wakes.pending.is_some_and(|p| p > now) {
                return;
            }
            let standby = match role {
                Some(r) => standbys.get_mut(r),
                None => standbys.values_mut().min_by_key(|s| s.due),
            };
            let Some(standby) = standby else {
                return;
            };
            if standby.due <= now {
                return;
            }
            let at = wakes.limit.reserve(now);
            wakes.pending = Some(at);
            standby.due = standby.due.min(at);
        }
        inner.joined.notify_one();
    }
}

/// Registers (upserts in the registry) every standby whose registration
/// is due within a quarter of its TTL, in chunks.
async fn register_due(client: &SharedLease) {
    let now = Instant::now();
    let mut due: Vec<(String, Registration)> = client
        .inner
        .standbys()
        .iter()
        .filter(|(_, s)| s.register_due <= now + s.ttl / 4)
        .map(|(role, s)| {
            let r = &s.registration;
            (
                role.clone(),
                Registration {
                    role: r.role.clone(),
                    node: r.node.clone(),
                    priority: r.priority,
                    standby: r.standby,
                    timing: r.timing.clone(),
                    meta: r.meta.clone(),
                    payload: r.payload.clone(),
                },
            )
        })
        .collect();
    if due.is_empty() {
        return;
    }
    // In role order, so that concurrent registrations lock rows in one
    // order.
    due.sort_by(|a, b| a.0.cmp(&b.0));
    for chunk in chunks(due.len(), CHUNK_ROWS) {
        let part = &due[chunk];
        match register_chunk(client, part).await {
            Ok(()) => {}
            Err(e) if is_transient(&e) => {
                tracing::warn!(error = %e, candidates = part.len(), "the batched registration failed; retrying");
            }
            Err(e) => {
                let roles: Vec<&str> = part.iter().map(|r| r.0.as_str()).collect();
                let alone = |i: usize| register_chunk(client, &part[i..=i]);
                if !refuse(client, &roles, e, alone).await {
                    return;
                }
            }
        }
    }
}

/// Registers the standbys of `part`, and schedules their next
/// registration; returns the statement's error.
async fn register_chunk(client: &SharedLease, part: &[(String, Registration)]) -> Result<()> {
    {
        let roles: Vec<&str> = part.iter().map(|r| r.1.role.as_str()).collect();
        let nodes: Vec<&str> = part.iter().map(|r| r.1.node.as_str()).collect();
        let priorities: Vec<i32> = part.iter().map(|r| r.1.priority).collect();
        let standbys: Vec<Option<&str>> = part.iter().map(|r| r.1.standby).collect();
        let timings: Vec<&serde_json::Value> = part.iter().map(|r| &*r.1.timing).collect();
        let metas: Vec<Option<&serde_json::Value>> =
            part.iter().map(|r| r.1.meta.as_ref()).collect();
        let payloads: Vec<&str> = part.iter().map(|r| r.1.payload.as_str()).collect();
        let (sent, r) = client
            .exec(
                Op::Register,
                PATIENT_BOUND,
                &client.inner.sql.register,
                &[
                    (&roles, Type::TEXT_ARRAY),
                    (&nodes, Type::TEXT_ARRAY),
                    (&priorities, Type::INT4_ARRAY),
                    (&standbys, Type::TEXT_ARRAY),
                    (&timings, Type::JSONB_ARRAY),
                    (&metas, Type::JSONB_ARRAY),
                    (&payloads, Type::TEXT_ARRAY),
                ],
            )
            .await;
        tracing::debug!(candidates = part.len(), took = ?sent.elapsed(), "batched lease registration");
        let mut standbys = client.inner.standbys();
        for (role, _) in part {
            if let Some(s) = standbys.get_mut(role) {
                s.register_due = match &r {
                    // Readiness is "seen within ttl" on the server's clock.
                    Ok(_) => sent + s.ttl / 2,
                    Err(_) => Instant::now() + s.retry_every,
                };
            }
        }
        r.map(drop)
    }
}

/// A batched statement for the standbys of `roles` failed in a way that
/// retrying does not cure (a missing schema or privilege, a refused
/// login): each of them is handed the error, as a lone candidate's
/// `leadership()` returns it, and leaves. An error that carries no driver
/// error names the client's setup and is copied to each. Any other is
/// learnt by each standby with a statement of its own (`alone(i)` for
/// `roles[i]`, one after another), so that each gets its own error and
/// one standby's fault is not blamed on the others; a failed statement
/// took nothing. False when a transient failure cut that short.
async fn refuse<F, Fut>(client: &SharedLease, roles: &[&str], e: Error, mut alone: F) -> bool
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    tracing::warn!(error = %e, standbys = roles.len(), "a batched lease statement was refused; its candidates get the error");
    if e.copied().is_some() {
        for role in roles {
            if let Some(e) = e.copied() {
                refuse_one(client, role, e);
            }
        }
        return true;
    }
    for (i, role) in roles.iter().enumerate() {
        match alone(i).await {
            Ok(()) => {}
            Err(e) if is_transient(&e) => return false,
            Err(e) => refuse_one(client, role, e),
        }
    }
    true
}

/// Hands `e` to the standby of `role`, which leaves the batch.
fn refuse_one(client: &SharedLease, role: &str, e: Error) {
    let mut standbys = client.inner.standbys();
    if let Some(mut s) = standbys.remove(role) {
        if let Some(tx) = s.won.take() {
            let _ = tx.send(Err(e));
        }
    }
}

/// One role's row of the acquire ([`LeaseSql::acquire`]), decoded.
struct Acquired {
    role: String,
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
    fn decode(row: &Row) -> std::result::Result<Acquired, tokio_postgres::Error> {
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
            role: row.try_get(10)?,
        })
    }
}

/// Server-reported milliseconds as a duration; zero for a negative or
/// non-finite value.
fn ms(f: f64) -> Duration {
    if f.is_finite() && f > 0.0 {
        Duration::from_secs_f64((f / 1000.0).min(1e9))
    } else {
        Duration::ZERO
    }
}

/// The largest jitter for `ttl`: [`MAX_JITTER`], a twentieth of the TTL
/// below 1 s.
fn max_jitter(ttl: Duration) -> Duration {
    MAX_JITTER.min(ttl / 20)
}

/// Up to [`max_jitter`] after an expiry, so that the candidates do not all
/// fire at once.
fn jitter(ttl: Duration) -> Duration {
    Duration::from_millis(random_u64() % (max_jitter(ttl).as_millis() as u64 + 1))
}

/// Sends the batched acquire for every standby, in chunks; hands each won
/// role to its standby and schedules the others' next attempt. False when
/// a statement failed.
async fn acquire_all(client: &SharedLease) -> bool {
    let mut entries: Vec<Entry> = client
        .inner
        .standbys()
        .iter()
        .map(|(role, s)| {
            (
                role.clone(),
                s.node.clone(),
                s.meta.clone(),
                s.ttl_ms,
                s.payload.clone(),
                s.priority,
            )
        })
        .collect();
    if entries.is_empty() {
        return true;
    }
    // From this client's own place in role order (see `offset`); each chunk
    // is sorted again below, so every statement locks its rows in role
    // order and concurrent acquires cannot deadlock.
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let at = client.inner.offset % entries.len();
    entries.rotate_left(at);
    // The statement's bound: a third of the shortest TTL, within 2 to 5 s
    // (renewals wait behind it).
    let bound = {
        let standbys = client.inner.standbys();
        let ttl = standbys.values().map(|s| s.ttl).min().unwrap_or_default();
        (ttl / 3).clamp(PATIENT_BOUND, Duration::from_secs(5))
    };
    let size = client.inner.acquire_rows.load(Ordering::Relaxed);
    for chunk in chunks(entries.len(), size) {
        let part = &mut entries[chunk];
        part.sort_by(|a, b| a.0.cmp(&b.0));
        let part = &*part;
        match acquire_chunk(client, part, bound).await {
            Ok(()) => {}
            Err(e) if is_transient(&e) => return false,
            Err(e) => {
                let roles: Vec<&str> = part.iter().map(|e| e.0.as_str()).collect();
                let alone = |i: usize| acquire_chunk(client, &part[i..=i], bound);
                if !refuse(client, &roles, e, alone).await {
                    return false;
                }
            }
        }
    }
    true
}

/// A standby's entry in a batched acquire: role, node, meta, TTL in
/// milliseconds, notification payload, priority.
type Entry = (String, String, Option<serde_json::Value>, i64, String, i32);

/// Sends the batched acquire for `part`; hands each won role to its
/// standby and schedules the others' next attempt. Returns the statement's
/// error.
async fn acquire_chunk(client: &SharedLease, part: &[Entry], bound: Duration) -> Result<()> {
    let s = client.inner.options.schema_name().as_str();
    let roles: Vec<&str> = part.iter().map(|e| e.0.as_str()).collect();
    let nodes: Vec<&str> = part.iter().map(|e| e.1.as_str()).collect();
    let metas: Vec<Option<&serde_json::Value>> = part.iter().map(|e| e.2.as_ref()).collect();
    let ttls: Vec<i64> = part.iter().map(|e| e.3).collect();
    let payloads: Vec<&str> = part.iter().map(|e| e.4.as_str()).collect();
    let priorities: Vec<i32> = part.iter().map(|e| e.5).collect();
    let token = random_u64() as i64;
    let unanswered: Vec<i64> = client.inner.unanswered().iter().copied().collect();
    let (sent, r) = client
        .exec(
            Op::Acquire,
            bound,
            &client.inner.sql.sql.acquire,
            &[
                (&roles, Type::TEXT_ARRAY),
                (&nodes, Type::TEXT_ARRAY),
                (&metas, Type::JSONB_ARRAY),
                (&ttls, Type::INT8_ARRAY),
                (&payloads, Type::TEXT_ARRAY),
                (&priorities, Type::INT4_ARRAY),
                (&token, Type::INT8),
                (&unanswered, Type::INT8_ARRAY),
            ],
        )
        .await;
    tracing::debug!(standbys = part.len(), took = ?sent.elapsed(), "batched lease acquire");
    let rows = match r {
        Ok(rows) => rows,
        Err(e) => {
            // Unless the server answered with an error (nothing
            // committed), the statement may have committed: the leases
            // it took name our nodes and nobody acts on them.
            let answered =
                matches!(&e, Error::Database { source, .. } if source.as_db_error().is_some());
            if !answered {
                let mut u = client.inner.unanswered();
                if u.len() >= UNANSWERED_TOKENS {
                    u.pop_front();
                }
                u.push_back(token);
                // Smaller chunks hold fewer rows for less time.
                let smaller = (part.len() / 2).max(MIN_ACQUIRE_ROWS);
                client.inner.acquire_rows.store(smaller, Ordering::Relaxed);
            }
            tracing::warn!(error = %e, standbys = part.len(), "the batched lease acquire failed");
            return Err(e);
        }
    };
    let decoded: std::result::Result<Vec<Acquired>, _> =
        rows.iter().map(Acquired::decode).collect();
    let decoded = match decoded {
        Ok(d) => d,
        Err(e) => {
            // Never: the statement's columns are ours. Whatever it won
            // expires unused after a TTL.
            let e = Error::db(Op::Acquire.operation(), s, e);
            tracing::warn!(error = %e, "could not read the batched acquire's rows");
            return Err(e);
        }
    };
    let size = client.inner.acquire_rows.load(Ordering::Relaxed);
    let grown = (size * 2).min(ACQUIRE_ROWS);
    client.inner.acquire_rows.store(grown, Ordering::Relaxed);
    let now = Instant::now();
    let mut unclaimed = Vec::new();
    {
        let mut standbys = client.inner.standbys();
        for a in decoded {
            let entry = standbys.get_mut(&a.role);
            if let Some(shared) = entry.as_ref().and_then(|e| e.shared.upgrade()) {
                shared.contact.touch();
            }
            match (a.won, entry) {
                (Some((term, acquired_at, lease_until)), Some(e)) => {
                    let node = e.node.clone();
                    let tx = e.won.take();
                    standbys.remove(&a.role);
                    let won = Won {
                        sent,
                        term,
                        acquired_at,
                        lease_until,
                        prev_holder: a.prev_holder,
                        prev_backend: a.prev_backend,
                    };
                    if tx.is_none_or(|tx| tx.send(Ok(won)).is_err()) {
                        unclaimed.push((a.role, node, term));
                    }
                }
                (Some((term, _, _)), None) => {
                    // The standby left while the statement ran.
                    let node = part
                        .iter()
                        .find(|e| e.0 == a.role)
                        .map(|e| e.1.clone())
                        .unwrap_or_default();
                    unclaimed.push((a.role, node, term));
                }
                (None, None) => {}
                (None, Some(e)) => {
                    let remaining = a.prev_remaining.unwrap_or(0.0);
                    if a.rearmed {
                        tracing::info!(role = a.role, holder = ?a.prev_holder, lease = ?ms(remaining), "the lease row was last written before this server's promotion and may lack the old primary's last renewals: re-armed it for a full TTL before anyone takes it over");
                    }
                    if a.prev_holder.is_some()
                        && a.prev_backend.as_deref() == Some("session")
                        && remaining > 0.0
                    {
                        let err = Error::config(format!(
                                "role {:?} is held by {:?}, a leader using the session backend, but this candidate uses the lease backend: all candidates of a role must use the same backend",
                                a.role,
                                a.prev_holder.unwrap_or_default()
                            ));
                        if let Some(tx) = e.won.take() {
                            let _ = tx.send(Err(err));
                        }
                        standbys.remove(&a.role);
                        continue;
                    }
                    let wait = if a.deferred_to.is_some() {
                        // Left to a candidate of higher priority seen
                        // within its TTL; its registration goes stale
                        // within a TTL if it never takes the lease.
                        e.retry_every
                    } else {
                        let left = if a.prev_holder.is_some() {
                            ms(remaining)
                        } else {
                            Duration::ZERO
                        };
                        (left + jitter(e.ttl)).min(e.retry_every)
                    };
                    // Announced released after this statement was sent:
                    // it may have read the row before the release.
                    let wait = match e.woken_at.take() {
                        Some(w) if w >= sent => wait.min(REWAKE_GAP),
                        _ => wait,
                    };
                    e.due = now + wait;
                }
            }
        }
    }
    for (role, node, term) in unclaimed {
        let bound = PATIENT_BOUND;
        tracing::debug!(
            role,
            term,
            "a lease won for a standby that left; releasing it"
        );
        if let Err(e) = client.release_role(&role, &node, term, bound).await {
            tracing::warn!(role, error = %e, "could not release a lease won for a standby that left; it expires on its own");
        }
    }
    Ok(())
}

/// Keeps the renewal's answer for the keeper: `Renewal` to the driver's
/// `Answer`, or the error the keeper retries on.
pub(crate) fn renewal_answer(r: Renewal) -> Result<crate::election::driver::Answer> {
    use crate::election::driver::{Answer, Preferred};
    match r {
        Renewal::Renewed {
            row,
            resign_requested,
            ready,
        } => Ok(Answer::Renewed {
            row: Some(row),
            resign_requested,
            preferred: Preferred {
                ready,
                pending: false,
            },
        }),
        Renewal::NotOurs => Ok(Answer::NotOurs),
        Renewal::Busy => Ok(Answer::Busy),
        Renewal::Failed { .. } => Err(Error::connection_lost(Op::Renew.operation())),
    }
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
    fn chunks_cover_every_item_once() {
        assert_eq!(chunks(4000, CHUNK_ROWS).count(), 2);
    }

    #[test]
    fn statements_are_scoped_to_holder_and_term() {
        let sql = lease_sql(&SchemaName::default());
        assert!(
            sql.renew.contains("greatest(l.lease_until, now()"),
            "{}",
            sql.renew
        );
        for s in [&sql.renew, &sql.release] {
            assert!(
                s.contains("l.role = m.role AND l.holder = m.node AND l.term = m.term"),
                "{s}"
            );
        }
        assert!(sql.renew.contains("SKIP LOCKED"), "{}", sql.renew);
        assert!(
            sql.acquire.contains("l.lease_until < now()"),
            "{}",
            sql.acquire
        );
        assert!(
            sql.acquire.contains("c.priority > a.priority"),
            "{}",
            sql.acquire
        );
        assert!(sql.acquire.contains("pg_notify"), "{}", sql.acquire);
        for s in [&sql.acquire, &sql.renew, &sql.release] {
            assert!(!s.contains(';'), "one statement each: {s}");
        }
    }
}
