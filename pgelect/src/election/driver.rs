//! The keep driver: the one loop that runs a leadership for every backend.
//!
//! It carries out what the pure [`Keeper`] decides (renew, heartbeat, tell
//! the user, end), listens for the handle's commands (stop, release, drop),
//! for resign hints and for the connection's death, reports the keeper's
//! decisions (logs, metrics, watchers) and, at the end, releases cleanly
//! when asked to. What differs between backends — the statements, what a
//! failure means, how a lock is let go of and released — is behind
//! [`KeepBackend`].

use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;

use crate::conn::Notice;
use crate::error::{Error, Result};
use crate::metrics;

use super::keeper::{Action, Keeper, Phase};
use super::leadership::{Command, LeaderState};
use super::support::Counted;
use super::watch::RESIGN_CHANNEL;
use super::ElectorState;
use crate::loss::LossReason;

/// What a renewal or a heartbeat found.
pub(crate) enum Answer {
    /// The renewal found the lease row still ours. `row` carries the
    /// server's `renewed_at` and `lease_until` when the backend publishes
    /// them to this elector's watchers; `resign_requested` is the row's
    /// mark, set only by `request_resign` (a privilege) for this term.
    Renewed {
        row: Option<(SystemTime, SystemTime)>,
        resign_requested: bool,
        /// What the renewal found in the candidate registry.
        preferred: Preferred,
    },
    /// The renewal found no row with our holder and term: someone else
    /// leads.
    NotOurs,
    /// The row still names us with our term, but a transaction of ours
    /// holds it (a fenced write's `FOR SHARE`): the server answered, so the
    /// connection lives, but the lease was not extended. Retried soon; the
    /// deadline stays where it was.
    Busy,
    /// The heartbeat was answered.
    Alive,
    /// The heartbeat was answered by a server that accepts no writes
    /// (`transaction_read_only` is on: a standby, or a fenced primary).
    ReadOnly,
}

/// What a renewal found about candidates of strictly higher priority
/// than the leader's (see [`registry`](super::registry)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Preferred {
    /// The node of the best such candidate that is ready to take the lock
    /// now: the leader hands over.
    pub(crate) ready: Option<String>,
    /// Such a candidate lives but does not wait yet (a blocking standby
    /// about to wait, or between two wait slices): worth checking again
    /// soon after a hint.
    pub(crate) pending: bool,
}

/// After a hint, how many more early checks a leader makes while a
/// preferred candidate lives but does not wait yet (one per
/// [`EARLY_CHECK_GAP`](super::keeper::EARLY_CHECK_GAP): a second at most).
const PENDING_RECHECKS: u8 = 10;

/// A statement in flight: resolves with the moment it was sent and what it
/// found.
pub(crate) type Statement<'a> =
    Pin<Box<dyn Future<Output = (Instant, Result<Answer>)> + Send + 'a>>;

/// What the keeper is told about a failed statement.
pub(crate) enum Failed {
    /// The connection, and with it the lock, is gone: leadership ends.
    ConnectionLost,
    /// The server accepts no writes (SQLSTATE 25006): leadership ends.
    ServerReadOnly,
    /// Not renewed; retry at the keeper's pace until the deadline.
    RetrySoon,
    /// Not renewed; retry after this wait, until the deadline.
    RetryAfter(Duration),
    /// Refused by a server that accepts no writes (SQLSTATE 25006); retry
    /// after this wait on a new connection, until the deadline, which then
    /// ends leadership as [`LossReason::ServerReadOnly`].
    ReadOnlyRetryAfter(Duration),
}

/// The backend-specific part of keeping a leadership.
pub(crate) trait KeepBackend: Send + Sync {
    /// True when a renewal in flight at release must be awaited (its
    /// connection is the one to release on) rather than dropped.
    const FINISH_IN_FLIGHT_BEFORE_RELEASE: bool;

    /// Sends the renewal.
    fn renew(&self) -> Statement<'_>;

    /// Sends a heartbeat; asked for only when the keeper's liveness has
    /// heartbeats.
    fn heartbeat(&self) -> Statement<'_>;

