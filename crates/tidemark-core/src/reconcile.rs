//! Reconciliation (O3, seed 000 §18.3): which relation between the stored
//! facts is broken, and whether repairing it is safe. Backends load the
//! facts of one message (its expected recipients, resolved exactly as the
//! fan-out resolves them, and what the recipients' logs hold), of one user
//! (cursors, head, unread counts, events) and of one conversation (head
//! and its highest message); this module names the findings, and the job
//! (`tidemark_store::reconcile`) applies only the repairs named here.
//!
//! A repair never writes a message or a user event itself: it re-enqueues
//! the message's original outbox item (the fan-out then writes only what a
//! log lacks, idempotent on `(user, source_event_id, period_id)`, F3) or
//! recounts an unread count from the facts (R3). Anything a repair would
//! have to guess (a message outside its sender's periods, an overlap of
//! periods, an event whose message or period does not exist, an ACK above
//! the head, a conversation head that disagrees with its messages) is
//! reported for a person and left as it is.

use crate::kinds::is_control_kind;
use crate::membership::Recipients;
use crate::{MsgSeq, SyncSeq};

/// The relations of seed §18.3 this module checks, by name (the report's
/// `relation` field). Cold archives (the eighth relation) are not built (L4).
pub mod relation {
    /// An accepted message has its fan-out: a pending outbox item, or an
    /// event in the log of every recipient its periods name (§18.3 1–3).
    pub const FANOUT: &str = "fanout";
    /// The periods a message hit are one per recipient, and its sender's
    /// period covers it (§18.3 3); an overlap is quarantined (F4).
    pub const PERIODS: &str = "periods";
    /// A user event's message exists, and its period is the user's in that
    /// conversation (§18.3 4).
    pub const EVENT_SOURCE: &str = "event_source";
    /// No device ACK is above its user's log head (§18.3 5).
    pub const ACK_HEAD: &str = "ack_head";
    /// A conversation's head is its highest message (§18.3 6).
    pub const CONV_HEAD: &str = "conv_head";
    /// An unread count equals its recount from the facts (§18.3 7).
    pub const UNREAD: &str = "unread";
}

/// Why a finding was made (the report's `reason` field).
pub mod reason {
    /// Every recipient lacks the event and no outbox item is pending: the
    /// item vanished before it ran.
    pub const OUTBOX_ITEM_MISSING: &str = "outbox_item_missing";
    /// Some recipients hold the event, this one does not.
    pub const USER_EVENT_MISSING: &str = "user_event_missing";
    /// A delivery is missing but the message's periods are not sound
    /// (overlap, or the sender outside every period): not repaired.
    pub const MISSING_UNSAFE: &str = "user_event_missing_periods_unsound";
    /// Two periods of one user cover the message; quarantined at fan-out.
    pub const OVERLAP_QUARANTINED: &str = "overlapping_membership_periods";
    /// Two periods of one user cover the message and no quarantine record
    /// says so.
    pub const OVERLAP_UNRECORDED: &str = "overlapping_membership_periods_unrecorded";
    /// No period of the sender covers its own message.
    pub const SENDER_OUTSIDE_PERIODS: &str = "sender_outside_periods";
    /// A user event names a message that does not exist.
    pub const MESSAGE_MISSING: &str = "message_missing";
    /// A user event names a period that is not the user's in that
    /// conversation (or does not exist).
    pub const PERIOD_FOREIGN: &str = "period_missing_or_foreign";
    pub const ACK_ABOVE_HEAD: &str = "ack_above_head";
    pub const HEAD_MISMATCH: &str = "head_differs_from_messages";
    pub const UNREAD_DRIFT: &str = "unread_drift";
    /// A mention count differs from its recount (issue 18); unread agrees.
    pub const MENTIONS_DRIFT: &str = "mentions_drift";
}

/// A repair the job may apply; each is idempotent.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Repair {
    /// Put the message's outbox item back; the fan-out delivers only what
    /// the logs lack (F3).
    Requeue { conv: String, message_id: String },
    /// Recount the row's unread from the facts.
    Recount { user: String, conv: String },
}

/// One broken relation. `repair` is `None` for what goes to a person.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Finding {
    pub relation: &'static str,
    pub reason: &'static str,
    pub conv: Option<String>,
    pub user: Option<String>,
    pub device: Option<String>,
    pub message_id: Option<String>,
    pub msg_seq: Option<MsgSeq>,
    pub sync_seq: Option<SyncSeq>,
    pub period_id: Option<i64>,
    /// What is stored (an unread count, an ACK, a head).
    pub stored: Option<u64>,
    /// What the facts say it should be.
    pub fact: Option<u64>,
    pub repair: Option<Repair>,
}

