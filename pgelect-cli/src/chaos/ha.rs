//! The run under a real HA manager (`--ha pg_auto_failover`): the manager
//! owns the primary, chaos orders its switchovers and failovers and kills
//! what it manages, and the same checker judges the workers' logs and the
//! fenced table.
//!
//! **The formation.** The test kit's [`AutoFailover`]: a monitor and three
//! data nodes on loopback, run as the kit's unprivileged server user,
//! failure detection lowered for a test machine (a dead primary is failed
//! over in seconds, not in about 50 s). Three data nodes with
//! `number_sync_standbys = 1`, the configuration in which pg_auto_failover
//! promises durability: on a settled formation the monitor keeps
//! synchronous replication on (`ANY 1` of the two standbys), and a primary
//! left without a standby in the quorum blocks writes instead of running
//! without it (`wait_primary`; a newly promoted primary still passes
//! through that state until a standby has caught up, and chaos faults only
//! a settled formation).
//! With two data nodes `number_sync_standbys` must be 0, and pg_auto_failover
//! 2.0 then can assign the old primary `wait_primary` in a race with a
//! `perform switchover` and keep it writable while it promotes the standby
//! (the book's chaos page, "The lost writes"; one switchover in about 30
//! to 70, which failed a CI run of `--quick`). The third node costs a base
//! backup at start and about 40 s per `--quick` run. Chaos injects a
//! manager's fault only when the formation is settled
//! ([`Formation::prepare`]): a write acknowledged before a failover is on
//! a standby, so the checker excuses none (unlike `promote`, whose replica
//! is asynchronous). Should the manager break that promise anyway, chaos
//! finds its `wait_primary` in the monitor's events ([`Unsynchronized`])
//! and the checker reports a write lost then as its own kind of violation,
//! naming the manager's state; it excuses none.
//! After a node kill the survivor takes writes alone (`wait_primary`,
//! replication off) until the killed node is started again and has caught
//! up; chaos does that within the fault, before the next one.
//!
//! **The candidates** of each backend run on the formation's multi-host URL
//! with `target_session_attrs=read-write` (as the HA integration tests
//! do), their workers' fenced writes too. The lease backend connects
//! directly: PgBouncer cannot follow `target_session_attrs`, and chaos puts
//! no address that follows the primary in front of the formation.
//!
//! **The faults**: `switchover` and `failover` (`pg_autoctl perform`),
//! `postmaster-kill` (SIGKILL of the primary's postmaster: its keeper
//! restarts it in place, or the monitor fails over), `node-kill` (SIGKILL
//! of the primary's keeper and PostgreSQL together: the monitor fails
//! over), and the process faults `kill`, `stop`, `term` on the leader's
//! supervisor. A manager's fault hits the database, so every leader until
//! the formation has settled again: a write that fails or is refused
//! meanwhile is no loss (until `Injected::ended`).
//!
//! **The gap.** Per fault, chaos polls the data nodes until one that is
//! new to the role (another node, or the same node's postmaster started
//! after the fault) commits a write (an insert into a probe table, whose
//! commit waits for the synchronous standby as the workers' do): the
//! manager's outage. The bound on the time until
//! a leader acts again ([`bound`](super::faults::bound)) is that outage's
//! bound ([`manager_outage`](super::faults::manager_outage)) plus the
//! backend's, as for a promotion; a leader's write must be acknowledged
//! again within it, and a new term (the session backend always; the lease
//! backend when its leader did not renew through the outage) begin within
//! it.

use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::admin::{create_table, Admin};
use super::args::{backend_name, timing, HaArg};
use super::candidates::Run;
use super::faults::Fault;
use super::judge::check;
use super::report::{self, Rows};
use super::schedule::{schedule, Injected};
use super::{fail, write_outcomes, ChaosArgs};
use crate::cli::Global;
use crate::exit::Failure;

#[cfg(feature = "throwaway")]
use pgelect_testkit::AutoFailover;

/// Why a manager's fault is skipped elsewhere.
pub(super) const NEEDS_MANAGER: &str =
    "a fault of the HA manager's: only in a run under it (--ha pg_auto_failover)";

