//! The candidate registry (`<schema>.candidates`, schema version 5): who
//! stands for a role, with which priority and timing; and the readiness
//! rules that decide whether a leader hands over to a *preferred*
//! candidate (one of strictly higher priority).
//!
//! Only pgelect's candidates may write the table (the grants of
//! `leaders`): another database user cannot register, so it cannot make a
//! leader hand over. A row alone never proves anything either: readiness
//! is read from what the server itself sets.
//!
//! * Session backend, blocking standby: ready while its registered backend
//!   pid (`pg_backend_pid()` of its lock connection, written by the server)
//!   waits, not granted, on the role's advisory lock in `pg_locks`.
//! * Session backend, polling standby: ready while that backend lives
//!   (`pg_stat_activity`) *and* still polls: its polls refresh `seen_at`
//!   (a write at most every [`polling_refresh`]), and a row not refreshed
//!   within [`polling_refresh`] + 2 polling intervals + 1 s is not ready
//!   (a candidate dropped from a shared connection that lives on for other
//!   roles, or a paused process). It tries the lock within its polling
//!   interval, and at once on the leader's release `NOTIFY`.
//! * Either way the backend must belong to the database user that wrote the
//!   row and, where the checking user may see it, have started before the
//!   row was written: a pid recycled by another session (possibly of a
//!   hostile user) after the candidate died is not taken for it.
//! * Lease backend: ready while `seen_at` (the server's `now()`, refreshed
//!   by the standby at least every `ttl / 2`) is within the candidate's own
//!   `ttl` of `now()`.
//!
//! Rows of candidates that died are harmless (never ready) and are deleted
//! opportunistically by the next registration of the role.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};

use crate::conn::DedicatedConnection;
use crate::error::{Error, Result};

use super::backend::among;
use super::timing::Timing;
use super::watch::RESIGN_CHANNEL;
use super::{ElectorState, StandbyMode};

/// A lease-backend row not refreshed for this many of its TTLs is deleted by
/// the next registration of the role.
const LEASE_ROW_STALE_TTLS: i64 = 10;

/// The timing an elector runs with, as stored in the registry (`timing`,
/// milliseconds, and the profile) for `pgelect status --json`: the same
/// object as [`TimingReport::to_json`](crate::election::TimingReport::to_json).
pub(crate) fn timing_json(t: &Timing) -> serde_json::Value {
    t.report().to_json()
}

/// The `timing` a candidate registers: [`timing_json`], with a polling
/// standby's `poll_interval_ms`. The candidates of a process mostly share
/// one timing: the last one built is kept and shared (10,000 roles built
/// it 10,000 times, 6 % of a candidate's CPU at a start).
fn registered_timing(t: &Timing, interval: Option<Duration>) -> Arc<serde_json::Value> {
    type Last = Option<((Timing, Option<Duration>), Arc<serde_json::Value>)>;
    static LAST: Mutex<Last> = Mutex::new(None);
    let key = (*t, interval);
    let mut last = LAST.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((k, v)) = last.as_ref() {
        if *k == key {
            return v.clone();
        }
    }
    let mut json = timing_json(t);
    if let Some(interval) = interval {
        json["poll_interval_ms"] = serde_json::json!(interval.as_millis() as u64);
    }
    let json = Arc::new(json);
    *last = Some((key, json.clone()));
    json
}

/// How often at most a polling standby's poll also refreshes its row's
/// `seen_at`: twice its interval, at least 5 s (a write per role every few
/// seconds, not one per poll).
pub(crate) fn polling_refresh(interval: Duration) -> Duration {
    (interval * 2).max(Duration::from_secs(5))
}

/// The SQL condition (on registry row `c`) that a polling standby still
/// polls: `seen_at` within [`polling_refresh`] + 2 intervals + 1 s, from
/// the interval it registered with (`timing.poll_interval_ms`).
fn polling_fresh_sql() -> &'static str {
    "c.seen_at >= now() - (greatest(2 * p.ms, 5000) + 2 * p.ms + 1000) * interval '1 millisecond'"
}

