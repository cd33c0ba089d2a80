//! The lease backend through a connection pooler.
//!
//! The lease backend's promise is that it works through PgBouncer in
//! transaction mode, so that is where chaos runs it when it can: through
//! the pooler given with `--pooler-url`, or, on its own throwaway server,
//! through a PgBouncer in transaction mode it starts in front of it (the
//! test kit's). The session backend never goes through it: it refuses
//! transaction pooling by design.
//!
//! The supervisors' election statements and their workers' fenced writes
//! go through the pooler (each write a transaction of unnamed statements).
//! Their LISTEN connection (`--listen-url-file`) connects directly: LISTEN
//! needs a session of its own.
//!
//! In the promote phase PgBouncer cannot follow the primary itself (it has
//! no `target_session_attrs`); production puts it in front of an address
//! that does (a virtual IP, HAProxy with health checks, DNS). Chaos starts a
//! second PgBouncer in front of such an address of its own, the pair's
//! primary address ([`start_own_at`]), which it points at the promoted
//! server once the promotion is done; the LISTEN connection keeps the
//! two-host URL.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::candidates::write_private;
use super::fail;
use super::url::UrlParts;
use crate::exit::{self, Failure};
use crate::run::BackendArg;

/// The pooler the lease backend's supervisors connect through.
pub(super) struct Pooler {
    /// How the header line names it.
    pub describe: String,
    /// A private file (mode 0600) with its URL, in the run's private
    /// directory.
    pub file: PathBuf,
    /// Its URL taken apart, for a proxy per supervisor in front of it
    /// (`None` if it is not a single-host `postgres://` URL).
    pub parts: Option<UrlParts>,
    /// The PgBouncer chaos started itself (it may restart it).
    own: Option<Own>,
    /// Transactions it served before its restarts (a restart starts its
    /// counters from zero).
    served_before: AtomicU64,
}

#[cfg(feature = "throwaway")]
type Own = pgelect_testkit::PgBouncer;

/// Never built without the throwaway server.
#[cfg(not(feature = "throwaway"))]
enum Own {}

impl Pooler {
    /// The pooler named with `--pooler-url`: checked to be a URL pgelect
    /// reads, its URL written to `file`.
    pub async fn given(url: &str, file: PathBuf) -> Result<Pooler, Failure> {
        pgelect::ConnectOptions::from_url(url).map_err(|e| {
            Failure::new(
                exit::USAGE,
                format!("--pooler-url is not a URL pgelect can use: {e}"),
            )
        })?;
        write_private(&file, url)?;
        let parts = UrlParts::parse(url).await;
        let describe = match &parts {
            Some(p) => format!("the pooler at {} (--pooler-url)", p.addr),
            None => "the pooler of --pooler-url".to_owned(),
        };
        Ok(Pooler {
            describe,
            file,
            parts,
            own: None,
            served_before: AtomicU64::new(0),
        })
    }

    /// Why `pgbouncer-restart` cannot run on this pooler, if it cannot.
    pub fn not_restartable(&self) -> Option<String> {
        self.own.is_none().then(|| {
            "the pooler of --pooler-url is not chaos's own: only the PgBouncer it starts in front of its throwaway server is restarted".to_owned()
        })
    }

    /// Kills the pooler (SIGKILL: every client and server connection
    /// through it drops) and starts it again on the same port; returns once
    /// a query through it succeeds. Blocks this worker thread meanwhile.
    pub async fn restart(&self) -> Result<(), Failure> {
        let Some(own) = &self.own else {
            return Err(fail("BUG: restart of a pooler that is not ours"));
        };
        let served = transactions(own).await.unwrap_or(0);
        self.served_before.fetch_add(served, Ordering::SeqCst);
        restart_own(own)
    }

    /// How many transactions our own PgBouncer served to its clients
    /// (`SHOW STATS`, database `postgres`, over its restarts): evidence
    /// that the supervisors went through it. `None` for a pooler given with
    /// --pooler-url, or if its console does not answer.
    pub async fn served(&self) -> Option<u64> {
        let now = transactions(self.own.as_ref()?).await?;
        Some(self.served_before.load(Ordering::SeqCst) + now)
    }
}

/// Starts PgBouncer in transaction mode in front of the throwaway server;
/// `Ok(Err(why))` if PgBouncer is not installed.
#[cfg(feature = "throwaway")]
pub(super) async fn start_own(
    server: &crate::demo::throwaway::Server,
    file: PathBuf,
) -> Result<Result<Pooler, String>, Failure> {
    use pgelect_testkit::{PgBouncer, PoolMode};
    start_kit(file, "in front of the throwaway server", || {
        PgBouncer::start(server.cluster(), PoolMode::Transaction)
    })
    .await
}

