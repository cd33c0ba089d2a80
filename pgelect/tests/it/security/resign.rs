//! Resign requests are authenticated by the database.
//!
//! Anyone who can connect may `NOTIFY pgelect_resign`; a leader treats the
//! notification as a hint only: it renews early and steps down only when
//! the row says a resignation was requested for its term, which takes
//! `request_resign` and the `EXECUTE` privilege on it. Shown for the
//! session backend with a blocking standby, the lease backend with
//! `listen_via`, and a leader on a shared connection; and a flood of hints
//! costs a bounded number of statements.

use std::time::{Duration, Instant, SystemTime};

use pgelect::{
    conn::TcpTimeouts, election::Backend, election::SharedConnection, election::StandbyMode,
    loss::LossReason, ConnectOptions, Elector, ElectorBuilder, Error,
};
use pgelect_testkit::TestDb;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls};

use crate::support;
use support::migrated;

const ATTACKER_PASSWORD: &str = "mallory-pw-1";
const OPERATOR_PASSWORD: &str = "operator-pw-1";

/// Renewals 10 s apart (ttl 30 s): a row read sooner than that was brought
/// forward by a hint.
fn slow_renewing(o: &ConnectOptions, role: &str, node: &str) -> ElectorBuilder {
    Elector::builder(o.clone(), role)
        .node_id(node)
        .ttl(Duration::from_secs(30))
        .renew_every(Duration::from_secs(10))
}

async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

/// A user with CONNECT only, and one granted what the book lists for an
/// operator who resigns (the library call needs no SELECT).
async fn users(db: &TestDb) -> (Client, ConnectOptions) {
    let attacker = connect(&db.create_role("mallory", ATTACKER_PASSWORD, false).await).await;
    let operator_url = db.create_role("operator", OPERATOR_PASSWORD, false).await;
    let op = db.role_name("operator");
    db.connect()
        .await
        .batch_execute(&format!(
            "GRANT USAGE ON SCHEMA pgelect TO {op};
             GRANT EXECUTE ON FUNCTION pgelect.request_resign(text) TO {op};"
        ))
        .await
        .unwrap();
    (attacker, ConnectOptions::from_url(&operator_url).unwrap())
}

