//! Semaphores ([`Semaphore`], [`Permit`]) against a real PostgreSQL: never
//! more than N holders (among many tasks, and with holder processes
//! SIGKILLed), waiters served in order of arrival, bounded waits, bad input.
//!
//! Every test gets its own database on the per-process test cluster. The
//! holder count is checked twice: by the holders themselves, and by a
//! sampler reading `pg_locks` (one consistent snapshot of the lock manager
//! per read) for the whole test. Timings are printed (`--nocapture`).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pgelect::{lock::Semaphore, ConnectOptions, Error, LockKey, LockSession};
use tokio_postgres::Client;

use crate::support::database as setup;
use pgelect::lock::Wait;

/// Granted slot locks of `semaphore`, as one `pg_locks` snapshot counts them.
async fn slots_held(admin: &Client, semaphore: &Semaphore) -> i64 {
    // A few slots beyond the limit too: none of them may ever be held.
    let wide = Semaphore::new(semaphore.name(), semaphore.limit() + 4).unwrap();
    let keys: Vec<i64> = (0..wide.limit())
        .filter_map(|i| wide.slot_key(i))
        .map(|k| match k {
            LockKey::Single(v) => v,
            LockKey::Pair(..) => unreachable!("slot keys are bigint keys"),
        })
        .collect();
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks l
              WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
                AND ((l.classid::int8 << 32) | l.objid::int8) = ANY($1)",
            &[&keys],
        )
        .await
        .unwrap()
        .get(0)
}

/// Reads `pg_locks` in a loop until stopped; returns the most slots seen
/// held at once and the number of reads.
fn sample_holders(
    admin: Client,
    semaphore: Semaphore,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(i64, u64)> {
    tokio::spawn(async move {
        let (mut most, mut reads) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            most = most.max(slots_held(&admin, &semaphore).await);
            reads += 1;
        }
        (most, reads)
    })
}

/// True while `pid` holds `key` (granted).
async fn holds(admin: &Client, pid: i32, key: LockKey) -> bool {
    let LockKey::Single(k) = key else {
        unreachable!()
    };
    admin
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory'
                AND l.granted AND l.pid = $1 AND l.objsubid = 1
                AND ((l.classid::int8 << 32) | l.objid::int8) = $2)",
            &[&pid, &k],
        )
        .await
        .unwrap()
        .get(0)
}

