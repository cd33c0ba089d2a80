//! For operators' tools: the state of every role as typed rows, forgetting
//! roles, resign requests, who holds a lock, and the grants each kind of
//! database user needs.
//!
//! The `pgelect` command's `status`, `resign`, `forget` and `grants` only
//! present what this module returns: every statement they run about
//! pgelect's tables, and how role names map to advisory-lock keys, are
//! here, so that a tool cannot drift from what the library does.
//!
//! * [`AdminClient`]: one connection, with [`status`](AdminClient::status)
//!   ([`Status`]: the [`ServerInfo`], every [`RoleStatus`] with its
//!   [`Candidate`]s and squatters, every [`HeldLock`]),
//!   [`role`](AdminClient::role), [`forget`](AdminClient::forget)
//!   ([`ForgetOutcome`]), [`request_resign`](AdminClient::request_resign),
//!   [`lease_row`](AdminClient::lease_row) and
//!   [`changed`](AdminClient::changed) (wakes on every change of leader).
//! * One-shot calls on their own short-lived connection:
//!   [`current_leader`], [`request_resign`].
//! * On your own connection: [`lock_holders`], [`semaphore_holders`].
//! * Privileges: [`grant_statements`], [`preemption_grant`] for each
//!   [`UserKind`], the one list the book's privileges chapter and
//!   `pgelect grants` show.
//! * Naming: [`lock_session_name`], how a lock session names its lock and
//!   node so that [`HeldLock`] can show them.
//!
//! What sessions say about themselves (`application_name`) is chosen by
//! their clients: anyone can call themselves `pgelect:<role>:<node>`. Only
//! pids, users and the lease rows are the server's word; status lists the
//! holders of a role's lock that its row does not name apart, as squatters.
//!
//! ```no_run
//! # async fn f() -> pgelect::Result<()> {
//! use pgelect::admin::{AdminClient, ForgetOutcome};
//! let options = pgelect::ConnectOptions::from_url("postgres://owner@db/app")?;
//! let mut admin = AdminClient::connect(&options).await?;
//! let scheduler = admin.role("scheduler").await?;
//! println!("term {}, {} candidates", scheduler.term, scheduler.candidates.len());
//! if let ForgetOutcome::Forgotten { last_term } = admin.forget("old-role").await? {
//!     println!("forgot old-role at term {last_term}");
//! }
//! # Ok(()) }
//! ```

mod client;
mod forget;
mod grants;
mod leader;
mod locks;
mod status;

pub use client::{AdminClient, LeaseRow};
pub use forget::{ForgetOutcome, KeySession, StandingCandidate};
pub use grants::{grant_statements, preemption_grant, Grant, UserKind, MAX_USER_NAME_BYTES};
pub use leader::{current_leader, request_resign};
pub(crate) use locks::parse_lock_session_name;
pub use locks::{lock_holders, lock_session_name, semaphore_holders, HeldLock, HeldLockKind};
pub use status::{Candidate, CandidateState, RoleStatus, ServerInfo, Status};
