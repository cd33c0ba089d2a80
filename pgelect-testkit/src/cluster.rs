//! Throwaway PostgreSQL clusters.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use crate::tls::{TestCerts, TlsMode, DEFAULT_SERVER_NAMES};
use crate::util::{
    self, as_server_user, block_on_fresh_runtime, chown_to_server, ctx, err, make_temp_dir,
    open_log, run_logged, wait_or_kill, wait_timeout, write_private, ReadyError, Reaper,
};
use crate::{free_port, percent_encode, pg_bin_dir, HOST, SUPERUSER, TEST_PASSWORD};

/// How long a server may take to accept connections after being spawned.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// `initdb` arguments besides `-D` and `--pwfile` (part of the template key).
/// `--wal-segsize=1` (MB instead of 16) makes a data directory 28 MB instead
/// of 39 MB, which matters when copying it under I/O contention.
const INITDB_ARGS: [&str; 7] = [
    "-U",
    SUPERUSER,
    "--auth=scram-sha-256",
    "--encoding=UTF8",
    "--locale=C",
    "--no-sync",
    "--wal-segsize=1",
];

/// Settings appended to every cluster's `postgresql.conf` (the port is
/// passed on the command line).
///
/// `synchronous_commit` stays `on`: with `fsync = off` a commit costs only a
/// `write()`, and it keeps acknowledged commits across [`Cluster::kill`]
/// (a process crash), which crash tests rely on. (`fsync = off` only loses
/// data on an OS crash.)
const SETTINGS: &str = "
# --- pgelect-testkit ---
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
fsync = off
full_page_writes = off
max_connections = 400
shared_buffers = 32MB
logging_collector = off
log_line_prefix = '%m [%p] %q%u@%d '
";

/// `pg_hba.conf` of every cluster: password (SCRAM) authentication over TCP
/// only, so wrong passwords really fail.
const PG_HBA: &str = "\
# TYPE  DATABASE  USER  ADDRESS       METHOD
host    all       all   127.0.0.1/32  scram-sha-256
host    all       all   ::1/128       scram-sha-256
host    replication all 127.0.0.1/32  scram-sha-256
";

/// The host name tests connect to over TCP on a TLS cluster, so that
/// `verify-full` checks a DNS name of the server certificate.
const TLS_HOST: &str = "localhost";

/// `pg_hba.conf` of a TLS cluster (see [`TlsMode`] for what each mode
/// means). The `local` line is for the kit's own connections over its
/// private Unix socket (see [`Cluster::url`]); it asks for the password.
fn tls_pg_hba(mode: &TlsMode) -> String {
    let local = "local   all       all                 scram-sha-256\n";
    match mode {
        TlsMode::Offered => format!("{local}{PG_HBA}"),
        TlsMode::Required => format!("{local}{REQUIRED_HBA}"),
        TlsMode::ClientCert { user } => {
            let user = format!("\"{user}\"");
            format!(
                "{local}\
                 hostssl all       {user} 127.0.0.1/32  cert\n\
                 hostssl all       {user} ::1/128       cert\n\
                 {REQUIRED_HBA}"
            )
        }
    }
}

/// The TCP part of `pg_hba.conf` when TLS is required: SCRAM over TLS, an
/// explicit `reject` for plain connections (so that the server's message
/// says "rejects connection ... no encryption").
const REQUIRED_HBA: &str = "\
hostssl   all         all  127.0.0.1/32  scram-sha-256
hostssl   all         all  ::1/128       scram-sha-256
hostssl   replication all  127.0.0.1/32  scram-sha-256
hostnossl all         all  0.0.0.0/0     reject
hostnossl all         all  ::/0          reject
";

/// Whether a server's dying words are about its TLS settings.
fn is_tls_failure(msg: &str) -> bool {
    ["SSL", "certificate", "private key"]
        .iter()
        .any(|needle| msg.contains(needle))
}

/// Quotes a value for `postgresql.conf`.
fn conf_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// Options of [`Cluster::start_with`]; the [`Default`] is what
/// [`Cluster::start`] starts: a plain cluster.
///
/// ```no_run
/// use pgelect_testkit::{Cluster, ClusterOptions, TlsMode};
///
/// let cluster = Cluster::start_with(ClusterOptions::new().tls(TlsMode::Required))?;
/// let certs = cluster.certs().expect("a TLS cluster has certificates");
/// let url = format!(
///     "{}?sslmode=verify-full&sslrootcert={}",
///     cluster.tcp_url("postgres"),
///     certs.ca_cert().display()
/// );
/// # let _ = url;
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use]
pub struct ClusterOptions {
    tls: Option<TlsMode>,
    server_names: Option<Vec<String>>,
}

impl ClusterOptions {
    /// A plain cluster, as [`Cluster::start`] starts.
    pub fn new() -> ClusterOptions {
        ClusterOptions::default()
    }

