//! The WebSocket endpoint `/v1/ws`.
//!
//! One reader loop per connection parses frames and dispatches them; one
//! writer task owns the socket's sending half and sends replies (from a
//! bounded queue), coalesced hints, pings and the final `kicked` frame.
//!
//! - A malformed frame gets a `BAD_REQUEST` error and the connection goes
//!   on; its other requests are unaffected.
//! - At most `ws_inflight_max` requests run at once; past that the reader
//!   stops reading (TCP backpressure).
//! - Every frame read (any kind but close) spends the connection's frame
//!   budget and its address's ([`crate::limits::Limits::admit_frame`])
//!   before it is parsed, authenticated or answered; over budget, the frame
//!   is held and the reader reads nothing more until the budget refills
//!   (TCP backpressure again), so a flooder costs at most its budget's
//!   frames a second and no refusal per excess frame.
//! - Each request's future is polled once in the reader before it is
//!   spawned; the store call is the first await point, so the writes of one
//!   connection enter the store's queue in arrival order.
//! - A client that does not read its replies fills its send queue and is
//!   disconnected (`kicked {reason: "slow_consumer"}`); it resyncs from its
//!   cursor, so nothing is silently skipped.
//! - Ephemeral frames (typing, presence; [`crate::ephemeral`]) wait in the
//!   connection's bounded slots and are written only while no reply is
//!   queued: they are shed first and never count toward the send queue.
//! - One flush per wake: whatever woke the writer, it writes everything
//!   that waits (replies, at most [`WS_FRAMES_PER_FLUSH_MAX`] of them, then
//!   hints, then, if no reply is left, the ephemeral frames) into the
//!   socket's write buffer and flushes once, so a storm of small frames
//!   costs one `sendto` per wake and buffer rather than one per frame.
//! - A connection that opted in to `presence.batch` (`?presence_batch=true`
//!   on the upgrade, or `presence_batch` in its `auth` frame) gets the
//!   presence entries waiting at a wake as one batch frame
//!   ([`EphConn::take_written`]), not one frame each.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use tidemark_proto::{op, reason, split_frame, AuthOk, AuthReq, ErrorCode, Hint, Kicked, ServerFrame, WsQuery};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use super::auth;
use super::http::{bearer, error_response};
use super::replies::{PushError, Replies};
use crate::config::{WS_FULL_RETRY_AFTER_MS, WS_USER_FULL_RETRY_AFTER_MS};
use crate::ephemeral::EphConn;
use crate::error::{ApiError, ApiResult};
use crate::hub::ConnEntry;
use crate::limits::FrameBudget;
use crate::metrics as m;
use crate::ops::{self, AuthCtx};
use crate::state::{AppState, ConnSlot, UserConnSlot};

/// Read buffer of a WebSocket, which every connection holds resident,
/// idle or not (tungstenite allocates it up front and zero-fills it to its
/// capacity before each socket read). tungstenite's default, 128 KiB, cost
/// 136 KiB per idle connection (`tidemark bench connections`); 8 KiB cost
/// 16.9 KiB at 19 000 connections. A client's requests (`sync`, `ack`, a
/// text `send`) are a few hundred bytes, so 1 KiB reads most in one call;
/// frames larger than the buffer still arrive whole (it grows to the frame
/// being read, up to the frame limit, in reads of this size).
pub const WS_READ_BUFFER_BYTES: usize = 1024;
/// Bytes queued before tungstenite writes to the socket (every frame is
/// flushed anyway); its default is 128 KiB.
pub const WS_WRITE_BUFFER_BYTES: usize = 8 * 1024;

/// Replies a writer takes from its queue for one flush; the rest wait for
/// the next (the queue itself is bounded by `ws_send_queue_max`).
pub const WS_FRAMES_PER_FLUSH_MAX: usize = 64;

