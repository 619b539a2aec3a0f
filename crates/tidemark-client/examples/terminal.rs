//! A small but complete terminal chat, built only on the SDK's public API:
//! log in (or register, with an operator's admin token: the server has no
//! self sign-up), list conversations, open one, send, receive live, and
//! keep typing while offline: lines wait in the device's durable outbox
//! and leave, in order, once the server is back.
//!
//! ```sh
//! TIDEMARK_PASSWORD=pw-a [TIDEMARK_ADMIN_TOKEN=change-me] \
//!   cargo run -p tidemark-client --example terminal -- http://127.0.0.1:8080 alice laptop ./alice-laptop.db
//! ```
//!
//! Commands: `/to USER` (open the direct conversation with USER), `/list`,
//! `/open CONV`, `/status`, `/quit`; any other line is sent to the open
//! conversation. (`tidemark chat` is the full-featured client.)

use serde_json::json;
use tidemark_client::{Change, Client, ClientConfig, ConnState, Http, OutboxState};
use tokio::io::{AsyncBufReadExt, BufReader};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Prints the text messages of `conv` with `msg_seq` in `(after, upto]`.
async fn print_messages(client: &Client, conv: &str, after: u64, upto: u64) -> Result<(), Error> {
    for m in client.messages(conv).await? {
        if m.msg_seq > after && m.msg_seq <= upto {
            let text = m.content["text"].as_str().unwrap_or(if m.state == "recalled" { "(recalled)" } else { "" });
            println!("[{conv}] #{} {}: {text}", m.msg_seq, m.sender);
        }
    }
    Ok(())
}

/// Serves one typed line; `Ok(false)` ends the session.
async fn command(client: &Client, open: &mut Option<String>, line: &str) -> Result<bool, Error> {
    let (cmd, arg) = line.split_once(' ').map_or((line, ""), |(c, a)| (c, a.trim()));
    match cmd {
        "/quit" => return Ok(false),
        "/to" => {
            let conv = client.create_direct(arg).await?;
            println!("opened {conv}");
            *open = Some(conv);
        }
        "/list" => {
            for c in client.conversations().await? {
                let last = c.last_message.as_ref().and_then(|m| m.content["text"].as_str().map(str::to_owned));
                println!("conv {} {} unread={} last={}", c.conv, c.kind, c.unread, last.unwrap_or_default());
            }
        }
        "/open" => {
            let held = client.conversation(arg).await?.ok_or("no such conversation here (see /list)")?;
            println!("opened {}", held.conv);
            print_messages(client, &held.conv, 0, held.contiguous_msg_seq).await?;
            client.mark_read(&held.conv, held.last_msg_seq).await?;
            *open = Some(held.conv);
        }
        "/status" => {
            let pending = client.outbox().await?.iter().filter(|e| e.state == OutboxState::Pending).count();
            let at = client.position().await?;
            println!("state={:?} pending={pending} applied={}", client.state(), at.applied_sync_seq);
        }
        _ if cmd.starts_with('/') => println!("[error] unknown command {cmd}"),
        _ => {
            let conv = open.as_deref().ok_or("open a conversation first (/to USER or /open CONV)")?;
            client.send(conv, json!({ "text": line })).await?;
            println!("queued");
        }
    }
    Ok(true)
}

/// Prints what a change means to the person at the terminal.
async fn show(client: &Client, change: Change) -> Result<bool, Error> {
    match change {
        Change::State(ConnState::Ready) => println!("[state] ready"),
        Change::State(ConnState::Offline) => println!("[state] offline"),
        Change::CursorMoved(moved) => print_messages(client, &moved.conv, moved.from, moved.to).await?,
        Change::OutboxAccepted { msg_seq, .. } => println!("sent #{msg_seq}"),
        Change::OutboxFailed { error, .. } => println!("[error] not sent: {error}"),
        // The store is the truth: a subscriber that fell behind re-reads it.
        Change::Lagged { .. } => println!("[lagged] some updates were not shown; /list re-reads"),
        Change::Exited(exit) => {
            println!("[exit] {exit:?}");
            return Ok(false);
        }
        _ => {}
    }
    Ok(true)
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, user, device, db] = args.as_slice() else {
        return Err("usage: terminal SERVER_URL USER DEVICE DB_PATH (password in TIDEMARK_PASSWORD)".into());
    };
    let password = std::env::var("TIDEMARK_PASSWORD").map_err(|_| "set TIDEMARK_PASSWORD")?;
    if let Ok(admin_token) = std::env::var("TIDEMARK_ADMIN_TOKEN") {
        let created = Http::new(url).create_user(&admin_token, user, &password).await?.created;
        println!("{}", if created { format!("registered {user}") } else { format!("{user} exists") });
    }
    let client = Client::open(ClientConfig::new(url, user, device, db).with_password(&password))?;
    let mut changes = client.subscribe();
    client.start().await?;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut open = None;
    loop {
        let go_on = tokio::select! {
            line = lines.next_line() => match line? {
                Some(line) if line.trim().is_empty() => Ok(true),
                Some(line) => command(&client, &mut open, line.trim()).await,
                None => Ok(false),
            },
            change = changes.recv() => match change {
                Some(change) => show(&client, change).await,
                None => Ok(false),
            },
        };
        match go_on {
            Ok(true) => {}
            Ok(false) => break,
            // A refused or failed command is reported; the session goes on.
            Err(e) => println!("[error] {e}"),
        }
    }
    client.stop().await;
    Ok(())
}
