//! Leader election: the [`Elector`], the [`Leadership`] handle, observers.
//!
//! One API, two backends ([`Backend`], chosen with
//! [`ElectorBuilder::backend`]): the same [`Elector::leadership`],
//! [`Leadership`] (term, token, loss reason, fence, resign),
//! [`Elector::watch`], [`Elector::run`] callbacks, and for operators
//! [`admin::current_leader`](crate::admin::current_leader) and
//! [`admin::request_resign`](crate::admin::request_resign). All candidates of a role must use the same backend;
//! a candidate that finds a live leader of the other one fails with
//! [`Error::Config`](crate::Error::Config).
//!
//! The book explains the ideas behind it: [roles, terms and
//! fencing](../../../book/concepts/roles-terms-fencing.html), [the two
//! backends](../../../book/concepts/backends.html) and [timing and
//! guarantees](../../../book/concepts/timing.html).
//!
//! # Which backend
//!
//! | | session (default) | lease |
//! |---|---|---|
//! | connection | direct or session-mode pool, one dedicated connection per candidate | anything, including PgBouncer in **transaction** mode; one connection, reopened at will |
//! | crashed leader replaced after | the server notices (ms for a killed process) + handover delay (2.5 s by default) | the lease expires: at most `ttl` (15 s by default) after the crash, + ≤ 50 ms |
//! | voluntary release taken over | at once (lock granted) | at once with [`listen_via`](LeaseOptions::listen_via), else within `retry_every` (1 s) |
//! | load at steady state | a heartbeat per second and a renewal per `renew_every` per leader; standbys block in the server | one statement per `renew_every` per leader, about one per `retry_every` per standby |
//! | frozen leader | preempted (`pg_terminate_backend`) once its lease expired | taken over once its lease expired |
//!
//! Choose the session backend where candidates can reach PostgreSQL
//! directly (fast crash failover, push detection of a dead leader). Choose
//! the lease backend behind a transaction pooler (where session advisory
//! locks silently break: the lock stays on a pooled server backend), or
//! where a failover time of about one TTL is fine and the fewest moving
//! parts are wanted.
//!
//! # The lease backend
//!
//! Every step is one statement, hence one transaction, and every time
//! comparison uses the server's `now()`; the remaining lease is computed by
//! the server, so the candidates' clocks never need to agree.
//!
//! 1. A standby runs one upsert that takes the role's row only if it has no
//!    holder or its lease expired (`lease_until < now()`), bumping the term
//!    (a missing row is inserted with term 1). Concurrent candidates are
//!    serialised by the row lock: exactly one wins.
//! 2. Not won, it learns from the same statement how long the lease still
//!    runs (server arithmetic), and tries again at that expiry plus a
//!    jitter of at most 50 ms (ttl/20 below a 1 s TTL) — capped by
//!    `retry_every` — or at once when a
//!    release `NOTIFY` arrives on the [`listen_via`](LeaseOptions::listen_via)
//!    connection.
//! 3. The leader renews every `renew_every` with an update scoped to its
//!    holder name *and* term. No row means another candidate took over:
//!    leadership ends at once ([`LossReason::Preempted`]). Failed renewals
//!    (connection refused or reset, PgBouncer restarting, statement timeout)
//!    are retried, reconnecting as needed, until the local deadline
//!    (`ttl - safety_margin` after the *sending* of the last successful
//!    renewal) — never beyond: then leadership ends
//!    ([`LossReason::Deadline`]) whether or not the database answers.
//! 4. Resigning clears the holder where holder and term are ours and sends
//!    `NOTIFY`, in one statement. [`request_resign`](crate::admin::request_resign) reaches a lease leader
//!    through a `resign_requested` flag returned by its next renewal; with
//!    a `listen_via` connection its `NOTIFY` hint brings that renewal
//!    forward, so the leader steps down at once (the hint alone, which
//!    anyone may send, moves nothing).
//!
//! Safety: the old leader's local deadline ends before its lease expires on
//! the server (the lease was set by the server after the renewal was sent,
//! for `ttl > ttl - safety_margin`), and a lease is taken only once expired
//! or released — so acting intervals do not overlap as long as clocks
//! advance at about the same rate and no process pauses longer than the
//! margin. [`LeaderContext::fence`] serialises writes with leadership even
//! without those assumptions.
//!
//! # The session backend
//!
//! Each candidate owns a dedicated connection (never a pooled one) named
//! `pgelect:<role>:<node>`, with server-side TCP keepalives and
//! `TCP_USER_TIMEOUT` set, and idle/statement timeouts off.
//!
//! 1. A standby waits on `pg_advisory_lock` of the role's key (see
//!    [`StandbyMode`]); PostgreSQL grants it the moment the leader's backend
//!    ends or unlocks. The wait notices its own connection dying (the driver
//!    task reads the socket all the time; client-side keepalives) and
//!    reconnects with backoff and jitter.
//! 2. Granted, it bumps the term and writes the lease row in one statement
//!    on the same connection, and learns whether the previous leader
//!    released cleanly. Only then is anyone told.
//! 3. After a clean release it acts at once. Otherwise (the row still named a
//!    holder: a crash, a terminated backend, a reset connection) it waits the
//!    *handover delay*, long enough for a live old leader to notice that its
//!    connection is gone; the old term is already fenced off meanwhile.
//! 4. The leader renews the lease every `renew_every`, heartbeats every
//!    `heartbeat`, and ends its leadership — cancelling the token — the
//!    moment the connection closes, a heartbeat or renewal times out, a
//!    renewal finds the row no longer ours, or its local deadline
//!    (`ttl - safety_margin` after the last successful renewal was sent, on
//!    the monotonic clock) passes, even with the database unreachable.
//! 5. A standby that finds the lock held but the lease expired on the
//!    server's clock (a frozen leader) terminates that backend, if allowed.
//! 6. Resigning stops the duties first, then clears the holder, notifies and
//!    unlocks: a blocking standby takes over within milliseconds.
//!
//! # Guarantees (session backend)
//!
//! * **Safety.** At most one process holds the role's advisory lock. Acting
//!   intervals of two leaders do not overlap as long as each process's
//!   timers run (no pause longer than the margins) and clocks advance at
//!   about the same rate: see the inequalities enforced by
//!   [`ElectorBuilder::build`]. Writes made through
//!   [`LeaderContext::fence`] are serialised with leadership even without
//!   those assumptions (a paused or partitioned old leader's fenced
//!   transactions fail once a newer term began).
//! * **Partition.** A leader cut off from the database demotes itself at its
//!   local deadline; the server releases its lock only later (its TCP
//!   timeouts are longer than the deadline), and the new leader still waits
//!   the handover delay.
//! * **Pause.** A stopped leader process cannot act on timers; once its lease
//!   expired on the server clock, a standby terminates its backend and takes
//!   over; when it resumes it sees its connection closed and its deadline
//!   passed. Use the fence for writes.
//! * **Database restart.** Every connection ends; leaders demote at once
//!   (push detection); candidates reconnect; exactly one wins, with a higher
//!   term (terms are stored in the table), after the handover delay.
//! * **Liveness.** A crashed leader is replaced after the server notices
//!   (at once for a killed process, whose kernel closes the socket) plus the
//!   handover delay (2.5 s by default); a resigning one at once.
//!
//! # Preferred leaders
//!
//! A candidate may carry a [priority](ElectorBuilder::priority) (default 0).
//! Every candidate registers in `<schema>.candidates` (schema version 5)
//! before it waits: its priority, its timing, and — session backend — the
//! server's `pg_backend_pid()` of its lock connection. A leader hands over
//! ([`LossReason::HandedOver`]: duties stop, then the usual clean release,
//! a new term, no overlap) to a candidate of **strictly** higher priority
//! that is *ready*, read from what the server sets, never from what a
//! candidate says: its registered backend waits on the role's lock in
//! `pg_locks` (blocking standby), lives and still polls (polling standby),
//! or it registered within its `ttl` (lease backend). Equal priorities
//! never take over from each other; a registered candidate that died,
//! stopped waiting or stopped polling is not ready.
//!
//! * **When.** At every renewal, and at once when the registering candidate's
//!   hint (a `NOTIFY` on [`RESIGN_CHANNEL`]; anyone may send one, so it only
//!   brings the check forward, at most once per 100 ms) reaches the leader.
//!   Session backend: the registration is pipelined with the first wait
//!   slice, so the check finds the candidate queued; measured handover in
//!   the tests: about 10 ms from the leader's check to the new leader's
//!   term, 0.3–0.5 s from a new process starting to stand (connecting
//!   included). A lease leader hears the hint only with
//!   [`listen_via`](LeaseOptions::listen_via), else at its next renewal.
//! * **FIFO queues.** A lower candidate granted the lock while a preferred
//!   one is ready gives it back before recording a term (nothing written,
//!   nobody told) and queues again after a pause (20 ms doubling to 1 s).
//!   Readiness is read at that very grant, so once the preferred candidate
//!   is gone the next grant proceeds: no livelock. Lease standbys leave a
//!   free or expired lease to a ready preferred candidate.
//! * **Security.** Only users with candidate grants may write the registry;
//!   other database users cannot register, and their hints, their waits on
//!   the role's (public) key, or a stale row that names their backend's
//!   recycled pid move nothing (the backend must belong to the user that
//!   registered and have started before the registration).
//!
//! # Where the code is
//!
//! The crate's front page has the code map (what each file holds); by
//! what they do (a unit test fails when a file or folder here is missing):
//!
//! | what | files |
//! | --- | --- |
//! | the elector and its handles | `elector.rs`, `config.rs`, `config_error.rs`, `leadership.rs` |
//! | pure rules | `timing.rs`, `keeper.rs`, `term.rs` |
//! | keeping a leadership | `driver.rs` (the one keep loop), `watchdog.rs` |
//! | candidates and observers | `registry.rs`, `watch.rs`, `support.rs` |
//! | the backends' common parts | `backend/`: `backend/mod.rs`, `backend/batch.rs`, `backend/claim.rs` |
//! | the session backend | `backend/session/`: `backend/session/mod.rs` (its sessions: of one candidate or shared, and their batches), `backend/session/lock_conn.rs` (one candidate's connection: a session of its own or a shared one), `backend/session/sql.rs`, `backend/session/campaign.rs`, `backend/session/keep.rs` |
//! | the lease backend | `backend/lease/`: `backend/lease/mod.rs` (its client), `backend/lease/sql.rs`, `backend/lease/campaign.rs`, `backend/lease/keep.rs`, `backend/lease/listen.rs` |
//! | the proof (tests only) | `sim.rs`; `model/`: `model/mod.rs`, `model/scenario.rs`, `model/scenarios.rs`, `model/state.rs`, `model/actions.rs`, `model/server.rs`, `model/candidate.rs`, `model/properties.rs`, `model/explorer.rs`, `model/tests.rs` |
//! | this page | `mod.rs` |
//!
//! ```no_run
//! # async fn f() -> Result<(), pgelect::Error> {
//! use std::time::Duration;
//! let options = pgelect::ConnectOptions::from_url("postgres://app@db/app")?;
//! let elector = pgelect::Elector::builder(options, "scheduler")
//!     .ttl(Duration::from_secs(10))
//!     .build()?;
//! let leadership = elector.leadership().await?;
//! println!("leading with term {}", leadership.term());
//! tokio::select! {
//!     loss = leadership.lost() => println!("lost: {}", loss.reason()),
//!     _ = tokio::time::sleep(Duration::from_secs(60)) => leadership.resign().await?,
//! }
//! # Ok(()) }
//! ```

