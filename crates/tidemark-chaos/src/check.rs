//! The checker: given what the scenario sent, what the server accepted and
//! what every device holds after the run settled, it lists every violation
//! of the sync guarantees, message by message. It is pure: no IO, no
//! clock, no client; the scenario collects the facts and hands them over.
//!
//! Per device, for every conversation of its user:
//! - every accepted message is present exactly once, at the `msg_seq` and
//!   with the `message_id` the server gave its sender (S1, S2);
//! - events are in strictly increasing `msg_seq` with no hole above
//!   `history_to` (a snapshot's history is not a hole), and the
//!   conversation's contiguous cursor reaches its last event (K2);
//! - nothing is held that nobody sent, or from a conversation the user is
//!   not in (G1 for direct conversations).
//!
//! Cursor monotonicity is checked while the run goes (see
//! [`crate::scenario`]), since only the change stream sees every move.

use std::collections::{BTreeMap, HashMap, HashSet};

use tidemark_client::{Conversation, Message};

/// One message the scenario queued.
#[derive(Debug, Clone)]
pub struct Sent {
    /// Unique per run; carried in the content as `tag`.
    pub tag: String,
    pub conv: String,
    pub user: String,
    pub device: String,
    pub client_msg_id: String,
}

/// What the server answered for a send (`send.ok`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub msg_seq: u64,
    pub message_id: String,
}

/// What one device holds locally once the run settled.
#[derive(Debug, Clone)]
pub struct DeviceView {
    pub user: String,
    pub device: String,
    pub conversations: Vec<Conversation>,
    /// Every event of each conversation of `conversations`, in the order
    /// the SDK returns them.
    pub events: BTreeMap<String, Vec<Message>>,
}

/// What the checker found.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    /// (device, message) pairs found exactly right.
    pub verified: u64,
    /// Accepted messages at or below a device's `history_to` (delivered by
    /// a snapshot as history): not required locally.
    pub history_skipped: u64,
    pub devices: usize,
    pub violations: Vec<String>,
}

/// The facts of a run, as the checker needs them.
pub struct Facts<'a> {
    /// Conversation → its members (both users of a direct conversation).
    pub members: &'a BTreeMap<String, Vec<String>>,
    pub sent: &'a [Sent],
    /// `client_msg_id` → the server's answer; a sent message missing here
    /// was never accepted.
    pub accepted: &'a HashMap<String, Accepted>,
    pub views: &'a [DeviceView],
}

/// Checks every device against what was accepted.
pub fn check(facts: &Facts<'_>) -> Outcome {
    let mut out = Outcome { devices: facts.views.len(), ..Outcome::default() };
    // conv → msg_seq → (tag, accepted), from the senders' side.
    let mut expected: BTreeMap<&str, BTreeMap<u64, (&Sent, &Accepted)>> = BTreeMap::new();
    let mut tags: HashMap<&str, (&Sent, &Accepted)> = HashMap::new();
    for s in facts.sent {
        let Some(a) = facts.accepted.get(&s.client_msg_id) else {
            out.violations.push(format!("{} ({}/{}): queued but never accepted", s.tag, s.user, s.device));
            continue;
        };
        let by_seq = expected.entry(s.conv.as_str()).or_default();
        if let Some((other, _)) = by_seq.insert(a.msg_seq, (s, a)) {
            out.violations.push(format!(
                "{} and {} were both accepted at {} msg_seq {} (S2)",
                other.tag, s.tag, s.conv, a.msg_seq
            ));
        }
        tags.insert(s.tag.as_str(), (s, a));
    }
    for view in facts.views {
        check_device(facts, view, &expected, &tags, &mut out);
    }
    out
}

