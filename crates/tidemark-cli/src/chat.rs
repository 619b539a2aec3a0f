//! `tidemark chat`: an interactive client on the SDK. Lines you type are
//! sent to the current conversation; incoming events print as they are
//! applied to the local store, one line each; status lines follow the
//! connection's state changes in order. A refused command prints an
//! `[error]` line and the session goes on.
//!
//! The password never appears on the command line: it comes from
//! `TIDEMARK_PASSWORD`, from `--password-file`, from a prompt without echo
//! on a terminal, or else from the first line of stdin (scripts).
//!
//! Sends, recalls and reads go through the SDK's durable outbox, so they
//! also work offline and leave in order on the next connection. Groups,
//! edits and reactions use the SDK's calls on the live connection, and
//! need the server.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use tidemark_client::policy::Backoff;
use tidemark_client::{Change, Client, ClientConfig, ClientError, ConnState, Exit, Message, OutboxOp, SdkError};
use tokio::io::{AsyncBufReadExt, BufReader, Lines, Stdin};

/// The password's environment variable.
pub const PASSWORD_ENV: &str = "TIDEMARK_PASSWORD";

#[derive(clap::Args, Debug, Clone)]
#[command(after_help = "The password comes from TIDEMARK_PASSWORD, else --password-file, else a prompt \
                        (no echo) on a terminal, else the first line of stdin. Type /help in the chat \
                        for its commands. RUST_LOG=debug shows the SDK's logs on stderr.")]
pub struct ChatArgs {
    /// The server, like http://127.0.0.1:8080.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The user to chat as.
    #[arg(long)]
    pub user: String,
    /// This installation's device id (one local store and one sync cursor
    /// per device).
    #[arg(long, default_value = "cli")]
    pub device: String,
    /// The device's local store; default `./tidemark-<user>-<device>.db`.
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Read the password from the first line of this file.
    #[arg(long)]
    pub password_file: Option<PathBuf>,
    /// Open the direct conversation with this user at start.
    #[arg(long)]
    pub to: Option<String>,
}

/// Reconnect backoff: a person waits for the chat to come back, so the
/// ceiling is lower than the SDK's default.
const RECONNECT_BACKOFF: Backoff = Backoff { base: Duration::from_millis(200), cap: Duration::from_secs(5) };
/// How long `/quit` waits for queued operations to leave (the rest stays
/// durable in the outbox for the next start).
const QUIT_DRAIN: Duration = Duration::from_secs(3);
/// Characters of a conversation id shown (enough to tell them apart here).
const CONV_SHOWN: usize = 9;

const HELP: &[(&str, &str)] = &[
    (
        "TEXT",
        "send TEXT to the current conversation (queued in the outbox when offline); @USER mentions USER, @all everyone",
    ),
    ("/to USER", "open the direct conversation with USER (created if new)"),
    ("/group USER [USER...]", "create a group with these users and you, and open it"),
    ("/add USER", "add USER to the current group"),
    ("/remove USER", "remove USER from the current group (its owner only)"),
    ("/leave", "leave the current group"),
    ("/open ID", "open a conversation by (the start of) its id, as /list shows it"),
    ("/list", "conversations with their last msg_seq, unread count and mentions of you (large groups marked)"),
    ("/history", "the current conversation as held locally"),
    ("/recall N", "recall your message #N (it becomes a placeholder everywhere)"),
    ("/edit N TEXT", "replace the text of your message #N"),
    ("/react N EMOJI", "add your reaction EMOJI to message #N"),
    ("/unreact N EMOJI", "remove your reaction EMOJI from message #N"),
    ("/read", "mark the current conversation read on all your devices"),
    ("/seen", "who of the current conversation read up to where (read marks)"),
    ("/typing", "tell the others in the current conversation you are typing"),
    ("/away", "show yourself idle (/back: online again)"),
    ("/status", "connection state and this device's sync position"),
    ("/help", "this list"),
    ("/quit", "stop (queued operations stay in the outbox for the next start)"),
];

fn short(conv: &str) -> &str {
    &conv[..conv.len().min(CONV_SHOWN)]
}