    /// Speak TLS in `mode`, with certificates generated for this cluster
    /// ([`Cluster::certs`]). Default: no TLS (`ssl = off`).
    pub fn tls(mut self, mode: TlsMode) -> ClusterOptions {
        self.tls = Some(mode);
        self
    }

    /// The names (DNS names or IP addresses) of the server certificate.
    /// Default: [`DEFAULT_SERVER_NAMES`] (`localhost`, `127.0.0.1`). E.g.
    /// only `localhost`, so that `verify-full` to `127.0.0.1` fails on the
    /// host name. Needs [`tls`](ClusterOptions::tls).
    pub fn server_names<I, S>(mut self, names: I) -> ClusterOptions
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.server_names = Some(names.into_iter().map(Into::into).collect());
        self
    }

    /// Refuses contradictory or unusable options, naming them.
    fn validate(&self) -> io::Result<()> {
        let invalid = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
        match (&self.tls, &self.server_names) {
            (None, Some(names)) => {
                return invalid(format!(
                    "server_names {names:?} given without tls: a plain cluster has no certificate"
                ))
            }
            (Some(_), Some(names)) if names.is_empty() => {
                return invalid("server_names is empty: the certificate needs a name".into())
            }
            _ => {}
        }
        if let Some(TlsMode::ClientCert { user }) = &self.tls {
            if user.is_empty()
                || user.len() > 63
                || user.chars().any(|c| c == '"' || c.is_control())
            {
                return invalid(format!(
                    "TlsMode::ClientCert user {user:?} must be 1 to 63 bytes, without '\"' or control characters"
                ));
            }
        }
        Ok(())
    }
}

/// Creates a cluster's data directory: `(cluster dir, data dir)`.
pub(crate) type MakeData<'a> = dyn Fn(&Path, &Path) -> io::Result<()> + 'a;

/// The TLS side of a cluster.
#[derive(Debug)]
struct Tls {
    mode: TlsMode,
    certs: TestCerts,
}

/// A throwaway PostgreSQL server, listening on `127.0.0.1` only, with
/// superuser [`SUPERUSER`] / [`TEST_PASSWORD`] (SCRAM authentication).
///
/// Its directory lives under `/dev/shm` or [`std::env::temp_dir`] (see the
/// crate docs) and is removed, and the
/// server killed, when the `Cluster` is dropped *or* when the test process
/// exits in any way (see the crate docs on cleanup).
///
/// Settings: `fsync` and `full_page_writes` off (commits survive
/// [`kill`](Cluster::kill), not an OS crash),
/// `max_connections = 400`, `shared_buffers = 32MB`, no Unix socket (a TLS
/// cluster has a private one, see [`Cluster::start_with`]); the
/// server log is `data_dir()/server.log`.
///
/// Cost: 0.3-0.5 s per cluster (copy of a cached `initdb` template plus
/// server start; more on a busy disk when `/dev/shm` is not usable, see the
/// crate docs); the very first cluster on a machine also runs `initdb`
/// (about 1 s).
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    data: PathBuf,
    bin: PathBuf,
    port: u16,
    template: Option<PathBuf>,
    /// TLS mode and certificates, if the cluster speaks TLS.
    tls: Option<Tls>,
    /// The superuser's password: [`TEST_PASSWORD`] unless
    /// [`set_superuser_password`](Cluster::set_superuser_password) changed it.
    password: Mutex<String>,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The running postmaster (our child), if started.
    postmaster: Option<Child>,
    reaper: Option<Reaper>,
}

impl Cluster {
    /// Starts a new private cluster (for tests that stop, kill or restart
    /// it; other tests should share [`Cluster::shared`]).
    ///
    /// Picks a free port with [`free_port`] and retries with another one if
    /// the server loses a race for it. Returns once the server answers a
    /// query over TCP.
    ///
    /// # Errors
    ///
    /// When the binaries are missing ([`pg_bin_dir`]), `initdb` fails, or the
    /// server does not start within 30 s; the message includes the last 20
    /// lines of the relevant log.
    pub fn start() -> io::Result<Cluster> {
        Self::start_with(ClusterOptions::default())
    }

