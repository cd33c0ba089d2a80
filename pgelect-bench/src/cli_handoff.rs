//! `cli-handoff`: a planned handoff through the `pgelect run` command, next
//! to the same handoff through the library.
//!
//! Per backend (`session`, and `lease` through PgBouncer in transaction mode
//! with a direct `--listen-url`), `--trials` times (default 30), alternating:
//!
//! * `command`: two real `pgelect run` processes stand for a role; the
//!   leader's is sent SIGTERM; the time until the successor's supervised
//!   command has started (it prints its start time, wall clock, as its first
//!   act). The leader stops its command (SIGTERM to the command's process
//!   group), waits for it, releases; the standby is elected and starts its
//!   command under its watcher. The successor then leads the next trial,
//!   against a fresh standby.
//! * `library`: [`Leadership::resign`](pgelect::Leadership::resign) until a
//!   standby in this process is told it leads (as `failover`'s voluntary
//!   series), same backend, same path to the database. The difference is
//!   what the command adds.
//!
//! The `pgelect` binary is `$PGELECT_BIN`, else the one next to this
//! benchmark's binary (`cargo build --release -p pgelect-cli` builds it into
//! the same `target/release`). The supervised command is this binary again:
//! `cli-handoff --child started`.
//!
//! Targets: command median ≤ 50 ms (session), ≤ 100 ms (lease
//! with a LISTEN connection).

use crate::common::{connect, Rows, Stats};

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use pgelect::{election::Backend, ConnectOptions, Elector, LockKey};
use tokio_postgres::types::Type;

/// How long a standby stands before the leader is stopped, by default (see
/// `standby_ready`).
const SETTLE: Duration = Duration::from_millis(500);

/// Bound on any one step (a process starting, a handoff, an exit).
const STEP: Duration = Duration::from_secs(30);

