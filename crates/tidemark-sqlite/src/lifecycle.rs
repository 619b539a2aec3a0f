//! Device lifecycle in the store: snapshots (D7) and user-log retention
//! (L1–L2). Writer-side functions run inside the writer's transaction.
//!
//! A snapshot's view is read on a read connection in one read transaction
//! whose head is the base, so it is exactly the user's view at that
//! `sync_seq` while the writer goes on; the writer then records the
//! snapshot at that base (refused if retention trimmed past it meanwhile)
//! and stores it one page per request, so a build never holds the writer
//! for more than a page, whatever the number of conversations.

use rusqlite::{params, Connection, OptionalExtension};
use tidemark_core::cursor::{self, decide_ack_with, AckDecision, CasDecision, DeviceCursor, DeviceState, RecoveryInfo};
use tidemark_core::retention::{self, Fences};
use tidemark_core::snapshot::{self, Install};
use tidemark_store::*;

use crate::{internal, read};

type R<T> = StoreResult<T>;

fn device_cursor(c: &Connection, user: &str, device: &str) -> R<DeviceCursor> {
    crate::read_device(c, user, device)?
        .map(|d| d.cursor)
        .ok_or_else(|| StoreError::NotFound(format!("device {device}")))
}

fn head(c: &Connection, user: &str) -> R<(u64, u64)> {
    Ok(c.prepare_cached("SELECT high_watermark, trimmed_upto FROM user_heads WHERE user_id = ?1")
        .map_err(internal)?
        .query_row(params![user], |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)))
        .optional()
        .map_err(internal)?
        .unwrap_or((0, 0)))
}

/// A user's log head: the highest `sync_seq` handed out (0 before the
/// first event).
pub(crate) fn high_watermark(c: &Connection, user: &str) -> R<u64> {
    Ok(head(c, user)?.0)
}

pub(crate) fn user_log(c: &Connection, user: &str) -> R<tidemark_core::cursor::UserLog> {
    let (high_watermark, trimmed_upto) = head(c, user)?;
    Ok(tidemark_core::cursor::UserLog { high_watermark, trimmed_upto })
}

/// The snapshot view (D7), on a read connection in one read transaction:
/// the head it reads first is the base, and everything after comes from
/// the same WAL snapshot, so the view is exactly the user's at that base
/// while the writer goes on. Sent in chunks of `chunk` conversations
/// through `out` (waiting while it is full); a dropped receiver ends it.
pub(crate) fn read_snapshot_view(
    c: &Connection,
    user: &str,
    device: &str,
    per_conv: u32,
    chunk: usize,
    out: &tokio::sync::mpsc::Sender<SnapshotViewPart>,
) -> R<()> {
    crate::read::in_snapshot(c, || view_in_transaction(c, user, device, per_conv, chunk.max(1), out))
}

