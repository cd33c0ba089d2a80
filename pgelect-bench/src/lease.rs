//! `lease-failover`: crash failover of the lease backend against its TTL,
//! and the statements per second a candidate sends at steady state.
//!
//! For every TTL of `--ttls` (default `1,2,10` seconds; `0.5` is 500 ms):
//!
//! * `load`: one leader and two standbys (in this process) stand for a role
//!   for `--window` seconds (default 10); the statements each sent are
//!   counted client-side ([`Elector::lease_statements`]) and divided by the
//!   window. Cross-checked with the database's committed transactions
//!   (`pg_stat_database.xact_commit` delta, all candidates together).
//! * `crash`: `--trials` times (default 30), a leader *process* (this binary
//!   again: `lease-failover --child leader <url> <role> <ttl-ms>`) is
//!   SIGKILLed at a random point of its renewal cycle; the time from the
//!   kill until a standby in this process is told it leads.
//!
//! Everything goes through PgBouncer in transaction mode when pgbouncer is
//! installed and the database is a throwaway cluster (else directly; the
//! output says which). Timing: the library defaults for the given TTL
//! (`safety_margin = ttl/5`, `renew_every = ttl/3`, `retry_every = 1s`).
//!
//! Expectation: the lease runs `ttl` from the dead leader's last renewal,
//! which was sent up to `renew_every` before the kill, and the standby tries
//! at the server-reported expiry plus at most 50 ms of jitter (ttl/20 below a
//! 1 s TTL): failover in
//! `[ttl - renew_every, ttl + 50 ms + a round trip]`.

use crate::common::{connect, round2, ChildProc, Rows, Stats};

use std::time::{Duration, Instant};

use pgelect::{election::Backend, ConnectOptions, Elector};

/// Entry point: `lease-failover [--ttls 0.5,1,2,10] [--trials N] [--window S] [--direct] [--json]`.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let mut ttls = vec![1.0, 2.0, 10.0];
    let mut trials = 30usize;
    let mut window = 10.0f64;
    let mut json = false;
    let mut direct = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--ttls" => {
                ttls = it
                    .next()
                    .ok_or("--ttls needs a list of seconds, e.g. 0.5,1,2,10")?
                    .split(',')
                    .map(|s| s.trim().parse::<f64>().ok().filter(|x| *x > 0.0))
                    .collect::<Option<Vec<_>>>()
                    .ok_or("--ttls: every TTL is a positive number of seconds (0.5 for 500 ms); the library refuses what it cannot keep safe")?
            }
            "--trials" => {
                trials = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| *n > 0)
                    .ok_or("--trials needs a positive number")?
            }
            "--window" => {
                window = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|x: &f64| *x >= 1.0)
                    .ok_or("--window needs a number of seconds, at least 1")?
            }
            "--direct" => direct = true,
            "--json" => json = true,
            other => return Err(format!("lease-failover: unknown option {other:?}")),
        }
    }
    let (url, cluster) = crate::database()?;
    let bouncer = match (&cluster, direct) {
        (Some(c), false) if pgelect_testkit::pgbouncer_available() => Some(
            pgelect_testkit::PgBouncer::start(c, pgelect_testkit::PoolMode::Transaction)
                .map_err(|e| format!("cannot start pgbouncer: {e}"))?,
        ),
        _ => None,
    };
    let via = match &bouncer {
        Some(b) => b.url("postgres"),
        None => url.clone(),
    };
    let path = if bouncer.is_some() {
        "PgBouncer (transaction mode)"
    } else {
        "direct"
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(measure(&url, &via, path, &ttls, trials, window, json))
}

fn builder(options: ConnectOptions, role: &str, ttl: Duration) -> pgelect::ElectorBuilder {
    Elector::builder(options, role)
        .backend(Backend::Lease)
        .ttl(ttl)
}

