//! The HTTP accept loop, with the timeouts of [`HttpTimeouts`]: `axum::serve`
//! has no setting for any of them, so the server serves each connection with
//! hyper's HTTP/1 builder itself.
//!
//! - the request head: hyper's `header_read_timeout` (it starts whenever
//!   the connection waits for a head: at the accept, and on a keep-alive
//!   connection at the previous response);
//! - the request body and the whole request: `tower_http`'s
//!   `RequestBodyTimeoutLayer` and `TimeoutLayer`, in
//!   [`crate::gateway::router`];
//! - idleness: a connection with no request in progress that receives no
//!   byte for [`HttpTimeouts::idle`] (counted from its last read or its
//!   last response, whichever is later) is shut down; hyper closes an idle
//!   HTTP/1 connection at once. Reads are stamped by [`Stamped`], the
//!   requests in progress counted (and their ends stamped) by
//!   [`InProgress`].
//!
//! A connection upgraded to a WebSocket leaves this loop (hyper hands the
//! socket over), and with it every HTTP timeout. On shutdown the loop stops
//! accepting, asks every connection to end after its current request, and
//! waits for them.
//!
//! Each accepted connection takes a place under its source address's cap
//! ([`AddressConns`]) before anything else: the place rides in the socket
//! ([`Stamped`]), so a WebSocket keeps it until it closes. Over the cap, a
//! connection is either served one request, answered `RATE_LIMITED` by
//! [`crate::gateway::http::admit_address`] (it carries
//! [`OverConnectionCap`]), and closed; or, once its address has
//! [`crate::limits::LimitsConfig::connection_refusals_per_address_max`]
//! such refusals in progress, closed at once: dropped where it was
//! accepted, before a task, a buffer or a timer is spent on it. The accept
//! itself is the standard library's on a listener the runtime only watches
//! for readiness ([`Acceptor`]), so a connection closed at once is an
//! `accept4` and a `close` and never enters the runtime's reactor (tokio's
//! own accept registers every socket with epoll, and its drop deregisters
//! it: two more system calls and a reactor slot per refused connection).

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::config::HttpTimeouts;
use crate::limits::{Accepted, AddressConns, AddressRefusalReason, AddressSlot, OverConnectionCap};

