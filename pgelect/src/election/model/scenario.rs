//! What a run checks: a [`Scenario`] (backend, timing, how standbys wait,
//! processes and roles, message delays, the fault budget and kinds, drift,
//! deliberate [`Breaks`]) and what follows from it in ticks (the server's
//! release of a silent client, the wait slices, the liveness bound).

use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

use crate::conn::TcpTimeouts;
use crate::election::keeper::Liveness;
use crate::election::timing::Timing;

/// Which backend a scenario runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Backend {
    Session,
    Lease,
}

/// How a session standby waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Standby {
    /// Blocking, as a candidate of the default priority waits (the session
    /// backend's `Place::Queue` and `Place::Watch`): in the queue of the
    /// role's watch key, one `wait_slice` at a time; the key's holder (the
    /// watch) waits in the role's lock queue in slices of `check_every`
    /// and, between them, reads the row and preempts a zombie holder. No
    /// standby has an observer.
    Watched,
    /// Blocking in the role's lock queue itself, one `wait_slice` at a
    /// time, with an observer connection that preempts zombie holders
    /// (`Place::Direct`: a candidate with a priority, or one whose role's
    /// watch key another database user holds).
    Direct,
    /// A try every so many ticks.
    Polling(u32),
}

/// Where a blocking standby waits (the session backend's `Place`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Place {
    /// In the watch key's queue.
    Queue,
    /// Holding the watch key, in the role's lock queue.
    Watch,
    /// In the role's lock queue, or trying it (polling), with an observer.
    Direct,
}

/// Deliberate breaks of the protocol, for the negative controls. The
/// production keeper and timing are untouched; the model feeds them
/// differently.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Breaks {
    /// Report answers to the keeper as if sent when they arrived.
    pub(super) deadline_from_reply: bool,
    /// The server commits writes without checking the term.
    pub(super) skip_fence: bool,
    /// Standbys preempt only the holder the lease row names (as before
    /// 5522eac), not one idle for a TTL that no row names.
    pub(super) no_idle_preempt: bool,
    /// A standby whose slice of the wait for the watch key ends does not
    /// end a watch that has been idle for a TTL.
    pub(super) no_idle_watch_end: bool,
}

/// One configuration to check, and its bounds.
#[derive(Clone, Debug)]
pub(super) struct Scenario {
    pub(super) name: &'static str,
    pub(super) backend: Backend,
    pub(super) timing: Timing,
    /// The length of one tick.
    pub(super) tick: Duration,
    pub(super) standby: Standby,
    /// Candidate processes.
    pub(super) procs: usize,
    /// Roles per process (2: two roles share each process's connection).
    pub(super) roles: usize,
    /// The longest delay of a message towards the server, in ticks (0:
    /// within the tick).
    pub(super) request_delay: u32,
    /// The longest delay of a message from the server, in ticks.
    pub(super) reply_delay: u32,
    /// Faults per run.
    pub(super) faults: u8,
    /// Which kinds of fault may happen (a set of the `F_*` bits).
    pub(super) kinds: u8,
    /// How long a pause lasts, in ticks: each pause is one of these (a
    /// scheduling hiccup, one past the handover delay, one past the
    /// takeover by preemption).
    pub(super) pauses: Vec<u32>,
    /// Ticks each process's clock may run fast or slow in a run.
    pub(super) drift: u8,
    /// States whose term exceeds this are not expanded.
    pub(super) max_term: u32,
    /// Fenced writes per run (issued by acting leaders at any moment, or
    /// by a paused one as it resumes).
    pub(super) writes: u8,
    pub(super) breaks: Breaks,
}

/// A process crashes (and may restart).
pub(super) const F_CRASH: u8 = 1;
/// A process pauses (and resumes).
pub(super) const F_PAUSE: u8 = 2;
/// A backend is terminated, with or without the goodbye reaching it.
pub(super) const F_TERMINATE: u8 = 4;
/// A process is cut off from the server (and healed).
pub(super) const F_PARTITION: u8 = 8;
/// A leader resigns.
pub(super) const F_RESIGN: u8 = 16;
/// Every kind.
pub(super) const F_ALL: u8 = 31;

pub(super) fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

