//! Ephemeral frames are shed first (issue 18, P3's degradation order): a
//! connection whose client is not reading has its replies queued; typing
//! sent to it meanwhile waits in its bounded slots and what does not fit is
//! dropped, while every reply and the hint still arrive once the client
//! reads again, and the connection is not kicked.

mod common;

use std::time::Duration;

use common::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tidemark_server::ephemeral::EphemeralConfig;
use tidemark_server::ServerConfig;
use tokio_tungstenite::tungstenite::Message;

/// Replies of about a megabyte each, many more than the socket buffers
/// hold, so the server's writer is stuck on the socket with replies queued.
const BIG_REPLIES: usize = 40;

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typing_is_shed_while_replies_wait_and_replies_and_hints_all_arrive() {
    let config = ServerConfig {
        ws_send_queue_max: 1024,
        ephemeral: EphemeralConfig { typing_slots_max: 1, ..EphemeralConfig::default() },
        ..ServerConfig::default()
    };
    let ts = TestServer::start_with(config).await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let mut groups = Vec::new();
    for _ in 0..3 {
        let g: Value = ann.ws.request_value("conv.create", json!({"kind": "group", "members": ["ben"]})).await.unwrap();
        groups.push(g["conv"].as_str().unwrap().to_owned());
    }
    let payload = "z".repeat(60_000);
    for i in 0..16 {
        let req = tidemark_client::proto::SendReq {
            conv: conv.clone(),
            client_msg_id: format!("big-{i}"),
            kind: "text".into(),
            content: json!({"p": payload}),
            mentions: Vec::new(),
            mention_all: false,
        };
        ann.ws.send(&req).await.unwrap();
    }
    let login = ts.http.login("ben", PASSWORD, "phone").await.unwrap();
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(ts.ws_url()).unwrap();
    request.headers_mut().insert("authorization", format!("Bearer {}", login.access_token).parse().unwrap());
    let mut ws = tokio_tungstenite::connect_async(request).await.unwrap().0;
    ws.send(Message::Text(json!({"t": "ping", "rid": "p"}).to_string().into())).await.unwrap();
    let mut generation = None;
    while generation.is_none() {
        ws.send(Message::Text(json!({"t": "sync", "rid": "s", "limit": 16}).to_string().into())).await.unwrap();
        loop {
            let Some(Ok(Message::Text(t))) = ws.next().await else { panic!("ben's connection ended") };
            let v: Value = serde_json::from_str(&t).unwrap();
            if v["rid"] == "s" {
                // Wait until the fan-out gave ben the 16 big messages.
                if v["events"].as_array().map_or(0, Vec::len) >= 16 {
                    generation = v["sync_generation"].as_u64();
                }
                break;
            }
        }
    }
    let metrics_url = format!("{}/metrics", ts.running().url());
    let pages_before =
        metric(&reqwest::get(&metrics_url).await.unwrap().text().await.unwrap(), "tidemark_sync_pages_total");
    // About 40 MB of replies that ben does not read.
    for i in 0..BIG_REPLIES {
        let frame = json!({"t": "sync", "rid": format!("s{i}"), "limit": 16,
                           "sync_generation": generation, "local_applied_sync_seq": 0});
        ws.send(Message::Text(frame.to_string().into())).await.unwrap();
    }
    // Bounded polling until every reply was produced (and so queued).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let text = reqwest::get(&metrics_url).await.unwrap().text().await.unwrap();
        if metric(&text, "tidemark_sync_pages_total") >= pages_before + BIG_REPLIES as f64 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the big replies were not produced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Three typings for ben (three slots' worth; ben holds one) and a
    // message, whose hint does not use the slots.
    for g in &groups {
        let ok =
            ann.ws.request_value("typing", json!({"conv": g, "typing": true, "timeout_ms": 30_000})).await.unwrap();
        assert_eq!(ok["t"], "typing.ok", "{ok}");
    }
    let last = ann.send(&groups[0], "after").await;
    // Bounded polling until the fan-out put it in ben's log.
    let want_hw = {
        let store = &ts.running().state.store;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let hw = store.user_high_watermark("ben").await.unwrap();
            let events = store.read_user_events("ben", 0, hw, 1000).await.unwrap();
            if events.iter().any(|e| e.message.as_ref().is_some_and(|m| m.message_id == last.message_id)) {
                break hw;
            }
            assert!(tokio::time::Instant::now() < deadline, "the last message was not fanned out");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // Now ben reads everything.
    let (mut replies, mut typing, mut hinted) = (0, Vec::new(), 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while replies < BIG_REPLIES || hinted < want_hw {
        let frame = tokio::time::timeout_at(deadline, ws.next()).await.expect("all frames arrive in time");
        let Some(Ok(Message::Text(t))) = frame else { continue };
        let v: Value = serde_json::from_str(&t).unwrap();
        match v["t"].as_str() {
            Some("sync.ok") => replies += 1,
            Some("typing") => typing.push(v["conv"].as_str().unwrap().to_owned()),
            Some("hint") => hinted = hinted.max(v["user_sync_high_watermark"].as_u64().unwrap()),
            Some("kicked") => panic!("ben was kicked: {v}"),
            _ => {}
        }
    }
    assert_eq!(replies, BIG_REPLIES, "every reply arrives");
    assert!(typing.len() <= 1, "typing beyond ben's one slot was shed: {typing:?}");
    let text = reqwest::get(&metrics_url).await.unwrap().text().await.unwrap();
    let shed = text
        .lines()
        .find(|l| l.starts_with("tidemark_ephemeral_dropped_total") && l.contains("slots_full"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(shed >= 2.0, "two typings were dropped for want of a slot: {shed}");
    ts.stop().await;
}
