//! The partition-group run (`--partitions N --members M`): M supervisors
//! `pgelect run --backend lease --partitions GROUP:N`, through the pooler
//! (their LISTEN connections direct), each running a worker per partition
//! it leads; faults on members (one or several killed, paused, terminated)
//! and on the pooler; after each, the wait until every partition it hit is
//! led again.
//!
//! Each partition `GROUP/p` is an election of its own: the workers log
//! their partition's role on every line and write it with their fenced
//! writes, and the checker applies every rule per role
//! ([`super::judge::judge`]).
//!
//! The workers tick every [`GROUP_TICK`] (50 ms) instead of 5 ms: a
//! hundred workers at 5 ms are 20,000 log writes a second, a core's worth
//! of wake-ups on a 2-core machine, which would starve the supervisors
//! whose timing is under test. The tick bounds how short an overlap the
//! logs can show (a worker acting past its end is seen once it ticks), so
//! it must stay below the leader's safety margin (the time between its
//! local deadline and the lease's end: ttl / 5, 400 ms at the default 2 s
//! TTL), the most an overlap could be before any lease rule is broken; the
//! run refuses a TTL whose margin is not above the tick.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;

use super::args::timing;
use super::candidates::{signal, Run, Supervisor};
use super::events::{is_write_ok, now_ns, parse_line, Event};
use super::fail;
use super::faults::{group_bound, Fault};
use super::schedule::{Draw, Hit, Injected};
use super::worker::{ROGUE, WRITE_EVERY};
use crate::exit::{self, Failure};
use crate::run::BackendArg;

/// The workers' tick in a partition-group run (see the module docs).
pub(super) const GROUP_TICK: Duration = Duration::from_millis(50);

/// The members of a partition-group run unless `--members` says.
pub(super) const DEFAULT_MEMBERS: u16 = 20;

/// The faults a partition-group run injects (its default set).
pub(super) const GROUP_FAULTS: [Fault; 5] = [
    Fault::Kill,
    Fault::KillMany,
    Fault::Stop,
    Fault::Term,
    Fault::PgbouncerRestart,
];

/// How long paused workers, continued before their supervisors, are given
/// to have a fenced write refused (or, wrongly, acknowledged): the first
/// attempt may find its pooled connection ended and fail, and the next
/// one reconnects (within 1 s).
const PAUSED_WRITES_WITHIN: Duration = Duration::from_secs(3);

/// How long the members may take to lead every partition at the start.
const FIRST_LED_WITHIN: Duration = Duration::from_secs(120);

/// The shape of a partition-group run.
#[derive(Clone, Copy, Debug)]
pub(super) struct Group {
    pub(super) partitions: u32,
    pub(super) members: u16,
    /// The workers' tick.
    pub(super) tick: Duration,
}

impl Group {
    /// The shape `args` ask for, if they ask for a group; refused when the
    /// leader's safety margin is not above the tick.
    pub(super) fn from_args(args: &super::ChaosArgs) -> Result<Option<Group>, Failure> {
        let Some(partitions) = args.partitions else {
            return Ok(None);
        };
        let g = Group {
            partitions,
            members: args.members.unwrap_or(DEFAULT_MEMBERS),
            tick: GROUP_TICK,
        };
        let margin = timing(args, BackendArg::Lease)?.safety_margin;
        if margin <= g.tick {
            return Err(Failure::new(
                exit::USAGE,
                format!(
                    "--ttl {}: the leader's safety margin ({} ms) must be above the workers' tick ({} ms), or an overlap could go unseen: raise --ttl",
                    crate::duration::show(args.ttl),
                    margin.as_millis(),
                    g.tick.as_millis()
                ),
            ));
        }
        Ok(Some(g))
    }

    /// How often a worker makes a fenced write.
    pub(super) fn write_every(&self) -> Duration {
        self.tick * WRITE_EVERY
    }

    /// The bound on the time until every partition `fault` hit is led
    /// again ([`group_bound`]).
    pub(super) fn bound(&self, fault: Fault, t: &pgelect::election::TimingReport) -> Duration {
        group_bound(fault, t, self.write_every())
    }

    /// The longest bound of any fault the run injects: no partition may be
    /// unled longer, whatever the cause.
    pub(super) fn longest_bound(&self, t: &pgelect::election::TimingReport) -> Duration {
        GROUP_FAULTS
            .iter()
            .map(|&f| self.bound(f, t))
            .max()
            .expect("BUG: no group fault")
    }
}

