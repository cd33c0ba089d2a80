//! `pgelect chaos`: real `pgelect run` supervisors against a database,
//! faults injected on a seeded schedule, and an independent check of what
//! the workers recorded: never two leaders acting at once (outside a pause,
//! whose fenced writes must then be refused), fenced writes in term order,
//! terms rising, no acknowledged write lost.
//!
//! Each supervisor runs this binary's hidden `chaos-worker` as its command.
//! A worker appends to a log of its own: `start`, a `tick` every 5 ms,
//! `write SEQ ok|refused` for a fenced insert every 50 ms (`pgelect.fence`
//! and the insert in one transaction), and `stop` on SIGTERM. The checker
//! reads only those logs and the table, never the supervisors' state.
//!
//! Faults come in up to three phases per backend. The first: process faults
//! (SIGKILL, SIGSTOP beyond the TTL then SIGCONT, SIGTERM, CPU starvation by
//! a SIGSTOP/SIGCONT duty cycle), `pg_terminate_backend` on the leader's
//! backends, a blackhole or added latency in a fault proxy (`pgelect-faultproxy`) per
//! supervisor, a wall-clock jump (libfaketime) and, on the throwaway server,
//! restarts (fast and immediate). The second, on the throwaway server only
//! and as root: real network partitions, each supervisor in a network
//! namespace of its own ([`netns`]) and a database user of its own, with
//! and without `pg_signal_backend` (zombie preemption). The third, on a
//! throwaway primary with a streaming replica ([`promote`]): the primary
//! killed and the replica promoted, the candidates on a URL naming both
//! servers (the lease backend's through PgBouncer in front of an address
//! that follows the primary, [`pooler`]). Faults are drawn
//! from a seeded generator in rounds (every kind once per round, at least
//! one round), so that `--seed` replays a run. A fault that cannot run here
//! is recorded as a skipped trial with its reason.
//!
//! Every fault has a bound on the time until the next leader acts
//! ([`bound`], one table); a longer gap is a violation, as is a healthy
//! leader's refused or lost write.
//!
//! With `--partitions N` the run is instead a partition group on the lease
//! backend ([`group`]): `--members` supervisors `pgelect run --backend
//! lease --partitions GROUP:N` through the pooler, a worker per partition
//! led (ticking every 50 ms: a hundred workers at 5 ms would starve the
//! supervisors on a small machine; the tick stays below the leader's
//! safety margin), faults on members (`kill`, `kill-many`, `stop`,
//! `term`) and the pooler (`pgbouncer-restart`). The workers log their
//! partition's role and write it with their fenced writes; every rule above
//! holds per partition, and after each fault every partition it hit must be
//! led again within [`faults::group_bound`] (the mechanism, a rebalance
//! margin and the slack), and no partition may go unled longer than the
//! longest of those bounds.

mod admin;
mod args;
mod candidates;
mod events;
mod faults;
mod group;
mod ha;
mod judge;
mod netns;
mod pooler;
mod promote;
mod report;
mod schedule;
mod url;
mod worker;

use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::SeedableRng;

use admin::{create_table, live_leader, Admin};
use args::{backend_name, timing};
pub use args::{ChaosArgs, WorkerArgs};
use candidates::{find_faketime, Netted, Run};
use events::now_ns;
use faults::{Fault, KILL_MANY_NEEDS_GROUP};
use group::{not_in_group, schedule_group, Group, GROUP_FAULTS};
use judge::check;
use pooler::pooler_for;
use report::{report, Rows};
use schedule::{schedule, Injected};
use url::UrlParts;
pub use worker::worker;

use crate::cli::Global;
use crate::exit::{self, Failure};
use crate::run::{BackendArg, ProfileArg};

/// An internal failure of the command (exit code 70).
fn fail(what: impl std::fmt::Display) -> Failure {
    Failure::new(exit::SOFTWARE, what.to_string())
}

/// `pgelect chaos`.
pub async fn run(global: &Global, args: ChaosArgs) -> Result<u8, Failure> {
    let mut signals = crate::signals::Signals::install()?;
    let seed = match args.seed {
        Some(s) => s,
        None => (now_ns() as u64) | 1,
    };
    let mut server = None;
    let work = async {
        let r = chaos(global, &args, seed, &mut server).await;
        r
    };
    // SIGINT or SIGTERM drops the run: its supervisors are killed (and
    // their workers with them), its namespaces and bridge removed.
    let outcome = tokio::select! {
        r = work => r,
        sig = signals.recv() => Err(Failure::new(exit::TEMPFAIL, format!("interrupted by {sig}; cleaned up"))),
    };
    if let Some(s) = server {
        s.stop();
    }
    let (rows, all_violations) = outcome?;
    report(&args, seed, rows, all_violations)
}

