//! Installing a snapshot (D7, docs/protocol.md §3.21–§3.24): the pending
//! snapshot recorded from `snapshot.begin` to its `snapshot.ack`, the
//! manifest digest, and the one transaction that replaces the synced state
//! with the snapshot's items.

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde_json::Value;
use tidemark_proto::Envelope;

use super::apply::{insert_message, message_of, ApplyError};
use super::schema::{CONTROL_KINDS, STATE_DELETED, STATE_RECALLED};
use super::Cached;
use super::{FaultAction, FaultPoint, LocalStore, StoreError, StoreResult};

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
    /// The user's privacy switches after the install (the snapshot's
    /// `privacy` item, or the defaults).
    pub privacy: super::PrivacySwitches,
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

impl LocalStore {
    /// The snapshot being installed, if any (docs/protocol.md §3.24).
    pub fn pending_snapshot(&self) -> StoreResult<Option<PendingSnapshot>> {
        Ok(self
            .conn
            .row(
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
        self.conn.exec("DELETE FROM snapshot_install", [])?;
        Ok(())
    }

    /// Step 5 of §3.24 answered: the server installed the snapshot. Clears
    /// the pending mark and records the ACK, in one transaction.
    pub fn snapshot_acked(&mut self, generation: u64, acked_sync_seq: u64) -> StoreResult<()> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.exec("DELETE FROM snapshot_install", [])?;
        tx.exec(
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
        let (convs, privacy) = parse_snapshot(items)?;
        let mut report = SnapshotReport {
            generation: snap.generation,
            base_sync_seq: snap.base_sync_seq,
            conversations: convs.len(),
            skipped_items: items.len()
                - convs.iter().map(|c| 1 + c.messages.len()).sum::<usize>()
                - usize::from(privacy.is_some()),
            ..SnapshotReport::default()
        };
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(StoreError::from)?;
        tx.execute_batch("DELETE FROM messages; DELETE FROM conversations; DELETE FROM control_events;")
            .map_err(StoreError::from)?;
        // The user's switches at the base: the snapshot's item, or the
        // defaults of a user who never changed them (issue 18).
        tx.execute_batch(super::schema::PRIVACY_RESET_SQL).map_err(StoreError::from)?;
        if let Some(p) = &privacy {
            super::apply::set_privacy(&tx, p)?;
            report.privacy = p.clone();
        }
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
            let held_mentions = c
                .messages
                .iter()
                .filter(|m| {
                    m.msg_seq > c.read_seq
                        && !CONTROL_KINDS.contains(&m.kind.as_str())
                        && m.state != STATE_RECALLED
                        && m.state != STATE_DELETED
                        && super::apply::mentions_user(&m.mentions, m.mention_all, &m.sender, &user)
                })
                .count() as u64;
            tx.exec(
                "INSERT INTO conversations (conv, kind, contiguous_msg_seq, last_msg_seq, read_seq, unread, muted,
                                            pinned, settings_version, updated_sync_seq, history_to, unread_below,
                                            active, mode, mentions, mentions_below, push_preview)
                 VALUES (?1, ?2, ?3, ?3, ?4, ?5, ?6, ?7, 0, ?8, ?9, ?10, ?11,
                         CASE WHEN ?12 THEN 'shared' ELSE 'per_member' END, ?13, ?14, ?15)",
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
                    c.active,
                    c.shared,
                    c.mentions as i64,
                    c.mentions.saturating_sub(held_mentions) as i64,
                    c.push_preview
                ],
            )
            .map_err(StoreError::from)?;
            for env in &c.messages {
                insert_message(&tx, &message_of(env, None))?;
                report.messages += 1;
            }
        }
        tx.exec(
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
    mentions: u64,
    muted: bool,
    pinned: bool,
    active: bool,
    shared: bool,
    push_preview: String,
    messages: Vec<Envelope>,
}

/// Reads snapshot items (docs/protocol.md §3.21): each conversation item,
/// then its message items ascending by `msg_seq`, and at most one
/// `privacy` item (the user's switches). Items of unknown types are
/// ignored.
fn parse_snapshot(items: &[Value]) -> Result<(Vec<SnapshotConv>, Option<super::PrivacySwitches>), ApplyError> {
    let mut out: Vec<SnapshotConv> = Vec::new();
    let mut privacy = None;
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
                    // Absent from servers before mentions (issue 18).
                    mentions: item["mentions"].as_u64().unwrap_or(0),
                    muted: flag("muted")?,
                    pinned: flag("pinned")?,
                    active: item["active"].as_bool().unwrap_or(true),
                    shared: item["mode"].as_str() == Some("shared"),
                    // Absent when `full` (the default).
                    push_preview: item["push_preview"].as_str().unwrap_or("full").to_owned(),
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
            Some("privacy") => {
                if privacy.is_some() {
                    return Err(bad("the privacy switches appear twice"));
                }
                let flag = |k: &str| item[k].as_bool().ok_or_else(|| bad(&format!("{k} missing")));
                privacy = Some(super::PrivacySwitches {
                    hide_presence: flag("hide_presence")?,
                    private_receipts: flag("private_receipts")?,
                    push_preview: item["push_preview"].as_str().ok_or_else(|| bad("push_preview missing"))?.to_owned(),
                    version: item["version"].as_u64().ok_or_else(|| bad("version missing"))?,
                });
            }
            _ => {}
        }
    }
    Ok((out, privacy))
}
