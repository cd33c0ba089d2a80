//! What `pgelect status` shows: every role with its leader, term, lease,
//! candidates and squatters, computed in one statement on the server (whose
//! clock decides leases), and the server that answered.

use std::time::SystemTime;

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

use super::locks::{seconds, HeldLock};
use crate::election::Term;
use crate::error::{Error, Result};
use crate::lock::{LockHolder, LockMode};
use crate::schema::SchemaName;

/// Everything an operator looks at: the server, every role, and the locks
/// of named lock sessions ([`AdminClient::status`](super::AdminClient::status)).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Status {
    /// The server that answered.
    pub server: ServerInfo,
    /// Every role, by name.
    pub roles: Vec<RoleStatus>,
    /// Every lock held or waited for by a named lock session.
    pub locks: Vec<HeldLock>,
}

/// One role: its leader as the lease row names it, its last term, and who
/// stands for it. All times are the server's.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RoleStatus {
    /// The role.
    pub role: String,
    /// The leader's node as the lease row names it; `None` when nobody
    /// leads.
    pub holder: Option<String>,
    /// The role's last term (the current one while a leader holds it);
    /// `0` for a role that was never led (its lock is taken, no row yet).
    pub term: Term,
    /// The backend that elected the last leader (`session` or `lease`).
    pub backend: Option<String>,
    /// When the last term began, on the server's clock.
    pub acquired_at: Option<SystemTime>,
    /// When the leader's lease ends unless renewed, on the server's clock;
    /// `None` when nobody leads.
    pub lease_until: Option<SystemTime>,
    /// Milliseconds left on the lease when read, on the server's clock;
    /// negative when it expired that long ago (the leader is frozen,
    /// partitioned or gone); `None` when nobody leads.
    pub lease_remaining_ms: Option<i64>,
    /// The candidates: the holder first, then those standing by, by age.
    pub candidates: Vec<Candidate>,
    /// Sessions holding the role's lock that are not the leader its lease
    /// row names: another user (or a stray session) took the key, and no
    /// candidate can take over until it lets go. Their `application_name`
    /// is a claim: anyone can call themselves `pgelect:<role>:<node>`.
    pub squatters: Vec<LockHolder>,
}

impl RoleStatus {
    /// True when the leader's lease had expired on the server's clock when
    /// read; `None` when nobody leads.
    pub fn lease_expired(&self) -> Option<bool> {
        self.lease_remaining_ms.map(|ms| ms < 0)
    }
}

/// What a candidate is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CandidateState {
    /// It holds the role's lock (session backend) or its lease (lease
    /// backend): the leader.
    Holding,
    /// It waits for the role's lock (a blocking standby).
    Waiting,
    /// It stands without waiting on a lock: a polling standby, a
    /// lease-backend candidate seen within its TTL.
    Standing,
}

impl CandidateState {
    /// `holding`, `waiting` or `standing`.
    pub fn as_str(self) -> &'static str {
        match self {
            CandidateState::Holding => "holding",
            CandidateState::Waiting => "waiting",
            CandidateState::Standing => "standing",
        }
    }
}

impl std::fmt::Display for CandidateState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A candidate of a role, as the server sees it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Candidate {
    /// Its node id, from the candidate registry, else from its
    /// `application_name` (`pgelect:<role>:<node>`, cut at 63 bytes by the
    /// server).
    pub node: String,
    /// The server process serving its connection (`pg_stat_activity.pid`),
    /// not the candidate's own process id; `None` for a lease-backend
    /// candidate, which holds no connection.
    pub backend_pid: Option<i32>,
    /// Its address as the server sees it; `None` over a Unix socket or when
    /// this user may not see it.
    pub client_addr: Option<String>,
    /// What it is doing.
    pub state: CandidateState,
    /// Its priority, from the candidate registry; `None` if it did not
    /// register (a pgelect older than schema 5).
    pub priority: Option<i32>,
    /// The timing it runs with (milliseconds), from the registry, as the
    /// candidate wrote it.
    pub timing: Option<serde_json::Value>,
}

/// The server that answered: with several hosts in the connection
/// settings, the one reached, which is where the candidates listed are
/// connected.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerInfo {
    /// `address:port`, or `local socket`.
    pub addr: String,
    /// True when it refuses writes (`transaction_read_only`).
    pub read_only: bool,
    /// True on a standby (`pg_is_in_recovery()`).
    pub in_recovery: bool,
    /// The WAL timeline (raised by every promotion); `None` on a standby.
    pub timeline: Option<i64>,
    /// `server_version`.
    pub version: String,
}

