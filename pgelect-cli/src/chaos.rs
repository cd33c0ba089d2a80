//! `pgelect chaos`: real `pgelect run` supervisors against a database,
//! faults injected on a seeded schedule, and an independent check of what
//! the workers recorded: never two leaders acting at once (outside a pause,
//! whose fenced writes must then be refused), fenced writes in term order,
//! terms rising, no acknowledged write lost.
//!
//! Each supervisor runs this binary's hidden `chaos-worker` as its command.
//! A worker appends to a log of its own: `start`, a `tick` every 5 ms,
//! `write SEQ ok|refused` for a fenced insert every 50 ms (`pgelect.fence`
//! and the insert in one transaction), and `stop` on SIGTERM. The checker
//! reads only those logs and the table, never the supervisors' state.
//!
//! This first version injects process faults (SIGKILL, SIGSTOP beyond the
//! TTL then SIGCONT, SIGTERM) and `pg_terminate_backend` on the leader's
//! backends; network faults, server restarts and pooler faults are not in
//! it yet.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};
use tokio::process::{Child, Command};

use crate::cli::Global;
use crate::exit::{self, Failure};
use crate::run::{BackendArg, ProfileArg};

#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// Supervisors standing at once (each a separate `pgelect run`).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(3..=16))]
    pub candidates: u8,
    /// How long faults are injected, per backend.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "60s", value_name = "DURATION")]
    pub duration: Duration,
    /// Seed of the fault schedule (printed; give it again to replay).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The candidates' --ttl.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "2s", value_name = "DURATION")]
    pub ttl: Duration,
    /// The candidates' --profile.
    #[arg(long, value_enum, default_value_t = ProfileArg::Standard)]
    pub profile: ProfileArg,
    /// Backends to run, one after the other.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["session", "lease"])]
    pub backends: Vec<BackendArg>,
    /// Faults to draw from.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["kill", "stop", "term", "terminate", "blackhole", "latency"])]
    pub faults: Vec<Fault>,
    /// Write one JSON object per fault and backend to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// A fault the command injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ValueEnum)]
pub enum Fault {
    /// SIGKILL the leader's supervisor (a crash).
    Kill,
    /// SIGSTOP the leader's supervisor and worker for 1.5 × the TTL, then
    /// SIGCONT (a pause: only the fence protects).
    Stop,
    /// SIGTERM the leader's supervisor (a planned handover).
    Term,
    /// `pg_terminate_backend` on the leader's server backends.
    Terminate,
    /// The leader's traffic stops in both directions (its proxy stops
    /// forwarding, both TCP connections stay up) for 1.5 × the TTL.
    Blackhole,
    /// The leader's traffic is delayed (from a quarter of its heartbeat
    /// timeout to twice it, each way) for 1.5 × the TTL.
    Latency,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Stop => "stop",
            Fault::Term => "term",
            Fault::Terminate => "terminate",
            Fault::Blackhole => "blackhole",
            Fault::Latency => "latency",
        }
    }

    /// Whether the fault must end in a new term on `backend`: a delay may
    /// not, and a lease leader whose connection is terminated reconnects
    /// and renews within its deadline (it holds no lock on the connection).
    fn must_fail_over(self, backend: BackendArg) -> bool {
        !matches!(
            (self, backend),
            (Fault::Latency, _) | (Fault::Terminate, BackendArg::Lease)
        )
    }
}

/// The hidden worker: `pgelect chaos-worker --log FILE --table NAME`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[arg(long)]
    pub log: PathBuf,
    #[arg(long)]
    pub table: String,
}

const TICK: Duration = Duration::from_millis(5);
const WRITE_EVERY: u32 = 10;

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn fail(what: impl std::fmt::Display) -> Failure {
    Failure::new(exit::SOFTWARE, what.to_string())
}

