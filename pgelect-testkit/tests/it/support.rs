//! Helpers the test kit's tests share: a bounded connection and a scalar
//! query over the simple protocol.

use std::time::Duration;

use tokio::time::timeout;
use tokio_postgres::{Client, Config, NoTls, SimpleQueryMessage};

/// Connects (bounded) and spawns the connection task.
pub async fn connect(config: &Config) -> Client {
    let (client, connection) = timeout(Duration::from_secs(10), config.connect(NoTls))
        .await
        .expect("connect timed out")
        .expect("connect failed");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// First column of the first row (simple protocol: works through
/// transaction pooling).
pub async fn scalar(client: &Client, sql: &str) -> String {
    timeout(Duration::from_secs(10), client.simple_query(sql))
        .await
        .expect("query timed out")
        .expect("query failed")
        .into_iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row.get(0).unwrap_or("").to_owned()),
            _ => None,
        })
        .expect("no row")
}
