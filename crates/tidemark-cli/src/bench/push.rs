//! `bench push`: offline push under load (issue 20, P4, seed §9.4, §19.4).
//! N offline devices, each with a webhook target pointing at a real HTTP
//! receiver on 127.0.0.1 inside this process (it verifies every request's
//! signature), sit in groups with one burster, who sends a burst into every
//! group. Measured, per round: notifications/s the receiver accepted, the
//! time from a message's `send.ok` to the receiver's accept of the
//! notification that covers it (p50, p99; the coalescing window included),
//! messages per notification, and an honest sender's `send` p99 in a
//! closed loop while the push load runs, beside the same sender with no
//! push load in the same round (the baseline: push must never delay an
//! accepted send), and beside the same sender while the same burst goes
//! into groups of as many devices that have no push target (the burst's
//! own cost: the push load's ratio to it is what push alone adds). Then
//! the throttling drill: the receiver answers every
//! push `429` with `Retry-After: 1` while the burst runs; the honest
//! sender's p99 beside the baseline again, and once the receiver accepts
//! again every device is still owed exactly its messages. Medians of the
//! rounds.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::json;
use tidemark_client::proto::SendReq;
use tidemark_client::{Http, WsConn};
use tidemark_core::push::PushPolicy;
use tidemark_proto::push::PushPayload;
use tidemark_push::webhook::{verify_signature, Webhook, SIGNATURE_HEADER, TOKEN_HEADER};
use tidemark_server::push::PushConfig;
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

use super::device::{bar, cheap_hash, PASSWORD};
use super::{init_logs, median, print_table, unix_ms, TempDir, LATENCY_MAX_US};

const SECRET: &[u8] = b"bench-push-webhook-secret";
/// Bound of the wait for every device's notifications after a phase.
const SETTLE_MAX: Duration = Duration::from_secs(120);
/// The receiver's throttling hint in the drill, in seconds.
const DRILL_RETRY_AFTER_SECS: u64 = 1;

