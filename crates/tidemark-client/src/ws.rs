//! A WebSocket connection with request multiplexing by `rid`.
//!
//! It owns the socket's two tasks (reader and writer) and the table of
//! requests waiting for their reply; it knows nothing of what the requests
//! mean, and never retries, ACKs or resyncs by itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tidemark_proto::{
    op, AckOk, AckReq, ConvCreateOk, ConvCreateReq, ConvListOk, ErrorCode, ErrorFrame, SendOk, SendReq, ServerFrame,
    SyncOk, SyncReq,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};

use crate::{decode_reply, ClientError, ClientResult, Peek};

/// Server-initiated frames.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    Hint {
        high_watermark: u64,
        reason: String,
    },
    Kicked {
        reason: String,
    },
    /// A member of a conversation started or stopped typing (ephemeral:
    /// dropped like hints when the buffer is full).
    Typing(tidemark_proto::TypingFrame),
    /// A user sharing a conversation changed presence (ephemeral).
    Presence(tidemark_proto::PresenceFrame),
    /// The connection ended.
    Closed,
}

/// Server events buffered for the application; hints, typing and presence
/// beyond this are dropped (a hint may be lost by design, D8; the others
/// are ephemeral), `kicked` and `Closed` never.
pub const EVENTS_MAX: usize = 1024;
/// Outgoing frames queued before `request` waits.
pub const OUTGOING_MAX: usize = 256;
/// Read buffer of the SDK's WebSocket. tungstenite's default (128 KiB) is
/// zero-filled up to its capacity before every socket read, however small
/// the frame: in `tidemark bench reconnect` that `memset` and the fresh
/// pages behind 128 KiB per connection were a tenth of all CPU samples
/// (client and server together; docs/benchmarks.md, issue 19), and 10 000
/// connections held 1.2 GiB. Frames larger than the buffer still arrive
/// whole: it grows to the frame being read.
pub const WS_READ_BUFFER_BYTES: usize = 8 * 1024;

/// The SDK's WebSocket settings: tungstenite's defaults but the read buffer.
pub fn ws_config() -> tokio_tungstenite::tungstenite::protocol::WebSocketConfig {
    tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default().read_buffer_size(WS_READ_BUFFER_BYTES)
}

/// How [`WsConn::connect_with`] connects.
#[derive(Debug, Clone, Copy)]
pub struct WsOptions {
    /// Speak from this local address (a host with several; the tests and
    /// benchmarks of the server's per-address limits use several loopback
    /// addresses). `None`: the system's choice.
    pub local: Option<std::net::IpAddr>,
    /// Ask for `presence.batch` frames (`?presence_batch=true` on the
    /// upgrade, docs/protocol.md §4.5): the presence entries waiting for
    /// this connection come in one frame, which the reader hands on as one
    /// [`ServerEvent::Presence`] per entry, exactly as single frames. A
    /// server that does not know the parameter ignores it and sends single
    /// frames. On by default.
    pub presence_batch: bool,
}

impl Default for WsOptions {
    fn default() -> WsOptions {
        WsOptions { local: None, presence_batch: true }
    }
}

/// The requests waiting for their reply, and whether the connection has
/// ended. Once it has, no request is admitted: its reply could only come
/// through a reader that is gone, so it would wait forever (a request sent
/// while the socket closes used to, when it was registered after the
/// reader's last sweep).
#[derive(Default)]
struct Waiting {
    /// The text of each awaited reply, parsed by its request (typed, or
    /// into a `Value` for [`WsConn::request_value`]).
    replies: HashMap<String, oneshot::Sender<Utf8Bytes>>,
    ended: bool,
}

impl Waiting {
    /// Ends the table: every waiting request fails with `Closed` (its
    /// sender drops), and so does every later one.
    fn end(&mut self) {
        self.ended = true;
        self.replies.clear();
    }
}

type Pending = Arc<Mutex<Waiting>>;

