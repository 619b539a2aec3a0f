//! The SDK under a server's rate limit (P3, K3, K4): a burst of sends
//! beyond the device's quota meets `RATE_LIMITED`; the outbox waits as the
//! server says and sends on, and every message arrives once, in order.

mod common;

use common::*;
use tidemark_server::limits::{LimitsConfig, Rate};
use tidemark_server::ServerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_burst_over_the_quota_waits_as_told_and_loses_nothing() {
    // Ten sends a second after a burst of five.
    let limits = LimitsConfig { send_per_device: Rate::new(10, 5), ..LimitsConfig::default() };
    let h = Harness::start_with(ServerConfig { limits, ..ServerConfig::default() }).await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let bob = h.ready("bob", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    for i in 0..30 {
        alice.send(&conv, serde_json::json!({ "text": format!("m{i}") })).await.unwrap();
    }
    let held = wait_messages(&bob, &conv, 30).await;
    let texts: Vec<_> = held.iter().map(|m| (m.msg_seq, m.content["text"].as_str().unwrap().to_owned())).collect();
    assert_eq!(texts, (0..30).map(|i| (i + 1, format!("m{i}"))).collect::<Vec<_>>(), "once each, in order");
    let limited = h.metric("tidemark_refusals_total", "code=\"RATE_LIMITED\"").await;
    assert!(limited >= 1.0, "the burst never met the limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdk_held_back_by_its_frame_budget_and_its_send_quota_loses_nothing() {
    // The connection is read at 20 frames a second after a burst of ten
    // (its syncs, ACKs and pings spend the budget too), and sends are
    // limited as above: the SDK is slowed by both and must still deliver
    // every message once, in order.
    let limits = LimitsConfig {
        frames_per_connection: Rate::new(20, 10),
        send_per_device: Rate::new(10, 5),
        ..LimitsConfig::default()
    };
    let h = Harness::start_with(ServerConfig { limits, ..ServerConfig::default() }).await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let bob = h.ready("bob", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    for i in 0..40 {
        alice.send(&conv, serde_json::json!({ "text": format!("m{i}") })).await.unwrap();
    }
    let held = wait_messages(&bob, &conv, 40).await;
    let texts: Vec<_> = held.iter().map(|m| (m.msg_seq, m.content["text"].as_str().unwrap().to_owned())).collect();
    assert_eq!(texts, (0..40).map(|i| (i + 1, format!("m{i}"))).collect::<Vec<_>>(), "once each, in order");
    let paused = h.metric("tidemark_frame_budget_pauses_total", "scope=\"connection\"").await;
    assert!(paused >= 1.0, "the frame budget never held the SDK back");
}
