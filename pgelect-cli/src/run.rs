//! `pgelect run`: run a command only while this process leads a role.

use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use pgelect::election::{BackendOptions, LeaseOptions, SessionOptions, Setting};
use pgelect::loss::LossReason;
use pgelect::{ConnectOptions, Elector, ElectorBuilder};

use crate::child::{self, Child};
use crate::cli::Global;
use crate::exit::{self, Failure};
use crate::signals::Signals;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The role to lead; one leader per role per schema.
    #[arg(long, value_name = "ROLE", required_unless_present = "partitions")]
    pub role: Option<String>,
    /// Instead of one role: take part in partition group GROUP of N
    /// partitions (roles GROUP/0 … GROUP/N-1), spread evenly over the
    /// running members, and run one CMD per partition held, with
    /// PGELECT_PARTITION, PGELECT_ROLE and PGELECT_TERM set. A partition
    /// handed over to another member gets SIGTERM (SIGKILL after --grace)
    /// first; a command that exits by itself is started again after 1s.
    /// Both backends: with --backend lease a member is one client, which
    /// may go through PgBouncer in transaction mode (and, with
    /// --listen-url, one direct LISTEN connection, so that a partition
    /// handed over is taken at once).
    #[arg(long, value_name = "GROUP:N", conflicts_with_all = ["role", "metrics_addr", "retry_every", "on_exit"])]
    pub partitions: Option<String>,
    /// This candidate's name (default: <hostname>-<pid>-<random>).
    #[arg(long = "id", value_name = "NODE")]
    pub node: Option<String>,
    /// Lease time-to-live: a frozen or cut-off leader is replaced after it.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "15s", value_name = "DURATION", allow_hyphen_values = true)]
    pub ttl: Duration,
    /// How the timing not set below is derived: `standard` follows --ttl
    /// (heartbeat ttl/15 from 20ms to 1s; after a crash a standby waits
    /// 2.5s at the default ttl, 400ms at --ttl 2s); `fast` heartbeats every
    /// 20ms (about 50 statements/s while leading) so that a crashed
    /// leader's successor starts within about 100ms (session backend only:
    /// `fast` is refused with --backend lease).
    #[arg(long, value_enum, default_value_t = ProfileArg::Standard, value_name = "PROFILE")]
    pub profile: ProfileArg,
    /// Time between heartbeats on the leader's lock connection (session
    /// backend only, refused with --backend lease; default from --profile).
    #[arg(long, value_parser = crate::duration::parse_positive, value_name = "DURATION", allow_hyphen_values = true)]
    pub heartbeat: Option<Duration>,
    /// How long a heartbeat or renewal may take before the lock connection
    /// counts as dead (session backend), or every lease statement's timeout
    /// (lease backend). Default from --profile.
    #[arg(long, value_parser = crate::duration::parse_positive, value_name = "DURATION", allow_hyphen_values = true)]
    pub heartbeat_timeout: Option<Duration>,
    /// How long a standby that took over from a leader that did not release
    /// waits before starting the command (session backend only, refused
    /// with --backend lease); at least --heartbeat + --heartbeat-timeout.
    /// Default from --profile.
    #[arg(long, value_parser = crate::duration::parse_positive, value_name = "DURATION", allow_hyphen_values = true)]
    pub handover_delay: Option<Duration>,
    /// How much earlier than the lease the leader stops acting (default:
    /// ttl/5).
    #[arg(long, value_parser = crate::duration::parse_positive, value_name = "DURATION", allow_hyphen_values = true)]
    pub safety_margin: Option<Duration>,
    /// Time between lease renewals (default: ttl/3).
    #[arg(long, value_parser = crate::duration::parse_positive, value_name = "DURATION", allow_hyphen_values = true)]
    pub renew_every: Option<Duration>,
    /// Election backend: `session` (advisory lock on a dedicated connection:
    /// failover in milliseconds to seconds; needs a direct connection or a
    /// session pool) or `lease` (lease row only: works through PgBouncer in
    /// transaction mode; a crashed leader is replaced when its lease ends).
    #[arg(long, value_enum, default_value_t = BackendArg::Session)]
    pub backend: BackendArg,
    /// Lease backend only: the longest a standby sleeps between two looks
    /// at the lease (default 1s). It looks again when the lease expires on
    /// the server's clock in any case, so a crashed leader is replaced
    /// within the ttl whatever this is; what it bounds is how long a clean
    /// release goes unseen without --listen-url. For a large fleet through
    /// a transaction pooler, set it to the ttl or more: each standby then
    /// costs about one statement per lease expiry instead of one a second.
    #[arg(long, value_parser = crate::duration::parse_positive, value_name = "DURATION", allow_hyphen_values = true)]
    pub retry_every: Option<Duration>,
    /// Lease backend only: a direct connection (bypassing the pooler) used
    /// for LISTEN, so that standbys take over a released lease at once and
    /// resign requests arrive at once. A password here is visible to every
    /// local user: prefer PGELECT_LISTEN_URL or --listen-url-file.
    #[arg(
        long,
        env = "PGELECT_LISTEN_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub listen_url: Option<String>,
    /// Read the --listen-url URL from this file (read once; a trailing
    /// newline is ignored). Keep it private (mode 0600).
    #[arg(long, env = "PGELECT_LISTEN_URL_FILE", value_name = "PATH")]
    pub listen_url_file: Option<std::path::PathBuf>,
    /// Time the command gets between SIGTERM and SIGKILL on a planned step-down
    /// (default: 10s, or less when the TTL leaves less time).
    #[arg(long, value_parser = crate::duration::parse_positive, value_name = "DURATION", allow_hyphen_values = true)]
    pub grace: Option<Duration>,
    /// What to do when the command exits by itself while leading.
    #[arg(long, value_enum, default_value_t = OnExit::Exit)]
    pub on_exit: OnExit,
    /// Serve /metrics (Prometheus), /healthz, /leader (JSON) and /is-leader
    /// (200 only while this process leads, else 503: for readiness probes)
    /// on this address, e.g. 127.0.0.1:9187.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Give the command the database variables pgelect was started with
    /// (DATABASE_URL, PGPASSWORD, PGPASSFILE, PGUSER, PGHOST and the rest of
    /// libpq's set); without this flag they are removed from its environment.
    #[arg(long)]
    pub pass_database_env: bool,
    /// This candidate's priority: the leader hands over (SIGTERM to its
    /// command, then a clean release) to a standing candidate of strictly
    /// higher priority that is ready to take over; equal priorities never
    /// take over from each other. Negative values are allowed.
    #[arg(
        long,
        default_value_t = 0,
        allow_negative_numbers = true,
        value_name = "N"
    )]
    pub priority: i32,
    /// The command to run while leader, after `--` (passed byte for byte).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<std::ffi::OsString>,
}

