//! Control events (E1–E3): who may recall, edit or react to a message,
//! the version CAS, what a retry answers, and which message an event
//! targets.
//!
//! A backend loads the facts ([`Target`], and the earlier event with the
//! request's idempotency key) inside its write transaction, at the
//! conversation's linearisation point, calls one of these functions and
//! writes what it decided.

use crate::kinds::{is_control_kind, STATE_RECALLED};
use crate::{MsgSeq, Refusal};

/// An idempotency key names one operation: an earlier event with the same
/// `(sender, client_msg_id)` is this request's earlier run only if it is in
/// the same conversation and of one of `kinds` (`kinds` empty means "a user
/// message", any kind that is not a control event). Anything else is
/// refused. `earlier` is `(conv, kind)` of the earlier event.
pub fn check_replay(earlier: (&str, &str), conv: &str, kinds: &[&str], client_msg_id: &str) -> Result<(), Refusal> {
    let (earlier_conv, kind) = earlier;
    let same_kind = if kinds.is_empty() { !is_control_kind(kind) } else { kinds.contains(&kind) };
    if earlier_conv != conv || !same_kind {
        // Not a malformed request: a key taken by another operation is a
        // conflict with what is stored.
        return Err(Refusal::Conflict(format!("client_msg_id {client_msg_id} was already used for another operation")));
    }
    Ok(())
}

/// S1: whether a send's answer says `duplicate` to the request that
/// minted `minted` as its message id. The store answers duplicate whenever
/// it finds a message under the request's idempotency key
/// (`stored_duplicate`, with that message's id `stored`); that message is
/// this very request's own write when the ids are equal. It happens in a
/// cluster: a send forwarded to its conversation's owner is written there,
/// the answer does not come back in time, and the node writes the same
/// command locally (issue 14's fallback), finding the owner's write. That
/// is the client's first attempt, and it is answered as the original it
/// is; a client's retry mints a new id and is still answered duplicate.
pub fn answered_as_duplicate(stored_duplicate: bool, stored: &str, minted: &str) -> bool {
    stored_duplicate && stored != minted
}

/// S1: a send carries user content; the control kinds are the store's own
/// events and are refused.
pub fn check_send_kind(kind: &str) -> Result<(), Refusal> {
    if is_control_kind(kind) {
        return Err(Refusal::Invalid(format!("kind {kind} is reserved for control events")));
    }
    Ok(())
}

/// A send or a per-user event by someone who is no member (no open
/// period, or for per-user events no row): `NotFound` if the conversation
/// does not exist, else `NotMember`.
pub fn not_member(conv: &str, conv_exists: bool) -> Refusal {
    if conv_exists {
        Refusal::NotMember
    } else {
        Refusal::NotFound(format!("conversation {conv}"))
    }
}

/// A quote names a user message of the same conversation inside the
/// sender's periods. `quoted` is `(kind, sender_sees)` of the quoted
/// message read in the send's conversation, `None` if it has none.
pub fn check_quote(quote_id: &str, quoted: Option<(&str, bool)>) -> Result<(), Refusal> {
    match quoted {
        Some((kind, true)) if !is_control_kind(kind) => Ok(()),
        _ => Err(Refusal::Invalid(format!("quoted message {quote_id} is not in this conversation"))),
    }
}

/// The message a control event targets, and what the rules need to know
/// about the actor's relation to it, read in one place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The target's kind: a control event is never a target.
    pub kind: String,
    pub msg_seq: MsgSeq,
    pub sender: String,
    pub state: String,
    pub version: u64,
    /// The `msg_seq` of its recall event, once recalled.
    pub recall_seq: Option<MsgSeq>,
    /// The actor has an open period in the conversation.
    pub actor_active: bool,
    /// The actor's periods cover the target's `msg_seq`.
    pub actor_sees: bool,
    /// For a reaction: the `msg_seq` of the actor's reaction event, if the
    /// actor has this reaction on the target now.
    pub actor_reaction: Option<MsgSeq>,
}

/// What a control event does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlDecision {
    /// Nothing is written; the answer is this event `msg_seq` and the
    /// target's current version (`changed: false`).
    Answer { msg_seq: MsgSeq, version: u64 },
    /// Append the event; the target's version becomes `version`.
    Write { version: u64 },
}

