//! The gateway: auth (P1, P5), bad input (typed errors, nothing lost),
//! bounded queues (slow consumers), health and metrics.

mod common;

use std::time::Duration;

use common::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tidemark_client::proto::{ErrorCode, SendOk};
use tidemark_client::{ServerEvent, WsConn};
use tokio_tungstenite::tungstenite::Message;

async fn raw_ws(
    ts: &TestServer,
    token: &str,
) -> tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>> {
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(ts.ws_url()).unwrap();
    request.headers_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    tokio_tungstenite::connect_async(request).await.unwrap().0
}

/// The next text frame, hints and ephemeral ones skipped: a hint may come
/// before the reply of the send that caused it (on SQLite the fan-out
/// commits with the accept, and the relay hints before the writer answers).
async fn next_json(
    ws: &mut (impl StreamExt<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin),
) -> Value {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), ws.next()).await.expect("a frame in time") {
            Some(Ok(Message::Text(t))) => {
                let v: Value = serde_json::from_str(&t).unwrap();
                // Hints and ephemeral frames (typing, presence) are not what
                // these tests wait for; a client skips what it does not show.
                if v.get("rid").is_none()
                    && ["hint", "typing", "presence", "presence.batch"].contains(&v["t"].as_str().unwrap_or(""))
                {
                    continue;
                }
                return v;
            }
            Some(Ok(_)) => continue,
            other => panic!("connection ended: {other:?}"),
        }
    }
}

/// P1: the identity of every operation comes from the token; a body that
/// names another user changes nothing. Bad, missing and expired tokens are
/// UNAUTHENTICATED; refresh tokens rotate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_comes_from_the_token_only() {
    let ts = TestServer::start().await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let forged: Value = ann
        .ws
        .request_value(
            "send",
            json!({"conv": conv, "client_msg_id": "x", "content": {"t": 1}, "sender": "ben", "user": "ben"}),
        )
        .await
        .unwrap();
    assert_eq!(forged["t"], "send.ok");
    let mut ben = ts.device("ben", "phone").await;
    ben.sync_until(1, 10).await;
    assert_eq!(ben.log[0].message.as_ref().unwrap().sender, "ann");

    assert_eq!(code(ts.http.rpc::<_, Value>("garbage", "conv.list", &json!({})).await), ErrorCode::Unauthenticated);
    let keys = &ts.running().state.keys;
    let expired = keys.sign_access(&tidemark_core::token::AccessClaims {
        user: "ann".into(),
        device: "phone".into(),
        expires_at_ms: 1,
    });
    assert_eq!(code(ts.http.rpc::<_, Value>(&expired, "conv.list", &json!({})).await), ErrorCode::Unauthenticated);
    assert!(WsConn::connect(&ts.ws_url(), "garbage").await.is_err(), "the upgrade is refused");
    assert_eq!(code(ts.http.login("ann", "wrong", "phone").await), ErrorCode::Unauthenticated);
    assert_eq!(code(ts.http.login("nobody", "wrong", "phone").await), ErrorCode::Unauthenticated);

    let refreshed = ts.http.refresh(&ann.refresh).await.unwrap();
    assert_eq!((refreshed.user.as_str(), refreshed.device_id.as_str()), ("ann", "phone"));
    assert_eq!(code(ts.http.refresh(&ann.refresh).await), ErrorCode::Unauthenticated, "a refresh token works once");
    let list: Value = ts.http.rpc(&refreshed.access_token, "conv.list", &json!({})).await.unwrap();
    assert_eq!(list["conversations"][0]["conv"], conv.as_str());
    ts.stop().await;
}

/// A first-frame `auth` works when the upgrade carried no header, and
/// nothing else is served before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_frame_auth() {
    let ts = TestServer::start().await;
    ts.user("ann").await;
    let login = ts.http.login("ann", PASSWORD, "phone").await.unwrap();
    let (mut ws, _) = tokio_tungstenite::connect_async(ts.ws_url()).await.unwrap();
    ws.send(Message::Text(json!({"t": "conv.list", "rid": "a"}).to_string().into())).await.unwrap();
    let r = next_json(&mut ws).await;
    assert_eq!((r["rid"].as_str(), r["code"].as_str()), (Some("a"), Some("UNAUTHENTICATED")));
    ws.send(Message::Text(json!({"t": "auth", "rid": "b", "token": login.access_token}).to_string().into()))
        .await
        .unwrap();
    let r = next_json(&mut ws).await;
    assert_eq!((r["t"].as_str(), r["device_id"].as_str()), (Some("auth.ok"), Some("phone")));
    ws.send(Message::Text(json!({"t": "conv.list", "rid": "c"}).to_string().into())).await.unwrap();
    assert_eq!(next_json(&mut ws).await["t"], "conv.list.ok");
    ts.stop().await;
}

