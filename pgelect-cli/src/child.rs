//! The supervised command, run under a watcher process.
//!
//! ```text
//! pgelect (supervisor, child subreaper)
//!   └─ pgelect __pgelect-watch (watcher: child subreaper, own process group)
//!        └─ the command (its own process group, PR_SET_PDEATHSIG = SIGKILL)
//!             └─ whatever it starts, `setsid` daemons included
//! ```
//!
//! The watcher is the command's parent and a *child subreaper*
//! (`PR_SET_CHILD_SUBREAPER`): anything the command starts that is orphaned,
//! even after leaving the process group and the session with `setsid`, is
//! re-parented to the watcher rather than to init, so the watcher can always
//! find every descendant by walking the parent links in `/proc`. It kills
//! all of them when
//!
//! * the command exits (leftovers must not outlive the lock or the
//!   leadership the supervisor is about to release),
//! * the supervisor asks (SIGUSR1: an unexpected loss, a grace period over),
//! * the supervisor dies, even by SIGKILL (the watcher's own
//!   `PR_SET_PDEATHSIG` is SIGUSR1).
//!
//! SIGTERM, SIGINT and SIGHUP sent to the watcher are forwarded to the
//! command's process group (a graceful stop). The watcher exits with the
//! command's code, or 128 + the signal that killed it, as shells report it.
//!
//! If the watcher itself dies (only SIGKILL can do that: it handles or blocks
//! everything else), the command dies with it (its death signal) and the
//! supervisor notices: the watcher's status is a signal, not a code. The
//! supervisor logs a warning and kills what the command left, which was
//! re-parented to the supervisor because it is a child subreaper as well.
//! It does not restart a watcher for a command that is already dead; the
//! command's exit is handled like any other exit of the command
//! (`--on-exit`). A command is never left running unwatched: only a watcher
//! guarantees that nothing of it outlives a SIGKILLed supervisor.
//!
//! A standby starts its watcher ahead of time ([`arm`]): the watcher sets
//! itself up and waits, reading a pipe, for the few variables only known at
//! election (`PGELECT_TERM`); at election the supervisor writes them and
//! closes the pipe, and the watcher starts the command at once. That takes
//! one process start (about 2 ms) off every handover. A pipe closed with
//! nothing written (the supervisor stopped standing, or died) ends the
//! watcher without starting anything.
//!
//! Signals and `prctl` go through `nix` (safe wrappers); the `unsafe`
//! left is `pre_exec` (the watcher's signal mask, the command's death
//! signal), whose closures std cannot check.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::ExitStatus;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::process::Command;

use crate::exit::{self, Failure};

/// Exit code for a command that could not be found or executed (as shells do).
pub const NOT_FOUND: u8 = 127;
/// Exit code for a command that was found but could not be executed.
pub const NOT_EXECUTABLE: u8 = 126;

/// The hidden first argument that makes `pgelect` the command's watcher:
/// `pgelect __pgelect-watch <supervisor pid> -- CMD ARGS…`.
pub const WATCH_ARG: &str = "__pgelect-watch";

/// Environment variables that carry database credentials or connection
/// settings (pgelect's own, and libpq's): the supervised command gets none
/// of them unless asked for with `--pass-database-env`.
pub const DATABASE_ENV: &[&str] = &[
    "DATABASE_URL",
    "PGELECT_DATABASE_URL_FILE",
    "PGELECT_LISTEN_URL",
    "PGELECT_LISTEN_URL_FILE",
    // libpq's environment variables (PostgreSQL manual, "Environment
    // Variables"), secrets or not: a command that should reach the
    // database gets them all or none.
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGDATABASE",
    "PGUSER",
    "PGPASSWORD",
    "PGPASSFILE",
    "PGREQUIREAUTH",
    "PGCHANNELBINDING",
    "PGSERVICE",
    "PGSERVICEFILE",
    "PGOPTIONS",
    "PGAPPNAME",
    "PGSSLMODE",
    "PGREQUIRESSL",
    "PGSSLNEGOTIATION",
    "PGSSLCOMPRESSION",
    "PGSSLCERT",
    "PGSSLKEY",
    "PGSSLCERTMODE",
    "PGSSLROOTCERT",
    "PGSSLCRL",
    "PGSSLCRLDIR",
    "PGSSLSNI",
    "PGREQUIREPEER",
    "PGSSLMINPROTOCOLVERSION",
    "PGSSLMAXPROTOCOLVERSION",
    "PGGSSENCMODE",
    "PGKRBSRVNAME",
    "PGGSSLIB",
    "PGGSSDELEGATION",
    "PGCONNECT_TIMEOUT",
    "PGCLIENTENCODING",
    "PGTARGETSESSIONATTRS",
    "PGLOADBALANCEHOSTS",
    "PGDATESTYLE",
    "PGTZ",
    "PGGEQO",
    "PGSYSCONFDIR",
    "PGLOCALEDIR",
];

