//! Offline push targets and the owed-push claim (P4): the SQL only. Who is
//! pushed, what coalesces and what a provider's answer does is decided by
//! `tidemark_core::push` in the server on the facts read here. Every write
//! runs on the writer thread (group-committed with the rest).

use rusqlite::{params, Connection, OptionalExtension, Row};
use tidemark_core::push::{OwedEvent, Preview};
use tidemark_store::*;

use crate::internal;

type R<T> = StoreResult<T>;

const TARGET_COLUMNS: &str = "user_id, device_id, platform, token_sealed, token_hash, token_last4, app_id, p256dh, \
                              auth, preview, created_at, updated_at";

fn target_row(r: &Row<'_>) -> rusqlite::Result<PushTarget> {
    Ok(PushTarget {
        user: r.get(0)?,
        device: r.get(1)?,
        platform: r.get(2)?,
        token_sealed: r.get(3)?,
        token_hash: r.get(4)?,
        token_last4: r.get(5)?,
        app_id: r.get(6)?,
        p256dh: r.get(7)?,
        auth: r.get(8)?,
        preview: r.get(9)?,
        created_at_ms: r.get(10)?,
        updated_at_ms: r.get(11)?,
    })
}

/// A stored preview level (a `CHECK`ed column) as the rules name it.
pub(crate) fn preview_col(r: &Row<'_>, i: usize) -> rusqlite::Result<Preview> {
    let s: String = r.get(i)?;
    Preview::parse(&s).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, format!("preview {s:?}").into())
    })
}

pub(crate) fn put_target(c: &Connection, t: &PushTarget, now_ms: i64) -> R<bool> {
    let state: Option<String> = c
        .prepare_cached("SELECT state FROM devices WHERE user_id = ?1 AND device_id = ?2")
        .map_err(internal)?
        .query_row(params![t.user, t.device], |r| r.get(0))
        .optional()
        .map_err(internal)?;
    if state.as_deref().is_none_or(|s| s == "REVOKED") {
        return Err(StoreError::NotFound(format!("device {}", t.device)));
    }
    let head = crate::lifecycle::high_watermark(c, &t.user)? as i64;
    let existed: Option<i64> = c
        .prepare_cached("SELECT 1 FROM push_targets WHERE user_id = ?1 AND device_id = ?2")
        .map_err(internal)?
        .query_row(params![t.user, t.device], |r| r.get(0))
        .optional()
        .map_err(internal)?;
    // A replaced target keeps its position, lease and wait; a new token
    // starts with no failures.
    c.prepare_cached(
        "INSERT INTO push_targets (user_id, device_id, platform, token_sealed, token_hash, token_last4, app_id,
                                   p256dh, auth, preview, pushed_through, created_at, updated_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?12)
         ON CONFLICT (user_id, device_id) DO UPDATE SET platform = excluded.platform,
             token_sealed = excluded.token_sealed, token_hash = excluded.token_hash,
             token_last4 = excluded.token_last4, app_id = excluded.app_id, p256dh = excluded.p256dh,
             auth = excluded.auth, preview = excluded.preview, attempts = 0, updated_at = excluded.updated_at",
    )
    .map_err(internal)?
    .execute(params![
        t.user,
        t.device,
        t.platform,
        t.token_sealed,
        t.token_hash,
        t.token_last4,
        t.app_id,
        t.p256dh,
        t.auth,
        t.preview,
        head,
        now_ms
    ])
    .map_err(internal)?;
    Ok(existed.is_none())
}

pub(crate) fn targets(c: &Connection, user: &str) -> R<Vec<PushTarget>> {
    let sql = format!("SELECT {TARGET_COLUMNS} FROM push_targets WHERE user_id = ?1 ORDER BY device_id");
    let mut stmt = c.prepare_cached(&sql).map_err(internal)?;
    let rows = stmt.query_map(params![user], target_row).map_err(internal)?;
    rows.collect::<rusqlite::Result<_>>().map_err(internal)
}

pub(crate) fn remove_target(c: &Connection, user: &str, device: &str, token_hash: Option<&str>) -> R<bool> {
    let n = c
        .prepare_cached(
            "DELETE FROM push_targets WHERE user_id = ?1 AND device_id = ?2 AND (?3 IS NULL OR token_hash = ?3)",
        )
        .map_err(internal)?
        .execute(params![user, device, token_hash])
        .map_err(internal)?;
    Ok(n > 0)
}

