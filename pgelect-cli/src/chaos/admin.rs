//! The command's own connection to the database, and what it asks of the
//! server: the run's table, whether a role already has a live leader,
//! ending the leader's backends, and the evidence when no new leader came.

use std::path::PathBuf;
use std::time::Duration;

use tokio_postgres::types::Type;

use super::candidates::Run;
use super::fail;
use crate::exit::{self, Failure};

/// The command's own connection, made again when the server restarted.
pub(super) struct Admin {
    pub(super) options: pgelect::ConnectOptions,
    pub(super) client: tokio::sync::Mutex<tokio_postgres::Client>,
}

impl Admin {
    pub(super) async fn connect(options: &pgelect::ConnectOptions) -> Result<Admin, Failure> {
        let client = crate::db::connect(options).await?;
        Ok(Admin {
            options: options.clone(),
            client: tokio::sync::Mutex::new(client),
        })
    }

    /// The connection, reconnected if it was closed.
    pub(super) async fn get(
        &self,
    ) -> Result<tokio::sync::MutexGuard<'_, tokio_postgres::Client>, Failure> {
        let mut c = self.client.lock().await;
        if c.is_closed() {
            let mut last = None;
            // The server may still be starting: a few attempts.
            for _ in 0..20 {
                match crate::db::connect(&self.options).await {
                    Ok(client) => {
                        *c = client;
                        return Ok(c);
                    }
                    Err(e) => last = Some(e),
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            return Err(last.expect("BUG: no attempt made"));
        }
        Ok(c)
    }
}

/// The server's sessions that are not idle, and who blocks them: why a
/// takeover may hang.
/// What a run that found no new leader leaves as evidence: the sessions
/// that are not idle, the role's lease row, every session holding or
/// awaiting the role's lock (idle ones included: a lock holder between two
/// statements is idle), and the last lines each supervisor logged and each
/// worker wrote.
pub(super) async fn stuck_state(admin: &Admin, run: &Run<'_>) -> String {
    let mut out = String::new();
    let admin = match admin.get().await {
        Ok(a) => a,
        Err(e) => return format!("  (cannot connect: {})", e.message),
    };
    let queries = [
        (
            "sessions not idle on the server",
            "SELECT format('  pid %s %s: %s, waiting %s, blocked by %s, for %s s: %s',
                           pid, application_name, state, coalesce(wait_event_type || '/' || wait_event, '-'),
                           pg_blocking_pids(pid), round(extract(epoch FROM now() - state_change)::numeric, 1),
                           left(query, 80))
               FROM pg_stat_activity
              WHERE state IS DISTINCT FROM 'idle' AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                .to_owned(),
        ),
        (
            "the role's lease row",
            format!(
                "SELECT format('  term %s, holder %s, holder_pid %s, backend %s, lease ends in %s s',
                               term, holder, holder_pid, backend,
                               round(extract(epoch FROM lease_until - now())::numeric, 1))
                   FROM {}.leaders WHERE role = $1",
                run.schema
            ),
        ),
        (
            "sessions holding or awaiting the role's lock",
            format!(
                "SELECT format('  pid %s %s: granted %s, %s for %s s: %s', a.pid, a.application_name,
                               k.granted, a.state,
                               round(extract(epoch FROM now() - a.state_change)::numeric, 1), left(a.query, 80))
                   FROM pg_locks k JOIN pg_stat_activity a ON a.pid = k.pid
                  WHERE k.locktype = 'advisory' AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND k.objsubid = 1 AND ((k.classid::bigint << 32) | k.objid::bigint) = {}.key($1)
                  ORDER BY k.granted DESC, a.pid",
                run.schema
            ),
        ),
    ];
    // The name an elector's lock key is hashed from.
    let lock_name = format!("election:{}:{}", run.schema, run.role);
    for (i, (title, sql)) in queries.into_iter().enumerate() {
        let rows = if i == 1 {
            admin.query(sql.as_str(), &[&run.role]).await
        } else if i == 2 {
            admin.query(sql.as_str(), &[&lock_name]).await
        } else {
            admin.query(sql.as_str(), &[]).await
        };
        out.push_str(&format!("{title}:\n"));
        match rows {
            Ok(rows) if rows.is_empty() => out.push_str("  (none)\n"),
            Ok(rows) => {
                for r in rows {
                    out.push_str(&r.get::<_, String>(0));
                    out.push('\n');
                }
            }
            Err(e) => out.push_str(&format!("  (cannot read: {})\n", db_error(&e))),
        }
    }
    // The logs are removed at the end unless --logs keeps them: their
    // tails go with the failure.
    let mut files: Vec<PathBuf> = std::fs::read_dir(&run.dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    for f in files {
        let (keep, what) = match f.extension().and_then(|x| x.to_str()) {
            Some("stderr") => (12, "supervisor log"),
            Some("log") => (3, "worker log"),
            _ => continue,
        };
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        out.push_str(&format!(
            "{what} {} (last {} of {} lines):\n",
            f.file_name().unwrap_or_default().to_string_lossy(),
            keep.min(lines.len()),
            lines.len()
        ));
        for l in &lines[lines.len().saturating_sub(keep)..] {
            out.push_str("  ");
            out.push_str(&l.chars().take(300).collect::<String>());
            out.push('\n');
        }
    }
    out
}

