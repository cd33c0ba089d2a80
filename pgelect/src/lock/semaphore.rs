//! Counting semaphores: at most N holders of a named resource at once,
//! held on a [`LockSession`]. The design is on [`Semaphore`].
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::broadcast::error::RecvError;
use tokio_postgres::types::Type;
use tokio_postgres::{GenericClient, SimpleQueryMessage};

use super::holders::LockHolder;
use super::session::{LockGuard, LockSession, Turn};
use super::{key_literals, wait_millis, LockMode, Wait};
use crate::error::{Error, Result};
use crate::key::{hash_in_domain, validate_name, LockKey};

/// The largest limit a [`Semaphore`] may have.
///
/// A head waiter tries every slot in one statement, and the limit check
/// reads the limit key's `pg_locks` entries: both stay cheap at this size.
pub const MAX_SEMAPHORE_LIMIT: u32 = 1024;

/// Default fallback poll of the head waiter.
const DEFAULT_POLL_EVERY: Duration = Duration::from_millis(500);
/// Bounds of [`Semaphore::poll_every`].
const MIN_POLL_EVERY: Duration = Duration::from_millis(10);
const MAX_POLL_EVERY: Duration = Duration::from_secs(60);

/// Hash domains of the semaphore's keys. None starts with `pgelect:` (the
/// domain of [`LockKey::from_name`]); a slot's index is followed by `:`, and
/// `gate` and `limit` are not numbers, so no two inputs coincide.
const SLOT_DOMAIN: &str = "pgelect-semaphore:";
const GATE_DOMAIN: &str = "pgelect-semaphore:gate:";
const LIMIT_DOMAIN: &str = "pgelect-semaphore:limit:";
/// The transaction-local setting through which a `DO` block reports.
const OUTCOME: &str = "pgelect.permit";

/// A named counting semaphore: at most [`limit`](Semaphore::limit) holders
/// of its permits at once, database-wide.
///
/// A `Semaphore` is only a description (name, limit, keys): permits are
/// taken through a [`LockSession`] ([`acquire_permit`], with a [`Wait`]
/// policy) and held by that
/// session's connection, so that a crashed holder's permit frees when its
/// connection ends. A [`Permit`] is watched like a [`LockGuard`]: stop the
/// work when its [`lost()`](Permit::lost) fires.
///
/// # How it works
/// A semaphore of limit N is N advisory keys, its *slots*, plus a *gate*
/// key and a *limit* key, all hashed from its name in a key family of their
/// own (they never coincide with [`LockKey::from_name`] keys; see
/// [`slot_key`](Semaphore::slot_key)). A permit is one slot, held
/// exclusively by the session: the server itself never lets more than N
/// sessions hold a slot, and a slot frees the moment its session ends (a
/// killed process's at once, since its kernel closes the socket; a
/// vanished host's within the [`TcpTimeouts`](crate::conn::TcpTimeouts)).
///
/// Waiters queue on the gate: PostgreSQL grants an advisory lock to its
/// waiters in the order they asked, so the gate's holder is the longest
/// waiter, the *head*. Only the head looks for a free slot (all slots in
/// one statement), woken by the `NOTIFY` that [`Permit::release`] sends on
/// the semaphore's [`channel`](Semaphore::channel), and by a poll every
/// [`poll_every`](Semaphore::poll_every) as a fallback (a crashed holder
/// sends nothing, and any user may `NOTIFY`). With a slot, it lets go of
/// the gate in the same statement, and the next waiter becomes the head.
/// Newcomers, [`Wait::Never`] tries included, take a slot only through
/// the gate, so they cannot overtake a waiter.
///
/// # The limit is part of the resource
/// Every user of a name must give the same limit. Each holder and waiter
/// holds the limit key, a shared lock on the two-integer key `(h, N)` (`h`
/// from the name): `pg_locks` shows the limits in use, and a session that
/// asks for a limit other than the one the current users hold is refused
/// with [`Error::Config`] naming that limit and a backend holding it (of
/// two that arrive together with different limits, at least the later is
/// refused). Once nobody uses the name, a new limit may be used.
///
/// # Sharp edges
/// * Fair within a [`wait_slice`](crate::lock::LockSessionBuilder::wait_slice)
///   (10 s by default): a queued waiter's wait for the gate is re-issued
///   every slice so that it does not hold back VACUUM, and a re-issued wait
///   queues again behind those who arrived meanwhile. The head keeps its
///   place until served. Raise the slice for strict order under long waits.
/// * A head that is alive but stuck (a stopped process whose connection
///   stays up) holds up the waiters behind it, as any lock holder would.
/// * The keys are public, as every advisory key: a session that takes a
///   slot or the gate by hand counts as a holder or a head. Slots also
///   share the `bigint` key space with other users' keys (a coincidence
///   of 64-bit hashes is improbable), and the limit key the two-integer
///   one, where a foreign lock on `(h, M)` would read as "limit M in use".
/// * The waiting session `LISTEN`s on the channel from its first wait on,
///   until it closes.
///
/// [`acquire_permit`]: LockSession::acquire_permit
///
/// ```
/// use pgelect::lock::Semaphore;
///
/// let uploads = Semaphore::new("s3-uploads", 4).unwrap();
/// assert_eq!(uploads.limit(), 4);
/// assert_ne!(uploads.slot_key(0), uploads.slot_key(1));
/// assert_eq!(uploads.slot_key(4), None);
/// // Slots do not depend on the limit: slot 0 is slot 0 for every limit.
/// assert_eq!(Semaphore::new("s3-uploads", 9).unwrap().slot_key(0), uploads.slot_key(0));
/// // And never coincide with a plain lock of the same name.
/// assert_ne!(uploads.slot_key(0), Some(pgelect::LockKey::from_name("s3-uploads").unwrap()));
///
/// assert!(Semaphore::new("s3-uploads", 0).is_err());
/// assert!(Semaphore::new("s3-uploads", pgelect::lock::MAX_SEMAPHORE_LIMIT + 1).is_err());
/// assert!(Semaphore::new("", 1).is_err());
/// ```
#[derive(Clone)]
pub struct Semaphore {
    inner: Arc<Keys>,
    poll_every: Duration,
}

