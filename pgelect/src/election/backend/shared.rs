//! One lock connection for the polling candidates of many roles.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, oneshot, watch, Mutex as AsyncMutex, Semaphore, SemaphorePermit};
use tokio::time::Instant;
use tokio_postgres::types::Type;

use crate::conn::{ConnectOptions, DedicatedConnection, Notice, TcpTimeouts};
use crate::election::driver::Preferred;
use crate::election::registry;
use crate::error::{Error, Result};
use crate::schema::{check_schema, SchemaName};

use crate::election::support::WakeLimit;

use super::batch::{chunks, remove_if_term, until_wanted, Batch, Member, Outcome, Termed};
use super::claim::{Claim, Roles};
use crate::election::term::{next_term_sql, previous_holder_sql};
use crate::election::watch::{
    leader_info_at, parse_leader_event, LeaderInfo, LEADER_CHANNEL, RESIGN_CHANNEL,
};

/// One server session shared by the session-backend candidates of many
/// roles, so that a process standing for a hundred roles holds one
/// connection, not a hundred.
///
/// Candidates on a shared connection stand in polling mode
/// ([`StandbyMode::Polling`](crate::election::StandbyMode::Polling)): a blocking wait
/// would occupy the session. The advisory locks of all roles live in the
/// one session, and the leaders on it renew their lease rows together:
/// one `UPDATE` per renewal period renews every role led on the
/// connection, whatever their number, and tells each role on its own
/// whether its row was still its own (a role whose row was taken is lost
/// alone). Each role keeps its own term and its own local deadline,
/// counted from the moment that statement was sent. The standbys on it are
/// batched too: one statement per polling interval tries all their locks
/// (in chunks of 10,000), one registers up to 200 new standbys, one
/// elects up to 200 granted roles, and one per poll looks for zombie
/// leaders of every vacant role; only one of these is in flight at a time,
/// so a leader's renewal or heartbeat waits behind one at most.
/// The roles share the connection's fate: when it dies, or
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
/// use pgelect::election::{SessionOptions, SharedConnection};
/// use pgelect::{conn::TcpTimeouts, ConnectOptions, Elector};
/// let options = ConnectOptions::from_url("postgres://app@db/app")?;
/// // The server may declare a silent client gone no sooner than the TTL.
/// let ttl = Duration::from_secs(15);
/// let connection = SharedConnection::new(&options, TcpTimeouts::for_ttl(ttl));
/// let mut shards = Vec::new();
/// for shard in 0..64 {
///     let elector = Elector::builder(options.clone(), &format!("shard-{shard}"))
///         .ttl(ttl)
///         .backend(SessionOptions::new().shared_connection(&connection))
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
    roles: Roles,
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
                roles: Roles::default(),
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
        self.inner.roles.claim(
            self.clone(),
            role,
            "already has a candidate on this shared connection; advisory locks are re-entrant within a session, so a second one would win too",
        )
    }

    /// The live connection, opened (and checked) if there is none.
    pub(crate) async fn get(&self) -> Result<Arc<SharedSession>> {
        let mut current = self.inner.current.lock().await;
        if let Some(c) = current.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let session = SharedSession::start(self.open().await?, self.inner.options.schema_name());
        *current = Some(session.clone());
        Ok(session)
    }

    async fn open(&self) -> Result<DedicatedConnection> {
        let options = &self.inner.options;
        let schema = options.schema_name();
        let s = schema.as_str();
        let conn = options
            .connect_for_shared_locks("shared", &self.inner.tcp, NOTICES)
            .await?;
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
            .field("roles", &self.inner.roles.len())
            .finish()
    }
}

/// A role's place on a shared connection, given back when dropped.
pub(crate) type RoleClaim = Claim<SharedConnection>;

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
    /// The leaders on this session, by role: every batched renewal renews
    /// them all.
    leaders: Mutex<HashMap<String, Leader>>,
    /// The earliest moment by which a leader wants its renewal sent.
    renew_wanted: watch::Sender<Option<Instant>>,
    /// The batched renewal statement.
    renew_sql: String,
    /// The polling standbys on this session, by role: every batched poll
    /// tries all their locks.
    standbys: Mutex<HashMap<String, Standby>>,
    /// The earliest moment by which a standby wants a poll sent.
    poll_wanted: watch::Sender<Option<Instant>>,
    /// Whether the next poll tries every standby's lock (asked for, or a
    /// release announced) rather than only the new standbys'.
    poll_all: AtomicBool,
    /// The batched poll statement.
    poll_sql: String,
    /// The polling standbys' registrations waiting for the batched
    /// registration statement, each with where its outcome goes.
    registrations: Queue<(Registration, oneshot::Sender<bool>)>,
    /// The batched registration statement.
    register_sql: String,
    /// The granted standbys' elections waiting for the batched election
    /// statement, each with where its role's row goes.
    elections: Queue<(Election, oneshot::Sender<Option<Elected>>)>,
    /// The batched election statement.
    elect_sql: String,
    /// The batched zombie preemption statement.
    preempt_sql: String,
    /// The campaign lane: the batched poll, registration, election and
    /// preemption statements hold it while in flight, so that at most one
    /// of them is ever queued ahead of a leader's renewal or heartbeat.
    campaign_lane: AsyncMutex<()>,
    /// Turns for the campaigns' own statements (a registration or an
    /// election run alone after its batch failed, a yield's unlock, a
    /// preemption the batch left to the role): few at a time, so that a
    /// heartbeat or a batch sent meanwhile waits behind a few statements,
    /// not behind every role's.
    campaign_turns: Semaphore,
    /// Resign hints for the leaders on this session, by payload: each
    /// leader hears its own role's, not every notification of the
    /// connection (with a thousand leaders, every election's notification
    /// would otherwise wake all of them).
    hints: Mutex<Hints>,
    /// The send time of the latest statement answered on this connection:
    /// proof that its server session (and every lock it holds) lived then.
    /// A leader whose own statement waits behind others' counts its answer
    /// limit from here (see `Keeper::alive_at`).
    answered: watch::Sender<Option<Instant>>,
}

/// How many campaign statements may be queued on a shared connection at
/// once.
const CAMPAIGN_TURNS: usize = 8;

/// The resign hint senders of a shared session's leaders, by payload.
#[derive(Default)]
struct Hints {
    by_payload: HashMap<String, broadcast::Sender<Notice>>,
    /// How many entries the last sweep left.
    swept: usize,
}

