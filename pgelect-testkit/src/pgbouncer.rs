//! A real pgbouncer in front of a [`Cluster`], of a data node of an
//! [`AutoFailover`] formation, or of a port.

use std::fs;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::autofailover::NodeIndex;
use crate::tls::{CertFiles, DEFAULT_SERVER_NAMES};
use crate::util::{
    self, as_server_user, block_on_fresh_runtime, ctx, err, make_temp_dir, open_log, wait_or_kill,
    write_private, ReadyError, Reaper,
};
use crate::{free_port, percent_encode, AutoFailover, Cluster, HOST, SUPERUSER, TEST_PASSWORD};

/// How long pgbouncer may take to answer a query through it after being
/// spawned.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// PgBouncer pooling mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolMode {
    /// `pool_mode = session`: a client keeps its server connection until it
    /// disconnects (`server_reset_query = DISCARD ALL` on release).
    Session,
    /// `pool_mode = transaction`: a client holds a server connection only
    /// for the duration of a transaction. Session state (advisory locks held
    /// at session level, prepared statements, `SET`) does not survive
    /// between transactions; use the simple query protocol.
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// TLS between clients and PgBouncer ([`PgBouncer::start_with`]).
///
/// Whatever this says, PgBouncer talks to a TLS cluster over TLS
/// (`server_tls_sslmode = verify-full` against the cluster's CA, or
/// `verify-ca` when the cluster's certificate does not name `127.0.0.1`,
/// the host PgBouncer connects to) and to a plain cluster in plain text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum BouncerTls {
    /// `client_tls_sslmode = disable`: clients connect in plain text.
    #[default]
    Off,
    /// `client_tls_sslmode = prefer`: TLS offered, plain accepted.
    Offered,
    /// `client_tls_sslmode = require`: plain client connections are refused.
    Required,
}

impl BouncerTls {
    fn sslmode(self) -> &'static str {
        match self {
            BouncerTls::Off => "disable",
            BouncerTls::Offered => "prefer",
            BouncerTls::Required => "require",
        }
    }
}

/// PgBouncer's TLS files, in its own directory.
#[derive(Debug)]
struct Tls {
    /// Copy of the cluster's CA: verifies the server, and signed `own`.
    ca: PathBuf,
    /// PgBouncer's own certificate for its clients (unless `client_tls` is `Off`).
    own: Option<CertFiles>,
    /// `server_tls_sslmode`.
    server_sslmode: &'static str,
}

/// Whether a pgbouncer binary was found: `PGELECT_PGBOUNCER`, the usual
/// system locations, or `PATH`.
pub fn pgbouncer_available() -> bool {
    pgbouncer_bin().is_some()
}

fn pgbouncer_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PGELECT_PGBOUNCER").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let system = [
        "/usr/sbin/pgbouncer",
        "/usr/bin/pgbouncer",
        "/usr/local/sbin/pgbouncer",
        "/usr/local/bin/pgbouncer",
    ];
    let path_dirs = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    system
        .iter()
        .map(PathBuf::from)
        .chain(path_dirs.into_iter().map(|d| d.join("pgbouncer")))
        .find(|p| p.is_file())
}

/// A real pgbouncer (run as the unprivileged server user when root) in
/// front of a [`Cluster`] (or of a port: [`PgBouncer::start_in_front_of`]),
/// listening on `127.0.0.1`.
///
/// Clients authenticate with SCRAM as [`SUPERUSER`] with the cluster's
/// superuser password when pgbouncer was started
/// ([`TEST_PASSWORD`](crate::TEST_PASSWORD) unless
/// [`Cluster::set_superuser_password`] changed it; from its
/// `userlist.txt`), or as any other role of the cluster (looked up
/// with `auth_query`). Database `pgbouncer` is the admin console
/// (`SHOW POOLS`, `SHOW CONFIG`, ... with the simple query protocol).
/// Settings: `max_client_conn = 500`, `default_pool_size = 20`,
/// `ignore_startup_parameters = extra_float_digits`,
/// `server_login_retry = 1`; log in `pgbouncer.log` next to its ini file.
///
/// In front of a TLS cluster it talks to the server over TLS, verifying the
/// cluster's certificate; [`PgBouncer::start_with`] adds TLS towards
/// clients ([`BouncerTls`]).
///
/// Dropping it (or the test process exiting) kills pgbouncer and removes its
/// directory.
#[derive(Debug)]
pub struct PgBouncer {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    server_port: u16,
    /// The superuser's password, in `userlist.txt` and the URLs.
    password: String,
    mode: PoolMode,
    client_tls: BouncerTls,
    tls: Option<Tls>,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    child: Option<Child>,
    reaper: Option<Reaper>,
}

