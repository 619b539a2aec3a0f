//! History pages (C3) kept locally: messages older than what sync
//! delivered (below a snapshot's latest messages, `history_to`) are fetched
//! with `history` and stored like any other, so they read offline
//! afterwards, and a page the local store holds whole is answered from it.
//!
//! A history page moves no cursor: `applied_sync_seq` and the contiguous
//! per-conversation cursor are sync's alone. A stored message is replaced
//! only by a newer version of itself (E2), never un-recalled. The local
//! store holds every visible message of `(history_to, contiguous_msg_seq]`;
//! a server page that reaches down from that floor lowers `history_to` to
//! what it covered, so the held run stays whole.

use rusqlite::{params, OptionalExtension};
use tidemark_proto::Envelope;

use super::apply::{ensure_conv, message_of, store_envelope};
use super::read::{message_row, MESSAGE_SELECT};
use super::schema::CONTROL_KINDS_SQL;
use super::Cached;
use super::{LocalStore, Message, StoreResult};

/// A history page answered from the local store.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalHistory {
    /// Newest first.
    pub messages: Vec<Message>,
    /// Older messages may exist (held here or at the server).
    pub has_more: bool,
}

impl LocalStore {
    /// The page of `limit` messages of `conv` below `before_seq` if the
    /// local store holds it whole: all of it lies above `history_to`, or
    /// `history_to` is 0 (the conversation is held from its start). `None`
    /// when the server must be asked.
    pub fn local_history(&self, conv: &str, before_seq: Option<u64>, limit: u32) -> StoreResult<Option<LocalHistory>> {
        let Some(history_to) = self
            .conn
            .row("SELECT history_to FROM conversations WHERE conv = ?1", params![conv], |r| r.get::<_, i64>(0))
            .optional()?
        else {
            return Ok(None);
        };
        let before = before_seq.map_or(i64::MAX, |b| b as i64);
        let sql = format!(
            "{MESSAGE_SELECT} WHERE conv = ?1 AND msg_seq < ?2 AND msg_seq > ?3 AND kind NOT IN {CONTROL_KINDS_SQL}
             ORDER BY msg_seq DESC LIMIT ?4 + 0"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        // One more than asked: whether anything older is held.
        let mut messages = stmt
            .query_map(params![conv, before, history_to, limit as i64 + 1], message_row)?
            .collect::<Result<Vec<_>, _>>()?;
        let held_more = messages.len() > limit as usize;
        messages.truncate(limit as usize);
        if held_more || messages.len() == limit as usize {
            return Ok(Some(LocalHistory { messages, has_more: true }));
        }
        if history_to == 0 {
            return Ok(Some(LocalHistory { messages, has_more: false }));
        }
        Ok(None)
    }

    /// Stores one `history` page of `conv` in one transaction. `before_seq`
    /// is the page's upper end as asked; `covered_to` the lowest `msg_seq`
    /// the page speaks for (its lowest message when more is older, else the
    /// server's history start): a page reaching down from the held floor
    /// lowers `history_to` to just below it.
    pub fn store_history(
        &mut self,
        conv: &str,
        before_seq: Option<u64>,
        covered_to: u64,
        messages: &[Envelope],
    ) -> StoreResult<()> {
        let tx = self.conn.transaction()?;
        ensure_conv(&tx, conv)?;
        for env in messages.iter().filter(|e| e.conv == conv && e.msg_seq > 0) {
            store_envelope(&tx, &message_of(env, None))?;
        }
        let history_to: i64 =
            tx.row("SELECT history_to FROM conversations WHERE conv = ?1", params![conv], |r| r.get(0))?;
        // The page and the held run `(history_to, …]` join when the page's top
        // is at or above the floor.
        let reaches_floor = before_seq.is_none_or(|b| b as i64 > history_to);
        let new_floor = covered_to.saturating_sub(1) as i64;
        if reaches_floor && new_floor < history_to {
            tx.exec("UPDATE conversations SET history_to = ?2 WHERE conv = ?1", params![conv, new_floor])?;
        }
        tx.commit()?;
        Ok(())
    }
}
