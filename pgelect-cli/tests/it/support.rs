//! Shared harness for the tests that drive the real `pgelect` binary.
//!
//! Every run is bounded: [`finish`] kills the process and fails the test when
//! it outlives its limit, so a test never hangs. Readiness is awaited through
//! events (a marker file written by the child, a row in `pg_locks`), polled
//! in bounded loops, never through fixed sleeps.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pgelect_testkit::TestDb;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use tokio_postgres::Client;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_pgelect");

/// Variables that would let the environment of `cargo test` leak into a run.
const SCRUBBED_ENV: &[&str] = &[
    "DATABASE_URL",
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGUSER",
    "PGPASSWORD",
    "PGPASSFILE",
    "PGDATABASE",
    "PGAPPNAME",
    "PGSERVICE",
    "PGCONNECT_TIMEOUT",
    "PGSSLMODE",
    "PGSSLROOTCERT",
    "PGSSLCERT",
    "PGSSLKEY",
    "PGSSLCRL",
    "PGSSLCRLDIR",
    "PGSSLSNI",
    "PGSSLMINPROTOCOLVERSION",
    "PGSSLMAXPROTOCOLVERSION",
    "RUST_LOG",
];

/// `pgelect ARGS` with a scrubbed environment, stdin closed, stdout and
/// stderr piped, killed if its handle is dropped (a failing test leaves no
/// process behind; the command's child dies with it through
/// `PR_SET_PDEATHSIG`).
pub fn pgelect<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    cmd
}

/// The outcome of one run.
#[derive(Debug)]
pub struct Run {
    /// Exit code (`None` if killed by a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// From spawn (or from the start given to [`finish`]) to exit.
    pub elapsed: Duration,
}

impl Run {
    /// Standard output and standard error together.
    pub fn output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }

    /// Panics with the whole output unless the exit code is `code`.
    pub fn assert_code(&self, code: i32) -> &Run {
        assert_eq!(
            self.code,
            Some(code),
            "expected exit code {code}, got {:?} after {:?}\n--- stdout\n{}--- stderr\n{}",
            self.code,
            self.elapsed,
            self.stdout,
            self.stderr
        );
        self
    }
}

/// Runs `cmd` to completion within `limit`.
pub async fn run(mut cmd: Command, limit: Duration) -> Run {
    let started = Instant::now();
    let child = cmd.spawn().expect("spawn pgelect");
    finish(child, started, limit).await
}

/// Waits for `child` (spawned with piped output by [`pgelect`]) to exit
/// within `limit` of `started`; on timeout kills it and panics with what it
/// printed.
pub async fn finish(mut child: Child, started: Instant, limit: Duration) -> Run {
    let stdout = child.stdout.take().map(|s| tokio::spawn(read_all(s)));
    let stderr = child.stderr.take().map(|s| tokio::spawn(read_all(s)));
    let remaining = limit.saturating_sub(started.elapsed());
    let status = tokio::time::timeout(remaining, child.wait()).await;
    let elapsed = started.elapsed();
    let timed_out = status.is_err();
    if timed_out {
        let _ = child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    }
    // The command's own children inherit the pipes; do not wait forever for
    // them to close.
    let collect = |task: Option<tokio::task::JoinHandle<String>>| async move {
        match task {
            None => String::new(),
            Some(task) => match tokio::time::timeout(Duration::from_secs(5), task).await {
                Ok(Ok(text)) => text,
                _ => "<output pipe still open after 5s>".to_owned(),
            },
        }
    };
    let stdout = collect(stdout).await;
    let stderr = collect(stderr).await;
    if timed_out {
        panic!(
            "pgelect did not exit within {limit:?}; killed it\n--- stdout\n{stdout}--- stderr\n{stderr}"
        );
    }
    let status = status.expect("checked above").expect("wait for pgelect");
    Run {
        code: status.code(),
        stdout,
        stderr,
        elapsed,
    }
}

async fn read_all(mut pipe: impl tokio::io::AsyncRead + Unpin) -> String {
    let mut buf = Vec::new();
    let _ = pipe.read_to_end(&mut buf).await;
    String::from_utf8_lossy(&buf).into_owned()
}

pub use pgelect_testkit::wait_until;

/// Waits for `path` to exist (a marker the command writes once running).
pub async fn wait_for_file(path: &Path, limit: Duration) -> Duration {
    let what = format!("{} to appear", path.display());
    wait_until(&what, limit, || async { path.exists() }).await
}

