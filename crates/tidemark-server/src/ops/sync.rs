//! `sync` (D1–D5, D8) and `ack` (D4).
//!
//! The first page decides where the batch starts from the server's cursor
//! (`decide_resume`), fixes `batch_high_watermark` at the user's committed
//! head and signs both into the batch token. Later pages carry that token
//! and a signed cursor, so a batch never passes its watermark however many
//! events arrive meanwhile; the next batch picks them up. `ack` is the
//! store's compare-and-set under the token's generation.
//!
//! Every page is one store read ([`tidemark_store::Store::sync_page`]):
//! the device's cursor, the log bounds, the recovery session and the page
//! come from one snapshot, decided by `tidemark_core::page` (never a
//! partial page). Only the outcomes that write (a reset, a recovery
//! opened, a device activated) add a compare-and-set, and the page read
//! with the cursor that CAS expected is the one served when it wins.

use tidemark_core::cursor::{
    AckDecision, ClientPosition, DeviceCursor, DeviceState, RecoveryInfo, RecoveryPolicy, Resume,
};
use tidemark_core::page::{NextPage, PageDecision, PageQuery};
use tidemark_core::token::{BatchClaims, TokenError};
use tidemark_proto::{
    AckOk, AckReq, ErrorCode, RawJson, SyncOk, SyncReq, SYNC_LIMIT_DEFAULT, SYNC_LIMIT_MAX, SYNC_PAGE_BYTES_MAX,
};

use tidemark_store::{StoredEvent, SyncRead};

use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::metrics as m;
use crate::state::AppState;
use crate::util::now_ms;

/// Attempts at the device-cursor compare-and-set before answering
/// `UNAVAILABLE` (another request of the same device kept winning).
const RESUME_CAS_ATTEMPTS_MAX: usize = 3;

fn token_error(e: TokenError) -> ApiError {
    ApiError::new(ErrorCode::TokenInvalid, format!("batch token refused: {e}"))
}

/// `sync`: one page; the page that ends a batch also carries the caller's
/// dirty large-group markers (G2), read after the page, so a group that
/// moved meanwhile shows as dirty rather than being missed. They are read
/// only if the page's snapshot found the user in a shared group: one that
/// turns shared (or that the user joins) later puts its switch (or the
/// join) in the user's log above this batch, and the batch that brings it
/// ends with the read.
pub async fn sync(state: &AppState, ctx: &AuthCtx, req: SyncReq) -> ApiResult<SyncOk<RawJson>> {
    let (mut page, shared_groups) = page_of(state, ctx, req).await?;
    if !page.has_more && shared_groups {
        page.dirty = state
            .store
            .dirty_markers(&ctx.user, &ctx.device)
            .await?
            .into_iter()
            .map(|d| tidemark_proto::DirtyMarker {
                conv: d.conv,
                dirty_target_msg_seq: d.marker.target,
                dirty_version: d.marker.version,
            })
            .collect();
    }
    Ok(page)
}

