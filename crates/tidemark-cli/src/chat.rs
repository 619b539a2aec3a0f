//! `tidemark chat`: an interactive client on the SDK. Lines you type are
//! sent to the current conversation; incoming messages print as they are
//! applied to the local store; a status line shows the connection state
//! and the device's sync position (applied / ACKed / generation).
//!
//! Commands: `/to USER` opens (or creates) the direct conversation with
//! USER; `/list` lists conversations with unread counts; `/history` prints
//! the current conversation from the local store; `/read` marks it read;
//! `/status` prints the status line; `/quit` stops (pending sends stay in
//! the local outbox and leave on the next start).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tidemark_client::{Change, Client, ClientConfig};
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(clap::Args, Debug, Clone)]
pub struct ChatArgs {
    /// The server, like http://127.0.0.1:8080.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    #[arg(long)]
    pub user: String,
    /// This installation's device id.
    #[arg(long, default_value = "cli")]
    pub device: String,
    /// The local store; default `./tidemark-<user>-<device>.db`.
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// The password; read from the first line of stdin when absent.
    #[arg(long, env = "TIDEMARK_PASSWORD", hide_env_values = true)]
    pub password: Option<String>,
    /// Open the direct conversation with this user at start.
    #[arg(long)]
    pub to: Option<String>,
}

/// How long a connection may take before `chat` says so and goes on
/// (the SDK keeps retrying with backoff in the background).
const CONNECT_WAIT: Duration = Duration::from_secs(10);

struct Printer {
    /// Per conversation: the highest `msg_seq` printed.
    printed: HashMap<String, u64>,
}

impl Printer {
    async fn print_new(&mut self, client: &Client) -> Result<()> {
        for conv in client.conversations().await? {
            let upto = self.printed.get(&conv.conv).copied().unwrap_or(0);
            for m in client.messages(&conv.conv).await?.into_iter().filter(|m| m.msg_seq > upto) {
                let text = match m.state.as_str() {
                    "recalled" => "(recalled)".to_string(),
                    "deleted" => "(deleted)".to_string(),
                    _ => m
                        .content
                        .get("text")
                        .and_then(|t| t.as_str())
                        .map(str::to_owned)
                        .unwrap_or_else(|| m.content.to_string()),
                };
                println!("[{} #{}] {}: {}", short(&m.conv), m.msg_seq, m.sender, text);
                self.printed.insert(conv.conv.clone(), m.msg_seq.max(upto));
            }
        }
        Ok(())
    }
}

fn short(conv: &str) -> &str {
    &conv[..conv.len().min(9)]
}

async fn status(client: &Client) -> Result<String> {
    let p = client.position().await?;
    Ok(format!(
        "[status] {:?} | applied sync_seq {} | acked {} | generation {}",
        client.state(),
        p.applied_sync_seq,
        p.acked_sync_seq,
        p.generation.map_or("-".to_string(), |g| g.to_string())
    ))
}

pub async fn run(args: ChatArgs) -> Result<()> {
    let stdin = tokio::io::stdin();
    let mut lines = BufReader::new(stdin).lines();
    let password = match args.password.clone() {
        Some(p) => p,
        None => lines.next_line().await?.context("no password on stdin")?,
    };
    let db = args.db.clone().unwrap_or_else(|| PathBuf::from(format!("tidemark-{}-{}.db", args.user, args.device)));
    let config = ClientConfig::new(&args.server, &args.user, &args.device, db).with_password(&password);
    let client = Client::open(config).context("open the local store")?;
    let mut changes = client.subscribe();
    client.start().await.context("start the client")?;
    if client.wait_state(tidemark_client::ConnState::Ready, CONNECT_WAIT).await.is_err() {
        println!("[status] not connected yet; sends queue in the local outbox");
    }
    println!("{}", status(&client).await?);
    let mut printer = Printer { printed: HashMap::new() };
    printer.print_new(&client).await?;
    let mut current: Option<String> = None;
    if let Some(peer) = &args.to {
        current = Some(client.create_direct(peer).await?);
        println!("[chat] talking to {peer} in {}", short(current.as_deref().unwrap_or_default()));
    }
    loop {
        tokio::select! {
            line = lines.next_line() => {
                let Some(line) = line? else { break };
                let line = line.trim();
                if line.is_empty() {
                    continue;
                }
                match line.split_once(' ').map_or((line, ""), |(a, b)| (a, b.trim())) {
                    ("/quit", _) => break,
                    ("/to", peer) if !peer.is_empty() => {
                        let conv = client.create_direct(peer).await?;
                        println!("[chat] talking to {peer} in {}", short(&conv));
                        current = Some(conv);
                    }
                    ("/list", _) => {
                        for c in client.conversations().await? {
                            println!("[list] {} {} last #{} unread {}", short(&c.conv), c.kind, c.last_msg_seq, c.unread);
                        }
                    }
                    ("/history", _) => {
                        let Some(conv) = &current else { println!("[chat] /to USER first"); continue };
                        for m in client.messages(conv).await? {
                            println!("[{} #{}] {}: {}", short(conv), m.msg_seq, m.sender, m.content);
                        }
                    }
                    ("/read", _) => {
                        let Some(conv) = &current else { println!("[chat] /to USER first"); continue };
                        let last = client.conversation(conv).await?.map_or(0, |c| c.last_msg_seq);
                        client.mark_read(conv, last).await?;
                        println!("[chat] read up to #{last}");
                    }
                    ("/status", _) => println!("{}", status(&client).await?),
                    (cmd, _) if cmd.starts_with('/') => println!("[chat] commands: /to USER, /list, /history, /read, /status, /quit"),
                    _ => {
                        let Some(conv) = &current else { println!("[chat] /to USER first"); continue };
                        let entry = client.send(conv, serde_json::json!({"text": line})).await?;
                        println!("[chat] queued {}", &entry.client_msg_id[..entry.client_msg_id.len().min(8)]);
                    }
                }
            }
            change = changes.recv() => {
                let Some(change) = change else { break };
                match change {
                    Change::State(s) => println!("[status] {s:?}"),
                    Change::Exited(exit) => {
                        println!("[status] stopped: {exit:?}");
                        break;
                    }
                    _ => {}
                }
                printer.print_new(&client).await?;
            }
        }
    }
    // Give queued sends a moment to leave; whatever is left stays durable
    // in the outbox for the next start.
    let _ = client.wait_for(Duration::from_secs(3), || async { Ok(client.outbox().await?.is_empty()) }).await;
    println!("{}", status(&client).await?);
    let exit = client.stop().await;
    if matches!(exit, tidemark_client::Exit::Failed(_)) {
        bail!("client stopped: {exit:?}");
    }
    Ok(())
}
