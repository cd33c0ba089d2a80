//! The deadline watchdog: one thread per process that ends every
//! leadership at its local deadline, whatever state the async runtime is in.
//!
//! A leadership's keeper is a task. When its worker is held by a long poll
//! (CPU-bound work in the application, a slow step in a debug build) the
//! keeper cannot run, and neither can its deadline timer; nor can any other
//! task's timer, because tokio's timers are fired by a worker that parks,
//! and a worker that is held does not park. A standby may take over once
//! the lease expires on the server, so a leader that learns of its deadline
//! late may act after a newer leader began. This thread does not depend on
//! the runtime: it sleeps until the earliest published deadline, follows
//! deadlines as renewals move them, and ends a leadership whose deadline
//! passed ([`LeaderState::expire_if_due`]), which cancels its token and
//! wakes whoever waits in `lost()`. The keeper, once it runs again, finds
//! the leadership ended and lets go of the lock.
//!
//! The thread reads the real monotonic clock. Deadlines taken under tokio's
//! paused test clock (`start_paused`) are instants of that clock, which
//! runs ahead of real time when it auto-advances and stops when it does
//! not: the library's own paused-clock tests of the keep loop run it
//! without the watchdog.
//!
//! Entries are weak: a leadership that ended or was dropped leaves its
//! entry to be discarded at its deadline. The thread costs one wake per
//! leadership per deadline budget (about every 12 s per role at the
//! default timing), and starts with the first campaign ([`ready`]), not
//! the first leadership: starting a thread (about 0.1-0.3 ms, with its
//! memory arena) is no work for the moment a standby is elected.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, Weak};
use std::time::Instant;

use super::leadership::LeaderState;

/// A leadership to look at, at `at`.
struct Entry {
    at: Instant,
    state: Weak<LeaderState>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    /// Reversed: the heap's top is the earliest entry.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.cmp(&self.at)
    }
}

struct Watchdog {
    queue: Mutex<BinaryHeap<Entry>>,
    changed: Condvar,
}

static WATCHDOG: OnceLock<Option<Arc<Watchdog>>> = OnceLock::new();

/// Watches `state` until it ends: from now on it is ended at its local
/// deadline even if its keeper task is late. Call it when the user is told
/// of the leadership. If the thread cannot be started (the process is out
/// of threads), the keeper alone watches the deadline, as it always does,
/// and the failure is logged once.
pub(crate) fn watch(state: &Arc<LeaderState>) {
    let Some(w) = WATCHDOG.get_or_init(start) else {
        return;
    };
    let at = state.deadline().into_std();
    let mut q = w.queue.lock().unwrap_or_else(PoisonError::into_inner);
    let earliest = q.peek().is_none_or(|e| at < e.at);
    q.push(Entry {
        at,
        state: Arc::downgrade(state),
    });
    drop(q);
    if earliest {
        w.changed.notify_one();
    }
}

/// Starts the thread now if it is not running, so that the first
/// [`watch`] finds it: called when a candidate starts campaigning.
pub(crate) fn ready() {
    WATCHDOG.get_or_init(start);
}

fn start() -> Option<Arc<Watchdog>> {
    let w = Arc::new(Watchdog {
        queue: Mutex::new(BinaryHeap::new()),
        changed: Condvar::new(),
    });
    let run = w.clone();
    match std::thread::Builder::new()
        .name("pgelect-watchdog".into())
        .spawn(move || run.run())
    {
        Ok(_) => Some(w),
        Err(e) => {
            tracing::error!(error = %e, "cannot start the deadline watchdog thread; leaderships' deadlines are watched by their keeper tasks alone");
            None
        }
    }
}

impl Watchdog {
    fn run(&self) {
        let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let now = Instant::now();
            let Some(next) = q.peek().map(|e| e.at) else {
                q = self.changed.wait(q).unwrap_or_else(PoisonError::into_inner);
                continue;
            };
            if next > now {
                q = self
                    .changed
                    .wait_timeout(q, next - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            }
            let entry = q.pop().expect("BUG: peeked above");
            let Some(state) = entry.state.upgrade() else {
                continue;
            };
            if state.token().is_cancelled() {
                continue;
            }
            let at = state.deadline().into_std();
            if at > now {
                // Renewed meanwhile: look again at the new deadline.
                q.push(Entry {
                    at,
                    state: entry.state,
                });
                continue;
            }
            // Ending it logs and wakes tasks: not under the queue's lock.
            drop(q);
            state.expire_if_due("watchdog");
            drop(state);
            q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        }
    }
}
