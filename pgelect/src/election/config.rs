//! The elector's configuration: a builder whose every default is documented
//! and whose `build()` checks the safety inequalities.

use std::time::Duration;

use crate::conn::{ConnectOptions, TcpTimeouts};
use crate::error::{shown, Error, Result};
use crate::key::LockKey;

use super::timing::{Profile, Timing, TimingRequest};
use super::{Elector, SharedConnection, SharedLease};

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
            other => Err(Error::config(format!(
                "unknown election backend {:?}: expected \"session\" or \"lease\"",
                shown(other)
            ))),
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
    /// [`ElectorBuilder::shared_connection`] the candidates of all roles
    /// share one connection.
    Polling {
        /// Time between attempts. Must be positive.
        interval: Duration,
    },
}

/// Builds an [`Elector`]; see [`Elector::builder`].
///
/// # Timing and the safety inequality
///
/// With the defaults (`ttl` 15 s):
///
/// | setting | default | with ttl 15 s |
/// |---|---|---|
/// | `ttl` | 15 s | 15 s |
/// | `safety_margin` | `ttl / 5` | 3 s |
/// | `renew_every` | `ttl / 3` | 5 s |
/// | `heartbeat` | `ttl / 15`, from 20 ms to 1 s | 1 s |
/// | `heartbeat_timeout` | `heartbeat` | 1 s |
/// | `handover_delay` | `min(heartbeat + heartbeat_timeout, ttl - safety_margin) + min(heartbeat_timeout, 500 ms)` | 2.5 s |
/// | `tcp_timeouts` | derived from `ttl` (below) | idle 5 s, interval 2 s, count 6, user timeout 15 s |
/// | `check_every` | `renew_every` | 5 s |
/// | `wait_slice` | 20 s | 20 s |
///
/// A leader's **local deadline** is `ttl - safety_margin` (12 s) after the
/// *sending* of its last successful renewal, on the monotonic clock; when it
/// passes, leadership is cancelled whether or not the database answers.
/// `build()` enforces, and rejects with [`Error::Config`] naming the values:
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
///    with the defaults) before its deadline.
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
/// [`Profile::Fast`] sets 20 ms / 25 ms / 70 ms whatever the TTL.
///
/// # The lease backend's inequalities
///
/// With [`Backend::Lease`] the same `ttl`, `safety_margin` and `renew_every`
/// (same defaults: 15 s, 3 s, 5 s) apply, plus `retry_every` (1 s) and
/// `heartbeat_timeout` (1 s), which bounds every lease statement (and the
/// reconnection before it). `build()` enforces:
///
/// 1. `ttl - safety_margin < ttl`: the local deadline (12 s after the
///    *sending* of the last successful renewal) ends before the lease on the
///    server (`now() + ttl` when the server *ran* that renewal, later) does.
/// 2. `renew_every < ttl - safety_margin` (5 s < 12 s): a healthy leader
///    renews before its deadline, with time for retries.
/// 3. `heartbeat_timeout < ttl - safety_margin`: a stuck statement is given
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
/// ([`Leadership::fence`](crate::Leadership::fence)), which the takeover's
/// term bump defeats.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ElectorBuilder {
    options: ConnectOptions,
    role: String,
    node_id: Option<String>,
    timing: TimingRequest,
    standby: StandbyMode,
    meta: Option<serde_json::Value>,
    backend: Backend,
    listen_via: Option<ConnectOptions>,
    shared_connection: Option<SharedConnection>,
    shared_lease: Option<SharedLease>,
    priority: i32,
}

