//! Groups: Ann creates a group with Ben, adds Cat later, removes Ben and
//! lists who is left; Ben
//! leaves with the history of his membership, Cat reads only from her
//! join. Membership changes are events of the conversation, ordered with
//! its messages.
//!
//! ```sh
//! TIDEMARK_ADMIN_TOKEN=change-me cargo run -p tidemark-client --example groups -- http://127.0.0.1:8080
//! ```

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tidemark_client::proto::ErrorCode;
use tidemark_client::{Client, ClientConfig, ConnState, Http, Message, OutboxState, SdkError};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
const WAIT: Duration = Duration::from_secs(15);

async fn device(url: &str, user: &str, dir: &Path) -> Result<Client, Error> {
    let client =
        Client::open(ClientConfig::new(url, user, "phone", dir.join(format!("{user}.db"))).with_password("pw"))?;
    client.start().await?;
    client.wait_state(ConnState::Ready, WAIT).await?;
    Ok(client)
}

fn texts(messages: &[Message]) -> Vec<String> {
    messages.iter().filter_map(|m| m.content["text"].as_str().map(str::to_owned)).collect()
}

/// Waits until `client` holds the messages `expected` in `conv`.
async fn wait_texts(client: &Client, conv: &str, expected: &[&str]) -> Result<(), Error> {
    client.wait_for(WAIT, || async { Ok(texts(&client.messages(conv).await?) == expected) }).await?;
    Ok(())
}

pub async fn run(url: &str, admin_token: &str, dir: &Path) -> Result<(), Error> {
    let http = Http::new(url);
    for user in ["ann", "ben", "cat"] {
        http.create_user(admin_token, user, "pw").await?;
    }
    let (ann, ben, cat) =
        (device(url, "ann", dir).await?, device(url, "ben", dir).await?, device(url, "cat", dir).await?);

    let group = ann.create_group(&["ben"]).await?;
    let conv = group.conv;
    ann.send(&conv, json!({ "text": "welcome ben" })).await?;
    wait_texts(&ben, &conv, &["welcome ben"]).await?;

    // Cat joins: she reads from her join on, not what came before.
    ann.add_member(&conv, "cat").await?;
    ann.send(&conv, json!({ "text": "welcome cat" })).await?;
    wait_texts(&cat, &conv, &["welcome cat"]).await?;
    wait_texts(&ben, &conv, &["welcome ben", "welcome cat"]).await?;

    // Only the owner removes; a member who tries is refused.
    match cat.remove_member(&conv, "ben").await {
        Err(SdkError::Refused(e)) => println!("cat may not remove ben: {:?}", e.code()),
        other => return Err(format!("cat removed ben: {other:?}").into()),
    }
    ann.remove_member(&conv, "ben").await?;
    // The member list (paged by user id; one page holds this group).
    let page = ann.members(&conv, None, 100).await?;
    let members: Vec<&str> = page.members.iter().map(|m| m.user.as_str()).collect();
    assert_eq!((members, page.owner.as_deref(), page.next_after), (vec!["ann", "cat"], Some("ann"), None));
    ann.send(&conv, json!({ "text": "ben is gone" })).await?;
    wait_texts(&cat, &conv, &["welcome cat", "ben is gone"]).await?;

    // Ben keeps what he held; his send after the removal is refused for
    // good, and the outbox says so (the entries after it go on).
    let late = ben.send(&conv, json!({ "text": "wait!" })).await?;
    ben.wait_for(WAIT, || async {
        Ok(ben.outbox_entry(&late.client_msg_id).await?.is_some_and(|e| e.state == OutboxState::Failed))
    })
    .await?;
    ben.wait_for(WAIT, || async { Ok(ben.conversation(&conv).await?.is_some_and(|c| !c.active)) }).await?;
    assert_eq!(texts(&ben.messages(&conv).await?), ["welcome ben", "welcome cat"]);

    // Cat leaves by herself; leaving twice is refused.
    cat.leave(&conv).await?;
    match cat.leave(&conv).await {
        Err(SdkError::Refused(e)) if e.code() == Some(ErrorCode::NotMember) => {}
        other => return Err(format!("a second leave: {other:?}").into()),
    }
    for c in [&ann, &ben, &cat] {
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