/// Starts PgBouncer in transaction mode in front of the promote phase's
/// primary address (`127.0.0.1:port`, a front that chaos points at the
/// current primary, as an HA proxy would), whose superuser has `password`;
/// `Ok(Err(why))` if PgBouncer is not installed.
#[cfg(feature = "throwaway")]
pub(super) async fn start_own_at(
    port: u16,
    password: &str,
    file: PathBuf,
) -> Result<Result<Pooler, String>, Failure> {
    use pgelect_testkit::{PgBouncer, PoolMode};
    start_kit(
        file,
        &format!("in front of the primary address 127.0.0.1:{port}"),
        || PgBouncer::start_in_front_of(port, password, PoolMode::Transaction),
    )
    .await
}

/// The test kit's PgBouncer from `start` (synchronous: it waits for a
/// query through it), its URL written to `file`; `Ok(Err(why))` if
/// PgBouncer is not installed. `before` says what it stands in front of.
#[cfg(feature = "throwaway")]
async fn start_kit(
    file: PathBuf,
    before: &str,
    start: impl FnOnce() -> std::io::Result<Own>,
) -> Result<Result<Pooler, String>, Failure> {
    if !pgelect_testkit::pgbouncer_available() {
        return Ok(Err(
            "PgBouncer is not installed (Debian: apt-get install pgbouncer; or set PGELECT_PGBOUNCER to its path)"
                .to_owned(),
        ));
    }
    let bouncer = tokio::task::block_in_place(start).map_err(|e| {
        Failure::new(
            exit::UNAVAILABLE,
            format!("cannot start PgBouncer {before}: {e} (--no-pooler runs the lease backend without it)"),
        )
    })?;
    let url = bouncer.tcp_url("postgres");
    write_private(&file, &url)?;
    let parts = UrlParts::parse(&url).await;
    Ok(Ok(Pooler {
        describe: format!(
            "PgBouncer in transaction mode on 127.0.0.1:{} {before}",
            bouncer.port()
        ),
        file,
        parts,
        own: Some(bouncer),
        served_before: AtomicU64::new(0),
    }))
}

/// `total_xact_count` of database `postgres` in the console's `SHOW
/// STATS` (simple query protocol, as the console requires).
#[cfg(feature = "throwaway")]
async fn transactions(own: &Own) -> Option<u64> {
    let mut config = own.tcp_config("pgbouncer");
    config.connect_timeout(std::time::Duration::from_secs(2));
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.ok()?;
    let task = tokio::spawn(connection);
    let messages = client.simple_query("SHOW STATS").await.ok();
    drop(client);
    let _ = task.await;
    messages?.iter().find_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(r) if r.get("database") == Some("postgres") => {
            r.get("total_xact_count")?.parse().ok()
        }
        _ => None,
    })
}

#[cfg(not(feature = "throwaway"))]
async fn transactions(own: &Own) -> Option<u64> {
    match *own {}
}

#[cfg(not(feature = "throwaway"))]
pub(super) async fn start_own(
    server: &crate::demo::throwaway::Server,
    _file: PathBuf,
) -> Result<Result<Pooler, String>, Failure> {
    match *server {}
}

#[cfg(not(feature = "throwaway"))]
pub(super) async fn start_own_at(
    _port: u16,
    _password: &str,
    _file: PathBuf,
) -> Result<Result<Pooler, String>, Failure> {
    Err(fail(
        "BUG: a pooler for promote without the throwaway server",
    ))
}

#[cfg(feature = "throwaway")]
fn restart_own(own: &Own) -> Result<(), Failure> {
    tokio::task::block_in_place(|| own.restart())
        .map_err(|e| Failure::new(exit::UNAVAILABLE, format!("cannot restart PgBouncer: {e}")))
}

#[cfg(not(feature = "throwaway"))]
fn restart_own(own: &Own) -> Result<(), Failure> {
    match *own {}
}

/// The pooler `backend`'s candidates connect through, or why they connect
/// directly: the lease backend only (the session backend refuses
/// transaction pooling).
pub(super) fn pooler_for(
    backend: BackendArg,
    pooler: &Result<Pooler, String>,
) -> Result<&Pooler, String> {
    match (backend, pooler) {
        (BackendArg::Session, _) => Err(
            "the session backend never connects through a pooler (it refuses transaction pooling)"
                .to_owned(),
        ),
        (BackendArg::Lease, Ok(p)) => Ok(p),
        (BackendArg::Lease, Err(why)) => Err(why.clone()),
    }
}