/// What a control event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlOutcome {
    /// The event's `msg_seq` (the original one on a retry).
    pub msg_seq: MsgSeq,
    /// The target message's version after the event.
    pub version: u64,
    /// False when nothing changed (a retry, or a reaction already there).
    pub changed: bool,
}

/// Splits a decision into what to write (the target and its new version)
/// or, when nothing is written, the answer.
pub fn plan(t: Option<Target>, d: ControlDecision) -> Result<(Target, u64), ControlOutcome> {
    match (t, d) {
        (Some(t), ControlDecision::Write { version }) => Ok((t, version)),
        (_, ControlDecision::Answer { msg_seq, version }) => Err(ControlOutcome { msg_seq, version, changed: false }),
        (None, ControlDecision::Write { .. }) => unreachable!("every rule refuses a missing target"),
    }
}

/// A user message of the conversation (never a control event), or
/// `NotFound`. The backend reads the target by `(conv, message_id)`.
pub fn target<'t>(target: Option<&'t Target>, message_id: &str) -> Result<&'t Target, Refusal> {
    target.filter(|t| !is_control_kind(&t.kind)).ok_or_else(|| Refusal::NotFound(format!("message {message_id}")))
}

/// A retry of an event already written (its key matched, at `msg_seq`):
/// the same event and the target's current version; nothing new.
pub fn decide_retry(msg_seq: MsgSeq, t: Option<&Target>, message_id: &str) -> Result<ControlDecision, Refusal> {
    let t = target(t, message_id)?;
    Ok(ControlDecision::Answer { msg_seq, version: t.version })
}

/// E1: only the sender, still a member, recalls; a second recall answers
/// the first one's event.
pub fn decide_recall(t: Option<&Target>, actor: &str, message_id: &str) -> Result<ControlDecision, Refusal> {
    let t = target(t, message_id)?;
    if t.sender != actor {
        return Err(Refusal::Forbidden("only the sender recalls a message".into()));
    }
    if !t.actor_active {
        return Err(Refusal::NotMember);
    }
    Ok(match t.recall_seq {
        Some(msg_seq) => ControlDecision::Answer { msg_seq, version: t.version },
        None => ControlDecision::Write { version: t.version + 1 },
    })
}

/// E2: only the sender, still a member, edits a message that is not
/// recalled, and only from its current version (a CAS on `version`).
pub fn decide_edit(
    t: Option<&Target>,
    actor: &str,
    message_id: &str,
    base_version: u64,
) -> Result<ControlDecision, Refusal> {
    let t = target(t, message_id)?;
    if t.sender != actor {
        return Err(Refusal::Forbidden("only the sender edits a message".into()));
    }
    if !t.actor_active {
        return Err(Refusal::NotMember);
    }
    if t.state == STATE_RECALLED {
        return Err(Refusal::Invalid("a recalled message cannot be edited".into()));
    }
    if base_version != t.version {
        return Err(Refusal::VersionConflict(t.version));
    }
    Ok(ControlDecision::Write { version: t.version + 1 })
}

/// E2: a member who sees the message adds or removes a reaction on it
/// (not on a recalled one); asking for the state it is already in changes
/// nothing and answers the reaction's event (0 when there is none).
pub fn decide_react(t: Option<&Target>, message_id: &str, add: bool) -> Result<ControlDecision, Refusal> {
    let t = target(t, message_id)?;
    if !t.actor_active || !t.actor_sees {
        return Err(Refusal::NotMember);
    }
    if t.state == STATE_RECALLED {
        return Err(Refusal::Invalid("a recalled message takes no reactions".into()));
    }
    if t.actor_reaction.is_some() == add {
        return Ok(ControlDecision::Answer { msg_seq: t.actor_reaction.unwrap_or(0), version: t.version });
    }
    Ok(ControlDecision::Write { version: t.version + 1 })
}

