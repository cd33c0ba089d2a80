//! Least privilege: login roles with exactly the grants
//! the book lists for candidates, fencing applications, observers and
//! operators who resign, each shown to work, and each grant shown to be
//! needed where that can be shown.

use std::time::Duration;

use pgelect::{
    conn::TcpTimeouts, election::Backend, election::SharedConnection, election::SharedLease,
    election::StandbyMode, loss::LossReason, ConnectOptions, Elector, Error,
};
use pgelect_testkit::TestDb;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls};

use crate::support;
use support::{fast_session as fast, migrated, CANDIDATE};

const PASSWORD: &str = "least-privilege-pw";

/// What an application that only fences needs.
const FENCING: &[&str] = &[
    "GRANT USAGE ON SCHEMA pgelect TO {r}",
    "GRANT EXECUTE ON FUNCTION pgelect.fence(text, bigint) TO {r}",
];

/// What an operator needs to ask a leader to resign (the library call).
const RESIGNING: &[&str] = &[
    "GRANT USAGE ON SCHEMA pgelect TO {r}",
    "GRANT EXECUTE ON FUNCTION pgelect.request_resign(text) TO {r}",
];

/// What an observer needs: `current_leader`, `Elector::watch` without
/// standing, and `pgelect status` (which computes keys with `key`).
const OBSERVING: &[&str] = &[
    "GRANT USAGE ON SCHEMA pgelect TO {r}",
    "GRANT SELECT ON pgelect.leaders TO {r}",
    "GRANT EXECUTE ON FUNCTION pgelect.key(text) TO {r}",
    "GRANT SELECT ON pgelect.candidates TO {r}",
];

/// A login role with CONNECT and exactly `grants`; its options.
async fn user(db: &TestDb, name: &str, grants: &[&str]) -> ConnectOptions {
    let url = db.create_role(name, PASSWORD, false).await;
    let r = db.role_name(name);
    let admin = db.connect().await;
    for g in grants {
        admin.batch_execute(&g.replace("{r}", &r)).await.unwrap();
    }
    ConnectOptions::from_url(&url).unwrap()
}

