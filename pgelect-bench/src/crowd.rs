//! `crowd`: many blocking candidates of one role, each a process of its
//! own with the library's default timing: what they cost the database, and
//! whether failover after a SIGKILLed leader stays what it is with one
//! standby.
//!
//! Three series, each in a database of its own, in one run:
//!
//! * `1 standby`: two candidates (the baseline for failover);
//! * `N standbys`: `--candidates` (default 100) candidates of the default
//!   priority: the standbys queue for the role's watch key and only the
//!   watch waits in the role's lock queue and reads the row;
//! * `N standbys, observer each`: the same with every candidate at
//!   priority 1, which puts each standby in the role's lock queue with an
//!   observer connection of its own (how every blocking standby waited
//!   before the watch key); equal priorities never hand over.
//!
//! For each: connections to the database (`pg_stat_activity`) and
//! statements per second (`pg_stat_database` transactions, the observer's
//! own left out) over `--window` seconds (default 40: two wait slices;
//! standbys that started together re-issue their waits together), measured a wait slice (20 s)
//! after every standby waits (a backend reports its counts when it goes
//! idle, a waiting standby once per slice); then `--trials` times: the
//! leader is SIGKILLed and the time until another candidate prints that it
//! leads (handover delay 2.5 s included) is taken, and a new candidate
//! replaces the killed one.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pgelect::{ConnectOptions, Elector};

use crate::common::{connect, option_number, round2, Rows, Stats};
use crate::roles::unix_ns;

/// The library's default wait slice: counts are read one slice after the
/// standbys started waiting.
const WAIT_SLICE: Duration = Duration::from_secs(20);

/// Entry point: `crowd [--candidates N] [--trials N] [--window S] [--json]`.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let mut candidates = 100usize;
    let mut trials = 5usize;
    // Two wait slices: standbys that started together re-issue their
    // slices together, so a shorter window may hold none of them.
    let mut window = 40.0f64;
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut number = |option: &str, min: f64| option_number(&mut it, "crowd", option, min);
        match a.as_str() {
            "--candidates" => candidates = number("--candidates", 3.0)? as usize,
            "--trials" => trials = number("--trials", 1.0)? as usize,
            "--window" => window = number("--window", 1.0)?,
            "--json" => json = true,
            other => return Err(format!("crowd: unknown option {other:?}")),
        }
    }
    let (url, _cluster) = crate::database()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let series = [
        ("1 standby", 2, 0),
        ("standbys", candidates, 0),
        ("standbys, observer each", candidates, 1),
    ];
    let mut results = Vec::new();
    for (name, n, priority) in series {
        let name = if n == 2 {
            name.to_owned()
        } else {
            format!("{} {name}", n - 1)
        };
        let r = rt.block_on(measure(&url, &name, n, priority, trials, window))?;
        eprintln!(
            "crowd {name}: {} connections, {:.2} statements/s, failover p50 {:.0} ms",
            r.connections, r.statements_per_s, r.failover.p50
        );
        results.push(r);
    }
    println!("\none role, blocking candidates as processes, library defaults (ttl 15 s, handover delay 2.5 s); steady state over {window} s, {trials} SIGKILLs of the leader each");
    println!(
        "{:<32} {:>7} {:>14} {:>11} {:>11} {:>11}",
        "series", "conns", "statements/s", "p50 (ms)", "p99 (ms)", "max (ms)"
    );
    for r in &results {
        println!(
            "{:<32} {:>7} {:>14.2} {:>11.1} {:>11.1} {:>11.1}",
            r.name,
            r.connections,
            r.statements_per_s,
            r.failover.p50,
            r.failover.p99,
            r.failover.max
        );
    }
    println!(
        "(failover: SIGKILL of the leader until another candidate leads, handover delay included)"
    );
    if json {
        let mut figures = Rows::default();
        for r in &results {
            let scenario = format!("crowd/{}", r.name.replace(' ', "-").replace(',', ""));
            figures.push(&scenario, "connections", r.connections as f64, "count");
            figures.push(&scenario, "statements", r.statements_per_s, "1/s");
            figures.latency(&scenario, &r.samples);
        }
        let mut line = serde_json::json!({
            "bench": "crowd",
            "candidates": candidates,
            "trials": trials,
            "window_s": window,
            "timing": "library defaults (ttl 15 s, renew 5 s, heartbeat 1 s, check 5 s, wait slice 20 s, handover delay 2.5 s)",
            "method": "candidates are processes; connections from pg_stat_activity; statements = pg_stat_database xact_commit + xact_rollback delta in the series' own database, observer excluded, from a wait slice after every standby waits; failover = SIGKILL until another candidate's LED line (wall clock of this machine)",
            "results": results.iter().map(|r| serde_json::json!({
                "series": r.name,
                "connections": r.connections,
                "statements_per_s": round2(r.statements_per_s),
                "failover_ms": r.failover.json(),
            })).collect::<Vec<_>>(),
        });
        figures.attach(&mut line);
        println!("{line}");
    }
    Ok(())
}

