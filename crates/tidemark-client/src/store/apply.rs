//! Applying the server's sync log: one page in one transaction (K1), each
//! conversation event through its contiguous cursor (K2), control events by
//! the version rules of docs/protocol.md §3.4 (E1, E2), per-user events, and
//! the conversation summaries recomputed in the same transaction. The
//! outbox's own replies (`send.ok`, `recall.ok`, `read.ok`) reuse the
//! per-event helpers here.

use std::collections::BTreeMap;

use rusqlite::{params, OptionalExtension, Transaction, TransactionBehavior};
use serde_json::{json, Value};
use tidemark_proto::{Envelope, SyncOk, UserEvent};

use super::schema::{CONTROL_KINDS_SQL, STATE_DELETED, STATE_EDITED, STATE_RECALLED};
use super::Cached;
use super::{FaultAction, FaultPoint, LocalStore, Message, StoreError, StoreResult};
use crate::cursor::{hole_step, ConvCursor, HoleStep, Policy, PENDING_MAX};
use tidemark_core::client_stats::repair_duration_ms;

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
    /// It mentions this device's user (issue 18), by name or everyone.
    pub mentioned: bool,
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
    /// Conversations put into the repair queue by this page (K5), with the
    /// first `msg_seq` to repair.
    pub repairs: Vec<(String, u64)>,
    /// The user's privacy switches, when a `privacy` event of this page
    /// changed them (issue 18).
    pub privacy: Option<super::PrivacySwitches>,
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

