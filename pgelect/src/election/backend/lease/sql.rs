//! The lease backend's statements: one SQL text per operation (acquire,
//! renew, release; the registration is the registry's batched one), each
//! taking one array element per role, for a lone candidate (a batch of one)
//! as for thousands on a shared client. Behind one seam: the client's
//! [`acquire`](SharedLease::acquire), [`renew`](SharedLease::renew),
//! [`clear`](SharedLease::clear) and [`register`](SharedLease::register),
//! which bind the parameters, send the statement (see `SharedLease::exec`)
//! and decode its rows; every caller goes through them. The acquire,
//! renewal and release are also the schema's functions (migration 9,
//! [`functions_sql`]), called instead of sent whole where installed with
//! this version's source: the server then plans them once per server
//! process.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use crate::election::backend::batch::among;
use crate::error::{Error, Result};

use crate::election::registry::{self, Registration, Registrations};
use crate::election::term::{next_term_sql, rearm_lease_sql, stale_row_sql, TIMELINE_SQL};
use crate::election::watch::LEADER_CHANNEL;
use crate::schema::SchemaName;

use super::keep::Renewal;
use super::{Op, SharedLease, Sql};

/// The client's statements: the lease backend's, one SQL text per
/// operation, each taking one array element per role (see [`LeaseSql`]),
/// sent whole or as calls of the schema's functions that run them.
pub(super) struct Statements {
    pub(super) sql: LeaseSql,
    /// The same operations as calls of the schema's lease functions
    /// ([`functions_sql`]), used while [`FUNCTIONS_CHECK`] finds them
    /// installed with these very statements.
    pub(super) calls: LeaseSql,
    /// [`FUNCTIONS_CHECK`]'s parameters: each function's signature and
    /// the source it must have.
    pub(super) check: (Vec<String>, Vec<String>),
    pub(super) register: String,
}

impl Statements {
    pub(super) fn new(schema: &SchemaName) -> Statements {
        let s = schema.as_str();
        let sql = lease_sql(schema);
        let check = FUNCTIONS
            .iter()
            .zip(sql.each())
            .map(|(f, body)| (f.signature(s), function_source(s, body)))
            .unzip();
        Statements {
            calls: LeaseSql {
                acquire: FUNCTIONS[0].call(s),
                renew: FUNCTIONS[1].call(s),
                release: FUNCTIONS[2].call(s),
            },
            sql,
            check,
            register: registry::register_sql(s, registry::Waits::Lease),
        }
    }
}

/// One of the lease functions of the schema (migration 9): the acquire,
/// renewal and release, each a PL/pgSQL function running the statement of
/// [`LeaseSql`] with its arguments. The server plans a function's
/// statement once per server process (a generic plan, forced: the batch's
/// size is not known to it, and the statements reach their rows by index
/// whatever it is; see the `election::plans` test) instead of at every
/// call: through a pooler in transaction mode, where statements cannot be
/// prepared, the acquire cost 1.9 ms of parsing and 3.7 ms of planning for
/// 0.7 ms of execution, on every poll and at every handover.
struct Function {
    name: &'static str,
    /// Argument types, in order (`$1`, `$2`, …).
    args: &'static [&'static str],
    /// The result columns, as the statement returns them.
    columns: &'static str,
}

/// The lease functions, in [`LeaseSql::each`]'s order.
const FUNCTIONS: [Function; 3] = [
    Function {
        name: "lease_acquire",
        args: &[
            "text[]", "text[]", "jsonb[]", "int8[]", "text[]", "int4[]", "int8", "int8[]",
        ],
        columns: "won_term int8, won_at timestamptz, won_until timestamptz, won_ms float8, \
                  prev_holder text, prev_backend text, prev_ms float8, notified text, \
                  deferred_to text, rearmed boolean, of_role text, seen_ms float8",
    },
    Function {
        name: "lease_renew",
        args: &["text[]", "text[]", "int8[]", "int8[]", "int4[]"],
        columns: "of_role text, left_ms float8, resign boolean, ready text, \
                  at timestamptz, until timestamptz, renewed boolean",
    },
    Function {
        name: "lease_release",
        args: &["text[]", "text[]", "int8[]", "text[]"],
        columns: "cleared int8, notified int8",
    },
];

impl Function {
    /// `schema.name(types)`, as `to_regprocedure` and `GRANT` take it.
    fn signature(&self, s: &str) -> String {
        format!("{s}.{}({})", self.name, self.args.join(", "))
    }

