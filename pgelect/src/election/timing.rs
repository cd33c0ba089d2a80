//! Timing rules: defaults, the safety inequalities an elector's timing
//! must satisfy, and the arithmetic they rest on (pure: no I/O, no clock).

use std::time::Duration;

use crate::conn::probe::{ELECTOR_HEARTBEAT, ELECTOR_HEARTBEAT_TIMEOUT, ELECTOR_WAIT_SLICE};
use crate::conn::TcpTimeouts;
use crate::election::config_error::{ConfigError, Setting};

/// The longest TTL accepted, so that deadline arithmetic cannot overflow.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// The most slack added on top of the worst-case detection time when the
/// handover delay is derived (the slack is `heartbeat_timeout`, capped
/// here): it covers the old leader's last answer being longer in flight
/// than the successor's grant, and scheduling delays of its runtime.
pub(crate) const HANDOVER_SLACK: Duration = Duration::from_millis(500);

/// How the timing settings left unset are derived.
///
/// Whatever the profile, `build()` checks the same inequalities, and any
/// setting given explicitly wins over the profile's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Profile {
    /// Follows the TTL: `heartbeat = heartbeat_timeout = ttl / 15` (at
    /// least 20 ms, at most 1 s) and `handover_delay = heartbeat +
    /// heartbeat_timeout + min(heartbeat_timeout, 500 ms)`: 2.5 s at the
    /// default TTL of 15 s, 400 ms at a TTL of 2 s. The lock connection
    /// carries about `1 / heartbeat` statements per second while leading
    /// (1 at the default TTL).
    #[default]
    Standard,
    /// The shortest crash failover the session backend offers: heartbeats
    /// every 20 ms on the lock connection, each answered within 25 ms, so
    /// a successor waits only 70 ms after an unclean takeover. Costs about
    /// 50 statements per second per leader, and a heartbeat answered later
    /// than 25 ms (a stalled server, a congested network) ends leadership —
    /// safely, but often, where such stalls are common. The TTL (partition
    /// detection) is not changed. Session backend only.
    Fast,
}

impl Profile {
    /// The name used in logs, `pgelect status` and the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Standard => "standard",
            Profile::Fast => "fast",
        }
    }

    /// The profile's heartbeat interval and heartbeat timeout for `ttl`.
    fn heartbeat(self, ttl: Duration) -> (Duration, Duration) {
        match self {
            Profile::Standard => {
                // Whole milliseconds: shown in logs and status.
                let every = Duration::from_millis((ttl / 15).as_millis() as u64)
                    .clamp(Duration::from_millis(20), ELECTOR_HEARTBEAT);
                (every, every)
            }
            Profile::Fast => (FAST_HEARTBEAT, FAST_HEARTBEAT_TIMEOUT),
        }
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Profile {
    type Err = String;

    fn from_str(s: &str) -> Result<Profile, String> {
        match s {
            "standard" => Ok(Profile::Standard),
            "fast" => Ok(Profile::Fast),
            other => Err(format!(
                "unknown timing profile {other:?}: expected `standard` or `fast`"
            )),
        }
    }
}

/// The fast profile's heartbeat interval.
pub(crate) const FAST_HEARTBEAT: Duration = Duration::from_millis(20);
/// The fast profile's heartbeat timeout.
pub(crate) const FAST_HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(25);

/// The validated timing of an elector. Built by [`Timing::validate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timing {
    pub(crate) profile: Profile,
    pub(crate) ttl: Duration,
    pub(crate) safety_margin: Duration,
    pub(crate) renew_every: Duration,
    pub(crate) heartbeat: Duration,
    pub(crate) heartbeat_timeout: Duration,
    pub(crate) handover_delay: Duration,
    pub(crate) check_every: Duration,
    pub(crate) tcp: TcpTimeouts,
    /// Lease backend: the longest a standby sleeps between two attempts.
    pub(crate) retry_every: Duration,
    /// Session backend: the length of one slice of a blocking standby's
    /// lock wait.
    pub(crate) wait_slice: Duration,
}

/// The timing as the user set it; `None` means "derive the default".
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TimingRequest {
    pub(crate) profile: Profile,
    pub(crate) ttl: Option<Duration>,
    pub(crate) safety_margin: Option<Duration>,
    pub(crate) renew_every: Option<Duration>,
    pub(crate) heartbeat: Option<Duration>,
    pub(crate) heartbeat_timeout: Option<Duration>,
    pub(crate) handover_delay: Option<Duration>,
    pub(crate) check_every: Option<Duration>,
    pub(crate) tcp: Option<TcpTimeouts>,
    pub(crate) retry_every: Option<Duration>,
    pub(crate) wait_slice: Option<Duration>,
}

