//! Gaining leadership on the lease backend: an elector's campaign (take
//! the lease when it is free or expired on the server's clock), the start
//! of a leadership, and the client's standby task, which registers the
//! standbys and tries them all in one acquire per poll.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::election::config_error::ConfigError;
use crate::error::{Error, Result};
use crate::metrics;

use crate::election::backend::batch::chunks;
use crate::election::config::random_u64;
use crate::election::driver::Keep;
use crate::election::keeper::{Action, Keeper, Liveness};
use crate::election::leadership::{LeaderContext, LeaderState, Leadership};
use crate::election::registry::Registration;
use crate::election::registry::{Register, Waits};
use crate::election::support::{is_transient, retry_backoff, step_aside, WakeOn};
use crate::election::watch::LeaderInfo;
use crate::election::{Backend, ElectorState, LeaseState, Term};

use super::keep::LeaseKeep;
use super::sql::{ms, Entry};
use super::{Inner, SharedLease, CHUNK_ROWS, PATIENT_BOUND};

/// Campaigns until elected: the client's acquire tries the role at every
/// poll, and the first win that arrives in time is kept, with this
/// elector's renewals in the client's renewal batch. Release announcements
/// heard on the elector's own `LISTEN` connection bring the next poll
/// forward. Transient failures (connection refused or reset, pooler
/// restarting, timeouts) are retried by the client; a missing schema, a
/// permission error or a role held by the session backend are returned.
pub(crate) async fn campaign(shared: &Arc<ElectorState>, lease: &LeaseState) -> Result<Leadership> {
    let span = tracing::info_span!("pgelect.campaign", role = %shared.role, node = %shared.node, backend = "lease");
    async {
        let client = lease.client.client();
        let mut notices = lease.notices.subscribe();
        shared.ensure_lease_listener();
        let schema = shared.options.schema_name().as_str();
        let bound = shared.timing.heartbeat_timeout;
        let interval = shared.timing.retry_every;
        let term_of = || client.term_of(&shared.role, bound);
        step_aside(shared, &lease.stepped_aside, interval, || lease.notices.subscribe(), term_of).await;
        let released = WakeOn::Released {
            schema,
            role: &shared.role,
        };
        let mut failures = 0u32;
        loop {
            let mut member = client.join_standbys(shared);
            let won = loop {
                tokio::select! {
                    won = member.won() => break won,
                    n = notices.recv() => match n {
                        Ok(n) if released.wanted(&n) => {
                            client.wake_standbys(Some(&shared.role), false);
                        }
                        Ok(_) => {}
                        // Missed announcements: poll as if one was ours.
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            client.wake_standbys(Some(&shared.role), false);
                        }
                        // Never: the sender lives in `shared`.
                        Err(broadcast::error::RecvError::Closed) => break member.won().await,
                    },
                }
            };
            let won = match won {
                Ok(won) => won,
                Err(e) if is_transient(&e) => {
                    // The client's task is gone (never while it lives): wait
                    // and stand again.
                    failures = failures.saturating_add(1);
                    tokio::time::sleep(retry_backoff(&shared.options, failures).min(shared.timing.retry_every)).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            drop(member);
            if won.prev_holder.is_some() && won.prev_backend.as_deref() == Some("session") {
                tracing::warn!(previous = ?won.prev_holder, "took over an expired lease of a session-backend leader: all candidates of a role should use one backend");
            }
            if let Some(l) = elected(
                shared,
                lease,
                &client,
                Term::new(won.term),
                won.sent,
                won.acquired_at,
                won.lease_until,
            )
            .await
            {
                return Ok(l);
            }
        }
    }
    .instrument(span)
    .await
}

/// The lease was won by a statement sent at `sent`: starts the keeper task
/// and returns the handle, or `None` if the answer came so late that the
/// local deadline already passed (the lease is then released unused).
async fn elected(
    shared: &Arc<ElectorState>,
    lease: &LeaseState,
    client: &SharedLease,
    term: Term,
    sent: Instant,
    acquired_at: SystemTime,
    lease_until: SystemTime,
) -> Option<Leadership> {
    // Active at once: a lease is taken over only after it expired on the
    // server or was released, so there is no handover delay to wait.
    let mut keeper = Keeper::new(shared.timing, Liveness::statements(), sent, sent, false);
    let now = Instant::now();
    match keeper.poll(now) {
        Some(Action::Activate) => {}
        other => {
            tracing::warn!(term = term.get(), action = ?other, "won the lease past the local deadline; releasing it unused");
            let _ = client.release(shared, term.get()).await;
            return None;
        }
    }
    tracing::info!(
        term = term.get(),
        took = ?now - sent,
        "leadership begins (lease)"
    );
    metrics::leader_on(&shared.role, term.get(), now - sent);
    shared.publish(Some(LeaderInfo {
        role: shared.role.clone(),
        holder: shared.node.clone(),
        holder_meta: shared.meta.clone(),
        term,
        backend: Some("lease".into()),
        acquired_at,
        renewed_at: acquired_at,
        lease_until,
        lease_expired: false,
        holder_pid: None,
    }));
    let state = Arc::new(LeaderState::new(
        shared.role.clone(),
        shared.options.schema_name().clone(),
        term,
        keeper.deadline(),
    ));
    let (commands, rx) = mpsc::unbounded_channel();
    let notices = lease.notices.subscribe();
    let span = tracing::info_span!("pgelect.leader", role = %shared.role, node = %shared.node, term = term.get(), backend = "lease");
    let backend = LeaseKeep::new(shared, client, term.get());
    let keep = Keep::new(shared.clone(), backend, keeper, state.clone(), rx, notices);
    keep.spawn(span);
    Some(Leadership {
        context: LeaderContext::new(state),
        commands,
    })
}

/// How many standbys one chunk of the batched acquire tries at most. At
/// steady state the acquire only reads the rows of led roles (one index
/// probe each), and it is sent every `retry_every`: with 10,000 roles over
/// 3 candidates, chunks of 2,000 would make 4 acquires a second per
/// candidate, chunks of 5,000 make 2 (as the session backend's polls).
pub(super) const ACQUIRE_ROWS: usize = 5000;

/// The fewest standbys an acquire chunk is cut down to after timeouts.
const MIN_ACQUIRE_ROWS: usize = 250;

/// How long a new standby waits for others to share its first poll.
const NEW_STANDBY_WAIT: Duration = Duration::from_millis(20);

/// How soon a standby tries again when its role was announced released
/// while an acquire that included it was in flight (that acquire may have
/// read the row before the release). At most one such retry follows each
/// acquire, so forged announcements cost at most 10 acquires a second.
const REWAKE_GAP: Duration = Duration::from_millis(100);

/// How many unanswered acquire tokens are remembered.
const UNANSWERED_TOKENS: usize = 16;

/// The largest jitter added to a standby's next acquire after the lease's
/// server-reported expiry, so that standbys do not all fire at once. A
/// twentieth of the TTL below a TTL of 1 s (25 ms at 500 ms), so that a
/// short lease is taken over within `ttl` + 50 ms, round trips included.
const MAX_JITTER: Duration = Duration::from_millis(50);

/// How often a standby's full registration (the upsert that also deletes
/// dead candidates' rows and hints a leader of lower priority) is sent
/// again; between two, its polls refresh its `seen_at`.
const FULL_REGISTRATION_EVERY: Duration = Duration::from_secs(600);

/// The share of its TTL after its last `seen_at` refresh by which a
/// standby polls again (a poll refreshes it once it is half a TTL old):
/// nine tenths, so that a standby that polls once per lease expiry (every
/// two thirds to one TTL while the leader renews) stays ready with one
/// statement per poll, and a tenth of the TTL is left for a late poll.
const REFRESH_WITHIN: (u32, u32) = (9, 10);

/// A standby's entry in the batched acquire and registration.
pub(super) struct Standby {
    pub(super) id: u64,
    pub(super) node: String,
    pub(super) meta: Option<serde_json::Value>,
    pub(super) ttl_ms: i64,
    pub(super) ttl: Duration,
    pub(super) priority: i32,
    pub(super) payload: String,
    pub(super) retry_every: Duration,
    /// When the next acquire of this role is due.
    pub(super) due: Instant,
    /// When the next full registration of this standby is due: at once
    /// when it joins, then every [`FULL_REGISTRATION_EVERY`], and at once
    /// again when a poll finds its row gone. In between, the polls refresh
    /// the row's `seen_at` themselves.
    pub(super) register_due: Instant,
    /// The latest moment of the next poll that keeps the registration
    /// fresh: [`REFRESH_WITHIN`] of its TTL after its `seen_at` was last
    /// refreshed (readiness is "seen within its TTL" on the server).
    pub(super) refresh_by: Instant,
    /// When its role was last announced released (or announcements may
    /// have been missed): an acquire sent before then may not have seen it.
    pub(super) woken_at: Option<Instant>,
    /// Whether a release of its role was heard since its last acquire (a
    /// real announcement, not a wake-up for announcements that may have
    /// been missed): the next acquire then takes the listening connection
    /// if it is ready (see `SharedLease::exec_direct`).
    pub(super) announced: bool,
    pub(super) registration: Registration,
    /// For the elector's last-contact time.
    pub(super) shared: Weak<ElectorState>,
    /// Where a win (or a refusal) goes; taken when sent.
    pub(super) won: Option<oneshot::Sender<Result<Won>>>,
}

/// A lease won by a batched acquire.
#[derive(Debug)]
pub(super) struct Won {
    /// When the statement that won it was sent.
    pub(super) sent: Instant,
    pub(super) term: i64,
    pub(super) acquired_at: SystemTime,
    pub(super) lease_until: SystemTime,
    /// The row as it was before: holder and backend.
    pub(super) prev_holder: Option<String>,
    pub(super) prev_backend: Option<String>,
}

/// A standby's place in the batched acquire; leaves it when dropped.
pub(super) struct StandbyMember {
    client: SharedLease,
    role: String,
    id: u64,
    outcome: oneshot::Receiver<Result<Won>>,
}

impl StandbyMember {
    /// Completes when a batched acquire won the role's lease, or with the
    /// error that refused the role to this standby.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a lease won after the member was dropped is released
    /// by the client.
    pub(super) async fn won(&mut self) -> Result<Won> {
        match (&mut self.outcome).await {
            Ok(r) => r,
            // The client's task ended (never while a handle lives).
            Err(_) => Err(Error::connection_lost("take the lease")),
        }
    }
}

impl Drop for StandbyMember {
    fn drop(&mut self) {
        let mut standbys = self.client.inner.standbys();
        if standbys.get(&self.role).is_some_and(|s| s.id == self.id) {
            standbys.remove(&self.role);
        }
    }
}

impl SharedLease {
    /// Enters the standby of `shared`'s role into the batched acquire
    /// (and registration); its first poll is sent within
    /// [`NEW_STANDBY_WAIT`].
    pub(super) fn join_standbys(&self, shared: &Arc<ElectorState>) -> StandbyMember {
        self.ensure_started();
        let s = shared.options.schema_name().as_str();
        let (tx, rx) = oneshot::channel();
        let id = self.inner.next_standby.fetch_add(1, Ordering::Relaxed);
        let first = Instant::now()
            + if self.inner.shares {
                NEW_STANDBY_WAIT
            } else {
                Duration::ZERO
            };
        let register = Register::new(shared, Waits::Lease);
        self.inner.standbys().insert(
            shared.role.clone(),
            Standby {
                id,
                node: shared.node.clone(),
                meta: shared.meta.clone(),
                ttl_ms: shared.timing.ttl.as_millis() as i64,
                ttl: shared.timing.ttl,
                priority: shared.priority,
                payload: format!("{s}:elected:{}", shared.role),
                retry_every: shared.timing.retry_every,
                due: first,
                register_due: first,
                refresh_by: first + shared.timing.ttl,
                woken_at: None,
                announced: false,
                registration: register.entry(shared),
                shared: Arc::downgrade(shared),
                won: Some(tx),
            },
        );
        self.inner.joined.notify_one();
        StandbyMember {
            client: self.clone(),
            role: shared.role.clone(),
            id,
            outcome: rx,
        }
    }
}

/// The standby task: registers the standbys that are due and sends the
/// batched acquire for all standbys when the earliest one is due; ends
/// with the client.
pub(super) async fn standby_batches(
    inner: Weak<Inner>,
    joined: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        let next = match inner.upgrade() {
            Some(i) => {
                let standbys = i.standbys();
                standbys.values().map(|s| s.due.min(s.register_due)).min()
            }
            None => return,
        };
        // A standby already due (an early acquire a release announcement
        // brought) goes at once: a timer for a moment already past fires
        // only at the timer's next tick, up to a millisecond later.
        if next.is_none_or(|at| at > Instant::now()) {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = joined.notified() => continue,
                _ = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        } else if stop.is_cancelled() {
            return;
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let client = SharedLease { inner };
        register_due(&client).await;
        let now = Instant::now();
        let due = client.inner.standbys().values().any(|s| s.due <= now);
        if !due {
            continue;
        }
        if acquire_all(&client).await {
            failures = 0;
        } else {
            failures = failures.saturating_add(1);
            let wait = retry_backoff(&client.inner.options, failures);
            let now = Instant::now();
            for s in client.inner.standbys().values_mut() {
                s.due = now + wait.min(s.retry_every);
            }
        }
    }
}

/// Registers (upserts in the registry) every standby whose registration
/// is due within a quarter of its TTL, in chunks.
async fn register_due(client: &SharedLease) {
    let now = Instant::now();
    let mut due: Vec<(String, Registration)> = client
        .inner
        .standbys()
        .iter()
        .filter(|(_, s)| s.register_due <= now + s.ttl / 4)
        .map(|(role, s)| {
            let r = &s.registration;
            (
                role.clone(),
                Registration {
                    role: r.role.clone(),
                    node: r.node.clone(),
                    priority: r.priority,
                    standby: r.standby,
                    timing: r.timing.clone(),
                    meta: r.meta.clone(),
                    payload: r.payload.clone(),
                },
            )
        })
        .collect();
    if due.is_empty() {
        return;
    }
    // In role order, so that concurrent registrations lock rows in one
    // order.
    due.sort_by(|a, b| a.0.cmp(&b.0));
    for chunk in chunks(due.len(), CHUNK_ROWS) {
        let part = &due[chunk];
        match register_chunk(client, part).await {
            Ok(()) => {}
            Err(e) if is_transient(&e) => {
                tracing::warn!(error = %e, candidates = part.len(), "the batched registration failed; retrying");
            }
            Err(e) => {
                let roles: Vec<&str> = part.iter().map(|r| r.0.as_str()).collect();
                let alone = |i: usize| register_chunk(client, &part[i..=i]);
                if !refuse(client, &roles, e, alone).await {
                    return;
                }
            }
        }
    }
}

/// Registers the standbys of `part`, and schedules their next
/// registration; returns the statement's error.
async fn register_chunk(client: &SharedLease, part: &[(String, Registration)]) -> Result<()> {
    let registrations: Vec<&Registration> = part.iter().map(|r| &r.1).collect();
    let (sent, r) = client.register(&registrations, PATIENT_BOUND).await;
    tracing::debug!(candidates = part.len(), took = ?sent.elapsed(), "batched lease registration");
    let mut standbys = client.inner.standbys();
    for (role, _) in part {
        if let Some(s) = standbys.get_mut(role) {
            match &r {
                // Readiness is "seen within ttl" on the server's clock; the
                // polls refresh it from now on.
                Ok(()) => {
                    s.register_due = sent + FULL_REGISTRATION_EVERY;
                    s.refresh_by = refresh_by(sent, s.ttl);
                }
                Err(_) => s.register_due = Instant::now() + s.retry_every,
            }
        }
    }
    r
}

/// A batched statement for the standbys of `roles` failed in a way that
/// retrying does not cure (a missing schema or privilege, a refused
/// login): each of them is handed the error, as a lone candidate's
/// `leadership()` returns it, and leaves. An error that carries no driver
/// error names the client's setup and is copied to each. Any other is
/// learnt by each standby with a statement of its own (`alone(i)` for
/// `roles[i]`, one after another), so that each gets its own error and
/// one standby's fault is not blamed on the others; a failed statement
/// took nothing. False when a transient failure cut that short.
async fn refuse<F, Fut>(client: &SharedLease, roles: &[&str], e: Error, mut alone: F) -> bool
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    tracing::warn!(error = %e, standbys = roles.len(), "a batched lease statement was refused; its candidates get the error");
    if e.copied().is_some() {
        for role in roles {
            if let Some(e) = e.copied() {
                refuse_one(client, role, e);
            }
        }
        return true;
    }
    for (i, role) in roles.iter().enumerate() {
        match alone(i).await {
            Ok(()) => {}
            Err(e) if is_transient(&e) => return false,
            Err(e) => refuse_one(client, role, e),
        }
    }
    true
}