struct Keys {
    name: String,
    limit: u32,
    gate: LockKey,
    limit_key: LockKey,
    slots: Vec<LockKey>,
    channel: String,
}

/// One permit of a [`Semaphore`], held by a [`LockSession`]'s connection.
///
/// Like a [`LockGuard`]: watch [`lost()`](Permit::lost) and stop the work
/// when it fires (the connection ended, so the slot is free for someone
/// else); end with [`release`](Permit::release), which frees the slot and
/// wakes the longest waiter at once. Dropping the permit releases it too,
/// as a best-effort fallback: in a task spawned on the current Tokio
/// runtime (without a runtime, at the session's next operation).
#[must_use = "dropping the permit releases it (in the background)"]
pub struct Permit {
    session: LockSession,
    semaphore: Arc<Keys>,
    slot: u32,
    /// The slot's guard and the limit key's; `None` once released.
    guards: Option<(LockGuard, LockGuard)>,
}

/// A session holding one permit of a semaphore, as `pg_locks` and
/// `pg_stat_activity` show it (see [`LockSession::permit_holders`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PermitHolder {
    /// The slot it holds, `0..limit`.
    pub slot: u32,
    /// Who holds it.
    pub holder: LockHolder,
}

impl Semaphore {
    /// Describes the semaphore `name` with at most `limit` holders.
    ///
    /// Fails with [`Error::InvalidName`] for a name [`LockKey::from_name`]
    /// would refuse (empty, with a NUL, longer than 64 KiB), and with
    /// [`Error::Config`] for a limit of 0 or above
    /// [`MAX_SEMAPHORE_LIMIT`]. Computes the keys (one SHA-256 per slot);
    /// clone it rather than building it again.
    pub fn new(name: impl Into<String>, limit: u32) -> Result<Semaphore> {
        let name = name.into();
        validate_name("semaphore name", &name)?;
        if limit == 0 || limit > MAX_SEMAPHORE_LIMIT {
            return Err(Error::config(format!(
                "semaphore limit must be between 1 and {MAX_SEMAPHORE_LIMIT}, got {limit}"
            )));
        }
        let gate = hash_in_domain(GATE_DOMAIN, &name);
        let family = (hash_in_domain(LIMIT_DOMAIN, &name) >> 32) as i32;
        let slots = (0..limit)
            .map(|i| LockKey::Single(hash_in_domain(&format!("{SLOT_DOMAIN}{i}:"), &name)))
            .collect();
        Ok(Semaphore {
            inner: Arc::new(Keys {
                channel: format!("pgelect_semaphore_{:016x}", gate as u64),
                gate: LockKey::Single(gate),
                limit_key: LockKey::Pair(family, limit as i32),
                slots,
                limit,
                name,
            }),
            poll_every: DEFAULT_POLL_EVERY,
        })
    }