/// Entry point: `cli-handoff [--trials N] [--backends session,lease] [--settle-ms MS] [--ttl D] [--keep-logs] [--json]`.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let mut trials = 30usize;
    let mut json = false;
    let mut keep_logs = false;
    let mut settle = SETTLE;
    let mut ttl: Option<(String, Duration)> = None;
    let mut backends = vec![Backend::Session, Backend::Lease];
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
                    .map(|b| match b.trim() {
                        "session" => Ok(Backend::Session),
                        "lease" => Ok(Backend::Lease),
                        other => Err(format!("--backends: unknown backend {other:?}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--json" => json = true,
            "--keep-logs" => keep_logs = true,
            "--ttl" => {
                let v = it
                    .next()
                    .ok_or("--ttl needs a duration, e.g. 500ms or 2s")?;
                ttl = Some((v.clone(), parse_duration(v)?));
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
    let bin = pgelect_bin()?;
    let (url, cluster) = crate::database()?;
    let bouncer = match &cluster {
        Some(c) if pgelect_testkit::pgbouncer_available() => Some(
            pgelect_testkit::PgBouncer::start(c, pgelect_testkit::PoolMode::Transaction)
                .map_err(|e| format!("cannot start pgbouncer: {e}"))?,
        ),
        _ => None,
    };
    let lease_url = match &bouncer {
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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let setup = Setup {
        bin,
        url,
        lease_url,
        dir: dir.clone(),
        settle,
        ttl,
    };
    let result = rt.block_on(measure(&setup, &backends, lease_path, trials, json));
    if result.is_ok() && !keep_logs {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("cli-handoff: the supervisors' logs (-vv) are in {dir:?}");
    }
    result
}

/// `500ms`, `2s` or `1.5s`.
fn parse_duration(v: &str) -> Result<Duration, String> {
    let bad = || format!("--ttl {v:?}: give milliseconds (500ms) or seconds (2s)");
    let (number, scale) = match v.strip_suffix("ms") {
        Some(n) => (n, 1e-3),
        None => (v.strip_suffix('s').ok_or_else(bad)?, 1.0),
    };
    let x: f64 = number.parse().map_err(|_| bad())?;
    Duration::try_from_secs_f64(x * scale)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(bad)
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
            "no pgelect binary at {bin:?}: build it into the same profile (cargo build --release -p pgelect-cli) or set PGELECT_BIN"
        ))
    }
}

struct Setup {
    bin: PathBuf,
    /// Direct: the session backend, LISTEN, the observer.
    url: String,
    /// Through PgBouncer when there is one: the lease backend.
    lease_url: String,
    /// Logs of the supervisors.
    dir: PathBuf,
    /// How long a standby stands before the leader is stopped.
    settle: Duration,
    /// `--ttl` as given (for `pgelect run`) and parsed (for the library);
    /// both use their default if `None`.
    ttl: Option<(String, Duration)>,
}

struct Series {
    backend: Backend,
    command: Vec<f64>,
    library: Vec<f64>,
}

fn name(b: Backend) -> &'static str {
    match b {
        Backend::Session => "session",
        _ => "lease",
    }
}

async fn measure(
    setup: &Setup,
    backends: &[Backend],
    lease_path: &str,
    trials: usize,
    json: bool,
) -> Result<(), String> {
    let direct = ConnectOptions::from_url(&setup.url).map_err(|e| e.to_string())?;
    pgelect::migrate(&direct).await.map_err(|e| e.to_string())?;
    let observer = connect(&setup.url).await?;
    let mut series = Vec::new();
    for &backend in backends {
        let role = format!("bench-cli-{}", name(backend));
        let mut leader = Supervisor::spawn(setup, &role, backend, "n0")?;
        leader.started(STEP).await?;
        let mut s = Series {
            backend,
            command: Vec::with_capacity(trials),
            library: Vec::with_capacity(trials),
        };
        for i in 0..trials {
            let node = format!("n{}", i + 1);
            let mut standby = Supervisor::spawn(setup, &role, backend, &node)?;
            standby_ready(&observer, setup, &role, backend, &node).await?;
            let t0 = wall_ns();
            leader.terminate()?;
            let started = standby.started(STEP).await?;
            s.command.push((started - t0) as f64 / 1e6);
            leader.exited(STEP).await?;
            leader = standby;
            s.library
                .push(library_trial(setup, backend, &observer).await?);
            if !json && (i + 1) % 10 == 0 {
                eprintln!(
                    "cli-handoff: {}: {} of {trials} trials",
                    name(backend),
                    i + 1
                );
            }
        }
        leader.terminate()?;
        leader.exited(STEP).await?;
        series.push(s);
    }
    let mut figures = Rows::default();
    for s in &series {
        let b = name(s.backend);
        figures.latency(&format!("cli-handoff/{b}-command-sigterm"), &s.command);
        figures.latency(&format!("cli-handoff/{b}-library-resign"), &s.library);
    }
    let mut line = serde_json::json!({
        "bench": "cli-handoff",
        "trials": trials,
        "lease_path": lease_path,
        "settle_ms": setup.settle.as_millis() as u64,
        "ttl_ms": setup.ttl.as_ref().map(|(_, d)| d.as_millis() as u64),
        "series": series.iter().map(|s| serde_json::json!({
            "backend": name(s.backend),
            "command_sigterm_to_successor_started_ms": Stats::of(&s.command).json(),
            "library_resign_to_standby_elected_ms": Stats::of(&s.library).json(),
        })).collect::<Vec<_>>(),
    });
    if !json {
        println!(
            "cli-handoff, {trials} trials per series (lease backend through {lease_path}; standbys settled {} ms; ttl {})\n",
            setup.settle.as_millis(),
            setup.ttl.as_ref().map_or("default", |(t, _)| t.as_str())
        );
        println!(
            "{:<48} {:>9} {:>9} {:>9} {:>9}",
            "series (ms)", "p50", "p99", "min", "max"
        );
        for s in &series {
            for (what, samples) in [
                (
                    "command: SIGTERM -> successor's command started",
                    &s.command,
                ),
                ("library: resign() -> standby elected", &s.library),
            ] {
                let st = Stats::of(samples);
                println!(
                    "{:<48} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
                    format!("{} {what}", name(s.backend)),
                    st.p50,
                    st.p99,
                    st.min,
                    st.max
                );
            }
        }
        println!("\ntargets: command p50 <= 50 ms (session), <= 100 ms (lease)\n");
    }
    figures.attach(&mut line);
    println!("{line}");
    Ok(())
}

/// Nanoseconds since the epoch: comparable between processes on one host.
fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("BUG: the clock is after 1970")
        .as_nanos()
}

/// A `pgelect run` process whose command prints `STARTED <node> <ns>`.
struct Supervisor {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    node: String,
}

