//! The [`Elector`] of one role and its internal state: the options it was
//! built with, the connection kept between campaigns, the last contact with
//! the server, and the [`TimingReport`] it derives from its timing.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::conn::{ConnectOptions, DedicatedConnection, Notice};
use crate::error::Result;
use crate::key::LockKey;

use super::backend::lease::LeaseClaim;
use super::backend::session::{LockConn, RoleClaim};
use super::timing::Timing;
use super::{
    backend, registry, watch, Backend, ElectorBuilder, LeaderContext, LeaderInfo, Leadership,
    Profile, SharedLease, StandbyMode,
};
use crate::loss::LossReason;
/// Stands for election of one role.
///
/// Built with [`Elector::builder`]; see [`ElectorBuilder`] for the timing,
/// its defaults and the safety inequalities it enforces. One `Elector` may
/// campaign again after losing; dropping it stops its observer connection
/// and closes the lock connection kept from its last clean release (a
/// [`Leadership`] it handed out lives on).
pub struct Elector {
    pub(super) shared: Arc<ElectorState>,
}

pub(crate) struct ElectorState {
    pub(crate) options: ConnectOptions,
    pub(crate) role: String,
    pub(crate) node: String,
    pub(crate) key: LockKey,
    pub(crate) timing: Timing,
    pub(crate) meta: Option<serde_json::Value>,
    /// A leader hands over to a ready candidate of strictly higher priority.
    pub(crate) priority: i32,
    pub(crate) leader: tokio::sync::watch::Sender<Option<LeaderInfo>>,
    /// What this elector is doing, which decides whether its observer
    /// connection is needed.
    pub(crate) activity: tokio::sync::watch::Sender<Activity>,
    observer: Mutex<Option<CancellationToken>>,
    /// What only this elector's backend keeps.
    pub(crate) per_backend: PerBackend,
    /// When one of this elector's connections last got an answer from the
    /// server, for health checks that must not open connections of their own.
    pub(crate) contact: Contact,
    /// Set once zombie preemption was refused for want of
    /// `pg_signal_backend`: the warning is written once per elector.
    pub(crate) preemption_refused: Arc<std::sync::atomic::AtomicBool>,
    /// Woken by the observer when it finds the server read-only (a demoted
    /// or fenced primary) while a blocking standby waits there: the wait
    /// is abandoned and the campaign reconnects (to the new primary, with
    /// several hosts and `target_session_attrs`).
    pub(crate) server_read_only: tokio::sync::Notify,
    /// The server (address, port) a blocking standby's lock connection
    /// reached. The observer compares its own: with several hosts it may
    /// have reached another one (the standby's server turned read-only
    /// before the observer connected, so `target_session_attrs` sent it
    /// on), and then the standby waits where nobody can be elected.
    pub(crate) lock_server: std::sync::Mutex<Option<(String, i32)>>,
}

/// The state only one backend keeps. (Unboxed: it is built once per
/// elector, inside the elector's one `Arc`.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum PerBackend {
    Session(SessionState),
    Lease(LeaseState),
}

/// The session backend's state of an elector.
pub(crate) struct SessionState {
    /// How a standby waits for the lock.
    pub(crate) standby: StandbyMode,
    /// The lock connection of the last clean release, for the next campaign.
    spare: Mutex<Option<LockConn>>,
    /// The shared connection this candidate stands on.
    pub(crate) host: Option<RoleClaim>,
    /// When this candidate last gave the role up of its own accord, and
    /// the term it gave up: its next polling campaign stands aside first
    /// (see `support::step_aside`).
    pub(crate) stepped_aside: Mutex<Option<(Instant, i64)>>,
}

impl SessionState {
    /// Takes the spare lock connection, if it is still open.
    pub(crate) fn take_spare(&self) -> Option<LockConn> {
        let conn = self
            .spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        conn.is_open().then_some(conn)
    }

    /// Keeps a released lock connection for the next campaign.
    pub(crate) fn put_spare(&self, conn: LockConn) {
        *self.spare.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn);
    }
}

