//! WebSocket bounds per user and before authentication: a user holds at
//! most `ws_connections_per_user_max` connections on a node (one more from
//! a new device is `RATE_LIMITED` with `retry_after_ms`, by header or by
//! `auth` frame; a connected device may always reconnect; other users are
//! not affected), and a socket that does not authenticate within
//! `ws_auth_timeout` is closed while an authenticated one stays.

mod common;

use std::time::Duration;

use common::{TestServer, PASSWORD};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tidemark_client::proto::ErrorCode;
use tidemark_client::{ClientError, WsConn};
use tidemark_server::config::WS_USER_FULL_RETRY_AFTER_MS;
use tidemark_server::ServerConfig;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

/// How long a closed connection may take to give its slot back.
const SLOT_FREED_WITHIN: Duration = Duration::from_secs(10);

async fn token(ts: &TestServer, user: &str, device: &str) -> String {
    ts.http.login(user, PASSWORD, device).await.unwrap().access_token
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_at_its_connection_cap_is_rate_limited_until_one_of_its_connections_ends() {
    let config = ServerConfig { ws_connections_per_user_max: 2, ..ServerConfig::default() };
    let ts = TestServer::start_with(config).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let a = ts.device("alice", "a").await;
    let _b = ts.device("alice", "b").await;
    assert_eq!(ts.running().state.ws_user_slots.live("alice"), 2);

    // A third device, with the token in the upgrade's header: HTTP 429.
    let c_token = token(&ts, "alice", "c").await;
    let refused = WsConn::connect(&ts.ws_url(), &c_token).await.err().expect("a third device is refused");
    let ClientError::Server(frame) = &refused else { panic!("{refused:?}") };
    assert_eq!(frame.code, ErrorCode::RateLimited);
    assert_eq!(frame.retry_after_ms, Some(WS_USER_FULL_RETRY_AFTER_MS));

    // The same by `auth` frame: an error reply to it, then the close.
    let (mut raw, _) = tokio_tungstenite::connect_async(ts.ws_url()).await.unwrap();
    raw.send(Message::Text(json!({"t": "auth", "rid": "r1", "token": c_token}).to_string().into())).await.unwrap();
    let reply = next_text(&mut raw).await.expect("a reply to auth");
    assert_eq!(reply["t"], "error");
    assert_eq!(reply["rid"], "r1");
    assert_eq!(reply["code"], "RATE_LIMITED");
    assert_eq!(reply["retry_after_ms"], WS_USER_FULL_RETRY_AFTER_MS);
    assert!(next_text(&mut raw).await.is_none(), "the refused socket is closed");
    assert_eq!(ts.running().state.ws_user_slots.live("alice"), 2, "refusals hold no slot");

    // Another user is not affected, and a connected device reconnects (its
    // newer connection supersedes the older one).
    let bob = ts.device("bob", "phone").await;
    bob.ws.request_value("ping", json!({})).await.unwrap();
    let a_again = ts.device("alice", "a").await;
    a_again.ws.request_value("ping", json!({})).await.unwrap();
    drop(a);

    // One of alice's connections ends: the new device gets in.
    a_again.ws.close().await;
    let deadline = Instant::now() + SLOT_FREED_WITHIN;
    while ts.running().state.ws_user_slots.live("alice") > 1 {
        assert!(Instant::now() < deadline, "alice's closed connections kept their slots");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (c, _events) = WsConn::connect(&ts.ws_url(), &c_token).await.expect("a freed slot takes the new device");
    c.request_value("ping", json!({})).await.unwrap();
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_that_does_not_authenticate_in_time_is_closed_and_one_that_did_stays() {
    let auth_timeout = Duration::from_millis(500);
    let ts = TestServer::start_with(ServerConfig { ws_auth_timeout: auth_timeout, ..ServerConfig::default() }).await;
    ts.user("alice").await;
    // Authenticated by `auth` frame within the timeout.
    let t = token(&ts, "alice", "phone").await;
    let (mut authed, _) = tokio_tungstenite::connect_async(ts.ws_url()).await.unwrap();
    authed.send(Message::Text(json!({"t": "auth", "rid": "a", "token": t}).to_string().into())).await.unwrap();
    assert_eq!(next_text(&mut authed).await.expect("auth.ok")["t"], "auth.ok");

    let started = Instant::now();
    let (mut silent, _) = tokio_tungstenite::connect_async(ts.ws_url()).await.unwrap();
    // Frames other than `auth` do not extend the deadline.
    silent.send(Message::Text(json!({"t": "ping", "rid": "p"}).to_string().into())).await.unwrap();
    assert_eq!(next_text(&mut silent).await.expect("a refusal")["code"], "UNAUTHENTICATED");
    let end = next_text(&mut silent).await;
    assert!(end.is_none(), "no frame before the close: {end:?}");
    let after = started.elapsed();
    assert!(after >= auth_timeout, "closed after {after:?}, before the {auth_timeout:?} timeout");
    // Well before the 10 s default: the configured timeout closed it.
    assert!(after <= auth_timeout + Duration::from_secs(4), "closed only after {after:?}");

    // The authenticated socket, older than the timeout now, still answers.
    authed.send(Message::Text(json!({"t": "ping", "rid": "p2"}).to_string().into())).await.unwrap();
    assert_eq!(next_text(&mut authed).await.expect("pong")["rid"], "p2");
    ts.stop().await;
}

/// The next text frame as JSON; `None` when the connection closes.
async fn next_text(
    ws: &mut (impl StreamExt<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin),
) -> Option<Value> {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await.expect("a frame or a close in time") {
            Some(Ok(Message::Text(t))) => return Some(serde_json::from_str(&t).unwrap()),
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
            Some(Ok(_)) => continue,
        }
    }
}
