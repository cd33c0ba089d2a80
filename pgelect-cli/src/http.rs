//! `--metrics-addr`: `/metrics` (Prometheus text), `/healthz` and `/leader`
//! (JSON) on one small HTTP/1.1 listener.
//!
//! Hand-written rather than hyper: three read-only routes, no request
//! bodies, one request per connection, and no new dependency tree in the
//! binary. It is built to be exposed to a network it does not trust:
//!
//! * nothing it serves opens a database connection: `/healthz` answers from
//!   the supervisor's phase and [`pgelect::Elector::last_contact`];
//! * at most [`MAX_CONNECTIONS`] connections are served at once; one more is
//!   answered `503` without reading its request and closed;
//! * a request's head must arrive within [`HEAD_DEADLINE`] (slowloris) and
//!   fit in [`MAX_HEAD`] bytes (else `431`); a request with a body gets `413`;
//! * accept errors (out of file descriptors) back off up to 1 s instead of
//!   spinning;
//! * lines may end in CRLF or a bare LF; a request line or header that is not
//!   HTTP gets `400` as soon as it is seen; methods other than GET and HEAD
//!   get `405` with `Allow`; HEAD gets GET's headers without the body;
//! * every answer carries `Connection: close`: requests pipelined behind the
//!   first are not answered (HTTP/1.1 lets a server close after any answer
//!   that says so). The connection is closed gracefully (its write side
//!   first, then what the client still sends is drained for a moment), so
//!   that the answer is not lost to a reset.
//!
//! What it exposes: the role, this candidate's node id, whether it leads and
//! with which term, the current leader's node id, term and lease times, and
//! the library's metrics. No connection string, user name or password.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::exit::{self, Failure};

/// Connections served at once; more are answered `503` and closed.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has to send a request's line and headers.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// Largest request line plus headers accepted.
pub const MAX_HEAD: usize = 8 * 1024;
/// Time a client has to take the answer.
const WRITE_DEADLINE: Duration = Duration::from_secs(5);
/// How long what a client still sends is drained after the answer.
const LINGER: Duration = Duration::from_secs(1);
/// Longest pause between accepts while accepting fails.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// The session backend's lock-wait slice (the library's default, which
/// `pgelect run` does not change): a blocked standby hears from the server
/// once per slice.
const WAIT_SLICE: Duration = Duration::from_secs(20);

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
    elector: Arc<pgelect::Elector>,
    leader: tokio::sync::watch::Receiver<Option<pgelect::election::LeaderInfo>>,
}

impl Status {
    /// Records what the supervisor does now.
    pub fn set(&self, phase: Phase) {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner()) = phase;
    }

    fn phase(&self) -> Phase {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Installs the Prometheus recorder and serves the three routes on `addr`.
pub async fn serve(addr: SocketAddr, elector: Arc<pgelect::Elector>) -> Result<Status, Failure> {
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
    if !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "--metrics-addr is not a loopback address: whoever can reach it sees the role, this node's id, whether it leads and its term, the current leader's id, term and lease, and the metrics (no credentials); bind 127.0.0.1 or firewall the port"
        );
    }
    tracing::info!(%addr, "serving /metrics, /healthz and /leader");
    let status = Status {
        phase: Arc::new(Mutex::new(Phase::Standing)),
        leader: elector.watch(),
        elector,
    };
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(accept_loop(listener, handle, status.clone()));
    Ok(status)
}

/// Accepts for ever: within the connection cap each connection gets a task;
/// beyond it a `503` is written without waiting and the connection closed.
async fn accept_loop(listener: TcpListener, handle: PrometheusHandle, status: Status) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut backoff = Duration::ZERO;
    let mut failures = 0u64;
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                if failures > 0 {
                    tracing::info!(failures, "accepting connections again");
                }
                backoff = Duration::ZERO;
                failures = 0;
                match slots.clone().try_acquire_owned() {
                    Ok(slot) => {
                        let (handle, status) = (handle.clone(), status.clone());
                        tokio::spawn(async move {
                            connection(stream, &handle, &status).await;
                            drop(slot);
                        });
                    }
                    Err(_) => {
                        // No task, no wait: a full socket buffer just
                        // loses the answer, the close still happens.
                        let _ = stream.try_write(&response(
                            503,
                            "text/plain",
                            "too many connections; retry shortly\n",
                            false,
                        ));
                    }
                }
            }
            Err(e) => {
                // EMFILE/ENFILE leave the connection queued: accepting again
                // at once would fail again at once, at 100% CPU.
                failures += 1;
                backoff = (backoff * 2)
                    .max(Duration::from_millis(10))
                    .min(MAX_ACCEPT_BACKOFF);
                if failures == 1 || failures.is_multiple_of(60) {
                    tracing::warn!(error = %e, failures, ?backoff, "cannot accept a metrics connection; backing off");
                }
                tokio::time::sleep(backoff).await;
            }
        }
    }
}

