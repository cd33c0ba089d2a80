//! A primary with a streaming replica, and the `promote` fault.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::cluster::Cluster;
use crate::util::{
    self, as_server_user, block_on_fresh_runtime, chown_to_server, ctx, err, run_logged,
    write_private,
};
use crate::{pg_bin_dir, HOST, SUPERUSER, TEST_PASSWORD};
use pgelect_faultproxy::FaultProxy;

/// The replica's `application_name` on the primary (what
/// `synchronous_standby_names` names).
pub const REPLICA_NAME: &str = "pgelect_replica";

/// How long [`ReplicaSet`] waits for replication to catch up, a standby to
/// become synchronous or a promotion to finish.
const WAIT: Duration = Duration::from_secs(30);

/// How the primary waits for its replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// A commit returns once the primary flushed it; the replica may not
    /// have it yet (`synchronous_standby_names` empty): a failover can
    /// lose the last commits.
    Async,
    /// A commit returns once the replica flushed it too
    /// (`synchronous_standby_names` names [`REPLICA_NAME`]): a failover
    /// loses no acknowledged commit. A commit hangs while the replica does
    /// not receive (see [`ReplicaSet::hold_replication`]).
    Sync,
}

/// A primary [`Cluster`] and a hot-standby replica of it streaming its WAL,
/// from the same server binaries: the replica is a `pg_basebackup` of the
/// primary with `standby.signal` and a `primary_conninfo`.
///
/// The replica reaches the primary through a [`FaultProxy`], so that a test
/// can make it miss commits on purpose ([`hold_replication`]): stopping
/// the walreceiver with `SIGSTOP` would not do, since the kernel keeps
/// receiving into its socket and a resumed walreceiver reads what the
/// primary sent before it died; `pg_wal_replay_pause()` stops replay, not
/// receiving, and a promotion replays what was received. Bytes the proxy
/// holds are lost when [`promote`](ReplicaSet::promote) cuts its
/// connections.
///
/// Both servers listen on `127.0.0.1` with the kit's superuser and
/// password (or one of the caller's: [`start_with_password`]); the replica
/// accepts read-only queries until promoted (`hot_standby`). After a
/// promotion, [`rebuild`] makes a new replica of the promoted server, so
/// that a set can fail over again and again. Dropping the set stops both
/// and removes their directories.
///
/// Cost: a plain cluster, plus the base backup and the replica's start
/// (the base backup copies the primary's 28 MB through the proxy): see
/// `pgelect-testkit/tests/replica.rs`, which prints what it measured.
///
/// [`hold_replication`]: ReplicaSet::hold_replication
/// [`start_with_password`]: ReplicaSet::start_with_password
/// [`rebuild`]: ReplicaSet::rebuild
#[derive(Debug)]
pub struct ReplicaSet {
    // Field order is drop order: the replica goes before its primary and proxy.
    replica: Cluster,
    primary: Cluster,
    proxy: FaultProxy,
    mode: Replication,
    /// Whether [`promote`](ReplicaSet::promote) ran since the replica was
    /// made: the primary is then dead and the replica the primary.
    promoted: AtomicBool,
}

impl ReplicaSet {
    /// Starts a primary and a replica of it, replicating in `mode`; returns
    /// once the replica streams (and, in [`Replication::Sync`], once the
    /// primary counts it as synchronous).
    ///
    /// # Errors
    ///
    /// As [`Cluster::start`]; or if `pg_basebackup` fails, or the replica
    /// does not stream within 30 s.
    pub fn start(mode: Replication) -> io::Result<ReplicaSet> {
        Self::start_with_password(mode, TEST_PASSWORD)
    }