/// One message and what the logs hold of it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MessageFacts {
    pub conv: String,
    pub message_id: String,
    pub msg_seq: MsgSeq,
    pub sender: String,
    pub kind: String,
    /// An outbox item for it is still pending: the relay has not run yet,
    /// nothing is expected in the logs.
    pub outbox_pending: bool,
    /// Whom the fan-out delivers it to (`membership::recipients_at` and
    /// `control_recipients` on the periods, `large::route`).
    pub recipients: Recipients,
    /// A period of the sender covers `msg_seq`.
    pub sender_covered: bool,
    /// Recipients `(user, period)` whose log holds no event for it, among
    /// those whose log must still hold it (not trimmed past it, not
    /// deleted: the backend leaves out a user whose log may have trimmed it).
    pub missing: Vec<(String, i64)>,
    /// Users with a quarantine record for it (`fanout_quarantine`).
    pub quarantine_recorded: Vec<String>,
}

/// The findings of one message (relations FANOUT and PERIODS).
pub fn check_message(f: &MessageFacts) -> Vec<Finding> {
    if f.outbox_pending {
        return Vec::new();
    }
    let base = || Finding {
        conv: Some(f.conv.clone()),
        message_id: Some(f.message_id.clone()),
        msg_seq: Some(f.msg_seq),
        ..Finding::default()
    };
    let mut out = Vec::new();
    for user in &f.recipients.quarantined {
        let recorded = f.quarantine_recorded.contains(user);
        out.push(Finding {
            relation: relation::PERIODS,
            reason: if recorded { reason::OVERLAP_QUARANTINED } else { reason::OVERLAP_UNRECORDED },
            user: Some(user.clone()),
            ..base()
        });
    }
    // A control event's actor may act on a message from a period of its
    // own (a recall by a sender who is still a member); a message's sender
    // must be inside a period at its msg_seq, or the periods are missing.
    let sender_sound = f.sender_covered || is_control_kind(&f.kind);
    if !sender_sound {
        out.push(Finding {
            relation: relation::PERIODS,
            reason: reason::SENDER_OUTSIDE_PERIODS,
            user: Some(f.sender.clone()),
            ..base()
        });
    }
    let safe = sender_sound && f.recipients.quarantined.is_empty();
    let all_missing = !f.missing.is_empty() && f.missing.len() == f.recipients.deliver.len();
    for (user, period) in &f.missing {
        out.push(Finding {
            relation: relation::FANOUT,
            reason: match (safe, all_missing) {
                (false, _) => reason::MISSING_UNSAFE,
                (true, true) => reason::OUTBOX_ITEM_MISSING,
                (true, false) => reason::USER_EVENT_MISSING,
            },
            user: Some(user.clone()),
            period_id: Some(*period),
            repair: safe.then(|| Repair::Requeue { conv: f.conv.clone(), message_id: f.message_id.clone() }),
            ..base()
        });
    }
    out
}

/// One device's cursor, as the user check reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAck {
    pub device: String,
    pub acked: SyncSeq,
}

/// One conversation row's unread and mention count (issue 18), stored
/// and recounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadFacts {
    pub conv: String,
    pub stored: u64,
    pub fact: u64,
    pub mentions_stored: u64,
    pub mentions_fact: u64,
}

/// A user event that names something that is not there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFacts {
    pub sync_seq: SyncSeq,
    pub conv: String,
    pub message_id: Option<String>,
    pub msg_seq: Option<MsgSeq>,
    pub period_id: i64,
    /// Its message exists.
    pub message_exists: bool,
    /// Its period is one of this user's in this conversation (always true
    /// for a per-user event, period 0).
    pub period_owned: bool,
}

/// One user: head, cursors, unread counts and the suspect events.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UserFacts {
    pub user: String,
    pub high_watermark: SyncSeq,
    /// Devices that are not revoked.
    pub devices: Vec<DeviceAck>,
    pub unread: Vec<UnreadFacts>,
    /// Events whose message is missing or whose period is not the user's
    /// (the backend reads only those).
    pub suspect_events: Vec<EventFacts>,
}

