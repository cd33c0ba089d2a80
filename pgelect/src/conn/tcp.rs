//! TCP timeouts on both ends of a connection that waits for or holds
//! locks: how soon each end declares a silent peer gone.

use std::time::Duration;

use tokio_postgres::Config;

/// TCP timeouts applied on both ends of a lock-holding connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpTimeouts {
    /// Idle time before the first keepalive probe. Default: `5s`.
    pub keepalive_idle: Duration,
    /// Time between probes. Default: `2s`.
    pub keepalive_interval: Duration,
    /// Unanswered probes before the peer is declared gone. Default: `3`.
    pub keepalive_count: u32,
    /// Longest time sent data may stay unacknowledged (`TCP_USER_TIMEOUT`).
    /// Default: `10s`.
    pub user_timeout: Duration,
}

impl Default for TcpTimeouts {
    fn default() -> Self {
        TcpTimeouts {
            keepalive_idle: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(2),
            keepalive_count: 3,
            user_timeout: Duration::from_secs(10),
        }
    }
}

impl TcpTimeouts {
    /// The timeouts an elector of this `ttl` sets on a connection of its
    /// own: the server can declare a silent client gone no sooner than the
    /// TTL (`TCP_USER_TIMEOUT` = `ttl`, keepalives ending after it), which
    /// the safety inequalities need. Give them to a [`SharedConnection`]
    /// whose candidates use this TTL; [`TcpTimeouts::default`] (10 s) suits
    /// TTLs up to about 12 s only.
    ///
    /// [`SharedConnection`]: crate::election::SharedConnection
    ///
    /// ```
    /// use std::time::Duration;
    /// use pgelect::{ConnectOptions, Elector, election::SharedConnection, conn::TcpTimeouts};
    /// # fn main() -> pgelect::Result<()> {
    /// let options = ConnectOptions::from_url("postgres://app@db/app")?;
    /// let ttl = Duration::from_secs(15);
    /// let shared = SharedConnection::new(&options, TcpTimeouts::for_ttl(ttl));
    /// let elector = Elector::builder(options, "shard-1")
    ///     .ttl(ttl)
    ///     .shared_connection(&shared)
    ///     .build()?;
    /// # drop(elector);
    /// # Ok(()) }
    /// ```
    pub fn for_ttl(ttl: Duration) -> TcpTimeouts {
        // Server-side keepalive settings have whole-second granularity, so
        // the keepalive path is computed in whole seconds and always ends
        // after `ttl`; `TCP_USER_TIMEOUT` (milliseconds) is exactly `ttl`.
        let t = ttl.as_secs_f64().ceil().max(1.0) as u64;
        let idle = (t / 3).max(1);
        let interval = (t / 6).max(1);
        // Probes needed so that idle + interval * count > t.
        let count = ((t.saturating_sub(idle)) / interval + 1).max(1);
        TcpTimeouts {
            keepalive_idle: Duration::from_secs(idle),
            keepalive_interval: Duration::from_secs(interval),
            keepalive_count: count.min(u32::MAX as u64) as u32,
            user_timeout: ttl,
        }
    }

    /// The longest time either end can take to declare a silent peer gone:
    /// the larger of the keepalive path and the user timeout.
    pub fn detection_bound(&self) -> Duration {
        let keepalive = self.keepalive_idle + self.keepalive_interval * self.keepalive_count;
        keepalive.max(self.user_timeout)
    }

    /// Applies the client-side half to a driver configuration.
    pub(crate) fn apply_client(&self, config: &mut Config) {
        config
            .keepalives(true)
            .keepalives_idle(self.keepalive_idle)
            .keepalives_interval(self.keepalive_interval)
            .keepalives_retries(self.keepalive_count)
            .tcp_user_timeout(self.user_timeout);
    }
}
