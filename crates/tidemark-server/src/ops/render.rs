//! Stored facts to wire shapes: the unified envelope (C4) and user events.
//! Recalled and deleted-for-me content is already `{}` in the store; this
//! module also drops the summary of a quote whose target was recalled, so
//! no path serves recalled content second-hand (E1).

use serde_json::Value;
use tidemark_proto::{Envelope, ErrorCode, UserEvent};
use tidemark_store::{StoredEvent, StoredMessage};

use crate::error::{ApiError, ApiResult};

fn json(s: &str) -> ApiResult<Value> {
    serde_json::from_str(s).map_err(|e| ApiError::new(ErrorCode::Internal, format!("stored JSON is invalid: {e}")))
}

pub fn envelope(m: StoredMessage) -> ApiResult<Envelope> {
    let mut content = json(&m.content)?;
    if let (Some((quoted, true)), Some(obj)) = (&m.quote, content.as_object_mut()) {
        obj.insert("quote".into(), serde_json::json!({"message_id": quoted, "recalled": true}));
    }
    Ok(Envelope {
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
    })
}

pub fn user_event(e: StoredEvent) -> ApiResult<UserEvent> {
    Ok(UserEvent {
        sync_seq: e.sync_seq,
        kind: e.kind,
        conv: e.conv,
        msg_seq: e.msg_seq,
        message: e.message.map(envelope).transpose()?,
        data: e.data.as_deref().map(json).transpose()?,
    })
}
