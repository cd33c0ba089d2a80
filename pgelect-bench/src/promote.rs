//! `promote`: how long a role has no leader across a PostgreSQL primary
//! failover, next to how long the database itself takes.
//!
//! Each trial starts a primary with a streaming replica (the test kit's
//! `ReplicaSet`, asynchronous by default), two candidates in this process
//! connected with a two-host URL (`target_session_attrs=read-write`), waits
//! for one to lead, then applies the `promote` fault: the primary is
//! stopped hard (`pg_ctl stop -m immediate`, clients cut) and the replica
//! promoted. Two series per backend, both from the primary's death:
//!
//! * `promoted`: until the promoted replica accepts a write (what the
//!   database costs: the baseline no elector can beat);
//! * `leader`: until a candidate acts on the new primary: one is told it
//!   leads (a new term), or the lease leader's first renewal there is
//!   answered (its row had reached the replica: it keeps its term and never
//!   stops leading; the session backend's lock dies with the primary, so
//!   there is always a new term).
//!
//! It checks, every trial, that a new term is larger than every term handed
//! out before (the timeline in the term's high bits), and reports how many
//! trials kept their leader. Lease
//! candidates connect directly (a pooler in front of a failover has to be
//! re-pointed by the operator, which this benchmark does not model).

use std::time::{Duration, Instant, SystemTime};

use pgelect::{election::Backend, ConnectOptions, Elector, Leadership};
use pgelect_testkit::{ReplicaSet, Replication, SUPERUSER, TEST_PASSWORD};

use crate::common::{round2, Rows, Stats};

/// Entry point: `promote [--trials N] [--backends session,lease] [--sync] [--json]`.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut trials = 10usize;
    let mut backends = vec![Backend::Session, Backend::Lease];
    let mut mode = Replication::Async;
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--trials" => {
                trials = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| *n > 0)
                    .ok_or("--trials needs a positive number")?
            }
            "--backends" => {
                let list = it.next().ok_or("--backends needs session,lease")?;
                backends = list
                    .split(',')
                    .map(|b| match b {
                        "session" => Ok(Backend::Session),
                        "lease" => Ok(Backend::Lease),
                        other => Err(format!("unknown backend {other:?}")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--sync" => mode = Replication::Sync,
            "--json" => json = true,
            other => return Err(format!("promote: unknown option {other:?}")),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(measure(trials, &backends, mode, json))
}

/// Timing of the candidates: the standard profile at a TTL of 2 s (handover
/// delay 399 ms), standbys of the lease backend retrying every 200 ms.
fn elector(o: &ConnectOptions, backend: Backend, node: &str) -> Result<Elector, String> {
    let b = Elector::builder(o.clone(), "bench-promote")
        .node_id(node)
        .ttl(Duration::from_secs(2))
        .backend(backend);
    let b = match backend {
        Backend::Lease => b.retry_every(Duration::from_millis(200)),
        _ => b,
    };
    b.build().map_err(|e| e.to_string())
}

struct Trial {
    promoted_ms: f64,
    leader_ms: f64,
    old_term: i64,
    new_term: i64,
}

async fn trial(backend: Backend, mode: Replication) -> Result<Trial, String> {
    let set = tokio::task::spawn_blocking(move || ReplicaSet::start(mode))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("cannot start a primary and a replica: {e}"))?;
    let url = format!(
        "postgres://{SUPERUSER}:{TEST_PASSWORD}@127.0.0.1:{},127.0.0.1:{}/postgres\
         ?target_session_attrs=read-write&connect_timeout=2",
        set.primary().port(),
        set.replica().port()
    );
    let o = ConnectOptions::from_url(&url).map_err(|e| e.to_string())?;
    pgelect::migrate(&o).await.map_err(|e| e.to_string())?;
    let a = elector(&o, backend, "a")?;
    let b = elector(&o, backend, "b")?;
    let first = tokio::time::timeout(Duration::from_secs(10), a.leadership())
        .await
        .map_err(|_| "no first leader within 10 s".to_string())?
        .map_err(|e| e.to_string())?;
    let old_term = first.term().get();
    let set = std::sync::Arc::new(set);
    {
        let set = set.clone();
        tokio::task::spawn_blocking(move || set.wait_replayed())
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
    }
    // Both candidates stand for the role across the failover: the first
    // leader loses its connection and campaigns again, as does `b`.
    let next = |e: Elector, held: Option<Leadership>| async move {
        if let Some(l) = held {
            l.lost().await;
        }
        let l = e.leadership().await;
        (Instant::now(), Some(e), Some(l))
    };
    // A lease leader whose row reached the replica may keep leading: its
    // next renewal, on the new primary, succeeds. The leader publishes its
    // renewals to its own watchers.
    let mut watch = a.watch();
    let ta = tokio::spawn(next(a, Some(first)));
    let tb = tokio::spawn(next(b, None));
    let died_at = SystemTime::now();
    let kept = async move {
        loop {
            if watch.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            let renewed_after = watch.borrow_and_update().as_ref().is_some_and(|i| {
                i.holder == "a" && i.term.get() == old_term && i.renewed_at > died_at
            });
            if renewed_after {
                return Instant::now();
            }
        }
    };
    let died = Instant::now();
    let promoted = {
        let set = set.clone();
        tokio::task::spawn_blocking(move || set.promote())
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("promotion failed: {e}"))?
    };
    let (mut ta, mut tb) = (ta, tb);
    // The first candidate told it leads; the other keeps standing (and is
    // dropped with the trial).
    let won = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::select! {
            r = &mut ta => r.map(Some),
            r = &mut tb => r.map(Some),
            at = kept => Ok(Some((at, None, None))),
        }
    })
    .await
    .map_err(|_| "no leader within 30 s of the promotion".to_string())?
    .map_err(|e| e.to_string())?;
    ta.abort();
    tb.abort();
    let (at, new_term) = match won {
        Some((at, _, None)) => (at, old_term),
        Some((at, _e, Some(l))) => {
            let l = l.map_err(|e| format!("campaign failed for good: {e}"))?;
            let new_term = l.term().get();
            if new_term <= old_term {
                return Err(format!(
                    "term {new_term} after the failover is not above term {old_term} before it"
                ));
            }
            (at, new_term)
        }
        None => unreachable!("BUG: every branch yields"),
    };
    Ok(Trial {
        promoted_ms: promoted.as_secs_f64() * 1e3,
        leader_ms: (at - died).as_secs_f64() * 1e3,
        old_term,
        new_term,
    })
}