/// The election backend, as typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// Advisory lock plus lease row (the default).
    Session,
    /// Lease row only, pooler-safe.
    Lease,
}

/// The timing profile, as typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProfileArg {
    /// Timing that follows --ttl.
    Standard,
    /// Crash failover in about 100 ms for about 50 statements/s.
    Fast,
}

impl From<ProfileArg> for pgelect::election::Profile {
    fn from(p: ProfileArg) -> pgelect::election::Profile {
        match p {
            ProfileArg::Standard => pgelect::election::Profile::Standard,
            ProfileArg::Fast => pgelect::election::Profile::Fast,
        }
    }
}

impl RunArgs {
    /// The session backend's options given (`--profile`, `--heartbeat`,
    /// `--heartbeat-timeout`, `--handover-delay`).
    pub fn session_options(&self) -> SessionOptions {
        let mut session = SessionOptions::new().profile(self.profile.into());
        if let Some(d) = self.heartbeat {
            session = session.heartbeat(d);
        }
        if let Some(d) = self.heartbeat_timeout {
            session = session.heartbeat_timeout(d);
        }
        if let Some(d) = self.handover_delay {
            session = session.handover_delay(d);
        }
        session
    }

    /// The lease backend's options given (`--heartbeat-timeout` as the
    /// statement timeout, the `LISTEN` connection); the session backend's
    /// own flags are refused, naming them.
    fn lease_options(&self, listen: Option<ConnectOptions>) -> Result<LeaseOptions, Failure> {
        if self.profile == ProfileArg::Fast {
            return Err(Failure::new(
                exit::USAGE,
                "--profile fast is for --backend session: the fast profile is for the session backend; it shortens the wait after an unclean takeover, which the lease backend does not have (its failover follows the ttl); lower --ttl instead",
            ));
        }
        for (given, flag) in [
            (self.heartbeat.is_some(), "--heartbeat"),
            (self.handover_delay.is_some(), "--handover-delay"),
        ] {
            if given {
                return Err(Failure::new(
                    exit::USAGE,
                    format!("{flag} is for --backend session: the lease backend sends no heartbeats and has no handover delay (its statements are bounded by --heartbeat-timeout); leave {flag} out"),
                ));
            }
        }
        let mut lease = LeaseOptions::new();
        if let Some(d) = self.heartbeat_timeout {
            lease = lease.statement_timeout(d);
        }
        if let Some(listen) = listen {
            lease = lease.listen_via(listen);
        }
        if let Some(d) = self.retry_every {
            lease = lease.retry_every(d);
        }
        Ok(lease)
    }