/// The worker: records when it acts and makes fenced writes until SIGTERM.
pub async fn worker(global: &Global, args: WorkerArgs) -> Result<u8, Failure> {
    use std::io::Write;
    let var = |k: &str| {
        std::env::var(k).map_err(|_| {
            fail(format!(
                "{k} is not set: chaos-worker runs under pgelect run"
            ))
        })
    };
    let (role, node) = (var("PGELECT_ROLE")?, var("PGELECT_NODE")?);
    let term: i64 = var("PGELECT_TERM")?.parse().map_err(fail)?;
    let pid = std::process::id();
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.log)
        .map_err(fail)?;
    let mut line = |what: &str| {
        // One write per line (O_APPEND): lines never interleave.
        let _ = log.write_all(format!("{what} {node} {term} {} {pid}\n", now_ns()).as_bytes());
    };
    line("start");
    let options = global.connect_options()?;
    let schema = options.schema_name().as_str().to_owned();
    let (mut client, _notices) = crate::db::connect(&options, "pgelect:chaos-worker").await?;
    let mut term_signal =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(fail)?;
    let mut ticks = tokio::time::interval(TICK);
    let mut n: u32 = 0;
    let mut seq: i64 = 0;
    loop {
        tokio::select! {
            _ = term_signal.recv() => {
                line("stop");
                return Ok(0);
            }
            _ = ticks.tick() => {
                line("tick");
                n = n.wrapping_add(1);
                if n % WRITE_EVERY != 0 {
                    continue;
                }
                seq += 1;
                let r = async {
                    let tx = client.transaction().await?;
                    tx.query_one(&format!("SELECT {schema}.fence($1, $2)"), &[&role, &term]).await?;
                    tx.execute(
                        &format!("INSERT INTO {} (role, node, term, seq) VALUES ($1, $2, $3, $4)", args.table),
                        &[&role, &node, &term, &seq],
                    )
                    .await?;
                    tx.commit().await
                }
                .await;
                match r {
                    Ok(()) => line(&format!("write:{seq}:ok")),
                    Err(e) if e.code().is_some() => line(&format!("write:{seq}:refused")),
                    // The connection is gone: the supervisor will end us.
                    Err(_) => line(&format!("write:{seq}:failed")),
                }
            }
        }
    }
}

/// One line of a worker log.
#[derive(Clone, Debug)]
struct Event {
    what: String,
    node: String,
    term: i64,
    at: u128,
    pid: u32,
}

fn read_events(dir: &Path) -> Vec<Event> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        for l in text.lines() {
            let f: Vec<&str> = l.split_whitespace().collect();
            if let [what, node, term, at, pid] = f[..] {
                if let (Ok(term), Ok(at), Ok(pid)) = (term.parse(), at.parse(), pid.parse()) {
                    out.push(Event {
                        what: what.to_owned(),
                        node: node.to_owned(),
                        term,
                        at,
                        pid,
                    });
                }
            }
        }
    }
    out.sort_by_key(|e| e.at);
    out
}

/// A worker's acting interval.
#[derive(Clone, Debug)]
struct Interval {
    node: String,
    term: i64,
    pid: u32,
    start: u128,
    end: u128,
}

fn intervals(events: &[Event]) -> Vec<Interval> {
    let mut by_pid: BTreeMap<u32, Interval> = BTreeMap::new();
    for e in events {
        let i = by_pid.entry(e.pid).or_insert_with(|| Interval {
            node: e.node.clone(),
            term: e.term,
            pid: e.pid,
            start: e.at,
            end: e.at,
        });
        i.start = i.start.min(e.at);
        i.end = i.end.max(e.at);
    }
    let mut v: Vec<Interval> = by_pid.into_values().collect();
    v.sort_by_key(|i| i.start);
    v
}

/// Every pair of acting intervals of different workers that overlap, the
/// earlier-started first.
fn overlapping(ivs: &[Interval]) -> Vec<(&Interval, &Interval)> {
    let mut out = Vec::new();
    for (i, a) in ivs.iter().enumerate() {
        for b in ivs.iter().skip(i + 1) {
            if b.start < a.end && a.pid != b.pid {
                out.push((a, b));
            }
        }
    }
    out
}

/// xorshift64*: a replayable schedule without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One injected fault and what followed.
#[derive(Debug)]
struct Injected {
    fault: Fault,
    at: u128,
    node: String,
    term: i64,
    /// The next start of a higher term, if any.
    next_start: Option<u128>,
    /// For a pause: the frozen worker's pid and when it was continued.
    paused: Option<(u32, u128)>,
    skipped: Option<String>,
}

