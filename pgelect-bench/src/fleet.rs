//! `fleet`: many `pgelect run --backend lease` candidate processes for one
//! role, all through PgBouncer in transaction mode (the test kit's, 20
//! server connections), as a Deployment scaled to hundreds of pods would
//! stand for one singleton.
//!
//! Phases, one run:
//!
//! * **start**: `--members` (default 100) processes are started together;
//!   the time until every one of them is registered in the candidate
//!   registry (its standby polls) and one leads;
//! * **steady state**: over `--window` seconds (default 30), after two TTLs
//!   of settling: statements per second on the server (`pg_stat_database`
//!   transactions; this benchmark's own few sampling reads included), rows
//!   written per second, PgBouncer's server connections (the most seen,
//!   sampled every second) and clients waiting for one, the CPU of the
//!   server, of PgBouncer and of the candidates, each candidate
//!   process's RSS, and the size of every table of the `pgelect` schema
//!   with its indexes and its dead tuples at the window's start and end (a
//!   long `--window`, e.g. 1800, shows whether they bloat);
//! * **failover**, `--kills` times (default 3): the leader's process is
//!   SIGKILLed and the time until another candidate holds the lease is
//!   taken (bound: TTL + 1 s); the new term must begin on the server at or
//!   after the dead leader's lease ended (no overlap); a new member
//!   replaces the dead one.
//!
//! Every member runs with `--ttl` (default 5 s) and `--retry-every` equal
//! to it (so a standby looks at the lease once per expiry on the server's
//! clock, not once a second; see the lease backend's notes in the book),
//! with `sleep` as the leader's command, and one `application_name` for
//! all (`--own-application-names`: pgelect's default name per member, for
//! which PgBouncer sends the server a `SET` before every statement). The `pgelect` binary is found as
//! by `cli-handoff` (`$PGELECT_BIN`, else next to this one).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cli_handoff::pgelect_bin;
use crate::common::{connect, option_number, round2, Rows, Stats};

const ROLE: &str = "fleet";

struct Options {
    members: usize,
    ttl: f64,
    window: f64,
    kills: usize,
    own_names: bool,
    /// Members started per second (0: all at once).
    start_rate: f64,
    logs: Option<std::path::PathBuf>,
    json: bool,
}

/// Entry point: `fleet [--members N] [--ttl S] [--window S] [--kills N] [--json]`.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut o = Options {
        members: 100,
        ttl: 5.0,
        window: 30.0,
        kills: 3,
        own_names: false,
        start_rate: 0.0,
        logs: None,
        json: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut number = |option: &str, min: f64| option_number(&mut it, "fleet", option, min);
        match a.as_str() {
            "--members" => o.members = number("--members", 2.0)? as usize,
            "--ttl" => o.ttl = number("--ttl", 1.0)?,
            "--window" => o.window = number("--window", 5.0)?,
            "--kills" => o.kills = number("--kills", 0.0)? as usize,
            "--own-application-names" => o.own_names = true,
            "--start-rate" => o.start_rate = number("--start-rate", 0.0)?,
            "--logs" => {
                o.logs = Some(it.next().ok_or("fleet: --logs needs a directory")?.into());
            }
            "--json" => o.json = true,
            other => return Err(format!("fleet: unknown option {other:?}")),
        }
    }
    if std::env::var_os("PGELECT_BENCH_DATABASE_URL").is_some() {
        return Err(
            "fleet: needs the test kit's cluster and PgBouncer; unset PGELECT_BENCH_DATABASE_URL"
                .into(),
        );
    }
    if !pgelect_testkit::pgbouncer_available() {
        return Err("fleet: needs pgbouncer (scripts/setup.sh installs it)".into());
    }
    let bin = pgelect_bin()?;
    let (url, cluster) = crate::database()?;
    let cluster = cluster.expect("BUG: a throwaway cluster without PGELECT_BENCH_DATABASE_URL");
    let bouncer =
        pgelect_testkit::PgBouncer::start(&cluster, pgelect_testkit::PoolMode::Transaction)
            .map_err(|e| format!("cannot start pgbouncer: {e}"))?;
    let postmaster = postmaster_pid(&cluster);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(measure(&o, &bin, &url, &bouncer, postmaster))
}

