//! Offline push (P4) end to end: a real server, real clients, and a real
//! HTTP receiver on 127.0.0.1 standing in for the operator's webhook
//! provider, which verifies each request's HMAC signature and answers as
//! each test scripts it (accepted, token dead, throttled).
//!
//! "Pushed once" is shown with a barrier, not a sleep: after the pushes
//! under test, one more event is made to be pushed; once it arrives (the
//! worker handles one device's ranges in order, each after the last one's
//! position was recorded), nothing earlier can still be on its way.

mod common;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use common::{code, TestServer, PASSWORD};
use serde_json::{json, Value};
use tidemark_client::proto::{ErrorCode, SendReq};
use tidemark_core::push::PushPolicy;
use tidemark_proto::push::{PushListOk, PushPayload, PushRegisterOk};
use tidemark_push::webhook::{verify_signature, Webhook, SIGNATURE_HEADER, TOKEN_HEADER};
use tidemark_server::push::PushConfig;
use tidemark_server::ServerConfig;

const SECRET: &[u8] = b"webhook-shared-secret";
/// The coalescing window of these tests: short, but a burst sent back to
/// back lands well inside it.
const WINDOW_MS: i64 = 400;
/// Bound of every wait on a condition.
const WAIT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone)]
struct Pushed {
    token: String,
    payload: PushPayload,
    at: Instant,
}

/// The provider's receiver: records every verified request; answers from
/// a per-token script (then 200).
#[derive(Clone, Default)]
struct Receiver {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    pushed: Vec<Pushed>,
    script: HashMap<String, VecDeque<(u16, Option<&'static str>)>>,
    bad_signatures: usize,
}

impl Receiver {
    async fn start(&self) -> String {
        let app = axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        format!("http://{addr}/hook")
    }