impl Scenario {
    pub(super) fn ticks(&self, d: Duration) -> u32 {
        // Rounded up: a timer set for `d` fires at the first tick at or
        // after it.
        d.as_nanos().div_ceil(self.tick.as_nanos()) as u32
    }

    pub(super) fn at(&self, t: u32) -> Instant {
        base() + self.tick * t
    }

    /// When the server declares a silent client gone after its last
    /// packet, as PostgreSQL and Linux apply the settings: keepalive
    /// settings in whole seconds (at least 1), `TCP_USER_TIMEOUT` in
    /// milliseconds (0 = off); whichever fires first.
    pub(super) fn server_release(&self) -> u32 {
        let tcp: TcpTimeouts = self.timing.tcp;
        let secs = |d: Duration| d.as_secs().max(1);
        let keepalive = Duration::from_secs(
            secs(tcp.keepalive_idle)
                + secs(tcp.keepalive_interval) * u64::from(tcp.keepalive_count),
        );
        let user = Duration::from_millis(tcp.user_timeout.as_millis() as u64);
        let r = if user.is_zero() {
            keepalive
        } else {
            keepalive.min(user)
        };
        self.ticks(r).max(1)
    }

    pub(super) fn wait_slice(&self) -> u32 {
        self.ticks(self.timing.wait_slice).max(1)
    }

    /// The watch's slice of the wait for the role's lock, as
    /// `wait_blocking` sets it: `min(check_every, wait_slice)`.
    pub(super) fn watch_slice(&self) -> u32 {
        self.ticks(self.timing.check_every.min(self.timing.wait_slice))
            .max(1)
    }

    /// Where a blocking standby starts each attempt (`wait_blocking`
    /// starts in `Place::Queue` at the default priority); polling ones
    /// try the role's lock directly.
    pub(super) fn first_place(&self) -> Place {
        match self.standby {
            Standby::Watched => Place::Queue,
            Standby::Direct | Standby::Polling(_) => Place::Direct,
        }
    }

    /// How long a client waits for an answer on its connection before it
    /// gives the connection up (its own TCP timeouts): a wait slice plus
    /// the TCP detection bound.
    pub(super) fn client_give_up(&self) -> u32 {
        self.wait_slice() + self.ticks(self.timing.tcp.detection_bound()) + self.round_trip() + 1
    }

    /// Anything older than this many ticks behaves as "long ago".
    pub(super) fn horizon(&self) -> u32 {
        let t = &self.timing;
        let longest = [
            t.ttl,
            t.handover_delay,
            t.wait_slice,
            t.retry_every,
            t.tcp.detection_bound(),
        ]
        .into_iter()
        .max()
        .expect("BUG: non-empty");
        self.ticks(longest) + self.server_release() + self.round_trip() + 3
    }

