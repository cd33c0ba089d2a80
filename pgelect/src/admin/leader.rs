//! A role's leader, read once, and resign requests: for observers and
//! operators that do not stand for election.

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

use crate::conn::ConnectOptions;
use crate::election::LeaderInfo;
use crate::error::{Error, Result};
use crate::schema::SchemaName;

/// Reads the current leader of `role` once, on a short-lived connection.
///
/// For observers that do not stand for election; candidates and long-lived
/// observers use [`Elector::watch`](crate::Elector::watch). Returns `None`
/// when the role has never been led or its last leader released it.
///
/// # Cancel safety
/// Cancel safe: it only reads; a cancelled call drops its connection.
pub async fn current_leader(options: &ConnectOptions, role: &str) -> Result<Option<LeaderInfo>> {
    crate::election::validate_name("role", role)?;
    let conn = options.connect("observe").await?;
    let result = crate::election::read_leader(conn.client(), options.schema_name(), role).await;
    conn.close().await;
    result
}

/// Asks the current leader of `role`, wherever it runs, to resign.
///
/// Calls the schema's `request_resign(role)` function, which marks the lease
/// row of the role's current term (`resign_requested`, cleared by every
/// election) and sends a `NOTIFY pgelect_resign` hint, in one transaction.
/// The database authenticates the request: the function may be executed
/// only by users granted `EXECUTE` on it (and `USAGE` on the schema); the
/// hint alone moves nothing, since anyone who can connect may send it.
///
/// * Session-backend leaders and lease-backend leaders with
///   [`listen_via`](crate::election::LeaseOptions::listen_via) hear the hint and
///   renew at once; the renewal's answer carries the mark, and they step
///   down within a round trip or two (a flood of hints from others is
///   rate-limited to one early renewal per 100 ms, so a request made in a
///   flood waits at most that long).
/// * A lease-backend leader without a `LISTEN` connection (behind a
///   transaction pooler) sees the mark in the answer to its next renewal,
///   within `renew_every`.
///
/// The leader cancels its leadership token; through
/// [`Elector::run`](crate::Elector::run) it then releases cleanly as soon as
/// its duties stopped, and a standby takes over at once (lease backend
/// without `LISTEN`: within `retry_every`).
///
/// Returns the leader that was asked, as its row read when marked, or
/// `None` when the role has no leader (nothing is marked or sent).
///
/// # Errors
/// [`Error::Permission`] when the user may not execute `request_resign`
/// (the message names the grant to ask for); [`Error::SchemaMissing`] when
/// the schema, or this function (schema version 4), is not installed.
///
/// # Cancel safety
/// Cancel safe: the request is made by one statement or not at all.
pub async fn request_resign(options: &ConnectOptions, role: &str) -> Result<Option<LeaderInfo>> {
    crate::election::validate_name("role", role)?;
    let conn = options.connect("resign").await?;
    let result = request_resign_on(conn.client(), options.schema_name(), role).await;
    conn.close().await;
    result
}

/// [`request_resign`] on `client`, the role's name checked already.
pub(crate) async fn request_resign_on<C: GenericClient + Sync>(
    client: &C,
    schema: &SchemaName,
    role: &str,
) -> Result<Option<LeaderInfo>> {
    let what = "request a resignation; the user needs `GRANT USAGE ON SCHEMA <schema>` and `GRANT EXECUTE ON FUNCTION <schema>.request_resign(text)`";
    let rows = client
        .query_typed(
            &format!(
                "SELECT holder, holder_meta, term, backend, acquired_at, renewed_at,
                        lease_until, lease_expired, holder_pid
                   FROM {schema}.request_resign($1)"
            ),
            &[(&role, Type::TEXT)],
        )
        .await
        .map_err(|e| Error::db(what, schema.as_str(), e))?;
    rows.first()
        .map(|row| crate::election::leader_info(role, row))
        .transpose()
        .map_err(|e| Error::db(what, schema.as_str(), e))
}
