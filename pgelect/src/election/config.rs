//! The elector's configuration: a builder whose every default is documented
//! and whose `build()` checks the safety inequalities.

use std::time::Duration;

use crate::conn::{ConnectOptions, TcpTimeouts};
use crate::election::config_error::{ConfigError, Setting};
use crate::error::{shown, Error, Result};
use crate::key::LockKey;

use super::timing::{Profile, Takeover, Timing, TimingRequest};
use super::{Elector, SharedConnection, SharedLease};

/// Builder methods that each set the optional field of their name
/// (`self.name = Some(arg)`), documented where they are listed.
macro_rules! optional_setters {
    ($($(#[$doc:meta])* $name:ident($arg:ident: $ty:ty);)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $arg: $ty) -> Self {
                self.$name = Some($arg);
                self
            }
        )*
    };
}

/// The longest role or node id accepted, in bytes.
pub const MAX_ROLE_BYTES: usize = 255;

/// Which mechanism elects the leader of a role. Every candidate of one role
/// must use the same backend: a candidate that finds the role held by a live
/// leader of the other backend fails with [`Error::Config`].
///
/// See the [module documentation](crate::election) for when to choose which.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Backend {
    /// A session advisory lock on a dedicated connection, plus the lease
    /// row for terms and observers. Standbys are granted the lock the moment
    /// the leader's backend ends. Needs a direct connection or a
    /// session-mode pool; refuses a transaction pooler with
    /// [`Error::Pooler`]. The default.
    #[default]
    Session,
    /// The lease row alone: every step is one statement in its own
    /// transaction, all times on the server's clock. Works through
    /// PgBouncer in transaction mode; a crashed leader is replaced when its
    /// lease expires (about `ttl` later).
    Lease,
}

impl Backend {
    /// The name stored in `pgelect.leaders.backend`: `session` or `lease`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Session => "session",
            Backend::Lease => "lease",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Backend {
    type Err = Error;

    /// Parses `session` or `lease`.
    ///
    /// ```
    /// use pgelect::election::Backend;
    /// assert_eq!("lease".parse::<Backend>().unwrap(), Backend::Lease);
    /// assert!("zookeeper".parse::<Backend>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Backend> {
        match s {
            "session" => Ok(Backend::Session),
            "lease" => Ok(Backend::Lease),
            other => Err(Error::Config(ConfigError::UnknownBackend {
                given: shown(other),
            })),
        }
    }
}

/// How a standby waits for the leader's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StandbyMode {
    /// Wait in `pg_advisory_lock` on the lock connection: the server grants
    /// the lock the moment the leader's backend ends or unlocks (a few ms on
    /// loopback). A second, light connection watches the lease row (for
    /// [`Elector::watch`] and zombie preemption). The default.
    #[default]
    Blocking,
    /// Try `pg_try_advisory_lock` on the lock connection every `interval`,
    /// and at once when the leader announces a release with `NOTIFY`. A
    /// crashed leader is replaced within `interval` plus the handover
    /// delay. For processes that stand for many roles: with
    /// [`SessionOptions::shared_connection`] the candidates of all roles
    /// share one connection.
    Polling {
        /// Time between attempts. Must be positive.
        interval: Duration,
    },
}

/// Session-backend options: what the session backend uses and the lease
/// backend has no use for. Given to [`ElectorBuilder::backend`]; every
/// setting left alone keeps the default its method names.
///
/// ```
/// use std::time::Duration;
/// use pgelect::election::SessionOptions;
/// use pgelect::election::{Profile, StandbyMode};
/// use pgelect::Elector;
/// # fn f(options: pgelect::ConnectOptions) -> pgelect::Result<()> {
/// let elector = Elector::builder(options, "scheduler")
///     .backend(
///         SessionOptions::new()
///             .profile(Profile::Fast)
///             .standby(StandbyMode::Polling { interval: Duration::from_millis(500) }),
///     )
///     .build()?;
/// assert_eq!(elector.handover_delay(), Duration::from_millis(70));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
#[must_use = "options do nothing until given to `ElectorBuilder::backend`"]
pub struct SessionOptions {
    profile: Profile,
    heartbeat: Option<Duration>,
    heartbeat_timeout: Option<Duration>,
    handover_delay: Option<Duration>,
    tcp: Option<TcpTimeouts>,
    standby: StandbyMode,
    wait_slice: Option<Duration>,
    shared_connection: Option<SharedConnection>,
}

impl SessionOptions {
    /// The defaults: [`Profile::Standard`], a blocking standby on a
    /// connection of its own, timing derived from the TTL.
    pub fn new() -> SessionOptions {
        SessionOptions::default()
    }

    /// How the timing settings not set explicitly are derived: the
    /// [`Profile::Standard`] default follows the TTL; [`Profile::Fast`]
    /// brings crash failover under 100 ms for about 50 heartbeats per
    /// second per leader. Explicit settings win; the inequalities are
    /// checked the same way. Default: [`Profile::Standard`].
    pub fn profile(mut self, profile: Profile) -> Self {
        self.profile = profile;
        self
    }

    optional_setters! {
        /// Time between heartbeats (`SHOW transaction_read_only`, which also
        /// finds a server that accepts no writes) on the lock connection while
        /// leading, backing up the push detection of a closed socket. Default:
        /// `ttl / 15`, between 20 ms and 1 s (1 s at the default TTL; 20 ms in
        /// [`Profile::Fast`]).
        heartbeat(every: Duration);

        /// How long a heartbeat or renewal may take before the lock connection
        /// is declared dead and dropped. Must be shorter than `ttl -
        /// safety_margin`. Default: the profile's heartbeat interval (`1s` at
        /// the default TTL; 25 ms in [`Profile::Fast`]).
        heartbeat_timeout(timeout: Duration);

        /// Wait after an unclean takeover before acting. Default:
        /// `min(heartbeat + heartbeat_timeout, ttl - safety_margin) +
        /// min(heartbeat_timeout, 500ms)` (`2.5s` with the other defaults,
        /// 400 ms with a TTL of 2 s, 70 ms in [`Profile::Fast`]); values below
        /// `min(heartbeat + heartbeat_timeout, ttl - safety_margin)` are
        /// refused with [`ConfigError::HandoverBelowDetection`].
        handover_delay(delay: Duration);
    }

