//! `failover`: how fast a standby takes over, next to the raw baseline.
//!
//! Three series, each over `--trials` runs (default 50), in one run and on
//! one server:
//!
//! * `baseline`: a bare connection blocked in `pg_advisory_lock` is granted
//!   the lock after the process holding it is SIGKILLed (time from the kill
//!   to the grant). This is what the server and the kernel cost.
//! * `crash`: a pgelect leader *process* is SIGKILLed; time until a pgelect
//!   standby in this process is told it leads. Includes the handover delay
//!   (the row still names the dead holder, so the takeover is unclean).
//! * `voluntary`: a leader resigns; time from the call until a blocked
//!   standby is told it leads (clean release: no handover delay).
//!
//! Targets: voluntary p99 ≤ 2 × baseline p99; crash p99 ≤ handover delay +
//! 2 × baseline p99.
//!
//! The child processes are this binary again, in a hidden mode:
//! `failover --child holder <url> <key>` and `failover --child leader <url> <role>`.

use crate::common::{connect, ChildProc, Stats};

use std::time::{Duration, Instant};

use pgelect::{ConnectOptions, Elector, LockKey};
use tokio_postgres::types::Type;

const ROLE: &str = "bench-failover";
const BASELINE_KEY: i64 = 0x5eed_f00d;

/// Timing shared by the leader processes and the standby: a fast heartbeat,
/// hence a short handover delay (`min(100 + 200, …) + 500 = 800 ms`).
fn builder(options: ConnectOptions) -> pgelect::ElectorBuilder {
    Elector::builder(options, ROLE)
        .ttl(Duration::from_secs(5))
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(Duration::from_millis(200))
}

/// Entry point: `failover [--trials N] [--json]`.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let mut trials = 50usize;
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
            "--json" => json = true,
            other => return Err(format!("failover: unknown option {other:?}")),
        }
    }
    let (url, _cluster) = crate::database()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(measure(&url, trials, json))
}

async fn measure(url: &str, trials: usize, json: bool) -> Result<(), String> {
    let options = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
    pgelect::migrate(&options)
        .await
        .map_err(|e| e.to_string())?;
    let handover = builder(options.clone())
        .build()
        .map_err(|e| e.to_string())?
        .handover_delay();
    let observer = connect(url).await?;
    let mut baseline = Vec::with_capacity(trials);
    let mut crash = Vec::with_capacity(trials);
    let mut voluntary = Vec::with_capacity(trials);
    // Alternate the series so that drift in the machine's load hits all.
    for i in 0..trials {
        baseline.push(baseline_trial(url, &observer).await?);
        crash.push(crash_trial(url, &options, &observer).await?);
        voluntary.push(voluntary_trial(&options, &observer).await?);
        if !json && (i + 1) % 10 == 0 {
            eprintln!("failover: {} of {trials} trials", i + 1);
        }
    }
    let b = Stats::of(&baseline);
    let c = Stats::of(&crash);
    let v = Stats::of(&voluntary);
    let voluntary_target = b.p99 * 2.0;
    let crash_target = handover.as_secs_f64() * 1000.0 + b.p99 * 2.0;
    let line = serde_json::json!({
        "bench": "failover",
        "trials": trials,
        "handover_delay_ms": handover.as_millis() as u64,
        "baseline_ms": b.json(),
        "crash_ms": c.json(),
        "voluntary_ms": v.json(),
        "targets": {
            "voluntary_p99_max_ms": voluntary_target,
            "voluntary_ok": v.p99 <= voluntary_target,
            "crash_p99_max_ms": crash_target,
            "crash_ok": c.p99 <= crash_target,
        },
    });
    if !json {
        println!("failover, {trials} trials, handover delay {handover:?}\n");
        println!(
            "{:<28} {:>10} {:>10} {:>10} {:>10}",
            "series (ms)", "p50", "p99", "min", "max"
        );
        for (name, s) in [
            ("baseline (bare lock, kill)", &b),
            ("crash (leader SIGKILLed)", &c),
            ("voluntary (resign)", &v),
        ] {
            println!(
                "{name:<28} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                s.p50, s.p99, s.min, s.max
            );
        }
        println!(
            "\ntargets: voluntary p99 {:.2} <= 2 x baseline p99 = {voluntary_target:.2}: {}",
            v.p99,
            if v.p99 <= voluntary_target {
                "met"
            } else {
                "MISSED"
            }
        );
        println!(
            "         crash p99 {:.2} <= handover {} + 2 x baseline p99 = {crash_target:.2}: {}\n",
            c.p99,
            handover.as_millis(),
            if c.p99 <= crash_target {
                "met"
            } else {
                "MISSED"
            }
        );
    }
    println!("{line}");
    Ok(())
}

