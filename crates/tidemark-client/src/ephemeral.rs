//! The SDK side of the ephemeral lane and of receipts shown to others
//! (issue 18): calls to send typing, set presence and privacy, and query
//! read and delivery receipts; and the [`Change`] values incoming `typing`
//! and `presence` frames become. Nothing here touches the local store:
//! typing and presence are never stored, and receipts are answered by the
//! server on request.

use tidemark_proto::push::PreviewLevel;
use tidemark_proto::{
    op, ConvReceiptsOk, ConvReceiptsReq, DeliveryReceiptsOk, DeliveryReceiptsReq, PresenceFrame, PresenceSetOk,
    PresenceSetReq, PrivacyOk, PrivacySetReq, TypingFrame, TypingOk, TypingReq,
};

use crate::client::Client;
use crate::types::{Change, SdkError};

/// What others may be shown of this device's user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PresenceState {
    Online,
    Idle,
}

impl PresenceState {
    fn as_str(self) -> &'static str {
        match self {
            PresenceState::Online => tidemark_proto::presence_state::ONLINE,
            PresenceState::Idle => tidemark_proto::presence_state::IDLE,
        }
    }
}

pub(crate) fn typing_change(t: TypingFrame) -> Change {
    Change::Typing { conv: t.conv, user: t.user, typing: t.typing, timeout_ms: t.timeout_ms }
}

pub(crate) fn presence_change(p: PresenceFrame) -> Change {
    Change::Presence { user: p.user, state: p.state, last_seen: p.last_seen }
}

impl Client {
    /// Tells the other current members of `conv` that this user is typing
    /// (`true`, for `timeout_ms` or the server's default, renew it while
    /// typing) or stopped. Needs the connection; rate-limited.
    pub async fn typing(&self, conv: &str, typing: bool, timeout_ms: Option<u64>) -> Result<TypingOk, SdkError> {
        self.request(op::TYPING, &TypingReq { conv: conv.into(), typing, timeout_ms }).await
    }

    /// Sets this connection online or idle; the reply says what others now
    /// see (`offline` while presence is hidden). A new connection starts
    /// online; closing it counts as leaving.
    pub async fn set_presence(&self, state: PresenceState) -> Result<PresenceSetOk, SdkError> {
        self.request(op::PRESENCE_SET, &PresenceSetReq { state: state.as_str().into() }).await
    }

    /// Updates the user's privacy switches (`None` keeps one) and returns
    /// them: `hide_presence` shows the user offline to everyone,
    /// `private_receipts` hides the user's read positions from others.
    pub async fn set_privacy(
        &self,
        hide_presence: Option<bool>,
        private_receipts: Option<bool>,
    ) -> Result<PrivacyOk, SdkError> {
        self.request(op::PRIVACY_SET, &PrivacySetReq { hide_presence, private_receipts, push_preview: None }).await
    }

    /// Sets the user's own offline push preview preference (P4): it narrows
    /// what every device and conversation allows; `Full` narrows nothing.
    pub async fn set_push_preview(&self, preview: PreviewLevel) -> Result<PrivacyOk, SdkError> {
        let req = PrivacySetReq { push_preview: Some(preview), ..PrivacySetReq::default() };
        self.request(op::PRIVACY_SET, &req).await
    }

    /// The read positions of `conv`'s current members, minus private ones
    /// (counted in `hidden`); with `msg_seq`, how many of them read it.
    pub async fn conv_receipts(&self, conv: &str, msg_seq: Option<u64>) -> Result<ConvReceiptsOk, SdkError> {
        self.request(op::CONV_RECEIPTS, &ConvReceiptsReq { conv: conv.into(), msg_seq }).await
    }

    /// When the peer of a direct conversation first received each of this
    /// user's messages `message_ids` (at most 500).
    pub async fn delivery_receipts(
        &self,
        conv: &str,
        message_ids: Vec<String>,
    ) -> Result<DeliveryReceiptsOk, SdkError> {
        self.request(op::DELIVERY_RECEIPTS, &DeliveryReceiptsReq { conv: conv.into(), message_ids }).await
    }
}