    /// The call the client sends.
    fn call(&self, s: &str) -> String {
        let args: Vec<String> = (1..=self.args.len()).map(|i| format!("${i}")).collect();
        format!("SELECT * FROM {s}.{}({})", self.name, args.join(", "))
    }
}

/// The source of the function that runs `statement` (of schema `s`): its
/// `$n` are the function's arguments (`$1` the roles, in all three); the
/// result columns' names never shadow a table's columns (`use_column`).
///
/// The plan the server process keeps (`force_generic_plan`, see
/// [`functions_sql`]) is made at its first call, from the tables' sizes
/// then. At a fleet's first start that is when they are empty, and such a
/// plan joins a batch of thousands the wrong way round (a nested loop
/// that reads the batch again for every row of the table, or the table's
/// range for every row of the batch) until autovacuum's first `ANALYZE`
/// makes the server plan again: an acquire of 5,000 roles took 6-12 s,
/// a renewal of 2,000 took 2 s. So a call whose batch is larger than
/// [`CUSTOM_PLAN_ROWS`] and than what the statistics say either table
/// holds (`reltuples`, -1 before the first `ANALYZE`) is planned for
/// itself, with its arrays and today's table sizes (80 ms and 40 ms
/// then). Once the statistics have caught up the kept plan serves again;
/// a small batch (a handover, a lone candidate) always takes it.
fn function_source(s: &str, statement: &str) -> String {
    format!(
        "
#variable_conflict use_column
BEGIN
    IF pg_catalog.cardinality($1) > {CUSTOM_PLAN_ROWS}
       AND (SELECT pg_catalog.min(c.reltuples) FROM pg_catalog.pg_class c
             WHERE c.oid IN ('{s}.leaders'::pg_catalog.regclass,
                             '{s}.candidates'::pg_catalog.regclass))
           < pg_catalog.cardinality($1) THEN
        SET LOCAL plan_cache_mode = force_custom_plan;
    END IF;
    RETURN QUERY {statement};
END
"
    )
}

/// The batch size above which a lease function's call may be planned for
/// itself (see [`function_source`]): planning a call costs about 1 ms for
/// a few roles and 6 ms for 5,000, so only where a wrong kept plan would
/// cost far more. A
/// wrong plan's cost grows with the batch times the table; at 64 roles it
/// is tens of milliseconds at 10,000 roles, against seconds at 5,000.
const CUSTOM_PLAN_ROWS: usize = 64;

/// Migration 9's lease functions for schema `schema`: created (or
/// replaced) from this version's statements, executable only by the users
/// who may already write the leaders table (the candidates, as
/// [`grant_statements`](crate::admin::grant_statements) grants them), not
/// by `PUBLIC`. They run with the caller's rights (no `SECURITY DEFINER`):
/// a call can do nothing the statement sent whole could not.
///
/// A later version whose statements differ installs its own in a new
/// migration; until then its clients find the installed source different
/// ([`FUNCTIONS_CHECK`]) and send the statements whole, as they do without
/// the `EXECUTE` grant: slower, never different.
pub(crate) fn functions_sql(schema: &SchemaName) -> String {
    let s = schema.as_str();
    let sql = lease_sql(schema);
    let mut out = String::new();
    for (f, body) in FUNCTIONS.iter().zip(sql.each()) {
        let sig = f.signature(s);
        out.push_str(&format!(
            "CREATE OR REPLACE FUNCTION {sig} RETURNS TABLE ({columns})
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan
AS $pgelect_fn${source}$pgelect_fn$;
COMMENT ON FUNCTION {sig} IS 'pgelect: the lease backend''s {name} statement, planned once per server process; runs with the caller''s rights';
REVOKE ALL ON FUNCTION {sig} FROM PUBLIC;
",
            columns = f.columns,
            source = function_source(s, body),
            name = f.name.trim_start_matches("lease_"),
        ));
    }
    // The candidates of earlier versions were granted rights on the table:
    // whoever may update it may call the functions.
    let sigs: Vec<String> = FUNCTIONS.iter().map(|f| f.signature(s)).collect();
    out.push_str(&format!(
        crate::schema::grant_to_leader_updaters!("GRANT EXECUTE ON FUNCTION {sigs}"),
        s = s,
        sigs = sigs.join(", ")
    ));
    out
}

