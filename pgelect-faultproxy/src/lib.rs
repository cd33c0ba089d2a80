//! A TCP proxy with injectable network faults, for pgelect's tests, its
//! benchmarks and `pgelect chaos` (which runs in a build without the test
//! kit, against a database the user names): one proxy, not a copy per user.
//!
//! ```no_run
//! # fn example() -> std::io::Result<()> {
//! use std::time::Duration;
//! use pgelect_faultproxy::FaultProxy;
//!
//! let proxy = FaultProxy::start("127.0.0.1:5432".parse().unwrap())?;
//! // Point a client at 127.0.0.1:<proxy.port()>, then:
//! proxy.delay(Duration::from_millis(200)); // a slow network
//! proxy.blackhole(); // a partition: nothing forwarded, sockets stay open
//! proxy.heal();
//! proxy.cut(); // every connection reset
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

/// `e` with what was being done in front of its message.
fn ctx(e: io::Error, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A TCP proxy from `127.0.0.1:<random port>` to an upstream address, with
/// faults to simulate network trouble: [`blackhole`](FaultProxy::blackhole)
/// (partition), [`delay`](FaultProxy::delay) (a slow network),
/// [`cut`](FaultProxy::cut) (connections reset) and
/// [`refuse`](FaultProxy::refuse) (server unreachable).
///
/// It runs on its own thread with its own tokio runtime, so it is
/// independent of (and outlives) any test runtime, and works under a paused
/// tokio clock. Dropping it stops the thread and closes every connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    /// `true` while blackholed.
    blackholed: watch::Sender<bool>,
    /// Milliseconds every forwarded chunk waits (0: none).
    delay_ms: AtomicU64,
    refuse: AtomicBool,
    live: AtomicUsize,
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, ConnCtl>>,
}

