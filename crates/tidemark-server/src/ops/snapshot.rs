//! Snapshots (D7): `snapshot.begin`, `snapshot.page`, `snapshot.ack`.
//!
//! A device that must rebuild (new after the log was trimmed, rolled back,
//! offline past the retention window) asks for a snapshot: the store reads
//! the user's view at exactly `S` in one read snapshot whose head is `S`,
//! in chunks of conversations, and records the snapshot at `S`; this module
//! turns each chunk into canonical JSON items, stores them a page per
//! writer request while it computes the digest, and signs a token
//! binding snapshot, device, generation, base and digest. The client checks
//! the digest, installs in one local transaction, then `snapshot.ack` moves
//! the cursor to `S` by one CAS; incremental sync continues from `S`.

use serde_json::Value;
use sha2::Digest;
use tidemark_core::cursor::{DeviceCursor, DeviceState};
use tidemark_core::snapshot::carries_privacy;
use tidemark_core::token::{SnapshotClaims, TokenError};
use tidemark_proto::{
    canonical_item, ErrorCode, PrivacySnapshot, SnapshotAckOk, SnapshotAckReq, SnapshotBeginOk, SnapshotItem,
    SnapshotPageOk, SnapshotPageReq,
};
use tidemark_store::{SnapshotConv, SnapshotViewPart, SNAPSHOT_CHUNKS_IN_FLIGHT};

use super::render::envelope;
use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::metrics as m;
use crate::state::AppState;
use crate::util::{new_id, now_ms};

fn token_error(e: TokenError) -> ApiError {
    ApiError::new(ErrorCode::TokenInvalid, format!("snapshot token refused: {e}"))
}

/// One snapshot item as a JSON value (the digest is computed over values).
fn item(item: &SnapshotItem) -> ApiResult<Value> {
    serde_json::to_value(item).map_err(|e| ApiError::new(ErrorCode::Internal, format!("encode snapshot item: {e}")))
}

fn items(view: Vec<SnapshotConv>) -> ApiResult<Vec<Value>> {
    let mut out = Vec::new();
    for c in view {
        out.push(item(&SnapshotItem::Conv(super::conv::summary(c.state)))?);
        for msg in c.messages {
            out.push(item(&SnapshotItem::Message { message: envelope(msg)? })?);
        }
    }
    Ok(out)
}

/// The pages of a snapshot as its items come, and its digest over them.
struct Pages {
    per_page: usize,
    current: Vec<String>,
    next_page: u32,
    items: usize,
    digest: sha2::Sha256,
}

impl Pages {
    fn new(per_page: usize) -> Pages {
        Pages { per_page, current: Vec::with_capacity(per_page), next_page: 0, items: 0, digest: sha2::Sha256::new() }
    }

    /// Adds one item (its canonical JSON); a page that is full is handed
    /// back with its number, to be stored.
    fn push(&mut self, item: String) -> Option<(u32, Vec<String>)> {
        self.digest.update(item.as_bytes());
        self.digest.update(b"\n");
        self.items += 1;
        self.current.push(item);
        (self.current.len() >= self.per_page).then(|| self.take())
    }

    fn take(&mut self) -> (u32, Vec<String>) {
        let page = self.next_page;
        self.next_page += 1;
        (page, std::mem::replace(&mut self.current, Vec::with_capacity(self.per_page)))
    }

    /// The last, partial page if any, the digest, the page count and the
    /// item count.
    fn finish(mut self) -> (Option<(u32, Vec<String>)>, String, u32, usize) {
        let last = (!self.current.is_empty()).then(|| self.take());
        let digest = self.digest.finalize().iter().map(|b| format!("{b:02x}")).collect();
        (last, digest, self.next_page, self.items)
    }
}

