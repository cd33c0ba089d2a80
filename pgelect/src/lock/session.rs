//! Session-level advisory locks on a dedicated connection.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex as StdMutex, MutexGuard as StdMutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, Mutex as AsyncMutex, OwnedMutexGuard};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::SimpleQueryMessage;
use tokio_util::sync::CancellationToken;

use super::holders::{describe, lock_holders, query_holders, LockHolder};
use super::{key_literals, wait_millis, LockMode, Wait};
use crate::conn::probe::{
    self, Probe, LOCK_SESSION_HEARTBEAT, LOCK_SESSION_HEARTBEAT_TIMEOUT, LOCK_SESSION_WAIT_SLICE,
};
use crate::conn::{ConnectOptions, DedicatedConnection, TcpTimeouts};
use crate::error::{Error, Result};
use crate::key::LockKey;
#[cfg(doc)]
use crate::loss::LossReason;
use crate::loss::LossSignal;

// A lock session's defaults, documented on `LockSessionBuilder`, are
// defined beside the elector's, which differ (`conn/probe.rs`).
const DEFAULT_NAME: &str = "locks";
/// A lock wait longer than this looks, on a connection of its own, for who
/// holds the key and logs it at warning level; then again every
/// [`WAIT_RECHECK`], naming only holders not named before.
const WAIT_WARN_AFTER: Duration = Duration::from_secs(5);
const WAIT_RECHECK: Duration = Duration::from_secs(30);

/// A dedicated PostgreSQL connection that holds session-level advisory
/// locks: as many as you like, exclusive or shared.
///
/// A session lock lives as long as the server session that took it, so
/// pgelect takes it on a connection it opens itself (with the TCP keepalive
/// and user timeouts of [`TcpTimeouts`] on both ends, and no idle, statement
/// or lock timeouts) and never returns to a pool. The connection closes when
/// the `LockSession` and every [`LockGuard`] taken from it are dropped; the
/// server then releases whatever is still held.
///
/// # Losing the connection
/// [`lost()`](LockSession::lost) (and the same on every guard and permit,
/// with the rest of the [loss API](crate::loss)) resolves when the
/// connection ends, with [`LossReason::ConnectionLost`]: pushed by the driver task the moment the server's
/// goodbye or a reset arrives (a terminated backend is seen in milliseconds),
/// and backed by a heartbeat (`SHOW transaction_read_only` every
/// [`heartbeat`](LockSessionBuilder::heartbeat)) that closes the connection
/// when an answer takes longer than
/// [`heartbeat_timeout`](LockSessionBuilder::heartbeat_timeout), for the
/// silent failures no packet announces. When `lost()` fires the locks may
/// already be someone else's: stop the work they protect.
///
/// # One statement at a time
/// A PostgreSQL session runs one statement at a time, and a blocking
/// `pg_advisory_lock` occupies it until granted. So a `LockSession` runs its
/// operations one after another, in the order they were called (a fair
/// queue): while an [`acquire`](LockSession::acquire) waits
/// ([`Wait::Forever`], [`Wait::AtMost`]), a [`Wait::Never`] try or a
/// `release` through the same session waits behind it. The heartbeat skips
/// its beats during such a wait; the driver task and the TCP timeouts still
/// watch the connection (a dead peer is noticed within
/// [`TcpTimeouts::detection_bound`]). To wait for one lock while working
/// freely with others, use a second `LockSession` for the wait.
///
/// Taking a key that this session already holds, in either mode, fails with
/// [`Error::AlreadyHeld`] instead of stacking a second lock that one release
/// would not undo.
///
/// ```no_run
/// # async fn f() -> Result<(), pgelect::Error> {
/// use pgelect::lock::{LockMode, Wait};
/// use pgelect::{ConnectOptions, LockKey, LockSession};
///
/// let options = ConnectOptions::from_url("postgres://app:secret@localhost/app")?;
/// let session = LockSession::connect(&options).await?;
/// let key = LockKey::from_name("nightly-report")?;
/// if let Some(guard) = session.acquire(key, LockMode::Exclusive, Wait::Never).await? {
///     tokio::select! {
///         _ = guard.lost() => eprintln!("lock lost, stopping"),
///         _ = async { /* the report */ } => {}
///     }
///     let released = guard.release().await?;
///     assert!(released);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LockSession {
    inner: Arc<Inner>,
}

/// Builds a [`LockSession`]; see [`LockSession::builder`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct LockSessionBuilder {
    options: ConnectOptions,
    heartbeat: Duration,
    heartbeat_timeout: Duration,
    tcp: TcpTimeouts,
    name: String,
    wait_slice: Duration,
}