/// The lease backend's state of an elector.
pub(crate) struct LeaseState {
    /// The direct connection for `LISTEN`, if any.
    pub(crate) listen_via: Option<ConnectOptions>,
    /// Notifications received on the `LISTEN` connection.
    pub(crate) notices: tokio::sync::broadcast::Sender<Notice>,
    listener: Mutex<Option<CancellationToken>>,
    /// The client that carries this candidate's statements: the
    /// [`SharedLease`] it was built on, or one of its own.
    pub(crate) client: LeaseClaim,
    /// Whether `client` is this candidate's own (built for it alone).
    own_client: bool,
    /// When this candidate last gave the role up of its own accord (a
    /// resignation, or a release while leading): its next campaign stands
    /// aside first (see `support::step_aside`); and the term it
    /// gave up.
    pub(crate) stepped_aside: Mutex<Option<(Instant, i64)>>,
}

/// The moment a connection of an elector last got an answer from the
/// server, kept as milliseconds since the elector was built (0: never).
pub(crate) struct Contact {
    origin: Instant,
    last_ms: std::sync::atomic::AtomicU64,
}

impl Contact {
    fn new() -> Contact {
        Contact {
            origin: Instant::now(),
            last_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Records that the server answered just now.
    pub(crate) fn touch(&self) {
        let ms = self.origin.elapsed().as_millis() as u64 + 1;
        self.last_ms
            .fetch_max(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// How long ago the server last answered, if it ever did.
    fn since(&self) -> Option<Duration> {
        match self.last_ms.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            ms => Some(
                self.origin
                    .elapsed()
                    .saturating_sub(Duration::from_millis(ms - 1)),
            ),
        }
    }
}

/// What an elector is doing, for its observer task.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Activity {
    /// Blocking standbys of this elector waiting in the role's lock queue
    /// directly (a candidate with a priority, or one whose role's watch
    /// key another database user holds): they need the observer. Standbys
    /// that queue for the watch key do not (the watch observes for them).
    pub(crate) standing: usize,
    /// Live session-backend leaderships of this elector.
    pub(crate) leading: usize,
    /// [`Elector::watch`] was called.
    pub(crate) watched: bool,
}

impl Activity {
    /// The observer connection is open while someone watches or a blocking
    /// standby waits in the role's lock queue directly (it preempts zombie
    /// leaders), and never while this
    /// elector leads with the session backend: the leader publishes its own
    /// state, and a leader process then holds one server backend, not two
    /// (a dead leader's lock is granted later when its process held more;
    /// see the book's design notes, "Session failover").
    pub(crate) fn wants_observer(&self) -> bool {
        self.leading == 0 && (self.watched || self.standing > 0)
    }
}

impl ElectorState {
    /// Starts the observer task if it is not running.
    pub(crate) fn ensure_observer(self: &Arc<Self>) {
        let mut slot = self.observer.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|t| !t.is_cancelled()) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                role = %self.role,
                "Elector::watch was called outside a Tokio runtime: no observer runs, so the receiver sees only this elector's own elections"
            );
            return;
        };
        let stop = CancellationToken::new();
        *slot = Some(stop.clone());
        let observer = watch::Observer {
            shared: Arc::downgrade(self),
            stop,
        };
        runtime.spawn(observer.run());
    }

    /// The backend.
    pub(crate) fn backend(&self) -> Backend {
        match self.per_backend {
            PerBackend::Session(_) => Backend::Session,
            PerBackend::Lease(_) => Backend::Lease,
        }
    }

    /// The session backend's state, if this elector uses it.
    pub(crate) fn session(&self) -> Option<&SessionState> {
        match &self.per_backend {
            PerBackend::Session(s) => Some(s),
            PerBackend::Lease(_) => None,
        }
    }

    /// The lease backend's state, if this elector uses it.
    pub(crate) fn lease(&self) -> Option<&LeaseState> {
        match &self.per_backend {
            PerBackend::Lease(l) => Some(l),
            PerBackend::Session(_) => None,
        }
    }

    /// Lease backend: starts the `LISTEN` task if a `listen_via` connection
    /// is configured and the task is not running.
    pub(crate) fn ensure_lease_listener(self: &Arc<Self>) {
        let Some(lease) = self.lease() else {
            return;
        };
        let Some(options) = lease.listen_via.clone() else {
            return;
        };
        let mut slot = lease
            .listener
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|t| !t.is_cancelled()) {
            return;
        }
        let stop = CancellationToken::new();
        *slot = Some(stop.clone());
        tokio::spawn(backend::lease::listen(Arc::downgrade(self), options, stop));
    }

    /// Publishes the current leader to watchers, if it changed.
    pub(crate) fn publish(&self, info: Option<LeaderInfo>) {
        self.leader.send_if_modified(|cur| {
            if *cur != info {
                *cur = info;
                true
            } else {
                false
            }
        });
    }

    /// Publishes `info` (an observation) only if watchers still see `seen`,
    /// what they saw when the observation began: a value published in the
    /// meantime (by this elector's own election) is newer and is kept.
    pub(crate) fn publish_if_unchanged(&self, seen: &Option<LeaderInfo>, info: Option<LeaderInfo>) {
        self.leader.send_if_modified(|cur| {
            if cur == seen && *cur != info {
                *cur = info;
                true
            } else {
                false
            }
        });
    }

    /// Publishes `info` only if watchers currently see `node` with `term`.
    pub(crate) fn publish_if_holder(&self, node: &str, term: i64, info: Option<LeaderInfo>) {
        self.leader.send_if_modified(|cur| {
            if cur
                .as_ref()
                .is_some_and(|c| c.holder == node && c.term.get() == term)
            {
                *cur = info;
                true
            } else {
                false
            }
        });
    }
}