    /// As [`start`](ReplicaSet::start), with `password` as the superuser's
    /// password on both servers (set on the primary before the base
    /// backup, which carries it to the replica): for a set reachable by
    /// other local users, since the kit's own password is public.
    ///
    /// # Errors
    ///
    /// As [`start`](ReplicaSet::start), or if the password cannot be set.
    pub fn start_with_password(mode: Replication, password: &str) -> io::Result<ReplicaSet> {
        let primary = Cluster::start()?;
        if password != TEST_PASSWORD {
            primary.set_superuser_password(password)?;
        }
        let proxy = FaultProxy::start(primary.addr())?;
        let upstream = proxy.port();
        let replica = Cluster::start_from(
            &|dir: &Path, data: &Path| base_backup(&primary, upstream, dir, data),
            password,
        )?;
        let set = ReplicaSet {
            replica,
            primary,
            proxy,
            mode,
            promoted: AtomicBool::new(false),
        };
        set.wait_streaming()?;
        if mode == Replication::Sync {
            set.make_synchronous()?;
        }
        Ok(set)
    }

    /// After [`promote`](ReplicaSet::promote): a new replica of the
    /// promoted server (`pg_basebackup` through a new proxy, then streaming,
    /// and synchronous in [`Replication::Sync`]), on a port of its own. The
    /// dead primary is removed; [`primary`](ReplicaSet::primary) is now the
    /// promoted server and [`replica`](ReplicaSet::replica) the new one, so
    /// the set can be promoted again (its timeline rises each time).
    /// Returns how long it took. The promoted server keeps serving
    /// meanwhile (a base backup asks it for a checkpoint).
    ///
    /// # Errors
    ///
    /// `InvalidInput` if the replica was not promoted; otherwise as
    /// [`start`](ReplicaSet::start).
    pub fn rebuild(&mut self) -> io::Result<Duration> {
        if !self.promoted.load(Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "rebuild follows promote: the primary still runs",
            ));
        }
        let started = Instant::now();
        let proxy = FaultProxy::start(self.replica.addr())?;
        let upstream = proxy.port();
        let password = self.replica.password();
        let promoted = &self.replica;
        let fresh = Cluster::start_from(
            &|dir: &Path, data: &Path| base_backup(promoted, upstream, dir, data),
            &password,
        )?;
        let promoted = std::mem::replace(&mut self.replica, fresh);
        let dead = std::mem::replace(&mut self.primary, promoted);
        let old_proxy = std::mem::replace(&mut self.proxy, proxy);
        // The dead primary's directory goes now, not with the set.
        drop(dead);
        drop(old_proxy);
        self.promoted.store(false, Ordering::SeqCst);
        self.wait_streaming()?;
        if self.mode == Replication::Sync {
            self.make_synchronous()?;
        }
        Ok(started.elapsed())
    }

    /// Waits until the replica has received (flushed to its disk, so that
    /// a promotion replays it) everything the primary had written when
    /// this was called: every commit acknowledged before the call survives
    /// a [`promote`](ReplicaSet::promote) that follows, also with
    /// [`Replication::Async`].
    ///
    /// # Errors
    ///
    /// If it has not within 30 s, or a server cannot be reached.
    pub fn wait_received(&self) -> io::Result<()> {
        let rows = self.primary_sql("SELECT pg_current_wal_lsn()::text")?;
        let target = first(&rows).ok_or_else(|| err("no WAL position on the primary"))?;
        self.wait_until("the replica to receive the primary's WAL", || {
            let rows = self.replica_sql(&format!(
                "SELECT pg_last_wal_receive_lsn() >= '{target}'::pg_lsn"
            ))?;
            Ok(first(&rows).as_deref() == Some("t"))
        })
    }

    /// Names the replica in `synchronous_standby_names` on the primary and
    /// waits until the primary counts it as synchronous.
    fn make_synchronous(&self) -> io::Result<()> {
        // Two statements: ALTER SYSTEM refuses to run in the implicit
        // transaction of a multi-statement query.
        self.primary_sql(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '\"{REPLICA_NAME}\"'"
        ))?;
        self.primary_sql("SELECT pg_reload_conf()")?;
        self.wait_until("the replica to become synchronous", || {
            let rows = self.primary_sql(&format!(
                "SELECT sync_state FROM pg_stat_replication \
                 WHERE application_name = '{REPLICA_NAME}'"
            ))?;
            Ok(first(&rows).as_deref() == Some("sync"))
        })
    }

    /// The primary (after [`promote`](ReplicaSet::promote): the old
    /// primary, stopped).
    pub fn primary(&self) -> &Cluster {
        &self.primary
    }

    /// The replica (after [`promote`](ReplicaSet::promote): the new
    /// primary).
    pub fn replica(&self) -> &Cluster {
        &self.replica
    }

    /// How the primary waits for the replica.
    pub fn mode(&self) -> Replication {
        self.mode
    }

    /// Waits until the replica has replayed everything the primary has
    /// written so far (e.g. a database a test just created there).
    ///
    /// # Errors
    ///
    /// If it has not within 30 s (e.g. while [`hold_replication`] holds
    /// it back), or a server cannot be reached.
    ///
    /// [`hold_replication`]: ReplicaSet::hold_replication
    pub fn wait_replayed(&self) -> io::Result<()> {
        let rows = self.primary_sql("SELECT pg_current_wal_lsn()::text")?;
        let target = first(&rows).ok_or_else(|| err("no WAL position on the primary"))?;
        self.wait_until("the replica to replay the primary's WAL", || {
            let rows = self.replica_sql(&format!(
                "SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn"
            ))?;
            Ok(first(&rows).as_deref() == Some("t"))
        })
    }

    /// From now on the replica receives nothing: the proxy between it and
    /// the primary stops forwarding (a partition; the replication
    /// connection stays open). Commits on the primary then never reach
    /// the replica if [`promote`](ReplicaSet::promote) follows; in
    /// [`Replication::Sync`] they hang instead. [`release_replication`]
    /// lets the held bytes through.
    ///
    /// [`release_replication`]: ReplicaSet::release_replication
    pub fn hold_replication(&self) {
        self.proxy.blackhole();
    }

    /// Ends [`hold_replication`](ReplicaSet::hold_replication): the replica
    /// receives what was held and catches up.
    pub fn release_replication(&self) {
        self.proxy.heal();
    }

    /// The `promote` fault: stops the primary hard (`pg_ctl stop -m
    /// immediate`, like a crash: no shutdown checkpoint, clients cut),
    /// drops whatever the replica had not received (the proxy's
    /// connections are reset), promotes the replica (`pg_ctl promote`) and
    /// waits until it accepts writes. Returns how long the promotion took
    /// from the primary's death until the new primary accepted a write.
    ///
    /// # Errors
    ///
    /// If a step fails or the replica does not accept writes within 30 s.
    pub fn promote(&self) -> io::Result<Duration> {
        self.primary.kill()?;
        self.promoted.store(true, Ordering::SeqCst);
        let died = Instant::now();
        self.proxy.cut();
        self.proxy.heal();
        let data = self.replica.data_dir();
        let dir = data
            .parent()
            .ok_or_else(|| err("the replica has no directory"))?;
        let mut cmd = Command::new(pg_bin_dir()?.join("pg_ctl"));
        cmd.arg("promote")
            .arg("-D")
            .arg(data)
            .args(["-w", "-t", "30"])
            .current_dir(dir);
        as_server_user(&mut cmd);
        run_logged(
            cmd,
            &dir.join("pg_ctl.log"),
            WAIT + Duration::from_secs(5),
            "pg_ctl promote",
        )?;
        // A transaction id is assigned only where writes are allowed.
        self.wait_until("the promoted replica to accept writes", || {
            Ok(self.replica_sql("SELECT txid_current()").is_ok())
        })?;
        Ok(died.elapsed())
    }

    /// The WAL timeline the replica writes on (or would, once promoted):
    /// `1` before a promotion, `2` after the first.
    ///
    /// # Errors
    ///
    /// If the replica cannot be reached.
    pub fn replica_timeline(&self) -> io::Result<u32> {
        let rows = self.replica_sql("SELECT timeline_id FROM pg_control_checkpoint()")?;
        let checkpoint: u32 = first(&rows)
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| err("no timeline"))?;
        // The checkpoint's timeline lags right after a promotion; the
        // insert position's segment name does not.
        let rows = self.replica_sql(
            "SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE \
             ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::int8 END",
        )?;
        Ok(first(&rows)
            .and_then(|t| t.parse().ok())
            .unwrap_or(checkpoint))
    }

    fn wait_streaming(&self) -> io::Result<()> {
        self.wait_until("the replica to stream from the primary", || {
            let rows = self.primary_sql(&format!(
                "SELECT state FROM pg_stat_replication WHERE application_name = '{REPLICA_NAME}'"
            ))?;
            Ok(first(&rows).as_deref() == Some("streaming"))
        })
    }

    fn wait_until(&self, what: &str, mut done: impl FnMut() -> io::Result<bool>) -> io::Result<()> {
        let start = Instant::now();
        let mut last = None;
        while start.elapsed() < WAIT {
            match done() {
                Ok(true) => return Ok(()),
                Ok(false) => last = None,
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let why = last.map_or_else(String::new, |e| format!(" (last error: {e})"));
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("waited {WAIT:?} for {what}{why}"),
        ))
    }

    fn primary_sql(&self, sql: &str) -> io::Result<Vec<Vec<Option<String>>>> {
        query(&self.primary, sql)
    }

    fn replica_sql(&self, sql: &str) -> io::Result<Vec<Vec<Option<String>>>> {
        query(&self.replica, sql)
    }
}

