//! The report: a row per fault kind and backend (the JSON), the table, the
//! verdict and the exit code.

use std::collections::{BTreeMap, HashSet};

use super::args::ChaosArgs;
use super::fail;
use super::faults::{bound, Fault};
use super::group::Group;
use super::judge::Findings;
use super::schedule::Injected;
use crate::exit::{self, Failure};
use crate::run::BackendArg;

pub(super) fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[i.clamp(1, v.len()) - 1]
}

pub(super) type Rows = Vec<serde_json::Value>;

/// Prints the table, writes the JSON; the exit code.
pub(super) fn report(
    args: &ChaosArgs,
    seed: u64,
    rows: Rows,
    all_violations: Vec<String>,
) -> Result<u8, Failure> {
    println!(
        "\n{:<19} {:<24} {:>6} {:>6} {:>8} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9}  verdict",
        "fault",
        "backend",
        "trials",
        "moved",
        "overlaps",
        "paused",
        "stale",
        "lost",
        "p50 ms",
        "p99 ms",
        "max ms",
        "bound ms"
    );
    for r in &rows {
        let verdict = match r["skipped_reason"].as_str() {
            Some(why) if r["skipped"] == r["trials"] => format!("skipped: {why}"),
            _ if r["within_bound"] == true => "ok".to_owned(),
            _ => "OVER THE BOUND".to_owned(),
        };
        println!(
            "{:<19} {:<24} {:>6} {:>6} {:>8} {:>6} {:>6} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9}  {verdict}",
            r["fault"].as_str().unwrap_or(""),
            format!(
                "{}{}{}",
                r["backend"].as_str().unwrap_or(""),
                match r["partitions"].as_u64() {
                    Some(n) => format!("/{}x{n}", r["members"]),
                    None => String::new(),
                },
                if r["pooler"] == true { "/pooler" } else { "" }
            ),
            r["trials"].as_u64().unwrap_or(0),
            r["failovers"].as_u64().unwrap_or(0),
            r["overlaps"].as_u64().unwrap_or(0),
            r["paused_overlaps"].as_u64().unwrap_or(0),
            r["stale_writes_committed"].as_u64().unwrap_or(0),
            r["lost_writes"].as_u64().unwrap_or(0),
            r["failover_p50_ms"].as_f64().unwrap_or(0.0),
            r["failover_p99_ms"].as_f64().unwrap_or(0.0),
            r["max_gap_ms"].as_f64().unwrap_or(0.0),
            r["bound_ms"].as_u64().unwrap_or(0),
        );
    }
    println!("seed {seed} (replay with --seed {seed})");
    if let Some(path) = &args.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&rows).map_err(fail)? + "\n",
        )
        .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))?;
    }
    if all_violations.is_empty() {
        println!("\nno violation: never two leaders acting at once outside a pause, writes in term order, terms rising, no healthy leader's write lost, every failover within its bound");
        Ok(0)
    } else {
        for v in &all_violations {
            println!("VIOLATION {v}");
        }
        Ok(exit::SOFTWARE)
    }
}

