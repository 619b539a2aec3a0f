//! The connection state machine (K4) and the two loops that run on a
//! connection: sync rounds (K1, K2) and the outbox pump (K3).
//!
//! One engine task per [`crate::Client`] owns the connection. It walks
//! `offline → connecting → syncing → ready`, reconnecting with exponential
//! backoff and full jitter. On a connection it syncs at once, then on every
//! hint, on a periodic timer and when a gap shows; [`SyncGate`] keeps at
//! most one sync in flight and turns any number of requests during it into
//! one more round. The outbox pump sends pending entries (sends, recalls,
//! reads) one at a time in their original order, each after the previous
//! reply, so after a reconnect the old entries leave before any new one.
//!
//! A sync round applies each page in one local transaction and ACKs only
//! after the commit; a lost ACK is repaired by the next round, whose batch
//! restarts at the server's ACK and is skipped locally. Every refusal goes
//! through [`crate::policy::action_for`]. A round ends with the due K5
//! repairs, then a `client.stats` report of the repair counts the server
//! has not taken yet (O1), then the dirty markers of large groups (G2).
//!
//! This module knows the protocol's order of operations and nothing of the
//! SQL (that is [`crate::store`]) or of how an app presents anything.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_proto::{
    op, ConvSummary, ReadOk, ReadReq, RecallOk, RecallReq, SendReq, SnapshotAckOk, SnapshotAckReq, SnapshotBeginOk,
    SnapshotPageOk, SnapshotPageReq, SyncReq,
};
use tokio::sync::{broadcast, mpsc, oneshot, watch, Notify};
use tokio::time::{Instant, MissedTickBehavior, Sleep};

use crate::policy::{action_for, action_for_kick, Action, Op, SyncGate};
use crate::store::{
    ApplyError, FaultAction, FaultPoint, LocalStore, OutboxEntry, OutboxOp, OutboxRecord, PageReport, PendingSnapshot,
    StoreError, StoreResult,
};
use crate::types::{Change, ClientConfig, ConnState, Exit, SdkError};
use crate::{ClientError, ClientResult, Http, ServerEvent, WsConn, WsOptions};

/// Commands from the app to the engine waiting to be served.
pub(crate) const COMMANDS_MAX: usize = 64;
/// Change notifications buffered per subscriber before it lags.
pub(crate) const CHANGES_MAX: usize = 1024;
/// Batches one sync round may start over (after `STALE_GENERATION`,
/// `TOKEN_INVALID`, `RESET_REQUIRED` or a page refused locally) before it
/// backs off instead.
const BATCH_RESTARTS_MAX: u32 = 4;
/// An access token this close to its expiry is refreshed before connecting.
const TOKEN_REFRESH_MARGIN: Duration = Duration::from_secs(30);

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// What an app asks of the engine's connection.
pub(crate) enum Command {
    CreateDirect {
        peer: String,
        reply: oneshot::Sender<Result<String, SdkError>>,
    },
    ServerConversations {
        reply: oneshot::Sender<Result<Vec<ConvSummary>, SdkError>>,
    },
    /// One operation on the connection, reply as JSON (the typed calls of
    /// `crate::calls` build the request and parse the reply).
    Request {
        op: &'static str,
        body: serde_json::Value,
        reply: oneshot::Sender<Result<serde_json::Value, SdkError>>,
    },
    /// Pull a conversation from this device's position to the server's head
    /// (opening a conversation: the slow path of G2); replies the position.
    Pull {
        conv: String,
        reply: oneshot::Sender<Result<u64, SdkError>>,
    },
}

/// State shared by the app handle and the engine task.
pub(crate) struct Inner {
    pub config: ClientConfig,
    pub store: Mutex<LocalStore>,
    pub changes: broadcast::Sender<Change>,
    pub state: watch::Sender<ConnState>,
    /// Bumped after every local commit, so waiters re-read the store.
    pub version: watch::Sender<u64>,
    /// A new outbox entry (a hint: the outbox table is the truth).
    pub outbox_wake: Notify,
    /// A reason to sync from outside the engine (app, own-send gap).
    pub sync_wake: Notify,
    /// Set when the fault hook aborted: no further local write happens.
    pub aborted: Mutex<Option<FaultPoint>>,
    pub http: Http,
    pub ws_url: String,
}

impl Inner {
    /// Runs `f` on the local store in a blocking thread. Refused once the
    /// fault hook aborted the client: a killed process writes nothing more.
    pub async fn db<R, F>(self: &Arc<Self>, f: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut LocalStore, &Inner) -> StoreResult<R> + Send + 'static,
    {
        let inner = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut store = inner.store.lock().map_err(|_| StoreError::Sqlite("local store lock poisoned".into()))?;
            if let Some(point) = inner.aborted.lock().map_err(|_| StoreError::Sqlite("poisoned".into()))?.clone() {
                return Err(StoreError::Aborted(point));
            }
            f(&mut store, &inner)
        })
        .await
        .map_err(|e| StoreError::Sqlite(format!("local store task: {e}")))?
    }

    /// Asks the fault hook about `point`; an abort is remembered so nothing
    /// else is written.
    pub fn fault(&self, point: &FaultPoint) -> FaultAction {
        let Some(hook) = &self.config.fault else {
            return FaultAction::Continue;
        };
        let action = hook(point);
        if action == FaultAction::Abort {
            if let Ok(mut aborted) = self.aborted.lock() {
                *aborted = Some(point.clone());
            }
        }
        action
    }

    /// Notifications are hints to the app (the store is the truth), so a
    /// send with no subscriber is not an error.
    pub fn emit(&self, change: Change) {
        let _ = self.changes.send(change);
    }

    pub fn committed(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    pub fn set_state(&self, state: ConnState) {
        if self.state.send_if_modified(|s| std::mem::replace(s, state) != state) {
            self.emit(Change::State(state));
        }
    }

    async fn call<T>(&self, request: impl Future<Output = ClientResult<T>>) -> ClientResult<T> {
        match tokio::time::timeout(self.config.request_timeout, request).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Transport("request timed out".into())),
        }
    }
}

/// How a connection (or an attempt at one) ended.
#[derive(Debug)]
enum End {
    Exit(Exit),
    Reconnect { at_least: Duration },
    Reauthenticate,
}

impl End {
    fn reconnect() -> End {
        End::Reconnect { at_least: Duration::ZERO }
    }

