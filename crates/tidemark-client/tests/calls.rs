//! The SDK's calls beyond send and sync, each against a real server with
//! its refusals: history paging past a snapshot boundary (C3, D7), groups
//! (G1), edit and react (E2), settings and delete-for-me (E3), delivery
//! receipts (R1) and device revocation (P5).

mod common;

use common::*;
use serde_json::json;
use tidemark_client::proto::ErrorCode;
use tidemark_client::{Client, ConnState, SdkError};
use tidemark_server::ServerConfig;

fn texts(msgs: &[tidemark_client::Message]) -> Vec<(u64, String)> {
    msgs.iter().map(|m| (m.msg_seq, m.content["text"].as_str().unwrap_or_default().to_owned())).collect()
}

/// Snapshots carry the latest 3 messages of a conversation; retention keeps
/// nothing an ACK does not fence and runs only when a test calls it.
fn snapshot_config() -> ServerConfig {
    let mut c = ServerConfig {
        retention_every: std::time::Duration::from_secs(3600),
        snapshot_messages_per_conv: 3,
        ..ServerConfig::default()
    };
    c.retention.as_mut().expect("retention on by default").keep_events_younger_than_ms = 0;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_pages_back_past_a_snapshot_boundary_once_each_and_then_reads_locally() {
    let h = Harness::start_with(snapshot_config()).await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    let laptop = h.ready("bob", "laptop").await;
    for i in 1..=8 {
        send_ok(&alice, &conv, &format!("m{i}")).await;
    }
    wait_messages(&laptop, &conv, 8).await;
    h.wait_log("bob", 8).await;
    h.wait_server_ack("bob", "laptop", 8).await;
    // Every valid device has ACKed the whole log: trimming it means a new
    // device cannot replay it and must start from a snapshot.
    let state = &h.server().state;
    let policy = state.config.retention.unwrap();
    state.store.trim_user_logs(policy, tidemark_server::util::now_ms() + 1).await.unwrap();
    assert_eq!(state.store.user_log("bob").await.unwrap().trimmed_upto, 8);

    let tablet = Client::open(h.config("bob", "tablet")).unwrap();
    tablet.start().await.unwrap();
    tablet
        .wait_for(WAIT, || async { Ok(tablet.conversation(&conv).await?.is_some_and(|c| c.history_to == 5)) })
        .await
        .unwrap();
    tablet.wait_state(ConnState::Ready, WAIT).await.unwrap();
    assert_eq!(
        texts(&tablet.messages(&conv).await.unwrap()),
        vec![(6, "m6".into()), (7, "m7".into()), (8, "m8".into())]
    );

    // Page back from the boundary, two at a time: each older message once,
    // newest first, from the server, stored as it comes.
    let mut paged = Vec::new();
    let mut before = Some(6);
    let mut pages = 0;
    loop {
        let page = tablet.history(&conv, before, 2).await.unwrap();
        assert!(!page.local, "below the snapshot boundary the server answers");
        assert!(!page.trimmed);
        paged.extend(texts(&page.messages));
        pages += 1;
        if !page.has_more {
            break;
        }
        before = page.next_cursor;
        assert!(pages < 10, "paging never ended");
    }
    assert_eq!(paged, (1..=5).rev().map(|i| (i, format!("m{i}"))).collect::<Vec<_>>());
    // Now the whole conversation is held: the local store answers, and the
    // stored pages joined the held run without moving any cursor.
    let summary = tablet.conversation(&conv).await.unwrap().unwrap();
    assert_eq!((summary.history_to, summary.contiguous_msg_seq), (0, 8));
    let all = tablet.history(&conv, None, 50).await.unwrap();
    assert!(all.local && !all.has_more);
    assert_eq!(texts(&all.messages), (1..=8).rev().map(|i| (i, format!("m{i}"))).collect::<Vec<_>>());
    let page = tablet.history(&conv, Some(5), 2).await.unwrap();
    assert!(page.local && page.has_more);
    assert_eq!(page.next_cursor, Some(3));
    assert_eq!(texts(&tablet.messages(&conv).await.unwrap()).len(), 8);
    assert!(matches!(tablet.history(&conv, None, 0).await, Err(SdkError::Invalid(_))));
    // A conversation the user is not in.
    h.user("carol").await;
    let carol = h.ready("carol", "phone").await;
    assert_eq!(refused(carol.history(&conv, None, 10).await), ErrorCode::NotMember);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_are_created_changed_and_left_through_the_sdk() {
    let h = Harness::start().await;
    for u in ["ann", "ben", "cat"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let ben = h.ready("ben", "phone").await;
    let cat = h.ready("cat", "phone").await;
    let group = ann.create_group(&["ben"]).await.unwrap();
    assert_eq!(group.kind, "group");
    let conv = group.conv.clone();
    send_ok(&ann, &conv, "g1").await;
    wait_messages(&ben, &conv, 1).await;

    // Only members change membership, and only the owner removes others.
    assert_eq!(refused(cat.add_member(&conv, "cat").await), ErrorCode::NotMember);
    let join = ann.add_member(&conv, "cat").await.unwrap();
    assert!(join > 0);
    send_ok(&ann, &conv, "g2").await;
    // Cat's view starts at its join: g1 is outside it, on the device and
    // in history.
    cat.wait_for(WAIT, || async { Ok(cat.messages(&conv).await?.iter().any(|m| m.content["text"] == "g2")) })
        .await
        .unwrap();
    // Devices that learned the group from sync know it is a group.
    assert_eq!(ben.conversation(&conv).await.unwrap().unwrap().kind, "group");
    assert_eq!(cat.conversation(&conv).await.unwrap().unwrap().kind, "group");
    let cat_history = cat.history(&conv, None, 50).await.unwrap();
    assert_eq!(cat_history.messages.iter().map(|m| m.content["text"].clone()).collect::<Vec<_>>(), vec![json!("g2")]);
    assert_eq!(refused(ben.remove_member(&conv, "cat").await), ErrorCode::Forbidden);
    let removed = ann.remove_member(&conv, "cat").await.unwrap();
    assert!(removed > join);
    cat.wait_for(WAIT, || async { Ok(cat.conversation(&conv).await?.is_some_and(|c| !c.active)) }).await.unwrap();
    assert_eq!(refused(cat.leave(&conv).await), ErrorCode::NotMember);
    let left = ben.leave(&conv).await.unwrap();
    assert!(left > removed);
    ben.wait_for(WAIT, || async { Ok(ben.conversation(&conv).await?.is_some_and(|c| !c.active)) }).await.unwrap();
}

/// `conv.members` through the SDK: a group's members paged by user id,
/// each once with its join, the owner and `members_seq`; a stranger and a
/// departed member are refused `NOT_MEMBER`, an unknown conversation
/// `NOT_FOUND`, a bad limit never leaves the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_lists_page_through_the_sdk_and_refuse_non_members() {
    let h = Harness::start().await;
    for u in ["ann", "ben", "cat", "dan", "eve"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let dan = h.ready("dan", "phone").await;
    let eve = h.ready("eve", "phone").await;
    let group = ann.create_group(&["cat", "ben"]).await.unwrap();
    let conv = group.conv;
    let joined = ann.add_member(&conv, "dan").await.unwrap();

    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut seqs = Vec::new();
    loop {
        let page = dan.members(&conv, after.as_deref(), 2).await.unwrap();
        assert!(page.members.len() <= 2);
        assert_eq!(page.owner.as_deref(), Some("ann"));
        seqs.push(page.members_seq);
        seen.extend(page.members.into_iter().map(|m| (m.user, m.joined_seq)));
        match page.next_after {
            Some(next) => after = Some(next),
            None => break,
        }
        assert!(seqs.len() < 10, "paging never ended");
    }
    let expected: Vec<(String, u64)> =
        [("ann", 1), ("ben", 1), ("cat", 1), ("dan", joined)].iter().map(|(u, s)| (u.to_string(), *s)).collect();
    assert_eq!(seen, expected, "every member once, by user id, with the join");
    assert_eq!(seqs, vec![joined; 2], "two pages, no change between them");

    assert_eq!(refused(eve.members(&conv, None, 10).await), ErrorCode::NotMember, "a stranger");
    assert_eq!(refused(eve.members("no-such-conv", None, 10).await), ErrorCode::NotFound);
    assert!(matches!(eve.members(&conv, None, 0).await, Err(SdkError::Invalid(_))));
    assert!(matches!(eve.members(&conv, None, 501).await, Err(SdkError::Invalid(_))));
    let left = dan.leave(&conv).await.unwrap();
    assert_eq!(refused(dan.members(&conv, None, 10).await), ErrorCode::NotMember, "a departed member");
    let now = ann.members(&conv, None, 500).await.unwrap();
    assert_eq!(now.members.iter().map(|m| m.user.as_str()).collect::<Vec<_>>(), vec!["ann", "ben", "cat"]);
    assert_eq!((now.members_seq, now.next_after), (left, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_reactions_settings_deletes_and_receipts_through_the_sdk() {
    let h = Harness::start().await;
    h.user("ann").await;
    h.user("ben").await;
    let ann = h.ready("ann", "phone").await;
    let ann_laptop = h.ready("ann", "laptop").await;
    let ben = h.ready("ben", "phone").await;
    let conv = ann.create_direct("ben").await.unwrap();
    send_ok(&ann, &conv, "helo").await;
    let held = wait_messages(&ben, &conv, 1).await;
    let id = held[0].message_id.clone();

    // Edit: a CAS on the version this device holds.
    let edited = ann.edit(&conv, &id, json!({"text": "hello"}), 1).await.unwrap();
    assert_eq!(edited.version, 2);
    assert_eq!(refused(ann.edit(&conv, &id, json!({"text": "stale"}), 1).await), ErrorCode::Conflict);
    assert_eq!(refused(ben.edit(&conv, &id, json!({"text": "not mine"}), 2).await), ErrorCode::Forbidden);
    ben.wait_for(WAIT, || async {
        Ok(ben.messages(&conv).await?.iter().any(|m| m.message_id == id && m.content["text"] == "hello"))
    })
    .await
    .unwrap();

    // React: idempotent; the other side sees it.
    assert!(ben.react(&conv, &id, "👍", true).await.unwrap().changed);
    assert!(!ben.react(&conv, &id, "👍", true).await.unwrap().changed);
    ann.wait_for(WAIT, || async {
        Ok(ann.messages(&conv).await?.iter().any(|m| m.message_id == id && m.reactions["👍"] == json!(["ben"])))
    })
    .await
    .unwrap();
    assert!(ben.react(&conv, &id, "👍", false).await.unwrap().changed);
    assert_eq!(refused(ben.react(&conv, "no-such-message", "👍", true).await), ErrorCode::NotFound);

    // Settings reach the user's other device only.
    let settings = ann.set_conversation_settings(&conv, Some(true), None).await.unwrap();
    assert!(settings.muted && !settings.pinned);
    ann_laptop
        .wait_for(WAIT, || async { Ok(ann_laptop.conversation(&conv).await?.is_some_and(|c| c.muted)) })
        .await
        .unwrap();
    assert!(!ben.conversation(&conv).await.unwrap().unwrap().muted);

    // Delete-for-me hides it on the user's devices, not on the other side.
    ann.delete_for_me(&conv, &id).await.unwrap();
    ann_laptop
        .wait_for(WAIT, || async {
            Ok(ann_laptop.messages(&conv).await?.iter().any(|m| m.message_id == id && m.state == "deleted"))
        })
        .await
        .unwrap();
    assert!(ben.messages(&conv).await.unwrap().iter().any(|m| m.message_id == id && m.state != "deleted"));

    // Delivery receipts are recorded once per device.
    assert_eq!(ben.delivery_ack(std::slice::from_ref(&id)).await.unwrap().recorded, 1);
    assert_eq!(ben.delivery_ack(std::slice::from_ref(&id)).await.unwrap().recorded, 0);

    // Revoking the laptop ends it; revoking a device twice changes nothing.
    assert!(ann.revoke_device("laptop").await.unwrap().revoked);
    assert!(!ann.revoke_device("laptop").await.unwrap().revoked);
    let exit = tokio::time::timeout(WAIT, ann_laptop.closed()).await.expect("the revoked device stops");
    assert!(format!("{exit:?}").to_lowercase().contains("revoked"), "{exit:?}");

    // Without a connection, a call says so at once.
    let mut h = h;
    h.stop_server().await;
    let mut state = ben.watch_state();
    tokio::time::timeout(WAIT, state.wait_for(|s| *s == ConnState::Offline))
        .await
        .expect("the device notices the server is gone")
        .unwrap();
    assert!(matches!(ben.react(&conv, &id, "👍", true).await, Err(SdkError::Offline)));
}

/// P4 through the SDK: register (and replace) this device's push target,
/// list the user's targets with tokens shown only as hash and last four,
/// remove one; a bad target is refused with `BAD_REQUEST`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_targets_are_registered_listed_and_removed_through_the_sdk() {
    use tidemark_client::proto::push::{PreviewLevel, PushRegisterReq};
    let webhook = tidemark_push::webhook::Webhook::new("http://127.0.0.1:9/hook", b"k".to_vec());
    let push = tidemark_server::push::PushConfig {
        providers: vec![std::sync::Arc::new(webhook)],
        ..tidemark_server::push::PushConfig::default()
    };
    let h = Harness::start_with(ServerConfig { push, ..ServerConfig::default() }).await;
    h.user("bob").await;
    let phone = h.ready("bob", "phone").await;
    let desk = h.ready("bob", "desk").await;
    let req = |token: &str, preview| PushRegisterReq {
        platform: "webhook".into(),
        token: token.into(),
        app_id: "chat".into(),
        p256dh: None,
        auth: None,
        preview,
    };
    let shown = phone.register_push(req("phone-token-0001", PreviewLevel::Full)).await.unwrap();
    assert_eq!((shown.device_id.as_str(), shown.token_last4.as_str(), shown.current), ("phone", "0001", true));
    assert_eq!(shown.preview, PreviewLevel::Full);
    let shown = phone.register_push(req("phone-token-0002", PreviewLevel::None)).await.unwrap();
    assert_eq!((shown.token_last4.as_str(), shown.preview), ("0002", PreviewLevel::None), "replaced");
    desk.register_push(req("desk-token-0003", PreviewLevel::Conversation)).await.unwrap();
    let listed = desk.push_targets().await.unwrap();
    let seen: Vec<(&str, &str, bool)> =
        listed.iter().map(|t| (t.device_id.as_str(), t.token_last4.as_str(), t.current)).collect();
    assert_eq!(seen, vec![("desk", "0003", true), ("phone", "0002", false)]);
    assert!(!format!("{listed:?}").contains("phone-token"), "{listed:?}");
    let bad = PushRegisterReq { platform: "webpush".into(), ..req("not-a-url", PreviewLevel::None) };
    assert_eq!(refused(phone.register_push(bad).await), ErrorCode::BadRequest);
    assert!(desk.remove_push(Some("phone")).await.unwrap());
    assert!(!phone.remove_push(None).await.unwrap(), "already removed");
    assert_eq!(desk.push_targets().await.unwrap().len(), 1);

    // The user's and a conversation's preview preferences (the most
    // private of them and the device's level is what a push says).
    assert_eq!(
        desk.set_push_preview(PreviewLevel::Conversation).await.unwrap().push_preview,
        PreviewLevel::Conversation
    );
    h.user("ann").await;
    let conv = desk.create_direct("ann").await.unwrap();
    let set = desk.set_conversation_push_preview(&conv, PreviewLevel::None).await.unwrap();
    assert_eq!((set.push_preview, set.muted), (PreviewLevel::None, false));
    let kept = desk.set_conversation_settings(&conv, Some(true), None).await.unwrap();
    assert_eq!((kept.push_preview, kept.muted), (PreviewLevel::None, true), "a mute keeps the preference");
    // The local store learns the preference from the settings events.
    desk.wait_for(WAIT, || async {
        Ok(desk.conversation(&conv).await?.is_some_and(|c| c.muted && c.push_preview == "none"))
    })
    .await
    .expect("the local conversation holds the preference");
}