async fn row(admin: &Client, role: &str) -> (Option<String>, i64, SystemTime, bool) {
    let r = admin
        .query_typed_one(
            "SELECT holder, term, renewed_at, resign_requested FROM pgelect.leaders WHERE role = $1",
            &[(&role, Type::TEXT)],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

/// The attacker's attempts: hints (which move nothing), and the real
/// request and a direct update (refused by the database).
async fn attack(attacker: &Client, admin: &Client, role: &str) {
    let before = row(admin, role).await;
    for _ in 0..5 {
        attacker
            .batch_execute(&format!("NOTIFY pgelect_resign, 'pgelect:{role}'"))
            .await
            .unwrap();
    }
    attacker
        .query_typed(
            "SELECT pg_notify('pgelect_resign', $1)",
            &[(&format!("pgelect:{role}"), Type::TEXT)],
        )
        .await
        .unwrap();
    for sql in [
        format!("SELECT * FROM pgelect.request_resign('{role}')"),
        format!("UPDATE pgelect.leaders SET resign_requested = true WHERE role = '{role}'"),
        "SELECT pgelect.fence('x', 1)".to_owned(),
    ] {
        let e = attacker.batch_execute(&sql).await.unwrap_err();
        assert_eq!(
            e.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{sql}: {e:?}"
        );
    }
    // The leader heard the hints: it read its row long before the next
    // regular renewal (10 s), and found no request.
    let t0 = Instant::now();
    loop {
        let now = row(admin, role).await;
        if now.2 > before.2 {
            println!("hint heard: row read {:?} after the hints", t0.elapsed());
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "the leader did not check its row after the hints"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = row(admin, role).await;
    assert_eq!(after.0, before.0, "same holder");
    assert_eq!(after.1, before.1, "same term");
    assert!(!after.3, "nobody marked the row");
}

/// Asks as the operator; returns how long the leader took to step down,
/// counted from the call and from its answer (the call opens a connection
/// of its own, with SCRAM: most of the first figure in a debug build).
async fn operator_resigns(
    operator: &ConnectOptions,
    role: &str,
    lost: impl std::future::Future,
) -> Duration {
    let t0 = Instant::now();
    let asked = pgelect::admin::request_resign(operator, role)
        .await
        .expect("the operator may request")
        .expect("the role has a leader");
    let answered = Instant::now();
    assert_eq!(asked.holder, "leader");
    tokio::time::timeout(Duration::from_secs(5), lost)
        .await
        .expect("the leader steps down on a real request");
    println!(
        "{role}: stepped down {:?} after the request's answer ({:?} after the call)",
        answered.elapsed(),
        t0.elapsed()
    );
    t0.elapsed()
}

/// After a resign request: the leader stepped down for that reason, its
/// release lets the waiting standby take over with a higher term.
async fn hands_over(
    l: pgelect::Leadership,
    waiting: tokio::task::JoinHandle<pgelect::Result<pgelect::Leadership>>,
) {
    assert_eq!(l.loss().map(|l| l.reason()), Some(LossReason::Resigned));
    let old = l.term();
    l.resign().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the standby takes over")
        .unwrap()
        .unwrap();
    assert!(next.term() > old);
    next.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_leader_ignores_an_unprivileged_notify_and_obeys_request_resign() {
    let (db, o) = migrated("sec_session").await;
    let admin = db.connect().await;
    let (attacker, operator) = users(&db).await;
    let leader = slow_renewing(&o, "sched", "leader").build().unwrap();
    let l = leader.leadership().await.unwrap();
    let standby = slow_renewing(&o, "sched", "standby").build().unwrap();
    let waiting = tokio::spawn(async move { standby.leadership().await });
    db.wait_for_advisory_waiters(1).await;

    attack(&attacker, &admin, "sched").await;
    assert!(!l.is_lost(), "{:?}", l.loss().map(|l| l.reason()));
    assert!(!l.token().is_cancelled());

    let took = operator_resigns(&operator, "sched", l.lost()).await;
    println!("session leader stepped down {took:?} after request_resign");
    hands_over(l, waiting).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_leader_with_listen_ignores_an_unprivileged_notify_and_obeys_request_resign() {
    let (db, o) = migrated("sec_lease").await;
    let admin = db.connect().await;
    let (attacker, operator) = users(&db).await;
    let leader = slow_renewing(&o, "sweep", "leader")
        .backend(Backend::Lease)
        .lease(|l| l.listen_via(o.clone()))
        .build()
        .unwrap();
    let l = leader.leadership().await.unwrap();
    let standby = slow_renewing(&o, "sweep", "standby")
        .backend(Backend::Lease)
        .lease(|l| l.retry_every(Duration::from_millis(200)))
        .build()
        .unwrap();
    let waiting = tokio::spawn(async move { standby.leadership().await });
    // The hints must reach a listening leader for the test to mean anything.
    wait_listening(&admin, "pgelect:listen:sweep:leader").await;

    attack(&attacker, &admin, "sweep").await;
    assert!(!l.is_lost(), "{:?}", l.loss().map(|l| l.reason()));

    let took = operator_resigns(&operator, "sweep", l.lost()).await;
    println!("lease leader (listen_via) stepped down {took:?} after request_resign");
    // Renewals are 10 s apart: this came through the hint and the row.
    assert!(took < Duration::from_secs(5), "{took:?}");
    hands_over(l, waiting).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_connection_leader_ignores_an_unprivileged_notify_and_obeys_request_resign() {
    let (db, o) = migrated("sec_shared").await;
    let admin = db.connect().await;
    let (attacker, operator) = users(&db).await;
    let polling = StandbyMode::Polling {
        interval: Duration::from_millis(200),
    };
    // TCP timeouts above the 24 s local deadline of a 30 s ttl.
    let tcp = TcpTimeouts {
        keepalive_idle: Duration::from_secs(10),
        keepalive_interval: Duration::from_secs(10),
        keepalive_count: 3,
        user_timeout: Duration::from_secs(30),
    };
    let host_a = SharedConnection::new(&o, tcp);
    let host_b = SharedConnection::new(&o, tcp);
    let leader = slow_renewing(&o, "shard", "leader")
        .session(|s| s.shared_connection(&host_a).standby(polling))
        .build()
        .unwrap();
    let l = leader.leadership().await.unwrap();
    let standby = slow_renewing(&o, "shard", "standby")
        .session(|s| s.shared_connection(&host_b).standby(polling))
        .build()
        .unwrap();
    let waiting = tokio::spawn(async move { standby.leadership().await });

    attack(&attacker, &admin, "shard").await;
    assert!(!l.is_lost(), "{:?}", l.loss().map(|l| l.reason()));

    let took = operator_resigns(&operator, "shard", l.lost()).await;
    println!("shared-connection leader stepped down {took:?} after request_resign");
    hands_over(l, waiting).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_resign_without_the_privilege_is_a_permission_error_naming_the_grant() {
    let (db, _o) = migrated("sec_noperm").await;
    let url = db.create_role("nobody", ATTACKER_PASSWORD, false).await;
    let nobody = ConnectOptions::from_url(&url).unwrap();
    let e = pgelect::admin::request_resign(&nobody, "any")
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Permission { .. }), "{e:?}");
    assert!(e.to_string().contains("request_resign"), "{e}");
    assert!(e.to_string().contains("GRANT EXECUTE"), "{e}");
    assert!(!e.to_string().contains(ATTACKER_PASSWORD), "{e}");
}

async fn wait_listening(admin: &Client, application_name: &str) {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let n: i64 = admin
                .query_typed_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE application_name = $1 AND state = 'idle' AND query LIKE 'LISTEN%'",
                    &[(&application_name, Type::TEXT)],
                )
                .await
                .unwrap()
                .get(0);
            if n > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the LISTEN connection is up");
}

/// Counts the updates of `pgelect.leaders` (renewals, as no election or
/// release happens meanwhile) in a sequence, which no rollback undoes.
async fn count_row_updates(admin: &Client) {
    admin
        .batch_execute(
            "CREATE SEQUENCE public.leader_updates;
             CREATE FUNCTION public.count_leader_update() RETURNS trigger
             LANGUAGE plpgsql SECURITY DEFINER AS $$
             BEGIN PERFORM nextval('public.leader_updates'); RETURN NEW; END $$;
             CREATE TRIGGER count_leader_updates BEFORE UPDATE ON pgelect.leaders
                FOR EACH ROW EXECUTE FUNCTION public.count_leader_update();",
        )
        .await
        .unwrap();
}

async fn row_updates(admin: &Client) -> i64 {
    let r = admin
        .query_typed_one(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.leader_updates",
            &[],
        )
        .await
        .unwrap();
    r.get(0)
}

/// Sends `n` hints, each in its own transaction (notifications with the
/// same payload in one transaction are folded into one); returns how long
/// that took.
async fn flood(attacker: &Client, role: &str, n: usize) -> Duration {
    let sql = format!("NOTIFY pgelect_resign, 'pgelect:{role}'");
    let t0 = Instant::now();
    for _ in 0..n {
        attacker.batch_execute(&sql).await.unwrap();
    }
    t0.elapsed()
}

/// The most renewals a flood lasting `d` may cause: one at once, then one
/// per 100 ms, one more still pending at its end, and a regular renewal
/// (every 10 s) that may fall in the window.
fn flood_bound(d: Duration) -> i64 {
    (d.as_millis() / 100) as i64 + 3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notify_flood_costs_the_session_leader_a_bounded_number_of_statements() {
    let (db, o) = migrated("sec_flood").await;
    let admin = db.connect().await;
    count_row_updates(&admin).await;
    let (attacker, _) = users(&db).await;
    let leader = slow_renewing(&o, "busy", "leader").build().unwrap();
    let l = leader.leadership().await.unwrap();
    let term = l.term();
    let before = row_updates(&admin).await;
    let took = flood(&attacker, "busy", 1000).await;
    // The last hint's check, if one was pending, is sent within 100 ms.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let extra = row_updates(&admin).await - before;
    let bound = flood_bound(took + Duration::from_millis(300));
    println!(
        "1000 hints in {took:?}: the session leader read its row {extra} times (bound {bound})"
    );
    assert!(extra >= 1, "the hints were heard");
    assert!(extra <= bound, "{extra} statements for 1000 hints");
    assert!(!l.is_lost(), "{:?}", l.loss().map(|l| l.reason()));
    assert_eq!(row(&admin, "busy").await.1, term.get());
    l.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notify_flood_costs_the_lease_leader_a_bounded_number_of_statements() {
    let (db, o) = migrated("sec_flood_lease").await;
    let admin = db.connect().await;
    let (attacker, _) = users(&db).await;
    let leader = slow_renewing(&o, "busy", "leader")
        .backend(Backend::Lease)
        .lease(|l| l.listen_via(o.clone()))
        .build()
        .unwrap();
    let l = leader.leadership().await.unwrap();
    wait_listening(&admin, "pgelect:listen:busy:leader").await;
    let before = leader.lease_statements();
    let took = flood(&attacker, "busy", 1000).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let extra = leader.lease_statements() as i64 - before as i64;
    let bound = flood_bound(took + Duration::from_millis(300));
    println!("1000 hints in {took:?}: the lease leader sent {extra} statements (bound {bound})");
    assert!(extra >= 1, "the hints were heard");
    assert!(extra <= bound, "{extra} statements for 1000 hints");
    assert!(!l.is_lost(), "{:?}", l.loss().map(|l| l.reason()));
    l.resign().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_fake_release_notifications_costs_a_standby_a_bounded_number_of_statements() {
    let (db, o) = migrated("sec_flood_standby").await;
    let admin = db.connect().await;
    let (attacker, _) = users(&db).await;
    let leader = slow_renewing(&o, "busy", "leader")
        .backend(Backend::Lease)
        .build()
        .unwrap();
    let l = leader.leadership().await.unwrap();
    // Left alone, the standby tries once every 10 s.
    let standby = std::sync::Arc::new(
        slow_renewing(&o, "busy", "standby")
            .backend(Backend::Lease)
            .lease(|l| l.listen_via(o.clone()).retry_every(Duration::from_secs(10)))
            .build()
            .unwrap(),
    );
    let s = standby.clone();
    let waiting = tokio::spawn(async move { s.leadership().await });
    wait_listening(&admin, "pgelect:listen:busy:standby").await;
    tokio::time::timeout(Duration::from_secs(10), async {
        while standby.lease_statements() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the standby tried once");
    let before = standby.lease_statements();
    let sql = "NOTIFY pgelect_leader, 'pgelect:released:busy'";
    let t0 = Instant::now();
    for _ in 0..1000 {
        attacker.batch_execute(sql).await.unwrap();
    }
    let took = t0.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let extra = standby.lease_statements() as i64 - before as i64;
    // A burst of six, then one per 100 ms, one more pending at the end.
    let bound = 6 + flood_bound(took + Duration::from_millis(300));
    println!("1000 fake releases in {took:?}: the standby sent {extra} statements (bound {bound})");
    assert!(extra >= 1, "the notifications were heard");
    assert!(extra <= bound, "{extra} statements for 1000 notifications");
    assert!(!waiting.is_finished());
    assert!(!l.is_lost());
    // A real release still wakes it at once.
    l.resign().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the standby takes over on the real release")
        .unwrap()
        .unwrap();
    next.resign().await.unwrap();
}
