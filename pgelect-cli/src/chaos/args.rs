//! The command's arguments (`pgelect chaos`, and the hidden
//! `chaos-worker`'s), and the timing they give the candidates.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::faults::Fault;
use crate::exit::Failure;
use crate::run::{BackendArg, ProfileArg};

#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// Supervisors standing at once (each a separate `pgelect run`).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(3..=16), conflicts_with = "partitions")]
    pub candidates: u8,
    /// Instead of one role per backend: a partition group of N partitions
    /// on the lease backend (`pgelect run --backend lease --partitions
    /// GROUP:N`, through the pooler), --members supervisors, a worker per
    /// partition led. Faults: kill, kill-many, stop, term,
    /// pgbouncer-restart (the default set here; other kinds given with
    /// --faults are reported skipped). Every rule is checked per partition,
    /// and after each fault every partition must be led again within its
    /// bound.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096), conflicts_with_all = ["backends", "python"])]
    pub partitions: Option<u32>,
    /// Members of the --partitions group (each a separate `pgelect run`).
    /// Default: 20.
    #[arg(long, value_name = "M", value_parser = clap::value_parser!(u16).range(2..=200), requires = "partitions")]
    pub members: Option<u16>,
    /// Instead of chaos's own servers: under a real HA manager. With
    /// `pg_auto_failover`, chaos starts a formation of its own on loopback
    /// (a monitor and three data nodes, synchronous replication that the
    /// manager keeps on, failure detection lowered for a test machine;
    /// pg_autoctl from Debian's pg-auto-failover-cli, as scripts/setup.sh
    /// installs it), the candidates of --backends on a URL naming every
    /// data node with
    /// target_session_attrs=read-write (the lease backend directly: no
    /// pooler), the fenced table on the formation. Faults: switchover,
    /// failover (`pg_autoctl perform`), postmaster-kill, node-kill (SIGKILL
    /// of the primary's postmaster, of its whole node), and kill, stop,
    /// term on the candidates (the default set here; other kinds given with
    /// --faults are reported skipped). Without pg_autoctl the run is
    /// reported skipped (exit 0).
    #[arg(long, value_enum, value_name = "MANAGER", conflicts_with_all = ["partitions", "python", "pooler_url", "pooler_url_file"])]
    pub ha: Option<HaArg>,
    /// How long faults are injected, per backend.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "60s", value_name = "DURATION", allow_hyphen_values = true)]
    pub duration: Duration,
    /// Seed of the fault schedule (printed; give it again to replay).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The candidates' --ttl.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "2s", value_name = "DURATION", allow_hyphen_values = true)]
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
    /// log and each supervisor's warnings), for a failing run's evidence;
    /// under --ha also the formation's (DIR/formation: the monitor's events,
    /// every node's pg_autoctl and PostgreSQL log, with every statement and
    /// its duration logged). Default: a private directory removed at the end.
    #[arg(long, value_name = "DIR")]
    pub logs: Option<PathBuf>,
    /// Run Python candidates instead of `pgelect run` supervisors: `PYTHON
    /// -m pgelect._chaos`, an elector of the pgelect Python package (the
    /// Rust library underneath) that ticks and makes fenced writes with
    /// psycopg in its own process while it leads, judged by the same
    /// checker. PYTHON is an interpreter with the pgelect wheel and psycopg
    /// installed (e.g. target/py-venv/bin/python after pgelect-py/test.sh
    /// --build-only). Clock jumps are skipped: libfaketime would fake the
    /// clock of the candidate's log too.
    #[arg(long, value_name = "PYTHON")]
    pub python: Option<PathBuf>,
    /// Test only: also run a worker outside any supervisor, acting all the
    /// time with term 1, so that the checker must report violations.
    #[arg(long, hide = true)]
    pub rogue: bool,
}

/// An HA manager `--ha` runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HaArg {
    /// A monitor and three data nodes (`pg_autoctl`).
    #[value(name = "pg_auto_failover")]
    PgAutoFailover,
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
    /// How often it logs a `tick`, in milliseconds (a fenced write every
    /// tenth).
    #[arg(long, default_value_t = super::worker::TICK.as_millis() as u64)]
    pub tick_ms: u64,
}

/// The timing the candidates run with (what `pgelect run` derives from
/// --ttl and --profile).
pub(super) fn timing(
    args: &ChaosArgs,
    backend: BackendArg,
) -> Result<pgelect::election::TimingReport, Failure> {
    let profile = match args.profile {
        ProfileArg::Standard => pgelect::election::Profile::Standard,
        ProfileArg::Fast => pgelect::election::Profile::Fast,
    };
    let o = pgelect::ConnectOptions::from_url("postgres://chaos@127.0.0.1/chaos")?;
    let b = pgelect::Elector::builder(o, "chaos").ttl(args.ttl);
    let b = match backend {
        BackendArg::Session => b.backend(pgelect::election::SessionOptions::new().profile(profile)),
        BackendArg::Lease => b.backend(pgelect::election::Backend::Lease),
    };
    Ok(b.build()?.timing())
}

pub(super) fn backend_name(b: BackendArg) -> &'static str {
    match b {
        BackendArg::Session => "session",
        BackendArg::Lease => "lease",
    }
}

/// The timing of the candidates of a default run on `backend`, for the
/// tests.
#[cfg(test)]
pub(super) fn standard_timing(backend: BackendArg) -> pgelect::election::TimingReport {
    let args = ChaosArgs {
        candidates: 3,
        partitions: None,
        members: None,
        ha: None,
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
        python: None,
        rogue: false,
    };
    timing(&args, backend).unwrap()
}
