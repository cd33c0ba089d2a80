//! `cli-handoff`: every handover through the command line, `pgelect run`
//! next to etcd's `etcdctl lock`, in one interleaved run.
//!
//! Contenders (each a role, or an etcd lock name, of its own):
//!
//! * `session`, `lease`: `pgelect run --ttl 2s --on-exit exit` (the lease
//!   backend through PgBouncer in transaction mode with a direct
//!   `--listen-url` when PgBouncer is installed). `--bin LABEL=PATH`
//!   (repeatable) runs the pgelect contenders once per binary, so that two
//!   builds (main's and a branch's) meet the same machine state in the same
//!   run: their series are labelled `session@LABEL`.
//! * `etcd`: `etcdctl lock --ttl 2 NAME -- CMD` against a throwaway
//!   one-member etcd on loopback (data on `/dev/shm` when it exists:
//!   PostgreSQL runs with `fsync = off` in the test kit, so etcd does not
//!   pay for fsync either). Run when `etcd` and `etcdctl` are on `PATH`
//!   (Debian: `etcd-server`, `etcd-client`); skipped with a message
//!   otherwise, or with `--no-etcd`.
//!
//! Kinds of handover (`--kinds`, default all), `--trials` of each per
//! contender (default 30), all trials shuffled together so that drift in
//! the machine's load hits every series alike:
//!
//! * `sigterm`: the leading process is sent SIGTERM (etcd: its process
//!   group, since `etcdctl lock` does not forward signals to its command).
//! * `exit`: the leader's command exits by itself (on SIGUSR1 to the
//!   command's own pid, which it prints: `etcdctl lock` gives its command
//!   no standard input, so the command cannot be told through it).
//! * `resign`: `pgelect resign --role R` is started from the benchmark, as
//!   from another shell (its start-up and connection included); pgelect
//!   only.
//! * `crash`: the leading process is SIGKILLed (etcd: its process group;
//!   pgelect: the `pgelect run` process only, its watcher kills the
//!   command). The successor waits the handover delay (pgelect, 400 ms at
//!   ttl 2 s) or the session's TTL (etcd, lease backend).
//! * `partition`: every connection of the leading process is blackholed
//!   (the test kit's TCP proxy stops forwarding, sockets left open), as
//!   when its host is cut off: the successor acts once the lease has
//!   expired. A pgelect leader stops its command at its local deadline,
//!   before the expiry; `etcdctl lock` never stops its command, so etcd's
//!   trials count an overlap. When `partition` is among the kinds, every
//!   supervisor of the run connects through proxies of its own (over TCP).
//! * `freeze`: the leading process and everything below it (watcher,
//!   command; etcd: `etcdctl` and its command) are SIGSTOPped, as a paused
//!   VM or container would be: the successor acts once the lease has
//!   expired. The frozen command keeps the bench's `flock`, so the overlap
//!   is judged after the successor started: the frozen tree is resumed
//!   (SIGCONT) and the trial counts an overlap if the old command still
//!   runs 2 s later. A pgelect supervisor finds its deadline passed and
//!   kills its command at once (the time is reported); `etcdctl lock` never
//!   stops its command.
//! * `library`: [`Leadership::resign`](pgelect::Leadership::resign) in this
//!   process until a standby here is told it leads; pgelect only. The
//!   difference from `sigterm` is what the command adds.
//!
//! Each trial measures the time from the action (the signal, the write,
//! the start of `pgelect resign`) until the successor's command has started
//! (it prints its start time, wall clock, as its first act). Overlaps are
//! counted for every contender: the command takes an exclusive `flock` on a
//! file of its contender at start; if the previous command still holds it
//! (the kernel drops the lock when a process dies), the two ran at once.
//!
//! `--breakdown` runs the supervisors at `-vv` and reads their logs to
//! split each planned pgelect handover into stages (signal seen, command
//! stopped, released and granted, elected, command started); the logging
//! itself costs a little, so the totals of a breakdown run are a bit above
//! those of a plain run.
//!
//! The supervised command is this binary again: `cli-handoff --child
//! started LOCKFILE`.
//!
//! Targets (issue 33): `sigterm` and `exit` p50 ≤ 5 ms, p99 ≤ 15 ms, both
//! backends; `resign` p50 ≤ 25 ms, p99 ≤ 60 ms; no overlap.

use crate::common::{connect, Rows, Stats};

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use pgelect::{election::Backend, ConnectOptions, Elector, LockKey};
use tokio_postgres::types::Type;

/// How long a standby stands before the leader is stopped, by default (see
/// `standby_ready`).
const SETTLE: Duration = Duration::from_millis(500);

/// Bound on any one step (a process starting, a handoff, an exit).
const STEP: Duration = Duration::from_secs(30);

/// The TTL of every contender: pgelect's `--ttl`, etcd's session TTL.
const TTL_S: u64 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Sigterm,
    Exit,
    Resign,
    Crash,
    Partition,
    Freeze,
    Library,
}

impl Kind {
    const ALL: [Kind; 7] = [
        Kind::Sigterm,
        Kind::Exit,
        Kind::Resign,
        Kind::Crash,
        Kind::Partition,
        Kind::Freeze,
        Kind::Library,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Sigterm => "sigterm",
            Kind::Exit => "exit",
            Kind::Resign => "resign",
            Kind::Crash => "crash",
            Kind::Partition => "partition",
            Kind::Freeze => "freeze",
            Kind::Library => "library",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Kind::Sigterm => "holder SIGTERMed (planned)",
            Kind::Exit => "command exits by itself",
            Kind::Resign => "`pgelect resign` from another shell",
            Kind::Crash => "holder SIGKILLed",
            Kind::Partition => "holder's connections blackholed",
            Kind::Freeze => "holder SIGSTOPped (with its command)",
            Kind::Library => "library resign() (no command)",
        }
    }
}

