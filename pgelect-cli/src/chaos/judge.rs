//! The checker: one backend's histories (the workers' logs, the committed
//! writes) judged against the safety properties and the bounds, on the
//! histories alone (never the supervisors' state).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use super::admin::Admin;
use super::args::timing;
use super::candidates::Run;
use super::events::{
    intervals, is_write_ok, overlapping, read_events, read_own_bound_losses, Event,
};
use super::fail;
use super::faults::{bound, Fault};
use super::group::Group;
use super::schedule::{Hit, Injected};
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
    /// Partition-group runs: when each fault after which a partition was
    /// not led again in time came (or when a partition's unled stretch
    /// over the longest bound began).
    pub(super) unled_at: Vec<u128>,
    /// Partition-group runs: when a member started its command again under
    /// the same term after the previous one stopped acting (`pgelect run
    /// --partitions` restarts a command that exited while its partition
    /// stays held): not a violation, reported.
    pub(super) restarted_at: Vec<u128>,
    /// When each write that was acknowledged by a primary in its last
    /// moments and is missing on the promoted replica was acknowledged (not
    /// a violation: see [`promote`]).
    pub(super) unreplicated_at: Vec<u128>,
    /// Under the HA manager: when each acknowledged but missing write that
    /// the manager's own state explains was acknowledged: the old primary
    /// took it while the manager ran it without synchronous replication
    /// and promoted another node ([`Injected::unsynchronized`]). Also in
    /// `lost_at` and a violation: a lost write all the same, its cause
    /// named.
    pub(super) unsynchronized_lost_at: Vec<u128>,
    /// When each write was refused or failed after its own supervisor had
    /// given that leadership up at its own timing bound, no fault on it
    /// ([`read_own_bound_losses`]): the fence refusing a leader that knew
    /// it had lost; not a violation, reported.
    pub(super) own_bound_at: Vec<u128>,
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

/// A committed fenced write: role, node, term, seq.
pub(super) type Committed = (String, String, i64, i64);

/// One role's history: its workers' events (by time), and its committed
/// writes (node, term, seq) in commit order.
type RoleHistory = (Vec<Event>, Vec<(String, i64, i64)>);

impl Findings {
    /// Says how many writes the fence refused to leaders that had given up
    /// at their own timing bound with no fault on them, if any.
    pub(super) fn print_own_bound(&self, bname: &str) {
        if !self.own_bound_at.is_empty() {
            println!(
                "  {bname}: {} write(s) refused or failed after their own supervisor had given that leadership up at its own timing bound (a lock-connection probe unanswered within its limit, or the local deadline passed) with no fault on it: the machine ran slower than the timings allow; not a violation (--logs keeps the supervisors' warnings)",
                self.own_bound_at.len()
            );
        }
    }

    /// Partitions not led again in time, per fault kind (each counted at
    /// the fault it followed).
    pub(super) fn unled_by_fault(&self, injected: &[Injected], fault: Fault) -> usize {
        let of = |t: u128| injected.iter().rev().find(|i| i.at <= t).map(|i| i.fault);
        self.unled_at
            .iter()
            .filter(|&&t| of(t) == Some(fault))
            .count()
    }
}

/// Reads one backend's histories (the workers' logs, the table) and
/// judges them.
pub(super) async fn check(
    run: &Run<'_>,
    admin: &Admin,
    injected: &[Injected],
) -> Result<Findings, Failure> {
    let mut events = read_events(&run.dir);
    for e in &mut events {
        // A line that does not name its role is of the run's one role.
        if e.role.is_empty() {
            e.role.clone_from(&run.role);
        }
    }
    // Committed writes, in commit order (the id is drawn inside the
    // transaction, after the fence, which holds the row against a bump):
    // the role's, or every partition's of the group it names.
    let rows = admin
        .get()
        .await?
        .query(
            &format!(
                "SELECT role, node, term, seq FROM {} WHERE role = $1 OR left(role, length($1) + 1) = $1 || '/' ORDER BY id",
                run.table
            ),
            &[&run.role],
        )
        .await
        .map_err(fail)?;
    let committed: Vec<Committed> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let timing = timing(run.args, run.backend)?;
    Ok(judge_with(
        &events,
        &committed,
        injected,
        run.backend,
        &timing,
        run.group.as_ref(),
        &read_own_bound_losses(&run.dir),
    ))
}

/// The checker proper, on histories alone: the workers' events (sorted by
/// time), the committed writes in commit order, the faults injected. Every
/// rule holds per role: each partition of a group is an election of its
/// own (`group`: the partition-group run's shape, `None` for one role).
#[cfg(test)]
pub(super) fn judge(
    events: &[Event],
    committed: &[Committed],
    injected: &[Injected],
    backend: BackendArg,
    timing: &pgelect::election::TimingReport,
    group: Option<&Group>,
) -> Findings {
    judge_with(
        events,
        committed,
        injected,
        backend,
        timing,
        group,
        &HashSet::new(),
    )
}