    /// The timing every backend uses (`--ttl`, `--safety-margin`,
    /// `--renew-every`) and `backend`, applied to `builder`.
    pub fn configure(
        &self,
        builder: ElectorBuilder,
        backend: impl Into<BackendOptions>,
    ) -> ElectorBuilder {
        let mut builder = builder.ttl(self.ttl).backend(backend);
        if let Some(d) = self.safety_margin {
            builder = builder.safety_margin(d);
        }
        if let Some(d) = self.renew_every {
            builder = builder.renew_every(d);
        }
        builder
    }

    /// Whether any timing option other than --ttl was given.
    fn timing_given(&self) -> bool {
        self.profile != ProfileArg::Standard
            || self.heartbeat.is_some()
            || self.heartbeat_timeout.is_some()
            || self.handover_delay.is_some()
            || self.safety_margin.is_some()
            || self.renew_every.is_some()
            || self.retry_every.is_some()
    }
}

/// The option of `pgelect run` that sets `setting`.
fn flag(setting: Setting) -> String {
    match setting {
        Setting::Ttl => "--ttl",
        Setting::SafetyMargin => "--safety-margin",
        Setting::RenewEvery => "--renew-every",
        Setting::Heartbeat => "--heartbeat",
        // The lease backend's statement timeout is set by the same option.
        Setting::HeartbeatTimeout | Setting::StatementTimeout => "--heartbeat-timeout",
        Setting::HandoverDelay => "--handover-delay",
        Setting::RetryEvery => "--retry-every",
        other => other.as_str(),
    }
    .to_owned()
}

/// A configuration the library refused, in the command's words: the
/// library's rule and values with its settings named by the options that
/// set them; when only `--ttl` was given and it is too short, the shortest
/// `--ttl` that `builder` (as configured) accepts, from the library's own
/// computation.
fn refused(e: pgelect::Error, args: &RunArgs, builder: Option<&ElectorBuilder>) -> Failure {
    if !e.is_config() {
        return e.into();
    }
    let shortest = builder
        .filter(|_| !args.timing_given())
        .and_then(ElectorBuilder::shortest_ttl)
        .filter(|&shortest| shortest > args.ttl);
    if let (Some(shortest), Some(_)) = (shortest, e.config_error()) {
        let show = crate::duration::show;
        return Failure::new(
            exit::USAGE,
            format!(
                "--ttl {} is too short: the shortest --ttl accepted is {} (the leader stops acting at 4/5 of the TTL and needs room before that for a heartbeat or a renewal to be answered); give --ttl {} or more (default 15s)",
                show(args.ttl),
                show(shortest),
                show(shortest),
            ),
        );
    }
    let text = match e.config_error() {
        Some(c) => format!("invalid configuration: {}", c.describe(flag)),
        None => e.to_string(),
    };
    Failure::new(exit::USAGE, text)
}

/// What happens when the command exits by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnExit {
    /// Release leadership and exit with the command's code.
    Exit,
    /// Release leadership and stand for election again.
    Release,
    /// Keep leadership and start the command again (after 1 s).
    Rerun,
}

const DEFAULT_GRACE: Duration = Duration::from_secs(10);

