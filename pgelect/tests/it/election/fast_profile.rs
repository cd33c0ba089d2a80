//! The fast timing profile (`Profile::Fast`: heartbeats every 20 ms, a
//! 25 ms heartbeat timeout, a 70 ms handover delay) under faults, with three
//! candidates each: the leader's process SIGKILLed, its backend terminated,
//! its connection blackholed, the database restarted, and the leader's
//! process frozen (SIGSTOP), preempted and fenced.
//!
//! Every candidate's acting intervals go into one log on this process's
//! clock, and each test asserts that no two overlap, that terms rise, and
//! that after the fault a leader with a higher term acts. The failover
//! times are printed, not asserted: with a 25 ms heartbeat timeout on a
//! loaded machine a healthy leader may lose its leadership now and then
//! (safely), so these tests assert safety and eventual progress with
//! generous bounds, never that a leader stays or how fast a successor
//! comes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pgelect::{election::Profile, ConnectOptions, Elector, ElectorBuilder, Term};
use pgelect_testkit::{Cluster, FaultProxy, TestDb};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::support;
use support::{migrated, Candidate, Intervals};

/// A short TTL, so that a partition or a freeze resolves in seconds.
const TTL: Duration = Duration::from_secs(2);
const TTL_MS: &str = "2000";

/// The bound on eventual progress after a fault (generous: the machine is
/// shared and a debug build is slow).
const PROGRESS: Duration = Duration::from_secs(60);

fn fast_profile(o: &ConnectOptions, role: &str, node: &str) -> ElectorBuilder {
    Elector::builder(o.clone(), role)
        .node_id(node)
        .profile(Profile::Fast)
        .ttl(TTL)
}

/// The instant on this process's monotonic clock of a Unix time in
/// milliseconds printed by a candidate process, widened by `widen` (a
/// negative widening for a start, positive for an end) to cover the
/// millisecond truncation on both sides.
fn instant_of_unix_ms(ms: u128, widen: i64) -> Instant {
    let now = Instant::now();
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_millis() as i128;
    let delta = ms as i128 + widen as i128 - now_ms;
    if delta >= 0 {
        now + Duration::from_millis(delta as u64)
    } else {
        now - Duration::from_millis((-delta) as u64)
    }
}

/// Who acts as leader, and when: every candidate's acting intervals (in
/// this process or another), and a signal on every change so that tests
/// await a new leader instead of sleeping.
#[derive(Clone)]
struct Acting {
    log: Intervals,
    /// Node -> its open interval in `log`.
    open: Arc<Mutex<HashMap<String, usize>>>,
    /// Node -> the moment it was frozen: an interval open then ends then
    /// (see the freeze test).
    frozen: Arc<Mutex<HashMap<String, Instant>>>,
    /// Node -> the last `LOST` line its process printed.
    lost_lines: Arc<Mutex<HashMap<String, String>>>,
    changed: Arc<watch::Sender<()>>,
}

impl Acting {
    fn new() -> Acting {
        Acting {
            log: Intervals::default(),
            open: Arc::default(),
            frozen: Arc::default(),
            lost_lines: Arc::default(),
            changed: Arc::new(watch::channel(()).0),
        }
    }

    fn begin(&self, node: &str, term: Term, at: Instant) {
        let i = self.log.start_at(node, term, at);
        // A second open interval of one node would show up in
        // `assert_disjoint` as one that never ended.
        self.open.lock().unwrap().insert(node.to_owned(), i);
        self.changed.send_replace(());
    }

    /// Ends `node`'s open interval at `at` (or when it was frozen, if
    /// that is earlier); false if it had none.
    fn end(&self, node: &str, at: Instant) -> bool {
        let Some(i) = self.open.lock().unwrap().remove(node) else {
            return false;
        };
        let at = match self.frozen.lock().unwrap().get(node) {
            Some(&f) if self.log.0.lock().unwrap()[i].2 < f => at.min(f),
            _ => at,
        };
        self.log.end_at(i, at);
        self.changed.send_replace(());
        true
    }

    /// The node acting now with the highest term, as far as reported.
    fn leader(&self) -> Option<(String, Term)> {
        self.log
            .open()
            .into_iter()
            .map(|x| (x.0, x.1))
            .max_by_key(|x| x.1)
    }

