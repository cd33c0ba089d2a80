//! Test infrastructure for pgelect, also behind `pgelect demo`'s throwaway server
//! (the command's `throwaway` feature); never needed by the library at run time.
//!
//! Provides, without Docker or downloads:
//!
//! * [`Cluster`]: a throwaway PostgreSQL server (initdb + postgres from the
//!   local installation, see [`pg_bin_dir`]), listening on `127.0.0.1` only,
//!   with SCRAM password authentication ([`SUPERUSER`] / [`TEST_PASSWORD`]).
//! * [`TestDb`]: a fresh database per test, on the server named by
//!   `PGELECT_TEST_DATABASE_URL` ([`external_url`]) if set, else on the
//!   per-process [`Cluster::shared`] cluster.
//! * [`PgBouncer`]: a real pgbouncer in front of a [`Cluster`], in session or
//!   transaction pooling mode; or one per data node of an [`AutoFailover`]
//!   formation ([`PgBouncer::start_for_node`]), named together in a
//!   multi-host URL.
//! * [`FaultProxy`]: a TCP proxy that can blackhole, delay, cut or refuse
//!   connections, to simulate network partitions (the crate
//!   `pgelect-faultproxy`, which `pgelect chaos` uses too).
//! * [`ReplicaSet`]: a primary and a streaming replica of it (asynchronous
//!   or synchronous, [`Replication`]), with the `promote` fault (the
//!   primary killed, the replica promoted) and a way to make the replica
//!   miss commits on purpose.
//! * [`TestCerts`]: a CA, server and client certificates, a wrong CA and a
//!   mismatched key, generated in memory (rcgen, ECDSA P-256) for clusters
//!   and PgBouncers that speak TLS ([`Cluster::start_with`] with a
//!   [`TlsMode`], [`PgBouncer::start_with`] with a [`BouncerTls`]).
//!
//! * [`AutoFailover`]: a pg_auto_failover formation (a monitor and two or
//!   three data nodes, synchronous replication) on loopback, with the
//!   manager's switchover and failover and the kill of a postmaster or of
//!   a whole node; needs Debian's `pg-auto-failover-cli` and
//!   `postgresql-<version>-auto-failover` (`scripts/setup.sh`).
//!
//! # TLS servers
//!
//! ```no_run
//! use pgelect_testkit::{BouncerTls, Cluster, ClusterOptions, PgBouncer, PoolMode, TlsMode};
//!
//! # async fn t() -> std::io::Result<()> {
//! let cluster = Cluster::start_with(ClusterOptions::new().tls(TlsMode::Required))?;
//! let db = pgelect_testkit::TestDb::on(&cluster, "tls").await; // works: see below
//! let ca = cluster.certs().expect("TLS cluster").ca_cert();
//! let url = format!(
//!     "{}?sslmode=verify-full&sslrootcert={}",
//!     cluster.tcp_url(db.name()), // postgres://postgres:…@localhost:PORT/<db>
//!     ca.display()
//! );
//! let bouncer = PgBouncer::start_with(&cluster, PoolMode::Transaction, BouncerTls::Required)?;
//! let through = format!("{}?sslmode=verify-full&sslrootcert={}", bouncer.tcp_url(db.name()), ca.display());
//! # let _ = (url, through);
//! # Ok(())
//! # }
//! ```
//!
//! The kit's own connections (readiness probes, [`TestDb`] administration,
//! [`Cluster::url`], [`Cluster::config`], [`TestDb::connect`]) use
//! tokio-postgres with `NoTls`, and must work even on a cluster that
//! rejects every plain TCP connection. Rather than giving the kit a TLS
//! stack of its own, a TLS cluster (and a PgBouncer speaking TLS to its
//! clients) also listens on a Unix socket in its private directory: mode
//! 0700, owned by the server user, so only the test process's user (who is
//! the server user when not root) and root can reach it, with SCRAM
//! password authentication (`local all all scram-sha-256`). So TLS tests
//! see exactly the `pg_hba.conf` they ask for on TCP, and the kit needs no
//! certificates to administer its servers. Plain clusters keep no Unix
//! socket (`unix_socket_directories = ''`, unchanged): the default
//! directory, `/var/run/postgresql`, is shared by the machine and writable
//! only by the `postgres` group, and their URLs stay TCP. A Unix socket path may not exceed 107 bytes: the servers'
//! directories are short (`/dev/shm/pgelect-testkit-pg-<pid>-<n>-<nanos>`),
//! and a TLS server refuses to start, naming `PGELECT_TEST_TMPDIR`, when
//! they are not.
//!
//! Over TCP, tests connect to `localhost` ([`Cluster::tcp_url`],
//! [`PgBouncer::tcp_url`]): the server certificates name `localhost` and
//! `127.0.0.1` ([`DEFAULT_SERVER_NAMES`]), so `verify-full` passes with
//! either; [`ClusterOptions::server_names`] makes one that does not.
//!
//! # Running as root
//!
//! `initdb`, `postgres`, `pg_ctl` and `pgbouncer` refuse to run as root. When
//! the effective uid is 0 they are run as the `postgres` system user (or
//! `nobody` if there is no such user), and their directories are chowned to
//! that user. Otherwise they run as the current user.
//!
//! Private keys are mode 0600 and, like every file the servers read, owned
//! by the server user: PostgreSQL refuses a key file it does not own (or
//! that root owns with more than 0640) or that others can read.
//!
//! # Cleanup
//!
//! Every server (PostgreSQL or pgbouncer) gets a tiny *reaper* process
//! (`sh -c`) whose stdin is a pipe held open only by the test process. When
//! the test process exits for any reason (normal exit, panic, abort,
//! `SIGKILL`), the pipe closes, the reaper's `read` returns, and the reaper
//! signals the server (then `SIGKILL`s its whole process group) and removes
//! its directory. This matters because statics such as
//! [`Cluster::shared`] are never dropped in Rust. `Drop` of each handle does
//! the same work eagerly.
//!
//! # Cost
//!
//! The first [`Cluster::start`] on a machine runs `initdb` once (about 1 s
//! on an idle machine) into a template directory (keyed by the PostgreSQL
//! version, the server uid and the initdb options; created atomically with
//! `rename`, never deleted) which later clusters copy with `cp -a` (28 MB:
//! 0.1 s on an idle machine, but up to 1-2 s on a disk busy with builds);
//! the server then starts in 0.1-0.3 s. That is why directories go to
//! `/dev/shm` when it is a tmpfs with at least 1 GiB free (the copy then
//! takes 0.1-0.3 s even under load), else to [`std::env::temp_dir`].
//! `PGELECT_TEST_NO_TEMPLATE=1` always runs `initdb` instead.
//!
//! # Environment variables
//!
//! * `PGELECT_TEST_DATABASE_URL`: use this server for [`TestDb::new`].
//! * `PGELECT_PG_BIN`: directory holding `initdb`, `postgres`, `pg_ctl`, of
//!   any PostgreSQL from 13 on (see [`pg_bin_dir`]; `scripts/fetch-pg.sh`
//!   fetches 13 to 18).
//! * `PGELECT_PGBOUNCER`: path of the pgbouncer binary.
//! * `PGELECT_PG_AUTOCTL`: path of pg_auto_failover's `pg_autoctl`.
//! * `PGELECT_TEST_TMPDIR`: parent directory of the servers' directories and
//!   of the template (default: `/dev/shm` if a roomy tmpfs, else
//!   [`std::env::temp_dir`]).
//! * `PGELECT_TEST_NO_TEMPLATE`: disable the initdb template cache.
//! * `PGELECT_TESTKIT_DEBUG`: print how long each cluster took to start.

