//! Leader election, fencing tokens and advisory locks on the PostgreSQL you
//! already run.
//!
//! pgelect turns a PostgreSQL database into a coordination service: no etcd,
//! ZooKeeper or Consul to operate.
//!
//! * [`LockKey`]: advisory-lock keys from integers, pairs, names (hashed the
//!   same way as SQL `pgelect.key(name)`) and UUIDs.
//! * [`migrate`]: installs the `pgelect` schema (idempotent, concurrency-safe).
//!
//! # Quick start
//! ```no_run
//! # async fn f() -> Result<(), pgelect::Error> {
//! let options = pgelect::ConnectOptions::from_url("postgres://app:secret@localhost/app")?;
//! pgelect::migrate(&options).await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod conn;
pub mod election;
mod error;
mod key;
pub mod lock;
pub mod metrics;
mod schema;

pub use conn::{ConnectOptions, TcpTimeouts, DEFAULT_CONNECT_TIMEOUT};
#[doc(inline)]
pub use election::*;
pub use error::{Error, Result, SQLSTATE_NO_LEADER, SQLSTATE_STALE_TERM};
pub use key::{LockKey, MAX_KEY_NAME_BYTES};
#[doc(inline)]
pub use lock::*;
pub use schema::{check_schema, migrate, SchemaName, DEFAULT_SCHEMA, SCHEMA_VERSION};