    /// How often the longest waiter looks for a free slot when no `NOTIFY`
    /// woke it: the bound on how long a slot freed without one (a holder's
    /// connection ended, a permit dropped outside a runtime) stays unused.
    /// Default: `500ms`. Between 10 ms and 60 s, else [`Error::Config`].
    /// Each look is one statement of the waiting session.
    pub fn poll_every(mut self, every: Duration) -> Result<Semaphore> {
        if !(MIN_POLL_EVERY..=MAX_POLL_EVERY).contains(&every) {
            return Err(Error::config(format!(
                "semaphore poll_every must be between {MIN_POLL_EVERY:?} and {MAX_POLL_EVERY:?}, got {every:?}"
            )));
        }
        self.poll_every = every;
        Ok(self)
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The most holders at once.
    pub fn limit(&self) -> u32 {
        self.inner.limit
    }

    /// The key of slot `i` (`0..limit`), `None` beyond the limit.
    ///
    /// Slot `i`'s key is the first 8 bytes of
    /// `SHA-256("pgelect-semaphore:" || i || ":" || name)` read as a
    /// big-endian signed integer (`i` in decimal), so in SQL:
    /// `('x' || encode(substr(sha256(convert_to('pgelect-semaphore:' || i || ':' || name, 'UTF8')), 1, 8), 'hex'))::bit(64)::bigint`.
    /// Other clients that take a permit by hand must also respect the gate
    /// (same formula with `'pgelect-semaphore:gate:' || name`), or they
    /// overtake waiters.
    pub fn slot_key(&self, i: u32) -> Option<LockKey> {
        self.inner.slots.get(i as usize).copied()
    }

    /// The key waiters queue on.
    pub fn gate_key(&self) -> LockKey {
        self.inner.gate
    }

    /// The key every user holds in shared mode while it holds or waits for
    /// a permit: `(h, limit)` in the two-integer key space, `h` being the
    /// high 32 bits of the hash of `"pgelect-semaphore:limit:" || name`.
    pub fn limit_key(&self) -> LockKey {
        self.inner.limit_key
    }

    /// The `LISTEN` channel on which a release wakes the longest waiter.
    pub fn channel(&self) -> &str {
        &self.inner.channel
    }

    /// How the semaphore is named in messages.
    fn describe(&self) -> String {
        describe_keys(&self.inner)
    }

    /// The slot keys with their indexes, as two SQL array literals; leaves
    /// out the slots `skip` says this session holds already.
    fn slot_arrays(&self, skip: impl Fn(LockKey) -> bool) -> (String, String) {
        let mut keys = Vec::new();
        let mut indexes = Vec::new();
        for (i, k) in self.inner.slots.iter().enumerate() {
            if let LockKey::Single(v) = k {
                if !skip(*k) {
                    keys.push(v.to_string());
                    indexes.push(i.to_string());
                }
            }
        }
        (
            format!("ARRAY[{}]::int8[]", keys.join(",")),
            format!("ARRAY[{}]::int4[]", indexes.join(",")),
        )
    }
}

fn describe_keys(k: &Keys) -> String {
    format!("semaphore {:?} (limit {})", k.name, k.limit)
}

/// What the first statement of an acquisition found.
enum Entered {
    /// A slot, with the limit key.
    Permit(Permit),
    /// The gate was free but no slot: this session is the head waiter.
    Head { gate: LockGuard, limit: LockGuard },
    /// Others wait: queue on the gate.
    Queue { limit: LockGuard },
    /// `try`: no slot free, or others wait. Nothing is held.
    Busy,
}

impl LockSession {
    /// The sessions that hold permits of `semaphore`, by slot (this
    /// session's own included). Runs on this session's connection, so it
    /// queues behind a wait in progress. See also
    /// [`admin::semaphore_holders`](crate::admin::semaphore_holders).
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn permit_holders(&self, semaphore: &Semaphore) -> Result<Vec<PermitHolder>> {
        let turn = self
            .take_connection("find the holders of a semaphore")
            .await?;
        let read = query_permit_holders(turn.client(), semaphore);
        match tokio::time::timeout(turn.statement_timeout(), read).await {
            Ok(r) => r.map_err(|e| Error::db("find the holders of a semaphore", "\0", e)),
            Err(_) => Err(Error::connection_lost(
                "find the holders of a semaphore (no answer in time)",
            )),
        }
    }