/// Time the writer has to deliver the final `kicked` frame.
const KICK_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
/// Time given to in-flight requests when a connection ends.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn upgrade(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    query: Result<Query<WsQuery>, axum::extract::rejection::QueryRejection>,
    ws: WebSocketUpgrade,
) -> Response {
    if let Err(e) = state.limits.admit_connect(peer.ip()) {
        return error_response(e);
    }
    let Ok(Query(query)) = query else {
        return error_response(ApiError::bad_request("presence_batch must be true or false"));
    };
    let Some(slot) = state.ws_slots.try_take() else {
        let full = ApiError::new(ErrorCode::Unavailable, "this node holds its most WebSocket connections");
        return error_response(ApiError { retry_after_ms: Some(WS_FULL_RETRY_AFTER_MS), ..full });
    };
    let pre_auth = match bearer(&headers) {
        None => None,
        Some(token) => match auth::authenticate(&state, token) {
            Ok(ctx) => match state.ws_user_slots.try_take(&ctx.user, &ctx.device) {
                Some(user_slot) => Some((ctx, user_slot)),
                None => return error_response(user_full()),
            },
            Err(e) => return error_response(e),
        },
    };
    let max = state.config.frame_bytes_max;
    ws.max_message_size(max)
        .max_frame_size(max)
        .read_buffer_size(WS_READ_BUFFER_BYTES)
        .write_buffer_size(WS_WRITE_BUFFER_BYTES)
        .on_upgrade(move |socket| {
            // Split before the connection's future is made: a `WebSocket`
            // (370 bytes) taken by an async block or function stays in its
            // state for the connection's whole life, idle or not (issue
            // 19); its halves are a pointer each. The connection's future
            // is the upgrade's, with no async block around it to hold a
            // second copy of what it is given.
            let (sink, stream) = socket.split();
            let presence_batch = query.presence_batch.unwrap_or(false);
            connection(Box::new(Opening { state, sink, stream, pre_auth, peer, presence_batch, _slot: slot }))
        })
}

/// The refusal of one more connection of a user at its per-node cap.
fn user_full() -> ApiError {
    crate::limits::rate_limited(WS_USER_FULL_RETRY_AFTER_MS, "this user holds its most WebSocket connections")
}

fn error_text(e: ApiError, rid: Option<String>) -> String {
    serde_json::to_string(&e.into_frame(rid)).expect("error frames serialize")
}

fn server_frame_text(frame: &ServerFrame) -> String {
    serde_json::to_string(frame).expect("server frames serialize")
}

fn reply_text(op: &str, rid: Option<&str>, result: ApiResult<tidemark_proto::RawJson>) -> String {
    match result {
        Ok(v) => tidemark_proto::reply_frame_text(op, rid, &v),
        Err(e) => error_text(e, rid.map(str::to_owned)),
    }
}

/// Queues the reply to `op`. A frame the store refused because the device
/// has a newer connection (P2; this node may not have heard of it: the bus
/// message is late or lost and the fence reload has not run yet) ends this
/// connection at once, `superseded`, with the device's other older
/// connections here, as the bus or the reload would have.
fn answer(
    state: &AppState,
    entry: &ConnEntry,
    out: &Replies,
    op: &str,
    rid: Option<&str>,
    result: ApiResult<tidemark_proto::RawJson>,
) {
    let superseded_by = result.as_ref().err().and_then(|e| e.superseded_by);
    push(out, entry, reply_text(op, rid, result));
    if let Some(newest) = superseded_by {
        tracing::debug!(device_hash = %state.log_id(&entry.device), epoch = entry.epoch, newest,
            "frame refused by the store as superseded; closing");
        state.fences.supersede(&entry.user, &entry.device, newest);
    }
}

/// Queues a frame for the writer; a full queue means the client is not
/// reading, and the connection is ended rather than a frame dropped.
fn push(out: &Replies, entry: &ConnEntry, text: String) {
    match out.push(text) {
        Ok(()) => {}
        Err(PushError::Full) => {
            m::SLOW_CONSUMERS.inc();
            tracing::warn!(stage = "gateway", epoch = entry.epoch, "send queue full; disconnecting slow consumer");
            entry.kick(reason::SLOW_CONSUMER);
        }
        Err(PushError::Closed) => {}
    }
}

async fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *fut).poll(cx))).await
}

/// Reads frames until a valid `auth` frame arrives (errors for the rest);
/// returns who it authenticates, its `rid` and whether it opts in to
/// `presence.batch`.
async fn first_frame_auth(
    state: &AppState,
    sink: &mut SplitSink<WebSocket, Message>,
    stream: &mut SplitStream<WebSocket>,
    budget: &FrameBudget,
) -> Option<(AuthCtx, Option<String>, bool)> {
    let deadline = tokio::time::Instant::now() + state.config.ws_auth_timeout;
    loop {
        let msg = tokio::time::timeout_at(deadline, stream.next()).await.ok()??.ok()?;
        if let Message::Close(_) = msg {
            return None;
        }
        // The budget before the token is looked at: guessed tokens cost
        // what any frame costs.
        while let Err(pause) = state.limits.admit_frame(budget) {
            m::FRAME_BUDGET_PAUSES.add_by("scope", pause.scope.as_str(), 1);
            let until = (tokio::time::Instant::now() + pause.wait).min(deadline);
            tokio::time::sleep_until(until).await;
            if until == deadline {
                return None;
            }
        }
        let text = match msg {
            Message::Text(t) => t,
            _ => continue,
        };
        let reply = match split_frame(&text) {
            Err((rid, m)) => error_text(ApiError::bad_request(m), rid),
            Ok(f) if f.t != op::AUTH => {
                error_text(ApiError::new(ErrorCode::Unauthenticated, "send an auth frame first"), f.rid)
            }
            Ok(f) => match ops::parse::<AuthReq>(f.body)
                .and_then(|a| auth::authenticate(state, &a.token).map(|ctx| (ctx, a.presence_batch.unwrap_or(false))))
            {
                Ok((ctx, batch)) => return Some((ctx, f.rid, batch)),
                Err(e) => error_text(e, f.rid),
            },
        };
        sink.send(Message::Text(reply.into())).await.ok()?;
    }
}

/// What a connection starts from. Boxed: an async fn keeps its arguments
/// for its whole life beside the locals it moves them into (issue 19).
struct Opening {
    state: Arc<AppState>,
    sink: SplitSink<WebSocket, Message>,
    stream: SplitStream<WebSocket>,
    /// Authenticated by the upgrade's bearer token, with its user's slot.
    pre_auth: Option<(AuthCtx, UserConnSlot)>,
    peer: SocketAddr,
    presence_batch: bool,
    /// The node's slot this connection holds while it lives.
    _slot: ConnSlot,
}

/// The value of `boxed`, its allocation given back at once: moved out
/// with `*boxed` in an async fn, the allocation would live on until the
/// function's end, here the connection's.
#[allow(clippy::boxed_local)] // The box is the point: it is given back here.
fn unbox<T>(boxed: Box<T>) -> T {
    *boxed
}

/// A connection once authenticated, registered and given its writer: what
/// its reader loop ([`serve`]) keeps for the connection's life.
struct Live {
    state: Arc<AppState>,
    stream: SplitStream<WebSocket>,
    ctx: AuthCtx,
    peer: SocketAddr,
    budget: FrameBudget,
    entry: Arc<ConnEntry>,
    out: Arc<Replies>,
    eph: Arc<EphConn>,
    writer: tokio::task::JoinHandle<()>,
    _user_slot: UserConnSlot,
    _slot: ConnSlot,
}

async fn connection(opening: Box<Opening>) {
    // Boxed, as the frames below: a future holds the largest of what it
    // awaits for its whole life, and the opening's locals (the `auth`
    // frame's, the store's answer) are dead once the connection is live.
    if let Some(live) = Box::pin(open(opening)).await {
        serve(live).await;
    }
}

