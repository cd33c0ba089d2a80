//! Who holds an advisory key: `pg_locks` joined with `pg_stat_activity`.
//!
//! Advisory locks are database-wide and their keys are public (a name's key
//! is a hash anyone can compute, `pgelect.key(name)`): any user who can
//! connect to the database can take a role's, a lock's or the migration's
//! key and make pgelect wait. This module finds such a holder so that waits
//! can say who they wait for.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant};

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

use super::LockMode;
use crate::error::{Error, Result};
use crate::key::LockKey;

/// A server backend that holds an advisory lock, as `pg_locks` and
/// `pg_stat_activity` show it.
///
/// What a backend says about itself (`application_name`) is chosen by its
/// client: anyone can call themselves `pgelect:scheduler:node-a`. Only the
/// `pid` and the `user` are the server's word.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockHolder {
    /// The server process id (`pg_locks.pid`); `pg_terminate_backend(pid)`
    /// ends that session and frees its locks.
    pub pid: i32,
    /// The database user of that session (`pg_stat_activity.usename`).
    pub user: Option<String>,
    /// The `application_name` the client set: a claim, not a proof.
    pub application_name: String,
    /// The client's address; `None` for a Unix socket, or when this user may
    /// not see other users' sessions (needs `pg_read_all_stats`).
    pub client_addr: Option<String>,
    /// The mode the key is held in.
    pub mode: LockMode,
    /// How long ago the session's state last changed (how long an idle
    /// session has been idle); `None` when this user may not see it.
    pub state_age: Option<Duration>,
}

impl LockHolder {
    /// The role and node this backend *claims* to be by its
    /// `application_name` (`pgelect:<role>:<node>`, as pgelect's candidates
    /// set it), if it claims to be a pgelect candidate at all. Anyone can set
    /// any application name: compare the pid with the lease row's
    /// `holder_pid` before believing it.
    pub fn claims_pgelect_candidate(&self) -> Option<(&str, &str)> {
        let rest = self.application_name.strip_prefix("pgelect:")?;
        rest.split_once(':')
    }

    /// The lock name and node this backend *claims* by its
    /// `application_name`, if it names itself as a lock session does
    /// ([`admin::lock_session_name`](crate::admin::lock_session_name), as
    /// `pgelect lock` sets it). A claim, as any application name.
    pub fn claims_lock_session(&self) -> Option<(&str, &str)> {
        crate::admin::parse_lock_session_name(&self.application_name)
    }
}

impl fmt::Display for LockHolder {
    /// `pid 4242 (user "mallory", application "psql", from 10.0.0.7)`; text
    /// from the database is escaped (`{:?}`), so it cannot inject terminal
    /// control sequences into a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} (user ", self.pid)?;
        match &self.user {
            Some(u) => write!(f, "{u:?}")?,
            None => f.write_str("unknown")?,
        }
        write!(f, ", application {:?}", self.application_name)?;
        if let Some(addr) = &self.client_addr {
            write!(f, ", from {addr}")?;
        }
        if self.mode == LockMode::Shared {
            f.write_str(", shared")?;
        }
        f.write_str(")")
    }
}

/// The holders as one phrase for messages: `held by pid 1 (…), pid 2 (…)`,
/// or `no holder seen` when the list is empty.
pub(crate) fn describe(holders: &[LockHolder]) -> String {
    if holders.is_empty() {
        return "no holder seen (it may have just let go)".to_owned();
    }
    let list: Vec<String> = holders.iter().map(ToString::to_string).collect();
    format!("held by {}", list.join(", "))
}

/// The other backends of this database that hold `key`; the public form
/// is [`admin::lock_holders`](crate::admin::lock_holders).
pub(crate) async fn lock_holders<C: GenericClient + Sync>(
    client: &C,
    key: LockKey,
) -> Result<Vec<LockHolder>> {
    // No schema involved: "\0" matches no server message, so a missing
    // relation is never taken for a missing pgelect schema.
    query_holders(client, key)
        .await
        .map_err(|e| Error::db("find the holders of a lock", "\0", e))
}

