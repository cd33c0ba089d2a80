//! Least privilege: the schema migrated by an owner who
//! is not a superuser, every other user given exactly the grants of
//! `pgelect::admin::grant_statements` (the book's list, checked here line by
//! line) by that owner, a representative run of the election and lock
//! behaviour as those users, and zombie preemption with and without
//! `pg_signal_backend`.
//!
//! The zombie tests read warnings from a tracing capture installed per test
//! (each runs on its own current-thread runtime, so the capture sees only
//! its own tasks).

use std::time::{Duration, Instant};

use pgelect::{
    admin::grant_statements, admin::preemption_grant, admin::UserKind, election::Backend,
    election::StandbyMode, schema::SchemaName, ConnectOptions, Elector, Error, LockKey,
    LockSession,
};
use pgelect_testkit::TestDb;
use tokio_postgres::{Client, NoTls};

use crate::support;
use pgelect::lock::{LockMode, Wait};
use support::{fast_session, term_of, Candidate, Log};

const PASSWORD: &str = "least-privilege-2";

/// A database migrated by a non-superuser owner, and its users.
struct Setup {
    db: TestDb,
    /// The owner: not a superuser, `CREATE` on the database (its only
    /// grant, from `grant_statements(Owner)` run by a superuser).
    owner: ConnectOptions,
    owner_client: Client,
}

/// A login role with CONNECT only; its options.
async fn login(db: &TestDb, name: &str) -> ConnectOptions {
    ConnectOptions::from_url(&db.create_role(name, PASSWORD, false).await).unwrap()
}

async fn client_of(o: &ConnectOptions) -> Client {
    let (c, conn) = o.driver_config().connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    c
}

/// Runs `grant_statements(kind, user)` on `client`.
async fn grant(client: &Client, kind: UserKind, user: &str) {
    for g in grant_statements(kind, user, &SchemaName::default()).unwrap() {
        client
            .batch_execute(&g.sql)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", g.sql));
    }
}

/// The owner role starts as NOLOGIN (as a group role that owns things
/// would), is given LOGIN, and its grant by a superuser; it migrates.
async fn owned(hint: &str) -> Setup {
    let db = TestDb::new(hint).await;
    let admin = db.connect().await;
    let owner_name = db.role_name("owner");
    admin
        .batch_execute(&format!("CREATE ROLE \"{owner_name}\" NOLOGIN"))
        .await
        .unwrap();
    let owner = login(&db, "owner").await; // ALTERs it to LOGIN
    grant(&admin, UserKind::Owner, &owner_name).await;
    let applied = pgelect::migrate(&owner).await.expect("the owner migrates");
    assert_eq!(
        i64::from(applied),
        i64::from(pgelect::schema::SCHEMA_VERSION)
    );
    let row = admin
        .query_one(
            "SELECT r.rolsuper, r.rolcreaterole, r.rolcreatedb,
                    (SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pgelect')
               FROM pg_roles r WHERE r.rolname = $1",
            &[&owner_name],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, bool>(0),
            row.get::<_, bool>(1),
            row.get::<_, bool>(2)
        ),
        (false, false, false),
        "the owner has no special attribute"
    );
    assert_eq!(
        row.get::<_, String>(3),
        owner_name,
        "the owner owns the schema"
    );
    let owner_client = client_of(&owner).await;
    Setup {
        db,
        owner,
        owner_client,
    }
}

impl Setup {
    /// A login role given `kinds`' grants by the owner (not a superuser).
    async fn user(&self, name: &str, kinds: &[UserKind]) -> ConnectOptions {
        let o = login(&self.db, name).await;
        for kind in kinds {
            grant(&self.owner_client, *kind, &self.db.role_name(name)).await;
        }
        o
    }
}

