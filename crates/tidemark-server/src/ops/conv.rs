//! Conversations: `conv.create` (direct and group), membership changes
//! (`conv.add`, `conv.remove`, `conv.leave`), the member list
//! (`conv.members`), `conv.list`, `conv.sync`,
//! `history`, `conv.settings` and `read`.

use tidemark_proto::{
    ConvCreateOk, ConvCreateReq, ConvListOk, ConvListReq, ConvMember, ConvMemberOk, ConvMemberReq, ConvMembersOk,
    ConvMembersReq, ConvSettingsOk, ConvSettingsReq, ConvSummary, ConvSyncOk, ConvSyncReq, DirtyClearOk, DirtyClearReq,
    HistoryOk, HistoryReq, ReadOk, ReadReq, CONV_LIST_LIMIT_DEFAULT, CONV_LIST_LIMIT_MAX, CONV_MEMBERS_LIMIT_DEFAULT,
    CONV_MEMBERS_LIMIT_MAX, CONV_SYNC_LIMIT_DEFAULT, CONV_SYNC_LIMIT_MAX, HISTORY_LIMIT_DEFAULT, HISTORY_LIMIT_MAX,
};
use tidemark_store::{ConvEventCmd, MembershipChange, CONV_DIRECT, CONV_GROUP};

use super::render::envelope;
use super::AuthCtx;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use crate::util::{new_id, new_message_id, now_ms};

pub(super) fn check_conv(conv: &str) -> ApiResult<()> {
    if conv.is_empty() || conv.len() > tidemark_proto::ID_BYTES_MAX {
        return Err(ApiError::bad_request(format!("conv must be 1..={} bytes", tidemark_proto::ID_BYTES_MAX)));
    }
    Ok(())
}

/// A conversation event command from the caller; `client_msg_id` makes a
/// retry return the original event.
pub(super) fn event_cmd(ctx: &AuthCtx, conv: &str, client_msg_id: Option<String>) -> ApiResult<ConvEventCmd> {
    let now = now_ms();
    let event_id = new_message_id(now);
    let client_msg_id = match client_msg_id {
        Some(id) => {
            tidemark_core::ids::check_client_msg_id(&id).map_err(ApiError::bad_request)?;
            id
        }
        None => format!("srv-{event_id}"),
    };
    Ok(ConvEventCmd {
        conv: conv.into(),
        actor: ctx.user.clone(),
        actor_device: ctx.device.clone(),
        event_id,
        client_msg_id,
        now_ms: now,
    })
}

/// Where a page must stop so its contents stay under
/// `SYNC_PAGE_BYTES_MAX` (it always keeps its first item); `None` when the
/// whole page fits.
fn bytes_cut(sizes: impl Iterator<Item = usize>) -> Option<usize> {
    let mut total = 0;
    for (i, size) in sizes.enumerate() {
        total += size;
        if total > tidemark_proto::SYNC_PAGE_BYTES_MAX && i > 0 {
            return Some(i);
        }
    }
    None
}

fn limit(requested: Option<u32>, default: u32, max: u32) -> ApiResult<u32> {
    let l = requested.unwrap_or(default);
    if l == 0 || l > max {
        return Err(ApiError::bad_request(format!("limit must be 1..={max}")));
    }
    Ok(l)
}

/// The users a request names, each as the account it means (`Bob` is
/// `bob`, or a legacy `Bob`: `accounts::resolve_user`).
async fn resolve_users(state: &AppState, names: &[String]) -> ApiResult<Vec<String>> {
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        out.push(crate::accounts::resolve_user(state.store.as_ref(), name).await?);
    }
    Ok(out)
}

pub async fn create(state: &AppState, ctx: &AuthCtx, req: ConvCreateReq) -> ApiResult<ConvCreateOk> {
    match req.kind.as_str() {
        CONV_DIRECT => {
            // `members` names the peer, with or without the caller.
            let members = resolve_users(state, &req.members).await?;
            let others: Vec<&String> = members.iter().filter(|m| **m != ctx.user).collect();
            let [peer] = others.as_slice() else {
                return Err(ApiError::bad_request("a direct conversation has exactly one other member"));
            };
            let (conv, created) = state.store.create_direct(&ctx.user, peer, &new_id("c"), now_ms()).await?;
            let mut members = vec![ctx.user.clone(), (*peer).clone()];
            members.sort();
            Ok(ConvCreateOk { conv, kind: CONV_DIRECT.into(), members, created })
        }
        CONV_GROUP => {
            let mut members = resolve_users(state, &req.members).await?;
            let cmd = event_cmd(ctx, &new_id("g"), req.client_msg_id.clone())?;
            let (conv, _) = state.store.create_group(cmd, members.clone()).await?;
            state.relay_wake.notify_one();
            members.push(ctx.user.clone());
            members.sort();
            members.dedup();
            Ok(ConvCreateOk { conv, kind: CONV_GROUP.into(), members, created: true })
        }
        other => Err(ApiError::bad_request(format!("unknown conversation kind {other:?}"))),
    }
}