/// The faults a run under the manager injects unless `--faults` says.
pub(super) const HA_FAULTS: [Fault; 7] = [
    Fault::Switchover,
    Fault::Failover,
    Fault::PostmasterKill,
    Fault::NodeKill,
    Fault::Kill,
    Fault::Stop,
    Fault::Term,
];

/// Why `fault` is not injected under the manager, if it is not.
pub(super) fn not_under_manager(fault: Fault) -> Option<&'static str> {
    match fault {
        Fault::Switchover
        | Fault::Failover
        | Fault::PostmasterKill
        | Fault::NodeKill
        | Fault::Kill
        | Fault::Stop
        | Fault::Term
        | Fault::Terminate => None,
        Fault::KillMany => Some(super::faults::KILL_MANY_NEEDS_GROUP),
        Fault::Blackhole | Fault::Latency => Some(
            "the candidates connect to the formation's data nodes directly (a multi-host URL): no proxy",
        ),
        Fault::Starve | Fault::ClockJump => {
            Some("not implemented under the manager (the runs on chaos's own server inject it)")
        }
        Fault::RestartFast | Fault::RestartImmediate | Fault::Promote => Some(
            "the manager owns the servers: its own faults (switchover, failover, postmaster-kill, node-kill) replace these",
        ),
        Fault::PgbouncerRestart => {
            Some("no pooler under the manager (PgBouncer cannot follow target_session_attrs)")
        }
        Fault::Partition | Fault::PartitionNoPreempt => {
            Some("the formation listens on loopback, out of the network namespaces' reach")
        }
    }
}

