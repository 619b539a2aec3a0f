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
pub mod metric_names;
pub mod reconcile;

use async_trait::async_trait;
pub use tidemark_core::control::ControlOutcome;
use tidemark_core::cursor::{AckDecision, DeviceCursor};
pub use tidemark_core::ephemeral::{MemberRead, Privacy, PrivacyUpdate, Receipts};
pub use tidemark_core::kinds::*;
pub use tidemark_core::large::{GroupPolicy, Marker};
pub use tidemark_core::membership::{MembersPage, MembershipChange};
pub use tidemark_core::projection::SettingsUpdate;
pub use tidemark_core::push::Preview;
use tidemark_core::{MsgSeq, Refusal, SyncSeq};

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
    /// The caller may not do this (not the owner, not the sender…).
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// `conv.sync` with `after` above the conversation head (C2).
    #[error("cursor ahead of head {0}")]
    CursorAhead(MsgSeq),
    /// `conv.sync` with another epoch than the conversation's (C2).
    #[error("conversation epoch is now {0}")]
    EpochChanged(u64),
    /// A stale `base_version` (E2); carries the current version.
    #[error("version is now {0}")]
    VersionConflict(u64),
    /// Opening a database whose recorded schema version (`found`) is newer
    /// than the last migration this build knows (`known`): a newer build
    /// migrated it, and this one must not write to it.
    #[error("database schema version {found} is newer than this build knows ({known})")]
    SchemaTooNew { found: i64, known: i64 },
    /// A frame of a WebSocket connection older than the device's newest
    /// (`tidemark_core::session::frame_superseded`, P2): refused by the
    /// statement that reads the device row, before anything changed. The
    /// newest epoch is carried.
    #[error("superseded by connection epoch {0}")]
    Superseded(u64),
}

impl From<Refusal> for StoreError {
    fn from(r: Refusal) -> StoreError {
        match r {
            Refusal::NotFound(m) => StoreError::NotFound(m),
            Refusal::NotMember => StoreError::NotMember,
            Refusal::Invalid(m) => StoreError::Invalid(m),
            Refusal::Forbidden(m) => StoreError::Forbidden(m),
            Refusal::Conflict(m) => StoreError::Conflict(m),
            Refusal::VersionConflict(v) => StoreError::VersionConflict(v),
        }
    }
}

/// A device and its sync cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRecord {
    pub user: String,
    pub device: String,
    pub name: String,
    pub cursor: DeviceCursor,
}

/// A refresh token, looked up by the hash of its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefreshRecord {
    pub user: String,
    pub device: String,
    pub expires_at_ms: i64,
    /// The chain of rotations it belongs to, started by one login
    /// (`tidemark_core::refresh`).
    pub family: String,
}

/// What [`Store::use_refresh_token`] did, as `tidemark_core::refresh::decide`
/// decided it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefreshUse {
    /// No such token; nothing changed.
    Unknown,
    /// It had expired; it is deleted.
    Expired(RefreshRecord),
    /// It was live; it is now used, and its successor may be stored.
    Rotated(RefreshRecord),
    /// It had been used already: every token of its family is deleted.
    FamilyRevoked(RefreshRecord),
}

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
    /// A quoted message of the same conversation (`content.quote`).
    pub quote_id: Option<String>,
    /// The users it mentions, as `tidemark_core::mention::normalize` left
    /// them (issue 18), stored with the message.
    pub mentions: Vec<String>,
    /// It mentions everyone: checked by `mention::check_mention_all` at
    /// the conversation's linearisation point, stored with the message.
    pub mention_all: bool,
    /// The epoch of the WebSocket connection it came on; `None` over HTTP
    /// (no connection: any epoch). A send of an older connection than the
    /// device's newest is refused `Superseded` (P2).
    pub connection_epoch: Option<u64>,
    pub now_ms: i64,
}

impl SendCmd {
    /// The send accepted at `msg_seq` (a new message, not a retry).
    pub fn accepted(&self, msg_seq: MsgSeq) -> Accepted {
        Accepted {
            message_id: self.message_id.clone(),
            conv: self.conv.clone(),
            msg_seq,
            created_at_ms: self.now_ms,
            duplicate: false,
        }
    }

    /// The send as the conversation event it becomes.
    pub fn as_event(&self) -> ConvEventCmd {
        ConvEventCmd {
            conv: self.conv.clone(),
            actor: self.sender.clone(),
            actor_device: self.sender_device.clone(),
            event_id: self.message_id.clone(),
            client_msg_id: self.client_msg_id.clone(),
            now_ms: self.now_ms,
        }
    }
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
    /// Shared groups whose marker this batch published (G2), once each.
    pub convs: Vec<ConvMoved>,
    /// Each item fanned out, in outbox order: what the metrics and the
    /// trace of seed §18.1–18.2 need, gathered from facts the fan-out read
    /// anyway (no statement added).
    pub items: Vec<FannedOut>,
}

/// What fan-out did with one outbox item.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FannedOut {
    pub source_event_id: String,
    /// `tidemark_core::large::fanout_class`: direct, group or large.
    pub class: &'static str,
    /// The recipients resolved from the membership periods (the item's
    /// amplification), redeliveries included.
    pub recipients: u64,
    /// `tidemark_core::large::period_miss`: no period covers the item.
    pub period_miss: bool,
    /// The user events written, each `(user, sync_seq)`.
    pub deliveries: Vec<(String, SyncSeq)>,
}

/// What one [`Store::fan_out_next`] (or one fused fan-out,
/// [`Store::fuse_fanout`]) claimed and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimedFanout {
    /// The outbox items claimed and fanned out, in outbox order.
    pub items: Vec<OutboxItem>,
    pub report: FanoutReport,
}

/// What rendering a page of messages for one reader needs besides the
/// messages, read by a backend in a few batched queries: the ids the reader
/// deleted for itself, the state of every quoted message, the reactions.
#[derive(Debug, Default)]
pub struct Decorations {
    pub deleted: std::collections::HashSet<String>,
    pub quote_states: std::collections::HashMap<String, String>,
    reactions: std::collections::HashMap<String, Vec<(String, Vec<String>)>>,
}

impl Decorations {
    /// One reaction row; rows come ordered by (message, reaction, user).
    pub fn add_reaction(&mut self, message_id: String, reaction: String, user: String) {
        let list = self.reactions.entry(message_id).or_default();
        match list.last_mut() {
            Some((last, users)) if *last == reaction => users.push(user),
            _ => list.push((reaction, vec![user])),
        }
    }