async fn measure(
    url: &str,
    via: &str,
    path: &str,
    ttls: &[f64],
    trials: usize,
    window: f64,
    json: bool,
) -> Result<(), String> {
    let direct = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
    pgelect::migrate(&direct).await.map_err(|e| e.to_string())?;
    let options = ConnectOptions::from_url(via).map_err(|e| e.to_string())?;
    let observer = connect(url).await?;
    let mut rows = Vec::new();
    let mut figures = Rows::default();
    for (n, &ttl_s) in ttls.iter().enumerate() {
        let ttl = Duration::from_secs_f64(ttl_s);
        let probe = builder(options.clone(), "probe", ttl)
            .build()
            .map_err(|e| e.to_string())?;
        let renew_every = ttl / 3;
        let deadline = probe.deadline_budget();
        drop(probe);
        let load = load(&options, &observer, &format!("bench-load-{n}"), ttl, window).await?;
        if !json {
            eprintln!(
                "lease-failover: ttl {ttl:?}: leader {:.3}/s, standby {:.3}/s; {trials} crash trials…",
                load.leader, load.standby
            );
        }
        let role = format!("bench-lease-{n}");
        let mut samples = Vec::with_capacity(trials);
        for i in 0..trials {
            samples.push(crash_trial(via, &options, &role, ttl, i).await?);
            if !json && (i + 1) % 10 == 0 {
                eprintln!("lease-failover: ttl {ttl:?}: {} of {trials} trials", i + 1);
            }
        }
        let s = Stats::of(&samples);
        figures.latency(&format!("lease-failover/crash-ttl-{ttl:?}"), &samples);
        figures.push(
            &format!("lease-failover/leader-ttl-{ttl:?}"),
            "statements",
            load.leader,
            "1/s",
        );
        figures.push(
            &format!("lease-failover/standby-ttl-{ttl:?}"),
            "statements",
            load.standby,
            "1/s",
        );
        rows.push((ttl, renew_every, deadline, s, load));
    }
    let mut line = serde_json::json!({
        "bench": "lease-failover",
        "path": path,
        "trials": trials,
        "window_s": window,
        "series": rows.iter().map(|(ttl, renew, deadline, s, load)| serde_json::json!({
            "ttl_ms": ttl.as_millis() as u64,
            "renew_every_ms": renew.as_millis() as u64,
            "deadline_ms": deadline.as_millis() as u64,
            "crash_failover_ms": s.json(),
            "crash_minus_ttl_p99_ms": round2(s.p99 - ttl.as_secs_f64() * 1000.0),
            "crash_p99_within_ttl_plus_50ms": s.p99 <= ttl.as_secs_f64() * 1000.0 + 50.0,
            "statements_per_s": {
                "leader": round3(load.leader),
                "standby": round3(load.standby),
                "xact_commit_per_s_all_three": round3(load.xact_per_s),
            },
        })).collect::<Vec<_>>(),
    });
    if !json {
        println!("lease-failover through {path}, {trials} trials per TTL (leader SIGKILLed; time until a standby acts)\n");
        println!(
            "{:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12} {:>12}",
            "ttl",
            "renew",
            "p50 ms",
            "p99 ms",
            "min ms",
            "max ms",
            "p99-ttl",
            "leader st/s",
            "standby st/s",
            "xact/s (3)"
        );
        for (ttl, renew, _, s, load) in &rows {
            println!(
                "{:>8} {:>9} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>12.3} {:>12.3} {:>12.3}",
                format!("{:?}", ttl),
                format!("{:?}", renew),
                s.p50,
                s.p99,
                s.min,
                s.max,
                s.p99 - ttl.as_secs_f64() * 1000.0,
                load.leader,
                load.standby,
                load.xact_per_s
            );
        }
        for (ttl, _, _, s, _) in &rows {
            let target = ttl.as_secs_f64() * 1000.0 + 50.0;
            println!(
                "target ttl {ttl:?}: crash p99 {:.1} <= ttl + 50 ms = {target:.1}: {}",
                s.p99,
                if s.p99 <= target { "met" } else { "MISSED" }
            );
        }
        println!();
    }
    figures.attach(&mut line);
    println!("{line}");
    Ok(())
}

struct Load {
    leader: f64,
    standby: f64,
    xact_per_s: f64,
}

