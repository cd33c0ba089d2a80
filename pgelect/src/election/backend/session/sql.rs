//! The session backend's statements, one text per operation. The
//! election, the renewal and the zombie preemption are array-shaped: a
//! shared connection's batch binds many roles, a candidate on its own
//! connection binds one ([`Elections`], [`Renewals`], [`Zombies`]).

use std::collections::HashMap;
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use super::{Batched, Election};
use crate::conn::DedicatedConnection;
use crate::election::backend::batch::among;
use crate::election::driver::Preferred;
use crate::election::registry;
use crate::election::term::{next_term_sql, previous_holder_sql};
use crate::election::watch::LEADER_CHANNEL;
use crate::key::LockKey;

/// The renewal, of one leader or many: renews the rows of all the given
/// roles that still name their leader with its term and this backend, each
/// for its own TTL, and returns, per renewed role, the row's times, the
/// resign mark and the preferred candidates (a ready candidate of strictly
/// higher priority makes the leader hand over). Roles not returned are no
/// longer ours.
///
/// A row is locked with `SKIP LOCKED`, never waited for: a fenced
/// transaction of the leader's own (`pgelect.fence` holds the row `FOR
/// SHARE` until it ends) would otherwise hold the renewal back for as long
/// as it runs, past the fast profile's 25 ms answer limit (the book's
/// design notes, "Renewals and fenced transactions"). A row that is still
/// ours but locked comes back with `renewed` false: the connection
/// answered, the lease was not extended, and the keeper retries soon.
///
/// This backend's pid is a column of `m` (`me`), so that "held by this
/// backend" is a join condition, not a filter on `leaders` alone (a new
/// backend's pid is in no statistics, and as a filter the planner chose a
/// nested loop). The same holds for the poll's `w`. The rows skipped as
/// locked are found with `NOT IN` over `u`, which the planner runs as one
/// hashed sub-plan, not a nested anti-join. The leaders' rows are reached
/// by their primary key ([`among`]): joined on `m` alone, a batch of 200
/// in 10,000 rows scanned the whole table. (The plans that were measured:
/// the book's design notes, "The planner and the batched statements"; the
/// `election::plans` test.)
pub(super) fn batch_renew_sql(s: &str) -> String {
    let ids = ("m.classid", "m.objid", "1");
    let of_m = among("l", "m");
    let ready = registry::preferred_session_sql_for(s, ids, "m.role", "m.node", "m.priority", true);
    let alive =
        registry::preferred_session_sql_for(s, ids, "m.role", "m.node", "m.priority", false);
    format!(
        "WITH m AS (
             SELECT *, pg_catalog.pg_backend_pid() AS me
               FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[],
                                             $5::int4[], $6::int8[], $7::int8[])
                        AS m(role, node, term, ttl_ms, priority, classid, objid)
         ), o AS (
             SELECT l.role
               FROM {s}.leaders l JOIN m
                 ON l.role = m.role AND l.holder = m.node AND l.term = m.term
                AND l.holder_pid = m.me
              WHERE {of_m}
                FOR NO KEY UPDATE OF l SKIP LOCKED
         ), u AS (
             UPDATE {s}.leaders l
                SET renewed_at = now(), lease_until = now() + m.ttl_ms * interval '1 millisecond'
               FROM m, o
              WHERE l.role = m.role AND l.role = o.role
             RETURNING l.role, l.renewed_at, l.lease_until, l.resign_requested
         )
         SELECT u.role, u.renewed_at, u.lease_until, u.resign_requested, {ready}, {alive} IS NOT NULL,
                true AS renewed
           FROM u JOIN m ON m.role = u.role
         UNION ALL
         SELECT l.role, l.renewed_at, l.lease_until, l.resign_requested, NULL::text, false, false
           FROM {s}.leaders l JOIN m
             ON l.role = m.role AND l.holder = m.node AND l.term = m.term
            AND l.holder_pid = m.me
          WHERE l.role NOT IN (SELECT u.role FROM u) AND {of_m}"
    )
}