    /// TCP timeouts of the lock connection, on both ends. Default: derived
    /// from the TTL — `TCP_USER_TIMEOUT = ttl`, `keepalive_idle = ttl/3`,
    /// `keepalive_interval = ttl/6` and enough probes for the keepalive path
    /// to outlast `ttl` (whole seconds, at least 1); on a
    /// [`shared_connection`](SessionOptions::shared_connection), the
    /// connection's.
    pub fn tcp_timeouts(mut self, tcp: TcpTimeouts) -> Self {
        self.tcp = Some(tcp);
        self
    }

    /// How a standby waits. Default: [`StandbyMode::Blocking`] (polling
    /// every second on a [`shared_connection`](SessionOptions::shared_connection)).
    pub fn standby(mut self, mode: StandbyMode) -> Self {
        self.standby = mode;
        self
    }

    optional_setters! {
        /// How long one slice of a blocking standby's lock wait lasts before
        /// it is issued again. Default: 20 s.
        ///
        /// Blocking standbys of the default priority queue for the role's
        /// *watch key* in slices of this length; only the key's holder (the
        /// watch) waits for the role's lock itself, in slices of
        /// `check_every`, and between them reads the row and preempts a zombie
        /// leader for all of them. So each other standby costs one connection
        /// and one statement per slice: 100 standbys of one role, 5 statements
        /// per second. A watch frozen for a TTL is ended by the next standby
        /// whose slice ends, so a leader that fails while its watch is frozen
        /// is followed within `ttl + wait_slice` (otherwise within the usual
        /// bound).
        ///
        /// A statement holds a snapshot while it runs, and the oldest snapshot
        /// bounds what VACUUM may remove in the whole database (the xmin
        /// horizon): a standby blocked in one `pg_advisory_lock` for days would
        /// keep every dead row for days. Each slice is one statement
        /// (`pgelect.lock_wait_slice`) that catches its own lock timeout, so the
        /// server logs no error for it. Between two slices the lock is not
        /// waited for during one round trip; a release in that moment is taken
        /// by the next slice at once (or by another standby).
        wait_slice(slice: Duration);
    }

    /// Stand on `connection`, shared with the candidates of other roles,
    /// instead of on a connection of this candidate's own (see
    /// [`SharedConnection`]). Sets the standby mode to
    /// [`StandbyMode::Polling`] every second unless a polling interval was
    /// chosen, and the TCP timeouts to the connection's unless set
    /// (`build()` refuses a blocking standby, other TCP timeouts, another
    /// database or schema, and a second candidate of the same role on the
    /// connection). Default: none.
    pub fn shared_connection(mut self, connection: &SharedConnection) -> Self {
        if self.standby == StandbyMode::Blocking {
            self.standby = StandbyMode::Polling {
                interval: Duration::from_secs(1),
            };
        }
        if self.tcp.is_none() {
            self.tcp = Some(connection.tcp_timeouts());
        }
        self.shared_connection = Some(connection.clone());
        self
    }
}

/// Lease-backend options: what the lease backend uses and the session
/// backend has no use for. Given to [`ElectorBuilder::backend`]; every
/// setting left alone keeps the default its method names.
///
/// ```
/// use pgelect::election::LeaseOptions;
/// use pgelect::election::Backend;
/// use pgelect::{ConnectOptions, Elector};
/// let pooled = ConnectOptions::from_url("postgres://app@pgbouncer:6432/app").unwrap();
/// let direct = ConnectOptions::from_url("postgres://app@db/app").unwrap();
/// let elector = Elector::builder(pooled, "scheduler")
///     .backend(LeaseOptions::new().listen_via(direct))
///     .build()
///     .unwrap();
/// assert_eq!(elector.backend(), Backend::Lease);
/// ```
#[derive(Clone, Debug, Default)]
#[must_use = "options do nothing until given to `ElectorBuilder::backend`"]
pub struct LeaseOptions {
    // Boxed: the connection options are large, and the session variant of
    // `BackendOptions` should not carry their size.
    listen_via: Option<Box<ConnectOptions>>,
    retry_every: Option<Duration>,
    statement_timeout: Option<Duration>,
    shared_lease: Option<SharedLease>,
}

impl LeaseOptions {
    /// The defaults: statements on a client of the candidate's own, no
    /// `LISTEN` connection.
    pub fn new() -> LeaseOptions {
        LeaseOptions::default()
    }

    /// A connection that bypasses the pooler (directly to PostgreSQL, or
    /// through a session-mode pool), used to `LISTEN`. With it,
    /// standbys wake up on a leader's release `NOTIFY` (a voluntary
    /// release is taken over in milliseconds instead of within
    /// [`retry_every`](LeaseOptions::retry_every)), and a leader hears
    /// [`request_resign`](crate::admin::request_resign) at once instead of at its
    /// next renewal. When it may call the schema's lease functions (it may
    /// connect as another user), the leader's release and the acquire that
    /// a release announcement brings are sent on it too: a planned
    /// handover does not wait for the pooler's hop. Losing this connection never affects leadership; it is
    /// reopened with backoff. It must use the elector's schema. Default:
    /// none (`LISTEN` through a transaction pooler does not work).
    pub fn listen_via(mut self, options: ConnectOptions) -> Self {
        self.listen_via = Some(Box::new(options));
        self
    }