/// One leader and two standbys for `window` seconds: statements per second.
async fn load(
    options: &ConnectOptions,
    observer: &tokio_postgres::Client,
    role: &str,
    ttl: Duration,
    window: f64,
) -> Result<Load, String> {
    let mk = |node: &str| {
        builder(options.clone(), role, ttl)
            .node_id(node)
            .build()
            .map_err(|e| e.to_string())
    };
    let leader = mk("load-leader")?;
    let l = leader.leadership().await.map_err(|e| e.to_string())?;
    let standbys: Vec<_> = ["load-s1", "load-s2"]
        .iter()
        .map(|n| mk(n))
        .collect::<Result<_, _>>()?;
    let standbys: Vec<_> = standbys.into_iter().map(std::sync::Arc::new).collect();
    let tasks: Vec<_> = standbys
        .iter()
        .map(|s| {
            let s = s.clone();
            tokio::spawn(async move {
                let _ = s.leadership().await;
            })
        })
        .collect();
    // Let the standbys settle into their rhythm.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let x0 = crate::roles::xacts(observer).await?;
    let xt0 = Instant::now();
    let l0 = leader.lease_statements();
    let s0: Vec<u64> = standbys.iter().map(|s| s.lease_statements()).collect();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(window)).await;
    let el = t0.elapsed().as_secs_f64();
    let l1 = leader.lease_statements();
    let s1: Vec<u64> = standbys.iter().map(|s| s.lease_statements()).collect();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let x1 = crate::roles::xacts(observer).await?;
    // Both reads lag the other backends' flushes alike: the delta covers
    // about the time between the reads.
    let xel = xt0.elapsed().as_secs_f64();
    for t in &tasks {
        t.abort();
    }
    if l.is_lost() {
        return Err(format!(
            "the load leader lost its leadership: {:?}",
            l.loss_reason()
        ));
    }
    l.resign().await.map_err(|e| e.to_string())?;
    let standby =
        s1.iter().zip(&s0).map(|(b, a)| (b - a) as f64).sum::<f64>() / s0.len() as f64 / el;
    Ok(Load {
        leader: (l1 - l0) as f64 / el,
        standby,
        // Minus the two reads of the counter itself.
        xact_per_s: ((x1 - x0 - 2).max(0)) as f64 / xel,
    })
}

async fn crash_trial(
    via: &str,
    options: &ConnectOptions,
    role: &str,
    ttl: Duration,
    i: usize,
) -> Result<f64, String> {
    let ttl_ms = ttl.as_millis().to_string();
    let mut leader = ChildProc::spawn("lease-failover", &["leader", via, role, &ttl_ms])?;
    leader
        .expect("ELECTED", ttl * 3 + Duration::from_secs(30))
        .await?;
    let standby = builder(options.clone(), role, ttl)
        .node_id("bench-standby")
        .build()
        .map_err(|e| e.to_string())?;
    let wait = tokio::spawn(async move {
        let l = standby.leadership().await;
        (Instant::now(), l)
    });
    // Kill at a spread of points of the renewal cycle (ttl/3): a golden-
    // ratio sequence covers it evenly over the trials.
    let phase = (i as f64 * 0.618_033_988_75).fract();
    tokio::time::sleep(Duration::from_millis(200) + (ttl / 3).mul_f64(phase)).await;
    let t0 = Instant::now();
    leader.kill9()?;
    let (elected, l) = wait.await.map_err(|e| e.to_string())?;
    let l = l.map_err(|e| e.to_string())?;
    let ms = (elected - t0).as_secs_f64() * 1000.0;
    l.resign().await.map_err(|e| e.to_string())?;
    Ok(ms)
}

/// The hidden child mode: a lease leader that prints `ELECTED <term>` and
/// renews until killed.
fn child(args: &[String]) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        match args {
            [mode, url, role, ttl_ms] if mode == "leader" => {
                let ttl = Duration::from_millis(ttl_ms.parse().map_err(|_| "bad ttl")?);
                let options = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
                let e = builder(options, role, ttl)
                    .node_id(&format!("bench-leader-{}", std::process::id()))
                    .build()
                    .map_err(|e| e.to_string())?;
                let l = e.leadership().await.map_err(|e| e.to_string())?;
                println!("ELECTED {}", l.term());
                l.lost().await;
                Err(format!("leadership lost: {:?}", l.loss_reason()))
            }
            _ => Err(format!("lease-failover --child: bad arguments {args:?}")),
        }
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