    /// Property (d)'s bound, in ticks after the last fault.
    ///
    /// Session backend, standbys with an observer each (direct or
    /// polling), as a chain:
    ///
    /// 1. `free`: the server frees a lock whose holder cannot lead (TCP
    ///    timeouts after a partition, or the lease's expiry plus the
    ///    observer's `check_every` for a zombie leader):
    ///    `max(server_release, ttl + check)`.
    /// 2. `stalled`, for each holder in turn that is granted the lock and
    ///    then never records its term (a process paused or cut off before
    ///    the last fault, in the queue or between its grant and its
    ///    term): its
    ///    session is idle from the grant (or its last message handled
    ///    after the fault), it may be preempted once idle for more than
    ///    `ttl` and is by `check_every` later: `ttl + check` from the
    ///    grant. A grant before the last fault is covered by the same sum,
    ///    one after it comes at the end of step 1 at the latest. Each such
    ///    holder is a different paused process, and one process is healthy
    ///    (else the clock does not run): at most `procs - 1` of them.
    /// 3. A standby whose own connection was silently ended gives it up
    ///    (`client_give_up`), sits out a wait slice or a poll interval,
    ///    then its grant, the election statement and the activation (three
    ///    round trips) and the handover delay, plus 2 ticks for timers
    ///    that fire at the first tick at or after their instant.
    ///
    /// The steps are added, not maximised: a paused candidate can be handed
    /// the lock only when the holder before it lets go (3 processes: a
    /// zombie leader preempted after its lease, then the paused candidate
    /// queued behind it).
    ///
    /// Watched standbys (the default) change steps 1 to 3; `leg` is
    /// `request_delay + reply_delay`, the longest from the server's answer
    /// to the client's next statement reaching the server, and `watch`
    /// the watch's slice:
    ///
    /// 1. Only the watch preempts, after a slice of the role's lock wait
    ///    and a read of the row that found it vacant. Two of its
    ///    preemption statements are at most `watch + 3 leg` apart (the
    ///    answer, the next slice, the slice, the read and its answer, the
    ///    preemption); the read before the first that can end a zombie
    ///    (lease expired, `lease_until < now`, at most `ttl + 1` after the
    ///    fault) may come a tick before the expiry and see the lease
    ///    live, so the one after it does, one leg after its read:
    ///    `free = max(server_release, ttl + 1 + watch + 4 leg)`.
    /// 2. A process that cannot act stalls the role in one of two ways:
    ///    * As the watch (holding the role's lock too, if it was granted
    ///      it): its session is idle from the end of its last statement,
    ///      at most a leg (its last statement on its way) and a watch
    ///      slice after the fault, or from the grant of the role's lock,
    ///      which comes no later. Once idle for more than `ttl`, the next
    ///      end of a queued standby's slice ends it; those come at most
    ///      `wait_slice + leg` apart. The watch key then goes to the next
    ///      standby in its queue at once, or, if the standby that ended
    ///      the watch was the only one, to its next slice a leg later;
    ///      the new watch's first slice of the role's lock wait reaches
    ///      the server a leg after that:
    ///      `watch + ttl + 1 + wait_slice + 4 leg`. This is the cost of a
    ///      paused watch: `wait_slice + ttl` before a standby ends it,
    ///      after the slice it was paused in.
    ///    * As the role's lock holder that let go of the watch key and is
    ///      paused before its term: unnamed and idle from its last
    ///      statement (a leg after the fault), the watch preempts it as
    ///      in step 1: `ttl + 1 + watch + 5 leg`.
    ///
    ///    So `ttl + 1 + watch + 4 leg + max(wait_slice, leg)` each, at
    ///    most `procs - 1` of them, as above.
    /// 3. As above, with two more round trips before the election
    ///    statement: the grant of the watch key and its unlock after the
    ///    grant of the role's lock.
    pub(super) fn liveness_bound(&self) -> u32 {
        let t = &self.timing;
        let rt = self.round_trip();
        let ttl = self.ticks(t.ttl);
        let stalling = self.procs as u32 - 1;
        match (self.backend, self.standby) {
            (Backend::Session, Standby::Watched) => {
                let leg = self.request_delay + self.reply_delay;
                let watch = self.watch_slice();
                let free = self.server_release().max(ttl + 1 + watch + 4 * leg);
                let stalled = (ttl + 1 + watch + 4 * leg + self.wait_slice().max(leg)) * stalling;
                free + stalled
                    + self.client_give_up()
                    + self.wait_slice()
                    + 5 * rt
                    + self.ticks(t.handover_delay)
                    + 2
            }
            (Backend::Session, _) => {
                let check = self.ticks(t.check_every);
                let free = self.server_release().max(ttl + check);
                let stalled = (ttl + check) * stalling;
                free + stalled
                    + self.client_give_up()
                    + self.wait_slice()
                    + self.poll_every()
                    + 3 * rt
                    + self.ticks(t.handover_delay)
                    + 2
            }
            (Backend::Lease, _) => {
                ttl + self.ticks(t.retry_every) + 2 * self.ticks(t.heartbeat_timeout) + 3 * rt + 2
            }
        }
    }

    /// The longest round trip, in ticks: both legs and the tick the
    /// answer is acted on.
    pub(super) fn round_trip(&self) -> u32 {
        self.request_delay + self.reply_delay + 1
    }

    /// The delay bound of a message on this leg.
    pub(super) fn delay(&self, to_server: bool) -> u32 {
        if to_server {
            self.request_delay
        } else {
            self.reply_delay
        }
    }

    pub(super) fn poll_every(&self) -> u32 {
        match self.standby {
            Standby::Watched | Standby::Direct => 0,
            Standby::Polling(n) => n,
        }
    }

    pub(super) fn liveness(&self) -> Liveness {
        match self.backend {
            Backend::Session => Liveness::session(&self.timing),
            Backend::Lease => Liveness::statements(),
        }
    }
}
