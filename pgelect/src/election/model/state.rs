//! The world one state of the check holds: processes and their candidates,
//! the server's backends, locks and rows, the messages in flight, the fault
//! and write budgets, what the properties watch; the [`Step`]s between
//! states; and states compared up to a shift of time.

use std::hash::{Hash, Hasher};
use std::time::Duration;

use super::scenario::{base, Place, Scenario};
use crate::election::keeper::{Keeper, Phase};

/// What a process is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Life {
    Up,
    Paused,
    Crashed,
}

/// A candidate (one role of one process).
#[derive(Clone, Debug)]
pub(super) enum Stage {
    /// Not running (its process crashed).
    Down,
    /// The next attempt goes out at local time `at`.
    Idle { at: u32 },
    /// A lock wait (for the role's lock or its watch key), a try, or a
    /// lease take, sent at local time `sent`.
    Asking { sent: u32 },
    /// The watch between two slices: its read of the row or its
    /// preemption statement, sent at local `sent`.
    Observing { sent: u32 },
    /// The watch, granted the role's lock: its unlock of the watch key,
    /// sent at local `sent` (the election statement follows its answer).
    Unwatching { sent: u32 },
    /// Session: the election statement, sent at local `sent`.
    Electing { sent: u32 },
    /// Elected for `term`.
    Leading {
        keeper: Box<Keeper>,
        term: u32,
        /// Lease: the renewal the driver waits for (local send time).
        renewing: Option<u32>,
    },
}

#[derive(Clone, Debug)]
pub(super) struct Cand {
    pub(super) stage: Stage,
    /// A fenced write of this candidate is in flight.
    pub(super) writing: bool,
    /// Where it waits while it stands (a new attempt starts at the
    /// scenario's first place).
    pub(super) place: Place,
}

#[derive(Clone, Debug)]
pub(super) struct Proc {
    pub(super) life: Life,
    /// A paused process resumes at this time (server clock).
    pub(super) resume_at: u32,
    /// The local monotonic clock, in ticks.
    pub(super) local: u32,
    pub(super) drift_left: u8,
    pub(super) partitioned: bool,
    /// The incarnation of this process's connection (bumped on reconnect).
    pub(super) inc: u8,
    pub(super) cands: Vec<Cand>,
}

