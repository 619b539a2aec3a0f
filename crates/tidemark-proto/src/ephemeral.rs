//! Wire shapes of the ephemeral lane and of receipts shown to others
//! (issue 18, docs/protocol.md §3.26–3.30 and §4.3–4.4): the `typing`,
//! `presence.set`, `privacy.set`, `conv.receipts` and `delivery.receipts`
//! operations, and the `typing` and `presence` server frames (variants of
//! [`crate::ServerFrame`]). Typing and presence never enter a sync log.

use serde::{Deserialize, Serialize};

use crate::whole;

/// The presence states on the wire.
pub mod presence_state {
    pub const ONLINE: &str = "online";
    pub const IDLE: &str = "idle";
    pub const OFFLINE: &str = "offline";
}

#[cfg(feature = "openapi")]
mod schema {
    use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
    use utoipa::openapi::RefOr;

    use super::presence_state::*;

    /// What a device may say of itself: online or idle.
    pub fn settable_state() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some([ONLINE, IDLE]))
            .description(Some("this connection's presence"))
            .into()
    }

    /// What others are shown.
    pub fn state() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some([ONLINE, IDLE, OFFLINE]))
            .description(Some("the user's presence as others see it"))
            .into()
    }

    pub fn typing_timeout() -> RefOr<Schema> {
        use tidemark_core::ephemeral::*;
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(0))
            .default(Some(TYPING_TIMEOUT_DEFAULT_MS.into()))
            .description(Some(format!(
                "milliseconds; cut to {TYPING_TIMEOUT_MIN_MS}..={TYPING_TIMEOUT_MAX_MS} (or the server's lower bound)"
            )))
            .into()
    }
}

/// `typing`: start (`typing: true`) or stop typing in a conversation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TypingReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::openapi::conv))]
    pub conv: String,
    pub typing: bool,
    /// How long the start holds without a renewal.
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = schema::typing_timeout))]
    pub timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TypingOk {
    pub conv: String,
    pub typing: bool,
    /// The timeout the server applies (0 for a stop).
    pub timeout_ms: u64,
}

/// `presence.set`: this connection is online or idle.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PresenceSetReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = schema::settable_state))]
    pub state: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PresenceSetOk {
    /// The user's presence as others now see it (`offline` while hidden).
    #[cfg_attr(feature = "openapi", schema(schema_with = schema::state))]
    pub state: String,
    pub hidden: bool,
}

/// `privacy.set`: the caller's privacy switches (absent: unchanged; an
/// empty body reads them).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PrivacySetReq {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hide_presence: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_receipts: Option<bool>,
    /// The user's offline push preview preference (P4): it narrows what
    /// every device and conversation allows. Default `full`, which narrows
    /// nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push_preview: Option<crate::push::PreviewLevel>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PrivacyOk {
    pub hide_presence: bool,
    pub private_receipts: bool,
    pub push_preview: crate::push::PreviewLevel,
}

/// `conv.receipts`: the read positions of a conversation's members.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvReceiptsReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::openapi::conv))]
    pub conv: String,
    /// With it, the reply counts the members shown who read this `msg_seq`.
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    pub msg_seq: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MemberReceipt {
    pub user: String,
    pub read_seq: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvReceiptsOk {
    pub conv: String,
    /// Current members shown, by user (the caller included).
    pub members: Vec<MemberReceipt>,
    /// Current members whose read receipts are private.
    pub hidden: u64,
    /// With `msg_seq`: members shown, the caller excluded, whose `read_seq`
    /// reaches it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_count: Option<u64>,
    /// More members were shown than one reply lists.
    pub truncated: bool,
}

/// `delivery.receipts`: deliveries of the caller's own messages in a
/// direct conversation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryReceiptsReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::openapi::conv))]
    pub conv: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::openapi::message_ids))]
    pub message_ids: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryReceipt {
    pub message_id: String,
    /// When a device of the peer first recorded it (`delivery.ack`);
    /// absent while none has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_at: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryReceiptsOk {
    pub conv: String,
    /// In the order asked.
    pub receipts: Vec<DeliveryReceipt>,
}

/// Server frame `typing`: `user` started (`typing: true`, shown for
/// `timeout_ms` unless renewed) or stopped typing in `conv`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TypingFrame {
    pub conv: String,
    pub user: String,
    pub typing: bool,
    #[serde(default)]
    pub timeout_ms: u64,
}

/// Server frame `presence`: `user` is now `state`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PresenceFrame {
    pub user: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = schema::state))]
    pub state: String,
    /// For `idle` and `offline`: when the user was last active (ms since
    /// the epoch, server clock); absent when unknown or hidden.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<i64>,
}

/// Server frame `presence.batch`: `presence` entries (each exactly the
/// fields of a [`PresenceFrame`]) for a connection that opted in; a client
/// applies them in order as it would that many `presence` frames. At most
/// [`tidemark_core::ephemeral::PRESENCE_BATCH_ENTRIES_MAX`] entries and
/// [`crate::FRAME_BYTES_MAX`] bytes of JSON a frame; more go in further
/// frames.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PresenceBatchFrame {
    pub presence: Vec<PresenceFrame>,
}

