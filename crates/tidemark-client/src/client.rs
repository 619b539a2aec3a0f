//! The SDK's public face: [`Client`], what an app holds for one device of
//! one user. It owns the local store handle, the engine task's lifetime and
//! the change notifications; it answers reads from the local store, so they
//! work offline, and turns sends into durable outbox entries.
//!
//! It must not know the sync protocol's order of operations (that is
//! [`crate::engine`]) nor any SQL (that is [`crate::store`]).

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tidemark_proto::{ConvSummary, CONTENT_BYTES_MAX};
use tokio::sync::{broadcast, mpsc, oneshot, watch, Notify};
use tokio::task::JoinHandle;

use crate::engine::{self, Command, Inner, CHANGES_MAX, COMMANDS_MAX};
use crate::store::{Conversation, LocalStore, Mentions, Message, OutboxEntry, OutboxOp, PrivacySwitches, SyncPosition};
use crate::types::{Change, ClientConfig, ConnState, Exit, SdkError};
use crate::Http;

/// Bounds of `conv`, `message_id` and `kind` (docs/protocol.md §3.1, §3.12).
use tidemark_proto::{ID_BYTES_MAX, KIND_BYTES_MAX, MENTIONS_MAX, USER_BYTES_MAX};

/// A subscription to a client's [`Change`]s.
pub struct Changes {
    rx: broadcast::Receiver<Change>,
}

impl Changes {
    /// The next change; `None` once the client is gone.
    pub async fn recv(&mut self) -> Option<Change> {
        match self.rx.recv().await {
            Ok(change) => Some(change),
            Err(broadcast::error::RecvError::Lagged(missed)) => Some(Change::Lagged { missed }),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }

    /// A change already waiting, without blocking.
    pub fn try_recv(&mut self) -> Option<Change> {
        match self.rx.try_recv() {
            Ok(change) => Some(change),
            Err(broadcast::error::TryRecvError::Lagged(missed)) => Some(Change::Lagged { missed }),
            Err(_) => None,
        }
    }
}

struct EngineSlot {
    idle: Option<mpsc::Receiver<Command>>,
    running: Option<JoinHandle<(Exit, mpsc::Receiver<Command>)>>,
    last_exit: Option<Exit>,
}

/// One device of one user: a local store, an outbox, and (once started) a
/// connection that keeps them in sync.
pub struct Client {
    pub(crate) inner: Arc<Inner>,
    cmds: mpsc::Sender<Command>,
    engine: tokio::sync::Mutex<EngineSlot>,
    shutdown: Mutex<Option<watch::Sender<bool>>>,
}

impl Client {
    /// Opens (or creates) the device's local store. No network yet: sends
    /// queue in the outbox and reads work offline until [`Client::start`].
    pub fn open(config: ClientConfig) -> Result<Client, SdkError> {
        if config.sync_page_limit == 0 || config.sync_page_limit > tidemark_proto::SYNC_LIMIT_MAX {
            return Err(SdkError::Invalid(format!("sync_page_limit must be 1..={}", tidemark_proto::SYNC_LIMIT_MAX)));
        }
        let store = LocalStore::open(&config.db_path, &config.user, &config.device_id)?;
        let (cmds_tx, cmds_rx) = mpsc::channel(COMMANDS_MAX);
        let (changes, _) = broadcast::channel(CHANGES_MAX);
        let inner = Arc::new(Inner {
            http: Http::new(&config.server_url),
            ws_url: config.ws_url(),
            config,
            store: Mutex::new(store),
            changes,
            state: watch::channel(ConnState::Offline).0,
            version: watch::channel(0).0,
            outbox_wake: Notify::new(),
            sync_wake: Notify::new(),
            aborted: Mutex::new(None),
        });
        Ok(Client {
            inner,
            cmds: cmds_tx,
            engine: tokio::sync::Mutex::new(EngineSlot { idle: Some(cmds_rx), running: None, last_exit: None }),
            shutdown: Mutex::new(None),
        })
    }

    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// Starts the engine: connect, sync, send, reconnect, until stopped.
    pub async fn start(&self) -> Result<(), SdkError> {
        let mut slot = self.engine.lock().await;
        let Some(cmds) = slot.idle.take() else {
            return Err(SdkError::AlreadyRunning);
        };
        let (tx, rx) = watch::channel(false);
        *self.shutdown.lock().expect("shutdown lock") = Some(tx);
        slot.last_exit = None;
        slot.running = Some(tokio::spawn(engine::run(self.inner.clone(), cmds, rx)));
        Ok(())
    }

