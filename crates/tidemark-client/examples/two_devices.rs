//! Two devices of one user: Bob's phone and laptop hold the same
//! conversation, each with its own cursor and ACK; what one sends or reads
//! shows on the other.
//!
//! ```sh
//! TIDEMARK_ADMIN_TOKEN=change-me cargo run -p tidemark-client --example two_devices -- http://127.0.0.1:8080
//! ```

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tidemark_client::{Client, ClientConfig, ConnState, Http};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
const WAIT: Duration = Duration::from_secs(15);

async fn device(url: &str, user: &str, device: &str, dir: &Path) -> Result<Client, Error> {
    let config = ClientConfig::new(url, user, device, dir.join(format!("{user}-{device}.db"))).with_password("pw");
    let client = Client::open(config)?;
    client.start().await?;
    client.wait_state(ConnState::Ready, WAIT).await?;
    Ok(client)
}

pub async fn run(url: &str, admin_token: &str, dir: &Path) -> Result<(), Error> {
    let http = Http::new(url);
    http.create_user(admin_token, "alice", "pw").await?;
    http.create_user(admin_token, "bob", "pw").await?;
    let alice = device(url, "alice", "phone", dir).await?;
    let phone = device(url, "bob", "phone", dir).await?;
    let laptop = device(url, "bob", "laptop", dir).await?;

    let conv = alice.create_direct("bob").await?;
    alice.send(&conv, json!({ "text": "dinner at 8?" })).await?;
    // Every device of the recipient gets every message, from its own
    // cursor in the user's sync log.
    for bob in [&phone, &laptop] {
        bob.wait_for(WAIT, || async { Ok(bob.messages(&conv).await?.len() == 1) }).await?;
        assert_eq!(bob.conversation(&conv).await?.expect("held").unread, 1);
    }

    // Read on the phone: the laptop learns it from the user's log.
    phone.mark_read(&conv, 1).await?;
    laptop.wait_for(WAIT, || async { Ok(laptop.conversation(&conv).await?.is_some_and(|c| c.unread == 0)) }).await?;

    // Sent from the laptop: the phone holds it too, as Bob's own.
    laptop.send(&conv, json!({ "text": "yes!" })).await?;
    phone.wait_for(WAIT, || async { Ok(phone.messages(&conv).await?.len() == 2) }).await?;
    let on_phone = phone.messages(&conv).await?;
    assert_eq!((on_phone[1].sender.as_str(), &on_phone[1].content["text"]), ("bob", &json!("yes!")));

    // Same conversation, separate positions: each device ACKs for itself.
    for (name, bob) in [("phone", &phone), ("laptop", &laptop)] {
        let at = bob.position().await?;
        println!("bob's {name}: applied {} acked {}", at.applied_sync_seq, at.acked_sync_seq);
    }
    for c in [&alice, &phone, &laptop] {
        c.stop().await;
    }
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