    /// Renders `msgs` (each with its quoted message id) for the reader:
    /// deleted-for-me becomes a placeholder, a quote says whether its target
    /// was recalled, reactions are attached. A wiped message (recalled, or
    /// deleted for this reader) shows neither its quote nor its reactions.
    pub fn apply(mut self, msgs: &mut [(StoredMessage, Option<String>)]) {
        for (m, quote_id) in msgs.iter_mut() {
            if self.deleted.contains(&m.message_id) {
                m.state = STATE_DELETED.into();
                m.content = "{}".into();
            }
            let wiped = m.state == STATE_DELETED || m.state == STATE_RECALLED;
            if let Some(q) = quote_id.take().filter(|_| !wiped) {
                let recalled = self.quote_states.get(&q).map(String::as_str) == Some(STATE_RECALLED);
                m.quote = Some((q, recalled));
            }
            if !wiped {
                m.reactions = self.reactions.remove(&m.message_id).unwrap_or_default();
            }
        }
    }
}

/// A committed message as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub message_id: String,
    pub conv: String,
    pub msg_seq: MsgSeq,
    pub kind: String,
    /// `normal`, `edited`, `recalled` (content wiped), or `deleted` (the
    /// reader deleted it for themselves).
    pub state: String,
    pub sender: String,
    /// Serialized JSON; `{}` once recalled or deleted for the reader.
    pub content: String,
    pub created_at_ms: i64,
    /// Bumped by every edit, reaction and recall (E2).
    pub version: u64,
    /// The quoted message and whether it was recalled since.
    pub quote: Option<(String, bool)>,
    /// Reactions: `(reaction, users)`, sorted.
    pub reactions: Vec<(String, Vec<String>)>,
    /// The users it mentions and whether it mentions everyone (issue 18).
    pub mentions: Vec<String>,
    pub mention_all: bool,
}

/// One entry of a user's sync log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub sync_seq: SyncSeq,
    pub kind: String,
    pub conv: String,
    pub msg_seq: Option<MsgSeq>,
    pub message: Option<StoredMessage>,
    /// Per-user events carry their payload as serialized JSON.
    pub data: Option<String>,
}

/// The delivery scope of per-user events (read, settings, delete): not a
/// membership period, but a stable non-null id so the idempotency key
/// `(user, source_event_id, period_id)` holds for them too.
pub const USER_SCOPE_PERIOD: i64 = 0;

/// One row of a user's conversation list (projection kept by fan-out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvState {
    pub conv: String,
    pub kind: String,
    pub last_msg_seq: MsgSeq,
    pub read_seq: MsgSeq,
    pub unread: u64,
    /// Unread messages mentioning the user (issue 18), kept like `unread`.
    pub mentions: u64,
    pub muted: bool,
    pub pinned: bool,
    /// The user's push preview preference of the conversation (P4).
    pub push_preview: Preview,
    /// False once the user left or was removed.
    pub active: bool,
    /// `per_member` or `shared` (G2); a direct conversation is per member.
    pub mode: String,
    /// Shared mode: the member's marker, `dirty` for the asking device
    /// (`None` asks for no device: dirty while anything is published).
    /// `last_msg_seq` is then the marker's target.
    pub marker: Option<Marker>,
    /// Shared mode: `unread` reached `large::UNREAD_COUNT_MAX` and reads as
    /// it (counted exactly below it).
    pub unread_capped: bool,
}

impl ConvState {
    /// The row of a shared group (G2, R3): its marker, `last_msg_seq` at
    /// the marker's target, `unread` the projection's count up to the
    /// switch plus `counted` from the log above it
    /// (`large::unread_window`), capped by `large::shared_unread`; the
    /// mentions likewise, `mentioned` of them counted in the same window.
    pub fn shared(mut self, marker: Marker, counted: u64, mentioned: u64) -> ConvState {
        let (unread, capped) = tidemark_core::large::shared_unread(self.unread + counted);
        self.last_msg_seq = self.last_msg_seq.max(marker.target);
        self.unread = unread;
        self.mentions = tidemark_core::large::shared_unread(self.mentions + mentioned).0;
        self.unread_capped = capped;
        self.marker = Some(marker);
        self
    }
}

/// A shared group that moved in one fan-out batch: its published marker
/// and the `msg_seq` of its last membership change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvMoved {
    pub conv: String,
    pub target: MsgSeq,
    pub version: u64,
    pub members_seq: MsgSeq,
}

/// The marker of one shared group for one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMarker {
    pub conv: String,
    pub marker: Marker,
}

/// A conversation event written by the conversation's writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvEventCmd {
    pub conv: String,
    pub actor: String,
    pub actor_device: String,
    /// The new event's id.
    pub event_id: String,
    /// Idempotency key of the event (same table as sends).
    pub client_msg_id: String,
    pub now_ms: i64,
}

/// A per-user event written straight into the user's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserEventOutcome {
    /// The user's new high watermark if an event was written.
    pub written: Option<SyncSeq>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOutcome {
    pub read_seq: MsgSeq,
    pub unread: u64,
    /// Mentions left above `read_seq` (issue 18).
    pub mentions: u64,
    pub written: Option<SyncSeq>,
}

/// One page of `conv.sync`, read from one snapshot (C1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvSyncPage {
    pub epoch: u64,
    pub min_seq: MsgSeq,
    pub head: MsgSeq,
    pub next_after: MsgSeq,
    pub has_more: bool,
    pub trimmed: bool,
    pub events: Vec<StoredMessage>,
}

/// One page of `history`, newest first (C3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryPage {
    pub messages: Vec<StoredMessage>,
    pub next_cursor: Option<MsgSeq>,
    pub has_more: bool,
    /// The lowest `msg_seq` still retained (L3).
    pub history_start: MsgSeq,
    /// The page ends at the retention boundary, not at the start of the
    /// reader's view: older history existed and was removed (L3).
    pub trimmed: bool,
}

/// What one row's recount found: `(unread, mentions)` stored before it
/// and after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recounted {
    pub before: (u64, u64),
    pub after: (u64, u64),
}

impl Recounted {
    /// The recount changed a count.
    pub fn changed(&self) -> bool {
        self.before != self.after
    }
}

/// What an unread rebuild found (R3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UnreadRebuild {
    pub rows_checked: u64,
    /// Rows whose materialised count differed from the facts (now fixed).
    pub drifted: u64,
}

/// A reconciliation window over the conversation side: the messages
/// after `(conv, msg_seq)` in `(conv_id, msg_seq)` order (O3).
pub type MessageCursor = Option<(String, MsgSeq)>;

/// One chunk of the conversation side, read in one snapshot
/// ([`Store::reconcile_messages`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MessageChunk {
    pub messages: Vec<tidemark_core::reconcile::MessageFacts>,
    /// Head and highest message of each conversation this chunk entered.
    pub convs: Vec<tidemark_core::reconcile::ConvFacts>,
    /// Where the next chunk starts; `None` after the last.
    pub next: MessageCursor,
}

/// One chunk of the user side ([`Store::reconcile_users`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserChunk {
    pub users: Vec<tidemark_core::reconcile::UserFacts>,
    /// The last user of this chunk, where the next starts; `None` after
    /// the last.
    pub next: Option<String>,
}