impl ElectorBuilder {
    pub(crate) fn new(options: ConnectOptions, role: &str) -> ElectorBuilder {
        ElectorBuilder {
            options,
            role: role.to_owned(),
            node_id: None,
            timing: TimingRequest::default(),
            standby: StandbyMode::default(),
            meta: None,
            backend: Backend::default(),
            listen_via: None,
            shared_connection: None,
            shared_lease: None,
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
    /// [`LossReason::HandedOver`](crate::election::LossReason::HandedOver): the
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

    /// The election mechanism. Default: [`Backend::Session`]. All
    /// candidates of a role must use the same one.
    ///
    /// With [`Backend::Lease`] the timing is checked against the lease
    /// backend's inequalities (see [`ElectorBuilder`]); `handover_delay`,
    /// `heartbeat`, `tcp_timeouts` and `standby` do not apply and are
    /// ignored, and `heartbeat_timeout` bounds every lease statement.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Lease backend: the longest a standby sleeps between two attempts to
    /// take the lease. A standby normally sleeps exactly until the lease's
    /// server-reported expiry plus a jitter of at most 50 ms (ttl/20 below a
    /// 1 s TTL); this caps that
    /// sleep, and so bounds how late a standby without a
    /// [`listen_via`](ElectorBuilder::listen_via) connection notices a
    /// voluntary release. Default: `1s`.
    pub fn retry_every(mut self, every: Duration) -> Self {
        self.timing.retry_every = Some(every);
        self
    }

    /// Lease backend: a connection that bypasses the pooler (directly to
    /// PostgreSQL, or through a session-mode pool), used only to `LISTEN`.
    /// With it, standbys wake up on a leader's release `NOTIFY` (a voluntary
    /// release is taken over in milliseconds instead of within
    /// [`retry_every`](ElectorBuilder::retry_every)), and a leader hears
    /// [`request_resign`](crate::admin::request_resign) at once instead of at its
    /// next renewal. Losing this connection never affects leadership; it is
    /// reopened with backoff. Default: none (`LISTEN` through a transaction
    /// pooler does not work).
    pub fn listen_via(mut self, options: ConnectOptions) -> Self {
        self.listen_via = Some(options);
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

    /// Lease time to live. Default: `15s`.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.timing.ttl = Some(ttl);
        self
    }

    /// How much earlier than the lease the local deadline ends. Default:
    /// `ttl / 5`.
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.timing.safety_margin = Some(margin);
        self
    }

    /// Time between renewals. Default: `ttl / 3`.
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.timing.renew_every = Some(every);
        self
    }

    /// Wait after an unclean takeover before acting. Default:
    /// `min(heartbeat + heartbeat_timeout, ttl - safety_margin) +
    /// min(heartbeat_timeout, 500ms)` (`2.5s` with the other defaults,
    /// 400 ms with a TTL of 2 s, 70 ms in [`Profile::Fast`]); values below
    /// `min(heartbeat + heartbeat_timeout, ttl - safety_margin)` are
    /// rejected.
    pub fn handover_delay(mut self, delay: Duration) -> Self {
        self.timing.handover_delay = Some(delay);
        self
    }

    /// How the timing settings not set explicitly are derived: the
    /// [`Profile::Standard`] default follows the TTL; [`Profile::Fast`]
    /// brings the session backend's crash failover under 100 ms for about
    /// 50 heartbeats per second per leader. Explicit settings win; the
    /// inequalities are checked the same way.
    ///
    /// ```
    /// # fn f(options: pgelect::ConnectOptions) -> pgelect::Result<()> {
    /// use pgelect::{Elector, election::Profile};
    /// let elector = Elector::builder(options, "scheduler")
    ///     .profile(Profile::Fast)
    ///     .build()?;
    /// assert_eq!(elector.handover_delay(), std::time::Duration::from_millis(70));
    /// # Ok(()) }
    /// ```
    pub fn profile(mut self, profile: Profile) -> Self {
        self.timing.profile = profile;
        self
    }