/// The batched renewal's statement for `schema` (see `batch_renew_sql`),
/// exactly as a shared session sends it, so that a test can check its
/// plan.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub fn shared_renew_sql(schema: &crate::schema::SchemaName) -> String {
    batch_renew_sql(schema.as_str())
}

/// The batched poll's statement for `schema` (see `batch_poll_sql`), as a
/// shared session sends it, so that a test can check its plan.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub fn shared_poll_sql(schema: &crate::schema::SchemaName) -> String {
    batch_poll_sql(schema.as_str())
}

/// The batched election's statement for `schema` (see
/// `batch_elect_sql`), as a shared session sends it, so that a test can
/// check its plan.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub fn shared_elect_sql(schema: &crate::schema::SchemaName) -> String {
    batch_elect_sql(schema.as_str())
}

/// The zombie preemption's statement for `schema` (see `preempt_sql`), as
/// a shared session and a standby alone send it, so that a test can check
/// its plan.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub fn shared_preempt_sql(schema: &crate::schema::SchemaName) -> String {
    preempt_sql(schema.as_str())
}

/// The batched poll: refreshes the registry rows of the standbys whose
/// refresh is due (`$6`, `$7`: role, node; as a single standby's poll
/// does), tries every standby's lock, and returns the granted roles and,
/// for the others, the leader row where it changed since last reported or
/// is vacant (no row, no holder, or an expired lease: someone else holds
/// the lock, which the zombie preemption looks at after every poll, as a
/// standby on its own connection does; a vacant row reported only once
/// left a candidate frozen before its term holding the role for ever).
/// The registry and leaders' rows are reached by their primary keys
/// ([`among`]; joined on the batch alone, a poll of 200 in 10,000 rows
/// scanned both tables).
pub(super) fn batch_poll_sql(s: &str) -> String {
    let (of_f, of_w) = (among("c", "f"), among("l", "w"));
    format!(
        "WITH w AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::text[])
                        AS w(role, node, key, known_term, known_holder)
         ), f AS (
             SELECT * FROM unnest($6::text[], $7::text[]) AS f(role, node)
         ), seen AS (
             UPDATE {s}.candidates c SET seen_at = now()
               FROM f
              WHERE c.role = f.role AND c.node = f.node AND {of_f}
                AND c.backend_pid = pg_catalog.pg_backend_pid()
             RETURNING 1
         ), t AS (
             -- Volatile: run once per standby, never inlined or repeated.
             SELECT w.*, pg_catalog.pg_try_advisory_lock(w.key) AS granted FROM w
         )
         SELECT t.role, t.granted, l.holder, l.holder_meta, l.term, l.backend, l.acquired_at,
                l.renewed_at, l.lease_until, coalesce(l.lease_until < now(), true), l.holder_pid,
                (SELECT count(*) FROM seen)
           FROM t LEFT JOIN {s}.leaders l ON l.role = t.role AND {of_w}
          WHERE t.granted OR l.term IS DISTINCT FROM t.known_term
             OR l.holder IS DISTINCT FROM t.known_holder
             OR l.holder IS NULL OR l.lease_until < now()"
    )
}

