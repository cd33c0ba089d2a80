//! The pure core of both backends: timing validation, deadline arithmetic
//! and the leader's keep-alive state machine.
//!
//! Nothing here does I/O or reads a clock. The drivers in `session.rs` and
//! `lease.rs` feed events with the monotonic time they happened at, and
//! carry out the actions the [`Keeper`] returns; unit tests feed simulated
//! time.

use std::time::Duration;

use tokio::time::Instant;

use crate::conn::TcpTimeouts;

use super::leadership::LossReason;

/// The longest TTL accepted, so that deadline arithmetic cannot overflow.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// Logs a local deadline noticed well after it passed: the process was
/// paused or starved of CPU, and may have believed it led after its lease
/// could be taken over; only fenced writes were safe meanwhile.
pub(crate) fn warn_if_late(role: &str, reason: LossReason, now: Instant, deadline: Instant) {
    let late = now.saturating_duration_since(deadline);
    if reason == LossReason::Deadline && late > Duration::from_millis(100) {
        tracing::warn!(role, late = ?late, "the local deadline was noticed late: this process was paused or starved of CPU; only fenced writes were safe in that time");
        crate::metrics::deadline_late(role, late);
    }
}

/// The least time between two renewals when an early one is asked for by a
/// hint (a resign `NOTIFY`, which anyone who can connect may send): a flood
/// of hints costs a leader at most one statement per this interval.
pub(crate) const EARLY_CHECK_GAP: Duration = Duration::from_millis(100);

/// Slack added on top of the worst-case detection time when the handover
/// delay is derived: covers scheduling delays of the old leader's runtime.
pub(crate) const HANDOVER_SLACK: Duration = Duration::from_millis(500);

/// The validated timing of an elector. Built by [`Timing::validate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timing {
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
/// Default heartbeat interval.
pub(crate) const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// Default heartbeat timeout (the lease backend's statement timeout).
pub(crate) const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(1);
/// Default cap on a lease-backend standby's sleep between two attempts.
pub(crate) const DEFAULT_RETRY_EVERY: Duration = Duration::from_secs(1);
/// Default slice of a blocking standby's lock wait.
pub(crate) const DEFAULT_WAIT_SLICE: Duration = Duration::from_secs(10);