/// The book's privilege list and the library's are the same statements:
/// each `GRANT` line of the privileges chapter
/// (`docs/src/operations/privileges.md`), for the users it names (`app`,
/// `fencer`, `ops`, `watcher`), is the library's output for that kind, in
/// order.
#[test]
fn the_book_lists_the_librarys_grants() {
    let section = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/src/operations/privileges.md"
    ));
    let grants: Vec<String> = section
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("GRANT "))
        .map(|l| l.split(';').next().unwrap().to_owned())
        .collect();
    let schema = SchemaName::default();
    let mut expected = Vec::new();
    for (kind, user) in [
        (UserKind::Candidate, "app"),
        (UserKind::Fencer, "fencer"),
        (UserKind::Operator, "ops"),
        (UserKind::Watcher, "watcher"),
    ] {
        let unquote = |s: String| s.replace(&format!("\"{user}\""), user);
        for g in grant_statements(kind, user, &schema).unwrap() {
            expected.push(unquote(g.sql));
        }
        if kind == UserKind::Candidate {
            expected.push(unquote(preemption_grant(user).unwrap().sql));
        }
    }
    assert_eq!(grants, expected);
}

/// The owner, not a superuser, migrates and gives every other kind its
/// grants; each then does its job: a candidate leads, a fencer fences its
/// term, an operator moves it, a watcher sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_superuser_owner_migrates_and_its_grants_suffice_for_every_kind() {
    let s = owned("lp_owner").await;
    let cand = s.user("cand", &[UserKind::Candidate]).await;
    let fencer = s.user("fencer", &[UserKind::Fencer]).await;
    let ops = s.user("ops", &[UserKind::Operator]).await;
    let watcher = s.user("watcher", &[UserKind::Watcher]).await;

    let a = fast_session(&cand, "jobs", "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let f = client_of(&fencer).await;
    f.query("SELECT pgelect.fence('jobs', $1)", &[&la.term().get()])
        .await
        .expect("the fencer fences the current term");
    let seen = pgelect::admin::current_leader(&watcher, "jobs")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(seen.term, la.term());
    let asked = pgelect::admin::request_resign(&ops, "jobs")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(asked.term, la.term());
    tokio::time::timeout(Duration::from_secs(10), la.lost())
        .await
        .expect("the leader steps down at the operator's request");
    la.resign().await.unwrap();
    // Migrating again is a no-op for the owner.
    assert_eq!(pgelect::migrate(&s.owner).await.unwrap(), 0);
}

