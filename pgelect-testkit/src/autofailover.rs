//! A pg_auto_failover formation (a monitor and two or three data nodes with
//! synchronous replication) on loopback, for tests that run pgelect under a
//! real HA manager.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::cluster::template;
use crate::util::{
    self, as_server_user, block_on_fresh_runtime, chown_to_server, ctx, err, make_temp_dir,
    open_log, wait_or_kill, wait_timeout, write_private,
};
use crate::{free_port, percent_encode, pg_bin_dir, HOST, SUPERUSER, TEST_PASSWORD};

/// How long a `pg_autoctl create` (initdb or base backup, start, register)
/// or a `perform` command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// How long the formation may take to reach its first stable state.
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// `pg_hba.conf` of every server of the formation (written before
/// `pg_autoctl create`, which is told `--skip-pg-hba`).
///
/// pg_auto_failover's own users (`autoctl_node` on the monitor, the monitor's
/// health checks as `pgautofailover_monitor`, replication and `pg_rewind` as
/// `pgautofailover_replicator`) are trusted from `127.0.0.1` only; everyone
/// else gives the kit's SCRAM password, as on the kit's other clusters. The
/// Unix socket is in the formation's private directory (mode 0700, the
/// server user's): only that user and root reach it, and `pg_autoctl`
/// administers its local server through it.
const PG_HBA: &str = "\
# TYPE  DATABASE     USER                                                          ADDRESS       METHOD
local   all          all                                                                         trust
host    all          autoctl_node,pgautofailover_monitor,pgautofailover_replicator 127.0.0.1/32  trust
host    replication  pgautofailover_replicator                                     127.0.0.1/32  trust
host    all          all                                                           127.0.0.1/32  scram-sha-256
host    all          all                                                           ::1/128       scram-sha-256
";

/// The monitor's failure detection and demotion timeouts for a test
/// machine (`pgautofailover.*`; defaults in brackets): a dead primary is
/// failed over in about 3 s instead of about 50 s.
///
/// `primary_demote_timeout` is how long the monitor waits, before it lets a
/// standby take writes, for an unreachable primary to have demoted itself:
/// its keeper does so after `timeout.network_partition_timeout`
/// ([`KEEPER_SETTINGS`], 2 s here) plus its 1 s loop. It stays above that
/// sum, as pg_auto_failover's defaults keep 30 s above 20 s, so lowering
/// both keeps the manager's own protection against two primaries. That
/// protection needs the old primary's keeper to reach `demote_timeout`: in
/// pg_auto_failover 2.0 one in wait_primary cannot (no such transition),
/// and a race of a `perform switchover` with its keeper's report can put it
/// there (the book's chaos page, "The lost writes"); then this timeout is
/// how long it takes writes without a synchronous standby while the
/// standby is promoted.
const MONITOR_SETTINGS: &str = "
# --- pgelect-testkit: failure detection for a test machine ---
pgautofailover.health_check_period = 1000          # [5000] ms
pgautofailover.health_check_timeout = 1000         # [5000] ms
pgautofailover.health_check_max_retries = 1        # [2]
pgautofailover.health_check_retry_delay = 500      # [2000] ms
pgautofailover.node_considered_unhealthy_timeout = 2000  # [20000] ms
pgautofailover.primary_demote_timeout = 4000       # [30000] ms
pgautofailover.startup_grace_period = 2000         # [10000] ms
";

/// The keepers' settings (`pg_autoctl config set`) matching
/// [`MONITOR_SETTINGS`].
const KEEPER_SETTINGS: [(&str, &str); 1] = [("timeout.network_partition_timeout", "2")];

/// Which data node: its index in the formation (0 is created first and is
/// the first primary).
pub type NodeIndex = usize;

/// One data node as the monitor sees it (`pg_autoctl show state --json`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    /// The node's index in the formation ([`NodeIndex`]).
    pub index: NodeIndex,
    /// Its pg_auto_failover name (`node1`, `node2`, ...).
    pub name: String,
    /// Its PostgreSQL port on `127.0.0.1`.
    pub port: u16,
    /// The state its keeper last reported (`primary`, `secondary`,
    /// `draining`, `catchingup`, ...).
    pub reported: String,
    /// The state the monitor assigned it.
    pub assigned: String,
    /// The monitor's health check: `true` when it answered.
    pub healthy: bool,
}

impl NodeState {
    /// Reported and assigned `primary`: it accepts writes (as far as the
    /// manager is concerned).
    pub fn is_primary(&self) -> bool {
        self.reported == "primary" && self.assigned == "primary"
    }

    /// Settled in a state that takes writes: `primary`, `wait_primary` (a
    /// primary with no standby in sync: after its standby died) or `single`.
    pub fn accepts_writes(&self) -> bool {
        self.is_settled()
            && matches!(
                self.reported.as_str(),
                "primary" | "wait_primary" | "single"
            )
    }

    /// One node of `formation` is primary and every other one a settled
    /// secondary ([`AutoFailover::wait_stable`] waits for it).
    pub fn stable(formation: &[NodeState]) -> bool {
        formation.iter().filter(|n| n.is_primary()).count() == 1
            && formation
                .iter()
                .all(|n| n.is_primary() || (n.reported == "secondary" && n.is_settled()))
    }

