//! The typed configuration error ([`ConfigError`], carried by
//! [`Error::Config`](crate::Error::Config)) and the names of the elector's
//! settings it reports ([`Setting`]).

use std::time::Duration;

use crate::conn::TcpTimeouts;
use crate::election::Backend;

/// Where the book explains the timing rules, named in their messages.
const TIMING_CHAPTER: &str = "see the book's timing chapter, docs/src/concepts/timing.md";

/// A setting of the elector's configuration, as a [`ConfigError`] names it.
///
/// [`Setting::as_str`] is the builder method that sets it
/// (`heartbeat_timeout`); a program that takes the settings under other
/// names (the `pgelect` command's `--heartbeat-timeout`) passes its own to
/// [`ConfigError::describe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Setting {
    /// [`ElectorBuilder::ttl`](crate::ElectorBuilder::ttl).
    Ttl,
    /// [`ElectorBuilder::safety_margin`](crate::ElectorBuilder::safety_margin).
    SafetyMargin,
    /// [`ElectorBuilder::renew_every`](crate::ElectorBuilder::renew_every).
    RenewEvery,
    /// [`ElectorBuilder::check_every`](crate::ElectorBuilder::check_every).
    CheckEvery,
    /// [`SessionOptions::heartbeat`](crate::election::SessionOptions::heartbeat).
    Heartbeat,
    /// [`SessionOptions::heartbeat_timeout`](crate::election::SessionOptions::heartbeat_timeout).
    HeartbeatTimeout,
    /// [`SessionOptions::handover_delay`](crate::election::SessionOptions::handover_delay).
    HandoverDelay,
    /// [`SessionOptions::wait_slice`](crate::election::SessionOptions::wait_slice).
    WaitSlice,
    /// The `interval` of [`StandbyMode::Polling`](crate::election::StandbyMode::Polling).
    PollingInterval,
    /// `keepalive_idle` of [`SessionOptions::tcp_timeouts`](crate::election::SessionOptions::tcp_timeouts).
    TcpKeepaliveIdle,
    /// `keepalive_interval` of [`SessionOptions::tcp_timeouts`](crate::election::SessionOptions::tcp_timeouts).
    TcpKeepaliveInterval,
    /// [`LeaseOptions::statement_timeout`](crate::election::LeaseOptions::statement_timeout).
    StatementTimeout,
    /// [`LeaseOptions::retry_every`](crate::election::LeaseOptions::retry_every).
    RetryEvery,
}

