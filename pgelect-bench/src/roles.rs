//! `roles`: many roles over a few candidate processes, each candidate on one
//! [`SharedConnection`]: what they cost the database and themselves, and how
//! fast they take every role, at the start and after a SIGKILL.
//!
//! For every count of `--count` (default `1,100,1000,10000`), in a database
//! of its own: `--candidates` processes (default 3; this binary again:
//! `roles --child <url> <node> <count>`) each stand for every role
//! (`part-0` … `part-<count-1>`), in role order from their own offset, and
//! print `LED <role> <unix ns>` when told they lead (after the handover
//! delay, where there is one). Then:
//!
//! * `start`: from the spawn of the processes until every role is led;
//! * steady state, 5 s after that, for `--window` seconds (default 10):
//!   connections to the database (`pg_stat_activity`), statements per
//!   second (`pg_stat_database`: committed and rolled-back transactions in
//!   that database, the observer's own left out; every statement pgelect
//!   sends outside an explicit transaction is one), and each candidate's CPU
//!   (`/proc/<pid>/stat`, user + system) and RSS (`/proc/<pid>/status`);
//! * `after SIGKILL`: the candidate leading the most roles is SIGKILLed;
//!   from the kill until every one of its roles is led by another
//!   candidate (their `LED` lines, on the same machine's clock).
//!
//! With `--backend lease` (default `session`) the candidates use the lease
//! backend, each process on one [`SharedLease`] (batched renewals,
//! acquires and registrations), with the library's lease defaults (ttl
//! 15 s, renewals every 5 s, standbys polling at least every second): a
//! killed candidate's roles are taken over once their leases expired,
//! within about a TTL.
//!
//! Timing: the library defaults (ttl 15 s, renewals every 5 s, heartbeats
//! every second, handover delay 2.5 s), standbys polling every second (the
//! default is `renew_every`), TCP timeouts of the shared connection
//! raised to fit the default TTL (keepalive after 10 s idle, user timeout
//! 15 s).

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pgelect::{
    conn::TcpTimeouts, election::Backend, election::SharedConnection, election::SharedLease,
    election::StandbyMode, ConnectOptions, Elector,
};

use crate::common::{connect, round2, Rows};

/// How often standbys poll in this benchmark.
const POLL: Duration = Duration::from_secs(1);
/// How long after full leadership the steady state is measured.
const SETTLE: Duration = Duration::from_secs(5);