/// Authenticates the connection (by the upgrade's token or its first
/// frame), opens it in the store and here, and starts its writer; `None`
/// when it ended before that (answered, if it could be).
async fn open(opening: Box<Opening>) -> Option<Box<Live>> {
    let Opening { state, mut sink, mut stream, pre_auth, peer, mut presence_batch, _slot } = unbox(opening);
    let budget = state.limits.frame_budget(peer.ip());
    let (mut ctx, auth_rid, _user_slot) = match pre_auth {
        Some((ctx, slot)) => (ctx, None, slot),
        None => match first_frame_auth(&state, &mut sink, &mut stream, &budget).await {
            Some((ctx, rid, batch)) => match state.ws_user_slots.try_take(&ctx.user, &ctx.device) {
                Some(slot) => {
                    presence_batch |= batch;
                    (ctx, Some(rid), slot)
                }
                None => {
                    let _ = sink.send(Message::Text(error_text(user_full(), rid).into())).await;
                    let _ = sink.send(Message::Close(None)).await;
                    return None;
                }
            },
            None => return None,
        },
    };
    // The device's next connection epoch, durable and shared by every node
    // (P2): committed before the connection is registered, so an older
    // connection anywhere has a lower one. The same statement reads the
    // device's ACK and its user's head for the re-hint sweep (D8).
    let opened = match state.store.open_connection(&ctx.user, &ctx.device).await {
        Ok(opened) => opened,
        Err(e) => {
            let _ = sink.send(Message::Text(error_text(ApiError::from(e), auth_rid.flatten()).into())).await;
            return None;
        }
    };
    let epoch = opened.connection_epoch;
    // Every frame of this connection carries its epoch to the store (P2).
    ctx.connection_epoch = Some(epoch);
    let issued_at_ms = state.token_issued_at_ms(ctx.expires_at_ms);
    let entry =
        state.hub.register(&ctx.user, &ctx.device, epoch, issued_at_ms, opened.acked_sync_seq, opened.high_watermark);
    // The other nodes end their older connections of this device.
    state.bus.publish_kick(&ctx.user, &ctx.device, reason::SUPERSEDED, epoch);
    tracing::debug!(device_hash = %state.log_id(&ctx.device), epoch = entry.epoch, "websocket connected");
    let out = Arc::new(Replies::new(state.config.ws_send_queue_max));
    if let Some(rid) = auth_rid {
        let ok = AuthOk { user: ctx.user.clone(), device_id: ctx.device.clone(), connection_epoch: entry.epoch };
        let v = serde_json::to_value(ok).expect("auth.ok serializes");
        push(&out, &entry, tidemark_proto::reply_frame(op::AUTH, rid.as_deref(), v).to_string());
    }
    // The ephemeral lane (issue 18): presence and typing of this connection.
    let eph = state.lane.attach(&ctx.user, &ctx.device, entry.epoch, presence_batch);
    let writer = tokio::spawn(write_loop(Box::new(Writer {
        device_hash: state.log_id(&ctx.device),
        sink,
        out: out.clone(),
        entry: entry.clone(),
        eph: eph.clone(),
        ping: state.config.ws_ping,
        shutdown: state.shutdown.clone(),
    })));
    Some(Box::new(Live { state, stream, ctx, peer, budget, entry, out, eph, writer, _user_slot, _slot }))
}