    /// Takes a permit of `semaphore`, waiting as `wait` says:
    /// `Ok(Some(permit))` when granted; `Ok(None)` only with
    /// [`Wait::Never`], when all permits are held or other sessions wait
    /// for one (they come first: a try does not overtake them);
    /// [`Error::LockTimeout`] (`is_timeout()`) when a [`Wait::AtMost`] wait
    /// ran out, naming the semaphore and the sessions that hold its
    /// permits. [`Error::Config`] when the semaphore is in use with another
    /// limit, or for a zero bound (see [`Wait::AtMost`]).
    ///
    /// Waiters are served in the order they arrived (PostgreSQL's queue on
    /// the semaphore's gate key) within a
    /// [`wait_slice`](crate::lock::LockSessionBuilder::wait_slice) of the
    /// session (10 s): the gate wait is re-issued every slice so that it
    /// does not hold back VACUUM, and a re-issued wait queues again behind
    /// those that arrived meanwhile. The longest waiter, once at the head,
    /// keeps its place until it has a permit. A free permit with nobody
    /// waiting costs one round trip.
    ///
    /// Permit acquisitions on one session run one after another (a second
    /// waits for the first to end); use a session per concurrent waiter.
    ///
    /// # Cancel safety
    /// Cancel safe: if the future is dropped, the wait is withdrawn on the
    /// server (and a permit granted meanwhile released) before the
    /// session's next statement.
    ///
    /// ```no_run
    /// # async fn f(session: pgelect::LockSession) -> Result<(), pgelect::Error> {
    /// use std::time::Duration;
    /// use pgelect::lock::Wait;
    /// let uploads = pgelect::lock::Semaphore::new("s3-uploads", 4)?;
    /// match session.acquire_permit(&uploads, Wait::Never).await? {
    ///     Some(permit) => {
    ///         tokio::select! {
    ///             _ = permit.lost() => eprintln!("permit lost, stopping"),
    ///             _ = async { /* upload */ } => {}
    ///         }
    ///         permit.release().await?;
    ///     }
    ///     None => eprintln!("4 uploads already running, or others waiting"),
    /// }
    ///
    /// let jobs = pgelect::lock::Semaphore::new("nightly-jobs", 3)?;
    /// match session.acquire_permit(&jobs, Wait::AtMost(Duration::from_secs(30))).await {
    ///     Ok(Some(permit)) => {
    ///         let work = permit.token(); // hand it to the work: cancelled on loss
    ///         # drop(work);
    ///         permit.release().await?;
    ///     }
    ///     Ok(None) => unreachable!("only Wait::Never answers None"),
    ///     Err(e) if e.is_timeout() => eprintln!("{e}"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn acquire_permit(
        &self,
        semaphore: &Semaphore,
        wait: Wait,
    ) -> Result<Option<Permit>> {
        let started = Instant::now();
        let deadline = match wait {
            Wait::AtMost(t) => {
                wait_millis(t)?;
                Some(started + t)
            }
            _ => None,
        };
        let _one = self.permit_turn().await;
        // Subscribed before the LISTEN, so that no release is missed.
        let mut notices = self.notices();
        let (mut gate, mut limit) = match self.enter(semaphore, wait).await? {
            Entered::Permit(p) => return Ok(Some(p)),
            Entered::Busy => return Ok(None),
            Entered::Head { gate, limit } => (gate, limit),
            Entered::Queue { limit } => {
                let gate = match deadline {
                    None => self.gate(semaphore, Wait::Forever).await,
                    Some(d) => match d.checked_duration_since(Instant::now()) {
                        Some(left) if !left.is_zero() => {
                            self.gate(semaphore, Wait::AtMost(left)).await
                        }
                        _ => Err(timed_out(started)),
                    },
                };
                match gate {
                    Ok(gate) => (gate, limit),
                    Err(e) => {
                        self.give_up(semaphore, None, limit).await;
                        return Err(self.timeout_or(semaphore, started, e).await);
                    }
                }
            }
        };
        tracing::debug!(semaphore = %semaphore.name(), "head of the semaphore's queue; looking for a free slot");
        loop {
            // A look comes first: a slot may have freed while this session
            // queued for the gate, and nobody else looks while it holds it.
            match self.look(semaphore, gate, limit).await? {
                Looked::Permit(p) => return Ok(Some(p)),
                Looked::Nothing { gate: g, limit: l } => {
                    gate = g;
                    limit = l;
                }
            }
            let until_deadline = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(semaphore.poll_every) => {}
                _ = wake(&mut notices, semaphore.channel()) => {}
                // The next look reports the loss.
                _ = self.lost() => {}
                _ = until_deadline => {
                    self.give_up(semaphore, Some(gate), limit).await;
                    return Err(self.timeout_or(semaphore, started, timed_out(started)).await);
                }
            }
        }
    }

    /// Queues on the gate of `semaphore` (`wait` is never [`Wait::Never`]).
    async fn gate(&self, semaphore: &Semaphore, wait: Wait) -> Result<LockGuard> {
        let gate = self
            .acquire(semaphore.gate_key(), LockMode::Exclusive, wait)
            .await?;
        Ok(gate.expect("BUG: a wait for the gate returns a guard or an error"))
    }

    /// The first statement: takes the limit key, checks the limit, and
    /// takes the gate and a slot if it can.
    async fn enter(&self, semaphore: &Semaphore, wait: Wait) -> Result<Entered> {
        let session = self.clone();
        let semaphore = semaphore.clone();
        spawn_step(async move {
            let operation = "take a semaphore permit";
            let (turn, outcome) = run_step(&session, &semaphore, operation, |turn| {
                enter_sql(&semaphore, wait, |k| turn.is_held(k))
            })
            .await?;
            let limit = || turn.guard_taken_lock(semaphore.limit_key(), LockMode::Shared, false);
            let mut words = outcome.split(' ');
            match (words.next(), words.next(), words.next()) {
                (Some("slot"), Some(i), None) => {
                    let slot = parse_slot(&semaphore, i)?;
                    let key = semaphore.inner.slots[slot as usize];
                    let guards = (
                        turn.guard_taken_lock(key, LockMode::Exclusive, true),
                        limit(),
                    );
                    Ok(Entered::Permit(Permit::new(
                        &session, &semaphore, slot, guards,
                    )))
                }
                (Some("head"), None, None) => Ok(Entered::Head {
                    gate: turn.guard_taken_lock(semaphore.gate_key(), LockMode::Exclusive, true),
                    limit: limit(),
                }),
                (Some("queue"), None, None) => Ok(Entered::Queue { limit: limit() }),
                (Some("busy"), None, None) => Ok(Entered::Busy),
                (Some("limit"), Some(n), Some(pid)) => Err(Error::config(format!(
                    "{} is in use with limit {n} (by backend pid {pid}, and maybe others); \
                     every user of a semaphore must give the same limit",
                    semaphore.describe()
                ))),
                (Some("limit-key-taken"), None, None) => Err(Error::config(format!(
                    "the limit key {} of {} is held (or waited for) exclusively by another \
                     session: advisory keys are database-wide, and that session is not a \
                     pgelect semaphore user; see `pgelect status` or pg_locks",
                    semaphore.limit_key(),
                    semaphore.describe()
                ))),
                _ => Err(unexpected(operation, &outcome)),
            }
        })
        .await
    }

    /// As the head waiter (holding the gate): looks for a free slot, and
    /// with one lets go of the gate in the same statement.
    async fn look(
        &self,
        semaphore: &Semaphore,
        gate: LockGuard,
        limit: LockGuard,
    ) -> Result<Looked> {
        let session = self.clone();
        let semaphore = semaphore.clone();
        spawn_step(async move {
            let operation = "look for a free semaphore slot";
            let (turn, outcome) = run_step(&session, &semaphore, operation, |turn| {
                look_sql(&semaphore, |k| turn.is_held(k))
            })
            .await?;
            let mut words = outcome.split(' ');
            match (words.next(), words.next(), words.next()) {
                (Some("slot"), Some(i), None) => {
                    let slot = parse_slot(&semaphore, i)?;
                    let key = semaphore.inner.slots[slot as usize];
                    let guards = (turn.guard_taken_lock(key, LockMode::Exclusive, true), limit);
                    gate.mark_released();
                    Ok(Looked::Permit(Permit::new(
                        &session, &semaphore, slot, guards,
                    )))
                }
                (Some("none"), None, None) => Ok(Looked::Nothing { gate, limit }),
                _ => Err(unexpected(operation, &outcome)),
            }
        })
        .await
    }

    /// Releases the gate (if held) and the limit key of a wait that ends
    /// without a permit.
    async fn give_up(&self, semaphore: &Semaphore, gate: Option<LockGuard>, limit: LockGuard) {
        let gate_sql = if gate.is_some() {
            format!(
                "pg_advisory_unlock({}), ",
                key_literals(&semaphore.gate_key())
            )
        } else {
            String::new()
        };
        let sql = format!(
            "SELECT {gate_sql}pg_advisory_unlock_shared({})",
            key_literals(&semaphore.limit_key())
        );
        let done = async {
            let turn = self.take_connection("leave a semaphore's queue").await?;
            turn.simple_query("leave a semaphore's queue", &sql).await
        };
        match done.await {
            Ok(_) => {
                if let Some(g) = gate {
                    g.mark_released();
                }
                limit.mark_released();
            }
            // The guards' drop fallback tries again.
            Err(e) => {
                tracing::debug!(semaphore = %semaphore.name(), error = %e, "leaving a semaphore's queue failed")
            }
        }
    }

    /// The error of a wait that ended without a permit: a timeout names
    /// the semaphore and who holds its permits.
    async fn timeout_or(&self, semaphore: &Semaphore, started: Instant, e: Error) -> Error {
        if !matches!(e, Error::LockTimeout { .. }) {
            return e;
        }
        let holders = match self.permit_holders(semaphore).await {
            Ok(h) => h.into_iter().map(|p| p.holder).collect(),
            Err(e) => {
                tracing::debug!(error = %e, "could not look up the holders of a semaphore");
                Vec::new()
            }
        };
        Error::LockTimeout {
            key: semaphore.describe(),
            waited: started.elapsed(),
            holders,
        }
    }
}