/// The first column of the first row.
fn first(rows: &[Vec<Option<String>>]) -> Option<String> {
    rows.first().and_then(|r| r.first().cloned().flatten())
}

fn query(cluster: &Cluster, sql: &str) -> io::Result<Vec<Vec<Option<String>>>> {
    let mut config = cluster.config("postgres");
    config.connect_timeout(Duration::from_secs(2));
    let sql = sql.to_owned();
    block_on_fresh_runtime(Duration::from_secs(5), move || async move {
        util::simple_rows(config, &sql).await
    })
}

/// `pg_basebackup` of `primary` through the proxy on `upstream` into
/// `data`, then the standby settings: `standby.signal` and a
/// `primary_conninfo` through the proxy (its password in the replica's
/// `postgresql.auto.conf`, mode 0600 like the rest of the data directory).
/// `synchronous_standby_names` is emptied: a backup of a synchronous
/// primary would carry its setting, and once promoted the replica's
/// commits would wait for a standby that does not exist yet.
fn base_backup(primary: &Cluster, upstream: u16, dir: &Path, data: &Path) -> io::Result<()> {
    let password = primary
        .config("postgres")
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let conninfo =
        format!("host={HOST} port={upstream} user={SUPERUSER} application_name={REPLICA_NAME}");
    let mut cmd = Command::new(pg_bin_dir()?.join("pg_basebackup"));
    cmd.arg("-D")
        .arg(data)
        .arg("-d")
        .arg(&conninfo)
        .args(["-X", "stream", "-c", "fast", "--no-sync", "-w"])
        // Not on the command line, where `ps` shows it.
        .env("PGPASSWORD", &password)
        .env_remove("PGPASSFILE")
        .current_dir(dir);
    as_server_user(&mut cmd);
    run_logged(
        cmd,
        &dir.join("basebackup.log"),
        Duration::from_secs(60),
        "pg_basebackup",
    )?;
    let signal = data.join("standby.signal");
    write_private(&signal, "")?;
    let auto = data.join("postgresql.auto.conf");
    let mut f = OpenOptions::new()
        .append(true)
        .open(&auto)
        .map_err(|e| ctx(e, format!("open {}", auto.display())))?;
    let password = password.replace('\\', "\\\\").replace('\'', "\\'");
    let quoted = format!("{conninfo} password='{password}'").replace('\'', "''");
    f.write_all(
        format!(
            "primary_conninfo = '{quoted}'\n\
             hot_standby = on\n\
             wal_receiver_status_interval = 1s\n\
             synchronous_standby_names = ''\n"
        )
        .as_bytes(),
    )?;
    chown_to_server(&auto)?;
    // Not the primary's: a new postmaster.pid and log are the replica's own.
    let _ = fs::remove_file(data.join("postmaster.pid"));
    let _ = fs::remove_file(data.join("server.log"));
    Ok(())
}