/// A conversation's kind from its id (`c…` direct, `g…` group,
/// docs/protocol.md §3.5): the SDK's local store records every
/// conversation it first learns from a sync page as `direct`.
fn kind_of(conv: &str) -> &'static str {
    if conv.starts_with('g') {
        "group"
    } else {
        "direct"
    }
}

fn text_of(content: &Value) -> String {
    content.get("text").and_then(Value::as_str).map(str::to_owned).unwrap_or_else(|| content.to_string())
}

/// One conversation event as a line of text, the same in the live view and
/// in `/history`.
fn render(m: &Message) -> String {
    let c = &m.content;
    let target = c.get("target_msg_seq").and_then(Value::as_u64).unwrap_or_default();
    let user = |k: &str| c.get(k).and_then(Value::as_str).unwrap_or("?").to_owned();
    let what = match m.kind.as_str() {
        "conv.created" => {
            let members: Vec<&str> =
                c["members"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
            format!("{} created the group: {}", m.sender, members.join(", "))
        }
        "member.join" => format!("{} added {}", m.sender, user("user")),
        "member.leave" if c["op"] == "leave" => format!("{} left", m.sender),
        "member.leave" => format!("{} removed {}", m.sender, user("user")),
        "recall" => format!("{} recalled #{target}", m.sender),
        "edit" if c.get("recalled").is_some() => format!("{} edited #{target} (since recalled)", m.sender),
        "edit" => format!("{} edited #{target}: {}", m.sender, text_of(&c["content"])),
        "reaction" if c["op"] == "remove" => format!("{} removed {} from #{target}", m.sender, user("reaction")),
        "reaction" => format!("{} reacted {} to #{target}", m.sender, user("reaction")),
        _ => match m.state.as_str() {
            "recalled" => format!("{}: (recalled)", m.sender),
            "deleted" => format!("{}: (deleted)", m.sender),
            "edited" => format!("{}: {} (edited)", m.sender, text_of(c)),
            _ => format!("{}: {}", m.sender, text_of(c)),
        },
    };
    let reactions = match m.reactions.as_object() {
        Some(r) if !r.is_empty() && !m.is_control() => {
            let parts: Vec<String> =
                r.iter().map(|(emoji, users)| format!("{emoji} {}", users.as_array().map_or(0, Vec::len))).collect();
            format!("  [{}]", parts.join(", "))
        }
        _ => String::new(),
    };
    format!("[{} #{}] {what}{reactions}", short(&m.conv), m.msg_seq)
}

/// The peers whose direct conversation this device opened before, kept
/// beside the local store so `/to USER` works offline too.
struct Peers {
    path: PathBuf,
    map: HashMap<String, String>,
}

impl Peers {
    fn load(db: &Path) -> Peers {
        let mut path = db.as_os_str().to_owned();
        path.push(".peers.json");
        let path = PathBuf::from(path);
        let map = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        Peers { path, map }
    }

    fn remember(&mut self, peer: &str, conv: &str) -> Result<()> {
        if self.map.get(peer).map(String::as_str) != Some(conv) {
            self.map.insert(peer.to_owned(), conv.to_owned());
            std::fs::write(&self.path, serde_json::to_vec(&self.map)?)
                .with_context(|| format!("write {}", self.path.display()))?;
        }
        Ok(())
    }
}

/// A refusal in a person's words: the server's code and message, or that
/// the server is unreachable.
fn explain(e: ClientError) -> anyhow::Error {
    match e {
        ClientError::Server(f) => anyhow!("{}: {}", f.code, f.message),
        ClientError::Transport(_) | ClientError::Closed => anyhow!("the server is not reachable; try again later"),
        other => anyhow!("{other}"),
    }
}

fn sdk(e: SdkError) -> anyhow::Error {
    match e {
        SdkError::Refused(c) => explain(c),
        SdkError::Offline | SdkError::Timeout => anyhow!("offline: this needs the server; try again once connected"),
        other => anyhow!("{other}"),
    }
}

struct Chat {
    client: Client,
    peers: Peers,
    current: Option<String>,
    /// Per conversation: the highest `msg_seq` printed.
    printed: HashMap<String, u64>,
    /// The last connection state a status line was printed for.
    shown: Option<ConnState>,
    /// `/to USER` asked while offline for a peer not opened before: opened
    /// once connected.
    pending_peer: Option<String>,
    /// Lines typed for `pending_peer`, sent once its conversation opens.
    held: Vec<String>,
}

impl Chat {
    async fn status(&self) -> Result<String> {
        let p = self.client.position().await?;
        Ok(format!(
            "[status] {} | applied sync_seq {} | acked {} | generation {}",
            format!("{:?}", self.client.state()).to_lowercase(),
            p.applied_sync_seq,
            p.acked_sync_seq,
            p.generation.map_or("-".to_string(), |g| g.to_string())
        ))
    }

    /// Prints every event applied since the last call, and conversations
    /// that appeared.
    async fn print_new(&mut self) -> Result<()> {
        for conv in self.client.conversations().await? {
            let upto = match self.printed.get(&conv.conv) {
                Some(n) => *n,
                None => {
                    if self.current.as_deref() != Some(conv.conv.as_str()) {
                        let id = short(&conv.conv);
                        println!("[chat] new {} conversation {id} (/open {id} to talk there)", kind_of(&conv.conv));
                    }
                    0
                }
            };
            let mut last = upto;
            for m in self.client.events(&conv.conv).await?.into_iter().filter(|m| m.msg_seq > upto) {
                println!("{}", render(&m));
                last = last.max(m.msg_seq);
            }
            self.printed.insert(conv.conv.clone(), last);
        }
        Ok(())
    }

    fn current(&self) -> Result<&str> {
        self.current.as_deref().ok_or_else(|| anyhow!("no conversation open: /to USER, /group USER..., or /open ID"))
    }

    async fn open_direct(&mut self, peer: &str) -> Result<()> {
        tidemark_core::ids::check_user(peer).map_err(anyhow::Error::msg)?;
        match self.client.create_direct(peer).await {
            Ok(conv) => {
                self.peers.remember(peer, &conv)?;
                println!("[chat] talking to {peer} in {}", short(&conv));
                self.current = Some(conv.clone());
                self.pending_peer = None;
                let held = std::mem::take(&mut self.held);
                for line in &held {
                    self.client.send(&conv, json!({ "text": line })).await.map_err(sdk)?;
                }
                if !held.is_empty() {
                    println!("[chat] {} held line(s) queued in the outbox", held.len());
                }
            }
            Err(SdkError::Offline | SdkError::Timeout | SdkError::NotRunning) => {
                if let Some(conv) = self.peers.map.get(peer).cloned() {
                    println!("[chat] talking to {peer} in {} (offline: lines queue in the outbox)", short(&conv));
                    self.current = Some(conv);
                    self.pending_peer = None;
                } else {
                    println!(
                        "[chat] offline: the conversation with {peer} opens once connected; lines typed until then are held"
                    );
                    self.current = None;
                    self.pending_peer = Some(peer.to_owned());
                }
            }
            Err(e) => return Err(sdk(e)),
        }
        Ok(())
    }

    /// The message `#n` of the current conversation, as held locally.
    async fn message(&self, n: &str) -> Result<Message> {
        let conv = self.current()?;
        let seq: u64 = n.trim_start_matches('#').parse().map_err(|_| anyhow!("{n:?} is not a message number"))?;
        self.client
            .messages(conv)
            .await?
            .into_iter()
            .find(|m| m.msg_seq == seq)
            .ok_or_else(|| anyhow!("no message #{seq} in {}", short(conv)))
    }

    async fn react(&mut self, args: &str, op: &str) -> Result<()> {
        let (n, emoji) = args.split_once(' ').ok_or_else(|| anyhow!("usage: /react N EMOJI"))?;
        let m = self.message(n).await?;
        let ok = self.client.react(&m.conv, &m.message_id, emoji.trim(), op == "add").await.map_err(sdk)?;
        if !ok.changed {
            println!("[chat] nothing to change on #{}", m.msg_seq);
        }
        Ok(())
    }

    /// Runs one typed line; `Ok(false)` ends the session.
    async fn line(&mut self, line: &str) -> Result<bool> {
        let (cmd, rest) = line.split_once(' ').map_or((line, ""), |(a, b)| (a, b.trim()));
        match (cmd, rest) {
            ("/quit", _) => return Ok(false),
            ("/help", _) => {
                for (c, what) in HELP {
                    println!("[help] {c:<22} {what}");
                }
            }
            ("/to", peer) if !peer.is_empty() => self.open_direct(peer).await?,
            ("/group", members) if !members.is_empty() => {
                let members: Vec<&str> = members.split_whitespace().collect();
                let ok = self.client.create_group(&members).await.map_err(sdk)?;
                let conv = ok.conv.clone();
                println!("[chat] group {} with {}", short(&conv), ok.members.join(", "));
                self.client.sync_now();
                self.current = Some(conv);
            }
            (op @ ("/add" | "/remove"), user) if !user.is_empty() => {
                let conv = self.current()?.to_owned();
                if op == "/add" {
                    self.client.add_member(&conv, user).await.map_err(sdk)?;
                } else {
                    self.client.remove_member(&conv, user).await.map_err(sdk)?;
                }
            }
            ("/leave", _) => {
                let conv = self.current()?.to_owned();
                self.client.leave(&conv).await.map_err(sdk)?;
            }
            ("/open", id) if !id.is_empty() => {
                let convs = self.client.conversations().await?;
                let found: Vec<_> = convs.iter().filter(|c| c.conv.starts_with(id)).collect();
                match found.as_slice() {
                    [c] => {
                        // Opening checks the authoritative head (a large
                        // group's slow path, G2) when connected.
                        let held = match self.client.open_conversation(&c.conv).await {
                            Ok(now) => now.contiguous_msg_seq,
                            Err(_) => c.contiguous_msg_seq,
                        };
                        let large = if c.shared { ", large group" } else { "" };
                        println!(
                            "[chat] talking in {} ({}{large}), held up to #{held}",
                            short(&c.conv),
                            kind_of(&c.conv)
                        );
                        self.current = Some(c.conv.clone());
                    }
                    [] => bail!("no conversation {id} held locally (/list shows them)"),
                    _ => bail!("{id} names {} conversations; give more of the id", found.len()),
                }
            }
            ("/list", _) => {
                let convs = self.client.conversations().await?;
                if convs.is_empty() {
                    println!("[list] no conversation yet");
                }
                for c in convs {
                    let here = if self.current.as_deref() == Some(c.conv.as_str()) { " (open)" } else { "" };
                    let gone = if c.active { "" } else { " (left)" };
                    let kind = if c.shared { "large group" } else { kind_of(&c.conv) };
                    let mentions = if c.mentions > 0 { format!(" @{}", c.mentions) } else { String::new() };
                    println!(
                        "[list] {} {} last #{} unread {}{mentions}{here}{gone}",
                        short(&c.conv),
                        kind,
                        c.last_msg_seq,
                        c.unread
                    );
                }
            }
            ("/history", _) => {
                let conv = self.current()?;
                let events = self.client.events(conv).await?;
                if events.is_empty() {
                    println!("[chat] nothing held in {} yet", short(conv));
                }
                for m in events {
                    println!("{}", render(&m));
                }
            }
            ("/recall", n) if !n.is_empty() => {
                let m = self.message(n).await?;
                if m.sender != self.client.config().user {
                    bail!("#{} is {}'s message: only its sender can recall it", m.msg_seq, m.sender);
                }
                self.client.recall(&m.conv, &m.message_id).await.map_err(sdk)?;
            }
            ("/edit", args) if args.contains(' ') => {
                let (n, text) = args.split_once(' ').unwrap_or_default();
                let m = self.message(n).await?;
                self.client.edit(&m.conv, &m.message_id, json!({"text": text.trim()}), m.version).await.map_err(sdk)?;
            }
            ("/react", args) => self.react(args, "add").await?,
            ("/unreact", args) => self.react(args, "remove").await?,
            ("/read", _) => {
                let conv = self.current()?.to_owned();
                let last = self.client.conversation(&conv).await?.map_or(0, |c| c.last_msg_seq);
                self.client.mark_read(&conv, last).await.map_err(sdk)?;
                println!("[chat] read up to #{last}");
            }
            ("/seen", _) => {
                let conv = self.current()?.to_owned();
                let r = self.client.conv_receipts(&conv, None).await.map_err(sdk)?;
                let marks: Vec<String> = r.members.iter().map(|m| format!("{} #{}", m.user, m.read_seq)).collect();
                println!("[seen] {} ({} private)", marks.join(", "), r.hidden);
            }
            ("/typing", _) => {
                let conv = self.current()?.to_owned();
                self.client.typing(&conv, true, None).await.map_err(sdk)?;
            }
            (op @ ("/away" | "/back"), _) => {
                let state = if op == "/away" {
                    tidemark_client::PresenceState::Idle
                } else {
                    tidemark_client::PresenceState::Online
                };
                let r = self.client.set_presence(state).await.map_err(sdk)?;
                println!("[presence] others see you {}", r.state);
            }
            ("/status", _) => println!("{}", self.status().await?),
            (cmd, _) if cmd.starts_with('/') => {
                bail!("{cmd} {rest}: unknown command or missing argument; /help lists the commands")
            }
            _ => {
                if let (None, Some(peer)) = (&self.current, &self.pending_peer) {
                    // No conversation id yet, so not in the outbox: held
                    // here until it opens (lost if the chat stops first).
                    self.held.push(line.to_owned());
                    println!("[chat] held until the conversation with {peer} opens");
                    return Ok(true);
                }
                let conv = self.current()?.to_owned();
                self.client
                    .send_mentioning(&conv, "text", json!({"text": line}), mentions_in(line))
                    .await
                    .map_err(sdk)?;
                if self.client.state() == ConnState::Offline {
                    println!("[chat] queued in the outbox; it leaves once connected");
                }
            }
        }
        Ok(true)
    }

    /// Reacts to one SDK change; `Some(exit)` when the engine stopped.
    async fn change(&mut self, change: Change) -> Result<Option<Exit>> {
        match change {
            Change::State(s) => {
                // Once per change that matters: connecting at start,
                // offline once however often a reconnect fails, connected
                // once per connection.
                let line = match (s, self.shown) {
                    (ConnState::Connecting, None) => {
                        Some(format!("[status] connecting to {}", self.client.config().server_url))
                    }
                    (ConnState::Ready, shown) if shown != Some(ConnState::Ready) => {
                        Some(format!("{} (connected)", self.status().await?))
                    }
                    (ConnState::Offline, shown) if shown != Some(ConnState::Offline) => {
                        Some("[status] offline; sends queue in the local outbox, reconnecting".to_string())
                    }
                    _ => None,
                };
                if let Some(line) = line {
                    println!("{line}");
                    self.shown = Some(s);
                }
                if s == ConnState::Ready {
                    if let Some(peer) = self.pending_peer.clone() {
                        if let Err(e) = self.open_direct(&peer).await {
                            println!("[error] /to {peer}: {e:#}");
                            self.pending_peer = None;
                        }
                    }
                }
            }
            Change::OutboxFailed { op, error, .. } => println!("[error] {} refused: {error}", op.as_str()),
            Change::OutboxAccepted { op: OutboxOp::Send, duplicate: true, msg_seq, .. } => {
                println!("[chat] #{msg_seq} was already sent (a retry)")
            }
            Change::Reset { generation } => println!(
                "[status] the server asked this device to rebuild (generation {}): installing a snapshot",
                generation.map_or("-".to_string(), |g| g.to_string())
            ),
            Change::SnapshotInstalled { conversations, messages, .. } => {
                println!("[status] rebuilt from a snapshot: {conversations} conversation(s), {messages} event(s)")
            }
            Change::Kicked { reason } => println!("[status] disconnected by the server: {reason}"),
            Change::RepairQueued { conv, from_msg_seq } => {
                println!("[status] {conv} needs repair from #{from_msg_seq}; it is fetched again, the rest syncs on")
            }
            Change::Repaired { conv } => println!("[status] {conv} repaired"),
            Change::Typing { conv, user, typing: true, .. } => println!("[typing] {user} is typing in {conv}"),
            Change::Presence { user, state, .. } => println!("[presence] {user} is {state}"),
            Change::Exited(exit) => return Ok(Some(exit)),
            _ => {}
        }
        self.print_new().await?;
        Ok(None)
    }
}

/// The password: env, file, a prompt on a terminal, or stdin's first line.
async fn password(args: &ChatArgs, lines: &mut Lines<BufReader<Stdin>>) -> Result<String> {
    if let Ok(p) = std::env::var(PASSWORD_ENV) {
        return Ok(p);
    }
    if let Some(path) = &args.password_file {
        let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        return Ok(text.lines().next().unwrap_or_default().to_owned());
    }
    if std::io::stdin().is_terminal() {
        let prompt = format!("password for {}: ", args.user);
        return tokio::task::spawn_blocking(move || rpassword::prompt_password(prompt))
            .await?
            .context("read the password");
    }
    lines.next_line().await?.context("no password: set TIDEMARK_PASSWORD, use --password-file, or write it to stdin")
}

pub async fn run(args: ChatArgs) -> Result<()> {
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let password = password(&args, &mut lines).await?;
    if password.is_empty() {
        bail!("empty password");
    }
    let db = args.db.clone().unwrap_or_else(|| PathBuf::from(format!("tidemark-{}-{}.db", args.user, args.device)));
    let mut config = ClientConfig::new(&args.server, &args.user, &args.device, &db).with_password(&password);
    config.backoff = RECONNECT_BACKOFF;
    let client = Client::open(config).context("open the local store")?;
    let mut changes = client.subscribe();
    let mut chat = Chat {
        client,
        peers: Peers::load(&db),
        current: None,
        printed: HashMap::new(),
        shown: None,
        pending_peer: None,
        held: Vec::new(),
    };
    // What the local store held before this start is history (/history),
    // not news.
    for c in chat.client.conversations().await? {
        chat.printed.insert(c.conv.clone(), c.last_msg_seq);
    }
    println!("[chat] {} as {}/{}; /help lists the commands", args.server, args.user, args.device);
    chat.client.start().await.context("start the client")?;
    if let Some(peer) = &args.to {
        if let Err(e) = chat.open_direct(peer).await {
            println!("[error] --to {peer}: {e:#}");
        }
    }
    let exit = loop {
        tokio::select! {
            line = lines.next_line() => {
                let Some(line) = line? else { break None };
                let line = line.trim();
                if line.is_empty() {
                    continue;
                }
                match chat.line(line).await {
                    Ok(true) => {}
                    Ok(false) => break None,
                    Err(e) => println!("[error] {e:#}"),
                }
                // Show what the command changed locally right away.
                chat.print_new().await?;
            }
            change = changes.recv() => {
                let Some(change) = change else { break None };
                if let Some(exit) = chat.change(change).await? {
                    break Some(exit);
                }
            }
        }
    };
    if let Some(exit) = exit {
        println!("[status] stopped: {exit:?}");
        if let Exit::LoggedOut(why) = &exit {
            bail!("cannot log in as {}: {why}", args.user);
        }
    }
    // Give queued operations a moment to leave; whatever is left stays
    // durable in the outbox for the next start.
    let client = &chat.client;
    let drained =
        client.wait_for(QUIT_DRAIN, || async { Ok(client.outbox().await?.iter().all(|e| !is_pending(e))) }).await;
    if drained.is_err() {
        println!("[chat] operations still queued in the outbox leave on the next start");
    }
    println!("{}", chat.status().await?);
    let exit = client.stop().await;
    if matches!(exit, Exit::Failed(_)) {
        bail!("client stopped: {exit:?}");
    }
    Ok(())
}

fn is_pending(e: &tidemark_client::OutboxEntry) -> bool {
    e.state == tidemark_client::OutboxState::Pending
}

/// The mentions a typed line makes (issue 18): each `@USER` word names a
/// user, `@all` everyone.
fn mentions_in(line: &str) -> tidemark_client::Mentions {
    let mut m = tidemark_client::Mentions::default();
    for word in line.split_whitespace().filter_map(|w| w.strip_prefix('@')) {
        let word = word.trim_end_matches(|c: char| !(c.is_ascii_alphanumeric() || "_-.@".contains(c)));
        match word {
            "" => {}
            "all" => m.all = true,
            user if tidemark_core::ids::check_user(user).is_ok() && !m.users.iter().any(|u| u == user) => {
                m.users.push(user.to_owned())
            }
            _ => {}
        }
    }
    m
}
