//! `failover`: how fast a standby takes over, per timing profile, next to
//! the raw baseline, and what each profile costs the database.
//!
//! The series (`--series a,b,…` picks some; default: all), each over
//! `--trials` runs (default 50), in one run and on one server, the trials
//! of the series interleaved so that drift in the machine's load hits all:
//!
//! * `baseline`: a bare connection blocked in `pg_advisory_lock` is granted
//!   the lock after the process holding it is SIGKILLed (time from the kill
//!   to the grant). This is what the server and the kernel cost.
//! * `crash-default`, `crash-standard-2s`, `crash-fast`: a pgelect leader
//!   *process* is SIGKILLed; time until a pgelect standby in this process is
//!   told it leads. Includes the handover delay (the row still names the
//!   dead holder, so the takeover is unclean). Leader and standby share the
//!   timing of the series: the library defaults (standard profile, TTL
//!   15 s: handover delay 2.5 s); the standard profile at TTL 2 s (400 ms);
//!   the fast profile at the default TTL (70 ms; the TTL plays no part in a
//!   crash, which closes the socket).
//! * `voluntary`: a leader (library defaults) resigns; time from the call
//!   until a blocked standby is told it leads (clean release: no handover
//!   delay).
//! * `voluntary-polling`: the same with a polling standby on its own
//!   connection (`StandbyMode::Polling`, every second), woken by the
//!   release's announcement.
//! * `statements`: the statements per second a leader of each of the three
//!   timings sends at steady state, alone in the database, over `--window`
//!   seconds (default 15: three renewals at the default TTL); see
//!   [`statements_per_s`] for the method.
//!
//! A trial whose leader had already lost its leadership when it was killed
//! (possible with the fast profile's 25 ms heartbeat timeout on a loaded
//! machine: the standby then wins without a crash) measures nothing and is
//! run again; the output counts these as `discarded`.
//!
//! Targets: voluntary p99 ≤ 2 × baseline p99; every crash p99 ≤ its handover
//! delay + 2 × baseline p99; the fast profile's crash p99 ≤ 100 ms.
//!
//! The child processes are this binary again, in a hidden mode:
//! `failover --child holder <url> <key>` and
//! `failover --child leader <url> <timing>`.

use crate::common::{connect, round2, ChildProc, Rows, Stats};

use std::time::{Duration, Instant};

use pgelect::{
    election::{Profile, StandbyMode},
    ConnectOptions, Elector, LockKey,
};
use tokio_postgres::types::Type;

const ROLE: &str = "bench-failover";
const BASELINE_KEY: i64 = 0x5eed_f00d;
/// The fast profile's crash failover target.
const FAST_CRASH_P99_TARGET_MS: f64 = 100.0;

/// The timings compared; leader and standby of a trial share one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timing {
    /// The library defaults: standard profile, TTL 15 s.
    Default,
    /// The standard profile at TTL 2 s.
    Standard2s,
    /// The fast profile (default TTL).
    Fast,
}

impl Timing {
    const ALL: [Timing; 3] = [Timing::Default, Timing::Standard2s, Timing::Fast];

    /// The name in the JSON line and the child's arguments.
    fn name(self) -> &'static str {
        match self {
            Timing::Default => "default",
            Timing::Standard2s => "standard-2s",
            Timing::Fast => "fast",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Timing::Default => "default (ttl 15 s)",
            Timing::Standard2s => "standard, ttl 2 s",
            Timing::Fast => "fast",
        }
    }

    fn builder(self, options: ConnectOptions) -> pgelect::ElectorBuilder {
        let b = Elector::builder(options, ROLE);
        match self {
            Timing::Default => b,
            Timing::Standard2s => b
                .session(|s| s.profile(Profile::Standard))
                .ttl(Duration::from_secs(2)),
            Timing::Fast => b.session(|s| s.profile(Profile::Fast)),
        }
    }

    fn report(self, options: &ConnectOptions) -> Result<pgelect::election::TimingReport, String> {
        Ok(self
            .builder(options.clone())
            .build()
            .map_err(|e| e.to_string())?
            .timing())
    }
}

