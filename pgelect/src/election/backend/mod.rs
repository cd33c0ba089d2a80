//! The election backends: each one's statements and behaviour — how a
//! candidate campaigns, what its renewal is, what a loss looks like, how
//! its lock is let go of and released. The loop that keeps a leadership is
//! written once, in [`driver`](super::driver); each backend implements its
//! [`KeepBackend`](super::driver::KeepBackend).
//!
//! * [`session`]: a session advisory lock plus the lease row, on a
//!   connection that carries roles: a candidate's own, or a
//!   [`SharedConnection`](crate::election::SharedConnection) for the
//!   candidates of many roles with batched statements and one heartbeat.
//!   Split by what it does: the connections, `sql`, `campaign`, `keep`.
//! * [`lease`]: the lease row only (works through a transaction pooler),
//!   in one engine, [`SharedLease`](crate::election::SharedLease): one connection for
//!   the lease-backend candidates of many roles, with batched acquires,
//!   registrations and renewals; a lone candidate is a batch of one on a
//!   client of its own. Split by what it does: the client, `sql`,
//!   `campaign`, `keep`, `listen`.
//! * [`claim`]: one candidate per role on a shared connection or a shared
//!   lease client.
//! * [`batch`]: a leader's place in a batched renewal (a shared
//!   connection's or a lease client's), and the utilities both batch with
//!   (`chunks`, `until_wanted`).

mod batch;
mod claim;
pub(crate) mod lease;
pub(crate) mod session;

pub(crate) use batch::among;
