//! `tidemark demo`: the sync story, played on a server started in-process
//! over a temporary directory, with three SDK clients (Alice's phone, Bob's
//! desktop, Bob's phone), each with its own local database.
//!
//! Alice's phone sends to Bob; Bob's desktop is online and receives at
//! once; Bob's phone is offline while more messages arrive, one is recalled
//! and Bob reads on his desktop; the phone reconnects and catches up. It
//! prints a timeline built from the clients' change notifications (who
//! sent, which `msg_seq`/`sync_seq`, which cursor moved, which device
//! ACKed), then checks the invariants the story is about and fails (exit
//! code 1) if any does not hold. It owns only the story and its output: the
//! sync itself is the SDK's, the server is the real one.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tidemark_client::{Change, Client, ClientConfig, ConnState, Exit, Http, Message, OutboxOp, OutboxState};
use tidemark_server::{RunningServer, Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tokio::task::JoinSet;

const ADMIN: &str = "demo-admin";
const PASSWORD: &str = "demo-password";
/// Every wait of the story gives up after this long.
const STEP_WAIT: Duration = Duration::from_secs(15);
/// The message Alice recalls; no device may hold this text afterwards.
const RECALLED_TEXT: &str = "lunch at 1?";

pub async fn run() -> Result<()> {
    let dir = temp_dir()?;
    let result = play(&dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn temp_dir() -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("tidemark-demo-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

/// A device of the story: its label and its client (shared, weakly, with
/// the task that prints its changes).
struct Device {
    label: &'static str,
    user: &'static str,
    device: &'static str,
    client: Arc<Client>,
}

/// Said once, before the story: the two numbers every line uses.
const SEQUENCES: &str = "\
Two sequence numbers run through this story:
  msg_seq  numbers the events of one conversation: #1, #2, ... are the same on every
           device of every member (messages and control events such as a recall);
  sync_seq numbers the entries of one user's sync log, across all the user's
           conversations. Each device pulls its user's log in batches and ACKs its own
           position in it, so Bob's two devices share one log but not one cursor.
Lines show a conversation event as c1234567#N and a log entry as sync_seq N.";

async fn play(dir: &Path) -> Result<()> {
    let started = Instant::now();
    let store = SqliteStore::open(&dir.join("server")).context("open the server store")?;
    let config = ServerConfig { admin_token: Some(ADMIN.into()), ..ServerConfig::default() };
    let server = Server::start("127.0.0.1:0", store, config).await.context("start the server")?;
    let url = server.url();
    println!("tidemark demo: server on {url}, data in {}", dir.display());
    let admin = Http::new(&url);
    for user in ["alice", "bob"] {
        admin.create_user(ADMIN, user, PASSWORD).await.with_context(|| format!("create {user}"))?;
    }

    let device = |label, user, device| -> Result<Device> {
        let mut config =
            ClientConfig::new(&url, user, device, dir.join(format!("{user}-{device}.db"))).with_password(PASSWORD);
        config.backoff =
            tidemark_client::policy::Backoff { base: Duration::from_millis(50), cap: Duration::from_secs(1) };
        Ok(Device { label, user, device, client: Arc::new(Client::open(config)?) })
    };
    let alice = device("alice/phone", "alice", "phone")?;
    let desktop = device("bob/desktop", "bob", "desktop")?;
    let phone = device("bob/phone", "bob", "phone")?;
    let timeline = Arc::new(Timeline {
        started,
        states: Mutex::new(HashMap::new()),
        // The story is about Bob's devices: Alice's phone also syncs its
        // own events back, which would double every line.
        senders_only: HashSet::from([alice.label]),
        done: AtomicBool::new(false),
    });
    println!("{SEQUENCES}");
    println!("(alice/phone syncs her own events back too; those lines are left out.)");
    let mut printers = JoinSet::new();
    for d in [&alice, &desktop, &phone] {
        let mut changes = d.client.subscribe();
        let (timeline, label, client) = (timeline.clone(), d.label, Arc::downgrade(&d.client));
        printers.spawn(async move {
            while let Some(change) = changes.recv().await {
                timeline.change(label, &client, &change).await;
            }
        });
    }

    let outcome = story(&server, &timeline, &alice, &desktop, &phone).await;
    // Shutting the clients down is not part of the story.
    timeline.done.store(true, Ordering::Relaxed);
    for d in [&alice, &desktop, &phone] {
        d.client.stop().await;
    }
    drop((alice, desktop, phone));
    // The printers end when their clients are gone.
    while tokio::time::timeout(STEP_WAIT, printers.join_next()).await.ok().flatten().is_some() {}
    server.stop().await;
    let failed = outcome?;
    if failed > 0 {
        bail!("{failed} invariant(s) failed");
    }
    println!("all invariants hold");
    Ok(())
}

async fn story(
    server: &RunningServer,
    t: &Timeline,
    alice: &Device,
    desktop: &Device,
    phone: &Device,
) -> Result<usize> {
    t.step("1. Everyone comes online. Bob's phone syncs once, then goes offline.");
    for d in [alice, desktop, phone] {
        d.client.start().await?;
        d.client.wait_state(ConnState::Ready, STEP_WAIT).await.with_context(|| format!("{} ready", d.label))?;
    }
    phone.client.stop().await;
    t.note("bob/phone", "offline (its server cursor stays where it was)");
    let conv = alice.client.create_direct("bob").await.context("conv.create")?;
    t.note("alice/phone", &format!("opened the direct conversation with bob: {}", short(&conv)));

    t.step("2. Alice's phone sends \"hi Bob!\". Bob's desktop is online and receives it at once.");
    send(alice, &conv, "hi Bob!").await?;
    wait_events(desktop, &conv, 1).await?;
    let bob_head = server.state.store.user_high_watermark("bob").await?;
    wait_acked(server, desktop, bob_head).await?;

    t.step("3. More messages, one from Bob's desktop, while Bob's phone is offline.");
    send(alice, &conv, "are you around?").await?;
    send(desktop, &conv, "yes, at my desk").await?;
    send(alice, &conv, "lunch at 1?").await?;
    send(alice, &conv, "my treat").await?;
    wait_events(desktop, &conv, 5).await?;

    t.step("4. Alice recalls \"lunch at 1?\": a new event; the message becomes a placeholder everywhere.");
    let target = alice
        .client
        .messages(&conv)
        .await?
        .into_iter()
        .find(|m| m.content["text"] == RECALLED_TEXT)
        .context("the message to recall")?;
    let recall = alice.client.recall(&conv, &target.message_id).await?;
    wait_accepted(alice, &recall.client_msg_id).await?;
    wait_events(desktop, &conv, 6).await?;
    let bob_head = server.state.store.user_high_watermark("bob").await?;
    wait_acked(server, desktop, bob_head).await?;
    // R1: the desktop ACKed every event of Bob's log, and Bob has still
    // not read Alice's last message.
    let unread_after_acks = desktop.client.conversation(&conv).await?.context("conversation")?.unread;
    let phone_ack_offline = server_ack(server, phone).await?;
    let desktop_ack_then = server_ack(server, desktop).await?;

    t.step("5. Bob reads the conversation on his desktop (one read position for all his devices).");
    let head = desktop.client.conversation(&conv).await?.context("conversation")?.last_msg_seq;
    let read = desktop.client.mark_read(&conv, head).await?;
    wait_accepted(desktop, &read.client_msg_id).await?;

    t.step("6. Bob's phone reconnects and catches up.");
    t.note("bob/phone", "back online: syncs from its server cursor");
    let bob_head = server.state.store.user_high_watermark("bob").await?;
    phone.client.start().await?;
    wait_acked(server, phone, bob_head).await?;
    wait_acked(server, desktop, bob_head).await?;
    wait_acked(server, alice, server.state.store.user_high_watermark("alice").await?).await?;

    t.step("7. Invariants.");
    let mut failed = 0;
    let mut check = |ok: bool, what: String| {
        println!("  {} {what}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failed += 1;
        }
    };
    let on_desktop = desktop.client.events(&conv).await?;
    let on_phone = phone.client.events(&conv).await?;
    let on_alice = alice.client.events(&conv).await?;
    check(
        view(&on_desktop) == view(&on_phone),
        format!("bob/desktop and bob/phone hold the same conversation ({} events)", on_phone.len()),
    );
    check(view(&on_alice) == view(&on_phone), "alice/phone holds the same conversation too".into());
    let seqs: Vec<u64> = on_phone.iter().map(|m| m.msg_seq).collect();
    check(seqs == [1, 2, 3, 4, 5, 6], format!("msg_seq is contiguous and ordered: {seqs:?}"));
    let ids: HashSet<&str> = on_phone.iter().map(|m| m.message_id.as_str()).collect();
    check(ids.len() == on_phone.len(), "every event is held once".into());
    for d in [alice, desktop, phone] {
        let held = d.client.events(&conv).await?;
        let placeholder = held.iter().find(|m| m.message_id == target.message_id);
        check(
            placeholder.is_some_and(|m| m.state == "recalled" && m.content == json!({}) && m.msg_seq == target.msg_seq),
            format!("{}: #{} is a placeholder in its place", d.label, target.msg_seq),
        );
        check(
            !held.iter().any(|m| m.content.to_string().contains(RECALLED_TEXT)),
            format!("{}: the recalled text is held nowhere", d.label),
        );
    }
    for d in [desktop, phone] {
        let c = d.client.conversation(&conv).await?.context("conversation")?;
        check(
            c.contiguous_msg_seq == 6 && c.last_msg_seq == 6,
            format!("{}: cursor {} = last msg_seq {} (no gap)", d.label, c.contiguous_msg_seq, c.last_msg_seq),
        );
    }
    let (phone_ack, desktop_ack) = (server_ack(server, phone).await?, server_ack(server, desktop).await?);
    check(
        phone_ack_offline.1 < desktop_ack_then.1,
        format!(
            "while offline the phone's server ACK stayed at {} as the desktop's moved to {}",
            phone_ack_offline.1, desktop_ack_then.1
        ),
    );
    check(
        phone_ack.1 == bob_head && desktop_ack.1 == bob_head,
        format!(
            "each device ACKed its own cursor: desktop {}, phone {} (bob's log head {bob_head})",
            desktop_ack.1, phone_ack.1
        ),
    );
    check(
        unread_after_acks == 1,
        format!("ACKs are not reads: with every event ACKed, bob still had {unread_after_acks} unread"),
    );
    let server_view = phone.client.server_conversations().await?;
    let sv = server_view.iter().find(|c| c.conv == conv).context("conv.list has the conversation")?;
    for d in [desktop, phone] {
        let c = d.client.conversation(&conv).await?.context("conversation")?;
        check(
            (c.read_seq, c.unread) == (sv.read_seq, sv.unread) && c.read_seq == head,
            format!(
                "{}: read_seq {} unread {} = the server's read state (read_seq {}, unread {})",
                d.label, c.read_seq, c.unread, sv.read_seq, sv.unread
            ),
        );
    }
    let mut entries = alice.client.outbox().await?;
    entries.extend(desktop.client.outbox().await?);
    for e in &entries {
        check(
            e.state == OutboxState::Accepted && !e.duplicate,
            format!("{} {} accepted once (msg_seq {:?})", e.op.as_str(), short(&e.client_msg_id), e.msg_seq),
        );
    }
    check(
        entries.len() == 7,
        format!("7 operations in the outboxes (5 sends, 1 recall, 1 read), {} found", entries.len()),
    );
    println!(
        "  server cursors: bob/desktop generation {} acked {}; bob/phone generation {} acked {}",
        desktop_ack.0, desktop_ack.1, phone_ack.0, phone_ack.1
    );
    Ok(failed)
}

async fn send(d: &Device, conv: &str, text: &str) -> Result<()> {
    let entry = d.client.send(conv, json!({ "text": text })).await?;
    wait_accepted(d, &entry.client_msg_id).await.with_context(|| format!("{} send {text:?}", d.label))
}

async fn wait_accepted(d: &Device, client_msg_id: &str) -> Result<()> {
    d.client
        .wait_for(STEP_WAIT, || async {
            Ok(d.client.outbox_entry(client_msg_id).await?.is_some_and(|e| e.state == OutboxState::Accepted))
        })
        .await
        .with_context(|| format!("{} waiting for {}", d.label, short(client_msg_id)))
}

/// Waits until `d` holds `n` conversation events (messages and control
/// events) of `conv`.
async fn wait_events(d: &Device, conv: &str, n: usize) -> Result<()> {
    d.client
        .wait_for(STEP_WAIT, || async { Ok(d.client.events(conv).await?.len() >= n) })
        .await
        .with_context(|| format!("{} waiting for {n} events", d.label))
}

async fn server_ack(server: &RunningServer, d: &Device) -> Result<(u64, u64)> {
    let rec = server.state.store.device(d.user, d.device).await?.context("device on the server")?;
    Ok((rec.cursor.generation, rec.cursor.acked_sync_seq))
}

async fn wait_acked(server: &RunningServer, d: &Device, acked: u64) -> Result<()> {
    let deadline = Instant::now() + STEP_WAIT;
    while server_ack(server, d).await?.1 < acked {
        if Instant::now() > deadline {
            bail!("{} never ACKed sync_seq {acked}", d.label);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Let its notifications reach the timeline before the next step.
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(())
}

/// What two devices must agree on: `(msg_seq, message_id, sender, state,
/// content)` of every event.
fn view(msgs: &[Message]) -> Vec<(u64, &str, &str, &str, String)> {
    msgs.iter()
        .map(|m| (m.msg_seq, m.message_id.as_str(), m.sender.as_str(), m.state.as_str(), m.content.to_string()))
        .collect()
}

/// The first characters of an opaque id, enough to tell ids apart here.
fn short(id: &str) -> &str {
    &id[..id.len().min(8)]
}

/// Prints the story's lines with the time since the start, one fact each.
struct Timeline {
    started: Instant,
    /// The last connection state printed per device.
    states: Mutex<HashMap<String, ConnState>>,
    /// Devices shown only sending: their sync-side lines are left out.
    senders_only: HashSet<&'static str>,
    /// The story is over: shutdown noise is not printed.
    done: AtomicBool,
}

/// The text of `conv`#`msg_seq` as `client` holds it now, quoted; a recalled
/// message is a placeholder.
async fn text_at(client: &Weak<Client>, conv: &str, msg_seq: u64) -> String {
    let Some(client) = client.upgrade() else { return String::new() };
    let held = client.events(conv).await.ok().and_then(|m| m.into_iter().find(|m| m.msg_seq == msg_seq));
    match held {
        Some(m) if m.state == "recalled" => ": (recalled placeholder)".into(),
        Some(m) if m.kind == "recall" => format!(": recalls #{}", m.content["target_msg_seq"]),
        Some(m) => m.content.get("text").map(|t| format!(": {t}")).unwrap_or_default(),
        None => String::new(),
    }
}

impl Timeline {
    fn line(&self, who: &str, text: &str) {
        println!("[{:>5} ms] {who:<12} {text}", self.started.elapsed().as_millis());
    }

    fn step(&self, title: &str) {
        println!();
        println!("== {title}");
    }

    fn note(&self, who: &str, text: &str) {
        self.line(who, text);
    }

    async fn change(&self, who: &str, client: &Weak<Client>, change: &Change) {
        if self.done.load(Ordering::Relaxed) {
            return;
        }
        let sync_side = matches!(
            change,
            Change::Hint { .. }
                | Change::PageApplied(_)
                | Change::Acked { .. }
                | Change::CursorMoved(_)
                | Change::Gap(_)
        );
        if sync_side && self.senders_only.contains(who) {
            return;
        }
        for text in self.describe(who, client, change).await {
            self.line(who, &text);
        }
    }

    /// The lines one change prints (none for those the story leaves out).
    async fn describe(&self, who: &str, client: &Weak<Client>, change: &Change) -> Vec<String> {
        let text = match change {
            Change::State(s) => {
                let mut states = self.states.lock().expect("timeline lock");
                let last = states.get(who).copied().unwrap_or(ConnState::Offline);
                // Syncing and ready flip on every sync round (the pages
                // say more), and the story says when a device goes
                // offline: print ready once per connection.
                states.insert(who.to_owned(), *s);
                if *s != ConnState::Ready || last == ConnState::Ready {
                    return Vec::new();
                }
                "connected and caught up".to_string()
            }
            Change::Hint { high_watermark, reason } => {
                format!("hint: the log reached sync_seq {high_watermark} ({reason}); syncing")
            }
            Change::GroupPulled { conv, last_msg_seq, cleared } => format!(
                "large group {}: pulled by conv.sync up to #{last_msg_seq}, committed; marker {}",
                short(conv),
                if *cleared { "cleared" } else { "moved meanwhile, pulling again" }
            ),
            Change::PageApplied(p) if p.applied == 0 => format!(
                "sync page (resume_from {}, watermark {}): {} event(s) already applied, skipped",
                p.resume_from, p.batch_high_watermark, p.skipped
            ),
            Change::PageApplied(p) => {
                let mut lines = vec![format!(
                    "sync page (generation {}, resume_from {}, watermark {}): applied sync_seq {}..={} in one transaction",
                    p.sync_generation,
                    p.resume_from,
                    p.batch_high_watermark,
                    p.first_sync_seq.unwrap_or_default(),
                    p.last_sync_seq.unwrap_or_default()
                )];
                for m in &p.messages {
                    let what = if m.kind == "text" { String::new() } else { format!(" ({})", m.kind) };
                    let text = text_at(client, &m.conv, m.msg_seq).await;
                    lines.push(format!(
                        "  sync_seq {} = {}#{} from {}{what}{text}",
                        m.sync_seq,
                        short(&m.conv),
                        m.msg_seq,
                        m.sender
                    ));
                }
                for (conv, read_seq) in &p.reads {
                    lines.push(format!("  read event: {} read up to #{read_seq}", short(conv)));
                }
                return lines;
            }
            Change::Acked { sync_seq, acked_sync_seq, generation } => {
                format!("ACK sync_seq {sync_seq} (server ACK now {acked_sync_seq}, generation {generation})")
            }
            Change::Reset { generation } => {
                format!("RESET_REQUIRED: rebuilding from a snapshot, generation {generation:?}")
            }
            Change::SnapshotStarted { generation, base_sync_seq, pages, resumed } => format!(
                "snapshot {}: base {base_sync_seq}, {pages} page(s), generation {generation}",
                if *resumed { "resumed" } else { "started" }
            ),
            Change::SnapshotPage { fetched, pages, items } => {
                format!("snapshot page {fetched}/{pages} ({items} items)")
            }
            Change::SnapshotInstalled { base_sync_seq, conversations, messages, .. } => format!(
                "snapshot installed: {conversations} conversation(s), {messages} event(s), at sync_seq {base_sync_seq}"
            ),
            Change::SnapshotFailed { reason, retrying } => {
                format!("snapshot failed: {reason}{}", if *retrying { "; retrying" } else { "" })
            }
            // The acceptance says it all (every operation here is online).
            Change::OutboxQueued { .. } => return Vec::new(),
            Change::OutboxAccepted { op: OutboxOp::Send, conv, msg_seq, duplicate, client_msg_id, .. } => format!(
                "send accepted: {}#{msg_seq} ({}{}){}",
                short(conv),
                short(client_msg_id),
                if *duplicate { ", duplicate of an earlier send" } else { "" },
                text_at(client, conv, *msg_seq).await
            ),
            Change::OutboxAccepted { op: OutboxOp::Recall, conv, msg_seq, .. } => {
                format!("recall accepted: recall event {}#{msg_seq}", short(conv))
            }
            Change::OutboxAccepted { op: OutboxOp::Read, conv, msg_seq, .. } => {
                format!("read accepted: {} read up to #{msg_seq}", short(conv))
            }
            Change::OutboxFailed { op, error, .. } => format!("{} failed: {error}", op.as_str()),
            Change::Recalled { conv, msg_seq } => format!("{}#{msg_seq} is now a recalled placeholder", short(conv)),
            Change::ReadMoved { conv, read_seq } => format!("read position {}: {read_seq}", short(conv)),
            Change::CursorMoved(m) => format!("cursor {}: {} -> {}", short(&m.conv), m.from, m.to),
            Change::Gap(g) => format!(
                "gap in {}: cursor at {}, missing {}..={}; sync requested",
                short(&g.conv),
                g.contiguous_msg_seq,
                g.missing_from,
                g.missing_to
            ),
            Change::Kicked { reason } => format!("kicked: {reason}"),
            Change::Lagged { missed } => format!("({missed} notifications missed)"),
            Change::RepairQueued { conv, from_msg_seq } => {
                format!("{} needs repair from #{from_msg_seq}; the rest syncs on", short(conv))
            }
            Change::RepairFailed { conv, attempts, retry_in_ms, .. } => {
                format!("repair of {} failed ({attempts}x); retry in {retry_in_ms} ms", short(conv))
            }
            Change::Repaired { conv } => format!("{} repaired", short(conv)),
            // The story says when a device stops; it tells the durable
            // state of conversations, not the ephemeral lane's typing and
            // presence, nor the user's privacy switches.
            Change::Exited(Exit::Stopped)
            | Change::Typing { .. }
            | Change::Presence { .. }
            | Change::PrivacyChanged(_) => return Vec::new(),
            Change::Exited(exit) => format!("engine stopped: {exit:?}"),
        };
        vec![text]
    }
}
