//! The `pgelect` command: leader election and locks on PostgreSQL from the shell.

mod chaos;
mod child;
mod cli;
mod db;
mod demo;
mod duration;
mod exit;
mod forget;
mod grants;
mod http;
mod lock;
mod migrate;
mod resign;
mod run;
mod signals;
mod status;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::exit::Failure;

fn main() -> ExitCode {
    // args_os: the supervised command's arguments need not be UTF-8, and
    // must reach it byte for byte.
    let raw: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if raw.get(1).is_some_and(|a| a == child::WATCH_ARG) {
        return child::watch_main(&raw[2..]);
    }
    let cli = match Cli::try_parse_from(raw) {
        Ok(cli) => cli,
        Err(e) => return exit::usage(e),
    };
    cli::init_logging(&cli.global, matches!(cli.command, Command::Run(_)));
    // No database, no runtime.
    if let Command::Grants(args) = cli.command {
        return match grants::run(&cli.global, args) {
            Ok(code) => ExitCode::from(code),
            Err(failure) => failure.report(),
        };
    }
    // The commands that ask once and exit (or only watch) run on this
    // thread: no worker threads to start for them. `run`, `lock`, `demo`
    // and `chaos` supervise commands and connections at once.
    let one_thread = matches!(
        cli.command,
        Command::Resign(_) | Command::Status(_) | Command::Forget(_) | Command::Migrate(_)
    );
    let mut builder = if one_thread {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pgelect: cannot start the async runtime: {e}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    // `demo` never uses the environment's database; the others say when
    // they fell back on libpq's defaults.
    let hint = match cli.command {
        Command::Demo(_) | Command::Chaos(_) => None,
        _ => cli.global.no_url_hint(),
    };
    // `run` is spawned onto the worker threads rather than run by
    // `block_on` on this one: its steps follow answers that a worker
    // reads (a lock granted, a lease won, a command's exit), and a task
    // woken on that worker runs there next, where this thread would first
    // have to be woken (measured on a planned handover: several wake-ups
    // of 50-150 us each). The command's watcher may be started from a
    // worker: they live as long as the runtime (see `child::spawn`), and
    // nothing in `run` blocks one in place.
    if let Command::Run(args) = cli.command {
        let global = cli.global;
        let run = runtime.spawn(async move { run::run(&global, args).await });
        let result = runtime
            .block_on(run)
            .unwrap_or_else(|e| match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => Err(Failure::new(
                    exit::SOFTWARE,
                    format!("the supervisor's task ended: {e}"),
                )),
            });
        return match result {
            Ok(code) => ExitCode::from(code),
            Err(failure) => failure.with_hint(hint.as_deref()).report(),
        };
    }
    let result: Result<u8, Failure> = runtime.block_on(async move {
        match cli.command {
            Command::Migrate(args) => migrate::run(&cli.global, args).await,
            Command::Lock(args) => lock::run(&cli.global, args).await,
            Command::Status(args) => status::run(&cli.global, args).await,
            Command::Run(_) => unreachable!("BUG: spawned above"),
            Command::Resign(args) => resign::run(&cli.global, args).await,
            Command::Demo(args) => demo::run(&cli.global, args).await,
            Command::Forget(args) => forget::run(&cli.global, args).await,
            Command::Chaos(args) => chaos::run(&cli.global, args).await,
            Command::ChaosWorker(args) => chaos::worker(&cli.global, args).await,
            Command::Grants(_) => unreachable!("BUG: handled before the runtime starts"),
        }
    });
    match result {
        Ok(code) => ExitCode::from(code),
        Err(failure) => failure.with_hint(hint.as_deref()).report(),
    }
}