/// What stands for a role.
#[derive(Clone, Debug)]
enum Engine {
    Pgelect { backend: Backend, bin: PathBuf },
    Etcd,
}

#[derive(Clone, Debug)]
struct Contender {
    engine: Engine,
    /// Role or lock name.
    role: String,
    /// Series name: `session`, `lease@after`, `etcd`.
    name: String,
}

impl Contender {
    fn runs(&self, kind: Kind) -> bool {
        match self.engine {
            Engine::Etcd => !matches!(kind, Kind::Resign | Kind::Library),
            Engine::Pgelect { .. } => true,
        }
    }
}

/// Entry point: see [`USAGE`](crate) in `main.rs`.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let mut trials = 30usize;
    let mut json = false;
    let mut keep_logs = false;
    let mut breakdown = false;
    let mut settle = SETTLE;
    let mut backends = vec![Backend::Session, Backend::Lease];
    let mut kinds = Kind::ALL.to_vec();
    let mut bins: Vec<(String, PathBuf)> = Vec::new();
    let mut etcd_wanted = true;
    let mut seed = wall_ns() as u64;
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
                backends = it
                    .next()
                    .ok_or("--backends needs a list, e.g. session,lease")?
                    .split(',')
                    .filter(|b| !b.trim().is_empty())
                    .map(|b| match b.trim() {
                        "session" => Ok(Backend::Session),
                        "lease" => Ok(Backend::Lease),
                        other => Err(format!("--backends: unknown backend {other:?}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--kinds" => {
                kinds = it
                    .next()
                    .ok_or("--kinds needs a list, e.g. sigterm,exit")?
                    .split(',')
                    .map(|k| {
                        Kind::ALL
                            .into_iter()
                            .find(|x| x.name() == k.trim())
                            .ok_or_else(|| format!("--kinds: unknown kind {k:?}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--bin" => {
                let v = it.next().ok_or("--bin needs LABEL=PATH")?;
                let (label, path) = v.split_once('=').ok_or("--bin needs LABEL=PATH")?;
                bins.push((label.to_owned(), PathBuf::from(path)));
            }
            "--no-etcd" => etcd_wanted = false,
            "--json" => json = true,
            "--keep-logs" => keep_logs = true,
            "--breakdown" => breakdown = true,
            "--seed" => {
                seed = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--seed needs a number")?
            }
            "--settle-ms" => {
                settle = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .map(Duration::from_millis)
                    .ok_or("--settle-ms needs a number of milliseconds")?
            }
            other => return Err(format!("cli-handoff: unknown option {other:?}")),
        }
    }
    if bins.is_empty() {
        bins.push((String::new(), pgelect_bin()?));
    }
    for (label, bin) in &bins {
        if !bin.is_file() {
            return Err(format!("--bin {label}={bin:?}: no such file"));
        }
    }
    let mut contenders = Vec::new();
    for (label, bin) in &bins {
        for &backend in &backends {
            let b = name(backend);
            let suffix = if label.is_empty() {
                String::new()
            } else {
                format!("@{label}")
            };
            contenders.push(Contender {
                engine: Engine::Pgelect {
                    backend,
                    bin: bin.clone(),
                },
                role: format!("bench-cli-{b}-{}", contenders.len()),
                name: format!("{b}{suffix}"),
            });
        }
    }
    let etcd_note = if !etcd_wanted {
        Some("etcd: skipped (--no-etcd)".to_owned())
    } else if !(on_path("etcd") && on_path("etcdctl")) {
        Some(
            "etcd: skipped: etcd and etcdctl are not on PATH (Debian: apt-get install etcd-server etcd-client)"
                .to_owned(),
        )
    } else {
        contenders.push(Contender {
            engine: Engine::Etcd,
            role: "bench-cli-etcd".into(),
            name: "etcd".into(),
        });
        None
    };
    if let Some(note) = &etcd_note {
        eprintln!("cli-handoff: {note}");
    }
    let (url, cluster) = crate::database()?;
    let bouncer = match &cluster {
        Some(c) if pgelect_testkit::pgbouncer_available() => Some(
            pgelect_testkit::PgBouncer::start(c, pgelect_testkit::PoolMode::Transaction)
                .map_err(|e| format!("cannot start pgbouncer: {e}"))?,
        ),
        _ => None,
    };
    // Cut off by proxies, which forward TCP: the servers' TCP addresses.
    let proxied = kinds.contains(&Kind::Partition);
    let url = match &cluster {
        Some(c) if proxied => c.tcp_url("postgres"),
        _ => url,
    };
    let lease_url = match &bouncer {
        Some(b) if proxied => b.tcp_url("postgres"),
        Some(b) => b.url("postgres"),
        None => url.clone(),
    };
    let lease_path = if bouncer.is_some() {
        "PgBouncer (transaction mode) + direct LISTEN"
    } else {
        "direct"
    };
    let dir = std::env::temp_dir().join(format!("pgelect-cli-handoff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {dir:?}: {e}"))?;
    let etcd = if contenders.iter().any(|c| matches!(c.engine, Engine::Etcd)) {
        Some(EtcdServer::start(&dir)?)
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let setup = Setup {
        url,
        lease_url,
        dir: dir.clone(),
        settle,
        breakdown,
        etcd_endpoint: etcd.as_ref().map(|e| e.endpoint.clone()),
        proxied,
    };
    let plan = Plan {
        contenders,
        kinds,
        trials,
        seed,
    };
    let result = rt.block_on(measure(&setup, &plan, lease_path, etcd_note, json));
    drop(etcd);
    if result.is_ok() && !keep_logs {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("cli-handoff: the supervisors' logs are in {dir:?}");
    }
    result
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

/// The `pgelect` binary to run.
pub(crate) fn pgelect_bin() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("PGELECT_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let bin = me.with_file_name("pgelect");
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!(
            "no pgelect binary at {bin:?}: build it into the same profile (cargo build --release -p pgelect-cli), set PGELECT_BIN or give --bin LABEL=PATH"
        ))
    }
}

struct Setup {
    /// Direct: the session backend, LISTEN, the observer, `pgelect resign`.
    url: String,
    /// Through PgBouncer when there is one: the lease backend.
    lease_url: String,
    /// Logs of the supervisors, the contenders' lock files, etcd's data.
    dir: PathBuf,
    /// How long a standby stands before the leader is stopped.
    settle: Duration,
    /// Supervisors at `-vv`, their logs read for the stages.
    breakdown: bool,
    etcd_endpoint: Option<String>,
    /// Every supervisor connects through TCP proxies of its own (when
    /// `partition` is measured), so that one can be cut off.
    proxied: bool,
}

struct Plan {
    contenders: Vec<Contender>,
    kinds: Vec<Kind>,
    trials: usize,
    seed: u64,
}

fn name(b: Backend) -> &'static str {
    match b {
        Backend::Session => "session",
        _ => "lease",
    }
}

/// One measured trial.
struct Sample {
    ms: f64,
    overlap: bool,
    /// `resign`: the resigned node won the role back first (its command
    /// started again); the bench then stopped it, and `ms` runs until the
    /// standby's command started.
    returned: bool,
    stages: Option<Stages>,
    /// `freeze`: from SIGCONT of the frozen holder (after the successor's
    /// command started) until its command had ended; `None` if it still
    /// ran after [`RESUMED`] (then `overlap`).
    resumed_ms: Option<f64>,
}

/// How long a resumed frozen holder's command may run on before the trial
/// counts an overlap: its supervisor finds its deadline passed and kills
/// it within milliseconds; `etcdctl lock` never stops its command.
const RESUMED: Duration = Duration::from_secs(2);

/// A throwaway one-member etcd on loopback.
struct EtcdServer {
    child: Child,
    endpoint: String,
    data: PathBuf,
}

impl EtcdServer {
    fn start(dir: &Path) -> Result<EtcdServer, String> {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            dir.to_owned()
        };
        let data = base.join(format!("pgelect-bench-etcd-{}", std::process::id()));
        let client_port = free_port()?;
        let peer_port = free_port()?;
        let endpoint = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(dir.join("etcd.log")).map_err(|e| e.to_string())?;
        let child = Command::new("etcd")
            .arg("--data-dir")
            .arg(&data)
            .args(["--name", "bench"])
            .args(["--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("bench={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start etcd: {e}"))?;
        let server = EtcdServer {
            child,
            endpoint,
            data,
        };
        let deadline = Instant::now() + STEP;
        loop {
            let ok = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &server.endpoint, "endpoint", "health"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(server);
            }
            if Instant::now() > deadline {
                return Err("etcd did not become healthy within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// A small deterministic generator for the shuffle (no dependency for it).
struct XorShift(u64);

impl XorShift {
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0.max(1);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

async fn measure(
    setup: &Setup,
    plan: &Plan,
    lease_path: &str,
    etcd_note: Option<String>,
    json: bool,
) -> Result<(), String> {
    let direct = ConnectOptions::from_url(&setup.url).map_err(|e| e.to_string())?;
    pgelect::migrate(&direct).await.map_err(|e| e.to_string())?;
    let observer = connect(&setup.url).await?;
    let load_before = loadavg();
    let mut order = Vec::new();
    for (ci, c) in plan.contenders.iter().enumerate() {
        for &k in &plan.kinds {
            if c.runs(k) {
                order.extend(std::iter::repeat_n((ci, k), plan.trials));
            }
        }
    }
    let mut rng = XorShift(plan.seed);
    for i in (1..order.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut groups: Vec<Group> = plan
        .contenders
        .iter()
        .map(|c| Group {
            c: c.clone(),
            leader: None,
            next_node: 0,
        })
        .collect();
    let mut results: BTreeMap<(usize, Kind), Vec<Sample>> = BTreeMap::new();
    let total = order.len();
    for (n, &(ci, kind)) in order.iter().enumerate() {
        let sample = if kind == Kind::Library {
            let c = &groups[ci].c;
            let Engine::Pgelect { backend, .. } = c.engine else {
                unreachable!("BUG: library trials are for pgelect only")
            };
            Sample {
                ms: library_trial(setup, backend, &observer, &format!("{}-lib", c.role)).await?,
                overlap: false,
                returned: false,
                stages: None,
                resumed_ms: None,
            }
        } else {
            groups[ci]
                .trial(setup, &observer, kind)
                .await
                .map_err(|e| format!("{} {}: {e}", groups[ci].c.name, kind.name()))?
        };
        results.entry((ci, kind)).or_default().push(sample);
        if !json && (n + 1) % 20 == 0 {
            eprintln!("cli-handoff: {} of {total} trials", n + 1);
        }
    }
    for g in &mut groups {
        if let Some(mut l) = g.leader.take() {
            l.stop_quietly().await;
        }
    }
    let load_after = loadavg();
    report(
        setup,
        plan,
        lease_path,
        etcd_note,
        json,
        &results,
        load_before,
        load_after,
    );
    Ok(())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| {
            let v: Vec<&str> = s.split_whitespace().take(3).collect();
            (v.len() == 3).then(|| v.join(" "))
        })
        .unwrap_or_else(|| "unknown".into())
}

pub(crate) fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    format!("{cores} cores, {model}")
}

fn commit() -> String {
    if let Ok(c) = std::env::var("PGELECT_BENCH_COMMIT") {
        return c;
    }
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

#[allow(clippy::too_many_arguments)]
fn report(
    setup: &Setup,
    plan: &Plan,
    lease_path: &str,
    etcd_note: Option<String>,
    json: bool,
    results: &BTreeMap<(usize, Kind), Vec<Sample>>,
    load_before: String,
    load_after: String,
) {
    let machine = machine();
    let commit = commit();
    let mut figures = Rows::default();
    let mut series = Vec::new();
    for ((ci, kind), samples) in results {
        let c = &plan.contenders[*ci];
        let ms: Vec<f64> = samples.iter().map(|s| s.ms).collect();
        let overlaps = samples.iter().filter(|s| s.overlap).count();
        figures.latency(&format!("cli-handoff/{}-{}", c.name, kind.name()), &ms);
        figures.push(
            &format!("cli-handoff/{}-{}", c.name, kind.name()),
            "overlaps",
            overlaps as f64,
            "count",
        );
        let stages: Option<BTreeMap<String, f64>> = stage_medians(samples).map(|s| {
            s.iter()
                .map(|(n, v)| (n.to_string(), crate::common::round2(*v)))
                .collect()
        });
        series.push(serde_json::json!({
            "contender": c.name,
            "kind": kind.name(),
            "ms": Stats::of(&ms).json(),
            "trials": ms.len(),
            "overlaps": overlaps,
            "returned": samples.iter().filter(|s| s.returned).count(),
            "stages_p50_ms": stages,
            "resumed_command_ended_ms": resumed_stats(samples).map(|st| st.json()),
        }));
    }
    let mut line = serde_json::json!({
        "bench": "cli-handoff",
        "machine": machine,
        "commit": commit,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "trials": plan.trials,
        "seed": plan.seed,
        "ttl_s": TTL_S,
        "lease_path": lease_path,
        "settle_ms": setup.settle.as_millis() as u64,
        "breakdown": setup.breakdown,
        "etcd": etcd_note.clone().unwrap_or_else(|| "run".into()),
        "series": series,
    });
    if !json {
        println!(
            "cli-handoff: {} trials per series, shuffled (seed {}); ttl {TTL_S} s for every contender; lease backend through {lease_path}; standbys settled {} ms{}",
            plan.trials,
            plan.seed,
            setup.settle.as_millis(),
            if setup.breakdown { "; supervisors at -vv (--breakdown)" } else { "" }
        );
        println!("machine: {machine}; commit {commit}; load average {load_before} at start, {load_after} at end");
        if let Some(note) = &etcd_note {
            println!("{note}");
        }
        println!(
            "\nfrom the action to the successor's command started (ms)\n{:<40} {:<14} {:>8} {:>8} {:>8} {:>8} {:>9}",
            "handover", "contender", "p50", "p99", "min", "max", "overlaps"
        );
        for &kind in &plan.kinds {
            for (ci, c) in plan.contenders.iter().enumerate() {
                let Some(samples) = results.get(&(ci, kind)) else {
                    continue;
                };
                let ms: Vec<f64> = samples.iter().map(|s| s.ms).collect();
                let st = Stats::of(&ms);
                println!(
                    "{:<40} {:<14} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>5} / {}",
                    kind.label(),
                    c.name,
                    st.p50,
                    st.p99,
                    st.min,
                    st.max,
                    samples.iter().filter(|s| s.overlap).count(),
                    samples.len()
                );
                if kind == Kind::Freeze {
                    match resumed_stats(samples) {
                        Some(st) => println!(
                            "{:<40} {:<14} resumed after the successor started, its command ended {:.2} / {:.2} ms (p50 / max) after SIGCONT; {} of {} still ran {} s after it",
                            "", c.name, st.p50, st.max,
                            samples.iter().filter(|s| s.overlap).count(),
                            samples.len(),
                            RESUMED.as_secs()
                        ),
                        None => println!(
                            "{:<40} {:<14} resumed after the successor started, its command still ran {} s after SIGCONT in every trial",
                            "", c.name, RESUMED.as_secs()
                        ),
                    }
                }
                let returned = samples.iter().filter(|s| s.returned).count();
                if returned > 0 {
                    println!(
                        "{:<40} {:<14} the resigned node won the role back in {returned} of {} trials (stopped by the bench; their time runs to the standby's start)",
                        "", c.name, samples.len()
                    );
                }
            }
        }
        if setup.breakdown {
            println!(
                "\nstages of the planned handovers, medians (ms; from the supervisors' -vv logs)"
            );
            for ((ci, kind), samples) in results {
                if let Some(stages) = stage_medians(samples) {
                    let text: Vec<String> =
                        stages.iter().map(|(n, v)| format!("{n} {v:.2}")).collect();
                    println!(
                        "{:<14} {:<8} {}",
                        plan.contenders[*ci].name,
                        kind.name(),
                        text.join(", ")
                    );
                }
            }
        }
        println!(
            "\ntargets: sigterm and exit p50 <= 5 ms, p99 <= 15 ms; resign p50 <= 25 ms, p99 <= 60 ms; no overlap\n"
        );
    }
    figures.attach(&mut line);
    println!("{line}");
}

/// `root` and every live descendant, parents before children (from
/// `/proc/*/stat`).
fn tree(root: Pid) -> Vec<Pid> {
    let mut procs = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else {
                continue;
            };
            let parent = std::fs::read_to_string(e.path().join("stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<i32>().ok())
                });
            if let Some(parent) = parent {
                procs.push((pid, parent));
            }
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let p = found[i].as_raw();
        for &(pid, parent) in &procs {
            if parent == p {
                found.push(Pid::from_raw(pid));
            }
        }
        i += 1;
    }
    found
}

/// True while `pid` runs (a zombie does not).
fn alive(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, r)| r.trim_start().to_owned()))
        .is_some_and(|r| !r.starts_with('Z') && !r.starts_with('X'))
}

/// Nanoseconds since the epoch: comparable between processes on one host.
fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("BUG: the clock is after 1970")
        .as_nanos()
}

/// The candidates of one contender: the leader, between trials.
struct Group {
    c: Contender,
    leader: Option<Proc>,
    next_node: usize,
}

impl Group {
    fn spawn(&mut self, setup: &Setup) -> Result<Proc, String> {
        let node = format!("n{}", self.next_node);
        self.next_node += 1;
        Proc::spawn(setup, &self.c, &node)
    }

    async fn trial(
        &mut self,
        setup: &Setup,
        observer: &tokio_postgres::Client,
        kind: Kind,
    ) -> Result<Sample, String> {
        if self.leader.is_none() {
            let mut l = self.spawn(setup)?;
            l.started(STEP).await?;
            l.lock_line(STEP).await?;
            self.leader = Some(l);
        }
        let mut standby = self.spawn(setup)?;
        standby_ready(observer, setup, &self.c, &standby.node).await?;
        let mut leader = self.leader.take().expect("BUG: a leader runs");
        let mut resign_cmd = None;
        let mut frozen = Vec::new();
        let t0 = wall_ns();
        match kind {
            Kind::Sigterm => leader.signal(Signal::SIGTERM)?,
            Kind::Crash => leader.signal(Signal::SIGKILL)?,
            Kind::Partition => {
                for p in &leader.proxies {
                    p.blackhole();
                }
            }
            Kind::Exit => leader.tell_command_to_exit()?,
            // The whole process tree, as a paused VM or container would
            // be: the supervisor first, so it cannot react to the rest.
            Kind::Freeze => {
                for pid in tree(Pid::from_raw(leader.child.id() as i32)) {
                    if kill(pid, Signal::SIGSTOP).is_ok() {
                        frozen.push(pid);
                    }
                }
            }
            Kind::Resign => {
                let Engine::Pgelect { bin, .. } = &self.c.engine else {
                    unreachable!("BUG: resign is for pgelect only")
                };
                resign_cmd = Some(
                    Command::new(bin)
                        .args([
                            "resign",
                            "--role",
                            &self.c.role,
                            "--database-url",
                            &setup.url,
                        ])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .map_err(|e| format!("cannot run pgelect resign: {e}"))?,
                );
            }
            Kind::Library => unreachable!("BUG: handled by the caller"),
        }
        let mut returned = false;
        if kind == Kind::Resign {
            // The resigned node stands again at once: if it wins the role
            // back, stop it, and count the trial as returned.
            let deadline = Instant::now() + STEP;
            while standby.early.is_none() {
                if leader.try_line("STARTED ").is_some() {
                    returned = true;
                    leader.stop_quietly().await;
                    break;
                }
                match standby.lines.try_recv() {
                    Ok(l) => standby.early = Some(l),
                    Err(_) if Instant::now() > deadline => {
                        return Err(format!("no command started within {STEP:?} of the resign"));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_micros(200)).await,
                }
            }
        }
        let started = standby.started(STEP).await?;
        let mut overlap = standby.lock_line(STEP).await?;
        let ms = (started.saturating_sub(t0)) as f64 / 1e6;
        let mut resumed_ms = None;
        if kind == Kind::Freeze {
            // The frozen command holds the bench's flock without acting:
            // what counts is whether it acts again once resumed.
            let resumed = Instant::now();
            for &pid in &frozen {
                let _ = kill(pid, Signal::SIGCONT);
            }
            let old = leader
                .command
                .ok_or("BUG: the frozen leader's command had started")?;
            while alive(old) && resumed.elapsed() < RESUMED {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            overlap = alive(old);
            resumed_ms = (!overlap).then(|| resumed.elapsed().as_secs_f64() * 1000.0);
        }
        if let Some(mut r) = resign_cmd {
            tokio::task::block_in_place(|| r.wait()).map_err(|e| e.to_string())?;
        }
        match kind {
            // Resigned, the old leader stands again: stop it.
            Kind::Resign if !returned => leader.stop_quietly().await,
            Kind::Resign => {}
            // Cut off, it cannot release: end what is left of it (etcd's
            // command still runs: `etcdctl lock` never stops it).
            Kind::Partition | Kind::Freeze => {
                leader.signal(Signal::SIGKILL)?;
                leader.exited(STEP).await?;
            }
            _ => leader.exited(STEP).await?,
        }
        let stages = if setup.breakdown && matches!(kind, Kind::Sigterm | Kind::Exit | Kind::Resign)
        {
            stages(setup, &self.c, &leader.node, &standby.node, t0, started)
        } else {
            None
        };
        self.leader = Some(standby);
        Ok(Sample {
            ms,
            overlap,
            returned,
            // The stages of a returned trial describe the node's own return.
            stages: stages.filter(|_| !returned),
            resumed_ms,
        })
    }
}

/// A `pgelect run` or `etcdctl lock` process whose command prints
/// `STARTED <node> <ns> <pid>`, then `LOCK ok` or `LOCK overlap`.
struct Proc {
    child: Child,
    /// The command's own pid, once it has started.
    command: Option<Pid>,
    /// A line read ahead (the `resign` trial's watch), read first.
    early: Option<String>,
    lines: std::sync::mpsc::Receiver<String>,
    node: String,
    /// Signals go to the process group (etcd) or the process (pgelect).
    group: bool,
    /// The TCP proxies its connections go through (`partition` runs), one
    /// per server it talks to; blackholed to cut it off.
    proxies: Vec<pgelect_testkit::FaultProxy>,
}

fn log_path(setup: &Setup, c: &Contender, node: &str) -> PathBuf {
    setup.dir.join(format!("{}-{node}.log", c.role))
}

fn lock_path(setup: &Setup, c: &Contender) -> PathBuf {
    setup.dir.join(format!("{}.lock", c.role))
}

impl Proc {
    fn spawn(setup: &Setup, c: &Contender, node: &str) -> Result<Self, String> {
        use std::os::unix::process::CommandExt;
        let me = std::env::current_exe().map_err(|e| e.to_string())?;
        let log = std::fs::File::create(log_path(setup, c, node))
            .map_err(|e| format!("cannot create a log file: {e}"))?;
        let lock = lock_path(setup, c);
        let mut proxies = Vec::new();
        let mut via = |url: &str| -> Result<String, String> {
            if !setup.proxied {
                return Ok(url.to_owned());
            }
            let (url, proxy) = proxied(url)?;
            proxies.push(proxy);
            Ok(url)
        };
        let mut cmd;
        let group;
        match &c.engine {
            Engine::Pgelect { backend, bin, .. } => {
                cmd = Command::new(bin);
                if setup.breakdown {
                    cmd.arg("-vv");
                }
                cmd.args(["run", "--role", &c.role, "--id", node]).args([
                    "--ttl",
                    &format!("{TTL_S}s"),
                    "--on-exit",
                    "exit",
                ]);
                match backend {
                    Backend::Session => {
                        cmd.args(["--database-url", &via(&setup.url)?]);
                    }
                    _ => {
                        cmd.args([
                            "--backend",
                            "lease",
                            "--database-url",
                            &via(&setup.lease_url)?,
                        ])
                        .args(["--listen-url", &via(&setup.url)?]);
                    }
                }
                cmd.arg("--");
                group = false;
            }
            Engine::Etcd => {
                let endpoint = via(setup.etcd_endpoint.as_deref().expect("BUG: etcd runs"))?;
                cmd = Command::new("etcdctl");
                cmd.env("ETCDCTL_API", "3")
                    .args(["--endpoints", &endpoint])
                    .args(["lock", "--ttl", &TTL_S.to_string(), &c.role, "--"])
                    .process_group(0);
                group = true;
            }
        }
        cmd.arg(me)
            .args(["cli-handoff", "--child", "started"])
            .arg(lock)
            .env("BENCH_NODE", node)
            .env_remove("DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", c.name))?;
        let out = child.stdout.take().expect("BUG: piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Proc {
            child,
            command: None,
            early: None,
            lines,
            node: node.to_owned(),
            group,
            proxies,
        })
    }

    /// A line starting with `prefix` already printed, its rest (others
    /// are dropped).
    fn try_line(&mut self, prefix: &str) -> Option<String> {
        while let Ok(l) = self.lines.try_recv() {
            if let Some(rest) = l.strip_prefix(prefix) {
                return Some(rest.to_owned());
            }
        }
        None
    }

    /// The next line starting with `prefix`, its rest.
    async fn line(&mut self, prefix: &str, within: Duration) -> Result<String, String> {
        let deadline = Instant::now() + within;
        loop {
            let next = match self.early.take() {
                Some(l) => Ok(l),
                None => self.lines.try_recv(),
            };
            match next {
                Ok(l) => {
                    if let Some(rest) = l.strip_prefix(prefix) {
                        return Ok(rest.to_owned());
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    if Instant::now() > deadline {
                        return Err(format!(
                            "{} printed no {prefix:?} within {within:?}",
                            self.node
                        ));
                    }
                    if let Ok(Some(status)) = self.child.try_wait() {
                        return Err(format!("{} exited: {status}", self.node));
                    }
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                Err(e) => return Err(format!("{}: output ended: {e}", self.node)),
            }
        }
    }

    /// Waits until its command has started; returns when it did (wall ns).
    async fn started(&mut self, within: Duration) -> Result<u128, String> {
        let rest = self.line("STARTED ", within).await?;
        let mut fields = rest.split(' ');
        let (Some(node), Some(ns), Some(pid)) = (fields.next(), fields.next(), fields.next())
        else {
            return Err(format!("bad STARTED line {rest:?}"));
        };
        if node != self.node {
            return Err(format!("{node} started, expected {}", self.node));
        }
        let pid: i32 = pid.parse().map_err(|_| "bad STARTED pid".to_owned())?;
        self.command = Some(Pid::from_raw(pid));
        ns.parse().map_err(|_| "bad STARTED time".to_owned())
    }

    /// Whether its command found the previous one still running.
    async fn lock_line(&mut self, within: Duration) -> Result<bool, String> {
        Ok(self.line("LOCK ", within).await? == "overlap")
    }

    fn signal(&self, signal: Signal) -> Result<(), String> {
        let pid = Pid::from_raw(self.child.id() as i32);
        if self.group {
            killpg(pid, signal)
        } else {
            kill(pid, signal)
        }
        .map_err(|e| format!("cannot send {signal}: {e}"))
    }

    fn tell_command_to_exit(&mut self) -> Result<(), String> {
        let pid = self.command.ok_or("BUG: the command has not started")?;
        kill(pid, Signal::SIGUSR1).map_err(|e| format!("cannot tell the command to exit: {e}"))
    }

    /// Waits for the process to exit.
    async fn exited(&mut self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            if self.child.try_wait().map_err(|e| e.to_string())?.is_some() {
                if self.group {
                    // What etcdctl left (its command, if a signal missed it).
                    let _ = killpg(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{} did not exit", self.node));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// SIGTERM, then waits (a standby or leader no longer measured).
    async fn stop_quietly(&mut self) {
        let _ = self.signal(Signal::SIGTERM);
        if self.exited(STEP).await.is_err() {
            let _ = self.signal(Signal::SIGKILL);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.group {
            let _ = killpg(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `url` (`postgres://…@127.0.0.1:PORT/…` or `http://127.0.0.1:PORT`)
/// through a new TCP proxy to the same address (the test kit's
/// [`FaultProxy`](pgelect_testkit::FaultProxy)).
fn proxied(url: &str) -> Result<(String, pgelect_testkit::FaultProxy), String> {
    const HOST: &str = "127.0.0.1:";
    let at = url
        .rfind(HOST)
        .ok_or_else(|| format!("cannot proxy {url:?}: not a 127.0.0.1 TCP address"))?
        + HOST.len();
    let digits = url[at..].bytes().take_while(u8::is_ascii_digit).count();
    let port: u16 = url[at..at + digits]
        .parse()
        .map_err(|_| format!("cannot proxy {url:?}: no port"))?;
    let proxy =
        pgelect_testkit::FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
            .map_err(|e| format!("cannot start a TCP proxy: {e}"))?;
    let url = format!("{}{}{}", &url[..at], proxy.port(), &url[at + digits..]);
    Ok((url, proxy))
}

/// Waits until the standby `node` would be told of a release at once: for
/// the session backend, its wait for the lock shows in `pg_locks`; for the
/// lease backend, its LISTEN connection is idle (LISTEN done); for etcd,
/// its key is under the lock's prefix; then `--settle-ms` (default
/// [`SETTLE`]; a planned handover in production meets a standby that has
/// settled).
async fn standby_ready(
    observer: &tokio_postgres::Client,
    setup: &Setup,
    c: &Contender,
    node: &str,
) -> Result<(), String> {
    let deadline = Instant::now() + STEP;
    loop {
        let ready = match &c.engine {
            Engine::Pgelect { backend, .. } => {
                pgelect_waiting(observer, setup, &c.role, *backend, node).await?
            }
            Engine::Etcd => {
                let out = Command::new("etcdctl")
                    .env("ETCDCTL_API", "3")
                    .args([
                        "--endpoints",
                        setup.etcd_endpoint.as_deref().expect("BUG: etcd runs"),
                    ])
                    .args(["get", "--prefix", "--keys-only", &format!("{}/", c.role)])
                    .output()
                    .map_err(|e| format!("cannot run etcdctl get: {e}"))?;
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .count()
                    >= 2
            }
        };
        if ready {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("standby {node} not waiting within {STEP:?}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(setup.settle).await;
    Ok(())
}

async fn pgelect_waiting(
    observer: &tokio_postgres::Client,
    setup: &Setup,
    role: &str,
    backend: Backend,
    node: &str,
) -> Result<bool, String> {
    let row = match backend {
        Backend::Session => {
            let key = role_key(setup, role)?;
            observer
                .query_typed_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
                       AND ((classid::bigint << 32) | objid::bigint) = $1 AND objsubid = 1",
                    &[(&key, Type::INT8)],
                )
                .await
        }
        _ => {
            let app = format!("pgelect:listen:{role}:{node}");
            observer
                .query_typed_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE application_name = $1 AND state = 'idle'",
                    &[(&app, Type::TEXT)],
                )
                .await
        }
    }
    .map_err(|e| e.to_string())?;
    Ok(row.get::<_, i64>(0) > 0)
}

fn role_key(setup: &Setup, role: &str) -> Result<i64, String> {
    let options = ConnectOptions::from_url(&setup.url).map_err(|e| e.to_string())?;
    let e = Elector::builder(options, role)
        .build()
        .map_err(|e| e.to_string())?;
    match e.lock_key() {
        LockKey::Single(k) => Ok(k),
        LockKey::Pair(..) => Err("BUG: role keys are single keys".into()),
    }
}

/// The library's own handoff: `resign()` until a standby is told it leads.
async fn library_trial(
    setup: &Setup,
    backend: Backend,
    observer: &tokio_postgres::Client,
    role: &str,
) -> Result<f64, String> {
    let direct = ConnectOptions::from_url(&setup.url).map_err(|e| e.to_string())?;
    let ttl = Duration::from_secs(TTL_S);
    let mk = |node: &str| -> Result<Elector, String> {
        let b = match backend {
            Backend::Session => Elector::builder(direct.clone(), role),
            _ => Elector::builder(
                ConnectOptions::from_url(&setup.lease_url).map_err(|e| e.to_string())?,
                role,
            )
            .backend(Backend::Lease)
            .lease(|l| l.listen_via(direct.clone())),
        };
        b.ttl(ttl).node_id(node).build().map_err(|e| e.to_string())
    };
    let a = mk("lib-a")?;
    let b = mk("lib-b")?;
    let la = a.leadership().await.map_err(|e| e.to_string())?;
    let wait = tokio::spawn(async move {
        let l = b.leadership().await;
        (Instant::now(), l, b)
    });
    let deadline = Instant::now() + STEP;
    while !pgelect_waiting(observer, setup, role, backend, "lib-b").await? {
        if Instant::now() > deadline {
            return Err("library standby not waiting within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(setup.settle).await;
    let t0 = Instant::now();
    la.resign().await.map_err(|e| e.to_string())?;
    let (elected, l, _b) = wait.await.map_err(|e| e.to_string())?;
    let l = l.map_err(|e| e.to_string())?;
    let ms = (elected - t0).as_secs_f64() * 1000.0;
    l.resign().await.map_err(|e| e.to_string())?;
    Ok(ms)
}

/// The stages of one planned handover, in order, as (name, ms).
type Stages = Vec<(&'static str, f64)>;

/// Reads the two supervisors' `-vv` logs: when the leader saw the signal,
/// when its command had exited (and its release was answered), when the
/// successor was granted the lock (session), when its leadership began
/// (session: the term recorded and the keeper active; lease: the lease
/// won) and when its command started (its own clock reading).
fn stages(
    setup: &Setup,
    c: &Contender,
    leader: &str,
    successor: &str,
    t0: u128,
    started: u128,
) -> Option<Stages> {
    let old = std::fs::read_to_string(log_path(setup, c, leader)).ok()?;
    let new = std::fs::read_to_string(log_path(setup, c, successor)).ok()?;
    let day = |ns: u128| (ns % 86_400_000_000_000) as f64 / 1e6;
    let (t0, started) = (day(t0), day(started));
    let at = |log: &str, marker: &str| -> Option<f64> {
        log.lines()
            .filter(|l| l.contains(marker))
            .filter_map(log_ms)
            .find(|&t| t >= t0 - 1.0)
    };
    let seen = at(&old, "received; stopping the command")
        .or_else(|| at(&old, "resign requested for role"));
    let exited = at(&old, "command exited").or_else(|| at(&old, "command killed"))?;
    let released = at(&old, "handed over role");
    // Session backend only (debug): the lock wait returned granted.
    let granted = at(&new, "lock granted");
    // The keeper's activation (session) or the won lease (lease).
    let elected = at(&new, "leadership begins")?;
    let mut s = Vec::new();
    let mut prev = t0;
    if let Some(seen) = seen {
        s.push(("seen", seen - t0));
        prev = seen;
    }
    s.push(("command stopped", exited - prev));
    if let Some(r) = released {
        s.push(("(release answered)", r - exited));
    }
    match granted {
        Some(g) => {
            s.push(("released+granted", g - exited));
            s.push(("term bump+activation", elected - g));
        }
        None => s.push(("released+won", elected - exited)),
    }
    s.push(("command started", started - elected));
    Some(s)
}

/// Milliseconds since midnight (UTC) of a log line's RFC 3339 timestamp,
/// `2026-11-28T09:12:34.123456Z …`.
fn log_ms(line: &str) -> Option<f64> {
    let ts = line.split_whitespace().next()?;
    let time = ts.split_once('T')?.1.trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(((h * 60.0 + m) * 60.0 + s) * 1000.0)
}

/// The `freeze` samples' times from SIGCONT to the old command's end.
fn resumed_stats(samples: &[Sample]) -> Option<Stats> {
    let v: Vec<f64> = samples.iter().filter_map(|s| s.resumed_ms).collect();
    (!v.is_empty()).then(|| Stats::of(&v))
}

/// Medians of each stage over the samples that have them.
fn stage_medians(samples: &[Sample]) -> Option<Vec<(&'static str, f64)>> {
    let with: Vec<&Stages> = samples.iter().filter_map(|s| s.stages.as_ref()).collect();
    let first = with.first()?;
    let mut out = Vec::new();
    for (i, (n, _)) in first.iter().enumerate() {
        let v: Vec<f64> = with
            .iter()
            .filter_map(|s| s.get(i).filter(|(m, _)| m == n).map(|(_, v)| *v))
            .collect();
        if !v.is_empty() {
            out.push((*n, Stats::of(&v).p50));
        }
    }
    Some(out)
}

/// The supervised command: prints `STARTED <node> <wall ns>` at once, then
/// takes the contender's lock file (`LOCK ok`, or `LOCK overlap` if the
/// previous command still held it, then waits for it), then exits when it
/// reads `exit` or end of file on its standard input (SIGTERM's default
/// action ends it too).
fn child(args: &[String]) -> Result<(), String> {
    let now = wall_ns();
    let [mode, lock] = args else {
        return Err(format!("cli-handoff --child: bad arguments {args:?}"));
    };
    if mode != "started" {
        return Err(format!("cli-handoff --child: bad mode {mode:?}"));
    }
    // SIGUSR1 (blocked here, then awaited) is "exit now, by yourself".
    use nix::sys::signal::{SigSet, SigmaskHow};
    let mut usr1 = SigSet::empty();
    usr1.add(Signal::SIGUSR1);
    nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&usr1), None)
        .map_err(|e| format!("cannot block SIGUSR1: {e}"))?;
    let node = std::env::var("BENCH_NODE").unwrap_or_default();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "STARTED {node} {now} {}", std::process::id());
    let _ = out.flush();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock)
        .map_err(|e| format!("cannot open {lock}: {e}"))?;
    use nix::fcntl::{Flock, FlockArg};
    let _held = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(held) => {
            let _ = writeln!(out, "LOCK ok");
            held
        }
        Err((file, _)) => {
            let _ = writeln!(out, "LOCK overlap");
            let _ = out.flush();
            Flock::lock(file, FlockArg::LockExclusive)
                .map_err(|(_, e)| format!("cannot lock {lock}: {e}"))?
        }
    };
    let _ = out.flush();
    drop(out);
    usr1.wait()
        .map_err(|e| format!("cannot wait for SIGUSR1: {e}"))?;
    Ok(())
}
