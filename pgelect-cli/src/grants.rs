//! `pgelect grants`: the GRANT statements a database user needs, printed
//! from the library's list (the one the book and the tests use); no
//! database connection.

use clap::{Args, ValueEnum};
use pgelect::admin::{grant_statements, preemption_grant, Grant, UserKind, MAX_USER_NAME_BYTES};
use pgelect::schema::SchemaName;

use crate::cli::Global;
use crate::exit::{self, Failure};

#[derive(Debug, Args)]
pub struct GrantsArgs {
    /// The database user (login role) to grant to. Printed as a quoted
    /// identifier, so upper case, spaces and quotes are kept exactly.
    #[arg(long, value_name = "NAME", value_parser = parse_user)]
    pub user: String,
    /// What the user does; repeat for a user with several jobs. Default:
    /// candidate.
    #[arg(long = "role-kind", value_enum, value_name = "KIND")]
    pub kinds: Vec<Kind>,
    /// With --role-kind candidate: also grant pg_signal_backend, so that the
    /// candidate can preempt a frozen leader of another database user
    /// (zombie preemption). Without it that leader is replaced only when its
    /// connection dies; the candidate logs once that preemption is
    /// unavailable.
    #[arg(long)]
    pub zombie_preemption: bool,
}

/// What a database user does with pgelect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    /// Stands for election (`pgelect run`, `Elector`), either backend,
    /// blocking or polling; reads the leader row.
    Candidate,
    /// Only fences its writes with a leader's term (`pgelect.fence`);
    /// nothing on the table.
    Fencer,
    /// Asks leaders to resign (`pgelect resign`, `request_resign`).
    Operator,
    /// Observes (`pgelect status`, `current_leader`, `Elector::watch`).
    Watcher,
    /// Runs `pgelect migrate` and owns the schema, without superuser:
    /// CREATE on the database; then gives the others their grants.
    Owner,
}

impl Kind {
    fn user_kind(self) -> UserKind {
        match self {
            Kind::Candidate => UserKind::Candidate,
            Kind::Fencer => UserKind::Fencer,
            Kind::Operator => UserKind::Operator,
            Kind::Watcher => UserKind::Watcher,
            Kind::Owner => UserKind::Owner,
        }
    }
}

/// A user name PostgreSQL can take: not empty, at most 63 bytes (longer is
/// truncated by the server to another name). A NUL cannot reach a command
/// line; the library refuses it too.
fn parse_user(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("the user name is empty".into());
    }
    if s.contains('\0') {
        return Err("the user name contains a NUL character".into());
    }
    if s.len() > MAX_USER_NAME_BYTES {
        return Err(format!(
            "the user name is {} bytes long; PostgreSQL names are at most {} bytes",
            s.len(),
            MAX_USER_NAME_BYTES
        ));
    }
    Ok(s.to_owned())
}

pub fn run(global: &Global, args: GrantsArgs) -> Result<u8, Failure> {
    let schema = SchemaName::new(&global.schema)?;
    let mut kinds = if args.kinds.is_empty() {
        vec![Kind::Candidate]
    } else {
        args.kinds.clone()
    };
    kinds.dedup();
    if args.zombie_preemption && !kinds.contains(&Kind::Candidate) {
        return Err(Failure::new(
            exit::USAGE,
            "--zombie-preemption is for --role-kind candidate",
        ));
    }
    let mut out = String::new();
    out.push_str(&format!(
        "-- pgelect {}: grants for database user {:?} on schema {schema}.\n-- Run as the schema's owner (the user that ran pgelect migrate) or a superuser.\n",
        env!("CARGO_PKG_VERSION"),
        args.user
    ));
    for kind in kinds {
        let k = kind.user_kind();
        out.push_str(&format!("\n-- {k}: {}\n", k.describe()));
        for g in grant_statements(k, &args.user, &schema)? {
            push(&mut out, &g, false);
        }
        if kind == Kind::Candidate {
            let g = preemption_grant(&args.user)?;
            push(&mut out, &g, !args.zombie_preemption);
        }
    }
    print!("{out}");
    Ok(0)
}

fn push(out: &mut String, g: &Grant, commented: bool) {
    if commented {
        out.push_str("-- ");
    }
    out.push_str(&g.sql);
    out.push(';');
    match (g.needed_for, commented) {
        (_, true) => out.push_str(
            "  -- optional: zombie preemption (--zombie-preemption; needs a superuser, or ADMIN on pg_signal_backend)",
        ),
        (Some(why), false) => out.push_str(&format!("  -- {why}")),
        (None, false) => {}
    }
    out.push('\n');
}
