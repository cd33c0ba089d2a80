//! A fresh database per test.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

use crate::util::{
    block_on_fresh_runtime, next_id, on_fresh_runtime, pg_err, quote_ident, quote_literal,
};
use crate::{external_url, rewrite_conn_str, Cluster};

/// Bound on each administrative operation (create/drop database/role).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(60);

/// A fresh, uniquely named database for one test, dropped (best effort,
/// `WITH (FORCE)`) when the `TestDb` is dropped.
///
/// Administrative statements run on a private helper thread with its own
/// tokio runtime, so they work under a paused tokio clock and from `Drop`.
#[derive(Debug)]
pub struct TestDb {
    name: String,
    /// `<counter>_<pid>`: makes names unique within the server.
    suffix: String,
    /// Superuser connection string of the server (any database).
    base: String,
    /// Superuser config for the maintenance database.
    admin: Config,
    /// Where the database lives, for messages (no password).
    server: String,
    /// Roles created by [`TestDb::create_role`], dropped with the database.
    roles: Mutex<Vec<String>>,
}

impl TestDb {
    /// Creates a database named `t_<hint>_<counter>_<pid>` (`hint`
    /// lowercased, other characters than `[a-z0-9_]` replaced by `_`,
    /// truncated to fit 63 bytes) on the [`external_url`] server if set, else
    /// on [`Cluster::shared`] (started on first use, on a blocking thread).
    ///
    /// Needs a tokio runtime (any flavour).
    ///
    /// # Panics
    ///
    /// If the server cannot be reached or the database cannot be created (it
    /// is test code: the message says why).
    pub async fn new(hint: &str) -> TestDb {
        if let Some(url) = external_url() {
            let admin: Config = url.parse().unwrap_or_else(|e| {
                panic!("pgelect-testkit: PGELECT_TEST_DATABASE_URL is not a valid connection string: {e}")
            });
            let server = format!(
                "the PGELECT_TEST_DATABASE_URL server (hosts {:?}, ports {:?})",
                admin.get_hosts(),
                admin.get_ports()
            );
            return Self::create(url, admin, server, hint).await;
        }
        let cluster = match tokio::task::spawn_blocking(Cluster::shared).await {
            Ok(cluster) => cluster,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("pgelect-testkit: starting the shared cluster was cancelled: {e}"),
        };
        Self::on(cluster, hint).await
    }

    /// Like [`TestDb::new`], on the given (typically private) cluster.
    ///
    /// # Panics
    ///
    /// If the database cannot be created.
    pub async fn on(cluster: &Cluster, hint: &str) -> TestDb {
        let server = format!(
            "the test cluster on port {} ({})",
            cluster.port(),
            cluster.data_dir().display()
        );
        Self::create(
            cluster.url("postgres"),
            cluster.config("postgres"),
            server,
            hint,
        )
        .await
    }

    async fn create(base: String, admin: Config, server: String, hint: &str) -> TestDb {
        let suffix = format!("{}_{}", next_id(), std::process::id());
        let name = format!("t_{}_{suffix}", sanitize(hint, 63 - 3 - suffix.len()));
        let sql = vec![format!("CREATE DATABASE {}", quote_ident(&name))];
        if let Err(e) = admin_exec(admin.clone(), sql).await {
            panic!("pgelect-testkit: cannot create test database {name} on {server}: {e}");
        }
        TestDb {
            name,
            suffix,
            base,
            admin,
            server,
            roles: Mutex::new(Vec::new()),
        }
    }

    /// The database name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A superuser connection URL for this database.
    pub fn url(&self) -> String {
        rewrite_conn_str(&self.base, None, Some(&self.name))
    }

    /// A superuser connection config for this database (no connect timeout
    /// is set unless the external URL has one).
    pub fn config(&self) -> Config {
        let mut config = self.admin.clone();
        config.dbname(&self.name);
        config
    }

