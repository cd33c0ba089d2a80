//! Exit codes (sysexits where they fit) and how failures are reported.

use std::process::ExitCode;

/// Command line usage error.
pub const USAGE: u8 = 64;
/// The database is unavailable.
pub const UNAVAILABLE: u8 = 69;
/// No such role: `status --role`, `resign --role` or `forget --role`
/// named a role nobody holds, stands for or has led (EX_NOINPUT).
pub const NO_SUCH_ROLE: u8 = 66;
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

    /// Adds `hint` to a failure that may come from the database being the
    /// wrong one or unreachable (exit 69, 77 or 78).
    pub fn with_hint(mut self, hint: Option<&str>) -> Failure {
        if let Some(hint) = hint {
            if matches!(self.code, UNAVAILABLE | NOPERM | CONFIG) {
                self.message.push_str("; ");
                self.message.push_str(hint);
            }
        }
        self
    }

    pub fn report(self) -> ExitCode {
        eprintln!("pgelect: {}", self.message);
        ExitCode::from(self.code)
    }
}

impl From<pgelect::Error> for Failure {
    fn from(e: pgelect::Error) -> Failure {
        // The library's own classification decides; the order matters
        // where predicates overlap (a connect timeout is a connection
        // problem first).
        // A database that does not exist (SQLSTATE 3D000) is a wrong name in
        // the configuration, not an outage: retrying will not help.
        let code = if e.is_unknown_role() {
            NO_SUCH_ROLE
        } else if e.is_config() || e.is_schema() || e.sqlstate() == Some("3D000") {
            CONFIG
        } else if e.is_auth() || e.is_permission() {
            // A wrong password or a refused login (SQLSTATE class 28) is a
            // permission problem, not an outage: retrying will not help.
            NOPERM
        } else if e.is_connection() {
            UNAVAILABLE
        } else if e.is_timeout() || matches!(e, pgelect::Error::AlreadyHeld { .. }) {
            TEMPFAIL
        } else {
            SOFTWARE
        };
        Failure::new(code, escape_controls(&message(&e)))
    }
}

/// The error's message and the causes it does not already name. The
/// library renders a tokio-postgres error itself (the server's severity,
/// message, detail and hint, without the driver's bare "db error"), so the
/// chain is followed only up to the first driver error.
fn message(e: &pgelect::Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    let mut seen = 0;
    while let Some(s) = source {
        if s.is::<tokio_postgres::Error>() || s.is::<tokio_postgres::error::DbError>() {
            break;
        }
        // A shared cause (`Arc<tokio_postgres::Error>`) shows as the error.
        if s.is::<std::sync::Arc<tokio_postgres::Error>>() {
            break;
        }
        let text = s.to_string();
        if !message.contains(&text) && seen < 3 {
            message.push_str(": ");
            message.push_str(&text);
        }
        seen += 1;
        source = s.source();
    }
    message
}

/// Server text may carry control characters (a role name, a message): they
/// are written as `\u{1b}` so that they cannot reach the terminal raw.
fn escape_controls(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' {
                format!("\\u{{{:x}}}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn exit_codes_follow_the_librarys_classification() {
        let code = |e: pgelect::Error| Failure::from(e).code;
        assert_eq!(
            code(pgelect::Error::Config(
                pgelect::election::ConfigError::Invalid("x".into())
            )),
            CONFIG
        );
        let missing = pgelect::Error::SchemaMissing {
            schema: "pgelect".into(),
        };
        assert_eq!(code(missing), CONFIG);
        let connect_timeout = pgelect::Error::ConnectTimeout {
            target: "h:5432/d user=u".into(),
            timeout: Duration::from_secs(1),
            source: None,
        };
        assert_eq!(code(connect_timeout), UNAVAILABLE);
        let lost = pgelect::Error::ConnectionLost {
            operation: "read",
            source: None,
        };
        assert_eq!(code(lost), UNAVAILABLE);
        let lock_timeout = pgelect::Error::LockTimeout {
            key: "k".into(),
            waited: Duration::from_secs(1),
            holders: Vec::new(),
        };
        assert_eq!(code(lock_timeout), TEMPFAIL);
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape_controls("a\u{1b}[2Jb\nc"), "a\\u{1b}[2Jb\nc");
    }
}
