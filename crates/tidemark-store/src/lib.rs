//! The Tidemark storage trait: domain-level operations that every backend
//! (embedded SQLite now, PostgreSQL later) implements with the same meaning.
//!
//! Services talk to `Arc<dyn Store>` and never see SQL. Each method is one
//! atomic step of the design: "accept this send" commits the message fact and
//! its outbox record together (S3); "fan out these outbox items" commits the
//! user events, the per-user head and the projections together (F2, R3);
//! "ACK" is a compare-and-set decided by `tidemark_core::cursor::decide_ack`
//! inside the backend's transaction (D4). Backends must group-commit
//! concurrent calls (many requests, one transaction, one fsync) and must
//! serialise `msg_seq` assignment per conversation so that `n+1` never
//! becomes visible before `n` (S2).
//!
//! Errors are neutral kinds ([`StoreError`]); the gateway maps them to wire
//! codes. This crate knows nothing about serde, sockets or a particular
//! database.

#[cfg(feature = "conformance")]
pub mod conformance;

use async_trait::async_trait;
use tidemark_core::cursor::{AckDecision, DeviceCursor};
use tidemark_core::{MsgSeq, SyncSeq};

pub type StoreResult<T> = Result<T, StoreError>;

/// Neutral error kinds of every backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("not a member of this conversation")]
    NotMember,
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("conflict: {0}")]
    Conflict(String),
    /// Temporary: the caller may retry with backoff.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// A broken invariant or backend bug.
    #[error("internal: {0}")]
    Internal(String),
}

/// A device and its sync cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRecord {
    pub user: String,
    pub device: String,
    pub name: String,
    pub cursor: DeviceCursor,
}

/// A live refresh token, looked up by the hash of its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefreshRecord {
    pub user: String,
    pub device: String,
    pub expires_at_ms: i64,
}

/// Conversation kinds.
pub const CONV_DIRECT: &str = "direct";
pub const CONV_GROUP: &str = "group";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversation {
    pub conv: String,
    pub kind: String,
    /// Users with an open membership period.
    pub members: Vec<String>,
    /// Highest committed `msg_seq`.
    pub head: MsgSeq,
}

/// One send, as accepted by the gateway (identity from the token only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendCmd {
    pub sender: String,
    pub sender_device: String,
    pub conv: String,
    pub client_msg_id: String,
    pub kind: String,
    /// Serialized JSON, already size-checked.
    pub content: String,
    /// Used only if this `(sender, client_msg_id)` is new.
    pub message_id: String,
    pub now_ms: i64,
}

/// The outcome of a send: the message fact as committed (S1, S4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub message_id: String,
    pub conv: String,
    pub msg_seq: MsgSeq,
    pub created_at_ms: i64,
    /// The `(sender, client_msg_id)` had been accepted before: this is the
    /// original message, nothing new was written.
    pub duplicate: bool,
}

/// A committed conversation event waiting for fan-out (F1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxItem {
    pub outbox_id: i64,
    /// The user event kind it becomes (`message` for a message).
    pub kind: String,
    /// The id of the fact that caused it (the message id for a message).
    pub source_event_id: String,
    pub conv: String,
    pub msg_seq: MsgSeq,
    /// The sender, who does not get an unread for their own message.
    pub actor: String,
    pub created_at_ms: i64,
}

/// What one fan-out transaction did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FanoutReport {
    /// Users whose sync log grew, with their new committed high watermark.
    pub users: Vec<(String, SyncSeq)>,
    pub events_written: u64,
    /// Recipients already holding the event (a re-delivered outbox item).
    pub duplicates_skipped: u64,
    /// Users hit by two membership periods of one message (F4).
    pub quarantined: u64,
    pub items_done: u64,
}

/// A committed message as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub message_id: String,
    pub conv: String,
    pub msg_seq: MsgSeq,
    pub kind: String,
    pub state: String,
    pub sender: String,
    /// Serialized JSON.
    pub content: String,
    pub created_at_ms: i64,
}

/// One entry of a user's sync log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub sync_seq: SyncSeq,
    pub kind: String,
    pub conv: String,
    pub msg_seq: Option<MsgSeq>,
    pub message: Option<StoredMessage>,
}

/// Event kinds of the user sync log.
pub const EVENT_MESSAGE: &str = "message";

/// One row of a user's conversation list (projection kept by fan-out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvState {
    pub conv: String,
    pub kind: String,
    pub last_msg_seq: MsgSeq,
    pub read_seq: MsgSeq,
    pub unread: u64,
}

/// The result of an ACK: the decision taken inside the backend's
/// transaction and the cursor after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckResult {
    pub decision: AckDecision,
    pub cursor: DeviceCursor,
}