#[derive(clap::Args, Debug, Clone)]
pub struct PushArgs {
    /// Offline devices with a webhook target (one user each).
    #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u32).range(1..=20_000))]
    pub devices: u32,
    /// Members per group besides the burster (below the large-group
    /// threshold, so each member's log gets the messages).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=400))]
    pub group: u32,
    /// Messages the burster sends into each group per phase.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub burst: u32,
    /// Seconds the honest sender sends in each phase.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// The push coalescing window, in milliseconds.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub window_ms: u64,
    /// Rounds; the summary reports medians.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    #[arg(long, default_value = "bench-results/push.json")]
    pub out: PathBuf,
    /// Where the temporary store goes (on the disk to measure).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The provider's receiver: verifies and records each request; accepts,
/// or throttles during the drill.
#[derive(Clone, Default)]
struct Receiver {
    inner: Arc<Mutex<Received>>,
    throttle: Arc<AtomicBool>,
}

#[derive(Default)]
struct Received {
    /// Accepted notifications: (arrival, token, count).
    accepted: Vec<(Instant, String, u32)>,
    throttled: u64,
    bad: u64,
}

async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> (StatusCode, HeaderMap) {
    let at = Instant::now();
    let signature = headers.get(SIGNATURE_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
    let token = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let payload = serde_json::from_slice::<PushPayload>(&body).ok();
    let mut inner = r.inner.lock().expect("receiver lock");
    let (Ok(()), Some(payload)) = (verify_signature(SECRET, signature, &body, unix_ms()), payload) else {
        inner.bad += 1;
        return (StatusCode::UNAUTHORIZED, HeaderMap::new());
    };
    if r.throttle.load(Ordering::Relaxed) {
        inner.throttled += 1;
        let mut h = HeaderMap::new();
        h.insert("retry-after", DRILL_RETRY_AFTER_SECS.into());
        return (StatusCode::TOO_MANY_REQUESTS, h);
    }
    inner.accepted.push((at, token, payload.count));
    (StatusCode::OK, HeaderMap::new())
}

#[derive(Debug, Serialize, Clone)]
struct Round {
    baseline_send_p99_ms: f64,
    /// The honest sender's p99 while the burst goes to devices with no
    /// push target: the same fan-out, no push.
    burst_send_p99_ms: f64,
    push_send_p99_ms: f64,
    /// `push_send_p99_ms / burst_send_p99_ms`: what push alone adds.
    push_vs_burst_ratio: f64,
    drill_send_p99_ms: f64,
    push_send_ratio: f64,
    drill_send_ratio: f64,
    notifications: u64,
    notifications_per_sec: f64,
    messages_per_notification: f64,
    commit_to_accept_p50_ms: f64,
    commit_to_accept_p99_ms: f64,
    drill_throttled_answers: u64,
    drill_notifications_after: u64,
    drill_messages_owed_after: u64,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

pub async fn run(args: PushArgs) -> Result<()> {
    init_logs();
    let receiver = Receiver::default();
    let app = axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let hook = format!("http://{}/hook", listener.local_addr()?);
    let receiver_task = tokio::spawn(async move { axum::serve(listener, app).await });

    let root = TempDir::create(&args.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let store = SqliteStore::open(&root.0.join("server")).context("open store")?;
    let push = PushConfig {
        providers: vec![Arc::new(Webhook::new(hook, SECRET.to_vec()))],
        token_key: Some([5; 32]),
        policy: PushPolicy { window_ms: args.window_ms as i64, ..PushPolicy::default() },
        ..PushConfig::default()
    };
    let config = ServerConfig { limits: tidemark_server::limits::LimitsConfig::off(), push, ..ServerConfig::default() };
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await.context("start server")?;
    let result = rounds(&args, &server, &*store, &receiver).await;
    server.stop().await;
    receiver_task.abort();
    let rounds = result?;
    let bad = receiver.inner.lock().expect("receiver lock").bad;
    ensure!(bad == 0, "{bad} pushes failed the receiver's signature check");

    let rows: Vec<Vec<String>> = rounds
        .iter()
        .enumerate()
        .map(|(i, r)| {
            vec![
                format!("round {}", i + 1),
                format!("{:.0}", r.notifications_per_sec),
                format!("{:.1}", r.messages_per_notification),
                format!("{:.0}", r.commit_to_accept_p50_ms),
                format!("{:.0}", r.commit_to_accept_p99_ms),
                format!("{:.2}", r.baseline_send_p99_ms),
                format!("{:.2}", r.burst_send_p99_ms),
                format!("{:.2}", r.push_send_p99_ms),
                format!("{:.2}", r.push_send_ratio),
                format!("{:.2}", r.push_vs_burst_ratio),
                format!("{:.2}", r.drill_send_p99_ms),
                format!("{:.2}", r.drill_send_ratio),
                r.drill_throttled_answers.to_string(),
            ]
        })
        .collect();
    let m = |f: &dyn Fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    let medians = Round {
        baseline_send_p99_ms: m(&|r| r.baseline_send_p99_ms),
        burst_send_p99_ms: m(&|r| r.burst_send_p99_ms),
        push_send_p99_ms: m(&|r| r.push_send_p99_ms),
        push_vs_burst_ratio: m(&|r| r.push_vs_burst_ratio),
        drill_send_p99_ms: m(&|r| r.drill_send_p99_ms),
        push_send_ratio: m(&|r| r.push_send_ratio),
        drill_send_ratio: m(&|r| r.drill_send_ratio),
        notifications: m(&|r| r.notifications as f64) as u64,
        notifications_per_sec: m(&|r| r.notifications_per_sec),
        messages_per_notification: m(&|r| r.messages_per_notification),
        commit_to_accept_p50_ms: m(&|r| r.commit_to_accept_p50_ms),
        commit_to_accept_p99_ms: m(&|r| r.commit_to_accept_p99_ms),
        drill_throttled_answers: m(&|r| r.drill_throttled_answers as f64) as u64,
        drill_notifications_after: m(&|r| r.drill_notifications_after as f64) as u64,
        drill_messages_owed_after: m(&|r| r.drill_messages_owed_after as f64) as u64,
    };
    let mut all = rows;
    all.push(vec![
        "median".into(),
        format!("{:.0}", medians.notifications_per_sec),
        format!("{:.1}", medians.messages_per_notification),
        format!("{:.0}", medians.commit_to_accept_p50_ms),
        format!("{:.0}", medians.commit_to_accept_p99_ms),
        format!("{:.2}", medians.baseline_send_p99_ms),
        format!("{:.2}", medians.burst_send_p99_ms),
        format!("{:.2}", medians.push_send_p99_ms),
        format!("{:.2}", medians.push_send_ratio),
        format!("{:.2}", medians.push_vs_burst_ratio),
        format!("{:.2}", medians.drill_send_p99_ms),
        format!("{:.2}", medians.drill_send_ratio),
        medians.drill_throttled_answers.to_string(),
    ]);
    print_table(
        &[
            "",
            "notif/s",
            "msgs/notif",
            "accept p50 ms",
            "accept p99 ms",
            "send p99 base",
            "burst",
            "push",
            "ratio",
            "÷ burst",
            "drill",
            "ratio",
            "429s",
        ],
        &all,
    );
    println!(
        "send p99 with push load {:.2}x, during the throttling drill {:.2}x the same sender without push (same run); \
         with push load {:.2}x the same sender beside the same burst to devices without push targets",
        medians.push_send_ratio, medians.drill_send_ratio, medians.push_vs_burst_ratio
    );
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let report = json!({"bench": "push", "unix_time_ms": unix_ms(), "devices": args.devices, "group": args.group,
        "burst": args.burst, "seconds": args.seconds, "window_ms": args.window_ms, "medians": medians,
        "rounds": rounds});
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

struct Setup {
    honest: WsConn,
    honest_conv: String,
    burster: WsConn,
    /// Each group's conversation and the devices (their index) in it.
    groups: Vec<(String, Vec<usize>)>,
    /// Groups of as many devices with no push target, the same shape.
    unpushed: Vec<(String, Vec<usize>)>,
}

async fn setup(args: &PushArgs, server: &tidemark_server::RunningServer, store: &dyn Store) -> Result<Setup> {
    let hash = cheap_hash()?;
    let names: Vec<String> = (0..args.devices).map(|i| format!("u{i:05}")).collect();
    let unpushed_names: Vec<String> = (0..args.devices).map(|i| format!("q{i:05}")).collect();
    for n in names.iter().chain(&unpushed_names).chain(["honest", "peer", "burster"].map(String::from).iter()) {
        store.create_user(n, &hash, unix_ms()).await?;
    }
    let http = Http::new(&server.url());
    let pb = bar(u64::from(args.devices), "devices");
    pb.set_message("offline devices, registering");
    for (i, n) in names.iter().enumerate() {
        let login = http.login(n, PASSWORD, "phone").await?;
        let req = json!({"platform": "webhook", "token": format!("tok-{i}"), "preview": "none"});
        let _: serde_json::Value = http.rpc(&login.access_token, "push.register", &req).await?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    // The same number of offline devices with no push target.
    let pb = bar(u64::from(args.devices), "devices");
    pb.set_message("offline devices without push");
    for n in &unpushed_names {
        http.login(n, PASSWORD, "phone").await?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    let ws_url = format!("ws://{}/v1/ws", server.addr);
    let connect = |user: &'static str| {
        let (http, ws_url) = (http.clone(), ws_url.clone());
        async move {
            let login = http.login(user, PASSWORD, "bench").await?;
            let (ws, _events) = WsConn::connect(&ws_url, &login.access_token).await?;
            anyhow::Ok(ws)
        }
    };
    let (honest, burster) = (connect("honest").await?, connect("burster").await?);
    let honest_conv = honest.conv_create_direct("peer").await?.conv;
    let mut groups = Vec::new();
    let indices: Vec<usize> = (0..names.len()).collect();
    for chunk in indices.chunks(args.group as usize) {
        let members: Vec<&str> = chunk.iter().map(|&i| names[i].as_str()).collect();
        let v = burster.request_value("conv.create", json!({"kind": "group", "members": members})).await?;
        groups.push((v["conv"].as_str().context("conv.create")?.to_owned(), chunk.to_vec()));
    }
    let mut unpushed = Vec::new();
    for chunk in indices.chunks(args.group as usize) {
        let members: Vec<&str> = chunk.iter().map(|&i| unpushed_names[i].as_str()).collect();
        let v = burster.request_value("conv.create", json!({"kind": "group", "members": members})).await?;
        unpushed.push((v["conv"].as_str().context("conv.create")?.to_owned(), chunk.to_vec()));
    }
    Ok(Setup { honest, honest_conv, burster, groups, unpushed })
}

/// The honest sender's closed loop for `seconds`; its send p99 in ms.
async fn honest_p99(s: &Setup, tag: &str, seconds: u64) -> Result<f64> {
    let mut h = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        let req = SendReq {
            conv: s.honest_conv.clone(),
            client_msg_id: format!("honest-{tag}-{n}"),
            kind: "text".into(),
            content: json!({"text": "honest"}),
            mentions: Vec::new(),
            mention_all: false,
        };
        let t = Instant::now();
        s.honest.send(&req).await?;
        h.record(t.elapsed().as_micros().max(1) as u64)?;
        n += 1;
    }
    ensure!(n > 0, "the honest sender sent nothing");
    Ok(ms(h.value_at_quantile(0.99)))
}

/// The burst: `burst` messages into every group of `groups`, interleaved;
/// each group's `send.ok` instants in order.
async fn burst(s: &Setup, groups: &[(String, Vec<usize>)], tag: &str, burst: u32) -> Result<Vec<Vec<Instant>>> {
    let mut acked = vec![Vec::with_capacity(burst as usize); groups.len()];
    for m in 0..burst {
        for (g, (conv, _)) in groups.iter().enumerate() {
            let req = SendReq {
                conv: conv.clone(),
                client_msg_id: format!("burst-{tag}-{g}-{m}"),
                kind: "text".into(),
                content: json!({"text": "burst"}),
                mentions: Vec::new(),
                mention_all: false,
            };
            s.burster.send(&req).await?;
            acked[g].push(Instant::now());
        }
    }
    Ok(acked)
}

/// Waits until the receiver accepted, from index `from` of its log, counts
/// adding up to `owed` messages.
async fn settle(receiver: &Receiver, from: usize, owed: u64) -> Result<()> {
    let start = Instant::now();
    loop {
        let got: u64 =
            receiver.inner.lock().expect("receiver lock").accepted[from..].iter().map(|(_, _, c)| u64::from(*c)).sum();
        if got >= owed {
            ensure!(got == owed, "devices were notified of {got} messages, {owed} were sent");
            return Ok(());
        }
        ensure!(start.elapsed() < SETTLE_MAX, "{got} of {owed} messages notified after {SETTLE_MAX:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the outbox is empty, so one phase's fan-out does not run
/// in the next.
async fn drained(store: &dyn Store) -> Result<()> {
    let start = Instant::now();
    while store.outbox_stats().await?.backlog > 0 {
        ensure!(start.elapsed() < SETTLE_MAX, "the outbox did not drain in {SETTLE_MAX:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

async fn rounds(
    args: &PushArgs,
    server: &tidemark_server::RunningServer,
    store: &dyn Store,
    receiver: &Receiver,
) -> Result<Vec<Round>> {
    let s = setup(args, server, store).await?;
    let group_of: Vec<usize> = {
        let mut g = vec![0; args.devices as usize];
        for (gi, (_, members)) in s.groups.iter().enumerate() {
            for &d in members {
                g[d] = gi;
            }
        }
        g
    };
    let owed = u64::from(args.devices) * u64::from(args.burst);
    let pb = bar(u64::from(args.rounds) * 4, "phases");
    let mut out = Vec::new();
    for round in 1..=args.rounds {
        pb.set_message(format!("round {round}: baseline"));
        let baseline = honest_p99(&s, &format!("{round}-base"), args.seconds).await?;
        pb.inc(1);

        pb.set_message(format!("round {round}: burst without push targets"));
        let pushed_before = receiver.inner.lock().expect("receiver lock").accepted.len();
        let tag = format!("{round}-burst");
        let (_, burst_p99) =
            tokio::try_join!(burst(&s, &s.unpushed, &tag, args.burst), honest_p99(&s, &tag, args.seconds))?;
        let pushed = receiver.inner.lock().expect("receiver lock").accepted.len() - pushed_before;
        ensure!(pushed == 0, "{pushed} pushes for devices without a push target");
        drained(store).await?;
        pb.inc(1);

        pb.set_message(format!("round {round}: push load"));
        let from = receiver.inner.lock().expect("receiver lock").accepted.len();
        let started = Instant::now();
        let tag = format!("{round}-push");
        let (acked, push_p99) =
            tokio::try_join!(burst(&s, &s.groups, &tag, args.burst), honest_p99(&s, &tag, args.seconds))?;
        settle(receiver, from, owed).await?;
        let notes: Vec<(Instant, String, u32)> =
            receiver.inner.lock().expect("receiver lock").accepted[from..].to_vec();
        let mut latency = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
        let mut covered = vec![0usize; args.devices as usize];
        for (at, token, count) in &notes {
            let d: usize = token.strip_prefix("tok-").and_then(|n| n.parse().ok()).context("a token of this bench")?;
            let oldest = acked[group_of[d]][covered[d]];
            latency.record(at.saturating_duration_since(oldest).as_micros().max(1) as u64)?;
            covered[d] += *count as usize;
        }
        let last = notes.iter().map(|(at, _, _)| *at).max().unwrap_or(started);
        let push_secs = last.duration_since(started).as_secs_f64().max(1e-3);
        pb.inc(1);

        pb.set_message(format!("round {round}: throttling drill"));
        let throttled_before = receiver.inner.lock().expect("receiver lock").throttled;
        let from_drill = receiver.inner.lock().expect("receiver lock").accepted.len();
        receiver.throttle.store(true, Ordering::Relaxed);
        let tag = format!("{round}-drill");
        let (_, drill_p99) =
            tokio::try_join!(burst(&s, &s.groups, &tag, args.burst), honest_p99(&s, &tag, args.seconds))?;
        receiver.throttle.store(false, Ordering::Relaxed);
        let throttled = receiver.inner.lock().expect("receiver lock").throttled - throttled_before;
        settle(receiver, from_drill, owed).await?;
        let after = (receiver.inner.lock().expect("receiver lock").accepted.len() - from_drill) as u64;
        pb.inc(1);

        out.push(Round {
            baseline_send_p99_ms: baseline,
            burst_send_p99_ms: burst_p99,
            push_send_p99_ms: push_p99,
            push_vs_burst_ratio: push_p99 / burst_p99.max(0.001),
            drill_send_p99_ms: drill_p99,
            push_send_ratio: push_p99 / baseline.max(0.001),
            drill_send_ratio: drill_p99 / baseline.max(0.001),
            notifications: notes.len() as u64,
            notifications_per_sec: notes.len() as f64 / push_secs,
            messages_per_notification: owed as f64 / notes.len().max(1) as f64,
            commit_to_accept_p50_ms: ms(latency.value_at_quantile(0.5)),
            commit_to_accept_p99_ms: ms(latency.value_at_quantile(0.99)),
            drill_throttled_answers: throttled,
            drill_notifications_after: after,
            drill_messages_owed_after: owed,
        });
    }
    pb.finish_and_clear();
    Ok(out)
}
