//! A plain connection for the commands that run statements of their own
//! (the demo, `run`'s start-up check, chaos), and the classification of
//! their errors.

use tokio_postgres::Client;

use crate::exit::Failure;

/// Connects as the library's admin client does (bounded by the connect
/// timeout, the server's idle timeouts off), so that exit codes and
/// messages match those of `run` and `lock`.
pub async fn connect(options: &pgelect::ConnectOptions) -> Result<Client, Failure> {
    Ok(pgelect::admin::AdminClient::connect(options)
        .await?
        .into_client())
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
