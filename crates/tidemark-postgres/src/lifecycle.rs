//! Device lifecycle in the store: recovery sessions and the ACK (D4, D6),
//! snapshots (D7) and user-log retention (L1–L2), with the SQLite backend's
//! rules. Writer-side functions run inside the writer's transaction.
//!
//! A snapshot's view is read in one `REPEATABLE READ` snapshot whose
//! head is the base, so no fan-out (from this writer or any other) can add
//! to the user's log between the base and the view, and no writer waits
//! for it; the snapshot is then recorded at that base and stored one page
//! per writer request. Operations that move where a user's log may be trimmed (opening a
//! recovery session, starting a snapshot) and the trimming itself lock the
//! user's head row first, so a fence is never computed while another writer
//! is adding one. This module knows nothing about the queue or the pool.

use tidemark_core::cursor::{self, decide_ack_with, AckDecision, CasDecision, DeviceCursor, RecoveryInfo, UserLog};
use tidemark_core::retention::{self, Fences};
use tidemark_core::snapshot::{self, Install};
use tidemark_store::*;
use tokio_postgres::Row;

use crate::db::{big, col, exec, query, query_opt, seq, seq_opt, Conn};
use crate::writer::Decided;
use crate::{events, read, read_device, write_cursor, DEVICE_FOR_UPDATE_SQL};

type R<T> = StoreResult<T>;

/// The device's cursor, locked until COMMIT.
async fn device_cursor(c: &Conn, user: &str, device: &str) -> R<DeviceCursor> {
    read_device(c, DEVICE_FOR_UPDATE_SQL, user, device)
        .await?
        .map(|d| d.cursor)
        .ok_or_else(|| StoreError::NotFound(format!("device {device}")))
}

pub(crate) async fn user_log(c: &Conn, user: &str) -> R<UserLog> {
    let row = query_opt(c, "SELECT high_watermark, trimmed_upto FROM user_heads WHERE user_id = $1", &[&user]).await?;
    Ok(match row {
        Some(r) => UserLog { high_watermark: seq(&r, 0)?, trimmed_upto: seq(&r, 1)? },
        None => UserLog { high_watermark: 0, trimmed_upto: 0 },
    })
}

