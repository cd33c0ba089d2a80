//! Process, filesystem and runtime helpers shared by the servers.

use std::fs::{self, File, OpenOptions};
use std::future::Future;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio_postgres::{NoTls, SimpleQueryMessage};

/// Builds an `io::Error` of kind `Other` from anything printable.
pub(crate) fn err(msg: impl Into<String>) -> io::Error {
    io::Error::other(msg.into())
}

/// Wraps an error with context, keeping its kind.
pub(crate) fn ctx(e: io::Error, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A random number, different on every call.
pub(crate) fn random_u64() -> u64 {
    rand::random()
}

/// The kernel's ephemeral port range (`low`, `high`).
pub(crate) fn ephemeral_range() -> (u16, u16) {
    fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999))
}

/// The effective uid of this process (from `/proc/self/status`; falls back
/// to the owner of a freshly created file).
fn euid() -> u32 {
    if let Ok(status) = fs::read_to_string("/proc/self/status") {
        for line in status.lines() {
            if let Some(rest) = line.strip_prefix("Uid:") {
                if let Some(e) = rest.split_whitespace().nth(1).and_then(|v| v.parse().ok()) {
                    return e;
                }
            }
        }
    }
    let probe = std::env::temp_dir().join(format!("pgelect-testkit-uid-{}", random_u64()));
    let uid = File::create(&probe)
        .and_then(|f| f.metadata())
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    let _ = fs::remove_file(&probe);
    uid
}

/// Looks a user up in `/etc/passwd`: `(uid, gid)`.
fn passwd_lookup(name: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut f = line.split(':');
        if f.next()? != name {
            return None;
        }
        let _password = f.next()?;
        Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
    })
}

/// The unprivileged `(uid, gid)` servers run as when this process is root,
/// or `None` when they run as the current user.
pub(crate) fn run_as() -> Option<(u32, u32)> {
    static RUN_AS: OnceLock<Option<(u32, u32)>> = OnceLock::new();
    *RUN_AS.get_or_init(|| {
        (euid() == 0).then(|| {
            passwd_lookup("postgres")
                .or_else(|| passwd_lookup("nobody"))
                .unwrap_or((65534, 65534))
        })
    })
}

/// The uid the servers run as (for cache keys).
pub(crate) fn server_uid() -> u32 {
    run_as().map_or_else(euid, |(uid, _)| uid)
}

/// Makes `cmd` run as the unprivileged server user when we are root.
pub(crate) fn as_server_user(cmd: &mut Command) -> &mut Command {
    if let Some((uid, gid)) = run_as() {
        // std calls setgroups(0) before setuid when running as root.
        cmd.uid(uid).gid(gid);
    }
    cmd
}

/// Hands `path` to the server user (no-op unless root).
pub(crate) fn chown_to_server(path: &Path) -> io::Result<()> {
    if let Some((uid, gid)) = run_as() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .map_err(|e| ctx(e, format!("chown {}", path.display())))?;
    }
    Ok(())
}

/// Where servers' directories go: `PGELECT_TEST_TMPDIR` if set, else
/// `/dev/shm` if it is a tmpfs with at least 1 GiB free and writable, else
/// [`std::env::temp_dir`].
pub(crate) fn base_dir() -> PathBuf {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        if let Some(dir) = std::env::var_os("PGELECT_TEST_TMPDIR").filter(|v| !v.is_empty()) {
            return PathBuf::from(dir);
        }
        if shm_usable() {
            return PathBuf::from("/dev/shm");
        }
        std::env::temp_dir()
    })
    .clone()
}