fn check_device(
    facts: &Facts<'_>,
    view: &DeviceView,
    expected: &BTreeMap<&str, BTreeMap<u64, (&Sent, &Accepted)>>,
    tags: &HashMap<&str, (&Sent, &Accepted)>,
    out: &mut Outcome,
) {
    let who = format!("{}/{}", view.user, view.device);
    let mine: HashSet<&str> =
        facts.members.iter().filter(|(_, m)| m.contains(&view.user)).map(|(c, _)| c.as_str()).collect();
    for conv in &view.conversations {
        if !mine.contains(conv.conv.as_str()) {
            out.violations.push(format!("{who}: holds conversation {} it is not a member of", conv.conv));
        }
    }
    for conv in &mine {
        let Some(summary) = view.conversations.iter().find(|c| c.conv == *conv) else {
            if expected.get(conv).is_some_and(|e| !e.is_empty()) {
                out.violations.push(format!("{who}: conversation {conv} missing"));
            }
            continue;
        };
        let events = view.events.get(*conv).map(Vec::as_slice).unwrap_or_default();
        check_order(&who, summary, events, out);
        let members = facts.members.get(*conv).map(Vec::as_slice).unwrap_or_default();
        check_messages(&who, summary, events, members, expected.get(conv), tags, out);
    }
}

/// Strictly increasing `msg_seq`, no hole above `history_to`, contiguous
/// cursor at the last event.
fn check_order(who: &str, summary: &Conversation, events: &[Message], out: &mut Outcome) {
    let conv = &summary.conv;
    let mut want = summary.history_to + 1;
    for e in events.iter().filter(|e| e.msg_seq > summary.history_to) {
        if e.msg_seq < want {
            out.violations.push(format!(
                "{who}: {conv} msg_seq {} out of order or twice (after {})",
                e.msg_seq,
                want - 1
            ));
            continue;
        }
        if e.msg_seq > want {
            out.violations.push(format!("{who}: {conv} hole at msg_seq {}..={}", want, e.msg_seq - 1));
        }
        want = e.msg_seq + 1;
    }
    if summary.contiguous_msg_seq != summary.last_msg_seq {
        out.violations.push(format!(
            "{who}: {conv} contiguous cursor {} below last msg_seq {} after settling",
            summary.contiguous_msg_seq, summary.last_msg_seq
        ));
    }
}

