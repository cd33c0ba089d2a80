//! Losing what you hold: one API for every handle that can be lost.
//!
//! A leadership ([`Leadership`](crate::Leadership),
//! [`LeaderContext`](crate::election::LeaderContext)), a held partition
//! ([`HeldPartition`](crate::partitions::HeldPartition)), a lock session
//! ([`LockSession`](crate::LockSession)), a session lock
//! ([`LockGuard`](crate::lock::LockGuard)) and a semaphore permit
//! ([`Permit`](crate::lock::Permit)) can each end without you asking: the
//! connection that holds it dies, a deadline passes, another process takes
//! over. Each of them answers the same four calls, with the meaning given
//! here:
//!
//! * `lost()` returns a [`Lost`] future that completes with the [`Loss`]
//!   once the handle is lost (at once if it is already). It owns what it
//!   needs: it does not borrow the handle, so it can be moved into a task or
//!   kept in a `select!` loop. Cancel safe: it only observes.
//! * `token()` returns a [`CancellationToken`] that is cancelled at the
//!   loss: hand it to the work the handle protects. It is a *child* token:
//!   cancelling it yourself cancels only that child, never the handle (to
//!   give a handle up, call its `release` or `resign`).
//! * `is_lost()` says whether the handle is lost, now.
//! * `loss()` says why and when: `None` while the handle lasts, the
//!   [`Loss`] (its [`LossReason`] and the [`Instant`] it happened) once it
//!   is lost. `is_lost()` and `loss().is_some()` always agree, and the loss
//!   is recorded before the token is cancelled, so a task woken by the
//!   token or by `lost()` always finds it.
//!
//! A loss is final: the reason and time never change once set, and the
//! first cause wins (a leadership that hit its deadline and then saw its
//! connection die was lost to the deadline).
//!
//! Loss is never a silent change of state: every handle that can be lost
//! reports it through these calls, and an elector also logs it and counts
//! it in its metrics. When `lost()` fires, what the handle protected may
//! already be someone else's: stop the work at once.
//!
//! ```no_run
//! # async fn f(session: pgelect::LockSession) -> pgelect::Result<()> {
//! use pgelect::lock::{LockMode, Wait};
//! use pgelect::LockKey;
//!
//! let key = LockKey::from_name("nightly-report")?;
//! let guard = session
//!     .acquire(key, LockMode::Exclusive, Wait::Forever)
//!     .await?
//!     .expect("BUG: an unbounded wait returns a guard or an error");
//! tokio::select! {
//!     loss = guard.lost() => {
//!         eprintln!("lock lost ({}), stopping", loss.reason());
//!         assert!(guard.is_lost());
//!         assert_eq!(guard.loss(), Some(loss));
//!     }
//!     _ = async { /* the report */ } => {
//!         guard.release().await?;
//!     }
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Why a handle was lost.
///
/// Elections and locks share it: a lock session, its guards and its
/// permits are lost only with their connection
/// ([`ConnectionLost`](LossReason::ConnectionLost)); a leadership or a held
/// partition for any of the reasons below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossReason {
    /// The elector was shut down (the `shutdown` token of
    /// [`Elector::run`](crate::Elector::run) was cancelled), or a partition
    /// member left its group ([`PartitionGroup::leave`](crate::partitions::PartitionGroup::leave)).
    Shutdown,
    /// The connection that held the lock, the permit or the leadership
    /// ended or stopped answering: the server terminated the backend
    /// (`pg_terminate_backend`), the database restarted, the network
    /// failed, or a heartbeat found no answer in time (pgelect then closes
    /// the connection itself). The server releases the connection's locks
    /// with it. An election loses leadership this way with the session
    /// backend only: the lease backend retries until its deadline
    /// ([`LossReason::Deadline`]).
    ConnectionLost,
    /// No renewal succeeded within `ttl - safety_margin` of the last
    /// successful one's sending: leadership was ended by the local timer,
    /// whether or not the database can be reached.
    Deadline,
    /// A renewal found the lease row no longer ours: another candidate leads.
    Preempted,
    /// Resigned: [`Leadership::resign`](crate::Leadership::resign) was
    /// called, or another process asked with
    /// [`request_resign`](crate::admin::request_resign).
    Resigned,
    /// The server accepts no writes any more: it was demoted to a standby
    /// (in recovery) or fenced read-only (`default_transaction_read_only`),
    /// found by a renewal failing with SQLSTATE 25006
    /// (`read_only_sql_transaction`) or, session backend, a heartbeat
    /// finding `transaction_read_only` on. Session backend: the lock there
    /// protects nothing, so leadership ends at once and the candidate
    /// reconnects (with several hosts and `target_session_attrs=read-write`,
    /// to the primary). Lease backend: the same with one host; with a
    /// multi-host URL the leader keeps renewing on new connections until its
    /// local deadline, since an HA manager's switchover promotes a standby
    /// that holds the replicated lease row within seconds, and it ends with
    /// this reason if the deadline comes after such a refusal.
    ServerReadOnly,
    /// Handed over to a preferred candidate (one of strictly higher
    /// [priority](crate::ElectorBuilder::priority) stands and is ready to
    /// take the lock), or a partition handed over to rebalance its group.
    /// Like [`LossReason::Resigned`], the lock is kept for a clean release:
    /// stop the duties, then release
    /// ([`Leadership::resign`](crate::Leadership::resign);
    /// [`Elector::run`](crate::Elector::run) does both; a partition is
    /// released once its [`HeldPartition`](crate::partitions::HeldPartition) is
    /// dropped), and the next holder takes over at once with a new term.
    /// Unreleased, the lock is abandoned after one `ttl`.
    HandedOver,
    /// Every [`Leadership`](crate::Leadership) handle was dropped without
    /// `resign`: the lock connection was dropped, and standbys treat it as
    /// an unclean loss (lease backend: the lease is not released and
    /// expires after `ttl`).
    Dropped,
}

