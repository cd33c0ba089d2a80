//! Command-line grammar and global options.

use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::exit::{self, Failure};

/// Leader election and distributed locks on the PostgreSQL you already run.
#[derive(Debug, Parser)]
#[command(name = "pgelect", version, propagate_version = true)]
#[command(after_help = "Examples:
  pgelect migrate --database-url postgres://app@db/app   # password from ~/.pgpass
  DATABASE_URL=postgres://app:secret@db/app pgelect migrate --schema my_locks
  pgelect migrate --database-url-file /run/secrets/pgelect-url

The database is taken from --database-url, else --database-url-file (or
PGELECT_DATABASE_URL_FILE), else DATABASE_URL, else the libpq variables
PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE. Without a password in the
URL, PGPASSWORD, else the password file (PGPASSFILE, else ~/.pgpass) is used.
A password on the command line is visible to every local user (ps,
/proc/PID/cmdline): prefer the environment or a file (mode 0600).

Exit codes: 0 success, 64 usage error, 66 no such role, 69 database
unavailable, 75 lock not acquired (or nothing to do now), 77 permission
denied, 78 configuration error (a missing database or schema included).")]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every subcommand takes.
#[derive(Debug, Args)]
pub struct Global {
    /// PostgreSQL URL (postgres://user:password@host:port/db) or key=value
    /// string. Never printed. A password here is visible to every local user:
    /// prefer DATABASE_URL, --database-url-file or ~/.pgpass.
    #[arg(
        long,
        global = true,
        env = "DATABASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub database_url: Option<String>,
    /// Read the database URL from this file (read once; a trailing newline
    /// is ignored). Keep it private (mode 0600).
    #[arg(
        long,
        global = true,
        env = "PGELECT_DATABASE_URL_FILE",
        value_name = "PATH"
    )]
    pub database_url_file: Option<PathBuf>,
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
    /// Print the GRANT statements a database user needs (no database connection).
    #[command(after_help = "Examples:
  pgelect grants --user app | psql -v ON_ERROR_STOP=1 \"$OWNER_URL\"
  pgelect grants --user app --zombie-preemption
  pgelect grants --user ops --role-kind operator --role-kind watcher
  pgelect grants --user migrator --role-kind owner   # run this one as a superuser

Kinds:
  owner      runs pgelect migrate and owns the schema: CREATE on the database,
             no superuser; fence and request_resign run with its rights
  candidate  stands for election (pgelect run, Elector): both backends,
             blocking and polling standbys, shared connections
  fencer     calls pgelect.fence(role, term) in its own transactions; nothing
             on the table
  operator   asks leaders to resign (pgelect resign, request_resign)
  watcher    observes (pgelect status, current_leader, Elector::watch)
Advisory locks (pgelect lock, LockSession, transaction locks) need no grant.

Run the output as the schema's owner (or a superuser); the owner's own grant
and pg_signal_backend need a superuser (or, on PostgreSQL 16+, a CREATEROLE
user with ADMIN on pg_signal_backend). The user is printed as a quoted
identifier: upper case, spaces and quotes are kept exactly.")]
    Grants(crate::grants::GrantsArgs),
    /// Run a command only while this process leads a role (a singleton).
    #[command(after_help = "Examples:
  pgelect run --role scheduler -- ./scheduler --config prod.toml
  pgelect run --role reconciler --id $(hostname) --ttl 10s -- ./reconcile
  pgelect run --role nightly --on-exit exit -- ./nightly-job.sh
  pgelect run --role sweeper --backend lease --database-url postgres://app@pgbouncer:6432/app -- ./sweep
  pgelect run --role scheduler --priority 10 -- ./scheduler   # leads as soon as it is ready

The command gets PGELECT_ROLE, PGELECT_NODE and PGELECT_TERM (the fencing
term: pass it to pgelect.fence(role, term) in your transactions).
It runs in its own process group and dies with the supervisor.
On an unexpected loss of leadership (connection lost, lease deadline,
preemption) the process group is killed at once, and pgelect stands again.
On a resign request (pgelect resign) or SIGTERM/SIGINT: SIGTERM, then SIGKILL
after --grace, then a clean release (standbys take over in milliseconds);
after SIGTERM/SIGINT pgelect exits 0. The same graceful handover happens when
a candidate of strictly higher --priority stands and is ready to take over.")]
    Run(crate::run::RunArgs),
    /// Run a command while holding a fleet-wide advisory lock, like flock(1).
    #[command(after_help = "Examples:
  pgelect lock --key nightly-report -- ./report.sh
  pgelect lock --key db-backup --no-wait -- pg_dump app
  pgelect lock --key deploy --timeout 30s -- ./deploy.sh
  pgelect lock --key deploy -w 5 -E 1 -- ./deploy.sh   # as flock -w 5 -E 1
  pgelect lock --key s3-uploads --limit 4 -- ./upload.sh   # at most 4 at once