    fn of(action: Action) -> End {
        match action {
            Action::Revoked => End::Exit(Exit::Revoked),
            Action::Superseded => End::Exit(Exit::Superseded),
            Action::Reauthenticate => End::Reauthenticate,
            Action::Retry { retry_after } => End::Reconnect { at_least: retry_after.unwrap_or_default() },
            Action::Reset { .. } | Action::RestartBatch | Action::Reconnect | Action::Reject => End::reconnect(),
        }
    }

    fn store(e: StoreError) -> End {
        match e {
            StoreError::Aborted(point) => End::Exit(Exit::Aborted(point)),
            other => End::Exit(Exit::Failed(other.to_string())),
        }
    }
}

/// Runs the engine until it stops; hands the command queue back so the
/// client can be started again.
pub(crate) async fn run(
    inner: Arc<Inner>,
    mut cmds: mpsc::Receiver<Command>,
    mut shutdown: watch::Receiver<bool>,
) -> (Exit, mpsc::Receiver<Command>) {
    let exit = drive(&inner, &mut cmds, &mut shutdown).await;
    inner.set_state(ConnState::Offline);
    if exit == Exit::Revoked {
        // docs/protocol.md §4.2: stop; delete the tokens and local data.
        if inner.db(|s, _| s.wipe()).await.is_ok() {
            inner.committed();
        }
    }
    inner.emit(Change::Exited(exit.clone()));
    (exit, cmds)
}

async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    loop {
        if *shutdown.borrow_and_update() {
            return;
        }
        if shutdown.changed().await.is_err() {
            return;
        }
    }
}

#[derive(Default)]
struct Auth {
    access: Option<(String, Instant)>,
}

async fn drive(inner: &Arc<Inner>, cmds: &mut mpsc::Receiver<Command>, shutdown: &mut watch::Receiver<bool>) -> Exit {
    let mut auth = Auth::default();
    // Consecutive failed attempts; reset once a connection reaches ready.
    let mut attempt: u32 = 0;
    loop {
        if *shutdown.borrow() {
            return Exit::Stopped;
        }
        inner.set_state(ConnState::Connecting);
        let connected = tokio::select! {
            connected = connect(inner, &mut auth) => connected,
            _ = stopped(shutdown) => return Exit::Stopped,
        };
        let end = match connected {
            Ok((ws, events)) => session(inner, ws, events, cmds, shutdown, &mut attempt).await,
            Err(end) => end,
        };
        let at_least = match end {
            End::Exit(exit) => return exit,
            End::Reconnect { at_least } => at_least,
            End::Reauthenticate => {
                auth.access = None;
                Duration::ZERO
            }
        };
        inner.set_state(ConnState::Offline);
        let delay = inner.config.backoff.delay_after(Some(at_least), attempt, rand::random());
        attempt = attempt.saturating_add(1);
        tracing::debug!(user = %inner.config.user, device = %inner.config.device_id, ?delay, attempt, "reconnecting");
        let deadline = tokio::time::sleep(delay);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => break,
                _ = stopped(shutdown) => return Exit::Stopped,
                cmd = cmds.recv() => match cmd {
                    Some(cmd) => refuse_offline(cmd),
                    None => return Exit::Stopped,
                },
            }
        }
    }
}

fn refuse_offline(cmd: Command) {
    match cmd {
        Command::CreateDirect { reply, .. } => {
            let _ = reply.send(Err(SdkError::Offline));
        }
        Command::ServerConversations { reply } => {
            let _ = reply.send(Err(SdkError::Offline));
        }
        Command::Request { reply, .. } => {
            let _ = reply.send(Err(SdkError::Offline));
        }
        Command::Pull { reply, .. } => {
            let _ = reply.send(Err(SdkError::Offline));
        }
    }
}

/// An access token (refreshing or logging in as needed) and a WebSocket.
async fn connect(inner: &Arc<Inner>, auth: &mut Auth) -> Result<(WsConn, mpsc::Receiver<ServerEvent>), End> {
    let token = access_token(inner, auth).await?;
    let options = WsOptions { presence_batch: inner.config.presence_batch, ..WsOptions::default() };
    match inner.call(WsConn::connect_with(&inner.ws_url, &token, options)).await {
        Ok(conn) => Ok(conn),
        Err(e) => {
            tracing::debug!(error = %e, "connect failed");
            Err(End::of(action_for(Op::Connect, &e)))
        }
    }
}

async fn access_token(inner: &Arc<Inner>, auth: &mut Auth) -> Result<String, End> {
    if let Some((token, expires)) = &auth.access {
        if Instant::now() + TOKEN_REFRESH_MARGIN < *expires {
            return Ok(token.clone());
        }
    }
    auth.access = None;
    let refresh = inner.db(|s, _| s.refresh_token()).await.map_err(End::store)?;
    if let Some(refresh) = refresh {
        match inner.call(inner.http.refresh(&refresh)).await {
            Ok(login) => return adopt(inner, auth, login).await,
            Err(e) => match action_for(Op::Connect, &e) {
                Action::Revoked => return Err(End::Exit(Exit::Revoked)),
                // Used, expired or unknown: it is gone; log in again.
                Action::Reauthenticate | Action::Reject => {
                    inner.db(|s, _| s.set_refresh_token(None)).await.map_err(End::store)?;
                }
                other => return Err(End::of(other)),
            },
        }
    }
    let Some(password) = inner.config.password.clone() else {
        return Err(End::Exit(Exit::LoggedOut("no password and no usable refresh token".into())));
    };
    let c = &inner.config;
    match inner.call(inner.http.login(&c.user, &password, &c.device_id)).await {
        Ok(login) => adopt(inner, auth, login).await,
        Err(e) => match action_for(Op::Connect, &e) {
            Action::Revoked => Err(End::Exit(Exit::Revoked)),
            Action::Reauthenticate | Action::Reject => Err(End::Exit(Exit::LoggedOut(e.to_string()))),
            other => Err(End::of(other)),
        },
    }
}

/// Persists the new refresh token before the access token is used (each
/// refresh token works once).
async fn adopt(inner: &Arc<Inner>, auth: &mut Auth, login: tidemark_proto::LoginOk) -> Result<String, End> {
    let refresh = login.refresh_token.clone();
    inner.db(move |s, _| s.set_refresh_token(Some(&refresh))).await.map_err(End::store)?;
    auth.access = Some((login.access_token.clone(), Instant::now() + Duration::from_secs(login.expires_in)));
    Ok(login.access_token)
}

/// Aborts the socket unless the session closed it cleanly.
struct ConnGuard {
    ws: WsConn,
    armed: bool,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        if self.armed {
            self.ws.abort();
        }
    }
}