fn timed_out(started: Instant) -> Error {
    Error::LockTimeout {
        key: String::new(),
        waited: started.elapsed(),
        holders: Vec::new(),
    }
}

/// What a look found.
enum Looked {
    /// A slot (the gate is released).
    Permit(Permit),
    /// No free slot: the guards back.
    Nothing { gate: LockGuard, limit: LockGuard },
}

/// Runs a step in a task of its own, so that it completes whatever becomes
/// of the caller's future: a permit it took is then dropped with the task's
/// output, and released by its drop fallback.
async fn spawn_step<T: Send + 'static>(
    step: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    match tokio::spawn(step).await {
        Ok(out) => out,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(Error::connection_lost(
            "take a semaphore permit (the runtime is shutting down)",
        )),
    }
}

/// Runs the SQL that `sql` builds in a turn of the session and returns the
/// outcome its `DO` block reported.
///
/// A statement that takes locks can fail halfway (a late cancel request of
/// an earlier abandoned wait of this session, whose locks taken inside the
/// aborted transaction stay held): then the gate and slots this session
/// holds without a guard are released, and a cancelled statement runs once
/// more. (An extra hold of the shared limit key may stay until the session
/// ends; it only shows this session's own limit.)
async fn run_step(
    session: &LockSession,
    semaphore: &Semaphore,
    operation: &'static str,
    sql: impl Fn(&Turn) -> String,
) -> Result<(Turn, String)> {
    let mut retried = false;
    loop {
        let turn = session.take_connection(operation).await?;
        match turn.simple_query(operation, &sql(&turn)).await {
            Ok(messages) => {
                let outcome = messages.iter().find_map(|m| match m {
                    SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                    _ => None,
                });
                return Ok((turn, outcome.unwrap_or_default()));
            }
            Err(e) if e.is_connection() => return Err(e),
            Err(e) => {
                let cleanup = cleanup_sql(semaphore, |k| turn.is_held(k));
                if let Err(c) = turn
                    .simple_query("release unguarded semaphore keys", &cleanup)
                    .await
                {
                    tracing::warn!(semaphore = %semaphore.name(), error = %c, "could not release semaphore keys after a failed statement; they stay held until the session ends");
                }
                if e.sqlstate() == Some("57014") && !retried {
                    tracing::debug!(
                        operation,
                        "a late cancel request hit a semaphore statement; running it again"
                    );
                    retried = true;
                    continue;
                }
                return Err(e);
            }
        }
    }
}

