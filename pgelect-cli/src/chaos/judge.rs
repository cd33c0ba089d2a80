//! The checker: one backend's histories (the workers' logs, the committed
//! writes) judged against the safety properties and the bounds, on the
//! histories alone (never the supervisors' state).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::admin::Admin;
use super::args::timing;
use super::candidates::Run;
use super::events::{intervals, overlapping, read_events, Event};
use super::fail;
use super::faults::{bound, Fault};
use super::schedule::Injected;
use crate::exit::Failure;
use crate::run::BackendArg;

/// What the checker found for one backend.
#[derive(Default)]
pub(super) struct Findings {
    pub(super) violations: Vec<String>,
    /// When each overlap of two healthy leaders began.
    pub(super) overlaps_at: Vec<u128>,
    /// When each overlap with a paused (then continued) leader began.
    pub(super) paused_at: Vec<u128>,
    /// Stale writes committed, by when the overlap they belong to began.
    pub(super) stale_at: Vec<(u128, usize)>,
    /// When each acknowledged but missing write was acknowledged.
    pub(super) lost_at: Vec<u128>,
    /// When each write that was acknowledged by a primary in its last
    /// moments and is missing on the promoted replica was acknowledged (not
    /// a violation: see [`promote`]).
    pub(super) unreplicated_at: Vec<u128>,
    pub(super) writes_committed: usize,
}

impl Findings {
    /// Counts per fault: each finding goes to the last fault injected
    /// before it.
    pub(super) fn by_fault(
        &self,
        injected: &[Injected],
        fault: Fault,
    ) -> (usize, usize, usize, usize) {
        let of = |t: u128| injected.iter().rev().find(|i| i.at <= t).map(|i| i.fault);
        let count = |v: &[u128]| v.iter().filter(|&&t| of(t) == Some(fault)).count();
        let stale = self
            .stale_at
            .iter()
            .filter(|(t, _)| of(*t) == Some(fault))
            .map(|(_, n)| n)
            .sum();
        (
            count(&self.overlaps_at),
            count(&self.paused_at),
            stale,
            count(&self.lost_at),
        )
    }
}

/// Reads one backend's histories (the workers' logs, the table) and
/// judges them.
pub(super) async fn check(
    run: &Run<'_>,
    admin: &Admin,
    injected: &[Injected],
) -> Result<Findings, Failure> {
    let events = read_events(&run.dir);
    // Committed writes, in commit order (the id is drawn inside the
    // transaction, after the fence, which holds the row against a bump).
    let rows = admin
        .get()
        .await?
        .query(
            &format!(
                "SELECT node, term, seq FROM {} WHERE role = $1 ORDER BY id",
                run.table
            ),
            &[&run.role],
        )
        .await
        .map_err(fail)?;
    let committed: Vec<(String, i64, i64)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let timing = timing(run.args, run.backend)?;
    Ok(judge(&events, &committed, injected, run.backend, &timing))
}