async fn opt<T>(f: &mut Option<BoxFuture<T>>) -> T {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn opt_sleep(s: &mut Option<Pin<Box<Sleep>>>) {
    match s {
        Some(s) => s.await,
        None => std::future::pending().await,
    }
}

/// One connection: sync on connect, on hints, on the timer and on gaps;
/// pump the outbox; serve app commands. Returns how it ended.
async fn session(
    inner: &Arc<Inner>,
    ws: WsConn,
    mut events: mpsc::Receiver<ServerEvent>,
    cmds: &mut mpsc::Receiver<Command>,
    shutdown: &mut watch::Receiver<bool>,
    attempt: &mut u32,
) -> End {
    let mut guard = ConnGuard { ws: ws.clone(), armed: true };
    let backoff = inner.config.backoff;
    let start_sync = || -> BoxFuture<RoundEnd> { Box::pin(sync_round(inner.clone(), ws.clone())) };
    let start_pump = || -> BoxFuture<PumpEnd> { Box::pin(pump(inner.clone(), ws.clone())) };
    let mut sync_gate = SyncGate::default();
    let mut pump_gate = SyncGate::default();
    let mut retries = (0u32, 0u32);
    let mut sync_retry: Option<Pin<Box<Sleep>>> = None;
    let mut pump_retry: Option<Pin<Box<Sleep>>> = None;
    let period = inner.config.periodic_sync;
    let mut periodic = tokio::time::interval_at(Instant::now() + period, period);
    periodic.set_missed_tick_behavior(MissedTickBehavior::Delay);

    inner.set_state(ConnState::Syncing);
    sync_gate.request();
    let mut sync: Option<BoxFuture<RoundEnd>> = Some(start_sync());
    // Pending sends from before this connection go first, in order.
    pump_gate.request();
    let mut pumping: Option<BoxFuture<PumpEnd>> = Some(start_pump());
    loop {
        let mut want_sync = false;
        let mut want_pump = false;
        tokio::select! {
            biased;
            _ = stopped(shutdown) => {
                ws.close().await;
                guard.armed = false;
                return End::Exit(Exit::Stopped);
            }
            ev = events.recv() => match ev {
                Some(ServerEvent::Hint { high_watermark, reason }) => {
                    inner.emit(Change::Hint { high_watermark, reason });
                    want_sync = true;
                }
                Some(ServerEvent::Kicked { reason }) => {
                    let end = End::of(action_for_kick(&reason));
                    inner.emit(Change::Kicked { reason });
                    return end;
                }
                // The ephemeral lane (issue 18): surfaced, nothing applied.
                Some(ServerEvent::Typing(t)) => inner.emit(crate::ephemeral::typing_change(t)),
                Some(ServerEvent::Presence(p)) => inner.emit(crate::ephemeral::presence_change(p)),
                Some(ServerEvent::Closed) | None => return End::reconnect(),
            },
            r = opt(&mut sync), if sync.is_some() => {
                sync = None;
                match r {
                    RoundEnd::Done { applied, gaps_left } => {
                        retries.0 = 0;
                        // A gap that the round's new events did not close
                        // gets one more round (the log may have caught up).
                        if sync_gate.finish() || (applied > 0 && gaps_left && sync_gate.request()) {
                            sync = Some(start_sync());
                        } else {
                            inner.set_state(ConnState::Ready);
                            *attempt = 0;
                        }
                    }
                    RoundEnd::Retry(retry_after) => {
                        sync_gate.abandon();
                        let delay = backoff.delay_after(retry_after, retries.0, rand::random());
                        retries.0 = retries.0.saturating_add(1);
                        sync_retry = Some(Box::pin(tokio::time::sleep(delay)));
                    }
                    RoundEnd::End(end) => return end,
                }
            }
            r = opt(&mut pumping), if pumping.is_some() => {
                pumping = None;
                match r {
                    PumpEnd::Drained => {
                        retries.1 = 0;
                        if pump_gate.finish() {
                            pumping = Some(start_pump());
                        }
                    }
                    PumpEnd::Retry(retry_after) => {
                        pump_gate.abandon();
                        let delay = backoff.delay_after(retry_after, retries.1, rand::random());
                        retries.1 = retries.1.saturating_add(1);
                        pump_retry = Some(Box::pin(tokio::time::sleep(delay)));
                    }
                    PumpEnd::End(end) => return end,
                }
            }
            _ = opt_sleep(&mut sync_retry), if sync_retry.is_some() => {
                sync_retry = None;
                want_sync = true;
            }
            _ = opt_sleep(&mut pump_retry), if pump_retry.is_some() => {
                pump_retry = None;
                want_pump = true;
            }
            _ = inner.outbox_wake.notified() => want_pump = true,
            _ = inner.sync_wake.notified() => want_sync = true,
            _ = periodic.tick() => want_sync = true,
            cmd = cmds.recv() => match cmd {
                Some(cmd) => serve(inner, &ws, cmd).await,
                None => return End::Exit(Exit::Stopped),
            },
        }
        // While a retry waits, its timer is the next round: a hint then
        // changes nothing (the round reads up to the head anyway).
        if want_sync && sync_retry.is_none() && sync_gate.request() {
            inner.set_state(ConnState::Syncing);
            sync = Some(start_sync());
        }
        if want_pump && pump_retry.is_none() && pump_gate.request() {
            pumping = Some(start_pump());
        }
    }
}

async fn serve(inner: &Arc<Inner>, ws: &WsConn, cmd: Command) {
    match cmd {
        Command::CreateDirect { peer, reply } => {
            let result = match inner.call(ws.conv_create_direct(&peer)).await {
                Ok(ok) => {
                    let (conv, kind) = (ok.conv.clone(), ok.kind.clone());
                    match inner.db(move |s, _| s.ensure_conversation(&conv, &kind)).await {
                        Ok(()) => {
                            inner.committed();
                            Ok(ok.conv)
                        }
                        Err(e) => Err(SdkError::Store(e)),
                    }
                }
                Err(e) => Err(SdkError::Refused(e)),
            };
            let _ = reply.send(result);
        }
        Command::ServerConversations { reply } => {
            let result = inner.call(ws.conv_list_all()).await.map_err(SdkError::Refused);
            let _ = reply.send(result);
        }
        Command::Request { op, body, reply } => {
            let result = inner.call(ws.request::<_, serde_json::Value>(op, &body)).await.map_err(SdkError::Refused);
            let _ = reply.send(result);
        }
        Command::Pull { conv, reply } => {
            let result = match pull_conversation(inner, ws, &conv).await {
                Ok(Some(held)) => Ok(held),
                Ok(None) => Err(SdkError::Unavailable(format!("conv.sync of {conv} failed; try again"))),
                Err(e) => Err(SdkError::Store(e)),
            };
            let _ = reply.send(result);
        }
    }
}

/// How one sync round ended.
enum RoundEnd {
    /// Caught up to the batch's watermark.
    Done {
        applied: usize,
        gaps_left: bool,
    },
    /// Transient refusal: retry after at least this long.
    Retry(Option<Duration>),
    End(End),
}

/// What a failed request inside a round leads to.
enum Flow {
    RestartBatch,
    Stop(RoundEnd),
}

async fn on_round_error(inner: &Arc<Inner>, ws: &WsConn, op: Op, e: &ClientError) -> Flow {
    tracing::debug!(error = %e, ?op, "sync request refused");
    match action_for(op, e) {
        Action::Reset { generation } => {
            // Always a snapshot (D7), never a wipe and full replay: it works
            // whether or not the log was trimmed, and the local state stays
            // usable until the install replaces it in one transaction.
            inner.emit(Change::Reset { generation });
            rebuild(inner, ws).await
        }
        Action::RestartBatch => Flow::RestartBatch,
        Action::Retry { retry_after } => Flow::Stop(RoundEnd::Retry(retry_after)),
        other => Flow::Stop(RoundEnd::End(End::of(other))),
    }
}

/// Snapshot install attempts (begin, fetch, verify, install, ack) one
/// rebuild may make before the round backs off.
const SNAPSHOT_ATTEMPTS_MAX: u32 = 4;

/// How one step of a snapshot install ended.
enum Step {
    Done,
    /// Start over: with the same snapshot if one is still pending, else
    /// with a new `snapshot.begin`.
    Again,
    Stop(Flow),
}

/// Rebuilds the device from a snapshot (D7, docs/protocol.md §3.24), or
/// finishes the install a previous run left pending: an install that
/// committed is acked first; one that did not is fetched again with the same
/// token; otherwise a new snapshot begins. On success the batch restarts
/// from the snapshot's base.
async fn rebuild(inner: &Arc<Inner>, ws: &WsConn) -> Flow {
    // The token whose pages failed the digest once: a second mismatch
    // abandons that snapshot for a new one.
    let mut mismatched: Option<String> = None;
    for _ in 0..SNAPSHOT_ATTEMPTS_MAX {
        let pending = match inner.db(|s, _| s.pending_snapshot()).await {
            Ok(p) => p,
            Err(e) => return Flow::Stop(RoundEnd::End(End::store(e))),
        };
        let step = match pending {
            Some(snap) if snap.installed => ack_snapshot(inner, ws, &snap).await,
            Some(snap) => install(inner, ws, snap, true, &mut mismatched).await,
            None => match begin_snapshot(inner, ws).await {
                Ok(snap) => install(inner, ws, snap, false, &mut mismatched).await,
                Err(step) => step,
            },
        };
        match step {
            Step::Done => return Flow::RestartBatch,
            Step::Again => continue,
            Step::Stop(flow) => return flow,
        }
    }
    inner.emit(Change::SnapshotFailed { reason: "too many failed attempts".into(), retrying: false });
    Flow::Stop(RoundEnd::Retry(None))
}

/// A refused snapshot call: a token that can no longer serve (reset again,
/// expired, superseded) is forgotten and a new snapshot begins; a transient
/// refusal or a lost connection keeps the pending snapshot for the next try.
async fn snapshot_refused(inner: &Arc<Inner>, what: &str, e: &ClientError) -> Step {
    tracing::debug!(error = %e, what, "snapshot request refused");
    match action_for(Op::Sync, e) {
        Action::Reset { .. } | Action::RestartBatch => {
            if let Err(e) = inner.db(|s, _| s.forget_snapshot()).await {
                return Step::Stop(Flow::Stop(RoundEnd::End(End::store(e))));
            }
            inner.emit(Change::SnapshotFailed { reason: format!("{what}: {e}"), retrying: true });
            Step::Again
        }
        Action::Retry { retry_after } => {
            inner.emit(Change::SnapshotFailed { reason: format!("{what}: {e}"), retrying: false });
            Step::Stop(Flow::Stop(RoundEnd::Retry(retry_after)))
        }
        other => {
            inner.emit(Change::SnapshotFailed { reason: format!("{what}: {e}"), retrying: false });
            Step::Stop(Flow::Stop(RoundEnd::End(End::of(other))))
        }
    }
}

fn aborted(point: FaultPoint) -> Step {
    Step::Stop(Flow::Stop(RoundEnd::End(End::Exit(Exit::Aborted(point)))))
}

/// Step 1: `snapshot.begin`, recorded locally before anything else.
async fn begin_snapshot(inner: &Arc<Inner>, ws: &WsConn) -> Result<PendingSnapshot, Step> {
    let ok: SnapshotBeginOk = match inner.call(ws.request(op::SNAPSHOT_BEGIN, &serde_json::json!({}))).await {
        Ok(ok) => ok,
        Err(e) => return Err(snapshot_refused(inner, "snapshot.begin", &e).await),
    };
    let snap = PendingSnapshot {
        snapshot_id: ok.snapshot_id,
        token: ok.snapshot_token,
        generation: ok.sync_generation,
        base_sync_seq: ok.base_sync_seq,
        manifest_digest: ok.manifest_digest,
        pages: ok.pages,
        installed: false,
    };
    let saved = snap.clone();
    if let Err(e) = inner.db(move |s, _| s.snapshot_begun(&saved)).await {
        return Err(Step::Stop(Flow::Stop(RoundEnd::End(End::store(e)))));
    }
    let point =
        FaultPoint::SnapshotBegun { generation: snap.generation, base_sync_seq: snap.base_sync_seq, pages: snap.pages };
    if inner.fault(&point) == FaultAction::Abort {
        return Err(aborted(point));
    }
    Ok(snap)
}

/// Steps 2–5: fetch every page, verify the digest, install in one local
/// transaction, then ack.
async fn install(
    inner: &Arc<Inner>,
    ws: &WsConn,
    snap: PendingSnapshot,
    resumed: bool,
    mismatched: &mut Option<String>,
) -> Step {
    inner.emit(Change::SnapshotStarted {
        generation: snap.generation,
        base_sync_seq: snap.base_sync_seq,
        pages: snap.pages,
        resumed,
    });
    let mut items = Vec::new();
    for page in 0..snap.pages {
        let req = SnapshotPageReq { snapshot_token: snap.token.clone(), page };
        let ok: SnapshotPageOk = match inner.call(ws.request(op::SNAPSHOT_PAGE, &req)).await {
            Ok(ok) => ok,
            Err(e) => return snapshot_refused(inner, "snapshot.page", &e).await,
        };
        let mut got = ok.items;
        let point = FaultPoint::SnapshotPageFetched { page, pages: snap.pages };
        match inner.fault(&point) {
            FaultAction::Abort => return aborted(point),
            FaultAction::Corrupt => {
                if let Some(serde_json::Value::Object(first)) = got.first_mut() {
                    first.insert("corrupted".into(), serde_json::Value::Bool(true));
                }
            }
            FaultAction::Continue | FaultAction::Fail => {}
        }
        inner.emit(Change::SnapshotPage { fetched: page + 1, pages: snap.pages, items: got.len() });
        items.extend(got);
    }
    if crate::store::manifest_digest(&items) != snap.manifest_digest {
        // Install nothing, ack nothing. The snapshot is immutable: fetch it
        // again once, then give it up for a new one.
        let again = mismatched.as_deref() == Some(snap.token.as_str());
        if again {
            if let Err(e) = inner.db(|s, _| s.forget_snapshot()).await {
                return Step::Stop(Flow::Stop(RoundEnd::End(End::store(e))));
            }
        }
        *mismatched = Some(snap.token.clone());
        tracing::warn!(snapshot = %snap.snapshot_id, "snapshot manifest digest mismatch");
        inner.emit(Change::SnapshotFailed { reason: "manifest digest mismatch".into(), retrying: true });
        return Step::Again;
    }
    let installing = snap.clone();
    let report = inner.db(move |s, inner| Ok(s.install_snapshot(&installing, &items, &|p| inner.fault(p)))).await;
    let report = match report {
        Ok(Ok(report)) => report,
        Ok(Err(ApplyError::Store(e))) | Err(e) => return Step::Stop(Flow::Stop(RoundEnd::End(End::store(e)))),
        Ok(Err(e)) => {
            // Malformed items: nothing was written. Try another snapshot.
            tracing::warn!(error = %e, "snapshot refused locally");
            if let Err(e) = inner.db(|s, _| s.forget_snapshot()).await {
                return Step::Stop(Flow::Stop(RoundEnd::End(End::store(e))));
            }
            inner.emit(Change::SnapshotFailed { reason: e.to_string(), retrying: true });
            return Step::Again;
        }
    };
    inner.emit(Change::SnapshotInstalled {
        generation: report.generation,
        base_sync_seq: report.base_sync_seq,
        conversations: report.conversations,
        messages: report.messages,
    });
    inner.emit(Change::PrivacyChanged(report.privacy));
    inner.committed();
    let point = FaultPoint::SnapshotAfterCommit { base_sync_seq: snap.base_sync_seq };
    if inner.fault(&point) == FaultAction::Abort {
        return aborted(point);
    }
    ack_snapshot(inner, ws, &PendingSnapshot { installed: true, ..snap }).await
}

/// Step 5: `snapshot.ack` of an installed snapshot (also a retry after a
/// lost reply or a restart: the server answers the same).
async fn ack_snapshot(inner: &Arc<Inner>, ws: &WsConn, snap: &PendingSnapshot) -> Step {
    let req = SnapshotAckReq { snapshot_token: snap.token.clone() };
    let ok: SnapshotAckOk = match inner.call(ws.request(op::SNAPSHOT_ACK, &req)).await {
        Ok(ok) => ok,
        // TOKEN_INVALID / STALE_GENERATION: the server does not recognize
        // the install; a new snapshot replaces it (§3.24).
        Err(e) => return snapshot_refused(inner, "snapshot.ack", &e).await,
    };
    let (generation, acked) = (ok.sync_generation, ok.acked_sync_seq);
    if let Err(e) = inner.db(move |s, _| s.snapshot_acked(generation, acked)).await {
        return Step::Stop(Flow::Stop(RoundEnd::End(End::store(e))));
    }
    inner.emit(Change::Acked { sync_seq: snap.base_sync_seq, acked_sync_seq: acked, generation });
    inner.committed();
    Step::Done
}

/// One sync round: one batch from a first page to `has_more: false`, each
/// page applied in one local transaction and ACKed after its commit.
async fn sync_round(inner: Arc<Inner>, ws: WsConn) -> RoundEnd {
    let limit = inner.config.sync_page_limit;
    let mut applied_total = 0usize;
    let mut restarts = 0u32;
    'batch: loop {
        if restarts > BATCH_RESTARTS_MAX {
            tracing::warn!(restarts, "sync batch keeps restarting; backing off");
            return RoundEnd::Retry(None);
        }
        let (position, pending) = match inner.db(|s, _| Ok((s.position()?, s.pending_snapshot()?))).await {
            Ok(p) => p,
            Err(e) => return RoundEnd::End(End::store(e)),
        };
        if pending.is_some() {
            // An install left pending (a crash, a lost connection): finish
            // it before any sync; an installed one must be acked first, or
            // the server still holds the device as RESETTING (§3.24).
            match rebuild(&inner, &ws).await {
                Flow::RestartBatch => {
                    restarts += 1;
                    continue 'batch;
                }
                Flow::Stop(end) => return end,
            }
        }
        let first = SyncReq {
            sync_generation: position.generation,
            local_applied_sync_seq: Some(position.applied_sync_seq),
            limit: Some(limit),
            ..SyncReq::default()
        };
        let mut page = match inner.call(ws.sync(&first)).await {
            Ok(page) => page,
            Err(e) => match on_round_error(&inner, &ws, Op::Sync, &e).await {
                Flow::RestartBatch => {
                    restarts += 1;
                    continue 'batch;
                }
                Flow::Stop(end) => return end,
            },
        };
        // An `ack.ok` lost on the way (a crash or a cut after the server
        // committed the ACK) leaves the local ACK behind the server's; the
        // batch then resumes at the server's ACK with nothing to ACK again.
        // The server's ACK in this generation, at or below what this device
        // applied, is the ACK it confirmed: record it.
        let server_acked = page.server_acked_sync_seq;
        if position.generation == Some(page.sync_generation)
            && server_acked > position.acked_sync_seq
            && server_acked <= position.applied_sync_seq
        {
            let generation = page.sync_generation;
            let recorded = inner.db(move |s, inner| {
                s.record_ack(generation, server_acked)?;
                inner.emit(Change::Acked { sync_seq: server_acked, acked_sync_seq: server_acked, generation });
                Ok(())
            });
            if let Err(e) = recorded.await {
                return RoundEnd::End(End::store(e));
            }
        }
        let token = page.batch_token.clone();
        // What this batch has ACKed so far. It starts at the batch's start,
        // not at the server's ACK: a recovery batch (D6) starts below the
        // server's ACK and completes only by its own final ACK.
        let mut acked = page.resume_from;
        loop {
            let report = {
                let page = page.clone();
                // Announced under the store lock right after the commit:
                // the change stream is in commit order (K-issue 17).
                inner
                    .db(move |s, inner| {
                        let report = s.apply_page(&page, &|p| inner.fault(p));
                        if let Ok(r) = &report {
                            if r.applied > 0 || r.skipped > 0 {
                                announce_page(inner, r.clone());
                            }
                        }
                        Ok(report)
                    })
                    .await
            };
            let report = match report {
                Ok(Ok(report)) => report,
                Ok(Err(ApplyError::Store(e))) | Err(e) => return RoundEnd::End(End::store(e)),
                Ok(Err(e)) => {
                    // Nothing of the page was committed; the cursor did not
                    // move. A new batch starts from the server's ACK.
                    tracing::warn!(error = %e, "sync page refused locally; starting a new batch");
                    restarts += 1;
                    continue 'batch;
                }
            };
            applied_total += report.applied;
            let (page_applied, applied_sync_seq) = (report.applied, report.applied_sync_seq);
            if page_applied > 0 {
                let point = FaultPoint::AfterCommit { applied_sync_seq };
                if inner.fault(&point) == FaultAction::Abort {
                    return RoundEnd::End(End::Exit(Exit::Aborted(point)));
                }
            }
            // K1: the ACK follows the commit, and covers what is applied.
            let ack_to = applied_sync_seq.min(page.batch_high_watermark);
            if ack_to > acked {
                match inner.call(ws.ack(&token, ack_to)).await {
                    Ok(ok) => {
                        acked = acked.max(ack_to);
                        let (generation, value) = (ok.sync_generation, ok.acked_sync_seq);
                        let recorded = inner.db(move |s, inner| {
                            s.record_ack(generation, value)?;
                            inner.emit(Change::Acked { sync_seq: ack_to, acked_sync_seq: value, generation });
                            inner.committed();
                            Ok(())
                        });
                        if let Err(e) = recorded.await {
                            return RoundEnd::End(End::store(e));
                        }
                    }
                    Err(e) => match on_round_error(&inner, &ws, Op::Ack, &e).await {
                        Flow::RestartBatch => {
                            restarts += 1;
                            continue 'batch;
                        }
                        Flow::Stop(end) => return end,
                    },
                }
            }
            if !page.has_more {
                if let Err(e) = run_repairs(&inner, &ws).await {
                    return RoundEnd::End(End::store(e));
                }
                if let Err(e) = report_gaps(&inner, &ws).await {
                    return RoundEnd::End(End::store(e));
                }
                if let Err(e) = run_markers(&inner, &ws, std::mem::take(&mut page.dirty)).await {
                    return RoundEnd::End(End::store(e));
                }
                let gaps_left = match inner.db(|s, _| s.conversations_with_gap()).await {
                    Ok(convs) => !convs.is_empty(),
                    Err(e) => return RoundEnd::End(End::store(e)),
                };
                return RoundEnd::Done { applied: applied_total, gaps_left };
            }
            let next = SyncReq {
                batch_token: Some(token.clone()),
                cursor: page.next_cursor.clone(),
                limit: Some(limit),
                ..SyncReq::default()
            };
            page = match inner.call(ws.sync(&next)).await {
                Ok(page) => page,
                Err(e) => match on_round_error(&inner, &ws, Op::Sync, &e).await {
                    Flow::RestartBatch => {
                        restarts += 1;
                        continue 'batch;
                    }
                    Flow::Stop(end) => return end,
                },
            };
        }
    }
}