/// Why `fault` is not injected in a partition-group run, if it is not.
pub(super) fn not_in_group(fault: Fault) -> Option<&'static str> {
    match fault {
        Fault::Kill | Fault::KillMany | Fault::Stop | Fault::Term | Fault::PgbouncerRestart => None,
        Fault::Terminate => Some(
            "through PgBouncer in transaction mode a member has no server backend of its own to end",
        ),
        Fault::Blackhole | Fault::Latency => {
            Some("the members of the partition-group run have no proxy of their own")
        }
        Fault::Starve | Fault::ClockJump | Fault::RestartFast | Fault::RestartImmediate => {
            Some("not implemented in the partition-group run (the runs of one role inject it)")
        }
        Fault::Partition | Fault::PartitionNoPreempt => Some(
            "the members connect through PgBouncer on loopback, out of the network namespaces' reach",
        ),
        Fault::Promote => Some("the partition-group run has no replica"),
        Fault::Switchover | Fault::Failover | Fault::PostmasterKill | Fault::NodeKill => {
            Some(super::ha::NEEDS_MANAGER)
        }
    }
}

/// The workers' logs read as they grow: per role, the starts, the
/// acknowledged writes and who leads now (ticks are skipped: the checker
/// reads them at the end).
struct Tail {
    dir: PathBuf,
    read: BTreeMap<PathBuf, u64>,
    roles: BTreeMap<String, RoleLog>,
}

#[derive(Default)]
struct RoleLog {
    /// The start of the highest term, and whether that worker stopped.
    leader: Option<(Event, bool)>,
    starts: Vec<Event>,
    /// Acknowledged writes: when, and of which term.
    oks: Vec<(u128, i64)>,
    /// Writes with a verdict (acknowledged or refused): which worker, when.
    verdicts: Vec<(u32, u128)>,
}

impl Tail {
    fn new(dir: &Path) -> Tail {
        Tail {
            dir: dir.to_owned(),
            read: BTreeMap::new(),
            roles: BTreeMap::new(),
        }
    }

    /// Reads what the logs gained since the last call (whole lines only).
    fn update(&mut self) {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "log") {
                continue;
            }
            let offset = self.read.get(&path).copied().unwrap_or(0);
            let Ok(mut file) = std::fs::File::open(&path) else {
                continue;
            };
            let mut text = Vec::new();
            if file.seek(SeekFrom::Start(offset)).is_err() || file.read_to_end(&mut text).is_err() {
                continue;
            }
            let Some(last) = text.iter().rposition(|&b| b == b'\n') else {
                continue;
            };
            self.read.insert(path, offset + last as u64 + 1);
            for line in String::from_utf8_lossy(&text[..=last]).lines() {
                if let Some(e) = parse_line(line).filter(|e| e.what != "tick" && e.node != ROGUE) {
                    self.add(e);
                }
            }
        }
    }

    fn add(&mut self, e: Event) {
        let r = self.roles.entry(e.role.clone()).or_default();
        if e.what == "start" {
            if r.leader.as_ref().is_none_or(|(l, _)| e.term > l.term) {
                r.leader = Some((e.clone(), false));
            }
            r.starts.push(e);
        } else if e.what == "stop" {
            if let Some((l, stopped)) = &mut r.leader {
                if l.pid == e.pid && l.term == e.term {
                    *stopped = true;
                }
            }
        } else if is_write_ok(&e.what) {
            r.oks.push((e.at, e.term));
            r.verdicts.push((e.pid, e.at));
        } else if e.what.ends_with(":refused") {
            r.verdicts.push((e.pid, e.at));
        }
    }

    /// Whether `hit`'s worker had a write acknowledged or refused after
    /// `after`.
    fn judged_after(&self, hit: &Hit, after: u128) -> bool {
        self.roles.get(&hit.role).is_some_and(|r| {
            r.verdicts
                .iter()
                .any(|&(pid, at)| pid == hit.pid && at > after)
        })
    }

    /// Every partition's leader as the logs show it now (not one whose
    /// worker stopped: a handover under way).
    fn holders(&self) -> BTreeMap<&str, &Event> {
        self.roles
            .iter()
            .filter_map(|(role, r)| match &r.leader {
                Some((e, false)) => Some((role.as_str(), e)),
                _ => None,
            })
            .collect()
    }

    /// When the partition of `hit` was led again after `fault` (see
    /// [`super::judge::led_again`], the checker's own reading).
    fn led_again(&self, hit: &Hit, fault: Fault, at: u128, ended: u128) -> Option<u128> {
        let r = self.roles.get(&hit.role)?;
        let start = r
            .starts
            .iter()
            .filter(|e| e.term > hit.term)
            .map(|e| e.at)
            .min();
        let write = (!fault.must_fail_over(BackendArg::Lease))
            .then(|| {
                r.oks
                    .iter()
                    .filter(|(w, t)| *w > ended && *t >= hit.term)
                    .map(|(w, _)| *w)
                    .min()
            })
            .flatten();
        start.into_iter().chain(write).min().map(|t| t.max(at))
    }
}

