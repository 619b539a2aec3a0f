//! HTTP routes: `POST /v1/rpc/<op>` with the same body and reply as the
//! WebSocket frame (without `t`/`rid` in the request), login, refresh,
//! admin, health and metrics.

use std::sync::Arc;

use std::net::SocketAddr;

use axum::body::Bytes;

use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;
use tidemark_proto::{
    AdminAuditOk, AdminAuditReq, AdminDeactivateOk, AdminDeactivateReq, AdminDeleteOk, AdminDeleteReq, AdminEpochOk,
    AdminEpochReq, AdminLogoutOk, AdminLogoutReq, AdminReconcileReq, AdminUnreadOk, AdminUserOk, AdminUserReq,
    AuditEntryOut, ErrorCode, HealthOk, HealthUnavailable, LoginReq, RefreshReq, AUDIT_LIMIT_DEFAULT, AUDIT_LIMIT_MAX,
};

use super::auth;
use crate::audit;
use crate::error::ApiError;
use crate::metrics as m;
use crate::ops::{self, parse};
use crate::state::AppState;
use tidemark_core::audit::{actor, event};

pub(super) fn error_response(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(e.into_frame(None))).into_response()
}

/// Parses a JSON object body into `T`, or the error response to send.
fn parse_body<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, Box<Response>> {
    json_body(body).and_then(parse).map_err(|e| Box::new(error_response(e)))
}