/// One stored quarantine record (F4): a fan-out item that hit two
/// membership periods of one user, never delivered to that user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantineRecord {
    pub source_event_id: String,
    pub user: String,
    pub conv: String,
    pub msg_seq: MsgSeq,
    pub reason: String,
    pub created_at_ms: i64,
}

/// One sync page and what it was decided from, read in one snapshot
/// ([`Store::sync_page`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncRead {
    pub facts: tidemark_core::page::SyncFacts,
    /// `tidemark_core::page::decide_page` on `facts`.
    pub decision: tidemark_core::page::PageDecision,
    /// The events of `decision.range(&facts)` (empty when it names none),
    /// ascending, at most the `limit` asked for.
    pub events: Vec<StoredEvent>,
    /// Whether the user had a conversation in shared mode (G2) in the same
    /// snapshot: only then can the page that ends a batch have dirty
    /// markers to read ([`Store::dirty_markers`]). A group that becomes
    /// shared later does so in a transaction whose events reach the user's
    /// log above this page's head, so a later batch sees the flag.
    pub shared_groups: bool,
}

/// What opening a WebSocket connection committed and read
/// ([`Store::open_connection`]), from one statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenedConnection {
    /// The device's new connection epoch (P2).
    pub connection_epoch: u64,
    /// The device's committed ACK (D8: what the re-hint sweep measures).
    pub acked_sync_seq: SyncSeq,
    /// The user's committed log head.
    pub high_watermark: SyncSeq,
}

/// The result of an ACK: the decision taken inside the backend's
/// transaction and the cursor after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckResult {
    pub decision: AckDecision,
    pub cursor: DeviceCursor,
}

/// One conversation of a snapshot: the user's view of it at the base.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotConv {
    /// `last_msg_seq` is the highest event of this conversation in the
    /// user's log at or below the base.
    pub state: ConvState,
    /// The most recent messages delivered at or below the base, ascending.
    pub messages: Vec<StoredMessage>,
}

/// What a snapshot view read sends, in order: the log it was read at
/// (its head is the base), the user's privacy switches, then the conversations in `conv.list` order, at
/// most [`SNAPSHOT_CONVS_PER_CHUNK`] (or the caller's chunk) at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotViewPart {
    Base(tidemark_core::cursor::UserLog),
    /// The user's privacy switches at the base and their version (0: never
    /// changed), right after the base (issue 18).
    Privacy {
        privacy: Privacy,
        version: u64,
    },
    Convs(Vec<SnapshotConv>),
}

/// Conversations (each with its latest messages) one chunk of a snapshot
/// view carries; the builder writes each page of items as its own writer
/// request, so a snapshot build never holds the writer for more than one
/// page (issue 16 item 5), whatever the number of conversations.
pub const SNAPSHOT_CONVS_PER_CHUNK: usize = 50;

/// Chunks of a snapshot view read ahead of the writer requests storing
/// them: the bound on what a build holds in memory.
pub const SNAPSHOT_CHUNKS_IN_FLIGHT: usize = 2;

/// A snapshot's durable record (D7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotMeta {
    pub snapshot_id: String,
    pub user: String,
    pub device: String,
    pub generation: u64,
    pub base_sync_seq: SyncSeq,
    /// `BUILDING`, `READY` (immutable), `INSTALLED` or `EXPIRED`.
    pub state: String,
    pub manifest_digest: String,
    pub pages: u32,
    pub expires_at_ms: i64,
}

impl SnapshotMeta {
    /// The record as the snapshot rules (`tidemark_core::snapshot`) see it.
    pub fn facts(&self) -> tidemark_core::snapshot::Snapshot<'_> {
        tidemark_core::snapshot::Snapshot {
            user: &self.user,
            device: &self.device,
            generation: self.generation,
            base_sync_seq: self.base_sync_seq,
            state: &self.state,
            pages: self.pages,
            expires_at_ms: self.expires_at_ms,
        }
    }
}

/// What one retention pass did (L1).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrimReport {
    pub users_trimmed: u64,
    pub events_deleted: u64,
    pub snapshots_expired: u64,
    /// Conversations whose history boundary (`min_seq`) moved (L3).
    pub conversations_trimmed: u64,
    /// Messages whose content expired (tombstones of recalls stay).
    pub messages_expired: u64,
}

impl TrimReport {
    fn add(&mut self, o: &TrimReport) {
        self.users_trimmed += o.users_trimmed;
        self.events_deleted += o.events_deleted;
        self.snapshots_expired += o.snapshots_expired;
        self.conversations_trimmed += o.conversations_trimmed;
        self.messages_expired += o.messages_expired;
    }
}

/// Users one retention step reads (one writer request each), so other
/// writes interleave between steps.
pub const RETENTION_USERS_PER_CHUNK: u32 = 200;
/// User-log events one retention step deletes at most; a user with more
/// to trim is trimmed over several steps (`trimmed_upto` moves with each).
pub const RETENTION_EVENTS_PER_CHUNK: u64 = 20_000;
/// Conversations one history-retention step reads (L3).
pub const RETENTION_CONVS_PER_CHUNK: u32 = 200;

/// One bounded step of the retention pass ([`Store::trim_step`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrimStep {
    /// Expire the snapshots past their lifetime and drop their pages.
    Snapshots,
    /// History retention (L3) of the conversations after `after`.
    History { after: String },
    /// Log trimming (L1) of the users after `after`.
    Users { after: String },
}

/// Retention settings (L1–L2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Events younger than this are kept whatever the fence.
    pub keep_events_younger_than_ms: i64,
    /// A device whose cursor did not move for this long stops holding the
    /// fence; on return it is reset (L2).
    pub device_inactive_after_ms: i64,
    /// Message history older than this expires (L3): the conversation's
    /// `min_seq` moves up, contents below it are removed, recall tombstones
    /// stay; `None` keeps history forever.
    pub history_keep_ms: Option<i64>,
}

/// Backlog of the outbox, for metrics and health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutboxStats {
    pub backlog: u64,
    pub oldest_created_at_ms: Option<i64>,
}

