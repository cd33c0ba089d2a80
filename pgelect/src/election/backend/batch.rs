//! A leader's place in a batched renewal, for both clients that batch
//! renewals: a shared connection's session ([`super::session`]) and a
//! lease client ([`super::lease`]). Each renewal statement
//! renews every leader in the batch; a member asks for one within its
//! share wait and takes its own outcome from it. Also the utilities both
//! clients batch with: [`chunks`] and [`until_wanted`].

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What one batched renewal found for one leader.
pub(crate) trait Outcome: Clone {
    /// The statement failed: the leader's own next renewal meets the
    /// failure, so it is never pushed to a leader that did not ask.
    fn failed(&self) -> bool;
}

/// The client a batch runs on.
pub(crate) trait Batch {
    /// Where renewal requests go: the earliest moment one is wanted at.
    fn renewals_wanted(&self) -> &watch::Sender<Option<Instant>>;

    /// Cancelled when no later batch can be sent (the connection closed);
    /// `None` when the client reconnects at will.
    fn closed(&self) -> Option<&CancellationToken>;

    /// Takes `role` out of the batch if its entry is still that of `term`.
    fn leave(&self, role: &str, term: i64);
}

/// A batch's entry for one leader: its term, among other things.
pub(crate) trait Termed {
    fn term(&self) -> i64;
}

/// Removes `role` from a batch's leaders if its entry is still that of
/// `term` (a newer term's entry stays).
pub(crate) fn remove_if_term<L: Termed>(leaders: &mut HashMap<String, L>, role: &str, term: i64) {
    if leaders.get(role).is_some_and(|l| l.term() == term) {
        leaders.remove(role);
    }
}

/// A leader's place in a batched renewal; leaves it when dropped.
pub(crate) struct Member<B: Batch, O: Outcome> {
    batch: B,
    role: String,
    term: i64,
    outcome: watch::Receiver<Option<(Instant, O)>>,
    /// The send time of the last outcome handed to the keeper.
    fed: Mutex<Option<Instant>>,
    /// How long a renewal request waits for others to share its statement.
    share_wait: Duration,
}

impl<B: Batch, O: Outcome> Member<B, O> {
    /// The member of `role` at `term`, whose outcomes arrive on `outcome`.
    pub(crate) fn new(
        batch: B,
        role: &str,
        term: i64,
        outcome: watch::Receiver<Option<(Instant, O)>>,
        share_wait: Duration,
    ) -> Self {
        Member {
            batch,
            role: role.to_owned(),
            term,
            outcome,
            fed: Mutex::new(None),
            share_wait,
        }
    }

    /// The outcome of a batched renewal sent at or after `requested`
    /// (asking for one within the member's share wait), with its send
    /// time; `None` when the batch ended first. The caller bounds the
    /// wait.
    pub(crate) async fn renewal(&self, requested: Instant) -> Option<(Instant, O)> {
        let by = requested + self.share_wait;
        self.batch
            .renewals_wanted()
            .send_modify(|w| *w = Some(w.map_or(by, |x| x.min(by))));
        let mut outcome = self.outcome.clone();
        let answered = outcome.wait_for(|o| o.as_ref().is_some_and(|(sent, _)| *sent >= requested));
        let found = match self.batch.closed() {
            Some(closed) => tokio::select! {
                o = answered => o.ok().and_then(|o| o.clone()),
                _ = closed.cancelled() => None,
            },
            None => answered.await.ok().and_then(|o| o.clone()),
        };
        if let Some((sent, _)) = &found {
            self.set_fed(*sent);
        }
        found
    }

    /// Completes with an outcome of a batch this leader did not ask for
    /// (another leader's request sent it) that the keeper has not been
    /// given yet: a renewal, or the news that the row is no longer ours.
    /// Failures are not pushed (see [`Outcome::failed`]); once the batch is
    /// gone, never completes (the connection's end, or the leader's own
    /// renewal, tells the keeper).
    pub(crate) async fn pushed(&self) -> (Instant, O) {
        let mut outcome = self.outcome.clone();
        let fed = *self.fed.lock().unwrap_or_else(PoisonError::into_inner);
        let found = outcome
            .wait_for(|o| {
                o.as_ref()
                    .is_some_and(|(sent, r)| fed.is_none_or(|f| *sent > f) && !r.failed())
            })
            .await
            .map(|o| o.clone());
        match found {
            Ok(Some((sent, r))) => {
                self.set_fed(sent);
                (sent, r)
            }
            _ => std::future::pending().await,
        }
    }

    fn set_fed(&self, sent: Instant) {
        let mut fed = self.fed.lock().unwrap_or_else(PoisonError::into_inner);
        if fed.is_none_or(|f| sent > f) {
            *fed = Some(sent);
        }
    }

    /// Leaves the batch at once (the leadership is being let go of or
    /// released): no later batch renews this role's row.
    pub(crate) fn leave(&self) {
        self.batch.leave(&self.role, self.term);
    }
}

impl<B: Batch, O: Outcome> Drop for Member<B, O> {
    fn drop(&mut self) {
        self.leave();
    }
}

/// `<l>.role BETWEEN (SELECT min(role) FROM <batch>) AND (SELECT max(role)
/// FROM <batch>)`: the condition, redundant with the join on the role, by
/// which a batched statement (of either backend) reaches the leaders' or
/// candidates' rows of its batch. The bounds are init plans whose values
/// the planner cannot know (it assumes a narrow range), so it probes the
/// primary key whatever the batch's size. Joined on the batch alone, whose
/// size it reads from the parameter, it scanned the whole table instead,
/// from a batch of 100 roles in 10,000 (see the `election::plans` test).
///
/// Bounds, not `= ANY (ARRAY(…))`: as the inner side of a nested loop, an
/// index scan with array keys sorts the whole array again at every rescan
/// (PostgreSQL 15), once per row of the batch, which made a batch of
/// 5,000 cost seconds; a range costs nothing to set up again.
///
/// The price: where the planner makes the range a scan of its own (the
/// outer side of a join; the `election::plans` test finds such plans), it
/// reads every row between the batch's first and last role, not only the
/// batch's. That is the whole table for a small batch whose names span it
/// (random names, say). The fix at the right depth is a statement that
/// reads the batch's rows once by an array into a materialized CTE and
/// joins on that; it is not written yet.
pub(crate) fn among(l: &str, batch: &str) -> String {
    format!(
        "{l}.role BETWEEN (SELECT pg_catalog.min({batch}.role) FROM {batch})
                      AND (SELECT pg_catalog.max({batch}.role) FROM {batch})"
    )
}

/// The index ranges of `len` items taken `size` at a time (the last one
/// shorter), in order: the chunks a batched statement goes in.
pub(crate) fn chunks(len: usize, size: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len)
        .step_by(size.max(1))
        .map(move |at| at..(at + size).min(len))
}

/// Waits for the earliest moment a batch's task is wanted at (the same
/// wait as a shared connection's probe).
pub(crate) use crate::conn::probe::until_wanted;

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_cover_every_item_once_in_order() {
        assert_eq!(chunks(0, 3).count(), 0);
        assert_eq!(chunks(7, 3).collect::<Vec<_>>(), vec![0..3, 3..6, 6..7]);
        assert_eq!(chunks(6, 3).collect::<Vec<_>>(), vec![0..3, 3..6]);
        assert_eq!(chunks(2, 2000).collect::<Vec<_>>(), vec![0..2]);
    }
}