struct Supervisor {
    node: String,
    child: Child,
    /// The proxy its connections go through, when the URL allows one.
    proxy: Option<proxy::Proxy>,
}

/// A TCP proxy per supervisor, for the network faults: it can stop
/// forwarding (both TCP connections stay up: the kernels keep acknowledging)
/// or delay every chunk.
mod proxy {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    #[derive(Default)]
    struct State {
        blackhole: AtomicBool,
        delay_ms: AtomicU64,
    }

    pub struct Proxy {
        pub port: u16,
        state: Arc<State>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Proxy {
        pub async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
            let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
            let port = listener.local_addr()?.port();
            let state = Arc::new(State::default());
            let s = state.clone();
            let task = tokio::spawn(async move {
                let mut pipes = tokio::task::JoinSet::new();
                while let Ok((client, _)) = listener.accept().await {
                    let s = s.clone();
                    pipes.spawn(async move {
                        let Ok(server) = TcpStream::connect(upstream).await else {
                            return;
                        };
                        let (cr, cw) = client.into_split();
                        let (sr, sw) = server.into_split();
                        tokio::join!(pipe(cr, sw, &s), pipe(sr, cw, &s));
                    });
                }
            });
            Ok(Proxy { port, state, task })
        }

        pub fn blackhole(&self, on: bool) {
            self.state.blackhole.store(on, Ordering::SeqCst);
        }

        pub fn delay(&self, d: Duration) {
            self.state
                .delay_ms
                .store(d.as_millis() as u64, Ordering::SeqCst);
        }
    }

    impl Drop for Proxy {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        s: &State,
    ) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            // Blackholed: read nothing, so nothing is forwarded, not even
            // an end of stream, and both connections stay up.
            while s.blackhole.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let delay = s.delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            while s.blackhole.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    }
}

/// The URL through a proxy on a given port: `url` with its host and port
/// replaced by `127.0.0.1:port`.
type ProxiedUrl = Box<dyn Fn(u16) -> String + Send + Sync>;

/// The address `url` names and how to reach it through a proxy; `None`
/// unless it is a `postgres://` URL naming one TCP host (network faults
/// are then skipped).
async fn through_proxy(url: &str) -> Option<(std::net::SocketAddr, ProxiedUrl)> {
    let scheme = ["postgresql://", "postgres://"]
        .into_iter()
        .find(|p| url.starts_with(p))?;
    let rest = &url[scheme.len()..];
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    if hostport.contains(',') || hostport.is_empty() || hostport.starts_with('[') {
        return None;
    }
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<u16>().ok()?),
        None => (hostport, 5432),
    };
    let addr = tokio::net::lookup_host((host, port)).await.ok()?.next()?;
    let (scheme, tail) = (scheme.to_owned(), tail.to_owned());
    Some((
        addr,
        Box::new(move |p: u16| format!("{scheme}{userinfo}127.0.0.1:{p}{tail}")),
    ))
}

struct Run<'a> {
    exe: PathBuf,
    url_file: &'a Path,
    /// The database's address and the URL through a proxy.
    proxied: Option<&'a (std::net::SocketAddr, ProxiedUrl)>,
    schema: String,
    role: String,
    backend: BackendArg,
    args: &'a ChaosArgs,
    dir: PathBuf,
    table: String,
    next_id: u32,
}