/// Bad input gets a typed error and the connection's other work goes on:
/// malformed JSON, a missing operation, an unknown operation, a binary
/// frame, a wrong field type, an oversized content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_get_typed_errors_and_the_connection_survives() {
    let ts = TestServer::start().await;
    ts.user("ann").await;
    ts.user("ben").await;
    let login = ts.http.login("ann", PASSWORD, "phone").await.unwrap();
    let ann = ts.device("ann", "laptop").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let mut ws = raw_ws(&ts, &login.access_token).await;
    let big = "x".repeat(tidemark_client::proto::CONTENT_BYTES_MAX + 10);
    let cases: Vec<(Message, Option<&str>)> = vec![
        (Message::Text("{not json".into()), None),
        (Message::Text("[1,2]".into()), None),
        (Message::Text(json!({"rid": "r1"}).to_string().into()), Some("r1")),
        (Message::Text(json!({"t": "no.such.op", "rid": "r2"}).to_string().into()), Some("r2")),
        (Message::Text(json!({"t": "send", "rid": "r3", "conv": 5}).to_string().into()), Some("r3")),
        (
            Message::Text(
                json!({"t": "send", "rid": "r4", "conv": conv, "client_msg_id": "big", "content": {"b": big}})
                    .to_string()
                    .into(),
            ),
            Some("r4"),
        ),
        (Message::Text(json!({"t": "sync", "rid": "r5", "limit": 0}).to_string().into()), Some("r5")),
        (Message::Binary(vec![1, 2, 3].into()), None),
    ];
    for (msg, rid) in cases {
        ws.send(msg).await.unwrap();
        let r = next_json(&mut ws).await;
        assert_eq!(r["t"], "error");
        assert_eq!(r["code"], "BAD_REQUEST", "{r}");
        assert_eq!(r["rid"].as_str(), rid);
    }
    ws.send(Message::Text(
        json!({"t": "send", "rid": "ok", "conv": conv, "client_msg_id": "fine", "content": {"a": 1}})
            .to_string()
            .into(),
    ))
    .await
    .unwrap();
    let r = next_json(&mut ws).await;
    assert_eq!((r["t"].as_str(), r["msg_seq"].as_u64()), (Some("send.ok"), Some(1)), "the connection still works");
    // A non-member and an unknown conversation.
    ts.user("cat").await;
    let cat = ts.device("cat", "phone").await;
    assert_eq!(code(cat.ws.send(&send_req(&conv, "intrude")).await), ErrorCode::NotMember);
    assert_eq!(code(cat.ws.send(&send_req("c-none", "lost")).await), ErrorCode::NotFound);
    // HTTP: malformed and oversized bodies get the error object too.
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{}/v1/rpc/send", ts.running().url()))
        .bearer_auth(&login.access_token)
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "BAD_REQUEST");
    let r = client
        .post(format!("{}/v1/rpc/send", ts.running().url()))
        .bearer_auth(&login.access_token)
        .body(vec![b'x'; tidemark_client::proto::FRAME_BYTES_MAX + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "BAD_REQUEST");
    // An oversized WebSocket frame ends that connection (the bound), and no
    // other connection.
    ws.send(Message::Text("y".repeat(tidemark_client::proto::FRAME_BYTES_MAX + 1).into())).await.ok();
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match ws.next().await {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return true,
                Some(Ok(_)) => continue,
            }
        }
    })
    .await
    .unwrap();
    assert!(ended);
    let ok: SendOk = ann.ws.send(&send_req(&conv, "after")).await.unwrap();
    assert_eq!(ok.msg_seq, 2);
    ts.stop().await;
}

