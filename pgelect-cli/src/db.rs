//! A plain connection for the commands that observe (status, resign), with
//! `LISTEN` notifications forwarded to a channel.

use std::time::Duration;

use futures_util::future::poll_fn;
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client, NoTls};

use crate::exit::{self, Failure};

/// Connects as `application_name`, bounded by 10 s; the receiver yields the
/// payload of every notification and ends when the connection does.
pub async fn connect(
    options: &pgelect::ConnectOptions,
    application_name: &str,
) -> Result<(Client, mpsc::UnboundedReceiver<String>), Failure> {
    let mut config = options.driver_config().clone();
    config.application_name(application_name);
    // A `connect_timeout` from the URL wins over the default.
    let timeout = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(pgelect::DEFAULT_CONNECT_TIMEOUT);
    config.connect_timeout(timeout);
    let target = options.target();
    let connecting = tokio::time::timeout(timeout + Duration::from_secs(1), config.connect(NoTls));
    let (client, mut connection) = connecting
        .await
        .map_err(|_| {
            Failure::new(
                exit::UNAVAILABLE,
                format!(
                    "could not connect to {target}: no answer within {}; check the host and port",
                    crate::duration::show(timeout)
                ),
            )
        })?
        .map_err(|e| {
            let code = match e.code() {
                Some(c) if c.code().starts_with("28") => exit::NOPERM,
                _ => exit::UNAVAILABLE,
            };
            let hint = match e.code().map(|c| c.code()) {
                Some(c) if c.starts_with("28") => "check the user name and password",
                Some("3D000") => "check the database name",
                Some(_) => "see the server's message",
                None => "check that PostgreSQL is running there and that the URL is right",
            };
            Failure::new(
                code,
                format!("could not connect to {target}: {}; {hint}", with_causes(&e)),
            )
        })?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(message) = poll_fn(|cx| connection.poll_message(cx)).await {
            match message {
                Ok(AsyncMessage::Notification(n)) => {
                    let _ = tx.send(n.payload().to_owned());
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
    Ok((client, rx))
}

/// Maps a statement's error on pgelect's tables to the library's error, so
/// that a missing schema says to run `pgelect migrate`.
pub fn classify(schema: &str, operation: &'static str, e: tokio_postgres::Error) -> pgelect::Error {
    use tokio_postgres::error::SqlState;
    match e.code() {
        Some(c)
            if *c == SqlState::UNDEFINED_TABLE
                || *c == SqlState::INVALID_SCHEMA_NAME
                || *c == SqlState::UNDEFINED_FUNCTION =>
        {
            pgelect::Error::SchemaMissing {
                schema: schema.to_owned(),
            }
        }
        Some(c) if *c == SqlState::INSUFFICIENT_PRIVILEGE => pgelect::Error::Permission {
            operation,
            source: e,
        },
        _ if e.is_closed() => pgelect::Error::ConnectionLost { operation },
        _ => pgelect::Error::Database {
            operation,
            source: e,
        },
    }
}

/// An error with its causes: the driver's own text is often only "db error"
/// or "error connecting to server", and the server's message ("database
/// \"x\" does not exist", "password authentication failed") or the I/O
/// error is its source. Links already contained in the text are skipped;
/// the server's text is escaped by the driver's `Display` only as far as
/// it goes, so control characters are escaped here.
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    // tokio-postgres says only "db error" and keeps the server's error as
    // its source: show the server's words alone.
    if message == "db error" {
        if let Some(s) = source {
            message = s.to_string();
            source = s.source();
        }
    }
    while let Some(s) = source {
        let text = s.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = s.source();
    }
    message
        .chars()
        .map(|c| {
            if c.is_control() && c != '\n' {
                format!("\\u{{{:x}}}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("error connecting to server")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn causes_are_kept_and_escaped() {
        let e = Outer(std::io::Error::other("Connection refused \u{1b}[2J"));
        let text = with_causes(&e);
        assert_eq!(
            text,
            "error connecting to server: Connection refused \\u{1b}[2J"
        );
    }
}