/// E3: a user deletes for themselves only a message their periods cover
/// (anything else does not exist for them); returns its `msg_seq`.
pub fn decide_delete_for_me(t: Option<&Target>, message_id: &str) -> Result<MsgSeq, Refusal> {
    match target(t, message_id)? {
        t if t.actor_sees => Ok(t.msg_seq),
        _ => Err(Refusal::NotFound(format!("message {message_id}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::{KIND_EDIT, KIND_JOIN, KIND_LEAVE, KIND_REACTION, KIND_RECALL, STATE_EDITED, STATE_NORMAL};

    #[test]
    fn a_send_is_a_duplicate_only_of_another_requests_write() {
        // (store says duplicate, stored id, minted id) -> answered duplicate
        let table = [
            ((false, "m1", "m1"), false), // written now
            ((true, "m1", "m2"), true),   // a retry finds the first attempt's message
            ((true, "m1", "m1"), false),  // its own forward's write, found by the local fallback
        ];
        for ((dup, stored, minted), expect) in table {
            assert_eq!(answered_as_duplicate(dup, stored, minted), expect, "{dup} {stored} {minted}");
        }
    }

    fn msg() -> Target {
        Target {
            kind: "text".into(),
            msg_seq: 7,
            sender: "a".into(),
            state: STATE_NORMAL.into(),
            version: 3,
            recall_seq: None,
            actor_active: true,
            actor_sees: true,
            actor_reaction: None,
        }
    }

    fn not_found() -> Refusal {
        Refusal::NotFound("message m".into())
    }

    #[test]
    fn replay_rules() {
        fn check(input: ((&str, &str), &[&str]), expect: Result<(), Refusal>) {
            assert_eq!(check_replay(input.0, "c1", input.1, "k"), expect, "{input:?}");
        }
        let other = || Err(Refusal::Conflict("client_msg_id k was already used for another operation".into()));
        check((("c1", "text"), &[]), Ok(()));
        check((("c1", "image"), &[]), Ok(()));
        check((("c2", "text"), &[]), other());
        check((("c1", KIND_RECALL), &[]), other());
        check((("c1", KIND_RECALL), &[KIND_RECALL]), Ok(()));
        check((("c1", KIND_LEAVE), &[KIND_JOIN, KIND_LEAVE]), Ok(()));
        check((("c1", KIND_EDIT), &[KIND_REACTION]), other());
        check((("c1", "text"), &[KIND_EDIT]), other());
        check((("c2", KIND_EDIT), &[KIND_EDIT]), other());
    }

    #[test]
    fn send_rules() {
        fn check(input: (&str, Option<(&str, bool)>), expect: Result<(), Refusal>) {
            let kind = check_send_kind(input.0);
            assert_eq!(kind.and_then(|_| check_quote("q", input.1)), expect, "{input:?}");
        }
        let bad_quote = || Err(Refusal::Invalid("quoted message q is not in this conversation".into()));
        check(("text", Some(("text", true))), Ok(()));
        check(
            (KIND_RECALL, Some(("text", true))),
            Err(Refusal::Invalid("kind recall is reserved for control events".into())),
        );
        check(("text", Some(("text", false))), bad_quote());
        check(("text", Some((KIND_EDIT, true))), bad_quote());
        check(("text", None), bad_quote());
        assert_eq!(not_member("c1", true), Refusal::NotMember);
        assert_eq!(not_member("c1", false), Refusal::NotFound("conversation c1".into()));
    }

    #[test]
    fn recall_rules() {
        fn check(input: (Option<Target>, &str), expect: Result<ControlDecision, Refusal>) {
            assert_eq!(decide_recall(input.0.as_ref(), input.1, "m"), expect, "{input:?}");
        }
        check((Some(msg()), "a"), Ok(ControlDecision::Write { version: 4 }));
        check((None, "a"), Err(not_found()));
        check((Some(Target { kind: KIND_EDIT.into(), ..msg() }), "a"), Err(not_found()));
        check((Some(msg()), "b"), Err(Refusal::Forbidden("only the sender recalls a message".into())));
        check((Some(Target { actor_active: false, ..msg() }), "a"), Err(Refusal::NotMember));
        let recalled = Target { recall_seq: Some(9), state: STATE_RECALLED.into(), version: 4, ..msg() };
        check((Some(recalled), "a"), Ok(ControlDecision::Answer { msg_seq: 9, version: 4 }));
    }

    #[test]
    fn edit_rules() {
        fn check(input: (Option<Target>, &str, u64), expect: Result<ControlDecision, Refusal>) {
            assert_eq!(decide_edit(input.0.as_ref(), input.1, "m", input.2), expect, "{input:?}");
        }
        check((Some(msg()), "a", 3), Ok(ControlDecision::Write { version: 4 }));
        check(
            (Some(Target { state: STATE_EDITED.into(), ..msg() }), "a", 3),
            Ok(ControlDecision::Write { version: 4 }),
        );
        check((Some(msg()), "a", 2), Err(Refusal::VersionConflict(3)));
        check((Some(msg()), "a", 4), Err(Refusal::VersionConflict(3)));
        check((None, "a", 3), Err(not_found()));
        check((Some(Target { kind: KIND_JOIN.into(), ..msg() }), "a", 3), Err(not_found()));
        check((Some(msg()), "b", 3), Err(Refusal::Forbidden("only the sender edits a message".into())));
        check((Some(Target { actor_active: false, ..msg() }), "a", 3), Err(Refusal::NotMember));
        let recalled = Target { state: STATE_RECALLED.into(), ..msg() };
        check((Some(recalled), "a", 3), Err(Refusal::Invalid("a recalled message cannot be edited".into())));
    }

    #[test]
    fn react_rules() {
        fn check(input: (Option<Target>, bool), expect: Result<ControlDecision, Refusal>) {
            assert_eq!(decide_react(input.0.as_ref(), "m", input.1), expect, "{input:?}");
        }
        check((Some(msg()), true), Ok(ControlDecision::Write { version: 4 }));
        check((Some(msg()), false), Ok(ControlDecision::Answer { msg_seq: 0, version: 3 }));
        let reacted = Target { actor_reaction: Some(8), ..msg() };
        check((Some(reacted.clone()), true), Ok(ControlDecision::Answer { msg_seq: 8, version: 3 }));
        check((Some(reacted), false), Ok(ControlDecision::Write { version: 4 }));
        check((None, true), Err(not_found()));
        check((Some(Target { kind: KIND_REACTION.into(), ..msg() }), true), Err(not_found()));
        // Anyone who sees it reacts, not only the sender; a newcomer does not see it.
        check((Some(Target { sender: "z".into(), ..msg() }), true), Ok(ControlDecision::Write { version: 4 }));
        check((Some(Target { actor_sees: false, ..msg() }), true), Err(Refusal::NotMember));
        check((Some(Target { actor_active: false, ..msg() }), true), Err(Refusal::NotMember));
        let recalled = Target { state: STATE_RECALLED.into(), ..msg() };
        check((Some(recalled), true), Err(Refusal::Invalid("a recalled message takes no reactions".into())));
    }

    #[test]
    fn retry_and_delete_rules() {
        fn check(input: (Option<Target>, u64), expect: Result<ControlDecision, Refusal>) {
            assert_eq!(decide_retry(input.1, input.0.as_ref(), "m"), expect, "{input:?}");
        }
        check((Some(msg()), 11), Ok(ControlDecision::Answer { msg_seq: 11, version: 3 }));
        check((None, 11), Err(not_found()));
        let delete = |t: Option<Target>| decide_delete_for_me(t.as_ref(), "m");
        assert_eq!(delete(Some(msg())), Ok(7));
        assert_eq!(delete(Some(Target { actor_sees: false, ..msg() })), Err(not_found()));
        assert_eq!(delete(Some(Target { kind: KIND_RECALL.into(), ..msg() })), Err(not_found()));
        assert_eq!(delete(None), Err(not_found()));
        let answer = ControlDecision::Answer { msg_seq: 9, version: 3 };
        assert_eq!(plan(Some(msg()), answer), Err(ControlOutcome { msg_seq: 9, version: 3, changed: false }));
        assert_eq!(plan(None, answer), Err(ControlOutcome { msg_seq: 9, version: 3, changed: false }));
        assert_eq!(plan(Some(msg()), ControlDecision::Write { version: 4 }), Ok((msg(), 4)));
    }
}