/// A representative run of the election and lock behaviour as a candidate
/// with exactly the listed grants (given by the non-superuser owner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_election_and_lock_behaviour_as_a_least_privilege_candidate() {
    let s = owned("lp_suite").await;
    let o = s.user("cand", &[UserKind::Candidate]).await;
    let admin = s.db.connect().await;
    let mut fencer = client_of(&s.user("fencer", &[UserKind::Fencer]).await).await;

    // Session backend: a leader fences; a blocking standby takes over on a
    // resign; a polling standby on a killed connection.
    let a = fast_session(&o, "s", "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    // The application's writes, on a connection of a user with the
    // fencer's grants; the candidate's grants alone do not include `fence`.
    let tx = fencer.transaction().await.unwrap();
    la.fence(&tx)
        .await
        .expect("the leader's term fences the writes");
    tx.rollback().await.unwrap();
    let own = client_of(&o).await;
    let e = la.fence(&own).await.unwrap_err();
    assert!(matches!(e, Error::Permission { .. }), "{e:?}");
    let b = fast_session(&o, "s", "b").build().unwrap();
    let waiting_b = tokio::spawn(async move { b.leadership().await.map(|l| (l, b)) });
    s.db.wait_for_advisory_waiters(1).await;
    let term_a = la.term();
    let t = Instant::now();
    la.resign().await.unwrap();
    let (lb, _b) = tokio::time::timeout(Duration::from_secs(10), waiting_b)
        .await
        .expect("the blocking standby takes over")
        .unwrap()
        .unwrap();
    assert!(lb.term() > term_a);
    println!(
        "session: blocking standby elected {:?} after the resign",
        t.elapsed()
    );
    let c = fast_session(&o, "s", "c")
        .session(|s| {
            s.standby(StandbyMode::Polling {
                interval: Duration::from_millis(100),
            })
        })
        .build()
        .unwrap();
    let waiting_c = tokio::spawn(async move { c.leadership().await.map(|l| (l, c)) });
    let pid: i32 = admin
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgelect:s:b' AND datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let t = Instant::now();
    admin
        .query("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), lb.lost())
        .await
        .expect("the leader notices its killed connection");
    let (lc, _c) = tokio::time::timeout(Duration::from_secs(20), waiting_c)
        .await
        .expect("the polling standby takes over")
        .unwrap()
        .unwrap();
    assert!(lc.term() > lb.term());
    println!(
        "session: polling standby elected {:?} after the leader's connection was killed",
        t.elapsed()
    );
    // The old term is fenced off, by a fencer with nothing on the table.
    let stale = fencer
        .query("SELECT pgelect.fence('s', $1)", &[&lb.term().get()])
        .await
        .unwrap_err();
    assert_eq!(
        stale.code().unwrap().code(),
        pgelect::schema::SQLSTATE_STALE_TERM
    );
    lc.resign().await.unwrap();

    // Lease backend: a resign hands over; a killed leader process is
    // replaced once its lease ends.
    let lease = |node: &str| {
        Elector::builder(o.clone(), "l")
            .backend(Backend::Lease)
            .lease(|l| l.listen_via(o.clone()))
            .node_id(node)
            .ttl(Duration::from_secs(2))
            .renew_every(Duration::from_millis(500))
            .lease(|l| l.retry_every(Duration::from_millis(200)))
            .check_every(Duration::from_millis(200))
            .build()
            .unwrap()
    };
    let x = lease("x");
    let lx = x.leadership().await.unwrap();
    let y = lease("y");
    let waiting_y = tokio::spawn(async move { y.leadership().await.map(|l| (l, y)) });
    let t = Instant::now();
    let term_x = lx.term();
    lx.resign().await.unwrap();
    let (ly, y) = tokio::time::timeout(Duration::from_secs(10), waiting_y)
        .await
        .expect("the lease standby takes over")
        .unwrap()
        .unwrap();
    assert!(ly.term() > term_x);
    println!("lease: standby elected {:?} after the resign", t.elapsed());
    ly.resign().await.unwrap();
    drop(y);
    let cand_url = s.db.create_role("cand", PASSWORD, false).await;
    let leader = Candidate::spawn(&["--backend", "lease", &cand_url, "lp", "2000"]);
    let old = term_of(&leader.expect("ELECTED", Duration::from_secs(20)));
    let z = Elector::builder(o.clone(), "lp")
        .backend(Backend::Lease)
        .ttl(Duration::from_secs(2))
        .renew_every(Duration::from_millis(500))
        .lease(|l| l.retry_every(Duration::from_millis(200)))
        .build()
        .unwrap();
    let waiting_z = tokio::spawn(async move { z.leadership().await.map(|l| (l, z)) });
    let t = Instant::now();
    leader.signal("-KILL");
    let (lz, _z) = tokio::time::timeout(Duration::from_secs(20), waiting_z)
        .await
        .expect("the lease standby replaces a killed leader")
        .unwrap()
        .unwrap();
    assert!(lz.term() > old);
    println!(
        "lease: killed leader process replaced after {:?} (ttl 2 s)",
        t.elapsed()
    );
    lz.resign().await.unwrap();

    // Lock sessions: exclusive, shared, bounded waits (no grant needed).
    let k = LockKey::from_name("lp:lock").unwrap();
    let s1 = LockSession::connect(&o).await.unwrap();
    let s2 = LockSession::connect(&o).await.unwrap();
    let g = s1
        .acquire(k, LockMode::Exclusive, Wait::Forever)
        .await
        .map(Option::unwrap)
        .unwrap();
    let e = s2
        .acquire(
            k,
            LockMode::Exclusive,
            Wait::AtMost(Duration::from_millis(300)),
        )
        .await
        .map(Option::unwrap)
        .unwrap_err();
    assert!(matches!(e, Error::LockTimeout { .. }), "{e:?}");
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        g.release().await.unwrap()
    });
    let g2 = s2
        .acquire(k, LockMode::Shared, Wait::Forever)
        .await
        .map(Option::unwrap)
        .expect("a shared waiter is granted");
    assert!(release.await.unwrap());
    let g1 = s1
        .acquire(k, LockMode::Shared, Wait::AtMost(Duration::from_secs(2)))
        .await
        .map(Option::unwrap)
        .expect("two shared holders");
    let s3 = LockSession::connect(&o).await.unwrap();
    assert!(
        s3.acquire(k, LockMode::Exclusive, Wait::Never)
            .await
            .unwrap()
            .is_none(),
        "shared holders keep an exclusive taker out"
    );
    g1.release().await.unwrap();
    g2.release().await.unwrap();

    // Transaction locks on the candidate's own connection.
    let mut c1 = client_of(&o).await;
    let mut c2 = client_of(&o).await;
    let t1 = c1.transaction().await.unwrap();
    pgelect::lock::xact_lock(&t1, k, LockMode::Exclusive, Wait::Forever)
        .await
        .unwrap();
    let t2 = c2.transaction().await.unwrap();
    assert!(
        !pgelect::lock::xact_lock(&t2, k, LockMode::Exclusive, Wait::Never)
            .await
            .unwrap()
    );
    t2.rollback().await.unwrap();
    let t2 = c2.transaction().await.unwrap();
    let e = pgelect::lock::xact_lock(
        &t2,
        k,
        LockMode::Exclusive,
        Wait::AtMost(Duration::from_millis(200)),
    )
    .await
    .unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    t2.rollback().await.unwrap();
    t1.commit().await.unwrap();
    let t2 = c2.transaction().await.unwrap();
    pgelect::lock::xact_lock(
        &t2,
        k,
        LockMode::Shared,
        Wait::AtMost(Duration::from_secs(2)),
    )
    .await
    .unwrap();
    t2.commit().await.unwrap();
}