mod autofailover;
mod cluster;
mod pgbouncer;
mod replica;
pub mod stats;
mod testdb;
mod tls;
mod util;

use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;

pub use autofailover::{
    autofailover_available, AutoFailover, AutoFailoverOptions, NodeIndex, NodeState,
};
pub use cluster::{Cluster, ClusterOptions};
pub use pgbouncer::{pgbouncer_available, BouncerTls, PgBouncer, PoolMode};
pub use pgelect_faultproxy::FaultProxy;
pub use replica::{ReplicaSet, Replication, REPLICA_NAME};
pub use testdb::TestDb;

/// Polls `condition` every 10 ms until it holds, and returns how long that
/// took; panics with `what` after `limit`: a bounded wait for an event a
/// test cannot be told of directly.
pub async fn wait_until<F, Fut>(
    what: &str,
    limit: std::time::Duration,
    mut condition: F,
) -> std::time::Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = std::time::Instant::now();
    loop {
        if condition().await {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
pub use tls::{CertFiles, TestCerts, TlsMode, DEFAULT_SERVER_NAMES};

/// Superuser password of every throwaway cluster (and of the pgbouncer
/// `userlist.txt`).
pub const TEST_PASSWORD: &str = "pgelect-test-secret-7Q";

/// Superuser name of every throwaway cluster.
pub const SUPERUSER: &str = "postgres";

/// Host every throwaway server listens on.
pub(crate) const HOST: &str = "127.0.0.1";

/// The external test server URL: `PGELECT_TEST_DATABASE_URL`, if set and
/// non-empty.
///
/// When set, [`TestDb::new`] creates its databases there (the URL must name
/// a role allowed to `CREATE DATABASE`/`CREATE ROLE`, and a database it can
/// connect to, typically `postgres`) instead of starting a local cluster.
pub fn external_url() -> Option<String> {
    std::env::var("PGELECT_TEST_DATABASE_URL")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// For tests that need a server of their own (to stop or restart it, or to
/// put PgBouncer in front of it): returns `true`, after printing a visible
/// `SKIPPED` line naming the test, when [`external_url`] is set, since such
/// a test cannot restart someone else's server.
///
/// ```
/// # fn t() {
/// if pgelect_testkit::skip_without_own_server("database_restart") {
///     return;
/// }
/// # }
/// ```
pub fn skip_without_own_server(test: &str) -> bool {
    if external_url().is_some() {
        eprintln!(
            "SKIPPED {test}: PGELECT_TEST_DATABASE_URL points at an existing server, and this test needs a throwaway server of its own (it restarts it or puts PgBouncer in front of it)"
        );
        println!("SKIPPED {test}: needs a throwaway server of its own");
        return true;
    }
    false
}

/// The server programs the kit runs, all from one directory: whatever
/// [`pg_bin_dir`] returns must hold each of them.
pub const PG_PROGRAMS: [&str; 3] = ["initdb", "postgres", "pg_ctl"];

/// Directory holding the PostgreSQL server binaries ([`PG_PROGRAMS`]:
/// `initdb`, `postgres`, `pg_ctl`). PgBouncer is looked up apart (see
/// [`pgbouncer_available`]).
///
/// Looks at, in order: the `PGELECT_PG_BIN` environment variable,
/// `pg_config --bindir` (if that directory contains `initdb`), and the
/// highest-versioned `/usr/lib/postgresql/*/bin` (Debian/Ubuntu layout).
///
/// Any PostgreSQL from 13 on works: `PGELECT_PG_BIN` may name the system's
/// binaries of another version, or relocatable ones such as those
/// `scripts/fetch-pg.sh 13` (… `18`) fetches into `target/pg/<major>/native/bin`
/// (`scripts/test.sh --pg 13` sets it). Every cluster of a process uses the
/// same directory; the initdb template cache is keyed by the binaries'
/// version and directory, so versions never share a template.
///
/// # Errors
///
/// `NotFound` with instructions (run `scripts/setup.sh` or
/// `apt-get install postgresql`) when nothing is found, or when
/// `PGELECT_PG_BIN` is set but lacks one of [`PG_PROGRAMS`] (all are named).
pub fn pg_bin_dir() -> io::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PGELECT_PG_BIN").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        let missing: Vec<&str> = PG_PROGRAMS
            .into_iter()
            .filter(|p| !dir.join(p).is_file())
            .collect();
        if missing.is_empty() {
            return Ok(dir);
        }
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "PGELECT_PG_BIN={} lacks {} (it must hold {}; scripts/fetch-pg.sh MAJOR \
                 prints such a directory)",
                dir.display(),
                missing.join(", "),
                PG_PROGRAMS.join(", ")
            ),
        ));
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        if out.status.success() {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if has_initdb(&dir) {
                return Ok(dir);
            }
        }
    }
    let mut best: Option<(Vec<u64>, PathBuf)> = None;
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(version) = name
                .split('.')
                .map(|p| p.parse::<u64>().ok())
                .collect::<Option<Vec<u64>>>()
            else {
                continue;
            };
            let bin = entry.path().join("bin");
            if has_initdb(&bin) && best.as_ref().is_none_or(|(v, _)| version > *v) {
                best = Some((version, bin));
            }
        }
    }
    best.map(|(_, bin)| bin).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "PostgreSQL server binaries (initdb, postgres, pg_ctl) not found: run \
             `scripts/setup.sh` or `apt-get install postgresql`, or set PGELECT_PG_BIN \
             to the directory holding them (or PGELECT_TEST_DATABASE_URL to use an \
             existing server for TestDb)",
        )
    })
}