async fn client_of(db: &TestDb, name: &str) -> Client {
    let mut config = db.config();
    config.user(db.role_name(name)).password(PASSWORD);
    let (client, conn) = config.connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

fn assert_denied(r: Result<impl std::fmt::Debug, tokio_postgres::Error>, what: &str) {
    let e = r.expect_err(what);
    assert_eq!(
        e.code(),
        Some(&SqlState::INSUFFICIENT_PRIVILEGE),
        "{what}: {e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_with_the_listed_grants_stands_and_leads_on_every_path() {
    let (db, _) = migrated("priv_candidate").await;
    let o = user(&db, "cand", CANDIDATE).await;

    // Session backend: a blocking leader, a blocking standby (lock-wait
    // slices, observer), then a polling standby.
    let a = fast(&o, "r", "a").build().unwrap();
    let la = a.leadership().await.unwrap();
    let b = fast(&o, "r", "b").build().unwrap();
    let mut seen = b.watch();
    let waiting_b = tokio::spawn(async move { b.leadership().await.map(|l| (l, b)) });
    db.wait_for_advisory_waiters(1).await;
    // The standby's observer reads the row.
    tokio::time::timeout(Duration::from_secs(10), seen.wait_for(|l| l.is_some()))
        .await
        .expect("the standby's observer reads the leader")
        .unwrap();
    let term_a = la.term();
    la.resign().await.unwrap();
    let (lb, _b) = tokio::time::timeout(Duration::from_secs(10), waiting_b)
        .await
        .expect("the blocking standby takes over")
        .unwrap()
        .unwrap();
    assert!(lb.term() > term_a);
    let c = fast(&o, "r", "c")
        .session(|s| {
            s.standby(StandbyMode::Polling {
                interval: Duration::from_millis(100),
            })
        })
        .build()
        .unwrap();
    let waiting_c = tokio::spawn(async move { c.leadership().await });
    let term_b = lb.term();
    lb.resign().await.unwrap();
    let lc = tokio::time::timeout(Duration::from_secs(10), waiting_c)
        .await
        .expect("the polling standby takes over")
        .unwrap()
        .unwrap();
    assert!(lc.term() > term_b);
    lc.resign().await.unwrap();

    // A shared connection.
    let host = SharedConnection::new(&o, TcpTimeouts::default());
    let shared = fast(&o, "s", "a")
        .session(|s| {
            s.shared_connection(&host).standby(StandbyMode::Polling {
                interval: Duration::from_millis(100),
            })
        })
        .build()
        .unwrap();
    let ls = shared.leadership().await.unwrap();
    ls.resign().await.unwrap();

    // The lease backend, with LISTEN.
    let lease = Elector::builder(o.clone(), "l")
        .backend(Backend::Lease)
        .lease(|l| l.listen_via(o.clone()))
        .ttl(Duration::from_secs(2))
        .renew_every(Duration::from_millis(500))
        .build()
        .unwrap();
    let ll = lease.leadership().await.unwrap();
    ll.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_candidate_grant_is_needed() {
    let (db, _) = migrated("priv_needed").await;
    // The lease functions' grant only makes the statements cheaper: without
    // it they are sent whole (`election::lease_functions`).
    let needed = CANDIDATE.iter().filter(|g| !g.contains("lease_acquire"));
    for (i, missing) in needed.enumerate() {
        let grants: Vec<&str> = CANDIDATE.iter().copied().filter(|g| g != missing).collect();
        let o = user(&db, &format!("short{i}"), &grants).await;
        let e = fast(&o, "r", "a")
            .build()
            .unwrap()
            .leadership()
            .await
            .expect_err(missing);
        assert!(
            matches!(e, Error::Permission { .. }),
            "without {missing:?}: {e:?}"
        );
        println!("without {missing:?}: {e}");
    }
    // The table privileges one by one (the grant above gives all three).
    for (i, privilege) in ["SELECT", "INSERT", "UPDATE"].iter().enumerate() {
        let mut grants: Vec<String> = CANDIDATE.iter().map(|g| g.to_string()).collect();
        let others: Vec<&str> = ["SELECT", "INSERT", "UPDATE"]
            .into_iter()
            .filter(|p| p != privilege)
            .collect();
        grants[2] = format!("GRANT {} ON pgelect.leaders TO {{r}}", others.join(", "));
        let grants: Vec<&str> = grants.iter().map(String::as_str).collect();
        let o = user(&db, &format!("table{i}"), &grants).await;
        for backend in [Backend::Session, Backend::Lease] {
            let e = fast(&o, "r", "a")
                .backend(backend)
                .build()
                .unwrap()
                .leadership()
                .await
                .expect_err(privilege);
            assert!(
                matches!(e, Error::Permission { .. }),
                "{backend:?} without {privilege} on leaders: {e:?}"
            );
        }
    }
}

/// The candidates of a shared client whose user lacks a grant get the
/// permission error, each of them, as a lone candidate does: not a retry
/// loop. Without `candidates` the batched registration is refused; with
/// only `SELECT` on `leaders` the batched election (or acquire) is.
/// `electors` builds four candidates of different roles on one client.
async fn each_candidate_gets_a_missing_grant(
    hint: &str,
    electors: impl Fn(&ConnectOptions) -> Vec<Elector>,
) {
    let (db, _) = migrated(hint).await;
    let cases = [
        (
            "nr",
            "pgelect.candidates",
            "GRANT USAGE ON SCHEMA pgelect TO {r}",
        ),
        (
            "nw",
            "pgelect.leaders",
            "GRANT SELECT ON pgelect.leaders TO {r}",
        ),
    ];
    for (name, left_out, instead) in cases {
        let grants: Vec<&str> = CANDIDATE
            .iter()
            .map(|g| if g.contains(left_out) { instead } else { g })
            .collect();
        let o = user(&db, name, &grants).await;
        let electors = electors(&o);
        let all = futures_util::future::join_all(electors.iter().map(|e| e.leadership()));
        let outcomes = tokio::time::timeout(Duration::from_secs(20), all)
            .await
            .unwrap_or_else(|_| panic!("without {left_out}: a candidate retried forever"));
        for r in outcomes {
            let e = r.expect_err(left_out);
            assert!(
                matches!(e, Error::Permission { .. }),
                "without {left_out}: {e:?}"
            );
        }
        println!("without {left_out}: each of 4 candidates got the permission error");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_candidate_of_a_shared_lease_client_gets_a_missing_grant() {
    each_candidate_gets_a_missing_grant("priv_shared_lease", |o| {
        let client = SharedLease::new(o);
        (0..4)
            .map(|i| {
                Elector::builder(o.clone(), &format!("shard-{i}"))
                    .backend(Backend::Lease)
                    .node_id("a")
                    .ttl(Duration::from_secs(2))
                    .renew_every(Duration::from_millis(500))
                    .lease(|l| {
                        l.retry_every(Duration::from_millis(200))
                            .shared_lease(&client)
                    })
                    .build()
                    .unwrap()
            })
            .collect()
    })
    .await;
}

/// The same for polling candidates on a shared connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_candidate_of_a_shared_connection_gets_a_missing_grant() {
    each_candidate_gets_a_missing_grant("priv_shared_conn", |o| {
        let host = SharedConnection::new(o, TcpTimeouts::default());
        (0..4)
            .map(|i| {
                fast(o, &format!("shard-{i}"), "a")
                    .session(|s| {
                        s.standby(StandbyMode::Polling {
                            interval: Duration::from_millis(100),
                        })
                        .shared_connection(&host)
                    })
                    .build()
                    .unwrap()
            })
            .collect()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_application_needs_usage_and_execute_on_fence_only() {
    let (db, owner) = migrated("priv_fence").await;
    let leader = fast(&owner, "jobs", "leader").build().unwrap();
    let l = leader.leadership().await.unwrap();
    let term = l.term().get();

    user(&db, "app", FENCING).await;
    let mut app = client_of(&db, "app").await;
    let tx = app.transaction().await.unwrap();
    l.fence(&tx).await.expect("the current term fences");
    tx.rollback().await.unwrap();
    let fence = |role: &str, t: i64| {
        let role = role.to_owned();
        let app = &app;
        async move {
            app.query_typed(
                "SELECT pgelect.fence($1, $2)",
                &[(&role, Type::TEXT), (&t, Type::INT8)],
            )
            .await
        }
    };
    let stale = fence("jobs", term - 1).await.unwrap_err();
    assert_eq!(stale.code().map(|c| c.code()), Some("PE001"), "{stale:?}");
    let none = fence("nobody-leads", 1).await.unwrap_err();
    assert_eq!(none.code().map(|c| c.code()), Some("PE002"), "{none:?}");
    // Nothing on the table itself.
    assert_denied(
        app.query("SELECT * FROM pgelect.leaders", &[]).await,
        "read the table",
    );
    assert_denied(
        app.query("UPDATE pgelect.leaders SET term = term + 1", &[])
            .await,
        "write the table",
    );
    assert_denied(
        app.query("SELECT * FROM pgelect.request_resign('jobs')", &[])
            .await,
        "request a resignation",
    );

    // Each of the two grants is needed.
    user(&db, "app_usage", &FENCING[..1]).await;
    let c = client_of(&db, "app_usage").await;
    assert_denied(
        c.query("SELECT pgelect.fence('jobs', 1)", &[]).await,
        "fence without EXECUTE",
    );
    user(&db, "app_exec", &FENCING[1..]).await;
    let c = client_of(&db, "app_exec").await;
    assert_denied(
        c.query("SELECT pgelect.fence('jobs', 1)", &[]).await,
        "fence without USAGE",
    );
    l.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_needs_usage_and_execute_on_request_resign() {
    let (db, owner) = migrated("priv_resign").await;
    let leader = fast(&owner, "jobs", "leader").build().unwrap();
    let l = leader.leadership().await.unwrap();

    for (name, grants) in [("op_usage", &RESIGNING[..1]), ("op_exec", &RESIGNING[1..])] {
        let o = user(&db, name, grants).await;
        let e = pgelect::admin::request_resign(&o, "jobs")
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Permission { .. }), "{name}: {e:?}");
        assert!(e.to_string().contains("request_resign"), "{e}");
    }
    assert!(!l.is_lost());

    let o = user(&db, "op", RESIGNING).await;
    let asked = pgelect::admin::request_resign(&o, "jobs")
        .await
        .unwrap()
        .expect("a leader");
    assert_eq!(asked.term, l.term());
    tokio::time::timeout(Duration::from_secs(5), l.lost())
        .await
        .expect("the leader steps down");
    assert_eq!(l.loss().map(|l| l.reason()), Some(LossReason::Resigned));
    l.resign().await.unwrap();
    // No leader: nothing marked, nothing returned.
    assert_eq!(
        pgelect::admin::request_resign(&o, "jobs").await.unwrap(),
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_needs_usage_select_and_execute_on_key() {
    let (db, owner) = migrated("priv_observe").await;
    let leader = fast(&owner, "jobs", "leader").build().unwrap();
    let l = leader.leadership().await.unwrap();
    let o = user(&db, "watcher", OBSERVING).await;
    let info = pgelect::admin::current_leader(&o, "jobs")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.term, l.term());
    let c = client_of(&db, "watcher").await;
    let k: i64 = c
        .query_one("SELECT pgelect.key('election:pgelect:jobs')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(pgelect::LockKey::Single(k), leader.lock_key());

    let no_select = user(&db, "watcher2", &[OBSERVING[0], OBSERVING[2]]).await;
    let e = pgelect::admin::current_leader(&no_select, "jobs")
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Permission { .. }), "{e:?}");
    user(&db, "watcher3", &OBSERVING[..2]).await;
    let c = client_of(&db, "watcher3").await;
    assert_denied(
        c.query("SELECT pgelect.key('x')", &[]).await,
        "key without EXECUTE",
    );
    l.resign().await.unwrap();
}

#[tokio::test]
async fn public_may_execute_no_pgelect_function_and_each_has_a_fixed_search_path() {
    let (db, _) = migrated("priv_public").await;
    let admin = db.connect().await;
    let rows = admin
        .query(
            "SELECT p.oid::regprocedure::text,
                    has_function_privilege('public', p.oid, 'EXECUTE'),
                    coalesce('search_path=pg_catalog, pg_temp' = ANY(p.proconfig), false),
                    p.prosecdef
               FROM pg_proc p WHERE p.pronamespace = 'pgelect'::regnamespace
              ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    let mut names = Vec::new();
    for r in &rows {
        let name: String = r.get(0);
        let public: bool = r.get(1);
        let fixed_path: bool = r.get(2);
        let definer: bool = r.get(3);
        assert!(!public, "PUBLIC may execute {name}");
        assert!(fixed_path, "{name} has no fixed search_path");
        assert_eq!(
            definer,
            name.starts_with("pgelect.fence") || name.starts_with("pgelect.request_resign"),
            "{name}: SECURITY DEFINER only where a caller needs the owner's rights"
        );
        names.push(name);
    }
    assert_eq!(
        names,
        [
            "pgelect.fence(text,bigint)",
            "pgelect.key(text)",
            "pgelect.lease_acquire(text[],text[],jsonb[],bigint[],text[],integer[],bigint,bigint[])",
            "pgelect.lease_release(text[],text[],bigint[],text[])",
            "pgelect.lease_renew(text[],text[],bigint[],bigint[],integer[])",
            "pgelect.lock_wait_slice(bigint,integer)",
            "pgelect.request_resign(text)",
        ]
    );
    // The table is granted to nobody but its owner.
    let granted: i64 = admin
        .query_one(
            "SELECT count(*) FROM information_schema.role_table_grants
              WHERE table_schema = 'pgelect' AND grantee = 'PUBLIC'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(granted, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_4_and_5_keep_the_rights_of_earlier_candidates_and_observers() {
    let (db, owner) = migrated("priv_upgrade").await;
    // Granted as the README said before migration 4 (functions through
    // PUBLIC), then migrations 4 and 5 applied again as on an upgrade.
    let old = user(&db, "old_cand", &CANDIDATE[..3]).await;
    user(&db, "old_watch", &OBSERVING[..2]).await;
    let admin = db.connect().await;
    admin
        .batch_execute(
            "DROP TABLE pgelect.candidates;
             DROP TABLE pgelect.group_views;
             DELETE FROM pgelect.migrations WHERE version >= 4",
        )
        .await
        .unwrap();
    // 4 and 5, and every later one.
    assert_eq!(
        i64::from(pgelect::migrate(&owner).await.unwrap()),
        i64::from(pgelect::schema::SCHEMA_VERSION) - 3
    );
    let l = fast(&old, "r", "a")
        .build()
        .unwrap()
        .leadership()
        .await
        .expect("a blocking candidate granted before migration 4 still stands");
    let c = client_of(&db, "old_watch").await;
    c.query_one("SELECT pgelect.key('x')", &[])
        .await
        .expect("an observer granted before migration 4 still computes keys");
    c.query("SELECT * FROM pgelect.candidates", &[])
        .await
        .expect("an observer granted before migration 5 reads the registry");
    // Nothing reached PUBLIC or a user with no rights on the table.
    let public: bool = admin
        .query_one(
            "SELECT has_function_privilege('public', 'pgelect.lock_wait_slice(bigint, integer)', 'EXECUTE')
                 OR has_function_privilege('public', 'pgelect.key(text)', 'EXECUTE')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!public);
    let public: bool = admin
        .query_one(
            "SELECT has_table_privilege('public', 'pgelect.candidates', 'SELECT')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!public, "the registry is not readable by PUBLIC");
    l.resign().await.unwrap();
}

/// A member of a partition group needs the candidate's grants and the
/// group views' (`grant_statements` lists both): with them it reads its
/// group, keeps the group's view for the others, and leads every
/// partition alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_member_with_the_candidate_and_group_view_grants_leads_its_group() {
    let (db, _) = migrated("priv_partitions").await;
    let mut grants = CANDIDATE.to_vec();
    grants.push("GRANT SELECT, INSERT, UPDATE ON pgelect.group_views TO {r}");
    let o = user(&db, "member", &grants).await;
    let group = pgelect::partitions::PartitionGroup::builder(o, "pg", 4)
        .member("m1")
        .poll_interval(Duration::from_millis(200))
        .rebalance_every(Duration::from_millis(300))
        .build()
        .unwrap();
    let _events = group.join().unwrap();
    let t0 = std::time::Instant::now();
    while group.held().len() < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "held {:?} after 30 s",
            group.held()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let admin = db.connect().await;
    let kept: i64 = admin
        .query_one(
            "SELECT count(*) FROM pgelect.group_views WHERE grp = 'pg' AND n = 4
                AND json_array_length(view->1) = 4",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, 1, "the group's view, kept");
    group.leave().await.unwrap();
}
