//! Fuzzing the gateway (issue 7): random frames — unknown and known
//! operations, every field with values of the wrong type, out of range or
//! absent, random text — sent over one real WebSocket. Every reply must be
//! the operation's `.ok` or an `error` whose code is in the contract and is
//! never `INTERNAL`; the connection must survive all of it. Deterministic
//! (proptest's fixed-seed runner), so a failure replays.

mod common;

use common::*;
use futures_util::{SinkExt, StreamExt};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use serde_json::{json, Map, Value};
use tidemark_client::proto::{op, ErrorCode};
use tokio_tungstenite::tungstenite::Message;

/// Frames per run: a short run in CI; `TIDEMARK_FUZZ_FRAMES` sets a long one.
fn frames() -> usize {
    std::env::var("TIDEMARK_FUZZ_FRAMES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000)
}

const FIELDS: &[&str] = &[
    "conv",
    "client_msg_id",
    "kind",
    "content",
    "sync_generation",
    "local_applied_sync_seq",
    "limit",
    "batch_token",
    "cursor",
    "sync_seq",
    "members",
    "user",
    "after",
    "epoch",
    "before_seq",
    "message_id",
    "base_version",
    "reaction",
    "op",
    "muted",
    "pinned",
    "read_to_seq",
    "message_ids",
    "device_id",
    "snapshot_token",
    "page",
    "token",
];

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        (0u64..20).prop_map(|n| json!(n)),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| json!(f)),
        "[a-z0-9._-]{0,12}".prop_map(Value::String),
        ".{0,40}".prop_map(Value::String),
        Just(json!("direct")),
        Just(json!("group")),
        Just(json!("add")),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(2, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn frame() -> impl Strategy<Value = String> {
    let mut ops: Vec<&'static str> = op::ALL.to_vec();
    ops.extend(["auth", "nope", "", "sync.ok", "error"]);
    let structured = (
        prop::sample::select(ops),
        prop::collection::btree_map(prop::sample::select(FIELDS.to_vec()), value(), 0..6),
        prop::option::of("[a-z0-9]{1,6}"),
    )
        .prop_map(|(t, fields, rid)| {
            let mut m: Map<String, Value> = fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            m.insert("t".into(), json!(t));
            if let Some(rid) = rid {
                m.insert("rid".into(), json!(rid));
            }
            Value::Object(m).to_string()
        });
    prop_oneof![8 => structured, 1 => ".{0,60}", 1 => value().prop_map(|v| v.to_string())]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_frames_get_contract_errors_and_never_kill_the_connection() {
    // Without rate limits: this client never waits as `RATE_LIMITED` tells
    // it, and a connection that keeps ignoring its waits is closed by
    // design (docs/protocol.md §1.6; tests/limits.rs covers that and the
    // refusals themselves).
    let limits = tidemark_server::limits::LimitsConfig::off();
    let ts = TestServer::start_with(tidemark_server::ServerConfig { limits, ..Default::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let login = ts.http.login("ann", PASSWORD, "phone").await.unwrap();
    // Something to act on: a conversation with a message.
    let setup = ts.device("ann", "laptop").await;
    let conv = setup.ws.conv_create_direct("ben").await.unwrap().conv;
    setup.send(&conv, "seed").await;

    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(ts.ws_url()).unwrap();
    request.headers_mut().insert("authorization", format!("Bearer {}", login.access_token).parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();

    let mut runner = TestRunner::deterministic();
    let strategy = frame();
    let contract: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    let (mut oks, mut errors) = (0, 0);
    let total = frames();
    for i in 0..total {
        // Half the frames aim at the real conversation, to reach deeper paths.
        let mut text = strategy.new_tree(&mut runner).unwrap().current();
        if i % 2 == 0 {
            text = text.replace("\"conv\":", &format!("\"conv\":\"{conv}\",\"_was\":"));
        }
        ws.send(Message::Text(text.clone().into())).await.unwrap();
        let reply = loop {
            let msg = tokio::time::timeout(std::time::Duration::from_secs(10), ws.next())
                .await
                .unwrap_or_else(|_| panic!("no reply to frame {i}: {text}"))
                .unwrap_or_else(|| panic!("connection closed by frame {i}: {text}"))
                .unwrap();
            match msg {
                Message::Text(t) => {
                    let v: Value = serde_json::from_str(&t).unwrap();
                    if v["t"] == "hint" {
                        continue;
                    }
                    break v;
                }
                Message::Close(_) => panic!("connection closed by frame {i}: {text}"),
                _ => continue,
            }
        };
        let t = reply["t"].as_str().unwrap_or_default();
        if t == "error" {
            let code = reply["code"].as_str().unwrap_or_default();
            assert!(contract.contains(&code), "frame {i} got a code outside the contract: {reply} for {text}");
            assert_ne!(code, "INTERNAL", "frame {i} hit a bug: {reply} for {text}");
            errors += 1;
        } else {
            assert!(t.ends_with(".ok"), "frame {i}: unexpected reply {reply} for {text}");
            oks += 1;
        }
    }
    ws.send(Message::Text(json!({"t": "ping", "rid": "last"}).to_string().into())).await.unwrap();
    loop {
        if let Message::Text(t) = ws.next().await.unwrap().unwrap() {
            let v: Value = serde_json::from_str(&t).unwrap();
            if v["rid"] == "last" {
                assert_eq!(v["t"], "ping.ok", "the connection survived {total} random frames");
                break;
            }
        }
    }
    eprintln!("fuzz: {total} frames, {oks} accepted, {errors} refused with contract codes");
    ts.stop().await;
}
