//! The workers' logs read back: one [`Event`] per line, the acting
//! [`Interval`] of each worker process, and the overlaps between them.
//!
//! A line is `WHAT NODE TERM AT_NS PID ROLE`; `WHAT` is `start`, `tick`,
//! `write:SEQ:ok|refused|failed` or `stop`. `ROLE` (the worker's
//! `PGELECT_ROLE`: a partition's role in a partition-group run) may be
//! missing (the Python candidate's lines): then the run's one role.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub(super) fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

#[derive(Clone, Debug)]
pub(super) struct Event {
    pub(super) what: String,
    /// The role the worker acted for; empty when the line did not say.
    pub(super) role: String,
    pub(super) node: String,
    pub(super) term: i64,
    pub(super) at: u128,
    pub(super) pid: u32,
}

pub(super) fn read_events(dir: &Path) -> Vec<Event> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        if e.path().extension().is_none_or(|x| x != "log") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        for l in text.lines() {
            out.extend(parse_line(l));
        }
    }
    out.sort_by_key(|e| e.at);
    out
}

/// The leaderships (node, term) that their own supervisor gave up at its
/// own timing bound, from the supervisors' standard error (`NODE.stderr`
/// in `dir`, `pgelect run`'s log): its keeper found a probe of the lock
/// connection unanswered within its limit and took the connection for
/// dead, or its local deadline passed. With no fault on it, that is the
/// machine running slower than the timings allow (a 25 ms heartbeat bound
/// beside a build), and a write the fence refused afterwards is the fence
/// doing its work, not a healthy leader's write lost.
pub(super) fn read_own_bound_losses(dir: &Path) -> HashSet<(String, String, i64)> {
    let mut out = HashSet::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().is_none_or(|x| x != "stderr") {
            continue;
        }
        let (Some(node), Ok(text)) = (
            path.file_stem().and_then(|n| n.to_str()),
            std::fs::read_to_string(&path),
        ) else {
            continue;
        };
        out.extend(
            own_bound_losses(text.lines()).map(|(role, term)| (role, node.to_owned(), term)),
        );
    }
    out
}

/// The (role, term) of each `lost` event of one supervisor's log that came
/// after its keeper's "no answer on the lock connection in time" (since
/// the last election) or names the deadline.
pub(super) fn own_bound_losses<'a>(
    lines: impl Iterator<Item = &'a str> + 'a,
) -> impl Iterator<Item = (String, i64)> + 'a {
    let mut unanswered = false;
    lines.filter_map(move |l| {
        if l.contains("no answer on the lock connection in time") {
            unanswered = true;
        } else if l.contains("event=\"elected\"") {
            unanswered = false;
        } else if l.contains("event=\"lost\"") {
            let own = l.contains("reason=\"deadline\"")
                || (unanswered && l.contains("reason=\"connection_lost\""));
            unanswered = false;
            let field = |k: &str| l.split_whitespace().find_map(|f| f.strip_prefix(k));
            let role = field("role=").map(|r| r.trim_matches('"').to_owned());
            let term = field("term=").and_then(|t| t.parse().ok());
            return role.zip(term).filter(|_| own);
        }
        None
    })
}

/// One log line as an event, if it is one.
pub(super) fn parse_line(l: &str) -> Option<Event> {
    let f: Vec<&str> = l.split_whitespace().collect();
    let (what, node, term, at, pid, role) = match f[..] {
        [what, node, term, at, pid] => (what, node, term, at, pid, ""),
        [what, node, term, at, pid, role] => (what, node, term, at, pid, role),
        _ => return None,
    };
    Some(Event {
        what: what.to_owned(),
        role: role.to_owned(),
        node: node.to_owned(),
        term: term.parse().ok()?,
        at: at.parse().ok()?,
        pid: pid.parse().ok()?,
    })
}

/// A worker's acting interval.
#[derive(Clone, Debug)]
pub(super) struct Interval {
    pub(super) role: String,
    pub(super) node: String,
    pub(super) term: i64,
    pub(super) pid: u32,
    pub(super) start: u128,
    pub(super) end: u128,
}