/// Runs the partition-group run's schedule, drawing from `kinds` (all of
/// them run here: see [`not_in_group`]); returns the faults injected.
pub(super) async fn schedule_group(
    run: &mut Run<'_>,
    kinds: Vec<Fault>,
    rng: &mut StdRng,
) -> Result<Vec<Injected>, Failure> {
    let g = run
        .group
        .expect("BUG: a partition-group schedule without a group");
    let args = run.args;
    let timing = timing(args, BackendArg::Lease)?;
    let began = Instant::now();
    let mut sups: Vec<Supervisor> = Vec::new();
    let mut rogue = None;
    let mut tail = Tail::new(&run.dir);
    let outcome = async {
        for _ in 0..g.members {
            sups.push(run.spawn().await?);
        }
        if args.rogue {
            rogue = Some(run.spawn_rogue()?);
        }
        loop {
            tail.update();
            let led = tail.holders().len();
            if led == g.partitions as usize {
                break;
            }
            if began.elapsed() > FIRST_LED_WITHIN {
                return Err(fail(format!(
                    "only {led} of {} partitions led within {} s of the start",
                    g.partitions,
                    FIRST_LED_WITHIN.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!(
            "  all {} partitions led {:.1} s after the {} members started",
            g.partitions,
            began.elapsed().as_secs_f64(),
            g.members
        );
        let mut injected = Vec::new();
        let mut draw = Draw::new(kinds);
        let end = Instant::now() + args.duration;
        while Instant::now() < end || (args.every_fault && draw.drawn < draw.kinds.len()) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..1500))).await;
            let Some(fault) = draw.next(rng) else { break };
            tail.update();
            let holders = tail.holders();
            let mut leading: Vec<&str> = holders.values().map(|e| e.node.as_str()).collect();
            leading.sort_unstable();
            leading.dedup();
            let targets: Vec<String> = match fault {
                Fault::PgbouncerRestart => Vec::new(),
                Fault::KillMany => {
                    let most = (g.members as usize / 10).max(3);
                    let k = rng.random_range(2..=most).min(leading.len());
                    leading.choose_multiple(rng, k).map(|n| n.to_string()).collect()
                }
                _ => leading.choose(rng).map(|n| n.to_string()).into_iter().collect(),
            };
            let hits: Vec<Hit> = holders
                .iter()
                .filter(|(_, e)| fault == Fault::PgbouncerRestart || targets.contains(&e.node))
                .map(|(role, e)| Hit {
                    role: role.to_string(),
                    term: e.term,
                    pid: e.pid,
                })
                .collect();
            let at = now_ns();
            let (paused, skipped) =
                inject(fault, run, &mut sups, &targets, &hits, &mut tail).await?;
            let ended = now_ns();
            // Until every partition hit is led again, or well past the
            // bound (the checker then reports it).
            let b = g.bound(fault, &timing);
            let mut again: Vec<Option<u128>> = vec![None; hits.len()];
            if skipped.is_none() {
                let until = Instant::now() + b + Duration::from_secs(5);
                loop {
                    tail.update();
                    again = hits
                        .iter()
                        .map(|h| tail.led_again(h, fault, at, ended))
                        .collect();
                    if again.iter().all(Option::is_some) || Instant::now() > until {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            let all_again = again.iter().copied().collect::<Option<Vec<u128>>>();
            let node = match fault {
                Fault::PgbouncerRestart => "pgbouncer".to_owned(),
                _ => targets.join(","),
            };
            let outcome = match (&skipped, &all_again) {
                (Some(why), _) => format!("skipped: {why}"),
                (None, Some(times)) => {
                    let ms = |t: u128| t.saturating_sub(at) as f64 / 1e6;
                    let mut gaps: Vec<f64> = times.iter().map(|&t| ms(t)).collect();
                    gaps.sort_by(f64::total_cmp);
                    let last = gaps.last().copied().unwrap_or(0.0);
                    format!(
                        "{} partition(s) led again, the last {last:.1} ms later (median {:.1} ms; bound {} ms{})",
                        hits.len(),
                        gaps.get(gaps.len() / 2).copied().unwrap_or(0.0),
                        b.as_millis(),
                        if last > b.as_millis() as f64 { ": OVER" } else { "" }
                    )
                }
                (None, None) => format!(
                    "{} of {} partition(s) not led again within {} ms",
                    again.iter().filter(|a| a.is_none()).count(),
                    hits.len(),
                    (b + Duration::from_secs(5)).as_millis()
                ),
            };
            println!("  {:<9} on {node}: {outcome}", fault.name());
            let stuck = skipped.is_none() && all_again.is_none();
            injected.push(Injected {
                fault,
                at,
                node,
                term: hits.first().map_or(0, |h| h.term),
                hits,
                ended,
                next_start: all_again.and_then(|t| t.into_iter().max()),
                paused,
                unreplicated: None,
                resumed: None,
                writable: None,
                unsynchronized: None,
                ran: skipped.is_none(),
                skipped,
            });
            if stuck {
                // The checker reports it; more faults would only blur it.
                println!("  no more faults: a partition was not led again");
                break;
            }
        }
        Ok(injected)
    }
    .await;
    run.stop_all(rogue, sups, Duration::from_secs(20)).await;
    outcome
}

/// Injects `fault` on the members `targets` (whose leaders are `hits`), or
/// on the pooler; a member killed or terminated is replaced by a new one.
/// Whether the hits were paused, and why the fault could not run, if so.
async fn inject(
    fault: Fault,
    run: &mut Run<'_>,
    sups: &mut Vec<Supervisor>,
    targets: &[String],
    hits: &[Hit],
    tail: &mut Tail,
) -> Result<(bool, Option<String>), Failure> {
    let mut picked = Vec::new();
    if fault != Fault::PgbouncerRestart {
        if targets.is_empty() {
            return Ok((false, Some("no member led a partition".to_owned())));
        }
        for t in targets {
            let Some(i) = sups.iter().position(|s| &s.node == t) else {
                return Err(fail(format!("the member {t} is not one of ours")));
            };
            picked.push(i);
        }
    }
    match fault {
        Fault::Kill | Fault::KillMany => {
            // All at once, then reaped.
            for &i in &picked {
                let _ = sups[i].child.start_kill();
            }
            replace(run, sups, picked).await?;
        }
        Fault::Term => {
            for &i in &picked {
                signal(sups[i].child.id(), nix::sys::signal::Signal::SIGTERM);
            }
            replace(run, sups, picked).await?;
        }
        Fault::Stop => {
            let members: Vec<Option<u32>> = picked.iter().map(|&i| sups[i].child.id()).collect();
            let workers: Vec<Option<u32>> = hits.iter().map(|h| Some(h.pid)).collect();
            for &p in members.iter().chain(&workers) {
                signal(p, nix::sys::signal::Signal::SIGSTOP);
            }
            tokio::time::sleep(run.args.ttl * 3 / 2).await;
            // The workers first: they write on (their missed ticks come
            // at once) before their supervisors can see the leadership
            // lost and end them, so that the fence, not the supervisor,
            // must refuse their writes. Until each had a verdict (a first
            // attempt may find its pooled connection gone and fail), at
            // most PAUSED_WRITES_WITHIN.
            let continued = now_ns();
            for &p in &workers {
                signal(p, nix::sys::signal::Signal::SIGCONT);
            }
            let until = Instant::now() + PAUSED_WRITES_WITHIN;
            while Instant::now() < until {
                tail.update();
                if hits.iter().all(|h| tail.judged_after(h, continued)) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            for &p in &members {
                signal(p, nix::sys::signal::Signal::SIGCONT);
            }
            return Ok((true, None));
        }
        Fault::PgbouncerRestart => match &run.pooler {
            Err(why) => return Ok((false, Some(why.clone()))),
            Ok(p) => match p.not_restartable() {
                Some(why) => return Ok((false, Some(why))),
                None => p.restart().await?,
            },
        },
        other => {
            let why = not_in_group(other).unwrap_or("not in the partition-group run");
            return Ok((false, Some(why.to_owned())));
        }
    }
    Ok((false, None))
}

/// Waits for the supervisors at `picked` to exit (SIGKILL after 15 s),
/// retires them and starts as many new ones.
async fn replace(
    run: &mut Run<'_>,
    sups: &mut Vec<Supervisor>,
    mut picked: Vec<usize>,
) -> Result<(), Failure> {
    // Highest index first, so that removing keeps the others' places.
    picked.sort_unstable_by(|a, b| b.cmp(a));
    let gone: Vec<Supervisor> = picked.iter().map(|&i| sups.remove(i)).collect();
    for mut s in gone {
        if tokio::time::timeout(Duration::from_secs(15), s.child.wait())
            .await
            .is_err()
        {
            let _ = s.child.start_kill();
            let _ = s.child.wait().await;
        }
        run.retire(s);
        sups.push(run.spawn().await?);
    }
    Ok(())
}