    optional_setters! {
        /// The longest a standby sleeps between two attempts to take the
        /// lease. A standby normally sleeps exactly until the lease's
        /// server-reported expiry plus a jitter of at most 50 ms (ttl/20 below
        /// a 1 s TTL); this caps that sleep, and so bounds how late a standby
        /// without a [`listen_via`](LeaseOptions::listen_via) connection
        /// notices a voluntary release. Default: `1s`. Through a transaction
        /// pooler with many standbys (a fleet of processes for one role), set
        /// it to the TTL or more: each standby then costs about one statement
        /// per lease expiry (its registration is refreshed by the same
        /// statement) instead of one a second, and a crashed leader is still
        /// taken over at its lease's expiry.
        retry_every(every: Duration);

        /// The bound on a leader's renewal and release; one that runs out is
        /// cancelled, its connection dropped, and it is retried within the
        /// deadline budget. Connecting and a standby's attempt may take up to
        /// `max(statement_timeout, 2s)` (no risk: the deadline counts from
        /// before the connection, and a standby holds nothing). Must be
        /// shorter than `ttl - safety_margin`. Default: `min(1s, (ttl -
        /// safety_margin) / 4)`.
        statement_timeout(timeout: Duration);
    }

    /// Send this candidate's statements over `client`, batched with those
    /// of the candidates of other roles, instead of over a connection of
    /// its own (see [`SharedLease`]). `build()` refuses it with a
    /// [`listen_via`](LeaseOptions::listen_via) connection of the
    /// candidate's own (set it on the client: [`SharedLease::listen_via`]),
    /// for another database or schema, and for a second candidate of the
    /// same role on the client. Default: none.
    ///
    /// ```
    /// use pgelect::election::LeaseOptions;
    /// use pgelect::election::{Backend, SharedLease};
    /// use pgelect::{ConnectOptions, Elector};
    /// let options = ConnectOptions::from_url("postgres://app@db/app").unwrap();
    /// let client = SharedLease::new(&options);
    /// let elector = Elector::builder(options.clone(), "shard-1")
    ///     .backend(LeaseOptions::new().shared_lease(&client))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(elector.backend(), Backend::Lease);
    /// // One candidate per role on a client.
    /// let err = Elector::builder(options, "shard-1")
    ///     .backend(LeaseOptions::new().shared_lease(&client))
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("already has a candidate"), "{err}");
    /// ```
    pub fn shared_lease(mut self, client: &SharedLease) -> Self {
        self.shared_lease = Some(client.clone());
        self
    }
}

/// The election backend with its options: the value
/// [`ElectorBuilder::backend`] takes. An option lives in the variant of
/// the backend that uses it, so none can be set that would be ignored.
///
/// Built from a [`Backend`] (its defaults), a [`SessionOptions`] or a
/// [`LeaseOptions`]:
///
/// ```
/// use pgelect::election::{BackendOptions, LeaseOptions};
/// use pgelect::election::Backend;
/// assert_eq!(BackendOptions::from(Backend::Lease).backend(), Backend::Lease);
/// assert_eq!(BackendOptions::from(LeaseOptions::new()).backend(), Backend::Lease);
/// assert_eq!(BackendOptions::default().backend(), Backend::Session);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum BackendOptions {
    /// [`Backend::Session`] with its options.
    Session(SessionOptions),
    /// [`Backend::Lease`] with its options.
    Lease(LeaseOptions),
}

impl BackendOptions {
    /// The session options or the lease options, whichever these are.
    fn split(self) -> (Option<SessionOptions>, Option<LeaseOptions>) {
        match self {
            BackendOptions::Session(s) => (Some(s), None),
            BackendOptions::Lease(l) => (None, Some(l)),
        }
    }

    /// Which backend.
    pub fn backend(&self) -> Backend {
        match self {
            BackendOptions::Session(_) => Backend::Session,
            BackendOptions::Lease(_) => Backend::Lease,
        }
    }
}

impl Default for BackendOptions {
    /// The session backend with its defaults.
    fn default() -> BackendOptions {
        BackendOptions::Session(SessionOptions::default())
    }
}

impl From<Backend> for BackendOptions {
    /// The backend with its default options.
    fn from(backend: Backend) -> BackendOptions {
        match backend {
            Backend::Session => BackendOptions::Session(SessionOptions::default()),
            Backend::Lease => BackendOptions::Lease(LeaseOptions::default()),
        }
    }
}

impl From<SessionOptions> for BackendOptions {
    fn from(options: SessionOptions) -> BackendOptions {
        BackendOptions::Session(options)
    }
}

impl From<LeaseOptions> for BackendOptions {
    fn from(options: LeaseOptions) -> BackendOptions {
        BackendOptions::Lease(options)
    }
}