impl LocalStore {
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
                Some(env) => apply_or_queue_repair(&tx, &user, e, env, &mut touched, &mut report, fault)?,
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
        tx.exec(
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

    /// Records a confirmed ACK (the server's value, never lowered), without
    /// an fsync of its own (`synchronous=NORMAL` for this one statement): the
    /// value is the server's, which every first page reports again
    /// (`server_acked_sync_seq`), so one lost to a power cut is learned
    /// again, at the cost of an ACK sent again at most (the `ack.ok` lost on
    /// the way, which the engine handles). The WAL is written in order, so
    /// the next page's commit (`FULL`) makes it durable with itself. A
    /// device's pages cost one local fsync each instead of two.
    pub fn record_ack(&mut self, generation: u64, acked_sync_seq: u64) -> StoreResult<()> {
        self.conn.pragma_update(None, "synchronous", "NORMAL")?;
        let written = self.conn.exec(
            "UPDATE device SET acked_sync_seq = MAX(acked_sync_seq, ?2) WHERE id = 1 AND sync_generation = ?1",
            params![generation as i64, acked_sync_seq as i64],
        );
        self.conn.pragma_update(None, "synchronous", "FULL")?;
        written?;
        Ok(())
    }
}

fn read_position(tx: &Transaction<'_>) -> StoreResult<(Option<u64>, u64)> {
    Ok(tx.row("SELECT sync_generation, applied_sync_seq FROM device WHERE id = 1", [], |r| {
        Ok((r.get::<_, Option<i64>>(0)?.map(|g| g as u64), r.get::<_, i64>(1)? as u64))
    })?)
}

pub(super) fn ensure_conv(tx: &Transaction<'_>, conv: &str) -> StoreResult<()> {
    tx.exec("INSERT OR IGNORE INTO conversations (conv, kind) VALUES (?1, 'direct')", params![conv])?;
    Ok(())
}

/// The conversation's cursor, rebuilt from its persisted position and the
/// rows held above it (the persistent pending buffer).
pub(super) fn load_cursor(tx: &Transaction<'_>, conv: &str) -> StoreResult<ConvCursor> {
    let position: i64 =
        tx.row("SELECT contiguous_msg_seq FROM conversations WHERE conv = ?1", params![conv], |r| r.get(0))?;
    let mut stmt = tx.prepare_cached(
        "SELECT msg_seq FROM messages WHERE conv = ?1 AND msg_seq > ?2 ORDER BY msg_seq LIMIT ?3 + 0",
    )?;
    let above = stmt
        .query_map(params![conv, position, PENDING_MAX as i64], |r| r.get::<_, i64>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ConvCursor::restore(Policy::Contiguous, position as u64, above.into_iter().map(|s| s as u64)))
}

/// What is held at `(conv, msg_seq)`: `(version, state)`; an error if it is
/// another message (one `msg_seq`, two ids: never overwrite, never guess).
pub(super) fn held(
    tx: &Transaction<'_>,
    conv: &str,
    msg_seq: u64,
    message_id: &str,
) -> StoreResult<Option<(u64, String)>> {
    let row: Option<(String, i64, String)> = tx
        .row(
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

pub(super) fn insert_message(tx: &Transaction<'_>, msg: &Message) -> StoreResult<()> {
    tx.exec(
        "INSERT INTO messages (conv, msg_seq, message_id, kind, state, sender, content, created_at, version,
                               reactions, sync_seq, mentions, mention_all)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
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
            msg.sync_seq.map(|s| s as i64),
            mentions_json(&msg.mentions),
            msg.mention_all
        ],
    )?;
    Ok(())
}

/// A message's `mentions` column: a JSON array, NULL when it names nobody.
pub(super) fn mentions_json(mentions: &[String]) -> Option<String> {
    (!mentions.is_empty()).then(|| serde_json::to_string(mentions).unwrap_or_default())
}

/// The local row of a server envelope; `sync_seq` is the user-log position
/// that delivered it (`None` for a history page).
pub(super) fn message_of(env: &Envelope, sync_seq: Option<u64>) -> Message {
    Message {
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
        sync_seq,
        mentions: env.mentions.clone(),
        mention_all: env.mention_all,
    }
}

/// Stores a conversation event's envelope. The envelope is read when the
/// page is served, so it replaces what is held when its version is not
/// lower (E2); a placeholder is final (`recalled`), and `deleted` (for this
/// user) wins over everything.
pub(super) fn store_envelope(tx: &Transaction<'_>, msg: &Message) -> StoreResult<()> {
    let Some((version, state)) = held(tx, &msg.conv, msg.msg_seq, &msg.message_id)? else {
        return insert_message(tx, msg);
    };
    let final_here = state == STATE_DELETED || (state == STATE_RECALLED && msg.state != STATE_DELETED);
    if final_here || msg.version < version {
        tx.exec(
            "UPDATE messages SET sync_seq = COALESCE(sync_seq, ?2) WHERE message_id = ?1",
            params![msg.message_id, msg.sync_seq.map(|s| s as i64)],
        )?;
        return Ok(());
    }
    tx.exec(
        "UPDATE messages SET state = ?2, content = ?3, version = ?4, reactions = ?5,
                             sync_seq = COALESCE(sync_seq, ?6), mentions = ?7, mention_all = ?8
         WHERE message_id = ?1",
        params![
            msg.message_id,
            msg.state,
            msg.content.to_string(),
            msg.version as i64,
            msg.reactions.to_string(),
            msg.sync_seq.map(|s| s as i64),
            mentions_json(&msg.mentions),
            msg.mention_all
        ],
    )?;
    Ok(())
}

/// The held target of a control event: `(msg_seq, version, state)`.
fn target(tx: &Transaction<'_>, conv: &str, message_id: &str) -> StoreResult<Option<(u64, u64, String)>> {
    Ok(tx
        .row(
            "SELECT msg_seq, version, state FROM messages WHERE conv = ?1 AND message_id = ?2",
            params![conv, message_id],
            |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64, r.get(2)?)),
        )
        .optional()?)
}

/// E1: the target becomes a placeholder (state `recalled`, content `{}`, no
/// reactions), and the text of its earlier edit events is discarded
/// (docs/protocol.md §3.4.4). Returns the target if it changed here.
pub(super) fn recall_target(tx: &Transaction<'_>, conv: &str, message_id: &str) -> StoreResult<Option<(String, u64)>> {
    let Some((msg_seq, _, state)) = target(tx, conv, message_id)? else {
        // Not held (outside this user's periods): nothing to hide.
        return Ok(None);
    };
    tx.exec(
        "UPDATE messages SET content = json_remove(content, '$.content')
         WHERE conv = ?1 AND kind = 'edit' AND json_extract(content, '$.target_message_id') = ?2",
        params![conv, message_id],
    )?;
    if state == STATE_RECALLED || state == STATE_DELETED {
        return Ok(None);
    }
    tx.exec(
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
        tx.exec(
            "UPDATE messages SET content = ?2, state = ?3, version = ?4 WHERE message_id = ?1",
            params![message_id, content["content"].to_string(), STATE_EDITED, new_version as i64],
        )?;
        return Ok(());
    }
    let reactions: String =
        tx.row("SELECT reactions FROM messages WHERE message_id = ?1", params![message_id], |r| r.get(0))?;
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
    tx.exec(
        "UPDATE messages SET reactions = ?2, version = ?3 WHERE message_id = ?1",
        params![message_id, reactions, new_version as i64],
    )?;
    Ok(())
}