    /// Waits for a node to act with a term above `term` and returns the
    /// first such node, its term and when it began acting.
    async fn leader_above(&self, term: Term, within: Duration) -> (String, Term, Instant) {
        let mut rx = self.changed.subscribe();
        let wait = async {
            loop {
                rx.borrow_and_update();
                let found = self
                    .log
                    .0
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|x| x.1 > term)
                    .min_by_key(|x| x.1)
                    .map(|x| (x.0.clone(), x.1, x.2));
                if let Some(found) = found {
                    return found;
                }
                rx.changed().await.expect("BUG: the sender lives in self");
            }
        };
        tokio::time::timeout(within, wait)
            .await
            .unwrap_or_else(|_| panic!("no leader above term {term} within {within:?}"))
    }

    /// Waits until `node`'s leadership of `term` has ended and returns when
    /// it ended.
    async fn ended(&self, node: &str, term: Term, within: Duration) -> Instant {
        let mut rx = self.changed.subscribe();
        let wait = async {
            loop {
                rx.borrow_and_update();
                let end = self
                    .log
                    .0
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|x| x.0 == node && x.1 == term)
                    .and_then(|x| x.3);
                if let Some(end) = end {
                    return end;
                }
                rx.changed().await.expect("BUG: the sender lives in self");
            }
        };
        tokio::time::timeout(within, wait)
            .await
            .unwrap_or_else(|_| panic!("{node}'s term {term} did not end within {within:?}"))
    }

    /// Waits until some node acts and returns it.
    async fn current_leader(&self) -> (String, Term) {
        let mut rx = self.changed.subscribe();
        let wait = async {
            loop {
                rx.borrow_and_update();
                if let Some(l) = self.leader() {
                    return l;
                }
                rx.changed().await.expect("BUG: the sender lives in self");
            }
        };
        tokio::time::timeout(PROGRESS, wait)
            .await
            .expect("a leader within the progress bound")
    }

    /// How many leaderships were recorded, and a summary for the output.
    fn summary(&self) -> String {
        let v = self.log.0.lock().unwrap();
        let terms: Vec<String> = v.iter().map(|x| format!("{}:{}", x.0, x.1)).collect();
        format!("{} leaderships ({})", v.len(), terms.join(", "))
    }
}

/// A candidate in this process: stands, acts until it loses, stands again,
/// until `stop`; records each leadership in `acting`.
fn stand(e: Elector, acting: Acting, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let node = e.node_id().to_owned();
        loop {
            let l = tokio::select! {
                _ = stop.cancelled() => return,
                l = e.leadership() => l,
            };
            let l = match l {
                Ok(l) => l,
                Err(err) => {
                    // Not expected (connection trouble is retried inside),
                    // but not a safety matter either: stand again.
                    println!("{node}: campaign failed: {err}");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    }
                }
            };
            acting.begin(&node, l.term(), Instant::now());
            tokio::select! {
                _ = l.lost() => {
                    acting.end(&node, l.lost_at().expect("lost"));
                    let _ = l.resign().await;
                }
                _ = stop.cancelled() => {
                    acting.end(&node, Instant::now());
                    let _ = l.resign().await;
                    return;
                }
            }
        }
    })
}

/// Stops the candidates of this process and waits for them.
async fn stop_all(stop: &CancellationToken, tasks: Vec<tokio::task::JoinHandle<()>>) {
    stop.cancel();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("a candidate stops")
            .unwrap();
    }
}

/// A candidate process with the fast profile whose `ELECTED` and `LOST` /
/// `RESIGNED` lines go into `acting` with the times it printed.
fn spawn_process(url: &str, role: &str, node: &str, acting: &Acting) -> Candidate {
    let acting = acting.clone();
    let name = node.to_owned();
    Candidate::spawn_with(
        &["--profile", "fast", url, role, TTL_MS, node],
        move |line| {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["ELECTED", term, ms] => acting.begin(
                    &name,
                    Term::new(term.parse().expect("a term")),
                    instant_of_unix_ms(ms.parse().expect("unix ms"), -1),
                ),
                ["LOST" | "RESIGNED", _, ms] => {
                    if line.starts_with("LOST") {
                        acting
                            .lost_lines
                            .lock()
                            .unwrap()
                            .insert(name.clone(), line.to_owned());
                    }
                    acting.end(&name, instant_of_unix_ms(ms.parse().expect("unix ms"), 1));
                }
                _ => {}
            }
        },
    )
}