/// Hands `e` to the standby of `role`, which leaves the batch.
fn refuse_one(client: &SharedLease, role: &str, e: Error) {
    let mut standbys = client.inner.standbys();
    if let Some(mut s) = standbys.remove(role) {
        if let Some(tx) = s.won.take() {
            let _ = tx.send(Err(e));
        }
    }
}

/// The latest next poll of a standby whose registration was refreshed at
/// `seen` (see [`REFRESH_WITHIN`]).
fn refresh_by(seen: Instant, ttl: Duration) -> Instant {
    seen + ttl * REFRESH_WITHIN.0 / REFRESH_WITHIN.1
}

/// The largest jitter for `ttl`: [`MAX_JITTER`], a twentieth of the TTL
/// below 1 s.
fn max_jitter(ttl: Duration) -> Duration {
    MAX_JITTER.min(ttl / 20)
}

/// Up to [`max_jitter`] after an expiry, so that the candidates do not all
/// fire at once.
fn jitter(ttl: Duration) -> Duration {
    Duration::from_millis(random_u64() % (max_jitter(ttl).as_millis() as u64 + 1))
}

/// Sends the batched acquire for every standby, in chunks; hands each won
/// role to its standby and schedules the others' next attempt. False when
/// a statement failed.
async fn acquire_all(client: &SharedLease) -> bool {
    let mut entries: Vec<Entry> = client
        .inner
        .standbys()
        .iter()
        .map(|(role, s)| {
            (
                role.clone(),
                s.node.clone(),
                s.meta.clone(),
                s.ttl_ms,
                s.payload.clone(),
                s.priority,
            )
        })
        .collect();
    if entries.is_empty() {
        return true;
    }
    // Brought forward by a release announcement: on the listening
    // connection if it is ready (see `SharedLease::exec_direct`).
    let direct = client.inner.standbys().values().any(|s| s.announced);
    // From this client's own place in role order (see `offset`); each chunk
    // is sorted again below, so every statement locks its rows in role
    // order and concurrent acquires cannot deadlock.
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let at = client.inner.offset % entries.len();
    entries.rotate_left(at);
    // The statement's bound: a third of the shortest TTL, within 2 to 5 s
    // (renewals wait behind it).
    let bound = {
        let standbys = client.inner.standbys();
        let ttl = standbys.values().map(|s| s.ttl).min().unwrap_or_default();
        (ttl / 3).clamp(PATIENT_BOUND, Duration::from_secs(5))
    };
    let size = client.inner.acquire_rows.load(Ordering::Relaxed);
    for chunk in chunks(entries.len(), size) {
        let part = &mut entries[chunk];
        part.sort_by(|a, b| a.0.cmp(&b.0));
        let part = &*part;
        match acquire_chunk(client, part, bound, direct).await {
            Ok(()) => {}
            Err(e) if is_transient(&e) => return false,
            Err(e) => {
                let roles: Vec<&str> = part.iter().map(|e| e.0.as_str()).collect();
                let alone = |i: usize| acquire_chunk(client, &part[i..=i], bound, false);
                if !refuse(client, &roles, e, alone).await {
                    return false;
                }
            }
        }
    }
    true
}