/// Builds an [`Elector`]; see [`Elector::builder`].
///
/// The builder holds what every backend uses (the TTL and the renewal
/// cadence, the safety margin, the node id, priority and metadata);
/// [`backend`](ElectorBuilder::backend) takes the backend with its own
/// options ([`SessionOptions`], [`LeaseOptions`]). `build()` checks the
/// timing below and refuses with [`Error::Config`] carrying a
/// [`ConfigError`] that names the inequality and its values;
/// [`shortest_ttl`](ElectorBuilder::shortest_ttl) gives the shortest TTL
/// the other settings allow.
///
/// # Timing and the safety inequality
///
/// With the defaults (`ttl` 15 s):
///
/// | setting | where | default | with ttl 15 s |
/// |---|---|---|---|
/// | `ttl` | builder | 15 s | 15 s |
/// | `safety_margin` | builder | `ttl / 5` | 3 s |
/// | `renew_every` | builder | `ttl / 3` | 5 s |
/// | `check_every` | builder | `renew_every` | 5 s |
/// | `heartbeat` | session | `ttl / 15`, from 20 ms to 1 s | 1 s |
/// | `heartbeat_timeout` | session | `heartbeat` | 1 s |
/// | `handover_delay` | session | `min(heartbeat + heartbeat_timeout, ttl - safety_margin) + min(heartbeat_timeout, 500 ms)` | 2.5 s |
/// | `tcp_timeouts` | session | derived from `ttl` (below) | idle 5 s, interval 2 s, count 6, user timeout 15 s |
/// | `wait_slice` | session | 20 s | 20 s |
/// | `statement_timeout` | lease | `min(1 s, (ttl - safety_margin) / 4)` | 1 s |
/// | `retry_every` | lease | 1 s | 1 s |
///
/// A leader's **local deadline** is `ttl - safety_margin` (12 s) after the
/// *sending* of its last successful renewal, on the monotonic clock; when it
/// passes, leadership is cancelled whether or not the database answers.
/// With the session backend, `build()` enforces:
///
/// 1. `ttl - safety_margin < ttl`: the local deadline ends before the
///    server-side lease (`now() + ttl` when the server ran the renewal,
///    which is after it was sent) expires, so a standby that preempts an
///    expired lease never overlaps a leader that still believes it leads;
///    the margin (3 s) absorbs clock-rate drift and one network round trip.
/// 2. `ttl - safety_margin < min(tcp user_timeout, keepalive_idle +
///    keepalive_interval × keepalive_count)` (12 s < 15 s): a partitioned
///    leader demotes itself before the *server* can declare it gone and
///    release its lock to a standby. `connect_for_locks` sets these TCP
///    settings on the server side of the lock connection. The derived
///    defaults use `TCP_USER_TIMEOUT = ttl` and a keepalive path longer than
///    `ttl`, so the lock is released soon after the deadline, not hours later.
/// 3. `renew_every < ttl - safety_margin`: a healthy leader renews (twice,
///    with the defaults) before its deadline; and `heartbeat_timeout < ttl -
///    safety_margin`.
/// 4. `handover_delay ≥ min(heartbeat + heartbeat_timeout, ttl -
///    safety_margin)`: after an *unclean* takeover (the lease row still named
///    a holder: the old backend was terminated or its connection reset) the
///    old leader may still be alive and not yet know. Its driver task reads
///    the socket all the time, so a FIN or RST is seen within a millisecond;
///    if none arrives, its next heartbeat is sent within `heartbeat` (1 s) and
///    fails within `heartbeat_timeout` (1 s), and at the latest its deadline
///    ends it. The default adds `min(heartbeat_timeout, 500 ms)` for the
///    old leader's last answer being longer in flight than the successor's
///    grant, and for scheduling delays: 2.5 s. A clean release (the holder
///    cleared itself) is taken over at once.
///
/// These defaults follow the TTL ([`Profile::Standard`]): with a TTL of 2 s
/// the heartbeat is 133 ms and the handover delay 400 ms.
/// [`Profile::Fast`] (a session option) sets 20 ms / 25 ms / 70 ms
/// whatever the TTL.
///
/// # The lease backend's inequalities
///
/// With [`Backend::Lease`] the same `ttl`, `safety_margin` and `renew_every`
/// (same defaults: 15 s, 3 s, 5 s) apply, plus the lease options
/// `retry_every` (1 s) and `statement_timeout` (1 s), which bounds every
/// lease statement (and the reconnection before it). `build()` enforces:
///
/// 1. `ttl - safety_margin < ttl`: the local deadline (12 s after the
///    *sending* of the last successful renewal) ends before the lease on the
///    server (`now() + ttl` when the server *ran* that renewal, later) does.
/// 2. `renew_every < ttl - safety_margin` (5 s < 12 s): a healthy leader
///    renews before its deadline, with time for retries.
/// 3. `statement_timeout < ttl - safety_margin`: a stuck statement is given
///    up and retried before the deadline.
///
/// No TCP or handover constraint is needed, unlike the session backend: a
/// lease changes hands only when the acquiring statement finds it expired
/// *on the server's clock* — which happens after the old leader's local
/// deadline passed (1.) whatever the state of its connection — or after the
/// old leader cleared it itself (a clean release, after its duties
/// stopped). A lost connection releases nothing, so nobody has to wait for a
/// live old leader to notice one; the handover delay is zero.
///
/// A process that is *paused* (stopped, swapped out, a long GC) cannot run
/// any timer: writes that must never overlap use the fence
/// ([`LeaderContext::fence`](crate::election::LeaderContext::fence)), which the takeover's
/// term bump defeats.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ElectorBuilder {
    options: ConnectOptions,
    role: String,
    node_id: Option<String>,
    ttl: Option<Duration>,
    safety_margin: Option<Duration>,
    renew_every: Option<Duration>,
    check_every: Option<Duration>,
    meta: Option<serde_json::Value>,
    backend: BackendOptions,
    priority: i32,
}

impl ElectorBuilder {
    pub(crate) fn new(options: ConnectOptions, role: &str) -> ElectorBuilder {
        ElectorBuilder {
            options,
            role: role.to_owned(),
            node_id: None,
            ttl: None,
            safety_margin: None,
            renew_every: None,
            check_every: None,
            meta: None,
            backend: BackendOptions::default(),
            priority: 0,
        }
    }

