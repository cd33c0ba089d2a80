//! The supervised child process: started in its own process group, killed
//! with the supervisor (`PR_SET_PDEATHSIG`), stopped gracefully or at once.

use std::io;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::process::Command;

use crate::exit::Failure;

/// Exit code for a command that could not be found or executed (as shells do).
pub const NOT_FOUND: u8 = 127;
/// Exit code for a command that was found but could not be executed.
pub const NOT_EXECUTABLE: u8 = 126;

/// A running child in its own process group.
#[derive(Debug)]
pub struct Child {
    inner: tokio::process::Child,
    pgid: i32,
    /// The write end of the watcher's pipe: when it closes (this handle is
    /// dropped, or the supervisor dies, even by SIGKILL) the watcher kills
    /// the whole process group, grandchildren included.
    _watch: Option<tokio::process::ChildStdin>,
}

/// Starts `argv` with `env` added to the environment, in a new process group
/// whose leader is the child, with `PR_SET_PDEATHSIG(SIGKILL)` on Linux so
/// that the child dies with the supervisor even when the supervisor is killed
/// with SIGKILL.
///
/// Must be called from a thread that lives as long as the child should: on
/// Linux the death signal fires when the *thread* that forked exits. Tokio's
/// worker threads live as long as the runtime; never call this from
/// `spawn_blocking`, whose threads exit when idle.
pub fn spawn(argv: &[String], env: &[(&str, String)]) -> Result<Child, Failure> {
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| Failure::new(crate::exit::USAGE, "no command given after `--`"))?;
    let mut cmd = Command::new(program);
    cmd.args(args).process_group(0).kill_on_drop(false);
    for (k, v) in env {
        cmd.env(k, v);
    }
    die_with_parent(&mut cmd);
    let inner = cmd.spawn().map_err(|e| spawn_failure(program, e))?;
    let pid = inner.id().map(|p| p as i32).unwrap_or(0);
    let watch = watch_group(pid);
    Ok(Child {
        inner,
        pgid: pid,
        _watch: watch,
    })
}

/// Starts a tiny watcher, outside the child's process group, that kills the
/// group when its standard input closes. `PR_SET_PDEATHSIG` only reaches the
/// direct child; the watcher also ends what the child started in the
/// background, so nothing of the command outlives the supervisor's hold on
/// the lock or the leadership. The watcher is this executable, started with
/// [`WATCH_GROUP_ARG`]; if it cannot start, only the death signal protects.
fn watch_group(pgid: i32) -> Option<tokio::process::ChildStdin> {
    if pgid <= 0 {
        return None;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            tracing::warn!(error = %e, "cannot find our own executable to watch the command's process group");
            return None;
        }
    };
    let spawned = Command::new(exe)
        .args([WATCH_GROUP_ARG, &pgid.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(false)
        .spawn();
    match spawned {
        Ok(mut watcher) => {
            let stdin = watcher.stdin.take();
            // Reap it in the background so it leaves no zombie.
            tokio::spawn(async move {
                let _ = watcher.wait().await;
            });
            stdin
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the process-group watcher; background processes of the command may outlive a killed supervisor");
            None
        }
    }
}

fn spawn_failure(program: &str, e: io::Error) -> Failure {
    match e.kind() {
        io::ErrorKind::NotFound => Failure::new(
            NOT_FOUND,
            format!("command not found: {program:?}; check the name and PATH"),
        ),
        io::ErrorKind::PermissionDenied => Failure::new(
            NOT_EXECUTABLE,
            format!("command {program:?} cannot be executed: permission denied"),
        ),
        _ => Failure::new(
            NOT_EXECUTABLE,
            format!("command {program:?} could not be started: {e}"),
        ),
    }
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (prctl, getppid, _exit).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

impl Child {
    /// The child's process id (also its process group id).
    pub fn pid(&self) -> i32 {
        self.pgid
    }

    /// Waits for the child to exit.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        self.inner.wait().await
    }

    /// Sends `signal` to the child's whole process group.
    pub fn signal_group(&self, signal: i32) {
        if self.pgid > 0 {
            // SAFETY: kill(2) with a negative pid signals a process group;
            // no memory is involved.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(-self.pgid, signal);
            }
        }
    }

    /// Kills the process group at once (after an unexpected loss) and reaps
    /// the child.
    pub async fn kill_now(&mut self) -> io::Result<ExitStatus> {
        self.signal_group(libc::SIGKILL);
        self.inner.wait().await
    }

    /// SIGTERM to the group, then SIGKILL after `grace` if it has not exited.
    pub async fn stop(&mut self, grace: Duration) -> io::Result<ExitStatus> {
        if let Some(status) = self.inner.try_wait()? {
            // Grandchildren may still be running in the group.
            self.signal_group(libc::SIGKILL);
            return Ok(status);
        }
        self.signal_group(libc::SIGTERM);
        match tokio::time::timeout(grace, self.inner.wait()).await {
            Ok(status) => {
                self.signal_group(libc::SIGKILL);
                status
            }
            Err(_) => {
                tracing::warn!(pid = self.pgid, ?grace, "child ignored SIGTERM; killing it");
                self.kill_now().await
            }
        }
    }
}

/// The shell convention for a child's exit status: its code, or 128 + signal.
pub fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        _ => crate::exit::SOFTWARE,
    }
}

/// Sends `signal` to one process, if it still has a pid.
pub fn signal_pid(pid: Option<u32>, signal: i32) {
    if let Some(pid) = pid {
        // SAFETY: kill(2) on a pid we started; no memory is involved.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid as i32, signal);
        }
    }
}

/// The hidden first argument that makes `pgelect` a process-group watcher.
pub const WATCH_GROUP_ARG: &str = "__pgelect-watch-group";

/// The watcher's whole life: wait for standard input to close, then kill
/// the process group. Ignores SIGINT and SIGTERM meant for the terminal's
/// foreground group (it runs in a group of its own anyway).
pub fn watch_group_main(pgid: &str) -> std::process::ExitCode {
    use std::io::Read;
    let Ok(pgid) = pgid.parse::<i32>() else {
        return std::process::ExitCode::from(crate::exit::USAGE);
    };
    if pgid <= 1 {
        return std::process::ExitCode::from(crate::exit::USAGE);
    }
    let mut sink = [0u8; 64];
    let mut stdin = std::io::stdin();
    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    // SAFETY: kill(2) with a negative pid signals a process group; no memory
    // is involved.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
    std::process::ExitCode::SUCCESS
}
