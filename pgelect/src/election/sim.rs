//! A randomized simulation of the session backend's safety argument, with
//! the real [`Keeper`] in the loop: a leader, the server holding its lock
//! and lease row, and a blocking standby, in virtual time, through a crash,
//! a backend termination (with or without the push notification reaching
//! the leader), a partition (the server notices only through its TCP
//! timeouts) and zombie preemption once the lease expired on the server.
//!
//! The property: the standby never acts before the old leader stopped
//! believing it leads (its keeper reported the loss, or its process died).
//! A paused process is outside it (the fence covers that case).
//!
//! Not a model checker: scenarios are drawn at random (fixed seeds, so a
//! failure reproduces), and one-way message latencies are bounded by 100 ms
//! and by half the heartbeat timeout (the network the timing assumes). The
//! last two tests break an inequality on purpose and expect violations, so
//! the simulation is shown to be able to fail.

use std::time::Duration;

use tokio::time::Instant;

use super::keeper::{Action, Keeper, Liveness};
use super::timing::{Timing, TimingRequest};
use crate::conn::TcpTimeouts;

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[lo, hi]` milliseconds.
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The leader's process dies; its kernel closes the socket.
    Crash,
    /// An admin terminates the leader's backend; the client may or may not
    /// get the server's goodbye.
    Terminate { push_lost: bool },
    /// Every packet between leader and server is dropped from then on.
    Partition,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Renew,
    Heartbeat,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Fault,
    Arrive {
        kind: Kind,
        sent: Duration,
    },
    Reply {
        kind: Kind,
        sent: Duration,
        ok: bool,
    },
    Push,
    ZombieCheck,
    Release,
}

/// What one run ended in.
#[derive(Debug)]
struct Outcome {
    /// When the old leader stopped believing it leads (loss reported, or
    /// its process died).
    leader_end: Option<Duration>,
    /// The leader had already lost before the fault (a heartbeat or renewal
    /// not answered in time): the run tested nothing.
    lost_before_fault: bool,
    /// When the standby began to act.
    standby_acts: Option<Duration>,
}

/// The longest one-way message latency drawn for timing `t`: 100 ms, or
/// less than half the heartbeat timeout, the network the timing assumes (a
/// healthy connection answers a heartbeat within `heartbeat_timeout`).
fn max_latency(t: &Timing) -> u64 {
    (t.heartbeat_timeout.as_millis() as u64 / 2)
        .saturating_sub(1)
        .min(100)
}

fn simulate(t: Timing, fault: Fault, fault_at: Duration, rng: &mut Rng) -> Outcome {
    let base = Instant::now();
    let at = |d: Duration| base + d;
    let max_lat = max_latency(&t);
    let lat = |rng: &mut Rng| rng.ms(0, max_lat);
    let horizon = fault_at + t.ttl * 10 + t.tcp.detection_bound() * 2;

    // The leader won cleanly at 0; the server ran the term statement at
    // `elected`, which set the lease.
    let elected = lat(rng);
    let mut keeper = Keeper::new(
        t,
        Liveness::session(&t),
        at(Duration::ZERO),
        at(elected * 2),
        false,
    );
    let mut lease_until = elected + t.ttl;
    let mut last_rx = elected;

    let mut events: Vec<(Duration, Event)> = vec![(fault_at, Event::Fault)];
    let mut next_check = t.check_every;
    events.push((next_check, Event::ZombieCheck));

    let mut dead = false;
    let mut lost: Option<Duration> = None;
    let mut partitioned = false;
    let mut backend_alive = true;
    let mut released: Option<Duration> = None;
    let mut standby_acts: Option<Duration> = None;
    let mut now = Duration::ZERO;

    loop {
        // The leader's keeper acts at `now`.
        if !dead && lost.is_none() {
            while let Some(action) = keeper.poll(at(now)) {
                match action {
                    Action::Renew | Action::Heartbeat => {
                        let kind = if action == Action::Renew {
                            Kind::Renew
                        } else {
                            Kind::Heartbeat
                        };
                        if !partitioned {
                            events.push((now + lat(rng), Event::Arrive { kind, sent: now }));
                        }
                    }
                    Action::Activate => {}
                    Action::Lose { .. } => {
                        lost = Some(now);
                        break;
                    }
                }
            }
        }
        let leader_done = dead || lost.is_some();
        if let Some(acts) = standby_acts {
            if now >= acts && !leader_done {
                // The standby acts while the old leader still believes.
                return Outcome {
                    leader_end: None,
                    lost_before_fault: false,
                    standby_acts,
                };
            }
        }
        if (standby_acts.is_some() && leader_done) || now > horizon {
            break;
        }
        // The next moment anything happens: an event, the keeper's wake-up,
        // the standby beginning to act.
        let wake = if leader_done {
            None
        } else {
            keeper.next_wake().map(|w| w.duration_since(base))
        };
        let next = events
            .iter()
            .map(|e| e.0)
            .chain(wake)
            .chain(standby_acts)
            .min()
            .unwrap_or(horizon + Duration::from_millis(1));
        // Nothing due but a wake-up the keeper did not act on: move on.
        let stalled = next <= now && events.iter().all(|e| e.0 > now);
        now = if stalled {
            now + Duration::from_millis(1)
        } else {
            next.max(now)
        };
        // Deliver every event due now, in the order they were scheduled.
        let (due, rest): (Vec<_>, Vec<_>) = events.into_iter().partition(|e| e.0 <= now);
        events = rest;
        for (_, event) in due {
            match event {
                Event::Fault => match fault {
                    Fault::Crash => {
                        dead = true;
                        events.push((now + lat(rng), Event::Release));
                    }
                    Fault::Terminate { push_lost } => {
                        backend_alive = false;
                        events.push((now, Event::Release));
                        if !push_lost {
                            events.push((now + lat(rng), Event::Push));
                        }
                    }
                    Fault::Partition => {
                        partitioned = true;
                        // The server declares the client gone after its TCP
                        // timeouts, counted from the last packet it got.
                        let tcp = t.tcp;
                        let keepalive =
                            tcp.keepalive_idle + tcp.keepalive_interval * tcp.keepalive_count;
                        let earliest = keepalive.min(tcp.user_timeout);
                        let latest = keepalive.max(tcp.user_timeout);
                        let spread = (latest - earliest).as_millis() as u64;
                        let detect = earliest + rng.ms(0, spread);
                        events.push(((last_rx + detect).max(now), Event::Release));
                    }
                },
                Event::Arrive { kind, sent } => {
                    if partitioned {
                        continue;
                    }
                    let ok = backend_alive && released.is_none();
                    if ok {
                        last_rx = now;
                        if let Kind::Renew = kind {
                            lease_until = now + t.ttl;
                        }
                    }
                    events.push((now + lat(rng), Event::Reply { kind, sent, ok }));
                }
                Event::Reply { kind, sent, ok } => {
                    if partitioned || dead || lost.is_some() {
                        continue;
                    }
                    match (kind, ok) {
                        (Kind::Renew, true) => keeper.renewed(at(sent), at(now)),
                        (Kind::Heartbeat, true) => keeper.heartbeat_ok(at(now)),
                        (_, false) => keeper.connection_lost(),
                    }
                }
                Event::Push => {
                    if !partitioned && !dead && lost.is_none() {
                        keeper.connection_lost();
                    }
                }
                Event::ZombieCheck => {
                    if released.is_some() {
                        continue;
                    }
                    // The standby's observer: a lease expired on the
                    // server's clock while the backend still holds the lock.
                    if backend_alive && lease_until < now {
                        backend_alive = false;
                        events.push((now, Event::Release));
                        if !partitioned && !rng.chance(50) {
                            events.push((now + lat(rng), Event::Push));
                        }
                    } else {
                        next_check = now + t.check_every;
                        events.push((next_check, Event::ZombieCheck));
                    }
                }
                Event::Release => {
                    if released.is_none() {
                        released = Some(now);
                        // Granted now; the standby's client hears it, sends
                        // the term statement, and (the row still names the
                        // old leader) waits the handover delay from there.
                        standby_acts = Some(now + lat(rng) + t.handover_delay);
                    }
                }
            }
        }
    }
    Outcome {
        leader_end: if dead { Some(fault_at) } else { lost },
        lost_before_fault: lost.is_some_and(|l| l < fault_at),
        standby_acts,
    }
}

/// A valid random timing, or `None` when the draw breaks an inequality.
fn random_timing(rng: &mut Rng) -> Option<Timing> {
    let ttl = rng.ms(1_000, 60_000);
    TimingRequest {
        ttl: Some(ttl),
        heartbeat: Some(rng.ms(50, 2_000)),
        heartbeat_timeout: Some(rng.ms(150, 2_000)),
        check_every: Some(rng.ms(100, 5_000)),
        ..Default::default()
    }
    .validate()
    .ok()
}

fn random_fault(rng: &mut Rng) -> Fault {
    match rng.next() % 4 {
        0 => Fault::Crash,
        1 => Fault::Terminate { push_lost: false },
        2 => Fault::Terminate { push_lost: true },
        _ => Fault::Partition,
    }
}

/// What many runs showed.
struct Summary {
    runs: usize,
    /// Runs in which the standby took over.
    takeovers: usize,
    /// Runs in which the leader lost before the fault.
    idle: usize,
    /// The smallest time between the old leader's end and the standby's
    /// first act, over the takeovers without violation.
    closest: Duration,
    violations: Vec<String>,
}

/// Runs `runs` random scenarios with random valid timings, changed by
/// `tweak`.
impl Summary {
    /// Fails with the first violation, if any run had one.
    fn assert_safe(&self) {
        assert!(
            self.violations.is_empty(),
            "{} of {} runs violated the property, e.g. {}",
            self.violations.len(),
            self.runs,
            self.violations[0]
        );
    }

    /// Fails unless the runs found a violation: the broken setting
    /// (`with`) must be caught.
    fn assert_caught(&self, with: &str) {
        assert!(
            !self.violations.is_empty(),
            "no violation in {} runs with {with}",
            self.runs
        );
    }
}

fn run_many(seed: u64, runs: usize, tweak: impl Fn(Timing) -> Timing) -> Summary {
    run_many_with(seed, runs, random_timing, tweak)
}

/// Runs `runs` random scenarios with timings drawn by `draw`, changed by
/// `tweak`.
fn run_many_with(
    seed: u64,
    runs: usize,
    draw: impl Fn(&mut Rng) -> Option<Timing>,
    tweak: impl Fn(Timing) -> Timing,
) -> Summary {
    let mut rng = Rng(seed);
    let mut done = 0;
    let mut takeovers = 0;
    let mut idle = 0;
    let mut closest = Duration::MAX;
    let mut violations = Vec::new();
    while done < runs {
        let Some(t) = draw(&mut rng) else {
            continue;
        };
        let t = tweak(t);
        let fault = random_fault(&mut rng);
        let fault_at = rng.ms(0, t.ttl.as_millis() as u64 * 3);
        let out = simulate(t, fault, fault_at, &mut rng);
        done += 1;
        idle += usize::from(out.lost_before_fault);
        if let Some(acts) = out.standby_acts {
            takeovers += 1;
            match out.leader_end {
                Some(end) if end <= acts => closest = closest.min(acts - end),
                end => violations.push(format!(
                    "{fault:?} at {fault_at:?}: standby acts at {acts:?}, old leader believed until {end:?} (ttl {:?}, heartbeat {:?}/{:?}, handover {:?})",
                    t.ttl, t.heartbeat, t.heartbeat_timeout, t.handover_delay
                )),
            }
        }
    }
    Summary {
        runs: done,
        takeovers,
        idle,
        closest,
        violations,
    }
}

#[test]
fn the_standby_never_acts_while_the_old_leader_believes() {
    let s = run_many(0x5eed_0001, 10_000, |t| t);
    println!(
        "{} runs, {} takeovers, closest: standby acted {:?} after the old leader stopped",
        s.runs, s.takeovers, s.closest
    );
    s.assert_safe();
    // Not vacuous: nearly every fault ends in a takeover within the horizon.
    assert!(
        s.takeovers * 10 >= s.runs * 9,
        "{} of {}",
        s.takeovers,
        s.runs
    );
}

/// The fast profile at a random TTL (its heartbeat timing does not depend
/// on the TTL; partitions do).
fn fast_timing(rng: &mut Rng) -> Option<Timing> {
    TimingRequest {
        profile: super::timing::Profile::Fast,
        ttl: Some(rng.ms(1_000, 15_000)),
        check_every: Some(rng.ms(100, 5_000)),
        ..Default::default()
    }
    .validate()
    .ok()
}

#[test]
fn the_fast_profile_never_lets_the_standby_act_while_the_old_leader_believes() {
    let s = run_many_with(0x5eed_0004, 3_000, fast_timing, |t| t);
    println!(
        "fast profile: {} runs, {} takeovers, {} lost before the fault, closest: standby acted {:?} after the old leader stopped",
        s.runs, s.takeovers, s.idle, s.closest
    );
    s.assert_safe();
    // Not vacuous: the leader was alive at the fault, and a standby took
    // over, in nearly every run.
    assert!(s.idle * 100 <= s.runs, "{} of {} idle", s.idle, s.runs);
    assert!(
        s.takeovers * 10 >= s.runs * 9,
        "{} of {}",
        s.takeovers,
        s.runs
    );
}

#[test]
fn the_fast_profile_with_a_handover_delay_below_detection_is_caught() {
    // 20 ms < heartbeat 20 ms + heartbeat timeout 25 ms: a terminated
    // backend whose goodbye was lost is noticed too late.
    let s = run_many_with(0x5eed_0005, 2_000, fast_timing, |mut t| {
        t.handover_delay = Duration::from_millis(20);
        t
    });
    s.assert_caught("a 20 ms handover delay");
}

#[test]
fn a_handover_delay_shorter_than_detection_is_caught() {
    // The leader notices a terminated backend whose goodbye was lost only
    // through a heartbeat (up to heartbeat + heartbeat_timeout).
    let s = run_many(0x5eed_0002, 2_000, |mut t| {
        t.handover_delay = Duration::from_millis(10);
        t
    });
    s.assert_caught("a 10 ms handover delay");
}

#[test]
fn tcp_timeouts_shorter_than_the_deadline_are_caught() {
    // A partitioned leader keeps believing until its deadline; a server
    // that drops its lock earlier lets the standby in too soon.
    let s = run_many(0x5eed_0003, 2_000, |mut t| {
        let short = (t.ttl - t.safety_margin) / 10;
        t.tcp = TcpTimeouts {
            keepalive_idle: short,
            keepalive_interval: short / 4 + Duration::from_millis(1),
            keepalive_count: 1,
            user_timeout: short,
        };
        // Detection through heartbeats is slower than the TCP timeouts.
        t.heartbeat = t.ttl;
        t.heartbeat_timeout = t.ttl;
        t.handover_delay = Duration::ZERO;
        t
    });
    s.assert_caught("TCP timeouts below the deadline");
}