    /// This candidate's priority: a leader hands over to a *ready*
    /// candidate of **strictly** higher priority (equal priorities never
    /// take over from each other). Default: `0`.
    ///
    /// Ready means, as the server sees it (never from what a candidate
    /// says of itself): a blocking standby's lock connection waits on the
    /// role's lock in `pg_locks`; a polling standby's connection is alive;
    /// a lease-backend standby refreshed its registration within its TTL.
    /// Candidates register in `<schema>.candidates` (schema version 5),
    /// which only users with candidate grants may write.
    ///
    /// The leader checks at every renewal, and at once (at most one check
    /// per 100 ms) when a preferred candidate registers and sends it a hint;
    /// it then ends its leadership with
    /// [`LossReason::HandedOver`](crate::loss::LossReason::HandedOver): the
    /// duties stop, and releasing (as [`Elector::run`] does, or
    /// [`Leadership::resign`](crate::Leadership::resign)) hands the lock to
    /// the preferred candidate with a new term and no overlap. A lower
    /// candidate granted the lock while a preferred one waits gives it back
    /// before bumping the term. Use cases: a rolling deploy whose new
    /// version should lead as soon as it is up; a leader kept in the same
    /// zone as the primary.
    ///
    /// ```
    /// let options = pgelect::ConnectOptions::from_url("postgres://app@db/app").unwrap();
    /// let elector = pgelect::Elector::builder(options, "scheduler").priority(10).build().unwrap();
    /// assert_eq!(elector.priority(), 10);
    /// ```
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// The election backend and its options: a [`Backend`] (with its
    /// default options), [`SessionOptions`] or [`LeaseOptions`]. Default:
    /// [`Backend::Session`] with [`SessionOptions::new`]. All candidates of
    /// a role must use the same backend. A second call replaces the first.
    ///
    /// ```
    /// use pgelect::election::{LeaseOptions, SessionOptions};
    /// use pgelect::election::{Backend, Profile};
    /// use pgelect::{ConnectOptions, Elector};
    /// let options = ConnectOptions::from_url("postgres://app@db/app").unwrap();
    /// let lease = Elector::builder(options.clone(), "a").backend(Backend::Lease).build().unwrap();
    /// assert_eq!(lease.backend(), Backend::Lease);
    /// let fast = Elector::builder(options, "b")
    ///     .backend(SessionOptions::new().profile(Profile::Fast))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(fast.timing().profile, Profile::Fast);
    /// ```
    pub fn backend(mut self, backend: impl Into<BackendOptions>) -> Self {
        self.backend = backend.into();
        self
    }

    /// Selects the session backend and adjusts its options: `adjust`
    /// receives the session options given so far (the defaults if none
    /// were, or if the lease backend was chosen: its options are dropped).
    /// For builders assembled in steps, such as a helper's builder that a
    /// caller extends.
    ///
    /// ```
    /// use std::time::Duration;
    /// use pgelect::election::Profile;
    /// use pgelect::{ConnectOptions, Elector};
    /// let options = ConnectOptions::from_url("postgres://app@db/app").unwrap();
    /// let fast = Elector::builder(options, "scheduler")
    ///     .session(|s| s.profile(Profile::Fast))
    ///     .session(|s| s.heartbeat(Duration::from_millis(50)));
    /// // Both adjustments hold: the fast profile with a 50 ms heartbeat.
    /// assert_eq!(fast.build().unwrap().handover_delay(), Duration::from_millis(100));
    /// ```
    pub fn session(mut self, adjust: impl FnOnce(SessionOptions) -> SessionOptions) -> Self {
        let (current, _) = std::mem::take(&mut self.backend).split();
        self.backend = BackendOptions::Session(adjust(current.unwrap_or_default()));
        self
    }

    /// Selects the lease backend and adjusts its options: `adjust`
    /// receives the lease options given so far (the defaults if none were,
    /// or if the session backend was chosen: its options are dropped).
    ///
    /// ```
    /// use std::time::Duration;
    /// use pgelect::election::Backend;
    /// use pgelect::{ConnectOptions, Elector};
    /// let options = ConnectOptions::from_url("postgres://app@pgbouncer:6432/app").unwrap();
    /// let elector = Elector::builder(options, "sweeper")
    ///     .lease(|l| l.retry_every(Duration::from_millis(200)))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(elector.backend(), Backend::Lease);
    /// ```
    pub fn lease(mut self, adjust: impl FnOnce(LeaseOptions) -> LeaseOptions) -> Self {
        let (_, current) = std::mem::take(&mut self.backend).split();
        self.backend = BackendOptions::Lease(adjust(current.unwrap_or_default()));
        self
    }

    /// This candidate's name, stored as `holder` in the lease row and shown
    /// in `application_name`. Default: `<hostname>-<pid>-<8 random hex
    /// digits>`, unique per process (never the bare host name, which two
    /// processes on one host would share).
    pub fn node_id(mut self, node_id: &str) -> Self {
        self.node_id = Some(node_id.to_owned());
        self
    }

    optional_setters! {
        /// Lease time to live. Default: `15s`.
        ttl(ttl: Duration);

        /// How much earlier than the lease the local deadline ends. Default:
        /// `ttl / 5`.
        safety_margin(margin: Duration);

        /// Time between renewals. Default: `ttl / 3`.
        renew_every(every: Duration);

        /// How often a standby reads the lease row (for [`Elector::watch`] and to
        /// preempt a leader whose lease expired). Default: `renew_every`.
        check_every(every: Duration);

        /// JSON stored as `holder_meta` in the lease row while this candidate
        /// leads (an address, a version). Default: none.
        meta(meta: serde_json::Value);
    }

    /// The shortest TTL, in whole milliseconds, that [`build`](ElectorBuilder::build)
    /// accepts with this builder's other settings (the TTL set, if any, is
    /// ignored), or `None` when no TTL is accepted (another setting is
    /// refused whatever the TTL, or explicit TCP timeouts or handover delay
    /// leave no room). Computed from the inequalities `build()` enforces,
    /// not searched; opens no connection.
    ///
    /// Settings left unset follow the TTL (`safety_margin = ttl / 5`, the
    /// standard profile's heartbeat timeout `ttl / 15`, at least 20 ms), so
    /// with the defaults the bound is the heartbeat timeout of 20 ms having
    /// to end before the deadline `4/5 ttl`:
    ///
    /// ```
    /// use std::time::Duration;
    /// use pgelect::election::SessionOptions;
    /// use pgelect::election::{Backend, Profile};
    /// use pgelect::{ConnectOptions, Elector};
    /// let options = ConnectOptions::from_url("postgres://app@db/app").unwrap();
    /// let builder = Elector::builder(options, "scheduler");
    /// let shortest = builder.shortest_ttl().unwrap();
    /// assert_eq!(shortest, Duration::from_millis(26));
    /// assert!(builder.clone().ttl(shortest).build().is_ok());
    /// assert!(builder.clone().ttl(shortest - Duration::from_millis(1)).build().is_err());
    /// // The fast profile's 25 ms heartbeat timeout: 4/5 ttl > 25 ms.
    /// let fast = builder.clone().backend(SessionOptions::new().profile(Profile::Fast));
    /// assert_eq!(fast.shortest_ttl(), Some(Duration::from_millis(32)));
    /// assert_eq!(builder.backend(Backend::Lease).shortest_ttl(), Some(Duration::from_millis(1)));
    /// ```
    pub fn shortest_ttl(&self) -> Option<Duration> {
        let (request, takeover) = self.timing_request();
        request.shortest_ttl(takeover)
    }