/// How a candidate waits, as stored in `candidates.standby`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waits {
    /// Session backend, in the lock queue (`lock_wait_slice`).
    Blocking,
    /// Session backend, `pg_try_advisory_lock` every interval.
    Polling,
    /// Lease backend: no server session to check.
    Lease,
}

impl Waits {
    fn backend(self) -> &'static str {
        match self {
            Waits::Blocking | Waits::Polling => "session",
            Waits::Lease => "lease",
        }
    }

    pub(crate) fn standby(self) -> Option<&'static str> {
        match self {
            Waits::Blocking => Some("blocking"),
            Waits::Polling => Some("polling"),
            Waits::Lease => None,
        }
    }
}

/// A candidate's registration: the values one element of the
/// registration statement ([`register_sql`]) binds.
pub(crate) struct Registration {
    pub(crate) role: String,
    pub(crate) node: String,
    pub(crate) priority: i32,
    pub(crate) standby: Option<&'static str>,
    pub(crate) timing: Arc<serde_json::Value>,
    pub(crate) meta: Option<serde_json::Value>,
    pub(crate) payload: String,
}

/// The arrays of one registration statement ([`register_sql`]), one
/// element per candidate, bound in this order by [`params`](Self::params).
pub(crate) struct Registrations<'a> {
    roles: Vec<&'a str>,
    nodes: Vec<&'a str>,
    priorities: Vec<i32>,
    standbys: Vec<Option<&'a str>>,
    timings: Vec<&'a serde_json::Value>,
    metas: Vec<Option<&'a serde_json::Value>>,
    payloads: Vec<&'a str>,
}

impl<'a> Registrations<'a> {
    pub(crate) fn of(part: impl ExactSizeIterator<Item = &'a Registration>) -> Self {
        let n = part.len();
        let mut r = Registrations {
            roles: Vec::with_capacity(n),
            nodes: Vec::with_capacity(n),
            priorities: Vec::with_capacity(n),
            standbys: Vec::with_capacity(n),
            timings: Vec::with_capacity(n),
            metas: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
        };
        for e in part {
            r.roles.push(&e.role);
            r.nodes.push(&e.node);
            r.priorities.push(e.priority);
            r.standbys.push(e.standby);
            r.timings.push(&e.timing);
            r.metas.push(e.meta.as_ref());
            r.payloads.push(&e.payload);
        }
        r
    }

    pub(crate) fn params(&self) -> [(&(dyn ToSql + Sync), Type); 7] {
        [
            (&self.roles, Type::TEXT_ARRAY),
            (&self.nodes, Type::TEXT_ARRAY),
            (&self.priorities, Type::INT4_ARRAY),
            (&self.standbys, Type::TEXT_ARRAY),
            (&self.timings, Type::JSONB_ARRAY),
            (&self.metas, Type::JSONB_ARRAY),
            (&self.payloads, Type::TEXT_ARRAY),
        ]
    }
}