/// The TCP timeouts used when none are given: derived from the TTL so that
/// the server cannot declare a silent client gone (and release its lock)
/// before `ttl` has passed, and not long after.
///
/// Server-side keepalive settings have whole-second granularity, so the
/// keepalive path is computed in whole seconds and always ends after `ttl`;
/// `TCP_USER_TIMEOUT` (milliseconds) is exactly `ttl`.
pub(crate) fn default_tcp_for(ttl: Duration) -> TcpTimeouts {
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
    /// Fills the defaults and checks the safety inequalities. The error text
    /// names the offending values.
    pub(crate) fn validate(&self) -> Result<Timing, String> {
        let ttl = self.ttl.unwrap_or(DEFAULT_TTL);
        positive("ttl", ttl)?;
        if ttl > MAX_TTL {
            return Err(format!(
                "ttl {ttl:?} is longer than the maximum {MAX_TTL:?}"
            ));
        }
        let safety_margin = self.safety_margin.unwrap_or(ttl / 5);
        positive("safety_margin", safety_margin)?;
        if safety_margin >= ttl {
            return Err(format!(
                "safety_margin {safety_margin:?} must be shorter than ttl {ttl:?}"
            ));
        }
        let budget = ttl - safety_margin;
        let renew_every = self.renew_every.unwrap_or(ttl / 3);
        positive("renew_every", renew_every)?;
        if renew_every >= ttl {
            return Err(format!(
                "renew_every {renew_every:?} must be shorter than ttl {ttl:?}"
            ));
        }
        if renew_every >= budget {
            return Err(format!(
                "renew_every {renew_every:?} must be shorter than the local deadline ttl - safety_margin = {budget:?} (ttl {ttl:?}, safety_margin {safety_margin:?}), or a healthy leader would lose leadership between two renewals"
            ));
        }
        let heartbeat = self.heartbeat.unwrap_or(DEFAULT_HEARTBEAT);
        positive("heartbeat", heartbeat)?;
        let heartbeat_timeout = self.heartbeat_timeout.unwrap_or(DEFAULT_HEARTBEAT_TIMEOUT);
        positive("heartbeat_timeout", heartbeat_timeout)?;
        if heartbeat_timeout >= budget {
            return Err(format!(
                "heartbeat_timeout {heartbeat_timeout:?} must be shorter than ttl - safety_margin = {budget:?}"
            ));
        }
        let tcp = self.tcp.unwrap_or_else(|| default_tcp_for(ttl));
        positive("tcp keepalive_idle", tcp.keepalive_idle)?;
        positive("tcp keepalive_interval", tcp.keepalive_interval)?;
        if tcp.keepalive_count == 0 {
            return Err("tcp keepalive_count must be at least 1".into());
        }
        let release = server_release_min(&tcp);
        if budget >= release {
            return Err(format!(
                "the local deadline ttl - safety_margin = {budget:?} (ttl {ttl:?}, safety_margin {safety_margin:?}) must end before the server can release a silent client's lock, min(tcp user_timeout {:?}, keepalive_idle {}s + keepalive_interval {}s x keepalive_count {}) = {release:?}; raise the TCP timeouts or lower the ttl",
                tcp.user_timeout,
                tcp.keepalive_idle.as_secs().max(1),
                tcp.keepalive_interval.as_secs().max(1),
                tcp.keepalive_count,
            ));
        }
        let needed = worst_detection(heartbeat, heartbeat_timeout, ttl, safety_margin);
        let handover_delay = self.handover_delay.unwrap_or(needed + HANDOVER_SLACK);
        if handover_delay < needed {
            return Err(format!(
                "handover_delay {handover_delay:?} is shorter than the time a live leader may take to notice a dead lock connection, min(heartbeat {heartbeat:?} + heartbeat_timeout {heartbeat_timeout:?}, ttl - safety_margin {budget:?}) = {needed:?}"
            ));
        }
        if handover_delay > MAX_TTL {
            return Err(format!(
                "handover_delay {handover_delay:?} is longer than the maximum {MAX_TTL:?}"
            ));
        }
        let check_every = self.check_every.unwrap_or(renew_every);
        positive("check_every", check_every)?;
        let retry_every = self.retry_every.unwrap_or(DEFAULT_RETRY_EVERY);
        positive("retry_every", retry_every)?;
        let wait_slice = self.wait_slice.unwrap_or(DEFAULT_WAIT_SLICE);
        positive("wait_slice", wait_slice)?;
        if wait_slice > MAX_TTL {
            return Err(format!(
                "wait_slice {wait_slice:?} is longer than the maximum {MAX_TTL:?}"
            ));
        }
        Ok(Timing {
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

    /// Fills the defaults and checks the lease backend's inequalities:
    /// `ttl - safety_margin < ttl` (the local deadline ends before the
    /// server-side lease), `renew_every < ttl - safety_margin` and the
    /// statement timeout (`heartbeat_timeout`) `< ttl - safety_margin`.
    ///
    /// No TCP or handover constraint: a lease is taken over only once it
    /// expired on the server's clock (after the old leader's local deadline)
    /// or after a clean release, never because a connection ended. The
    /// handover delay is zero.
    pub(crate) fn validate_lease(&self) -> Result<Timing, String> {
        let ttl = self.ttl.unwrap_or(DEFAULT_TTL);
        positive("ttl", ttl)?;
        if ttl > MAX_TTL {
            return Err(format!(
                "ttl {ttl:?} is longer than the maximum {MAX_TTL:?}"
            ));
        }
        let safety_margin = self.safety_margin.unwrap_or(ttl / 5);
        positive("safety_margin", safety_margin)?;
        if safety_margin >= ttl {
            return Err(format!(
                "safety_margin {safety_margin:?} must be shorter than ttl {ttl:?}"
            ));
        }
        let budget = ttl - safety_margin;
        let renew_every = self.renew_every.unwrap_or(ttl / 3);
        positive("renew_every", renew_every)?;
        if renew_every >= budget {
            return Err(format!(
                "renew_every {renew_every:?} must be shorter than the local deadline ttl - safety_margin = {budget:?} (ttl {ttl:?}, safety_margin {safety_margin:?}), or a healthy leader would lose leadership between two renewals"
            ));
        }
        let heartbeat = self.heartbeat.unwrap_or(DEFAULT_HEARTBEAT);
        positive("heartbeat", heartbeat)?;
        let statement_timeout = self
            .heartbeat_timeout
            .unwrap_or(DEFAULT_HEARTBEAT_TIMEOUT.min(budget / 4));
        positive("heartbeat_timeout", statement_timeout)?;
        if statement_timeout >= budget {
            return Err(format!(
                "heartbeat_timeout (the lease statement timeout) {statement_timeout:?} must be shorter than ttl - safety_margin = {budget:?}"
            ));
        }
        let check_every = self.check_every.unwrap_or(renew_every);
        positive("check_every", check_every)?;
        let retry_every = self.retry_every.unwrap_or(DEFAULT_RETRY_EVERY);
        positive("retry_every", retry_every)?;
        let wait_slice = self.wait_slice.unwrap_or(DEFAULT_WAIT_SLICE);
        positive("wait_slice", wait_slice)?;
        if wait_slice > MAX_TTL {
            return Err(format!(
                "wait_slice {wait_slice:?} is longer than the maximum {MAX_TTL:?}"
            ));
        }
        Ok(Timing {
            ttl,
            safety_margin,
            renew_every,
            heartbeat,
            heartbeat_timeout: statement_timeout,
            handover_delay: Duration::ZERO,
            check_every,
            tcp: self.tcp.unwrap_or_else(|| default_tcp_for(ttl)),
            retry_every,
            wait_slice,
        })
    }
}

fn positive(name: &str, d: Duration) -> Result<(), String> {
    if d.is_zero() {
        Err(format!("{name} must be positive, got {d:?}"))
    } else {
        Ok(())
    }
}

impl Timing {
    /// How long after a renewal was *sent* the leader may still act.
    pub(crate) fn deadline_budget(&self) -> Duration {
        self.ttl - self.safety_margin
    }
}

/// The phase of a leadership kept by a [`Keeper`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Elected (term bumped), waiting out the handover delay: the user has
    /// not been told.
    Pending,
    /// The user has been told and may act.
    Active,
    /// Leadership ended (the user's token is cancelled), but the lock is
    /// still held and renewed so that `resign` can release it cleanly.
    LameDuck,
    /// Over: the connection is to be closed or was released.
    Done,
}

/// What the driver must do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Send the renewal statement (and report its outcome with the send time).
    Renew,
    /// Send the cheap heartbeat statement.
    Heartbeat,
    /// Tell the user: leadership begins now.
    Activate,
    /// Leadership ended: cancel the user's token with this reason. When
    /// `kill` is set, drop the connection at once (the lock goes with it);
    /// otherwise keep it for a clean release.
    Lose { reason: LossReason, kill: bool },
}

/// Which statement is in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    Renew,
    Heartbeat,
}

