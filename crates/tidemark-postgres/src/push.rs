//! Offline push targets and the owed-push claim (P4): the SQL only. Who is
//! pushed, what coalesces and what a provider's answer does is decided by
//! `tidemark_core::push` in the server on the facts read here. Writes run
//! on the first writer (group-committed with the rest); the claim takes
//! each target row with `FOR UPDATE SKIP LOCKED`, so nodes claiming at
//! once split the due targets and never take one twice.

use tidemark_core::push::{OwedEvent, Preview};
use tidemark_store::*;
use tokio_postgres::Row;

use crate::db::{big, col, exec, query, query_opt, seq, Conn};

type R<T> = StoreResult<T>;

const TARGET_COLUMNS: &str = "user_id, device_id, platform, token_sealed, token_hash, token_last4, app_id, p256dh, \
                              auth, preview, created_at, updated_at";

/// A stored preview level (a `CHECK`ed column) as the rules name it.
pub(crate) fn preview_col(r: &Row, i: usize) -> R<Preview> {
    let s: String = col(r, i)?;
    Preview::parse(&s).ok_or_else(|| StoreError::Internal(format!("an unknown push preview {s:?}")))
}

fn target_row(r: &Row) -> R<PushTarget> {
    target_row_at(r, 0)
}

/// A target read from [`TARGET_COLUMNS`] starting at column `first`.
fn target_row_at(r: &Row, first: usize) -> R<PushTarget> {
    Ok(PushTarget {
        user: col(r, first)?,
        device: col(r, first + 1)?,
        platform: col(r, first + 2)?,
        token_sealed: col(r, first + 3)?,
        token_hash: col(r, first + 4)?,
        token_last4: col(r, first + 5)?,
        app_id: col(r, first + 6)?,
        p256dh: col(r, first + 7)?,
        auth: col(r, first + 8)?,
        preview: col(r, first + 9)?,
        created_at_ms: col(r, first + 10)?,
        updated_at_ms: col(r, first + 11)?,
    })
}

pub(crate) async fn put_target(c: &Conn, t: &PushTarget, now_ms: i64) -> R<bool> {
    // FOR SHARE: a revocation (which locks the row FOR UPDATE and deletes
    // the target) is ordered before or after this registration, never
    // across it.
    let state = query_opt(
        c,
        "SELECT state FROM devices WHERE user_id = $1 AND device_id = $2 FOR SHARE",
        &[&t.user, &t.device],
    )
    .await?;
    let state: Option<String> = state.map(|r| col(&r, 0)).transpose()?;
    if state.as_deref().is_none_or(|s| s == "REVOKED") {
        return Err(StoreError::NotFound(format!("device {}", t.device)));
    }
    let head = query_opt(c, "SELECT high_watermark FROM user_heads WHERE user_id = $1", &[&t.user]).await?;
    let head: i64 = head.map(|r| col(&r, 0)).transpose()?.unwrap_or(0);
    let row = query_opt(
        c,
        "INSERT INTO push_targets (user_id, device_id, platform, token_sealed, token_hash, token_last4, app_id,
                                   p256dh, auth, preview, pushed_through, created_at, updated_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $12)
         ON CONFLICT (user_id, device_id) DO UPDATE SET platform = excluded.platform,
             token_sealed = excluded.token_sealed, token_hash = excluded.token_hash,
             token_last4 = excluded.token_last4, app_id = excluded.app_id, p256dh = excluded.p256dh,
             auth = excluded.auth, preview = excluded.preview, attempts = 0, updated_at = excluded.updated_at
         RETURNING (xmax = 0)",
        &[
            &t.user,
            &t.device,
            &t.platform,
            &t.token_sealed,
            &t.token_hash,
            &t.token_last4,
            &t.app_id,
            &t.p256dh,
            &t.auth,
            &t.preview,
            &head,
            &now_ms,
        ],
    )
    .await?;
    let row = row.ok_or_else(|| StoreError::Internal("push target upsert returned no row".into()))?;
    col(&row, 0)
}

pub(crate) async fn targets(c: &Conn, user: &str) -> R<Vec<PushTarget>> {
    let sql = format!("SELECT {TARGET_COLUMNS} FROM push_targets WHERE user_id = $1 ORDER BY device_id");
    query(c, &sql, &[&user]).await?.iter().map(target_row).collect()
}

pub(crate) async fn remove_target(c: &Conn, user: &str, device: &str, token_hash: Option<&str>) -> R<bool> {
    let n = exec(
        c,
        "DELETE FROM push_targets WHERE user_id = $1 AND device_id = $2 AND ($3::TEXT IS NULL OR token_hash = $3)",
        &[&user, &device, &token_hash],
    )
    .await?;
    Ok(n > 0)
}

