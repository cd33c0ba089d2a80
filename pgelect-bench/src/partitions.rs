//! `partitions`: balanced partitions on the lease backend through PgBouncer
//! in transaction mode, M library members of one group of N partitions, in
//! this process (each member its own `SharedLease` client, which also
//! reads the group, as separate processes would have; one process keeps a
//! 2-core machine's CPU for the server and the pooler rather than for M
//! runtimes).
//!
//! Phases, each timed from its start until every partition is led by
//! exactly one member and no member leads more than its share ⌈N/M⌉:
//! a cold start of M members; a steady window (server connections,
//! transactions and rows written per second, server CPU); K members killed
//! at once (dropped without leaving: their leases run out); J members
//! joining (clean handoffs). Throughout, every 20 ms, no partition may be
//! held by two members at once (`held()`, which a member updates before it
//! releases and after it wins): a violation is counted and reported.
//! The members share one `application_name` (`--own-application-names`:
//! pgelect's default name per client, for which PgBouncer sends the server
//! a `SET application_name` before most transactions).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use pgelect::election::Backend;
use pgelect::partitions::{PartitionEvent, PartitionGroup};
use pgelect::ConnectOptions;

use crate::common::{option_number, round2, Rows};

const GROUP: &str = "bench";

struct Options {
    members: usize,
    partitions: u32,
    ttl: f64,
    window: f64,
    kills: usize,
    joins: usize,
    /// Members started per second at the cold start (0: all at once).
    start_rate: f64,
    /// pgelect's default `application_name` per client instead of one for
    /// all (for which PgBouncer sends the server a `SET` before most
    /// transactions).
    own_names: bool,
    json: bool,
}

pub fn run(args: &[String]) -> Result<(), String> {
    let mut o = Options {
        members: 100,
        partitions: 100,
        ttl: 5.0,
        window: 10.0,
        kills: 10,
        joins: 10,
        start_rate: 0.0,
        own_names: false,
        json: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut number = |option: &str, min: f64| option_number(&mut it, "partitions", option, min);
        match a.as_str() {
            "--members" => o.members = number("--members", 2.0)? as usize,
            "--partitions" => o.partitions = number("--partitions", 1.0)? as u32,
            "--ttl" => o.ttl = number("--ttl", 1.0)?,
            "--window" => o.window = number("--window", 1.0)?,
            "--kills" => o.kills = number("--kills", 0.0)? as usize,
            "--joins" => o.joins = number("--joins", 0.0)? as usize,
            "--start-rate" => o.start_rate = number("--start-rate", 0.0)?,
            "--own-application-names" => o.own_names = true,
            "--json" => o.json = true,
            other => return Err(format!("partitions: unknown option {other:?}")),
        }
    }
    if o.kills >= o.members {
        return Err("partitions: --kills must leave at least one member".into());
    }
    if std::env::var_os("PGELECT_BENCH_DATABASE_URL").is_some() {
        return Err("partitions: needs the test kit's cluster and PgBouncer; unset PGELECT_BENCH_DATABASE_URL".into());
    }
    if !pgelect_testkit::pgbouncer_available() {
        return Err("partitions: needs pgbouncer (scripts/setup.sh installs it)".into());
    }
    let (url, cluster) = crate::database()?;
    let cluster = cluster.expect("BUG: a throwaway cluster without PGELECT_BENCH_DATABASE_URL");
    let bouncer =
        pgelect_testkit::PgBouncer::start(&cluster, pgelect_testkit::PoolMode::Transaction)
            .map_err(|e| format!("cannot start pgbouncer: {e}"))?;
    let postmaster = crate::fleet::postmaster_pid(&cluster);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(measure(&o, &url, &bouncer, postmaster))
}

/// The fleet's members, by node id, and what their applications hold.
struct Fleet {
    options: ConnectOptions,
    partitions: u32,
    ttl: Duration,
    next: usize,
    members: BTreeMap<String, PartitionGroup>,
}

impl Fleet {
    fn join(&mut self) -> Result<(), String> {
        let node = format!("m{:04}", self.next);
        self.next += 1;
        let ttl = self.ttl;
        let group = PartitionGroup::builder(self.options.clone(), GROUP, self.partitions)
            .member(&node)
            .poll_interval(ttl)
            .elector(move |b| b.backend(Backend::Lease).ttl(ttl))
            .build()
            .map_err(|e| e.to_string())?;
        let mut events = group.join().map_err(|e| e.to_string())?;
        // The application: drops a partition as soon as it must.
        tokio::spawn(async move {
            while let Some(e) = events.recv().await {
                if let PartitionEvent::Gained(held) = e {
                    tokio::spawn(async move { held.token().cancelled().await });
                }
            }
        });
        self.members.insert(node, group);
        Ok(())
    }