/// Entry point: `roles [--count 1,100,1000,10000] [--candidates 3] [--window S]
/// [--backend session|lease] [--json]`.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let mut counts = vec![1usize, 100, 1000, 10_000];
    let mut candidates = 3usize;
    let mut window = 10.0f64;
    let mut json = false;
    let mut backend = Backend::Session;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--count" => {
                counts = it
                    .next()
                    .ok_or("--count needs a list of role counts, e.g. 1,100,1000,10000")?
                    .split(',')
                    .map(|s| s.trim().parse::<usize>().ok().filter(|n| *n > 0))
                    .collect::<Option<Vec<_>>>()
                    .ok_or("--count: every count is a positive whole number")?
            }
            "--candidates" => {
                candidates = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| *n >= 2)
                    .ok_or("--candidates needs a number, at least 2 (one is killed)")?
            }
            "--window" => {
                window = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|s: &f64| *s >= 1.0)
                    .ok_or("--window needs a number of seconds, at least 1")?
            }
            "--json" => json = true,
            "--backend" => {
                backend = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--backend needs session or lease")?
            }
            other => return Err(format!("roles: unknown option {other:?}")),
        }
    }
    let (url, _cluster) = crate::database()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut results = Vec::new();
    for &count in &counts {
        let r = rt.block_on(measure(&url, count, candidates, window, backend))?;
        eprintln!(
            "roles {count}: led in {:.0} ms, {:.2} statements/s per candidate, taken over in {:.0} ms",
            r.start_ms, r.statements_per_s_each, r.takeover_ms
        );
        results.push(r);
    }
    print_table(&results, candidates, window, backend);
    let mut figures = Rows::default();
    for r in &results {
        // The session backend's scenario names are kept as they were.
        let scenario = match backend {
            Backend::Lease => format!("roles/lease-{}-roles-{candidates}-candidates", r.roles),
            _ => format!("roles/{}-roles-{candidates}-candidates", r.roles),
        };
        let cpu = r.cpu_percent.iter().cloned().fold(0.0, f64::max);
        let rss = r.rss_mb.iter().cloned().fold(0.0, f64::max);
        figures.push(&scenario, "time_to_full_leadership", r.start_ms, "ms");
        figures.push(
            &scenario,
            "connections_per_candidate",
            r.connections_each,
            "count",
        );
        figures.push(
            &scenario,
            "statements_per_candidate",
            r.statements_per_s_each,
            "1/s",
        );
        figures.push(&scenario, "cpu_busiest_candidate", cpu, "%");
        figures.push(&scenario, "rss_busiest_candidate", rss, "MB");
        figures.push(&scenario, "takeover_after_sigkill", r.takeover_ms, "ms");
        if let (Backend::Lease, Some(after)) = (backend, r.after_expiry_ms) {
            figures.push(&scenario, "takeover_after_last_lease_expiry", after, "ms");
        }
    }
    if json {
        let v: Vec<serde_json::Value> = results.iter().map(Outcome::json).collect();
        let mut line = serde_json::json!({
                "bench": "roles",
                "candidates": candidates,
                "backend": backend.as_str(),
                "window_s": window,
                "timing": match backend {
                    Backend::Lease => "library lease defaults (ttl 15 s, renew 5 s, retry_every 1 s)",
                    _ => "library defaults (ttl 15 s, renew 5 s, heartbeat 1 s, handover delay 2.5 s), standbys polling every 1 s",
                },
                "method": "candidates are processes, each on one SharedConnection (session) or SharedLease (lease); statements = pg_stat_database xact_commit + xact_rollback delta in the benchmark's database, observer excluded; CPU from /proc/<pid>/stat (user+system, USER_HZ 100); takeover = kill until the last of the killed candidate's roles is led elsewhere (LED lines, wall clock of this machine)",
                "results": v,
        });
        figures.attach(&mut line);
        println!("{line}");
    }
    Ok(())
}

/// One count's measurements.
struct Outcome {
    roles: usize,
    start_ms: f64,
    connections: i64,
    connections_each: f64,
    statements_per_s: f64,
    statements_per_s_each: f64,
    cpu_percent: Vec<f64>,
    rss_mb: Vec<f64>,
    killed_roles: usize,
    takeover_ms: f64,
    takeover_first_ms: f64,
    /// From the moment the killed candidate's last lease ran out (its
    /// rows' latest `lease_until`) until the last of its roles was led
    /// elsewhere; negative when the takeover did not wait for the lease
    /// (the session backend's lock is gone with the connection).
    after_expiry_ms: Option<f64>,
}

impl Outcome {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "roles": self.roles,
            "time_to_full_leadership_ms": round2(self.start_ms),
            "connections": self.connections,
            "connections_per_candidate": round2(self.connections_each),
            "statements_per_s": round2(self.statements_per_s),
            "statements_per_s_per_candidate": round2(self.statements_per_s_each),
            "candidate_cpu_percent": self.cpu_percent.iter().map(|x| round2(*x)).collect::<Vec<_>>(),
            "candidate_rss_mb": self.rss_mb.iter().map(|x| round2(*x)).collect::<Vec<_>>(),
            "killed_candidate_roles": self.killed_roles,
            "takeover_after_sigkill_ms": round2(self.takeover_ms),
            "first_takeover_after_sigkill_ms": round2(self.takeover_first_ms),
            "takeover_after_last_lease_expiry_ms": self.after_expiry_ms.map(round2),
        })
    }
}

