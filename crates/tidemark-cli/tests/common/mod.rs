//! Shared by the tests that drive the real `tidemark serve` binary: start a
//! server process and read its address, and pull a device's log over HTTP
//! the way a client does (whole batches, ACKed).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tidemark_client::proto::{SyncOk, SyncReq};
use tidemark_client::Http;

/// A server process; killed when dropped, so a failing test leaves none
/// behind (it would hold the test runner's output pipes open).
pub struct ServerProc {
    pub child: Child,
    pub url: String,
    pub ws: String,
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `tidemark serve --listen 127.0.0.1:0 ARGS…` with `admin` as its
/// admin token and waits for its listening line.
pub fn spawn_serve<S: AsRef<std::ffi::OsStr>>(args: &[S], admin: &str) -> ServerProc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .env("TIDEMARK_ADMIN_TOKEN", admin)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn tidemark serve");
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read the listening line");
    let addr = line
        .trim()
        .strip_prefix("tidemark listening on ")
        .unwrap_or_else(|| panic!("the server did not start (stdout {line:?}); see its stderr above"))
        .to_owned();
    ServerProc { child, url: format!("http://{addr}"), ws: format!("ws://{addr}/v1/ws") }
}

/// A message event as a device saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub sync_seq: u64,
    pub conv: String,
    pub msg_seq: u64,
    pub message_id: String,
}

/// Pulls whole batches (pages of `limit`) over HTTP, ACKing each batch,
/// until `count` message events arrived or `wait` passed. Checks that the
/// log only moves forward.
pub async fn pull(http: &Http, token: &str, count: usize, wait: Duration, limit: u32) -> Vec<Seen> {
    pull_from(http, token, &mut Position::default(), count, wait, limit).await
}

/// A device's local position: its generation and what it applied.
#[derive(Debug, Default, Clone, Copy)]
pub struct Position {
    pub generation: Option<u64>,
    pub applied: u64,
}

/// [`pull`] from a device's position, which it moves: a device that keeps
/// syncing where it left off.
pub async fn pull_from(
    http: &Http,
    token: &str,
    pos: &mut Position,
    count: usize,
    wait: Duration,
    limit: u32,
) -> Vec<Seen> {
    let mut seen: Vec<Seen> = Vec::new();
    let Position { mut generation, mut applied } = *pos;
    let deadline = tokio::time::Instant::now() + wait;
    while seen.len() < count && tokio::time::Instant::now() < deadline {
        let req = SyncReq {
            sync_generation: generation,
            local_applied_sync_seq: Some(applied),
            limit: Some(limit),
            ..Default::default()
        };
        let mut page: SyncOk = http.rpc(token, "sync", &req).await.unwrap();
        generation = Some(page.sync_generation);
        let batch = page.batch_token.clone();
        loop {
            for e in &page.events {
                assert!(e.sync_seq > applied, "sync_seq goes forward: {} after {applied}", e.sync_seq);
                applied = e.sync_seq;
                if let (Some(m), "message") = (&e.message, e.kind.as_str()) {
                    let msg_seq = e.msg_seq.unwrap_or(m.msg_seq);
                    let message_id = m.message_id.clone();
                    seen.push(Seen { sync_seq: e.sync_seq, conv: e.conv.clone(), msg_seq, message_id });
                }
            }
            if !page.has_more {
                break;
            }
            let next = SyncReq {
                batch_token: Some(batch.clone()),
                cursor: page.next_cursor.clone(),
                limit: Some(limit),
                ..Default::default()
            };
            page = http.rpc(token, "sync", &next).await.unwrap();
        }
        if page.batch_high_watermark > 0 {
            let _: serde_json::Value = http
                .rpc(token, "ack", &serde_json::json!({"batch_token": batch, "sync_seq": page.batch_high_watermark}))
                .await
                .unwrap();
        }
        *pos = Position { generation, applied };
        if seen.len() < count {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    seen
}
