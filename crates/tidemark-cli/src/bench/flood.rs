//! `bench flood`: what a hostile client costs everyone else (issue 15). One
//! in-process server with its default limits; an honest user logs in from
//! its own address (127.0.0.2) every `--login-every-ms` and sends in a
//! direct conversation every `--send-every-ms`, through three phases of the
//! same run:
//!
//! - `quiet`: the honest user alone (the baseline);
//! - `login flood`: `--attackers` clients, each from its own loopback
//!   address (127.0.1.x, so the per-address quota alone does not stop
//!   them), post wrong passwords in a closed loop for a few real accounts
//!   and for names that do not exist;
//! - `send flood`: one attacking account on one address of its own
//!   (127.0.2.1) sends in `--attackers` concurrent closed loops, each on its
//!   own device's WebSocket, ignoring `retry_after_ms` (the account holds
//!   at most 20 connections, `--ws-connections-per-user-max`; the other
//!   loops' upgrades are refused), and a second account writes sends
//!   without waiting for any reply on `--pipelined` more WebSockets; a
//!   loop whose connection is closed (`kicked` `waits_ignored`, counted as
//!   closed) reconnects at once and goes on (counted as reconnects; an
//!   upgrade refused with `RATE_LIMITED` counts as a connect refused, and
//!   is retried at once).
//!
//! `--no-hostile-limits` lifts the frame and request budgets per
//! connection and address and the reconnect penalty (the server before
//! them) for a same-machine comparison.
//!
//! Measured per phase: the honest login's latency (until it succeeds,
//! waits told by `RATE_LIMITED` included) and send latency, p50 and p99;
//! the process's peak RSS (sampled every 20 ms; the attackers' own memory is
//! small beside the server's Argon2 blocks); and the attack's answers
//! (accepted, refused, `RATE_LIMITED`; the refusals answered a second,
//! upgrades refused included; connections the server closed). Ratios are
//! attack / quiet.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::json;
use tidemark_client::proto::{ErrorCode, SendReq};
use tidemark_client::{ClientError, Http, WsConn};
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

use super::{print_table, unix_ms, TempDir, LATENCY_MAX_US};

#[derive(clap::Args, Debug, Clone)]
pub struct FloodArgs {
    /// Seconds of each phase (quiet, login flood, send flood).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Concurrent attacking clients (login flood: one loopback address
    /// each; send flood: concurrent send loops of one device).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=250))]
    pub attackers: u32,
    /// The honest user logs in this often.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(10..))]
    pub login_every_ms: u64,
    /// The honest user sends this often (the default stays well inside the
    /// per-device send quota, so the honest user is never limited itself).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..))]
    pub send_every_ms: u64,
    /// Failed logins from an address before its password checks wait in
    /// the suspect lane (the server's default; a huge value puts every
    /// check in one lane, the behaviour before the lanes, for a same-run
    /// comparison).
    #[arg(long, default_value_t = tidemark_core::throttle::SUSPECT_AFTER_FAILURES)]
    pub suspect_after_failures: u32,
    /// WebSockets of the send flood that write sends without waiting for
    /// replies (besides the `--attackers` closed loops).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub pipelined: u32,
    /// Lift the frame budgets, the per-address request budget and the
    /// reconnect penalty (the server before them), to compare.
    #[arg(long)]
    pub no_hostile_limits: bool,
    #[arg(long, default_value = "bench-results/flood.json")]
    pub out: PathBuf,
    /// Where the temporary store goes.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

const HONEST: &str = "honest";
const HONEST_PASSWORD: &str = "honest password";
/// Real accounts the login flood guesses at (besides unknown names).
const VICTIMS: usize = 8;
/// The honest user's source address; the attackers' are 127.0.1.x.
const HONEST_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// The pipelined writers' account (its own, so the per-user connection
/// cap, which the closed loops' account already fills, does not keep them
/// out).
const PIPER: &str = "piper";
/// The send flood's one address.
const SEND_ATTACK_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 2, 1);

#[derive(Debug, Serialize)]
struct Phase {
    phase: &'static str,
    seconds: f64,
    logins: u64,
    login_p50_ms: f64,
    login_p99_ms: f64,
    login_limited_waits: u64,
    sends: u64,
    send_p50_ms: f64,
    send_p99_ms: f64,
    peak_rss_mib: f64,
    attack_requests_per_sec: f64,
    attack_accepted: u64,
    attack_refused: u64,
    attack_rate_limited: u64,
    /// Connections the attacker opened again after the server closed one.
    attack_reconnects: u64,
    /// Refusals the server answered a second: `RATE_LIMITED` and other
    /// error replies, and refused upgrades.
    attack_refusals_per_sec: f64,
    /// The attacker's connections the server closed, and its upgrades it
    /// refused (`RATE_LIMITED`).
    attack_closed: u64,
    attack_connects_refused: u64,
}

