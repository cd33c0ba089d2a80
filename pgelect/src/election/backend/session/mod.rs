//! The session backend: a session advisory lock per role plus the lease
//! row, on a connection that carries roles — one candidate's own
//! connection, or a [`SharedConnection`](crate::election::SharedConnection)
//! carrying the candidates of many roles. Split by what it does:
//!
//! * this file: the shared connections that carry many roles
//!   ([`SharedConnection`], [`SharedSession`]) and their queues;
//! * [`lock_conn`]: the connection one candidate stands on ([`LockConn`]:
//!   a session of its own or a shared one, run the same way);
//! * [`sql`]: the backend's statements, one text per operation;
//! * [`campaign`]: gaining leadership (a blocking wait on a connection of
//!   one candidate, polling or batched otherwise);
//! * [`keep`]: keeping it ([`KeepBackend`](crate::election::driver::KeepBackend)):
//!   renewal, heartbeat, release.

mod campaign;
mod keep;
mod lock_conn;
mod sql;

pub(crate) use campaign::{campaign, preempt};
pub(crate) use sql::Zombies;
#[cfg(feature = "test-hooks")]
pub use sql::{shared_elect_sql, shared_poll_sql, shared_preempt_sql, shared_renew_sql};

use campaign::{elect_batches, poll_batches, register_batches, NEW_STANDBY_WAIT};
use keep::renew_batches;
pub(crate) use lock_conn::LockConn;
use lock_conn::{unlock_if_held_sql, KillOnDrop};
use sql::{batch_elect_sql, batch_poll_sql, batch_renew_sql};

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, oneshot, watch, Mutex as AsyncMutex, Semaphore, SemaphorePermit};
use tokio::time::Instant;

use crate::conn::probe::Probe;
use crate::conn::{ConnectOptions, DedicatedConnection, Notice, TcpTimeouts};
use crate::election::driver::Preferred;
use crate::election::registry::{self, Registration};
use crate::error::{Error, Result};
use crate::schema::{check_schema, SchemaName};

use crate::election::backend::batch::{chunks, remove_if_term, Batch, Member, Outcome, Termed};
use crate::election::backend::claim::{Claim, Roles};
use crate::election::watch::{parse_leader_event, LeaderInfo, LEADER_CHANNEL, RESIGN_CHANNEL};

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

    /// Test hook, not API (feature `test-hooks`): holds the session's
    /// campaign lane (the batched polls, registrations and elections wait
    /// for it) until the returned sender is dropped, so that a test can
    /// stop a batched poll between its reading of the standbys and its
    /// statement.
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub async fn hold_campaign_lane(&self) -> Result<tokio::sync::oneshot::Sender<()>> {
        let session = self.get().await?;
        let (held, is_held) = tokio::sync::oneshot::channel();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _lane = session.lane().await;
            let _ = held.send(());
            let _ = released.await;
        });
        let _ = is_held.await;
        Ok(release)
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
        let session =
            SharedSession::start(self.open().await?, self.inner.options.schema_name(), false);
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

