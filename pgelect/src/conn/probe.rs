//! The connection probe: one statement that proves a connection's server
//! session alive (and says whether the server accepts writes), the
//! defaults of everything that probes a connection, and the probe of a
//! connection shared by many users.
//!
//! Every connection that holds something (a leader's lock connection, a
//! shared connection carrying many roles, a [`LockSession`]) is probed the
//! same way: asked at an interval, dropped when the answer does not come
//! within its bound, not asked while another statement is in flight, whose
//! answer counts as one (the elector's keeper, `Keeper::alive_at`; a
//! lock session skips while its statement lock is held). Who asks differs:
//! the elector's keeper decides when its leader asks and enforces the
//! bound; a [`LockSession`] asks from a task of its own; the leaders of a
//! shared connection ask [`Probe`], which sends one statement for all of
//! them.
//!
//! [`LockSession`]: crate::LockSession

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_postgres::{Client, SimpleQueryMessage};

use super::DedicatedConnection;

// The defaults, each defined once. An elector's are chosen to fit its
// TTL's inequalities (see `election/timing.rs`); a lock session has no
// TTL, so it can wait longer for an answer and slices its waits shorter.
// The values are documented behaviour (`ElectorBuilder`,
// `LockSessionBuilder`): they carry distinct names, not one name with two
// values.

/// An elector's heartbeat interval at the default TTL, and the longest the
/// standard profile derives.
pub(crate) const ELECTOR_HEARTBEAT: Duration = Duration::from_secs(1);
/// An elector's heartbeat timeout (the lease backend's statement timeout).
pub(crate) const ELECTOR_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(1);
/// The slice of a blocking standby's lock wait.
pub(crate) const ELECTOR_WAIT_SLICE: Duration = Duration::from_secs(20);
/// The interval between two heartbeats of a lock session.
pub(crate) const LOCK_SESSION_HEARTBEAT: Duration = Duration::from_secs(1);
/// The bound on a lock session's heartbeat answer (and on every short
/// statement of it) before the session is given up.
pub(crate) const LOCK_SESSION_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);
/// The slice of a lock session's unbounded lock wait.
pub(crate) const LOCK_SESSION_WAIT_SLICE: Duration = Duration::from_secs(10);

/// The probe statement. `transaction_read_only` is on in a standby and on
/// a primary fenced with `default_transaction_read_only`: a lock there
/// protects nothing.
const PROBE_SQL: &str = "SHOW transaction_read_only";

/// What a probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probed {
    /// The server answered and accepts writes.
    Alive,
    /// The server answered but accepts no writes.
    ReadOnly,
}

/// Sends the probe statement on `client` and waits for its answer.
pub(crate) async fn ask(client: &Client) -> Result<Probed, tokio_postgres::Error> {
    let msgs = client.simple_query(PROBE_SQL).await?;
    Ok(match read_only(&msgs) {
        true => Probed::ReadOnly,
        false => Probed::Alive,
    })
}

/// Whether the answer to `SHOW transaction_read_only` is `on`.
fn read_only(msgs: &[SimpleQueryMessage]) -> bool {
    msgs.iter().any(|m| match m {
        SimpleQueryMessage::Row(r) => r.get(0) == Some("on"),
        _ => false,
    })
}

/// The probe of a connection shared by many users, and the record of its
/// answers.
///
/// Each user asks at its own pace. A request made at `r` is answered by a
/// probe *sent* at or after `r`, and the send waits a little (`wait`) for
/// other requests to share it. The user's bound still runs from `r`, so it
/// learns of a dead connection no later than with a probe of its own;
/// users answered by one probe ask again together, so after a few rounds
/// one statement serves them all. Every other statement answered on the
/// connection is recorded too ([`Probe::credit`], [`Probe::next_answer`]):
/// proof that the server session lived when it was sent.
pub(crate) struct Probe {
    /// The earliest moment by which a pending request wants its probe
    /// sent; `None` when no request is pending.
    wanted: watch::Sender<Option<Instant>>,
    /// The last probe: when it was sent, and its answer (`None`: failed).
    beats: watch::Sender<Option<(Instant, Option<Probed>)>>,
    /// The send time of the latest statement answered on the connection.
    answered: watch::Sender<Option<Instant>>,
}

impl Default for Probe {
    fn default() -> Self {
        Probe {
            wanted: watch::Sender::new(None),
            beats: watch::Sender::new(None),
            answered: watch::Sender::new(None),
        }
    }
}

