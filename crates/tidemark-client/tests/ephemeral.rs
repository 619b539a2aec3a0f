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

/// What presence changes taught a client: per user, `(state, last_seen)`.
type Seen = std::collections::BTreeMap<String, (String, Option<i64>)>;

/// Folds presence changes into `seen` until `done` holds of it.
async fn learn(changes: &mut tidemark_client::Changes, seen: &mut Seen, done: impl Fn(&Seen) -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done(seen) {
        match tokio::time::timeout_at(deadline, changes.recv()).await {
            Ok(Some(Change::Presence { user, state, last_seen })) => {
                seen.insert(user, (state, last_seen));
            }
            Ok(Some(_)) => {}
            other => panic!("presence never got there ({other:?}); seen {seen:?}"),
        }
    }
}

fn knows(seen: &Seen, users: &[&str]) -> bool {
    users.iter().all(|u| seen.contains_key(*u))
}

fn of<'a>(seen: &'a Seen, users: &[&'a str]) -> Vec<(&'a str, &'a (String, Option<i64>))> {
    users.iter().map(|u| (*u, &seen[*u])).collect()
}

/// Issue 19: an SDK client that takes `presence.batch` frames (the
/// default) and one that does not see the same presence: the same states
/// and last-seen times of the same users on connect (the audience's answers
/// as one batch for the first, a frame each for the second, read from the
/// server's counters), and the same changes after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdk_client_sees_the_same_presence_with_batched_frames_or_without() {
    const BATCHED: &str = "tidemark_ephemeral_presence_batched_total";
    let h = Harness::start().await;
    let others = ["ann", "ben", "cat", "dan"];
    for u in others.iter().chain(&["obs", "old"]) {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    ann.create_group(&["ben", "cat", "dan", "obs", "old"]).await.unwrap();
    let (ben, cat, dan) = (h.ready("ben", "phone").await, h.ready("cat", "phone").await, h.ready("dan", "phone").await);
    let mut theirs: Vec<_> = [&ann, &ben, &cat, &dan].iter().map(|c| (c.subscribe(), Seen::new())).collect();
    dan.set_presence(PresenceState::Idle).await.unwrap();
    let open = |user: &str, presence_batch: bool| {
        let config = tidemark_client::ClientConfig { presence_batch, ..h.config(user, "phone") };
        let client = tidemark_client::Client::open(config).unwrap();
        let changes = client.subscribe();
        (client, changes, Seen::new())
    };

    let batched_before = h.metric(BATCHED, "").await;
    let (obs, mut obs_changes, mut obs_seen) = open("obs", true);
    obs.start().await.unwrap();
    learn(&mut obs_changes, &mut obs_seen, |s| knows(s, &others)).await;
    let batched = h.metric(BATCHED, "").await - batched_before;
    assert!(batched >= others.len() as f64, "obs's audience answered in one batch: {batched} entries batched");
    // Everyone has written "obs online" before old connects.
    for (changes, seen) in &mut theirs {
        learn(changes, seen, |s| knows(s, &["obs"])).await;
    }

    let batched_before = h.metric(BATCHED, "").await;
    let (old, mut old_changes, mut old_seen) = open("old", false);
    old.start().await.unwrap();
    learn(&mut old_changes, &mut old_seen, |s| knows(s, &["ann", "ben", "cat", "dan", "obs"])).await;
    learn(&mut obs_changes, &mut obs_seen, |s| knows(s, &["old"])).await;
    assert_eq!(h.metric(BATCHED, "").await, batched_before, "old's answers came one frame each");
    assert_eq!(of(&old_seen, &others), of(&obs_seen, &others));
    assert_eq!(old_seen["dan"].0, "idle");
    assert!(old_seen["dan"].1.is_some(), "idle carries last_seen");
    assert_eq!((old_seen["obs"].0.as_str(), obs_seen["old"].0.as_str()), ("online", "online"));

    // Changes after: the same again.
    cat.set_presence(PresenceState::Idle).await.unwrap();
    ben.stop().await;
    for (changes, seen) in [(&mut obs_changes, &mut obs_seen), (&mut old_changes, &mut old_seen)] {
        learn(changes, seen, |s| s["cat"].0 == "idle" && s["ben"].0 == "offline").await;
    }
    assert_eq!(of(&old_seen, &others), of(&obs_seen, &others));
    for c in [ann, cat, dan, obs, old] {
        c.stop().await;
    }
}