    /// Who holds what: (partitions led by exactly one member, partitions
    /// held by two or more, the most any member holds).
    fn census(&self) -> (usize, usize, usize) {
        let mut count: HashMap<u32, usize> = HashMap::new();
        let mut most = 0;
        for g in self.members.values() {
            let held = g.held();
            most = most.max(held.len());
            for p in held.keys() {
                *count.entry(*p).or_default() += 1;
            }
        }
        let once = count.values().filter(|c| **c == 1).count();
        let twice = count.values().filter(|c| **c > 1).count();
        (once, twice, most)
    }

    /// Waits until every partition is led once and nobody leads more than
    /// ⌈N/M⌉, counting double holds on the way: (seconds, double holds).
    async fn balanced(&self, within: Duration) -> Result<(f64, usize), String> {
        let t0 = Instant::now();
        let share = (self.partitions as usize).div_ceil(self.members.len());
        let mut doubles = 0;
        let mut said = t0;
        loop {
            let (once, twice, most) = self.census();
            doubles += twice;
            if said.elapsed() >= Duration::from_secs(1) {
                said = Instant::now();
                eprintln!(
                    "partitions: {:5.1} s: {once} of {} led once, {twice} twice, most held {most} (share {share})",
                    t0.elapsed().as_secs_f64(),
                    self.partitions
                );
            }
            if once == self.partitions as usize && twice == 0 && most <= share {
                return Ok((t0.elapsed().as_secs_f64(), doubles));
            }
            if t0.elapsed() > within {
                let shown = pgelect::partitions::partition_assignment(
                    &self.options,
                    GROUP,
                    self.partitions,
                )
                .await
                .map(|a| {
                    let by = a.by_member();
                    let over: Vec<_> = by.iter().filter(|(_, v)| v.len() > share).collect();
                    format!(
                        "{} live members as the database shows them, over the share: {over:?}",
                        a.members.len()
                    )
                })
                .unwrap_or_else(|e| e.to_string());
                return Err(format!(
                    "not balanced within {within:?}: {once} of {} led once, {twice} twice, most held {most} (share {share}); {shown}",
                    self.partitions
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn measure(
    o: &Options,
    url: &str,
    bouncer: &pgelect_testkit::PgBouncer,
    postmaster: Option<u32>,
) -> Result<(), String> {
    let direct = ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
    pgelect::migrate(&direct).await.map_err(|e| e.to_string())?;
    let (admin, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    // The kit's PgBouncer takes 500 clients; each member is one (its lease
    // client, which also reads the group), and twice that leaves room for
    // connections being replaced.
    let (pgb, conn) = tokio_postgres::connect(&bouncer.url("pgbouncer"), tokio_postgres::NoTls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    pgb.simple_query(&format!(
        "SET max_client_conn = {}",
        2 * (o.members + o.joins) + 100
    ))
    .await
    .map_err(|e| format!("cannot raise PgBouncer's max_client_conn: {e}"))?;
    // One `application_name` for all, as the book advises for fleets
    // through a pooler.
    let pooled_url = if o.own_names {
        bouncer.url("postgres")
    } else {
        crate::fleet::with_application_name(&bouncer.url("postgres"))
    };
    let pooled = ConnectOptions::from_url(&pooled_url).map_err(|e| e.to_string())?;
    let ttl = Duration::from_secs_f64(o.ttl);
    let mut fleet = Fleet {
        options: pooled,
        partitions: o.partitions,
        ttl,
        next: 0,
        members: BTreeMap::new(),
    };
    let bound = Duration::from_secs(60);
    let mut rows = Rows::default();

    let t0 = Instant::now();
    for i in 0..o.members {
        if o.start_rate > 0.0 {
            tokio::time::sleep_until(
                (t0 + Duration::from_secs_f64(i as f64 / o.start_rate)).into(),
            )
            .await;
        }
        fleet.join()?;
    }
    let (_, d0) = fleet.balanced(bound).await?;
    let start = t0.elapsed().as_secs_f64();
    eprintln!(
        "partitions: {} members led all {} partitions {start:.2} s after the first started",
        o.members, o.partitions
    );

    // Steady state.
    let sizes_start = crate::fleet::sizes(&admin).await?;
    let (x0, w0) = crate::fleet::counters(&admin).await?;
    let cpu0 = postmaster.map(crate::fleet::tree_cpu_s);
    let w = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(o.window)).await;
    let secs = w.elapsed().as_secs_f64();
    let (x1, w1) = crate::fleet::counters(&admin).await?;
    let sizes_end = crate::fleet::sizes(&admin).await?;
    let cpu1 = postmaster.map(crate::fleet::tree_cpu_s);
    let server_cpu = match (cpu0, cpu1) {
        (Some(a), Some(b)) => Some((b - a) / secs * 100.0),
        _ => None,
    };
    let connections: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let tps = (x1 - x0) as f64 / secs;
    let writes = (w1 - w0) as f64 / secs;
    let (_, d1) = fleet.balanced(bound).await?;

    // Killed at once: dropped without leaving.
    let victims: Vec<String> = fleet.members.keys().take(o.kills).cloned().collect();
    for v in &victims {
        fleet.members.remove(v);
    }
    let (after_kill, d2) = if o.kills > 0 {
        fleet.balanced(bound).await?
    } else {
        (0.0, 0)
    };

    // Joining.
    for _ in 0..o.joins {
        fleet.join()?;
    }
    let (after_join, d3) = if o.joins > 0 {
        fleet.balanced(bound).await?
    } else {
        (0.0, 0)
    };
    let doubles = d0 + d1 + d2 + d3;
    for (_, g) in std::mem::take(&mut fleet.members) {
        let _ = g.leave().await;
    }

    let machine = crate::cli_handoff::machine();
    println!(
        "partitions: {} members, {} partitions, lease backend through PgBouncer (transaction mode), ttl {} s, looks every ttl, application_name {}, started {}; {machine}",
        o.members,
        o.partitions,
        o.ttl,
        if o.own_names { "one per client" } else { "one for all" },
        if o.start_rate > 0.0 { format!("{} a second", o.start_rate) } else { "all at once".to_owned() }
    );
    println!("phase                                   value");
    println!("cold start, all led within share        {start:.2} s");
    println!(
        "{} killed at once, all led again          {after_kill:.2} s (ttl {} s)",
        o.kills, o.ttl
    );
    println!(
        "{} joining, balanced again               {after_join:.2} s",
        o.joins
    );
    println!("server connections (steady)             {connections}");
    println!(
        "transactions/s (steady)                 {tps:.1} ({:.2} per member)",
        tps / o.members as f64
    );
    println!("rows written/s (steady)                 {writes:.1}");
    if let Some(c) = server_cpu {
        println!("server CPU (steady)                     {c:.1} % of one core");
    }
    println!("partitions held twice at once (20 ms)   {doubles}");
    println!();
    println!("over the steady window ({:.0} s):", o.window);
    crate::fleet::print_sizes(&sizes_start, &sizes_end);
    let s = |k: &str| format!("partitions/{}x{}/{k}", o.members, o.partitions);
    rows.push(&s("start"), "seconds", round2(start), "s");
    rows.push(&s("after-kill"), "seconds", round2(after_kill), "s");
    rows.push(&s("after-join"), "seconds", round2(after_join), "s");
    rows.push(
        &s("steady"),
        "server_connections",
        connections as f64,
        "count",
    );
    rows.push(&s("steady"), "transactions_per_s", round2(tps), "1/s");
    rows.push(&s("steady"), "rows_written_per_s", round2(writes), "1/s");
    if let Some(c) = server_cpu {
        rows.push(&s("steady"), "server_cpu", round2(c), "%");
    }
    rows.push(&s("all"), "double_holds", doubles as f64, "count");
    if o.json {
        let mut line = serde_json::json!({
            "bench": "partitions",
            "machine": machine,
            "members": o.members,
            "partitions": o.partitions,
            "ttl_s": o.ttl,
            "start_rate_per_s": o.start_rate,
            "application_name": if o.own_names { "one per client" } else { "one for all" },
            "window_s": o.window,
            "pgelect_tables": {
                "window_start": crate::fleet::sizes_json(&sizes_start),
                "window_end": crate::fleet::sizes_json(&sizes_end),
            },
        });
        rows.attach(&mut line);
        println!("{line}");
    }
    if doubles > 0 {
        return Err(format!(
            "partitions: {doubles} partitions were held twice at once"
        ));
    }
    Ok(())
}
