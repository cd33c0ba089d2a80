//! The `pgelect` schema: versioned, idempotent migrations.
//!
//! Everything pgelect keeps in the database lives in one schema (`pgelect` by
//! default, configurable). [`migrate`](crate::migrate) installs or upgrades it; it is safe to
//! run from many processes at once, because the whole migration runs under a
//! session advisory lock on a dedicated connection, and the unlock's result is
//! checked.

pub(crate) mod migrate;

use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{GenericClient, SimpleQueryMessage};

use crate::conn::ConnectOptions;
use crate::error::{shown, Error, Result};
use crate::key::LockKey;

pub use crate::error::{SQLSTATE_NO_LEADER, SQLSTATE_STALE_TERM};

/// How long [`migrate`](crate::migrate) waits for the migration lock before it fails with
/// [`Error::MigrationLockTimeout`], naming who holds it: 30 s. A migration
/// takes milliseconds, so a longer wait means a stuck or hostile holder.
pub const MIGRATE_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// The default schema name.
pub const DEFAULT_SCHEMA: &str = "pgelect";

/// The schema version this library needs (the number of migrations it ships).
pub const SCHEMA_VERSION: i32 = MIGRATIONS.len() as i32;

/// A validated schema name: 1 to 63 characters of `a-z`, `0-9` and `_`, not
/// starting with a digit. Only such names are accepted so that they can be
/// spliced into SQL without quoting surprises.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SchemaName(String);