/// Sends the batched acquire for `part`; hands each won role to its
/// standby and schedules the others' next attempt. Returns the statement's
/// error.
async fn acquire_chunk(
    client: &SharedLease,
    part: &[Entry],
    bound: Duration,
    direct: bool,
) -> Result<()> {
    let token = random_u64() as i64;
    let unanswered: Vec<i64> = client.inner.unanswered().iter().copied().collect();
    let (sent, r) = client
        .acquire(part, token, &unanswered, bound, direct)
        .await;
    tracing::debug!(standbys = part.len(), took = ?sent.elapsed(), "batched lease acquire");
    let decoded = match r {
        Ok(decoded) => decoded,
        Err(e) => {
            // Unless the server answered with an error (nothing
            // committed), the statement may have committed: the leases
            // it took name our nodes and nobody acts on them.
            let answered =
                matches!(&e, Error::Database { source, .. } if source.as_db_error().is_some());
            if !answered {
                let mut u = client.inner.unanswered();
                if u.len() >= UNANSWERED_TOKENS {
                    u.pop_front();
                }
                u.push_back(token);
                // Smaller chunks hold fewer rows for less time.
                let smaller = (part.len() / 2).max(MIN_ACQUIRE_ROWS);
                client.inner.acquire_rows.store(smaller, Ordering::Relaxed);
            }
            tracing::warn!(error = %e, standbys = part.len(), "the batched lease acquire failed");
            return Err(e);
        }
    };
    let size = client.inner.acquire_rows.load(Ordering::Relaxed);
    let grown = (size * 2).min(ACQUIRE_ROWS);
    client.inner.acquire_rows.store(grown, Ordering::Relaxed);
    let now = Instant::now();
    let mut unclaimed = Vec::new();
    {
        let mut standbys = client.inner.standbys();
        for a in decoded {
            let entry = standbys.get_mut(&a.role);
            if let Some(shared) = entry.as_ref().and_then(|e| e.shared.upgrade()) {
                shared.contact.touch();
            }
            match (a.won, entry) {
                (Some((term, acquired_at, lease_until)), Some(e)) => {
                    let node = e.node.clone();
                    let tx = e.won.take();
                    standbys.remove(&a.role);
                    let won = Won {
                        sent,
                        term,
                        acquired_at,
                        lease_until,
                        prev_holder: a.prev_holder,
                        prev_backend: a.prev_backend,
                    };
                    if tx.is_none_or(|tx| tx.send(Ok(won)).is_err()) {
                        unclaimed.push((a.role, node, term));
                    }
                }
                (Some((term, _, _)), None) => {
                    // The standby left while the statement ran.
                    let node = part
                        .iter()
                        .find(|e| e.0 == a.role)
                        .map(|e| e.1.clone())
                        .unwrap_or_default();
                    unclaimed.push((a.role, node, term));
                }
                (None, None) => {}
                (None, Some(e)) => {
                    let remaining = a.prev_remaining.unwrap_or(0.0);
                    if a.rearmed {
                        tracing::info!(role = a.role, holder = ?a.prev_holder, lease = ?ms(remaining), "the lease row was last written before this server's promotion and may lack the old primary's last renewals: re-armed it for a full TTL before anyone takes it over");
                    }
                    if a.prev_holder.is_some()
                        && a.prev_backend.as_deref() == Some("session")
                        && remaining > 0.0
                    {
                        let err = Error::Config(ConfigError::OtherBackendLeads {
                            role: a.role.clone(),
                            holder: a.prev_holder.clone(),
                            leader: Backend::Session,
                        });
                        if let Some(tx) = e.won.take() {
                            let _ = tx.send(Err(err));
                        }
                        standbys.remove(&a.role);
                        continue;
                    }
                    let wait = if a.deferred_to.is_some() {
                        // Left to a candidate of higher priority seen
                        // within its TTL; its registration goes stale
                        // within a TTL if it never takes the lease.
                        e.retry_every
                    } else {
                        let left = if a.prev_holder.is_some() {
                            ms(remaining)
                        } else {
                            Duration::ZERO
                        };
                        (left + jitter(e.ttl)).min(e.retry_every)
                    };
                    // Announced released after this statement was sent:
                    // it may have read the row before the release.
                    e.announced = false;
                    let wait = match e.woken_at.take() {
                        Some(w) if w >= sent => wait.min(REWAKE_GAP),
                        _ => wait,
                    };
                    match a.seen_age {
                        // Refreshed by this poll (age 0) or earlier.
                        Some(age) => {
                            let seen = sent.checked_sub(age).unwrap_or(sent);
                            e.refresh_by = refresh_by(seen, e.ttl);
                        }
                        // No row (deleted, or a registration that failed):
                        // registered again at once.
                        None => e.register_due = now,
                    }
                    e.due = (now + wait).min(e.refresh_by.max(now));
                }
            }
        }
    }
    for (role, node, term) in unclaimed {
        let bound = PATIENT_BOUND;
        tracing::debug!(
            role,
            term,
            "a lease won for a standby that left; releasing it"
        );
        if let Err(e) = client.release_role(&role, &node, term, bound).await {
            tracing::warn!(role, error = %e, "could not release a lease won for a standby that left; it expires on its own");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_bound() {
        for _ in 0..100 {
            assert!(jitter(Duration::from_secs(15)) <= MAX_JITTER);
            assert!(jitter(Duration::from_millis(500)) <= Duration::from_millis(25));
        }
        assert_eq!(max_jitter(Duration::from_secs(1)), MAX_JITTER);
    }
}