/// Waits until some session waits for the advisory lock `key`.
async fn until_waiting(observer: &tokio_postgres::Client, key: i64) -> Result<(), String> {
    let (classid, objid) = (((key as u64) >> 32) as u32, key as u64 as u32);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let row = observer
            .query_typed_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
                   AND classid = $1 AND objid = $2 AND objsubid = 1",
                &[(&classid, Type::OID), (&objid, Type::OID)],
            )
            .await
            .map_err(|e| e.to_string())?;
        if row.get::<_, i64>(0) > 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("no waiter showed up within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn baseline_trial(url: &str, observer: &tokio_postgres::Client) -> Result<f64, String> {
    let mut holder = ChildProc::spawn("failover", &["holder", url, &BASELINE_KEY.to_string()])?;
    holder.expect("HELD", Duration::from_secs(30)).await?;
    let waiter = connect(url).await?;
    let wait = tokio::spawn(async move {
        let r = waiter
            .query_typed(
                "SELECT pg_advisory_lock($1)",
                &[(&BASELINE_KEY, Type::INT8)],
            )
            .await;
        (Instant::now(), r.map(|_| waiter))
    });
    until_waiting(observer, BASELINE_KEY).await?;
    let t0 = Instant::now();
    holder.kill9()?;
    let (granted, r) = wait.await.map_err(|e| e.to_string())?;
    let waiter = r.map_err(|e| e.to_string())?;
    let ms = (granted - t0).as_secs_f64() * 1000.0;
    waiter
        .query_typed(
            "SELECT pg_advisory_unlock($1)",
            &[(&BASELINE_KEY, Type::INT8)],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(ms)
}

fn role_key_single(e: &Elector) -> i64 {
    match e.lock_key() {
        LockKey::Single(k) => k,
        LockKey::Pair(..) => unreachable!("BUG: role keys are names, hashed to single keys"),
    }
}

async fn crash_trial(
    url: &str,
    options: &ConnectOptions,
    observer: &tokio_postgres::Client,
) -> Result<f64, String> {
    let mut leader = ChildProc::spawn("failover", &["leader", url, ROLE])?;
    leader.expect("ELECTED", Duration::from_secs(30)).await?;
    let standby = builder(options.clone())
        .node_id("bench-standby")
        .build()
        .map_err(|e| e.to_string())?;
    let key = role_key_single(&standby);
    let wait = tokio::spawn(async move {
        let l = standby.leadership().await;
        (Instant::now(), l)
    });
    until_waiting(observer, key).await?;
    let t0 = Instant::now();
    leader.kill9()?;
    let (elected, l) = wait.await.map_err(|e| e.to_string())?;
    let l = l.map_err(|e| e.to_string())?;
    let ms = (elected - t0).as_secs_f64() * 1000.0;
    l.resign().await.map_err(|e| e.to_string())?;
    Ok(ms)
}

async fn voluntary_trial(
    options: &ConnectOptions,
    observer: &tokio_postgres::Client,
) -> Result<f64, String> {
    let a = builder(options.clone())
        .node_id("bench-a")
        .build()
        .map_err(|e| e.to_string())?;
    let b = builder(options.clone())
        .node_id("bench-b")
        .build()
        .map_err(|e| e.to_string())?;
    let key = role_key_single(&b);
    let la = a.leadership().await.map_err(|e| e.to_string())?;
    let wait = tokio::spawn(async move {
        let l = b.leadership().await;
        (Instant::now(), l)
    });
    until_waiting(observer, key).await?;
    let t0 = Instant::now();
    la.resign().await.map_err(|e| e.to_string())?;
    let (elected, l) = wait.await.map_err(|e| e.to_string())?;
    let l = l.map_err(|e| e.to_string())?;
    let ms = (elected - t0).as_secs_f64() * 1000.0;
    l.resign().await.map_err(|e| e.to_string())?;
    Ok(ms)
}

/// The hidden child modes. They print one line when ready and then wait to
/// be killed.
fn child(args: &[String]) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        match args {
            [mode, url, key] if mode == "holder" => {
                let key: i64 = key.parse().map_err(|_| "bad key")?;
                let c = connect(url).await?;
                c.query_typed("SELECT pg_advisory_lock($1)", &[(&key, Type::INT8)])
                    .await
                    .map_err(|e| e.to_string())?;
                println!("HELD");
                std::future::pending::<()>().await;
                Ok(())
            }
            [mode, url, role] if mode == "leader" && role == ROLE => {
                let options = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
                let e = builder(options)
                    .node_id(&format!("bench-leader-{}", std::process::id()))
                    .build()
                    .map_err(|e| e.to_string())?;
                let l = e.leadership().await.map_err(|e| e.to_string())?;
                println!("ELECTED {}", l.term());
                l.lost().await;
                Err(format!("leadership lost: {:?}", l.loss_reason()))
            }
            _ => Err(format!("failover --child: bad arguments {args:?}")),
        }
    })
}
