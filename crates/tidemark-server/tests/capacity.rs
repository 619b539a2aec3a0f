//! A node holds at most `ws_connections_max` WebSockets: one more upgrade
//! is refused with the contract's `UNAVAILABLE` (HTTP 503) and a
//! `retry_after_ms`, and a slot frees when a connection ends.

mod common;

use std::time::Duration;

use common::{TestServer, PASSWORD};
use tidemark_client::proto::ErrorCode;
use tidemark_client::WsConn;
use tidemark_server::config::WS_FULL_RETRY_AFTER_MS;
use tidemark_server::ServerConfig;

/// How long a closed connection may take to give its slot back.
const SLOT_FREED_WITHIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_refuses_one_more_websocket_until_a_slot_frees() {
    let ts = TestServer::start_with(ServerConfig { ws_connections_max: 2, ..Default::default() }).await;
    ts.user("alice").await;
    let a = ts.device("alice", "a").await;
    let _b = ts.device("alice", "b").await;
    assert_eq!(ts.running().state.ws_slots.live(), 2);

    let token = ts.http.login("alice", PASSWORD, "c").await.unwrap().access_token;
    let refused = WsConn::connect(&ts.ws_url(), &token).await.err().expect("a third connection is refused");
    assert_eq!(refused.code(), Some(ErrorCode::Unavailable), "{refused:?}");
    let tidemark_client::ClientError::Server(frame) = &refused else { unreachable!() };
    assert_eq!(frame.retry_after_ms, Some(WS_FULL_RETRY_AFTER_MS));
    assert_eq!(ts.running().state.ws_slots.live(), 2, "a refused upgrade holds no slot");

    a.ws.close().await;
    let deadline = tokio::time::Instant::now() + SLOT_FREED_WITHIN;
    while ts.running().state.ws_slots.live() > 1 {
        assert!(tokio::time::Instant::now() < deadline, "the closed connection kept its slot");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (c, _events) = WsConn::connect(&ts.ws_url(), &token).await.expect("a freed slot takes a connection");
    c.request_value("ping", serde_json::json!({})).await.unwrap();
}
