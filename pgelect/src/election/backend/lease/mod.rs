//! The lease backend: the lease row only. Every step is one statement,
//! hence one transaction, so the backend works through PgBouncer in
//! transaction mode: no session state (no advisory lock, no `SET`, no named
//! prepared statement) is relied upon between two statements. Every time
//! comparison uses the server's `now()`, and the remaining lease is
//! computed by the server, so the candidates' clocks never need to agree.
//!
//! One engine sends every statement: [`SharedLease`], one connection for
//! the lease-backend candidates of many roles, with batched acquires,
//! registrations and renewals. A candidate not built on a shared client
//! stands on a client of its own that carries it alone: a single candidate
//! is a batch of one. The leader's loop is the shared
//! [`driver`](crate::election::driver); all decisions about the leader's
//! deadline are taken by the pure [`Keeper`](crate::election::keeper::Keeper),
//! with [`Liveness::statements`](crate::election::keeper::Liveness::statements)
//! (no heartbeats, each statement bounded by the client).
//!
//! * this module: the client itself: its connection (reopened at will),
//!   how a statement is sent and bounded, the roles it carries.
//! * [`sql`]: the statements, one SQL text per operation, each taking one
//!   array element per role, and the typed calls that send them and decode
//!   their rows: the one seam every caller goes through.
//! * [`campaign`]: gaining leadership: an elector's campaign and the
//!   client's standby task (registrations, acquires, refusals).
//! * [`keep`]: keeping it: the leader's [`KeepBackend`](crate::election::driver::KeepBackend)
//!   and the client's renewal task, and the release.
//! * [`listen`]: the `LISTEN` connections (an elector's own, a client's
//!   [`listen_via`](SharedLease::listen_via)) and the early acquires a
//!   release announcement brings.

mod campaign;
mod keep;
mod listen;
mod sql;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{watch, Mutex as AsyncMutex, Notify};
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use tokio_util::sync::CancellationToken;

use crate::conn::{ConnectOptions, DedicatedConnection};
use crate::error::{Error, Result};
use crate::schema::check_schema;

use crate::election::config::random_u64;
use crate::election::support::{is_transient, ParkedConnection};
use crate::election::watch::LEADER_CHANNEL;

use super::claim::{Claim, Roles};

pub(crate) use campaign::campaign;
pub(crate) use listen::listen;
#[cfg(feature = "test-hooks")]
pub use sql::lease_sql;
#[cfg(feature = "test-hooks")]
pub use sql::LeaseSql;
pub(crate) use sql::{functions_grant, functions_sql};

use campaign::{standby_batches, Standby, ACQUIRE_ROWS};
use keep::{renew_batches, Leader};
use listen::Wakes;
use sql::Statements;