impl SchemaName {
    /// Validates a schema name.
    ///
    /// ```
    /// use pgelect::schema::SchemaName;
    /// assert!(SchemaName::new("pgelect").is_ok());
    /// assert!(SchemaName::new("my_app_locks").is_ok());
    /// assert!(SchemaName::new("Bad-Name").is_err());
    /// assert!(SchemaName::new("").is_err());
    /// ```
    pub fn new(name: &str) -> Result<SchemaName> {
        let refuse = |reason: &str| {
            Err(Error::InvalidName {
                what: "schema",
                shown: shown(name),
                reason: reason.to_owned(),
            })
        };
        if name.is_empty() {
            return refuse("it is empty");
        }
        if name.len() > 63 {
            return refuse("it is longer than 63 bytes, PostgreSQL's limit for identifiers");
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return refuse("use only lower-case letters a-z, digits and '_'");
        }
        if name.as_bytes()[0].is_ascii_digit() {
            return refuse("it must not start with a digit");
        }
        Ok(SchemaName(name.to_owned()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for SchemaName {
    fn default() -> Self {
        SchemaName(DEFAULT_SCHEMA.to_owned())
    }
}

impl std::fmt::Display for SchemaName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A `DO` block that runs `$grant TO <grantee>` for every user granted
/// `UPDATE` on `{s}.leaders` but its owner (`PUBLIC` for grantee 0): a
/// rolling upgrade keeps working, since whoever may update the table (a
/// candidate of an earlier version) gets what this version's candidates
/// need. A literal (`concat!`): a migration's text and a `format!` string
/// alike; `$grant` may name `{s}` and, in a `format!`, other arguments.
macro_rules! grant_to_leader_updaters {
    ($grant:literal) => {
        concat!(
            r#"DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee
          FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid = '{s}.leaders'::pg_catalog.regclass
           AND a.privilege_type = 'UPDATE'
           AND a.grantee <> c.relowner
    LOOP
        EXECUTE pg_catalog.format('"#,
            $grant,
            r#" TO %s',
            CASE g.grantee WHEN 0 THEN 'PUBLIC'
                           ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END);
    END LOOP;
END
$grants$;
"#
        )
    };
}
pub(crate) use grant_to_leader_updaters;

/// The migrations, in order. `{s}` stands for the schema name. Never edit a
/// shipped migration: add a new one.
const MIGRATIONS: &[&str] = &[
    // 1: leaders, fence, key.
    r#"
CREATE TABLE {s}.leaders (
    role         text PRIMARY KEY CHECK (role <> ''),
    holder       text,
    holder_meta  jsonb,
    term         bigint NOT NULL DEFAULT 0 CHECK (term >= 0),
    backend      text,
    holder_pid   integer,
    acquired_at  timestamptz,
    renewed_at   timestamptz,
    lease_until  timestamptz
);
COMMENT ON TABLE {s}.leaders IS 'pgelect: one row per role; term is the fencing token and only rises';

CREATE FUNCTION {s}.fence(p_role text, p_term bigint) RETURNS void
LANGUAGE plpgsql AS $fn$
DECLARE
    cur_term bigint;
    cur_holder text;
BEGIN
    SELECT l.term, l.holder INTO cur_term, cur_holder
      FROM {s}.leaders l WHERE l.role = p_role FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PE002',
            MESSAGE = format('role "%s" has no leader row; term %s cannot be fenced', p_role, p_term),
            HINT = 'stop acting as leader and roll back';
    END IF;
    IF cur_term IS DISTINCT FROM p_term THEN
        RAISE EXCEPTION USING ERRCODE = 'PE001',
            MESSAGE = format('role "%s": term %s is stale, the current term is %s', p_role, p_term, cur_term),
            HINT = 'this process is no longer the leader: roll back and stop acting as leader';
    END IF;
    IF cur_holder IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'PE002',
            MESSAGE = format('role "%s": term %s was released and has no holder now', p_role, p_term),
            HINT = 'this process is no longer the leader: roll back and stop acting as leader';
    END IF;
END
$fn$;
COMMENT ON FUNCTION {s}.fence(text, bigint) IS 'pgelect: call inside a transaction; fails unless p_term is the current term of p_role';

CREATE FUNCTION {s}.key(name text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
BEGIN
    IF name = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'pgelect.key: the lock name is empty';
    END IF;
    RETURN ('x' || encode(substr(sha256(convert_to('pgelect:' || name, 'UTF8')), 1, 8), 'hex'))::bit(64)::bigint;
END
$fn$;
COMMENT ON FUNCTION {s}.key(text) IS 'pgelect: the advisory-lock key of a name, as LockKey::from_name computes it';
"#,
    // 2: resign requests that reach a lease-backend leader without LISTEN;
    // the token of a lease taken by an unanswered acquire attempt.
    r#"
ALTER TABLE {s}.leaders ADD COLUMN resign_requested boolean NOT NULL DEFAULT false;
ALTER TABLE {s}.leaders ADD COLUMN lease_token bigint;
COMMENT ON COLUMN {s}.leaders.lease_token IS 'pgelect: random per acquire attempt of the lease backend; lets a candidate recognise a lease its unanswered attempt took';
COMMENT ON COLUMN {s}.leaders.resign_requested IS 'pgelect: set by request_resign; a lease-backend leader reads it at every renewal and steps down; cleared by the next election';
"#,
    // 3: a bounded slice of a lock wait. A statement holds a snapshot while
    // it runs, and a snapshot holds back the xmin horizon (what VACUUM may
    // remove): a standby blocked in pg_advisory_lock for days would keep
    // every dead row of the database for days. Waiting in slices of a few
    // seconds lets the horizon move on; the timeout is caught here, so the
    // server does not log an error for every slice.
    r#"
CREATE FUNCTION {s}.lock_wait_slice(p_key bigint, p_slice_ms integer) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_slice_ms IS NULL OR p_slice_ms <= 0 THEN
        RAISE EXCEPTION 'pgelect.lock_wait_slice: the slice must be positive, not %', p_slice_ms
            USING ERRCODE = '22023';
    END IF;
    PERFORM set_config('lock_timeout', p_slice_ms::text, true);
    PERFORM pg_advisory_lock(p_key);
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END
$$;
COMMENT ON FUNCTION {s}.lock_wait_slice(bigint, integer) IS 'pgelect: waits up to p_slice_ms for the session advisory lock p_key; true when granted';
"#,
    // 4: least privilege. A resign request is authenticated by the
    // database: only a user granted EXECUTE on request_resign may mark the
    // row (the NOTIFY it sends is a hint anyone could send; leaders act on
    // the mark only). fence runs as its owner, so an application that only
    // fences needs USAGE on the schema and EXECUTE on fence, nothing on the
    // table. Every function has a fixed search_path (objects a caller
    // creates cannot hijack names) and nothing is executable by PUBLIC:
    // grants are explicit (see the book's privileges chapter).
    r#"
CREATE OR REPLACE FUNCTION {s}.fence(p_role text, p_term bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    cur_term bigint;
    cur_holder text;
BEGIN
    SELECT l.term, l.holder INTO cur_term, cur_holder
      FROM {s}.leaders l WHERE l.role = p_role FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PE002',
            MESSAGE = pg_catalog.format('role "%s" has no leader row; term %s cannot be fenced', p_role, p_term),
            HINT = 'stop acting as leader and roll back';
    END IF;
    IF cur_term IS DISTINCT FROM p_term THEN
        RAISE EXCEPTION USING ERRCODE = 'PE001',
            MESSAGE = pg_catalog.format('role "%s": term %s is stale, the current term is %s', p_role, p_term, cur_term),
            HINT = 'this process is no longer the leader: roll back and stop acting as leader';
    END IF;
    IF cur_holder IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'PE002',
            MESSAGE = pg_catalog.format('role "%s": term %s was released and has no holder now', p_role, p_term),
            HINT = 'this process is no longer the leader: roll back and stop acting as leader';
    END IF;
END
$fn$;

ALTER FUNCTION {s}.key(text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {s}.lock_wait_slice(bigint, integer) SET search_path = pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION {s}.request_resign(p_role text)
RETURNS TABLE (holder text, holder_meta jsonb, term bigint, backend text,
               acquired_at timestamptz, renewed_at timestamptz, lease_until timestamptz,
               lease_expired boolean, holder_pid integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE {s}.leaders AS l SET resign_requested = true
     WHERE l.role = p_role AND l.holder IS NOT NULL
    RETURNING l.holder, l.holder_meta, l.term, l.backend, l.acquired_at, l.renewed_at,
              l.lease_until, coalesce(l.lease_until < pg_catalog.now(), true), l.holder_pid;
    IF FOUND THEN
        PERFORM pg_catalog.pg_notify('pgelect_resign', '{s}:' || p_role);
    END IF;
END
$fn$;
COMMENT ON COLUMN {s}.leaders.resign_requested IS 'pgelect: set by request_resign (EXECUTE on it is the resign privilege) for the current term; every leader reads it at each renewal, at once on a pgelect_resign NOTIFY hint, and steps down; cleared by the next election';
COMMENT ON FUNCTION {s}.request_resign(text) IS 'pgelect: asks the current leader of p_role to resign (marks its term, sends a NOTIFY hint); returns the leader asked, no row if none';

REVOKE ALL ON FUNCTION {s}.fence(text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION {s}.key(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {s}.lock_wait_slice(bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION {s}.request_resign(text) FROM PUBLIC;

-- A rolling upgrade keeps working: candidates of the previous version were
-- granted rights on the table and relied on PUBLIC for the functions, so
-- whoever may update the table keeps lock_wait_slice (blocking standbys),
-- and whoever may read it keeps key (`pgelect status`).
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee, a.privilege_type
          FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid = '{s}.leaders'::pg_catalog.regclass
           AND a.privilege_type IN ('UPDATE', 'SELECT')
           AND a.grantee <> c.relowner
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s',
            CASE g.privilege_type WHEN 'UPDATE' THEN '{s}.lock_wait_slice(bigint, integer)'
                                  ELSE '{s}.key(text)' END,
            CASE g.grantee WHEN 0 THEN 'PUBLIC'
                           ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END);
    END LOOP;
END
$grants$;
"#,
    // 5: the candidate registry, for preferred leaders (priorities) and for
    // observers to see each candidate's timing. Written only by pgelect's
    // candidates (the users that may write `leaders`): a user without those
    // grants cannot register, so cannot move leadership. Readiness is never
    // taken from a row alone: the leader checks the registered backend pid
    // against pg_locks / pg_stat_activity (server-set facts), and the user
    // the row was written by against the backend's user (a recycled pid).
    r#"
CREATE TABLE {s}.candidates (
    role          text NOT NULL CHECK (role <> ''),
    node          text NOT NULL CHECK (node <> ''),
    backend_pid   integer,
    priority      integer NOT NULL DEFAULT 0,
    backend       text,
    standby       text,
    timing        jsonb,
    meta          jsonb,
    db_user       name NOT NULL DEFAULT session_user,
    registered_at timestamptz NOT NULL DEFAULT now(),
    seen_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role, node)
);
COMMENT ON TABLE {s}.candidates IS 'pgelect: one row per standing candidate (role, node): its priority and timing; a leader hands over to a ready candidate of strictly higher priority';
COMMENT ON COLUMN {s}.candidates.backend_pid IS 'pgelect: session backend: pg_backend_pid() of the lock connection, set by the server at registration';
COMMENT ON COLUMN {s}.candidates.standby IS 'pgelect: session backend: blocking (ready while waiting on the role lock in pg_locks) or polling (ready while its backend lives)';
COMMENT ON COLUMN {s}.candidates.seen_at IS 'pgelect: lease backend: refreshed by the standby at least every ttl/2; ready while within ttl of now()';
REVOKE ALL ON {s}.candidates FROM PUBLIC;

-- A rolling upgrade keeps working: whoever may update `leaders` (a
-- candidate) may register, and whoever may read it (an observer) may read
-- the registry.
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee, a.privilege_type
          FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid = '{s}.leaders'::pg_catalog.regclass
           AND a.privilege_type IN ('UPDATE', 'SELECT')
           AND a.grantee <> c.relowner
    LOOP
        EXECUTE pg_catalog.format('GRANT %s ON {s}.candidates TO %s',
            CASE g.privilege_type WHEN 'UPDATE' THEN 'SELECT, INSERT, UPDATE, DELETE'
                                  ELSE 'SELECT' END,
            CASE g.grantee WHEN 0 THEN 'PUBLIC'
                           ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END);
    END LOOP;
END
$grants$;
"#,
    // 6: a fenced transaction holds the role's row FOR SHARE, and the next
    // election's term bump waits for it. A client that froze or vanished
    // in the middle of one (a paused process, a partition the server does
    // not see yet) would hold every takeover back for as long as its
    // session lives. fence() caps how long this transaction may sit idle
    // between statements at the lease's length (SET LOCAL: this
    // transaction only, pooler-safe), unless the session already allows
    // less; the server then ends the session and the row is free.
    r#"
CREATE OR REPLACE FUNCTION {s}.fence(p_role text, p_term bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    cur_term bigint;
    cur_holder text;
    lease_ms bigint;
    idle_ms bigint;
BEGIN
    SELECT l.term, l.holder,
           pg_catalog.ceil(EXTRACT(EPOCH FROM l.lease_until - l.renewed_at) * 1000)::bigint
      INTO cur_term, cur_holder, lease_ms
      FROM {s}.leaders l WHERE l.role = p_role FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PE002',
            MESSAGE = pg_catalog.format('role "%s" has no leader row; term %s cannot be fenced', p_role, p_term),
            HINT = 'stop acting as leader and roll back';
    END IF;
    IF cur_term IS DISTINCT FROM p_term THEN
        RAISE EXCEPTION USING ERRCODE = 'PE001',
            MESSAGE = pg_catalog.format('role "%s": term %s is stale, the current term is %s', p_role, p_term, cur_term),
            HINT = 'this process is no longer the leader: roll back and stop acting as leader';
    END IF;
    IF cur_holder IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'PE002',
            MESSAGE = pg_catalog.format('role "%s": term %s was released and has no holder now', p_role, p_term),
            HINT = 'this process is no longer the leader: roll back and stop acting as leader';
    END IF;
    IF lease_ms > 0 THEN
        SELECT s.setting::bigint INTO idle_ms
          FROM pg_catalog.pg_settings s WHERE s.name = 'idle_in_transaction_session_timeout';
        IF idle_ms = 0 OR idle_ms > lease_ms THEN
            PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout',
                                          LEAST(lease_ms, 2147483647)::text, true);
        END IF;
    END IF;
END
$fn$;
COMMENT ON FUNCTION {s}.fence(text, bigint) IS 'pgelect: call inside a transaction; fails unless p_term is the current term of p_role; caps idle_in_transaction_session_timeout for this transaction at the lease length';
"#, // 7: a lease row read on a promoted server may lack the old primary's
    // last renewals (asynchronous replication). The lease backend re-arms
    // such a row once per timeline before anyone takes it over, and marks
    // it here; see election/term.rs.
    r#"
ALTER TABLE {s}.leaders ADD COLUMN IF NOT EXISTS lease_timeline integer;
COMMENT ON COLUMN {s}.leaders.lease_timeline IS 'pgelect: the WAL timeline on which a lease candidate last re-armed this row''s lease after a promotion (NULL: never)';
"#,
    // 8: fence() read the session's idle_in_transaction_session_timeout
    // from the pg_settings view, which builds a row for every setting of
    // the server: about 0.8 ms of the server's time per call, most of a
    // fenced transaction's cost. current_setting() reads the one setting
    // (with its unit, such as '90s' or '0', which an interval takes): about
    // 2 microseconds. Same check, same result.
    r#"
CREATE OR REPLACE FUNCTION {s}.fence(p_role text, p_term bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    cur_term bigint;
    cur_holder text;
    lease_ms bigint;
    idle_ms bigint;
BEGIN
    SELECT l.term, l.holder,
           pg_catalog.ceil(EXTRACT(EPOCH FROM l.lease_until - l.renewed_at) * 1000)::bigint
      INTO cur_term, cur_holder, lease_ms
      FROM {s}.leaders l WHERE l.role = p_role FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PE002',
            MESSAGE = pg_catalog.format('role "%s" has no leader row; term %s cannot be fenced', p_role, p_term),
            HINT = 'stop acting as leader and roll back';
    END IF;
    IF cur_term IS DISTINCT FROM p_term THEN
        RAISE EXCEPTION USING ERRCODE = 'PE001',
            MESSAGE = pg_catalog.format('role "%s": term %s is stale, the current term is %s', p_role, p_term, cur_term),
            HINT = 'this process is no longer the leader: roll back and stop acting as leader';
    END IF;
    IF cur_holder IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'PE002',
            MESSAGE = pg_catalog.format('role "%s": term %s was released and has no holder now', p_role, p_term),
            HINT = 'this process is no longer the leader: roll back and stop acting as leader';
    END IF;
    IF lease_ms > 0 THEN
        idle_ms := (EXTRACT(EPOCH FROM pg_catalog.current_setting(
                       'idle_in_transaction_session_timeout')::interval) * 1000)::bigint;
        IF idle_ms = 0 OR idle_ms > lease_ms THEN
            PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout',
                                          LEAST(lease_ms, 2147483647)::text, true);
        END IF;
    END IF;
END
$fn$;
COMMENT ON FUNCTION {s}.fence(text, bigint) IS 'pgelect: call inside a transaction; fails unless p_term is the current term of p_role; caps idle_in_transaction_session_timeout for this transaction at the lease length';
"#,
    // 9: statements the server plans once. Through a pooler in transaction
    // mode nothing can be prepared, so the lease backend's acquire was
    // parsed (1.9 ms) and planned (3.7 ms) at every poll and handover for
    // 0.7 ms of execution: {lease_functions} stands for its acquire,
    // renewal and release as PL/pgSQL functions, generated from this
    // version's statements (see `functions_sql` in
    // election/backend/lease/sql.rs), whose plans each server process
    // keeps. request_resign becomes an SQL function: PL/pgSQL's first call
    // in a server process (every `pgelect resign` opens one) cost about
    // 1.7 ms more. Same statement, same result, same grants (CREATE OR
    // REPLACE keeps them).
    r#"
{lease_functions}
CREATE OR REPLACE FUNCTION {s}.request_resign(p_role text)
RETURNS TABLE (holder text, holder_meta jsonb, term bigint, backend text,
               acquired_at timestamptz, renewed_at timestamptz, lease_until timestamptz,
               lease_expired boolean, holder_pid integer)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
    WITH asked AS (
        UPDATE {s}.leaders AS l SET resign_requested = true
         WHERE l.role = p_role AND l.holder IS NOT NULL
        RETURNING l.holder, l.holder_meta, l.term, l.backend, l.acquired_at, l.renewed_at,
                  l.lease_until, coalesce(l.lease_until < pg_catalog.now(), true) AS expired,
                  l.holder_pid
    ), hint AS (
        SELECT pg_catalog.pg_notify('pgelect_resign', '{s}:' || p_role) FROM asked
    )
    SELECT a.holder, a.holder_meta, a.term, a.backend, a.acquired_at, a.renewed_at,
           a.lease_until, a.expired, a.holder_pid
      FROM asked a
     WHERE (SELECT count(*) FROM hint) > 0
$fn$;
"#,
    // 10: the lease functions again, from this version's statements: the
    // release marks the releasing node's registration as not seen (a
    // standby of lower priority woken by the release no longer defers to
    // the node that gave the role up). Clients of version 9 find the new
    // source different from theirs and send their statements whole until
    // they are upgraded (slower, never different).
    r#"
{lease_functions}
"#,
    // 11: a partition group's view, kept for its fleet. Every member reads
    // its group every second or so while anything changes; at 1,000
    // members of 1,000 partitions the members' reads of the tables were
    // more work than two server cores do. A member that finds the group's
    // kept view older than a quarter of a second claims it, computes it
    // again and keeps it; the others take the older view meanwhile. Unlogged: it is a cache of what `leaders` and `candidates`
    // show, recomputed after a crash or on a promoted standby. Written
    // only by candidates (those who may update `leaders`), like the
    // registry: a user without those grants cannot change what members
    // see.
    concat!(
        r#"
CREATE UNLOGGED TABLE {s}.group_views (
    grp     text NOT NULL CHECK (grp <> ''),
    n       bigint NOT NULL CHECK (n > 0),
    read_at timestamptz NOT NULL,
    -- Until when a member that found the view old recomputes it; the
    -- others take the older view meanwhile.
    claimed_until timestamptz NOT NULL DEFAULT '-infinity',
    view    json NOT NULL,
    PRIMARY KEY (grp, n)
);
COMMENT ON TABLE {s}.group_views IS 'pgelect: each partition group''s view (leaders, ready standbys, live members) as a member last computed it, for the other members to take while it is fresh';
REVOKE ALL ON {s}.group_views FROM PUBLIC;

-- A rolling upgrade keeps working: whoever may update `leaders` (a
-- candidate) may keep and take views.
"#,
        grant_to_leader_updaters!("GRANT SELECT, INSERT, UPDATE ON {s}.group_views")
    ),
    // 12: the lease functions again, from this version's statements. The
    // acquire's read of the registrations is MATERIALIZED: used once, the
    // planner inlined it, and the generic plan each server process keeps
    // (made while the tables were still empty at a fleet's start) joined
    // it anew for every standby of the batch: 5,000 standbys of new roles
    // took 5 s. And every batched statement reaches its rows by a range
    // of roles, not an array: an index scan with array keys sorts the
    // array again at every rescan, once per row of the batch. Clients of
    // version 11 find the new source different from theirs and send their
    // statements whole until they are upgraded (slower, never different).
    r#"
{lease_functions}
"#,
    // 13: the lease functions again, from this version's statements. The
    // plan a server process keeps was made at its first call, at a fleet's
    // first start while the tables were empty, and joined batches of
    // thousands the wrong way round until autovacuum's first ANALYZE: a
    // call whose batch is larger than the statistics say the tables hold
    // is now planned for itself. Clients of version 12 find the new source
    // different from theirs and send their statements whole until they are
    // upgraded (slower, never different).
    r#"
{lease_functions}
"#,
];

/// [`migrate`](crate::migrate), waiting at most about `lock_timeout` for the migration lock.
///
/// When the wait runs out the error is [`Error::MigrationLockTimeout`],
/// which names the sessions holding the lock (pid, user, application name;
/// see [`LockHolder`](crate::lock::LockHolder)). The server bounds the wait
/// (`lock_timeout`, as [`LockSession::acquire`](crate::LockSession::acquire) with [`Wait::AtMost`](crate::lock::Wait::AtMost)
/// does). A zero bound, or one over PostgreSQL's `lock_timeout` range, is
/// refused with [`Error::Config`].
///
/// # Cancel safety
/// As for [`migrate`](crate::migrate).
pub async fn migrate_timeout(options: &ConnectOptions, lock_timeout: Duration) -> Result<u32> {
    let ms = crate::lock::timeout_millis("the migration lock timeout", lock_timeout)?;
    // A lock connection: the wait for the migration lock is bounded by
    // `lock_timeout` alone, so a database's or role's `statement_timeout`
    // must not cut it (or the DDL) short.
    let conn = options
        .connect_for_locks("migrate", &crate::conn::TcpTimeouts::default())
        .await?;
    let schema = options.schema_name().clone();
    let result = migrate_locked(conn.client(), &schema, ms).await;
    conn.close().await;
    result
}

/// The key of the advisory lock that serialises migrations of `schema`.
fn migration_lock(schema: &SchemaName) -> LockKey {
    LockKey::from_name(&format!("pgelect.migrate.{schema}")).expect("BUG: valid lock name")
}

async fn migrate_locked(
    client: &tokio_postgres::Client,
    schema: &SchemaName,
    lock_timeout_ms: i64,
) -> Result<u32> {
    let key = migration_lock(schema);
    let s = schema.as_str();
    let err = |op: &'static str| move |e| Error::db(op, s, e);
    let LockKey::Single(high) = key else {
        unreachable!("BUG: names hash to single keys")
    };
    // Bounded by the server, in one round trip and one implicit
    // transaction: a failed wait rolls the SET back, so lock_timeout is 0
    // again either way for the migration's own statements.
    let started = Instant::now();
    let take = format!(
        "SET lock_timeout = '{lock_timeout_ms}ms'; SELECT pg_advisory_lock('{high}'::int8); SET lock_timeout = 0"
    );
    match client.simple_query(&take).await {
        Ok(_) => {}
        Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            let waited = started.elapsed();
            // Granted as the timeout fired? Then it is ours: go on.
            let held = client
                .simple_query(&format!(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks
                      WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
                        AND classid = {} AND objid = {} AND objsubid = {})",
                    key.pg_locks_ids().0,
                    key.pg_locks_ids().1,
                    key.pg_locks_ids().2
                ))
                .await
                .map_err(err("check the migration lock"))?;
            let granted = held.iter().any(|m| match m {
                SimpleQueryMessage::Row(r) => matches!(r.try_get(0), Ok(Some("t"))),
                _ => false,
            });
            if !granted {
                let holders = crate::lock::holders::query_holders(client, key)
                    .await
                    .map_err(err("find who holds the migration lock"))?;
                return Err(Error::MigrationLockTimeout {
                    schema: s.to_owned(),
                    waited,
                    holders,
                });
            }
        }
        Err(e) => return Err(err("take the migration lock")(e)),
    }
    let applied = apply_pending(client, schema).await;
    let unlocked = client
        .query_typed_one("SELECT pg_advisory_unlock($1)", &[(&high, Type::INT8)])
        .await
        .map_err(err("release the migration lock"))?;
    let unlocked: bool = unlocked
        .try_get(0)
        .map_err(err("release the migration lock"))?;
    if !unlocked {
        return Err(Error::config(
            "the migration lock was not held at unlock time; the migration ran unserialised — check for a connection pooler in transaction mode between pgelect and PostgreSQL",
        ));
    }
    applied
}

async fn apply_pending(client: &tokio_postgres::Client, schema: &SchemaName) -> Result<u32> {
    let s = schema.as_str();
    let err = |op: &'static str| move |e| Error::db(op, s, e);
    client
        .batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS {s};
             CREATE TABLE IF NOT EXISTS {s}.migrations (
                 version    integer PRIMARY KEY,
                 applied_at timestamptz NOT NULL DEFAULT now()
             );"
        ))
        .await
        .map_err(err("create the schema"))?;
    let found = installed_version(client, schema).await?;
    if found > SCHEMA_VERSION {
        return Err(Error::SchemaVersion {
            schema: s.to_owned(),
            found,
            expected: SCHEMA_VERSION,
            hint: "the database was migrated by a newer pgelect; upgrade this program",
        });
    }
    let mut applied = 0;
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        let version = i as i32 + 1;
        let body = sql.replace("{s}", s).replace(
            "{lease_functions}",
            &crate::election::lease_functions_sql(schema),
        );
        let script = format!(
            "BEGIN;\n{body}\nINSERT INTO {s}.migrations (version) VALUES ({version});\nCOMMIT;"
        );
        if let Err(e) = client.batch_execute(&script).await {
            let _ = client.batch_execute("ROLLBACK").await;
            return Err(Error::db("apply a migration", s, e));
        }
        tracing::info!(schema = s, version, "pgelect migration applied");
        applied += 1;
    }
    Ok(applied)
}

async fn installed_version<C: GenericClient>(client: &C, schema: &SchemaName) -> Result<i32> {
    let s = schema.as_str();
    let row = client
        .query_typed_one(
            &format!("SELECT coalesce(max(version), 0) FROM {s}.migrations"),
            &[],
        )
        .await
        .map_err(|e| Error::db("read the schema version", s, e))?;
    row.try_get(0)
        .map_err(|e| Error::db("read the schema version", s, e))
}

/// Checks that the schema is installed at the version this library needs,
/// or a newer one.
///
/// Returns [`Error::SchemaMissing`] (which says to run `pgelect migrate`) or
/// [`Error::SchemaVersion`] (older than needed: migrate). A newer schema is
/// accepted: migrations only ever add, so a rolling upgrade can migrate
/// first while candidates of the previous version keep campaigning.
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn check_schema<C: GenericClient>(client: &C, schema: &SchemaName) -> Result<()> {
    let found = installed_version(client, schema).await?;
    match found {
        0 => Err(Error::SchemaMissing {
            schema: schema.to_string(),
        }),
        v if v < SCHEMA_VERSION => Err(Error::SchemaVersion {
            schema: schema.to_string(),
            found: v,
            expected: SCHEMA_VERSION,
            hint: "run `pgelect migrate` to upgrade it",
        }),
        v if v > SCHEMA_VERSION => {
            // Migrations only add (a column with a default, a function):
            // what an older version uses stays. So a rolling upgrade can
            // migrate first while older candidates keep campaigning.
            tracing::debug!(
                schema = schema.as_str(),
                found = v,
                needed = SCHEMA_VERSION,
                "the schema was migrated by a newer pgelect; migrations only add, so this version works with it"
            );
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::MIGRATIONS;

    /// FNV-1a, 64 bits: a fixed hash of a migration's text (std's hasher
    /// may change between Rust releases).
    fn fnv1a(text: &str) -> u64 {
        text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// "Never edit a shipped migration: add a new one": a database
    /// migrated by an earlier version never runs an edited one again, so
    /// an edit would make two installations differ. Each shipped
    /// migration's text, as `migrate` reads it before it names the
    /// schema, keeps its hash; a new migration adds its own line.
    #[test]
    fn shipped_migrations_keep_their_text() {
        let shipped: [u64; 13] = [
            0x7f23_bfb4_5a04_208d,
            0x1407_9f5f_b8b4_0e66,
            0x73f8_2d6c_c6c2_9a55,
            0x3d58_d97e_50e7_99b5,
            0x6c5c_7561_992c_d145,
            0x9abc_6f64_78fc_058c,
            0x4b5f_d79a_4d07_1b1c,
            0x41bf_eb13_2808_2cc5,
            0x80f5_d9d9_87b4_65af,
            0x7844_f69f_6826_8561,
            0xf3c0_7f35_edc0_81b0,
            0x7844_f69f_6826_8561,
            0x7844_f69f_6826_8561,
        ];
        assert!(
            MIGRATIONS.len() >= shipped.len(),
            "a shipped migration was removed"
        );
        for (i, (m, want)) in MIGRATIONS.iter().zip(shipped).enumerate() {
            assert_eq!(
                fnv1a(m),
                want,
                "migration {} was edited; ship the change as a new migration",
                i + 1
            );
        }
    }
}