/// The election, of one role or many: for each given role, unless a ready candidate of strictly higher priority waits,
/// bumps the term and writes the lease row naming the candidate (never
/// over a live lease-backend leader), notifies watchers. One row per role:
/// the role, then a single election's columns (term, previous holder,
/// acquired at, lease until, notification, preferred node).
///
/// `old` reads the rows as the statement found them, without `FOR UPDATE`:
/// a row locked after `up` updated it in the same statement is skipped,
/// which hid the previous holder (and with it the handover delay). The
/// advisory locks held by this session serialise the electors of every
/// role here, and `up` locks the rows itself. `pref` (a ready candidate of
/// strictly higher priority) is read from `pg_locks` in this very
/// statement; if there is one, nothing is written and the lock is given
/// back. `old` reaches the rows by their primary key ([`among`]; joined
/// on `e` alone, an election of 200 in 10,000 rows scanned the table).
pub(super) fn batch_elect_sql(s: &str) -> String {
    let (first, next) = (next_term_sql("0"), next_term_sql("l.term"));
    let ids = ("e.classid", "e.objid", "e.objsubid");
    let pref = registry::preferred_session_sql_for(s, ids, "e.role", "e.node", "e.priority", true);
    let previous = previous_holder_sql("l");
    let of_e = among("l", "e");
    format!(
        "WITH e AS (
             SELECT * FROM unnest($1::text[], $2::text[], $3::jsonb[], $4::int8[], $5::text[],
                                  $6::int4[], $7::int8[], $8::int8[], $9::int2[])
                        AS e(role, node, meta, ttl_ms, payload, priority, classid, objid, objsubid)
         ), pe AS (
             SELECT e.*, {pref} AS pref FROM e
         ), old AS (
             SELECT l.role, {previous} AS holder FROM {s}.leaders l JOIN e ON e.role = l.role
              WHERE {of_e}
         ), up AS (
             INSERT INTO {s}.leaders AS l
                    (role, holder, holder_meta, term, backend, holder_pid, acquired_at, renewed_at, lease_until)
             SELECT pe.role, pe.node, pe.meta, {first}, 'session', pg_catalog.pg_backend_pid(), now(), now(),
                    now() + pe.ttl_ms * interval '1 millisecond'
               FROM pe
              WHERE pe.pref IS NULL
             ON CONFLICT (role) DO UPDATE
                SET holder = EXCLUDED.holder, holder_meta = EXCLUDED.holder_meta,
                    term = {next}, backend = EXCLUDED.backend,
                    holder_pid = EXCLUDED.holder_pid, acquired_at = EXCLUDED.acquired_at,
                    renewed_at = EXCLUDED.renewed_at, lease_until = EXCLUDED.lease_until,
                    resign_requested = false, lease_token = NULL
              WHERE NOT (l.backend = 'lease' AND l.holder IS NOT NULL AND l.lease_until >= now())
             RETURNING l.role, l.term, l.acquired_at, l.lease_until
         )
         SELECT pe.role, up.term, old.holder, up.acquired_at, up.lease_until,
                CASE WHEN up.term IS NOT NULL
                     THEN pg_catalog.pg_notify('{LEADER_CHANNEL}', pe.payload)::text END,
                pe.pref
           FROM pe LEFT JOIN up ON up.role = pe.role LEFT JOIN old ON old.role = pe.role"
    )
}

/// The zombie preemption, of one role or many (the roles whose row was
/// found vacant: no row, no holder, or an expired lease). For each role,
/// the backend other than this one that holds the role's lock and is
/// either
///
/// * the holder the expired row names (a *zombie* leader: frozen or
///   partitioned, its connection not yet dropped by the server; a pooler
///   keeping a backend alive), or
/// * while the row is vacant, a session of this database user the row
///   does not name, idle for at least the role's grace (its TTL): a
///   candidate frozen between the grant of the lock and its term
///   transaction. It has no term, so it cannot be acting; a live
///   candidate runs its term transaction milliseconds after the grant.
///
/// A healthy leader renews every `renew_every < ttl - safety_margin`, so
/// its lease never expires and it is never preempted. Checking, choosing
/// the pid and signalling happen in one statement: a candidate whose term
/// commits meanwhile is named by the row and no longer matches.
///
/// Terminates the backends of this database user (each pid once) and,
/// when `$6` is true, those of other users too; a refusal to end one of
/// those (no `pg_signal_backend`, or a superuser's backend) fails the
/// whole statement, so `$6` is for one role at a time. One row per role
/// found: role, pid, term, holder, whether the row names the pid, whether
/// it was terminated, whether it is this user's.
pub(super) fn preempt_sql(s: &str) -> String {
    format!(
        "WITH v AS (
             SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int2[], $5::int8[])
                        AS v(role, classid, objid, objsubid, grace_ms)
         ), z AS (
             SELECT DISTINCT ON (v.role) v.role, k.pid, coalesce(l.term, 0) AS term,
                    coalesce(l.holder, '') AS holder, k.pid IS NOT DISTINCT FROM l.holder_pid AS named,
                    coalesce(a.usename = session_user, false) AS own
               FROM v
               JOIN pg_catalog.pg_locks k
                 ON k.classid = v.classid::oid AND k.objid = v.objid::oid AND k.objsubid = v.objsubid
               LEFT JOIN {s}.leaders l ON l.role = v.role
               LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = k.pid
              WHERE k.locktype = 'advisory' AND k.granted AND k.mode = 'ExclusiveLock'
                AND k.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                   WHERE d.datname = pg_catalog.current_database())
                AND k.pid <> pg_catalog.pg_backend_pid()
                AND ((l.holder IS NOT NULL AND l.lease_until < now() AND k.pid = l.holder_pid)
                     OR ((l.holder IS NULL OR l.lease_until IS NULL OR l.lease_until < now())
                         AND k.pid IS DISTINCT FROM l.holder_pid
                         AND a.usename = session_user
                         AND a.state IN ('idle', 'idle in transaction', 'idle in transaction (aborted)')
                         AND a.state_change < now() - v.grace_ms * interval '1 millisecond'))
              ORDER BY v.role, k.pid
         ), t AS (
             -- Volatile: run once per pid, never inlined or repeated.
             SELECT p.pid, pg_catalog.pg_terminate_backend(p.pid) AS done
               FROM (SELECT DISTINCT z.pid FROM z WHERE z.own OR $6::bool) p
         )
         SELECT z.role, z.pid, z.term, z.holder, z.named, coalesce(t.done, false), z.own
           FROM z LEFT JOIN t ON t.pid = z.pid"
    )
}

