//! Control events on a message: `recall` (E1), `edit` and `react` (E2),
//! `message.delete` for the caller only (E3), and `delivery.ack` (R1).

use tidemark_proto::{
    DeliveryAckOk, DeliveryAckReq, EditOk, EditReq, MessageDeleteOk, MessageDeleteReq, ReactOk, ReactReq, RecallOk,
    RecallReq, CONTENT_BYTES_MAX, ID_BYTES_MAX,
};

use super::conv::event_cmd;
use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use crate::util::now_ms;

use tidemark_proto::REACTION_BYTES_MAX;

fn check_ids(conv: &str, message_id: &str) -> ApiResult<()> {
    if conv.is_empty() || conv.len() > ID_BYTES_MAX || message_id.is_empty() || message_id.len() > ID_BYTES_MAX {
        return Err(ApiError::bad_request(format!("conv and message_id must be 1..={ID_BYTES_MAX} bytes")));
    }
    Ok(())
}

pub async fn recall(state: &AppState, ctx: &AuthCtx, req: RecallReq) -> ApiResult<RecallOk> {
    check_ids(&req.conv, &req.message_id)?;
    let cmd = event_cmd(ctx, &req.conv, req.client_msg_id)?;
    let out = state.store.recall(cmd, &req.message_id).await?;
    if out.changed {
        state.relay_wake.notify_one();
        tracing::info!(conv = %req.conv, message_id = %req.message_id, msg_seq = out.msg_seq, "message recalled");
    }
    Ok(RecallOk { msg_seq: out.msg_seq, version: out.version })
}

pub async fn edit(state: &AppState, ctx: &AuthCtx, req: EditReq) -> ApiResult<EditOk> {
    check_ids(&req.conv, &req.message_id)?;
    let content = super::send::check_content("text", &req.content)?;
    if content.len() > CONTENT_BYTES_MAX {
        return Err(ApiError::bad_request(format!("content exceeds {CONTENT_BYTES_MAX} bytes")));
    }
    let cmd = event_cmd(ctx, &req.conv, req.client_msg_id)?;
    let out = state.store.edit(cmd, &req.message_id, &content, req.base_version).await?;
    if out.changed {
        state.relay_wake.notify_one();
    }
    Ok(EditOk { msg_seq: out.msg_seq, version: out.version })
}

pub async fn react(state: &AppState, ctx: &AuthCtx, req: ReactReq) -> ApiResult<ReactOk> {
    check_ids(&req.conv, &req.message_id)?;
    if req.reaction.is_empty() || req.reaction.len() > REACTION_BYTES_MAX || req.reaction.chars().any(char::is_control)
    {
        return Err(ApiError::bad_request(format!("reaction must be 1..={REACTION_BYTES_MAX} bytes")));
    }
    let add = match req.op.as_str() {
        "add" => true,
        "remove" => false,
        other => return Err(ApiError::bad_request(format!("op must be add or remove, not {other:?}"))),
    };
    let cmd = event_cmd(ctx, &req.conv, req.client_msg_id)?;
    let out = state.store.react(cmd, &req.message_id, &req.reaction, add).await?;
    if out.changed {
        state.relay_wake.notify_one();
    }
    Ok(ReactOk { msg_seq: out.msg_seq, version: out.version, changed: out.changed })
}

pub async fn delete_for_me(state: &AppState, ctx: &AuthCtx, req: MessageDeleteReq) -> ApiResult<MessageDeleteOk> {
    check_ids(&req.conv, &req.message_id)?;
    let out = state.store.delete_for_me(&ctx.user, &req.conv, &req.message_id, now_ms()).await?;
    if let Some(hw) = out.written {
        state.hint_user(&ctx.user, hw);
    }
    Ok(MessageDeleteOk { conv: req.conv, message_id: req.message_id })
}

pub async fn delivery_ack(state: &AppState, ctx: &AuthCtx, req: DeliveryAckReq) -> ApiResult<DeliveryAckOk> {
    if req.message_ids.iter().any(|id| id.is_empty() || id.len() > ID_BYTES_MAX) {
        return Err(ApiError::bad_request(format!("message ids must be 1..={ID_BYTES_MAX} bytes")));
    }
    let recorded = state.store.record_delivery(&ctx.user, &ctx.device, req.message_ids, now_ms()).await?;
    Ok(DeliveryAckOk { recorded })
}
