//! One module per operation: parse the body, apply it through the store,
//! build the reply. [`dispatch`] is the single entry point used by both the
//! WebSocket and the HTTP transport, so an operation behaves the same on
//! both.

pub mod control;
pub mod conv;
pub mod device;
pub mod ephemeral;
pub mod push;
pub mod receipts;
pub mod render;
pub mod send;
pub mod snapshot;
pub mod stats;
pub mod sync;

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;
use tidemark_proto::{op, ErrorCode, RawJson};
use tidemark_store::MembershipChange;

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;

/// The caller, taken from a verified access token and nothing else (P1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthCtx {
    pub user: String,
    pub device: String,
    /// When the access token expires; a WebSocket is closed then.
    pub expires_at_ms: i64,
    /// The WebSocket connection the request came on (its
    /// `connection_epoch`, P2); `None` over HTTP, which belongs to no
    /// connection. The store refuses a send, ACK or read of an older
    /// connection than the device's newest (`StoreError::Superseded`),
    /// whether or not this node has heard of the newer one yet.
    pub connection_epoch: Option<u64>,
}

/// The caller's device cursor, as every sync and snapshot step reads it
/// first; a device the store does not know must log in again.
pub(crate) async fn device_cursor(state: &AppState, ctx: &AuthCtx) -> ApiResult<tidemark_core::cursor::DeviceCursor> {
    state
        .store
        .device(&ctx.user, &ctx.device)
        .await?
        .map(|d| d.cursor)
        .ok_or_else(|| ApiError::new(ErrorCode::Unauthenticated, "unknown device; log in again"))
}

pub(crate) fn parse<T: DeserializeOwned>(body: Value) -> ApiResult<T> {
    serde_json::from_value(body).map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
}

/// A reply serialised once, to the text that goes on the wire (stored JSON
/// inside it stays verbatim: see `render`).
pub(crate) fn to_value<T: serde::Serialize>(reply: &T) -> ApiResult<RawJson> {
    serde_json::value::to_raw_value(reply).map_err(|e| ApiError::new(ErrorCode::Internal, format!("encode reply: {e}")))
}

/// Runs operation `op` for `ctx`. Everything before the first store call is
/// synchronous, so a transport that polls this future once before spawning
/// it enqueues the connection's writes in arrival order.
pub async fn dispatch(state: Arc<AppState>, ctx: AuthCtx, op: String, body: Value) -> ApiResult<RawJson> {
    if state.is_revoked(&ctx.user, &ctx.device) {
        return Err(ApiError::device_revoked());
    }
    // A WebSocket outlives no forced logout: its later requests are refused.
    if !state.session_alive(&ctx.user, &ctx.device, ctx.expires_at_ms) {
        return Err(crate::gateway::auth::session_ended());
    }
    // Before anything is read or written: a limited request changes nothing.
    state.limits.admit_op(&op, &ctx.user, &ctx.device)?;
    if crate::limits::OpClass::of(&op) == crate::limits::OpClass::Ephemeral
        && !state.load.runs(tidemark_core::degrade::Work::Ephemeral)
    {
        // Typing and presence are the first shed (§9.4).
        return Err(crate::limits::rate_limited(
            crate::degrade::SHED_RETRY_AFTER_MS,
            "typing and presence while the server is behind",
        ));
    }
    match op.as_str() {
        op::SEND => to_value(&send::run(&state, &ctx, parse(body)?).await?),
        op::SYNC => to_value(&sync::sync(&state, &ctx, parse(body)?).await?),
        op::ACK => to_value(&sync::ack(&state, &ctx, parse(body)?).await?),
        op::CONV_CREATE => to_value(&conv::create(&state, &ctx, parse(body)?).await?),
        op::CONV_LIST => to_value(&conv::list(&state, &ctx, parse(body)?).await?),
        op::DIRTY_CLEAR => to_value(&conv::dirty_clear(&state, &ctx, parse(body)?).await?),
        op::CONV_ADD => to_value(&conv::membership(&state, &ctx, parse(body)?, MembershipChange::Add).await?),
        op::CONV_REMOVE => to_value(&conv::membership(&state, &ctx, parse(body)?, MembershipChange::Remove).await?),
        op::CONV_LEAVE => to_value(&conv::membership(&state, &ctx, parse(body)?, MembershipChange::Leave).await?),
        op::CONV_MEMBERS => to_value(&conv::members(&state, &ctx, parse(body)?).await?),
        op::CONV_SYNC => to_value(&conv::sync(&state, &ctx, parse(body)?).await?),
        op::HISTORY => to_value(&conv::history(&state, &ctx, parse(body)?).await?),
        op::CONV_SETTINGS => to_value(&conv::settings(&state, &ctx, parse(body)?).await?),
        op::READ => to_value(&conv::read(&state, &ctx, parse(body)?).await?),
        op::RECALL => to_value(&control::recall(&state, &ctx, parse(body)?).await?),
        op::EDIT => to_value(&control::edit(&state, &ctx, parse(body)?).await?),
        op::REACT => to_value(&control::react(&state, &ctx, parse(body)?).await?),
        op::MESSAGE_DELETE => to_value(&control::delete_for_me(&state, &ctx, parse(body)?).await?),
        op::DELIVERY_ACK => to_value(&control::delivery_ack(&state, &ctx, parse(body)?).await?),
        op::SNAPSHOT_BEGIN => to_value(&snapshot::begin(&state, &ctx).await?),
        op::SNAPSHOT_PAGE => to_value(&snapshot::page(&state, &ctx, parse(body)?).await?),
        op::SNAPSHOT_ACK => to_value(&snapshot::ack(&state, &ctx, parse(body)?).await?),
        op::DEVICE_REVOKE => to_value(&device::revoke(&state, &ctx, parse(body)?).await?),
        op::DEVICE_LIST => to_value(&device::list(&state, &ctx).await?),
        op::ACCOUNT_PASSWORD => to_value(&device::change_password(&state, &ctx, parse(body)?).await?),
        op::PING => to_value(&tidemark_proto::Empty {}),
        op::TYPING => to_value(&ephemeral::typing(&state, &ctx, parse(body)?).await?),
        op::PRESENCE_SET => to_value(&ephemeral::presence_set(&state, &ctx, parse(body)?).await?),
        op::PRIVACY_SET => to_value(&ephemeral::privacy_set(&state, &ctx, parse(body)?).await?),
        op::CONV_RECEIPTS => to_value(&receipts::conv_receipts(&state, &ctx, parse(body)?).await?),
        op::DELIVERY_RECEIPTS => to_value(&receipts::delivery_receipts(&state, &ctx, parse(body)?).await?),
        op::CLIENT_STATS => to_value(&stats::report(parse(body)?)?),
        op::PUSH_REGISTER => to_value(&push::register(&state, &ctx, parse(body)?).await?),
        op::PUSH_LIST => to_value(&push::list(&state, &ctx).await?),
        op::PUSH_REMOVE => to_value(&push::remove(&state, &ctx, parse(body)?).await?),
        other => Err(ApiError::bad_request(format!("unknown operation {other:?}"))),
    }
}
