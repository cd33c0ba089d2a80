//! The lease backend, as an elector sees it: its campaign (take the lease
//! when it is free or expired on the server's clock), the start of a
//! leadership, its behaviour while leading ([`LeaseKeep`]: renewals retried
//! until the deadline, release) and the elector's optional `LISTEN`
//! connection.
//!
//! Every statement goes through a [`SharedLease`], the lease backend's one
//! engine: the client the candidate was built on, or a client of its own
//! that carries this candidate alone (a single candidate is a batch of
//! one). Each statement is one transaction, so the backend works through
//! PgBouncer in transaction mode: no session state is relied upon between
//! two statements. Every time comparison uses the server's `now()`, and the
//! remaining lease is computed by the server, so the candidates' clocks
//! never need to agree.
//!
//! The leader's loop is the shared [`driver`](crate::election::driver); all
//! decisions about the leader's deadline are taken by the pure
//! [`Keeper`](crate::election::keeper::Keeper), with
//! [`Liveness::statements`](crate::election::keeper::Liveness::statements)
//! (no heartbeats, each statement bounded by the client).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::conn::{ConnectOptions, Notice};
use crate::error::{Error, Result};
use crate::metrics;

use crate::election::driver::{Activation, Answer, Failed, Keep, KeepBackend, Statement};
use crate::election::keeper::{Action, Keeper, Liveness};
use crate::election::leadership::{LeaderContext, LeaderState, Leadership, LossReason};
use crate::election::support::{backoff, is_read_only, is_transient, listen_for};
use crate::election::watch::{parse_leader_event, LeaderInfo, LEADER_CHANNEL, RESIGN_CHANNEL};
use crate::election::{LeaseState, Shared, Term};

use super::shared_lease::{renewal_answer, RenewMember, Renewal, SharedLease};

/// The lease state of an elector that campaigns with the lease backend.
fn lease_state(shared: &Shared) -> &LeaseState {
    shared
        .lease()
        .expect("BUG: the lease backend campaigns for lease electors only")
}