    /// Completes with the outcome of a renewal this leader did not ask for
    /// (a batch that renewed every leader on a shared connection), with its
    /// send time; polled only while no statement of this leader is in
    /// flight. Never completes for a backend whose leaders renew alone.
    fn pushed(&self) -> impl Future<Output = (Instant, Result<Answer>)> + Send + '_ {
        std::future::pending()
    }

    /// Completes with the send time of another statement answered on this
    /// leader's connection (a shared connection's other leaders, standbys
    /// and heartbeats): the server session lived then
    /// ([`Keeper::alive_at`](super::keeper::Keeper::alive_at)). Never
    /// completes where the leader's statements are the connection's only.
    fn answered(&self) -> impl Future<Output = Instant> + Send + '_ {
        std::future::pending()
    }

    /// Completes when the connection is known to be closed (never, for a
    /// backend that reconnects at will).
    fn closed(&self) -> impl Future<Output = ()> + Send + '_;

    /// Classifies a failed renewal or heartbeat; `failures` counts them in
    /// a row, this one included.
    fn failed(&self, error: &Error, failures: u32) -> Failed;

    /// Leadership ended with the lock to be let go of at once (`reason`),
    /// or the handle was dropped (`None`).
    fn let_go(&self, reason: Option<LossReason>);

    /// After a loss for `reason`, may the lock still be released cleanly
    /// once the user's duties stopped (the handle waits for `release`)?
    fn releasable_after(&self, reason: LossReason) -> bool;

    /// Releases cleanly: clears the holder, notifies, unlocks; `ended` is
    /// the loss that came first, if any. Cleans up its connection either
    /// way.
    fn release(self, ended: Option<LossReason>) -> impl Future<Output = Result<()>> + Send;

    /// Leadership ended without a release: closes what is left.
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// How the user learns that leadership begins.
pub(crate) enum Activation {
    /// The keeper starts pending: on [`Action::Activate`] the campaign is
    /// told through `tx` (false: lost before acting); `granted_at` is when
    /// the lock was granted, for the takeover metric.
    Pending {
        tx: oneshot::Sender<bool>,
        granted_at: Instant,
    },
    /// Already told (the keeper was polled to `Activate` by the campaign).
    Done,
}

/// A leadership to keep.
pub(crate) struct Keep<B> {
    pub(crate) shared: Arc<ElectorState>,
    pub(crate) backend: B,
    pub(crate) keeper: Keeper,
    pub(crate) state: Arc<LeaderState>,
    pub(crate) commands: mpsc::UnboundedReceiver<Command>,
    pub(crate) notices: broadcast::Receiver<Notice>,
    pub(crate) activation: Activation,
    /// Count this leadership in the elector's
    /// [`Activity::leading`](super::Activity) while it runs (which keeps
    /// the elector's observer connection closed).
    pub(crate) count_leading: bool,
}

/// Reports a local deadline noticed well after it passed: the process was
/// paused or starved of CPU, and may have believed it led after its lease
/// could be taken over; only fenced writes were safe meanwhile.
fn report_late(role: &str, reason: LossReason, now: Instant, deadline: Instant) {
    let late = now.saturating_duration_since(deadline);
    if reason == LossReason::Deadline && late > Duration::from_millis(100) {
        tracing::warn!(role, late = ?late, "the local deadline was noticed late: this process was paused or starved of CPU; only fenced writes were safe in that time");
        metrics::deadline_late(role, late);
    }
}