#[derive(Default)]
struct AttackCounts {
    accepted: AtomicU64,
    refused: AtomicU64,
    limited: AtomicU64,
    reconnects: AtomicU64,
    closed: AtomicU64,
    connects_refused: AtomicU64,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn init_logs() {
    // Errors only: every refused guess is a warning line of the server.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "error".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

pub async fn run(args: FloodArgs) -> Result<()> {
    init_logs();
    let root = TempDir::create(&args.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let store = SqliteStore::open(&root.0.join("server")).context("open store")?;
    // Listening on 0.0.0.0 would do too; 127.0.0.1 accepts every loopback
    // source address.
    let mut config = ServerConfig::default();
    config.limits.login_suspect_after_failures = args.suspect_after_failures;
    if args.no_hostile_limits {
        let unbounded = tidemark_server::limits::Rate::new(u32::MAX, u32::MAX);
        config.limits.frames_per_connection = unbounded;
        config.limits.frames_per_address = unbounded;
        config.limits.requests_per_address = unbounded;
        config.limits.reconnect_penalty =
            tidemark_core::throttle::ReconnectPenalty { first_ms: 0, max_ms: 0, ..config.limits.reconnect_penalty };
    }
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await.context("start server")?;
    let result = phases(&args, &server, &*store).await;
    server.stop().await;
    let phases = result?;
    let rows: Vec<Vec<String>> = phases
        .iter()
        .map(|p| {
            vec![
                p.phase.to_string(),
                format!("{:.1} / {:.1}", p.login_p50_ms, p.login_p99_ms),
                format!("{:.2} / {:.2}", p.send_p50_ms, p.send_p99_ms),
                format!("{:.0}", p.peak_rss_mib),
                format!("{:.0}", p.attack_requests_per_sec),
                format!("{} / {} / {}", p.attack_accepted, p.attack_refused, p.attack_rate_limited),
                p.attack_reconnects.to_string(),
                format!("{:.0}", p.attack_refusals_per_sec),
                format!("{} / {}", p.attack_closed, p.attack_connects_refused),
            ]
        })
        .collect();
    print_table(
        &[
            "phase",
            "honest login p50/p99 ms",
            "honest send p50/p99 ms",
            "peak RSS MiB",
            "attack req/s",
            "attack ok/refused/limited",
            "attack reconnects",
            "refusals/s",
            "attack closed / connects refused",
        ],
        &rows,
    );
    let quiet = &phases[0];
    let ratio = |a: f64, b: f64| a / b.max(0.001);
    let (login, send) = (&phases[1], &phases[2]);
    println!(
        "login flood / quiet: login p99 {:.2}x, send p99 {:.2}x, peak RSS {:.0} MiB (quiet {:.0})",
        ratio(login.login_p99_ms, quiet.login_p99_ms),
        ratio(login.send_p99_ms, quiet.send_p99_ms),
        login.peak_rss_mib,
        quiet.peak_rss_mib
    );
    println!(
        "send flood / quiet: login p99 {:.2}x, send p99 {:.2}x; the attacker's sends accepted {} of {}",
        ratio(send.login_p99_ms, quiet.login_p99_ms),
        ratio(send.send_p99_ms, quiet.send_p99_ms),
        send.attack_accepted,
        send.attack_accepted + send.attack_rate_limited + send.attack_refused
    );
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let report = json!({
        "attackers": args.attackers, "pipelined": args.pipelined, "hostile_limits": !args.no_hostile_limits,
        "suspect_after_failures": args.suspect_after_failures, "login_every_ms": args.login_every_ms, "send_every_ms": args.send_every_ms,
        "phases": phases,
        "login_flood_login_p99_ratio": ratio(login.login_p99_ms, quiet.login_p99_ms),
        "login_flood_send_p99_ratio": ratio(login.send_p99_ms, quiet.send_p99_ms),
        "send_flood_login_p99_ratio": ratio(send.login_p99_ms, quiet.login_p99_ms),
        "send_flood_send_p99_ratio": ratio(send.send_p99_ms, quiet.send_p99_ms),
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

/// A client whose requests leave from `address`.
fn client_from(address: Ipv4Addr) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder().local_address(IpAddr::V4(address)).build()?)
}

/// One login; `Err(Some(wait))` when told to wait.
async fn login(
    client: &reqwest::Client,
    url: &str,
    user: &str,
    password: &str,
    device: &str,
) -> Result<Result<(), Option<u64>>> {
    let body = json!({"user": user, "password": password, "device_id": device});
    let resp = client.post(format!("{url}/v1/login")).json(&body).send().await?;
    if resp.status().is_success() {
        return Ok(Ok(()));
    }
    let v: serde_json::Value = resp.json().await.unwrap_or_default();
    Ok(Err(v["retry_after_ms"].as_u64()))
}

async fn phases(args: &FloodArgs, server: &tidemark_server::RunningServer, store: &dyn Store) -> Result<Vec<Phase>> {
    let url = server.url();
    let ws_url = format!("ws://{}/v1/ws", server.addr);
    // Real Argon2 hashes: a known account's guess costs what a login costs.
    let honest_hash = tidemark_server::accounts::hash_password(HONEST_PASSWORD).map_err(anyhow::Error::msg)?;
    store.create_user(HONEST, &honest_hash, unix_ms()).await?;
    for n in ["peer", "attacker", PIPER] {
        store.create_user(n, &honest_hash, unix_ms()).await?;
    }
    for i in 0..VICTIMS {
        let hash =
            tidemark_server::accounts::hash_password(&format!("victim password {i}")).map_err(anyhow::Error::msg)?;
        store.create_user(&format!("victim{i}"), &hash, unix_ms()).await?;
    }
    let http = Http::new(&url);
    let honest_login = http.login(HONEST, HONEST_PASSWORD, "laptop").await?;
    // From its own address, as the attackers are from theirs.
    let (honest_ws, _honest_events) =
        WsConn::connect_from(&ws_url, &honest_login.access_token, IpAddr::V4(HONEST_ADDRESS)).await?;
    let direct = honest_ws.conv_create_direct("peer").await?.conv;
    // The send flood's devices, one per loop, logged in before any phase.
    let mut attacker_tokens = Vec::new();
    for t in 0..args.attackers {
        attacker_tokens.push(http.login("attacker", HONEST_PASSWORD, &format!("bot{t}")).await?.access_token);
    }
    let mut pipe_tokens = Vec::new();
    for t in 0..args.pipelined {
        pipe_tokens.push(http.login(PIPER, HONEST_PASSWORD, &format!("pipe{t}")).await?.access_token);
    }
    let attacker_conv = {
        let (ws, _events) = WsConn::connect(&ws_url, &attacker_tokens[0]).await?;
        ws.conv_create_direct("peer").await?.conv
    };
    let piper_conv = match pipe_tokens.first() {
        Some(token) => WsConn::connect(&ws_url, token).await?.0.conv_create_direct("peer").await?.conv,
        None => String::new(),
    };
    let honest_client = client_from(HONEST_ADDRESS)?;
    let attack_clients: Vec<reqwest::Client> =
        (0..args.attackers).map(|i| client_from(Ipv4Addr::new(127, 0, 1, 1 + i as u8))).collect::<Result<_>>()?;

    let mut out = Vec::new();
    for phase in ["quiet", "login flood", "send flood"] {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(AttackCounts::default());
        let attack_requests = Arc::new(AtomicU64::new(0));
        let mut attack = Vec::new();
        match phase {
            "login flood" => {
                for (i, client) in attack_clients.iter().enumerate() {
                    let (client, url, stop) = (client.clone(), url.clone(), stop.clone());
                    let (counts, requests) = (counts.clone(), attack_requests.clone());
                    attack.push(tokio::spawn(async move {
                        let mut n = 0usize;
                        while !stop.load(Ordering::Relaxed) {
                            // Half the guesses at real accounts, half at names
                            // that do not exist (they cost the same hash).
                            let user = if n.is_multiple_of(2) {
                                format!("victim{}", (i + n) % VICTIMS)
                            } else {
                                format!("nobody{i}")
                            };
                            n += 1;
                            requests.fetch_add(1, Ordering::Relaxed);
                            match login(&client, &url, &user, "wrong guess", "bot").await {
                                Ok(Ok(())) => counts.accepted.fetch_add(1, Ordering::Relaxed),
                                Ok(Err(Some(_))) => counts.limited.fetch_add(1, Ordering::Relaxed),
                                Ok(Err(None)) | Err(_) => counts.refused.fetch_add(1, Ordering::Relaxed),
                            };
                        }
                    }));
                }
            }
            "send flood" => {
                for (t, token) in attacker_tokens.iter().enumerate() {
                    let (token, ws_url, conv, stop) =
                        (token.clone(), ws_url.clone(), attacker_conv.clone(), stop.clone());
                    let (counts, requests) = (counts.clone(), attack_requests.clone());
                    attack.push(tokio::spawn(async move {
                        let mut n = 0u64;
                        let mut first = true;
                        'connection: while !stop.load(Ordering::Relaxed) {
                            requests.fetch_add(1, Ordering::Relaxed);
                            let from = IpAddr::V4(SEND_ATTACK_ADDRESS);
                            let ws = match WsConn::connect_from(&ws_url, &token, from).await {
                                Ok((ws, _events)) => ws,
                                Err(ClientError::Server(f)) if f.code == ErrorCode::RateLimited => {
                                    counts.connects_refused.fetch_add(1, Ordering::Relaxed);
                                    continue;
                                }
                                Err(_) => {
                                    counts.refused.fetch_add(1, Ordering::Relaxed);
                                    continue;
                                }
                            };
                            if !std::mem::take(&mut first) {
                                counts.reconnects.fetch_add(1, Ordering::Relaxed);
                            }
                            while !stop.load(Ordering::Relaxed) {
                                let req = SendReq {
                                    conv: conv.clone(),
                                    client_msg_id: format!("flood-{t}-{n}"),
                                    kind: "text".into(),
                                    content: json!({"text": "flood"}),
                                    mentions: Vec::new(),
                                    mention_all: false,
                                };
                                n += 1;
                                requests.fetch_add(1, Ordering::Relaxed);
                                match ws.send(&req).await {
                                    Ok(_) => counts.accepted.fetch_add(1, Ordering::Relaxed),
                                    Err(ClientError::Server(f)) if f.code == ErrorCode::RateLimited => {
                                        counts.limited.fetch_add(1, Ordering::Relaxed)
                                    }
                                    Err(ClientError::Server(_)) => counts.refused.fetch_add(1, Ordering::Relaxed),
                                    // Closed by the server: connect again.
                                    Err(_) => {
                                        counts.closed.fetch_add(1, Ordering::Relaxed);
                                        continue 'connection;
                                    }
                                };
                            }
                        }
                    }));
                }
                for (t, token) in pipe_tokens.iter().enumerate() {
                    let (token, ws_url, conv, stop) = (token.clone(), ws_url.clone(), piper_conv.clone(), stop.clone());
                    let (counts, requests) = (counts.clone(), attack_requests.clone());
                    attack.push(tokio::spawn(pipelined(t, token, ws_url, conv, stop, counts, requests)));
                }
            }
            _ => {}
        }
        // Peak RSS of the process while the phase runs.
        let peak = Arc::new(AtomicU64::new(0));
        let sampler = {
            let (peak, stop) = (peak.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(kib) = super::proc::rss_kib(std::process::id()) {
                        peak.fetch_max(kib, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        // The honest logins, on their own task, paced.
        let honest_logins = {
            let (client, url, stop) = (honest_client.clone(), url.clone(), stop.clone());
            let every = Duration::from_millis(args.login_every_ms);
            tokio::spawn(async move {
                let mut h = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3).expect("histogram bounds");
                let mut waits = 0u64;
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep_until(next.into()).await;
                    next += every;
                    let t = Instant::now();
                    loop {
                        match login(&client, &url, HONEST, HONEST_PASSWORD, "phone").await {
                            Ok(Ok(())) => break,
                            Ok(Err(Some(wait))) => {
                                waits += 1;
                                tokio::time::sleep(Duration::from_millis(wait)).await;
                            }
                            Ok(Err(None)) | Err(_) => return Err(anyhow::anyhow!("the honest login was refused")),
                        }
                    }
                    h.record((t.elapsed().as_micros() as u64).clamp(1, LATENCY_MAX_US)).expect("in bounds");
                }
                Ok((h, waits))
            })
        };
        let started = Instant::now();
        let mut send_h = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
        let mut n = 0u64;
        let mut next = Instant::now();
        let every = Duration::from_millis(args.send_every_ms);
        while started.elapsed() < Duration::from_secs(args.seconds) {
            tokio::time::sleep_until(next.into()).await;
            next += every;
            let req = SendReq {
                conv: direct.clone(),
                client_msg_id: format!("honest-{phase}-{n}"),
                kind: "text".into(),
                content: json!({"text": "hello"}),
                mentions: Vec::new(),
                mention_all: false,
            };
            let t = Instant::now();
            honest_ws.send(&req).await.context("the honest send")?;
            send_h.record((t.elapsed().as_micros() as u64).clamp(1, LATENCY_MAX_US))?;
            n += 1;
        }
        let seconds = started.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        for mut t in attack {
            // A pipelined writer may be blocked on a socket the server
            // reads no more of.
            if tokio::time::timeout(Duration::from_secs(5), &mut t).await.is_err() {
                t.abort();
            }
        }
        let _ = sampler.await;
        let (login_h, waits) = honest_logins.await??;
        ensure!(n > 0 && !login_h.is_empty(), "the honest user did nothing in phase {phase}");
        out.push(Phase {
            phase,
            seconds,
            logins: login_h.len(),
            login_p50_ms: ms(login_h.value_at_quantile(0.5)),
            login_p99_ms: ms(login_h.value_at_quantile(0.99)),
            login_limited_waits: waits,
            sends: n,
            send_p50_ms: ms(send_h.value_at_quantile(0.5)),
            send_p99_ms: ms(send_h.value_at_quantile(0.99)),
            peak_rss_mib: peak.load(Ordering::Relaxed) as f64 / 1024.0,
            attack_requests_per_sec: attack_requests.load(Ordering::Relaxed) as f64 / seconds,
            attack_accepted: counts.accepted.load(Ordering::Relaxed),
            attack_refused: counts.refused.load(Ordering::Relaxed),
            attack_rate_limited: counts.limited.load(Ordering::Relaxed),
            attack_reconnects: counts.reconnects.load(Ordering::Relaxed),
            attack_refusals_per_sec: (counts.limited.load(Ordering::Relaxed)
                + counts.refused.load(Ordering::Relaxed)
                + counts.connects_refused.load(Ordering::Relaxed)) as f64
                / seconds,
            attack_closed: counts.closed.load(Ordering::Relaxed),
            attack_connects_refused: counts.connects_refused.load(Ordering::Relaxed),
        });
    }
    Ok(out)
}

/// One WebSocket of the send flood that writes sends as fast as its socket
/// takes them, never waiting for a reply, from the attack address; a
/// connection the server ends is opened again at once.
async fn pipelined(
    t: usize,
    token: String,
    ws_url: String,
    conv: String,
    stop: Arc<AtomicBool>,
    counts: Arc<AttackCounts>,
    requests: Arc<AtomicU64>,
) {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let mut n = 0u64;
    let mut first = true;
    while !stop.load(Ordering::Relaxed) {
        requests.fetch_add(1, Ordering::Relaxed);
        let Ok(mut request) = ws_url.as_str().into_client_request() else { return };
        let Ok(bearer) = format!("Bearer {token}").parse() else { return };
        request.headers_mut().insert("authorization", bearer);
        let connected = async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(std::net::SocketAddr::new(IpAddr::V4(SEND_ATTACK_ADDRESS), 0))?;
            let addr = request.uri().authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
            let peer =
                tokio::net::lookup_host(addr).await?.next().ok_or_else(|| std::io::Error::other("no address"))?;
            let tcp = socket.connect(peer).await?;
            tcp.set_nodelay(true)?;
            Ok::<_, std::io::Error>(tcp)
        };
        let Ok(tcp) = connected.await else {
            counts.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let ws = match tokio_tungstenite::client_async(request, tcp).await {
            Ok((ws, _)) => ws,
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) if resp.status().as_u16() == 429 => {
                counts.connects_refused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Err(_) => {
                counts.refused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        if !std::mem::take(&mut first) {
            counts.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        let (mut sink, mut stream) = ws.split();
        let reader = {
            let counts = counts.clone();
            async move {
                while let Some(Ok(msg)) = stream.next().await {
                    let Message::Text(text) = msg else { continue };
                    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    match (v["t"].as_str(), v["code"].as_str()) {
                        (Some("send"), _) => counts.accepted.fetch_add(1, Ordering::Relaxed),
                        (Some("error"), Some("RATE_LIMITED")) => counts.limited.fetch_add(1, Ordering::Relaxed),
                        (Some("error"), _) => counts.refused.fetch_add(1, Ordering::Relaxed),
                        _ => continue,
                    };
                }
            }
        };
        tokio::pin!(reader);
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let frame = json!({"t": "send", "rid": format!("p{t}-{n}"), "conv": conv,
                "client_msg_id": format!("pipe-{t}-{n}"), "kind": "text", "content": {"text": "flood"}});
            n += 1;
            tokio::select! {
                // The server ended the connection.
                _ = &mut reader => break,
                sent = sink.send(Message::Text(frame.to_string().into())) => if sent.is_err() { break },
            }
            requests.fetch_add(1, Ordering::Relaxed);
        }
        counts.closed.fetch_add(1, Ordering::Relaxed);
    }
}