/// What one run can measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Series {
    Baseline,
    Crash(Timing),
    Voluntary,
    /// As `Voluntary`, with a polling standby.
    VoluntaryPolling,
    /// A candidate of higher priority starts standing while a leader acts;
    /// the leader hands over to it: time from its first `leadership()`
    /// call (its connection set-up included) until it is told it leads.
    Preferred,
    Statements,
}

impl Series {
    const ALL: [Series; 8] = [
        Series::Baseline,
        Series::Crash(Timing::Default),
        Series::Crash(Timing::Standard2s),
        Series::Crash(Timing::Fast),
        Series::Voluntary,
        Series::VoluntaryPolling,
        Series::Preferred,
        Series::Statements,
    ];

    fn name(self) -> &'static str {
        match self {
            Series::Baseline => "baseline",
            Series::Crash(Timing::Default) => "crash-default",
            Series::Crash(Timing::Standard2s) => "crash-standard-2s",
            Series::Crash(Timing::Fast) => "crash-fast",
            Series::Voluntary => "voluntary",
            Series::VoluntaryPolling => "voluntary-polling",
            Series::Preferred => "preferred",
            Series::Statements => "statements",
        }
    }

    fn parse_list(list: &str) -> Result<Vec<Series>, String> {
        let names: Vec<&str> = Series::ALL.iter().map(|s| s.name()).collect();
        let mut out = Vec::new();
        for want in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let s = Series::ALL
                .into_iter()
                .find(|s| s.name() == want)
                .ok_or_else(|| {
                    format!(
                        "--series: unknown series {want:?}; expected some of {}",
                        names.join(",")
                    )
                })?;
            if !out.contains(&s) {
                out.push(s);
            }
        }
        if out.is_empty() {
            return Err(format!("--series needs a list, e.g. {}", names.join(",")));
        }
        Ok(out)
    }
}

/// Entry point: `failover [--trials N] [--series a,b] [--window S] [--json]`.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let mut trials = 50usize;
    let mut json = false;
    let mut series = Series::ALL.to_vec();
    let mut window = 15.0f64;
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
            "--series" => series = Series::parse_list(it.next().ok_or("--series needs a list")?)?,
            "--window" => {
                window = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|x: &f64| *x >= 1.0)
                    .ok_or("--window needs a number of seconds, at least 1")?
            }
            "--json" => json = true,
            other => return Err(format!("failover: unknown option {other:?}")),
        }
    }
    let (url, cluster) = crate::database()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    if let (Some(cluster), true) = (&cluster, series.contains(&Series::Statements)) {
        // pg_stat_statements must be preloaded: only possible (and only
        // done) on the throwaway cluster, which is restarted for it before
        // anything is measured.
        rt.block_on(async {
            connect(&url)
                .await?
                .batch_execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
                .await
                .map_err(|e| format!("cannot preload pg_stat_statements: {e}"))
        })?;
        cluster
            .restart()
            .map_err(|e| format!("cannot restart the throwaway cluster: {e}"))?;
    }
    rt.block_on(measure(&url, &series, trials, window, json))
}

/// The series' samples and the trials thrown away.
#[derive(Default)]
struct Samples {
    ms: Vec<f64>,
    discarded: usize,
}

impl Samples {
    fn json(&self) -> serde_json::Value {
        let mut v = Stats::of(&self.ms).json();
        v["discarded"] = self.discarded.into();
        v
    }
}

