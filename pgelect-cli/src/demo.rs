//! `pgelect demo`: a throwaway PostgreSQL, three candidates, the leader
//! killed, the failover timed; then a planned resign, timed.

use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::cli::Global;
use crate::exit::{self, Failure};

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How many candidates stand for the role.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(2..=16))]
    pub candidates: u8,
    /// The candidates' lease TTL.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "5s", value_name = "DURATION", allow_hyphen_values = true)]
    pub ttl: Duration,
    /// After the demo, keep the throwaway PostgreSQL running for trying
    /// things by hand: prints how to reach it (its URL is in a private file,
    /// for --database-url-file) and waits; Ctrl-C or SIGTERM stops and
    /// removes it.
    #[arg(long)]
    pub keep: bool,
}

const ROLE: &str = "demo";
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// A duty line: a candidate's command announcing that it runs as leader.
#[derive(Debug)]
struct Duty {
    node: String,
    term: i64,
    at_unix_ns: u128,
}

struct Candidate {
    name: String,
    process: Child,
}

pub async fn run(global: &Global, args: DemoArgs) -> Result<u8, Failure> {
    let mut signals = crate::signals::Signals::install()?;
    // Only a database named on the command line: a DATABASE_URL that
    // happens to be set could be production.
    let (url, cluster) = match global.explicit_url()? {
        Some((url, flag)) => {
            println!(
                "• using the database at {} (from {flag})",
                pgelect::ConnectOptions::from_url(&url)?.target()
            );
            (url, None)
        }
        None => {
            if std::env::var_os("DATABASE_URL").is_some_and(|v| !v.is_empty())
                || std::env::var_os("PGELECT_DATABASE_URL_FILE").is_some_and(|v| !v.is_empty())
            {
                println!("• DATABASE_URL / PGELECT_DATABASE_URL_FILE is set but not used: the demo runs only against a database named with --database-url or --database-url-file");
            }
            let (url, server) = throwaway::start().await?;
            (url, Some(server))
        }
    };
    let options = pgelect::ConnectOptions::from_url(&url)?.schema(&global.schema)?;
    pgelect::migrate(&options).await?;
    println!("• schema {} installed", options.schema_name());
    let secret = UrlFile::write(&url)?;
    println!(
        "• the candidates read the URL from {} (mode 0600), never from their command line",
        secret.path().display()
    );

    let outcome = tokio::select! {
        r = scenario(secret.path(), &options, &args) => r,
        sig = signals.recv() => Err(Failure::new(exit::TEMPFAIL, format!("interrupted by {sig}; cleaning up"))),
    };
    if let (Ok(_), true, Some(server)) = (&outcome, args.keep, &cluster) {
        println!("• candidates stopped; the throwaway PostgreSQL keeps running on 127.0.0.1:{} until you press Ctrl-C here (or send SIGTERM to pid {}), then it is removed. Try, from another shell:", server.port(), std::process::id());
        let file = secret.path().display();
        println!("    pgelect --database-url-file {file} status");
        println!("    pgelect --database-url-file {file} run --role mine -- sleep 1000");
        println!("    pgelect --database-url-file {file} lock --key deploy -- sleep 30");
        println!("  (the URL, with this run's random superuser password, is in {file}, mode 0600)");
        let sig = signals.recv().await;
        println!("• {sig} received: stopping the throwaway PostgreSQL");
    }
    drop(secret);
    if let Some(server) = cluster {
        server.stop();
    }
    if outcome.is_ok() {
        println!("• candidates stopped, throwaway PostgreSQL removed. Done.");
    }
    outcome
}