/// What the supervised command is started with.
#[derive(Debug)]
pub struct Spec<'a> {
    /// The command and its arguments, byte for byte as given.
    pub argv: &'a [OsString],
    /// Variables added to its environment (`PGELECT_*`).
    pub env: &'a [(&'a str, String)],
    /// Keep [`DATABASE_ENV`] in its environment (`--pass-database-env`).
    pub pass_database_env: bool,
}

/// A running command, seen through its watcher.
#[derive(Debug)]
pub struct Child {
    watcher: tokio::process::Child,
    pid: u32,
    _live: Live,
}

/// The watchers of this process that have not been reaped, by pid: what
/// [`kill_orphans`] must leave alone (with everything below them) when
/// another watcher dies. `pgelect run --partitions` runs a command per
/// partition, each under a watcher of its own.
static LIVE_WATCHERS: std::sync::Mutex<std::collections::BTreeSet<i32>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A watcher's place in [`LIVE_WATCHERS`], from its start until its
/// handle is dropped (or its death is handled: [`Child::wait`]).
#[derive(Debug)]
struct Live(i32);

impl Live {
    fn new(pid: u32) -> Live {
        let pid = pid as i32;
        live_watchers().insert(pid);
        Live(pid)
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        live_watchers().remove(&self.0);
    }
}

fn live_watchers() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<i32>> {
    LIVE_WATCHERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The signals a watcher handles ([`watch_main`]): blocked in it from its
/// first instruction, set between fork and exec (a signal mask survives
/// exec), so that one sent while it starts stays pending until its loop
/// takes it, rather than killing it (a supervisor handing a partition
/// over may stop a command it started a moment ago).
fn watcher_signals() -> SigSet {
    let mut mask = SigSet::empty();
    for s in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGUSR1,
    ] {
        mask.add(s);
    }
    mask
}

/// Starts the command under a watcher (see the module docs).
///
/// The watcher's death signal fires when the *thread* that forked it exits:
/// call this from a thread that lives as long as the command should (tokio's
/// worker threads live as long as the runtime; never from `spawn_blocking`).
/// A command that cannot be executed shows as an exit with 127 or 126 and a
/// message on standard error, as in a shell.
pub fn spawn(spec: &Spec<'_>) -> Result<Child, Failure> {
    let (watcher, pid) = start_watcher(spec, &[])?;
    Ok(Child {
        watcher,
        pid,
        _live: Live::new(pid),
    })
}

/// A watcher started ahead of the command ([`arm`]), waiting for
/// [`Armed::start`]. Dropped unstarted, it exits without starting anything.
#[derive(Debug)]
pub struct Armed {
    watcher: tokio::process::Child,
    pid: u32,
    live: Live,
    /// The write end of the watcher's go pipe.
    go: std::fs::File,
}

/// Starts the command's watcher now, to start the command later
/// ([`Armed::start`]) with `spec`'s environment plus what `start` adds.
/// The same conditions as [`spawn`] apply (the thread, the watcher's
/// death signal).
pub fn arm(spec: &Spec<'_>) -> Result<Armed, Failure> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
    use std::os::fd::AsRawFd;
    let failure = |e: nix::Error| {
        Failure::new(
            exit::SOFTWARE,
            format!("cannot make the process watcher's pipe: {e}"),
        )
    };
    // Close-on-exec for both ends, then not for the read end alone: the
    // watcher inherits it, the command (started by the watcher, which
    // closes it) and anything else never see the write end.
    let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(failure)?;
    fcntl(&read, FcntlArg::F_SETFD(FdFlag::empty())).map_err(failure)?;
    let go_fd = read.as_raw_fd().to_string();
    let (watcher, pid) = start_watcher(spec, &["--go-fd", &go_fd])?;
    drop(read);
    Ok(Armed {
        watcher,
        pid,
        live: Live::new(pid),
        go: std::fs::File::from(write),
    })
}