#[derive(Clone)]
pub struct WsConn {
    out: mpsc::Sender<Message>,
    pending: Pending,
    next_rid: Arc<AtomicU64>,
    tasks: Arc<[AbortHandle; 2]>,
}

/// A refused upgrade carries the error object (docs/protocol.md §1.1):
/// surface it as the server's refusal so the caller can tell a bad token
/// (401) or a revoked device (403) from a network failure.
fn upgrade_error(e: tokio_tungstenite::tungstenite::Error) -> ClientError {
    use tokio_tungstenite::tungstenite::Error;
    let Error::Http(resp) = e else {
        return ClientError::Transport(e.to_string());
    };
    let status = resp.status().as_u16();
    if let Some(frame) = resp.body().as_deref().and_then(|b| serde_json::from_slice::<ErrorFrame>(b).ok()) {
        return ClientError::Server(frame);
    }
    let code = match status {
        401 => ErrorCode::Unauthenticated,
        403 => ErrorCode::DeviceRevoked,
        _ => return ClientError::Transport(format!("upgrade refused with HTTP {status}")),
    };
    ClientError::Server(ErrorFrame::new(code, format!("upgrade refused with HTTP {status}")))
}

impl WsConn {
    /// Connects to `ws_url` (like `ws://127.0.0.1:8080/v1/ws`) with the
    /// access token in the `Authorization` header.
    pub async fn connect(ws_url: &str, access_token: &str) -> ClientResult<(WsConn, mpsc::Receiver<ServerEvent>)> {
        WsConn::connect_with(ws_url, access_token, WsOptions::default()).await
    }

    /// Like [`WsConn::connect`], from the local address `local` (a host
    /// with several addresses; the tests and benchmarks of the server's
    /// per-address limits speak from several loopback addresses).
    pub async fn connect_from(
        ws_url: &str,
        access_token: &str,
        local: std::net::IpAddr,
    ) -> ClientResult<(WsConn, mpsc::Receiver<ServerEvent>)> {
        WsConn::connect_with(ws_url, access_token, WsOptions { local: Some(local), ..WsOptions::default() }).await
    }

