//! The stored payloads the store backends write: the `content` of control
//! events (`conv.created`, `member.join`/`member.leave`, `recall`, `edit`,
//! `reaction`) and the `data` of per-user events (`read`, `settings`,
//! `delete`). They reach clients as they are stored (the `content` of a
//! control event in a sync page, the `data` of a user event), so their
//! JSON text is part of the wire: field order and names are fixed here,
//! once, for every backend.
//!
//! Each type borrows what it serializes; [`Payload::to_json`] gives the
//! stored text.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// A payload the backends store as JSON text.
pub trait Payload: Serialize {
    /// The compact JSON text, in field order.
    fn to_json(&self) -> String {
        serde_json::to_string(self).expect("strings, numbers and validated JSON always serialize")
    }
}

/// `conv.created`: `{"owner":…,"members":[…]}` (members sorted, the owner
/// among them).
#[derive(Debug, Serialize)]
pub struct GroupCreated<'a> {
    pub owner: &'a str,
    pub members: &'a [String],
}

/// `conv.mode`: `{"mode":"shared","members":…}`: from the next `msg_seq`
/// on, the group's events are read from the conversation log (G3);
/// `members` is the active member count that crossed the threshold.
#[derive(Debug, Serialize)]
pub struct ModeChanged<'a> {
    pub mode: &'a str,
    pub members: u64,
}

/// `member.join` / `member.leave`: `{"user":…,"by":…,"op":"add"|"remove"|"leave"}`.
#[derive(Debug, Serialize)]
pub struct MemberChanged<'a> {
    pub user: &'a str,
    pub by: &'a str,
    pub op: &'a str,
}

/// `recall`: `{"target_message_id":…,"target_msg_seq":…}`.
#[derive(Debug, Serialize)]
pub struct Recalled<'a> {
    pub target_message_id: &'a str,
    pub target_msg_seq: u64,
}

/// `edit`: `{"target_message_id":…,"target_msg_seq":…,"version":…,"content":…}`,
/// the new content embedded as it was given. Once its target is recalled,
/// a stored edit becomes [`EditRecalled`] ([`Edited::recalled`]).
#[derive(Debug, Serialize)]
pub struct Edited<'a> {
    pub target_message_id: &'a str,
    pub target_msg_seq: u64,
    pub version: u64,
    pub content: &'a RawValue,
}

/// Content that is not one JSON value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotJson(String);

impl std::fmt::Display for NotJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "content is not JSON: {}", self.0)
    }
}

impl std::error::Error for NotJson {}

/// A stored `edit` after its target was recalled: the content gone,
/// `{"target_message_id":…,"target_msg_seq":…,"version":…,"recalled":true}`.
#[derive(Debug, Serialize, Deserialize)]
pub struct EditRecalled {
    pub target_message_id: String,
    pub target_msg_seq: u64,
    pub version: u64,
    #[serde(default = "yes", skip_deserializing)]
    pub recalled: bool,
}

fn yes() -> bool {
    true
}

impl<'a> Edited<'a> {
    /// The stored text of an edit (or of one already recalled) once its
    /// target is recalled (E1): the content removed for good.
    pub fn recalled(stored: &str) -> Result<String, NotJson> {
        let edit: EditRecalled = serde_json::from_str(stored).map_err(|e| NotJson(e.to_string()))?;
        Ok(edit.to_json())
    }

    /// `content` must be one JSON value; it is embedded byte for byte.
    pub fn new(
        target_message_id: &'a str,
        target_msg_seq: u64,
        version: u64,
        content: &'a str,
    ) -> Result<Self, NotJson> {
        let content: &RawValue = serde_json::from_str(content).map_err(|e| NotJson(e.to_string()))?;
        Ok(Edited { target_message_id, target_msg_seq, version, content })
    }
}

/// `reaction`: `{"target_message_id":…,"target_msg_seq":…,"reaction":…,"op":"add"|"remove","user":…,"version":…}`.
#[derive(Debug, Serialize)]
pub struct Reacted<'a> {
    pub target_message_id: &'a str,
    pub target_msg_seq: u64,
    pub reaction: &'a str,
    pub op: &'a str,
    pub user: &'a str,
    pub version: u64,
}

impl<'a> Reacted<'a> {
    /// `add` is the reaction's `op`: `"add"`, else `"remove"`.
    pub fn new(
        target_message_id: &'a str,
        target_msg_seq: u64,
        reaction: &'a str,
        add: bool,
        user: &'a str,
        version: u64,
    ) -> Self {
        Reacted { target_message_id, target_msg_seq, reaction, op: if add { "add" } else { "remove" }, user, version }
    }
}

/// The `data` of a `read` user event: `{"read_seq":…,"unread":…}`.
#[derive(Debug, Serialize)]
pub struct ReadData {
    pub read_seq: u64,
    pub unread: u64,
}

/// The `data` of a `settings` user event:
/// `{"muted":…,"pinned":…,"push_preview":…,"version":…}`.
#[derive(Debug, Serialize)]
pub struct SettingsData {
    pub muted: bool,
    pub pinned: bool,
    pub push_preview: crate::push::PreviewLevel,
    pub version: u64,
}