/// The table's rows for one part of a backend's run (its faults on one
/// server, judged together): one per fault kind. `group`: a
/// partition-group run's shape (its gaps are until every partition a fault
/// hit was led again).
// Eight arguments, two call sites: a struct of them would only name them
// again.
#[allow(clippy::too_many_arguments)]
pub(super) fn rows(
    bname: &str,
    seed: u64,
    backend: BackendArg,
    timing: &pgelect::election::TimingReport,
    injected: &[Injected],
    found: &Findings,
    pooled_kinds: &HashSet<Fault>,
    group: Option<&Group>,
) -> Rows {
    let mut rows = Vec::new();
    let mut kinds: BTreeMap<Fault, Vec<&Injected>> = BTreeMap::new();
    for i in injected {
        kinds.entry(i.fault).or_default().push(i);
    }
    for (fault, list) in kinds {
        let took: Vec<f64> = list
            .iter()
            .filter(|i| i.skipped.is_none())
            .filter_map(|i| i.next_start.map(|n| (n.saturating_sub(i.at)) as f64 / 1e6))
            .collect();
        let skipped = list.iter().filter(|i| i.skipped.is_some()).count();
        let skipped_reason = list.iter().find_map(|i| i.skipped.clone());
        let (overlaps, paused, stale, lost) = found.by_fault(injected, fault);
        // Only a promotion excuses them (they are acknowledged
        // just before its injection).
        let unreplicated = if fault == Fault::Promote {
            found.unreplicated_at.len()
        } else {
            0
        };
        // Under the HA manager: lost writes (counted in lost_writes) that
        // the manager's own state explains (see Findings).
        let of = |t: u128| injected.iter().rev().find(|i| i.at <= t).map(|i| i.fault);
        let lost_unsynchronized = found
            .unsynchronized_lost_at
            .iter()
            .filter(|&&t| of(t) == Some(fault))
            .count();
        let max_gap = took.iter().copied().fold(0.0, f64::max);
        // Promotions: until writes were acknowledged again.
        let resumed: Vec<f64> = list
            .iter()
            .filter(|i| i.skipped.is_none() && i.fault.writes_must_resume())
            .map(|i| {
                i.resumed
                    .map_or(f64::INFINITY, |w| w.saturating_sub(i.at) as f64 / 1e6)
            })
            .collect();
        let max_resumed = resumed.iter().copied().fold(0.0, f64::max);
        // Under the HA manager: until a primary accepted a write again.
        let outage: Vec<f64> = list
            .iter()
            .filter(|i| i.skipped.is_none())
            .filter_map(|i| i.writable.map(|w| w.saturating_sub(i.at) as f64 / 1e6))
            .collect();
        // Under the HA manager: from a primary's first accepted write
        // (the probe's) to a leader's next acknowledged write, the
        // availability the manager's outage does not explain.
        let after_writable: Vec<f64> = list
            .iter()
            .filter(|i| i.skipped.is_none())
            .filter_map(|i| Some(i.resumed?.saturating_sub(i.writable?) as f64 / 1e6))
            .collect();
        let ms = |v: f64| (v * 10.0).round() / 10.0;
        let bound_ms = match group {
            Some(g) => g.bound(fault, timing),
            None => bound(fault, backend, timing),
        }
        .as_millis() as u64;
        let (unled, hits) = match group {
            Some(_) => (
                Some(found.unled_by_fault(injected, fault)),
                Some(list.iter().map(|i| i.hits.len()).sum::<usize>()),
            ),
            None => (None, None),
        };
        rows.push(serde_json::json!({
            "fault": fault.name(),
            "backend": bname,
            "seed": seed,
            "trials": list.len(),
            "skipped": skipped,
            "skipped_reason": skipped_reason,
            // Trials after which leadership moved (a delay, or a
            // terminated lease connection, may leave it in place);
            // the failover figures are over these.
            "failovers": took.len(),
            "overlaps": overlaps,
            "paused_overlaps": paused,
            "stale_writes_committed": stale,
            "lost_writes": lost,
            // Acknowledged by a primary just before it died and
            // not yet on its replica (promote, asynchronous
            // replication): not counted in lost_writes.
            "unreplicated_writes": unreplicated,
            // Of lost_writes: those the old primary acknowledged while the
            // HA manager ran it without synchronous replication during
            // its promotion of the standby (its events show it).
            "lost_writes_manager_unsynchronized": lost_unsynchronized,
            "failover_p50_ms": (percentile(&took, 50.0) * 10.0).round() / 10.0,
            "failover_p99_ms": (percentile(&took, 99.0) * 10.0).round() / 10.0,
            "max_gap_ms": (max_gap * 10.0).round() / 10.0,
            "bound_ms": bound_ms,
            "within_bound": max_gap <= bound_ms as f64
                && max_resumed <= bound_ms as f64
                && unled.unwrap_or(0) == 0,
            // Promotions: the longest time from the fault until a
            // write was acknowledged again (null for other faults,
            // and when none came within the bound: a violation).
            "writes_resumed_max_ms": (!resumed.is_empty() && max_resumed.is_finite())
                .then(|| (max_resumed * 10.0).round() / 10.0),
            "writes_resumed_p50_ms": (!resumed.is_empty() && max_resumed.is_finite())
                .then(|| ms(percentile(&resumed, 50.0))),
            // Under the HA manager (--ha): from the fault until a primary
            // accepted a write again (the manager's outage; null for
            // other faults).
            "manager_outage_p50_ms": (!outage.is_empty()).then(|| ms(percentile(&outage, 50.0))),
            "manager_outage_max_ms": (!outage.is_empty())
                .then(|| ms(outage.iter().copied().fold(0.0, f64::max))),
            // Under the HA manager: from the probe's first write accepted
            // by a primary after the fault to a leader's next acknowledged
            // write (null for other faults).
            "after_writable_p50_ms": (!after_writable.is_empty())
                .then(|| ms(percentile(&after_writable, 50.0))),
            "after_writable_p99_ms": (!after_writable.is_empty())
                .then(|| ms(percentile(&after_writable, 99.0))),
            "after_writable_max_ms": (!after_writable.is_empty())
                .then(|| ms(after_writable.iter().copied().fold(0.0, f64::max))),
            // Whether its candidates connected through the pooler
            // (the lease backend's first and promote phases).
            "pooler": pooled_kinds.contains(&fault),
            // Partition-group runs: the group's size, how many partition
            // leaders the trials hit, and how many of those were not led
            // again within the bound (the failover figures are until the
            // last one was).
            "partitions": group.map(|g| g.partitions),
            "members": group.map(|g| g.members),
            "partitions_hit": hits,
            "partitions_late": unled,
        }));
    }
    rows
}
