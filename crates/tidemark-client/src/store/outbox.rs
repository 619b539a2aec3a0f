//! The outbox (K3): every send, recall and read is durable with its
//! `client_msg_id` before its first attempt, leaves in `id` order, and
//! records the server's acceptance in the transaction that applies it
//! locally; finished entries are pruned to [`OUTBOX_DONE_KEEP`].

use rusqlite::{params, OptionalExtension, Transaction, TransactionBehavior};
use serde_json::{json, Value};
use tidemark_proto::{ReadOk, RecallOk, SendOk};

use super::apply::{ensure_conv, held, insert_message, load_cursor, recall_target, refresh_summary, save_cursor};
use super::apply::{CursorMove, Gap};
use super::schema::STATE_NORMAL;
use super::Cached;
use super::{now_ms, LocalStore, Message, StoreError, StoreResult};

/// Pending outbox entries at most; [`LocalStore::enqueue`] refuses more.
pub const OUTBOX_PENDING_MAX: u64 = 10_000;
/// Accepted or failed outbox entries kept for the app to look up; older ones
/// are pruned (the messages themselves stay in `messages`).
pub const OUTBOX_DONE_KEEP: u64 = 1_000;

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
    /// Sends: who the message mentions (issue 18), sent as they are on
    /// every attempt.
    pub mentions: Vec<String>,
    pub mention_all: bool,
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

/// Who a send mentions (issue 18): users by id, and everyone with `all`
/// (the server refuses `all` with `FORBIDDEN` in a group of more than
/// `tidemark_core::mention::MENTION_ALL_MEMBERS_MAX` members unless the
/// sender owns it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mentions {
    pub users: Vec<String>,
    pub all: bool,
}