pub(super) type Touched = BTreeMap<String, Option<(u64, ConvCursor)>>;

/// Applies one conversation event in a savepoint. If this event cannot be
/// applied (it contradicts itself or what is held), its conversation goes
/// into the repair queue in this same transaction instead (K5, seed §7.3),
/// and the page goes on: the rest of the account keeps syncing, and the
/// ACK may pass the event because the repair record holds its place. Only
/// an error the queue cannot absorb (the database itself failing, a fault
/// hook's abort) fails the page, and then nothing of it commits.
fn apply_or_queue_repair(
    tx: &Transaction<'_>,
    user: &str,
    e: &UserEvent,
    env: &Envelope,
    touched: &mut Touched,
    report: &mut PageReport,
    fault: &dyn Fn(&FaultPoint) -> FaultAction,
) -> Result<(), ApplyError> {
    let cursor_before = touched.get(&e.conv).cloned();
    let (recalled_before, messages_before) = (report.recalled.len(), report.messages.len());
    tx.exec("SAVEPOINT event", []).map_err(StoreError::from)?;
    let point = FaultPoint::ApplyEvent { conv: e.conv.clone(), msg_seq: env.msg_seq };
    let outcome = match fault(&point) {
        FaultAction::Fail => Err(ApplyError::Store(StoreError::Integrity(format!("fault hook refused {point:?}")))),
        _ => apply_conv_event(tx, user, e, env, touched, report),
    };
    let reason = match outcome {
        Ok(()) => {
            tx.exec("RELEASE event", []).map_err(StoreError::from)?;
            return Ok(());
        }
        Err(ApplyError::Malformed { why, .. }) => why,
        Err(ApplyError::Store(StoreError::Integrity(why))) => why,
        Err(other) => {
            tx.execute_batch("ROLLBACK TO event; RELEASE event").map_err(StoreError::from)?;
            return Err(other);
        }
    };
    tx.execute_batch("ROLLBACK TO event; RELEASE event").map_err(StoreError::from)?;
    // What the failed event did to the in-memory state goes with it.
    match cursor_before {
        Some(c) => touched.insert(e.conv.clone(), c),
        None => touched.remove(&e.conv),
    };
    report.recalled.truncate(recalled_before);
    report.messages.truncate(messages_before);
    queue_repair(tx, &e.conv, env.msg_seq.max(1), e.sync_seq, &reason)?;
    report.repairs.push((e.conv.clone(), env.msg_seq.max(1)));
    Ok(())
}

/// Records (or widens) in the `repairs` table (`store::repair`) the repair of `conv` from `from_msg_seq`, in the
/// caller's transaction.
fn queue_repair(tx: &Transaction<'_>, conv: &str, from_msg_seq: u64, sync_seq: u64, reason: &str) -> StoreResult<()> {
    ensure_conv(tx, conv)?;
    // A conversation newly queued is one gap detected (`client.stats`); a
    // widened record is the same gap.
    tx.exec(
        "UPDATE gap_stats SET detected = detected + 1 WHERE NOT EXISTS (SELECT 1 FROM repairs WHERE conv = ?1)",
        params![conv],
    )?;
    tx.exec(
        "INSERT INTO repairs (conv, from_msg_seq, sync_seq, reason, queued_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (conv) DO UPDATE SET from_msg_seq = MIN(from_msg_seq, excluded.from_msg_seq),
                                          sync_seq = MIN(sync_seq, excluded.sync_seq)",
        params![conv, from_msg_seq as i64, sync_seq as i64, reason, super::now_ms()],
    )?;
    Ok(())
}

/// `gap_durations` kinds (the `kind` label of `tidemark_sdk_gap_repair_seconds`).
pub(super) const GAP_REPAIR: &str = "repair";
pub(super) const GAP_HOLE: &str = "hole";

/// Repaired gaps' durations kept until reported; past it the oldest go
/// (a device that cannot report for long keeps its latest samples).
pub const GAP_DURATIONS_KEPT_MAX: i64 = 1024;

