//! Exit codes (sysexits where they fit) and how failures are reported.

use std::process::ExitCode;

/// Command line usage error.
pub const USAGE: u8 = 64;
/// The database is unavailable.
pub const UNAVAILABLE: u8 = 69;
/// Internal software error.
pub const SOFTWARE: u8 = 70;
/// Temporary failure: the lock was not acquired.
pub const TEMPFAIL: u8 = 75;
/// Permission denied.
pub const NOPERM: u8 = 77;
/// Configuration error.
pub const CONFIG: u8 = 78;

/// A failure to report on standard error with an exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn new(code: u8, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }

    pub fn report(self) -> ExitCode {
        eprintln!("pgelect: {}", self.message);
        ExitCode::from(self.code)
    }
}

impl From<pgelect::Error> for Failure {
    fn from(e: pgelect::Error) -> Failure {
        use pgelect::Error as E;
        let code = match &e {
            E::Config(_) | E::InvalidName { .. } => CONFIG,
            E::SchemaMissing { .. } | E::SchemaVersion { .. } | E::Pooler(_) => CONFIG,
            // A wrong password or a refused login (SQLSTATE class 28) is a
            // permission problem, not an outage: retrying will not help.
            E::Permission { .. } | E::Auth { .. } => NOPERM,
            E::LockTimeout { .. } | E::MigrationLockTimeout { .. } | E::AlreadyHeld { .. } => {
                TEMPFAIL
            }
            _ if e.is_connection() => UNAVAILABLE,
            _ => SOFTWARE,
        };
        // Errors name their cause chain's first link; add the rest.
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        let mut seen = 0;
        while let Some(s) = source {
            let text = s.to_string();
            if !message.contains(&text) && seen < 3 {
                message.push_str(": ");
                message.push_str(&text);
            }
            seen += 1;
            source = s.source();
        }
        Failure::new(code, message)
    }
}

/// Reports a command-line parse error: help and version go to standard output
/// with code 0, everything else is a usage error (64).
pub fn usage(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::from(USAGE)
        }
        _ => {
            let _ = e.print();
            ExitCode::from(USAGE)
        }
    }
}