impl Armed {
    /// Starts the command, with `env` added to the environment given to
    /// [`arm`]. Fails if the watcher is gone (then nothing was started):
    /// the caller may [`spawn`] instead.
    pub fn start(mut self, env: &[(&str, String)]) -> io::Result<Child> {
        use std::io::Write;
        let mut go = Vec::new();
        for (k, v) in env {
            go.extend_from_slice(k.as_bytes());
            go.push(b'=');
            go.extend_from_slice(v.as_bytes());
            go.push(0);
        }
        if go.is_empty() {
            go.push(0);
        }
        // Less than a pipe's atomic write: never blocks, never splits. A
        // watcher that has died leaves no reader: EPIPE (Rust ignores
        // SIGPIPE).
        self.go.write_all(&go)?;
        let Armed {
            watcher,
            pid,
            live,
            go,
        } = self;
        drop(go);
        Ok(Child {
            watcher,
            pid,
            _live: live,
        })
    }
}

/// Starts the watcher (`this binary`, [`WATCH_ARG`]) with `extra`
/// arguments before the command's.
fn start_watcher(spec: &Spec<'_>, extra: &[&str]) -> Result<(tokio::process::Child, u32), Failure> {
    if spec.argv.is_empty() {
        return Err(Failure::new(exit::USAGE, "no command given after `--`"));
    }
    become_subreaper();
    // `/proc/self/exe` is resolved in the forked child, so the watcher is
    // this very binary even if the file was replaced or deleted since.
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg0("pgelect")
        .arg(WATCH_ARG)
        .arg(std::process::id().to_string())
        .args(extra)
        .arg("--")
        .args(spec.argv)
        .process_group(0)
        .kill_on_drop(false);
    if !spec.pass_database_env {
        for var in DATABASE_ENV {
            cmd.env_remove(var);
        }
    }
    for (k, v) in spec.env {
        cmd.env(k, v);
    }
    block_in_watcher(&mut cmd);
    let watcher = cmd.spawn().map_err(|e| {
        Failure::new(
            exit::SOFTWARE,
            format!("cannot start the process watcher (this executable, from /proc/self/exe): {e}; the command was not started"),
        )
    })?;
    let pid = watcher.id().expect("BUG: a just-spawned child has a pid");
    Ok((watcher, pid))
}

/// Blocks [`watcher_signals`] in the watcher before it executes.
#[allow(unsafe_code)]
fn block_in_watcher(cmd: &mut Command) {
    let mask = watcher_signals();
    // SAFETY: the closure runs in the forked child before exec and makes
    // one async-signal-safe system call (sigprocmask); it allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || mask.thread_block().map_err(io::Error::from));
    }
}

/// Makes this process a child subreaper, once: descendants of a watcher
/// that dies are re-parented here and can still be killed.
fn become_subreaper() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
            tracing::warn!(error = %e, "cannot become a child subreaper; if the process watcher dies, what the command started in the background may survive");
        }
    });
}

