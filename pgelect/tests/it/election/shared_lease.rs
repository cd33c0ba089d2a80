//! Lease-backend candidates of many roles on shared lease clients
//! (`SharedLease`), against a real server and through a real PgBouncer in
//! transaction mode: every role led exactly once on one connection per
//! client with a few statements a second, takeover of a killed client's
//! roles after the TTL, a role taken by hand lost alone.
//!
//! Timing assertions use generous bounds and print what they measured.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use pgelect::{election::SharedLease, loss::LossReason, ConnectOptions, Elector};
use pgelect_testkit::{Cluster, PgBouncer, PoolMode, TestDb};
use tokio::sync::mpsc;

use crate::support;
use support::{connections_named, fast_lease as fast, migrated, transactions};

fn role(i: usize) -> String {
    format!("shard-{i}")
}

/// Which node leads each role now, as the candidates themselves report it;
/// panics when a second candidate of a role believes it leads.
#[derive(Clone, Default)]
struct Leaders(Arc<Mutex<HashMap<String, (String, i64)>>>);

impl Leaders {
    fn begin(&self, role: &str, node: &str, term: i64) {
        let mut m = self.0.lock().unwrap();
        if let Some((other, t)) = m.get(role) {
            panic!("role {role}: {node} (term {term}) leads while {other} (term {t}) still does");
        }
        m.insert(role.to_owned(), (node.to_owned(), term));
    }

    fn end(&self, role: &str, node: &str) {
        let mut m = self.0.lock().unwrap();
        if m.get(role).is_some_and(|(n, _)| n == node) {
            m.remove(role);
        }
    }

    fn snapshot(&self) -> HashMap<String, (String, i64)> {
        self.0.lock().unwrap().clone()
    }
}

/// Stands `node` for every role in `roles` on `client`: each candidate
/// leads until it loses, reports its wins on `won`, and stands again.
fn stand(
    o: &ConnectOptions,
    client: &SharedLease,
    node: &str,
    roles: &[String],
    leaders: &Leaders,
    won: &mpsc::UnboundedSender<(String, String, i64)>,
) -> Vec<tokio::task::JoinHandle<()>> {
    roles
        .iter()
        .map(|r| {
            // A batched renewal of a hundred rows, on a debug build beside
            // five other tests on two cores, once took longer than the
            // 600 ms statement timeout of `fast` and gave its roles up;
            // 1.2 s keeps the 2 s TTL (500 ms renewals) valid.
            let e = fast(o, r, node)
                .lease(|l| {
                    l.shared_lease(client)
                        .statement_timeout(Duration::from_millis(1200))
                })
                .build()
                .unwrap();
            let (leaders, won, r, node) =
                (leaders.clone(), won.clone(), r.clone(), node.to_owned());
            tokio::spawn(async move {
                loop {
                    let l = e.leadership().await.expect("elected");
                    leaders.begin(&r, &node, l.term().get());
                    let _ = won.send((r.clone(), node.clone(), l.term().get()));
                    let loss = l.lost().await;
                    println!(
                        "{node} lost {r} (term {}): {:?}",
                        l.term().get(),
                        loss.reason()
                    );
                    leaders.end(&r, &node);
                }
            })
        })
        .collect()
}

