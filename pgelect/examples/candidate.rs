//! A candidate process, for tests and benchmarks that kill or freeze a
//! leader: stands for a role until killed, and reports on stdout.
//!
//! ```text
//! candidate [--backend session|lease] [--profile standard|fast] [--listen <direct-url>] <database-url> <role> [ttl-ms] [node-id]
//! ```
//!
//! `--backend lease` elects with the lease backend (the database URL may
//! point at PgBouncer in transaction mode; renewals every ttl/4, statement
//! timeout 300 ms); `--listen` gives it a direct connection for `LISTEN`.
//!
//! Prints `STANDING <node>`, then `ELECTED <term> <unix-ms>` on every
//! election and `LOST <reason> <unix-ms>` on every loss. A line `resign` on
//! stdin resigns the current leadership.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = Vec::new();
    let mut backend = pgelect::election::Backend::Session;
    let mut listen = None;
    let mut profile = None;
    let mut it = std::env::args();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--backend" => backend = it.next().unwrap_or_default().parse()?,
            "--listen" => listen = it.next(),
            "--profile" => profile = Some(it.next().unwrap_or_default().parse()?),
            _ => args.push(a),
        }
    }
    if args.len() < 3 {
        eprintln!("usage: candidate [--backend session|lease] [--profile standard|fast] [--listen <direct-url>] <database-url> <role> [ttl-ms] [node-id]");
        std::process::exit(2);
    }
    let options = pgelect::ConnectOptions::from_url(&args[1])?;
    let mut builder = pgelect::Elector::builder(options, &args[2]).backend(backend);
    builder = match profile {
        Some(p) => builder.profile(p),
        None => builder
            .heartbeat(Duration::from_millis(200))
            .heartbeat_timeout(Duration::from_millis(500))
            .check_every(Duration::from_millis(200)),
    };
    if let Some(ttl) = args.get(3) {
        let ttl = Duration::from_millis(ttl.parse()?);
        builder = builder.ttl(ttl);
        if backend == pgelect::election::Backend::Lease {
            builder = builder
                .renew_every(ttl / 4)
                .heartbeat_timeout(Duration::from_millis(300).min(ttl / 4));
        }
    }
    if let Some(url) = listen {
        builder = builder.listen_via(pgelect::ConnectOptions::from_url(&url)?);
    }
    if let Some(node) = args.get(4) {
        builder = builder.node_id(node);
    }
    let elector = builder.build()?;
    say(format!("STANDING {}", elector.node_id()));
    // Lines from stdin, read on a plain thread.
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            match line {
                Ok(l) => {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
    });
    let mut stdin_open = true;
    loop {
        let leadership = elector.leadership().await?;
        say(format!("ELECTED {} {}", leadership.term(), unix_ms()));
        loop {
            tokio::select! {
                _ = leadership.lost() => {
                    let reason = leadership.loss_reason().map(|r| r.as_str()).unwrap_or("?");
                    say(format!("LOST {reason} {}", unix_ms()));
                    let _ = leadership.resign().await;
                    break;
                }
                line = lines.recv(), if stdin_open => match line {
                    Some(l) if l.trim() == "resign" => {
                        let term = leadership.term();
                        leadership.resign().await?;
                        say(format!("RESIGNED {term} {}", unix_ms()));
                        break;
                    }
                    Some(_) => {}
                    None => stdin_open = false,
                },
            }
        }
    }
}