pub async fn membership(
    state: &AppState,
    ctx: &AuthCtx,
    req: ConvMemberReq,
    change: MembershipChange,
) -> ApiResult<ConvMemberOk> {
    check_conv(&req.conv)?;
    let target = match change {
        MembershipChange::Leave => ctx.user.clone(),
        _ => {
            let named = req.user.as_deref().ok_or_else(|| ApiError::bad_request("user is required"))?;
            crate::accounts::resolve_user(state.store.as_ref(), named).await?
        }
    };
    let cmd = event_cmd(ctx, &req.conv, req.client_msg_id)?;
    let msg_seq = state.store.change_membership(cmd, &target, change).await?;
    state.relay_wake.notify_one();
    tracing::info!(conv = %req.conv, target = %target, msg_seq, ?change, "membership changed");
    Ok(ConvMemberOk { conv: req.conv, msg_seq })
}

/// `conv.list`: without paging fields every conversation at once, in list
/// order (what clients that predate paging get); with `limit` or `after`
/// one page in `conv` order, which a keyset read over the key never skips
/// or repeats under writes.
pub async fn list(state: &AppState, ctx: &AuthCtx, req: ConvListReq) -> ApiResult<ConvListOk> {
    if !req.paged() {
        let rows = state.store.list_conversations(&ctx.user, Some(&ctx.device)).await?;
        return Ok(ConvListOk {
            conversations: rows.into_iter().map(summary).collect(),
            has_more: None,
            next_after: None,
        });
    }
    let limit = req.limit.unwrap_or(CONV_LIST_LIMIT_DEFAULT);
    if limit == 0 || limit > CONV_LIST_LIMIT_MAX {
        return Err(ApiError::bad_request(format!("limit must be 1..={CONV_LIST_LIMIT_MAX}")));
    }
    let after = req.after.unwrap_or_default();
    if after.len() > tidemark_proto::ID_BYTES_MAX {
        return Err(ApiError::bad_request(format!("after must be at most {} bytes", tidemark_proto::ID_BYTES_MAX)));
    }
    // One more than the page says whether another page follows.
    let mut rows = state.store.conversations_after(&ctx.user, Some(&ctx.device), &after, limit + 1).await?;
    let has_more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    let next_after = if has_more { rows.last().map(|r| r.conv.clone()) } else { None };
    Ok(ConvListOk { conversations: rows.into_iter().map(summary).collect(), has_more: Some(has_more), next_after })
}

/// A conversation-list row on the wire (`conv.list`, snapshot items).
pub fn summary(r: tidemark_store::ConvState) -> ConvSummary {
    ConvSummary {
        conv: r.conv,
        kind: r.kind,
        last_msg_seq: r.last_msg_seq,
        read_seq: r.read_seq,
        unread: r.unread,
        mentions: r.mentions,
        muted: r.muted,
        pinned: r.pinned,
        active: r.active,
        mode: r.mode,
        dirty_target_msg_seq: r.marker.map(|m| m.target),
        dirty_version: r.marker.map(|m| m.version),
        dirty: r.marker.map(|m| m.dirty),
        unread_capped: r.unread_capped,
        push_preview: r.push_preview.into(),
    }
}

/// `dirty.clear` (G2): the version CAS after the device's pull.
pub async fn dirty_clear(state: &AppState, ctx: &AuthCtx, req: DirtyClearReq) -> ApiResult<DirtyClearOk> {
    check_conv(&req.conv)?;
    let (cleared, marker) =
        state.store.clear_marker(&ctx.user, &ctx.device, &req.conv, req.dirty_version, req.last_msg_seq).await?;
    crate::metrics::MARKER_CLEARS.add_by("outcome", if cleared { "cleared" } else { "stale" }, 1);
    Ok(DirtyClearOk { conv: req.conv, cleared, dirty_target_msg_seq: marker.target, dirty_version: marker.version })
}

