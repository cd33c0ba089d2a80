//! The schedule of one phase: candidates started, faults drawn in seeded
//! rounds and injected on the leader, and what followed each (the next
//! leader's start, or why the fault was skipped).

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

use super::admin::stuck_state;
use super::args::timing;
use super::candidates::{Run, Supervisor};

use super::events::{moved_before, now_ns};
use super::fail;
use super::faults::{bound, inject, Effect, Fault};
use crate::exit::Failure;

/// A leader a fault hit: the worker acting for one role (one partition, in
/// a partition-group run) when the fault came.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Hit {
    pub(super) role: String,
    pub(super) term: i64,
    pub(super) pid: u32,
}

/// One injected fault and what followed.
#[derive(Clone, Debug)]
pub(super) struct Injected {
    pub(super) fault: Fault,
    pub(super) at: u128,
    /// The supervisor(s) it hit (comma-separated), or what else (`pgbouncer`).
    pub(super) node: String,
    /// The term of the leader it hit (the first, in a partition group).
    pub(super) term: i64,
    /// Every leader it hit: its write refused or failed from `at` on is no
    /// loss, and in a partition-group run each of their partitions must be
    /// led again within the bound.
    pub(super) hits: Vec<Hit>,
    /// When the fault's action was over (the pooler back, the pause
    /// continued, under the HA manager the formation settled again); `at`
    /// for instant ones.
    pub(super) ended: u128,
    /// The next start of a higher term, if any.
    pub(super) next_start: Option<u128>,
    /// A pause: the hits were frozen, then continued.
    pub(super) paused: bool,
    /// For a promotion: from when the replica may have missed a commit
    /// (everything acknowledged before had reached it) until the primary
    /// died. An acknowledged write of that window may be lost with the
    /// primary (asynchronous replication): not a violation.
    pub(super) unreplicated: Option<(u128, u128)>,
    /// For a promotion: the first fenced write acknowledged after the
    /// primary died (necessarily by the promoted server), if one came
    /// within the bound. A lease leader may keep its term through a
    /// promotion: then this, not a new term, shows it acting again.
    pub(super) resumed: Option<u128>,
    /// Under the HA manager: when a primary accepted a write again after
    /// the fault (the manager's outage ends there).
    pub(super) writable: Option<u128>,
    /// Under the HA manager: when the manager itself had the old primary
    /// take writes without its synchronous standby while it promoted that
    /// standby (its events show it). An acknowledged write of that stretch
    /// that is missing is still a lost write, reported with this as its
    /// cause.
    pub(super) unsynchronized: Option<super::ha::Unsynchronized>,
    pub(super) skipped: Option<String>,
    /// Whether its action ran. A fault skipped because leadership had
    /// moved before it still ran: on the server (a restart, a promotion,
    /// a manager's fault) it hit whoever led then.
    pub(super) ran: bool,
}

impl Injected {
    /// A fault that could not run here: one skipped trial with the reason,
    /// so that the table and the JSON say so.
    pub(super) fn not_run(fault: Fault, why: &str) -> Injected {
        let at = now_ns();
        Injected {
            fault,
            at,
            node: "-".to_owned(),
            term: 0,
            hits: Vec::new(),
            ended: at,
            next_start: None,
            paused: false,
            unreplicated: None,
            resumed: None,
            writable: None,
            unsynchronized: None,
            skipped: Some(why.to_owned()),
            ran: false,
        }
    }
}

/// so that a short run still injects every kind and a replay draws the same.
pub(super) struct Draw {
    pub(super) kinds: Vec<Fault>,
    pub(super) round: Vec<Fault>,
    /// How many were drawn so far.
    pub(super) drawn: usize,
}

impl Draw {
    pub(super) fn new(kinds: Vec<Fault>) -> Draw {
        Draw {
            kinds,
            round: Vec::new(),
            drawn: 0,
        }
    }

    pub(super) fn next(&mut self, rng: &mut StdRng) -> Option<Fault> {
        if self.round.is_empty() {
            self.round = self.kinds.clone();
            self.round.shuffle(rng);
        }
        self.drawn += 1;
        self.round.pop()
    }
}