/// The snapshot view (D7), in one `REPEATABLE READ READ ONLY` transaction
/// of a snapshot reader: the head it reads first is the base, and
/// everything after comes from the same snapshot, so the view is exactly
/// the user's at that base while every writer goes on. Sent in chunks of
/// `chunk` conversations through `out` (waiting while it is full); a
/// dropped receiver ends it.
pub(crate) async fn read_snapshot_view(
    c: &Conn,
    user: &str,
    device: &str,
    per_conv: u32,
    chunk: usize,
    out: &tokio::sync::mpsc::Sender<SnapshotViewPart>,
) -> R<()> {
    if out.send(SnapshotViewPart::Base(user_log(c, user).await?)).await.is_err() {
        return Ok(());
    }
    let (privacy, version) = crate::receipts::privacy_versioned(c, user).await?;
    if out.send(SnapshotViewPart::Privacy { privacy, version }).await.is_err() {
        return Ok(());
    }
    let convs = read::list_conversations(c, user, Some(device)).await?;
    // What fan-out delivered to this user up to the base: per
    // conversation, messages up to the projection's last_msg_seq, inside
    // the user's periods, newest `per_conv`; a chunk in one statement.
    let sql = format!(
        "SELECT x.n, {cols} FROM unnest($1::text[], $3::bigint[]) WITH ORDINALITY AS x(conv_id, last, n)
         CROSS JOIN LATERAL (
             SELECT m.* FROM messages m
             WHERE m.conv_id = x.conv_id AND m.msg_seq <= x.last AND {visible}
             ORDER BY m.msg_seq DESC LIMIT $4) m
         ORDER BY x.n, m.msg_seq",
        cols = read::MSG_COLS,
        visible = read::VISIBLE,
    );
    let mut convs = convs.into_iter().peekable();
    while convs.peek().is_some() {
        let states: Vec<ConvState> = convs.by_ref().take(chunk.max(1)).collect();
        let ids: Vec<String> = states.iter().map(|s| s.conv.clone()).collect();
        let lasts: Vec<i64> = states.iter().map(|s| big(s.last_msg_seq)).collect();
        let rows = query(c, &sql, &[&ids, &user, &lasts, &i64::from(per_conv)]).await?;
        let mut slots = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        for r in &rows {
            let n: i64 = col(r, 0)?;
            slots.push(usize::try_from(n - 1).map_err(|_| StoreError::Internal(format!("bad ordinality {n}")))?);
            messages.push(read::message_at(r, 1)?);
        }
        read::decorate(c, user, &mut messages).await?;
        let mut part: Vec<SnapshotConv> =
            states.into_iter().map(|state| SnapshotConv { state, messages: Vec::new() }).collect();
        for (slot, (m, _)) in slots.into_iter().zip(messages) {
            let conv = part.get_mut(slot).ok_or_else(|| StoreError::Internal(format!("bad snapshot slot {slot}")))?;
            conv.messages.push(m);
        }
        if out.send(SnapshotViewPart::Convs(part)).await.is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// Records a `BUILDING` snapshot at a view's base, the user's head row
/// locked (a fence is never added while retention computes one).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn open_snapshot(
    c: &Conn,
    user: &str,
    device: &str,
    generation: u64,
    snapshot_id: &str,
    base: u64,
    expires_at_ms: i64,
    now_ms: i64,
) -> R<()> {
    events::lock_user(c, user).await?;
    snapshot::check_begin(device_cursor(c, user, device).await?, generation)?;
    snapshot::check_base(base, user_log(c, user).await?)?;
    exec(
        c,
        "INSERT INTO snapshots (snapshot_id, user_id, device_id, generation, base_sync_seq, state, created_at, expires_at)
         VALUES ($1, $2, $3, $4, $5, 'BUILDING', $6, $7)",
        &[&snapshot_id, &user, &device, &big(generation), &big(base), &now_ms, &expires_at_ms],
    )
    .await?;
    Ok(())
}

fn not_building(snapshot_id: &str) -> StoreError {
    StoreError::Conflict(format!("snapshot {snapshot_id} is not building"))
}

/// One page of a `BUILDING` snapshot, in one statement.
pub(crate) async fn add_snapshot_page(c: &Conn, snapshot_id: &str, page: u32, items: &[String]) -> R<()> {
    let building = query_opt(
        c,
        "SELECT 1 FROM snapshots WHERE snapshot_id = $1 AND state = 'BUILDING' FOR UPDATE",
        &[&snapshot_id],
    )
    .await?;
    if building.is_none() {
        return Err(not_building(snapshot_id));
    }
    if !items.is_empty() {
        let idxs: Vec<i64> = (0..items.len() as i64).collect();
        let texts: Vec<&str> = items.iter().map(String::as_str).collect();
        exec(
            c,
            "INSERT INTO snapshot_items (snapshot_id, page, idx, item)
             SELECT $1, $2, i, t FROM unnest($3::bigint[], $4::text[]) AS x(i, t)",
            &[&snapshot_id, &i64::from(page), &idxs, &texts],
        )
        .await?;
    }
    Ok(())
}

/// `BUILDING` → `READY`.
pub(crate) async fn seal_snapshot(c: &Conn, snapshot_id: &str, digest: &str, pages: u32) -> R<()> {
    let n = exec(
        c,
        "UPDATE snapshots SET state = 'READY', manifest_digest = $2, pages = $3
         WHERE snapshot_id = $1 AND state = 'BUILDING'",
        &[&snapshot_id, &digest, &i64::from(pages)],
    )
    .await?;
    if n != 1 {
        return Err(not_building(snapshot_id));
    }
    Ok(())
}

const SNAPSHOT_COLS: &str = "user_id, device_id, generation, base_sync_seq, state, manifest_digest, pages, expires_at";

fn snapshot_at(snapshot_id: &str, r: &Row) -> R<SnapshotMeta> {
    let pages: i64 = col(r, 6)?;
    Ok(SnapshotMeta {
        snapshot_id: snapshot_id.into(),
        user: col(r, 0)?,
        device: col(r, 1)?,
        generation: seq(r, 2)?,
        base_sync_seq: seq(r, 3)?,
        state: col(r, 4)?,
        manifest_digest: col(r, 5)?,
        pages: u32::try_from(pages).map_err(|_| StoreError::Internal(format!("bad page count {pages}")))?,
        expires_at_ms: col(r, 7)?,
    })
}

pub(crate) async fn snapshot(c: &Conn, snapshot_id: &str) -> R<Option<SnapshotMeta>> {
    let sql = format!("SELECT {SNAPSHOT_COLS} FROM snapshots WHERE snapshot_id = $1");
    query_opt(c, &sql, &[&snapshot_id]).await?.map(|r| snapshot_at(snapshot_id, &r)).transpose()
}

/// The snapshot row, locked until COMMIT.
async fn snapshot_for_update(c: &Conn, snapshot_id: &str) -> R<Option<SnapshotMeta>> {
    let sql = format!("SELECT {SNAPSHOT_COLS} FROM snapshots WHERE snapshot_id = $1 FOR UPDATE");
    query_opt(c, &sql, &[&snapshot_id]).await?.map(|r| snapshot_at(snapshot_id, &r)).transpose()
}

/// One page of a snapshot; the caller runs it in one read snapshot, so the
/// state and the items agree.
pub(crate) async fn snapshot_page(c: &Conn, snapshot_id: &str, page: u32) -> R<Option<Vec<String>>> {
    let Some(meta) = snapshot(c, snapshot_id).await? else { return Ok(None) };
    if !snapshot::serves_page(&meta.facts(), page) {
        return Ok(None);
    }
    let rows = query(
        c,
        "SELECT item FROM snapshot_items WHERE snapshot_id = $1 AND page = $2 ORDER BY idx",
        &[&snapshot_id, &i64::from(page)],
    )
    .await?;
    rows.iter().map(|r| col(r, 0)).collect::<R<Vec<String>>>().map(Some)
}

pub(crate) async fn ack_snapshot(
    c: &Conn,
    user: &str,
    device: &str,
    snapshot_id: &str,
    now_ms: i64,
) -> R<(bool, DeviceCursor)> {
    let meta = snapshot_for_update(c, snapshot_id)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("snapshot {snapshot_id}")))?;
    let cursor = device_cursor(c, user, device).await?;
    let Install::Install(new) = snapshot::decide_install(&meta.facts(), snapshot_id, user, device, cursor, now_ms)?
    else {
        return Ok((false, cursor));
    };
    write_cursor(c, user, device, new, now_ms).await?;
    exec(c, "UPDATE snapshots SET state = 'INSTALLED' WHERE snapshot_id = $1", &[&snapshot_id]).await?;
    // The device's other live snapshots (one whose `snapshot.begin` reply
    // was lost, say) can never be installed now: the device is ACTIVE and a
    // later reset takes a new generation. Expire them, or each would pin
    // the user's log for retention until its TTL (L1).
    exec(
        c,
        "UPDATE snapshots SET state = 'EXPIRED'
         WHERE user_id = $1 AND device_id = $2 AND state IN ('BUILDING','READY') AND snapshot_id <> $3",
        &[&user, &device, &snapshot_id],
    )
    .await?;
    // Their items and the installed one's are no longer needed by anyone.
    exec(
        c,
        "DELETE FROM snapshot_items WHERE snapshot_id IN
         (SELECT snapshot_id FROM snapshots WHERE user_id = $1 AND device_id = $2 AND state IN ('INSTALLED','EXPIRED'))",
        &[&user, &device],
    )
    .await?;
    Ok((true, new))
}