    /// Time between heartbeats (`SELECT 1`) on the lock connection while
    /// leading, backing up the push detection of a closed socket. Default:
    /// `ttl / 15`, between 20 ms and 1 s (1 s at the default TTL; 20 ms in
    /// [`Profile::Fast`]).
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.timing.heartbeat = Some(every);
        self
    }

    /// How long a heartbeat or renewal may take before the lock connection
    /// is declared dead and dropped. Default: the heartbeat interval
    /// (`1s` at the default TTL; 25 ms in [`Profile::Fast`]).
    ///
    /// Lease backend: the bound on a leader's renewal and release; one that
    /// runs out is cancelled, its connection dropped, and it is retried
    /// within the deadline budget. Connecting and a standby's attempt may
    /// take up to `max(heartbeat_timeout, 2s)` (no risk: the deadline counts
    /// from before the connection, and a standby holds nothing). Default:
    /// `min(1s, (ttl - safety_margin) / 4)`.
    pub fn heartbeat_timeout(mut self, timeout: Duration) -> Self {
        self.timing.heartbeat_timeout = Some(timeout);
        self
    }

    /// How often a standby reads the lease row (for [`Elector::watch`] and to
    /// preempt a leader whose lease expired). Default: `renew_every`.
    pub fn check_every(mut self, every: Duration) -> Self {
        self.timing.check_every = Some(every);
        self
    }

    /// Session backend: how long one slice of a blocking standby's lock
    /// wait lasts before it is issued again. Default: 20 s.
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
    pub fn wait_slice(mut self, slice: Duration) -> Self {
        self.timing.wait_slice = Some(slice);
        self
    }

    /// Session backend: stand on `connection`, shared with the candidates of
    /// other roles, instead of on a connection of this candidate's own (see
    /// [`SharedConnection`]). Sets the standby mode to
    /// [`StandbyMode::Polling`] every second unless a polling interval was
    /// chosen, and the TCP timeouts to the connection's (`build()` refuses
    /// a blocking standby, other TCP timeouts, the lease backend, and a
    /// second candidate of the same role on the connection).
    pub fn shared_connection(mut self, connection: &SharedConnection) -> Self {
        if self.standby == StandbyMode::Blocking {
            self.standby = StandbyMode::Polling {
                interval: Duration::from_secs(1),
            };
        }
        if self.timing.tcp.is_none() {
            self.timing.tcp = Some(connection.tcp_timeouts());
        }
        self.shared_connection = Some(connection.clone());
        self
    }

    /// Lease backend: send this candidate's statements over `client`,
    /// batched with those of the candidates of other roles, instead of over
    /// a connection of its own (see [`SharedLease`]). `build()` refuses it
    /// for the session backend, with a `listen_via` connection of the
    /// elector's own (set it on the client:
    /// [`SharedLease::listen_via`]), for another database or schema, and
    /// for a second candidate of the same role on the client.
    ///
    /// ```
    /// use pgelect::{election::Backend, ConnectOptions, Elector, election::SharedLease};
    /// let options = ConnectOptions::from_url("postgres://app@db/app").unwrap();
    /// let client = SharedLease::new(&options);
    /// let elector = Elector::builder(options.clone(), "shard-1")
    ///     .backend(Backend::Lease)
    ///     .shared_lease(&client)
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(elector.backend(), Backend::Lease);
    /// // One candidate per role on a client.
    /// let err = Elector::builder(options, "shard-1")
    ///     .backend(Backend::Lease)
    ///     .shared_lease(&client)
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("already has a candidate"), "{err}");
    /// ```
    pub fn shared_lease(mut self, client: &SharedLease) -> Self {
        self.shared_lease = Some(client.clone());
        self
    }

    /// How a standby waits. Default: [`StandbyMode::Blocking`].
    pub fn standby(mut self, mode: StandbyMode) -> Self {
        self.standby = mode;
        self
    }

    /// TCP timeouts of the lock connection, on both ends. Default: derived
    /// from the TTL — `TCP_USER_TIMEOUT = ttl`, `keepalive_idle = ttl/3`,
    /// `keepalive_interval = ttl/6` and enough probes for the keepalive path
    /// to outlast `ttl` (whole seconds, at least 1).
    pub fn tcp_timeouts(mut self, tcp: TcpTimeouts) -> Self {
        self.timing.tcp = Some(tcp);
        self
    }

    /// JSON stored as `holder_meta` in the lease row while this candidate
    /// leads (an address, a version). Default: none.
    pub fn meta(mut self, meta: serde_json::Value) -> Self {
        self.meta = Some(meta);
        self
    }

    /// Validates everything and builds the elector. Opens no connection.
    ///
    /// Fails with [`Error::InvalidName`] for an empty role or node id, one
    /// with a NUL character or longer than [`MAX_ROLE_BYTES`], and with
    /// [`Error::Config`] naming the values for timing that breaks the safety
    /// inequalities (see [`ElectorBuilder`]).
    pub fn build(self) -> Result<Elector> {
        validate_name("role", &self.role)?;
        let node = match self.node_id {
            Some(n) => {
                validate_name("node id", &n)?;
                n
            }
            None => default_node_id(),
        };
        let timing: Timing = match self.backend {
            Backend::Session => self.timing.validate(),
            Backend::Lease => self.timing.validate_lease(),
        }
        .map_err(Error::Config)?;
        if let Some(listen) = &self.listen_via {
            if listen.schema_name() != self.options.schema_name() {
                return Err(Error::config(format!(
                    "listen_via uses schema {:?} but the elector uses {:?}; they must match",
                    listen.schema_name().as_str(),
                    self.options.schema_name().as_str()
                )));
            }
        }
        if let StandbyMode::Polling { interval } = self.standby {
            if interval.is_zero() {
                return Err(Error::config("standby polling interval must be positive"));
            }
        }
        let claim = match &self.shared_connection {
            None => None,
            Some(c) => {
                if self.backend != Backend::Session {
                    return Err(Error::config(
                        "a shared connection is for the session backend; lease-backend candidates hold no connection while standing",
                    ));
                }
                if self.standby == StandbyMode::Blocking {
                    return Err(Error::config(
                        "candidates on a shared connection must poll (StandbyMode::Polling): a blocking wait would occupy the connection of every role on it",
                    ));
                }
                if self.timing.tcp != Some(c.tcp_timeouts()) {
                    return Err(Error::config(format!(
                        "tcp_timeouts {:?} differ from the shared connection's {:?}; the deadline is checked against the connection's",
                        self.timing.tcp,
                        c.tcp_timeouts()
                    )));
                }
                if c.options().target() != self.options.target()
                    || c.options().schema_name() != self.options.schema_name()
                {
                    return Err(Error::config(format!(
                        "the shared connection goes to {} (schema {:?}), the elector to {} (schema {:?}); they must match",
                        c.options().target(),
                        c.options().schema_name().as_str(),
                        self.options.target(),
                        self.options.schema_name().as_str()
                    )));
                }
                Some(c.claim(&self.role)?)
            }
        };
        let lease_claim = match &self.shared_lease {
            None => None,
            Some(c) => {
                if self.backend != Backend::Lease {
                    return Err(Error::config(
                        "a shared lease client is for the lease backend; use a shared connection (ElectorBuilder::shared_connection) for the session backend",
                    ));
                }
                if self.listen_via.is_some() {
                    return Err(Error::config(
                        "listen_via is not used by candidates on a shared lease client: set it once on the client (SharedLease::listen_via), whose one LISTEN connection serves all its candidates",
                    ));
                }
                if c.options().target() != self.options.target()
                    || c.options().schema_name() != self.options.schema_name()
                {
                    return Err(Error::config(format!(
                        "the shared lease client goes to {} (schema {:?}), the elector to {} (schema {:?}); they must match",
                        c.options().target(),
                        c.options().schema_name().as_str(),
                        self.options.target(),
                        self.options.schema_name().as_str()
                    )));
                }
                Some(c.claim(&self.role)?)
            }
        };
        let key = role_key(self.options.schema_name().as_str(), &self.role);
        Ok(Elector::from_parts(
            self.priority,
            self.options,
            self.role,
            node,
            key,
            timing,
            self.standby,
            self.meta,
            self.backend,
            self.listen_via,
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
        let b = ElectorBuilder::new(o.clone(), "r").shared_connection(&c);
        assert_eq!(
            b.standby,
            StandbyMode::Polling {
                interval: Duration::from_secs(1)
            }
        );
        assert_eq!(b.timing.tcp, Some(c.tcp_timeouts()));
        let chosen = StandbyMode::Polling {
            interval: Duration::from_millis(300),
        };
        let b = ElectorBuilder::new(o, "r")
            .standby(chosen)
            .shared_connection(&c);
        assert_eq!(b.standby, chosen, "a chosen polling interval is kept");
    }

    /// What `build()` refuses on a shared connection, each next to the
    /// same builder that it accepts.
    #[test]
    fn build_refuses_what_a_shared_connection_cannot_carry() {
        let o = options("postgres://app@db/app");
        let c = shared(&o);
        let refused = |b: ElectorBuilder, needle: &str| {
            let e = b.build().expect_err("accepted");
            assert!(
                matches!(e, Error::Config(_)) && e.to_string().contains(needle),
                "{e}"
            );
        };
        let _ok = ElectorBuilder::new(o.clone(), "ok")
            .shared_connection(&c)
            .build()
            .expect("a polling session-backend candidate fits");
        refused(
            ElectorBuilder::new(o.clone(), "a")
                .backend(Backend::Lease)
                .shared_connection(&c),
            "session backend",
        );
        refused(
            ElectorBuilder::new(o.clone(), "a")
                .shared_connection(&c)
                .standby(StandbyMode::Blocking),
            "must poll",
        );
        let other_tcp = TcpTimeouts {
            user_timeout: Duration::from_secs(30),
            ..TcpTimeouts::for_ttl(Duration::from_secs(15))
        };
        refused(
            ElectorBuilder::new(o.clone(), "a")
                .tcp_timeouts(other_tcp)
                .shared_connection(&c),
            "tcp_timeouts",
        );
        refused(
            ElectorBuilder::new(options("postgres://app@other/app"), "a").shared_connection(&c),
            "must match",
        );
        refused(
            ElectorBuilder::new(o.clone().schema("other").unwrap(), "a").shared_connection(&c),
            "must match",
        );
    }

    /// What `build()` refuses on a shared lease client, each next to the
    /// same builder that it accepts.
    #[test]
    fn build_refuses_what_a_shared_lease_client_cannot_carry() {
        let o = options("postgres://app@db/app");
        let c = SharedLease::new(&o);
        let lease = |role: &str| ElectorBuilder::new(o.clone(), role).backend(Backend::Lease);
        let refused = |b: ElectorBuilder, needle: &str| {
            let e = b.build().expect_err("accepted");
            assert!(
                matches!(e, Error::Config(_)) && e.to_string().contains(needle),
                "{e}"
            );
        };
        let first = lease("ok")
            .shared_lease(&c)
            .build()
            .expect("a lease-backend candidate fits");
        refused(lease("ok").shared_lease(&c), "already has a candidate");
        drop(first);
        let _again = lease("ok")
            .shared_lease(&c)
            .build()
            .expect("the role is free again once the first elector is gone");
        refused(
            ElectorBuilder::new(o.clone(), "a").shared_lease(&c),
            "lease backend",
        );
        refused(
            lease("a").listen_via(o.clone()).shared_lease(&c),
            "listen_via",
        );
        refused(
            ElectorBuilder::new(options("postgres://app@other/app"), "a")
                .backend(Backend::Lease)
                .shared_lease(&c),
            "must match",
        );
        refused(
            ElectorBuilder::new(o.clone().schema("other").unwrap(), "a")
                .backend(Backend::Lease)
                .shared_lease(&c),
            "must match",
        );
    }

    #[test]
    fn build_refuses_a_listener_on_another_schema() {
        let o = options("postgres://app@db/app");
        ElectorBuilder::new(o.clone(), "r")
            .listen_via(o.clone())
            .build()
            .expect("the same schema");
        let e = ElectorBuilder::new(o.clone(), "r")
            .listen_via(o.schema("other").unwrap())
            .build()
            .expect_err("accepted");
        assert!(e.to_string().contains("listen_via"), "{e}");
    }
}