fn check_messages(
    who: &str,
    summary: &Conversation,
    events: &[Message],
    members: &[String],
    expected: Option<&BTreeMap<u64, (&Sent, &Accepted)>>,
    tags: &HashMap<&str, (&Sent, &Accepted)>,
    out: &mut Outcome,
) {
    let conv = &summary.conv;
    let mut held: HashMap<&str, Vec<&Message>> = HashMap::new();
    for e in events.iter().filter(|e| !e.is_control()) {
        if !members.contains(&e.sender) {
            out.violations.push(format!("{who}: {conv} msg_seq {} from non-member {}", e.msg_seq, e.sender));
        }
        let Some(tag) = e.content.get("tag").and_then(|t| t.as_str()) else {
            // A recalled message loses its content; the scenario recalls
            // nothing, so this is a message nobody sent.
            out.violations.push(format!("{who}: {conv} msg_seq {} has no tag (state {})", e.msg_seq, e.state));
            continue;
        };
        match tags.get(tag) {
            Some((s, _)) if s.conv != *conv => {
                out.violations.push(format!("{who}: {tag} of {} shows up in {conv}", s.conv));
            }
            Some(_) => held.entry(tag).or_default().push(e),
            None => out.violations.push(format!("{who}: {conv} holds {tag}, which was never accepted")),
        }
    }
    for (seq, (sent, acc)) in expected.into_iter().flatten() {
        let copies = held.get(sent.tag.as_str()).map(Vec::as_slice).unwrap_or_default();
        if *seq <= summary.history_to && copies.is_empty() {
            out.history_skipped += 1;
            continue;
        }
        match copies {
            [] => out.violations.push(format!("{who}: {conv} lost {} (msg_seq {seq})", sent.tag)),
            [m] if m.msg_seq == acc.msg_seq && m.message_id == acc.message_id => out.verified += 1,
            [m] => out.violations.push(format!(
                "{who}: {conv} {} held at msg_seq {} id {}, accepted at {} id {}",
                sent.tag, m.msg_seq, m.message_id, acc.msg_seq, acc.message_id
            )),
            many => out.violations.push(format!(
                "{who}: {conv} {} held {} times at msg_seqs {:?}",
                sent.tag,
                many.len(),
                many.iter().map(|m| m.msg_seq).collect::<Vec<_>>()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Negative controls: a checker that never fails proves nothing. One
    //! device of `a` in conversation `c` (members `a`, `b`); `b` sent
    //! m1..m3, accepted at msg_seq 1..3.

    use super::*;

    fn msg(conv: &str, seq: u64, tag: &str) -> Message {
        Message {
            conv: conv.into(),
            msg_seq: seq,
            message_id: format!("id-{tag}"),
            kind: "text".into(),
            state: "normal".into(),
            sender: "b".into(),
            content: serde_json::json!({ "tag": tag }),
            created_at: 0,
            version: 1,
            reactions: serde_json::json!({}),
            sync_seq: Some(seq),
        }
    }

    fn summary(conv: &str, events: &[Message]) -> Conversation {
        let last = events.iter().map(|e| e.msg_seq).max().unwrap_or(0);
        Conversation {
            conv: conv.into(),
            kind: "direct".into(),
            contiguous_msg_seq: last,
            history_to: 0,
            last_msg_seq: last,
            read_seq: 0,
            unread: 0,
            muted: false,
            pinned: false,
            active: true,
            last_message: None,
        }
    }

    /// Runs the checker on a device holding `held` (conversation → events);
    /// returns its violations.
    fn check_held(held: &[(&str, Vec<Message>)]) -> Vec<String> {
        let members: BTreeMap<String, Vec<String>> = [("c".to_owned(), vec!["a".to_owned(), "b".to_owned()])].into();
        let sent: Vec<Sent> = (1..=3)
            .map(|i| Sent {
                tag: format!("m{i}"),
                conv: "c".into(),
                user: "b".into(),
                device: "d0".into(),
                client_msg_id: format!("cm{i}"),
            })
            .collect();
        let accepted: HashMap<String, Accepted> =
            (1..=3).map(|i| (format!("cm{i}"), Accepted { msg_seq: i, message_id: format!("id-m{i}") })).collect();
        let view = DeviceView {
            user: "a".into(),
            device: "d0".into(),
            conversations: held.iter().map(|(c, e)| summary(c, e)).collect(),
            events: held.iter().map(|(c, e)| (c.to_string(), e.clone())).collect(),
        };
        check(&Facts { members: &members, sent: &sent, accepted: &accepted, views: &[view] }).violations
    }

    #[test]
    fn the_checker_flags_every_kind_of_damage() {
        let good = || vec![msg("c", 1, "m1"), msg("c", 2, "m2"), msg("c", 3, "m3")];
        assert_eq!(check_held(&[("c", good())]), Vec::<String>::new());

        let mut lost = good();
        lost.remove(1);
        let v = check_held(&[("c", lost)]);
        assert!(v.iter().any(|v| v.contains("hole at msg_seq 2")), "{v:?}");
        assert!(v.iter().any(|v| v.contains("lost m2")), "{v:?}");

        let mut twice = good();
        twice.push(msg("c", 4, "m3"));
        let v = check_held(&[("c", twice)]);
        assert!(v.iter().any(|v| v.contains("m3 held 2 times")), "{v:?}");

        let mut swapped = good();
        swapped.swap(1, 2);
        let v = check_held(&[("c", swapped)]);
        assert!(v.iter().any(|v| v.contains("out of order")), "{v:?}");

        let mut moved = good();
        moved[2] = msg("c", 3, "m3");
        moved[2].message_id = "id-other".into();
        let v = check_held(&[("c", moved)]);
        assert!(v.iter().any(|v| v.contains("accepted at 3 id id-m3")), "{v:?}");

        let v = check_held(&[("c", good()), ("elsewhere", vec![msg("elsewhere", 1, "x")])]);
        assert!(v.iter().any(|v| v.contains("not a member of")), "{v:?}");

        let mut stranger = good();
        stranger[0].sender = "z".into();
        let v = check_held(&[("c", stranger)]);
        assert!(v.iter().any(|v| v.contains("non-member z")), "{v:?}");
    }
}