/// A server backend: one connection incarnation of a process.
#[derive(Clone, Debug)]
pub(super) struct Backend_ {
    pub(super) proc: u8,
    pub(super) inc: u8,
    /// The last time (server clock) a packet from the client arrived;
    /// meaningful only while the client is partitioned (otherwise its
    /// kernel answers keepalives).
    pub(super) last_rx: u32,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Lock {
    /// The backend holding it.
    pub(super) holder: Option<(u8, u8)>,
    /// When the holder's session last did something on the server (server
    /// clock): the grant (the end of its lock statement), then every
    /// message the server handles on that backend, and the end of any
    /// wait slice it sits out for another role. What `pg_stat_activity.
    /// state_change` shows of an idle session, kept on the lock rather
    /// than on the backend because only the holder's matters; see
    /// [`ElectionModel::preemptable`] and the state's hash for why it
    /// costs few states.
    pub(super) idle_since: u32,
    /// Waiting backends and when their wait slice ends (server clock).
    pub(super) queue: Vec<(u8, u8, u32)>,
}

/// Per role, the server's two advisory locks.
#[derive(Clone, Debug, Default)]
pub(super) struct Locks {
    /// The role's lock.
    pub(super) role: Lock,
    /// The role's watch key: its holder is the watch; its idle clock is
    /// what a queued standby's slice checks before it ends the watch.
    pub(super) watch: Lock,
}

impl Locks {
    pub(super) fn get_mut(&mut self, watch: bool) -> &mut Lock {
        if watch {
            &mut self.watch
        } else {
            &mut self.role
        }
    }
}

#[derive(Clone, Debug, Default)]
pub(super) struct Row {
    pub(super) term: u32,
    /// The holder's process and backend (`holder_pid`).
    pub(super) holder: Option<(u8, u8)>,
    pub(super) lease_until: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Msg {
    // Client to server.
    /// A slice of the wait for the role's lock, `slice` ticks long.
    Lock {
        role: u8,
        slice: u32,
    },
    /// A slice of the wait for the role's watch key (`wait_slice` long),
    /// which, when it times out, ends a watch idle for longer than the
    /// TTL (`queue_slice_sql`).
    WatchLock {
        role: u8,
    },
    WatchUnlock {
        role: u8,
    },
    /// The watch's read of the row (`read_leader_and_mode`).
    Read {
        role: u8,
    },
    /// The watch's `preempt`.
    Preempt {
        role: u8,
    },
    Try {
        role: u8,
    },
    Elect {
        role: u8,
        sent: u32,
    },
    Renew {
        role: u8,
        term: u32,
        sent: u32,
    },
    Heartbeat {
        role: u8,
    },
    Release {
        role: u8,
        term: u32,
    },
    Unlock {
        role: u8,
    },
    Close,
    Take {
        role: u8,
        sent: u32,
    },
    Write {
        role: u8,
        term: u32,
    },
    // Server to client.
    Granted {
        role: u8,
    },
    NotGranted {
        role: u8,
    },
    WatchGranted {
        role: u8,
    },
    WatchNotGranted {
        role: u8,
    },
    WatchUnlocked {
        role: u8,
    },
    /// The row as the read found it: no holder, or an expired lease.
    Row {
        role: u8,
        vacant: bool,
    },
    Preempted {
        role: u8,
    },
    Elected {
        role: u8,
        term: u32,
        unclean: bool,
        sent: u32,
    },
    Busy {
        role: u8,
        sent: u32,
    },
    Renewed {
        role: u8,
        sent: u32,
    },
    NotOurs {
        role: u8,
        sent: u32,
    },
    Alive {
        role: u8,
    },
    Goodbye,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Envelope {
    pub(super) to_server: bool,
    pub(super) proc: u8,
    pub(super) inc: u8,
    /// Writes travel on the user's own connection, not the lock connection.
    pub(super) user_conn: bool,
    pub(super) sent_at: u32,
    pub(super) msg: Msg,
}

/// One state of the whole system.
#[derive(Clone, Debug)]
pub(super) struct State {
    /// The scenario's tick and horizon, for hashing (the same in every
    /// state of a run; stateright hashes states without the model).
    pub(super) tick: Duration,
    pub(super) horizon: u32,
    /// Idle times of an unnamed lock holder at or beyond this many ticks
    /// hash alike (its preemption is due by then).
    pub(super) idle_cap: u32,
    /// Idle times of the watch at or beyond this many ticks hash alike
    /// (a queued standby ends it from then on).
    pub(super) watch_idle_cap: u32,
    /// The server's (reference) clock, in ticks.
    pub(super) now: u32,
    pub(super) procs: Vec<Proc>,
    pub(super) backends: Vec<Backend_>,
    /// Per process: the newest connection incarnation whose backend
    /// started (an ended backend never comes back).
    pub(super) started: Vec<Option<u8>>,
    pub(super) locks: Vec<Locks>,
    pub(super) rows: Vec<Row>,
    pub(super) net: Vec<Envelope>,
    pub(super) faults_left: u8,
    /// Fenced writes left in this run.
    pub(super) writes_left: u8,
    /// Per role: ticks without an acting leader while a healthy candidate
    /// stood, since the last fault.
    pub(super) unled: Vec<u32>,
    /// Per role: the term of the last activation.
    pub(super) last_active: Vec<u32>,
    /// Per role: the highest term of a committed write.
    pub(super) committed: Vec<u32>,
    /// Something happened that breaks (b) or (c); the first one is kept.
    pub(super) broken: Option<String>,
    /// Examples, for the non-vacuity checks.
    pub(super) seen_unclean_takeover: bool,
    pub(super) seen_fence_refusal: bool,
    pub(super) seen_write: bool,
    pub(super) seen_idle_preempt: bool,
    pub(super) seen_watch_handoff: bool,
    pub(super) seen_watch_end: bool,
}

/// What can happen next.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Step {
    /// Time advances one tick; each process's clock by `1 + skew`.
    Tick {
        skew: Vec<i8>,
    },
    /// A message arrives; `goodbye: false` only for a watch's
    /// preemption statement that ends a backend whose goodbye is lost.
    Deliver {
        index: usize,
        goodbye: bool,
    },
    Crash {
        proc: u8,
    },
    Restart {
        proc: u8,
    },
    Pause {
        proc: u8,
        ticks: u32,
    },
    Resume {
        proc: u8,
        write_first: bool,
    },
    Terminate {
        proc: u8,
        goodbye: bool,
    },
    Partition {
        proc: u8,
    },
    Heal {
        proc: u8,
    },
    Resign {
        proc: u8,
        role: u8,
    },
    Write {
        proc: u8,
        role: u8,
    },
    Preempt {
        role: u8,
        goodbye: bool,
    },
}

/// The model: a scenario's system.
pub(super) struct ElectionModel {
    pub(super) s: Scenario,
}

impl State {
    pub(super) fn acting(&self, role: usize) -> Vec<usize> {
        (0..self.procs.len())
            .filter(|&p| {
                self.procs[p].life == Life::Up
                    && matches!(&self.procs[p].cands[role].stage, Stage::Leading { keeper, .. } if keeper.phase() == Phase::Active)
            })
            .collect()
    }

