//! The faults chaos injects, the one table of bounds on the time until the
//! next leader acts after each, and how each is injected.

use std::time::{Duration, Instant};

use clap::ValueEnum;
use rand::rngs::StdRng;
use rand::Rng;

use super::admin::terminate_backends;
use super::candidates::{signal, Run, Supervisor};
use super::events::{now_ns, Event};
use super::{fail, PROMOTE_NEEDS_THROWAWAY};
use crate::exit::Failure;
use crate::run::BackendArg;

/// A fault the command injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ValueEnum)]
pub enum Fault {
    /// SIGKILL the leader's supervisor (a crash).
    Kill,
    /// SIGKILL several members of a partition group at once (2 to a tenth
    /// of them, at least 3): their partitions all unled together, the
    /// others' shares grow. Partition-group runs only (--partitions); one
    /// role has one leader, so elsewhere it is reported skipped.
    #[value(name = "kill-many")]
    KillMany,
    /// SIGSTOP the leader's supervisor and worker for 1.5 × the TTL, then
    /// SIGCONT (a pause: only the fence protects).
    Stop,
    /// SIGTERM the leader's supervisor (a planned handover).
    Term,
    /// `pg_terminate_backend` on the leader's server backends.
    Terminate,
    /// The leader's traffic stops in both directions (its proxy stops
    /// forwarding, both TCP connections stay up) for 1.5 × the TTL.
    Blackhole,
    /// The leader's traffic is delayed (from a quarter of its heartbeat
    /// timeout to twice it, each way) for 1.5 × the TTL.
    Latency,
    /// The leader's network namespace is cut off (the kernel drops its
    /// packets) until a new leader acts; candidates may preempt
    /// (`pg_signal_backend`).
    Partition,
    /// As `partition`, with `pg_signal_backend` revoked from every
    /// candidate's database user while it lasts: only the server's own TCP
    /// timers free the leader's lock.
    #[value(name = "partition-nopreempt")]
    PartitionNoPreempt,
    /// The leader's supervisor and worker starved of CPU for 1.5 × the TTL:
    /// each 10 ms they run 1 ms (SIGSTOP, SIGCONT), so timers fire late.
    /// Unlike a pause the supervisor keeps running now and then and must
    /// stop its worker in time: no overlap is excused.
    Starve,
    /// The leader's supervisor's wall clock jumps an hour forward or back
    /// (libfaketime, preloaded into every supervisor of the first phase),
    /// and back again after 1.5 × the TTL: nothing may depend on it.
    ClockJump,
    /// The throwaway server stopped (`pg_ctl stop -m fast`: clients
    /// disconnected, a clean shutdown) and started again.
    RestartFast,
    /// The throwaway server stopped with `-m immediate` (a crash: the next
    /// start recovers) and started again; acknowledged writes must survive.
    RestartImmediate,
    /// The PgBouncer chaos started in front of its throwaway server killed
    /// (SIGKILL: every connection through it drops) and started again; only
    /// where the lease backend runs through it (the session backend never
    /// does).
    #[value(name = "pgbouncer-restart")]
    PgbouncerRestart,
    /// On a throwaway primary with an asynchronous streaming replica (a
    /// phase of its own): the primary stopped with `-m immediate` and the
    /// replica promoted (`pg_ctl promote`); before the next one, a new
    /// replica of the promoted server. The candidates connect with a URL
    /// naming both servers and `target_session_attrs=read-write`; the lease
    /// backend's through PgBouncer in front of an address chaos points at
    /// the primary, where PgBouncer is installed (LISTEN on the two-host
    /// URL).
    Promote,
    /// Under an HA manager (`--ha`): `pg_autoctl perform switchover` (the
    /// monitor demotes the primary and promotes its synchronous standby).
    Switchover,
    /// Under an HA manager (`--ha`): `pg_autoctl perform failover`.
    Failover,
    /// Under an HA manager (`--ha`): SIGKILL of the primary's postmaster
    /// (its keeper restarts it in place, or the monitor fails over).
    #[value(name = "postmaster-kill")]
    PostmasterKill,
    /// Under an HA manager (`--ha`): SIGKILL of the primary's whole node
    /// (keeper and PostgreSQL, as a machine that dies): the monitor fails
    /// over; the node is started again and rejoins as a standby.
    #[value(name = "node-kill")]
    NodeKill,
}