/// What `/metrics` samples from the store at scrape time (seed §18.1), in
/// one read: aggregates over whole tables, never per request, never per
/// user (a scrape pays one statement whatever the traffic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreGauges {
    pub outbox: OutboxStats,
    /// The highest committed high watermark of any user's log.
    pub user_high_watermark_max: SyncSeq,
    /// The longest retained user log: `head - trimmed_upto`, in events.
    pub retained_events_max: u64,
    /// The cursor furthest behind its user's head, over devices not
    /// revoked (`head - acked_sync_seq`, in events): what the lowest
    /// retained cursor holds back, whether its device is online or not.
    pub cursor_lag_events_max: u64,
    /// Devices not revoked whose ACK is below their user's trim point:
    /// their next sync resets them (L2).
    pub devices_below_trim: u64,
    /// Recovery sessions (D6) still live at `now_ms`, and when the oldest
    /// of them opened.
    pub recovery_sessions: u64,
    pub recovery_oldest_created_at_ms: Option<i64>,
    /// Snapshots (D7) building or ready, not installed and not expired at
    /// `now_ms`: devices rebuilding; and when the oldest was started.
    pub snapshot_sessions: u64,
    pub snapshot_oldest_created_at_ms: Option<i64>,
    /// Push targets (P4) of devices not revoked whose user's log holds
    /// events above `max(acked, pushed_through)`: devices the push worker
    /// still owes a look (a notification, a wait, or settling events that
    /// do not count), not notifications.
    pub push_targets_owing: u64,
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
    /// SQL statements the backend's connections ran, reads and writes,
    /// including `BEGIN`/`COMMIT` and pragmas. The counter is per process
    /// (every store of the same backend in one process adds to it), which
    /// is what `/metrics` and the benchmarks want: one server, one store.
    pub statements: u64,
    /// Of those, statements run on read connections, where the backend
    /// tells them apart (SQLite's read pool); `None` otherwise.
    pub read_statements: Option<u64>,
}

/// Whether the backend can take writes now, for `/healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoreHealth {
    /// Why writes cannot commit: the writer's last transaction could not
    /// begin or commit (a full disk, an I/O error, a lost database) and none
    /// has committed since, or the writer stopped. `None` while writes
    /// commit.
    pub write_failure: Option<String>,
}

/// Why the writer's last transaction could not begin or commit, until one
/// commits: what a backend's writer records and [`StoreHealth`] reports.
#[derive(Debug, Default)]
pub struct WriteFailure(std::sync::Mutex<Option<String>>);

impl WriteFailure {
    /// Records the outcome of one transaction (`None`: it committed).
    pub fn set(&self, why: Option<String>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = why;
    }

    pub fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
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

    /// Stores a live refresh token, and forgets the device's tokens (live
    /// or used) that expired by `rec`'s issue (`now_ms`).
    async fn put_refresh_token(&self, token_hash: &str, rec: &RefreshRecord, now_ms: i64) -> StoreResult<()>;

    // ------------------------------------------------------- conversations

    /// The single direct conversation of a pair, created if absent; the
    /// boolean says whether it was created by this call.
    async fn create_direct(&self, a: &str, b: &str, conv_id: &str, now_ms: i64) -> StoreResult<(String, bool)>;

    async fn conversation(&self, conv: &str) -> StoreResult<Option<Conversation>>;

    /// The user's conversation list with its projections; the markers of
    /// shared groups are evaluated for `device` (G2).
    async fn list_conversations(&self, user: &str, device: Option<&str>) -> StoreResult<Vec<ConvState>>;

    /// One page of the user's conversations: up to `limit` of them whose
    /// `conv` is above `after` (`""`: from the first), in `conv` order (the
    /// key, so paging under writes never skips or repeats a conversation),
    /// each as [`Store::list_conversations`] has it, read in one snapshot.
    async fn conversations_after(
        &self,
        user: &str,
        device: Option<&str>,
        after: &str,
        limit: u32,
    ) -> StoreResult<Vec<ConvState>>;

    /// Creates a group: `conv.created` at `msg_seq` 1 and a membership
    /// period from 1 for the creator and each member. A retry with the same
    /// `client_msg_id` returns the group the first attempt created.
    async fn create_group(&self, cmd: ConvEventCmd, members: Vec<String>) -> StoreResult<(String, MsgSeq)>;

    /// Adds, removes or lets a member leave, as a conversation event whose
    /// `msg_seq` opens (`join_seq`) or closes (`leave_seq`, inclusive) the
    /// target's membership period.
    async fn change_membership(&self, cmd: ConvEventCmd, target: &str, change: MembershipChange)
        -> StoreResult<MsgSeq>;

    /// Bumps a conversation's epoch (after any operation that rewrote its
    /// log); returns the new epoch.
    async fn bump_epoch(&self, conv: &str) -> StoreResult<u64>;

    /// Recalls a message (E1): a new `recall` event; the target keeps its
    /// `msg_seq` but its content is wiped for good.
    async fn recall(&self, cmd: ConvEventCmd, message_id: &str) -> StoreResult<ControlOutcome>;

    /// Edits a message if `base_version` is current (E2).
    async fn edit(
        &self,
        cmd: ConvEventCmd,
        message_id: &str,
        content: &str,
        base_version: u64,
    ) -> StoreResult<ControlOutcome>;

    /// Adds or removes a reaction (E2).
    async fn react(
        &self,
        cmd: ConvEventCmd,
        message_id: &str,
        reaction: &str,
        add: bool,
    ) -> StoreResult<ControlOutcome>;

    /// Moves the user's read cursor to `read_to_seq` (never back), recounts
    /// unread from the user's own log, and writes a `read` user event (R1–R3).
    /// This is [`Store::mark_read_on`] from no connection (HTTP).
    async fn mark_read(&self, user: &str, conv: &str, read_to_seq: MsgSeq, now_ms: i64) -> StoreResult<ReadOutcome> {
        self.mark_read_on(user, conv, read_to_seq, None, now_ms).await
    }

    /// [`Store::mark_read`] from a WebSocket connection, `on` = (device,
    /// connection epoch); `None` over HTTP (any epoch). Refused
    /// `Superseded`, with nothing changed, when the device has a newer
    /// connection (P2).
    async fn mark_read_on(
        &self,
        user: &str,
        conv: &str,
        read_to_seq: MsgSeq,
        on: Option<(&str, u64)>,
        now_ms: i64,
    ) -> StoreResult<ReadOutcome>;

    /// Per-user conversation settings (E3): mute, pin and the push preview
    /// preference (`tidemark_core::projection::settings_after` decides).
    async fn update_settings(
        &self,
        user: &str,
        conv: &str,
        update: SettingsUpdate,
        now_ms: i64,
    ) -> StoreResult<(ConvState, UserEventOutcome)>;

    /// Deletes a message for this user only (E3).
    async fn delete_for_me(
        &self,
        user: &str,
        conv: &str,
        message_id: &str,
        now_ms: i64,
    ) -> StoreResult<UserEventOutcome>;

    /// Records per-device delivery of messages the user may see (R1);
    /// returns how many were new.
    async fn record_delivery(
        &self,
        user: &str,
        device: &str,
        message_ids: Vec<String>,
        now_ms: i64,
    ) -> StoreResult<u64>;

    // ------------------------------------------------------ reconciliation

    /// Reads, in one snapshot and without the writer, the facts of up to
    /// `limit` messages after `after` in `(conv_id, msg_seq)` order (O3,
    /// `core::reconcile::check_message`): pending outbox items, recipients
    /// as the fan-out resolves them, the recipients whose log lacks the
    /// event (leaving out a log trimmed past it or a deleted user's),
    /// quarantine records; and head and highest message of each
    /// conversation the chunk enters.
    async fn reconcile_messages(&self, after: MessageCursor, limit: u32) -> StoreResult<MessageChunk>;