impl Hints {
    /// Drops the senders nobody listens to any more once the map has
    /// doubled since the last sweep: a sweep at every subscription made
    /// 10,000 elections cost 50 million visits (6 % of a candidate's CPU
    /// at a start).
    fn sweep(&mut self) {
        if self.by_payload.len() >= (2 * self.swept).max(64) {
            self.by_payload.retain(|_, tx| tx.receiver_count() > 0);
            self.swept = self.by_payload.len();
        }
    }
}

/// A polling standby's entry in its session's batched poll.
struct Standby {
    node: String,
    key: i64,
    /// The key as `pg_locks` shows it (classid, objid, objsubid).
    lock_ids: (u32, u32, i16),
    /// How often its registry row's `seen_at` is refreshed.
    refresh: Duration,
    /// When the row's `seen_at` was last set (its registration, then the
    /// polls that refreshed it): the poll refreshes it once `refresh` has
    /// passed, and names only those rows (a join of every standby with the
    /// whole registry at every poll cost more than the locks).
    refreshed: Instant,
    /// Not polled yet: a poll asked for by new standbys tries only theirs.
    fresh: bool,
    interval: Duration,
    /// How long a lock holder the row does not name must have been idle
    /// before it is preempted (the role's TTL).
    grace_ms: i64,
    /// The leader row's (term, holder) as last reported to the standby:
    /// a poll reports a role's row again only when it changed (or its
    /// lease expired).
    known: Option<(Option<i64>, Option<String>)>,
    outcome: watch::Sender<Option<(u64, Polled)>>,
}

/// What one batched poll found for one standby.
#[derive(Clone, Debug)]
pub(crate) enum Polled {
    /// The lock was granted: this standby holds it now.
    Granted,
    /// Not granted; the leader row as read now (it changed since the last
    /// report, or its lease expired). Where the row was vacant, the
    /// session's batched preemption ran first; `preempt_alone` asks the
    /// standby to run its own (the holder is another database user's, or
    /// the batch failed).
    Leader {
        info: Option<LeaderInfo>,
        preempt_alone: bool,
    },
    /// The statement failed; the standby polls alone to learn why.
    Failed,
}

/// A polling standby's place in its session's batched poll; leaves it
/// when dropped.
pub(crate) struct PollMember {
    session: Arc<SharedSession>,
    role: String,
    outcome: watch::Receiver<Option<(u64, Polled)>>,
    seen: u64,
}

/// A leader's entry in its session's batched renewal.
struct Leader {
    node: String,
    term: i64,
    ttl_ms: i64,
    priority: i32,
    /// The role's advisory key as `pg_locks` shows it (classid, objid).
    lock_ids: (i64, i64),
    /// The last batch that included this leader: when it was sent and
    /// what it found for this role.
    outcome: watch::Sender<Option<(Instant, Batched)>>,
}

/// What one batched renewal found for one role.
#[derive(Clone, Debug)]
pub(crate) enum Batched {
    /// The row still named this leader and term, and was renewed.
    Renewed {
        row: (SystemTime, SystemTime),
        resign_requested: bool,
        preferred: Preferred,
    },
    /// The row no longer names this leader and term.
    NotOurs,
    /// The row still names this leader and term but was locked (a fenced
    /// transaction's `FOR SHARE`): not renewed this time.
    Busy,
    /// The statement failed; the leader runs its own renewal to learn
    /// why (and is told by its own statement's error).
    Failed,
}

/// A leader's place in its session's batched renewal; leaves it when
/// dropped.
pub(crate) type BatchMember = Member<Arc<SharedSession>, Batched>;

impl Outcome for Batched {
    fn failed(&self) -> bool {
        matches!(self, Batched::Failed)
    }
}

impl Termed for Leader {
    fn term(&self) -> i64 {
        self.term
    }
}

impl Batch for Arc<SharedSession> {
    fn renewals_wanted(&self) -> &watch::Sender<Option<Instant>> {
        &self.renew_wanted
    }

    fn closed(&self) -> Option<&tokio_util::sync::CancellationToken> {
        Some(self.conn.closed())
    }

    fn leave(&self, role: &str, term: i64) {
        remove_if_term(&mut self.leaders(), role, term);
    }
}

impl std::ops::Deref for SharedSession {
    type Target = DedicatedConnection;

    fn deref(&self) -> &DedicatedConnection {
        &self.conn
    }
}

impl SharedSession {
    fn start(conn: DedicatedConnection, schema: &SchemaName) -> Arc<SharedSession> {
        let session = Arc::new(SharedSession {
            conn,
            wanted: watch::Sender::new(None),
            beats: watch::Sender::new(None),
            leaders: Mutex::new(HashMap::new()),
            renew_wanted: watch::Sender::new(None),
            renew_sql: batch_renew_sql(schema.as_str()),
            standbys: Mutex::new(HashMap::new()),
            poll_wanted: watch::Sender::new(None),
            poll_all: AtomicBool::new(false),
            poll_sql: batch_poll_sql(schema.as_str()),
            registrations: Queue::default(),
            register_sql: registry::batch_register_sql(schema.as_str()),
            elections: Queue::default(),
            elect_sql: batch_elect_sql(schema.as_str()),
            preempt_sql: batch_preempt_sql(schema.as_str()),
            campaign_lane: AsyncMutex::new(()),
            campaign_turns: Semaphore::new(CAMPAIGN_TURNS),
            hints: Mutex::new(Hints::default()),
            answered: watch::Sender::new(None),
        });
        tokio::spawn(register_batches(Arc::downgrade(&session)));
        tokio::spawn(elect_batches(Arc::downgrade(&session)));
        tokio::spawn(dispatch_hints(Arc::downgrade(&session)));
        tokio::spawn(heartbeat_task(Arc::downgrade(&session)));
        tokio::spawn(renew_batches(Arc::downgrade(&session)));
        tokio::spawn(poll_batches(
            Arc::downgrade(&session),
            schema.as_str().to_owned(),
        ));
        session
    }

    /// A statement sent at `sent` was answered.
    fn answered(&self, sent: Instant) {
        self.answered.send_if_modified(|a| match a {
            Some(t) if *t >= sent => false,
            _ => {
                *a = Some(sent);
                true
            }
        });
    }

