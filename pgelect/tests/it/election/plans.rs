//! The plans of the lease backend's statements at scale: against 10,000
//! leader rows and as many registered candidates, the statements the lease
//! client sends (`lease_sql`), for a batch of one and for full chunks, reach
//! their rows by index, planned for the batch (a statement sent whole) and
//! planned once for any batch (the generic plan the schema's lease
//! functions keep). A sequential scan of the leaders or candidates
//! table, or a `NOT IN` run as a plain subplan (once per row, as one did
//! before), fails the test with the plan. And the partition group's read
//! at 1,000 partitions: one pass, no subquery per partition, the member
//! list sent once. The same for the session backend's batched statements
//! (renewal, poll, election, zombie preemption, registration), for a
//! batch of one and for a full chunk, planned by the backend whose pid the
//! rows name and by a new one. And the lease functions' kept plans, made
//! at their first call while the tables were empty, run full chunks once
//! the tables are full without a node that handles the batch times the
//! table.

use pgelect::schema::SchemaName;
use serde_json::Value;
use tokio_postgres::types::{ToSql, Type};

use crate::support::migrated;

const ROWS: usize = 10_000;

/// The largest batch of each statement the client sends: renewals and
/// releases in chunks of 2,000, acquires in chunks of 5,000.
const RENEW_ROWS: usize = 2_000;
const ACQUIRE_ROWS: usize = 5_000;

/// The session backend's chunks (`session/mod.rs`): registrations and
/// elections 200 at a time, renewals 2,000, polls 10,000 (and a zombie
/// preemption takes every vacant role a poll found, so as many).
const SESSION_BATCH_ROWS: usize = 200;
const SESSION_RENEW_ROWS: usize = 2_000;
const SESSION_POLL_ROWS: usize = 10_000;

/// `n` of the `ROWS` roles `r-1`..: every `ROWS / n`-th, across the table.
fn spread(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("r-{}", 1 + i * (ROWS / n)))
        .collect()
}

