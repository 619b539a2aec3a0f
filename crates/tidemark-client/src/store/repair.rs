//! The repair queue (K5, seed §7.3, §12.3): a conversation whose event
//! could not be applied is recorded here in the transaction that advances
//! `applied_sync_seq` past that event, so the ACK may pass it and the rest
//! of the account keeps syncing, while this record holds the conversation's
//! place. A repair fetches the conversation from the server (`conv.sync`
//! from the first unapplied `msg_seq`) and applies it in one transaction
//! that also deletes the record; where a held row contradicts the server
//! (one `msg_seq`, two message ids) the server's fact wins, since the
//! conversation log is the truth. A failed attempt waits a growing delay.
//! Until the record is gone the app sees the conversation as needing repair.
//! The queue also counts what it detected and repaired (`gap_stats`), which
//! the engine reports to the server with `client.stats` (O1): the server
//! cannot see these gaps itself.

use rusqlite::{params, OptionalExtension};
use tidemark_core::client_stats::repair_duration_ms;
use tidemark_proto::Envelope;

use super::apply::{
    apply_envelope, load_cursor, record_duration, refresh_summary, save_cursor, ApplyError, PageReport, Touched,
    GAP_HOLE, GAP_REPAIR,
};
use super::Cached;
use super::{CursorMove, LocalStore, StoreError, StoreResult};

/// First wait after a failed repair; it doubles per attempt up to the cap.
pub const REPAIR_BACKOFF_FIRST_MS: i64 = 500;
pub const REPAIR_BACKOFF_MAX_MS: i64 = 5 * 60 * 1000;

/// A conversation waiting for repair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repair {
    pub conv: String,
    /// The first `msg_seq` that was not applied.
    pub from_msg_seq: u64,
    /// The user-log position of the event that failed.
    pub sync_seq: u64,
    pub reason: String,
    pub attempts: u32,
    pub next_attempt_at_ms: i64,
    pub last_error: Option<String>,
}

/// The device's gap counts as `client.stats` reports them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GapCounts {
    /// Gaps detected since the last report: conversations queued for
    /// repair and holes opened in a conversation's `msg_seq`.
    pub detected: u64,
    /// Gaps repaired since the last report: repairs completed, holes closed.
    pub repaired: u64,
    /// Repairs waiting now.
    pub pending: u64,
    /// Durations (ms) of the repair-queue repairs not reported yet, oldest
    /// first, at most `CLIENT_STATS_DURATIONS_MAX`.
    pub repair_ms: Vec<u64>,
    /// The same for closed holes.
    pub hole_ms: Vec<u64>,
    /// The last `gap_durations` row of those (0 for none).
    pub durations_through: i64,
}

impl GapCounts {
    /// Whether there is anything to tell the server.
    pub fn worth_reporting(&self) -> bool {
        self.detected > 0
            || self.repaired > 0
            || self.pending > 0
            || !self.repair_ms.is_empty()
            || !self.hole_ms.is_empty()
    }
}

fn repair_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Repair> {
    Ok(Repair {
        conv: r.get(0)?,
        from_msg_seq: r.get::<_, i64>(1)? as u64,
        sync_seq: r.get::<_, i64>(2)? as u64,
        reason: r.get(3)?,
        attempts: r.get::<_, i64>(4)? as u32,
        next_attempt_at_ms: r.get(5)?,
        last_error: r.get(6)?,
    })
}

const REPAIR_SELECT: &str =
    "SELECT conv, from_msg_seq, sync_seq, reason, attempts, next_attempt_at, last_error FROM repairs";