/// Hex SHA-256 over each item's canonical JSON followed by a newline.
pub fn manifest_digest<'a>(items: impl IntoIterator<Item = &'a Value>) -> String {
    let mut h = sha2::Sha256::new();
    for item in items {
        h.update(canonical_item(item).as_bytes());
        h.update(b"\n");
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

pub async fn begin(state: &AppState, ctx: &AuthCtx) -> ApiResult<SnapshotBeginOk> {
    let now = now_ms();
    let mut cursor = super::device_cursor(state, ctx).await?;
    match cursor.state {
        DeviceState::Revoked => return Err(ApiError::device_revoked()),
        DeviceState::Resetting => {}
        // Any other device asking for a snapshot is resetting itself: the
        // generation moves first, fencing its older tokens (D5).
        _ => {
            let bumped = DeviceCursor { generation: cursor.generation + 1, state: DeviceState::Resetting, ..cursor };
            let (won, now_cursor) = state.store.cas_device_cursor(&ctx.user, &ctx.device, cursor, bumped, now).await?;
            if !won {
                return Err(ApiError {
                    retry_after_ms: Some(100),
                    ..ApiError::new(ErrorCode::Unavailable, "device cursor is busy; retry")
                });
            }
            m::GENERATION_BUMPS.inc();
            cursor = now_cursor;
        }
    }
    // A build holds a read connection for its whole view: at most
    // `snapshot_builds_max` at once, the others wait their turn.
    let _slot = state
        .snapshot_builds
        .acquire()
        .await
        .map_err(|_| ApiError::new(ErrorCode::Unavailable, "the server is stopping"))?;
    let snapshot_id = new_id("s");
    let expires_at_ms = now + state.config.snapshot_ttl.as_millis() as i64;
    // The view is read in one read snapshot beside the writer, a chunk of
    // conversations at a time; each page of items is stored as its own
    // writer request, so sends keep flowing during a big build (issue 16).
    let (tx, mut rx) = tokio::sync::mpsc::channel(SNAPSHOT_CHUNKS_IN_FLIGHT);
    let read = state.store.read_snapshot_view(
        &ctx.user,
        &ctx.device,
        state.config.snapshot_messages_per_conv,
        state.config.snapshot_convs_per_chunk,
        tx,
    );
    let build = async {
        let Some(SnapshotViewPart::Base(log)) = rx.recv().await else {
            return Err(ApiError::new(ErrorCode::Internal, "a snapshot view starts with its base"));
        };
        let base = log.high_watermark;
        state
            .store
            .open_snapshot(&ctx.user, &ctx.device, cursor.generation, &snapshot_id, base, expires_at_ms, now)
            .await?;
        let mut pages = Pages::new(state.config.snapshot_page_items.max(1));
        while let Some(part) = rx.recv().await {
            let values = match part {
                SnapshotViewPart::Convs(convs) => items(convs)?,
                // The user's switches at the base, before any conversation.
                SnapshotViewPart::Privacy { privacy, version } if carries_privacy(version) => {
                    vec![item(&SnapshotItem::Privacy(PrivacySnapshot {
                        hide_presence: privacy.hide_presence,
                        private_receipts: privacy.private_receipts,
                        push_preview: privacy.push_preview.into(),
                        version,
                    }))?]
                }
                SnapshotViewPart::Privacy { .. } => Vec::new(),
                SnapshotViewPart::Base(_) => {
                    return Err(ApiError::new(ErrorCode::Internal, "a snapshot view has one base"));
                }
            };
            for value in values {
                if let Some((page, full)) = pages.push(canonical_item(&value)) {
                    state.store.add_snapshot_page(&snapshot_id, page, full).await?;
                }
            }
        }
        let (digest, page_count, count) = match pages.finish() {
            (Some((page, last)), digest, page_count, count) => {
                state.store.add_snapshot_page(&snapshot_id, page, last).await?;
                (digest, page_count, count)
            }
            (None, digest, page_count, count) => (digest, page_count, count),
        };
        state.store.seal_snapshot(&snapshot_id, &digest, page_count).await?;
        Ok((base, digest, page_count, count))
    };
    // A read that failed ended the view early: its error is the cause.
    let (read, built) = tokio::join!(read, build);
    read?;
    let (base, digest, page_count, count) = built?;
    m::SNAPSHOTS.add_by("outcome", "built", 1);
    tracing::info!(stage = "device_sync", device_hash = %state.log_id(&ctx.device), snapshot_id = %snapshot_id, base, items = count, pages = page_count, "snapshot ready");
    let token = state.keys.sign_snapshot(&SnapshotClaims {
        snapshot_id: snapshot_id.clone(),
        user: ctx.user.clone(),
        device: ctx.device.clone(),
        generation: cursor.generation,
        base_sync_seq: base,
        manifest_digest: digest.clone(),
        expires_at_ms,
    });
    Ok(SnapshotBeginOk {
        snapshot_id,
        snapshot_token: token,
        sync_generation: cursor.generation,
        base_sync_seq: base,
        manifest_digest: digest,
        pages: page_count,
    })
}

/// Checks that the device is still resetting at the snapshot's generation.
async fn check_device(state: &AppState, ctx: &AuthCtx, claims: &SnapshotClaims) -> ApiResult<DeviceCursor> {
    let cursor = super::device_cursor(state, ctx).await?;
    match cursor.state {
        DeviceState::Revoked => Err(ApiError::device_revoked()),
        _ if cursor.generation != claims.generation => Err(ApiError::stale_generation(cursor.generation)),
        _ => Ok(cursor),
    }
}

pub async fn page(state: &AppState, ctx: &AuthCtx, req: SnapshotPageReq) -> ApiResult<SnapshotPageOk> {
    let claims =
        state.keys.verify_snapshot(&req.snapshot_token, &ctx.user, &ctx.device, now_ms()).map_err(token_error)?;
    check_device(state, ctx, &claims).await?;
    let meta = state
        .store
        .snapshot(&claims.snapshot_id)
        .await?
        .ok_or_else(|| ApiError::new(ErrorCode::TokenInvalid, "unknown snapshot"))?;
    let Some(items) = state.store.snapshot_page(&claims.snapshot_id, req.page).await? else {
        return Err(ApiError::bad_request(format!("page must be 0..{} of a ready snapshot", meta.pages)));
    };
    let items = items
        .iter()
        .map(|i| serde_json::from_str(i))
        .collect::<Result<Vec<Value>, _>>()
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("stored snapshot item: {e}")))?;
    Ok(SnapshotPageOk { page: req.page, pages: meta.pages, items })
}