/// The grant a candidate needs to call the lease functions (see
/// [`functions_sql`]).
pub(crate) fn functions_grant(schema: &SchemaName, user: &str) -> String {
    let s = schema.as_str();
    let sigs: Vec<String> = FUNCTIONS.iter().map(|f| f.signature(s)).collect();
    format!("GRANT EXECUTE ON FUNCTION {} TO {user}", sigs.join(", "))
}

/// Whether the schema's lease functions are installed with this version's
/// statements and this user may call them: `$1` the signatures, `$2` the
/// sources ([`Statements::check`]). Read by each new lease connection.
/// Not on PostgreSQL 13, whose PL/pgSQL runs `RETURN QUERY` through a
/// cursor: there the 300-role shared-lease test lost leases at steady
/// state in one CI run of two (not explained yet), so the statements are
/// sent whole as before.
pub(super) const FUNCTIONS_CHECK: &str = "SELECT count(*) = pg_catalog.cardinality($1::text[])
       FROM unnest($1::text[], $2::text[]) AS f(sig, src)
       JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(f.sig)
      WHERE p.prosrc = f.src AND pg_catalog.has_function_privilege(p.oid, 'EXECUTE')
        AND pg_catalog.current_setting('server_version_num')::int >= 140000";

/// The lease backend's statements, exactly as the client sends them: one
/// SQL text per operation, each taking one array element per role, for a
/// lone candidate (a batch of one) as for thousands on a shared client.
///
/// Exposed (hidden from the docs) so that integration tests run the very
/// statements the client runs. Parameters and rows:
///
/// * `acquire`: `$1` roles (text[]), `$2` nodes (text[]), `$3` holder
///   metas (jsonb[]), `$4` TTLs in ms (int8[]), `$5` NOTIFY payloads
///   (text[]), `$6` priorities (int4[]); then `$7` this attempt's random
///   token (int8) and `$8` the tokens of this client's earlier attempts
///   that got no answer (int8[]): a lease one of them took (it names the
///   same node) is taken again. A role is taken when its row is missing,
///   has no holder, or its lease expired on the server's clock, and no
///   ready candidate of strictly higher priority is registered. One row
///   per role: won term (int8, NULL if not won), acquired_at, lease_until,
///   remaining ms of the new lease (float8), then the row as it was
///   before: holder, backend, remaining ms (float8, negative if expired);
///   then the NOTIFY (text), the preferred candidate it deferred to (text,
///   NULL if none), whether the row was re-armed instead (bool), the
///   role (text), and the age in ms of the standby's registration
///   (float8: 0 when this poll refreshed its `seen_at`, which it does once
///   it is half a TTL old; NULL when the standby has no registration row).
/// * `renew`: `$1` roles, `$2` nodes, `$3` terms (int8[]), `$4` TTLs in ms,
///   `$5` priorities. A row per role whose lease is still its node's with
///   its term: role, remaining ms (float8), resign_requested, the node of a
///   ready candidate of strictly higher priority (or NULL), renewed_at,
///   lease_until, renewed (bool: false when a fenced transaction holds the
///   row, which is then skipped, not waited for). No row: not ours.
/// * `release`: `$1` roles, `$2` nodes, `$3` terms, `$4` NOTIFY payloads.
///   One row: the number of rows cleared (int8).
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct LeaseSql {
    /// Takes the leases that are free or expired (inserting missing rows
    /// with term 1).
    pub acquire: String,
    /// Renews the leases whose holder and term are still the given ones.
    pub renew: String,
    /// Clears the holders whose holder and term are still the given ones.
    pub release: String,
}

impl LeaseSql {
    /// The acquire, the renewal and the release, in that order.
    fn each(&self) -> [&str; 3] {
        [&self.acquire, &self.renew, &self.release]
    }
}

/// The lease statements for `schema`; see [`LeaseSql`].
#[doc(hidden)]
pub fn lease_sql(schema: &SchemaName) -> LeaseSql {
    let s = schema.as_str();
    LeaseSql {
        acquire: acquire_sql(s),
        renew: renew_sql(s),
        release: release_sql(s),
    }
}