impl Fault {
    pub(super) fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::KillMany => "kill-many",
            Fault::Stop => "stop",
            Fault::Term => "term",
            Fault::Terminate => "terminate",
            Fault::Blackhole => "blackhole",
            Fault::Latency => "latency",
            Fault::Partition => "partition",
            Fault::PartitionNoPreempt => "partition-nopreempt",
            Fault::Starve => "starve",
            Fault::ClockJump => "clock-jump",
            Fault::RestartFast => "restart-fast",
            Fault::RestartImmediate => "restart-immediate",
            Fault::PgbouncerRestart => "pgbouncer-restart",
            Fault::Promote => "promote",
            Fault::Switchover => "switchover",
            Fault::Failover => "failover",
            Fault::PostmasterKill => "postmaster-kill",
            Fault::NodeKill => "node-kill",
        }
    }

    /// Whether the fault hits the server (or the pooler) rather than one
    /// candidate: every leader's writes may fail while it lasts.
    pub(super) fn hits_the_server(self) -> bool {
        matches!(
            self,
            Fault::RestartFast | Fault::RestartImmediate | Fault::PgbouncerRestart | Fault::Promote
        ) || self.needs_manager()
    }

    /// Whether the fault is the HA manager's (a run under `--ha`): it
    /// hits the database, and with it every leader, until the formation
    /// has settled again.
    pub(super) fn needs_manager(self) -> bool {
        matches!(
            self,
            Fault::Switchover | Fault::Failover | Fault::PostmasterKill | Fault::NodeKill
        )
    }

    /// Whether writes must be acknowledged again within the bound after
    /// the fault, whether or not the term moved: the primary changed or
    /// restarted, and a lease leader may keep its term through that.
    pub(super) fn writes_must_resume(self) -> bool {
        self == Fault::Promote || self.needs_manager()
    }

    /// Whether the fault needs a primary with a replica (the third phase).
    pub(super) fn needs_replica(self) -> bool {
        self == Fault::Promote
    }

    /// Whether the fault acts for a while on the leader's supervisor, its
    /// worker or their connections, rather than on a term: until it is
    /// over, whatever leadership that node holds (a new one too: a starved
    /// or slowed standby still wins when the lock is free) is under it.
    pub(super) fn lasts_on_the_node(self) -> bool {
        matches!(
            self,
            Fault::Stop
                | Fault::Blackhole
                | Fault::Latency
                | Fault::Starve
                | Fault::ClockJump
                | Fault::Partition
                | Fault::PartitionNoPreempt
        )
    }

    /// Whether the fault needs candidates in network namespaces (the second
    /// phase).
    pub(super) fn needs_netns(self) -> bool {
        matches!(self, Fault::Partition | Fault::PartitionNoPreempt)
    }

    /// Whether the fault must end in a new term on `backend`: a delay may
    /// not, and a lease leader whose connection is terminated reconnects
    /// and renews within its deadline (it holds no lock on the connection).
    pub(super) fn must_fail_over(self, backend: BackendArg) -> bool {
        !matches!(
            (self, backend),
            (Fault::Latency | Fault::Starve | Fault::ClockJump, _)
                | (
                    Fault::Terminate
                        | Fault::RestartFast
                        | Fault::RestartImmediate
                        | Fault::PgbouncerRestart
                        | Fault::Promote
                        | Fault::Switchover
                        | Fault::Failover
                        | Fault::PostmasterKill
                        | Fault::NodeKill,
                    BackendArg::Lease
                )
        )
    }
}

/// Slack added to every bound: starting the worker process, connecting, and
/// a loaded machine (CI: 2 cores, four test binaries at once).
pub(super) const SLACK: Duration = Duration::from_secs(3);

/// A lease-backend standby's longest sleep between two attempts without a
/// LISTEN connection (the library's `retry_every` default).
pub(super) const RETRY_EVERY: Duration = Duration::from_secs(1);

/// A starved leader runs STARVE_ON of every STARVE_OFF + STARVE_ON.
const STARVE_ON: Duration = Duration::from_millis(1);
const STARVE_OFF: Duration = Duration::from_millis(9);

/// The longest a restart of the throwaway server may take (stop, crash
/// recovery, start) on a loaded machine.
pub(super) const RESTART: Duration = Duration::from_secs(10);