/// Serves one request on `stream` and closes it.
async fn connection(mut stream: TcpStream, handle: &PrometheusHandle, status: &Status) {
    let answer = match tokio::time::timeout(HEAD_DEADLINE, read_head(&mut stream)).await {
        Ok(Ok(Some(answer))) => answer,
        // The client went away, or its socket failed.
        Ok(Ok(None)) | Ok(Err(_)) => return,
        Err(_) => Answer::Error(408, "request head not received in time\n"),
    };
    let bytes = match answer {
        Answer::Error(code, why) => response(code, "text/plain", why, true),
        Answer::Request(request) => route(&request, handle, status),
    };
    let writing = async {
        stream.write_all(&bytes).await?;
        stream.shutdown().await
    };
    if tokio::time::timeout(WRITE_DEADLINE, writing).await.is_err() {
        return;
    }
    // Closing with unread input would reset the connection and could
    // destroy the answer before the client reads it: drain for a moment.
    let mut sink = [0u8; 4096];
    let draining = async {
        let mut drained = 0usize;
        while drained < 64 * 1024 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(n) => drained += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, draining).await;
}

/// Reads until a whole request head is in, or it is found bad.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<Answer>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        match parse(&buf) {
            Parse::Partial if buf.len() >= MAX_HEAD => {
                return Ok(Some(Answer::Error(431, "request head too large\n")))
            }
            Parse::Partial => {}
            Parse::Done(answer) => return Ok(Some(answer)),
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// What a request head asks for, or why it cannot be served.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Request(Request),
    Error(u16, &'static str),
}

#[derive(Debug, PartialEq, Eq)]
struct Request {
    /// `false` for HEAD: headers only.
    body: bool,
    path: String,
}

#[derive(Debug, PartialEq, Eq)]
enum Parse {
    /// More bytes needed.
    Partial,
    Done(Answer),
}

/// Parses the first request head in `buf` (RFC 9112, lines ending in CRLF
/// or LF). A bad request line or header is reported as soon as its line is
/// complete, or at once when a byte that cannot belong to it arrives.
fn parse(buf: &[u8]) -> Parse {
    let bad = |why| Parse::Done(Answer::Error(400, why));
    // RFC 9112 §2.2: empty lines before the request line are ignored.
    let start = buf
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len());
    let mut lines = buf[start..].split_inclusive(|&b| b == b'\n');
    let Some(first) = lines.next() else {
        return Parse::Partial;
    };
    let complete = first.ends_with(b"\n");
    let line = trim_eol(first);
    // Request lines are visible ASCII and single spaces; anything else
    // (a TLS hello, binary noise) is refused without waiting for a newline.
    if line.iter().any(|b| !(0x20..0x7f).contains(b)) {
        return bad("malformed request line\n");
    }
    if !complete {
        return Parse::Partial;
    }
    let parts: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
    let [method, target, version] = parts[..] else {
        return bad("malformed request line: expected METHOD TARGET HTTP/1.1\n");
    };
    if method.is_empty() || !method.iter().all(|&b| is_tchar(b)) {
        return bad("malformed method\n");
    }
    if !version.starts_with(b"HTTP/") {
        return bad("malformed request line: no HTTP version\n");
    }
    if version != b"HTTP/1.1" && version != b"HTTP/1.0" {
        return Parse::Done(Answer::Error(505, "only HTTP/1.0 and HTTP/1.1\n"));
    }
    let path = match target {
        [b'/', ..] => target,
        _ if target.starts_with(b"http://") => {
            let rest = &target[7..];
            rest.iter()
                .position(|&b| b == b'/')
                .map(|i| &rest[i..])
                .unwrap_or(b"/")
        }
        _ => return bad("malformed request target\n"),
    };
    let path = String::from_utf8_lossy(path.split(|&b| b == b'?').next().unwrap_or(b"/"));
    let mut has_body = false;
    for raw in lines {
        let complete = raw.ends_with(b"\n");
        let line = trim_eol(raw);
        if complete && line.is_empty() {
            let body = match method {
                b"GET" => true,
                b"HEAD" => false,
                _ => return Parse::Done(Answer::Error(405, "only GET and HEAD\n")),
            };
            if has_body {
                return Parse::Done(Answer::Error(413, "request bodies are not accepted\n"));
            }
            return Parse::Done(Answer::Request(Request {
                body,
                path: path.into_owned(),
            }));
        }
        if line.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
            return bad("control character in a header\n");
        }
        if !complete {
            return Parse::Partial;
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return bad("malformed header: no colon\n");
        };
        let name = &line[..colon];
        // Also refuses obsolete line folding (a line starting with a space).
        if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
            return bad("malformed header name\n");
        }
        let value = line[colon + 1..].trim_ascii();
        if name.eq_ignore_ascii_case(b"transfer-encoding")
            || (name.eq_ignore_ascii_case(b"content-length") && value != b"0")
        {
            has_body = true;
        }
    }
    Parse::Partial
}

