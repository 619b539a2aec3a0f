//! `conv.create` and `conv.list`.

use tidemark_proto::{ConvCreateOk, ConvCreateReq, ConvListOk, ConvSummary};
use tidemark_store::CONV_DIRECT;

use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::server::AppState;
use crate::util::{new_id, now_ms};

pub async fn create(state: &AppState, ctx: &AuthCtx, req: ConvCreateReq) -> ApiResult<ConvCreateOk> {
    match req.kind.as_str() {
        CONV_DIRECT => {
            // `members` names the peer, with or without the caller.
            let others: Vec<&String> = req.members.iter().filter(|m| **m != ctx.user).collect();
            let [peer] = others.as_slice() else {
                return Err(ApiError::bad_request("a direct conversation has exactly one other member"));
            };
            tidemark_core::ids::check_user(peer).map_err(ApiError::bad_request)?;
            let (conv, created) = state.store.create_direct(&ctx.user, peer, &new_id("c"), now_ms()).await?;
            let mut members = vec![ctx.user.clone(), (*peer).clone()];
            members.sort();
            Ok(ConvCreateOk { conv, kind: CONV_DIRECT.into(), members, created })
        }
        "group" => Err(ApiError::bad_request("group conversations are not available on this server yet")),
        other => Err(ApiError::bad_request(format!("unknown conversation kind {other:?}"))),
    }
}

pub async fn list(state: &AppState, ctx: &AuthCtx) -> ApiResult<ConvListOk> {
    let rows = state.store.list_conversations(&ctx.user).await?;
    Ok(ConvListOk {
        conversations: rows
            .into_iter()
            .map(|r| ConvSummary {
                conv: r.conv,
                kind: r.kind,
                last_msg_seq: r.last_msg_seq,
                read_seq: r.read_seq,
                unread: r.unread,
            })
            .collect(),
    })
}
