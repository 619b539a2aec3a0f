//! `send` (S1–S4): validate, then one store call that commits the message
//! fact and its outbox record. The reply says "accepted", nothing more.

use tidemark_core::ids;
use tidemark_proto::{SendOk, SendReq, CONTENT_BYTES_MAX, ID_BYTES_MAX};
use tidemark_store::SendCmd;

use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::metrics as m;
use crate::state::AppState;
use crate::util::{new_message_id, now_ms};

/// Times and counts every send (O1, stage `accept`), refusals included,
/// and traces its outcome.
pub async fn run(state: &AppState, ctx: &AuthCtx, req: SendReq) -> ApiResult<SendOk> {
    let started = std::time::Instant::now();
    let result = accept(state, ctx, req).await;
    m::ACCEPT_LATENCY.record(started.elapsed().as_secs_f64());
    match &result {
        Ok(accepted) => {
            crate::trace_stage!(stage = "accept", trace_id = %accepted.message_id,
                message_id = %accepted.message_id, conv = %accepted.conv, msg_seq = accepted.msg_seq,
                user_hash = %state.log_id(&ctx.user), device_hash = %state.log_id(&ctx.device),
                result = if accepted.duplicate { "duplicate" } else { "accepted" },
                "send accepted: message and outbox record committed");
        }
        Err(e) => {
            m::SENDS_REFUSED.add_by("code", e.code.as_str(), 1);
            crate::trace_stage!(stage = "accept", trace_id = "", user_hash = %state.log_id(&ctx.user),
                device_hash = %state.log_id(&ctx.device), result = e.code.as_str(), "send refused");
        }
    }
    result
}

async fn accept(state: &AppState, ctx: &AuthCtx, req: SendReq) -> ApiResult<SendOk> {
    if req.conv.is_empty() || req.conv.len() > ID_BYTES_MAX {
        return Err(ApiError::bad_request(format!("conv must be 1..={ID_BYTES_MAX} bytes")));
    }
    ids::check_client_msg_id(&req.client_msg_id).map_err(ApiError::bad_request)?;
    ids::check_kind(&req.kind).map_err(ApiError::bad_request)?;
    let content = check_content(&req.kind, &req.content)?;
    let quote_id = match req.content.get("quote") {
        None => None,
        Some(q) => match q.get("message_id").and_then(|v| v.as_str()) {
            Some(id) if !id.is_empty() && id.len() <= ID_BYTES_MAX => Some(id.to_owned()),
            _ => return Err(ApiError::bad_request("content.quote needs a message_id")),
        },
    };
    // Bounds and one form per user (issue 18); a refusal is BAD_REQUEST.
    let mentions = tidemark_core::mention::normalize(&req.mentions, &ctx.user)
        .map_err(|e| ApiError::from(tidemark_store::StoreError::from(e)))?;
    let now = now_ms();
    let cmd = SendCmd {
        sender: ctx.user.clone(),
        sender_device: ctx.device.clone(),
        conv: req.conv,
        client_msg_id: req.client_msg_id,
        kind: req.kind,
        content,
        message_id: new_message_id(now),
        quote_id,
        mentions,
        mention_all: req.mention_all,
        connection_epoch: ctx.connection_epoch,
        now_ms: now,
    };
    // Cluster mode: the conversation's owner node writes it (issue 14).
    match state.router.forward_send(&cmd).await {
        crate::route::Forwarded::Answer(answer) => answer,
        crate::route::Forwarded::Local => write(state, cmd).await,
    }
}

/// Writes a validated send through this node's store: a send received
/// here, or one another node forwarded (`route`).
pub(crate) async fn write(state: &AppState, cmd: SendCmd) -> ApiResult<SendOk> {
    let minted = cmd.message_id.clone();
    let accepted = state.store.accept_send(cmd).await?;
    if accepted.duplicate {
        m::SENDS_DUPLICATE.inc();
    } else {
        m::SENDS_ACCEPTED.inc();
        state.relay_wake.notify_one();
    }
    // The answer's `duplicate` is the client's view: this request's own
    // write, found again by a local fallback, is no duplicate of it (S1).
    let duplicate = tidemark_core::control::answered_as_duplicate(accepted.duplicate, &accepted.message_id, &minted);
    Ok(SendOk {
        message_id: accepted.message_id,
        conv: accepted.conv,
        msg_seq: accepted.msg_seq,
        created_at: accepted.created_at_ms,
        duplicate,
    })
}

/// Required fields of the reference kinds: a file, a red packet or a card
/// is a reference to a resource held elsewhere, never the resource (C4).
const REFERENCE_FIELDS: &[(&str, &[&str])] =
    &[("file", &["file_id", "file_name", "file_size"]), ("red_packet", &["red_packet_id"]), ("card", &["card_id"])];

/// Validates a message content and returns it serialized.
pub(super) fn check_content(kind: &str, content: &serde_json::Value) -> ApiResult<String> {
    if !content.is_object() {
        return Err(ApiError::bad_request("content must be a JSON object"));
    }
    if let Some((_, fields)) = REFERENCE_FIELDS.iter().find(|(k, _)| *k == kind) {
        for f in *fields {
            if content.get(f).is_none_or(|v| v.is_null()) {
                return Err(ApiError::bad_request(format!("a {kind} message needs content.{f} (a reference)")));
            }
        }
    }
    let text = serde_json::to_string(content).map_err(|e| ApiError::bad_request(e.to_string()))?;
    if text.len() > CONTENT_BYTES_MAX {
        return Err(ApiError::bad_request(format!("content exceeds {CONTENT_BYTES_MAX} bytes")));
    }
    Ok(text)
}