/// The `data` of a `privacy` user event (issue 18), the user's switches
/// after a change:
/// `{"hide_presence":…,"private_receipts":…,"push_preview":…,"version":…}`.
#[derive(Debug, Serialize)]
pub struct PrivacyData {
    pub hide_presence: bool,
    pub private_receipts: bool,
    pub push_preview: crate::push::PreviewLevel,
    pub version: u64,
}

/// The `data` of a `delete` (for me) user event: `{"message_id":…,"msg_seq":…}`.
#[derive(Debug, Serialize)]
pub struct DeletedData<'a> {
    pub message_id: &'a str,
    pub msg_seq: u64,
}

impl Payload for GroupCreated<'_> {}
impl Payload for MemberChanged<'_> {}
impl Payload for ModeChanged<'_> {}
impl Payload for Recalled<'_> {}
impl Payload for Edited<'_> {}
impl Payload for Reacted<'_> {}
impl Payload for EditRecalled {}
/// `messages.mentions` (issue 18): the users a message names, a JSON
/// array of user ids (`["bob","cy"]`); NULL is stored when it names nobody.
#[derive(Debug, Serialize)]
#[serde(transparent)]
pub struct Mentions<'a>(pub &'a [String]);

impl Payload for Mentions<'_> {}

/// Reads a stored `messages.mentions` back.
pub fn parse_mentions(stored: &str) -> Result<Vec<String>, String> {
    serde_json::from_str(stored).map_err(|e| format!("stored mentions {stored}: {e}"))
}

impl Payload for ReadData {}
impl Payload for SettingsData {}
impl Payload for PrivacyData {}

impl PrivacyData {
    /// The data of the `privacy` user event that records the switches `p`
    /// at `version` (issue 18): what both backends write with the change.
    pub fn of(p: tidemark_core::ephemeral::Privacy, version: u64) -> PrivacyData {
        PrivacyData {
            hide_presence: p.hide_presence,
            private_receipts: p.private_receipts,
            push_preview: p.push_preview.into(),
            version,
        }
    }
}
impl Payload for DeletedData<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact text stored before these types existed (and parsed by the
    /// server's renderer and the SDK since).
    fn check(input: &dyn Fn() -> String, expect: &str) {
        assert_eq!(input(), expect);
    }

    #[test]
    fn payloads_keep_their_stored_text() {
        let members = vec!["a".to_string(), "b".to_string()];
        check(&|| GroupCreated { owner: "a", members: &members }.to_json(), r#"{"owner":"a","members":["a","b"]}"#);
        check(&|| MemberChanged { user: "d", by: "a", op: "add" }.to_json(), r#"{"user":"d","by":"a","op":"add"}"#);
        check(
            &|| Recalled { target_message_id: "m1", target_msg_seq: 3 }.to_json(),
            r#"{"target_message_id":"m1","target_msg_seq":3}"#,
        );
        check(
            &|| Edited::new("m1", 3, 2, r#"{"text":"new"}"#).unwrap().to_json(),
            r#"{"target_message_id":"m1","target_msg_seq":3,"version":2,"content":{"text":"new"}}"#,
        );
        check(
            &|| {
                Reacted {
                    target_message_id: "m1",
                    target_msg_seq: 3,
                    reaction: "+1",
                    op: "remove",
                    user: "b",
                    version: 4,
                }
                .to_json()
            },
            r#"{"target_message_id":"m1","target_msg_seq":3,"reaction":"+1","op":"remove","user":"b","version":4}"#,
        );
        check(&|| ReadData { read_seq: 4, unread: 0 }.to_json(), r#"{"read_seq":4,"unread":0}"#);
        check(
            &|| {
                SettingsData { muted: true, pinned: false, push_preview: crate::push::PreviewLevel::Full, version: 1 }
                    .to_json()
            },
            r#"{"muted":true,"pinned":false,"push_preview":"full","version":1}"#,
        );
        check(
            &|| Reacted::new("m1", 3, "+1", true, "b", 4).to_json(),
            r#"{"target_message_id":"m1","target_msg_seq":3,"reaction":"+1","op":"add","user":"b","version":4}"#,
        );
        check(&|| DeletedData { message_id: "m2", msg_seq: 5 }.to_json(), r#"{"message_id":"m2","msg_seq":5}"#);
    }

    #[test]
    fn strings_are_escaped_and_content_is_embedded_as_given() {
        check(
            &|| MemberChanged { user: "q\"\\\n", by: "a", op: "leave" }.to_json(),
            r#"{"user":"q\"\\\n","by":"a","op":"leave"}"#,
        );
        // Embedded byte for byte, key order and all.
        check(
            &|| Edited::new("m", 1, 2, r#"{"z":1,"a":[true,null]}"#).unwrap().to_json(),
            r#"{"target_message_id":"m","target_msg_seq":1,"version":2,"content":{"z":1,"a":[true,null]}}"#,
        );
        assert!(Edited::new("m", 1, 2, "{not json").is_err());
        let recalled = r#"{"target_message_id":"m","target_msg_seq":1,"version":2,"recalled":true}"#;
        let stored = Edited::new("m", 1, 2, r#"{"text":"x"}"#).unwrap().to_json();
        check(&|| Edited::recalled(&stored).unwrap(), recalled);
        check(&|| Edited::recalled(recalled).unwrap(), recalled);
        assert!(Edited::recalled("{}").is_err(), "not an edit payload");
        assert!(Edited::new("m", 1, 2, "{} {}").is_err());
    }
}
