use serde_json::{json, Value};
use tidemark_proto::{SendOk, SyncOk, UserEvent};

use super::*;

// Built from JSON, as they arrive on the wire, so fields the protocol
// adds later take their defaults here too.
fn conv_event(sync_seq: u64, conv: &str, msg_seq: u64, kind: &str, sender: &str, content: Value) -> UserEvent {
    let event_kind = match kind {
        "recall" | "edit" | "reaction" => kind,
        "member.join" | "member.leave" | "conv.created" => "membership",
        _ => "message",
    };
    serde_json::from_value(json!({
        "sync_seq": sync_seq, "kind": event_kind, "conv": conv, "msg_seq": msg_seq,
        "message": {
            "message_id": format!("m-{conv}-{msg_seq}"), "conv": conv, "msg_seq": msg_seq, "kind": kind,
            "state": "normal", "sender": sender, "content": content, "created_at": 1000 + msg_seq, "version": 1,
        },
    }))
    .unwrap()
}

fn event(sync_seq: u64, conv: &str, msg_seq: u64, sender: &str) -> UserEvent {
    conv_event(sync_seq, conv, msg_seq, "text", sender, json!({ "n": msg_seq }))
}

fn page_at(generation: u64, resume_from: u64, events: Vec<UserEvent>, hw: u64) -> SyncOk {
    serde_json::from_value(json!({
        "sync_generation": generation, "resume_from": resume_from, "batch_high_watermark": hw,
        "server_acked_sync_seq": resume_from, "events": events, "next_cursor": null, "has_more": false,
        "batch_token": "t",
    }))
    .unwrap()
}

fn page(events: Vec<UserEvent>, hw: u64) -> SyncOk {
    page_at(1, 0, events, hw)
}

fn open() -> (tempfile::TempDir, LocalStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = LocalStore::open(&dir.path().join("local.db"), "bob", "phone").unwrap();
    (dir, s)
}

const GO: &dyn Fn(&FaultPoint) -> FaultAction = &|_| FaultAction::Continue;

#[test]
fn control_kinds_sql_matches_the_list() {
    let listed: Vec<String> = CONTROL_KINDS.iter().map(|k| format!("'{k}'")).collect();
    assert_eq!(CONTROL_KINDS_SQL, format!("({})", listed.join(", ")));
}

#[test]
fn a_page_and_its_replay_apply_once() {
    let (_d, mut s) = open();
    let p = page(vec![event(1, "c1", 1, "ann"), event(2, "c1", 2, "bob"), event(3, "c1", 3, "ann")], 3);
    let r = s.apply_page(&p, GO).unwrap();
    assert_eq!((r.applied, r.skipped, r.applied_sync_seq), (3, 0, 3));
    assert_eq!(r.cursors, vec![CursorMove { conv: "c1".into(), from: 0, to: 3 }]);
    let r = s.apply_page(&p, GO).unwrap();
    assert_eq!((r.applied, r.skipped), (0, 3), "a replayed batch is skipped");
    let c = s.conversation("c1").unwrap().unwrap();
    assert_eq!((c.contiguous_msg_seq, c.last_msg_seq, c.read_seq, c.unread), (3, 3, 2, 1));
    assert_eq!(s.messages("c1").unwrap().len(), 3);
}

#[test]
fn a_hole_in_the_user_log_applies_nothing() {
    let (_d, mut s) = open();
    let err = s.apply_page(&page(vec![event(1, "c1", 1, "ann"), event(3, "c1", 2, "ann")], 3), GO).unwrap_err();
    assert_eq!(err, ApplyError::Hole { expected: 2, got: 3 });
    assert_eq!(s.position().unwrap(), SyncPosition::default(), "rolled back");
    assert!(s.messages("c1").unwrap().is_empty());
}

#[test]
fn an_aborted_page_leaves_nothing() {
    let (_d, mut s) = open();
    let abort: &dyn Fn(&FaultPoint) -> FaultAction = &|_| FaultAction::Abort;
    let err = s.apply_page(&page(vec![event(1, "c1", 1, "ann")], 1), abort).unwrap_err();
    assert!(matches!(err, ApplyError::Store(StoreError::Aborted(FaultPoint::BeforeCommit { .. }))));
    assert_eq!(s.position().unwrap(), SyncPosition::default());
    assert!(s.conversations().unwrap().is_empty());
}