/// The acquire (see [`LeaseSql::acquire`]). `cur` reads the rows as of the
/// statement's snapshot; the upsert locks the latest version and re-checks
/// its WHERE on it (READ COMMITTED), so of concurrent candidates exactly
/// one wins a role, whatever `cur` showed. Rows that are held are only
/// read, never locked or written: a poll of thousands of led roles writes
/// nothing.
fn acquire_sql(s: &str) -> String {
    let (first, next) = (next_term_sql("0"), next_term_sql("l.term"));
    let pref = registry::preferred_lease_sql(s, "a.role", "a.node", "a.priority");
    // `stale`: rows that may lack the old primary's last writes (a promoted
    // server) are re-armed for a full TTL instead of taken over, once per
    // timeline (see term.rs). `lost` rows (our own unanswered attempt) are
    // taken again as before: nobody acts on them.
    let tl = "(SELECT t FROM tl)";
    let stale = stale_row_sql("l", tl);
    let rearm = rearm_lease_sql("l", "c.ttl_ms", tl);
    let (of_a, of_stale) = (among("l", "a"), among("l", "cur"));
    let reg_of_a = among("c", "a");
    format!(
        "WITH tl AS (
             SELECT {TIMELINE_SQL} AS t
         ), a AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::jsonb[], $4::int8[], $5::text[],
                                  $6::int4[])
                        AS a(role, node, meta, ttl_ms, payload, priority)
         ), cur AS (
             SELECT a.role, a.ttl_ms, l.holder, l.backend, l.lease_until,
                    (l.role IS NULL OR l.holder IS NULL AND l.lease_timeline IS DISTINCT FROM {tl}
                     OR l.lease_until IS NULL OR l.lease_until < now()) AS free,
                    coalesce(l.holder = a.node AND l.lease_token = ANY($8::int8[]), false) AS lost,
                    coalesce({stale}, false) AS stale
               FROM a LEFT JOIN {s}.leaders l ON l.role = a.role AND {of_a}
         ), rearm AS (
             UPDATE {s}.leaders AS l SET {rearm}
               FROM cur c
              WHERE l.role = c.role AND c.stale AND NOT c.lost AND {stale} AND {of_stale}
             RETURNING l.role, l.lease_until
         ), try AS (
             SELECT a.*, cur.lost, CASE WHEN cur.free THEN {pref} END AS pref
               FROM a JOIN cur ON cur.role = a.role
              WHERE (cur.free AND NOT cur.stale) OR cur.lost
         ), up AS (
             INSERT INTO {s}.leaders AS l
                    (role, holder, holder_meta, term, backend, holder_pid,
                     acquired_at, renewed_at, lease_until, resign_requested, lease_token)
             SELECT t.role, t.node, t.meta, {first}, 'lease', NULL, now(), now(),
                    now() + t.ttl_ms * interval '1 millisecond', false, $7
               FROM try t
              WHERE t.pref IS NULL OR t.lost
              ORDER BY t.role
             ON CONFLICT (role) DO UPDATE
                SET holder = EXCLUDED.holder, holder_meta = EXCLUDED.holder_meta,
                    term = {next}, backend = 'lease', holder_pid = NULL,
                    acquired_at = EXCLUDED.acquired_at, renewed_at = EXCLUDED.renewed_at,
                    lease_until = EXCLUDED.lease_until, resign_requested = false,
                    lease_token = EXCLUDED.lease_token
              WHERE ((l.holder IS NULL AND l.lease_timeline IS DISTINCT FROM {tl}
                      OR l.lease_until IS NULL OR l.lease_until < now())
                     AND NOT {stale})
                 -- a lease taken by one of our own unanswered acquires:
                 -- nobody acts on it, take it again with a new term
                 OR (l.holder = EXCLUDED.holder AND l.lease_token = ANY($8::int8[]))
             RETURNING l.role, l.term, l.acquired_at, l.lease_until
         ), reg AS MATERIALIZED (
             -- MATERIALIZED: used once, it was inlined into the final
             -- join, which the generic plan (batch size unknown) made a
             -- nested loop over the batch with this join inside: 5,000
             -- standbys of new roles cost 5 s.
             SELECT c.role, c.seen_at
               FROM {s}.candidates c JOIN a ON c.role = a.role AND c.node = a.node
              WHERE c.backend = 'lease' AND {reg_of_a}
         ), seen AS (
             -- The registration's `seen_at`, refreshed by the poll itself
             -- once it is half a TTL old: a standby that polls costs one
             -- statement, not a poll and a registration.
             UPDATE {s}.candidates c SET seen_at = now()
               FROM a
              WHERE c.role = a.role AND c.node = a.node AND c.backend = 'lease'
                AND c.seen_at < now() - (a.ttl_ms / 2) * interval '1 millisecond'
                AND {reg_of_a}
             RETURNING c.role
         )
         SELECT up.term, up.acquired_at, up.lease_until,
                (extract(epoch FROM up.lease_until - now()) * 1000)::float8,
                CASE WHEN rearm.lease_until IS NOT NULL THEN coalesce(cur.holder, '') ELSE cur.holder END,
                cur.backend,
                (extract(epoch FROM coalesce(rearm.lease_until, cur.lease_until) - now()) * 1000)::float8,
                CASE WHEN up.term IS NOT NULL
                     THEN pg_catalog.pg_notify('{LEADER_CHANNEL}', a.payload)::text END,
                CASE WHEN up.term IS NULL THEN try.pref END,
                rearm.lease_until IS NOT NULL,
                a.role,
                CASE WHEN a.role IN (SELECT seen.role FROM seen) THEN 0::float8
                     ELSE (extract(epoch FROM now() - reg.seen_at) * 1000)::float8 END
           FROM a LEFT JOIN up ON up.role = a.role
                  LEFT JOIN reg ON reg.role = a.role
                  LEFT JOIN cur ON cur.role = a.role
                  LEFT JOIN try ON try.role = a.role
                  LEFT JOIN rearm ON rearm.role = a.role"
    )
}

