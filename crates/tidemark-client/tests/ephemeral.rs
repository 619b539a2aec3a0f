//! The SDK's side of the ephemeral lane and of receipts (issue 18), against
//! a real server: typing and presence of others surface as `Change`
//! values, the calls set presence and privacy, and receipts are queried.

mod common;

use common::*;
use tidemark_client::proto::ErrorCode;
use tidemark_client::{Change, PresenceState};

fn presence_is(c: &Change, who: &str, what: &str) -> bool {
    matches!(c, Change::Presence { user, state, .. } if user == who && state == what)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typing_and_presence_arrive_as_changes_and_receipts_are_queried() {
    let h = Harness::start().await;
    h.user("alice").await;
    h.user("bob").await;
    let bob = h.ready("bob", "phone").await;
    let mut bob_changes = bob.subscribe();
    let conv = bob.create_direct("alice").await.unwrap();
    let alice = h.ready("alice", "phone").await;
    let mut alice_changes = alice.subscribe();

    collect_until(&mut bob_changes, |c| presence_is(c, "alice", "online")).await;
    let ok = alice.typing(&conv, true, Some(2_000)).await.unwrap();
    assert_eq!(ok.timeout_ms, 2_000);
    let seen = collect_until(&mut bob_changes, |c| matches!(c, Change::Typing { .. })).await;
    assert_eq!(
        seen.last(),
        Some(&Change::Typing { conv: conv.clone(), user: "alice".into(), typing: true, timeout_ms: 2_000 })
    );
    alice.typing(&conv, false, None).await.unwrap();
    collect_until(&mut bob_changes, |c| matches!(c, Change::Typing { typing: false, .. })).await;

    let idle = alice.set_presence(PresenceState::Idle).await.unwrap();
    assert_eq!((idle.state.as_str(), idle.hidden), ("idle", false));
    collect_until(&mut bob_changes, |c| presence_is(c, "alice", "idle")).await;
    let privacy = alice.set_privacy(Some(true), Some(true)).await.unwrap();
    assert!(privacy.hide_presence && privacy.private_receipts);
    collect_until(&mut bob_changes, |c| presence_is(c, "alice", "offline")).await;
    // bob is still shown to alice: hiding is about oneself only.
    bob.set_presence(PresenceState::Idle).await.unwrap();
    collect_until(&mut alice_changes, |c| presence_is(c, "bob", "idle")).await;

    // Receipts: alice's position is private now; bob's own is shown.
    let (_, _) = send_ok(&bob, &conv, "hello").await;
    let receipts = bob.conv_receipts(&conv, Some(1)).await.unwrap();
    assert_eq!(receipts.hidden, 1);
    assert!(receipts.members.iter().all(|m| m.user == "bob"), "{receipts:?}");
    let msgs = wait_messages(&bob, &conv, 1).await;
    let delivered = bob.delivery_receipts(&conv, vec![msgs[0].message_id.clone()]).await.unwrap();
    assert_eq!(delivered.receipts.len(), 1);
    assert_eq!(refused(alice.delivery_receipts(&conv, vec![msgs[0].message_id.clone()]).await), ErrorCode::Forbidden);
    assert_eq!(refused(alice.typing("gnope", true, None).await), ErrorCode::NotFound);
    alice.stop().await;
    bob.stop().await;
}