impl LossReason {
    /// A short label, used in metrics and logs: `shutdown`,
    /// `connection_lost`, `deadline`, `preempted`, `resigned`, `dropped`,
    /// `server_read_only`, `handed_over`.
    pub fn as_str(self) -> &'static str {
        match self {
            LossReason::Shutdown => "shutdown",
            LossReason::ConnectionLost => "connection_lost",
            LossReason::Deadline => "deadline",
            LossReason::Preempted => "preempted",
            LossReason::Resigned => "resigned",
            LossReason::Dropped => "dropped",
            LossReason::ServerReadOnly => "server_read_only",
            LossReason::HandedOver => "handed_over",
        }
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a handle was lost: the reason and the moment (see the
/// [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loss {
    reason: LossReason,
    at: Instant,
}

impl Loss {
    /// Why the handle was lost.
    pub fn reason(&self) -> LossReason {
        self.reason
    }

    /// When, on this process's monotonic clock: the moment pgelect recorded
    /// the loss and cancelled the handle's token, which is when this process
    /// stopped believing it holds the handle (tasks waiting on `lost()` wake
    /// a little later).
    pub fn at(&self) -> Instant {
        self.at
    }
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "lost ({}) {} ago",
            self.reason,
            crate::error::rounded(self.at.elapsed())
        )
    }
}

/// The future of a handle's `lost()`: completes with the [`Loss`] once the
/// handle is lost (see the [module docs](self)).
///
/// It owns what it waits on (no borrow of the handle) and does not keep
/// the handle's connection alive.
///
/// # Cancel safety
/// Cancel safe: it only observes; dropping it changes nothing.
#[must_use = "futures do nothing unless you `.await` or poll them"]
pub struct Lost {
    signal: LossSignal,
    // Boxed so that `Lost` is `Unpin`: it can be polled by `&mut` in a
    // `select!` loop without pinning it first.
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl Future for Lost {
    type Output = Loss;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Loss> {
        match self.cancelled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(
                self.signal
                    .loss()
                    .expect("BUG: a loss is recorded before its token is cancelled"),
            ),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl fmt::Debug for Lost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lost")
            .field("loss", &self.signal.loss())
            .finish()
    }
}

/// The loss state every losable handle holds (crate-internal): a token and
/// the loss, recorded once.
///
/// # Invariants
/// 1. The loss is recorded (here, or in the parent) before the token is
///    cancelled: `end` sets it first, and the only other way the token is
///    cancelled is the parent's, whose own `end` recorded its loss first.
/// 2. A recorded loss never changes (`OnceLock`).
#[derive(Clone)]
pub(crate) struct LossSignal {
    inner: Arc<Inner>,
}

struct Inner {
    token: CancellationToken,
    loss: OnceLock<Loss>,
    /// A child signal is lost with its parent too (a held partition with
    /// its leadership), and reports the parent's loss when that came first.
    parent: Option<LossSignal>,
}

impl LossSignal {
    /// A signal not lost yet.
    pub(crate) fn new() -> LossSignal {
        LossSignal {
            inner: Arc::new(Inner {
                token: CancellationToken::new(),
                loss: OnceLock::new(),
                parent: None,
            }),
        }
    }

    /// A signal lost when this one is, or on its own [`end`](Self::end).
    pub(crate) fn child(&self) -> LossSignal {
        LossSignal {
            inner: Arc::new(Inner {
                token: self.inner.token.child_token(),
                loss: OnceLock::new(),
                parent: Some(self.clone()),
            }),
        }
    }

    /// Records the loss (if it is the first) and then cancels the token
    /// (invariant 1). True when this call lost the handle, false when it
    /// was lost already (here or through the parent).
    pub(crate) fn end(&self, reason: LossReason) -> bool {
        let already = self.is_lost();
        let first = self
            .inner
            .loss
            .set(Loss {
                reason,
                at: Instant::now(),
            })
            .is_ok();
        self.inner.token.cancel();
        first && !already
    }

