//! `--metrics-addr`: `/metrics` (Prometheus text), `/healthz` and `/leader`
//! (JSON) on one small HTTP/1.1 listener.
//!
//! Hand-written rather than hyper: three read-only GET routes, one request
//! per connection, and no new dependency tree in the binary.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::exit::{self, Failure};

/// What the supervisor is doing, for `/healthz` and `/leader`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Campaigning or waiting as a standby.
    Standing,
    /// Leading with this term; the command runs.
    Leading(i64),
    /// Leadership ended unexpectedly; the command is being killed.
    Stopping,
}

/// Shared between the supervisor loop and the listener.
#[derive(Clone)]
pub struct Status {
    phase: Arc<Mutex<Phase>>,
    role: String,
    node: String,
    options: pgelect::ConnectOptions,
    leader: tokio::sync::watch::Receiver<Option<pgelect::LeaderInfo>>,
}

impl Status {
    pub fn set(&self, phase: Phase) {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner()) = phase;
    }

    fn phase(&self) -> Phase {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Installs the Prometheus recorder and serves the three routes on `addr`.
pub async fn serve(
    addr: SocketAddr,
    role: &str,
    node: &str,
    options: pgelect::ConnectOptions,
    leader: tokio::sync::watch::Receiver<Option<pgelect::LeaderInfo>>,
) -> Result<Status, Failure> {
    let handle = PrometheusBuilder::new().install_recorder().map_err(|e| {
        Failure::new(
            exit::SOFTWARE,
            format!("cannot install the metrics recorder: {e}"),
        )
    })?;
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        Failure::new(
            exit::USAGE,
            format!("cannot listen on --metrics-addr {addr}: {e}"),
        )
    })?;
    tracing::info!(%addr, "serving /metrics, /healthz and /leader");
    let status = Status {
        phase: Arc::new(Mutex::new(Phase::Standing)),
        role: role.to_owned(),
        node: node.to_owned(),
        options,
        leader,
    };
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    let shared = status.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (handle, status) = (handle.clone(), shared.clone());
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(10), answer(stream, &handle, &status))
                        .await;
            });
        }
    });
    Ok(status)
}

async fn answer(
    mut stream: TcpStream,
    handle: &PrometheusHandle,
    status: &Status,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    while !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
        if len == buf.len() {
            return respond(&mut stream, 431, "text/plain", "request header too large\n").await;
        }
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            return Ok(());
        }
        len += n;
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    if method != "GET" && method != "HEAD" {
        return respond(&mut stream, 405, "text/plain", "only GET\n").await;
    }
    match path.split('?').next().unwrap_or("") {
        "/metrics" => {
            respond(
                &mut stream,
                200,
                "text/plain; version=0.0.4",
                &handle.render(),
            )
            .await
        }
        "/healthz" => {
            let (code, body) = health(status).await;
            respond(&mut stream, code, "text/plain", &body).await
        }
        "/leader" => respond(&mut stream, 200, "application/json", &leader_json(status)).await,
        _ => {
            respond(
                &mut stream,
                404,
                "text/plain",
                "not found; try /metrics, /healthz or /leader\n",
            )
            .await
        }
    }
}

/// 200 while the election loop is healthy: the database answers and the
/// supervisor is standing or leading; 503 otherwise, with the reason.
async fn health(status: &Status) -> (u16, String) {
    if status.phase() == Phase::Stopping {
        return (503, "leadership lost; stopping the command\n".into());
    }
    let ping = async {
        let (client, _) = crate::db::connect(&status.options, "pgelect:healthz")
            .await
            .ok()?;
        client.simple_query("SELECT 1").await.ok()
    };
    match tokio::time::timeout(Duration::from_secs(3), ping).await {
        Ok(Some(_)) => match status.phase() {
            Phase::Leading(term) => (200, format!("ok: leading with term {term}\n")),
            _ => (200, "ok: standing by\n".into()),
        },
        _ => (503, "the database does not answer\n".into()),
    }
}

fn leader_json(status: &Status) -> String {
    let me = match status.phase() {
        Phase::Leading(term) => serde_json::json!({"is_leader": true, "term": term}),
        _ => serde_json::json!({"is_leader": false, "term": null}),
    };
    let leader = status.leader.borrow().clone().map(|l| {
        let ms = |t: std::time::SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
        };
        serde_json::json!({
            "holder": l.holder,
            "term": l.term.get(),
            "acquired_at_unix_ms": ms(l.acquired_at),
            "lease_until_unix_ms": ms(l.lease_until),
        })
    });
    serde_json::json!({
        "role": status.role,
        "node": status.node,
        "is_leader": me["is_leader"],
        "term": me["term"],
        "leader": leader,
    })
    .to_string()
        + "\n"
}

async fn respond(
    stream: &mut TcpStream,
    code: u16,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
