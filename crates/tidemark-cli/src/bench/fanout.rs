//! `bench fanout`: one sender writes to a group; every other member has one
//! connected device that syncs on each hint and ACKs each page, as the SDK
//! does. Measured: deliveries per second (messages × receiving devices over
//! the time from the first send to the last delivery) and the end-to-end
//! latency of each delivery, from the moment the sender starts its `send`
//! to the moment the receiving device holds the event in a sync page.
//!
//! The baseline, in the same run and the same process, is a bare
//! tokio-tungstenite broadcast server: the same sender (closed loop, waits
//! for an `ok` per message) and the same number of WebSocket clients, each
//! payload (the same JSON event) pushed as one frame to every client, with
//! no store, no fan-out, no hint/sync/ACK round trips. Latency is measured
//! the same way, on the same clock.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::future::try_join_all;
use futures_util::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tidemark_client::proto::{op, ConvCreateOk, ConvCreateReq, SendReq, SyncReq, UserEvent};
use tidemark_client::{Http, ServerEvent, WsConn};
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::Message;

use super::{init_logs, print_table, TempDir};

#[derive(clap::Args, Debug, Clone)]
pub struct FanoutArgs {
    /// Group sizes, members including the sender (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![10u32, 100])]
    pub groups: Vec<u32>,
    /// Messages the sender sends to each group, one after another (each
    /// waits for its send.ok).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub messages: u32,
    /// Events per sync page.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    #[arg(long, default_value = "bench-results/fanout.json")]
    pub out: PathBuf,
    /// Where the temporary stores go (must be a real disk).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub(super) const PASSWORD: &str = "bench-password";
const TEXT: &str = "The quick brown fox jumps over the lazy dog; benchmark payload.";
const LATENCY_MAX_US: u64 = 120_000_000;
/// A receiver that got no hint for this long syncs anyway (hints may be
/// lost by design); such polls are counted.
const HINT_WAIT: Duration = Duration::from_millis(500);
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// A password hash with the cheapest Argon2 parameters, computed once and
/// stored for every bench user: logins verify with the parameters in the
/// hash, so setting up hundreds of devices does not cost seconds of Argon2.
/// Setup only; nothing measured logs in.
pub(super) fn cheap_hash() -> Result<String> {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let params = argon2::Params::new(8, 1, 1, None).map_err(|e| anyhow::anyhow!("{e}"))?;
    let argon = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let salt = SaltString::from_b64("YmVuY2hzYWx0YmVuY2g").map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(argon.hash_password(PASSWORD.as_bytes(), &salt).map_err(|e| anyhow::anyhow!("{e}"))?.to_string())
}

pub(super) fn bar(len: u64, unit: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} {{msg:<30}} [{{bar:30}}] {{pos}}/{{len}} {unit}  {{per_sec}}  eta {{eta}}"
        ))
        .expect("static template")
        .progress_chars("=> "),
    );
    pb
}

/// A device's sync position and its connection, synced the way the SDK
/// does: a batch from its first page to `has_more: false`, each page ACKed.
pub(super) struct Device {
    pub ws: WsConn,
    pub generation: Option<u64>,
    pub applied: u64,
    pub pages: u64,
    pub acks: u64,
}

impl Device {
    pub(super) fn new(ws: WsConn) -> Device {
        Device { ws, generation: None, applied: 0, pages: 0, acks: 0 }
    }