/// The statement of a slice of the wait for the watch key: `$1` the watch
/// key, `$2` the slice (ms), `$3` the grace (ms: the TTL), `$4`..`$6` the
/// watch key's `pg_locks` ids. One jsonb value: `{"granted": true}`; or,
/// after a slice that timed out, the key's holder (`pid`; `ours`: of this
/// database user; `ended`: terminated here because its session had done
/// nothing for the grace, a watch frozen (or stuck) for a TTL); `{}` when
/// nobody holds it.
///
/// The holder is looked up after the wait (`CASE` runs its branches in
/// order; the sub-select is run only when its branch is taken), on the
/// wall clock (`now()` is the statement's start, a slice earlier). A
/// healthy watch is `active` for the whole of each of its slices (it waits
/// on the role's lock inside a statement) and idle only for the moment
/// between two of them and while it reads the row, so it is never idle for
/// a TTL, whatever `check_every` is; one that is has no term (it lets go of
/// the watch key before its term transaction) and ending it costs nobody
/// anything.
pub(super) fn queue_slice_sql(s: &str) -> String {
    format!(
        "SELECT CASE WHEN {s}.lock_wait_slice($1, $2) THEN '{{\"granted\": true}}'::jsonb
                ELSE coalesce((
                    SELECT pg_catalog.jsonb_build_object(
                               'pid', k.pid,
                               'ours', a.usename IS NOT DISTINCT FROM session_user,
                               'ended', CASE WHEN a.usename = session_user
                                              AND a.state IN ('idle', 'idle in transaction',
                                                              'idle in transaction (aborted)')
                                              AND a.state_change < pg_catalog.clock_timestamp()
                                                                   - $3 * interval '1 millisecond'
                                             THEN pg_catalog.pg_terminate_backend(k.pid)
                                             ELSE false END)
                      FROM pg_catalog.pg_locks k
                      LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = k.pid
                     WHERE k.locktype = 'advisory' AND k.granted AND k.mode = 'ExclusiveLock'
                       AND k.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                          WHERE d.datname = pg_catalog.current_database())
                       AND k.classid = $4 AND k.objid = $5 AND k.objsubid = $6
                       AND k.pid <> pg_catalog.pg_backend_pid()
                     LIMIT 1), '{{}}'::jsonb) END"
    )
}

/// The rows of one election statement ([`batch_elect_sql`]), one role or
/// many: its arrays, bound in this order.
#[derive(Default)]
pub(super) struct Elections {
    roles: Vec<String>,
    nodes: Vec<String>,
    metas: Vec<Option<serde_json::Value>>,
    ttls: Vec<i64>,
    payloads: Vec<String>,
    priorities: Vec<i32>,
    classids: Vec<i64>,
    objids: Vec<i64>,
    objsubids: Vec<i16>,
}

