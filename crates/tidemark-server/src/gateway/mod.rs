//! The gateway: HTTP routes and the WebSocket endpoint. Both transports
//! parse a frame, authenticate from the token, and call
//! [`crate::ops::dispatch`]; neither holds message state.

pub mod auth;
mod http;
mod openapi;
mod replies;
mod ws;

pub use ws::{WS_READ_BUFFER_BYTES, WS_WRITE_BUFFER_BYTES};

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutLayer};

use crate::state::AppState;

pub fn router(state: Arc<AppState>) -> Router {
    let body_max = state.config.frame_bytes_max;
    let timeouts = state.config.http_timeouts;
    Router::new()
        .route("/healthz", get(http::healthz))
        .route("/metrics", get(http::metrics))
        .route("/v1/openapi.json", get(openapi::document))
        .route("/v1/admin/users", post(http::admin_create_user))
        .route("/v1/admin/conv/epoch", post(http::admin_bump_epoch))
        .route("/v1/admin/unread/rebuild", post(http::admin_rebuild_unread))
        .route("/v1/admin/reconcile", post(http::admin_reconcile))
        .route("/v1/admin/logout", post(http::admin_logout))
        .route("/v1/admin/deactivate", post(http::admin_deactivate))
        .route("/v1/admin/delete", post(http::admin_delete))
        .route("/v1/admin/audit", post(http::admin_audit))
        .route("/v1/login", post(http::login))
        .route("/v1/refresh", post(http::refresh))
        .route("/v1/rpc/{op}", post(http::rpc))
        .route("/v1/ws", get(ws::upgrade))
        // Before the body limit, the timeouts and any handler: a request
        // from an address over its budget is refused before it is read.
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), http::admit_address))
        .layer(DefaultBodyLimit::max(body_max))
        // A body that pauses too long (400) and a request, body included,
        // that takes too long (408) end the request; hyper then closes the
        // connection, as the body was not read to its end.
        .layer(RequestBodyTimeoutLayer::new(timeouts.body))
        .layer(TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, timeouts.request))
        .layer(axum::middleware::map_response(http::contract_errors))
        .with_state(state)
}
