//! `bench reconnect`: N devices, each K events behind (messages sent to
//! their groups while they were disconnected), the server SIGKILLed and
//! started again on the same data directory, then every device reconnects
//! at the same moment and syncs (pages of `--limit`, each ACKed) until it
//! has all K events. Measured per round: time until every device is caught
//! up, per-device catch-up time, sync pages and requests per resume, and
//! the SQL statements the server's store ran per resume (the
//! `tidemark_store_statements_total` and `tidemark_store_read_statements_total` counters
//! of `/metrics`, read before and after the storm; they count every
//! statement SQLite starts, `BEGIN`/`COMMIT` of the ACKs' group commits
//! included). Several rounds (each sends K more messages, kills and
//! restarts the server, and resumes every device again); the summary is
//! the median of the rounds.
//!
//! The server is the real `tidemark serve` in a child process, so the
//! benchmark's 10,000 client sockets and the server's 10,000 do not share
//! one open-file limit.
//!
//! The baseline, in the same round against the same restarted server, is
//! the bare handshakes of the same devices at once: WebSocket connect plus
//! the `auth` frame, until every `auth.ok` has arrived (its statements per
//! handshake are reported too: authentication reads the device record).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures_util::future::try_join_all;
use futures_util::{SinkExt, StreamExt, TryStreamExt};
use serde::Serialize;
use tidemark_client::proto::{op, ConvCreateOk, ConvCreateReq, SendReq};
use tidemark_client::{Http, WsConn};
use tokio_tungstenite::tungstenite::Message;

use super::device::{bar, Device, PASSWORD};
use super::proc::{
    cpu_secs, create_devices, create_users, metric_series, metric_value, open_files_soft_limit, pct, spawn_tidemark,
    ChildGuard, TokenMint,
};
use super::stores::{Schemas, StoreAt};
use super::{init_logs, median, print_table, TempDir};

#[derive(clap::Args, Debug, Clone)]
pub struct ReconnectArgs {
    /// Devices (one user each) that reconnect at once.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub devices: u32,
    /// Events each device is behind (messages sent to its group while it
    /// was away).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub events: u32,
    /// Events per sync page.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Devices per group (the sender is one more member).
    #[arg(long, default_value_t = 99, value_parser = clap::value_parser!(u32).range(1..=999))]
    pub group: u32,
    /// Rounds (messages while away, SIGKILL + restart, resume storm,
    /// baseline); the summary is the median.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    #[arg(long, default_value = "bench-results/reconnect.json")]
    pub out: PathBuf,
    /// Where the temporary store goes (must be a real disk).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Run `tidemark serve` on the PostgreSQL store at this URL instead (a
    /// fresh schema for the run, dropped afterwards); SIGKILL and restart
    /// as on the embedded store.
    #[arg(long, value_name = "postgres://…")]
    pub database: Option<String>,
    /// The devices do not opt in to `presence.batch` frames (one `presence`
    /// frame per entry, as clients before it): the same-binary "before".
    #[arg(long)]
    pub single_presence_frames: bool,
}

const SETUP_CONCURRENCY: usize = 64;
const RUN_TIMEOUT: Duration = Duration::from_secs(600);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(600);
/// The device every bench user connects with.
const DEVICE: &str = "phone";
/// Access tokens live 15 minutes; sign new ones when older than this.
const TOKEN_REFRESH_AFTER: Duration = Duration::from_secs(8 * 60);
const STATEMENTS: &str = "tidemark_store_statements_total";
const READ_STATEMENTS: &str = "tidemark_store_read_statements_total";
/// Typing and presence frames the server's writers sent (one series per
/// kind; summed), a `presence.batch` counting one.
const EPHEMERAL_SENT: &str = "tidemark_ephemeral_frames_sent_total";
/// Presence entries sent inside `presence.batch` frames.
const PRESENCE_BATCHED: &str = "tidemark_ephemeral_presence_batched_total";
/// Failed reads of a user's presence facts, by outcome (`retried`,
/// `gave_up`: the announcement not made).
const PRESENCE_READS_FAILED: &str = "tidemark_presence_reads_failed_total";

