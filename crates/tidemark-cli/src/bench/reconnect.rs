//! `bench reconnect`: N devices, each K events behind (messages sent to
//! their groups while they were disconnected), the server stopped and
//! restarted on the same data directory, then every device reconnects at
//! the same moment and syncs (pages of `--limit`, each ACKed) until it has
//! all K events. Measured: time until every device is caught up, per-device
//! catch-up time, and sync pages and requests per resume.
//!
//! The store keeps no count of its read queries and wrapping the `Store`
//! trait to count them is not cheap, so the scenario reports pages (and
//! sync + ACK requests) per resume instead: each sync page is one range
//! read of the user log plus the cursor checks.
//!
//! The baseline, in the same run against the same restarted server, is the
//! bare handshakes of the same devices at once: WebSocket connect plus the
//! `auth` frame, until every `auth.ok` has arrived.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures_util::future::try_join_all;
use futures_util::{SinkExt, StreamExt, TryStreamExt};
use serde::Serialize;
use tidemark_client::proto::{op, ConvCreateOk, ConvCreateReq, SendReq};
use tidemark_client::{Http, WsConn};
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;
use tokio_tungstenite::tungstenite::Message;

use super::fanout::{bar, cheap_hash, Device, PASSWORD};
use super::{init_logs, median, print_table, wait_store_closed, TempDir};

#[derive(clap::Args, Debug, Clone)]
pub struct ReconnectArgs {
    /// Devices (one user each) that reconnect at once.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
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
    #[arg(long, default_value = "bench-results/reconnect.json")]
    pub out: PathBuf,
    /// Where the temporary store goes (must be a real disk).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

const SETUP_CONCURRENCY: usize = 64;
const RUN_TIMEOUT: Duration = Duration::from_secs(300);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Serialize)]
struct Report {
    devices: u32,
    events_behind: u32,
    limit: u32,
    groups: usize,
    open_files_soft_limit: Option<u64>,
    setup_secs: f64,
    restart_secs: f64,
    all_caught_up_secs: f64,
    device_p50_ms: f64,
    device_p99_ms: f64,
    pages_per_resume: f64,
    requests_per_resume: f64,
    read_queries_per_resume: Option<f64>,
    baseline_all_handshakes_secs: f64,
    baseline_p50_ms: f64,
    baseline_p99_ms: f64,
}

/// The soft limit on open files, from /proc/self/limits.
fn open_files_soft_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