impl Setting {
    /// The name of the builder method (or field) that sets it.
    pub fn as_str(self) -> &'static str {
        match self {
            Setting::Ttl => "ttl",
            Setting::SafetyMargin => "safety_margin",
            Setting::RenewEvery => "renew_every",
            Setting::CheckEvery => "check_every",
            Setting::Heartbeat => "heartbeat",
            Setting::HeartbeatTimeout => "heartbeat_timeout",
            Setting::HandoverDelay => "handover_delay",
            Setting::WaitSlice => "wait_slice",
            Setting::PollingInterval => "standby polling interval",
            Setting::TcpKeepaliveIdle => "tcp keepalive_idle",
            Setting::TcpKeepaliveInterval => "tcp keepalive_interval",
            Setting::StatementTimeout => "statement_timeout",
            Setting::RetryEvery => "retry_every",
        }
    }
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused configuration: the rule broken and the values that broke it.
///
/// The elector's rules each have a variant of their own; the timing
/// inequalities are explained in [`ElectorBuilder`](crate::ElectorBuilder)
/// and the book's timing chapter. [`ElectorBuilder::shortest_ttl`](crate::ElectorBuilder::shortest_ttl)
/// computes, from the same rules, the shortest TTL the other settings allow.
///
/// ```
/// use std::time::Duration;
/// use pgelect::election::ConfigError;
/// use pgelect::{ConnectOptions, Elector, Error};
/// let options = ConnectOptions::from_url("postgres://app@db/app").unwrap();
/// let err = Elector::builder(options, "scheduler")
///     .ttl(Duration::from_secs(3))
///     .renew_every(Duration::from_millis(2500))
///     .build()
///     .unwrap_err();
/// let Error::Config(ConfigError::RenewNotBeforeDeadline { renew_every, ttl, safety_margin }) = err
/// else { panic!("{err}") };
/// assert_eq!(renew_every, Duration::from_millis(2500));
/// assert_eq!(ttl - safety_margin, Duration::from_millis(2400));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A duration that must be positive is zero.
    Zero {
        /// Which one.
        setting: Setting,
    },
    /// A duration is longer than the longest accepted (24 h, so that
    /// deadline arithmetic cannot overflow).
    TooLong {
        /// Which one.
        setting: Setting,
        /// As given.
        value: Duration,
        /// The longest accepted.
        max: Duration,
    },
    /// `safety_margin < ttl` is broken: the local deadline `ttl -
    /// safety_margin` would not be positive.
    MarginNotBelowTtl {
        /// The safety margin.
        safety_margin: Duration,
        /// The TTL.
        ttl: Duration,
    },
    /// Session backend: `renew_every < ttl` is broken.
    RenewNotBelowTtl {
        /// The renewal interval.
        renew_every: Duration,
        /// The TTL.
        ttl: Duration,
    },
    /// `renew_every < ttl - safety_margin` is broken: a healthy leader
    /// would reach its local deadline between two renewals.
    RenewNotBeforeDeadline {
        /// The renewal interval.
        renew_every: Duration,
        /// The TTL.
        ttl: Duration,
        /// The safety margin.
        safety_margin: Duration,
    },
    /// `timeout < ttl - safety_margin` is broken for the session backend's
    /// heartbeat timeout or the lease backend's statement timeout: a stuck
    /// statement would not be given up (and retried) before the deadline.
    TimeoutNotBeforeDeadline {
        /// [`Setting::HeartbeatTimeout`] or [`Setting::StatementTimeout`].
        setting: Setting,
        /// The timeout.
        timeout: Duration,
        /// The TTL.
        ttl: Duration,
        /// The safety margin.
        safety_margin: Duration,
    },
    /// Session backend: `ttl - safety_margin < min(tcp user_timeout,
    /// keepalive_idle + keepalive_interval × keepalive_count)` is broken:
    /// the server could release a silent leader's lock before that leader's
    /// local deadline ends.
    DeadlineNotBeforeServerRelease {
        /// The TTL.
        ttl: Duration,
        /// The safety margin.
        safety_margin: Duration,
        /// The lock connection's TCP timeouts.
        tcp: TcpTimeouts,
        /// The earliest time the server may release the lock of a client
        /// gone silent, with `tcp` (keepalives counted in whole seconds).
        release: Duration,
    },
    /// Session backend: the TCP `keepalive_count` is zero.
    KeepaliveCountZero,
    /// Session backend: `handover_delay ≥ min(heartbeat +
    /// heartbeat_timeout, ttl - safety_margin)` is broken: a successor
    /// could act before a live old leader notices its dead connection.
    HandoverBelowDetection {
        /// The handover delay.
        handover_delay: Duration,
        /// The heartbeat interval.
        heartbeat: Duration,
        /// The heartbeat timeout.
        heartbeat_timeout: Duration,
        /// The TTL.
        ttl: Duration,
        /// The safety margin.
        safety_margin: Duration,
    },
    /// A backend name other than `session` or `lease`.
    UnknownBackend {
        /// The name given, escaped and shortened.
        given: String,
    },
    /// A `LISTEN` connection to another schema than the elector's (or the
    /// shared lease client's).
    ListenSchemaMismatch {
        /// The `LISTEN` connection's schema.
        listen: String,
        /// The elector's (or the client's) schema.
        elector: String,
    },
    /// Session backend: a blocking standby on a shared connection, where
    /// its wait would occupy the connection of every role.
    SharedConnectionBlocking,
    /// Session backend: TCP timeouts that differ from the shared
    /// connection's, against which the deadline must be checked.
    SharedConnectionTcp {
        /// The TCP timeouts given in the elector's options.
        elector: TcpTimeouts,
        /// The shared connection's.
        connection: TcpTimeouts,
    },
    /// A shared connection or shared lease client to another database or
    /// schema than the elector's.
    SharedTargetMismatch {
        /// `host:port/database user=NAME` of the shared client.
        shared: String,
        /// Its schema.
        shared_schema: String,
        /// The elector's target.
        elector: String,
        /// The elector's schema.
        elector_schema: String,
    },
    /// Lease backend: a `listen_via` connection of the elector's own on a
    /// shared lease client, whose one `LISTEN` connection serves all its
    /// candidates.
    ListenViaOnSharedLease,
    /// A second candidate of one role on a shared connection or lease
    /// client.
    RoleAlreadyShared {
        /// The role.
        role: String,
        /// Why one is the limit.
        why: &'static str,
    },
    /// A live leader of the role uses the other backend; all candidates of
    /// a role must use the same one.
    OtherBackendLeads {
        /// The role.
        role: String,
        /// The leader's node id, where known.
        holder: Option<String>,
        /// The backend the leader uses.
        leader: Backend,
    },
    /// A value refused outside the elector's configuration (a connection
    /// URL or TLS setting, a lock, semaphore or partition-group argument):
    /// the message names it and says what to do.
    Invalid(String),
}