/// The leader's keep-alive state machine (sans-IO).
///
/// Invariants: the deadline only moves forward, and only on a successful
/// renewal, to `send time + ttl - margin`; once past it, leadership is lost
/// for good, whatever answers arrive later; a loss is reported once.
#[derive(Debug)]
pub(crate) struct Keeper {
    timing: Timing,
    phase: Phase,
    deadline: Instant,
    active_at: Instant,
    next_renew: Instant,
    next_heartbeat: Instant,
    in_flight: Option<(Probe, Instant)>,
    lame_duck_until: Option<Instant>,
    reason: Option<LossReason>,
    pending_action: Option<Action>,
    /// When the renewal asked for by [`Keeper::check_requested`] is due.
    early_check: Option<Instant>,
    /// When the last renewal was sent: early checks keep their distance.
    last_renew_sent: Option<Instant>,
    /// Lease backend: no heartbeats (there is no session to keep alive), no
    /// in-flight timeout here (the driver bounds every statement and reports
    /// a failure), and a failed renewal is retried, not fatal.
    lease: bool,
}

impl Keeper {
    /// A keeper for a leadership whose term-bumping statement was sent at
    /// `sent_at` and answered at `now`. After an unclean takeover the user
    /// is told only after the handover delay, counted from `sent_at`: the
    /// old leader's connection had ended before the lock was granted, which
    /// was before `sent_at`, so the delay is still counted from a moment
    /// after the old leader's loss, and the term transaction's round trip
    /// overlaps with it instead of adding to the failover.
    pub(crate) fn new(timing: Timing, sent_at: Instant, now: Instant, unclean: bool) -> Keeper {
        let delay = if unclean {
            timing.handover_delay
        } else {
            Duration::ZERO
        };
        Keeper {
            timing,
            phase: Phase::Pending,
            deadline: sent_at + timing.deadline_budget(),
            active_at: sent_at + delay,
            next_renew: sent_at + timing.renew_every,
            next_heartbeat: now + timing.heartbeat,
            in_flight: None,
            lame_duck_until: None,
            reason: None,
            pending_action: None,
            early_check: None,
            last_renew_sent: None,
            lease: false,
        }
    }