    /// Like [`WsConn::connect`], as `options` say.
    pub async fn connect_with(
        ws_url: &str,
        access_token: &str,
        options: WsOptions,
    ) -> ClientResult<(WsConn, mpsc::Receiver<ServerEvent>)> {
        let transport = |e: std::io::Error| ClientError::Transport(e.to_string());
        let local = options.local;
        let url = if options.presence_batch {
            let sep = if ws_url.contains('?') { '&' } else { '?' };
            format!("{ws_url}{sep}presence_batch=true")
        } else {
            ws_url.to_owned()
        };
        let mut request = url.into_client_request().map_err(|e| ClientError::Transport(e.to_string()))?;
        let value = format!("Bearer {access_token}").parse().map_err(|_| ClientError::Transport("bad token".into()))?;
        request.headers_mut().insert("authorization", value);
        // Nagle off: requests are small frames that must leave at once.
        let (socket, _) = match local {
            None => tokio_tungstenite::connect_async_with_config(request, Some(ws_config()), true)
                .await
                .map_err(upgrade_error)?,
            Some(local) => {
                let host = request.uri().host().unwrap_or_default().trim_matches(['[', ']']).to_owned();
                let port = request.uri().port_u16().unwrap_or(80);
                let peer = tokio::net::lookup_host((host.as_str(), port))
                    .await
                    .map_err(transport)?
                    .find(|a| a.is_ipv4() == local.is_ipv4())
                    .ok_or_else(|| ClientError::Transport(format!("no address of {host} to reach from {local}")))?;
                let socket =
                    if local.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }
                        .map_err(transport)?;
                socket.bind(std::net::SocketAddr::new(local, 0)).map_err(transport)?;
                let tcp = socket.connect(peer).await.map_err(transport)?;
                tcp.set_nodelay(true).map_err(transport)?;
                // Plain `ws://` only: the client is built without TLS.
                let tcp = tokio_tungstenite::MaybeTlsStream::Plain(tcp);
                tokio_tungstenite::client_async_with_config(request, tcp, Some(ws_config()))
                    .await
                    .map_err(upgrade_error)?
            }
        };
        let (mut sink, mut stream) = socket.split();
        let (out_tx, mut out_rx) = mpsc::channel::<Message>(OUTGOING_MAX);
        let (ev_tx, ev_rx) = mpsc::channel::<ServerEvent>(EVENTS_MAX);
        let pending: Pending = Arc::default();
        let writer = tokio::spawn(async move {
            while let Some(msg) = out_rx.recv().await {
                if sink.send(msg).await.is_err() {
                    break;
                }
            }
            let _ = sink.close().await;
        });
        let reader_pending = pending.clone();
        let pong = out_tx.clone();
        let reader = tokio::spawn(async move {
            while let Some(Ok(msg)) = stream.next().await {
                let text = match msg {
                    Message::Text(t) => t,
                    Message::Ping(p) => {
                        let _ = pong.try_send(Message::Pong(p));
                        continue;
                    }
                    Message::Close(_) => break,
                    _ => continue,
                };
                let Ok(peek) = serde_json::from_str::<Peek>(&text) else {
                    continue;
                };
                if let Some(rid) = peek.rid {
                    let waiting = reader_pending.lock().expect("pending lock").replies.remove(rid.as_ref());
                    if let Some(tx) = waiting {
                        let _ = tx.send(text);
                    }
                    continue;
                }
                // Frames of types this SDK does not know are skipped.
                match serde_json::from_str::<ServerFrame>(&text) {
                    Ok(ServerFrame::Hint(h)) => {
                        let hint = ServerEvent::Hint { high_watermark: h.user_sync_high_watermark, reason: h.reason };
                        let _ = ev_tx.try_send(hint);
                    }
                    Ok(ServerFrame::Kicked(k)) => {
                        let _ = ev_tx.send(ServerEvent::Kicked { reason: k.reason }).await;
                    }
                    Ok(ServerFrame::Typing(t)) => {
                        let _ = ev_tx.try_send(ServerEvent::Typing(t));
                    }
                    Ok(ServerFrame::Presence(p)) => {
                        let _ = ev_tx.try_send(ServerEvent::Presence(p));
                    }
                    // The same entries as single frames, in order.
                    Ok(ServerFrame::PresenceBatch(b)) => {
                        for p in b.presence {
                            let _ = ev_tx.try_send(ServerEvent::Presence(p));
                        }
                    }
                    Err(_) => {}
                }
            }
            // Fail every request still waiting, and every later one.
            reader_pending.lock().expect("pending lock").end();
            let _ = ev_tx.send(ServerEvent::Closed).await;
        });
        let tasks = Arc::new([writer.abort_handle(), reader.abort_handle()]);
        Ok((WsConn { out: out_tx, pending, next_rid: Arc::new(AtomicU64::new(1)), tasks }, ev_rx))
    }

    /// Starts a clean close: queues a Close frame; the server answers it and
    /// the connection ends (the event stream then yields `Closed`).
    pub async fn close(&self) {
        let _ = self.out.send(Message::Close(None)).await;
    }

    /// Drops the socket at once, without a Close frame, as a killed process
    /// would; requests still waiting, and later ones, fail with `Closed`.
    /// The event stream ends without a `Closed` event.
    pub fn abort(&self) {
        for task in self.tasks.iter() {
            task.abort();
        }
        self.pending.lock().expect("pending lock").end();
    }

    /// Sends a raw text frame (for tests of malformed input).
    pub async fn send_raw(&self, text: String) -> ClientResult<()> {
        self.out.send(Message::Text(text.into())).await.map_err(|_| ClientError::Closed)
    }

    /// Sends `{"t": op, "rid": .., ...body}` and waits for its reply;
    /// `Closed` at once when the connection has ended, and as soon as it
    /// ends while the request waits (the caller bounds a silent peer).
    pub async fn request_value(&self, op: &str, body: Value) -> ClientResult<Value> {
        let text = self.request_text(op, body).await?;
        serde_json::from_str(&text).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// [`WsConn::request_value`], the reply's text unparsed.
    async fn request_text(&self, op: &str, body: Value) -> ClientResult<Utf8Bytes> {
        let rid = format!("r{}", self.next_rid.fetch_add(1, Ordering::Relaxed));
        let mut map = match body {
            Value::Object(m) => m,
            Value::Null => Default::default(),
            _ => return Err(ClientError::Decode("request body must be an object".into())),
        };
        map.insert("t".into(), Value::String(op.into()));
        map.insert("rid".into(), Value::String(rid.clone()));
        let (tx, rx) = oneshot::channel();
        {
            let mut waiting = self.pending.lock().expect("pending lock");
            if waiting.ended {
                return Err(ClientError::Closed);
            }
            waiting.replies.insert(rid.clone(), tx);
        }
        if self.out.send(Message::Text(Value::Object(map).to_string().into())).await.is_err() {
            self.pending.lock().expect("pending lock").replies.remove(&rid);
            return Err(ClientError::Closed);
        }
        rx.await.map_err(|_| ClientError::Closed)
    }

    pub async fn request<B: Serialize, T: DeserializeOwned>(&self, op: &str, body: &B) -> ClientResult<T> {
        let body = serde_json::to_value(body).map_err(|e| ClientError::Decode(e.to_string()))?;
        decode_reply(&self.request_text(op, body).await?)
    }

    pub async fn send(&self, req: &SendReq) -> ClientResult<SendOk> {
        self.request(op::SEND, req).await
    }

    pub async fn sync(&self, req: &SyncReq) -> ClientResult<SyncOk> {
        self.request(op::SYNC, req).await
    }

    pub async fn ack(&self, batch_token: &str, sync_seq: u64) -> ClientResult<AckOk> {
        self.request(op::ACK, &AckReq { batch_token: batch_token.into(), sync_seq }).await
    }

    pub async fn conv_create_direct(&self, peer: &str) -> ClientResult<ConvCreateOk> {
        self.request(
            op::CONV_CREATE,
            &ConvCreateReq { kind: "direct".into(), members: vec![peer.into()], client_msg_id: None },
        )
        .await
    }

    /// Every conversation in one reply (a request without paging fields).
    pub async fn conv_list(&self) -> ClientResult<ConvListOk> {
        self.request(op::CONV_LIST, &serde_json::json!({})).await
    }

    /// One page of `conv.list`: at most `limit` conversations after
    /// `after` (`None`: from the first), in `conv` order.
    pub async fn conv_list_page(&self, after: Option<&str>, limit: u32) -> ClientResult<ConvListOk> {
        let req = tidemark_proto::ConvListReq { limit: Some(limit), after: after.map(str::to_owned) };
        self.request(op::CONV_LIST, &req).await
    }

    /// Every conversation, following `conv.list` pages of
    /// [`tidemark_proto::CONV_LIST_LIMIT_MAX`], in list order (pinned first,
    /// then most recent `last_msg_seq`, then `conv`), as one unpaged reply
    /// has them.
    pub async fn conv_list_all(&self) -> ClientResult<Vec<tidemark_proto::ConvSummary>> {
        let mut all = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = self.conv_list_page(after.as_deref(), tidemark_proto::CONV_LIST_LIMIT_MAX).await?;
            all.extend(page.conversations);
            match (page.has_more, page.next_after) {
                (Some(true), Some(next)) => after = Some(next),
                _ => break,
            }
        }
        all.sort_by(|a, b| b.pinned.cmp(&a.pinned).then(b.last_msg_seq.cmp(&a.last_msg_seq)).then(a.conv.cmp(&b.conv)));
        Ok(all)
    }
}
