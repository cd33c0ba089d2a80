//! A plain connection for the commands that run statements of their own
//! (the demo's fenced write, `run`'s start-up check, chaos).

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
