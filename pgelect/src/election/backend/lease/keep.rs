//! Keeping a leadership on the lease backend: the leader's place in its
//! client's renewal batch ([`LeaseKeep`]: renewals retried until the
//! deadline, release), and the client's renewal task.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

use crate::election::backend::batch::{
    chunks, remove_if_term, until_wanted, Batch, Member, Outcome, Termed,
};
use crate::election::driver::{Answer, Failed, KeepBackend, Statement};
use crate::election::support::{backoff, is_read_only, is_transient};
use crate::election::ElectorState;
use crate::loss::LossReason;

use super::sql::Renewing;
use super::{Inner, Op, SharedLease, CHUNK_ROWS};

/// How soon a leader whose row a fenced transaction held is tried again
/// (see [`renew_batches`]): a fencing transaction's end is followed by
/// the leader's renewal within this, plus a round trip.
const BUSY_RETRY: Duration = Duration::from_millis(25);

/// How the lease backend keeps a leadership: the leader's place in its
/// client's renewal batch (one renewal statement per `renew_every` for
/// every leader on the client, each bounded by the statement timeout);
/// failures are retried until the deadline.
pub(super) struct LeaseKeep {
    shared: Arc<ElectorState>,
    client: SharedLease,
    member: RenewMember,
    term: i64,
    /// A batched renewal was refused by a server that accepts no writes:
    /// the error the keeper gets for it (the batch's own error went to the
    /// whole batch) is to be taken as such.
    refused_read_only: AtomicBool,
}

impl LeaseKeep {
    /// The keep of the leadership of `shared`'s role at `term`, in
    /// `client`'s renewal batch from now on.
    pub(super) fn new(shared: &Arc<ElectorState>, client: &SharedLease, term: i64) -> LeaseKeep {
        LeaseKeep {
            shared: shared.clone(),
            client: client.clone(),
            member: client.join_renewals(shared, term),
            term,
            refused_read_only: AtomicBool::new(false),
        }
    }
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
        // A server that accepts no writes: a primary being demoted by an HA
        // manager's switchover, or fenced. With a multi-host URL
        // (`target_session_attrs=read-write`), retried like an outage until
        // the local deadline: the client dropped that connection, and the
        // next renewal reconnects, reaching the promoted primary, where
        // the replicated lease row still names this leader and term. So a
        // switchover shorter than the time left costs no term; giving up at
        // the first refusal made the successor wait out the whole lease on
        // the promoted server. Safety is as in any outage: the keeper stops
        // acting at its local deadline, which falls before the row's expiry
        // that any successor waits for; a deadline reached after such a
        // refusal ends as `ServerReadOnly`. With one host, reconnecting
        // reaches the same server: leadership ends at once.
        let cap = (self.shared.timing.renew_every / 4).max(Duration::from_millis(50));
        let wait = backoff(failures).min(cap);
        if is_read_only(error) || self.refused_read_only.swap(false, AtomicOrdering::Relaxed) {
            if self.shared.options.host_count() < 2 {
                return Failed::ServerReadOnly;
            }
            return Failed::ReadOnlyRetryAfter(wait);
        }
        // Retries are cheap (one statement or a refused connection): keep
        // them frequent, so that a short outage is ridden out.
        Failed::RetryAfter(wait)
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
        let result = self.client.release(&self.shared, self.term).await;
        match &result {
            // Given up of its own accord (resigned, or released while
            // leading): the next campaign lets the woken standbys take the
            // role first.
            Ok(true) if matches!(ended, None | Some(LossReason::Resigned)) => {
                if let Some(lease) = self.shared.lease() {
                    *lease
                        .stepped_aside
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) =
                        Some((Instant::now(), self.term));
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "clean release failed; the lease will expire on its own")
            }
        }
        result.map(|_| ())
    }

    async fn close(self) {
        self.member.leave();
    }
}

/// A leader's entry in the batched renewal.
pub(super) struct Leader {
    node: String,
    term: i64,
    ttl_ms: i64,
    priority: i32,
    /// The leader's statement bound (its heartbeat timeout).
    bound: Duration,
    /// The last batch that included this leader: when it was sent and
    /// what it found for this role.
    outcome: watch::Sender<Option<(Instant, Renewal)>>,
}