/// Frames far larger than the gateway's socket buffers (1 KiB
/// `WS_READ_BUFFER_BYTES`, 8 KiB `WS_WRITE_BUFFER_BYTES`) arrive whole both
/// ways: sends with content near the 64 KiB limit, and a sync page of
/// several of them (hundreds of KiB in one frame).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_larger_than_the_socket_buffers_arrive_whole() {
    const { assert!(tidemark_server::gateway::WS_READ_BUFFER_BYTES * 4 < tidemark_client::proto::CONTENT_BYTES_MAX) };
    let ts = TestServer::start().await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let bodies: Vec<String> = (0..4u8)
        .map(|i| std::iter::repeat_n(char::from(b'a' + i), tidemark_client::proto::CONTENT_BYTES_MAX - 100).collect())
        .collect();
    for (i, body) in bodies.iter().enumerate() {
        let req = tidemark_client::proto::SendReq {
            conv: conv.clone(),
            client_msg_id: format!("big-{i}"),
            kind: "text".into(),
            content: json!({ "b": body }),
            mentions: Vec::new(),
            mention_all: false,
        };
        let ok: SendOk = ann.ws.send(&req).await.unwrap();
        assert!(!ok.duplicate);
    }
    let mut ben = ts.device("ben", "phone").await;
    ben.sync_until(bodies.len(), 10).await;
    let got: Vec<String> = ben
        .log
        .iter()
        .filter_map(|e| e.message.as_ref())
        .map(|m| m.content["b"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(got, bodies);
    ts.stop().await;
}

/// An idle connection holds only its small read buffer (1 KiB,
/// `WS_READ_BUFFER_BYTES`: `tidemark bench connections`, issue 19), and
/// loses nothing when it wakes: after sitting idle it is hinted at the
/// head, its sync brings every message whole (bodies below, at and far
/// above the buffer), and its own requests larger than the buffer, read in
/// several socket reads, are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_that_wakes_gets_everything_whole() {
    use tidemark_server::gateway::WS_READ_BUFFER_BYTES;
    let ts = TestServer::start().await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let mut ben = ts.device("ben", "phone").await;
    let start = ben.sync_batch(50).await;
    ben.drain_events();
    // Ben now sends nothing; ann's messages straddle his read buffer.
    let sizes = [10, WS_READ_BUFFER_BYTES - 100, WS_READ_BUFFER_BYTES, WS_READ_BUFFER_BYTES + 1, 5_000, 40_000];
    let mut head = start;
    for (i, n) in sizes.iter().enumerate() {
        let req = tidemark_client::proto::SendReq {
            content: json!({ "cmid": format!("m{i}"), "b": "x".repeat(*n) }),
            ..send_req(&conv, &format!("m{i}"))
        };
        let ok: SendOk = ann.ws.send(&req).await.unwrap();
        assert!(!ok.duplicate);
    }
    // Woken by a hint (fan-out is async): bounded wait for the one that
    // covers every message.
    while head < start + sizes.len() as u64 {
        head = ben.next_hint(Duration::from_secs(10)).await.expect("the idle connection is hinted");
    }
    ben.sync_until(ben.log.len() + sizes.len(), 2).await;
    let got: Vec<(String, usize)> = ben
        .log
        .iter()
        .filter_map(|e| e.message.as_ref())
        .filter_map(|m| Some((m.content["cmid"].as_str()?.to_owned(), m.content["b"].as_str()?.len())))
        .collect();
    let want: Vec<(String, usize)> = sizes.iter().enumerate().map(|(i, n)| (format!("m{i}"), *n)).collect();
    assert_eq!(got, want);
    // And its own frame, many times its read buffer, is read whole.
    let req = tidemark_client::proto::SendReq {
        content: json!({ "cmid": "back", "b": "y".repeat(WS_READ_BUFFER_BYTES * 20) }),
        ..send_req(&conv, "back")
    };
    let ok: SendOk = ben.ws.send(&req).await.unwrap();
    assert!(!ok.duplicate);
    ts.stop().await;
}