    /// Stops the engine (closing the connection cleanly) and waits for it.
    pub async fn stop(&self) -> Exit {
        if let Some(tx) = self.shutdown.lock().expect("shutdown lock").as_ref() {
            let _ = tx.send(true);
        }
        self.closed().await
    }

    /// Waits until the engine stops by itself (revoked, superseded, logged
    /// out, aborted) or is stopped; returns why. Returns at once if it is not
    /// running.
    pub async fn closed(&self) -> Exit {
        let mut slot = self.engine.lock().await;
        if let Some(handle) = slot.running.take() {
            let exit = match handle.await {
                Ok((exit, cmds)) => {
                    slot.idle = Some(cmds);
                    exit
                }
                // The engine panicked: it cannot be restarted.
                Err(e) => Exit::Failed(format!("engine task: {e}")),
            };
            slot.last_exit = Some(exit);
        }
        slot.last_exit.clone().unwrap_or(Exit::Stopped)
    }

    pub fn subscribe(&self) -> Changes {
        Changes { rx: self.inner.changes.subscribe() }
    }

    pub fn state(&self) -> ConnState {
        *self.inner.state.borrow()
    }

    pub fn watch_state(&self) -> watch::Receiver<ConnState> {
        self.inner.state.subscribe()
    }

    /// Changes after every local commit (page, send, reset), once the
    /// commit's [`Change`]s are sent.
    pub fn watch_version(&self) -> watch::Receiver<u64> {
        self.inner.version.subscribe()
    }

    /// Asks for a sync now (app resumed, came to the foreground…).
    pub fn sync_now(&self) {
        self.inner.sync_wake.notify_one();
    }

    /// Queues a text-kind message; see [`Client::send_kind`].
    pub async fn send(&self, conv: &str, content: Value) -> Result<OutboxEntry, SdkError> {
        self.send_kind(conv, "text", content).await
    }

    /// Persists the message with a fresh `client_msg_id` in the outbox, then
    /// lets the engine send it (now if connected, after the older pending
    /// entries; otherwise on the next connection). The entry is durable when
    /// this returns; [`Change::OutboxAccepted`] follows the server's `send.ok`.
    pub async fn send_kind(&self, conv: &str, kind: &str, content: Value) -> Result<OutboxEntry, SdkError> {
        self.send_mentioning(conv, kind, content, Mentions::default()).await
    }

    /// [`Client::send_kind`] of a message that mentions users or everyone
    /// (issue 18): each mentioned member's [`Conversation::mentions`]
    /// grows apart from unread, and a mention is pushed even where the
    /// conversation is muted. At most `MENTIONS_MAX` users, refused here
    /// (`Invalid`) before anything is queued; a mention of everyone the
    /// server does not allow fails the entry with `FORBIDDEN`.
    pub async fn send_mentioning(
        &self,
        conv: &str,
        kind: &str,
        content: Value,
        mentions: Mentions,
    ) -> Result<OutboxEntry, SdkError> {
        check_send(conv, kind, &content)?;
        if mentions.users.len() > MENTIONS_MAX {
            return Err(SdkError::Invalid(format!("at most {MENTIONS_MAX} mentions")));
        }
        if let Some(bad) = mentions.users.iter().find(|u| u.is_empty() || u.len() > USER_BYTES_MAX) {
            return Err(SdkError::Invalid(format!("mention {bad:?} must be 1..={USER_BYTES_MAX} bytes")));
        }
        self.enqueue_with(OutboxOp::Send, conv, kind, content, mentions).await
    }

