//! Forgetting a role nobody holds or stands for.
//!
//! The role's row stays, emptied and marked: its term is a fencing token
//! and must never be handed out twice (a process paused since long ago may
//! still hold an old one), so the next candidate that stands for the role
//! continues above it. The mark hides the row from
//! [`AdminClient::status`](super::AdminClient::status) and makes the role
//! unknown to the operator's calls; every election overwrites
//! `holder_meta`, and so removes it.

use std::time::SystemTime;

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use super::status::{unknown_role, FORGOTTEN};
use crate::election::{role_key, Term};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::schema::SchemaName;

/// What [`AdminClient::forget`](super::AdminClient::forget) did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForgetOutcome {
    /// The role is no longer listed. Its last term is kept: a candidate
    /// that stands for it again continues above it.
    Forgotten {
        /// The role's last term.
        last_term: Term,
    },
    /// Not forgotten: a leader's lease is live.
    Led {
        /// The leader's node.
        holder: String,
        /// Its term.
        term: Term,
        /// When its lease ends unless renewed, on the server's clock.
        lease_until: Option<SystemTime>,
    },
    /// Not forgotten: sessions hold or wait for the role's lock. Empty when
    /// the lock was taken but its holder could not be seen.
    Locked {
        /// The sessions, by pid.
        sessions: Vec<KeySession>,
    },
    /// Not forgotten: candidates stand for it (polling standbys, found by
    /// their `application_name`).
    Standing {
        /// The candidates, by pid.
        candidates: Vec<StandingCandidate>,
    },
}

/// A session that holds or waits for a role's lock.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeySession {
    /// Its server process (`pg_locks.pid`).
    pub backend_pid: i32,
    /// Its `application_name` (a claim), when this user may see it.
    pub application_name: Option<String>,
    /// True when it holds the lock, false when it waits for it.
    pub granted: bool,
}

/// A candidate standing for a role.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StandingCandidate {
    /// The node its `application_name` names.
    pub node: String,
    /// Its server process.
    pub backend_pid: i32,
}

/// Forgets `role` in one transaction: the row is locked first, so that a
/// lease-backend candidate renewing or taking it waits and then sees it
/// gone; the role's lock is taken for the transaction, so that no
/// session-backend candidate can win it meanwhile.
pub(crate) async fn forget(
    client: &mut Client,
    schema: &SchemaName,
    role: &str,
) -> Result<ForgetOutcome> {
    crate::election::validate_name("role", role)?;
    let s = schema.as_str();
    let db = |what: &'static str| move |e| Error::db(what, s, e);
    let tx = client
        .transaction()
        .await
        .map_err(db("begin a transaction"))?;
    const READ: &str = "read the leaders table";
    let row = tx
        .query_typed_opt(
            &format!(
                "SELECT holder, term, lease_until > now(), lease_until,
                        holder IS NULL AND coalesce(holder_meta ? $2::text, false)
                   FROM {schema}.leaders WHERE role = $1 FOR UPDATE"
            ),
            &[(&role, Type::TEXT), (&FORGOTTEN, Type::TEXT)],
        )
        .await
        .map_err(db(READ))?;
    let row = match row {
        Some(row) if !row.try_get::<_, bool>(4).map_err(db(READ))? => row,
        _ => {
            drop(tx);
            return Err(unknown_role(&*client, schema, role).await);
        }
    };
    let holder: Option<String> = row.try_get(0).map_err(db(READ))?;
    let term = Term::new(row.try_get(1).map_err(db(READ))?);
    let live: Option<bool> = row.try_get(2).map_err(db(READ))?;
    let lease_until: Option<SystemTime> = row.try_get(3).map_err(db(READ))?;
    if let (Some(holder), Some(true)) = (holder, live) {
        return Ok(ForgetOutcome::Led {
            holder,
            term,
            lease_until,
        });
    }
    // The role's lock, for this transaction: while it is ours no
    // session-backend candidate can win the role.
    let key = role_key(s, role);
    let LockKey::Single(k) = key else {
        unreachable!("BUG: a name's key is a single bigint")
    };
    const TAKE: &str = "take the role's lock";
    let got: bool = tx
        .query_typed("SELECT pg_try_advisory_xact_lock($1)", &[(&k, Type::INT8)])
        .await
        .map_err(db(TAKE))?
        .first()
        .map(|r| r.try_get(0))
        .transpose()
        .map_err(db(TAKE))?
        .unwrap_or(false);
    const LOOK: &str = "look for the role's candidates";
    let sessions = crate::lock::holders::key_sessions(&tx, key, true)
        .await
        .map_err(db(LOOK))?
        .into_iter()
        .map(|s| KeySession {
            backend_pid: s.holder.pid,
            application_name: s.application_name,
            granted: s.granted,
        })
        .collect::<Vec<_>>();
    if !sessions.is_empty() || !got {
        return Ok(ForgetOutcome::Locked { sessions });
    }
    let prefix = format!("pgelect:{role}:");
    let candidates = tx
        .query_typed(
            "SELECT substr(a.application_name, length($1::text) + 1), a.pid
               FROM pg_stat_activity a
              WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                AND starts_with(a.application_name, $1::text)
              ORDER BY a.pid",
            &[(&prefix, Type::TEXT)],
        )
        .await
        .map_err(db(LOOK))?
        .iter()
        .map(|r| {
            Ok(StandingCandidate {
                node: r.try_get(0)?,
                backend_pid: r.try_get(1)?,
            })
        })
        .collect::<std::result::Result<Vec<_>, tokio_postgres::Error>>()
        .map_err(db(LOOK))?;
    if !candidates.is_empty() {
        return Ok(ForgetOutcome::Standing { candidates });
    }
    tx.execute(
        &format!(
            "UPDATE {schema}.leaders
                SET holder = NULL, holder_pid = NULL, backend = NULL, lease_token = NULL,
                    acquired_at = NULL, renewed_at = NULL, lease_until = NULL,
                    holder_meta = jsonb_build_object($2::text, now())
              WHERE role = $1"
        ),
        &[&role, &FORGOTTEN],
    )
    .await
    .map_err(db("forget the role's row"))?;
    tx.commit().await.map_err(db("commit"))?;
    Ok(ForgetOutcome::Forgotten { last_term: term })
}