    /// Puts a partition group's session-backend elector on the group's
    /// shared connection, polling every `interval` (overriding what the
    /// group's user chose).
    pub(crate) fn on_shared_connection(
        self,
        connection: &SharedConnection,
        interval: Duration,
    ) -> Self {
        self.session(|s| {
            s.shared_connection(connection)
                .standby(StandbyMode::Polling { interval })
        })
    }

    /// Puts a partition group's lease-backend elector on the group's
    /// shared lease client, looking at the lease at least every `interval`
    /// (overriding what the group's user chose).
    pub(crate) fn on_shared_lease(self, client: &SharedLease, interval: Duration) -> Self {
        self.lease(|l| l.shared_lease(client).retry_every(interval))
    }

    /// Sets `key` in the meta: in the meta object given, or in a new one;
    /// a meta that is not an object is left as it is.
    pub(crate) fn with_meta_key(mut self, key: &str, value: serde_json::Value) -> Self {
        match &mut self.meta {
            None => self.meta = Some(serde_json::json!({ key: value })),
            Some(serde_json::Value::Object(m)) => {
                m.insert(key.to_owned(), value);
            }
            Some(_) => {}
        }
        self
    }

    /// The backend chosen so far.
    pub(crate) fn chosen_backend(&self) -> Backend {
        self.backend.backend()
    }

    /// The timing as set, and the takeover rule of the chosen backend.
    fn timing_request(&self) -> (TimingRequest, Takeover) {
        let common = TimingRequest {
            ttl: self.ttl,
            safety_margin: self.safety_margin,
            renew_every: self.renew_every,
            check_every: self.check_every,
            ..TimingRequest::default()
        };
        match &self.backend {
            BackendOptions::Session(s) => (
                TimingRequest {
                    profile: s.profile,
                    heartbeat: s.heartbeat,
                    heartbeat_timeout: s.heartbeat_timeout,
                    handover_delay: s.handover_delay,
                    tcp: s.tcp,
                    wait_slice: s.wait_slice,
                    ..common
                },
                Takeover::OnDisconnect,
            ),
            BackendOptions::Lease(l) => (
                TimingRequest {
                    heartbeat_timeout: l.statement_timeout,
                    retry_every: l.retry_every,
                    ..common
                },
                Takeover::OnExpiry,
            ),
        }
    }

    /// Validates everything and builds the elector. Opens no connection.
    ///
    /// Fails with [`Error::InvalidName`] for an empty role or node id, one
    /// with a NUL character or longer than [`MAX_ROLE_BYTES`], and with
    /// [`Error::Config`] carrying the [`ConfigError`] that names the rule
    /// and the values for timing that breaks the safety inequalities (see
    /// [`ElectorBuilder`]) and for shared clients that do not fit.
    pub fn build(self) -> Result<Elector> {
        validate_name("role", &self.role)?;
        let node = match &self.node_id {
            Some(n) => {
                validate_name("node id", n)?;
                n.clone()
            }
            None => default_node_id(),
        };
        let (request, takeover) = self.timing_request();
        let timing: Timing = request.validate_for(takeover).map_err(Error::Config)?;
        let key = role_key(self.options.schema_name().as_str(), &self.role);
        let mismatch = |options: &ConnectOptions| {
            (options.target() != self.options.target()
                || options.schema_name() != self.options.schema_name())
            .then(|| {
                Error::Config(ConfigError::SharedTargetMismatch {
                    shared: options.target(),
                    shared_schema: options.schema_name().as_str().to_owned(),
                    elector: self.options.target(),
                    elector_schema: self.options.schema_name().as_str().to_owned(),
                })
            })
        };
        let (standby, backend, listen, claim, lease_claim) = match self.backend {
            BackendOptions::Session(s) => {
                if let StandbyMode::Polling { interval } = s.standby {
                    if interval.is_zero() {
                        return Err(Error::Config(ConfigError::Zero {
                            setting: Setting::PollingInterval,
                        }));
                    }
                }
                let claim = match &s.shared_connection {
                    None => None,
                    Some(c) => {
                        if s.standby == StandbyMode::Blocking {
                            return Err(Error::Config(ConfigError::SharedConnectionBlocking));
                        }
                        if timing.tcp != c.tcp_timeouts() {
                            return Err(Error::Config(ConfigError::SharedConnectionTcp {
                                elector: timing.tcp,
                                connection: c.tcp_timeouts(),
                            }));
                        }
                        if let Some(e) = mismatch(c.options()) {
                            return Err(e);
                        }
                        Some(c.claim(&self.role)?)
                    }
                };
                (s.standby, Backend::Session, None, claim, None)
            }
            BackendOptions::Lease(l) => {
                if let Some(listen) = &l.listen_via {
                    if listen.schema_name() != self.options.schema_name() {
                        return Err(Error::Config(ConfigError::ListenSchemaMismatch {
                            listen: listen.schema_name().as_str().to_owned(),
                            elector: self.options.schema_name().as_str().to_owned(),
                        }));
                    }
                }
                let lease_claim = match &l.shared_lease {
                    None => None,
                    Some(c) => {
                        if l.listen_via.is_some() {
                            return Err(Error::Config(ConfigError::ListenViaOnSharedLease));
                        }
                        if let Some(e) = mismatch(c.options()) {
                            return Err(e);
                        }
                        Some(c.claim(&self.role)?)
                    }
                };
                let listen = l.listen_via.map(|b| *b);
                (
                    StandbyMode::default(),
                    Backend::Lease,
                    listen,
                    None,
                    lease_claim,
                )
            }
        };
        Ok(Elector::from_parts(
            self.priority,
            self.options,
            self.role,
            node,
            key,
            timing,
            standby,
            self.meta,
            backend,
            listen,
            claim,
            lease_claim,
        ))
    }
}

