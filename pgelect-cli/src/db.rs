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
            Failure::new(code, format!("could not connect to {target}: {e}"))
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