/// Whether `/dev/shm` is a roomy, writable tmpfs (Docker's default one is
/// only 64 MB: too small).
fn shm_usable() -> bool {
    let is_tmpfs = fs::read_to_string("/proc/mounts").is_ok_and(|mounts| {
        mounts.lines().any(|l| {
            let mut f = l.split_whitespace().skip(1);
            f.next() == Some("/dev/shm") && f.next() == Some("tmpfs")
        })
    });
    if !is_tmpfs {
        return false;
    }
    let free_kib = Command::new("df")
        .args(["-Pk", "/dev/shm"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .and_then(|out| {
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.lines()
                .nth(1)?
                .split_whitespace()
                .nth(3)?
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0);
    if free_kib < 1 << 20 {
        return false;
    }
    let probe = Path::new("/dev/shm").join(format!("pgelect-testkit-probe-{}", random_u64()));
    let writable = fs::create_dir(&probe).is_ok();
    let _ = fs::remove_dir(&probe);
    writable
}

/// Creates a fresh, unique directory `<base_dir>/pgelect-testkit-<kind>-<pid>-<n>-<nanos>`,
/// mode 0700, owned by the server user.
pub(crate) fn make_temp_dir(kind: &str) -> io::Result<PathBuf> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let base = base_dir();
    for _ in 0..100 {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = base.join(format!(
            "pgelect-testkit-{kind}-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        match fs::create_dir(&dir) {
            Ok(()) => {
                fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?;
                chown_to_server(&dir)?;
                return Ok(dir);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(ctx(e, format!("create {}", dir.display()))),
        }
    }
    Err(err(format!(
        "cannot create a unique directory under {}",
        base.display()
    )))
}

/// Writes a file readable only by its owner, owned by the server user.
pub(crate) fn write_private(path: &Path, contents: &str) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| ctx(e, format!("create {}", path.display())))?;
    f.write_all(contents.as_bytes())?;
    chown_to_server(path)
}

/// Opens (append) a log file for a child's stdout/stderr; returns the file
/// and its current length (where this run's output starts).
pub(crate) fn open_log(path: &Path) -> io::Result<(File, u64)> {
    let f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| ctx(e, format!("open {}", path.display())))?;
    let len = f.metadata()?.len();
    Ok((f, len))
}

/// The last `n` lines of `path` written after byte `from`, for error messages.
pub(crate) fn log_tail(path: &Path, from: u64, n: usize) -> String {
    let mut text = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.seek(SeekFrom::Start(from));
        let mut bytes = Vec::new();
        let _ = f.read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    if lines.is_empty() {
        format!("(log {} is empty)", path.display())
    } else {
        format!(
            "last {} lines of {}:\n{}",
            lines.len() - start,
            path.display(),
            lines[start..].join("\n")
        )
    }
}

/// Waits for `child` to exit, at most `timeout`.
pub(crate) fn wait_timeout(child: &mut Child, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits for `child` at most `timeout`, then `SIGKILL`s and reaps it.
pub(crate) fn wait_or_kill(child: &mut Child, timeout: Duration) {
    if matches!(wait_timeout(child, timeout), Ok(Some(_))) {
        return;
    }
    let _ = child.kill();
    let _ = wait_timeout(child, Duration::from_secs(5));
}

/// Runs `cmd` to completion (bounded by `timeout`), with stdout and stderr
/// appended to `log`. On failure the error names `what` and quotes the log.
pub(crate) fn run_logged(
    mut cmd: Command,
    log: &Path,
    timeout: Duration,
    what: &str,
) -> io::Result<()> {
    let (out, from) = open_log(log)?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn();
    let mut child = child.map_err(|e| ctx(e, format!("spawn {what}")))?;
    match wait_timeout(&mut child, timeout)? {
        Some(status) if status.success() => Ok(()),
        Some(status) => Err(err(format!(
            "{what} failed ({status}); {}",
            log_tail(log, from, 20)
        ))),
        None => {
            let _ = child.kill();
            let _ = wait_timeout(&mut child, Duration::from_secs(5));
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{what} did not finish within {timeout:?}; {}",
                    log_tail(log, from, 20)
                ),
            ))
        }
    }
}

