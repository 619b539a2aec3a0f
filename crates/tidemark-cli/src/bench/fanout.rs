//! `bench fanout`: one sender writes to a group; every other member has one
//! receiving device that stores what it receives in its own local SQLite
//! database. A delivery counts only once the receiving device has committed
//! it locally.
//!
//! Tidemark side: the sender is a bare `WsConn`, closed loop (`send`, wait
//! for `send.ok`, next). Every receiver is the real SDK, a
//! `tidemark_client::Client` with its own database file (WAL,
//! `synchronous=FULL`): it syncs on each hint, applies each sync page in one
//! local transaction and ACKs after the commit. The receiver's time stamp
//! is taken when its `Change::PageApplied` arrives on the client's change
//! stream, which the engine emits after the page's COMMIT returned. Each
//! message's content carries its send start (`t0_ns`, nanoseconds since an
//! `Instant` shared by the whole process); after the run the content is
//! read back from every receiver's local store and joined, by `msg_seq`, to
//! the commit time observed for that message, and every receiver must hold
//! exactly the messages sent.
//!
//! Measured, per run: deliveries per second (messages × receiving devices
//! over the time from the first send start to the last local commit) and
//! the latency of each delivery, from the sender starting its `send` to the
//! receiving device having committed the message locally (same process,
//! same clock). Also: local commits per delivery (how many messages a
//! device's commit carries) and hints seen by the receivers.
//!
//! The baseline, in the same round and the same process, is a bare
//! tokio-tungstenite broadcast server: the same sender loop (waits for an
//! `ok` per message), the same number of WebSocket clients, each payload
//! (the JSON a sync page carries for the message) pushed as one frame to
//! every client, with no server store, no fan-out, no hint/sync/ACK round
//! trips. Each baseline client commits what it receives to its own local
//! SQLite database with the SDK's PRAGMAs (`journal_mode=WAL`,
//! `synchronous=FULL`): it waits for a frame, takes every further frame
//! already received (at most `--limit`, like a sync page), inserts them in
//! one transaction on a blocking thread (as the SDK does) and stamps the
//! deliveries after the COMMIT, with the send start read from each frame's
//! content. So both sides pay one local fsync per batch, and the ratio is
//! the cost of the server and the protocol (with the SDK's own work per
//! page: its cursor and summary updates, the ACK, the change stream), not
//! of the local disk. Both senders are closed loops, so deliveries/s is
//! bounded by each side's per-message round trip as well as by the
//! receivers.
//!
//! Each round runs every group size on both sides (alternating which goes
//! first); the table reports the median over `--rounds` of per-round
//! deliveries/s, p50 and p99 and the median of the per-round ratios; the
//! JSON has every round.
//!
//! All receivers of a run share the process and the disk (100 databases
//! fsyncing at once on one machine, where real devices each have their own
//! disk); both sides share that handicap.
//!
//! Each run also records, per message, the time until its *last* receiver
//! committed it (`last_p50_ms`, `last_p99_ms`, in the JSON).
//!
//! `bench online` (`online.rs`) runs the same machinery ([`Shape`]) with
//! a direct conversation of two and an open-loop sender ([`Pace::Open`]).
//!
//! `--large` runs the large-group matrix instead (`large.rs`): shared and
//! per-member mode at `--large-sizes`, `--online-fraction` of the members
//! online, beside this file's baseline to as many receivers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures_util::future::{join_all, try_join_all};
use futures_util::{FutureExt, SinkExt, StreamExt};
use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use rusqlite::{params, Connection, TransactionBehavior};
use serde::Serialize;
use tidemark_client::proto::{op, ConvCreateOk, ConvCreateReq, SendReq};
use tidemark_client::{Change, Client, ClientConfig, ConnState, Http, WsConn};
use tidemark_server::{Server, ServerConfig};
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::Message;

use super::device::{bar, cheap_hash, PASSWORD};
use super::stores::{Schemas, StoreAt};
use super::{init_logs, median, print_table, TempDir};