/// What one batched renewal found for one role.
#[derive(Clone, Debug)]
pub(super) enum Renewal {
    /// The row still named this leader and term, and was renewed.
    Renewed {
        row: (SystemTime, SystemTime),
        resign_requested: bool,
        /// A ready candidate of strictly higher priority.
        ready: Option<String>,
    },
    /// The row no longer names this leader and term.
    NotOurs,
    /// The row still names this leader and term but was locked (a fenced
    /// transaction's `FOR SHARE`): not renewed this time.
    Busy,
    /// The statement failed or got no answer; `read_only` when the server
    /// refused it as accepting no writes (SQLSTATE 25006).
    Failed { read_only: bool },
}

/// A leader's place in the batched renewal; leaves it when dropped.
pub(super) type RenewMember = Member<SharedLease, Renewal>;

impl Outcome for Renewal {
    fn failed(&self) -> bool {
        matches!(self, Renewal::Failed { .. })
    }
}

impl Termed for Leader {
    fn term(&self) -> i64 {
        self.term
    }
}

impl Batch for SharedLease {
    fn renewals_wanted(&self) -> &watch::Sender<Option<Instant>> {
        &self.inner.renew_wanted
    }

    fn closed(&self) -> Option<&CancellationToken> {
        // Reconnects at will: no end but the client's own.
        None
    }

    fn leave(&self, role: &str, term: i64) {
        remove_if_term(&mut self.inner.leaders(), role, term);
    }
}

impl SharedLease {
    /// Enters the leader of `shared`'s role, with `term`, into the batched
    /// renewal.
    pub(super) fn join_renewals(&self, shared: &ElectorState, term: i64) -> RenewMember {
        self.ensure_started();
        let (tx, rx) = watch::channel(None);
        self.inner.leaders().insert(
            shared.role.clone(),
            Leader {
                node: shared.node.clone(),
                term,
                ttl_ms: shared.timing.ttl.as_millis() as i64,
                priority: shared.priority,
                bound: shared.timing.heartbeat_timeout,
                outcome: tx,
            },
        );
        // As on a shared connection: a short wait for others to share the
        // statement, a small part of the answer limit.
        let share_wait = if self.inner.shares {
            (shared.timing.heartbeat_timeout / 10).min(Duration::from_millis(20))
        } else {
            Duration::ZERO
        };
        Member::new(self.clone(), &shared.role, term, rx, share_wait)
    }

    /// Clears the holder where holder and term are still ours, with a
    /// NOTIFY in the same transaction; up to three attempts (transient
    /// failures). Returns whether the row was still ours.
    pub(super) async fn release(&self, shared: &ElectorState, term: i64) -> Result<bool> {
        self.release_role(
            &shared.role,
            &shared.node,
            term,
            shared.timing.heartbeat_timeout,
        )
        .await
    }

