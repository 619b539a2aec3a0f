//! The SDK's vocabulary, shared by the app-facing [`crate::Client`] and the
//! engine task below it: the configuration a client is opened with, the
//! connection states (K4), why an engine stopped, the change notifications
//! an app subscribes to, and the SDK's errors. It holds no behaviour of its
//! own, so the client and the engine both import it and neither imports
//! the other's types back.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::policy::Backoff;
use crate::store::{CursorMove, FaultAction, FaultPoint, Gap, OutboxOp, PageReport, PrivacySwitches, StoreError};
use crate::ClientError;

/// Decides, at each [`FaultPoint`], whether the client dies there (tests).
pub type FaultHook = Arc<dyn Fn(&FaultPoint) -> FaultAction + Send + Sync>;

/// Everything a [`Client`](crate::Client) needs; [`ClientConfig::new`] fills the defaults.
#[derive(Clone)]
pub struct ClientConfig {
    /// The server's base URL, like `http://127.0.0.1:8080`.
    pub server_url: String,
    pub user: String,
    /// Stable id of this installation (docs/protocol.md §2.2).
    pub device_id: String,
    /// Used to log in when there is no usable refresh token.
    pub password: Option<String>,
    /// The local SQLite database of this device.
    pub db_path: PathBuf,
    pub backoff: Backoff,
    /// A sync runs at least this often while connected (hints may be lost).
    pub periodic_sync: Duration,
    /// Events per sync page, 1..=1000.
    pub sync_page_limit: u32,
    /// A request without a reply for this long counts as a dead connection.
    pub request_timeout: Duration,
    /// Ask the server for `presence.batch` frames ([`crate::WsOptions`]);
    /// what the app sees ([`Change::Presence`](crate::Change)) is the same
    /// either way. Default on.
    pub presence_batch: bool,
    pub fault: Option<FaultHook>,
}

impl ClientConfig {
    pub fn new(server_url: &str, user: &str, device_id: &str, db_path: impl Into<PathBuf>) -> ClientConfig {
        ClientConfig {
            server_url: server_url.trim_end_matches('/').to_owned(),
            user: user.to_owned(),
            device_id: device_id.to_owned(),
            password: None,
            db_path: db_path.into(),
            backoff: Backoff::default(),
            periodic_sync: Duration::from_secs(30),
            sync_page_limit: tidemark_proto::SYNC_LIMIT_DEFAULT,
            request_timeout: Duration::from_secs(30),
            presence_batch: true,
            fault: None,
        }
    }

    pub fn with_password(mut self, password: &str) -> ClientConfig {
        self.password = Some(password.to_owned());
        self
    }

    pub(crate) fn ws_url(&self) -> String {
        let base = &self.server_url;
        let ws = if let Some(rest) = base.strip_prefix("https://") {
            format!("wss://{rest}")
        } else if let Some(rest) = base.strip_prefix("http://") {
            format!("ws://{rest}")
        } else {
            base.clone()
        };
        format!("{ws}/v1/ws")
    }
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the password.
        f.debug_struct("ClientConfig")
            .field("server_url", &self.server_url)
            .field("user", &self.user)
            .field("device_id", &self.device_id)
            .field("db_path", &self.db_path)
            .field("fault", &self.fault.is_some())
            .finish_non_exhaustive()
    }
}

/// The connection state machine's states (K4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    /// No connection; waiting out a backoff, or stopped.
    Offline,
    /// Getting a token and opening the WebSocket.
    Connecting,
    /// Connected, a sync round running: local data may be behind.
    Syncing,
    /// Connected and caught up with the last batch (not a promise about
    /// the future: new events may already be on their way).
    Ready,
}

/// Why the engine stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// [`Client::stop`](crate::Client::stop) (or the client was dropped).
    Stopped,
    /// Another instance connected as this device (`kicked superseded`):
    /// not reconnecting automatically.
    Superseded,
    /// The device was revoked; its tokens and local data are deleted.
    Revoked,
    /// No way to authenticate: wrong password, or none and no refresh token.
    LoggedOut(String),
    /// The fault hook killed the client at this point (tests). Like a dead
    /// process, this client object writes and reads nothing more; open a
    /// new one on the same database.
    Aborted(FaultPoint),
    /// The local store failed (disk full, corrupt, contradicting the server).
    Failed(String),
    /// The server asks for something this client cannot do. (No longer
    /// produced: a device that cannot replay installs a snapshot.)
    Unsupported(String),
}