async fn measure(
    trials: usize,
    backends: &[Backend],
    mode: Replication,
    json: bool,
) -> Result<(), String> {
    let mut out = Vec::new();
    let mut figures = Rows::default();
    // The table unless --json; the JSON line always, as every benchmark.
    let table = |line: String| {
        if !json {
            println!("{line}");
        }
    };
    table(format!(
        "{:<8} {:<9} {:>9} {:>9} {:>9} {:>9}   (ms from the primary's death; {trials} trials, {mode:?} replication)",
        "backend", "series", "p50", "p99", "min", "max"
    ));
    for &backend in backends {
        let mut promoted = Vec::with_capacity(trials);
        let mut leader = Vec::with_capacity(trials);
        let mut terms = Vec::with_capacity(trials);
        for _ in 0..trials {
            let t = trial(backend, mode).await?;
            promoted.push(t.promoted_ms);
            leader.push(t.leader_ms);
            terms.push((t.old_term, t.new_term));
        }
        let (p, l) = (Stats::of(&promoted), Stats::of(&leader));
        let b = backend.as_str();
        figures.latency(&format!("promote/{b}-replica-writable"), &promoted);
        figures.latency(&format!("promote/{b}-leader-on-new-primary"), &leader);
        for (name, s) in [("promoted", &p), ("leader", &l)] {
            table(format!(
                "{:<8} {:<9} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                backend.as_str(),
                name,
                s.p50,
                s.p99,
                s.min,
                s.max
            ));
        }
        let extra: Vec<f64> = leader
            .iter()
            .zip(&promoted)
            .map(|(l, p)| round2(l - p))
            .collect();
        let kept = terms.iter().filter(|(o, n)| o == n).count();
        table(format!(
            "{:<8} the leader kept its term through {kept} of {trials} failovers",
            backend.as_str()
        ));
        out.push(serde_json::json!({
            "backend": backend.as_str(),
            "kept_leader": kept,
            "promoted_ms": p.json(),
            "leader_ms": l.json(),
            "leader_after_promoted_ms": Stats::of(&extra).json(),
            "terms": terms,
        }));
    }
    let mut line = serde_json::json!({
        "bench": "promote",
        "trials": trials,
        "replication": format!("{mode:?}").to_lowercase(),
        "series": out,
    });
    figures.attach(&mut line);
    println!("{line}");
    Ok(())
}