/// The findings of one user (relations ACK_HEAD, UNREAD, EVENT_SOURCE).
pub fn check_user(f: &UserFacts) -> Vec<Finding> {
    let base = || Finding { user: Some(f.user.clone()), ..Finding::default() };
    let mut out = Vec::new();
    for d in f.devices.iter().filter(|d| d.acked > f.high_watermark) {
        // Lowering an ACK moves a cursor back, which no rule allows (D4):
        // a person decides (e.g. resets the device).
        out.push(Finding {
            relation: relation::ACK_HEAD,
            reason: reason::ACK_ABOVE_HEAD,
            device: Some(d.device.clone()),
            stored: Some(d.acked),
            fact: Some(f.high_watermark),
            ..base()
        });
    }
    for u in &f.unread {
        // One recount repairs both counts of the row.
        let drift = if u.stored != u.fact {
            (reason::UNREAD_DRIFT, u.stored, u.fact)
        } else if u.mentions_stored != u.mentions_fact {
            (reason::MENTIONS_DRIFT, u.mentions_stored, u.mentions_fact)
        } else {
            continue;
        };
        out.push(Finding {
            relation: relation::UNREAD,
            reason: drift.0,
            conv: Some(u.conv.clone()),
            stored: Some(drift.1),
            fact: Some(drift.2),
            repair: Some(Repair::Recount { user: f.user.clone(), conv: u.conv.clone() }),
            ..base()
        });
    }
    for e in &f.suspect_events {
        let reason = match (e.message_id.is_some() && !e.message_exists, e.period_owned) {
            (true, _) => reason::MESSAGE_MISSING,
            (false, false) => reason::PERIOD_FOREIGN,
            (false, true) => continue,
        };
        // Never fabricated, never deleted: the log is what devices read.
        out.push(Finding {
            relation: relation::EVENT_SOURCE,
            reason,
            conv: Some(e.conv.clone()),
            message_id: e.message_id.clone(),
            msg_seq: e.msg_seq,
            sync_seq: Some(e.sync_seq),
            period_id: Some(e.period_id),
            ..base()
        });
    }
    out
}

/// One conversation's head and its highest stored message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvFacts {
    pub conv: String,
    pub head: MsgSeq,
    pub max_msg_seq: MsgSeq,
}