/// A client that stops reading fills its bounded send queue and is
/// disconnected; the server and other clients go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_consumer_is_disconnected_not_skipped() {
    let config = tidemark_server::ServerConfig { ws_send_queue_max: 4, ..Default::default() };
    let ts = TestServer::start_with(config).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
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
    let mut ws = raw_ws(&ts, &login.access_token).await;
    // One round trip first, so the connection is registered.
    ws.send(Message::Text(json!({"t": "ping", "rid": "p"}).to_string().into())).await.unwrap();
    assert_eq!(next_json(&mut ws).await["t"], "ping.ok");
    assert_eq!(ts.running().state.hub.connections(), 2);
    // The device's generation, so that every later first page replays the
    // log (about a megabyte each) rather than answering a small reset.
    ws.send(Message::Text(json!({"t": "sync", "rid": "s", "limit": 16}).to_string().into())).await.unwrap();
    let first = next_json(&mut ws).await;
    assert_eq!(first["t"], "sync.ok", "{first}");
    let generation = first["sync_generation"].as_u64().unwrap();
    // Each reply is about a megabyte; never read them.
    for i in 0..400 {
        let frame = json!({"t": "sync", "rid": format!("s{i}"), "limit": 16,
                           "sync_generation": generation, "local_applied_sync_seq": 0});
        if ws.send(Message::Text(frame.to_string().into())).await.is_err() {
            break;
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while ts.running().state.hub.connections() > 1 {
        assert!(tokio::time::Instant::now() < deadline, "the slow consumer was not disconnected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = reqwest::get(format!("{}/metrics", ts.running().url())).await.unwrap().text().await.unwrap();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("tidemark_slow_consumer_disconnects_total"))
        .unwrap_or_else(|| panic!("no slow consumer metric in:\n{metrics}"));
    assert!(line.split_whitespace().last().unwrap().parse::<f64>().unwrap() >= 1.0, "{line}");
    // ann's connection is unaffected and the server serves new work.
    ann.send(&conv, "still-here").await;
    let mut ben = ts.device("ben", "desk").await;
    ben.sync_until(17, 4).await;
    ts.stop().await;
}

/// P5: revoking a device kicks its connection and refuses every later
/// sync, ACK, refresh and login of it; other devices go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_device_is_refused_everywhere() {
    let ts = TestServer::start().await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let mut lost = ts.device("ben", "lost-phone").await;
    let desk = ts.device("ben", "desk").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    ann.send(&conv, "1").await;
    lost.sync_until(1, 10).await;
    let page = lost.sync_page(10).await.unwrap();
    let r: Value = desk.ws.request_value("device.revoke", json!({"device_id": "lost-phone"})).await.unwrap();
    assert_eq!(r["revoked"], true);
    let kicked = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match lost.events.recv().await {
                Some(ServerEvent::Kicked { reason }) => return reason,
                Some(_) => continue,
                None => return String::new(),
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(kicked, "device_revoked");
    assert_eq!(code(ts.http.rpc::<_, Value>(&lost.token, "sync", &json!({})).await), ErrorCode::DeviceRevoked);
    assert_eq!(
        code(
            ts.http.rpc::<_, Value>(&lost.token, "ack", &json!({"batch_token": page.batch_token, "sync_seq": 1})).await
        ),
        ErrorCode::DeviceRevoked
    );
    assert_eq!(code(ts.http.refresh(&lost.refresh).await), ErrorCode::Unauthenticated, "its refresh tokens are gone");
    assert_eq!(code(ts.http.login("ben", PASSWORD, "lost-phone").await), ErrorCode::DeviceRevoked);
    assert_eq!(
        code(ts.http.rpc::<_, Value>(&ann.token, "device.revoke", &json!({"device_id": "nope"})).await),
        ErrorCode::NotFound
    );
    let list: Value = desk.ws.request_value("conv.list", json!({})).await.unwrap();
    assert_eq!(list["t"], "conv.list.ok");
    ts.stop().await;
}

/// The admin endpoint needs the configured token; health and metrics
/// expose what the operators need.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_health_metrics_and_openapi() {
    let ts = TestServer::start().await;
    assert_eq!(code(ts.http.create_user("wrong", "ann", "pw").await), ErrorCode::Unauthenticated);
    ts.user("ann").await;
    assert!(!ts.http.create_user(ADMIN, "ann", "pw").await.unwrap().created, "a taken name is not overwritten");
    assert_eq!(code(ts.http.login("ann", "pw", "phone").await), ErrorCode::Unauthenticated);
    assert_eq!(code(ts.http.create_user(ADMIN, "bad name!", "pw").await), ErrorCode::BadRequest);
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    ann.send(&conv, "1").await;
    ann.send(&conv, "1").await;
    let mut ben = ts.device("ben", "phone").await;
    ben.sync_until(1, 10).await;
    let base = ts.running().url();
    let health: Value = reqwest::get(format!("{base}/healthz")).await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ok");
    let metrics = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    for name in [
        "tidemark_sends_accepted_total",
        "tidemark_sends_duplicate_total",
        "tidemark_outbox_backlog",
        "tidemark_outbox_oldest_age_seconds",
        "tidemark_fanout_lag_seconds",
        "tidemark_sync_pages_total",
        "tidemark_acks_total",
        "tidemark_refusals_total{stage=\"gateway\",code=\"UNAUTHENTICATED\"}",
        "tidemark_store_commits",
    ] {
        assert!(metrics.contains(name), "metric {name} missing");
    }
    let api: Value = reqwest::get(format!("{base}/v1/openapi.json")).await.unwrap().json().await.unwrap();
    assert!(api["paths"]["/v1/rpc/sync"]["post"].is_object());
    // A server started without an admin token has the endpoint disabled.
    let dir = tempfile::tempdir().unwrap();
    let store = tidemark_sqlite::SqliteStore::open(dir.path()).unwrap();
    let s =
        tidemark_server::Server::start("127.0.0.1:0", store, tidemark_server::ServerConfig::default()).await.unwrap();
    let http = tidemark_client::Http::new(&s.url());
    assert_eq!(code(http.create_user(ADMIN, "x", "pw").await), ErrorCode::Forbidden);
    s.stop().await;
    ts.stop().await;
}

/// P1: a WebSocket lives no longer than its short-lived access token; the
/// client is told why, refreshes and reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_ends_when_its_access_token_expires() {
    let config = tidemark_server::ServerConfig { access_token_ttl: Duration::from_secs(1), ..Default::default() };
    let ts = TestServer::start_with(config).await;
    ts.user("ann").await;
    let mut ann = ts.device("ann", "phone").await;
    let reason = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match ann.events.recv().await {
                Some(ServerEvent::Kicked { reason }) => return reason,
                Some(_) => continue,
                None => return String::new(),
            }
        }
    })
    .await
    .expect("kicked before the timeout");
    assert_eq!(reason, "token_expired");
    let fresh = ts.http.refresh(&ann.refresh).await.unwrap();
    let (ws, _) = WsConn::connect(&ts.ws_url(), &fresh.access_token).await.unwrap();
    assert_eq!(ws.request_value("ping", json!({})).await.unwrap()["t"], "ping.ok");
    ts.stop().await;
}