/// Repairs started at the end of one sync round, at most (K5).
pub(crate) const REPAIRS_PER_ROUND_MAX: usize = 4;
/// `conv.sync` pages one repair fetches, at most; a longer conversation is
/// repaired over several rounds.
pub(crate) const REPAIR_PAGES_MAX: usize = 20;

fn wall_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// Runs the repairs that are due (K5): each conversation is fetched with
/// `conv.sync` from its first unapplied `msg_seq` and applied in one local
/// transaction that also clears its record. A refused or failed attempt
/// waits its backoff; the account's sync is never held up by it. Only a
/// local store failure ends the round.
async fn run_repairs(inner: &Arc<Inner>, ws: &WsConn) -> StoreResult<()> {
    let due = inner.db(|s, _| s.due_repairs(wall_ms(), REPAIRS_PER_ROUND_MAX)).await?;
    for repair in due {
        let conv = repair.conv.clone();
        let fetched = if inner.fault(&FaultPoint::BeforeRepair { conv: conv.clone() }) == FaultAction::Fail {
            Err("the fault hook failed this attempt".to_owned())
        } else {
            fetch_conversation(inner, ws, &conv, repair.from_msg_seq).await
        };
        let outcome = match fetched {
            Ok((events, complete, next_from)) => {
                let c = conv.clone();
                let done = conv.clone();
                let applied = inner.db(move |s, inner| {
                    let moved = s.apply_repair(&c, &events, complete, next_from);
                    if let Ok(m) = &moved {
                        if let Some(m) = m {
                            inner.emit(Change::CursorMoved(m.clone()));
                        }
                        if complete {
                            inner.emit(Change::Repaired { conv: done });
                        }
                        inner.committed();
                    }
                    Ok(moved)
                });
                match applied.await? {
                    Ok(_) => Ok(()),
                    Err(ApplyError::Store(e)) => return Err(e),
                    Err(e) => Err(e.to_string()),
                }
            }
            Err(e) => Err(e),
        };
        if let Err(error) = outcome {
            tracing::warn!(conv = %conv, attempts = repair.attempts + 1, "conversation repair failed; will retry");
            let (c, err) = (conv.clone(), error.clone());
            let now = wall_ms();
            let after = inner.db(move |s, _| s.repair_failed(&c, now, &err)).await?;
            inner.emit(Change::RepairFailed {
                conv,
                attempts: after.attempts,
                retry_in_ms: (after.next_attempt_at_ms - now).max(0) as u64,
                error,
            });
        }
    }
    Ok(())
}