    /// Starts a new private cluster with `options`: with TLS, see
    /// [`TlsMode`] for each mode's `pg_hba.conf`. Otherwise as
    /// [`Cluster::start`].
    ///
    /// A TLS cluster also listens on a Unix socket in its own directory
    /// (mode 0700, so only this process's user and root reach it), which
    /// the kit's own connections use: [`url`](Cluster::url),
    /// [`config`](Cluster::config), [`TestDb::on`](crate::TestDb::on) and the
    /// readiness probe work with `NoTls` whatever the mode. Tests reach the
    /// server over TCP with TLS through [`tcp_url`](Cluster::tcp_url) and
    /// [`tcp_config`](Cluster::tcp_config). Generating the certificates
    /// costs a few milliseconds: a TLS cluster starts as fast as a plain one.
    ///
    /// # Errors
    ///
    /// `InvalidInput` for unusable options (named in the message), or when
    /// the cluster's directory is too long for a Unix socket path (set
    /// `PGELECT_TEST_TMPDIR` to a shorter one); otherwise as
    /// [`Cluster::start`].
    pub fn start_with(options: ClusterOptions) -> io::Result<Cluster> {
        options.validate()?;
        match Self::start_once(&options, true, None, TEST_PASSWORD) {
            Err((e, true)) => {
                eprintln!("pgelect-testkit: retrying without the initdb template: {e}");
                Self::start_once(&options, false, None, TEST_PASSWORD).map_err(|(e, _)| e)
            }
            other => other.map_err(|(e, _)| e),
        }
    }

    /// A plain cluster whose data directory `make_data(dir, data)` creates
    /// (a base backup, for [`ReplicaSet`](crate::ReplicaSet)), configured
    /// by it too; started like any other. `password` is the superuser's
    /// password in that data (a base backup carries the primary's).
    pub(crate) fn start_from(make_data: &MakeData<'_>, password: &str) -> io::Result<Cluster> {
        Self::start_once(&ClusterOptions::default(), false, Some(make_data), password)
            .map_err(|(e, _)| e)
    }