/// The registration statement, of one candidate or many (a candidate
/// registering alone is a batch of one): for each, upserts its row (with
/// the server's `backend_pid` for the session backend, none for the lease
/// backend), deletes the role's rows of dead candidates, and, when the
/// current leader is registered with a lower priority (or not at all,
/// which counts as 0), sends it a hint on [`RESIGN_CHANNEL`] (a hint only
/// brings its next check forward).
///
/// Parameters, one array element per candidate ([`Registrations`]): `$1`
/// role, `$2` node, `$3` priority (int4), `$4` standby (text, NULL for the
/// lease backend), `$5` timing (jsonb), `$6` meta (jsonb), `$7` hint
/// payload (text). One row: rows deleted (int8), rows upserted, hints sent.
///
/// The roles' rows are reached by their primary keys ([`among`]; joined
/// on `r` alone, a batch of 2,000 in 10,000 rows scanned both tables).
pub(crate) fn register_sql(s: &str, waits: Waits) -> String {
    let (of_c, of_l) = (among("c", "r"), among("l", "r"));
    let backend = waits.backend();
    let pid = match waits {
        Waits::Lease => "NULL::int4",
        Waits::Blocking | Waits::Polling => "pg_catalog.pg_backend_pid()",
    };
    format!(
        "WITH r AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::int4[], $4::text[], $5::jsonb[],
                                  $6::jsonb[], $7::text[])
                        AS r(role, node, priority, standby, timing, meta, payload)
         ), me AS (
             INSERT INTO {s}.candidates AS c
                    (role, node, backend_pid, priority, backend, standby, timing, meta,
                     db_user, registered_at, seen_at)
             SELECT r.role, r.node, {pid}, r.priority, '{backend}', r.standby,
                    r.timing, r.meta, session_user, now(), now()
               FROM r
             ON CONFLICT (role, node) DO UPDATE
                SET backend_pid = EXCLUDED.backend_pid, priority = EXCLUDED.priority,
                    backend = EXCLUDED.backend, standby = EXCLUDED.standby,
                    timing = EXCLUDED.timing, meta = EXCLUDED.meta, db_user = session_user,
                    registered_at = CASE WHEN c.backend_pid IS NOT DISTINCT FROM EXCLUDED.backend_pid
                                         THEN c.registered_at ELSE now() END,
                    seen_at = now()
             RETURNING 1
         ), stale AS (
             DELETE FROM {s}.candidates c
              USING r
              WHERE c.role = r.role AND c.node <> r.node AND {of_c}
                AND CASE WHEN c.backend = 'session'
                         THEN NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a
                                           WHERE a.pid = c.backend_pid)
                         ELSE c.seen_at + {LEASE_ROW_STALE_TTLS}
                                * coalesce((c.timing->>'ttl_ms')::int8, 15000)
                                * interval '1 millisecond' < now() END
             RETURNING 1
         ), hint AS (
             -- Volatile: run once per candidate whose leader has a lower
             -- priority.
             SELECT pg_catalog.pg_notify('{RESIGN_CHANNEL}', r.payload)
               FROM r
              WHERE EXISTS (
                    SELECT 1 FROM {s}.leaders l
                      LEFT JOIN {s}.candidates lc ON lc.role = l.role AND lc.node = l.holder
                     WHERE l.role = r.role AND l.holder IS NOT NULL AND l.holder <> r.node
                       AND coalesce(lc.priority, 0) < r.priority AND {of_l})
         )
         SELECT (SELECT count(*) FROM stale), (SELECT count(*) FROM me), (SELECT count(*) FROM hint)"
    )
}

/// The registration statement for `schema` (see [`register_sql`]), as a
/// shared session sends it for its polling standbys, so that a test can
/// check its plan.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub fn shared_register_sql(schema: &crate::schema::SchemaName) -> String {
    register_sql(schema.as_str(), Waits::Polling)
}

/// Deletes this candidate's row: `$1` role, `$2` node.
pub(crate) fn withdraw_sql(s: &str) -> String {
    format!("DELETE FROM {s}.candidates WHERE role = $1 AND node = $2")
}

/// Session backend: an SQL scalar subquery, the node of the best ready
/// candidate of `role` whose priority is strictly higher than `priority`
/// (both SQL expressions, as is `node`, the asking candidate's, which is
/// left out), or NULL. With `ready` false: any such candidate whose backend
/// lives, waiting or not (a blocking standby between two wait slices, or
/// one that registered and is about to wait).
#[cfg(test)]
pub(crate) fn preferred_session_sql(
    s: &str,
    key: crate::key::LockKey,
    role: &str,
    node: &str,
    priority: &str,
    ready: bool,
) -> String {
    let (classid, objid, objsubid) = key.pg_locks_ids();
    let ids = (classid.to_string(), objid.to_string(), objsubid.to_string());
    preferred_session_sql_for(s, (&ids.0, &ids.1, &ids.2), role, node, priority, ready)
}