fn has_initdb(dir: &Path) -> bool {
    dir.join("initdb").is_file()
}

/// A TCP port on `127.0.0.1` that was free a moment ago.
///
/// The port is picked at random *below* the kernel's ephemeral port range
/// (`/proc/sys/net/ipv4/ip_local_port_range`) and checked by binding it, so
/// that outgoing connections and `bind(0)` listeners (such as
/// [`FaultProxy`]) never grab a port a stopped [`Cluster`] wants back in
/// [`Cluster::start_again`]. Falls back to binding `127.0.0.1:0`. There is
/// still an unavoidable race with other processes between this check and the
/// real bind: callers retry with a new port when the server fails to bind.
///
/// # Panics
///
/// If not even `127.0.0.1:0` can be bound (no loopback networking).
pub fn free_port() -> u16 {
    let (low, high) = util::ephemeral_range();
    let range = if low >= 11024 {
        Some((low - 10_000, low - 1))
    } else if high <= 55_535 {
        Some((high + 1, high + 10_000))
    } else {
        None
    };
    if let Some((lo, hi)) = range {
        for _ in 0..64 {
            let span = u64::from(hi - lo) + 1;
            let offset = u16::try_from(util::random_u64() % span).unwrap_or(0);
            let port = lo + offset;
            if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return port;
            }
        }
    }
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("pgelect-testkit: cannot bind any TCP port on 127.0.0.1")
}

