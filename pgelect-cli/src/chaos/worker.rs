//! The hidden `chaos-worker`: the command each supervisor runs as leader.
//! It records when it acts and makes fenced writes until SIGTERM; its log
//! is all the checker reads of it (see [`super::events`]).

use std::time::Duration;

use tokio_postgres::types::Type;

use super::args::WorkerArgs;
use super::events::now_ns;
use super::fail;
use crate::cli::Global;
use crate::exit::Failure;

/// The node name of the test-only rogue worker (`--rogue`).
pub(super) const ROGUE: &str = "rogue";

/// How often a worker logs that it acts, unless `--tick-ms` says
/// otherwise: an overlap shorter than the tick may go unseen.
pub(super) const TICK: Duration = Duration::from_millis(5);
/// A fenced write every this many ticks.
pub(super) const WRITE_EVERY: u32 = 10;

/// The worker: records when it acts and makes fenced writes until SIGTERM.
pub async fn worker(global: &Global, args: WorkerArgs) -> Result<u8, Failure> {
    use std::io::Write;
    let var = |k: &str| {
        std::env::var(k).map_err(|_| {
            fail(format!(
                "{k} is not set: chaos-worker runs under pgelect run"
            ))
        })
    };
    if std::env::var_os("LD_PRELOAD").is_some_and(|v| v.to_string_lossy().contains("faketime")) {
        // The clock jump is the supervisor's: the worker's log must carry
        // real time. Same pid after exec.
        use std::os::unix::process::CommandExt;
        let e = std::process::Command::new(std::env::current_exe().map_err(fail)?)
            .args(std::env::args_os().skip(1))
            .env_remove("LD_PRELOAD")
            .env_remove("FAKETIME_TIMESTAMP_FILE")
            .exec();
        return Err(fail(format!(
            "cannot re-execute the worker without libfaketime: {e}"
        )));
    }
    let (role, node) = (var("PGELECT_ROLE")?, var("PGELECT_NODE")?);
    let term: i64 = var("PGELECT_TERM")?.parse().map_err(fail)?;
    let pid = std::process::id();
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.log)
        .map_err(fail)?;
    let mut line = |what: &str| {
        // One write per line (O_APPEND): lines never interleave.
        let _ =
            log.write_all(format!("{what} {node} {term} {} {pid} {role}\n", now_ns()).as_bytes());
    };
    line("start");
    let options = global.connect_options()?;
    let schema = options.schema_name().as_str().to_owned();
    // Through the pooler for the lease backend (transaction mode): every
    // statement runs inside the fenced transaction, unnamed (no prepared
    // statement outlives it), and the idle timeout is the transaction's own
    // (a session setting would land on a pooled server connection that
    // other clients use next).
    let connect = || async {
        let client = crate::db::connect(&options).await?;
        Ok::<_, Failure>(client)
    };
    // A fenced transaction holds the role's row FOR SHARE, and every
    // takeover waits for it: if this process is cut off or frozen
    // mid-transaction, the server must end the session (see the README's
    // note on fencing connections; `fence` also bounds it by the lease).
    let idle_limit = (args.idle_in_transaction_ms > 0).then(|| {
        format!(
            "SET LOCAL idle_in_transaction_session_timeout = {}",
            args.idle_in_transaction_ms
        )
    });
    let fence_sql = format!("SELECT {schema}.fence($1, $2)");
    let insert_sql = format!(
        "INSERT INTO {} (role, node, term, seq) VALUES ($1, $2, $3, $4)",
        args.table
    );
    // Before connecting, which may take a while on a loaded machine: a
    // SIGTERM meanwhile (a handover) is then logged as a stop, not a death.
    let mut term_signal =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(fail)?;
    let mut client = connect().await?;
    let mut ticks = tokio::time::interval(Duration::from_millis(args.tick_ms.max(1)));
    let mut n: u32 = 0;
    let mut seq: i64 = 0;
    loop {
        tokio::select! {
            _ = term_signal.recv() => {
                line("stop");
                return Ok(0);
            }
            _ = ticks.tick() => {
                line("tick");
                n = n.wrapping_add(1);
                if !n.is_multiple_of(WRITE_EVERY) {
                    continue;
                }
                seq += 1;
                if client.is_closed() {
                    // The server restarted (or ended this session): a
                    // leader that kept its term writes on.
                    match tokio::time::timeout(Duration::from_secs(1), connect()).await {
                        Ok(Ok(c)) => client = c,
                        _ => {
                            line(&format!("write:{seq}:failed"));
                            continue;
                        }
                    }
                }
                let r = async {
                    let tx = client.transaction().await?;
                    if let Some(limit) = &idle_limit {
                        tx.batch_execute(limit).await?;
                    }
                    tx.query_typed(&fence_sql, &[(&role, Type::TEXT), (&term, Type::INT8)]).await?;
                    tx.execute_typed(
                        &insert_sql,
                        &[(&role, Type::TEXT), (&node, Type::TEXT), (&term, Type::INT8), (&seq, Type::INT8)],
                    )
                    .await?;
                    tx.commit().await
                }
                .await;
                match r {
                    Ok(()) => line(&format!("write:{seq}:ok")),
                    // The server refused the write: the fence (PE001 stale,
                    // PE002 no holder), or anything else it decided about
                    // the transaction (a deadlock would count too).
                    Err(e) if e.code().is_some_and(|c| !matches!(c.code().get(..2), Some("08" | "57"))) => {
                        line(&format!("write:{seq}:refused"))
                    }
                    // The connection is gone (class 08, which is also what
                    // PgBouncer sends when it cannot serve it) or the server
                    // is shutting down (57): no verdict on the write (the
                    // supervisor ends us if leadership went).
                    Err(_) => line(&format!("write:{seq}:failed")),
                }
            }
        }
    }
}