#[test]
fn a_newer_generation_is_adopted_only_when_it_skips_nothing() {
    let (_d, mut s) = open();
    s.apply_page(&page(vec![event(1, "c1", 1, "ann"), event(2, "c1", 2, "ann")], 2), GO).unwrap();
    // A replay from above what is applied would skip sync_seq 3.
    let err = s.apply_page(&page_at(2, 3, vec![event(4, "c1", 4, "ann")], 4), GO).unwrap_err();
    assert!(matches!(err, ApplyError::GenerationMismatch { local: 1, page: 2, .. }));
    // An older generation is stale.
    let err = s.apply_page(&page_at(0, 0, vec![], 2), GO).unwrap_err();
    assert!(matches!(err, ApplyError::GenerationMismatch { local: 1, page: 0, .. }));
    // A recovery replay from this device's own position (D6).
    let r = s.apply_page(&page_at(2, 2, vec![event(3, "c1", 3, "ann")], 3), GO).unwrap();
    assert_eq!(r.applied, 1);
    assert_eq!(s.position().unwrap().generation, Some(2));
}

#[test]
fn own_send_above_a_gap_waits_then_the_log_fills_it() {
    let (_d, mut s) = open();
    s.apply_page(&page(vec![event(1, "c1", 1, "ann")], 1), GO).unwrap();
    let e = s.enqueue("cm-1", OutboxOp::Send, "c1", "text", &json!({"n": 3})).unwrap();
    let ok: SendOk = serde_json::from_value(
        json!({"message_id": "m-c1-3", "conv": "c1", "msg_seq": 3, "created_at": 5, "duplicate": false}),
    )
    .unwrap();
    let rec = s.record_send_ok(e.id, &ok).unwrap();
    assert_eq!(rec.cursor, None, "3 is above the gap at 2");
    assert_eq!(rec.gap.as_ref().map(|g| (g.missing_from, g.missing_to)), Some((2, 2)));
    let p = page_at(1, 1, vec![event(2, "c1", 2, "ann"), event(3, "c1", 3, "bob")], 3);
    let r = s.apply_page(&p, GO).unwrap();
    assert_eq!(r.cursors, vec![CursorMove { conv: "c1".into(), from: 1, to: 3 }]);
    assert!(r.gaps.is_empty());
    let msgs = s.messages("c1").unwrap();
    assert_eq!(msgs.iter().map(|m| m.msg_seq).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(msgs[2].sync_seq, Some(3), "the log's copy records its sync_seq");
}

#[test]
fn a_recall_leaves_a_placeholder_and_late_edits_do_not_revive_it() {
    let (_d, mut s) = open();
    let target = "m-c1-1";
    let events = vec![
        event(1, "c1", 1, "ann"),
        conv_event(
            2,
            "c1",
            2,
            "edit",
            "ann",
            json!({"target_message_id": target, "target_msg_seq": 1,
                                                      "version": 2, "content": {"text": "edited"}}),
        ),
        conv_event(3, "c1", 3, "recall", "ann", json!({"target_message_id": target, "target_msg_seq": 1})),
        conv_event(
            4,
            "c1",
            4,
            "reaction",
            "bob",
            json!({"target_message_id": target, "target_msg_seq": 1,
                                                          "reaction": "+1", "op": "add", "user": "bob",
                                                          "version": 9}),
        ),
    ];
    let r = s.apply_page(&page(events, 4), GO).unwrap();
    assert_eq!(r.recalled, vec![("c1".to_owned(), 1)]);
    assert_eq!(r.cursors, vec![CursorMove { conv: "c1".into(), from: 0, to: 4 }], "control events hold seqs");
    let msgs = s.messages("c1").unwrap();
    assert_eq!(msgs.len(), 1, "control events are not messages");
    assert_eq!((msgs[0].state.as_str(), &msgs[0].content, &msgs[0].reactions), ("recalled", &json!({}), &json!({})));
    let edit = s.events("c1").unwrap().into_iter().find(|m| m.kind == "edit").unwrap();
    assert!(edit.content.get("content").is_none(), "the edit's text is discarded too");
    let c = s.conversation("c1").unwrap().unwrap();
    assert_eq!(c.unread, 0, "a placeholder is not unread");
}

#[test]
fn edits_and_reactions_apply_only_above_the_version_held() {
    let (_d, mut s) = open();
    let t = "m-c1-1";
    let edit = |seq, version, text: &str| {
        conv_event(
            seq,
            "c1",
            seq,
            "edit",
            "ann",
            json!({"target_message_id": t, "target_msg_seq": 1,
                                                          "version": version, "content": {"text": text}}),
        )
    };
    let events = vec![event(1, "c1", 1, "ann"), edit(2, 3, "newer"), edit(3, 2, "older")];
    s.apply_page(&page(events, 3), GO).unwrap();
    let m = &s.messages("c1").unwrap()[0];
    assert_eq!((m.content["text"].as_str(), m.version, m.state.as_str()), (Some("newer"), 3, "edited"));
}

#[test]
fn a_join_starts_the_cursor_at_the_period() {
    let (_d, mut s) = open();
    let join = conv_event(1, "g1", 7, "member.join", "ann", json!({"user": "bob", "by": "ann", "op": "add"}));
    let r = s.apply_page(&page(vec![join, event(2, "g1", 8, "ann")], 2), GO).unwrap();
    assert_eq!(r.cursors, vec![CursorMove { conv: "g1".into(), from: 0, to: 8 }]);
    assert!(r.gaps.is_empty(), "msg_seq 1..=6 are outside bob's period, not a gap");
    // Someone else's join is just an event.
    let other = conv_event(3, "g1", 10, "member.join", "ann", json!({"user": "cat", "by": "ann", "op": "add"}));
    let r = s.apply_page(&page_at(1, 2, vec![other], 3), GO).unwrap();
    assert_eq!(r.gaps.len(), 1, "msg_seq 9 is missing");
}

#[test]
fn a_rejoin_skips_only_the_time_out_not_the_previous_periods_tail() {
    // A shared group (G2): bob held 1..=4; 5 and 6 are messages of his
    // first period, read by conv.sync, not in his log; his leave (7) and
    // rejoin (9) are, and arrive first. 8 is outside his periods.
    let (_d, mut s) = open();
    let join = |sync_seq, msg_seq| {
        conv_event(sync_seq, "g1", msg_seq, "member.join", "ann", json!({"user": "bob", "by": "ann", "op": "add"}))
    };
    let leave = conv_event(5, "g1", 7, "member.leave", "ann", json!({"user": "bob", "by": "ann", "op": "remove"}));
    let first: Vec<UserEvent> = (1..=4).map(|m| event(m, "g1", m, "ann")).collect();
    s.apply_page(&page(first, 4), GO).unwrap();
    let r = s.apply_page(&page_at(1, 4, vec![leave.clone(), join(6, 9)], 6), GO).unwrap();
    assert!(r.cursors.is_empty(), "nothing below the leave may be skipped: {:?}", r.cursors);
    assert_eq!(r.gaps.len(), 1, "msg_seq 5..=6 are missing");
    assert_eq!(s.conversation("g1").unwrap().unwrap().contiguous_msg_seq, 4);
    // The pull from 5 serves 5, 6, the leave and the join again.
    let env = |e: &UserEvent| e.message.clone().unwrap();
    let pulled = vec![env(&event(0, "g1", 5, "ann")), env(&event(0, "g1", 6, "ann")), env(&leave), env(&join(0, 9))];
    s.apply_pull("g1", &pulled, true, 10).unwrap();
    assert_eq!(s.conversation("g1").unwrap().unwrap().contiguous_msg_seq, 9, "8 is the time bob was out");

    // Once the previous period is held, a rejoin skips the time out at once.
    let leave2 = conv_event(7, "g1", 10, "member.leave", "ann", json!({"user": "bob", "by": "ann", "op": "remove"}));
    let r = s.apply_page(&page_at(1, 6, vec![leave2, join(8, 12)], 8), GO).unwrap();
    assert!(r.gaps.is_empty(), "{:?}", r.gaps);
    assert_eq!(s.conversation("g1").unwrap().unwrap().contiguous_msg_seq, 12);
}

#[test]
fn per_user_events_move_the_read_position_and_settings() {
    let (_d, mut s) = open();
    let events = vec![
        event(1, "c1", 1, "ann"),
        event(2, "c1", 2, "ann"),
        serde_json::from_value(json!({"sync_seq": 3, "kind": "read", "conv": "c1", "msg_seq": 1,
                                      "data": {"read_seq": 1, "unread": 1}}))
        .unwrap(),
        serde_json::from_value(json!({"sync_seq": 4, "kind": "settings", "conv": "c1",
                                      "data": {"muted": true, "pinned": false, "version": 1}}))
        .unwrap(),
        serde_json::from_value(json!({"sync_seq": 5, "kind": "future.kind", "conv": "c1"})).unwrap(),
    ];
    let r = s.apply_page(&page(events, 5), GO).unwrap();
    assert_eq!((r.applied, r.kept_verbatim, r.reads.clone()), (5, 1, vec![("c1".to_owned(), 1)]));
    let c = s.conversation("c1").unwrap().unwrap();
    assert_eq!((c.read_seq, c.unread, c.muted), (1, 1, true));
    assert_eq!(s.kept_verbatim().unwrap(), vec![(5, "future.kind".to_owned(), "c1".to_owned())]);
}

#[test]
fn reset_keeps_the_outbox() {
    let (_d, mut s) = open();
    s.apply_page(&page(vec![event(1, "c1", 1, "ann")], 1), GO).unwrap();
    s.enqueue("cm-1", OutboxOp::Send, "c1", "text", &json!({})).unwrap();
    s.reset(Some(7)).unwrap();
    assert_eq!(s.position().unwrap(), SyncPosition { generation: Some(7), applied_sync_seq: 0, acked_sync_seq: 0 });
    assert!(s.conversations().unwrap().is_empty());
    assert_eq!(s.next_pending().unwrap().unwrap().client_msg_id, "cm-1");
}

#[test]
fn the_manifest_digest_is_the_documented_one() {
    // docs/protocol.md §3.22: the empty input, then keys sorted, no
    // whitespace, one newline per item.
    assert_eq!(manifest_digest([]), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    let item = json!({"type": "conv", "conv": "c1", "active": true});
    use sha2::Digest;
    let want: String = sha2::Sha256::digest(b"{\"active\":true,\"conv\":\"c1\",\"type\":\"conv\"}\n")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(manifest_digest([&item]), want);
}

#[test]
fn a_store_belongs_to_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("local.db");
    drop(LocalStore::open(&path, "bob", "phone").unwrap());
    assert!(matches!(LocalStore::open(&path, "bob", "desktop"), Err(StoreError::WrongOwner { .. })));
}

/// `(last_msg_seq, read_seq, unread, mentions)` of `conv` counted from every
/// held message, as the summary was before it was counted by the page.
fn whole_count(s: &LocalStore, conv: &str) -> (i64, i64, i64, i64) {
    let sql = format!(
        "SELECT (SELECT COALESCE(MAX(msg_seq), 0) FROM messages WHERE conv = c.conv),
                MAX(c.read_seq, (SELECT COALESCE(MAX(msg_seq), 0) FROM messages WHERE conv = c.conv AND sender = ?2)),
                (SELECT COUNT(*) FROM messages m WHERE m.conv = c.conv AND m.sender <> ?2 AND m.msg_seq > c.read_seq
                   AND m.kind NOT IN {CONTROL_KINDS_SQL} AND m.state NOT IN ('recalled', 'deleted'))
                  + CASE WHEN c.read_seq < c.history_to THEN c.unread_below ELSE 0 END,
                (SELECT COUNT(*) FROM messages m WHERE m.conv = c.conv AND m.sender <> ?2 AND m.msg_seq > c.read_seq
                   AND m.kind NOT IN {CONTROL_KINDS_SQL} AND m.state NOT IN ('recalled', 'deleted')
                   AND (m.mention_all = 1 OR EXISTS (SELECT 1 FROM json_each(m.mentions) j WHERE j.value = ?2)))
                  + CASE WHEN c.read_seq < c.history_to THEN c.mentions_below ELSE 0 END
         FROM conversations c WHERE c.conv = ?1"
    );
    s.conn.query_row(&sql, params![conv, s.user], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))).unwrap()
}