/// The text of a `presence.batch` frame around its entries: the bytes a
/// frame costs besides its entries' [`presence_fields`] and the comma and
/// `{` each entry adds (the `overhead` of
/// [`tidemark_core::ephemeral::presence_batches`]).
pub const PRESENCE_BATCH_FRAME_OVERHEAD: usize = PRESENCE_BATCH_HEAD.len() + PRESENCE_BATCH_TAIL.len();
/// Bytes one entry costs in a batch besides its [`presence_fields`]: its
/// opening `{`.
pub const PRESENCE_BATCH_ENTRY_OVERHEAD: usize = 1;
const PRESENCE_BATCH_HEAD: &str = r#"{"t":"presence.batch","presence":["#;
const PRESENCE_BATCH_TAIL: &str = "]}";
/// How a `presence` frame's text begins: the internally tagged
/// [`crate::ServerFrame`] writes its tag first.
const PRESENCE_FRAME_HEAD: &str = r#"{"t":"presence","#;

/// The fields of a `presence` frame's text after its tag (`"user":…}`),
/// which a `presence.batch` splices in as one entry, so an entry costs no
/// serialisation or copy beyond the frame's own (shared by every
/// receiver); `None` for the text of another frame.
pub fn presence_fields(frame_text: &str) -> Option<&str> {
    frame_text.strip_prefix(PRESENCE_FRAME_HEAD)
}

/// A `presence.batch` frame's text from its entries' [`presence_fields`],
/// spliced in verbatim: the same JSON as serialising
/// `ServerFrame::PresenceBatch` of those entries.
pub fn presence_batch_text<'a>(fields: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = String::from(PRESENCE_BATCH_HEAD);
    for (i, f) in fields.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('{');
        out.push_str(f);
    }
    out.push_str(PRESENCE_BATCH_TAIL);
    out
}

/// What an ephemeral signal carries between nodes (cluster mode), inside a
/// [`crate::BusHint`]: the frame for the users `to` on whichever node holds
/// their connections.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BusEphemeral {
    pub to: Vec<String>,
    /// Absent for a probe alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame: Option<crate::ServerFrame>,
    /// A connection of the hint's `user` just opened: each receiver that is
    /// online or idle (and not hidden) answers with its own presence.
    #[serde(default)]
    pub answer: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ServerFrame;

    fn entry(user: &str, state: &str, last_seen: Option<i64>) -> PresenceFrame {
        PresenceFrame { user: user.into(), state: state.into(), last_seen }
    }

    /// The spliced text is the typed frame's JSON, and parses back to it;
    /// the overhead is what the frame costs besides its entries.
    #[test]
    fn presence_batch_text_is_the_typed_frame_spliced() {
        for entries in [
            vec![],
            vec![entry("ann", "online", None)],
            vec![
                entry("ann", "online", None),
                entry("b\"en\u{e9}", "idle", Some(5)),
                entry("cat", "offline", Some(-1)),
            ],
        ] {
            let texts: Vec<String> =
                entries.iter().map(|e| serde_json::to_string(&ServerFrame::Presence(e.clone())).unwrap()).collect();
            let fields: Vec<&str> = texts.iter().map(|t| presence_fields(t).expect("a presence frame")).collect();
            let spliced = presence_batch_text(fields.iter().copied());
            let frame = ServerFrame::PresenceBatch(PresenceBatchFrame { presence: entries.clone() });
            assert_eq!(spliced, serde_json::to_string(&frame).unwrap());
            assert_eq!(serde_json::from_str::<ServerFrame>(&spliced).unwrap(), frame);
            let commas = fields.len().saturating_sub(1);
            let entry_bytes: usize = fields.iter().map(|f| f.len() + PRESENCE_BATCH_ENTRY_OVERHEAD).sum();
            assert_eq!(spliced.len(), PRESENCE_BATCH_FRAME_OVERHEAD + entry_bytes + commas);
        }
        let typing =
            ServerFrame::Typing(TypingFrame { conv: "c".into(), user: "u".into(), typing: true, timeout_ms: 1 });
        assert_eq!(presence_fields(&serde_json::to_string(&typing).unwrap()), None);
        let v =
            serde_json::json!({"t": "presence.batch", "presence": [{"user": "ann", "state": "idle", "last_seen": 3}]});
        assert_eq!(
            serde_json::from_value::<ServerFrame>(v).unwrap(),
            ServerFrame::PresenceBatch(PresenceBatchFrame { presence: vec![entry("ann", "idle", Some(3))] })
        );
    }

    /// Opting in is optional in both places: old clients send neither.
    #[test]
    fn opting_in_is_an_optional_field() {
        let old: crate::AuthReq = serde_json::from_str(r#"{"token":"x"}"#).unwrap();
        assert_eq!(old.presence_batch, None);
        assert_eq!(serde_json::to_string(&old).unwrap(), r#"{"token":"x"}"#);
        let new: crate::AuthReq = serde_json::from_str(r#"{"token":"x","presence_batch":true}"#).unwrap();
        assert_eq!(new.presence_batch, Some(true));
        let q: crate::WsQuery = serde_json::from_str("{}").unwrap();
        assert_eq!(q.presence_batch, None);
    }
}