/// P2 heartbeat: a connection that answers nothing (no frame, not even a
/// pong) is closed after three ping periods; one that keeps reading (its
/// WebSocket library answers the pings) stays open meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_closes_a_silent_connection() {
    // Long enough that a reader scheduled late on a loaded machine still
    // answers well within three periods.
    let ping = Duration::from_millis(250);
    let ts = TestServer::start_with(tidemark_server::ServerConfig { ws_ping: ping, ..Default::default() }).await;
    ts.user("ann").await;
    let login = ts.http.login("ann", PASSWORD, "phone").await.unwrap();
    let mut live = raw_ws(&ts, &login.access_token).await;
    live.send(Message::Text(json!({"t": "ping", "rid": "p"}).to_string().into())).await.unwrap();
    assert_eq!(next_json(&mut live).await["t"], "ping.ok");
    let login2 = ts.http.login("ann", PASSWORD, "laptop").await.unwrap();
    let mut silent = raw_ws(&ts, &login2.access_token).await;
    silent.send(Message::Text(json!({"t": "ping", "rid": "p"}).to_string().into())).await.unwrap();
    assert_eq!(next_json(&mut silent).await["t"], "ping.ok");
    assert_eq!(ts.running().state.hub.connections(), 2);
    // The live one reads (and so answers pings) in the background; the
    // silent one is never read again.
    let reader = tokio::spawn(async move { while let Some(Ok(_)) = live.next().await {} });
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(20);
    while ts.running().state.hub.connections() > 1 {
        assert!(tokio::time::Instant::now() < deadline, "the silent connection was never closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(started.elapsed() >= ping * 2, "closed before it could have been silent for three periods");
    assert_eq!(ts.running().state.hub.connections(), 1, "the connection that answers pings stays");
    reader.abort();
    drop(silent);
    ts.stop().await;
}