/// [`preferred_session_sql`] with the key's `pg_locks` ids as SQL
/// expressions (`classid`, `objid`, `objsubid`), for a statement over many
/// roles (the shared connection's batched renewal).
pub(crate) fn preferred_session_sql_for(
    s: &str,
    (classid, objid, objsubid): (&str, &str, &str),
    role: &str,
    node: &str,
    priority: &str,
    ready: bool,
) -> String {
    let waiting = if ready {
        let fresh = polling_fresh_sql();
        format!(
            "AND ((c.standby = 'polling' AND {fresh}) OR EXISTS (
                   SELECT 1 FROM pg_catalog.pg_locks l
                    WHERE l.pid = c.backend_pid AND l.locktype = 'advisory' AND NOT l.granted
                      AND l.database = a.datid AND l.classid = ({classid})::oid
                      AND l.objid = ({objid})::oid AND l.objsubid = ({objsubid})::int2))"
        )
    } else {
        String::new()
    };
    // The usual case (nobody of higher priority registered) costs an index
    // probe: a sub-select in a CASE branch not taken is never run, so
    // pg_stat_activity and pg_locks (which takes every lock-manager
    // partition lock) are read only when there is someone to check.
    format!(
        "(CASE WHEN EXISTS (
             SELECT 1 FROM {s}.candidates c
              WHERE c.role = {role} AND c.node <> {node} AND c.priority > {priority}
                AND c.backend = 'session')
         THEN (SELECT c.node FROM {s}.candidates c
           JOIN pg_catalog.pg_stat_activity a ON a.pid = c.backend_pid
           CROSS JOIN LATERAL (SELECT coalesce((c.timing->>'poll_interval_ms')::int8, 1000) AS ms) p
          WHERE c.role = {role} AND c.node <> {node} AND c.priority > {priority}
            AND c.backend = 'session'
            AND a.datid = (SELECT d.oid FROM pg_catalog.pg_database d
                            WHERE d.datname = pg_catalog.current_database())
            AND a.usename = c.db_user
            AND (a.backend_start IS NULL OR a.backend_start <= c.seen_at)
            {waiting}
          ORDER BY c.priority DESC, c.node LIMIT 1) END)"
    )
}

/// Lease backend: an SQL scalar subquery, the node of the best ready
/// candidate (seen within its own TTL) of `role` whose priority is strictly
/// higher than `priority`, other than `node`, or NULL.
pub(crate) fn preferred_lease_sql(s: &str, role: &str, node: &str, priority: &str) -> String {
    format!(
        "(SELECT c.node FROM {s}.candidates c
          WHERE c.role = {role} AND c.node <> {node} AND c.priority > {priority}
            AND c.backend = 'lease'
            AND c.seen_at + coalesce((c.timing->>'ttl_ms')::int8, 15000)
                            * interval '1 millisecond' >= now()
          ORDER BY c.priority DESC, c.node LIMIT 1)"
    )
}

/// The hint payload a registration sends on [`RESIGN_CHANNEL`]: the one a
/// leader of `role` listens for.
pub(crate) fn hint_payload(s: &str, role: &str) -> String {
    format!("{s}:{role}")
}

/// The longest a blocking or polling candidate that gave the lock back to a
/// preferred one waits before it stands in the queue again, after its
/// `yields`-th yield in a row: 20 ms doubling to 1 s. A blocking preferred
/// candidate is granted the lock at once (it waits in the queue); a polling
/// one needs time to try; and a preferred candidate that vanished costs at
/// most this much.
pub(crate) fn yield_pause(yields: u32) -> Duration {
    let ms = 20u64.saturating_mul(1 << yields.saturating_sub(1).min(6));
    Duration::from_millis(ms.min(1000))
}

/// A candidate's registration in the registry (see
/// [`registry`](crate::election::registry)).
pub(crate) struct Register {
    waits: Waits,
    standby: Option<&'static str>,
    timing: Arc<serde_json::Value>,
    payload: String,
}