const DEGRADED: &str = "zombie preemption unavailable (degraded)";

/// A leader process (the `candidate` example, ttl 1 s) as `leader_url`'s
/// user, frozen with SIGSTOP once a blocking standby as `standby`'s user
/// waits. Returns the leader, its term, the standby's task and the moment
/// of the freeze.
async fn frozen_leader(
    db: &TestDb,
    leader_url: &str,
    standby: &ConnectOptions,
    role: &str,
) -> (
    Candidate,
    pgelect::Term,
    tokio::task::JoinHandle<(pgelect::Leadership, Instant)>,
    Instant,
) {
    let leader = Candidate::spawn(&[leader_url, role, "1000"]);
    let old = term_of(&leader.expect("ELECTED", Duration::from_secs(20)));
    let e = Elector::builder(standby.clone(), role)
        .node_id("standby")
        .ttl(Duration::from_secs(1))
        .session(|s| {
            s.heartbeat(Duration::from_millis(100))
                .heartbeat_timeout(Duration::from_millis(300))
        })
        .check_every(Duration::from_millis(100))
        .build()
        .unwrap();
    let task = tokio::spawn(async move { (e.leadership().await.unwrap(), Instant::now()) });
    db.wait_for_advisory_waiters(1).await;
    leader.signal("-STOP");
    (leader, old, task, Instant::now())
}

/// Without `pg_signal_backend`, a standby of another database user cannot
/// end a frozen leader's backend: it says once that preemption is
/// unavailable, and nobody else leads while the frozen leader's connection
/// lives (many lease lengths); when the leader process dies, the standby
/// takes over.
#[tokio::test]
async fn without_pg_signal_backend_preemption_is_degraded_logged_once_and_safe() {
    let log = Log::default();
    let _guard = log.capture(tracing::Level::WARN);
    let s = owned("lp_zombie_off").await;
    s.user("leader", &[UserKind::Candidate]).await;
    let leader_url = s.db.create_role("leader", PASSWORD, false).await;
    let standby = s.user("standby", &[UserKind::Candidate]).await;
    let (leader, old, task, frozen) = frozen_leader(&s.db, &leader_url, &standby, "z").await;
    // Six lease lengths: the standby checks every 100 ms, and is refused
    // each time.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        !task.is_finished(),
        "nobody else leads while the zombie's connection lives"
    );
    let admin = s.db.connect().await;
    let holders: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE l.locktype = 'advisory' AND l.granted AND a.usename = $1",
            &[&s.db.role_name("leader")],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(holders, 1, "the frozen leader's connection keeps the lock");
    let warned = log.count(DEGRADED);
    println!(
        "frozen for {:?}: {warned} degraded warning(s)",
        frozen.elapsed()
    );
    assert_eq!(warned, 1, "warned once; the log:\n{}", log.text());
    let t = Instant::now();
    leader.signal("-KILL");
    drop(leader);
    let (l, _) = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the standby takes over once the zombie dies")
        .unwrap();
    assert!(l.term() > old);
    println!(
        "standby elected {:?} after the zombie was killed",
        t.elapsed()
    );
    assert_eq!(log.count(DEGRADED), 1);
    l.resign().await.unwrap();
}