/// Handle to cut one connection.
#[derive(Debug)]
struct ConnCtl {
    cut: oneshot::Sender<()>,
    closed: Arc<AtomicBool>,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, HashMap<u64, ConnCtl>> {
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl FaultProxy {
    /// Starts a proxy on `127.0.0.1:0` forwarding every accepted connection
    /// to `upstream` (connected to lazily, once not blackholed).
    ///
    /// # Errors
    ///
    /// If the listener, the runtime or the thread cannot be created.
    pub fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .map_err(|e| ctx(e, "bind the fault proxy"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ctx(e, "build the fault proxy runtime"))?;
        let shared = Arc::new(Shared {
            upstream,
            blackholed: watch::Sender::new(false),
            delay_ms: AtomicU64::new(0),
            refuse: AtomicBool::new(false),
            live: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
        });
        let (shutdown, shutdown_rx) = oneshot::channel();
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("fault-proxy-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(async move {
                    match TcpListener::from_std(listener) {
                        Ok(listener) => accept_loop(listener, thread_shared, shutdown_rx).await,
                        Err(e) => eprintln!("pgelect-testkit: fault proxy listener: {e}"),
                    }
                });
                // Drops every connection task (and so their sockets).
                runtime.shutdown_timeout(Duration::from_secs(2));
            })
            .map_err(|e| ctx(e, "spawn the fault proxy thread"))?;
        Ok(FaultProxy {
            addr,
            shared,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    /// The address clients connect to (`127.0.0.1:port`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Simulates a network partition: from now on no byte is forwarded in
    /// either direction, on current and new connections, and nothing errors
    /// (sockets stay open, new connections are accepted but not forwarded).
    ///
    /// Bytes are *held*, not dropped: the proxy simply stops reading, so
    /// after [`heal`](FaultProxy::heal) surviving connections resume where
    /// they stopped (like TCP after a short partition). A read that was
    /// already in progress may complete, but its bytes are held too.
    pub fn blackhole(&self) {
        self.shared.blackholed.send_replace(true);
    }

    /// Ends a [`blackhole`](FaultProxy::blackhole): forwarding resumes on all
    /// connections.
    pub fn heal(&self) {
        self.shared.blackholed.send_replace(false);
    }

    /// Delays every chunk forwarded from now on, in either direction and on
    /// current and new connections, by `d` (`Duration::ZERO` ends it). The
    /// chunks of one direction stay in order, each waiting its turn, so a
    /// busy connection's throughput falls as well: a slow, congested link
    /// rather than a long one. Independent of
    /// [`blackhole`](FaultProxy::blackhole).
    pub fn delay(&self, d: Duration) {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.shared.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Closes all current connections abruptly: both the client and the
    /// upstream side get a TCP RST (`SO_LINGER` 0). Returns once they are
    /// closed (at most 5 s). New connections are unaffected.
    pub fn cut(&self) {
        let ctls: Vec<ConnCtl> = self.shared.conns().drain().map(|(_, c)| c).collect();
        let closed: Vec<Arc<AtomicBool>> = ctls
            .into_iter()
            .map(|c| {
                let _ = c.cut.send(());
                c.closed
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && !closed.iter().all(|c| c.load(Ordering::Acquire)) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// While `yes`, new connections are accepted and immediately reset (the
    /// client sees a connection error at once). Current connections are
    /// unaffected.
    pub fn refuse(&self, yes: bool) {
        self.shared.refuse.store(yes, Ordering::SeqCst);
    }

    /// The number of live proxied connections.
    pub fn connections(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    /// Stops the proxy thread; every connection is closed.
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Sets `SO_LINGER` to 0 so that dropping the socket sends a RST.
fn reset_on_drop(sock: &TcpStream) {
    // Deprecated only because a *non-zero* linger blocks on drop; a zero
    // linger does not (and `set_zero_linger` needs tokio >= 1.47).
    #[allow(deprecated)]
    let _ = sock.set_linger(Some(Duration::ZERO));
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: oneshot::Receiver<()>,
) {
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let client = match accepted {
            Ok((client, _)) => client,
            Err(_) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if shared.refuse.load(Ordering::SeqCst) {
            reset_on_drop(&client);
            continue;
        }
        let _ = client.set_nodelay(true);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (cut_tx, cut_rx) = oneshot::channel();
        let closed = Arc::new(AtomicBool::new(false));
        shared.conns().insert(
            id,
            ConnCtl {
                cut: cut_tx,
                closed: Arc::clone(&closed),
            },
        );
        shared.live.fetch_add(1, Ordering::SeqCst);
        let guard = ConnGuard {
            id,
            shared: Arc::clone(&shared),
            closed,
        };
        tokio::spawn(async move {
            let guard = guard;
            proxy_conn(client, &guard.shared, cut_rx).await;
            drop(guard);
        });
    }
}

/// Unregisters a connection when its task ends (or is dropped at shutdown).
struct ConnGuard {
    id: u64,
    shared: Arc<Shared>,
    closed: Arc<AtomicBool>,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared.conns().remove(&self.id);
        self.shared.live.fetch_sub(1, Ordering::SeqCst);
        self.closed.store(true, Ordering::Release);
    }
}

/// Waits until the proxy is not blackholed.
async fn wait_open(state: &mut watch::Receiver<bool>) -> io::Result<()> {
    state
        .wait_for(|blackholed| !*blackholed)
        .await
        .map(|_| ())
        .map_err(|_| io::Error::other("proxy shut down"))
}

/// Copies `src` to `dst` until EOF (then half-closes `dst`), pausing while
/// blackholed and holding each chunk for the current delay.
async fn pump<R, W>(src: &mut R, dst: &mut W, shared: &Shared) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut state = shared.blackholed.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        wait_open(&mut state).await?;
        let n = src.read(&mut buf).await?;
        let delay = shared.delay_ms.load(Ordering::SeqCst);
        if delay > 0 && n > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        // Bytes read while (or just before) blackholed are held here.
        wait_open(&mut state).await?;
        if n == 0 {
            return dst.shutdown().await;
        }
        dst.write_all(&buf[..n]).await?;
    }
}

#[derive(PartialEq)]
enum End {
    /// Both directions reached EOF: close normally.
    Clean,
    /// Cut or I/O error: reset both sides.
    Abort,
}

async fn proxy_conn(mut client: TcpStream, shared: &Shared, mut cut: oneshot::Receiver<()>) {
    let mut state = shared.blackholed.subscribe();
    // Connect upstream only once not blackholed (a partitioned client must
    // not reach the server at all).
    let connect = async {
        wait_open(&mut state).await?;
        TcpStream::connect(shared.upstream).await
    };
    let mut upstream = tokio::select! {
        _ = &mut cut => {
            reset_on_drop(&client);
            return;
        }
        up = connect => match up {
            Ok(up) => up,
            Err(_) => {
                // Upstream down: the client sees a reset, like a refusal.
                reset_on_drop(&client);
                return;
            }
        },
    };
    let _ = upstream.set_nodelay(true);
    let end = {
        let (mut cr, mut cw) = client.split();
        let (mut ur, mut uw) = upstream.split();
        let to_upstream = pump(&mut cr, &mut uw, shared);
        let to_client = pump(&mut ur, &mut cw, shared);
        tokio::pin!(to_upstream, to_client);
        let (mut up_done, mut down_done) = (false, false);
        loop {
            tokio::select! {
                _ = &mut cut => break End::Abort,
                r = &mut to_upstream, if !up_done => match r {
                    Ok(()) => up_done = true,
                    Err(_) => break End::Abort,
                },
                r = &mut to_client, if !down_done => match r {
                    Ok(()) => down_done = true,
                    Err(_) => break End::Abort,
                },
            }
            if up_done && down_done {
                break End::Clean;
            }
        }
    };
    if end == End::Abort {
        reset_on_drop(&client);
        reset_on_drop(&upstream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// An upstream that echoes every byte back, on its own thread.
    fn echo_server() -> SocketAddr {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 || conn.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    /// One byte there and back through the proxy; how long it took.
    fn round_trip(conn: &mut std::net::TcpStream, byte: u8) -> Duration {
        let started = Instant::now();
        conn.write_all(&[byte]).unwrap();
        let mut back = [0u8; 1];
        conn.read_exact(&mut back).unwrap();
        assert_eq!(back[0], byte, "the proxy forwarded another byte");
        started.elapsed()
    }

    #[test]
    fn a_delay_holds_each_direction_and_zero_ends_it() {
        let proxy = FaultProxy::start(echo_server()).unwrap();
        let mut conn = std::net::TcpStream::connect(proxy.addr()).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let direct = round_trip(&mut conn, 1);
        proxy.delay(Duration::from_millis(150));
        let delayed = round_trip(&mut conn, 2);
        proxy.delay(Duration::ZERO);
        let after = round_trip(&mut conn, 3);
        eprintln!(
            "round trips: {direct:?} undelayed, {delayed:?} at 150 ms each way, {after:?} after"
        );
        // Held once on the way there and once on the way back.
        assert!(
            delayed >= Duration::from_millis(300),
            "a 150 ms delay each way gave a round trip of {delayed:?}"
        );
        assert!(
            after < Duration::from_millis(150),
            "the delay outlived delay(ZERO): {after:?}"
        );
        assert_eq!(proxy.connections(), 1);
    }

    #[test]
    fn a_blackhole_holds_bytes_until_healed() {
        let proxy = FaultProxy::start(echo_server()).unwrap();
        let mut conn = std::net::TcpStream::connect(proxy.addr()).unwrap();
        round_trip(&mut conn, 1);
        proxy.blackhole();
        conn.write_all(&[2]).unwrap();
        conn.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut back = [0u8; 1];
        let held = conn.read(&mut back);
        assert!(held.is_err(), "answered through a blackhole: {held:?}");
        proxy.heal();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn.read_exact(&mut back).unwrap();
        assert_eq!(back[0], 2, "the held byte was lost");
    }
}
