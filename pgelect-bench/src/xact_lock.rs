//! `xact-lock`: `BEGIN; SELECT pg_advisory_xact_lock($1); COMMIT` in a loop
//! on one connection, through a bare tokio-postgres loop and through
//! pgelect's transaction-lock API.
//!
//! Both loops use the same statement style: `Client::transaction()`, an
//! unnamed statement through `query_typed` (what pgelect sends, and what a
//! pooler-safe application would send), and `commit()`. The variants run in
//! alternating rounds of equal length, so that drift in the machine's load
//! hits them alike; the table reports the median round's throughput and
//! latency percentiles over all operations of a variant.

use std::time::{Duration, Instant};

use pgelect::LockKey;
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::common::{connect, Rows};

/// The figure to reach: pgelect's `xact_lock` at 90% of the bare loop.
const TARGET_RATIO: f64 = 0.9;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Bare,
    Pgelect,
    PgelectTimeout,
}

impl Variant {
    const ALL: [Variant; 3] = [Variant::Bare, Variant::Pgelect, Variant::PgelectTimeout];

    fn label(self) -> &'static str {
        match self {
            Variant::Bare => "bare tokio-postgres",
            Variant::Pgelect => "pgelect xact_lock",
            Variant::PgelectTimeout => "pgelect xact_lock_timeout",
        }
    }

    fn json_name(self) -> &'static str {
        match self {
            Variant::Bare => "bare",
            Variant::Pgelect => "pgelect",
            Variant::PgelectTimeout => "pgelect_timeout",
        }
    }
}

struct Options {
    seconds: f64,
    rounds: u32,
    json: bool,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        seconds: 12.0,
        rounds: 4,
        json: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value"))
                .cloned()
        };
        match a.as_str() {
            "--seconds" => {
                let v = value("--seconds")?;
                o.seconds = v
                    .parse()
                    .ok()
                    .filter(|s: &f64| *s > 0.0 && s.is_finite())
                    .ok_or_else(|| format!("--seconds {v:?}: expected a positive number"))?;
            }
            "--rounds" => {
                let v = value("--rounds")?;
                o.rounds = v
                    .parse()
                    .ok()
                    .filter(|r| *r > 0)
                    .ok_or_else(|| format!("--rounds {v:?}: expected a positive integer"))?;
            }
            "--json" => o.json = true,
            other => {
                return Err(format!(
                    "xact-lock: unknown option {other:?} (options: --seconds N, --rounds N, --json)"
                ))
            }
        }
    }
    Ok(o)
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let options = parse(args)?;
    let (url, _cluster) = crate::database()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build the runtime: {e}"))?;
    runtime.block_on(bench(&url, &options))
}

async fn one_op(client: &mut Client, variant: Variant, key: i64) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", variant.label());
    let tx = client.transaction().await.map_err(|e| err(&e))?;
    match variant {
        Variant::Bare => {
            tx.query_typed(
                "SELECT pg_advisory_xact_lock($1::int8)",
                &[(&key, Type::INT8)],
            )
            .await
            .map_err(|e| err(&e))?;
        }
        Variant::Pgelect => pgelect::lock::xact_lock(&tx, LockKey::from_i64(key))
            .await
            .map_err(|e| err(&e))?,
        Variant::PgelectTimeout => {
            pgelect::lock::xact_lock_timeout(&tx, LockKey::from_i64(key), Duration::from_secs(5))
                .await
                .map_err(|e| err(&e))?
        }
    }
    tx.commit().await.map_err(|e| err(&e))
}

/// Runs `variant` for `length`; returns ops/s and per-op latencies (ns).
async fn round(
    client: &mut Client,
    variant: Variant,
    length: Duration,
    latencies: &mut Vec<u64>,
) -> Result<f64, String> {
    let key = 0x7067_656c_6563_7400_i64; // "pgelect\0"
    let started = Instant::now();
    let mut ops = 0u64;
    while started.elapsed() < length {
        let t = Instant::now();
        one_op(client, variant, key).await?;
        latencies.push(t.elapsed().as_nanos() as u64);
        ops += 1;
    }
    Ok(ops as f64 / started.elapsed().as_secs_f64())
}