/// A session-level advisory lock held through a [`LockSession`].
///
/// Release it with [`release`](LockGuard::release), which reports whether
/// PostgreSQL really held and released it. Dropping the guard releases it
/// too, as a best-effort fallback: the release is queued on the session and
/// run by a task spawned on the current Tokio runtime, in turn with the
/// session's other statements (never interleaved with them, since the
/// session runs one statement at a time). It is therefore not immediate; and
/// without a runtime it waits for the next operation on the session, or for
/// the session to close. Either way the key becomes free for this session
/// again before its next operation runs.
#[must_use = "dropping the guard releases the lock (in the background)"]
pub struct LockGuard {
    inner: Arc<Inner>,
    key: LockKey,
    mode: LockMode,
    released: bool,
}

/// Exclusive access to the session's connection, held for every statement.
type Ops = OwnedMutexGuard<()>;

struct Inner {
    conn: DedicatedConnection,
    /// Serialises statements (see "One statement at a time"). Fair (FIFO).
    ops: Arc<AsyncMutex<()>>,
    /// Serialises the semaphore permit acquisitions of this session, which
    /// span several statements (see `semaphore.rs`).
    permits: Arc<AsyncMutex<()>>,
    state: StdMutex<State>,
    /// Bound on every short statement (heartbeat, try, unlock, checks).
    statement_timeout: Duration,
    /// Length of one slice of an unbounded lock wait.
    wait_slice: Duration,
    schema: String,
    /// For the side connection that looks up the holders of a long wait.
    options: ConnectOptions,
    /// The record of the statements answered on the connection: the
    /// heartbeat is not sent while they prove it alive.
    probe: Probe,
}

#[derive(Default)]
struct State {
    held: HashMap<LockKey, LockMode>,
    /// Locks of dropped guards, to release before the next statement.
    pending: Vec<(LockKey, LockMode)>,
    waiting: Option<(LockKey, LockMode)>,
    /// Set while pgelect cancels an abandoned wait: a query-cancel error is
    /// then ours. Otherwise one is a late cancel of an earlier wait (the
    /// driver's cancel request does not wait for the server to act on it)
    /// and the statement is run again.
    cancelling: bool,
}

fn is_query_canceled(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::QUERY_CANCELED)
}

impl LockSession {
    /// Opens a session with the default settings (see [`LockSessionBuilder`]).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-opened connection.
    pub async fn connect(options: &ConnectOptions) -> Result<LockSession> {
        LockSession::builder(options).connect().await
    }

    /// A builder for a session with non-default heartbeat or TCP timeouts.
    ///
    /// ```no_run
    /// # async fn f(options: pgelect::ConnectOptions) -> Result<(), pgelect::Error> {
    /// use std::time::Duration;
    /// let session = pgelect::LockSession::builder(&options)
    ///     .heartbeat(Duration::from_millis(500))
    ///     .heartbeat_timeout(Duration::from_secs(2))
    ///     .name("report-locks")
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(options: &ConnectOptions) -> LockSessionBuilder {
        LockSessionBuilder {
            options: options.clone(),
            heartbeat: LOCK_SESSION_HEARTBEAT,
            heartbeat_timeout: LOCK_SESSION_HEARTBEAT_TIMEOUT,
            tcp: TcpTimeouts::default(),
            name: DEFAULT_NAME.to_owned(),
            wait_slice: LOCK_SESSION_WAIT_SLICE,
        }
    }