    /// One attempt; the flag in the error says the template was to blame.
    fn start_once(
        options: &ClusterOptions,
        use_template: bool,
        make_data: Option<&MakeData<'_>>,
        password: &str,
    ) -> Result<Cluster, (io::Error, bool)> {
        let t0 = std::time::Instant::now();
        let bin = pg_bin_dir().map_err(|e| (e, false))?;
        let dir = make_temp_dir("pg").map_err(|e| (e, false))?;
        let reaper = match Reaper::spawn(&dir, "QUIT") {
            Ok(r) => r,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err((e, false));
            }
        };
        let mut cluster = Cluster {
            data: dir.join("data"),
            dir,
            bin,
            port: 0,
            template: None,
            tls: None,
            password: Mutex::new(password.to_owned()),
            state: Mutex::new(State {
                postmaster: None,
                reaper: Some(reaper),
            }),
        };
        // From here on, dropping `cluster` cleans everything up.
        if let Some(mode) = &options.tls {
            cluster.tls = Some(cluster.make_tls(mode, options).map_err(|e| (e, false))?);
        }
        match make_data {
            Some(make) => make(&cluster.dir, &cluster.data).map_err(|e| (e, false))?,
            None => {
                cluster.init(use_template).map_err(|e| (e, false))?;
                cluster.configure().map_err(|e| (e, false))?;
            }
        }
        let t_init = t0.elapsed();
        let mut clash = None;
        for _ in 0..10 {
            cluster.port = free_port();
            match cluster.spawn_postmaster() {
                Ok(()) => {
                    if std::env::var_os("PGELECT_TESTKIT_DEBUG").is_some() {
                        eprintln!(
                            "pgelect-testkit: {} cluster on port {} ready in {:?} \
                             (data dir {:?} via {}, server start {:?})",
                            match &cluster.tls {
                                Some(tls) => format!("{:?}", tls.mode),
                                None => "plain".to_owned(),
                            },
                            cluster.port,
                            t0.elapsed(),
                            t_init,
                            if cluster.template.is_some() {
                                "template copy"
                            } else if make_data.is_some() {
                                "base backup"
                            } else {
                                "initdb"
                            },
                            t0.elapsed() - t_init,
                        );
                    }
                    return Ok(cluster);
                }
                Err(e) if e.is_port_clash() => clash = Some(e),
                Err(ReadyError::Exited(msg)) if cluster.tls.is_some() && is_tls_failure(&msg) => {
                    // Our TLS settings, not the template, are to blame: keep it.
                    let hint = if msg.contains("SSL is not supported by this build") {
                        "; these server binaries were built without OpenSSL, \
                         which TLS clusters need (see PGELECT_PG_BIN)"
                    } else {
                        ""
                    };
                    let e = err(format!("postgres refused its TLS settings{hint}: {msg}"));
                    return Err((e, false));
                }
                Err(ReadyError::Exited(msg)) if cluster.template.is_some() => {
                    // Probably a corrupt template, which would break every
                    // later cluster: discard it (the retry runs initdb).
                    let template = cluster.template.take().unwrap_or_default();
                    discard_template(&template);
                    let e = err(format!(
                        "postgres failed to start from template {} (discarded): {msg}",
                        template.display()
                    ));
                    return Err((e, true));
                }
                Err(e) => return Err((ctx(e.into_io(), "postgres failed to start"), false)),
            }
        }
        let e = clash.map_or_else(|| err("no attempt"), ReadyError::into_io);
        Err((
            ctx(e, "postgres could not bind a free port after 10 attempts"),
            false,
        ))
    }

    /// The cluster shared by all tests of this process, started on first
    /// use. It is never dropped; its reaper kills it and removes its
    /// directory when the process exits.
    ///
    /// Note that cargo-nextest runs each test in its own process, so there
    /// this is one cluster per test.
    ///
    /// # Panics
    ///
    /// If the cluster cannot be started (every call panics with the same
    /// message, including the cause and how to install PostgreSQL).
    pub fn shared() -> &'static Cluster {
        static SHARED: OnceLock<Result<Cluster, String>> = OnceLock::new();
        match SHARED.get_or_init(|| Cluster::start().map_err(|e| e.to_string())) {
            Ok(cluster) => cluster,
            Err(e) => panic!(
                "pgelect-testkit: cannot start the shared PostgreSQL test cluster: {e}\n\
                 (set PGELECT_TEST_DATABASE_URL to use an existing server instead)"
            ),
        }
    }

    /// The TCP port the server listens on (stable across
    /// [`start_again`](Cluster::start_again)).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The host the server listens on: `"127.0.0.1"`.
    pub fn host(&self) -> &str {
        HOST
    }

    /// The server's socket address (`127.0.0.1:port`), e.g. as the upstream of a
    /// [`FaultProxy`](crate::FaultProxy).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `postgres://postgres:PASSWORD@127.0.0.1:PORT/<database>` (superuser),
    /// for the kit's and the tests' plain connections.
    ///
    /// On a TLS cluster the host is instead the kit's private Unix socket
    /// directory (percent-encoded, as libpq and tokio-postgres read it), so
    /// that `NoTls` connections work in every [`TlsMode`]; use
    /// [`tcp_url`](Cluster::tcp_url) to go over TCP and TLS.
    pub fn url(&self, database: &str) -> String {
        let host = match &self.tls {
            Some(_) => percent_encode(&self.dir.to_string_lossy()),
            None => HOST.to_owned(),
        };
        format!(
            "postgres://{}:{}@{host}:{}/{}",
            percent_encode(SUPERUSER),
            percent_encode(&self.password()),
            self.port,
            percent_encode(database)
        )
    }

    /// A connection config for `database` as the superuser. No connect
    /// timeout is set (tokio's timers misbehave under a paused test clock);
    /// add one if needed.
    ///
    /// On a TLS cluster it goes through the kit's private Unix socket, like
    /// [`url`](Cluster::url).
    pub fn config(&self, database: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        match &self.tls {
            Some(_) => config.host_path(&self.dir),
            None => config.host(HOST),
        };
        config
            .port(self.port)
            .user(SUPERUSER)
            .password(self.password())
            .dbname(database);
        config
    }

    /// `postgres://postgres:PASSWORD@HOST:PORT/<database>` over TCP, with no
    /// query string (append `?sslmode=…&sslrootcert=…`). `HOST` is
    /// `localhost` on a TLS cluster (a DNS name of the server certificate,
    /// so `verify-full` passes; `localhost` must resolve to `127.0.0.1`, as
    /// it does on Linux), `127.0.0.1` on a plain one.
    pub fn tcp_url(&self, database: &str) -> String {
        self.tcp_url_as(SUPERUSER, Some(&self.password()), database)
    }

    /// Like [`tcp_url`](Cluster::tcp_url), as `user` with `password` (or none,
    /// e.g. for the [`TlsMode::ClientCert`] user).
    pub fn tcp_url_as(&self, user: &str, password: Option<&str>, database: &str) -> String {
        let password = password.map_or_else(String::new, |p| format!(":{}", percent_encode(p)));
        format!(
            "postgres://{}{password}@{}:{}/{}",
            percent_encode(user),
            self.tcp_host(),
            self.port,
            percent_encode(database)
        )
    }

    /// A superuser config for `database` over TCP, to the host of
    /// [`tcp_url`](Cluster::tcp_url) (connect it with a TLS connector on a
    /// TLS cluster). No connect timeout is set.
    pub fn tcp_config(&self, database: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host(self.tcp_host())
            .port(self.port)
            .user(SUPERUSER)
            .password(self.password())
            .dbname(database);
        config
    }

    fn tcp_host(&self) -> &'static str {
        if self.tls.is_some() {
            TLS_HOST
        } else {
            HOST
        }
    }

    /// The TLS mode, or `None` for a plain cluster.
    pub fn tls_mode(&self) -> Option<&TlsMode> {
        self.tls.as_ref().map(|tls| &tls.mode)
    }

    /// The certificates of a TLS cluster (its CA, server and client
    /// certificates, in `<cluster dir>/tls`), or `None` for a plain
    /// cluster. Their client user is the [`TlsMode::ClientCert`] user, else
    /// [`SUPERUSER`].
    pub fn certs(&self) -> Option<&TestCerts> {
        self.tls.as_ref().map(|tls| &tls.certs)
    }

    /// The directory of the kit's private Unix socket (`.s.PGSQL.<port>`)
    /// on a TLS cluster, `None` on a plain one (which has no socket).
    pub fn socket_dir(&self) -> Option<&Path> {
        self.tls.as_ref().map(|_| self.dir.as_path())
    }

    /// Changes the superuser's password (`ALTER ROLE`) from now on, for a
    /// cluster that must not accept the well-known [`TEST_PASSWORD`] (the
    /// `pgelect demo`); [`url`](Cluster::url) and
    /// [`config`](Cluster::config) use the new one. A
    /// [`PgBouncer`](crate::PgBouncer) started afterwards in front of the
    /// cluster uses it too; one started before still expects the old one.
    ///
    /// # Errors
    ///
    /// If the server cannot be reached or refuses the statement (within 10 s).
    pub fn set_superuser_password(&self, password: &str) -> io::Result<()> {
        let mut config = self.config("postgres");
        config.connect_timeout(Duration::from_secs(5));
        let sql = format!(
            "ALTER ROLE {} PASSWORD {}",
            util::quote_ident(SUPERUSER),
            util::quote_literal(password)
        );
        block_on_fresh_runtime(Duration::from_secs(10), move || async move {
            util::simple_rows(config, &sql).await.map(drop)
        })
        .map_err(|e| ctx(e, "set the superuser password"))?;
        *self.password.lock().unwrap_or_else(PoisonError::into_inner) = password.to_owned();
        Ok(())
    }

    /// The superuser's current password.
    pub(crate) fn password(&self) -> String {
        self.password
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops the server (`pg_ctl stop -m fast`: clients are disconnected,
    /// then a clean shutdown) and waits until it has exited. A no-op if it
    /// is not running.
    ///
    /// # Errors
    ///
    /// If `pg_ctl` fails or times out (the server is then killed).
    pub fn stop(&self) -> io::Result<()> {
        self.pg_ctl_stop("fast")
    }

    /// Stops the server immediately (`pg_ctl stop -m immediate`: like a
    /// crash, the next start runs crash recovery) and waits until it has
    /// exited. A no-op if it is not running.
    ///
    /// # Errors
    ///
    /// If `pg_ctl` fails or times out (the server is then killed).
    pub fn kill(&self) -> io::Result<()> {
        self.pg_ctl_stop("immediate")
    }

    /// Starts the server again after [`stop`](Cluster::stop) or
    /// [`kill`](Cluster::kill), on the same port; returns once it answers a
    /// query.
    ///
    /// # Errors
    ///
    /// `AlreadyExists` if it is running; otherwise if it does not start
    /// within 30 s (e.g. another process took the port meanwhile), with the
    /// log tail.
    pub fn start_again(&self) -> io::Result<()> {
        self.spawn_postmaster()
            .map_err(|e| ctx(e.into_io(), "restart postgres"))
    }

    /// [`stop`](Cluster::stop) then [`start_again`](Cluster::start_again).
    ///
    /// # Errors
    ///
    /// As those two.
    pub fn restart(&self) -> io::Result<()> {
        self.stop()?;
        self.start_again()
    }

    /// The data directory (contains `server.log`).
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Creates the data directory: copy of the template, or initdb.
    fn init(&mut self, use_template: bool) -> io::Result<()> {
        let use_template = use_template
            && std::env::var_os("PGELECT_TEST_NO_TEMPLATE")
                .is_none_or(|v| v.is_empty() || v == "0");
        if use_template {
            match template(&self.bin) {
                Ok(template) => {
                    let mut cp = Command::new("cp");
                    cp.arg("-a").arg(template.join("data")).arg(&self.data);
                    match run_logged(
                        cp,
                        &self.dir.join("cp.log"),
                        Duration::from_secs(60),
                        "cp -a",
                    ) {
                        Ok(()) => {
                            self.template = Some(template);
                            return Ok(());
                        }
                        Err(e) => {
                            eprintln!("pgelect-testkit: copying the initdb template failed, running initdb: {e}");
                            let _ = fs::remove_dir_all(&self.data);
                        }
                    }
                }
                Err(e) => {
                    eprintln!("pgelect-testkit: no initdb template ({e}), running initdb");
                }
            }
        }
        initdb(&self.bin, &self.dir, &self.data)
    }

    /// Writes `pg_hba.conf` and appends our settings to `postgresql.conf`.
    fn configure(&self) -> io::Result<()> {
        let hba = match &self.tls {
            Some(tls) => tls_pg_hba(&tls.mode),
            None => PG_HBA.to_owned(),
        };
        write_private(&self.data.join("pg_hba.conf"), &hba)?;
        let conf = self.data.join("postgresql.conf");
        let mut f = OpenOptions::new()
            .append(true)
            .open(&conf)
            .map_err(|e| ctx(e, format!("open {}", conf.display())))?;
        f.write_all(SETTINGS.as_bytes())?;
        if let Some(tls) = &self.tls {
            let certs = &tls.certs;
            let path = |p: &Path| conf_quote(&p.to_string_lossy());
            let mut settings = format!(
                "ssl = on\n\
                 ssl_cert_file = {}\n\
                 ssl_key_file = {}\n\
                 unix_socket_directories = {}\n\
                 unix_socket_permissions = 0700\n",
                path(certs.server_cert()),
                path(certs.server_key()),
                path(&self.dir),
            );
            if matches!(tls.mode, TlsMode::ClientCert { .. }) {
                settings.push_str(&format!("ssl_ca_file = {}\n", path(certs.ca_cert())));
            }
            f.write_all(settings.as_bytes())?;
        }
        Ok(())
    }

    /// Generates the certificates of a TLS cluster into `<dir>/tls`, after
    /// checking that the Unix socket path fits.
    fn make_tls(&self, mode: &TlsMode, options: &ClusterOptions) -> io::Result<Tls> {
        // sun_path holds 108 bytes with the terminating NUL.
        let socket = self.dir.join(".s.PGSQL.65535");
        if socket.as_os_str().len() > 107 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the Unix socket path {} of a TLS cluster is longer than 107 bytes: \
                     set PGELECT_TEST_TMPDIR to a shorter directory",
                    socket.display()
                ),
            ));
        }
        let names: Vec<&str> = match &options.server_names {
            Some(names) => names.iter().map(String::as_str).collect(),
            None => DEFAULT_SERVER_NAMES.to_vec(),
        };
        let client_user = match mode {
            TlsMode::ClientCert { user } => user.as_str(),
            _ => SUPERUSER,
        };
        let certs = TestCerts::generate(&self.dir.join("tls"), &names, client_user)?;
        Ok(Tls {
            mode: mode.clone(),
            certs,
        })
    }

    /// What the readiness probe runs: `SHOW data_directory`, and for a
    /// [`TlsMode::ClientCert`] cluster the creation of its user (idempotent),
    /// in the same session: a second connection made a client-certificate
    /// cluster start about 0.1 s slower than the others (debug build).
    fn probe_sql(&self) -> String {
        let mut sql = "SHOW data_directory".to_owned();
        if let Some(Tls {
            mode: TlsMode::ClientCert { user },
            ..
        }) = &self.tls
        {
            if user != SUPERUSER {
                sql.push_str(&format!(
                    "; DO $pgelect_testkit$ BEGIN CREATE ROLE {} LOGIN; \
                     EXCEPTION WHEN duplicate_object THEN NULL; END $pgelect_testkit$",
                    util::quote_ident(user)
                ));
            }
        }
        sql
    }

    /// Spawns `postgres` on `self.port` and waits until it answers.
    fn spawn_postmaster(&self) -> Result<(), ReadyError> {
        let mut st = self.lock();
        if let Some(child) = st.postmaster.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                return Err(ReadyError::Other(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "the cluster is already running",
                )));
            }
        }
        st.postmaster = None;
        // Our postmaster is not running: a leftover lock file (after a crash)
        // could name a recycled pid and make postgres refuse to start.
        let _ = fs::remove_file(self.data.join("postmaster.pid"));
        let log = self.data.join("server.log");
        let (out, from) = open_log(&log).map_err(ReadyError::Other)?;
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(&self.data)
            .arg("-c")
            .arg(format!("port={}", self.port))
            .stdin(Stdio::null())
            .stdout(out.try_clone().map_err(ReadyError::Other)?)
            .stderr(out)
            .current_dir(&self.dir)
            // Own process group: terminal signals aimed at the test process
            // do not hit it, and the reaper can SIGKILL the whole group.
            .process_group(0);
        as_server_user(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| ReadyError::Other(ctx(e, "spawn postgres")))?;
        if let Some(reaper) = st.reaper.as_mut() {
            reaper.watch(child.id());
        }
        let config = self.config("postgres");
        let data = self.data.clone();
        let pid = child.id().to_string();
        let probe_sql = self.probe_sql();
        let ready = util::wait_ready(
            "postgres",
            &mut child,
            self.port,
            START_TIMEOUT,
            &log,
            from,
            || {
                // Like `pg_ctl -w`: our postmaster says "ready" in its lock
                // file once it accepts connections. Checking it first avoids
                // talking to whatever else may listen on the port.
                let lock = fs::read_to_string(data.join("postmaster.pid")).unwrap_or_default();
                let lines: Vec<&str> = lock.lines().map(str::trim).collect();
                if lines.first() != Some(&pid.as_str()) || lines.get(7) != Some(&"ready") {
                    return Err(err("postmaster.pid does not say \"ready\" yet"));
                }
                let config = config.clone();
                let data = data.clone();
                let probe_sql = probe_sql.clone();
                block_on_fresh_runtime(Duration::from_secs(5), move || async move {
                    let mut config = config;
                    config.connect_timeout(Duration::from_secs(2));
                    let rows = util::simple_rows(config, &probe_sql).await?;
                    let found = rows.first().and_then(|r| r.first().cloned().flatten());
                    // Guard against another server that grabbed our port.
                    if found.as_deref() == data.to_str() {
                        Ok(())
                    } else {
                        Err(err(format!(
                            "port is served by another server (data_directory {found:?})"
                        )))
                    }
                })
            },
        );
        match ready {
            Ok(()) => {
                st.postmaster = Some(child);
                Ok(())
            }
            Err(e) => {
                if matches!(child.try_wait(), Ok(None)) {
                    let _ = self.run_pg_ctl_stop("immediate");
                }
                wait_or_kill(&mut child, Duration::from_secs(5));
                if let Some(reaper) = st.reaper.as_mut() {
                    reaper.watch(0);
                }
                Err(e)
            }
        }
    }

    fn pg_ctl_stop(&self, mode: &str) -> io::Result<()> {
        let mut st = self.lock();
        let State { postmaster, reaper } = &mut *st;
        let Some(mut child) = postmaster.take() else {
            return Ok(());
        };
        let result = if child.try_wait()?.is_some() {
            Ok(())
        } else {
            let r = self.run_pg_ctl_stop(mode);
            if wait_timeout(&mut child, Duration::from_secs(10))?.is_none() {
                wait_or_kill(&mut child, Duration::ZERO);
                r.and(Err(err(
                    "postgres did not exit after pg_ctl stop; killed it",
                )))
            } else {
                // pg_ctl may complain although the server did stop.
                Ok(())
            }
        };
        if let Some(reaper) = reaper.as_mut() {
            reaper.watch(0);
        }
        result
    }

    fn run_pg_ctl_stop(&self, mode: &str) -> io::Result<()> {
        let mut cmd = Command::new(self.bin.join("pg_ctl"));
        cmd.arg("stop")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", mode, "-w", "-t", "20"])
            .current_dir(&self.dir);
        as_server_user(&mut cmd);
        run_logged(
            cmd,
            &self.dir.join("pg_ctl.log"),
            Duration::from_secs(25),
            &format!("pg_ctl stop -m {mode}"),
        )
    }
}

