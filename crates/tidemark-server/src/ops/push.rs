//! `push.register`, `push.list`, `push.remove` (P4): a device's offline push
//! target. The token is sealed before it reaches the store and is never
//! shown again in full (a hash and its last four characters); logs carry
//! its hash only. A platform this server has no provider for is refused.

use tidemark_proto::push::{
    PreviewLevel, PushListOk, PushRegisterOk, PushRegisterReq, PushRemoveOk, PushRemoveReq, PushTargetInfo,
};
use tidemark_push::seal::{device_aad, last4};
use tidemark_store::PushTarget;

use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use crate::util::now_ms;

fn info(t: PushTarget, ctx: &AuthCtx) -> PushTargetInfo {
    PushTargetInfo {
        current: t.device == ctx.device,
        device_id: t.device,
        platform: t.platform,
        token_hash: t.token_hash,
        token_last4: t.token_last4,
        app_id: t.app_id,
        preview: PreviewLevel::parse(&t.preview).unwrap_or_default(),
        created_at: t.created_at_ms,
        updated_at: t.updated_at_ms,
    }
}

pub async fn register(state: &AppState, ctx: &AuthCtx, req: PushRegisterReq) -> ApiResult<PushRegisterOk> {
    req.check().map_err(ApiError::bad_request)?;
    if state.config.push.provider(&req.platform).is_none() {
        return Err(ApiError::bad_request(format!("this server has no {} push provider", req.platform)));
    }
    let now = now_ms();
    let target = PushTarget {
        user: ctx.user.clone(),
        device: ctx.device.clone(),
        platform: req.platform,
        token_sealed: state.push_sealer.seal(&req.token, &device_aad(&ctx.user, &ctx.device)),
        token_hash: tidemark_push::token_hash(&req.token),
        token_last4: last4(&req.token),
        app_id: req.app_id,
        p256dh: req.p256dh,
        auth: req.auth,
        preview: req.preview.as_str().to_owned(),
        created_at_ms: now,
        updated_at_ms: now,
    };
    let created = state.store.put_push_target(target, now).await?;
    let stored = state.store.push_targets(&ctx.user).await?.into_iter().find(|t| t.device == ctx.device);
    let stored =
        stored.ok_or_else(|| ApiError::new(tidemark_proto::ErrorCode::Unavailable, "push target removed meanwhile"))?;
    tracing::info!(device = %ctx.device, token = %stored.token_hash, platform = %stored.platform, created, "push target set");
    Ok(PushRegisterOk { target: info(stored, ctx), created })
}

pub async fn list(state: &AppState, ctx: &AuthCtx) -> ApiResult<PushListOk> {
    let targets = state.store.push_targets(&ctx.user).await?;
    Ok(PushListOk { targets: targets.into_iter().map(|t| info(t, ctx)).collect() })
}

pub async fn remove(state: &AppState, ctx: &AuthCtx, req: PushRemoveReq) -> ApiResult<PushRemoveOk> {
    let device = req.device_id.unwrap_or_else(|| ctx.device.clone());
    tidemark_core::ids::check_device_id(&device).map_err(ApiError::bad_request)?;
    // The user comes from the token: only the caller's own devices.
    let removed = state.store.remove_push_target(&ctx.user, &device, None).await?;
    tracing::info!(%device, by_device = %ctx.device, removed, "push target removed");
    Ok(PushRemoveOk { device_id: device, removed })
}