impl Elector {
    /// Starts building an elector for `role` on the database `options`
    /// point at. The role is validated by [`ElectorBuilder::build`]: 1 to
    /// [`MAX_ROLE_BYTES`](super::MAX_ROLE_BYTES) bytes, no NUL.
    ///
    /// ```
    /// use std::time::Duration;
    /// let options = pgelect::ConnectOptions::from_url("postgres://app@db/app").unwrap();
    /// let elector = pgelect::Elector::builder(options.clone(), "scheduler").build().unwrap();
    /// assert_eq!(elector.ttl(), Duration::from_secs(15));
    /// assert_eq!(elector.handover_delay(), Duration::from_millis(2500));
    /// // A renewal interval that cannot keep a healthy leader is refused.
    /// let err = pgelect::Elector::builder(options, "scheduler")
    ///     .ttl(Duration::from_secs(3))
    ///     .renew_every(Duration::from_secs(3))
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("renew_every 3s"), "{err}");
    /// ```
    pub fn builder(options: ConnectOptions, role: &str) -> ElectorBuilder {
        ElectorBuilder::new(options, role)
    }

    #[allow(clippy::too_many_arguments)] // one call site, in build()
    pub(crate) fn from_parts(
        priority: i32,
        options: ConnectOptions,
        role: String,
        node: String,
        key: LockKey,
        timing: Timing,
        standby: StandbyMode,
        meta: Option<serde_json::Value>,
        backend: Backend,
        listen_via: Option<ConnectOptions>,
        host: Option<RoleClaim>,
        lease_host: Option<LeaseClaim>,
    ) -> Elector {
        let per_backend = match backend {
            Backend::Session => PerBackend::Session(SessionState {
                standby,
                spare: Mutex::new(None),
                host,
                stepped_aside: Mutex::new(None),
            }),
            Backend::Lease => {
                let own_client = lease_host.is_none();
                let client = lease_host.unwrap_or_else(|| {
                    let own = SharedLease::own(&options, &role, &node);
                    if listen_via.is_some() {
                        own.through_pooler();
                    }
                    own.claim(&role)
                        .expect("BUG: a new client carries no role yet")
                });
                // Only this elector's own `LISTEN` connection sends here:
                // without one the channel stays empty, and a broadcast
                // channel allocates all its slots at once (64 slots are
                // 4.6 kB, for each of thousands of roles on a SharedLease).
                let slots = if listen_via.is_some() { 64 } else { 1 };
                PerBackend::Lease(LeaseState {
                    notices: tokio::sync::broadcast::Sender::new(slots),
                    listen_via,
                    listener: Mutex::new(None),
                    client,
                    own_client,
                    stepped_aside: Mutex::new(None),
                })
            }
        };
        Elector {
            shared: Arc::new(ElectorState {
                options,
                role,
                node,
                key,
                timing,
                meta,
                priority,
                leader: tokio::sync::watch::Sender::new(None),
                activity: tokio::sync::watch::Sender::new(Activity::default()),
                observer: Mutex::new(None),
                per_backend,
                contact: Contact::new(),
                preemption_refused: Arc::default(),
                server_read_only: tokio::sync::Notify::new(),
                lock_server: std::sync::Mutex::new(None),
            }),
        }
    }

    /// The role stood for.
    pub fn role(&self) -> &str {
        &self.shared.role
    }

    /// This candidate's node id (the `holder` written while leading).
    pub fn node_id(&self) -> &str {
        &self.shared.node
    }

    /// This candidate's priority (see [`ElectorBuilder::priority`]).
    pub fn priority(&self) -> i32 {
        self.shared.priority
    }

    /// Removes this candidate's row from the candidate registry
    /// (`<schema>.candidates`), on a connection of its own (or the one kept
    /// from the last clean release), for a candidate that stops standing
    /// for good. [`Elector::run`] calls it when shut down. Bounded by twice
    /// the `heartbeat_timeout`, connecting included.
    ///
    /// Not calling it is safe: a row of a candidate that no longer waits is
    /// never ready (readiness is read from `pg_locks` and
    /// `pg_stat_activity`, or a lease candidate's refresh time), and the
    /// next registration of the role deletes rows of dead backends. A
    /// campaign still running registers again on its next attempt.
    ///
    /// # Cancel safety
    /// Cancel safe: one statement; dropped, the row is left (see above).
    pub async fn withdraw(&self) -> Result<()> {
        registry_withdraw(&self.shared).await
    }

    /// The lease TTL.
    pub fn ttl(&self) -> Duration {
        self.shared.timing.ttl
    }

    /// The election backend.
    pub fn backend(&self) -> Backend {
        self.shared.backend()
    }

    /// Lease backend: the number of statements this elector (and the
    /// leaderships it handed out) has sent to the database so far —
    /// registrations, acquire attempts, renewals, releases — for capacity
    /// planning (also recorded as the metric
    /// [`LEASE_STATEMENTS`](crate::metrics::LEASE_STATEMENTS)). Always 0
    /// for the session backend and for a candidate on a [`SharedLease`]
    /// (see [`SharedLease::statements`]).
    pub fn lease_statements(&self) -> u64 {
        self.shared
            .lease()
            .filter(|l| l.own_client)
            .map_or(0, |l| l.client.client().statements())
    }

    /// How long ago one of this elector's connections (lock or lease
    /// statements, heartbeats, lock-wait slices, polls, the observer) last
    /// got an answer from the database; `None` if none ever did.
    ///
    /// For health checks: it costs nothing and opens no connection. A
    /// standby blocked in a lock wait hears from the server once per
    /// `wait_slice`; a leader at least once per heartbeat.
    pub fn last_contact(&self) -> Option<Duration> {
        self.shared.contact.since()
    }

    /// The wait after an unclean takeover (session backend; zero for the
    /// lease backend, which never takes over a lease that has not expired
    /// on the server or been released).
    pub fn handover_delay(&self) -> Duration {
        self.shared.timing.handover_delay
    }

    /// The timing this elector runs with, every default filled in (for
    /// logs, `pgelect status` and dashboards).
    pub fn timing(&self) -> TimingReport {
        self.shared.timing.report()
    }

    /// How long after sending its last successful renewal a leader may act:
    /// `ttl - safety_margin`.
    pub fn deadline_budget(&self) -> Duration {
        self.shared.timing.deadline_budget()
    }

    /// The role's advisory-lock key (`pgelect.key('election:<schema>:<role>')`).
    pub fn lock_key(&self) -> LockKey {
        self.shared.key
    }

    /// Campaigns until elected and returns the leadership.
    ///
    /// Waits as configured ([`StandbyMode`]; lease backend: until the
    /// lease's server-reported expiry, a release `NOTIFY` or `retry_every`);
    /// reconnects with backoff and jitter after connection failures and
    /// database restarts. Returns an error only for what waiting cannot fix:
    /// a missing schema
    /// ([`Error::SchemaMissing`](crate::Error::SchemaMissing), run `pgelect
    /// migrate`), a pooler in transaction mode with the session backend
    /// ([`Error::Pooler`](crate::Error::Pooler)), a live leader of the other
    /// backend ([`Error::Config`](crate::Error::Config)), bad credentials or
    /// privileges.
    ///
    /// Returns only once the handover delay (after an unclean loss) has
    /// passed: from then on the caller may act until
    /// [`LeaderContext::lost`] completes.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future while waiting cancels the lock wait
    /// and drops the lock connection; if the lock had already been granted
    /// (during the handover delay), the connection is dropped and standbys
    /// see an unclean loss. No leadership is ever left held without a
    /// handle.
    ///
    /// Lease backend: dropping the future while the acquiring statement is
    /// in flight may leave the lease taken on the server with no handle
    /// (the statement is cancelled, but may have committed): nobody acts on
    /// it, and it expires after `ttl`.
    pub async fn leadership(&self) -> Result<Leadership> {
        // A standby exports is_leader = 0 from the start, so that dashboards
        // and alerts see every candidate, not only those that have led.
        crate::metrics::standing(&self.shared.role);
        super::watchdog::ready();
        match &self.shared.per_backend {
            // Boxed: a waiting candidate's future holds its backend's
            // campaign only (thousands wait on a shared connection).
            PerBackend::Session(session) => {
                Box::pin(backend::session::campaign(&self.shared, session)).await
            }
            PerBackend::Lease(lease) => {
                Box::pin(backend::lease::campaign(&self.shared, lease)).await
            }
        }
    }

    /// The current leader of the role, updated on every change: from this
    /// elector's own elections and releases, from `NOTIFY` of other
    /// candidates, and by reading the lease row every `check_every`. `None`
    /// while nobody holds the role.
    ///
    /// The first call starts a light observer connection, kept until the
    /// elector is dropped; while this elector leads with the session backend
    /// it is closed and the leader publishes its own renewals. Called
    /// outside a Tokio runtime it does not panic: no observer starts (a
    /// warning is logged) and the receiver sees only this elector's own
    /// elections and releases until a campaign starts the observer.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<Option<LeaderInfo>> {
        self.shared
            .activity
            .send_if_modified(|a| !std::mem::replace(&mut a.watched, true));
        self.shared.ensure_observer();
        self.shared.leader.subscribe()
    }

    /// Runs duties while leader, as long as `shutdown` is not cancelled —
    /// the callback layer over [`Elector::leadership`].
    ///
    /// On every election, `on_elected` is called with a [`LeaderContext`]
    /// and the future it returns is run: these are the duties. They must
    /// stop (the future must complete) soon after
    /// [`LeaderContext::token`] is cancelled. Then:
    ///
    /// * leadership lost (connection, deadline, preemption, resign request):
    ///   the future is awaited until it completes;
    /// * `shutdown` cancelled: the token is cancelled with
    ///   [`LossReason::Shutdown`], the future awaited;
    /// * the future completes by itself: leadership is resigned;
    ///
    /// and, only after the duties completed, the leadership is released
    /// cleanly where the connection still allows it, and `on_demoted` runs
    /// and is awaited. Then it stands again, or returns `Ok(())` after a
    /// shutdown.
    ///
    /// Returns an error only when campaigning fails for good (see
    /// [`Elector::leadership`]).
    ///
    /// # Cancel safety
    /// Dropping the future drops a held leadership without release
    /// (standbys see an unclean loss); cancel `shutdown` instead.
    pub async fn run<E, EF, D, DF>(
        self,
        shutdown: CancellationToken,
        mut on_elected: E,
        mut on_demoted: D,
    ) -> Result<()>
    where
        E: FnMut(LeaderContext) -> EF,
        EF: Future<Output = ()>,
        D: FnMut() -> DF,
        DF: Future<Output = ()>,
    {
        loop {
            let leadership = tokio::select! {
                _ = shutdown.cancelled() => {
                    if let Err(e) = self.withdraw().await {
                        tracing::debug!(role = %self.shared.role, error = %e, "could not withdraw from the candidate registry; the row is left stale (never ready)");
                    }
                    return Ok(());
                }
                l = self.leadership() => l?,
            };
            let ctx = leadership.context();
            let duties = on_elected(ctx.clone());
            tokio::pin!(duties);
            let mut finished_alone = false;
            tokio::select! {
                _ = &mut duties => finished_alone = true,
                _ = ctx.lost() => {}
                _ = shutdown.cancelled() => leadership.stop(LossReason::Shutdown),
            }
            if !finished_alone {
                duties.await;
            }
            if let Err(e) = leadership.release(LossReason::Resigned).await {
                tracing::warn!(role = %self.shared.role, error = %e, "release after the duties stopped failed");
            }
            on_demoted().await;
            if shutdown.is_cancelled() {
                if let Err(e) = self.withdraw().await {
                    tracing::debug!(role = %self.shared.role, error = %e, "could not withdraw from the candidate registry; the row is left stale (never ready)");
                }
                return Ok(());
            }
        }
    }
}

