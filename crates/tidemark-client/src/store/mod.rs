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
//!   `history_to`, counted while `read_seq` is below it); `counted_upto`,
//!   `summary_dirty`, `summary_rev`: what the unread count was counted
//!   from, so a page adds its own messages instead of counting the
//!   conversation again (`apply::refresh_summary`, kept honest by the
//!   triggers of `schema::SUMMARY_TRIGGERS`).
//! - `messages` — key `(conv, msg_seq)`, `message_id` unique: every
//!   conversation event held (user messages and control events), its
//!   envelope with `version` and `reactions`, and the `sync_seq` that
//!   delivered it (NULL while known only from our own `send.ok`).
//! - `control_events` — key `sync_seq`: events of kinds this client does not
//!   interpret, kept verbatim (they count as applied).
//! - `privacy` — one row: the user's privacy switches (`hide_presence`,
//!   `private_receipts`, `push_preview`) and their `version`, from the
//!   user's `privacy` events and snapshots (issue 18).
//! - `gap_stats`, `gap_durations` — the gap counts and repair durations
//!   `client.stats` reports (O1).
//! - `snapshot_install` — at most one row: the snapshot being installed
//!   (token, generation, base, digest, pages) and whether its install
//!   committed (`installed`: its `snapshot.ack` is pending).
//! - `outbox` — key `id` (order), `client_msg_id` unique, `op` (`send`,
//!   `recall`, `read`): `pending`, then `accepted` (with `msg_seq`, and for
//!   a send `message_id` and `duplicate`) or `failed`.
//!
//! Submodules, one cluster each: `schema` (the tables and their migration),
//! `apply` (sync pages and the per-event rules), `snapshot` (installing a
//! snapshot), `outbox` (operations and their replies), `read` (what the
//! app reads). This module holds the store itself, its errors and the
//! fault points.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde_json::Value;

mod apply;
mod history;
mod outbox;
mod read;
mod repair;
mod schema;
mod snapshot;

pub use apply::{AppliedMessage, ApplyError, CursorMove, Gap, PageReport, GAP_DURATIONS_KEPT_MAX};
pub use history::LocalHistory;
pub use outbox::{Mentions, OutboxEntry, OutboxOp, OutboxRecord, OutboxState, OUTBOX_DONE_KEEP, OUTBOX_PENDING_MAX};
pub use read::PrivacySwitches;
pub use repair::{Repair, REPAIR_BACKOFF_FIRST_MS, REPAIR_BACKOFF_MAX_MS};
pub use schema::{CONTROL_KINDS, SCHEMA, STATE_DELETED, STATE_EDITED, STATE_NORMAL, STATE_RECALLED};
pub use snapshot::{manifest_digest, PendingSnapshot, SnapshotReport};

use schema::migrate;

/// The local form of a server envelope (as a history page holds it).
pub fn message_of_envelope(env: &tidemark_proto::Envelope) -> Message {
    apply::message_of(env, None)
}
#[cfg(test)]
use schema::CONTROL_KINDS_SQL;

/// How long a local write waits for the database lock, ms.
const BUSY_TIMEOUT_MS: u64 = 5_000;

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
        // A constraint the data breaks (one message id at two positions…)
        // is about the data, not the database: an integrity error.
        match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::ConstraintViolation) => StoreError::Integrity(e.to_string()),
            _ => StoreError::Sqlite(e.to_string()),
        }
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
    /// A conversation event of a sync page is about to be applied. The hook
    /// may answer [`FaultAction::Fail`] to have the store reject it (as a
    /// corrupt local row would).
    ApplyEvent { conv: String, msg_seq: u64 },
    /// A repair of `conv` (K5) is about to fetch from the server. The hook
    /// may answer [`FaultAction::Fail`] to make this attempt fail (as a
    /// server that cannot serve the conversation yet would).
    BeforeRepair { conv: String },
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
    /// At [`FaultPoint::ApplyEvent`] and [`FaultPoint::BeforeRepair`] only:
    /// that step fails. Elsewhere, `Continue`.
    Fail,
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
    /// The users it mentions and whether it mentions everyone (issue 18).
    pub mentions: Vec<String>,
    pub mention_all: bool,
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
    /// A large group in shared mode (G2): its events after the switch come
    /// from `conv.sync` when its marker is dirty, not from the user log.
    pub shared: bool,
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
    /// Those of them that mention the user, by name or everyone (issue 18).
    pub mentions: u64,
    pub muted: bool,
    pub pinned: bool,
    /// The user is a member now (false once they left or were removed).
    pub active: bool,
    /// The user's push preview preference for this conversation (P4):
    /// `none`, `conversation` or `full` (the default, which narrows
    /// nothing), from its `settings` events or a snapshot.
    pub push_preview: String,
    /// An event of this conversation could not be applied and waits in the
    /// repair queue (K5): what is shown may lack it until it is repaired.
    pub needs_repair: bool,
    /// The latest user message (control events are not messages).
    pub last_message: Option<Message>,
}

impl Conversation {
    pub fn has_gap(&self) -> bool {
        self.contiguous_msg_seq < self.last_msg_seq
    }
}

pub struct LocalStore {
    conn: Connection,
    user: String,
}

/// Prepared statements the store's connection keeps. rusqlite's default is
/// 16, fewer than the distinct statements one page runs, so the LRU evicted
/// them in turn and each page parsed its SQL again (a sixth of the
/// `bench fanout` process's samples, docs/benchmarks.md).
pub const STATEMENT_CACHE_CAPACITY: usize = 128;

/// `execute` and `query_row` through the connection's statement cache: the
/// store's statements are parsed once per connection, not once per call.
pub(crate) trait Cached {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;
}

impl Cached for Connection {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }

    fn row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.prepare_cached(sql)?.query_row(params, f)
    }
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
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE_CAPACITY);
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
        let p = self.conn.row(
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

    /// `RESET_REQUIRED`: wipes the synced state (repair records included:
    /// what they would repair is rebuilt) in one transaction and adopts
    /// `generation` (the next first page sends it with
    /// `local_applied_sync_seq` 0). The outbox stays (docs/protocol.md §7.7).
    pub fn reset(&mut self, generation: Option<u64>) -> StoreResult<()> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(
            "DELETE FROM messages; DELETE FROM conversations; DELETE FROM control_events;
             DELETE FROM snapshot_install; DELETE FROM repairs;",
        )?;
        tx.execute_batch(schema::PRIVACY_RESET_SQL)?;
        tx.execute(
            "UPDATE device SET sync_generation = ?1, applied_sync_seq = 0, acked_sync_seq = 0 WHERE id = 1",
            params![generation.map(|g| g as i64)],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// `DEVICE_REVOKED`: deletes every local datum of this device, tokens
    /// and unsent entries included.
    pub fn wipe(&mut self) -> StoreResult<()> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(
            "DELETE FROM messages; DELETE FROM conversations; DELETE FROM control_events; DELETE FROM outbox;
             DELETE FROM snapshot_install; DELETE FROM repairs;
             UPDATE device SET sync_generation = NULL, applied_sync_seq = 0, acked_sync_seq = 0,
                               refresh_token = NULL WHERE id = 1;",
        )?;
        tx.execute_batch(schema::PRIVACY_RESET_SQL)?;
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
}

#[cfg(test)]
mod tests;
