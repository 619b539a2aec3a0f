//! Tidemark's second-language door: UniFFI bindings of the client SDK's
//! core calls, for Python, Kotlin and Swift (`uniffi-bindgen generate
//! --library` on this crate's cdylib; the `uniffi-bindgen` binary of this
//! crate is that tool).
//!
//! It is a thin typed wrapper and must stay one: every call is one call of
//! [`tidemark_client::Client`], its arguments and results converted to
//! UniFFI records field by field; it decides nothing, retries nothing and
//! holds no state but the SDK client, a runtime to run it on and the
//! client's change subscription. Rules live where they live for Rust apps
//! (the SDK, `tidemark-core`, `tidemark-proto`).
//!
//! The calls block the calling thread (UniFFI's Python bindings release
//! the interpreter's lock meanwhile); each [`TidemarkClient`] owns a small
//! tokio runtime that runs its engine in the background. Message content
//! crosses as JSON text (`content_json`), as the wire carries it.
//! *tests/python.rs* drives it from Python against a real server.
//!
//! # Kotlin and Swift: generated, not run
//!
//! *tests/python.rs* generates the Kotlin and Swift bindings too, but no
//! test compiles or runs them, because neither toolchain can be installed
//! from the package sources this project's machines and CI reach
//! (crates.io, PyPI, Debian 12 and npm; no Maven Central, no swift.org):
//!
//! - **Kotlin.** Debian 12's `kotlin` is 1.3.31 (`kotlinc-jvm
//!   1.3-SNAPSHOT`), with `libjna-java` 5.13.0; together about 340 MB over
//!   71 packages. It cannot compile what UniFFI 0.32 generates
//!   (`uniffi/tidemark_ffi/tidemark_ffi.kt`, ~3,100 lines): 162 errors
//!   `expecting a parameter declaration` / `expecting an argument`, every
//!   one at a trailing comma in a parameter or argument list (e.g.
//!   `` fun callback(`handle`: Long,) ``), a syntax Kotlin has only since
//!   1.4. With the trailing commas removed by hand (not a fix we would
//!   ship) 14 errors remain: `unresolved reference: stackTraceToString`
//!   (standard library since 1.4) and the generated exceptions'
//!   `message` property (`conflicting declarations: public open val
//!   message`, `'message' hides member of supertype ... needs 'override'`,
//!   `overload resolution ambiguity`). A newer compiler comes only from
//!   JetBrains' releases or Maven Central (`kotlin-compiler-embeddable`),
//!   neither reachable; npm's `@jetbrains/kotlinc-js-api` wraps a
//!   compiler it does not ship, and no PyPI package ships one.
//! - **Swift.** `apt-cache search swiftlang` finds nothing in Debian 12
//!   (Debian packages Swift only from 13 on), there is no `swift` on the
//!   machine, and no PyPI or npm package ships a Swift toolchain
//!   (swift.org's tarballs are not reachable).
//!
//! A Kotlin or Swift test like *tests/python.rs* (skipping only when the
//! compiler is absent) becomes possible on a machine whose packages carry
//! Kotlin 1.4 or later (with JNA 5) or Swift 5.9 or later.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_client as sdk;

uniffi::setup_scaffolding!();

/// Worker threads of each client's runtime: the engine and the calls that
/// wait on it need few.
const RUNTIME_THREADS: usize = 2;

/// An SDK error, by kind; `Refused` carries the contract's error code
/// (`NOT_MEMBER`, `NOT_FOUND`, `FORBIDDEN`…, docs/protocol.md §5).
#[derive(Debug, thiserror::Error, uniffi::Error)]
pub enum TidemarkError {
    #[error("refused: {code}: {message}")]
    Refused { code: String, message: String },
    #[error("offline")]
    Offline,
    #[error("timed out")]
    Timeout,
    #[error("invalid input: {message}")]
    Invalid { message: String },
    #[error("the client is not running")]
    NotRunning,
    #[error("{message}")]
    Failed { message: String },
}

impl From<sdk::SdkError> for TidemarkError {
    fn from(e: sdk::SdkError) -> Self {
        match e {
            sdk::SdkError::Refused(refusal) => match &refusal {
                sdk::ClientError::Server(frame) => {
                    TidemarkError::Refused { code: frame.code.as_str().to_owned(), message: frame.message.clone() }
                }
                _ => TidemarkError::Failed { message: refusal.to_string() },
            },
            sdk::SdkError::Offline => TidemarkError::Offline,
            sdk::SdkError::Timeout => TidemarkError::Timeout,
            sdk::SdkError::Invalid(message) => TidemarkError::Invalid { message },
            sdk::SdkError::NotRunning => TidemarkError::NotRunning,
            other => TidemarkError::Failed { message: other.to_string() },
        }
    }
}