impl<B: KeepBackend + 'static> Keep<B> {
    /// A leadership the user is told of at once ([`Activation::Done`]),
    /// not counted in the elector's activity; the session backend sets
    /// both fields after.
    pub(crate) fn new(
        shared: Arc<ElectorState>,
        backend: B,
        keeper: Keeper,
        state: Arc<LeaderState>,
        commands: mpsc::UnboundedReceiver<Command>,
        notices: broadcast::Receiver<Notice>,
    ) -> Self {
        Keep {
            shared,
            backend,
            keeper,
            state,
            commands,
            notices,
            activation: Activation::Done,
            count_leading: false,
        }
    }

    /// Starts the leader's task in `span`. A leadership the user is told of
    /// at once is watched from here: the task may not be polled in time.
    pub(crate) fn spawn(self, span: tracing::Span) {
        if matches!(self.activation, Activation::Done) {
            super::watchdog::watch(&self.state);
        }
        tokio::spawn(tracing::Instrument::instrument(self.run(), span));
    }

    /// The leader's task: carries out the keeper's actions until leadership
    /// ends ([`Leading`]), then releases when asked to.
    pub(crate) async fn run(self) {
        let Keep {
            shared,
            backend,
            keeper,
            state,
            mut commands,
            mut notices,
            activation,
            count_leading,
        } = self;
        let _leading = count_leading.then(|| Counted::new(&shared.activity, |a| &mut a.leading));
        let resign_payload = format!("{}:{}", shared.options.schema_name().as_str(), shared.role);
        let mut leading = Leading::new(&shared, &backend, keeper, &state, activation);
        while leading
            .step(&mut commands, &mut notices, &resign_payload)
            .await
            .is_continue()
        {}
        let release = leading.wind_up(&mut commands).await;
        let (ended, term) = (leading.ended, leading.term);
        // Its statement in flight borrowed the backend, which the release
        // consumes.
        drop(leading);
        // Boxed: the release's and the close's statements are far larger
        // than the loop's state, and would otherwise be part of every
        // leader's task for its whole life (a kilobyte-sized future per
        // role led, thousands on a shared connection).
        let Some((reason, reply)) = release else {
            Box::pin(backend.close()).await;
            return;
        };
        let result = Box::pin(backend.release(ended)).await;
        if result.is_ok() {
            tracing::info!(%reason, "leadership released");
            shared.publish_if_holder(&shared.node, term, None);
        }
        let _ = reply.send(result);
    }
}

/// A leadership while it runs: the keeper, the statement in flight and
/// what the loop has learnt so far. Each [`step`](Leading::step) carries
/// out the keeper's actions, then waits for the next event and tells the
/// keeper; [`Keep::run`] steps until the leadership ends.
struct Leading<'a, B> {
    shared: &'a ElectorState,
    backend: &'a B,
    keeper: Keeper,
    state: &'a Arc<LeaderState>,
    term: i64,
    /// Until [`Action::Activate`]: the campaign waiting to be told.
    activated: Option<oneshot::Sender<bool>>,
    granted_at: Option<Instant>,
    /// Whether the user was told that leadership began.
    was_active: bool,
    in_flight: Option<Statement<'a>>,
    /// Failed statements in a row.
    failures: u32,
    /// The handle's release request, which ends the loop.
    release_reply: Option<(LossReason, oneshot::Sender<Result<()>>)>,
    /// The loss that ended the loop with the lock let go of.
    ended: Option<LossReason>,
    /// Early checks left after a hint (see [`PENDING_RECHECKS`]).
    rechecks: u8,
}

impl<'a, B: KeepBackend> Leading<'a, B> {
    fn new(
        shared: &'a ElectorState,
        backend: &'a B,
        keeper: Keeper,
        state: &'a Arc<LeaderState>,
        activation: Activation,
    ) -> Self {
        let (activated, granted_at, was_active) = match activation {
            Activation::Pending { tx, granted_at } => (Some(tx), Some(granted_at), false),
            Activation::Done => (None, None, true),
        };
        Leading {
            shared,
            backend,
            keeper,
            state,
            term: state.term.get(),
            activated,
            granted_at,
            was_active,
            in_flight: None,
            failures: 0,
            release_reply: None,
            ended: None,
            rechecks: 0,
        }
    }

    /// One turn of the loop; `Break` once the leadership's loop is over.
    async fn step(
        &mut self,
        commands: &mut mpsc::UnboundedReceiver<Command>,
        notices: &mut broadcast::Receiver<Notice>,
        resign_payload: &str,
    ) -> ControlFlow<()> {
        if self.state.reason().is_some() {
            // Only the watchdog thread (or a handle reading the clock)
            // ends a live keeper's state: its deadline passed.
            self.keeper.expired_elsewhere();
        }
        self.act(Instant::now())?;
        if self.keeper.phase() == Phase::Done {
            return ControlFlow::Break(());
        }
        if let Some((sent, result)) = self.wait(commands, notices, resign_payload).await? {
            self.answered(sent, result, Instant::now());
        }
        ControlFlow::Continue(())
    }

