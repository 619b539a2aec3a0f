//! The fault-injecting proxy: it sits on `127.0.0.1:0` between SDK clients
//! and one server address, and forwards everything the clients send.
//!
//! A WebSocket upgrade (`/v1/ws`) is accepted here with the client's
//! `Authorization` header, and a WebSocket to the server is opened with the
//! same header; text frames are then forwarded both ways, and while faults
//! are on each frame may be dropped, duplicated, delayed, swapped with the
//! next one, or the whole connection cut, with probabilities drawn from a
//! seeded generator per connection. Every other request (login, refresh
//! over HTTP) is passed through byte for byte: the faults are about the
//! sync protocol, not about authentication.
//!
//! The proxy knows nothing of the frames' meaning; it never parses JSON.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::Message;

/// Connections (WebSocket or HTTP) the proxy serves at once; more wait.
pub const CONNECTIONS_MAX: usize = 256;
/// Longest HTTP request head the proxy looks into, bytes.
pub const HEAD_BYTES_MAX: usize = 16 * 1024;
/// How long a client may take to send its request head.
pub const HEAD_WAIT: Duration = Duration::from_secs(5);
/// How long opening the WebSocket to the server may take.
pub const UPSTREAM_CONNECT_WAIT: Duration = Duration::from_secs(2);

/// Fault probabilities per forwarded text frame, and the bounds of delays.
#[derive(Debug, Clone, Copy)]
pub struct FaultConfig {
    pub drop: f64,
    pub duplicate: f64,
    pub delay: f64,
    /// A delayed frame waits `1..=delay_ms_max` milliseconds (and holds the
    /// frames behind it in that direction, like a slow link).
    pub delay_ms_max: u64,
    pub swap: f64,
    /// A frame held for a swap goes out alone if no next frame comes within
    /// this long.
    pub swap_hold: Duration,
    pub cut: f64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            drop: 0.02,
            duplicate: 0.03,
            delay: 0.05,
            delay_ms_max: 40,
            swap: 0.02,
            swap_hold: Duration::from_millis(50),
            cut: 0.01,
        }
    }
}

/// The kinds of fault, as counted and printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Drop,
    Duplicate,
    Delay,
    Swap,
    Cut,
}

impl FaultKind {
    pub const ALL: [FaultKind; 5] =
        [FaultKind::Drop, FaultKind::Duplicate, FaultKind::Delay, FaultKind::Swap, FaultKind::Cut];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Drop => "drop",
            FaultKind::Duplicate => "duplicate",
            FaultKind::Delay => "delay",
            FaultKind::Swap => "swap",
            FaultKind::Cut => "cut",
        }
    }
}

/// Counters shared by every connection of a proxy.
#[derive(Debug, Default)]
pub struct ProxyStats {
    faults: [AtomicU64; 5],
    pub frames: AtomicU64,
    pub websockets: AtomicU64,
    pub http_passthrough: AtomicU64,
    /// Upgrades the proxy could not carry to the server (server down).
    pub upstream_refused: AtomicU64,
}

