//! SIGTERM and SIGINT as a stream of requests to stop.

use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::exit::{self, Failure};

/// Listens for SIGTERM and SIGINT.
pub struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    pub fn install() -> Result<Signals, Failure> {
        let fail = |e: std::io::Error| {
            Failure::new(
                exit::SOFTWARE,
                format!("cannot install signal handlers: {e}"),
            )
        };
        Ok(Signals {
            term: signal(SignalKind::terminate()).map_err(fail)?,
            int: signal(SignalKind::interrupt()).map_err(fail)?,
        })
    }

    /// The next SIGTERM or SIGINT, by name.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