impl ServerInfo {
    /// `standby`, `primary, read-only` or `primary`.
    pub fn kind(&self) -> &'static str {
        match (self.in_recovery, self.read_only) {
            (true, _) => "standby",
            (false, true) => "primary, read-only",
            (false, false) => "primary",
        }
    }
}

/// Reads the server's identity.
pub(crate) async fn server<C: GenericClient + Sync>(client: &C) -> Result<ServerInfo> {
    const WHAT: &str = "read which server this is";
    let sql = "SELECT coalesce(host(inet_server_addr()) || ':' || inet_server_port(), 'local socket'),
            current_setting('transaction_read_only')::bool, pg_is_in_recovery(),
            CASE WHEN pg_is_in_recovery() THEN NULL
                 ELSE ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::int8 END,
            current_setting('server_version')";
    let row = client
        .query_one(sql, &[])
        .await
        .map_err(|e| Error::db(WHAT, "\0", e))?;
    let decode = || -> std::result::Result<ServerInfo, tokio_postgres::Error> {
        Ok(ServerInfo {
            addr: row.try_get(0)?,
            read_only: row.try_get(1)?,
            in_recovery: row.try_get(2)?,
            timeline: row.try_get(3)?,
            version: row.try_get(4)?,
        })
    };
    decode().map_err(|e| Error::db(WHAT, "\0", e))
}

/// The key in `holder_meta` that marks a role as forgotten
/// ([`AdminClient::forget`](super::AdminClient::forget)): the row stays,
/// so that its term does, and is not listed while nobody stands again.
/// Every election overwrites `holder_meta`, and so removes the mark.
pub(crate) const FORGOTTEN: &str = "pgelect_forgotten";

/// The name a role's election key is hashed from, less the role:
/// `election:<schema>:` (see `election::role_key`).
pub(crate) fn role_key_prefix(schema: &SchemaName) -> String {
    format!("election:{schema}:")
}

/// The same for the key blocking standbys queue for (`election::watch_key`).
pub(crate) fn watch_key_prefix(schema: &SchemaName) -> String {
    format!("election-watch:{schema}:")
}