/// The timing an [`Elector`] runs with, as validated by
/// [`ElectorBuilder::build`]; see [`Elector::timing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TimingReport {
    /// The profile the unset values were derived from.
    pub profile: Profile,
    /// Lease time to live.
    pub ttl: Duration,
    /// How much earlier than the lease the local deadline ends.
    pub safety_margin: Duration,
    /// Time between renewals.
    pub renew_every: Duration,
    /// Time between heartbeats on the lock connection while leading
    /// (session backend).
    pub heartbeat: Duration,
    /// How long a heartbeat or renewal may take (session backend); the
    /// statement timeout (lease backend).
    pub heartbeat_timeout: Duration,
    /// Wait after an unclean takeover before acting (zero for the lease
    /// backend).
    pub handover_delay: Duration,
}

impl TimingReport {
    /// The timing as JSON, durations in milliseconds (what `pgelect status
    /// --json` shows).
    pub fn to_json(&self) -> serde_json::Value {
        let ms = |d: Duration| d.as_millis() as u64;
        serde_json::json!({
            "profile": self.profile.as_str(),
            "ttl_ms": ms(self.ttl),
            "safety_margin_ms": ms(self.safety_margin),
            "renew_every_ms": ms(self.renew_every),
            "heartbeat_ms": ms(self.heartbeat),
            "heartbeat_timeout_ms": ms(self.heartbeat_timeout),
            "handover_delay_ms": ms(self.handover_delay),
        })
    }
}