    /// Completes with the send time of the next statement answered on this
    /// connection (sent later than any reported before this call).
    pub(crate) async fn next_answer(&self) -> Instant {
        let mut rx = self.answered.subscribe();
        loop {
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
            if let Some(t) = *rx.borrow_and_update() {
                return t;
            }
        }
    }

    /// Enters the polling standby of `role` into the batched poll, which
    /// tries its lock within [`NEW_STANDBY_WAIT`], then every `interval`
    /// (the shortest of all standbys' on the session), and soon after a
    /// release of the role is announced.
    pub(crate) fn join_poll(
        self: &Arc<Self>,
        role: &str,
        node: &str,
        key: crate::key::LockKey,
        refresh_ms: i64,
        interval: Duration,
        grace: Duration,
    ) -> PollMember {
        let lock_ids = key.pg_locks_ids();
        let crate::key::LockKey::Single(key) = key else {
            unreachable!("BUG: role keys are hashed names, which are single keys")
        };
        let (tx, rx) = watch::channel(None);
        self.standbys().insert(
            role.to_owned(),
            Standby {
                node: node.to_owned(),
                key,
                lock_ids,
                refresh: Duration::from_millis(refresh_ms.max(0) as u64),
                refreshed: Instant::now(),
                fresh: true,
                interval,
                grace_ms: grace.as_millis().min(i64::MAX as u128) as i64,
                known: None,
                outcome: tx,
            },
        );
        self.poll_wanted_by(Instant::now() + NEW_STANDBY_WAIT);
        PollMember {
            session: self.clone(),
            role: role.to_owned(),
            outcome: rx,
            seen: 0,
        }
    }

    /// Asks for a batched poll of every standby sent within `wait`.
    pub(crate) fn poll_soon(&self, wait: Duration) {
        self.poll_all.store(true, Ordering::Relaxed);
        self.poll_wanted_by(Instant::now() + wait);
    }

    /// Asks for a poll sent by `by`: of every standby if one was asked for
    /// ([`poll_soon`](Self::poll_soon)) or is due, else of the new ones.
    fn poll_wanted_by(&self, by: Instant) {
        self.poll_wanted
            .send_modify(|w| *w = Some(w.map_or(by, |x| x.min(by))));
    }

    /// A receiver of the resign hints (notifications on the resign channel)
    /// whose payload is `payload`, from now on.
    pub(crate) fn hints(&self, payload: &str) -> broadcast::Receiver<Notice> {
        let mut hints = self.hints.lock().unwrap_or_else(PoisonError::into_inner);
        hints.sweep();
        hints
            .by_payload
            .entry(payload.to_owned())
            .or_insert_with(|| broadcast::channel(4).0)
            .subscribe()
    }

    /// Waits for a turn to send a campaign statement (see
    /// [`CAMPAIGN_TURNS`]); the turn ends when the permit is dropped.
    pub(crate) async fn campaign_turn(&self) -> SemaphorePermit<'_> {
        self.campaign_turns
            .acquire()
            .await
            .expect("BUG: the semaphore is never closed")
    }

    /// Waits for the campaign lane (see `campaign_lane`); held until the
    /// guard is dropped.
    async fn lane(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.campaign_lane.lock().await
    }

    fn standbys(&self) -> std::sync::MutexGuard<'_, HashMap<String, Standby>> {
        // As for `leaders`: entries are inserted and removed whole.
        self.standbys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Enters the leader of `role` (with `term`) into the batched renewal.
    /// `share_wait` bounds how long its renewal requests wait for others.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn join_batch(
        self: &Arc<Self>,
        role: &str,
        node: &str,
        term: i64,
        ttl_ms: i64,
        priority: i32,
        key: crate::key::LockKey,
        share_wait: Duration,
    ) -> BatchMember {
        let (classid, objid, _) = key.pg_locks_ids();
        let (tx, rx) = watch::channel(None);
        self.leaders().insert(
            role.to_owned(),
            Leader {
                node: node.to_owned(),
                term,
                ttl_ms,
                priority,
                lock_ids: (i64::from(classid), i64::from(objid)),
                outcome: tx,
            },
        );
        Member::new(self.clone(), role, term, rx, share_wait)
    }

    fn leaders(&self) -> std::sync::MutexGuard<'_, HashMap<String, Leader>> {
        // Entries are only inserted and removed whole: a panic elsewhere
        // that poisoned the lock left the map consistent.
        self.leaders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// True when a heartbeat sent at or after `requested` was answered;
    /// false when it failed. The heartbeat is sent within `wait` of
    /// `requested`.
    pub(crate) async fn heartbeat_answered(&self, requested: Instant, wait: Duration) -> bool {
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
async fn heartbeat_task(session: std::sync::Weak<SharedSession>) {
    let (mut wanted, closed) = match session.upgrade() {
        Some(s) => (s.wanted.subscribe(), s.conn.closed().clone()),
        None => return,
    };
    loop {
        if !until_wanted(&mut wanted, &closed).await {
            return;
        }
        let Some(s) = session.upgrade() else {
            return;
        };
        s.wanted.send_replace(None);
        let sent = Instant::now();
        let ok = s.conn.client().simple_query("SELECT 1").await.is_ok();
        tracing::debug!(pid = s.conn.pid(), took = ?sent.elapsed(), "heartbeat");
        if ok {
            s.answered(sent);
        }
        s.beats.send_replace(Some((sent, ok)));
        if !ok {
            return;
        }
    }
}

/// The batched renewal: renews the rows of all the given roles that still
/// name their leader with its term and this backend, each for its own TTL,
/// and returns, per renewed role, what a single leader's renewal returns
/// (the row's times, the resign mark, preferred candidates). A row that
/// is still ours but locked (a fenced transaction holds it) is skipped,
/// not waited for, and returned with `renewed` false, as the single
/// renewal does (see `session::renew_sql`). Roles not returned are no
/// longer ours.
///
/// This backend's pid is a column of `m` (`me`), so that "held by this
/// backend" is a join condition, not a filter on `leaders` alone (a new
/// backend's pid is in no statistics, and as a filter the planner chose a
/// nested loop). The same holds for the poll's `w`. The rows skipped as
/// locked are found with `NOT IN` over `u`, which the planner runs as one
/// hashed sub-plan, not a nested anti-join. (The plans that were measured:
/// the book's design notes, "The planner and the batched statements".)
fn batch_renew_sql(s: &str) -> String {
    let ids = ("m.classid", "m.objid", "1");
    let ready = registry::preferred_session_sql_for(s, ids, "m.role", "m.node", "m.priority", true);
    let alive =
        registry::preferred_session_sql_for(s, ids, "m.role", "m.node", "m.priority", false);
    format!(
        "WITH m AS (
             SELECT *, pg_catalog.pg_backend_pid() AS me
               FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[],
                                             $5::int4[], $6::int8[], $7::int8[])
                        AS m(role, node, term, ttl_ms, priority, classid, objid)
         ), o AS (
             SELECT l.role
               FROM {s}.leaders l JOIN m
                 ON l.role = m.role AND l.holder = m.node AND l.term = m.term
                AND l.holder_pid = m.me
                FOR NO KEY UPDATE OF l SKIP LOCKED
         ), u AS (
             UPDATE {s}.leaders l
                SET renewed_at = now(), lease_until = now() + m.ttl_ms * interval '1 millisecond'
               FROM m, o
              WHERE l.role = m.role AND l.role = o.role
             RETURNING l.role, l.renewed_at, l.lease_until, l.resign_requested
         )
         SELECT u.role, u.renewed_at, u.lease_until, u.resign_requested, {ready}, {alive} IS NOT NULL,
                true AS renewed
           FROM u JOIN m ON m.role = u.role
         UNION ALL
         SELECT l.role, l.renewed_at, l.lease_until, l.resign_requested, NULL::text, false, false
           FROM {s}.leaders l JOIN m
             ON l.role = m.role AND l.holder = m.node AND l.term = m.term
            AND l.holder_pid = m.me
          WHERE l.role NOT IN (SELECT u.role FROM u)"
    )
}

