//! Observing a role: the current leader, change notifications, resign
//! requests, and the observer that has a waiting standby's zombie leaders
//! preempted (the session backend's `preempt`).

use std::sync::Weak;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;
use tokio_util::sync::CancellationToken;

use crate::conn::DedicatedConnection;
use crate::error::{Error, Result};
use crate::schema::SchemaName;

use super::backend::session::{preempt, Zombies};
use super::support::{sleep_until_woken, NapEnd, Reconnect, WakeLimit, WakeOn};
use super::ElectorState;

/// The `NOTIFY` channel on which leadership changes are announced. The
/// payload is `<schema>:<event>:<role>`, with event `elected` or `released`.
pub const LEADER_CHANNEL: &str = "pgelect_leader";

/// The `NOTIFY` channel on which a leader listens for resign hints. The
/// payload is `<schema>:<role>`. Anyone who can connect may notify, so a
/// hint only makes the leader read its lease row early (at most one early
/// read per 100 ms); it steps down only if the row says that a resignation
/// was requested for its term, which takes
/// [`request_resign`](crate::admin::request_resign) and the privilege to run it.
pub const RESIGN_CHANNEL: &str = "pgelect_resign";

/// A role's leader as the lease row shows it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct LeaderInfo {
    /// The role.
    pub role: String,
    /// The leader's node id.
    pub holder: String,
    /// The JSON the leader stored with [`ElectorBuilder::meta`](crate::ElectorBuilder::meta).
    pub holder_meta: Option<serde_json::Value>,
    /// The fencing term.
    pub term: super::Term,
    /// The backend that elected it (`session` or `lease`).
    pub backend: Option<String>,
    /// The server's clock when this term began.
    pub acquired_at: SystemTime,
    /// The server's clock at the last renewal.
    pub renewed_at: SystemTime,
    /// The server's clock at which the lease ends unless renewed.
    pub lease_until: SystemTime,
    /// True when the lease had expired on the server's clock when read: the
    /// leader is frozen, partitioned or gone.
    pub lease_expired: bool,
    /// The server process id of the leader's lock connection.
    pub holder_pid: Option<i32>,
}

/// One row, whether or not the role has one: its leader's columns (null
/// without a row), then whether the server accepts writes.
fn leader_sql(schema: &SchemaName) -> String {
    format!(
        "SELECT l.holder, l.holder_meta, l.term, l.backend, l.acquired_at, l.renewed_at,
                l.lease_until, coalesce(l.lease_until < now(), true), l.holder_pid,
                pg_is_in_recovery() OR current_setting('transaction_read_only')::bool,
                (extract(epoch FROM l.lease_until - now()) * 1000)::float8
           FROM (SELECT 1) AS one LEFT JOIN {schema}.leaders AS l ON l.role = $1"
    )
}

/// Reads the role's leader; `None` when the role has no row or no holder.
pub(crate) async fn read_leader<C: GenericClient + Sync>(
    client: &C,
    schema: &SchemaName,
    role: &str,
) -> Result<Option<LeaderInfo>> {
    Ok(read_leader_and_mode(client, schema, role).await?.0)
}

/// [`read_leader`], and whether the server is read-only (in recovery, or a
/// primary fenced with `default_transaction_read_only`), in one statement.
pub(crate) async fn read_leader_and_mode<C: GenericClient + Sync>(
    client: &C,
    schema: &SchemaName,
    role: &str,
) -> Result<(Option<LeaderInfo>, bool)> {
    read_leader_mode_and_lease(client, schema, role)
        .await
        .map(|(leader, read_only, _)| (leader, read_only))
}

/// [`read_leader_and_mode`], and how long the holder's lease still runs on
/// the server's clock (`None`: no holder, or already expired).
pub(crate) async fn read_leader_mode_and_lease<C: GenericClient + Sync>(
    client: &C,
    schema: &SchemaName,
    role: &str,
) -> Result<(Option<LeaderInfo>, bool, Option<Duration>)> {
    let what = "read the leader";
    let rows = client
        .query_typed(&leader_sql(schema), &[(&role, Type::TEXT)])
        .await
        .map_err(|e| Error::db(what, schema.as_str(), e))?;
    let Some(row) = rows.first() else {
        return Ok((None, false, None));
    };
    let read_only: bool = row
        .try_get(9)
        .map_err(|e| Error::db(what, schema.as_str(), e))?;
    let holder: Option<String> = row
        .try_get(0)
        .map_err(|e| Error::db(what, schema.as_str(), e))?;
    if holder.is_none() {
        return Ok((None, read_only, None));
    }
    let remaining_ms: Option<f64> = row
        .try_get(10)
        .map_err(|e| Error::db(what, schema.as_str(), e))?;
    let runs = remaining_ms
        .filter(|ms| ms.is_finite() && *ms > 0.0)
        .map(|ms| Duration::from_secs_f64(ms.min(1e9) / 1000.0));
    leader_info(role, row)
        .map(|i| (Some(i), read_only, runs))
        .map_err(|e| Error::db(what, schema.as_str(), e))
}

