//! O2 against the real `tidemark serve --log-format json`: every line of
//! its log is one JSON object; a message sent with a known text by a
//! device holding a known token is followed through every stage of its
//! trace (accept, fan-out, hint, page, ACK), joined by its message id,
//! the recipient's hashed user id, its `sync_seq` and the batch's trace
//! id; and nowhere in the log is the message's text, a token, the password
//! or a user or device name in the clear.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_client::proto::{SendReq, SyncReq};
use tidemark_client::{Http, ServerEvent, WsConn};

const ADMIN: &str = "json-logs-admin-token-5d1f";
const PASSWORD: &str = "a password nobody logs 81c2";
/// Names that cannot occur in a log by chance.
const ANN: &str = "annika-q7w3";
const BEN: &str = "bertil-z4k8";
const PHONE: &str = "phone-m2x9";
const TEXT: &str = "the body text that never reaches a log 3b9e";

struct Serve {
    child: Child,
    url: String,
    ws: String,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json", "--data"])
        .arg(dir.path().join("data"))
        .env("TIDEMARK_ADMIN_TOKEN", ADMIN)
        .env("RUST_LOG", "info,tidemark::trace=debug")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn tidemark serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("tidemark listening on ").expect("the server started").to_owned();
    Serve { child, url: format!("http://{addr}"), ws: format!("ws://{addr}/v1/ws"), log, _dir: dir }
}

/// Every line of the log so far, each parsed as JSON (a line that is not
/// JSON fails the test).
fn lines(serve: &Serve) -> (String, Vec<Value>) {
    let text = std::fs::read_to_string(&serve.log).unwrap();
    let parsed = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    (text, parsed)
}

fn field<'a>(line: &'a Value, name: &str) -> &'a Value {
    &line[name]
}

fn is(line: &Value, name: &str, value: &str) -> bool {
    field(line, name).as_str() == Some(value)
}

