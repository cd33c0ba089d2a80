//! Server-side session timeouts never cost a leader its lock. A database or
//! a role may set `idle_session_timeout`, `statement_timeout`,
//! `idle_in_transaction_session_timeout` or `lock_timeout` for every session
//! (managed services often do). Each test sets one of them to 300 ms, first
//! with `ALTER DATABASE … SET`, then with `ALTER ROLE … SET` for a
//! least-privilege candidate, and runs the same scenario as with stock
//! settings: session-backend leader with a blocking and a polling standby,
//! lease-backend leader with `LISTEN` and a standby, an idle `LockSession`
//! holder with exclusive and shared waiters, and a migration that waits for
//! its lock. Leaders keep their term for many multiples of the timeout,
//! waiters that waited longer than it are granted, and no connection pgelect
//! owns is ended by the server.
//!
//! Transaction locks run in the caller's transaction, under the caller's
//! settings: a test shows that pgelect leaves them as they were and what a
//! caller's `statement_timeout` means for a bounded wait. The lease backend
//! through PgBouncer in transaction mode is run with all four settings.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::support::CANDIDATE;
use pgelect::lock::{LockMode, Wait};
use pgelect::{
    election::Backend, election::StandbyMode, ConnectOptions, Elector, ElectorBuilder, Error,
    LockKey, LockSession,
};
use pgelect_testkit::{Cluster, PgBouncer, PoolMode, TestDb};
use tokio_postgres::Client;

/// Well under every interval the scenario uses (renewals every 500 ms,
/// waits of seconds), so a timeout pgelect does not switch off fires many
/// times over.
const TIMEOUT: &str = "300ms";

/// How long leaders and holders are watched: more than eight timeouts.
const HOLD: Duration = Duration::from_millis(2500);

const PASSWORD: &str = "timeouts-pw";

/// Where the setting is made.
#[derive(Clone, Copy, Debug)]
enum Level {
    Database,
    Role,
}

/// Users of a database whose sessions get `settings = TIMEOUT` at `level`.
struct Users {
    /// Stands for election and takes locks.
    candidate: ConnectOptions,
    /// Migrates and asks leaders to resign.
    owner: ConnectOptions,
}

/// Whether the server has the setting `s` (PostgreSQL 13 has no
/// `idle_session_timeout`: there is nothing to switch off, so nothing to test).
async fn has_setting(c: &tokio_postgres::Client, s: &str) -> bool {
    let known: bool = c
        .query_one(
            "SELECT count(*) > 0 FROM pg_settings WHERE name = $1",
            &[&s],
        )
        .await
        .unwrap()
        .get(0);
    if !known {
        println!("this server has no {s}: not set");
    }
    known
}

