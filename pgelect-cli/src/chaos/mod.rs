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
//! Faults come in up to three phases per backend. The first: process faults
//! (SIGKILL, SIGSTOP beyond the TTL then SIGCONT, SIGTERM, CPU starvation by
//! a SIGSTOP/SIGCONT duty cycle), `pg_terminate_backend` on the leader's
//! backends, a blackhole or added latency in a TCP proxy of its own per
//! supervisor, a wall-clock jump (libfaketime) and, on the throwaway server,
//! restarts (fast and immediate). The second, on the throwaway server only
//! and as root: real network partitions, each supervisor in a network
//! namespace of its own ([`netns`]) and a database user of its own, with
//! and without `pg_signal_backend` (zombie preemption). The third, on a
//! throwaway primary with a streaming replica ([`promote`]): the primary
//! killed and the replica promoted, the candidates on a URL naming both
//! servers (the lease backend's through PgBouncer in front of an address
//! that follows the primary, [`pooler`]). Faults are drawn
//! from a seeded generator in rounds (every kind once per round, at least
//! one round), so that `--seed` replays a run. A fault that cannot run here
//! is recorded as a skipped trial with its reason.
//!
//! Every fault has a bound on the time until the next leader acts
//! ([`bound`], one table); a longer gap is a violation, as is a healthy
//! leader's refused or lost write.

mod netns;
mod pooler;
mod promote;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};
use tokio::process::{Child, Command};
use tokio_postgres::types::Type;

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
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["kill", "stop", "term", "terminate", "blackhole", "latency", "starve", "clock-jump", "restart-fast", "restart-immediate", "pgbouncer-restart", "partition", "partition-nopreempt", "promote"])]
    pub faults: Vec<Fault>,
    /// The lease backend's supervisors and their workers connect through
    /// this pooler (e.g. PgBouncer in transaction mode in front of the
    /// --database-url server); their LISTEN connection connects directly.
    /// The session backend never uses it. Default: on its own throwaway
    /// server, a PgBouncer in transaction mode it starts; against your
    /// database, none. A password here is visible to every local user:
    /// prefer --pooler-url-file.
    #[arg(long, value_name = "URL", conflicts_with = "no_pooler")]
    pub pooler_url: Option<String>,
    /// Read the --pooler-url URL from this file (a trailing newline is
    /// ignored). Keep it private (mode 0600).
    #[arg(long, value_name = "PATH", conflicts_with = "no_pooler")]
    pub pooler_url_file: Option<PathBuf>,
    /// On the throwaway server, run the lease backend directly, without the
    /// PgBouncer chaos would start in front of it (and, for promote, in
    /// front of the primary address).
    #[arg(long)]
    pub no_pooler: bool,
    /// Write one JSON object per fault and backend to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Go on past --duration until every fault kind was injected at least
    /// once (per backend and phase).
    #[arg(long)]
    pub every_fault: bool,
    /// Keep the histories in DIR (a directory per backend: each worker's
    /// log and each supervisor's warnings), for a failing run's evidence.
    /// Default: a private directory removed at the end.
    #[arg(long, value_name = "DIR")]
    pub logs: Option<PathBuf>,
    /// Test only: also run a worker outside any supervisor, acting all the
    /// time with term 1, so that the checker must report violations.
    #[arg(long, hide = true)]
    pub rogue: bool,
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
    /// The leader's network namespace is cut off (the kernel drops its
    /// packets) until a new leader acts; candidates may preempt
    /// (`pg_signal_backend`).
    Partition,
    /// As `partition`, with `pg_signal_backend` revoked from every
    /// candidate's database user while it lasts: only the server's own TCP
    /// timers free the leader's lock.
    #[value(name = "partition-nopreempt")]
    PartitionNoPreempt,
    /// The leader's supervisor and worker starved of CPU for 1.5 × the TTL:
    /// each 10 ms they run 1 ms (SIGSTOP, SIGCONT), so timers fire late.
    /// Unlike a pause the supervisor keeps running now and then and must
    /// stop its worker in time: no overlap is excused.
    Starve,
    /// The leader's supervisor's wall clock jumps an hour forward or back
    /// (libfaketime, preloaded into every supervisor of the first phase),
    /// and back again after 1.5 × the TTL: nothing may depend on it.
    ClockJump,
    /// The throwaway server stopped (`pg_ctl stop -m fast`: clients
    /// disconnected, a clean shutdown) and started again.
    RestartFast,
    /// The throwaway server stopped with `-m immediate` (a crash: the next
    /// start recovers) and started again; acknowledged writes must survive.
    RestartImmediate,
    /// The PgBouncer chaos started in front of its throwaway server killed
    /// (SIGKILL: every connection through it drops) and started again; only
    /// where the lease backend runs through it (the session backend never
    /// does).
    #[value(name = "pgbouncer-restart")]
    PgbouncerRestart,
    /// On a throwaway primary with an asynchronous streaming replica (a
    /// phase of its own): the primary stopped with `-m immediate` and the
    /// replica promoted (`pg_ctl promote`); before the next one, a new
    /// replica of the promoted server. The candidates connect with a URL
    /// naming both servers and `target_session_attrs=read-write`; the lease
    /// backend's through PgBouncer in front of an address chaos points at
    /// the primary, where PgBouncer is installed (LISTEN on the two-host
    /// URL).
    Promote,
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
            Fault::Partition => "partition",
            Fault::PartitionNoPreempt => "partition-nopreempt",
            Fault::Starve => "starve",
            Fault::ClockJump => "clock-jump",
            Fault::RestartFast => "restart-fast",
            Fault::RestartImmediate => "restart-immediate",
            Fault::PgbouncerRestart => "pgbouncer-restart",
            Fault::Promote => "promote",
        }
    }

    /// Whether the fault needs a primary with a replica (the third phase).
    fn needs_replica(self) -> bool {
        self == Fault::Promote
    }

    /// Whether the fault needs candidates in network namespaces (the second
    /// phase).
    fn needs_netns(self) -> bool {
        matches!(self, Fault::Partition | Fault::PartitionNoPreempt)
    }

    /// Whether the fault must end in a new term on `backend`: a delay may
    /// not, and a lease leader whose connection is terminated reconnects
    /// and renews within its deadline (it holds no lock on the connection).
    fn must_fail_over(self, backend: BackendArg) -> bool {
        !matches!(
            (self, backend),
            (Fault::Latency | Fault::Starve | Fault::ClockJump, _)
                | (
                    Fault::Terminate
                        | Fault::RestartFast
                        | Fault::RestartImmediate
                        | Fault::PgbouncerRestart
                        | Fault::Promote,
                    BackendArg::Lease
                )
        )
    }
}

/// Slack added to every bound: starting the worker process, connecting, and
/// a loaded machine (CI: 2 cores, four test binaries at once).
const SLACK: Duration = Duration::from_secs(3);

/// A lease-backend standby's longest sleep between two attempts without a
/// LISTEN connection (the library's `retry_every` default).
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// A starved leader runs STARVE_ON of every STARVE_OFF + STARVE_ON.
const STARVE_ON: Duration = Duration::from_millis(1);
const STARVE_OFF: Duration = Duration::from_millis(9);

/// The longest a restart of the throwaway server may take (stop, crash
/// recovery, start) on a loaded machine.
const RESTART: Duration = Duration::from_secs(10);

/// The longest a restart of chaos's own PgBouncer may take: the test kit
/// gives up (and chaos fails) when no query went through it within 10 s.
const POOLER_RESTART: Duration = Duration::from_secs(10);

/// After a server restart, PgBouncer tries to log in to the server again
/// only `server_login_retry` later (1 s in chaos's own PgBouncer): a lease
/// candidate through it may wait that much more than one connecting
/// directly.
const POOLER_LOGIN_RETRY: Duration = Duration::from_secs(1);

/// The longest a promotion may take on a loaded machine: the primary's
/// `pg_ctl stop -m immediate`, `pg_ctl promote`, and the first write the
/// new primary accepts (measured 0.1-0.2 s on this 2-core machine).
const PROMOTE: Duration = Duration::from_secs(5);

/// The longest a candidate waits between two connection attempts: its
/// backoff doubles from 100 ms up to this (the library's reconnection
/// backoff). While the primary is down it may have grown this far.
const RECONNECT_CAP: Duration = Duration::from_secs(5);

/// The longest time from injecting `fault` on `backend` until the next
/// leader's worker acts: the mechanism's bound as the README states it,
/// plus [`SLACK`]. The one table of bounds; `max_gap_ms` is checked
/// against it.
fn bound(fault: Fault, backend: BackendArg, t: &pgelect::TimingReport) -> Duration {
    use BackendArg::{Lease, Session};
    // When a lease leader's lease has surely expired on the server clock,
    // and a standby noticed (jitter at most 50 ms).
    let lease_gone = t.ttl + Duration::from_millis(50);
    let mechanism = match (fault, backend) {
        // The socket closes with the process (or the server ends it): the
        // lock is free at once; an unclean takeover waits the handover
        // delay.
        (Fault::Kill | Fault::Terminate, Session) => t.handover_delay,
        (Fault::Kill | Fault::Terminate, Lease) => lease_gone,
        // Planned: the leader releases; a lease standby without LISTEN
        // polls within retry_every.
        (Fault::Term, Session) => Duration::ZERO,
        (Fault::Term, Lease) => RETRY_EVERY,
        // The fault lasts 1.5 × ttl; then at the latest the old leader finds
        // its deadline passed and lets go (or was preempted before).
        (Fault::Stop | Fault::Blackhole | Fault::Latency | Fault::Starve | Fault::ClockJump, _) => {
            t.ttl * 3 / 2 + t.handover_delay + RETRY_EVERY
        }
        // The lease expires (ttl); a standby's observer preempts within its
        // next check, then the handover delay. A worker cut off inside a
        // fenced transaction holds the row until the server ends its
        // session (its idle_in_transaction_session_timeout, = ttl): the
        // term bump waits for that.
        (Fault::Partition, Session) => t.ttl * 3 + t.handover_delay,
        // Only the server's TCP timers free the lock: keepalives derived
        // from the ttl end a silent client within ttl + ttl/6 + 1 s (whole
        // seconds) or tcp_user_timeout (= ttl); then the handover delay.
        (Fault::PartitionNoPreempt, Session) => {
            t.ttl * 3 + Duration::from_secs(1) + t.handover_delay
        }
        (Fault::Partition | Fault::PartitionNoPreempt, Lease) => lease_gone + t.ttl,
        // Every connection ends; the server is back within RESTART (the
        // gap includes its downtime); candidates reconnect with backoff
        // (at most a second), and a session leader's successor waits the
        // handover delay.
        // Through a pooler (lease backend), PgBouncer's login retry more.
        (Fault::RestartFast | Fault::RestartImmediate, Session) => {
            RESTART + RETRY_EVERY + t.handover_delay
        }
        (Fault::RestartFast | Fault::RestartImmediate, Lease) => {
            RESTART + POOLER_LOGIN_RETRY + RETRY_EVERY + t.handover_delay
        }
        // Every connection through the pooler ends; it is back within
        // POOLER_RESTART. The leader may renew then and keep its term;
        // otherwise its lease expires a ttl after its last renewal at the
        // latest, and a standby retries within retry_every of the later of
        // the two. (Session backend: never through a pooler, skipped; the
        // same bound.)
        (Fault::PgbouncerRestart, _) => {
            POOLER_RESTART.max(lease_gone) + RETRY_EVERY + t.handover_delay
        }
        // Every connection ends with the primary; the replica accepts
        // writes within PROMOTE; candidates find it on their next attempt
        // (backoff: at most RECONNECT_CAP later) and the session leader's
        // successor waits the handover delay (the row names the dead
        // holder). A lease leader renews on the new primary (its row was
        // replicated); otherwise the first standby on the new primary
        // re-arms the lease row written before the promotion for a ttl
        // (asynchronous replication may have lost the last renewals) and
        // takes it over when that ends, retrying within retry_every.
        // Through PgBouncer (lease backend, where installed) in front of
        // the primary address, which chaos re-points once the promotion is
        // done: PgBouncer's logins fail until then, and after a failed one
        // it refuses its clients ("server login has been failing") and
        // tries again only server_login_retry later (POOLER_LOGIN_RETRY,
        // 1 s in the kit's ini). The last failed login may come just before
        // the re-pointing, so the candidates reach the new primary at most
        // that much later than directly. A login to the dead primary never
        // waits on server_connect_timeout (the kit's ini leaves PgBouncer's
        // 15 s default): the front accepts and closes at once, its own
        // connection refused on loopback. As for restarts, the lease
        // backend's bound covers its pooled path (1 s more when direct).
        (Fault::Promote, Session) => PROMOTE + RECONNECT_CAP + t.handover_delay,
        (Fault::Promote, Lease) => {
            PROMOTE
                + POOLER_LOGIN_RETRY
                + RECONNECT_CAP
                + lease_gone
                + RETRY_EVERY
                + t.handover_delay
        }
    };
    mechanism + SLACK
}

