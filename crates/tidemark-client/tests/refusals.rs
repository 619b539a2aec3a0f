//! The SDK calls whose refusals (or whose use at all) no other test covers,
//! against a real server: each is made once as an app would and once where
//! the contract refuses it, with the code checked. Calls through the outbox
//! (`send_kind`, `recall`, `mark_read`) are refused into a `failed` entry
//! that names the code; calls on the connection into
//! [`SdkError::Refused`]; what the SDK can judge alone (a bad kind, null
//! content, a bad page limit, a second start) never leaves the device. The
//! call-by-call list of tests is in issue 17's audit (report of the `sdk`
//! branch).

mod common;

use common::*;
use serde_json::json;
use tidemark_client::proto::ErrorCode;
use tidemark_client::{Client, OutboxEntry, OutboxState, SdkError};

/// Waits until the outbox entry `entry` leaves `pending`; returns it.
async fn settled(client: &Client, entry: &OutboxEntry) -> OutboxEntry {
    let id = entry.client_msg_id.clone();
    client
        .wait_for(WAIT, || async {
            Ok(client.outbox_entry(&id).await?.is_some_and(|e| e.state != OutboxState::Pending))
        })
        .await
        .unwrap_or_else(|e| panic!("outbox entry {id} never settled: {e}"));
    client.outbox_entry(&id).await.unwrap().unwrap()
}