impl Child {
    /// The watcher's process id.
    pub fn watcher_pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the command to exit; by then the watcher has killed
    /// everything the command left. If the watcher was killed instead, logs
    /// a warning and kills what it left (re-parented to this process).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        let status = self.watcher.wait().await?;
        if let Some(signal) = status.signal() {
            tracing::warn!(
                watcher = self.pid,
                signal,
                "the process watcher was killed; the command died with it, and what it left in the background is killed now"
            );
            live_watchers().remove(&(self.pid as i32));
            kill_orphans().await;
        }
        Ok(status)
    }

    /// Asks the command's process group to stop (SIGTERM, forwarded by the
    /// watcher).
    pub fn terminate(&self) {
        self.tell(Signal::SIGTERM);
    }

    /// Kills the command and every descendant at once (after an unexpected
    /// loss) and waits for the watcher to report.
    ///
    /// # Cancel safety
    /// Cancel safe: the kill is sent before the first await.
    pub async fn kill_now(&mut self) -> io::Result<ExitStatus> {
        self.tell(Signal::SIGUSR1);
        self.wait().await
    }

    /// SIGTERM to the group, then everything killed after `grace` if the
    /// command has not exited.
    ///
    /// # Cancel safety
    /// Not cancel safe: cancelled during the grace period, the command keeps
    /// running until the watcher is told otherwise.
    pub async fn stop(&mut self, grace: Duration) -> io::Result<ExitStatus> {
        if let Some(status) = self.watcher.try_wait()? {
            return Ok(status);
        }
        self.terminate();
        match tokio::time::timeout(grace, self.wait()).await {
            Ok(status) => status,
            Err(_) => {
                tracing::warn!(
                    pid = self.pid,
                    ?grace,
                    "the command ignored SIGTERM; killing it"
                );
                self.kill_now().await
            }
        }
    }

    /// Sends `signal` to the watcher, unless it has been reaped (its pid
    /// could belong to another process by then).
    fn tell(&self, signal: Signal) {
        if self.watcher.id().is_none() {
            return;
        }
        match kill(Pid::from_raw(self.pid as i32), signal) {
            Ok(()) => {}
            // Exited, not yet reaped: its status tells the rest.
            Err(Errno::ESRCH) => {}
            Err(e) => {
                tracing::error!(watcher = self.pid, %signal, error = %e, "cannot signal the process watcher; the command may keep running")
            }
        }
    }
}

/// Kills every descendant of this process but the live watchers and what
/// runs under them (the other partitions' commands), and reaps those
/// re-parented here, for at most a second.
async fn kill_orphans() {
    let me = std::process::id() as i32;
    for _ in 0..100 {
        let spared: Vec<i32> = live_watchers().iter().copied().collect();
        let victims = descendants_but(me, &spared);
        if victims.is_empty() {
            return;
        }
        for &(pid, parent) in &victims {
            signal_logged(Pid::from_raw(pid), Signal::SIGKILL);
            if parent == me {
                // Re-parented orphans are not tokio's; reap them here.
                let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::warn!("processes left by the command survived SIGKILL for 1s");
}

/// Live (not zombie) descendants of `root` as (pid, parent pid), from
/// `/proc/*/stat`.
fn descendants(root: i32) -> Vec<(i32, i32)> {
    descendants_but(root, &[])
}

/// [`descendants`], leaving out the processes `spared` and everything
/// below them.
fn descendants_but(root: i32, spared: &[i32]) -> Vec<(i32, i32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut procs = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // "pid (comm) S ppid …": comm may hold anything, so parse after the
        // last ')'.
        let mut rest = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .unwrap_or("")
            .split_whitespace();
        let state = rest.next().unwrap_or("");
        let Some(ppid) = rest.next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        procs.push((pid, ppid, state == "Z" || state == "X"));
    }
    let mut found = vec![root];
    let mut out = Vec::new();
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        for &(pid, ppid, dead) in &procs {
            if ppid == parent && !found.contains(&pid) && !spared.contains(&pid) {
                found.push(pid);
                if !dead {
                    out.push((pid, ppid));
                }
            }
        }
        i += 1;
    }
    out
}

/// Sends `signal`; a process already gone is fine, anything else is logged.
fn signal_logged(pid: Pid, signal: Signal) {
    match kill(pid, signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => eprintln!("pgelect: cannot send {signal} to process {pid}: {e}"),
    }
}

/// Sends `signal` (a libc number) to one process, if it still has a pid;
/// a failure other than "no such process" is logged.
pub fn signal_pid(pid: Option<u32>, signal: i32) {
    let (Some(pid), Ok(signal)) = (pid, Signal::try_from(signal)) else {
        return;
    };
    match kill(Pid::from_raw(pid as i32), signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => tracing::warn!(pid, %signal, error = %e, "cannot signal the process"),
    }
}

/// The shell convention for a command's exit status: its code, or 128 +
/// signal.
pub fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        _ => exit::SOFTWARE,
    }
}