impl Run<'_> {
    async fn spawn(&mut self) -> Result<Supervisor, Failure> {
        self.next_id += 1;
        let node = format!("c{}", self.next_id);
        let (proxy, url_file) = match self.proxied {
            Some((upstream, url_for)) => {
                let proxy = proxy::Proxy::start(*upstream)
                    .await
                    .map_err(|e| fail(format!("cannot start a proxy: {e}")))?;
                let path = self.dir.join(format!("{node}.url"));
                write_private(&path, &url_for(proxy.port))?;
                (Some(proxy), path)
            }
            None => (None, self.url_file.to_owned()),
        };
        let mut cmd = Command::new(&self.exe);
        let backend = match self.backend {
            BackendArg::Session => "session",
            BackendArg::Lease => "lease",
        };
        let profile = match self.args.profile {
            ProfileArg::Standard => "standard",
            ProfileArg::Fast => "fast",
        };
        cmd.args([
            "run",
            "--role",
            &self.role,
            "--id",
            &node,
            "--backend",
            backend,
        ])
        .args(["--profile", profile, "--ttl"])
        .arg(crate::duration::show(self.args.ttl))
        .args(["--grace", "1s", "--pass-database-env", "-q"])
        .args(["--schema", &self.schema, "--"])
        .arg(&self.exe)
        .args([
            "chaos-worker",
            "--schema",
            &self.schema,
            "--table",
            &self.table,
            "--log",
        ])
        .arg(self.dir.join(format!("{node}.log")))
        .env("PGELECT_DATABASE_URL_FILE", &url_file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .process_group(0);
        for var in [
            "DATABASE_URL",
            "PGPASSWORD",
            "PGHOST",
            "PGUSER",
            "PGDATABASE",
            "PGPORT",
        ] {
            cmd.env_remove(var);
        }
        let child = cmd
            .spawn()
            .map_err(|e| fail(format!("cannot start a supervisor: {e}")))?;
        Ok(Supervisor { node, child, proxy })
    }

    /// Waits for a start of a term above `above` after `after`; returns it.
    async fn next_start(&self, above: i64, after: u128, within: Duration) -> Option<Event> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Some(e) = read_events(&self.dir)
                .into_iter()
                .find(|e| e.what == "start" && e.term > above && e.at > after)
            {
                return Some(e);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    }
}

/// Writes `text` to a new file only this user can read (mode 0600).
fn write_private(path: &Path, text: &str) -> Result<(), Failure> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))
}

fn signal(pid: Option<u32>, sig: nix::sys::signal::Signal) {
    if let Some(pid) = pid {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
    }
}

async fn terminate_backends(
    client: &tokio_postgres::Client,
    role: &str,
    node: &str,
) -> Result<i64, String> {
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
               FROM pg_stat_activity
              WHERE pid <> pg_backend_pid()
                AND application_name LIKE 'pgelect:%'
                AND position(':' || $1 || ':' IN application_name || ':') > 0
                AND position(':' || $2 IN application_name) > 0",
            &[&role, &node],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(row.get(0))
}

/// The heartbeat timeout the candidates run with (what `pgelect run`
/// derives from --ttl and --profile).
fn heartbeat_timeout(run: &Run<'_>) -> Duration {
    let profile = match run.args.profile {
        ProfileArg::Standard => pgelect::Profile::Standard,
        ProfileArg::Fast => pgelect::Profile::Fast,
    };
    pgelect::ConnectOptions::from_url("postgres://chaos@127.0.0.1/chaos")
        .ok()
        .and_then(|o| {
            let b = pgelect::Elector::builder(o, "chaos").ttl(run.args.ttl);
            let b = match run.backend {
                BackendArg::Session => b.profile(profile),
                BackendArg::Lease => b.backend(pgelect::Backend::Lease),
            };
            b.build().ok()
        })
        .map(|e| e.timing().heartbeat_timeout)
        .unwrap_or(Duration::from_millis(200))
}