/// Default TTL.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(15);
/// Default cap on a lease-backend standby's sleep between two attempts.
pub(crate) const DEFAULT_RETRY_EVERY: Duration = Duration::from_secs(1);
// The heartbeat's and the wait slice's defaults are the connection
// probe's (`conn/probe.rs`), beside a lock session's.

/// The earliest time after the last packet it received from a client at
/// which the *server* can declare that client gone and release its locks,
/// with the settings `connect_for_locks` sends (whole seconds, at least 1,
/// for the keepalive settings; `TCP_USER_TIMEOUT` in milliseconds, 0 = off).
pub(crate) fn server_release_min(tcp: &TcpTimeouts) -> Duration {
    let idle = tcp.keepalive_idle.as_secs().max(1);
    let interval = tcp.keepalive_interval.as_secs().max(1);
    let keepalive = Duration::from_secs(idle + interval * u64::from(tcp.keepalive_count));
    let user = Duration::from_millis(tcp.user_timeout.as_millis() as u64);
    if user.is_zero() {
        keepalive
    } else {
        keepalive.min(user)
    }
}

/// The longest time a live leader whose lock connection died silently (the
/// server ended it, but no FIN/RST arrived) takes to notice: the next
/// heartbeat goes out within `heartbeat` and fails within `heartbeat_timeout`;
/// in any case the local deadline (at most `ttl - margin` after the last
/// renewal was sent, which was before the server ended the connection) ends
/// leadership.
pub(crate) fn worst_detection(
    heartbeat: Duration,
    heartbeat_timeout: Duration,
    ttl: Duration,
    margin: Duration,
) -> Duration {
    (heartbeat + heartbeat_timeout).min(ttl.saturating_sub(margin))
}

impl TimingRequest {
    /// Fills the defaults and checks the safety inequalities of a backend
    /// whose lock the server releases when a connection ends (the session
    /// backend). The error text names the offending values.
    #[cfg(test)]
    pub(crate) fn validate(&self) -> Result<Timing, ConfigError> {
        self.validate_for(Takeover::OnDisconnect)
    }

    /// Fills the defaults and checks the inequalities of a backend whose
    /// lease is taken over only once it expired or was released (the lease
    /// backend): `ttl - safety_margin < ttl` (the local deadline ends
    /// before the server-side lease), `renew_every < ttl - safety_margin`
    /// and the statement timeout (`heartbeat_timeout`) `< ttl -
    /// safety_margin`.
    ///
    /// No TCP or handover constraint: a lease is taken over only once it
    /// expired on the server's clock (after the old leader's local deadline)
    /// or after a clean release, never because a connection ended. The
    /// handover delay is zero.
    #[cfg(test)]
    pub(crate) fn validate_lease(&self) -> Result<Timing, ConfigError> {
        self.validate_for(Takeover::OnExpiry)
    }

    /// The one validation: the inequalities every backend needs, then those
    /// of `takeover`.
    pub(crate) fn validate_for(&self, takeover: Takeover) -> Result<Timing, ConfigError> {
        let ttl = self.ttl.unwrap_or(DEFAULT_TTL);
        positive(Setting::Ttl, ttl)?;
        at_most(Setting::Ttl, ttl)?;
        let safety_margin = self.safety_margin.unwrap_or(ttl / 5);
        positive(Setting::SafetyMargin, safety_margin)?;
        if safety_margin >= ttl {
            return Err(ConfigError::MarginNotBelowTtl { safety_margin, ttl });
        }
        let budget = ttl - safety_margin;
        let renew_every = self.renew_every.unwrap_or(ttl / 3);
        positive(Setting::RenewEvery, renew_every)?;
        if takeover == Takeover::OnDisconnect && renew_every >= ttl {
            return Err(ConfigError::RenewNotBelowTtl { renew_every, ttl });
        }
        if renew_every >= budget {
            return Err(ConfigError::RenewNotBeforeDeadline {
                renew_every,
                ttl,
                safety_margin,
            });
        }
        // The lease backend takes no profile (it is a session option), so
        // it is always the standard one there.
        let profile = match takeover {
            Takeover::OnDisconnect => self.profile,
            Takeover::OnExpiry => Profile::Standard,
        };
        let (profile_heartbeat, profile_timeout) = profile.heartbeat(ttl);
        let heartbeat = self.heartbeat.unwrap_or(profile_heartbeat);
        positive(Setting::Heartbeat, heartbeat)?;
        let heartbeat_timeout = match takeover {
            Takeover::OnDisconnect => self.heartbeat_timeout.unwrap_or(profile_timeout),
            // The statement timeout of every lease statement: short TTLs
            // get a shorter default, so that retries fit in the budget.
            Takeover::OnExpiry => self
                .heartbeat_timeout
                .unwrap_or(ELECTOR_HEARTBEAT_TIMEOUT.min(budget / 4)),
        };
        let timeout_setting = match takeover {
            Takeover::OnDisconnect => Setting::HeartbeatTimeout,
            Takeover::OnExpiry => Setting::StatementTimeout,
        };
        positive(timeout_setting, heartbeat_timeout)?;
        if heartbeat_timeout >= budget {
            return Err(ConfigError::TimeoutNotBeforeDeadline {
                setting: timeout_setting,
                timeout: heartbeat_timeout,
                ttl,
                safety_margin,
            });
        }
        let tcp = self.tcp.unwrap_or_else(|| TcpTimeouts::for_ttl(ttl));
        let handover_delay = match takeover {
            Takeover::OnDisconnect => check_disconnect_takeover(
                self,
                ttl,
                safety_margin,
                heartbeat,
                heartbeat_timeout,
                &tcp,
            )?,
            Takeover::OnExpiry => Duration::ZERO,
        };
        let check_every = self.check_every.unwrap_or(renew_every);
        positive(Setting::CheckEvery, check_every)?;
        let retry_every = self.retry_every.unwrap_or(DEFAULT_RETRY_EVERY);
        positive(Setting::RetryEvery, retry_every)?;
        let wait_slice = self.wait_slice.unwrap_or(ELECTOR_WAIT_SLICE);
        positive(Setting::WaitSlice, wait_slice)?;
        at_most(Setting::WaitSlice, wait_slice)?;
        Ok(Timing {
            profile,
            ttl,
            safety_margin,
            renew_every,
            heartbeat,
            heartbeat_timeout,
            handover_delay,
            check_every,
            tcp,
            retry_every,
            wait_slice,
        })
    }
}