/// Backlog of the outbox, for metrics and health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutboxStats {
    pub backlog: u64,
    pub oldest_created_at_ms: Option<i64>,
}

/// Counters a backend keeps about its own durability work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Write transactions committed (each is one WAL fsync for SQLite).
    pub commits: u64,
    /// Requests carried by those transactions.
    pub writes: u64,
    /// WAL checkpoints run (each is two fsyncs: WAL and database file).
    pub checkpoints: u64,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    // ------------------------------------------------ secrets and accounts

    /// The server secret for token keys, created on first use and shared by
    /// every node on the same database.
    async fn server_secret(&self) -> StoreResult<Vec<u8>>;

    /// Creates a user; `Ok(false)` if the name is taken (nothing changes).
    async fn create_user(&self, user: &str, password_hash: &str, now_ms: i64) -> StoreResult<bool>;

    async fn password_hash(&self, user: &str) -> StoreResult<Option<String>>;

    /// Registers the device on login (state `NEW` if it is new) and returns
    /// it; a revoked device comes back with state `REVOKED`.
    async fn login_device(&self, user: &str, device: &str, name: &str, now_ms: i64) -> StoreResult<DeviceRecord>;

    async fn device(&self, user: &str, device: &str) -> StoreResult<Option<DeviceRecord>>;

    /// Revokes the device and every refresh token of it; `Ok(false)` if it
    /// was already revoked. `NotFound` if the user has no such device.
    async fn revoke_device(&self, user: &str, device: &str, now_ms: i64) -> StoreResult<bool>;

    /// Every revoked `(user, device)`, for the gateway's in-memory fence.
    async fn revoked_devices(&self) -> StoreResult<Vec<(String, String)>>;

    async fn put_refresh_token(&self, token_hash: &str, rec: &RefreshRecord) -> StoreResult<()>;

    /// Removes and returns a refresh token (rotation: each is used once).
    async fn take_refresh_token(&self, token_hash: &str) -> StoreResult<Option<RefreshRecord>>;

    // ------------------------------------------------------- conversations

    /// The single direct conversation of a pair, created if absent; the
    /// boolean says whether it was created by this call.
    async fn create_direct(&self, a: &str, b: &str, conv_id: &str, now_ms: i64) -> StoreResult<(String, bool)>;

    async fn conversation(&self, conv: &str) -> StoreResult<Option<Conversation>>;

    /// The user's conversation list with its projections.
    async fn list_conversations(&self, user: &str) -> StoreResult<Vec<ConvState>>;

    // ---------------------------------------------------------------- send

    /// Accepts one send: idempotency on `(sender, client_msg_id)`, a
    /// membership check at the conversation's linearisation point, the next
    /// contiguous `msg_seq`, the message fact and its outbox record, all in
    /// one committed transaction before this returns (S1–S3).
    async fn accept_send(&self, cmd: SendCmd) -> StoreResult<Accepted>;

    // ------------------------------------------------------------- fan-out

    /// Up to `limit` outbox items in commit order.
    async fn pending_outbox(&self, limit: u32) -> StoreResult<Vec<OutboxItem>>;

    async fn outbox_stats(&self) -> StoreResult<OutboxStats>;

    /// Fans the items out in one transaction: recipients from the periods
    /// covering each `msg_seq` (F4), one user event per recipient with the
    /// next `sync_seq`, idempotent on `(user, source_event_id, period)` (F3),
    /// the user head and projections, and the outbox rows marked done.
    async fn fan_out(&self, items: Vec<OutboxItem>, now_ms: i64) -> StoreResult<FanoutReport>;

    // ---------------------------------------------------------------- sync

    /// The user's committed sync high watermark (0 if the log is empty).
    async fn user_high_watermark(&self, user: &str) -> StoreResult<SyncSeq>;

    /// Events with `after < sync_seq <= upto`, ascending, at most `limit`.
    async fn read_user_events(
        &self,
        user: &str,
        after: SyncSeq,
        upto: SyncSeq,
        limit: u32,
    ) -> StoreResult<Vec<StoredEvent>>;

    /// Replaces the device cursor with `new` only if it still equals
    /// `expected`; returns the cursor after the call.
    async fn cas_device_cursor(
        &self,
        user: &str,
        device: &str,
        expected: DeviceCursor,
        new: DeviceCursor,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)>;

    /// A cumulative ACK: `decide_ack` applied inside one transaction.
    async fn ack(&self, user: &str, device: &str, generation: u64, seq: SyncSeq, now_ms: i64)
        -> StoreResult<AckResult>;

    // -------------------------------------------------------- observability

    fn stats(&self) -> StoreStats;
}