fn parse_slot(semaphore: &Semaphore, text: &str) -> Result<u32> {
    text.parse::<u32>()
        .ok()
        .filter(|i| *i < semaphore.limit())
        .ok_or_else(|| unexpected("take a semaphore permit", text))
}

fn unexpected(operation: &str, outcome: &str) -> Error {
    Error::config(format!(
        "{operation}: unexpected answer {outcome:?} from the server (a bug in pgelect, or a server setting pgelect.permit)"
    ))
}

/// The PL/pgSQL loop that tries the free slots (`slots`, their indexes in
/// `idx`) in order while holding the gate key: the first slot taken lets
/// go of the gate and is the outcome (`slot N`); the block returns then.
fn try_slots_sql(gate: &str) -> String {
    format!(
        "  FOR i IN 1 .. coalesce(array_length(slots, 1), 0) LOOP
    IF pg_try_advisory_lock(slots[i]) THEN
      PERFORM pg_advisory_unlock({gate});
      PERFORM set_config('{OUTCOME}', 'slot ' || idx[i], true);
      RETURN;
    END IF;
  END LOOP;
"
    )
}

fn enter_sql(semaphore: &Semaphore, wait: Wait, held: impl Fn(LockKey) -> bool) -> String {
    let (keys, indexes) = semaphore.slot_arrays(held);
    let (classid, objid, _) = semaphore.limit_key().pg_locks_ids();
    let limit = key_literals(&semaphore.limit_key());
    let gate = key_literals(&semaphore.gate_key());
    let try_slots = try_slots_sql(&gate);
    let (listen, no_gate, no_slot) = if wait == Wait::Never {
        (
            String::new(),
            format!("PERFORM pg_advisory_unlock_shared({limit}); PERFORM set_config('{OUTCOME}', 'busy', true);"),
            format!("PERFORM pg_advisory_unlock({gate}); PERFORM pg_advisory_unlock_shared({limit}); PERFORM set_config('{OUTCOME}', 'busy', true);"),
        )
    } else {
        (
            format!("LISTEN \"{}\";\n", semaphore.channel()),
            format!("PERFORM set_config('{OUTCOME}', 'queue', true);"),
            format!("PERFORM set_config('{OUTCOME}', 'head', true);"),
        )
    };
    format!(
        "{listen}DO $pgelect$
DECLARE
  slots int8[] := {keys};
  idx int4[] := {indexes};
  other record;
BEGIN
  IF NOT pg_try_advisory_lock_shared({limit}) THEN
    PERFORM set_config('{OUTCOME}', 'limit-key-taken', true);
    RETURN;
  END IF;
  SELECT l.objid::int8 AS n, l.pid INTO other FROM pg_locks l
   WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.classid = '{classid}'::oid
     AND l.objid <> '{objid}'::oid AND l.granted AND l.pid <> pg_backend_pid()
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   LIMIT 1;
  IF FOUND THEN
    PERFORM pg_advisory_unlock_shared({limit});
    PERFORM set_config('{OUTCOME}', 'limit ' || other.n || ' ' || other.pid, true);
    RETURN;
  END IF;
  IF NOT pg_try_advisory_lock({gate}) THEN
    {no_gate}
    RETURN;
  END IF;
{try_slots}  {no_slot}
END $pgelect$;
SELECT current_setting('{OUTCOME}', true)"
    )
}

fn look_sql(semaphore: &Semaphore, held: impl Fn(LockKey) -> bool) -> String {
    let (keys, indexes) = semaphore.slot_arrays(held);
    let try_slots = try_slots_sql(&key_literals(&semaphore.gate_key()));
    format!(
        "DO $pgelect$
DECLARE
  slots int8[] := {keys};
  idx int4[] := {indexes};
BEGIN
{try_slots}  PERFORM set_config('{OUTCOME}', 'none', true);
END $pgelect$;
SELECT current_setting('{OUTCOME}', true)"
    )
}

/// Releases, completely, the gate and slots this backend holds without a
/// guard (`held` says which keys have one).
fn cleanup_sql(semaphore: &Semaphore, held: impl Fn(LockKey) -> bool) -> String {
    let mut keys: Vec<String> = Vec::new();
    for k in std::iter::once(&semaphore.inner.gate).chain(semaphore.inner.slots.iter()) {
        if let LockKey::Single(v) = k {
            if !held(*k) {
                keys.push(v.to_string());
            }
        }
    }
    format!(
        "DO $pgelect$
DECLARE k int8;
BEGIN
  FOR k IN SELECT (l.classid::int8 << 32) | l.objid::int8 FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
              AND l.pid = pg_backend_pid() AND l.mode = 'ExclusiveLock'
              AND ((l.classid::int8 << 32) | l.objid::int8) = ANY(ARRAY[{}]::int8[]) LOOP
    WHILE pg_advisory_unlock(k) LOOP END LOOP;
  END LOOP;
END $pgelect$",
        keys.join(",")
    )
}