    /// The socket address of the server holding this database (its first
    /// host and port), e.g. as the upstream of a
    /// [`FaultProxy`](crate::FaultProxy).
    ///
    /// # Panics
    ///
    /// If the server is reached through a Unix socket or the host does not
    /// resolve.
    pub fn server_addr(&self) -> SocketAddr {
        let host = match self.admin.get_hosts().first() {
            Some(Host::Tcp(host)) => host.clone(),
            Some(other) => panic!(
                "pgelect-testkit: {} is not a TCP server: {other:?}",
                self.server
            ),
            None => "localhost".to_owned(),
        };
        let port = self.admin.get_ports().first().copied().unwrap_or(5432);
        (host.as_str(), port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut addrs| addrs.next())
            .unwrap_or_else(|| panic!("pgelect-testkit: cannot resolve {host}:{port}"))
    }

    /// A superuser config for this database through `127.0.0.1:port`, e.g.
    /// a [`FaultProxy`](crate::FaultProxy) or [`PgBouncer`](crate::PgBouncer)
    /// in front of its server. (Use this rather than `config().port(..)`:
    /// `tokio_postgres::Config::port` *adds* a port.)
    pub fn config_via(&self, port: u16) -> Config {
        let mut config = Config::new();
        config.host(crate::HOST).port(port).dbname(&self.name);
        if let Some(user) = self.admin.get_user() {
            config.user(user);
        }
        if let Some(password) = self.admin.get_password() {
            config.password(password);
        }
        if let Some(options) = self.admin.get_options() {
            config.options(options);
        }
        if let Some(name) = self.admin.get_application_name() {
            config.application_name(name);
        }
        config
    }

    /// Connects as the superuser; the connection task is spawned with
    /// `tokio::spawn` (its error, if any, is ignored: tests kill servers on
    /// purpose).
    ///
    /// # Panics
    ///
    /// If the connection fails.
    pub async fn connect(&self) -> Client {
        let (client, connection) = self.config().connect(NoTls).await.unwrap_or_else(|e| {
            panic!(
                "pgelect-testkit: cannot connect to test database {} on {}: {}",
                self.name,
                self.server,
                pg_err(e)
            )
        });
        tokio::spawn(async move {
            let _ = connection.await;
        });
        client
    }