/// A row of `holder, holder_meta, term, backend, acquired_at, renewed_at,
/// lease_until, lease_expired, holder_pid` whose holder is set.
pub(crate) fn leader_info(
    role: &str,
    row: &tokio_postgres::Row,
) -> std::result::Result<LeaderInfo, tokio_postgres::Error> {
    leader_info_at(role, row, 0)
}

/// [`leader_info`] from the columns starting at `at`.
pub(crate) fn leader_info_at(
    role: &str,
    row: &tokio_postgres::Row,
    at: usize,
) -> std::result::Result<LeaderInfo, tokio_postgres::Error> {
    let epoch = SystemTime::UNIX_EPOCH;
    Ok(LeaderInfo {
        role: role.to_owned(),
        holder: row.try_get(at)?,
        holder_meta: row.try_get(at + 1)?,
        term: super::Term::new(row.try_get(at + 2)?),
        backend: row.try_get(at + 3)?,
        acquired_at: row
            .try_get::<_, Option<SystemTime>>(at + 4)?
            .unwrap_or(epoch),
        renewed_at: row
            .try_get::<_, Option<SystemTime>>(at + 5)?
            .unwrap_or(epoch),
        lease_until: row
            .try_get::<_, Option<SystemTime>>(at + 6)?
            .unwrap_or(epoch),
        lease_expired: row.try_get(at + 7)?,
        holder_pid: row.try_get(at + 8)?,
    })
}

/// Parses a notification on [`LEADER_CHANNEL`]: `(event, role)` if it is
/// about `schema`.
pub(crate) fn parse_leader_event<'a>(schema: &str, payload: &'a str) -> Option<(&'a str, &'a str)> {
    let mut parts = payload.splitn(3, ':');
    let s = parts.next()?;
    let event = parts.next()?;
    let role = parts.next()?;
    (s == schema).then_some((event, role))
}

/// The background observer of an elector: keeps the watch channel current
/// (on `NOTIFY` and every `check_every`), and, while a blocking standby of
/// this elector waits, preempts zombie leaders. Holds the elector's state
/// weakly and ends when the elector is dropped.
pub(crate) struct Observer {
    pub(crate) shared: Weak<ElectorState>,
    pub(crate) stop: CancellationToken,
}