/// The status statement. Parameters: `$1` the role (or `NULL` for every
/// role), `$2` and `$3` the prefixes of the role's lock and watch key
/// names, `$4` the forgotten mark.
fn status_sql(schema: &SchemaName) -> String {
    // Everything is computed on the server: its clock decides leases.
    // The roles: those with a row, the one asked for, and those whose key a
    // backend calling itself `pgelect:<role>:<node>` holds or waits for (a
    // role whose lock was squatted before anyone was elected has no row).
    format!(
        "WITH locks AS (
            SELECT pl.pid, pl.granted, pl.classid, pl.objid, pl.mode
              FROM pg_locks pl
             WHERE pl.locktype = 'advisory' AND pl.objsubid = 1
               AND pl.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        ), claimed AS (
            SELECT DISTINCT split_part(a.application_name, ':', 2) AS role, lk.classid, lk.objid
              FROM pg_stat_activity a JOIN locks lk ON lk.pid = a.pid
             WHERE $1::text IS NULL AND a.datname = current_database()
               AND starts_with(a.application_name, 'pgelect:')
               AND split_part(a.application_name, ':', 2) <> ''
               AND split_part(a.application_name, ':', 3) <> ''
        ), names AS (
            SELECT l.role FROM {schema}.leaders l
             WHERE ($1::text IS NULL OR l.role = $1)
               AND NOT (l.holder IS NULL AND coalesce(l.holder_meta ? $4::text, false))
            UNION SELECT $1::text WHERE $1::text IS NOT NULL AND $1::text <> ''
            UNION SELECT c.role FROM claimed c
             CROSS JOIN LATERAL (SELECT {schema}.key($2::text || c.role) AS k) ck
             WHERE c.classid = ((ck.k >> 32) & 4294967295)::oid AND c.objid = (ck.k & 4294967295)::oid
        ), r AS (
            SELECT n.role, l.holder, coalesce(l.term, 0) AS term, l.backend, l.holder_pid,
                   l.acquired_at,
                   CASE WHEN l.holder IS NULL THEN NULL ELSE l.lease_until END AS lease_until,
                   CASE WHEN l.holder IS NULL THEN NULL
                        ELSE (extract(epoch FROM (l.lease_until - now())) * 1000)::bigint END AS lease_ms,
                   {schema}.key($2::text || n.role) AS k,
                   {schema}.key($3::text || n.role) AS wk,
                   l.role IS NOT NULL
                     AND NOT (l.holder IS NULL AND coalesce(l.holder_meta ? $4::text, false)) AS has_row
              FROM names n LEFT JOIN {schema}.leaders l ON l.role = n.role
        )
        SELECT r.role, r.holder, r.term, r.backend, r.acquired_at, r.lease_until, r.lease_ms,
               coalesce((
                 SELECT json_agg(x.j ORDER BY x.holding DESC NULLS LAST, x.since) FROM (
                 SELECT json_build_object(
                          'node', coalesce(rc.node,
                                  CASE WHEN starts_with(a.application_name, 'pgelect:' || r.role || ':')
                                       THEN substr(a.application_name, length('pgelect:' || r.role || ':') + 1)
                                       ELSE a.application_name END),
                          'backend_pid', a.pid, 'client_addr', host(a.client_addr),
                          'state', CASE WHEN lk.granted THEN 'holding'
                                        WHEN lk.pid IS NOT NULL OR wl.pid IS NOT NULL THEN 'waiting'
                                        ELSE 'standing' END,
                          'priority', rc.priority, 'timing', rc.timing) AS j,
                        lk.granted AS holding, a.backend_start AS since
                   FROM pg_stat_activity a
                   LEFT JOIN locks lk ON lk.pid = a.pid
                    AND lk.classid = ((r.k >> 32) & 4294967295)::oid AND lk.objid = (r.k & 4294967295)::oid
                   -- A blocking standby queues for the role's watch key
                   -- (held by the one standby in the role's lock queue,
                   -- which checks the row between two waits): waiting too.
                   LEFT JOIN locks wl ON wl.pid = a.pid
                    AND wl.classid = ((r.wk >> 32) & 4294967295)::oid AND wl.objid = (r.wk & 4294967295)::oid
                   -- The registry (schema 5): priority and timing, matched
                   -- by the backend pid the server wrote at registration.
                   LEFT JOIN {schema}.candidates rc ON rc.role = r.role AND rc.backend = 'session'
                    AND rc.backend_pid = a.pid
                  WHERE a.datname = current_database()
                    -- Holders and waiters are found by the role's lock key,
                    -- whatever their application_name (PostgreSQL cuts it at
                    -- 63 bytes and keeps ASCII only); polling standbys, which
                    -- hold no lock entry, by their name. A holder that is not
                    -- the row's is a squatter, listed apart.
                    AND (lk.pid IS NOT NULL OR wl.pid IS NOT NULL
                         OR starts_with(a.application_name, 'pgelect:' || r.role || ':'))
                    AND NOT (coalesce(lk.granted, false)
                             AND a.pid IS DISTINCT FROM r.holder_pid)
                 UNION ALL
                 -- Lease-backend candidates hold no connection: those seen
                 -- within their TTL, and the holder.
                 SELECT json_build_object('node', c.node, 'backend_pid', NULL, 'client_addr', NULL,
                          'state', CASE WHEN c.node = r.holder THEN 'holding' ELSE 'standing' END,
                          'priority', c.priority, 'timing', c.timing),
                        c.node = r.holder, c.registered_at
                   FROM {schema}.candidates c
                  WHERE c.role = r.role AND c.backend = 'lease'
                    AND (c.node = r.holder
                         OR c.seen_at + coalesce((c.timing->>'ttl_ms')::int8, 15000)
                                        * interval '1 millisecond' >= now())
                 ) x
               ), '[]'::json)::text AS candidates,
               coalesce((
                 SELECT json_agg(json_build_object(
                          'pid', lk.pid, 'user', a.usename,
                          'application_name', coalesce(a.application_name, ''),
                          'client_addr', host(a.client_addr), 'mode', lk.mode,
                          'state_age', extract(epoch FROM now() - a.state_change)::float8)
                          ORDER BY lk.pid)
                   FROM locks lk LEFT JOIN pg_stat_activity a ON a.pid = lk.pid
                  WHERE lk.classid = ((r.k >> 32) & 4294967295)::oid AND lk.objid = (r.k & 4294967295)::oid
                    AND lk.granted AND lk.pid IS DISTINCT FROM r.holder_pid
               ), '[]'::json)::text AS squatters,
               r.has_row
          FROM r
         ORDER BY r.role"
    )
}