/// The reaper of one server: a `sh` process that, when its stdin pipe
/// closes (i.e. when this process exits, however it exits, or when
/// [`Reaper::finish`] is called), signals the last pid written to it (`QUIT`
/// for a postmaster: immediate shutdown of it and its backends), waits up to
/// 5 s, `SIGKILL`s that pid and its process group, then removes `dir`.
/// (PostgreSQL backends `setsid()` themselves, so the group kill only hits
/// the postmaster; orphaned backends exit on postmaster death.)
///
/// The write end of the pipe is opened `O_CLOEXEC` by std, so the servers
/// (and other reapers) spawned later do not inherit it: only this process
/// holds it open.
#[derive(Debug)]
pub(crate) struct Reaper {
    child: Child,
    stdin: Option<ChildStdin>,
}

/// The reaper script. `$1` = directory to remove, `$2` = first signal to send.
/// Each line read is a pid to kill at the end (`0`: nothing to kill).
const REAPER_SCRIPT: &str = r#"
trap '' INT TERM HUP PIPE
alive() {
  if [ -r "/proc/$1/stat" ]; then
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)
    [ -n "$state" ] && [ "$state" != Z ]
  else
    kill -0 "$1" 2>/dev/null
  fi
}
pid=0
while read -r line; do pid=$line; done
if [ "$pid" != 0 ]; then
  kill -"$2" "$pid" 2>/dev/null
  i=0
  while [ $i -lt 100 ] && alive "$pid"; do sleep 0.05; i=$((i+1)); done
  kill -9 -"$pid" 2>/dev/null
  kill -9 "$pid" 2>/dev/null
fi
rm -rf -- "$1"
"#;

impl Reaper {
    /// Spawns the reaper for `dir`; at exit it sends `signal` (a name such
    /// as `QUIT`) to the watched pid, waits up to 5 s, then `SIGKILL`s the
    /// pid's process group.
    pub(crate) fn spawn(dir: &Path, signal: &str) -> io::Result<Reaper> {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(REAPER_SCRIPT)
            .arg("pgelect-testkit-reaper")
            .arg(dir)
            .arg(signal)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .current_dir("/")
            // Own process group: a Ctrl-C or a group kill aimed at the test
            // process must not kill the reaper before it has cleaned up.
            .process_group(0)
            .spawn()
            .map_err(|e| ctx(e, "spawn the cleanup process (/bin/sh)"))?;
        let stdin = child.stdin.take();
        Ok(Reaper { child, stdin })
    }

    /// Sets the pid to kill at exit (`0`: none).
    pub(crate) fn watch(&mut self, pid: u32) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{pid}");
            let _ = stdin.flush();
        }
    }

    /// The raw fd of the pipe's write end (for tests).
    #[cfg(test)]
    pub(crate) fn stdin_fd(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        self.stdin.as_ref().map(|s| s.as_raw_fd())
    }

    /// Closes the pipe and waits (at most `timeout`) for the reaper to kill
    /// and remove everything.
    pub(crate) fn finish(mut self, timeout: Duration) {
        drop(self.stdin.take());
        wait_or_kill(&mut self.child, timeout);
    }
}

/// Runs a future on a fresh thread with its own current-thread tokio
/// runtime (so it works from sync code, from inside any runtime, and from
/// `Drop`), bounded by `timeout`. `deliver` receives the result.
pub(crate) fn spawn_on_fresh_runtime<T, F, Fut>(
    timeout: Duration,
    make: F,
    deliver: impl FnOnce(io::Result<T>) + Send + 'static,
) -> io::Result<()>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = io::Result<T>>,
{
    std::thread::Builder::new()
        .name("pgelect-testkit".into())
        .spawn(move || {
            let result = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .and_then(|rt| {
                    rt.block_on(async {
                        match tokio::time::timeout(timeout, make()).await {
                            Ok(r) => r,
                            Err(_) => Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("timed out after {timeout:?}"),
                            )),
                        }
                    })
                });
            deliver(result);
        })
        .map(|_| ())
        .map_err(|e| ctx(e, "spawn a helper thread"))
}

/// Sync wrapper of [`spawn_on_fresh_runtime`].
pub(crate) fn block_on_fresh_runtime<T, F, Fut>(timeout: Duration, make: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = io::Result<T>>,
{
    let (tx, rx) = std::sync::mpsc::channel();
    spawn_on_fresh_runtime(timeout, make, move |r| {
        let _ = tx.send(r);
    })?;
    rx.recv_timeout(timeout + Duration::from_secs(5))
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "helper thread hung",
            ))
        })
}

