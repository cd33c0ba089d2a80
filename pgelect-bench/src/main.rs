//! Reproducible pgelect benchmarks.
//!
//! ```text
//! cargo run --release -p pgelect-bench -- <benchmark> [options]
//! ```
//!
//! Each benchmark starts a throwaway PostgreSQL cluster with
//! `pgelect-testkit` (or uses `PGELECT_BENCH_DATABASE_URL`), measures its
//! variants in alternating rounds in the same run, and prints a table for
//! people and one JSON line for scripts. One module per benchmark.

use std::process::ExitCode;

mod cli_handoff;
mod common;
mod crowd;
mod failover;
mod fleet;
mod lease;
mod partitions;
mod promote;
mod report;
mod roles;
mod xact_lock;

const USAGE: &str = "\
usage: pgelect-bench <benchmark> [options]

benchmarks:
  xact-lock   transaction-lock acquire + commit throughput, pgelect next to a bare
              tokio-postgres loop (options: --seconds N, --rounds N, --json)
  failover    crash failover of the session backend per timing (library defaults,
              standard profile at ttl 2 s, fast profile), voluntary handoff, and the
              leader's statements per second per timing, next to a bare
              pg_advisory_lock baseline (options: --trials N (50), --series LIST
              (baseline,crash-default,crash-standard-2s,crash-fast,voluntary,
              statements; default all), --window SECONDS (15), --json)
  lease-failover
              crash failover of the lease backend against the TTL (leader process
              SIGKILLed) and statements per second per candidate, through PgBouncer
              in transaction mode when installed (options: --ttls 1,2,10 (seconds, 0.5 allowed),
              --trials N (30), --window SECONDS (10), --direct, --json)
  roles       many roles over a few candidate processes, each on one shared connection:
              connections, statements per second, candidate CPU and RSS, time until
              every role is led after the start and after a SIGKILL of the busiest
              candidate (options: --count 1,100,1000,10000, --candidates N (3),
              --window SECONDS (10), --backend session|lease (session; lease: one
              SharedLease per candidate), --json)
  crowd       many blocking candidates of one role, each a process: connections,
              statements per second and failover after a SIGKILLed leader, for one
              standby, N-1 standbys, and N-1 standbys each in the lock queue with an
              observer (options: --candidates N (100), --trials N (5),
              --window SECONDS (40), --json)
  fleet       many `pgelect run --backend lease` processes of one role through
              PgBouncer in transaction mode (pool of 20): start, statements and rows
              written per second, server connections, CPU of the server, PgBouncer
              and the members, RSS per member, crash failover after SIGKILLed
              leaders and overlaps (options: --members N (100), --ttl SECONDS (5),
              --window SECONDS (30), --kills N (3), --own-application-names (pgelect's
              default name per member, which costs PgBouncer a SET per statement),
              --start-rate N (members started per second; default all at once),
              --logs DIR (each member's stderr), --json; needs the pgelect binary as
              cli-handoff does)
  partitions  a partition group on the lease backend through PgBouncer in transaction
              mode, M library members (each its own pooled clients) in this process:
              cold start until every partition is led within the share, steady server
              connections, transactions and rows written per second and server CPU, K
              members killed at once, J joining; partitions held twice counted
              (options: --members N (100), --partitions N (100), --ttl SECONDS (5),
              --window SECONDS (10), --kills N (10), --joins N (10), --start-rate N
              (members started per second; default all at once), --json)
  promote     a PostgreSQL primary failover (primary stopped hard, streaming replica
              promoted): time until the replica accepts writes and until a candidate
              leads on it, both backends (options: --trials N (10),
              --backends session,lease, --sync, --json)
  cli-handoff every handover through the command line, `pgelect run` (session, and
              lease through PgBouncer in transaction mode + a direct LISTEN) next to
              etcd's `etcdctl lock` when etcd is installed, in one shuffled run: holder
              SIGTERMed, command exiting by itself, `pgelect resign`, holder SIGKILLed,
              connections blackholed, holder SIGSTOPped with its command, and the
              library's resign(); overlaps counted (options: --trials N (30), --kinds
              sigterm,exit,resign,crash,partition,freeze,library, --backends session,lease,
              --bin LABEL=PATH (repeatable: before/after builds in one run), --no-etcd,
              --breakdown (stages from -vv logs), --settle-ms MS (500), --seed N,
              --keep-logs, --json; needs the pgelect binary next to this one, or
              PGELECT_BIN)

  report      merges the --json output of benchmarks into one list of {scenario, metric,
              value, unit} rows, prints them and draws the latency distributions
              (report [--json FILE] [--svg FILE] [--title T] INPUT...; scripts/bench
              runs every benchmark and then this)

environment:
  PGELECT_BENCH_DATABASE_URL   use this database instead of a throwaway cluster";

fn main() -> ExitCode {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("xact-lock") => xact_lock::run(&args[1..]),
        Some("failover") => failover::run(&args[1..]),
        Some("promote") => promote::run(&args[1..]),
        Some("roles") => roles::run(&args[1..]),
        Some("crowd") => crowd::run(&args[1..]),
        Some("fleet") => fleet::run(&args[1..]),
        Some("partitions") => partitions::run(&args[1..]),
        Some("lease-failover") => lease::run(&args[1..]),
        Some("cli-handoff") => cli_handoff::run(&args[1..]),
        Some("report") => report::run(&args[1..]),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown benchmark {other:?}\n\n{USAGE}")),
        None => Err(USAGE.to_owned()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pgelect-bench: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The database to benchmark against: `PGELECT_BENCH_DATABASE_URL`, or a
/// throwaway cluster that lives as long as the returned handle.
pub(crate) fn database() -> Result<(String, Option<pgelect_testkit::Cluster>), String> {
    if let Some(url) = std::env::var("PGELECT_BENCH_DATABASE_URL")
        .ok()
        .filter(|s| !s.trim().is_empty())
    {
        return Ok((url, None));
    }
    let cluster = pgelect_testkit::Cluster::start()
        .map_err(|e| format!("cannot start a throwaway PostgreSQL cluster: {e}"))?;
    Ok((cluster.url("postgres"), Some(cluster)))
}