/// A page, and whether its snapshot found the user in a shared group.
async fn page_of(state: &AppState, ctx: &AuthCtx, req: SyncReq) -> ApiResult<(SyncOk<RawJson>, bool)> {
    let limit = req.limit.unwrap_or(SYNC_LIMIT_DEFAULT);
    if limit == 0 || limit > SYNC_LIMIT_MAX {
        return Err(ApiError::bad_request(format!("limit must be 1..={SYNC_LIMIT_MAX}")));
    }
    let now = now_ms();
    if let Some(token) = req.batch_token {
        return next_page(state, ctx, token, req.cursor, limit, now).await;
    }
    if req.cursor.is_some() {
        return Err(ApiError::bad_request("cursor needs the batch_token of its batch"));
    }
    let client = ClientPosition { generation: req.sync_generation, local_applied_sync_seq: req.local_applied_sync_seq };
    let policy = RecoveryPolicy { max_gap: state.config.recovery_max_gap, max_replay: state.config.replay_max_events };
    for _ in 0..RESUME_CAS_ATTEMPTS_MAX {
        // The cursor, the log bounds, the recovery session, the resume
        // decision and the page it starts with: one read snapshot.
        let read = read_page(state, ctx, PageQuery::First { client, policy, now_ms: now }, limit).await?;
        let SyncRead { facts, decision, events, shared_groups } = read;
        let with_flag = |page: SyncOk<RawJson>| (page, shared_groups);
        let PageDecision::First(resume) = decision else {
            return Err(ApiError::new(ErrorCode::Internal, "a first page got a next page's decision"));
        };
        let current = facts.device;
        let user_hw = facts.log.high_watermark;
        let (expected, new, start) = match resume {
            Resume::Replay { generation, from } => {
                let batch = Batch { generation, resume_from: from, high_watermark: user_hw, recovery: None };
                return first_page(state, ctx, batch, current.acked_sync_seq, events, limit, now).map(with_flag);
            }
            Resume::ContinueRecovery { generation } => {
                let s = facts.session.expect("a recovering device has its session");
                let batch = Batch {
                    generation,
                    resume_from: s.resume_from,
                    high_watermark: s.high_watermark,
                    recovery: Some(s.session_id),
                };
                return first_page(state, ctx, batch, current.acked_sync_seq, events, limit, now).map(with_flag);
            }
            Resume::Recover { from, .. } => {
                let info = RecoveryInfo {
                    session_id: crate::util::new_id("r"),
                    resume_from: from,
                    high_watermark: user_hw,
                    expires_at_ms: now + state.config.recovery_ttl.as_millis() as i64,
                };
                let (won, cursor) =
                    state.store.begin_recovery(&ctx.user, &ctx.device, current, info.clone(), now).await?;
                if !won {
                    continue;
                }
                m::GENERATION_BUMPS.inc();
                tracing::info!(stage = "device_sync", device_hash = %state.log_id(&ctx.device),
                    generation = cursor.generation, from, "recovery session opened");
                // The page was read with the cursor the CAS expected: it is
                // exactly `(from, user_hw]`, and the session fences it now.
                let batch = Batch {
                    generation: cursor.generation,
                    resume_from: from,
                    high_watermark: user_hw,
                    recovery: Some(info.session_id),
                };
                return first_page(state, ctx, batch, cursor.acked_sync_seq, events, limit, now).map(with_flag);
            }
            Resume::Activate { generation } | Resume::Rebuild { generation } => {
                (current, DeviceCursor { generation, acked_sync_seq: 0, state: DeviceState::Active }, true)
            }
            Resume::Reset { expected } => {
                let bumped = DeviceCursor { generation: expected + 1, state: DeviceState::Resetting, ..current };
                (current, bumped, false)
            }
            Resume::StillResetting { generation } => return Err(ApiError::reset_required(generation)),
            Resume::Revoked => return Err(ApiError::device_revoked()),
        };
        let (won, _) = state.store.cas_device_cursor(&ctx.user, &ctx.device, expected, new, now).await?;
        if !won {
            continue;
        }
        if start {
            // Only reached while the user's log is retained from its start;
            // the page `(0, user_hw]` was read with the cursor the CAS expected.
            let batch = Batch { generation: new.generation, resume_from: 0, high_watermark: user_hw, recovery: None };
            return first_page(state, ctx, batch, 0, events, limit, now).map(with_flag);
        }
        m::GENERATION_BUMPS.inc();
        tracing::info!(stage = "device_sync", device_hash = %state.log_id(&ctx.device), generation = new.generation,
            "device generation bumped; reset required");
        return Err(ApiError::reset_required(new.generation));
    }
    Err(ApiError { retry_after_ms: Some(100), ..ApiError::new(ErrorCode::Unavailable, "device cursor is busy; retry") })
}

/// One [`tidemark_store::Store::sync_page`] read, one row more than the
/// page holds (to tell whether more follow); a device the store does not
/// know must log in again.
async fn read_page(state: &AppState, ctx: &AuthCtx, query: PageQuery, limit: u32) -> ApiResult<SyncRead> {
    let started = std::time::Instant::now();
    let read = state.store.sync_page(&ctx.user, &ctx.device, query, limit + 1).await;
    m::SYNC_PAGE_LATENCY.record(started.elapsed().as_secs_f64());
    read?.ok_or_else(|| ApiError::new(ErrorCode::Unauthenticated, "unknown device; log in again"))
}

/// The fixed ends of a batch, as they go into its token.
struct Batch {
    generation: u64,
    resume_from: u64,
    high_watermark: u64,
    recovery: Option<String>,
}