/// A live session that carries roles: of one candidate (its own
/// connection), or of a shared connection; its batches and its one
/// heartbeat.
///
/// Each leader on the session asks for a heartbeat at its own pace; the
/// session's [`Probe`] sends one for all the requests pending (on a shared
/// session waiting a quarter of the asking leader's heartbeat timeout, at
/// most 100 ms, for others to share it; on a session of one at once).
pub(crate) struct SharedSession {
    conn: DedicatedConnection,
    /// A session of one candidate (its own connection), not shared: it may
    /// wait in the server (a blocking standby), it listens while its
    /// candidate leads only, it sends each batch of one at once (nobody
    /// shares it) and it is dropped whole when its candidate lets the role
    /// go (see [`LockConn`]).
    alone: bool,
    /// The connection's probe, and the record of every statement answered
    /// on it: proof that its server session (and every lock it holds)
    /// lived then. A leader whose own statement waits behind others'
    /// counts its answer limit from there (see `Keeper::alive_at`).
    probe: Probe,
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
    /// The schema of the session's statements (the zombie preemption's).
    schema: SchemaName,
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
    grace: Duration,
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
    fn start(conn: DedicatedConnection, schema: &SchemaName, alone: bool) -> Arc<SharedSession> {
        let session = Arc::new(SharedSession {
            conn,
            alone,
            probe: Probe::default(),
            leaders: Mutex::new(HashMap::new()),
            renew_wanted: watch::Sender::new(None),
            renew_sql: batch_renew_sql(schema.as_str()),
            standbys: Mutex::new(HashMap::new()),
            poll_wanted: watch::Sender::new(None),
            poll_all: AtomicBool::new(false),
            poll_sql: batch_poll_sql(schema.as_str()),
            registrations: Queue::default(),
            register_sql: registry::register_sql(schema.as_str(), registry::Waits::Polling),
            elections: Queue::default(),
            elect_sql: batch_elect_sql(schema.as_str()),
            schema: schema.clone(),
            campaign_lane: AsyncMutex::new(()),
            campaign_turns: Semaphore::new(CAMPAIGN_TURNS),
            hints: Mutex::new(Hints::default()),
        });
        tokio::spawn(register_batches(Arc::downgrade(&session)));
        tokio::spawn(elect_batches(Arc::downgrade(&session)));
        tokio::spawn(dispatch_hints(Arc::downgrade(&session)));
        tokio::spawn(Probe::serve(Arc::downgrade(&session), |s| {
            (&s.probe, &s.conn)
        }));
        tokio::spawn(renew_batches(Arc::downgrade(&session)));
        tokio::spawn(poll_batches(
            Arc::downgrade(&session),
            schema.as_str().to_owned(),
        ));
        session
    }

    /// Whether this is a session of one candidate (see `alone`).
    pub(crate) fn alone(&self) -> bool {
        self.alone
    }

    /// How long a request waits for others to share its statement: `wait`
    /// on a shared session, none on a session of one.
    pub(super) fn share_wait(&self, wait: Duration) -> Duration {
        match self.alone {
            true => Duration::ZERO,
            false => wait,
        }
    }

    /// A statement sent at `sent` was answered.
    fn answered(&self, sent: Instant) {
        self.probe.credit(sent);
    }

    /// The connection's probe (heartbeats, and the answers of its other
    /// statements).
    pub(crate) fn probe(&self) -> &Probe {
        &self.probe
    }

    /// Enters the polling standby of `role` into the batched poll, which
    /// tries its lock within [`NEW_STANDBY_WAIT`] (a session of one at
    /// once), then every `interval`
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
                grace,
                known: None,
                outcome: tx,
            },
        );
        self.poll_wanted_by(Instant::now() + self.share_wait(NEW_STANDBY_WAIT));
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

    /// The lane for a batched registration or election: none on a session
    /// of one, which nobody shares (the request then goes out at once).
    async fn campaign_lane(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        match self.alone {
            true => None,
            false => Some(self.lane().await),
        }
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
        Member::new(self.clone(), role, term, rx, self.share_wait(share_wait))
    }

    fn leaders(&self) -> std::sync::MutexGuard<'_, HashMap<String, Leader>> {
        // Entries are only inserted and removed whole: a panic elsewhere
        // that poisoned the lock left the map consistent.
        self.leaders.lock().unwrap_or_else(PoisonError::into_inner)
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
    /// Queues `entry` for a statement sent within `wait`.
    fn push(&self, entry: E, wait: Duration) {
        // Entries are pushed and drained whole: a poisoned lock left the
        // list consistent.
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(entry);
        let by = Instant::now() + wait;
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
        if self.alone {
            // A batch of one, sent at once: nobody shares the session.
            // (Boxed: thousands of standbys of a shared session each hold
            // this future, whose size is that of its largest branch.)
            return Box::pin(self.send_registrations(std::iter::once(&entry))).await;
        }
        let (tx, rx) = oneshot::channel();
        self.registrations.push((entry, tx), SHARE_WAIT);
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
        if self.alone {
            // A batch of one, sent at once (the request goes out when the
            // future is first polled, so it can be pipelined with others).
            // (Boxed, as the registration's.)
            let (sent, mut rows) = Box::pin(self.send_elections(std::iter::once(&entry))).await?;
            return rows.remove(&entry.role).map(|row| (sent, row));
        }
        let (tx, rx) = oneshot::channel();
        self.elections.push((entry, tx), SHARE_WAIT);
        tokio::select! {
            r = rx => r.ok().flatten(),
            _ = self.conn.closed().cancelled() => None,
        }
    }
}