    /// Reported and assigned the same state: not in a transition.
    pub fn is_settled(&self) -> bool {
        self.reported == self.assigned
    }
}

/// How [`AutoFailover::start_with`] sets a formation up.
#[derive(Debug, Clone)]
pub struct AutoFailoverOptions {
    nodes: usize,
    number_sync_standbys: usize,
    fast_detection: bool,
    keep: Option<PathBuf>,
}

impl Default for AutoFailoverOptions {
    fn default() -> Self {
        AutoFailoverOptions::new()
    }
}

impl AutoFailoverOptions {
    /// Two data nodes, fast failure detection.
    pub fn new() -> AutoFailoverOptions {
        AutoFailoverOptions {
            nodes: 2,
            number_sync_standbys: 0,
            fast_detection: true,
            keep: None,
        }
    }

    /// The number of data nodes: 2 or 3.
    pub fn nodes(mut self, nodes: usize) -> AutoFailoverOptions {
        self.nodes = nodes;
        self
    }

    /// The formation's `number_sync_standbys` (pg_auto_failover's default
    /// 0): how many standbys must acknowledge a commit. pg_auto_failover
    /// accepts 1 only with at least two standbys (three data nodes).
    ///
    /// With 0, the monitor may run a primary without synchronous
    /// replication (`wait_primary`) whenever it counts no healthy standby,
    /// by design, and pg_auto_failover 2.0 can do so in a race with a
    /// `perform switchover` while it promotes that standby (the book's
    /// chaos page, "The lost writes"): writes acknowledged then are lost.
    /// With 1 a primary left without a standby in the quorum blocks writes
    /// instead, so on a settled formation an acknowledged write is on a
    /// standby (a newly promoted primary still runs as `wait_primary`
    /// until a standby has caught up).
    pub fn number_sync_standbys(mut self, n: usize) -> AutoFailoverOptions {
        self.number_sync_standbys = n;
        self
    }

    /// `false` keeps pg_auto_failover's production timeouts (a dead primary
    /// is failed over after about 50 s) instead of the lowered timeouts the kit sets (health check 1 s, unhealthy after 2 s).
    pub fn fast_detection(mut self, fast: bool) -> AutoFailoverOptions {
        self.fast_detection = fast;
        self
    }

    /// Keeps the formation's evidence in `dir` when it stops (created if
    /// need be; a failing run's post-mortem): the monitor's events and the
    /// nodes' last states, every `pg_autoctl` log (with its PostgreSQL's
    /// messages), pg_autoctl's configuration and state files and each
    /// server's settings files, and the servers' own logs (`pglog/`, a file
    /// per postmaster start): they then log every statement with its
    /// duration (`log_min_duration_statement = 0`), connections and
    /// replication commands, with the application name and transaction id
    /// in each line's prefix (a commit's wait for the synchronous standby
    /// shows in its duration, a released wait as PostgreSQL's warning).
    pub fn keep_in(mut self, dir: impl Into<PathBuf>) -> AutoFailoverOptions {
        self.keep = Some(dir.into());
        self
    }
}

/// The servers' logging when the evidence is kept
/// ([`AutoFailoverOptions::keep_in`]).
const KEEP_LOGGING: &str = "
# --- pgelect-testkit: evidence kept (AutoFailoverOptions::keep_in) ---
log_min_duration_statement = 0
log_connections = on
log_disconnections = on
log_replication_commands = on
log_line_prefix = '%m [%p] %q%u@%d %a x%x '
";

/// Whether a formation can be started here: `pg_autoctl` is found and the
/// `pgautofailover` extension is installed for a PostgreSQL whose server
/// binaries are present. `Err` says what is missing (`scripts/setup.sh`
/// installs it).
pub fn autofailover_available() -> io::Result<()> {
    let _ = pg_autoctl()?;
    let _ = bin_dir()?;
    Ok(())
}

/// `pg_autoctl`: `PGELECT_PG_AUTOCTL`, else on `PATH`, else `/usr/bin`.
fn pg_autoctl() -> io::Result<PathBuf> {
    if let Some(p) = std::env::var_os("PGELECT_PG_AUTOCTL").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join("pg_autoctl"))
        .find(|p| p.is_file());
    on_path.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "pg_autoctl not found: run scripts/setup.sh (Debian's pg-auto-failover-cli and \
             postgresql-<version>-auto-failover) or set PGELECT_PG_AUTOCTL",
        )
    })
}

/// The major version of the server binaries in `bin`.
fn major_of(bin: &Path) -> Option<String> {
    let out = Command::new(bin.join("postgres"))
        .arg("-V")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.split_whitespace().nth(2)?;
    Some(version.split('.').next()?.to_owned())
}

/// Server binaries with the `pgautofailover` extension: the kit's usual
/// ones ([`pg_bin_dir`]) when their version has it, else a Debian
/// installation's that has it.
fn bin_dir() -> io::Result<PathBuf> {
    let has_extension = |major: &str| {
        Path::new("/usr/share/postgresql")
            .join(major)
            .join("extension/pgautofailover.control")
            .is_file()
    };
    if let Ok(bin) = pg_bin_dir() {
        if major_of(&bin).is_some_and(|m| has_extension(&m)) {
            return Ok(bin);
        }
    }
    let mut found: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let major: u32 = name.parse().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").is_file() && has_extension(&name)).then_some((major, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no PostgreSQL with the pgautofailover extension: run scripts/setup.sh \
             (Debian's postgresql-<version>-auto-failover)",
        )
    })
}