    /// Recalls one of the user's messages (E1), through the outbox: after
    /// any send queued before it, and with one `client_msg_id` for every
    /// attempt. On `recall.ok` the message becomes a placeholder here; the
    /// recall event brings it to the user's other devices.
    pub async fn recall(&self, conv: &str, message_id: &str) -> Result<OutboxEntry, SdkError> {
        check_conv(conv)?;
        if message_id.is_empty() || message_id.len() > ID_BYTES_MAX {
            return Err(SdkError::Invalid(format!("message_id must be 1..={ID_BYTES_MAX} bytes")));
        }
        self.enqueue(OutboxOp::Recall, conv, "recall", serde_json::json!({ "message_id": message_id })).await
    }

    /// Marks everything in `conv` up to `read_to_seq` read, for the user (all
    /// devices learn it from the `read` event). Through the outbox, so it
    /// also works offline; the read position never moves back.
    pub async fn mark_read(&self, conv: &str, read_to_seq: u64) -> Result<OutboxEntry, SdkError> {
        check_conv(conv)?;
        self.enqueue(OutboxOp::Read, conv, "read", serde_json::json!({ "read_to_seq": read_to_seq })).await
    }

    async fn enqueue(&self, op: OutboxOp, conv: &str, kind: &str, content: Value) -> Result<OutboxEntry, SdkError> {
        self.enqueue_with(op, conv, kind, content, Mentions::default()).await
    }

    async fn enqueue_with(
        &self,
        op: OutboxOp,
        conv: &str,
        kind: &str,
        content: Value,
        mentions: Mentions,
    ) -> Result<OutboxEntry, SdkError> {
        let client_msg_id = format!("{:032x}", rand::random::<u128>());
        let (c, k) = (conv.to_owned(), kind.to_owned());
        // Announced under the store lock right after the commit, so no
        // later commit (the pump's acceptance of this entry) is announced
        // first.
        let entry = self
            .inner
            .db(move |s, inner| {
                let entry = s.enqueue_mentioning(&client_msg_id, op, &c, &k, &content, &mentions)?;
                inner.emit(Change::OutboxQueued {
                    op,
                    client_msg_id: entry.client_msg_id.clone(),
                    conv: entry.conv.clone(),
                });
                inner.committed();
                Ok(entry)
            })
            .await?;
        self.inner.outbox_wake.notify_one();
        Ok(entry)
    }