/// Why `promote` is skipped against a database the user names.
const PROMOTE_NEEDS_THROWAWAY: &str = "promote needs a primary with a streaming replica that chaos starts itself: run without --database-url";

/// Whether partitions can be made, and if not why.
fn partitions_possible(throwaway: bool) -> Result<(), String> {
    if !throwaway {
        return Err("partitions need the throwaway server (it must listen on the namespaces' bridge): run without --database-url".into());
    }
    netns::available()
}

/// Sets up, runs every backend's phases, checks, cleans up; the rows and
/// the violations.
async fn chaos(
    global: &Global,
    args: &ChaosArgs,
    seed: u64,
    server: &mut Option<crate::demo::throwaway::Server>,
) -> Result<(Rows, Vec<String>), Failure> {
    let explicit = global.explicit_url()?;
    // Refused here rather than by the candidates' `pgelect run`, which
    // would leave the phase without a leader for its first 60 s.
    if args.profile == ProfileArg::Fast
        && (args.backends.contains(&BackendArg::Lease) || args.partitions.is_some())
    {
        return Err(Failure::new(
            exit::USAGE,
            "--profile fast is for the session backend (the lease backend's failover follows its --ttl): add --backends session",
        ));
    }
    if let Some(manager) = args.ha {
        if explicit.is_some() {
            return Err(Failure::new(
                exit::USAGE,
                "--ha runs on a formation chaos starts itself: run without --database-url",
            ));
        }
        return ha::run(global, args, manager, seed).await;
    }
    let group = Group::from_args(args)?;
    // A partition-group run is the lease backend's, with its own default
    // faults.
    let (backends, faults) = match group {
        Some(_) => (
            vec![BackendArg::Lease],
            if crate::cli::on_command_line("--faults") {
                args.faults.clone()
            } else {
                GROUP_FAULTS.to_vec()
            },
        ),
        None => (args.backends.clone(), args.faults.clone()),
    };
    if let Some(python) = &args.python {
        candidates::check_python(python)?;
    }
    let pooler_url = crate::cli::resolve_url(
        args.pooler_url.as_deref(),
        "--pooler-url",
        args.pooler_url_file.as_deref(),
        "--pooler-url-file",
    )?;
    if pooler_url.is_some() && explicit.is_none() {
        return Err(Failure::new(
            exit::USAGE,
            "--pooler-url needs --database-url or --database-url-file: the database behind the pooler (on its own throwaway server chaos starts its own PgBouncer)",
        ));
    }
    let net_kinds: Vec<Fault> = faults
        .iter()
        .copied()
        .filter(|f| f.needs_netns() && group.is_none())
        .collect();
    let net_possible = partitions_possible(explicit.is_none());
    let mut net = None;
    let url = match explicit {
        Some((url, _flag)) => url,
        None => {
            let (url, mut s) = crate::demo::throwaway::start().await?;
            if !net_kinds.is_empty() && net_possible.is_ok() {
                let removed = netns::remove_leftovers();
                if !removed.is_empty() {
                    println!(
                        "  removed leftovers of dead chaos runs: {}",
                        removed.join(", ")
                    );
                }
                let n = netns::Net::create()
                    .map_err(|e| fail(format!("cannot make the bridge: {e}")))?;
                s = s.listen_also(n.host_addr(), n.cidr()).await?;
                println!(
                    "  network namespaces on bridge {} ({}); the server also listens on {}",
                    n.bridge(),
                    n.cidr(),
                    n.host_addr()
                );
                net = Some(n);
            }
            *server = Some(s);
            url
        }
    };
    let options = pgelect::ConnectOptions::from_url(&url)?.schema(&global.schema)?;
    pgelect::migrate(&options).await?;
    // Refuse before touching anything if a role of ours has a live leader
    // (a dead run's last leader, whose row outlives it, is no reason).
    let roles: Vec<String> = backends
        .iter()
        .flat_map(|&backend| {
            let role = format!("chaos-{seed:x}-{}", run_name(backend, group));
            match group {
                Some(g) => (0..g.partitions)
                    .map(|p| pgelect::partitions::partition_role(&role, p))
                    .collect(),
                None => vec![role],
            }
        })
        .collect();
    for role in roles {
        if let Some(l) = live_leader(&options, &role).await? {
            return Err(Failure::new(
                exit::USAGE,
                format!(
                    "role {role:?} already has a leader ({}, term {}): refusing to run chaos on it (pick another --seed, or stop that leader)",
                    l.holder, l.term
                ),
            ));
        }
    }
    let url_file = crate::demo::UrlFile::write(&url)?;
    // The lease backend's pooler, or why it runs without one.
    let pooler_file = url_file.dir().join("pooler.url");
    let pooler: Result<pooler::Pooler, String> = if !backends.contains(&BackendArg::Lease) {
        Err("the lease backend does not run".to_owned())
    } else if let Some(u) = &pooler_url {
        Ok(pooler::Pooler::given(u, pooler_file).await?)
    } else if args.no_pooler {
        Err("--no-pooler: the lease backend connects directly".to_owned())
    } else if let Some(s) = server.as_ref() {
        pooler::start_own(s, pooler_file).await?
    } else {
        Err("no --pooler-url: the lease backend connects directly".to_owned())
    };
    let admin = Admin::connect(&options).await?;
    let schema = options.schema_name().as_str().to_owned();
    let table = format!("pgelect_chaos_{seed:x}");
    create_table(&admin, &table).await?;
    let lease_via = match (&pooler, backends.contains(&BackendArg::Lease)) {
        (_, false) => String::new(),
        (Ok(p), true) => format!(", lease backend through {}", p.describe),
        (Err(why), true) => format!(", lease backend direct ({why})"),
    };
    let who = match group {
        Some(g) => format!(
            "{} members of a partition group of {} partitions (lease backend), workers ticking every {} ms",
            g.members,
            g.partitions,
            g.tick.as_millis()
        ),
        None => format!("{} candidates", args.candidates),
    };
    println!(
        "pgelect chaos: seed {seed} (replay with --seed {seed}), {who}, ttl {}, profile {:?}, {} per backend and phase, table {table}{lease_via}",
        crate::duration::show(args.ttl),
        args.profile,
        crate::duration::show(args.duration)
    );
    let exe = std::env::current_exe().map_err(fail)?;
    let proxied = UrlParts::parse(&url).await;
    if proxied.is_none() {
        println!("  (the URL is not a single-host postgres:// URL: blackhole and latency faults are skipped)");
    }
    let net_skip = match (&net_possible, &net) {
        (Err(why), _) => Some(why.clone()),
        (Ok(()), None) => Some("no bridge was made".to_owned()),
        (Ok(()), Some(_)) => None,
    };
    if let (false, Some(why)) = (net_kinds.is_empty(), &net_skip) {
        println!("  partition faults skipped: {why}");
    }
    let mut netted = match (net, UrlParts::parse(&url).await) {
        (Some(net), Some(url)) => Some(Netted {
            net,
            url,
            users: Vec::new(),
        }),
        _ => None,
    };
    // The promote phase's primary and replica, its own connection and URL
    // file; the schema and the table made on the primary and replayed on
    // the replica before any candidate starts.
    let promote_asked = faults.contains(&Fault::Promote) && group.is_none();
    // The replica is made with pg_basebackup, which not every PostgreSQL
    // build ships (the npm packages the version tests use do not).
    let mut promote_skip = PROMOTE_NEEDS_THROWAWAY.to_owned();
    let basebackup = match &server {
        Some(s) => s
            .has_program("pg_basebackup")
            .map_err(|e| format!("promote needs pg_basebackup to make the replica: {e}")),
        None => Err(PROMOTE_NEEDS_THROWAWAY.to_owned()),
    };
    let mut pair = match (promote_asked, basebackup) {
        (true, Err(why)) => {
            println!("  promote skipped: {why}");
            promote_skip = why;
            None
        }
        (true, Ok(())) => {
            let p = promote::Pair::start().await?;
            let url = p.url();
            let options = pgelect::ConnectOptions::from_url(&url)?.schema(&global.schema)?;
            pgelect::migrate(&options).await?;
            let admin = Admin::connect(&options).await?;
            create_table(&admin, &table).await?;
            p.wait_replayed()?;
            let file = crate::demo::UrlFile::write(&url)?;
            Some((p, admin, file))
        }
        (false, _) => None,
    };
    // In the promote phase, the lease backend's PgBouncer stands in front
    // of the pair's primary address (PgBouncer cannot follow
    // target_session_attrs), wherever the first phase has chaos's own.
    let promote_pooler: Result<pooler::Pooler, String> = match (&pair, &pooler) {
        (None, _) => Err("no promote phase".to_owned()),
        (Some(_), Err(why)) => Err(why.clone()),
        (Some((p, _, file)), Ok(_)) => {
            pooler::start_own_at(
                p.primary_address(),
                p.password(),
                file.dir().join("pooler.url"),
            )
            .await?
        }
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rows = Vec::new();
    let mut all_violations = Vec::new();
    let outcome: Result<(), Failure> = async {
        for &backend in &backends {
            let bname = run_name(backend, group);
            let role = format!("chaos-{seed:x}-{bname}");
            let dir = args.logs.as_deref().unwrap_or(url_file.dir()).join(bname);
            std::fs::create_dir_all(&dir).map_err(fail)?;
            let run_pooler = pooler_for(backend, &pooler);
            let pooler_restart_skip = match &run_pooler {
                Ok(p) => p.not_restartable(),
                Err(why) => Some(why.clone()),
            };
            if let Some(g) = group {
                let found = group_run(
                    GroupRun {
                        exe: &exe,
                        url_file: url_file.path(),
                        server: server.as_ref(),
                        pooler: run_pooler,
                        admin: &admin,
                        schema: &schema,
                        role: &role,
                        args,
                        dir,
                        table: &table,
                        group: g,
                        faults: &faults,
                        seed,
                    },
                    &mut rng,
                )
                .await?;
                rows.extend(found.0);
                all_violations.extend(found.1.into_iter().map(|v| format!("{bname}: {v}")));
                continue;
            }
            let mut first: Vec<Fault> = faults
                .iter()
                .copied()
                .filter(|f| !f.needs_netns() && !f.needs_replica())
                .collect();
            let mut injected = Vec::new();
            // The manager's faults: a run under --ha only.
            for f in faults.iter().copied().filter(|f| f.needs_manager()) {
                first.retain(|&k| k != f);
                injected.push(Injected::not_run(f, ha::NEEDS_MANAGER));
            }
            if first.contains(&Fault::KillMany) {
                first.retain(|&f| f != Fault::KillMany);
                injected.push(Injected::not_run(Fault::KillMany, KILL_MANY_NEEDS_GROUP));
            }
            if let (true, Some(why)) = (first.contains(&Fault::PgbouncerRestart), &pooler_restart_skip) {
                // Not drawn where it cannot run; one skipped trial, with the
                // reason, not silently.
                first.retain(|&f| f != Fault::PgbouncerRestart);
                injected.push(Injected::not_run(Fault::PgbouncerRestart, why));
            }
            let run_pooler_for_report = run_pooler.clone();
            let mut run = Run {
                exe: exe.clone(),
                url_file: url_file.path(),
                proxied: proxied.as_ref(),
                net: None,
                // Not for Python candidates: their log's clock would jump too.
                faketime: (faults.contains(&Fault::ClockJump) && args.python.is_none())
                    .then(find_faketime)
                    .flatten(),
                server: server.as_ref(),
                replicas: None,
                manager: None,
                pooler: run_pooler,
                admin: &admin,
                schema: schema.clone(),
                role: role.clone(),
                backend,
                args,
                dir,
                table: table.clone(),
                next_id: 0,
                group: None,
            };
            let first_phase: HashSet<Fault> = first.iter().copied().collect();
            if !first.is_empty() {
                injected.extend(schedule(&mut run, first, &mut rng).await?);
            }
            if let (false, Some(n)) = (net_kinds.is_empty(), netted.as_mut()) {
                println!("  {bname}: candidates in network namespaces, each its own database user");
                run.proxied = None;
                // The pooler listens on loopback only: out of reach.
                run.pooler = Err("the partition phase connects directly".to_owned());
                run.net = Some(n);
                injected.extend(schedule(&mut run, net_kinds.clone(), &mut rng).await?);
                run.net = None;
            } else if let Some(why) = &net_skip {
                // Not silently: one skipped trial per kind, with the reason.
                injected.extend(net_kinds.iter().map(|&fault| Injected::not_run(fault, why)));
            }
            if let (Ok(p), false) = (&run_pooler_for_report, first_phase.is_empty()) {
                if let Some(n) = p.served().await {
                    println!("  {bname}: PgBouncer served {n} transactions to the candidates");
                }
            }
            if let (true, None) = (promote_asked, &pair) {
                injected.push(Injected::not_run(Fault::Promote, &promote_skip));
            }
            let found = check(&run, &admin, &injected).await?;
            // Each part is judged on its own server: (faults, findings,
            // the kinds drawn through the pooler).
            let pooled_kinds = match run_pooler_for_report {
                Ok(_) => first_phase,
                Err(_) => HashSet::new(),
            };
            let mut parts = vec![(injected, found, pooled_kinds)];
            if let (true, Some((pair, pair_admin, pair_url))) = (promote_asked, pair.as_mut()) {
                // The lease backend through PgBouncer in front of the
                // primary address; LISTEN (a session) on the two-host URL.
                let promote_via = pooler_for(backend, &promote_pooler);
                match &promote_via {
                    Ok(p) => println!(
                        "  {bname}: candidates through {} (chaos points it at the new primary once a promotion is done, as an HA proxy would); their LISTEN connections on {}",
                        p.describe,
                        pair.describe()
                    ),
                    Err(why) => println!(
                        "  {bname}: candidates on {}, directly: {why}",
                        pair.describe()
                    ),
                }
                let dir = args
                    .logs
                    .as_deref()
                    .unwrap_or(url_file.dir())
                    .join(format!("{bname}-promote"));
                std::fs::create_dir_all(&dir).map_err(fail)?;
                let mut run = Run {
                    exe: exe.clone(),
                    url_file: pair_url.path(),
                    proxied: None,
                    net: None,
                    faketime: None,
                    server: None,
                    replicas: Some(pair),
                    manager: None,
                    pooler: promote_via,
                    admin: &*pair_admin,
                    schema: schema.clone(),
                    role: role.clone(),
                    backend,
                    args,
                    dir,
                    table: table.clone(),
                    next_id: 0,
                    group: None,
                };
                let injected = schedule(&mut run, vec![Fault::Promote], &mut rng).await?;
                let found = check(&run, run.admin, &injected).await?;
                if let Ok(p) = &run.pooler {
                    if let Some(n) = p.served().await {
                        println!(
                            "  {bname}: PgBouncer served {n} transactions to the candidates in the promote phase, where {} fenced writes committed",
                            found.writes_committed
                        );
                    }
                }
                let pooled_kinds = match &run.pooler {
                    Ok(_) => HashSet::from([Fault::Promote]),
                    Err(_) => HashSet::new(),
                };
                parts.push((injected, found, pooled_kinds));
            }
            let timing = timing(args, backend)?;
            let (mut faults, mut committed, mut violations) = (0, 0, Vec::new());
            for (injected, found, pooled_kinds) in parts {
            rows.extend(report::rows(bname, seed, backend, &timing, &injected, &found, &pooled_kinds, None));
            faults += injected.len();
            committed += found.writes_committed;
            found.print_own_bound(bname);
            if !found.unreplicated_at.is_empty() {
                println!(
                    "  {bname}: {} write(s) acknowledged by a primary in its last moments were not on its promoted replica (asynchronous replication; not a violation)",
                    found.unreplicated_at.len()
                );
            }
            violations.extend(found.violations);
            }
            println!(
                "{bname}: {faults} faults, {committed} fenced writes committed, {} violation(s)",
                violations.len()
            );
            // At once: a later phase that fails stops the run before its
            // report.
            for v in &violations {
                println!("  VIOLATION {bname}: {v}");
            }
            all_violations.extend(violations.into_iter().map(|v| format!("{bname}: {v}")));
        }
        Ok(())
    }
    .await;
    if let Ok(c) = admin.get().await {
        let _ = c
            .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
            .await;
    }
    // The candidates' users live in the throwaway cluster, removed with it.
    drop(netted);
    drop(url_file);
    outcome.map(|()| (rows, all_violations))
}

/// The name of a backend's run (its roles, its log directory, its rows):
/// the backend's, `lease-group` for a partition-group run.
fn run_name(backend: BackendArg, group: Option<Group>) -> &'static str {
    match group {
        Some(_) => "lease-group",
        None => backend_name(backend),
    }
}