pub async fn run(global: &Global, args: RunArgs) -> Result<u8, Failure> {
    if let Some(spec) = args.partitions.clone() {
        return run_partitions(global, args, &spec).await;
    }
    let role = args
        .role
        .clone()
        .expect("BUG: clap requires --role without --partitions");
    check_name("--role", &role)?;
    if let Some(node) = &args.node {
        check_name("--id", node)?;
    }
    let options = global.connect_options()?;
    let listen = listen_options(global, &args)?;
    let backend: BackendOptions = match args.backend {
        BackendArg::Session => {
            if args.retry_every.is_some() {
                return Err(Failure::new(
                    exit::USAGE,
                    "--retry-every is for --backend lease: a session-backend standby waits in the lock queue or polls on its own schedule; leave --retry-every out",
                ));
            }
            args.session_options().into()
        }
        BackendArg::Lease => args.lease_options(listen)?.into(),
    };
    let mut builder = args.configure(Elector::builder(options.clone(), &role), backend);
    if let Some(node) = &args.node {
        builder = builder.node_id(node);
    }
    builder = builder.priority(args.priority);
    // Shared with the metrics listener, which reads its state.
    let elector = match builder.clone().build() {
        Ok(elector) => std::sync::Arc::new(elector),
        Err(e) => return Err(refused(e, &args, Some(&builder))),
    };
    let budget = elector.deadline_budget();
    let grace = match args.grace {
        Some(g) if g >= budget => {
            return Err(Failure::new(
                exit::USAGE,
                format!(
                    "--grace {} is not shorter than the leader's deadline budget {} (ttl {} minus the safety margin): the command could outlive leadership; lower --grace or raise --ttl",
                    crate::duration::show(g),
                    crate::duration::show(budget),
                    crate::duration::show(args.ttl)
                ),
            ))
        }
        Some(g) => g,
        None => DEFAULT_GRACE.min(budget / 2),
    };
    // Both checks fail fast: a standby would otherwise learn only when (if
    // ever) elected that its command does not exist, and the campaign
    // retries an unreachable database for ever.
    check_command(&args.command)?;
    preflight(&options).await?;
    let mut signals = Signals::install()?;
    let node = elector.node_id().to_owned();
    let http = match args.metrics_addr {
        Some(addr) => Some(crate::http::serve(addr, elector.clone()).await?),
        None => None,
    };
    let set_phase = |phase: crate::http::Phase| {
        if let Some(h) = &http {
            h.set(phase);
        }
    };
    let backend = match args.backend {
        BackendArg::Session => "session",
        BackendArg::Lease => "lease",
    };
    // What an operator reads at the default level (info): one line per
    // step, the same events as fields in `--log-format json`.
    let timing = elector.timing();
    let show = crate::duration::show;
    let timing_text = match args.backend {
        BackendArg::Session => format!(
            "{} timing: ttl {}, heartbeat {} answered within {}, handover delay {}",
            timing.profile,
            show(timing.ttl),
            show(timing.heartbeat),
            show(timing.heartbeat_timeout),
            show(timing.handover_delay)
        ),
        BackendArg::Lease => format!(
            "ttl {}, renewal every {}, statement timeout {}",
            show(timing.ttl),
            show(timing.renew_every),
            show(timing.heartbeat_timeout)
        ),
    };
    tracing::info!(event = "standing", role = %role, %node, backend, ttl = ?args.ttl, ?grace,
        profile = %timing.profile, heartbeat = ?timing.heartbeat, heartbeat_timeout = ?timing.heartbeat_timeout,
        handover_delay = ?timing.handover_delay,
        "standing for role {:?} as node {node:?} ({backend} backend, {timing_text})",
        role);
    let mut standing_since = Instant::now();
    let standing_env = [
        ("PGELECT_ROLE", role.clone()),
        ("PGELECT_NODE", node.clone()),
    ];
    loop {
        // The command's watcher, started while standing by: at election
        // only the command is left to start (see `child::arm`).
        let armed = match child::arm(&child::Spec {
            argv: &args.command,
            env: &standing_env,
            pass_database_env: args.pass_database_env,
        }) {
            Ok(armed) => Some(armed),
            Err(failure) => {
                tracing::debug!(error = %failure.message, "cannot start the process watcher ahead; starting it at election");
                None
            }
        };
        let leadership = tokio::select! {
            l = elector.leadership() => l?,
            sig = signals.recv() => {
                tracing::info!(%sig, "stopping while standing by");
                drop(armed);
                withdraw(&elector).await;
                return Ok(0);
            }
        };
        let term = leadership.term();
        set_phase(crate::http::Phase::Leading(term.get()));
        let waited = standing_since.elapsed();
        tracing::info!(event = "elected", role = %role, %node, term = term.get(), after_ms = waited.as_millis() as u64,
            "elected leader of role {:?} with term {term} after {:.1}s; starting the command",
            role, waited.as_secs_f64());
        let env = [
            ("PGELECT_ROLE", role.clone()),
            ("PGELECT_NODE", node.clone()),
            ("PGELECT_TERM", term.to_string()),
        ];
        let spec = child::Spec {
            argv: &args.command,
            env: &env,
            pass_database_env: args.pass_database_env,
        };
        let armed = armed.and_then(|a| {
            a.start(&[("PGELECT_TERM", term.to_string())])
                .map_err(|e| tracing::debug!(error = %e, "the process watcher started ahead is gone; starting another"))
                .ok()
        });
        let mut child = match armed.map_or_else(|| child::spawn(&spec), Ok) {
            Ok(child) => child,
            Err(failure) => {
                // Hand over cleanly rather than leave standbys an unclean
                // loss (and its handover delay) to clear up.
                release(leadership).await;
                return Err(failure);
            }
        };
        started(&child, term);
        loop {
            tokio::select! {
                status = child.wait() => {
                    let code = exited(status, term);
                    match args.on_exit {
                        OnExit::Rerun if !leadership.is_lost() => {
                            tokio::select! {
                                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                                _ = leadership.lost() => break,
                            }
                            child = match child::spawn(&spec) {
                                Ok(child) => child,
                                Err(failure) => {
                                    release(leadership).await;
                                    return Err(failure);
                                }
                            };
                            started(&child, term);
                            continue;
                        }
                        OnExit::Exit => {
                            release(leadership).await;
                            leave(&elector).await;
                            return Ok(code);
                        }
                        _ => {
                            release(leadership).await;
                            set_phase(crate::http::Phase::Standing);
                            standing_again(&role, &node);
                            standing_since = Instant::now();
                            break;
                        }
                    }
                }
                _ = leadership.lost() => {
                    set_phase(crate::http::Phase::Stopping);
                    let reason = leadership.loss().map(|l| l.reason());
                    if matches!(reason, Some(LossReason::Resigned | LossReason::HandedOver)) {
                        // Planned: `pgelect resign` (or the library's
                        // request_resign) asked, or a candidate of higher
                        // priority is ready; not a warning.
                        if reason == Some(LossReason::HandedOver) {
                            tracing::info!(event = "handing_over", role = %role, term = term.get(),
                                "a candidate of higher priority is ready to lead role {:?} (term {term}); stopping the command (SIGTERM, SIGKILL after {})",
                                role, crate::duration::show(grace));
                        } else {
                            tracing::info!(event = "resign_requested", role = %role, term = term.get(),
                                "resign requested for role {:?} (term {term}); stopping the command (SIGTERM, SIGKILL after {})",
                                role, crate::duration::show(grace));
                        }
                        let status = stop_gracefully(&mut child, grace, &leadership).await;
                        if let Some(status) = status {
                            exited(Ok(status), term);
                        }
                        release(leadership).await;
                    } else {
                        let started = Instant::now();
                        let status = child.kill_now().await;
                        let why = reason.map_or("unknown", LossReason::as_str);
                        tracing::warn!(event = "lost", role = %role, term = term.get(), reason = why,
                            killed_in_ms = started.elapsed().as_millis() as u64,
                            "lost leadership of role {:?} (term {term}): {}; the command was killed",
                            role, reason.map_or_else(|| "unknown reason".to_owned(), |r| r.to_string()));
                        exited(status, term);
                    }
                    set_phase(crate::http::Phase::Standing);
                    standing_again(&role, &node);
                    standing_since = Instant::now();
                    break;
                }
                sig = signals.recv() => {
                    tracing::info!(event = "stopping", signal = %sig, term = term.get(),
                        "{sig} received; stopping the command, then handing over role {:?}", role);
                    if let Some(status) = stop_gracefully(&mut child, grace, &leadership).await {
                        exited(Ok(status), term);
                    }
                    release(leadership).await;
                    leave(&elector).await;
                    return Ok(0);
                }
            }
        }
    }
}