/// A change notification. Notifications are hints for the app's view: the
/// local store is the truth, so a subscriber that lags gets
/// [`Change::Lagged`] and re-reads what it shows.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    State(ConnState),
    /// A hint arrived: only a watermark; a sync follows, nothing is applied
    /// from it.
    Hint {
        high_watermark: u64,
        reason: String,
    },
    /// A sync page committed locally (or was all replay, `applied == 0`).
    PageApplied(PageReport),
    /// The server confirmed this device's ACK.
    Acked {
        sync_seq: u64,
        acked_sync_seq: u64,
        generation: u64,
    },
    /// `RESET_REQUIRED`: this device must rebuild under `generation`. A
    /// snapshot install follows ([`Change::SnapshotStarted`]…); the local
    /// state stays as it is until the install commits.
    Reset {
        generation: Option<u64>,
    },
    /// Rebuilding from a snapshot (D7): `snapshot.begin` answered, or an
    /// interrupted install of the same snapshot starts over (`resumed`).
    /// `pages` pages follow; after the install the device stands at
    /// `base_sync_seq` and syncs on from there.
    SnapshotStarted {
        generation: u64,
        base_sync_seq: u64,
        pages: u32,
        resumed: bool,
    },
    /// Snapshot page `fetched` of `pages` downloaded (counted from 1): for a
    /// progress bar. Nothing is applied before the last page is verified.
    SnapshotPage {
        fetched: u32,
        pages: u32,
        items: usize,
    },
    /// The snapshot replaced the local synced state in one transaction; its
    /// `snapshot.ack` follows ([`Change::Acked`] with `sync_seq` =
    /// `base_sync_seq`).
    SnapshotInstalled {
        generation: u64,
        base_sync_seq: u64,
        conversations: usize,
        messages: usize,
    },
    /// An install attempt failed (digest mismatch, refused page or ack,
    /// malformed item, connection lost). Nothing local changed unless the
    /// install had already committed (then only its ack is left).
    /// `retrying`: a new attempt starts at once; otherwise after a backoff
    /// or on the next connection.
    SnapshotFailed {
        reason: String,
        retrying: bool,
    },
    /// An operation is durable in the outbox and will be sent in order.
    OutboxQueued {
        op: OutboxOp,
        client_msg_id: String,
        conv: String,
    },
    /// The server accepted an outbox entry: for a send, `msg_seq` and
    /// `message_id` are the message's; for a recall, the recall event's
    /// `msg_seq`; for a read, the read position after it.
    OutboxAccepted {
        op: OutboxOp,
        client_msg_id: String,
        conv: String,
        msg_seq: u64,
        message_id: Option<String>,
        duplicate: bool,
    },
    /// The server refused an outbox entry for good.
    OutboxFailed {
        op: OutboxOp,
        client_msg_id: String,
        conv: String,
        error: String,
    },
    /// A message became a placeholder (E1).
    Recalled {
        conv: String,
        msg_seq: u64,
    },
    /// The user's read position in a conversation moved (from this device
    /// or another one).
    ReadMoved {
        conv: String,
        read_seq: u64,
    },
    /// A conversation's contiguous cursor moved.
    CursorMoved(CursorMove),
    /// A message is held above a gap; a sync was requested.
    Gap(Gap),
    /// An event of `conv` could not be applied; the conversation is in the
    /// repair queue from `from_msg_seq` (K5) and shows `needs_repair` until
    /// [`Change::Repaired`]. The rest of the account syncs on.
    RepairQueued {
        conv: String,
        from_msg_seq: u64,
    },
    /// A repair attempt failed; the next waits `retry_in_ms`.
    RepairFailed {
        conv: String,
        attempts: u32,
        retry_in_ms: u64,
        error: String,
    },
    /// `conv` was fetched from the server and applied: nothing is missing.
    Repaired {
        conv: String,
    },
    /// A large group (G2) was pulled by `conv.sync` up to `last_msg_seq`
    /// and committed locally; `cleared` says whether its marker cleared
    /// (false: it moved meanwhile and is pulled again).
    GroupPulled {
        conv: String,
        last_msg_seq: u64,
        cleared: bool,
    },
    Kicked {
        reason: String,
    },
    /// `user` started (`typing`, shown for `timeout_ms` unless renewed) or
    /// stopped typing in `conv`. Ephemeral: never stored, may be lost.
    Typing {
        conv: String,
        user: String,
        typing: bool,
        timeout_ms: u64,
    },
    /// `user`, who shares a conversation with this one, is now `state`
    /// (`online`, `idle`, `offline`), last active at `last_seen` when
    /// known. Ephemeral: never stored, may be lost; after a reconnect the
    /// users online answer anew.
    Presence {
        user: String,
        state: String,
        last_seen: Option<i64>,
    },
    /// The user's privacy switches as this device holds them changed (a
    /// `privacy` event, from a change made on any of the user's devices, or
    /// a snapshot install): [`Client::privacy`] reads them.
    PrivacyChanged(PrivacySwitches),
    /// This subscriber missed `missed` notifications.
    Lagged {
        missed: u64,
    },
    Exited(Exit),
}

/// Errors of the SDK's API.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SdkError {
    #[error("local store: {0}")]
    Store(#[from] StoreError),
    /// The server refused the call (or the connection failed during it).
    #[error("{0}")]
    Refused(ClientError),
    /// The call needs a connection and there is none right now.
    #[error("offline")]
    Offline,
    #[error("the client is already running")]
    AlreadyRunning,
    /// The engine is not running.
    #[error("the client is not running")]
    NotRunning,
    #[error("invalid input: {0}")]
    Invalid(String),
    #[error("timed out")]
    Timeout,
    /// A multi-request call failed part way; nothing of it was applied
    /// locally. Try again.
    #[error("unavailable: {0}")]
    Unavailable(String),
}