/// The batched renewal's statement for `schema` (see `batch_renew_sql`),
/// exactly as a shared session sends it, so that a test can check its
/// plan.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub fn shared_renew_sql(schema: &SchemaName) -> String {
    batch_renew_sql(schema.as_str())
}

/// The renewal task of a shared session: when the earliest renewal
/// request wants it, sends one statement renewing every leader on the
/// session, and hands each its outcome; ends with the session or when its
/// connection fails.
async fn renew_batches(session: std::sync::Weak<SharedSession>) {
    let (mut wanted, closed) = match session.upgrade() {
        Some(s) => (s.renew_wanted.subscribe(), s.conn.closed().clone()),
        None => return,
    };
    loop {
        if !until_wanted(&mut wanted, &closed).await {
            return;
        }
        let Some(s) = session.upgrade() else {
            return;
        };
        s.renew_wanted.send_replace(None);
        let mut roles = Vec::new();
        let mut nodes = Vec::new();
        let mut terms = Vec::new();
        let mut ttls = Vec::new();
        let mut priorities = Vec::new();
        let mut classids = Vec::new();
        let mut objids = Vec::new();
        let mut outcomes = HashMap::new();
        for (role, l) in s.leaders().iter() {
            roles.push(role.clone());
            nodes.push(l.node.clone());
            terms.push(l.term);
            ttls.push(l.ttl_ms);
            priorities.push(l.priority);
            classids.push(l.lock_ids.0);
            objids.push(l.lock_ids.1);
            outcomes.insert(role.clone(), (l.term, l.outcome.clone()));
        }
        if roles.is_empty() {
            continue;
        }
        // In chunks, one in flight at a time, as the polls: a heartbeat
        // waits behind one chunk, and every chunk's answer shows the
        // session alive to the leaders still waiting for theirs.
        for chunk in chunks(roles.len(), RENEW_ROWS) {
            let sent = Instant::now();
            let rows = s
                .conn
                .client()
                .query_typed(
                    &s.renew_sql,
                    &[
                        (&&roles[chunk.clone()], Type::TEXT_ARRAY),
                        (&&nodes[chunk.clone()], Type::TEXT_ARRAY),
                        (&&terms[chunk.clone()], Type::INT8_ARRAY),
                        (&&ttls[chunk.clone()], Type::INT8_ARRAY),
                        (&&priorities[chunk.clone()], Type::INT4_ARRAY),
                        (&&classids[chunk.clone()], Type::INT8_ARRAY),
                        (&&objids[chunk.clone()], Type::INT8_ARRAY),
                    ],
                )
                .await;
            tracing::debug!(pid = s.conn.pid(), leaders = chunk.len(), took = ?sent.elapsed(), "batched renewal");
            if rows.is_ok() {
                s.answered(sent);
            }
            let mut found: HashMap<String, Batched> = HashMap::new();
            let failed = match rows {
                Ok(rows) => {
                    let decoded = rows.iter().try_for_each(|row| {
                        let role: String = row.try_get(0)?;
                        if !row.try_get::<_, bool>(6)? {
                            found.insert(role, Batched::Busy);
                            return Ok(());
                        }
                        let b = Batched::Renewed {
                            row: (row.try_get(1)?, row.try_get(2)?),
                            resign_requested: row.try_get(3)?,
                            preferred: Preferred {
                                ready: row.try_get(4)?,
                                pending: row.try_get(5)?,
                            },
                        };
                        found.insert(role, b);
                        Ok::<_, tokio_postgres::Error>(())
                    });
                    decoded.is_err()
                }
                Err(e) => {
                    tracing::warn!(error = %e, cause = ?e.as_db_error().map(|d| d.message()), leaders = chunk.len(), "the batched renewal failed; each leader renews alone");
                    true
                }
            };
            for role in &roles[chunk] {
                let Some((_, tx)) = outcomes.remove(role) else {
                    continue;
                };
                let b = if failed {
                    Batched::Failed
                } else {
                    found.remove(role).unwrap_or(Batched::NotOurs)
                };
                tx.send_replace(Some((sent, b)));
            }
            if failed && s.conn.is_closed() {
                return;
            }
        }
    }
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

/// The batched poll: refreshes the registry rows of the standbys whose
/// refresh is due (`$6`, `$7`: role, node; as a single standby's poll
/// does), tries every standby's lock, and returns the granted roles and,
/// for the others, the leader row where it changed since last reported or
/// its lease expired.
fn batch_poll_sql(s: &str) -> String {
    format!(
        "WITH w AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::text[])
                        AS w(role, node, key, known_term, known_holder)
         ), seen AS (
             UPDATE {s}.candidates c SET seen_at = now()
               FROM unnest($6::text[], $7::text[]) AS f(role, node)
              WHERE c.role = f.role AND c.node = f.node
                AND c.backend_pid = pg_catalog.pg_backend_pid()
             RETURNING 1
         ), t AS (
             -- Volatile: run once per standby, never inlined or repeated.
             SELECT w.*, pg_catalog.pg_try_advisory_lock(w.key) AS granted FROM w
         )
         SELECT t.role, t.granted, l.holder, l.holder_meta, l.term, l.backend, l.acquired_at,
                l.renewed_at, l.lease_until, coalesce(l.lease_until < now(), true), l.holder_pid,
                (SELECT count(*) FROM seen)
           FROM t LEFT JOIN {s}.leaders l ON l.role = t.role
          WHERE t.granted OR l.term IS DISTINCT FROM t.known_term
             OR l.holder IS DISTINCT FROM t.known_holder
             OR (l.holder IS NOT NULL AND l.lease_until < now())"
    )
}

