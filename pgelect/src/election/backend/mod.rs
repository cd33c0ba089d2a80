//! The election backends: each one's statements and behaviour — how a
//! candidate campaigns, what its renewal is, what a loss looks like, how
//! its lock is let go of and released. The loop that keeps a leadership is
//! written once, in [`driver`](super::driver); each backend implements its
//! [`KeepBackend`](super::driver::KeepBackend).
//!
//! * [`session`]: a session advisory lock on a dedicated connection (or on
//!   a [`SharedConnection`](crate::SharedConnection)), plus the lease row.
//! * [`lease`]: the lease row only, as an elector sees it: its campaign,
//!   its keep and its `LISTEN` connection (works through a transaction
//!   pooler).
//! * [`shared`]: one lock connection for the session-backend candidates of
//!   many roles, and its shared heartbeat.
//! * [`shared_lease`]: the lease backend's one engine and its statements:
//!   one connection for the lease-backend candidates of many roles, with
//!   batched renewals, acquires and registrations; a lone candidate is a
//!   batch of one on a client of its own.
//! * [`claim`]: one candidate per role on a shared connection or client.
//! * [`batch`]: a leader's place in the batched renewal of either of those
//!   two, and the utilities both batch with (`chunks`, `until_wanted`).

mod batch;
mod claim;
pub(crate) mod lease;
pub(crate) mod session;
pub(crate) mod shared;
pub(crate) mod shared_lease;
