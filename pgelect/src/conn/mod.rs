//! Connection settings and the dedicated connections pgelect owns.
//!
//! Locks and leadership live on connections that pgelect opens itself and
//! never returns to a pool. Each one is driven by a background task that reads
//! the socket all the time, so the server's goodbye (a terminated backend, a
//! restart) is noticed within milliseconds with no query in flight; the task
//! also forwards `LISTEN` notifications.
//!
//! * `options`: [`ConnectOptions`], read from a URL, a key/value string,
//!   the environment or a driver configuration;
//! * `connect`: establishing a connection (TLS as libpq, bounded, off the
//!   runtime's workers), and plain connections for observers;
//! * `dedicated`: the connections pgelect owns, their driver task and
//!   the session settings they start with;
//! * `cancel`: cancelling the statement running on one;
//! * `probe`: the connection probe every holder of a connection uses, and
//!   the defaults of probes and lock waits;
//! * `tcp`: [`TcpTimeouts`] on both ends of a lock connection;
//! * `params`, `passfile`, `tls`: libpq's connection parameters,
//!   password file and TLS settings.

mod cancel;
mod connect;
mod dedicated;
pub(crate) mod options;
mod params;
mod passfile;
pub(crate) mod probe;
mod tcp;
mod tls;

pub(crate) use dedicated::{DedicatedConnection, Notice};
pub(crate) use options::ConnectOptions;
pub use options::DEFAULT_CONNECT_TIMEOUT;
pub use tcp::TcpTimeouts;
pub use tls::SslMode;