impl TimingRequest {
    /// The shortest TTL, in whole milliseconds, that
    /// [`validate_for`](TimingRequest::validate_for)`(takeover)` accepts
    /// with the other settings of `self` (its `ttl` is ignored); `None`
    /// when no TTL is accepted.
    ///
    /// Computed, not searched: every inequality that only a longer TTL can
    /// satisfy (the margin below the TTL, the renewal and the heartbeat or
    /// statement timeout below the deadline `ttl - safety_margin`, derived
    /// values being positive) gives a lower bound in closed form below.
    /// The others only a shorter TTL (or none) satisfies: an explicit
    /// handover delay or TCP timeouts the deadline must stay under, the
    /// 24 h maximum, an explicit zero. So the largest lower bound is the
    /// answer if it passes those, checked by one validation, and no TTL is
    /// accepted otherwise.
    pub(crate) fn shortest_ttl(&self, takeover: Takeover) -> Option<Duration> {
        const MS: u128 = 1_000_000;
        let ns = Duration::as_nanos;
        // The smallest t (ms) with t ms > x ns.
        let above = |x: u128| x / MS + 1;
        // The smallest t with the deadline ttl - safety_margin > x ns. A
        // derived margin is ttl / 5, exact for whole milliseconds: the
        // deadline is 800 000 t ns.
        let deadline_above = |x: u128| match self.safety_margin {
            Some(m) => above(ns(&m) + x),
            None => x / 800_000 + 1,
        };
        let mut t: u128 = 1;
        if let Some(m) = self.safety_margin {
            t = t.max(above(ns(&m)));
        }
        if takeover == Takeover::OnDisconnect {
            if let Some(r) = self.renew_every {
                t = t.max(above(ns(&r)));
            }
        }
        // renew_every < ttl - safety_margin. With a derived renewal
        // interval floor(ttl / 3) and a margin m: 2/3 ttl > m.
        t = t.max(match (self.safety_margin, self.renew_every) {
            (_, Some(r)) => deadline_above(ns(&r)),
            (Some(m), None) => 3 * ns(&m) / (2 * MS) + 1,
            (None, None) => 1,
        });
        // The heartbeat or statement timeout < ttl - safety_margin.
        t = t.max(match (takeover, self.heartbeat_timeout) {
            (_, Some(x)) => deadline_above(ns(&x)),
            (Takeover::OnDisconnect, None) => match self.profile {
                Profile::Fast => deadline_above(ns(&FAST_HEARTBEAT_TIMEOUT)),
                Profile::Standard => standard_timeout_bound(self.safety_margin),
            },
            // The derived statement timeout, min(1 s, deadline / 4), must
            // be positive: a deadline of at least 4 ns.
            (Takeover::OnExpiry, None) => match self.safety_margin {
                Some(m) => (ns(&m) + 4).div_ceil(MS),
                None => 1,
            },
        });
        let ttl = Duration::from_millis(u64::try_from(t).ok()?);
        TimingRequest {
            ttl: Some(ttl),
            ..*self
        }
        .validate_for(takeover)
        .ok()
        .map(|_| ttl)
    }
}