pub async fn ack(state: &AppState, ctx: &AuthCtx, req: SnapshotAckReq) -> ApiResult<SnapshotAckOk> {
    let now = now_ms();
    let claims = state.keys.verify_snapshot(&req.snapshot_token, &ctx.user, &ctx.device, now).map_err(token_error)?;
    check_device(state, ctx, &claims).await?;
    let (installed, cursor) = state.store.ack_snapshot(&ctx.user, &ctx.device, &claims.snapshot_id, now).await?;
    if installed {
        m::SNAPSHOTS.add_by("outcome", "installed", 1);
        state.hub.on_ack(&ctx.user, &ctx.device, cursor.acked_sync_seq);
        return Ok(SnapshotAckOk { acked_sync_seq: cursor.acked_sync_seq, sync_generation: cursor.generation });
    }
    // A retried ACK of this very snapshot, already installed: the same answer.
    let meta = state.store.snapshot(&claims.snapshot_id).await?;
    let installed_here = meta.is_some_and(|m| m.state == tidemark_store::SNAPSHOT_INSTALLED);
    if installed_here && cursor.generation == claims.generation && cursor.state == DeviceState::Active {
        return Ok(SnapshotAckOk { acked_sync_seq: claims.base_sync_seq, sync_generation: cursor.generation });
    }
    Err(ApiError::new(
        ErrorCode::TokenInvalid,
        "the snapshot is no longer installable (expired or superseded); begin a new one",
    ))
}
