//! The SDK's calls for what a user's device does beyond sending, recalling,
//! reading and syncing: history paging (C3), groups and their member
//! lists (G1), edits and
//! reactions (E2), conversation settings and delete-for-me (E3), delivery
//! receipts (R1), the device list, device revocation (P5) and password
//! changes (P1).
//!
//! Each call needs the connection: it goes to the engine as one request
//! on the live WebSocket and answers [`SdkError::Offline`] when there is
//! none (the outbox, for sends, recalls and reads, is what works offline).
//! A refusal comes back as [`SdkError::Refused`] with the contract's code
//! (`NOT_MEMBER`, `FORBIDDEN`, `CONFLICT`, `NOT_FOUND`, `BAD_REQUEST`…, see
//! docs/protocol.md §3). Facts the call creates (a membership event, an
//! edit, a reaction, a settings or delete event) reach this device like
//! every other event, through the user log; only `history` writes the
//! local store directly, and it moves no cursor.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tidemark_proto::push::{
    PreviewLevel, PushListOk, PushRegisterOk, PushRegisterReq, PushRemoveOk, PushRemoveReq, PushTargetInfo,
};
use tidemark_proto::{
    op, AccountPasswordOk, AccountPasswordReq, ConvCreateOk, ConvCreateReq, ConvMember, ConvMemberOk, ConvMemberReq,
    ConvMembersOk, ConvMembersReq, ConvSettingsOk, ConvSettingsReq, DeliveryAckOk, DeliveryAckReq, DeviceInfo,
    DeviceListOk, DeviceRevokeOk, DeviceRevokeReq, EditOk, EditReq, HistoryOk, HistoryReq, MessageDeleteReq, ReactOk,
    ReactReq, CONV_MEMBERS_LIMIT_MAX, HISTORY_LIMIT_MAX,
};
use tokio::sync::oneshot;

use crate::client::Client;
use crate::engine::Command;
use crate::store::{message_of_envelope, Message};
use crate::types::SdkError;

/// One page of a conversation's history, newest first.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryPage {
    pub messages: Vec<Message>,
    /// `before_seq` of the next (older) page; `None` at the end.
    pub next_cursor: Option<u64>,
    pub has_more: bool,
    /// The lowest `msg_seq` the server retains for this conversation (L3).
    pub history_start: u64,
    /// The page stopped at the retention boundary: older history of the
    /// user's view existed and was removed by the server's policy.
    pub trimmed: bool,
    /// Answered from the local store (which held the page whole); then
    /// `history_start` is 0 and `trimmed` false: the server was not asked.
    pub local: bool,
}

/// One page of a conversation's current members, by user id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembersPage {
    /// `{user, joined_seq}`: the `msg_seq` each member's period opened at.
    pub members: Vec<ConvMember>,
    /// The group's owner (who removes members); `None` for a direct
    /// conversation.
    pub owner: Option<String>,
    /// The `msg_seq` of the last membership change: two pages with a
    /// different one were read across a change; page again from `None`
    /// for an exact list.
    pub members_seq: u64,
    /// `after` of the next page; `None` at the end.
    pub next_after: Option<String>,
}

fn new_key() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn encode<B: Serialize>(body: &B) -> Result<Value, SdkError> {
    serde_json::to_value(body).map_err(|e| SdkError::Invalid(e.to_string()))
}

impl Client {
    /// Sends `op` with `body` on the connection and parses the reply.
    pub(crate) async fn request<B: Serialize, T: DeserializeOwned>(
        &self,
        op: &'static str,
        body: &B,
    ) -> Result<T, SdkError> {
        let (reply, rx) = oneshot::channel();
        let value = self.command(Command::Request { op, body: encode(body)?, reply }, rx).await?;
        serde_json::from_value(value).map_err(|e| SdkError::Invalid(format!("{op} reply: {e}")))
    }

    /// Pages back through `conv`'s history (C3): the `limit` (1..=50)
    /// messages before `before_seq` (or the newest, when `None`), newest
    /// first, within the user's membership periods, recalled ones as
    /// placeholders. Local first: a page the local store holds whole is
    /// answered from it (offline too); otherwise the server's page is
    /// stored locally in one transaction, moving no cursor. Follow
    /// `next_cursor` while `has_more`; `trimmed` says the server's
    /// retention removed what lies below `history_start`.
    pub async fn history(&self, conv: &str, before_seq: Option<u64>, limit: u32) -> Result<HistoryPage, SdkError> {
        if !(1..=HISTORY_LIMIT_MAX).contains(&limit) {
            return Err(SdkError::Invalid(format!("limit must be 1..={HISTORY_LIMIT_MAX}")));
        }
        let c = conv.to_owned();
        if let Some(local) = self.inner.db(move |s, _| s.local_history(&c, before_seq, limit)).await? {
            let next_cursor = local.messages.last().map(|m| m.msg_seq).filter(|_| local.has_more);
            return Ok(HistoryPage {
                has_more: next_cursor.is_some(),
                next_cursor,
                messages: local.messages,
                history_start: 0,
                trimmed: false,
                local: true,
            });
        }
        let req = HistoryReq { conv: conv.to_owned(), before_seq, limit: Some(limit) };
        let page: HistoryOk = self.request(op::HISTORY, &req).await?;
        let covered_to = match page.messages.last() {
            Some(oldest) if page.has_more => oldest.msg_seq,
            _ => page.history_start.max(1),
        };
        let (c, envelopes) = (conv.to_owned(), page.messages.clone());
        self.inner.db(move |s, _| s.store_history(&c, before_seq, covered_to, &envelopes)).await?;
        self.inner.committed();
        Ok(HistoryPage {
            messages: page.messages.iter().map(message_of_envelope).collect(),
            next_cursor: page.next_cursor,
            has_more: page.has_more,
            history_start: page.history_start,
            trimmed: page.trimmed,
            local: false,
        })
    }