/// The longest a restart of chaos's own PgBouncer may take: the test kit
/// gives up (and chaos fails) when no query went through it within 10 s.
pub(super) const POOLER_RESTART: Duration = Duration::from_secs(10);

/// After a server restart, PgBouncer tries to log in to the server again
/// only `server_login_retry` later (1 s in chaos's own PgBouncer): a lease
/// candidate through it may wait that much more than one connecting
/// directly.
pub(super) const POOLER_LOGIN_RETRY: Duration = Duration::from_secs(1);

/// The longest a promotion may take on a loaded machine: the primary's
/// `pg_ctl stop -m immediate`, `pg_ctl promote`, and the first write the
/// new primary accepts (measured 0.1-0.2 s on this 2-core machine).
pub(super) const PROMOTE: Duration = Duration::from_secs(5);

/// The longest a candidate waits between two connection attempts: its
/// backoff doubles from 100 ms up to this (the library's reconnection
/// backoff). While the primary is down it may have grown this far.
pub(super) const RECONNECT_CAP: Duration = Duration::from_secs(5);

/// The longest an HA manager's fault may leave the formation without a
/// primary that accepts a write (`txid_current()` through a connection to
/// a data node, polled every 50 ms), on a loaded 2-core machine, with the
/// test kit's failure detection (health checks every second, a node
/// unhealthy after 2 s, `primary_demote_timeout` 4 s). A switchover or a
/// failover ordered by `pg_autoctl perform` returns once it is done; a
/// dead node is failed over once the monitor found it unhealthy and waited
/// for it to have demoted itself; a killed postmaster is restarted in
/// place by its keeper (or, if that outlasts the monitor's patience,
/// failed over). Measured figures: the book's chaos page.
pub(super) fn manager_outage(fault: Fault) -> Duration {
    match fault {
        Fault::Switchover | Fault::Failover => Duration::from_secs(MANAGER_PLANNED_S),
        Fault::PostmasterKill | Fault::NodeKill => Duration::from_secs(MANAGER_CRASH_S),
        _ => Duration::ZERO,
    }
}

/// [`manager_outage`] of an ordered switchover or failover, in seconds.
const MANAGER_PLANNED_S: u64 = 12;
/// [`manager_outage`] of a killed postmaster or node, in seconds.
const MANAGER_CRASH_S: u64 = 15;

