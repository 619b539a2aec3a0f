//! Test harness: a real server on 127.0.0.1 over a real SQLite store in a
//! temporary directory, and SDK clients with their own local databases in
//! the same directory. No mocks: every byte crosses a socket.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tidemark_client::{
    Change, Changes, Client, ClientConfig, ConnState, FaultAction, FaultHook, FaultPoint, Http, Message,
};
use tidemark_server::{RunningServer, Server, ServerConfig};
use tidemark_sqlite::SqliteStore;

pub const ADMIN: &str = "test-admin-token";
pub const PASSWORD: &str = "correct horse";
/// Every wait in these tests gives up after this long.
pub const WAIT: Duration = Duration::from_secs(15);

pub struct Harness {
    pub server: Option<RunningServer>,
    pub url: String,
    pub http: Http,
    pub dir: tempfile::TempDir,
    addr: String,
}

impl Harness {
    pub async fn start() -> Harness {
        Harness::start_with(ServerConfig::default()).await
    }

    pub async fn start_with(config: ServerConfig) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let server = boot(&dir, "127.0.0.1:0", config).await;
        let url = server.url();
        let addr = server.addr.to_string();
        Harness { server: Some(server), http: Http::new(&url), url, dir, addr }
    }

    pub fn server(&self) -> &RunningServer {
        self.server.as_ref().expect("server running")
    }

    /// The sum of the series of `family` in the server's `/metrics` whose
    /// line contains `label` (`""`: every series, such as `kind="hole"`
    /// for one); 0 while absent.
    pub async fn metric(&self, family: &str, label: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.server().url())).await.unwrap().text().await.unwrap();
        text.lines()
            .filter(|l| l.starts_with(family) && l[family.len()..].starts_with(['{', ' ']) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.trim().parse::<f64>().ok())
            .sum()
    }

    /// Stops the server (its connections get `kicked shutdown`).
    pub async fn stop_server(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await;
        }
    }

    /// Starts the server again on the same address and data directory.
    pub async fn restart_server(&mut self, config: ServerConfig) {
        self.stop_server().await;
        self.server = Some(boot(&self.dir, &self.addr, config).await);
    }

    pub async fn user(&self, name: &str) {
        assert!(self.http.create_user(ADMIN, name, PASSWORD).await.unwrap().created);
    }

    /// A client config with fast backoff and a short periodic sync.
    pub fn config(&self, user: &str, device: &str) -> ClientConfig {
        let mut c = ClientConfig::new(&self.url, user, device, self.dir.path().join(format!("{user}-{device}.db")))
            .with_password(PASSWORD);
        c.backoff =
            tidemark_client::policy::Backoff { base: Duration::from_millis(20), cap: Duration::from_millis(300) };
        c.periodic_sync = Duration::from_secs(2);
        c.request_timeout = Duration::from_secs(10);
        c
    }

    /// Opens and starts a client, and waits until it is ready.
    pub async fn ready(&self, user: &str, device: &str) -> Client {
        let client = Client::open(self.config(user, device)).unwrap();
        client.start().await.unwrap();
        client.wait_state(ConnState::Ready, WAIT).await.unwrap();
        client
    }

    /// The device's cursor on the server: `(generation, acked_sync_seq)`.
    pub async fn server_ack(&self, user: &str, device: &str) -> (u64, u64) {
        let d = self.server().state.store.device(user, device).await.unwrap().expect("device exists");
        (d.cursor.generation, d.cursor.acked_sync_seq)
    }

    /// Waits until the user's log on the server reaches `head` (fan-out is
    /// asynchronous).
    pub async fn wait_log(&self, user: &str, head: u64) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.server().state.store.user_high_watermark(user).await.unwrap() < head {
            assert!(tokio::time::Instant::now() < deadline, "{user}'s log never reached {head}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn wait_server_ack(&self, user: &str, device: &str, acked: u64) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.server_ack(user, device).await.1 < acked {
            assert!(tokio::time::Instant::now() < deadline, "{user}/{device} never ACKed {acked}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

async fn boot(dir: &tempfile::TempDir, addr: &str, config: ServerConfig) -> RunningServer {
    let store = SqliteStore::open(&dir.path().join("server")).unwrap();
    let config = ServerConfig { admin_token: Some(ADMIN.into()), ..config };
    Server::start(addr, store, config).await.unwrap()
}

/// The contract code of a call's server refusal; panics on anything else.
pub fn refused(r: Result<impl std::fmt::Debug, tidemark_client::SdkError>) -> tidemark_client::proto::ErrorCode {
    match r {
        Err(tidemark_client::SdkError::Refused(e)) => e.code().unwrap_or_else(|| panic!("not a server refusal: {e}")),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A hook that aborts the client the first time `when` matches.
pub fn abort_once(when: impl Fn(&FaultPoint) -> bool + Send + Sync + 'static) -> FaultHook {
    let fired = AtomicBool::new(false);
    Arc::new(
        move |p: &FaultPoint| {
            if when(p) && !fired.swap(true, Ordering::SeqCst) {
                FaultAction::Abort
            } else {
                FaultAction::Continue
            }
        },
    )
}

/// Waits until `client` holds `n` messages in `conv`; returns them.
pub async fn wait_messages(client: &Client, conv: &str, n: usize) -> Vec<Message> {
    client
        .wait_for(WAIT, || async { Ok(client.messages(conv).await?.len() >= n) })
        .await
        .unwrap_or_else(|e| panic!("{}: {n} messages in {conv}: {e}", client.config().device_id));
    client.messages(conv).await.unwrap()
}

/// Sends and waits for `send.ok`; returns `(msg_seq, duplicate)`.
pub async fn send_ok(client: &Client, conv: &str, text: &str) -> (u64, bool) {
    let entry = client.send(conv, serde_json::json!({ "text": text })).await.unwrap();
    let id = entry.client_msg_id.clone();
    client
        .wait_for(WAIT, || async {
            Ok(client.outbox_entry(&id).await?.is_some_and(|e| e.state == tidemark_client::OutboxState::Accepted))
        })
        .await
        .unwrap();
    let e = client.outbox_entry(&id).await.unwrap().unwrap();
    (e.msg_seq.unwrap(), e.duplicate)
}

/// Changes up to and including the first that matches `until`.
pub async fn collect_until(changes: &mut Changes, until: impl Fn(&Change) -> bool) -> Vec<Change> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, changes.recv()).await {
            Ok(Some(c)) => {
                let done = until(&c);
                out.push(c);
                if done {
                    return out;
                }
            }
            other => panic!("the awaited change never came ({other:?}); got {out:?}"),
        }
    }
}

/// Every change received so far, without waiting.
pub fn drain(changes: &mut Changes) -> Vec<Change> {
    let mut out = Vec::new();
    while let Some(c) = changes.try_recv() {
        out.push(c);
    }
    out
}

/// `(msg_seq, message_id, sender, text)` of each message, for comparisons.
pub fn view(msgs: &[Message]) -> Vec<(u64, String, String, String)> {
    msgs.iter()
        .map(|m| {
            (m.msg_seq, m.message_id.clone(), m.sender.clone(), m.content["text"].as_str().unwrap_or("").to_owned())
        })
        .collect()
}