    /// Takes `key` in `mode`, waiting as `wait` says: `Ok(Some(guard))`
    /// when granted; `Ok(None)` only with [`Wait::Never`], when another
    /// session holds the key in a conflicting mode;
    /// [`Error::LockTimeout`] when a [`Wait::AtMost`] wait ran out.
    /// [`Error::AlreadyHeld`] when this session holds the key already (in
    /// either mode).
    ///
    /// # Waiting
    /// * [`Wait::Never`]: one `pg_try_advisory_lock[_shared]`.
    /// * [`Wait::Forever`]: PostgreSQL's own wait (`pg_advisory_lock`): the
    ///   lock is granted the moment the holder lets go, and waiters are
    ///   served in order. The wait is re-issued every
    ///   [`wait_slice`](LockSessionBuilder::wait_slice) (10 s) so that it
    ///   does not hold back VACUUM; a re-issued wait queues again.
    /// * [`Wait::AtMost`]: the server bounds the wait (`lock_timeout`, set
    ///   for this one wait and reset in the same round trip), so no cancel
    ///   request is needed and the bound holds to the millisecond.
    ///   PostgreSQL may grant the lock at the very moment the timeout fires
    ///   and still report the timeout; pgelect then finds the lock in
    ///   `pg_locks` and returns the guard rather than leak the lock. The
    ///   timeout error names who held the lock then (`holders` of
    ///   [`Error::LockTimeout`]). A zero bound is refused with
    ///   [`Error::Config`] (see [`Wait::AtMost`]).
    ///
    /// Other operations on this session queue behind a wait (see "One
    /// statement at a time"). A wait that lasts longer than 5 s looks up
    /// who holds the key (on a short-lived connection of its own) and logs
    /// a warning naming each holder's pid, user and application name:
    /// advisory keys are public, and any user who can connect to the
    /// database can hold one.
    ///
    /// # Cancel safety
    /// Cancel safe: when the future is dropped, pgelect cancels the wait on
    /// the server (a cancel request, as `pg_cancel_backend` would), and if
    /// the lock was granted in the meantime releases it, before the
    /// session's next statement runs.
    ///
    /// ```no_run
    /// # async fn f(session: pgelect::LockSession) -> Result<(), pgelect::Error> {
    /// use std::time::Duration;
    /// use pgelect::lock::{LockMode, Wait};
    /// let key = pgelect::LockKey::from_i64(42);
    /// match session.acquire(key, LockMode::Exclusive, Wait::AtMost(Duration::from_secs(3))).await {
    ///     Ok(Some(guard)) => { /* ... */ guard.release().await?; }
    ///     Ok(None) => unreachable!("only Wait::Never answers None"),
    ///     Err(e) if e.is_timeout() => eprintln!("busy, try later"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn acquire(
        &self,
        key: LockKey,
        mode: LockMode,
        wait: Wait,
    ) -> Result<Option<LockGuard>> {
        wait.check()?;
        // The statement runs in a task of its own, so that whatever the
        // caller does with this future, the session ends in a known state:
        // if the caller goes away, the task cancels the server-side wait and
        // releases a lock that was granted anyway.
        let inner = self.inner.clone();
        let (mut tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let ops = tokio::select! {
                ops = inner.ops.clone().lock_owned() => ops,
                _ = tx.closed() => return,
            };
            let result = inner.acquire_locked(&ops, key, mode, wait, &mut tx).await;
            if let Err(Ok(Some(guard))) = tx.send(result) {
                inner.release_unwanted(&ops, guard).await;
            }
        });
        rx.await.unwrap_or(Err(Error::connection_lost(
            "acquire a lock (the runtime is shutting down)",
        )))
    }

    /// The other sessions of this database that hold `key` (see
    /// [`admin::lock_holders`](crate::admin::lock_holders)): who to blame after a
    /// [`Wait::Never`] try returned `None` or a wait timed out. Runs on this
    /// session's connection, so it queues behind a wait in progress.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn holders(&self, key: LockKey) -> Result<Vec<LockHolder>> {
        let ops = self.inner.ops.clone().lock_owned().await;
        let holders = self.inner.holders(key).await;
        drop(ops);
        holders
    }

    /// The keys this session holds through live guards (or whose release
    /// after a drop is still queued), with their modes.
    pub fn held(&self) -> Vec<(LockKey, LockMode)> {
        let state = self.inner.state();
        state.held.iter().map(|(k, m)| (*k, *m)).collect()
    }

    /// The process id of the server backend that holds the locks (as in
    /// `pg_locks.pid` and `pg_stat_activity.pid`).
    pub fn backend_pid(&self) -> i32 {
        self.inner.conn.pid()
    }

    crate::loss::connection_loss_methods! {
        self => self.inner.signal();
        ended: "the connection",
        after: ", and with it every lock of this session; see \"Losing the connection\".",
        loss: "Why and when the connection ended; `None` while it lasts.",
    }

    /// Test hook, not API, built only with the `test-hooks` feature: runs
    /// `pg_advisory_unlock_all()` on the session behind the guards' backs,
    /// so that tests can see [`LockGuard::release`] report `false`.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub async fn unlock_all_behind_guards_for_tests(&self) -> Result<()> {
        let ops = self.inner.ops.clone().lock_owned().await;
        self.inner
            .run_short_statement("unlock all (test hook)", || {
                self.inner
                    .client()
                    .simple_query("SELECT pg_advisory_unlock_all()")
            })
            .await?;
        drop(ops);
        Ok(())
    }
}

/// Exclusive use of a session's connection for one statement of a compound
/// operation built on the session (the semaphore's): it runs its own SQL
/// and adopts the locks that SQL took, as guards.
pub(crate) struct Turn {
    inner: Arc<Inner>,
    _ops: Ops,
}

impl LockSession {
    /// Waits for the session's connection, releases what dropped guards
    /// left, and fails if the connection is gone.
    pub(crate) async fn take_connection(&self, operation: &'static str) -> Result<Turn> {
        let ops = self.inner.ops.clone().lock_owned().await;
        self.inner.flush_pending(&ops).await;
        if self.inner.signal().is_lost() {
            return Err(self.inner.conn.lost(operation));
        }
        Ok(Turn {
            inner: self.inner.clone(),
            _ops: ops,
        })
    }