/// Fills the tables, `leaders` and `candidates` each a column list and
/// the query of its rows, and analyzes them.
async fn fill(c: &tokio_postgres::Client, leaders: &str, candidates: &str) {
    c.batch_execute(&format!(
        "INSERT INTO pgelect.leaders {leaders};
         INSERT INTO pgelect.candidates {candidates};
         ANALYZE pgelect.leaders;
         ANALYZE pgelect.candidates;"
    ))
    .await
    .unwrap();
}

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
            // An index scan with array keys (`= ANY`) on a nested loop's
            // inner side sorts the whole array again at every rescan, once
            // per outer row: a batch of 5,000 costs 5,000 sorts of 5,000
            // keys (PostgreSQL 15).
            if kind == Some("Nested Loop") {
                // (Harmless under a single outer row: a batch of one.)
                let outer_rows = node
                    .get("Plans")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .find(|p| p.get("Parent Relationship").and_then(Value::as_str) == Some("Outer"))
                    .and_then(|p| p.get("Plan Rows"))
                    .and_then(Value::as_f64)
                    .unwrap_or(0.0);
                for inner in node
                    .get("Plans")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter(|p| {
                        p.get("Parent Relationship").and_then(Value::as_str) == Some("Inner")
                    })
                {
                    // An inner join that reads a batch (a CTE or the
                    // arrays' rows) whole, once per outer row: a subquery
                    // the planner inlined (a CTE used once) and joined to
                    // a batch it took for a few rows. (A materialized
                    // CTE's scan there is not caught: see `reads_a_batch`.)
                    let inner_kind = inner.get("Node Type").and_then(Value::as_str);
                    let join = matches!(
                        inner_kind,
                        Some("Hash Join" | "Merge Join" | "Nested Loop" | "Materialize")
                    );
                    if outer_rows > 1.0 && join {
                        if let Some(what) = reads_a_batch(inner) {
                            found.push(format!("a batch read whole per outer row: {what}"));
                        }
                    }
                    let cond = inner
                        .get("Index Cond")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    if cond.contains("ANY (") {
                        found.push(format!(
                            "array keys rescanned per outer row: {} on {}: {cond}",
                            inner
                                .get("Node Type")
                                .and_then(Value::as_str)
                                .unwrap_or("?"),
                            inner
                                .get("Relation Name")
                                .and_then(Value::as_str)
                                .unwrap_or("?"),
                        ));
                    }
                }
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

/// A scan in `plan` (not below a subplan) that reads more than one row of
/// a CTE or of a function (the batch's arrays), described. Checked below
/// the inner joins of nested loops only: a nested loop that rescans a
/// materialized CTE (a statement's `up`, say) for each row of the batch is
/// a plan the planner makes for small estimates, and not caught here.
fn reads_a_batch(plan: &Value) -> Option<String> {
    let kind = plan.get("Node Type").and_then(Value::as_str)?;
    let rows = plan.get("Plan Rows").and_then(Value::as_f64).unwrap_or(0.0);
    if matches!(kind, "CTE Scan" | "Function Scan") && rows > 1.0 {
        let name = plan.get("Alias").and_then(Value::as_str).unwrap_or("?");
        return Some(format!("{kind} on {name}"));
    }
    plan.get("Plans")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|p| p.get("Parent Relationship").and_then(Value::as_str) != Some("SubPlan"))
        .find_map(reads_a_batch)
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
    fill(
        &c,
        &format!(
            "(role, holder, term, backend, acquired_at, renewed_at, lease_until)
             SELECT 'r-' || i, 'n', 1, 'lease', now(), now(), now() + interval '1 hour'
               FROM generate_series(1, {ROWS}) AS i"
        ),
        &format!(
            "(role, node, priority, backend, timing)
             SELECT 'r-' || i, 'm', 0, 'lease', '{{\"ttl_ms\": 15000}}'
               FROM generate_series(1, {ROWS}) AS i"
        ),
    )
    .await;
    let sql = pgelect::election::lease_sql(&SchemaName::default());
    for n in [1, 100, RENEW_ROWS, ACQUIRE_ROWS] {
        let roles = spread(n);
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

/// The rows a node of `plan` (an `EXPLAIN ANALYZE` plan in JSON) handled
/// over all its loops, counting those its filters removed: the most of
/// any node, with its type. A batch joined the wrong way round shows as a
/// node that handled the batch times the table.
fn most_rows_handled(plan: &Value) -> (f64, String) {
    let mut most = (0.0, String::new());
    fn walk(v: &Value, most: &mut (f64, String)) {
        match v {
            Value::Object(node) => {
                let num = |k: &str| node.get(k).and_then(Value::as_f64).unwrap_or(0.0);
                // EXPLAIN shows rows and removed rows per loop.
                let handled = (num("Actual Rows")
                    + num("Rows Removed by Filter")
                    + num("Rows Removed by Join Filter")
                    + num("Rows Removed by Index Recheck"))
                    * num("Actual Loops").max(1.0);
                if handled > most.0 {
                    let kind = node.get("Node Type").and_then(Value::as_str).unwrap_or("?");
                    let on = node
                        .get("Relation Name")
                        .or_else(|| node.get("Alias"))
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    *most = (handled, format!("{kind} {on}").trim().to_owned());
                }
                node.values().for_each(|v| walk(v, most));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, most)),
            _ => {}
        }
    }
    walk(plan, &mut most);
    most
}

/// A fleet's first start: each server process plans a lease function at
/// its first call and keeps the plan, and at a first start the tables are
/// still empty then. Such plans once joined batches of thousands the wrong
/// way round until autovacuum's first `ANALYZE` (an acquire of 5,000 roles
/// took 6-12 s). Here the functions are called once on empty tables, the
/// tables are filled to 10,000 roles without an `ANALYZE` (autovacuum off
/// for them), and full chunks are run through the same server process:
/// `auto_explain` reports the plans that ran, and no node of them may
/// handle more rows than a few passes over the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_functions_first_called_on_empty_tables_scale_once_the_tables_are_full() {
    let (db, _options) = migrated("lease_cold_plans").await;
    let admin = db.connect().await;
    admin
        .batch_execute(
            "ALTER TABLE pgelect.leaders SET (autovacuum_enabled = off);
             ALTER TABLE pgelect.candidates SET (autovacuum_enabled = off);",
        )
        .await
        .unwrap();
    // A connection whose notices (auto_explain's plans) are kept.
    let (c, mut connection) = db.config().connect(tokio_postgres::NoTls).await.unwrap();
    let (tx, mut notices) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        while let Some(Ok(m)) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let tokio_postgres::AsyncMessage::Notice(n) = m {
                let _ = tx.send(n.message().to_owned());
            }
        }
    });
    let (acquire, renew, release) = (
        "SELECT * FROM pgelect.lease_acquire($1, $2, $3, $4, $5, $6, $7, $8)",
        "SELECT * FROM pgelect.lease_renew($1, $2, $3, $4, $5)",
        "SELECT * FROM pgelect.lease_release($1, $2, $3, $4)",
    );
    let call = |n: usize, first: usize| -> Vec<String> {
        (first..first + n).map(|i| format!("r-{i:05}")).collect()
    };
    // The first calls, on empty tables, of a batch of one each: the plans
    // the server process keeps.
    for (sql, roles) in [
        (acquire, call(1, 0)),
        (renew, call(1, 0)),
        (release, call(1, 0)),
    ] {
        run_lease_call(&c, sql, &roles, "s").await;
    }
    // 10,000 roles led by `n`, a lease standby `s` registered for each.
    admin
        .batch_execute(&format!(
            "INSERT INTO pgelect.leaders
                    (role, holder, term, backend, acquired_at, renewed_at, lease_until)
             SELECT 'r-' || lpad(i::text, 5, '0'), 'n', 1, 'lease', now(), now(),
                    now() + interval '1 hour'
               FROM generate_series(1, {ROWS}) AS i;
             INSERT INTO pgelect.candidates (role, node, priority, backend, timing)
             SELECT 'r-' || lpad(i::text, 5, '0'), k, 0, 'lease', '{{\"ttl_ms\": 15000}}'
               FROM generate_series(1, {ROWS}) AS i, unnest(ARRAY['n', 's']) AS k;"
        ))
        .await
        .unwrap();
    c.batch_execute(
        "LOAD 'auto_explain';
         SET auto_explain.log_min_duration = 0;
         SET auto_explain.log_analyze = on;
         SET auto_explain.log_timing = off;
         SET auto_explain.log_nested_statements = on;
         SET auto_explain.log_format = json;
         SET client_min_messages = log;",
    )
    .await
    .unwrap();
    // Full chunks, in a transaction rolled back: a poll of `s` for 5,000
    // roles `n` holds, a renewal and a release of 2,000 of them by `n`.
    c.batch_execute("BEGIN").await.unwrap();
    let t = std::time::Instant::now();
    let polled = run_lease_call(&c, acquire, &call(ACQUIRE_ROWS, 1), "s").await;
    let won = polled
        .iter()
        .filter(|r| r.get::<_, Option<i64>>(0).is_some())
        .count();
    assert_eq!(
        (polled.len(), won),
        (ACQUIRE_ROWS, 0),
        "the poll: a row per role, none won"
    );
    let renewed = run_lease_call(&c, renew, &call(RENEW_ROWS, 1), "n").await;
    assert_eq!(
        renewed.len(),
        RENEW_ROWS,
        "the renewal: a row per role renewed"
    );
    let released = run_lease_call(&c, release, &call(RENEW_ROWS, 1), "n").await;
    assert_eq!(
        released[0].get::<_, i64>(0),
        RENEW_ROWS as i64,
        "the release cleared them"
    );
    let took = t.elapsed();
    c.batch_execute("ROLLBACK").await.unwrap();
    drop(c);
    let mut report = Vec::new();
    while let Some(message) = notices.recv().await {
        let Some((_, json)) = message.split_once("plan:") else {
            continue;
        };
        let plan: Value = serde_json::from_str(json.trim())
            .unwrap_or_else(|e| panic!("auto_explain's plan does not parse ({e}): {json}"));
        let text = plan["Query Text"].as_str().unwrap_or_default();
        // The statements inside the functions (not the calls around them).
        if !text.trim_start().starts_with("WITH") {
            continue;
        }
        let (rows, node) = most_rows_handled(&plan["Plan"]);
        let what: String = text
            .split_whitespace()
            .take(4)
            .collect::<Vec<_>>()
            .join(" ");
        report.push(format!(
            "{what}…: at most {rows:.0} rows in one node ({node})"
        ));
        assert!(
            rows <= 6.0 * ROWS as f64,
            "a plan kept from empty tables handled {rows:.0} rows in one node ({node}) \
             against {ROWS} roles:\n{}",
            serde_json::to_string_pretty(&plan).unwrap()
        );
    }
    assert_eq!(
        report.len(),
        3,
        "auto_explain reported the three statements: {report:?}"
    );
    println!("{}\nthe three calls took {took:?}", report.join("\n"));
}

