//! Cancelling the statement running on a dedicated connection, waiting
//! (bounded) for the server to act on the request as libpq does.

use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::Config;
use tokio_postgres_rustls::MakeRustlsConnect;

/// The one TCP server `reached` names, if it names exactly one (no
/// `hostaddr`): where [`Canceller`] sends its requests itself. `reached` is
/// the host a connection reached
/// ([`open_reaching`](super::options::ConnectOptions::open_reaching)): of a
/// multi-host URL, the one host that accepted it.
pub(super) fn cancel_target(reached: &Config) -> Option<CancelTarget> {
    let hosts = reached.get_hosts();
    if hosts.len() != 1 || !reached.get_hostaddrs().is_empty() {
        return None;
    }
    let Host::Tcp(host) = &hosts[0] else {
        return None;
    };
    let port = match reached.get_ports() {
        [] => 5432,
        [p] => *p,
        _ => return None,
    };
    Some(CancelTarget {
        host: host.clone(),
        port,
        connect_timeout: reached
            .get_connect_timeout()
            .copied()
            .unwrap_or(Duration::from_secs(5)),
    })
}

/// Cancels the statement running on a
/// [`DedicatedConnection`](super::DedicatedConnection).
pub(crate) struct Canceller {
    pub(super) token: tokio_postgres::CancelToken,
    pub(super) tls: MakeRustlsConnect,
    pub(super) target: Option<CancelTarget>,
}

/// The one TCP server a connection's settings name: where pgelect sends a
/// cancel request itself, so that it can wait for the server's answer.
#[derive(Clone, Debug)]
pub(super) struct CancelTarget {
    host: String,
    port: u16,
    connect_timeout: Duration,
}

/// How long a cancel request may take, connecting included. The server
/// (or pooler) closes the connection as soon as it has acted on it.
const CANCEL_BOUND: Duration = Duration::from_secs(10);

impl Canceller {
    /// Sends the cancel request and, like libpq, waits (bounded by
    /// [`CANCEL_BOUND`]) until the server closes the cancel connection,
    /// which it does once it acted on the request; the statement may still
    /// finish first.
    ///
    /// tokio-postgres closes its side right after sending. PgBouncer up to
    /// at least 1.18 can then free the cancelling client while it still
    /// forwards the request, and exits ("FATAL … disconnect_client(): bad
    /// client state: 0", pgbouncer/pgbouncer#801): a pooler every other
    /// client depends on, brought down by a lease renewal's timeout. So
    /// with a single TCP host pgelect opens the connection itself and
    /// keeps it until the other side has closed it, at the host the
    /// connection reached (of a multi-host URL, the one that accepted it:
    /// one PgBouncer per data node is the usual deployment next to an HA
    /// manager). With a Unix socket or a `hostaddr`, the driver's own
    /// request is sent.
    pub(crate) async fn cancel(self) -> std::io::Result<()> {
        let Some(t) = self.target else {
            return tokio::time::timeout(CANCEL_BOUND, self.token.cancel_query(self.tls))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
                .map_err(std::io::Error::other);
        };
        let mut tls = self.tls;
        let token = self.token;
        let sent = async move {
            let stream = tokio::time::timeout(
                t.connect_timeout,
                tokio::net::TcpStream::connect((t.host.as_str(), t.port)),
            )
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
            let _ = stream.set_nodelay(true);
            let connector = MakeTlsConnect::<AwaitClose<tokio::net::TcpStream>>::make_tls_connect(
                &mut tls, &t.host,
            )
            .map_err(std::io::Error::other)?;
            token
                .cancel_query_raw(AwaitClose(stream), connector)
                .await
                .map_err(std::io::Error::other)
        };
        tokio::time::timeout(CANCEL_BOUND, sent)
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    }
}

/// A stream whose shutdown first waits for the other side to close: the
/// driver shuts the cancel connection down right after writing the
/// request; this makes that wait for the server's close, as libpq does.
struct AwaitClose<S>(S);

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for AwaitClose<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite
    for AwaitClose<S>
{
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        // Read (and drop) until the server's end of stream or an error.
        let mut scratch = [0u8; 64];
        loop {
            let mut buf = tokio::io::ReadBuf::new(&mut scratch);
            match std::pin::Pin::new(&mut self.0).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) if buf.filled().is_empty() => break,
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(_)) => break,
            }
        }
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