/// The advisory-lock key of a role's election: `LockKey::from_name` of
/// `election:<schema>:<role>`, i.e. `pgelect.key('election:pgelect:' || role)`
/// in SQL for the default schema.
pub(crate) fn role_key(schema: &str, role: &str) -> LockKey {
    LockKey::from_name(&format!("election:{schema}:{role}")).expect("BUG: validated role")
}

/// The advisory-lock key a role's blocking standbys queue for before they
/// wait for the role's lock (see the session backend's `Place`):
/// `LockKey::from_name` of `election-watch:<schema>:<role>`.
pub(crate) fn watch_key(schema: &str, role: &str) -> LockKey {
    LockKey::from_name(&format!("election-watch:{schema}:{role}")).expect("BUG: validated role")
}

pub(crate) fn validate_name(what: &'static str, name: &str) -> Result<()> {
    let refuse = |reason: &str| {
        Err(Error::InvalidName {
            what,
            shown: shown(name),
            reason: reason.to_owned(),
        })
    };
    if name.is_empty() {
        return refuse("it is empty");
    }
    if name.len() > MAX_ROLE_BYTES {
        return refuse(&format!(
            "it is {} bytes long, the limit is {MAX_ROLE_BYTES}",
            name.len()
        ));
    }
    if name.contains('\0') {
        return refuse("it contains a NUL character, which PostgreSQL text cannot hold");
    }
    Ok(())
}

/// A random 64-bit number (thread-local generator of the `rand` crate,
/// already in the tree through tokio-postgres): for jitter, lease tokens and
/// node-id suffixes.
pub(crate) fn random_u64() -> u64 {
    rand::random()
}