/// A driver error with the server's message, if any.
pub(super) fn db_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("ERROR: {}", d.message()),
        None => e.to_string(),
    }
}

pub(super) async fn terminate_backends(
    client: &tokio_postgres::Client,
    role: &str,
    node: &str,
) -> Result<i64, String> {
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
               FROM pg_stat_activity
              WHERE pid <> pg_backend_pid()
                AND application_name LIKE 'pgelect:%'
                AND position(':' || $1 || ':' IN application_name || ':') > 0
                AND position(':' || $2 IN application_name) > 0",
            &[&role, &node],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(row.get(0))
}

/// The run's table of fenced writes.
pub(super) async fn create_table(admin: &Admin, table: &str) -> Result<(), Failure> {
    admin
        .get()
        .await?
        .batch_execute(&format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, role text NOT NULL, node text NOT NULL,
                                   term bigint NOT NULL, seq bigint NOT NULL)"
        ))
        .await
        .map_err(|e| fail(format!("cannot create the table {table}: {e}")))
}

/// The leader of `role` if one is alive: its lease runs, and (session
/// backend) its lock connection is still a server backend. A lease that
/// runs without such proof (a lease-backend leader, or a row whose pid
/// cannot be checked) is waited out once, for at most its TTL and a
/// margin: a live leader renews it, a dead one leaves it to expire.
pub(super) async fn live_leader(
    options: &pgelect::ConnectOptions,
    role: &str,
) -> Result<Option<pgelect::election::LeaderInfo>, Failure> {
    let Some(l) = pgelect::admin::current_leader(options, role).await? else {
        return Ok(None);
    };
    if l.lease_expired {
        return Ok(None);
    }
    if let (Some("session"), Some(pid)) = (l.backend.as_deref(), l.holder_pid) {
        let client = crate::db::connect(options).await?;
        let alive = client
            .query_typed_one(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = $1)",
                &[(&pid, Type::INT4)],
            )
            .await
            .and_then(|r| r.try_get::<_, bool>(0));
        drop(client);
        return match alive {
            Ok(true) => Ok(Some(l)),
            Ok(false) => Ok(None),
            Err(e) => Err(Failure::new(
                exit::SOFTWARE,
                format!("cannot tell whether the leader of {role:?} is alive: {e}"),
            )),
        };
    }
    let ttl = l
        .lease_until
        .duration_since(l.renewed_at)
        .unwrap_or_default()
        .min(Duration::from_secs(60));
    println!(
        "  role {role:?} has a leader ({}, term {}) whose lease runs: waiting up to {:.1} s for it to end",
        l.holder,
        l.term,
        (ttl + Duration::from_millis(500)).as_secs_f64()
    );
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    Ok(pgelect::admin::current_leader(options, role)
        .await?
        .filter(|l| !l.lease_expired))
}