/// The polling task of a shared session: when a poll is wanted (a new
/// standby, a standby's interval, an announced release of a waiting role),
/// sends one statement for every standby on the session and hands each its
/// outcome; ends with the session or when its connection fails.
async fn poll_batches(session: std::sync::Weak<SharedSession>, schema: String) {
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
            tracing::debug!(pid = s.conn.pid(), standbys = chunk.len(), took = ?sent.elapsed(), "batched poll");
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
        let mut standbys = s.standbys();
        for (role, refreshed) in roles.iter().zip(refreshed) {
            // A standby that left while the poll ran may have been granted
            // its lock: its campaign's clean-up unlocks it (it runs after
            // this statement on the same connection).
            let Some(w) = standbys.get_mut(role) else {
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
                        w.known = Some(known);
                        p
                    }
                    None => continue,
                }
            };
            w.outcome.send_replace(Some((round, polled)));
        }
        let failed = !failed.is_empty();
        drop(standbys);
        if failed && s.conn.is_closed() {
            return;
        }
    }
}

/// How many notifications a shared connection keeps for a task that has
/// not read them yet. Every election of every role is announced on it, up
/// to 200 in one commit of each candidate; a lag makes every leader check
/// its row, so the buffer must hold a start of thousands of roles (why 256
/// was too few: the book's design notes, "Scaling to 10,000 roles").
/// 16,384 slots cost about a megabyte, once per shared connection.
const NOTICES: usize = 16_384;

/// How often at most a shared session's leaders are all told to check
/// their rows because some notifications were missed.
const LAGGED_CHECK_GAP: Duration = Duration::from_secs(1);

/// Hands each resign hint heard on a shared session to the leader of its
/// role, if it has one there.
///
/// When notifications were missed (the connection's notice channel lagged,
/// as it does while thousands of roles are elected at once and every
/// election is announced), every leader checks its row, since a missed one
/// may have been its hint: at most once per [`LAGGED_CHECK_GAP`]. A check
/// is one batched renewal of every leader on the session; checking at each
/// lag made the leaders renew back to back during a start.
async fn dispatch_hints(session: std::sync::Weak<SharedSession>) {
    let mut notices = match session.upgrade() {
        Some(s) => s.conn.notices(),
        None => return,
    };
    let mut last_check: Option<Instant> = None;
    let mut owed = false;
    loop {
        let next_check = last_check.map_or_else(Instant::now, |l| l + LAGGED_CHECK_GAP);
        let received = tokio::select! {
            n = notices.recv() => Some(n),
            _ = tokio::time::sleep_until(next_check), if owed => None,
        };
        let lagged = match received {
            Some(Ok(n)) if n.channel == RESIGN_CHANNEL => {
                let Some(s) = session.upgrade() else {
                    return;
                };
                let hints = s.hints.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(tx) = hints.by_payload.get(&n.payload) {
                    let _ = tx.send(n);
                }
                false
            }
            Some(Ok(_)) => false,
            Some(Err(broadcast::error::RecvError::Lagged(missed))) => {
                tracing::debug!(missed, "notifications missed; every leader checks its row");
                true
            }
            Some(Err(broadcast::error::RecvError::Closed)) => return,
            None => true,
        };
        if !lagged {
            continue;
        }
        let now = Instant::now();
        if last_check.is_some_and(|l| now < l + LAGGED_CHECK_GAP) {
            owed = true;
            continue;
        }
        owed = false;
        last_check = Some(now);
        let Some(s) = session.upgrade() else {
            return;
        };
        let hints = s.hints.lock().unwrap_or_else(PoisonError::into_inner);
        for (payload, tx) in hints.by_payload.iter() {
            let _ = tx.send(Notice {
                channel: RESIGN_CHANNEL.to_owned(),
                payload: payload.clone(),
            });
        }
    }
}

/// How many roles one batched registration or election statement carries
/// at most: a heartbeat or renewal sent meanwhile waits behind one such
/// statement (some tens of milliseconds), never behind every role's, and
/// 200 keeps every statement well under a 1 s heartbeat timeout (the sizes
/// that were tried: the book's design notes, "The planner and the batched
/// statements").
const BATCH_ROWS: usize = 200;

/// How many leaders one chunk of the batched renewal renews at most, so
/// that no renewal statement outlasts a heartbeat timeout; each chunk's
/// answer shows the session alive to the leaders whose own chunk is still
/// to come (measured chunk sizes: the book's design notes, "The planner and
/// the batched statements").
const RENEW_ROWS: usize = 2000;

/// How many standbys one chunk of the batched poll tries at most, for the
/// same reason. A lock try costs much less than an election, and every
/// chunk is a statement each polling interval, so the chunk is large (the
/// sizes measured: the book's design notes, "The planner and the batched
/// statements").
const POLL_ROWS: usize = 10_000;

/// How long a registration or election waits for others to share its
/// statement.
const SHARE_WAIT: Duration = Duration::from_millis(10);

/// Requests waiting for one of a shared session's batched statements.
struct Queue<E> {
    pending: Mutex<Vec<E>>,
    /// The earliest moment by which a pending request wants its statement
    /// sent.
    wanted: watch::Sender<Option<Instant>>,
}

impl<E> Default for Queue<E> {
    fn default() -> Self {
        Queue {
            pending: Mutex::new(Vec::new()),
            wanted: watch::Sender::new(None),
        }
    }
}

