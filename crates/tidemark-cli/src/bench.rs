//! Benchmarks. Each prints a table on stdout and writes the same figures as
//! JSON.
//!
//! `bench ingest` measures durable ingest: concurrent WebSocket senders in a
//! closed loop against an in-process server on the embedded SQLite store,
//! next to a baseline measured in the same run on the same disk (plain
//! SQLite inserts at the batch size the server achieved, and the disk's raw
//! single-commit rate). The machine may be shared and noisy, so the server
//! measurement and the baseline alternate over several rounds and the
//! summary reports medians.
//!
//! With `--database postgres://…` the same senders run against a server on
//! the PostgreSQL store, beside a baseline of plain INSERTs (see `pg`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures_util::future::try_join_all;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use rand::Rng;
use rusqlite::{params, Connection, TransactionBehavior};
use serde::Serialize;
use tidemark_client::proto::SendReq;
use tidemark_client::{Http, WsConn};
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

mod bigaccount;
mod connections;
mod depth;
mod device;
mod fanout;
mod flood;
mod floor;
mod large;
mod maintenance;
mod online;
mod pg;
mod presence;
mod proc;
mod push;
mod reconnect;
mod stores;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Durable ingest: closed-loop WebSocket senders against an in-process
    /// server, next to a plain-SQLite baseline measured in the same run.
    Ingest(IngestArgs),
    /// Sync page latency with a short and a long user log (D2 reads by
    /// index range, so depth must not matter): the short log is the
    /// baseline of the same run.
    Depth(depth::DepthArgs),
    /// A new device of a big account (10^6 events over 1,000
    /// conversations): RESET_REQUIRED and a snapshot, timed until ready,
    /// beside a new device of a small account of the same run.
    Bigaccount(bigaccount::BigAccountArgs),
    /// Group fan-out: one sender, every other member one device syncing
    /// on hints; deliveries/s and end-to-end latency beside a bare
    /// tokio-tungstenite broadcast baseline of the same run.
    Fanout(fanout::FanoutArgs),
    /// Online latency (issue 19): one direct conversation, a sender at a
    /// steady open-loop rate, the other device an SDK client syncing on
    /// hints; p50, p99 and p99/p50 to its local commit beside the bare
    /// broadcast of the same run.
    Online(online::OnlineArgs),
    /// Resume storm: devices each K events behind reconnect at once to a
    /// restarted server and catch up, beside bare handshakes of the same
    /// devices against the same server.
    Reconnect(reconnect::ReconnectArgs),
    /// Server RSS per idle authenticated WebSocket (`tidemark serve` as a
    /// child process), beside a bare tokio-tungstenite server.
    Connections(connections::ConnectionsArgs),
    /// Presence and typing storm (issue 18): ephemeral frames/s and the p99
    /// of a concurrent send and sync page, beside a quiet phase of the same
    /// run.
    Presence(presence::PresenceArgs),
    /// Login and send floods (issue 15): an honest user's login and send
    /// p99 and the server's peak RSS under attack, beside a quiet phase of
    /// the same run.
    Flood(flood::FloodArgs),
    /// Internal: the attacker's process of `bench flood`.
    #[command(hide = true)]
    FloodAttack(flood::AttackArgs),
    /// Maintenance off the critical path (issue 16): a send's p99 while
    /// the retention pass, the unread rebuild and reconciliation run in
    /// their bounded chunks on a large population, beside a quiet phase of
    /// the same run.
    Maintenance(maintenance::MaintenanceArgs),
    /// Offline push under load (issue 20): N offline devices with webhook
    /// targets on a receiver in this process, a burst into their groups;
    /// notifications/s, send.ok-to-accept p50/p99, coalescing, and an honest
    /// sender's send p99 beside the same without push, with a throttling
    /// drill.
    Push(push::PushArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct IngestArgs {
    /// Concurrent WebSocket senders (one device each).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub senders: u32,
    /// Messages per sender, sent one after another (each waits for its
    /// send.ok) [default: 500; with --database: 50, to keep the run short].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub messages: Option<u32>,
    /// Direct conversations the senders write to (two users each).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub conversations: u32,
    /// Rounds; the server measurement and the baseline alternate and the
    /// summary reports medians.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Where to write the JSON results (the parent directory is created).
    #[arg(long, default_value = "bench-results/ingest.json")]
    pub out: PathBuf,
    /// Directory under which the temporary databases are created (default:
    /// the system temp dir). It must be on the disk to measure: on a tmpfs
    /// fsync is free and the figures say nothing about durability cost.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Run against a server on the PostgreSQL store at this URL instead
    /// (each round in a fresh schema, dropped afterwards), beside a baseline
    /// of plain INSERTs by as many concurrent clients as senders.
    #[arg(long, value_name = "postgres://…")]
    pub database: Option<String>,
    /// With --database: the store's conversation writer connections, each
    /// owning a hash partition of the conversations.
    #[arg(long, default_value_t = tidemark_postgres::CONV_WRITERS_DEFAULT as u16, requires = "database",
          value_parser = clap::value_parser!(u16).range(1..=tidemark_postgres::CONV_WRITERS_MAX as i64))]
    pub conv_writers: u16,
    /// With --database: run N `tidemark serve` processes on the database
    /// (each round's schema) instead of one in-process server, sender i on
    /// node i mod N, and sample where the time goes (PostgreSQL wait
    /// events, node and backend CPU).
    #[arg(long, requires = "database", value_parser = clap::value_parser!(u16).range(1..=NODES_MAX as i64))]
    pub nodes: Option<u16>,
    /// With --nodes: the nodes share this NATS server (a subject prefix per
    /// round), so hints cross nodes and each send is routed to its
    /// conversation's owner node (issue 14); without it every node writes
    /// what it receives.
    #[arg(long, requires = "nodes", value_name = "nats://…")]
    pub nats: Option<String>,
}

