//! The per-user projection of a conversation (R1–R3, E3): what one
//! delivered event does to the recipient's conversation row, how the read
//! cursor and the settings move, and the idempotency keys of per-user
//! events. Backends keep the row (`user_convs`) and write what these decide
//! in the transaction that writes the event.

use crate::kinds::{EVENT_MESSAGE, EVENT_RECALL};
use crate::push::Preview;
use crate::{MsgSeq, Refusal};

/// Most message ids in one `delivery.ack`.
pub const DELIVERY_IDS_MAX: usize = 500;

/// What delivering one fanned-out event to one recipient does to the
/// recipient's conversation row, besides the log entry. Every delivered
/// event moves `last_msg_seq` up to its `msg_seq`, recalls included: a
/// snapshot lists the conversation up to it, so a device rebuilt from one
/// holds no gap below the next event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// The recipient's own event: the read cursor moves up to it.
    pub own: bool,
    /// A message from someone else: unread grows by one if it lies above
    /// the read cursor and the recipient did not delete it for themselves.
    pub counts_unread: bool,
    /// Recount unread from the facts afterwards: a recalled message no
    /// longer counts; any own event (a message, an edit, a reaction, a
    /// membership change) moved the read cursor over whatever was unread
    /// below it.
    pub recount: bool,
}

/// R3: the projection flags of one delivery. `kind` is the user-log kind of
/// the event, `actor` its sender.
pub fn delivery(kind: &str, recipient: &str, actor: &str) -> Delivery {
    let own = recipient == actor;
    let message = kind == EVENT_MESSAGE;
    Delivery { own, counts_unread: message && !own, recount: kind == EVENT_RECALL || own }
}

/// R1: where `mark_read` moves the read cursor: to `read_to`, capped at the
/// conversation head, never back. `None` when it does not move.
pub fn read_target(read_to: MsgSeq, head: MsgSeq, read_seq: MsgSeq) -> Option<MsgSeq> {
    let target = read_to.min(head);
    (target > read_seq).then_some(target)
}

/// Per-user conversation settings (E3) and their version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub muted: bool,
    pub pinned: bool,
    /// What an offline push of this conversation may say (P4; see
    /// `push::effective_preview`).
    pub push_preview: Preview,
    pub version: u64,
}

/// One update of the settings: `None` keeps a setting as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SettingsUpdate {
    pub muted: Option<bool>,
    pub pinned: Option<bool>,
    pub push_preview: Option<Preview>,
}

/// E3: the settings after an update; a change bumps the version, no change
/// returns `None` (nothing written).
pub fn settings_after(now: Settings, u: SettingsUpdate) -> Option<Settings> {
    let next = Settings {
        muted: u.muted.unwrap_or(now.muted),
        pinned: u.pinned.unwrap_or(now.pinned),
        push_preview: u.push_preview.unwrap_or(now.push_preview),
        version: now.version,
    };
    (Settings { version: now.version, ..next } != now).then_some(Settings { version: now.version + 1, ..next })
}

/// The idempotency key (`source_event_id`) of a `read` user event.
pub fn read_event_id(conv: &str, read_seq: MsgSeq) -> String {
    format!("read:{conv}:{read_seq}")
}

/// The idempotency key of a `settings` user event.
pub fn settings_event_id(conv: &str, version: u64) -> String {
    format!("settings:{conv}:{version}")
}

/// The idempotency key of a `delete` (for me) user event.
pub fn delete_event_id(message_id: &str) -> String {
    format!("delete:{message_id}")
}

/// R1: a `delivery.ack` names at most [`DELIVERY_IDS_MAX`] messages.
pub fn check_delivery_ids(n: usize) -> Result<(), Refusal> {
    if n > DELIVERY_IDS_MAX {
        return Err(Refusal::Invalid(format!("at most {DELIVERY_IDS_MAX} message ids")));
    }
    Ok(())
}

