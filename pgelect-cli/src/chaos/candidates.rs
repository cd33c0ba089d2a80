//! The candidates of a run: starting a supervisor (`pgelect run` with the
//! worker as its command) on its path to the database (directly, through
//! a proxy of its own, through the pooler, or from a network namespace as
//! a database user of its own), retiring it, and watching the workers'
//! logs for the next leader.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use super::admin::{db_error, Admin};
use super::args::{backend_name, ChaosArgs};
use super::events::{is_write_ok, read_events, Event};
use super::url::UrlParts;
use super::worker::ROGUE;
use super::{fail, netns, pooler, promote};
use crate::exit::Failure;
use crate::run::{BackendArg, ProfileArg};
use pgelect_faultproxy::FaultProxy;

pub(super) struct Supervisor {
    pub(super) node: String,
    pub(super) child: Child,
    /// The proxies its connections (and its worker's) go through, when the
    /// URLs allow them: one to the server, and one to the pooler when it
    /// connects through one.
    pub(super) proxies: Vec<FaultProxy>,
    /// Its network namespace, in the partition phase.
    pub(super) ns: Option<netns::Ns>,
    /// The file libfaketime reads its clock offset from, if preloaded.
    pub(super) clock: Option<PathBuf>,
    /// Its process id, kept after it was reaped.
    pub(super) pid: Option<u32>,
}

/// The second phase's set-up: the bridge and namespaces, and the database
/// users the namespaced candidates connect as (one each, so that only
/// `pg_signal_backend` lets one end another's backend).
pub(super) struct Netted {
    pub(super) net: netns::Net,
    pub(super) url: UrlParts,
    pub(super) users: Vec<String>,
}