/// Runs one backend's schedule; returns the faults injected.
async fn schedule(
    run: &mut Run<'_>,
    admin: &tokio_postgres::Client,
    rng: &mut Rng,
) -> Result<Vec<Injected>, Failure> {
    let args = run.args;
    let mut sups: Vec<Supervisor> = Vec::new();
    for _ in 0..args.candidates {
        sups.push(run.spawn().await?);
    }
    let mut injected = Vec::new();
    let mut leader = run
        .next_start(0, 0, Duration::from_secs(60))
        .await
        .ok_or_else(|| fail("no leader within 60 s of the start"))?;
    let end = Instant::now() + args.duration;
    while Instant::now() < end {
        // Let the leader settle and write for a while.
        tokio::time::sleep(Duration::from_millis(500 + rng.below(1000))).await;
        let fault = args.faults[rng.below(args.faults.len() as u64) as usize];
        let at = now_ns();
        let Some(i) = sups.iter().position(|s| s.node == leader.node) else {
            return Err(fail(format!(
                "the leader {} is not one of ours",
                leader.node
            )));
        };
        let mut paused = None;
        let mut skipped = None;
        match fault {
            Fault::Kill => {
                let mut s = sups.remove(i);
                let _ = s.child.start_kill();
                let _ = s.child.wait().await;
                sups.push(run.spawn().await?);
            }
            Fault::Term => {
                let mut s = sups.remove(i);
                signal(s.child.id(), nix::sys::signal::Signal::SIGTERM);
                if tokio::time::timeout(Duration::from_secs(15), s.child.wait())
                    .await
                    .is_err()
                {
                    let _ = s.child.start_kill();
                }
                sups.push(run.spawn().await?);
            }
            Fault::Stop => {
                let sup = sups[i].child.id();
                signal(sup, nix::sys::signal::Signal::SIGSTOP);
                signal(Some(leader.pid), nix::sys::signal::Signal::SIGSTOP);
                tokio::time::sleep(args.ttl * 3 / 2).await;
                signal(sup, nix::sys::signal::Signal::SIGCONT);
                signal(Some(leader.pid), nix::sys::signal::Signal::SIGCONT);
                paused = Some((leader.pid, now_ns()));
            }
            Fault::Blackhole | Fault::Latency => match &sups[i].proxy {
                None => {
                    skipped =
                        Some("the URL is not a single-host postgres:// URL: no proxy".to_owned())
                }
                Some(p) => {
                    if fault == Fault::Blackhole {
                        p.blackhole(true);
                    } else {
                        let t = heartbeat_timeout(run);
                        let lo = (t / 4).as_millis() as u64;
                        let hi = (t * 2).as_millis() as u64;
                        p.delay(Duration::from_millis(lo + rng.below(hi - lo + 1)));
                    }
                    tokio::time::sleep(args.ttl * 3 / 2).await;
                    p.blackhole(false);
                    p.delay(Duration::ZERO);
                }
            },
            Fault::Terminate => match terminate_backends(admin, &run.role, &leader.node).await {
                Ok(0) => skipped = Some("no backend of the leader found".to_owned()),
                Ok(_) => {}
                Err(e) => skipped = Some(format!("pg_terminate_backend refused: {e}")),
            },
        }
        let next = if skipped.is_some() {
            None
        } else if fault.must_fail_over(run.backend) {
            run.next_start(leader.term, at, Duration::from_secs(60))
                .await
        } else {
            // The leader may stay in place: a new term counts only if it
            // began while the fault was on or right after.
            run.next_start(leader.term, at, Duration::from_millis(500))
                .await
        };
        injected.push(Injected {
            fault,
            at,
            node: leader.node.clone(),
            term: leader.term,
            next_start: next.as_ref().map(|e| e.at),
            paused,
            skipped,
        });
        if let Some(f) = injected.last() {
            let outcome = match (&f.skipped, f.next_start) {
                (Some(why), _) => format!("skipped: {why}"),
                (None, Some(n)) => format!(
                    "term {} began {:.1} ms later",
                    next.as_ref().map(|e| e.term).unwrap_or_default(),
                    n.saturating_sub(f.at) as f64 / 1e6
                ),
                (None, None) => "no new term".to_owned(),
            };
            println!(
                "  {:<9} on {} (term {}): {outcome}",
                f.fault.name(),
                f.node,
                f.term
            );
        }
        match next {
            Some(e) => leader = e,
            None if injected
                .last()
                .is_some_and(|f| f.skipped.is_some() || !f.fault.must_fail_over(run.backend)) => {}
            None => return Err(fail(format!("no new leader within 60 s of {fault:?}"))),
        }
    }
    for s in &sups {
        signal(s.child.id(), nix::sys::signal::Signal::SIGTERM);
    }
    for s in &mut sups {
        if tokio::time::timeout(Duration::from_secs(15), s.child.wait())
            .await
            .is_err()
        {
            let _ = s.child.start_kill();
        }
    }
    Ok(injected)
}