    /// True once lost.
    pub(crate) fn is_lost(&self) -> bool {
        self.inner.token.is_cancelled()
    }

    /// The loss, once lost: this signal's or its parent's, whichever came
    /// first.
    pub(crate) fn loss(&self) -> Option<Loss> {
        if !self.is_lost() {
            return None;
        }
        let own = self.inner.loss.get().copied();
        let parent = self.inner.parent.as_ref().and_then(LossSignal::loss);
        match (own, parent) {
            (Some(a), Some(b)) => Some(if b.at < a.at { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// The `lost()` future.
    pub(crate) fn lost(&self) -> Lost {
        Lost {
            signal: self.clone(),
            cancelled: Box::pin(self.inner.token.clone().cancelled_owned()),
        }
    }

    /// A child token for the user: cancelling it ends nothing.
    pub(crate) fn token(&self) -> CancellationToken {
        self.inner.token.child_token()
    }

    /// The token itself, for pgelect's own waits. Never cancel it
    /// directly: use [`end`](Self::end) (invariant 1).
    pub(crate) fn raw_token(&self) -> &CancellationToken {
        &self.inner.token
    }
}

impl fmt::Debug for LossSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LossSignal")
            .field("loss", &self.loss())
            .finish()
    }
}

/// The loss API's four methods on a holder of something the server keeps
/// for a connection (a lock session, a lock, a permit): `lost`, `token`,
/// `is_lost`, `loss`, each delegating to `$signal` (an expression on
/// `$self`, which the caller names so that it is the methods' `self`).
/// `$ended` says what ends ("the connection holding the lock"), `$after`
/// what the loss means to the holder, `$loss` what `loss()` reports.
macro_rules! connection_loss_methods {
    ($self:ident => $signal:expr; ended: $ended:literal, after: $after:literal, loss: $loss:literal $(,)?) => {
        #[doc = concat!("Completes with the [`Loss`](crate::loss::Loss) when ", $ended, " has ended ([`LossReason::ConnectionLost`](crate::loss::LossReason::ConnectionLost))", $after, " See [`loss`](crate::loss).")]
        ///
        /// # Cancel safety
        /// Cancel safe: it only observes.
        pub fn lost(&$self) -> crate::loss::Lost {
            $signal.lost()
        }

        #[doc = concat!("A token cancelled when ", $ended, " ends; hand it to work that must stop then. A child token: cancelling it ends nothing. See [`loss`](crate::loss).")]
        pub fn token(&$self) -> tokio_util::sync::CancellationToken {
            $signal.token()
        }

        #[doc = concat!("True once ", $ended, " has ended; see [`loss`](crate::loss).")]
        pub fn is_lost(&$self) -> bool {
            $signal.is_lost()
        }

        #[doc = concat!($loss, " See [`loss`](crate::loss).")]
        pub fn loss(&$self) -> Option<crate::loss::Loss> {
            $signal.loss()
        }
    };
}
pub(crate) use connection_loss_methods;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_records_its_first_loss_before_the_token_fires() {
        let s = LossSignal::new();
        assert!(!s.is_lost());
        assert_eq!(s.loss(), None);
        let token = s.token();
        assert!(s.end(LossReason::Deadline));
        assert!(token.is_cancelled());
        assert!(s.is_lost());
        assert_eq!(s.loss().map(|l| l.reason()), Some(LossReason::Deadline));
        assert!(!s.end(LossReason::ConnectionLost));
        assert_eq!(s.loss().map(|l| l.reason()), Some(LossReason::Deadline));
    }

    #[test]
    fn cancelling_the_users_token_ends_nothing() {
        let s = LossSignal::new();
        s.token().cancel();
        assert!(!s.is_lost());
        assert_eq!(s.loss(), None);
    }

    #[test]
    fn a_child_is_lost_with_its_parent_and_reports_the_earlier_loss() {
        let parent = LossSignal::new();
        let child = parent.child();
        assert!(parent.end(LossReason::ConnectionLost));
        assert!(child.is_lost());
        assert_eq!(
            child.loss().map(|l| l.reason()),
            Some(LossReason::ConnectionLost)
        );
        // A later stop of the child does not rewrite what happened.
        assert!(!child.end(LossReason::HandedOver));
        assert_eq!(
            child.loss().map(|l| l.reason()),
            Some(LossReason::ConnectionLost)
        );

        let parent = LossSignal::new();
        let child = parent.child();
        assert!(child.end(LossReason::HandedOver));
        assert!(!parent.is_lost());
        parent.end(LossReason::Resigned);
        assert_eq!(
            child.loss().map(|l| l.reason()),
            Some(LossReason::HandedOver)
        );
    }

    #[tokio::test]
    async fn lost_completes_with_the_loss_even_when_created_after_it() {
        let s = LossSignal::new();
        let waiting = s.lost();
        s.end(LossReason::Shutdown);
        let loss = waiting.await;
        assert_eq!(loss.reason(), LossReason::Shutdown);
        assert_eq!(s.lost().await, loss);
    }
}