/// Kills process groups when the test process ends, however it ends (as
/// the kit's other servers' reaper does for one server): a `sh` reading
/// `+PGID` / `-PGID` lines on a pipe only this process holds; when the
/// pipe closes it sends `SIGQUIT` to every group still listed (immediate
/// stop of `pg_autoctl` and of its PostgreSQL), `SIGKILL` 3 s later, and
/// removes the formation's directory.
const GROUP_REAPER_SCRIPT: &str = r#"
trap '' INT TERM HUP PIPE
groups=" "
while read -r line; do
  case "$line" in
    +*) groups="$groups${line#+} " ;;
    -*) groups=$(echo "$groups" | sed "s/ ${line#-} / /") ;;
  esac
done
for g in $groups; do kill -QUIT -"$g" 2>/dev/null; done
i=0
while [ $i -lt 60 ]; do
  alive=0
  for g in $groups; do kill -0 -"$g" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break
  sleep 0.05; i=$((i+1))
done
for g in $groups; do kill -9 -"$g" 2>/dev/null; done
sleep 0.2
rm -rf -- "$1"
"#;

struct GroupReaper {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl GroupReaper {
    fn spawn(dir: &Path) -> io::Result<GroupReaper> {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(GROUP_REAPER_SCRIPT)
            .arg("pgelect-testkit-reaper")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .current_dir("/")
            .process_group(0)
            .spawn()
            .map_err(|e| ctx(e, "spawn the cleanup process (/bin/sh)"))?;
        let stdin = child.stdin.take();
        Ok(GroupReaper { child, stdin })
    }

    fn line(&mut self, line: String) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{line}");
            let _ = stdin.flush();
        }
    }

    fn watch(&mut self, group: u32) {
        self.line(format!("+{group}"));
    }

    fn forget(&mut self, group: u32) {
        self.line(format!("-{group}"));
    }

    fn finish(mut self, timeout: Duration) {
        drop(self.stdin.take());
        wait_or_kill(&mut self.child, timeout);
    }
}

/// Sends `signal` (a name: `KILL`, `QUIT`) to the process group `group`,
/// with kill(1) (the workspace allows no `unsafe` for kill(2)).
fn kill_group(group: u32, signal: &str) {
    let _ = send_signal(&format!("-{group}"), signal);
}

/// `kill -s SIGNAL -- TARGET`; true when it was delivered.
fn send_signal(target: &str, signal: &str) -> bool {
    Command::new("kill")
        .args(["-s", signal, "--", target])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `pid` is a live process (not a zombie).
fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z')
    })
}