    /// Reads, in one snapshot and without the writer, the facts of up to
    /// `limit` users after `after` in `user_id` order
    /// (`core::reconcile::check_user`): head, ACKs of devices not revoked,
    /// each conversation row's unread and its recount, and the events
    /// whose message or period is not there.
    async fn reconcile_users(&self, after: Option<String>, limit: u32) -> StoreResult<UserChunk>;

    /// Repair: puts a message's outbox item back, as its acceptance wrote
    /// it, unless one is pending; `false` when nothing was written. The
    /// fan-out then writes only what the logs lack (F3).
    async fn requeue_fanout(&self, conv: &str, message_id: &str, now_ms: i64) -> StoreResult<bool>;

    /// Repair: recounts one row's unread and mention count from the facts
    /// (R3, issue 18) in one writer request; what was stored before and
    /// what is now, `None` without the row.
    async fn recount_unread(&self, user: &str, conv: &str) -> StoreResult<Option<Recounted>>;

    /// Up to `limit` quarantine records after `(source_event_id, user)`,
    /// in that order: the report for a person (F4).
    async fn quarantine(&self, after: Option<(String, String)>, limit: u32) -> StoreResult<Vec<QuarantineRecord>>;

    /// `conv.sync` for `user` (C1–C2), limited to the user's periods.
    async fn conv_sync(
        &self,
        user: &str,
        conv: &str,
        after: MsgSeq,
        limit: u32,
        epoch: Option<u64>,
    ) -> StoreResult<ConvSyncPage>;

    /// `history` for `user` (C3), newest first below `before_seq`, limited to
    /// the user's periods.
    async fn history(&self, user: &str, conv: &str, before_seq: Option<MsgSeq>, limit: u32)
        -> StoreResult<HistoryPage>;

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

    /// The gauges `/metrics` samples at scrape time ([`StoreGauges`]), in
    /// one read statement; sessions count as live while `expires_at > now_ms`.
    async fn gauges(&self, now_ms: i64) -> StoreResult<StoreGauges>;

    /// Fans the items out in one transaction: recipients from the periods
    /// covering each `msg_seq` (F4), one user event per recipient with the
    /// next `sync_seq`, idempotent on `(user, source_event_id, period)` (F3),
    /// the user head and projections, and the outbox rows marked done.
    async fn fan_out(&self, items: Vec<OutboxItem>, now_ms: i64) -> StoreResult<FanoutReport>;

    /// Claims up to `limit` pending outbox items, oldest first, and fans
    /// them out ([`Store::fan_out`]) in the same transaction; returns what
    /// it claimed (empty when nothing was pending) and the report. This is
    /// the relay's entry point: with several relays on one database, each
    /// item is claimed by one of them at a time (a backend with several
    /// writers must lock what it claims until its commit, so concurrent
    /// relays split the work instead of repeating it), and one conversation's
    /// items are never fanned out by two relays at once, so they reach every
    /// log in `msg_seq` order. A claim that does not commit (a crash) leaves
    /// its items pending for the next claim.
    async fn fan_out_next(&self, limit: u32, now_ms: i64) -> StoreResult<ClaimedFanout>;

    /// Fuses the fan-out with the accept (issue 19), for a backend whose
    /// single writer can fan out in the transaction of the writes that fed
    /// the outbox: from this call until the receiver is dropped, a write
    /// transaction that appended to the outbox also claims and fans out up
    /// to `limit` pending items, oldest first, exactly as
    /// [`Store::fan_out_next`] would, as far as
    /// `tidemark_core::fuse::admits` allows, and sends each such claim here
    /// once its transaction committed. A fused fan-out that fails rolls
    /// back alone: the writes commit and the items stay for the relay. A
    /// later call replaces the receiver. `None` (the default): the backend
    /// does not fuse and the relay's own claims are the only fan-outs.
    fn fuse_fanout(&self, _limit: u32) -> Option<tokio::sync::mpsc::UnboundedReceiver<ClaimedFanout>> {
        None
    }

    // ---------------------------------------------------------------- sync

    /// The user's committed sync high watermark (0 if the log is empty).
    async fn user_high_watermark(&self, user: &str) -> StoreResult<SyncSeq>;

    /// The user's head and trim point (D5, L1).
    async fn user_log(&self, user: &str) -> StoreResult<tidemark_core::cursor::UserLog>;

    /// Reads the user's snapshot view in one read snapshot, without the
    /// writer: first [`SnapshotViewPart::Base`], the log bounds that read
    /// snapshot holds (its head is the base), then every conversation of
    /// the user's `conv.list` at that base, in that order, with its latest
    /// `messages_per_conv` visible messages, `convs_per_chunk` at a time.
    /// The read waits while `out` is full and stops, with `Ok`, once its
    /// receiver is gone. D7: the view is exactly the user's view at the base
    /// because it comes from the snapshot whose head is the base.
    async fn read_snapshot_view(
        &self,
        user: &str,
        device: &str,
        messages_per_conv: u32,
        convs_per_chunk: usize,
        out: tokio::sync::mpsc::Sender<SnapshotViewPart>,
    ) -> StoreResult<()>;

