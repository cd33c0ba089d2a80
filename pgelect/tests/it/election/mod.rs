//! Leader election: each backend, shared connections, priorities, processes,
//! load, primary failover and fencing.

mod crowd;
mod fast_profile;
#[cfg(feature = "sqlx")]
mod fence_sqlx;
mod last_contact;
mod lease;
mod lease_functions;
mod plans;
mod primary_failover;
mod priority;
mod process;
mod scale;
mod session;
mod shared;
mod shared_lease;