/// The smallest TTL `t` (ms) at which the standard profile's heartbeat
/// timeout `H(t) = clamp(floor(t / 15), 20, 1000)` ms is shorter than the
/// deadline `t - margin`. `t - H(t)` never falls as `t` grows by a
/// millisecond, so the answer is the first `t` of the first region where
/// it is reached.
fn standard_timeout_bound(margin: Option<Duration>) -> u128 {
    const MS: u128 = 1_000_000;
    let Some(m) = margin else {
        // A derived margin: the deadline 4/5 t outgrows t / 15; only the
        // 20 ms floor binds, 4/5 t > 20 ms.
        return (20 * MS) / 800_000 + 1;
    };
    // t - H(t) > m / 1 ms, i.e. t - H(t) >= n.
    let n = m.as_nanos() / MS + 1;
    // H = 20 up to t = 314.
    if n + 20 <= 314 {
        return n + 20;
    }
    // H = floor(t / 15) from 315 to 15 014: t = 15q + r gives t - H = 14q + r,
    // so 14q (r = 0) is first reached at t = 15q - 1.
    let (q, r) = (n / 14, n % 14);
    let t = if r == 0 { 15 * q - 1 } else { 15 * q + r };
    if t <= 15_014 {
        return t.max(315);
    }
    // H = 1000 beyond.
    (n + 1000).max(15_015)
}

/// What a backend's safety rests on, which decides the inequalities checked
/// beyond those every backend needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Takeover {
    /// The lock is released by the server when the holder's connection
    /// ends: the local deadline must end before the server can declare a
    /// silent client gone (TCP timeouts), and a successor waits a handover
    /// delay long enough for a live old leader to notice its dead
    /// connection.
    OnDisconnect,
    /// The lease is taken over only once it expired on the server's clock
    /// or was released: no TCP or handover constraint.
    OnExpiry,
}

/// The TCP and handover inequalities of [`Takeover::OnDisconnect`]; returns
/// the handover delay.
fn check_disconnect_takeover(
    req: &TimingRequest,
    ttl: Duration,
    safety_margin: Duration,
    heartbeat: Duration,
    heartbeat_timeout: Duration,
    tcp: &TcpTimeouts,
) -> Result<Duration, ConfigError> {
    let budget = ttl - safety_margin;
    positive(Setting::TcpKeepaliveIdle, tcp.keepalive_idle)?;
    positive(Setting::TcpKeepaliveInterval, tcp.keepalive_interval)?;
    if tcp.keepalive_count == 0 {
        return Err(ConfigError::KeepaliveCountZero);
    }
    let release = server_release_min(tcp);
    if budget >= release {
        return Err(ConfigError::DeadlineNotBeforeServerRelease {
            ttl,
            safety_margin,
            tcp: *tcp,
            release,
        });
    }
    let needed = worst_detection(heartbeat, heartbeat_timeout, ttl, safety_margin);
    let handover_delay = req
        .handover_delay
        .unwrap_or(needed + heartbeat_timeout.min(HANDOVER_SLACK));
    if handover_delay < needed {
        return Err(ConfigError::HandoverBelowDetection {
            handover_delay,
            heartbeat,
            heartbeat_timeout,
            ttl,
            safety_margin,
        });
    }
    at_most(Setting::HandoverDelay, handover_delay)?;
    Ok(handover_delay)
}

fn positive(setting: Setting, d: Duration) -> Result<(), ConfigError> {
    if d.is_zero() {
        Err(ConfigError::Zero { setting })
    } else {
        Ok(())
    }
}

fn at_most(setting: Setting, value: Duration) -> Result<(), ConfigError> {
    if value > MAX_TTL {
        Err(ConfigError::TooLong {
            setting,
            value,
            max: MAX_TTL,
        })
    } else {
        Ok(())
    }
}

impl Timing {
    /// The public view of this timing.
    pub(crate) fn report(&self) -> super::TimingReport {
        super::TimingReport {
            profile: self.profile,
            ttl: self.ttl,
            safety_margin: self.safety_margin,
            renew_every: self.renew_every,
            heartbeat: self.heartbeat,
            heartbeat_timeout: self.heartbeat_timeout,
            handover_delay: self.handover_delay,
        }
    }