/// Tells the server the gaps only this device sees (`client.stats`, O1):
/// the conversations queued for repair and the repairs completed since the
/// last report it took, and the repairs waiting; only when there is
/// something to say. The counts are marked reported after the reply, so a
/// lost report is repeated, never skipped. A refusal is left to the next
/// round; only a local store failure ends the round.
async fn report_gaps(inner: &Arc<Inner>, ws: &WsConn) -> StoreResult<()> {
    let counts = inner.db(|s, _| s.unreported_gaps()).await?;
    if !counts.worth_reporting() {
        return Ok(());
    }
    let req = tidemark_proto::ClientStatsReq {
        gaps_detected: counts.detected,
        gaps_repaired: counts.repaired,
        repairs_pending: counts.pending,
        repair_ms: counts.repair_ms.clone(),
        hole_ms: counts.hole_ms.clone(),
    };
    match inner.call(ws.request::<_, tidemark_proto::ClientStatsOk>(tidemark_proto::op::CLIENT_STATS, &req)).await {
        Ok(_) => inner.db(move |s, _| s.gaps_reported(&counts)).await,
        Err(e) => {
            tracing::debug!(error = %e, "client.stats not taken; reported next round");
            Ok(())
        }
    }
}

/// Rounds of pull-then-clear one dirty marker gets in one sync round; a
/// group that keeps moving stays dirty and is pulled again next round.
pub(crate) const MARKER_ROUNDS_MAX: usize = 3;

