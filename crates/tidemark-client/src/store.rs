//! The local SQLite store of one device (K1–K3): what the device has applied
//! from its user's sync log, its conversations and their contiguous cursors,
//! and its outbox.
//!
//! It owns the local schema and every local transaction, and the rules that
//! must hold inside one:
//!
//! - a sync page (its messages, control events, per-user events,
//!   conversation summaries and the new `applied_sync_seq`) commits in
//!   **one** transaction (K1), and only events that continue
//!   `applied_sync_seq` without a hole are applied; events at or below it
//!   are skipped, so a replayed batch is idempotent;
//! - every conversation event, whatever brought it (a sync page or our own
//!   `send.ok`), goes through [`crate::cursor::ConvCursor`] in the
//!   transaction that stores it, and the conversation's `contiguous_msg_seq`
//!   is written from the cursor, so it never jumps a gap (K2); rows above it
//!   are the persistent pending buffer;
//! - control events apply by the rules of docs/protocol.md §3.4: an edit or
//!   reaction only above the version held, a recall turns its target into a
//!   placeholder for good (E1, E2);
//! - an outbox entry and its `client_msg_id` are durable before the first
//!   attempt, and entries leave in `id` order (K3).
//!
//! It knows nothing about sockets, tasks or time: the engine calls it from a
//! blocking thread and decides when. The fault hook is passed in so a test
//! can stop a transaction between its writes and its commit.
//!
//! Tables (all defined in [`SCHEMA`]):
//!
//! - `device` — one row: `user`, `device_id`, `sync_generation` (NULL until
//!   the first page), `applied_sync_seq` (everything up to it is applied),
//!   `acked_sync_seq` (the last ACK the server confirmed: an `ack.ok`, or
//!   the server's ACK a sync reports; below `applied_sync_seq` until an
//!   ACK or its reply that was lost is made good), `refresh_token`.
//! - `conversations` — key `conv`: `contiguous_msg_seq` (the K2 cursor),
//!   `last_msg_seq`, `read_seq`, `unread`, settings (`muted`, `pinned`,
//!   `settings_version`), `updated_sync_seq`, `active` (still a member),
//!   `history_to` (events at or below it were never delivered here: a
//!   snapshot's older history) and `unread_below` (unread messages below
//!   `history_to`, counted while `read_seq` is below it).
//! - `messages` — key `(conv, msg_seq)`, `message_id` unique: every
//!   conversation event held (user messages and control events), its
//!   envelope with `version` and `reactions`, and the `sync_seq` that
//!   delivered it (NULL while known only from our own `send.ok`).
//! - `control_events` — key `sync_seq`: events of kinds this client does not
//!   interpret, kept verbatim (they count as applied).
//! - `snapshot_install` — at most one row: the snapshot being installed
//!   (token, generation, base, digest, pages) and whether its install
//!   committed (`installed`: its `snapshot.ack` is pending).
//! - `outbox` — key `id` (order), `client_msg_id` unique, `op` (`send`,
//!   `recall`, `read`): `pending`, then `accepted` (with `msg_seq`, and for
//!   a send `message_id` and `duplicate`) or `failed`.

use std::collections::BTreeMap;
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, Transaction, TransactionBehavior};
use serde_json::{json, Value};
use tidemark_proto::{Envelope, ReadOk, RecallOk, SendOk, SyncOk, UserEvent};

use crate::cursor::{ConvCursor, Policy, PENDING_MAX};

/// Pending outbox entries at most; [`LocalStore::enqueue`] refuses more.
pub const OUTBOX_PENDING_MAX: u64 = 10_000;
/// Accepted or failed outbox entries kept for the app to look up; older ones
/// are pruned (the messages themselves stay in `messages`).
pub const OUTBOX_DONE_KEEP: u64 = 1_000;
/// How long a local write waits for the database lock, ms.
const BUSY_TIMEOUT_MS: u64 = 5_000;

/// Envelope kinds of control events (docs/protocol.md §3.4.1): they take a
/// `msg_seq` but are not user content and never count as unread.
pub const CONTROL_KINDS: &[&str] = &["conv.created", "member.join", "member.leave", "recall", "edit", "reaction"];
/// The same list as an SQL tuple (checked against [`CONTROL_KINDS`] by a test).
const CONTROL_KINDS_SQL: &str = "('conv.created', 'member.join', 'member.leave', 'recall', 'edit', 'reaction')";

pub const STATE_NORMAL: &str = "normal";
pub const STATE_EDITED: &str = "edited";
pub const STATE_RECALLED: &str = "recalled";
pub const STATE_DELETED: &str = "deleted";

pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS device (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    user TEXT NOT NULL,
    device_id TEXT NOT NULL,
    sync_generation INTEGER,
    applied_sync_seq INTEGER NOT NULL DEFAULT 0,
    acked_sync_seq INTEGER NOT NULL DEFAULT 0,
    refresh_token TEXT
);
CREATE TABLE IF NOT EXISTS conversations (
    conv TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    contiguous_msg_seq INTEGER NOT NULL DEFAULT 0,
    last_msg_seq INTEGER NOT NULL DEFAULT 0,
    read_seq INTEGER NOT NULL DEFAULT 0,
    unread INTEGER NOT NULL DEFAULT 0,
    muted INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,
    settings_version INTEGER NOT NULL DEFAULT 0,
    updated_sync_seq INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS messages (
    conv TEXT NOT NULL,
    msg_seq INTEGER NOT NULL,
    message_id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    sender TEXT NOT NULL,
    content TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    version INTEGER NOT NULL DEFAULT 1,
    reactions TEXT NOT NULL DEFAULT '{}',
    sync_seq INTEGER,
    PRIMARY KEY (conv, msg_seq)
);
CREATE TABLE IF NOT EXISTS control_events (
    sync_seq INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    conv TEXT NOT NULL,
    msg_seq INTEGER,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    client_msg_id TEXT NOT NULL UNIQUE,
    op TEXT NOT NULL,
    conv TEXT NOT NULL,
    kind TEXT NOT NULL,
    content TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    message_id TEXT,
    msg_seq INTEGER,
    duplicate INTEGER,
    error TEXT
);
CREATE INDEX IF NOT EXISTS outbox_by_state ON outbox (state, id);
CREATE TABLE IF NOT EXISTS snapshot_install (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    snapshot_id TEXT NOT NULL,
    token TEXT NOT NULL,
    generation INTEGER NOT NULL,
    base_sync_seq INTEGER NOT NULL,
    manifest_digest TEXT NOT NULL,
    pages INTEGER NOT NULL,
    installed INTEGER NOT NULL DEFAULT 0
);
";

/// Columns added to `conversations` after the first release of the schema;
/// [`LocalStore::open`] adds the missing ones to an older database.
const CONVERSATION_COLUMNS: &[(&str, &str)] = &[
    ("history_to", "INTEGER NOT NULL DEFAULT 0"),
    ("unread_below", "INTEGER NOT NULL DEFAULT 0"),
    ("active", "INTEGER NOT NULL DEFAULT 1"),
];

/// Local store failures.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("sqlite: {0}")]
    Sqlite(String),
    /// The database belongs to another user or device.
    #[error("this local store belongs to {user}/{device}")]
    WrongOwner { user: String, device: String },
    /// Local data contradicts itself or the server (for example one
    /// `msg_seq` with two message ids). Nothing was written.
    #[error("integrity: {0}")]
    Integrity(String),
    /// The outbox holds [`OUTBOX_PENDING_MAX`] unsent entries.
    #[error("the outbox is full ({OUTBOX_PENDING_MAX} pending entries)")]
    OutboxFull,
    /// The fault hook stopped the client at this point (tests).
    #[error("aborted by the fault hook at {0:?}")]
    Aborted(FaultPoint),
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Sqlite(e.to_string())
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// The points where a fault hook may stop the client (crash-safety tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultPoint {
    /// A sync page is written in the open transaction, not committed.
    BeforeCommit { first_sync_seq: u64, last_sync_seq: u64 },
    /// The page committed; its ACK is not sent yet.
    AfterCommit { applied_sync_seq: u64 },
    /// `snapshot.begin` answered and the snapshot is recorded locally; no
    /// page fetched yet.
    SnapshotBegun { generation: u64, base_sync_seq: u64, pages: u32 },
    /// Snapshot page `page` (from 0) arrived; it is not verified yet. The
    /// hook may answer [`FaultAction::Corrupt`] here to damage one item.
    SnapshotPageFetched { page: u32, pages: u32 },
    /// The snapshot is written in the open install transaction, not
    /// committed.
    SnapshotBeforeCommit { base_sync_seq: u64 },
    /// The install committed; `snapshot.ack` is not sent yet.
    SnapshotAfterCommit { base_sync_seq: u64 },
    /// An outbox entry is about to be sent.
    BeforeSend { client_msg_id: String },
    /// The server accepted an outbox entry; that is not recorded locally yet.
    AfterSendOk { client_msg_id: String, msg_seq: u64 },
}

/// What a fault hook tells the client to do at a [`FaultPoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    Continue,
    /// Stop at once, as if the process were killed: no further write, reply
    /// or request.
    Abort,
    /// At [`FaultPoint::SnapshotPageFetched`] only: damage the first item of
    /// the page just received (a corrupt transfer). Elsewhere, `Continue`.
    Corrupt,
}