#[derive(Debug, Clone, Serialize)]
struct Round {
    round: u32,
    restart_secs: f64,
    all_caught_up_secs: f64,
    device_p50_ms: f64,
    device_p99_ms: f64,
    pages_per_resume: f64,
    requests_per_resume: f64,
    statements_per_resume: f64,
    read_statements_per_resume: f64,
    /// Presence (and typing) frames the server sent over the storm, per
    /// resume: every connect announces its user to the online members of
    /// its groups, who answer with theirs, and every close announces it
    /// offline.
    ephemeral_frames_per_resume: f64,
    /// Syncs and ACKs run again after a "retry later" answer
    /// (`UNAVAILABLE`: a store pool wait ran out), over all devices.
    retries: u64,
    /// Reads of a user's presence facts the server made again after a
    /// failure, and announcements it gave up for one, from the storm's
    /// start to the baseline's end (on PostgreSQL the read pool runs dry
    /// in a large storm).
    presence_reads_retried: u64,
    presence_reads_given_up: u64,
    /// Presence entries the devices were told over the storm, per resume:
    /// single `presence` frames plus the entries of `presence.batch` frames
    /// (what the clients learn, whichever way it travels).
    presence_entries_per_resume: f64,
    /// CPU (user + system, from /proc) of the `tidemark serve` process over
    /// the storm, per resume: what a resume costs the node, steadier than
    /// the wall time on a shared machine. PostgreSQL's backends are not in
    /// it.
    server_cpu_ms_per_resume: f64,
    /// CPU of this process over the storm (the devices' SDK clients), per
    /// resume.
    clients_cpu_ms_per_resume: f64,
    /// Presence entries and server CPU per resume from the storm's start
    /// until the server is quiet again ([`settle`]): what the devices are
    /// told, and what it costs, whether it happens before the last device
    /// has caught up or after. The figures above stop at the catch-up, so a
    /// faster storm leaves more of its presence after their window.
    presence_entries_settled_per_resume: f64,
    server_cpu_settled_ms_per_resume: f64,
    baseline_all_handshakes_secs: f64,
    baseline_p50_ms: f64,
    baseline_p99_ms: f64,
    baseline_statements_per_handshake: f64,
    /// The server's CPU over the bare handshakes, per handshake.
    baseline_server_cpu_ms_per_handshake: f64,
}

/// Connect, send the `auth` frame, wait for `auth.ok`.
async fn bare_handshake(url: &str, token: &str) -> Result<()> {
    // The SDK's socket settings, so both phases' clients read alike.
    let (ws, _) = tokio_tungstenite::connect_async_with_config(url, Some(tidemark_client::ws_config()), true).await?;
    let (mut sink, mut stream) = ws.split();
    let frame = serde_json::json!({ "t": op::AUTH, "rid": "a1", "token": token });
    sink.send(Message::Text(frame.to_string().into())).await?;
    while let Some(msg) = stream.next().await {
        if let Message::Text(t) = msg? {
            let v: serde_json::Value = serde_json::from_str(t.as_str())?;
            if v.get("rid").and_then(|r| r.as_str()) == Some("a1") {
                ensure!(v.get("t").and_then(|t| t.as_str()) == Some("auth.ok"), "auth refused: {v}");
                let _ = sink.send(Message::Close(None)).await;
                return Ok(());
            }
        }
    }
    bail!("closed before auth.ok")
}

/// Logs every user in (device "phone", 64 at a time) and returns the
/// access tokens.
pub(super) async fn log_in(http: &Http, users: &[String], pb: &indicatif::ProgressBar) -> Result<Vec<String>> {
    futures_util::stream::iter(users.iter().map(|u| {
        let (http, pb) = (http.clone(), pb.clone());
        async move {
            let l = http.login(u, PASSWORD, "phone").await;
            pb.inc(1);
            l.map(|l| l.access_token)
        }
    }))
    .buffered(SETUP_CONCURRENCY)
    .try_collect()
    .await
    .context("log in")
}

/// How often [`settle`] reads the counters, how many unchanged reads in a
/// row make the server quiet, and how long it waits at most.
const SETTLE_POLL: Duration = Duration::from_millis(250);
const SETTLE_QUIET_READS: u32 = 4;
const SETTLE_MAX: Duration = Duration::from_secs(60);

/// Waits until the server has told the devices every presence entry the
/// storm caused: its presence counter unchanged over [`SETTLE_QUIET_READS`]
/// reads [`SETTLE_POLL`] apart (a second), at most [`SETTLE_MAX`]; returns
/// the counters then.
async fn settle(addr: SocketAddr, reads: bool) -> Result<Counters> {
    let deadline = Instant::now() + SETTLE_MAX;
    let mut last = statements(addr, reads).await?;
    let mut quiet = 0;
    while quiet < SETTLE_QUIET_READS && Instant::now() < deadline {
        tokio::time::sleep(SETTLE_POLL).await;
        let now = statements(addr, reads).await?;
        quiet = if now.presence_entries == last.presence_entries { quiet + 1 } else { 0 };
        last = now;
    }
    Ok(last)
}