Exit codes: the command's own code; 75 (or --conflict-exit-code) when the
lock was not acquired (--no-wait, --timeout); 69 when the lock's connection was lost (the command
is killed at once); 127 when the command does not exist.

With --limit N, up to N holders of NAME run at once (a semaphore, as
consul lock -n); waiters are served in order of arrival, and every user of
NAME must give the same N (another N is refused, exit 78).

While the command runs it has PGELECT_LOCK=NAME in its environment, and
with --limit PGELECT_PERMIT=SLOT (0..N-1, distinct among the holders).
SIGTERM or SIGINT stop it (SIGTERM, then SIGKILL after --grace) and release
the lock.")]
    Lock(crate::lock::LockArgs),
    /// Ask a role's current leader to step down; waits for a new term.
    #[command(after_help = "Examples:
  pgelect resign --role scheduler
  pgelect resign --role scheduler --timeout 5s

Exit codes: 0 when a new term was seen; 66 when there is no such role
(the known ones are named); 75 when the role has no leader (nothing to
resign) or no new term was seen within --timeout.")]
    Resign(crate::resign::ResignArgs),
    /// Watch a failover: a throwaway PostgreSQL, three candidates, the leader
    /// killed, the failover timed, then a planned resign.
    #[command(after_help = "Examples:
  pgelect demo
  pgelect demo --candidates 5 --ttl 3s
  pgelect demo --database-url postgres://app@db/app

Without --database-url or --database-url-file (DATABASE_URL is ignored here:
it could name a production database) it starts a throwaway PostgreSQL from the
system's binaries (initdb/postgres; as root it runs them as the postgres user)
with a random superuser password, and removes it afterwards. The candidates
read the URL from a private file (mode 0600), never from their command line.")]
    Demo(crate::demo::DemoArgs),
    /// Show every role's leader, term, lease and candidates.
    #[command(after_help = "Examples:
  pgelect status
  pgelect status --role scheduler --json
  pgelect status --watch