/// [`lock_holders`] with the driver's error, for callers that classify it.
pub(crate) async fn query_holders<C: GenericClient + Sync>(
    client: &C,
    key: LockKey,
) -> std::result::Result<Vec<LockHolder>, tokio_postgres::Error> {
    Ok(key_sessions(client, key, false)
        .await?
        .into_iter()
        .map(|s| s.holder)
        .collect())
}

/// A session with `key` in `pg_locks`: what [`LockHolder`] says of it
/// (`mode` the mode held or wanted), its `application_name` as the server
/// gave it (`None` when it is not visible), and whether it holds the key.
pub(crate) struct KeySessionRow {
    pub(crate) holder: LockHolder,
    pub(crate) application_name: Option<String>,
    pub(crate) granted: bool,
}

/// The other backends of this database that hold `key`, and with
/// `waiting` also those that wait for it, in pid order.
pub(crate) async fn key_sessions<C: GenericClient + Sync>(
    client: &C,
    key: LockKey,
    waiting: bool,
) -> std::result::Result<Vec<KeySessionRow>, tokio_postgres::Error> {
    let (classid, objid, objsubid) = key.pg_locks_ids();
    let rows = client
        .query_typed(
            "SELECT l.pid, a.usename::text, a.application_name,
                    host(a.client_addr), l.mode,
                    extract(epoch FROM now() - a.state_change)::float8, l.granted
               FROM pg_locks l
               LEFT JOIN pg_stat_activity a ON a.pid = l.pid
              WHERE l.locktype = 'advisory' AND (l.granted OR $4)
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND l.classid = $1 AND l.objid = $2 AND l.objsubid = $3
                AND l.pid <> pg_backend_pid()
              ORDER BY l.pid",
            &[
                (&classid, Type::OID),
                (&objid, Type::OID),
                (&objsubid, Type::INT2),
                (&waiting, Type::BOOL),
            ],
        )
        .await?;
    rows.iter()
        .map(|r| {
            let application_name: Option<String> = r.try_get(2)?;
            Ok(KeySessionRow {
                holder: LockHolder {
                    pid: r.try_get(0)?,
                    user: r.try_get(1)?,
                    application_name: application_name.clone().unwrap_or_default(),
                    client_addr: r.try_get(3)?,
                    mode: if r.try_get::<_, &str>(4)? == "ShareLock" {
                        LockMode::Shared
                    } else {
                        LockMode::Exclusive
                    },
                    state_age: r
                        .try_get::<_, Option<f64>>(5)?
                        .filter(|s| s.is_finite() && *s >= 0.0)
                        .map(Duration::from_secs_f64),
                },
                application_name,
                granted: r.try_get(6)?,
            })
        })
        .collect()
}

/// How long a backend must have held a key, as far as pgelect can tell,
/// before a wait calls it a squatter: longer than any legitimate handover
/// between a lock grant and the lease row naming the new holder
/// (milliseconds).
pub(crate) const SQUAT_GRACE: Duration = Duration::from_secs(3);

/// How often a polling standby looks up who holds its role's key: as
/// often as a blocking standby does with the default `wait_slice`, so that
/// a standby behind a live leader costs one more short statement per 10 s
/// (on a shared connection, per role).
pub(crate) const SQUAT_CHECK_EVERY: Duration = Duration::from_secs(10);

/// Tells squatters apart from legitimate holders over the checks of one
/// wait, and says which are new (to warn about each pid once).
#[derive(Debug, Default)]
pub(crate) struct SquatWatch {
    /// Foreign holders seen at an earlier check, with when first seen.
    seen: HashMap<i32, Instant>,
    warned: HashSet<i32>,
    last_check: Option<Instant>,
}

impl SquatWatch {
    /// True when a check is due: the first one, then every
    /// [`SQUAT_CHECK_EVERY`].
    pub(crate) fn due(&self, now: Instant) -> bool {
        self.last_check
            .is_none_or(|t| now.saturating_duration_since(t) >= SQUAT_CHECK_EVERY)
    }