/// One `pg_autoctl run` (a monitor's or a keeper's), in its own process
/// group with the PostgreSQL it starts.
struct Service {
    pgdata: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A pg_auto_failover formation on loopback: a monitor and two (or three)
/// data nodes, each a `pg_autoctl` service with its PostgreSQL, run as the
/// kit's unprivileged server user (see the crate docs, "Running as root")
/// in one temporary directory.
///
/// Every setting `pg_autoctl` would choose for a production host is set
/// for a test machine: listening on `127.0.0.1` only, the Unix socket in
/// the formation's private directory, `shared_buffers = 16MB` (pg_autoctl
/// would size it from the machine's memory), `fsync = off`, its
/// configuration and state files (`XDG_*`) in the directory, no TLS
/// (`--no-ssl`, loopback only), the monitor's failure detection lowered
/// ([`AutoFailoverOptions::fast_detection`]). Authentication: the kit's
/// superuser [`SUPERUSER`] with [`TEST_PASSWORD`] (SCRAM) for tests;
/// pg_auto_failover's own users trusted from `127.0.0.1` (see the
/// `pg_hba.conf` in the source). Replication is synchronous (the
/// formation's default with one standby: `ANY 1 (...)`).
///
/// Faults go through the manager's own commands:
/// [`perform_switchover`](Self::perform_switchover),
/// [`perform_failover`](Self::perform_failover); or kill what it manages:
/// [`kill_postmaster`](Self::kill_postmaster) (the keeper restarts it in
/// place), [`kill_node`](Self::kill_node) (keeper and PostgreSQL: the
/// monitor fails over), [`restart_node`](Self::restart_node).
///
/// Dropping the formation stops every process and removes the directory;
/// if the test process dies first (panic, abort, `SIGKILL`), a reaper
/// process does the same.
///
/// Cost: about 5-10 s to start on an idle machine (two `initdb`-template
/// copies, a base backup, registrations).
pub struct AutoFailover {
    dir: PathBuf,
    bin: PathBuf,
    autoctl: PathBuf,
    monitor_port: u16,
    ports: Vec<u16>,
    monitor: Mutex<Service>,
    nodes: Vec<Mutex<Service>>,
    reaper: Mutex<Option<GroupReaper>>,
    keep: Option<PathBuf>,
}

impl std::fmt::Debug for AutoFailover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AutoFailover")
            .field("dir", &self.dir)
            .field("monitor_port", &self.monitor_port)
            .field("ports", &self.ports)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AutoFailover {
    /// Starts a formation of two data nodes with fast failure detection
    /// and waits until node 0 is primary and node 1 a synchronous
    /// secondary.
    pub fn start() -> io::Result<AutoFailover> {
        AutoFailover::start_with(AutoFailoverOptions::new())
    }

    /// Starts a formation as `options` says; see [`AutoFailover::start`].
    pub fn start_with(options: AutoFailoverOptions) -> io::Result<AutoFailover> {
        if !(2..=3).contains(&options.nodes) {
            return Err(err(format!(
                "a formation has 2 or 3 data nodes, not {}",
                options.nodes
            )));
        }
        if options.number_sync_standbys > 0 && options.number_sync_standbys + 2 > options.nodes {
            return Err(err(format!(
                "number_sync_standbys {} needs at least {} data nodes, not {}",
                options.number_sync_standbys,
                options.number_sync_standbys + 2,
                options.nodes
            )));
        }
        let autoctl = pg_autoctl()?;
        let bin = bin_dir()?;
        let dir = make_temp_dir("haf")?;
        let reaper = GroupReaper::spawn(&dir)?;
        for sub in ["config", "share", "run"] {
            let d = dir.join(sub);
            fs::create_dir(&d).map_err(|e| ctx(e, format!("create {}", d.display())))?;
            chown_to_server(&d)?;
        }
        let monitor_port = free_port();
        let ports: Vec<u16> = (0..options.nodes).map(|_| free_port()).collect();
        let formation = AutoFailover {
            monitor: Mutex::new(Service {
                pgdata: dir.join("monitor"),
                log: dir.join("monitor.log"),
                child: None,
            }),
            nodes: (0..options.nodes)
                .map(|i| {
                    Mutex::new(Service {
                        pgdata: dir.join(format!("node{}", i + 1)),
                        log: dir.join(format!("node{}.log", i + 1)),
                        child: None,
                    })
                })
                .collect(),
            dir,
            bin,
            autoctl,
            monitor_port,
            ports,
            reaper: Mutex::new(Some(reaper)),
            keep: options.keep.clone(),
        };
        formation.set_up(&options)?;
        Ok(formation)
    }

    fn set_up(&self, options: &AutoFailoverOptions) -> io::Result<()> {
        let started = Instant::now();
        // The monitor, from a copy of the kit's initdb template.
        let monitor_pgdata = lock(&self.monitor).pgdata.clone();
        self.copy_template(&monitor_pgdata)?;
        self.run_autoctl(
            &[
                "create",
                "monitor",
                "--pgport",
                &self.monitor_port.to_string(),
                "--hostname",
                HOST,
                "--no-ssl",
                "--skip-pg-hba",
            ],
            &monitor_pgdata,
            &self.dir.join("monitor.log"),
            "pg_autoctl create monitor",
        )?;
        if options.fast_detection {
            append(&monitor_pgdata.join("postgresql.conf"), MONITOR_SETTINGS)?;
        }
        self.run_autoctl(
            &["config", "set", "postgresql.listen_addresses", HOST],
            &monitor_pgdata,
            &self.dir.join("monitor.log"),
            "pg_autoctl config set (monitor)",
        )?;
        self.spawn_service(&self.monitor)?;
        // The first node is primary: from the template too; the others
        // are base backups of it, made by pg_autoctl.
        for i in 0..self.nodes.len() {
            let pgdata = lock(&self.nodes[i]).pgdata.clone();
            if i == 0 {
                self.copy_template(&pgdata)?;
            }
            let log = lock(&self.nodes[i]).log.clone();
            let name = format!("node{}", i + 1);
            self.run_autoctl(
                &[
                    "create",
                    "postgres",
                    "--pgport",
                    &self.ports[i].to_string(),
                    "--hostname",
                    HOST,
                    "--listen",
                    HOST,
                    "--name",
                    &name,
                    "--username",
                    SUPERUSER,
                    "--dbname",
                    "postgres",
                    "--no-ssl",
                    "--skip-pg-hba",
                    "--monitor",
                    &self.monitor_uri(),
                ],
                &pgdata,
                &log,
                &format!("pg_autoctl create postgres ({name})"),
            )?;
            if options.fast_detection {
                for (key, value) in KEEPER_SETTINGS {
                    self.run_autoctl(
                        &["config", "set", key, value],
                        &pgdata,
                        &log,
                        &format!("pg_autoctl config set {key} ({name})"),
                    )?;
                }
            }
            self.spawn_service(&self.nodes[i])?;
            // Alone, the first node is `single`; with standbys, `primary`.
            let want = i + 1;
            let first = if i == 0 { "single" } else { "primary" };
            self.wait_for(
                &format!("{name} to join the formation"),
                START_TIMEOUT.saturating_sub(started.elapsed()),
                |s| {
                    s.len() == want && s.iter().all(NodeState::is_settled) && s[0].reported == first
                },
            )?;
        }
        if options.number_sync_standbys > 0 {
            // The monitor's function that `pg_autoctl set formation
            // number-sync-standbys` calls: that command (2.0) tests a
            // stale `errno` after parsing its argument and can refuse a
            // valid number.
            let config = self.monitor_config("pg_auto_failover");
            let sql = format!(
                "SELECT pgautofailover.set_formation_number_sync_standbys('default', {})",
                options.number_sync_standbys
            );
            block_on_fresh_runtime(Duration::from_secs(60), move || async move {
                util::simple_rows(config, &sql).await.map(|_| ())
            })
            .map_err(|e| ctx(e, "set the formation's number_sync_standbys"))?;
            // Stable again (the primary may go through `apply_settings`).
            self.wait_for(
                "a stable formation after setting number_sync_standbys",
                START_TIMEOUT.saturating_sub(started.elapsed()),
                NodeState::stable,
            )?;
        }
        if std::env::var_os("PGELECT_TESTKIT_DEBUG").is_some() {
            eprintln!(
                "pgelect-testkit: pg_auto_failover formation ready in {:?}",
                started.elapsed()
            );
        }
        Ok(())
    }

    /// Copies the kit's initdb template to `pgdata` and writes the
    /// formation's `pg_hba.conf` and settings into it.
    fn copy_template(&self, pgdata: &Path) -> io::Result<()> {
        let template = template(&self.bin)?;
        let mut cp = Command::new("cp");
        cp.arg("-a").arg(template.join("data")).arg(pgdata);
        util::run_logged(
            cp,
            &self.dir.join("cp.log"),
            Duration::from_secs(60),
            "cp -a",
        )?;
        write_private(&pgdata.join("pg_hba.conf"), PG_HBA)?;
        // After pg_autoctl's `include` (the first line, written by
        // `create`): these win over its production sizing.
        let settings = format!(
            "
# --- pgelect-testkit (pg_auto_failover formation) ---
listen_addresses = '127.0.0.1'
unix_socket_directories = '{}'
unix_socket_permissions = 0700
fsync = off
max_connections = 200
shared_buffers = 16MB
work_mem = 4MB
maintenance_work_mem = 16MB
effective_cache_size = 128MB
logging_collector = off
log_line_prefix = '%m [%p] %q%u@%d '
",
            self.dir.display()
        );
        append(&pgdata.join("postgresql.conf"), &settings)?;
        if self.keep.is_some() {
            // Out of the data directories, which pg_rewind overwrites with
            // the source's files (and pg_autoctl's startup.log is
            // truncated at each start): one file per postmaster start, its
            // first lines name the port.
            let logs = self.dir.join("pglog");
            if !logs.exists() {
                fs::create_dir(&logs).map_err(|e| ctx(e, format!("create {}", logs.display())))?;
                chown_to_server(&logs)?;
            }
            append(
                &pgdata.join("postgresql.conf"),
                &format!(
                    "{KEEP_LOGGING}logging_collector = on\nlog_directory = '{}'\n\
                     log_filename = 'postgresql-%Y%m%d-%H%M%S.log'\n\
                     log_rotation_age = 0\nlog_rotation_size = 0\n",
                    logs.display()
                ),
            )?;
        }
        Ok(())
    }

    /// The environment every `pg_autoctl` runs with: its configuration,
    /// state and runtime files in the formation's directory; the socket
    /// directory as `PGHOST`; nothing inherited from the test's `PG*`.
    fn autoctl_command(&self, args: &[&str], pgdata: &Path) -> Command {
        let mut cmd = Command::new(&self.autoctl);
        cmd.args(args)
            .arg("--pgdata")
            .arg(pgdata)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &self.dir)
            .env("XDG_CONFIG_HOME", self.dir.join("config"))
            .env("XDG_DATA_HOME", self.dir.join("share"))
            .env("XDG_RUNTIME_DIR", self.dir.join("run"))
            .env("PGHOST", &self.dir)
            .env("LANG", "C")
            .current_dir(&self.dir)
            .stdin(Stdio::null());
        if args.first() == Some(&"create") {
            cmd.arg("--pgctl").arg(self.bin.join("pg_ctl"));
        }
        as_server_user(&mut cmd);
        cmd
    }