    /// After the loop: settles the statement in flight and tells a
    /// campaign still waiting that it lost; returns the handle's release
    /// request, with the user's duties stopped and the keeper finished,
    /// or `None` when the leadership ends without a release.
    async fn wind_up(
        &mut self,
        commands: &mut mpsc::UnboundedReceiver<Command>,
    ) -> Option<(LossReason, oneshot::Sender<Result<()>>)> {
        if !B::FINISH_IN_FLIGHT_BEFORE_RELEASE {
            self.in_flight = None;
        }
        if let Some(tx) = self.activated.take() {
            let _ = tx.send(false);
        }
        // After some losses the lock may still be ours on the server (a
        // lease after a deadline loss: the database was unreachable for a
        // while); once the user's duties stopped (it calls `resign`, as
        // `Elector::run` does) a release lets standbys take over without
        // waiting for the expiry.
        if self.release_reply.is_none()
            && self.ended.is_some_and(|r| self.backend.releasable_after(r))
        {
            self.in_flight = None;
            loop {
                match commands.recv().await {
                    Some(Command::Release { reason, reply }) => {
                        self.release_reply = Some((reason, reply));
                        break;
                    }
                    Some(Command::Stop { .. }) => {}
                    None => break,
                }
            }
        }
        let Some((reason, reply)) = self.release_reply.take() else {
            self.in_flight = None;
            return None;
        };
        // A statement in flight finishes first where its connection is the
        // one to release on (bounded by the statement timeout).
        if let Some(f) = self.in_flight.take() {
            let _ = f.await;
        }
        // Duties have stopped (the caller says so by releasing): cancel
        // first, then clear the holder and notify, then unlock.
        self.state.end_counted(reason, self.was_active);
        self.keeper.finish(reason);
        Some((reason, reply))
    }

    /// Carries out every action the keeper has for `now`.
    fn act(&mut self, now: Instant) -> ControlFlow<()> {
        while let Some(action) = self.keeper.poll(now) {
            match action {
                Action::Renew => self.in_flight = Some(self.backend.renew()),
                Action::Heartbeat => self.in_flight = Some(self.backend.heartbeat()),
                Action::Activate => self.activate()?,
                Action::Lose { reason, kill } => self.lose(reason, kill, now)?,
            }
        }
        ControlFlow::Continue(())
    }

