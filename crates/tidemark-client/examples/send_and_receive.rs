//! Send and receive: Alice's phone writes to Bob's laptop, Bob answers.
//!
//! Against a running server that has an admin token (accounts are made by
//! an operator; there is no self sign-up):
//!
//! ```sh
//! TIDEMARK_ADMIN_TOKEN=change-me cargo run -p tidemark-client --example send_and_receive -- http://127.0.0.1:8080
//! ```

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tidemark_client::{Change, Client, ClientConfig, ConnState, Http, OutboxState};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
const WAIT: Duration = Duration::from_secs(15);

pub async fn run(url: &str, admin_token: &str, dir: &Path) -> Result<(), Error> {
    let http = Http::new(url);
    http.create_user(admin_token, "alice", "pw-alice").await?;
    http.create_user(admin_token, "bob", "pw-bob").await?;

    // One `Client` per device, each with its own local database. Opening
    // needs no network; `start` runs the connection until `stop`.
    let alice = Client::open(
        ClientConfig::new(url, "alice", "alice-phone", dir.join("alice-phone.db")).with_password("pw-alice"),
    )?;
    let bob =
        Client::open(ClientConfig::new(url, "bob", "bob-laptop", dir.join("bob-laptop.db")).with_password("pw-bob"))?;
    let mut bob_changes = bob.subscribe();
    alice.start().await?;
    bob.start().await?;
    alice.wait_state(ConnState::Ready, WAIT).await?;

    let conv = alice.create_direct("bob").await?;
    // Durable in Alice's outbox when `send` returns; sent in order.
    let sent = alice.send(&conv, json!({ "text": "hello bob" })).await?;

    // Bob's device syncs on the server's hint, commits the page locally,
    // then ACKs. The change stream says what moved (a hint for the view);
    // the local store is the truth, so a `Lagged` subscriber re-reads it.
    loop {
        match tokio::time::timeout(WAIT, bob_changes.recv()).await? {
            Some(Change::CursorMoved(moved)) if moved.conv == conv => break,
            Some(Change::Lagged { .. }) => break,
            Some(_) => {}
            None => return Err("bob's client stopped".into()),
        }
    }
    let inbox = bob.messages(&conv).await?;
    println!("bob got: {} from {}", inbox[0].content["text"], inbox[0].sender);
    assert_eq!((inbox[0].sender.as_str(), &inbox[0].content["text"]), ("alice", &json!("hello bob")));
    assert_eq!(bob.conversations().await?[0].unread, 1);

    // Alice's outbox entry carries the server's answer.
    let accepted = alice.outbox_entry(&sent.client_msg_id).await?.expect("the entry is kept");
    assert_eq!((accepted.state, accepted.msg_seq), (OutboxState::Accepted, Some(inbox[0].msg_seq)));

    // Bob reads (the read position is the user's, on every device) and
    // answers.
    bob.mark_read(&conv, inbox[0].msg_seq).await?;
    bob.send(&conv, json!({ "text": "hi alice" })).await?;
    alice.wait_for(WAIT, || async { Ok(alice.messages(&conv).await?.len() == 2) }).await?;
    bob.wait_for(WAIT, || async { Ok(bob.conversation(&conv).await?.is_some_and(|c| c.unread == 0)) }).await?;
    for m in alice.messages(&conv).await? {
        println!("alice holds #{}: {}: {}", m.msg_seq, m.sender, m.content["text"]);
    }

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