impl From<sdk::ClientError> for TidemarkError {
    fn from(e: sdk::ClientError) -> Self {
        TidemarkError::from(sdk::SdkError::Refused(e))
    }
}

/// What [`TidemarkClient::open`] needs (`sdk::ClientConfig`'s defaults for
/// the rest; `None` keeps a default).
#[derive(uniffi::Record)]
pub struct ClientSettings {
    /// Like `http://127.0.0.1:8080`.
    pub server_url: String,
    pub user: String,
    /// Stable id of this installation.
    pub device_id: String,
    pub password: Option<String>,
    /// The device's local SQLite database.
    pub db_path: String,
    pub request_timeout_ms: Option<u64>,
    pub periodic_sync_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum)]
pub enum ConnState {
    Offline,
    Connecting,
    Syncing,
    Ready,
}

impl From<sdk::ConnState> for ConnState {
    fn from(s: sdk::ConnState) -> Self {
        match s {
            sdk::ConnState::Offline => ConnState::Offline,
            sdk::ConnState::Connecting => ConnState::Connecting,
            sdk::ConnState::Syncing => ConnState::Syncing,
            sdk::ConnState::Ready => ConnState::Ready,
        }
    }
}

/// A conversation event as held locally (`sdk::Message`).
#[derive(uniffi::Record)]
pub struct Message {
    pub conv: String,
    pub msg_seq: u64,
    pub message_id: String,
    pub kind: String,
    /// `normal`, `edited`, `recalled` or `deleted`.
    pub state: String,
    pub sender: String,
    pub content_json: String,
    pub created_at: i64,
    pub version: u64,
}

impl From<sdk::Message> for Message {
    fn from(m: sdk::Message) -> Self {
        Message {
            content_json: m.content.to_string(),
            conv: m.conv,
            msg_seq: m.msg_seq,
            message_id: m.message_id,
            kind: m.kind,
            state: m.state,
            sender: m.sender,
            created_at: m.created_at,
            version: m.version,
        }
    }
}

/// A conversation summary (`sdk::Conversation`).
#[derive(uniffi::Record)]
pub struct Conversation {
    pub conv: String,
    pub kind: String,
    pub contiguous_msg_seq: u64,
    pub history_to: u64,
    pub last_msg_seq: u64,
    pub read_seq: u64,
    pub unread: u64,
    pub muted: bool,
    pub pinned: bool,
    pub active: bool,
    pub needs_repair: bool,
    pub last_message: Option<Message>,
}

impl From<sdk::Conversation> for Conversation {
    fn from(c: sdk::Conversation) -> Self {
        Conversation {
            conv: c.conv,
            kind: c.kind,
            contiguous_msg_seq: c.contiguous_msg_seq,
            history_to: c.history_to,
            last_msg_seq: c.last_msg_seq,
            read_seq: c.read_seq,
            unread: c.unread,
            muted: c.muted,
            pinned: c.pinned,
            active: c.active,
            needs_repair: c.needs_repair,
            last_message: c.last_message.map(Message::from),
        }
    }
}

/// An outbox entry (`sdk::OutboxEntry`); `state` is `pending`, `accepted`
/// or `failed`.
#[derive(uniffi::Record)]
pub struct OutboxEntry {
    pub client_msg_id: String,
    pub op: String,
    pub conv: String,
    pub state: String,
    pub message_id: Option<String>,
    pub msg_seq: Option<u64>,
    pub duplicate: bool,
    pub error: Option<String>,
}

impl From<sdk::OutboxEntry> for OutboxEntry {
    fn from(e: sdk::OutboxEntry) -> Self {
        OutboxEntry {
            client_msg_id: e.client_msg_id,
            op: e.op.as_str().to_owned(),
            conv: e.conv,
            state: e.state.as_str().to_owned(),
            message_id: e.message_id,
            msg_seq: e.msg_seq,
            duplicate: e.duplicate,
            error: e.error,
        }
    }
}

/// One page of history, newest first (`sdk::HistoryPage`).
#[derive(uniffi::Record)]
pub struct HistoryPage {
    pub messages: Vec<Message>,
    pub next_cursor: Option<u64>,
    pub has_more: bool,
    pub history_start: u64,
    pub trimmed: bool,
    pub local: bool,
}