/// A snapshot this device began installing (D7, docs/protocol.md §3.24),
/// persisted from `snapshot.begin` until its `snapshot.ack` is confirmed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingSnapshot {
    pub snapshot_id: String,
    /// Fetches the pages again and acks; valid 30 minutes.
    pub token: String,
    pub generation: u64,
    pub base_sync_seq: u64,
    pub manifest_digest: String,
    pub pages: u32,
    /// The install committed locally; only `snapshot.ack` is left, and it
    /// must go before any `sync`.
    pub installed: bool,
}

/// What installing a snapshot did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SnapshotReport {
    pub generation: u64,
    pub base_sync_seq: u64,
    pub conversations: usize,
    /// Conversation events stored (messages and control events).
    pub messages: usize,
    /// Items of a type this client does not know, ignored.
    pub skipped_items: usize,
}

/// The manifest digest of snapshot items (docs/protocol.md §3.22): lowercase
/// hex SHA-256 over each item's canonical JSON followed by `\n`.
pub fn manifest_digest<'a>(items: impl IntoIterator<Item = &'a Value>) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for item in items {
        h.update(tidemark_proto::canonical_item(item).as_bytes());
        h.update(b"\n");
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The device's position in its user's sync log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SyncPosition {
    /// `None` until the device applied its first page.
    pub generation: Option<u64>,
    pub applied_sync_seq: u64,
    /// The last ACK the server confirmed to this device.
    pub acked_sync_seq: u64,
}

/// A conversation event as held locally: the C4 envelope, the version rules
/// applied, and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub conv: String,
    pub msg_seq: u64,
    pub message_id: String,
    /// The sender's kind (`text`…) or a control kind ([`CONTROL_KINDS`]).
    pub kind: String,
    /// `normal`, `edited`, `recalled` (content `{}`) or `deleted` (for this
    /// user only, content `{}`).
    pub state: String,
    pub sender: String,
    pub content: Value,
    pub created_at: i64,
    pub version: u64,
    /// Reaction → users, as the server last described it.
    pub reactions: Value,
    /// The user-log position that delivered it; `None` while it is known
    /// only from this device's own `send.ok`.
    pub sync_seq: Option<u64>,
}

impl Message {
    /// A control event (membership, recall, edit, reaction), not user content.
    pub fn is_control(&self) -> bool {
        CONTROL_KINDS.contains(&self.kind.as_str())
    }
}

/// A conversation summary, maintained in the transaction that changes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub conv: String,
    pub kind: String,
    /// Every `msg_seq` in `history_to + 1 ..= contiguous_msg_seq` is held
    /// locally or outside this user's view (K2): the point a sync continues
    /// after.
    pub contiguous_msg_seq: u64,
    /// Events at or below this `msg_seq` were never delivered to this
    /// device: a snapshot (D7) carries only the latest events of each
    /// conversation. They are history, fetched on demand (`history`,
    /// docs/protocol.md §3.11), never a gap. 0 when the device holds the
    /// conversation from its start.
    pub history_to: u64,
    /// The highest `msg_seq` held; above `contiguous_msg_seq` when a gap
    /// waits to be filled.
    pub last_msg_seq: u64,
    /// The user's read position: moved by `read` (here or on another
    /// device) and by the user's own events.
    pub read_seq: u64,
    /// Messages from others above `read_seq`, not recalled, not deleted.
    pub unread: u64,
    pub muted: bool,
    pub pinned: bool,
    /// The user is a member now (false once they left or were removed).
    pub active: bool,
    /// The latest user message (control events are not messages).
    pub last_message: Option<Message>,
}

impl Conversation {
    pub fn has_gap(&self) -> bool {
        self.contiguous_msg_seq < self.last_msg_seq
    }
}

/// What an outbox entry asks of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxOp {
    /// `send`: `content` is the message content.
    Send,
    /// `recall`: `content` is `{"message_id": …}`.
    Recall,
    /// `read`: `content` is `{"read_to_seq": …}`.
    Read,
}

impl OutboxOp {
    pub fn as_str(self) -> &'static str {
        match self {
            OutboxOp::Send => "send",
            OutboxOp::Recall => "recall",
            OutboxOp::Read => "read",
        }
    }

    fn parse(s: &str) -> Option<OutboxOp> {
        match s {
            "send" => Some(OutboxOp::Send),
            "recall" => Some(OutboxOp::Recall),
            "read" => Some(OutboxOp::Read),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxState {
    Pending,
    Accepted,
    Failed,
}

impl OutboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            OutboxState::Pending => "pending",
            OutboxState::Accepted => "accepted",
            OutboxState::Failed => "failed",
        }
    }

    fn parse(s: &str) -> OutboxState {
        match s {
            "accepted" => OutboxState::Accepted,
            "failed" => OutboxState::Failed,
            _ => OutboxState::Pending,
        }
    }
}

/// One operation, from the moment the app asked for it.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxEntry {
    /// Order: entries leave in ascending `id`.
    pub id: i64,
    pub client_msg_id: String,
    pub op: OutboxOp,
    pub conv: String,
    pub kind: String,
    pub content: Value,
    pub state: OutboxState,
    pub created_at: i64,
    /// Sends: the accepted message.
    pub message_id: Option<String>,
    /// The accepted message's or event's `msg_seq` (for a read: the read
    /// position after it).
    pub msg_seq: Option<u64>,
    /// The server had already accepted this `client_msg_id` (a resend).
    pub duplicate: bool,
    /// Why it failed, for `failed` entries.
    pub error: Option<String>,
}

/// A conversation cursor that moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorMove {
    pub conv: String,
    pub from: u64,
    pub to: u64,
}

/// A conversation left with a gap: `missing` is the first run it lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    pub conv: String,
    pub contiguous_msg_seq: u64,
    pub missing_from: u64,
    pub missing_to: u64,
}

/// One conversation event a page applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedMessage {
    pub sync_seq: u64,
    pub conv: String,
    pub msg_seq: u64,
    pub kind: String,
    pub sender: String,
}

/// What applying one sync page did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PageReport {
    pub sync_generation: u64,
    pub resume_from: u64,
    pub batch_high_watermark: u64,
    /// Events applied (new) and skipped (at or below `applied_sync_seq`).
    pub applied: usize,
    pub skipped: usize,
    pub first_sync_seq: Option<u64>,
    pub last_sync_seq: Option<u64>,
    /// `applied_sync_seq` after the page.
    pub applied_sync_seq: u64,
    /// Conversation events (messages and control events).
    pub messages: Vec<AppliedMessage>,
    /// Messages turned into placeholders by a recall: `(conv, msg_seq)`.
    pub recalled: Vec<(String, u64)>,
    /// Read positions moved by `read` events: `(conv, read_seq)`.
    pub reads: Vec<(String, u64)>,
    /// Events of kinds this client keeps verbatim.
    pub kept_verbatim: usize,
    pub cursors: Vec<CursorMove>,
    pub gaps: Vec<Gap>,
}

/// What recording a server's acceptance of an outbox entry did.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRecord {
    pub entry: OutboxEntry,
    pub cursor: Option<CursorMove>,
    pub gap: Option<Gap>,
    /// A recall: the message turned into a placeholder here, if held.
    pub recalled: Option<(String, u64)>,
    /// A read: the conversation's read position and unread count after it.
    pub read: Option<(u64, u64)>,
}

/// Why a page could not be applied. Nothing of it was committed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The page skips a `sync_seq`: applying past it would jump a hole.
    #[error("hole in the user log: expected sync_seq {expected}, got {got}")]
    Hole { expected: u64, got: u64 },
    /// The page is of an older generation than the local state, or of a
    /// newer one that would skip what is applied.
    #[error("page of generation {page} (resume_from {resume_from}) for local generation {local}")]
    GenerationMismatch { local: u64, page: u64, resume_from: u64 },
    /// An event contradicts itself (envelope of another conversation…).
    #[error("malformed event at sync_seq {sync_seq}: {why}")]
    Malformed { sync_seq: u64, why: String },
    /// A snapshot's items contradict themselves (a message outside its
    /// conversation, out of order…).
    #[error("malformed snapshot item {index}: {why}")]
    BadSnapshot { index: usize, why: String },
}

pub struct LocalStore {
    conn: Connection,
    user: String,
}

/// Milliseconds since the Unix epoch, for local bookkeeping only.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

