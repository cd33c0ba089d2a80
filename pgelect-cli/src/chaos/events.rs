//! The workers' logs read back: one [`Event`] per line, the acting
//! [`Interval`] of each worker process, and the overlaps between them.
//!
//! A line is `WHAT NODE TERM AT_NS PID ROLE`; `WHAT` is `start`, `tick`,
//! `write:SEQ:ok|refused|failed` or `stop`. `ROLE` (the worker's
//! `PGELECT_ROLE`: a partition's role in a partition-group run) may be
//! missing (the Python candidate's lines): then the run's one role.

use std::collections::BTreeMap;
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