fn trim_eol(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// RFC 9110 token characters.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn route(request: &Request, handle: &PrometheusHandle, status: &Status) -> Vec<u8> {
    let (code, content_type, body) = match request.path.as_str() {
        "/metrics" => (200, "text/plain; version=0.0.4", handle.render()),
        "/healthz" => {
            let (code, body) = health(status);
            (code, "text/plain", body)
        }
        "/leader" => (200, "application/json", leader_json(status)),
        "/is-leader" => {
            let (code, body) = is_leader(status);
            (code, "text/plain", body)
        }
        _ => (
            404,
            "text/plain",
            "not found; try /metrics, /healthz, /leader or /is-leader\n".to_owned(),
        ),
    };
    response(code, content_type, &body, request.body)
}

/// How long a standby may go without hearing from the database and still be
/// healthy: twice the TTL, and never less than one lock-wait slice plus 5 s
/// (a blocked session standby hears from the server once per slice).
pub fn staleness_bound(ttl: Duration) -> Duration {
    (2 * ttl).max(WAIT_SLICE + Duration::from_secs(5))
}

/// 200 while leading (the library ends leadership by its deadline when the
/// database stops answering), or standing with an answer from the database
/// within [`staleness_bound`]; 503 otherwise, with the reason. Opens no
/// connection: the elector's own connections report their last answer.
fn health(status: &Status) -> (u16, String) {
    let contact = status.elector.last_contact();
    let bound = staleness_bound(status.elector.ttl());
    let ago = |d: Duration| format!("{:.1}s ago", d.as_secs_f64());
    match (status.phase(), contact) {
        (Phase::Stopping, _) => (503, "leadership lost; stopping the command\n".into()),
        (Phase::Leading(term), _) => (200, format!("ok: leading with term {term}\n")),
        (Phase::Standing, Some(d)) if d <= bound => (
            200,
            format!("ok: standing by; the database answered {}\n", ago(d)),
        ),
        (Phase::Standing, Some(d)) => (
            503,
            format!(
                "standing by, but the database last answered {} (more than {}s)\n",
                ago(d),
                bound.as_secs()
            ),
        ),
        (Phase::Standing, None) => (
            503,
            "standing by, but no answer from the database yet\n".into(),
        ),
    }
}

/// 200 only while this process leads (its command runs with the current
/// term), 503 otherwise: for a readiness probe or a load balancer that must
/// send traffic to the leader alone. Read from the supervisor's own state
/// (set when elected, cleared the moment leadership is lost or handed
/// over); no query.
fn is_leader(status: &Status) -> (u16, String) {
    let role = status.elector.role();
    match status.phase() {
        Phase::Leading(term) => (200, format!("leader of {role:?} with term {term}\n")),
        Phase::Stopping => (503, format!("not leader of {role:?}: handing over\n")),
        Phase::Standing => (503, format!("not leader of {role:?}: standing by\n")),
    }
}

fn leader_json(status: &Status) -> String {
    let me = match status.phase() {
        Phase::Leading(term) => serde_json::json!({"is_leader": true, "term": term}),
        _ => serde_json::json!({"is_leader": false, "term": null}),
    };
    // Only names, the term and times: holder metadata could hold anything.
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
        "role": status.elector.role(),
        "node": status.elector.node_id(),
        "is_leader": me["is_leader"],
        "term": me["term"],
        "leader": leader,
    })
    .to_string()
        + "\n"
}