    /// One permit acquisition at a time on this session (they span several
    /// statements and share the semaphore's gate key).
    pub(crate) async fn permit_turn(&self) -> OwnedMutexGuard<()> {
        self.inner.permits.clone().lock_owned().await
    }

    /// `LISTEN` notifications of this session's connection, from now on.
    pub(crate) fn notices(&self) -> tokio::sync::broadcast::Receiver<crate::conn::Notice> {
        self.inner.conn.notices()
    }
}

impl Turn {
    /// The session's client, for reads; bound them with a timeout.
    pub(crate) fn client(&self) -> &tokio_postgres::Client {
        self.inner.client()
    }

    /// The session's bound on a short statement.
    pub(crate) fn statement_timeout(&self) -> Duration {
        self.inner.statement_timeout
    }

    /// True when a live guard of this session holds `key`.
    pub(crate) fn is_held(&self, key: LockKey) -> bool {
        self.inner.state().held.contains_key(&key)
    }

    /// Runs `sql` (simple-query protocol), bounded like every short
    /// statement of the session, and never retried: a statement that takes
    /// locks must not run twice. On a timeout the connection is closed.
    pub(crate) async fn simple_query(
        &self,
        operation: &'static str,
        sql: &str,
    ) -> Result<Vec<SimpleQueryMessage>> {
        let inner = &self.inner;
        match tokio::time::timeout(inner.statement_timeout, inner.client().simple_query(sql)).await
        {
            Ok(Ok(messages)) => Ok(messages),
            Ok(Err(e)) if e.is_closed() => Err(inner.lost_by(operation, e)),
            Ok(Err(e)) => Err(Error::db(operation, &inner.schema, e)),
            Err(_) => {
                tracing::warn!(
                    pid = inner.conn.pid(),
                    timeout = ?inner.statement_timeout,
                    operation,
                    "lock connection did not answer in time; closing it"
                );
                inner.conn.kill();
                Err(Error::connection_lost(operation))
            }
        }
    }

    /// A guard for a lock this turn's SQL took. `registered`: listed as
    /// held (and then refused by the session's own `lock` calls); a lock the
    /// session may hold several times over (a stacked shared lock) is not.
    pub(crate) fn guard_taken_lock(
        &self,
        key: LockKey,
        mode: LockMode,
        registered: bool,
    ) -> LockGuard {
        if registered {
            self.inner.register(key, mode)
        } else {
            LockGuard {
                inner: self.inner.clone(),
                key,
                mode,
                released: false,
            }
        }
    }
}

impl LockSessionBuilder {
    /// How often the heartbeat checks the connection with `SHOW transaction_read_only`.
    /// Default: `1s`. Must be positive.
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every;
        self
    }

    /// How long the heartbeat, and every other short statement of the
    /// session (try, release, checks), may wait for an answer before the
    /// connection is declared dead and closed, so that the server releases
    /// its locks and [`LockSession::lost`] fires. Lock waits are not
    /// bounded by it. Default: `5s`. Must be positive.
    pub fn heartbeat_timeout(mut self, timeout: Duration) -> Self {
        self.heartbeat_timeout = timeout;
        self
    }

    /// TCP keepalive and user timeouts, applied on the client and, through
    /// session settings, on the server. Default: [`TcpTimeouts::default`].
    pub fn tcp_timeouts(mut self, tcp: TcpTimeouts) -> Self {
        self.tcp = tcp;
        self
    }

    /// Names the connection `pgelect:<name>` in `pg_stat_activity` (unless
    /// the connection options set an application name). Default: `locks`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// How long one slice of an unbounded wait ([`Wait::Forever`]) lasts
    /// before it is issued again.
    /// Default: `10s`. Must be positive, at most 24 h.
    ///
    /// A waiting statement holds a snapshot, and the oldest snapshot bounds
    /// what VACUUM may remove in the whole database (the xmin horizon): one
    /// `pg_advisory_lock` blocked for hours keeps every dead row for hours.
    /// Each slice catches its own lock timeout (the server logs no error).
    /// The price: the server's waiting order is kept within a slice only,
    /// since a re-issued wait queues again.
    pub fn wait_slice(mut self, slice: Duration) -> Self {
        self.wait_slice = slice;
        self
    }

    /// Validates the settings, connects, and starts the heartbeat.
    ///
    /// Fails with [`Error::Config`] for a zero heartbeat, heartbeat
    /// timeout or wait slice, before connecting.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-opened connection.
    pub async fn connect(self) -> Result<LockSession> {
        if self.heartbeat.is_zero() {
            return Err(Error::config(format!(
                "lock session heartbeat must be positive, got {:?}",
                self.heartbeat
            )));
        }
        if self.wait_slice.is_zero() || self.wait_slice > Duration::from_secs(24 * 3600) {
            return Err(Error::config(format!(
                "lock session wait_slice must be positive and at most 24h, got {:?}",
                self.wait_slice
            )));
        }
        if self.heartbeat_timeout.is_zero() {
            return Err(Error::config(format!(
                "lock session heartbeat_timeout must be positive, got {:?}",
                self.heartbeat_timeout
            )));
        }
        let conn = self
            .options
            .connect_for_locks(&self.name, &self.tcp)
            .await?;
        let lost = conn.closed().clone();
        let inner = Arc::new(Inner {
            conn,
            ops: Arc::new(AsyncMutex::new(())),
            permits: Arc::new(AsyncMutex::new(())),
            state: StdMutex::new(State::default()),
            statement_timeout: self.heartbeat_timeout,
            wait_slice: self.wait_slice,
            schema: self.options.schema_name().as_str().to_owned(),
            options: self.options,
            probe: Probe::default(),
        });
        tokio::spawn(heartbeat(Arc::downgrade(&inner), lost, self.heartbeat));
        Ok(LockSession { inner })
    }
}

