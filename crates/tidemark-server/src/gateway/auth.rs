//! Sessions: login, refresh and the bearer check (the account rules they
//! apply are in [`crate::accounts`]). Tokens and passwords never reach a
//! log line.

use std::net::IpAddr;

use tidemark_core::token::AccessClaims;
use tidemark_proto::{ErrorCode, LoginOk, LoginReq, RefreshReq};
use tidemark_store::{RefreshRecord, RefreshUse};

use crate::error::{ApiError, ApiResult};
use crate::ops::AuthCtx;
use crate::state::AppState;
use crate::util::{new_secret, now_ms, sha256_hex};
use crate::{accounts, audit};
use tidemark_core::audit::{actor, event};

fn unauthenticated(message: &str) -> ApiError {
    ApiError::new(ErrorCode::Unauthenticated, message)
}

/// The refusal of a token whose session an operator ended.
pub fn session_ended() -> ApiError {
    unauthenticated("this session was ended; log in again")
}

/// Verifies a bearer access token; the identity of every operation.
pub fn authenticate(state: &AppState, token: &str) -> ApiResult<AuthCtx> {
    let claims = state
        .keys
        .verify_access(token, now_ms())
        .map_err(|e| unauthenticated(&format!("access token refused: {e}")))?;
    if state.is_revoked(&claims.user, &claims.device) {
        return Err(ApiError::device_revoked());
    }
    if !state.session_alive(&claims.user, &claims.device, claims.expires_at_ms) {
        return Err(session_ended());
    }
    Ok(AuthCtx {
        user: claims.user,
        device: claims.device,
        expires_at_ms: claims.expires_at_ms,
        connection_epoch: None,
    })
}

/// Signs an access token and stores a new refresh token in `family` (a
/// login starts a family; a refresh continues its token's).
async fn issue(state: &AppState, user: &str, device: &str, family: String) -> ApiResult<LoginOk> {
    let now = now_ms();
    let ttl = state.config.access_token_ttl;
    let access_token = state.keys.sign_access(&AccessClaims {
        user: user.into(),
        device: device.into(),
        expires_at_ms: now + ttl.as_millis() as i64,
    });
    let refresh_token = new_secret();
    let rec = RefreshRecord {
        user: user.into(),
        device: device.into(),
        expires_at_ms: now + state.config.refresh_token_ttl.as_millis() as i64,
        family,
    };
    state.store.put_refresh_token(&sha256_hex(&refresh_token), &rec, now).await?;
    Ok(LoginOk { user: user.into(), device_id: device.into(), access_token, expires_in: ttl.as_secs(), refresh_token })
}