impl ProxyStats {
    fn count(&self, kind: FaultKind) {
        self.faults[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn faults(&self, kind: FaultKind) -> u64 {
        self.faults[kind as usize].load(Ordering::Relaxed)
    }

    pub fn faults_total(&self) -> u64 {
        FaultKind::ALL.iter().map(|k| self.faults(*k)).sum()
    }
}

struct Shared {
    upstream: SocketAddr,
    faults: FaultConfig,
    seed: u64,
    enabled: AtomicBool,
    stats: ProxyStats,
    next_conn: AtomicU64,
}

/// A running proxy; [`Proxy::stop`] ends it and every connection.
pub struct Proxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream`. Faults start off.
    pub async fn start(upstream: SocketAddr, faults: FaultConfig, seed: u64) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            faults,
            seed,
            enabled: AtomicBool::new(false),
            stats: ProxyStats::default(),
            next_conn: AtomicU64::new(0),
        });
        let (shutdown, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, shared.clone(), rx));
        Ok(Proxy { addr, shared, shutdown, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Turns fault injection on or off for every frame from now on.
    pub fn set_faults(&self, on: bool) {
        self.shared.enabled.store(on, Ordering::SeqCst);
    }

    pub fn stats(&self) -> &ProxyStats {
        &self.shared.stats
    }

    /// Stops accepting and ends every connection.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }
}

/// Owns every connection task: they end when it ends (the join set aborts
/// them on drop).
async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut conns = JoinSet::new();
    loop {
        let permit = tokio::select! {
            _ = shutdown.changed() => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            _ = shutdown.changed() => break,
            a = listener.accept() => a,
        };
        // Reap finished connections so the set stays as small as the
        // number of live ones.
        while conns.try_join_next().is_some() {}
        let Ok((stream, _)) = accepted else { continue };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        conns.spawn(async move {
            serve(stream, shared).await;
            drop(permit);
        });
    }
    conns.shutdown().await;
}

async fn serve(stream: TcpStream, shared: Arc<Shared>) {
    let Ok(Ok(head)) = tokio::time::timeout(HEAD_WAIT, peek_head(&stream)).await else {
        return;
    };
    if is_upgrade(&head) {
        shared.stats.websockets.fetch_add(1, Ordering::Relaxed);
        websocket(stream, shared).await;
    } else {
        shared.stats.http_passthrough.fetch_add(1, Ordering::Relaxed);
        passthrough(stream, shared.upstream).await;
    }
}

/// The request head, without consuming it from the socket.
async fn peek_head(stream: &TcpStream) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; HEAD_BYTES_MAX];
    loop {
        let n = stream.peek(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if let Some(end) = buf[..n].windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(buf[..end].to_vec());
        }
        if n == buf.len() {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        // Part of the head arrived; peek returns at once until more does.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn is_upgrade(head: &[u8]) -> bool {
    let head = String::from_utf8_lossy(head).to_ascii_lowercase();
    head.lines().any(|l| l.starts_with("upgrade:") && l.contains("websocket"))
}

async fn passthrough(mut client: TcpStream, upstream: SocketAddr) {
    let Ok(Ok(mut server)) = tokio::time::timeout(UPSTREAM_CONNECT_WAIT, TcpStream::connect(upstream)).await else {
        return;
    };
    let _ = server.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}

// tungstenite fixes the handshake callback's error type (an HTTP response).
#[allow(clippy::result_large_err)]
async fn websocket(stream: TcpStream, shared: Arc<Shared>) {
    let mut seen: Option<(String, Option<String>)> = None;
    let callback = |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
        let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned);
        seen = Some((req.uri().path().to_owned(), auth));
        Ok(resp)
    };
    let Ok(client) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
        return;
    };
    let Some((path, auth)) = seen else { return };
    let Ok(mut request) = format!("ws://{}{}", shared.upstream, path).into_client_request() else {
        return;
    };
    if let Some(value) = auth.and_then(|a| a.parse().ok()) {
        request.headers_mut().insert("authorization", value);
    }
    let connect = tokio_tungstenite::connect_async_with_config(request, None, true);
    let server = match tokio::time::timeout(UPSTREAM_CONNECT_WAIT, connect).await {
        Ok(Ok((server, _))) => server,
        // The server is down or refused: the client sees its socket close
        // and reconnects, as it would without the proxy.
        _ => {
            shared.stats.upstream_refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    // One generator per direction, derived from the seed and the connection
    // number, so a direction's choices do not depend on the other's timing.
    let seed = shared.seed ^ conn.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let (client_tx, client_rx) = client.split();
    let (server_tx, server_rx) = server.split();
    let up = pump(client_rx, server_tx, &shared, StdRng::seed_from_u64(seed));
    let down = pump(server_rx, client_tx, &shared, StdRng::seed_from_u64(seed.rotate_left(17) ^ 1));
    // Either direction ending (close, error or cut) drops both sockets.
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// What to do with one frame.
enum Verdict {
    Forward,
    Drop,
    Duplicate,
    Delay(Duration),
    Swap,
    Cut,
}

fn verdict(f: &FaultConfig, rng: &mut StdRng) -> Verdict {
    // One draw per kind, in a fixed order, so the stream of choices is a
    // function of the seed and the frame count alone.
    let cut = rng.random_bool(f.cut);
    let drop = rng.random_bool(f.drop);
    let dup = rng.random_bool(f.duplicate);
    let swap = rng.random_bool(f.swap);
    let delay = rng.random_bool(f.delay);
    let delay_ms = rng.random_range(1..=f.delay_ms_max.max(1));
    if cut {
        Verdict::Cut
    } else if drop {
        Verdict::Drop
    } else if dup {
        Verdict::Duplicate
    } else if swap {
        Verdict::Swap
    } else if delay {
        Verdict::Delay(Duration::from_millis(delay_ms))
    } else {
        Verdict::Forward
    }
}

async fn pump<R, W>(mut rx: R, mut tx: W, shared: &Shared, mut rng: StdRng)
where
    R: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
    W: futures_util::Sink<Message> + Unpin,
{
    let mut held: Option<Message> = None;
    loop {
        let next = match &held {
            Some(_) => match tokio::time::timeout(shared.faults.swap_hold, rx.next()).await {
                Ok(next) => next,
                Err(_) => {
                    // Nothing to swap with: the held frame goes out late.
                    let Some(frame) = held.take() else { continue };
                    if tx.send(frame).await.is_err() {
                        return;
                    }
                    continue;
                }
            },
            None => rx.next().await,
        };
        let msg = match next {
            Some(Ok(msg)) => msg,
            _ => return,
        };
        let msg = match msg {
            Message::Text(_) => msg,
            // Each hop answers its own pings; a close ends both sides.
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => continue,
            Message::Close(_) => {
                let _ = tx.send(Message::Close(None)).await;
                return;
            }
            Message::Binary(_) => msg,
        };
        shared.stats.frames.fetch_add(1, Ordering::Relaxed);
        let verdict =
            if shared.enabled.load(Ordering::SeqCst) { verdict(&shared.faults, &mut rng) } else { Verdict::Forward };
        let mut out: Vec<Message> = Vec::with_capacity(3);
        match verdict {
            Verdict::Forward => out.push(msg),
            Verdict::Drop => shared.stats.count(FaultKind::Drop),
            Verdict::Duplicate => {
                shared.stats.count(FaultKind::Duplicate);
                out.push(msg.clone());
                out.push(msg);
            }
            Verdict::Delay(d) => {
                shared.stats.count(FaultKind::Delay);
                tokio::time::sleep(d).await;
                out.push(msg);
            }
            Verdict::Swap if held.is_none() => {
                shared.stats.count(FaultKind::Swap);
                held = Some(msg);
            }
            // Already holding one: this frame overtakes it (the swap).
            Verdict::Swap => out.push(msg),
            Verdict::Cut => {
                shared.stats.count(FaultKind::Cut);
                return;
            }
        }
        if !out.is_empty() {
            if let Some(h) = held.take() {
                out.push(h);
            }
        }
        for frame in out {
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    }
}