    fn script(&self, token: &str, answers: &[(u16, Option<&'static str>)]) {
        self.inner.lock().unwrap().script.insert(token.into(), answers.iter().copied().collect());
    }

    fn to(&self, token: &str) -> Vec<Pushed> {
        self.inner.lock().unwrap().pushed.iter().filter(|p| p.token == token).cloned().collect()
    }

    /// Waits until `token` got `n` requests; returns them.
    async fn wait_for(&self, token: &str, n: usize) -> Vec<Pushed> {
        let start = Instant::now();
        loop {
            let got = self.to(token);
            if got.len() >= n {
                return got;
            }
            assert!(start.elapsed() < WAIT, "{token}: {} of {n} pushes after {WAIT:?}: {got:?}", got.len());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    let mut inner = r.inner.lock().unwrap();
    let signature = headers.get(SIGNATURE_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
    if verify_signature(SECRET, signature, &body, tidemark_server::util::now_ms()).is_err() {
        inner.bad_signatures += 1;
        return (StatusCode::UNAUTHORIZED, HeaderMap::new());
    }
    let token = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let payload: PushPayload = serde_json::from_slice(&body).expect("the payload is a PushPayload");
    inner.pushed.push(Pushed { token: token.clone(), payload, at: Instant::now() });
    let (status, retry_after) = inner.script.get_mut(&token).and_then(VecDeque::pop_front).unwrap_or((200, None));
    let mut out = HeaderMap::new();
    if let Some(s) = retry_after {
        out.insert("retry-after", s.parse().unwrap());
    }
    (StatusCode::from_u16(status).unwrap(), out)
}

async fn server(receiver: &Receiver) -> TestServer {
    let url = receiver.start().await;
    let push = PushConfig {
        providers: vec![Arc::new(Webhook::new(url, SECRET.to_vec()))],
        token_key: Some([9; 32]),
        policy: PushPolicy { window_ms: WINDOW_MS, ..PushPolicy::default() },
        poll: Duration::from_millis(50),
        ..PushConfig::default()
    };
    TestServer::start_with(ServerConfig { push, ..ServerConfig::default() }).await
}

/// Logs a device in over HTTP only (no WebSocket: offline) and registers
/// its push target; returns its access token.
async fn offline(ts: &TestServer, user: &str, device: &str, token: &str, preview: &str) -> String {
    let login = ts.http.login(user, PASSWORD, device).await.unwrap();
    register(ts, &login.access_token, token, preview).await;
    login.access_token
}

async fn register(ts: &TestServer, access: &str, token: &str, preview: &str) -> PushRegisterOk {
    let req = json!({"platform": "webhook", "token": token, "app_id": "test", "preview": preview});
    ts.http.rpc(access, "push.register", &req).await.unwrap()
}

fn text(conv: &str, cmid: &str, text: &str) -> SendReq {
    SendReq {
        conv: conv.into(),
        client_msg_id: cmid.into(),
        kind: "text".into(),
        content: json!({"text": text}),
        mentions: Vec::new(),
        mention_all: false,
    }
}

/// P4, seed §17.3: what a notification says is the most private of the
/// device's level, the user's preference (`privacy.set`) and the user's
/// preference for the conversation (`conv.settings`).
#[tokio::test]
async fn the_conversation_and_user_preferences_narrow_what_a_push_says() {
    let receiver = Receiver::default();
    let ts = server(&receiver).await;
    for u in ["ann", "bob"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "laptop").await;
    let bob = offline(&ts, "bob", "tablet", "tok-bob-full", "full").await;
    let ab = ann.ws.conv_create_direct("bob").await.unwrap().conv;
    let (http, bob_token) = (&ts.http, bob.as_str());
    let settings = |v: Value| async move { http.rpc::<_, Value>(bob_token, "conv.settings", &v).await };
    let next = |cmid: &'static str, n: usize| push_after(&ann, &receiver, &ab, cmid, n);
    let p = next("everything", 1).await;
    assert_eq!(p.conv.as_deref(), Some(ab.as_str()));
    assert_eq!(p.preview.as_ref().map(|p| p.text.as_str()), Some("everything"), "the device allows full: {p:?}");

    let reply = settings(json!({"conv": ab, "push_preview": "conversation"})).await.unwrap();
    assert_eq!((reply["push_preview"].as_str(), reply["muted"].as_bool()), (Some("conversation"), Some(false)));
    let p = next("named", 2).await;
    assert_eq!((p.conv.as_deref(), p.preview.as_ref()), (Some(ab.as_str()), None), "the conversation narrows: {p:?}");

    settings(json!({"conv": ab, "push_preview": "none"})).await.unwrap();
    // conv.list shows the conversation's preference (absent while `full`).
    let list: Value = ts.http.rpc(bob_token, "conv.list", &json!({})).await.unwrap();
    let row =
        |list: &Value| list["conversations"].as_array().unwrap().iter().find(|c| c["conv"] == ab.as_str()).cloned();
    assert_eq!(row(&list).unwrap()["push_preview"], "none", "{list}");
    let p = next("quiet", 3).await;
    assert_eq!((p.conv.as_ref(), p.preview.as_ref(), p.count), (None, None, 1), "nothing but a count: {p:?}");

    // The conversation opens up again; the user's own preference narrows.
    settings(json!({"conv": ab, "push_preview": "full"})).await.unwrap();
    let mine: Value = ts.http.rpc(&bob, "privacy.set", &json!({"push_preview": "conversation"})).await.unwrap();
    assert_eq!(mine["push_preview"], "conversation");
    let p = next("user-narrowed", 4).await;
    assert_eq!((p.conv.as_deref(), p.preview.as_ref()), (Some(ab.as_str()), None), "the user narrows: {p:?}");

    let _: Value = ts.http.rpc(&bob, "privacy.set", &json!({"push_preview": "full"})).await.unwrap();
    let list: Value = ts.http.rpc(bob_token, "conv.list", &json!({})).await.unwrap();
    assert!(row(&list).unwrap().get("push_preview").is_none(), "full is the default and not shown: {list}");
    let p = next("open-again", 5).await;
    assert_eq!(p.preview.map(|p| p.text), Some("open-again".to_string()));
    // A setting is not a message: the four settings events pushed nothing.
    assert_eq!(receiver.to("tok-bob-full").len(), 5);
    ts.stop().await;
}

/// Ann sends `cmid` to `conv`; returns the `n`-th push bob's full-preview
/// device got.
async fn push_after(ann: &common::Device, receiver: &Receiver, conv: &str, cmid: &str, n: usize) -> PushPayload {
    let _: tidemark_client::proto::SendOk = ann.ws.request("send", &text(conv, cmid, cmid)).await.unwrap();
    let got = receiver.wait_for("tok-bob-full", n).await;
    assert_eq!(got.len(), n, "one push per message: {got:?}");
    got[n - 1].payload.clone()
}

#[tokio::test]
async fn an_offline_device_is_pushed_once_per_burst_and_online_own_and_muted_are_not() {
    let receiver = Receiver::default();
    let ts = server(&receiver).await;
    for u in ["ann", "bob", "cy"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "laptop").await;
    let cy = ts.device("cy", "phone").await;
    // Bob: an offline phone (no preview), an offline tablet (full
    // preview), and a desk that is online and also registered.
    offline(&ts, "bob", "phone", "tok-bob-phone", "none").await;
    offline(&ts, "bob", "tablet", "tok-bob-tablet", "full").await;
    let desk = ts.device("bob", "desk").await;
    register(&ts, &desk.token, "tok-bob-desk", "conversation").await;
    // Ann's other device is offline and registered: her own sends must
    // not wake it.
    offline(&ts, "ann", "tab", "tok-ann-tab", "full").await;

    let ab = ann.ws.conv_create_direct("bob").await.unwrap().conv;
    let cb = cy.ws.conv_create_direct("bob").await.unwrap().conv;
    // A burst of five, back to back.
    for i in 0..5 {
        let _: tidemark_client::proto::SendOk =
            ann.ws.request("send", &text(&ab, &format!("a{i}"), &format!("hello {i}"))).await.unwrap();
    }
    let [phone] = receiver.wait_for("tok-bob-phone", 1).await.try_into().unwrap();
    assert_eq!(phone.payload.count, 5, "one notification for the burst, with its count: {phone:?}");
    assert_eq!((phone.payload.conv.as_ref(), phone.payload.preview.as_ref()), (None, None), "preview none: {phone:?}");
    let [tablet] = receiver.wait_for("tok-bob-tablet", 1).await.try_into().unwrap();
    assert_eq!(tablet.payload.count, 5);
    assert_eq!(tablet.payload.conv.as_deref(), Some(ab.as_str()), "full preview names the conversation");
    let preview = tablet.payload.preview.as_ref().expect("full preview");
    assert_eq!((preview.sender.as_str(), preview.text.as_str()), ("ann", "hello 4"), "the newest message");

    // Bob mutes his conversation with cy; cy's message there is not
    // pushed, ann's next one is (the barrier), alone.
    let _: Value = desk.ws.request_value("conv.settings", json!({"conv": cb, "muted": true})).await.unwrap();
    let _: tidemark_client::proto::SendOk = cy.ws.request("send", &text(&cb, "c0", "muted one")).await.unwrap();
    let _: tidemark_client::proto::SendOk = ann.ws.request("send", &text(&ab, "a5", "after")).await.unwrap();
    let pushes = receiver.wait_for("tok-bob-phone", 2).await;
    assert_eq!(pushes[1].payload.count, 1, "the muted conversation's message is not counted: {pushes:?}");
    let pushes = receiver.wait_for("tok-bob-tablet", 2).await;
    let preview = pushes[1].payload.preview.as_ref().unwrap();
    assert_eq!(preview.text, "after");

    // After the barrier: exactly two pushes each (the burst was not
    // repeated), none to the online desk, none to ann's own tab.
    assert_eq!(receiver.to("tok-bob-phone").len(), 2);
    assert_eq!(receiver.to("tok-bob-tablet").len(), 2);
    assert!(receiver.to("tok-bob-desk").is_empty(), "an online device is not pushed");
    assert!(receiver.to("tok-ann-tab").is_empty(), "the sender's other device is not pushed");
    let ids: Vec<String> = receiver.to("tok-bob-phone").into_iter().map(|p| p.payload.notification_id).collect();
    assert_ne!(ids[0], ids[1]);
    assert_eq!(receiver.inner.lock().unwrap().bad_signatures, 0);

    // Cy unmuted: pushed again.
    let _: Value = desk.ws.request_value("conv.settings", json!({"conv": cb, "muted": false})).await.unwrap();
    let _: tidemark_client::proto::SendOk = cy.ws.request("send", &text(&cb, "c1", "unmuted")).await.unwrap();
    let pushes = receiver.wait_for("tok-bob-phone", 3).await;
    assert_eq!(pushes[2].payload.count, 1);
    assert!(receiver.to("tok-bob-desk").is_empty(), "still online, still not pushed");
    ts.stop().await;
}

#[tokio::test]
async fn registration_shows_no_token_and_refuses_bad_targets_and_revocation_removes_it() {
    let receiver = Receiver::default();
    let ts = server(&receiver).await;
    ts.user("bob").await;
    let phone = ts.http.login("bob", PASSWORD, "phone").await.unwrap().access_token;
    let desk = ts.device("bob", "desk").await;
    let secret_token = "apns-very-secret-token-7890";
    let ok = register(&ts, &phone, secret_token, "conversation").await;
    assert!(ok.created);
    assert_eq!((ok.target.token_last4.as_str(), ok.target.current), ("7890", true));
    assert_eq!(ok.target.token_hash, tidemark_push::token_hash(secret_token));
    let again = register(&ts, &phone, "another-token-1234", "none").await;
    assert!(!again.created, "a second registration replaces the first");
    let list: PushListOk = desk.ws.request("push.list", &json!({})).await.unwrap();
    let shown = serde_json::to_string(&list).unwrap();
    assert!(!shown.contains("another-token") && !shown.contains(secret_token), "{shown}");
    assert_eq!(list.targets.len(), 1);
    assert!(!list.targets[0].current);
    // The token is sealed at rest: not in the database file in clear.
    let db = std::fs::read_dir(ts.dir.path()).unwrap().map(|e| std::fs::read(e.unwrap().path()).unwrap_or_default());
    assert!(db.into_iter().all(|bytes| !bytes.windows(13).any(|w| w == b"another-token")), "token stored in clear");

    for bad in [
        json!({"platform": "carrier-pigeon", "token": "t"}),
        json!({"platform": "webhook", "token": ""}),
        json!({"platform": "webhook", "token": "x".repeat(tidemark_proto::push::PUSH_TOKEN_BYTES_MAX + 1)}),
        json!({"platform": "webpush", "token": "https://push.example/x"}),
        json!({"platform": "webhook", "token": "t", "p256dh": "abc"}),
        json!({"platform": "webhook", "token": "t", "preview": "everything"}),
        // A platform this server has no provider for.
        json!({"platform": "gateway", "token": "t"}),
    ] {
        let r: Result<PushRegisterOk, _> = ts.http.rpc(&phone, "push.register", &bad).await;
        assert_eq!(code(r), ErrorCode::BadRequest, "{bad}");
    }
    let _: Value = desk.ws.request_value("device.revoke", json!({"device_id": "phone"})).await.unwrap();
    let list: PushListOk = desk.ws.request("push.list", &json!({})).await.unwrap();
    assert!(list.targets.is_empty(), "a revoked device loses its push target");
    let removed: Value = desk.ws.request_value("push.remove", json!({})).await.unwrap();
    assert_eq!(removed["removed"], false);
    ts.stop().await;
}

#[tokio::test]
async fn a_dead_token_is_removed_and_throttling_backs_off_while_sends_and_syncs_go_on() {
    let receiver = Receiver::default();
    let ts = server(&receiver).await;
    for u in ["ann", "bob"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "laptop").await;
    receiver.script("tok-dead", &[(410, None)]);
    receiver.script("tok-slow", &[(429, Some("2"))]);
    offline(&ts, "bob", "old-phone", "tok-dead", "none").await;
    offline(&ts, "bob", "phone", "tok-slow", "none").await;
    let mut desk = ts.device("bob", "desk").await;
    let ab = ann.ws.conv_create_direct("bob").await.unwrap().conv;
    let _: tidemark_client::proto::SendOk = ann.ws.request("send", &text(&ab, "m0", "one")).await.unwrap();

    // Token dead: the target goes.
    receiver.wait_for("tok-dead", 1).await;
    let start = Instant::now();
    loop {
        let list: PushListOk = desk.ws.request("push.list", &json!({})).await.unwrap();
        if list.targets.iter().all(|t| t.device_id != "old-phone") {
            break;
        }
        assert!(start.elapsed() < WAIT, "the rejected target was not removed: {list:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Throttled with a hint of 2 s: while it waits, sends and syncs work.
    let [first] = receiver.wait_for("tok-slow", 1).await.try_into().unwrap();
    for i in 1..4 {
        let _: tidemark_client::proto::SendOk =
            ann.ws.request("send", &text(&ab, &format!("m{i}"), "during the backoff")).await.unwrap();
    }
    desk.sync_until(4, 100).await;
    let pushes = receiver.wait_for("tok-slow", 2).await;
    let waited = pushes[1].at - first.at;
    assert!(waited >= Duration::from_millis(1_900), "the retry came after {waited:?}, before the hint");
    assert_eq!(pushes[0].payload.count, 1);

    // Barrier: one more message reaches the live target; the dead one got
    // exactly its one request, and the throttled one every message once:
    // the counts add up to the messages sent (the retry carries what came
    // meanwhile, coalesced).
    let _: tidemark_client::proto::SendOk = ann.ws.request("send", &text(&ab, "m9", "last")).await.unwrap();
    let start = Instant::now();
    loop {
        let total: u32 = receiver.to("tok-slow").iter().skip(1).map(|p| p.payload.count).sum();
        if total >= 5 {
            assert_eq!(total, 5, "m0..m3 and m9 once each: {:?}", receiver.to("tok-slow"));
            break;
        }
        assert!(start.elapsed() < WAIT, "pushes after the throttle: {:?}", receiver.to("tok-slow"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(receiver.to("tok-dead").len(), 1, "no further push goes to a dead token");

    // The metrics say what happened, and never "delivered".
    let metrics = reqwest::get(format!("{}/metrics", ts.running().url())).await.unwrap().text().await.unwrap();
    // Each series carries its stage label too, so a label is looked for
    // inside the braces, not as the whole label set.
    for (family, label) in [
        ("tidemark_push_results_total{", "result=\"token_rejected\""),
        ("tidemark_push_results_total{", "result=\"throttled\""),
        ("tidemark_push_results_total{", "result=\"accepted\""),
        ("tidemark_push_targets_removed_total", ""),
        ("tidemark_push_coalesced_events_total", ""),
        ("tidemark_push_accept_latency_seconds_count", ""),
    ] {
        let value: f64 = metrics
            .lines()
            .find(|l| l.starts_with(family) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{family}{label} missing"));
        assert!(value >= 1.0, "{family}{label} = {value}");
    }
    assert!(!metrics.lines().any(|l| l.starts_with("tidemark_push") && l.contains("deliver")));
    ts.stop().await;
}

/// The value of an unlabelled-but-for-stage gauge on `/metrics`.
async fn gauge(ts: &TestServer, family: &str) -> f64 {
    let metrics = reqwest::get(format!("{}/metrics", ts.running().url())).await.unwrap().text().await.unwrap();
    metrics
        .lines()
        .find(|l| l.starts_with(&format!("{family}{{")) || l.starts_with(&format!("{family} ")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{family} missing"))
}

/// Waits until the gauge reads `want`.
async fn gauge_reaches(ts: &TestServer, family: &str, want: f64) {
    let start = Instant::now();
    loop {
        let got = gauge(ts, family).await;
        if got == want {
            return;
        }
        assert!(start.elapsed() < WAIT, "{family} = {got}, not {want}, after {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The owing gauge (seed §18.1, push stage) after known traffic: a target
/// the provider holds off owes its range until its device ACKs it; a
/// target with nothing above its position owes nothing.
#[tokio::test]
async fn the_owing_gauge_counts_targets_until_their_range_is_settled() {
    let receiver = Receiver::default();
    let ts = server(&receiver).await;
    for u in ["ann", "bob", "cy"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "laptop").await;
    // The provider throttles bob's phone for longer than the test runs
    // (the wait is capped at the backoff maximum, minutes).
    receiver.script("tok-held", &[(429, Some("3600"))]);
    offline(&ts, "bob", "phone", "tok-held", "none").await;
    offline(&ts, "cy", "phone", "tok-cy", "none").await;
    assert_eq!(gauge(&ts, "tidemark_push_targets_owing").await, 0.0, "nothing sent yet");
    let ab = ann.ws.conv_create_direct("bob").await.unwrap().conv;
    for i in 0..3 {
        let _: tidemark_client::proto::SendOk =
            ann.ws.request("send", &text(&ab, &format!("h{i}"), "held")).await.unwrap();
    }
    receiver.wait_for("tok-held", 1).await;
    // Bob's phone owes its three messages (cy owes nothing: no traffic).
    gauge_reaches(&ts, "tidemark_push_targets_owing", 1.0).await;
    // The phone comes online and ACKs: nothing is owed any more.
    let mut phone = ts.device("bob", "phone").await;
    phone.sync_until(3, 100).await;
    gauge_reaches(&ts, "tidemark_push_targets_owing", 0.0).await;
    assert_eq!(receiver.to("tok-held").len(), 1, "the throttled target was not pushed again");
    assert!(receiver.to("tok-cy").is_empty());
    ts.stop().await;
}

/// Issue 18, P4: a mention overrides mute. Bob muted the group; cy's plain
/// message there is not pushed, cy's messages that mention bob (by name,
/// then everyone) are, each counted alone; `conv.list` counts them apart
/// from unread.
#[tokio::test]
async fn a_muted_conversations_mention_is_pushed() {
    let receiver = Receiver::default();
    let ts = server(&receiver).await;
    for u in ["ann", "bob", "cy"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "laptop").await;
    let cy = ts.device("cy", "phone").await;
    offline(&ts, "bob", "phone", "tok-bob-phone", "none").await;
    let desk = ts.device("bob", "desk").await;
    let g: Value =
        ann.ws.request_value("conv.create", json!({"kind": "group", "members": ["bob", "cy"]})).await.unwrap();
    let g = g["conv"].as_str().unwrap().to_owned();
    let _: Value = desk.ws.request_value("conv.settings", json!({"conv": g, "muted": true})).await.unwrap();

    let _: tidemark_client::proto::SendOk = cy.ws.request("send", &text(&g, "c0", "plain")).await.unwrap();
    let named = SendReq { mentions: vec!["Bob".into()], ..text(&g, "c1", "@bob look") };
    let _: tidemark_client::proto::SendOk = cy.ws.request("send", &named).await.unwrap();
    let [first] = receiver.wait_for("tok-bob-phone", 1).await.try_into().unwrap();
    assert_eq!(first.payload.count, 1, "only the mention counts in the muted group: {first:?}");

    let everyone = SendReq { mention_all: true, ..text(&g, "c2", "@all") };
    let _: tidemark_client::proto::SendOk = cy.ws.request("send", &everyone).await.unwrap();
    let pushes = receiver.wait_for("tok-bob-phone", 2).await;
    assert_eq!(pushes[1].payload.count, 1, "everyone mentions bob too: {pushes:?}");

    let list: Value = desk.ws.request_value("conv.list", json!({})).await.unwrap();
    let row = list["conversations"].as_array().unwrap().iter().find(|c| c["conv"] == g.as_str()).unwrap().clone();
    assert_eq!(
        (row["unread"].as_u64(), row["mentions"].as_u64(), row["muted"].as_bool()),
        (Some(3), Some(2), Some(true))
    );
    // Past MENTIONS_MAX: a typed refusal.
    let many = (0..=tidemark_client::proto::MENTIONS_MAX).map(|i| format!("u{i}")).collect();
    let too_many = SendReq { mentions: many, ..text(&g, "c3", "x") };
    let refused = cy.ws.request::<_, tidemark_client::proto::SendOk>("send", &too_many).await;
    assert!(format!("{refused:?}").contains("code: BadRequest"), "{refused:?}");
    assert_eq!(receiver.to("tok-bob-phone").len(), 2);
    ts.stop().await;
}