/// One step of [`summary_counts_as_a_whole_recount_would`]'s random pages.
#[derive(Debug, Clone)]
enum Step {
    /// A message from `ann` (`mention`: 0 none, 1 bob, 2 everyone) or from
    /// bob himself; `skip` leaves the next `msg_seq` out, to come later.
    Message {
        conv: usize,
        own: bool,
        mention: u8,
        skip: bool,
    },
    /// A message left out earlier arrives.
    Fill {
        conv: usize,
    },
    Recall {
        conv: usize,
        pick: usize,
    },
    Delete {
        conv: usize,
        pick: usize,
    },
    Edit {
        conv: usize,
        pick: usize,
    },
    Read {
        conv: usize,
        back: u64,
    },
    /// The page ends here.
    EndPage,
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        6 => (0..2usize, any::<bool>(), 0..3u8, proptest::bool::weighted(0.25))
            .prop_map(|(conv, own, mention, skip)| Step::Message { conv, own, mention, skip }),
        2 => (0..2usize).prop_map(|conv| Step::Fill { conv }),
        1 => (0..2usize, any::<usize>()).prop_map(|(conv, pick)| Step::Recall { conv, pick }),
        1 => (0..2usize, any::<usize>()).prop_map(|(conv, pick)| Step::Delete { conv, pick }),
        1 => (0..2usize, any::<usize>()).prop_map(|(conv, pick)| Step::Edit { conv, pick }),
        1 => (0..2usize, 0..4u64).prop_map(|(conv, back)| Step::Read { conv, back }),
        3 => Just(Step::EndPage),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 128, ..Default::default() })]

    /// However messages arrive (appended, late into a gap, recalled, deleted
    /// for me, edited, read past), the unread and mention counts a page
    /// leaves are those of counting the whole conversation again.
    #[test]
    fn summary_counts_as_a_whole_recount_would(steps in proptest::collection::vec(step(), 1..60)) {
        let (_d, mut s) = open();
        let convs = ["c1", "c2"];
        // Per conversation: the next msg_seq, those left out, the messages held.
        let mut next = [1u64; 2];
        let mut missing: [Vec<u64>; 2] = Default::default();
        let mut held: [Vec<String>; 2] = Default::default();
        let mut version = 1u64;
        let (mut sync_seq, mut events) = (0u64, Vec::new());
        let message = |sync_seq: u64, conv: &str, msg_seq: u64, sender: &str, mention: u8| -> UserEvent {
            serde_json::from_value(json!({
                "sync_seq": sync_seq, "kind": "message", "conv": conv, "msg_seq": msg_seq,
                "message": {
                    "message_id": format!("m-{conv}-{msg_seq}"), "conv": conv, "msg_seq": msg_seq, "kind": "text",
                    "state": "normal", "sender": sender, "content": {"n": msg_seq}, "created_at": 1000,
                    "version": 1, "mentions": if mention == 1 { json!(["bob"]) } else { json!([]) },
                    "mention_all": mention == 2,
                },
            }))
            .unwrap()
        };
        for (i, st) in steps.iter().chain(std::iter::once(&Step::EndPage)).enumerate() {
            let mut seq = || { sync_seq += 1; sync_seq };
            match st.clone() {
                Step::Message { conv, own, mention, skip } => {
                    if skip {
                        missing[conv].push(next[conv]);
                        next[conv] += 1;
                    }
                    let (c, m) = (convs[conv], next[conv]);
                    next[conv] += 1;
                    events.push(message(seq(), c, m, if own { "bob" } else { "ann" }, mention));
                    held[conv].push(format!("m-{c}-{m}"));
                }
                Step::Fill { conv } => {
                    if let Some(m) = missing[conv].pop() {
                        let c = convs[conv];
                        events.push(message(seq(), c, m, "ann", 1));
                        held[conv].push(format!("m-{c}-{m}"));
                    }
                }
                Step::Recall { conv, pick } | Step::Edit { conv, pick } if !held[conv].is_empty() => {
                    let (c, target) = (convs[conv], held[conv][pick % held[conv].len()].clone());
                    let m = next[conv];
                    next[conv] += 1;
                    version += 1;
                    events.push(match st {
                        Step::Recall { .. } => conv_event(seq(), c, m, "recall", "ann",
                            json!({"target_message_id": target})),
                        _ => conv_event(seq(), c, m, "edit", "ann",
                            json!({"target_message_id": target, "version": version, "content": {"text": "e"}})),
                    });
                }
                Step::Delete { conv, pick } if !held[conv].is_empty() => {
                    let target = held[conv][pick % held[conv].len()].clone();
                    events.push(serde_json::from_value(json!({"sync_seq": seq(), "kind": "delete",
                        "conv": convs[conv], "data": {"message_id": target}})).unwrap());
                }
                Step::Read { conv, back } => {
                    let read_seq = next[conv].saturating_sub(back);
                    events.push(serde_json::from_value(json!({"sync_seq": seq(), "kind": "read",
                        "conv": convs[conv], "data": {"read_seq": read_seq, "unread": 0}})).unwrap());
                }
                Step::Recall { .. } | Step::Edit { .. } | Step::Delete { .. } => {}
                Step::EndPage => {
                    if events.is_empty() {
                        continue;
                    }
                    let p = page(std::mem::take(&mut events), sync_seq);
                    s.apply_page(&p, GO).unwrap();
                    for conv in convs {
                        let Some(c) = s.conversation(conv).unwrap() else { continue };
                        let got = (c.last_msg_seq as i64, c.read_seq as i64, c.unread as i64, c.mentions as i64);
                        proptest::prop_assert_eq!(got, whole_count(&s, conv), "{} after step {}", conv, i);
                    }
                }
            }
        }
    }
}

