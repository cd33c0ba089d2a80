//! The `Leadership` handle, its `LeaderContext` and its `Term`.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::loss::{Loss, LossReason, LossSignal, Lost};
use crate::schema::SchemaName;

/// A fencing term: it rises by one at every change of leader of a role and
/// never goes back, across leaders, restarts of candidates and restarts of
/// the database (it is stored in `pgelect.leaders.term`).
///
/// ```
/// use pgelect::Term;
/// assert!(Term::new(7) > Term::new(6));
/// assert_eq!(Term::new(7).get(), 7);
/// assert_eq!(Term::new(7).to_string(), "7");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Term(i64);

impl Term {
    /// Wraps a term as stored in the database.
    pub const fn new(term: i64) -> Term {
        Term(term)
    }

    /// The term as stored in the database (`bigint`).
    pub const fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// State shared between a leadership's keeper task and its handles.
#[derive(Debug)]
pub(crate) struct LeaderState {
    pub(crate) role: String,
    pub(crate) schema: SchemaName,
    pub(crate) term: Term,
    /// Lost when the leadership ends: the first reason, then the token.
    pub(crate) signal: LossSignal,
    /// The keeper's local deadline, published at every move (see
    /// [`expire_if_due`](Self::expire_if_due)).
    deadline: Mutex<Instant>,
}

impl LeaderState {
    pub(crate) fn new(role: String, schema: SchemaName, term: Term, deadline: Instant) -> Self {
        LeaderState {
            role,
            schema,
            term,
            signal: LossSignal::new(),
            deadline: Mutex::new(deadline),
        }
    }

    /// Publishes the keeper's deadline after it moved.
    pub(crate) fn set_deadline(&self, deadline: Instant) {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner) = deadline;
    }

    /// The keeper's deadline as last published.
    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// True once the leadership ended. Ends it ([`LossReason::Deadline`])
    /// when the clock says its local deadline passed, even if the keeper
    /// task has not run since: a keeper is a task, and a long poll on its
    /// worker (CPU-bound work in the application or a starved runtime)
    /// would otherwise delay the loss past the point where a standby may
    /// take over. Called by the [watchdog](super::watchdog) thread at the
    /// deadline, and by
    /// `is_lost` and the fences before they answer (`noticed_by` says
    /// which, in the log). The keeper, once it runs, finds the state ended
    /// and lets go; it reports its own lateness if it was late.
    pub(crate) fn expire_if_due(&self, noticed_by: &'static str) -> bool {
        if self.signal.is_lost() {
            return true;
        }
        let deadline = self.deadline();
        let now = Instant::now();
        if now < deadline {
            return false;
        }
        if self.end_counted(LossReason::Deadline, true) {
            tracing::warn!(
                role = %self.role,
                term = self.term.get(),
                reason = %LossReason::Deadline,
                noticed_by,
                late = ?now.saturating_duration_since(deadline),
                "leadership lost"
            );
        }
        true
    }
    /// Records the first reason and cancels the token (in that order, so a
    /// woken waiter always finds the reason).
    pub(crate) fn end(&self, reason: LossReason) -> bool {
        self.signal.end(reason)
    }

    /// The leadership's own token, for pgelect's waits (never cancel it:
    /// [`end`](Self::end) does).
    pub(crate) fn token(&self) -> &CancellationToken {
        self.signal.raw_token()
    }

    /// [`end`](Self::end), and the first time, when the user had been told
    /// of the leadership (`was_active`), counts the loss in the metrics.
    pub(crate) fn end_counted(&self, reason: LossReason, was_active: bool) -> bool {
        let first = self.end(reason);
        if first && was_active {
            crate::metrics::leader_off(&self.role, reason.as_str());
        }
        first
    }