/// K2 for large groups (G2): for each dirty marker the sync reported, pull
/// `conv.sync` from this device's own position, commit the events and the
/// new position in one local transaction, and only then `dirty.clear` with
/// the version read; `cleared: false` (the group moved, or this device
/// holds less than the target) means pull again. A failed pull or clear
/// leaves the marker dirty on the server: the next sync shows it again
/// (level-triggered). Only a local store failure ends the round.
async fn run_markers(inner: &Arc<Inner>, ws: &WsConn, dirty: Vec<tidemark_proto::DirtyMarker>) -> StoreResult<()> {
    for marker in dirty {
        let conv = marker.conv.clone();
        let mut version = marker.dirty_version;
        let mut target = marker.dirty_target_msg_seq;
        let c = conv.clone();
        inner.db(move |s, _| s.mark_shared(&c)).await?;
        for _ in 0..MARKER_ROUNDS_MAX {
            let Some(held) = pull_conversation(inner, ws, &conv).await? else { break };
            if held < target {
                // More than one round of pages: the rest comes next round.
                break;
            }
            let req = tidemark_proto::DirtyClearReq { conv: conv.clone(), dirty_version: version, last_msg_seq: held };
            let ok: tidemark_proto::DirtyClearOk = match inner.call(ws.request(op::DIRTY_CLEAR, &req)).await {
                Ok(ok) => ok,
                Err(e) => {
                    tracing::debug!(conv = %conv, error = %e, "dirty.clear failed; the marker stays dirty");
                    break;
                }
            };
            inner.emit(Change::GroupPulled { conv: conv.clone(), last_msg_seq: held, cleared: ok.cleared });
            if ok.cleared {
                break;
            }
            (version, target) = (ok.dirty_version, ok.dirty_target_msg_seq);
        }
    }
    Ok(())
}