/// 128 random bits as hex, from the kernel.
fn random_password() -> Result<String, Failure> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| Failure::new(exit::SOFTWARE, format!("cannot read /dev/urandom: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The database URL in a file only this user can read (mode 0600, in a
/// directory of mode 0700), removed on drop: how the candidates get it.
pub(crate) struct UrlFile {
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
}

impl UrlFile {
    pub(crate) fn write(url: &str) -> Result<UrlFile, Failure> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let fail = |e: std::io::Error| {
            Failure::new(
                exit::SOFTWARE,
                format!("cannot write the private URL file: {e}"),
            )
        };
        let dir = std::env::temp_dir().join(format!(
            "pgelect-demo-{}-{}",
            std::process::id(),
            random_password()?.get(..8).unwrap_or_default()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(fail)?;
        let file = UrlFile {
            path: dir.join("database-url"),
            dir,
        };
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&file.path)
            .and_then(|mut f| f.write_all(url.as_bytes()))
            .map_err(fail)?;
        Ok(file)
    }

    pub(crate) fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The private directory (mode 0700) the file is in, removed with it.
    pub(crate) fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for UrlFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Variables a candidate must not inherit: the URL comes from its file, and
/// a DATABASE_URL of the demo's environment may name another database.
const SCRUBBED_ENV: [&str; 9] = [
    "DATABASE_URL",
    "PGELECT_DATABASE_URL_FILE",
    "PGELECT_LISTEN_URL",
    "PGELECT_LISTEN_URL_FILE",
    "PGPASSWORD",
    "PGHOST",
    "PGUSER",
    "PGDATABASE",
    "PGPORT",
];

async fn scenario(
    url_file: &std::path::Path,
    options: &pgelect::ConnectOptions,
    args: &DemoArgs,
) -> Result<u8, Failure> {
    let exe = std::env::current_exe().map_err(|e| {
        Failure::new(
            exit::SOFTWARE,
            format!("cannot find the pgelect executable: {e}"),
        )
    })?;
    let (duty_tx, mut duties) = mpsc::unbounded_channel::<Duty>();
    let mut candidates = Vec::new();
    println!(
        "• starting {} candidates for role {ROLE:?} (ttl {}), each `pgelect run` with a command that announces itself",
        args.candidates,
        crate::duration::show(args.ttl)
    );
    let started = Instant::now();
    for i in 1..=args.candidates {
        let name = format!("candidate-{i}");
        let mut cmd = Command::new(&exe);
        cmd.args(["run", "--role", ROLE, "--id", &name, "--ttl"])
            .arg(crate::duration::show(args.ttl))
            .arg("--database-url-file")
            .arg(url_file)
            .args(["--schema", options.schema_name().as_str(), "-q", "--"])
            .args([
                "sh",
                "-c",
                "echo DUTY $PGELECT_NODE $PGELECT_TERM $(date +%s%N); exec sleep 86400",
            ])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .process_group(0);
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        let mut process = cmd
            .spawn()
            .map_err(|e| Failure::new(exit::SOFTWARE, format!("cannot start a candidate: {e}")))?;
        let stdout = process.stdout.take().expect("BUG: piped stdout");
        let tx = duty_tx.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let parts: Vec<&str> = line.split_whitespace().collect();
                if let ["DUTY", node, term, ns] = parts[..] {
                    if let (Ok(term), Ok(at_unix_ns)) = (term.parse(), ns.parse()) {
                        let _ = tx.send(Duty {
                            node: node.to_owned(),
                            term,
                            at_unix_ns,
                        });
                    }
                }
            }
        });
        candidates.push(Candidate { name, process });
    }

    let first = next_duty(&mut duties).await?;
    println!(
        "• {} leads with term {} ({} ms after the candidates started)",
        first.node,
        first.term,
        started.elapsed().as_millis()
    );
    show_status(options).await;

    // 1. A crash: SIGKILL the leader's supervisor (its command dies with it).
    let leader = candidates
        .iter_mut()
        .find(|c| c.name == first.node)
        .ok_or_else(|| Failure::new(exit::SOFTWARE, "the leader is not one of the candidates"))?;
    println!(
        "• killing {} with SIGKILL: no goodbye, like a machine that died",
        first.node
    );
    let observer = Observer::connect(options).await?;
    let killed_at = now_ns();
    let killed = Instant::now();
    leader
        .process
        .start_kill()
        .map_err(|e| Failure::new(exit::SOFTWARE, format!("cannot kill the leader: {e}")))?;
    let _ = leader.process.wait().await;
    let term_seen = observer.wait_for_new_term(first.term).await?;
    let second = next_duty(&mut duties).await?;
    let acted_ms = (second.at_unix_ns.saturating_sub(killed_at)) as f64 / 1e6;
    println!(
        "• {} leads with term {}: the new term was recorded {} ms after the kill; its command started {:.0} ms after the kill",
        second.node,
        second.term,
        term_seen.saturating_duration_since(killed).as_millis(),
        acted_ms
    );
    println!(
        "  (after an unclean loss the new leader first bumps the term, so writes fenced with term {} fail at once,\n   then waits the handover delay ({} ms here), long enough for a live old leader to have noticed, before it acts)",
        first.term,
        handover_delay(options, args.ttl).as_millis()
    );
    show_stale_fence(options, first.term).await;

    // 2. A planned handover: ask the leader to resign.
    println!(
        "• asking {} to resign (planned handover, like a rolling deploy)",
        second.node
    );
    let asked_at = now_ns();
    pgelect::admin::request_resign(options, ROLE).await?;
    let third = next_duty(&mut duties).await?;
    println!(
        "• {} leads with term {}: its command started {:.0} ms after the request (clean release: no handover delay)",
        third.node,
        third.term,
        third.at_unix_ns.saturating_sub(asked_at) as f64 / 1e6
    );
    show_status(options).await;

    for c in &mut candidates {
        crate::child::signal_pid(c.process.id(), nix::sys::signal::Signal::SIGTERM as i32);
    }
    for c in &mut candidates {
        let _ = tokio::time::timeout(Duration::from_secs(15), c.process.wait()).await;
    }
    Ok(0)
}