pub async fn sync(state: &AppState, ctx: &AuthCtx, req: ConvSyncReq) -> ApiResult<ConvSyncOk> {
    check_conv(&req.conv)?;
    let limit = limit(req.limit, CONV_SYNC_LIMIT_DEFAULT, CONV_SYNC_LIMIT_MAX)?;
    let mut page = state.store.conv_sync(&ctx.user, &req.conv, req.after, limit, req.epoch).await?;
    if let Some(keep) = bytes_cut(page.events.iter().map(|m| m.content.len())) {
        // The page stops at the byte bound; the cursor stops with it.
        page.events.truncate(keep);
        page.has_more = true;
        page.next_after = page.events.last().map_or(req.after, |m| m.msg_seq);
    }
    Ok(ConvSyncOk {
        conv: req.conv,
        epoch: page.epoch,
        min_seq: page.min_seq,
        head: page.head,
        next_after: page.next_after,
        has_more: page.has_more,
        trimmed: page.trimmed,
        events: page.events.into_iter().map(envelope).collect::<ApiResult<_>>()?,
    })
}

/// One page of a conversation's current members (a current member only;
/// `tidemark_core::membership::members_page` decides in the store).
pub async fn members(state: &AppState, ctx: &AuthCtx, req: ConvMembersReq) -> ApiResult<ConvMembersOk> {
    check_conv(&req.conv)?;
    if let Some(after) = &req.after {
        tidemark_core::ids::check_user(after).map_err(ApiError::bad_request)?;
    }
    let limit = limit(req.limit, CONV_MEMBERS_LIMIT_DEFAULT, CONV_MEMBERS_LIMIT_MAX)?;
    let page = state.store.conv_members(&ctx.user, &req.conv, req.after, limit).await?;
    let next_after = page.members.last().map(|(user, _)| user.clone()).filter(|_| page.has_more);
    Ok(ConvMembersOk {
        conv: req.conv,
        owner: page.owner,
        members_seq: page.members_seq,
        members: page.members.into_iter().map(|(user, joined_seq)| ConvMember { user, joined_seq }).collect(),
        next_after,
        has_more: page.has_more,
    })
}

pub async fn history(state: &AppState, ctx: &AuthCtx, req: HistoryReq) -> ApiResult<HistoryOk> {
    check_conv(&req.conv)?;
    let limit = limit(req.limit, HISTORY_LIMIT_DEFAULT, HISTORY_LIMIT_MAX)?;
    let mut page = state.store.history(&ctx.user, &req.conv, req.before_seq, limit).await?;
    if let Some(keep) = bytes_cut(page.messages.iter().map(|m| m.content.len())) {
        page.messages.truncate(keep);
        page.has_more = true;
        page.next_cursor = page.messages.last().map(|m| m.msg_seq);
    }
    Ok(HistoryOk {
        messages: page.messages.into_iter().map(envelope).collect::<ApiResult<_>>()?,
        next_cursor: page.next_cursor,
        has_more: page.has_more,
        history_start: page.history_start,
        trimmed: page.trimmed && !page.has_more,
    })
}

pub async fn settings(state: &AppState, ctx: &AuthCtx, req: ConvSettingsReq) -> ApiResult<ConvSettingsOk> {
    check_conv(&req.conv)?;
    let update = tidemark_store::SettingsUpdate {
        muted: req.muted,
        pinned: req.pinned,
        push_preview: req.push_preview.map(Into::into),
    };
    let (row, outcome) = state.store.update_settings(&ctx.user, &req.conv, update, now_ms()).await?;
    if let Some(hw) = outcome.written {
        state.hint_user(&ctx.user, hw);
    }
    Ok(ConvSettingsOk { conv: req.conv, muted: row.muted, pinned: row.pinned, push_preview: row.push_preview.into() })
}

pub async fn read(state: &AppState, ctx: &AuthCtx, req: ReadReq) -> ApiResult<ReadOk> {
    check_conv(&req.conv)?;
    let on = ctx.connection_epoch.map(|e| (ctx.device.as_str(), e));
    let r = state.store.mark_read_on(&ctx.user, &req.conv, req.read_to_seq, on, now_ms()).await?;
    if let Some(hw) = r.written {
        // The read cursor reaches the user's other devices as a user event (R2).
        state.hint_user(&ctx.user, hw);
    }
    Ok(ReadOk { conv: req.conv, read_seq: r.read_seq, unread: r.unread, mentions: r.mentions })
}