    /// How long after a renewal was *sent* the leader may still act.
    pub(crate) fn deadline_budget(&self) -> Duration {
        self.ttl - self.safety_margin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn defaults_satisfy_the_safety_inequality() {
        let t = TimingRequest::default().validate().unwrap();
        assert_eq!(t.ttl, ms(15_000));
        assert_eq!(t.renew_every, ms(5_000));
        assert_eq!(t.safety_margin, ms(3_000));
        assert_eq!(t.handover_delay, ms(2_500));
        assert!(t.deadline_budget() < server_release_min(&t.tcp));
        assert!(t.deadline_budget() < t.ttl);
        assert_eq!(t.tcp.user_timeout, ms(15_000));
    }

    #[test]
    fn the_standard_profile_follows_the_ttl() {
        // (ttl, heartbeat = heartbeat_timeout, handover delay)
        for (ttl, beat, delay) in [
            (15_000, 1_000, 2_500),
            (60_000, 1_000, 2_500),
            (5_000, 333, 999),
            (2_000, 133, 399),
            (1_000, 66, 198),
            (200, 20, 60),
        ] {
            let t = TimingRequest {
                ttl: Some(ms(ttl)),
                ..Default::default()
            }
            .validate()
            .unwrap();
            assert_eq!(t.profile, Profile::Standard);
            assert_eq!(t.heartbeat.as_millis(), beat, "ttl {ttl}");
            assert_eq!(t.heartbeat_timeout.as_millis(), beat, "ttl {ttl}");
            assert_eq!(t.handover_delay.as_millis(), delay, "ttl {ttl}");
            // Never slower than the fixed 1 s / 1 s / +500 ms of before.
            assert!(t.handover_delay <= ms(2_500));
        }
    }

    #[test]
    fn the_fast_profile_waits_70ms_and_explicit_values_win() {
        let fast = |req: TimingRequest| {
            TimingRequest {
                profile: Profile::Fast,
                ..req
            }
            .validate()
        };
        let t = fast(TimingRequest::default()).unwrap();
        assert_eq!(
            (t.heartbeat, t.heartbeat_timeout, t.handover_delay),
            (ms(20), ms(25), ms(70))
        );
        assert_eq!(t.ttl, ms(15_000));
        // The same inequalities: a handover delay below detection is refused.
        let e = fast(TimingRequest {
            handover_delay: Some(ms(44)),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            e.to_string().contains("handover_delay 44ms") && e.to_string().contains("= 45ms"),
            "{e}"
        );
        let t = fast(TimingRequest {
            heartbeat: Some(ms(50)),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(t.handover_delay, ms(100));
        // The profile is a session option: the lease backend's timing is
        // the standard one whatever the request says.
        let t = TimingRequest {
            profile: Profile::Fast,
            ..Default::default()
        }
        .validate_lease()
        .unwrap();
        assert_eq!((t.profile, t.heartbeat), (Profile::Standard, ms(1_000)));
        assert_eq!("fast".parse::<Profile>(), Ok(Profile::Fast));
        assert!("quick".parse::<Profile>().unwrap_err().contains("standard"));
    }

    #[test]
    fn derived_tcp_outlasts_every_ttl() {
        for ttl_ms in [
            100, 999, 1000, 1001, 2000, 2500, 5000, 15_000, 60_000, 86_400_000,
        ] {
            let ttl = ms(ttl_ms);
            let tcp = TcpTimeouts::for_ttl(ttl);
            assert!(server_release_min(&tcp) >= ttl, "ttl {ttl:?} tcp {tcp:?}");
            let t = TimingRequest {
                ttl: Some(ttl),
                heartbeat: Some(ms(10)),
                heartbeat_timeout: Some(ms(10)),
                ..Default::default()
            };
            t.validate().unwrap();
        }
    }

    /// The exact derived settings (idle = ttl/3, interval = ttl/6, whole
    /// seconds, at least 1; just enough probes to outlast the TTL): a change
    /// of rule shows here, not only in the inequality.
    #[test]
    fn derived_tcp_timeouts_are_exact() {
        let secs = Duration::from_secs;
        for (ttl, idle, interval, count) in [
            (ms(15_000), 5, 2, 6),
            (ms(60_000), 20, 10, 5),
            (ms(7_000), 2, 1, 6),
            (ms(2_000), 1, 1, 2),
            (ms(1_500), 1, 1, 2),
            (ms(100), 1, 1, 1),
        ] {
            let tcp = TcpTimeouts::for_ttl(ttl);
            assert_eq!(
                tcp,
                TcpTimeouts {
                    keepalive_idle: secs(idle),
                    keepalive_interval: secs(interval),
                    keepalive_count: count,
                    user_timeout: ttl,
                },
                "ttl {ttl:?}"
            );
            // The keepalive path alone ends after the (whole-second) TTL.
            let t = ttl.as_secs_f64().ceil() as u64;
            assert!(idle + interval * u64::from(count) > t, "ttl {ttl:?}");
        }
    }

    /// The server's release time as PostgreSQL applies the settings:
    /// keepalives in whole seconds (at least 1), `TCP_USER_TIMEOUT` in
    /// whole milliseconds with 0 meaning off; whichever fires first.
    #[test]
    fn server_release_is_the_first_of_the_tcp_timeouts() {
        let tcp = |idle: u64, interval: u64, count: u32, user: u64| TcpTimeouts {
            keepalive_idle: ms(idle),
            keepalive_interval: ms(interval),
            keepalive_count: count,
            user_timeout: ms(user),
        };
        for (t, expected) in [
            // min(5 + 2 x 6 = 17 s, 15 s)
            (tcp(5_000, 2_000, 6, 15_000), 15_000),
            // User timeout above the keepalive path.
            (tcp(5_000, 2_000, 6, 20_000), 17_000),
            // User timeout off: the keepalive path.
            (tcp(5_000, 2_000, 6, 0), 17_000),
            // Sub-second keepalive settings count as 1 s each.
            (tcp(500, 200, 3, 0), 4_000),
            // Fractions of a second are cut, not rounded.
            (tcp(2_900, 1_900, 2, 0), 4_000),
            // One probe.
            (tcp(3_000, 4_000, 1, 100_000), 7_000),
            (tcp(1_000, 1_000, 2, 1_500), 1_500),
        ] {
            assert_eq!(server_release_min(&t), ms(expected), "{t:?}");
        }
        // Sub-millisecond user timeouts are cut to whole milliseconds.
        let mut t = tcp(5_000, 2_000, 6, 0);
        t.user_timeout = Duration::from_micros(1_500_700);
        assert_eq!(server_release_min(&t), ms(1_500));
    }

    #[test]
    fn detection_is_the_first_of_a_failed_heartbeat_and_the_deadline() {
        assert_eq!(
            worst_detection(ms(1_000), ms(1_000), ms(15_000), ms(3_000)),
            ms(2_000)
        );
        assert_eq!(
            worst_detection(ms(10_000), ms(5_000), ms(15_000), ms(3_000)),
            ms(12_000)
        );
        assert_eq!(worst_detection(ms(20), ms(25), ms(500), ms(100)), ms(45));
    }

    #[test]
    fn the_session_backend_refuses_tcp_timeouts_that_end_at_the_deadline() {
        // ttl 15 s, margin 3 s: a release at exactly 12 s is refused, at
        // 12 s + 1 ms accepted.
        let with_user = |user: u64| TimingRequest {
            tcp: Some(TcpTimeouts {
                keepalive_idle: Duration::from_secs(5),
                keepalive_interval: Duration::from_secs(2),
                keepalive_count: 6,
                user_timeout: ms(user),
            }),
            ..Default::default()
        };
        let e = with_user(12_000).validate().unwrap_err();
        assert!(
            e.to_string()
                .contains("must end before the server can release"),
            "{e}"
        );
        with_user(12_001).validate().unwrap();
        // Zero keepalive settings are named.
        let mut req = with_user(15_000);
        req.tcp.as_mut().unwrap().keepalive_count = 0;
        assert_eq!(req.validate().unwrap_err(), ConfigError::KeepaliveCountZero);
    }

    #[test]
    fn rejects_zero_and_inverted_values_naming_them() {
        let cases: Vec<(TimingRequest, &str)> = vec![
            (
                TimingRequest {
                    ttl: Some(Duration::ZERO),
                    ..Default::default()
                },
                "ttl must be positive",
            ),
            (
                TimingRequest {
                    renew_every: Some(ms(15_000)),
                    ..Default::default()
                },
                "renew_every 15s must be shorter than ttl 15s",
            ),
            (
                TimingRequest {
                    renew_every: Some(ms(12_000)),
                    ..Default::default()
                },
                "renew_every 12s",
            ),
            (
                TimingRequest {
                    heartbeat: Some(Duration::ZERO),
                    ..Default::default()
                },
                "heartbeat must be positive",
            ),
            (
                TimingRequest {
                    handover_delay: Some(ms(100)),
                    ..Default::default()
                },
                "handover_delay 100ms",
            ),
            (
                TimingRequest {
                    safety_margin: Some(ms(20_000)),
                    ..Default::default()
                },
                "safety_margin 20s",
            ),
            (
                TimingRequest {
                    tcp: Some(TcpTimeouts::default()),
                    ..Default::default()
                },
                "user_timeout 10s",
            ),
        ];
        for (req, needle) in cases {
            let e = req.validate().unwrap_err();
            assert!(e.to_string().contains(needle), "{e:?} lacks {needle:?}");
        }
    }

    #[test]
    fn lease_defaults_and_inequalities() {
        let t = TimingRequest::default().validate_lease().unwrap();
        assert_eq!(t.ttl, ms(15_000));
        assert_eq!(t.deadline_budget(), ms(12_000));
        assert_eq!(t.renew_every, ms(5_000));
        assert_eq!(t.retry_every, ms(1_000));
        assert_eq!(t.handover_delay, Duration::ZERO);
        assert_eq!(t.heartbeat_timeout, ms(1_000));
        // Short TTLs get a shorter default statement timeout.
        let t = TimingRequest {
            ttl: Some(ms(1_000)),
            ..Default::default()
        }
        .validate_lease()
        .unwrap();
        assert_eq!(t.heartbeat_timeout, ms(200));
        // No TCP constraint: TCP timeouts the session backend refuses are
        // irrelevant to a lease.
        TimingRequest {
            tcp: Some(TcpTimeouts::default()),
            ttl: Some(ms(60_000)),
            ..Default::default()
        }
        .validate_lease()
        .unwrap();
        for (req, needle) in [
            (
                TimingRequest {
                    renew_every: Some(ms(12_000)),
                    ..Default::default()
                },
                "renew_every 12s",
            ),
            (
                TimingRequest {
                    heartbeat_timeout: Some(ms(12_000)),
                    ..Default::default()
                },
                "statement_timeout",
            ),
            (
                TimingRequest {
                    retry_every: Some(Duration::ZERO),
                    ..Default::default()
                },
                "retry_every must be positive",
            ),
            (
                TimingRequest {
                    safety_margin: Some(ms(15_000)),
                    ..Default::default()
                },
                "safety_margin 15s",
            ),
        ] {
            let e = req.validate_lease().unwrap_err();
            assert!(e.to_string().contains(needle), "{e:?} lacks {needle:?}");
        }
    }

    #[test]
    fn the_bounds_are_inclusive_where_documented() {
        // The longest TTL, wait slice and handover delay are accepted, a
        // nanosecond more is not.
        let nano = Duration::from_nanos(1);
        for backend in [TimingRequest::validate, TimingRequest::validate_lease] {
            backend(&TimingRequest {
                ttl: Some(MAX_TTL),
                wait_slice: Some(MAX_TTL),
                ..Default::default()
            })
            .unwrap();
            let e = backend(&TimingRequest {
                ttl: Some(MAX_TTL + nano),
                ..Default::default()
            })
            .unwrap_err();
            assert!(
                e.to_string().contains("is longer than the maximum 86400s"),
                "{e}"
            );
            let e = backend(&TimingRequest {
                wait_slice: Some(MAX_TTL + nano),
                ..Default::default()
            })
            .unwrap_err();
            assert!(e.to_string().contains("wait_slice"), "{e}");
        }
        TimingRequest {
            ttl: Some(MAX_TTL),
            handover_delay: Some(MAX_TTL),
            ..Default::default()
        }
        .validate()
        .unwrap();
        let e = TimingRequest {
            handover_delay: Some(MAX_TTL + nano),
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("handover_delay"), "{e}");
        // A handover delay of exactly the detection bound is enough (the
        // bound is a worst case reached, not exceeded); a millisecond less
        // is refused.
        let at = |d: u64| TimingRequest {
            heartbeat: Some(ms(1000)),
            heartbeat_timeout: Some(ms(1000)),
            handover_delay: Some(ms(d)),
            ..Default::default()
        };
        assert_eq!(at(2000).validate().unwrap().handover_delay, ms(2000));
        let e = at(1999).validate().unwrap_err();
        assert!(e.to_string().contains("handover_delay 1.999s"), "{e}");
    }

    #[test]
    fn lease_statement_timeout_defaults_to_a_quarter_of_the_budget() {
        // ttl 2 s: budget 1.6 s, a quarter is 400 ms (under the 1 s cap).
        let t = TimingRequest {
            ttl: Some(ms(2000)),
            ..Default::default()
        }
        .validate_lease()
        .unwrap();
        assert_eq!(t.heartbeat_timeout, ms(400));
        assert_eq!(t.safety_margin, ms(400));
        assert_eq!(t.renew_every, Duration::from_nanos(666_666_666));
    }

    #[test]
    fn profiles_print_and_parse_and_the_report_is_the_timing() {
        for p in [Profile::Standard, Profile::Fast] {
            assert_eq!(p.to_string(), p.as_str());
            assert_eq!(p.as_str().parse::<Profile>(), Ok(p));
        }
        assert_eq!(Profile::Fast.as_str(), "fast");
        assert!("slow".parse::<Profile>().unwrap_err().contains("\"slow\""));
        let t = TimingRequest::default().validate().unwrap();
        let r = t.report();
        assert_eq!(
            (r.profile, r.ttl, r.safety_margin, r.renew_every),
            (t.profile, t.ttl, t.safety_margin, t.renew_every)
        );
        assert_eq!(
            (r.heartbeat, r.heartbeat_timeout, r.handover_delay),
            (t.heartbeat, t.heartbeat_timeout, t.handover_delay)
        );
    }

    /// Checks `shortest_ttl` against the validation it is derived from:
    /// the TTL it names is accepted and every shorter whole-millisecond
    /// TTL (a millisecond shorter first) is refused; `None` only when no
    /// TTL up to 20 s is accepted.
    fn check_shortest(req: TimingRequest, takeover: Takeover) -> Option<Duration> {
        let at = |t: u64| {
            TimingRequest {
                ttl: Some(ms(t)),
                ..req
            }
            .validate_for(takeover)
        };
        match req.shortest_ttl(takeover) {
            Some(s) => {
                let s_ms = s.as_millis() as u64;
                assert_eq!(s, ms(s_ms), "whole milliseconds");
                at(s_ms).unwrap_or_else(|e| panic!("{req:?} {takeover:?}: {s:?} refused: {e}"));
                for t in (1..s_ms).rev() {
                    assert!(
                        at(t).is_err(),
                        "{req:?} {takeover:?}: {t}ms accepted, below {s:?}"
                    );
                }
                Some(s)
            }
            None => {
                for t in 1..=20_000 {
                    assert!(
                        at(t).is_err(),
                        "{req:?} {takeover:?}: {t}ms accepted, None said"
                    );
                }
                None
            }
        }
    }

    #[test]
    fn the_shortest_ttl_is_accepted_and_a_millisecond_less_is_not() {
        use Takeover::{OnDisconnect, OnExpiry};
        // The defaults: the standard heartbeat timeout's 20 ms floor under
        // the deadline 4/5 ttl; the fast profile's 25 ms; the lease
        // backend has nothing but positive derived values.
        let default = TimingRequest::default();
        assert_eq!(check_shortest(default, OnDisconnect), Some(ms(26)));
        let fast = TimingRequest {
            profile: Profile::Fast,
            ..default
        };
        assert_eq!(check_shortest(fast, OnDisconnect), Some(ms(32)));
        assert_eq!(check_shortest(default, OnExpiry), Some(ms(1)));
        let nanos = Duration::from_nanos;
        let margins = [
            None,
            Some(ms(1)),
            Some(ms(7)),
            Some(ms(300)),
            Some(ms(3_000)),
            Some(nanos(12_345_678)),
        ];
        let renewals = [None, Some(ms(5)), Some(ms(250)), Some(nanos(4_999_999_999))];
        let timeouts = [None, Some(ms(1)), Some(ms(40)), Some(ms(1_500))];
        let mut seen = 0;
        for takeover in [OnDisconnect, OnExpiry] {
            for profile in [Profile::Standard, Profile::Fast] {
                for safety_margin in margins {
                    for renew_every in renewals {
                        for heartbeat_timeout in timeouts {
                            let req = TimingRequest {
                                profile,
                                safety_margin,
                                renew_every,
                                heartbeat_timeout,
                                ..default
                            };
                            seen += usize::from(check_shortest(req, takeover).is_some());
                        }
                    }
                }
            }
        }
        assert_eq!(seen, 2 * 2 * 6 * 4 * 4, "every combination has a TTL");
        // The standard heartbeat timeout's regions with an explicit margin:
        // its 20 ms floor, ttl / 15, its 1 s ceiling.
        for m in [100, 294, 295, 296, 307, 308, 1_000, 13_999, 14_000, 14_001] {
            let req = TimingRequest {
                safety_margin: Some(ms(m)),
                ..default
            };
            check_shortest(req, OnDisconnect).expect("a ttl");
        }
        // Settings only a shorter TTL satisfies: an explicit handover delay
        // (the detection time grows with the TTL) leaves a range, explicit
        // TCP timeouts below the heartbeat floor leave none.
        let handover = TimingRequest {
            handover_delay: Some(ms(100)),
            ..default
        };
        assert_eq!(check_shortest(handover, OnDisconnect), Some(ms(26)));
        let tight_tcp = TimingRequest {
            tcp: Some(TcpTimeouts {
                user_timeout: ms(10),
                ..TcpTimeouts::default()
            }),
            ..default
        };
        assert_eq!(check_shortest(tight_tcp, OnDisconnect), None);
        let zero = TimingRequest {
            check_every: Some(Duration::ZERO),
            ..default
        };
        assert_eq!(zero.shortest_ttl(OnDisconnect), None);
        // Pseudo-random settings (a fixed linear congruential sequence).
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |below: u64| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (x >> 33) % below
        };
        for _ in 0..300 {
            let mut maybe = |below: u64| (next(3) > 0).then(|| nanos(1 + next(below)));
            let safety_margin = maybe(4_000_000_000);
            let renew_every = maybe(4_000_000_000);
            let heartbeat = maybe(2_000_000_000);
            let heartbeat_timeout = maybe(2_000_000_000);
            let profile = if next(2) == 0 {
                Profile::Standard
            } else {
                Profile::Fast
            };
            let req = TimingRequest {
                profile,
                safety_margin,
                renew_every,
                heartbeat,
                heartbeat_timeout,
                ..default
            };
            let takeover = if next(2) == 0 { OnDisconnect } else { OnExpiry };
            check_shortest(req, takeover);
        }
    }
}