/// One user's fences, read with the user's head row locked: head, trim
/// point, and the lowest device ACK, recovery start, snapshot base and the
/// newest event older than the keep window.
const USER_FENCES: &str = "SELECT h.high_watermark, h.trimmed_upto,
        (SELECT MIN(acked_sync_seq) FROM devices d
         WHERE d.user_id = h.user_id AND d.state IN ('ACTIVE','RECOVERING') AND d.updated_at >= $2),
        (SELECT MIN(resume_from) FROM recovery_sessions r
         WHERE r.user_id = h.user_id AND r.state = 'ACTIVE' AND r.expires_at > $3),
        (SELECT MIN(base_sync_seq) FROM snapshots s WHERE s.user_id = h.user_id AND s.state IN ('BUILDING','READY')),
        (SELECT MAX(sync_seq) FROM user_events e WHERE e.user_id = h.user_id AND e.created_at < $4),
        EXISTS (SELECT 1 FROM users u WHERE u.user_id = h.user_id AND u.deleted_at IS NOT NULL)
     FROM user_heads h WHERE h.user_id = $1 FOR UPDATE OF h";

/// One step of the retention pass (`Store::trim_step`). Per user, the fence is the lowest of: the ACK of
/// every device that is `ACTIVE` or `RECOVERING` and moved within the
/// inactivity window, the `resume_from` of every live recovery session, and
/// the base of every live (`BUILDING`/`READY`, unexpired) snapshot.
/// Events above the fence, or younger than the keep window, stay. The
/// client never reports a position that counts here (L1). Users are visited
/// in `user_id` order, the order fan-out locks heads in; each step is a
/// writer request of its own, so the head locks it takes last one step.
pub(crate) async fn trim_step(
    c: &Conn,
    policy: RetentionPolicy,
    now_ms: i64,
    step: TrimStep,
) -> R<(TrimReport, Option<String>)> {
    match step {
        TrimStep::Snapshots => {
            let snapshots_expired = exec(
                c,
                "UPDATE snapshots SET state = 'EXPIRED' WHERE state IN ('BUILDING','READY') AND expires_at <= $1",
                &[&now_ms],
            )
            .await?;
            exec(
                c,
                "DELETE FROM snapshot_items WHERE snapshot_id IN (SELECT snapshot_id FROM snapshots WHERE state = 'EXPIRED')",
                &[],
            )
            .await?;
            Ok((TrimReport { snapshots_expired, ..TrimReport::default() }, None))
        }
        TrimStep::History { after } => {
            let mut report = TrimReport::default();
            let keep = policy.history_keep_ms.unwrap_or(i64::MAX);
            let next = trim_history(c, now_ms.saturating_sub(keep), &after, &mut report).await?;
            Ok((report, next))
        }
        TrimStep::Users { after } => {
            let mut report = TrimReport::default();
            let next = trim_users(c, policy, now_ms, &after, &mut report).await?;
            Ok((report, next))
        }
    }
}