/// One interval per worker process. A worker is named by its role, its
/// supervisor's node, its term and its pid together: over a long run the
/// kernel reuses pids (a soak merged a term-9 worker with a later one of
/// the same pid into one interval 24 minutes long), and one supervisor of a
/// partition group runs a worker per partition with terms of their own.
pub(super) fn intervals(events: &[Event]) -> Vec<Interval> {
    let mut by_worker: BTreeMap<(&str, &str, i64, u32), Interval> = BTreeMap::new();
    for e in events {
        let key = (e.role.as_str(), e.node.as_str(), e.term, e.pid);
        let i = by_worker.entry(key).or_insert_with(|| Interval {
            role: e.role.clone(),
            node: e.node.clone(),
            term: e.term,
            pid: e.pid,
            start: e.at,
            end: e.at,
        });
        i.start = i.start.min(e.at);
        i.end = i.end.max(e.at);
    }
    let mut v: Vec<Interval> = by_worker.into_values().collect();
    v.sort_by_key(|i| i.start);
    v
}

/// Every pair of acting intervals of different workers of one role that
/// overlap, the earlier-started first (`ivs` sorted by start). Workers of
/// different roles (partitions) may act at once.
pub(super) fn overlapping(ivs: &[Interval]) -> Vec<(&Interval, &Interval)> {
    let mut out = Vec::new();
    for (i, a) in ivs.iter().enumerate() {
        for b in ivs.iter().skip(i + 1) {
            let same = a.pid == b.pid && a.node == b.node && a.term == b.term;
            if b.start < a.end && !same && a.role == b.role {
                out.push((a, b));
            }
        }
    }
    out
}

/// Whether a worker log line's event is an acknowledged fenced write.
pub(super) fn is_write_ok(what: &str) -> bool {
    what.starts_with("write:") && what.ends_with(":ok")
}

/// Why a fault at `at` proves nothing when the next leader's start was
/// stamped at or before it: the fault hit a candidate that no longer led.
pub(super) fn moved_before(next: Option<&Event>, at: u128) -> Option<String> {
    let e = next.filter(|e| e.at <= at)?;
    Some(format!(
        "leadership had already moved to {} (term {}) {:.1} ms before the fault",
        e.node,
        e.term,
        (at - e.at) as f64 / 1e6
    ))
}

/// An event of the run's one role at `at_ms` milliseconds, for the tests.
#[cfg(test)]
pub(super) fn ev(what: &str, node: &str, term: i64, at_ms: u128, pid: u32) -> Event {
    ev_of("", what, node, term, at_ms, pid)
}