impl ConfigError {
    /// The message, with the settings named by `name` instead of by
    /// [`Setting::as_str`]: for a program that takes them under other
    /// names (the `pgelect` command passes `--heartbeat-timeout` for
    /// [`Setting::HeartbeatTimeout`]). `Display` is `describe(Setting::as_str)`.
    ///
    /// ```
    /// use pgelect::election::{ConfigError, Setting};
    /// let e = ConfigError::Zero { setting: Setting::RenewEvery };
    /// assert_eq!(e.to_string(), "renew_every must be positive");
    /// let flag = |s: Setting| format!("--{}", s.as_str().replace('_', "-"));
    /// assert_eq!(e.describe(flag), "--renew-every must be positive");
    /// ```
    pub fn describe<N: std::fmt::Display>(&self, name: impl Fn(Setting) -> N) -> String {
        use Setting::*;
        let deadline = |ttl: &Duration, margin: &Duration| {
            format!(
                "the local deadline {} - {} = {:?} ({} {ttl:?}, {} {margin:?})",
                name(Ttl),
                name(SafetyMargin),
                ttl.saturating_sub(*margin),
                name(Ttl),
                name(SafetyMargin),
            )
        };
        match self {
            ConfigError::Zero { setting } => format!("{} must be positive", name(*setting)),
            ConfigError::TooLong {
                setting,
                value,
                max,
            } => format!(
                "{} {value:?} is longer than the maximum {max:?}",
                name(*setting)
            ),
            ConfigError::MarginNotBelowTtl { safety_margin, ttl } => format!(
                "{} {safety_margin:?} must be shorter than {} {ttl:?}; lower the margin or raise the ttl ({TIMING_CHAPTER})",
                name(SafetyMargin),
                name(Ttl)
            ),
            ConfigError::RenewNotBelowTtl { renew_every, ttl } => format!(
                "{} {renew_every:?} must be shorter than {} {ttl:?} ({TIMING_CHAPTER})",
                name(RenewEvery),
                name(Ttl)
            ),
            ConfigError::RenewNotBeforeDeadline {
                renew_every,
                ttl,
                safety_margin,
            } => format!(
                "{} {renew_every:?} must be shorter than {}, or a healthy leader would lose leadership between two renewals; renew more often or raise the ttl ({TIMING_CHAPTER})",
                name(RenewEvery),
                deadline(ttl, safety_margin)
            ),
            ConfigError::TimeoutNotBeforeDeadline {
                setting,
                timeout,
                ttl,
                safety_margin,
            } => format!(
                "{} {timeout:?} must be shorter than {}, so that a stuck statement is given up and retried before it; lower the timeout or raise the ttl ({TIMING_CHAPTER})",
                name(*setting),
                deadline(ttl, safety_margin)
            ),
            ConfigError::DeadlineNotBeforeServerRelease {
                ttl,
                safety_margin,
                tcp,
                release,
            } => format!(
                "{} must end before the server can release a silent client's lock, min(tcp user_timeout {:?}, keepalive_idle {}s + keepalive_interval {}s x keepalive_count {}) = {release:?}; raise the TCP timeouts or lower the ttl ({TIMING_CHAPTER})",
                deadline(ttl, safety_margin),
                tcp.user_timeout,
                tcp.keepalive_idle.as_secs().max(1),
                tcp.keepalive_interval.as_secs().max(1),
                tcp.keepalive_count,
            ),
            ConfigError::KeepaliveCountZero => "tcp keepalive_count must be at least 1".into(),
            ConfigError::HandoverBelowDetection {
                handover_delay,
                heartbeat,
                heartbeat_timeout,
                ttl,
                safety_margin,
            } => format!(
                "{} {handover_delay:?} must be at least the time a live leader may take to notice a dead lock connection, min({} {heartbeat:?} + {} {heartbeat_timeout:?}, {} - {} {:?}) = {:?}; raise it or shorten the heartbeat ({TIMING_CHAPTER})",
                name(HandoverDelay),
                name(Heartbeat),
                name(HeartbeatTimeout),
                name(Ttl),
                name(SafetyMargin),
                ttl.saturating_sub(*safety_margin),
                crate::election::worst_detection(*heartbeat, *heartbeat_timeout, *ttl, *safety_margin),
            ),
            ConfigError::UnknownBackend { given } => format!(
                "unknown election backend {given}: expected \"session\" or \"lease\""
            ),
            ConfigError::ListenSchemaMismatch { listen, elector } => format!(
                "listen_via uses schema {listen:?} but the candidates use {elector:?}; give it the same schema"
            ),
            ConfigError::SharedConnectionBlocking => "candidates on a shared connection must poll (StandbyMode::Polling): a blocking wait would occupy the connection of every role on it".into(),
            ConfigError::SharedConnectionTcp { elector, connection } => format!(
                "tcp_timeouts {elector:?} differ from the shared connection's {connection:?}; the deadline is checked against the connection's, so leave tcp_timeouts unset"
            ),
            ConfigError::SharedTargetMismatch {
                shared,
                shared_schema,
                elector,
                elector_schema,
            } => format!(
                "the shared client goes to {shared} (schema {shared_schema:?}), the elector to {elector} (schema {elector_schema:?}); they must match"
            ),
            ConfigError::ListenViaOnSharedLease => "listen_via is not used by candidates on a shared lease client: set it once on the client (SharedLease::listen_via), whose one LISTEN connection serves all its candidates".into(),
            ConfigError::RoleAlreadyShared { role, why } => format!("role {role:?} {why}"),
            ConfigError::OtherBackendLeads { role, holder, leader } => {
                let ours = match leader {
                    Backend::Session => Backend::Lease,
                    Backend::Lease => Backend::Session,
                };
                let by = holder
                    .as_deref()
                    .map(|h| format!("{h:?}, "))
                    .unwrap_or_default();
                format!(
                    "role {role:?} is held by {by}a live leader using the {leader} backend, but this candidate uses the {ours} backend: all candidates of a role must use the same backend"
                )
            }
            ConfigError::Invalid(message) => message.clone(),
        }
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe(Setting::as_str))
    }
}