impl Drop for Cluster {
    /// Stops the server (`-m immediate`) and removes its directory.
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let (postmaster, reaper) = (st.postmaster.take(), st.reaper.take());
        let mut stopped = true;
        if let Some(mut child) = postmaster {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = self.run_pg_ctl_stop("immediate");
            }
            if !matches!(
                wait_timeout(&mut child, Duration::from_secs(5)),
                Ok(Some(_))
            ) {
                // Leave the pid to the reaper, which kills the process group.
                stopped = false;
                wait_or_kill(&mut child, Duration::ZERO);
            }
        }
        if let Some(mut reaper) = reaper {
            if stopped {
                reaper.watch(0);
            }
            reaper.finish(Duration::from_secs(30));
        }
        if self.dir.exists() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Runs initdb into `data` (inside `dir`, owned by the server user).
fn initdb(bin: &Path, dir: &Path, data: &Path) -> io::Result<()> {
    let pwfile = dir.join("pwfile");
    write_private(&pwfile, TEST_PASSWORD)?;
    let mut cmd = Command::new(bin.join("initdb"));
    cmd.arg("-D")
        .arg(data)
        .args(INITDB_ARGS)
        .arg(format!("--pwfile={}", pwfile.display()))
        .env_remove("PGDATA")
        .current_dir(dir);
    as_server_user(&mut cmd);
    let result = run_logged(
        cmd,
        &dir.join("initdb.log"),
        Duration::from_secs(120),
        "initdb",
    );
    let _ = fs::remove_file(&pwfile);
    result
}