/// An event of `role` at `at_ms` milliseconds, for the tests.
#[cfg(test)]
pub(super) fn ev_of(role: &str, what: &str, node: &str, term: i64, at_ms: u128, pid: u32) -> Event {
    Event {
        what: what.to_owned(),
        role: role.to_owned(),
        node: node.to_owned(),
        term,
        at: at_ms * 1_000_000,
        pid,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn log(dir: &Path, name: &str, lines: &[&str]) {
        std::fs::write(dir.join(name), lines.join("\n") + "\n").unwrap();
    }

    /// Lines as `pgelect run` writes them (from a fast-profile chaos run
    /// beside a build, where leaders kept giving up at the 25 ms bound).
    #[test]
    fn a_leadership_given_up_at_its_own_bound_is_read_from_the_supervisors_log() {
        let lines = [
            // A standby's probe: no leadership of its own to give up.
            r#"2026-12-02T13:49:50.125937Z  WARN pgelect::election::keeper: no answer on the lock connection in time; taking it for dead probe=Heartbeat limit=25ms unanswered_for=25.559708ms checked_late_by=559.708µs"#,
            r#"2026-12-02T13:49:50.771437Z  INFO pgelect::run: elected leader of role "r" with term 5 after 4.3s; starting the command event="elected" role=r node=c4 term=5 after_ms=4342"#,
            r#"2026-12-02T13:49:52.546684Z  WARN pgelect::run: lost leadership of role "r" (term 5): connection_lost; the command was killed event="lost" role=r term=5 reason="connection_lost" killed_in_ms=12"#,
            r#"2026-12-02T13:49:55.400753Z  INFO pgelect::run: elected leader of role "r" with term 8 after 0.6s; starting the command event="elected" role=r node=c4 term=8 after_ms=605"#,
            r#"2026-12-02T13:49:56.304346Z  WARN pgelect::election::keeper: no answer on the lock connection in time; taking it for dead probe=Heartbeat limit=25ms unanswered_for=33.920426ms checked_late_by=8.920426ms"#,
            r#"2026-12-02T13:49:56.304572Z  WARN pgelect::election::driver: leadership lost reason=connection_lost"#,
            r#"2026-12-02T13:49:56.362306Z  WARN pgelect::run: lost leadership of role "r" (term 8): connection_lost; the command was killed event="lost" role=r term=8 reason="connection_lost" killed_in_ms=57"#,
            r#"2026-12-02T13:49:57.000000Z  INFO pgelect::run: elected leader of role "r" with term 11 after 0.6s; starting the command event="elected" role=r node=c4 term=11 after_ms=605"#,
            r#"2026-12-02T13:49:58.000000Z  WARN pgelect::run: lost leadership of role "r" (term 11): deadline; the command was killed event="lost" role=r term=11 reason="deadline" killed_in_ms=3"#,
            r#"2026-12-02T13:49:59.000000Z  INFO pgelect::run: elected leader of role "r" with term 13 after 0.6s; starting the command event="elected" role=r node=c4 term=13 after_ms=605"#,
            r#"2026-12-02T13:50:00.000000Z  WARN pgelect::run: lost leadership of role "r" (term 13): preempted; the command was killed event="lost" role=r term=13 reason="preempted" killed_in_ms=3"#,
        ];
        let found: Vec<(String, i64)> = own_bound_losses(lines.into_iter()).collect();
        // Term 5 ended with its connection closed under it (no probe of its
        // own had gone unanswered), term 13 preempted: neither counts.
        assert_eq!(found, vec![("r".to_owned(), 8), ("r".to_owned(), 11)]);
        let dir = std::env::temp_dir().join(format!("pgelect-chaos-bound-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        log(&dir, "c4.stderr", &lines);
        // A worker's log is not a supervisor's.
        log(&dir, "c4.log", &lines);
        let all = read_own_bound_losses(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(all.len(), 2, "{all:?}");
        assert!(all.contains(&("r".to_owned(), "c4".to_owned(), 8)));
    }

    #[test]
    fn the_checker_sees_an_overlap_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("pgelect-chaos-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // c1 acts 100..200 (term 1); c2 200..300 (term 2): back to back.
        log(
            &dir,
            "c1.log",
            &["start c1 1 100 11", "tick c1 1 150 11", "stop c1 1 200 11"],
        );
        log(
            &dir,
            "c2.log",
            &[
                "start c2 2 200 12",
                "write:1:ok c2 2 250 12",
                "tick c2 2 300 12",
            ],
        );
        let ivs = intervals(&read_events(&dir));
        assert_eq!(ivs.len(), 2);
        assert_eq!(
            (ivs[0].start, ivs[0].end, ivs[1].start, ivs[1].end),
            (100, 200, 200, 300)
        );
        assert!(overlapping(&ivs).is_empty());
        // c3 (term 3) begins at 290 while c2 still ticks at 300: caught.
        log(
            &dir,
            "c3.log",
            &["start c3 3 290 13", "tick c3 3 400 13", "garbage line"],
        );
        let ivs = intervals(&read_events(&dir));
        let found = overlapping(&ivs);
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].0.node.as_str(), found[0].1.node.as_str()),
            ("c2", "c3")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fault_after_leadership_moved_is_not_counted() {
        // c2's worker stamped its start (term 6) at 850 ms; the schedule
        // had last looked before that and aimed a fault at the old leader
        // at 871 ms (a loaded CI run): that fault proves nothing.
        let moved = ev("start", "c2", 6, 850, 7);
        let why = moved_before(Some(&moved), 871 * 1_000_000).expect("missed");
        assert!(why.contains("c2 (term 6) 21.0 ms before"), "{why}");
        // Stamped after the fault: the failover the fault caused.
        assert_eq!(moved_before(Some(&moved), 849 * 1_000_000), None);
        assert_eq!(moved_before(None, 871 * 1_000_000), None);
    }
}