/// A whole answer; `with_body` false (HEAD) keeps the headers, the
/// `Content-Length` included, and leaves out the body.
fn response(code: u16, content_type: &str, body: &str, with_body: bool) -> Vec<u8> {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        505 => "HTTP Version Not Supported",
        _ => "Service Unavailable",
    };
    let extra = match code {
        405 => "allow: GET, HEAD\r\n",
        503 => "retry-after: 1\r\n",
        _ => "",
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\ncache-control: no-store\r\n{extra}connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if with_body {
        out.extend_from_slice(body.as_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(path: &str, body: bool) -> Parse {
        Parse::Done(Answer::Request(Request {
            body,
            path: path.to_owned(),
        }))
    }

    fn error(code: u16) -> impl Fn(&Parse) -> bool {
        move |p| matches!(p, Parse::Done(Answer::Error(c, _)) if *c == code)
    }

    #[test]
    fn crlf_and_bare_lf_heads_parse() {
        assert_eq!(
            parse(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"),
            request("/healthz", true)
        );
        assert_eq!(
            parse(b"GET /healthz HTTP/1.1\nHost: x\n\n"),
            request("/healthz", true)
        );
        assert_eq!(
            parse(b"\r\nHEAD /metrics?x=1 HTTP/1.0\n\n"),
            request("/metrics", false)
        );
        assert_eq!(
            parse(b"GET http://h:1/leader HTTP/1.1\r\n\r\n"),
            request("/leader", true)
        );
    }

    #[test]
    fn incomplete_heads_wait_for_more() {
        for head in [
            &b""[..],
            b"GE",
            b"GET /healthz HTTP/1.1",
            b"GET /healthz HTTP/1.1\r",
            b"GET /healthz HTTP/1.1\r\nHost: x",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r",
        ] {
            assert_eq!(
                parse(head),
                Parse::Partial,
                "{:?}",
                String::from_utf8_lossy(head)
            );
        }
    }

    #[test]
    fn malformed_heads_are_refused_as_soon_as_seen() {
        for head in [
            &b"\x16\x03\x01\x02"[..],
            b"hello\n",
            b"GET /healthz\r\n",
            b"GET  /healthz HTTP/1.1\r\n",
            b"G(T /healthz HTTP/1.1\r\n",
            b"GET healthz HTTP/1.1\r\n",
            b"GET /healthz FTP/1.1\r\n",
            b"GET /healthz HTTP/1.1\r\nno colon\r\n",
            b"GET /healthz HTTP/1.1\r\n folded: x\r\n",
            b"GET /healthz HTTP/1.1\r\nBad Name: x\r\n",
            b"GET /healthz HTTP/1.1\r\nX: a\x01",
        ] {
            assert!(
                error(400)(&parse(head)),
                "{:?}: {:?}",
                String::from_utf8_lossy(head),
                parse(head)
            );
        }
        assert!(error(505)(&parse(b"GET / HTTP/2.0\r\n\r\n")));
    }

    #[test]
    fn methods_and_bodies() {
        assert!(error(405)(&parse(b"POST /healthz HTTP/1.1\r\n\r\n")));
        assert!(error(405)(&parse(b"BREW /healthz HTTP/1.1\n\n")));
        assert!(error(413)(&parse(
            b"GET / HTTP/1.1\r\nContent-Length: 5\r\n\r\n"
        )));
        assert!(error(413)(&parse(
            b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        )));
        assert_eq!(
            parse(b"GET / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"),
            request("/", true)
        );
    }

    #[test]
    fn head_keeps_content_length_and_drops_the_body() {
        let get = response(200, "text/plain", "hello\n", true);
        let head = response(200, "text/plain", "hello\n", false);
        let get = String::from_utf8(get).unwrap();
        let head = String::from_utf8(head).unwrap();
        assert!(head.contains("content-length: 6\r\n"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "{head}");
        assert_eq!(get, head + "hello\n");
    }

    #[test]
    fn the_staleness_bound_covers_a_lock_wait_slice() {
        assert_eq!(
            staleness_bound(Duration::from_secs(1)),
            Duration::from_secs(25)
        );
        assert_eq!(
            staleness_bound(Duration::from_secs(15)),
            Duration::from_secs(30)
        );
    }
}
