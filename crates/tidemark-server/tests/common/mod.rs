//! Test harness: a real server on 127.0.0.1:0 over a real SQLite store in a
//! temporary directory, and real clients over HTTP and WebSocket.
#![allow(dead_code)]

pub mod exposition;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_client::proto::{ErrorCode, SendReq, SyncOk, SyncReq, UserEvent};
use tidemark_client::{ClientError, Http, ServerEvent, WsConn};
use tidemark_server::{RunningServer, Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tokio::sync::mpsc;

pub const ADMIN: &str = "test-admin-token";
pub const PASSWORD: &str = "correct horse";

pub struct TestServer {
    pub server: Option<RunningServer>,
    pub http: Http,
    pub dir: tempfile::TempDir,
}

impl TestServer {
    pub async fn start() -> TestServer {
        TestServer::start_with(ServerConfig::default()).await
    }

    pub async fn start_with(config: ServerConfig) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let config = ServerConfig { admin_token: Some(ADMIN.into()), ..config };
        let server = Server::start("127.0.0.1:0", store, config).await.unwrap();
        let http = Http::new(&server.url());
        TestServer { server: Some(server), http, dir }
    }

    pub fn running(&self) -> &RunningServer {
        self.server.as_ref().unwrap()
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/v1/ws", self.running().addr)
    }

    pub async fn user(&self, name: &str) {
        assert!(self.http.create_user(ADMIN, name, PASSWORD).await.unwrap().created);
    }

    /// Logs `user` in on `device` and opens its WebSocket.
    pub async fn device(&self, user: &str, device: &str) -> Device {
        let login = self.http.login(user, PASSWORD, device).await.unwrap();
        let (ws, events) = WsConn::connect(&self.ws_url(), &login.access_token).await.unwrap();
        // A round trip proves the server registered the connection (and so
        // will hint it) before the test goes on.
        ws.request_value("ping", json!({})).await.unwrap();
        Device {
            user: user.into(),
            device: device.into(),
            token: login.access_token,
            refresh: login.refresh_token,
            ws,
            events,
            generation: None,
            applied: 0,
            log: Vec::new(),
            snapshot: Vec::new(),
        }
    }

    /// Users `ann` and `ben`, a device each (`phone`), and their direct
    /// conversation.
    pub async fn ann_and_ben(&self) -> (Device, Device, String) {
        self.user("ann").await;
        self.user("ben").await;
        let ann = self.device("ann", "phone").await;
        let ben = self.device("ben", "phone").await;
        let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
        (ann, ben, conv)
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await;
        }
    }
}

/// A device with a tiny in-memory "local store": the events it applied.
pub struct Device {
    pub user: String,
    pub device: String,
    pub token: String,
    pub refresh: String,
    pub ws: WsConn,
    pub events: mpsc::Receiver<ServerEvent>,
    pub generation: Option<u64>,
    pub applied: u64,
    pub log: Vec<UserEvent>,
    /// Messages installed from a snapshot (D7), before `log`.
    pub snapshot: Vec<tidemark_client::proto::Envelope>,
}

impl Device {
    pub async fn send(&self, conv: &str, cmid: &str) -> tidemark_client::proto::SendOk {
        self.ws.send(&send_req(conv, cmid)).await.unwrap()
    }

    /// A first page from the device's local position; remembers the
    /// generation the server answered with, as a client store would.
    pub async fn sync_page(&mut self, limit: u32) -> Result<SyncOk, ClientError> {
        let req = SyncReq {
            sync_generation: self.generation,
            local_applied_sync_seq: Some(self.applied),
            limit: Some(limit),
            ..Default::default()
        };
        let page = self.ws.sync(&req).await?;
        self.generation = Some(page.sync_generation);
        Ok(page)
    }

    /// Fetches every page of a fresh snapshot, checks the digest and
    /// installs it (replacing the local state), then ACKs it. Returns the
    /// snapshot's base. `tamper` corrupts one item after download, as a
    /// broken transfer would, and the install is refused before any ACK.
    pub async fn install_snapshot(&mut self, tamper: bool) -> Result<u64, String> {
        let begin: tidemark_client::proto::SnapshotBeginOk =
            self.ws.request("snapshot.begin", &json!({})).await.map_err(|e| e.to_string())?;
        let mut items = Vec::new();
        for page in 0..begin.pages {
            let p: tidemark_client::proto::SnapshotPageOk = self
                .ws
                .request("snapshot.page", &json!({"snapshot_token": begin.snapshot_token, "page": page}))
                .await
                .map_err(|e| e.to_string())?;
            items.extend(p.items);
        }
        if tamper {
            if let Some(Value::Object(first)) = items.first_mut() {
                first.insert("unread".into(), json!(999));
            }
        }
        if tidemark_server::ops::snapshot::manifest_digest(&items) != begin.manifest_digest {
            return Err("manifest digest mismatch".into());
        }
        // "One local transaction": replace everything at once.
        self.log.clear();
        self.snapshot = items
            .iter()
            .filter(|i| i["type"] == "message")
            .map(|i| serde_json::from_value(i["message"].clone()).unwrap())
            .collect();
        self.applied = begin.base_sync_seq;
        self.generation = Some(begin.sync_generation);
        let ack: Value = self
            .ws
            .request("snapshot.ack", &json!({"snapshot_token": begin.snapshot_token}))
            .await
            .map_err(|e| e.to_string())?;
        assert_eq!(ack["acked_sync_seq"], begin.base_sync_seq);
        Ok(begin.base_sync_seq)
    }