/// The watcher's whole life (see the module docs). `args` follow
/// [`WATCH_ARG`]: the supervisor's pid, `--`, the command.
pub fn watch_main(args: &[OsString]) -> std::process::ExitCode {
    use std::process::ExitCode;
    // Block first: until the loop below waits for them, these signals must
    // stay pending rather than kill the watcher. The mask is inherited
    // across fork and exec: the command gets an empty one (`die_with_parent`).
    // (Blocked already by the supervisor, between fork and exec: see
    // `watcher_signals`. Again here for a watcher started otherwise.)
    let mask = watcher_signals();
    if let Err(e) = mask.thread_block() {
        eprintln!("pgelect: watcher: cannot block signals: {e}");
        return ExitCode::from(exit::SOFTWARE);
    }
    // `<supervisor pid> [--go-fd N] -- command…`
    let number = |a: Option<&OsString>| {
        a.and_then(|p| p.to_str())
            .and_then(|p| p.parse::<i32>().ok())
    };
    let parent = number(args.first());
    let (go_fd, rest) = match args.get(1) {
        Some(a) if a == "--go-fd" => (number(args.get(2)).map(Some), 3),
        _ => (Some(None), 1),
    };
    let (Some(parent), Some(go_fd), Some(command)) = (
        parent,
        go_fd,
        args.get(rest)
            .filter(|a| *a == "--")
            .and(args.get(rest + 1..)),
    ) else {
        eprintln!("pgelect: {WATCH_ARG} is internal to pgelect");
        return ExitCode::from(exit::USAGE);
    };
    let Some((program, rest)) = command.split_first() else {
        return ExitCode::from(exit::USAGE);
    };
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        eprintln!(
            "pgelect: watcher: cannot become a child subreaper: {e}; the command was not started"
        );
        return ExitCode::from(exit::SOFTWARE);
    }
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGUSR1) {
        eprintln!(
            "pgelect: watcher: cannot set a parent-death signal: {e}; the command was not started"
        );
        return ExitCode::from(exit::SOFTWARE);
    }
    // The supervisor may have died before the death signal was set.
    if nix::unistd::getppid().as_raw() != parent {
        return ExitCode::from(exit::SOFTWARE);
    }
    let command_pid = match go_fd {
        // Started ahead: the command's process is forked now and waits for
        // the go itself, then executes the command: at the go, one process
        // wakes and executes, no fork on the way.
        Some(fd) => match fork_ahead(fd, program, rest) {
            Ok(pid) => pid,
            Err(e) => {
                eprintln!(
                    "pgelect: watcher: cannot fork the command's process: {e}; the command was not started"
                );
                return ExitCode::from(exit::SOFTWARE);
            }
        },
        None => {
            let mut cmd = std::process::Command::new(program);
            cmd.args(rest).process_group(0);
            die_with_parent(&mut cmd);
            match cmd.spawn() {
                Ok(child) => Pid::from_raw(child.id() as i32),
                Err(e) => {
                    let (code, message) = spawn_failure(program, &e);
                    eprintln!("pgelect: {message}");
                    return ExitCode::from(code);
                }
            }
        }
    };
    let mut watch = Watch {
        command: command_pid,
        status: None,
    };
    loop {
        let _ = watch.reap();
        if let Some(code) = watch.status {
            watch.kill_all();
            return ExitCode::from(code);
        }
        match mask.wait() {
            Ok(Signal::SIGUSR1) => watch.kill_all(),
            Ok(signal @ (Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP)) => {
                match killpg(watch.command, signal) {
                    Ok(()) | Err(Errno::ESRCH) => {}
                    Err(e) => eprintln!("pgelect: watcher: cannot forward {signal}: {e}"),
                }
            }
            _ => {}
        }
    }
}