Lease times come from the server's clock. Candidates are the connections
whose application_name is pgelect:<role>:<node>: 'holding' holds the
role's lock, 'waiting' waits for it, 'standing' polls for it (lease-backend
candidates: registered within their TTL); a priority other than 0 is shown,
and --json gives each candidate's priority and timing. Locks taken
with `pgelect lock` are listed after the roles (name, node, host, backend
pid, since; with --limit, each permit's slot and the first in line). --role of a role nobody holds, stands for or has led exits 66
and names the known roles.")]
    Status(crate::status::StatusArgs),
    /// Remove a stale role that nobody holds or stands for from the
    /// listings; refuses while any candidate does.
    #[command(after_help = "Examples:
  pgelect forget --role old-scheduler

Refuses (exit 75) while the role's lock is held or waited for, a candidate
connected as pgelect:<role>:<node> stands for it, or its lease is live; exit
66 when there is no such role. The role's row stays, emptied and marked
forgotten, so that its last term does: a candidate that stands for it again
continues above that term (fencing terms never repeat), and the role is
listed again.")]
    Forget(crate::forget::ForgetArgs),
    /// Check the promise on your own database: real `pgelect run`
    /// supervisors, faults on a seeded schedule, an independent check.
    #[command(after_help = "Examples:
  pgelect chaos                                   # a throwaway PostgreSQL, both backends, 60s each
  pgelect chaos --duration 5m --seed 42 --json chaos.json
  pgelect chaos --database-url-file staging.url --backends session --faults kill,stop,term,blackhole
  pgelect chaos --database-url-file staging.url --pooler-url-file bouncer.url --backends lease
  pgelect chaos --partitions 100 --members 100 --duration 3m   # a partition group through PgBouncer

Faults: kill (SIGKILL the leader's supervisor), stop (SIGSTOP it and its
command for 1.5 x the TTL, then SIGCONT), term (SIGTERM: a planned
handover), terminate (pg_terminate_backend on the leader's backends; needs
pg_signal_backend or superuser, skipped and reported otherwise), blackhole
(the leader's traffic stops for 1.5 x the TTL: each supervisor connects
through a proxy of its own that stops forwarding while both TCP connections
stay up), latency (the leader's traffic delayed by a quarter to twice its
heartbeat timeout for 1.5 x the TTL), starve (the leader's supervisor and
command run 1 ms in every 10 ms for 1.5 x the TTL), clock-jump (its wall clock moved an hour,
needs libfaketime). The network faults need a single-host postgres:// URL
and are skipped otherwise. On its own throwaway server only:
restart-fast, restart-immediate (the server restarted), pgbouncer-restart
(the PgBouncer in front of it killed and started again, where the lease
backend runs through it) and, as root, partition and partition-nopreempt
(each candidate in a network namespace, the leader's link cut).
Without --database-url or --database-url-file it starts a throwaway
PostgreSQL, and PgBouncer in transaction mode in front of it for the lease
backend's supervisors (--no-pooler: not). Against your database the lease
backend goes through --pooler-url if given. The session backend never goes
through a pooler, nor do the lease backend's LISTEN connections.
With --partitions N: a partition group on the lease backend instead,
--members supervisors `pgelect run --backend lease --partitions
chaos-<seed>-lease-group:N` through the pooler, a worker per partition led
(ticking every 50 ms); faults kill, kill-many (several members at once),
stop, term, pgbouncer-restart; every rule is checked per partition, and
after each fault every partition it hit must be led again within its bound.
Against your database it uses roles named chaos-<seed>-<backend>
(refused if one has a live leader: a session leader whose backend is
still connected, or a lease that is still renewed after one TTL's wait;
a dead run's last leader is no reason) and a table pgelect_chaos_<seed>,
dropped at the end.
Exit codes: 0 when no violation was found, 70 when one was (each printed
with the events that prove it).")]
    Chaos(crate::chaos::ChaosArgs),
    /// The worker `pgelect chaos` supervises (not for direct use).
    #[command(hide = true)]
    ChaosWorker(crate::chaos::WorkerArgs),
}

impl Global {
    /// The connection options from the flags and the environment.
    pub fn connect_options(&self) -> Result<pgelect::ConnectOptions, Failure> {
        let url = resolve_url(
            self.database_url.as_deref(),
            "--database-url",
            self.database_url_file.as_deref(),
            "--database-url-file",
        )?;
        let options = match url {
            Some(url) => pgelect::ConnectOptions::from_url(&url)?,
            None => pgelect::ConnectOptions::from_env()?,
        };
        Ok(options.schema(&self.schema)?)
    }

    /// When no database was named (no `--database-url`, `--database-url-file`
    /// or `DATABASE_URL`): a hint that says so, which libpq variables were
    /// used (names only, never values) and how to name one; `None` otherwise.
    pub fn no_url_hint(&self) -> Option<String> {
        let named = self.database_url.as_deref().is_some_and(|u| !u.is_empty())
            || self.database_url_file.is_some();
        if named {
            return None;
        }
        let used: Vec<&str> = [
            "PGHOST",
            "PGPORT",
            "PGUSER",
            "PGDATABASE",
            "PGPASSWORD",
            "PGSERVICE",
        ]
        .into_iter()
        .filter(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()))
        .collect();
        let from = if used.is_empty() {
            "libpq's defaults (localhost:5432, your login name as user and database)".to_owned()
        } else {
            format!("{} and libpq's defaults for the rest", used.join(", "))
        };
        Some(format!(
            "no database was named (no --database-url, --database-url-file or DATABASE_URL), so pgelect used {from}; name the database with --database-url URL or DATABASE_URL=URL, or set PGHOST, PGPORT, PGUSER and PGDATABASE"
        ))
    }

    /// The database URL only if named on the command line itself
    /// (`--database-url` or `--database-url-file`), ignoring `DATABASE_URL`
    /// and the other variables: for `pgelect demo`, which must not run
    /// against whatever database the environment happens to point at.
    pub fn explicit_url(&self) -> Result<Option<(String, &'static str)>, Failure> {
        let url = on_command_line("--database-url")
            .then_some(self.database_url.as_deref())
            .flatten();
        let file = on_command_line("--database-url-file")
            .then_some(self.database_url_file.as_deref())
            .flatten();
        let flag = match (url, file) {
            (Some(_), _) => "--database-url",
            (None, Some(_)) => "--database-url-file",
            (None, None) => return Ok(None),
        };
        let url = resolve_url(url, "--database-url", file, "--database-url-file")?;
        Ok(url.map(|u| (u, flag)))
    }
}

/// A URL option that may come from its flag, its environment variable, or
/// a file (`file_flag` or its variable). Precedence: the flag on the command
/// line, then the file, then the variable. The flag and the file flag both
/// on the command line are a usage error. Warns (once per flag) when the
/// flag on the command line holds a password.
pub fn resolve_url(
    value: Option<&str>,
    flag: &'static str,
    file: Option<&Path>,
    file_flag: &'static str,
) -> Result<Option<String>, Failure> {
    let value = value.filter(|v| !v.is_empty());
    let value_on_line = value.is_some() && on_command_line(flag);
    if value_on_line && file.is_some() && on_command_line(file_flag) {
        return Err(Failure::new(
            exit::USAGE,
            format!("{flag} and {file_flag} both given; use one"),
        ));
    }
    if let Some(url) = value.filter(|_| value_on_line) {
        if holds_password(url) {
            warn_password_on_command_line(flag, file_flag);
        }
        return Ok(Some(url.to_owned()));
    }
    if let Some(path) = file {
        return read_url_file(path, file_flag).map(Some);
    }
    Ok(value.map(str::to_owned))
}

/// Reads a URL from `path`: the whole file, without its trailing newline.
/// Errors (exit 78) name the path, never the content.
pub fn read_url_file(path: &Path, flag: &str) -> Result<String, Failure> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Failure::new(
            exit::CONFIG,
            format!("cannot read the URL file {} ({flag}): {e}", path.display()),
        )
    })?;
    let url = text.trim_end_matches(['\n', '\r']);
    if url.trim().is_empty() {
        return Err(Failure::new(
            exit::CONFIG,
            format!("the URL file {} ({flag}) is empty", path.display()),
        ));
    }
    Ok(url.to_owned())
}