/// Calls a lease function (`sql`: acquire, renewal or release, by its
/// name) for `roles` as `node`, term 1, TTL 15 s; its rows.
async fn run_lease_call(
    c: &tokio_postgres::Client,
    sql: &str,
    roles: &[String],
    node: &str,
) -> Vec<tokio_postgres::Row> {
    let n = roles.len();
    let nodes = vec![node; n];
    let terms = vec![1i64; n];
    let ttls = vec![15_000i64; n];
    let priorities = vec![0i32; n];
    let payloads = vec!["pgelect:released:r"; n];
    let metas: Vec<Option<Value>> = vec![None; n];
    let no_tokens: Vec<i64> = Vec::new();
    let r = if sql.contains("lease_acquire") {
        c.query_typed(
            sql,
            &[
                (&roles, Type::TEXT_ARRAY),
                (&nodes, Type::TEXT_ARRAY),
                (&metas, Type::JSONB_ARRAY),
                (&ttls, Type::INT8_ARRAY),
                (&payloads, Type::TEXT_ARRAY),
                (&priorities, Type::INT4_ARRAY),
                (&7i64, Type::INT8),
                (&no_tokens, Type::INT8_ARRAY),
            ],
        )
        .await
    } else if sql.contains("lease_renew") {
        c.query_typed(
            sql,
            &[
                (&roles, Type::TEXT_ARRAY),
                (&nodes, Type::TEXT_ARRAY),
                (&terms, Type::INT8_ARRAY),
                (&ttls, Type::INT8_ARRAY),
                (&priorities, Type::INT4_ARRAY),
            ],
        )
        .await
    } else {
        c.query_typed(
            sql,
            &[
                (&roles, Type::TEXT_ARRAY),
                (&nodes, Type::TEXT_ARRAY),
                (&terms, Type::INT8_ARRAY),
                (&payloads, Type::TEXT_ARRAY),
            ],
        )
        .await
    };
    r.unwrap_or_else(|e| panic!("{sql}: {e:?}"))
}

