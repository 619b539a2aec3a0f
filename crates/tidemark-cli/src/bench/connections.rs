//! `bench connections`: server memory per idle authenticated WebSocket.
//!
//! The server runs as the real binary (`tidemark serve`, a child process on
//! a fresh data directory) so its resident set is not mixed with the
//! clients'. M clients connect from several 127.0.0.x source addresses
//! (so one address's port range is not exhausted), each authenticates with
//! an `auth` frame and waits for `auth.ok`, then stays idle. Measured:
//! (VmRSS of the server after the connections settle − VmRSS before) / M.
//!
//! The baseline, in the same run, is a bare tokio-tungstenite server in a
//! child process (this binary with a hidden flag) with the same buffer
//! sizes: the same frame and message limit (256 KiB), the gateway's read
//! and write buffer sizes (`WS_READ_BUFFER_BYTES`, `WS_WRITE_BUFFER_BYTES`),
//! and a bounded outgoing queue of 256 frames per connection. It answers `auth` with `auth.ok`
//! without checking the token. The same clients connect the same way.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use futures_util::{SinkExt, StreamExt, TryStreamExt};
use serde::Serialize;
use tidemark_client::Http;
use tokio::net::{TcpListener, TcpSocket};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::device::bar;
use super::proc::{create_users, open_files_soft_limit, rss_kib, spawn_server, spawn_tidemark};
use super::stores::StoreAt;
use super::{init_logs, median, print_table, TempDir};

#[derive(clap::Args, Debug, Clone)]
pub struct ConnectionsArgs {
    /// Idle authenticated connections (capped by the open-file limit).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub connections: u32,
    /// Source addresses 127.0.0.2 .. 127.0.0.(1+N) the clients bind to.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(1..=250))]
    pub sources: u8,
    /// Rounds, each starting both servers afresh; the summary is the
    /// median.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Seconds to let the servers settle before reading their RSS.
    #[arg(long, default_value_t = 2)]
    pub settle_secs: u64,
    #[arg(long, default_value = "bench-results/connections.json")]
    pub out: PathBuf,
    /// Where the temporary store goes.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Internal: run the bare baseline server and print its address.
    #[arg(long, hide = true)]
    pub serve_baseline: bool,
}

const FRAME_MAX: usize = tidemark_client::proto::FRAME_BYTES_MAX;
const QUEUE_MAX: usize = 256;
const SETUP_CONCURRENCY: usize = 64;

fn ws_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(FRAME_MAX))
        .max_frame_size(Some(FRAME_MAX))
        .read_buffer_size(tidemark_server::gateway::WS_READ_BUFFER_BYTES)
        .write_buffer_size(tidemark_server::gateway::WS_WRITE_BUFFER_BYTES)
}

/// The bare server: WebSocket accept, answer `auth` with `auth.ok`, then
/// hold the connection with a bounded outgoing queue, as a real server
/// would for pushes.
async fn serve_baseline() -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("baseline listening on {}", listener.local_addr()?);
    use std::io::Write;
    std::io::stdout().flush()?;
    loop {
        let (tcp, _) = listener.accept().await?;
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            let Ok(ws) = tokio_tungstenite::accept_async_with_config(tcp, Some(ws_config())).await else { return };
            let (mut sink, mut stream) = ws.split();
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Message>(QUEUE_MAX);
            let writer = tokio::spawn(async move {
                while let Some(m) = rx.recv().await {
                    if sink.send(m).await.is_err() {
                        break;
                    }
                }
            });
            while let Some(Ok(msg)) = stream.next().await {
                if let Message::Text(t) = msg {
                    let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap_or_default();
                    let rid = v.get("rid").cloned().unwrap_or_default();
                    let reply = serde_json::json!({ "t": "auth.ok", "rid": rid, "user": "u", "device_id": "d" });
                    if tx.send(Message::Text(reply.to_string().into())).await.is_err() {
                        break;
                    }
                }
            }
            writer.abort();
        });
    }
}

/// Opens one client connection from `source`, authenticates, and returns
/// the open socket.
async fn client(source: Ipv4Addr, server: SocketAddr, token: &str) -> Result<WebSocketStream<tokio::net::TcpStream>> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source.into(), 0))?;
    let tcp = socket.connect(server).await?;
    tcp.set_nodelay(true)?;
    let url = format!("ws://{server}/v1/ws");
    // The SDK's socket settings: tungstenite's default 128 KiB read buffer
    // would hold 2.4 GiB in this process at 19 000 connections.
    let (mut ws, _) = tokio_tungstenite::client_async_with_config(url, tcp, Some(tidemark_client::ws_config())).await?;
    let frame = serde_json::json!({ "t": "auth", "rid": "a1", "token": token });
    ws.send(Message::Text(frame.to_string().into())).await?;
    while let Some(msg) = ws.next().await {
        if let Message::Text(t) = msg? {
            let v: serde_json::Value = serde_json::from_str(t.as_str())?;
            if v.get("rid").and_then(|r| r.as_str()) == Some("a1") {
                ensure!(v.get("t").and_then(|t| t.as_str()) == Some("auth.ok"), "auth refused: {v}");
                return Ok(ws);
            }
        }
    }
    bail!("closed before auth.ok")
}

#[derive(Debug, Clone, Serialize)]
struct RoundResult {
    round: u32,
    tidemark: Measure,
    baseline: Measure,
}

#[derive(Debug, Clone, Serialize)]
struct Measure {
    connections: u32,
    rss_before_kib: u64,
    rss_after_kib: u64,
    kib_per_connection: f64,
}

