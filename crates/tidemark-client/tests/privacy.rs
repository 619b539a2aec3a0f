//! Issue 18 in the SDK, against a real server: a change of the user's
//! privacy switches made on one device reaches the user's other devices as
//! a `privacy` event of the user's own log, and ends in each device's local
//! store (`Client::privacy`, `Change::PrivacyChanged`): a device online at
//! the time, one offline that reconnects, and one new device rebuilt from a
//! snapshot after the event left the retained log.

mod common;

use std::time::Duration;

use common::*;
use tidemark_client::proto::push::PreviewLevel;
use tidemark_client::{Change, Client, PrivacySwitches};
use tidemark_server::ServerConfig;

fn switches(hide: bool, private: bool, preview: &str, version: u64) -> PrivacySwitches {
    PrivacySwitches { hide_presence: hide, private_receipts: private, push_preview: preview.into(), version }
}

/// Waits until `client`'s local switches are `want`.
async fn wait_privacy(client: &Client, want: &PrivacySwitches) {
    if let Err(e) = client.wait_for(WAIT, || async { Ok(client.privacy().await? == *want) }).await {
        panic!("the switches never became {want:?}: {e}; held {:?}", client.privacy().await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privacy_change_reaches_the_users_other_online_device() {
    let h = Harness::start().await;
    h.user("alice").await;
    let phone = h.ready("alice", "phone").await;
    let laptop = h.ready("alice", "laptop").await;
    assert_eq!(laptop.privacy().await.unwrap(), PrivacySwitches::default(), "never changed: the defaults");
    let mut changes = laptop.subscribe();

    let reply = phone.set_privacy(Some(true), Some(true)).await.unwrap();
    assert!(reply.hide_presence && reply.private_receipts);
    let want = switches(true, true, "full", 1);
    wait_privacy(&laptop, &want).await;
    let seen = collect_until(&mut changes, |c| matches!(c, Change::PrivacyChanged(_))).await;
    assert!(seen.contains(&Change::PrivacyChanged(want.clone())), "{seen:?}");
    // The device that made the change holds it too (its own log).
    wait_privacy(&phone, &want).await;

    // The push preview preference is one of the switches.
    phone.set_push_preview(PreviewLevel::None).await.unwrap();
    let want = switches(true, true, "none", 2);
    wait_privacy(&laptop, &want).await;

    // A no-op set writes no event: the log head stays, nothing moves.
    let head = h.server().state.store.user_log("alice").await.unwrap().high_watermark;
    phone.set_privacy(Some(true), None).await.unwrap();
    assert_eq!(h.server().state.store.user_log("alice").await.unwrap().high_watermark, head);
    // Back off: a third change, applied over the second.
    phone.set_privacy(Some(false), Some(false)).await.unwrap();
    wait_privacy(&laptop, &switches(false, false, "none", 3)).await;
    wait_privacy(&phone, &switches(false, false, "none", 3)).await;
    laptop.stop().await;
    phone.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_device_learns_the_switches_when_it_reconnects() {
    let h = Harness::start().await;
    h.user("alice").await;
    let phone = h.ready("alice", "phone").await;
    let laptop = h.ready("alice", "laptop").await;
    laptop.stop().await;
    drop(laptop);

    phone.set_privacy(None, Some(true)).await.unwrap();
    phone.set_push_preview(PreviewLevel::Conversation).await.unwrap();
    wait_privacy(&phone, &switches(false, true, "conversation", 2)).await;

    let laptop = Client::open(h.config("alice", "laptop")).unwrap();
    assert_eq!(laptop.privacy().await.unwrap(), PrivacySwitches::default(), "offline: not learnt yet");
    laptop.start().await.unwrap();
    wait_privacy(&laptop, &switches(false, true, "conversation", 2)).await;
    laptop.stop().await;
    phone.stop().await;
}

/// D7: the `privacy` event is trimmed from the log before a new device
/// starts, so only the snapshot's `privacy` item can bring the switches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_rebuilt_from_a_snapshot_holds_the_switches() {
    let mut config = ServerConfig { retention_every: Duration::from_millis(50), ..ServerConfig::default() };
    if let Some(policy) = config.retention.as_mut() {
        policy.keep_events_younger_than_ms = 0;
    }
    let h = Harness::start_with(config).await;
    h.user("alice").await;
    h.user("bob").await;
    let phone = h.ready("alice", "phone").await;
    let conv = phone.create_direct("bob").await.unwrap();
    send_ok(&phone, &conv, "one").await;
    phone.set_privacy(Some(true), None).await.unwrap();
    let want = switches(true, false, "full", 1);
    wait_privacy(&phone, &want).await;
    let head = h.server().state.store.user_log("alice").await.unwrap().high_watermark;
    h.wait_server_ack("alice", "phone", head).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.server().state.store.user_log("alice").await.unwrap().trimmed_upto < head {
        assert!(tokio::time::Instant::now() < deadline, "the log was never trimmed past the privacy event");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let tablet = Client::open(h.config("alice", "tablet")).unwrap();
    let mut changes = tablet.subscribe();
    tablet.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::PrivacyChanged(_))).await;
    assert!(seen.iter().any(|c| matches!(c, Change::SnapshotInstalled { .. })), "rebuilt from a snapshot: {seen:?}");
    assert!(seen.contains(&Change::PrivacyChanged(want.clone())), "{seen:?}");
    assert_eq!(tablet.privacy().await.unwrap(), want);
    assert_eq!(wait_messages(&tablet, &conv, 1).await[0].content["text"], "one");

    // A later change still applies over the snapshot's version.
    phone.set_privacy(Some(false), None).await.unwrap();
    wait_privacy(&tablet, &switches(false, false, "full", 2)).await;
    tablet.stop().await;
    phone.stop().await;
}