/// Resolves on a notification on `channel` (or when some were missed).
async fn wake(notices: &mut tokio::sync::broadcast::Receiver<crate::conn::Notice>, channel: &str) {
    loop {
        match notices.recv().await {
            Ok(n) if n.channel == channel => return,
            Ok(_) => {}
            Err(RecvError::Lagged(_)) => return,
            Err(RecvError::Closed) => std::future::pending().await,
        }
    }
}

impl Permit {
    fn new(
        session: &LockSession,
        semaphore: &Semaphore,
        slot: u32,
        guards: (LockGuard, LockGuard),
    ) -> Permit {
        Permit {
            session: session.clone(),
            semaphore: semaphore.inner.clone(),
            slot,
            guards: Some(guards),
        }
    }

    /// The semaphore's name.
    pub fn semaphore(&self) -> &str {
        &self.semaphore.name
    }

    /// The slot held, `0..limit`: useful as a worker index (the slots held
    /// at one time are distinct).
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The slot's advisory key.
    pub fn key(&self) -> LockKey {
        self.semaphore.slots[self.slot as usize]
    }

    /// The process id of the server backend holding the permit.
    pub fn backend_pid(&self) -> i32 {
        self.session.backend_pid()
    }

    crate::loss::connection_loss_methods! {
        self => self.session;
        ended: "the connection holding the permit",
        after: ": from then on the slot is free for another holder. Stop the work.",
        loss: "Why and when the permit was lost; `None` while it is held.",
    }

    /// Releases the permit, and wakes the longest waiter with a `NOTIFY`.
    /// `true` when PostgreSQL held the slot and released it, `false` when it
    /// did not hold it (released behind pgelect's back, e.g. with
    /// `pg_advisory_unlock_all()`).
    ///
    /// Fails with [`Error::ConnectionLost`] when the connection is gone; the
    /// server released the slot with it.
    ///
    /// # Cancel safety
    /// Cancel safe: the release runs in a task of its own and completes if
    /// the future is dropped.
    pub async fn release(mut self) -> Result<bool> {
        let guards = self.guards.take().expect("BUG: a permit is released once");
        let session = self.session.clone();
        let keys = self.semaphore.clone();
        let slot = self.slot;
        spawn_step(release(session, keys, slot, guards)).await
    }
}

async fn release(
    session: LockSession,
    keys: Arc<Keys>,
    slot: u32,
    (slot_guard, limit_guard): (LockGuard, LockGuard),
) -> Result<bool> {
    const OPERATION: &str = "release a semaphore permit";
    let turn = match session.take_connection(OPERATION).await {
        Ok(turn) => turn,
        Err(e) => {
            if e.is_connection() {
                slot_guard.mark_released();
                limit_guard.mark_released();
            }
            return Err(e);
        }
    };
    let sql = format!(
        "SELECT pg_advisory_unlock({}), pg_advisory_unlock_shared({}), pg_notify('{}', '')",
        key_literals(&keys.slots[slot as usize]),
        key_literals(&limit_guard.key()),
        keys.channel
    );
    match turn.simple_query(OPERATION, &sql).await {
        Ok(messages) => {
            drop(turn);
            slot_guard.mark_released();
            limit_guard.mark_released();
            let released = messages.iter().find_map(|m| match m {
                SimpleQueryMessage::Row(r) => r.get(0).map(|v| v == "t"),
                _ => None,
            });
            Ok(released.unwrap_or(false))
        }
        Err(e) if e.is_connection() => {
            drop(turn);
            slot_guard.mark_released();
            limit_guard.mark_released();
            Err(e)
        }
        // The guards' drop fallback tries once more (without a NOTIFY).
        Err(e) => Err(e),
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(guards) = self.guards.take() else {
            return;
        };
        if self.session.is_lost() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let (session, keys, slot) =
                    (self.session.clone(), self.semaphore.clone(), self.slot);
                runtime.spawn(async move {
                    if let Err(e) = release(session, keys.clone(), slot, guards).await {
                        tracing::warn!(semaphore = %keys.name, slot, error = %e, "releasing a dropped permit failed");
                    }
                });
            }
            // The guards' own drop queues their release on the session.
            Err(_) => drop(guards),
        }
    }
}

/// The sessions that hold permits of `semaphore`, by slot; the public form
/// is [`admin::semaphore_holders`](crate::admin::semaphore_holders).
pub(crate) async fn semaphore_holders<C: GenericClient + Sync>(
    client: &C,
    semaphore: &Semaphore,
) -> Result<Vec<PermitHolder>> {
    query_permit_holders(client, semaphore)
        .await
        .map_err(|e| Error::db("find the holders of a semaphore", "\0", e))
}