/// True if `flag` (as `--flag VALUE` or `--flag=VALUE`) is among this
/// process's own arguments, before any `--` (after it come the supervised
/// command's arguments).
pub fn on_command_line(flag: &str) -> bool {
    std::env::args_os()
        .skip(1)
        .take_while(|a| a != "--")
        .any(|a| {
            let a = a.to_string_lossy();
            a == flag
                || a.strip_prefix(flag)
                    .is_some_and(|rest| rest.starts_with('='))
        })
}

/// Whether a URL or key=value string names a password (unparsable strings
/// are assumed to: the warning is cheap, a missed one is not).
fn holds_password(url: &str) -> bool {
    url.trim()
        .parse::<tokio_postgres::Config>()
        .map(|c| c.get_password().is_some())
        .unwrap_or(true)
}

fn warn_password_on_command_line(flag: &'static str, file_flag: &'static str) {
    static WARNED: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    if warned.contains(&flag) {
        return;
    }
    warned.push(flag);
    let env = match flag {
        "--database-url" => "DATABASE_URL",
        "--listen-url" => "PGELECT_LISTEN_URL",
        _ => "the environment",
    };
    tracing::warn!(
        "the URL given with {flag} holds a password, which every local user can read in /proc/PID/cmdline (ps); pass it in {env}, in a file with {file_flag} (mode 0600), or leave it out of the URL and use PGPASSWORD or ~/.pgpass"
    );
}

/// Sets up `tracing` on standard error per `-v`, `-q` and `--log-format`;
/// `RUST_LOG` overrides the level. `narrates`: the command's own steps are
/// shown at the default level (`pgelect run`: standing, elected, child
/// started and exited, handed over), the library's stay at warnings.
/// Colour only when standard error is a terminal and `NO_COLOR` is unset
/// or empty (no-color.org).
pub fn init_logging(global: &Global, narrates: bool) {
    use std::io::IsTerminal;
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
    let own = if narrates && !global.quiet && global.verbose == 0 {
        ",pgelect::run=info"
    } else {
        ""
    };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{level},tokio_postgres=warn{own}")));
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    match global.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