impl Supervisor {
    fn spawn(setup: &Setup, role: &str, backend: Backend, node: &str) -> Result<Self, String> {
        let me = std::env::current_exe().map_err(|e| e.to_string())?;
        let log = std::fs::File::create(setup.dir.join(format!("{role}-{node}.log")))
            .map_err(|e| format!("cannot create a log file: {e}"))?;
        let mut cmd = Command::new(&setup.bin);
        cmd.args(["-vv", "run", "--role", role, "--id", node]);
        if let Some((ttl, _)) = &setup.ttl {
            cmd.args(["--ttl", ttl]);
        }
        match backend {
            Backend::Session => {
                cmd.args(["--database-url", &setup.url]);
            }
            _ => {
                cmd.args(["--backend", "lease", "--database-url", &setup.lease_url])
                    .args(["--listen-url", &setup.url]);
            }
        }
        cmd.arg("--")
            .arg(me)
            .args(["cli-handoff", "--child", "started"])
            .env_remove("DATABASE_URL")
            .stdout(Stdio::piped())
            .stderr(log);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot run {:?}: {e}", setup.bin))?;
        let out = child.stdout.take().expect("BUG: piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Supervisor {
            child,
            lines,
            node: node.to_owned(),
        })
    }

    /// Waits until its command has started; returns when it did (wall ns).
    async fn started(&mut self, within: Duration) -> Result<u128, String> {
        let deadline = Instant::now() + within;
        loop {
            match self.lines.try_recv() {
                Ok(l) => {
                    if let Some(rest) = l.strip_prefix("STARTED ") {
                        let (node, ns) = rest.split_once(' ').ok_or("bad STARTED line")?;
                        if node != self.node {
                            return Err(format!("{node} started, expected {}", self.node));
                        }
                        return ns.parse().map_err(|_| "bad STARTED time".to_owned());
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    if Instant::now() > deadline {
                        return Err(format!(
                            "{}'s command did not start within {within:?}",
                            self.node
                        ));
                    }
                    if let Ok(Some(status)) = self.child.try_wait() {
                        return Err(format!("pgelect run ({}) exited: {status}", self.node));
                    }
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                Err(e) => return Err(format!("{}: output ended: {e}", self.node)),
            }
        }
    }

    fn terminate(&self) -> Result<(), String> {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM)
            .map_err(|e| format!("cannot SIGTERM pgelect run: {e}"))
    }

    /// Waits for `pgelect run` to exit, with code 0.
    async fn exited(&mut self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("pgelect run ({}) exited with {status}", self.node))
                };
            }
            if Instant::now() > deadline {
                return Err(format!("pgelect run ({}) did not exit", self.node));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the standby `node` would be told of a release at once: for
/// the session backend, its wait for the lock shows in `pg_locks`; for the
/// lease backend, its LISTEN connection is idle (LISTEN done); then
/// `--settle-ms` (default [`SETTLE`]; 0 measures a standby started just
/// before the leader is stopped, as in a rolling restart).
async fn standby_ready(
    observer: &tokio_postgres::Client,
    setup: &Setup,
    role: &str,
    backend: Backend,
    node: &str,
) -> Result<(), String> {
    let deadline = Instant::now() + STEP;
    let key = role_key(setup, role)?;
    let app = format!("pgelect:listen:{role}:{node}");
    loop {
        let row =
            match backend {
                Backend::Session => observer
                    .query_typed_one(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
                           AND ((classid::bigint << 32) | objid::bigint) = $1 AND objsubid = 1",
                        &[(&key, Type::INT8)],
                    )
                    .await,
                _ => {
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
        if row.get::<_, i64>(0) > 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("standby {node} not waiting within {STEP:?}"));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // A standby that just started is still busy for a moment (its
    // observer's or first campaign's connection, authentication included);
    // a planned handoff in production meets a standby that has settled.
    tokio::time::sleep(setup.settle).await;
    Ok(())
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
) -> Result<f64, String> {
    let role = format!("bench-lib-{}", name(backend));
    let direct = ConnectOptions::from_url(&setup.url).map_err(|e| e.to_string())?;
    let mk = |node: &str| -> Result<Elector, String> {
        let b = match backend {
            Backend::Session => Elector::builder(direct.clone(), &role),
            _ => Elector::builder(
                ConnectOptions::from_url(&setup.lease_url).map_err(|e| e.to_string())?,
                &role,
            )
            .backend(Backend::Lease)
            .lease(|l| l.listen_via(direct.clone())),
        };
        let b = match setup.ttl {
            Some((_, ttl)) => b.ttl(ttl),
            None => b,
        };
        b.node_id(node).build().map_err(|e| e.to_string())
    };
    let a = mk("lib-a")?;
    let b = mk("lib-b")?;
    let la = a.leadership().await.map_err(|e| e.to_string())?;
    let wait = tokio::spawn(async move {
        let l = b.leadership().await;
        (Instant::now(), l, b)
    });
    standby_ready(observer, setup, &role, backend, "lib-b").await?;
    let t0 = Instant::now();
    la.resign().await.map_err(|e| e.to_string())?;
    let (elected, l, _b) = wait.await.map_err(|e| e.to_string())?;
    let l = l.map_err(|e| e.to_string())?;
    let ms = (elected - t0).as_secs_f64() * 1000.0;
    l.resign().await.map_err(|e| e.to_string())?;
    Ok(ms)
}

/// The supervised command: prints `STARTED <node> <wall ns>` at once, then
/// waits to be stopped (SIGTERM's default action ends it).
fn child(args: &[String]) -> Result<(), String> {
    let now = wall_ns();
    match args {
        [mode] if mode == "started" => {
            let node = std::env::var("PGELECT_NODE").unwrap_or_default();
            println!("STARTED {node} {now}");
            loop {
                std::thread::park();
            }
        }
        _ => Err(format!("cli-handoff --child: bad arguments {args:?}")),
    }
}