/// The renewal (see [`LeaseSql::renew`]): where a row still names the node
/// with the term, extends the lease to the server's `now()` + the role's
/// TTL. `greatest`: a renewal that was given up on the client but ran late
/// on the server (after a retry on a new connection) never moves the lease
/// back in time below what a later renewal promised.
///
/// A row still ours but locked (a fenced transaction of the leader's own
/// holds it `FOR SHARE` until it ends) is skipped, not waited for, and
/// returned with `renewed` false: the keeper retries soon
/// ([`Answer::Busy`](crate::election::driver::Answer::Busy)), as the
/// session backend's renewal does. Waiting would hold up every role of a
/// batch behind one application transaction, and a lone leader's
/// renewal behind a transaction that may outlast its statement bound.
///
/// The skipped rows are found with `NOT IN` over `u`, which the planner
/// runs as one hashed sub-plan (it guesses one row for `u`); as `NOT
/// EXISTS` it chose a nested anti-join that rescanned `u` for every row
/// (see the shared connection's renewal).
fn renew_sql(s: &str) -> String {
    let pref = registry::preferred_lease_sql(s, "m.role", "m.node", "m.priority");
    let (of_m, of_o) = (among("l", "m"), among("l", "o"));
    format!(
        "WITH m AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int4[])
                        AS m(role, node, term, ttl_ms, priority)
         ), o AS (
             SELECT l.role, m.ttl_ms
               FROM {s}.leaders l JOIN m
                 ON l.role = m.role AND l.holder = m.node AND l.term = m.term
              WHERE {of_m}
                FOR NO KEY UPDATE OF l SKIP LOCKED
         ), u AS (
             UPDATE {s}.leaders l
                SET renewed_at = greatest(l.renewed_at, now()),
                    lease_until = greatest(l.lease_until, now() + o.ttl_ms * interval '1 millisecond')
               FROM o
              WHERE l.role = o.role AND {of_o}
             RETURNING l.role, l.renewed_at, l.lease_until, l.resign_requested
         )
         SELECT u.role, (extract(epoch FROM u.lease_until - now()) * 1000)::float8,
                u.resign_requested, {pref}, u.renewed_at, u.lease_until, true AS renewed
           FROM u JOIN m ON m.role = u.role
         UNION ALL
         SELECT l.role, NULL::float8, false, NULL::text, l.renewed_at, l.lease_until, false
           FROM {s}.leaders l JOIN m
             ON l.role = m.role AND l.holder = m.node AND l.term = m.term
          WHERE {of_m} AND l.role NOT IN (SELECT u.role FROM u)"
    )
}