async fn measure(
    name: &str,
    pid: u32,
    addr: SocketAddr,
    tokens: &[String],
    args: &ConnectionsArgs,
    pb: &indicatif::ProgressBar,
) -> Result<Measure> {
    pb.set_message(format!("{name}: connecting"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pid)?;
    let conns: Vec<_> = futures_util::stream::iter(tokens.iter().enumerate().map(|(i, token)| {
        let source = Ipv4Addr::new(127, 0, 0, 2 + (i % args.sources as usize) as u8);
        let pb = pb.clone();
        async move {
            let c = client(source, addr, token).await;
            pb.inc(1);
            c
        }
    }))
    .buffer_unordered(SETUP_CONCURRENCY)
    .try_collect()
    .await
    .with_context(|| format!("{name}: connect"))?;
    pb.set_message(format!("{name}: settling"));
    tokio::time::sleep(Duration::from_secs(args.settle_secs)).await;
    let after = rss_kib(pid)?;
    let n = conns.len() as u32;
    drop(conns);
    Ok(Measure {
        connections: n,
        rss_before_kib: before,
        rss_after_kib: after,
        kib_per_connection: after.saturating_sub(before) as f64 / f64::from(n),
    })
}

pub async fn run(args: ConnectionsArgs) -> Result<()> {
    if args.serve_baseline {
        return serve_baseline().await;
    }
    init_logs();
    let soft = open_files_soft_limit();
    let mut m = args.connections;
    if let Some(soft) = soft {
        let cap = soft.saturating_sub(200) as u32;
        eprintln!("open-file soft limit: {soft} (caps connections at {cap}); not raised (no rlimit dependency)");
        if m > cap {
            eprintln!("note: --connections {m} capped to {cap}");
            m = cap;
        }
    }
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = TempDir::create(&parent)?;
    let pb = bar(u64::from(m) * 3, "steps");

    // Users with a cheap password hash, written before the server starts.
    pb.set_message("setup: users");
    let users: Vec<String> = (0..m).map(|i| format!("cn-u{i}")).collect();
    create_users(&StoreAt::Dir(dir.0.clone()), &users, &indicatif::ProgressBar::hidden()).await?;
    let (server, addr) = spawn_tidemark(&StoreAt::Dir(dir.0.clone()), "127.0.0.1:0")?;
    let http = Http::new(&format!("http://{addr}"));
    pb.set_message("setup: logins");
    let tokens = super::reconnect::log_in(&http, &users, &pb).await?;
    drop(server);
    pb.finish_and_clear();
    // Each round starts both servers afresh (an allocator keeps freed
    // memory, so a server is measured once) and alternates which goes
    // first.
    let mut rounds = Vec::new();
    for round in 1..=args.rounds {
        let pb = bar(u64::from(m) * 2, "connections");
        let order: [bool; 2] = if round % 2 == 1 { [true, false] } else { [false, true] };
        let (mut tidemark, mut baseline) = (None, None);
        for is_tidemark in order {
            if is_tidemark {
                let (server, addr) = spawn_tidemark(&StoreAt::Dir(dir.0.clone()), "127.0.0.1:0")?;
                tidemark = Some(measure("tidemark", server.pid(), addr, &tokens, &args, &pb).await?);
            } else {
                let (base, base_addr) = spawn_server(&["bench", "connections", "--serve-baseline"])?;
                baseline = Some(measure("baseline", base.pid(), base_addr, &tokens, &args, &pb).await?);
            }
        }
        pb.finish_and_clear();
        let (tidemark, baseline) = (tidemark.context("tidemark round")?, baseline.context("baseline round")?);
        eprintln!(
            "round {round}: {:.1} KiB/connection (baseline {:.1})",
            tidemark.kib_per_connection, baseline.kib_per_connection
        );
        rounds.push(RoundResult { round, tidemark, baseline });
    }
    let med_t = median(rounds.iter().map(|r| r.tidemark.kib_per_connection).collect());
    let med_b = median(rounds.iter().map(|r| r.baseline.kib_per_connection).collect());

    println!(
        "tidemark bench connections: {} idle authenticated WebSockets from {} source addresses, server in its own \
         process (VmRSS delta / connections), median of {} rounds\n",
        m,
        args.sources,
        rounds.len()
    );
    let mut rows = Vec::new();
    for r in &rounds {
        for (name, x) in [("tidemark serve", &r.tidemark), ("baseline: bare tokio-tungstenite", &r.baseline)] {
            rows.push(vec![
                format!("{} #{}", name, r.round),
                format!("{}", x.connections),
                format!("{:.1}", x.rss_before_kib as f64 / 1024.0),
                format!("{:.1}", x.rss_after_kib as f64 / 1024.0),
                format!("{:.1}", x.kib_per_connection),
            ]);
        }
    }
    rows.push(vec![
        "median: tidemark serve".into(),
        String::new(),
        String::new(),
        String::new(),
        format!("{med_t:.1}"),
    ]);
    rows.push(vec!["median: baseline".into(), String::new(), String::new(), String::new(), format!("{med_b:.1}")]);
    rows.push(vec![
        "ratio of medians".into(),
        String::new(),
        String::new(),
        String::new(),
        format!("{:.2}x", med_t / med_b.max(f64::MIN_POSITIVE)),
    ]);
    print_table(&["server", "connections", "RSS before MiB", "RSS after MiB", "KiB/connection"], &rows);
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "connections",
        "note": "server RSS per idle authenticated connection, server in a child process; baseline = bare \
                 tokio-tungstenite server (same frame limit, default buffers, 256-frame queue) in a child process",
        "open_files_soft_limit": soft, "sources": args.sources, "connections": m,
        "median_kib_per_connection": { "tidemark": med_t, "baseline": med_b },
        "rounds": rounds,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}