/// Pulls `conv` from this device's position to the server's head by
/// `conv.sync` and applies it in one local transaction (the slow path of
/// G2 too). Returns the `msg_seq` up to which this device now holds the
/// conversation as the server serves it to this user, or `None` when the
/// pull failed (logged; nothing was applied).
pub(crate) async fn pull_conversation(inner: &Arc<Inner>, ws: &WsConn, conv: &str) -> StoreResult<Option<u64>> {
    let c = conv.to_owned();
    let from = inner.db(move |s, _| Ok(s.conversation(&c)?.map_or(0, |c| c.contiguous_msg_seq) + 1)).await?;
    let (events, complete, next_from) = match fetch_conversation(inner, ws, conv, from).await {
        Ok(fetched) => fetched,
        Err(e) => {
            tracing::debug!(conv = %conv, error = %e, "conv.sync pull failed");
            return Ok(None);
        }
    };
    let c = conv.to_owned();
    let applied = inner.db(move |s, inner| {
        let moved = s.apply_pull(&c, &events, complete, next_from);
        if let Ok(m) = &moved {
            if let Some(m) = m {
                inner.emit(Change::CursorMoved(m.clone()));
            }
            inner.committed();
        }
        Ok(moved)
    });
    match applied.await? {
        Ok(_) => Ok(Some(next_from.saturating_sub(1))),
        Err(ApplyError::Store(e)) => Err(e),
        Err(e) => {
            tracing::warn!(conv = %conv, error = %e, "pulled events refused locally");
            Ok(None)
        }
    }
}

/// `conv`'s events from `from_msg_seq` on, by `conv.sync` pages:
/// `(events, complete, next_from)`; `complete` once the head is reached.
async fn fetch_conversation(
    inner: &Arc<Inner>,
    ws: &WsConn,
    conv: &str,
    from_msg_seq: u64,
) -> Result<(Vec<tidemark_proto::Envelope>, bool, u64), String> {
    let mut events = Vec::new();
    let mut after = from_msg_seq.saturating_sub(1);
    for _ in 0..REPAIR_PAGES_MAX {
        let req = tidemark_proto::ConvSyncReq {
            conv: conv.to_owned(),
            after,
            limit: Some(tidemark_proto::CONV_SYNC_LIMIT_MAX),
            epoch: None,
        };
        let page: tidemark_proto::ConvSyncOk =
            inner.call(ws.request(op::CONV_SYNC, &req)).await.map_err(|e| e.to_string())?;
        events.extend(page.events);
        after = page.next_after.max(after);
        if !page.has_more {
            return Ok((events, true, after + 1));
        }
    }
    Ok((events, false, after + 1))
}

/// Notifies first, then bumps the version: whoever wakes on the version
/// finds the notifications already sent.
fn announce_page(inner: &Inner, report: PageReport) {
    let applied = report.applied;
    let (cursors, gaps) = (report.cursors.clone(), report.gaps.clone());
    let (recalled, reads) = (report.recalled.clone(), report.reads.clone());
    let repairs = report.repairs.clone();
    let privacy = report.privacy.clone();
    inner.emit(Change::PageApplied(report));
    if let Some(p) = privacy {
        inner.emit(Change::PrivacyChanged(p));
    }
    for (conv, from_msg_seq) in repairs {
        inner.emit(Change::RepairQueued { conv, from_msg_seq });
    }
    for m in cursors {
        inner.emit(Change::CursorMoved(m));
    }
    for g in gaps {
        inner.emit(Change::Gap(g));
    }
    for (conv, msg_seq) in recalled {
        inner.emit(Change::Recalled { conv, msg_seq });
    }
    for (conv, read_seq) in reads {
        inner.emit(Change::ReadMoved { conv, read_seq });
    }
    if applied > 0 {
        inner.committed();
    }
}