impl Netted {
    /// Grants or revokes `pg_signal_backend` for every candidate's user.
    pub(super) async fn set_preempt(&self, admin: &Admin, on: bool) -> Result<(), Failure> {
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

/// libfaketime's multi-threaded library, where Debian's `faketime`
/// package puts it.
pub(super) fn find_faketime() -> Option<PathBuf> {
    let dirs = std::fs::read_dir("/usr/lib").ok()?;
    dirs.flatten()
        .map(|d| d.path().join("faketime/libfaketimeMT.so.1"))
        .chain([PathBuf::from("/usr/lib/faketime/libfaketimeMT.so.1")])
        .find(|p| p.exists())
}

/// 128 random bits as hex (a candidate's database password), from `rand`'s
/// thread-local generator (a CSPRNG seeded by the operating system).
pub(super) fn random_hex() -> String {
    format!("{:032x}", rand::random::<u128>())
}

pub(super) struct Run<'a> {
    pub(super) exe: PathBuf,
    pub(super) url_file: &'a Path,
    /// The database's URL, for a proxy per supervisor (first phase).
    pub(super) proxied: Option<&'a UrlParts>,
    /// Namespaces and users (second phase).
    pub(super) net: Option<&'a mut Netted>,
    /// libfaketime, preloaded into supervisors for clock jumps.
    pub(super) faketime: Option<PathBuf>,
    /// The throwaway server, for restarts.
    pub(super) server: Option<&'a crate::demo::throwaway::Server>,
    /// The primary and its replica, for promotions (third phase).
    pub(super) replicas: Option<&'a mut promote::Pair>,
    /// The HA manager's formation, for its faults (a run under `--ha`).
    pub(super) manager: Option<&'a mut super::ha::Formation>,
    /// The pooler the supervisors and their workers connect through (lease
    /// backend, first and promote phases), or why there is none.
    pub(super) pooler: Result<&'a pooler::Pooler, String>,
    pub(super) admin: &'a Admin,
    pub(super) schema: String,
    pub(super) role: String,
    pub(super) backend: BackendArg,
    pub(super) args: &'a ChaosArgs,
    pub(super) dir: PathBuf,
    pub(super) table: String,
    pub(super) next_id: u32,
    /// A partition-group run's shape: `role` names the group, each
    /// supervisor is a member running a worker per partition it leads.
    pub(super) group: Option<super::group::Group>,
}

impl Run<'_> {
    pub(super) async fn spawn(&mut self) -> Result<Supervisor, Failure> {
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
                let password = random_hex();
                let schema = pgelect::schema::SchemaName::new(&self.schema)?;
                let mut sql = vec![format!(
                    "CREATE ROLE \"{user}\" LOGIN PASSWORD '{password}'"
                )];
                for kind in [
                    pgelect::admin::UserKind::Candidate,
                    pgelect::admin::UserKind::Fencer,
                ] {
                    sql.extend(
                        pgelect::admin::grant_statements(kind, &user, &schema)?
                            .into_iter()
                            .map(|g| g.sql),
                    );
                }
                sql.push(pgelect::admin::preemption_grant(&user)?.sql);
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
                        let proxy = proxy_to(url, &path)?;
                        (vec![proxy], path, None)
                    }
                    // Both paths proxied, so that a network fault cuts all
                    // of the leader's traffic.
                    (Some(url), Some(pooler)) if pooler.parts.is_some() => {
                        let p = pooler.parts.as_ref().expect("BUG: checked above");
                        let proxy = proxy_to(url, &path)?;
                        let to_pooler = FaultProxy::start(p.addr).map_err(|e| {
                            fail(format!("cannot start a proxy to the pooler: {e}"))
                        })?;
                        let pooled = self.dir.join(format!("{node}.pooled.url"));
                        write_private(&pooled, &p.to("127.0.0.1", to_pooler.port(), None))?;
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
        let program = self.args.python.as_deref().unwrap_or(&self.exe);
        let mut cmd = match &ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(netns::Net::exec_prefix(ns)).arg(program);
                c
            }
            None => Command::new(program),
        };
        let backend = match self.backend {
            BackendArg::Session => "session",
            BackendArg::Lease => "lease",
        };
        let profile = match self.args.profile {
            ProfileArg::Standard => "standard",
            ProfileArg::Fast => "fast",
        };
        let ttl_ms = self.args.ttl.as_millis().to_string();
        let tick_ms = self
            .group
            .map_or(super::worker::TICK, |g| g.tick)
            .as_millis()
            .to_string();
        let log = self.dir.join(format!("{node}.log"));
        if self.args.python.is_some() {
            // The Python candidate: elector and worker in one process
            // (pgelect-py/python/pgelect/_chaos.py).
            cmd.args(["-m", "pgelect._chaos", "--url-file"])
                .arg(&url_file)
                .arg("--worker-url-file")
                .arg(&worker_url)
                .args(["--role", &self.role, "--node", &node, "--backend", backend])
                .args(["--profile", profile, "--ttl-ms", &ttl_ms])
                .args(["--schema", &self.schema, "--table", &self.table])
                .args(["--idle-in-transaction-ms", &ttl_ms, "--log"])
                .arg(&log);
            if let Some(direct) = &direct {
                cmd.arg("--listen-url-file").arg(direct);
            }
        } else {
            match &self.group {
                Some(g) => cmd.args([
                    "run",
                    "--partitions",
                    &format!("{}:{}", self.role, g.partitions),
                ]),
                None => cmd.args(["run", "--role", &self.role]),
            };
            cmd.args(["--id", &node, "--backend", backend])
                .args(["--profile", profile, "--ttl"])
                .arg(crate::duration::show(self.args.ttl))
                .arg("--grace")
                .arg(crate::duration::show(super::faults::GRACE))
                .arg("--pass-database-env");
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
                    &ttl_ms,
                    "--tick-ms",
                    &tick_ms,
                    "--log",
                ])
                .arg(&log)
                .env("PGELECT_DATABASE_URL_FILE", &url_file);
        }
        cmd.stdin(Stdio::null())
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
    pub(super) fn retire(&mut self, s: Supervisor) {
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

    /// The end of a phase: the rogue (if any) killed, every supervisor
    /// sent SIGTERM (a clean handover each), those still running after
    /// `bound` in all killed, and each retired.
    pub(super) async fn stop_all(
        &mut self,
        rogue: Option<Child>,
        sups: Vec<Supervisor>,
        bound: Duration,
    ) {
        if let Some(mut r) = rogue {
            let _ = r.start_kill();
            let _ = r.wait().await;
        }
        for s in &sups {
            signal(s.child.id(), nix::sys::signal::Signal::SIGTERM);
        }
        let deadline = Instant::now() + bound;
        for mut s in sups {
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, s.child.wait()).await.is_err() {
                let _ = s.child.start_kill();
                let _ = s.child.wait().await;
            }
            self.retire(s);
        }
    }

    /// The test-only rogue: a worker under no supervisor, acting with
    /// term 1 all along (see `--rogue`).
    pub(super) fn spawn_rogue(&self) -> Result<Child, Failure> {
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
        .env(
            "PGELECT_ROLE",
            match &self.group {
                Some(_) => pgelect::partitions::partition_role(&self.role, 0),
                None => self.role.clone(),
            },
        )
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
    pub(super) fn latest_start(&self) -> Option<Event> {
        read_events(&self.dir)
            .into_iter()
            .filter(|e| e.what == "start" && e.node != ROGUE)
            .max_by_key(|e| e.term)
    }

    /// Waits for a fenced write acknowledged after `after`; returns when.
    /// The logs are read at least once, even when `within` is zero (the
    /// fault may have lasted its whole bound, and the write be logged
    /// already).
    pub(super) async fn next_write_ok(&self, after: u128, within: Duration) -> Option<u128> {
        let until = Instant::now() + within;
        loop {
            if let Some(e) = read_events(&self.dir)
                .into_iter()
                .find(|e| e.at > after && e.node != ROGUE && is_write_ok(&e.what))
            {
                return Some(e.at);
            }
            if Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub(super) async fn next_start(
        &self,
        above: i64,
        after: u128,
        within: Duration,
    ) -> Option<Event> {
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

/// Fails clearly unless `python` runs and imports the Python candidate
/// (the pgelect wheel and psycopg installed).
pub(super) fn check_python(python: &Path) -> Result<(), Failure> {
    let out = std::process::Command::new(python)
        .args(["-c", "import pgelect._chaos"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            Failure::new(
                crate::exit::USAGE,
                format!("--python {}: cannot run it: {e}", python.display()),
            )
        })?;
    if out.status.success() {
        return Ok(());
    }
    let why = String::from_utf8_lossy(&out.stderr);
    Err(Failure::new(
        crate::exit::USAGE,
        format!(
            "--python {}: cannot import the Python candidate (pgelect._chaos): {}; install the pgelect wheel and psycopg into it (pgelect-py/test.sh --build-only makes target/py-venv)",
            python.display(),
            why.trim().lines().last().unwrap_or("no message")
        ),
    ))
}

/// A proxy to the server of `url`, and at `path` a private file with the
/// URL through it.
pub(super) fn proxy_to(url: &UrlParts, path: &Path) -> Result<FaultProxy, Failure> {
    let proxy =
        FaultProxy::start(url.addr).map_err(|e| fail(format!("cannot start a proxy: {e}")))?;
    write_private(path, &url.to("127.0.0.1", proxy.port(), None))?;
    Ok(proxy)
}

/// Writes `text` to a new file only this user can read (mode 0600).
pub(super) fn write_private(path: &Path, text: &str) -> Result<(), Failure> {
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

pub(super) fn signal(pid: Option<u32>, sig: nix::sys::signal::Signal) {
    if let Some(pid) = pid {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
    }
}