/// What the checker found for one backend.
#[derive(Default)]
struct Findings {
    violations: Vec<String>,
    /// When each overlap of two healthy leaders began.
    overlaps_at: Vec<u128>,
    /// When each overlap with a paused (then continued) leader began.
    paused_at: Vec<u128>,
    /// Stale writes committed, by when the overlap they belong to began.
    stale_at: Vec<(u128, usize)>,
    /// When each acknowledged but missing write was acknowledged.
    lost_at: Vec<u128>,
    writes_committed: usize,
}

impl Findings {
    /// Counts per fault: each finding goes to the last fault injected
    /// before it.
    fn by_fault(&self, injected: &[Injected], fault: Fault) -> (usize, usize, usize, usize) {
        let of = |t: u128| injected.iter().rev().find(|i| i.at <= t).map(|i| i.fault);
        let count = |v: &[u128]| v.iter().filter(|&&t| of(t) == Some(fault)).count();
        let stale = self
            .stale_at
            .iter()
            .filter(|(t, _)| of(*t) == Some(fault))
            .map(|(_, n)| n)
            .sum();
        (
            count(&self.overlaps_at),
            count(&self.paused_at),
            stale,
            count(&self.lost_at),
        )
    }
}

async fn check(
    run: &Run<'_>,
    admin: &tokio_postgres::Client,
    injected: &[Injected],
) -> Result<Findings, Failure> {
    let mut f = Findings::default();
    let events = read_events(&run.dir);
    let ivs = intervals(&events);
    // Terms rise with every start.
    for w in ivs.windows(2) {
        if w[1].term <= w[0].term {
            f.violations.push(format!(
                "terms did not rise: {} started term {} at {} after {} started term {} at {}",
                w[1].node, w[1].term, w[1].start, w[0].node, w[0].term, w[0].start
            ));
        }
    }
    // Committed writes, in commit order (the id is drawn inside the
    // transaction, after the fence, which holds the row against a bump).
    let rows = admin
        .query(
            &format!(
                "SELECT node, term, seq FROM {} WHERE role = $1 ORDER BY id",
                run.table
            ),
            &[&run.role],
        )
        .await
        .map_err(fail)?;
    let committed: Vec<(String, i64, i64)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    f.writes_committed = committed.len();
    for w in committed.windows(2) {
        if w[1].1 < w[0].1 {
            f.violations.push(format!(
                "fenced write {}#{} of term {} committed after {}#{} of term {}",
                w[1].0, w[1].2, w[1].1, w[0].0, w[0].2, w[0].1
            ));
        }
    }
    let have: HashSet<(String, i64, i64)> = committed.iter().cloned().collect();
    let first_write_of: HashMap<i64, usize> =
        committed
            .iter()
            .enumerate()
            .fold(HashMap::new(), |mut m, (i, (_, t, _))| {
                m.entry(*t).or_insert(i);
                m
            });
    for e in events.iter().filter(|e| e.what.starts_with("write:")) {
        let mut parts = e.what.split(':');
        let (_, seq, outcome) = (parts.next(), parts.next(), parts.next());
        let Some(seq) = seq.and_then(|s| s.parse::<i64>().ok()) else {
            continue;
        };
        if outcome == Some("ok") && !have.contains(&(e.node.clone(), e.term, seq)) {
            f.lost_at.push(e.at);
            f.violations.push(format!(
                "write {}#{seq} of term {} was acknowledged but is not in the table",
                e.node, e.term
            ));
        }
    }
    // Acting intervals of different workers must not overlap, except a
    // paused worker's after its pause: then none of its writes may commit
    // once the newer term wrote.
    let paused: HashMap<u32, u128> = injected.iter().filter_map(|i| i.paused).collect();
    for (a, b) in overlapping(&ivs) {
        {
            if paused.contains_key(&a.pid) {
                f.paused_at.push(b.start);
                if let Some(&newer) = first_write_of.get(&b.term) {
                    let stale = committed
                        .iter()
                        .skip(newer)
                        .filter(|(_, t, _)| *t == a.term)
                        .count();
                    if stale > 0 {
                        f.stale_at.push((b.start, stale));
                        f.violations.push(format!(
                            "{stale} write(s) of the paused {}'s term {} committed after term {} wrote",
                            a.node, a.term, b.term
                        ));
                    }
                }
                continue;
            }
            f.overlaps_at.push(b.start);
            f.violations.push(format!(
                "two leaders at once: {} (term {}, pid {}) acted until {} and {} (term {}, pid {}) began at {} ({:.1} ms overlap)",
                a.node, a.term, a.pid, a.end, b.node, b.term, b.pid, b.start,
                (a.end - b.start) as f64 / 1e6
            ));
        }
    }
    Ok(f)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[i.clamp(1, v.len()) - 1]
}