    /// The device's view of a conversation: snapshot then log messages,
    /// by msg_seq, each once (message_id, text).
    pub fn view(&self, conv: &str) -> std::collections::BTreeMap<u64, String> {
        let mut v = std::collections::BTreeMap::new();
        let from_log = self.log.iter().filter_map(|e| e.message.as_ref());
        for m in self.snapshot.iter().chain(from_log).filter(|m| m.conv == conv) {
            v.insert(m.msg_seq, m.message_id.clone());
        }
        v
    }

    /// Drops every server event received so far.
    pub fn drain_events(&mut self) {
        while self.events.try_recv().is_ok() {}
    }

    /// Runs one whole batch: pages until `has_more` is false, checks every
    /// page stays under the batch watermark, applies, then ACKs the end.
    /// Returns the batch's watermark.
    pub async fn sync_batch(&mut self, limit: u32) -> u64 {
        let first = self.sync_page(limit).await.unwrap();
        let token = first.batch_token.clone();
        let hw = first.batch_high_watermark;
        self.generation = Some(first.sync_generation);
        let mut page = first;
        loop {
            assert_eq!(page.batch_high_watermark, hw, "the watermark is fixed for the batch");
            for e in &page.events {
                assert!(e.sync_seq <= hw, "event {} above the batch watermark {hw}", e.sync_seq);
                self.apply(e.clone());
            }
            if !page.has_more {
                break;
            }
            let req = SyncReq {
                batch_token: Some(token.clone()),
                cursor: page.next_cursor.clone(),
                limit: Some(limit),
                ..Default::default()
            };
            page = self.ws.sync(&req).await.unwrap();
        }
        if hw > 0 {
            let ack = self.ws.ack(&token, hw).await.unwrap();
            assert!(ack.acked_sync_seq >= hw);
        }
        hw
    }

    /// Applies one event the way a client store would: idempotent by
    /// sync_seq, and never past a gap.
    pub fn apply(&mut self, e: UserEvent) {
        if e.sync_seq <= self.applied {
            return;
        }
        assert_eq!(e.sync_seq, self.applied + 1, "{}/{}: hole in the user log", self.user, self.device);
        self.applied = e.sync_seq;
        self.log.push(e);
    }

    /// Syncs until the local log holds `count` events (fan-out is async).
    pub async fn sync_until(&mut self, count: usize, limit: u32) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while self.log.len() < count {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{}/{}: only {} of {count}",
                self.user,
                self.device,
                self.log.len()
            );
            let before = self.log.len();
            self.sync_batch(limit).await;
            if self.log.len() == before {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// The messages of one conversation in local order: (msg_seq, client id).
    pub fn conv_messages(&self, conv: &str) -> Vec<(u64, String)> {
        self.log
            .iter()
            .filter(|e| e.conv == conv)
            .map(|e| {
                let m = e.message.as_ref().expect("message events carry the envelope");
                (m.msg_seq, m.content["cmid"].as_str().unwrap_or("").to_owned())
            })
            .collect()
    }

    /// The next hint within `within`; `None` on timeout, kick or close.
    /// Ephemeral frames (typing, presence) in between are skipped.
    pub async fn next_hint(&mut self, within: Duration) -> Option<u64> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(ServerEvent::Hint { high_watermark, .. })) => return Some(high_watermark),
                Ok(Some(ServerEvent::Typing(_) | ServerEvent::Presence(_))) => continue,
                _ => return None,
            }
        }
    }
}

pub fn send_req(conv: &str, cmid: &str) -> SendReq {
    SendReq {
        conv: conv.into(),
        client_msg_id: cmid.into(),
        kind: "text".into(),
        content: json!({"cmid": cmid}),
        mentions: Vec::new(),
        mention_all: false,
    }
}

pub fn code(r: Result<impl std::fmt::Debug, ClientError>) -> ErrorCode {
    match r {
        Err(e) => e.code().unwrap_or_else(|| panic!("expected a server refusal, got {e:?}")),
        Ok(v) => panic!("expected a refusal, got {v:?}"),
    }
}

/// Counts per key, for exactly-once checks.
pub fn counts<K: std::hash::Hash + Eq>(items: impl IntoIterator<Item = K>) -> HashMap<K, usize> {
    let mut m = HashMap::new();
    for k in items {
        *m.entry(k).or_insert(0) += 1;
    }
    m
}

pub fn shared<T>(v: T) -> Arc<tokio::sync::Mutex<T>> {
    Arc::new(tokio::sync::Mutex::new(v))
}

pub fn body(v: Value) -> Value {
    v
}

/// Polls `ready` every 10 ms until it holds, failing after `within`.
pub async fn eventually<F, Fut>(what: &str, within: Duration, ready: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !ready().await {
        assert!(tokio::time::Instant::now() < deadline, "never held within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