/// R1: the first of `ids` (in request order) the user was not delivered
/// (`delivered` are those fan-out delivered inside the user's periods)
/// refuses the whole request.
pub fn check_delivered(ids: &[String], delivered: &[String]) -> Result<(), Refusal> {
    match ids.iter().find(|id| !delivered.contains(id)) {
        Some(id) => Err(Refusal::NotFound(format!("message {id}"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::{EVENT_EDIT, EVENT_MEMBERSHIP, EVENT_REACTION};

    #[test]
    fn delivery_rules() {
        fn check(input: (&str, &str), expect: (bool, bool, bool)) {
            let d = delivery(input.0, input.1, "a");
            assert_eq!((d.own, d.counts_unread, d.recount), expect, "{input:?}");
        }
        check((EVENT_MESSAGE, "b"), (false, true, false));
        check((EVENT_MESSAGE, "a"), (true, false, true));
        check((EVENT_RECALL, "b"), (false, false, true));
        check((EVENT_RECALL, "a"), (true, false, true));
        check((EVENT_EDIT, "b"), (false, false, false));
        // An own control event moves read_seq too: recount (issue 16's drift).
        check((EVENT_REACTION, "a"), (true, false, true));
        check((EVENT_EDIT, "a"), (true, false, true));
        check((EVENT_MEMBERSHIP, "a"), (true, false, true));
        check((EVENT_MEMBERSHIP, "b"), (false, false, false));
    }

    #[test]
    fn read_rules() {
        fn check(input: (u64, u64, u64), expect: Option<u64>) {
            assert_eq!(read_target(input.0, input.1, input.2), expect, "{input:?}");
        }
        check((4, 10, 2), Some(4));
        check((1000, 10, 2), Some(10));
        check((2, 10, 4), None);
        check((4, 10, 4), None);
        check((9, 3, 3), None);
    }

    #[test]
    fn settings_rules() {
        type Row = (bool, bool, Preview, u64);
        fn check(input: (Option<bool>, Option<bool>, Option<Preview>), expect: Option<Row>) {
            let now = Settings { muted: false, pinned: true, push_preview: Preview::Full, version: 2 };
            let u = SettingsUpdate { muted: input.0, pinned: input.1, push_preview: input.2 };
            let got = settings_after(now, u).map(|s| (s.muted, s.pinned, s.push_preview, s.version));
            assert_eq!(got, expect, "{input:?}");
        }
        check((None, None, None), None);
        check((Some(false), Some(true), Some(Preview::Full)), None);
        check((Some(true), None, None), Some((true, true, Preview::Full, 3)));
        check((None, Some(false), None), Some((false, false, Preview::Full, 3)));
        check((Some(true), Some(false), None), Some((true, false, Preview::Full, 3)));
        check((None, None, Some(Preview::None)), Some((false, true, Preview::None, 3)));
        check((None, None, Some(Preview::Conversation)), Some((false, true, Preview::Conversation, 3)));
    }

    #[test]
    fn per_user_event_ids_and_delivery_bounds() {
        assert_eq!(read_event_id("g1", 4), "read:g1:4");
        assert_eq!(settings_event_id("g1", 2), "settings:g1:2");
        assert_eq!(delete_event_id("m1"), "delete:m1");
        fn check(input: usize, expect: Result<(), Refusal>) {
            assert_eq!(check_delivery_ids(input), expect, "{input}");
        }
        check(0, Ok(()));
        check(DELIVERY_IDS_MAX, Ok(()));
        check(DELIVERY_IDS_MAX + 1, Err(Refusal::Invalid(format!("at most {DELIVERY_IDS_MAX} message ids"))));
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(check_delivered(&s(&["a", "a", "b"]), &s(&["b", "a"])), Ok(()));
        assert_eq!(check_delivered(&s(&["a", "x", "y"]), &s(&["a"])), Err(Refusal::NotFound("message x".into())));
    }
}