pub(crate) fn claim(c: &Connection, now_ms: i64, lease_ms: i64, limit: u32, scan_max: u32) -> R<Vec<OwedPushes>> {
    // The writer thread is the only writer, so reading the candidates and
    // taking their lease in one transaction is the claim.
    let mut due = c
        .prepare_cached(
            "SELECT t.user_id, t.device_id, MAX(t.pushed_through, d.acked_sync_seq), t.attempts,
                    COALESCE(p.push_preview, 'full'), t.preview = 'full' AND COALESCE(p.push_preview, 'full') = 'full'
             FROM push_targets t
             JOIN devices d ON d.user_id = t.user_id AND d.device_id = t.device_id
             JOIN user_heads h ON h.user_id = t.user_id
             LEFT JOIN user_privacy p ON p.user_id = t.user_id
             WHERE t.next_at <= ?1 AND t.claim_until <= ?1 AND d.state <> 'REVOKED'
               AND h.high_watermark > MAX(t.pushed_through, d.acked_sync_seq)
             ORDER BY t.next_at LIMIT ?2",
        )
        .map_err(internal)?;
    type Candidate = (String, String, i64, i64, Preview, bool);
    let candidates: Vec<Candidate> = due
        .query_map(params![now_ms, limit], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, preview_col(r, 4)?, r.get(5)?))
        })
        .map_err(internal)?
        .collect::<rusqlite::Result<_>>()
        .map_err(internal)?;
    let mut out = Vec::with_capacity(candidates.len());
    for (user, device, from, attempts, user_preview, full) in candidates {
        let claim: i64 = c
            .prepare_cached(
                "UPDATE push_targets SET claim_seq = claim_seq + 1, claim_until = ?3
                 WHERE user_id = ?1 AND device_id = ?2 RETURNING claim_seq",
            )
            .map_err(internal)?
            .query_row(params![user, device, now_ms + lease_ms], |r| r.get(0))
            .map_err(internal)?;
        let sql = format!("SELECT {TARGET_COLUMNS} FROM push_targets WHERE user_id = ?1 AND device_id = ?2");
        let target =
            c.prepare_cached(&sql).map_err(internal)?.query_row(params![user, device], target_row).map_err(internal)?;
        let mut stmt = c
            .prepare_cached(
                "SELECT e.sync_seq, e.kind, e.conv_id, m.sender, COALESCE(uc.muted, 0), e.created_at,
                        COALESCE(uc.push_preview, 'full'),
                        CASE WHEN ?4 AND COALESCE(uc.push_preview, 'full') = 'full' THEN m.content END,
                        m.message_id IS NOT NULL AND (m.mention_all = 1
                            OR EXISTS (SELECT 1 FROM json_each(m.mentions) j WHERE j.value = ?1))
                 FROM user_events e
                 LEFT JOIN messages m ON m.message_id = e.message_id
                 LEFT JOIN user_convs uc ON uc.user_id = e.user_id AND uc.conv_id = e.conv_id
                 WHERE e.user_id = ?1 AND e.sync_seq > ?2 ORDER BY e.sync_seq LIMIT ?3",
            )
            .map_err(internal)?;
        let rows = stmt
            .query_map(params![user, from, scan_max, full], |r| {
                let event = OwedEvent {
                    sync_seq: r.get::<_, i64>(0)? as u64,
                    kind: r.get(1)?,
                    conv: r.get(2)?,
                    sender: r.get(3)?,
                    muted: r.get(4)?,
                    mentioned: r.get(8)?,
                    preview: preview_col(r, 6)?,
                    created_at_ms: r.get(5)?,
                };
                Ok((event, r.get::<_, Option<String>>(7)?))
            })
            .map_err(internal)?
            .collect::<rusqlite::Result<Vec<_>>>()
            .map_err(internal)?;
        let (events, contents) = rows.into_iter().unzip();
        out.push(OwedPushes { target, claim, attempts: attempts.max(0) as u32, user_preview, events, contents });
    }
    Ok(out)
}

pub(crate) fn finish(c: &Connection, user: &str, device: &str, claim: i64, step: PushStep, now_ms: i64) -> R<bool> {
    let held: Option<i64> = c
        .prepare_cached(
            "SELECT 1 FROM push_targets WHERE user_id = ?1 AND device_id = ?2 AND claim_seq = ?3 AND claim_until > 0",
        )
        .map_err(internal)?
        .query_row(params![user, device, claim], |r| r.get(0))
        .optional()
        .map_err(internal)?;
    if held.is_none() {
        return Ok(false);
    }
    let key = params![user, device];
    let n = match step {
        PushStep::Remove => c
            .prepare_cached("DELETE FROM push_targets WHERE user_id = ?1 AND device_id = ?2")
            .map_err(internal)?
            .execute(key),
        PushStep::Advance { through } => c
            .prepare_cached(
                "UPDATE push_targets SET pushed_through = MAX(pushed_through, ?3), attempts = 0, next_at = ?4,
                     claim_until = 0 WHERE user_id = ?1 AND device_id = ?2",
            )
            .map_err(internal)?
            .execute(params![user, device, through as i64, now_ms]),
        PushStep::Wait { at_ms } => c
            .prepare_cached(
                "UPDATE push_targets SET next_at = ?3, claim_until = 0 WHERE user_id = ?1 AND device_id = ?2",
            )
            .map_err(internal)?
            .execute(params![user, device, at_ms]),
        PushStep::Retry { at_ms, attempts } => c
            .prepare_cached(
                "UPDATE push_targets SET next_at = ?3, attempts = ?4, claim_until = 0
                 WHERE user_id = ?1 AND device_id = ?2",
            )
            .map_err(internal)?
            .execute(params![user, device, at_ms, attempts]),
    }
    .map_err(internal)?;
    Ok(n > 0)
}
