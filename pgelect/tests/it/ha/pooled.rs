//! The lease backend under pg_auto_failover through PgBouncer, deployed as
//! an operator would: one PgBouncer (transaction mode) per data node,
//! pointed at its local node, and the candidates on a multi-host URL
//! naming the bouncers with `target_session_attrs=read-write` (the driver's
//! `SHOW transaction_read_only` goes through a bouncer to its node). Their
//! `LISTEN` connections ([`LeaseOptions::listen_via`]) go directly to the
//! data nodes on the formation's multi-host URL.
//!
//! After a switchover the old primary comes back as a standby behind its
//! bouncer, which the lease clients may still be connected to: a write
//! there is refused as read-only, and the client must leave that bouncer
//! for the writable one.
//!
//! The same faults, checks and `HA-RESULT` lines as
//! [`manager`](super::manager) (`via=pgbouncer-per-node`); slow, so run
//! only with `PGELECT_HA_TESTS=1` (`scripts/ha-tests.sh`).
//!
//! [`LeaseOptions::listen_via`]: pgelect::election::LeaseOptions::listen_via

use std::io;

use pgelect::{election::Backend, ConnectOptions};
use pgelect_testkit::{PgBouncer, PoolMode};
use tokio_postgres::{NoTls, SimpleQueryMessage};

use super::manager::{blocking, enabled, under_faults, Fault, Formation, ALL, DB, NODES, ROLE};
use crate::support::fast_lease;

/// Transactions `bouncer` carried for the tests' database (`SHOW STATS`).
async fn transactions(bouncer: &PgBouncer) -> u64 {
    let (c, conn) = bouncer
        .config("pgbouncer")
        .connect(NoTls)
        .await
        .expect("pgbouncer's admin console");
    tokio::spawn(conn);
    let rows = c.simple_query("SHOW STATS").await.expect("SHOW STATS");
    rows.iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) if r.get("database") == Some(DB) => r
                .get("total_xact_count")
                .and_then(|n| n.parse::<u64>().ok()),
            _ => None,
        })
        .sum()
}

/// The bouncers; on a failure (a panic), how each is doing and its log's
/// tail.
struct Bouncers(Vec<PgBouncer>);

impl Drop for Bouncers {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for b in &self.0 {
                eprintln!("{}", b.diagnose(40));
            }
        }
    }
}

async fn through_bouncers(faults: &[Fault]) {
    let f = Formation::start().await;
    let haf = f.haf.clone();
    let bouncers = blocking(move || {
        (0..haf.ports().len())
            .map(|node| PgBouncer::start_for_node(&haf, node, PoolMode::Transaction))
            .collect::<io::Result<Vec<_>>>()
    })
    .await
    .map(Bouncers)
    .expect("a pgbouncer per data node");
    let pooled = PgBouncer::multi_host_url(
        &bouncers.0,
        DB,
        "target_session_attrs=read-write&connect_timeout=2",
    );
    let pooled = ConnectOptions::from_url(&pooled).unwrap();
    let electors = NODES
        .iter()
        .map(|node| {
            let elector = fast_lease(&pooled, ROLE, node)
                .lease(|l| l.listen_via(f.options.clone()))
                .build()
                .unwrap();
            (node.to_string(), elector)
        })
        .collect();
    under_faults(&f, Backend::Lease, "pgbouncer-per-node", electors, faults).await;
    // The lease statements went through the bouncers (the probe and the
    // fenced writes go directly to the nodes): through each one, since
    // each node was primary at some point.
    for (node, bouncer) in bouncers.0.iter().enumerate() {
        assert!(
            bouncer.is_running(),
            "the pgbouncer of node {node} exited: {}",
            bouncer.diagnose(40)
        );
        let n = transactions(bouncer).await;
        eprintln!("pgbouncer of node {node}: {n} transactions in {DB}");
        assert!(
            n > 0,
            "no lease statement went through the pgbouncer of node {node}"
        );
    }
    blocking(move || drop(bouncers)).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_backend_through_a_pgbouncer_per_node_under_pg_auto_failover() {
    if !enabled("lease_backend_through_a_pgbouncer_per_node_under_pg_auto_failover") {
        return;
    }
    if !pgelect_testkit::pgbouncer_available() {
        eprintln!(
            "SKIPPED lease_backend_through_a_pgbouncer_per_node_under_pg_auto_failover: pgbouncer not installed"
        );
        return;
    }
    through_bouncers(&ALL).await;
}
