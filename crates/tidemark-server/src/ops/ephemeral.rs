//! The ephemeral lane's operations (issue 18): `typing`, `presence.set`
//! and `privacy.set`. Typing and presence are delivered by
//! [`crate::ephemeral::Lane`] and never written to a log; only the privacy
//! switches are durable.

use tidemark_core::ephemeral::Presence;
use tidemark_proto::{presence_state, PresenceSetOk, PresenceSetReq, PrivacyOk, PrivacySetReq, TypingOk, TypingReq};

use super::conv::check_conv;
use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;

pub async fn typing(state: &AppState, ctx: &AuthCtx, req: TypingReq) -> ApiResult<TypingOk> {
    check_conv(&req.conv)?;
    let timeout_ms = state.lane.typing(&ctx.user, &req.conv, req.typing, req.timeout_ms).await?;
    Ok(TypingOk { conv: req.conv, typing: req.typing, timeout_ms })
}

pub async fn presence_set(state: &AppState, ctx: &AuthCtx, req: PresenceSetReq) -> ApiResult<PresenceSetOk> {
    let wanted = match Presence::parse(&req.state) {
        Some(p @ (Presence::Online | Presence::Idle)) => p,
        _ => {
            let allowed = [presence_state::ONLINE, presence_state::IDLE].join(" or ");
            return Err(ApiError::bad_request(format!("state must be {allowed}")));
        }
    };
    let (shown, hidden) = state.lane.set_presence(&ctx.user, &ctx.device, wanted).await?;
    Ok(PresenceSetOk { state: shown.as_str().into(), hidden })
}

pub async fn privacy_set(state: &AppState, ctx: &AuthCtx, req: PrivacySetReq) -> ApiResult<PrivacyOk> {
    let before = state.store.privacy(&ctx.user).await?;
    let update = tidemark_store::PrivacyUpdate {
        hide_presence: req.hide_presence,
        private_receipts: req.private_receipts,
        push_preview: req.push_preview.map(Into::into),
    };
    let (after, outcome) = state.store.update_privacy(&ctx.user, update, crate::util::now_ms()).await?;
    if let Some(hw) = outcome.written {
        // The change reaches the user's other devices as a user event.
        state.hint_user(&ctx.user, hw);
    }
    if after.hide_presence != before.hide_presence {
        state.lane.privacy_changed(&ctx.user, after).await;
    }
    Ok(PrivacyOk {
        hide_presence: after.hide_presence,
        private_receipts: after.private_receipts,
        push_preview: after.push_preview.into(),
    })
}