/// Sends `signal` (a name such as `TERM`) to `pid` with kill(1).
pub fn send_signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill(1)");
    assert!(status.success(), "kill -{signal} {pid} failed");
}

/// True while `pid` exists and is not a zombie (a zombie has exited; only its
/// parent has not reaped it yet).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => {
            // "pid (comm) S ...": the state follows the last ')'.
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next());
            !matches!(state, Some("Z" | "X") | None)
        }
    }
}

/// A directory for one test, removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(hint: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "pgelect-cli-{hint}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create test directory");
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Installs pgelect's schema in the database at `url`.
pub async fn migrate(url: &str) {
    let options = pgelect::ConnectOptions::from_url(url).expect("test URL parses");
    pgelect::migrate(&options).await.expect("migrate");
}

/// Whether `schema` exists in `db`.
pub async fn schema_exists(db: &TestDb, schema: &str) -> bool {
    db.connect()
        .await
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
            &[&schema],
        )
        .await
        .expect("query pg_namespace")
        .get(0)
}

/// A fresh database with pgelect's schema, and a scratch directory.
pub async fn setup(hint: &str) -> (TestDb, TempDir) {
    let db = TestDb::new(hint).await;
    migrate(&db.url()).await;
    (db, TempDir::new(hint))
}

/// One advisory lock in this test's database, as `pg_locks` and
/// `pg_stat_activity` show it.
#[derive(Debug, Clone)]
pub struct AdvisoryLock {
    pub pid: i32,
    pub application_name: String,
    pub mode: String,
    pub granted: bool,
}

/// The advisory locks (held and awaited) in the current database, except
/// the roles' watch keys held (a blocking standby of the default priority
/// holds its role's while it waits for the role's lock, the others wait
/// for it: see the book's "Many candidates of one role"; so each standby
/// still shows as one waiting lock). A watch key is recognised by its
/// holder's `application_name` (`pgelect:<role>:<node>`).
pub async fn advisory_locks(admin: &Client) -> Vec<AdvisoryLock> {
    admin
        .query(
            "SELECT l.pid, coalesce(a.application_name, ''), l.mode, l.granted,
                    l.classid::int8, l.objid::int8, l.objsubid::int4
               FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
              WHERE l.locktype = 'advisory'
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              ORDER BY l.granted DESC, l.pid",
            &[],
        )
        .await
        .expect("query pg_locks")
        .iter()
        .filter(|row| {
            let app: String = row.get(1);
            let granted: bool = row.get(3);
            let role = app
                .strip_prefix("pgelect:")
                .and_then(|rest| rest.rsplit_once(':'))
                .map(|(role, _)| role);
            let watch = role.and_then(|role| {
                pgelect::LockKey::from_name(&format!("election-watch:pgelect:{role}")).ok()
            });
            let is_watch = watch.is_some_and(|k| {
                let pgelect::LockKey::Single(k) = k else {
                    return false;
                };
                row.get::<_, i32>(6) == 1
                    && row.get::<_, i64>(4) == ((k as u64) >> 32) as i64
                    && row.get::<_, i64>(5) == (k as u64 & 0xffff_ffff) as i64
            });
            !(granted && is_watch)
        })
        .map(|row| AdvisoryLock {
            pid: row.get(0),
            application_name: row.get(1),
            mode: row.get(2),
            granted: row.get(3),
        })
        .collect()
}

/// Waits until `pg_locks` shows `granted` held and `waiting` awaited
/// advisory locks in this database.
pub async fn await_advisory_locks(admin: &Client, granted: usize, waiting: usize) {
    let what = format!("{granted} granted and {waiting} waiting advisory locks");
    wait_until(&what, Duration::from_secs(10), || async {
        let locks = advisory_locks(admin).await;
        locks.iter().filter(|l| l.granted).count() == granted
            && locks.iter().filter(|l| !l.granted).count() == waiting
    })
    .await;
}

/// Nanoseconds since the Unix epoch (what `date +%s%N` prints), to compare
/// the test's observations with times the commands write.
pub fn unix_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos()
}

/// Reads a pid that a command wrote to `path`.
pub fn read_pid_file(path: &Path) -> u32 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{} holds no pid: {e}", path.display()))
}