/// `pgelect chaos`.
pub async fn run(global: &Global, args: ChaosArgs) -> Result<u8, Failure> {
    let seed = match args.seed {
        Some(s) => s,
        None => (now_ns() as u64) | 1,
    };
    let (url, server) = match global.explicit_url()? {
        Some((url, _flag)) => (url, None),
        None => {
            let (url, server) = crate::demo::throwaway::start().await?;
            (url, Some(server))
        }
    };
    let options = pgelect::ConnectOptions::from_url(&url)?.schema(&global.schema)?;
    pgelect::migrate(&options).await?;
    let url_file = crate::demo::UrlFile::write(&url)?;
    let (admin, _notices) = crate::db::connect(&options, "pgelect:chaos").await?;
    let schema = options.schema_name().as_str().to_owned();
    let table = format!("pgelect_chaos_{seed:x}");
    admin
        .batch_execute(&format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, role text NOT NULL, node text NOT NULL,
                                   term bigint NOT NULL, seq bigint NOT NULL)"
        ))
        .await
        .map_err(|e| fail(format!("cannot create the table {table}: {e}")))?;
    println!(
        "pgelect chaos: seed {seed} (replay with --seed {seed}), {} candidates, ttl {}, profile {:?}, {} per backend, table {table}",
        args.candidates,
        crate::duration::show(args.ttl),
        args.profile,
        crate::duration::show(args.duration)
    );
    let exe = std::env::current_exe().map_err(fail)?;
    let proxied = through_proxy(&url).await;
    if proxied.is_none() {
        println!("  (the URL is not a single-host postgres:// URL: blackhole and latency faults are skipped)");
    }
    let mut rng = Rng(seed);
    let mut rows = Vec::new();
    let mut all_violations = Vec::new();
    let outcome: Result<(), Failure> = async {
        for &backend in &args.backends {
            let bname = match backend {
                BackendArg::Session => "session",
                BackendArg::Lease => "lease",
            };
            let role = format!("chaos-{seed:x}-{bname}");
            if let Some(l) = pgelect::current_leader(&options, &role).await? {
                return Err(Failure::new(
                    exit::USAGE,
                    format!(
                        "role {role:?} already has a leader ({}): refusing to run chaos on it",
                        l.holder
                    ),
                ));
            }
            let dir = url_file.dir().join(bname);
            std::fs::create_dir_all(&dir).map_err(fail)?;
            let mut run = Run {
                exe: exe.clone(),
                url_file: url_file.path(),
                proxied: proxied.as_ref(),
                schema: schema.clone(),
                role: role.clone(),
                backend,
                args: &args,
                dir,
                table: table.clone(),
                next_id: 0,
            };
            let injected = schedule(&mut run, &admin, &mut rng).await?;
            let found = check(&run, &admin, &injected).await?;
            let mut kinds: BTreeMap<Fault, Vec<&Injected>> = BTreeMap::new();
            for i in &injected {
                kinds.entry(i.fault).or_default().push(i);
            }
            for (fault, list) in kinds {
                let took: Vec<f64> = list
                    .iter()
                    .filter_map(|i| i.next_start.map(|n| (n.saturating_sub(i.at)) as f64 / 1e6))
                    .collect();
                let skipped = list.iter().filter(|i| i.skipped.is_some()).count();
                let (overlaps, paused, stale, lost) = found.by_fault(&injected, fault);
                rows.push(serde_json::json!({
                    "fault": fault.name(),
                    "backend": bname,
                    "trials": list.len(),
                    "skipped": skipped,
                    // Trials after which leadership moved (a delay, or a
                    // terminated lease connection, may leave it in place);
                    // the failover figures are over these.
                    "failovers": took.len(),
                    "overlaps": overlaps,
                    "paused_overlaps": paused,
                    "stale_writes_committed": stale,
                    "lost_writes": lost,
                    "failover_p50_ms": (percentile(&took, 50.0) * 10.0).round() / 10.0,
                    "failover_p99_ms": (percentile(&took, 99.0) * 10.0).round() / 10.0,
                    "max_gap_ms": (took.iter().copied().fold(0.0, f64::max) * 10.0).round() / 10.0,
                }));
            }
            println!(
                "{bname}: {} faults, {} fenced writes committed, {} violation(s)",
                injected.len(),
                found.writes_committed,
                found.violations.len()
            );
            all_violations.extend(
                found
                    .violations
                    .into_iter()
                    .map(|v| format!("{bname}: {v}")),
            );
        }
        Ok(())
    }
    .await;
    let _ = admin
        .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
        .await;
    drop(url_file);
    if let Some(s) = server {
        s.stop();
    }
    outcome?;
    println!(
        "\n{:<10} {:<8} {:>6} {:>6} {:>8} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9}",
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
        "max ms"
    );
    for r in &rows {
        println!(
            "{:<10} {:<8} {:>6} {:>6} {:>8} {:>6} {:>6} {:>6} {:>9.1} {:>9.1} {:>9.1}",
            r["fault"].as_str().unwrap_or(""),
            r["backend"].as_str().unwrap_or(""),
            r["trials"].as_u64().unwrap_or(0),
            r["failovers"].as_u64().unwrap_or(0),
            r["overlaps"].as_u64().unwrap_or(0),
            r["paused_overlaps"].as_u64().unwrap_or(0),
            r["stale_writes_committed"].as_u64().unwrap_or(0),
            r["lost_writes"].as_u64().unwrap_or(0),
            r["failover_p50_ms"].as_f64().unwrap_or(0.0),
            r["failover_p99_ms"].as_f64().unwrap_or(0.0),
            r["max_gap_ms"].as_f64().unwrap_or(0.0),
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&rows).map_err(fail)? + "\n",
        )
        .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))?;
    }
    if all_violations.is_empty() {
        println!("\nno violation: never two leaders acting at once outside a pause, writes in term order, terms rising, no acknowledged write lost");
        Ok(0)
    } else {
        for v in &all_violations {
            println!("VIOLATION {v}");
        }
        Ok(exit::SOFTWARE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(dir: &Path, name: &str, lines: &[&str]) {
        std::fs::write(dir.join(name), lines.join("\n") + "\n").unwrap();
    }

    #[test]
    fn the_checker_sees_an_overlap_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("pgelect-chaos-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // c1 acts 100..200 (term 1); c2 200..300 (term 2): back to back.
        log(
            &dir,
            "c1.log",
            &["start c1 1 100 11", "tick c1 1 150 11", "stop c1 1 200 11"],
        );
        log(
            &dir,
            "c2.log",
            &[
                "start c2 2 200 12",
                "write:1:ok c2 2 250 12",
                "tick c2 2 300 12",
            ],
        );
        let ivs = intervals(&read_events(&dir));
        assert_eq!(ivs.len(), 2);
        assert_eq!(
            (ivs[0].start, ivs[0].end, ivs[1].start, ivs[1].end),
            (100, 200, 200, 300)
        );
        assert!(overlapping(&ivs).is_empty());
        // c3 (term 3) begins at 290 while c2 still ticks at 300: caught.
        log(
            &dir,
            "c3.log",
            &["start c3 3 290 13", "tick c3 3 400 13", "garbage line"],
        );
        let ivs = intervals(&read_events(&dir));
        let found = overlapping(&ivs);
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].0.node.as_str(), found[0].1.node.as_str()),
            ("c2", "c3")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