fn json_body(body: &Bytes) -> Result<Value, ApiError> {
    if body.is_empty() {
        return Ok(Value::Object(Default::default()));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("malformed JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("body must be a JSON object"));
    }
    Ok(v)
}

/// The token of an `Authorization: Bearer <token>` header (the scheme
/// name is case-insensitive, RFC 7235).
pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(axum::http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Refuses a request on a connection over its address's connection cap,
/// from an address over its request budget, or serving its period for
/// ignored waits, with `RATE_LIMITED` before its body, its token or its
/// route's handler is looked at (every route, WebSocket upgrades included).
pub async fn admit_address(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let over_cap = request.extensions().get::<crate::limits::OverConnectionCap>().is_some();
    match state.limits.admit_request(peer.ip(), over_cap, crate::util::now_ms()) {
        Ok(()) => next.run(request).await,
        Err(refusal) => {
            m::ADDRESS_REFUSALS.add_by("reason", refusal.reason.as_str(), 1);
            error_response(refusal.error)
        }
    }
}

/// Turns axum's plain-text rejections (body too large, bad method, no such
/// route) into the contract's error object, so every 4xx carries a code.
pub async fn contract_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !status.is_client_error() || is_json || status == StatusCode::UNAUTHORIZED {
        return response;
    }
    let (code, message) = match status {
        StatusCode::NOT_FOUND => (ErrorCode::NotFound, "no such route".to_string()),
        StatusCode::PAYLOAD_TOO_LARGE => (ErrorCode::BadRequest, "request body too large".to_string()),
        StatusCode::REQUEST_TIMEOUT => (ErrorCode::BadRequest, "request not received in time".to_string()),
        other => (ErrorCode::BadRequest, format!("request refused: {other}")),
    };
    (status, Json(ApiError::new(code, message).into_frame(None))).into_response()
}

pub async fn rpc(
    State(state): State<Arc<AppState>>,
    Path(op): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let ctx = match bearer(&headers) {
        None => return error_response(ApiError::new(ErrorCode::Unauthenticated, "missing bearer token")),
        Some(token) => match auth::authenticate(&state, token) {
            Ok(ctx) => ctx,
            Err(e) => return error_response(e),
        },
    };
    let body = match json_body(&body) {
        Ok(b) => b,
        Err(e) => return error_response(e),
    };
    match ops::dispatch(state, ctx, op.clone(), body).await {
        Ok(reply) => (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            tidemark_proto::reply_frame_text(&op, None, &reply),
        )
            .into_response(),
        Err(e) => error_response(e),
    }
}

pub async fn login(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: Bytes,
) -> Response {
    let req: LoginReq = match parse_body(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match auth::login(&state, peer.ip(), req).await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => error_response(e),
    }
}

pub async fn refresh(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: Bytes,
) -> Response {
    let req: RefreshReq = match parse_body(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match auth::refresh(&state, peer.ip(), req).await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => error_response(e),
    }
}

/// Constant-time comparison so the admin token cannot be guessed by timing.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The admin token check shared by every admin route.
fn admin_guard(state: &AppState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let Some(admin) = state.config.admin_token.as_deref() else {
        return Err(Box::new(error_response(ApiError::new(
            ErrorCode::Forbidden,
            "admin endpoints are disabled (TIDEMARK_ADMIN_TOKEN unset)",
        ))));
    };
    if !bearer(headers).is_some_and(|t| same_secret(t, admin)) {
        return Err(Box::new(error_response(ApiError::new(ErrorCode::Unauthenticated, "admin token required"))));
    }
    Ok(())
}

/// `POST /v1/admin/conv/epoch {conv}`: after any operation that rewrote a
/// conversation's log, clients must drop their cursor for it (C2).
pub async fn admin_bump_epoch(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = admin_guard(&state, &headers) {
        return *r;
    }
    let req: AdminEpochReq = match parse_body(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match state.store.bump_epoch(&req.conv).await {
        Ok(epoch) => {
            tracing::warn!(conv = %req.conv, epoch, "admin bumped conversation epoch");
            Json(AdminEpochOk { conv: req.conv, epoch }).into_response()
        }
        Err(e) => error_response(e.into()),
    }
}

/// `POST /v1/admin/unread/rebuild`: recounts unread from the facts and
/// reports how many rows had drifted (R3).
pub async fn admin_rebuild_unread(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = admin_guard(&state, &headers) {
        return *r;
    }
    match tidemark_store::reconcile::rebuild_unread(&*state.store, tidemark_store::reconcile::USERS_PER_CHUNK).await {
        Ok(r) => {
            tracing::info!(rows = r.rows_checked, drifted = r.drifted, "unread rebuilt");
            Json(AdminUnreadOk { rows_checked: r.rows_checked, drifted: r.drifted }).into_response()
        }
        Err(e) => error_response(e.into()),
    }
}

/// `POST /v1/admin/reconcile {dry_run?}` (O3): one reconciliation run over
/// every relation, in bounded chunks; repairs what is safe (unless
/// `dry_run`) and reports the rest, the quarantine included.
pub async fn admin_reconcile(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = admin_guard(&state, &headers) {
        return *r;
    }
    let req: AdminReconcileReq = if body.is_empty() {
        AdminReconcileReq::default()
    } else {
        match parse_body(&body) {
            Ok(r) => r,
            Err(r) => return *r,
        }
    };
    match crate::reconcile::run_once(&*state.store, req.dry_run).await {
        Ok(reply) => Json(reply).into_response(),
        Err(e) => error_response(e.into()),
    }
}

/// `POST /v1/admin/logout {user, device_id?}`: ends the sessions of one
/// device, or of every device of the user: their refresh tokens are
/// deleted, the access tokens issued until now are refused, live sockets
/// are kicked (`logged_out`). A later login works.
pub async fn admin_logout(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = admin_guard(&state, &headers) {
        return *r;
    }
    let req: AdminLogoutReq = match parse_body(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let result = async {
        let user = crate::accounts::resolve_user(state.store.as_ref(), &req.user).await?;
        if let Some(d) = &req.device_id {
            tidemark_core::ids::check_device_id(d).map_err(ApiError::bad_request)?;
        }
        let now = crate::util::now_ms();
        // The fence first, then the store: a refresh racing this logout
        // sees one or the other (`auth::refresh`). A fence left for a
        // name that does not exist refuses only tokens issued before now.
        state.sessions.end(&user, req.device_id.as_deref(), now);
        if !state.store.end_sessions(&user, req.device_id.as_deref(), now).await? {
            return Err(ApiError::new(ErrorCode::NotFound, "no such user or device"));
        }
        // Its live sockets here end, and the other nodes' on the bus.
        state.fences.end_sessions(&user, req.device_id.as_deref(), now);
        state.bus.publish_session_end(&user, req.device_id.as_deref(), tidemark_proto::reason::LOGGED_OUT, now);
        tracing::warn!(user_hash = %state.log_id(&user), device_hash = ?req.device_id.as_deref().map(|d| state.log_id(d)), "admin ended sessions");
        let device = req.device_id.as_deref();
        audit::record(&state, event::LOGGED_OUT, actor::ADMIN, &user, device, Some(peer.ip())).await;
        Ok(AdminLogoutOk { user, device_id: req.device_id.clone() })
    };
    match result.await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => error_response(e),
    }
}

/// Deactivates `user` around the store's `commit` (a deactivation or a
/// deletion): the in-memory fence first, so a refresh racing it sees one or
/// the other; taken back if the store refused; then the live sockets here
/// are kicked and the other nodes told. Returns what `commit` answered.
async fn fenced_deactivation(
    state: &AppState,
    user: &str,
    commit: impl std::future::Future<Output = tidemark_store::StoreResult<bool>>,
) -> Result<bool, ApiError> {
    state.sessions.deactivate(user);
    let done = match commit.await {
        Ok(d) => d,
        Err(e) => {
            state.sessions.undo_deactivate(user);
            return Err(e.into());
        }
    };
    state.fences.deactivate(user);
    state.bus.publish_session_end(user, None, tidemark_proto::reason::ACCOUNT_DEACTIVATED, 0);
    Ok(done)
}

/// `POST /v1/admin/deactivate {user}`: the account's sessions end, its
/// live sockets are kicked (`account_deactivated`), and nothing of it is
/// accepted after: its tokens are refused and it no longer logs in.
pub async fn admin_deactivate(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = admin_guard(&state, &headers) {
        return *r;
    }
    let req: AdminDeactivateReq = match parse_body(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let result = async {
        let user = crate::accounts::resolve_user(state.store.as_ref(), &req.user).await?;
        let deactivated =
            fenced_deactivation(&state, &user, state.store.deactivate_user(&user, crate::util::now_ms())).await?;
        tracing::warn!(user_hash = %state.log_id(&user), deactivated, "admin deactivated user");
        if deactivated {
            audit::record(&state, event::DEACTIVATED, actor::ADMIN, &user, None, Some(peer.ip())).await;
        }
        Ok(AdminDeactivateOk { user, deactivated })
    };
    match result.await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => error_response(e),
    }
}

/// `POST /v1/admin/delete {user}`: deactivates the account (its sessions
/// end, live sockets are kicked) and deletes its devices, cursors, tokens
/// and log (`Store::delete_user`); its messages stay in their
/// conversations under its name, which is never reused.
pub async fn admin_delete(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = admin_guard(&state, &headers) {
        return *r;
    }
    let req: AdminDeleteReq = match parse_body(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let result = async {
        let user = crate::accounts::resolve_user(state.store.as_ref(), &req.user).await?;
        let deleted = fenced_deactivation(&state, &user, state.store.delete_user(&user, crate::util::now_ms())).await?;
        tracing::warn!(user_hash = %state.log_id(&user), deleted, "admin deleted user");
        if deleted {
            audit::record(&state, event::DELETED, actor::ADMIN, &user, None, Some(peer.ip())).await;
        }
        Ok(AdminDeleteOk { user, deleted })
    };
    match result.await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => error_response(e),
    }
}

/// `POST /v1/admin/audit {user?, from_ms?, to_ms?, limit?}`: audit entries,
/// oldest first.
pub async fn admin_audit(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = admin_guard(&state, &headers) {
        return *r;
    }
    let req: AdminAuditReq = match parse_body(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let result = async {
        let limit = req.limit.unwrap_or(AUDIT_LIMIT_DEFAULT);
        if limit == 0 || limit > AUDIT_LIMIT_MAX {
            return Err(ApiError::bad_request(format!("limit must be 1..={AUDIT_LIMIT_MAX}")));
        }
        let user_hash = match &req.user {
            Some(u) => Some(state.keys.audit_id(&crate::accounts::resolve_user(state.store.as_ref(), u).await?)),
            None => None,
        };
        let (from, to) = (req.from_ms.unwrap_or(0), req.to_ms.unwrap_or(i64::MAX));
        let entries = state.store.audit_log(user_hash.as_deref(), from, to, limit).await?;
        Ok(AdminAuditOk {
            entries: entries
                .into_iter()
                .map(|e| AuditEntryOut {
                    at_ms: e.at_ms,
                    event: e.event,
                    actor: e.actor,
                    user_hash: e.user_hash,
                    device_hash: e.device_hash,
                    address: e.address,
                })
                .collect(),
        })
    };
    match result.await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => error_response(e),
    }
}

pub async fn admin_create_user(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = admin_guard(&state, &headers) {
        return *r;
    }
    let req: AdminUserReq = match parse_body(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match crate::accounts::create_user(&state, &req.user, &req.password).await {
        Ok((user, created)) => {
            tracing::info!(user_hash = %state.log_id(&user), created, "admin created user");
            if created {
                audit::record(&state, event::USER_CREATED, actor::ADMIN, &user, None, Some(peer.ip())).await;
            }
            Json(AdminUserOk { user, created }).into_response()
        }
        Err(e) => error_response(e),
    }
}

/// 200 while the store answers reads and its writes commit; 503 otherwise
/// (a writer that cannot commit, a database that does not answer).
pub async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    if let Some(why) = state.store.health().write_failure {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "unavailable", "error": why})))
            .into_response();
    }
    match state.store.outbox_stats().await {
        Ok(s) => Json(HealthOk { status: "ok".into(), outbox_backlog: s.backlog }).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(HealthUnavailable { status: "unavailable".into(), error: e.to_string() }),
        )
            .into_response(),
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    // Gauges are sampled here, at scrape time: one store read of
    // aggregates (at most once per `gauges_every`) and a walk of this
    // node's connections, nothing per request.
    let now = crate::util::now_ms();
    let gauges = state.sampled_gauges(now).await;
    m::sample(gauges.as_ref(), &state.hub.lag(now), now);
    m::sample_limits(&state.limits);
    let st = state.store.stats();
    // The store keeps its own totals; the counters take them as they are.
    m::STORE_WRITE_REQUESTS.absolute(st.writes);
    m::STORE_STATEMENTS.absolute(st.statements);
    if let Some(reads) = st.read_statements {
        m::STORE_READ_STATEMENTS.absolute(reads);
    }
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}