impl LockGuard {
    /// The key held.
    pub fn key(&self) -> LockKey {
        self.key
    }

    /// The mode it is held in.
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// The process id of the server backend holding the lock.
    pub fn backend_pid(&self) -> i32 {
        self.inner.conn.pid()
    }

    crate::loss::connection_loss_methods! {
        self => self.inner.signal();
        ended: "the connection holding the lock",
        after: ": from then on the lock is not held (the server released it, or will as soon as it notices). Stop the work the lock protects.",
        loss: "Why and when the lock was lost; `None` while it is held.",
    }

    /// Releases the lock and reports what PostgreSQL did: `true` when it
    /// held the lock and released it (`pg_advisory_unlock` returned true),
    /// `false` when the server did not hold it (someone released it behind
    /// pgelect's back, e.g. with `pg_advisory_unlock_all()` on this
    /// connection).
    ///
    /// Fails with [`Error::ConnectionLost`] when the connection is gone; the
    /// server releases locks of a closed session by itself.
    ///
    /// # Cancel safety
    /// Cancel safe: if the future is dropped, the guard is dropped with it
    /// and the drop fallback releases the lock (a second unlock of a lock
    /// already released does no harm).
    pub async fn release(mut self) -> Result<bool> {
        let inner = self.inner.clone();
        let ops = inner.ops.clone().lock_owned().await;
        inner.flush_pending(&ops).await;
        if inner.signal().is_lost() {
            inner.state().held.remove(&self.key);
            self.released = true;
            return Err(inner.conn.lost("release a lock"));
        }
        match inner.unlock(&ops, self.key, self.mode).await {
            Ok(released) => {
                inner.state().held.remove(&self.key);
                self.released = true;
                Ok(released)
            }
            Err(e) if e.is_connection() => {
                inner.state().held.remove(&self.key);
                self.released = true;
                Err(e)
            }
            // Leaves `released` false: the drop fallback tries once more.
            Err(e) => Err(e),
        }
    }
}

impl LockGuard {
    /// Forgets a guard whose lock a [`Turn`]'s SQL released (or that went
    /// with a lost connection).
    pub(crate) fn mark_released(mut self) {
        self.inner.state().held.remove(&self.key);
        self.released = true;
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.inner.state().pending.push((self.key, self.mode));
        if self.inner.signal().is_lost() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let inner = self.inner.clone();
            runtime.spawn(async move {
                let ops = inner.ops.clone().lock_owned().await;
                inner.flush_pending(&ops).await;
            });
        } else {
            tracing::debug!(
                key = %self.key,
                "lock guard dropped outside a Tokio runtime: the release waits for the \
                 session's next operation or its end"
            );
        }
    }
}