    /// A keeper for a lease-backend leadership whose acquiring statement was
    /// sent at `sent_at`: active at once (a lease is taken over only after
    /// it expired on the server or was released), no heartbeats, renewals
    /// every `renew_every`, failures retried until the deadline.
    pub(crate) fn new_lease(timing: Timing, sent_at: Instant) -> Keeper {
        let mut k = Keeper::new(timing, sent_at, sent_at, false);
        k.lease = true;
        k
    }

    /// The current phase.
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    /// The local deadline.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The next action due at `now`, if any. Call until it returns `None`,
    /// then sleep until [`Keeper::next_wake`] or the next event.
    pub(crate) fn poll(&mut self, now: Instant) -> Option<Action> {
        if let Some(a) = self.pending_action.take() {
            return Some(a);
        }
        match self.phase {
            Phase::Done => return None,
            Phase::Pending | Phase::Active => {
                if now >= self.deadline {
                    return Some(self.lose(LossReason::Deadline, true));
                }
            }
            Phase::LameDuck => {
                if now >= self.deadline || self.lame_duck_until.is_some_and(|t| now >= t) {
                    self.phase = Phase::Done;
                    return Some(Action::Lose {
                        reason: self.reason.unwrap_or(LossReason::Deadline),
                        kill: true,
                    });
                }
            }
        }
        if let Some((_, sent)) = self.in_flight {
            if !self.lease && now >= sent + self.timing.heartbeat_timeout {
                self.in_flight = None;
                return Some(self.fail_connection());
            }
            return None;
        }
        if self.phase == Phase::Pending && now >= self.active_at {
            self.phase = Phase::Active;
            return Some(Action::Activate);
        }
        if now >= self.next_renew || self.early_check.is_some_and(|t| now >= t) {
            // Any renewal sent from now on reads the row as the hint left
            // it: it answers a pending early check too.
            self.in_flight = Some((Probe::Renew, now));
            self.early_check = None;
            self.last_renew_sent = Some(now);
            return Some(Action::Renew);
        }
        if !self.lease && now >= self.next_heartbeat {
            self.in_flight = Some((Probe::Heartbeat, now));
            return Some(Action::Heartbeat);
        }
        None
    }

    /// When the driver must call [`Keeper::poll`] again at the latest.
    pub(crate) fn next_wake(&self) -> Option<Instant> {
        if self.phase == Phase::Done {
            return None;
        }
        let mut t = self.deadline;
        match self.in_flight {
            Some((_, sent)) if !self.lease => t = t.min(sent + self.timing.heartbeat_timeout),
            Some(_) => {}
            None if self.lease => t = t.min(self.next_renew),
            None => t = t.min(self.next_renew).min(self.next_heartbeat),
        }
        if let (None, Some(e)) = (self.in_flight, self.early_check) {
            t = t.min(e);
        }
        if self.phase == Phase::Pending {
            t = t.min(self.active_at);
        }
        if let Some(l) = self.lame_duck_until {
            t = t.min(l);
        }
        Some(t)
    }

    /// The renewal sent at `sent_at` found the row still ours.
    pub(crate) fn renewed(&mut self, sent_at: Instant, now: Instant) {
        self.in_flight = None;
        if self.phase == Phase::Done {
            return;
        }
        self.next_renew = sent_at + self.timing.renew_every;
        self.next_heartbeat = now + self.timing.heartbeat;
        // A late answer never revives a leadership whose deadline passed:
        // poll() has already ended it, and Done/LameDuck stay so.
        let candidate = sent_at + self.timing.deadline_budget();
        if candidate > self.deadline && now < self.deadline {
            self.deadline = candidate;
        }
    }

