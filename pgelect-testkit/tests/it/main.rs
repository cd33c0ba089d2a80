//! Integration tests of the test kit itself: throwaway clusters, PgBouncer,
//! the fault proxy, replicas and TLS.

mod support;

mod autofailover;
mod kit;
mod replica;
mod tls;