    /// One sync batch; `on_event` sees every event not applied before.
    pub(super) async fn catch_up(&mut self, limit: u32, mut on_event: impl FnMut(&UserEvent)) -> Result<()> {
        let first = SyncReq {
            sync_generation: self.generation,
            local_applied_sync_seq: Some(self.applied),
            limit: Some(limit),
            ..SyncReq::default()
        };
        let mut page = self.ws.sync(&first).await.context("sync")?;
        let token = page.batch_token.clone();
        let mut acked = page.resume_from;
        if self.generation != Some(page.sync_generation) {
            self.applied = page.resume_from;
        }
        self.generation = Some(page.sync_generation);
        loop {
            self.pages += 1;
            let mut top = acked;
            for ev in &page.events {
                if ev.sync_seq > self.applied {
                    on_event(ev);
                }
                top = top.max(ev.sync_seq);
            }
            let ack_to = if page.has_more { top } else { page.batch_high_watermark.max(top) };
            if ack_to > acked {
                self.ws.ack(&token, ack_to).await.context("ack")?;
                self.acks += 1;
                acked = ack_to;
            }
            self.applied = self.applied.max(acked);
            if !page.has_more {
                return Ok(());
            }
            let next = SyncReq {
                batch_token: Some(token.clone()),
                cursor: page.next_cursor.clone(),
                limit: Some(limit),
                ..SyncReq::default()
            };
            page = self.ws.sync(&next).await.context("sync next page")?;
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct Run {
    members: u32,
    receivers: u32,
    messages: u32,
    deliveries: u64,
    secs: f64,
    deliveries_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Tidemark only: sync pages fetched and polls after a missing hint.
    pages: u64,
    polls_without_hint: u64,
}

fn payload(n: u64) -> serde_json::Value {
    serde_json::json!({ "text": TEXT, "n": n })
}

fn finish(members: u32, messages: u32, hists: Vec<Histogram<u64>>, secs: f64, pages: u64, polls: u64) -> Result<Run> {
    let mut all = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
    for h in &hists {
        all.add(h)?;
    }
    let deliveries = all.len();
    let ms = |q: f64| all.value_at_quantile(q) as f64 / 1000.0;
    Ok(Run {
        members,
        receivers: members - 1,
        messages,
        deliveries,
        secs,
        deliveries_per_s: deliveries as f64 / secs.max(f64::MIN_POSITIVE),
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        max_ms: all.max() as f64 / 1000.0,
        pages,
        polls_without_hint: polls,
    })
}

async fn tidemark_run(parent: &std::path::Path, members: u32, args: &FanoutArgs, pb: &ProgressBar) -> Result<Run> {
    let dir = TempDir::create(parent)?;
    let store = SqliteStore::open(&dir.0)?;
    let hash = cheap_hash()?;
    let users: Vec<String> = (0..members).map(|i| format!("fan-u{i}")).collect();
    for u in &users {
        store.create_user(u, &hash, 0).await?;
    }
    let config = ServerConfig { retention: None, ..ServerConfig::default() };
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await?;
    let http = Http::new(&server.url());
    let logins = try_join_all(users.iter().map(|u| http.login(u, PASSWORD, "phone"))).await.context("log in")?;
    let ws_url = format!("ws://{}/v1/ws", server.addr);
    let mut conns = try_join_all(logins.iter().map(|l| WsConn::connect(&ws_url, &l.access_token)))
        .await
        .context("connect")?
        .into_iter();
    let (sender, _sender_events) = conns.next().context("no sender")?;

    let messages = u64::from(args.messages);
    let sent_at: Arc<Vec<AtomicU64>> = Arc::new((0..messages).map(|_| AtomicU64::new(0)).collect());
    let epoch = Instant::now();
    let ready = Arc::new(tokio::sync::Barrier::new(members as usize));
    let last_delivery = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (ws, mut events) in conns {
        let (sent_at, ready, pb, last) = (sent_at.clone(), ready.clone(), pb.clone(), last_delivery.clone());
        let limit = args.limit;
        tasks.push(tokio::spawn(async move {
            let mut dev = Device::new(ws);
            let mut hist = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
            let mut polls = 0u64;
            dev.catch_up(limit, |_| {}).await?;
            ready.wait().await;
            let mut got = 0u64;
            while got < messages {
                match tokio::time::timeout(HINT_WAIT, events.recv()).await {
                    Ok(Some(ServerEvent::Hint { .. })) => {}
                    Ok(Some(other)) => bail!("receiver: {other:?}"),
                    Ok(None) => bail!("receiver: event stream ended"),
                    Err(_) => polls += 1,
                }
                while events.try_recv().is_ok() {}
                dev.catch_up(limit, |ev| {
                    let n = ev.message.as_ref().and_then(|m| m.content.get("n")).and_then(|n| n.as_u64());
                    if let (Some(n), "message") = (n, ev.kind.as_str()) {
                        let now = epoch.elapsed().as_micros() as u64;
                        let t0 = sent_at[n as usize].load(Ordering::Relaxed);
                        hist.saturating_record(now.saturating_sub(t0).max(1));
                        last.fetch_max(now, Ordering::Relaxed);
                        got += 1;
                        pb.inc(1);
                    }
                })
                .await?;
            }
            Ok((hist, dev.pages, polls))
        }));
    }
    ready.wait().await;
    let others: Vec<String> = users[1..].to_vec();
    let conv: ConvCreateOk = sender
        .request(op::CONV_CREATE, &ConvCreateReq { kind: "group".into(), members: others, client_msg_id: None })
        .await
        .context("create group")?;
    let start = epoch.elapsed().as_micros() as u64;
    for n in 0..messages {
        sent_at[n as usize].store(epoch.elapsed().as_micros() as u64, Ordering::Relaxed);
        let req = SendReq {
            conv: conv.conv.clone(),
            client_msg_id: format!("fan-{members}-{n}"),
            kind: "text".into(),
            content: payload(n),
        };
        sender.send(&req).await.with_context(|| format!("send {n}"))?;
    }
    let results = tokio::time::timeout(RUN_TIMEOUT, try_join_all(tasks)).await.context("receivers timed out")??;
    let (mut hists, mut pages, mut polls) = (Vec::new(), 0, 0);
    for r in results {
        let (h, p, q) = r?;
        hists.push(h);
        pages += p;
        polls += q;
    }
    let secs = (last_delivery.load(Ordering::Relaxed).saturating_sub(start)) as f64 / 1e6;
    drop(sender);
    server.stop().await;
    finish(members, args.messages, hists, secs, pages, polls)
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

async fn baseline_run(members: u32, args: &FanoutArgs, pb: &ProgressBar) -> Result<Run> {
    let (addr, server) = baseline_server().await?;
    let url = format!("ws://{addr}/");
    let messages = u64::from(args.messages);
    let sent_at: Arc<Vec<AtomicU64>> = Arc::new((0..messages).map(|_| AtomicU64::new(0)).collect());
    let epoch = Instant::now();
    let last_delivery = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let mut readies = Vec::new();
    for _ in 1..members {
        let (ws, _) = tokio_tungstenite::connect_async_with_config(url.as_str(), None, true).await?;
        let (mut sink, mut stream) = ws.split();
        sink.send(Message::Text("sub".into())).await?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
        readies.push(ready_rx);
        let (sent_at, pb, last) = (sent_at.clone(), pb.clone(), last_delivery.clone());
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
            let mut ready_tx = Some(ready_tx);
            let mut got = 0u64;
            while got < messages {
                let Some(msg) = stream.next().await else { bail!("baseline client: closed") };
                let Message::Text(text) = msg? else { continue };
                if text.as_str() == "ready" {
                    if let Some(r) = ready_tx.take() {
                        let _ = r.send(());
                    }
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(text.as_str())?;
                let n = v.pointer("/message/content/n").and_then(|n| n.as_u64()).context("payload n")?;
                let now = epoch.elapsed().as_micros() as u64;
                let t0 = sent_at[n as usize].load(Ordering::Relaxed);
                hist.saturating_record(now.saturating_sub(t0).max(1));
                last.fetch_max(now, Ordering::Relaxed);
                got += 1;
                pb.inc(1);
            }
            drop(sink);
            Ok(hist)
        }));
    }
    for r in readies {
        r.await.context("subscriber not ready")?;
    }
    let (ws, _) = tokio_tungstenite::connect_async_with_config(url.as_str(), None, true).await?;
    let (mut sink, mut stream) = ws.split();
    sink.send(Message::Text("pub".into())).await?;
    let start = epoch.elapsed().as_micros() as u64;
    for n in 0..messages {
        sent_at[n as usize].store(epoch.elapsed().as_micros() as u64, Ordering::Relaxed);
        // The same JSON a sync page carries for this message.
        let event = serde_json::json!({
            "sync_seq": n + 1, "kind": "message", "conv": "g-baseline", "msg_seq": n + 1,
            "message": {
                "message_id": format!("m{n:012}"), "conv": "g-baseline", "msg_seq": n + 1, "kind": "text",
                "state": "normal", "sender": "fan-u0", "content": payload(n), "created_at": 0, "version": 0,
            }
        });
        sink.send(Message::Text(event.to_string().into())).await?;
        loop {
            match stream.next().await {
                Some(Ok(Message::Text(t))) if t.as_str() == "ok" => break,
                Some(Ok(_)) => continue,
                _ => bail!("baseline sender: closed"),
            }
        }
    }
    let results = tokio::time::timeout(RUN_TIMEOUT, try_join_all(tasks)).await.context("baseline timed out")??;
    let hists = results.into_iter().collect::<Result<Vec<_>>>()?;
    let secs = (last_delivery.load(Ordering::Relaxed).saturating_sub(start)) as f64 / 1e6;
    server.abort();
    finish(members, args.messages, hists, secs, 0, 0)
}

pub async fn run(args: FanoutArgs) -> Result<()> {
    init_logs();
    for &m in &args.groups {
        anyhow::ensure!(m >= 2, "a group needs at least 2 members");
    }
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let total: u64 = args.groups.iter().map(|&m| 2 * u64::from(m - 1) * u64::from(args.messages)).sum();
    let pb = bar(total, "deliveries");
    let mut pairs = Vec::new();
    for &members in &args.groups {
        pb.set_message(format!("tidemark, group of {members}"));
        let server = tidemark_run(&parent, members, &args, &pb).await?;
        pb.set_message(format!("baseline, group of {members}"));
        let baseline = baseline_run(members, &args, &pb).await?;
        pairs.push((server, baseline));
    }
    pb.finish_and_clear();
    println!(
        "tidemark bench fanout: one sender, {} messages per group (closed loop), every other member one \
         device that syncs on each hint and ACKs; latency = sender's send start -> event in the device's sync page\n",
        args.messages
    );
    let mut rows = Vec::new();
    for (s, b) in &pairs {
        for (name, r) in [("tidemark", s), ("baseline", b)] {
            rows.push(vec![
                format!("{} ({} members)", name, r.members),
                format!("{}", r.deliveries),
                format!("{:.0}", r.deliveries_per_s),
                format!("{:.2}", r.p50_ms),
                format!("{:.2}", r.p99_ms),
                format!("{:.2}", r.max_ms),
                if name == "tidemark" {
                    format!("{:.2}", r.pages as f64 / r.deliveries.max(1) as f64)
                } else {
                    "-".into()
                },
            ]);
        }
        rows.push(vec![
            format!("tidemark/baseline ({})", s.members),
            String::new(),
            format!("{:.3}", s.deliveries_per_s / b.deliveries_per_s.max(f64::MIN_POSITIVE)),
            format!("{:.1}x", s.p50_ms / b.p50_ms.max(f64::MIN_POSITIVE)),
            format!("{:.1}x", s.p99_ms / b.p99_ms.max(f64::MIN_POSITIVE)),
            String::new(),
            String::new(),
        ]);
    }
    print_table(&["run", "deliveries", "deliveries/s", "p50 ms", "p99 ms", "max ms", "pages/delivery"], &rows);
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "fanout",
        "note": "baseline = bare tokio-tungstenite broadcast server in the same process, same sender loop, same payload \
                 JSON, one frame per message per client; latency from send start to the event at the receiving device",
        "messages": args.messages, "limit": args.limit,
        "runs": pairs.iter().map(|(s, b)| serde_json::json!({ "tidemark": s, "baseline": b })).collect::<Vec<_>>(),
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}
