//! `pgelect run`: run a command only while this process leads a role.

use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use pgelect::{Elector, LossReason};

use crate::child::{self, Child};
use crate::cli::Global;
use crate::exit::{self, Failure};
use crate::signals::Signals;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The role to lead; one leader per role per schema.
    #[arg(long, value_name = "ROLE")]
    pub role: String,
    /// This candidate's name (default: <hostname>-<pid>-<random>).
    #[arg(long = "id", value_name = "NODE")]
    pub node: Option<String>,
    /// Lease time-to-live: a frozen or cut-off leader is replaced after it.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "15s", value_name = "DURATION")]
    pub ttl: Duration,
    /// Time the command gets between SIGTERM and SIGKILL on a planned step-down
    /// (default: 10s, or less when the TTL leaves less time).
    #[arg(long, value_parser = crate::duration::parse_positive, value_name = "DURATION")]
    pub grace: Option<Duration>,
    /// What to do when the command exits by itself while leading.
    #[arg(long, value_enum, default_value_t = OnExit::Exit)]
    pub on_exit: OnExit,
    /// Serve /metrics (Prometheus), /healthz and /leader (JSON) on this
    /// address, e.g. 127.0.0.1:9187.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The command to run while leader, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// What happens when the command exits by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnExit {
    /// Release leadership and exit with the command's code.
    Exit,
    /// Release leadership and stand for election again.
    Release,
    /// Keep leadership and start the command again (after 1 s).
    Rerun,
}

const DEFAULT_GRACE: Duration = Duration::from_secs(10);

pub async fn run(global: &Global, args: RunArgs) -> Result<u8, Failure> {
    let options = global.connect_options()?;
    let mut builder = Elector::builder(options.clone(), &args.role).ttl(args.ttl);
    if let Some(node) = &args.node {
        builder = builder.node_id(node);
    }
    let elector = builder.build()?;
    let budget = elector.deadline_budget();
    let grace = match args.grace {
        Some(g) if g >= budget => {
            return Err(Failure::new(
                exit::USAGE,
                format!(
                    "--grace {} is not shorter than the leader's deadline budget {} (ttl {} minus the safety margin): the command could outlive leadership; lower --grace or raise --ttl",
                    crate::duration::show(g),
                    crate::duration::show(budget),
                    crate::duration::show(args.ttl)
                ),
            ))
        }
        Some(g) => g,
        None => DEFAULT_GRACE.min(budget / 2),
    };
    let mut signals = Signals::install()?;
    let node = elector.node_id().to_owned();
    let http = match args.metrics_addr {
        Some(addr) => {
            Some(crate::http::serve(addr, &args.role, &node, options, elector.watch()).await?)
        }
        None => None,
    };
    let set_phase = |phase: crate::http::Phase| {
        if let Some(h) = &http {
            h.set(phase);
        }
    };
    tracing::info!(role = %args.role, %node, ttl = ?args.ttl, ?grace, "standing for election");
    loop {
        let leadership = tokio::select! {
            l = elector.leadership() => l?,
            sig = signals.recv() => {
                tracing::info!(%sig, "stopping while standing by");
                return Ok(0);
            }
        };
        let term = leadership.term();
        set_phase(crate::http::Phase::Leading(term.get()));
        tracing::info!(role = %args.role, %node, %term, "elected; starting the command");
        let env = [
            ("PGELECT_ROLE", args.role.clone()),
            ("PGELECT_NODE", node.clone()),
            ("PGELECT_TERM", term.to_string()),
        ];
        let mut child = child::spawn(&args.command, &env)?;
        loop {
            tokio::select! {
                status = child.wait() => {
                    let code = status.map(child::exit_code).unwrap_or(exit::SOFTWARE);
                    tracing::info!(code, "the command exited by itself");
                    // Leftovers in its process group must not outlive leadership.
                    child.signal_group(libc::SIGKILL);
                    match args.on_exit {
                        OnExit::Rerun if !leadership.is_lost() => {
                            tokio::select! {
                                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                                _ = leadership.lost() => break,
                            }
                            child = child::spawn(&args.command, &env)?;
                            continue;
                        }
                        OnExit::Exit => {
                            release(leadership).await;
                            return Ok(code);
                        }
                        _ => {
                            release(leadership).await;
                            set_phase(crate::http::Phase::Standing);
                            break;
                        }
                    }
                }
                _ = leadership.lost() => {
                    set_phase(crate::http::Phase::Stopping);
                    let reason = leadership.loss_reason();
                    if reason == Some(LossReason::Resigned) {
                        tracing::info!(%term, "asked to resign; stopping the command");
                        stop_gracefully(&mut child, grace, &leadership).await;
                        release(leadership).await;
                    } else {
                        let started = Instant::now();
                        let _ = child.kill_now().await;
                        tracing::warn!(%term, reason = ?reason, killed_in = ?started.elapsed(), "leadership lost; the command was killed");
                    }
                    set_phase(crate::http::Phase::Standing);
                    break;
                }
                sig = signals.recv() => {
                    tracing::info!(%sig, %term, "stopping the command, then releasing leadership");
                    stop_gracefully(&mut child, grace, &leadership).await;
                    release(leadership).await;
                    return Ok(0);
                }
            }
        }
    }
}

/// SIGTERM, then SIGKILL after `grace`; at once if leadership ends for a
/// reason other than a resignation meanwhile.
async fn stop_gracefully(child: &mut Child, grace: Duration, leadership: &pgelect::Leadership) {
    child.signal_group(libc::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        tokio::select! {
            _ = child.wait() => { child.signal_group(libc::SIGKILL); return; }
            _ = tokio::time::sleep_until(deadline) => {
                tracing::warn!(?grace, "the command outlived its grace period; killing it");
                let _ = child.kill_now().await;
                return;
            }
            _ = leadership.lost(), if !leadership.is_lost() => {}
        }
        if !matches!(
            leadership.loss_reason(),
            None | Some(LossReason::Resigned) | Some(LossReason::Shutdown)
        ) {
            let _ = child.kill_now().await;
            return;
        }
    }
}

async fn release(leadership: pgelect::Leadership) {
    // The command's process group is already gone or killed by the caller
    // (`Child::stop` / `kill_now` end the group, not just the child).
    let term = leadership.term();
    if let Err(e) = leadership.resign().await {
        tracing::warn!(%term, error = %e, "releasing leadership failed; standbys take over when the lease ends");
    } else {
        tracing::info!(%term, "leadership released");
    }
}