/// The server's counters the storm is measured by, from one read of
/// `/metrics`. A store that does not tell reads apart (PostgreSQL, `reads`
/// false) has no read figure: NaN.
#[derive(Debug, Clone, Copy)]
struct Counters {
    statements: f64,
    reads: f64,
    ephemeral_frames: f64,
    /// Single `presence` frames plus entries of `presence.batch` frames.
    presence_entries: f64,
    /// Presence reads made again, and announcements given up for a failed
    /// read ([`PRESENCE_READS_FAILED`]).
    presence_reads_retried: f64,
    presence_reads_given_up: f64,
}

async fn statements(addr: SocketAddr, reads: bool) -> Result<Counters> {
    let text = reqwest::get(format!("http://{addr}/metrics")).await?.error_for_status()?.text().await?;
    let value = |name: &str| metric_value(&text, name).with_context(|| format!("{name} not in /metrics"));
    let sent: Vec<(&str, f64)> = metric_series(&text, EPHEMERAL_SENT).collect();
    let single_presence: f64 = sent.iter().filter(|(l, _)| l.contains("kind=\"presence\"")).map(|(_, v)| v).sum();
    let failed = |outcome: &str| {
        let label = format!("outcome=\"{outcome}\"");
        metric_series(&text, PRESENCE_READS_FAILED)
            .find(|(l, _)| l.contains(&label))
            .map(|(_, v)| v)
            .with_context(|| format!("{PRESENCE_READS_FAILED}{{{label}}} not in /metrics"))
    };
    Ok(Counters {
        statements: value(STATEMENTS)?,
        reads: if reads { value(READ_STATEMENTS)? } else { f64::NAN },
        ephemeral_frames: sent.iter().map(|(_, v)| v).sum(),
        presence_entries: single_presence + value(PRESENCE_BATCHED)?,
        presence_reads_retried: failed("retried")?,
        presence_reads_given_up: failed("gave_up")?,
    })
}