    /// The renewal found no row with our holder and term: someone else leads.
    pub(crate) fn preempted(&mut self) {
        self.in_flight = None;
        self.pending_action = Some(self.lose(LossReason::Preempted, true));
    }

    /// A renewal failed with a non-connection error: not renewed, retry soon.
    pub(crate) fn renew_failed(&mut self, now: Instant) {
        self.in_flight = None;
        // Retry at the heartbeat pace; the deadline stays where it was.
        self.next_renew = now + self.timing.heartbeat.min(self.timing.renew_every);
    }

    /// Lease backend: a renewal failed (connection refused or reset, pooler
    /// restarting, statement timeout, any error but "no row"). The deadline
    /// stays where it was; the next attempt is due after `wait`, capped so
    /// that at least one more attempt is made before the deadline where
    /// there is room for it.
    pub(crate) fn renew_retry(&mut self, now: Instant, wait: Duration) {
        self.in_flight = None;
        let mut at = now + wait;
        let room = self.deadline.saturating_duration_since(now);
        // Halve the room left, but not below 10 ms (no storm of attempts
        // just before the deadline).
        if at >= self.deadline && room >= Duration::from_millis(20) {
            at = now + room / 2;
        }
        self.next_renew = at;
    }

    /// The heartbeat was answered.
    pub(crate) fn heartbeat_ok(&mut self, now: Instant) {
        self.in_flight = None;
        self.next_heartbeat = now + self.timing.heartbeat;
    }

    /// The connection ended (push detection, failed statement).
    pub(crate) fn connection_lost(&mut self) {
        self.in_flight = None;
        self.pending_action = Some(self.fail_connection());
    }

    /// A hint says the lease row may have changed (a resign `NOTIFY`): renew
    /// early, because the renewal's answer says whether a resignation was
    /// requested for this term. The hint itself proves nothing (anyone who
    /// can connect may send it), so it only ever costs a statement, and few:
    /// hints are coalesced (one check pending at most, none sent while a
    /// statement is in flight) and the check is sent no sooner than
    /// [`EARLY_CHECK_GAP`] after the last renewal was sent. A check whose
    /// renewal was already in flight when the hint came still follows it:
    /// that renewal may have read the row before the request committed.
    pub(crate) fn check_requested(&mut self, now: Instant) {
        if !matches!(self.phase, Phase::Pending | Phase::Active) || self.early_check.is_some() {
            return;
        }
        let at = self
            .last_renew_sent
            .map_or(now, |sent| (sent + EARLY_CHECK_GAP).max(now));
        self.early_check = Some(at);
    }

    /// A resignation was requested (remotely, or by shutdown): cancel the
    /// user's token, keep the lock and lease for a clean release for at most
    /// one TTL.
    pub(crate) fn stop_requested(&mut self, reason: LossReason, now: Instant) {
        match self.phase {
            Phase::Pending | Phase::Active => {
                self.reason = Some(reason);
                self.phase = Phase::LameDuck;
                self.lame_duck_until = Some(now + self.timing.ttl);
                self.pending_action = Some(Action::Lose {
                    reason,
                    kill: false,
                });
            }
            Phase::LameDuck | Phase::Done => {}
        }
    }

    /// The driver released (or abandoned) the lock.
    pub(crate) fn finish(&mut self, reason: LossReason) -> Option<Action> {
        let first = self.reason.is_none();
        self.phase = Phase::Done;
        if first {
            self.reason = Some(reason);
            Some(Action::Lose {
                reason,
                kill: false,
            })
        } else {
            None
        }
    }

    fn fail_connection(&mut self) -> Action {
        self.lose(LossReason::ConnectionLost, true)
    }