async fn query_permit_holders<C: GenericClient + Sync>(
    client: &C,
    semaphore: &Semaphore,
) -> std::result::Result<Vec<PermitHolder>, tokio_postgres::Error> {
    let keys: Vec<i64> = semaphore
        .inner
        .slots
        .iter()
        .filter_map(|k| match k {
            LockKey::Single(v) => Some(*v),
            LockKey::Pair(..) => None,
        })
        .collect();
    let rows = client
        .query_typed(
            "SELECT s.i::int8 - 1, l.pid, a.usename::text, coalesce(a.application_name, ''),
                    host(a.client_addr), l.mode,
                    extract(epoch FROM now() - a.state_change)::float8
               FROM unnest($1::int8[]) WITH ORDINALITY AS s(k, i)
               JOIN pg_locks l
                 ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
                AND ((l.classid::int8 << 32) | l.objid::int8) = s.k
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               LEFT JOIN pg_stat_activity a ON a.pid = l.pid
              ORDER BY s.i, l.pid",
            &[(&keys, Type::INT8_ARRAY)],
        )
        .await?;
    rows.iter()
        .map(|r| {
            let slot: i64 = r.try_get(0)?;
            Ok(PermitHolder {
                slot: slot as u32,
                holder: LockHolder {
                    pid: r.try_get(1)?,
                    user: r.try_get(2)?,
                    application_name: r.try_get(3)?,
                    client_addr: r.try_get(4)?,
                    mode: if r.try_get::<_, &str>(5)? == "ShareLock" {
                        LockMode::Shared
                    } else {
                        LockMode::Exclusive
                    },
                    state_age: r
                        .try_get::<_, Option<f64>>(6)?
                        .filter(|s| s.is_finite() && *s >= 0.0)
                        .map(Duration::from_secs_f64),
                },
            })
        })
        .collect()
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.inner.name)
            .field("limit", &self.inner.limit)
            .field("gate", &self.inner.gate)
            .field("limit_key", &self.inner.limit_key)
            .field("poll_every", &self.poll_every)
            .finish()
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("semaphore", &self.semaphore.name)
            .field("slot", &self.slot)
            .field("backend_pid", &self.session.backend_pid())
            .field("released", &self.guards.is_none())
            .field("lost", &self.session.is_lost())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_stable_and_independent_of_the_limit() {
        let a = Semaphore::new("jobs", 3).unwrap();
        let b = Semaphore::new("jobs", 5).unwrap();
        let mut seen = std::collections::HashSet::new();
        for i in 0..3 {
            assert_eq!(a.slot_key(i), b.slot_key(i));
            assert!(seen.insert(a.slot_key(i).unwrap()));
        }
        assert!(seen.insert(a.gate_key()));
        assert!(!seen.contains(&LockKey::from_name("jobs").unwrap()));
        assert_ne!(a.limit_key(), b.limit_key());
        let (ca, _, _) = a.limit_key().pg_locks_ids();
        let (cb, nb, sub) = b.limit_key().pg_locks_ids();
        assert_eq!((ca, nb, sub), (cb, 5, 2), "same family, the limit readable");
        // Pinned: `printf 'pgelect-semaphore:0:jobs' | sha256sum`, first 8 bytes.
        use sha2::{Digest, Sha256};
        let d = Sha256::digest(b"pgelect-semaphore:0:jobs");
        let want = i64::from_be_bytes(d[..8].try_into().unwrap());
        assert_eq!(a.slot_key(0), Some(LockKey::Single(want)));
        assert!(a.channel().len() <= 63 && a.channel().starts_with("pgelect_semaphore_"));
    }

    #[test]
    fn bad_limits_names_and_polls_are_refused() {
        let e = Semaphore::new("x", 0).unwrap_err();
        assert!(
            e.is_config() && e.to_string().contains("between 1 and 1024"),
            "{e}"
        );
        assert!(Semaphore::new("x", MAX_SEMAPHORE_LIMIT).is_ok());
        assert!(Semaphore::new("x", MAX_SEMAPHORE_LIMIT + 1).is_err());
        let e = Semaphore::new("a\0b", 2).unwrap_err();
        assert!(e.to_string().contains("semaphore name"), "{e}");
        let s = Semaphore::new("x", 1).unwrap();
        assert!(s.clone().poll_every(Duration::ZERO).is_err());
        assert!(s.clone().poll_every(Duration::from_secs(61)).is_err());
        assert_eq!(
            s.poll_every(Duration::from_millis(50)).unwrap().poll_every,
            Duration::from_millis(50)
        );
    }

    #[test]
    fn statements_skip_held_slots_and_try_does_not_queue() {
        let s = Semaphore::new("x", 3).unwrap();
        let held = s.slot_key(1).unwrap();
        let sql = enter_sql(&s, Wait::Never, |k| k == held);
        assert!(!sql.contains("LISTEN"), "{sql}");
        assert!(sql.contains("ARRAY[0,2]::int4[]"), "{sql}");
        assert!(!sql.contains("'queue'") && !sql.contains("'head'"), "{sql}");
        let sql = enter_sql(&s, Wait::Forever, |_| false);
        assert!(sql.starts_with("LISTEN \"pgelect_semaphore_"), "{sql}");
        assert!(sql.contains("ARRAY[0,1,2]::int4[]"), "{sql}");
        let all = look_sql(&s, |_| true);
        assert!(all.contains("ARRAY[]::int8[]"), "{all}");
    }
}