impl<E> Queue<E> {
    /// Queues `entry` for a statement sent within [`SHARE_WAIT`].
    fn push(&self, entry: E) {
        // Entries are pushed and drained whole: a poisoned lock left the
        // list consistent.
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(entry);
        let by = Instant::now() + SHARE_WAIT;
        self.wanted
            .send_modify(|w| *w = Some(w.map_or(by, |x| x.min(by))));
    }

    /// Takes up to [`BATCH_ROWS`] entries, oldest first; asks at once for
    /// another statement when more wait.
    fn take(&self) -> Vec<E> {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let n = pending.len().min(BATCH_ROWS);
        let taken: Vec<E> = pending.drain(..n).collect();
        let more = !pending.is_empty();
        drop(pending);
        self.wanted.send_replace(more.then(Instant::now));
        taken
    }
}

/// A polling standby's registration, for the batched registration
/// statement ([`registry::batch_register_sql`]): the values a single
/// registration binds.
pub(crate) struct Registration {
    pub(crate) role: String,
    pub(crate) node: String,
    pub(crate) priority: i32,
    pub(crate) standby: Option<&'static str>,
    pub(crate) timing: Arc<serde_json::Value>,
    pub(crate) meta: Option<serde_json::Value>,
    pub(crate) payload: String,
}

/// A role's row of a batched election and the statement's send time.
pub(crate) type Elected = (Instant, tokio_postgres::Row);

/// What a batched poll found for each role it reports, and the leader row
/// (term, holder) it read.
type PollFound = HashMap<String, (Polled, (Option<i64>, Option<String>))>;

/// A granted standby's election, for the batched election statement
/// ([`batch_elect_sql`]): the values a single election binds.
pub(crate) struct Election {
    pub(crate) role: String,
    pub(crate) node: String,
    pub(crate) meta: Option<serde_json::Value>,
    pub(crate) ttl_ms: i64,
    pub(crate) payload: String,
    pub(crate) priority: i32,
    pub(crate) key: crate::key::LockKey,
}

impl SharedSession {
    /// Registers a polling standby in the session's next batched
    /// registration. True once registered; false when the statement failed
    /// or the connection ended (the caller registers alone to learn why).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the registration queued: it is sent
    /// all the same, and a registry row is harmless (readiness is read from
    /// the server, and the row is refreshed or replaced by the next
    /// registration).
    pub(crate) async fn register(&self, entry: Registration) -> bool {
        let (tx, rx) = oneshot::channel();
        self.registrations.push((entry, tx));
        tokio::select! {
            r = rx => r.unwrap_or(false),
            _ = self.conn.closed().cancelled() => false,
        }
    }

    /// Records a new term for a granted standby in the session's next
    /// batched election: the statement's send time and the role's row, or
    /// `None` when the statement failed or the connection ended (the
    /// caller elects alone to learn why).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not take the election back: the role may
    /// be elected all the same, as when a single statement in flight is
    /// dropped. The campaign's clean-up unlocks the role's lock after it
    /// (on the same connection), so the term is never led, and the next
    /// leader waits the handover delay.
    /// The role's row has the columns of a single election from index 1
    /// (index 0 is the role).
    pub(crate) async fn elect(&self, entry: Election) -> Option<Elected> {
        let (tx, rx) = oneshot::channel();
        self.elections.push((entry, tx));
        tokio::select! {
            r = rx => r.ok().flatten(),
            _ = self.conn.closed().cancelled() => None,
        }
    }
}

/// The registration task of a shared session: sends the queued
/// registrations, [`BATCH_ROWS`] at a time, and tells each whether it was
/// registered; ends with the session or its connection.
async fn register_batches(session: std::sync::Weak<SharedSession>) {
    let (mut wanted, closed) = match session.upgrade() {
        Some(s) => (s.registrations.wanted.subscribe(), s.conn.closed().clone()),
        None => return,
    };
    loop {
        if !until_wanted(&mut wanted, &closed).await {
            return;
        }
        let Some(s) = session.upgrade() else {
            return;
        };
        let mut batch = s.registrations.take();
        if batch.is_empty() {
            continue;
        }
        // In role order: two candidates registering the same roles lock
        // the registry's rows in the same order.
        batch.sort_by(|a, b| a.0.role.cmp(&b.0.role));
        let mut roles = Vec::with_capacity(batch.len());
        let mut nodes = Vec::with_capacity(batch.len());
        let mut priorities = Vec::with_capacity(batch.len());
        let mut standbys = Vec::with_capacity(batch.len());
        let mut timings = Vec::with_capacity(batch.len());
        let mut metas = Vec::with_capacity(batch.len());
        let mut payloads = Vec::with_capacity(batch.len());
        for (r, _) in &batch {
            roles.push(r.role.as_str());
            nodes.push(r.node.as_str());
            priorities.push(r.priority);
            standbys.push(r.standby);
            timings.push(&*r.timing);
            metas.push(r.meta.as_ref());
            payloads.push(r.payload.as_str());
        }
        // Elections first: a granted role waits for its term, while a
        // registration only announces a standby (at a start, thousands of
        // them queue for roles that others will lead).
        let mut elections = s.elections.wanted.subscribe();
        tokio::select! {
            _ = elections.wait_for(Option::is_none) => {}
            _ = s.conn.closed().cancelled() => return,
        }
        let lane = s.lane().await;
        let sent = Instant::now();
        let r = s
            .conn
            .client()
            .query_typed(
                &s.register_sql,
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
        drop(lane);
        tracing::debug!(pid = s.conn.pid(), candidates = batch.len(), took = ?sent.elapsed(), "batched registration");
        if r.is_ok() {
            s.answered(sent);
        }
        let ok = match r {
            Ok(rows) => {
                let stale: i64 = rows.first().and_then(|r| r.try_get(0).ok()).unwrap_or(0);
                if stale > 0 {
                    tracing::debug!(stale, "deleted registry rows of candidates that died");
                }
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, cause = ?e.as_db_error().map(|d| d.message()), candidates = batch.len(), "the batched registration failed; each candidate registers alone");
                false
            }
        };
        for (_, done) in batch {
            let _ = done.send(ok);
        }
        if !ok && s.conn.is_closed() {
            return;
        }
    }
}