/// Where the device stands in its user's sync log (`sdk::SyncPosition`).
#[derive(uniffi::Record)]
pub struct SyncPosition {
    pub generation: Option<u64>,
    pub applied_sync_seq: u64,
    pub acked_sync_seq: u64,
}

/// A change notification (`sdk::Change`), the ones an app acts on typed;
/// the others as `Other` with their description. A hint for the view: the
/// local store is the truth, and after `Lagged` the app re-reads it.
#[derive(Debug, uniffi::Enum)]
pub enum Event {
    State { state: ConnState },
    PageApplied { applied: u64, applied_sync_seq: u64 },
    CursorMoved { conv: String, from_seq: u64, to_seq: u64 },
    Acked { acked_sync_seq: u64, generation: u64 },
    OutboxQueued { client_msg_id: String, conv: String },
    OutboxAccepted { client_msg_id: String, conv: String, msg_seq: u64, duplicate: bool },
    OutboxFailed { client_msg_id: String, conv: String, error: String },
    ReadMoved { conv: String, read_seq: u64 },
    Lagged { missed: u64 },
    Exited { reason: String },
    Other { description: String },
}

impl From<sdk::Change> for Event {
    fn from(c: sdk::Change) -> Self {
        use sdk::Change as C;
        match c {
            C::State(s) => Event::State { state: s.into() },
            C::PageApplied(p) => Event::PageApplied { applied: p.applied as u64, applied_sync_seq: p.applied_sync_seq },
            C::CursorMoved(m) => Event::CursorMoved { conv: m.conv, from_seq: m.from, to_seq: m.to },
            C::Acked { acked_sync_seq, generation, .. } => Event::Acked { acked_sync_seq, generation },
            C::OutboxQueued { client_msg_id, conv, .. } => Event::OutboxQueued { client_msg_id, conv },
            C::OutboxAccepted { client_msg_id, conv, msg_seq, duplicate, .. } => {
                Event::OutboxAccepted { client_msg_id, conv, msg_seq, duplicate }
            }
            C::OutboxFailed { client_msg_id, conv, error, .. } => Event::OutboxFailed { client_msg_id, conv, error },
            C::ReadMoved { conv, read_seq } => Event::ReadMoved { conv, read_seq },
            C::Lagged { missed } => Event::Lagged { missed },
            C::Exited(exit) => Event::Exited { reason: format!("{exit:?}") },
            other => Event::Other { description: format!("{other:?}") },
        }
    }
}

/// Creates an account through the server's admin API (an operator's
/// token; the server has no self sign-up). True when it was created, false
/// when it existed.
#[uniffi::export]
pub fn create_user(
    server_url: String,
    admin_token: String,
    user: String,
    password: String,
) -> Result<bool, TidemarkError> {
    let runtime = runtime()?;
    let http = sdk::Http::new(&server_url);
    Ok(runtime.block_on(http.create_user(&admin_token, &user, &password))?.created)
}

fn runtime() -> Result<tokio::runtime::Runtime, TidemarkError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(RUNTIME_THREADS)
        .enable_all()
        .build()
        .map_err(|e| TidemarkError::Failed { message: format!("runtime: {e}") })
}

/// One device of one user (`sdk::Client`).
#[derive(uniffi::Object)]
pub struct TidemarkClient {
    // Dropped before the runtime it runs on.
    client: sdk::Client,
    changes: Mutex<sdk::Changes>,
    runtime: tokio::runtime::Runtime,
}