/// Percent-encodes a URL component (everything but RFC 3986 unreserved
/// characters).
pub(crate) fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Rewrites a libpq-style connection string (URL or `key=value` form),
/// replacing the credentials and/or the database name.
pub(crate) fn rewrite_conn_str(
    base: &str,
    creds: Option<(&str, &str)>,
    db: Option<&str>,
) -> String {
    let scheme_end = ["postgres://", "postgresql://"]
        .iter()
        .find(|p| base.starts_with(*p))
        .map(|p| p.len());
    let Some(scheme_end) = scheme_end else {
        // key=value form: later keys override earlier ones.
        let quote = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
        let mut out = base.to_owned();
        if let Some((user, password)) = creds {
            out.push_str(&format!(
                " user={} password={}",
                quote(user),
                quote(password)
            ));
        }
        if let Some(db) = db {
            out.push_str(&format!(" dbname={}", quote(db)));
        }
        return out;
    };
    let (scheme, rest) = base.split_at(scheme_end);
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (path, query) = match tail.find('?') {
        Some(i) => tail.split_at(i),
        None => (tail, ""),
    };
    let hosts = match authority.rfind('@') {
        Some(i) => &authority[i + 1..],
        None => authority,
    };
    let userinfo = match (creds, authority.rfind('@')) {
        (Some((user, password)), _) => {
            format!("{}:{}@", percent_encode(user), percent_encode(password))
        }
        (None, Some(i)) => authority[..=i].to_owned(),
        (None, None) => String::new(),
    };
    let path = match db {
        Some(db) => format!("/{}", percent_encode(db)),
        None => path.to_owned(),
    };
    format!("{scheme}{userinfo}{hosts}{path}{query}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrite_url() {
        let base = "postgres://u:p@h:5432/db?sslmode=disable";
        assert_eq!(
            rewrite_conn_str(base, None, Some("x y")),
            "postgres://u:p@h:5432/x%20y?sslmode=disable"
        );
        assert_eq!(
            rewrite_conn_str(base, Some(("a", "p@ss")), None),
            "postgres://a:p%40ss@h:5432/db?sslmode=disable"
        );
        assert_eq!(
            rewrite_conn_str("postgresql://h", Some(("a", "b")), Some("d")),
            "postgresql://a:b@h/d"
        );
        assert_eq!(
            rewrite_conn_str("host=h user=u", Some(("a", "it's")), Some("d")),
            "host=h user=u user='a' password='it\\'s' dbname='d'"
        );
    }

    #[test]
    fn rewritten_urls_parse() {
        let url = rewrite_conn_str(
            "postgres://u:p@127.0.0.1:5/db",
            Some(("r", "p w:/@'")),
            Some("t_1"),
        );
        let cfg: tokio_postgres::Config = url.parse().unwrap();
        assert_eq!(cfg.get_user(), Some("r"));
        assert_eq!(cfg.get_password(), Some(&b"p w:/@'"[..]));
        assert_eq!(cfg.get_dbname(), Some("t_1"));
        let kv = rewrite_conn_str("host=h", Some(("r", "a'b\\c")), Some("d"));
        let cfg: tokio_postgres::Config = kv.parse().unwrap();
        assert_eq!(cfg.get_password(), Some(&b"a'b\\c"[..]));
        assert_eq!(cfg.get_dbname(), Some("d"));
    }

    #[test]
    fn free_port_is_bindable() {
        let p = free_port();
        assert!(p > 0);
        TcpListener::bind((Ipv4Addr::LOCALHOST, p)).unwrap();
    }

    #[test]
    fn finds_binaries() {
        let dir = pg_bin_dir().unwrap();
        for program in PG_PROGRAMS {
            assert!(
                dir.join(program).is_file(),
                "{program} in {}",
                dir.display()
            );
        }
    }
}