/// Most `tidemark serve` processes `bench ingest --database --nodes` runs.
pub const NODES_MAX: u16 = 8;

/// Default messages per sender on the embedded store and on PostgreSQL.
const MESSAGES_DEFAULT: u32 = 500;
const MESSAGES_DEFAULT_POSTGRES: u32 = 50;

impl IngestArgs {
    /// Messages per sender: the flag, or the default for the store.
    fn messages(&self) -> u32 {
        self.messages.unwrap_or(if self.database.is_some() { MESSAGES_DEFAULT_POSTGRES } else { MESSAGES_DEFAULT })
    }
}

pub async fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Ingest(args) => ingest(args).await,
        BenchCommand::Depth(args) => depth::run(args).await,
        BenchCommand::Bigaccount(args) => bigaccount::run(args).await,
        BenchCommand::Fanout(args) => fanout::run(args).await,
        BenchCommand::Online(args) => online::run(args).await,
        BenchCommand::Reconnect(args) => reconnect::run(args).await,
        BenchCommand::Connections(args) => connections::run(args).await,
        BenchCommand::Presence(args) => presence::run(args).await,
        BenchCommand::Flood(args) => flood::run(args).await,
        BenchCommand::FloodAttack(args) => flood::attack(args).await,
        BenchCommand::Maintenance(args) => maintenance::run(args).await,
        BenchCommand::Push(args) => push::run(args).await,
    }
}

// ------------------------------------------------------------------ ingest

/// Rows committed one per transaction to measure the disk's commit rate.
const DISK_PROBE_ROWS: u64 = 300;
/// Longest wait for the outbox to drain after the send phase.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);
/// Outbox polling period while waiting for the drain.
const DRAIN_POLL: Duration = Duration::from_millis(2);
/// Longest wait for a stopped store to close its files.
const STORE_CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Latency histogram bounds, microseconds (1 µs .. 60 s, 3 significant digits).
const LATENCY_MAX_US: u64 = 60_000_000;
pub(crate) const PASSWORD: &str = "bench-password";
/// Message text: a short chat line.
const TEXT: &str = "The quick brown fox jumps over the lazy dog; benchmark payload.";

const NOTE: &str = "Ratios are against a baseline measured in the same run, on the same disk, alternating with the \
server measurement round by round: baseline = single-threaded rusqlite inserts into a table shaped like `messages` \
(WAL, synchronous=FULL) in transactions of the server's average requests per commit; disk commit rate = the same \
inserts one row per transaction. Summary ratios are medians of the per-round ratios. fsyncs/msg = (commits + \
2*checkpoints) / messages during the send phase, fan-out commits included. floor = the rows the storage design \
writes per message (the message, its outbox row written and deleted, per recipient a user-log event and a \
conversation row, a head per user per batch) in plain SQL on the server's own schema and pragmas, one thread, the \
same batch: floor / baseline is the most any server on this design could reach of the baseline.";

/// Who sends where. Conversation `k` joins users `2k` and `2k+1`; sender `i`
/// writes to conversation `i mod active` as one of its two members, so both
/// members of a conversation send once there are at least `2*active`
/// senders. Only conversations with a sender are created (`active`).
struct Topology {
    users: Vec<String>,
    /// Per conversation: (creator, peer) user indices.
    convs: Vec<(usize, usize)>,
    /// Per sender: (user index, conversation index).
    senders: Vec<(usize, usize)>,
}