impl Inner {
    fn state(&self) -> StdMutexGuard<'_, State> {
        // No code panics while holding this lock; recover the data anyway.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn client(&self) -> &tokio_postgres::Client {
        self.conn.client()
    }

    /// The connection's end: the session's, its guards' and permits' loss.
    fn signal(&self) -> &LossSignal {
        self.conn.signal()
    }

    /// [`Error::ConnectionLost`] for a statement that found the connection
    /// closed (`e`): its source is the error the connection ended with
    /// (the server's `FATAL`, an I/O error), else the statement's own.
    fn lost_by(&self, operation: &'static str, e: tokio_postgres::Error) -> Error {
        Error::connection_lost_by(
            operation,
            self.conn.ended_by().or_else(|| Some(Arc::new(e))),
        )
    }

    /// Runs a short statement bounded by `statement_timeout`; one that does
    /// not answer in time means the connection is dead: it is closed (the
    /// server then releases the locks) and `lost` fires.
    ///
    /// A query-cancel error is a late cancel request of an abandoned wait
    /// (nothing else of pgelect cancels a short statement): it is run again,
    /// once.
    async fn run_short_statement<T, F>(
        &self,
        operation: &'static str,
        statement: impl Fn() -> F,
    ) -> Result<T>
    where
        F: Future<Output = std::result::Result<T, tokio_postgres::Error>>,
    {
        let bounded = async {
            match statement().await {
                Err(e) if is_query_canceled(&e) => {
                    tracing::debug!(
                        operation,
                        "a late cancel request hit a short statement; running it again"
                    );
                    statement().await
                }
                other => other,
            }
        };
        let sent = tokio::time::Instant::now();
        match tokio::time::timeout(self.statement_timeout, bounded).await {
            Ok(Ok(v)) => {
                self.probe.credit(sent);
                Ok(v)
            }
            Ok(Err(e)) if e.is_closed() => Err(self.lost_by(operation, e)),
            Ok(Err(e)) => Err(Error::db(operation, &self.schema, e)),
            Err(_) => {
                tracing::warn!(
                    pid = self.conn.pid(),
                    timeout = ?self.statement_timeout,
                    operation,
                    "lock connection did not answer in time; closing it"
                );
                self.conn.kill();
                Err(Error::connection_lost(operation))
            }
        }
    }

    async fn acquire_locked(
        self: &Arc<Self>,
        ops: &Ops,
        key: LockKey,
        mode: LockMode,
        wait: Wait,
        caller: &mut oneshot::Sender<Result<Option<LockGuard>>>,
    ) -> Result<Option<LockGuard>> {
        self.flush_pending(ops).await;
        if self.signal().is_lost() {
            return Err(self.conn.lost("acquire a lock"));
        }
        if self.state().held.contains_key(&key) {
            return Err(Error::AlreadyHeld {
                key: key.to_string(),
            });
        }
        let params = key.params();
        let args: Vec<_> = params.iter().map(|p| p.as_sql()).collect();
        match wait {
            Wait::Never => {
                let sql = format!(
                    "SELECT pg_try_advisory_lock{}({})",
                    mode.suffix(),
                    key.sql_args(1)
                );
                let row = self
                    .run_short_statement("try a lock", || {
                        self.client().query_typed_one(&sql, &args)
                    })
                    .await?;
                // pg_try_advisory_lock returns boolean; a decoding failure
                // would be a driver bug, reported rather than panicked on.
                let granted: bool = row
                    .try_get(0)
                    .map_err(|e| Error::db("try a lock", &self.schema, e))?;
                Ok(granted.then(|| self.register(key, mode)))
            }
            Wait::Forever => {
                // In slices (see `LockSessionBuilder::wait_slice`): the
                // block catches its lock timeout and says whether the lock
                // was granted in a transaction-local setting, read by the
                // second statement of the same implicit transaction.
                let ms = self.wait_slice.as_millis();
                let sql = format!(
                    "DO $pgelect$ BEGIN
                         PERFORM set_config('lock_timeout', '{ms}', true);
                         PERFORM pg_advisory_lock{}({});
                         PERFORM set_config('pgelect.granted', 'on', true);
                     EXCEPTION WHEN lock_not_available THEN NULL;
                     END $pgelect$;
                     SELECT current_setting('pgelect.granted', true)",
                    mode.suffix(),
                    key_literals(&key)
                );
                let statement = async {
                    loop {
                        let messages = match self.client().simple_query(&sql).await {
                            Err(e) if is_query_canceled(&e) && !self.state().cancelling => {
                                tracing::debug!(%key, "a late cancel request hit a lock wait; waiting again");
                                continue;
                            }
                            r => r?,
                        };
                        let granted = messages.iter().any(|m| match m {
                            SimpleQueryMessage::Row(r) => matches!(r.try_get(0), Ok(Some("on"))),
                            _ => false,
                        });
                        if granted {
                            return Ok(());
                        }
                    }
                };
                self.wait_for(ops, key, mode, false, statement, caller)
                    .await
            }
            Wait::AtMost(bound) => {
                let ms = wait_millis(bound)?;
                // One round trip, one implicit transaction: if the wait
                // fails, the rollback also undoes the SET, so lock_timeout
                // is back at 0 either way (a session lock taken inside an
                // aborted transaction stays held, which is checked below).
                let sql = format!(
                    "SET lock_timeout = '{ms}ms'; SELECT pg_advisory_lock{}({}); SET lock_timeout = 0",
                    mode.suffix(),
                    key_literals(&key)
                );
                let statement = async {
                    match self.client().simple_query(&sql).await {
                        Err(e) if is_query_canceled(&e) && !self.state().cancelling => {
                            tracing::debug!(%key, "a late cancel request hit a bounded lock wait; waiting again");
                            self.client().simple_query(&sql).await.map(drop)
                        }
                        r => r.map(drop),
                    }
                };
                self.wait_for(ops, key, mode, true, statement, caller).await
            }
        }
    }

    /// Drives a lock wait to its end, cancelling it on the server if the
    /// caller goes away, and makes sure no granted lock is left untracked.
    async fn wait_for(
        self: &Arc<Self>,
        ops: &Ops,
        key: LockKey,
        mode: LockMode,
        bounded: bool,
        statement: impl Future<Output = std::result::Result<(), tokio_postgres::Error>>,
        caller: &mut oneshot::Sender<Result<Option<LockGuard>>>,
    ) -> Result<Option<LockGuard>> {
        let started = Instant::now();
        self.state().waiting = Some((key, mode));
        let _probe = AbortOnDrop(tokio::spawn(warn_about_holders(
            self.options.clone(),
            self.conn.pid(),
            key,
        )));
        tokio::pin!(statement);
        let (outcome, abandoned) = tokio::select! {
            outcome = &mut statement => (outcome, false),
            _ = caller.closed() => {
                tracing::debug!(%key, pid = self.conn.pid(), "lock wait abandoned; cancelling it on the server");
                self.state().cancelling = true;
                if let Err(e) = self.conn.canceller().cancel().await {
                    tracing::warn!(%key, error = %e, "could not cancel an abandoned lock wait; it ends when granted");
                }
                (statement.await, true)
            }
        };
        {
            let mut state = self.state();
            state.waiting = None;
            state.cancelling = false;
        }
        match outcome {
            Ok(()) if abandoned => {
                if let Err(e) = self.unlock(ops, key, mode).await {
                    tracing::warn!(%key, error = %e, "could not release a lock granted after its wait was abandoned");
                }
                Ok(None)
            }
            Ok(()) => Ok(Some(self.register(key, mode))),
            Err(e) if e.is_closed() => Err(self.lost_by("wait for a lock", e)),
            Err(e) => {
                // PostgreSQL can grant the lock at the moment the wait
                // fails (timeout, cancel) and still report the failure; a
                // session lock then stays held. Look, and do not leak it.
                let timed_out = bounded && e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE);
                let granted = self.is_granted(key, mode).await?;
                if granted && timed_out && !abandoned {
                    tracing::debug!(%key, "lock granted as its wait timed out; keeping it");
                    return Ok(Some(self.register(key, mode)));
                }
                if granted {
                    self.unlock(ops, key, mode).await?;
                }
                if timed_out {
                    let waited = started.elapsed();
                    let holders = self.holders(key).await.unwrap_or_else(|e| {
                        tracing::debug!(%key, error = %e, "could not look up the holders of a lock");
                        Vec::new()
                    });
                    Err(Error::LockTimeout {
                        key: key.to_string(),
                        waited,
                        holders,
                    })
                } else {
                    Err(Error::db("wait for a lock", &self.schema, e))
                }
            }
        }
    }

    /// The other backends holding `key`, bounded like every short statement.
    async fn holders(&self, key: LockKey) -> Result<Vec<LockHolder>> {
        self.run_short_statement("find the holders of a lock", || {
            query_holders(self.client(), key)
        })
        .await
    }

    /// True when this backend holds `key` in `mode` (per `pg_locks`).
    async fn is_granted(&self, key: LockKey, mode: LockMode) -> Result<bool> {
        let (classid, objid, objsubid) = key.pg_locks_ids();
        let mode_name = mode.pg_locks_mode();
        let args: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 4] = [
            (&classid, Type::OID),
            (&objid, Type::OID),
            (&objsubid, Type::INT2),
            (&mode_name, Type::TEXT),
        ];
        let row = self
            .run_short_statement("check pg_locks", || {
                self.client().query_typed_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks
                      WHERE locktype = 'advisory' AND pid = pg_backend_pid()
                        AND classid = $1 AND objid = $2 AND objsubid = $3
                        AND mode = $4 AND granted)",
                    &args,
                )
            })
            .await?;
        row.try_get(0)
            .map_err(|e| Error::db("check pg_locks", &self.schema, e))
    }

    /// `pg_advisory_unlock[_shared]`: true when the server held and released.
    async fn unlock(&self, _ops: &Ops, key: LockKey, mode: LockMode) -> Result<bool> {
        let sql = format!(
            "SELECT pg_advisory_unlock{}({})",
            mode.suffix(),
            key.sql_args(1)
        );
        let params = key.params();
        let args: Vec<_> = params.iter().map(|p| p.as_sql()).collect();
        let row = self
            .run_short_statement("release a lock", || {
                self.client().query_typed_one(&sql, &args)
            })
            .await?;
        row.try_get(0)
            .map_err(|e| Error::db("release a lock", &self.schema, e))
    }

    /// Releases the locks of dropped guards.
    async fn flush_pending(&self, ops: &Ops) {
        loop {
            let next = self.state().pending.pop();
            let Some((key, mode)) = next else { break };
            if !self.signal().is_lost() {
                match self.unlock(ops, key, mode).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(%key, "a dropped lock guard's lock was not held any more")
                    }
                    Err(e) => tracing::warn!(
                        %key, error = %e,
                        "releasing a dropped lock guard's lock failed; it stays held until the session ends"
                    ),
                }
            }
            self.state().held.remove(&key);
        }
    }

    fn register(self: &Arc<Self>, key: LockKey, mode: LockMode) -> LockGuard {
        self.state().held.insert(key, mode);
        LockGuard {
            inner: self.clone(),
            key,
            mode,
            released: false,
        }
    }

    /// Releases a lock granted to a caller that went away meanwhile.
    async fn release_unwanted(&self, ops: &Ops, mut guard: LockGuard) {
        if let Err(e) = self.unlock(ops, guard.key, guard.mode).await {
            tracing::warn!(key = %guard.key, error = %e, "could not release a lock nobody waited for any more");
        }
        self.state().held.remove(&guard.key);
        guard.released = true;
    }
}

