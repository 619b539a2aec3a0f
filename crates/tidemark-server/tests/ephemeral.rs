//! The ephemeral lane on a real server (issue 18): typing and presence
//! reach exactly the users allowed to see them, typing expires without a
//! stop, presence changes are coalesced and can be hidden, neither ever
//! appears in `sync` or a snapshot, and both are rate-limited per device.
//!
//! Absence is shown with a barrier: a later ephemeral frame to the same
//! connection. A frame is put in its receivers' slots before the request
//! that caused it is answered, and a connection's writer sends what its
//! slots hold all at once, so a frame that was wrongly offered would have
//! arrived no later than the barrier.

mod common;

use std::time::Duration;

use common::{code, Device, TestServer};
use serde_json::{json, Value};
use tidemark_client::proto::{ErrorCode, PresenceFrame, TypingFrame};
use tidemark_client::ServerEvent;
use tidemark_server::limits::{LimitsConfig, Rate};
use tidemark_server::ServerConfig;

/// The longest wait for a frame that must arrive.
const ARRIVES_WITHIN: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq)]
enum Eph {
    Typing(TypingFrame),
    Presence(PresenceFrame),
}

/// Ephemeral frames of `d` until one matches `until` (included); panics
/// after [`ARRIVES_WITHIN`]. Hints in between are skipped.
async fn until(d: &mut Device, what: &str, until: impl Fn(&Eph) -> bool) -> Vec<Eph> {
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    let mut seen = Vec::new();
    loop {
        let ev = tokio::time::timeout_at(deadline, d.events.recv())
            .await
            .unwrap_or_else(|_| panic!("{}: no {what} within {ARRIVES_WITHIN:?}; saw {seen:?}", d.user));
        let eph = match ev {
            Some(ServerEvent::Typing(t)) => Eph::Typing(t),
            Some(ServerEvent::Presence(p)) => Eph::Presence(p),
            Some(ServerEvent::Hint { .. }) => continue,
            other => panic!("{}: connection ended waiting for {what}: {other:?}", d.user),
        };
        let done = until(&eph);
        seen.push(eph);
        if done {
            return seen;
        }
    }
}

fn typing_of(e: &Eph, conv: &str, user: &str, typing: bool) -> bool {
    matches!(e, Eph::Typing(t) if t.conv == conv && t.user == user && t.typing == typing)
}

fn presence_of(e: &Eph, user: &str, state: &str) -> bool {
    matches!(e, Eph::Presence(p) if p.user == user && p.state == state)
}

fn about(seen: &[Eph], user: &str) -> Vec<Eph> {
    seen.iter()
        .filter(|e| match e {
            Eph::Typing(t) => t.user == user,
            Eph::Presence(p) => p.user == user,
        })
        .cloned()
        .collect()
}

async fn group(owner: &Device, members: &[&str]) -> String {
    let v: Value = owner.ws.request_value("conv.create", json!({"kind": "group", "members": members})).await.unwrap();
    v["conv"].as_str().unwrap_or_else(|| panic!("conv.create: {v}")).to_owned()
}