mod backend;
pub(crate) mod config;
pub(crate) mod config_error;
mod driver;
pub(crate) mod elector;
mod keeper;
pub(crate) mod leadership;
#[cfg(test)]
mod model;
mod registry;
#[cfg(test)]
mod sim;
mod support;
mod term;
mod timing;
mod watch;
mod watchdog;

// The elector, its builder, `Leadership` and `Term` are re-exported at the
// crate root only (the front door); this module names the rest.
#[cfg(doc)]
use crate::loss::LossReason;
pub use backend::lease::SharedLease;
pub(crate) use backend::lease::{
    functions_grant as lease_functions_grant, functions_sql as lease_functions_sql,
};
#[doc(hidden)]
#[cfg(feature = "test-hooks")]
pub use backend::lease::{lease_sql, LeaseSql};
pub use backend::session::SharedConnection;
#[cfg(feature = "test-hooks")]
pub use backend::session::{
    shared_elect_sql, shared_poll_sql, shared_preempt_sql, shared_renew_sql,
};
#[cfg(test)]
pub(crate) use config::watch_key;
pub(crate) use config::{role_key, validate_name};
pub use config::{
    Backend, BackendOptions, LeaseOptions, SessionOptions, StandbyMode, MAX_ROLE_BYTES,
};
pub use config_error::{ConfigError, Setting};
pub use elector::TimingReport;
pub use leadership::LeaderContext;
#[cfg(feature = "test-hooks")]
pub use registry::shared_register_sql;
pub(crate) use timing::worst_detection;
pub use timing::Profile;
pub(crate) use watch::{leader_info, read_leader};
pub use watch::{LeaderInfo, LEADER_CHANNEL, RESIGN_CHANNEL};

pub(crate) use config::ElectorBuilder;
pub(crate) use elector::{Activity, Elector, ElectorState, LeaseState};
pub(crate) use leadership::{Leadership, Term};