/// The reader loop of a live connection, then its end: requests drained,
/// writer stopped, the connection gone from the hub and the lane.
async fn serve(live: Box<Live>) {
    let Live { state, mut stream, ctx, peer, budget, entry, out, eph, mut writer, _user_slot, _slot } = unbox(live);
    let inflight = Arc::new(Semaphore::new(state.config.ws_inflight_max));
    let mut tasks: JoinSet<()> = JoinSet::new();
    {
        let (state, eph) = (state.clone(), eph.clone());
        tasks.spawn(async move { state.lane.connected(&eph).await });
    }
    let mut last_seen = Instant::now();
    let silent_max = state.config.ws_ping * 3;
    let mut liveness = tokio::time::interval(state.config.ws_ping);
    let mut writer_done = false;
    let token_left = Duration::from_millis((ctx.expires_at_ms - crate::util::now_ms()).max(0) as u64);
    let token_expiry = tokio::time::sleep(token_left);
    tokio::pin!(token_expiry);
    let mut strikes = tidemark_core::throttle::Strikes::default();
    let conn = Conn { state: &state, ctx: &ctx, entry: &entry, out: &out, peer };
    // A frame read while the connection was over its frame budget, and
    // when the budget is checked again: nothing more is read meanwhile.
    // Boxed: only a paused connection holds the timer.
    let mut held: Option<(Message, Pin<Box<tokio::time::Sleep>>)> = None;
    loop {
        tokio::select! {
            msg = stream.next(), if held.is_none() => {
                let Some(Ok(msg)) = msg else { break };
                last_seen = Instant::now();
                if let Message::Close(_) = msg {
                    break;
                }
                if let Err(pause) = state.limits.admit_frame(&budget) {
                    m::FRAME_BUDGET_PAUSES.add_by("scope", pause.scope.as_str(), 1);
                    held = Some((msg, Box::pin(tokio::time::sleep(pause.wait))));
                    continue;
                }
                if !Box::pin(conn.frame(msg, &inflight, &mut tasks, &mut strikes)).await {
                    break;
                }
            }
            _ = async { held.as_mut().expect("a held frame").1.as_mut().await }, if held.is_some() => {
                if let Err(pause) = state.limits.admit_frame(&budget) {
                    held.as_mut().expect("a held frame").1.as_mut().reset(tokio::time::Instant::now() + pause.wait);
                    continue;
                }
                let (msg, _) = held.take().expect("a held frame");
                if !Box::pin(conn.frame(msg, &inflight, &mut tasks, &mut strikes)).await {
                    break;
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            _ = entry.kicked_reader.notified() => break,
            // Short-lived tokens (P1) bound a connection's life too.
            _ = &mut token_expiry => entry.kick(reason::TOKEN_EXPIRED),
            _ = &mut writer => {
                writer_done = true;
                break;
            }
            _ = liveness.tick() => {
                if last_seen.elapsed() > silent_max {
                    tracing::debug!(device_hash = %state.log_id(&ctx.device), epoch = entry.epoch, "websocket silent; closing");
                    break;
                }
            }
        }
    }
    // Let requests already accepted finish (their writes are queued anyway).
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async { while tasks.join_next().await.is_some() {} }).await;
    tasks.shutdown().await;
    out.close();
    if !writer_done && tokio::time::timeout(KICK_FLUSH_TIMEOUT * 2, &mut writer).await.is_err() {
        writer.abort();
    }
    state.hub.unregister(&entry);
    // Boxed: the closing announcement's reads (and their waits) are held
    // only while the connection closes, not for its whole life.
    Box::pin(state.lane.detach(&eph)).await;
    tracing::debug!(device_hash = %state.log_id(&ctx.device), epoch = entry.epoch, "websocket closed");
}

/// What the reader loop handles a frame with.
struct Conn<'a> {
    state: &'a Arc<AppState>,
    ctx: &'a AuthCtx,
    entry: &'a Arc<ConnEntry>,
    out: &'a Arc<Replies>,
    peer: SocketAddr,
}

impl Conn<'_> {
    /// Handles one frame the budget admitted; false: stop reading.
    async fn frame(
        &self,
        msg: Message,
        inflight: &Arc<Semaphore>,
        tasks: &mut JoinSet<()>,
        strikes: &mut tidemark_core::throttle::Strikes,
    ) -> bool {
        let text = match msg {
            Message::Text(t) => t,
            Message::Binary(_) => {
                let e = ApiError::bad_request("binary frames are not supported");
                push(self.out, self.entry, error_text(e, None));
                return true;
            }
            Message::Close(_) => return false,
            Message::Ping(_) | Message::Pong(_) => return true,
        };
        let Ok(permit) = inflight.clone().acquire_owned().await else { return false };
        handle_text(self, tasks, text, permit, strikes).await;
        true
    }
}