/// [`judge`], knowing which leaderships (role, node, term) their own supervisor
/// gave up at its own timing bound ([`read_own_bound_losses`]).
pub(super) fn judge_with(
    events: &[Event],
    committed: &[Committed],
    injected: &[Injected],
    backend: BackendArg,
    timing: &pgelect::election::TimingReport,
    group: Option<&Group>,
    gave_up: &HashSet<(String, String, i64)>,
) -> Findings {
    let mut f = Findings {
        writes_committed: committed.len(),
        ..Findings::default()
    };
    let mut by_role: BTreeMap<&str, RoleHistory> = BTreeMap::new();
    for e in events {
        by_role.entry(&e.role).or_default().0.push(e.clone());
    }
    for (role, node, term, seq) in committed {
        by_role
            .entry(role)
            .or_default()
            .1
            .push((node.clone(), *term, *seq));
    }
    for (role, (events, committed)) in &by_role {
        // Name the partition in what is found; one role needs no name.
        let prefix = match group {
            Some(_) => format!("{role}: "),
            None => String::new(),
        };
        judge_role(
            role,
            &prefix,
            events,
            committed,
            injected,
            group.is_some(),
            timing.ttl,
            gave_up,
            &mut f,
        );
    }
    // After a promotion the promoted server must acknowledge writes again
    // within the bound (a lease leader may keep its term: no new start).
    for i in injected
        .iter()
        .filter(|i| i.skipped.is_none() && i.fault.writes_must_resume())
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
    match group {
        Some(g) => led_again_in_time(g, &by_role, injected, timing, &mut f),
        None => {
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
        }
    }
    f
}

/// The rules of one role (one partition): `events` its workers' (sorted by
/// time), `committed` its writes (node, term, seq) in commit order.
/// `restarts`: whether a supervisor may start its command again within one
/// leadership (a partition group's member does, 1 s after the command
/// exited by itself). `ttl`: how long after a fault that lasted on a node
/// ([`Fault::lasts_on_the_node`]) a leadership of that node may still be
/// lost to it.
// Nine arguments, one call site: a struct of them would only name them
// again.
#[allow(clippy::too_many_arguments)]
fn judge_role(
    role: &str,
    prefix: &str,
    events: &[Event],
    committed: &[(String, i64, i64)],
    injected: &[Injected],
    restarts: bool,
    ttl: Duration,
    gave_up: &HashSet<(String, String, i64)>,
    f: &mut Findings,
) {
    let ivs = intervals(events);
    // Terms rise with every start: with every new leadership. The same
    // supervisor's next worker of the same term, once the last one stopped
    // acting, is that leadership's command started again (the overlap rule
    // below still holds for it).
    for w in ivs.windows(2) {
        if restarts && w[1].term == w[0].term && w[1].node == w[0].node && w[1].start >= w[0].end {
            f.restarted_at.push(w[1].start);
            continue;
        }
        if w[1].term <= w[0].term {
            f.violations.push(format!(
                "{prefix}terms did not rise: {} started term {} at {} after {} started term {} at {}",
                w[1].node, w[1].term, w[1].start, w[0].node, w[0].term, w[0].start
            ));
        }
    }
    for w in committed.windows(2) {
        if w[1].1 < w[0].1 {
            f.violations.push(format!(
                "{prefix}fenced write {}#{} of term {} committed after {}#{} of term {}",
                w[1].0, w[1].2, w[1].1, w[0].0, w[0].2, w[0].1
            ));
        }
    }
    let have: HashSet<(String, i64, i64)> = committed.iter().cloned().collect();
    // Whether a fault was injected on the leader of `term` by `at`, or a
    // manager's fault on the database was still on at `at` (it hits every
    // leader until the formation has settled: a leader elected on a
    // primary restarted in place may yet see it failed over), or a fault
    // that lasts on a node acted on `node` then or within a ttl before (a
    // starved standby that won the lock while still starved loses that
    // term too, and finds out when it next runs).
    let linger = ttl.as_nanos();
    let faulted = |node: &str, term: i64, at: u128| {
        injected.iter().any(|i| {
            i.at <= at
                && ((i.skipped.is_none()
                    && (i.hits.iter().any(|h| h.role == role && h.term == term)
                        || (i.fault.needs_manager() && at <= i.ended)
                        || (i.fault.lasts_on_the_node()
                            && at <= i.ended + linger
                            && i.node.split(',').any(|n| n == node))))
                    // A fault on the server hits whoever leads while it
                    // lasts, even one reported skipped because leadership
                    // had moved just before it (it ran all the same).
                    || (i.ran && i.fault.hits_the_server() && at <= i.ended))
        })
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
            // The manager's own state may explain it: still a loss (the
            // acknowledgement promised a synchronous standby), named so.
            let unsynchronized = injected.iter().find_map(|i| {
                i.unsynchronized
                    .as_ref()
                    .filter(|u| i.skipped.is_none() && u.from <= e.at && e.at <= u.to)
            });
            if let Some(u) = unsynchronized {
                f.unsynchronized_lost_at.push(e.at);
                f.violations.push(format!(
                    "{prefix}write {}#{seq} of term {} was acknowledged but is not in the table: lost by the HA manager (it ran the old primary without synchronous replication while it promoted the standby: {})",
                    e.node, e.term, u.why
                ));
                continue;
            }
            f.violations.push(format!(
                "{prefix}write {}#{seq} of term {} was acknowledged but is not in the table",
                e.node, e.term
            ));
        } else if outcome != Some("ok")
            && !faulted(&e.node, e.term, e.at)
            && gave_up.contains(&(role.to_owned(), e.node.clone(), e.term))
        {
            // Its own supervisor had given this leadership up (a probe
            // unanswered in time, the deadline passed): the fence refused a
            // leader that knew it had lost.
            f.own_bound_at.push(e.at);
        } else if outcome != Some("ok") && !faulted(&e.node, e.term, e.at) {
            // Refused or failed, while nothing had been done to this leader:
            // a healthy leader's write lost.
            f.lost_at.push(e.at);
            f.violations.push(format!(
                "{prefix}write {}#{seq} of term {} (pid {}) was {} at {} although no fault had touched that leader",
                e.node,
                e.term,
                e.pid,
                outcome.unwrap_or("?"),
                e.at
            ));
        }
    }
    // Acting intervals of different workers must not overlap, except a
    // paused worker's after its pause: then none of its writes may commit
    // once the newer term wrote.
    let paused: HashSet<(u32, i64)> = injected
        .iter()
        .filter(|i| i.paused)
        .flat_map(|i| &i.hits)
        .filter(|h| h.role == role)
        .map(|h| (h.pid, h.term))
        .collect();
    for (a, b) in overlapping(&ivs) {
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
                        "{prefix}{stale} write(s) of the paused {}'s term {} committed after term {} wrote",
                        a.node, a.term, b.term
                    ));
                }
            }
            continue;
        }
        f.overlaps_at.push(b.start);
        f.violations.push(format!(
            "{prefix}two leaders at once: {} (term {}, pid {}) acted until {} and {} (term {}, pid {}) began at {} ({:.1} ms overlap)",
            a.node, a.term, a.pid, a.end, b.node, b.term, b.pid, b.start,
            (a.end - b.start) as f64 / 1e6
        ));
    }
}

