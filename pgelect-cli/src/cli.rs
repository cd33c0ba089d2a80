//! Command-line grammar and global options.

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::exit::Failure;

/// Leader election and distributed locks on the PostgreSQL you already run.
#[derive(Debug, Parser)]
#[command(name = "pgelect", version, propagate_version = true)]
#[command(after_help = "Examples:
  pgelect migrate --database-url postgres://app@db/app
  DATABASE_URL=postgres://app@db/app pgelect migrate --schema my_locks

The database is taken from --database-url, else DATABASE_URL, else the libpq
variables PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE.

Exit codes: 0 success, 64 usage error, 69 database unavailable,
75 lock not acquired, 77 permission denied, 78 configuration error.")]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every subcommand takes.
#[derive(Debug, Args)]
pub struct Global {
    /// PostgreSQL URL (postgres://user:password@host:port/db). Never printed.
    #[arg(
        long,
        global = true,
        env = "DATABASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub database_url: Option<String>,
    /// Schema holding pgelect's tables.
    #[arg(long, global = true, default_value = "pgelect", value_name = "NAME")]
    pub schema: String,
    /// More log output (-v info, -vv debug, -vvv trace).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only errors.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Log format on standard error.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// How logs are written.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Install or upgrade the pgelect schema (idempotent; safe to run concurrently).
    #[command(after_help = "Examples:
  pgelect migrate --database-url postgres://app@db/app
  pgelect migrate --schema my_locks")]
    Migrate(crate::migrate::MigrateArgs),
    /// Run a command only while this process leads a role (a singleton).
    #[command(after_help = "Examples:
  pgelect run --role scheduler -- ./scheduler --config prod.toml
  pgelect run --role reconciler --id $(hostname) --ttl 10s -- ./reconcile
  pgelect run --role nightly --on-exit exit -- ./nightly-job.sh
  pgelect run --role sweeper --backend lease --database-url postgres://app@pgbouncer:6432/app -- ./sweep

The command gets PGELECT_ROLE, PGELECT_NODE and PGELECT_TERM (the fencing
term: pass it to pgelect.fence(role, term) in your transactions).
It runs in its own process group and dies with the supervisor.
On an unexpected loss of leadership (connection lost, lease deadline,
preemption) the process group is killed at once, and pgelect stands again.
On a resign request (pgelect resign) or SIGTERM/SIGINT: SIGTERM, then SIGKILL
after --grace, then a clean release (standbys take over in milliseconds);
after SIGTERM/SIGINT pgelect exits 0.")]
    Run(crate::run::RunArgs),
    /// Run a command while holding a fleet-wide advisory lock, like flock(1).
    #[command(after_help = "Examples:
  pgelect lock --key nightly-report -- ./report.sh
  pgelect lock --key db-backup --no-wait -- pg_dump app
  pgelect lock --key deploy --timeout 30s -- ./deploy.sh

Exit codes: the command's own code; 75 when the lock was not acquired
(--no-wait, --timeout); 69 when the lock's connection was lost (the command
is killed at once); 127 when the command does not exist.

While the command runs it has PGELECT_LOCK=NAME in its environment.
SIGTERM or SIGINT stop it (SIGTERM, then SIGKILL after --grace) and release
the lock.")]
    Lock(crate::lock::LockArgs),
    /// Ask a role's current leader to step down; waits for a new term.
    #[command(after_help = "Examples:
  pgelect resign --role scheduler
  pgelect resign --role scheduler --timeout 5s

Exit codes: 0 when a new term was seen (or the role had no leader),
75 when no new term was seen within --timeout.")]
    Resign(crate::resign::ResignArgs),
    /// Watch a failover: a throwaway PostgreSQL, three candidates, the leader
    /// killed, the failover timed, then a planned resign.
    #[command(after_help = "Examples:
  pgelect demo
  pgelect demo --candidates 5 --ttl 3s
  pgelect demo --database-url postgres://app@db/app

Without a database URL it starts a throwaway PostgreSQL from the system's
binaries (initdb/postgres; as root it runs them as the postgres user) and
removes it afterwards.")]
    Demo(crate::demo::DemoArgs),
    /// Show every role's leader, term, lease and candidates.
    #[command(after_help = "Examples:
  pgelect status
  pgelect status --role scheduler --json
  pgelect status --watch

Lease times come from the server's clock. Candidates are the connections
whose application_name is pgelect:<role>:<node>: 'holding' holds the
role's lock, 'waiting' waits for it, 'standing' polls for it.")]
    Status(crate::status::StatusArgs),
}

impl Global {
    /// The connection options from the flags and the environment.
    pub fn connect_options(&self) -> Result<pgelect::ConnectOptions, Failure> {
        let options = match self.database_url.as_deref().filter(|u| !u.is_empty()) {
            Some(url) => pgelect::ConnectOptions::from_url(url)?,
            None => pgelect::ConnectOptions::from_env()?,
        };
        Ok(options.schema(&self.schema)?)
    }
}

/// Sets up `tracing` on standard error per `-v`, `-q` and `--log-format`;
/// `RUST_LOG` overrides the level.
pub fn init_logging(global: &Global) {
    use tracing_subscriber::EnvFilter;
    let level = if global.quiet {
        "error"
    } else {
        match global.verbose {
            0 => "warn",
            1 => "info",
            2 => "debug",
            _ => "trace",
        }
    };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{level},tokio_postgres=warn")));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match global.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