fn first_page(
    state: &AppState,
    ctx: &AuthCtx,
    batch: Batch,
    acked: u64,
    events: Vec<StoredEvent>,
    limit: u32,
    now: i64,
) -> ApiResult<SyncOk<RawJson>> {
    // resume_from is the server ACK (or a recovery start below it), which
    // never exceeds a watermark the server issued, and the watermark only
    // grows: assert it on this side of the store boundary rather than serve
    // a batch that runs backwards.
    let Batch { generation, resume_from, high_watermark, recovery } = batch;
    assert!(resume_from <= high_watermark, "batch start {resume_from} above its user's log head {high_watermark}");
    let claims = BatchClaims {
        user: ctx.user.clone(),
        device: ctx.device.clone(),
        generation,
        resume_from,
        high_watermark,
        expires_at_ms: now + state.config.batch_token_ttl.as_millis() as i64,
        recovery_session: recovery,
    };
    let token = state.keys.sign_batch(&claims);
    page(state, token, &claims, acked, events, limit)
}

async fn next_page(
    state: &AppState,
    ctx: &AuthCtx,
    token: String,
    cursor: Option<String>,
    limit: u32,
    now: i64,
) -> ApiResult<(SyncOk<RawJson>, bool)> {
    let claims = state.keys.verify_batch(&token, &ctx.user, &ctx.device, now).map_err(token_error)?;
    let position = match cursor {
        Some(c) => state.keys.verify_cursor(&c, &token, &claims).map_err(token_error)?,
        None => claims.resume_from,
    };
    let query = PageQuery::Next {
        generation: claims.generation,
        position,
        high_watermark: claims.high_watermark,
        recovery_session: claims.recovery_session.clone(),
        now_ms: now,
    };
    let SyncRead { facts, decision, events, shared_groups } = read_page(state, ctx, query, limit).await?;
    let cursor = facts.device;
    match decision {
        PageDecision::Next(NextPage::Serve { .. }) => {
            page(state, token, &claims, cursor.acked_sync_seq, events, limit).map(|p| (p, shared_groups))
        }
        PageDecision::Next(NextPage::Revoked) => Err(ApiError::device_revoked()),
        PageDecision::Next(NextPage::StaleGeneration { current }) => {
            m::GENERATION_CONFLICTS.add_by("op", "page", 1);
            m::invariant_violation("stale_generation");
            Err(ApiError::stale_generation(current))
        }
        PageDecision::Next(NextPage::ResetRequired { generation }) => Err(ApiError::reset_required(generation)),
        // Never a partial page: the rest of this batch is no longer all in
        // the log (trimmed, or its recovery session expired and stopped
        // fencing it), so the device is reset instead (D6, L2).
        PageDecision::Next(NextPage::Reset) => {
            let bumped = DeviceCursor { generation: cursor.generation + 1, state: DeviceState::Resetting, ..cursor };
            let (won, cursor) = state.store.cas_device_cursor(&ctx.user, &ctx.device, cursor, bumped, now).await?;
            if !won {
                // The cursor moved meanwhile (say the final ACK of the
                // recovery landed): let the client start a new batch.
                return Err(ApiError::new(ErrorCode::TokenInvalid, "the batch ended; start a new one")
                    .with_generation(cursor.generation));
            }
            m::GENERATION_BUMPS.inc();
            Err(ApiError::reset_required(cursor.generation))
        }
        PageDecision::First(_) => Err(ApiError::new(ErrorCode::Internal, "a next page got a first page's decision")),
    }
}