/// How the outbox pump ended.
enum PumpEnd {
    Drained,
    Retry(Option<Duration>),
    End(End),
}

/// Sends pending outbox entries oldest first, one at a time, each after
/// the previous reply (docs/protocol.md §1.2: the order of two writes holds
/// only if the second waits for the first).
async fn pump(inner: Arc<Inner>, ws: WsConn) -> PumpEnd {
    loop {
        let entry = match inner.db(|s, _| s.next_pending()).await {
            Ok(Some(entry)) => entry,
            Ok(None) => return PumpEnd::Drained,
            Err(e) => return PumpEnd::End(End::store(e)),
        };
        let point = FaultPoint::BeforeSend { client_msg_id: entry.client_msg_id.clone() };
        if inner.fault(&point) == FaultAction::Abort {
            return PumpEnd::End(End::Exit(Exit::Aborted(point)));
        }
        let sent = match entry.op {
            OutboxOp::Send => send_entry(&inner, &ws, &entry).await,
            OutboxOp::Recall => recall_entry(&inner, &ws, &entry).await,
            OutboxOp::Read => read_entry(&inner, &ws, &entry).await,
        };
        let record = match sent {
            Ok(Ok(record)) => record,
            Ok(Err(end)) => return end,
            Err(e) => match action_for(Op::Send, &e) {
                Action::Reject => {
                    let (id, why) = (entry.id, e.to_string());
                    if let Err(e) = inner.db(move |s, _| s.record_failed(id, &why)).await {
                        return PumpEnd::End(End::store(e));
                    }
                    inner.emit(Change::OutboxFailed {
                        op: entry.op,
                        client_msg_id: entry.client_msg_id.clone(),
                        conv: entry.conv.clone(),
                        error: e.to_string(),
                    });
                    inner.committed();
                    continue;
                }
                Action::Retry { retry_after } => return PumpEnd::Retry(retry_after),
                other => return PumpEnd::End(End::of(other)),
            },
        };
        // Announced when it was recorded (`recorded`).
        let _ = record;
    }
}

/// A reply arrived: the fault hook may kill the client before it is
/// recorded (the reply is then lost, as in a crash).
fn after_reply(inner: &Inner, entry: &OutboxEntry, msg_seq: u64) -> Result<(), PumpEnd> {
    let point = FaultPoint::AfterSendOk { client_msg_id: entry.client_msg_id.clone(), msg_seq };
    if inner.fault(&point) == FaultAction::Abort {
        return Err(PumpEnd::End(End::Exit(Exit::Aborted(point))));
    }
    Ok(())
}

type Sent = ClientResult<Result<OutboxRecord, PumpEnd>>;

async fn send_entry(inner: &Arc<Inner>, ws: &WsConn, entry: &OutboxEntry) -> Sent {
    let req = SendReq {
        conv: entry.conv.clone(),
        client_msg_id: entry.client_msg_id.clone(),
        kind: entry.kind.clone(),
        content: entry.content.clone(),
        mentions: entry.mentions.clone(),
        mention_all: entry.mention_all,
    };
    let ok = inner.call(ws.send(&req)).await?;
    if let Err(end) = after_reply(inner, entry, ok.msg_seq) {
        return Ok(Err(end));
    }
    let id = entry.id;
    Ok(inner
        .db(move |s, inner| recorded(inner, s.record_send_ok(id, &ok)))
        .await
        .map_err(|e| PumpEnd::End(End::store(e))))
}

async fn recall_entry(inner: &Arc<Inner>, ws: &WsConn, entry: &OutboxEntry) -> Sent {
    let req = RecallReq {
        conv: entry.conv.clone(),
        message_id: entry.content["message_id"].as_str().unwrap_or_default().to_owned(),
        // The same key on every attempt: a retry returns the same event.
        client_msg_id: Some(entry.client_msg_id.clone()),
    };
    let ok: RecallOk = inner.call(ws.request(op::RECALL, &req)).await?;
    if let Err(end) = after_reply(inner, entry, ok.msg_seq) {
        return Ok(Err(end));
    }
    let id = entry.id;
    Ok(inner
        .db(move |s, inner| recorded(inner, s.record_recall_ok(id, &ok)))
        .await
        .map_err(|e| PumpEnd::End(End::store(e))))
}

async fn read_entry(inner: &Arc<Inner>, ws: &WsConn, entry: &OutboxEntry) -> Sent {
    // `read` is idempotent by itself (the position never moves back).
    let req = ReadReq { conv: entry.conv.clone(), read_to_seq: entry.content["read_to_seq"].as_u64().unwrap_or(0) };
    let ok: ReadOk = inner.call(ws.request(op::READ, &req)).await?;
    if let Err(end) = after_reply(inner, entry, ok.read_seq) {
        return Ok(Err(end));
    }
    let id = entry.id;
    Ok(inner
        .db(move |s, inner| recorded(inner, s.record_read_ok(id, &ok)))
        .await
        .map_err(|e| PumpEnd::End(End::store(e))))
}

/// Announces a recorded acceptance under the store lock, right after its
/// commit, so the change stream is in commit order.
fn recorded(inner: &Inner, record: StoreResult<OutboxRecord>) -> StoreResult<OutboxRecord> {
    let record = record?;
    announce_record(inner, record.clone());
    Ok(record)
}

/// Notifies what an accepted entry changed, then bumps the version.
fn announce_record(inner: &Inner, record: OutboxRecord) {
    let e = &record.entry;
    inner.emit(Change::OutboxAccepted {
        op: e.op,
        client_msg_id: e.client_msg_id.clone(),
        conv: e.conv.clone(),
        msg_seq: e.msg_seq.unwrap_or_default(),
        message_id: e.message_id.clone(),
        duplicate: e.duplicate,
    });
    if let Some(m) = record.cursor {
        inner.emit(Change::CursorMoved(m));
    }
    if let Some((conv, msg_seq)) = record.recalled {
        inner.emit(Change::Recalled { conv, msg_seq });
    }
    if let Some((read_seq, _)) = record.read {
        inner.emit(Change::ReadMoved { conv: e.conv.clone(), read_seq });
    }
    let gap = record.gap.is_some();
    if let Some(g) = record.gap {
        // Our message landed above events we do not hold yet.
        inner.emit(Change::Gap(g));
    }
    inner.committed();
    if gap {
        inner.sync_wake.notify_one();
    }
}