/// [`assert_indexed`], then [`assert_indexed_as_run`]: the statement's
/// plans checked, then the statement run; returns the report's line with
/// the run's time.
async fn planned_and_run(
    c: &tokio_postgres::Client,
    what: &str,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> String {
    assert_indexed(c, what, sql, params).await;
    let ms = assert_indexed_as_run(c, what, sql, params).await;
    format!("{what}: {ms:.1} ms")
}

/// Runs `sql` with `params` under `EXPLAIN ANALYZE` in a transaction
/// that is rolled back (for a statement whose side effects are writes and
/// notifications, which the rollback undoes; never a lock or a
/// termination), fails on a regression in the plan it ran, and returns
/// its execution time (ms).
async fn assert_indexed_as_run(
    c: &tokio_postgres::Client,
    what: &str,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> f64 {
    c.batch_execute("BEGIN").await.unwrap();
    let row = c
        .query_typed_one(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}"), params)
        .await
        .unwrap_or_else(|e| panic!("{what}: EXPLAIN ANALYZE failed: {e:?}"));
    c.batch_execute("ROLLBACK").await.unwrap();
    let plan: Value = row.get(0);
    assert_no_regression(&format!("{what}, as run"), &plan);
    plan[0]["Execution Time"].as_f64().unwrap_or_default()
}

/// The session backend's batched statements (`session/sql.rs` and the
/// batched registration), for a batch of one up to a full chunk of each,
/// planned for the batch and generically (a shared session keeps its
/// statements prepared), by the backend whose pid the rows name and by a
/// new one (a shared connection that reconnected: its pid is in no
/// statistics). The statements that only write and notify are also run,
/// in a transaction rolled back; the poll (advisory locks, which a
/// rollback keeps) and the preemption (terminations) are only planned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_statements_reach_their_rows_by_index_at_ten_thousand_roles() {
    let (db, _options) = migrated("session_plans").await;
    // 10,000 roles led by `n` at term 1 on one shared session (`writer`'s
    // backend), and a polling standby `m` of the same priority registered
    // on it for each (the readiness checks read them).
    let writer = db.connect().await;
    fill(
        &writer,
        &format!(
            "(role, holder, term, backend, holder_pid, acquired_at, renewed_at, lease_until)
             SELECT 'r-' || i, 'n', 1, 'session', pg_backend_pid(), now(), now(),
                    now() + interval '1 hour'
               FROM generate_series(1, {ROWS}) AS i"
        ),
        &format!(
            "(role, node, backend_pid, priority, backend, standby, timing)
             SELECT 'r-' || i, 'm', pg_backend_pid(), 0, 'session', 'polling',
                    '{{\"ttl_ms\": 15000, \"poll_interval_ms\": 1000}}'
               FROM generate_series(1, {ROWS}) AS i"
        ),
    )
    .await;
    let newcomer = db.connect().await;
    let schema = SchemaName::default();
    let renew = pgelect::election::shared_renew_sql(&schema);
    let poll = pgelect::election::shared_poll_sql(&schema);
    let elect = pgelect::election::shared_elect_sql(&schema);
    let preempt = pgelect::election::shared_preempt_sql(&schema);
    let register = pgelect::election::shared_register_sql(&schema);
    let timing = serde_json::json!({"ttl_ms": 15000, "poll_interval_ms": 1000});
    let mut times = Vec::new();
    for (who, c) in [("writer", &writer), ("newcomer", &newcomer)] {
        for n in [1, SESSION_BATCH_ROWS, SESSION_RENEW_ROWS, SESSION_POLL_ROWS] {
            // Roles with a row (held, or vacant once their leader is gone)
            // and roles without one yet (a first start).
            let held = spread(n);
            let fresh: Vec<String> = (0..n).map(|i| format!("new-{i}")).collect();
            // The registered standby `m` polls and is elected; `s`
            // registers beside it (the stale-row check reads `m`'s row).
            let (leaders, standbys, joiners) = (vec!["n"; n], vec!["m"; n], vec!["s"; n]);
            let terms = vec![1i64; n];
            let ttls = vec![15_000i64; n];
            let priorities = vec![0i32; n];
            let ids: Vec<i64> = (1..=n as i64).collect();
            let subids = vec![1i16; n];
            let metas: Vec<Option<Value>> = vec![None; n];
            let timings = vec![timing.clone(); n];
            let polling = vec!["polling"; n];
            let payloads = vec!["pgelect:r"; n];
            if n <= SESSION_RENEW_ROWS {
                let what = format!("renewal of {n} ({who})");
                let params: [(&(dyn ToSql + Sync), Type); 7] = [
                    (&held, Type::TEXT_ARRAY),
                    (&leaders, Type::TEXT_ARRAY),
                    (&terms, Type::INT8_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&priorities, Type::INT4_ARRAY),
                    (&ids, Type::INT8_ARRAY),
                    (&ids, Type::INT8_ARRAY),
                ];
                times.push(planned_and_run(c, &what, &renew, &params).await);
            }
            for (kind, roles) in [("held", &held), ("new", &fresh)] {
                let what = format!("poll of {n} {kind} roles ({who})");
                assert_indexed(
                    c,
                    &what,
                    &poll,
                    &[
                        (roles, Type::TEXT_ARRAY),
                        (&standbys, Type::TEXT_ARRAY),
                        (&ids, Type::INT8_ARRAY),
                        (&terms, Type::INT8_ARRAY),
                        (&leaders, Type::TEXT_ARRAY),
                        // Every standby's registration due for a refresh.
                        (roles, Type::TEXT_ARRAY),
                        (&standbys, Type::TEXT_ARRAY),
                    ],
                )
                .await;
                let what = format!("zombie preemption of {n} {kind} roles ({who})");
                assert_indexed(
                    c,
                    &what,
                    &preempt,
                    &[
                        (roles, Type::TEXT_ARRAY),
                        (&ids, Type::INT8_ARRAY),
                        (&ids, Type::INT8_ARRAY),
                        (&subids, Type::INT2_ARRAY),
                        (&ttls, Type::INT8_ARRAY),
                        (&false, Type::BOOL),
                    ],
                )
                .await;
                if n > SESSION_BATCH_ROWS {
                    continue;
                }
                let what = format!("election of {n} {kind} roles ({who})");
                let params: [(&(dyn ToSql + Sync), Type); 9] = [
                    (roles, Type::TEXT_ARRAY),
                    (&standbys, Type::TEXT_ARRAY),
                    (&metas, Type::JSONB_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&payloads, Type::TEXT_ARRAY),
                    (&priorities, Type::INT4_ARRAY),
                    (&ids, Type::INT8_ARRAY),
                    (&ids, Type::INT8_ARRAY),
                    (&subids, Type::INT2_ARRAY),
                ];
                times.push(planned_and_run(c, &what, &elect, &params).await);
                let what = format!("registration of {n} standbys of {kind} roles ({who})");
                let params: [(&(dyn ToSql + Sync), Type); 7] = [
                    (roles, Type::TEXT_ARRAY),
                    (&joiners, Type::TEXT_ARRAY),
                    (&priorities, Type::INT4_ARRAY),
                    (&polling, Type::TEXT_ARRAY),
                    (&timings, Type::JSONB_ARRAY),
                    (&metas, Type::JSONB_ARRAY),
                    (&payloads, Type::TEXT_ARRAY),
                ];
                times.push(planned_and_run(c, &what, &register, &params).await);
            }
        }
    }
    println!("{}", times.join("\n"));
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
    let last = PARTITIONS - 1;
    fill(
        &c,
        &format!(
            "(role, holder, term, backend, acquired_at, renewed_at, lease_until)
             SELECT 'g/' || i, 'm' || i, 1, 'lease', now(), now(), now() + interval '1 hour'
               FROM generate_series(0, {last}) AS i
             UNION ALL
             SELECT 'r-' || i, 'n', 1, 'lease', now(), now(), now() + interval '1 hour'
               FROM generate_series(1, {ROWS}) AS i"
        ),
        &format!(
            "(role, node, priority, backend, timing, meta, standby)
             SELECT 'g/' || i, 'm' || ((i + 1) % {PARTITIONS}), 0, 'lease',
                    '{{\"ttl_ms\": 600000}}', '{{\"pgelect_partitions\": \"{PARTITIONS}\"}}',
                    'polling'
               FROM generate_series(0, {last}) AS i"
        ),
    )
    .await;
    let sql = pgelect::partitions::group_read_sql(&SchemaName::default());
    let roles: Vec<String> = (0..PARTITIONS)
        .map(|p| pgelect::partitions::partition_role("g", p as u32))
        .collect();
    let n = PARTITIONS as i64;
    let params: [(&(dyn ToSql + Sync), Type); 2] = [(&roles, Type::TEXT_ARRAY), (&n, Type::INT8)];
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
    assert_eq!(rows.len(), 1, "the group's view is one value");
    let view: Value = rows[0].get(0);
    // [names, partitions, members, declared, since]: nodes by number.
    let names = view[0].as_array().unwrap();
    let name = |i: &Value| names[i.as_u64().unwrap() as usize].as_str().unwrap();
    let partitions = view[1].as_array().unwrap();
    assert_eq!(partitions.len(), PARTITIONS);
    for (p, v) in partitions.iter().enumerate() {
        assert_eq!(name(&v[0]), format!("m{p}"));
        let ready: Vec<&str> = v[2].as_array().unwrap().iter().map(name).collect();
        assert_eq!(ready, [format!("m{}", (p + 1) % PARTITIONS)]);
    }
    let members = view[2].as_array().unwrap();
    assert_eq!(members.len(), PARTITIONS, "every live member, once");
    assert_eq!(names.len(), PARTITIONS, "every node named once");
    let lists = 1;
    // Once for the group, not on each of 1,000 rows (4.9 MB a read).
    assert_eq!(lists, 1, "rows carrying the member list");
}