/// The roles (every one, or `role` alone), as the status statement reads
/// them. A role asked for by name that nobody stands for, holds or waits
/// for and that has no row is left out.
pub(crate) async fn roles<C: GenericClient + Sync>(
    client: &C,
    schema: &SchemaName,
    role: Option<&str>,
) -> Result<Vec<RoleStatus>> {
    const WHAT: &str = "read the leaders table";
    let rows = client
        .query_typed(
            &status_sql(schema),
            &[
                (&role, Type::TEXT),
                (&role_key_prefix(schema), Type::TEXT),
                (&watch_key_prefix(schema), Type::TEXT),
                (&FORGOTTEN, Type::TEXT),
            ],
        )
        .await
        .map_err(|e| Error::db(WHAT, schema.as_str(), e))?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let status = decode(&row).map_err(|e| Error::db(WHAT, schema.as_str(), e))?;
        if let Some(status) = status {
            out.push(status);
        }
    }
    Ok(out)
}

/// One row of the status statement; `None` for a role without a row,
/// candidates or squatters.
fn decode(
    row: &tokio_postgres::Row,
) -> std::result::Result<Option<RoleStatus>, tokio_postgres::Error> {
    let candidates: String = row.try_get(7)?;
    let candidates: Vec<Candidate> = json_array(&candidates)
        .iter()
        .map(|c| Candidate {
            node: c["node"].as_str().unwrap_or_default().to_owned(),
            backend_pid: c["backend_pid"].as_i64().map(|p| p as i32),
            client_addr: c["client_addr"].as_str().map(str::to_owned),
            state: match c["state"].as_str() {
                Some("holding") => CandidateState::Holding,
                Some("waiting") => CandidateState::Waiting,
                _ => CandidateState::Standing,
            },
            priority: c["priority"].as_i64().map(|p| p as i32),
            timing: Some(c["timing"].clone()).filter(|t| t.is_object()),
        })
        .collect();
    let squatters: String = row.try_get(8)?;
    let squatters: Vec<LockHolder> = json_array(&squatters)
        .iter()
        .map(|q| LockHolder {
            pid: q["pid"].as_i64().unwrap_or_default() as i32,
            user: q["user"].as_str().map(str::to_owned),
            application_name: q["application_name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            client_addr: q["client_addr"].as_str().map(str::to_owned),
            mode: if q["mode"].as_str() == Some("ShareLock") {
                LockMode::Shared
            } else {
                LockMode::Exclusive
            },
            state_age: seconds(q["state_age"].as_f64()),
        })
        .collect();
    let has_row: bool = row.try_get(9)?;
    if !has_row && candidates.is_empty() && squatters.is_empty() {
        return Ok(None);
    }
    Ok(Some(RoleStatus {
        role: row.try_get(0)?,
        holder: row.try_get(1)?,
        term: Term::new(row.try_get(2)?),
        backend: row.try_get(3)?,
        acquired_at: row.try_get(4)?,
        lease_until: row.try_get(5)?,
        lease_remaining_ms: row.try_get(6)?,
        candidates,
        squatters,
    }))
}

/// The elements of a JSON array the server built; none for anything else.
fn json_array(text: &str) -> Vec<serde_json::Value> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Array(a)) => a,
        _ => Vec::new(),
    }
}

/// The error for a role the schema does not know, naming those it does.
pub(crate) async fn unknown_role<C: GenericClient + Sync>(
    client: &C,
    schema: &SchemaName,
    role: &str,
) -> Error {
    match roles(client, schema, None).await {
        Ok(known) => Error::UnknownRole {
            role: role.to_owned(),
            schema: schema.as_str().to_owned(),
            known: known.into_iter().map(|r| r.role).collect(),
        },
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::LockKey;

    #[test]
    fn the_key_prefixes_are_the_electors() {
        let schema = SchemaName::new("ops").unwrap();
        for role in ["r", "a:b", "orders/7"] {
            assert_eq!(
                LockKey::from_name(&format!("{}{role}", role_key_prefix(&schema))).unwrap(),
                crate::election::role_key(schema.as_str(), role)
            );
            assert_eq!(
                LockKey::from_name(&format!("{}{role}", watch_key_prefix(&schema))).unwrap(),
                crate::election::watch_key(schema.as_str(), role)
            );
        }
    }
}