impl Elections {
    /// How many roles the statement elects.
    pub(super) fn len(&self) -> usize {
        self.roles.len()
    }

    /// Adds `e`'s role to the statement.
    pub(super) fn push(&mut self, e: &Election) {
        let (classid, objid, objsubid) = e.key.pg_locks_ids();
        self.roles.push(e.role.clone());
        self.nodes.push(e.node.clone());
        self.metas.push(e.meta.clone());
        self.ttls.push(e.ttl_ms);
        self.payloads.push(e.payload.clone());
        self.priorities.push(e.priority);
        self.classids.push(i64::from(classid));
        self.objids.push(i64::from(objid));
        self.objsubids.push(objsubid);
    }

    /// Runs `sql` (the election statement, or an `EXPLAIN` of it) over
    /// these rows: one row per role, the role then a single election's
    /// columns.
    pub(super) async fn run(
        &self,
        conn: &DedicatedConnection,
        sql: &str,
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        conn.query_kept(sql, &self.params()).await
    }

    /// Runs the election statement for one role: its one row. The request
    /// is sent when the future is first polled, so that it can be
    /// pipelined between a `BEGIN` and a `COMMIT`.
    pub(super) async fn run_one(
        &self,
        conn: &DedicatedConnection,
        sql: &str,
    ) -> Result<Row, tokio_postgres::Error> {
        conn.query_kept_one(sql, &self.params()).await
    }

    /// The types of the statement's parameters, to prepare it with.
    pub(super) fn types() -> [Type; 9] {
        Elections::default().params().map(|(_, t)| t)
    }

    fn params(&self) -> [(&(dyn ToSql + Sync), Type); 9] {
        [
            (&self.roles, Type::TEXT_ARRAY),
            (&self.nodes, Type::TEXT_ARRAY),
            (&self.metas, Type::JSONB_ARRAY),
            (&self.ttls, Type::INT8_ARRAY),
            (&self.payloads, Type::TEXT_ARRAY),
            (&self.priorities, Type::INT4_ARRAY),
            (&self.classids, Type::INT8_ARRAY),
            (&self.objids, Type::INT8_ARRAY),
            (&self.objsubids, Type::INT2_ARRAY),
        ]
    }
}

/// The roles of one zombie preemption ([`preempt_sql`]), one or many:
/// its arrays, bound in this order.
#[derive(Default)]
pub(crate) struct Zombies {
    roles: Vec<String>,
    classids: Vec<i64>,
    objids: Vec<i64>,
    objsubids: Vec<i16>,
    graces: Vec<i64>,
}

/// A holder of a role's lock that the preemption found (a row of
/// [`preempt_sql`]).
pub(super) struct Zombie {
    pub(super) role: String,
    pub(super) pid: i32,
    /// The term and holder of the role's row (0 and empty without one).
    pub(super) term: i64,
    pub(super) holder: String,
    /// Whether the row names this pid (an expired leader) or not (a
    /// holder frozen before its term).
    pub(super) named: bool,
    /// Whether it was terminated.
    pub(super) ended: bool,
    /// Whether it is a session of this database user.
    pub(super) own: bool,
}

impl Zombies {
    /// The preemption of `role` alone, whose lock is `key`, ending an
    /// unnamed holder idle for `grace`.
    pub(crate) fn one(role: &str, key: LockKey, grace: Duration) -> Self {
        let mut z = Zombies::default();
        z.push(role, key.pg_locks_ids(), grace);
        z
    }

    /// Adds `role`, whose key `pg_locks` shows as `lock_ids` (classid,
    /// objid, objsubid).
    pub(super) fn push(&mut self, role: &str, lock_ids: (u32, u32, i16), grace: Duration) {
        self.roles.push(role.to_owned());
        self.classids.push(i64::from(lock_ids.0));
        self.objids.push(i64::from(lock_ids.1));
        self.objsubids.push(lock_ids.2);
        self.graces
            .push(grace.as_millis().min(i64::MAX as u128) as i64);
    }

    pub(super) fn len(&self) -> usize {
        self.roles.len()
    }

    pub(super) fn roles(&self) -> &[String] {
        &self.roles
    }

