//! The privileges each kind of database user needs: the one list that the
//! book's privileges chapter (`docs/src/operations/privileges.md`),
//! `pgelect grants` and the privilege tests share.

use std::fmt;

use crate::error::{Error, Result};
use crate::schema::SchemaName;

/// PostgreSQL's longest identifier, in bytes (`NAMEDATALEN - 1`): a longer
/// user name would be truncated by the server, and so name someone else.
pub const MAX_USER_NAME_BYTES: usize = 63;

/// What a database user does with pgelect, and so which grants it needs
/// (see [`grant_statements`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UserKind {
    /// Stands for election: both backends, blocking and polling standbys,
    /// shared connections; its observer reads the row. Zombie preemption
    /// needs [`preemption_grant`] as well.
    Candidate,
    /// Only fences (`Leadership::fence` from an application's own
    /// connection): nothing on the table.
    Fencer,
    /// Asks leaders to resign ([`request_resign`](super::request_resign),
    /// `pgelect resign`).
    Operator,
    /// Observes: [`current_leader`](super::current_leader),
    /// [`AdminClient::status`](super::AdminClient::status), `Elector::watch`,
    /// `pgelect status`.
    Watcher,
    /// Migrates (`pgelect migrate`) and then owns the schema: `CREATE` on
    /// the database, no superuser. `fence` and `request_resign` run with
    /// its rights.
    Owner,
}

impl UserKind {
    /// Every kind, in the order of the book's privileges chapter.
    pub const ALL: [UserKind; 5] = [
        UserKind::Owner,
        UserKind::Candidate,
        UserKind::Fencer,
        UserKind::Operator,
        UserKind::Watcher,
    ];

    /// The kind's name: `candidate`, `fencer`, `operator`, `watcher`,
    /// `owner`.
    pub fn as_str(self) -> &'static str {
        match self {
            UserKind::Candidate => "candidate",
            UserKind::Fencer => "fencer",
            UserKind::Operator => "operator",
            UserKind::Watcher => "watcher",
            UserKind::Owner => "owner",
        }
    }

    /// What the kind may do, in a sentence.
    pub fn describe(self) -> &'static str {
        match self {
            UserKind::Candidate => "stands for election with either backend, blocking or polling, on its own or a shared connection, and reads the leader row",
            UserKind::Fencer => "fences writes with a leader's term (pgelect.fence) from its own transactions, and nothing else",
            UserKind::Operator => "asks a role's leader to resign (pgelect::admin::request_resign, pgelect resign) and reads the row to wait for the new term",
            UserKind::Watcher => "observes leaders: current_leader, AdminClient::status, Elector::watch, pgelect status",
            UserKind::Owner => "runs pgelect migrate and owns the schema, without superuser; gives the other kinds their grants",
        }
    }
}

impl fmt::Display for UserKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for UserKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<UserKind> {
        UserKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                Error::config(format!(
                    "unknown kind of user {s:?}: expected candidate, fencer, operator, watcher or owner"
                ))
            })
    }
}

/// One `GRANT`, with why it is there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The statement, without a trailing `;`.
    pub sql: String,
    /// What needs it, when that is narrower than the whole kind (e.g.
    /// "blocking standbys").
    pub needed_for: Option<&'static str>,
}