/// Records how long a repaired gap of `kind` took, in the caller's
/// transaction, keeping at most [`GAP_DURATIONS_KEPT_MAX`] unreported.
pub(super) fn record_duration(tx: &Transaction<'_>, kind: &str, ms: u64) -> StoreResult<()> {
    tx.exec("INSERT INTO gap_durations (kind, ms) VALUES (?1, ?2)", params![kind, ms as i64])?;
    tx.exec(
        "DELETE FROM gap_durations WHERE id <= (SELECT MAX(id) FROM gap_durations) - ?1",
        params![GAP_DURATIONS_KEPT_MAX],
    )?;
    Ok(())
}

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
    apply_envelope(tx, user, env, Some(e.sync_seq), touched, report)
}

/// Stores one conversation event's envelope through its conversation's
/// cursor and applies its effects (a recall, an edit, a reaction, the
/// user's own join or leave), in the caller's transaction. `sync_seq` is
/// the user-log position that delivered it (`None` for a repair).
pub(super) fn apply_envelope(
    tx: &Transaction<'_>,
    user: &str,
    env: &Envelope,
    sync_seq: Option<u64>,
    touched: &mut Touched,
    report: &mut PageReport,
) -> Result<(), ApplyError> {
    ensure_conv(tx, &env.conv)?;
    let slot = touched.entry(env.conv.clone()).or_insert(None);
    if slot.is_none() {
        let cursor = load_cursor(tx, &env.conv)?;
        *slot = Some((cursor.position(), cursor));
    }
    let (_, cursor) = slot.as_mut().expect("loaded above");
    // A period of this user starts at its own join event: what lies below
    // it is outside the user's view, not a gap (§3.4.2) — down to the
    // user's previous leave only. When that leave is held above the cursor
    // (the previous period's tail is not: in a shared group its messages
    // come by `conv.sync`, while the leave and the join come by the user's
    // log, G2; or an event of it was lost), skipping would pass messages
    // of the previous period that were never held. The gap stays; the pull
    // or repair that fills it serves this join again (it is inside the
    // period), with the cursor at the leave by then, and skips only the
    // time the user was out.
    if env.kind == "member.join" && env.content["user"].as_str() == Some(user) {
        let tail_missing = tx
            .row(
                "SELECT EXISTS (SELECT 1 FROM messages WHERE conv = ?1 AND kind = 'member.leave'
                   AND msg_seq > ?2 AND msg_seq < ?3 AND json_extract(content, '$.user') = ?4)",
                params![env.conv, cursor.position() as i64, env.msg_seq as i64, user],
                |r| r.get::<_, bool>(0),
            )
            .map_err(StoreError::from)?;
        if !tail_missing {
            cursor.start_at(env.msg_seq - 1);
        }
    }
    // Only groups have a creation event and membership events: a
    // conversation first learned from one is a group, whatever was assumed.
    if matches!(env.kind.as_str(), "conv.created" | "member.join" | "member.leave" | "conv.mode") {
        tx.exec("UPDATE conversations SET kind = 'group' WHERE conv = ?1 AND kind <> 'group'", params![env.conv])
            .map_err(StoreError::from)?;
    }
    // The switch (G3): later events of the group come by `conv.sync`, when
    // its marker says so.
    if env.kind == "conv.mode" && env.content["mode"].as_str() == Some("shared") {
        tx.exec("UPDATE conversations SET mode = 'shared' WHERE conv = ?1", params![env.conv])
            .map_err(StoreError::from)?;
    }
    if (env.kind == "member.join" || env.kind == "member.leave") && env.content["user"].as_str() == Some(user) {
        tx.exec("UPDATE conversations SET active = ?2 WHERE conv = ?1", params![env.conv, env.kind == "member.join"])
            .map_err(StoreError::from)?;
    }
    store_envelope(tx, &message_of(env, sync_seq))?;
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
        sync_seq: sync_seq.unwrap_or(0),
        conv: env.conv.clone(),
        msg_seq: env.msg_seq,
        kind: env.kind.clone(),
        sender: env.sender.clone(),
        mentioned: mentions_user(&env.mentions, env.mention_all, &env.sender, user),
    });
    Ok(())
}