    /// Tells the campaign that leadership begins.
    fn activate(&mut self) -> ControlFlow<()> {
        let Some(tx) = self.activated.take() else {
            return ControlFlow::Continue(());
        };
        self.was_active = true;
        // From now on the deadline is also watched by a thread that does
        // not depend on this task being polled in time.
        super::watchdog::watch(self.state);
        let took = self.granted_at.map_or(Duration::ZERO, |g| g.elapsed());
        metrics::leader_on(&self.shared.role, self.term, took);
        tracing::info!(takeover = ?took, "leadership begins");
        if tx.send(true).is_err() {
            // The campaign was dropped while waiting: nobody will ever
            // hold this leadership.
            self.state.end_counted(LossReason::Dropped, self.was_active);
            self.backend.let_go(None);
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }

    /// The keeper ends the leadership for `reason`; `kill`: let go of the
    /// lock at once.
    fn lose(&mut self, reason: LossReason, kill: bool, now: Instant) -> ControlFlow<()> {
        let shared = self.shared;
        report_late(&shared.role, reason, now, self.keeper.deadline());
        let first = self.state.end_counted(reason, self.was_active);
        if first && self.was_active && reason == LossReason::Resigned {
            // Asked for (by an operator's request_resign): news, not
            // trouble.
            tracing::info!(%reason, "leadership handed back on request");
        } else if first && reason == LossReason::HandedOver {
            tracing::info!(%reason, "handing leadership over to a candidate of higher priority");
        } else if first && self.was_active {
            tracing::warn!(%reason, "leadership lost");
        } else if first {
            tracing::warn!(%reason, "lost the lock before acting");
        }
        if !kill {
            return ControlFlow::Continue(());
        }
        self.backend.let_go(Some(reason));
        if self.was_active {
            shared.publish_if_holder(&shared.node, self.term, None);
        }
        self.ended = Some(reason);
        ControlFlow::Break(())
    }

    /// Waits for the next event until the keeper's next wake: an answer
    /// (returned for [`answered`](Leading::answered)), a command, a hint,
    /// the connection's death; `Break` when the handle is dropped or asks
    /// for the release.
    async fn wait(
        &mut self,
        commands: &mut mpsc::UnboundedReceiver<Command>,
        notices: &mut broadcast::Receiver<Notice>,
        resign_payload: &str,
    ) -> ControlFlow<(), Option<(Instant, Result<Answer>)>> {
        let wake = self
            .keeper
            .next_wake()
            .expect("BUG: a live keeper has a wake time");
        let live = matches!(self.keeper.phase(), Phase::Pending | Phase::Active);
        let Leading {
            backend,
            state,
            keeper,
            in_flight,
            ..
        } = self;
        let (backend, state) = (*backend, *state);
        tokio::select! {
            biased;
            // Ended by the watchdog: let go at once (the top of the loop).
            _ = state.token().cancelled(), if live => {}
            _ = backend.closed() => keeper.connection_lost(),
            cmd = commands.recv() => match cmd {
                None => {
                    state.end_counted(LossReason::Dropped, self.was_active);
                    backend.let_go(None);
                    return ControlFlow::Break(());
                }
                Some(Command::Stop { reason }) => keeper.stop_requested(reason, Instant::now()),
                Some(Command::Release { reason, reply }) => {
                    self.release_reply = Some((reason, reply));
                    return ControlFlow::Break(());
                }
            },
            (sent, result) = async { in_flight.as_mut().expect("BUG: guarded").await }, if in_flight.is_some() => {
                *in_flight = None;
                return ControlFlow::Continue(Some((sent, result)));
            }
            // A batch that renewed this leader with the others on its
            // connection: the same news as an answer to its own renewal
            // sent at that moment (its rows were read then), so that the
            // leaders on one connection keep one schedule.
            (sent, result) = backend.pushed(), if in_flight.is_none() => {
                return ControlFlow::Continue(Some((sent, result)));
            }
            // Our statement waits behind others on a shared connection:
            // their answers show the session alive meanwhile.
            sent = backend.answered(), if in_flight.is_some() => {
                keeper.alive_at(sent);
            }
            n = notices.recv() => {
                if let Ok(n) = n {
                    // Only a hint: anyone who can connect may send it. The
                    // renewal it brings forward reads the row, which only
                    // `request_resign` (a granted privilege) marks.
                    // The same hint is sent by a registering candidate of
                    // higher priority: the renewal also reads the
                    // candidate registry against pg_locks.
                    if n.channel == RESIGN_CHANNEL && n.payload == resign_payload {
                        tracing::debug!("resign hint heard; checking the lease row and the candidates");
                        self.rechecks = PENDING_RECHECKS;
                        keeper.check_requested(Instant::now());
                    }
                }
            }
            _ = tokio::time::sleep_until(wake) => {}
        }
        ControlFlow::Continue(None)
    }

    /// Tells the keeper what a renewal or heartbeat sent at `sent` found.
    fn answered(&mut self, sent: Instant, result: Result<Answer>, now: Instant) {
        let (shared, keeper) = (self.shared, &mut self.keeper);
        match result {
            Ok(Answer::Renewed {
                row,
                resign_requested,
                preferred,
            }) => {
                self.failures = 0;
                shared.contact.touch();
                self.renewed(sent, now, row, resign_requested, preferred);
            }
            Ok(Answer::NotOurs) => {
                shared.contact.touch();
                tracing::warn!("renewal found the lease row no longer ours: preempted");
                keeper.preempted();
            }
            Ok(Answer::Busy) => {
                shared.contact.touch();
                tracing::debug!(deadline_in = ?keeper.deadline().saturating_duration_since(now), "the lease row is held by a fenced transaction; renewing again soon");
                keeper.renew_busy(now);
            }
            Ok(Answer::Alive) => {
                shared.contact.touch();
                keeper.heartbeat_ok(now);
            }
            Ok(Answer::ReadOnly) => {
                shared.contact.touch();
                tracing::warn!(
                    "the server accepts no writes (transaction_read_only is on): demoted or fenced"
                );
                keeper.server_read_only();
            }
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                self.failed(&e, now);
            }
        }
    }