/// The statements that give database user `user` exactly what `kind`
/// needs on the pgelect schema `schema`, as the book's "Privileges"
/// chapter lists them. The user name is quoted as an identifier (`"app"`,
/// `"O""Brien"`), so any name PostgreSQL accepts comes out valid; the
/// owner's grant names the current database at run time (a `DO` block),
/// so the statements need no database name.
///
/// Refuses with [`Error::InvalidName`] an empty name, one with a NUL
/// character, and one over [`MAX_USER_NAME_BYTES`] (the server would
/// truncate it to someone else's).
///
/// ```
/// use pgelect::admin::{grant_statements, UserKind};
/// use pgelect::schema::SchemaName;
/// let g = grant_statements(UserKind::Fencer, "Billing App", &SchemaName::default()).unwrap();
/// assert_eq!(g[1].sql, r#"GRANT EXECUTE ON FUNCTION pgelect.fence(text, bigint) TO "Billing App""#);
/// assert!(grant_statements(UserKind::Fencer, "", &SchemaName::default()).is_err());
/// ```
pub fn grant_statements(kind: UserKind, user: &str, schema: &SchemaName) -> Result<Vec<Grant>> {
    let u = quote_user(user)?;
    let s = schema.as_str();
    let grant = |sql: String| Grant {
        sql,
        needed_for: None,
    };
    let usage = grant(format!("GRANT USAGE ON SCHEMA {s} TO {u}"));
    Ok(match kind {
        UserKind::Candidate => vec![
            usage,
            grant(format!("GRANT SELECT ON {s}.migrations TO {u}")),
            grant(format!(
                "GRANT SELECT, INSERT, UPDATE ON {s}.leaders TO {u}"
            )),
            grant(format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.candidates TO {u}"
            )),
            Grant {
                sql: format!(
                    "GRANT EXECUTE ON FUNCTION {s}.lock_wait_slice(bigint, integer) TO {u}"
                ),
                needed_for: Some("blocking standbys"),
            },
            Grant {
                sql: format!("GRANT SELECT, INSERT, UPDATE ON {s}.group_views TO {u}"),
                needed_for: Some("partition groups: the group's view, kept for the fleet"),
            },
            Grant {
                sql: crate::election::lease_functions_grant(schema, &u),
                needed_for: Some(
                    "lease backend: statements the server plans once (without it they are sent whole)",
                ),
            },
        ],
        UserKind::Fencer => vec![
            usage,
            grant(format!(
                "GRANT EXECUTE ON FUNCTION {s}.fence(text, bigint) TO {u}"
            )),
        ],
        UserKind::Operator => vec![
            usage,
            grant(format!(
                "GRANT EXECUTE ON FUNCTION {s}.request_resign(text) TO {u}"
            )),
            Grant {
                sql: format!("GRANT SELECT ON {s}.leaders TO {u}"),
                needed_for: Some("`pgelect resign` waiting for the new term"),
            },
        ],
        UserKind::Watcher => vec![
            usage,
            grant(format!("GRANT SELECT ON {s}.leaders TO {u}")),
            Grant {
                sql: format!("GRANT EXECUTE ON FUNCTION {s}.key(text) TO {u}"),
                needed_for: Some("pgelect status"),
            },
            Grant {
                sql: format!("GRANT SELECT ON {s}.candidates TO {u}"),
                needed_for: Some("pgelect status (priorities and timing)"),
            },
        ],
        UserKind::Owner => {
            // The user name as an SQL string literal inside the block: the
            // server's format('%I') quotes it again as an identifier.
            // The dollar-quote tag is one the name does not contain.
            let literal = user.replace('\'', "''");
            let tag = (0..)
                .map(|i| format!("$pgelect{i}$"))
                .find(|t| !user.contains(t.as_str()))
                .expect("BUG: a 63-byte name cannot contain every tag");
            vec![grant(format!(
                "DO {tag} BEGIN EXECUTE pg_catalog.format('GRANT CREATE ON DATABASE %I TO %I', pg_catalog.current_database(), '{literal}'); END {tag}"
            ))]
        }
    })
}

/// The optional grant that lets a candidate preempt a *zombie* leader (one
/// whose lease expired while its connection still holds the lock, such as
/// a frozen process): `GRANT pg_signal_backend TO user`. Without it a
/// candidate can end only backends of its own database user; it logs once
/// that preemption is unavailable and waits until the zombie's connection
/// dies. Quoted and refused as in [`grant_statements`].
pub fn preemption_grant(user: &str) -> Result<Grant> {
    Ok(Grant {
        sql: format!("GRANT pg_signal_backend TO {}", quote_user(user)?),
        needed_for: Some("zombie preemption (optional)"),
    })
}

/// `user` as a quoted SQL identifier, or the reason it cannot be one.
fn quote_user(user: &str) -> Result<String> {
    let refuse = |reason: String| Error::InvalidName {
        what: "database user",
        shown: format!("{:?}", user.chars().take(40).collect::<String>()),
        reason,
    };
    if user.is_empty() {
        return Err(refuse("it is empty".into()));
    }
    if user.contains('\0') {
        return Err(refuse("it contains a NUL character".into()));
    }
    if user.len() > MAX_USER_NAME_BYTES {
        return Err(refuse(format!(
            "it is {} bytes long; PostgreSQL names are at most {MAX_USER_NAME_BYTES} bytes (a longer one is truncated to another name)",
            user.len()
        )));
    }
    Ok(format!("\"{}\"", user.replace('"', "\"\"")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names_are_quoted_identifiers() {
        assert_eq!(quote_user("app").unwrap(), r#""app""#);
        assert_eq!(quote_user("App").unwrap(), r#""App""#);
        assert_eq!(quote_user(r#"a"b"#).unwrap(), r#""a""b""#);
        assert_eq!(quote_user("o'brien").unwrap(), r#""o'brien""#);
        assert_eq!(quote_user(&"é".repeat(31)).unwrap().len(), 64);
    }

    #[test]
    fn bad_user_names_are_refused_with_the_reason() {
        for (name, why) in [
            ("", "empty"),
            ("a\0b", "NUL"),
            (&"x".repeat(64) as &str, "64 bytes"),
            (&"é".repeat(32), "64 bytes"),
        ] {
            let e = quote_user(name).unwrap_err();
            assert!(e.to_string().contains(why), "{name:?}: {e}");
        }
    }

    #[test]
    fn the_owner_grant_quotes_the_name_as_a_literal_too() {
        let g = grant_statements(UserKind::Owner, "o'b\"x", &SchemaName::default()).unwrap();
        assert!(g[0].sql.contains("'o''b\"x'"), "{}", g[0].sql);
    }

    #[test]
    fn the_owner_grant_dollar_quotes_with_a_tag_the_name_lacks() {
        let g = grant_statements(UserKind::Owner, "a$pgelect0$b", &SchemaName::default()).unwrap();
        assert!(g[0].sql.starts_with("DO $pgelect1$ "), "{}", g[0].sql);
    }

    #[test]
    fn kinds_parse_from_their_names() {
        for k in UserKind::ALL {
            assert_eq!(k.as_str().parse::<UserKind>().unwrap(), k);
        }
        assert!("admin".parse::<UserKind>().is_err());
    }
}