async fn op(d: &Device, t: &str, body: Value) -> Value {
    let v = d.ws.request_value(t, body).await.unwrap();
    assert_eq!(v["t"], format!("{t}.ok"), "{t}: {v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typing_reaches_the_other_members_only_and_expires_without_a_stop() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben", "cat", "dan", "eve"] {
        ts.user(u).await;
    }
    let mut ann = ts.device("ann", "phone").await;
    let mut ben = ts.device("ben", "phone").await;
    let mut cat = ts.device("cat", "phone").await;
    let mut dan = ts.device("dan", "phone").await;
    let eve = ts.device("eve", "phone").await;
    let g = group(&ann, &["ben", "cat"]).await;
    let other = group(&eve, &["dan", "ann"]).await;

    let ok = op(&ann, "typing", json!({"conv": g, "typing": true, "timeout_ms": 400})).await;
    assert_eq!(ok["timeout_ms"], 400);
    for d in [&mut ben, &mut cat] {
        let seen = until(d, "ann typing", |e| typing_of(e, &g, "ann", true)).await;
        let Some(Eph::Typing(t)) = seen.last() else { unreachable!() };
        assert_eq!(t.timeout_ms, 400);
        // No stop was sent: the server stops it once the timeout passed.
        let seen = until(d, "ann's typing to expire", |e| typing_of(e, &g, "ann", false)).await;
        assert_eq!(about(&seen, "ann").len(), 1, "one stop, nothing else about ann: {seen:?}");
    }
    // dan is not a member of g, and ann does not hear herself: a later
    // typing of eve (in a group of eve, dan and ann) is the barrier.
    op(&eve, "typing", json!({"conv": other, "typing": true})).await;
    for d in [&mut dan, &mut ann] {
        let seen = until(d, "eve typing", |e| typing_of(e, &other, "eve", true)).await;
        assert!(!seen.iter().any(|e| matches!(e, Eph::Typing(t) if t.user == "ann")), "{}: {seen:?}", d.user);
    }
    // An explicit stop reaches the members at once; a second stop is news
    // to no one (nothing live) and is not forwarded.
    op(&eve, "typing", json!({"conv": other, "typing": false})).await;
    op(&eve, "typing", json!({"conv": other, "typing": false})).await;
    let seen = until(&mut dan, "eve's stop", |e| typing_of(e, &other, "eve", false)).await;
    assert_eq!(about(&seen, "eve").len(), 1);

    // Outsiders and bad requests are refused.
    let r = dan.ws.request::<_, Value>("typing", &json!({"conv": g, "typing": true})).await;
    assert_eq!(code(r), ErrorCode::NotMember);
    let r = dan.ws.request::<_, Value>("typing", &json!({"conv": "gnope", "typing": true})).await;
    assert_eq!(code(r), ErrorCode::NotFound);
    let r = dan.ws.request::<_, Value>("typing", &json!({"conv": g})).await;
    assert_eq!(code(r), ErrorCode::BadRequest);
    let long = op(&ann, "typing", json!({"conv": g, "typing": true, "timeout_ms": 3_600_000})).await;
    assert_eq!(long["timeout_ms"], 30_000, "the server bounds a typing's life");

    // Never in the log: ben's whole log holds conversation events only.
    ben.sync_batch(1000).await;
    assert!(!ben.log.is_empty());
    for e in &ben.log {
        assert!(!["typing", "presence"].contains(&e.kind.as_str()), "{e:?}");
    }
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_reaches_contacts_once_per_change_and_can_be_hidden() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben", "cat", "dan"] {
        ts.user(u).await;
    }
    let mut ben = ts.device("ben", "phone").await;
    let mut cat = ts.device("cat", "phone").await;
    let c = ben.ws.conv_create_direct("ann").await.unwrap().conv;
    cat.ws.conv_create_direct("dan").await.unwrap();

    // ann connects: ben (sharing a conversation) sees her online, and the
    // new connection is told who of its contacts is online.
    let mut ann = ts.device("ann", "phone").await;
    until(&mut ben, "ann online", |e| presence_of(e, "ann", "online")).await;
    until(&mut ann, "ben's answer", |e| presence_of(e, "ben", "online")).await;

    // Heartbeats and a second device say nothing; a change says one frame.
    op(&ann, "presence.set", json!({"state": "online"})).await;
    let mut ann_desk = ts.device("ann", "desk").await;
    until(&mut ann_desk, "ben's answer to the second device", |e| presence_of(e, "ben", "online")).await;
    let idle = op(&ann, "presence.set", json!({"state": "idle"})).await;
    assert_eq!(idle["state"], "online", "the desk is still online");
    op(&ann_desk, "presence.set", json!({"state": "idle"})).await;
    op(&ann_desk, "presence.set", json!({"state": "idle"})).await;
    let seen = until(&mut ben, "ann idle", |e| presence_of(e, "ann", "idle")).await;
    assert_eq!(about(&seen, "ann").len(), 1, "nothing between online and idle: {seen:?}");
    let Some(Eph::Presence(p)) = seen.last() else { unreachable!() };
    assert!(p.last_seen.is_some(), "idle carries when ann was last active");
    op(&ann, "presence.set", json!({"state": "online"})).await;
    let seen = until(&mut ben, "ann online again", |e| presence_of(e, "ann", "online")).await;
    assert_eq!(about(&seen, "ann").len(), 1, "the repeated idle said nothing: {seen:?}");

    // Hidden: others see her offline, and nothing of her after that.
    let hidden = op(&ann, "privacy.set", json!({"hide_presence": true})).await;
    assert_eq!(hidden["hide_presence"], true);
    let seen = until(&mut ben, "ann hidden", |e| presence_of(e, "ann", "offline")).await;
    let Some(Eph::Presence(p)) = seen.last() else { unreachable!() };
    assert_eq!(p.last_seen, None, "a hidden user shows no last-seen time");
    let set = op(&ann_desk, "presence.set", json!({"state": "online"})).await;
    assert_eq!((set["state"].as_str(), set["hidden"].as_bool()), (Some("offline"), Some(true)));
    op(&ann, "privacy.set", json!({"hide_presence": false})).await;
    let seen = until(&mut ben, "ann shown again", |e| presence_of(e, "ann", "online")).await;
    assert_eq!(about(&seen, "ann").len(), 1, "nothing while hidden: {seen:?}");

    // Leaving: offline once the last connection closes, with last-seen.
    ann_desk.ws.close().await;
    ann.ws.close().await;
    let seen = until(&mut ben, "ann offline", |e| presence_of(e, "ann", "offline")).await;
    assert_eq!(about(&seen, "ann").len(), 1, "one frame for two closes: {seen:?}");
    let Some(Eph::Presence(p)) = seen.last() else { unreachable!() };
    assert!(p.last_seen.is_some());

    // cat shares nothing with ann: dan's arrival is the barrier.
    ts.device("dan", "phone").await;
    let seen = until(&mut cat, "dan online", |e| presence_of(e, "dan", "online")).await;
    assert!(about(&seen, "ann").is_empty(), "cat never hears of ann: {seen:?}");

    // Over HTTP there is no connection to be present on.
    let token = ts.http.login("ann", common::PASSWORD, "web").await.unwrap().access_token;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/rpc/presence.set", ts.running().url()))
        .bearer_auth(token)
        .json(&json!({"state": "idle"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);

    // Never in the log, never in a snapshot.
    ben.sync_batch(1000).await;
    assert!(ben.log.iter().all(|e| e.conv == c && !["typing", "presence"].contains(&e.kind.as_str())));
    ben.generation = Some(999);
    assert_eq!(code(ben.sync_page(10).await), ErrorCode::ResetRequired);
    ben.install_snapshot(false).await.unwrap();
    assert!(ben.snapshot.iter().all(|m| m.conv == c), "a snapshot holds conversations only");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typing_and_presence_are_rate_limited_per_device() {
    // The default burst (20), replenished once a minute: nothing refills
    // while the test runs.
    let slow = Rate::every(Duration::from_secs(60), tidemark_server::limits::EPHEMERAL_PER_DEVICE_DEFAULT.burst);
    let limits = LimitsConfig { ephemeral_per_device: slow, ..LimitsConfig::default() };
    let ts = TestServer::start_with(ServerConfig { limits, ..ServerConfig::default() }).await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let c = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let mut limited = None;
    for i in 0..40 {
        let r = ann.ws.request::<_, Value>("typing", &json!({"conv": c, "typing": i % 2 == 0})).await;
        if let Err(e) = r {
            limited = Some((i, e));
            break;
        }
    }
    let (i, e) = limited.expect("40 typing requests at once are limited");
    assert_eq!(i, 20, "the burst is allowed, then nothing");
    assert_eq!(code(Err::<Value, _>(e)), ErrorCode::RateLimited);
    let r = ann.ws.request::<_, Value>("presence.set", &json!({"state": "idle"})).await;
    assert_eq!(code(r), ErrorCode::RateLimited, "presence shares the typing quota");
    ts.stop().await;
}

type RawWs = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A bare WebSocket of `user`'s `device`, as a client of its own would open
/// it: with `auth: None` the token goes on the upgrade and `query` after
/// the URL; otherwise the upgrade is bare and the first frame is `auth`
/// with the token and the fields of `auth`, answered `auth.ok`.
async fn raw(ts: &TestServer, user: &str, device: &str, query: &str, auth: Option<Value>) -> RawWs {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let token = ts.http.login(user, common::PASSWORD, device).await.unwrap().access_token;
    let mut request = format!("{}{query}", ts.ws_url()).into_client_request().unwrap();
    if auth.is_none() {
        request.headers_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    let mut ws = tokio_tungstenite::connect_async(request).await.unwrap().0;
    if let Some(Value::Object(mut fields)) = auth {
        fields.extend([("t".into(), json!("auth")), ("rid".into(), json!("a1")), ("token".into(), json!(token))]);
        ws.send(Message::Text(Value::Object(fields).to_string().into())).await.unwrap();
        let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
        loop {
            let msg = tokio::time::timeout_at(deadline, ws.next()).await.expect("auth.ok in time");
            let Some(Ok(Message::Text(t))) = msg else { panic!("{user}/{device}: closed before auth.ok") };
            let v: Value = serde_json::from_str(&t).unwrap();
            if v["rid"] == "a1" {
                assert_eq!(v["t"], "auth.ok", "{v}");
                break;
            }
        }
    }
    ws
}

/// The presence frames (`t` of each) `ws` reads until it has heard of
/// `users` users, and what it learned of each: `(state, last_seen)`, the
/// entries of a `presence.batch` applied in order as single frames.
async fn learn_presence(
    ws: &mut RawWs,
    users: usize,
) -> (Vec<String>, std::collections::BTreeMap<String, (String, Option<i64>)>) {
    use futures_util::StreamExt;
    use tidemark_client::proto::ServerFrame;
    use tokio_tungstenite::tungstenite::Message;
    let (mut frames, mut learned) = (Vec::new(), std::collections::BTreeMap::new());
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    while learned.len() < users {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("heard of {} users of {users}: {learned:?}", learned.len()));
        let Some(Ok(Message::Text(t))) = msg else { continue };
        let entries = match serde_json::from_str::<ServerFrame>(&t) {
            Ok(ServerFrame::Presence(p)) => vec![p],
            Ok(ServerFrame::PresenceBatch(b)) => b.presence,
            _ => continue,
        };
        frames.push(serde_json::from_str::<Value>(&t).unwrap()["t"].as_str().unwrap().to_owned());
        for p in entries {
            learned.insert(p.user, (p.state, p.last_seen));
        }
    }
    (frames, learned)
}

/// Issue 19: the answers to a new connection from its audience are one
/// `presence.batch` frame for a connection that opted in (by the upgrade's
/// query or by its `auth` frame), and one `presence` frame per user for one
/// that did not (old clients unchanged); both learn the same states.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_learns_its_audience_in_one_batch_when_opted_in_and_frame_by_frame_otherwise() {
    const PEERS: usize = 12;
    let ts = TestServer::start().await;
    ts.user("ann").await;
    let peers: Vec<String> = (0..PEERS).map(|i| format!("peer{i:02}")).collect();
    let mut devices = Vec::new();
    for p in &peers {
        ts.user(p).await;
        devices.push(ts.device(p, "phone").await);
    }
    let mut members: Vec<&str> = peers[1..].iter().map(String::as_str).collect();
    members.push("ann");
    group(&devices[0], &members).await;
    op(&devices[1], "presence.set", json!({"state": "idle"})).await;

    // The upgrade's query (the token in the header, no auth frame).
    let mut by_query = raw(&ts, "ann", "phone", "?presence_batch=true", None).await;
    let (frames, learned) = learn_presence(&mut by_query, PEERS).await;
    assert_eq!(frames, ["presence.batch"], "the whole audience in one frame");
    let states: Vec<&str> = learned.values().map(|(s, _)| s.as_str()).collect();
    assert_eq!(states.iter().filter(|s| **s == "online").count(), PEERS - 1, "{learned:?}");
    assert_eq!(learned["peer01"].0, "idle");
    assert!(learned["peer01"].1.is_some(), "idle carries last_seen");

    // The auth frame's field.
    let mut by_auth = raw(&ts, "ann", "desk", "", Some(json!({"presence_batch": true}))).await;
    let (frames, learned_by_auth) = learn_presence(&mut by_auth, PEERS).await;
    assert_eq!(frames, ["presence.batch"]);
    assert_eq!(learned_by_auth, learned);

    // Not opted in, either way: a frame per user, the same entries.
    let mut old = raw(&ts, "ann", "tablet", "", Some(json!({}))).await;
    let (frames, learned_old) = learn_presence(&mut old, PEERS).await;
    assert_eq!(frames, vec!["presence"; PEERS]);
    assert_eq!(learned_old, learned);
    let mut old_header = raw(&ts, "ann", "web", "?presence_batch=false", None).await;
    let (frames, learned_old) = learn_presence(&mut old_header, PEERS).await;
    assert_eq!(frames, vec!["presence"; PEERS]);
    assert_eq!(learned_old, learned);

    // A query that is not a bool is refused before the upgrade.
    let token = ts.http.login("ann", common::PASSWORD, "bad").await.unwrap().access_token;
    let mut request = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(format!(
        "{}?presence_batch=maybe",
        ts.ws_url()
    ))
    .unwrap();
    request.headers_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    match tokio_tungstenite::connect_async(request).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 400),
        other => panic!("expected a refused upgrade, got {:?}", other.map(|_| ())),
    }
    ts.stop().await;
}