/// Waits (polling `pg_locks`: a server-side event with no client signal)
/// until `pid` holds `key`; panics after 30 s.
async fn await_holds(admin: &Client, pid: i32, key: LockKey) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !holds(admin, pid, key).await {
        assert!(Instant::now() < deadline, "backend {pid} never took {key}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Advisory locks (granted or not) of backend `pid`.
async fn advisory_locks_of(admin: &Client, pid: i32) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
            &[&pid],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn permits_up_to_the_limit_then_none_until_one_is_released() {
    let (_db, options, admin) = setup("sem_basic").await;
    let sem = Semaphore::new("uploads", 2).unwrap();
    let a = LockSession::connect(&options).await.unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let c = LockSession::connect(&options).await.unwrap();

    let pa = a
        .acquire_permit(&sem, Wait::Never)
        .await
        .unwrap()
        .expect("a free permit");
    let pb = b
        .acquire_permit(&sem, Wait::Never)
        .await
        .unwrap()
        .expect("a free permit");
    assert_ne!(
        pa.slot(),
        pb.slot(),
        "holders at one time hold distinct slots"
    );
    assert!(c.acquire_permit(&sem, Wait::Never).await.unwrap().is_none());

    let mut holders = c.permit_holders(&sem).await.unwrap();
    holders.sort_by_key(|h| h.slot);
    let pids: Vec<i32> = holders.iter().map(|h| h.holder.pid).collect();
    assert_eq!(pids.len(), 2, "{holders:?}");
    assert!(pids.contains(&a.backend_pid()) && pids.contains(&b.backend_pid()));
    assert_eq!(
        pgelect::admin::semaphore_holders(&admin, &sem)
            .await
            .unwrap()
            .len(),
        2
    );

    assert!(
        pa.release().await.unwrap(),
        "postgres held and released the slot"
    );
    let pc = c
        .acquire_permit(&sem, Wait::Never)
        .await
        .unwrap()
        .expect("free after release");
    // One session may hold several permits of a semaphore.
    let pc2 = c.acquire_permit(&sem, Wait::Never).await.unwrap();
    assert!(pc2.is_none(), "both slots are held (b and c)");
    assert!(pb.release().await.unwrap());
    let pc2 = c
        .acquire_permit(&sem, Wait::Never)
        .await
        .unwrap()
        .expect("b's slot");
    assert_ne!(pc.slot(), pc2.slot());
    assert!(pc.release().await.unwrap());
    assert!(pc2.release().await.unwrap());
    assert!(c.held().is_empty(), "{:?}", c.held());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_more_than_n_holders_among_many_tasks() {
    let (db, options, admin) = setup("sem_many").await;
    const LIMIT: u32 = 3;
    const TASKS: usize = 10;
    const ROUNDS: usize = 8;
    let sem = Semaphore::new("jobs", LIMIT).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_holders(db.connect().await, sem.clone(), stop.clone());
    let inside = Arc::new(AtomicUsize::new(0));
    let most_inside = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (options, sem) = (options.clone(), sem.clone());
        let (inside, most_inside) = (inside.clone(), most_inside.clone());
        tasks.push(tokio::spawn(async move {
            let session = LockSession::connect(&options).await.unwrap();
            for r in 0..ROUNDS {
                let permit = if (t + r) % 3 == 0 {
                    match session.acquire_permit(&sem, Wait::Never).await.unwrap() {
                        Some(p) => p,
                        None => continue,
                    }
                } else {
                    session
                        .acquire_permit(&sem, Wait::Forever)
                        .await
                        .map(Option::unwrap)
                        .unwrap()
                };
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most_inside.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                assert!(permit.release().await.unwrap());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let (most_seen, reads) = sampler.await.unwrap();
    let most_inside = most_inside.load(Ordering::SeqCst);
    println!(
        "{TASKS} tasks x {ROUNDS} rounds, limit {LIMIT}: {:?}; most holders at once: {most_inside} \
         (tasks' count), {most_seen} (pg_locks, {reads} reads)",
        started.elapsed()
    );
    assert!(
        most_inside <= LIMIT as usize,
        "{most_inside} holders at once"
    );
    assert!(
        most_seen <= LIMIT as i64,
        "pg_locks showed {most_seen} slots held"
    );
    // Either count shows the limit reached, else the test shows little.
    // (Each can miss it: in CI, with holders holding 3 ms, the tasks' own
    // count once peaked at 2 while pg_locks showed 3; they hold 10 ms now.)
    assert!(
        most_inside == LIMIT as usize || most_seen == LIMIT as i64,
        "the limit was never reached: {most_inside} (tasks), {most_seen} (pg_locks)"
    );
    assert_eq!(slots_held(&admin, &sem).await, 0);
}

/// Environment variable that turns this test binary into a holder process
/// (`url|name|limit`): see [`holder_process`].
const CHILD_ENV: &str = "PGELECT_SEMAPHORE_TEST_CHILD";

/// Not a test: the body of a holder process, which the crash test starts
/// by running this test binary again with [`CHILD_ENV`] set. It takes a
/// permit, prints `holding <slot> <backend pid>`, and waits to be killed.
/// Without the variable it returns at once.
#[tokio::test]
async fn holder_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, '|');
    let (url, name, limit) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let options = ConnectOptions::from_url(url).unwrap();
    let sem = Semaphore::new(name, limit.parse().unwrap())
        .unwrap()
        .poll_every(Duration::from_millis(50))
        .unwrap();
    let session = LockSession::connect(&options).await.unwrap();
    println!("waiting {}", session.backend_pid());
    let permit = session
        .acquire_permit(&sem, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    println!("holding {} {}", permit.slot(), permit.backend_pid());
    permit.lost().await;
    println!("lost");
}

fn spawn_holder(index: usize, spec: &str, lines: mpsc::Sender<(usize, String)>) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // The full name in this binary: `locks::semaphore::holder_process`.
            &format!(
                "{}::holder_process",
                module_path!().split_once("::").unwrap().1
            ),
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = lines.send((index, l));
        }
    });
    child
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_holder_processes_never_let_more_than_n_hold() {
    let (db, _options, admin) = setup("sem_kill").await;
    const LIMIT: u32 = 2;
    const PROCESSES: usize = 7;
    let sem = Semaphore::new("fragile-upstream", LIMIT).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_holders(db.connect().await, sem.clone(), stop.clone());
    let spec = format!("{}|{}|{LIMIT}", db.url(), sem.name());
    let (tx, rx) = mpsc::channel();
    let mut children: Vec<Child> = (0..PROCESSES)
        .map(|i| spawn_holder(i, &spec, tx.clone()))
        .collect();
    let next_line = |want: &str| -> (usize, String) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (i, l) = rx
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no {want:?} line: {e}"));
            if l.starts_with(want) {
                return (i, l);
            }
        }
    };
    let mut holding = Vec::new();
    for _ in 0..LIMIT {
        holding.push(next_line("holding").0);
    }
    let mut takeovers = Vec::new();
    // Kill holders one by one: each time, a waiter (and only one) takes
    // the freed slot.
    for _ in 0..PROCESSES - LIMIT as usize {
        let victim = holding.remove(0);
        let killed_at = Instant::now();
        children[victim].kill().unwrap();
        children[victim].wait().unwrap();
        let (next, _) = next_line("holding");
        takeovers.push(killed_at.elapsed());
        assert_ne!(next, victim);
        holding.push(next);
        assert!(
            slots_held(&admin, &sem).await <= LIMIT as i64,
            "more than {LIMIT} slots held"
        );
    }
    for c in &mut children {
        let _ = c.kill();
        let _ = c.wait();
    }
    stop.store(true, Ordering::Relaxed);
    let (most_seen, reads) = sampler.await.unwrap();
    println!(
        "{PROCESSES} holder processes, limit {LIMIT}, {} SIGKILLed: takeover after a kill {:?} \
         (poll 50 ms: a killed holder sends no NOTIFY); most slots held at once {most_seen} \
         ({reads} pg_locks reads)",
        takeovers.len(),
        takeovers
    );
    assert!(
        most_seen <= LIMIT as i64,
        "pg_locks showed {most_seen} slots held"
    );
    assert_eq!(most_seen, LIMIT as i64);
    for t in &takeovers {
        assert!(*t < Duration::from_secs(10), "a takeover took {t:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_served_in_order_and_newcomers_do_not_overtake_them() {
    let (db, options, admin) = setup("sem_fair").await;
    let sem = Semaphore::new("one-at-a-time", 1).unwrap();
    let holder = LockSession::connect(&options).await.unwrap();
    let first = holder
        .acquire_permit(&sem, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();

    // Three waiters, each arriving once the one before is queued: the
    // first becomes the head (holds the gate), the others wait for it.
    let (served_tx, mut served) = tokio::sync::mpsc::unbounded_channel();
    let mut waiters = Vec::new();
    for w in 0..3 {
        let session = LockSession::connect(&options).await.unwrap();
        let pid = session.backend_pid();
        let (sem2, tx) = (sem.clone(), served_tx.clone());
        waiters.push(tokio::spawn(async move {
            let permit = session
                .acquire_permit(&sem2, Wait::Forever)
                .await
                .map(Option::unwrap)
                .unwrap();
            tx.send((w, permit)).unwrap();
        }));
        if w == 0 {
            await_holds(&admin, pid, sem.gate_key()).await;
        } else {
            db.wait_for_advisory_waiters(w as i64).await;
        }
    }
    // Newcomers keep trying while the waiters are served; the first try
    // has returned before the holder lets go.
    let stop = Arc::new(AtomicBool::new(false));
    let (tried_tx, tried) = tokio::sync::oneshot::channel();
    let barging = {
        let (options, sem, stop) = (options.clone(), sem.clone(), stop.clone());
        let session = LockSession::connect(&options).await.unwrap();
        tokio::spawn(async move {
            let (mut tries, mut wins) = (0, 0);
            let mut tried_tx = Some(tried_tx);
            while !stop.load(Ordering::Relaxed) {
                tries += 1;
                if let Some(p) = session.acquire_permit(&sem, Wait::Never).await.unwrap() {
                    wins += 1;
                    p.release().await.unwrap();
                }
                if let Some(tx) = tried_tx.take() {
                    let _ = tx.send(());
                }
            }
            (tries, wins)
        })
    };
    tried.await.unwrap();
    let mut order = Vec::new();
    let mut handoffs = Vec::new();
    let mut release = first.release();
    for _ in 0..3 {
        let t = Instant::now();
        assert!(release.await.unwrap());
        let (w, permit) = tokio::time::timeout(Duration::from_secs(30), served.recv())
            .await
            .expect("a waiter is served")
            .unwrap();
        handoffs.push(t.elapsed());
        order.push(w);
        release = permit.release();
    }
    stop.store(true, Ordering::Relaxed);
    let (tries, wins) = barging.await.unwrap();
    assert!(release.await.unwrap());
    for w in waiters {
        w.await.unwrap();
    }
    println!(
        "served in order {order:?}; handoffs {handoffs:?}; newcomers' tries {tries}, won {wins}"
    );
    assert_eq!(order, [0, 1, 2], "waiters are served in order of arrival");
    assert_eq!(wins, 0, "a newcomer took a permit while others waited");
    assert!(tries > 1, "the newcomers did try ({tries})");
}

#[tokio::test]
async fn a_bounded_wait_times_out_naming_the_holders_and_leaves_nothing_behind() {
    let (db, options, admin) = setup("sem_timeout").await;
    let sem = Semaphore::new("reports", 1).unwrap();
    let holder = LockSession::connect(&options).await.unwrap();
    let held = holder
        .acquire_permit(&sem, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();

    // The head waiter's timeout (it polls for a slot)...
    let head = LockSession::connect(&options).await.unwrap();
    let bound = Duration::from_millis(300);
    let t = Instant::now();
    let err = head
        .acquire_permit(&sem, Wait::AtMost(bound))
        .await
        .map(Option::unwrap)
        .unwrap_err();
    let waited = t.elapsed();
    println!("head waiter timed out after {waited:?} (bound {bound:?}): {err}");
    assert!(err.is_timeout(), "{err}");
    let text = err.to_string();
    assert!(text.contains("semaphore \"reports\" (limit 1)"), "{text}");
    assert!(
        text.contains(&format!("pid {}", holder.backend_pid())),
        "{text}"
    );
    assert!(
        waited >= bound && waited < bound + Duration::from_secs(5),
        "{waited:?}"
    );
    assert_eq!(
        advisory_locks_of(&admin, head.backend_pid()).await,
        0,
        "nothing left held"
    );

    // ... and a queued waiter's (it waits for the gate).
    let queued = LockSession::connect(&options).await.unwrap();
    let head_wait = {
        let (head, sem) = (head.clone(), sem.clone());
        tokio::spawn(async move {
            head.acquire_permit(&sem, Wait::Forever)
                .await
                .map(Option::unwrap)
        })
    };
    await_holds(&admin, head.backend_pid(), sem.gate_key()).await;
    let t = Instant::now();
    let err = queued
        .acquire_permit(&sem, Wait::AtMost(bound))
        .await
        .map(Option::unwrap)
        .unwrap_err();
    let waited = t.elapsed();
    println!("queued waiter timed out after {waited:?}: {err}");
    assert!(matches!(err, Error::LockTimeout { .. }), "{err}");
    assert!(err.to_string().contains("semaphore \"reports\""), "{err}");
    assert!(
        waited >= bound && waited < bound + Duration::from_secs(5),
        "{waited:?}"
    );
    assert_eq!(advisory_locks_of(&admin, queued.backend_pid()).await, 0);
    db.wait_for_advisory_waiters(0).await;

    assert!(held.release().await.unwrap());
    let permit = head_wait.await.unwrap().unwrap();
    assert!(permit.release().await.unwrap());
}

#[tokio::test]
async fn bad_input_and_a_different_limit_are_refused_clearly() {
    let (_db, options, _admin) = setup("sem_bad").await;
    for (name, limit) in [("x", 0), ("x", 1025), ("", 1), ("a\0b", 1)] {
        let err = Semaphore::new(name, limit).unwrap_err();
        assert!(err.is_config(), "{name:?}/{limit}: {err}");
    }
    let sem = Semaphore::new("pool", 2).unwrap();
    let a = LockSession::connect(&options).await.unwrap();
    let err = a
        .acquire_permit(&sem, Wait::AtMost(Duration::ZERO))
        .await
        .map(Option::unwrap)
        .unwrap_err();
    assert!(err.is_config(), "{err}");

    let held = a
        .acquire_permit(&sem, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let other = Semaphore::new("pool", 3).unwrap();
    for attempt in 0..2 {
        let err = if attempt == 0 {
            b.acquire_permit(&other, Wait::Never).await.unwrap_err()
        } else {
            b.acquire_permit(&other, Wait::Forever)
                .await
                .map(Option::unwrap)
                .unwrap_err()
        };
        let text = err.to_string();
        println!("{text}");
        assert!(err.is_config(), "{text}");
        assert!(text.contains("in use with limit 2"), "{text}");
        assert!(text.contains(&a.backend_pid().to_string()), "{text}");
    }
    assert!(b.held().is_empty());
    // The same name with the same limit is fine.
    let p = b
        .acquire_permit(&sem, Wait::Never)
        .await
        .unwrap()
        .expect("a second permit");
    assert!(p.release().await.unwrap());
    assert!(held.release().await.unwrap());
    // Once nobody uses it, another limit may be used.
    let p = b
        .acquire_permit(&other, Wait::Never)
        .await
        .unwrap()
        .expect("free again");
    assert!(p.release().await.unwrap());
}

#[tokio::test]
async fn a_holder_whose_connection_ends_loses_its_permit_to_a_waiter() {
    let (_db, options, admin) = setup("sem_lost").await;
    let sem = Semaphore::new("single", 1)
        .unwrap()
        .poll_every(Duration::from_millis(50))
        .unwrap();
    let holder = LockSession::connect(&options).await.unwrap();
    let permit = holder
        .acquire_permit(&sem, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let waiter = LockSession::connect(&options).await.unwrap();
    let waiting = {
        let (waiter, sem) = (waiter.clone(), sem.clone());
        tokio::spawn(async move {
            waiter
                .acquire_permit(&sem, Wait::Forever)
                .await
                .map(Option::unwrap)
        })
    };
    await_holds(&admin, waiter.backend_pid(), sem.gate_key()).await;
    let t = Instant::now();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&permit.backend_pid()])
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), permit.lost())
        .await
        .expect("lost() fires");
    assert!(permit.is_lost());
    let next = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter takes the freed slot")
        .unwrap()
        .unwrap();
    println!(
        "waiter took the slot of a terminated holder after {:?}",
        t.elapsed()
    );
    assert!(matches!(permit.release().await, Err(e) if e.is_connection()));
    assert!(next.release().await.unwrap());
}

#[tokio::test]
async fn an_abandoned_wait_is_withdrawn() {
    let (db, options, admin) = setup("sem_cancel").await;
    let sem = Semaphore::new("cancelled", 1).unwrap();
    let holder = LockSession::connect(&options).await.unwrap();
    let held = holder
        .acquire_permit(&sem, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let head = LockSession::connect(&options).await.unwrap();
    let head_wait = {
        let (head, sem) = (head.clone(), sem.clone());
        tokio::spawn(async move {
            head.acquire_permit(&sem, Wait::Forever)
                .await
                .map(Option::unwrap)
        })
    };
    await_holds(&admin, head.backend_pid(), sem.gate_key()).await;
    let queued = LockSession::connect(&options).await.unwrap();
    let queued_wait = {
        let (queued, sem) = (queued.clone(), sem.clone());
        tokio::spawn(async move {
            queued
                .acquire_permit(&sem, Wait::Forever)
                .await
                .map(Option::unwrap)
        })
    };
    db.wait_for_advisory_waiters(1).await;
    queued_wait.abort();
    head_wait.abort();
    let _ = queued_wait.await;
    let _ = head_wait.await;
    // The sessions' next operations run after the withdrawal and release.
    assert!(queued
        .acquire_permit(&sem, Wait::Never)
        .await
        .unwrap()
        .is_none());
    assert!(head
        .acquire_permit(&sem, Wait::Never)
        .await
        .unwrap()
        .is_none());
    assert_eq!(advisory_locks_of(&admin, queued.backend_pid()).await, 0);
    assert_eq!(advisory_locks_of(&admin, head.backend_pid()).await, 0);
    assert!(held.release().await.unwrap());
    let p = queued
        .acquire_permit(&sem, Wait::Never)
        .await
        .unwrap()
        .expect("free, nobody waits");
    assert!(p.release().await.unwrap());
}

#[tokio::test]
async fn latency_uncontended_and_handoff() {
    let (_db, options, admin) = setup("sem_latency").await;
    let sem = Semaphore::new("latency", 4).unwrap();
    let a = LockSession::connect(&options).await.unwrap();
    let mut acquire = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let p = a
            .acquire_permit(&sem, Wait::Forever)
            .await
            .map(Option::unwrap)
            .unwrap();
        acquire.push(t.elapsed());
        p.release().await.unwrap();
    }
    acquire.sort();
    // Handoff: a holder of the last slot releases; the head waiter, woken
    // by the release's NOTIFY, takes it.
    let one = Semaphore::new("handoff", 1).unwrap();
    let b = LockSession::connect(&options).await.unwrap();
    let mut handoff = Vec::new();
    for _ in 0..20 {
        let p = a
            .acquire_permit(&one, Wait::Forever)
            .await
            .map(Option::unwrap)
            .unwrap();
        let (b2, one2) = (b.clone(), one.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let waiter = tokio::spawn(async move {
            let got = b2
                .acquire_permit(&one2, Wait::Forever)
                .await
                .map(Option::unwrap)
                .unwrap();
            let _ = tx.send(Instant::now());
            got
        });
        await_holds(&admin, b.backend_pid(), one.gate_key()).await;
        let t = Instant::now();
        p.release().await.unwrap();
        let got_at = rx.await.unwrap();
        handoff.push(got_at - t);
        waiter.await.unwrap().release().await.unwrap();
    }
    handoff.sort();
    println!(
        "uncontended acquire: median {:?}, p90 {:?}; handoff release -> next holder: median {:?}, max {:?}",
        acquire[acquire.len() / 2],
        acquire[acquire.len() * 9 / 10],
        handoff[handoff.len() / 2],
        handoff[handoff.len() - 1]
    );
    // Woken by the NOTIFY, not by the 500 ms poll.
    assert!(
        handoff[handoff.len() / 2] < Duration::from_millis(250),
        "median handoff {:?}",
        handoff[handoff.len() / 2]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_waiters_are_all_served_when_their_waits_span_several_slices() {
    let (db, options, _admin) = setup("sem_slices").await;
    let sem = Semaphore::new("sliced", 1).unwrap();
    let holder = LockSession::connect(&options).await.unwrap();
    let held = holder
        .acquire_permit(&sem, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let (tx, mut served) = tokio::sync::mpsc::unbounded_channel();
    for w in 0..4 {
        // Gate waits re-issued every 100 ms: each waits through several.
        let session = LockSession::builder(&options)
            .wait_slice(Duration::from_millis(100))
            .connect()
            .await
            .unwrap();
        let (sem, tx) = (sem.clone(), tx.clone());
        tokio::spawn(async move {
            let permit = session
                .acquire_permit(&sem, Wait::Forever)
                .await
                .map(Option::unwrap)
                .unwrap();
            tx.send(w).unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            permit.release().await.unwrap();
        });
    }
    db.wait_for_advisory_waiters(3).await;
    // Long enough for every queued wait to be re-issued a few times.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    assert!(held.release().await.unwrap());
    let mut order = Vec::new();
    for _ in 0..4 {
        let w = tokio::time::timeout(Duration::from_secs(30), served.recv())
            .await
            .expect("every waiter is served")
            .unwrap();
        order.push(w);
    }
    println!(
        "4 waiters over 100 ms slices served in {:?}, order {order:?}",
        t.elapsed()
    );
    order.sort();
    assert_eq!(order, [0, 1, 2, 3]);
}