/// When the partition `hit` was hit by `i` is led again, from `events` (its
/// role's, sorted by time): the first start of a newer term (the fault's
/// time if that start came before it: the partition had moved already),
/// or, where the fault need not move leadership (a pooler restart), the
/// first fenced write acknowledged after the fault was over.
pub(super) fn led_again(events: &[Event], hit: &Hit, i: &Injected) -> Option<u128> {
    let may_keep = !i.fault.must_fail_over(BackendArg::Lease);
    events
        .iter()
        .find(|e| {
            (e.what == "start" && e.term > hit.term)
                || (may_keep && e.at > i.ended && e.term >= hit.term && is_write_ok(&e.what))
        })
        .map(|e| e.at.max(i.at))
}

/// The partition-group rules: after each fault every partition it hit is
/// led again within the fault's bound ([`Group::bound`]); and no partition
/// is led by no worker, at any time after it was first led, for longer than
/// the longest of those bounds (a rebalance, too, must never leave one
/// unled).
fn led_again_in_time(
    g: &Group,
    by_role: &BTreeMap<&str, RoleHistory>,
    injected: &[Injected],
    timing: &pgelect::election::TimingReport,
    f: &mut Findings,
) {
    let none = Vec::new();
    for i in injected.iter().filter(|i| i.skipped.is_none()) {
        let b = g.bound(i.fault, timing);
        for h in &i.hits {
            let events = by_role.get(h.role.as_str()).map_or(&none, |(e, _)| e);
            match led_again(events, h, i) {
                Some(t) if Duration::from_nanos(t.saturating_sub(i.at) as u64) <= b => {}
                Some(t) => {
                    f.unled_at.push(i.at);
                    f.violations.push(format!(
                        "{}: {} on {} at {}: led again (after term {}) at {}, {} ms later, over the bound of {} ms",
                        h.role, i.fault.name(), i.node, i.at, h.term, t,
                        t.saturating_sub(i.at) / 1_000_000, b.as_millis()
                    ));
                }
                None => {
                    f.unled_at.push(i.at);
                    f.violations.push(format!(
                        "{}: {} on {} at {}: never led again after term {} (bound {} ms)",
                        h.role,
                        i.fault.name(),
                        i.node,
                        i.at,
                        h.term,
                        b.as_millis()
                    ));
                }
            }
        }
    }
    let limit = g.longest_bound(timing);
    for (role, (events, _)) in by_role {
        let ivs = intervals(events);
        let Some(first) = ivs.first() else { continue };
        let mut covered = first.end;
        for iv in &ivs[1..] {
            if iv.start > covered {
                let gap = Duration::from_nanos((iv.start - covered) as u64);
                if gap > limit {
                    f.unled_at.push(covered);
                    f.violations.push(format!(
                        "{role}: no worker acted from {covered} until {} began term {} at {} ({} ms), over the longest bound of {} ms",
                        iv.node, iv.term, iv.start, gap.as_millis(), limit.as_millis()
                    ));
                }
            }
            covered = covered.max(iv.end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::args::standard_timing as standard;
    use crate::chaos::events::{ev, ev_of};
    use crate::chaos::faults::bound;

    fn fault(fault: Fault, node: &str, term: i64, at_ms: u128, next_ms: Option<u128>) -> Injected {
        Injected {
            fault,
            at: at_ms * 1_000_000,
            node: node.to_owned(),
            term,
            // The pid is not looked at outside a pause.
            hits: vec![Hit {
                role: String::new(),
                term,
                pid: 0,
            }],
            ended: at_ms * 1_000_000,
            next_start: next_ms.map(|n| n * 1_000_000),
            paused: false,
            unreplicated: None,
            resumed: None,
            writable: None,
            unsynchronized: None,
            skipped: None,
            ran: true,
        }
    }

    /// c1 leads term 1 from 0 to 1000 ms, is killed at 1000 ms; c2 leads
    /// term 2 from 1400 ms. Clean.
    fn clean_history() -> (Vec<Event>, Vec<Committed>) {
        let events = vec![
            ev("start", "c1", 1, 0, 11),
            ev("write:1:ok", "c1", 1, 50, 11),
            ev("tick", "c1", 1, 1000, 11),
            ev("start", "c2", 2, 1400, 12),
            ev("write:1:ok", "c2", 2, 1450, 12),
            ev("tick", "c2", 2, 1500, 12),
        ];
        let committed = vec![
            (String::new(), "c1".into(), 1, 1),
            (String::new(), "c2".into(), 2, 1),
        ];
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
            None,
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
        committed.push((String::new(), "c3".into(), 3, 1));
        let t = standard(BackendArg::Session);
        let faults = [
            fault(Fault::Kill, "c1", 1, 1000, Some(1400)),
            fault(Fault::Kill, "c2", 2, 2000, Some(3000)),
        ];
        let f = judge(&events, &committed, &faults, BackendArg::Session, &t, None);
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        // The same pid acting again under another term while c2 acts is
        // still two leaders.
        events.push(ev("tick", "c1", 1, 1460, 11));
        events.sort_by_key(|e| e.at);
        let f = judge(&events, &committed, &faults, BackendArg::Session, &t, None);
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
        let f = judge(&events, &committed, &[late], BackendArg::Session, &t, None);
        assert_eq!(f.violations.len(), 1, "{:?}", f.violations);
        assert!(
            f.violations[0].starts_with("kill on c1 (term 1)")
                && f.violations[0].contains("over the bound"),
            "{}",
            f.violations[0]
        );
    }

    /// The clean history, and c2 (term 2) having a write refused at 1480
    /// ms although nothing was done to it; c1 killed at 1000 ms.
    fn refused_c2() -> (Vec<Event>, Vec<Committed>, [Injected; 1]) {
        let (mut events, committed) = clean_history();
        events.push(ev("write:2:refused", "c2", 2, 1480, 12));
        events.sort_by_key(|e| e.at);
        (
            events,
            committed,
            [fault(Fault::Kill, "c1", 1, 1000, Some(1400))],
        )
    }

    #[test]
    fn the_checker_counts_a_healthy_leaders_refused_write_as_lost() {
        let (events, committed, injected) = refused_c2();
        let t = standard(BackendArg::Lease);
        let f = judge(&events, &committed, &injected, BackendArg::Lease, &t, None);
        assert_eq!(f.lost_at, vec![1480 * 1_000_000], "{:?}", f.violations);
        assert!(
            f.violations[0].contains("c2#2 of term 2"),
            "{:?}",
            f.violations
        );
        // The same refusal after a fault on that leader is no loss.
        let mut after = injected.to_vec();
        after.push(fault(Fault::Stop, "c2", 2, 1470, None));
        let f = judge(&events, &committed, &after, BackendArg::Lease, &t, None);
        assert!(f.lost_at.is_empty(), "{:?}", f.violations);
    }

    /// A CI run found this: c1, starved from 1000 ms (term 1) until 4000
    /// ms, lost term 1 to c2, then won term 3 at 2500 ms while still
    /// starved (the lock was free), and lost that too. Its refused write of
    /// term 3 was the starve's doing, not a healthy leader's loss; the
    /// same refusal a ttl after the starve was over, or c2's while c1 was
    /// starved, is a loss.
    #[test]
    fn a_leadership_won_under_a_fault_that_lasts_on_the_node_is_under_it_until_a_ttl_after() {
        let t = standard(BackendArg::Session);
        let ttl_ms = t.ttl.as_millis();
        let events = |refused_at: u128, node: &str, term: i64| {
            let mut e = vec![
                ev("start", "c1", 1, 0, 11),
                ev("start", "c2", 2, 1650, 12),
                ev("start", "c1", 3, 2500, 13),
                ev(&format!("write:{term}:refused"), node, term, refused_at, 13),
            ];
            e.sort_by_key(|e| e.at);
            e
        };
        let mut starve = fault(Fault::Starve, "c1", 1, 1000, Some(1650));
        starve.ended = 4000 * 1_000_000;
        let injected = [starve];
        let judged = |at, node, term| {
            judge(
                &events(at, node, term),
                &[],
                &injected,
                BackendArg::Session,
                &t,
                None,
            )
            .lost_at
        };
        assert!(judged(2900, "c1", 3).is_empty());
        assert!(judged(4000 + ttl_ms, "c1", 3).is_empty());
        assert_eq!(judged(4000 + ttl_ms + 1, "c1", 3).len(), 1);
        assert_eq!(judged(2900, "c2", 2).len(), 1);
        // An instant fault on the node (a kill) covers only its term.
        let kill = [fault(Fault::Kill, "c1", 1, 1000, Some(1650))];
        let f = judge(
            &events(2900, "c1", 3),
            &[],
            &kill,
            BackendArg::Session,
            &t,
            None,
        );
        assert_eq!(f.lost_at.len(), 1, "{:?}", f.violations);
    }

    /// A fast-profile run beside a build: c2's keeper found a heartbeat
    /// unanswered within 25 ms and gave term 2 up, no fault on it; its
    /// worker's write, refused before the supervisor killed it, is the
    /// fence refusing a leader that knew it had lost. The same refusal
    /// without that give-up in c2's log is a healthy leader's write lost.
    #[test]
    fn a_write_refused_after_its_leader_gave_up_at_its_own_bound_is_no_loss() {
        let (events, committed, injected) = refused_c2();
        let t = standard(BackendArg::Session);
        let judged = |gave_up: &[(&str, &str, i64)]| {
            let gave_up = gave_up
                .iter()
                .map(|(r, n, t)| (r.to_string(), n.to_string(), *t))
                .collect();
            judge_with(
                &events,
                &committed,
                &injected,
                BackendArg::Session,
                &t,
                None,
                &gave_up,
            )
        };
        let f = judged(&[("", "c2", 2)]);
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        assert_eq!(f.own_bound_at, vec![1480 * 1_000_000]);
        // Another term, another node, another role: still a loss.
        for other in [("", "c2", 3), ("", "c1", 2), ("other", "c2", 2)] {
            let f = judged(&[other]);
            assert_eq!(f.lost_at, vec![1480 * 1_000_000], "{other:?}");
            assert!(f.own_bound_at.is_empty());
        }
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
            None,
        );
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        assert_eq!(f.unreplicated_at, vec![950 * 1_000_000]);
        // Acknowledged before the replica confirmed it had everything: lost.
        let mut early = promote.clone();
        early.unreplicated = Some((960 * 1_000_000, 1010 * 1_000_000));
        let f = judge(&events, &committed, &[early], BackendArg::Session, &t, None);
        assert_eq!(f.lost_at, vec![950 * 1_000_000], "{:?}", f.violations);
        assert!(f.unreplicated_at.is_empty());
        // No write acknowledged again after the promotion: a violation,
        // whether or not the term moved.
        let mut silent = promote.clone();
        silent.resumed = None;
        let f = judge(
            &events,
            &committed,
            &[silent],
            BackendArg::Session,
            &t,
            None,
        );
        assert_eq!(f.violations.len(), 1, "{:?}", f.violations);
        assert!(
            f.violations[0].contains("no write was acknowledged within the bound"),
            "{:?}",
            f.violations
        );
    }

    /// A node kill under the HA manager at 1000 ms: c2 (term 2) is
    /// elected at 1400 ms, before the formation settled at 1600 ms. A
    /// write of c2's that fails meanwhile (the database was still moving)
    /// is no loss; one that fails after the formation settled is. And
    /// writes must be acknowledged again within the bound.
    /// A server restart aimed at a leader that had lost just before it is
    /// reported skipped, but it ran: the write of the new leader that
    /// failed while the server restarted is no loss; one that failed after
    /// the restart is. (A soak judged the first a violation.)
    #[test]
    fn a_restart_reported_skipped_still_excuses_the_writes_it_failed() {
        let (mut events, committed) = clean_history();
        events.push(ev("write:2:failed", "c2", 2, 1550, 12));
        events.sort_by_key(|e| e.at);
        let t = standard(BackendArg::Session);
        let mut restart = fault(Fault::RestartImmediate, "c1", 1, 1500, None);
        restart.skipped = Some(
            "leadership had already moved to c2 (term 2) 100.0 ms before the fault".to_owned(),
        );
        restart.ended = 1800 * 1_000_000;
        let judged = |i: &Injected| {
            judge(
                &events,
                &committed,
                std::slice::from_ref(i),
                BackendArg::Session,
                &t,
                None,
            )
        };
        let f = judged(&restart);
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        // Over at 1520 ms: the failure at 1550 ms is a healthy leader's.
        let mut short = restart.clone();
        short.ended = 1520 * 1_000_000;
        assert_eq!(judged(&short).lost_at, vec![1550 * 1_000_000]);
        // Skipped before it ran (no server to restart): no excuse.
        let mut not_run = restart.clone();
        not_run.ran = false;
        assert_eq!(judged(&not_run).lost_at, vec![1550 * 1_000_000]);
        // A process fault reported skipped excuses nothing either.
        let mut kill = restart.clone();
        kill.fault = Fault::Kill;
        assert_eq!(judged(&kill).lost_at, vec![1550 * 1_000_000]);
    }

    #[test]
    fn a_managers_fault_excuses_every_leaders_failed_writes_until_the_formation_settled() {
        let (mut events, committed) = clean_history();
        events.push(ev("write:2:failed", "c2", 2, 1550, 12));
        events.sort_by_key(|e| e.at);
        let t = standard(BackendArg::Session);
        let mut kill = fault(Fault::NodeKill, "c1", 1, 1000, Some(1400));
        kill.ended = 1600 * 1_000_000;
        kill.writable = Some(1300 * 1_000_000);
        kill.resumed = Some(1450 * 1_000_000);
        let f = judge(
            &events,
            &committed,
            std::slice::from_ref(&kill),
            BackendArg::Session,
            &t,
            None,
        );
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        // Settled at 1500 ms: the failure at 1550 ms is a healthy
        // leader's write lost.
        let mut early = kill.clone();
        early.ended = 1500 * 1_000_000;
        let f = judge(&events, &committed, &[early], BackendArg::Session, &t, None);
        assert_eq!(f.lost_at, vec![1550 * 1_000_000], "{:?}", f.violations);
        // A process fault excuses only the leader it hit.
        let mut process = kill.clone();
        process.fault = Fault::Kill;
        let f = judge(
            &events,
            &committed,
            &[process],
            BackendArg::Session,
            &t,
            None,
        );
        assert_eq!(f.lost_at, vec![1550 * 1_000_000], "{:?}", f.violations);
        // No write acknowledged again after the manager's fault.
        let mut silent = kill.clone();
        silent.resumed = None;
        let f = judge(
            &events,
            &committed,
            &[silent],
            BackendArg::Session,
            &t,
            None,
        );
        assert!(
            f.violations
                .iter()
                .any(|v| v.starts_with("node-kill on c1 (term 1)")
                    && v.contains("no write was acknowledged within the bound")),
            "{:?}",
            f.violations
        );
    }

    #[test]
    fn the_checker_fails_an_acknowledged_write_missing_from_the_table() {
        let (events, mut committed) = clean_history();
        committed.pop();
        let t = standard(BackendArg::Session);
        let f = judge(&events, &committed, &[], BackendArg::Session, &t, None);
        assert_eq!(f.lost_at.len(), 1, "{:?}", f.violations);
        assert!(f.violations[0].contains("acknowledged but is not in the table"));
    }

    /// A write the old primary acknowledged while the HA manager ran it
    /// without synchronous replication (its events show `wait_primary`
    /// during a switchover) and that is missing: still a lost write and a
    /// violation, reported with the manager's state as its cause; one
    /// acknowledged outside that stretch is an unexplained loss.
    #[test]
    fn a_write_lost_while_the_manager_ran_the_old_primary_unsynchronized_is_a_named_violation() {
        let (mut events, committed) = clean_history();
        events.push(ev("write:2:ok", "c2", 2, 1460, 12));
        events.push(ev("write:3:ok", "c2", 2, 1490, 12));
        events.sort_by_key(|e| e.at);
        let t = standard(BackendArg::Session);
        let mut switchover = fault(Fault::Switchover, "c2", 2, 1455, None);
        switchover.ended = 1470 * 1_000_000;
        // c2's write #3 at 1490 ms came after the switchover.
        switchover.resumed = Some(1490 * 1_000_000);
        switchover.unsynchronized = Some(crate::chaos::ha::Unsynchronized {
            from: 1456 * 1_000_000,
            to: 1470 * 1_000_000,
            why: "switchover 1 ms after the order: \"wait_primary\"".to_owned(),
        });
        let f = judge(
            &events,
            &committed,
            &[switchover],
            BackendArg::Session,
            &t,
            None,
        );
        assert_eq!(
            f.lost_at,
            vec![1460 * 1_000_000, 1490 * 1_000_000],
            "{:?}",
            f.violations
        );
        assert_eq!(f.unsynchronized_lost_at, vec![1460 * 1_000_000]);
        assert_eq!(f.violations.len(), 2, "{:?}", f.violations);
        assert!(
            f.violations[0].contains("lost by the HA manager"),
            "{:?}",
            f.violations
        );
        assert!(
            !f.violations[1].contains("HA manager"),
            "{:?}",
            f.violations
        );
    }

    #[test]
    fn the_checker_fails_two_leaders_and_writes_out_of_term_order() {
        let (mut events, mut committed) = clean_history();
        // c1 still ticks at 1450 ms, after c2 began at 1400 ms.
        events.push(ev("tick", "c1", 1, 1450, 11));
        events.sort_by_key(|e| e.at);
        committed.push((String::new(), "c1".into(), 1, 2));
        let t = standard(BackendArg::Session);
        let f = judge(&events, &committed, &[], BackendArg::Session, &t, None);
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

    /// Partition-group histories: c1 leads g/0 and c2 leads g/1, both with
    /// term 1, from 0 to 1000 ms, ticking every 50 ms; writes of both
    /// partitions interleave in the table.
    fn two_partitions() -> (Vec<Event>, Vec<Committed>, Group) {
        let mut events = Vec::new();
        for (role, node, pid) in [("g/0", "c1", 11), ("g/1", "c2", 12)] {
            events.push(ev_of(role, "start", node, 1, 0, pid));
            for at in (50..=1000).step_by(50) {
                events.push(ev_of(role, "tick", node, 1, at, pid));
            }
            events.push(ev_of(role, "write:1:ok", node, 1, 500, pid));
        }
        events.sort_by_key(|e| e.at);
        let committed = vec![
            ("g/1".into(), "c2".into(), 1, 1),
            ("g/0".into(), "c1".into(), 1, 1),
        ];
        let group = Group {
            partitions: 2,
            members: 2,
            tick: crate::chaos::group::GROUP_TICK,
        };
        (events, committed, group)
    }

    fn hit(role: &str, term: i64, pid: u32) -> Hit {
        Hit {
            role: role.to_owned(),
            term,
            pid,
        }
    }

    #[test]
    fn the_checker_judges_each_partition_as_an_election_of_its_own() {
        let (mut events, mut committed, g) = two_partitions();
        let t = standard(BackendArg::Lease);
        // Two workers acting at once, and a term-3 write of g/0 committed
        // before a term-1 write of g/1: different partitions, no violation.
        events.push(ev_of("g/0", "start", "c3", 3, 1100, 13));
        events.push(ev_of("g/0", "write:1:ok", "c3", 3, 1150, 13));
        events.push(ev_of("g/1", "write:2:ok", "c2", 1, 990, 12));
        events.sort_by_key(|e| e.at);
        committed.push(("g/0".into(), "c3".into(), 3, 1));
        committed.push(("g/1".into(), "c2".into(), 1, 2));
        let f = judge(&events, &committed, &[], BackendArg::Lease, &t, Some(&g));
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        // The same start in g/1, still led by c2 with term 1 until 1000 ms
        // (c3 starting term 3 at 900 ms): two leaders of one partition.
        let mut planted = events.clone();
        planted.push(ev_of("g/1", "start", "c3", 3, 900, 14));
        planted.sort_by_key(|e| e.at);
        let f = judge(&planted, &committed, &[], BackendArg::Lease, &t, Some(&g));
        assert_eq!(f.overlaps_at, vec![900 * 1_000_000], "{:?}", f.violations);
        assert!(
            f.violations[0].starts_with("g/1: two leaders at once: c2 (term 1, pid 12)"),
            "{:?}",
            f.violations
        );
        // A write of g/1's term 1 committed after its term 3 wrote: out of
        // term order in that partition.
        let mut late = committed.clone();
        late.insert(2, ("g/1".into(), "c3".into(), 3, 1));
        planted.push(ev_of("g/1", "write:1:ok", "c3", 3, 950, 14));
        planted.sort_by_key(|e| e.at);
        let f = judge(&planted, &late, &[], BackendArg::Lease, &t, Some(&g));
        assert!(
            f.violations.iter().any(|v| v
                .starts_with("g/1: fenced write c2#2 of term 1 committed after c3#1 of term 3")),
            "{:?}",
            f.violations
        );
    }

    #[test]
    fn the_checker_fails_a_partition_left_unled_past_its_bound() {
        let (mut events, committed, g) = two_partitions();
        let t = standard(BackendArg::Lease);
        let b = g.bound(Fault::Kill, &t).as_millis();
        // c1 killed at 1000 ms; c2 takes g/0 with term 2 just within the
        // bound; g/1 (not hit) keeps its leader.
        let mut kill = fault(Fault::Kill, "c1", 1, 1000, None);
        kill.hits = vec![hit("g/0", 1, 11)];
        let in_time = |at: u128| {
            let mut e = events.clone();
            e.push(ev_of("g/0", "start", "c2", 2, at, 15));
            e.push(ev_of("g/0", "tick", "c2", 2, at + 50, 15));
            e.push(ev_of("g/1", "tick", "c2", 1, at + 50, 12));
            e.sort_by_key(|e| e.at);
            e
        };
        let f = judge(
            &in_time(1000 + b),
            &committed,
            std::slice::from_ref(&kill),
            BackendArg::Lease,
            &t,
            Some(&g),
        );
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        // 1 ms later: g/0 was left unled past its bound.
        let f = judge(
            &in_time(1000 + b + 1),
            &committed,
            std::slice::from_ref(&kill),
            BackendArg::Lease,
            &t,
            Some(&g),
        );
        assert_eq!(f.unled_at, vec![1000 * 1_000_000], "{:?}", f.violations);
        assert!(
            f.violations[0].starts_with("g/0: kill on c1 at 1000000000: led again (after term 1)")
                && f.violations[0].contains("over the bound"),
            "{:?}",
            f.violations
        );
        // Never led again.
        let f = judge(
            &events,
            &committed,
            std::slice::from_ref(&kill),
            BackendArg::Lease,
            &t,
            Some(&g),
        );
        assert!(
            f.violations[0]
                .starts_with("g/0: kill on c1 at 1000000000: never led again after term 1"),
            "{:?}",
            f.violations
        );
        // A partition no fault hit, unled longer than any fault's bound:
        // caught all the same.
        let limit = g.longest_bound(&t).as_millis();
        events.push(ev_of("g/1", "start", "c1", 2, 1000 + limit + 1, 16));
        events.sort_by_key(|e| e.at);
        let f = judge(&events, &committed, &[], BackendArg::Lease, &t, Some(&g));
        assert_eq!(f.violations.len(), 1, "{:?}", f.violations);
        assert!(
            f.violations[0].starts_with("g/1: no worker acted from 1000000000"),
            "{:?}",
            f.violations
        );
    }

    /// A member starts its command again within one leadership (same term)
    /// after it exited: counted, not a violation; the same term from
    /// another member, or a restart while the old worker still acts, is.
    #[test]
    fn a_members_command_started_again_within_its_leadership_is_no_new_term() {
        let (mut events, committed, g) = two_partitions();
        let t = standard(BackendArg::Lease);
        events.push(ev_of("g/0", "start", "c1", 1, 2000, 21));
        events.push(ev_of("g/0", "tick", "c1", 1, 2050, 21));
        events.sort_by_key(|e| e.at);
        let f = judge(&events, &committed, &[], BackendArg::Lease, &t, Some(&g));
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        assert_eq!(f.restarted_at, vec![2000 * 1_000_000]);
        // Not in a run of one role: there every worker is a new term.
        let one: Vec<Event> = events.iter().filter(|e| e.role == "g/0").cloned().collect();
        let f = judge(&one, &[], &[], BackendArg::Lease, &t, None);
        assert!(
            f.violations[0].contains("terms did not rise"),
            "{:?}",
            f.violations
        );
        // Term 1 again, from another member: two leaderships of one term.
        let mut other = events.clone();
        other.push(ev_of("g/0", "start", "c2", 1, 3000, 22));
        other.sort_by_key(|e| e.at);
        let f = judge(&other, &committed, &[], BackendArg::Lease, &t, Some(&g));
        assert!(
            f.violations
                .iter()
                .any(|v| v.starts_with("g/0: terms did not rise: c2 started term 1")),
            "{:?}",
            f.violations
        );
        // Started again while the first worker still acts: an overlap.
        let mut early = events.clone();
        early.push(ev_of("g/0", "start", "c1", 1, 900, 23));
        early.sort_by_key(|e| e.at);
        let f = judge(&early, &committed, &[], BackendArg::Lease, &t, Some(&g));
        assert_eq!(f.overlaps_at.len(), 1, "{:?}", f.violations);
    }

    /// After a pooler restart a partition's leader may keep its term: its
    /// first acknowledged write after the pooler was back shows it led.
    #[test]
    fn a_partition_that_kept_its_term_through_a_pooler_restart_is_led_again_by_its_next_write() {
        let (mut events, committed, g) = two_partitions();
        let t = standard(BackendArg::Lease);
        let mut restart = fault(Fault::PgbouncerRestart, "pgbouncer", 1, 600, None);
        restart.ended = 700 * 1_000_000;
        restart.hits = vec![hit("g/0", 1, 11), hit("g/1", 1, 12)];
        // Failed writes while the pooler was away are no loss (hit).
        events.push(ev_of("g/0", "write:2:failed", "c1", 1, 650, 11));
        events.push(ev_of("g/0", "write:3:ok", "c1", 1, 800, 11));
        events.sort_by_key(|e| e.at);
        let mut committed = committed;
        committed.push(("g/0".into(), "c1".into(), 1, 3));
        let f = judge(
            &events,
            &committed,
            std::slice::from_ref(&restart),
            BackendArg::Lease,
            &t,
            Some(&g),
        );
        // g/1 wrote nothing after 700 ms: never led again as the logs show.
        assert_eq!(f.violations.len(), 1, "{:?}", f.violations);
        assert!(
            f.violations[0].starts_with("g/1: pgbouncer-restart"),
            "{:?}",
            f.violations
        );
        let g0 = events
            .iter()
            .filter(|e| e.role == "g/0")
            .cloned()
            .collect::<Vec<_>>();
        assert_eq!(
            led_again(&g0, &restart.hits[0], &restart),
            Some(800 * 1_000_000)
        );
    }
}
