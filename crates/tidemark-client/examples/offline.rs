//! Offline and resume: sends made with no connection wait in the durable
//! outbox and leave in order once connected; a device that was off, or
//! whose app was closed and opened again on the same database, resumes
//! from its own position and gets every message once.
//!
//! ```sh
//! TIDEMARK_ADMIN_TOKEN=change-me cargo run -p tidemark-client --example offline -- http://127.0.0.1:8080
//! ```

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tidemark_client::{Client, ClientConfig, ConnState, Http, OutboxState};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
const WAIT: Duration = Duration::from_secs(15);

fn config(url: &str, user: &str, dir: &Path) -> ClientConfig {
    ClientConfig::new(url, user, "phone", dir.join(format!("{user}.db"))).with_password("pw")
}

fn texts(messages: &[tidemark_client::Message]) -> Vec<String> {
    messages.iter().map(|m| m.content["text"].as_str().unwrap_or_default().to_owned()).collect()
}

pub async fn run(url: &str, admin_token: &str, dir: &Path) -> Result<(), Error> {
    let http = Http::new(url);
    http.create_user(admin_token, "alice", "pw").await?;
    http.create_user(admin_token, "bob", "pw").await?;
    let alice = Client::open(config(url, "alice", dir))?;
    alice.start().await?;
    alice.wait_state(ConnState::Ready, WAIT).await?;
    let conv = alice.create_direct("bob").await?;
    // Alice goes offline (as in a tunnel) and keeps typing.
    alice.stop().await;
    for text in ["one", "two", "three"] {
        alice.send(&conv, json!({ "text": text })).await?;
    }
    let queued = alice.outbox().await?;
    assert!(queued.iter().all(|e| e.state == OutboxState::Pending), "nothing leaves without a connection");
    // Queued sends are outbox entries, not yet messages of the
    // conversation: their `msg_seq` comes from the server.
    println!("alice: {} sends queued offline", queued.len());

    // Back online: the outbox drains in order, each send once.
    alice.start().await?;
    alice
        .wait_for(WAIT, || async { Ok(alice.outbox().await?.iter().all(|e| e.state == OutboxState::Accepted)) })
        .await?;

    // Bob's phone was never on: its first start catches up.
    let bob = Client::open(config(url, "bob", dir))?;
    bob.start().await?;
    bob.wait_for(WAIT, || async { Ok(bob.messages(&conv).await?.len() == 3) }).await?;
    assert_eq!(texts(&bob.messages(&conv).await?), ["one", "two", "three"]);

    // Bob closes the app; Alice writes on; Bob opens it again on the same
    // database and resumes from where his device stood.
    bob.stop().await;
    let before = bob.position().await?;
    drop(bob);
    alice.send(&conv, json!({ "text": "four" })).await?;
    let bob = Client::open(config(url, "bob", dir))?;
    bob.start().await?;
    bob.wait_for(WAIT, || async { Ok(bob.messages(&conv).await?.len() == 4) }).await?;
    let after = bob.position().await?;
    println!("bob resumed from sync_seq {} to {}", before.applied_sync_seq, after.applied_sync_seq);
    assert_eq!(texts(&bob.messages(&conv).await?), ["one", "two", "three", "four"]);
    assert!(after.applied_sync_seq > before.applied_sync_seq);

    alice.stop().await;
    bob.stop().await;
    Ok(())
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Error> {
    let url = std::env::args().nth(1).unwrap_or_else(|| "http://127.0.0.1:8080".into());
    let admin_token = std::env::var("TIDEMARK_ADMIN_TOKEN").map_err(|_| "set TIDEMARK_ADMIN_TOKEN")?;
    let dir = tempfile::tempdir()?;
    run(&url, &admin_token, dir.path()).await
}