/// FNV-1a, for cache keys.
fn fnv(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain([0]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Whether `template` is a complete template owned by the server user.
fn template_ok(template: &Path) -> bool {
    template.join("complete").is_file()
        && template.join("data/PG_VERSION").is_file()
        && template.join("data/global/pg_control").is_file()
        && fs::metadata(template).is_ok_and(|m| m.uid() == util::server_uid())
}

/// Moves a template out of the way and deletes it.
fn discard_template(template: &Path) {
    let trash = template.with_extension(format!("discarded-{}", util::random_u64()));
    if fs::rename(template, &trash).is_ok() {
        let _ = fs::remove_dir_all(&trash);
    }
}

/// The machine-wide initdb template for these binaries, created on first
/// use: `initdb` into a private directory, then an atomic `rename` to
/// `<base_dir>/pgelect-testkit-template-v1-<version>-uid<uid>-<hash>`. When
/// several processes race, one rename wins and the others discard their
/// copy.
pub(crate) fn template(bin: &Path) -> io::Result<PathBuf> {
    let out = Command::new(bin.join("postgres"))
        .arg("-V")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| ctx(e, "postgres -V"))?;
    let version: String = String::from_utf8_lossy(&out.stdout)
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(60)
        .collect();
    if !out.status.success() || version.is_empty() {
        return Err(err("postgres -V failed"));
    }
    let hash = fnv(&[
        &bin.to_string_lossy(),
        TEST_PASSWORD,
        &INITDB_ARGS.join(" "),
    ]);
    let template = util::base_dir().join(format!(
        "pgelect-testkit-template-v1-{version}-uid{}-{hash:016x}",
        util::server_uid()
    ));
    if template_ok(&template) {
        return Ok(template);
    }
    if template.exists() {
        discard_template(&template);
    }
    let tmp = make_temp_dir("template-build")?;
    let reaper = Reaper::spawn(&tmp, "TERM")?;
    let built = initdb(bin, &tmp, &tmp.join("data")).and_then(|()| {
        let marker = tmp.join("complete");
        fs::write(&marker, "ok\n")?;
        chown_to_server(&marker)
    });
    if built.is_ok() {
        // Fails if another process won the race: fine, use theirs.
        let _ = fs::rename(&tmp, &template);
    }
    reaper.finish(Duration::from_secs(30)); // removes `tmp` unless renamed
    built?;
    if template_ok(&template) {
        Ok(template)
    } else {
        Err(err(format!(
            "template {} is incomplete after creation",
            template.display()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::log_tail;

    /// The servers must not inherit the write end of their reaper's pipe,
    /// or the reaper would never see EOF.
    #[test]
    fn server_does_not_inherit_reaper_pipe() {
        let cluster = Cluster::start().unwrap();
        let fd = cluster.lock().reaper.as_ref().unwrap().stdin_fd().unwrap();
        let pipe = fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
        assert!(pipe.to_string_lossy().starts_with("pipe:"), "{pipe:?}");
        let pid = cluster.lock().postmaster.as_ref().unwrap().id();
        let fds = match fs::read_dir(format!("/proc/{pid}/fd")) {
            Ok(fds) => fds,
            Err(e) => {
                eprintln!("cannot inspect /proc/{pid}/fd ({e}); skipping");
                return;
            }
        };
        let mut n = 0;
        for entry in fds.flatten() {
            n += 1;
            let target = fs::read_link(entry.path()).unwrap_or_default();
            assert_ne!(target, pipe, "postmaster holds the reaper pipe");
        }
        assert!(n > 0);
    }

    #[test]
    fn tls_pg_hba_per_mode() {
        let offered = tls_pg_hba(&TlsMode::Offered);
        assert!(offered.starts_with("local   all       all                 scram-sha-256\n"));
        assert!(offered.ends_with(PG_HBA));
        assert!(!offered.contains("hostssl") && !offered.contains("reject"));

        let required = tls_pg_hba(&TlsMode::Required);
        let tcp: Vec<&str> = required
            .lines()
            .filter(|l| !l.starts_with("local"))
            .collect();
        assert!(
            tcp.iter()
                .all(|l| l.starts_with("hostssl ") || l.starts_with("hostnossl ")),
            "{required}"
        );
        assert!(required.contains("hostnossl all         all  0.0.0.0/0     reject"));

        let cert = tls_pg_hba(&TlsMode::ClientCert {
            user: "alice".into(),
        });
        let lines: Vec<&str> = cert.lines().collect();
        assert_eq!(lines[1], "hostssl all       \"alice\" 127.0.0.1/32  cert");
        assert_eq!(lines[2], "hostssl all       \"alice\" ::1/128       cert");
        assert!(cert.ends_with(REQUIRED_HBA));
    }

    #[test]
    fn options_validate() {
        assert!(ClusterOptions::new().validate().is_ok());
        assert!(ClusterOptions::new()
            .tls(TlsMode::Required)
            .server_names(["a.test"])
            .validate()
            .is_ok());
        for bad in [
            ClusterOptions::new().server_names(["localhost"]),
            ClusterOptions::new()
                .tls(TlsMode::Offered)
                .server_names(Vec::<String>::new()),
            ClusterOptions::new().tls(TlsMode::ClientCert {
                user: String::new(),
            }),
            ClusterOptions::new().tls(TlsMode::ClientCert {
                user: "a\nb".into(),
            }),
        ] {
            let e = bad.validate().unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
    }

    #[test]
    fn log_tail_reports_lines() {
        let cluster = Cluster::shared();
        let tail = log_tail(&cluster.data_dir().join("server.log"), 0, 20);
        assert!(tail.contains("ready to accept connections"), "{tail}");
    }
}