/// Forks the command's process ahead of the go (see [`arm`]): in its own
/// process group, dying with the watcher, with an empty signal mask, it
/// waits for the go on the inherited pipe `fd`, then executes `program`
/// with the go's variables added (a command that cannot be executed exits
/// 127 or 126 with a message, as [`spawn`]'s); stood down (the pipe closed
/// with nothing written) it exits 0. Returns its pid.
#[allow(unsafe_code)]
fn fork_ahead(fd: i32, program: &OsStr, rest: &[OsString]) -> nix::Result<Pid> {
    use nix::unistd::{fork, setpgid, ForkResult};
    let watcher = nix::unistd::getpid();
    // SAFETY: the watcher has one thread (its main), so the child may do
    // anything a process may, allocation included.
    match unsafe { fork() }? {
        ForkResult::Parent { child } => {
            // Both sides set the group: it exists when either returns, so
            // a signal to it from here is never lost.
            match setpgid(child, child) {
                Ok(()) | Err(Errno::EACCES) | Err(Errno::ESRCH) => {}
                Err(e) => return Err(e),
            }
            Ok(child)
        }
        ForkResult::Child => {
            let code = (|| {
                let _ = setpgid(Pid::from_raw(0), Pid::from_raw(0));
                if SigSet::empty().thread_set_mask().is_err()
                    || nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).is_err()
                    || nix::unistd::getppid() != watcher
                {
                    // The watcher is gone (or the process cannot follow
                    // it): nothing to start.
                    return exit::SOFTWARE;
                }
                let env = match wait_for_go(fd) {
                    Ok(Some(env)) => env,
                    // Stood down, or the supervisor died: nothing to start.
                    Ok(None) => return 0,
                    Err(e) => {
                        eprintln!(
                            "pgelect: watcher: cannot read the go pipe: {e}; the command was not started"
                        );
                        return exit::SOFTWARE;
                    }
                };
                let e = std::process::Command::new(program)
                    .args(rest)
                    .envs(env)
                    .exec();
                let (code, message) = spawn_failure(program, &e);
                eprintln!("pgelect: {message}");
                code
            })();
            std::process::exit(code.into())
        }
    }
}

/// Waits for the supervisor's go ([`Armed::start`]) on the inherited pipe
/// `fd`: the variables to add to the command's environment, or `None` if
/// the pipe was closed with nothing written.
fn wait_for_go(fd: i32) -> io::Result<Option<Vec<(OsString, OsString)>>> {
    use std::io::Read;
    use std::os::unix::ffi::OsStringExt;
    // Opened anew (close-on-exec, like every file std opens) rather than
    // adopted, then the inherited descriptor closed: the command never
    // inherits the pipe. Nothing else in this process owns that number.
    let mut pipe = std::fs::File::open(format!("/proc/self/fd/{fd}"))?;
    nix::unistd::close(fd)?;
    let mut go = Vec::new();
    pipe.read_to_end(&mut go)?;
    if go.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        go.split(|b| *b == 0)
            .filter_map(|kv| {
                let at = kv.iter().position(|b| *b == b'=')?;
                Some((
                    OsString::from_vec(kv[..at].to_vec()),
                    OsString::from_vec(kv[at + 1..].to_vec()),
                ))
            })
            .collect(),
    ))
}

/// The watcher's state: the command's pid and, once reaped, its code.
struct Watch {
    command: Pid,
    status: Option<u8>,
}

impl Watch {
    /// Reaps every exited child without blocking, keeping the command's
    /// code; true if the watcher has no child at all any more.
    fn reap(&mut self) -> bool {
        self.reap_with(Some(WaitPidFlag::WNOHANG))
    }

    /// Reaps children, keeping the command's code, until none is left to
    /// reap (`None`: until none is left at all); true if the watcher has no
    /// child at all any more (`ECHILD`).
    fn reap_with(&mut self, flags: Option<WaitPidFlag>) -> bool {
        loop {
            match waitpid(None, flags) {
                Ok(WaitStatus::Exited(pid, code)) if pid == self.command => {
                    self.status = Some(code as u8)
                }
                Ok(WaitStatus::Signaled(pid, signal, _)) if pid == self.command => {
                    self.status = Some(128u8.wrapping_add(signal as i32 as u8))
                }
                Err(Errno::ECHILD) => return true,
                Ok(WaitStatus::StillAlive) | Err(_) => return false,
                Ok(_) => {}
            }
        }
    }