fn print_table(results: &[Outcome], candidates: usize, window: f64, backend: Backend) {
    let each = match backend {
        Backend::Lease => "lease backend, one SharedLease each",
        _ => "one shared connection each",
    };
    println!(
        "\nroles over {candidates} candidate processes, {each} (steady state over {window} s)"
    );
    println!(
        "{:>7} {:>10} {:>12} {:>12} {:>14} {:>14} {:>11} {:>16}",
        "roles",
        "led (ms)",
        "conns/cand",
        "stmts/s",
        "stmts/s/cand",
        "CPU %/cand",
        "RSS MB",
        "after kill (ms)"
    );
    for r in results {
        let cpu = r.cpu_percent.iter().cloned().fold(0.0, f64::max);
        let rss = r.rss_mb.iter().cloned().fold(0.0, f64::max);
        println!(
            "{:>7} {:>10.0} {:>12.2} {:>12.2} {:>14.2} {:>14.1} {:>11.1} {:>16.0}",
            r.roles,
            r.start_ms,
            r.connections_each,
            r.statements_per_s,
            r.statements_per_s_each,
            cpu,
            rss,
            r.takeover_ms
        );
    }
    match backend {
        Backend::Lease => {
            println!("(CPU and RSS: the busiest candidate; after kill: until the last of the killed candidate's roles is led elsewhere, bounded by the ttl of 15 s plus one poll)");
            for r in results {
                if let Some(after) = r.after_expiry_ms {
                    println!("({} roles: the last one led elsewhere {after:.0} ms after the killed candidate's last lease ran out; the kill came {:.0} ms before that)", r.roles, r.takeover_ms - after);
                }
            }
        }
        _ => println!("(CPU and RSS: the busiest candidate; after kill: until the last of the killed candidate's roles is led elsewhere, handover delay 2.5 s included)"),
    }
}

/// A candidate process and where its lines go.
struct Candidate {
    node: String,
    child: Child,
}

impl Drop for Candidate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `LED` lines: (node, role, unix ns).
type Led = (String, usize, u128);

fn spawn(
    url: &str,
    node: &str,
    count: usize,
    backend: Backend,
    tx: mpsc::Sender<Led>,
) -> Result<Candidate, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([
            "roles",
            "--child",
            url,
            node,
            &count.to_string(),
            backend.as_str(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot spawn a candidate: {e}"))?;
    let out = child.stdout.take().expect("BUG: piped stdout");
    let n = node.to_owned();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let mut parts = l.split_whitespace();
            if parts.next() != Some("LED") {
                continue;
            }
            let (Some(role), Some(ns)) = (
                parts.next().and_then(|r| r.parse().ok()),
                parts.next().and_then(|t| t.parse().ok()),
            ) else {
                continue;
            };
            if tx.send((n.clone(), role, ns)).is_err() {
                break;
            }
        }
    });
    Ok(Candidate {
        node: node.to_owned(),
        child,
    })
}

pub(crate) fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// User + system CPU time of a process, in seconds.
fn cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields count from its closing ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

fn rss_mb(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Collects `LED` lines until `done` says so or `within` passes.
fn collect(
    rx: &mpsc::Receiver<Led>,
    within: Duration,
    mut on: impl FnMut(Led) -> bool,
) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(led) => {
                if on(led) {
                    return Ok(());
                }
            }
            Err(_) => return Err(format!("not every role was led within {within:?}")),
        }
    }
}