impl LocalStore {
    /// Every conversation waiting for repair.
    pub fn repairs(&self) -> StoreResult<Vec<Repair>> {
        let mut stmt = self.conn.prepare_cached(&format!("{REPAIR_SELECT} ORDER BY conv"))?;
        let rows = stmt.query_map([], repair_row)?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// What `client.stats` has to report: gaps detected and repaired since
    /// the last report the server accepted, and the repairs waiting now.
    /// The repair durations not yet reported, the oldest
    /// `CLIENT_STATS_DURATIONS_MAX` of each kind (one report's worth; the
    /// rest go in the next).
    pub fn unreported_gaps(&self) -> StoreResult<GapCounts> {
        let mut counts = self.conn.row(
            "SELECT detected - reported_detected, repaired - reported_repaired, (SELECT COUNT(*) FROM repairs)
             FROM gap_stats WHERE id = 1",
            [],
            |r| {
                Ok(GapCounts {
                    detected: r.get::<_, i64>(0)? as u64,
                    repaired: r.get::<_, i64>(1)? as u64,
                    pending: r.get::<_, i64>(2)? as u64,
                    ..GapCounts::default()
                })
            },
        )?;
        let max = tidemark_core::client_stats::CLIENT_STATS_DURATIONS_MAX;
        let mut stmt = self.conn.prepare_cached("SELECT id, kind, ms FROM gap_durations ORDER BY id LIMIT ?1 + 0")?;
        let rows = stmt
            .query_map(params![max as i64], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        for (id, kind, ms) in rows {
            let list = if kind == GAP_HOLE { &mut counts.hole_ms } else { &mut counts.repair_ms };
            list.push(ms.max(0) as u64);
            counts.durations_through = id;
        }
        Ok(counts)
    }

    /// Records that the server took a report of `counts` (after its reply,
    /// so a lost report is sent again, never skipped): its durations leave.
    pub fn gaps_reported(&mut self, counts: &GapCounts) -> StoreResult<()> {
        let tx = self.conn.transaction()?;
        tx.exec(
            "UPDATE gap_stats SET reported_detected = reported_detected + ?1, reported_repaired = reported_repaired + ?2",
            params![counts.detected as i64, counts.repaired as i64],
        )?;
        tx.exec("DELETE FROM gap_durations WHERE id <= ?1", params![counts.durations_through])?;
        tx.commit()?;
        Ok(())
    }

    /// At most `max` repairs whose wait is over at `now_ms`, oldest first.
    pub fn due_repairs(&self, now_ms: i64, max: usize) -> StoreResult<Vec<Repair>> {
        let mut stmt = self
            .conn
            .prepare_cached(&format!("{REPAIR_SELECT} WHERE next_attempt_at <= ?1 ORDER BY sync_seq LIMIT ?2 + 0"))?;
        let rows = stmt.query_map(params![now_ms, max as i64], repair_row)?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Records a failed attempt: the next one waits twice as long.
    pub fn repair_failed(&mut self, conv: &str, now_ms: i64, error: &str) -> StoreResult<Repair> {
        let attempts: i64 =
            self.conn.row("SELECT attempts FROM repairs WHERE conv = ?1", params![conv], |r| r.get(0))?;
        let wait = REPAIR_BACKOFF_FIRST_MS.saturating_mul(1i64 << attempts.min(20)).min(REPAIR_BACKOFF_MAX_MS);
        self.conn.exec(
            "UPDATE repairs SET attempts = attempts + 1, next_attempt_at = ?2, last_error = ?3 WHERE conv = ?1",
            params![conv, now_ms.saturating_add(wait), error],
        )?;
        Ok(self.conn.row(&format!("{REPAIR_SELECT} WHERE conv = ?1"), params![conv], repair_row)?)
    }

    /// Applies a pull of `conv` (`conv.sync` from this device's position,
    /// for a large group's marker or when the app opens a conversation) in
    /// one transaction, as a repair applies; a pending repair of `conv`
    /// is satisfied by it when `complete`.
    pub fn apply_pull(
        &mut self,
        conv: &str,
        events: &[Envelope],
        complete: bool,
        next_from: u64,
    ) -> Result<Option<CursorMove>, ApplyError> {
        self.apply_repair(conv, events, complete, next_from)
    }

    /// Records that `conv` is a large group in shared mode (its marker was
    /// seen before its switch event, say for a group created large).
    pub fn mark_shared(&mut self, conv: &str) -> StoreResult<()> {
        let tx = self.conn.transaction()?;
        super::apply::ensure_conv(&tx, conv)?;
        tx.exec("UPDATE conversations SET mode = 'shared', kind = 'group' WHERE conv = ?1", params![conv])?;
        tx.commit()?;
        Ok(())
    }

    /// Applies what the server served for a repaired conversation (its
    /// events from the repair's `from_msg_seq`, in order) in one
    /// transaction and, when `complete`, deletes the repair record; else
    /// the record moves up to `next_from`. A held row that contradicts the
    /// server is replaced by the server's. Returns the cursor's move.
    pub fn apply_repair(
        &mut self,
        conv: &str,
        events: &[Envelope],
        complete: bool,
        next_from: u64,
    ) -> Result<Option<CursorMove>, ApplyError> {
        let user = self.user.clone();
        let tx = self.conn.transaction().map_err(StoreError::from)?;
        let applied: i64 =
            tx.row("SELECT applied_sync_seq FROM device WHERE id = 1", [], |r| r.get(0)).map_err(StoreError::from)?;
        let mut touched = Touched::new();
        let cursor = load_cursor(&tx, conv)?;
        touched.insert(conv.to_owned(), Some((cursor.position(), cursor)));
        let mut report = PageReport::default();
        for env in events.iter().filter(|e| e.conv == conv && e.msg_seq > 0) {
            // The conversation log is the truth: a contradicting local row
            // at this position goes.
            tx.exec(
                "DELETE FROM messages WHERE conv = ?1 AND msg_seq = ?2 AND message_id <> ?3",
                params![conv, env.msg_seq as i64, env.message_id],
            )
            .map_err(StoreError::from)?;
            tx.exec(
                "DELETE FROM messages WHERE message_id = ?1 AND NOT (conv = ?2 AND msg_seq = ?3)",
                params![env.message_id, conv, env.msg_seq as i64],
            )
            .map_err(StoreError::from)?;
            apply_envelope(&tx, &user, env, None, &mut touched, &mut report)?;
        }
        let mut moved = None;
        if let Some(Some((before, cursor))) = touched.remove(conv) {
            moved = save_cursor(&tx, conv, before, &cursor)?.0;
        }
        refresh_summary(&tx, &user, conv, applied as u64)?;
        if complete {
            let queued_at: Option<i64> = tx
                .row("SELECT queued_at_ms FROM repairs WHERE conv = ?1", params![conv], |r| r.get(0))
                .optional()
                .map_err(StoreError::from)?;
            let done = tx.exec("DELETE FROM repairs WHERE conv = ?1", params![conv]).map_err(StoreError::from)?;
            tx.exec("UPDATE gap_stats SET repaired = repaired + ?1", params![done as i64]).map_err(StoreError::from)?;
            // A record older than its timestamp column has no duration.
            if let Some(at) = queued_at.filter(|at| *at > 0) {
                record_duration(&tx, GAP_REPAIR, repair_duration_ms(at, super::now_ms()))?;
            }
        } else {
            tx.exec(
                "UPDATE repairs SET from_msg_seq = MAX(from_msg_seq, ?2) WHERE conv = ?1",
                params![conv, next_from as i64],
            )
            .map_err(StoreError::from)?;
        }
        tx.commit().map_err(StoreError::from)?;
        Ok(moved)
    }
}