#[test]
fn a_late_message_below_the_counted_ones_is_counted() {
    let (_d, mut s) = open();
    s.apply_page(&page(vec![event(1, "c1", 1, "ann"), event(2, "c1", 3, "ann")], 2), GO).unwrap();
    assert_eq!(s.conversation("c1").unwrap().unwrap().unread, 2);
    s.apply_page(&page_at(1, 2, vec![event(3, "c1", 2, "ann")], 3), GO).unwrap();
    let c = s.conversation("c1").unwrap().unwrap();
    assert_eq!((c.contiguous_msg_seq, c.last_msg_seq, c.unread), (3, 3, 3), "the gap's message counts once it arrives");
}

#[test]
fn one_conversation_is_read_by_its_key_as_the_list_shows_it() {
    let (_d, mut s) = open();
    let events = vec![event(1, "c1", 1, "ann"), event(2, "c2", 1, "bob"), event(3, "c1", 2, "ann")];
    s.apply_page(&page(events, 3), GO).unwrap();
    let list = s.conversations().unwrap();
    assert_eq!(list.len(), 2);
    for c in &list {
        assert_eq!(s.conversation(&c.conv).unwrap().as_ref(), Some(c));
    }
    assert_eq!(s.conversation("c9").unwrap(), None);
}

/// The ACK's record skips its own fsync, and only it: the pages' commits
/// that follow are `synchronous=FULL` again.
#[test]
fn recording_an_ack_leaves_the_store_fully_synchronous() {
    let (_d, mut s) = open();
    s.apply_page(&page(vec![event(1, "c1", 1, "ann")], 1), GO).unwrap();
    s.record_ack(1, 1).unwrap();
    let level: i64 = s.conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
    assert_eq!(level, 2, "FULL");
    assert_eq!(s.position().unwrap().acked_sync_seq, 1);
}

/// A repair that removes a held row (here a message the server serves at
/// another place) leaves counts of the rows that remain.
#[test]
fn a_repair_that_removes_a_counted_message_counts_again() {
    let (_d, mut s) = open();
    s.apply_page(&page(vec![event(1, "c1", 1, "ann"), event(2, "c1", 2, "ann")], 2), GO).unwrap();
    assert_eq!(s.conversation("c1").unwrap().unwrap().unread, 2);
    // The server's log has m-c1-1 at msg_seq 3: the row at 1 goes.
    let mut moved = event(3, "c1", 1, "ann").message.unwrap();
    moved.msg_seq = 3;
    s.apply_repair("c1", &[moved], true, 4).unwrap();
    let held: Vec<u64> = s.messages("c1").unwrap().iter().map(|m| m.msg_seq).collect();
    assert_eq!(held, vec![2, 3]);
    let c = s.conversation("c1").unwrap().unwrap();
    assert_eq!((c.unread as i64, c.last_msg_seq as i64), (whole_count(&s, "c1").2, 3));
    assert_eq!(c.unread, 2);
}