impl Register {
    pub(crate) fn new(shared: &ElectorState, waits: Waits) -> Register {
        let s = shared.options.schema_name().as_str();
        let interval = match shared.session().map(|x| x.standby) {
            Some(StandbyMode::Polling { interval }) => Some(interval),
            _ => None,
        };
        Register {
            waits,
            standby: waits.standby(),
            timing: registered_timing(&shared.timing, interval),
            payload: hint_payload(s, &shared.role),
        }
    }

    /// This candidate's registration, alone or as an entry of a shared
    /// session's batched registration.
    pub(crate) fn entry(&self, shared: &ElectorState) -> Registration {
        Registration {
            role: shared.role.clone(),
            node: shared.node.clone(),
            priority: shared.priority,
            standby: self.standby,
            timing: self.timing.clone(),
            meta: shared.meta.clone(),
            payload: self.payload.clone(),
        }
    }

    /// Registers (upsert) on `conn`, a batch of one; the backend pid is the
    /// server's. The statement's text is built here, when a candidate
    /// registers alone: on a shared connection thousands register in one
    /// batched statement of the same text.
    pub(crate) async fn run(
        &self,
        shared: &ElectorState,
        conn: &DedicatedConnection,
    ) -> Result<()> {
        let s = shared.options.schema_name().as_str();
        let entry = self.entry(shared);
        let rows = Registrations::of(std::iter::once(&entry));
        let row = conn
            .client()
            .query_typed_one(&register_sql(s, self.waits), &rows.params())
            .await
            .map_err(|e| Error::db("register as a candidate", s, e))?;
        let stale: i64 = row
            .try_get(0)
            .map_err(|e| Error::db("register as a candidate", s, e))?;
        if stale > 0 {
            tracing::debug!(stale, "deleted registry rows of candidates that died");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::election::timing::TimingRequest;
    use crate::key::LockKey;

    #[test]
    fn timing_is_stored_in_milliseconds() {
        let t = TimingRequest::default().validate().unwrap();
        let j = timing_json(&t);
        assert_eq!(j["ttl_ms"], 15000);
        assert_eq!(j["safety_margin_ms"], 3000);
        assert_eq!(j["renew_every_ms"], 5000);
        assert_eq!(j["heartbeat_ms"], 1000);
        assert_eq!(j["heartbeat_timeout_ms"], 1000);
        assert_eq!(j["handover_delay_ms"], 2500);
        assert_eq!(j["profile"], "standard");
    }

    #[test]
    fn polling_standbys_refresh_every_few_seconds_not_every_poll() {
        assert_eq!(
            polling_refresh(Duration::from_secs(1)),
            Duration::from_secs(5)
        );
        assert_eq!(
            polling_refresh(Duration::from_secs(4)),
            Duration::from_secs(8)
        );
    }

    #[test]
    fn yield_pauses_double_to_a_second() {
        assert_eq!(yield_pause(1), Duration::from_millis(20));
        assert_eq!(yield_pause(2), Duration::from_millis(40));
        assert_eq!(yield_pause(7), Duration::from_millis(1000));
        assert_eq!(yield_pause(u32::MAX), Duration::from_millis(1000));
    }

    #[test]
    fn readiness_is_strictly_higher_and_checked_against_the_server() {
        let key = LockKey::from_name("election:pgelect:r").unwrap();
        let ready = preferred_session_sql("pgelect", key, "$1", "$2", "$5", true);
        assert!(ready.contains("c.priority > $5"), "{ready}");
        assert!(ready.contains("NOT l.granted"), "{ready}");
        assert!(ready.contains("a.usename = c.db_user"), "{ready}");
        assert!(
            ready.contains("c.standby = 'polling' AND c.seen_at >="),
            "{ready}"
        );
        let alive = preferred_session_sql("pgelect", key, "$1", "$2", "$5", false);
        assert!(!alive.contains("pg_locks"), "{alive}");
        assert!(preferred_lease_sql("pgelect", "$1", "$2", "$8").contains("c.priority > $8"));
    }
}
