//! `pgelect-throwaway`: a throwaway PostgreSQL (and a PgBouncer in
//! transaction mode in front of it) for test suites that are not Rust, such
//! as the Python package's pytest run (`pgelect-py/tests/`).
//!
//! Starts the servers the way the Rust tests do ([`Cluster::start`],
//! [`PgBouncer::start`]: as the unprivileged server user when run as root,
//! listening on 127.0.0.1 only), creates one database, and prints one line
//! of JSON on stdout:
//!
//! ```text
//! {"url": "postgres://postgres:…@127.0.0.1:PORT/DB", "bouncer_url": "postgres://…:BPORT/DB", "database": "DB"}
//! ```
//!
//! `bouncer_url` is `null` when pgbouncer is not installed. The URLs carry
//! the kit's fixed test password ([`pgelect_testkit::TEST_PASSWORD`]); the
//! servers accept connections from this machine only and are removed when
//! this process ends. It runs until its stdin reaches end of file (the
//! caller closes the pipe or exits), then stops both servers and removes
//! their directories. The kit's reapers remove them too if this process is
//! killed.

use std::io::Read;

use pgelect_testkit::{pgbouncer_available, Cluster, PgBouncer, PoolMode, TestDb};

fn main() {
    if let Err(e) = run() {
        eprintln!("pgelect-throwaway: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    let cluster = Cluster::start().map_err(|e| {
        format!("cannot start a throwaway PostgreSQL: {e}; install the server (scripts/setup.sh)")
    })?;
    let db = runtime.block_on(TestDb::on(&cluster, "throwaway"));
    let bouncer = if pgbouncer_available() {
        Some(
            PgBouncer::start(&cluster, PoolMode::Transaction)
                .map_err(|e| format!("cannot start PgBouncer: {e}"))?,
        )
    } else {
        None
    };
    let line = json_line(
        &cluster.tcp_url(db.name()),
        bouncer.as_ref().map(|b| b.tcp_url(db.name())).as_deref(),
        db.name(),
    );
    println!("{line}");
    // Wait for end of file on stdin, whatever is written before it.
    let mut sink = Vec::new();
    let _ = std::io::stdin().lock().read_to_end(&mut sink);
    drop(bouncer);
    drop(db);
    drop(cluster);
    Ok(())
}

/// The one line of JSON, without a JSON crate: every value is a URL or a
/// database name the kit made (no quotes, backslashes or control
/// characters), escaped all the same.
fn json_line(url: &str, bouncer_url: Option<&str>, database: &str) -> String {
    let s = |v: &str| {
        let mut out = String::from("\"");
        for c in v.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
        out
    };
    format!(
        "{{\"url\": {}, \"bouncer_url\": {}, \"database\": {}}}",
        s(url),
        bouncer_url.map(s).unwrap_or_else(|| "null".to_owned()),
        s(database)
    )
}