    /// Fails with [`Error::LeadershipLost`] once the leadership ended (or
    /// its local deadline passed).
    fn ensure_live(&self) -> Result<()> {
        self.expire_if_due("fence");
        match self.reason() {
            Some(reason) => Err(Error::LeadershipLost {
                role: self.role.clone(),
                term: self.term.get(),
                reason,
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn reason(&self) -> Option<LossReason> {
        self.signal.loss().map(|l| l.reason())
    }
}

/// Requests from handles to the keeper task.
#[derive(Debug)]
pub(crate) enum Command {
    /// Cancel the token with this reason; keep the lock for a clean release.
    Stop { reason: LossReason },
    /// Cancel the token with this reason and release cleanly; reply when done.
    Release {
        reason: LossReason,
        reply: oneshot::Sender<Result<()>>,
    },
}

/// What an elected process gets: the term, the loss API and the fence.
/// Cheap to clone; handed to the `on_elected` callback of
/// [`Elector::run`](crate::Elector::run), obtained from
/// [`Leadership::context`], and what a [`Leadership`] and a
/// [`HeldPartition`](crate::partitions::HeldPartition) dereference to.
///
/// Its loss API (`lost`, `token`, `is_lost`, `loss`) is the one every
/// losable handle has; the [`loss`](crate::loss) module documents it. At
/// the local deadline the leadership is lost even when the task that keeps
/// it is held up (a long poll on its worker): a thread of the library
/// watches every leader's deadline, and `is_lost` and `loss` read the clock
/// too.
#[derive(Clone)]
pub struct LeaderContext {
    state: Arc<LeaderState>,
    /// The leadership's signal, or for a held partition a child of it that
    /// a handover ends too.
    signal: LossSignal,
}

impl LeaderContext {
    /// The fencing term of this leadership.
    pub fn term(&self) -> Term {
        self.state.term
    }

    /// The role led.
    pub fn role(&self) -> &str {
        &self.state.role
    }

    /// Completes with the [`Loss`] when leadership ends, for any reason;
    /// see [`loss`](crate::loss).
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub fn lost(&self) -> Lost {
        self.signal.lost()
    }

    /// A token cancelled the moment leadership ends, for any reason; see
    /// [`loss`](crate::loss). Stop acting as leader when it is.
    ///
    /// A child token: cancelling it does not end leadership (use
    /// [`Leadership::resign`] for that).
    ///
    /// ```
    /// # fn f(leadership: &pgelect::Leadership) {
    /// let token = leadership.token();
    /// token.cancel(); // cancels this child only
    /// assert!(!leadership.is_lost());
    /// # }
    /// ```
    pub fn token(&self) -> CancellationToken {
        self.signal.token()
    }

    /// True once leadership has ended; see [`loss`](crate::loss). Once the
    /// local deadline passed it is true (and the leadership ends with
    /// [`LossReason::Deadline`]) even if the task that keeps the
    /// leadership was not polled in time.
    pub fn is_lost(&self) -> bool {
        self.state.expire_if_due("is_lost");
        self.signal.is_lost()
    }

    /// Why and when leadership ended; `None` while it lasts. See
    /// [`loss`](crate::loss); reads the clock as [`is_lost`](Self::is_lost)
    /// does.
    pub fn loss(&self) -> Option<Loss> {
        self.state.expire_if_due("loss");
        self.signal.loss()
    }

    /// Fences the caller's transaction with this term: runs
    /// `SELECT pgelect.fence(role, term)`, which locks the role's row
    /// `FOR SHARE` until the transaction ends and fails unless the term is
    /// still current.
    ///
    /// Call it inside the transaction whose writes must not happen after a
    /// newer leader began, before those writes (or at least before commit).
    /// Because a takeover must `UPDATE` that row to bump the term, it waits
    /// for fenced transactions of the old term to end, and once the term
    /// moved, every fence of the old term fails with [`Error::StaleTerm`]
    /// (or [`Error::NoLeader`] when the term was released and nobody holds
    /// the role): a fenced transaction of an old term never commits after a
    /// newer term began, even when this process was paused or partitioned.
    ///
    /// Fails at once, without a statement, once this leadership is known
    /// lost. The statement is unnamed (no prepared statement), so it works
    /// through PgBouncer in transaction mode.
    ///
    /// # Cancel safety
    /// Cancelling drops the statement's future; the transaction is the
    /// caller's, roll it back.
    pub async fn fence<C: GenericClient + Sync>(&self, tx: &C) -> Result<()> {
        let s = &self.state;
        s.ensure_live()?;
        let sql = format!("SELECT {}.fence($1, $2)", s.schema.as_str());
        let term = s.term.get();
        tx.query_typed(&sql, &[(&s.role, Type::TEXT), (&term, Type::INT8)])
            .await
            .map_err(|e| Error::fence(&s.role, s.schema.as_str(), e))?;
        Ok(())
    }

    /// Like [`fence`](LeaderContext::fence), on the caller's sqlx connection
    /// or transaction (pass `&mut *tx`). Feature `sqlx`.
    ///
    /// # Cancel safety
    /// Cancelling drops the statement's future; roll the transaction back.
    #[cfg(feature = "sqlx")]
    pub async fn fence_sqlx(&self, conn: &mut ::sqlx::PgConnection) -> Result<()> {
        let s = &self.state;
        s.ensure_live()?;
        let sql = format!("SELECT {}.fence($1, $2)::text", s.schema.as_str());
        let result = ::sqlx::query(::sqlx::AssertSqlSafe(sql))
            .bind(&s.role)
            .bind(s.term.get())
            .persistent(false)
            .execute(conn)
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(e) => {
                let refusal = e
                    .as_database_error()
                    .and_then(|d| Error::fence_refusal(&s.role, d.code().as_deref(), d.message()));
                Err(refusal.unwrap_or(Error::Sqlx {
                    operation: "fence a transaction",
                    source: e,
                }))
            }
        }
    }

    pub(crate) fn new(state: Arc<LeaderState>) -> LeaderContext {
        let signal = state.signal.clone();
        LeaderContext { state, signal }
    }

    /// A context of the same leadership whose loss API also fires on
    /// [`end`](LossSignal::end) of the returned signal (a partition's
    /// handover), and the signal.
    pub(crate) fn with_child_signal(&self) -> (LeaderContext, LossSignal) {
        let signal = self.signal.child();
        let context = LeaderContext {
            state: self.state.clone(),
            signal: signal.clone(),
        };
        (context, signal)
    }
}

impl fmt::Debug for LeaderContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderContext")
            .field("role", &self.state.role)
            .field("term", &self.state.term)
            .field("loss", &self.signal.loss())
            .finish()
    }
}

/// The handle of a won election.
///
/// It dereferences to its [`LeaderContext`]: the [term](LeaderContext::term),
/// the loss API ([`lost`](LeaderContext::lost),
/// [`token`](LeaderContext::token), [`is_lost`](LeaderContext::is_lost),
/// [`loss`](LeaderContext::loss); documented in [`loss`](crate::loss)) and
/// the [fence](LeaderContext::fence). What it adds is ownership: it ends the
/// leadership when it goes.
///
/// Leadership lasts until `lost()` completes (its `token()` is
/// cancelled): on a lost lock connection, a passed local deadline, a
/// preemption, a resign request from another process, or
/// [`resign`](Leadership::resign). Every loss is reported; it is never a
/// silent change of state.
///
/// # Ending it
/// * [`resign`](Leadership::resign) cancels the token, then — after your
///   duties have stopped, which is why you call it only then — clears the
///   holder, sends `NOTIFY` and unlocks: standbys take over within
///   milliseconds, at once, with no handover delay.
/// * After a loss you do not cause (for example a resign requested by
///   another process), call `resign` once your duties stopped: while the lock
///   connection lives, it still releases cleanly. The lock is kept for that
///   at most one TTL.
/// * Dropping every handle without `resign` cancels the token and drops the
///   lock connection: standbys see an unclean loss and wait the handover
///   delay. This is a fallback, not the way to step down.
///
/// Forgetting to bind it is a compile-time warning (`#[must_use]`), because
/// the leadership would end at once:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// async fn f(elector: &pgelect::Elector) -> Result<(), pgelect::Error> {
///     elector.leadership().await?; // dropped at once: refused
///     Ok(())
/// }
/// ```
#[must_use = "dropping a Leadership ends it at once, and standbys see an unclean loss; bind it, and call `resign` to step down"]
pub struct Leadership {
    pub(crate) context: LeaderContext,
    pub(crate) commands: mpsc::UnboundedSender<Command>,
}

impl Deref for Leadership {
    type Target = LeaderContext;