async fn handle_text(
    conn: &Conn<'_>,
    tasks: &mut JoinSet<()>,
    text: Utf8Bytes,
    permit: tokio::sync::OwnedSemaphorePermit,
    strikes: &mut tidemark_core::throttle::Strikes,
) {
    let Conn { state, ctx, entry, out, peer } = *conn;
    let frame = match split_frame(&text) {
        Ok(f) => f,
        Err((rid, m)) => return push(out, entry, error_text(ApiError::bad_request(m), rid)),
    };
    if entry.kicked().is_some() {
        // Superseded or revoked: a frame read after the kick has no effect
        // (P2); the connection is closing.
        return;
    }
    if frame.t == op::AUTH {
        let e = ApiError::bad_request("this connection is already authenticated");
        return push(out, entry, error_text(e, frame.rid));
    }
    let op = frame.t;
    let rid = frame.rid;
    let mut fut = Box::pin(ops::dispatch(state.clone(), ctx.clone(), op.clone(), frame.body));
    match poll_once(&mut fut).await {
        Poll::Ready(result) => {
            // Limits are checked before anything is read, so a refusal is
            // answered here, at once: count the ones the client did not wait out.
            let ignored = match &result {
                Err(e) if e.code == ErrorCode::RateLimited => strikes.refused(
                    crate::util::now_ms(),
                    e.retry_after_ms.unwrap_or(0),
                    tidemark_core::throttle::IGNORED_WAITS_MAX,
                ),
                _ => false,
            };
            answer(state, entry, out, &op, rid.as_deref(), result);
            if ignored {
                // The address is refused at connect for a while, so
                // reconnecting does not start a fresh count.
                let period_ms = state.limits.closed_for_ignored_waits(peer.ip(), crate::util::now_ms());
                tracing::warn!(stage = "gateway", device_hash = %state.log_id(&ctx.device), period_ms,
                    "websocket kept sending while told to wait; closing, address refused for the period");
                m::WAITS_IGNORED_CLOSED.inc();
                entry.kick(reason::WAITS_IGNORED);
            }
        }
        Poll::Pending => {
            let (state, out, entry) = (state.clone(), out.clone(), entry.clone());
            tasks.spawn(async move {
                let result = fut.await;
                answer(&state, &entry, &out, &op, rid.as_deref(), result);
                drop(permit);
            });
        }
    }
}

async fn send_kicked(sink: &mut SplitSink<WebSocket, Message>, why: &'static str) {
    let frame = server_frame_text(&ServerFrame::Kicked(Kicked { reason: why.into() }));
    let _ = tokio::time::timeout(KICK_FLUSH_TIMEOUT, async {
        sink.send(Message::Text(frame.into())).await?;
        sink.send(Message::Close(Some(CloseFrame { code: 4000, reason: why.into() }))).await
    })
    .await;
}

/// What woke a connection's writer.
enum Wake {
    Reply(String),
    Hints,
    Ephemeral,
    Ping,
}

/// Feeds the hints waiting for this connection (no flush).
async fn feed_hints(
    sink: &mut SplitSink<WebSocket, Message>,
    entry: &ConnEntry,
    device_hash: &str,
) -> Result<(), axum::Error> {
    if let Some((hw, rehint)) = entry.take_hint() {
        let why = if rehint { reason::LAGGING_ACK } else { reason::NEW_EVENT };
        crate::trace_stage!(stage = "push", trace_id = "", device_hash = %device_hash, sync_seq = hw,
            result = why, "hint sent");
        m::HINTS.inc();
        sink.feed(Message::Text(server_frame_text(&ServerFrame::Hint(Hint::user(hw, why))).into())).await?;
    }
    for (conv, target, version) in entry.take_conv_hints() {
        let hint = Hint {
            user_sync_high_watermark: entry.hinted(),
            reason: reason::CONV_MOVED.into(),
            conv: Some(conv),
            dirty_target_msg_seq: Some(target),
            dirty_version: Some(version),
        };
        m::HINTS.inc();
        sink.feed(Message::Text(server_frame_text(&ServerFrame::Hint(hint)).into())).await?;
    }
    Ok(())
}