    /// SIGKILLs the command's group and every descendant of the watcher,
    /// until none is left alive, and reaps them.
    fn kill_all(&mut self) {
        if self.status.is_none() {
            // The group cannot have been reused: its leader is not reaped.
            match killpg(self.command, Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) => {
                    eprintln!("pgelect: watcher: cannot kill the command's process group: {e}")
                }
            }
        }
        // Every descendant is a child of the watcher or below one (orphans
        // are re-parented to it, a subreaper): with the command reaped and
        // no child left at all, there is nothing to look for in /proc. The
        // common case (the command exited with everything it started), and
        // it keeps a planned handoff from waiting for a scan of every
        // process on the host.
        if self.status.is_some() && self.reap() {
            return;
        }
        let me = std::process::id() as i32;
        for _ in 0..500 {
            let victims = descendants(me);
            for &(pid, _) in &victims {
                signal_logged(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = self.reap();
            if victims.is_empty() {
                // Reap the last round's zombies before exiting.
                let _ = self.reap_with(None);
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!("pgelect: watcher: processes left by the command survived SIGKILL for 5s");
    }
}

fn spawn_failure(program: &OsStr, e: &io::Error) -> (u8, String) {
    match e.kind() {
        io::ErrorKind::NotFound => (
            NOT_FOUND,
            format!("command not found: {program:?}; check the name and PATH"),
        ),
        io::ErrorKind::PermissionDenied => (
            NOT_EXECUTABLE,
            format!("command {program:?} cannot be executed: permission denied"),
        ),
        _ => (
            NOT_EXECUTABLE,
            format!("command {program:?} could not be started: {e}"),
        ),
    }
}

/// `PR_SET_PDEATHSIG(SIGKILL)` in the command: it dies with its watcher.
/// Also gives it an empty signal mask: the watcher's blocked signals would
/// otherwise be inherited, and a shell that saves its mask at start (dash)
/// would never run its SIGTERM trap.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut std::process::Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the forked child before exec and makes
    // only async-signal-safe system calls (sigprocmask, prctl, getppid,
    // _exit); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            SigSet::empty().thread_set_mask().map_err(io::Error::from)?;
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
            // The watcher may have died between fork and prctl.
            if nix::unistd::getppid() != parent {
                nix::libc::_exit(1);
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_watcher_holds_a_signal_sent_while_it_starts() {
        // What the supervisor does to the watcher before exec, on a shell
        // that sends itself SIGTERM at once: the signal stays pending (the
        // shell keeps the mask it was started with) instead of killing it.
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "kill -TERM $$; echo alive"])
            .stdout(std::process::Stdio::piped());
        block_in_watcher(&mut cmd);
        let out = cmd.output().await.expect("run sh");
        assert_eq!(out.status.signal(), None, "{:?}", out.status);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "alive");
    }

    #[test]
    fn the_orphans_to_kill_leave_out_the_live_watchers_and_their_commands() {
        let spawn = || {
            std::process::Command::new("sh")
                .args(["-c", "sleep 30 & echo $!; wait"])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn sh")
        };
        let grandchild = |c: &mut std::process::Child| {
            let mut line = String::new();
            std::io::BufRead::read_line(
                &mut std::io::BufReader::new(c.stdout.take().unwrap()),
                &mut line,
            )
            .unwrap();
            line.trim().parse::<i32>().unwrap()
        };
        let (mut watched, mut orphan) = (spawn(), spawn());
        let (under_watched, under_orphan) = (grandchild(&mut watched), grandchild(&mut orphan));
        let live = Live::new(watched.id());
        let me = std::process::id() as i32;
        let victims: Vec<i32> = {
            let spared: Vec<i32> = live_watchers().iter().copied().collect();
            descendants_but(me, &spared)
                .iter()
                .map(|&(p, _)| p)
                .collect()
        };
        drop(live);
        let after: Vec<i32> = descendants_but(me, &[]).iter().map(|&(p, _)| p).collect();
        for pid in [under_watched, under_orphan] {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = (watched.wait(), orphan.wait());
        assert!(!victims.contains(&(watched.id() as i32)), "{victims:?}");
        assert!(!victims.contains(&under_watched), "{victims:?}");
        assert!(victims.contains(&(orphan.id() as i32)), "{victims:?}");
        assert!(victims.contains(&under_orphan), "{victims:?}");
        // Unregistered, a watcher is a descendant like any other.
        assert!(after.contains(&under_watched), "{after:?}");
    }

    #[test]
    fn descendants_of_this_test_include_a_grandchild() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let grandchild: i32 = line.trim().parse().unwrap();
        let found = descendants(std::process::id() as i32);
        let _ = kill(Pid::from_raw(grandchild), Signal::SIGKILL);
        let _ = child.wait();
        assert!(
            found.iter().any(|&(p, _)| p == child.id() as i32),
            "{found:?}"
        );
        assert!(found.iter().any(|&(p, _)| p == grandchild), "{found:?}");
    }
}