#[uniffi::export]
impl TidemarkClient {
    /// Opens (or creates) the device's local store; no network until
    /// `start`. Changes are recorded for `next_event` from here on.
    #[uniffi::constructor]
    pub fn open(settings: ClientSettings) -> Result<Arc<TidemarkClient>, TidemarkError> {
        let mut config =
            sdk::ClientConfig::new(&settings.server_url, &settings.user, &settings.device_id, settings.db_path);
        config.password = settings.password;
        if let Some(ms) = settings.request_timeout_ms {
            config.request_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = settings.periodic_sync_ms {
            config.periodic_sync = Duration::from_millis(ms);
        }
        let runtime = runtime()?;
        let client = sdk::Client::open(config)?;
        let changes = Mutex::new(client.subscribe());
        Ok(Arc::new(TidemarkClient { client, changes, runtime }))
    }

    /// Starts the engine: connect, sync, send, reconnect, until `stop`.
    pub fn start(&self) -> Result<(), TidemarkError> {
        Ok(self.runtime.block_on(self.client.start())?)
    }

    /// Stops the engine and waits for it; returns why it stopped.
    pub fn stop(&self) -> String {
        format!("{:?}", self.runtime.block_on(self.client.stop()))
    }

    pub fn state(&self) -> ConnState {
        self.client.state().into()
    }

    /// Waits until the connection is `Ready`, for at most `timeout_ms`.
    pub fn wait_ready(&self, timeout_ms: u64) -> Result<(), TidemarkError> {
        let within = Duration::from_millis(timeout_ms);
        Ok(self.runtime.block_on(self.client.wait_state(sdk::ConnState::Ready, within))?)
    }

    /// Asks for a sync now (the app came to the foreground…).
    pub fn sync_now(&self) {
        self.client.sync_now();
    }

    /// The next change, waiting at most `timeout_ms`; `None` when none came.
    pub fn next_event(&self, timeout_ms: u64) -> Option<Event> {
        let mut changes = self.changes.lock().expect("changes lock");
        let within = Duration::from_millis(timeout_ms);
        // The timer is made inside the runtime: it needs its clock.
        let next = self.runtime.block_on(async { tokio::time::timeout(within, changes.recv()).await });
        next.ok().flatten().map(Event::from)
    }

    /// Creates (or finds) the direct conversation with `peer`; needs the
    /// connection.
    pub fn create_direct(&self, peer: String) -> Result<String, TidemarkError> {
        Ok(self.runtime.block_on(self.client.create_direct(&peer))?)
    }

    /// Creates a group with `members` (the caller is its owner); returns its
    /// conversation id.
    pub fn create_group(&self, members: Vec<String>) -> Result<String, TidemarkError> {
        let members: Vec<&str> = members.iter().map(String::as_str).collect();
        Ok(self.runtime.block_on(self.client.create_group(&members))?.conv)
    }

    /// Queues a message of `kind` with `content_json` in the durable outbox
    /// (works offline); it leaves in order once connected.
    pub fn send(&self, conv: String, kind: String, content_json: String) -> Result<OutboxEntry, TidemarkError> {
        let content = serde_json::from_str(&content_json)
            .map_err(|e| TidemarkError::Invalid { message: format!("content_json: {e}") })?;
        Ok(self.runtime.block_on(self.client.send_kind(&conv, &kind, content))?.into())
    }

    /// Marks `conv` read up to `read_to_seq` for the user, through the
    /// outbox.
    pub fn mark_read(&self, conv: String, read_to_seq: u64) -> Result<OutboxEntry, TidemarkError> {
        Ok(self.runtime.block_on(self.client.mark_read(&conv, read_to_seq))?.into())
    }

    /// Conversations held locally, most recent first (works offline).
    pub fn conversations(&self) -> Result<Vec<Conversation>, TidemarkError> {
        let list = self.runtime.block_on(self.client.conversations())?;
        Ok(list.into_iter().map(Conversation::from).collect())
    }

    /// The messages of `conv` held locally, in `msg_seq` order.
    pub fn messages(&self, conv: String) -> Result<Vec<Message>, TidemarkError> {
        let list = self.runtime.block_on(self.client.messages(&conv))?;
        Ok(list.into_iter().map(Message::from).collect())
    }

    /// A page of `conv`'s history before `before_seq` (newest when `None`),
    /// newest first: from the local store when it holds the page whole,
    /// otherwise from the server (and then stored).
    pub fn history(&self, conv: String, before_seq: Option<u64>, limit: u32) -> Result<HistoryPage, TidemarkError> {
        let page = self.runtime.block_on(self.client.history(&conv, before_seq, limit))?;
        Ok(HistoryPage {
            messages: page.messages.into_iter().map(Message::from).collect(),
            next_cursor: page.next_cursor,
            has_more: page.has_more,
            history_start: page.history_start,
            trimmed: page.trimmed,
            local: page.local,
        })
    }

    /// The outbox: pending entries and the latest accepted and failed ones.
    pub fn outbox(&self) -> Result<Vec<OutboxEntry>, TidemarkError> {
        let list = self.runtime.block_on(self.client.outbox())?;
        Ok(list.into_iter().map(OutboxEntry::from).collect())
    }

    pub fn position(&self) -> Result<SyncPosition, TidemarkError> {
        let p = self.runtime.block_on(self.client.position())?;
        Ok(SyncPosition {
            generation: p.generation,
            applied_sync_seq: p.applied_sync_seq,
            acked_sync_seq: p.acked_sync_seq,
        })
    }
}
