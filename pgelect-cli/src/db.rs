//! A plain connection for the commands that observe (status, resign), with
//! `LISTEN` notifications forwarded to a channel.

use futures_util::future::poll_fn;
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client};

use crate::exit::Failure;

/// Connects as `application_name`, bounded by the connect timeout (the
/// URL's `connect_timeout`, else 10 s); the receiver yields the payload of
/// every notification and ends when the connection does. Failures are the
/// library's ([`pgelect::ConnectOptions::connect_plain`]), so that exit codes
/// and messages match those of `run` and `lock`.
pub async fn connect(
    options: &pgelect::ConnectOptions,
    application_name: &str,
) -> Result<(Client, mpsc::UnboundedReceiver<String>), Failure> {
    let (client, mut connection) = options.connect_plain(application_name).await?;
    let (tx, rx) = mpsc::unbounded_channel();
    let schema = options.schema_name().as_str();
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
    // `status --watch` and `resign` sit idle between notifications: a
    // database's or role's idle timeouts would end them (and `status`
    // would exit 69). Names the server does not know are skipped
    // (PostgreSQL 13 has no idle_session_timeout).
    client
        .batch_execute(
            "SELECT count(set_config(s.name, '0', false)) FROM pg_settings s
              WHERE s.name IN ('idle_session_timeout', 'idle_in_transaction_session_timeout')",
        )
        .await
        .map_err(|e| classify(schema, "configure the session", e))?;
    Ok((client, rx))
}

/// A statement's error on pgelect's tables, classified by the library (a
/// missing schema says to run `pgelect migrate`, a missing grant is a
/// permission error, a closed connection a lost one).
pub fn classify(schema: &str, operation: &'static str, e: tokio_postgres::Error) -> Failure {
    pgelect::Error::from_driver(operation, schema, e).into()
}

/// Column `idx` of `row`: a type mismatch (a schema changed under us) is
/// reported as a database error, not a panic.
pub fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a tokio_postgres::Row,
    idx: usize,
    schema: &str,
    operation: &'static str,
) -> Result<T, Failure> {
    row.try_get(idx).map_err(|e| classify(schema, operation, e))
}
