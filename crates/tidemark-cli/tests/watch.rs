//! `examples/watch.py` meets the refusals a device can get on its first
//! page, against a real `tidemark serve`: a restored state file a little
//! behind its ACK gets a recovery session under a new generation; a device
//! with no state on a log that retention trimmed is refused a full replay
//! and installs a snapshot. (README's walkthrough, tests/readme.rs, covers
//! the plain rebuild after RESET_REQUIRED.)

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tidemark_client::Http;

const ADMIN: &str = "watch-admin";
const PASSWORD: &str = "pw";
/// Bound on every wait.
const WAIT: Duration = Duration::from_secs(30);

/// watch.py as a child, killed when dropped.
struct Watch {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Watch {
    fn start(ws: &str, token: &str, cwd: &Path) -> Watch {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/watch.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(ws)
            .env("BOB", token)
            .current_dir(cwd)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run python3 examples/watch.py");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Watch { child, lines, seen: Vec::new() }
    }

    /// Reads lines until one contains `needle`; returns it.
    fn expect(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(e) => panic!("watch.py printed no {needle:?} ({e}); it printed {:#?}", self.seen),
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn send(http: &Http, token: &str, conv: &str, id: &str, text: &str) {
    let req = json!({"conv": conv, "client_msg_id": id, "kind": "text", "content": {"text": text}});
    let _: serde_json::Value = http.rpc(token, "send", &req).await.unwrap();
}

/// Alice and Bob, their direct conversation and `texts` sent by Alice.
async fn conversation(http: &Http, texts: &[&str]) -> (String, String) {
    for u in ["alice", "bob"] {
        http.create_user(ADMIN, u, PASSWORD).await.unwrap();
    }
    let alice = http.login("alice", PASSWORD, "alice-phone").await.unwrap().access_token;
    let conv: serde_json::Value =
        http.rpc(&alice, "conv.create", &json!({"kind": "direct", "members": ["bob"]})).await.unwrap();
    let conv = conv["conv"].as_str().unwrap().to_owned();
    for (i, text) in texts.iter().enumerate() {
        send(http, &alice, &conv, &format!("a-{i}"), text).await;
    }
    (alice, conv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_behind_its_ack_gets_a_recovery_session() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = common::spawn_serve(&[std::ffi::OsStr::new("--data"), data.as_os_str()], ADMIN);
    let http = Http::new(&server.url);
    conversation(&http, &["one", "two"]).await;
    let bob = http.login("bob", PASSWORD, "bob-desktop").await.unwrap().access_token;
    // The device synced and ACKed both messages; then its local state is
    // restored from a backup taken after the first.
    let seen = common::pull(&http, &bob, 2, WAIT, 50).await;
    assert_eq!(seen.len(), 2);
    std::fs::write(dir.path().join("watch-bob-bob-desktop.json"), r#"{"generation": 1, "applied": 1}"#).unwrap();

    let mut watch = Watch::start(&server.ws, &bob, dir.path());
    watch.expect("local state watch-bob-bob-desktop.json: generation 1, applied 1");
    watch.expect("recovery: generation 2, replaying (1, 2] (server ACK 2)");
    let line = watch.expect("sync_seq 2:");
    assert!(line.ends_with("#2: {'text': 'two'}"), "{line}");
    watch.expect("acked 2 (generation 2)");
    assert!(
        !watch.seen.iter().any(|l| l.contains("sync_seq 1:")),
        "only the frozen range is replayed: {:#?}",
        watch.seen
    );
    drop(watch);

    // The state file moved with it: the next run resumes without a reset.
    let mut watch = Watch::start(&server.ws, &bob, dir.path());
    watch.expect("local state watch-bob-bob-desktop.json: generation 2, applied 2");
    watch.expect("acked 2 (generation 2)");
    assert!(!watch.seen.iter().any(|l| l.contains("RESET") || l.contains("recovery")), "{:#?}", watch.seen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_device_on_a_trimmed_log_installs_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // Retention trims at once whatever every active device ACKed: no entry
    // is kept for its age.
    let args: Vec<&std::ffi::OsStr> = vec![
        "--data".as_ref(),
        data.as_os_str(),
        "--log-keep-secs".as_ref(),
        "0".as_ref(),
        "--retention-every-ms".as_ref(),
        "10".as_ref(),
    ];
    let server = common::spawn_serve(&args, ADMIN);
    let http = Http::new(&server.url);
    conversation(&http, &["before the trim", "also trimmed"]).await;
    // Bob's laptop syncs and ACKs both: the log behind its ACK can go.
    let laptop = http.login("bob", PASSWORD, "bob-laptop").await.unwrap().access_token;
    assert_eq!(common::pull(&http, &laptop, 2, WAIT, 50).await.len(), 2);
    // Wait until Bob's log is trimmed: a new device's first page is then
    // refused (each probe is a new device, so none holds anything).
    let deadline = Instant::now() + WAIT;
    for n in 0.. {
        let probe = http.login("bob", PASSWORD, &format!("probe-{n}")).await.unwrap().access_token;
        let reply: Result<serde_json::Value, _> = http.rpc(&probe, "sync", &json!({"limit": 1})).await;
        match reply {
            Err(e) if e.code() == Some(tidemark_client::proto::ErrorCode::ResetRequired) => break,
            _ => assert!(Instant::now() < deadline, "bob's log was not trimmed within {WAIT:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let bob = http.login("bob", PASSWORD, "bob-desktop").await.unwrap().access_token;
    let mut watch = Watch::start(&server.ws, &bob, dir.path());
    watch.expect("RESET_REQUIRED: rebuilding under generation 2");
    let line = watch.expect("snapshot: base sync_seq ");
    assert!(line.ends_with("3 item(s)"), "one conversation item and two messages: {line}");
    watch.expect("alice: {'text': 'before the trim'}");
    watch.expect("alice: {'text': 'also trimmed'}");
    watch.expect("snapshot acked at 2 (generation 2)");
    assert_eq!(
        watch.seen.iter().filter(|l| l.starts_with("RESET_REQUIRED")).count(),
        1,
        "one reset, not a loop: {:#?}",
        watch.seen
    );
}