/// A per-user event (`read`, `settings`, `delete`, `privacy`), or a kind this client
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
                tx.exec(
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
                // Absent from servers before per-conversation previews.
                let preview = data["push_preview"].as_str().unwrap_or("full");
                tx.exec(
                    "UPDATE conversations SET muted = ?2, pinned = ?3, settings_version = ?4, push_preview = ?5
                     WHERE conv = ?1 AND settings_version < ?4",
                    params![e.conv, muted, pinned, version as i64, preview],
                )
                .map_err(StoreError::from)?;
                true
            }
            _ => false,
        },
        // Not about a conversation: nothing to touch but the switches.
        "privacy" => {
            let parsed = match (
                data["hide_presence"].as_bool(),
                data["private_receipts"].as_bool(),
                data["push_preview"].as_str(),
                data["version"].as_u64(),
            ) {
                (Some(hide), Some(private), Some(preview), Some(version)) => Some(super::PrivacySwitches {
                    hide_presence: hide,
                    private_receipts: private,
                    push_preview: preview.to_owned(),
                    version,
                }),
                _ => None,
            };
            if let Some(p) = parsed {
                if set_privacy(tx, &p)? {
                    report.privacy = Some(p);
                }
                return Ok(());
            }
            false
        }
        "delete" => match data["message_id"].as_str() {
            Some(message_id) => {
                tx.exec(
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
    tx.exec(
        "INSERT OR REPLACE INTO control_events (sync_seq, kind, conv, msg_seq, body) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![e.sync_seq as i64, e.kind, e.conv, e.msg_seq.map(|s| s as i64), body],
    )
    .map_err(StoreError::from)?;
    report.kept_verbatim += 1;
    Ok(())
}

/// Stores the user's privacy switches when `p` is newer than what is held
/// (in the caller's transaction); whether they changed.
pub(super) fn set_privacy(tx: &Transaction<'_>, p: &super::PrivacySwitches) -> StoreResult<bool> {
    let n = tx.exec(
        "UPDATE privacy SET hide_presence = ?1, private_receipts = ?2, push_preview = ?3, version = ?4
         WHERE id = 1 AND version < ?4",
        params![p.hide_presence, p.private_receipts, p.push_preview, p.version as i64],
    )?;
    Ok(n > 0)
}

/// Writes the cursor position (in the caller's transaction); returns the
/// move and the remaining gap, if any. A hole that opens here is one gap
/// detected and one that closes one gap repaired, with its duration
/// (`client.stats`, O1; [`hole_step`] decides), in the same transaction.
pub(super) fn save_cursor(
    tx: &Transaction<'_>,
    conv: &str,
    before: u64,
    cursor: &ConvCursor,
) -> StoreResult<(Option<CursorMove>, Option<Gap>)> {
    let to = cursor.position();
    assert!(to >= before, "a conversation cursor never moves back ({conv}: {before} -> {to})");
    let since: Option<i64> = tx
        .row("SELECT hole_since_ms FROM conversations WHERE conv = ?1", params![conv], |r| r.get(0))
        .optional()?
        .flatten();
    let now = super::now_ms();
    match hole_step(since.is_some(), cursor.missing().is_some()) {
        HoleStep::Opened => {
            tx.exec("UPDATE conversations SET hole_since_ms = ?2 WHERE conv = ?1", params![conv, now])?;
            tx.exec("UPDATE gap_stats SET detected = detected + 1", [])?;
        }
        HoleStep::Closed => {
            tx.exec("UPDATE conversations SET hole_since_ms = NULL WHERE conv = ?1", params![conv])?;
            tx.exec("UPDATE gap_stats SET repaired = repaired + 1", [])?;
            record_duration(tx, GAP_HOLE, repair_duration_ms(since.unwrap_or(now), now))?;
        }
        HoleStep::Same => {}
    }
    tx.exec("UPDATE conversations SET contiguous_msg_seq = ?2 WHERE conv = ?1", params![conv, to as i64])?;
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
/// it, not recalled, not deleted, never control events, R3) with the
/// mentions among them.
///
/// Counted from the messages appended since the last refresh only, when
/// nothing else changed (`summary_dirty` unset: see
/// `schema::SUMMARY_TRIGGERS`): the old counts plus the new messages above
/// the read position, or, when one of our own new messages moved the read
/// position past everything counted before, the new messages above it.
/// Otherwise the whole conversation is counted again. Either way the
/// result is the whole count's (*summary_counts_as_a_whole_recount_would*);
/// a page of a busy conversation nobody reads costs the page's messages,
/// not every unread one.
pub(super) fn refresh_summary(tx: &Transaction<'_>, user: &str, conv: &str, sync_seq: u64) -> StoreResult<()> {
    let Some(held) = summary_state(tx, conv, user)? else { return Ok(()) };
    let read_seq = held.read_seq.max(held.own);
    let (unread, mentions) = if !held.dirty && read_seq == held.read_seq {
        let (n, m) = count_unread(tx, conv, user, held.counted_upto.max(read_seq))?;
        (held.unread + n, held.mentions + m)
    } else {
        let (n, m) = count_unread(tx, conv, user, read_seq)?;
        let below = read_seq < held.history_to;
        (n + if below { held.unread_below } else { 0 }, m + if below { held.mentions_below } else { 0 })
    };
    tx.exec(
        "UPDATE conversations SET last_msg_seq = MAX(last_msg_seq, ?2), read_seq = ?3, unread = ?4, mentions = ?5,
             updated_sync_seq = MAX(updated_sync_seq, ?6), counted_upto = ?2, summary_dirty = 0,
             summary_rev = summary_rev + 1
         WHERE conv = ?1",
        params![conv, held.last, read_seq, unread, mentions, sync_seq as i64],
    )?;
    Ok(())
}

/// What [`refresh_summary`] starts from, read in one statement: the row's
/// counts and bookkeeping, the highest `msg_seq` held, and the highest of
/// the user's own messages among those still to count (all of them when
/// the summary is dirty, else those above `counted_upto`).
struct SummaryState {
    read_seq: i64,
    unread: i64,
    mentions: i64,
    counted_upto: i64,
    dirty: bool,
    history_to: i64,
    unread_below: i64,
    mentions_below: i64,
    last: i64,
    own: i64,
}

fn summary_state(tx: &Transaction<'_>, conv: &str, user: &str) -> StoreResult<Option<SummaryState>> {
    Ok(tx
        .row(
            "SELECT c.read_seq, c.unread, c.mentions, c.counted_upto, c.summary_dirty, c.history_to, c.unread_below,
                    c.mentions_below,
                    (SELECT COALESCE(MAX(m.msg_seq), 0) FROM messages m WHERE m.conv = c.conv),
                    (SELECT COALESCE(MAX(m.msg_seq), 0) FROM messages m WHERE m.conv = c.conv AND m.sender = ?2
                       AND m.msg_seq > CASE WHEN c.summary_dirty THEN 0 ELSE c.counted_upto END)
             FROM conversations c WHERE c.conv = ?1",
            params![conv, user],
            |r| {
                Ok(SummaryState {
                    read_seq: r.get(0)?,
                    unread: r.get(1)?,
                    mentions: r.get(2)?,
                    counted_upto: r.get(3)?,
                    dirty: r.get(4)?,
                    history_to: r.get(5)?,
                    unread_below: r.get(6)?,
                    mentions_below: r.get(7)?,
                    last: r.get(8)?,
                    own: r.get(9)?,
                })
            },
        )
        .optional()?)
}

/// The held messages of `conv` above `above` that count as unread for
/// `user` (from others, not control events, not recalled or deleted), and
/// how many of them mention the user.
fn count_unread(tx: &Transaction<'_>, conv: &str, user: &str, above: i64) -> StoreResult<(i64, i64)> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "SELECT COUNT(*), COALESCE(SUM(m.mention_all = 1 OR (m.mentions IS NOT NULL
                        AND EXISTS (SELECT 1 FROM json_each(m.mentions) j WHERE j.value = ?2))), 0)
             FROM messages m
             WHERE m.conv = ?1 AND m.msg_seq > ?3 AND m.sender <> ?2
               AND m.kind NOT IN {CONTROL_KINDS_SQL} AND m.state NOT IN ('recalled', 'deleted')"
        )
    });
    Ok(tx.row(&SQL, params![conv, user, above], |r| Ok((r.get(0)?, r.get(1)?)))?)
}

/// Issue 18, as `tidemark_core::mention::counts` decides it on the server:
/// a message mentions `user` when it names them or everyone, never its
/// sender.
pub(super) fn mentions_user(mentions: &[String], all: bool, sender: &str, user: &str) -> bool {
    sender != user && (all || mentions.iter().any(|m| m == user))
}