pub(crate) async fn claim(c: &Conn, now_ms: i64, lease_ms: i64, limit: u32, scan_max: u32) -> R<Vec<OwedPushes>> {
    let candidates = query(
        c,
        "SELECT t.user_id, t.device_id, GREATEST(t.pushed_through, d.acked_sync_seq), t.attempts,
                COALESCE(p.push_preview, 'full'), t.preview = 'full' AND COALESCE(p.push_preview, 'full') = 'full'
         FROM push_targets t
         JOIN devices d ON d.user_id = t.user_id AND d.device_id = t.device_id
         JOIN user_heads h ON h.user_id = t.user_id
         LEFT JOIN user_privacy p ON p.user_id = t.user_id
         WHERE t.next_at <= $1 AND t.claim_until <= $1 AND d.state <> 'REVOKED'
           AND h.high_watermark > GREATEST(t.pushed_through, d.acked_sync_seq)
         ORDER BY t.next_at LIMIT $2
         FOR UPDATE OF t SKIP LOCKED",
        &[&now_ms, &i64::from(limit)],
    )
    .await?;
    let mut out = Vec::with_capacity(candidates.len());
    for cand in candidates {
        let (user, device): (String, String) = (col(&cand, 0)?, col(&cand, 1)?);
        let from: i64 = col(&cand, 2)?;
        let attempts: i32 = col(&cand, 3)?;
        let user_preview = preview_col(&cand, 4)?;
        let full: bool = col(&cand, 5)?;
        let sql = format!(
            "UPDATE push_targets SET claim_seq = claim_seq + 1, claim_until = $3
             WHERE user_id = $1 AND device_id = $2 RETURNING claim_seq, {TARGET_COLUMNS}"
        );
        let row = query_opt(c, &sql, &[&user, &device, &(now_ms + lease_ms)]).await?;
        let row = row.ok_or_else(|| StoreError::Internal("claimed push target vanished".into()))?;
        let claim: i64 = col(&row, 0)?;
        let target = target_row_at(&row, 1)?;
        let rows = query(
            c,
            "SELECT e.sync_seq, e.kind, e.conv_id, m.sender, COALESCE(uc.muted, FALSE), e.created_at,
                    CASE WHEN $4 AND COALESCE(uc.push_preview, 'full') = 'full' THEN m.content END,
                    COALESCE(uc.push_preview, 'full'),
                    m.message_id IS NOT NULL AND (m.mention_all OR $1 = ANY (m.mentions))
             FROM user_events e
             LEFT JOIN messages m ON m.message_id = e.message_id
             LEFT JOIN user_convs uc ON uc.user_id = e.user_id AND uc.conv_id = e.conv_id
             WHERE e.user_id = $1 AND e.sync_seq > $2 ORDER BY e.sync_seq LIMIT $3",
            &[&user, &from, &i64::from(scan_max), &full],
        )
        .await?;
        let mut events = Vec::with_capacity(rows.len());
        let mut contents = Vec::with_capacity(rows.len());
        for r in &rows {
            events.push(OwedEvent {
                sync_seq: seq(r, 0)?,
                kind: col(r, 1)?,
                conv: col(r, 2)?,
                sender: col(r, 3)?,
                muted: col(r, 4)?,
                mentioned: col::<Option<bool>>(r, 8)?.unwrap_or(false),
                preview: preview_col(r, 7)?,
                created_at_ms: col(r, 5)?,
            });
            contents.push(col(r, 6)?);
        }
        out.push(OwedPushes { target, claim, attempts: attempts.max(0) as u32, user_preview, events, contents });
    }
    Ok(out)
}

pub(crate) async fn finish(c: &Conn, user: &str, device: &str, claim: i64, step: PushStep, now_ms: i64) -> R<bool> {
    let held = query_opt(
        c,
        "SELECT 1 FROM push_targets WHERE user_id = $1 AND device_id = $2 AND claim_seq = $3 AND claim_until > 0
         FOR UPDATE",
        &[&user, &device, &claim],
    )
    .await?;
    if held.is_none() {
        return Ok(false);
    }
    let n = match step {
        PushStep::Remove => {
            exec(c, "DELETE FROM push_targets WHERE user_id = $1 AND device_id = $2", &[&user, &device]).await?
        }
        PushStep::Advance { through } => {
            exec(
                c,
                "UPDATE push_targets SET pushed_through = GREATEST(pushed_through, $3), attempts = 0, next_at = $4,
                     claim_until = 0 WHERE user_id = $1 AND device_id = $2",
                &[&user, &device, &big(through), &now_ms],
            )
            .await?
        }
        PushStep::Wait { at_ms } => {
            exec(
                c,
                "UPDATE push_targets SET next_at = $3, claim_until = 0 WHERE user_id = $1 AND device_id = $2",
                &[&user, &device, &at_ms],
            )
            .await?
        }
        PushStep::Retry { at_ms, attempts } => {
            let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
            exec(
                c,
                "UPDATE push_targets SET next_at = $3, attempts = $4, claim_until = 0
                 WHERE user_id = $1 AND device_id = $2",
                &[&user, &device, &at_ms, &attempts],
            )
            .await?
        }
    };
    Ok(n > 0)
}
