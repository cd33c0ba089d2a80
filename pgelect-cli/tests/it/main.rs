//! Integration tests of the `pgelect` command, one binary with a module per
//! subcommand or subject; each drives the built binary against a throwaway
//! server. `support` holds the helpers they share.

mod basics;
mod chaos;
mod child;
mod http;
mod lock;
mod ops;
mod partitions;
mod run;
mod security;
mod semaphore;
mod server_timeouts;
mod status;
mod support;