    fn lose(&mut self, reason: LossReason, kill: bool) -> Action {
        let reason = *self.reason.get_or_insert(reason);
        self.phase = Phase::Done;
        Action::Lose { reason, kill }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn timing() -> Timing {
        TimingRequest {
            ttl: Some(ms(3000)),
            renew_every: Some(ms(1000)),
            heartbeat: Some(ms(250)),
            heartbeat_timeout: Some(ms(500)),
            ..Default::default()
        }
        .validate()
        .unwrap()
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
    fn derived_tcp_outlasts_every_ttl() {
        for ttl_ms in [
            100, 999, 1000, 1001, 2000, 2500, 5000, 15_000, 60_000, 86_400_000,
        ] {
            let ttl = ms(ttl_ms);
            let tcp = default_tcp_for(ttl);
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
            assert!(e.contains(needle), "{e:?} lacks {needle:?}");
        }
    }

    #[test]
    fn clean_takeover_activates_at_once_unclean_after_the_delay() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        assert_eq!(k.poll(t0), Some(Action::Activate));
        let mut k = Keeper::new(t, t0, t0, true);
        assert_eq!(k.poll(t0), None);
        assert_eq!(k.next_wake(), Some(t0 + ms(250)));
        // Heartbeats continue while waiting.
        assert_eq!(k.poll(t0 + ms(250)), Some(Action::Heartbeat));
        k.heartbeat_ok(t0 + ms(251));
        let at = t0 + t.handover_delay;
        assert!(k.next_wake().unwrap() <= at);
        // Drive to the activation.
        let mut now;
        loop {
            now = k.next_wake().unwrap();
            match k.poll(now) {
                Some(Action::Activate) => break,
                Some(Action::Heartbeat) => k.heartbeat_ok(now),
                Some(Action::Renew) => k.renewed(now, now),
                other => panic!("{other:?} at {:?}", now - t0),
            }
        }
        assert_eq!(now, at);
        assert_eq!(k.phase(), Phase::Active);
    }

    #[test]
    fn deadline_counts_from_the_send_time_of_the_last_success() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0 + ms(5), false);
        assert_eq!(k.deadline(), t0 + ms(2400));
        assert_eq!(k.poll(t0 + ms(5)), Some(Action::Activate));
        assert_eq!(k.poll(t0 + ms(1000)), Some(Action::Renew));
        // The answer took 400 ms: the deadline counts from the send.
        k.renewed(t0 + ms(1000), t0 + ms(1400));
        assert_eq!(k.deadline(), t0 + ms(3400));
        // The next renewal is sent and never answered: the heartbeat
        // timeout kills the connection before the deadline.
        assert_eq!(k.poll(t0 + ms(2000)), Some(Action::Renew));
        assert_eq!(k.next_wake(), Some(t0 + ms(2500)));
        assert_eq!(
            k.poll(t0 + ms(2500)),
            Some(Action::Lose {
                reason: LossReason::ConnectionLost,
                kill: true
            })
        );
        assert_eq!(k.poll(t0 + ms(9999)), None);
        assert_eq!(k.next_wake(), None);
    }

    #[test]
    fn failed_renewals_end_in_the_deadline_even_with_no_answer() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        assert_eq!(k.poll(t0), Some(Action::Activate));
        let mut now;
        let lost_at = loop {
            now = k.next_wake().unwrap();
            match k.poll(now) {
                Some(Action::Renew) => k.renew_failed(now),
                Some(Action::Heartbeat) => k.heartbeat_ok(now),
                Some(Action::Lose { reason, kill }) => {
                    assert_eq!(reason, LossReason::Deadline);
                    assert!(kill);
                    break now;
                }
                None => {}
                Some(a) => panic!("{a:?}"),
            }
        };
        assert_eq!(lost_at, t0 + t.deadline_budget());
        // A late success never revives the leadership.
        k.renewed(now, now);
        assert_eq!(k.poll(now + ms(1)), None);
        assert_eq!(k.phase(), Phase::Done);
    }

    #[test]
    fn a_late_answer_after_the_deadline_does_not_extend_it() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        k.poll(t0);
        // Sent at 2300, answered at 2450 (after the 2400 deadline).
        let sent = t0 + ms(2300);
        k.renewed(sent, t0 + ms(2450));
        assert_eq!(k.deadline(), t0 + ms(2400));
    }

    #[test]
    fn preemption_and_connection_loss_end_at_once() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        k.poll(t0);
        assert_eq!(k.poll(t0 + ms(1000)), Some(Action::Renew));
        k.preempted();
        assert_eq!(
            k.poll(t0 + ms(1001)),
            Some(Action::Lose {
                reason: LossReason::Preempted,
                kill: true
            })
        );
        let mut k = Keeper::new(t, t0, t0, false);
        k.poll(t0);
        k.connection_lost();
        assert_eq!(
            k.poll(t0 + ms(1)),
            Some(Action::Lose {
                reason: LossReason::ConnectionLost,
                kill: true
            })
        );
        // A second failure reports nothing new.
        k.connection_lost();
        assert!(matches!(
            k.poll(t0 + ms(2)),
            Some(Action::Lose {
                reason: LossReason::ConnectionLost,
                ..
            })
        ));
    }

    #[test]
    fn resign_request_keeps_the_lock_until_released_or_one_ttl() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        k.poll(t0);
        k.stop_requested(LossReason::Resigned, t0 + ms(10));
        assert_eq!(
            k.poll(t0 + ms(10)),
            Some(Action::Lose {
                reason: LossReason::Resigned,
                kill: false
            })
        );
        assert_eq!(k.phase(), Phase::LameDuck);
        // Still renewing while the user stops its duties.
        assert_eq!(k.poll(t0 + ms(1000)), Some(Action::Renew));
        k.renewed(t0 + ms(1000), t0 + ms(1001));
        // Nobody released within a TTL: abandon the lock.
        let mut now;
        loop {
            now = k.next_wake().unwrap();
            match k.poll(now) {
                Some(Action::Renew) => k.renewed(now, now),
                Some(Action::Heartbeat) => k.heartbeat_ok(now),
                Some(Action::Lose { reason, kill }) => {
                    assert_eq!(reason, LossReason::Resigned);
                    assert!(kill);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(now, t0 + ms(10) + t.ttl);
        assert_eq!(k.finish(LossReason::Resigned), None);
    }

    #[test]
    fn a_hint_renews_at_once_when_the_last_renewal_is_old() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        assert_eq!(k.poll(t0), Some(Action::Activate));
        assert_eq!(k.poll(t0 + ms(50)), None);
        k.check_requested(t0 + ms(50));
        assert_eq!(k.next_wake(), Some(t0 + ms(50)));
        assert_eq!(k.poll(t0 + ms(50)), Some(Action::Renew));
        k.renewed(t0 + ms(50), t0 + ms(51));
        // The regular schedule counts from the early renewal.
        assert_eq!(k.next_renew, t0 + ms(1050));
    }

    #[test]
    fn a_flood_of_hints_costs_one_renewal_per_gap() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        k.poll(t0);
        let mut renewals = 0;
        let mut in_flight: Option<Instant> = None;
        // A hint every millisecond for 2 s; each statement answers in 1 ms.
        for i in 0..2000u64 {
            let now = t0 + ms(i);
            k.check_requested(now);
            if let Some(sent) = in_flight {
                if now >= sent + ms(1) {
                    k.renewed(sent, now);
                    in_flight = None;
                }
            }
            while let Some(a) = k.poll(now) {
                match a {
                    Action::Renew => {
                        renewals += 1;
                        in_flight = Some(now);
                    }
                    Action::Heartbeat => k.heartbeat_ok(now),
                    other => panic!("{other:?}"),
                }
            }
        }
        // 2 s / 100 ms = 20, plus the first one at once.
        assert!(renewals <= 21, "{renewals}");
        assert!(renewals >= 19, "{renewals}");
        assert_eq!(k.phase(), Phase::Active);
    }

    #[test]
    fn a_hint_during_a_renewal_is_checked_after_its_answer() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        k.poll(t0);
        assert_eq!(k.poll(t0 + ms(1000)), Some(Action::Renew));
        // The request committed after the renewal was sent: it may not
        // have seen it.
        k.check_requested(t0 + ms(1001));
        assert_eq!(k.poll(t0 + ms(1002)), None, "one statement at a time");
        k.renewed(t0 + ms(1000), t0 + ms(1150));
        // Answered after the gap: checked at once.
        assert_eq!(k.poll(t0 + ms(1150)), Some(Action::Renew));
        k.renewed(t0 + ms(1150), t0 + ms(1151));
        // No hint pending: back to the schedule.
        assert_eq!(k.poll(t0 + ms(1200)), None);
        // A resigning leader needs no more checks.
        k.stop_requested(LossReason::Resigned, t0 + ms(1200));
        k.poll(t0 + ms(1200));
        k.check_requested(t0 + ms(1300));
        assert_eq!(k.early_check, None);
    }

    #[test]
    fn a_healthy_leader_keeps_its_deadline_ahead_forever() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, t0, t0, false);
        let mut now = t0;
        let rtt = ms(30);
        for _ in 0..10_000 {
            match k.poll(now) {
                Some(Action::Activate) => continue,
                Some(Action::Renew) => k.renewed(now, now + rtt),
                Some(Action::Heartbeat) => k.heartbeat_ok(now + rtt),
                Some(a) => panic!("{a:?} at {:?}", now - t0),
                None => {}
            }
            now = k.next_wake().unwrap().max(now + rtt);
            assert!(k.deadline() > now);
        }
        assert!(now - t0 > Duration::from_secs(60));
    }

    fn lease_timing() -> Timing {
        TimingRequest {
            ttl: Some(ms(2000)),
            renew_every: Some(ms(500)),
            heartbeat_timeout: Some(ms(300)),
            ..Default::default()
        }
        .validate_lease()
        .unwrap()
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
                "statement timeout",
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
            assert!(e.contains(needle), "{e:?} lacks {needle:?}");
        }
    }

    #[test]
    fn lease_keeper_renews_without_heartbeats_and_counts_from_the_send() {
        let t = lease_timing();
        let t0 = Instant::now();
        let mut k = Keeper::new_lease(t, t0);
        assert_eq!(k.poll(t0 + ms(3)), Some(Action::Activate));
        assert_eq!(k.deadline(), t0 + ms(1600));
        assert_eq!(k.next_wake(), Some(t0 + ms(500)));
        assert_eq!(k.poll(t0 + ms(500)), Some(Action::Renew));
        // In flight for longer than the statement timeout: the keeper does
        // not kill anything (the driver bounds the statement and reports).
        assert_eq!(k.poll(t0 + ms(900)), None);
        assert_eq!(k.next_wake(), Some(t0 + ms(1600)));
        k.renewed(t0 + ms(500), t0 + ms(950));
        assert_eq!(k.deadline(), t0 + ms(2100));
        let mut now = t0 + ms(950);
        for _ in 0..1000 {
            match k.poll(now) {
                Some(Action::Renew) => k.renewed(now, now + ms(5)),
                None => {}
                other => panic!("{other:?}"),
            }
            now = k.next_wake().unwrap();
            assert!(k.deadline() > now);
        }
    }

    #[test]
    fn lease_keeper_retries_failures_until_the_deadline_never_beyond() {
        let t = lease_timing();
        let t0 = Instant::now();
        let mut k = Keeper::new_lease(t, t0);
        k.poll(t0);
        let mut attempts = Vec::new();
        let mut now;
        let lost_at = loop {
            now = k.next_wake().unwrap();
            match k.poll(now) {
                Some(Action::Renew) => {
                    attempts.push(now - t0);
                    // Refused at once, then retried after a 300 ms backoff.
                    k.renew_retry(now, ms(300));
                }
                Some(Action::Lose { reason, kill }) => {
                    assert_eq!(reason, LossReason::Deadline);
                    assert!(kill);
                    break now;
                }
                None => {}
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(lost_at, t0 + t.deadline_budget());
        assert!(attempts.len() >= 4, "{attempts:?}");
        assert!(attempts.iter().all(|a| *a < t.deadline_budget()));
        // A late success after the deadline never revives it.
        k.renewed(lost_at - ms(1), lost_at + ms(1));
        assert_eq!(k.poll(lost_at + ms(2)), None);
        assert_eq!(k.phase(), Phase::Done);
    }

    #[test]
    fn lease_keeper_ends_at_once_when_the_row_is_no_longer_ours() {
        let t = lease_timing();
        let t0 = Instant::now();
        let mut k = Keeper::new_lease(t, t0);
        k.poll(t0);
        assert_eq!(k.poll(t0 + ms(500)), Some(Action::Renew));
        k.preempted();
        assert_eq!(
            k.poll(t0 + ms(501)),
            Some(Action::Lose {
                reason: LossReason::Preempted,
                kill: true
            })
        );
        assert_eq!(k.next_wake(), None);
    }
}