impl LocalStore {
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
        self.enqueue_mentioning(client_msg_id, op, conv, kind, content, &Mentions::default())
    }

    /// [`LocalStore::enqueue`] of a send that mentions `mentions`.
    pub fn enqueue_mentioning(
        &mut self,
        client_msg_id: &str,
        op: OutboxOp,
        conv: &str,
        kind: &str,
        content: &Value,
        mentions: &Mentions,
    ) -> StoreResult<OutboxEntry> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let pending: i64 = tx.row("SELECT COUNT(*) FROM outbox WHERE state = 'pending'", [], |r| r.get(0))?;
        if pending as u64 >= OUTBOX_PENDING_MAX {
            return Err(StoreError::OutboxFull);
        }
        tx.exec(
            "INSERT INTO outbox (client_msg_id, op, conv, kind, content, state, created_at, mentions, mention_all)
             VALUES (?1, ?2, ?3, ?4, ?5, 'pending', ?6, ?7, ?8)",
            params![
                client_msg_id,
                op.as_str(),
                conv,
                kind,
                content.to_string(),
                now_ms(),
                super::apply::mentions_json(&mentions.users),
                mentions.all
            ],
        )?;
        let id = tx.last_insert_rowid();
        tx.commit()?;
        self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("outbox entry {id} vanished")))
    }

    /// The oldest pending entry: the next to go out.
    pub fn next_pending(&self) -> StoreResult<Option<OutboxEntry>> {
        let id: Option<i64> = self
            .conn
            .row("SELECT id FROM outbox WHERE state = 'pending' ORDER BY id LIMIT 1", [], |r| r.get(0))
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
        tx.exec(
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
            mentions: entry.mentions.clone(),
            mention_all: entry.mention_all,
        };
        // A duplicate reply describes the original message, which may
        // already be here from the sync log: keep what is stored.
        if held(&tx, &msg.conv, msg.msg_seq, &msg.message_id)?.is_none() {
            insert_message(&tx, &msg)?;
        }
        cursor.offer(ok.msg_seq);
        let (moved, gap) = save_cursor(&tx, &ok.conv, before, &cursor)?;
        let applied: i64 = tx.row("SELECT applied_sync_seq FROM device WHERE id = 1", [], |r| r.get(0))?;
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
        tx.exec(
            "UPDATE outbox SET state = 'accepted', msg_seq = ?2, error = NULL WHERE id = ?1",
            params![id, ok.msg_seq as i64],
        )?;
        let recalled = recall_target(&tx, &entry.conv, &target)?;
        let applied: i64 = tx.row("SELECT applied_sync_seq FROM device WHERE id = 1", [], |r| r.get(0))?;
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
        tx.exec(
            "UPDATE outbox SET state = 'accepted', msg_seq = ?2, error = NULL WHERE id = ?1",
            params![id, ok.read_seq as i64],
        )?;
        ensure_conv(&tx, &ok.conv)?;
        tx.exec(
            "UPDATE conversations SET read_seq = MAX(read_seq, ?2) WHERE conv = ?1",
            params![ok.conv, ok.read_seq as i64],
        )?;
        let applied: i64 = tx.row("SELECT applied_sync_seq FROM device WHERE id = 1", [], |r| r.get(0))?;
        refresh_summary(&tx, &user, &ok.conv, applied as u64)?;
        let read = tx.row("SELECT read_seq, unread FROM conversations WHERE conv = ?1", params![ok.conv], |r| {
            Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64))
        })?;
        prune_outbox(&tx)?;
        tx.commit()?;
        let entry = self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("no outbox entry {id}")))?;
        Ok(OutboxRecord { entry, cursor: None, gap: None, recalled: None, read: Some(read) })
    }

    /// An entry the server refused for good (NOT_MEMBER, FORBIDDEN…).
    pub fn record_failed(&mut self, id: i64, error: &str) -> StoreResult<OutboxEntry> {
        self.conn.exec("UPDATE outbox SET state = 'failed', error = ?2 WHERE id = ?1", params![id, error])?;
        self.outbox_entry(id)?.ok_or_else(|| StoreError::Integrity(format!("no outbox entry {id}")))
    }

    pub fn outbox_entry(&self, id: i64) -> StoreResult<Option<OutboxEntry>> {
        let row = self.conn.row(&format!("{OUTBOX_SELECT} WHERE id = ?1"), params![id], outbox_row).optional()?;
        row.transpose()
    }

    pub fn outbox_by_client_msg_id(&self, client_msg_id: &str) -> StoreResult<Option<OutboxEntry>> {
        let row = self
            .conn
            .row(&format!("{OUTBOX_SELECT} WHERE client_msg_id = ?1"), params![client_msg_id], outbox_row)
            .optional()?;
        row.transpose()
    }

    /// Every outbox entry kept, in order.
    pub fn outbox(&self) -> StoreResult<Vec<OutboxEntry>> {
        let mut stmt = self.conn.prepare_cached(&format!("{OUTBOX_SELECT} ORDER BY id"))?;
        let rows = stmt.query_map([], outbox_row)?.collect::<Result<Vec<_>, _>>()?;
        rows.into_iter().collect()
    }
}

const OUTBOX_SELECT: &str = "SELECT id, client_msg_id, op, conv, kind, content, state, created_at, message_id,
                                    msg_seq, duplicate, error, mentions, mention_all FROM outbox";

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
        mentions: r.get::<_, Option<String>>(12)?.and_then(|s| serde_json::from_str(&s).ok()).unwrap_or_default(),
        mention_all: r.get(13)?,
        state: OutboxState::parse(&state),
        created_at: r.get(7)?,
        message_id: r.get(8)?,
        msg_seq: r.get::<_, Option<i64>>(9)?.map(|s| s as u64),
        duplicate: r.get::<_, Option<bool>>(10)?.unwrap_or(false),
        error: r.get(11)?,
    }))
}

fn prune_outbox(tx: &Transaction<'_>) -> StoreResult<()> {
    tx.exec(
        "DELETE FROM outbox WHERE state <> 'pending' AND id NOT IN
             (SELECT id FROM outbox WHERE state <> 'pending' ORDER BY id DESC LIMIT ?1 + 0)",
        params![OUTBOX_DONE_KEEP as i64],
    )?;
    Ok(())
}