/// Campaigns until elected: the client's acquire tries the role at every
/// poll, and the first win that arrives in time is kept, with this
/// elector's renewals in the client's renewal batch. Release announcements
/// heard on the elector's own `LISTEN` connection bring the next poll
/// forward. Transient failures (connection refused or reset, pooler
/// restarting, timeouts) are retried by the client; a missing schema, a
/// permission error or a role held by the session backend are returned.
pub(crate) async fn campaign(shared: &Arc<Shared>) -> Result<Leadership> {
    let span = tracing::info_span!("pgelect.campaign", role = %shared.role, node = %shared.node, backend = "lease");
    async {
        let client = lease_state(shared).client.client();
        let mut notices = lease_state(shared).notices.subscribe();
        shared.ensure_lease_listener();
        let schema = shared.options.schema_name().as_str();
        let mut failures = 0u32;
        loop {
            let mut member = client.join_standbys(shared);
            let won = loop {
                tokio::select! {
                    won = member.won() => break won,
                    n = notices.recv() => match n {
                        Ok(n) if n.channel == LEADER_CHANNEL
                            && parse_leader_event(schema, &n.payload)
                                == Some(("released", shared.role.as_str())) =>
                        {
                            client.wake_standbys(Some(&shared.role));
                        }
                        Ok(_) => {}
                        // Missed announcements: poll as if one was ours.
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            client.wake_standbys(Some(&shared.role));
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
                    tokio::time::sleep(backoff(failures).min(shared.timing.retry_every)).await;
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
    shared: &Arc<Shared>,
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
    let notices = lease_state(shared).notices.subscribe();
    let span = tracing::info_span!("pgelect.leader", role = %shared.role, node = %shared.node, term = term.get(), backend = "lease");
    let keep = Keep {
        shared: shared.clone(),
        backend: LeaseKeep {
            shared: shared.clone(),
            client: client.clone(),
            member: client.join_renewals(shared, term.get()),
            term: term.get(),
            refused_read_only: AtomicBool::new(false),
        },
        keeper,
        state: state.clone(),
        commands: rx,
        notices,
        activation: Activation::Done,
        count_leading: false,
    };
    keep.spawn(span);
    Some(Leadership {
        context: LeaderContext::new(state),
        commands,
    })
}

/// How the lease backend keeps a leadership: the leader's place in its
/// client's renewal batch (one renewal statement per `renew_every` for
/// every leader on the client, each bounded by the statement timeout);
/// failures are retried until the deadline.
struct LeaseKeep {
    shared: Arc<Shared>,
    client: SharedLease,
    member: RenewMember,
    term: i64,
    /// A batched renewal was refused by a server that accepts no writes:
    /// the error the keeper gets for it (the batch's own error went to the
    /// whole batch) is to be taken as such.
    refused_read_only: AtomicBool,
}

impl KeepBackend for LeaseKeep {
    const FINISH_IN_FLIGHT_BEFORE_RELEASE: bool = true;

    /// Asks for a batch sent within the member's share wait and takes its
    /// outcome with the batch's own send time (taken by the batch task
    /// right before it sent the statement). Bounded like a statement of its
    /// own, plus the share wait and one batch ahead of it.
    fn renew(&self) -> Statement<'_> {
        Box::pin(async move {
            let requested = Instant::now();
            let bound = self.shared.timing.heartbeat_timeout * 2;
            match tokio::time::timeout(bound, self.member.renewal(requested)).await {
                Ok(Some((sent, r))) => {
                    match r {
                        Renewal::Renewed { .. } => tracing::trace!("lease renewed"),
                        Renewal::Failed { read_only: true } => {
                            self.refused_read_only.store(true, AtomicOrdering::Relaxed);
                        }
                        _ => {}
                    }
                    (sent, renewal_answer(r))
                }
                _ => (requested, Err(Error::connection_lost("renew the lease"))),
            }
        })
    }

    async fn pushed(&self) -> (Instant, Result<Answer>) {
        let (sent, r) = self.member.pushed().await;
        (sent, renewal_answer(r))
    }

    fn heartbeat(&self) -> Statement<'_> {
        // Never asked for: a lease has no session to keep alive.
        Box::pin(std::future::ready((Instant::now(), Ok(Answer::Alive))))
    }

    fn closed(&self) -> impl Future<Output = ()> + Send + '_ {
        // The connection is reopened at will: its end ends nothing.
        std::future::pending()
    }

    fn failed(&self, error: &Error, failures: u32) -> Failed {
        if is_read_only(error) || self.refused_read_only.swap(false, AtomicOrdering::Relaxed) {
            // Not an outage to ride out: the lease is on a server that
            // cannot renew it (demoted or fenced); the client dropped that
            // connection, and the next campaign opens a new one.
            return Failed::ServerReadOnly;
        }
        // Retries are cheap (one statement or a refused connection): keep
        // them frequent, so that a short outage is ridden out.
        let cap = (self.shared.timing.renew_every / 4).max(Duration::from_millis(50));
        Failed::RetryAfter(backoff(failures).min(cap))
    }

    fn let_go(&self, _reason: Option<LossReason>) {
        // Nothing to drop: the lease expires on its own, after the local
        // deadline, unless released. The batch stops renewing it at once.
        self.member.leave();
    }

    fn releasable_after(&self, reason: LossReason) -> bool {
        // After a deadline loss the lease may still be ours on the server
        // (the database was unreachable for a while). After a preemption
        // there is nothing left to release.
        reason == LossReason::Deadline
    }

    async fn release(self, ended: Option<LossReason>) -> Result<()> {
        self.member.leave();
        if ended == Some(LossReason::Preempted) {
            return Ok(());
        }
        let result = self
            .client
            .release(&self.shared, self.term)
            .await
            .map(|_| ());
        if let Err(e) = &result {
            tracing::warn!(error = %e, "clean release failed; the lease will expire on its own");
        }
        result
    }

    async fn close(self) {
        self.member.leave();
    }
}

/// The `LISTEN` connection of a lease-backend elector (see
/// `ElectorBuilder::listen_via`): forwards notifications on
/// [`LEADER_CHANNEL`] and [`RESIGN_CHANNEL`] to the elector's broadcast
/// channel; reconnects with backoff; ends when the elector is dropped.
pub(crate) async fn listen(shared: Weak<Shared>, options: ConnectOptions, stop: CancellationToken) {
    let purpose = match shared.upgrade() {
        Some(s) => format!("listen:{}:{}", s.role, s.node),
        None => return,
    };
    let channels = [LEADER_CHANNEL, RESIGN_CHANNEL];
    listen_for(&options, &purpose, &channels, &stop, |n| {
        let Some(s) = shared.upgrade() else {
            return false;
        };
        // A release sent before the LISTEN took effect (the first one, or
        // after a reconnection), or missed, was not heard: a standby that
        // found the lease held would sleep until its next retry. Wake it
        // as if it had been heard; it reads the row again (a hint like any
        // other, within the wake-up limit).
        let n = n.unwrap_or_else(|| Notice {
            channel: LEADER_CHANNEL.to_owned(),
            payload: format!("{}:released:{}", s.options.schema_name().as_str(), s.role),
        });
        if let Some(lease) = s.lease() {
            let _ = lease.notices.send(n);
        }
        true
    })
    .await
}