    pub(super) async fn release_role(
        &self,
        role: &str,
        node: &str,
        term: i64,
        bound: Duration,
    ) -> Result<bool> {
        let mut failures = 0;
        loop {
            let (_, r) = self.clear(role, node, term, bound).await;
            match r {
                Ok(cleared) => {
                    if !cleared {
                        tracing::warn!(
                            role,
                            term,
                            "the lease row no longer named this leader at release"
                        );
                    }
                    return Ok(cleared);
                }
                Err(e) if is_transient(&e) && failures < 2 => {
                    failures += 1;
                    tokio::time::sleep(backoff(failures)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The renewal task: when the earliest renewal request wants it, sends one
/// statement per chunk renewing every leader on the client, and hands each
/// its outcome with the statement's send time; ends with the client.
///
/// A leader whose row a fenced transaction holds (the statement skips it,
/// see [`renew_sql`](super::sql::renew_sql)) is not handed `Busy` at once: it is tried again alone
/// every [`BUSY_RETRY`], its outcome held back, until renewed or until
/// half its statement bound has passed since it was first found busy. So a
/// leader whose application fences in short transactions is renewed right
/// after one ends, as a renewal that waited for the lock would be, without
/// holding up the other leaders' renewals.
pub(super) async fn renew_batches(
    inner: Weak<Inner>,
    mut wanted: watch::Receiver<Option<Instant>>,
    stop: CancellationToken,
) {
    // Leaders found busy and not handed their outcome yet: role -> term and
    // the send time of the statement that first found the row held.
    let mut busy: HashMap<String, (i64, Instant)> = HashMap::new();
    loop {
        let all = if busy.is_empty() {
            if !until_wanted(&mut wanted, &stop).await {
                return;
            }
            true
        } else {
            tokio::select! {
                w = until_wanted(&mut wanted, &stop) => {
                    if !w {
                        return;
                    }
                    true
                }
                _ = tokio::time::sleep(BUSY_RETRY) => false,
            }
        };
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let client = SharedLease { inner };
        if all {
            client.inner.renew_wanted.send_replace(None);
        }
        // Leaders that left (or lead with another term now) wait no more.
        {
            let leaders = client.inner.leaders();
            busy.retain(|role, (term, _)| leaders.get(role).is_some_and(|l| l.term == *term));
        }
        let mut leaders: Vec<(String, String, i64, i64, i32, Duration, watch::Sender<_>)> = client
            .inner
            .leaders()
            .iter()
            .filter(|(role, _)| all || busy.contains_key(*role))
            .map(|(role, l)| {
                (
                    role.clone(),
                    l.node.clone(),
                    l.term,
                    l.ttl_ms,
                    l.priority,
                    l.bound,
                    l.outcome.clone(),
                )
            })
            .collect();
        if leaders.is_empty() {
            continue;
        }
        leaders.sort_by(|a, b| a.0.cmp(&b.0));
        for chunk in chunks(leaders.len(), CHUNK_ROWS) {
            let part = &leaders[chunk];
            let leases: Vec<Renewing> = part
                .iter()
                .map(|l| Renewing {
                    role: &l.0,
                    node: &l.1,
                    term: l.2,
                    ttl_ms: l.3,
                    priority: l.4,
                })
                .collect();
            let bound = part
                .iter()
                .map(|l| l.5)
                .min()
                .expect("BUG: chunks are not empty");
            let (sent, r) = client.renew(&leases, bound).await;
            tracing::debug!(leaders = part.len(), took = ?sent.elapsed(), "batched lease renewal");
            let (mut found, failed) = match r {
                Ok(found) => (found, None),
                Err(e) => {
                    tracing::warn!(error = %e, leaders = part.len(), "the batched lease renewal failed");
                    (HashMap::new(), Some(is_read_only(&e)))
                }
            };
            for (role, _, term, _, _, bound, tx) in part {
                let r = match failed {
                    Some(read_only) => Renewal::Failed { read_only },
                    None => found.remove(role).unwrap_or(Renewal::NotOurs),
                };
                if matches!(r, Renewal::Busy) {
                    let first = busy.entry(role.clone()).or_insert((*term, sent));
                    if first.0 != *term {
                        *first = (*term, sent);
                    }
                    if sent.saturating_duration_since(first.1) < *bound / 2 {
                        continue;
                    }
                }
                busy.remove(role);
                tx.send_replace(Some((sent, r)));
            }
        }
    }
}

/// Keeps the renewal's answer for the keeper: `Renewal` to the driver's
/// `Answer`, or the error the keeper retries on.
pub(super) fn renewal_answer(r: Renewal) -> Result<crate::election::driver::Answer> {
    use crate::election::driver::{Answer, Preferred};
    match r {
        Renewal::Renewed {
            row,
            resign_requested,
            ready,
        } => Ok(Answer::Renewed {
            row: Some(row),
            resign_requested,
            preferred: Preferred {
                ready,
                pending: false,
            },
        }),
        Renewal::NotOurs => Ok(Answer::NotOurs),
        Renewal::Busy => Ok(Answer::Busy),
        Renewal::Failed { .. } => Err(Error::connection_lost(Op::Renew.operation())),
    }
}