/// Feeds the ephemeral frames waiting for this connection (issue 18), each
/// the bytes serialised once for all its receivers, or presence entries
/// spliced into `presence.batch` frames where the connection opted in
/// (no flush).
async fn feed_ephemeral(sink: &mut SplitSink<WebSocket, Message>, eph: &EphConn) -> Result<(), axum::Error> {
    for frame in eph.take_written(crate::util::now_ms()) {
        m::EPHEMERAL_SENT.add_by("kind", frame.kind, 1);
        if frame.batched > 0 {
            m::EPHEMERAL_PRESENCE_BATCHED.add(frame.batched as u64);
        }
        sink.feed(Message::Text(frame.text)).await?;
    }
    Ok(())
}

/// One wake of the writer: what woke it, then everything else that waits,
/// in one flush. Replies first (at most [`WS_FRAMES_PER_FLUSH_MAX`]), then
/// hints; ephemeral frames only if no reply is left waiting (shed first).
async fn write_batch(
    sink: &mut SplitSink<WebSocket, Message>,
    wake: Wake,
    out: &Replies,
    entry: &ConnEntry,
    eph: &EphConn,
    device_hash: &str,
) -> Result<(), axum::Error> {
    let mut replies = 0;
    match wake {
        Wake::Reply(text) => {
            sink.feed(Message::Text(text.into())).await?;
            replies = 1;
        }
        Wake::Ping => sink.feed(Message::Ping(Default::default())).await?,
        Wake::Hints | Wake::Ephemeral => {}
    }
    while replies < WS_FRAMES_PER_FLUSH_MAX {
        let Some(text) = out.pop() else { break };
        sink.feed(Message::Text(text.into())).await?;
        replies += 1;
    }
    feed_hints(sink, entry, device_hash).await?;
    if out.is_empty() {
        feed_ephemeral(sink, eph).await?;
    }
    sink.flush().await
}

/// What a connection's writer task owns. Boxed, as [`Opening`].
struct Writer {
    device_hash: String,
    sink: SplitSink<WebSocket, Message>,
    out: Arc<Replies>,
    entry: Arc<ConnEntry>,
    eph: Arc<EphConn>,
    ping: Duration,
    shutdown: watch::Receiver<bool>,
}

/// Closes the reply queue when the writer ends, however it ends: nothing
/// more is written, so a reply queued from then on is dropped, not
/// counted against the client as a slow consumer.
struct CloseOnDrop(Arc<Replies>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

async fn write_loop(writer: Box<Writer>) {
    let Writer { device_hash, mut sink, out, entry, eph, ping, mut shutdown } = unbox(writer);
    let closer = CloseOnDrop(out);
    let out = &*closer.0;
    let mut ticker = tokio::time::interval(ping);
    ticker.tick().await;
    loop {
        if let Some(why) = entry.kicked() {
            return send_kicked(&mut sink, why).await;
        }
        let wake = tokio::select! {
            biased;
            _ = entry.kicked_writer.notified() => continue,
            _ = crate::util::stopped(&mut shutdown) => return send_kicked(&mut sink, reason::SHUTDOWN).await,
            msg = out.recv() => match msg {
                Some(text) => Wake::Reply(text),
                None => return,
            },
            _ = entry.wake.notified() => Wake::Hints,
            // Shed first: ephemeral frames go only while no reply waits
            // (they wait in their coalescing slots meanwhile).
            _ = eph.wake.notified(), if out.is_empty() => Wake::Ephemeral,
            _ = ticker.tick() => Wake::Ping,
        };
        // Boxed: the writer's future would otherwise hold a batch's state
        // (about 450 bytes) while the connection idles (issue 19).
        if Box::pin(write_batch(&mut sink, wake, out, &entry, &eph, &device_hash)).await.is_err() {
            return;
        }
    }
}
