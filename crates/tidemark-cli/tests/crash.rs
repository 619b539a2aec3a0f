//! F1 fault drill with the real binary: the server is SIGKILLed after it
//! accepted messages and before it fanned them out; after a restart every
//! recipient device gets each message exactly once.

use std::time::Duration;

use tidemark_client::proto::{SendOk, SendReq, SyncOk, SyncReq};
use tidemark_client::Http;

const ADMIN: &str = "crash-admin";

mod common;

use common::{pull, spawn_serve, ServerProc};

fn start(data: &std::path::Path, extra: &[&str]) -> ServerProc {
    let mut args: Vec<std::ffi::OsString> = vec!["--data".into(), data.into()];
    args.extend(extra.iter().map(|a| a.into()));
    spawn_serve(&args, ADMIN)
}

/// The message ids a device pulled, in log order.
fn ids(seen: &[common::Seen]) -> Vec<&String> {
    seen.iter().map(|s| &s.message_id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_after_accept_before_fanout_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = start(dir.path(), &["--hold-fanout"]);
    let http = Http::new(&first.url);
    for u in ["ann", "ben"] {
        http.create_user(ADMIN, u, "pw").await.unwrap();
    }
    let ann = http.login("ann", "pw", "phone").await.unwrap();
    let ben_phone = http.login("ben", "pw", "phone").await.unwrap();
    let conv: serde_json::Value = http
        .rpc(&ann.access_token, "conv.create", &serde_json::json!({"kind": "direct", "members": ["ben"]}))
        .await
        .unwrap();
    let conv = conv["conv"].as_str().unwrap().to_owned();
    let mut accepted = Vec::new();
    for i in 0..20 {
        let req = SendReq {
            conv: conv.clone(),
            client_msg_id: format!("k{i}"),
            kind: "text".into(),
            content: serde_json::json!({"i": i}),
            mentions: Vec::new(),
            mention_all: false,
        };
        let ok: SendOk = http.rpc(&ann.access_token, "send", &req).await.unwrap();
        accepted.push(ok.message_id);
    }
    // Fan-out is held: nothing reached ben's log yet.
    let first_page: SyncOk = http
        .rpc(&ben_phone.access_token, "sync", &SyncReq { local_applied_sync_seq: Some(0), ..Default::default() })
        .await
        .unwrap();
    assert_eq!(first_page.batch_high_watermark, 0, "accepted but not fanned out");

    // Child::kill sends SIGKILL: no graceful shutdown, no final checkpoint.
    first.child.kill().expect("SIGKILL");
    first.child.wait().unwrap();

    let mut second = start(dir.path(), &[]);
    let http = Http::new(&second.url);
    let ben_phone = http.login("ben", "pw", "phone").await.unwrap();
    let ben_desk = http.login("ben", "pw", "desk").await.unwrap();
    let ann_laptop = http.login("ann", "pw", "laptop").await.unwrap();
    for token in [&ben_desk.access_token, &ann_laptop.access_token] {
        let got = pull(&http, token, 20, Duration::from_secs(20), 7).await;
        assert_eq!(ids(&got), accepted.iter().collect::<Vec<_>>(), "every accepted message once, in order");
    }
    // ben's phone had synced (nothing) before the crash under generation 1;
    // it resumes under the same generation from its ACK.
    let mut got: Vec<(u64, String)> = Vec::new();
    let mut req = SyncReq {
        sync_generation: Some(first_page.sync_generation),
        local_applied_sync_seq: Some(0),
        ..Default::default()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while got.len() < 20 && tokio::time::Instant::now() < deadline {
        let page: SyncOk = http.rpc(&ben_phone.access_token, "sync", &req).await.unwrap();
        assert_eq!(page.sync_generation, first_page.sync_generation, "a clean resume keeps the generation");
        got.extend(page.events.iter().map(|e| (e.sync_seq, e.message.as_ref().unwrap().message_id.clone())));
        let _: serde_json::Value = http
            .rpc(
                &ben_phone.access_token,
                "ack",
                &serde_json::json!({"batch_token": page.batch_token, "sync_seq": page.batch_high_watermark}),
            )
            .await
            .unwrap();
        req.local_applied_sync_seq = got.last().map(|g| g.0);
    }
    let phone_ids: Vec<&String> = got.iter().map(|g| &g.1).collect();
    assert_eq!(phone_ids, accepted.iter().collect::<Vec<_>>());

    // A second restart re-runs the relay on an empty outbox: no duplicates.
    second.child.kill().unwrap();
    second.child.wait().unwrap();
    let mut third = start(dir.path(), &[]);
    let http = Http::new(&third.url);
    let ben_tablet = http.login("ben", "pw", "tablet").await.unwrap();
    let got = pull(&http, &ben_tablet.access_token, 21, Duration::from_secs(2), 7).await;
    assert_eq!(got.len(), 20, "restarts fan out nothing twice");
    third.child.kill().unwrap();
    third.child.wait().unwrap();
}