    /// Opens `conv` (G2's slow path): pulls it with `conv.sync` from this
    /// device's position up to the server's authoritative head, whatever
    /// its marker says or whether a hint was lost, and commits it locally
    /// in one transaction; returns the conversation as now held. Call it
    /// when the app shows a conversation, and on foreground.
    pub async fn open_conversation(&self, conv: &str) -> Result<crate::store::Conversation, SdkError> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::Pull { conv: conv.to_owned(), reply }, rx).await?;
        let c = conv.to_owned();
        self.inner
            .db(move |s, _| s.conversation(&c))
            .await?
            .ok_or_else(|| SdkError::Invalid(format!("conversation {conv} is not held")))
    }

    /// Creates a group with `members` (the caller is its owner and a member
    /// whether listed or not). One idempotency key per call.
    pub async fn create_group(&self, members: &[&str]) -> Result<ConvCreateOk, SdkError> {
        let req = ConvCreateReq {
            kind: "group".into(),
            members: members.iter().map(|m| (*m).to_owned()).collect(),
            client_msg_id: Some(new_key()),
        };
        let ok: ConvCreateOk = self.request(op::CONV_CREATE, &req).await?;
        let (conv, kind) = (ok.conv.clone(), ok.kind.clone());
        self.inner.db(move |s, _| s.ensure_conversation(&conv, &kind)).await?;
        self.inner.committed();
        Ok(ok)
    }

    async fn membership(&self, op: &'static str, conv: &str, user: Option<&str>) -> Result<u64, SdkError> {
        let req =
            ConvMemberReq { conv: conv.to_owned(), user: user.map(str::to_owned), client_msg_id: Some(new_key()) };
        let ok: ConvMemberOk = self.request(op, &req).await?;
        Ok(ok.msg_seq)
    }

    /// Adds `user` to the group; returns the join event's `msg_seq`.
    pub async fn add_member(&self, conv: &str, user: &str) -> Result<u64, SdkError> {
        self.membership(op::CONV_ADD, conv, Some(user)).await
    }

    /// Removes `user` from the group (the owner's right); returns the leave
    /// event's `msg_seq`.
    pub async fn remove_member(&self, conv: &str, user: &str) -> Result<u64, SdkError> {
        self.membership(op::CONV_REMOVE, conv, Some(user)).await
    }

    /// Leaves the group; its history up to the leave stays readable.
    pub async fn leave(&self, conv: &str) -> Result<u64, SdkError> {
        self.membership(op::CONV_LEAVE, conv, None).await
    }

    /// One page of `conv`'s current members (`conv.members`), by user id
    /// after `after` (`None` for the first page, then the previous page's
    /// `next_after`), at most `limit` (1..=500); each with the `msg_seq`
    /// they joined at. Asks the server (the local store holds membership
    /// as events, not as a list). Refused `NOT_MEMBER` unless the user is a
    /// current member, `NOT_FOUND` for an unknown conversation;
    /// [`SdkError::Invalid`] for a `limit` out of range.
    pub async fn members(&self, conv: &str, after: Option<&str>, limit: u32) -> Result<MembersPage, SdkError> {
        if !(1..=CONV_MEMBERS_LIMIT_MAX).contains(&limit) {
            return Err(SdkError::Invalid(format!("limit must be 1..={CONV_MEMBERS_LIMIT_MAX}")));
        }
        let req = ConvMembersReq { conv: conv.to_owned(), after: after.map(str::to_owned), limit: Some(limit) };
        let ok: ConvMembersOk = self.request(op::CONV_MEMBERS, &req).await?;
        Ok(MembersPage { members: ok.members, owner: ok.owner, members_seq: ok.members_seq, next_after: ok.next_after })
    }

    /// Replaces the content of one of the user's messages (E2): a CAS on
    /// `base_version` (the version this device holds); `CONFLICT` when the
    /// server's is newer, and the newer version arrives through sync.
    pub async fn edit(
        &self,
        conv: &str,
        message_id: &str,
        content: Value,
        base_version: u64,
    ) -> Result<EditOk, SdkError> {
        let req = EditReq {
            conv: conv.to_owned(),
            message_id: message_id.to_owned(),
            content,
            base_version,
            client_msg_id: Some(new_key()),
        };
        self.request(op::EDIT, &req).await
    }

    /// Adds (or with `add == false` removes) the user's `reaction` to a
    /// message; idempotent: `changed` is false when nothing moved.
    pub async fn react(&self, conv: &str, message_id: &str, reaction: &str, add: bool) -> Result<ReactOk, SdkError> {
        let req = ReactReq {
            conv: conv.to_owned(),
            message_id: message_id.to_owned(),
            reaction: reaction.to_owned(),
            op: if add { "add" } else { "remove" }.to_owned(),
            client_msg_id: Some(new_key()),
        };
        self.request(op::REACT, &req).await
    }

    /// Changes the user's settings of `conv` (E3); `None` leaves one as it
    /// is. The user's other devices learn it from a `settings` event.
    pub async fn set_conversation_settings(
        &self,
        conv: &str,
        muted: Option<bool>,
        pinned: Option<bool>,
    ) -> Result<ConvSettingsOk, SdkError> {
        let req = ConvSettingsReq { conv: conv.to_owned(), muted, pinned, push_preview: None };
        self.request(op::CONV_SETTINGS, &req).await
    }

    /// Sets what an offline push of `conv` may say (P4): the most private
    /// of this, the user's preference ([`Client::set_push_preview`]) and
    /// the device's registered level wins; `Full` narrows nothing.
    pub async fn set_conversation_push_preview(
        &self,
        conv: &str,
        preview: PreviewLevel,
    ) -> Result<ConvSettingsOk, SdkError> {
        let req = ConvSettingsReq { conv: conv.to_owned(), muted: None, pinned: None, push_preview: Some(preview) };
        self.request(op::CONV_SETTINGS, &req).await
    }

    /// Deletes a message for this user only (E3): a `delete` event hides it
    /// on the user's devices; the other members keep it.
    pub async fn delete_for_me(&self, conv: &str, message_id: &str) -> Result<(), SdkError> {
        let req = MessageDeleteReq { conv: conv.to_owned(), message_id: message_id.to_owned() };
        let _: Value = self.request(op::MESSAGE_DELETE, &req).await?;
        Ok(())
    }

    /// Tells the server this device holds these messages (R1: a delivery
    /// receipt, neither a sync ACK nor a read).
    pub async fn delivery_ack(&self, message_ids: &[String]) -> Result<DeliveryAckOk, SdkError> {
        self.request(op::DELIVERY_ACK, &DeliveryAckReq { message_ids: message_ids.to_vec() }).await
    }

    /// Revokes one of the user's devices (P5): its connections end and every
    /// later operation of it is refused. Revoking this device ends this
    /// client (`DEVICE_REVOKED`).
    pub async fn revoke_device(&self, device_id: &str) -> Result<DeviceRevokeOk, SdkError> {
        self.request(op::DEVICE_REVOKE, &DeviceRevokeReq { device_id: device_id.to_owned() }).await
    }

    /// Every device of the user (id, name, first login, last seen, state),
    /// this one marked `current`: what the user picks from to revoke one.
    pub async fn devices(&self) -> Result<Vec<DeviceInfo>, SdkError> {
        let ok: DeviceListOk = self.request(op::DEVICE_LIST, &serde_json::json!({})).await?;
        Ok(ok.devices)
    }

    /// Changes the user's password (P1); the user's other devices can no
    /// longer refresh their tokens and log in again when theirs expire.
    /// `UNAUTHENTICATED` for a wrong `old_password`.
    pub async fn change_password(&self, old_password: &str, new_password: &str) -> Result<(), SdkError> {
        let req = AccountPasswordReq { old_password: old_password.to_owned(), new_password: new_password.to_owned() };
        let _: AccountPasswordOk = self.request(op::ACCOUNT_PASSWORD, &req).await?;
        Ok(())
    }

    /// Sets (or replaces) this device's offline push target (P4): the
    /// provider platform (`tidemark_proto::push::platform`), the provider's
    /// token or Web Push endpoint with its keys, and how much a
    /// notification may say. The reply shows the token as a hash and its
    /// last four characters only.
    pub async fn register_push(&self, req: PushRegisterReq) -> Result<PushTargetInfo, SdkError> {
        let ok: PushRegisterOk = self.request(op::PUSH_REGISTER, &req).await?;
        Ok(ok.target)
    }

    /// The push targets of the user's devices, this one marked `current`.
    pub async fn push_targets(&self) -> Result<Vec<PushTargetInfo>, SdkError> {
        let ok: PushListOk = self.request(op::PUSH_LIST, &serde_json::json!({})).await?;
        Ok(ok.targets)
    }

    /// Removes the push target of `device_id` (this device's if `None`);
    /// false if it had none.
    pub async fn remove_push(&self, device_id: Option<&str>) -> Result<bool, SdkError> {
        let ok: PushRemoveOk =
            self.request(op::PUSH_REMOVE, &PushRemoveReq { device_id: device_id.map(str::to_owned) }).await?;
        Ok(ok.removed)
    }
}