async fn next_duty(duties: &mut mpsc::UnboundedReceiver<Duty>) -> Result<Duty, Failure> {
    match tokio::time::timeout(STEP_TIMEOUT, duties.recv()).await {
        Ok(Some(d)) => Ok(d),
        Ok(None) => Err(Failure::new(exit::SOFTWARE, "every candidate exited")),
        Err(_) => Err(Failure::new(
            exit::SOFTWARE,
            format!("no leader within {}s", STEP_TIMEOUT.as_secs()),
        )),
    }
}

/// A connection opened before the kill, so that its set-up is not timed.
struct Observer {
    admin: pgelect::admin::AdminClient,
}

impl Observer {
    async fn connect(options: &pgelect::ConnectOptions) -> Result<Observer, Failure> {
        let admin = pgelect::admin::AdminClient::connect(options).await?;
        Ok(Observer { admin })
    }

    /// Polls the lease row (every 2 ms, bounded) until the term moves past `old`.
    async fn wait_for_new_term(&self, old: i64) -> Result<Instant, Failure> {
        let deadline = Instant::now() + STEP_TIMEOUT;
        while Instant::now() < deadline {
            let term = self.admin.lease_row(ROLE).await?.map(|row| row.term.get());
            if term.is_some_and(|term| term > old) {
                return Ok(Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Err(Failure::new(exit::SOFTWARE, "no new term after the kill"))
    }
}

async fn show_stale_fence(options: &pgelect::ConnectOptions, stale: i64) {
    let Ok(client) = crate::db::connect(options).await else {
        return;
    };
    let schema = options.schema_name().as_str();
    let sql = format!("SELECT {schema}.fence($1, $2)");
    match client
        .query_typed(
            &sql,
            &[
                (&ROLE, tokio_postgres::types::Type::TEXT),
                (&stale, tokio_postgres::types::Type::INT8),
            ],
        )
        .await
    {
        Err(e) => println!(
            "  a transaction fenced with the old term {stale} is refused: {}",
            e.as_db_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_else(|| e.to_string())
        ),
        Ok(_) => println!("  UNEXPECTED: a write fenced with the old term {stale} was accepted"),
    }
}

async fn show_status(options: &pgelect::ConnectOptions) {
    if let Ok(text) = crate::status::snapshot(options, Some(ROLE)).await {
        for line in text.lines() {
            println!("    {line}");
        }
    }
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// The handover delay the candidates use (the library's default for `ttl`).
fn handover_delay(options: &pgelect::ConnectOptions, ttl: Duration) -> Duration {
    pgelect::Elector::builder(options.clone(), ROLE)
        .ttl(ttl)
        .build()
        .map(|e| e.handover_delay())
        .unwrap_or_default()
}

/// The throwaway server, when this build has one (feature `throwaway`).
#[cfg(feature = "throwaway")]
pub(crate) mod throwaway {
    use std::time::Instant;

    use super::random_password;
    use crate::exit::{self, Failure};

    /// A running throwaway cluster; dropping it stops and removes it.
    pub struct Server(pgelect_testkit::Cluster, Option<std::path::PathBuf>);

    impl Server {
        /// Stops the server and removes its directory, and the demo's own
        /// directory for the test kit (its initdb template included).
        pub fn stop(self) {
            drop(self.0);
            if let Some(dir) = self.1 {
                let _ = std::fs::remove_dir_all(dir);
            }
        }

        pub fn port(&self) -> u16 {
            self.0.port()
        }

        /// The cluster, for a PgBouncer in front of it (`pgelect chaos`).
        pub fn cluster(&self) -> &pgelect_testkit::Cluster {
            &self.0
        }

        /// Whether PostgreSQL program `name` is installed beside this
        /// server's; `Err` says where it was looked for.
        pub fn has_program(&self, name: &str) -> Result<(), String> {
            match pgelect_testkit::pg_bin_dir() {
                Ok(dir) if dir.join(name).is_file() => Ok(()),
                Ok(dir) => Err(format!("{name} is not in {}", dir.display())),
                Err(e) => Err(format!("{name} not found: {e}")),
            }
        }

        /// Stops the server (`pg_ctl stop -m fast`, or `immediate`: a crash
        /// and recovery) and starts it again on the same port; returns once
        /// it answers. Blocks this worker thread meanwhile.
        pub fn restart(&self, immediate: bool) -> Result<(), Failure> {
            tokio::task::block_in_place(|| {
                if immediate {
                    self.0.kill()?;
                } else {
                    self.0.stop()?;
                }
                self.0.start_again()
            })
            .map_err(|e| {
                Failure::new(
                    exit::UNAVAILABLE,
                    format!("cannot restart the throwaway PostgreSQL: {e}"),
                )
            })
        }

        /// Also listens on `addr` and accepts password logins from `cidr`
        /// (for `pgelect chaos`'s network namespaces); restarts the server.
        pub async fn listen_also(
            self,
            addr: std::net::Ipv4Addr,
            cidr: String,
        ) -> Result<Server, Failure> {
            let Server(cluster, base) = self;
            let data = cluster.data_dir().to_owned();
            let append = |file: &str, line: String| {
                use std::io::Write;
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(data.join(file))
                    .and_then(|mut f| f.write_all(line.as_bytes()))
                    .map_err(|e| Failure::new(exit::SOFTWARE, format!("cannot edit {file}: {e}")))
            };
            append(
                "postgresql.conf",
                format!("\nlisten_addresses = '127.0.0.1,{addr}'\n"),
            )?;
            append(
                "pg_hba.conf",
                format!("\nhost all all {cidr} scram-sha-256\n"),
            )?;
            let cluster = tokio::task::spawn_blocking(move || cluster.restart().map(|()| cluster))
                .await
                .map_err(|e| Failure::new(exit::SOFTWARE, format!("the restart task failed: {e}")))?
                .map_err(|e| {
                    Failure::new(
                        exit::UNAVAILABLE,
                        format!("cannot restart the throwaway PostgreSQL on {addr}: {e}"),
                    )
                })?;
            Ok(Server(cluster, base))
        }
    }

    /// A directory of the demo's own for the test kit's server and its
    /// cached initdb template (28 MB), removed at the end, unless
    /// `PGELECT_TEST_TMPDIR` names one: left alone, the kit would put both
    /// in `/dev/shm` (fast for the test suite, which reuses the template)
    /// and the template would outlive the demo there.
    fn private_base_dir() -> Result<Option<std::path::PathBuf>, Failure> {
        use std::os::unix::fs::DirBuilderExt;
        if std::env::var_os("PGELECT_TEST_TMPDIR").is_some_and(|v| !v.is_empty()) {
            return Ok(None);
        }
        let dir = std::env::temp_dir().join(format!(
            "pgelect-demo-server-{}-{}",
            std::process::id(),
            random_password()?.get(..8).unwrap_or_default()
        ));
        // 0711: the server runs as the postgres user when we are root and
        // must traverse it; what the kit creates inside is private.
        std::fs::DirBuilder::new()
            .mode(0o711)
            .create(&dir)
            .map_err(|e| {
                Failure::new(
                    exit::SOFTWARE,
                    format!("cannot create {}: {e}", dir.display()),
                )
            })?;
        // The kit reads it once, at its first server; nothing else in this
        // process reads the environment concurrently at this point.
        std::env::set_var("PGELECT_TEST_TMPDIR", &dir);
        Ok(Some(dir))
    }

    /// Starts a throwaway PostgreSQL with a random superuser password and
    /// returns its URL.
    pub async fn start() -> Result<(String, Server), Failure> {
        println!("• starting a throwaway PostgreSQL from the system's binaries …");
        let started = Instant::now();
        let base = private_base_dir()?;
        let cluster = tokio::task::spawn_blocking(pgelect_testkit::Cluster::start)
            .await
            .map_err(|e| Failure::new(exit::SOFTWARE, format!("the cluster start task failed: {e}")))?
            .map_err(|e| Failure::new(exit::UNAVAILABLE, format!("cannot start a throwaway PostgreSQL: {e}; install the server with `apt-get install postgresql`, or pass --database-url")))?;
        // The kit's password is public (it is in the source): give this
        // cluster one nobody else knows.
        let password = random_password()?;
        let cluster = tokio::task::spawn_blocking(move || {
            cluster.set_superuser_password(&password).map(|()| cluster)
        })
        .await
        .map_err(|e| Failure::new(exit::SOFTWARE, format!("the password task failed: {e}")))?
        .map_err(|e| {
            Failure::new(
                exit::UNAVAILABLE,
                format!("cannot set the throwaway PostgreSQL's password: {e}"),
            )
        })?;
        println!(
            "  PostgreSQL on 127.0.0.1:{} (data in {}), up in {} ms, superuser password random for this run",
            cluster.port(),
            cluster.data_dir().display(),
            started.elapsed().as_millis()
        );
        Ok((cluster.url("postgres"), Server(cluster, base)))
    }
}

/// Without the feature `throwaway`: say how to get one.
#[cfg(not(feature = "throwaway"))]
pub(crate) mod throwaway {
    use crate::exit::{self, Failure};

    /// Never built.
    pub enum Server {}

    impl Server {
        pub fn stop(self) {
            match self {}
        }

        pub fn port(&self) -> u16 {
            match *self {}
        }

        pub fn has_program(&self, _name: &str) -> Result<(), String> {
            match *self {}
        }

        pub fn restart(&self, _immediate: bool) -> Result<(), Failure> {
            match *self {}
        }

        pub async fn listen_also(
            self,
            _addr: std::net::Ipv4Addr,
            _cidr: String,
        ) -> Result<Server, Failure> {
            match self {}
        }
    }

    pub async fn start() -> Result<(String, Server), Failure> {
        Err(Failure::new(
            exit::CONFIG,
            "this pgelect was built without a throwaway PostgreSQL: pass --database-url or --database-url-file (a database you may experiment in), or install with `cargo install pgelect-cli --features throwaway` (scripts/demo.sh builds with it)",
        ))
    }
}