/// The hidden worker: `pgelect chaos-worker --log FILE --table NAME`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[arg(long)]
    pub log: PathBuf,
    #[arg(long)]
    pub table: String,
    /// `idle_in_transaction_session_timeout` of its connection, in
    /// milliseconds (0: the server's).
    #[arg(long, default_value_t = 0)]
    pub idle_in_transaction_ms: u64,
}

/// The node name of the test-only rogue worker (`--rogue`).
const ROGUE: &str = "rogue";

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
    if std::env::var_os("LD_PRELOAD").is_some_and(|v| v.to_string_lossy().contains("faketime")) {
        // The clock jump is the supervisor's: the worker's log must carry
        // real time. Same pid after exec.
        use std::os::unix::process::CommandExt;
        let e = std::process::Command::new(std::env::current_exe().map_err(fail)?)
            .args(std::env::args_os().skip(1))
            .env_remove("LD_PRELOAD")
            .env_remove("FAKETIME_TIMESTAMP_FILE")
            .exec();
        return Err(fail(format!(
            "cannot re-execute the worker without libfaketime: {e}"
        )));
    }
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
    // Through the pooler for the lease backend (transaction mode): every
    // statement runs inside the fenced transaction, unnamed (no prepared
    // statement outlives it), and the idle timeout is the transaction's own
    // (a session setting would land on a pooled server connection that
    // other clients use next).
    let connect = || async {
        let (client, _notices) = crate::db::connect(&options, "pgelect:chaos-worker").await?;
        Ok::<_, Failure>(client)
    };
    // A fenced transaction holds the role's row FOR SHARE, and every
    // takeover waits for it: if this process is cut off or frozen
    // mid-transaction, the server must end the session (see the README's
    // note on fencing connections; `fence` also bounds it by the lease).
    let idle_limit = (args.idle_in_transaction_ms > 0).then(|| {
        format!(
            "SET LOCAL idle_in_transaction_session_timeout = {}",
            args.idle_in_transaction_ms
        )
    });
    let fence_sql = format!("SELECT {schema}.fence($1, $2)");
    let insert_sql = format!(
        "INSERT INTO {} (role, node, term, seq) VALUES ($1, $2, $3, $4)",
        args.table
    );
    let mut client = connect().await?;
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
                if !n.is_multiple_of(WRITE_EVERY) {
                    continue;
                }
                seq += 1;
                if client.is_closed() {
                    // The server restarted (or ended this session): a
                    // leader that kept its term writes on.
                    match tokio::time::timeout(Duration::from_secs(1), connect()).await {
                        Ok(Ok(c)) => client = c,
                        _ => {
                            line(&format!("write:{seq}:failed"));
                            continue;
                        }
                    }
                }
                let r = async {
                    let tx = client.transaction().await?;
                    if let Some(limit) = &idle_limit {
                        tx.batch_execute(limit).await?;
                    }
                    tx.query_typed(&fence_sql, &[(&role, Type::TEXT), (&term, Type::INT8)]).await?;
                    tx.execute_typed(
                        &insert_sql,
                        &[(&role, Type::TEXT), (&node, Type::TEXT), (&term, Type::INT8), (&seq, Type::INT8)],
                    )
                    .await?;
                    tx.commit().await
                }
                .await;
                match r {
                    Ok(()) => line(&format!("write:{seq}:ok")),
                    // The server refused the write: the fence (PE001 stale,
                    // PE002 no holder), or anything else it decided about
                    // the transaction (a deadlock would count too).
                    Err(e) if e.code().is_some_and(|c| !matches!(c.code().get(..2), Some("08" | "57"))) => {
                        line(&format!("write:{seq}:refused"))
                    }
                    // The connection is gone (class 08, which is also what
                    // PgBouncer sends when it cannot serve it) or the server
                    // is shutting down (57): no verdict on the write (the
                    // supervisor ends us if leadership went).
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
        if e.path().extension().is_none_or(|x| x != "log") {
            continue;
        }
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

/// One interval per worker process. A worker is named by its supervisor's
/// node, its term and its pid together: over a long run the kernel reuses
/// pids (a soak merged a term-9 worker with a later one of the same pid
/// into one interval 24 minutes long).
fn intervals(events: &[Event]) -> Vec<Interval> {
    let mut by_worker: BTreeMap<(&str, i64, u32), Interval> = BTreeMap::new();
    for e in events {
        let key = (e.node.as_str(), e.term, e.pid);
        let i = by_worker.entry(key).or_insert_with(|| Interval {
            node: e.node.clone(),
            term: e.term,
            pid: e.pid,
            start: e.at,
            end: e.at,
        });
        i.start = i.start.min(e.at);
        i.end = i.end.max(e.at);
    }
    let mut v: Vec<Interval> = by_worker.into_values().collect();
    v.sort_by_key(|i| i.start);
    v
}

/// Every pair of acting intervals of different workers that overlap, the
/// earlier-started first.
fn overlapping(ivs: &[Interval]) -> Vec<(&Interval, &Interval)> {
    let mut out = Vec::new();
    for (i, a) in ivs.iter().enumerate() {
        for b in ivs.iter().skip(i + 1) {
            let same = a.pid == b.pid && a.node == b.node && a.term == b.term;
            if b.start < a.end && !same {
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
#[derive(Clone, Debug)]
struct Injected {
    fault: Fault,
    at: u128,
    node: String,
    term: i64,
    /// The next start of a higher term, if any.
    next_start: Option<u128>,
    /// For a pause: the frozen worker's pid and when it was continued.
    paused: Option<(u32, u128)>,
    /// For a promotion: from when the replica may have missed a commit
    /// (everything acknowledged before had reached it) until the primary
    /// died. An acknowledged write of that window may be lost with the
    /// primary (asynchronous replication): not a violation.
    unreplicated: Option<(u128, u128)>,
    /// For a promotion: the first fenced write acknowledged after the
    /// primary died (necessarily by the promoted server), if one came
    /// within the bound. A lease leader may keep its term through a
    /// promotion: then this, not a new term, shows it acting again.
    resumed: Option<u128>,
    skipped: Option<String>,
}

impl Injected {
    /// A fault that could not run here: one skipped trial with the reason,
    /// so that the table and the JSON say so.
    fn not_run(fault: Fault, why: &str) -> Injected {
        Injected {
            fault,
            at: now_ns(),
            node: "-".to_owned(),
            term: 0,
            next_start: None,
            paused: None,
            unreplicated: None,
            resumed: None,
            skipped: Some(why.to_owned()),
        }
    }
}

struct Supervisor {
    node: String,
    child: Child,
    /// The proxies its connections (and its worker's) go through, when the
    /// URLs allow them: one to the server, and one to the pooler when it
    /// connects through one.
    proxies: Vec<proxy::Proxy>,
    /// Its network namespace, in the partition phase.
    ns: Option<netns::Ns>,
    /// The file libfaketime reads its clock offset from, if preloaded.
    clock: Option<PathBuf>,
    /// Its process id, kept after it was reaped.
    pid: Option<u32>,
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

/// A single-host `postgres://` URL taken apart, to point it elsewhere.
struct UrlParts {
    scheme: String,
    /// `user:password@` or empty.
    userinfo: String,
    /// `/database?params`.
    tail: String,
    /// The server's address.
    addr: std::net::SocketAddr,
}

impl UrlParts {
    /// `None` unless `url` is a `postgres://` URL naming one TCP host
    /// (network faults are then skipped).
    async fn parse(url: &str) -> Option<UrlParts> {
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
        Some(UrlParts {
            scheme: scheme.to_owned(),
            userinfo,
            tail: tail.to_owned(),
            addr,
        })
    }

    /// The URL with the host and port replaced, and the user and password
    /// if `user` is given.
    fn to(&self, host: &str, port: u16, user: Option<(&str, &str)>) -> String {
        let userinfo = match user {
            Some((u, p)) => format!("{u}:{p}@"),
            None => self.userinfo.clone(),
        };
        format!("{}{userinfo}{host}:{port}{}", self.scheme, self.tail)
    }
}

/// The second phase's set-up: the bridge and namespaces, and the database
/// users the namespaced candidates connect as (one each, so that only
/// `pg_signal_backend` lets one end another's backend).
struct Netted {
    net: netns::Net,
    url: UrlParts,
    users: Vec<String>,
}

impl Netted {
    /// Grants or revokes `pg_signal_backend` for every candidate's user.
    async fn set_preempt(&self, admin: &Admin, on: bool) -> Result<(), Failure> {
        for u in &self.users {
            let sql = if on {
                format!("GRANT pg_signal_backend TO \"{u}\"")
            } else {
                format!("REVOKE pg_signal_backend FROM \"{u}\"")
            };
            admin
                .get()
                .await?
                .batch_execute(&sql)
                .await
                .map_err(|e| fail(format!("{sql}: {}", db_error(&e))))?;
        }
        Ok(())
    }
}

/// The command's own connection, made again when the server restarted.
struct Admin {
    options: pgelect::ConnectOptions,
    client: tokio::sync::Mutex<tokio_postgres::Client>,
}

impl Admin {
    async fn connect(options: &pgelect::ConnectOptions) -> Result<Admin, Failure> {
        let (client, _notices) = crate::db::connect(options, "pgelect:chaos").await?;
        Ok(Admin {
            options: options.clone(),
            client: tokio::sync::Mutex::new(client),
        })
    }

    /// The connection, reconnected if it was closed.
    async fn get(&self) -> Result<tokio::sync::MutexGuard<'_, tokio_postgres::Client>, Failure> {
        let mut c = self.client.lock().await;
        if c.is_closed() {
            let mut last = None;
            // The server may still be starting: a few attempts.
            for _ in 0..20 {
                match crate::db::connect(&self.options, "pgelect:chaos").await {
                    Ok((client, _)) => {
                        *c = client;
                        return Ok(c);
                    }
                    Err(e) => last = Some(e),
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            return Err(last.expect("BUG: no attempt made"));
        }
        Ok(c)
    }
}

/// The server's sessions that are not idle, and who blocks them: why a
/// takeover may hang.
/// What a run that found no new leader leaves as evidence: the sessions
/// that are not idle, the role's lease row, every session holding or
/// awaiting the role's lock (idle ones included: a lock holder between two
/// statements is idle), and the last lines each supervisor logged and each
/// worker wrote.
async fn stuck_state(admin: &Admin, run: &Run<'_>) -> String {
    let mut out = String::new();
    let admin = match admin.get().await {
        Ok(a) => a,
        Err(e) => return format!("  (cannot connect: {})", e.message),
    };
    let queries = [
        (
            "sessions not idle on the server",
            "SELECT format('  pid %s %s: %s, waiting %s, blocked by %s, for %s s: %s',
                           pid, application_name, state, coalesce(wait_event_type || '/' || wait_event, '-'),
                           pg_blocking_pids(pid), round(extract(epoch FROM now() - state_change)::numeric, 1),
                           left(query, 80))
               FROM pg_stat_activity
              WHERE state IS DISTINCT FROM 'idle' AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                .to_owned(),
        ),
        (
            "the role's lease row",
            format!(
                "SELECT format('  term %s, holder %s, holder_pid %s, backend %s, lease ends in %s s',
                               term, holder, holder_pid, backend,
                               round(extract(epoch FROM lease_until - now())::numeric, 1))
                   FROM {}.leaders WHERE role = $1",
                run.schema
            ),
        ),
        (
            "sessions holding or awaiting the role's lock",
            format!(
                "SELECT format('  pid %s %s: granted %s, %s for %s s: %s', a.pid, a.application_name,
                               k.granted, a.state,
                               round(extract(epoch FROM now() - a.state_change)::numeric, 1), left(a.query, 80))
                   FROM pg_locks k JOIN pg_stat_activity a ON a.pid = k.pid
                  WHERE k.locktype = 'advisory' AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND k.objsubid = 1 AND ((k.classid::bigint << 32) | k.objid::bigint) = {}.key($1)
                  ORDER BY k.granted DESC, a.pid",
                run.schema
            ),
        ),
    ];
    // The name an elector's lock key is hashed from.
    let lock_name = format!("election:{}:{}", run.schema, run.role);
    for (i, (title, sql)) in queries.into_iter().enumerate() {
        let rows = if i == 1 {
            admin.query(sql.as_str(), &[&run.role]).await
        } else if i == 2 {
            admin.query(sql.as_str(), &[&lock_name]).await
        } else {
            admin.query(sql.as_str(), &[]).await
        };
        out.push_str(&format!("{title}:\n"));
        match rows {
            Ok(rows) if rows.is_empty() => out.push_str("  (none)\n"),
            Ok(rows) => {
                for r in rows {
                    out.push_str(&r.get::<_, String>(0));
                    out.push('\n');
                }
            }
            Err(e) => out.push_str(&format!("  (cannot read: {})\n", db_error(&e))),
        }
    }
    // The logs are removed at the end unless --logs keeps them: their
    // tails go with the failure.
    let mut files: Vec<PathBuf> = std::fs::read_dir(&run.dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    for f in files {
        let (keep, what) = match f.extension().and_then(|x| x.to_str()) {
            Some("stderr") => (12, "supervisor log"),
            Some("log") => (3, "worker log"),
            _ => continue,
        };
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        out.push_str(&format!(
            "{what} {} (last {} of {} lines):\n",
            f.file_name().unwrap_or_default().to_string_lossy(),
            keep.min(lines.len()),
            lines.len()
        ));
        for l in &lines[lines.len().saturating_sub(keep)..] {
            out.push_str("  ");
            out.push_str(&l.chars().take(300).collect::<String>());
            out.push('\n');
        }
    }
    out
}

/// libfaketime's multi-threaded library, where Debian's `faketime`
/// package puts it.
fn find_faketime() -> Option<PathBuf> {
    let dirs = std::fs::read_dir("/usr/lib").ok()?;
    dirs.flatten()
        .map(|d| d.path().join("faketime/libfaketimeMT.so.1"))
        .chain([PathBuf::from("/usr/lib/faketime/libfaketimeMT.so.1")])
        .find(|p| p.exists())
}

/// A driver error with the server's message, if any.
fn db_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("ERROR: {}", d.message()),
        None => e.to_string(),
    }
}

/// 128 random bits as hex, from the kernel.
fn random_hex() -> Result<String, Failure> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| fail(format!("cannot read /dev/urandom: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

struct Run<'a> {
    exe: PathBuf,
    url_file: &'a Path,
    /// The database's URL, for a proxy per supervisor (first phase).
    proxied: Option<&'a UrlParts>,
    /// Namespaces and users (second phase).
    net: Option<&'a mut Netted>,
    /// libfaketime, preloaded into supervisors for clock jumps.
    faketime: Option<PathBuf>,
    /// The throwaway server, for restarts.
    server: Option<&'a crate::demo::throwaway::Server>,
    /// The primary and its replica, for promotions (third phase).
    replicas: Option<&'a mut promote::Pair>,
    /// The pooler the supervisors and their workers connect through (lease
    /// backend, first and promote phases), or why there is none.
    pooler: Result<&'a pooler::Pooler, String>,
    admin: &'a Admin,
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
        let mut ns = None;
        // The supervisor's URL file, its proxies, and the direct URL file
        // of its LISTEN connection and its worker when the supervisor goes
        // through a pooler.
        let pooler = self
            .pooler
            .as_ref()
            .ok()
            .copied()
            .filter(|_| self.net.is_none());
        let (proxies, url_file, direct) = match (&mut self.net, self.proxied) {
            (Some(netted), _) => {
                // A user of its own, with a candidate's and a fencer's
                // grants, the worker's table, and preemption.
                let user = format!(
                    "pgelect_chaos_{}_{}_{node}",
                    std::process::id(),
                    backend_name(self.backend)
                );
                let password = random_hex()?;
                let schema = pgelect::SchemaName::new(&self.schema)?;
                let mut sql = vec![format!(
                    "CREATE ROLE \"{user}\" LOGIN PASSWORD '{password}'"
                )];
                for kind in [pgelect::UserKind::Candidate, pgelect::UserKind::Fencer] {
                    sql.extend(
                        pgelect::grant_statements(kind, &user, &schema)?
                            .into_iter()
                            .map(|g| g.sql),
                    );
                }
                sql.push(pgelect::preemption_grant(&user)?.sql);
                sql.push(format!("GRANT INSERT ON {} TO \"{user}\"", self.table));
                sql.push(format!(
                    "GRANT USAGE ON SEQUENCE {}_id_seq TO \"{user}\"",
                    self.table
                ));
                for q in &sql {
                    self.admin
                        .get()
                        .await?
                        .batch_execute(q)
                        .await
                        .map_err(|e| {
                            fail(format!(
                                "cannot set up the candidate's user {user}: {}",
                                db_error(&e)
                            ))
                        })?;
                }
                netted.users.push(user.clone());
                let made = netted
                    .net
                    .add()
                    .map_err(|e| fail(format!("cannot make a network namespace: {e}")))?;
                let path = self.dir.join(format!("{node}.url"));
                let host = netted.net.host_addr().to_string();
                write_private(
                    &path,
                    &netted
                        .url
                        .to(&host, netted.url.addr.port(), Some((&user, &password))),
                )?;
                ns = Some(made);
                (Vec::new(), path, None)
            }
            (None, proxied) => {
                let path = self.dir.join(format!("{node}.url"));
                match (proxied, pooler) {
                    (Some(url), None) => {
                        let proxy = proxy_to(url, &path).await?;
                        (vec![proxy], path, None)
                    }
                    // Both paths proxied, so that a network fault cuts all
                    // of the leader's traffic.
                    (Some(url), Some(pooler)) if pooler.parts.is_some() => {
                        let p = pooler.parts.as_ref().expect("BUG: checked above");
                        let proxy = proxy_to(url, &path).await?;
                        let to_pooler = proxy::Proxy::start(p.addr).await.map_err(|e| {
                            fail(format!("cannot start a proxy to the pooler: {e}"))
                        })?;
                        let pooled = self.dir.join(format!("{node}.pooled.url"));
                        write_private(&pooled, &p.to("127.0.0.1", to_pooler.port, None))?;
                        (vec![to_pooler, proxy], pooled, Some(path))
                    }
                    (_, Some(pooler)) => (
                        Vec::new(),
                        pooler.file.clone(),
                        Some(self.url_file.to_owned()),
                    ),
                    (None, None) => (Vec::new(), self.url_file.to_owned(), None),
                }
            }
        };
        // The worker's fenced writes take the supervisor's path: through
        // the pooler where the supervisor goes through it.
        let worker_url = url_file.clone();
        // The supervisor's warnings (lost leadership, refused preemption)
        // beside its worker's history.
        let stderr =
            std::fs::File::create(self.dir.join(format!("{node}.stderr"))).map_err(|e| {
                fail(format!(
                    "cannot create a log in {}: {e}",
                    self.dir.display()
                ))
            })?;
        // In a namespace: `ip netns exec NS pgelect run …` (ip execs it:
        // the child is the supervisor itself).
        let mut cmd = match &ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(netns::Net::exec_prefix(ns)).arg(&self.exe);
                c
            }
            None => Command::new(&self.exe),
        };
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
        .args(["--grace", "1s", "--pass-database-env"]);
        if let Some(direct) = &direct {
            // LISTEN needs a session: directly, bypassing the pooler.
            cmd.arg("--listen-url-file").arg(direct);
        }
        cmd.args(["--schema", &self.schema, "--"])
            .arg(&self.exe)
            .args(["chaos-worker", "--database-url-file"])
            .arg(&worker_url)
            .args([
                "--schema",
                &self.schema,
                "--table",
                &self.table,
                "--idle-in-transaction-ms",
                &self.args.ttl.as_millis().to_string(),
                "--log",
            ])
            .arg(self.dir.join(format!("{node}.log")))
            .env("PGELECT_DATABASE_URL_FILE", &url_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .process_group(0);
        for var in [
            "DATABASE_URL",
            "PGELECT_LISTEN_URL",
            "PGELECT_LISTEN_URL_FILE",
            "PGPASSWORD",
            "PGHOST",
            "PGUSER",
            "PGDATABASE",
            "PGPORT",
        ] {
            cmd.env_remove(var);
        }
        let mut clock = None;
        if let (Some(lib), None) = (&self.faketime, &ns) {
            // The offset is re-read from the file (no cache), so that it can
            // jump while the supervisor runs; monotonic clocks stay real.
            let file = self.dir.join(format!("{node}.faketime"));
            std::fs::write(&file, "+0\n")
                .map_err(|e| fail(format!("cannot write {}: {e}", file.display())))?;
            cmd.env("LD_PRELOAD", lib)
                .env("FAKETIME_TIMESTAMP_FILE", &file)
                .env("FAKETIME_NO_CACHE", "1")
                .env("DONT_FAKE_MONOTONIC", "1")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
            clock = Some(file);
        }
        let child = cmd
            .spawn()
            .map_err(|e| fail(format!("cannot start a supervisor: {e}")))?;
        let pid = child.id();
        Ok(Supervisor {
            node,
            child,
            proxies,
            ns,
            clock,
            pid,
        })
    }

    /// What is left of a supervisor that exited: its URL files, its
    /// namespace, libfaketime's files.
    fn retire(&mut self, s: Supervisor) {
        // Its URLs (a password) are not kept with the logs.
        for url in ["url", "pooled.url"] {
            let _ = std::fs::remove_file(self.dir.join(format!("{}.{url}", s.node)));
        }
        if let (Some(netted), Some(ns)) = (self.net.as_deref_mut(), &s.ns) {
            netted.net.remove(ns);
        }
        // libfaketime, preloaded into the supervisor, made a shared-memory
        // segment and a semaphore named by its pid (its watcher and worker
        // use the same ones) and removes them at a clean exit only: a
        // SIGKILLed supervisor leaves them in /dev/shm.
        if let (Some(_), Some(pid)) = (&s.clock, s.pid) {
            for name in [
                format!("faketime_shm_{pid}"),
                format!("sem.faketime_sem_{pid}"),
            ] {
                let _ = std::fs::remove_file(Path::new("/dev/shm").join(name));
            }
        }
    }

    /// The test-only rogue: a worker under no supervisor, acting with
    /// term 1 all along (see `--rogue`).
    fn spawn_rogue(&self) -> Result<Child, Failure> {
        let mut cmd = Command::new(&self.exe);
        cmd.args([
            "chaos-worker",
            "--schema",
            &self.schema,
            "--table",
            &self.table,
            "--log",
        ])
        .arg(self.dir.join(format!("{ROGUE}.log")))
        .env("PGELECT_DATABASE_URL_FILE", self.url_file)
        .env("PGELECT_ROLE", &self.role)
        .env("PGELECT_NODE", ROGUE)
        .env("PGELECT_TERM", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
        cmd.spawn()
            .map_err(|e| fail(format!("cannot start the rogue worker: {e}")))
    }

    /// Waits for a start of a term above `above` after `after`; returns it.
    /// The start of the highest term so far (the rogue's aside).
    fn latest_start(&self) -> Option<Event> {
        read_events(&self.dir)
            .into_iter()
            .filter(|e| e.what == "start" && e.node != ROGUE)
            .max_by_key(|e| e.term)
    }

    /// Waits for a fenced write acknowledged after `after`; returns when.
    async fn next_write_ok(&self, after: u128, within: Duration) -> Option<u128> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Some(e) = read_events(&self.dir)
                .into_iter()
                .find(|e| e.at > after && e.node != ROGUE && is_write_ok(&e.what))
            {
                return Some(e.at);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    }

    async fn next_start(&self, above: i64, after: u128, within: Duration) -> Option<Event> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Some(e) = read_events(&self.dir)
                .into_iter()
                .find(|e| e.what == "start" && e.term > above && e.at > after && e.node != ROGUE)
            {
                return Some(e);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    }
}

/// Whether a worker log line's event is an acknowledged fenced write.
fn is_write_ok(what: &str) -> bool {
    what.starts_with("write:") && what.ends_with(":ok")
}

/// Why a fault at `at` proves nothing when the next leader's start was
/// stamped at or before it: the fault hit a candidate that no longer led.
fn moved_before(next: Option<&Event>, at: u128) -> Option<String> {
    let e = next.filter(|e| e.at <= at)?;
    Some(format!(
        "leadership had already moved to {} (term {}) {:.1} ms before the fault",
        e.node,
        e.term,
        (at - e.at) as f64 / 1e6
    ))
}

/// A proxy to the server of `url`, and at `path` a private file with the
/// URL through it.
async fn proxy_to(url: &UrlParts, path: &Path) -> Result<proxy::Proxy, Failure> {
    let proxy = proxy::Proxy::start(url.addr)
        .await
        .map_err(|e| fail(format!("cannot start a proxy: {e}")))?;
    write_private(path, &url.to("127.0.0.1", proxy.port, None))?;
    Ok(proxy)
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

/// The timing the candidates run with (what `pgelect run` derives from
/// --ttl and --profile).
fn timing(args: &ChaosArgs, backend: BackendArg) -> Result<pgelect::TimingReport, Failure> {
    let profile = match args.profile {
        ProfileArg::Standard => pgelect::Profile::Standard,
        ProfileArg::Fast => pgelect::Profile::Fast,
    };
    let o = pgelect::ConnectOptions::from_url("postgres://chaos@127.0.0.1/chaos")?;
    let b = pgelect::Elector::builder(o, "chaos").ttl(args.ttl);
    let b = match backend {
        BackendArg::Session => b.profile(profile),
        BackendArg::Lease => b.backend(pgelect::Backend::Lease),
    };
    Ok(b.build()?.timing())
}

/// Draws faults in rounds: each round every kind once, in a seeded order,
/// so that a short run still injects every kind and a replay draws the same.
struct Draw {
    kinds: Vec<Fault>,
    round: Vec<Fault>,
    /// How many were drawn so far.
    drawn: usize,
}

impl Draw {
    fn new(kinds: Vec<Fault>) -> Draw {
        Draw {
            kinds,
            round: Vec::new(),
            drawn: 0,
        }
    }

    fn next(&mut self, rng: &mut Rng) -> Option<Fault> {
        if self.round.is_empty() {
            self.round = self.kinds.clone();
            // Fisher-Yates, popped from the end.
            for i in (1..self.round.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                self.round.swap(i, j);
            }
        }
        self.drawn += 1;
        self.round.pop()
    }
}

/// Runs one phase of one backend's schedule, drawing from `kinds`; returns
/// the faults injected.
async fn schedule(
    run: &mut Run<'_>,
    kinds: Vec<Fault>,
    rng: &mut Rng,
) -> Result<Vec<Injected>, Failure> {
    let args = run.args;
    let admin = run.admin;
    let timing = timing(args, run.backend)?;
    let phase_start = now_ns();
    let mut sups: Vec<Supervisor> = Vec::new();
    let mut rogue = None;
    let outcome = async {
        for _ in 0..args.candidates {
            sups.push(run.spawn().await?);
        }
        if args.rogue {
            rogue = Some(run.spawn_rogue()?);
        }
        let mut injected = Vec::new();
        let mut leader = run
            .next_start(0, phase_start, Duration::from_secs(60))
            .await
            .ok_or_else(|| fail("no leader within 60 s of the start"))?;
        let mut draw = Draw::new(kinds);
        let end = Instant::now() + args.duration;
        // With --every-fault, at least one full round.
        while Instant::now() < end || (args.every_fault && draw.drawn < draw.kinds.len()) {
            // Let the leader settle and write for a while.
            tokio::time::sleep(Duration::from_millis(500 + rng.below(1000))).await;
            let Some(fault) = draw.next(rng) else { break };
            // A promotion needs a replica that has everything acknowledged
            // so far; making one takes seconds, which are not the fault's.
            let durable = match (fault, run.replicas.as_deref_mut()) {
                (Fault::Promote, Some(pair)) => Some(pair.prepare()?),
                _ => None,
            };
            // Leadership may have moved after the last fault's window (a
            // lease leader that lost its deadline during a restart).
            if let Some(e) = run.latest_start().filter(|e| e.term > leader.term) {
                leader = e;
            }
            let at = now_ns();
            let Some(i) = sups.iter().position(|s| s.node == leader.node) else {
                return Err(fail(format!(
                    "the leader {} is not one of ours",
                    leader.node
                )));
            };
            let mut paused = None;
            let mut unreplicated = None;
            let mut skipped = None;
            // Faults that last until the next leader acts find it themselves.
            let mut found: Option<Option<Event>> = None;
            match fault {
                Fault::Kill => {
                    let mut s = sups.remove(i);
                    let _ = s.child.start_kill();
                    let _ = s.child.wait().await;
                    run.retire(s);
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
                    run.retire(s);
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
                Fault::Blackhole | Fault::Latency => match &sups[i].proxies[..] {
                    [] => {
                        skipped = Some(
                            "the URL is not a single-host postgres:// URL: no proxy".to_owned(),
                        )
                    }
                    proxies => {
                        // One draw, as before there were two proxies: a seed
                        // replays the same schedule.
                        let delay = (fault == Fault::Latency).then(|| {
                            let t = timing.heartbeat_timeout;
                            let lo = (t / 4).as_millis() as u64;
                            let hi = (t * 2).as_millis() as u64;
                            Duration::from_millis(lo + rng.below(hi - lo + 1))
                        });
                        for p in proxies {
                            match delay {
                                None => p.blackhole(true),
                                Some(d) => p.delay(d),
                            }
                        }
                        tokio::time::sleep(args.ttl * 3 / 2).await;
                        for p in proxies {
                            p.blackhole(false);
                            p.delay(Duration::ZERO);
                        }
                    }
                },
                Fault::Terminate => match terminate_backends(&*admin.get().await?, &run.role, &leader.node).await {
                    Ok(0) => skipped = Some("no backend of the leader found".to_owned()),
                    Ok(_) => {}
                    Err(e) => skipped = Some(format!("pg_terminate_backend refused: {e}")),
                },
                Fault::Starve => {
                    // SIGSTOP/SIGCONT duty cycle rather than cgroup cpu.max:
                    // it needs no root nor a delegated cgroup, and touches
                    // exactly these two processes.
                    let pids = [sups[i].child.id(), Some(leader.pid)];
                    let until = Instant::now() + args.ttl * 3 / 2;
                    while Instant::now() < until {
                        for p in pids {
                            signal(p, nix::sys::signal::Signal::SIGSTOP);
                        }
                        tokio::time::sleep(STARVE_OFF).await;
                        for p in pids {
                            signal(p, nix::sys::signal::Signal::SIGCONT);
                        }
                        tokio::time::sleep(STARVE_ON).await;
                    }
                    for p in pids {
                        signal(p, nix::sys::signal::Signal::SIGCONT);
                    }
                }
                Fault::ClockJump => match &sups[i].clock {
                    None => {
                        skipped = Some(
                            "libfaketime is not installed (Debian: apt-get install faketime)"
                                .to_owned(),
                        )
                    }
                    Some(file) => {
                        let offset = if rng.below(2) == 0 { "+3600" } else { "-3600" };
                        let set = |o: &str| {
                            std::fs::write(file, format!("{o}\n"))
                                .map_err(|e| fail(format!("cannot write {}: {e}", file.display())))
                        };
                        set(offset)?;
                        tokio::time::sleep(args.ttl * 3 / 2).await;
                        set("+0")?;
                    }
                },
                Fault::RestartFast | Fault::RestartImmediate => match run.server {
                    None => {
                        skipped = Some(
                            "restarts need the throwaway server: run without --database-url"
                                .to_owned(),
                        )
                    }
                    Some(server) => server.restart(fault == Fault::RestartImmediate)?,
                },
                Fault::Promote => match (run.replicas.as_deref_mut(), durable) {
                    (Some(pair), Some(durable)) => {
                        let (died, took) = pair.promote()?;
                        unreplicated = Some((durable, died));
                        println!(
                            "  (primary killed, replica promoted: accepted a write {:.1} ms after the death)",
                            took.as_secs_f64() * 1e3
                        );
                    }
                    _ => skipped = Some(PROMOTE_NEEDS_THROWAWAY.to_owned()),
                },
                Fault::PgbouncerRestart => match &run.pooler {
                    Err(why) => skipped = Some(why.clone()),
                    Ok(p) => match p.not_restartable() {
                        Some(why) => skipped = Some(why),
                        None => p.restart().await?,
                    },
                },
                Fault::Partition | Fault::PartitionNoPreempt => {
                    match (run.net.as_deref(), sups[i].ns.as_ref()) {
                        (Some(netted), Some(ns)) => {
                            let nopreempt = fault == Fault::PartitionNoPreempt;
                            if nopreempt {
                                netted.set_preempt(admin, false).await?;
                            }
                            let cut = netted.net.set_cut(ns, true);
                            // Cut off until a new leader acts (bounded):
                            // the old one must be freed by timers alone.
                            let next = match &cut {
                                Ok(()) => {
                                    run.next_start(leader.term, leader.at, Duration::from_secs(60))
                                        .await
                                }
                                Err(_) => None,
                            };
                            let healed = netted.net.set_cut(ns, false);
                            if nopreempt {
                                netted.set_preempt(admin, true).await?;
                            }
                            cut.and(healed).map_err(|e| fail(format!("partition: {e}")))?;
                            found = Some(next);
                        }
                        _ => skipped = Some("the candidates are not in network namespaces".into()),
                    }
                }
            }
            let next = if let Some(found) = found {
                found
            } else if skipped.is_some() {
                None
            } else if fault.must_fail_over(run.backend) {
                run.next_start(leader.term, leader.at, Duration::from_secs(60))
                    .await
            } else {
                // The leader may stay in place: a new term counts only if it
                // began while the fault was on or right after (after a
                // restart of the server or the pooler, within a ttl: a leader that could not renew
                // meanwhile loses by then). A later move is followed before
                // the next fault.
                let window = match fault {
                    Fault::RestartFast
                    | Fault::RestartImmediate
                    | Fault::PgbouncerRestart
                    | Fault::Promote => args.ttl,
                    _ => Duration::ZERO,
                };
                run.next_start(leader.term, leader.at, window + Duration::from_millis(500))
                    .await
            };
            // A start of a newer term that the logs showed only after the
            // leader was chosen, but that was stamped before the fault: the
            // fault hit a candidate that no longer led (its worker wrote
            // `start` between the last look and the fault). It proves
            // nothing about the fault; the new leader is followed.
            if let Some(why) = moved_before(next.as_ref(), at) {
                skipped = Some(why);
            }
            // After a promotion, writes must be acknowledged again (by the
            // new primary) within the bound, whether or not the term moved.
            let resumed = match (unreplicated, &skipped) {
                (Some((_, died)), None) => {
                    let within = bound(fault, run.backend, &timing)
                        .saturating_sub(Duration::from_nanos(now_ns().saturating_sub(at) as u64));
                    run.next_write_ok(died, within).await
                }
                _ => None,
            };
            injected.push(Injected {
                fault,
                at,
                node: leader.node.clone(),
                term: leader.term,
                next_start: next.as_ref().map(|e| e.at),
                paused,
                unreplicated,
                resumed,
                skipped,
            });
            if let Some(f) = injected.last() {
                let outcome = match (&f.skipped, f.next_start) {
                    (Some(why), _) => format!("skipped: {why}"),
                    (None, Some(n)) => {
                        let gap = Duration::from_nanos(n.saturating_sub(f.at) as u64);
                        let b = bound(f.fault, run.backend, &timing);
                        format!(
                            "term {} began {:.1} ms later (bound {} ms{})",
                            next.as_ref().map(|e| e.term).unwrap_or_default(),
                            gap.as_secs_f64() * 1e3,
                            b.as_millis(),
                            if gap > b { ": OVER" } else { "" }
                        )
                    }
                    (None, None) => "no new term".to_owned(),
                };
                let outcome = match (f.unreplicated, f.resumed, &f.skipped) {
                    (Some(_), Some(w), None) => format!(
                        "{outcome}; writes acknowledged again {:.1} ms after the fault",
                        w.saturating_sub(f.at) as f64 / 1e6
                    ),
                    (Some(_), None, None) => format!("{outcome}; no write acknowledged again"),
                    _ => outcome,
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
                None => {
                    return Err(fail(format!(
                        "no new leader within 60 s of {} on {} (term {}); what the server and the logs show:\n{}",
                        fault.name(),
                        leader.node,
                        leader.term,
                        stuck_state(admin, run).await
                    )))
                }
            }
        }
        Ok(injected)
    }
    .await;
    if let Some(mut r) = rogue {
        let _ = r.start_kill();
        let _ = r.wait().await;
    }
    for s in &sups {
        signal(s.child.id(), nix::sys::signal::Signal::SIGTERM);
    }
    for mut s in sups {
        if tokio::time::timeout(Duration::from_secs(15), s.child.wait())
            .await
            .is_err()
        {
            let _ = s.child.start_kill();
            let _ = s.child.wait().await;
        }
        run.retire(s);
    }
    outcome
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
    /// When each write that was acknowledged by a primary in its last
    /// moments and is missing on the promoted replica was acknowledged (not
    /// a violation: see [`promote`]).
    unreplicated_at: Vec<u128>,
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

/// Reads one backend's histories (the workers' logs, the table) and
/// judges them.
async fn check(run: &Run<'_>, admin: &Admin, injected: &[Injected]) -> Result<Findings, Failure> {
    let events = read_events(&run.dir);
    // Committed writes, in commit order (the id is drawn inside the
    // transaction, after the fence, which holds the row against a bump).
    let rows = admin
        .get()
        .await?
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
    let timing = timing(run.args, run.backend)?;
    Ok(judge(&events, &committed, injected, run.backend, &timing))
}

/// The checker proper, on histories alone: the workers' events (sorted by
/// time), the committed writes in commit order, the faults injected.
fn judge(
    events: &[Event],
    committed: &[(String, i64, i64)],
    injected: &[Injected],
    backend: BackendArg,
    timing: &pgelect::TimingReport,
) -> Findings {
    let mut f = Findings::default();
    let ivs = intervals(events);
    // Terms rise with every start.
    for w in ivs.windows(2) {
        if w[1].term <= w[0].term {
            f.violations.push(format!(
                "terms did not rise: {} started term {} at {} after {} started term {} at {}",
                w[1].node, w[1].term, w[1].start, w[0].node, w[0].term, w[0].start
            ));
        }
    }
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
    // Whether a fault was injected on the leader of `term` by `at`.
    let faulted = |term: i64, at: u128| {
        injected
            .iter()
            .any(|i| i.term == term && i.at <= at && i.skipped.is_none())
    };
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
        let unreplicated = |at: u128| {
            injected.iter().any(|i| {
                i.skipped.is_none()
                    && i.unreplicated
                        .is_some_and(|(from, to)| from < at && at <= to)
            })
        };
        if outcome == Some("ok") && !have.contains(&(e.node.clone(), e.term, seq)) {
            if unreplicated(e.at) {
                // Acknowledged by the old primary after the replica last
                // confirmed it had everything: lost with the primary.
                f.unreplicated_at.push(e.at);
                continue;
            }
            f.lost_at.push(e.at);
            f.violations.push(format!(
                "write {}#{seq} of term {} was acknowledged but is not in the table",
                e.node, e.term
            ));
        } else if outcome != Some("ok") && !faulted(e.term, e.at) {
            // Refused or failed, while nothing had been done to this leader:
            // a healthy leader's write lost.
            f.lost_at.push(e.at);
            f.violations.push(format!(
                "write {}#{seq} of term {} (pid {}) was {} at {} although no fault had touched that leader",
                e.node,
                e.term,
                e.pid,
                outcome.unwrap_or("?"),
                e.at
            ));
        }
    }
    // After a promotion the promoted server must acknowledge writes again
    // within the bound (a lease leader may keep its term: no new start).
    for i in injected
        .iter()
        .filter(|i| i.skipped.is_none() && i.unreplicated.is_some())
    {
        let b = bound(i.fault, backend, timing);
        match i.resumed {
            Some(w) if Duration::from_nanos(w.saturating_sub(i.at) as u64) <= b => {}
            Some(w) => f.violations.push(format!(
                "{} on {} (term {}) at {}: the first write acknowledged afterwards came at {}, {} ms later, over the bound of {} ms",
                i.fault.name(), i.node, i.term, i.at, w, w.saturating_sub(i.at) / 1_000_000, b.as_millis()
            )),
            None => f.violations.push(format!(
                "{} on {} (term {}) at {}: no write was acknowledged within the bound of {} ms afterwards",
                i.fault.name(), i.node, i.term, i.at, b.as_millis()
            )),
        }
    }
    // The gap after each fault against its bound.
    for i in injected.iter().filter(|i| i.skipped.is_none()) {
        let Some(n) = i.next_start else { continue };
        let gap = Duration::from_nanos(n.saturating_sub(i.at) as u64);
        let b = bound(i.fault, backend, timing);
        if gap > b {
            f.violations.push(format!(
                "{} on {} (term {}) at {}: the next term began at {}, {} ms later, over the bound of {} ms",
                i.fault.name(),
                i.node,
                i.term,
                i.at,
                n,
                gap.as_millis(),
                b.as_millis()
            ));
        }
    }
    // Acting intervals of different workers must not overlap, except a
    // paused worker's after its pause: then none of its writes may commit
    // once the newer term wrote.
    let paused: HashSet<(u32, i64)> = injected
        .iter()
        .filter_map(|i| i.paused.map(|(pid, _)| (pid, i.term)))
        .collect();
    for (a, b) in overlapping(&ivs) {
        {
            if paused.contains(&(a.pid, a.term)) {
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
    f
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
    let mut signals = crate::signals::Signals::install()?;
    let seed = match args.seed {
        Some(s) => s,
        None => (now_ns() as u64) | 1,
    };
    let mut server = None;
    let work = async {
        let r = chaos(global, &args, seed, &mut server).await;
        r
    };
    // SIGINT or SIGTERM drops the run: its supervisors are killed (and
    // their workers with them), its namespaces and bridge removed.
    let outcome = tokio::select! {
        r = work => r,
        sig = signals.recv() => Err(Failure::new(exit::TEMPFAIL, format!("interrupted by {sig}; cleaned up"))),
    };
    if let Some(s) = server {
        s.stop();
    }
    let (rows, all_violations) = outcome?;
    report(&args, seed, rows, all_violations)
}

/// Why `promote` is skipped against a database the user names.
const PROMOTE_NEEDS_THROWAWAY: &str = "promote needs a primary with a streaming replica that chaos starts itself: run without --database-url";

/// Whether partitions can be made, and if not why.
fn partitions_possible(throwaway: bool) -> Result<(), String> {
    if !throwaway {
        return Err("partitions need the throwaway server (it must listen on the namespaces' bridge): run without --database-url".into());
    }
    netns::available()
}

type Rows = Vec<serde_json::Value>;

/// Sets up, runs every backend's phases, checks, cleans up; the rows and
/// the violations.
async fn chaos(
    global: &Global,
    args: &ChaosArgs,
    seed: u64,
    server: &mut Option<crate::demo::throwaway::Server>,
) -> Result<(Rows, Vec<String>), Failure> {
    let explicit = global.explicit_url()?;
    let pooler_url = crate::cli::resolve_url(
        args.pooler_url.as_deref(),
        "--pooler-url",
        args.pooler_url_file.as_deref(),
        "--pooler-url-file",
    )?;
    if pooler_url.is_some() && explicit.is_none() {
        return Err(Failure::new(
            exit::USAGE,
            "--pooler-url needs --database-url or --database-url-file: the database behind the pooler (on its own throwaway server chaos starts its own PgBouncer)",
        ));
    }
    let net_kinds: Vec<Fault> = args
        .faults
        .iter()
        .copied()
        .filter(|f| f.needs_netns())
        .collect();
    let net_possible = partitions_possible(explicit.is_none());
    let mut net = None;
    let url = match explicit {
        Some((url, _flag)) => url,
        None => {
            let (url, mut s) = crate::demo::throwaway::start().await?;
            if !net_kinds.is_empty() && net_possible.is_ok() {
                let removed = netns::remove_leftovers();
                if !removed.is_empty() {
                    println!(
                        "  removed leftovers of dead chaos runs: {}",
                        removed.join(", ")
                    );
                }
                let n = netns::Net::create()
                    .map_err(|e| fail(format!("cannot make the bridge: {e}")))?;
                s = s.listen_also(n.host_addr(), n.cidr()).await?;
                println!(
                    "  network namespaces on bridge {} ({}); the server also listens on {}",
                    n.bridge(),
                    n.cidr(),
                    n.host_addr()
                );
                net = Some(n);
            }
            *server = Some(s);
            url
        }
    };
    let options = pgelect::ConnectOptions::from_url(&url)?.schema(&global.schema)?;
    pgelect::migrate(&options).await?;
    // Refuse before touching anything if a role of ours has a live leader
    // (a dead run's last leader, whose row outlives it, is no reason).
    for &backend in &args.backends {
        let role = format!("chaos-{seed:x}-{}", backend_name(backend));
        if let Some(l) = live_leader(&options, &role).await? {
            return Err(Failure::new(
                exit::USAGE,
                format!(
                    "role {role:?} already has a leader ({}, term {}): refusing to run chaos on it (pick another --seed, or stop that leader)",
                    l.holder, l.term
                ),
            ));
        }
    }
    let url_file = crate::demo::UrlFile::write(&url)?;
    // The lease backend's pooler, or why it runs without one.
    let pooler_file = url_file.dir().join("pooler.url");
    let pooler: Result<pooler::Pooler, String> = if !args.backends.contains(&BackendArg::Lease) {
        Err("the lease backend does not run".to_owned())
    } else if let Some(u) = &pooler_url {
        Ok(pooler::Pooler::given(u, pooler_file).await?)
    } else if args.no_pooler {
        Err("--no-pooler: the lease backend connects directly".to_owned())
    } else if let Some(s) = server.as_ref() {
        pooler::start_own(s, pooler_file).await?
    } else {
        Err("no --pooler-url: the lease backend connects directly".to_owned())
    };
    let admin = Admin::connect(&options).await?;
    let schema = options.schema_name().as_str().to_owned();
    let table = format!("pgelect_chaos_{seed:x}");
    create_table(&admin, &table).await?;
    let lease_via = match (&pooler, args.backends.contains(&BackendArg::Lease)) {
        (_, false) => String::new(),
        (Ok(p), true) => format!(", lease backend through {}", p.describe),
        (Err(why), true) => format!(", lease backend direct ({why})"),
    };
    println!(
        "pgelect chaos: seed {seed} (replay with --seed {seed}), {} candidates, ttl {}, profile {:?}, {} per backend and phase, table {table}{lease_via}",
        args.candidates,
        crate::duration::show(args.ttl),
        args.profile,
        crate::duration::show(args.duration)
    );
    let exe = std::env::current_exe().map_err(fail)?;
    let proxied = UrlParts::parse(&url).await;
    if proxied.is_none() {
        println!("  (the URL is not a single-host postgres:// URL: blackhole and latency faults are skipped)");
    }
    let net_skip = match (&net_possible, &net) {
        (Err(why), _) => Some(why.clone()),
        (Ok(()), None) => Some("no bridge was made".to_owned()),
        (Ok(()), Some(_)) => None,
    };
    if let (false, Some(why)) = (net_kinds.is_empty(), &net_skip) {
        println!("  partition faults skipped: {why}");
    }
    let mut netted = match (net, UrlParts::parse(&url).await) {
        (Some(net), Some(url)) => Some(Netted {
            net,
            url,
            users: Vec::new(),
        }),
        _ => None,
    };
    // The promote phase's primary and replica, its own connection and URL
    // file; the schema and the table made on the primary and replayed on
    // the replica before any candidate starts.
    let promote_asked = args.faults.contains(&Fault::Promote);
    // The replica is made with pg_basebackup, which not every PostgreSQL
    // build ships (the npm packages the version tests use do not).
    let mut promote_skip = PROMOTE_NEEDS_THROWAWAY.to_owned();
    let basebackup = match &server {
        Some(s) => s
            .has_program("pg_basebackup")
            .map_err(|e| format!("promote needs pg_basebackup to make the replica: {e}")),
        None => Err(PROMOTE_NEEDS_THROWAWAY.to_owned()),
    };
    let mut pair = match (promote_asked, basebackup) {
        (true, Err(why)) => {
            println!("  promote skipped: {why}");
            promote_skip = why;
            None
        }
        (true, Ok(())) => {
            let p = promote::Pair::start().await?;
            let url = p.url();
            let options = pgelect::ConnectOptions::from_url(&url)?.schema(&global.schema)?;
            pgelect::migrate(&options).await?;
            let admin = Admin::connect(&options).await?;
            create_table(&admin, &table).await?;
            p.wait_replayed()?;
            let file = crate::demo::UrlFile::write(&url)?;
            Some((p, admin, file))
        }
        (false, _) => None,
    };
    // In the promote phase, the lease backend's PgBouncer stands in front
    // of the pair's primary address (PgBouncer cannot follow
    // target_session_attrs), wherever the first phase has chaos's own.
    let promote_pooler: Result<pooler::Pooler, String> = match (&pair, &pooler) {
        (None, _) => Err("no promote phase".to_owned()),
        (Some(_), Err(why)) => Err(why.clone()),
        (Some((p, _, file)), Ok(_)) => {
            pooler::start_own_at(
                p.primary_address(),
                p.password(),
                file.dir().join("pooler.url"),
            )
            .await?
        }
    };
    let mut rng = Rng(seed);
    let mut rows = Vec::new();
    let mut all_violations = Vec::new();
    let outcome: Result<(), Failure> = async {
        for &backend in &args.backends {
            let bname = backend_name(backend);
            let role = format!("chaos-{seed:x}-{bname}");
            let dir = args.logs.as_deref().unwrap_or(url_file.dir()).join(bname);
            std::fs::create_dir_all(&dir).map_err(fail)?;
            let run_pooler = pooler_for(backend, &pooler);
            let pooler_restart_skip = match &run_pooler {
                Ok(p) => p.not_restartable(),
                Err(why) => Some(why.clone()),
            };
            let mut first: Vec<Fault> = args
                .faults
                .iter()
                .copied()
                .filter(|f| !f.needs_netns() && !f.needs_replica())
                .collect();
            let mut injected = Vec::new();
            if let (true, Some(why)) = (first.contains(&Fault::PgbouncerRestart), &pooler_restart_skip) {
                // Not drawn where it cannot run; one skipped trial, with the
                // reason, not silently.
                first.retain(|&f| f != Fault::PgbouncerRestart);
                injected.push(Injected::not_run(Fault::PgbouncerRestart, why));
            }
            let run_pooler_for_report = run_pooler.clone();
            let mut run = Run {
                exe: exe.clone(),
                url_file: url_file.path(),
                proxied: proxied.as_ref(),
                net: None,
                faketime: args
                    .faults
                    .contains(&Fault::ClockJump)
                    .then(find_faketime)
                    .flatten(),
                server: server.as_ref(),
                replicas: None,
                pooler: run_pooler,
                admin: &admin,
                schema: schema.clone(),
                role: role.clone(),
                backend,
                args,
                dir,
                table: table.clone(),
                next_id: 0,
            };
            let first_phase: HashSet<Fault> = first.iter().copied().collect();
            if !first.is_empty() {
                injected.extend(schedule(&mut run, first, &mut rng).await?);
            }
            if let (false, Some(n)) = (net_kinds.is_empty(), netted.as_mut()) {
                println!("  {bname}: candidates in network namespaces, each its own database user");
                run.proxied = None;
                // The pooler listens on loopback only: out of reach.
                run.pooler = Err("the partition phase connects directly".to_owned());
                run.net = Some(n);
                injected.extend(schedule(&mut run, net_kinds.clone(), &mut rng).await?);
                run.net = None;
            } else if let Some(why) = &net_skip {
                // Not silently: one skipped trial per kind, with the reason.
                injected.extend(net_kinds.iter().map(|&fault| Injected::not_run(fault, why)));
            }
            if let (Ok(p), false) = (&run_pooler_for_report, first_phase.is_empty()) {
                if let Some(n) = p.served().await {
                    println!("  {bname}: PgBouncer served {n} transactions to the candidates");
                }
            }
            if let (true, None) = (promote_asked, &pair) {
                injected.push(Injected::not_run(Fault::Promote, &promote_skip));
            }
            let found = check(&run, &admin, &injected).await?;
            // Each part is judged on its own server: (faults, findings,
            // the kinds drawn through the pooler).
            let pooled_kinds = match run_pooler_for_report {
                Ok(_) => first_phase,
                Err(_) => HashSet::new(),
            };
            let mut parts = vec![(injected, found, pooled_kinds)];
            if let (true, Some((pair, pair_admin, pair_url))) = (promote_asked, pair.as_mut()) {
                // The lease backend through PgBouncer in front of the
                // primary address; LISTEN (a session) on the two-host URL.
                let promote_via = pooler_for(backend, &promote_pooler);
                match &promote_via {
                    Ok(p) => println!(
                        "  {bname}: candidates through {} (chaos points it at the new primary once a promotion is done, as an HA proxy would); their LISTEN connections on {}",
                        p.describe,
                        pair.describe()
                    ),
                    Err(why) => println!(
                        "  {bname}: candidates on {}, directly: {why}",
                        pair.describe()
                    ),
                }
                let dir = args
                    .logs
                    .as_deref()
                    .unwrap_or(url_file.dir())
                    .join(format!("{bname}-promote"));
                std::fs::create_dir_all(&dir).map_err(fail)?;
                let mut run = Run {
                    exe: exe.clone(),
                    url_file: pair_url.path(),
                    proxied: None,
                    net: None,
                    faketime: None,
                    server: None,
                    replicas: Some(pair),
                    pooler: promote_via,
                    admin: &*pair_admin,
                    schema: schema.clone(),
                    role: role.clone(),
                    backend,
                    args,
                    dir,
                    table: table.clone(),
                    next_id: 0,
                };
                let injected = schedule(&mut run, vec![Fault::Promote], &mut rng).await?;
                let found = check(&run, run.admin, &injected).await?;
                if let Ok(p) = &run.pooler {
                    if let Some(n) = p.served().await {
                        println!(
                            "  {bname}: PgBouncer served {n} transactions to the candidates in the promote phase, where {} fenced writes committed",
                            found.writes_committed
                        );
                    }
                }
                let pooled_kinds = match &run.pooler {
                    Ok(_) => HashSet::from([Fault::Promote]),
                    Err(_) => HashSet::new(),
                };
                parts.push((injected, found, pooled_kinds));
            }
            let timing = timing(args, backend)?;
            let (mut faults, mut committed, mut violations) = (0, 0, Vec::new());
            for (injected, found, pooled_kinds) in parts {
            let mut kinds: BTreeMap<Fault, Vec<&Injected>> = BTreeMap::new();
            for i in &injected {
                kinds.entry(i.fault).or_default().push(i);
            }
            for (fault, list) in kinds {
                let took: Vec<f64> = list
                    .iter()
                    .filter(|i| i.skipped.is_none())
                    .filter_map(|i| i.next_start.map(|n| (n.saturating_sub(i.at)) as f64 / 1e6))
                    .collect();
                let skipped = list.iter().filter(|i| i.skipped.is_some()).count();
                let skipped_reason = list.iter().find_map(|i| i.skipped.clone());
                let (overlaps, paused, stale, lost) = found.by_fault(&injected, fault);
                // Only a promotion excuses them (they are acknowledged
                // just before its injection).
                let unreplicated = if fault == Fault::Promote {
                    found.unreplicated_at.len()
                } else {
                    0
                };
                let max_gap = took.iter().copied().fold(0.0, f64::max);
                // Promotions: until writes were acknowledged again.
                let resumed: Vec<f64> = list
                    .iter()
                    .filter(|i| i.skipped.is_none() && i.unreplicated.is_some())
                    .map(|i| {
                        i.resumed
                            .map_or(f64::INFINITY, |w| w.saturating_sub(i.at) as f64 / 1e6)
                    })
                    .collect();
                let max_resumed = resumed.iter().copied().fold(0.0, f64::max);
                let bound_ms = bound(fault, backend, &timing).as_millis() as u64;
                rows.push(serde_json::json!({
                    "fault": fault.name(),
                    "backend": bname,
                    "seed": seed,
                    "trials": list.len(),
                    "skipped": skipped,
                    "skipped_reason": skipped_reason,
                    // Trials after which leadership moved (a delay, or a
                    // terminated lease connection, may leave it in place);
                    // the failover figures are over these.
                    "failovers": took.len(),
                    "overlaps": overlaps,
                    "paused_overlaps": paused,
                    "stale_writes_committed": stale,
                    "lost_writes": lost,
                    // Acknowledged by a primary just before it died and
                    // not yet on its replica (promote, asynchronous
                    // replication): not counted in lost_writes.
                    "unreplicated_writes": unreplicated,
                    "failover_p50_ms": (percentile(&took, 50.0) * 10.0).round() / 10.0,
                    "failover_p99_ms": (percentile(&took, 99.0) * 10.0).round() / 10.0,
                    "max_gap_ms": (max_gap * 10.0).round() / 10.0,
                    "bound_ms": bound_ms,
                    "within_bound": max_gap <= bound_ms as f64 && max_resumed <= bound_ms as f64,
                    // Promotions: the longest time from the fault until a
                    // write was acknowledged again (null for other faults,
                    // and when none came within the bound: a violation).
                    "writes_resumed_max_ms": (!resumed.is_empty() && max_resumed.is_finite())
                        .then(|| (max_resumed * 10.0).round() / 10.0),
                    // Whether its candidates connected through the pooler
                    // (the lease backend's first and promote phases).
                    "pooler": pooled_kinds.contains(&fault),
                }));
            }
            faults += injected.len();
            committed += found.writes_committed;
            if !found.unreplicated_at.is_empty() {
                println!(
                    "  {bname}: {} write(s) acknowledged by a primary in its last moments were not on its promoted replica (asynchronous replication; not a violation)",
                    found.unreplicated_at.len()
                );
            }
            violations.extend(found.violations);
            }
            println!(
                "{bname}: {faults} faults, {committed} fenced writes committed, {} violation(s)",
                violations.len()
            );
            all_violations.extend(violations.into_iter().map(|v| format!("{bname}: {v}")));
        }
        Ok(())
    }
    .await;
    if let Ok(c) = admin.get().await {
        let _ = c
            .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
            .await;
    }
    // The candidates' users live in the throwaway cluster, removed with it.
    drop(netted);
    drop(url_file);
    outcome.map(|()| (rows, all_violations))
}

/// The pooler `backend`'s candidates connect through, or why they connect
/// directly: the lease backend only (the session backend refuses
/// transaction pooling).
fn pooler_for(
    backend: BackendArg,
    pooler: &Result<pooler::Pooler, String>,
) -> Result<&pooler::Pooler, String> {
    match (backend, pooler) {
        (BackendArg::Session, _) => Err(
            "the session backend never connects through a pooler (it refuses transaction pooling)"
                .to_owned(),
        ),
        (BackendArg::Lease, Ok(p)) => Ok(p),
        (BackendArg::Lease, Err(why)) => Err(why.clone()),
    }
}

/// The run's table of fenced writes.
async fn create_table(admin: &Admin, table: &str) -> Result<(), Failure> {
    admin
        .get()
        .await?
        .batch_execute(&format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, role text NOT NULL, node text NOT NULL,
                                   term bigint NOT NULL, seq bigint NOT NULL)"
        ))
        .await
        .map_err(|e| fail(format!("cannot create the table {table}: {e}")))
}

/// The leader of `role` if one is alive: its lease runs, and (session
/// backend) its lock connection is still a server backend. A lease that
/// runs without such proof (a lease-backend leader, or a row whose pid
/// cannot be checked) is waited out once, for at most its TTL and a
/// margin: a live leader renews it, a dead one leaves it to expire.
async fn live_leader(
    options: &pgelect::ConnectOptions,
    role: &str,
) -> Result<Option<pgelect::LeaderInfo>, Failure> {
    let Some(l) = pgelect::current_leader(options, role).await? else {
        return Ok(None);
    };
    if l.lease_expired {
        return Ok(None);
    }
    if let (Some("session"), Some(pid)) = (l.backend.as_deref(), l.holder_pid) {
        let (client, _notices) = crate::db::connect(options, "pgelect:chaos-check").await?;
        let alive = client
            .query_typed_one(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = $1)",
                &[(&pid, Type::INT4)],
            )
            .await
            .and_then(|r| r.try_get::<_, bool>(0));
        drop(client);
        return match alive {
            Ok(true) => Ok(Some(l)),
            Ok(false) => Ok(None),
            Err(e) => Err(Failure::new(
                exit::SOFTWARE,
                format!("cannot tell whether the leader of {role:?} is alive: {e}"),
            )),
        };
    }
    let ttl = l
        .lease_until
        .duration_since(l.renewed_at)
        .unwrap_or_default()
        .min(Duration::from_secs(60));
    println!(
        "  role {role:?} has a leader ({}, term {}) whose lease runs: waiting up to {:.1} s for it to end",
        l.holder,
        l.term,
        (ttl + Duration::from_millis(500)).as_secs_f64()
    );
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    Ok(pgelect::current_leader(options, role)
        .await?
        .filter(|l| !l.lease_expired))
}

fn backend_name(b: BackendArg) -> &'static str {
    match b {
        BackendArg::Session => "session",
        BackendArg::Lease => "lease",
    }
}

/// Prints the table, writes the JSON; the exit code.
fn report(
    args: &ChaosArgs,
    seed: u64,
    rows: Rows,
    all_violations: Vec<String>,
) -> Result<u8, Failure> {
    println!(
        "\n{:<19} {:<12} {:>6} {:>6} {:>8} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9}  verdict",
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
        "max ms",
        "bound ms"
    );
    for r in &rows {
        let verdict = match r["skipped_reason"].as_str() {
            Some(why) if r["skipped"] == r["trials"] => format!("skipped: {why}"),
            _ if r["within_bound"] == true => "ok".to_owned(),
            _ => "OVER THE BOUND".to_owned(),
        };
        println!(
            "{:<19} {:<12} {:>6} {:>6} {:>8} {:>6} {:>6} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9}  {verdict}",
            r["fault"].as_str().unwrap_or(""),
            format!(
                "{}{}",
                r["backend"].as_str().unwrap_or(""),
                if r["pooler"] == true { "/pooler" } else { "" }
            ),
            r["trials"].as_u64().unwrap_or(0),
            r["failovers"].as_u64().unwrap_or(0),
            r["overlaps"].as_u64().unwrap_or(0),
            r["paused_overlaps"].as_u64().unwrap_or(0),
            r["stale_writes_committed"].as_u64().unwrap_or(0),
            r["lost_writes"].as_u64().unwrap_or(0),
            r["failover_p50_ms"].as_f64().unwrap_or(0.0),
            r["failover_p99_ms"].as_f64().unwrap_or(0.0),
            r["max_gap_ms"].as_f64().unwrap_or(0.0),
            r["bound_ms"].as_u64().unwrap_or(0),
        );
    }
    println!("seed {seed} (replay with --seed {seed})");
    if let Some(path) = &args.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&rows).map_err(fail)? + "\n",
        )
        .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))?;
    }
    if all_violations.is_empty() {
        println!("\nno violation: never two leaders acting at once outside a pause, writes in term order, terms rising, no healthy leader's write lost, every failover within its bound");
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

    fn ev(what: &str, node: &str, term: i64, at_ms: u128, pid: u32) -> Event {
        Event {
            what: what.to_owned(),
            node: node.to_owned(),
            term,
            at: at_ms * 1_000_000,
            pid,
        }
    }

    #[test]
    fn a_fault_after_leadership_moved_is_not_counted() {
        // c2's worker stamped its start (term 6) at 850 ms; the schedule
        // had last looked before that and aimed a fault at the old leader
        // at 871 ms (a loaded CI run): that fault proves nothing.
        let moved = ev("start", "c2", 6, 850, 7);
        let why = moved_before(Some(&moved), 871 * 1_000_000).expect("missed");
        assert!(why.contains("c2 (term 6) 21.0 ms before"), "{why}");
        // Stamped after the fault: the failover the fault caused.
        assert_eq!(moved_before(Some(&moved), 849 * 1_000_000), None);
        assert_eq!(moved_before(None, 871 * 1_000_000), None);
    }

    fn standard(backend: BackendArg) -> pgelect::TimingReport {
        let args = ChaosArgs {
            candidates: 3,
            duration: Duration::from_secs(1),
            seed: None,
            ttl: Duration::from_secs(2),
            profile: ProfileArg::Standard,
            backends: vec![backend],
            faults: vec![],
            json: None,
            pooler_url: None,
            pooler_url_file: None,
            no_pooler: false,
            every_fault: false,
            logs: None,
            rogue: false,
        };
        timing(&args, backend).unwrap()
    }

    fn fault(fault: Fault, node: &str, term: i64, at_ms: u128, next_ms: Option<u128>) -> Injected {
        Injected {
            fault,
            at: at_ms * 1_000_000,
            node: node.to_owned(),
            term,
            next_start: next_ms.map(|n| n * 1_000_000),
            paused: None,
            unreplicated: None,
            resumed: None,
            skipped: None,
        }
    }

    /// c1 leads term 1 from 0 to 1000 ms, is killed at 1000 ms; c2 leads
    /// term 2 from 1400 ms. Clean.
    fn clean_history() -> (Vec<Event>, Vec<(String, i64, i64)>) {
        let events = vec![
            ev("start", "c1", 1, 0, 11),
            ev("write:1:ok", "c1", 1, 50, 11),
            ev("tick", "c1", 1, 1000, 11),
            ev("start", "c2", 2, 1400, 12),
            ev("write:1:ok", "c2", 2, 1450, 12),
            ev("tick", "c2", 2, 1500, 12),
        ];
        let committed = vec![("c1".into(), 1, 1), ("c2".into(), 2, 1)];
        (events, committed)
    }

    #[test]
    fn the_checker_passes_a_clean_history() {
        let (events, committed) = clean_history();
        let t = standard(BackendArg::Session);
        let f = judge(
            &events,
            &committed,
            &[fault(Fault::Kill, "c1", 1, 1000, Some(1400))],
            BackendArg::Session,
            &t,
        );
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        assert_eq!(f.writes_committed, 2);
    }

    /// A soak found this: the kernel reused a term-1 worker's pid for a
    /// term-3 worker minutes later, and the checker, keying workers by pid
    /// alone, saw one interval over both and "two leaders at once" with
    /// everyone in between.
    #[test]
    fn the_checker_tells_apart_workers_that_share_a_reused_pid() {
        let (mut events, mut committed) = clean_history();
        events.push(ev("start", "c3", 3, 3000, 11));
        events.push(ev("write:1:ok", "c3", 3, 3050, 11));
        events.push(ev("tick", "c3", 3, 3100, 11));
        committed.push(("c3".into(), 3, 1));
        let t = standard(BackendArg::Session);
        let faults = [
            fault(Fault::Kill, "c1", 1, 1000, Some(1400)),
            fault(Fault::Kill, "c2", 2, 2000, Some(3000)),
        ];
        let f = judge(&events, &committed, &faults, BackendArg::Session, &t);
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        // The same pid acting again under another term while c2 acts is
        // still two leaders.
        events.push(ev("tick", "c1", 1, 1460, 11));
        events.sort_by_key(|e| e.at);
        let f = judge(&events, &committed, &faults, BackendArg::Session, &t);
        assert!(
            f.violations
                .iter()
                .any(|v| v.starts_with("two leaders at once: c1")),
            "{:?}",
            f.violations
        );
    }

    #[test]
    fn the_checker_fails_a_gap_over_the_bound_naming_the_fault() {
        let (events, committed) = clean_history();
        let t = standard(BackendArg::Session);
        let b = bound(Fault::Kill, BackendArg::Session, &t).as_millis();
        // The next leader acted 1 ms after the bound.
        let late = fault(Fault::Kill, "c1", 1, 1000, Some(1000 + b + 1));
        let f = judge(&events, &committed, &[late], BackendArg::Session, &t);
        assert_eq!(f.violations.len(), 1, "{:?}", f.violations);
        assert!(
            f.violations[0].starts_with("kill on c1 (term 1)")
                && f.violations[0].contains("over the bound"),
            "{}",
            f.violations[0]
        );
    }

    #[test]
    fn the_checker_counts_a_healthy_leaders_refused_write_as_lost() {
        let (mut events, committed) = clean_history();
        // c2 (term 2) had a write refused although nothing was done to it.
        events.push(ev("write:2:refused", "c2", 2, 1480, 12));
        events.sort_by_key(|e| e.at);
        let t = standard(BackendArg::Lease);
        let injected = [fault(Fault::Kill, "c1", 1, 1000, Some(1400))];
        let f = judge(&events, &committed, &injected, BackendArg::Lease, &t);
        assert_eq!(f.lost_at, vec![1480 * 1_000_000], "{:?}", f.violations);
        assert!(
            f.violations[0].contains("c2#2 of term 2"),
            "{:?}",
            f.violations
        );
        // The same refusal after a fault on that leader is no loss.
        let mut after = injected.to_vec();
        after.push(fault(Fault::Stop, "c2", 2, 1470, None));
        let f = judge(&events, &committed, &after, BackendArg::Lease, &t);
        assert!(f.lost_at.is_empty(), "{:?}", f.violations);
    }

    /// A promotion at 1000 ms: the replica had everything acknowledged
    /// before 900 ms, the primary died at 1010 ms. A write acknowledged in
    /// between may be lost with it (asynchronous replication); one
    /// acknowledged before may not.
    #[test]
    fn the_checker_excuses_only_writes_the_replica_may_not_have_received() {
        let (mut events, committed) = clean_history();
        events.push(ev("write:2:ok", "c1", 1, 950, 11));
        events.sort_by_key(|e| e.at);
        let t = standard(BackendArg::Session);
        let mut promote = fault(Fault::Promote, "c1", 1, 1000, Some(1400));
        promote.unreplicated = Some((900 * 1_000_000, 1010 * 1_000_000));
        promote.resumed = Some(1450 * 1_000_000);
        let f = judge(
            &events,
            &committed,
            std::slice::from_ref(&promote),
            BackendArg::Session,
            &t,
        );
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        assert_eq!(f.unreplicated_at, vec![950 * 1_000_000]);
        // Acknowledged before the replica confirmed it had everything: lost.
        let mut early = promote.clone();
        early.unreplicated = Some((960 * 1_000_000, 1010 * 1_000_000));
        let f = judge(&events, &committed, &[early], BackendArg::Session, &t);
        assert_eq!(f.lost_at, vec![950 * 1_000_000], "{:?}", f.violations);
        assert!(f.unreplicated_at.is_empty());
        // No write acknowledged again after the promotion: a violation,
        // whether or not the term moved.
        let mut silent = promote.clone();
        silent.resumed = None;
        let f = judge(&events, &committed, &[silent], BackendArg::Session, &t);
        assert_eq!(f.violations.len(), 1, "{:?}", f.violations);
        assert!(
            f.violations[0].contains("no write was acknowledged within the bound"),
            "{:?}",
            f.violations
        );
    }

    #[test]
    fn the_checker_fails_an_acknowledged_write_missing_from_the_table() {
        let (events, mut committed) = clean_history();
        committed.pop();
        let t = standard(BackendArg::Session);
        let f = judge(&events, &committed, &[], BackendArg::Session, &t);
        assert_eq!(f.lost_at.len(), 1, "{:?}", f.violations);
        assert!(f.violations[0].contains("acknowledged but is not in the table"));
    }

    #[test]
    fn the_checker_fails_two_leaders_and_writes_out_of_term_order() {
        let (mut events, mut committed) = clean_history();
        // c1 still ticks at 1450 ms, after c2 began at 1400 ms.
        events.push(ev("tick", "c1", 1, 1450, 11));
        events.sort_by_key(|e| e.at);
        committed.push(("c1".into(), 1, 2));
        let t = standard(BackendArg::Session);
        let f = judge(&events, &committed, &[], BackendArg::Session, &t);
        assert_eq!(f.overlaps_at.len(), 1, "{:?}", f.violations);
        assert!(f
            .violations
            .iter()
            .any(|v| v.starts_with("two leaders at once: c1 (term 1, pid 11)")));
        assert!(f
            .violations
            .iter()
            .any(|v| v.starts_with("fenced write c1#2 of term 1 committed after c2#1 of term 2")));
    }

    #[test]
    fn every_fault_has_a_bound_above_the_slack_and_partitions_wait_longest() {
        for backend in [BackendArg::Session, BackendArg::Lease] {
            let t = standard(backend);
            for f in <Fault as ValueEnum>::value_variants() {
                let b = bound(*f, backend, &t);
                assert!(
                    b >= SLACK && b < Duration::from_secs(30),
                    "{f:?} {backend:?}: {b:?}"
                );
            }
            assert!(
                bound(Fault::PartitionNoPreempt, backend, &t) >= bound(Fault::Kill, backend, &t)
            );
        }
        // Without preemption, only the server's TCP timers (at least the
        // ttl) free a session leader's lock.
        let t = standard(BackendArg::Session);
        assert!(
            bound(Fault::PartitionNoPreempt, BackendArg::Session, &t)
                >= t.ttl + t.handover_delay + SLACK
        );
    }

    #[test]
    fn the_draw_injects_every_kind_each_round_and_replays_with_the_seed() {
        let kinds = vec![Fault::Kill, Fault::Stop, Fault::Partition, Fault::Latency];
        let drawn = |seed| {
            let mut rng = Rng(seed);
            let mut d = Draw::new(kinds.clone());
            (0..12)
                .map(|_| d.next(&mut rng).unwrap())
                .collect::<Vec<_>>()
        };
        let a = drawn(7);
        for round in a.chunks(4) {
            let mut r = round.to_vec();
            r.sort();
            let mut k = kinds.clone();
            k.sort();
            assert_eq!(r, k, "{a:?}");
        }
        assert_eq!(a, drawn(7));
        assert_ne!(a, drawn(8));
    }
}
