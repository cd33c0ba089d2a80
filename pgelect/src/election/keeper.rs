//! The leader's keep-alive rules: a sans-IO state machine that decides,
//! from events and the monotonic time they happened at, when to renew, when
//! to heartbeat, when to tell the user and when leadership ends.
//!
//! Nothing here does I/O, reads a clock, logs or records metrics. The
//! drivers feed events and carry out (and report) the [`Action`]s the
//! [`Keeper`] returns; unit tests and the simulation feed simulated time.
//! What differs between backends comes in as data ([`Liveness`]), never as
//! a backend flag.

use std::time::Duration;

use tokio::time::Instant;

use super::timing::Timing;
use crate::loss::LossReason;

/// The least time between two early renewals asked for by hints (a resign
/// `NOTIFY`, which anyone who can connect may send): a flood of hints costs
/// a leader at most one statement per this interval beyond its schedule.
/// Counted from the last early renewal, not from the last scheduled one: a
/// genuine request that comes just after a scheduled renewal is checked at
/// once (counted from any renewal, 1 in 7 `pgelect resign` on the lease
/// backend at `--ttl 2s` waited up to 100 ms more).
pub(crate) const EARLY_CHECK_GAP: Duration = Duration::from_millis(100);

/// How the keeper learns that the connection a leadership is kept on died.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Liveness {
    /// Send a cheap heartbeat this long after the last answer, to learn of
    /// a dead server session between two renewals; `None` when there is no
    /// session to watch (every statement stands alone).
    pub(crate) heartbeat: Option<Duration>,
    /// A statement unanswered for this long means the connection is dead:
    /// the keeper ends leadership ([`LossReason::ConnectionLost`], kill).
    /// `None` when the driver bounds every statement itself and reports a
    /// failure, which is retried until the deadline.
    pub(crate) answer_within: Option<Duration>,
}

impl Liveness {
    /// A server session that holds the lock: heartbeats every
    /// `timing.heartbeat`, each statement answered within
    /// `timing.heartbeat_timeout` or the connection is given up.
    pub(crate) fn session(timing: &Timing) -> Liveness {
        Liveness {
            heartbeat: Some(timing.heartbeat),
            answer_within: Some(timing.heartbeat_timeout),
        }
    }

    /// Statements only, each bounded by the driver: no heartbeats, and no
    /// statement timeout kept here.
    pub(crate) fn statements() -> Liveness {
        Liveness {
            heartbeat: None,
            answer_within: None,
        }
    }
}

/// The phase of a leadership kept by a [`Keeper`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Probe {
    Renew,
    Heartbeat,
}

/// The leader's keep-alive state machine (sans-IO).
///
/// Invariants: the deadline only moves forward, and only on a successful
/// renewal, to `send time + ttl - margin`; once past it, leadership is lost
/// for good, whatever answers arrive later; a loss is reported once.
// Clone under test: the model checker (`election/model/`) copies states.
#[cfg_attr(test, derive(Clone))]
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
    /// When the last early renewal ([`Keeper::check_requested`]) was sent:
    /// early checks keep their distance.
    last_early_sent: Option<Instant>,
    /// How a dead connection shows (heartbeats, statement timeout).
    liveness: Liveness,
    /// A renewal since the last successful one was refused by a server
    /// that accepts no writes ([`Keeper::renew_refused_read_only`]): a loss
    /// at the deadline is then [`LossReason::ServerReadOnly`] (later
    /// attempts may have failed otherwise, timing out on a reconnection).
    read_only: bool,
}