async fn measure(
    url: &str,
    series: &[Series],
    trials: usize,
    window: f64,
    json: bool,
) -> Result<(), String> {
    let started = Instant::now();
    let load_before = load_average();
    let options = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
    pgelect::migrate(&options)
        .await
        .map_err(|e| e.to_string())?;
    let observer = connect(url).await?;
    let timed: Vec<Series> = series
        .iter()
        .copied()
        .filter(|s| *s != Series::Statements)
        .collect();
    let mut samples: Vec<Samples> = timed.iter().map(|_| Samples::default()).collect();
    // Interleave the series so that drift in the machine's load hits all.
    for i in 0..trials {
        for (s, out) in timed.iter().zip(samples.iter_mut()) {
            // A trial that measured nothing (see the module docs) is run
            // again, a bounded number of times.
            let ms = loop {
                let r = match s {
                    Series::Baseline => Some(baseline_trial(url, &observer).await?),
                    Series::Crash(t) => crash_trial(url, &options, &observer, *t).await?,
                    Series::Voluntary => Some(voluntary_trial(&options, &observer, false).await?),
                    Series::VoluntaryPolling => {
                        Some(voluntary_trial(&options, &observer, true).await?)
                    }
                    Series::Preferred => Some(preferred_trial(&options).await?),
                    Series::Statements => unreachable!("BUG: not a timed series"),
                };
                match r {
                    Some(ms) => break ms,
                    None if out.discarded < trials => out.discarded += 1,
                    None => {
                        return Err(format!(
                            "{}: {} trials measured nothing (the leader had lost its leadership before the kill)",
                            s.name(),
                            out.discarded + 1
                        ))
                    }
                }
            };
            out.ms.push(ms);
        }
        if !json && (i + 1) % 10 == 0 {
            eprintln!(
                "failover: {} of {trials} trials ({:.0} s)",
                i + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    let mut rates = Vec::new();
    if series.contains(&Series::Statements) {
        for t in Timing::ALL {
            rates.push((t, statements_per_s(&options, &observer, t, window).await?));
        }
    }
    let load_after = load_average();

    let by = |want: Series| timed.iter().position(|s| *s == want).map(|i| &samples[i]);
    let baseline = by(Series::Baseline).map(|s| Stats::of(&s.ms));
    let mut line = serde_json::json!({
        "bench": "failover",
        "trials": trials,
        "series": series.iter().map(|s| s.name()).collect::<Vec<_>>(),
        "load_average": { "before": load_before, "after": load_after },
        "seconds": round2(started.elapsed().as_secs_f64()),
    });
    let mut targets = serde_json::Map::new();
    if let Some(s) = by(Series::Baseline) {
        line["baseline_ms"] = s.json();
    }
    let mut crash = serde_json::Map::new();
    for t in Timing::ALL {
        if let Some(s) = by(Series::Crash(t)) {
            let report = t.report(&options)?;
            let st = Stats::of(&s.ms);
            crash.insert(
                t.name().into(),
                serde_json::json!({ "timing": report.to_json(), "ms": s.json() }),
            );
            if let Some(b) = &baseline {
                let max = report.handover_delay.as_secs_f64() * 1000.0 + 2.0 * b.p99;
                targets.insert(format!("crash_{}_p99_max_ms", t.name()), round2(max).into());
                targets.insert(format!("crash_{}_ok", t.name()), (st.p99 <= max).into());
            }
            if t == Timing::Fast {
                targets.insert(
                    "crash_fast_p99_max_ms_absolute".into(),
                    FAST_CRASH_P99_TARGET_MS.into(),
                );
                targets.insert(
                    "crash_fast_absolute_ok".into(),
                    (st.p99 <= FAST_CRASH_P99_TARGET_MS).into(),
                );
            }
        }
    }
    if !crash.is_empty() {
        line["crash"] = crash.into();
    }
    if let Some(s) = by(Series::Preferred) {
        line["preferred_ms"] = s.json();
    }
    if let Some(s) = by(Series::VoluntaryPolling) {
        line["voluntary_polling_ms"] = s.json();
    }
    if let Some(s) = by(Series::Voluntary) {
        line["voluntary_ms"] = s.json();
        if let Some(b) = &baseline {
            let max = 2.0 * b.p99;
            targets.insert("voluntary_p99_max_ms".into(), round2(max).into());
            targets.insert("voluntary_ok".into(), (Stats::of(&s.ms).p99 <= max).into());
        }
    }
    if !rates.is_empty() {
        let mut m = serde_json::Map::new();
        for (t, r) in &rates {
            m.insert(t.name().into(), r.json(&t.report(&options)?));
        }
        line["statements_per_s"] = m.into();
    }
    if !targets.is_empty() {
        line["targets"] = targets.clone().into();
    }
    let mut rows = Rows::default();
    for (s, smp) in timed.iter().zip(&samples) {
        rows.latency(&format!("failover/{}", s.name()), &smp.ms);
    }
    for (t, r) in &rates {
        if let Some(per_s) = r.per_s {
            rows.push(
                &format!("failover/leader-{}", t.name()),
                "statements",
                per_s,
                "1/s",
            );
        }
    }
    rows.attach(&mut line);

    if !json {
        println!(
            "failover, {trials} trials, load average {load_before} before, {load_after} after, {:.0} s\n",
            started.elapsed().as_secs_f64()
        );
        println!(
            "{:<32} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "series (ms)", "handover", "p50", "p99", "min", "max", "discarded"
        );
        for (s, smp) in timed.iter().zip(&samples) {
            let st = Stats::of(&smp.ms);
            let (label, handover) = match s {
                Series::Baseline => ("baseline (bare lock, kill)".to_owned(), "-".to_owned()),
                Series::Crash(t) => (
                    format!("crash, {}", t.label()),
                    // Rounded, not truncated: ttl/15 at 2 s is 133.3 ms, so
                    // the delay is 399.99… ms.
                    format!(
                        "{:.0}",
                        t.report(&options)?.handover_delay.as_secs_f64() * 1000.0
                    ),
                ),
                Series::Voluntary => ("voluntary (resign, default)".to_owned(), "-".to_owned()),
                Series::VoluntaryPolling => {
                    ("voluntary, polling standby".to_owned(), "-".to_owned())
                }
                Series::Preferred => ("preferred (priority 1 joins)".to_owned(), "-".to_owned()),
                Series::Statements => unreachable!("BUG: not a timed series"),
            };
            println!(
                "{label:<32} {handover:>9} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9}",
                st.p50, st.p99, st.min, st.max, smp.discarded
            );
        }
        if !rates.is_empty() {
            println!(
                "\nleader statements per second at steady state ({window} s window, pg_stat_statements)"
            );
            println!(
                "{:<32} {:>9} {:>9} {:>12}  by statement",
                "timing", "heartbeat", "renew", "statements/s"
            );
            for (t, r) in &rates {
                let report = t.report(&options)?;
                match &r.per_s {
                    Some(per_s) => println!(
                        "{:<32} {:>9} {:>9} {:>12.2}  {}",
                        t.label(),
                        format!("{} ms", report.heartbeat.as_millis()),
                        format!("{} ms", report.renew_every.as_millis()),
                        per_s,
                        r.breakdown()
                    ),
                    None => println!(
                        "{:<32} not measured: {}",
                        t.label(),
                        r.note.as_deref().unwrap_or("?")
                    ),
                }
            }
        }
        if !targets.is_empty() {
            println!("\ntargets:");
            let ok = |k: &str| match targets.get(k).and_then(|v| v.as_bool()) {
                Some(true) => "met",
                _ => "MISSED",
            };
            if let (Some(b), Some(v)) = (&baseline, by(Series::Voluntary)) {
                println!(
                    "  voluntary p99 {:.2} <= 2 x baseline p99 = {:.2}: {}",
                    Stats::of(&v.ms).p99,
                    2.0 * b.p99,
                    ok("voluntary_ok")
                );
            }
            for t in Timing::ALL {
                let (Some(b), Some(c)) = (&baseline, by(Series::Crash(t))) else {
                    continue;
                };
                let handover = t.report(&options)?.handover_delay.as_secs_f64() * 1000.0;
                println!(
                    "  crash, {} p99 {:.2} <= handover {handover:.0} + 2 x baseline p99 = {:.2}: {}",
                    t.label(),
                    Stats::of(&c.ms).p99,
                    handover + 2.0 * b.p99,
                    ok(&format!("crash_{}_ok", t.name()))
                );
            }
            if let Some(c) = by(Series::Crash(Timing::Fast)) {
                println!(
                    "  crash, fast p99 {:.2} <= {FAST_CRASH_P99_TARGET_MS}: {}",
                    Stats::of(&c.ms).p99,
                    ok("crash_fast_absolute_ok")
                );
            }
        }
        println!();
    }
    println!("{line}");
    Ok(())
}

/// The 1-, 5- and 15-minute load averages (Linux), for the record: the
/// numbers depend on how busy the machine was.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
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

/// Waits until the polling standby `bench-b` has polled once (it listens
/// for releases before its first poll).
async fn until_polled(observer: &tokio_postgres::Client) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let row = observer
            .query_typed_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE '%bench-b%'
                   AND state = 'idle' AND query LIKE '%pg_try_advisory_lock%'",
                &[],
            )
            .await
            .map_err(|e| e.to_string())?;
        if row.get::<_, i64>(0) > 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("the polling standby did not poll within 30 s".into());
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

/// One crash: `None` if the leader had lost its leadership before the kill
/// (it said `LOST`, or the standby was elected before the kill).
async fn crash_trial(
    url: &str,
    options: &ConnectOptions,
    observer: &tokio_postgres::Client,
    timing: Timing,
) -> Result<Option<f64>, String> {
    let mut leader = ChildProc::spawn("failover", &["leader", url, timing.name()])?;
    leader.expect("ELECTED", Duration::from_secs(30)).await?;
    let standby = timing
        .builder(options.clone())
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
    l.resign().await.map_err(|e| e.to_string())?;
    let lost_first = leader.wait_lines()?.iter().any(|l| l.starts_with("LOST"));
    if lost_first || elected < t0 {
        return Ok(None);
    }
    Ok(Some((elected - t0).as_secs_f64() * 1000.0))
}

async fn voluntary_trial(
    options: &ConnectOptions,
    observer: &tokio_postgres::Client,
    polling: bool,
) -> Result<f64, String> {
    let a = Timing::Default
        .builder(options.clone())
        .node_id("bench-a")
        .build()
        .map_err(|e| e.to_string())?;
    let mut b = Timing::Default.builder(options.clone()).node_id("bench-b");
    if polling {
        let interval = Duration::from_secs(1);
        b = b.session(|s| s.standby(StandbyMode::Polling { interval }));
    }
    let b = b.build().map_err(|e| e.to_string())?;
    let key = role_key_single(&b);
    let la = a.leadership().await.map_err(|e| e.to_string())?;
    let wait = tokio::spawn(async move {
        let l = b.leadership().await;
        (Instant::now(), l)
    });
    match polling {
        true => until_polled(observer).await?,
        false => until_waiting(observer, key).await?,
    }
    let t0 = Instant::now();
    la.resign().await.map_err(|e| e.to_string())?;
    let (elected, l) = wait.await.map_err(|e| e.to_string())?;
    let l = l.map_err(|e| e.to_string())?;
    let ms = (elected - t0).as_secs_f64() * 1000.0;
    l.resign().await.map_err(|e| e.to_string())?;
    Ok(ms)
}

/// A leader of priority 0 acts (and hands over cleanly when told, as
/// `Elector::run` does); a candidate of priority 1 starts standing. Time
/// from its `leadership()` call until it is told it leads.
async fn preferred_trial(options: &ConnectOptions) -> Result<f64, String> {
    let a = Timing::Default
        .builder(options.clone())
        .node_id("bench-a")
        .build()
        .map_err(|e| e.to_string())?;
    let b = Timing::Default
        .builder(options.clone())
        .node_id("bench-preferred")
        .priority(1)
        .build()
        .map_err(|e| e.to_string())?;
    let la = a.leadership().await.map_err(|e| e.to_string())?;
    let hand_over = tokio::spawn(async move {
        la.lost().await;
        let reason = la.loss().map(|l| l.reason());
        let _ = la.resign().await;
        (a, reason)
    });
    let t0 = Instant::now();
    let lb = b.leadership().await.map_err(|e| e.to_string())?;
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    let (a, reason) = hand_over.await.map_err(|e| e.to_string())?;
    if reason != Some(pgelect::loss::LossReason::HandedOver) {
        return Err(format!(
            "the leader lost leadership as {reason:?}, not HandedOver"
        ));
    }
    lb.resign().await.map_err(|e| e.to_string())?;
    b.withdraw().await.map_err(|e| e.to_string())?;
    a.withdraw().await.map_err(|e| e.to_string())?;
    Ok(ms)
}

/// A leader's statements per second, in total and per statement text.
struct Rate {
    per_s: Option<f64>,
    by_statement: Vec<(String, f64)>,
    window_s: f64,
    note: Option<String>,
}

impl Rate {
    fn json(&self, timing: &pgelect::election::TimingReport) -> serde_json::Value {
        serde_json::json!({
            "timing": timing.to_json(),
            "per_s": self.per_s.map(round2),
            "window_s": round2(self.window_s),
            "method": "pg_stat_statements, calls in this database during the window, the observer's own statements excluded; leader alone",
            "by_statement": self.by_statement.iter()
                .map(|(q, r)| serde_json::json!({ "query": q, "per_s": round2(*r) }))
                .collect::<Vec<_>>(),
            "note": self.note,
        })
    }

    /// Per statement, for the table: its text cut at 40 characters (the
    /// JSON line has it whole).
    fn breakdown(&self) -> String {
        self.by_statement
            .iter()
            .map(|(q, r)| {
                let short: String = q.chars().take(40).collect();
                let more = if q.chars().count() > 40 { "…" } else { "" };
                format!("{r:.2} \"{short}{more}\"")
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The statements per second a leader with `timing` sends at steady state.
///
/// Method: the server counts them. `pg_stat_statements` (preloaded on the
/// throwaway cluster by [`run`]) counts every top-level statement a client
/// sends, utility statements such as `BEGIN` included, by statement text
/// and database. The leader runs alone (no standby, no other candidate:
/// this measures the leader's cost, not the election's), settles for a
/// second, the counters are reset, and after `window` seconds the calls in
/// this database are summed, leaving out the observer's own statements
/// (the reset and the read, the only ones that name `pg_stat_statements`;
/// the observer sends nothing else meanwhile). A statement in flight at
/// either end of the window counts or not: ±1 per window. Against a
/// database the benchmark does not own, whatever else runs there counts
/// too, and without the extension the rate is not measured (the output
/// says why).
async fn statements_per_s(
    options: &ConnectOptions,
    observer: &tokio_postgres::Client,
    timing: Timing,
    window: f64,
) -> Result<Rate, String> {
    if let Err(e) = observer
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await
    {
        return Ok(Rate {
            per_s: None,
            by_statement: Vec::new(),
            window_s: 0.0,
            note: Some(format!("pg_stat_statements unavailable: {e}")),
        });
    }
    let e = timing
        .builder(options.clone())
        .node_id("bench-rate")
        .build()
        .map_err(|e| e.to_string())?;
    let l = e.leadership().await.map_err(|e| e.to_string())?;
    // Steady state: the election's own statements and the connections of
    // earlier trials closing are behind us.
    tokio::time::sleep(Duration::from_secs(1)).await;
    observer
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .map_err(|e| format!("cannot reset pg_stat_statements: {e}"))?;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(window)).await;
    let rows = observer
        .query_typed(
            "SELECT query, sum(calls)::bigint FROM pg_stat_statements
              WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND query NOT LIKE '%pg_stat_statements%'
              GROUP BY query ORDER BY 2 DESC",
            &[],
        )
        .await
        .map_err(|e| format!("cannot read pg_stat_statements: {e}"))?;
    let el = t0.elapsed().as_secs_f64();
    let lost = l.loss().map(|l| l.reason());
    l.resign().await.map_err(|e| e.to_string())?;
    let by_statement: Vec<(String, f64)> = rows
        .iter()
        .map(|r| {
            let q: String = r.get(0);
            let n: i64 = r.get(1);
            (
                q.split_whitespace().collect::<Vec<_>>().join(" "),
                n as f64 / el,
            )
        })
        .collect();
    let total = by_statement.iter().map(|(_, r)| r).sum();
    Ok(Rate {
        per_s: Some(total),
        by_statement,
        window_s: el,
        // A leader that lost its leadership in the window stood again, so
        // the count mixes leading and standing: say so.
        note: lost.map(|r| format!("the leader lost its leadership in the window ({r:?})")),
    })
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
            [mode, url, timing] if mode == "leader" => {
                let timing = Timing::ALL
                    .into_iter()
                    .find(|t| t.name() == timing)
                    .ok_or_else(|| format!("unknown timing {timing:?}"))?;
                let options = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
                let e = timing
                    .builder(options)
                    .node_id(&format!("bench-leader-{}", std::process::id()))
                    .build()
                    .map_err(|e| e.to_string())?;
                let l = e.leadership().await.map_err(|e| e.to_string())?;
                println!("ELECTED {}", l.term());
                l.lost().await;
                // The parent discards the trial when it reads this.
                println!("LOST {:?}", l.loss().map(|l| l.reason()));
                Err(format!(
                    "leadership lost: {:?}",
                    l.loss().map(|l| l.reason())
                ))
            }
            _ => Err(format!("failover --child: bad arguments {args:?}")),
        }
    })
}