/// The election task of a shared session: sends the queued elections,
/// [`BATCH_ROWS`] at a time, and hands each its role's row and the
/// statement's send time; ends with the session or its connection.
async fn elect_batches(session: std::sync::Weak<SharedSession>) {
    let (mut wanted, closed) = match session.upgrade() {
        Some(s) => (s.elections.wanted.subscribe(), s.conn.closed().clone()),
        None => return,
    };
    loop {
        if !until_wanted(&mut wanted, &closed).await {
            return;
        }
        let Some(s) = session.upgrade() else {
            return;
        };
        let mut batch = s.elections.take();
        // A campaign dropped while queued (its role's lock is being let go
        // of) must not be elected after the unlock: its row would name a
        // leader that holds nothing.
        batch.retain(|(_, done)| !done.is_closed());
        if batch.is_empty() {
            continue;
        }
        // In role order, for the reason the registrations are.
        batch.sort_by(|a, b| a.0.role.cmp(&b.0.role));
        let mut roles = Vec::with_capacity(batch.len());
        let mut nodes = Vec::with_capacity(batch.len());
        let mut metas = Vec::with_capacity(batch.len());
        let mut ttls = Vec::with_capacity(batch.len());
        let mut payloads = Vec::with_capacity(batch.len());
        let mut priorities = Vec::with_capacity(batch.len());
        let mut classids = Vec::with_capacity(batch.len());
        let mut objids = Vec::with_capacity(batch.len());
        let mut objsubids = Vec::with_capacity(batch.len());
        for (e, _) in &batch {
            let (classid, objid, objsubid) = e.key.pg_locks_ids();
            roles.push(e.role.as_str());
            nodes.push(e.node.as_str());
            metas.push(e.meta.as_ref());
            ttls.push(e.ttl_ms);
            payloads.push(e.payload.as_str());
            priorities.push(e.priority);
            classids.push(i64::from(classid));
            objids.push(i64::from(objid));
            objsubids.push(objsubid);
        }
        let lane = s.lane().await;
        let sent = Instant::now();
        let r = s
            .conn
            .client()
            .query_typed(
                &s.elect_sql,
                &[
                    (&roles, Type::TEXT_ARRAY),
                    (&nodes, Type::TEXT_ARRAY),
                    (&metas, Type::JSONB_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&payloads, Type::TEXT_ARRAY),
                    (&priorities, Type::INT4_ARRAY),
                    (&classids, Type::INT8_ARRAY),
                    (&objids, Type::INT8_ARRAY),
                    (&objsubids, Type::INT2_ARRAY),
                ],
            )
            .await;
        drop(lane);
        tracing::debug!(pid = s.conn.pid(), candidates = batch.len(), took = ?sent.elapsed(), "batched election");
        if r.is_ok() {
            s.answered(sent);
        }
        let mut rows: HashMap<String, tokio_postgres::Row> = HashMap::new();
        let failed = match r {
            Ok(found) => found
                .into_iter()
                .try_for_each(|row| {
                    rows.insert(row.try_get::<_, String>(0)?, row);
                    Ok::<_, tokio_postgres::Error>(())
                })
                .is_err(),
            Err(e) => {
                tracing::warn!(error = %e, cause = ?e.as_db_error().map(|d| d.message()), candidates = batch.len(), "the batched election failed; each candidate elects alone");
                true
            }
        };
        for (e, done) in batch {
            let row = match failed {
                true => None,
                false => rows.remove(&e.role).map(|row| (sent, row)),
            };
            let _ = done.send(row);
        }
        if failed && s.conn.is_closed() {
            return;
        }
    }
}

/// The batched election: for each given role, what a single election
/// statement (`ElectStatement` of the session backend) does, in one
/// statement: unless a ready candidate of strictly higher priority waits,
/// bumps the term and writes the lease row naming the candidate (never
/// over a live lease-backend leader), notifies watchers. One row per role:
/// the role, then a single election's columns (term, previous holder,
/// acquired at, lease until, notification, preferred node).
///
/// `old` reads the rows as the statement found them, without `FOR UPDATE`,
/// for the reason the single statement gives; the advisory locks held by
/// this session serialise the electors of every role here.
fn batch_elect_sql(s: &str) -> String {
    let (first, next) = (next_term_sql("0"), next_term_sql("l.term"));
    let ids = ("e.classid", "e.objid", "e.objsubid");
    let pref = registry::preferred_session_sql_for(s, ids, "e.role", "e.node", "e.priority", true);
    let previous = previous_holder_sql("l");
    format!(
        "WITH e AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::jsonb[], $4::int8[], $5::text[],
                                  $6::int4[], $7::int8[], $8::int8[], $9::int2[])
                        AS e(role, node, meta, ttl_ms, payload, priority, classid, objid, objsubid)
         ), pe AS (
             SELECT e.*, {pref} AS pref FROM e
         ), old AS (
             SELECT l.role, {previous} AS holder FROM {s}.leaders l JOIN e ON e.role = l.role
         ), up AS (
             INSERT INTO {s}.leaders AS l
                    (role, holder, holder_meta, term, backend, holder_pid, acquired_at, renewed_at, lease_until)
             SELECT pe.role, pe.node, pe.meta, {first}, 'session', pg_catalog.pg_backend_pid(), now(), now(),
                    now() + pe.ttl_ms * interval '1 millisecond'
               FROM pe
              WHERE pe.pref IS NULL
             ON CONFLICT (role) DO UPDATE
                SET holder = EXCLUDED.holder, holder_meta = EXCLUDED.holder_meta,
                    term = {next}, backend = EXCLUDED.backend,
                    holder_pid = EXCLUDED.holder_pid, acquired_at = EXCLUDED.acquired_at,
                    renewed_at = EXCLUDED.renewed_at, lease_until = EXCLUDED.lease_until,
                    resign_requested = false, lease_token = NULL
              WHERE NOT (l.backend = 'lease' AND l.holder IS NOT NULL AND l.lease_until >= now())
             RETURNING l.role, l.term, l.acquired_at, l.lease_until
         )
         SELECT pe.role, up.term, old.holder, up.acquired_at, up.lease_until,
                CASE WHEN up.term IS NOT NULL
                     THEN pg_catalog.pg_notify('{LEADER_CHANNEL}', pe.payload)::text END,
                pe.pref
           FROM pe LEFT JOIN up ON up.role = pe.role LEFT JOIN old ON old.role = pe.role"
    )
}