    /// Records a `BUILDING` snapshot at `base` (a view's base) for a device
    /// `RESETTING` at `generation`, which fences retention from now on:
    /// `Conflict` if the device is not resetting at that generation, or the
    /// log was trimmed past `base` since the view was read
    /// (`core::snapshot::check_base`).
    #[allow(clippy::too_many_arguments)]
    async fn open_snapshot(
        &self,
        user: &str,
        device: &str,
        generation: u64,
        snapshot_id: &str,
        base: SyncSeq,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> StoreResult<()>;

    /// Stores one page of a `BUILDING` snapshot (one writer request per
    /// page); `Conflict` once it is not building.
    async fn add_snapshot_page(&self, snapshot_id: &str, page: u32, items: Vec<String>) -> StoreResult<()>;

    /// Turns `BUILDING` into `READY` with its digest and page count; a
    /// `READY` snapshot never changes again. `Conflict` if not building.
    async fn seal_snapshot(&self, snapshot_id: &str, manifest_digest: &str, pages: u32) -> StoreResult<()>;

    /// The whole view at once: [`Store::read_snapshot_view`] and
    /// [`Store::open_snapshot`] at its base, the conversations collected.
    /// For tests and small users; the server streams the view instead.
    #[allow(clippy::too_many_arguments)]
    async fn begin_snapshot(
        &self,
        user: &str,
        device: &str,
        generation: u64,
        snapshot_id: &str,
        messages_per_conv: u32,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> StoreResult<(SyncSeq, Vec<SnapshotConv>)> {
        let (tx, mut rx) = tokio::sync::mpsc::channel(SNAPSHOT_CHUNKS_IN_FLIGHT);
        let read = self.read_snapshot_view(user, device, messages_per_conv, SNAPSHOT_CONVS_PER_CHUNK, tx);
        let build = async {
            let Some(SnapshotViewPart::Base(log)) = rx.recv().await else {
                return Err(StoreError::Internal("a snapshot view starts with its base".into()));
            };
            let base = log.high_watermark;
            self.open_snapshot(user, device, generation, snapshot_id, base, expires_at_ms, now_ms).await?;
            let mut view = Vec::new();
            while let Some(part) = rx.recv().await {
                match part {
                    SnapshotViewPart::Convs(convs) => view.extend(convs),
                    SnapshotViewPart::Privacy { .. } => {}
                    SnapshotViewPart::Base(_) => {
                        return Err(StoreError::Internal("a snapshot view has one base".into()));
                    }
                }
            }
            Ok((base, view))
        };
        // A read that failed ended the view early: its error is the cause.
        let (read, built) = tokio::join!(read, build);
        read?;
        built
    }

    /// Stores the pages (one writer request each) and seals the snapshot.
    async fn finish_snapshot(
        &self,
        snapshot_id: &str,
        manifest_digest: &str,
        pages: Vec<Vec<String>>,
    ) -> StoreResult<()> {
        let count = pages.len() as u32;
        for (page, items) in pages.into_iter().enumerate() {
            self.add_snapshot_page(snapshot_id, page as u32, items).await?;
        }
        self.seal_snapshot(snapshot_id, manifest_digest, count).await
    }

    async fn snapshot(&self, snapshot_id: &str) -> StoreResult<Option<SnapshotMeta>>;

    /// The items of one page of a `READY` snapshot (`None` otherwise, or
    /// past its last page).
    async fn snapshot_page(&self, snapshot_id: &str, page: u32) -> StoreResult<Option<Vec<String>>>;

    /// Installs: if the device is still `RESETTING` at the snapshot's
    /// generation, its cursor becomes `ACTIVE` at the snapshot's base (one
    /// CAS). Returns whether it did and the cursor after the call.
    async fn ack_snapshot(
        &self,
        user: &str,
        device: &str,
        snapshot_id: &str,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)>;

    /// One retention pass over every user log (L1–L2): never past the
    /// slowest valid device's ACK or a live snapshot's base. It runs as
    /// bounded steps ([`Store::trim_step`]), each its own writer request,
    /// so every other write waits for one step at most, never the pass.
    async fn trim_user_logs(&self, policy: RetentionPolicy, now_ms: i64) -> StoreResult<TrimReport> {
        let mut report = TrimReport::default();
        let mut step = TrimStep::Snapshots;
        loop {
            let (done, more) = self.trim_step(policy, now_ms, step.clone()).await?;
            report.add(&done);
            step = match (step, more) {
                (TrimStep::History { .. }, Some(after)) => TrimStep::History { after },
                (TrimStep::Users { .. }, Some(after)) => TrimStep::Users { after },
                (TrimStep::Snapshots, _) if policy.history_keep_ms.is_some() => {
                    TrimStep::History { after: String::new() }
                }
                (TrimStep::Snapshots | TrimStep::History { .. }, _) => TrimStep::Users { after: String::new() },
                (TrimStep::Users { .. }, None) => return Ok(report),
            };
        }
    }

    /// One step of the retention pass in one writer request: the snapshot
    /// expiry; or history retention of up to [`RETENTION_CONVS_PER_CHUNK`]
    /// conversations; or log trimming of up to [`RETENTION_USERS_PER_CHUNK`]
    /// users deleting at most [`RETENTION_EVENTS_PER_CHUNK`] events. Returns
    /// what it did and, when the same kind of step has more to do, the
    /// conversation or user to resume after.
    async fn trim_step(
        &self,
        policy: RetentionPolicy,
        now_ms: i64,
        step: TrimStep,
    ) -> StoreResult<(TrimReport, Option<String>)>;

    /// Events with `after < sync_seq <= upto`, ascending, at most `limit`.
    async fn read_user_events(
        &self,
        user: &str,
        after: SyncSeq,
        upto: SyncSeq,
        limit: u32,
    ) -> StoreResult<Vec<StoredEvent>>;

    /// One sync page from one read snapshot: the device's cursor, the
    /// user's log bounds and the device's recovery session, the decision
    /// `tidemark_core::page::decide_page` takes on them for `query`, and
    /// the events of the range that decision names (at most `limit`), all
    /// from the same snapshot, so the trim check and the read it guards
    /// agree (D2, D5, D6, L2). `None` if the device is unknown.
    async fn sync_page(
        &self,
        user: &str,
        device: &str,
        query: tidemark_core::page::PageQuery,
        limit: u32,
    ) -> StoreResult<Option<SyncRead>>;

    /// The facts of [`Store::sync_page`] alone, in one statement (what a
    /// connecting device is registered with). `None` if the device is
    /// unknown.
    async fn sync_facts(&self, user: &str, device: &str) -> StoreResult<Option<tidemark_core::page::SyncFacts>>;

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

    /// A cumulative ACK: `decide_ack_with` applied inside one transaction,
    /// with the device's open recovery session; `token_session` is the
    /// session bound into the batch token. Completing a recovery and
    /// expiring one (bump, `RESETTING`) happen here too (D6).
    ///
    /// This is [`Store::ack_on`] from no connection (HTTP: any epoch).
    async fn ack(
        &self,
        user: &str,
        device: &str,
        generation: u64,
        token_session: Option<&str>,
        seq: SyncSeq,
        now_ms: i64,
    ) -> StoreResult<AckResult> {
        self.ack_on(None, user, device, generation, token_session, seq, now_ms).await
    }

    /// [`Store::ack`] from the WebSocket connection `connection_epoch`
    /// (`None`: HTTP, any epoch): refused `Superseded`, with nothing
    /// changed, when the device has a newer connection (P2), compared in
    /// the statement that reads the device row.
    #[allow(clippy::too_many_arguments)]
    async fn ack_on(
        &self,
        connection_epoch: Option<u64>,
        user: &str,
        device: &str,
        generation: u64,
        token_session: Option<&str>,
        seq: SyncSeq,
        now_ms: i64,
    ) -> StoreResult<AckResult>;

    /// Opens a recovery session (D6): if the cursor still equals
    /// `expected`, bumps its generation, sets `RECOVERING` and records the
    /// session (which fences retention from its `resume_from` until it
    /// completes or expires), in one transaction.
    async fn begin_recovery(
        &self,
        user: &str,
        device: &str,
        expected: DeviceCursor,
        session: tidemark_core::cursor::RecoveryInfo,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)>;

    /// The device's open recovery session, if any.
    async fn recovery_session(
        &self,
        user: &str,
        device: &str,
    ) -> StoreResult<Option<tidemark_core::cursor::RecoveryInfo>>;

    // --------------------------------------------------------- large groups

    /// When groups leave per-member mode (G3); applies to the next group
    /// created and the next membership change.
    fn set_group_policy(&self, policy: GroupPolicy);

    /// `dirty.clear` (G2): the version CAS of `large::decide_clear` for the
    /// device, in one writer transaction. Returns whether it cleared and
    /// the marker as it now is. `NotMember` unless the user ever had a
    /// period in `conv`; `Invalid` for a conversation not in shared mode.
    async fn clear_marker(
        &self,
        user: &str,
        device: &str,
        conv: &str,
        observed_version: u64,
        last_msg_seq: MsgSeq,
    ) -> StoreResult<(bool, Marker)>;

    /// The markers of the user's shared groups that are dirty for `device`,
    /// from one read.
    async fn dirty_markers(&self, user: &str, device: &str) -> StoreResult<Vec<DeviceMarker>>;

    /// The active members of `conv` and the `msg_seq` of its last
    /// membership change, from one read (the hint path's member cache).
    async fn active_members(&self, conv: &str) -> StoreResult<(MsgSeq, Vec<String>)>;

    /// One page of `conv`'s current members as `user` may read them
    /// (`conv.members`): by user id above `after`, at most `limit`, each
    /// with the `join_seq` of their open period; the conversation, the
    /// caller's period and the page read in one snapshot and decided by
    /// `tidemark_core::membership::members_page` (a current member only).
    async fn conv_members(&self, user: &str, conv: &str, after: Option<String>, limit: u32)
        -> StoreResult<MembersPage>;

    // -------------------------------------------------------- observability

    fn stats(&self) -> StoreStats;

    /// Whether writes commit; read without touching the database.
    fn health(&self) -> StoreHealth;

    // ------------------------------ ephemeral lane and receipts (issue 18)

    /// The user's privacy switches (`Privacy::default()` for a user who
    /// never set one).
    async fn privacy(&self, user: &str) -> StoreResult<Privacy>;

    /// Updates the user's privacy switches and push preview preference
    /// (`None` keeps one as it is; `tidemark_core::ephemeral::privacy_after`
    /// decides, nothing is written when nothing changes) and returns them.
    /// `NotFound` for an unknown user. [`Store::update_privacy`] without
    /// its log position.
    async fn set_privacy(&self, user: &str, update: PrivacyUpdate, now_ms: i64) -> StoreResult<Privacy> {
        Ok(self.update_privacy(user, update, now_ms).await?.0)
    }

    /// [`Store::set_privacy`], and a change is also a `privacy` user event
    /// in the user's own log (`EVENT_PRIVACY`, data
    /// `content::PrivacyData`, keyed by `ephemeral::privacy_event_id` of the
    /// switches' new version), in the same transaction as the switches, so
    /// the user's other devices learn it (issue 18); a no-op writes
    /// neither.
    async fn update_privacy(
        &self,
        user: &str,
        update: PrivacyUpdate,
        now_ms: i64,
    ) -> StoreResult<(Privacy, UserEventOutcome)>;

    /// The users sharing a conversation with `user` in which both have an
    /// open period, `user` excluded, sorted, at most `limit`: who may see
    /// the user's presence.
    async fn presence_audience(&self, user: &str, limit: u32) -> StoreResult<Vec<String>>;

    /// [`Store::privacy`] and [`Store::presence_audience`] of one user in
    /// one statement: what a connecting device's presence is announced
    /// with.
    async fn presence_facts(&self, user: &str, limit: u32) -> StoreResult<(Privacy, Vec<String>)>;

    /// The read positions (R2) of `conv`'s current members as `user` may
    /// see them (`tidemark_core::ephemeral::visible_receipts`, on the
    /// members, their `read_seq` and their privacy read in one statement);
    /// with `at`, how many of them read it.
    async fn conv_receipts(&self, user: &str, conv: &str, at: Option<MsgSeq>) -> StoreResult<Receipts>;

    /// Delivery receipts (R1) of the caller's own messages in a direct
    /// conversation (`tidemark_core::ephemeral::check_delivery_receipts`):
    /// for each id, in the order asked, the earliest delivery to a device
    /// of another user, `None` while there is none.
    async fn delivery_receipts(
        &self,
        user: &str,
        conv: &str,
        message_ids: Vec<String>,
    ) -> StoreResult<Vec<(String, Option<i64>)>>;
    // ------------------------------------------------------ cluster fences

    /// A new WebSocket connection of the device (P2): its
    /// `connection_epoch`, one above the device's previous connection on
    /// any node, committed before it returns, with the device's ACK and the
    /// user's head read by the same statement (what the hub registers the
    /// connection with). `NotFound` for a device that never logged in.
    async fn open_connection(&self, user: &str, device: &str) -> StoreResult<OpenedConnection>;

    /// The durable fences of these devices (absent ones are left out), in
    /// one read: what a node checks its live connections against, and the
    /// ACK its re-hint sweep measures their lag from.
    async fn device_fences(&self, devices: &[(String, String)]) -> StoreResult<Vec<DeviceFence>>;

    // ------------------------------------------------------------- accounts

    /// Presents a refresh token: in one transaction, loads it, asks
    /// `tidemark_core::refresh::decide` and applies the verdict (mark it
    /// used; delete it when expired; delete its whole family when it had
    /// been used already).
    async fn use_refresh_token(&self, token_hash: &str, now_ms: i64) -> StoreResult<RefreshUse>;

    /// Every device of `user` (any state), by device id.
    async fn list_devices(&self, user: &str) -> StoreResult<Vec<DeviceInfo>>;

    /// Replaces the user's password hash and deletes the refresh tokens of
    /// every device of the user but `keep_device`; `Ok(false)` if the user
    /// does not exist.
    async fn change_password(&self, user: &str, password_hash: &str, keep_device: &str) -> StoreResult<bool>;

    /// Ends the sessions of `device` of `user`, or of every device of it
    /// when `None`, at `now_ms` (`tidemark_core::session`): records the end
    /// and deletes the refresh tokens concerned. `Ok(false)` if there is
    /// no such user (or device).
    async fn end_sessions(&self, user: &str, device: Option<&str>, now_ms: i64) -> StoreResult<bool>;

    /// Deactivates the account: it no longer logs in (`password_hash`
    /// answers `None`), its sessions end, its refresh tokens are deleted.
    /// `Ok(false)` if it was deactivated already; `NotFound` if no such user.
    async fn deactivate_user(&self, user: &str, now_ms: i64) -> StoreResult<bool>;

    /// Every recorded session end and deactivation, for the gateway's
    /// in-memory fence.
    async fn session_fences(&self) -> StoreResult<SessionFences>;

    /// A counter that every write recording a fence (a revoked device, an
    /// end of sessions, a deactivation, a deletion) moves in its own
    /// transaction, whichever process wrote it: a node re-reads
    /// [`Store::revoked_devices`] and [`Store::session_fences`] only when
    /// it moved, so its periodic check is one point read (0: none yet).
    async fn fences_version(&self) -> StoreResult<u64>;

    /// Appends one entry to the durable audit log.
    async fn append_audit(&self, entry: &AuditEntry) -> StoreResult<()>;

    /// Audit entries with `from_ms <= at_ms < to_ms`, of one user (by its
    /// audit hash) or of all, oldest first, at most `limit`.
    async fn audit_log(
        &self,
        user_hash: Option<&str>,
        from_ms: i64,
        to_ms: i64,
        limit: u32,
    ) -> StoreResult<Vec<AuditEntry>>;

    /// Deletes the audit entries older than `before_ms`; returns how many.
    async fn trim_audit(&self, before_ms: i64) -> StoreResult<u64>;

    /// Every account, by name.
    async fn list_users(&self) -> StoreResult<Vec<UserInfo>>;

    /// Deletes an account, in one transaction: it is deactivated (if it was
    /// not), its devices with their cursors, refresh tokens, recovery
    /// sessions, snapshots, delivery records, delete-for-me marks and its
    /// whole sync log are deleted (the log's trim point moves to its head,
    /// so no `sync_seq` is reused). The account's row stays as a tombstone,
    /// its name never reused; its messages and membership periods stay as
    /// facts of their conversations. `Ok(false)` if it was deleted already;
    /// `NotFound` if no such user.
    async fn delete_user(&self, user: &str, now_ms: i64) -> StoreResult<bool>;

    /// Sets the device's offline push target (P4), replacing any it had.
    /// A new target's push position starts at the user's head, so nothing
    /// committed before it is pushed; a replaced one keeps its position.
    /// `Ok(true)` if the device had none. `NotFound` if the device is
    /// unknown or revoked. Revoking the device, deactivating or deleting
    /// the user removes the target in the same transaction.
    async fn put_push_target(&self, target: PushTarget, now_ms: i64) -> StoreResult<bool>;

    /// The push targets of the user's devices, by device id.
    async fn push_targets(&self, user: &str) -> StoreResult<Vec<PushTarget>>;

    /// Removes the device's push target; with `token_hash`, only while it
    /// still holds that token (a provider's "token dead" never removes a
    /// newer registration). `Ok(false)` if nothing was removed.
    async fn remove_push_target(&self, user: &str, device: &str, token_hash: Option<&str>) -> StoreResult<bool>;

    /// Claims up to `limit` push targets that owe a push at `now_ms`: not
    /// revoked, not waiting (`next_at`), not claimed by a live lease, and
    /// whose user's head is above `max(acked, pushed_through)`. Each claim
    /// lasts `lease_ms` (another node claims the target after that) and
    /// comes with the events above that position, at most `scan_max`, each
    /// with the message's sender and the user's `muted` setting, and the
    /// stored content when the target's preview is `full`. Two claimers
    /// never hold one target at once.
    async fn claim_pushes(&self, now_ms: i64, lease_ms: i64, limit: u32, scan_max: u32)
        -> StoreResult<Vec<OwedPushes>>;

    /// Ends claim `claim` of a device's target with `step`. `Ok(false)`
    /// (nothing written) if the claim was lost (its lease ran out and
    /// another claim was taken) or the target is gone. `pushed_through`
    /// only grows.
    async fn finish_push(&self, user: &str, device: &str, claim: i64, step: PushStep, now_ms: i64)
        -> StoreResult<bool>;
}

/// A device's offline push target as stored (P4). The token is sealed by
/// the server (`token_sealed`, encrypted); the store never sees it clear.
#[derive(Clone, PartialEq, Eq)]
pub struct PushTarget {
    pub user: String,
    pub device: String,
    /// `tidemark_proto::push::platform`.
    pub platform: String,
    pub token_sealed: Vec<u8>,
    pub token_hash: String,
    pub token_last4: String,
    pub app_id: String,
    pub p256dh: Option<String>,
    pub auth: Option<String>,
    /// `none`, `conversation` or `full`.
    pub preview: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl std::fmt::Debug for PushTarget {
    // Even sealed, a token is not printed: only its hash.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushTarget")
            .field("user", &self.user)
            .field("device", &self.device)
            .field("platform", &self.platform)
            .field("token_hash", &self.token_hash)
            .field("preview", &self.preview)
            .finish_non_exhaustive()
    }
}

/// One claimed target and the facts of its owed range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwedPushes {
    pub target: PushTarget,
    /// The claim's number, for [`Store::finish_push`].
    pub claim: i64,
    /// Retryable failures in a row so far.
    pub attempts: u32,
    /// The user's own push preview preference (`Privacy::push_preview`).
    pub user_preview: Preview,
    /// The events above `max(acked, pushed_through)`, ascending, each with
    /// the user's preview preference of its conversation.
    pub events: Vec<tidemark_core::push::OwedEvent>,
    /// The stored content of each event (same order) when the target's,
    /// the user's and the conversation's preview all are `full`, else `None`.
    pub contents: Vec<Option<String>>,
}

/// How a claim ends ([`Store::finish_push`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushStep {
    /// Settled through `through`: the position moves there, failures reset.
    Advance { through: u64 },
    /// Look again at `at_ms`, the position and failures unchanged.
    Wait { at_ms: i64 },
    /// Retry no sooner than `at_ms` with `attempts` failures on record.
    Retry { at_ms: i64, attempts: u32 },
    /// The token is dead: remove the target.
    Remove,
}

