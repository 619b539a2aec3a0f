//! Stored facts to wire shapes: the unified envelope (C4) and user events.
//! Recalled and deleted-for-me content is already `{}` in the store; this
//! module also drops the summary of a quote whose target was recalled, so
//! no path serves recalled content second-hand (E1).
//!
//! A sync page's events ([`user_event`]) keep the stored JSON text as it
//! is ([`RawJson`]): it is checked to be JSON and spliced into the reply
//! verbatim, not parsed into a value and serialised again. Only a quote
//! whose target was recalled rewrites its content.

use serde_json::value::RawValue;
use serde_json::Value;
use tidemark_core::kinds::{STATE_DELETED, STATE_RECALLED};
use tidemark_proto::{Envelope, ErrorCode, RawJson, UserEvent};
use tidemark_store::{StoredEvent, StoredMessage};

use crate::error::{ApiError, ApiResult};

fn invalid(e: serde_json::Error) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("stored JSON is invalid: {e}"))
}

fn json(s: &str) -> ApiResult<Value> {
    serde_json::from_str(s).map_err(invalid)
}

fn raw(s: String) -> ApiResult<RawJson> {
    RawValue::from_string(s).map_err(invalid)
}

/// The content as it goes out: the quote of a recalled message says so
/// instead of carrying its summary.
fn rendered_content(m: &StoredMessage) -> ApiResult<Option<Value>> {
    let Some((quoted, true)) = &m.quote else { return Ok(None) };
    let mut content = json(&m.content)?;
    if let Some(obj) = content.as_object_mut() {
        obj.insert("quote".into(), serde_json::json!({"message_id": quoted, "recalled": true}));
    }
    Ok(Some(content))
}

fn envelope_with<C>(m: StoredMessage, content: C) -> Envelope<C> {
    // A wiped message (recalled, or deleted for this reader) shows its
    // mentions no more than its content.
    let wiped = m.state == STATE_RECALLED || m.state == STATE_DELETED;
    Envelope {
        message_id: m.message_id,
        conv: m.conv,
        msg_seq: m.msg_seq,
        kind: m.kind,
        state: m.state,
        sender: m.sender,
        content,
        created_at: m.created_at_ms,
        version: m.version,
        reactions: m.reactions.into_iter().collect(),
        mentions: if wiped { Vec::new() } else { m.mentions },
        mention_all: m.mention_all && !wiped,
    }
}

pub fn envelope(m: StoredMessage) -> ApiResult<Envelope> {
    let content = match rendered_content(&m)? {
        Some(c) => c,
        None => json(&m.content)?,
    };
    Ok(envelope_with(m, content))
}

/// [`envelope`] with the stored content text kept verbatim.
pub fn envelope_raw(mut m: StoredMessage) -> ApiResult<Envelope<RawJson>> {
    let content = match rendered_content(&m)? {
        Some(c) => serde_json::value::to_raw_value(&c).map_err(invalid)?,
        None => raw(std::mem::take(&mut m.content))?,
    };
    Ok(envelope_with(m, content))
}

pub fn user_event(e: StoredEvent) -> ApiResult<UserEvent<RawJson>> {
    Ok(UserEvent {
        sync_seq: e.sync_seq,
        kind: e.kind,
        conv: e.conv,
        msg_seq: e.msg_seq,
        message: e.message.map(envelope_raw).transpose()?,
        data: e.data.map(raw).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_store::StoredMessage;

    fn message(content: &str, quote: Option<(&str, bool)>) -> StoredMessage {
        StoredMessage {
            message_id: "m2".into(),
            conv: "c1".into(),
            msg_seq: 2,
            kind: "text".into(),
            state: "normal".into(),
            sender: "ann".into(),
            content: content.into(),
            created_at_ms: 9,
            version: 3,
            quote: quote.map(|(q, r)| (q.to_owned(), r)),
            reactions: vec![("+1".into(), vec!["ben".into(), "cat".into()])],
            mentions: vec!["ben".into()],
            mention_all: false,
        }
    }

    /// Verbatim and parsed rendering are the same JSON, recalled quotes
    /// included.
    #[test]
    fn raw_rendering_is_the_same_json_as_parsed() {
        let cases = [
            (r#"{"text":"hi"}"#, None),
            (r#"{"text":"re","quote":{"message_id":"m1","summary":"old"}}"#, Some(("m1", false))),
            (r#"{"text":"re","quote":{"message_id":"m1","summary":"gone"}}"#, Some(("m1", true))),
            ("{}", None),
        ];
        for (content, quote) in cases {
            let m = message(content, quote);
            let raw = serde_json::to_value(envelope_raw(m.clone()).unwrap()).unwrap();
            let parsed = serde_json::to_value(envelope(m).unwrap()).unwrap();
            assert_eq!(raw, parsed, "{content}");
        }
        let recalled = serde_json::to_value(envelope_raw(message(cases[2].0, cases[2].1)).unwrap()).unwrap();
        assert_eq!(recalled["content"]["quote"], serde_json::json!({"message_id": "m1", "recalled": true}));
        assert!(envelope_raw(message("{not json", None)).is_err(), "invalid stored JSON is an internal error");
    }
}