/// Cuts the events read (`limit + 1` at most) into the page: at most
/// `limit` events and `SYNC_PAGE_BYTES_MAX` of content (at least one
/// event), with a signed cursor when more follow.
fn page(
    state: &AppState,
    token: String,
    claims: &BatchClaims,
    acked: u64,
    mut stored: Vec<StoredEvent>,
    limit: u32,
) -> ApiResult<SyncOk<RawJson>> {
    let mut keep = stored.len().min(limit as usize);
    let mut bytes = 0usize;
    for (i, e) in stored.iter().take(keep).enumerate() {
        bytes += e.message.as_ref().map_or(0, |m| m.content.len());
        if bytes > SYNC_PAGE_BYTES_MAX && i > 0 {
            keep = i;
            break;
        }
    }
    let has_more = stored.len() > keep;
    stored.truncate(keep);
    let next_cursor = match (has_more, stored.last()) {
        (true, Some(last)) => Some(state.keys.sign_cursor(&token, last.sync_seq)),
        _ => None,
    };
    let first = stored.first().map(|e| e.sync_seq);
    let last = stored.last().map(|e| e.sync_seq);
    let events = stored.into_iter().map(super::render::user_event).collect::<ApiResult<Vec<_>>>()?;
    m::SYNC_PAGES.inc();
    m::SYNC_PAGE_EVENTS.record(events.len() as f64);
    crate::trace_stage!(stage = "sync_log", trace_id = %tidemark_core::token::token_tag(&token),
        user_hash = %state.log_id(&claims.user), device_hash = %state.log_id(&claims.device),
        generation = claims.generation, resume_from = claims.resume_from, high_watermark = claims.high_watermark,
        first_sync_seq = first, sync_seq = last, events = events.len(), has_more, result = "served", "sync page served");
    Ok(SyncOk {
        sync_generation: claims.generation,
        resume_from: claims.resume_from,
        batch_high_watermark: claims.high_watermark,
        server_acked_sync_seq: acked,
        events,
        next_cursor,
        has_more,
        batch_token: token,
        dirty: Vec::new(),
    })
}

pub async fn ack(state: &AppState, ctx: &AuthCtx, req: AckReq) -> ApiResult<AckOk> {
    let now = now_ms();
    let claims = state.keys.verify_batch(&req.batch_token, &ctx.user, &ctx.device, now).map_err(token_error)?;
    let trace_id = tidemark_core::token::token_tag(&req.batch_token);
    if req.sync_seq > claims.high_watermark {
        m::ACKS.add_by("result", "beyond_watermark", 1);
        m::invariant_violation("ack_beyond_watermark");
        crate::trace_stage!(stage = "device_sync", trace_id = %trace_id, device_hash = %state.log_id(&ctx.device),
            generation = claims.generation, sync_seq = req.sync_seq, high_watermark = claims.high_watermark,
            result = "beyond_watermark", "ack refused");
        return Err(ApiError::new(
            ErrorCode::AckBeyondWatermark,
            format!("sync_seq {} is above the batch watermark {}", req.sync_seq, claims.high_watermark),
        ));
    }
    let result = state
        .store
        .ack_on(
            ctx.connection_epoch,
            &ctx.user,
            &ctx.device,
            claims.generation,
            claims.recovery_session.as_deref(),
            req.sync_seq,
            now,
        )
        .await?;
    m::ACKS.add_by("result", m::ack_result(&result.decision), 1);
    if let AckDecision::StaleGeneration { .. } = result.decision {
        m::GENERATION_CONFLICTS.add_by("op", "ack", 1);
        m::invariant_violation("stale_generation");
    }
    crate::trace_stage!(stage = "device_sync", trace_id = %trace_id, user_hash = %state.log_id(&ctx.user),
        device_hash = %state.log_id(&ctx.device), generation = claims.generation, sync_seq = req.sync_seq,
        acked_sync_seq = result.cursor.acked_sync_seq, result = m::ack_result(&result.decision), "ack");
    match result.decision {
        AckDecision::Advance { .. } | AckDecision::Unchanged { .. } | AckDecision::CompleteRecovery { .. } => {
            state.hub.on_ack(&ctx.user, &ctx.device, result.cursor.acked_sync_seq);
            Ok(AckOk { acked_sync_seq: result.cursor.acked_sync_seq, sync_generation: result.cursor.generation })
        }
        AckDecision::StaleGeneration { current } => Err(ApiError::stale_generation(current)),
        AckDecision::Resetting { current } => Err(ApiError::reset_required(current)),
        AckDecision::Revoked => Err(ApiError::device_revoked()),
        // The session expired before its final ACK: the device was reset
        // (bumped, RESETTING) in the same transaction and rebuilds from a
        // snapshot, never from a partial replay (D6).
        AckDecision::RecoveryExpired { .. } => Err(ApiError::reset_required(result.cursor.generation)),
    }
}
