//! The caller's account and devices. `device.revoke` (P5): the device's
//! cursor becomes `REVOKED`, its refresh tokens are deleted, its live
//! connections are kicked, and every later request of it is refused with
//! `DEVICE_REVOKED`. `device.list`: every device of the caller.
//! `account.password`: a new password, checked against the old one like a
//! login (and counted as one by the failed-login delays), after which the
//! caller's other devices can no longer refresh.

use std::net::{IpAddr, Ipv4Addr};

use tidemark_core::audit::{actor, event};

use tidemark_proto::{
    reason, AccountPasswordOk, AccountPasswordReq, DeviceInfo, DeviceListOk, DeviceRevokeOk, DeviceRevokeReq, ErrorCode,
};

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
    tracing::info!(device_hash = %state.log_id(&req.device_id), by_device_hash = %state.log_id(&ctx.device), "device revoked");
    crate::audit::record(state, event::DEVICE_REVOKED, actor::SELF, &ctx.user, Some(&req.device_id), None).await;
    Ok(DeviceRevokeOk { device_id: req.device_id, revoked })
}

pub async fn list(state: &AppState, ctx: &AuthCtx) -> ApiResult<DeviceListOk> {
    let devices = state.store.list_devices(&ctx.user).await?;
    Ok(DeviceListOk {
        devices: devices
            .into_iter()
            .map(|d| DeviceInfo {
                current: d.device == ctx.device,
                device_id: d.device,
                name: d.name,
                created_at: d.created_at_ms,
                last_seen_at: d.last_seen_ms,
                state: d.state.as_str().to_owned(),
            })
            .collect(),
    })
}

/// The source "address" password changes are throttled under: they come
/// with a session, not from a login form, so the account's own failure
/// count (per "address" and across addresses) is what slows a guesser.
const PASSWORD_CHANGE_KEY: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);

pub async fn change_password(state: &AppState, ctx: &AuthCtx, req: AccountPasswordReq) -> ApiResult<AccountPasswordOk> {
    crate::accounts::check_new_account(&ctx.user, &req.new_password).map_err(ApiError::bad_request)?;
    let wrong = || ApiError::new(ErrorCode::Unauthenticated, "wrong password");
    if req.old_password.len() > crate::accounts::PASSWORD_BYTES_MAX {
        return Err(wrong());
    }
    state.limits.admit_login(&ctx.user, PASSWORD_CHANGE_KEY, now_ms())?;
    let stored = state.store.password_hash(&ctx.user).await?;
    let (old, new) = (req.old_password, req.new_password);
    let verdict = state
        .limits
        .hash(move || {
            let ok = crate::accounts::verify_login(&old, stored.as_deref());
            (ok, ok.then(|| crate::accounts::hash_password(&new)))
        })
        .await?;
    let (ok, hash) = verdict;
    state.limits.login_outcome(&ctx.user, PASSWORD_CHANGE_KEY, ok, now_ms());
    let Some(hash) = hash else {
        tracing::warn!(device_hash = %state.log_id(&ctx.device), "password change refused: wrong password");
        let failed = event::PASSWORD_CHANGE_FAILED;
        crate::audit::record(state, failed, actor::SELF, &ctx.user, Some(&ctx.device), None).await;
        return Err(wrong());
    };
    let hash = hash.map_err(|e| ApiError::new(ErrorCode::Internal, e))?;
    if !state.store.change_password(&ctx.user, &hash, &ctx.device).await? {
        return Err(wrong());
    }
    // The other devices' refresh tokens are deleted with the change; their
    // access tokens end now too, on every node, and their sockets close.
    let now = now_ms();
    for d in state.store.list_devices(&ctx.user).await? {
        if d.device == ctx.device {
            continue;
        }
        state.sessions.end(&ctx.user, Some(&d.device), now);
        state.store.end_sessions(&ctx.user, Some(&d.device), now).await?;
        state.fences.end_sessions(&ctx.user, Some(&d.device), now);
        state.bus.publish_session_end(&ctx.user, Some(&d.device), reason::LOGGED_OUT, now);
    }
    tracing::info!(device_hash = %state.log_id(&ctx.device), "password changed; the other devices are logged out");
    crate::audit::record(state, event::PASSWORD_CHANGED, actor::SELF, &ctx.user, Some(&ctx.device), None).await;
    Ok(AccountPasswordOk { other_devices_logged_out: true })
}
