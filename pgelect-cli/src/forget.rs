//! `pgelect forget`: remove a role nobody holds or stands for.

use clap::Args;
use tokio_postgres::types::Type;

use crate::cli::Global;
use crate::exit::{self, Failure};
use crate::status::escape;

#[derive(Debug, Args)]
pub struct ForgetArgs {
    /// The role to remove from the leaders table.
    #[arg(long, value_name = "ROLE")]
    pub role: String,
}

/// Why a role cannot be forgotten now, found in the transaction that would
/// remove it.
const CHECKS: &str = "WITH k AS (SELECT {schema}.key('election:{schema}:' || $1::text) AS key)
    SELECT
      (SELECT string_agg(CASE WHEN l.granted THEN 'held' ELSE 'waited for' END
                         || ' by backend pid ' || l.pid
                         || coalesce(' (' || a.application_name || ')', ''), ', ' ORDER BY l.pid)
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid, k
        WHERE l.locktype = 'advisory' AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = ((k.key >> 32) & 4294967295)::oid AND l.objid = (k.key & 4294967295)::oid
          AND l.pid <> pg_backend_pid()) AS locked,
      (SELECT string_agg(substr(a.application_name, length('pgelect:' || $1::text || ':') + 1)
                         || ' (backend pid ' || a.pid || ')', ', ' ORDER BY a.pid)
         FROM pg_stat_activity a
        WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
          AND starts_with(a.application_name, 'pgelect:' || $1::text || ':')) AS standing";

pub async fn run(global: &Global, args: ForgetArgs) -> Result<u8, Failure> {
    crate::run::check_name("--role", &args.role)?;
    let options = global.connect_options()?;
    let schema = options.schema_name().as_str().to_owned();
    let (mut client, _) = crate::db::connect(&options, "pgelect:forget").await?;
    let role = args.role.as_str();
    let quoted = format!("\"{}\"", escape(role));
    let db = |op: &'static str| {
        let schema = schema.clone();
        move |e| crate::db::classify(&schema, op, e)
    };
    let tx = client
        .transaction()
        .await
        .map_err(db("begin a transaction"))?;
    // The row first, locked: a lease-backend candidate renewing or taking it
    // waits for this transaction, and sees no row after it.
    let row = tx
        .query_typed_opt(
            &format!(
                "SELECT holder, term, lease_until > now(), \
                 to_char(lease_until AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), \
                 holder IS NULL AND coalesce(holder_meta ? 'pgelect_forgotten', false) \
                 FROM {schema}.leaders WHERE role = $1 FOR UPDATE"
            ),
            &[(&role, Type::TEXT)],
        )
        .await
        .map_err(db("read the leaders table"))?;
    let forgotten =
        |row: &tokio_postgres::Row| row.try_get::<_, Option<bool>>(4).ok().flatten() == Some(true);
    let Some(row) = row.filter(|r| !forgotten(r)) else {
        drop(tx);
        return Err(crate::status::unknown_role(&client, &schema, role).await);
    };
    const READ: &str = "read the leaders table";
    let holder: Option<String> = crate::db::column(&row, 0, &schema, READ)?;
    let term: i64 = crate::db::column(&row, 1, &schema, READ)?;
    let live: Option<bool> = crate::db::column(&row, 2, &schema, READ)?;
    let until: Option<String> = crate::db::column(&row, 3, &schema, READ)?;
    let refuse = |why: String| {
        Failure::new(
            exit::TEMPFAIL,
            format!("role {quoted} not removed: {why}; stop its candidates (pgelect run --role {}) first, then run forget again", escape(role)),
        )
    };
    if let (Some(holder), Some(true)) = (&holder, live) {
        return Err(refuse(format!(
            "{} leads it with term {term}, lease live until {}",
            escape(holder),
            until.as_deref().unwrap_or("?")
        )));
    }
    // The role's advisory lock, for this transaction: while it is ours no
    // session-backend candidate can win the role.
    let got: bool = tx
        .query_one(
            &format!(
                "SELECT pg_try_advisory_xact_lock({schema}.key('election:{schema}:' || $1::text))"
            ),
            &[&role],
        )
        .await
        .map_err(db("take the role's lock"))
        .and_then(|r| crate::db::column(&r, 0, &schema, "take the role's lock"))?;
    let checks = tx
        .query_one(&CHECKS.replace("{schema}", &schema), &[&role])
        .await
        .map_err(db("look for the role's candidates"))?;
    let locked: Option<String> = crate::db::column(&checks, 0, &schema, "look for candidates")?;
    let standing: Option<String> = crate::db::column(&checks, 1, &schema, "look for candidates")?;
    if let Some(locked) = locked {
        return Err(refuse(format!("its lock is {}", escape(&locked))));
    }
    if !got {
        return Err(refuse("its lock is held by another session".to_owned()));
    }
    if let Some(standing) = standing {
        return Err(refuse(format!(
            "candidates stand for it: {}",
            escape(&standing)
        )));
    }
    // The row stays, marked and emptied, so that its term does: a term is
    // a fencing token and must never be handed out twice, and a process
    // paused since long ago may still hold an old one. Every election
    // overwrites holder_meta, so the mark goes when someone stands again.
    tx.execute(
        &format!(
            "UPDATE {schema}.leaders
                SET holder = NULL, holder_pid = NULL, backend = NULL, lease_token = NULL,
                    acquired_at = NULL, renewed_at = NULL, lease_until = NULL,
                    holder_meta = jsonb_build_object('pgelect_forgotten', now())
              WHERE role = $1"
        ),
        &[&role],
    )
    .await
    .map_err(db("forget the role's row"))?;
    tx.commit().await.map_err(db("commit"))?;
    println!(
        "forgot role {quoted}: it is no longer listed; its last term {term} is kept, so a candidate that stands for it again continues above it (fencing terms never repeat)"
    );
    Ok(0)
}