/// Every group gets `k` messages from the sender; returns once the server's
/// outbox is empty (every event is in the members' logs).
async fn send_while_away(addr: SocketAddr, convs: &[String], k: u64, round: u32) -> Result<()> {
    let http = Http::new(&format!("http://{addr}"));
    let login = http.login("rc-sender", PASSWORD, "desk").await.context("sender login")?;
    let (sender, _events) = WsConn::connect(&format!("ws://{addr}/v1/ws"), &login.access_token).await?;
    try_join_all(convs.iter().enumerate().map(|(g, conv)| {
        let sender = sender.clone();
        async move {
            for m in 0..k {
                let req = SendReq {
                    conv: conv.clone(),
                    client_msg_id: format!("rc-{round}-{g}-{m}"),
                    kind: "text".into(),
                    content: serde_json::json!({ "text": "while you were away", "m": m }),
                    mentions: Vec::new(),
                    mention_all: false,
                };
                sender.send(&req).await?;
            }
            anyhow::Ok(())
        }
    }))
    .await
    .context("send")?;
    sender.close().await;
    let drained = Instant::now();
    while outbox_backlog(addr).await? > 0 {
        ensure!(drained.elapsed() < DRAIN_TIMEOUT, "fan-out did not drain");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The outbox records not fanned out yet, read from the store now
/// (`/healthz`; the `/metrics` gauge may be up to `--gauges-every-secs` old,
/// and a PostgreSQL fan-out of the away messages takes longer than that).
async fn outbox_backlog(addr: SocketAddr) -> Result<u64> {
    let health: tidemark_client::proto::HealthOk =
        reqwest::get(format!("http://{addr}/healthz")).await?.error_for_status()?.json().await?;
    Ok(health.outbox_backlog)
}

/// SIGKILLs the server and starts it again on the same store, on the
/// same port if it is free. Returns the new server and the seconds until
/// it listened.
fn kill_and_restart(server: ChildGuard, addr: SocketAddr, at: &StoreAt) -> Result<(ChildGuard, SocketAddr, f64)> {
    drop(server);
    let t = Instant::now();
    let (child, addr) = match spawn_tidemark(at, &addr.to_string()) {
        Ok(s) => s,
        Err(_) => spawn_tidemark(at, "127.0.0.1:0")?,
    };
    Ok((child, addr, t.elapsed().as_secs_f64()))
}

pub async fn run(args: ReconnectArgs) -> Result<()> {
    init_logs();
    let soft = open_files_soft_limit();
    let mut devices = args.devices;
    if let Some(soft) = soft {
        // The client ends of every socket live in this process.
        let cap = soft.saturating_sub(300) as u32;
        eprintln!("open-file soft limit: {soft} (caps devices at {cap})");
        if devices > cap {
            eprintln!("note: --devices {devices} capped to {cap}");
            devices = cap;
        }
    }
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = TempDir::create(&parent)?;
    match &args.database {
        None => run_on(&args, devices, soft, &StoreAt::Dir(dir.0.clone())).await,
        Some(url) => {
            let schemas = Schemas::connect(url).await?;
            let schemas = &schemas;
            let args = &args;
            schemas
                .run("reconnect", |schema| async move { run_on(args, devices, soft, &schemas.at(&schema)).await })
                .await
        }
    }
}

/// Setup and the rounds on the store `at`.
async fn run_on(args: &ReconnectArgs, devices: u32, soft: Option<u64>, at: &StoreAt) -> Result<()> {
    let n = devices as usize;
    let k = u64::from(args.events);
    let reads = matches!(at, StoreAt::Dir(_));
    let Setup {
        mut server,
        mut addr,
        users,
        convs,
        mint,
        mut tokens,
        mut logged_in,
        mut positions,
        setup_secs,
        phases,
    } = setup(args, n, at).await?;
    let mut rounds = Vec::new();
    for round in 1..=args.rounds {
        let pb = bar(n as u64 * 2, "devices");
        // ------------------------------------------------------ away
        pb.set_message(format!("round {round}: {k} messages per group while the devices are away"));
        send_while_away(addr, &convs, k, round).await?;
        if logged_in.elapsed() > TOKEN_REFRESH_AFTER {
            pb.set_message(format!("round {round}: new access tokens (they expire)"));
            tokens = users.iter().map(|u| mint.access(u, DEVICE)).collect();
            logged_in = Instant::now();
        }

        // ------------------------------------------------------ restart
        pb.set_message(format!("round {round}: SIGKILL and restart"));
        let restart_secs;
        (server, addr, restart_secs) = kill_and_restart(server, addr, at)?;
        let ws_url = format!("ws://{addr}/v1/ws");

        // ------------------------------------------------------ resume storm
        pb.set_message(format!("round {round}: resume, all devices at once"));
        let before = statements(addr, reads).await?;
        let cpu_before = (cpu_secs(server.pid())?, cpu_secs("self")?);
        let batch = !args.single_presence_frames;
        let storm = resume_storm(&ws_url, &tokens, &mut positions, (k, args.limit), batch, &pb).await?;
        let cpu_after = (cpu_secs(server.pid())?, cpu_secs("self")?);
        let after = statements(addr, reads).await?;

        pb.set_message(format!("round {round}: presence settling"));
        let settled = settle(addr, reads).await?;
        let cpu_settled = cpu_secs(server.pid())?;

        // ------------------------------------------------------ baseline
        pb.set_message(format!("round {round}: baseline, bare handshakes"));
        // Let the server finish closing the resumed connections first.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let base_before = statements(addr, reads).await?;
        let base_cpu_before = cpu_secs(server.pid())?;
        let (baseline_secs, mut base_times) = handshakes(&ws_url, &tokens, &pb).await?;
        let base_cpu_after = cpu_secs(server.pid())?;
        let base_after = statements(addr, reads).await?;
        pb.finish_and_clear();

        let Storm { all_caught_up_secs, mut times, pages, requests, retries } = storm;
        times.sort_by(f64::total_cmp);
        base_times.sort_by(f64::total_cmp);
        let per = |a: f64, b: f64| (b - a) / n as f64;
        let r = Round {
            round,
            restart_secs,
            all_caught_up_secs,
            device_p50_ms: median(times.clone()),
            device_p99_ms: pct(&times, 0.99),
            pages_per_resume: pages as f64 / n as f64,
            requests_per_resume: requests as f64 / n as f64,
            statements_per_resume: per(before.statements, after.statements),
            read_statements_per_resume: per(before.reads, after.reads),
            ephemeral_frames_per_resume: per(before.ephemeral_frames, after.ephemeral_frames),
            presence_entries_per_resume: per(before.presence_entries, after.presence_entries),
            server_cpu_ms_per_resume: per(cpu_before.0, cpu_after.0) * 1000.0,
            clients_cpu_ms_per_resume: per(cpu_before.1, cpu_after.1) * 1000.0,
            presence_entries_settled_per_resume: per(before.presence_entries, settled.presence_entries),
            server_cpu_settled_ms_per_resume: per(cpu_before.0, cpu_settled) * 1000.0,
            retries,
            presence_reads_retried: (base_after.presence_reads_retried - before.presence_reads_retried) as u64,
            presence_reads_given_up: (base_after.presence_reads_given_up - before.presence_reads_given_up) as u64,
            baseline_all_handshakes_secs: baseline_secs,
            baseline_p50_ms: median(base_times.clone()),
            baseline_p99_ms: pct(&base_times, 0.99),
            baseline_statements_per_handshake: per(base_before.statements, base_after.statements),
            baseline_server_cpu_ms_per_handshake: per(base_cpu_before, base_cpu_after) * 1000.0,
        };
        eprintln!(
            "round {round}: all caught up in {:.2} s (handshakes alone {:.2} s), {:.1} statements and {:.2} ms of \
             server CPU per resume",
            r.all_caught_up_secs, r.baseline_all_handshakes_secs, r.statements_per_resume, r.server_cpu_ms_per_resume
        );
        rounds.push(r);
    }
    drop(server);

    let summary = median_round(&rounds);
    report(args, at.backend(), devices, convs.len(), soft, (setup_secs, &phases), &summary, &rounds)
}

/// What setup leaves for the rounds.
struct Setup {
    server: ChildGuard,
    addr: SocketAddr,
    users: Vec<String>,
    convs: Vec<String>,
    mint: TokenMint,
    tokens: Vec<String>,
    logged_in: Instant,
    /// Each device's `(generation, applied)`, at its user's head.
    positions: Vec<(Option<u64>, u64)>,
    setup_secs: f64,
    /// Seconds of each setup step.
    phases: Vec<(&'static str, f64)>,
}

/// The users and their devices (through the store, their access tokens
/// signed here), the sender, `tidemark serve`, the groups, and each device
/// connected once and brought to its head.
async fn setup(args: &ReconnectArgs, n: usize, at: &StoreAt) -> Result<Setup> {
    let setup = Instant::now();
    let mut phases = Vec::new();
    let mut phase = |name: &'static str, since: &mut Instant| {
        let secs = since.elapsed().as_secs_f64();
        eprintln!("setup: {name} in {secs:.1} s");
        phases.push((name, secs));
        *since = Instant::now();
    };
    let mut step = Instant::now();
    let pb = bar(n as u64 * 2, "setup steps");
    pb.set_message("setup: users and devices");
    let users: Vec<String> = (0..n).map(|i| format!("rc-u{i}")).collect();
    create_users(at, &["rc-sender".to_owned()], &indicatif::ProgressBar::hidden()).await?;
    let mint = create_devices(at, &users, DEVICE, &pb).await?;
    let tokens: Vec<String> = users.iter().map(|u| mint.access(u, DEVICE)).collect();
    let logged_in = Instant::now();
    phase("users and devices (store)", &mut step);
    let (server, addr) = spawn_tidemark(at, "127.0.0.1:0")?;
    let http = Http::new(&format!("http://{addr}"));
    pb.set_message("setup: groups");
    let sender_login = http.login("rc-sender", PASSWORD, "desk").await.context("sender login")?;
    let (sender, _sender_events) = WsConn::connect(&format!("ws://{addr}/v1/ws"), &sender_login.access_token).await?;
    let mut convs = Vec::new();
    for chunk in users.chunks(args.group as usize) {
        let ok: ConvCreateOk = sender
            .request(
                op::CONV_CREATE,
                &ConvCreateReq { kind: "group".into(), members: chunk.to_vec(), client_msg_id: None },
            )
            .await
            .context("create group")?;
        convs.push(ok.conv);
    }
    sender.close().await;
    phase("server start and groups", &mut step);
    // Connect each device once and bring it to the head, then disconnect.
    pb.set_message("setup: first sync");
    let ws_url = format!("ws://{addr}/v1/ws");
    let positions: Vec<(Option<u64>, u64)> = futures_util::stream::iter(tokens.iter().map(|token| {
        let (ws_url, pb) = (ws_url.clone(), pb.clone());
        async move {
            let (ws, _events) = WsConn::connect(&ws_url, token).await?;
            let mut dev = Device::new(ws);
            dev.catch_up(args.limit, |_| {}).await?;
            dev.ws.close().await;
            pb.inc(1);
            anyhow::Ok((dev.generation, dev.applied))
        }
    }))
    .buffered(SETUP_CONCURRENCY)
    .try_collect()
    .await
    .context("first sync")?;
    phase("first sync", &mut step);
    let setup_secs = setup.elapsed().as_secs_f64();
    pb.finish_and_clear();
    Ok(Setup { server, addr, users, convs, mint, tokens, logged_in, positions, setup_secs, phases })
}

/// What one resume storm measured.
struct Storm {
    all_caught_up_secs: f64,
    /// Per-device catch-up times, ms.
    times: Vec<f64>,
    pages: u64,
    requests: u64,
    retries: u64,
}

/// Connect attempts of one device in a storm: ten thousand connects at
/// once overflow the listener's accept queue (`somaxconn` is 4 096 on the
/// benchmark machine), and a connection dropped there fails its handshake
/// in transport; a device retries, as the SDK's reconnect loop would.
const CONNECT_ATTEMPTS_MAX: u64 = 5;
const CONNECT_RETRY_AFTER: Duration = Duration::from_millis(200);

/// Connects, retrying a transport failure (never a server's refusal);
/// returns the connection, its events and how many attempts failed.
async fn connect_retrying(
    ws_url: &str,
    token: &str,
    presence_batch: bool,
) -> Result<(WsConn, tokio::sync::mpsc::Receiver<tidemark_client::ServerEvent>, u64)> {
    let mut failed = 0;
    let options = tidemark_client::WsOptions { presence_batch, ..Default::default() };
    loop {
        match WsConn::connect_with(ws_url, token, options).await {
            Ok((ws, events)) => return Ok((ws, events, failed)),
            Err(tidemark_client::ClientError::Transport(e)) if failed + 1 < CONNECT_ATTEMPTS_MAX => {
                tracing::debug!(error = %e, "connect failed in transport; retrying");
                failed += 1;
                tokio::time::sleep(CONNECT_RETRY_AFTER).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// One resume storm: every device connects at the same moment (opting in
/// to `presence.batch` or not) and syncs, in pages of `limit`, until it
/// holds its `k` new events. Updates `positions`.
async fn resume_storm(
    ws_url: &str,
    tokens: &[String],
    positions: &mut [(Option<u64>, u64)],
    (k, limit): (u64, u32),
    presence_batch: bool,
    pb: &indicatif::ProgressBar,
) -> Result<Storm> {
    let n = tokens.len();
    let start = Arc::new(tokio::sync::Barrier::new(n + 1));
    let mut tasks = Vec::with_capacity(n);
    for (token, &(generation, applied)) in tokens.iter().zip(positions.iter()) {
        let (ws_url, token, start, pb) = (ws_url.to_owned(), token.clone(), start.clone(), pb.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let t = Instant::now();
            let (ws, _events, retries) = connect_retrying(&ws_url, &token, presence_batch).await?;
            let mut dev = Device::at(ws, generation, applied);
            let mut got = 0u64;
            while got < k {
                dev.catch_up(limit, |ev| {
                    if ev.kind == "message" {
                        got += 1;
                    }
                })
                .await?;
            }
            let requests = dev.pages + dev.acks;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            ensure!(got == k, "device got {got} of {k} events");
            dev.ws.close().await;
            pb.inc(1);
            anyhow::Ok((ms, dev.pages, requests, (retries, dev.retries), (dev.generation, dev.applied)))
        }));
    }
    start.wait().await;
    let t = Instant::now();
    let results = tokio::time::timeout(RUN_TIMEOUT, try_join_all(tasks)).await.context("resume timed out")??;
    let all_caught_up_secs = t.elapsed().as_secs_f64();
    let mut times = Vec::with_capacity(n);
    let (mut pages, mut requests, mut connect_retries, mut retries) = (0u64, 0u64, 0u64, 0u64);
    for (i, r) in results.into_iter().enumerate() {
        let (ms, p, q, (connects, requests_again), pos) = r?;
        times.push(ms);
        pages += p;
        requests += q;
        connect_retries += connects;
        retries += requests_again;
        positions[i] = pos;
    }
    if connect_retries > 0 {
        eprintln!("{connect_retries} connects failed in transport and were retried (counted in their device's time)");
    }
    if retries > 0 {
        eprintln!(
            "{retries} syncs and ACKs were answered 'retry later' and run again (counted in their device's time)"
        );
    }
    Ok(Storm { all_caught_up_secs, times, pages, requests, retries })
}

/// The baseline: the same devices' bare handshakes at the same moment.
/// Returns the time until every `auth.ok` arrived and each handshake's, ms.
async fn handshakes(ws_url: &str, tokens: &[String], pb: &indicatif::ProgressBar) -> Result<(f64, Vec<f64>)> {
    let n = tokens.len();
    let start = Arc::new(tokio::sync::Barrier::new(n + 1));
    let mut tasks = Vec::with_capacity(n);
    for token in tokens {
        let (ws_url, token, start, pb) = (ws_url.to_owned(), token.clone(), start.clone(), pb.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let t = Instant::now();
            bare_handshake(&ws_url, &token).await?;
            pb.inc(1);
            anyhow::Ok(t.elapsed().as_secs_f64() * 1000.0)
        }));
    }
    start.wait().await;
    let t = Instant::now();
    let results = tokio::time::timeout(RUN_TIMEOUT, try_join_all(tasks)).await.context("baseline timed out")??;
    let baseline_secs = t.elapsed().as_secs_f64();
    let base_times = results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok((baseline_secs, base_times))
}

/// The median round: each figure the median of the rounds'.
fn median_round(rounds: &[Round]) -> Round {
    let med = |f: fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    Round {
        round: 0,
        restart_secs: med(|r| r.restart_secs),
        all_caught_up_secs: med(|r| r.all_caught_up_secs),
        device_p50_ms: med(|r| r.device_p50_ms),
        device_p99_ms: med(|r| r.device_p99_ms),
        pages_per_resume: med(|r| r.pages_per_resume),
        requests_per_resume: med(|r| r.requests_per_resume),
        statements_per_resume: med(|r| r.statements_per_resume),
        read_statements_per_resume: med(|r| r.read_statements_per_resume),
        ephemeral_frames_per_resume: med(|r| r.ephemeral_frames_per_resume),
        retries: med(|r| r.retries as f64) as u64,
        presence_reads_retried: med(|r| r.presence_reads_retried as f64) as u64,
        presence_reads_given_up: med(|r| r.presence_reads_given_up as f64) as u64,
        presence_entries_per_resume: med(|r| r.presence_entries_per_resume),
        server_cpu_ms_per_resume: med(|r| r.server_cpu_ms_per_resume),
        clients_cpu_ms_per_resume: med(|r| r.clients_cpu_ms_per_resume),
        presence_entries_settled_per_resume: med(|r| r.presence_entries_settled_per_resume),
        server_cpu_settled_ms_per_resume: med(|r| r.server_cpu_settled_ms_per_resume),
        baseline_all_handshakes_secs: med(|r| r.baseline_all_handshakes_secs),
        baseline_p50_ms: med(|r| r.baseline_p50_ms),
        baseline_p99_ms: med(|r| r.baseline_p99_ms),
        baseline_statements_per_handshake: med(|r| r.baseline_statements_per_handshake),
        baseline_server_cpu_ms_per_handshake: med(|r| r.baseline_server_cpu_ms_per_handshake),
    }
}

/// Prints the summary and per-round tables and writes the JSON.
#[allow(clippy::too_many_arguments)]
fn report(
    args: &ReconnectArgs,
    backend: &str,
    devices: u32,
    groups: usize,
    soft: Option<u64>,
    (setup_secs, phases): (f64, &[(&str, f64)]),
    summary: &Round,
    rounds: &[Round],
) -> Result<()> {
    println!(
        "tidemark bench reconnect ({} store): {} devices in {} groups, each {} events behind, `tidemark serve` \
         SIGKILLed and restarted on the same store (median {:.2} s), all reconnect at once; pages of {}; presence \
         {}; median of {} rounds\n",
        backend,
        devices,
        groups,
        args.events,
        summary.restart_secs,
        args.limit,
        if args.single_presence_frames { "one frame per entry" } else { "batched (presence.batch)" },
        rounds.len()
    );
    let s = summary;
    let ratio = |a: f64, b: f64| format!("{:.2}x", a / b.max(f64::MIN_POSITIVE));
    print_table(
        &[
            "run",
            "all done s",
            "device p50 ms",
            "device p99 ms",
            "pages/resume",
            "requests/resume",
            "SQL stmts/resume",
            "of them reads",
            "eph frames/resume",
            "presence entries/resume",
            "server CPU ms/resume",
            "clients CPU ms/resume",
        ],
        &[
            vec![
                "resume + catch up".into(),
                format!("{:.3}", s.all_caught_up_secs),
                format!("{:.1}", s.device_p50_ms),
                format!("{:.1}", s.device_p99_ms),
                format!("{:.2}", s.pages_per_resume),
                format!("{:.2}", s.requests_per_resume),
                format!("{:.1}", s.statements_per_resume),
                if s.read_statements_per_resume.is_nan() {
                    "-".into()
                } else {
                    format!("{:.1}", s.read_statements_per_resume)
                },
                format!("{:.1}", s.ephemeral_frames_per_resume),
                format!("{:.1}", s.presence_entries_per_resume),
                format!("{:.2}", s.server_cpu_ms_per_resume),
                format!("{:.2}", s.clients_cpu_ms_per_resume),
            ],
            vec![
                "baseline: bare handshakes".into(),
                format!("{:.3}", s.baseline_all_handshakes_secs),
                format!("{:.1}", s.baseline_p50_ms),
                format!("{:.1}", s.baseline_p99_ms),
                "-".into(),
                "1 (auth)".into(),
                format!("{:.1}", s.baseline_statements_per_handshake),
                String::new(),
                String::new(),
                String::new(),
                format!("{:.2}", s.baseline_server_cpu_ms_per_handshake),
                String::new(),
            ],
            vec![
                "ratio".into(),
                ratio(s.all_caught_up_secs, s.baseline_all_handshakes_secs),
                ratio(s.device_p50_ms, s.baseline_p50_ms),
                ratio(s.device_p99_ms, s.baseline_p99_ms),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                ratio(s.server_cpu_ms_per_resume, s.baseline_server_cpu_ms_per_handshake),
                String::new(),
            ],
        ],
    );
    println!("\nper round:");
    print_table(
        &[
            "round",
            "restart s",
            "all done s",
            "device p50 ms",
            "device p99 ms",
            "stmts/resume",
            "server CPU ms/resume",
            "settled: presence entries / server CPU ms per resume",
            "retries",
            "presence reads again / given up",
            "handshakes s",
        ],
        &rounds
            .iter()
            .map(|r| {
                vec![
                    r.round.to_string(),
                    format!("{:.2}", r.restart_secs),
                    format!("{:.3}", r.all_caught_up_secs),
                    format!("{:.1}", r.device_p50_ms),
                    format!("{:.1}", r.device_p99_ms),
                    format!("{:.1}", r.statements_per_resume),
                    format!("{:.2}", r.server_cpu_ms_per_resume),
                    format!("{:.1} / {:.2}", r.presence_entries_settled_per_resume, r.server_cpu_settled_ms_per_resume),
                    r.retries.to_string(),
                    format!("{} / {}", r.presence_reads_retried, r.presence_reads_given_up),
                    format!("{:.3}", r.baseline_all_handshakes_secs),
                ]
            })
            .collect::<Vec<_>>(),
    );
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "reconnect",
        "store": backend,
        "note": "server = `tidemark serve` child process, SIGKILLed and restarted before each round's storm; \
                 baseline = WebSocket connect + auth frame of the same devices at once against the same restarted \
                 server; statements = statements the server's store connections ran (its /metrics counters: \
                 SQLite counts every statement started, PostgreSQL every statement sent, BEGIN/COMMIT included, \
                 and has no read counter), delta over the storm / devices; server/clients CPU = user + system CPU \
                 (/proc) of the serve process / of this bench process (the devices' clients) over the storm / \
                 devices, PostgreSQL's backends not counted; settled = from the storm's start until the \
                 server's presence counter is unchanged for a second (presence told after the last device \
                 caught up included); summary = median of the rounds",
        "devices": devices, "events_behind": args.events, "limit": args.limit, "groups": groups,
        "presence_batch": !args.single_presence_frames,
        "open_files_soft_limit": soft, "setup_secs": setup_secs,
        "setup_phases_secs": phases.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
        "summary": summary, "rounds": rounds,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