impl Observer {
    pub(crate) async fn run(self) {
        let mut reconnect = Reconnect::default();
        while !self.stop.is_cancelled() {
            let Some(shared) = self.shared.upgrade() else {
                return;
            };
            let purpose = format!("observe:{}", shared.role);
            // LISTEN needs a connection that keeps its server session: not
            // one through a transaction pooler, which the lease backend may
            // use. Without `listen_via` the lease backend's observer only
            // polls (every `check_every`).
            let (options, listen) = match shared.lease().map(|l| &l.listen_via) {
                Some(Some(direct)) => (direct.clone(), true),
                Some(None) => (shared.options.clone(), false),
                None => (shared.options.clone(), true),
            };
            let mut activity = shared.activity.subscribe();
            drop(shared);
            // Connected only while needed (see `Activity::wants_observer`).
            tokio::select! {
                _ = self.stop.cancelled() => return,
                r = activity.wait_for(|a| a.wants_observer()) => if r.is_err() { return },
            }
            let Some(conn) = reconnect
                .connect(&options, &purpose, &self.stop, "observer")
                .await
            else {
                return;
            };
            reconnect.succeeded();
            match self.observe(&conn, listen, activity).await {
                Ok(()) => {
                    conn.close().await;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "observer connection failed; reconnecting");
                    conn.kill();
                }
            }
            if !reconnect.back_off(&self.stop).await {
                return;
            }
        }
    }

    /// Observes until the connection fails (`Err`), or until the elector
    /// is dropped or stopped, or no longer needs the connection (`Ok`).
    async fn observe(
        &self,
        conn: &DedicatedConnection,
        listen: bool,
        mut activity: tokio::sync::watch::Receiver<super::Activity>,
    ) -> Result<()> {
        let Some(shared) = self.shared.upgrade() else {
            return Ok(());
        };
        let schema = shared.options.schema_name().clone();
        let role = shared.role.clone();
        let key = shared.key;
        let check_every = shared.timing.check_every;
        let refused = shared.preemption_refused.clone();
        drop(shared);
        let mut notices = conn.notices();
        let mut listening = false;
        let mut wakes = WakeLimit::default();
        loop {
            let now = *activity.borrow_and_update();
            if !now.wants_observer() {
                return Ok(());
            }
            // Changes are pushed only to watchers. A standby alone needs
            // the periodic check (zombies), not a wake-up on every change,
            // which would put a read beside its own election on the server.
            if listen && now.watched && !listening {
                conn.client()
                    .batch_execute(&format!("LISTEN {LEADER_CHANNEL}"))
                    .await
                    .map_err(|e| Error::db("listen for leader changes", schema.as_str(), e))?;
                listening = true;
            }
            // What watchers saw before the read: if this elector published
            // meanwhile (it was just elected), that is newer than the row
            // this read may have seen, and is kept.
            let Some(seen) = self.shared.upgrade().map(|s| s.leader.borrow().clone()) else {
                return Ok(());
            };
            let (info, read_only) = read_leader_and_mode(conn.client(), &schema, &role).await?;
            // No live lease: an expired one, or none. Under the session
            // backend a session may still hold the lock (a zombie leader,
            // or a candidate frozen before its term).
            let vacant = info.as_ref().is_none_or(|i| i.lease_expired);
            let Some(shared) = self.shared.upgrade() else {
                return Ok(());
            };
            let session_backend = shared.lease().is_none();
            let grace = shared.timing.ttl;
            shared.contact.touch();
            shared.publish_if_unchanged(&seen, info);
            if read_only && now.standing > 0 {
                // A demoted or fenced primary: nothing can be elected here.
                // A blocking standby waiting on it gives up its wait and
                // reconnects; so does this observer.
                tracing::warn!(role = %role, "the server became read-only (a demoted or fenced primary) while a standby waits on it; reconnecting");
                shared.server_read_only.notify_waiters();
                return Err(Error::connection_lost(
                    "observe the leader: the server is read-only",
                ));
            }
            if now.standing > 0 {
                let lock_server = shared
                    .lock_server
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone();
                if let (Some(ours), Some(theirs)) = (conn.server(), lock_server) {
                    if *ours != theirs {
                        // This observer reached another server than the
                        // standby's (its server turned read-only or became
                        // unreachable before the observer connected): the
                        // standby waits where nobody can be elected. Wake
                        // it at every check until it has moved here.
                        tracing::warn!(role = %role, standby = %format!("{}:{}", theirs.0, theirs.1), now = %format!("{}:{}", ours.0, ours.1), "a standby waits on another server than the one the connection settings now reach; reconnecting it");
                        shared.server_read_only.notify_waiters();
                    }
                }
            }
            drop(shared);
            if vacant && session_backend && now.standing > 0 {
                // The session backend's one zombie preemption, for this
                // role alone (it counts what it ends).
                let zombies = Zombies::one(&role, key, grace);
                preempt(conn.client(), &schema, &zombies, Some(&refused)).await?;
            }
            let until = Instant::now() + check_every;
            let woken_by = WakeOn::AnyChange {
                schema: schema.as_str(),
                role: &role,
            };
            tokio::select! {
                _ = self.stop.cancelled() => return Ok(()),
                _ = conn.closed().cancelled() => return Err(Error::connection_lost("observe the leader")),
                r = activity.changed() => {
                    if r.is_err() {
                        return Ok(());
                    }
                }
                end = sleep_until_woken(until, &mut notices, woken_by, &mut wakes, || Duration::ZERO) => {
                    if end == NapEnd::ChannelClosed {
                        return Err(Error::connection_lost("observe the leader"));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_events_are_parsed_per_schema() {
        assert_eq!(
            parse_leader_event("pgelect", "pgelect:released:a:b"),
            Some(("released", "a:b"))
        );
        assert_eq!(parse_leader_event("other", "pgelect:released:a"), None);
        assert_eq!(parse_leader_event("pgelect", "garbage"), None);
    }
}