struct Summary {
    variant: Variant,
    ops_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    ops: usize,
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

async fn bench(url: &str, options: &Options) -> Result<(), String> {
    let mut client = connect(url).await?;
    let server_version: String = client
        .query_typed_one("SHOW server_version", &[])
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let per_round = Duration::from_secs_f64(
        options.seconds / (options.rounds as f64 * Variant::ALL.len() as f64),
    );

    // Warm-up: connection, plans, caches.
    for v in Variant::ALL {
        round(&mut client, v, Duration::from_millis(300), &mut Vec::new()).await?;
    }
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); Variant::ALL.len()];
    let mut latencies: Vec<Vec<u64>> = vec![Vec::new(); Variant::ALL.len()];
    for r in 0..options.rounds {
        // Rotate the order so that no variant always runs first.
        let order: [usize; 3] = [0, 1, 2].map(|i| (i + r as usize) % 3);
        for i in order {
            let rate = round(&mut client, Variant::ALL[i], per_round, &mut latencies[i]).await?;
            rates[i].push(rate);
        }
    }
    let summaries: Vec<Summary> = Variant::ALL
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let lat = &mut latencies[i];
            lat.sort_unstable();
            Summary {
                variant: *v,
                ops_per_sec: median(&mut rates[i]),
                p50_us: percentile(lat, 0.50),
                p99_us: percentile(lat, 0.99),
                ops: lat.len(),
            }
        })
        .collect();
    let bare = summaries[0].ops_per_sec;
    let ratio = summaries[1].ops_per_sec / bare;
    let ratio_timeout = summaries[2].ops_per_sec / bare;

    if !options.json {
        println!(
            "xact-lock: BEGIN; SELECT pg_advisory_xact_lock($1); COMMIT on one connection \
             (PostgreSQL {server_version}), {} rounds x {:.2?} per variant, alternating",
            options.rounds, per_round
        );
        println!(
            "{:<28} {:>14} {:>10} {:>10} {:>9} {:>7}",
            "variant", "ops/s median", "p50 µs", "p99 µs", "ops", "ratio"
        );
        for s in &summaries {
            println!(
                "{:<28} {:>14.0} {:>10.1} {:>10.1} {:>9} {:>7.3}",
                s.variant.label(),
                s.ops_per_sec,
                s.p50_us,
                s.p99_us,
                s.ops,
                s.ops_per_sec / bare
            );
        }
        let verdict = |r: f64| if r >= TARGET_RATIO { "met" } else { "NOT met" };
        println!(
            "pgelect xact_lock / bare = {ratio:.3} (target >= {TARGET_RATIO}: {}); \
             xact_lock_timeout / bare = {ratio_timeout:.3} (target >= {TARGET_RATIO}: {})",
            verdict(ratio),
            verdict(ratio_timeout)
        );
    }
    let mut json = serde_json::json!({
        "bench": "xact-lock",
        "server_version": server_version,
        "rounds": options.rounds,
        "seconds_per_round": per_round.as_secs_f64(),
        "ratio": ratio,
        "ratio_timeout": ratio_timeout,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio >= TARGET_RATIO && ratio_timeout >= TARGET_RATIO,
    });
    let mut figures = Rows::default();
    for s in &summaries {
        let scenario = format!("xact-lock/{}", s.variant.json_name());
        figures.push(&scenario, "throughput", s.ops_per_sec, "ops/s");
        figures.push(&scenario, "p50", s.p50_us, "us");
        figures.push(&scenario, "p99", s.p99_us, "us");
        figures.push(&scenario, "ratio_to_bare", s.ops_per_sec / bare, "x");
    }
    figures.attach(&mut json);
    for s in &summaries {
        json[s.variant.json_name()] = serde_json::json!({
            "ops_per_sec": s.ops_per_sec,
            "p50_us": s.p50_us,
            "p99_us": s.p99_us,
            "ops": s.ops,
        });
    }
    println!("{json}");
    Ok(())
}