/// Deletes `shared`'s registry row (see [`Elector::withdraw`]): connecting
/// and the statement together are bounded by twice the statement timeout,
/// so that a process that stops is not held up by an unreachable database.
async fn registry_withdraw(shared: &ElectorState) -> Result<()> {
    const WHAT: &str = "withdraw from the candidate registry";
    let s = shared.options.schema_name().as_str();
    // At least 2 s: with short TTLs the statement timeout is a few hundred
    // milliseconds, too little to connect on a busy machine, and a row left
    // behind is only stale (never ready), not harmful.
    let bound = (shared.timing.heartbeat_timeout * 2).max(Duration::from_secs(2));
    if let Some(lease) = shared.lease() {
        // On the lease client's connection (open already, unless it failed).
        return lease
            .client
            .client()
            .withdraw(&shared.role, &shared.node, bound)
            .await;
    }
    let spare = shared.session().and_then(SessionState::take_spare);
    let withdraw = async {
        let sql = registry::withdraw_sql(s);
        let args: [(&(dyn tokio_postgres::types::ToSql + Sync), _); 2] = [
            (&shared.role, tokio_postgres::types::Type::TEXT),
            (&shared.node, tokio_postgres::types::Type::TEXT),
        ];
        async fn withdrawn(
            conn: &DedicatedConnection,
            sql: &str,
            args: &[(
                &(dyn tokio_postgres::types::ToSql + Sync),
                tokio_postgres::types::Type,
            )],
        ) -> Result<(), tokio_postgres::Error> {
            conn.client().query_typed(sql, args).await.map(|_| ())
        }
        let result = match spare {
            Some(conn) => {
                let result = withdrawn(&conn, &sql, &args).await;
                conn.close().await;
                result
            }
            None => {
                let conn = shared
                    .options
                    .connect(&format!("withdraw:{}:{}", shared.role, shared.node))
                    .await?;
                let result = withdrawn(&conn, &sql, &args).await;
                conn.close().await;
                result
            }
        };
        result.map_err(|e| crate::Error::db(WHAT, s, e))
    };
    match tokio::time::timeout(bound, withdraw).await {
        Ok(r) => r,
        Err(_) => Err(crate::Error::connection_lost(WHAT)),
    }
}

impl Drop for Elector {
    fn drop(&mut self) {
        if let Some(lease) = self.shared.lease() {
            if let Some(t) = lease
                .listener
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
            {
                t.cancel();
            }
        }
        if let Some(t) = self
            .shared
            .observer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            t.cancel();
        }
    }
}

impl fmt::Debug for Elector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Elector")
            .field("role", &self.shared.role)
            .field("node", &self.shared.node)
            .field("target", &self.shared.options.target())
            .field("timing", &self.shared.timing)
            .field("backend", &self.shared.backend())
            .field("priority", &self.shared.priority)
            .field("standby", &self.shared.session().map(|s| s.standby))
            .field("leader", &*self.shared.leader.borrow())
            .finish()
    }
}