    /// A renewal sent at `sent` found the lease row still ours.
    fn renewed(
        &mut self,
        sent: Instant,
        now: Instant,
        row: Option<(SystemTime, SystemTime)>,
        resign_requested: bool,
        preferred: Preferred,
    ) {
        let (shared, keeper) = (self.shared, &mut self.keeper);
        keeper.renewed(sent, now);
        self.state.set_deadline(keeper.deadline());
        let remaining = keeper.deadline().saturating_duration_since(now);
        metrics::renewed(&shared.role, now - sent, remaining);
        tracing::trace!(deadline_in = ?remaining, "renewed");
        // Watchers see the renewal: while leading, a session elector's
        // observer is closed and the leader is the one that knows.
        if let Some((renewed_at, lease_until)) = row {
            shared.leader.send_if_modified(|cur| match cur {
                Some(c) if c.holder == shared.node && c.term.get() == self.term => {
                    c.renewed_at = renewed_at;
                    c.lease_until = lease_until;
                    c.lease_expired = false;
                    true
                }
                _ => false,
            });
        }
        if resign_requested {
            tracing::info!("resignation requested for this term (lease row)");
            keeper.stop_requested(LossReason::Resigned, now);
        } else if let Some(to) = preferred.ready {
            tracing::info!(to = %to, "a ready candidate of higher priority stands");
            keeper.stop_requested(LossReason::HandedOver, now);
        } else if preferred.pending && self.rechecks > 0 {
            self.rechecks -= 1;
            keeper.check_requested(now);
        }
    }

    /// A renewal or heartbeat failed (the `failures`-th in a row).
    fn failed(&mut self, e: &Error, now: Instant) {
        let keeper = &mut self.keeper;
        let deadline_in = keeper.deadline().saturating_duration_since(now);
        match self.backend.failed(e, self.failures) {
            Failed::ConnectionLost => {
                tracing::warn!(error = %e, "lock connection failed");
                keeper.connection_lost();
            }
            Failed::ServerReadOnly => {
                tracing::warn!(error = %e, "the server accepts no writes: demoted or fenced");
                keeper.server_read_only();
            }
            Failed::RetrySoon => {
                tracing::warn!(error = %e, "renewal failed; retrying until the deadline");
                keeper.renew_failed(now);
            }
            Failed::ReadOnlyRetryAfter(wait) => {
                tracing::warn!(error = %e, retry_in = ?wait, deadline_in = ?deadline_in, "the server accepts no writes (demoted or fenced); retrying on a new connection until the deadline");
                keeper.renew_refused_read_only(now, wait);
            }
            Failed::RetryAfter(wait) => {
                tracing::warn!(error = %e, retry_in = ?wait, deadline_in = ?deadline_in, "renewal failed; retrying until the deadline");
                keeper.renew_retry(now, wait);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use super::*;
    use crate::election::keeper::Liveness;
    use crate::election::timing::TimingRequest;
    use crate::election::{Backend, Elector, Term};
    use crate::schema::SchemaName;
    use crate::ConnectOptions;

    /// A backend whose renewals answer from a script, and which logs what
    /// the driver asks of it.
    struct Scripted {
        answers: Mutex<VecDeque<Answer>>,
        log: Arc<Mutex<Vec<String>>>,
        /// Each renewal holds its worker thread this long in one poll (CPU
        /// work in a poll, as a debug build's SCRAM exchange was).
        hold_worker: Duration,
    }

    impl Scripted {
        fn note(&self, what: String) {
            self.log.lock().unwrap().push(what);
        }
    }

    impl KeepBackend for Scripted {
        const FINISH_IN_FLIGHT_BEFORE_RELEASE: bool = true;

        fn renew(&self) -> Statement<'_> {
            Box::pin(async move {
                let sent = Instant::now();
                std::thread::sleep(self.hold_worker);
                tokio::time::sleep(Duration::from_millis(5)).await;
                self.note("renew".into());
                let answer = self.answers.lock().unwrap().pop_front();
                let answer = answer.unwrap_or(Answer::Renewed {
                    row: None,
                    resign_requested: false,
                    preferred: Preferred::default(),
                });
                (sent, Ok(answer))
            })
        }

        fn heartbeat(&self) -> Statement<'_> {
            Box::pin(async { (Instant::now(), Ok(Answer::Alive)) })
        }

        fn closed(&self) -> impl Future<Output = ()> + Send + '_ {
            std::future::pending()
        }

        fn failed(&self, _error: &Error, _failures: u32) -> Failed {
            Failed::RetrySoon
        }

        fn let_go(&self, reason: Option<LossReason>) {
            self.note(format!("let go {reason:?}"));
        }

        fn releasable_after(&self, reason: LossReason) -> bool {
            reason == LossReason::Deadline
        }

        async fn release(self, ended: Option<LossReason>) -> Result<()> {
            self.note(format!("release after {ended:?}"));
            Ok(())
        }

        async fn close(self) {
            self.note("close".into());
        }
    }

