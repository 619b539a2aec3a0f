//! K3: the outbox is durable and ordered. Sends queued while offline, or
//! whose reply was lost in a crash, go out after the reconnect in their
//! original order, with their original `client_msg_id`, before a send the
//! app makes after the reconnect.

mod common;

use common::*;
use tidemark_client::{Client, ConnState, Exit, FaultPoint, OutboxState};
use tidemark_server::ServerConfig;

/// Waits until every outbox entry is accepted; returns
/// `(text, msg_seq, duplicate)` in send order.
async fn accepted(client: &Client) -> Vec<(String, u64, bool)> {
    client
        .wait_for(WAIT, || async { Ok(client.outbox().await?.iter().all(|e| e.state == OutboxState::Accepted)) })
        .await
        .unwrap();
    client
        .outbox()
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.content["text"].as_str().unwrap_or("").to_owned(), e.msg_seq.unwrap(), e.duplicate))
        .collect()
}

async fn texts(client: &Client, conv: &str, n: usize) -> Vec<String> {
    wait_messages(client, conv, n).await.into_iter().map(|m| m.content["text"].as_str().unwrap().to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_queued_offline_go_out_in_order_before_a_new_send() {
    let mut h = Harness::start().await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();

    // The server goes away: Alice's client is kicked (shutdown) and keeps
    // retrying with backoff while the app queues three sends.
    h.stop_server().await;
    let mut state = alice.watch_state();
    tokio::time::timeout(WAIT, state.wait_for(|s| *s != ConnState::Ready)).await.expect("disconnected").unwrap();
    for text in ["m1", "m2", "m3"] {
        alice.send(&conv, serde_json::json!({ "text": text })).await.unwrap();
    }
    let pending = alice.outbox().await.unwrap();
    assert!(pending.iter().all(|e| e.state == OutboxState::Pending), "nothing can leave while offline");

    // The server comes back; as soon as the client is connected again the
    // app sends a fourth message.
    h.restart_server(ServerConfig::default()).await;
    tokio::time::timeout(WAIT, state.wait_for(|s| matches!(s, ConnState::Syncing | ConnState::Ready)))
        .await
        .expect("reconnected")
        .unwrap();
    alice.send(&conv, serde_json::json!({ "text": "m4" })).await.unwrap();

    assert_eq!(
        accepted(&alice).await,
        vec![("m1".into(), 1, false), ("m2".into(), 2, false), ("m3".into(), 3, false), ("m4".into(), 4, false)]
    );
    let bob = h.ready("bob", "phone").await;
    assert_eq!(texts(&bob, &conv, 4).await, ["m1", "m2", "m3", "m4"]);
    alice.stop().await;
    bob.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_whose_reply_was_lost_is_resent_first_with_its_client_msg_id() {
    let h = Harness::start().await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    alice.stop().await;
    drop(alice);

    // Offline, the app queues three sends; then the client starts and is
    // killed right after the server accepted the first (its reply lost).
    let mut config = h.config("alice", "phone");
    config.fault = Some(abort_once(|p| matches!(p, FaultPoint::AfterSendOk { .. })));
    let alice = Client::open(config).unwrap();
    let mut ids = Vec::new();
    for text in ["m1", "m2", "m3"] {
        ids.push(alice.send(&conv, serde_json::json!({ "text": text })).await.unwrap().client_msg_id);
    }
    alice.start().await.unwrap();
    let exit = tokio::time::timeout(WAIT, alice.closed()).await.unwrap();
    assert_eq!(exit, Exit::Aborted(FaultPoint::AfterSendOk { client_msg_id: ids[0].clone(), msg_seq: 1 }));
    drop(alice);

    // Restarted, with a new send right away: m1 goes first again (same
    // client_msg_id, so the server answers with the original message), then
    // m2, m3, and only then m4.
    let alice = Client::open(h.config("alice", "phone")).unwrap();
    let before = alice.outbox().await.unwrap();
    assert_eq!(
        before.iter().map(|e| (e.client_msg_id.clone(), e.state)).collect::<Vec<_>>(),
        vec![
            (ids[0].clone(), OutboxState::Pending),
            (ids[1].clone(), OutboxState::Pending),
            (ids[2].clone(), OutboxState::Pending),
        ]
    );
    alice.start().await.unwrap();
    alice.send(&conv, serde_json::json!({ "text": "m4" })).await.unwrap();
    assert_eq!(
        accepted(&alice).await,
        vec![("m1".into(), 1, true), ("m2".into(), 2, false), ("m3".into(), 3, false), ("m4".into(), 4, false)]
    );
    let bob = h.ready("bob", "phone").await;
    assert_eq!(texts(&bob, &conv, 4).await, ["m1", "m2", "m3", "m4"]);
    assert_eq!(bob.messages(&conv).await.unwrap().len(), 4, "the resend made no second message");
    alice.stop().await;
    bob.stop().await;
}