    /// Runs `sql` (the preemption statement) over these roles, ending
    /// other database users' backends too if `others`; returns what it
    /// found.
    pub(super) async fn run(
        &self,
        client: &tokio_postgres::Client,
        sql: &str,
        others: bool,
    ) -> Result<Vec<Zombie>, tokio_postgres::Error> {
        let rows = client
            .query_typed(
                sql,
                &[
                    (&self.roles, Type::TEXT_ARRAY),
                    (&self.classids, Type::INT8_ARRAY),
                    (&self.objids, Type::INT8_ARRAY),
                    (&self.objsubids, Type::INT2_ARRAY),
                    (&self.graces, Type::INT8_ARRAY),
                    (&others, Type::BOOL),
                ],
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok(Zombie {
                    role: row.try_get(0)?,
                    pid: row.try_get(1)?,
                    term: row.try_get(2)?,
                    holder: row.try_get(3)?,
                    named: row.try_get(4)?,
                    ended: row.try_get(5)?,
                    own: row.try_get(6)?,
                })
            })
            .collect()
    }
}

/// The leaders of one renewal statement ([`batch_renew_sql`]), one or
/// many: its arrays, bound in this order.
#[derive(Default)]
pub(super) struct Renewals {
    pub(super) roles: Vec<String>,
    nodes: Vec<String>,
    terms: Vec<i64>,
    ttls: Vec<i64>,
    priorities: Vec<i32>,
    classids: Vec<i64>,
    objids: Vec<i64>,
}

impl Renewals {
    /// Adds the leader of `role` at `term`, whose advisory key `pg_locks`
    /// shows as `lock_ids` (classid, objid).
    pub(super) fn push(
        &mut self,
        role: &str,
        node: &str,
        term: i64,
        ttl_ms: i64,
        priority: i32,
        lock_ids: (i64, i64),
    ) {
        self.roles.push(role.to_owned());
        self.nodes.push(node.to_owned());
        self.terms.push(term);
        self.ttls.push(ttl_ms);
        self.priorities.push(priority);
        self.classids.push(lock_ids.0);
        self.objids.push(lock_ids.1);
    }

    /// Runs `sql` (the renewal statement, or an `EXPLAIN` of it) for the
    /// leaders in `chunk`; returns its rows.
    pub(super) async fn run(
        &self,
        conn: &DedicatedConnection,
        sql: &str,
        chunk: std::ops::Range<usize>,
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let [t0, t1, t2, t3, t4, t5, t6] = Self::TYPES;
        conn.query_kept(
            sql,
            &[
                (&&self.roles[chunk.clone()], t0),
                (&&self.nodes[chunk.clone()], t1),
                (&&self.terms[chunk.clone()], t2),
                (&&self.ttls[chunk.clone()], t3),
                (&&self.priorities[chunk.clone()], t4),
                (&&self.classids[chunk.clone()], t5),
                (&&self.objids[chunk.clone()], t6),
            ],
        )
        .await
    }

    /// The types of the statement's parameters, in order.
    pub(super) const TYPES: [Type; 7] = [
        Type::TEXT_ARRAY,
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
        Type::INT8_ARRAY,
        Type::INT4_ARRAY,
        Type::INT8_ARRAY,
        Type::INT8_ARRAY,
    ];

    /// What the renewal's `rows` found, per role: renewed, or busy (still
    /// ours, but locked). A role without a row is no longer its leader's.
    pub(super) fn outcomes(
        rows: &[Row],
    ) -> Result<HashMap<String, Batched>, tokio_postgres::Error> {
        let mut found = HashMap::with_capacity(rows.len());
        for row in rows {
            let role: String = row.try_get(0)?;
            if !row.try_get::<_, bool>(6)? {
                found.insert(role, Batched::Busy);
                continue;
            }
            let b = Batched::Renewed {
                row: (row.try_get(1)?, row.try_get(2)?),
                resign_requested: row.try_get(3)?,
                preferred: Preferred {
                    ready: row.try_get(4)?,
                    pending: row.try_get(5)?,
                },
            };
            found.insert(role, b);
        }
        Ok(found)
    }
}
