//! Integration tests of the pgelect library, one binary with a module per subject.
//!
//! Every test that needs a server starts its own throwaway PostgreSQL (and
//! PgBouncer where pooling matters) through `pgelect-testkit`; `support`
//! holds the helpers they share.

mod admin;
mod api;
mod election;
mod ha;
mod locks;
mod loss;
mod partitions;
mod schema;
mod security;
mod server_timeouts;
mod support;
