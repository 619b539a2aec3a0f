//! Accounts: password hashing (argon2), login, refresh and the bearer check.
//! Tokens and passwords never reach a log line.

use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use tidemark_core::token::AccessClaims;
use tidemark_proto::{ErrorCode, LoginOk, LoginReq, RefreshReq};
use tidemark_store::RefreshRecord;

use crate::error::{ApiError, ApiResult};
use crate::ops::AuthCtx;
use crate::server::AppState;
use crate::util::{new_secret, now_ms, sha256_hex};

use tidemark_proto::PASSWORD_BYTES_MAX;

pub fn hash_password(password: &str) -> Result<String, String> {
    let salt = SaltString::generate(&mut OsRng);
    Argon2::default().hash_password(password.as_bytes(), &salt).map(|h| h.to_string()).map_err(|e| e.to_string())
}

pub fn verify_password(password: &str, phc: &str) -> bool {
    PasswordHash::new(phc).is_ok_and(|h| Argon2::default().verify_password(password.as_bytes(), &h).is_ok())
}

fn unauthenticated(message: &str) -> ApiError {
    ApiError::new(ErrorCode::Unauthenticated, message)
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
    Ok(AuthCtx { user: claims.user, device: claims.device, expires_at_ms: claims.expires_at_ms })
}

pub async fn create_user(state: &AppState, user: &str, password: &str) -> ApiResult<bool> {
    tidemark_core::ids::check_user(user).map_err(ApiError::bad_request)?;
    if password.is_empty() || password.len() > PASSWORD_BYTES_MAX {
        return Err(ApiError::bad_request(format!("password must be 1..={PASSWORD_BYTES_MAX} bytes")));
    }
    let password = password.to_owned();
    let hash = tokio::task::spawn_blocking(move || hash_password(&password))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(|e| ApiError::new(ErrorCode::Internal, e))?;
    Ok(state.store.create_user(user, &hash, now_ms()).await?)
}

async fn issue(state: &AppState, user: &str, device: &str) -> ApiResult<LoginOk> {
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
    };
    state.store.put_refresh_token(&sha256_hex(&refresh_token), &rec).await?;
    Ok(LoginOk { user: user.into(), device_id: device.into(), access_token, expires_in: ttl.as_secs(), refresh_token })
}

pub async fn login(state: &AppState, req: LoginReq) -> ApiResult<LoginOk> {
    tidemark_core::ids::check_user(&req.user).map_err(|_| unauthenticated("wrong user or password"))?;
    tidemark_core::ids::check_device_id(&req.device_id).map_err(ApiError::bad_request)?;
    if req.password.len() > PASSWORD_BYTES_MAX {
        return Err(unauthenticated("wrong user or password"));
    }
    let hash = state.store.password_hash(&req.user).await?;
    let password = req.password.clone();
    // Verify even for an unknown user so timing does not reveal which
    // names exist.
    let ok = tokio::task::spawn_blocking(move || match hash {
        Some(h) => verify_password(&password, &h),
        None => {
            let _ = hash_password(&password);
            false
        }
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    if !ok {
        return Err(unauthenticated("wrong user or password"));
    }
    let name = req.device_name.unwrap_or_else(|| req.device_id.clone());
    let name: String = name.chars().take(tidemark_proto::DEVICE_NAME_CHARS_MAX).collect();
    let device = state.store.login_device(&req.user, &req.device_id, &name, now_ms()).await?;
    if device.cursor.state == tidemark_core::cursor::DeviceState::Revoked {
        return Err(ApiError::device_revoked());
    }
    tracing::info!(user = %req.user, device = %req.device_id, "login");
    issue(state, &req.user, &req.device_id).await
}

pub async fn refresh(state: &AppState, req: RefreshReq) -> ApiResult<LoginOk> {
    let rec = state
        .store
        .take_refresh_token(&sha256_hex(&req.refresh_token))
        .await?
        .ok_or_else(|| unauthenticated("unknown or used refresh token"))?;
    if rec.expires_at_ms <= now_ms() {
        return Err(unauthenticated("refresh token expired"));
    }
    if state.is_revoked(&rec.user, &rec.device) {
        return Err(ApiError::device_revoked());
    }
    tracing::info!(user = %rec.user, device = %rec.device, "token refreshed");
    issue(state, &rec.user, &rec.device).await
}