/// The batched zombie preemption, for the roles whose row a poll found
/// vacant (no row, no holder, or an expired lease): for each, what
/// [`preempt_zombie`](crate::election::watch::preempt_zombie) looks for, a
/// backend other than this one holding the role's lock that is either the
/// holder the expired row names, or, while the row is vacant, a session of
/// this database user the row does not name, idle for at least the role's
/// TTL. Terminates those of this database user (each pid once); those of
/// another user are returned, not terminated (the standby's own
/// preemption learns whether it may). One row per role found: role, pid,
/// term, holder, whether the row names the pid, whether it was
/// terminated, whether it is this user's.
fn batch_preempt_sql(s: &str) -> String {
    format!(
        "WITH v AS (
             SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int2[], $5::int8[])
                        AS v(role, classid, objid, objsubid, grace_ms)
         ), z AS (
             SELECT DISTINCT ON (v.role) v.role, k.pid, coalesce(l.term, 0) AS term,
                    coalesce(l.holder, '') AS holder, k.pid IS NOT DISTINCT FROM l.holder_pid AS named,
                    coalesce(a.usename = session_user, false) AS own
               FROM v
               JOIN pg_catalog.pg_locks k
                 ON k.classid = v.classid::oid AND k.objid = v.objid::oid AND k.objsubid = v.objsubid
               LEFT JOIN {s}.leaders l ON l.role = v.role
               LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = k.pid
              WHERE k.locktype = 'advisory' AND k.granted AND k.mode = 'ExclusiveLock'
                AND k.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                   WHERE d.datname = pg_catalog.current_database())
                AND k.pid <> pg_catalog.pg_backend_pid()
                AND ((l.holder IS NOT NULL AND l.lease_until < now() AND k.pid = l.holder_pid)
                     OR ((l.holder IS NULL OR l.lease_until IS NULL OR l.lease_until < now())
                         AND k.pid IS DISTINCT FROM l.holder_pid
                         AND a.usename = session_user
                         AND a.state IN ('idle', 'idle in transaction', 'idle in transaction (aborted)')
                         AND a.state_change < now() - v.grace_ms * interval '1 millisecond'))
              ORDER BY v.role, k.pid
         ), t AS (
             -- Volatile: run once per pid, never inlined or repeated.
             SELECT p.pid, pg_catalog.pg_terminate_backend(p.pid) AS done
               FROM (SELECT DISTINCT z.pid FROM z WHERE z.own) p
         )
         SELECT z.role, z.pid, z.term, z.holder, z.named, coalesce(t.done, false), z.own
           FROM z LEFT JOIN t ON t.pid = z.pid"
    )
}

/// Runs the batched preemption for the roles a poll found vacant (`found`,
/// not granted, no live lease): logs and counts what it terminated, asks
/// for a poll at once if it did, and marks the roles whose standby must
/// try alone. A session needs at most one such statement per poll; while
/// every role is led, none.
async fn preempt_vacant(s: &SharedSession, found: &mut PollFound) {
    let vacant: Vec<&String> = found
        .iter()
        .filter(|(_, (p, _))| match p {
            Polled::Leader { info, .. } => info.as_ref().is_none_or(|i| i.lease_expired),
            _ => false,
        })
        .map(|(role, _)| role)
        .collect();
    if vacant.is_empty() {
        return;
    }
    let mut roles = Vec::with_capacity(vacant.len());
    let mut classids = Vec::with_capacity(vacant.len());
    let mut objids = Vec::with_capacity(vacant.len());
    let mut objsubids = Vec::with_capacity(vacant.len());
    let mut graces = Vec::with_capacity(vacant.len());
    {
        let standbys = s.standbys();
        for role in vacant {
            let Some(w) = standbys.get(role) else {
                continue;
            };
            roles.push(role.clone());
            classids.push(i64::from(w.lock_ids.0));
            objids.push(i64::from(w.lock_ids.1));
            objsubids.push(w.lock_ids.2);
            graces.push(w.grace_ms);
        }
    }
    if roles.is_empty() {
        return;
    }
    let lane = s.lane().await;
    let sent = Instant::now();
    let r = s
        .conn
        .client()
        .query_typed(
            &s.preempt_sql,
            &[
                (&roles, Type::TEXT_ARRAY),
                (&classids, Type::INT8_ARRAY),
                (&objids, Type::INT8_ARRAY),
                (&objsubids, Type::INT2_ARRAY),
                (&graces, Type::INT8_ARRAY),
            ],
        )
        .await;
    drop(lane);
    tracing::debug!(pid = s.conn.pid(), roles = roles.len(), took = ?sent.elapsed(), "batched zombie preemption");
    type Found = (String, i32, i64, String, bool, bool, bool);
    let decoded = r.and_then(|rows| {
        rows.iter()
            .map(|row| {
                Ok::<Found, tokio_postgres::Error>((
                    row.try_get(0)?,
                    row.try_get(1)?,
                    row.try_get(2)?,
                    row.try_get(3)?,
                    row.try_get(4)?,
                    row.try_get(5)?,
                    row.try_get(6)?,
                ))
            })
            .collect::<std::result::Result<Vec<Found>, _>>()
    });
    let alone = |found: &mut HashMap<String, (Polled, _)>, role: &str| {
        if let Some((Polled::Leader { preempt_alone, .. }, _)) = found.get_mut(role) {
            *preempt_alone = true;
        }
    };
    match decoded {
        Ok(rows) => {
            let mut preempted = false;
            for (role, pid, term, holder, named, done, own) in rows {
                if !own {
                    alone(found, &role);
                } else if done && !named {
                    tracing::warn!(role, pid, "terminated a backend that held the role's lock for a TTL without taking the lease (a candidate frozen before its term, or a squatter)");
                    crate::metrics::preempted_zombie(&role);
                    preempted = true;
                } else if done {
                    tracing::warn!(role, pid, term, holder = %holder, "terminated the backend of a leader whose lease expired on the server");
                    crate::metrics::preempted_zombie(&role);
                    preempted = true;
                } else {
                    tracing::warn!(role, pid, term, holder = %holder, "could not terminate the backend of a leader whose lease expired; waiting");
                }
            }
            if preempted {
                s.poll_soon(Duration::ZERO);
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, cause = ?e.as_db_error().map(|d| d.message()), roles = roles.len(), "the batched zombie preemption failed; each vacant role's standby preempts alone");
            for role in &roles {
                alone(found, role);
            }
        }
    }
}