/// How long a supervisor that handed its role over and stops for good
/// waits before it closes its connections and exits.
///
/// What an exit costs the server (each connection's backend ending, the
/// registration deleted) would otherwise run at the very moment the successor is
/// granted the role and records its term, and slow it down: measured with
/// `pgelect-bench cli-handoff` on a 2-core machine running PostgreSQL and
/// every candidate, about 1 ms of a 6-8 ms planned handover. A successor
/// takes a few milliseconds; a stop that takes 25 ms longer costs nobody.
const HANDOVER_LINGER: Duration = Duration::from_millis(25);

/// The end of a supervisor that handed over and stops for good: waits
/// [`HANDOVER_LINGER`], then leaves the candidate registry, and returns to
/// exit. (No standby defers to it meanwhile: the lease backend's release
/// marks the releasing node's registration as not seen, and the session
/// backend reads readiness from the lock queue.)
async fn leave(elector: &Elector) {
    tokio::time::sleep(HANDOVER_LINGER).await;
    withdraw(elector).await;
}

/// Leaves the candidate registry when stopping for good (best effort: a
/// row left behind is never taken for a ready candidate).
async fn withdraw(elector: &Elector) {
    if let Err(e) = elector.withdraw().await {
        tracing::debug!(error = %e, "could not withdraw from the candidate registry");
    }
}