/// The longest time from injecting `fault` on `backend` until the next
/// leader's worker acts: the mechanism's bound as the README states it,
/// plus [`SLACK`]. The one table of bounds; `max_gap_ms` is checked
/// against it.
pub(super) fn bound(
    fault: Fault,
    backend: BackendArg,
    t: &pgelect::election::TimingReport,
) -> Duration {
    use BackendArg::{Lease, Session};
    // When a lease leader's lease has surely expired on the server clock,
    // and a standby noticed (jitter at most 50 ms).
    let lease_gone = t.ttl + Duration::from_millis(50);
    let mechanism = match (fault, backend) {
        // The socket closes with the process (or the server ends it): the
        // lock is free at once; an unclean takeover waits the handover
        // delay.
        (Fault::Kill | Fault::KillMany | Fault::Terminate, Session) => t.handover_delay,
        (Fault::Kill | Fault::KillMany | Fault::Terminate, Lease) => lease_gone,
        // Planned: the leader releases; a lease standby without LISTEN
        // polls within retry_every.
        (Fault::Term, Session) => Duration::ZERO,
        (Fault::Term, Lease) => RETRY_EVERY,
        // The fault lasts 1.5 × ttl; then at the latest the old leader finds
        // its deadline passed and lets go (or was preempted before).
        (Fault::Stop | Fault::Blackhole | Fault::Latency | Fault::Starve | Fault::ClockJump, _) => {
            t.ttl * 3 / 2 + t.handover_delay + RETRY_EVERY
        }
        // The lease expires (ttl); a standby's observer preempts within its
        // next check, then the handover delay. A worker cut off inside a
        // fenced transaction holds the row until the server ends its
        // session (its idle_in_transaction_session_timeout, = ttl): the
        // term bump waits for that.
        (Fault::Partition, Session) => t.ttl * 3 + t.handover_delay,
        // Only the server's TCP timers free the lock: keepalives derived
        // from the ttl end a silent client within ttl + ttl/6 + 1 s (whole
        // seconds) or tcp_user_timeout (= ttl); then the handover delay.
        (Fault::PartitionNoPreempt, Session) => {
            t.ttl * 3 + Duration::from_secs(1) + t.handover_delay
        }
        (Fault::Partition | Fault::PartitionNoPreempt, Lease) => lease_gone + t.ttl,
        // Every connection ends; the server is back within RESTART (the
        // gap includes its downtime); candidates reconnect with backoff
        // (at most a second), and a session leader's successor waits the
        // handover delay.
        // Through a pooler (lease backend), PgBouncer's login retry more.
        (Fault::RestartFast | Fault::RestartImmediate, Session) => {
            RESTART + RETRY_EVERY + t.handover_delay
        }
        (Fault::RestartFast | Fault::RestartImmediate, Lease) => {
            RESTART + POOLER_LOGIN_RETRY + RETRY_EVERY + t.handover_delay
        }
        // Every connection through the pooler ends; it is back within
        // POOLER_RESTART. The leader may renew then and keep its term;
        // otherwise its lease expires a ttl after its last renewal at the
        // latest, and a standby retries within retry_every of the later of
        // the two. (Session backend: never through a pooler, skipped; the
        // same bound.)
        (Fault::PgbouncerRestart, _) => {
            POOLER_RESTART.max(lease_gone) + RETRY_EVERY + t.handover_delay
        }
        // Every connection ends with the primary; the replica accepts
        // writes within PROMOTE; candidates find it on their next attempt
        // (backoff: at most RECONNECT_CAP later) and the session leader's
        // successor waits the handover delay (the row names the dead
        // holder). A lease leader renews on the new primary (its row was
        // replicated); otherwise the first standby on the new primary
        // re-arms the lease row written before the promotion for a ttl
        // (asynchronous replication may have lost the last renewals) and
        // takes it over when that ends, retrying within retry_every.
        // Through PgBouncer (lease backend, where installed) in front of
        // the primary address, which chaos re-points once the promotion is
        // done: PgBouncer's logins fail until then, and after a failed one
        // it refuses its clients ("server login has been failing") and
        // tries again only server_login_retry later (POOLER_LOGIN_RETRY,
        // 1 s in the kit's ini). The last failed login may come just before
        // the re-pointing, so the candidates reach the new primary at most
        // that much later than directly. A login to the dead primary never
        // waits on server_connect_timeout (the kit's ini leaves PgBouncer's
        // 15 s default): the front accepts and closes at once, its own
        // connection refused on loopback. As for restarts, the lease
        // backend's bound covers its pooled path (1 s more when direct).
        (Fault::Promote, Session) => PROMOTE + RECONNECT_CAP + t.handover_delay,
        (Fault::Promote, Lease) => {
            PROMOTE
                + POOLER_LOGIN_RETRY
                + RECONNECT_CAP
                + lease_gone
                + RETRY_EVERY
                + t.handover_delay
        }
        // Under the HA manager: as a promotion, the manager's outage in
        // place of PROMOTE, and no pooler (the candidates connect to the
        // data nodes directly). Replication is synchronous, so the lease
        // row on the new primary is the last one renewed.
        (
            Fault::Switchover | Fault::Failover | Fault::PostmasterKill | Fault::NodeKill,
            Session,
        ) => manager_outage(fault) + RECONNECT_CAP + t.handover_delay,
        (Fault::Switchover | Fault::Failover | Fault::PostmasterKill | Fault::NodeKill, Lease) => {
            manager_outage(fault) + RECONNECT_CAP + lease_gone + RETRY_EVERY + t.handover_delay
        }
    };
    mechanism + SLACK
}

/// How long after their last look at the group members of a partition
/// group may take to stand for a partition that became unled, and to
/// take it: a quiet member reads the group every 4 × `rebalance_every` at
/// most (1 s: the library's default, which `pgelect run` keeps), one more
/// read at the busy pace (a joining member, the replacement of one killed,
/// unsettles the snapshot: no new standby until the next read), and the
/// new standby's first look within `poll_interval` (1 s).
pub(super) const REBALANCE_MARGIN: Duration = Duration::from_secs(4 + 1 + 1);

/// The `--grace` chaos gives its supervisors: a command stopped for a
/// handover gets SIGKILL this long after SIGTERM.
pub(super) const GRACE: Duration = Duration::from_secs(1);