impl PgBouncer {
    /// Starts pgbouncer in `mode` in front of `cluster` on a free port and
    /// waits (at most 10 s) until a `SELECT 1` through it succeeds.
    ///
    /// # Errors
    ///
    /// `NotFound` if pgbouncer is not installed; otherwise if it does not
    /// start (the message includes the log tail).
    pub fn start(cluster: &Cluster, mode: PoolMode) -> io::Result<PgBouncer> {
        Self::start_with(cluster, mode, BouncerTls::Off)
    }

    /// Starts pgbouncer in `mode` in front of `cluster` with TLS to its
    /// clients as `client_tls` says, and to the cluster if it speaks TLS
    /// (see [`BouncerTls`]); waits (at most 10 s) until a `SELECT 1`
    /// through it succeeds.
    ///
    /// For client TLS, PgBouncer gets its own certificate from the
    /// cluster's CA ([`ca_cert`](PgBouncer::ca_cert)), for
    /// [`DEFAULT_SERVER_NAMES`] (`localhost`, `127.0.0.1`): clients use
    /// `verify-full` with [`tcp_url`](PgBouncer::tcp_url). PgBouncer then
    /// also listens on a Unix socket in its private directory, which
    /// [`url`](PgBouncer::url) and [`config`](PgBouncer::config) use, so the
    /// kit's own plain connections keep working.
    ///
    /// # Errors
    ///
    /// `InvalidInput` if `client_tls` is not [`BouncerTls::Off`] and the
    /// cluster has no TLS (its CA signs PgBouncer's certificate); otherwise
    /// as [`start`](PgBouncer::start).
    pub fn start_with(
        cluster: &Cluster,
        mode: PoolMode,
        client_tls: BouncerTls,
    ) -> io::Result<PgBouncer> {
        if client_tls != BouncerTls::Off && cluster.certs().is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "BouncerTls::{client_tls:?} needs a TLS cluster (ClusterOptions::tls): \
                     its CA signs pgbouncer's certificate"
                ),
            ));
        }
        Self::launch(
            cluster.port(),
            cluster.password(),
            cluster.certs(),
            mode,
            client_tls,
        )
    }

    /// Starts pgbouncer in `mode` in front of whatever PostgreSQL server
    /// answers on `127.0.0.1:server_port` without TLS, whose [`SUPERUSER`]
    /// has `password`: a server behind a proxy, or an address that follows
    /// the primary of a [`ReplicaSet`](crate::ReplicaSet) as an HA proxy
    /// would. Clients connect in plain text. Waits (at most 10 s) until a
    /// `SELECT 1` through it succeeds, so a server must answer there now.
    ///
    /// Whatever answers on the port later is PgBouncer's server. After a
    /// failed login (nothing answers) it tries again only
    /// `server_login_retry` (1 s) later, and meanwhile refuses clients that
    /// need a server ("server login has been failing, try again later").
    ///
    /// # Errors
    ///
    /// As [`start`](PgBouncer::start).
    pub fn start_in_front_of(
        server_port: u16,
        password: &str,
        mode: PoolMode,
    ) -> io::Result<PgBouncer> {
        Self::launch(
            server_port,
            password.to_owned(),
            None,
            mode,
            BouncerTls::Off,
        )
    }

    /// Starts pgbouncer in `mode` in front of data node `node` of a
    /// pg_auto_failover `formation`, as PgBouncer is deployed next to an HA
    /// manager: one per data node, pointed at its local node, since
    /// PgBouncer cannot follow the primary itself (it has no
    /// `target_session_attrs`). Clients name every node's bouncer in a
    /// multi-host URL ([`PgBouncer::multi_host_url`]) with
    /// `target_session_attrs=read-write`: the driver's check (`SHOW
    /// transaction_read_only`) goes through a bouncer to its node, so it
    /// keeps the bouncer of the node that accepts writes.
    ///
    /// The bouncer outlives its node's restarts, demotions and promotions:
    /// it connects to whatever answers on the node's port, a primary or a
    /// standby (after a failed login, only `server_login_retry`, 1 s,
    /// later). Waits (at most 10 s) until a `SELECT 1` through it succeeds,
    /// so the node must answer now.
    ///
    /// # Errors
    ///
    /// As [`start`](PgBouncer::start); `InvalidInput` if the formation has
    /// no node `node`.
    pub fn start_for_node(
        formation: &AutoFailover,
        node: NodeIndex,
        mode: PoolMode,
    ) -> io::Result<PgBouncer> {
        let port = *formation.ports().get(node).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the formation has {} data nodes, no node {node}",
                    formation.ports().len()
                ),
            )
        })?;
        Self::start_in_front_of(port, TEST_PASSWORD, mode)
    }

    /// `postgres://postgres:PASSWORD@127.0.0.1:P1,127.0.0.1:P2/<database>?<params>`:
    /// a multi-host URL over `bouncers` in their order (plain TCP, the
    /// first bouncer's password), e.g. with
    /// `params = "target_session_attrs=read-write"` over the bouncers of
    /// [`start_for_node`](PgBouncer::start_for_node).
    ///
    /// # Panics
    ///
    /// If `bouncers` is empty.
    pub fn multi_host_url(bouncers: &[PgBouncer], database: &str, params: &str) -> String {
        let first = bouncers.first().expect("at least one pgbouncer");
        let hosts: Vec<String> = bouncers
            .iter()
            .map(|b| format!("{}:{}", b.tcp_host(), b.port))
            .collect();
        format!(
            "postgres://{}:{}@{}/{}?{params}",
            percent_encode(SUPERUSER),
            percent_encode(&first.password),
            hosts.join(","),
            percent_encode(database)
        )
    }

    /// Starts pgbouncer in front of `127.0.0.1:server_port`, over TLS with
    /// `certs`' CA if given.
    fn launch(
        server_port: u16,
        password: String,
        certs: Option<&crate::TestCerts>,
        mode: PoolMode,
        client_tls: BouncerTls,
    ) -> io::Result<PgBouncer> {
        let bin = pgbouncer_bin().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "pgbouncer not found: run `scripts/setup.sh` or `apt-get install pgbouncer`, \
                 or set PGELECT_PGBOUNCER to its path",
            )
        })?;
        let dir = make_temp_dir("pgbouncer")?;
        let reaper = match Reaper::spawn(&dir, "TERM") {
            Ok(r) => r,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let mut bouncer = PgBouncer {
            dir,
            bin,
            port: 0,
            server_port,
            password,
            mode,
            client_tls,
            tls: None,
            state: Mutex::new(State {
                child: None,
                reaper: Some(reaper),
            }),
        };
        // From here on, dropping `bouncer` cleans everything up.
        if let Some(certs) = certs {
            bouncer.tls = Some(bouncer.make_tls(certs)?);
        }
        let userlist = format!(
            "\"{}\" \"{}\"\n",
            SUPERUSER.replace('"', "\"\""),
            bouncer.password.replace('"', "\"\"")
        );
        write_private(&bouncer.dir.join("userlist.txt"), &userlist)?;
        let mut clash = None;
        for _ in 0..10 {
            bouncer.port = free_port();
            bouncer.write_ini()?;
            match bouncer.spawn() {
                Ok(()) => return Ok(bouncer),
                Err(e) if e.is_port_clash() => clash = Some(e),
                Err(e) => return Err(ctx(e.into_io(), "pgbouncer failed to start")),
            }
        }
        Err(ctx(
            clash.map_or_else(|| err("no attempt"), ReadyError::into_io),
            "pgbouncer could not bind a free port after 10 attempts",
        ))
    }

    /// The pgbouncer process's id while it runs (to freeze it with
    /// `SIGSTOP`, say); `None` once stopped.
    pub fn pid(&self) -> Option<u32> {
        self.lock().child.as_ref().map(|c| c.id())
    }

    /// The port pgbouncer listens on (stable across
    /// [`restart`](PgBouncer::restart)).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres:PASSWORD@127.0.0.1:PORT/<database>` through
    /// pgbouncer (database `pgbouncer` is its admin console), for plain
    /// connections. With client TLS the host is instead pgbouncer's private
    /// Unix socket directory, so that `NoTls` connections keep working; use
    /// [`tcp_url`](PgBouncer::tcp_url) to go over TCP and TLS.
    pub fn url(&self, database: &str) -> String {
        let host = match self.socket_dir() {
            Some(dir) => percent_encode(&dir.to_string_lossy()),
            None => HOST.to_owned(),
        };
        format!(
            "postgres://{}:{}@{host}:{}/{}",
            percent_encode(SUPERUSER),
            percent_encode(&self.password),
            self.port,
            percent_encode(database)
        )
    }

    /// A superuser connection config for `database` through pgbouncer (no
    /// connect timeout is set); through its Unix socket with client TLS,
    /// like [`url`](PgBouncer::url).
    pub fn config(&self, database: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        match self.socket_dir() {
            Some(dir) => config.host_path(dir),
            None => config.host(HOST),
        };
        config
            .port(self.port)
            .user(SUPERUSER)
            .password(&self.password)
            .dbname(database);
        config
    }

    /// `postgres://postgres:PASSWORD@HOST:PORT/<database>` through
    /// pgbouncer over TCP, with no query string (append
    /// `?sslmode=…&sslrootcert=…`). `HOST` is `localhost` with client TLS (a
    /// DNS name of pgbouncer's certificate), `127.0.0.1` without.
    pub fn tcp_url(&self, database: &str) -> String {
        format!(
            "postgres://{}:{}@{}:{}/{}",
            percent_encode(SUPERUSER),
            percent_encode(&self.password),
            self.tcp_host(),
            self.port,
            percent_encode(database)
        )
    }

    /// A superuser config for `database` through pgbouncer over TCP, to the
    /// host of [`tcp_url`](PgBouncer::tcp_url) (no connect timeout is set).
    pub fn tcp_config(&self, database: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host(self.tcp_host())
            .port(self.port)
            .user(SUPERUSER)
            .password(&self.password)
            .dbname(database);
        config
    }

    fn tcp_host(&self) -> &'static str {
        if self.client_tls == BouncerTls::Off {
            HOST
        } else {
            "localhost"
        }
    }

    /// TLS towards clients.
    pub fn client_tls(&self) -> BouncerTls {
        self.client_tls
    }

    /// `server_tls_sslmode` towards the cluster: `Some("verify-full")` (or
    /// `"verify-ca"`) in front of a TLS cluster, `None` in front of a plain
    /// one.
    pub fn server_tls_sslmode(&self) -> Option<&'static str> {
        self.tls.as_ref().map(|tls| tls.server_sslmode)
    }

    /// The CA that signed pgbouncer's certificate (the cluster's CA, copied
    /// into pgbouncer's directory): `sslrootcert` for clients. `None` in
    /// front of a plain cluster.
    pub fn ca_cert(&self) -> Option<&Path> {
        self.tls.as_ref().map(|tls| tls.ca.as_path())
    }

    /// The directory of pgbouncer's private Unix socket, when it speaks TLS
    /// to clients (it has none otherwise).
    pub fn socket_dir(&self) -> Option<&Path> {
        (self.client_tls != BouncerTls::Off).then_some(self.dir.as_path())
    }

    /// Kills pgbouncer (`SIGKILL`: all client and server connections drop)
    /// and starts it again on the same port; returns once a query through it
    /// succeeds.
    ///
    /// # Errors
    ///
    /// If it does not come back within 10 s (e.g. the port was taken
    /// meanwhile), with the log tail.
    pub fn restart(&self) -> io::Result<()> {
        self.stop()?;
        self.spawn()
            .map_err(|e| ctx(e.into_io(), "restart pgbouncer"))
    }

    /// Points pgbouncer at `cluster` and restarts it (its port stays): what
    /// an operator does after a primary failover when the pooler does not
    /// follow the primary by itself (PgBouncer has no
    /// `target_session_attrs`). Clients' connections are cut.
    ///
    /// # Errors
    ///
    /// As [`restart`](PgBouncer::restart), or if the configuration cannot
    /// be written.
    pub fn retarget(&mut self, cluster: &Cluster) -> io::Result<()> {
        self.server_port = cluster.port();
        self.write_ini()?;
        self.restart()
    }

    /// Whether the pgbouncer process runs (it was started and has not
    /// exited).
    pub fn is_running(&self) -> bool {
        matches!(
            self.lock().child.as_mut().map(|c| c.try_wait()),
            Some(Ok(None))
        )
    }

    /// How pgbouncer is doing, for a failure message: whether its process
    /// still runs (or how it exited) and the last `lines` of its log.
    pub fn diagnose(&self, lines: usize) -> String {
        let status = match self.lock().child.as_mut().map(|c| c.try_wait()) {
            None => "not started".to_owned(),
            Some(Ok(None)) => "running".to_owned(),
            Some(Ok(Some(exit))) => format!("exited: {exit}"),
            Some(Err(e)) => format!("unknown: {e}"),
        };
        let log = fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        format!(
            "pgbouncer on port {}: {status}; its log (last {lines} lines):\n{}",
            self.port,
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }

    /// Kills pgbouncer (`SIGKILL`) and waits for it to exit. A no-op if it is
    /// not running. [`restart`](PgBouncer::restart) brings it back.
    ///
    /// # Errors
    ///
    /// Only if waiting for the process fails.
    pub fn stop(&self) -> io::Result<()> {
        let mut st = self.lock();
        if let Some(mut child) = st.child.take() {
            let _ = child.kill();
            if util::wait_timeout(&mut child, Duration::from_secs(10))?.is_none() {
                return Err(err("pgbouncer did not exit after SIGKILL"));
            }
        }
        if let Some(reaper) = st.reaper.as_mut() {
            reaper.watch(0);
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Copies the cluster's CA and, for client TLS, issues pgbouncer's own
    /// certificate, into pgbouncer's directory.
    fn make_tls(&self, certs: &crate::TestCerts) -> io::Result<Tls> {
        let socket = self.dir.join(".s.PGSQL.65535");
        if self.client_tls != BouncerTls::Off && socket.as_os_str().len() > 107 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the Unix socket path {} of a TLS pgbouncer is longer than 107 bytes: \
                     set PGELECT_TEST_TMPDIR to a shorter directory",
                    socket.display()
                ),
            ));
        }
        let ca = self.dir.join("ca.crt");
        let pem = fs::read_to_string(certs.ca_cert())
            .map_err(|e| ctx(e, format!("read {}", certs.ca_cert().display())))?;
        util::write_private(&ca, &pem)?;
        let own = match self.client_tls {
            BouncerTls::Off => None,
            _ => Some(certs.issue_server_cert(&self.dir, "pgbouncer", &DEFAULT_SERVER_NAMES)?),
        };
        // pgbouncer connects to 127.0.0.1: verify-full only if the
        // certificate names it.
        let server_sslmode = if certs.server_names().iter().any(|n| n == HOST) {
            "verify-full"
        } else {
            "verify-ca"
        };
        Ok(Tls {
            ca,
            own,
            server_sslmode,
        })
    }

    fn write_ini(&self) -> io::Result<()> {
        let dir = self.dir.display();
        let reset = match self.mode {
            PoolMode::Session => "DISCARD ALL",
            PoolMode::Transaction => "",
        };
        let mut ini = format!(
            "\
[databases]
* = host={HOST} port={server_port}

[pgbouncer]
listen_addr = {HOST}
listen_port = {port}
unix_socket_dir = {socket_dir}
pidfile = {dir}/pgbouncer.pid
auth_type = scram-sha-256
auth_file = {dir}/userlist.txt
auth_user = {SUPERUSER}
auth_query = SELECT usename, passwd FROM pg_catalog.pg_shadow WHERE usename = $1
admin_users = {SUPERUSER}
stats_users = {SUPERUSER}
pool_mode = {mode}
max_client_conn = 500
default_pool_size = 20
ignore_startup_parameters = extra_float_digits
server_reset_query = {reset}
server_login_retry = 1
",
            server_port = self.server_port,
            port = self.port,
            mode = self.mode.as_str(),
            socket_dir = self
                .socket_dir()
                .map(Path::display)
                .map(|d| d.to_string())
                .unwrap_or_default(),
        );
        if let Some(tls) = &self.tls {
            ini.push_str(&format!(
                "server_tls_sslmode = {}\nserver_tls_ca_file = {}\n",
                tls.server_sslmode,
                tls.ca.display()
            ));
            if let Some(own) = &tls.own {
                ini.push_str(&format!(
                    "client_tls_sslmode = {}\n\
                     client_tls_cert_file = {}\n\
                     client_tls_key_file = {}\n",
                    self.client_tls.sslmode(),
                    own.cert().display(),
                    own.key().display()
                ));
            }
        }
        write_private(&self.dir.join("pgbouncer.ini"), &ini)
    }

    fn spawn(&self) -> Result<(), ReadyError> {
        let mut st = self.lock();
        if let Some(child) = st.child.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                return Err(ReadyError::Other(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "pgbouncer is already running",
                )));
            }
        }
        st.child = None;
        let pidfile = self.dir.join("pgbouncer.pid");
        let _ = fs::remove_file(&pidfile);
        let log = self.dir.join("pgbouncer.log");
        let (out, from) = open_log(&log).map_err(ReadyError::Other)?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg(self.dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().map_err(ReadyError::Other)?)
            .stderr(out)
            .current_dir(&self.dir)
            .process_group(0);
        as_server_user(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| ReadyError::Other(ctx(e, format!("spawn {}", self.bin.display()))))?;
        if let Some(reaper) = st.reaper.as_mut() {
            reaper.watch(child.id());
        }
        let admin = self.config("pgbouncer");
        let db = self.config("postgres");
        let ready = util::wait_ready(
            "pgbouncer",
            &mut child,
            self.port,
            START_TIMEOUT,
            &log,
            from,
            || {
                let (mut admin, mut db) = (admin.clone(), db.clone());
                let pidfile = pidfile.clone();
                block_on_fresh_runtime(Duration::from_secs(5), move || async move {
                    admin.connect_timeout(Duration::from_secs(2));
                    db.connect_timeout(Duration::from_secs(2));
                    // Guard against another pgbouncer that grabbed our port.
                    let config = util::simple_rows(admin, "SHOW CONFIG").await?;
                    let ours = config.iter().any(|row| {
                        row.first().and_then(Option::as_deref) == Some("pidfile")
                            && row.get(1).and_then(Option::as_deref) == pidfile.to_str()
                    });
                    if !ours {
                        return Err(err("port is served by another pgbouncer"));
                    }
                    util::simple_rows(db, "SELECT 1").await.map(|_| ())
                })
            },
        );
        match ready {
            Ok(()) => {
                st.child = Some(child);
                Ok(())
            }
            Err(e) => {
                wait_or_kill(&mut child, Duration::ZERO);
                if let Some(reaper) = st.reaper.as_mut() {
                    reaper.watch(0);
                }
                Err(e)
            }
        }
    }
}

impl Drop for PgBouncer {
    /// Kills pgbouncer and removes its directory.
    fn drop(&mut self) {
        let _ = self.stop();
        let reaper = self.lock().reaper.take();
        if let Some(reaper) = reaper {
            reaper.finish(Duration::from_secs(30));
        }
        if self.dir.exists() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}