/// The checker proper, on histories alone: the workers' events (sorted by
/// time), the committed writes in commit order, the faults injected.
pub(super) fn judge(
    events: &[Event],
    committed: &[(String, i64, i64)],
    injected: &[Injected],
    backend: BackendArg,
    timing: &pgelect::election::TimingReport,
) -> Findings {
    let mut f = Findings::default();
    let ivs = intervals(events);
    // Terms rise with every start.
    for w in ivs.windows(2) {
        if w[1].term <= w[0].term {
            f.violations.push(format!(
                "terms did not rise: {} started term {} at {} after {} started term {} at {}",
                w[1].node, w[1].term, w[1].start, w[0].node, w[0].term, w[0].start
            ));
        }
    }
    f.writes_committed = committed.len();
    for w in committed.windows(2) {
        if w[1].1 < w[0].1 {
            f.violations.push(format!(
                "fenced write {}#{} of term {} committed after {}#{} of term {}",
                w[1].0, w[1].2, w[1].1, w[0].0, w[0].2, w[0].1
            ));
        }
    }
    let have: HashSet<(String, i64, i64)> = committed.iter().cloned().collect();
    // Whether a fault was injected on the leader of `term` by `at`.
    let faulted = |term: i64, at: u128| {
        injected
            .iter()
            .any(|i| i.term == term && i.at <= at && i.skipped.is_none())
    };
    let first_write_of: HashMap<i64, usize> =
        committed
            .iter()
            .enumerate()
            .fold(HashMap::new(), |mut m, (i, (_, t, _))| {
                m.entry(*t).or_insert(i);
                m
            });
    for e in events.iter().filter(|e| e.what.starts_with("write:")) {
        let mut parts = e.what.split(':');
        let (_, seq, outcome) = (parts.next(), parts.next(), parts.next());
        let Some(seq) = seq.and_then(|s| s.parse::<i64>().ok()) else {
            continue;
        };
        let unreplicated = |at: u128| {
            injected.iter().any(|i| {
                i.skipped.is_none()
                    && i.unreplicated
                        .is_some_and(|(from, to)| from < at && at <= to)
            })
        };
        if outcome == Some("ok") && !have.contains(&(e.node.clone(), e.term, seq)) {
            if unreplicated(e.at) {
                // Acknowledged by the old primary after the replica last
                // confirmed it had everything: lost with the primary.
                f.unreplicated_at.push(e.at);
                continue;
            }
            f.lost_at.push(e.at);
            f.violations.push(format!(
                "write {}#{seq} of term {} was acknowledged but is not in the table",
                e.node, e.term
            ));
        } else if outcome != Some("ok") && !faulted(e.term, e.at) {
            // Refused or failed, while nothing had been done to this leader:
            // a healthy leader's write lost.
            f.lost_at.push(e.at);
            f.violations.push(format!(
                "write {}#{seq} of term {} (pid {}) was {} at {} although no fault had touched that leader",
                e.node,
                e.term,
                e.pid,
                outcome.unwrap_or("?"),
                e.at
            ));
        }
    }
    // After a promotion the promoted server must acknowledge writes again
    // within the bound (a lease leader may keep its term: no new start).
    for i in injected
        .iter()
        .filter(|i| i.skipped.is_none() && i.unreplicated.is_some())
    {
        let b = bound(i.fault, backend, timing);
        match i.resumed {
            Some(w) if Duration::from_nanos(w.saturating_sub(i.at) as u64) <= b => {}
            Some(w) => f.violations.push(format!(
                "{} on {} (term {}) at {}: the first write acknowledged afterwards came at {}, {} ms later, over the bound of {} ms",
                i.fault.name(), i.node, i.term, i.at, w, w.saturating_sub(i.at) / 1_000_000, b.as_millis()
            )),
            None => f.violations.push(format!(
                "{} on {} (term {}) at {}: no write was acknowledged within the bound of {} ms afterwards",
                i.fault.name(), i.node, i.term, i.at, b.as_millis()
            )),
        }
    }
    // The gap after each fault against its bound.
    for i in injected.iter().filter(|i| i.skipped.is_none()) {
        let Some(n) = i.next_start else { continue };
        let gap = Duration::from_nanos(n.saturating_sub(i.at) as u64);
        let b = bound(i.fault, backend, timing);
        if gap > b {
            f.violations.push(format!(
                "{} on {} (term {}) at {}: the next term began at {}, {} ms later, over the bound of {} ms",
                i.fault.name(),
                i.node,
                i.term,
                i.at,
                n,
                gap.as_millis(),
                b.as_millis()
            ));
        }
    }
    // Acting intervals of different workers must not overlap, except a
    // paused worker's after its pause: then none of its writes may commit
    // once the newer term wrote.
    let paused: HashSet<(u32, i64)> = injected
        .iter()
        .filter_map(|i| i.paused.map(|(pid, _)| (pid, i.term)))
        .collect();
    for (a, b) in overlapping(&ivs) {
        {
            if paused.contains(&(a.pid, a.term)) {
                f.paused_at.push(b.start);
                if let Some(&newer) = first_write_of.get(&b.term) {
                    let stale = committed
                        .iter()
                        .skip(newer)
                        .filter(|(_, t, _)| *t == a.term)
                        .count();
                    if stale > 0 {
                        f.stale_at.push((b.start, stale));
                        f.violations.push(format!(
                            "{stale} write(s) of the paused {}'s term {} committed after term {} wrote",
                            a.node, a.term, b.term
                        ));
                    }
                }
                continue;
            }
            f.overlaps_at.push(b.start);
            f.violations.push(format!(
                "two leaders at once: {} (term {}, pid {}) acted until {} and {} (term {}, pid {}) began at {} ({:.1} ms overlap)",
                a.node, a.term, a.pid, a.end, b.node, b.term, b.pid, b.start,
                (a.end - b.start) as f64 / 1e6
            ));
        }
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::args::standard_timing as standard;
    use crate::chaos::events::ev;
    use crate::chaos::faults::bound;

    fn fault(fault: Fault, node: &str, term: i64, at_ms: u128, next_ms: Option<u128>) -> Injected {
        Injected {
            fault,
            at: at_ms * 1_000_000,
            node: node.to_owned(),
            term,
            next_start: next_ms.map(|n| n * 1_000_000),
            paused: None,
            unreplicated: None,
            resumed: None,
            skipped: None,
        }
    }

    /// c1 leads term 1 from 0 to 1000 ms, is killed at 1000 ms; c2 leads
    /// term 2 from 1400 ms. Clean.
    fn clean_history() -> (Vec<Event>, Vec<(String, i64, i64)>) {
        let events = vec![
            ev("start", "c1", 1, 0, 11),
            ev("write:1:ok", "c1", 1, 50, 11),
            ev("tick", "c1", 1, 1000, 11),
            ev("start", "c2", 2, 1400, 12),
            ev("write:1:ok", "c2", 2, 1450, 12),
            ev("tick", "c2", 2, 1500, 12),
        ];
        let committed = vec![("c1".into(), 1, 1), ("c2".into(), 2, 1)];
        (events, committed)
    }

    #[test]
    fn the_checker_passes_a_clean_history() {
        let (events, committed) = clean_history();
        let t = standard(BackendArg::Session);
        let f = judge(
            &events,
            &committed,
            &[fault(Fault::Kill, "c1", 1, 1000, Some(1400))],
            BackendArg::Session,
            &t,
        );
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        assert_eq!(f.writes_committed, 2);
    }

    /// A soak found this: the kernel reused a term-1 worker's pid for a
    /// term-3 worker minutes later, and the checker, keying workers by pid
    /// alone, saw one interval over both and "two leaders at once" with
    /// everyone in between.
    #[test]
    fn the_checker_tells_apart_workers_that_share_a_reused_pid() {
        let (mut events, mut committed) = clean_history();
        events.push(ev("start", "c3", 3, 3000, 11));
        events.push(ev("write:1:ok", "c3", 3, 3050, 11));
        events.push(ev("tick", "c3", 3, 3100, 11));
        committed.push(("c3".into(), 3, 1));
        let t = standard(BackendArg::Session);
        let faults = [
            fault(Fault::Kill, "c1", 1, 1000, Some(1400)),
            fault(Fault::Kill, "c2", 2, 2000, Some(3000)),
        ];
        let f = judge(&events, &committed, &faults, BackendArg::Session, &t);
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        // The same pid acting again under another term while c2 acts is
        // still two leaders.
        events.push(ev("tick", "c1", 1, 1460, 11));
        events.sort_by_key(|e| e.at);
        let f = judge(&events, &committed, &faults, BackendArg::Session, &t);
        assert!(
            f.violations
                .iter()
                .any(|v| v.starts_with("two leaders at once: c1")),
            "{:?}",
            f.violations
        );
    }

    #[test]
    fn the_checker_fails_a_gap_over_the_bound_naming_the_fault() {
        let (events, committed) = clean_history();
        let t = standard(BackendArg::Session);
        let b = bound(Fault::Kill, BackendArg::Session, &t).as_millis();
        // The next leader acted 1 ms after the bound.
        let late = fault(Fault::Kill, "c1", 1, 1000, Some(1000 + b + 1));
        let f = judge(&events, &committed, &[late], BackendArg::Session, &t);
        assert_eq!(f.violations.len(), 1, "{:?}", f.violations);
        assert!(
            f.violations[0].starts_with("kill on c1 (term 1)")
                && f.violations[0].contains("over the bound"),
            "{}",
            f.violations[0]
        );
    }

    #[test]
    fn the_checker_counts_a_healthy_leaders_refused_write_as_lost() {
        let (mut events, committed) = clean_history();
        // c2 (term 2) had a write refused although nothing was done to it.
        events.push(ev("write:2:refused", "c2", 2, 1480, 12));
        events.sort_by_key(|e| e.at);
        let t = standard(BackendArg::Lease);
        let injected = [fault(Fault::Kill, "c1", 1, 1000, Some(1400))];
        let f = judge(&events, &committed, &injected, BackendArg::Lease, &t);
        assert_eq!(f.lost_at, vec![1480 * 1_000_000], "{:?}", f.violations);
        assert!(
            f.violations[0].contains("c2#2 of term 2"),
            "{:?}",
            f.violations
        );
        // The same refusal after a fault on that leader is no loss.
        let mut after = injected.to_vec();
        after.push(fault(Fault::Stop, "c2", 2, 1470, None));
        let f = judge(&events, &committed, &after, BackendArg::Lease, &t);
        assert!(f.lost_at.is_empty(), "{:?}", f.violations);
    }

    /// A promotion at 1000 ms: the replica had everything acknowledged
    /// before 900 ms, the primary died at 1010 ms. A write acknowledged in
    /// between may be lost with it (asynchronous replication); one
    /// acknowledged before may not.
    #[test]
    fn the_checker_excuses_only_writes_the_replica_may_not_have_received() {
        let (mut events, committed) = clean_history();
        events.push(ev("write:2:ok", "c1", 1, 950, 11));
        events.sort_by_key(|e| e.at);
        let t = standard(BackendArg::Session);
        let mut promote = fault(Fault::Promote, "c1", 1, 1000, Some(1400));
        promote.unreplicated = Some((900 * 1_000_000, 1010 * 1_000_000));
        promote.resumed = Some(1450 * 1_000_000);
        let f = judge(
            &events,
            &committed,
            std::slice::from_ref(&promote),
            BackendArg::Session,
            &t,
        );
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        assert_eq!(f.unreplicated_at, vec![950 * 1_000_000]);
        // Acknowledged before the replica confirmed it had everything: lost.
        let mut early = promote.clone();
        early.unreplicated = Some((960 * 1_000_000, 1010 * 1_000_000));
        let f = judge(&events, &committed, &[early], BackendArg::Session, &t);
        assert_eq!(f.lost_at, vec![950 * 1_000_000], "{:?}", f.violations);
        assert!(f.unreplicated_at.is_empty());
        // No write acknowledged again after the promotion: a violation,
        // whether or not the term moved.
        let mut silent = promote.clone();
        silent.resumed = None;
        let f = judge(&events, &committed, &[silent], BackendArg::Session, &t);
        assert_eq!(f.violations.len(), 1, "{:?}", f.violations);
        assert!(
            f.violations[0].contains("no write was acknowledged within the bound"),
            "{:?}",
            f.violations
        );
    }

    #[test]
    fn the_checker_fails_an_acknowledged_write_missing_from_the_table() {
        let (events, mut committed) = clean_history();
        committed.pop();
        let t = standard(BackendArg::Session);
        let f = judge(&events, &committed, &[], BackendArg::Session, &t);
        assert_eq!(f.lost_at.len(), 1, "{:?}", f.violations);
        assert!(f.violations[0].contains("acknowledged but is not in the table"));
    }

    #[test]
    fn the_checker_fails_two_leaders_and_writes_out_of_term_order() {
        let (mut events, mut committed) = clean_history();
        // c1 still ticks at 1450 ms, after c2 began at 1400 ms.
        events.push(ev("tick", "c1", 1, 1450, 11));
        events.sort_by_key(|e| e.at);
        committed.push(("c1".into(), 1, 2));
        let t = standard(BackendArg::Session);
        let f = judge(&events, &committed, &[], BackendArg::Session, &t);
        assert_eq!(f.overlaps_at.len(), 1, "{:?}", f.violations);
        assert!(f
            .violations
            .iter()
            .any(|v| v.starts_with("two leaders at once: c1 (term 1, pid 11)")));
        assert!(f
            .violations
            .iter()
            .any(|v| v.starts_with("fenced write c1#2 of term 1 committed after c2#1 of term 2")));
    }
}