impl Keeper {
    /// A keeper for a leadership whose electing statement was sent at
    /// `sent_at` and answered at `now`, on a connection watched as
    /// `liveness` says. After an unclean takeover (`unclean`: the previous
    /// holder did not release) the user is told only after the handover
    /// delay, counted from `sent_at` (or from the grant, see
    /// [`Keeper::handover_counted_from`]): the old leader's connection had
    /// ended before the lock was granted, which was before `sent_at`, so the
    /// delay is still counted from a moment after the old leader's loss, and
    /// the term transaction's round trip overlaps with it instead of adding
    /// to the failover. (A backend that never takes over before expiry or
    /// release has a zero handover delay.)
    pub(crate) fn new(
        timing: Timing,
        liveness: Liveness,
        sent_at: Instant,
        now: Instant,
        unclean: bool,
    ) -> Keeper {
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
            next_heartbeat: now + liveness.heartbeat.unwrap_or(timing.heartbeat),
            in_flight: None,
            lame_duck_until: None,
            reason: None,
            pending_action: None,
            early_check: None,
            last_early_sent: None,
            liveness,
            read_only: false,
        }
    }

    /// Counts the handover delay from `granted`, when the lock was seen
    /// granted, if that is earlier than the electing statement's send (on a
    /// shared connection the election waits its turn behind other roles'
    /// statements: thousands of roles granted in one poll are elected 200
    /// to a statement, one after another). The delay covers the time a live
    /// old leader may take to notice that its connection died (see
    /// [`Timing`]'s handover inequality); that connection had ended before
    /// the lock was granted, hence before `granted`, so the delay counted
    /// from `granted` still ends after the old leader stopped. The deadline
    /// is untouched: it counts from the electing statement's send, which
    /// wrote the lease. A clean takeover (no delay) is unchanged.
    pub(crate) fn handover_counted_from(mut self, granted: Instant) -> Keeper {
        let sent_at = self.deadline - self.timing.deadline_budget();
        if self.phase == Phase::Pending && self.active_at > sent_at && granted < sent_at {
            self.active_at = granted + (self.active_at - sent_at);
        }
        self
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
                    let reason = if self.read_only {
                        LossReason::ServerReadOnly
                    } else {
                        LossReason::Deadline
                    };
                    return Some(self.lose(reason, true));
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
        if let Some((probe, sent)) = self.in_flight {
            if let Some(limit) = self
                .liveness
                .answer_within
                .filter(|limit| now >= sent + *limit)
            {
                // How late this check ran says whether the process, not the
                // connection, was slow: a starved runtime polls late.
                tracing::warn!(
                    ?probe,
                    ?limit,
                    unanswered_for = ?now.saturating_duration_since(sent),
                    checked_late_by = ?now.saturating_duration_since(sent + limit),
                    "no answer on the lock connection in time; taking it for dead"
                );
                self.in_flight = None;
                return Some(self.fail_connection());
            }
            return None;
        }
        if self.phase == Phase::Pending && now >= self.active_at {
            self.phase = Phase::Active;
            return Some(Action::Activate);
        }
        let early = self.early_check.is_some_and(|t| now >= t);
        if now >= self.next_renew || early {
            // Any renewal sent from now on reads the row as the hint left
            // it: it answers a pending early check too.
            self.in_flight = Some((Probe::Renew, now));
            self.early_check = None;
            if early {
                self.last_early_sent = Some(now);
            }
            return Some(Action::Renew);
        }
        if self.liveness.heartbeat.is_some() && now >= self.next_heartbeat {
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
        match (self.in_flight, self.liveness) {
            (
                Some((_, sent)),
                Liveness {
                    answer_within: Some(limit),
                    ..
                },
            ) => t = t.min(sent + limit),
            (Some(_), _) => {}
            (
                None,
                Liveness {
                    heartbeat: None, ..
                },
            ) => t = t.min(self.next_renew),
            (None, _) => t = t.min(self.next_renew).min(self.next_heartbeat),
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
        self.read_only = false;
        if self.phase == Phase::Done {
            return;
        }
        self.next_renew = sent_at + self.timing.renew_every;
        self.next_heartbeat = now + self.heartbeat_every();
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

    /// The renewal was answered but could not extend the lease (the row
    /// was locked by a fenced transaction): the connection is alive, the
    /// deadline stays where it was, and the next attempt comes at the
    /// heartbeat pace, as after a failure.
    pub(crate) fn renew_busy(&mut self, now: Instant) {
        self.renew_failed(now);
        self.next_heartbeat = now + self.heartbeat_every();
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

    /// Lease backend: the renewal was refused by a server that accepts no
    /// writes (SQLSTATE 25006: a primary being demoted by an HA manager, or
    /// fenced). Retried as [`Keeper::renew_retry`] until the deadline (a
    /// new connection reaches the promoted primary, where the replicated
    /// row still names this leader); if the deadline comes first, the loss
    /// is [`LossReason::ServerReadOnly`].
    pub(crate) fn renew_refused_read_only(&mut self, now: Instant, wait: Duration) {
        self.renew_retry(now, wait);
        self.read_only = true;
    }

    /// Another statement on the same connection, sent at `sent`, was
    /// answered (a shared connection, where this leader's own statement
    /// may wait behind others'): the server session lived then, so the
    /// statement in flight's answer limit counts from `sent` if that is
    /// later than its own send. Nothing else moves: the deadline only
    /// follows this leader's own renewals.
    pub(crate) fn alive_at(&mut self, sent: Instant) {
        if let Some((probe, since)) = self.in_flight {
            if sent > since {
                self.in_flight = Some((probe, sent));
            }
        }
    }

    /// The heartbeat was answered.
    pub(crate) fn heartbeat_ok(&mut self, now: Instant) {
        self.in_flight = None;
        self.next_heartbeat = now + self.heartbeat_every();
    }

    /// The connection ended (push detection, failed statement).
    pub(crate) fn connection_lost(&mut self) {
        self.in_flight = None;
        self.pending_action = Some(self.fail_connection());
    }

    /// The leadership was ended outside this task: the clock said its
    /// deadline passed while the keeper task had not run
    /// ([`LeaderState::expire_if_due`](super::leadership::LeaderState::expire_if_due)).
    /// Lost for good, as if this keeper had seen the deadline pass, even if
    /// an answer it took in meanwhile moved its own deadline.
    pub(crate) fn expired_elsewhere(&mut self) {
        if matches!(self.phase, Phase::Pending | Phase::Active) {
            self.in_flight = None;
            self.pending_action = Some(self.lose(LossReason::Deadline, true));
        }
    }

    /// The server accepts no writes (demoted or fenced): leadership ends at
    /// once, and the lock connection goes.
    pub(crate) fn server_read_only(&mut self) {
        self.in_flight = None;
        self.pending_action = Some(self.lose(LossReason::ServerReadOnly, true));
    }

    /// A hint says the lease row may have changed (a resign `NOTIFY`): renew
    /// early, because the renewal's answer says whether a resignation was
    /// requested for this term. The hint itself proves nothing (anyone who
    /// can connect may send it), so it only ever costs a statement, and few:
    /// hints are coalesced (one check pending at most, none sent while a
    /// statement is in flight) and the check is sent no sooner than
    /// [`EARLY_CHECK_GAP`] after the last early one was sent. A check whose
    /// renewal was already in flight when the hint came still follows it:
    /// that renewal may have read the row before the request committed.
    pub(crate) fn check_requested(&mut self, now: Instant) {
        if !matches!(self.phase, Phase::Pending | Phase::Active) || self.early_check.is_some() {
            return;
        }
        let at = self
            .last_early_sent
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

    fn heartbeat_every(&self) -> Duration {
        self.liveness.heartbeat.unwrap_or(self.timing.heartbeat)
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
impl Keeper {
    /// For the model checker: hashes what decides this keeper's behaviour
    /// from `now` on, every instant taken relative to `now`, and instants
    /// more than `horizon` in the past as `horizon` ago (the keeper only
    /// compares them as `now >= t + d` with `d <= horizon`, so their exact
    /// age no longer matters). Two keepers hashed alike act alike.
    pub(crate) fn hash_relative<H: std::hash::Hasher>(
        &self,
        now: Instant,
        horizon: Duration,
        h: &mut H,
    ) {
        use std::hash::Hash;
        let rel = |t: Instant| -> i64 {
            if t >= now {
                (t - now).as_micros() as i64
            } else {
                -((now - t).min(horizon).as_micros() as i64)
            }
        };
        self.phase.hash(h);
        self.pending_action.hash(h);
        self.reason.hash(h);
        if self.phase == Phase::Done {
            return;
        }
        rel(self.deadline).hash(h);
        rel(self.active_at).hash(h);
        rel(self.next_renew).hash(h);
        rel(self.next_heartbeat).hash(h);
        self.in_flight.map(|(p, t)| (p, rel(t))).hash(h);
        self.lame_duck_until.map(rel).hash(h);
        self.early_check.map(rel).hash(h);
        self.last_early_sent.map(rel).hash(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::election::timing::TimingRequest;

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
    fn clean_takeover_activates_at_once_unclean_after_the_delay() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        assert_eq!(k.poll(t0), Some(Action::Activate));
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, true);
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

    /// Drives `k` from `now` (answering every probe at once) until it
    /// activates; returns when.
    fn activation(mut k: Keeper, mut now: Instant) -> Instant {
        loop {
            match k.poll(now) {
                Some(Action::Activate) => return now,
                Some(Action::Heartbeat) => k.heartbeat_ok(now),
                Some(Action::Renew) => k.renewed(now, now),
                None => now = k.next_wake().unwrap(),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn the_handover_delay_counts_from_the_grant_when_the_election_waited() {
        let t = timing();
        let t0 = Instant::now();
        // Granted at t0, elected by a statement sent 300 ms later.
        let sent = t0 + ms(300);
        let k = Keeper::new(t, Liveness::session(&t), sent, sent + ms(5), true)
            .handover_counted_from(t0);
        assert_eq!(k.deadline(), sent + t.deadline_budget());
        assert!(
            t0 + t.handover_delay > sent + ms(5),
            "the test needs a delay longer than the wait"
        );
        assert_eq!(activation(k, sent + ms(5)), t0 + t.handover_delay);
        // Never later than from the send.
        let k =
            Keeper::new(t, Liveness::session(&t), t0, t0, true).handover_counted_from(t0 + ms(100));
        assert_eq!(activation(k, t0), t0 + t.handover_delay);
        // A clean takeover stays at once.
        let k = Keeper::new(t, Liveness::session(&t), sent, sent, false).handover_counted_from(t0);
        assert_eq!(activation(k, sent), sent);
    }

    #[test]
    fn deadline_counts_from_the_send_time_of_the_last_success() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0 + ms(5), false);
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
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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
    fn a_busy_row_keeps_the_connection_retries_at_the_heartbeat_pace_and_ends_in_the_deadline() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        assert_eq!(k.poll(t0), Some(Action::Activate));
        assert_eq!(k.poll(t0 + ms(1000)), Some(Action::Renew));
        k.renewed(t0 + ms(1000), t0 + ms(1010));
        let deadline = k.deadline();
        // The row is held by a fenced transaction from now on: every
        // renewal is answered at once but extends nothing.
        assert_eq!(k.poll(t0 + ms(2000)), Some(Action::Renew));
        k.renew_busy(t0 + ms(2005));
        assert_eq!(k.deadline(), deadline);
        // Retried at the heartbeat pace, not a whole renewal period later,
        // and no heartbeat is due before that retry.
        assert_eq!(k.next_wake(), Some(t0 + ms(2255)));
        assert_eq!(k.poll(t0 + ms(2255)), Some(Action::Renew));
        // An answer at once is never a lost connection; only the deadline
        // ends a leadership whose row stays held.
        let mut now = t0 + ms(2256);
        k.renew_busy(now);
        let lost = loop {
            now = k.next_wake().unwrap();
            match k.poll(now) {
                Some(Action::Renew) => k.renew_busy(now + ms(1)),
                Some(Action::Heartbeat) => k.heartbeat_ok(now + ms(1)),
                Some(Action::Lose { reason, kill }) => break (reason, kill, now),
                None => {}
                Some(a) => panic!("{a:?}"),
            }
        };
        assert_eq!(lost, (LossReason::Deadline, true, deadline));
    }

    #[test]
    fn answers_to_other_statements_move_the_answer_limit_not_the_deadline() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        assert_eq!(k.poll(t0), Some(Action::Activate));
        assert_eq!(k.poll(t0 + ms(1000)), Some(Action::Renew));
        let deadline = k.deadline();
        // Nothing in flight before the renewal: an answer then is no news.
        // The renewal waits behind other leaders' chunks, each answered.
        k.alive_at(t0 + ms(900));
        assert_eq!(k.next_wake(), Some(t0 + ms(1500)));
        k.alive_at(t0 + ms(1400));
        assert_eq!(k.next_wake(), Some(t0 + ms(1900)));
        assert_eq!(
            k.poll(t0 + ms(1600)),
            None,
            "the session answered 200 ms ago"
        );
        assert_eq!(k.deadline(), deadline);
        // No answer for the limit after the last one: the connection is dead.
        assert_eq!(
            k.poll(t0 + ms(1900)),
            Some(Action::Lose {
                reason: LossReason::ConnectionLost,
                kill: true
            })
        );
        // With nothing in flight, answers change nothing.
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        assert_eq!(k.poll(t0), Some(Action::Activate));
        let wake = k.next_wake();
        k.alive_at(t0 + ms(100));
        assert_eq!(k.next_wake(), wake);
    }

    #[test]
    fn a_late_answer_after_the_deadline_does_not_extend_it() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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
        // A demoted server: leadership ends at once, well before the
        // deadline, and the lock connection goes with it.
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        k.poll(t0);
        k.server_read_only();
        assert_eq!(
            k.poll(t0 + ms(1)),
            Some(Action::Lose {
                reason: LossReason::ServerReadOnly,
                kill: true
            })
        );
    }

    #[test]
    fn resign_request_keeps_the_lock_until_released_or_one_ttl() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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

    /// A clean release ends the keeper: it reports the loss once, then
    /// neither renews nor wakes again.
    #[test]
    fn a_release_ends_the_keeper() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        assert_eq!(k.poll(t0), Some(Action::Activate));
        assert_eq!(
            k.finish(LossReason::Resigned),
            Some(Action::Lose {
                reason: LossReason::Resigned,
                kill: false
            })
        );
        assert_eq!(k.phase(), Phase::Done);
        assert_eq!(k.next_wake(), None);
        assert_eq!(k.poll(t0 + t.renew_every), None);
        assert_eq!(k.finish(LossReason::Deadline), None);
    }

    #[test]
    fn a_hint_renews_at_once_when_the_last_renewal_is_old() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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
    fn a_hint_just_after_a_scheduled_renewal_is_checked_at_once() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        k.poll(t0);
        assert_eq!(k.poll(t0 + ms(1000)), Some(Action::Renew));
        k.renewed(t0 + ms(1000), t0 + ms(1001));
        // A resign request 10 ms after the scheduled renewal: not held
        // back by it.
        k.check_requested(t0 + ms(1010));
        assert_eq!(k.poll(t0 + ms(1010)), Some(Action::Renew));
        k.renewed(t0 + ms(1010), t0 + ms(1011));
        // A second hint keeps its distance from the first early renewal.
        k.check_requested(t0 + ms(1020));
        assert_eq!(k.poll(t0 + ms(1020)), None);
        assert_eq!(k.next_wake(), Some(t0 + ms(1110)));
        assert_eq!(k.poll(t0 + ms(1110)), Some(Action::Renew));
    }

    #[test]
    fn a_hint_during_a_renewal_is_checked_after_its_answer() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
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
    fn lease_keeper_renews_without_heartbeats_and_counts_from_the_send() {
        let t = lease_timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::statements(), t0, t0, false);
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
        let mut k = Keeper::new(t, Liveness::statements(), t0, t0, false);
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
        let mut k = Keeper::new(t, Liveness::statements(), t0, t0, false);
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

    // Pinned exactly where the tests above only bound a value: cargo-mutants
    // (scripts/mutants) left these changes of the rules uncaught.

    #[test]
    fn an_answer_at_the_deadline_instant_does_not_extend_it() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        k.poll(t0);
        let deadline = k.deadline();
        // Sent before the deadline, answered exactly at it: too late.
        k.renewed(deadline - ms(100), deadline);
        assert_eq!(k.deadline(), deadline);
        assert_eq!(
            k.poll(deadline),
            Some(Action::Lose {
                reason: LossReason::Deadline,
                kill: true
            })
        );
        // One instant earlier it counts.
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        k.poll(t0);
        k.renewed(deadline - ms(100), deadline - Duration::from_nanos(1));
        assert_eq!(k.deadline(), deadline - ms(100) + t.deadline_budget());
    }

    #[test]
    fn a_lease_refused_read_only_is_retried_until_the_deadline() {
        let t = lease_timing();
        let t0 = Instant::now();
        // Refused until the deadline: lost then, as ServerReadOnly.
        let mut k = Keeper::new(t, Liveness::statements(), t0, t0, false);
        k.poll(t0);
        let deadline = k.deadline();
        let mut lost = None;
        while let Some(now) = k.next_wake() {
            match k.poll(now) {
                Some(Action::Renew) => k.renew_refused_read_only(now, ms(50)),
                Some(Action::Lose { reason, .. }) => {
                    lost = Some((reason, now));
                    break;
                }
                _ => {}
            }
        }
        assert_eq!(lost, Some((LossReason::ServerReadOnly, deadline)));
        // Renewed once the promoted server answers: kept, with a new
        // deadline; a later deadline loss is a plain one.
        let mut k = Keeper::new(t, Liveness::statements(), t0, t0, false);
        k.poll(t0);
        let first = k.next_wake().unwrap();
        assert_eq!(k.poll(first), Some(Action::Renew));
        k.renew_refused_read_only(first, ms(50));
        let again = k.next_wake().unwrap();
        assert_eq!(k.poll(again), Some(Action::Renew));
        k.renewed(again, again + ms(5));
        assert_eq!(k.deadline(), again + t.deadline_budget());
        let next = k.next_wake().unwrap();
        assert_eq!(k.poll(next), Some(Action::Renew));
        k.renew_retry(next, ms(50));
        let mut reason = None;
        while let Some(now) = k.next_wake() {
            match k.poll(now) {
                Some(Action::Renew) => k.renew_retry(now, ms(50)),
                Some(Action::Lose { reason: r, .. }) => {
                    reason = Some(r);
                    break;
                }
                _ => {}
            }
        }
        assert_eq!(reason, Some(LossReason::Deadline));
    }

    #[test]
    fn lease_retries_follow_the_backoff_then_halve_the_room_left() {
        let t = lease_timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::statements(), t0, t0, false);
        k.poll(t0);
        let mut attempts = Vec::new();
        loop {
            let now = k.next_wake().unwrap();
            match k.poll(now) {
                Some(Action::Renew) => {
                    attempts.push((now - t0).as_micros());
                    k.renew_retry(now, ms(300));
                }
                Some(Action::Lose { .. }) => break,
                None => {}
                other => panic!("{other:?}"),
            }
        }
        // Every 300 ms while that lands before the 1.6 s deadline, then
        // half the room left while it is at least 20 ms.
        assert_eq!(
            attempts,
            [500_000, 800_000, 1_100_000, 1_400_000, 1_500_000, 1_550_000, 1_575_000, 1_587_500]
        );
    }

    #[test]
    fn retries_and_heartbeats_are_due_exactly_one_interval_later() {
        let t = timing();
        let t0 = Instant::now();
        let mut k = Keeper::new(t, Liveness::session(&t), t0, t0, false);
        k.poll(t0);
        // Heartbeat every 250 ms, renewal every 1000 ms.
        assert_eq!(k.next_wake(), Some(t0 + ms(250)));
        assert_eq!(k.poll(t0 + ms(250)), Some(Action::Heartbeat));
        k.heartbeat_ok(t0 + ms(260));
        assert_eq!(k.next_wake(), Some(t0 + ms(510)));
        assert_eq!(k.poll(t0 + ms(509)), None);
        // A refused renewal is retried at the heartbeat pace.
        k.heartbeat_ok(t0 + ms(900));
        assert_eq!(k.poll(t0 + ms(1000)), Some(Action::Renew));
        k.renew_failed(t0 + ms(1010));
        assert_eq!(k.next_renew, t0 + ms(1260));
        assert_eq!(k.next_wake(), Some(t0 + ms(1150)));
        assert_eq!(k.poll(t0 + ms(1150)), Some(Action::Heartbeat));
        k.heartbeat_ok(t0 + ms(1160));
        assert_eq!(k.poll(t0 + ms(1259)), None);
        assert_eq!(k.poll(t0 + ms(1260)), Some(Action::Renew));
    }

    #[test]
    fn an_unclean_takeover_wakes_at_the_end_of_the_handover_delay() {
        // Renewals and heartbeats later than the activation: the wake-up
        // is the activation itself.
        let t = TimingRequest {
            ttl: Some(ms(3000)),
            renew_every: Some(ms(2000)),
            heartbeat: Some(ms(250)),
            heartbeat_timeout: Some(ms(500)),
            ..Default::default()
        }
        .validate()
        .unwrap();
        let slow = Liveness {
            heartbeat: Some(ms(10_000)),
            answer_within: Some(ms(500)),
        };
        let t0 = Instant::now();
        let mut k = Keeper::new(t, slow, t0, t0, true);
        assert_eq!(k.poll(t0), None);
        assert_eq!(k.next_wake(), Some(t0 + t.handover_delay));
        assert_eq!(k.poll(t0 + t.handover_delay), Some(Action::Activate));
        assert_eq!(k.next_wake(), Some(t0 + ms(2000)));
    }
}