    fn deref(&self) -> &LeaderContext {
        &self.context
    }
}

impl Leadership {
    /// A cheap, cloneable view (term, loss API, fence) to hand to the tasks
    /// doing the leader's work.
    pub fn context(&self) -> LeaderContext {
        self.context.clone()
    }

    /// Steps down: cancels the token (reason [`LossReason::Resigned`] unless
    /// leadership already ended), then, in one transaction, clears the
    /// holder where holder and term are still ours and sends `NOTIFY`, then
    /// unlocks the advisory lock and checks that it was held.
    ///
    /// Stop the duties that act as leader *before* calling it: standbys take
    /// over as soon as it returns. If leadership had already ended with the
    /// connection (lost connection, deadline, preemption), there is nothing
    /// to release and it returns `Ok(())`.
    ///
    /// Lease backend: one statement clears the holder where holder and term
    /// are ours and sends `NOTIFY` (retried up to three times, each bounded
    /// by the statement timeout). After a [`LossReason::Deadline`] loss the
    /// lease may still be ours on the server (the database was unreachable
    /// for a while): the release is then still attempted, and is a no-op if
    /// another candidate took over meanwhile. After a preemption there is
    /// nothing to release. A failed release is returned as an error; the
    /// lease then expires on its own. An elector that campaigns again right
    /// after resigning lets a waiting standby take the role first: it
    /// stands aside for 1.25 × `retry_every` (at most the TTL), or until
    /// its `LISTEN` connection hears the role taken.
    ///
    /// # Cancel safety
    /// The release runs in the leadership's own task and completes even if
    /// this future is dropped.
    pub async fn resign(self) -> Result<()> {
        self.release(LossReason::Resigned).await
    }

    /// Cancels the token with `reason`, keeping the lock for a clean release.
    pub(crate) fn stop(&self, reason: LossReason) {
        let _ = self.commands.send(Command::Stop { reason });
    }

    pub(crate) async fn release(&self, reason: LossReason) -> Result<()> {
        let (reply, answer) = oneshot::channel();
        if self
            .commands
            .send(Command::Release { reason, reply })
            .is_err()
        {
            // The keeper ended: the connection, and with it the lock, is gone.
            return Ok(());
        }
        answer.await.unwrap_or(Ok(()))
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("role", &self.context.state.role)
            .field("term", &self.context.state.term)
            .field("loss", &self.context.signal.loss())
            .finish()
    }
}