/// One connection that carries the statements of the lease-backend
/// candidates of many roles in one process, batched: a process standing
/// for thousands of roles holds one connection and sends a few statements
/// a second, not one connection and several statements a second per role.
///
/// The name says what it shares: the lease backend's traffic, as
/// [`SharedConnection`](crate::election::SharedConnection) shares the session
/// backend's session. Unlike that one, nothing lives in the connection's
/// session: every statement is one transaction, the connection is reopened
/// at will after a failure, and it works through PgBouncer in transaction
/// mode, as the lease backend does.
///
/// What goes over it, for every candidate built with
/// [`LeaseOptions::shared_lease`](crate::election::LeaseOptions::shared_lease):
///
/// * **Renewals**: one `UPDATE … FROM unnest(…)` renews every leader on
///   the client (in chunks of 2,000), each for its own TTL, and tells each
///   role on its own whether its row was still its own: a role whose row
///   was taken is lost alone. Leaders renewed by one statement ask again
///   together, so at steady state one statement per renewal period serves
///   them all. Each role keeps its own term and its own local deadline,
///   counted from the moment that statement was sent. A row that a fenced
///   transaction holds is skipped, not waited for, and tried again alone
///   every 25 ms for up to half the leader's statement bound: one
///   application's transaction never holds up the other roles' renewals.
/// * **Standbys**: one batched acquire per poll tries every standby role
///   (in chunks of 5,000) and takes those whose lease is free or expired
///   on the server's clock (a ready candidate of strictly higher priority
///   goes first; a role held by a session-backend leader is refused). A poll is sent at
///   the earliest server-reported expiry among the standbys, at least
///   every `retry_every` (1 s by default), and, with
///   [`listen_via`](SharedLease::listen_via), at once when a leader
///   announces the release of a role one of them waits for.
/// * **Registrations** in the candidate registry: one statement when a
///   standby joins (and every 10 minutes, or when its row is gone); in
///   between, the batched acquire refreshes each standby's `seen_at` once
///   it is half a TTL old, and a standby polls at least every nine tenths
///   of its TTL, so that it stays ready (seen within its TTL).
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
/// One connection, and one more with
/// [`listen_via`](SharedLease::listen_via) (to `LISTEN`, and for the
/// releases and the acquires a release announcement brings). At steady state, per process: one renewal statement per
/// `renew_every` per 2,000 leaders and one acquire per 5,000 standbys at
/// the earliest of: the lease's expiry on the server's clock (plus up to
/// 50 ms of jitter), `retry_every`, and nine tenths of the TTL after the
/// registrations were last refreshed. With `retry_every` at the TTL or
/// more, a standby of a role whose leader renews every `ttl / 3` costs
/// about 1.2 statements per TTL: a fleet of N such processes about
/// `1.2 × N / ttl` statements a second.
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
/// use pgelect::election::{LeaseOptions, SharedLease};
/// use pgelect::{ConnectOptions, Elector};
/// // Through PgBouncer in transaction mode, if need be.
/// let options = ConnectOptions::from_url("postgres://app@pgbouncer:6432/app")?;
/// let client = SharedLease::new(&options);
/// let mut shards = Vec::new();
/// for shard in 0..1000 {
///     let elector = Elector::builder(options.clone(), &format!("shard-{shard}"))
///         .ttl(Duration::from_secs(15))
///         .backend(LeaseOptions::new().shared_lease(&client))
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

/// The name (after `pgelect:`) of every lease client's connection that
/// goes through a pooler (see [`SharedLease::application_name`]).
const POOLED_NAME: &str = "lease";

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
    /// The connection between two statements (and one being opened); a
    /// statement holds the lock while in flight, so one statement at a
    /// time is sent.
    conn: AsyncMutex<Link>,
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
    /// Whether the current connection found the schema's lease functions
    /// with this version's statements and may call them (checked at each
    /// connection): the statements are then sent as calls.
    functions: AtomicBool,
    started: AtomicBool,
    /// Where the client listens for release announcements, if anywhere
    /// ([`SharedLease::listen_via`]).
    listen_via: Mutex<Option<ConnectOptions>>,
    /// Whether the client's connection goes through a pooler, as a client
    /// whose candidates listen on a direct connection does: it is then
    /// named [`POOLED_NAME`] (see [`SharedLease::application_name`]).
    pooled: AtomicBool,
    /// Set once the listening task runs.
    listening: AtomicBool,
    /// The listening connection, between notifications: it bypasses the
    /// pooler, so a release and an acquire that a release announcement
    /// brought take it ([`SharedLease::exec_direct`]) instead of the
    /// pooled one, one hop (PgBouncer's) shorter on a handover's path.
    direct: Arc<ParkedConnection>,
    /// The parked connection once it was found able to call this
    /// version's lease functions and their plans were made
    /// ([`SharedLease::ready_direct`]); only then does a statement take it.
    direct_ready: Mutex<Option<DirectReady>>,
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

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// How many rows one chunk of a batched renewal or registration carries
/// at most (see the session backend's `RENEW_ROWS`: a chunk must stay well
/// under the heartbeat timeout on a loaded machine).
const CHUNK_ROWS: usize = 2000;

/// The least time allowed for connecting and for a standby's statement.
const PATIENT_BOUND: Duration = Duration::from_secs(2);

/// The statements of the client, for errors and bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Renew,
    Acquire,
    Register,
    Release,
    Withdraw,
    Read,
    /// A partition group's read ([`SharedLease::read_group`]).
    ReadGroup,
}