/// Refuses a role or node id that is empty or holds control characters:
/// they cannot be shown in `application_name` (the server replaces them),
/// so `pgelect status` could not find the candidate, and they garble logs.
/// (NUL cannot reach us: argv strings end at NUL.)
pub fn check_name(flag: &str, value: &str) -> Result<(), Failure> {
    if value.is_empty() {
        return Err(Failure::new(
            exit::USAGE,
            format!("{flag} is empty; give a name such as `scheduler`"),
        ));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(Failure::new(
            exit::USAGE,
            format!(
                "{flag} {value:?} contains the control character U+{:04X}; use printable characters only",
                c as u32
            ),
        ));
    }
    Ok(())
}

/// Finds the command the way `execvp` will (a name with a `/` as a path,
/// else on `PATH`), so that a typo fails with 127 (126 when not executable)
/// before standing for election rather than after winning it.
fn check_command(argv: &[std::ffi::OsString]) -> Result<(), Failure> {
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};
    let program = argv
        .first()
        .ok_or_else(|| Failure::new(exit::USAGE, "no command given after `--`"))?;
    let executable = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .ok()
    };
    let candidates: Vec<PathBuf> = if program.as_encoded_bytes().contains(&b'/') {
        vec![PathBuf::from(program)]
    } else {
        let path = std::env::var_os("PATH")
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
        std::env::split_paths(&path)
            .map(|dir| dir.join(program))
            .collect()
    };
    let mut found_but_not_executable = false;
    for candidate in &candidates {
        match executable(candidate) {
            Some(true) => return Ok(()),
            Some(false) => found_but_not_executable = true,
            None => {}
        }
    }
    if found_but_not_executable {
        Err(Failure::new(
            child::NOT_EXECUTABLE,
            format!(
                "command {program:?} cannot be executed: permission denied (or not a regular file)"
            ),
        ))
    } else {
        Err(Failure::new(
            child::NOT_FOUND,
            format!("command not found: {program:?}; check the name and PATH"),
        ))
    }
}

/// One connection before standing: a database that cannot be reached at
/// start is most likely a wrong URL, which retrying would hide for ever
/// (exit 69, bounded by the connect timeout); a missing or old schema is a
/// configuration error (78). Once started, `run` rides out outages.
async fn preflight(options: &pgelect::ConnectOptions) -> Result<(), Failure> {
    let client = crate::db::connect(options)
        .await
        .map_err(|f| {
            Failure::new(
                f.code,
                format!(
                    "{}; `pgelect run` needs the database at start (after that it stays in the election through outages)",
                    f.message
                ),
            )
        })?;
    pgelect::schema::check_schema(&client, options.schema_name()).await?;
    Ok(())
}

/// SIGTERM, then SIGKILL after `grace`; at once if leadership ends for a
/// reason other than a resignation meanwhile. Returns how the command ended
/// (`None` if that could not be learned).
async fn stop_gracefully(
    child: &mut Child,
    grace: Duration,
    leadership: &pgelect::Leadership,
) -> Option<std::process::ExitStatus> {
    child.terminate();
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        tokio::select! {
            // The watcher killed what the command left before reporting.
            status = child.wait() => return status.ok(),
            _ = tokio::time::sleep_until(deadline) => {
                tracing::warn!(?grace, "the command outlived its grace period; killing it");
                return child.kill_now().await.ok();
            }
            _ = leadership.lost(), if !leadership.is_lost() => {}
        }
        if !matches!(
            leadership.loss().map(|l| l.reason()),
            None | Some(LossReason::Resigned)
                | Some(LossReason::HandedOver)
                | Some(LossReason::Shutdown)
        ) {
            return child.kill_now().await.ok();
        }
    }
}