    struct Running {
        state: Arc<LeaderState>,
        commands: mpsc::UnboundedSender<Command>,
        log: Arc<Mutex<Vec<String>>>,
        _elector: Elector,
        _notices: broadcast::Sender<Notice>,
    }

    fn start(answers: Vec<Answer>) -> Running {
        start_holding(answers, Duration::ZERO)
    }

    fn start_holding(answers: Vec<Answer>, hold_worker: Duration) -> Running {
        let options = ConnectOptions::from_url("postgres://app@localhost/app").unwrap();
        let elector = Elector::builder(options, "r")
            .backend(Backend::Lease)
            .build()
            .unwrap();
        let timing = TimingRequest {
            ttl: Some(Duration::from_millis(2000)),
            renew_every: Some(Duration::from_millis(500)),
            heartbeat_timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        }
        .validate_lease()
        .unwrap();
        let now = Instant::now();
        let keeper = Keeper::new(timing, Liveness::statements(), now, now, false);
        let state = Arc::new(LeaderState::new(
            "r".into(),
            SchemaName::default(),
            Term::new(1),
            keeper.deadline(),
        ));
        let (commands, rx) = mpsc::unbounded_channel();
        let (notices_tx, notices) = broadcast::channel(4);
        let log = Arc::new(Mutex::new(Vec::new()));
        let backend = Scripted {
            answers: Mutex::new(answers.into()),
            log: log.clone(),
            hold_worker,
        };
        let keep = Keep::new(
            elector.shared.clone(),
            backend,
            keeper,
            state.clone(),
            rx,
            notices,
        );
        if hold_worker.is_zero() {
            // The paused-clock tests: the watchdog thread runs on the real
            // clock, which a paused test's deadlines do not follow.
            tokio::spawn(keep.run());
        } else {
            keep.spawn(tracing::Span::none());
        }
        Running {
            state,
            commands,
            log,
            _elector: elector,
            _notices: notices_tx,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_finds_the_row_taken_ends_leadership_and_lets_go() {
        let r = start(vec![
            Answer::Renewed {
                row: None,
                resign_requested: false,
                preferred: Preferred::default(),
            },
            Answer::NotOurs,
        ]);
        r.state.token().cancelled().await;
        assert_eq!(r.state.reason(), Some(LossReason::Preempted));
        tokio::time::sleep(Duration::from_millis(10)).await;
        let log = r.log.lock().unwrap().clone();
        assert_eq!(log, ["renew", "renew", "let go Some(Preempted)", "close"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_ready_preferred_candidate_makes_the_leader_hand_over_then_release() {
        let r = start(vec![Answer::Renewed {
            row: None,
            resign_requested: false,
            preferred: Preferred {
                ready: Some("b".into()),
                pending: false,
            },
        }]);
        // Like a resign request: the duties stop, the lock is kept for a
        // clean release.
        r.state.token().cancelled().await;
        assert_eq!(r.state.reason(), Some(LossReason::HandedOver));
        let log = release(&r).await;
        assert_eq!(log, ["renew", "release after None"]);
        assert_eq!(r.state.reason(), Some(LossReason::HandedOver));
    }

    /// Releases the leadership as a resignation does and returns the
    /// backend's log.
    async fn release(r: &Running) -> Vec<String> {
        let (reply, answer) = oneshot::channel();
        r.commands
            .send(Command::Release {
                reason: LossReason::Resigned,
                reply,
            })
            .unwrap();
        answer.await.unwrap().unwrap();
        r.log.lock().unwrap().clone()
    }

    fn renewals(r: &Running) -> usize {
        r.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| *l == "renew")
            .count()
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_hint_a_preferred_candidate_not_yet_waiting_is_checked_again_a_bounded_number_of_times(
    ) {
        let pending = || Answer::Renewed {
            row: None,
            resign_requested: false,
            preferred: Preferred {
                ready: None,
                pending: true,
            },
        };
        let r = start((0..200).map(|_| pending()).collect());
        // Renewals every 500 ms on their own.
        tokio::time::sleep(Duration::from_millis(1250)).await;
        let regular = renewals(&r);
        assert_eq!(regular, 2, "{:?}", r.log.lock().unwrap());
        r._notices
            .send(Notice {
                channel: RESIGN_CHANNEL.into(),
                payload: "pgelect:r".into(),
            })
            .unwrap();
        // One check at once, then one per 100 ms while the candidate does
        // not wait yet, ten at most.
        tokio::time::sleep(Duration::from_millis(1240)).await;
        let after_hint = renewals(&r) - regular;
        assert_eq!(after_hint, 11, "{:?}", r.log.lock().unwrap());
        // Then back to the schedule (every 500 ms).
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(renewals(&r) - regular - after_hint, 2);
        assert!(!r.state.token().is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn a_resign_request_stops_the_duties_and_release_reports_its_outcome() {
        let r = start(vec![Answer::Renewed {
            row: None,
            resign_requested: true,
            preferred: Preferred::default(),
        }]);
        // The lease row's mark cancels the token but keeps the lease.
        r.state.token().cancelled().await;
        assert_eq!(r.state.reason(), Some(LossReason::Resigned));
        let log = release(&r).await;
        assert_eq!(log.first().map(String::as_str), Some("renew"));
        assert_eq!(log.last().map(String::as_str), Some("release after None"));
    }

    /// A keeper task held up in one long poll (3 s of CPU in a renewal)
    /// cannot keep the leadership past its deadline: the watchdog thread
    /// ends it on time, and the keeper lets go once it runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_keeper_held_up_in_a_long_poll_still_ends_the_leadership_at_its_deadline() {
        let start = Instant::now();
        let r = start_holding(Vec::new(), Duration::from_secs(3));
        let context = crate::election::LeaderContext::new(r.state.clone());
        // ttl 2 s: the local deadline is 1.6 s after the electing statement.
        let budget = Duration::from_millis(1600);
        tokio::time::timeout(Duration::from_secs(10), context.lost())
            .await
            .expect("leadership ends");
        let lost = start.elapsed();
        println!("lost {lost:?} after the start (deadline {budget:?}; the renewal's poll holds its worker until 3.5 s)");
        assert_eq!(r.state.reason(), Some(LossReason::Deadline));
        assert!(lost >= budget, "lost before the deadline: {lost:?}");
        assert!(
            lost < Duration::from_millis(2500),
            "lost only when the keeper ran again: {lost:?}"
        );
        // The keeper, once its poll returned, let go of the lock.
        tokio::time::timeout(Duration::from_secs(10), async {
            while !r
                .log
                .lock()
                .unwrap()
                .iter()
                .any(|l| l.starts_with("let go"))
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the keeper lets go");
        let log = r.log.lock().unwrap().clone();
        assert!(log.contains(&"let go Some(Deadline)".to_owned()), "{log:?}");
    }
}