impl Op {
    fn operation(self) -> &'static str {
        match self {
            Op::Renew => "renew the lease",
            Op::Acquire => "take the lease",
            Op::Register => "register as a candidate",
            Op::Release => "release the lease",
            Op::Withdraw => "withdraw from the candidate registry",
            Op::Read => "read the lease",
            Op::ReadGroup => "read the partition group",
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
                conn: AsyncMutex::new(Link::default()),
                roles: Roles::default(),
                leaders: Mutex::new(HashMap::new()),
                renew_wanted: watch::Sender::new(None),
                standbys: Mutex::new(HashMap::new()),
                joined: Arc::new(Notify::new()),
                unanswered: Mutex::new(VecDeque::new()),
                sql: Statements::new(schema),
                functions: AtomicBool::new(false),
                started: AtomicBool::new(false),
                listen_via: Mutex::new(None),
                pooled: AtomicBool::new(false),
                listening: AtomicBool::new(false),
                direct: Arc::new(ParkedConnection::default()),
                direct_ready: Mutex::new(None),
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
    /// unique per client (`pgelect:lease:<role>:<node>` for a candidate's
    /// own client); `pgelect:lease`, the same for every client, once its
    /// candidates listen on a direct connection
    /// ([`listen_via`](SharedLease::listen_via), or
    /// [`LeaseOptions::listen_via`](crate::election::LeaseOptions::listen_via)
    /// for a candidate's own client).
    ///
    /// A client that listens elsewhere reaches the server through a pooler,
    /// whose server connections serve every client in turn: PgBouncer sends
    /// a `SET application_name` of its own before each statement it
    /// forwards for a client named otherwise than the connection's previous
    /// one, so a name per client costs the server a second statement for
    /// most statements, and the name read on the server is only the last
    /// client's anyway. Each client's direct `LISTEN` connection keeps a
    /// name of its own (`pgelect:listen:<role>:<node>`, or
    /// [`listen_application_name`](SharedLease::listen_application_name)),
    /// where the server shows it truly.
    pub fn application_name(&self) -> String {
        format!("pgelect:{}", self.connection_name())
    }

    /// The `application_name` of the client's direct `LISTEN` connection,
    /// when it listens ([`listen_via`](SharedLease::listen_via); unless
    /// those options set one): `pgelect:shared-lease:<8 hex digits>-listen`,
    /// unique per client.
    pub fn listen_application_name(&self) -> String {
        format!("pgelect:{}-listen", self.purpose())
    }

    /// The connection's name without the `pgelect:` prefix (see
    /// [`SharedLease::application_name`]).
    fn connection_name(&self) -> String {
        if self.inner.pooled.load(Ordering::Acquire) {
            POOLED_NAME.to_owned()
        } else {
            self.purpose()
        }
    }

    /// Marks the client's connection as going through a pooler: named
    /// [`POOLED_NAME`] from its next connection on.
    pub(crate) fn through_pooler(&self) {
        self.inner.pooled.store(true, Ordering::Release);
    }

    /// The number of statements sent on the connection so far (renewals,
    /// acquires, registrations, releases, a partition group's reads; not
    /// the schema check of a new connection).
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
        let link = self.inner.conn.lock().await;
        link.open
            .as_ref()
            .filter(|c| !c.is_closed())
            .map(|c| c.pid())
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

    /// Runs one statement, (re)connecting first if needed, bounded by
    /// `bound` (connecting by at least [`PATIENT_BOUND`]). Returns the
    /// moment the statement was handed to the connection — taken right
    /// before it, never later — and its rows. After a connection failure,
    /// or a second statement in a row without an answer in time, the
    /// connection is dropped (a running statement cancelled), so the next
    /// statement starts on a fresh one; after a first one it is kept (see
    /// [`Link::late`]).
    async fn exec(
        &self,
        op: Op,
        bound: Duration,
        sql: Sql<'_>,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> (Instant, Result<Vec<Row>>) {
        let inner = &self.inner;
        let schema = inner.options.schema_name();
        let operation = op.operation();
        let mut link = inner.conn.lock().await;
        if let Err(e) = self
            .reopen(&mut link, bound.max(PATIENT_BOUND), operation)
            .await
        {
            return (Instant::now(), Err(e));
        }
        let conn = link.open.as_ref().expect("BUG: connected above");
        let c = conn;
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
        // A call of a lease function needs neither: the function sets
        // `jit` for its own statement.
        let call = match sql {
            Sql::Lease(pick) if inner.functions.load(Ordering::Relaxed) => {
                Some(pick(&inner.sql.calls).as_str())
            }
            _ => None,
        };
        let run = async {
            if let Some(call) = call {
                return c
                    .client()
                    .query_typed(call, params)
                    .await
                    .map_err(|e| Error::db(operation, schema.as_str(), e));
            }
            let sql = match sql {
                Sql::Lease(pick) => pick(&inner.sql.sql).as_str(),
                Sql::Text(sql) => sql,
            };
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
        let r = match r {
            // The first statement in a row that got no answer in time: the
            // connection is kept (see `Link::late`).
            Err(_) if !link.late => {
                link.late = true;
                Err(Error::connection_lost(operation))
            }
            r => {
                if r.is_ok() {
                    link.late = false;
                }
                let r = drop_connection_on_failure(&mut link.open, operation, r);
                if link.open.is_none() {
                    link.late = false;
                }
                r
            }
        };
        (sent, r)
    }

    /// Makes sure `link` has an open connection, waiting at most `bound`
    /// for one. A connection attempt runs in a task of its own, which a
    /// caller that stops waiting leaves running: the next statement takes
    /// the connection it opens (or its error). Through a pooler that logs
    /// clients in slowly (PgBouncer hashes each SCRAM login on its one
    /// thread: about 100 a second on a 2-core machine), a login given up
    /// at every statement's bound and started again by the next one was
    /// work thrown away: 1,000 members starting together never all logged
    /// in.
    async fn reopen(
        &self,
        link: &mut Link,
        bound: Duration,
        operation: &'static str,
    ) -> Result<()> {
        if link.open.as_ref().is_some_and(|c| c.is_closed()) {
            link.open.take();
        }
        if link.open.is_some() {
            return Ok(());
        }
        let opening = link
            .opening
            .get_or_insert_with(|| tokio::spawn(self.open_connection()));
        let joined = match tokio::time::timeout(bound, opening).await {
            Ok(joined) => joined,
            // Still connecting: left running for the next statement.
            Err(_) => return Err(Error::connection_lost(operation)),
        };
        link.opening = None;
        match joined {
            Ok(Ok((c, functions))) => {
                self.inner.functions.store(functions, Ordering::Relaxed);
                link.open = Some(c);
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            // Panicked or cancelled at the runtime's shutdown.
            Err(_) => Err(Error::connection_lost(operation)),
        }
    }

    /// A new connection for the client, checked: the schema's version, and
    /// whether it may call the lease functions (the second value). Owns
    /// what it needs, to run in a task of its own ([`Self::reopen`]),
    /// bounded by the connect timeout (plus [`PATIENT_BOUND`] for the
    /// checks, which wait behind other clients through a pooler).
    fn open_connection(
        &self,
    ) -> impl std::future::Future<Output = Result<(DedicatedConnection, bool)>> + Send + 'static
    {
        let options = self.inner.options.clone();
        let name = self.connection_name();
        let (sigs, sources) = self.inner.sql.check.clone();
        let at_most = options.connect_bound() + PATIENT_BOUND;
        async move {
            let open = async {
                let schema = options.schema_name();
                let c = options.connect(&name).await?;
                let args: [(&(dyn ToSql + Sync), Type); 2] =
                    [(&sigs, Type::TEXT_ARRAY), (&sources, Type::TEXT_ARRAY)];
                // Pipelined: one round trip.
                let (checked, functions) = tokio::join!(
                    check_schema(c.client(), schema),
                    c.client().query_typed_one(sql::FUNCTIONS_CHECK, &args)
                );
                let functions = functions
                    .and_then(|row| row.try_get::<_, bool>(0))
                    .map_err(|e| Error::db("look for the lease functions", schema.as_str(), e));
                let mut found = false;
                let checked = checked.and_then(|()| {
                    found = functions?;
                    if !found {
                        tracing::debug!(
                            schema = schema.as_str(),
                            "the schema's lease functions are missing, differ from this version's statements or may not be called (no EXECUTE grant): the statements are sent whole"
                        );
                    }
                    Ok(())
                });
                c.kept_if(checked).map(|c| (c, found))
            };
            match tokio::time::timeout(at_most, open).await {
                Ok(r) => r,
                Err(_) => Err(Error::connection_lost("connect and check the schema")),
            }
        }
    }
}

/// The client's connection between two statements, and a connection
/// attempt that a statement stopped waiting for ([`SharedLease::reopen`]).
#[derive(Default)]
struct Link {
    open: Option<DedicatedConnection>,
    /// The last statement on `open` got no answer within its bound, and
    /// the connection was kept: the answer is read and thrown away when it
    /// comes (the driver does so for a dropped request), and the next
    /// statement goes after it. Through a pooler a late answer is mostly a
    /// statement waiting in the pooler's queue; dropping the connection
    /// for it cost a new login (PgBouncer's scarcest work at 1,000
    /// clients) and, if the statement had reached a server connection,
    /// that server connection too. A second statement in a row without an
    /// answer in time drops the connection (with a cancel request), as
    /// any transient failure does. What a late statement did is never
    /// counted: a renewal without an answer is a failed renewal, whose
    /// leader's deadline still runs from its last answered one (a late
    /// commit only moves the server's expiry later); an acquire without
    /// an answer is remembered as unanswered (see `Inner::unanswered`).
    late: bool,
    opening: Option<tokio::task::JoinHandle<Result<(DedicatedConnection, bool)>>>,
}

impl Drop for Link {
    fn drop(&mut self) {
        // The client is gone: nobody takes the connection being opened.
        if let Some(t) = self.opening.take() {
            t.abort();
        }
    }
}

impl SharedLease {
    /// Runs `sql`, a statement that only reads (a partition group's read
    /// of its rows), on the client's connection between the client's own
    /// statements, bounded by `bound` as they are: a member of a partition
    /// group is then one pooled client, not two, and logs in once. A
    /// failure is handled as any of the client's statements' (after a
    /// timeout or a lost connection the next statement reconnects).
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads; a statement dropped in flight is
    /// answered on the connection and its answer discarded.
    pub(crate) async fn read_group(
        &self,
        bound: Duration,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>> {
        self.exec(Op::ReadGroup, bound, Sql::Text(sql), params)
            .await
            .1
    }
}

impl SharedLease {
    /// [`exec`](Self::exec), on the listening connection if it is parked
    /// and ready ([`ready_direct`](Self::ready_direct)): a call of the
    /// schema's function that runs the lease statement `sql`. `None` when
    /// that connection is not there (or is not ready, or is busy with
    /// another statement): the caller sends the statement through the
    /// pooler as usual. After a timeout or a lost connection the listening
    /// connection is dropped (the listener opens a new one).
    async fn exec_direct(
        &self,
        op: Op,
        bound: Duration,
        sql: fn(&sql::LeaseSql) -> &String,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Option<(Instant, Result<Vec<Row>>)> {
        let inner = &self.inner;
        let mut direct = inner.direct.try_lock().ok()?;
        let c = direct.as_ref().filter(|c| !c.is_closed())?;
        let ready = inner
            .direct_ready
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|r| r.pid == c.pid())?;
        let prepared = matches!(op, Op::Release).then_some(ready.release);
        let schema = inner.options.schema_name();
        let operation = op.operation();
        inner.statements.fetch_add(1, Ordering::Relaxed);
        crate::metrics::lease_statement(&inner.metric_role, op_kind(op));
        let sent = Instant::now();
        // Followed, in the same round trip, by a LISTEN it already has (a
        // no-op on the server): `pg_stat_activity` shows the connection's
        // last statement, and an operator (or a check) looking there sees
        // it as what it mostly is, a listener.
        let relisten = format!("LISTEN {LEADER_CHANNEL}");
        let run = async {
            let rows = async {
                match &prepared {
                    Some(statement) => {
                        let values: Vec<&(dyn ToSql + Sync)> =
                            params.iter().map(|(v, _)| *v).collect();
                        c.client().query(statement, &values).await
                    }
                    None => c.client().query_typed(sql(&inner.sql.calls), params).await,
                }
            };
            let (rows, listen) = tokio::join!(rows, c.client().batch_execute(&relisten));
            rows.and_then(|rows| listen.map(|()| rows))
                .map_err(|e| Error::db(operation, schema.as_str(), e))
        };
        let r = tokio::time::timeout(bound, run).await;
        Some((sent, drop_connection_on_failure(&mut direct, operation, r)))
    }

    /// Readies a new listening connection `c` for
    /// [`exec_direct`](Self::exec_direct), before its `LISTEN`: checks that
    /// it may call this version's lease functions (it may connect as
    /// another user than the pooled one), prepares the release on it
    /// ([`DirectReady`]) and has the server plan the acquire and the
    /// release once (each run for no role), so that a handover waits for
    /// neither.
    pub(super) async fn ready_direct(&self, c: &DedicatedConnection) {
        let inner = &self.inner;
        let (sigs, sources) = &inner.sql.check;
        let check: [(&(dyn ToSql + Sync), Type); 2] =
            [(sigs, Type::TEXT_ARRAY), (sources, Type::TEXT_ARRAY)];
        let ready = async {
            let found: bool = c
                .client()
                .query_typed_one(sql::FUNCTIONS_CHECK, &check)
                .await?
                .try_get(0)?;
            if !found {
                return Ok(None);
            }
            let none: Vec<&str> = Vec::new();
            let no_meta: Vec<Option<&serde_json::Value>> = Vec::new();
            let no_ints: Vec<i64> = Vec::new();
            let no_prios: Vec<i32> = Vec::new();
            let token = 0i64;
            let acquire: [(&(dyn ToSql + Sync), Type); 8] = [
                (&none, Type::TEXT_ARRAY),
                (&none, Type::TEXT_ARRAY),
                (&no_meta, Type::JSONB_ARRAY),
                (&no_ints, Type::INT8_ARRAY),
                (&none, Type::TEXT_ARRAY),
                (&no_prios, Type::INT4_ARRAY),
                (&token, Type::INT8),
                (&no_ints, Type::INT8_ARRAY),
            ];
            let release: [(&(dyn ToSql + Sync), Type); 4] = [
                (&none, Type::TEXT_ARRAY),
                (&none, Type::TEXT_ARRAY),
                (&no_ints, Type::INT8_ARRAY),
                (&none, Type::TEXT_ARRAY),
            ];
            // Counted rather than returned: nothing comes back, and the
            // text differs from the client's calls (`SELECT *`), so that
            // the connection's last statement in `pg_stat_activity` tells
            // this preparation from an acquire sent on it.
            let count = |call: &str| call.replacen("SELECT *", "SELECT count(*)", 1);
            let plan_acquire = count(&inner.sql.calls.acquire);
            // The release prepared on this connection, its plan generic as
            // the function's (the setting is this connection's own, and
            // only the prepared release takes a kept plan on it).
            let types = [
                Type::TEXT_ARRAY,
                Type::TEXT_ARRAY,
                Type::INT8_ARRAY,
                Type::TEXT_ARRAY,
            ];
            let (settings, prepared) = tokio::join!(
                c.client()
                    .batch_execute("SET plan_cache_mode = force_generic_plan; SET jit = off"),
                c.client().prepare_typed(&inner.sql.sql.release, &types),
            );
            settings?;
            let prepared = prepared?;
            let values: Vec<&(dyn ToSql + Sync)> = release.iter().map(|(v, _)| *v).collect();
            let (a, r) = tokio::join!(
                c.client().query_typed(&plan_acquire, &acquire),
                c.client().query(&prepared, &values),
            );
            a.and(r).map(|_| Some(prepared))
        };
        let ready = match tokio::time::timeout(PATIENT_BOUND, ready).await {
            Ok(Ok(ready)) => ready,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "the listening connection cannot call the lease functions; releases and early acquires go through the pooler");
                None
            }
            Err(_) => None,
        };
        *inner
            .direct_ready
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = ready.map(|release| DirectReady {
            pid: c.pid(),
            release,
        });
    }
}

/// A listening connection readied for [`SharedLease::exec_direct`].
#[derive(Clone)]
struct DirectReady {
    /// Its server pid.
    pid: i32,
    /// The release ([`sql::LeaseSql::release`]) prepared on it, planned
    /// once (generic): on this connection of its own it needs no function.
    /// After 300 ms idle, as a leader's listening connection always is at
    /// its release, the server ran it in 0.32-0.37 ms against 0.69-0.76 ms
    /// for the function's call (three rounds of 20; the acquire showed no
    /// difference, and is still called).
    release: tokio_postgres::Statement,
}

/// A statement for [`SharedLease::exec`].
#[derive(Clone, Copy)]
pub(super) enum Sql<'a> {
    /// One of the lease statements: sent as a call of the schema's
    /// function when the connection found it, otherwise whole.
    Lease(fn(&sql::LeaseSql) -> &String),
    /// Any other statement, sent whole.
    Text(&'a str),
}

/// The result of a statement run on a lease connection within its bound.
/// After a timeout or a transient failure the connection is dropped (a
/// statement still running is cancelled on the server), so the next
/// statement starts on a fresh one.
fn drop_connection_on_failure<T>(
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
        Op::Register | Op::Withdraw | Op::Read | Op::ReadGroup => "other",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_item_once() {
        assert_eq!(super::super::batch::chunks(4000, CHUNK_ROWS).count(), 2);
    }
}
