//! The names the rules speak in: conversation kinds, conversation event
//! kinds, user-log event kinds, message states and snapshot states. They are
//! stored as text by every backend; `tidemark-store` re-exports them.

/// Conversation kinds.
pub const CONV_DIRECT: &str = "direct";
pub const CONV_GROUP: &str = "group";

/// Message states.
pub const STATE_NORMAL: &str = "normal";
pub const STATE_EDITED: &str = "edited";
pub const STATE_RECALLED: &str = "recalled";
pub const STATE_DELETED: &str = "deleted";
/// Below the conversation's retention boundary: content removed (L3).
pub const STATE_EXPIRED: &str = "expired";

/// Conversation event kinds that are not user content: they take a
/// `msg_seq` like messages but never count as unread.
pub const KIND_CREATED: &str = "conv.created";
pub const KIND_JOIN: &str = "member.join";
pub const KIND_LEAVE: &str = "member.leave";
pub const KIND_RECALL: &str = "recall";
pub const KIND_EDIT: &str = "edit";
pub const KIND_REACTION: &str = "reaction";
/// A group switched to shared mode at this event's `msg_seq` (G3).
pub const KIND_MODE: &str = "conv.mode";
pub const CONTROL_KINDS: &[&str] =
    &[KIND_CREATED, KIND_JOIN, KIND_LEAVE, KIND_RECALL, KIND_EDIT, KIND_REACTION, KIND_MODE];

pub fn is_control_kind(kind: &str) -> bool {
    CONTROL_KINDS.contains(&kind)
}

/// Event kinds of the user sync log. Conversation events fan out as
/// `message` (user content), `membership`, `recall`, `edit`, `reaction`;
/// per-user events are written straight into one user's log.
pub const EVENT_MESSAGE: &str = "message";
pub const EVENT_MEMBERSHIP: &str = "membership";
pub const EVENT_RECALL: &str = "recall";
pub const EVENT_EDIT: &str = "edit";
pub const EVENT_REACTION: &str = "reaction";
pub const EVENT_READ: &str = "read";
pub const EVENT_SETTINGS: &str = "settings";
pub const EVENT_DELETE: &str = "delete";
/// A change of the user's privacy switches (issue 18), written into the
/// user's own log so the user's other devices learn it; its `conv` is
/// empty (it belongs to no conversation).
pub const EVENT_PRIVACY: &str = "privacy";
/// The switch of a group to shared mode: later events are read from the
/// conversation log (G3).
pub const EVENT_MODE: &str = "mode";

/// The user-log event kind of a conversation event kind.
pub fn event_kind_of(kind: &str) -> &'static str {
    match kind {
        KIND_CREATED | KIND_JOIN | KIND_LEAVE => EVENT_MEMBERSHIP,
        KIND_RECALL => EVENT_RECALL,
        KIND_EDIT => EVENT_EDIT,
        KIND_REACTION => EVENT_REACTION,
        KIND_MODE => EVENT_MODE,
        _ => EVENT_MESSAGE,
    }
}

/// Snapshot states (D7).
pub const SNAPSHOT_BUILDING: &str = "BUILDING";
pub const SNAPSHOT_READY: &str = "READY";
pub const SNAPSHOT_INSTALLED: &str = "INSTALLED";

#[cfg(test)]
mod tests {
    use super::*;

    fn check(kind: &str, expect: (bool, &str)) {
        assert_eq!((is_control_kind(kind), event_kind_of(kind)), expect, "{kind}");
    }

    #[test]
    fn kinds_fan_out_as_their_user_event() {
        check("text", (false, EVENT_MESSAGE));
        check("image", (false, EVENT_MESSAGE));
        check(KIND_CREATED, (true, EVENT_MEMBERSHIP));
        check(KIND_JOIN, (true, EVENT_MEMBERSHIP));
        check(KIND_LEAVE, (true, EVENT_MEMBERSHIP));
        check(KIND_RECALL, (true, EVENT_RECALL));
        check(KIND_EDIT, (true, EVENT_EDIT));
        check(KIND_REACTION, (true, EVENT_REACTION));
        check(KIND_MODE, (true, EVENT_MODE));
    }
}