async fn measure(
    url: &str,
    count: usize,
    candidates: usize,
    window: f64,
    backend: Backend,
) -> Result<Outcome, String> {
    // A database of its own: its transaction counters are these candidates'.
    let admin = connect(url).await?;
    let db = format!("bench_roles_{count}_{}", std::process::id());
    let db_url = fresh_database(&admin, url, &db).await?;
    let options = ConnectOptions::from_url(&db_url).map_err(|e| e.to_string())?;
    pgelect::migrate(&options)
        .await
        .map_err(|e| e.to_string())?;
    let observer = connect(&db_url).await?;

    let (tx, rx) = mpsc::channel();
    let t0 = unix_ns();
    let mut procs = Vec::new();
    for c in 0..candidates {
        procs.push(spawn(
            &db_url,
            &format!("cand-{c}"),
            count,
            backend,
            tx.clone(),
        )?);
    }
    drop(tx);
    let mut leader: HashMap<usize, String> = HashMap::new();
    let mut last = t0;
    let within = Duration::from_secs(60 + count as u64 / 50);
    tokio::task::block_in_place(|| {
        collect(&rx, within, |(node, role, ns)| {
            leader.insert(role, node);
            last = last.max(ns);
            leader.len() == count
        })
    })?;
    let start_ms = (last - t0) as f64 / 1e6;

    tokio::time::sleep(SETTLE).await;
    let cpu0: Vec<Option<f64>> = procs.iter().map(|p| cpu_s(p.child.id())).collect();
    let x0 = xacts(&observer).await?;
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(window)).await;
    let x1 = xacts(&observer).await?;
    let el = w0.elapsed().as_secs_f64();
    let cpu1: Vec<Option<f64>> = procs.iter().map(|p| cpu_s(p.child.id())).collect();
    let rss: Vec<f64> = procs
        .iter()
        .map(|p| rss_mb(p.child.id()).unwrap_or(f64::NAN))
        .collect();
    let cpu_percent: Vec<f64> = cpu0
        .iter()
        .zip(&cpu1)
        .map(|(a, b)| match (a, b) {
            (Some(a), Some(b)) => (b - a) / el * 100.0,
            _ => f64::NAN,
        })
        .collect();
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
    let statements = (x1 - x0 - 2).max(0) as f64;
    let statements_per_s = statements / el;

    // SIGKILL the candidate that leads the most roles.
    let mut per_node: HashMap<&str, usize> = HashMap::new();
    for n in leader.values() {
        *per_node.entry(n.as_str()).or_default() += 1;
    }
    let (victim, _) = per_node
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(v, n)| (v.to_string(), *n))
        .expect("BUG: some candidate leads");
    let orphans: HashSet<usize> = leader
        .iter()
        .filter(|(_, n)| **n == victim)
        .map(|(r, _)| *r)
        .collect();
    let i = procs
        .iter()
        .position(|p| p.node == victim)
        .expect("BUG: the victim is a candidate");
    let killed_at = unix_ns();
    procs[i]
        .child
        .kill()
        .map_err(|e| format!("cannot SIGKILL the candidate: {e}"))?;
    let _ = procs[i].child.wait();
    // When the killed candidate's last lease runs out on the server's
    // clock (this machine's: the server is local): a takeover's bound
    // that does not depend on where the kill fell in its renewal period.
    let expiry_ns: Option<f64> = observer
        .query_one(
            "SELECT (extract(epoch FROM max(lease_until)) * 1e9)::float8
               FROM pgelect.leaders WHERE holder = $1",
            &[&victim],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let mut retaken: HashMap<usize, u128> = HashMap::new();
    tokio::task::block_in_place(|| {
        collect(&rx, within, |(node, role, ns)| {
            if node != victim && orphans.contains(&role) && ns >= killed_at {
                retaken.insert(role, ns);
            }
            retaken.len() == orphans.len()
        })
    })?;
    let takeover_ms =
        (retaken.values().max().copied().unwrap_or(killed_at) - killed_at) as f64 / 1e6;
    let takeover_first_ms =
        (retaken.values().min().copied().unwrap_or(killed_at) - killed_at) as f64 / 1e6;
    let after_expiry_ms =
        expiry_ns.map(|e| (retaken.values().max().copied().unwrap_or(killed_at) as f64 - e) / 1e6);
    drop(procs);
    drop(observer);
    let _ = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await;
    Ok(Outcome {
        roles: count,
        start_ms,
        connections,
        connections_each: connections as f64 / candidates as f64,
        statements_per_s,
        statements_per_s_each: statements_per_s / candidates as f64,
        cpu_percent,
        rss_mb: rss,
        killed_roles: orphans.len(),
        takeover_ms,
        takeover_first_ms,
        after_expiry_ms,
    })
}

