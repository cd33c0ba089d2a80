//! Leader election, fencing tokens and advisory locks on the PostgreSQL you
//! already run.
//!
//! pgelect turns a PostgreSQL database into a coordination service: no etcd,
//! ZooKeeper or Consul to operate.
//!
//! * **Locks** ([`lock`]): session advisory locks on a connection pgelect
//!   owns ([`LockSession`], [`LockGuard`] with [`lost()`](LockGuard::lost)),
//!   and transaction locks on *your* transaction ([`xact_lock`],
//!   [`xact_lock_timeout`], …; sqlx behind the `sqlx` feature). Shared and
//!   exclusive, try / wait / bounded wait. Semaphores ([`Semaphore`],
//!   [`Permit`]): at most N holders at once, waiters served in order.
//! * **Keys** ([`LockKey`]): from integers, pairs, names (hashed the same way
//!   as SQL `pgelect.key(name)`) and UUIDs.
//! * **Election** ([`election`]): [`Elector`] and the [`Leadership`] handle
//!   with its fencing [`Term`], [`Leadership::fence`] for your transactions,
//!   observers ([`Elector::watch`], [`current_leader`]) and resign requests
//!   from other processes ([`request_resign`]). Two backends
//!   ([`Backend`]): `Session` (advisory lock: fast failover) and `Lease`
//!   (lease row only: safe through PgBouncer in transaction mode). Polling
//!   candidates of many roles can share one connection
//!   ([`SharedConnection`]).
//! * **Partitions** ([`partitions`]): a group of N partitions spread
//!   evenly over the live members of a fleet ([`PartitionGroup`]), each
//!   an ordinary role with its own fencing term; gains and losses as a
//!   stream of events with a token per partition.
//! * **Schema** ([`migrate`]): installs the `pgelect` schema (idempotent,
//!   concurrency-safe).
//!
//! # Where the code is
//!
//! * `lock/`: advisory locks (session locks on a connection pgelect owns,
//!   transaction locks on yours, who holds a key).
//! * `election/`: the elector. Pure rules in `election/timing.rs` (the
//!   safety inequalities) and `election/keeper.rs` (the leader's state
//!   machine, no I/O); the one loop that keeps a leadership, for every
//!   backend, in `election/driver.rs`; each backend's SQL and behaviour in
//!   `election/backend/` (`session.rs`, `lease/`, `shared.rs` for
//!   [`SharedConnection`]); observers in `election/watch.rs`; shared
//!   utilities (backoff, transient errors, waiting for a release `NOTIFY`,
//!   reconnecting, pooler detection) in `election/support.rs`. The
//!   [`election`] module's docs have the full map.
//! * `conn.rs`: connecting (options, TCP timeouts, the dedicated connection
//!   type); `error.rs`: [`Error`]; `key.rs`: [`LockKey`]; `schema.rs`:
//!   migrations; `server.rs`: what older PostgreSQL versions lack (logged
//!   once, never fatal); `metrics.rs`: metric names.
//!
//! # Guarantees, in short
//!
//! * At most one process holds a role's lock or lease at a time, on the
//!   database's word.
//! * A leader stops acting (its token is cancelled) when its connection
//!   ends, when a renewal finds another holder, or at its local deadline,
//!   measured on the monotonic clock from the *sending* of its last
//!   successful renewal, whether or not the database can be reached. The
//!   configuration is checked so that this deadline passes before anyone
//!   else can take over ([`ElectorBuilder`] lists the inequalities with
//!   their default numbers).
//! * A process that was paused cannot run timers; writes that must never
//!   overlap go through the fence: a fenced transaction of an old term never
//!   commits after a newer term began.
//!
//! # Quick start
//! ```no_run
//! # async fn f() -> Result<(), pgelect::Error> {
//! let options = pgelect::ConnectOptions::from_url("postgres://app:secret@localhost/app")?;
//! pgelect::migrate(&options).await?;
//! let elector = pgelect::Elector::builder(options, "scheduler").build()?;
//! let leadership = elector.leadership().await?;
//! println!("leading with term {}", leadership.term());
//! leadership.lost().await; // do the work until this fires
//! # Ok(()) }
//! ```

mod conn;
pub mod election;
mod error;
mod grants;
mod key;
pub mod lock;
pub mod metrics;
pub mod partitions;
mod schema;
mod server;

pub use conn::{ConnectOptions, PlainConnection, SslMode, TcpTimeouts, DEFAULT_CONNECT_TIMEOUT};
pub use election::{
    current_leader, request_resign, Backend, Elector, ElectorBuilder, LeaderContext, LeaderInfo,
    Leadership, LossReason, Profile, SharedConnection, SharedLease, StandbyMode, Term,
    TimingReport, LEADER_CHANNEL, MAX_ROLE_BYTES, RESIGN_CHANNEL,
};
/// Test hook, not API (feature `test-hooks`): the lease backend's statements
/// and the shared connection's batched renewal.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use election::{lease_sql, shared_renew_sql, LeaseSql};
pub use error::{Error, Result, SQLSTATE_NO_LEADER, SQLSTATE_STALE_TERM};
pub use grants::{grant_statements, preemption_grant, Grant, UserKind, MAX_USER_NAME_BYTES};
pub use key::{LockKey, MAX_KEY_NAME_BYTES};
pub use lock::{
    lock_holders, try_xact_lock, try_xact_lock_shared, xact_lock, xact_lock_shared,
    xact_lock_shared_timeout, xact_lock_timeout, LockGuard, LockHolder, LockMode, LockSession,
    LockSessionBuilder,
};
pub use lock::{semaphore_holders, Permit, PermitHolder, Semaphore, MAX_SEMAPHORE_LIMIT};
pub use partitions::{
    partition_assignment, partition_role, HeldPartition, PartitionAssignment, PartitionEvent,
    PartitionEvents, PartitionGroup, PartitionGroupBuilder, PartitionLeader, MAX_PARTITIONS,
};
pub use schema::{
    check_schema, migrate, migrate_timeout, SchemaName, DEFAULT_SCHEMA, MIGRATE_LOCK_TIMEOUT,
    SCHEMA_VERSION,
};

/// The README's examples, compiled as doc tests so that they stay true.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