/// With `pg_signal_backend` the standby ends the frozen leader's backend
/// once its lease expired, and leads; the thawed leader finds its
/// leadership lost. No degraded warning.
#[tokio::test]
async fn with_pg_signal_backend_a_frozen_leader_of_another_user_is_preempted() {
    let log = Log::default();
    let _guard = log.capture(tracing::Level::WARN);
    let s = owned("lp_zombie_on").await;
    s.user("leader", &[UserKind::Candidate]).await;
    let leader_url = s.db.create_role("leader", PASSWORD, false).await;
    let standby = s.user("standby", &[UserKind::Candidate]).await;
    // pg_signal_backend is a predefined role: a superuser grants it.
    let admin = s.db.connect().await;
    admin
        .batch_execute(&preemption_grant(&s.db.role_name("standby")).unwrap().sql)
        .await
        .unwrap();
    let (leader, old, task, frozen) = frozen_leader(&s.db, &leader_url, &standby, "z").await;
    let (l, at) = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the standby preempts the frozen leader")
        .unwrap();
    println!(
        "frozen leader (ttl 1 s) preempted; standby acting {:?} after the freeze",
        at - frozen
    );
    assert!(
        at - frozen >= Duration::from_millis(700),
        "{:?}",
        at - frozen
    );
    assert!(l.term() > old);
    leader.signal("-CONT");
    // Read on a blocking thread: this runtime drives the new leader.
    let lost = tokio::task::spawn_blocking(move || leader.expect("LOST", Duration::from_secs(10)))
        .await
        .unwrap();
    println!("thawed leader: {lost}");
    assert_eq!(log.count(DEGRADED), 0, "{}", log.text());
    l.resign().await.unwrap();
}

/// PostgreSQL lets a user end its own backends: candidates that share one
/// database user preempt each other without `pg_signal_backend`.
#[tokio::test]
async fn candidates_of_one_user_preempt_each_other_without_pg_signal_backend() {
    let log = Log::default();
    let _guard = log.capture(tracing::Level::WARN);
    let s = owned("lp_zombie_same").await;
    let o = s.user("cand", &[UserKind::Candidate]).await;
    let url = s.db.create_role("cand", PASSWORD, false).await;
    let (leader, old, task, frozen) = frozen_leader(&s.db, &url, &o, "z").await;
    let (l, at) = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the standby preempts the frozen leader of its own user")
        .unwrap();
    println!(
        "same user, no pg_signal_backend: standby acting {:?} after the freeze",
        at - frozen
    );
    assert!(l.term() > old);
    assert_eq!(log.count(DEGRADED), 0, "{}", log.text());
    drop(leader);
    l.resign().await.unwrap();
}

/// Preferred leaders between two least-privilege candidates of *different*
/// database users (neither may read the other's `pg_stat_activity`
/// details): the one of higher priority registers, is seen waiting, and
/// the leader hands over to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_least_privilege_candidate_of_higher_priority_takes_over_from_another_user() {
    let s = owned("lp_priority").await;
    let one = s.user("cand1", &[UserKind::Candidate]).await;
    let two = s.user("cand2", &[UserKind::Candidate]).await;
    let a = fast_session(&one, "prio", "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let term = la.term();
    let a_task = tokio::spawn(async move {
        la.lost().await;
        let reason = la.loss().map(|l| l.reason());
        la.resign().await.unwrap();
        reason
    });
    let b = fast_session(&two, "prio", "b").priority(1).build().unwrap();
    let lb = tokio::time::timeout(Duration::from_secs(10), b.leadership())
        .await
        .expect("the preferred candidate of another user leads")
        .unwrap();
    assert_eq!(
        a_task.await.unwrap(),
        Some(pgelect::loss::LossReason::HandedOver)
    );
    assert_eq!(lb.term().get(), term.get() + 1);
    lb.resign().await.unwrap();
    b.withdraw().await.unwrap();
}