/// The release (see [`LeaseSql::release`]): clears the holder where holder
/// and term are still the given ones, with a NOTIFY per cleared row in the
/// same transaction.
///
/// The releasing node's registration for the role (if any) is marked as
/// not seen since long ago (`seen_at` at the epoch) in the same
/// statement: a node that gives a role up is no ready candidate for it,
/// and a standby of lower priority woken by the release must not defer to
/// it (`preferred_lease_sql`) and wait for its next poll. A node that
/// stands again is seen again at its first poll, which refreshes a
/// registration older than half a TTL.
fn release_sql(s: &str) -> String {
    let of_m = among("l", "m");
    let reg_of_m = among("r", "m");
    format!(
        "WITH m AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[])
                        AS m(role, node, term, payload)
         ), c AS (
             UPDATE {s}.leaders l
                SET holder = NULL, holder_pid = NULL, holder_meta = NULL, lease_token = NULL,
                    renewed_at = now(), lease_until = now(), resign_requested = false
               FROM m
              WHERE l.role = m.role AND l.holder = m.node AND l.term = m.term AND {of_m}
             RETURNING m.payload
         ), unready AS (
             UPDATE {s}.candidates r SET seen_at = 'epoch'
               FROM m
              WHERE r.role = m.role AND r.node = m.node AND r.backend = 'lease' AND {reg_of_m}
             RETURNING 1
         )
         SELECT count(*), count(pg_catalog.pg_notify('{LEADER_CHANNEL}', c.payload)::text)
           FROM c"
    )
}

/// A standby's entry in a batched acquire: role, node, meta, TTL in
/// milliseconds, notification payload, priority.
pub(super) type Entry = (String, String, Option<serde_json::Value>, i64, String, i32);

/// A leader's values in a renewal.
pub(super) struct Renewing<'a> {
    pub(super) role: &'a str,
    pub(super) node: &'a str,
    pub(super) term: i64,
    pub(super) ttl_ms: i64,
    pub(super) priority: i32,
}