/// A device's durable fences: its latest connection and whether it is
/// revoked (P2, P5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFence {
    pub user: String,
    pub device: String,
    /// The epoch of the device's newest connection (0: none yet).
    pub connection_epoch: u64,
    pub revoked: bool,
    /// The device's committed ACK, whichever node took it (D8's lag).
    pub acked_sync_seq: u64,
}

/// One audit log entry (`tidemark_core::audit`): ids are keyed hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    pub at_ms: i64,
    pub event: String,
    pub actor: String,
    pub user_hash: String,
    pub device_hash: Option<String>,
    /// The source address, when the event came over the network.
    pub address: Option<String>,
}

/// An account as `list_users` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserInfo {
    pub user: String,
    pub created_at_ms: i64,
    pub deactivated_at_ms: Option<i64>,
    pub deleted_at_ms: Option<i64>,
}

/// A device as `device.list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub device: String,
    pub name: String,
    pub created_at_ms: i64,
    /// Its last login or cursor move.
    pub last_seen_ms: i64,
    pub state: tidemark_core::cursor::DeviceState,
}

/// What [`Store::session_fences`] reads: deactivated users, and the moments
/// sessions of users and of devices were ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionFences {
    pub deactivated: Vec<String>,
    pub users_ended: Vec<(String, i64)>,
    pub devices_ended: Vec<(String, String, i64)>,
}