/// In a partition-group run, the longest time from injecting `fault` until
/// every partition it hit is led again (a worker of a newer term started,
/// or, after a pooler restart that let a leader keep its term, that
/// partition's next acknowledged fenced write): the mechanism plus
/// [`REBALANCE_MARGIN`] and [`SLACK`]. `write_every`: the period of a
/// worker's fenced writes.
pub(super) fn group_bound(
    fault: Fault,
    t: &pgelect::election::TimingReport,
    write_every: Duration,
) -> Duration {
    let lease_gone = t.ttl + Duration::from_millis(50);
    let mechanism = match fault {
        // The members' leases expire a ttl after their last renewal (a
        // paused worker inside a fenced transaction holds its row until
        // the server ends the session, idle_in_transaction = ttl, in the
        // same time); their registrations are no longer fresh by then.
        Fault::Kill | Fault::KillMany | Fault::Stop => lease_gone,
        // The member stops its commands (SIGKILL after GRACE) and releases
        // with NOTIFY: the others read the group at once (or, NOTIFY
        // missed, at their next read).
        Fault::Term => GRACE,
        // The pooler is back within POOLER_RESTART; a leader that could not
        // renew meanwhile has lost by lease_gone; a leader that kept its
        // term shows it at its next write.
        Fault::PgbouncerRestart => POOLER_RESTART.max(lease_gone) + write_every,
        // Not drawn in a partition-group run (reported skipped): the one
        // role's lease bound, never checked.
        other => return bound(other, BackendArg::Lease, t),
    };
    mechanism + REBALANCE_MARGIN + SLACK
}

/// Why `kill-many` is skipped in a run of one role.
pub(super) const KILL_MANY_NEEDS_GROUP: &str =
    "one role has one leader: several members killed at once is the partition-group run's fault (--partitions)";

/// What injecting a fault left to know.
#[derive(Default)]
pub(super) struct Effect {
    /// For a pause: the frozen leaders were continued.
    pub(super) paused: bool,
    /// For a promotion: see [`Injected::unreplicated`].
    pub(super) unreplicated: Option<(u128, u128)>,
    /// For a fault that replaced or restarted the primary: writes must be
    /// acknowledged again within the bound, counting those after this
    /// time (the primary's death; under the manager, the moment a primary
    /// accepted a write again).
    pub(super) resume_after: Option<u128>,
    /// Under the manager: when a primary accepted a write again.
    pub(super) writable: Option<u128>,
    /// Under the manager: see [`Injected::unsynchronized`](super::schedule::Injected::unsynchronized).
    pub(super) unsynchronized: Option<super::ha::Unsynchronized>,
    /// When the fault was over (the formation settled again), if later
    /// than its injection.
    pub(super) ended: Option<u128>,
    /// Why the fault could not run here.
    pub(super) skipped: Option<String>,
    /// The next leader's start, for faults that last until the next leader
    /// acts (and so find it themselves).
    pub(super) found: Option<Option<Event>>,
}