/// A long-running `pgelect` (a `run` supervisor, `status --watch`) whose
/// standard output and error are drained all the time, so that its logs can
/// never fill a pipe and block it, and are at hand when an assertion fails.
/// Killed when dropped.
pub struct Background {
    pub name: String,
    child: Child,
    stdout: std::sync::Arc<std::sync::Mutex<String>>,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    /// The tasks draining stdout and stderr: awaited after an exit, so that
    /// the last lines are in `output()` when `wait` returns.
    readers: Vec<tokio::task::JoinHandle<()>>,
    started: Instant,
}

/// A process still running when its test ends (a failed assertion, or a
/// test that leaves it to the end) is asked to stop with SIGTERM first and
/// given up to two seconds, so that it stops what it started (`pgelect
/// demo` its candidates and server; `pgelect run` its command); only then
/// SIGKILLed (`kill_on_drop`). A SIGKILL alone left a failed demo test's
/// candidates running as orphans.
impl Drop for Background {
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let Some(pid) = self.child.id() else {
            return;
        };
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        let until = Instant::now() + Duration::from_secs(2);
        while sent && Instant::now() < until {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.start_kill();
    }
}

impl Background {
    /// Spawns `cmd` (from [`pgelect`], so with piped output).
    pub fn spawn(name: &str, mut cmd: Command) -> Background {
        use tokio::io::AsyncBufReadExt;
        let mut child = cmd.spawn().expect("spawn pgelect");
        let stdout = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        let out = child.stdout.take().expect("piped stdout");
        let sink = stdout.clone();
        let out_reader = tokio::spawn(async move {
            let mut reader = tokio::io::BufReader::new(out).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                sink.lock().unwrap().push_str(&format!("{line}\n"));
                let _ = tx.send(line);
            }
        });
        let err = child.stderr.take().expect("piped stderr");
        let sink = stderr.clone();
        let err_reader = tokio::spawn(async move {
            let mut reader = tokio::io::BufReader::new(err).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                sink.lock().unwrap().push_str(&format!("{line}\n"));
            }
        });
        Background {
            name: name.to_owned(),
            child,
            stdout,
            stderr,
            lines,
            readers: vec![out_reader, err_reader],
            started: Instant::now(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("pgelect still has a pid")
    }

    /// Sends `signal` (a name such as `TERM`) to pgelect itself.
    pub fn signal(&self, signal: &str) {
        send_signal(self.pid(), signal);
    }

    /// What it printed so far, for failure messages.
    pub fn output(&self) -> String {
        format!(
            "--- {} stdout\n{}--- {} stderr\n{}",
            self.name,
            self.stdout.lock().unwrap(),
            self.name,
            self.stderr.lock().unwrap()
        )
    }

    /// The next line of standard output for which `wanted` holds (earlier
    /// lines are skipped); panics after `limit`.
    pub async fn next_line(
        &mut self,
        what: &str,
        limit: Duration,
        wanted: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) if wanted(&line) => return line,
                Ok(Some(_)) => {}
                Ok(None) => panic!(
                    "{} closed its output before {what}\n{}",
                    self.name,
                    self.output()
                ),
                Err(_) => panic!(
                    "timed out after {limit:?} waiting for {what}\n{}",
                    self.output()
                ),
            }
        }
    }

    /// Waits for it to exit within `limit`; returns the exit code (`None`
    /// after a signal). On timeout kills it and panics with its output.
    pub async fn wait(&mut self, limit: Duration) -> Option<i32> {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => {
                // The pipes end with the process (or soon after, if a
                // child of it held them): read them to the end.
                for reader in self.readers.drain(..) {
                    let _ = tokio::time::timeout(Duration::from_secs(2), reader).await;
                }
                status.expect("wait for pgelect").code()
            }
            Err(_) => {
                let _ = self.child.start_kill();
                let _ = self.child.wait().await;
                panic!(
                    "{} did not exit within {limit:?}; killed it\n{}",
                    self.name,
                    self.output()
                );
            }
        }
    }

    /// SIGKILLs pgelect and reaps it.
    pub async fn kill(&mut self) {
        self.child.start_kill().expect("SIGKILL pgelect");
        let _ = self.child.wait().await;
    }

    /// How long ago it was spawned.
    pub fn age(&self) -> Duration {
        self.started.elapsed()
    }
}
