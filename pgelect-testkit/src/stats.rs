//! What the server counts of a test's load: transactions and connections,
//! read the same way by the tests and the benchmarks.

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Error};

/// Transactions committed and rolled back in `c`'s database so far, as the
/// server's statistics say. On PostgreSQL 15 and later, `c`'s own pending
/// counts are flushed first; other backends flush theirs at least once a
/// second while they work, and when they go idle (before 15, the
/// statistics collector lags by about a second, alike at both ends of a
/// steady measurement).
pub async fn transactions(c: &Client) -> Result<i64, Error> {
    c.batch_execute(
        "SELECT pg_stat_clear_snapshot();
         DO $$ BEGIN
             IF to_regproc('pg_stat_force_next_flush') IS NOT NULL THEN
                 PERFORM pg_stat_force_next_flush();
             END IF;
         END $$",
    )
    .await?;
    let row = c
        .query_typed_one(
            "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database
              WHERE datname = current_database()",
            &[],
        )
        .await?;
    row.try_get(0)
}

/// Connections to `c`'s database whose `application_name` is `app`.
pub async fn connections_named(c: &Client, app: &str) -> Result<i64, Error> {
    c.query_typed_one(
        "SELECT count(*) FROM pg_stat_activity
          WHERE application_name = $1 AND datname = current_database()",
        &[(&app, Type::TEXT)],
    )
    .await?
    .try_get(0)
}
