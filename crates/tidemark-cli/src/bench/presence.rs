//! `bench presence`: a presence and typing storm (issue 18). N connected
//! users in groups of G each report presence (idle/online in turn) and type
//! in their group at a steady rate; one probe device meanwhile sends in a
//! closed loop and syncs (a batch, ACKed, as the SDK does) after each send. Measured: ephemeral
//! frames delivered per second, and the p99 of the probe's `send` and sync
//! page, in a quiet phase and in a storm phase of the same run on the same
//! server (the quiet phase is the baseline; goal: storm p99 within 1.2x).
//! Each round is a quiet phase then a storm phase; the summary is each
//! figure's median over the rounds, the ratios the medians of each round's.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::json;
use tidemark_client::proto::SendReq;
use tidemark_client::{Http, ServerEvent, WsConn};
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

use super::device::{cheap_hash, Device, PASSWORD};
use super::{init_logs, print_table, unix_ms, TempDir, LATENCY_MAX_US};

#[derive(clap::Args, Debug, Clone)]
pub struct PresenceArgs {
    /// Connected users taking part in the storm.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(2..=20_000))]
    pub users: u32,
    /// Members per group (each user is in one group).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub group: u32,
    /// Seconds of each phase (quiet, then storm).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Each user changes presence (idle, online, ...) this often.
    #[arg(long, default_value_t = 5_000)]
    pub presence_every_ms: u64,
    /// Each user sends a typing start in its group this often.
    #[arg(long, default_value_t = 2_000)]
    pub typing_every_ms: u64,
    /// Rounds (a quiet phase, then a storm phase); the summary is the median.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    #[arg(long, default_value = "bench-results/presence.json")]
    pub out: PathBuf,
    /// Where the temporary store goes.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The ephemeral frames have settled when none arrived for this long.
const SETTLED_AFTER: Duration = Duration::from_millis(300);
/// The longest wait for them to settle between phases.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Serialize)]
struct Phase {
    round: u32,
    storm: bool,
    seconds: f64,
    ephemeral_frames_per_sec: f64,
    storm_requests_per_sec: f64,
    sends: u64,
    send_p50_ms: f64,
    send_p99_ms: f64,
    sync_p50_ms: f64,
    sync_p99_ms: f64,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

pub async fn run(args: PresenceArgs) -> Result<()> {
    init_logs();
    let root = TempDir::create(&args.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let store = SqliteStore::open(&root.0.join("server")).context("open store")?;
    let config = ServerConfig { limits: tidemark_server::limits::LimitsConfig::off(), ..ServerConfig::default() };
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await.context("start server")?;
    let result = storm(&args, &server, &*store).await;
    server.stop().await;
    let phases = result?;
    let row = |label: String, p: &Phase| {
        vec![
            label,
            format!("{:.0}", p.ephemeral_frames_per_sec),
            format!("{:.0}", p.storm_requests_per_sec),
            p.sends.to_string(),
            format!("{:.2}", p.send_p50_ms),
            format!("{:.2}", p.send_p99_ms),
            format!("{:.2}", p.sync_p50_ms),
            format!("{:.2}", p.sync_p99_ms),
        ]
    };
    let header =
        ["phase", "eph frames/s", "storm req/s", "sends", "send p50 ms", "send p99 ms", "sync p50 ms", "sync p99 ms"];
    let (quiet, loud) = (median_phase(&phases, false), median_phase(&phases, true));
    println!(
        "tidemark bench presence: {} users in groups of {}, presence every {} ms, typing every {} ms; \
         phases of {} s; median of {} rounds\n",
        args.users, args.group, args.presence_every_ms, args.typing_every_ms, args.seconds, args.rounds
    );
    print_table(&header, &[row("quiet".into(), &quiet), row("storm".into(), &loud)]);
    let ratios = |f: fn(&Phase) -> f64| {
        let per_round: Vec<f64> = phases.chunks(2).map(|pair| f(&pair[1]) / f(&pair[0]).max(0.001)).collect();
        super::median(per_round)
    };
    let send_ratio = ratios(|p| p.send_p99_ms);
    let sync_ratio = ratios(|p| p.sync_p99_ms);
    println!("storm/quiet p99 (median of the rounds' ratios): send {send_ratio:.2}x, sync page {sync_ratio:.2}x (goal: within 1.2x)");
    println!("\nper round:");
    let rows: Vec<Vec<String>> =
        phases.iter().map(|p| row(format!("{} {}", p.round, if p.storm { "storm" } else { "quiet" }), p)).collect();
    print_table(&header, &rows);
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let report = json!({"users": args.users, "group": args.group, "presence_every_ms": args.presence_every_ms,
        "typing_every_ms": args.typing_every_ms, "seconds": args.seconds, "rounds": args.rounds,
        "summary": {"quiet": quiet, "storm": loud}, "phases": phases,
        "send_p99_ratio": send_ratio, "sync_p99_ratio": sync_ratio});
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// The median quiet (or storm) phase: each figure the median of the rounds'.
fn median_phase(phases: &[Phase], storm: bool) -> Phase {
    let of: Vec<&Phase> = phases.iter().filter(|p| p.storm == storm).collect();
    let med = |f: fn(&Phase) -> f64| super::median(of.iter().map(|p| f(p)).collect());
    Phase {
        round: 0,
        storm,
        seconds: med(|p| p.seconds),
        ephemeral_frames_per_sec: med(|p| p.ephemeral_frames_per_sec),
        storm_requests_per_sec: med(|p| p.storm_requests_per_sec),
        sends: med(|p| p.sends as f64) as u64,
        send_p50_ms: med(|p| p.send_p50_ms),
        send_p99_ms: med(|p| p.send_p99_ms),
        sync_p50_ms: med(|p| p.sync_p50_ms),
        sync_p99_ms: med(|p| p.sync_p99_ms),
    }
}

async fn storm(args: &PresenceArgs, server: &tidemark_server::RunningServer, store: &dyn Store) -> Result<Vec<Phase>> {
    let hash = cheap_hash()?;
    let names: Vec<String> = (0..args.users).map(|i| format!("p{i:05}")).collect();
    for n in names.iter().chain(["probe".to_string(), "peer".to_string()].iter()) {
        store.create_user(n, &hash, unix_ms()).await?;
    }
    let http = Http::new(&server.url());
    let ws_url = format!("ws://{}/v1/ws", server.addr);
    let frames = Arc::new(AtomicU64::new(0));
    let mut users = Vec::new();
    for n in &names {
        let login = http.login(n, PASSWORD, "bench").await?;
        let (ws, mut events) = WsConn::connect(&ws_url, &login.access_token).await?;
        let frames = frames.clone();
        tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                if matches!(ev, ServerEvent::Typing(_) | ServerEvent::Presence(_)) {
                    frames.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        users.push(ws);
    }
    let mut groups = Vec::new();
    for chunk in (0..names.len()).collect::<Vec<_>>().chunks(args.group as usize) {
        let members: Vec<&str> = chunk[1..].iter().map(|&i| names[i].as_str()).collect();
        let v = users[chunk[0]].request_value("conv.create", json!({"kind": "group", "members": members})).await?;
        let conv = v["conv"].as_str().context("conv.create")?.to_owned();
        groups.extend(chunk.iter().map(|_| conv.clone()));
    }
    let login = http.login("probe", PASSWORD, "bench").await?;
    let (probe, _probe_events) = WsConn::connect(&ws_url, &login.access_token).await?;
    let direct = probe.conv_create_direct("peer").await?.conv;
    // The probe syncs as the SDK does: a batch, each page ACKed.
    let mut device = Device::new(probe.clone());
    device.catch_up(100, |_| {}).await?;
    let mut phases = Vec::new();
    for (round, storm) in (1..=args.rounds).flat_map(|r| [(r, false), (r, true)]) {
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        if storm {
            for (i, ws) in users.iter().enumerate() {
                let (ws, conv, stop, requests) = (ws.clone(), groups[i].clone(), stop.clone(), requests.clone());
                let (presence_every, typing_every) = (args.presence_every_ms, args.typing_every_ms);
                // Spread the users over the periods.
                let offset = Duration::from_millis((i as u64 * 37) % typing_every.max(1));
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep(offset).await;
                    let start = Instant::now();
                    let (mut next_presence, mut next_typing, mut idle) = (presence_every, 0u64, false);
                    while !stop.load(Ordering::Relaxed) {
                        let now = start.elapsed().as_millis() as u64;
                        if now >= next_typing {
                            let _ = ws.request_value("typing", json!({"conv": conv, "typing": true})).await;
                            requests.fetch_add(1, Ordering::Relaxed);
                            next_typing += typing_every;
                        }
                        if now >= next_presence {
                            idle = !idle;
                            let state = if idle { "idle" } else { "online" };
                            let _ = ws.request_value("presence.set", json!({"state": state})).await;
                            requests.fetch_add(1, Ordering::Relaxed);
                            next_presence += presence_every;
                        }
                        let wake = next_typing.min(next_presence).saturating_sub(start.elapsed().as_millis() as u64);
                        tokio::time::sleep(Duration::from_millis(wake.clamp(1, 100))).await;
                    }
                }));
            }
        }
        let frames_before = frames.load(Ordering::Relaxed);
        let mut send_h = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
        let mut sync_h = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
        let started = Instant::now();
        let mut n = 0u64;
        while started.elapsed() < Duration::from_secs(args.seconds) {
            let req = SendReq {
                conv: direct.clone(),
                client_msg_id: format!("probe-{round}-{storm}-{n}"),
                kind: "text".into(),
                content: json!({"text": "probe"}),
                mentions: Vec::new(),
                mention_all: false,
            };
            let t = Instant::now();
            probe.send(&req).await?;
            send_h.record(t.elapsed().as_micros().max(1) as u64)?;
            let t = Instant::now();
            device.catch_up(100, |_| {}).await?;
            sync_h.record(t.elapsed().as_micros().max(1) as u64)?;
            n += 1;
        }
        let seconds = started.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            let _ = t.await;
        }
        let delivered = frames.load(Ordering::Relaxed) - frames_before;
        ensure!(n > 0, "the probe sent nothing");
        if storm {
            // The next quiet phase stays quiet: every typing is stopped now
            // (not by the server's expiry sweep during it), and the stops
            // have arrived.
            for (i, ws) in users.iter().enumerate() {
                ws.request_value("typing", json!({"conv": groups[i], "typing": false})).await?;
            }
            settle(&frames).await;
        }
        phases.push(Phase {
            round,
            storm,
            seconds,
            ephemeral_frames_per_sec: delivered as f64 / seconds,
            storm_requests_per_sec: requests.load(Ordering::Relaxed) as f64 / seconds,
            sends: n,
            send_p50_ms: ms(send_h.value_at_quantile(0.5)),
            send_p99_ms: ms(send_h.value_at_quantile(0.99)),
            sync_p50_ms: ms(sync_h.value_at_quantile(0.5)),
            sync_p99_ms: ms(sync_h.value_at_quantile(0.99)),
        });
    }
    Ok(phases)
}

/// Bounded wait until no ephemeral frame arrived for [`SETTLED_AFTER`].
async fn settle(frames: &AtomicU64) {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    let mut last = frames.load(Ordering::Relaxed);
    while Instant::now() < deadline {
        tokio::time::sleep(SETTLED_AFTER).await;
        let now = frames.load(Ordering::Relaxed);
        if now == last {
            return;
        }
        last = now;
    }
}