/// Waits for `client`'s first statement: it follows the client's
/// connection, whose SCRAM exchange is slow in a debug build on a loaded
/// machine. Returns how long it took.
async fn first_statement(client: &SharedLease, name: &str) -> Duration {
    let start = Instant::now();
    tokio::time::timeout(Duration::from_secs(15), async {
        while client.statements() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{name} sends no statement within 15 s"));
    let took = start.elapsed();
    println!("{name}'s first statement after {took:?}");
    took
}

/// Waits until every role in `roles` is led (by the candidates' reports).
async fn all_led(leaders: &Leaders, roles: &[String], within: Duration) -> Duration {
    let start = Instant::now();
    tokio::time::timeout(within, async {
        loop {
            let led = leaders.snapshot();
            if roles.iter().all(|r| led.contains_key(r)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        let led = leaders.snapshot();
        panic!(
            "only {} of {} roles led after {within:?}",
            roles.iter().filter(|r| led.contains_key(*r)).count(),
            roles.len()
        )
    });
    start.elapsed()
}

/// The roles whose row names a holder with a live lease on the server.
async fn held_on_server(admin: &tokio_postgres::Client) -> HashMap<String, (String, i64)> {
    admin
        .query(
            "SELECT role, holder, term FROM pgelect.leaders
              WHERE holder IS NOT NULL AND lease_until > now()",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_hundred_roles_over_three_clients_are_led_once_on_one_connection_each() {
    const ROLES: usize = 300;
    let (db, o) = migrated("lease_shared_many").await;
    let admin = db.connect().await;
    let roles: Vec<String> = (0..ROLES).map(role).collect();
    let leaders = Leaders::default();
    let (won_tx, mut won_rx) = mpsc::unbounded_channel();
    let clients: Vec<SharedLease> = (0..3).map(|_| SharedLease::new(&o)).collect();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        tasks.extend(stand(&o, c, &format!("n{i}"), &roles, &leaders, &won_tx));
    }
    let took = all_led(&leaders, &roles, Duration::from_secs(60)).await;
    println!("{ROLES} roles over 3 shared lease clients led after {took:?}");

    // Every role once on the server, by one of the candidates' nodes, as
    // the candidates believe.
    let held = held_on_server(&admin).await;
    assert_eq!(held.len(), ROLES, "roles held on the server");
    for (r, (node, term)) in leaders.snapshot() {
        assert_eq!(held.get(&r), Some(&(node, term)), "role {r}");
    }

    // Steady state: a window of 4 s (8 renewal periods, 20 polls).
    tokio::time::sleep(Duration::from_secs(1)).await;
    while won_rx.try_recv().is_ok() {}
    let before: Vec<u64> = clients.iter().map(|c| c.statements()).collect();
    let xact_before = transactions(&admin).await;
    let window = Instant::now();
    let mut most_connections = 0;
    while window.elapsed() < Duration::from_secs(4) {
        for c in &clients {
            let n = connections_named(&admin, &c.application_name()).await;
            most_connections = most_connections.max(n);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let secs = window.elapsed().as_secs_f64();
    let xacts = (transactions(&admin).await - xact_before) as f64 / secs;
    let rates: Vec<f64> = clients
        .iter()
        .zip(&before)
        .map(|(c, b)| (c.statements() - b) as f64 / secs)
        .collect();
    println!("steady state: statements/s per client {rates:?}; transactions/s on the server {xacts:.1} (the observer's included); connections per client at most {most_connections}");
    assert!(
        (1..=1).contains(&most_connections),
        "connections per client: {most_connections}"
    );
    // One client renews 100 leaders every 500 ms and polls 200 standbys
    // every 200 ms: one statement per role would be 200 a second or more
    // (100 renewals of its own twice a second alone); batched, about 8.
    for r in &rates {
        assert!(*r < 20.0, "statements/s per client: {rates:?}");
    }
    // The server's count, which the clients cannot misreport: the 3
    // clients and this observer (about 10 statements a second).
    assert!(xacts < 80.0, "transactions/s on the server: {xacts:.1}");
    // Nobody lost a role in the steady state.
    assert!(
        won_rx.try_recv().is_err(),
        "a role changed hands at steady state"
    );
    assert_eq!(leaders.snapshot().len(), ROLES);
    println!("total {:?}", start.elapsed());
    for t in tasks {
        t.abort();
    }
}

/// Each role's row on the server: holder, term, acquired_at, lease_until.
async fn rows(
    admin: &tokio_postgres::Client,
) -> HashMap<String, (Option<String>, i64, Option<SystemTime>, Option<SystemTime>)> {
    admin
        .query(
            "SELECT role, holder, term, acquired_at, lease_until FROM pgelect.leaders",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_client_s_roles_are_taken_over_after_the_ttl_with_higher_terms() {
    const ROLES: usize = 60;
    let (db, o) = migrated("lease_shared_kill").await;
    let admin = db.connect().await;
    let roles: Vec<String> = (0..ROLES).map(role).collect();
    let leaders = Leaders::default();
    let (won_tx, mut won_rx) = mpsc::unbounded_channel();

    // Client a, in a runtime of its own (its "process"), leads every role.
    let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
    let a = {
        let (o, roles, leaders, won_tx) =
            (o.clone(), roles.clone(), leaders.clone(), won_tx.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let client = SharedLease::new(&o);
            let tasks = rt.block_on(async { stand(&o, &client, "a", &roles, &leaders, &won_tx) });
            kill_rx.recv().unwrap();
            // SIGKILL-like: every task stops where it is, the connection
            // is dropped, nothing is released.
            rt.shutdown_background();
            drop(tasks);
        })
    };
    all_led(&leaders, &roles, Duration::from_secs(30)).await;
    assert!(leaders.snapshot().values().all(|(n, _)| n == "a"));

    // b and c stand on clients of their own; a keeps every role.
    let (b, c) = (SharedLease::new(&o), SharedLease::new(&o));
    let mut tasks = stand(&o, &b, "b", &roles, &leaders, &won_tx);
    tasks.extend(stand(&o, &c, "c", &roles, &leaders, &won_tx));
    while won_rx.try_recv().is_ok() {}
    first_statement(&b, "b").await;
    first_statement(&c, "c").await;
    let (b_before, c_before) = (b.statements(), c.statements());
    let wait_renewed = Instant::now();
    // Two of a's renewal periods, seen on the server: both other clients
    // polled meanwhile (at least every 200 ms).
    let first = rows(&admin).await;
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let now = rows(&admin).await;
            if roles.iter().all(|r| now[r].3 > first[r].3)
                && wait_renewed.elapsed() > Duration::from_secs(1)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("a renews every role");
    assert!(won_rx.try_recv().is_err(), "a standby won a role a leads");
    assert!(
        b.statements() > b_before && c.statements() > c_before,
        "the standbys poll while a renews"
    );

    kill_tx.send(()).unwrap();
    a.join().unwrap();
    let killed = Instant::now();
    // a's beliefs died with it.
    for r in &roles {
        leaders.end(r, "a");
    }
    // What a held on the server when it died (a renewal in flight at the
    // kill either committed by now or never will).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let at_kill = rows(&admin).await;

    let took =
        all_led(&leaders, &roles, Duration::from_secs(15)).await + Duration::from_millis(200);
    println!("{ROLES} roles of a killed client taken over {took:?} after the kill (ttl 2 s)");
    assert!(
        took < Duration::from_secs(2) + Duration::from_secs(3),
        "takeover took {took:?}"
    );
    let after = rows(&admin).await;
    for r in &roles {
        let (old_holder, old_term, _, old_until) = &at_kill[r];
        let (holder, term, acquired_at, _) = &after[r];
        assert_eq!(old_holder.as_deref(), Some("a"), "role {r} before");
        assert!(
            matches!(holder.as_deref(), Some("b") | Some("c")),
            "role {r}: {holder:?}"
        );
        assert!(term > old_term, "role {r}: term {term} after {old_term}");
        // Never two leaders on the server's clock: taken only after a's
        // lease expired.
        assert!(
            acquired_at.unwrap() >= old_until.unwrap(),
            "role {r} taken at {acquired_at:?} before a's lease ended at {old_until:?}"
        );
    }
    let _ = killed;
    for t in tasks {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_renewal_that_finds_its_role_taken_loses_that_role_alone() {
    const ROLES: usize = 20;
    let (db, o) = migrated("lease_shared_taken").await;
    let admin = db.connect().await;
    let client = SharedLease::new(&o);
    let mut electors = Vec::new();
    let mut led = Vec::new();
    for i in 0..ROLES {
        let e = fast(&o, &role(i), "a")
            .lease(|l| l.shared_lease(&client))
            .build()
            .unwrap();
        led.push(e.leadership().await.unwrap());
        electors.push(e);
    }
    // Someone else takes shard-7 by hand, with a live lease and a new term.
    let taken = admin
        .execute(
            "UPDATE pgelect.leaders
                SET holder = 'intruder', term = term + 1, lease_until = now() + interval '1 hour'
              WHERE role = 'shard-7'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(taken, 1);
    let since = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), led[7].lost())
        .await
        .expect("the taken role is lost");
    println!("the taken role was lost after {:?}", since.elapsed());
    assert_eq!(
        led[7].loss().map(|l| l.reason()),
        Some(LossReason::Preempted)
    );

    // Two more renewals of every other role, seen on the server.
    let first = rows(&admin).await;
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut renewed = 0;
        let mut seen = first.clone();
        while renewed < 2 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = rows(&admin).await;
            let others = (0..ROLES).filter(|i| *i != 7).map(role);
            if others.clone().all(|r| now[&r].3 > seen[&r].3) {
                renewed += 1;
                seen = now;
            }
        }
    })
    .await
    .expect("the other roles are renewed");
    for (i, l) in led.iter().enumerate() {
        if i != 7 {
            assert!(!l.is_lost(), "role {i} was lost with the taken one");
        }
    }
    let now = rows(&admin).await;
    assert_eq!(now["shard-7"].0.as_deref(), Some("intruder"));
    assert_eq!(
        connections_named(&admin, &client.application_name()).await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_lease_clients_work_through_pgbouncer_in_transaction_mode() {
    const ROLES: usize = 50;
    let cluster = tokio::task::spawn_blocking(Cluster::shared).await.unwrap();
    let db = TestDb::on(cluster, "lease_shared_bouncer").await;
    let direct = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&direct).await.expect("migrate");
    let bouncer = PgBouncer::start(cluster, PoolMode::Transaction).expect("pgbouncer starts");
    let pooled = ConnectOptions::from_url(&bouncer.url(db.name())).unwrap();
    let admin = db.connect().await;
    let roles: Vec<String> = (0..ROLES).map(role).collect();
    let leaders = Leaders::default();
    let (won_tx, mut won_rx) = mpsc::unbounded_channel();

    // a leads every role through PgBouncer; then b stands too.
    let a = SharedLease::new(&pooled);
    let a_tasks = stand(&pooled, &a, "a", &roles, &leaders, &won_tx);
    let took = all_led(&leaders, &roles, Duration::from_secs(30)).await;
    println!("{ROLES} roles led through PgBouncer after {took:?}");
    let b = SharedLease::new(&pooled);
    let b_tasks = stand(&pooled, &b, "b", &roles, &leaders, &won_tx);
    first_statement(&b, "b").await;
    // Two of a's renewals of every role, seen on the server, while b polls
    // (at least every 200 ms): a keeps every role.
    let b_before = b.statements();
    let first = rows(&admin).await;
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut renewed = 0;
        let mut seen = first;
        while renewed < 2 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = rows(&admin).await;
            if roles.iter().all(|r| now[r].3 > seen[r].3) {
                renewed += 1;
                seen = now;
            }
        }
    })
    .await
    .expect("a renews every role through PgBouncer");
    let b_polls = b.statements() - b_before;
    println!("b sent {b_polls} statements during two of a's renewals");
    assert!(b_polls > 0, "b polls while a renews");
    let held = held_on_server(&admin).await;
    assert_eq!(held.len(), ROLES);
    assert!(held.values().all(|(n, _)| n == "a"), "{held:?}");
    let mut a_won = HashSet::new();
    while let Ok((r, n, _)) = won_rx.try_recv() {
        assert_eq!(n, "a");
        a_won.insert(r);
    }
    assert_eq!(a_won.len(), ROLES);

    // a's candidates go away without releasing: b takes every role once
    // the leases expired, through PgBouncer.
    for t in a_tasks {
        t.abort();
    }
    let gone = Instant::now();
    // What a held when it went away (a renewal in flight committed by now
    // or never will).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let at_abort = rows(&admin).await;
    // The aborted tasks never report their end.
    for r in &roles {
        leaders.end(r, "a");
    }
    let mut taken = HashSet::new();
    tokio::time::timeout(Duration::from_secs(15), async {
        while taken.len() < ROLES {
            let (r, n, _) = won_rx.recv().await.unwrap();
            assert_eq!(n, "b", "role {r}");
            taken.insert(r);
        }
    })
    .await
    .unwrap_or_else(|_| panic!("b took {} of {ROLES} roles", taken.len()));
    println!(
        "b took over {ROLES} roles through PgBouncer {:?} after a went away",
        gone.elapsed()
    );
    let held = held_on_server(&admin).await;
    assert_eq!(held.len(), ROLES);
    assert!(held.values().all(|(n, _)| n == "b"), "{held:?}");
    let after = rows(&admin).await;
    for r in &roles {
        let (_, old_term, _, old_until) = &at_abort[r];
        let (_, term, acquired_at, _) = &after[r];
        assert!(term > old_term, "role {r}: term {term} after {old_term}");
        assert!(
            acquired_at.unwrap() >= old_until.unwrap(),
            "role {r} taken at {acquired_at:?} before a's lease ended at {old_until:?}"
        );
    }
    for t in b_tasks {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_role_held_by_a_session_backend_leader_is_refused_to_a_shared_lease_candidate() {
    let (_db, o) = migrated("lease_shared_mixed").await;
    let session = Elector::builder(o.clone(), "mixed")
        .node_id("s")
        .ttl(Duration::from_secs(2))
        .renew_every(Duration::from_millis(500))
        .session(|s| {
            s.heartbeat(Duration::from_millis(200))
                .heartbeat_timeout(Duration::from_millis(500))
        })
        .build()
        .unwrap();
    let held = session.leadership().await.unwrap();
    let client = SharedLease::new(&o);
    // A role of its own on the same client is led meanwhile.
    let other = fast(&o, "other", "l")
        .lease(|l| l.shared_lease(&client))
        .build()
        .unwrap();
    let e = fast(&o, "mixed", "l")
        .lease(|l| l.shared_lease(&client))
        .build()
        .unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(10), e.leadership())
        .await
        .expect("answered");
    let err = refused.expect_err("a session leader's role taken by a lease candidate");
    assert!(
        matches!(err, pgelect::Error::Config(_)) && err.to_string().contains("session backend"),
        "{err}"
    );
    let l = tokio::time::timeout(Duration::from_secs(10), other.leadership())
        .await
        .expect("answered")
        .expect("the other role is led");
    assert!(!held.is_lost());
    assert!(!l.is_lost());
}

/// Each candidate's `leadership()` on `client` (roles `shard-0..n`),
/// bounded: a candidate that neither leads nor fails within 20 s hangs.
async fn outcomes(
    o: &ConnectOptions,
    client: &SharedLease,
    n: usize,
) -> Vec<pgelect::Result<pgelect::Leadership>> {
    let electors: Vec<Elector> = (0..n)
        .map(|i| {
            fast(o, &role(i), "a")
                .lease(|l| l.shared_lease(client))
                .build()
                .unwrap()
        })
        .collect();
    let started = Instant::now();
    let all = futures_util::future::join_all(electors.iter().map(|e| e.leadership()));
    let out = tokio::time::timeout(Duration::from_secs(20), all)
        .await
        .expect("every candidate answers: none retries a refusal forever");
    println!("{n} candidates answered within {:?}", started.elapsed());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_schema_is_returned_to_every_candidate_of_the_client() {
    let db = TestDb::new("lease_shared_noschema").await;
    let o = ConnectOptions::from_url(&db.url()).unwrap();
    let client = SharedLease::new(&o);
    for r in outcomes(&o, &client, 5).await {
        let e = r.expect_err("no schema, no leadership");
        assert!(e.is_schema(), "{e:?}");
        assert!(e.to_string().contains("pgelect migrate"), "{e}");
    }
    // Once migrated, the same client serves new candidates.
    pgelect::migrate(&o).await.unwrap();
    for r in outcomes(&o, &client, 5).await {
        let l = r.expect("led once the schema is there");
        l.resign().await.unwrap();
    }
}

/// With `listen_via` (a direct connection beside PgBouncer in transaction
/// mode), a shared lease client's standbys hear a leader's release: two
/// roles resigned one after the other are each taken over well within
/// `retry_every` (10 s here). Without it a standby learns of a release only
/// at its next poll, and the second release, made just after the poll
/// that took the first, would wait about 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_listen_via_released_roles_are_taken_over_at_once_through_pgbouncer() {
    const ROLES: usize = 20;
    let cluster = tokio::task::spawn_blocking(Cluster::shared).await.unwrap();
    let db = TestDb::on(cluster, "lease_shared_listen").await;
    let direct = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&direct).await.expect("migrate");
    let bouncer = PgBouncer::start(cluster, PoolMode::Transaction).expect("pgbouncer starts");
    let pooled = ConnectOptions::from_url(&bouncer.url(db.name())).unwrap();
    let admin = db.connect().await;
    let slow = |client: &SharedLease, r: &str, node: &str| slow_lease(&pooled, client, r, node);
    // a leads every role.
    let a = SharedLease::new(&pooled);
    let (_a_electors, mut led) = lead_roles(&a, &pooled, ROLES).await;
    // b stands for every role and listens directly.
    let b = SharedLease::new(&pooled)
        .listen_via(direct.clone())
        .unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let b_tasks: Vec<_> = (0..ROLES)
        .map(|i| {
            let e = slow(&b, &role(i), "b");
            let tx = tx.clone();
            tokio::spawn(async move {
                let l = e.leadership().await.expect("b leads");
                let _ = tx.send((i, Instant::now()));
                l.lost().await;
            })
        })
        .collect();
    until_listening(&admin, &b).await;
    for i in [3, 7] {
        let resigned = Instant::now();
        led[i].take().unwrap().resign().await.unwrap();
        let (taken, at) = tokio::time::timeout(Duration::from_secs(15), rx.recv())
            .await
            .expect("b takes the released role")
            .unwrap();
        assert_eq!(taken, i, "only the released role changes hands");
        let took = at - resigned;
        println!("role {i} taken over by b {took:?} after a resigned it (retry_every 10 s)");
        assert!(
            took < Duration::from_secs(3),
            "the release NOTIFY brought b's acquire forward: {took:?}"
        );
    }
    assert!(rx.try_recv().is_err(), "a still leads the other roles");
    assert!(led.iter().flatten().all(|l| !l.is_lost()));

    // Anyone may NOTIFY: 300 forged announcements of a release of a role b
    // waits for (each in a transaction of its own: the server folds equal
    // ones in one transaction) cost b at most the wake limit's acquires
    // (a burst of 5, then 10 a second), not one each.
    let before = b.statements();
    let flood_started = Instant::now();
    for _ in 0..300 {
        admin
            .batch_execute("SELECT pg_notify('pgelect_leader', 'pgelect:released:shard-1')")
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let window = flood_started.elapsed().as_secs_f64();
    let spent = b.statements() - before;
    let bound = 5.0 + 10.0 * window + 5.0;
    println!(
        "300 forged announcements in {window:.2} s cost b {spent} statements (bound {bound:.0})"
    );
    assert!(
        (spent as f64) <= bound,
        "{spent} statements for a flood of 300 announcements in {window:.2} s"
    );
    assert!(rx.try_recv().is_err(), "no role changed hands");
    for t in b_tasks {
        t.abort();
    }
}

/// A release announced while an acquire is in flight is not lost: that
/// acquire read the row before the release, and its outcome used to put
/// the standby's next try off by `retry_every` (10 s here), the
/// announcement having been taken as answered by it. CI once saw such a
/// takeover take 10.01 s. Here the acquire is held in flight by a free
/// row another transaction has locked, and the release is announced
/// meanwhile; the role is taken over soon after the lock goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_announced_while_an_acquire_is_in_flight_is_not_lost() {
    const ROLES: usize = 5;
    let (db, direct) = migrated("lease_shared_rewake").await;
    let admin = db.connect().await;
    let slow = |client: &SharedLease, r: &str, node: &str| slow_lease(&direct, client, r, node);
    // a leads every role, and releases "blocker": a free row.
    let a = SharedLease::new(&direct);
    let (_a_electors, mut led) = lead_roles(&a, &direct, ROLES).await;
    let blocker = slow(&a, "blocker", "a");
    blocker.leadership().await.unwrap().resign().await.unwrap();
    drop(blocker);

    let b = SharedLease::new(&direct)
        .listen_via(direct.clone())
        .unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut b_tasks: Vec<_> = (0..ROLES)
        .map(|i| {
            let e = slow(&b, &role(i), "b");
            let tx = tx.clone();
            tokio::spawn(async move {
                let l = e.leadership().await.expect("b leads");
                let _ = tx.send((role(i), Instant::now()));
                l.lost().await;
            })
        })
        .collect();
    until_listening(&admin, &b).await;

    // Another transaction locks the free row; b's standby for it brings
    // an acquire of all b's standbys, which waits on that lock.
    let locker = db.connect().await;
    locker
        .batch_execute("BEGIN; SELECT 1 FROM pgelect.leaders WHERE role = 'blocker' FOR UPDATE")
        .await
        .unwrap();
    let e = slow(&b, "blocker", "b");
    let blocker_tx = tx.clone();
    b_tasks.push(tokio::spawn(async move {
        let l = e.leadership().await.expect("b leads blocker");
        let _ = blocker_tx.send(("blocker".to_owned(), Instant::now()));
        l.lost().await;
    }));
    let name = b.application_name();
    pgelect_testkit::wait_until(
        "b's acquire waits on the lock",
        Duration::from_secs(10),
        || async {
            admin
                .query_typed_one(
                    "SELECT count(*) FROM pg_stat_activity
                  WHERE application_name = $1 AND wait_event_type = 'Lock'",
                    &[(&name, tokio_postgres::types::Type::TEXT)],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1
        },
    )
    .await;

    // Role 3 is released while that acquire is in flight, and b hears it.
    let heard = b.releases_heard();
    let resigned = Instant::now();
    led[3].take().unwrap().resign().await.unwrap();
    pgelect_testkit::wait_until("b hears the release", Duration::from_secs(10), || async {
        b.releases_heard() > heard
    })
    .await;
    locker.batch_execute("COMMIT").await.unwrap();

    let mut taken = HashMap::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        while taken.len() < 2 {
            let (r, at) = rx.recv().await.unwrap();
            assert!(taken.insert(r, at).is_none());
        }
    })
    .await
    .expect("b takes blocker and the released role");
    let took = taken[&role(3)] - resigned;
    println!(
        "role 3 taken over by b {took:?} after a resigned it during b's acquire (retry_every 10 s)"
    );
    assert!(
        took < Duration::from_secs(3),
        "the release heard during an acquire was acted on: {took:?}"
    );
    assert!(taken.contains_key("blocker"));
    assert!(rx.try_recv().is_err(), "a still leads the other roles");
    for t in b_tasks {
        t.abort();
    }
}

/// A candidate of `r` on `client` with a 20 s TTL, renewing every 2 s and
/// trying a held role every 10 s: a standby that takes a released role
/// within seconds was woken by its announcement.
fn slow_lease(options: &ConnectOptions, client: &SharedLease, r: &str, node: &str) -> Elector {
    fast(options, r, node)
        .ttl(Duration::from_secs(20))
        .renew_every(Duration::from_secs(2))
        .lease(|l| l.retry_every(Duration::from_secs(10)).shared_lease(client))
        .build()
        .unwrap()
}

/// Node "a" on `client` leads roles 0..`roles`; the electors, and each
/// leadership (taken when the test resigns it).
async fn lead_roles(
    client: &SharedLease,
    options: &ConnectOptions,
    roles: usize,
) -> (Vec<Elector>, Vec<Option<pgelect::Leadership>>) {
    let electors: Vec<Elector> = (0..roles)
        .map(|i| slow_lease(options, client, &role(i), "a"))
        .collect();
    let mut led = Vec::new();
    for e in &electors {
        led.push(Some(e.leadership().await.unwrap()));
    }
    (electors, led)
}

/// Waits (bounded) until `b` listens on its own connection, named after
/// the client, and has sent a statement.
async fn until_listening(admin: &tokio_postgres::Client, b: &SharedLease) {
    let listen_name = b.listen_application_name();
    pgelect_testkit::wait_until(
        "b's LISTEN connection, named after the client, and its first poll",
        Duration::from_secs(10),
        || async {
            let listening: i64 = admin
                .query_typed_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE application_name = $1 AND query LIKE 'LISTEN%'",
                    &[(&listen_name, tokio_postgres::types::Type::TEXT)],
                )
                .await
                .unwrap()
                .get(0);
            listening == 1 && b.statements() > 0
        },
    )
    .await;
}