/// Aborts a task when dropped: the holder lookup of a wait that ended.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// While a wait lasts (this task is aborted when it ends): after
/// [`WAIT_WARN_AFTER`] and then every [`WAIT_RECHECK`], looks up who holds
/// `key` on a short-lived connection of its own (the session's is busy
/// waiting) and logs each holder not named before at warning level.
async fn warn_about_holders(options: ConnectOptions, waiter: i32, key: LockKey) {
    let started = Instant::now();
    let mut named = std::collections::HashSet::new();
    tokio::time::sleep(WAIT_WARN_AFTER).await;
    loop {
        let found = async {
            let conn = options.connect("lock-holders").await?;
            let holders = lock_holders(conn.client(), key).await;
            conn.close().await;
            holders
        };
        match tokio::time::timeout(LOCK_SESSION_HEARTBEAT_TIMEOUT, found).await {
            Ok(Ok(holders)) => {
                let new: Vec<LockHolder> = holders
                    .into_iter()
                    .filter(|h| h.pid != waiter && named.insert(h.pid))
                    .collect();
                if !new.is_empty() {
                    tracing::warn!(
                        %key,
                        waited = %crate::error::rounded(started.elapsed()),
                        pids = ?new.iter().map(|h| h.pid).collect::<Vec<_>>(),
                        "still waiting for a lock {}; advisory locks are database-wide: any user who can connect can hold a key",
                        describe(&new)
                    );
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(%key, error = %e, "could not look up who holds a lock")
            }
            Err(_) => tracing::debug!(%key, "looking up who holds a lock took too long"),
        }
        tokio::time::sleep(WAIT_RECHECK).await;
    }
}

/// Probes the connection every `every` ([`probe::ask`]), unless a
/// statement is in flight (a short one is bounded by the same timeout, a
/// lock wait is watched by the driver and TCP) or one was answered within
/// the interval, and closes it when a probe is not answered within the
/// statement timeout. Ends with the session.
async fn heartbeat(session: Weak<Inner>, lost: CancellationToken, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    let mut probed = None;
    loop {
        tokio::select! {
            _ = lost.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let Some(inner) = session.upgrade() else {
            return;
        };
        // Busy means a statement is in flight: a short one is bounded by the
        // same timeout, a lock wait is watched by the driver and TCP.
        let Ok(ops) = inner.ops.clone().try_lock_owned() else {
            continue;
        };
        inner.flush_pending(&ops).await;
        if inner.signal().is_lost() {
            return;
        }
        // Another statement answered within the interval (not this task's
        // last probe) counts as the probe's answer.
        let last = inner.probe.last_answer();
        let window = tokio::time::Instant::now().checked_sub(every);
        if last != probed && last.zip(window).is_some_and(|(a, w)| a >= w) {
            continue;
        }
        // The connection probe every holder of a connection sends (its
        // answer's server mode is not a lock session's concern).
        if let Err(e) = inner
            .run_short_statement("check the connection", || probe::ask(inner.client()))
            .await
        {
            tracing::warn!(pid = inner.conn.pid(), error = %e, "lock connection heartbeat failed; closing it");
            inner.conn.kill();
            return;
        }
        probed = inner.probe.last_answer();
    }
}

impl fmt::Debug for LockSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.inner.state();
        f.debug_struct("LockSession")
            .field("backend_pid", &self.inner.conn.pid())
            .field("held", &state.held)
            .field("waiting", &state.waiting)
            .field("lost", &self.inner.signal().is_lost())
            .finish()
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key)
            .field("mode", &self.mode)
            .field("backend_pid", &self.inner.conn.pid())
            .field("released", &self.released)
            .field("lost", &self.inner.signal().is_lost())
            .finish()
    }
}