#[derive(clap::Args, Debug, Clone)]
pub struct FanoutArgs {
    /// Group sizes, members including the sender (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![10u32, 100])]
    pub groups: Vec<u32>,
    /// Messages the sender sends to each group, one after another (each
    /// waits for its send.ok).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub messages: u32,
    /// Events per sync page (and most frames a baseline client commits at
    /// once).
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    /// Rounds; each runs every group on both sides. Medians are reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    #[arg(long, default_value = "bench-results/fanout.json")]
    pub out: PathBuf,
    /// Where the temporary stores go (must be a real disk).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Large groups instead (`large.rs`): shared mode at `--large-sizes`,
    /// per-member mode where the size allows it (up to 1,000), a fraction
    /// of the members online, beside the bare broadcast to as many
    /// receivers. Default output `bench-results/fanout-large.json`.
    #[arg(long)]
    pub large: bool,
    /// `--large`: group sizes, members including the sender.
    #[arg(long, value_delimiter = ',', default_values_t = vec![100u32, 1000, 10_000])]
    pub large_sizes: Vec<u32>,
    /// `--large`: the fraction of the members (sender excluded) online, each
    /// one SDK client with its own local database; the others are accounts
    /// and memberships only.
    #[arg(long, default_value_t = 0.1)]
    pub online_fraction: f64,
    /// `--large`: messages sent before any receiver is online, to measure
    /// the server's rows written per message without device work.
    #[arg(long, default_value_t = 20)]
    pub probe_messages: u32,
    /// Run the Tidemark side on the PostgreSQL store at this URL (each run
    /// in a fresh schema, dropped afterwards) instead of the embedded one;
    /// the receivers' local stores and the baseline are unchanged.
    #[arg(long, value_name = "postgres://…", conflicts_with = "large")]
    pub database: Option<String>,
}

pub(super) const TEXT: &str = "The quick brown fox jumps over the lazy dog; benchmark payload.";
pub(super) const LATENCY_MAX_US: u64 = 120_000_000;
pub(super) const RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// Logging in, connecting and syncing the group's creation, per run.
pub(super) const SETUP_TIMEOUT: Duration = Duration::from_secs(120);
/// The SDK's local store waits this long on a locked database; the
/// baseline's databases use the same.
const BUSY_TIMEOUT: Duration = Duration::from_millis(5_000);
/// The message kind the sender uses; group creation events are control
/// kinds, so a receiver counts exactly the sender's messages.
pub(super) const KIND: &str = "text";

/// Nanoseconds since the run's shared reference instant.
pub(super) fn since(epoch: Instant) -> u64 {
    epoch.elapsed().as_nanos() as u64
}

pub(super) fn payload(n: u64, t0_ns: u64) -> serde_json::Value {
    serde_json::json!({ "text": TEXT, "n": n, "t0_ns": t0_ns })
}

pub(super) fn latency_hist() -> Result<Histogram<u64>> {
    Ok(Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?)
}

/// Records one delivery committed at `done_ns` of a message whose send
/// started at `t0_ns`, in microseconds.
pub(super) fn record(hist: &mut Histogram<u64>, t0_ns: u64, done_ns: u64) {
    hist.saturating_record((done_ns.saturating_sub(t0_ns) / 1000).max(1));
}

/// The kind of a conversation of two, created without an event.
pub(super) const DIRECT: &str = "direct";

/// How a run's sender paces its sends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Pace {
    /// Closed loop: each send waits for the answer to the previous one
    /// (`bench fanout`).
    Closed,
    /// Open loop at a steady rate: send `n` starts `n / per_sec` seconds
    /// after the first, whatever the answers (`bench online`).
    Open { per_sec: f64 },
}

/// What one run measures, the same on both sides.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    /// Members including the sender; every other member has one receiving
    /// device.
    pub members: u32,
    pub messages: u32,
    /// Events per sync page (and most frames a baseline client commits at
    /// once).
    pub limit: u32,
    pub pace: Pace,
    /// The conversation's kind: `group`, or `direct` (two members).
    pub conv_kind: &'static str,
}

impl Shape {
    /// `bench fanout`'s run: a group of `members`, the closed-loop sender.
    pub(super) fn group(members: u32, args: &FanoutArgs) -> Shape {
        Shape { members, messages: args.messages, limit: args.limit, pace: Pace::Closed, conv_kind: "group" }
    }
}

