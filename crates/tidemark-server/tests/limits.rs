//! Rate limits (P3) against a real server: a device flooding sends gets
//! `RATE_LIMITED` with `retry_after_ms`, nothing beyond its quota is
//! accepted and other users are not affected; a connection that keeps
//! sending while told to wait is closed; a throttled sync or ACK leaves the
//! device's cursor where it was.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tidemark_client::proto::{ErrorCode, SyncReq};
use tidemark_client::ClientError;
use tidemark_server::limits::{LimitsConfig, Rate};
use tidemark_server::ServerConfig;

fn refusal(r: Result<impl std::fmt::Debug, ClientError>) -> (ErrorCode, Option<u64>) {
    match r {
        Err(ClientError::Server(frame)) => (frame.code, frame.retry_after_ms),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_sends_is_limited_per_device_and_nothing_beyond_the_quota_is_accepted() {
    // One send a minute after a burst of five: nothing refills while the
    // test runs, however slowly the machine runs it.
    let cell = Duration::from_secs(60);
    let limits = LimitsConfig { send_per_device: Rate::every(cell, 5), ..LimitsConfig::default() };
    let ts = TestServer::start_with(ServerConfig { limits, ..ServerConfig::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;

    let started = Instant::now();
    let mut accepted = Vec::new();
    let mut refused = 0;
    for i in 0..20 {
        match ann.ws.send(&send_req(&conv, &format!("flood-{i}"))).await {
            Ok(ok) => accepted.push(ok.msg_seq),
            Err(e) => {
                let (code, retry_after_ms) = refusal(Err::<(), _>(e));
                assert_eq!(code, ErrorCode::RateLimited);
                let wait = retry_after_ms.expect("a limit says when to retry");
                assert!((1..=cell.as_millis() as u64).contains(&wait), "retry_after_ms {wait}");
                refused += 1;
            }
        }
    }
    let elapsed_secs = started.elapsed().as_secs();
    assert!(refused > 0, "the flood was never limited");
    // The burst, plus at most one per second that passed meanwhile.
    assert!(accepted.len() as u64 <= 5 + elapsed_secs + 1, "{} accepted in {elapsed_secs} s", accepted.len());
    assert_eq!(accepted, (1..=accepted.len() as u64).collect::<Vec<_>>(), "accepted sends are contiguous");
    // Another user's sends go through meanwhile.
    let other = ben.send(&conv, "ben-1").await;
    assert_eq!(other.msg_seq, accepted.len() as u64 + 1);
    // What the store holds is exactly what was accepted: a refused send was
    // never written.
    let history = ann.ws.request_value("history", serde_json::json!({"conv": conv, "limit": 50})).await.unwrap();
    assert_eq!(history["messages"].as_array().unwrap().len(), accepted.len() + 1);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_keeps_sending_while_told_to_wait_is_closed() {
    use tidemark_core::throttle::IGNORED_WAITS_MAX;
    let limits = LimitsConfig { send_per_device: Rate::every(Duration::from_secs(60), 5), ..LimitsConfig::default() };
    let ts = TestServer::start_with(ServerConfig { limits, ..ServerConfig::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let mut ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let (mut accepted, mut refused) = (0u32, 0u32);
    for i in 0..(IGNORED_WAITS_MAX + 50) {
        let sent = tokio::time::timeout(Duration::from_secs(5), ann.ws.send(&send_req(&conv, &format!("f-{i}")))).await;
        match sent {
            Ok(Ok(_)) => accepted += 1,
            Ok(Err(ClientError::Server(f))) if f.code == ErrorCode::RateLimited => refused += 1,
            // The socket closed (or a reply never came once it did).
            Ok(Err(_)) | Err(_) => break,
        }
    }
    assert_eq!(accepted, 5, "the burst");
    // The first refusal tells the client to wait; each further one inside
    // the wait is ignored; one more than the bound closes the connection
    // (its own refusal may be cut off by the close).
    let answered = IGNORED_WAITS_MAX + 1..=IGNORED_WAITS_MAX + 2;
    assert!(answered.contains(&refused), "{refused} refusals answered before the close, not {answered:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let reason = loop {
        match tokio::time::timeout_at(deadline, ann.events.recv()).await.expect("a kick in time") {
            Some(tidemark_client::ServerEvent::Kicked { reason }) => break reason,
            Some(tidemark_client::ServerEvent::Closed) | None => panic!("closed without a kick"),
            Some(_) => continue,
        }
    };
    assert_eq!(reason, tidemark_client::proto::reason::WAITS_IGNORED);
    // Reconnecting is allowed; the quota did not refill.
    let again = ts.device("ann", "phone").await;
    assert_eq!(refusal(again.ws.send(&send_req(&conv, "after")).await).0, ErrorCode::RateLimited);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_sync_or_ack_moves_no_cursor() {
    // Two pages or ACKs, then one every 3 s: far longer than the refused
    // requests below take, short enough to wait out at the end.
    let limits = LimitsConfig { sync_per_device: Rate::every(Duration::from_secs(3), 2), ..LimitsConfig::default() };
    let ts = TestServer::start_with(ServerConfig { limits, ..ServerConfig::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for i in 0..3 {
        ann.send(&conv, &format!("m{i}")).await;
    }
    let mut ben = ts.device("ben", "phone").await;
    let store = &ts.running().state.store;
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.user_high_watermark("ben").await.unwrap() < 3 {
        assert!(Instant::now() < deadline, "fan-out never reached ben");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The quota: two pages or ACKs, then one every 3 s.
    let first = ben.sync_page(10).await.unwrap();
    assert_eq!(first.events.len(), 3);
    let again = ben.sync_page(10).await.unwrap();
    let cursor = || async { store.device("ben", "phone").await.unwrap().unwrap().cursor };
    let before = cursor().await;
    let (code, retry_after) = refusal(ben.ws.ack(&again.batch_token, again.batch_high_watermark).await);
    assert_eq!(code, ErrorCode::RateLimited);
    assert!(retry_after.is_some());
    assert_eq!(cursor().await, before, "a throttled ACK moved the cursor");
    let req = SyncReq {
        sync_generation: ben.generation,
        local_applied_sync_seq: Some(3),
        limit: Some(10),
        ..Default::default()
    };
    let (code, _) = refusal(ben.ws.sync(&req).await);
    assert_eq!(code, ErrorCode::RateLimited);
    assert_eq!(cursor().await, before, "a throttled sync moved the cursor");
    // A client that waits as told is heard, and the same ACK moves it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wait = retry_after.unwrap();
    let ok = loop {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        match ben.ws.ack(&again.batch_token, again.batch_high_watermark).await {
            Ok(ok) => break ok,
            Err(ClientError::Server(f)) if f.code == ErrorCode::RateLimited && Instant::now() < deadline => {
                wait = f.retry_after_ms.unwrap_or(100);
            }
            Err(e) => panic!("ack after the wait: {e}"),
        }
    };
    assert_eq!(ok.acked_sync_seq, 3);
    ts.stop().await;
}
