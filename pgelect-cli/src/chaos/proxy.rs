//! A TCP proxy per supervisor, for the network faults: it can stop
//! forwarding (both TCP connections stay up: the kernels keep
//! acknowledging) or delay every chunk.
//!
//! Not the test kit's `FaultProxy`: `pgelect chaos` also runs in a build
//! without the test kit (the default, what `cargo install` builds) against
//! a database the user names, and that proxy cannot delay traffic (the
//! `latency` fault).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
struct State {
    blackhole: AtomicBool,
    delay_ms: AtomicU64,
}

pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(State::default());
        let s = state.clone();
        let task = tokio::spawn(async move {
            let mut pipes = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let s = s.clone();
                pipes.spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, &s), pipe(sr, cw, &s));
                });
            }
        });
        Ok(Proxy { port, state, task })
    }

    pub fn blackhole(&self, on: bool) {
        self.state.blackhole.store(on, Ordering::SeqCst);
    }

    pub fn delay(&self, d: Duration) {
        self.state
            .delay_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    s: &State,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // Blackholed: read nothing, so nothing is forwarded, not even
        // an end of stream, and both connections stay up.
        while s.blackhole.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = s.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        while s.blackhole.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