/// Sends messages `0..messages` as `pace` says: `send(n, t0_ns)` sends
/// message `n` whose send starts at `t0_ns` (since `epoch`) and ends with
/// its answer. Open loop: each send runs in a task of its own, started on
/// schedule; all are awaited at the end.
pub(super) async fn paced<F, Fut>(pace: Pace, messages: u64, epoch: Instant, send: F) -> Result<()>
where
    F: Fn(u64, u64) -> Fut,
    Fut: std::future::Future<Output = Result<()>> + Send + 'static,
{
    match pace {
        Pace::Closed => {
            for n in 0..messages {
                send(n, since(epoch)).await?;
            }
        }
        Pace::Open { per_sec } => {
            let first = tokio::time::Instant::now();
            let mut sends = Vec::with_capacity(messages as usize);
            for n in 0..messages {
                tokio::time::sleep_until(first + Duration::from_secs_f64(n as f64 / per_sec)).await;
                sends.push(tokio::spawn(send(n, since(epoch))));
            }
            for s in sends {
                s.await.context("send task")??;
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct Run {
    members: u32,
    receivers: u32,
    messages: u32,
    deliveries: u64,
    secs: f64,
    deliveries_per_s: f64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
    /// Local transactions that committed deliveries, over all receivers.
    local_commits: u64,
    pub(super) commits_per_delivery: f64,
    /// Tidemark only: hints the receivers' clients got.
    hints: u64,
    /// Per message, the time until the last receiver committed it.
    pub(super) last_p50_ms: f64,
    pub(super) last_p99_ms: f64,
}

struct Tally {
    hist: Histogram<u64>,
    /// Per message, until its last receiver's commit.
    last: Histogram<u64>,
    /// Nanoseconds from the first send start to the last local commit.
    span_ns: u64,
    commits: u64,
    hints: u64,
}

fn finish(members: u32, messages: u32, t: Tally) -> Run {
    let deliveries = t.hist.len();
    let secs = t.span_ns as f64 / 1e9;
    let ms = |q: f64| t.hist.value_at_quantile(q) as f64 / 1000.0;
    Run {
        members,
        receivers: members - 1,
        messages,
        deliveries,
        secs,
        deliveries_per_s: deliveries as f64 / secs.max(f64::MIN_POSITIVE),
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        max_ms: t.hist.max() as f64 / 1000.0,
        local_commits: t.commits,
        commits_per_delivery: t.commits as f64 / deliveries.max(1) as f64,
        hints: t.hints,
        last_p50_ms: t.last.value_at_quantile(0.5) as f64 / 1000.0,
        last_p99_ms: t.last.value_at_quantile(0.99) as f64 / 1000.0,
    }
}

/// What one SDK receiver saw on its change stream during the run.
struct Observed {
    /// `(msg_seq, ns)`: a sender's message and when its page's local commit
    /// was observed.
    committed: Vec<(u64, u64)>,
    commits: u64,
    hints: u64,
}

/// Follows one SDK client's change stream until it has observed the local
/// commit of `messages` messages of the sender.
async fn observe(
    mut changes: tidemark_client::Changes,
    messages: u64,
    epoch: Instant,
    pb: ProgressBar,
) -> Result<Observed> {
    let mut seen = Observed { committed: Vec::with_capacity(messages as usize), commits: 0, hints: 0 };
    while (seen.committed.len() as u64) < messages {
        match changes.recv().await {
            // Emitted by the engine after the page's COMMIT returned.
            Some(Change::PageApplied(report)) => {
                let now = since(epoch);
                let before = seen.committed.len();
                seen.committed.extend(report.messages.iter().filter(|m| m.kind == KIND).map(|m| (m.msg_seq, now)));
                let new = (seen.committed.len() - before) as u64;
                if new > 0 {
                    seen.commits += 1;
                    pb.inc(new);
                }
            }
            Some(Change::Hint { .. }) => seen.hints += 1,
            Some(Change::Lagged { missed }) => {
                bail!("receiver missed {missed} change notifications; its commit times are lost")
            }
            Some(Change::Exited(exit)) => bail!("receiver client exited: {exit:?}"),
            Some(_) => {}
            None => bail!("receiver client gone"),
        }
    }
    Ok(seen)
}

/// One Tidemark run of `shape`: on a fresh embedded store, or on a fresh
/// schema of `schemas`' database (named after `label`).
pub(super) async fn tidemark_run(
    parent: &Path,
    schemas: Option<&Schemas>,
    label: &str,
    shape: &Shape,
    pb: &ProgressBar,
) -> Result<Run> {
    let dir = TempDir::create(parent)?;
    match schemas {
        None => tidemark_run_on(&dir, &StoreAt::Dir(dir.0.join("server")), shape, pb).await,
        Some(schemas) => {
            let dir = &dir;
            schemas
                .run(label, |schema| async move { tidemark_run_on(dir, &schemas.at(&schema), shape, pb).await })
                .await
        }
    }
}

async fn tidemark_run_on(dir: &TempDir, at: &StoreAt, shape: &Shape, pb: &ProgressBar) -> Result<Run> {
    let members = shape.members;
    let devices_dir = dir.0.join("devices");
    std::fs::create_dir_all(&devices_dir)?;
    let store = at.open().await?;
    let hash = cheap_hash()?;
    let users: Vec<String> = (0..members).map(|i| format!("fan-u{i}")).collect();
    for u in &users {
        store.create_user(u, &hash, 0).await?;
    }
    let config = ServerConfig {
        retention: None,
        limits: tidemark_server::limits::LimitsConfig::off(),
        ..ServerConfig::default()
    };
    let server = Server::start("127.0.0.1:0", store.clone(), config).await?;
    let url = server.url();
    let ws_url = format!("ws://{}/v1/ws", server.addr);
    let result = tidemark_measure(&url, &ws_url, &users, &devices_dir, shape, pb).await;
    server.stop().await;
    at.close(store).await;
    result
}

async fn tidemark_measure(
    url: &str,
    ws_url: &str,
    users: &[String],
    devices_dir: &Path,
    shape: &Shape,
    pb: &ProgressBar,
) -> Result<Run> {
    let members = shape.members;
    let login = Http::new(url).login(&users[0], PASSWORD, "phone").await.context("log in the sender")?;
    let (sender, _sender_events) = WsConn::connect(ws_url, &login.access_token).await.context("connect the sender")?;

    let mut clients = Vec::new();
    for u in &users[1..] {
        let mut config =
            ClientConfig::new(url, u, "phone", devices_dir.join(format!("{u}.db"))).with_password(PASSWORD);
        config.sync_page_limit = shape.limit;
        clients.push(Client::open(config).with_context(|| format!("open the client of {u}"))?);
    }
    let result: Result<Run> = async {
        for c in &clients {
            c.start().await?;
        }
        try_join_all(clients.iter().map(|c| c.wait_state(ConnState::Ready, SETUP_TIMEOUT)))
            .await
            .context("receivers ready")?;
        let conv: ConvCreateOk = sender
            .request(
                op::CONV_CREATE,
                &ConvCreateReq { kind: shape.conv_kind.into(), members: users[1..].to_vec(), client_msg_id: None },
            )
            .await
            .context("create the conversation")?;
        let conv = conv.conv;
        // Every receiver holds the group (its creation events committed)
        // before the first send. A direct conversation's creation writes no
        // event: its receiver learns of it with the first message.
        if shape.conv_kind != DIRECT {
            try_join_all(clients.iter().map(|c| {
                let conv = &conv;
                c.wait_for(SETUP_TIMEOUT, move || async move { Ok(c.conversation(conv).await?.is_some()) })
            }))
            .await
            .context("receivers see the group")?;
        }

        let messages = u64::from(shape.messages);
        let epoch = Instant::now();
        let tasks: Vec<_> =
            clients.iter().map(|c| tokio::spawn(observe(c.subscribe(), messages, epoch, pb.clone()))).collect();
        let start = since(epoch);
        paced(shape.pace, messages, epoch, |n, t0| {
            let (sender, conv) = (sender.clone(), conv.clone());
            async move {
                let req = SendReq {
                    conv,
                    client_msg_id: format!("fan-{members}-{n}"),
                    kind: KIND.into(),
                    content: payload(n, t0),
                    mentions: Vec::new(),
                    mention_all: false,
                };
                sender.send(&req).await.with_context(|| format!("send {n}"))?;
                Ok(())
            }
        })
        .await?;
        let seen = tokio::time::timeout(RUN_TIMEOUT, try_join_all(tasks)).await.context("receivers timed out")??;

        // The send start of each delivery, from the content each receiver
        // committed to its local store.
        let mut tally = Tally { hist: latency_hist()?, last: latency_hist()?, span_ns: 0, commits: 0, hints: 0 };
        let mut last = start;
        // msg_seq -> (send start, the last receiver's commit).
        let mut per_message: HashMap<u64, (u64, u64)> = HashMap::new();
        for (c, seen) in clients.iter().zip(seen) {
            let seen = seen?;
            let stored = c.messages(&conv).await?;
            ensure!(stored.len() as u64 == messages, "a receiver holds {} of {messages} messages", stored.len());
            let t0_of: HashMap<u64, u64> = stored
                .iter()
                .map(|m| Ok((m.msg_seq, m.content["t0_ns"].as_u64().context("content without t0_ns")?)))
                .collect::<Result<_>>()?;
            let mut seqs: Vec<u64> = seen.committed.iter().map(|&(seq, _)| seq).collect();
            seqs.sort_unstable();
            seqs.dedup();
            ensure!(
                seqs.len() as u64 == messages,
                "a receiver observed {} distinct of {messages} messages",
                seqs.len()
            );
            for &(msg_seq, done) in &seen.committed {
                let t0 = *t0_of.get(&msg_seq).with_context(|| format!("msg_seq {msg_seq} not in the local store"))?;
                record(&mut tally.hist, t0, done);
                last = last.max(done);
                let slot = per_message.entry(msg_seq).or_insert((t0, done));
                slot.1 = slot.1.max(done);
            }
            tally.commits += seen.commits;
            tally.hints += seen.hints;
        }
        for (t0, done) in per_message.values() {
            record(&mut tally.last, *t0, *done);
        }
        tally.span_ns = last - start;
        Ok(finish(members, shape.messages, tally))
    }
    .await;
    join_all(clients.iter().map(|c| c.stop())).await;
    drop(sender);
    result
}

/// The bare broadcast server: a connection whose first frame is `sub`
/// receives every payload; one whose first frame is `pub` sends payloads,
/// each answered by `ok` once it has been queued to every subscriber.
async fn baseline_server() -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, _) = tokio::sync::broadcast::channel::<Message>(100_000);
    let handle = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(ws) = tokio_tungstenite::accept_async(tcp).await else { return };
                let (mut sink, mut stream) = ws.split();
                let Some(Ok(Message::Text(first))) = stream.next().await else { return };
                if first.as_str() == "sub" {
                    let mut rx = tx.subscribe();
                    if sink.send(Message::Text("ready".into())).await.is_err() {
                        return;
                    }
                    while let Ok(m) = rx.recv().await {
                        if sink.send(m).await.is_err() {
                            return;
                        }
                    }
                } else {
                    while let Some(Ok(m)) = stream.next().await {
                        if let Message::Text(_) = m {
                            let _ = tx.send(m);
                            if sink.send(Message::Text("ok".into())).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    Ok((addr, handle))
}

/// One received message, as a baseline client stores it.
struct Row {
    sync_seq: u64,
    conv: String,
    msg_seq: u64,
    message_id: String,
    sender: String,
    kind: String,
    content: String,
    created_at: i64,
    t0_ns: u64,
}

impl Row {
    fn parse(text: &str) -> Result<Row> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        let m = v.get("message").context("frame without message")?;
        let s = |key: &str| m[key].as_str().map(str::to_owned).with_context(|| format!("frame without {key}"));
        Ok(Row {
            sync_seq: v["sync_seq"].as_u64().context("frame without sync_seq")?,
            conv: s("conv")?,
            msg_seq: m["msg_seq"].as_u64().context("frame without msg_seq")?,
            message_id: s("message_id")?,
            sender: s("sender")?,
            kind: s("kind")?,
            content: m["content"].to_string(),
            created_at: m["created_at"].as_i64().unwrap_or(0),
            t0_ns: m["content"]["t0_ns"].as_u64().context("frame without t0_ns")?,
        })
    }
}

/// A baseline client's local database, with the PRAGMAs of the SDK's store.
fn open_local(path: &Path) -> Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    ensure!(mode.eq_ignore_ascii_case("wal"), "journal_mode is {mode}, not wal");
    conn.execute_batch(
        "PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;
         CREATE TABLE device (id INTEGER PRIMARY KEY CHECK (id = 1), applied_sync_seq INTEGER NOT NULL);
         INSERT INTO device (id, applied_sync_seq) VALUES (1, 0);
         CREATE TABLE messages (
             conv TEXT NOT NULL, msg_seq INTEGER NOT NULL, message_id TEXT NOT NULL, sender TEXT NOT NULL,
             kind TEXT NOT NULL, content TEXT NOT NULL, created_at INTEGER NOT NULL, sync_seq INTEGER NOT NULL,
             PRIMARY KEY (conv, msg_seq)
         );",
    )?;
    Ok(conn)
}

/// One transaction for the frames received together.
fn commit_batch(conn: &mut Connection, rows: &[Row]) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut insert = tx.prepare_cached(
            "INSERT OR IGNORE INTO messages (conv, msg_seq, message_id, sender, kind, content, created_at, sync_seq)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?;
        for r in rows {
            insert.execute(params![
                r.conv,
                r.msg_seq as i64,
                r.message_id,
                r.sender,
                r.kind,
                r.content,
                r.created_at,
                r.sync_seq as i64
            ])?;
        }
    }
    let top = rows.iter().map(|r| r.sync_seq).max().unwrap_or(0);
    tx.execute("UPDATE device SET applied_sync_seq = MAX(applied_sync_seq, ?1) WHERE id = 1", params![top as i64])?;
    tx.commit()?;
    Ok(())
}

pub(super) async fn baseline_run(parent: &Path, shape: &Shape, pb: &ProgressBar) -> Result<Run> {
    let dir = TempDir::create(parent)?;
    let (addr, server) = baseline_server().await?;
    let result = baseline_measure(&dir.0, addr, shape, pb).await;
    server.abort();
    result
}

async fn baseline_measure(dir: &Path, addr: std::net::SocketAddr, shape: &Shape, pb: &ProgressBar) -> Result<Run> {
    let members = shape.members;
    let url = format!("ws://{addr}/");
    let messages = u64::from(shape.messages);
    let batch_max = shape.limit.max(1) as usize;
    let epoch = Instant::now();
    let mut tasks = Vec::new();
    let mut readies = Vec::new();
    for i in 1..members {
        let mut conn = open_local(&dir.join(format!("b{i}.db")))?;
        let (ws, _) = tokio_tungstenite::connect_async_with_config(url.as_str(), None, true).await?;
        let (mut sink, mut stream) = ws.split();
        sink.send(Message::Text("sub".into())).await?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
        readies.push(ready_rx);
        let pb = pb.clone();
        tasks.push(tokio::spawn(async move {
            let mut hist = latency_hist()?;
            let mut ready_tx = Some(ready_tx);
            let (mut got, mut commits, mut last) = (0u64, 0u64, 0u64);
            // (msg_seq, send start, commit) of every delivery.
            let mut done: Vec<(u64, u64, u64)> = Vec::with_capacity(messages as usize);
            while got < messages {
                let Some(msg) = stream.next().await else { bail!("baseline client: closed") };
                let Message::Text(text) = msg? else { continue };
                if text.as_str() == "ready" {
                    if let Some(r) = ready_tx.take() {
                        let _ = r.send(());
                    }
                    continue;
                }
                // This frame and every one already received, like a sync
                // page takes what is there (at most --limit).
                let mut rows = vec![Row::parse(text.as_str())?];
                while rows.len() < batch_max {
                    match stream.next().now_or_never() {
                        Some(Some(Ok(Message::Text(t)))) => rows.push(Row::parse(t.as_str())?),
                        Some(Some(Ok(_))) => {}
                        Some(Some(Err(e))) => return Err(e.into()),
                        Some(None) | None => break,
                    }
                }
                let (c, rows) =
                    tokio::task::spawn_blocking(move || commit_batch(&mut conn, &rows).map(|()| (conn, rows)))
                        .await
                        .context("local commit task")??;
                conn = c;
                let now = since(epoch);
                for r in &rows {
                    record(&mut hist, r.t0_ns, now);
                    done.push((r.msg_seq, r.t0_ns, now));
                }
                got += rows.len() as u64;
                commits += 1;
                last = now;
                pb.inc(rows.len() as u64);
            }
            drop(sink);
            let held: i64 = conn.query_row("SELECT COUNT(*) FROM messages", [], |r| r.get(0))?;
            ensure!(held as u64 == messages, "a baseline client holds {held} of {messages} messages");
            Ok((hist, commits, last, done))
        }));
    }
    for r in readies {
        r.await.context("subscriber not ready")?;
    }
    let (ws, _) = tokio_tungstenite::connect_async_with_config(url.as_str(), None, true).await?;
    let (mut sink, mut stream) = ws.split();
    sink.send(Message::Text("pub".into())).await?;
    // Each `ok` the server answers is one permit: a send ends once it took
    // one (they come in send order, one per payload).
    let oks = Arc::new(tokio::sync::Semaphore::new(0));
    let reader = tokio::spawn({
        let oks = oks.clone();
        async move {
            while let Some(Ok(m)) = stream.next().await {
                if matches!(&m, Message::Text(t) if t.as_str() == "ok") {
                    oks.add_permits(1);
                }
            }
            // Closed: every waiting send fails.
            oks.close();
        }
    });
    let sink = Arc::new(tokio::sync::Mutex::new(sink));
    let start = since(epoch);
    let sent = paced(shape.pace, messages, epoch, |n, t0| {
        let (sink, oks) = (sink.clone(), oks.clone());
        async move {
            // The same JSON a sync page carries for this message.
            let event = serde_json::json!({
                "sync_seq": n + 1, "kind": "message", "conv": "g-baseline", "msg_seq": n + 1,
                "message": {
                    "message_id": format!("m{n:012}"), "conv": "g-baseline", "msg_seq": n + 1, "kind": KIND,
                    "state": "normal", "sender": "fan-u0", "content": payload(n, t0), "created_at": 0, "version": 0,
                }
            });
            sink.lock().await.send(Message::Text(event.to_string().into())).await?;
            oks.acquire().await.context("baseline sender: closed")?.forget();
            Ok(())
        }
    })
    .await;
    reader.abort();
    sent?;
    let results = tokio::time::timeout(RUN_TIMEOUT, try_join_all(tasks)).await.context("baseline timed out")??;
    let mut tally = Tally { hist: latency_hist()?, last: latency_hist()?, span_ns: 0, commits: 0, hints: 0 };
    let mut last = start;
    let mut per_message: HashMap<u64, (u64, u64)> = HashMap::new();
    for r in results {
        let (h, commits, l, done) = r?;
        tally.hist.add(&h)?;
        tally.commits += commits;
        last = last.max(l);
        for (msg_seq, t0, at) in done {
            let slot = per_message.entry(msg_seq).or_insert((t0, at));
            slot.1 = slot.1.max(at);
        }
    }
    for (t0, at) in per_message.values() {
        record(&mut tally.last, *t0, *at);
    }
    tally.span_ns = last - start;
    Ok(finish(members, shape.messages, tally))
}

#[derive(Debug, Clone, Serialize)]
struct Ratios {
    /// tidemark / baseline: below 1 is slower.
    deliveries_per_s: f64,
    /// tidemark / baseline: above 1 is slower.
    p50: f64,
    p99: f64,
}

fn ratios(s: &Run, b: &Run) -> Ratios {
    let r = |a: f64, b: f64| a / b.max(f64::MIN_POSITIVE);
    Ratios {
        deliveries_per_s: r(s.deliveries_per_s, b.deliveries_per_s),
        p50: r(s.p50_ms, b.p50_ms),
        p99: r(s.p99_ms, b.p99_ms),
    }
}

#[derive(Debug, Clone, Serialize)]
struct RoundRun {
    round: u32,
    members: u32,
    tidemark: Run,
    baseline: Run,
    tidemark_over_baseline: Ratios,
}

/// Medians over rounds of the per-round figures.
#[derive(Debug, Clone, Serialize)]
struct Medians {
    deliveries: u64,
    deliveries_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    pub(super) commits_per_delivery: f64,
}

fn medians(runs: &[&Run]) -> Medians {
    let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(|r| f(r)).collect());
    Medians {
        deliveries: runs.first().map_or(0, |r| r.deliveries),
        deliveries_per_s: m(&|r| r.deliveries_per_s),
        p50_ms: m(&|r| r.p50_ms),
        p99_ms: m(&|r| r.p99_ms),
        max_ms: m(&|r| r.max_ms),
        commits_per_delivery: m(&|r| r.commits_per_delivery),
    }
}

#[derive(Debug, Clone, Serialize)]
struct GroupSummary {
    members: u32,
    rounds: u32,
    tidemark: Medians,
    baseline: Medians,
    /// Medians of the per-round ratios (each round's pair ran back to back).
    tidemark_over_baseline: Ratios,
}

fn summarize(members: u32, runs: &[&RoundRun]) -> GroupSummary {
    let m = |f: &dyn Fn(&Ratios) -> f64| median(runs.iter().map(|r| f(&r.tidemark_over_baseline)).collect());
    GroupSummary {
        members,
        rounds: runs.len() as u32,
        tidemark: medians(&runs.iter().map(|r| &r.tidemark).collect::<Vec<_>>()),
        baseline: medians(&runs.iter().map(|r| &r.baseline).collect::<Vec<_>>()),
        tidemark_over_baseline: Ratios {
            deliveries_per_s: m(&|r| r.deliveries_per_s),
            p50: m(&|r| r.p50),
            p99: m(&|r| r.p99),
        },
    }
}

pub async fn run(args: FanoutArgs) -> Result<()> {
    init_logs();
    if args.large {
        return super::large::run(args).await;
    }
    for &m in &args.groups {
        ensure!(m >= 2, "a group needs at least 2 members");
    }
    ensure!(
        (1..=tidemark_client::proto::SYNC_LIMIT_MAX).contains(&args.limit),
        "--limit must be 1..={}",
        tidemark_client::proto::SYNC_LIMIT_MAX
    );
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let schemas = match &args.database {
        Some(url) => Some(Schemas::connect(url).await?),
        None => None,
    };
    let per_round: u64 = args.groups.iter().map(|&m| 2 * u64::from(m - 1) * u64::from(args.messages)).sum();
    let pb = bar(per_round * u64::from(args.rounds), "deliveries");
    let mut runs: Vec<RoundRun> = Vec::new();
    for round in 1..=args.rounds {
        for &members in &args.groups {
            // Alternate which side goes first, so neither always runs on a
            // disk still busy with the other's writes.
            let tidemark_first = round % 2 == 1;
            let mut tidemark = None;
            let mut baseline = None;
            for side in 0..2 {
                if (side == 0) == tidemark_first {
                    pb.set_message(format!("round {round}: tidemark, {members}"));
                    let label = format!("r{round}_m{members}");
                    let shape = Shape::group(members, &args);
                    tidemark = Some(tidemark_run(&parent, schemas.as_ref(), &label, &shape, &pb).await?);
                } else {
                    pb.set_message(format!("round {round}: baseline, {members}"));
                    baseline = Some(baseline_run(&parent, &Shape::group(members, &args), &pb).await?);
                }
            }
            let (tidemark, baseline) = (tidemark.context("tidemark run")?, baseline.context("baseline run")?);
            let tidemark_over_baseline = ratios(&tidemark, &baseline);
            runs.push(RoundRun { round, members, tidemark, baseline, tidemark_over_baseline });
        }
    }
    pb.finish_and_clear();
    let summaries: Vec<GroupSummary> = args
        .groups
        .iter()
        .map(|&m| summarize(m, &runs.iter().filter(|r| r.members == m).collect::<Vec<_>>()))
        .collect();

    let backend = if schemas.is_some() { "postgres" } else { "sqlite" };
    println!(
        "tidemark bench fanout ({backend} server store): one sender, {} messages per group (closed loop), every \
         other member one device \
         with its own local SQLite store (WAL, synchronous=FULL); tidemark receivers are SDK clients (sync on \
         hint, one transaction per page, ACK after commit), baseline receivers commit each batch of frames \
         received together in one transaction; latency = sender's send start -> receiving device's local \
         COMMIT; medians of {} rounds\n",
        args.messages, args.rounds
    );
    let mut rows = Vec::new();
    for s in &summaries {
        for (name, r) in [("tidemark", &s.tidemark), ("baseline", &s.baseline)] {
            rows.push(vec![
                format!("{} ({} members)", name, s.members),
                format!("{}", r.deliveries),
                format!("{:.0}", r.deliveries_per_s),
                format!("{:.2}", r.p50_ms),
                format!("{:.2}", r.p99_ms),
                format!("{:.2}", r.max_ms),
                format!("{:.2}", r.commits_per_delivery),
            ]);
        }
        let q = &s.tidemark_over_baseline;
        rows.push(vec![
            format!("tidemark/baseline ({})", s.members),
            String::new(),
            format!("{:.3}", q.deliveries_per_s),
            format!("{:.1}x", q.p50),
            format!("{:.1}x", q.p99),
            String::new(),
            String::new(),
        ]);
    }
    print_table(
        &["run (median of rounds)", "deliveries", "deliveries/s", "p50 ms", "p99 ms", "max ms", "commits/delivery"],
        &rows,
    );
    println!();
    let mut rows = Vec::new();
    for r in &runs {
        for (name, x) in [("tidemark", &r.tidemark), ("baseline", &r.baseline)] {
            rows.push(vec![
                format!("{} ({} members)", name, r.members),
                format!("{}", r.round),
                format!("{:.0}", x.deliveries_per_s),
                format!("{:.2}", x.p50_ms),
                format!("{:.2}", x.p99_ms),
                format!("{:.2}", x.max_ms),
                format!("{:.2}", x.commits_per_delivery),
            ]);
        }
    }
    print_table(&["per round", "round", "deliveries/s", "p50 ms", "p99 ms", "max ms", "commits/delivery"], &rows);
    println!("\nratios are medians of the per-round ratios (each round's pair runs back to back)");
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "fanout",
        "server_store": backend,
        "note": "every receiving device commits to its own local SQLite (WAL, synchronous=FULL) before a delivery \
                 counts; tidemark receivers are tidemark_client::Client (one transaction per sync page, time stamp \
                 at Change::PageApplied, send start read back from the committed content); baseline = bare \
                 tokio-tungstenite broadcast server in the same process, same sender loop, same payload JSON, one \
                 frame per message per client, each client committing the frames received together in one \
                 transaction; latency from send start to the receiving device's local COMMIT; summaries are \
                 medians over rounds, ratios medians of per-round ratios",
        "messages": args.messages, "limit": args.limit, "rounds": args.rounds,
        "summary": summaries,
        "runs": runs,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}
