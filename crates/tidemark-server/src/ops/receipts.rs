//! Receipts shown to others (issue 18): `conv.receipts`, the read
//! positions of a conversation's current members (R2) minus private ones,
//! and `delivery.receipts`, the deliveries (R1) of the caller's own
//! messages in a direct conversation. Both are reads, decided by
//! `tidemark_core::ephemeral` inside the store.

use tidemark_proto::{
    ConvReceiptsOk, ConvReceiptsReq, DeliveryReceipt, DeliveryReceiptsOk, DeliveryReceiptsReq, MemberReceipt,
    ID_BYTES_MAX,
};

use super::conv::check_conv;
use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;

pub async fn conv_receipts(state: &AppState, ctx: &AuthCtx, req: ConvReceiptsReq) -> ApiResult<ConvReceiptsOk> {
    check_conv(&req.conv)?;
    let r = state.store.conv_receipts(&ctx.user, &req.conv, req.msg_seq).await?;
    Ok(ConvReceiptsOk {
        conv: req.conv,
        members: r.members.into_iter().map(|(user, read_seq)| MemberReceipt { user, read_seq }).collect(),
        hidden: r.hidden,
        read_count: r.read_count,
        truncated: r.truncated,
    })
}

pub async fn delivery_receipts(
    state: &AppState,
    ctx: &AuthCtx,
    req: DeliveryReceiptsReq,
) -> ApiResult<DeliveryReceiptsOk> {
    check_conv(&req.conv)?;
    if req.message_ids.iter().any(|id| id.is_empty() || id.len() > ID_BYTES_MAX) {
        return Err(ApiError::bad_request(format!("message ids must be 1..={ID_BYTES_MAX} bytes")));
    }
    let found = state.store.delivery_receipts(&ctx.user, &req.conv, req.message_ids).await?;
    let receipts =
        found.into_iter().map(|(message_id, delivered_at)| DeliveryReceipt { message_id, delivered_at }).collect();
    Ok(DeliveryReceiptsOk { conv: req.conv, receipts })
}