/// The run under the manager: the formation started, each backend's
/// schedule and check; the rows and violations.
pub(super) async fn run(
    global: &Global,
    args: &ChaosArgs,
    manager: HaArg,
    seed: u64,
) -> Result<(Rows, Vec<String>), Failure> {
    let HaArg::PgAutoFailover = manager;
    let kinds = if crate::cli::on_command_line("--faults") {
        args.faults.clone()
    } else {
        HA_FAULTS.to_vec()
    };
    let mut not_run = Vec::new();
    let mut drawn = Vec::new();
    for f in kinds {
        match not_under_manager(f) {
            Some(why) => not_run.push((f, why.to_owned())),
            None => drawn.push(f),
        }
    }
    let names: Vec<String> = args
        .backends
        .iter()
        .map(|&b| format!("{}-ha", backend_name(b)))
        .collect();
    if let Err(why) = available() {
        println!("pgelect chaos --ha pg_auto_failover: skipped: {why}");
        let mut rows = Vec::new();
        for (&backend, bname) in args.backends.iter().zip(&names) {
            let injected: Vec<Injected> = drawn
                .iter()
                .map(|&f| Injected::not_run(f, &why))
                .chain(not_run.iter().map(|(f, why)| Injected::not_run(*f, why)))
                .collect();
            rows.extend(report::rows(
                bname,
                seed,
                backend,
                &timing(args, backend)?,
                &injected,
                &Default::default(),
                &HashSet::new(),
                None,
            ));
        }
        return Ok((rows, Vec::new()));
    }
    let started = std::time::Instant::now();
    // With --logs, the formation's own logs and the monitor's events are
    // kept beside the histories.
    let mut formation = Formation::start(args.logs.as_deref().map(|d| d.join("formation"))).await?;
    println!(
        "  {} (started in {:.1} s)",
        formation.describe(),
        started.elapsed().as_secs_f64()
    );
    let url = formation.url();
    let options = pgelect::ConnectOptions::from_url(&url)?.schema(&global.schema)?;
    pgelect::migrate(&options).await?;
    let admin = Admin::connect(&options).await?;
    let schema = options.schema_name().as_str().to_owned();
    let table = format!("pgelect_chaos_{seed:x}");
    create_table(&admin, &table).await?;
    let probe = format!("{table}_probe");
    admin
        .get()
        .await?
        .batch_execute(&format!(
            "CREATE TABLE {probe} (at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ))
        .await
        .map_err(|e| fail(format!("cannot create the table {probe}: {e}")))?;
    formation.probe_with(&probe);
    let url_file = crate::demo::UrlFile::write(&url)?;
    println!(
        "pgelect chaos: seed {seed} (replay with --seed {seed}), {} candidates under pg_auto_failover, ttl {}, profile {:?}, {} per backend, table {table} on the formation, lease backend direct (PgBouncer cannot follow target_session_attrs)",
        args.candidates,
        crate::duration::show(args.ttl),
        args.profile,
        crate::duration::show(args.duration)
    );
    let exe = std::env::current_exe().map_err(fail)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rows = Vec::new();
    let mut all_violations = Vec::new();
    let outcome: Result<(), Failure> = async {
        for (&backend, bname) in args.backends.iter().zip(&names) {
            let role = format!("chaos-{seed:x}-{bname}");
            let dir = args.logs.as_deref().unwrap_or(url_file.dir()).join(bname);
            std::fs::create_dir_all(&dir).map_err(fail)?;
            let mut injected: Vec<Injected> = not_run
                .iter()
                .map(|(f, why)| Injected::not_run(*f, why))
                .collect();
            let mut run = Run {
                exe: exe.clone(),
                url_file: url_file.path(),
                proxied: None,
                net: None,
                faketime: None,
                server: None,
                replicas: None,
                manager: Some(&mut formation),
                pooler: Err(
                    "under the manager the candidates connect directly (PgBouncer cannot follow target_session_attrs)"
                        .to_owned(),
                ),
                admin: &admin,
                schema: schema.clone(),
                role,
                backend,
                args,
                dir,
                table: table.clone(),
                next_id: 0,
                group: None,
            };
            if !drawn.is_empty() {
                injected.extend(schedule(&mut run, drawn.clone(), &mut rng).await?);
            }
            let found = check(&run, &admin, &injected).await?;
            let t = timing(args, backend)?;
            let kind_rows = report::rows(
                bname,
                seed,
                backend,
                &t,
                &injected,
                &found,
                &HashSet::new(),
                None,
            );
            for r in kind_rows.iter().filter(|r| r["manager_outage_max_ms"].is_number()) {
                println!(
                    "  {bname} {}: a primary took writes again after p50 {} / max {} ms, a leader's write was acknowledged again after p50 {} / max {} ms (bound {} ms); after the primary's first write: p50 {} / p99 {} / max {} ms",
                    r["fault"].as_str().unwrap_or(""),
                    r["manager_outage_p50_ms"],
                    r["manager_outage_max_ms"],
                    r["writes_resumed_p50_ms"],
                    r["writes_resumed_max_ms"],
                    r["bound_ms"],
                    r["after_writable_p50_ms"],
                    r["after_writable_p99_ms"],
                    r["after_writable_max_ms"]
                );
            }
            rows.extend(kind_rows);
            found.print_own_bound(bname);
            let (ok, refused, failed) = write_outcomes(&run.dir);
            println!(
                "{bname}: {} faults, {} fenced writes committed (workers saw {ok} acknowledged, {refused} refused, {failed} failed), {} violation(s)",
                injected.iter().filter(|i| i.skipped.is_none()).count(),
                found.writes_committed,
                found.violations.len()
            );
            if !found.unsynchronized_lost_at.is_empty() {
                println!(
                    "  {bname}: {} of the lost writes were acknowledged by the old primary while pg_auto_failover ran it without synchronous replication (wait_primary) as it promoted the standby: the manager's loss, still a violation",
                    found.unsynchronized_lost_at.len()
                );
            }
            for v in &found.violations {
                println!("  VIOLATION {bname}: {v}");
            }
            all_violations.extend(found.violations.into_iter().map(|v| format!("{bname}: {v}")));
        }
        Ok(())
    }
    .await;
    if let Ok(c) = admin.get().await {
        let _ = c
            .batch_execute(&format!("DROP TABLE IF EXISTS {table}, {probe}"))
            .await;
    }
    drop(url_file);
    formation.close();
    outcome.map(|()| (rows, all_violations))
}

/// Whether a formation can be started here; why not otherwise.
#[cfg(feature = "throwaway")]
fn available() -> Result<(), String> {
    pgelect_testkit::autofailover_available().map_err(|e| e.to_string())
}

#[cfg(not(feature = "throwaway"))]
fn available() -> Result<(), String> {
    Err("this pgelect was built without the throwaway feature (the test kit's formation)".into())
}

/// What followed a manager's fault.
#[cfg_attr(not(feature = "throwaway"), allow(dead_code))]
pub(super) struct After {
    /// When a primary new to the role accepted a write (ns since the
    /// epoch).
    pub(super) writable: u128,
    /// When the formation had settled again: one primary, a synchronous
    /// standby (a killed node started again and caught up).
    pub(super) settled: u128,
    /// When the manager itself ran the old primary without synchronous
    /// replication while it promoted another node, if it did
    /// ([`Unsynchronized`]).
    pub(super) unsynchronized: Option<Unsynchronized>,
}

/// A stretch in which the HA manager had the old primary take writes
/// without its synchronous standby while it promoted that standby: found in
/// the monitor's events (pg_auto_failover assigned the old primary
/// `wait_primary`, which empties `synchronous_standby_names` and releases
/// the commits waiting for the standby, after the order). Writes the old
/// primary acknowledged then are on no other server: when it is rewound to
/// follow the promoted node they are gone. The checker still fails such a
/// loss, as its own kind, naming the manager's state as the cause.
#[derive(Clone, Debug)]
pub(super) struct Unsynchronized {
    /// The manager's assignment of `wait_primary` to the old primary (ns
    /// since the epoch; the monitor's transaction start).
    pub(super) from: u128,
    /// When the old primary reported that it stopped (`draining`,
    /// `demote_timeout` or `demoted`), or the formation settled.
    pub(super) to: u128,
    /// The manager's events that show it, for the report.
    pub(super) why: String,
}

/// A manager's order it refused: why, and when the formation had settled
/// again after it.
pub(super) struct Refused {
    pub(super) why: String,
    pub(super) settled: u128,
}

/// What a manager's fault came to.
pub(super) type Ordered = Result<After, Refused>;

#[cfg(feature = "throwaway")]
pub(super) use own::Formation;

#[cfg(feature = "throwaway")]
mod own {
    use std::sync::Arc;
    use std::time::Duration;

    use pgelect_testkit::{NodeIndex, NodeState};

    use pgelect_testkit::AutoFailoverOptions;

    use super::{judge_events, After, AutoFailover, Ordered, Refused, Unsynchronized};
    use crate::chaos::events::now_ns;
    use crate::chaos::fail;
    use crate::chaos::faults::Fault;
    use crate::exit::{self, Failure};

    /// How long the formation may take to settle (a killed node's
    /// `pg_rewind` and catch-up included) or to have a primary again.
    const SETTLE_WITHIN: Duration = Duration::from_secs(120);
    /// How long a formation stays healthy and settled before chaos gives
    /// the manager an order: more than the monitor's health-check period
    /// (1 s in the test kit) and its retry delay.
    const HEALTHY_FOR: Duration = Duration::from_millis(1_600);

    /// The formation, which node is its primary, and which node was
    /// killed and not started again.
    pub(in crate::chaos) struct Formation {
        haf: Arc<AutoFailover>,
        primary: NodeIndex,
        killed: Option<NodeIndex>,
        /// The statement that tells whether a node takes writes.
        probe: String,
    }

    fn unavailable(what: impl std::fmt::Display) -> Failure {
        Failure::new(exit::UNAVAILABLE, what.to_string())
    }

    impl Formation {
        /// Stops the formation (its nodes and monitor) and removes its
        /// files: blocking work, off the runtime's worker.
        pub fn close(self) {
            tokio::task::block_in_place(|| drop(self));
        }

        /// Starts a monitor and three data nodes (`number_sync_standbys`
        /// 1); returns once node 0 is primary and the others synchronous
        /// standbys. With `keep`, the
        /// formation's logs, its monitor's events and its settings are kept
        /// there when it stops ([`AutoFailoverOptions::keep_in`]).
        pub async fn start(keep: Option<std::path::PathBuf>) -> Result<Formation, Failure> {
            let mut options = AutoFailoverOptions::new().nodes(3).number_sync_standbys(1);
            if let Some(dir) = keep {
                options = options.keep_in(dir);
            }
            let haf = tokio::task::spawn_blocking(move || AutoFailover::start_with(options))
                .await
                .map_err(fail)?
                .map_err(|e| {
                    unavailable(format!("cannot start a pg_auto_failover formation: {e}"))
                })?;
            Ok(Formation {
                haf: Arc::new(haf),
                primary: 0,
                killed: None,
                probe: String::new(),
            })
        }

        /// Probes for a primary that takes writes with an insert into
        /// `table` (`at timestamptz DEFAULT clock_timestamp()`, made on
        /// the formation): a commit that waits for the synchronous standby,
        /// as the workers' do. (`txid_current()` alone writes no WAL, and
        /// its commit does not wait.)
        pub fn probe_with(&mut self, table: &str) {
            self.probe = format!(
                "INSERT INTO {table} DEFAULT VALUES RETURNING (extract(epoch FROM pg_postmaster_start_time()) * 1e9)::float8"
            );
        }

        /// The candidates' URL: both data nodes, the primary wherever it
        /// is.
        pub fn url(&self) -> String {
            format!("{}&connect_timeout=2", self.haf.url("postgres"))
        }

        /// How the header line names it.
        pub fn describe(&self) -> String {
            let nodes: Vec<String> = self
                .haf
                .ports()
                .iter()
                .map(|p| format!("127.0.0.1:{p}"))
                .collect();
            format!(
                "a pg_auto_failover formation: a monitor on 127.0.0.1:{}, data nodes on {} (synchronous replication), the candidates on every one with target_session_attrs=read-write",
                self.haf.monitor_port(),
                nodes.join(" and ")
            )
        }

        /// Readies the next manager's fault: a killed node started again,
        /// then one primary and a settled synchronous standby, every node
        /// found healthy by the monitor's own checks, and all of it again
        /// `HEALTHY_FOR` later with the same primary. Not counted in any
        /// fault's gap. Blocks this worker thread meanwhile.
        ///
        /// `show state` can report a settled formation before the monitor
        /// counts the standby healthy again (after the primary's restart,
        /// say): an order then had pg_auto_failover set the primary
        /// `wait_primary` (replication off) 56 ms later and promote the
        /// standby without the writes it had taken (a CI run of `--quick`,
        /// 93 writes lost). An operator waits for a healthy formation
        /// before a switchover; so does chaos. The window is the monitor's
        /// health-check period and more: its verdict is not an event one
        /// can wait for.
        pub fn prepare(&mut self) -> Result<(), Failure> {
            let haf = self.haf.clone();
            let killed = self.killed.take();
            self.primary = tokio::task::block_in_place(move || {
                if let Some(k) = killed {
                    haf.restart_node(k)?;
                }
                let until = std::time::Instant::now() + SETTLE_WITHIN;
                loop {
                    let primary = haf.wait_stable(SETTLE_WITHIN)?;
                    let healthy = |s: &[NodeState]| s.iter().all(|n| n.healthy);
                    let left = until.saturating_duration_since(std::time::Instant::now());
                    haf.wait_for("every node healthy", left, healthy)?;
                    std::thread::sleep(HEALTHY_FOR);
                    let s = haf.state()?;
                    let same = NodeState::stable(&s) && s.get(primary).is_some_and(NodeState::is_primary);
                    if same && healthy(&s) {
                        return Ok(primary);
                    }
                    if std::time::Instant::now() >= until {
                        return Err(std::io::Error::other(format!(
                            "not healthy and settled for {HEALTHY_FOR:?} within {SETTLE_WITHIN:?}: {s:?}"
                        )));
                    }
                }
            })
            .map_err(|e| unavailable(format!("the formation did not settle: {e}")))?;
            Ok(())
        }

        /// Injects `fault` on the primary, watches for a primary new to
        /// the role to accept a write, then lets the formation settle.
        pub async fn inject(&mut self, fault: Fault) -> Result<Ordered, Failure> {
            let at = now_ns();
            let old = self.primary;
            let haf = self.haf.clone();
            // The manager's command (or the kill) and the watch at once:
            // `perform` returns only once its failover is done, later than
            // the new primary took writes.
            let order = tokio::task::spawn_blocking(move || match fault {
                Fault::Switchover => haf.perform_switchover(),
                Fault::Failover => haf.perform_failover(),
                Fault::PostmasterKill => haf.kill_postmaster(old).map(|_| ()),
                Fault::NodeKill => haf.kill_node(old),
                _ => Err(std::io::Error::other("BUG: not a manager's fault")),
            });
            // The manager may refuse an order (pg_auto_failover's monitor
            // once failed a `perform failover` on a lock wait of its own):
            // then nothing is judged but what followed.
            let writable = {
                let watch = self.watch_writable(old, at);
                tokio::pin!(watch);
                tokio::pin!(order);
                tokio::select! {
                    w = &mut watch => {
                        let ordered = (&mut order).await.map_err(fail)?;
                        ordered.map_err(|e| unavailable(format!("{}: {e}", fault.name())))?;
                        Ok(w)
                    }
                    ordered = &mut order => match ordered.map_err(fail)? {
                        Ok(()) => Ok(watch.await),
                        Err(e) if matches!(fault, Fault::Switchover | Fault::Failover) => {
                            let e = e.to_string();
                            Err(e.lines().next().unwrap_or_default().to_owned())
                        }
                        Err(e) => return Err(unavailable(format!("{}: {e}", fault.name()))),
                    },
                }
            };
            let writable = match writable {
                Ok(w) => w,
                Err(why) => {
                    // Whatever it started is let settle, inside the
                    // fault's window.
                    self.prepare()?;
                    return Ok(Err(Refused {
                        why: format!("the manager refused the order: {why}"),
                        settled: now_ns(),
                    }));
                }
            };
            if fault == Fault::NodeKill {
                self.killed = Some(old);
            }
            let (writable, new) = writable?;
            self.prepare()?;
            let settled = now_ns();
            let unsynchronized = if self.primary != old {
                self.unsynchronized(fault, old, at, settled).await
            } else {
                None
            };
            if let Some(u) = &unsynchronized {
                println!(
                    "  ({}: the manager ran node{} without synchronous replication for {:.1} ms while promoting another node: {})",
                    fault.name(),
                    old + 1,
                    u.to.saturating_sub(u.from) as f64 / 1e6,
                    u.why
                );
            }
            let ms = |t: u128| t.saturating_sub(at) as f64 / 1e6;
            println!(
                "  ({}: node{} was primary; node{} took a write {:.1} ms after the fault; settled, node{} primary, after {:.1} ms)",
                fault.name(),
                old + 1,
                new + 1,
                ms(writable),
                self.primary + 1,
                ms(settled)
            );
            Ok(Ok(After {
                writable,
                settled,
                unsynchronized,
            }))
        }

        /// Whether the monitor's events since `at` show it assigning the
        /// old primary `old` `wait_primary` (synchronous replication off)
        /// during this fault: see [`Unsynchronized`]. `None` also when the
        /// events cannot be read (said on stderr).
        async fn unsynchronized(
            &self,
            fault: Fault,
            old: NodeIndex,
            at: u128,
            settled: u128,
        ) -> Option<Unsynchronized> {
            let config = self.haf.monitor_config("pg_auto_failover");
            let port = i32::from(self.haf.ports()[old]);
            let sql = "SELECT (extract(epoch FROM eventtime) * 1e9)::float8, nodeport, \
                       reportedstate::text, goalstate::text, coalesce(description, '') \
                       FROM pgautofailover.event \
                       WHERE eventtime >= to_timestamp($1) ORDER BY eventid";
            let from_s = at as f64 / 1e9;
            let rows = async {
                let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
                let task = tokio::spawn(connection);
                let rows = client.query(sql, &[&from_s]).await;
                drop(client);
                task.abort();
                rows
            };
            let rows = match tokio::time::timeout(Duration::from_secs(10), rows).await {
                Ok(Ok(rows)) => rows,
                Ok(Err(e)) => {
                    eprintln!("pgelect chaos: cannot read the monitor's events: {e}");
                    return None;
                }
                Err(_) => {
                    eprintln!("pgelect chaos: cannot read the monitor's events: timed out");
                    return None;
                }
            };
            let events: Vec<(u128, i32, String, String, String)> = rows
                .iter()
                .map(|r| {
                    (
                        r.get::<_, f64>(0) as u128,
                        r.get(1),
                        r.get(2),
                        r.get(3),
                        r.get(4),
                    )
                })
                .collect();
            judge_events(&events, port, settled).map(|(from, to, assigned, ended)| {
                let ms = |t: u128| t.saturating_sub(at) as f64 / 1e6;
                Unsynchronized {
                    from,
                    to,
                    why: format!(
                        "{} {:.0} ms after the order: \"{assigned}\"; {ended} {:.0} ms after it",
                        fault.name(),
                        ms(from),
                        ms(to)
                    ),
                }
            })
        }

        /// Polls the data nodes every 50 ms until one new to the role (not
        /// `old`, or `old` with its postmaster started after `at`) accepts
        /// a write; returns when, and which.
        async fn watch_writable(
            &self,
            old: NodeIndex,
            at: u128,
        ) -> Result<(u128, NodeIndex), Failure> {
            let until = std::time::Instant::now() + SETTLE_WITHIN;
            loop {
                for node in 0..self.haf.ports().len() {
                    let mut config = self.haf.node_config(node, "postgres");
                    config.connect_timeout(Duration::from_secs(1));
                    if let Some(started) = takes_writes(config, &self.probe).await {
                        if node != old || started > at as f64 {
                            return Ok((now_ns(), node));
                        }
                    }
                }
                if std::time::Instant::now() >= until {
                    let haf = self.haf.clone();
                    let state = tokio::task::spawn_blocking(move || haf.state())
                        .await
                        .map_err(fail)?;
                    return Err(unavailable(format!(
                        "no primary took a write within {} s of the fault; the monitor says {state:?}",
                        SETTLE_WITHIN.as_secs()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Whether the server of `config` commits the write `probe` within a
    /// second (a standby refuses it, a primary waits for its synchronous
    /// standby); if so, when its postmaster started (ns since the epoch,
    /// what `probe` returns).
    async fn takes_writes(config: tokio_postgres::Config, probe: &str) -> Option<f64> {
        let probe = async {
            let (client, connection) = config.connect(tokio_postgres::NoTls).await.ok()?;
            let task = tokio::spawn(connection);
            let row = client.query_one(probe, &[]).await.ok();
            drop(client);
            task.abort();
            row.map(|r| r.get::<_, f64>(0))
        };
        tokio::time::timeout(Duration::from_secs(1), probe)
            .await
            .ok()
            .flatten()
    }
}

/// The stretch [`Unsynchronized`] in the monitor's events (time in ns,
/// node port, reported state, assigned state, description; in order) for
/// the old primary on `port`: from the first assignment of `wait_primary`
/// to it until it reported `draining`, `demote_timeout` or `demoted` (else
/// `settled`). Returns the stretch, the assignment's description and how
/// it ended.
#[cfg_attr(not(feature = "throwaway"), allow(dead_code))]
pub(super) fn judge_events(
    events: &[(u128, i32, String, String, String)],
    port: i32,
    settled: u128,
) -> Option<(u128, u128, String, String)> {
    let start = events
        .iter()
        .position(|(_, p, _, goal, _)| *p == port && goal == "wait_primary")?;
    let (from, _, _, _, assigned) = &events[start];
    let end = events[start..].iter().find(|(_, p, reported, _, _)| {
        *p == port && matches!(reported.as_str(), "draining" | "demote_timeout" | "demoted")
    });
    let (to, ended) = match end {
        Some((t, _, reported, _, _)) => (*t, format!("it reported {reported}")),
        None => (settled, "the formation settled".to_owned()),
    };
    Some((*from, to.max(*from), assigned.clone(), ended))
}

/// Without the throwaway feature there is no formation: never built.
#[cfg(not(feature = "throwaway"))]
pub(super) enum Formation {}

#[cfg(not(feature = "throwaway"))]
impl Formation {
    pub async fn start(_keep: Option<std::path::PathBuf>) -> Result<Formation, Failure> {
        Err(fail("BUG: --ha without the throwaway feature"))
    }

    pub fn url(&self) -> String {
        match *self {}
    }

    pub fn probe_with(&mut self, _table: &str) {
        match *self {}
    }

    pub fn describe(&self) -> String {
        match *self {}
    }

    pub fn prepare(&mut self) -> Result<(), Failure> {
        match *self {}
    }

    pub async fn inject(&mut self, _fault: Fault) -> Result<Ordered, Failure> {
        match *self {}
    }

    pub fn close(self) {
        match self {}
    }
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::*;

    /// The monitor's events of the switchover that lost 125 acknowledged
    /// writes in a soak (2026-12-01, node2 the old primary on port 2):
    /// the order's `draining` overwritten by `wait_primary`, node2 in
    /// `wait_primary` until the demote timeout had it `demoted`.
    #[test]
    fn the_managers_wait_primary_on_the_old_primary_is_found_in_its_events() {
        let e = |t: u128, port: i32, reported: &str, goal: &str, what: &str| {
            (
                t * 1_000_000,
                port,
                reported.to_owned(),
                goal.to_owned(),
                what.to_owned(),
            )
        };
        let events = vec![
            e(10_030, 2, "primary", "draining", "user-initiated failover"),
            e(
                10_030,
                1,
                "secondary",
                "prepare_promotion",
                "user-initiated failover",
            ),
            e(
                11_128,
                2,
                "primary",
                "wait_primary",
                "none of the standby nodes in the quorum are healthy",
            ),
            e(
                11_461,
                1,
                "prepare_promotion",
                "stop_replication",
                "converged",
            ),
            e(11_461, 2, "primary", "demote_timeout", "converged"),
            e(13_547, 2, "wait_primary", "demote_timeout", "new state"),
            e(
                18_455,
                2,
                "wait_primary",
                "demoted",
                "demote timeout expired",
            ),
            e(18_896, 2, "demoted", "demoted", "new state"),
        ];
        let (from, to, assigned, ended) = judge_events(&events, 2, 30_000_000_000).unwrap();
        assert_eq!((from, to), (11_128_000_000, 18_896_000_000));
        assert!(assigned.contains("none of the standby"), "{assigned}");
        assert_eq!(ended, "it reported demoted");
        // An ordinary switchover: draining, demote_timeout, demoted.
        let clean = vec![
            e(10_000, 2, "primary", "draining", "user-initiated failover"),
            e(10_300, 2, "draining", "demote_timeout", "converged"),
            e(10_400, 2, "demote_timeout", "demoted", "done"),
        ];
        assert!(judge_events(&clean, 2, 30_000_000_000).is_none());
        // The new primary's own wait_primary (its standby not back yet) is
        // not the old primary's.
        let new_primary = vec![e(
            11_000,
            1,
            "stop_replication",
            "wait_primary",
            "demote timeout expired",
        )];
        assert!(judge_events(&new_primary, 2, 30_000_000_000).is_none());
    }

    #[test]
    fn every_fault_is_either_injected_under_the_manager_or_skipped_with_a_reason() {
        for &f in <Fault as ValueEnum>::value_variants() {
            let skipped = not_under_manager(f);
            assert_eq!(
                skipped.is_none(),
                f.needs_manager()
                    || matches!(
                        f,
                        Fault::Kill | Fault::Stop | Fault::Term | Fault::Terminate
                    ),
                "{f:?}"
            );
        }
        assert!(HA_FAULTS.iter().all(|&f| not_under_manager(f).is_none()));
    }
}