/// A migrated database whose sessions get each of `settings` = [`TIMEOUT`]
/// at `level`, and its users, all subject to the settings. At the database
/// level both are the superuser; at the role level the candidate has the
/// grants the book lists only, and the owner is a non-superuser with `CREATE` on
/// the database that migrated it and gave those grants. The settings are
/// shown to be in effect for both (where the server has them).
async fn set_up(hint: &str, settings: &[&str], level: Level) -> (TestDb, Users) {
    let db = TestDb::new(hint).await;
    let admin = db.connect().await;
    let users = match level {
        Level::Database => {
            for s in settings {
                if !has_setting(&admin, s).await {
                    continue;
                }
                admin
                    .batch_execute(&format!(
                        "ALTER DATABASE \"{}\" SET {s} = '{TIMEOUT}'",
                        db.name()
                    ))
                    .await
                    .unwrap();
            }
            let superuser = ConnectOptions::from_url(&db.url()).unwrap();
            pgelect::migrate(&superuser).await.expect("migrate");
            Users {
                candidate: superuser.clone(),
                owner: superuser,
            }
        }
        Level::Role => {
            let owner_url = db.create_role("owner", PASSWORD, false).await;
            let owner_role = db.role_name("owner");
            let cand_url = db.create_role("cand", PASSWORD, false).await;
            let cand_role = db.role_name("cand");
            admin
                .batch_execute(&format!(
                    "GRANT CREATE ON DATABASE \"{}\" TO \"{owner_role}\"",
                    db.name()
                ))
                .await
                .unwrap();
            for r in [&owner_role, &cand_role] {
                for s in settings {
                    if !has_setting(&admin, s).await {
                        continue;
                    }
                    admin
                        .batch_execute(&format!("ALTER ROLE \"{r}\" SET {s} = '{TIMEOUT}'"))
                        .await
                        .unwrap();
                }
            }
            let owner = ConnectOptions::from_url(&owner_url).unwrap();
            pgelect::migrate(&owner).await.expect("the owner migrates");
            let mut config = db.config();
            config.user(&owner_role).password(PASSWORD);
            let (c, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            for g in CANDIDATE {
                c.batch_execute(&g.replace("{r}", &format!("\"{cand_role}\"")))
                    .await
                    .unwrap();
            }
            Users {
                candidate: ConnectOptions::from_url(&cand_url).unwrap(),
                owner,
            }
        }
    };
    for o in [&users.candidate, &users.owner] {
        let (c, conn) = o
            .driver_config()
            .connect(tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        for s in settings {
            if !has_setting(&c, s).await {
                continue;
            }
            let shown: String = c.query_one(&format!("SHOW {s}"), &[]).await.unwrap().get(0);
            assert_eq!(shown, TIMEOUT, "{s} at {level:?} level is in effect");
        }
    }
    (db, users)
}

/// Session-backend timings: renewals every 500 ms and heartbeats every
/// 500 ms (each longer than the timeouts, so the connection sits idle past
/// them), standbys' lock waits in 1 s slices; a generous ttl (6 s) and
/// heartbeat timeout (2 s), so that a loaded test machine does not cost a
/// leader its lock.
fn session(o: &ConnectOptions, role: &str, node: &str) -> ElectorBuilder {
    Elector::builder(o.clone(), role)
        .node_id(node)
        .ttl(Duration::from_secs(6))
        .renew_every(Duration::from_millis(500))
        .session(|s| {
            s.heartbeat(Duration::from_millis(500))
                .heartbeat_timeout(Duration::from_secs(2))
        })
        .check_every(Duration::from_millis(200))
        .session(|s| s.wait_slice(Duration::from_secs(1)))
}

/// Lease-backend timings: renewals every 500 ms (idle in between for
/// longer than the timeout), `LISTEN` on `listen`; ttl 6 s and statements
/// bounded by 2 s, generous for a loaded machine.
fn lease(o: &ConnectOptions, listen: &ConnectOptions, role: &str, node: &str) -> ElectorBuilder {
    Elector::builder(o.clone(), role)
        .backend(Backend::Lease)
        .lease(|l| l.listen_via(listen.clone()))
        .node_id(node)
        .ttl(Duration::from_secs(6))
        .renew_every(Duration::from_millis(500))
        .lease(|l| {
            l.statement_timeout(Duration::from_secs(2))
                .retry_every(Duration::from_millis(200))
        })
        .check_every(Duration::from_millis(200))
}

/// The backends of pgelect's connections to `db` (application name
/// `pgelect:…`), by pid.
async fn pgelect_backends(admin: &Client, db: &TestDb) -> BTreeMap<i32, String> {
    admin
        .query(
            "SELECT pid, application_name FROM pg_stat_activity
              WHERE datname = $1 AND application_name LIKE 'pgelect:%'",
            &[&db.name()],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// A superuser connection for the test's own queries, exempt from the
/// timeouts under test (the database's settings apply to it too).
async fn admin(db: &TestDb) -> Client {
    let c = db.connect().await;
    // set_config through pg_settings: skips what the server lacks.
    c.batch_execute(
        "SELECT set_config(name, '0', false) FROM pg_settings
          WHERE name IN ('idle_session_timeout', 'statement_timeout',
                         'idle_in_transaction_session_timeout', 'lock_timeout')",
    )
    .await
    .unwrap();
    c
}

async fn within<T>(what: &str, limit: Duration, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| panic!("{what} within {limit:?}"))
}

/// The scenario: everything pgelect does on connections it owns, watched
/// for [`HOLD`] under the timeout, then handed over.
async fn scenario(db: &TestDb, users: &Users, label: &str) {
    let o = &users.candidate;
    let admin = admin(db).await;
    let k1 = LockKey::from_i64(101);
    let k2 = LockKey::from_i64(102);

    // Session backend: leader, blocking standby (watching), polling standby.
    let a = session(o, "s", "a").build().unwrap();
    let la = within(
        "the session leader",
        Duration::from_secs(10),
        a.leadership(),
    )
    .await
    .unwrap();
    let b = session(o, "s", "b").build().unwrap();
    let mut seen_by_b = b.watch();
    let waiting_b = tokio::spawn(async move { b.leadership().await.map(|l| (l, b)) });
    let c = session(o, "s", "c")
        .session(|s| {
            s.standby(StandbyMode::Polling {
                interval: Duration::from_millis(100),
            })
        })
        .build()
        .unwrap();
    let waiting_c = tokio::spawn(async move { c.leadership().await.map(|l| (l, c)) });

    // Lease backend, LISTEN on the same (direct) server.
    let l = lease(o, o, "l", "a").build().unwrap();
    let ll = within("the lease leader", Duration::from_secs(10), l.leadership())
        .await
        .unwrap();
    let m = lease(o, o, "l", "b").build().unwrap();
    let waiting_m = tokio::spawn(async move { m.leadership().await.map(|l| (l, m)) });

    // Lock sessions: an idle holder of k1 (exclusive) and k2 (shared), an
    // exclusive waiter on k1, a bounded shared waiter... on k1 too, and a
    // second shared holder of k2.
    let holder = LockSession::builder(o)
        .name("holder")
        .connect()
        .await
        .unwrap();
    let g1 = holder
        .acquire(k1, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let g2 = holder
        .acquire(k2, LockMode::Shared, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let waiter = LockSession::builder(o)
        .name("waiter")
        .wait_slice(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    // Each waiter lets go as soon as it is granted (the two wait for one
    // key) and reports when it was granted.
    let waiting_lock = tokio::spawn(async move {
        let g = waiter
            .acquire(k1, LockMode::Exclusive, Wait::Forever)
            .await
            .map(Option::unwrap)
            .expect("the exclusive waiter is granted");
        let at = Instant::now();
        assert!(g.release().await.unwrap());
        at
    });
    let bounded = LockSession::builder(o)
        .name("bounded")
        .connect()
        .await
        .unwrap();
    let waiting_bounded = tokio::spawn(async move {
        let g = bounded
            .acquire(k1, LockMode::Shared, Wait::AtMost(Duration::from_secs(30)))
            .await
            .map(Option::unwrap)
            .expect("the bounded shared waiter is granted");
        let at = Instant::now();
        assert!(g.release().await.unwrap());
        at
    });
    let sharer = LockSession::builder(o)
        .name("sharer")
        .connect()
        .await
        .unwrap();
    let g2b = sharer
        .acquire(k2, LockMode::Shared, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();

    tokio::select! {
        _ = db.wait_for_advisory_waiters(3) => {}
        _ = la.lost() => {
            logged(db, None, "FATAL");
            panic!("{label}: the session leader was lost while its standbys lined up: {:?}", la.loss().map(|l| l.reason()))
        }
        _ = ll.lost() => panic!("{label}: the lease leader was lost while its standbys lined up: {:?}", ll.loss().map(|l| l.reason())),
    }
    within(
        "the blocking standby's observer reads the leader",
        Duration::from_secs(10),
        seen_by_b.wait_for(|x| x.is_some()),
    )
    .await
    .unwrap();

    // Watch: nobody loses anything, no connection of pgelect's ends.
    let before = pgelect_backends(&admin, db).await;
    let terms = (la.term(), ll.term());
    let started = Instant::now();
    tokio::time::sleep(HOLD).await;
    let after = pgelect_backends(&admin, db).await;
    let ended: Vec<_> = before
        .iter()
        .filter(|(pid, _)| !after.contains_key(pid))
        .collect();
    println!(
        "{label}: {} pgelect connections watched for {:?}; ended meanwhile: {ended:?}",
        before.len(),
        started.elapsed()
    );
    assert!(
        ended.is_empty(),
        "{label}: the server ended pgelect's connections {ended:?}"
    );
    assert!(
        !la.is_lost() && !ll.is_lost(),
        "{label}: a leader was lost: session {:?}, lease {:?}",
        la.loss().map(|l| l.reason()),
        ll.loss().map(|l| l.reason())
    );
    assert_eq!((la.term(), ll.term()), terms);
    assert!(!holder.is_lost() && !sharer.is_lost());
    assert!(!g1.is_lost() && !g2.is_lost() && !g2b.is_lost());
    for (what, done) in [
        ("blocking standby", waiting_b.is_finished()),
        ("polling standby", waiting_c.is_finished()),
        ("lease standby", waiting_m.is_finished()),
        ("lock waiter", waiting_lock.is_finished()),
        ("bounded lock waiter", waiting_bounded.is_finished()),
    ] {
        assert!(!done, "{label}: the {what} stopped waiting");
    }

    // Hand-overs, each after a wait many times the timeout.
    let t = Instant::now();
    assert!(g1.release().await.unwrap());
    let granted = within("the lock waiter", Duration::from_secs(10), waiting_lock)
        .await
        .unwrap();
    println!(
        "{label}: exclusive LockSession waiter granted {:?} after the release",
        granted - t
    );
    let granted = within(
        "the bounded waiter",
        Duration::from_secs(10),
        waiting_bounded,
    )
    .await
    .unwrap();
    println!(
        "{label}: bounded shared LockSession waiter granted {:?} after the release",
        granted - t
    );

    // The blocking standby is usually first in the lock queue, but between
    // two of its 1 s wait slices the polling one may take the lock: either
    // order is right, as long as both are elected in turn.
    let t = Instant::now();
    let term_a = la.term();
    la.resign().await.unwrap();
    let (mut waiting_b, mut waiting_c) = (waiting_b, waiting_c);
    let (first, second, rest) = within("a standby", Duration::from_secs(10), async {
        tokio::select! {
            r = &mut waiting_b => ("blocking", "polling", (r, waiting_c)),
            r = &mut waiting_c => ("polling", "blocking", (r, waiting_b)),
        }
    })
    .await;
    let (l1, _e1) = rest.0.unwrap().unwrap();
    assert!(l1.term() > term_a);
    println!(
        "{label}: {first} standby elected {:?} after the resign",
        t.elapsed()
    );
    let t = Instant::now();
    let term_1 = l1.term();
    l1.resign().await.unwrap();
    let (l2, _e2) = within("the other standby", Duration::from_secs(10), rest.1)
        .await
        .unwrap()
        .unwrap();
    assert!(l2.term() > term_1);
    println!(
        "{label}: {second} standby elected {:?} after the resign",
        t.elapsed()
    );
    l2.resign().await.unwrap();

    // A resign request for the lease leader, heard on its LISTEN connection.
    let t = Instant::now();
    let term_l = ll.term();
    let asked = pgelect::admin::request_resign(&users.owner, "l")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(asked.term, term_l);
    within(
        "the lease leader steps down",
        Duration::from_secs(10),
        ll.lost(),
    )
    .await;
    ll.resign().await.unwrap();
    let (lm, _m) = within("the lease standby", Duration::from_secs(10), waiting_m)
        .await
        .unwrap()
        .unwrap();
    assert!(lm.term() > term_l);
    println!(
        "{label}: lease standby elected {:?} after request_resign",
        t.elapsed()
    );
    lm.resign().await.unwrap();

    // A migration waits for its lock longer than the timeout.
    let migration_lock = LockKey::from_name("pgelect.migrate.pgelect").unwrap();
    let g = holder
        .acquire(migration_lock, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let migrating = {
        let o = users.owner.clone();
        tokio::spawn(async move { pgelect::migrate(&o).await })
    };
    db.wait_for_advisory_waiters(1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(g.release().await.unwrap());
    let applied = within("the migration", Duration::from_secs(10), migrating)
        .await
        .unwrap();
    assert_eq!(applied.expect("the migration waits and runs"), 0);
}

async fn run_both_levels(setting: &str) {
    for level in [Level::Database, Level::Role] {
        let hint = format!("tmo_{setting}_{level:?}");
        let (db, users) = set_up(&hint, &[setting], level).await;
        scenario(&db, &users, &format!("{setting} = {TIMEOUT} ({level:?})")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_session_timeout_ends_no_connection_pgelect_owns() {
    run_both_levels("idle_session_timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_cuts_no_wait_pgelect_makes() {
    run_both_levels("statement_timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_in_transaction_session_timeout_ends_no_connection_pgelect_owns() {
    run_both_levels("idle_in_transaction_session_timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_timeout_cuts_no_wait_pgelect_makes() {
    run_both_levels("lock_timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_four_at_once() {
    let all = [
        "idle_session_timeout",
        "statement_timeout",
        "idle_in_transaction_session_timeout",
        "lock_timeout",
    ];
    let (db, users) = set_up("tmo_all", &all, Level::Database).await;
    scenario(&db, &users, "all four = 300ms (Database)").await;
}

/// Transaction locks run in the caller's transaction, under the caller's
/// settings: pgelect changes none of them for longer than its own
/// statement, and the caller's `statement_timeout` (here the database's
/// 300 ms) bounds even a wait with a longer bound of pgelect's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_locks_keep_the_callers_timeouts() {
    let (db, users) = set_up(
        "tmo_xact",
        &["statement_timeout", "lock_timeout"],
        Level::Database,
    )
    .await;
    let o = users.candidate;
    let key = LockKey::from_i64(7);
    let holder = LockSession::connect(&o).await.unwrap();
    let g = holder
        .acquire(key, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let mut caller = db.connect().await;

    // pgelect's bound (5 s) is longer than the caller's: the caller's wins.
    let settings = "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')";
    let tx = caller.transaction().await.unwrap();
    let t = Instant::now();
    let e = pgelect::lock::xact_lock(
        &tx,
        key,
        LockMode::Exclusive,
        Wait::AtMost(Duration::from_secs(5)),
    )
    .await
    .unwrap_err();
    let waited = t.elapsed();
    println!("xact_lock_timeout(5 s) under the caller's 300 ms: {e} after {waited:?}");
    assert!(matches!(e, Error::LockTimeout { .. }), "{e:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    tx.rollback().await.unwrap();

    // The caller lifts its own limits for this transaction: pgelect's bound
    // applies, and the caller's values are as they were afterwards.
    let tx = caller.transaction().await.unwrap();
    tx.batch_execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = '4s'")
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        g.release().await.unwrap()
    });
    let t = Instant::now();
    pgelect::lock::xact_lock(
        &tx,
        key,
        LockMode::Exclusive,
        Wait::AtMost(Duration::from_secs(10)),
    )
    .await
    .expect("granted when the holder lets go after 1 s");
    println!("xact_lock_timeout granted after {:?}", t.elapsed());
    let row = tx.query_one(settings, &[]).await.unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        ("0".to_owned(), "4s".to_owned()),
        "the caller's settings are as it left them"
    );
    tx.commit().await.unwrap();
    assert!(release.await.unwrap());
    let row = caller.query_one(settings, &[]).await.unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        (TIMEOUT.to_owned(), TIMEOUT.to_owned()),
        "the database's settings are back after the transaction"
    );
}

/// The lease backend through PgBouncer in transaction mode, with all four
/// settings on the database. The pooler owns the server sessions: the
/// idle ones are ended by the server and replaced by PgBouncer; pgelect's
/// statements are short, so neither `statement_timeout` nor `lock_timeout`
/// reaches them. The leader keeps its term, a standby takes over on a
/// resign request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_backend_through_pgbouncer_keeps_its_term() {
    if !pgelect_testkit::pgbouncer_available() {
        println!("skipped: pgbouncer is not installed");
        return;
    }
    let cluster = tokio::task::spawn_blocking(Cluster::shared).await.unwrap();
    let db = TestDb::on(cluster, "tmo_bouncer").await;
    let direct = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&direct).await.unwrap();
    let admin = db.connect().await;
    for s in [
        "idle_session_timeout",
        "statement_timeout",
        "idle_in_transaction_session_timeout",
        "lock_timeout",
    ] {
        if !has_setting(&admin, s).await {
            continue;
        }
        admin
            .batch_execute(&format!(
                "ALTER DATABASE \"{}\" SET {s} = '{TIMEOUT}'",
                db.name()
            ))
            .await
            .unwrap();
    }
    let bouncer = PgBouncer::start(cluster, PoolMode::Transaction).expect("pgbouncer starts");
    let pooled = ConnectOptions::from_url(&bouncer.url(db.name())).unwrap();

    let a = lease(&pooled, &direct, "p", "a").build().unwrap();
    let la = within("the pooled leader", Duration::from_secs(10), a.leadership())
        .await
        .unwrap();
    let b = lease(&pooled, &direct, "p", "b").build().unwrap();
    let waiting_b = tokio::spawn(async move { b.leadership().await.map(|l| (l, b)) });
    let term = la.term();
    tokio::time::sleep(HOLD).await;
    assert!(!la.is_lost(), "the pooled leader kept its lease");
    assert_eq!(la.term(), term);
    assert!(!waiting_b.is_finished());
    let statements = a.lease_statements();
    let ended = logged(&db, None, "idle-session timeout");
    println!(
        "through PgBouncer: leader kept term {term} for {HOLD:?} ({statements} lease statements); pooled server connections the server ended for idle_session_timeout, replaced by PgBouncer: {ended}"
    );

    let t = Instant::now();
    pgelect::admin::request_resign(&pooled, "p")
        .await
        .unwrap()
        .unwrap();
    within(
        "the pooled leader steps down",
        Duration::from_secs(10),
        la.lost(),
    )
    .await;
    la.resign().await.unwrap();
    let (lb, _b) = within("the pooled standby", Duration::from_secs(10), waiting_b)
        .await
        .unwrap()
        .unwrap();
    assert!(lb.term() > term);
    println!(
        "through PgBouncer: standby elected {:?} after request_resign",
        t.elapsed()
    );
    lb.resign().await.unwrap();
    drop(bouncer);
}

/// `lock_timeout` reaches a leader where its renewal waits for a row lock:
/// an application that fences holds the role's row `FOR SHARE` until its
/// transaction ends, and the renewal's `UPDATE` waits for that. With stock
/// settings the renewal just waits (here 450 ms, within its bound); under a
/// 300 ms `lock_timeout` it must still wait, for both backends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_timeout_fails_no_renewal_that_waits_for_a_fencing_transaction() {
    for level in [Level::Database, Level::Role] {
        let (db, users) = set_up(&format!("tmo_fence_{level:?}"), &["lock_timeout"], level).await;
        let o = &users.candidate;
        let s = session(o, "s", "a").build().unwrap();
        let ls = s.leadership().await.unwrap();
        let l = lease(o, o, "l", "a").build().unwrap();
        let ll = l.leadership().await.unwrap();
        let (term_s, term_l) = (ls.term(), ll.term());
        let pids = pgelect_backends(&admin(&db).await, &db).await;
        let pid_of = |name: &str| {
            *pids
                .iter()
                .find(|(_, n)| n.as_str() == name)
                .unwrap_or_else(|| panic!("{name} connected: {pids:?}"))
                .0
        };
        let (session_pid, lease_pid) = (pid_of("pgelect:s:a"), pid_of("pgelect:lease"));
        // Each leader's application fences in transactions of 450 ms, 150 ms
        // apart, for 5 s: most renewals (every 500 ms) wait, and those that
        // start early in a transaction wait longer than 300 ms.
        let started = Instant::now();
        let (fs, fl) = tokio::join!(
            fence_until(&db, &ls, started + 2 * HOLD),
            fence_until(&db, &ll, started + 2 * HOLD)
        );
        let fenced = fs + fl;
        let cancelled_session = lock_timeouts_logged(&db, session_pid);
        let cancelled_lease = lock_timeouts_logged(&db, lease_pid);
        println!(
            "lock_timeout = {TIMEOUT} ({level:?}): {fenced} fencing transactions of 450 ms in {:?}; renewals cancelled by lock_timeout: session {cancelled_session}, lease {cancelled_lease} (retried); session leader lost: {:?}, lease leader lost: {:?}",
            started.elapsed(),
            ls.loss().map(|l| l.reason()),
            ll.loss().map(|l| l.reason())
        );
        assert_eq!(
            cancelled_session, 0,
            "{level:?}: the session leader's renewals wait for the fence, as with stock settings"
        );
        assert!(
            !ls.is_lost() && !ll.is_lost(),
            "{level:?}: a leader was lost"
        );
        assert_eq!((ls.term(), ll.term()), (term_s, term_l));
        ls.resign().await.unwrap();
        ll.resign().await.unwrap();
    }
}

/// Statements of backend `pid` on `db` the server cancelled for
/// `lock_timeout`, from the shared cluster's log (its line prefix names the
/// pid and the database).
fn lock_timeouts_logged(db: &TestDb, pid: i32) -> usize {
    logged(db, Some(pid), "canceling statement due to lock timeout")
}

/// Lines of the shared cluster's log for `db` (and backend `pid`, if
/// given) that contain `needle`; each is printed with the line after it.
fn logged(db: &TestDb, pid: Option<i32>, needle: &str) -> usize {
    let log = Cluster::shared().data_dir().join("server.log");
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut count = 0;
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if pid.is_none_or(|pid| line.contains(&format!("[{pid}] ")))
            && line.contains(&format!("@{} ", db.name()))
            && line.contains(needle)
        {
            count += 1;
            if let Some(next) = lines.peek() {
                println!("  {line}\n  {next}");
            }
        }
    }
    count
}

/// Fences `leadership` in transactions of 450 ms, 150 ms apart, until
/// `until`; how many.
async fn fence_until(db: &TestDb, leadership: &pgelect::Leadership, until: Instant) -> usize {
    let mut fencer = admin(db).await;
    let mut fenced = 0;
    while Instant::now() < until {
        let tx = fencer.transaction().await.unwrap();
        leadership.fence(&tx).await.unwrap();
        tokio::time::sleep(Duration::from_millis(450)).await;
        tx.commit().await.unwrap();
        fenced += 1;
        // Room for the renewal that waited (the fencing transactions
        // would starve it with stock settings too).
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    fenced
}
