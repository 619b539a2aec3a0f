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
    // Reconnecting is allowed once the address's period ran out (the test
    // below); the quota did not refill.
    let again = reconnect_after_the_period(&ts, &ann.token, "127.0.0.1".parse().unwrap()).await;
    assert_eq!(refusal(again.send(&send_req(&conv, "after")).await).0, ErrorCode::RateLimited);
    ts.stop().await;
}

/// Connects `token` from `from` until the address is admitted again,
/// checking each refusal says how long to wait.
async fn reconnect_after_the_period(ts: &TestServer, token: &str, from: std::net::IpAddr) -> tidemark_client::WsConn {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match tidemark_client::WsConn::connect_from(&ts.ws_url(), token, from).await {
            Ok((ws, _events)) => return ws,
            Err(ClientError::Server(f)) if f.code == ErrorCode::RateLimited && Instant::now() < deadline => {
                let wait = f.retry_after_ms.expect("a refusal says when to retry");
                tokio::time::sleep(Duration::from_millis(wait)).await;
            }
            Err(e) => panic!("reconnect from {from}: {e}"),
        }
    }
}

/// Sends on `ws` while told to wait until the server closes it with
/// `kicked` `waits_ignored`; returns the refusals answered.
async fn ignore_waits_until_closed(
    ws: &tidemark_client::WsConn,
    events: &mut tokio::sync::mpsc::Receiver<tidemark_client::ServerEvent>,
    conv: &str,
) -> u32 {
    use tidemark_core::throttle::IGNORED_WAITS_MAX;
    let mut refused = 0;
    for i in 0..(IGNORED_WAITS_MAX + 50) {
        match tokio::time::timeout(Duration::from_secs(5), ws.send(&send_req(conv, &format!("x-{i}")))).await {
            Ok(Ok(_)) => {}
            Ok(Err(ClientError::Server(f))) if f.code == ErrorCode::RateLimited => refused += 1,
            Ok(Err(_)) | Err(_) => break,
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, events.recv()).await.expect("a kick in time") {
            Some(tidemark_client::ServerEvent::Kicked { reason }) => {
                assert_eq!(reason, tidemark_client::proto::reason::WAITS_IGNORED);
                return refused;
            }
            Some(tidemark_client::ServerEvent::Closed) | None => panic!("closed without a kick"),
            Some(_) => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_that_reconnects_after_a_waits_ignored_close_is_refused_until_its_period_ends() {
    use tidemark_core::throttle::{ReconnectPenalty, RECONNECT_PENALTY};
    let penalty = ReconnectPenalty { first_ms: 1_500, max_ms: 60_000, ..RECONNECT_PENALTY };
    let limits = LimitsConfig {
        send_per_device: Rate::every(Duration::from_secs(60), 5),
        reconnect_penalty: penalty,
        ..LimitsConfig::default()
    };
    let ts = TestServer::start_with(ServerConfig { limits, ..ServerConfig::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let attacker: std::net::IpAddr = "127.0.0.3".parse().unwrap();
    let ann = ts.device("ann", "phone").await;
    let ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let (ws, mut events) = tidemark_client::WsConn::connect_from(&ts.ws_url(), &ann.token, attacker).await.unwrap();
    assert!(ignore_waits_until_closed(&ws, &mut events, &conv).await > 0);

    // Closed once: the address is refused at connect, and its HTTP
    // requests too, for the first period, before its token is looked at.
    let t0 = Instant::now();
    let refused = tidemark_client::WsConn::connect_from(&ts.ws_url(), &ann.token, attacker).await;
    let (code, wait) = refusal(refused.map(|_| ()));
    assert_eq!(code, ErrorCode::RateLimited);
    let wait = wait.expect("retry_after_ms");
    assert!((1..=penalty.first_ms).contains(&wait), "retry_after_ms {wait}");
    let http = reqwest::Client::builder().local_address(attacker).build().unwrap();
    let resp = http
        .post(format!("{}/v1/login", ts.running().url()))
        .json(&serde_json::json!({"user": "ann", "password": PASSWORD, "device_id": "laptop"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "RATE_LIMITED");
    assert!(body["retry_after_ms"].as_u64().is_some_and(|w| (1..=penalty.first_ms).contains(&w)), "{body}");
    // Another address connects and sends meanwhile.
    let laptop = ts.device("ben", "laptop").await;
    laptop.send(&conv, "ben-while-refused").await;
    ben.send(&conv, "ben-phone-while-refused").await;

    // Admitted once the period ran out, not before.
    let again = reconnect_after_the_period(&ts, &ann.token, attacker).await;
    assert!(t0.elapsed() + Duration::from_millis(2) >= Duration::from_millis(wait), "admitted before the period ended");
    drop(again);
    let m = common::exposition::scrape(&ts).await;
    assert!(m.value("tidemark_address_refusals_total", &[("reason", "penalty")]) >= 2.0);
    assert_eq!(m.value("tidemark_waits_ignored_disconnects_total", &[]), 1.0);

    // Closed again: the period doubles.
    let (ws, mut events) = tidemark_client::WsConn::connect_from(&ts.ws_url(), &ann.token, attacker).await.unwrap();
    ignore_waits_until_closed(&ws, &mut events, &conv).await;
    let (code, wait) =
        refusal(tidemark_client::WsConn::connect_from(&ts.ws_url(), &ann.token, attacker).await.map(|_| ()));
    assert_eq!(code, ErrorCode::RateLimited);
    let wait = wait.unwrap();
    assert!(wait > penalty.first_ms && wait <= 2 * penalty.first_ms, "the second period: retry_after_ms {wait}");
    ts.stop().await;
}

/// One raw WebSocket of `token` that writes `frames` send frames as fast as
/// the socket takes them, never waiting for a reply; counts the frames
/// written and the replies read (accepted, `RATE_LIMITED`).
struct Flooder {
    written: std::sync::Arc<std::sync::atomic::AtomicU64>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    limited: std::sync::Arc<std::sync::atomic::AtomicU64>,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl Flooder {
    async fn start(ts: &TestServer, token: &str, conv: &str, frames: u64) -> Flooder {
        use futures_util::{SinkExt, StreamExt};
        use std::sync::atomic::Ordering;
        use tokio_tungstenite::tungstenite::Message;
        let mut request =
            tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(ts.ws_url()).unwrap();
        request.headers_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        let (ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
        let (mut sink, mut stream) = ws.split();
        let counters = (0..3).map(|_| std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0))).collect::<Vec<_>>();
        let (written, accepted, limited) = (counters[0].clone(), counters[1].clone(), counters[2].clone());
        let writer = {
            let (written, conv) = (written.clone(), conv.to_owned());
            tokio::spawn(async move {
                for i in 0..frames {
                    let frame = serde_json::json!({"t": "send", "rid": format!("f{i}"), "conv": conv,
                        "client_msg_id": format!("flood-{i}"), "kind": "text", "content": {"text": "flood"}});
                    if sink.send(Message::Text(frame.to_string().into())).await.is_err() {
                        return;
                    }
                    written.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let reader = {
            let (accepted, limited) = (accepted.clone(), limited.clone());
            tokio::spawn(async move {
                while let Some(Ok(msg)) = stream.next().await {
                    let Message::Text(text) = msg else { continue };
                    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                    match (v["t"].as_str(), v["code"].as_str()) {
                        (Some("send"), _) => accepted.fetch_add(1, Ordering::SeqCst),
                        (Some("error"), Some("RATE_LIMITED")) => {
                            assert!(v["retry_after_ms"].as_u64().is_some(), "{v}");
                            limited.fetch_add(1, Ordering::SeqCst)
                        }
                        _ => continue,
                    };
                }
            })
        };
        Flooder { written, accepted, limited, tasks: [writer, reader] }
    }

    fn counts(&self) -> (u64, u64, u64) {
        use std::sync::atomic::Ordering;
        (self.written.load(Ordering::SeqCst), self.accepted.load(Ordering::SeqCst), self.limited.load(Ordering::SeqCst))
    }
}

impl Drop for Flooder {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_connection_is_read_at_its_frame_budget_not_refused_frame_by_frame() {
    // Ten frames a second after a burst of ten; the send quota (five, then
    // none while the test runs) refuses what the budget lets through.
    let (rate, burst) = (10u64, 10u64);
    let limits = LimitsConfig {
        frames_per_connection: Rate::new(rate as u32, burst as u32),
        send_per_device: Rate::every(Duration::from_secs(600), 5),
        ..LimitsConfig::default()
    };
    let ts = TestServer::start_with(ServerConfig { limits, ..ServerConfig::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    // The WebSocket above spent one frame of its own budget; the flooder's
    // connection (the same device, superseding it) has a fresh one.
    let started = Instant::now();
    let flood = Flooder::start(&ts, &ann.token, &conv, 5_000).await;
    // The flooder writes far more than the budget lets the server read.
    let deadline = Instant::now() + Duration::from_secs(30);
    while flood.counts().0 < 20 * burst {
        assert!(Instant::now() < deadline, "the flooder could not write: {:?}", flood.counts());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Meanwhile another user's sends go through, each answered (within
    // ben's own device quota of five).
    let mut ben_seqs = Vec::new();
    for i in 0..5 {
        ben_seqs.push(ben.send(&conv, &format!("ben-{i}")).await.msg_seq);
    }
    // Wait until the budget has held the flooder back at least once.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = common::exposition::scrape(&ts).await;
        if m.value("tidemark_frame_budget_pauses_total", &[("scope", "connection")]) >= 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the frame budget never paused the flooder");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (written, accepted, limited) = flood.counts();
    let elapsed = started.elapsed().as_secs_f64();
    // Answered: at most the burst plus the rate for the time that passed
    // (and one frame being answered as the counts were read), however much
    // more the flooder wrote.
    let bound = burst + (rate as f64 * elapsed).ceil() as u64 + 1;
    assert!(
        accepted + limited <= bound,
        "{} frames answered in {elapsed:.2} s (bound {bound}) of {written} written",
        accepted + limited
    );
    assert!(written >= 4 * (accepted + limited), "{written} written, {} answered", accepted + limited);
    // Nothing beyond the send quota was accepted, and what was accepted is
    // exactly what the store holds beside ben's sends.
    assert!(accepted <= 5, "{accepted} accepted beyond the quota of 5");
    drop(flood);
    let history = ben.ws.request_value("history", serde_json::json!({"conv": conv, "limit": 50})).await.unwrap();
    let held = history["messages"].as_array().unwrap();
    let sent_by = |who: &str| held.iter().filter(|m| m["sender"] == who).count() as u64;
    assert!(sent_by("ann") <= 5, "{} flood messages stored", sent_by("ann"));
    assert_eq!(sent_by("ben"), ben_seqs.len() as u64, "every send of ben's was stored");
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

/// A TCP connection to the test server from `from`.
async fn tcp_from(ts: &TestServer, from: std::net::IpAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::new(from, 0)).unwrap();
    socket.connect(ts.running().addr).await.unwrap()
}

/// Polls `cond` every few milliseconds for at most 10 s.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "not reached within 10 s: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_over_its_connection_cap_is_refused_then_closed_while_another_is_served() {
    use tidemark_server::limits::{Held, CONNECTIONS_PER_ADDRESS_RETRY_AFTER_MS};
    use tokio::io::AsyncReadExt;
    let cap = 3;
    let limits =
        LimitsConfig { connections_per_address_max: cap, connection_refusals_per_address_max: 1, ..Default::default() };
    // Long HTTP timeouts: a silent connection is closed by the cap, or not at all.
    let timeouts = tidemark_server::config::HttpTimeouts {
        header: Duration::from_secs(120),
        idle: Duration::from_secs(120),
        ..Default::default()
    };
    let ts = TestServer::start_with(ServerConfig { limits, http_timeouts: timeouts, ..ServerConfig::default() }).await;
    ts.user("ann").await;
    let crowded: std::net::IpAddr = "127.0.0.5".parse().unwrap();
    let other: std::net::IpAddr = "127.0.0.6".parse().unwrap();
    let conns = ts.running().state.limits.address_conns();
    let mut tokens = Vec::new();
    for d in 0..cap + 2 {
        tokens.push(ts.http.login("ann", PASSWORD, &format!("d{d}")).await.unwrap().access_token);
    }

    // The cap's WebSockets from one address.
    let mut open = Vec::new();
    for token in &tokens[..cap] {
        let (ws, events) = tidemark_client::WsConn::connect_from(&ts.ws_url(), token, crowded).await.unwrap();
        ws.request_value("ping", serde_json::json!({})).await.unwrap();
        open.push((ws, events));
    }
    assert_eq!(conns.held(crowded), Held { served: cap, answering: 0 });

    // One more upgrade: RATE_LIMITED, told when to retry; its connection
    // closes and gives its place back.
    let (code, wait) =
        refusal(tidemark_client::WsConn::connect_from(&ts.ws_url(), &tokens[cap], crowded).await.map(|_| ()));
    assert_eq!(code, ErrorCode::RateLimited);
    assert_eq!(wait, Some(CONNECTIONS_PER_ADDRESS_RETRY_AFTER_MS));
    until("the refused upgrade's place given back", || conns.held(crowded).answering == 0).await;
    // An HTTP request too, before its route is looked at.
    let http = reqwest::Client::builder().local_address(crowded).build().unwrap();
    let resp = http.get(format!("{}/healthz", ts.running().url())).send().await.unwrap();
    assert_eq!(resp.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "RATE_LIMITED");
    assert_eq!(body["retry_after_ms"], CONNECTIONS_PER_ADDRESS_RETRY_AFTER_MS);
    drop(http);
    until("the refused request's place given back", || conns.held(crowded).answering == 0).await;

    // A silent connection over the cap holds the one refusal in progress;
    // the next is closed at the accept: no byte, just the end.
    let _silent = tcp_from(&ts, crowded).await;
    until("the silent connection counted", || conns.held(crowded).answering == 1).await;
    let mut closed = tcp_from(&ts, crowded).await;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(10), closed.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "a connection past the refusals was not closed at once: {read:?}");
    assert_eq!(conns.held(crowded), Held { served: cap, answering: 1 }, "the closed one holds nothing");
    let m = common::exposition::scrape(&ts).await;
    assert!(m.value("tidemark_address_refusals_total", &[("reason", "connections")]) >= 2.0);
    assert!(m.value("tidemark_address_refusals_total", &[("reason", "connections_closed")]) >= 1.0);

    // Another address is served meanwhile.
    let (ws, _events) = tidemark_client::WsConn::connect_from(&ts.ws_url(), &tokens[cap + 1], other).await.unwrap();
    ws.request_value("ping", serde_json::json!({})).await.unwrap();

    // A closed WebSocket frees its place: the address connects again.
    let (first, _) = open.remove(0);
    first.close().await;
    until("the closed WebSocket's place given back", || conns.held(crowded).served == cap - 1).await;
    let (again, _events) = tidemark_client::WsConn::connect_from(&ts.ws_url(), &tokens[cap], crowded).await.unwrap();
    again.request_value("ping", serde_json::json!({})).await.unwrap();
    assert_eq!(conns.held(crowded).served, cap);
    ts.stop().await;
}