    /// Creates (or finds) the direct conversation with `peer`; needs the
    /// connection.
    pub async fn create_direct(&self, peer: &str) -> Result<String, SdkError> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::CreateDirect { peer: peer.to_owned(), reply }, rx).await
    }

    /// The server's `conv.list` for this user (read positions and unread
    /// counts as the server projects them); needs the connection.
    pub async fn server_conversations(&self) -> Result<Vec<ConvSummary>, SdkError> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::ServerConversations { reply }, rx).await
    }

    pub(crate) async fn command<T>(
        &self,
        cmd: Command,
        rx: oneshot::Receiver<Result<T, SdkError>>,
    ) -> Result<T, SdkError> {
        if self.cmds.send(cmd).await.is_err() {
            return Err(SdkError::NotRunning);
        }
        // A command queued while the engine is not running waits for the
        // next start; bound the wait like any request.
        match tokio::time::timeout(self.inner.config.request_timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(SdkError::NotRunning),
            Err(_) => Err(SdkError::Timeout),
        }
    }

    /// Conversations with their last message and unread count, most recent
    /// first. Local: works offline.
    pub async fn conversations(&self) -> Result<Vec<Conversation>, SdkError> {
        Ok(self.inner.db(|s, _| s.conversations()).await?)
    }

    /// The user's privacy switches as this device last synced them (issue
    /// 18): a change made on any of the user's devices arrives as a
    /// `privacy` event ([`Change::PrivacyChanged`]); a snapshot carries
    /// them. Local: needs no connection.
    pub async fn privacy(&self) -> Result<PrivacySwitches, SdkError> {
        Ok(self.inner.db(|s, _| s.privacy()).await?)
    }

    pub async fn conversation(&self, conv: &str) -> Result<Option<Conversation>, SdkError> {
        let conv = conv.to_owned();
        Ok(self.inner.db(move |s, _| s.conversation(&conv)).await?)
    }

    /// The messages of `conv` held locally, in `msg_seq` order; a recalled
    /// message stays in place as a placeholder.
    pub async fn messages(&self, conv: &str) -> Result<Vec<Message>, SdkError> {
        let conv = conv.to_owned();
        Ok(self.inner.db(move |s, _| s.messages(&conv)).await?)
    }

    /// Every conversation event of `conv` held locally, control events
    /// (membership, recall, edit, reaction) included, in `msg_seq` order.
    pub async fn events(&self, conv: &str) -> Result<Vec<Message>, SdkError> {
        let conv = conv.to_owned();
        Ok(self.inner.db(move |s, _| s.events(&conv)).await?)
    }

    /// The outbox (pending entries, and the latest accepted and failed
    /// ones), in order.
    pub async fn outbox(&self) -> Result<Vec<OutboxEntry>, SdkError> {
        Ok(self.inner.db(|s, _| s.outbox()).await?)
    }

    pub async fn outbox_entry(&self, client_msg_id: &str) -> Result<Option<OutboxEntry>, SdkError> {
        let id = client_msg_id.to_owned();
        Ok(self.inner.db(move |s, _| s.outbox_by_client_msg_id(&id)).await?)
    }

    /// Where this device stands in its user's sync log.
    pub async fn position(&self) -> Result<SyncPosition, SdkError> {
        Ok(self.inner.db(|s, _| s.position()).await?)
    }

    /// Re-runs `check` after every local commit until it returns true, for
    /// at most `within`.
    pub async fn wait_for<F, Fut>(&self, within: Duration, mut check: F) -> Result<(), SdkError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, SdkError>>,
    {
        let deadline = tokio::time::Instant::now() + within;
        let mut version = self.watch_version();
        loop {
            version.borrow_and_update();
            if check().await? {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, version.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(SdkError::NotRunning),
                Err(_) => return Err(SdkError::Timeout),
            }
        }
    }

    /// Waits until the connection state is `state`, for at most `within`.
    pub async fn wait_state(&self, state: ConnState, within: Duration) -> Result<(), SdkError> {
        let mut rx = self.watch_state();
        let reached = tokio::time::timeout(within, async { rx.wait_for(|s| *s == state).await.is_ok() }).await;
        match reached {
            Ok(true) => Ok(()),
            Ok(false) => Err(SdkError::NotRunning),
            Err(_) => Err(SdkError::Timeout),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Dropping the sender stops the engine at its next turn.
        if let Ok(mut tx) = self.shutdown.lock() {
            if let Some(tx) = tx.take() {
                let _ = tx.send(true);
            }
        }
    }
}

/// The send rules of docs/protocol.md §3.1, checked before anything is
/// queued: an entry the server would refuse forever must not block the
/// outbox.
fn check_send(conv: &str, kind: &str, content: &Value) -> Result<(), SdkError> {
    check_conv(conv)?;
    let kind_ok = !kind.is_empty()
        && kind.len() <= KIND_BYTES_MAX
        && kind.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.@-".contains(&b));
    if !kind_ok {
        return Err(SdkError::Invalid(format!("kind must be 1..={KIND_BYTES_MAX} bytes of [A-Za-z0-9_.@-]")));
    }
    if content.is_null() {
        return Err(SdkError::Invalid("content must not be null".into()));
    }
    let bytes = content.to_string().len();
    if bytes > CONTENT_BYTES_MAX {
        return Err(SdkError::Invalid(format!("content is {bytes} bytes; at most {CONTENT_BYTES_MAX}")));
    }
    Ok(())
}

fn check_conv(conv: &str) -> Result<(), SdkError> {
    if conv.is_empty() || conv.len() > ID_BYTES_MAX {
        return Err(SdkError::Invalid(format!("conv must be 1..={ID_BYTES_MAX} bytes")));
    }
    Ok(())
}