/// L1 for up to `RETENTION_USERS_PER_CHUNK` users after `after`, deleting
/// at most `RETENTION_EVENTS_PER_CHUNK` events; the user to resume after.
async fn trim_users(
    c: &Conn,
    policy: RetentionPolicy,
    now_ms: i64,
    after: &str,
    report: &mut TrimReport,
) -> R<Option<String>> {
    let users = query(
        c,
        "SELECT user_id FROM user_heads WHERE user_id > $1 ORDER BY user_id LIMIT $2",
        &[&after, &i64::from(RETENTION_USERS_PER_CHUNK)],
    )
    .await?;
    let full = users.len() as u32 == RETENTION_USERS_PER_CHUNK;
    let active_since = now_ms - policy.device_inactive_after_ms;
    let young = now_ms - policy.keep_events_younger_than_ms;
    let mut budget = RETENTION_EVENTS_PER_CHUNK;
    let mut prev = after.to_owned();
    for u in &users {
        let user: String = col(u, 0)?;
        let Some(r) = query_opt(c, USER_FENCES, &[&user, &active_since, &now_ms, &young]).await? else { continue };
        let fences = Fences {
            high_watermark: seq(&r, 0)?,
            trimmed_upto: seq(&r, 1)?,
            device: seq_opt(&r, 2)?,
            recovery: seq_opt(&r, 3)?,
            snapshot: seq_opt(&r, 4)?,
            aged: seq_opt(&r, 5)?,
            deleted: col(&r, 6)?,
        };
        if let Some(fence) = retention::trim_to(fences) {
            // Bounded: the rest of a long log goes in the next step (the
            // trim point moves with what was deleted, so it stays true).
            let capped = fence.min(fences.trimmed_upto + budget);
            let deleted =
                exec(c, "DELETE FROM user_events WHERE user_id = $1 AND sync_seq <= $2", &[&user, &big(capped)])
                    .await?;
            exec(c, "UPDATE user_heads SET trimmed_upto = $2 WHERE user_id = $1", &[&user, &big(capped)]).await?;
            tracing::info!(user = %user, trimmed_upto = capped, deleted, "user log trimmed");
            report.users_trimmed += 1;
            report.events_deleted += deleted;
            budget -= capped - fences.trimmed_upto;
            if capped < fence {
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

pub(crate) async fn recovery_session(c: &Conn, user: &str, device: &str) -> R<Option<RecoveryInfo>> {
    let row = query_opt(
        c,
        "SELECT session_id, resume_from, high_watermark, expires_at FROM recovery_sessions
         WHERE user_id = $1 AND device_id = $2 AND state = 'ACTIVE'",
        &[&user, &device],
    )
    .await?;
    row.map(|r| {
        Ok(RecoveryInfo {
            session_id: col(&r, 0)?,
            resume_from: seq(&r, 1)?,
            high_watermark: seq(&r, 2)?,
            expires_at_ms: col(&r, 3)?,
        })
    })
    .transpose()
}

pub(crate) async fn begin_recovery(
    c: &Conn,
    user: &str,
    device: &str,
    expected: DeviceCursor,
    session: &RecoveryInfo,
    now_ms: i64,
) -> R<(bool, DeviceCursor)> {
    events::lock_user(c, user).await?;
    let new = match cursor::decide_begin_recovery(device_cursor(c, user, device).await?, expected) {
        CasDecision::Refuse { current } => return Ok((false, current)),
        CasDecision::Write { new, .. } => new,
    };
    write_cursor(c, user, device, new, now_ms).await?;
    // Any older session of this device is over: the generation moved.
    exec(
        c,
        "UPDATE recovery_sessions SET state = 'EXPIRED' WHERE user_id = $1 AND device_id = $2 AND state = 'ACTIVE'",
        &[&user, &device],
    )
    .await?;
    exec(
        c,
        "INSERT INTO recovery_sessions (user_id, session_id, device_id, generation, resume_from, high_watermark, state,
                                        created_at, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, 'ACTIVE', $7, $8)",
        &[
            &user,
            &session.session_id,
            &device,
            &big(new.generation),
            &big(session.resume_from),
            &big(session.high_watermark),
            &now_ms,
            &session.expires_at_ms,
        ],
    )
    .await?;
    Ok((true, new))
}

/// A cumulative ACK in one statement, `tidemark_ack` (schema step 15); the
/// parameters are [`ack_params`], [`decide_ack_row`] reads the outcome.
pub(crate) const ACK_SQL: &str = "SELECT * FROM tidemark_ack($1, $2, $3, $4, $5, $6, $7)";

/// One ACK, as [`ACK_SQL`] takes it and [`decide_ack_row`] judges it.
#[derive(Debug, Clone)]
pub(crate) struct AckCmd {
    pub connection_epoch: Option<u64>,
    pub user: String,
    pub device: String,
    pub generation: u64,
    pub token_session: Option<String>,
    pub seq: u64,
    pub now_ms: i64,
}

/// The parameters of [`ACK_SQL`] for `cmd`.
pub(crate) fn ack_params(cmd: &AckCmd) -> Vec<crate::writer::Param> {
    vec![
        Box::new(cmd.user.clone()),
        Box::new(cmd.device.clone()),
        Box::new(big(cmd.generation)),
        Box::new(cmd.token_session.clone()),
        Box::new(big(cmd.seq)),
        Box::new(cmd.now_ms),
        Box::new(cmd.connection_epoch.map(big)),
    ]
}

/// What `tidemark_core` makes of `tidemark_ack`'s row: the statement
/// decided and wrote as `cursor::decide_ack_with` and `cursor_after_ack`
/// do; here core decides again on the facts the statement read (the
/// locked cursor, the open session), and a disagreement undoes the
/// request and answers `Internal`, never committed against core's rule.
pub(crate) fn decide_ack_row(cmd: &AckCmd, rows: &[Row]) -> Decided<AckResult> {
    let decided = (|| -> R<Decided<AckResult>> {
        let [r] = rows else {
            return Err(StoreError::Internal(format!("tidemark_ack returned {} rows", rows.len())));
        };
        let status: String = col(r, 0)?;
        match status.as_str() {
            "no_device" => return Ok(Decided::Answer(Err(StoreError::NotFound(format!("device {}", cmd.device))))),
            "superseded" => {
                let newest = seq(r, 4)?;
                if !tidemark_core::session::frame_superseded(cmd.connection_epoch, newest) {
                    return Err(StoreError::Internal(format!(
                        "tidemark_ack refused epoch {:?} under {newest}, which frame_superseded accepts",
                        cmd.connection_epoch
                    )));
                }
                return Ok(Decided::Answer(Err(StoreError::Superseded(newest))));
            }
            "ok" => {}
            other => return Err(StoreError::Internal(format!("tidemark_ack status {other}"))),
        }
        let state: String = col(r, 3)?;
        let cursor = crate::cursor_from_row(col(r, 1)?, col(r, 2)?, &state)?;
        let session_id: Option<String> = col(r, 5)?;
        let session = match session_id {
            Some(session_id) => Some(RecoveryInfo {
                session_id,
                resume_from: seq(r, 6)?,
                high_watermark: seq(r, 7)?,
                expires_at_ms: col(r, 8)?,
            }),
            None => None,
        };
        let decision = decide_ack_with(
            cursor,
            cmd.generation,
            cmd.token_session.as_deref(),
            session.as_ref(),
            cmd.seq,
            cmd.now_ms,
        );
        let sql: String = col(r, 9)?;
        let sql_to: Option<i64> = col(r, 10)?;
        let agrees = match decision {
            AckDecision::Advance { to } => sql == "advance" && sql_to == Some(big(to)),
            AckDecision::CompleteRecovery { to } => sql == "complete_recovery" && sql_to == Some(big(to)),
            AckDecision::Unchanged { .. } => sql == "unchanged",
            AckDecision::StaleGeneration { .. } => sql == "stale_generation",
            AckDecision::Resetting { .. } => sql == "resetting",
            AckDecision::Revoked => sql == "revoked",
            AckDecision::RecoveryExpired { .. } => sql == "recovery_expired",
        };
        if !agrees {
            return Ok(Decided::Undo(StoreError::Internal(format!(
                "tidemark_ack decided {sql} {sql_to:?} on {cursor:?}, where decide_ack_with decides {decision:?}"
            ))));
        }
        let after = cursor::cursor_after_ack(cursor, decision).unwrap_or(cursor);
        Ok(Decided::Answer(Ok(AckResult { decision, cursor: after })))
    })();
    match decided {
        Ok(d) => d,
        // A row this build cannot read: whatever the statement wrote must
        // not commit.
        Err(e) => Decided::Undo(e),
    }
}

/// Message-history retention (L3), as in the SQLite backend: per
/// conversation, `min_seq` moves up to the first message younger than the
/// cutoff (or past the head), contents below it expire, recall tombstones
/// stay.
/// L3 for up to `RETENTION_CONVS_PER_CHUNK` conversations after `after`;
/// the conversation to resume after, `None` after the last.
async fn trim_history(c: &Conn, cutoff_ms: i64, after: &str, report: &mut TrimReport) -> R<Option<String>> {
    let convs = query(
        c,
        "SELECT conv_id, head, min_seq FROM conversations WHERE conv_id > $1 ORDER BY conv_id LIMIT $2",
        &[&after, &i64::from(RETENTION_CONVS_PER_CHUNK)],
    )
    .await?;
    let next = match convs.last() {
        Some(last) if convs.len() as u32 == RETENTION_CONVS_PER_CHUNK => Some(col::<String>(last, 0)?),
        _ => None,
    };
    for row in &convs {
        let (conv, head, min_seq): (String, i64, i64) = (col(row, 0)?, col(row, 1)?, col(row, 2)?);
        let first_young: Option<i64> = crate::db::scalar::<Option<i64>>(
            c,
            "SELECT MIN(msg_seq) FROM messages WHERE conv_id = $1 AND created_at >= $2",
            &[&conv, &cutoff_ms],
        )
        .await?
        .flatten();
        let Some(new_min) = retention::history_boundary(head as u64, min_seq as u64, first_young.map(|v| v as u64))
        else {
            continue;
        };
        let new_min = big(new_min);
        let expired = exec(
            c,
            "UPDATE messages SET content = '{}', state = 'expired'
             WHERE conv_id = $1 AND msg_seq < $2 AND state NOT IN ('recalled', 'expired') AND kind <> 'recall'",
            &[&conv, &new_min],
        )
        .await?;
        exec(c, "UPDATE conversations SET min_seq = $2 WHERE conv_id = $1", &[&conv, &new_min]).await?;
        report.conversations_trimmed += 1;
        report.messages_expired += expired;
    }
    Ok(next)
}