impl Probe {
    /// The answer of a probe sent at or after `requested`; `None` when it
    /// failed (or the connection's probe task ended). The probe is sent
    /// within `wait` of `requested`.
    pub(crate) async fn answer(&self, requested: Instant, wait: Duration) -> Option<Probed> {
        let mut beats = self.beats.subscribe();
        let by = requested + wait;
        self.wanted
            .send_modify(|w| *w = Some(w.map_or(by, |x| x.min(by))));
        let answered = beats
            .wait_for(|b| b.is_some_and(|(sent, _)| sent >= requested))
            .await;
        answered.ok().and_then(|b| b.and_then(|(_, p)| p))
    }

    /// A statement sent at `sent` was answered on the connection.
    pub(crate) fn credit(&self, sent: Instant) {
        self.answered.send_if_modified(|a| match a {
            Some(t) if *t >= sent => false,
            _ => {
                *a = Some(sent);
                true
            }
        });
    }

    /// The send time of the latest statement answered on the connection.
    pub(crate) fn last_answer(&self) -> Option<Instant> {
        *self.answered.borrow()
    }

    /// Completes with the send time of the next statement answered on the
    /// connection (sent later than any reported before this call).
    pub(crate) async fn next_answer(&self) -> Instant {
        let mut rx = self.answered.subscribe();
        loop {
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
            if let Some(t) = *rx.borrow_and_update() {
                return t;
            }
        }
    }

    /// The probe task of the connection `parts` gives of `owner`: sends
    /// the probe when the earliest pending request wants it, for every
    /// request pending then; ends with the owner, its connection or at the
    /// first failure.
    pub(crate) async fn serve<S>(
        owner: std::sync::Weak<S>,
        parts: fn(&S) -> (&Probe, &DedicatedConnection),
    ) {
        each_wanted(
            owner,
            move |s| {
                let (probe, conn) = parts(s);
                (&probe.wanted, conn)
            },
            async move |s: Arc<S>| {
                let (probe, conn) = parts(&s);
                probe.wanted.send_replace(None);
                let sent = Instant::now();
                let found = ask(conn.client()).await.ok();
                tracing::debug!(pid = conn.pid(), took = ?sent.elapsed(), "heartbeat");
                if found.is_some() {
                    probe.credit(sent);
                }
                probe.beats.send_replace(Some((sent, found)));
                found.is_some()
            },
        )
        .await;
    }
}

/// What [`each_wanted`] watches of its owner: the earliest deadline
/// wanted, and the connection whose end ends the task.
pub(crate) type Wanted<'s> = (&'s watch::Sender<Option<Instant>>, &'s DedicatedConnection);

/// The loop of a task that sends one owner's statement each time a request
/// wants it: waits until the earliest request's deadline (the `wanted`
/// that `parts` gives, see [`until_wanted`]), then runs `round` with the
/// owner. Ends when the owner is gone, its connection (the other part)
/// closes, or `round` returns false. The probe and a shared session's
/// batched renewals, registrations and elections are such tasks.
pub(crate) async fn each_wanted<S>(
    owner: std::sync::Weak<S>,
    parts: impl for<'s> Fn(&'s S) -> Wanted<'s>,
    mut round: impl AsyncFnMut(Arc<S>) -> bool,
) {
    let (mut wanted, closed) = match owner.upgrade() {
        Some(s) => {
            let (wanted, conn) = parts(&s);
            (wanted.subscribe(), conn.closed().clone())
        }
        None => return,
    };
    loop {
        if !until_wanted(&mut wanted, &closed).await {
            return;
        }
        let Some(s) = owner.upgrade() else {
            return;
        };
        if !round(s).await {
            return;
        }
    }
}

/// Waits until the deadline `wanted` holds (the earliest a pending request
/// wants its statement sent), following it as it changes; false when
/// `closed` is cancelled or the sender is gone.
pub(crate) async fn until_wanted(
    wanted: &mut watch::Receiver<Option<Instant>>,
    closed: &tokio_util::sync::CancellationToken,
) -> bool {
    loop {
        let by = *wanted.borrow_and_update();
        // Wanted now (a session of one's request): at once, not at the
        // timer's next millisecond tick.
        if by.is_some_and(|by| by <= Instant::now()) {
            // (A turn of the task's budget, as the timer would take.)
            tokio::task::consume_budget().await;
            return !closed.is_cancelled();
        }
        let changed = tokio::select! {
            _ = closed.cancelled() => return false,
            r = wanted.changed() => r,
            _ = async {
                match by {
                    Some(by) => tokio::time::sleep_until(by).await,
                    None => std::future::pending().await,
                }
            } => return true,
        };
        if changed.is_err() {
            return false;
        }
    }
}