fn view_in_transaction(
    c: &Connection,
    user: &str,
    device: &str,
    per_conv: u32,
    chunk: usize,
    out: &tokio::sync::mpsc::Sender<SnapshotViewPart>,
) -> R<()> {
    if out.blocking_send(SnapshotViewPart::Base(user_log(c, user)?)).is_err() {
        return Ok(());
    }
    let (privacy, version) = crate::receipts::privacy_versioned(c, user)?;
    if out.blocking_send(SnapshotViewPart::Privacy { privacy, version }).is_err() {
        return Ok(());
    }
    let convs = read::list_conversations(c, user, Some(device))?;
    let sql = format!(
        "SELECT {} FROM messages m
         WHERE m.conv_id = ?1 AND m.msg_seq <= ?3 AND {}
         ORDER BY m.msg_seq DESC LIMIT ?4 + 0",
        read::MSG_COLS,
        read::VISIBLE
    );
    let mut convs = convs.into_iter().peekable();
    while convs.peek().is_some() {
        let mut part = Vec::with_capacity(chunk);
        for state in convs.by_ref().take(chunk) {
            // What fan-out delivered to this user up to the base: messages
            // up to the projection's last_msg_seq, inside the user's
            // periods, newest `per_conv`.
            let mut stmt = c.prepare_cached(&sql).map_err(internal)?;
            let mut rows: Vec<(StoredMessage, Option<String>)> = stmt
                .query_map(params![state.conv, user, state.last_msg_seq as i64, per_conv], |r| read::message_at(r, 0))
                .map_err(internal)?
                .collect::<Result<_, _>>()
                .map_err(internal)?;
            rows.reverse();
            read::decorate(c, user, &mut rows)?;
            part.push(SnapshotConv { state, messages: rows.into_iter().map(|(m, _)| m).collect() });
        }
        if out.blocking_send(SnapshotViewPart::Convs(part)).is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// Records a `BUILDING` snapshot at a view's base (writer side).
#[allow(clippy::too_many_arguments)]
pub(crate) fn open_snapshot(
    c: &Connection,
    user: &str,
    device: &str,
    generation: u64,
    snapshot_id: &str,
    base: u64,
    expires_at_ms: i64,
    now_ms: i64,
) -> R<()> {
    snapshot::check_begin(device_cursor(c, user, device)?, generation)?;
    snapshot::check_base(base, user_log(c, user)?)?;
    c.execute(
        "INSERT INTO snapshots (snapshot_id, user_id, device_id, generation, base_sync_seq, state, created_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, 'BUILDING', ?6, ?7)",
        params![snapshot_id, user, device, generation as i64, base as i64, now_ms, expires_at_ms],
    )
    .map_err(internal)?;
    Ok(())
}

fn not_building(snapshot_id: &str) -> StoreError {
    StoreError::Conflict(format!("snapshot {snapshot_id} is not building"))
}

/// One page of a `BUILDING` snapshot (writer side).
pub(crate) fn add_snapshot_page(c: &Connection, snapshot_id: &str, page: u32, items: &[String]) -> R<()> {
    let building = c
        .prepare_cached("SELECT 1 FROM snapshots WHERE snapshot_id = ?1 AND state = 'BUILDING'")
        .map_err(internal)?
        .exists(params![snapshot_id])
        .map_err(internal)?;
    if !building {
        return Err(not_building(snapshot_id));
    }
    let mut stmt = c
        .prepare_cached("INSERT INTO snapshot_items (snapshot_id, page, idx, item) VALUES (?1, ?2, ?3, ?4)")
        .map_err(internal)?;
    for (i, item) in items.iter().enumerate() {
        stmt.execute(params![snapshot_id, page as i64, i as i64, item]).map_err(internal)?;
    }
    Ok(())
}

/// `BUILDING` → `READY` (writer side).
pub(crate) fn seal_snapshot(c: &Connection, snapshot_id: &str, digest: &str, pages: u32) -> R<()> {
    let n = c
        .execute(
            "UPDATE snapshots SET state = 'READY', manifest_digest = ?2, pages = ?3 WHERE snapshot_id = ?1 AND state = 'BUILDING'",
            params![snapshot_id, digest, pages as i64],
        )
        .map_err(internal)?;
    if n != 1 {
        return Err(not_building(snapshot_id));
    }
    Ok(())
}

pub(crate) fn snapshot(c: &Connection, snapshot_id: &str) -> R<Option<SnapshotMeta>> {
    c.prepare_cached(
        "SELECT user_id, device_id, generation, base_sync_seq, state, manifest_digest, pages, expires_at
         FROM snapshots WHERE snapshot_id = ?1",
    )
    .map_err(internal)?
    .query_row(params![snapshot_id], |r| {
        Ok(SnapshotMeta {
            snapshot_id: snapshot_id.into(),
            user: r.get(0)?,
            device: r.get(1)?,
            generation: r.get::<_, i64>(2)? as u64,
            base_sync_seq: r.get::<_, i64>(3)? as u64,
            state: r.get(4)?,
            manifest_digest: r.get(5)?,
            pages: r.get::<_, i64>(6)? as u32,
            expires_at_ms: r.get(7)?,
        })
    })
    .optional()
    .map_err(internal)
}

pub(crate) fn snapshot_page(c: &Connection, snapshot_id: &str, page: u32) -> R<Option<Vec<String>>> {
    let Some(meta) = snapshot(c, snapshot_id)? else { return Ok(None) };
    if !snapshot::serves_page(&meta.facts(), page) {
        return Ok(None);
    }
    let mut stmt = c
        .prepare_cached("SELECT item FROM snapshot_items WHERE snapshot_id = ?1 AND page = ?2 ORDER BY idx")
        .map_err(internal)?;
    let items = stmt
        .query_map(params![snapshot_id, page as i64], |r| r.get(0))
        .map_err(internal)?
        .collect::<Result<Vec<String>, _>>()
        .map_err(internal)?;
    Ok(Some(items))
}

pub(crate) fn ack_snapshot(
    c: &Connection,
    user: &str,
    device: &str,
    snapshot_id: &str,
    now_ms: i64,
) -> R<(bool, DeviceCursor)> {
    let meta = snapshot(c, snapshot_id)?.ok_or_else(|| StoreError::NotFound(format!("snapshot {snapshot_id}")))?;
    let cursor = device_cursor(c, user, device)?;
    let Install::Install(new) = snapshot::decide_install(&meta.facts(), snapshot_id, user, device, cursor, now_ms)?
    else {
        return Ok((false, cursor));
    };
    crate::write_cursor(c, user, device, new, now_ms)?;
    c.execute("UPDATE snapshots SET state = 'INSTALLED' WHERE snapshot_id = ?1", params![snapshot_id])
        .map_err(internal)?;
    // The device's other live snapshots (one whose `snapshot.begin` reply
    // was lost, say) can never be installed now: the device is ACTIVE and a
    // later reset takes a new generation. Expire them, or each would pin
    // the user's log for retention until its TTL (L1).
    c.execute(
        "UPDATE snapshots SET state = 'EXPIRED'
         WHERE user_id = ?1 AND device_id = ?2 AND state IN ('BUILDING','READY') AND snapshot_id <> ?3",
        params![user, device, snapshot_id],
    )
    .map_err(internal)?;
    // Their items and the installed one's are no longer needed by anyone.
    c.execute(
        "DELETE FROM snapshot_items WHERE snapshot_id IN
         (SELECT snapshot_id FROM snapshots WHERE user_id = ?1 AND device_id = ?2 AND state IN ('INSTALLED','EXPIRED'))",
        params![user, device],
    )
    .map_err(internal)?;
    Ok((true, new))
}

/// One retention pass. Per user, the fence is the lowest of: the ACK of
/// every device that is `ACTIVE` or `RECOVERING` and moved within the
/// inactivity window, the `resume_from` of every live recovery session, and
/// the base of every live (`BUILDING`/`READY`, unexpired) snapshot.
/// Events above the fence, or younger than the keep window, stay. The
/// client never reports a position that counts here (L1).
/// One step of the retention pass (`Store::trim_step`), in the writer's
/// transaction.
pub(crate) fn trim_step(
    c: &Connection,
    policy: RetentionPolicy,
    now_ms: i64,
    step: TrimStep,
) -> R<(TrimReport, Option<String>)> {
    match step {
        TrimStep::Snapshots => {
            let snapshots_expired = c
                .execute(
                    "UPDATE snapshots SET state = 'EXPIRED' WHERE state IN ('BUILDING','READY') AND expires_at <= ?1",
                    params![now_ms],
                )
                .map_err(internal)? as u64;
            c.execute(
                "DELETE FROM snapshot_items WHERE snapshot_id IN (SELECT snapshot_id FROM snapshots WHERE state = 'EXPIRED')",
                [],
            )
            .map_err(internal)?;
            Ok((TrimReport { snapshots_expired, ..TrimReport::default() }, None))
        }
        TrimStep::History { after } => {
            let mut report = TrimReport::default();
            let keep = policy.history_keep_ms.unwrap_or(i64::MAX);
            let next = trim_history(c, now_ms.saturating_sub(keep), &after, &mut report)?;
            Ok((report, next))
        }
        TrimStep::Users { after } => {
            let mut report = TrimReport::default();
            let next = trim_users(c, policy, now_ms, &after, &mut report)?;
            Ok((report, next))
        }
    }
}

/// L1 for up to `RETENTION_USERS_PER_CHUNK` users after `after`, deleting
/// at most `RETENTION_EVENTS_PER_CHUNK` events; the user to resume after.
fn trim_users(
    c: &Connection,
    policy: RetentionPolicy,
    now_ms: i64,
    after: &str,
    report: &mut TrimReport,
) -> R<Option<String>> {
    let users: Vec<(String, i64, i64)> = {
        let mut stmt = c
            .prepare_cached(
                "SELECT user_id, high_watermark, trimmed_upto FROM user_heads WHERE user_id > ?1 ORDER BY user_id LIMIT ?2",
            )
            .map_err(internal)?;
        let rows = stmt
            .query_map(params![after, RETENTION_USERS_PER_CHUNK], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .map_err(internal)?;
        rows.collect::<Result<_, _>>().map_err(internal)?
    };
    let active_since = now_ms - policy.device_inactive_after_ms;
    let young = now_ms - policy.keep_events_younger_than_ms;
    let mut budget = RETENTION_EVENTS_PER_CHUNK;
    let mut prev = after.to_owned();
    let full = users.len() as u32 == RETENTION_USERS_PER_CHUNK;
    for (user, hw, trimmed) in users {
        let (device_fence, recovery_fence, snapshot_fence, age_fence, deleted): (
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            bool,
        ) = c
            .prepare_cached(USER_FENCES)
            .map_err(internal)?
            .query_row(params![user, active_since, now_ms, young], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .map_err(internal)?;
        let seq = |v: Option<i64>| v.map(|v| v as u64);
        let fences = Fences {
            high_watermark: hw as u64,
            trimmed_upto: trimmed as u64,
            device: seq(device_fence),
            recovery: seq(recovery_fence),
            snapshot: seq(snapshot_fence),
            aged: seq(age_fence),
            deleted,
        };
        if let Some(fence) = retention::trim_to(fences) {
            // Bounded: the rest of a long log goes in the next step (the
            // trim point moves with what was deleted, so it stays true).
            let capped = fence.min(trimmed as u64 + budget);
            let deleted = c
                .execute("DELETE FROM user_events WHERE user_id = ?1 AND sync_seq <= ?2", params![user, capped as i64])
                .map_err(internal)?;
            c.execute("UPDATE user_heads SET trimmed_upto = ?2 WHERE user_id = ?1", params![user, capped as i64])
                .map_err(internal)?;
            tracing::info!(user = %user, trimmed_upto = capped, deleted, "user log trimmed");
            report.users_trimmed += 1;
            report.events_deleted += deleted as u64;
            budget -= capped - trimmed as u64;
            if capped < fence {
                // This user again, from where the step stopped.
                return Ok(Some(prev));
            }
            if budget == 0 {
                return Ok(Some(user));
            }
        }
        prev = user;
    }
    Ok(full.then_some(prev))
}

/// A user's retention fences in one statement: the lowest ACK of its valid
/// devices, of its live recovery sessions and snapshots, the newest event
/// old enough to go, and whether the user was deleted.
const USER_FENCES: &str = "SELECT
    (SELECT MIN(acked_sync_seq) FROM devices WHERE user_id = ?1 AND state IN ('ACTIVE','RECOVERING')
        AND updated_at >= ?2),
    (SELECT MIN(resume_from) FROM recovery_sessions WHERE user_id = ?1 AND state = 'ACTIVE' AND expires_at > ?3),
    (SELECT MIN(base_sync_seq) FROM snapshots WHERE user_id = ?1 AND state IN ('BUILDING','READY')),
    (SELECT MAX(sync_seq) FROM user_events WHERE user_id = ?1 AND created_at < ?4),
    EXISTS (SELECT 1 FROM users WHERE user_id = ?1 AND deleted_at IS NOT NULL)";

pub(crate) fn recovery_session(c: &Connection, user: &str, device: &str) -> R<Option<RecoveryInfo>> {
    c.prepare_cached(
        "SELECT session_id, resume_from, high_watermark, expires_at FROM recovery_sessions
         WHERE user_id = ?1 AND device_id = ?2 AND state = 'ACTIVE'",
    )
    .map_err(internal)?
    .query_row(params![user, device], |r| {
        Ok(RecoveryInfo {
            session_id: r.get(0)?,
            resume_from: r.get::<_, i64>(1)? as u64,
            high_watermark: r.get::<_, i64>(2)? as u64,
            expires_at_ms: r.get(3)?,
        })
    })
    .optional()
    .map_err(internal)
}

pub(crate) fn begin_recovery(
    c: &Connection,
    user: &str,
    device: &str,
    expected: DeviceCursor,
    session: &RecoveryInfo,
    now_ms: i64,
) -> R<(bool, DeviceCursor)> {
    let new = match cursor::decide_begin_recovery(device_cursor(c, user, device)?, expected) {
        CasDecision::Refuse { current } => return Ok((false, current)),
        CasDecision::Write { new, .. } => new,
    };
    crate::write_cursor(c, user, device, new, now_ms)?;
    // Any older session of this device is over: the generation moved.
    c.execute(
        "UPDATE recovery_sessions SET state = 'EXPIRED' WHERE user_id = ?1 AND device_id = ?2 AND state = 'ACTIVE'",
        params![user, device],
    )
    .map_err(internal)?;
    c.execute(
        "INSERT INTO recovery_sessions (session_id, user_id, device_id, generation, resume_from, high_watermark, state, created_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'ACTIVE', ?7, ?8)",
        params![
            session.session_id,
            user,
            device,
            new.generation as i64,
            session.resume_from as i64,
            session.high_watermark as i64,
            now_ms,
            session.expires_at_ms
        ],
    )
    .map_err(internal)?;
    Ok((true, new))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn ack(
    c: &Connection,
    connection_epoch: Option<u64>,
    user: &str,
    device: &str,
    generation: u64,
    token_session: Option<&str>,
    seq: u64,
    now_ms: i64,
) -> R<AckResult> {
    // The cursor and the device's newest connection in one statement: the
    // epoch fence (P2) costs no statement of its own.
    let row: Option<(i64, i64, String, i64)> = c
        .prepare_cached(
            "SELECT sync_generation, acked_sync_seq, state, connection_epoch FROM devices
             WHERE user_id = ?1 AND device_id = ?2",
        )
        .map_err(internal)?
        .query_row(params![user, device], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .optional()
        .map_err(internal)?;
    let Some((g, a, state, newest)) = row else { return Err(StoreError::NotFound(format!("device {device}"))) };
    let newest = newest.max(0) as u64;
    if tidemark_core::session::frame_superseded(connection_epoch, newest) {
        return Err(StoreError::Superseded(newest));
    }
    let cursor = crate::cursor_from_row(g, a, &state)?;
    let session = if cursor.state == DeviceState::Recovering { recovery_session(c, user, device)? } else { None };
    let decision = decide_ack_with(cursor, generation, token_session, session.as_ref(), seq, now_ms);
    let Some(after) = cursor::cursor_after_ack(cursor, decision) else {
        return Ok(AckResult { decision, cursor });
    };
    match decision {
        AckDecision::CompleteRecovery { .. } => {
            // The session's own CAS: only the live session of this
            // generation completes, and only here.
            let s = session.as_ref().expect("a completion has a session");
            let n = c
                .execute(
                    "UPDATE recovery_sessions SET state = 'COMPLETED' WHERE session_id = ?1 AND state = 'ACTIVE'",
                    params![s.session_id],
                )
                .map_err(internal)?;
            assert_eq!(n, 1, "the live session completes once");
        }
        AckDecision::RecoveryExpired { .. } => {
            c.execute(
                "UPDATE recovery_sessions SET state = 'EXPIRED' WHERE user_id = ?1 AND device_id = ?2 AND state = 'ACTIVE'",
                params![user, device],
            )
            .map_err(internal)?;
        }
        _ => {}
    }
    crate::write_cursor(c, user, device, after, now_ms)?;
    Ok(AckResult { decision, cursor: after })
}

/// Message-history retention (L3): per conversation, `min_seq` moves up to
/// the first message younger than `cutoff_ms` (or past the head when none
/// is), and every message below it loses its content (`expired`). Recall
/// events and recalled messages are tombstones and stay as they are, so a
/// device that still holds an original learns of its recall whatever the
/// window.
/// L3 for up to `RETENTION_CONVS_PER_CHUNK` conversations after `after`;
/// the conversation to resume after, `None` after the last.
fn trim_history(c: &Connection, cutoff_ms: i64, after: &str, report: &mut TrimReport) -> R<Option<String>> {
    let convs: Vec<(String, i64, i64)> = {
        let mut stmt = c
            .prepare_cached(
                "SELECT conv_id, head, min_seq FROM conversations WHERE conv_id > ?1 ORDER BY conv_id LIMIT ?2",
            )
            .map_err(internal)?;
        let rows = stmt
            .query_map(params![after, RETENTION_CONVS_PER_CHUNK], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .map_err(internal)?;
        rows.collect::<Result<_, _>>().map_err(internal)?
    };
    let next = (convs.len() as u32 == RETENTION_CONVS_PER_CHUNK).then(|| convs[convs.len() - 1].0.clone());
    for (conv, head, min_seq) in convs {
        let first_young: Option<i64> = c
            .query_row(
                "SELECT MIN(msg_seq) FROM messages WHERE conv_id = ?1 AND created_at >= ?2",
                params![conv, cutoff_ms],
                |r| r.get(0),
            )
            .map_err(internal)?;
        let Some(new_min) = retention::history_boundary(head as u64, min_seq as u64, first_young.map(|v| v as u64))
        else {
            continue;
        };
        let new_min = new_min as i64;
        let expired = c
            .execute(
                "UPDATE messages SET content = '{}', state = 'expired'
                 WHERE conv_id = ?1 AND msg_seq < ?2 AND state NOT IN ('recalled', 'expired') AND kind != 'recall'",
                params![conv, new_min],
            )
            .map_err(internal)?;
        c.execute("UPDATE conversations SET min_seq = ?2 WHERE conv_id = ?1", params![conv, new_min])
            .map_err(internal)?;
        report.conversations_trimmed += 1;
        report.messages_expired += expired as u64;
    }
    Ok(next)
}
