//! `device.revoke` (P5): the device's cursor becomes `REVOKED`, its refresh
//! tokens are deleted, its live connections are kicked, and every later
//! request of it is refused with `DEVICE_REVOKED`.

use tidemark_proto::{reason, DeviceRevokeOk, DeviceRevokeReq};

use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use crate::util::now_ms;

pub async fn revoke(state: &AppState, ctx: &AuthCtx, req: DeviceRevokeReq) -> ApiResult<DeviceRevokeOk> {
    tidemark_core::ids::check_device_id(&req.device_id).map_err(ApiError::bad_request)?;
    // A user revokes their own devices only: the user comes from the token.
    let revoked = state.store.revoke_device(&ctx.user, &req.device_id, now_ms()).await?;
    // Committed: fenced here at once, on the other nodes when they hear it
    // on the bus (or reload it from the store, `fence`).
    state.fences.revoke(&ctx.user, &req.device_id);
    state.bus.publish_kick(&ctx.user, &req.device_id, reason::DEVICE_REVOKED, 0);
    tracing::info!(device = %req.device_id, by_device = %ctx.device, "device revoked");
    Ok(DeviceRevokeOk { device_id: req.device_id, revoked })
}