impl SharedLease {
    /// Sends the acquire ([`LeaseSql::acquire`]) for the standbys of `part`,
    /// with this attempt's `token` and the `unanswered` tokens, bounded by
    /// `bound`: its send time and each role's row.
    ///
    /// With `direct`, on the listening connection if it is ready (see
    /// [`SharedLease::exec_direct`]): an acquire that a release
    /// announcement brought.
    pub(super) async fn acquire(
        &self,
        part: &[Entry],
        token: i64,
        unanswered: &[i64],
        bound: Duration,
        direct: bool,
    ) -> (Instant, Result<Vec<Acquired>>) {
        let roles: Vec<&str> = part.iter().map(|e| e.0.as_str()).collect();
        let nodes: Vec<&str> = part.iter().map(|e| e.1.as_str()).collect();
        let metas: Vec<Option<&serde_json::Value>> = part.iter().map(|e| e.2.as_ref()).collect();
        let ttls: Vec<i64> = part.iter().map(|e| e.3).collect();
        let payloads: Vec<&str> = part.iter().map(|e| e.4.as_str()).collect();
        let priorities: Vec<i32> = part.iter().map(|e| e.5).collect();
        let params: [(&(dyn ToSql + Sync), Type); 8] = [
            (&roles, Type::TEXT_ARRAY),
            (&nodes, Type::TEXT_ARRAY),
            (&metas, Type::JSONB_ARRAY),
            (&ttls, Type::INT8_ARRAY),
            (&payloads, Type::TEXT_ARRAY),
            (&priorities, Type::INT4_ARRAY),
            (&token, Type::INT8),
            (&unanswered, Type::INT8_ARRAY),
        ];
        // A failure there is the caller's to handle, as through the
        // pooler: an acquire that got no answer may have committed (its
        // token goes to the next one's unanswered list).
        let direct = match direct {
            true => {
                self.exec_direct(Op::Acquire, bound, |s| &s.acquire, &params)
                    .await
            }
            false => None,
        };
        let (sent, r) = match direct {
            Some(done) => done,
            None => {
                self.exec(Op::Acquire, bound, Sql::Lease(|s| &s.acquire), &params)
                    .await
            }
        };
        // A row that cannot be read (never: the columns are ours) fails
        // the whole answer; whatever it won expires unused after a TTL.
        let decoded = r.and_then(|rows| {
            rows.iter()
                .map(Acquired::decode)
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| self.read_error(Op::Acquire, e))
        });
        (sent, decoded)
    }

    /// Sends the renewal ([`LeaseSql::renew`]) for the leaders of `part`,
    /// bounded by `bound`: its send time and what it found for each role
    /// still its leader's, [`Renewal::Renewed`] or [`Renewal::Busy`]; a
    /// role not in the map is no longer ours.
    pub(super) async fn renew(
        &self,
        part: &[Renewing<'_>],
        bound: Duration,
    ) -> (Instant, Result<HashMap<String, Renewal>>) {
        let roles: Vec<&str> = part.iter().map(|l| l.role).collect();
        let nodes: Vec<&str> = part.iter().map(|l| l.node).collect();
        let terms: Vec<i64> = part.iter().map(|l| l.term).collect();
        let ttls: Vec<i64> = part.iter().map(|l| l.ttl_ms).collect();
        let priorities: Vec<i32> = part.iter().map(|l| l.priority).collect();
        let (sent, r) = self
            .exec(
                Op::Renew,
                bound,
                Sql::Lease(|s| &s.renew),
                &[
                    (&roles, Type::TEXT_ARRAY),
                    (&nodes, Type::TEXT_ARRAY),
                    (&terms, Type::INT8_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&priorities, Type::INT4_ARRAY),
                ],
            )
            .await;
        let found = r.and_then(|rows| {
            rows.iter()
                .map(|row| {
                    let role: String = row.try_get(0)?;
                    if !row.try_get::<_, bool>(6)? {
                        return Ok((role, Renewal::Busy));
                    }
                    let renewed = Renewal::Renewed {
                        row: (row.try_get(4)?, row.try_get(5)?),
                        resign_requested: row.try_get(2)?,
                        ready: row.try_get(3)?,
                    };
                    Ok((role, renewed))
                })
                .collect::<std::result::Result<HashMap<_, _>, tokio_postgres::Error>>()
                .map_err(|e| self.read_error(Op::Renew, e))
        });
        (sent, found)
    }

    /// Deletes the registration of `node` for `role` on this client's
    /// connection: a candidate stopping for good opens no connection of
    /// its own for it (through a pooler, a new client's authentication
    /// competed with the successor's acquire for the pooler's one core).
    pub(crate) async fn withdraw(&self, role: &str, node: &str, bound: Duration) -> Result<()> {
        let s = self.inner.options.schema_name().as_str();
        let sql = registry::withdraw_sql(s);
        let (_, r) = self
            .exec(
                Op::Withdraw,
                bound,
                Sql::Text(&sql),
                &[(&role, Type::TEXT), (&node, Type::TEXT)],
            )
            .await;
        r.map(|_| ())
    }

    /// The term of `role`'s row (`None`: no row).
    pub(super) async fn term_of(&self, role: &str, bound: Duration) -> Result<Option<i64>> {
        let s = self.inner.options.schema_name().as_str();
        let sql = format!("SELECT term FROM {s}.leaders WHERE role = $1");
        let (_, r) = self
            .exec(Op::Read, bound, Sql::Text(&sql), &[(&role, Type::TEXT)])
            .await;
        match r?.first() {
            Some(row) => row
                .try_get(0)
                .map_err(|e| Error::db(Op::Read.operation(), s, e)),
            None => Ok(None),
        }
    }

    /// Sends the release ([`LeaseSql::release`]) of `role`'s lease where it
    /// still names `node` with `term`, bounded by `bound`: its send time
    /// and whether the row was still ours (and is cleared now).
    pub(super) async fn clear(
        &self,
        role: &str,
        node: &str,
        term: i64,
        bound: Duration,
    ) -> (Instant, Result<bool>) {
        let s = self.inner.options.schema_name().as_str();
        let payload = format!("{s}:released:{role}");
        let (roles, nodes, terms, payloads) = (vec![role], vec![node], vec![term], vec![payload]);
        let params: [(&(dyn ToSql + Sync), Type); 4] = [
            (&roles, Type::TEXT_ARRAY),
            (&nodes, Type::TEXT_ARRAY),
            (&terms, Type::INT8_ARRAY),
            (&payloads, Type::TEXT_ARRAY),
        ];
        // Directly when the listening connection is ready: the standbys
        // hear the announcement one hop sooner. A release is idempotent
        // (it clears the row only while it names this holder and term),
        // so one that failed there is sent again through the pooler.
        let direct = self
            .exec_direct(Op::Release, bound, |s| &s.release, &params)
            .await;
        let (sent, r) = match direct {
            Some((sent, Ok(rows))) => (sent, Ok(rows)),
            _ => {
                self.exec(Op::Release, bound, Sql::Lease(|s| &s.release), &params)
                    .await
            }
        };
        let cleared = r.and_then(|rows| {
            rows.first()
                .map(|r| r.try_get::<_, i64>(0))
                .transpose()
                .map(|n| n.unwrap_or(0) > 0)
                .map_err(|e| self.read_error(Op::Release, e))
        });
        (sent, cleared)
    }

    /// Sends the registration (the registry's batched upsert, see
    /// [`registry::register_sql`]) of the standbys of `part`,
    /// bounded by `bound`: its send time and its outcome.
    pub(super) async fn register(
        &self,
        part: &[&Registration],
        bound: Duration,
    ) -> (Instant, Result<()>) {
        let rows = Registrations::of(part.iter().copied());
        let (sent, r) = self
            .exec(
                Op::Register,
                bound,
                Sql::Text(&self.inner.sql.register),
                &rows.params(),
            )
            .await;
        (sent, r.map(drop))
    }

    /// A row of `op`'s answer that could not be read.
    fn read_error(&self, op: Op, e: tokio_postgres::Error) -> Error {
        Error::db(op.operation(), self.inner.options.schema_name().as_str(), e)
    }
}

