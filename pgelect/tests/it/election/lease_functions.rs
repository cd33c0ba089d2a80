//! The lease backend's statements as the schema's functions (migration 9):
//! through PgBouncer in transaction mode a lease client calls
//! `lease_acquire`, `lease_renew` and `lease_release`, whose plans each
//! server process keeps; a function that is not this version's, or that
//! the user may not call, is never called: the statements are sent whole.

use std::time::{Duration, Instant};

use pgelect::ConnectOptions;
use pgelect_testkit::{Cluster, PgBouncer, PoolMode, TestDb};
use tokio_postgres::types::Type;

use crate::support::{self, fast_lease, options};

/// A migrated database on the shared cluster with a PgBouncer in
/// transaction mode in front: the database, the options through PgBouncer,
/// the bouncer. `before` runs (as the superuser) before the bouncer opens
/// any server connection.
async fn pooled(hint: &str, before: &str) -> (TestDb, ConnectOptions, PgBouncer) {
    let cluster = tokio::task::spawn_blocking(Cluster::shared).await.unwrap();
    let db = TestDb::on(cluster, hint).await;
    pgelect::migrate(&options(&db.url()))
        .await
        .expect("migrate");
    db.connect()
        .await
        .batch_execute(&before.replace("{db}", db.name()))
        .await
        .unwrap();
    let bouncer = PgBouncer::start(cluster, PoolMode::Transaction).expect("pgbouncer starts");
    let pooled = options(&bouncer.url(db.name()));
    (db, pooled, bouncer)
}

/// The calls of each lease function counted by the server so far.
async fn calls(c: &tokio_postgres::Client) -> (i64, i64, i64) {
    let r = c
        .query_typed_one(
            "SELECT coalesce(sum(calls) FILTER (WHERE funcname = 'lease_acquire'), 0)::int8,
                    coalesce(sum(calls) FILTER (WHERE funcname = 'lease_renew'), 0)::int8,
                    coalesce(sum(calls) FILTER (WHERE funcname = 'lease_release'), 0)::int8
               FROM pg_stat_user_functions WHERE schemaname = 'pgelect'",
            &[],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_the_lease_statements_run_as_the_schemas_functions() {
    // The server counts calls of PL/pgSQL functions in sessions that
    // track them: every server connection PgBouncer opens for this
    // database does.
    let (db, pooled, _bouncer) = pooled(
        "lease_fn_calls",
        "ALTER DATABASE {db} SET track_functions = 'pl'",
    )
    .await;
    let admin = db.connect().await;
    let a = fast_lease(&pooled, "fn", "a").build().unwrap();
    let la = a.leadership().await.expect("a leads");
    let b = fast_lease(&pooled, "fn", "b").build().unwrap();
    let standing = tokio::spawn(async move { (b.leadership().await, b) });
    // A few renewals and standby polls (every 500 and 200 ms).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = la.term();
    la.resign().await.expect("a resigns");
    let (lb, b) = standing.await.unwrap();
    let lb = lb.expect("b leads after a resigned");
    assert!(lb.term() > first);

    // Statistics reach the server's shared counters within about a second
    // of a session going idle (at most 10 s).
    let started = Instant::now();
    let mut seen = calls(&admin).await;
    while !(seen.0 >= 2 && seen.1 >= 1 && seen.2 >= 1)
        && started.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
        seen = calls(&admin).await;
    }
    println!(
        "calls counted after {:?}: acquire {}, renew {}, release {}",
        started.elapsed(),
        seen.0,
        seen.1,
        seen.2
    );
    assert!(
        seen.0 >= 2 && seen.1 >= 1 && seen.2 >= 1,
        "the lease client did not call the schema's functions: {seen:?} (acquire, renew, release)"
    );
    drop((lb, b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_function_that_is_not_this_versions_or_not_granted_is_never_called() {
    let (db, pooled, bouncer) = pooled("lease_fn_other", "").await;
    let admin = db.connect().await;
    // The schema's acquire replaced by one that fails when called (as a
    // later pgelect's migration could have changed it).
    let def: String = admin
        .query_typed_one(
            "SELECT pg_get_functiondef('pgelect.lease_acquire(text[], text[], jsonb[], int8[], text[], int4[], int8, int8[])'::regprocedure)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let replaced = def.replacen(
        "RETURN QUERY",
        "RAISE EXCEPTION 'pgelect test: this acquire must not be called'; RETURN QUERY",
        1,
    );
    assert_ne!(replaced, def, "{def}");
    admin.batch_execute(&replaced).await.unwrap();
    let a = fast_lease(&pooled, "other", "a").build().unwrap();
    let la = tokio::time::timeout(Duration::from_secs(20), a.leadership())
        .await
        .expect("a leads within 20 s with the acquire sent whole")
        .expect("a leads");
    assert_eq!(la.term().get(), 1);
    la.resign().await.unwrap();
    admin.batch_execute(&def).await.unwrap();

    // A candidate whose user may write the tables but not call the
    // functions (granted before migration 9, say) sends them whole too.
    db.create_role("nofn", "nofn-pw", false).await;
    let user = db.role_name("nofn");
    for g in support::CANDIDATE
        .iter()
        .filter(|g| !g.contains("lease_acquire"))
    {
        admin.batch_execute(&g.replace("{r}", &user)).await.unwrap();
    }
    let may_call: bool = admin
        .query_typed_one(
            "SELECT has_function_privilege($1, 'pgelect.lease_acquire(text[], text[], jsonb[], int8[], text[], int4[], int8, int8[])', 'EXECUTE')",
            &[(&user, Type::TEXT)],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!may_call, "the user was not to be granted the functions");
    let o = options(&format!(
        "postgres://{user}:nofn-pw@127.0.0.1:{}/{}",
        bouncer.port(),
        db.name()
    ));
    let b = fast_lease(&o, "nofn", "b").build().unwrap();
    let lb = tokio::time::timeout(Duration::from_secs(20), b.leadership())
        .await
        .expect("b leads within 20 s without the functions' grant")
        .expect("b leads");
    assert_eq!(lb.term().get(), 1);
    lb.resign().await.unwrap();
}