/// Creates the database `db` anew (dropped first if left over) and returns
/// `url` with its database replaced by it.
pub(crate) async fn fresh_database(
    admin: &tokio_postgres::Client,
    url: &str,
    db: &str,
) -> Result<String, String> {
    // Two statements: CREATE DATABASE cannot run in a transaction block.
    for sql in [
        format!("DROP DATABASE IF EXISTS {db}"),
        format!("CREATE DATABASE {db}"),
    ] {
        admin
            .batch_execute(&sql)
            .await
            .map_err(|e| format!("cannot create the benchmark database: {e:?}"))?;
    }
    with_database(url, db)
}

/// `url` with its database replaced by `db`.
fn with_database(url: &str, db: &str) -> Result<String, String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let path = base[scheme_end..]
        .find('/')
        .map(|i| i + scheme_end)
        .ok_or_else(|| format!("cannot find the database name in {url:?}"))?;
    let mut out = format!("{}/{db}", &base[..path]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

/// The hidden child mode: a candidate for `count` roles on one shared
/// connection, printing `LED <role> <unix ns>` at each leadership.
fn child(args: &[String]) -> Result<(), String> {
    let (url, node, count, backend) = match args {
        [url, node, count] => (url, node, count, Backend::Session),
        [url, node, count, backend] => (
            url,
            node,
            count,
            backend.parse().map_err(|_| "bad backend")?,
        ),
        _ => return Err(format!("roles --child: bad arguments {args:?}")),
    };
    let count: usize = count.parse().map_err(|_| "bad count")?;
    let offset: usize = node
        .rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let options = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
        // The library's default TTL (local deadline 12 s) needs the server
        // to keep a silent client's locks longer than the default TCP
        // timeouts (10 s) do.
        let tcp = TcpTimeouts {
            keepalive_idle: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(2),
            keepalive_count: 3,
            user_timeout: Duration::from_secs(15),
        };
        let host = SharedConnection::new(&options, tcp);
        let lease = SharedLease::new(&options);
        let mut tasks = Vec::new();
        for k in 0..count {
            // Spread the starting order: each candidate starts from its own
            // third (or so) of the roles.
            let i = (k + offset * count / 3) % count;
            let builder = Elector::builder(options.clone(), &format!("part-{i}")).node_id(node);
            let e = match backend {
                Backend::Lease => builder
                    .backend(Backend::Lease)
                    .lease(|l| l.retry_every(POLL).shared_lease(&lease)),
                _ => builder.session(|s| {
                    s.standby(StandbyMode::Polling { interval: POLL })
                        .shared_connection(&host)
                }),
            }
            .build()
            .map_err(|e| e.to_string())?;
            tasks.push(tokio::spawn(async move {
                loop {
                    let l = match e.leadership().await {
                        Ok(l) => l,
                        Err(e) => {
                            eprintln!("part-{i}: {e}");
                            return;
                        }
                    };
                    {
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(out, "LED {i} {}", unix_ns());
                        let _ = out.flush();
                    }
                    l.lost().await;
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
        Ok(())
    })
}

/// Transactions committed and rolled back in the observer's database so
/// far ([`pgelect_testkit::stats::transactions`]).
pub(crate) async fn xacts(c: &tokio_postgres::Client) -> Result<i64, String> {
    pgelect_testkit::stats::transactions(c)
        .await
        .map_err(|e| e.to_string())
}