    pub(super) fn backend_alive(&self, proc: u8, inc: u8) -> bool {
        self.backends.iter().any(|b| b.proc == proc && b.inc == inc)
    }
}

impl Hash for State {
    /// Up to a shift of time: every instant relative to the current one
    /// (server instants to the server clock, a process's to its own),
    /// those older than the model's horizon clamped; incarnations relative
    /// to each process's current one.
    fn hash<H: Hasher>(&self, h: &mut H) {
        let cap = self.horizon;
        let rel = |t: u32, now: u32| -> i64 { (t as i64 - now as i64).max(-(cap as i64)) };
        let now = self.now;
        for pr in &self.procs {
            pr.life.hash(h);
            if pr.life == Life::Paused {
                rel(pr.resume_at, now).hash(h);
            }
            ((pr.local as i64) - (now as i64)).hash(h);
            pr.drift_left.hash(h);
            pr.partitioned.hash(h);
            for c in &pr.cands {
                c.writing.hash(h);
                c.place.hash(h);
                match &c.stage {
                    Stage::Down => 0u8.hash(h),
                    // Due is due.
                    Stage::Idle { at } => (1u8, rel(*at, pr.local).max(0)).hash(h),
                    Stage::Asking { sent } => (2u8, rel(*sent, pr.local)).hash(h),
                    Stage::Electing { sent } => (3u8, rel(*sent, pr.local)).hash(h),
                    Stage::Observing { sent } => (5u8, rel(*sent, pr.local)).hash(h),
                    Stage::Unwatching { sent } => (6u8, rel(*sent, pr.local)).hash(h),
                    Stage::Leading {
                        keeper,
                        term,
                        renewing,
                    } => {
                        (4u8, *term, renewing.map(|t| rel(t, pr.local))).hash(h);
                        let tick = self.tick;
                        keeper.hash_relative(base() + tick * pr.local, tick * cap, h);
                    }
                }
            }
        }
        let inc = |p: u8, n: u8| self.procs[p as usize].inc.wrapping_sub(n).min(3);
        let mut backends: Vec<_> = self
            .backends
            .iter()
            .map(|b| {
                let partitioned = self.procs[b.proc as usize].partitioned;
                (
                    b.proc,
                    inc(b.proc, b.inc),
                    partitioned.then(|| rel(b.last_rx, now)),
                )
            })
            .collect();
        backends.sort();
        backends.hash(h);
        for (locks, row) in self.locks.iter().zip(&self.rows) {
            let l = &locks.role;
            l.holder.map(|(p, n)| (p, inc(p, n))).hash(h);
            // The idle clock only counts for a holder the row does not
            // name (a candidate between its grant and its term, a few
            // ticks unless paused), so a leader's heartbeats do not split
            // states. The row stops naming a holder that keeps the lock
            // only when a newer connection of the same process releases
            // the term while the old connection's close is still on its
            // way; that close ends the backend within a request delay
            // whatever its idle clock says.
            if l.holder.is_some() && l.holder != row.holder {
                (now - l.idle_since).min(self.idle_cap).hash(h);
            }
            for &(p, n, end) in &l.queue {
                (p, inc(p, n), rel(end, now)).hash(h);
            }
            // The watch key's idle clock counts only while its holder is
            // out of every lock statement (the end of one restarts it),
            // and only up to the TTL that makes it end.
            let w = &locks.watch;
            w.holder.map(|(p, n)| (p, inc(p, n))).hash(h);
            if let Some((p, n)) = w.holder {
                if !ElectionModel::busy(self, p, n) {
                    (now - w.idle_since).min(self.watch_idle_cap).hash(h);
                }
            }
            for &(p, n, end) in &w.queue {
                (p, inc(p, n), rel(end, now)).hash(h);
            }
        }
        for r in &self.rows {
            // Once expired, how long ago no longer matters.
            let lease = (r.lease_until as i64 - now as i64).max(-1);
            (r.term, r.holder.map(|(p, n)| (p, inc(p, n))), lease).hash(h);
        }
        for e in &self.net {
            let local = self.procs[e.proc as usize].local;
            let msg = match e.msg {
                Msg::Elect { role, sent } => Msg::Elect {
                    role,
                    sent: rel(sent, local) as u32,
                },
                Msg::Renew { role, term, sent } => Msg::Renew {
                    role,
                    term,
                    sent: rel(sent, local) as u32,
                },
                Msg::Take { role, sent } => Msg::Take {
                    role,
                    sent: rel(sent, local) as u32,
                },
                Msg::Elected {
                    role,
                    term,
                    unclean,
                    sent,
                } => Msg::Elected {
                    role,
                    term,
                    unclean,
                    sent: rel(sent, local) as u32,
                },
                Msg::Busy { role, sent } => Msg::Busy {
                    role,
                    sent: rel(sent, local) as u32,
                },
                Msg::Renewed { role, sent } => Msg::Renewed {
                    role,
                    sent: rel(sent, local) as u32,
                },
                Msg::NotOurs { role, sent } => Msg::NotOurs {
                    role,
                    sent: rel(sent, local) as u32,
                },
                m => m,
            };
            (
                e.to_server,
                e.proc,
                inc(e.proc, e.inc),
                e.user_conn,
                rel(e.sent_at, now),
                msg,
            )
                .hash(h);
        }
        self.faults_left.hash(h);
        self.writes_left.hash(h);
        for (p, n) in self.started.iter().enumerate() {
            n.map(|n| inc(p as u8, n)).hash(h);
        }
        self.unled.hash(h);
        self.last_active.hash(h);
        self.committed.hash(h);
        self.broken.hash(h);
        self.seen_unclean_takeover.hash(h);
        self.seen_fence_refusal.hash(h);
        self.seen_write.hash(h);
        self.seen_idle_preempt.hash(h);
        self.seen_watch_handoff.hash(h);
        self.seen_watch_end.hash(h);
    }
}

impl PartialEq for State {
    fn eq(&self, other: &State) -> bool {
        fingerprint(self) == fingerprint(other)
    }
}

pub(super) fn fingerprint(st: &State) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    st.hash(&mut h);
    h.finish()
}