impl Topology {
    fn new(senders: usize, conversations: usize) -> Topology {
        let active = conversations.min(senders);
        let users = (0..2 * active).map(|u| format!("bench-u{u}")).collect();
        let convs = (0..active).map(|k| (2 * k, 2 * k + 1)).collect();
        let senders = (0..senders)
            .map(|i| {
                let conv = i % active;
                let side = (i / active) % 2;
                (2 * conv + side, conv)
            })
            .collect();
        Topology { users, convs, senders }
    }

    /// A round's first `rows` sends as the server round makes them:
    /// senders interleaved, each in its conversation.
    fn traffic(&self, round: u32, rows: u64) -> impl Iterator<Item = Traffic> + '_ {
        let senders = self.senders.len() as u64;
        (0..rows).map(move |k| {
            let (index, n) = ((k % senders) as usize, k / senders);
            let (user, conv) = self.senders[index];
            Traffic {
                index,
                user,
                conv,
                client_msg_id: client_msg_id(round, index, n),
                content: content(n).to_string(),
            }
        })
    }

    fn device(sender: usize) -> String {
        format!("bench-d{sender}")
    }
}

/// One send of [`Topology::traffic`]: sender `index`, its user and
/// conversation, the send's client id and content.
struct Traffic {
    index: usize,
    user: usize,
    conv: usize,
    client_msg_id: String,
    content: String,
}

fn client_msg_id(round: u32, sender: usize, n: u64) -> String {
    format!("r{round}-s{sender}-m{n}")
}

fn content(n: u64) -> serde_json::Value {
    serde_json::json!({ "text": TEXT, "n": n })
}

#[derive(Debug, Clone, Serialize)]
struct Params {
    senders: u32,
    messages_per_sender: u32,
    conversations: u32,
    /// Conversations that have at least one sender (`min(conversations, senders)`).
    conversations_active: u32,
    users: u32,
    rounds: u32,
    messages_per_round: u64,
    disk_probe_rows: u64,
    data_dir: String,
    cpus: usize,
}

