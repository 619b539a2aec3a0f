//! What the app reads from the local store: conversations with their
//! summaries and latest message, the messages and events of one
//! conversation, and the conversations waiting on a gap.

use rusqlite::{params, OptionalExtension};
use serde_json::{json, Value};

use super::schema::CONTROL_KINDS_SQL;
use super::Cached;
use super::{Conversation, LocalStore, Message, StoreResult};

/// The user's privacy switches as this device holds them (issue 18): from
/// the user's `privacy` events (a change made on any of the user's
/// devices) and snapshots. `version` 0: never changed, the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrivacySwitches {
    /// Others see the user offline.
    pub hide_presence: bool,
    /// Others do not see the user's read positions.
    pub private_receipts: bool,
    /// The user's push preview preference: `none`, `conversation` or `full`.
    pub push_preview: String,
    pub version: u64,
}

impl Default for PrivacySwitches {
    fn default() -> PrivacySwitches {
        PrivacySwitches { hide_presence: false, private_receipts: false, push_preview: "full".into(), version: 0 }
    }
}

impl LocalStore {
    /// The user's privacy switches as last synced.
    pub fn privacy(&self) -> StoreResult<PrivacySwitches> {
        Ok(self.conn.row(
            "SELECT hide_presence, private_receipts, push_preview, version FROM privacy WHERE id = 1",
            [],
            |r| {
                Ok(PrivacySwitches {
                    hide_presence: r.get(0)?,
                    private_receipts: r.get(1)?,
                    push_preview: r.get(2)?,
                    version: r.get::<_, i64>(3)? as u64,
                })
            },
        )?)
    }

    /// Conversations, pinned first, then by their latest message.
    pub fn conversations(&self) -> StoreResult<Vec<Conversation>> {
        let order = format!(
            "ORDER BY c.pinned DESC, COALESCE((SELECT m.created_at FROM messages m WHERE m.conv = c.conv
                       AND m.kind NOT IN {CONTROL_KINDS_SQL} ORDER BY m.msg_seq DESC LIMIT 1), 0) DESC, c.conv"
        );
        self.conversation_rows(&order, None)
    }

    /// One conversation's row, read by its key (not by listing them all).
    pub fn conversation(&self, conv: &str) -> StoreResult<Option<Conversation>> {
        Ok(self.conversation_rows("WHERE c.conv = ?1", Some(conv))?.pop())
    }

    /// The conversation rows `tail` selects (with `conv` as `?1` when
    /// given), each with its last user message.
    fn conversation_rows(&self, tail: &str, conv: Option<&str>) -> StoreResult<Vec<Conversation>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT c.conv, c.kind, c.contiguous_msg_seq, c.last_msg_seq, c.read_seq, c.unread, c.muted, c.pinned,
                    c.history_to, c.active, EXISTS (SELECT 1 FROM repairs r WHERE r.conv = c.conv), c.mode,
                    c.mentions, c.push_preview
             FROM conversations c {tail}"
        ))?;
        let map = |r: &rusqlite::Row<'_>| {
            Ok(Conversation {
                conv: r.get(0)?,
                kind: r.get(1)?,
                contiguous_msg_seq: r.get::<_, i64>(2)? as u64,
                last_msg_seq: r.get::<_, i64>(3)? as u64,
                read_seq: r.get::<_, i64>(4)? as u64,
                unread: r.get::<_, i64>(5)? as u64,
                mentions: r.get::<_, i64>(12)? as u64,
                muted: r.get(6)?,
                pinned: r.get(7)?,
                history_to: r.get::<_, i64>(8)? as u64,
                active: r.get(9)?,
                needs_repair: r.get(10)?,
                shared: r.get::<_, String>(11)? == "shared",
                push_preview: r.get(13)?,
                last_message: None,
            })
        };
        let rows = match conv {
            Some(conv) => stmt.query_map(params![conv], map)?.collect::<Result<Vec<_>, _>>()?,
            None => stmt.query_map([], map)?.collect::<Result<Vec<_>, _>>()?,
        };
        let mut out = Vec::with_capacity(rows.len());
        for mut c in rows {
            c.last_message = self
                .conn
                .row(
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
        let mut stmt = self.conn.prepare_cached(sql)?;
        let rows = stmt.query_map(params![conv], message_row)?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Conversations whose cursor waits below an event held above a gap.
    pub fn conversations_with_gap(&self) -> StoreResult<Vec<String>> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT conv FROM conversations WHERE contiguous_msg_seq < last_msg_seq ORDER BY conv")?;
        let rows = stmt.query_map([], |r| r.get(0))?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Events of kinds this client keeps verbatim: `(sync_seq, kind, conv)`.
    pub fn kept_verbatim(&self) -> StoreResult<Vec<(u64, String, String)>> {
        let mut stmt = self.conn.prepare_cached("SELECT sync_seq, kind, conv FROM control_events ORDER BY sync_seq")?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?, r.get(2)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}

pub(super) const MESSAGE_SELECT: &str =
    "SELECT conv, msg_seq, message_id, kind, state, sender, content, created_at, version,
                                     reactions, sync_seq, mentions, mention_all FROM messages";

pub(super) fn message_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Message> {
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
        mentions: r.get::<_, Option<String>>(11)?.and_then(|s| serde_json::from_str(&s).ok()).unwrap_or_default(),
        mention_all: r.get(12)?,
    })
}