/// Kills the candidate processes left, closes what they were acting at
/// the kill, and asserts the whole log.
fn kill_processes_and_check(acting: &Acting, procs: Vec<(String, Candidate)>) {
    for (node, mut p) in procs {
        p.signal("-KILL");
        let at = Instant::now();
        tokio::task::block_in_place(|| p.wait_exit());
        acting.end(&node, at);
    }
    println!("{}", acting.summary());
    acting.log.assert_disjoint();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_fast_leader_process_is_followed_by_a_higher_term() {
    let (db, o) = migrated("fast_kill").await;
    let timing = fast_profile(&o, "kill", "probe").build().unwrap().timing();
    assert_eq!(timing.handover_delay, Duration::from_millis(70));
    let acting = Acting::new();
    let mut procs: Vec<(String, Candidate)> = (0..3)
        .map(|n| {
            let node = format!("p{n}");
            let c = spawn_process(&db.url(), "kill", &node, &acting);
            (node, c)
        })
        .collect();
    // Two rounds: three processes, then two.
    for round in 0..2 {
        acting.current_leader().await;
        db.wait_for_advisory_waiters(procs.len() as i64 - 1).await;
        let (victim, old) = acting.current_leader().await;
        let at = procs.iter().position(|(n, _)| *n == victim).unwrap();
        let (_, mut killed) = procs.remove(at);
        let t0 = Instant::now();
        killed.signal("-KILL");
        let killed_at = Instant::now();
        tokio::task::block_in_place(|| killed.wait_exit());
        // A dead process acts no more: its leadership, if it still had
        // one, ended at the kill.
        let was_leading = acting.end(&victim, killed_at);
        let (next, new, began) = acting.leader_above(old, PROGRESS).await;
        assert_ne!(next, victim, "a dead process leads");
        assert!(new > old);
        if was_leading {
            println!(
                "round {round}: SIGKILLed fast leader {victim} (term {old}): {next} acts with term {new} {:?} after the kill (handover delay {:?})",
                began.saturating_duration_since(t0),
                timing.handover_delay
            );
        } else {
            println!("round {round}: {victim} had already lost term {old} before the kill; {next} leads with term {new}: no failover time");
        }
    }
    kill_processes_and_check(&acting, procs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_fast_leader_backend_is_followed_by_a_higher_term() {
    let (db, o) = migrated("fast_terminate").await;
    let acting = Acting::new();
    let stop = CancellationToken::new();
    let tasks: Vec<_> = (0..3)
        .map(|n| {
            let e = fast_profile(&o, "term", &format!("n{n}")).build().unwrap();
            stand(e, acting.clone(), stop.clone())
        })
        .collect();
    let admin = db.connect().await;
    for round in 0..3 {
        acting.current_leader().await;
        db.wait_for_advisory_waiters(2).await;
        // The lock connection of whoever holds the term now.
        let row = admin
            .query_typed_one(
                "SELECT holder, holder_pid, term FROM pgelect.leaders WHERE role = 'term'",
                &[],
            )
            .await
            .unwrap();
        let (holder, pid, old): (String, i32, i64) = (row.get(0), row.get(1), row.get(2));
        let old = Term::new(old);
        let t0 = Instant::now();
        admin
            .query_typed(
                "SELECT pg_terminate_backend($1)",
                &[(&pid, tokio_postgres::types::Type::INT4)],
            )
            .await
            .unwrap();
        let (next, new, began) = acting.leader_above(old, PROGRESS).await;
        assert!(new > old);
        println!(
            "round {round}: terminated backend of fast leader {holder} (term {old}): {next} acts with term {new} {:?} after pg_terminate_backend",
            began.saturating_duration_since(t0)
        );
    }
    stop_all(&stop, tasks).await;
    println!("{}", acting.summary());
    acting.log.assert_disjoint();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_fast_leader_is_followed_by_a_higher_term() {
    let (db, _) = migrated("fast_blackhole").await;
    let acting = Acting::new();
    let stop = CancellationToken::new();
    // A proxy per candidate, so whoever leads can be cut off alone.
    let mut proxies = HashMap::new();
    let mut tasks = Vec::new();
    for n in 0..3 {
        let node = format!("n{n}");
        let proxy = FaultProxy::start(db.server_addr()).unwrap();
        let via = ConnectOptions::from_config(db.config_via(proxy.port()));
        let e = fast_profile(&via, "bh", &node).build().unwrap();
        tasks.push(stand(e, acting.clone(), stop.clone()));
        proxies.insert(node, proxy);
    }
    // Two rounds: the partitioned node comes back after the heal.
    for round in 0..2 {
        acting.current_leader().await;
        db.wait_for_advisory_waiters(2).await;
        let (victim, old) = acting.current_leader().await;
        let t0 = Instant::now();
        proxies[&victim].blackhole();
        let (next, new, began) = acting.leader_above(old, PROGRESS).await;
        assert!(new > old);
        assert_ne!(next, victim, "a partitioned node leads");
        let demoted = acting.ended(&victim, old, PROGRESS).await;
        println!(
            "round {round}: blackholed fast leader {victim} (term {old}): demoted after {:?}, {next} acts with term {new} {:?} after the partition (ttl {TTL:?})",
            demoted.saturating_duration_since(t0),
            began.saturating_duration_since(t0)
        );
        proxies[&victim].heal();
    }
    stop_all(&stop, tasks).await;
    println!("{}", acting.summary());
    acting.log.assert_disjoint();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_restart_under_the_fast_profile_is_followed_by_a_higher_term() {
    if pgelect_testkit::skip_without_own_server("database_restart_under_the_fast_profile") {
        return;
    }
    let cluster = Cluster::start().unwrap();
    let db = TestDb::on(&cluster, "fast_restart").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&o).await.unwrap();
    let acting = Acting::new();
    let stop = CancellationToken::new();
    let tasks: Vec<_> = (0..3)
        .map(|n| {
            let e = fast_profile(&o, "restart", &format!("n{n}"))
                .build()
                .unwrap();
            stand(e, acting.clone(), stop.clone())
        })
        .collect();
    for round in 0..2 {
        acting.current_leader().await;
        db.wait_for_advisory_waiters(2).await;
        let (before, old) = acting.current_leader().await;
        let t0 = Instant::now();
        tokio::task::block_in_place(|| cluster.restart()).unwrap();
        let restarted = t0.elapsed();
        let (next, new, began) = acting.leader_above(old, PROGRESS).await;
        assert!(new > old);
        println!(
            "round {round}: database restart ({restarted:?}) under fast leader {before} (term {old}): {next} acts with term {new} {:?} after the restart began",
            began.saturating_duration_since(t0)
        );
    }
    stop_all(&stop, tasks).await;
    println!("{}", acting.summary());
    acting.log.assert_disjoint();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_fast_leader_is_preempted_fenced_and_told_when_thawed() {
    // The candidates connect as the superuser: a standby may preempt a
    // leader whose lease expired (pg_terminate_backend).
    let (db, _) = migrated("fast_frozen").await;
    let acting = Acting::new();
    let procs: Vec<(String, Candidate)> = (0..3)
        .map(|n| {
            let node = format!("p{n}");
            let c = spawn_process(&db.url(), "frozen", &node, &acting);
            (node, c)
        })
        .collect();
    acting.current_leader().await;
    db.wait_for_advisory_waiters(2).await;
    let (victim, old) = acting.current_leader().await;
    let frozen = &procs.iter().find(|(n, _)| *n == victim).unwrap().1;
    let t0 = Instant::now();
    frozen.signal("-STOP");
    // A stopped process executes nothing: the leadership it held ends here
    // as far as acting goes. What it might do once thawed, before it learns
    // of its loss, is what the fence is for (asserted below), so the
    // interval is clipped at the freeze rather than left open until the
    // LOST line it prints after the thaw.
    acting.frozen.lock().unwrap().insert(victim.clone(), t0);
    let (next, new, began) = acting.leader_above(old, PROGRESS).await;
    assert!(new > old);
    assert_ne!(next, victim, "a frozen process leads");
    println!(
        "frozen fast leader {victim} (term {old}): {next} preempted it and acts with term {new} {:?} after SIGSTOP (ttl {TTL:?})",
        began.saturating_duration_since(t0)
    );
    // The frozen leader's term is fenced off.
    let client = db.connect().await;
    client.batch_execute("BEGIN").await.unwrap();
    let r = client
        .query_typed(
            "SELECT pgelect.fence('frozen', $1)",
            &[(&old.get(), tokio_postgres::types::Type::INT8)],
        )
        .await;
    client.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        r.unwrap_err().code().unwrap().code(),
        pgelect::schema::SQLSTATE_STALE_TERM
    );
    // Thawed, it reports the loss of that term (its LOST line ends the
    // interval, which stays clipped at the freeze).
    let t1 = Instant::now();
    frozen.signal("-CONT");
    acting.ended(&victim, old, PROGRESS).await;
    println!(
        "thawed {victim}: {:?} within {:?} after SIGCONT",
        acting.lost_lines.lock().unwrap().get(&victim),
        t1.elapsed()
    );
    kill_processes_and_check(&acting, procs);
}