/// The finding of one conversation (relation CONV_HEAD). A head below its
/// messages would hand out a seq twice; above them, a hole: neither is
/// guessed at, both go to a person.
pub fn check_conv(f: &ConvFacts) -> Option<Finding> {
    (f.head != f.max_msg_seq).then(|| Finding {
        relation: relation::CONV_HEAD,
        reason: reason::HEAD_MISMATCH,
        conv: Some(f.conv.clone()),
        stored: Some(f.head),
        fact: Some(f.max_msg_seq),
        ..Finding::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg() -> MessageFacts {
        MessageFacts {
            conv: "g".into(),
            message_id: "m".into(),
            msg_seq: 5,
            sender: "a".into(),
            kind: "text".into(),
            outbox_pending: false,
            recipients: Recipients { deliver: vec![("a".into(), 1), ("b".into(), 2)], quarantined: vec![] },
            sender_covered: true,
            missing: vec![],
            quarantine_recorded: vec![],
        }
    }

    /// (relation, reason, user, repaired?) of each finding.
    fn summary(found: &[Finding]) -> Vec<(&'static str, &'static str, String, bool)> {
        found.iter().map(|f| (f.relation, f.reason, f.user.clone().unwrap_or_default(), f.repair.is_some())).collect()
    }

    #[test]
    fn message_rules() {
        fn check(input: MessageFacts, expect: &[(&'static str, &'static str, &str, bool)]) {
            let got = summary(&check_message(&input));
            let expect: Vec<_> = expect.iter().map(|(a, b, c, d)| (*a, *b, c.to_string(), *d)).collect();
            assert_eq!(got, expect, "{input:?}");
        }
        use reason::*;
        use relation::*;
        check(msg(), &[]);
        let b_missing = MessageFacts { missing: vec![("b".into(), 2)], ..msg() };
        check(b_missing.clone(), &[(FANOUT, USER_EVENT_MISSING, "b", true)]);
        // A pending item: the relay will deliver it, nothing is drift.
        check(MessageFacts { outbox_pending: true, ..b_missing.clone() }, &[]);
        let all = MessageFacts { missing: vec![("a".into(), 1), ("b".into(), 2)], ..msg() };
        check(all.clone(), &[(FANOUT, OUTBOX_ITEM_MISSING, "a", true), (FANOUT, OUTBOX_ITEM_MISSING, "b", true)]);
        // Overlapping periods: reported (recorded or not), and no repair of
        // the message for anyone.
        let overlap = MessageFacts {
            recipients: Recipients { deliver: vec![("a".into(), 1), ("b".into(), 2)], quarantined: vec!["c".into()] },
            ..b_missing.clone()
        };
        check(
            MessageFacts { quarantine_recorded: vec!["c".into()], ..overlap.clone() },
            &[(PERIODS, OVERLAP_QUARANTINED, "c", false), (FANOUT, MISSING_UNSAFE, "b", false)],
        );
        check(overlap.clone(), &[(PERIODS, OVERLAP_UNRECORDED, "c", false), (FANOUT, MISSING_UNSAFE, "b", false)]);
        // A sender outside every period: a missing period, nothing repaired.
        check(
            MessageFacts { sender_covered: false, ..b_missing.clone() },
            &[(PERIODS, SENDER_OUTSIDE_PERIODS, "a", false), (FANOUT, MISSING_UNSAFE, "b", false)],
        );
        // A control event's actor need not be covered at its own seq.
        check(
            MessageFacts { sender_covered: false, kind: "recall".into(), ..b_missing },
            &[(FANOUT, USER_EVENT_MISSING, "b", true)],
        );
    }

    #[test]
    fn user_rules() {
        let f = UserFacts {
            user: "u".into(),
            high_watermark: 10,
            devices: vec![DeviceAck { device: "d1".into(), acked: 10 }, DeviceAck { device: "d2".into(), acked: 11 }],
            unread: vec![
                UnreadFacts { conv: "c1".into(), stored: 3, fact: 3, mentions_stored: 1, mentions_fact: 1 },
                UnreadFacts { conv: "c2".into(), stored: 9, fact: 2, mentions_stored: 0, mentions_fact: 0 },
                UnreadFacts { conv: "c3".into(), stored: 2, fact: 2, mentions_stored: 2, mentions_fact: 1 },
            ],
            suspect_events: vec![
                EventFacts {
                    sync_seq: 4,
                    conv: "c1".into(),
                    message_id: Some("gone".into()),
                    msg_seq: Some(2),
                    period_id: 1,
                    message_exists: false,
                    period_owned: true,
                },
                EventFacts {
                    sync_seq: 5,
                    conv: "c1".into(),
                    message_id: Some("m".into()),
                    msg_seq: Some(3),
                    period_id: 99,
                    message_exists: true,
                    period_owned: false,
                },
                EventFacts {
                    sync_seq: 6,
                    conv: "c1".into(),
                    message_id: None,
                    msg_seq: None,
                    period_id: 0,
                    message_exists: false,
                    period_owned: true,
                },
            ],
        };
        let found = check_user(&f);
        assert_eq!(
            found.iter().map(|f| (f.relation, f.reason, f.repair.is_some())).collect::<Vec<_>>(),
            vec![
                (relation::ACK_HEAD, reason::ACK_ABOVE_HEAD, false),
                (relation::UNREAD, reason::UNREAD_DRIFT, true),
                (relation::UNREAD, reason::MENTIONS_DRIFT, true),
                (relation::EVENT_SOURCE, reason::MESSAGE_MISSING, false),
                (relation::EVENT_SOURCE, reason::PERIOD_FOREIGN, false),
            ]
        );
        assert_eq!((found[0].device.as_deref(), found[0].stored, found[0].fact), (Some("d2"), Some(11), Some(10)));
        assert_eq!(found[1].repair, Some(Repair::Recount { user: "u".into(), conv: "c2".into() }));
        assert!(check_user(&UserFacts { user: "u".into(), ..UserFacts::default() }).is_empty());
    }

    #[test]
    fn conv_rules() {
        assert_eq!(check_conv(&ConvFacts { conv: "c".into(), head: 4, max_msg_seq: 4 }), None);
        let f = check_conv(&ConvFacts { conv: "c".into(), head: 5, max_msg_seq: 4 }).unwrap();
        assert_eq!((f.relation, f.stored, f.fact, f.repair), (relation::CONV_HEAD, Some(5), Some(4), None));
        assert!(check_conv(&ConvFacts { conv: "c".into(), head: 3, max_msg_seq: 4 }).is_some());
    }
}