/// The members' processes, by node id.
struct Fleet {
    bin: std::path::PathBuf,
    url: String,
    ttl: String,
    next: usize,
    members: HashMap<String, Child>,
    logs: Option<std::path::PathBuf>,
}

impl Fleet {
    fn spawn(&mut self) -> Result<(), String> {
        let node = format!("m{:04}", self.next);
        self.next += 1;
        let child = Command::new(&self.bin)
            .args(["run", "--backend", "lease", "--role", ROLE, "--id", &node])
            .args(["--ttl", &self.ttl, "--retry-every", &self.ttl])
            .args(["--", "sleep", "100000"])
            // Through the environment: a URL with a password on the
            // command line is visible to every local user.
            .env("DATABASE_URL", &self.url)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(match &self.logs {
                Some(dir) => std::fs::File::create(dir.join(format!("{node}.log")))
                    .map(Stdio::from)
                    .map_err(|e| format!("cannot create a log in {dir:?}: {e}"))?,
                None => Stdio::null(),
            })
            .spawn()
            .map_err(|e| format!("cannot start {:?}: {e}", self.bin))?;
        self.members.insert(node, child);
        Ok(())
    }

    fn pids(&self) -> Vec<u32> {
        self.members.values().map(Child::id).collect()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for c in self.members.values_mut() {
            let _ = c.kill();
        }
        for c in self.members.values_mut() {
            let _ = c.wait();
        }
    }
}

/// `url` with one `application_name` for every member. PgBouncer sets a
/// client's `application_name` on the server connection it lends it,
/// with a `SET` of its own, whenever the two differ: with a name per
/// member (pgelect's default, `pgelect:lease:<role>:<node>`), every
/// statement through a transaction pool cost the server a second one.
pub(crate) fn with_application_name(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name=pgelect-fleet")
}

/// Clock ticks of CPU (user + system) of `pid`, from `/proc`.
fn cpu_ticks(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // After the command name in parentheses: state is field 3, utime 14.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    n(11) + n(12)
}

fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The pgbouncer processes started below this one (the kit's).
fn pgbouncer_pids() -> Vec<u32> {
    let me = std::process::id();
    all_pids()
        .into_iter()
        .filter(|p| comm(*p) == "pgbouncer")
        .filter(|p| {
            let mut at = *p;
            for _ in 0..8 {
                match parent(at) {
                    Some(q) if q == me => return true,
                    Some(q) if q > 1 => at = q,
                    _ => return false,
                }
            }
            false
        })
        .collect()
}

/// The pid of `cluster`'s postmaster, from its pid file.
pub(crate) fn postmaster_pid(cluster: &pgelect_testkit::Cluster) -> Option<u32> {
    std::fs::read_to_string(cluster.data_dir().join("postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<u32>().ok()))
}

/// CPU seconds (user + system) used so far by the postmaster and its
/// live children.
pub(crate) fn tree_cpu_s(postmaster: u32) -> f64 {
    let ticks: u64 = postgres_pids(Some(postmaster))
        .into_iter()
        .map(cpu_ticks)
        .sum();
    ticks as f64 / ticks_per_s()
}

/// The postmaster and its children.
fn postgres_pids(postmaster: Option<u32>) -> Vec<u32> {
    let Some(pm) = postmaster else {
        return Vec::new();
    };
    let mut v: Vec<u32> = all_pids()
        .into_iter()
        .filter(|p| parent(*p) == Some(pm))
        .collect();
    v.push(pm);
    v
}

fn rss_kib(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `/proc`'s clock ticks per second (`USER_HZ`): 100 on every Linux
/// architecture pgelect runs on.
fn ticks_per_s() -> f64 {
    100.0
}

/// Transactions and rows written in the database so far.
pub(crate) async fn counters(c: &tokio_postgres::Client) -> Result<(i64, i64), String> {
    let r = c
        .query_one(
            "SELECT (xact_commit + xact_rollback)::int8,
                    (tup_inserted + tup_updated + tup_deleted)::int8
               FROM pg_stat_database WHERE datname = current_database()",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok((r.get(0), r.get(1)))
}

/// PgBouncer's server connections (all states) and waiting clients for
/// database `postgres`.
async fn pools(admin: &tokio_postgres::Client) -> Result<(i64, i64), String> {
    let msgs = admin
        .simple_query("SHOW POOLS")
        .await
        .map_err(|e| format!("SHOW POOLS: {e}"))?;
    let (mut servers, mut waiting) = (0, 0);
    for m in msgs {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            if r.get("database") != Some("postgres") {
                continue;
            }
            let n = |k: &str| r.get(k).and_then(|v| v.parse::<i64>().ok()).unwrap_or(0);
            servers +=
                n("sv_active") + n("sv_idle") + n("sv_used") + n("sv_tested") + n("sv_login");
            waiting += n("cl_waiting");
        }
    }
    Ok((servers, waiting))
}

/// The lease row: holder, term, remaining ms on the server's clock.
async fn leader(c: &tokio_postgres::Client) -> Result<Option<(String, i64, f64)>, String> {
    let r = c
        .query_opt(
            "SELECT holder, term, (extract(epoch FROM lease_until - now()) * 1000)::float8
               FROM pgelect.leaders WHERE role = $1 AND holder IS NOT NULL",
            &[&ROLE],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(r.map(|r| (r.get(0), r.get(1), r.get(2))))
}

async fn registered(c: &tokio_postgres::Client, ttl: f64) -> Result<i64, String> {
    let r = c
        .query_one(
            // A leader's lease row stands for it: a lease leader does not
            // refresh its registration while it renews.
            "SELECT count(*) FROM (
                 SELECT node FROM pgelect.candidates
                  WHERE role = $1 AND seen_at >= now() - $2 * interval '1 second'
                 UNION
                 SELECT holder FROM pgelect.leaders
                  WHERE role = $1 AND holder IS NOT NULL AND lease_until > now()) AS m",
            &[&ROLE, &ttl],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(r.get(0))
}

/// The size of one of pgelect's tables with its indexes, and its tuples.
#[derive(Clone, Debug)]
pub(crate) struct TableSize {
    table: String,
    table_bytes: i64,
    index_bytes: i64,
    live: i64,
    dead: i64,
}

/// Every table of the `pgelect` schema: heap and index bytes, live and
/// dead tuples (the statistics collector's counts, a moment behind).
pub(crate) async fn sizes(c: &tokio_postgres::Client) -> Result<Vec<TableSize>, String> {
    let rows = c
        .query(
            "SELECT relname::text, pg_relation_size(relid)::int8, pg_indexes_size(relid)::int8,
                    n_live_tup::int8, n_dead_tup::int8
               FROM pg_stat_user_tables WHERE schemaname = 'pgelect' ORDER BY relname",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(rows
        .iter()
        .map(|r| TableSize {
            table: r.get(0),
            table_bytes: r.get(1),
            index_bytes: r.get(2),
            live: r.get(3),
            dead: r.get(4),
        })
        .collect())
}

pub(crate) fn sizes_json(sizes: &[TableSize]) -> serde_json::Value {
    sizes
        .iter()
        .map(|t| {
            (
                t.table.clone(),
                serde_json::json!({
                    "table_bytes": t.table_bytes,
                    "index_bytes": t.index_bytes,
                    "live_tuples": t.live,
                    "dead_tuples": t.dead,
                }),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The table of pgelect's tables at a window's start and end.
pub(crate) fn print_sizes(sizes_start: &[TableSize], sizes_end: &[TableSize]) {
    println!(
        "{:<24} {:>26} {:>26} {:>16}",
        "pgelect table", "heap kB, start -> end", "indexes kB, start -> end", "dead tuples, end"
    );
    for end in sizes_end {
        let start = sizes_start.iter().find(|t| t.table == end.table);
        let kb = |b: i64| b as f64 / 1024.0;
        let pair = |a: Option<i64>, b: i64| match a {
            Some(a) => format!("{:.0} -> {:.0}", kb(a), kb(b)),
            None => format!("- -> {:.0}", kb(b)),
        };
        println!(
            "{:<24} {:>26} {:>26} {:>16}",
            end.table,
            pair(start.map(|t| t.table_bytes), end.table_bytes),
            pair(start.map(|t| t.index_bytes), end.index_bytes),
            format!("{} ({} live)", end.dead, end.live)
        );
    }
}

async fn measure(
    o: &Options,
    bin: &std::path::Path,
    url: &str,
    bouncer: &pgelect_testkit::PgBouncer,
    postmaster: Option<u32>,
) -> Result<(), String> {
    let say = |m: String| {
        if !o.json {
            eprintln!("fleet: {m}");
        }
    };
    let direct = pgelect::ConnectOptions::from_url(url).map_err(|e| e.to_string())?;
    pgelect::migrate(&direct).await.map_err(|e| e.to_string())?;
    let db = connect(url).await?;
    let admin = connect(&bouncer.url("pgbouncer")).await?;
    // The kit's PgBouncer takes 500 clients; a fleet needs one each.
    admin
        .simple_query(&format!("SET max_client_conn = {}", o.members + 100))
        .await
        .map_err(|e| format!("cannot raise PgBouncer's max_client_conn: {e}"))?;
    let ttl = Duration::from_secs_f64(o.ttl);
    let mut fleet = Fleet {
        bin: bin.to_owned(),
        url: if o.own_names {
            bouncer.url("postgres")
        } else {
            with_application_name(&bouncer.url("postgres"))
        },
        ttl: format!("{}ms", ttl.as_millis()),
        next: 0,
        members: HashMap::new(),
        logs: o.logs.clone(),
    };
    if let Some(dir) = &o.logs {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {dir:?}: {e}"))?;
    }
    let mut figures = Rows::default();
    let scenario = format!("fleet/{}-members-ttl-{ttl:?}", o.members);

    // Start.
    say(format!("starting {} members (ttl {ttl:?})…", o.members));
    let t0 = Instant::now();
    for i in 0..o.members {
        if o.start_rate > 0.0 {
            let at = t0 + Duration::from_secs_f64(i as f64 / o.start_rate);
            tokio::time::sleep_until(at.into()).await;
        }
        fleet.spawn()?;
    }
    let spawned = t0.elapsed();
    let start_limit =
        Duration::from_secs(120) + ttl * 4 + Duration::from_millis(50) * o.members as u32;
    let started = loop {
        let n = registered(&db, o.ttl).await?;
        if n >= o.members as i64 && leader(&db).await?.is_some() {
            break t0.elapsed();
        }
        if t0.elapsed() > start_limit {
            return Err(format!(
                "fleet: after {start_limit:?} only {n} of {} members are registered",
                o.members
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    say(format!(
        "all registered, one leads, {:.1} s after the start ({:.1} s to spawn); settling {:?}…",
        started.as_secs_f64(),
        spawned.as_secs_f64(),
        ttl * 2
    ));
    tokio::time::sleep(ttl * 2).await;

    // Steady state.
    let pgb = pgbouncer_pids();
    let pgs = postgres_pids(postmaster);
    let members = fleet.pids();
    let cpu = |pids: &[u32]| pids.iter().map(|p| cpu_ticks(*p)).sum::<u64>();
    let (x0, w0) = counters(&db).await?;
    let sizes_start = sizes(&db).await?;
    let (c_pgb, c_pg, c_m) = (cpu(&pgb), cpu(&pgs), cpu(&members));
    let w = Instant::now();
    let (mut servers_max, mut waiting_max, mut servers_sum, mut samples) = (0i64, 0i64, 0i64, 0i64);
    while w.elapsed().as_secs_f64() < o.window {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (s, c) = pools(&admin).await?;
        servers_max = servers_max.max(s);
        waiting_max = waiting_max.max(c);
        servers_sum += s;
        samples += 1;
    }
    let secs = w.elapsed().as_secs_f64();
    let (x1, w1) = counters(&db).await?;
    let sizes_end = sizes(&db).await?;
    let per_s = |ticks: u64| ticks as f64 / ticks_per_s() / secs * 100.0;
    let cpu_pgb = per_s(cpu(&pgb).saturating_sub(c_pgb));
    let cpu_pg = per_s(cpu(&pgs).saturating_sub(c_pg));
    let cpu_m = per_s(cpu(&members).saturating_sub(c_m));
    let statements = (x1 - x0) as f64 / secs;
    let writes = (w1 - w0) as f64 / secs;
    let rss: Vec<f64> = members
        .iter()
        .filter_map(|p| rss_kib(*p))
        .map(|k| k / 1024.0)
        .collect();
    let rss_s = Stats::of(&rss);
    let rss_total: f64 = rss.iter().sum();
    let knows = registered(&db, o.ttl).await?;
    say(format!(
        "steady state over {secs:.0} s: {statements:.1} statements/s ({:.3} per member), {writes:.1} rows written/s, PgBouncer server connections at most {servers_max}, clients waiting at most {waiting_max}",
        statements / o.members as f64
    ));

    // Failover.
    let mut failovers = Vec::new();
    let mut over_bound = 0usize;
    let mut overlaps = 0usize;
    for k in 0..o.kills {
        let Some((holder, term, _)) = leader(&db).await? else {
            return Err("fleet: no leader before a kill".into());
        };
        let Some(mut child) = fleet.members.remove(&holder) else {
            return Err(format!(
                "fleet: the leader {holder:?} is not one of the members"
            ));
        };
        let killed = Instant::now();
        child
            .kill()
            .map_err(|e| format!("cannot SIGKILL the leader: {e}"))?;
        let _ = child.wait();
        // Its lease as it was left (no renewal can follow the death).
        let old_until: std::time::SystemTime = db
            .query_one(
                "SELECT lease_until FROM pgelect.leaders WHERE role = $1",
                &[&ROLE],
            )
            .await
            .map_err(|e| e.to_string())?
            .get(0);
        let limit = ttl + Duration::from_secs(30);
        let (took, new_term, acquired) = loop {
            let r = db
                .query_opt(
                    "SELECT term, acquired_at FROM pgelect.leaders
                      WHERE role = $1 AND holder IS NOT NULL AND term > $2",
                    &[&ROLE, &term],
                )
                .await
                .map_err(|e| e.to_string())?;
            if let Some(r) = r {
                break (
                    killed.elapsed(),
                    r.get::<_, i64>(0),
                    r.get::<_, std::time::SystemTime>(1),
                );
            }
            if killed.elapsed() > limit {
                return Err(format!(
                    "fleet: no successor {limit:?} after the leader's SIGKILL"
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let ms = took.as_secs_f64() * 1000.0;
        if took > ttl + Duration::from_secs(1) {
            over_bound += 1;
        }
        if acquired < old_until {
            overlaps += 1;
        }
        say(format!(
            "kill {}: {holder} (term {term}) SIGKILLed; term {new_term} began {ms:.0} ms later",
            k + 1
        ));
        failovers.push(ms);
        fleet.spawn()?;
        // Let the replacement register before the next kill.
        tokio::time::sleep(ttl).await;
    }

    figures.push(&scenario, "members", o.members as f64, "count");
    figures.push(
        &scenario,
        "start-all-registered",
        started.as_secs_f64() * 1000.0,
        "ms",
    );
    figures.push(&scenario, "statements", statements, "1/s");
    figures.push(
        &scenario,
        "statements-per-member",
        statements / o.members as f64,
        "1/s",
    );
    figures.push(&scenario, "rows-written", writes, "1/s");
    figures.push(
        &scenario,
        "server-connections-max",
        servers_max as f64,
        "count",
    );
    figures.push(
        &scenario,
        "clients-waiting-max",
        waiting_max as f64,
        "count",
    );
    figures.push(&scenario, "cpu-postgres", cpu_pg, "%");
    figures.push(&scenario, "cpu-pgbouncer", cpu_pgb, "%");
    figures.push(&scenario, "cpu-members", cpu_m, "%");
    figures.push(&scenario, "rss-per-member-p50", rss_s.p50, "MiB");
    figures.push(&scenario, "rss-members-total", rss_total, "MiB");
    figures.push(
        &scenario,
        "failover-over-ttl-plus-1s",
        over_bound as f64,
        "count",
    );
    figures.push(&scenario, "overlaps", overlaps as f64, "count");
    figures.latency(&format!("{scenario}/crash-failover"), &failovers);

    let fo = (!failovers.is_empty()).then(|| Stats::of(&failovers));
    let mut line = serde_json::json!({
        "bench": "fleet",
        "path": "PgBouncer (transaction mode, pool of 20)",
        "application_name": if o.own_names { "one per member" } else { "one for all" },
        "members": o.members,
        "ttl_ms": ttl.as_millis() as u64,
        "retry_every_ms": ttl.as_millis() as u64,
        "window_s": round2(secs),
        "start_ms": round2(started.as_secs_f64() * 1000.0),
        "spawn_ms": round2(spawned.as_secs_f64() * 1000.0),
        "statements_per_s": round2(statements),
        "statements_per_member_per_s": (statements / o.members as f64 * 1000.0).round() / 1000.0,
        "rows_written_per_s": round2(writes),
        "server_connections": {"max": servers_max, "mean": round2(servers_sum as f64 / samples.max(1) as f64)},
        "clients_waiting_max": waiting_max,
        "cpu_percent": {"postgres": round2(cpu_pg), "pgbouncer": round2(cpu_pgb), "members": round2(cpu_m)},
        "rss_mib_per_member": rss_s.json(),
        "rss_mib_members_total": round2(rss_total),
        "registered_fresh_after_window": knows,
        "pgelect_tables": {"window_start": sizes_json(&sizes_start), "window_end": sizes_json(&sizes_end)},
        "crash_failover_ms": fo.as_ref().map(Stats::json),
        "failovers_over_ttl_plus_1s": over_bound,
        "overlaps": overlaps,
    });
    if !o.json {
        println!(
            "fleet: {} `pgelect run --backend lease` members of one role through PgBouncer (transaction mode), ttl {ttl:?}, retry-every {ttl:?}\n",
            o.members
        );
        let rows: Vec<(&str, String)> = vec![
            (
                "start: all registered, one leads",
                format!("{:.1} s", started.as_secs_f64()),
            ),
            ("statements/s (server)", format!("{statements:.1}")),
            (
                "statements/s per member",
                format!("{:.3}", statements / o.members as f64),
            ),
            ("rows written/s", format!("{writes:.1}")),
            ("server connections (max)", format!("{servers_max}")),
            ("clients waiting (max)", format!("{waiting_max}")),
            (
                "CPU postgres / pgbouncer / members",
                format!("{cpu_pg:.0} % / {cpu_pgb:.0} % / {cpu_m:.0} %"),
            ),
            (
                "RSS per member p50 (max)",
                format!("{:.1} MiB ({:.1})", rss_s.p50, rss_s.max),
            ),
            ("RSS all members", format!("{rss_total:.0} MiB")),
            (
                "crash failover p50 / p99 (bound ttl + 1 s)",
                fo.as_ref()
                    .map(|s| {
                        format!(
                            "{:.0} / {:.0} ms ({} trials)",
                            s.p50,
                            s.p99,
                            failovers.len()
                        )
                    })
                    .unwrap_or_else(|| "-".into()),
            ),
            (
                "failovers over the bound / overlaps",
                format!("{over_bound} / {overlaps}"),
            ),
        ];
        for (k, v) in rows {
            println!("{k:<44} {v}");
        }
        println!();
        print_sizes(&sizes_start, &sizes_end);
        println!();
    }
    figures.attach(&mut line);
    println!("{line}");
    drop(fleet);
    if over_bound > 0 || overlaps > 0 {
        return Err(format!(
            "fleet: {over_bound} failovers over ttl + 1 s, {overlaps} overlaps"
        ));
    }
    Ok(())
}