/// Logs a device in from `peer`. Bounded before any password is hashed:
/// attempts per source address, the failed-login delay of the account
/// (per address and across addresses), and a permit from the named number
/// of hashes that may run at once; each answers `RATE_LIMITED` with
/// `retry_after_ms`. An unknown user costs a hash like a known one and gets
/// the same refusal.
pub async fn login(state: &AppState, peer: IpAddr, req: LoginReq) -> ApiResult<LoginOk> {
    state.limits.admit_login_attempt(peer)?;
    // One account per name whatever its case: the folded name is the
    // account, its throttle key and the token's user (or a legacy account,
    // created before folding, by its exact name: `accounts::resolve_user`).
    tidemark_core::ids::check_user(&req.user).map_err(|_| unauthenticated("wrong user or password"))?;
    let user = accounts::resolve_user(state.store.as_ref(), &req.user).await?;
    let req = LoginReq { user, ..req };
    tidemark_core::ids::check_device_id(&req.device_id).map_err(ApiError::bad_request)?;
    if req.password.len() > accounts::PASSWORD_BYTES_MAX {
        return Err(unauthenticated("wrong user or password"));
    }
    state.limits.admit_login(&req.user, peer, now_ms())?;
    let hash = state.store.password_hash(&req.user).await?;
    let password = req.password.clone();
    // A check from an address that keeps failing waits in the suspect
    // lane, so guessers on many addresses cannot queue ahead of everyone.
    let lane = state.limits.login_lane(peer, now_ms());
    let ok = state.limits.hash_in(lane, move || accounts::verify_login(&password, hash.as_deref())).await?;
    state.limits.login_outcome(&req.user, peer, ok, now_ms());
    if !ok {
        tracing::warn!(user_hash = %state.log_id(&req.user), %peer, "login failed");
        audit::record(state, event::LOGIN_FAILED, actor::ANONYMOUS, &req.user, Some(&req.device_id), Some(peer)).await;
        return Err(unauthenticated("wrong user or password"));
    }
    let name = req.device_name.unwrap_or_else(|| req.device_id.clone());
    let name: String = name.chars().take(tidemark_proto::DEVICE_NAME_CHARS_MAX).collect();
    // Whether this login registers the device, for the audit log.
    let known = state.store.device(&req.user, &req.device_id).await?.is_some();
    let device = state.store.login_device(&req.user, &req.device_id, &name, now_ms()).await?;
    if !known {
        audit::record(state, event::DEVICE_REGISTERED, actor::SELF, &req.user, Some(&req.device_id), Some(peer)).await;
    }
    if device.cursor.state == tidemark_core::cursor::DeviceState::Revoked {
        return Err(ApiError::device_revoked());
    }
    tracing::info!(user_hash = %state.log_id(&req.user), device_hash = %state.log_id(&req.device_id), "login");
    audit::record(state, event::LOGIN, actor::SELF, &req.user, Some(&req.device_id), Some(peer)).await;
    issue(state, &req.user, &req.device_id, crate::util::new_id("f")).await
}

/// Rotates a refresh token. A token presented a second time (it was
/// rotated already) revokes its whole family, the token that replaced it
/// included (`tidemark_core::refresh`): someone else holds the chain.
pub async fn refresh(state: &AppState, peer: IpAddr, req: RefreshReq) -> ApiResult<LoginOk> {
    state.limits.admit_login_attempt(peer)?;
    let rec = match state.store.use_refresh_token(&sha256_hex(&req.refresh_token), now_ms()).await? {
        RefreshUse::Rotated(rec) => rec,
        RefreshUse::Unknown => return Err(unauthenticated("unknown or used refresh token")),
        RefreshUse::Expired(_) => return Err(unauthenticated("refresh token expired")),
        RefreshUse::FamilyRevoked(rec) => {
            tracing::warn!(user_hash = %state.log_id(&rec.user), device_hash = %state.log_id(&rec.device), %peer, "refresh token reused; its family is revoked");
            audit::record(state, event::REFRESH_REUSED, actor::ANONYMOUS, &rec.user, Some(&rec.device), Some(peer))
                .await;
            return Err(unauthenticated("unknown or used refresh token"));
        }
    };
    if state.is_revoked(&rec.user, &rec.device) {
        return Err(ApiError::device_revoked());
    }
    // The presented token was issued when its predecessor was rotated (or
    // at the login): a session ended since then does not continue.
    let presented_at_ms = rec.expires_at_ms - state.config.refresh_token_ttl.as_millis() as i64;
    if !state.sessions.alive(&rec.user, &rec.device, presented_at_ms) {
        return Err(session_ended());
    }
    let (user, device) = (rec.user.clone(), rec.device.clone());
    let ok = issue(state, &rec.user, &rec.device, rec.family).await?;
    // A logout that fenced this session while the new token was being
    // stored may have deleted the device's tokens before it was: delete
    // them again, so no token outlives the logout.
    if !state.sessions.alive(&user, &device, presented_at_ms) {
        state.store.end_sessions(&user, Some(&device), now_ms()).await?;
        return Err(session_ended());
    }
    tracing::info!(user_hash = %state.log_id(&user), device_hash = %state.log_id(&device), "token refreshed");
    audit::record(state, event::REFRESH, actor::SELF, &user, Some(&device), Some(peer)).await;
    Ok(ok)
}