/// Runs one phase of one backend's schedule, drawing from `kinds`; returns
/// the faults injected.
pub(super) async fn schedule(
    run: &mut Run<'_>,
    kinds: Vec<Fault>,
    rng: &mut StdRng,
) -> Result<Vec<Injected>, Failure> {
    let args = run.args;
    let admin = run.admin;
    let timing = timing(args, run.backend)?;
    let phase_start = now_ns();
    let mut sups: Vec<Supervisor> = Vec::new();
    let mut rogue = None;
    let outcome = async {
        for _ in 0..args.candidates {
            sups.push(run.spawn().await?);
        }
        if args.rogue {
            rogue = Some(run.spawn_rogue()?);
        }
        let mut injected = Vec::new();
        let mut leader = match run
            .next_start(0, phase_start, Duration::from_secs(60))
            .await
        {
            Some(leader) => leader,
            None => {
                return Err(fail(format!(
                    "no leader within 60 s of the start; what the server and the logs show:\n{}",
                    stuck_state(admin, run).await
                )))
            }
        };
        let mut draw = Draw::new(kinds);
        let end = Instant::now() + args.duration;
        // With --every-fault, at least one full round.
        while Instant::now() < end || (args.every_fault && draw.drawn < draw.kinds.len()) {
            // Let the leader settle and write for a while.
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..1500))).await;
            let Some(fault) = draw.next(rng) else { break };
            // A promotion needs a replica that has everything acknowledged
            // so far; making one takes seconds, which are not the fault's.
            let durable = match (fault, run.replicas.as_deref_mut()) {
                (Fault::Promote, Some(pair)) => Some(pair.prepare()?),
                _ => None,
            };
            // Likewise a manager's fault needs a settled formation (a
            // killed node back as a synchronous standby).
            if let (true, Some(formation)) = (fault.needs_manager(), run.manager.as_deref_mut()) {
                formation.prepare()?;
            }
            // Leadership may have moved after the last fault's window (a
            // lease leader that lost its deadline during a restart).
            if let Some(e) = run.latest_start().filter(|e| e.term > leader.term) {
                leader = e;
            }
            let at = now_ns();
            let Some(i) = sups.iter().position(|s| s.node == leader.node) else {
                return Err(fail(format!(
                    "the leader {} is not one of ours",
                    leader.node
                )));
            };
            let Effect {
                paused,
                unreplicated,
                resume_after,
                writable,
                unsynchronized,
                ended,
                mut skipped,
                found,
            } = inject(fault, run, &mut sups, i, &leader, &timing, rng, durable).await?;
            let ran = skipped.is_none();
            let next = if let Some(found) = found {
                found
            } else if skipped.is_some() {
                None
            } else if fault.must_fail_over(run.backend) {
                run.next_start(leader.term, leader.at, Duration::from_secs(60))
                    .await
            } else {
                // The leader may stay in place: a new term counts only if it
                // began while the fault was on or right after (after a
                // restart of the server or the pooler, within a ttl: a leader that could not renew
                // meanwhile loses by then). A later move is followed before
                // the next fault.
                let window = match fault {
                    Fault::RestartFast
                    | Fault::RestartImmediate
                    | Fault::PgbouncerRestart
                    | Fault::Promote
                    | Fault::Switchover
                    | Fault::Failover
                    | Fault::PostmasterKill
                    | Fault::NodeKill => args.ttl,
                    _ => Duration::ZERO,
                };
                run.next_start(leader.term, leader.at, window + Duration::from_millis(500))
                    .await
            };
            // A start of a newer term that the logs showed only after the
            // leader was chosen, but that was stamped before the fault: the
            // fault hit a candidate that no longer led (its worker wrote
            // `start` between the last look and the fault). It proves
            // nothing about the fault; the new leader is followed.
            if let Some(why) = moved_before(next.as_ref(), at) {
                skipped = Some(why);
            }
            // After a promotion (or a manager's fault), writes must be
            // acknowledged again (by the new primary) within the bound,
            // whether or not the term moved.
            let resumed = match (resume_after, &skipped) {
                (Some(after), None) => {
                    let within = bound(fault, run.backend, &timing)
                        .saturating_sub(Duration::from_nanos(now_ns().saturating_sub(at) as u64));
                    run.next_write_ok(after, within).await
                }
                _ => None,
            };
            injected.push(Injected {
                fault,
                at,
                node: leader.node.clone(),
                term: leader.term,
                hits: vec![Hit {
                    role: run.role.clone(),
                    term: leader.term,
                    pid: leader.pid,
                }],
                ended: ended.unwrap_or(at).max(at),
                next_start: next.as_ref().map(|e| e.at),
                paused,
                unreplicated,
                resumed,
                writable,
                unsynchronized,
                skipped,
                ran,
            });
            if let Some(f) = injected.last() {
                let outcome = match (&f.skipped, f.next_start) {
                    (Some(why), _) => format!("skipped: {why}"),
                    (None, Some(n)) => {
                        let gap = Duration::from_nanos(n.saturating_sub(f.at) as u64);
                        let b = bound(f.fault, run.backend, &timing);
                        format!(
                            "term {} began {:.1} ms later (bound {} ms{})",
                            next.as_ref().map(|e| e.term).unwrap_or_default(),
                            gap.as_secs_f64() * 1e3,
                            b.as_millis(),
                            if gap > b { ": OVER" } else { "" }
                        )
                    }
                    (None, None) => "no new term".to_owned(),
                };
                let outcome = match (f.fault.writes_must_resume(), f.resumed, &f.skipped) {
                    (true, Some(w), None) => format!(
                        "{outcome}; writes acknowledged again {:.1} ms after the fault",
                        w.saturating_sub(f.at) as f64 / 1e6
                    ),
                    (true, None, None) => format!("{outcome}; no write acknowledged again"),
                    _ => outcome,
                };
                println!(
                    "  {:<9} on {} (term {}): {outcome}",
                    f.fault.name(),
                    f.node,
                    f.term
                );
            }
            match next {
                Some(e) => leader = e,
                None if injected
                    .last()
                    .is_some_and(|f| f.skipped.is_some() || !f.fault.must_fail_over(run.backend)) => {}
                None => {
                    return Err(fail(format!(
                        "no new leader within 60 s of {} on {} (term {}); what the server and the logs show:\n{}",
                        fault.name(),
                        leader.node,
                        leader.term,
                        stuck_state(admin, run).await
                    )))
                }
            }
        }
        Ok(injected)
    }
    .await;
    // All stopped within 20 s (each had 15 s before, one after another).
    run.stop_all(rogue, sups, Duration::from_secs(20)).await;
    outcome
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn the_draw_injects_every_kind_each_round_and_replays_with_the_seed() {
        let kinds = vec![Fault::Kill, Fault::Stop, Fault::Partition, Fault::Latency];
        let drawn = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut d = Draw::new(kinds.clone());
            (0..12)
                .map(|_| d.next(&mut rng).unwrap())
                .collect::<Vec<_>>()
        };
        let a = drawn(7);
        for round in a.chunks(4) {
            let mut r = round.to_vec();
            r.sort();
            let mut k = kinds.clone();
            k.sort();
            assert_eq!(r, k, "{a:?}");
        }
        assert_eq!(a, drawn(7));
        assert_ne!(a, drawn(8));
    }
}