/// Logs that the command started (under its watcher, whose pid is given:
/// the command's own pid is the watcher's child).
fn started(child: &Child, term: pgelect::Term) {
    tracing::info!(
        event = "child_started",
        watcher_pid = child.watcher_pid(),
        term = term.get(),
        "command started (watcher pid {})",
        child.watcher_pid()
    );
}

/// Logs how the command ended (its code, or the signal that killed it)
/// and returns the shell's exit code for it.
fn exited(status: std::io::Result<std::process::ExitStatus>, term: pgelect::Term) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    let Ok(status) = status else {
        return exit::SOFTWARE;
    };
    let code = child::exit_code(status);
    // Its watcher has killed what it left: nothing of it outlives this.
    match (status.code(), status.signal()) {
        (Some(c), _) => tracing::info!(
            event = "child_exited",
            code = c,
            term = term.get(),
            "command exited with code {c}"
        ),
        (None, Some(sig)) => {
            let name = nix::sys::signal::Signal::try_from(sig)
                .map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_owned());
            tracing::info!(event = "child_exited", signal = %name, code, term = term.get(),
                "command killed by {name}")
        }
        _ => {}
    }
    code
}

fn standing_again(role: &str, node: &str) {
    tracing::info!(
        event = "standing",
        role,
        node,
        "standing for role {role:?} again as node {node:?}"
    );
}

async fn release(leadership: pgelect::Leadership) {
    // The command's process group is already gone or killed by the caller
    // (`Child::stop` / `kill_now` end the group, not just the child).
    let term = leadership.term();
    let role = leadership.role().to_owned();
    if let Err(e) = leadership.resign().await {
        tracing::warn!(%term, error = %e, "releasing leadership failed; standbys take over when the lease ends");
    } else {
        tracing::info!(event = "handed_over", role = %role, term = term.get(),
            "handed over role {role:?} (term {term}): released for the standbys");
    }
}

/// A partition's role TTL when `--ttl` is not given: the standard 15 s does
/// not fit the TCP timeouts of the shared connection a member's partitions
/// stand on (the library's partition default).
const PARTITION_TTL: Duration = pgelect::partitions::DEFAULT_TTL;

/// `pgelect run --partitions GROUP:N -- CMD`: one member of a partition
/// group, one command per partition held.
///
/// Why one command per partition rather than one command given the set:
/// each partition moves on its own, with its own term for
/// `pgelect.fence`; a command per partition is stopped and started alone
/// when its partition is handed over, while a single command would have to
/// be restarted (or told) at every change, stopping the work on every
/// partition for the move of one.
/// The direct connection the lease backend listens on (`--listen-url`,
/// `--listen-url-file` or their environment variables). Refused on the
/// command line for the session backend, which listens on its own lock
/// connection; from the environment (shared by candidates of both kinds)
/// ignored there.
fn listen_options(global: &Global, args: &RunArgs) -> Result<Option<ConnectOptions>, Failure> {
    let url = crate::cli::resolve_url(
        args.listen_url.as_deref(),
        "--listen-url",
        args.listen_url_file.as_deref(),
        "--listen-url-file",
    )?;
    let Some(url) = url else {
        return Ok(None);
    };
    match args.backend {
        BackendArg::Session => {
            if crate::cli::on_command_line("--listen-url")
                || crate::cli::on_command_line("--listen-url-file")
            {
                return Err(Failure::new(
                    exit::USAGE,
                    "--listen-url is for --backend lease; the session backend listens on its own lock connection",
                ));
            }
            tracing::info!("PGELECT_LISTEN_URL(_FILE) ignored: the session backend listens on its own lock connection");
            Ok(None)
        }
        BackendArg::Lease => Ok(Some(
            ConnectOptions::from_url(&url)?.schema(&global.schema)?,
        )),
    }
}