fn num(line: &Value, name: &str) -> u64 {
    field(line, name).as_u64().unwrap_or_else(|| panic!("{name} is not a number in {line}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_trace_a_message_through_every_stage_and_hold_no_secret() {
    let s = serve();
    let http = Http::new(&s.url);
    for user in [ANN, BEN] {
        assert!(http.create_user(ADMIN, user, PASSWORD).await.unwrap().created);
    }
    let ann = http.login(ANN, PASSWORD, PHONE).await.unwrap();
    let ben = http.login(BEN, PASSWORD, PHONE).await.unwrap();
    let (ann_ws, _ann_events) = WsConn::connect(&s.ws, &ann.access_token).await.unwrap();
    let (ben_ws, mut ben_events) = WsConn::connect(&s.ws, &ben.access_token).await.unwrap();
    // A round trip: ben's connection is registered, so the fan-out hints it.
    ben_ws.request_value("ping", json!({})).await.unwrap();
    let conv = ann_ws.conv_create_direct(BEN).await.unwrap().conv;
    let req = SendReq {
        conv: conv.clone(),
        client_msg_id: "c1".into(),
        kind: "text".into(),
        content: json!({"text": TEXT}),
        mentions: Vec::new(),
        mention_all: false,
    };
    let sent = ann_ws.send(&req).await.unwrap();

    // ben is hinted, pulls the batch and ACKs it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match tokio::time::timeout_at(deadline, ben_events.recv()).await {
            Ok(Some(ServerEvent::Hint { .. })) => break,
            Ok(Some(_)) => continue,
            other => panic!("no hint for ben: {other:?}"),
        }
    }
    let page = ben_ws
        .sync(&SyncReq {
            sync_generation: None,
            local_applied_sync_seq: Some(0),
            limit: Some(10),
            ..Default::default()
        })
        .await
        .unwrap();
    let event =
        page.events.iter().find(|e| e.message.as_ref().map(|m| m.message_id.as_str()) == Some(&sent.message_id));
    let sync_seq = event.expect("the message is in ben's page").sync_seq;
    ben_ws.ack(&page.batch_token, page.batch_high_watermark).await.unwrap();

    // The ACK is the last stage; wait (bounded) until its line is written.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let (text, log) = loop {
        let (text, log) = lines(&s);
        if log.iter().any(|l| is(l, "stage", "device_sync") && is(l, "result", "advanced")) {
            break (text, log);
        }
        assert!(tokio::time::Instant::now() < deadline, "no ACK line in the log:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    // Nothing secret, no name in the clear.
    let secrets = [
        TEXT,
        PASSWORD,
        ADMIN,
        &ann.access_token,
        &ann.refresh_token,
        &ben.access_token,
        &ben.refresh_token,
        &page.batch_token,
        ANN,
        BEN,
        PHONE,
    ];
    for secret in secrets {
        assert!(!text.contains(secret), "the log holds {secret:?}:\n{text}");
    }

    // The trace. Accept: the message's trace id is its id.
    let mid = sent.message_id.as_str();
    let accept = log
        .iter()
        .find(|l| is(l, "stage", "accept") && is(l, "trace_id", mid))
        .unwrap_or_else(|| panic!("no accept line for {mid}:\n{text}"));
    assert_eq!((field(accept, "conv").as_str(), num(accept, "msg_seq")), (Some(conv.as_str()), sent.msg_seq));
    assert!(is(accept, "result", "accepted"));
    // Fan-out: the item, then one user event per member.
    let item = log
        .iter()
        .find(|l| is(l, "stage", "fanout") && is(l, "trace_id", mid) && is(l, "result", "fanned_out"))
        .unwrap_or_else(|| panic!("no fan-out line for {mid}:\n{text}"));
    assert_eq!((num(item, "recipients"), num(item, "events")), (2, 2));
    assert!(is(item, "conv_kind", "direct"));
    // Page: ben's device read a page holding the message's sync_seq; its
    // user hash names ben's user event of this message.
    let served = log
        .iter()
        .find(|l| is(l, "stage", "sync_log") && is(l, "result", "served"))
        .unwrap_or_else(|| panic!("no page line:\n{text}"));
    assert!(num(served, "first_sync_seq") <= sync_seq && sync_seq <= num(served, "sync_seq"));
    let ben_hash = field(served, "user_hash").as_str().unwrap().to_owned();
    let device_hash = field(served, "device_hash").as_str().unwrap().to_owned();
    assert_eq!(ben_hash.len(), 16, "a 64-bit keyed hash in hex: {ben_hash}");
    assert!(ben_hash.chars().all(|c| c.is_ascii_hexdigit()));
    let delivered = log
        .iter()
        .find(|l| is(l, "stage", "fanout") && is(l, "trace_id", mid) && is(l, "user_hash", &ben_hash))
        .unwrap_or_else(|| panic!("no user event of {mid} for ben's hash {ben_hash}:\n{text}"));
    assert_eq!(num(delivered, "sync_seq"), sync_seq);
    let ann_hash = field(accept, "user_hash").as_str().unwrap();
    assert_ne!(ann_hash, ben_hash, "one hash per user");
    // Hint: queued for ben's user, sent to ben's device, at the watermark.
    assert!(log
        .iter()
        .any(|l| is(l, "stage", "push") && is(l, "user_hash", &ben_hash) && num(l, "sync_seq") >= sync_seq));
    assert!(log
        .iter()
        .any(|l| is(l, "stage", "push") && is(l, "device_hash", &device_hash) && num(l, "sync_seq") >= sync_seq));
    // ACK: the same batch (trace id), the same device, past the message.
    let ack = log.iter().find(|l| is(l, "stage", "device_sync") && is(l, "result", "advanced")).expect("the ACK line");
    assert_eq!(field(ack, "trace_id"), field(served, "trace_id"), "a batch's pages and ACK share a trace id");
    assert!(is(ack, "device_hash", &device_hash));
    assert!(num(ack, "acked_sync_seq") >= sync_seq);
    assert_eq!(num(ack, "generation"), num(served, "generation"));
}