    /// Waits until at least `n` sessions of this database wait for an
    /// advisory lock (`pg_locks`, not granted): the event a test needs before
    /// it frees a lock and times the takeover. Polls every 5 ms.
    ///
    /// # Panics
    ///
    /// If that does not happen within 30 s.
    pub async fn wait_for_advisory_waiters(&self, n: i64) {
        let client = self.connect().await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let row = client
                .query_one(
                    "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
                      WHERE l.locktype = 'advisory' AND NOT l.granted
                        AND d.datname = current_database()",
                    &[],
                )
                .await
                .unwrap_or_else(|e| panic!("pgelect-testkit: cannot read pg_locks: {}", pg_err(e)));
            let waiting: i64 = row.get(0);
            if waiting >= n {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "pgelect-testkit: only {waiting} of {n} advisory-lock waiters after 30 s"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// The server-wide role name [`create_role`](TestDb::create_role) uses
    /// for `name`: `<name>_<counter>_<pid>` (sanitised like database names),
    /// unique to this `TestDb` because roles are shared by all databases of
    /// a server.
    pub fn role_name(&self, name: &str) -> String {
        format!(
            "{}_{}",
            sanitize(name, 63 - 1 - self.suffix.len()),
            self.suffix
        )
    }

    /// Creates (or, if it exists, alters) the login role
    /// [`role_name(name)`](TestDb::role_name) with `password` (SCRAM), as a
    /// superuser or not, grants it `CONNECT` on this database, and returns a
    /// connection URL for that role on this database. The role is dropped
    /// with the `TestDb`.
    ///
    /// No other privilege is granted: since PostgreSQL 15 a non-owner cannot
    /// create objects in schema `public`; grant what the test needs.
    ///
    /// # Panics
    ///
    /// If a statement fails.
    pub async fn create_role(&self, name: &str, password: &str, superuser: bool) -> String {
        let role = self.role_name(name);
        let r = quote_ident(&role);
        let attrs = format!(
            "LOGIN {} PASSWORD {}",
            if superuser {
                "SUPERUSER"
            } else {
                "NOSUPERUSER"
            },
            quote_literal(password)
        );
        let sql = vec![
            format!(
                "DO $pgelect_testkit$ BEGIN CREATE ROLE {r} {attrs}; \
                 EXCEPTION WHEN duplicate_object THEN ALTER ROLE {r} {attrs}; END $pgelect_testkit$"
            ),
            format!(
                "GRANT CONNECT ON DATABASE {} TO {r}",
                quote_ident(&self.name)
            ),
        ];
        {
            let mut roles = self.roles.lock().unwrap_or_else(PoisonError::into_inner);
            if !roles.contains(&role) {
                roles.push(role.clone());
            }
        }
        if let Err(e) = admin_exec(self.admin.clone(), sql).await {
            panic!(
                "pgelect-testkit: cannot create role {role} on {}: {e}",
                self.server
            );
        }
        rewrite_conn_str(&self.base, Some((&role, password)), Some(&self.name))
    }
}

impl Drop for TestDb {
    /// Drops the database (`WITH (FORCE)`, disconnecting its clients) and the
    /// roles created for it, on a helper thread, bounded by a timeout. Never
    /// panics: failures are printed to stderr.
    fn drop(&mut self) {
        let mut sql = vec![format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote_ident(&self.name)
        )];
        let roles = std::mem::take(self.roles.get_mut().unwrap_or_else(PoisonError::into_inner));
        sql.extend(
            roles
                .iter()
                .map(|r| format!("DROP ROLE IF EXISTS {}", quote_ident(r))),
        );
        let admin = with_connect_timeout(self.admin.clone());
        let result = block_on_fresh_runtime(Duration::from_secs(20), move || exec_all(admin, sql));
        if let Err(e) = result {
            eprintln!(
                "pgelect-testkit: could not drop test database {} on {}: {e}",
                self.name, self.server
            );
        }
    }
}

/// Runs `sql` statements one by one (each in its own implicit transaction,
/// as `CREATE/DROP DATABASE` require) on a helper runtime.
async fn admin_exec(admin: Config, sql: Vec<String>) -> io::Result<()> {
    let admin = with_connect_timeout(admin);
    on_fresh_runtime(ADMIN_TIMEOUT, move || exec_all(admin, sql)).await
}

async fn exec_all(config: Config, sql: Vec<String>) -> io::Result<()> {
    let (client, connection) = config.connect(NoTls).await.map_err(pg_err)?;
    let connection = tokio::spawn(connection);
    let mut result = Ok(());
    for statement in &sql {
        if let Err(e) = client.simple_query(statement).await {
            result = Err(crate::util::ctx(pg_err(e), statement));
            break;
        }
    }
    drop(client);
    let _ = connection.await;
    result
}

fn with_connect_timeout(mut config: Config) -> Config {
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(5));
    }
    config
}

/// Lowercase, `[a-z0-9_]` only, at most `max` bytes, never empty.
fn sanitize(hint: &str, max: usize) -> String {
    let s: String = hint
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(max.max(1))
        .collect();
    if s.is_empty() {
        "db".to_owned()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::{sanitize, TestDb};

    #[test]
    fn is_send_sync() {
        fn is<T: Send + Sync>() {}
        is::<TestDb>();
    }

    #[test]
    fn sanitizes() {
        assert_eq!(sanitize("Leader-Election!", 60), "leader_election_");
        assert_eq!(sanitize("", 60), "db");
        assert_eq!(sanitize("abcdef", 3), "abc");
        assert_eq!(sanitize("é", 60), "_");
    }
}
