//! The explorer: a scenario checked breadth-first, and its [`Report`] with
//! each violation's path in readable steps.

use std::fmt::Write as _;

use stateright::{Checker, Model};

use super::scenario::{Place, Scenario, Standby};
use super::state::{ElectionModel, Stage, State, Step};

/// The outcome of checking a scenario.
pub(super) struct Report {
    pub(super) name: &'static str,
    pub(super) states: usize,
    pub(super) unique: usize,
    pub(super) depth: usize,
    pub(super) secs: f64,
    /// Property name and the readable path that breaks it.
    pub(super) violations: Vec<(&'static str, String)>,
    /// The `sometimes` properties for which an example was found.
    pub(super) examples: Vec<&'static str>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} states ({} unique), depth {}, {:.1} s; examples: {:?}",
            self.name, self.states, self.unique, self.depth, self.secs, self.examples
        )?;
        for (name, path) in &self.violations {
            write!(f, "\nVIOLATED {name}:\n{path}")?;
        }
        Ok(())
    }
}

/// Checks a scenario breadth-first (every state up to a depth before
/// any deeper one) until `max_states` states were generated (0: no
/// limit), or until the property `stop_at` is violated.
pub(super) fn check(s: Scenario, max_states: usize, stop_at: Option<&'static str>) -> Report {
    let name = s.name;
    let model = ElectionModel { s };
    let started = std::time::Instant::now();
    let mut builder = model.checker();
    if max_states > 0 {
        builder = builder.target_state_count(max_states);
    }
    if let Some(p) = stop_at {
        builder = builder.finish_when(stateright::HasDiscoveries::AnyOf([p].into()));
    }
    // Breadth-first: a counterexample found is a shortest one.
    let checker = builder.spawn_bfs().join();
    let secs = started.elapsed().as_secs_f64();
    let model = checker.model();
    let mut violations = Vec::new();
    let mut examples = Vec::new();
    for p in model.properties() {
        let found = checker.discovery(p.name);
        match (p.expectation, found) {
            (stateright::Expectation::Sometimes, Some(_)) => examples.push(p.name),
            (stateright::Expectation::Sometimes, None) => {}
            (_, Some(path)) => violations.push((p.name, describe(model, path))),
            (_, None) => {}
        }
    }
    Report {
        name,
        states: checker.state_count(),
        unique: checker.unique_state_count(),
        depth: checker.max_depth(),
        secs,
        violations,
        examples,
    }
}

/// A counterexample, one line per step: every fault, and every step of
/// the last `TAIL` (the ticks and deliveries before are elided).
pub(super) fn describe(m: &ElectionModel, path: stateright::Path<State, Step>) -> String {
    const TAIL: usize = 40;
    let mut out = String::new();
    let tick = m.s.tick;
    let steps = path.into_vec();
    let n = steps.len();
    let mut elided = 0;
    for (i, (st, step)) in steps.iter().enumerate() {
        let Some(step) = step else {
            break;
        };
        // What the step led to.
        let after = &steps.get(i + 1).expect("BUG: a step leads somewhere").0;
        let routine = matches!(step, Step::Tick { .. } | Step::Deliver { .. });
        if routine && i + TAIL < n {
            elided += 1;
            continue;
        }
        if elided > 0 {
            let _ = writeln!(out, "  ... {elided} ticks and deliveries");
            elided = 0;
        }
        let _ = writeln!(
            out,
            "  t={:>7?} {:<44} -> {}",
            tick * st.now,
            format!("{step:?}"),
            summary(m, after)
        );
    }
    out
}

pub(super) fn summary(m: &ElectionModel, st: &State) -> String {
    let mut s = String::new();
    for (p, pr) in st.procs.iter().enumerate() {
        let _ = write!(
            s,
            "p{p}[{:?}{}",
            pr.life,
            if pr.partitioned { ",cut" } else { "" }
        );
        for c in &pr.cands {
            let _ = match &c.stage {
                Stage::Leading { keeper, term, .. } => write!(
                    s,
                    " {:?}@{term} dl+{:?}",
                    keeper.phase(),
                    keeper
                        .deadline()
                        .checked_duration_since(m.s.at(pr.local))
                        .unwrap_or_default()
                ),
                other => write!(
                    s,
                    " {}{}",
                    format!("{other:?}").split(' ').next().unwrap_or(""),
                    match (m.s.standby, c.place, &c.stage) {
                        (
                            Standby::Watched,
                            _,
                            Stage::Unwatching { .. } | Stage::Electing { .. },
                        ) => "",
                        (Standby::Watched, Place::Queue, _) => "(queue)",
                        (Standby::Watched, Place::Watch, _) => "(watch)",
                        _ => "",
                    }
                ),
            };
        }
        s.push_str("] ");
    }
    for (r, row) in st.rows.iter().enumerate() {
        let _ = write!(
            s,
            "row{r}(term {}, holder {:?}, lease {:+}) lock {:?} ",
            row.term,
            row.holder.map(|h| h.0),
            row.lease_until as i64 - st.now as i64,
            st.locks[r].role.holder.map(|h| h.0)
        );
        if m.s.standby == Standby::Watched {
            let _ = write!(s, "watch {:?} ", st.locks[r].watch.holder.map(|h| h.0));
        }
    }
    for e in &st.net {
        let _ = write!(
            s,
            "{}p{}#{}:{:?} ",
            if e.to_server { ">" } else { "<" },
            e.proc,
            e.inc,
            e.msg
        );
    }
    if let Some(b) = &st.broken {
        s.push_str(b);
    }
    s
}