#[derive(Debug, Clone, Serialize)]
struct ServerRound {
    messages: u64,
    send_phase_ms: f64,
    msgs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    max_ms: f64,
    mean_ms: f64,
    /// Store counters over the send phase.
    commits: u64,
    writes: u64,
    checkpoints: u64,
    fsyncs_per_msg: f64,
    requests_per_commit: f64,
    msgs_per_commit: f64,
    /// Outbox records left when the last send.ok arrived.
    outbox_backlog_at_end: u64,
    fanout_drain_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
struct InsertRun {
    rows: u64,
    batch: u64,
    commits: u64,
    checkpoints: u64,
    secs: f64,
    rows_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Round {
    round: u32,
    server: ServerRound,
    baseline: InsertRun,
    /// The storage design's floor (`floor`): a message's rows in plain SQL.
    floor: InsertRun,
    disk: InsertRun,
    ratio_server_baseline: f64,
    /// The floor's messages/s over the baseline's rows/s: the most any
    /// server on this storage design could reach of the baseline.
    ratio_floor_baseline: f64,
    /// The server's messages/s over the floor's.
    ratio_server_floor: f64,
    ratio_server_disk: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Summary {
    msgs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    fsyncs_per_msg: f64,
    requests_per_commit: f64,
    fanout_drain_ms: f64,
    baseline_batch: f64,
    baseline_rows_per_s: f64,
    ratio_server_baseline: f64,
    floor_msgs_per_s: f64,
    ratio_floor_baseline: f64,
    ratio_server_floor: f64,
    disk_commits_per_s: f64,
    ratio_server_disk: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    note: &'static str,
    unix_time_ms: i64,
    params: Params,
    medians: Summary,
    rounds: Vec<Round>,
}

/// Removes a directory tree when dropped (also on error paths).
struct TempDir(PathBuf);

impl TempDir {
    fn create(parent: &Path) -> Result<TempDir> {
        let suffix: u64 = rand::rng().random();
        let path = parent.join(format!("tidemark-bench-{suffix:016x}"));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            eprintln!("warning: could not remove {}: {e}", self.0.display());
        }
    }
}

fn init_logs() {
    // Warnings only (for example a failed fan-out); RUST_LOG overrides.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

async fn ingest(args: IngestArgs) -> Result<()> {
    init_logs();
    if let Some(url) = args.database.clone() {
        return pg::ingest(args, &url).await;
    }
    let topo = Arc::new(Topology::new(args.senders as usize, args.conversations as usize));
    let per_round = u64::from(args.senders) * u64::from(args.messages());
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let root = TempDir::create(&parent)?;
    let params = Params {
        senders: args.senders,
        messages_per_sender: args.messages(),
        conversations: args.conversations,
        conversations_active: topo.convs.len() as u32,
        users: topo.users.len() as u32,
        rounds: args.rounds,
        messages_per_round: per_round,
        disk_probe_rows: DISK_PROBE_ROWS,
        data_dir: parent.display().to_string(),
        cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    };
    if params.conversations_active < args.conversations {
        eprintln!(
            "note: {} senders write to only {} of the {} conversations",
            args.senders, params.conversations_active, args.conversations
        );
    }

    let pb = ProgressBar::new(per_round * u64::from(args.rounds));
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg:<28} [{bar:30}] {pos}/{len} msgs  {per_sec}  eta {eta}")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb.enable_steady_tick(Duration::from_millis(200));

    let mut rounds = Vec::with_capacity(args.rounds as usize);
    for round in 1..=args.rounds {
        let tag = format!("round {round}/{}", args.rounds);
        pb.set_message(format!("{tag}: server setup"));
        let server = server_round(&args, &topo, &root.0, round, &pb, &tag).await?;

        let batch = (server.requests_per_commit.round() as u64).max(1);
        pb.set_message(format!("{tag}: baseline (batch {batch})"));
        let path = root.0.join(format!("baseline-{round}"));
        let (t, rows) = (topo.clone(), per_round);
        let baseline = tokio::task::spawn_blocking(move || sqlite_insert_rate(&path, &t, round, rows, batch)).await??;

        pb.set_message(format!("{tag}: floor (batch {batch})"));
        let path = root.0.join(format!("floor-{round}"));
        let t = topo.clone();
        let floor =
            tokio::task::spawn_blocking(move || floor::floor_rate(&path, &t, round, per_round, batch)).await??;

        pb.set_message(format!("{tag}: disk commit rate"));
        let path = root.0.join(format!("disk-{round}"));
        let t = topo.clone();
        let disk =
            tokio::task::spawn_blocking(move || sqlite_insert_rate(&path, &t, round, DISK_PROBE_ROWS, 1)).await??;

        let r = Round {
            round,
            ratio_server_baseline: ratio(server.msgs_per_s, baseline.rows_per_s),
            ratio_floor_baseline: ratio(floor.rows_per_s, baseline.rows_per_s),
            ratio_server_floor: ratio(server.msgs_per_s, floor.rows_per_s),
            ratio_server_disk: ratio(server.msgs_per_s, disk.rows_per_s),
            server,
            baseline,
            floor,
            disk,
        };
        pb.suspend(|| {
            eprintln!(
                "{tag}: {:.0} msgs/s, p50 {:.2} ms, p99 {:.2} ms, {:.3} fsyncs/msg, baseline {:.0} rows/s (batch {}), floor {:.0} msgs/s, disk {:.0} commits/s",
                r.server.msgs_per_s,
                r.server.p50_ms,
                r.server.p99_ms,
                r.server.fsyncs_per_msg,
                r.baseline.rows_per_s,
                r.baseline.batch,
                r.floor.rows_per_s,
                r.disk.rows_per_s
            )
        });
        rounds.push(r);
    }
    pb.finish_and_clear();

    let medians = summarize(&rounds);
    print_report(&params, &medians, &rounds);

    let report = Report { bench: "ingest", note: NOTE, unix_time_ms: unix_ms(), params, medians, rounds };
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(&args.out, json + "\n").with_context(|| format!("write {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    drop(root);
    Ok(())
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// One server measurement on a fresh store in `root/server-<round>`.
async fn server_round(
    args: &IngestArgs,
    topo: &Topology,
    root: &Path,
    round: u32,
    pb: &ProgressBar,
    tag: &str,
) -> Result<ServerRound> {
    let dir = root.join(format!("server-{round}"));
    let store = SqliteStore::open(&dir).with_context(|| format!("open store in {}", dir.display()))?;
    let admin_token = format!("bench-{:032x}", rand::rng().random::<u128>());
    let config = ServerConfig {
        admin_token: Some(admin_token.clone()),
        limits: tidemark_server::limits::LimitsConfig::off(),
        ..ServerConfig::default()
    };
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await.context("start server")?;
    let result = drive(args, topo, &Targets::one(&server, &*store), &admin_token, round, pb, tag, None).await;
    server.stop().await;
    let weak = Arc::downgrade(&store);
    drop(store);
    wait_store_closed(weak, &dir).await;
    result
}

/// Waits until nothing holds the store and its writer has folded the WAL
/// back, so the baseline that follows does not share the disk with it.
async fn wait_store_closed<S: ?Sized>(store: Weak<S>, dir: &Path) {
    let wal = dir.join(format!("{}-wal", tidemark_sqlite::DB_FILE));
    let deadline = Instant::now() + STORE_CLOSE_TIMEOUT;
    while Instant::now() < deadline {
        let closed = store.strong_count() == 0;
        let wal_empty = std::fs::metadata(&wal).map(|m| m.len() == 0).unwrap_or(true);
        if closed && wal_empty {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Where `drive`'s senders go and how the store under them is read: one
/// in-process server and its store, or `tidemark serve` nodes on one
/// database (`bench ingest --database --nodes N`), sender `i` on node
/// `i mod N`.
pub(crate) struct Targets<'a> {
    pub addrs: Vec<std::net::SocketAddr>,
    /// Commits, requests committed and checkpoints so far, over every node.
    pub counters: Reader<'a, (u64, u64, u64)>,
    /// Outbox records not fanned out yet.
    pub backlog: Reader<'a, u64>,
}

/// A read of the store under a bench.
pub(crate) type Reader<'a, T> = Box<dyn Fn() -> futures_util::future::BoxFuture<'a, Result<T>> + Send + Sync + 'a>;

impl<'a> Targets<'a> {
    /// The in-process `server` on `store`.
    pub(crate) fn one(server: &tidemark_server::RunningServer, store: &'a dyn Store) -> Targets<'a> {
        Targets {
            addrs: vec![server.addr],
            counters: Box::new(move || {
                Box::pin(async move {
                    let s = store.stats();
                    Ok((s.commits, s.writes, s.checkpoints))
                })
            }),
            backlog: Box::new(move || {
                Box::pin(async move { Ok(store.outbox_stats().await.context("outbox stats")?.backlog) })
            }),
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    args: &IngestArgs,
    topo: &Topology,
    targets: &Targets<'_>,
    admin_token: &str,
    round: u32,
    pb: &ProgressBar,
    tag: &str,
    before_send: Option<&dyn Fn() -> futures_util::future::BoxFuture<'static, Result<()>>>,
) -> Result<ServerRound> {
    let http = Http::new(&format!("http://{}", targets.addrs[0]));
    let node = |i: usize| targets.addrs[i % targets.addrs.len()];
    // The server bounds concurrent password hashes and answers RATE_LIMITED
    // beyond its wait (a loaded machine hashes slowly): retry those.
    try_join_all(topo.users.iter().map(|u| {
        let http = &http;
        async move {
            let mut tries = 0;
            loop {
                match http.create_user(admin_token, u, PASSWORD).await {
                    Err(e) if tries < 100 && e.to_string().contains("RATE_LIMITED") => {
                        tries += 1;
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                    other => return other,
                }
            }
        }
    }))
    .await
    .context("create users")?;
    let devices: Vec<String> = (0..topo.senders.len()).map(Topology::device).collect();
    let logins = try_join_all(
        topo.senders.iter().zip(&devices).map(|(&(u, _), device)| http.login(&topo.users[u], PASSWORD, device)),
    )
    .await
    .context("log in")?;
    // Server events (hints) are not needed: their receivers are dropped and
    // the client discards hints it cannot queue.
    let conns: Vec<WsConn> = try_join_all(logins.iter().enumerate().map(|(i, l)| {
        let ws_url = format!("ws://{}/v1/ws", node(i));
        async move { WsConn::connect(&ws_url, &l.access_token).await }
    }))
    .await
    .context("connect WebSockets")?
    .into_iter()
    .map(|(conn, _events)| conn)
    .collect();
    // Sender k (< active) is the first member of conversation k.
    let conv_ids: Vec<String> = try_join_all(topo.convs.iter().enumerate().map(|(k, &(creator, peer))| {
        debug_assert_eq!(topo.senders[k].0, creator);
        conns[k].conv_create_direct(&topo.users[peer])
    }))
    .await
    .context("create conversations")?
    .into_iter()
    .map(|ok| ok.conv)
    .collect();

    let messages = u64::from(args.messages());
    let total = messages * conns.len() as u64;
    let barrier = Arc::new(tokio::sync::Barrier::new(conns.len() + 1));
    let mut tasks = Vec::with_capacity(conns.len());
    for (i, conn) in conns.into_iter().enumerate() {
        let conv = conv_ids[topo.senders[i].1].clone();
        let mut hist = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
        let (barrier, pb) = (barrier.clone(), pb.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            for n in 0..messages {
                let req = SendReq {
                    conv: conv.clone(),
                    client_msg_id: client_msg_id(round, i, n),
                    kind: "text".into(),
                    content: content(n),
                    mentions: Vec::new(),
                    mention_all: false,
                };
                let t = Instant::now();
                let ok = conn.send(&req).await.with_context(|| format!("sender {i}: send {n}"))?;
                hist.saturating_record(t.elapsed().as_micros() as u64);
                ensure!(!ok.duplicate, "sender {i}: send {n} was answered as a duplicate");
                pb.inc(1);
            }
            anyhow::Ok(hist)
        }));
    }

    if let Some(hook) = before_send {
        hook().await?;
    }
    pb.set_message(format!("{tag}: sending"));
    let before = (targets.counters)().await?;
    let start = Instant::now();
    barrier.wait().await;
    let mut latency = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
    let mut first_error = None;
    for task in tasks {
        match task.await.context("sender task")? {
            Ok(h) => latency.add(&h)?,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    let elapsed = start.elapsed();
    let after = (targets.counters)().await?;
    if let Some(e) = first_error {
        return Err(e);
    }

    pb.set_message(format!("{tag}: fan-out drain"));
    let drain_start = Instant::now();
    let mut backlog_at_end = None;
    loop {
        let backlog = (targets.backlog)().await?;
        backlog_at_end.get_or_insert(backlog);
        if backlog == 0 {
            break;
        }
        if drain_start.elapsed() > DRAIN_TIMEOUT {
            bail!("the outbox still holds {backlog} records {DRAIN_TIMEOUT:?} after the send phase");
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
    let drain = drain_start.elapsed();

    let commits = after.0 - before.0;
    let writes = after.1 - before.1;
    let checkpoints = after.2 - before.2;
    let secs = elapsed.as_secs_f64();
    let ms = |us: u64| us as f64 / 1000.0;
    Ok(ServerRound {
        messages: total,
        send_phase_ms: secs * 1000.0,
        msgs_per_s: ratio(total as f64, secs),
        p50_ms: ms(latency.value_at_quantile(0.50)),
        p99_ms: ms(latency.value_at_quantile(0.99)),
        p999_ms: ms(latency.value_at_quantile(0.999)),
        max_ms: ms(latency.max()),
        mean_ms: latency.mean() / 1000.0,
        commits,
        writes,
        checkpoints,
        fsyncs_per_msg: ratio((commits + 2 * checkpoints) as f64, total as f64),
        requests_per_commit: ratio(writes as f64, commits as f64),
        msgs_per_commit: ratio(total as f64, commits as f64),
        outbox_backlog_at_end: backlog_at_end.unwrap_or(0),
        fanout_drain_ms: drain.as_secs_f64() * 1000.0,
    })
}

/// Single-threaded inserts of `rows` message rows into a fresh database in
/// `dir`, `batch` rows per transaction, with the store's durability
/// settings (WAL, synchronous=FULL, a passive checkpoint every
/// `CHECKPOINT_EVERY_COMMITS` commits). The rows are generated before the
/// clock starts. The directory is removed afterwards.
fn sqlite_insert_rate(dir: &Path, topo: &Topology, round: u32, rows: u64, batch: u64) -> Result<InsertRun> {
    in_fresh_dir(dir, |dir| insert_rate_in(dir, topo, round, rows, batch))
}

/// Runs `f` in directory `dir`, created for it and removed afterwards.
fn in_fresh_dir<T>(dir: &Path, f: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let result = f(dir);
    let _ = std::fs::remove_dir_all(dir);
    result
}

struct Row {
    conv_id: usize,
    msg_seq: i64,
    sender: usize,
    client_msg_id: String,
    content: String,
}

fn hex_id(prefix: &str, rng: &mut impl Rng) -> String {
    let bytes: [u8; 10] = rng.random();
    let mut s = String::from(prefix);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn insert_rate_in(dir: &Path, topo: &Topology, round: u32, rows: u64, batch: u64) -> Result<InsertRun> {
    let mut conn = commit_db(&dir.join("baseline.db"))?;
    conn.execute_batch(
        "CREATE TABLE messages (
            message_id     TEXT PRIMARY KEY,
            conv_id        TEXT NOT NULL,
            msg_seq        INTEGER NOT NULL,
            sender         TEXT NOT NULL,
            client_msg_id  TEXT NOT NULL,
            kind           TEXT NOT NULL,
            content        TEXT NOT NULL,
            created_at     INTEGER NOT NULL,
            UNIQUE (conv_id, msg_seq),
            UNIQUE (sender, client_msg_id)
        );",
    )?;

    // The same traffic as the server round: senders interleaved, each in
    // its conversation, contiguous msg_seq per conversation.
    let mut rng = rand::rng();
    let conv_ids: Vec<String> = topo.convs.iter().map(|_| hex_id("c", &mut rng)).collect();
    let mut heads = vec![0i64; conv_ids.len()];
    let data: Vec<Row> = topo
        .traffic(round, rows)
        .map(|t| {
            heads[t.conv] += 1;
            Row {
                conv_id: t.conv,
                msg_seq: heads[t.conv],
                sender: t.user,
                client_msg_id: t.client_msg_id,
                content: t.content,
            }
        })
        .collect();

    let mut commits = Commits::default();
    let start = Instant::now();
    for chunk in data.chunks(batch as usize) {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        {
            let mut stmt = tx.prepare_cached(
                "INSERT INTO messages (message_id, conv_id, msg_seq, sender, client_msg_id, kind, content, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, 'text', ?6, ?7)",
            )?;
            let now = unix_ms();
            for r in chunk {
                // Minted as the server mints it, when the row is written
                // (time-ordered: tidemark_core::ids::message_id).
                stmt.execute(params![
                    tidemark_core::ids::message_id(now, rng.random()),
                    conv_ids[r.conv_id],
                    r.msg_seq,
                    topo.users[r.sender],
                    r.client_msg_id,
                    r.content,
                    now
                ])?;
            }
        }
        tx.commit()?;
        commits.committed(&conn)?;
    }
    Ok(commits.run(rows, batch, start.elapsed().as_secs_f64()))
}

/// A bench database opened as the server's writer opens its own: WAL,
/// `synchronous=FULL`, the same cache, checkpoints run by the caller
/// ([`Commits`]).
fn commit_db(path: &Path) -> Result<Connection> {
    let conn = Connection::open(path)?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    ensure!(mode.eq_ignore_ascii_case("wal"), "journal_mode is {mode}, want wal");
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "cache_size", -16_000)?;
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    Ok(conn)
}

/// The commits of a baseline or floor run, with a PASSIVE checkpoint every
/// `CHECKPOINT_EVERY_COMMITS`, as the server's writer runs them.
#[derive(Default)]
struct Commits {
    commits: u64,
    checkpoints: u64,
    since_checkpoint: u64,
}

impl Commits {
    /// One transaction committed on `conn`: a checkpoint when it is due.
    fn committed(&mut self, conn: &Connection) -> Result<()> {
        self.commits += 1;
        self.since_checkpoint += 1;
        if self.since_checkpoint >= tidemark_sqlite::writer::CHECKPOINT_EVERY_COMMITS {
            self.since_checkpoint = 0;
            conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?;
            self.checkpoints += 1;
        }
        Ok(())
    }

    fn run(&self, rows: u64, batch: u64, secs: f64) -> InsertRun {
        let (commits, checkpoints) = (self.commits, self.checkpoints);
        InsertRun { rows, batch, commits, checkpoints, secs, rows_per_s: ratio(rows as f64, secs) }
    }
}

// ------------------------------------------------------------------ report

fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let mid = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[mid]
    } else {
        (xs[mid - 1] + xs[mid]) / 2.0
    }
}

fn summarize(rounds: &[Round]) -> Summary {
    let m = |f: &dyn Fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    Summary {
        msgs_per_s: m(&|r| r.server.msgs_per_s),
        p50_ms: m(&|r| r.server.p50_ms),
        p99_ms: m(&|r| r.server.p99_ms),
        fsyncs_per_msg: m(&|r| r.server.fsyncs_per_msg),
        requests_per_commit: m(&|r| r.server.requests_per_commit),
        fanout_drain_ms: m(&|r| r.server.fanout_drain_ms),
        baseline_batch: m(&|r| r.baseline.batch as f64),
        baseline_rows_per_s: m(&|r| r.baseline.rows_per_s),
        ratio_server_baseline: m(&|r| r.ratio_server_baseline),
        floor_msgs_per_s: m(&|r| r.floor.rows_per_s),
        ratio_floor_baseline: m(&|r| r.ratio_floor_baseline),
        ratio_server_floor: m(&|r| r.ratio_server_floor),
        disk_commits_per_s: m(&|r| r.disk.rows_per_s),
        ratio_server_disk: m(&|r| r.ratio_server_disk),
    }
}

/// Prints rows as plain text columns: the first left-aligned, the rest
/// right-aligned.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (c, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if c == 0 {
                s.push_str(&format!("{cell:<w$}"));
            } else {
                s.push_str(&format!("  {cell:>w$}"));
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.to_vec());
    line(widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().iter().map(String::as_str).collect());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

fn print_report(p: &Params, s: &Summary, rounds: &[Round]) {
    let f0 = |x: f64| format!("{x:.0}");
    let f1 = |x: f64| format!("{x:.1}");
    let f2 = |x: f64| format!("{x:.2}");
    let f3 = |x: f64| format!("{x:.3}");
    println!();
    println!(
        "tidemark bench ingest: {} senders x {} messages, {} conversations ({} active), {} round(s), data in {}",
        p.senders, p.messages_per_sender, p.conversations, p.conversations_active, p.rounds, p.data_dir
    );
    println!();
    let spread = |f: &dyn Fn(&Round) -> f64, fmt: &dyn Fn(f64) -> String| {
        let xs: Vec<f64> = rounds.iter().map(f).collect();
        let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (fmt(lo), fmt(hi))
    };
    let row = |name: &str, median: f64, f: &dyn Fn(&Round) -> f64, fmt: &dyn Fn(f64) -> String| {
        let (lo, hi) = spread(f, fmt);
        vec![name.to_owned(), fmt(median), lo, hi]
    };
    let summary = vec![
        row("accepted msgs/s", s.msgs_per_s, &|r| r.server.msgs_per_s, &f0),
        row("send latency p50 (ms)", s.p50_ms, &|r| r.server.p50_ms, &f2),
        row("send latency p99 (ms)", s.p99_ms, &|r| r.server.p99_ms, &f2),
        row("fsyncs per message", s.fsyncs_per_msg, &|r| r.server.fsyncs_per_msg, &f3),
        row("requests per commit", s.requests_per_commit, &|r| r.server.requests_per_commit, &f1),
        row("fan-out drain (ms)", s.fanout_drain_ms, &|r| r.server.fanout_drain_ms, &f1),
        row("baseline batch (rows/commit)", s.baseline_batch, &|r| r.baseline.batch as f64, &f0),
        row("baseline rows/s, same batch", s.baseline_rows_per_s, &|r| r.baseline.rows_per_s, &f0),
        row("server / baseline", s.ratio_server_baseline, &|r| r.ratio_server_baseline, &f2),
        row("floor msgs/s, same batch", s.floor_msgs_per_s, &|r| r.floor.rows_per_s, &f0),
        row("floor / baseline (design's ceiling)", s.ratio_floor_baseline, &|r| r.ratio_floor_baseline, &f2),
        row("server / floor", s.ratio_server_floor, &|r| r.ratio_server_floor, &f2),
        row("disk single-commit rate (/s)", s.disk_commits_per_s, &|r| r.disk.rows_per_s, &f0),
        row("server msgs/s / disk commits/s", s.ratio_server_disk, &|r| r.ratio_server_disk, &f1),
    ];
    print_table(&["metric", "median", "min", "max"], &summary);
    println!();
    let per_round: Vec<Vec<String>> = rounds
        .iter()
        .map(|r| {
            vec![
                r.round.to_string(),
                f0(r.server.msgs_per_s),
                f2(r.server.p50_ms),
                f2(r.server.p99_ms),
                f3(r.server.fsyncs_per_msg),
                f1(r.server.requests_per_commit),
                f1(r.server.fanout_drain_ms),
                r.baseline.batch.to_string(),
                f0(r.baseline.rows_per_s),
                f2(r.ratio_server_baseline),
                f0(r.floor.rows_per_s),
                f2(r.ratio_floor_baseline),
                f0(r.disk.rows_per_s),
                f1(r.ratio_server_disk),
            ]
        })
        .collect();
    print_table(
        &[
            "round",
            "msgs/s",
            "p50 ms",
            "p99 ms",
            "fsync/msg",
            "req/commit",
            "drain ms",
            "batch",
            "base rows/s",
            "srv/base",
            "floor msg/s",
            "floor/base",
            "disk c/s",
            "srv/disk",
        ],
        &per_round,
    );
    println!();
    println!("note: ratios are against a baseline measured in the same run (alternating with the server, same disk);");
    println!("      summary ratios are medians of the per-round ratios.");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_gives_every_sender_a_conversation_it_belongs_to() {
        for (senders, convs) in [(32, 16), (8, 16), (1, 1), (5, 2), (33, 16)] {
            let t = Topology::new(senders, convs);
            assert_eq!(t.senders.len(), senders);
            assert_eq!(t.convs.len(), convs.min(senders));
            for (i, &(user, conv)) in t.senders.iter().enumerate() {
                let (a, b) = t.convs[conv];
                assert!(user == a || user == b, "sender {i} is not a member of its conversation");
            }
            for (k, &(creator, _)) in t.convs.iter().enumerate() {
                assert_eq!(t.senders[k].0, creator, "sender {k} creates conversation {k}");
            }
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(vec![]), 0.0);
    }
}