/// Connect, send the `auth` frame, wait for `auth.ok`.
async fn bare_handshake(url: &str, token: &str) -> Result<()> {
    let (ws, _) = tokio_tungstenite::connect_async_with_config(url, None, true).await?;
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

pub async fn run(args: ReconnectArgs) -> Result<()> {
    init_logs();
    let soft = open_files_soft_limit();
    let mut devices = args.devices;
    if let Some(soft) = soft {
        // Client and server ends of every socket live in this process.
        let cap = (soft.saturating_sub(200) / 2) as u32;
        eprintln!("open-file soft limit: {soft} (caps devices at {cap})");
        if devices > cap {
            eprintln!("note: --devices {devices} capped to {cap}");
            devices = cap;
        }
    }
    let n = devices as usize;
    let k = u64::from(args.events);
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = TempDir::create(&parent)?;

    // ---------------------------------------------------------- setup
    let setup = Instant::now();
    let pb = bar(n as u64 * 3, "setup steps");
    pb.set_message("setup: users, groups, devices");
    let store = SqliteStore::open(&dir.0)?;
    let hash = cheap_hash()?;
    let users: Vec<String> = (0..n).map(|i| format!("rc-u{i}")).collect();
    store.create_user("rc-sender", &hash, 0).await?;
    for u in &users {
        store.create_user(u, &hash, 0).await?;
    }
    let config = ServerConfig { retention: None, ..ServerConfig::default() };
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config.clone()).await?;
    let http = Http::new(&server.url());
    let ws_url = format!("ws://{}/v1/ws", server.addr);
    let sender_login = http.login("rc-sender", PASSWORD, "desk").await.context("sender login")?;
    let (sender, _sender_events) = WsConn::connect(&ws_url, &sender_login.access_token).await?;
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
    let logins: Vec<_> = futures_util::stream::iter(users.iter().map(|u| {
        let (http, pb) = (http.clone(), pb.clone());
        async move {
            let l = http.login(u, PASSWORD, "phone").await;
            pb.inc(1);
            l
        }
    }))
    .buffered(SETUP_CONCURRENCY)
    .try_collect()
    .await
    .context("log in")?;
    // Connect each device once and bring it to the head, then disconnect.
    let positions: Vec<(Option<u64>, u64)> = futures_util::stream::iter(logins.iter().map(|l| {
        let (ws_url, pb) = (ws_url.clone(), pb.clone());
        async move {
            let (ws, _events) = WsConn::connect(&ws_url, &l.access_token).await?;
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
    pb.set_message("setup: messages while away");
    try_join_all(convs.iter().enumerate().map(|(g, conv)| {
        let sender = sender.clone();
        async move {
            for m in 0..k {
                let req = SendReq {
                    conv: conv.clone(),
                    client_msg_id: format!("rc-{g}-{m}"),
                    kind: "text".into(),
                    content: serde_json::json!({ "text": "while you were away", "m": m }),
                };
                sender.send(&req).await?;
            }
            anyhow::Ok(())
        }
    }))
    .await
    .context("send")?;
    let drained = Instant::now();
    while store.outbox_stats().await?.backlog > 0 {
        ensure!(drained.elapsed() < DRAIN_TIMEOUT, "fan-out did not drain");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pb.inc(n as u64);
    drop(sender);
    let port = server.addr.port();
    server.stop().await;
    let weak = Arc::downgrade(&store);
    drop(store);
    wait_store_closed(weak, &dir.0).await;
    let setup_secs = setup.elapsed().as_secs_f64();
    pb.finish_and_clear();

    // ---------------------------------------------------------- restart
    let restart = Instant::now();
    let store = SqliteStore::open(&dir.0)?;
    let server =
        match Server::start(&format!("127.0.0.1:{port}"), store.clone() as Arc<dyn Store>, config.clone()).await {
            Ok(s) => s,
            Err(_) => Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await?,
        };
    let restart_secs = restart.elapsed().as_secs_f64();
    let ws_url = format!("ws://{}/v1/ws", server.addr);

    // ---------------------------------------------------------- resume storm
    let pb = bar(n as u64 * 2, "devices");
    pb.set_message("resume: all devices at once");
    let start = Arc::new(tokio::sync::Barrier::new(n + 1));
    let mut tasks = Vec::with_capacity(n);
    for (login, &(generation, applied)) in logins.iter().zip(&positions) {
        let (ws_url, token, start, pb) = (ws_url.clone(), login.access_token.clone(), start.clone(), pb.clone());
        let limit = args.limit;
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let t = Instant::now();
            let (ws, _events) = WsConn::connect(&ws_url, &token).await?;
            let mut dev = Device { ws, generation, applied, pages: 0, acks: 0 };
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
            anyhow::Ok((ms, dev.pages, requests))
        }));
    }
    start.wait().await;
    let t = Instant::now();
    let results = tokio::time::timeout(RUN_TIMEOUT, try_join_all(tasks)).await.context("resume timed out")??;
    let all_caught_up_secs = t.elapsed().as_secs_f64();
    let mut times = Vec::with_capacity(n);
    let (mut pages, mut requests) = (0u64, 0u64);
    for r in results {
        let (ms, p, q) = r?;
        times.push(ms);
        pages += p;
        requests += q;
    }

    // ---------------------------------------------------------- baseline
    pb.set_message("baseline: bare handshakes");
    // Let the server finish closing the resumed connections first.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Arc::new(tokio::sync::Barrier::new(n + 1));
    let mut tasks = Vec::with_capacity(n);
    for login in &logins {
        let (ws_url, token, start, pb) = (ws_url.clone(), login.access_token.clone(), start.clone(), pb.clone());
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
    let mut base_times = results.into_iter().collect::<Result<Vec<_>>>()?;
    pb.finish_and_clear();
    server.stop().await;

    times.sort_by(f64::total_cmp);
    base_times.sort_by(f64::total_cmp);
    let report = Report {
        devices,
        events_behind: args.events,
        limit: args.limit,
        groups: convs.len(),
        open_files_soft_limit: soft,
        setup_secs,
        restart_secs,
        all_caught_up_secs,
        device_p50_ms: median(times.clone()),
        device_p99_ms: pct(&times, 0.99),
        pages_per_resume: pages as f64 / n as f64,
        requests_per_resume: requests as f64 / n as f64,
        read_queries_per_resume: None,
        baseline_all_handshakes_secs: baseline_secs,
        baseline_p50_ms: median(base_times.clone()),
        baseline_p99_ms: pct(&base_times, 0.99),
    };
    println!(
        "tidemark bench reconnect: {} devices, each {} events behind, server restarted on the same data dir \
         ({:.2} s), all reconnect at once; pages of {}\n",
        devices, args.events, restart_secs, args.limit
    );
    let r = &report;
    print_table(
        &["run", "all done s", "device p50 ms", "device p99 ms", "pages/resume", "requests/resume"],
        &[
            vec![
                "resume + catch up".into(),
                format!("{:.3}", r.all_caught_up_secs),
                format!("{:.1}", r.device_p50_ms),
                format!("{:.1}", r.device_p99_ms),
                format!("{:.2}", r.pages_per_resume),
                format!("{:.2}", r.requests_per_resume),
            ],
            vec![
                "baseline: bare handshakes".into(),
                format!("{:.3}", r.baseline_all_handshakes_secs),
                format!("{:.1}", r.baseline_p50_ms),
                format!("{:.1}", r.baseline_p99_ms),
                "-".into(),
                "1 (auth)".into(),
            ],
            vec![
                "ratio".into(),
                format!("{:.2}x", r.all_caught_up_secs / r.baseline_all_handshakes_secs.max(f64::MIN_POSITIVE)),
                format!("{:.2}x", r.device_p50_ms / r.baseline_p50_ms.max(f64::MIN_POSITIVE)),
                format!("{:.2}x", r.device_p99_ms / r.baseline_p99_ms.max(f64::MIN_POSITIVE)),
                String::new(),
                String::new(),
            ],
        ],
    );
    println!("\nstore read queries per resume: not counted (the store has no read counter); pages per resume instead");
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "reconnect",
        "note": "baseline = WebSocket connect + auth frame of the same devices at once against the same restarted \
                 server; read queries are not counted (no counter in the store), pages per resume instead",
        "report": report,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
