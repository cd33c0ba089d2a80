//! A model check of the election protocol over every interleaving, within
//! bounds, with the real [`Keeper`] of every candidate in the loop
//! (`stateright`, breadth-first).
//!
//! # What is modelled
//!
//! * **Candidates** (2 or 3 processes; with a shared connection, 2 roles per
//!   process on one connection): standby, the election statement, then the
//!   production [`Keeper`] driven as the driver drives it (`poll` until
//!   `None`, answers reported with their send time), the release after a
//!   resignation or a loss. A standby waits as `wait_blocking` has one of
//!   the default priority wait (`Standby::Watched`, every session scenario
//!   but those named otherwise): in the role's watch-key queue in slices of
//!   `wait_slice`; granted the key, as the watch, in the role's lock queue
//!   in slices of `min(check_every, wait_slice)`, after each a read of the
//!   row and, if it is vacant, `preempt`; granted the role's lock,
//!   it unlocks the watch key and waits for the answer before its
//!   election statement. Or directly in the role's lock queue with an
//!   observer (`Standby::Direct`: a candidate with a priority, or one whose
//!   watch key another user holds), or polling.
//! * **The server**: per role an advisory lock and a watch key, each with
//!   a FIFO of waiters whose wait slices end, and the `leaders` row (term,
//!   holder and its backend, lease expiry on the server clock); backends
//!   (one per connection incarnation) that end when the client closes,
//!   when an administrator, the watch or a direct standby's observer
//!   terminates them (zombie preemption: the holder the row names once its
//!   lease expired, or a holder no row names whose session has been idle
//!   for longer than the TTL while the row is vacant, as `preempt`
//!   does), when a queued standby's slice ends while the watch's session
//!   has been idle for longer than the TTL (`queue_slice_sql`, on the
//!   server's clock), or when the server's TCP timeouts declare a silent
//!   client gone; fenced writes (committed only while the row's term is
//!   the writer's, as the `FOR SHARE` fence does). The server's release
//!   time is computed here from the TCP settings as PostgreSQL applies them
//!   (whole seconds for keepalives, milliseconds for `TCP_USER_TIMEOUT`),
//!   independently of `timing::server_release_min`.
//! * **The network**: per-connection FIFO messages, each delivered within
//!   a bound of its sending (in any order with other events of the same
//!   tick), or lost while its process is partitioned. The two legs have
//!   their own bounds (`request_delay` towards the server, `reply_delay`
//!   back), so that a statement can reach the server at once and its answer
//!   come late, or the other way round.
//! * **Faults** (a bounded budget per run): crash (the kernel closes the
//!   socket unless partitioned), restart, pause (the process's timers and
//!   message handling stop; the kernel still answers TCP, so the server
//!   keeps its backend; on resume the user's code may issue one fenced
//!   write before the keeper runs), termination of a backend with or
//!   without the goodbye reaching the client, partition and heal, a
//!   resignation.
//! * **Time**: discrete ticks (a scenario's `tick`); each process has its
//!   own monotonic clock, which may run one tick fast or slow up to `drift`
//!   times in a run (clock-rate drift and scheduling delay within a TTL).
//!   States are compared up to a shift of time (every instant is hashed
//!   relative to the current one), so a healthy leader's endless renewals
//!   are a finite cycle.
//!
//! # Properties
//!
//! (a) never two candidates acting (keeper phase `Active`) for one role at
//! one instant, unless one of them is paused; (b) fenced writes commit in
//! term order, and none of an older term commits after a newer term began;
//! (c) every activation's term is higher than every earlier activation's;
//! (d) with a healthy candidate (up, reachable) a role has an acting
//! leader within the scenario's bound after the last fault, with no case
//! excused: a candidate paused between the grant of its lock and its term
//! transaction is preempted once its session has been idle for a TTL, and
//! a watch paused or cut off is ended by a queued standby once its session
//! has been idle for a TTL (the bound's derivation is on
//! `Scenario::liveness_bound`; without either, the checker finds the role
//! leaderless for the whole pause).
//!
//! # Left out
//!
//! Priorities and hand-over to preferred candidates (so direct and watched
//! standbys never stand together, as a priority candidate among default
//! ones would), resign hints, the observer's reads (only its preemption;
//! the observer is not a connection of its own), the squatter checks and
//! read-only checks (one database user, a primary that stays one),
//! a watch key held by another user, server restarts and failover,
//! poolers, connection set-up failures and backoff (a reconnection is
//! immediate), message duplication, and more faults, candidates, terms or
//! drift than the bounds below.
//!
//! Abstractions of the watch: a backend ended by `pg_terminate_backend`
//! (the queued standby's or the watch's) ends at once, not a moment
//! later; the queued standby's termination sends the goodbye (a lost one
//! is the `Terminate` fault's case), the watch's may lose it, as an
//! observer's may; a session's `state_change` is the last message the
//! server handled on it or the end of its last lock statement (a
//! statement runs in no time otherwise).
//!
//! # Files
//!
//! * [`scenario`]: what a run checks, and its bounds in ticks;
//! * [`state`]: the world one state holds, the steps between states, and
//!   states compared up to a shift of time;
//! * [`actions`]: the transition system (initial states, steps, next
//!   state), with [`server`] and [`candidate`] for each side of a step;
//! * [`properties`]: what is checked on every state, and the examples
//!   that must be found;
//! * [`explorer`]: the breadth-first check and its report;
//! * [`scenarios`]: the scenarios checked; the tests run them.

mod actions;
mod candidate;
mod explorer;
mod properties;
mod scenario;
mod scenarios;
mod server;
mod state;
#[cfg(test)]
mod tests;
