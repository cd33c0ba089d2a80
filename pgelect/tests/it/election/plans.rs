//! The plans of the lease backend's statements at scale: against 10,000
//! leader rows and as many registered candidates, the statements the lease
//! client sends (`lease_sql`), for a batch of one and for full chunks, reach
//! their rows by index, planned for the batch (a statement sent whole) and
//! planned once for any batch (the generic plan the schema's lease
//! functions keep). A sequential scan of the leaders or candidates
//! table, or a `NOT IN` run as a plain subplan (once per row, as one did
//! before), fails the test with the plan. And the partition group's read
//! at 1,000 partitions: one pass, no subquery per partition, the member
//! list sent once.

use pgelect::schema::SchemaName;
use serde_json::Value;
use tokio_postgres::types::{ToSql, Type};

use crate::support::migrated;

const ROWS: usize = 10_000;

/// The largest batch of each statement the client sends: renewals and
/// releases in chunks of 2,000, acquires in chunks of 5,000.
const RENEW_ROWS: usize = 2_000;
const ACQUIRE_ROWS: usize = 5_000;

/// What in `plan` (an `EXPLAIN (FORMAT JSON)` node) reads a whole table
/// of pgelect's, or runs a subplan per row where a hashed one belongs.
fn regressions(plan: &Value, found: &mut Vec<String>) {
    match plan {
        Value::Object(node) => {
            let kind = node.get("Node Type").and_then(Value::as_str);
            let relation = node.get("Relation Name").and_then(Value::as_str);
            if kind == Some("Seq Scan") && matches!(relation, Some("leaders" | "candidates")) {
                found.push(format!(
                    "sequential scan of {}",
                    relation.unwrap_or_default()
                ));
            }
            if kind == Some("Nested Loop")
                && node.get("Join Type").and_then(Value::as_str) == Some("Anti")
            {
                found.push("a nested anti-join (rescans its inner side for every row)".to_owned());
            }
            for key in ["Filter", "Join Filter", "Hash Cond"] {
                if let Some(f) = node.get(key).and_then(Value::as_str) {
                    if f.contains("NOT ") && f.contains("SubPlan") && !f.contains("hashed SubPlan")
                    {
                        found.push(format!("{key} runs a subplan per row: {f}"));
                    }
                }
            }
            node.values().for_each(|v| regressions(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| regressions(v, found)),
        _ => {}
    }
}

/// Plans `sql` with `params` both ways the client runs it, and fails on a
/// regression in either: a custom plan, as for a statement sent whole, and
/// the generic plan that the schema's lease function (migration 9) keeps,
/// made without knowing the batch's size.
async fn assert_indexed(
    c: &tokio_postgres::Client,
    what: &str,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) {
    let row = c
        .query_typed_one(&format!("EXPLAIN (FORMAT JSON) {sql}"), params)
        .await
        .unwrap_or_else(|e| panic!("{what}: EXPLAIN failed: {e}"));
    let plan: Value = row.get(0);
    assert_no_regression(&format!("{what}, custom plan"), &plan);

    // A generic plan does not depend on the values (NULLs here).
    let types: Vec<&str> = params.iter().map(|(_, t)| t.name()).collect();
    let nulls = vec!["NULL"; params.len()];
    c.batch_execute(&format!(
        "SET plan_cache_mode = force_generic_plan; PREPARE plan_check({}) AS {sql}",
        types.join(", ")
    ))
    .await
    .unwrap_or_else(|e| panic!("{what}: PREPARE failed: {e:?}"));
    let row = c
        .query_typed_one(
            &format!(
                "EXPLAIN (FORMAT JSON) EXECUTE plan_check({})",
                nulls.join(", ")
            ),
            &[],
        )
        .await
        .unwrap_or_else(|e| panic!("{what}: EXPLAIN EXECUTE failed: {e:?}"));
    c.batch_execute("DEALLOCATE plan_check; RESET plan_cache_mode")
        .await
        .unwrap();
    let plan: Value = row.get(0);
    assert_no_regression(&format!("{what}, generic plan"), &plan);
}

fn assert_no_regression(what: &str, plan: &Value) {
    let mut found = Vec::new();
    regressions(plan, &mut found);
    assert!(
        found.is_empty(),
        "{what}: {found:?}\n{}",
        serde_json::to_string_pretty(plan).unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_statements_reach_their_rows_by_index_at_ten_thousand_roles() {
    let (db, _options) = migrated("lease_plans").await;
    let c = db.connect().await;
    // 10,000 leased roles held by `n` with term 1, and a lease candidate of
    // lower priority registered for each (the priority check reads them).
    c.batch_execute(&format!(
        "INSERT INTO pgelect.leaders
                (role, holder, term, backend, acquired_at, renewed_at, lease_until)
         SELECT 'r-' || i, 'n', 1, 'lease', now(), now(), now() + interval '1 hour'
           FROM generate_series(1, {ROWS}) AS i;
         INSERT INTO pgelect.candidates (role, node, priority, backend, timing)
         SELECT 'r-' || i, 'm', 0, 'lease', '{{\"ttl_ms\": 15000}}'
           FROM generate_series(1, {ROWS}) AS i;
         ANALYZE pgelect.leaders;
         ANALYZE pgelect.candidates;"
    ))
    .await
    .unwrap();
    let sql = pgelect::election::lease_sql(&SchemaName::default());
    for n in [1, 100, RENEW_ROWS, ACQUIRE_ROWS] {
        // Every n-th role, across the table.
        let roles: Vec<String> = (0..n)
            .map(|i| format!("r-{}", 1 + i * (ROWS / n)))
            .collect();
        let nodes = vec!["n"; n];
        let terms = vec![1i64; n];
        let ttls = vec![15_000i64; n];
        let priorities = vec![0i32; n];
        let payloads = vec!["pgelect:released:r"; n];
        let metas: Vec<Option<Value>> = vec![None; n];
        if n <= RENEW_ROWS {
            assert_indexed(
                &c,
                &format!("renew of {n}"),
                &sql.renew,
                &[
                    (&roles, Type::TEXT_ARRAY),
                    (&nodes, Type::TEXT_ARRAY),
                    (&terms, Type::INT8_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&priorities, Type::INT4_ARRAY),
                ],
            )
            .await;
            assert_indexed(
                &c,
                &format!("release of {n}"),
                &sql.release,
                &[
                    (&roles, Type::TEXT_ARRAY),
                    (&nodes, Type::TEXT_ARRAY),
                    (&terms, Type::INT8_ARRAY),
                    (&payloads, Type::TEXT_ARRAY),
                ],
            )
            .await;
        }
        // Standbys of held roles (the steady state) and of roles without a
        // row yet (a first start).
        let fresh: Vec<String> = (0..n).map(|i| format!("new-{i}")).collect();
        for (kind, roles) in [("held", &roles), ("new", &fresh)] {
            let standbys = vec!["s"; n];
            assert_indexed(
                &c,
                &format!("acquire of {n} {kind} roles"),
                &sql.acquire,
                &[
                    (roles, Type::TEXT_ARRAY),
                    (&standbys, Type::TEXT_ARRAY),
                    (&metas, Type::JSONB_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&payloads, Type::TEXT_ARRAY),
                    (&priorities, Type::INT4_ARRAY),
                    (&7i64, Type::INT8),
                    (&vec![5i64, 6], Type::INT8_ARRAY),
                ],
            )
            .await;
        }
    }
}

/// The nodes of `plan` that run once per row of their parent (a
/// correlated subquery), by name.
fn per_row_subplans(plan: &Value, found: &mut Vec<String>) {
    match plan {
        Value::Object(node) => {
            if node.get("Parent Relationship").and_then(Value::as_str) == Some("SubPlan") {
                found.push(
                    node.get("Subplan Name")
                        .and_then(Value::as_str)
                        .unwrap_or("SubPlan")
                        .to_owned(),
                );
            }
            node.values().for_each(|v| per_row_subplans(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| per_row_subplans(v, found)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partition_group_read_is_one_pass_and_sends_the_members_once_at_a_thousand_partitions()
{
    const PARTITIONS: usize = 1_000;
    let (db, _options) = migrated("partition_read_plan").await;
    let c = db.connect().await;
    // 1,000 partitions of group g, each led (lease backend) by its own
    // member and stood for by the next one, beside 10,000 other roles.
    c.batch_execute(&format!(
        "INSERT INTO pgelect.leaders
                (role, holder, term, backend, acquired_at, renewed_at, lease_until)
         SELECT 'g/' || i, 'm' || i, 1, 'lease', now(), now(), now() + interval '1 hour'
           FROM generate_series(0, {last}) AS i
         UNION ALL
         SELECT 'r-' || i, 'n', 1, 'lease', now(), now(), now() + interval '1 hour'
           FROM generate_series(1, {ROWS}) AS i;
         INSERT INTO pgelect.candidates (role, node, priority, backend, timing, meta, standby)
         SELECT 'g/' || i, 'm' || ((i + 1) % {PARTITIONS}), 0, 'lease',
                '{{\"ttl_ms\": 600000}}', '{{\"pgelect_partitions\": \"{PARTITIONS}\"}}', 'polling'
           FROM generate_series(0, {last}) AS i;
         ANALYZE pgelect.leaders;
         ANALYZE pgelect.candidates;",
        last = PARTITIONS - 1
    ))
    .await
    .unwrap();
    let sql = pgelect::partitions::group_read_sql(&SchemaName::default());
    let roles: Vec<String> = (0..PARTITIONS)
        .map(|p| pgelect::partitions::partition_role("g", p as u32))
        .collect();
    let n = PARTITIONS as i64;
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&roles, Type::TEXT_ARRAY),
        (&"m5", Type::TEXT),
        (&n, Type::INT8),
    ];
    let row = c
        .query_typed_one(&format!("EXPLAIN (FORMAT JSON) {sql}"), &params)
        .await
        .unwrap();
    let plan: Value = row.get(0);
    let mut found = Vec::new();
    per_row_subplans(&plan, &mut found);
    // The ready standbys were once a subquery per partition over every
    // live registration (1,000 x 2,000 rows a read).
    assert!(
        found.is_empty(),
        "subqueries run once per partition: {found:?}\n{}",
        serde_json::to_string_pretty(&plan).unwrap()
    );

    let rows = c.query_typed(&sql, &params).await.unwrap();
    assert_eq!(rows.len(), PARTITIONS);
    let mut lists = 0;
    for (p, r) in rows.iter().enumerate() {
        let holder: Option<String> = r.get(0);
        let ready: Vec<String> = r.get(2);
        let members: Vec<String> = r.get(3);
        assert_eq!(holder.as_deref(), Some(format!("m{p}").as_str()));
        assert_eq!(ready, vec![format!("m{}", (p + 1) % PARTITIONS)]);
        if !members.is_empty() {
            lists += 1;
            assert_eq!(members.len(), PARTITIONS, "every live member, once");
        }
    }
    // Once for the group, not on each of 1,000 rows (4.9 MB a read).
    assert_eq!(lists, 1, "rows carrying the member list");
}