/// What a partition-group run needs of the command's set-up.
struct GroupRun<'a> {
    exe: &'a std::path::Path,
    url_file: &'a std::path::Path,
    server: Option<&'a crate::demo::throwaway::Server>,
    pooler: Result<&'a pooler::Pooler, String>,
    admin: &'a Admin,
    schema: &'a str,
    role: &'a str,
    args: &'a ChaosArgs,
    dir: std::path::PathBuf,
    table: &'a str,
    group: Group,
    faults: &'a [Fault],
    seed: u64,
}

/// The partition-group run ([`group`]): its schedule, its check; its rows
/// and violations.
async fn group_run(g: GroupRun<'_>, rng: &mut StdRng) -> Result<(Rows, Vec<String>), Failure> {
    let bname = run_name(BackendArg::Lease, Some(g.group));
    // Kinds that do not run here: one skipped trial each, with the reason.
    let mut injected = Vec::new();
    let mut kinds = Vec::new();
    for &f in g.faults {
        match not_in_group(f) {
            Some(why) => injected.push(Injected::not_run(f, why)),
            None => kinds.push(f),
        }
    }
    let restart_skip = match &g.pooler {
        Ok(p) => p.not_restartable(),
        Err(why) => Some(why.clone()),
    };
    if let (true, Some(why)) = (kinds.contains(&Fault::PgbouncerRestart), &restart_skip) {
        kinds.retain(|&f| f != Fault::PgbouncerRestart);
        injected.push(Injected::not_run(Fault::PgbouncerRestart, why));
    }
    let pooled = g.pooler.is_ok();
    match &g.pooler {
        Ok(p) => println!(
            "  {bname}: {} members of group {} through {}, their LISTEN connections direct",
            g.group.members, g.role, p.describe
        ),
        Err(why) => println!(
            "  {bname}: {} members of group {}, directly: {why}",
            g.group.members, g.role
        ),
    }
    let mut run = candidates::Run {
        exe: g.exe.to_owned(),
        url_file: g.url_file,
        // No proxy per member: a hundred members would be two hundred
        // proxies in this process.
        proxied: None,
        net: None,
        faketime: None,
        server: g.server,
        replicas: None,
        manager: None,
        pooler: g.pooler,
        admin: g.admin,
        schema: g.schema.to_owned(),
        role: g.role.to_owned(),
        backend: BackendArg::Lease,
        args: g.args,
        dir: g.dir,
        table: g.table.to_owned(),
        next_id: 0,
        group: Some(g.group),
    };
    if !kinds.is_empty() {
        injected.extend(schedule_group(&mut run, kinds, rng).await?);
    }
    if let Ok(p) = &run.pooler {
        if let Some(n) = p.served().await {
            println!(
                "  {bname}: PgBouncer served {n} transactions to the members and their workers"
            );
        }
    }
    let found = check(&run, g.admin, &injected).await?;
    let timing = timing(g.args, BackendArg::Lease)?;
    let pooled_kinds: HashSet<Fault> = match pooled {
        true => injected.iter().map(|i| i.fault).collect(),
        false => HashSet::new(),
    };
    let rows = report::rows(
        bname,
        g.seed,
        BackendArg::Lease,
        &timing,
        &injected,
        &found,
        &pooled_kinds,
        Some(&g.group),
    );
    if !found.restarted_at.is_empty() {
        println!(
            "  {bname}: {} command(s) started again by their member within one leadership (same term, after the last one stopped acting): `pgelect run --partitions` restarts a command that exited while its partition stays held; not a violation, but each one is a command that died under its supervisor (--logs keeps the supervisors' warnings)",
            found.restarted_at.len()
        );
    }
    found.print_own_bound(bname);
    let (ok, refused, failed) = write_outcomes(&run.dir);
    println!(
        "{bname}: {} faults, {} fenced writes committed (workers saw {ok} acknowledged, {refused} refused, {failed} failed), {} violation(s)",
        injected.iter().filter(|i| i.skipped.is_none()).count(),
        found.writes_committed,
        found.violations.len()
    );
    for v in &found.violations {
        println!("  VIOLATION {bname}: {v}");
    }
    Ok((rows, found.violations))
}

/// The fenced writes the workers logged: acknowledged, refused, failed.
pub(super) fn write_outcomes(dir: &std::path::Path) -> (usize, usize, usize) {
    let events = events::read_events(dir);
    let count = |end: &str| {
        events
            .iter()
            .filter(|e| e.what.starts_with("write:") && e.what.ends_with(end))
            .count()
    };
    (count(":ok"), count(":refused"), count(":failed"))
}