/// The wait before accepting again after an accept error other than a
/// refused handshake, typically `EMFILE`: the process is out of file
/// descriptors, and the idle timeouts free some.
pub const ACCEPT_RETRY_AFTER: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` until `shutdown` is set, holding each source
/// address to its cap of open connections (`conns`).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    timeouts: HttpTimeouts,
    conns: Arc<AddressConns>,
    mut shutdown: watch::Receiver<bool>,
) {
    let listener = match Acceptor::new(listener) {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "the listener cannot be watched");
            return;
        }
    };
    let mut tasks = JoinSet::new();
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    if !is_connection_error(&e) {
                        tracing::error!(error = %e, "accept failed");
                        tokio::time::sleep(ACCEPT_RETRY_AFTER).await;
                    }
                    continue;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            _ = crate::util::stopped(&mut shutdown) => break,
        };
        let slot = match conns.accept(peer.ip()) {
            Accepted::Serve(slot) | Accepted::Refuse(slot) => slot,
            Accepted::Close => {
                crate::metrics::ADDRESS_REFUSALS.add_by("reason", AddressRefusalReason::ConnectionsClosed.as_str(), 1);
                drop(tcp);
                continue;
            }
        };
        let tcp = match tcp.set_nonblocking(true).and_then(|()| TcpStream::from_std(tcp)) {
            Ok(tcp) => tcp,
            Err(e) => {
                tracing::debug!(error = %e, "an accepted connection could not be registered");
                continue;
            }
        };
        // Replies and hints are small frames that must leave at once: with
        // Nagle on, a reply queued behind a hint waits for the peer's
        // delayed ACK (~40 ms) and senders stall instead of batching.
        let _ = tcp.set_nodelay(true);
        tasks.spawn(connection(tcp, peer, slot, app.clone(), timeouts, shutdown.clone()));
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
}

/// The listening socket: accepts with the standard library, so a socket is
/// handed to the runtime (and its reactor) only once the caller keeps it.
struct Acceptor {
    #[cfg(unix)]
    inner: tokio::io::unix::AsyncFd<std::net::TcpListener>,
    #[cfg(not(unix))]
    inner: TcpListener,
}

impl Acceptor {
    fn new(listener: TcpListener) -> io::Result<Acceptor> {
        #[cfg(unix)]
        // SAFETY: the standard library's listener owns its descriptor, which
        // stays open and the same until the `AsyncFd` (its owner) drops.
        let inner = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(listener.into_std()?, tokio::io::Interest::READABLE)?
        };
        #[cfg(not(unix))]
        let inner = listener;
        Ok(Acceptor { inner })
    }

    /// The next connection, not yet registered with the runtime (blocking
    /// mode, as the standard library accepts it).
    async fn accept(&self) -> io::Result<(std::net::TcpStream, SocketAddr)> {
        #[cfg(unix)]
        loop {
            let mut ready = self.inner.readable().await?;
            if let Ok(accepted) = ready.try_io(|listener| listener.get_ref().accept()) {
                return accepted;
            }
        }
        #[cfg(not(unix))]
        {
            let (tcp, peer) = self.inner.accept().await?;
            Ok((tcp.into_std()?, peer))
        }
    }
}

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
    )
}

/// One connection: HTTP/1 with upgrades, ended when idle or at shutdown;
/// over its address's cap, ended after its first response.
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    slot: AddressSlot,
    app: Router,
    timeouts: HttpTimeouts,
    mut shutdown: watch::Receiver<bool>,
) {
    let started = Instant::now();
    let activity = Arc::new(Activity { started, last_ms: AtomicU64::new(0), in_progress: AtomicUsize::new(0) });
    let refusing = slot.refusing();
    let io = TokioIo::new(Stamped { inner: tcp, activity: activity.clone(), _slot: slot });
    let counter = activity.clone();
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        if refusing {
            req.extensions_mut().insert(OverConnectionCap);
        }
        let guard = InProgress::start(counter.clone());
        let reply = tower_service::Service::call(&mut app.clone(), req);
        async move {
            let reply = reply.await;
            drop(guard);
            Ok::<_, Infallible>(reply.unwrap_or_else(|never| match never {}))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.header)
        .keep_alive(!refusing)
        .serve_connection(io, service)
        .with_upgrades();
    tokio::pin!(conn);
    let mut ending = false;
    loop {
        // When this connection is idle if nothing arrives meanwhile; while
        // a request is in progress, look again one idle period from now
        // (its end is stamped, so the idle period restarts there).
        let idle_at = if activity.in_progress.load(Ordering::Acquire) > 0 {
            Instant::now() + timeouts.idle
        } else {
            activity.last() + timeouts.idle
        };
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "http connection ended");
                }
                return;
            }
            _ = tokio::time::sleep_until(idle_at), if !ending => {
                let quiet = Instant::now() >= activity.last() + timeouts.idle;
                if quiet && activity.in_progress.load(Ordering::Acquire) == 0 {
                    ending = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            _ = crate::util::stopped(&mut shutdown), if !ending => {
                ending = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// What the idle timeout of one connection looks at.
struct Activity {
    started: Instant,
    /// The last read that returned bytes, or the last response, whichever
    /// is later: milliseconds since the accept.
    last_ms: AtomicU64,
    in_progress: AtomicUsize,
}

impl Activity {
    fn stamp(&self) {
        self.last_ms.fetch_max(self.started.elapsed().as_millis() as u64, Ordering::AcqRel);
    }

    fn last(&self) -> Instant {
        self.started + Duration::from_millis(self.last_ms.load(Ordering::Acquire))
    }
}

/// Counts a request in progress on its connection while it lives, and
/// stamps its end.
struct InProgress(Arc<Activity>);

impl InProgress {
    fn start(activity: Arc<Activity>) -> InProgress {
        activity.in_progress.fetch_add(1, Ordering::AcqRel);
        InProgress(activity)
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.stamp();
        self.0.in_progress.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A TCP stream that stamps its connection's [`Activity`] on every read
/// that returns bytes, and holds the connection's place under its
/// address's cap for as long as the socket lives (an upgraded WebSocket's
/// too: hyper hands this stream over).
struct Stamped {
    inner: TcpStream,
    activity: Arc<Activity>,
    _slot: AddressSlot,
}

impl AsyncRead for Stamped {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.stamp();
        }
        polled
    }
}

impl AsyncWrite for Stamped {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