    /// Takes the holders of a role's key and the pid the lease row names
    /// as its live holder; returns the squatters not warned about before.
    ///
    /// A holder other than the row's is a squatter once it has held the
    /// key for [`SQUAT_GRACE`]: its session state has not changed for that
    /// long, or it was seen at a check at least that long ago. A new
    /// leader between its lock grant and its term statement is such a
    /// holder for milliseconds only.
    pub(crate) fn check(
        &mut self,
        now: Instant,
        holders: Vec<LockHolder>,
        row_pid: Option<i32>,
    ) -> Vec<LockHolder> {
        self.last_check = Some(now);
        let foreign: Vec<LockHolder> = holders
            .into_iter()
            .filter(|h| Some(h.pid) != row_pid)
            .collect();
        self.seen
            .retain(|pid, _| foreign.iter().any(|h| h.pid == *pid));
        let mut new = Vec::new();
        for h in foreign {
            let first = *self.seen.entry(h.pid).or_insert(now);
            let long = h.state_age.is_some_and(|a| a >= SQUAT_GRACE)
                || now.saturating_duration_since(first) >= SQUAT_GRACE;
            if long && self.warned.insert(h.pid) {
                new.push(h);
            }
        }
        new
    }

    /// The pids currently taken for squatters.
    pub(crate) fn squatting(&self) -> usize {
        self.seen
            .keys()
            .filter(|pid| self.warned.contains(pid))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: i32, age: Option<u64>) -> LockHolder {
        LockHolder {
            pid,
            user: Some("mallory".into()),
            application_name: "pgelect:scheduler:\u{1b}[2Jx".into(),
            client_addr: None,
            mode: LockMode::Exclusive,
            state_age: age.map(Duration::from_secs),
        }
    }

    #[test]
    fn display_escapes_what_the_client_chose() {
        let text = holder(7, None).to_string();
        assert!(!text.contains('\u{1b}'), "{text}");
        assert!(text.starts_with("pid 7 (user \"mallory\""), "{text}");
    }

    #[test]
    fn a_claim_is_parsed_from_the_application_name() {
        let mut h = holder(1, None);
        h.application_name = "pgelect:scheduler:node-a".into();
        assert_eq!(h.claims_pgelect_candidate(), Some(("scheduler", "node-a")));
        h.application_name = "psql".into();
        assert_eq!(h.claims_pgelect_candidate(), None);
    }

    #[test]
    fn the_row_holder_is_never_a_squatter() {
        let mut w = SquatWatch::default();
        let now = Instant::now();
        assert!(w.check(now, vec![holder(5, Some(60))], Some(5)).is_empty());
    }

    #[test]
    fn a_long_idle_foreign_holder_is_reported_once() {
        let mut w = SquatWatch::default();
        let now = Instant::now();
        let got = w.check(now, vec![holder(9, Some(10))], Some(5));
        assert_eq!(got.iter().map(|h| h.pid).collect::<Vec<_>>(), [9]);
        assert_eq!(w.squatting(), 1);
        assert!(w
            .check(now + SQUAT_GRACE, vec![holder(9, Some(13))], None)
            .is_empty());
    }

    #[test]
    fn a_fresh_holder_needs_a_second_look_after_the_grace() {
        let mut w = SquatWatch::default();
        let t0 = Instant::now();
        assert!(w.check(t0, vec![holder(9, Some(0))], None).is_empty());
        assert!(!w.due(t0 + SQUAT_GRACE));
        assert!(w.due(t0 + SQUAT_CHECK_EVERY));
        let got = w.check(t0 + SQUAT_GRACE, vec![holder(9, Some(0))], None);
        assert_eq!(got.len(), 1);
        // Gone, then back: the same pid is not warned about twice.
        assert!(w.check(t0 + SQUAT_GRACE * 2, vec![], None).is_empty());
        assert_eq!(w.squatting(), 0);
    }

    #[test]
    fn a_new_leader_writing_its_row_is_not_a_squatter() {
        let mut w = SquatWatch::default();
        let t0 = Instant::now();
        assert!(w.check(t0, vec![holder(3, Some(0))], None).is_empty());
        // Next check: the row names it.
        assert!(w
            .check(t0 + SQUAT_GRACE, vec![holder(3, Some(0))], Some(3))
            .is_empty());
    }

    #[test]
    fn describe_lists_every_holder() {
        assert!(describe(&[]).starts_with("no holder"));
        let d = describe(&[holder(1, None), holder(2, None)]);
        assert!(d.contains("pid 1") && d.contains("pid 2"), "{d}");
    }
}