/// Async wrapper of [`spawn_on_fresh_runtime`]: awaits without using the
/// caller's timers (safe under a paused tokio clock).
pub(crate) async fn on_fresh_runtime<T, F, Fut>(timeout: Duration, make: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = io::Result<T>>,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    spawn_on_fresh_runtime(timeout, make, move |r| {
        let _ = tx.send(r);
    })?;
    rx.await
        .unwrap_or_else(|_| Err(err("helper thread panicked")))
}

/// Converts a tokio-postgres error to `io::Error`, with its full detail.
pub(crate) fn pg_err(e: tokio_postgres::Error) -> io::Error {
    let detail = match e.as_db_error() {
        Some(db) => format!("{}: {} ({})", db.severity(), db.message(), db.code().code()),
        None => match std::error::Error::source(&e) {
            Some(src) => format!("{e}: {src}"),
            None => e.to_string(),
        },
    };
    err(detail)
}

/// Connects (within this runtime), runs `sql` with the simple query
/// protocol and returns the rows as strings.
pub(crate) async fn simple_rows(
    config: tokio_postgres::Config,
    sql: &str,
) -> io::Result<Vec<Vec<Option<String>>>> {
    let (client, conn) = config.connect(NoTls).await.map_err(pg_err)?;
    let conn = tokio::spawn(conn);
    let result = client.simple_query(sql).await.map_err(pg_err);
    drop(client);
    let _ = conn.await;
    let mut rows = Vec::new();
    for msg in result? {
        if let SimpleQueryMessage::Row(row) = msg {
            rows.push(
                (0..row.len())
                    .map(|i| row.get(i).map(str::to_owned))
                    .collect(),
            );
        }
    }
    Ok(rows)
}

/// Polls until `probe` succeeds, `child` exits, or `timeout` passes.
///
/// Before each probe, a plain TCP connect to `port` must succeed (cheap).
/// On failure, the error quotes the last probe error and the log tail.
pub(crate) fn wait_ready(
    what: &str,
    child: &mut Child,
    port: u16,
    timeout: Duration,
    log: &Path,
    log_from: u64,
    mut probe: impl FnMut() -> io::Result<()>,
) -> Result<(), ReadyError> {
    let deadline = Instant::now() + timeout;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut last = String::from("not listening yet");
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(ReadyError::Exited(format!(
                    "{what} exited during startup ({status}); {}",
                    log_tail(log, log_from, 20)
                )))
            }
            Ok(None) => {}
            Err(e) => return Err(ReadyError::Other(ctx(e, format!("wait for {what}")))),
        }
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok() {
            match probe() {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            return Err(ReadyError::Other(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{what} did not accept connections on port {port} within {timeout:?} \
                     (last error: {last}); {}",
                    log_tail(log, log_from, 20)
                ),
            )));
        }
        std::thread::sleep(Duration::from_millis(15));
    }
}

/// Why a server did not become ready.
#[derive(Debug)]
pub(crate) enum ReadyError {
    /// The process exited (message includes the log tail).
    Exited(String),
    /// Timeout or another failure.
    Other(io::Error),
}

impl ReadyError {
    /// Whether the failure looks like a lost race for the port.
    pub(crate) fn is_port_clash(&self) -> bool {
        match self {
            ReadyError::Exited(msg) => {
                msg.contains("could not bind")
                    || msg.contains("Address already in use")
                    || msg.contains("could not create any TCP/IP sockets")
            }
            ReadyError::Other(_) => false,
        }
    }

    /// Into an `io::Error`.
    pub(crate) fn into_io(self) -> io::Error {
        match self {
            ReadyError::Exited(msg) => err(msg),
            ReadyError::Other(e) => e,
        }
    }
}

/// Unique-ish numeric id for names: (per-process counter, pid).
pub(crate) fn next_id() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// Quotes an SQL identifier.
pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Quotes an SQL string literal (standard_conforming_strings = on).
pub(crate) fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}