/// A failed outbox entry names the contract code the server refused with.
fn failed_with(entry: &OutboxEntry, code: ErrorCode) {
    assert_eq!(entry.state, OutboxState::Failed, "{entry:?}");
    let error = entry.error.as_deref().unwrap_or_default();
    assert!(error.contains(code.as_str()), "{code:?} expected: {entry:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_calls_send_kinds_recall_and_read_and_are_refused_into_failed_entries() {
    let h = Harness::start().await;
    for u in ["ann", "ben", "cat"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let ben = h.ready("ben", "phone").await;
    let cat = h.ready("cat", "phone").await;
    let conv = ann.create_direct("ben").await.unwrap();

    // send_kind: the kind travels with the message; what the server would
    // refuse forever is refused before it is queued.
    let card = ann.send_kind(&conv, "card.v1", json!({ "title": "hi" })).await.unwrap();
    assert_eq!(settled(&ann, &card).await.state, OutboxState::Accepted);
    let held = wait_messages(&ben, &conv, 1).await;
    assert_eq!((held[0].kind.as_str(), held[0].content["title"].clone()), ("card.v1", json!("hi")));
    assert!(matches!(ann.send_kind(&conv, "no spaces", json!({})).await, Err(SdkError::Invalid(_))));
    assert!(matches!(ann.send_kind(&conv, "text", serde_json::Value::Null).await, Err(SdkError::Invalid(_))));
    assert!(matches!(ann.send_kind("", "text", json!({})).await, Err(SdkError::Invalid(_))));
    // A conversation the sender is not in: the entry fails, the next goes.
    let stranger = cat.send(&conv, json!({ "text": "let me in" })).await.unwrap();
    failed_with(&settled(&cat, &stranger).await, ErrorCode::NotMember);

    // recall: only the sender's own message; ben's recall of ann's fails.
    let text = ann.send(&conv, json!({ "text": "oops" })).await.unwrap();
    let text = settled(&ann, &text).await;
    let id = text.message_id.clone().unwrap();
    wait_messages(&ben, &conv, 2).await;
    let not_his = ben.recall(&conv, &id).await.unwrap();
    failed_with(&settled(&ben, &not_his).await, ErrorCode::Forbidden);
    let recall = ann.recall(&conv, &id).await.unwrap();
    assert_eq!(settled(&ann, &recall).await.state, OutboxState::Accepted);
    ben.wait_for(WAIT, || async {
        Ok(ben.messages(&conv).await?.iter().any(|m| m.message_id == id && m.state == "recalled"))
    })
    .await
    .unwrap();
    let gone = ann.recall(&conv, "no-such-message").await.unwrap();
    failed_with(&settled(&ann, &gone).await, ErrorCode::NotFound);
    assert!(matches!(ann.recall(&conv, "").await, Err(SdkError::Invalid(_))));

    // mark_read: a stranger's read fails; a member's moves the position.
    let read = cat.mark_read(&conv, 1).await.unwrap();
    failed_with(&settled(&cat, &read).await, ErrorCode::NotMember);
    let read = ben.mark_read(&conv, 2).await.unwrap();
    assert_eq!(settled(&ben, &read).await.state, OutboxState::Accepted);

    // events: control events are held beside the messages, in order.
    let kinds: Vec<String> = ben.events(&conv).await.unwrap().into_iter().map(|e| e.kind).collect();
    assert!(kinds.contains(&"recall".to_owned()), "{kinds:?}");
    assert!(ben.messages(&conv).await.unwrap().iter().all(|m| m.kind != "recall"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_calls_without_a_refusal_test_elsewhere_are_refused_as_documented() {
    let h = Harness::start().await;
    for u in ["ann", "ben", "cat"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let cat = h.ready("cat", "phone").await;
    let conv = ann.create_direct("ben").await.unwrap();
    let (_, _) = send_ok(&ann, &conv, "hello").await;

    // The lifecycle: a bad configuration and a second start.
    let mut bad = h.config("ann", "bad");
    bad.sync_page_limit = 0;
    assert!(matches!(Client::open(bad), Err(SdkError::Invalid(_))));
    assert!(matches!(ann.start().await, Err(SdkError::AlreadyRunning)));

    // Conversations.
    assert_eq!(refused(ann.create_direct("nobody").await), ErrorCode::NotFound);
    assert_eq!(refused(ann.create_group(&["ben", "nobody"]).await), ErrorCode::NotFound);
    assert_eq!(refused(cat.set_conversation_settings(&conv, Some(true), None).await), ErrorCode::NotMember);
    assert_eq!(refused(cat.set_conversation_settings("no-such-conv", None, Some(true)).await), ErrorCode::NotFound);
    assert_eq!(refused(ann.delete_for_me(&conv, "no-such-message").await), ErrorCode::NotFound);
    // A message outside the caller's periods is not found for them
    // (docs/protocol.md §3.17), a stranger's case included.
    let hello = wait_messages(&ann, &conv, 1).await[0].message_id.clone();
    assert_eq!(refused(cat.delete_for_me(&conv, &hello).await), ErrorCode::NotFound);
    assert!(cat.open_conversation(&conv).await.is_err(), "a stranger cannot pull a conversation");
    // Receipts and typing, by a stranger.
    assert_eq!(refused(cat.conv_receipts(&conv, None).await), ErrorCode::NotMember);
    assert_eq!(refused(cat.conv_receipts("no-such-conv", None).await), ErrorCode::NotFound);
    assert_eq!(refused(cat.typing(&conv, true, None).await), ErrorCode::NotMember);
    let too_many: Vec<String> = (0..=500).map(|i| format!("m{i}")).collect();
    assert_eq!(refused(ann.delivery_ack(&too_many).await), ErrorCode::BadRequest);
    assert_eq!(refused(ann.delivery_receipts(&conv, too_many).await), ErrorCode::BadRequest);

    // Devices, account and push targets.
    assert_eq!(refused(ann.revoke_device("not a device id").await), ErrorCode::BadRequest);
    assert_eq!(refused(ann.revoke_device("never-seen").await), ErrorCode::NotFound, "a device the user never had");
    assert_eq!(refused(ann.change_password("not it", "new secret").await), ErrorCode::Unauthenticated);
    assert_eq!(refused(ann.change_password(PASSWORD, "").await), ErrorCode::BadRequest);
    assert_eq!(refused(ann.remove_push(Some("not a device id")).await), ErrorCode::BadRequest);
    assert!(ann.push_targets().await.unwrap().is_empty());
    assert!(!ann.remove_push(None).await.unwrap(), "no target to remove");
    // Presence and privacy take any state; the switches read back.
    let privacy = ann.set_privacy(None, None).await.unwrap();
    assert!(!privacy.hide_presence && !privacy.private_receipts);

    // Without a connection every connection call says so at once, and the
    // local reads go on.
    let mut h = h;
    h.stop_server().await;
    cat.wait_state(tidemark_client::ConnState::Offline, WAIT).await.unwrap();
    assert!(matches!(cat.devices().await, Err(SdkError::Offline)));
    assert!(matches!(cat.push_targets().await, Err(SdkError::Offline)));
    assert!(matches!(cat.members(&conv, None, 10).await, Err(SdkError::Offline)));
    assert!(matches!(cat.server_conversations().await, Err(SdkError::Offline)));
    assert_eq!(ann.messages(&conv).await.unwrap().len(), 1, "local reads work offline");
}