impl LocalStore {
    /// Opens (creating if needed) the store of `user`/`device_id` at `path`.
    /// WAL, `synchronous=FULL`: a commit survives a crash before the ACK
    /// that follows it.
    pub fn open(path: &Path, user: &str, device_id: &str) -> StoreResult<LocalStore> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_millis(BUSY_TIMEOUT_MS))?;
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Sqlite(format!("journal_mode is {mode}, not wal")));
        }
        conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")?;
        conn.execute_batch(SCHEMA)?;
        migrate(&conn)?;
        let owner: Option<(String, String)> = conn
            .query_row("SELECT user, device_id FROM device WHERE id = 1", [], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        match owner {
            None => {
                conn.execute("INSERT INTO device (id, user, device_id) VALUES (1, ?1, ?2)", params![user, device_id])?;
            }
            Some((u, d)) if u == user && d == device_id => {}
            Some((u, d)) => return Err(StoreError::WrongOwner { user: u, device: d }),
        }
        Ok(LocalStore { conn, user: user.to_owned() })
    }

    pub fn user(&self) -> &str {
        &self.user
    }

    pub fn position(&self) -> StoreResult<SyncPosition> {
        let p = self.conn.query_row(
            "SELECT sync_generation, applied_sync_seq, acked_sync_seq FROM device WHERE id = 1",
            [],
            |r| {
                Ok(SyncPosition {
                    generation: r.get::<_, Option<i64>>(0)?.map(|g| g as u64),
                    applied_sync_seq: r.get::<_, i64>(1)? as u64,
                    acked_sync_seq: r.get::<_, i64>(2)? as u64,
                })
            },
        )?;
        Ok(p)
    }

    /// Applies one sync page in one transaction (K1). `fault` is asked at
    /// [`FaultPoint::BeforeCommit`] when the page applies anything.
    ///
    /// A page of a newer generation than the local one is accepted when its
    /// batch starts at or below `applied_sync_seq` (a recovery replay from
    /// this device's own position, D6): nothing is skipped, and the new
    /// generation is stored with the page.
    pub fn apply_page(
        &mut self,
        page: &SyncOk,
        fault: &dyn Fn(&FaultPoint) -> FaultAction,
    ) -> Result<PageReport, ApplyError> {
        let user = self.user.clone();
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(StoreError::from)?;
        let (generation, applied) = read_position(&tx)?;
        if let Some(local) = generation {
            let adoptable = page.sync_generation > local && page.resume_from <= applied;
            if local != page.sync_generation && !adoptable {
                return Err(ApplyError::GenerationMismatch {
                    local,
                    page: page.sync_generation,
                    resume_from: page.resume_from,
                });
            }
        }
        let mut report = PageReport {
            sync_generation: page.sync_generation,
            resume_from: page.resume_from,
            batch_high_watermark: page.batch_high_watermark,
            applied_sync_seq: applied,
            ..PageReport::default()
        };
        let mut touched: BTreeMap<String, Option<(u64, ConvCursor)>> = BTreeMap::new();
        let mut next = applied;
        for e in &page.events {
            if e.sync_seq <= next {
                report.skipped += 1;
                continue;
            }
            if e.sync_seq != next + 1 {
                return Err(ApplyError::Hole { expected: next + 1, got: e.sync_seq });
            }
            match &e.message {
                Some(env) => apply_conv_event(&tx, &user, e, env, &mut touched, &mut report)?,
                None => apply_user_event(&tx, e, &mut touched, &mut report)?,
            }
            report.first_sync_seq.get_or_insert(e.sync_seq);
            report.last_sync_seq = Some(e.sync_seq);
            report.applied += 1;
            next = e.sync_seq;
        }
        if report.applied == 0 && generation == Some(page.sync_generation) {
            // Nothing new: no write, no commit.
            return Ok(report);
        }
        for (conv, cursor) in touched {
            if let Some((before, cursor)) = cursor {
                let (moved, gap) = save_cursor(&tx, &conv, before, &cursor)?;
                report.cursors.extend(moved);
                report.gaps.extend(gap);
            }
            refresh_summary(&tx, &user, &conv, next)?;
        }
        tx.execute(
            "UPDATE device SET sync_generation = ?1, applied_sync_seq = ?2 WHERE id = 1",
            params![page.sync_generation as i64, next as i64],
        )
        .map_err(StoreError::from)?;
        report.applied_sync_seq = next;
        if let (Some(first), Some(last)) = (report.first_sync_seq, report.last_sync_seq) {
            let point = FaultPoint::BeforeCommit { first_sync_seq: first, last_sync_seq: last };
            if fault(&point) == FaultAction::Abort {
                // Dropping the transaction rolls it back, as a crash would.
                return Err(StoreError::Aborted(point).into());
            }
        }
        tx.commit().map_err(StoreError::from)?;
        Ok(report)
    }

    /// Records a confirmed ACK (the server's value, never lowered).
    pub fn record_ack(&mut self, generation: u64, acked_sync_seq: u64) -> StoreResult<()> {
        self.conn.execute(
            "UPDATE device SET acked_sync_seq = MAX(acked_sync_seq, ?2) WHERE id = 1 AND sync_generation = ?1",
            params![generation as i64, acked_sync_seq as i64],
        )?;
        Ok(())
    }

    /// `RESET_REQUIRED`: wipes the synced state in one transaction and
    /// adopts `generation` (the next first page sends it with
    /// `local_applied_sync_seq` 0). The outbox stays (docs/protocol.md §7.7).
    pub fn reset(&mut self, generation: Option<u64>) -> StoreResult<()> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(
            "DELETE FROM messages; DELETE FROM conversations; DELETE FROM control_events;
             DELETE FROM snapshot_install;",
        )?;
        tx.execute(
            "UPDATE device SET sync_generation = ?1, applied_sync_seq = 0, acked_sync_seq = 0 WHERE id = 1",
            params![generation.map(|g| g as i64)],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// The snapshot being installed, if any (docs/protocol.md §3.24).
    pub fn pending_snapshot(&self) -> StoreResult<Option<PendingSnapshot>> {
        Ok(self
            .conn
            .query_row(
                "SELECT snapshot_id, token, generation, base_sync_seq, manifest_digest, pages, installed
                 FROM snapshot_install WHERE id = 1",
                [],
                |r| {
                    Ok(PendingSnapshot {
                        snapshot_id: r.get(0)?,
                        token: r.get(1)?,
                        generation: r.get::<_, i64>(2)? as u64,
                        base_sync_seq: r.get::<_, i64>(3)? as u64,
                        manifest_digest: r.get(4)?,
                        pages: r.get::<_, i64>(5)? as u32,
                        installed: r.get(6)?,
                    })
                },
            )
            .optional()?)
    }

    /// Step 1 of §3.24: records a begun snapshot (not installed), replacing
    /// any older one. The synced state is not touched.
    pub fn snapshot_begun(&mut self, snap: &PendingSnapshot) -> StoreResult<()> {
        save_pending(&self.conn, snap, false)?;
        Ok(())
    }

    /// Forgets the pending snapshot (its token can no longer be used).
    pub fn forget_snapshot(&mut self) -> StoreResult<()> {
        self.conn.execute("DELETE FROM snapshot_install", [])?;
        Ok(())
    }

    /// Step 5 of §3.24 answered: the server installed the snapshot. Clears
    /// the pending mark and records the ACK, in one transaction.
    pub fn snapshot_acked(&mut self, generation: u64, acked_sync_seq: u64) -> StoreResult<()> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute("DELETE FROM snapshot_install", [])?;
        tx.execute(
            "UPDATE device SET acked_sync_seq = MAX(acked_sync_seq, ?2) WHERE id = 1 AND sync_generation = ?1",
            params![generation as i64, acked_sync_seq as i64],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Step 4 of §3.24: replaces the whole synced state with the snapshot's
    /// verified `items`, in **one** transaction, and marks the snapshot
    /// installed (its ack pending). The outbox stays. `fault` is asked at
    /// [`FaultPoint::SnapshotBeforeCommit`].
    ///
    /// Each conversation takes the summary of its conversation item as the
    /// server computed it at the base (`last_msg_seq`, `read_seq`, `unread`,
    /// `muted`, `pinned`, `active`; the settings version restarts at 0, so
    /// every later `settings` event applies). Its cursor rule: the snapshot
    /// holds the latest events of the conversation, so
    /// - `contiguous_msg_seq` = `last_msg_seq` (everything the user could see
    ///   up to the base is either held or history), and the next event,
    ///   `last_msg_seq + 1`, continues the cursor, so gap detection works as
    ///   before for everything after the base;
    /// - `history_to` = the first held `msg_seq` − 1 (0 when the first held
    ///   is `msg_seq` 1; `last_msg_seq` when none is held): the events at or
    ///   below it are history to fetch on demand, never a gap;
    /// - the unread count of messages below `history_to` (server's `unread`
    ///   minus the unread messages held) is kept as `unread_below` and
    ///   counted until the read position passes `history_to`.
    ///
    /// The messages get `sync_seq` NULL: no log entry delivered them.
    pub fn install_snapshot(
        &mut self,
        snap: &PendingSnapshot,
        items: &[Value],
        fault: &dyn Fn(&FaultPoint) -> FaultAction,
    ) -> Result<SnapshotReport, ApplyError> {
        let user = self.user.clone();
        let convs = parse_snapshot(items)?;
        let mut report = SnapshotReport {
            generation: snap.generation,
            base_sync_seq: snap.base_sync_seq,
            conversations: convs.len(),
            skipped_items: items.len() - convs.iter().map(|c| 1 + c.messages.len()).sum::<usize>(),
            ..SnapshotReport::default()
        };
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(StoreError::from)?;
        tx.execute_batch("DELETE FROM messages; DELETE FROM conversations; DELETE FROM control_events;")
            .map_err(StoreError::from)?;
        for c in &convs {
            let held_max = c.messages.last().map_or(0, |m| m.msg_seq);
            let last = c.last_msg_seq.max(held_max);
            let history_to = match c.messages.first() {
                None => last,
                Some(m) => m.msg_seq - 1,
            };
            let held_unread = c
                .messages
                .iter()
                .filter(|m| {
                    m.sender != user
                        && m.msg_seq > c.read_seq
                        && !CONTROL_KINDS.contains(&m.kind.as_str())
                        && m.state != STATE_RECALLED
                        && m.state != STATE_DELETED
                })
                .count() as u64;
            tx.execute(
                "INSERT INTO conversations (conv, kind, contiguous_msg_seq, last_msg_seq, read_seq, unread, muted,
                                            pinned, settings_version, updated_sync_seq, history_to, unread_below,
                                            active)
                 VALUES (?1, ?2, ?3, ?3, ?4, ?5, ?6, ?7, 0, ?8, ?9, ?10, ?11)",
                params![
                    c.conv,
                    c.kind,
                    last as i64,
                    c.read_seq as i64,
                    c.unread as i64,
                    c.muted,
                    c.pinned,
                    snap.base_sync_seq as i64,
                    history_to as i64,
                    c.unread.saturating_sub(held_unread) as i64,
                    c.active
                ],
            )
            .map_err(StoreError::from)?;
            for env in &c.messages {
                insert_message(
                    &tx,
                    &Message {
                        conv: env.conv.clone(),
                        msg_seq: env.msg_seq,
                        message_id: env.message_id.clone(),
                        kind: env.kind.clone(),
                        state: env.state.clone(),
                        sender: env.sender.clone(),
                        content: env.content.clone(),
                        created_at: env.created_at,
                        version: env.version.max(1),
                        reactions: serde_json::to_value(&env.reactions).unwrap_or_else(|_| json!({})),
                        sync_seq: None,
                    },
                )?;
                report.messages += 1;
            }
        }
        tx.execute(
            "UPDATE device SET sync_generation = ?1, applied_sync_seq = ?2, acked_sync_seq = 0 WHERE id = 1",
            params![snap.generation as i64, snap.base_sync_seq as i64],
        )
        .map_err(StoreError::from)?;
        save_pending(&tx, snap, true)?;
        let point = FaultPoint::SnapshotBeforeCommit { base_sync_seq: snap.base_sync_seq };
        if fault(&point) == FaultAction::Abort {
            return Err(StoreError::Aborted(point).into());
        }
        tx.commit().map_err(StoreError::from)?;
        Ok(report)
    }

    /// `DEVICE_REVOKED`: deletes every local datum of this device, tokens
    /// and unsent entries included.
    pub fn wipe(&mut self) -> StoreResult<()> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(
            "DELETE FROM messages; DELETE FROM conversations; DELETE FROM control_events; DELETE FROM outbox;
             DELETE FROM snapshot_install;
             UPDATE device SET sync_generation = NULL, applied_sync_seq = 0, acked_sync_seq = 0,
                               refresh_token = NULL WHERE id = 1;",
        )?;
        tx.commit()?;
        Ok(())
    }

    pub fn refresh_token(&self) -> StoreResult<Option<String>> {
        Ok(self.conn.query_row("SELECT refresh_token FROM device WHERE id = 1", [], |r| r.get(0))?)
    }

    /// Persists a refresh token before its access token is used (each works
    /// once, docs/protocol.md §2.3).
    pub fn set_refresh_token(&mut self, token: Option<&str>) -> StoreResult<()> {
        self.conn.execute("UPDATE device SET refresh_token = ?1 WHERE id = 1", params![token])?;
        Ok(())
    }

    /// Makes `conv` known locally (after `conv.create`), with no message.
    pub fn ensure_conversation(&mut self, conv: &str, kind: &str) -> StoreResult<()> {
        self.conn.execute("INSERT OR IGNORE INTO conversations (conv, kind) VALUES (?1, ?2)", params![conv, kind])?;
        Ok(())
    }

    /// Persists an operation with its `client_msg_id` before its first
    /// attempt.
    pub fn enqueue(
        &mut self,
        client_msg_id: &str,
        op: OutboxOp,
        conv: &str,
        kind: &str,
        content: &Value,
    ) -> StoreResult<OutboxEntry> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let pending: i64 = tx.query_row("SELECT COUNT(*) FROM outbox WHERE state = 'pending'", [], |r| r.get(0))?;
        if pending as u64 >= OUTBOX_PENDING_MAX {
            return Err(StoreError::OutboxFull);
        }
        tx.execute(
            "INSERT INTO outbox (client_msg_id, op, conv, kind, content, state, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, 'pending', ?6)",
            params![client_msg_id, op.as_str(), conv, kind, content.to_string(), now_ms()],
        )?;
        let id = tx.last_insert_rowid();
        tx.commit()?;
        self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("outbox entry {id} vanished")))
    }

    /// The oldest pending entry: the next to go out.
    pub fn next_pending(&self) -> StoreResult<Option<OutboxEntry>> {
        let id: Option<i64> = self
            .conn
            .query_row("SELECT id FROM outbox WHERE state = 'pending' ORDER BY id LIMIT 1", [], |r| r.get(0))
            .optional()?;
        match id {
            Some(id) => self.outbox_entry(id),
            None => Ok(None),
        }
    }

    /// Records `send.ok` for outbox entry `id` and stores our own message at
    /// its `msg_seq`, through the conversation cursor, in one transaction.
    /// The message may land above a gap (the sync log has not brought the
    /// events before it yet): it then waits in the pending buffer.
    pub fn record_send_ok(&mut self, id: i64, ok: &SendOk) -> StoreResult<OutboxRecord> {
        let user = self.user.clone();
        let entry = self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("no outbox entry {id}")))?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            "UPDATE outbox SET state = 'accepted', message_id = ?2, msg_seq = ?3, duplicate = ?4, error = NULL
             WHERE id = ?1",
            params![id, ok.message_id, ok.msg_seq as i64, ok.duplicate],
        )?;
        ensure_conv(&tx, &ok.conv)?;
        let mut cursor = load_cursor(&tx, &ok.conv)?;
        let before = cursor.position();
        let msg = Message {
            conv: ok.conv.clone(),
            msg_seq: ok.msg_seq,
            message_id: ok.message_id.clone(),
            kind: entry.kind.clone(),
            state: STATE_NORMAL.into(),
            sender: user.clone(),
            content: entry.content.clone(),
            created_at: ok.created_at,
            version: 1,
            reactions: json!({}),
            sync_seq: None,
        };
        // A duplicate reply describes the original message, which may
        // already be here from the sync log: keep what is stored.
        if held(&tx, &msg.conv, msg.msg_seq, &msg.message_id)?.is_none() {
            insert_message(&tx, &msg)?;
        }
        cursor.offer(ok.msg_seq);
        let (moved, gap) = save_cursor(&tx, &ok.conv, before, &cursor)?;
        let applied: i64 = tx.query_row("SELECT applied_sync_seq FROM device WHERE id = 1", [], |r| r.get(0))?;
        refresh_summary(&tx, &user, &ok.conv, applied as u64)?;
        prune_outbox(&tx)?;
        tx.commit()?;
        let entry = self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("no outbox entry {id}")))?;
        Ok(OutboxRecord { entry, cursor: moved, gap, recalled: None, read: None })
    }

    /// Records `recall.ok` and turns the target into a placeholder here at
    /// once (the recall event follows through the log and changes nothing
    /// more).
    pub fn record_recall_ok(&mut self, id: i64, ok: &RecallOk) -> StoreResult<OutboxRecord> {
        let user = self.user.clone();
        let entry = self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("no outbox entry {id}")))?;
        let target = entry.content["message_id"].as_str().unwrap_or_default().to_owned();
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            "UPDATE outbox SET state = 'accepted', msg_seq = ?2, error = NULL WHERE id = ?1",
            params![id, ok.msg_seq as i64],
        )?;
        let recalled = recall_target(&tx, &entry.conv, &target)?;
        let applied: i64 = tx.query_row("SELECT applied_sync_seq FROM device WHERE id = 1", [], |r| r.get(0))?;
        if recalled.is_some() {
            refresh_summary(&tx, &user, &entry.conv, applied as u64)?;
        }
        prune_outbox(&tx)?;
        tx.commit()?;
        let entry = self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("no outbox entry {id}")))?;
        Ok(OutboxRecord { entry, cursor: None, gap: None, recalled, read: None })
    }

    /// Records `read.ok`: the read position moves up (never back) here too.
    pub fn record_read_ok(&mut self, id: i64, ok: &ReadOk) -> StoreResult<OutboxRecord> {
        let user = self.user.clone();
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            "UPDATE outbox SET state = 'accepted', msg_seq = ?2, error = NULL WHERE id = ?1",
            params![id, ok.read_seq as i64],
        )?;
        ensure_conv(&tx, &ok.conv)?;
        tx.execute(
            "UPDATE conversations SET read_seq = MAX(read_seq, ?2) WHERE conv = ?1",
            params![ok.conv, ok.read_seq as i64],
        )?;
        let applied: i64 = tx.query_row("SELECT applied_sync_seq FROM device WHERE id = 1", [], |r| r.get(0))?;
        refresh_summary(&tx, &user, &ok.conv, applied as u64)?;
        let read =
            tx.query_row("SELECT read_seq, unread FROM conversations WHERE conv = ?1", params![ok.conv], |r| {
                Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64))
            })?;
        prune_outbox(&tx)?;
        tx.commit()?;
        let entry = self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("no outbox entry {id}")))?;
        Ok(OutboxRecord { entry, cursor: None, gap: None, recalled: None, read: Some(read) })
    }

    /// An entry the server refused for good (NOT_MEMBER, FORBIDDEN…).
    pub fn record_failed(&mut self, id: i64, error: &str) -> StoreResult<OutboxEntry> {
        self.conn.execute("UPDATE outbox SET state = 'failed', error = ?2 WHERE id = ?1", params![id, error])?;
        self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("no outbox entry {id}")))
    }

    pub fn outbox_entry(&self, id: i64) -> StoreResult<Option<OutboxEntry>> {
        let row = self.conn.query_row(&format!("{OUTBOX_SELECT} WHERE id = ?1"), params![id], outbox_row).optional()?;
        row.transpose()
    }

    pub fn outbox_by_client_msg_id(&self, client_msg_id: &str) -> StoreResult<Option<OutboxEntry>> {
        let row = self
            .conn
            .query_row(&format!("{OUTBOX_SELECT} WHERE client_msg_id = ?1"), params![client_msg_id], outbox_row)
            .optional()?;
        row.transpose()
    }

    /// Every outbox entry kept, in order.
    pub fn outbox(&self) -> StoreResult<Vec<OutboxEntry>> {
        let mut stmt = self.conn.prepare(&format!("{OUTBOX_SELECT} ORDER BY id"))?;
        let rows = stmt.query_map([], outbox_row)?.collect::<Result<Vec<_>, _>>()?;
        rows.into_iter().collect()
    }

    /// Conversations, pinned first, then by their latest message.
    pub fn conversations(&self) -> StoreResult<Vec<Conversation>> {
        let mut stmt = self.conn.prepare(&format!(
            "SELECT c.conv, c.kind, c.contiguous_msg_seq, c.last_msg_seq, c.read_seq, c.unread, c.muted, c.pinned,
                    c.history_to, c.active
             FROM conversations c
             ORDER BY c.pinned DESC,
                      COALESCE((SELECT m.created_at FROM messages m WHERE m.conv = c.conv
                                AND m.kind NOT IN {CONTROL_KINDS_SQL} ORDER BY m.msg_seq DESC LIMIT 1), 0) DESC,
                      c.conv"
        ))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(Conversation {
                    conv: r.get(0)?,
                    kind: r.get(1)?,
                    contiguous_msg_seq: r.get::<_, i64>(2)? as u64,
                    last_msg_seq: r.get::<_, i64>(3)? as u64,
                    read_seq: r.get::<_, i64>(4)? as u64,
                    unread: r.get::<_, i64>(5)? as u64,
                    muted: r.get(6)?,
                    pinned: r.get(7)?,
                    history_to: r.get::<_, i64>(8)? as u64,
                    active: r.get(9)?,
                    last_message: None,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = Vec::with_capacity(rows.len());
        for mut c in rows {
            c.last_message = self
                .conn
                .query_row(
                    &format!(
                        "{MESSAGE_SELECT} WHERE conv = ?1 AND kind NOT IN {CONTROL_KINDS_SQL}
                         ORDER BY msg_seq DESC LIMIT 1"
                    ),
                    params![c.conv],
                    message_row,
                )
                .optional()?;
            out.push(c);
        }
        Ok(out)
    }

    pub fn conversation(&self, conv: &str) -> StoreResult<Option<Conversation>> {
        Ok(self.conversations()?.into_iter().find(|c| c.conv == conv))
    }

    /// The user messages of `conv` held locally, in `msg_seq` order (those
    /// above a gap included; [`Conversation::contiguous_msg_seq`] says where
    /// the complete prefix ends). Recalled messages stay, as placeholders.
    pub fn messages(&self, conv: &str) -> StoreResult<Vec<Message>> {
        self.query_messages(
            &format!("{MESSAGE_SELECT} WHERE conv = ?1 AND kind NOT IN {CONTROL_KINDS_SQL} ORDER BY msg_seq"),
            conv,
        )
    }

    /// Every conversation event of `conv` held locally (messages and control
    /// events), in `msg_seq` order.
    pub fn events(&self, conv: &str) -> StoreResult<Vec<Message>> {
        self.query_messages(&format!("{MESSAGE_SELECT} WHERE conv = ?1 ORDER BY msg_seq"), conv)
    }

    fn query_messages(&self, sql: &str, conv: &str) -> StoreResult<Vec<Message>> {
        let mut stmt = self.conn.prepare(sql)?;
        let rows = stmt.query_map(params![conv], message_row)?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Conversations whose cursor waits below an event held above a gap.
    pub fn conversations_with_gap(&self) -> StoreResult<Vec<String>> {
        let mut stmt = self
            .conn
            .prepare("SELECT conv FROM conversations WHERE contiguous_msg_seq < last_msg_seq ORDER BY conv")?;
        let rows = stmt.query_map([], |r| r.get(0))?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Events of kinds this client keeps verbatim: `(sync_seq, kind, conv)`.
    pub fn kept_verbatim(&self) -> StoreResult<Vec<(u64, String, String)>> {
        let mut stmt = self.conn.prepare("SELECT sync_seq, kind, conv FROM control_events ORDER BY sync_seq")?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?, r.get(2)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}

const OUTBOX_SELECT: &str = "SELECT id, client_msg_id, op, conv, kind, content, state, created_at, message_id,
                                    msg_seq, duplicate, error FROM outbox";
const MESSAGE_SELECT: &str = "SELECT conv, msg_seq, message_id, kind, state, sender, content, created_at, version,
                                     reactions, sync_seq FROM messages";

fn outbox_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<StoreResult<OutboxEntry>> {
    let op: String = r.get(2)?;
    let Some(op) = OutboxOp::parse(&op) else {
        return Ok(Err(StoreError::Integrity(format!("outbox op {op:?}"))));
    };
    let content: String = r.get(5)?;
    let state: String = r.get(6)?;
    Ok(Ok(OutboxEntry {
        id: r.get(0)?,
        client_msg_id: r.get(1)?,
        op,
        conv: r.get(3)?,
        kind: r.get(4)?,
        content: serde_json::from_str(&content).unwrap_or(Value::Null),
        state: OutboxState::parse(&state),
        created_at: r.get(7)?,
        message_id: r.get(8)?,
        msg_seq: r.get::<_, Option<i64>>(9)?.map(|s| s as u64),
        duplicate: r.get::<_, Option<bool>>(10)?.unwrap_or(false),
        error: r.get(11)?,
    }))
}

fn message_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Message> {
    let content: String = r.get(6)?;
    let reactions: String = r.get(9)?;
    Ok(Message {
        conv: r.get(0)?,
        msg_seq: r.get::<_, i64>(1)? as u64,
        message_id: r.get(2)?,
        kind: r.get(3)?,
        state: r.get(4)?,
        sender: r.get(5)?,
        content: serde_json::from_str(&content).unwrap_or(Value::Null),
        created_at: r.get(7)?,
        version: r.get::<_, i64>(8)? as u64,
        reactions: serde_json::from_str(&reactions).unwrap_or_else(|_| json!({})),
        sync_seq: r.get::<_, Option<i64>>(10)?.map(|s| s as u64),
    })
}

/// Adds the columns of [`CONVERSATION_COLUMNS`] that an older database lacks.
fn migrate(conn: &Connection) -> StoreResult<()> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info('conversations')")?;
    let have = stmt.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<Vec<_>, _>>()?;
    for (name, decl) in CONVERSATION_COLUMNS {
        if !have.iter().any(|h| h == name) {
            conn.execute_batch(&format!("ALTER TABLE conversations ADD COLUMN {name} {decl}"))?;
        }
    }
    Ok(())
}

fn save_pending(conn: &Connection, snap: &PendingSnapshot, installed: bool) -> StoreResult<()> {
    conn.execute(
        "INSERT OR REPLACE INTO snapshot_install
             (id, snapshot_id, token, generation, base_sync_seq, manifest_digest, pages, installed)
         VALUES (1, ?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            snap.snapshot_id,
            snap.token,
            snap.generation as i64,
            snap.base_sync_seq as i64,
            snap.manifest_digest,
            snap.pages as i64,
            installed
        ],
    )?;
    Ok(())
}

/// A conversation item of a snapshot with the message items that follow it.
struct SnapshotConv {
    conv: String,
    kind: String,
    last_msg_seq: u64,
    read_seq: u64,
    unread: u64,
    muted: bool,
    pinned: bool,
    active: bool,
    messages: Vec<Envelope>,
}

/// Reads snapshot items (docs/protocol.md §3.21): each conversation item,
/// then its message items ascending by `msg_seq`. Items of unknown types
/// are ignored.
fn parse_snapshot(items: &[Value]) -> Result<Vec<SnapshotConv>, ApplyError> {
    let mut out: Vec<SnapshotConv> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (index, item) in items.iter().enumerate() {
        let bad = |why: &str| ApplyError::BadSnapshot { index, why: why.to_owned() };
        match item["type"].as_str() {
            Some("conv") => {
                let text = |k: &str| item[k].as_str().map(str::to_owned).ok_or_else(|| bad(&format!("{k} missing")));
                let num = |k: &str| item[k].as_u64().ok_or_else(|| bad(&format!("{k} missing")));
                let flag = |k: &str| item[k].as_bool().ok_or_else(|| bad(&format!("{k} missing")));
                let c = SnapshotConv {
                    conv: text("conv")?,
                    kind: text("kind")?,
                    last_msg_seq: num("last_msg_seq")?,
                    read_seq: num("read_seq")?,
                    unread: num("unread")?,
                    muted: flag("muted")?,
                    pinned: flag("pinned")?,
                    active: item["active"].as_bool().unwrap_or(true),
                    messages: Vec::new(),
                };
                if !seen.insert(c.conv.clone()) {
                    return Err(bad("a conversation appears twice"));
                }
                out.push(c);
            }
            Some("message") => {
                let env: Envelope = serde_json::from_value(item["message"].clone()).map_err(|e| bad(&e.to_string()))?;
                let conv = out.last_mut().ok_or_else(|| bad("a message before any conversation"))?;
                if env.conv != conv.conv {
                    return Err(bad("a message outside its conversation"));
                }
                if env.msg_seq == 0 || conv.messages.last().is_some_and(|m| m.msg_seq >= env.msg_seq) {
                    return Err(bad("messages out of order"));
                }
                conv.messages.push(env);
            }
            _ => {}
        }
    }
    Ok(out)
}

fn read_position(tx: &Transaction<'_>) -> StoreResult<(Option<u64>, u64)> {
    Ok(tx.query_row("SELECT sync_generation, applied_sync_seq FROM device WHERE id = 1", [], |r| {
        Ok((r.get::<_, Option<i64>>(0)?.map(|g| g as u64), r.get::<_, i64>(1)? as u64))
    })?)
}

fn ensure_conv(tx: &Transaction<'_>, conv: &str) -> StoreResult<()> {
    tx.execute("INSERT OR IGNORE INTO conversations (conv, kind) VALUES (?1, 'direct')", params![conv])?;
    Ok(())
}

/// The conversation's cursor, rebuilt from its persisted position and the
/// rows held above it (the persistent pending buffer).
fn load_cursor(tx: &Transaction<'_>, conv: &str) -> StoreResult<ConvCursor> {
    let position: i64 =
        tx.query_row("SELECT contiguous_msg_seq FROM conversations WHERE conv = ?1", params![conv], |r| r.get(0))?;
    let mut stmt =
        tx.prepare_cached("SELECT msg_seq FROM messages WHERE conv = ?1 AND msg_seq > ?2 ORDER BY msg_seq LIMIT ?3")?;
    let above = stmt
        .query_map(params![conv, position, PENDING_MAX as i64], |r| r.get::<_, i64>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ConvCursor::restore(Policy::Contiguous, position as u64, above.into_iter().map(|s| s as u64)))
}

/// What is held at `(conv, msg_seq)`: `(version, state)`; an error if it is
/// another message (one `msg_seq`, two ids: never overwrite, never guess).
fn held(tx: &Transaction<'_>, conv: &str, msg_seq: u64, message_id: &str) -> StoreResult<Option<(u64, String)>> {
    let row: Option<(String, i64, String)> = tx
        .query_row(
            "SELECT message_id, version, state FROM messages WHERE conv = ?1 AND msg_seq = ?2",
            params![conv, msg_seq as i64],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    match row {
        None => Ok(None),
        Some((id, version, state)) if id == message_id => Ok(Some((version as u64, state))),
        Some((id, ..)) => {
            Err(StoreError::Integrity(format!("{conv}#{msg_seq} is {id} locally and {message_id} from the server")))
        }
    }
}

fn insert_message(tx: &Transaction<'_>, msg: &Message) -> StoreResult<()> {
    tx.execute(
        "INSERT INTO messages (conv, msg_seq, message_id, kind, state, sender, content, created_at, version,
                               reactions, sync_seq)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        params![
            msg.conv,
            msg.msg_seq as i64,
            msg.message_id,
            msg.kind,
            msg.state,
            msg.sender,
            msg.content.to_string(),
            msg.created_at,
            msg.version as i64,
            msg.reactions.to_string(),
            msg.sync_seq.map(|s| s as i64)
        ],
    )?;
    Ok(())
}

/// Stores a conversation event's envelope. The envelope is read when the
/// page is served, so it replaces what is held when its version is not
/// lower (E2); a placeholder is final (`recalled`), and `deleted` (for this
/// user) wins over everything.
fn store_envelope(tx: &Transaction<'_>, msg: &Message) -> StoreResult<()> {
    let Some((version, state)) = held(tx, &msg.conv, msg.msg_seq, &msg.message_id)? else {
        return insert_message(tx, msg);
    };
    let final_here = state == STATE_DELETED || (state == STATE_RECALLED && msg.state != STATE_DELETED);
    if final_here || msg.version < version {
        tx.execute(
            "UPDATE messages SET sync_seq = COALESCE(sync_seq, ?2) WHERE message_id = ?1",
            params![msg.message_id, msg.sync_seq.map(|s| s as i64)],
        )?;
        return Ok(());
    }
    tx.execute(
        "UPDATE messages SET state = ?2, content = ?3, version = ?4, reactions = ?5,
                             sync_seq = COALESCE(sync_seq, ?6)
         WHERE message_id = ?1",
        params![
            msg.message_id,
            msg.state,
            msg.content.to_string(),
            msg.version as i64,
            msg.reactions.to_string(),
            msg.sync_seq.map(|s| s as i64)
        ],
    )?;
    Ok(())
}

/// The held target of a control event: `(msg_seq, version, state)`.
fn target(tx: &Transaction<'_>, conv: &str, message_id: &str) -> StoreResult<Option<(u64, u64, String)>> {
    Ok(tx
        .query_row(
            "SELECT msg_seq, version, state FROM messages WHERE conv = ?1 AND message_id = ?2",
            params![conv, message_id],
            |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64, r.get(2)?)),
        )
        .optional()?)
}

/// E1: the target becomes a placeholder (state `recalled`, content `{}`, no
/// reactions), and the text of its earlier edit events is discarded
/// (docs/protocol.md §3.4.4). Returns the target if it changed here.
fn recall_target(tx: &Transaction<'_>, conv: &str, message_id: &str) -> StoreResult<Option<(String, u64)>> {
    let Some((msg_seq, _, state)) = target(tx, conv, message_id)? else {
        // Not held (outside this user's periods): nothing to hide.
        return Ok(None);
    };
    tx.execute(
        "UPDATE messages SET content = json_remove(content, '$.content')
         WHERE conv = ?1 AND kind = 'edit' AND json_extract(content, '$.target_message_id') = ?2",
        params![conv, message_id],
    )?;
    if state == STATE_RECALLED || state == STATE_DELETED {
        return Ok(None);
    }
    tx.execute(
        "UPDATE messages SET state = ?2, content = '{}', reactions = '{}', version = version + 1
         WHERE message_id = ?1",
        params![message_id, STATE_RECALLED],
    )?;
    Ok(Some((conv.to_owned(), msg_seq)))
}

/// E2: an edit or a reaction applies only above the version held, never to
/// a placeholder or a message this user deleted.
fn apply_versioned(tx: &Transaction<'_>, conv: &str, kind: &str, content: &Value) -> StoreResult<()> {
    let (Some(message_id), Some(new_version)) = (content["target_message_id"].as_str(), content["version"].as_u64())
    else {
        return Ok(());
    };
    let Some((_, version, state)) = target(tx, conv, message_id)? else {
        return Ok(());
    };
    if new_version <= version || state == STATE_RECALLED || state == STATE_DELETED {
        return Ok(());
    }
    if kind == "edit" {
        tx.execute(
            "UPDATE messages SET content = ?2, state = ?3, version = ?4 WHERE message_id = ?1",
            params![message_id, content["content"].to_string(), STATE_EDITED, new_version as i64],
        )?;
        return Ok(());
    }
    let reactions: String =
        tx.query_row("SELECT reactions FROM messages WHERE message_id = ?1", params![message_id], |r| r.get(0))?;
    let mut reactions: BTreeMap<String, Vec<String>> = serde_json::from_str(&reactions).unwrap_or_default();
    let (Some(reaction), Some(user)) = (content["reaction"].as_str(), content["user"].as_str()) else {
        return Ok(());
    };
    let users = reactions.entry(reaction.to_owned()).or_default();
    users.retain(|u| u != user);
    if content["op"].as_str() == Some("add") {
        users.push(user.to_owned());
        users.sort();
    }
    reactions.retain(|_, users| !users.is_empty());
    let reactions = serde_json::to_string(&reactions).map_err(|e| StoreError::Integrity(e.to_string()))?;
    tx.execute(
        "UPDATE messages SET reactions = ?2, version = ?3 WHERE message_id = ?1",
        params![message_id, reactions, new_version as i64],
    )?;
    Ok(())
}

type Touched = BTreeMap<String, Option<(u64, ConvCursor)>>;

/// A conversation event (a message or a control event) with its envelope.
fn apply_conv_event(
    tx: &Transaction<'_>,
    user: &str,
    e: &UserEvent,
    env: &Envelope,
    touched: &mut Touched,
    report: &mut PageReport,
) -> Result<(), ApplyError> {
    let malformed = |why: &str| ApplyError::Malformed { sync_seq: e.sync_seq, why: why.to_owned() };
    if env.conv != e.conv {
        return Err(malformed("the envelope names another conversation"));
    }
    if e.msg_seq.is_some_and(|s| s != env.msg_seq) {
        return Err(malformed("the event and its envelope disagree on msg_seq"));
    }
    if env.msg_seq == 0 {
        return Err(malformed("msg_seq 0"));
    }
    ensure_conv(tx, &env.conv)?;
    let slot = touched.entry(env.conv.clone()).or_insert(None);
    if slot.is_none() {
        let cursor = load_cursor(tx, &env.conv)?;
        *slot = Some((cursor.position(), cursor));
    }
    let (_, cursor) = slot.as_mut().expect("loaded above");
    // A period of this user starts at its own join event: what lies below
    // it is outside the user's view, not a gap (§3.4.2).
    if env.kind == "member.join" && env.content["user"].as_str() == Some(user) {
        cursor.start_at(env.msg_seq - 1);
    }
    if (env.kind == "member.join" || env.kind == "member.leave") && env.content["user"].as_str() == Some(user) {
        tx.execute(
            "UPDATE conversations SET active = ?2 WHERE conv = ?1",
            params![env.conv, env.kind == "member.join"],
        )
        .map_err(StoreError::from)?;
    }
    store_envelope(
        tx,
        &Message {
            conv: env.conv.clone(),
            msg_seq: env.msg_seq,
            message_id: env.message_id.clone(),
            kind: env.kind.clone(),
            state: env.state.clone(),
            sender: env.sender.clone(),
            content: env.content.clone(),
            created_at: env.created_at,
            version: env.version.max(1),
            reactions: serde_json::to_value(&env.reactions).unwrap_or_else(|_| json!({})),
            sync_seq: Some(e.sync_seq),
        },
    )?;
    // The outcome is read back from the cursor once the page is done, so
    // the report names each conversation's move once.
    cursor.offer(env.msg_seq);
    match env.kind.as_str() {
        "recall" => {
            if let Some(target_id) = env.content["target_message_id"].as_str() {
                report.recalled.extend(recall_target(tx, &env.conv, target_id)?);
            }
        }
        "edit" | "reaction" => apply_versioned(tx, &env.conv, &env.kind, &env.content)?,
        _ => {}
    }
    report.messages.push(AppliedMessage {
        sync_seq: e.sync_seq,
        conv: env.conv.clone(),
        msg_seq: env.msg_seq,
        kind: env.kind.clone(),
        sender: env.sender.clone(),
    });
    Ok(())
}

/// A per-user event (`read`, `settings`, `delete`), or a kind this client
/// does not know: kept verbatim and counted as applied (§3.2).
fn apply_user_event(
    tx: &Transaction<'_>,
    e: &UserEvent,
    touched: &mut Touched,
    report: &mut PageReport,
) -> Result<(), ApplyError> {
    let data = e.data.as_ref().unwrap_or(&Value::Null);
    let applied = match e.kind.as_str() {
        "read" => match data["read_seq"].as_u64() {
            Some(read_seq) => {
                ensure_conv(tx, &e.conv)?;
                tx.execute(
                    "UPDATE conversations SET read_seq = MAX(read_seq, ?2) WHERE conv = ?1",
                    params![e.conv, read_seq as i64],
                )
                .map_err(StoreError::from)?;
                report.reads.push((e.conv.clone(), read_seq));
                true
            }
            None => false,
        },
        "settings" => match (data["muted"].as_bool(), data["pinned"].as_bool(), data["version"].as_u64()) {
            (Some(muted), Some(pinned), Some(version)) => {
                ensure_conv(tx, &e.conv)?;
                tx.execute(
                    "UPDATE conversations SET muted = ?2, pinned = ?3, settings_version = ?4
                     WHERE conv = ?1 AND settings_version < ?4",
                    params![e.conv, muted, pinned, version as i64],
                )
                .map_err(StoreError::from)?;
                true
            }
            _ => false,
        },
        "delete" => match data["message_id"].as_str() {
            Some(message_id) => {
                tx.execute(
                    "UPDATE messages SET state = ?3, content = '{}', reactions = '{}' WHERE conv = ?1 AND message_id = ?2",
                    params![e.conv, message_id, STATE_DELETED],
                )
                .map_err(StoreError::from)?;
                true
            }
            None => false,
        },
        _ => false,
    };
    if applied {
        touched.entry(e.conv.clone()).or_insert(None);
        return Ok(());
    }
    let body =
        serde_json::to_string(e).map_err(|err| ApplyError::Malformed { sync_seq: e.sync_seq, why: err.to_string() })?;
    tx.execute(
        "INSERT OR REPLACE INTO control_events (sync_seq, kind, conv, msg_seq, body) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![e.sync_seq as i64, e.kind, e.conv, e.msg_seq.map(|s| s as i64), body],
    )
    .map_err(StoreError::from)?;
    report.kept_verbatim += 1;
    Ok(())
}

/// Writes the cursor position (in the caller's transaction); returns the
/// move and the remaining gap, if any.
fn save_cursor(
    tx: &Transaction<'_>,
    conv: &str,
    before: u64,
    cursor: &ConvCursor,
) -> StoreResult<(Option<CursorMove>, Option<Gap>)> {
    let to = cursor.position();
    assert!(to >= before, "a conversation cursor never moves back ({conv}: {before} -> {to})");
    tx.execute("UPDATE conversations SET contiguous_msg_seq = ?2 WHERE conv = ?1", params![conv, to as i64])?;
    let moved = (to > before).then(|| CursorMove { conv: conv.to_owned(), from: before, to });
    let gap = cursor.missing().map(|m| Gap {
        conv: conv.to_owned(),
        contiguous_msg_seq: to,
        missing_from: *m.start(),
        missing_to: *m.end(),
    });
    Ok((moved, gap))
}

/// Recomputes a conversation's summary from what is held (in the caller's
/// transaction): the last `msg_seq`, the read position (one's own events
/// count as read, §3.6) and the unread count (messages from others above
/// it, not recalled, not deleted, never control events, R3).
fn refresh_summary(tx: &Transaction<'_>, user: &str, conv: &str, sync_seq: u64) -> StoreResult<()> {
    tx.execute(
        "UPDATE conversations SET
             last_msg_seq = MAX(last_msg_seq, (SELECT COALESCE(MAX(msg_seq), 0) FROM messages WHERE conv = ?1)),
             read_seq = MAX(read_seq, (SELECT COALESCE(MAX(msg_seq), 0) FROM messages
                                        WHERE conv = ?1 AND sender = ?2)),
             updated_sync_seq = MAX(updated_sync_seq, ?3)
         WHERE conv = ?1",
        params![conv, user, sync_seq as i64],
    )?;
    tx.execute(
        &format!(
            "UPDATE conversations SET unread = (
                 SELECT COUNT(*) FROM messages m
                 WHERE m.conv = ?1 AND m.sender <> ?2 AND m.msg_seq > conversations.read_seq
                   AND m.kind NOT IN {CONTROL_KINDS_SQL} AND m.state NOT IN ('recalled', 'deleted'))
                 + CASE WHEN read_seq < history_to THEN unread_below ELSE 0 END
             WHERE conv = ?1"
        ),
        params![conv, user],
    )?;
    Ok(())
}