/// One role's row of the acquire ([`LeaseSql::acquire`]), decoded.
pub(super) struct Acquired {
    pub(super) role: String,
    /// Won: the new term, `acquired_at` and `lease_until`.
    pub(super) won: Option<(i64, SystemTime, SystemTime)>,
    /// The row as it was before: holder, backend, remaining ms.
    pub(super) prev_holder: Option<String>,
    pub(super) prev_backend: Option<String>,
    pub(super) prev_remaining: Option<f64>,
    /// Not won because this ready candidate of higher priority stands.
    pub(super) deferred_to: Option<String>,
    /// Not won because the row was last written before this server's
    /// promotion: its lease was re-armed for a full TTL.
    pub(super) rearmed: bool,
    /// The age of the standby's registration after this poll (0: just
    /// refreshed); `None`: it has none (never written, or deleted).
    pub(super) seen_age: Option<Duration>,
}

impl Acquired {
    pub(super) fn decode(row: &Row) -> std::result::Result<Acquired, tokio_postgres::Error> {
        let term: Option<i64> = row.try_get(0)?;
        let won = match term {
            Some(term) => Some((term, row.try_get(1)?, row.try_get(2)?)),
            None => None,
        };
        Ok(Acquired {
            won,
            prev_holder: row.try_get(4)?,
            prev_backend: row.try_get(5)?,
            prev_remaining: row.try_get(6)?,
            deferred_to: row.try_get(8)?,
            rearmed: row.try_get::<_, Option<bool>>(9)?.unwrap_or(false),
            role: row.try_get(10)?,
            seen_age: row.try_get::<_, Option<f64>>(11)?.map(ms),
        })
    }
}

/// Server-reported milliseconds as a duration; zero for a negative or
/// non-finite value.
pub(super) fn ms(f: f64) -> Duration {
    if f.is_finite() && f > 0.0 {
        Duration::from_secs_f64((f / 1000.0).min(1e9))
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_reported_milliseconds_are_clamped() {
        assert_eq!(ms(-5.0), Duration::ZERO);
        assert_eq!(ms(f64::NAN), Duration::ZERO);
        assert_eq!(ms(1500.0), Duration::from_millis(1500));
    }

    #[test]
    fn statements_are_scoped_to_holder_and_term() {
        let sql = lease_sql(&SchemaName::default());
        assert!(
            sql.renew.contains("greatest(l.lease_until, now()"),
            "{}",
            sql.renew
        );
        for s in [&sql.renew, &sql.release] {
            assert!(
                s.contains("l.role = m.role AND l.holder = m.node AND l.term = m.term"),
                "{s}"
            );
        }
        assert!(sql.renew.contains("SKIP LOCKED"), "{}", sql.renew);
        assert!(
            sql.acquire.contains("l.lease_until < now()"),
            "{}",
            sql.acquire
        );
        assert!(
            sql.acquire.contains("c.priority > a.priority"),
            "{}",
            sql.acquire
        );
        assert!(sql.acquire.contains("pg_notify"), "{}", sql.acquire);
        for s in [&sql.acquire, &sql.renew, &sql.release] {
            assert!(!s.contains(';'), "one statement each: {s}");
        }
    }
}
