//! History paging: a device pages back through a conversation, newest
//! first, `limit` messages a page. Pages the local store holds whole are
//! answered from it (offline too); the others come from the server and are
//! stored, so the next time they are local. A device that rebuilt from a
//! snapshot holds only each conversation's latest messages: everything
//! older is history, fetched this way, never a gap.
//!
//! ```sh
//! TIDEMARK_ADMIN_TOKEN=change-me cargo run -p tidemark-client --example history -- http://127.0.0.1:8080
//! ```

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tidemark_client::{Client, ClientConfig, ConnState, Http};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
const WAIT: Duration = Duration::from_secs(15);
const MESSAGES: u64 = 12;

/// What paging saw: the `msg_seq`s in the order they came, and how many
/// pages the local store answered and how many the server.
#[derive(Debug, Default)]
pub struct Paged {
    pub seqs: Vec<u64>,
    pub local_pages: usize,
    pub server_pages: usize,
}

/// Pages back through all of `conv`'s history the user may read.
pub async fn page_all(client: &Client, conv: &str, limit: u32) -> Result<Paged, Error> {
    let mut paged = Paged::default();
    let mut before = None;
    loop {
        let page = client.history(conv, before, limit).await?;
        paged.seqs.extend(page.messages.iter().map(|m| m.msg_seq));
        if page.local {
            paged.local_pages += 1;
        } else {
            paged.server_pages += 1;
        }
        if page.trimmed {
            println!("the server's retention removed history below #{}", page.history_start);
        }
        match page.next_cursor {
            Some(cursor) if page.has_more => before = Some(cursor),
            _ => return Ok(paged),
        }
    }
}

pub async fn run(url: &str, admin_token: &str, dir: &Path) -> Result<Paged, Error> {
    let http = Http::new(url);
    http.create_user(admin_token, "alice", "pw").await?;
    http.create_user(admin_token, "bob", "pw").await?;
    let alice = Client::open(ClientConfig::new(url, "alice", "phone", dir.join("alice.db")).with_password("pw"))?;
    alice.start().await?;
    alice.wait_state(ConnState::Ready, WAIT).await?;
    let conv = alice.create_direct("bob").await?;
    for i in 1..=MESSAGES {
        alice.send(&conv, json!({ "text": format!("message {i}") })).await?;
    }
    alice.wait_for(WAIT, || async { Ok(alice.outbox().await?.iter().all(|e| e.msg_seq.is_some())) }).await?;

    // Bob's new tablet: it starts from the server (by replaying his log,
    // or from a snapshot if the log was trimmed) and pages back.
    let tablet = Client::open(ClientConfig::new(url, "bob", "tablet", dir.join("bob.db")).with_password("pw"))?;
    tablet.start().await?;
    tablet
        .wait_for(WAIT, || async { Ok(tablet.conversation(&conv).await?.is_some_and(|c| c.last_msg_seq == MESSAGES)) })
        .await?;
    let first = page_all(&tablet, &conv, 5).await?;
    println!("{} messages in {} local and {} server pages", first.seqs.len(), first.local_pages, first.server_pages);
    assert_eq!(first.seqs, (1..=MESSAGES).rev().collect::<Vec<_>>(), "every message once, newest first");

    // The second time every page is local: the server's pages were kept.
    let again = page_all(&tablet, &conv, 5).await?;
    assert_eq!((again.seqs, again.server_pages), (first.seqs.clone(), 0));

    alice.stop().await;
    tablet.stop().await;
    Ok(first)
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Error> {
    let url = std::env::args().nth(1).unwrap_or_else(|| "http://127.0.0.1:8080".into());
    let admin_token = std::env::var("TIDEMARK_ADMIN_TOKEN").map_err(|_| "set TIDEMARK_ADMIN_TOKEN")?;
    let dir = tempfile::tempdir()?;
    run(&url, &admin_token, dir.path()).await.map(drop)
}