    /// Runs a `pg_autoctl` command to completion in a process group the
    /// reaper knows (a `create` starts and stops a PostgreSQL).
    fn run_autoctl(&self, args: &[&str], pgdata: &Path, log: &Path, what: &str) -> io::Result<()> {
        let (out, from) = open_log(log)?;
        let mut cmd = self.autoctl_command(args, pgdata);
        cmd.stdout(out.try_clone()?).stderr(out).process_group(0);
        let mut child = cmd.spawn().map_err(|e| ctx(e, format!("spawn {what}")))?;
        let group = child.id();
        self.reaper_do(|r| r.watch(group));
        let status = wait_timeout(&mut child, COMMAND_TIMEOUT);
        let result = match status {
            Ok(Some(s)) if s.success() => Ok(()),
            Ok(Some(s)) => Err(err(format!(
                "{what} failed ({s}); {}",
                util::log_tail(log, from, 25)
            ))),
            Ok(None) => {
                kill_group(group, "KILL");
                let _ = wait_timeout(&mut child, Duration::from_secs(5));
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{what} did not finish within {COMMAND_TIMEOUT:?}; {}",
                        util::log_tail(log, from, 25)
                    ),
                ))
            }
            Err(e) => Err(e),
        };
        self.reaper_do(|r| r.forget(group));
        result
    }

    /// Runs a `pg_autoctl` command against the monitor and returns its
    /// standard output.
    fn monitor_command(&self, args: &[&str], what: &str) -> io::Result<String> {
        let pgdata = lock(&self.monitor).pgdata.clone();
        let mut cmd = self.autoctl_command(args, &pgdata);
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| ctx(e, format!("spawn {what}")))?;
        // Read both pipes on threads so that a chatty command cannot fill
        // one and block.
        let mut stdout = child.stdout.take().expect("piped");
        let mut stderr = child.stderr.take().expect("piped");
        let out = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = io::Read::read_to_string(&mut stdout, &mut s);
            s
        });
        let errs = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = io::Read::read_to_string(&mut stderr, &mut s);
            s
        });
        let status = wait_timeout(&mut child, COMMAND_TIMEOUT)?;
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let out = out.join().unwrap_or_default();
        let errs = errs.join().unwrap_or_default();
        match status {
            Some(s) if s.success() => Ok(out),
            Some(s) => Err(err(format!("{what} failed ({s}): {}", tail(&errs, 15)))),
            None => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{what} did not finish within {COMMAND_TIMEOUT:?}: {}",
                    tail(&errs, 15)
                ),
            )),
        }
    }

    /// Starts `pg_autoctl run` for a service, in a process group of its
    /// own (its PostgreSQL joins it), known to the reaper.
    fn spawn_service(&self, service: &Mutex<Service>) -> io::Result<()> {
        let mut s = lock(service);
        if let Some(mut old) = s.child.take() {
            kill_group(old.id(), "KILL");
            let _ = wait_timeout(&mut old, Duration::from_secs(5));
            self.reaper_do(|r| r.forget(old.id()));
        }
        let (out, _) = open_log(&s.log)?;
        let mut cmd = self.autoctl_command(&["run"], &s.pgdata);
        cmd.stdout(out.try_clone()?).stderr(out).process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| ctx(e, format!("spawn pg_autoctl run ({})", s.pgdata.display())))?;
        let group = child.id();
        self.reaper_do(|r| r.watch(group));
        s.child = Some(child);
        Ok(())
    }

    fn reaper_do(&self, f: impl FnOnce(&mut GroupReaper)) {
        if let Some(r) = lock(&self.reaper).as_mut() {
            f(r);
        }
    }

    /// The monitor's URI for the keepers.
    fn monitor_uri(&self) -> String {
        format!(
            "postgres://autoctl_node@{HOST}:{}/pg_auto_failover?sslmode=disable",
            self.monitor_port
        )
    }

    /// The data nodes' ports, by [`NodeIndex`].
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// The monitor's port.
    pub fn monitor_port(&self) -> u16 {
        self.monitor_port
    }

    /// The formation's directory (data directories, logs, pg_autoctl's
    /// files, the Unix socket).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The log of a data node's `pg_autoctl` (with its PostgreSQL's
    /// messages), for a failing test to print.
    pub fn node_log(&self, node: NodeIndex) -> PathBuf {
        lock(&self.nodes[node]).log.clone()
    }

    /// The multi-host URL of `database` as the kit's superuser, every data
    /// node in index order, with `target_session_attrs=read-write`: what an
    /// application uses to follow the primary.
    pub fn url(&self, database: &str) -> String {
        self.url_with(database, "target_session_attrs=read-write")
    }

    /// [`AutoFailover::url`] with other query parameters (`params`, without
    /// the `?`).
    pub fn url_with(&self, database: &str, params: &str) -> String {
        let hosts: Vec<String> = self.ports.iter().map(|p| format!("{HOST}:{p}")).collect();
        format!(
            "postgres://{SUPERUSER}:{}@{}/{}?{params}",
            percent_encode(TEST_PASSWORD),
            hosts.join(","),
            percent_encode(database)
        )
    }

    /// The URL of `database` on one data node only.
    pub fn node_url(&self, node: NodeIndex, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{}@{HOST}:{}/{}",
            percent_encode(TEST_PASSWORD),
            self.ports[node],
            percent_encode(database)
        )
    }

    /// A driver configuration for `database` on one data node.
    pub fn node_config(&self, node: NodeIndex, database: &str) -> tokio_postgres::Config {
        let mut c = tokio_postgres::Config::new();
        c.host(HOST)
            .port(self.ports[node])
            .user(SUPERUSER)
            .password(TEST_PASSWORD)
            .dbname(database)
            .connect_timeout(Duration::from_secs(5));
        c
    }

    /// A driver configuration for `database` on the monitor (its events are
    /// in `pgautofailover.event` of `pg_auto_failover`), as the kit's
    /// superuser.
    pub fn monitor_config(&self, database: &str) -> tokio_postgres::Config {
        let mut c = tokio_postgres::Config::new();
        c.host(HOST)
            .port(self.monitor_port)
            .user(SUPERUSER)
            .password(TEST_PASSWORD)
            .dbname(database)
            .connect_timeout(Duration::from_secs(5));
        c
    }

    /// Creates `database` on the current primary (the standbys get it by
    /// replication).
    pub fn create_database(&self, database: &str) -> io::Result<()> {
        let primary = self.primary()?;
        let config = self.node_config(primary, "postgres");
        let sql = format!("CREATE DATABASE {}", util::quote_ident(database));
        block_on_fresh_runtime(Duration::from_secs(60), move || async move {
            util::simple_rows(config, &sql).await.map(|_| ())
        })
    }

    /// The data nodes as the monitor sees them (`pg_autoctl show state
    /// --json`), by [`NodeIndex`].
    pub fn state(&self) -> io::Result<Vec<NodeState>> {
        let out = self.monitor_command(&["show", "state", "--json"], "pg_autoctl show state")?;
        parse_state(&out, &self.ports)
    }

    /// Polls [`state`](Self::state) every 100 ms until `done` holds and
    /// returns that state; `Err(TimedOut)` after `timeout`, naming `what`
    /// and the last state.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&[NodeState]) -> bool,
    ) -> io::Result<Vec<NodeState>> {
        let deadline = Instant::now() + timeout;
        let mut last;
        loop {
            match self.state() {
                Ok(s) if done(&s) => return Ok(s),
                Ok(s) => last = format!("{s:?}"),
                Err(e) => last = e.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "timed out after {timeout:?} waiting for {what}; last state: {last}; {}",
                        util::log_tail(&self.dir.join("monitor.log"), 0, 10)
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until one node is primary and every other one a settled
    /// secondary; returns the primary.
    pub fn wait_stable(&self, timeout: Duration) -> io::Result<NodeIndex> {
        let s = self.wait_for(
            "one primary and settled secondaries",
            timeout,
            NodeState::stable,
        )?;
        Ok(s.iter().position(NodeState::is_primary).expect("checked"))
    }

    /// The node the monitor has as primary now ([`NodeState::accepts_writes`]).
    pub fn primary(&self) -> io::Result<NodeIndex> {
        let s = self.state()?;
        s.iter()
            .position(NodeState::accepts_writes)
            .ok_or_else(|| err(format!("no primary in {s:?}")))
    }

    /// `pg_autoctl perform switchover`: the monitor demotes the primary
    /// and promotes a standby; returns when the manager reports it done.
    pub fn perform_switchover(&self) -> io::Result<()> {
        self.monitor_command(&["perform", "switchover"], "pg_autoctl perform switchover")
            .map(|_| ())
    }

    /// `pg_autoctl perform failover`: as a switchover, ordered as a
    /// failover; returns when the manager reports it done.
    pub fn perform_failover(&self) -> io::Result<()> {
        self.monitor_command(&["perform", "failover"], "pg_autoctl perform failover")
            .map(|_| ())
    }

    /// `SIGKILL`s a data node's postmaster (its keeper restarts it in
    /// place); returns the killed pid.
    pub fn kill_postmaster(&self, node: NodeIndex) -> io::Result<u32> {
        let pgdata = lock(&self.nodes[node]).pgdata.clone();
        let pidfile = pgdata.join("postmaster.pid");
        let text = fs::read_to_string(&pidfile)
            .map_err(|e| ctx(e, format!("read {}", pidfile.display())))?;
        let pid: u32 = text
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| err(format!("no pid in {}", pidfile.display())))?;
        if !send_signal(&pid.to_string(), "KILL") {
            return Err(err(format!("kill -KILL {pid} failed")));
        }
        Ok(pid)
    }

    /// `SIGKILL`s a data node's keeper and PostgreSQL at once (its whole
    /// process group), as a machine that dies: the monitor fails over.
    pub fn kill_node(&self, node: NodeIndex) -> io::Result<()> {
        let mut s = lock(&self.nodes[node]);
        let Some(mut child) = s.child.take() else {
            return Err(err(format!("node {node} is not running")));
        };
        let group = child.id();
        kill_group(group, "KILL");
        let _ = wait_timeout(&mut child, Duration::from_secs(10));
        // Backends exit on their postmaster's death; the group is empty
        // once the postmaster has gone.
        let pidfile = s.pgdata.join("postmaster.pid");
        if let Some(pid) = fs::read_to_string(&pidfile)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()))
        {
            let deadline = Instant::now() + Duration::from_secs(10);
            while alive(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.reaper_do(|r| r.forget(group));
        Ok(())
    }

    /// Starts a killed node's keeper again: it rejoins as a secondary
    /// (after `pg_rewind` when needed).
    pub fn restart_node(&self, node: NodeIndex) -> io::Result<()> {
        self.spawn_service(&self.nodes[node])
    }

    /// Stops every service and removes the directory (also done on drop).
    pub fn stop(self) {
        drop(self);
    }

    /// Saves the evidence [`AutoFailoverOptions::keep_in`] asks for: what
    /// the monitor says first (it is still running), the files once every
    /// service has stopped ([`copy_kept`](Self::copy_kept)).
    fn save_monitor_view(&self, keep: &Path) -> io::Result<()> {
        fs::create_dir_all(keep).map_err(|e| ctx(e, format!("create {}", keep.display())))?;
        for (args, file) in [
            (&["show", "events", "--count", "100000"][..], "events.txt"),
            (
                &["show", "events", "--count", "100000", "--json"][..],
                "events.json",
            ),
            (&["show", "state"][..], "state.txt"),
            (&["show", "settings"][..], "settings.txt"),
        ] {
            let text = self
                .monitor_command(args, &format!("pg_autoctl {}", args.join(" ")))
                .unwrap_or_else(|e| format!("(failed: {e})\n"));
            fs::write(keep.join(file), text)
                .map_err(|e| ctx(e, format!("write {}", keep.join(file).display())))?;
        }
        Ok(())
    }

    /// Copies the logs, pg_autoctl's files and each server's settings into
    /// `keep` (the data directories themselves are left out).
    fn copy_kept(&self, keep: &Path) -> io::Result<()> {
        let mut cp = Command::new("cp");
        cp.arg("-a");
        for entry in fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            if name.as_deref().is_some_and(|n| n.ends_with(".log")) {
                cp.arg(&path);
            }
        }
        cp.arg(self.dir.join("config"))
            .arg(self.dir.join("share"))
            .arg(self.dir.join("pglog"))
            .arg(keep);
        util::run_logged(cp, &keep.join("cp.log"), Duration::from_secs(60), "cp -a")?;
        let services: Vec<PathBuf> = self
            .nodes
            .iter()
            .chain(std::iter::once(&self.monitor))
            .map(|s| lock(s).pgdata.clone())
            .collect();
        for pgdata in services {
            let name = pgdata
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let to = keep.join(format!("{name}-conf"));
            fs::create_dir_all(&to)?;
            for f in [
                "postgresql.conf",
                "postgresql-auto-failover.conf",
                "postgresql-auto-failover-standby.conf",
                "postgresql.auto.conf",
                "pg_hba.conf",
                "current_logfiles",
            ] {
                if pgdata.join(f).is_file() {
                    let _ = fs::copy(pgdata.join(f), to.join(f));
                }
            }
        }
        Ok(())
    }

    fn shutdown(&mut self) {
        if let Some(keep) = self.keep.clone() {
            if let Err(e) = self.save_monitor_view(&keep) {
                eprintln!("pgelect-testkit: cannot keep the formation's evidence: {e}");
            }
        }
        let services: Vec<&Mutex<Service>> = self
            .nodes
            .iter()
            .chain(std::iter::once(&self.monitor))
            .collect();
        let mut children: Vec<Child> = services
            .iter()
            .filter_map(|s| lock(s).child.take())
            .collect();
        // An immediate stop of each keeper and its PostgreSQL: nothing
        // here needs a clean shutdown.
        for c in &children {
            kill_group(c.id(), "QUIT");
        }
        for c in &mut children {
            if !matches!(wait_timeout(c, Duration::from_secs(5)), Ok(Some(_))) {
                kill_group(c.id(), "KILL");
                let _ = wait_timeout(c, Duration::from_secs(5));
            }
        }
        if let Some(keep) = self.keep.clone() {
            match self.copy_kept(&keep) {
                Ok(()) => eprintln!(
                    "pgelect-testkit: the formation's logs and events are kept in {}",
                    keep.display()
                ),
                Err(e) => eprintln!("pgelect-testkit: cannot keep the formation's files: {e}"),
            }
        }
        if let Some(r) = lock(&self.reaper).take() {
            r.finish(Duration::from_secs(30));
        }
        if self.dir.exists() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

impl Drop for AutoFailover {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn append(path: &Path, text: &str) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|e| ctx(e, format!("open {}", path.display())))?;
    f.write_all(text.as_bytes())
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Parses `pg_autoctl show state --json` into nodes ordered by `ports`
/// (nodes on other ports are left out).
fn parse_state(json: &str, ports: &[u16]) -> io::Result<Vec<NodeState>> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| {
        err(format!(
            "pg_autoctl show state --json: {e}: {}",
            tail(json, 5)
        ))
    })?;
    let nodes = value
        .as_array()
        .ok_or_else(|| err("pg_autoctl show state --json: not an array"))?;
    let mut out = Vec::new();
    for n in nodes {
        let port = n["nodeport"].as_u64().unwrap_or(0);
        let Some(index) = ports.iter().position(|p| u64::from(*p) == port) else {
            continue;
        };
        let text = |k: &str| n[k].as_str().unwrap_or("").to_owned();
        out.push(NodeState {
            index,
            name: text("nodename"),
            port: ports[index],
            reported: text("current_group_state"),
            assigned: text("assigned_group_state"),
            healthy: n["health"].as_i64() == Some(1),
        });
    }
    out.sort_by_key(|n| n.index);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pg_auto_failover accepts `number_sync_standbys` 1 only with two
    /// standbys: the kit says so before it starts anything.
    #[test]
    fn a_synchronous_standby_count_the_formation_cannot_hold_is_refused_before_anything_starts() {
        let Err(e) = AutoFailover::start_with(AutoFailoverOptions::new().number_sync_standbys(1))
        else {
            panic!("two data nodes cannot keep number_sync_standbys 1");
        };
        assert!(
            e.to_string().contains("needs at least 3 data nodes, not 2"),
            "{e}"
        );
    }

    #[test]
    fn parses_show_state() {
        let json = r#"[
            {"health": 1, "node_id": 1, "nodename": "node1", "nodeport": 41001,
             "current_group_state": "primary", "assigned_group_state": "primary"},
            {"health": 0, "node_id": 2, "nodename": "node2", "nodeport": 41002,
             "current_group_state": "secondary", "assigned_group_state": "catchingup"}
        ]"#;
        let s = parse_state(json, &[41002, 41001]).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].index, s[0].name.as_str()), (0, "node2"));
        assert!(!s[0].healthy && !s[0].is_settled() && !s[0].is_primary());
        assert!(s[1].healthy && s[1].is_primary());
        assert!(parse_state("not json", &[1]).is_err());
    }
}
