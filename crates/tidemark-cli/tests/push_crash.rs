//! P4 fault drill with the real binary: `tidemark serve` is SIGKILLed while
//! pushes are owed (committed messages inside the coalescing window); after
//! a restart on the same data they are pushed, once, and what was pushed
//! before the kill is not pushed again. The provider is the signed webhook,
//! its receiver a real HTTP server on 127.0.0.1 in this test.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use tidemark_client::proto::{SendOk, SendReq};
use tidemark_client::Http;
use tidemark_proto::push::PushPayload;
use tidemark_push::webhook::{verify_signature, SIGNATURE_HEADER};

mod common;

use common::{spawn_serve, ServerProc};

const ADMIN: &str = "push-crash-admin";
const SECRET: &str = "push-crash-webhook-secret";
/// Long enough that messages sent just before the kill are still inside
/// their window when it lands, on a loaded machine too.
const WINDOW_MS: u64 = 5_000;
const WAIT: Duration = Duration::from_secs(40);

type Pushed = Arc<Mutex<Vec<PushPayload>>>;

async fn receive(State(pushed): State<Pushed>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let signature = headers.get(SIGNATURE_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    if verify_signature(SECRET.as_bytes(), signature, &body, now).is_err() {
        return StatusCode::UNAUTHORIZED;
    }
    pushed.lock().unwrap().push(serde_json::from_slice(&body).expect("a PushPayload"));
    StatusCode::OK
}

async fn wait_for(pushed: &Pushed, n: usize) -> Vec<PushPayload> {
    let start = Instant::now();
    loop {
        let got = pushed.lock().unwrap().clone();
        if got.len() >= n {
            return got;
        }
        assert!(start.elapsed() < WAIT, "{} of {n} pushes: {got:?}", got.len());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The phone's push position, read through a read-only connection to the
/// server's database (WAL: it never blocks the server).
fn pushed_through(data: &std::path::Path) -> i64 {
    let flags = rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let c = rusqlite::Connection::open_with_flags(data.join("tidemark.db"), flags).unwrap();
    c.query_row("SELECT pushed_through FROM push_targets WHERE user_id = 'bob' AND device_id = 'phone'", [], |r| {
        r.get(0)
    })
    .unwrap()
}

fn start(data: &std::path::Path, hook: &str, files: &tempfile::TempDir) -> ServerProc {
    let secret = files.path().join("webhook-secret");
    let key = files.path().join("token-key");
    let window = WINDOW_MS.to_string();
    let args: Vec<std::ffi::OsString> = vec![
        "--data".into(),
        data.into(),
        "--push-webhook-url".into(),
        hook.into(),
        "--push-webhook-secret-file".into(),
        secret.into(),
        "--push-token-key-file".into(),
        key.into(),
        "--push-window-ms".into(),
        window.into(),
        "--push-poll-ms".into(),
        "50".into(),
        "--push-lease-ms".into(),
        "2000".into(),
    ];
    spawn_serve(&args, ADMIN)
}

async fn send(http: &Http, token: &str, conv: &str, cmid: &str) {
    let req = SendReq {
        conv: conv.into(),
        client_msg_id: cmid.into(),
        kind: "text".into(),
        content: serde_json::json!({"text": cmid}),
        mentions: Vec::new(),
        mention_all: false,
    };
    let _: SendOk = http.rpc(token, "send", &req).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_pushes_owed_pushes_them_once_after_restart() {
    let pushed: Pushed = Arc::default();
    let app = axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(pushed.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let files = tempfile::tempdir().unwrap();
    std::fs::write(files.path().join("webhook-secret"), format!("{SECRET}\n")).unwrap();
    std::fs::write(files.path().join("token-key"), "ab".repeat(32)).unwrap();
    let data = tempfile::tempdir().unwrap();

    let mut first = start(data.path(), &hook, &files);
    let http = Http::new(&first.url);
    for u in ["ann", "bob"] {
        http.create_user(ADMIN, u, "pw").await.unwrap();
    }
    let ann = http.login("ann", "pw", "laptop").await.unwrap().access_token;
    let phone = http.login("bob", "pw", "phone").await.unwrap().access_token;
    let _: serde_json::Value = http
        .rpc(&phone, "push.register", &serde_json::json!({"platform": "webhook", "token": "tok-phone"}))
        .await
        .unwrap();
    let conv: serde_json::Value =
        http.rpc(&ann, "conv.create", &serde_json::json!({"kind": "direct", "members": ["bob"]})).await.unwrap();
    let conv = conv["conv"].as_str().unwrap().to_owned();

    // One push goes out and is recorded before the kill.
    send(&http, &ann, &conv, "m1").await;
    let before = wait_for(&pushed, 1).await;
    assert_eq!(before[0].count, 1);
    let start_wait = Instant::now();
    while pushed_through(data.path()) < 1 {
        assert!(start_wait.elapsed() < WAIT, "the accepted push was never recorded");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // Two more are committed and owed (inside their window) when the
    // server is SIGKILLed: no graceful shutdown.
    send(&http, &ann, &conv, "m2").await;
    send(&http, &ann, &conv, "m3").await;
    first.child.kill().expect("SIGKILL");
    first.child.wait().unwrap();
    assert_eq!(pushed.lock().unwrap().len(), 1, "the owed pushes were still inside their window at the kill");

    let mut second = start(data.path(), &hook, &files);
    let http = Http::new(&second.url);
    let after = wait_for(&pushed, 2).await;
    assert_eq!(after[1].count, 2, "m2 and m3, not lost, m1 not repeated: {after:?}");
    // Barrier: one more message is pushed alone, so nothing of the earlier
    // ranges was pushed twice before it.
    let ann = http.login("ann", "pw", "laptop").await.unwrap().access_token;
    send(&http, &ann, &conv, "m4").await;
    let all = wait_for(&pushed, 3).await;
    let counts: Vec<u32> = all.iter().map(|p| p.count).collect();
    assert_eq!(counts, vec![1, 2, 1], "{all:?}");
    let mut ids: Vec<&str> = all.iter().map(|p| p.notification_id.as_str()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 3);
    second.child.kill().unwrap();
    second.child.wait().unwrap();
}