struct Outcome {
    name: String,
    connections: i64,
    statements_per_s: f64,
    failover: Stats,
    samples: Vec<f64>,
}

/// A candidate process.
struct Candidate {
    child: Child,
}

impl Drop for Candidate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `LED` lines: (candidate index, unix ns).
type Led = (usize, u128);

fn spawn(
    url: &str,
    index: usize,
    priority: i32,
    tx: mpsc::Sender<Led>,
) -> Result<Candidate, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([
            "crowd",
            "--child",
            url,
            &format!("cand-{index}"),
            &priority.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot spawn a candidate: {e}"))?;
    let out = child.stdout.take().expect("BUG: piped stdout");
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let ns = l.strip_prefix("LED ").and_then(|t| t.trim().parse().ok());
            if let Some(ns) = ns {
                if tx.send((index, ns)).is_err() {
                    break;
                }
            }
        }
    });
    Ok(Candidate { child })
}

/// Waits until `n` sessions of the database wait for an advisory lock.
async fn until_waiting(c: &tokio_postgres::Client, n: i64, within: Duration) -> Result<(), String> {
    let end = Instant::now() + within;
    loop {
        let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
                  WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()",
                &[],
            )
            .await
            .map_err(|e| e.to_string())?
            .get(0);
        if waiting >= n {
            return Ok(());
        }
        if Instant::now() > end {
            return Err(format!(
                "only {waiting} of {n} standbys waiting after {within:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn measure(
    url: &str,
    name: &str,
    n: usize,
    priority: i32,
    trials: usize,
    window: f64,
) -> Result<Outcome, String> {
    let admin = connect(url).await?;
    let db = format!("bench_crowd_{n}_{priority}_{}", std::process::id());
    let db_url = crate::roles::fresh_database(&admin, url, &db).await?;
    let options = ConnectOptions::from_url(&db_url).map_err(|e| e.to_string())?;
    pgelect::migrate(&options)
        .await
        .map_err(|e| e.to_string())?;
    let observer = connect(&db_url).await?;
    let (tx, rx) = mpsc::channel();
    let mut procs: Vec<Option<Candidate>> = Vec::new();
    for i in 0..n {
        procs.push(Some(spawn(&db_url, i, priority, tx.clone())?));
    }
    let led = |within: Duration, after: u128| {
        tokio::task::block_in_place(|| {
            let end = Instant::now() + within;
            loop {
                let left = end.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok((i, ns)) if ns >= after => return Ok((i, ns)),
                    Ok(_) => {}
                    Err(_) => return Err(format!("{name}: nobody led within {within:?}")),
                }
            }
        })
    };
    let (mut leader, _) = led(Duration::from_secs(60), 0)?;
    until_waiting(&observer, n as i64 - 1, Duration::from_secs(120)).await?;
    tokio::time::sleep(WAIT_SLICE + Duration::from_secs(2)).await;
    let x0 = crate::roles::xacts(&observer).await?;
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(window)).await;
    let x1 = crate::roles::xacts(&observer).await?;
    let el = w0.elapsed().as_secs_f64();
    let connections: i64 = observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    // The observer's own: the clear and the read before the second read.
    let statements_per_s = (x1 - x0 - 2).max(0) as f64 / el;

    let mut samples = Vec::new();
    for _ in 0..trials {
        let killed_at = unix_ns();
        if let Some(mut c) = procs[leader].take() {
            c.child
                .kill()
                .map_err(|e| format!("cannot SIGKILL the leader: {e}"))?;
            let _ = c.child.wait();
        }
        let (next, ns) = led(Duration::from_secs(60), killed_at)?;
        samples.push((ns - killed_at) as f64 / 1e6);
        leader = next;
        // A new candidate takes the killed one's place in the queue.
        let i = procs.len();
        procs.push(Some(spawn(&db_url, i, priority, tx.clone())?));
        until_waiting(&observer, n as i64 - 1, Duration::from_secs(60)).await?;
    }
    drop(procs);
    drop(observer);
    let _ = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await;
    Ok(Outcome {
        name: name.to_owned(),
        connections,
        statements_per_s,
        failover: Stats::of(&samples),
        samples,
    })
}

/// The hidden child mode: one blocking candidate with the library's
/// defaults, printing `LED <unix ns>` at each leadership.
fn child(args: &[String]) -> Result<(), String> {
    let [url, node, priority] = args else {
        return Err(format!("crowd --child: bad arguments {args:?}"));
    };
    let priority: i32 = priority.parse().map_err(|_| "bad priority")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let options = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
        let e = Elector::builder(options, "crowd")
            .node_id(node)
            .priority(priority)
            .build()
            .map_err(|e| e.to_string())?;
        loop {
            let l = e.leadership().await.map_err(|e| e.to_string())?;
            {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "LED {}", unix_ns());
                let _ = out.flush();
            }
            l.lost().await;
        }
    })
}