async fn run_partitions(global: &Global, args: RunArgs, spec: &str) -> Result<u8, Failure> {
    use pgelect::{partitions::PartitionEvent, partitions::PartitionGroup};
    let (group_name, n) = crate::status::parse_partitions(spec)?;
    if let Some(node) = &args.node {
        check_name("--id", node)?;
    }
    // On the lease backend (through a pooler too) a member is one shared
    // lease client; on the session backend one shared connection.
    let backend: BackendOptions = match args.backend {
        BackendArg::Session => args.session_options().into(),
        BackendArg::Lease => args.lease_options(None)?.into(),
    };
    let options = global.connect_options()?;
    let ttl_given = crate::cli::on_command_line("--ttl");
    let ttl = if ttl_given { args.ttl } else { PARTITION_TTL };
    let budget = ttl.saturating_sub(args.safety_margin.unwrap_or(ttl / 5));
    let grace = match args.grace {
        Some(g) if g >= budget => {
            return Err(Failure::new(
                exit::USAGE,
                format!(
                    "--grace {} is not shorter than the leader's deadline budget {}: lower --grace or raise --ttl",
                    crate::duration::show(g),
                    crate::duration::show(budget)
                ),
            ))
        }
        Some(g) => g,
        None => DEFAULT_GRACE.min(budget / 2),
    };
    check_command(&args.command)?;
    let args = std::sync::Arc::new(args);
    let timing = args.clone();
    let mut builder = PartitionGroup::builder(options.clone(), &group_name, n)
        .release_grace(grace + Duration::from_secs(1))
        .elector(move |b| {
            let b = timing.configure(b, backend.clone());
            if ttl_given {
                b
            } else {
                b.ttl(PARTITION_TTL)
            }
        });
    if let Some(node) = &args.node {
        builder = builder.member(node);
    }
    if let Some(listen) = listen_options(global, &args)? {
        builder = builder.listen_via(listen);
    }
    let group = match builder.build() {
        Ok(g) => g,
        Err(e) => return Err(refused(e, &args, None)),
    };
    preflight(&options).await?;
    let mut signals = Signals::install()?;
    let node = group.member().to_owned();
    let mut events = group.join()?;
    tracing::info!(event = "standing", group = %group_name, partitions = n, %node, ?grace,
        "taking part in partition group {group_name:?} ({n} partitions) as node {node:?}");
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(PartitionEvent::Gained(held)) => {
                    tasks.spawn(supervise(held, args.clone(), node.clone(), grace));
                }
                Some(_) => {}
                None => break,
            },
            sig = signals.recv() => {
                tracing::info!(event = "stopping", signal = %sig,
                    "{sig} received; stopping the commands, then handing over every partition");
                group.leave().await?;
                break;
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    Ok(0)
}

/// Runs the command for one held partition until its token is cancelled:
/// SIGTERM then SIGKILL after `grace` for a planned stop (handover,
/// leaving), at once for a lost leadership; started again 1 s after it
/// exits by itself. Dropping `held` at the end lets the partition go.
async fn supervise(
    held: pgelect::partitions::HeldPartition,
    args: std::sync::Arc<RunArgs>,
    node: String,
    grace: Duration,
) {
    let term = held.term();
    let token = held.token();
    let env = [
        ("PGELECT_ROLE", held.role().to_owned()),
        ("PGELECT_PARTITION", held.partition().to_string()),
        ("PGELECT_NODE", node),
        ("PGELECT_TERM", term.to_string()),
    ];
    let spec = child::Spec {
        argv: &args.command,
        env: &env,
        pass_database_env: args.pass_database_env,
    };
    while !token.is_cancelled() {
        let mut child = match child::spawn(&spec) {
            Ok(c) => c,
            Err(f) => {
                tracing::error!(partition = held.partition(), error = %f.message, "cannot start the command; holding the partition idle until it is handed over");
                token.cancelled().await;
                break;
            }
        };
        tracing::info!(event = "child_started", role = %held.role(), term = term.get(), watcher_pid = child.watcher_pid(),
            "command for partition {} started (watcher pid {})", held.partition(), child.watcher_pid());
        tokio::select! {
            status = child.wait() => {
                exited(status, term);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = token.cancelled() => {}
                }
            }
            _ = token.cancelled() => {
                let status = match held.loss().map(|l| l.reason()) {
                    Some(LossReason::HandedOver | LossReason::Shutdown | LossReason::Resigned) => {
                        child.stop(grace).await
                    }
                    _ => child.kill_now().await,
                };
                exited(status, term);
            }
        }
    }
    drop(held);
}