fn prune_outbox(tx: &Transaction<'_>) -> StoreResult<()> {
    tx.execute(
        "DELETE FROM outbox WHERE state <> 'pending' AND id NOT IN
             (SELECT id FROM outbox WHERE state <> 'pending' ORDER BY id DESC LIMIT ?1)",
        params![OUTBOX_DONE_KEEP as i64],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Built from JSON, as they arrive on the wire, so fields the protocol
    // adds later take their defaults here too.
    fn conv_event(sync_seq: u64, conv: &str, msg_seq: u64, kind: &str, sender: &str, content: Value) -> UserEvent {
        let event_kind = match kind {
            "recall" | "edit" | "reaction" => kind,
            "member.join" | "member.leave" | "conv.created" => "membership",
            _ => "message",
        };
        serde_json::from_value(json!({
            "sync_seq": sync_seq, "kind": event_kind, "conv": conv, "msg_seq": msg_seq,
            "message": {
                "message_id": format!("m-{conv}-{msg_seq}"), "conv": conv, "msg_seq": msg_seq, "kind": kind,
                "state": "normal", "sender": sender, "content": content, "created_at": 1000 + msg_seq, "version": 1,
            },
        }))
        .unwrap()
    }

    fn event(sync_seq: u64, conv: &str, msg_seq: u64, sender: &str) -> UserEvent {
        conv_event(sync_seq, conv, msg_seq, "text", sender, json!({ "n": msg_seq }))
    }

    fn page_at(generation: u64, resume_from: u64, events: Vec<UserEvent>, hw: u64) -> SyncOk {
        serde_json::from_value(json!({
            "sync_generation": generation, "resume_from": resume_from, "batch_high_watermark": hw,
            "server_acked_sync_seq": resume_from, "events": events, "next_cursor": null, "has_more": false,
            "batch_token": "t",
        }))
        .unwrap()
    }

    fn page(events: Vec<UserEvent>, hw: u64) -> SyncOk {
        page_at(1, 0, events, hw)
    }

    fn open() -> (tempfile::TempDir, LocalStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(&dir.path().join("local.db"), "bob", "phone").unwrap();
        (dir, s)
    }

    const GO: &dyn Fn(&FaultPoint) -> FaultAction = &|_| FaultAction::Continue;

    #[test]
    fn control_kinds_sql_matches_the_list() {
        let listed: Vec<String> = CONTROL_KINDS.iter().map(|k| format!("'{k}'")).collect();
        assert_eq!(CONTROL_KINDS_SQL, format!("({})", listed.join(", ")));
    }

    #[test]
    fn a_page_and_its_replay_apply_once() {
        let (_d, mut s) = open();
        let p = page(vec![event(1, "c1", 1, "ann"), event(2, "c1", 2, "bob"), event(3, "c1", 3, "ann")], 3);
        let r = s.apply_page(&p, GO).unwrap();
        assert_eq!((r.applied, r.skipped, r.applied_sync_seq), (3, 0, 3));
        assert_eq!(r.cursors, vec![CursorMove { conv: "c1".into(), from: 0, to: 3 }]);
        let r = s.apply_page(&p, GO).unwrap();
        assert_eq!((r.applied, r.skipped), (0, 3), "a replayed batch is skipped");
        let c = s.conversation("c1").unwrap().unwrap();
        assert_eq!((c.contiguous_msg_seq, c.last_msg_seq, c.read_seq, c.unread), (3, 3, 2, 1));
        assert_eq!(s.messages("c1").unwrap().len(), 3);
    }

    #[test]
    fn a_hole_in_the_user_log_applies_nothing() {
        let (_d, mut s) = open();
        let err = s.apply_page(&page(vec![event(1, "c1", 1, "ann"), event(3, "c1", 2, "ann")], 3), GO).unwrap_err();
        assert_eq!(err, ApplyError::Hole { expected: 2, got: 3 });
        assert_eq!(s.position().unwrap(), SyncPosition::default(), "rolled back");
        assert!(s.messages("c1").unwrap().is_empty());
    }

    #[test]
    fn an_aborted_page_leaves_nothing() {
        let (_d, mut s) = open();
        let abort: &dyn Fn(&FaultPoint) -> FaultAction = &|_| FaultAction::Abort;
        let err = s.apply_page(&page(vec![event(1, "c1", 1, "ann")], 1), abort).unwrap_err();
        assert!(matches!(err, ApplyError::Store(StoreError::Aborted(FaultPoint::BeforeCommit { .. }))));
        assert_eq!(s.position().unwrap(), SyncPosition::default());
        assert!(s.conversations().unwrap().is_empty());
    }

    #[test]
    fn a_newer_generation_is_adopted_only_when_it_skips_nothing() {
        let (_d, mut s) = open();
        s.apply_page(&page(vec![event(1, "c1", 1, "ann"), event(2, "c1", 2, "ann")], 2), GO).unwrap();
        // A replay from above what is applied would skip sync_seq 3.
        let err = s.apply_page(&page_at(2, 3, vec![event(4, "c1", 4, "ann")], 4), GO).unwrap_err();
        assert!(matches!(err, ApplyError::GenerationMismatch { local: 1, page: 2, .. }));
        // An older generation is stale.
        let err = s.apply_page(&page_at(0, 0, vec![], 2), GO).unwrap_err();
        assert!(matches!(err, ApplyError::GenerationMismatch { local: 1, page: 0, .. }));
        // A recovery replay from this device's own position (D6).
        let r = s.apply_page(&page_at(2, 2, vec![event(3, "c1", 3, "ann")], 3), GO).unwrap();
        assert_eq!(r.applied, 1);
        assert_eq!(s.position().unwrap().generation, Some(2));
    }

    #[test]
    fn own_send_above_a_gap_waits_then_the_log_fills_it() {
        let (_d, mut s) = open();
        s.apply_page(&page(vec![event(1, "c1", 1, "ann")], 1), GO).unwrap();
        let e = s.enqueue("cm-1", OutboxOp::Send, "c1", "text", &json!({"n": 3})).unwrap();
        let ok: SendOk = serde_json::from_value(
            json!({"message_id": "m-c1-3", "conv": "c1", "msg_seq": 3, "created_at": 5, "duplicate": false}),
        )
        .unwrap();
        let rec = s.record_send_ok(e.id, &ok).unwrap();
        assert_eq!(rec.cursor, None, "3 is above the gap at 2");
        assert_eq!(rec.gap.as_ref().map(|g| (g.missing_from, g.missing_to)), Some((2, 2)));
        let p = page_at(1, 1, vec![event(2, "c1", 2, "ann"), event(3, "c1", 3, "bob")], 3);
        let r = s.apply_page(&p, GO).unwrap();
        assert_eq!(r.cursors, vec![CursorMove { conv: "c1".into(), from: 1, to: 3 }]);
        assert!(r.gaps.is_empty());
        let msgs = s.messages("c1").unwrap();
        assert_eq!(msgs.iter().map(|m| m.msg_seq).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(msgs[2].sync_seq, Some(3), "the log's copy records its sync_seq");
    }

    #[test]
    fn a_recall_leaves_a_placeholder_and_late_edits_do_not_revive_it() {
        let (_d, mut s) = open();
        let target = "m-c1-1";
        let events = vec![
            event(1, "c1", 1, "ann"),
            conv_event(
                2,
                "c1",
                2,
                "edit",
                "ann",
                json!({"target_message_id": target, "target_msg_seq": 1,
                                                          "version": 2, "content": {"text": "edited"}}),
            ),
            conv_event(3, "c1", 3, "recall", "ann", json!({"target_message_id": target, "target_msg_seq": 1})),
            conv_event(
                4,
                "c1",
                4,
                "reaction",
                "bob",
                json!({"target_message_id": target, "target_msg_seq": 1,
                                                              "reaction": "+1", "op": "add", "user": "bob",
                                                              "version": 9}),
            ),
        ];
        let r = s.apply_page(&page(events, 4), GO).unwrap();
        assert_eq!(r.recalled, vec![("c1".to_owned(), 1)]);
        assert_eq!(r.cursors, vec![CursorMove { conv: "c1".into(), from: 0, to: 4 }], "control events hold seqs");
        let msgs = s.messages("c1").unwrap();
        assert_eq!(msgs.len(), 1, "control events are not messages");
        assert_eq!(
            (msgs[0].state.as_str(), &msgs[0].content, &msgs[0].reactions),
            ("recalled", &json!({}), &json!({}))
        );
        let edit = s.events("c1").unwrap().into_iter().find(|m| m.kind == "edit").unwrap();
        assert!(edit.content.get("content").is_none(), "the edit's text is discarded too");
        let c = s.conversation("c1").unwrap().unwrap();
        assert_eq!(c.unread, 0, "a placeholder is not unread");
    }

    #[test]
    fn edits_and_reactions_apply_only_above_the_version_held() {
        let (_d, mut s) = open();
        let t = "m-c1-1";
        let edit = |seq, version, text: &str| {
            conv_event(
                seq,
                "c1",
                seq,
                "edit",
                "ann",
                json!({"target_message_id": t, "target_msg_seq": 1,
                                                              "version": version, "content": {"text": text}}),
            )
        };
        let events = vec![event(1, "c1", 1, "ann"), edit(2, 3, "newer"), edit(3, 2, "older")];
        s.apply_page(&page(events, 3), GO).unwrap();
        let m = &s.messages("c1").unwrap()[0];
        assert_eq!((m.content["text"].as_str(), m.version, m.state.as_str()), (Some("newer"), 3, "edited"));
    }

    #[test]
    fn a_join_starts_the_cursor_at_the_period() {
        let (_d, mut s) = open();
        let join = conv_event(1, "g1", 7, "member.join", "ann", json!({"user": "bob", "by": "ann", "op": "add"}));
        let r = s.apply_page(&page(vec![join, event(2, "g1", 8, "ann")], 2), GO).unwrap();
        assert_eq!(r.cursors, vec![CursorMove { conv: "g1".into(), from: 0, to: 8 }]);
        assert!(r.gaps.is_empty(), "msg_seq 1..=6 are outside bob's period, not a gap");
        // Someone else's join is just an event.
        let other = conv_event(3, "g1", 10, "member.join", "ann", json!({"user": "cat", "by": "ann", "op": "add"}));
        let r = s.apply_page(&page_at(1, 2, vec![other], 3), GO).unwrap();
        assert_eq!(r.gaps.len(), 1, "msg_seq 9 is missing");
    }

    #[test]
    fn per_user_events_move_the_read_position_and_settings() {
        let (_d, mut s) = open();
        let events = vec![
            event(1, "c1", 1, "ann"),
            event(2, "c1", 2, "ann"),
            serde_json::from_value(json!({"sync_seq": 3, "kind": "read", "conv": "c1", "msg_seq": 1,
                                          "data": {"read_seq": 1, "unread": 1}}))
            .unwrap(),
            serde_json::from_value(json!({"sync_seq": 4, "kind": "settings", "conv": "c1",
                                          "data": {"muted": true, "pinned": false, "version": 1}}))
            .unwrap(),
            serde_json::from_value(json!({"sync_seq": 5, "kind": "future.kind", "conv": "c1"})).unwrap(),
        ];
        let r = s.apply_page(&page(events, 5), GO).unwrap();
        assert_eq!((r.applied, r.kept_verbatim, r.reads.clone()), (5, 1, vec![("c1".to_owned(), 1)]));
        let c = s.conversation("c1").unwrap().unwrap();
        assert_eq!((c.read_seq, c.unread, c.muted), (1, 1, true));
        assert_eq!(s.kept_verbatim().unwrap(), vec![(5, "future.kind".to_owned(), "c1".to_owned())]);
    }

    #[test]
    fn reset_keeps_the_outbox() {
        let (_d, mut s) = open();
        s.apply_page(&page(vec![event(1, "c1", 1, "ann")], 1), GO).unwrap();
        s.enqueue("cm-1", OutboxOp::Send, "c1", "text", &json!({})).unwrap();
        s.reset(Some(7)).unwrap();
        assert_eq!(s.position().unwrap(), SyncPosition { generation: Some(7), applied_sync_seq: 0, acked_sync_seq: 0 });
        assert!(s.conversations().unwrap().is_empty());
        assert_eq!(s.next_pending().unwrap().unwrap().client_msg_id, "cm-1");
    }

    #[test]
    fn the_manifest_digest_is_the_documented_one() {
        // docs/protocol.md §3.22: the empty input, then keys sorted, no
        // whitespace, one newline per item.
        assert_eq!(manifest_digest([]), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        let item = json!({"type": "conv", "conv": "c1", "active": true});
        use sha2::Digest;
        let want: String = sha2::Sha256::digest(b"{\"active\":true,\"conv\":\"c1\",\"type\":\"conv\"}\n")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(manifest_digest([&item]), want);
    }

    #[test]
    fn a_store_belongs_to_one_device() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("local.db");
        drop(LocalStore::open(&path, "bob", "phone").unwrap());
        assert!(matches!(LocalStore::open(&path, "bob", "desktop"), Err(StoreError::WrongOwner { .. })));
    }
}