/// `<hostname>-<pid>-<8 hex digits>`.
pub(crate) fn default_node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    let host: String = host.chars().take(64).collect();
    format!("{host}-{}-{:08x}", std::process::id(), random_u64() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_node_ids_are_unique_per_call_and_not_the_host_name() {
        let a = default_node_id();
        let b = default_node_id();
        assert_ne!(a, b);
        assert!(a.contains(&format!("-{}-", std::process::id())), "{a}");
        validate_name("node id", &a).unwrap();
    }

    #[test]
    fn names_are_validated() {
        assert!(validate_name("role", "").is_err());
        assert!(validate_name("role", "a\0b").is_err());
        assert!(validate_name("role", &"x".repeat(MAX_ROLE_BYTES + 1)).is_err());
        validate_name("role", &"x".repeat(MAX_ROLE_BYTES)).unwrap();
        validate_name("role", "scheduler:eu-1 ✓").unwrap();
    }

    #[test]
    fn a_default_node_id_begins_with_the_host_name() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().chars().take(64).collect::<String>())
            .unwrap_or_default();
        if host.is_empty() {
            return; // no host name to find: nothing to compare with
        }
        let id = default_node_id();
        assert!(id.starts_with(&format!("{host}-")), "{id} (host {host})");
    }

    #[test]
    fn backend_names_round_trip() {
        assert_eq!(Backend::Session.as_str(), "session");
        assert_eq!(Backend::Lease.as_str(), "lease");
        for b in [Backend::Session, Backend::Lease] {
            assert_eq!(b.to_string(), b.as_str());
            assert_eq!(b.as_str().parse::<Backend>().unwrap(), b);
        }
        for bad in ["", "Session", "zookeeper"] {
            assert!(bad.parse::<Backend>().is_err(), "{bad:?} accepted");
        }
    }

    fn options(url: &str) -> ConnectOptions {
        ConnectOptions::from_url(url).unwrap()
    }

    fn shared(o: &ConnectOptions) -> SharedConnection {
        SharedConnection::new(o, TcpTimeouts::for_ttl(Duration::from_secs(15)))
    }

    #[test]
    fn a_shared_connection_turns_a_blocking_standby_into_a_polling_one() {
        let o = options("postgres://app@db/app");
        let c = shared(&o);
        let s = SessionOptions::new().shared_connection(&c);
        assert_eq!(
            s.standby,
            StandbyMode::Polling {
                interval: Duration::from_secs(1)
            }
        );
        assert_eq!(s.tcp, Some(c.tcp_timeouts()));
        let chosen = StandbyMode::Polling {
            interval: Duration::from_millis(300),
        };
        let s = SessionOptions::new().standby(chosen).shared_connection(&c);
        assert_eq!(s.standby, chosen, "a chosen polling interval is kept");
    }

    /// The error `build()` returns, which must be a configuration error.
    fn refusal(b: ElectorBuilder) -> ConfigError {
        match b.build() {
            Err(Error::Config(c)) => c,
            Err(e) => panic!("not a configuration error: {e}"),
            Ok(_) => panic!("accepted"),
        }
    }

    /// What `build()` refuses on a shared connection, each next to the
    /// same builder that it accepts.
    #[test]
    fn build_refuses_what_a_shared_connection_cannot_carry() {
        let o = options("postgres://app@db/app");
        let c = shared(&o);
        let on = |o: &ConnectOptions, role: &str, s: SessionOptions| {
            ElectorBuilder::new(o.clone(), role).backend(s.shared_connection(&c))
        };
        let _ok = on(&o, "ok", SessionOptions::new())
            .build()
            .expect("a polling session-backend candidate fits");
        assert!(matches!(
            refusal(on(&o, "ok", SessionOptions::new())),
            ConfigError::RoleAlreadyShared { role, .. } if role == "ok"
        ));
        assert_eq!(
            refusal(
                ElectorBuilder::new(o.clone(), "a").backend(
                    SessionOptions::new()
                        .shared_connection(&c)
                        .standby(StandbyMode::Blocking)
                )
            ),
            ConfigError::SharedConnectionBlocking
        );
        let other_tcp = TcpTimeouts {
            user_timeout: Duration::from_secs(30),
            ..TcpTimeouts::for_ttl(Duration::from_secs(15))
        };
        assert_eq!(
            refusal(on(&o, "a", SessionOptions::new().tcp_timeouts(other_tcp))),
            ConfigError::SharedConnectionTcp {
                elector: other_tcp,
                connection: c.tcp_timeouts()
            }
        );
        for other in [
            options("postgres://app@other/app"),
            o.clone().schema("other").unwrap(),
        ] {
            let e = refusal(on(&other, "a", SessionOptions::new()));
            assert!(matches!(e, ConfigError::SharedTargetMismatch { .. }), "{e}");
            assert!(e.to_string().contains("must match"), "{e}");
        }
    }

    /// What `build()` refuses on a shared lease client, each next to the
    /// same builder that it accepts.
    #[test]
    fn build_refuses_what_a_shared_lease_client_cannot_carry() {
        let o = options("postgres://app@db/app");
        let c = SharedLease::new(&o);
        let on = |o: &ConnectOptions, role: &str, l: LeaseOptions| {
            ElectorBuilder::new(o.clone(), role).backend(l.shared_lease(&c))
        };
        let first = on(&o, "ok", LeaseOptions::new())
            .build()
            .expect("a lease-backend candidate fits");
        let e = refusal(on(&o, "ok", LeaseOptions::new()));
        assert!(e.to_string().contains("already has a candidate"), "{e}");
        drop(first);
        let _again = on(&o, "ok", LeaseOptions::new())
            .build()
            .expect("the role is free again once the first elector is gone");
        assert_eq!(
            refusal(on(&o, "a", LeaseOptions::new().listen_via(o.clone()))),
            ConfigError::ListenViaOnSharedLease
        );
        for other in [
            options("postgres://app@other/app"),
            o.clone().schema("other").unwrap(),
        ] {
            let e = refusal(on(&other, "a", LeaseOptions::new()));
            assert!(matches!(e, ConfigError::SharedTargetMismatch { .. }), "{e}");
        }
    }

    #[test]
    fn build_refuses_a_listener_on_another_schema() {
        let o = options("postgres://app@db/app");
        ElectorBuilder::new(o.clone(), "r")
            .backend(LeaseOptions::new().listen_via(o.clone()))
            .build()
            .expect("the same schema");
        let e = refusal(
            ElectorBuilder::new(o.clone(), "r")
                .backend(LeaseOptions::new().listen_via(o.schema("other").unwrap())),
        );
        assert_eq!(
            e,
            ConfigError::ListenSchemaMismatch {
                listen: "other".into(),
                elector: "pgelect".into()
            }
        );
        assert!(e.to_string().contains("listen_via"), "{e}");
    }

    /// A partition group puts its session electors on its shared
    /// connection and its lease electors on its shared lease client.
    #[test]
    fn a_partition_group_puts_each_backends_electors_on_its_shared_client() {
        let o = options("postgres://app@db/app");
        let c = shared(&o);
        let polling = Duration::from_millis(200);
        let e = ElectorBuilder::new(o.clone(), "g/0")
            .on_shared_connection(&c, polling)
            .build()
            .expect("a session-backend elector fits");
        assert_eq!(e.backend(), Backend::Session);
        let client = SharedLease::new(&o);
        let lease = ElectorBuilder::new(o, "g/1")
            .backend(Backend::Lease)
            .on_shared_lease(&client, polling)
            .build()
            .expect("a lease-backend elector fits");
        assert_eq!(lease.backend(), Backend::Lease);
    }

    /// The elector's timing refusals are typed, carrying the values.
    #[test]
    fn timing_refusals_name_the_inequality_and_its_values() {
        let o = options("postgres://app@db/app");
        let secs = Duration::from_secs;
        let e = refusal(
            ElectorBuilder::new(o.clone(), "r")
                .ttl(secs(3))
                .renew_every(secs(3)),
        );
        assert_eq!(
            e,
            ConfigError::RenewNotBelowTtl {
                renew_every: secs(3),
                ttl: secs(3)
            }
        );
        let e = refusal(
            ElectorBuilder::new(o.clone(), "r")
                .ttl(secs(2))
                .backend(LeaseOptions::new().statement_timeout(secs(2))),
        );
        assert_eq!(
            e,
            ConfigError::TimeoutNotBeforeDeadline {
                setting: Setting::StatementTimeout,
                timeout: secs(2),
                ttl: secs(2),
                safety_margin: Duration::from_millis(400)
            }
        );
        let e = refusal(
            ElectorBuilder::new(o, "r").backend(SessionOptions::new().standby(
                StandbyMode::Polling {
                    interval: Duration::ZERO,
                },
            )),
        );
        assert_eq!(
            e,
            ConfigError::Zero {
                setting: Setting::PollingInterval
            }
        );
        assert!(
            e.to_string()
                .contains("standby polling interval must be positive"),
            "{e}"
        );
    }

    #[test]
    fn the_builders_shortest_ttl_follows_the_backend() {
        let o = options("postgres://app@db/app");
        let b = ElectorBuilder::new(o, "r")
            .safety_margin(Duration::from_secs(1))
            .renew_every(Duration::from_millis(10));
        // Session: the heartbeat timeout ttl / 15 under ttl - 1 s; lease:
        // the renewal under ttl - 1 s.
        assert_eq!(b.shortest_ttl(), Some(Duration::from_millis(1_072)));
        b.clone()
            .ttl(Duration::from_millis(1_072))
            .build()
            .expect("accepted");
        let lease = b.backend(Backend::Lease);
        assert_eq!(lease.shortest_ttl(), Some(Duration::from_millis(1_011)));
        lease
            .ttl(Duration::from_millis(1_011))
            .build()
            .expect("accepted");
    }
}