/// Injects `fault` on the leader (the worker `leader` of supervisor
/// `sups[i]`) and, where the fault has a duration, waits it out and ends
/// it. A supervisor killed or terminated is replaced by a new one.
/// `durable`: for a promotion, since when the replica has everything
/// acknowledged.
// Eight arguments, one call site: a struct of them would only name them
// again.
#[allow(clippy::too_many_arguments)]
pub(super) async fn inject(
    fault: Fault,
    run: &mut Run<'_>,
    sups: &mut Vec<Supervisor>,
    i: usize,
    leader: &Event,
    timing: &pgelect::election::TimingReport,
    rng: &mut StdRng,
    durable: Option<u128>,
) -> Result<Effect, Failure> {
    let args = run.args;
    let admin = run.admin;
    let mut effect = Effect::default();
    match fault {
        Fault::Kill => {
            let mut s = sups.remove(i);
            let _ = s.child.start_kill();
            let _ = s.child.wait().await;
            run.retire(s);
            sups.push(run.spawn().await?);
        }
        Fault::KillMany => effect.skipped = Some(KILL_MANY_NEEDS_GROUP.to_owned()),
        Fault::Term => {
            let mut s = sups.remove(i);
            signal(s.child.id(), nix::sys::signal::Signal::SIGTERM);
            if tokio::time::timeout(Duration::from_secs(15), s.child.wait())
                .await
                .is_err()
            {
                let _ = s.child.start_kill();
            }
            run.retire(s);
            sups.push(run.spawn().await?);
        }
        Fault::Stop => {
            let sup = sups[i].child.id();
            signal(sup, nix::sys::signal::Signal::SIGSTOP);
            signal(Some(leader.pid), nix::sys::signal::Signal::SIGSTOP);
            tokio::time::sleep(args.ttl * 3 / 2).await;
            signal(sup, nix::sys::signal::Signal::SIGCONT);
            signal(Some(leader.pid), nix::sys::signal::Signal::SIGCONT);
            effect.paused = true;
        }
        Fault::Blackhole | Fault::Latency => match &sups[i].proxies[..] {
            [] => {
                effect.skipped =
                    Some("the URL is not a single-host postgres:// URL: no proxy".to_owned())
            }
            proxies => {
                // One draw, as before there were two proxies: a seed
                // replays the same schedule.
                let delay = (fault == Fault::Latency).then(|| {
                    let t = timing.heartbeat_timeout;
                    let lo = (t / 4).as_millis() as u64;
                    let hi = (t * 2).as_millis() as u64;
                    Duration::from_millis(rng.random_range(lo..=hi))
                });
                for p in proxies {
                    match delay {
                        None => p.blackhole(),
                        Some(d) => p.delay(d),
                    }
                }
                tokio::time::sleep(args.ttl * 3 / 2).await;
                for p in proxies {
                    p.heal();
                    p.delay(Duration::ZERO);
                }
            }
        },
        Fault::Terminate => {
            match terminate_backends(&*admin.get().await?, &run.role, &leader.node).await {
                Ok(0) => effect.skipped = Some("no backend of the leader found".to_owned()),
                Ok(_) => {}
                Err(e) => effect.skipped = Some(format!("pg_terminate_backend refused: {e}")),
            }
        }
        Fault::Starve => {
            // SIGSTOP/SIGCONT duty cycle rather than cgroup cpu.max:
            // it needs no root nor a delegated cgroup, and touches
            // exactly these two processes.
            let pids = [sups[i].child.id(), Some(leader.pid)];
            let until = Instant::now() + args.ttl * 3 / 2;
            while Instant::now() < until {
                for p in pids {
                    signal(p, nix::sys::signal::Signal::SIGSTOP);
                }
                tokio::time::sleep(STARVE_OFF).await;
                for p in pids {
                    signal(p, nix::sys::signal::Signal::SIGCONT);
                }
                tokio::time::sleep(STARVE_ON).await;
            }
            for p in pids {
                signal(p, nix::sys::signal::Signal::SIGCONT);
            }
        }
        Fault::ClockJump => match &sups[i].clock {
            None if args.python.is_some() => {
                effect.skipped = Some(
                    "not with Python candidates: libfaketime would fake their log's clock too"
                        .to_owned(),
                )
            }
            None => {
                effect.skipped = Some(
                    "libfaketime is not installed (Debian: apt-get install faketime)".to_owned(),
                )
            }
            Some(file) => {
                let offset = if rng.random_bool(0.5) {
                    "+3600"
                } else {
                    "-3600"
                };
                let set = |o: &str| {
                    std::fs::write(file, format!("{o}\n"))
                        .map_err(|e| fail(format!("cannot write {}: {e}", file.display())))
                };
                set(offset)?;
                tokio::time::sleep(args.ttl * 3 / 2).await;
                set("+0")?;
            }
        },
        Fault::RestartFast | Fault::RestartImmediate => match run.server {
            None => {
                effect.skipped = Some(
                    "restarts need the throwaway server: run without --database-url".to_owned(),
                )
            }
            Some(server) => {
                server.restart(fault == Fault::RestartImmediate)?;
                effect.ended = Some(now_ns());
            }
        },
        Fault::Promote => match (run.replicas.as_deref_mut(), durable) {
            (Some(pair), Some(durable)) => {
                let (died, took) = pair.promote()?;
                effect.unreplicated = Some((durable, died));
                effect.resume_after = Some(died);
                println!(
                    "  (primary killed, replica promoted: accepted a write {:.1} ms after the death)",
                    took.as_secs_f64() * 1e3
                );
            }
            _ => effect.skipped = Some(PROMOTE_NEEDS_THROWAWAY.to_owned()),
        },
        Fault::Switchover | Fault::Failover | Fault::PostmasterKill | Fault::NodeKill => {
            match run.manager.as_deref_mut() {
                None => effect.skipped = Some(super::ha::NEEDS_MANAGER.to_owned()),
                Some(formation) => match formation.inject(fault).await? {
                    Ok(after) => {
                        effect.resume_after = Some(after.writable);
                        effect.writable = Some(after.writable);
                        effect.ended = Some(after.settled);
                        effect.unsynchronized = after.unsynchronized;
                    }
                    Err(refused) => {
                        effect.skipped = Some(refused.why);
                        effect.ended = Some(refused.settled);
                    }
                },
            }
        }
        Fault::PgbouncerRestart => match &run.pooler {
            Err(why) => effect.skipped = Some(why.clone()),
            Ok(p) => match p.not_restartable() {
                Some(why) => effect.skipped = Some(why),
                None => p.restart().await?,
            },
        },
        Fault::Partition | Fault::PartitionNoPreempt => {
            match (run.net.as_deref(), sups[i].ns.as_ref()) {
                (Some(netted), Some(ns)) => {
                    let nopreempt = fault == Fault::PartitionNoPreempt;
                    if nopreempt {
                        netted.set_preempt(admin, false).await?;
                    }
                    let cut = netted.net.set_cut(ns, true);
                    // Cut off until a new leader acts (bounded):
                    // the old one must be freed by timers alone.
                    let next = match &cut {
                        Ok(()) => {
                            run.next_start(leader.term, leader.at, Duration::from_secs(60))
                                .await
                        }
                        Err(_) => None,
                    };
                    let healed = netted.net.set_cut(ns, false);
                    if nopreempt {
                        netted.set_preempt(admin, true).await?;
                    }
                    cut.and(healed)
                        .map_err(|e| fail(format!("partition: {e}")))?;
                    effect.found = Some(next);
                }
                _ => effect.skipped = Some("the candidates are not in network namespaces".into()),
            }
        }
    }
    if fault.lasts_on_the_node() && effect.skipped.is_none() {
        effect.ended.get_or_insert_with(now_ns);
    }
    Ok(effect)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::args::standard_timing as standard;

    #[test]
    fn every_fault_has_a_bound_above_the_slack_and_partitions_wait_longest() {
        for backend in [BackendArg::Session, BackendArg::Lease] {
            let t = standard(backend);
            for f in <Fault as ValueEnum>::value_variants() {
                let b = bound(*f, backend, &t);
                assert!(
                    b >= SLACK && b < Duration::from_secs(30),
                    "{f:?} {backend:?}: {b:?}"
                );
            }
            assert!(
                bound(Fault::PartitionNoPreempt, backend, &t) >= bound(Fault::Kill, backend, &t)
            );
        }
        // Without preemption, only the server's TCP timers (at least the
        // ttl) free a session leader's lock.
        let t = standard(BackendArg::Session);
        assert!(
            bound(Fault::PartitionNoPreempt, BackendArg::Session, &t)
                >= t.ttl + t.handover_delay + SLACK
        );
    }

    #[test]
    fn a_managers_fault_is_bounded_by_its_outage_plus_the_backends_bound_after_a_promotion() {
        // Under the HA manager: the manager's outage, then the backend's
        // bound as after a promotion (without the pooler's login retry).
        for backend in [BackendArg::Session, BackendArg::Lease] {
            let t = standard(backend);
            let pooler = match backend {
                BackendArg::Lease => POOLER_LOGIN_RETRY,
                BackendArg::Session => Duration::ZERO,
            };
            for f in [
                Fault::Switchover,
                Fault::Failover,
                Fault::PostmasterKill,
                Fault::NodeKill,
            ] {
                let b = bound(f, backend, &t);
                assert!(
                    b >= manager_outage(f) + RECONNECT_CAP + SLACK,
                    "{f:?} {backend:?}: {b:?}"
                );
                assert_eq!(
                    b - manager_outage(f),
                    bound(Fault::Promote, backend, &t) - PROMOTE - pooler,
                    "{f:?} {backend:?}"
                );
                assert!(f.writes_must_resume() && f.needs_manager());
                assert_eq!(f.must_fail_over(backend), backend == BackendArg::Session);
            }
        }
    }
}
