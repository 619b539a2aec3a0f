//! `bench fanout --large`: large groups (G2, G3). One sender writes to a
//! group of `--large-sizes` members of which `--online-fraction` (sender
//! excluded) are online, each the real SDK (`tidemark_client::Client`,
//! its own local SQLite database, WAL, `synchronous=FULL`); the other
//! members are accounts and memberships only, created in bulk through the
//! store (`Store::create_user`, many at once so the writer batches them)
//! and one `conv.create`.
//!
//! Each size runs in shared mode (the server's threshold at 2, so the group
//! is shared from its creation) and, up to 1,000 members, in per-member
//! mode too (threshold 1,000, the cap), beside the bare broadcast baseline
//! of `fanout.rs` with as many receivers as there are online members.
//!
//! Per run, on a fresh server:
//!
//! 1. *write probe*: `--probe-messages` sends to the group before any
//!    receiver is online, until the outbox is drained; the rows the store's
//!    writer changed (`SqliteStore::rows_written`, SQLite's
//!    `total_changes` over committed transactions) divided by the messages
//!    is the server's write cost per message, without device work;
//! 2. the online receivers start and catch up with the probe;
//! 3. *measured*: `--messages` closed-loop sends to the group, each
//!    followed by one to a direct conversation of the sender (the same run,
//!    the same load: the ratio of the two send latencies is the goal's);
//!    a receiver's delivery time is the `Change::CursorMoved` of the group
//!    reaching the message, which the engine emits after the local COMMIT
//!    of the page (per-member) or of the `conv.sync` pull (shared mode,
//!    `pull_conversation`), before `dirty.clear`; per message the time
//!    until the *last* online receiver committed it is the fan-out
//!    latency. The rows written meanwhile (devices' ACKs and marker
//!    clears included) are reported too;
//! 4. *catch-up*: one offline member's device starts on an empty database;
//!    the time until it holds the whole group (probe and measured messages)
//!    is its catch-up.
//!
//! Goals (reported, not asserted): rows per message independent of the
//! member count in shared mode; the send to a 10,000-member group within
//! 1.5× of the direct send; the p99 until the last online receiver's
//! commit within 4× of the baseline's to as many receivers.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures_util::future::{join_all, try_join_all};
use futures_util::{StreamExt, TryStreamExt};
use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use serde::Serialize;
use tidemark_client::proto::{op, ConvCreateOk, ConvCreateReq, SendReq};
use tidemark_client::{Change, Client, ClientConfig, ConnState, Http, WsConn};
use tidemark_core::large::GroupPolicy;
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

use super::device::{bar, cheap_hash, PASSWORD};
use super::fanout::{
    baseline_run, latency_hist, payload, record, since, FanoutArgs, Run, Shape, KIND, RUN_TIMEOUT, SETUP_TIMEOUT,
};
use super::{median, print_table, wait_store_closed, TempDir};

/// The threshold of the shared runs: every group above two members is
/// shared from its creation.
const SHARED_THRESHOLD: u64 = 2;
/// Users created at once (the store's writer batches them).
const CREATE_CONCURRENCY: usize = 256;
/// How often the probe looks at the outbox.
const DRAIN_POLL: Duration = Duration::from_millis(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Mode {
    PerMember,
    Shared,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::PerMember => "per-member",
            Mode::Shared => "shared",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Plan {
    members: u32,
    mode: Mode,
    /// Online members besides the sender.
    online: u32,
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

#[derive(Debug, Clone, Serialize)]
struct LargeRun {
    members: u32,
    mode: Mode,
    online: u32,
    probe_messages: u32,
    messages: u32,
    /// Rows the server's writer changed per message in the write probe
    /// (nobody online but the sender's connection).
    rows_per_message: f64,
    /// The same during the measured sends, with the online devices' work.
    rows_per_message_online: f64,
    send_p50_ms: f64,
    send_p99_ms: f64,
    direct_send_p50_ms: f64,
    direct_send_p99_ms: f64,
    /// Per message: until the last online receiver committed it.
    last_p50_ms: f64,
    last_p99_ms: f64,
    /// Every delivery.
    delivery_p50_ms: f64,
    delivery_p99_ms: f64,
    /// One offline member's new device, until it holds every message.
    catch_up_ms: f64,
    catch_up_messages: u64,
    /// Setting up the accounts, the group and the online devices.
    setup_secs: f64,
}

/// Follows one receiver's change stream until its cursor of `conv` reached
/// `last`; returns when each `msg_seq` in `(from, last]` was committed.
async fn observe(
    mut changes: tidemark_client::Changes,
    conv: String,
    from: u64,
    last: u64,
    epoch: Instant,
    pb: ProgressBar,
) -> Result<Vec<(u64, u64)>> {
    let mut at = Vec::with_capacity((last - from) as usize);
    let mut held = from;
    while held < last {
        match changes.recv().await {
            // Emitted after the COMMIT of the page or the pull that moved it.
            Some(Change::CursorMoved(m)) if m.conv == conv && m.to > held => {
                let now = since(epoch);
                let top = m.to.min(last);
                at.extend((held + 1..=top).map(|seq| (seq, now)));
                pb.inc(top - held);
                held = top;
            }
            Some(Change::Lagged { missed }) => bail!("receiver missed {missed} change notifications"),
            Some(Change::Exited(exit)) => bail!("receiver client exited: {exit:?}"),
            Some(_) => {}
            None => bail!("receiver client gone"),
        }
    }
    Ok(at)
}

fn client_config(url: &str, user: &str, dir: &Path, limit: u32) -> ClientConfig {
    let mut config = ClientConfig::new(url, user, "phone", dir.join(format!("{user}.db"))).with_password(PASSWORD);
    config.sync_page_limit = limit;
    config
}

async fn tidemark_run(parent: &Path, plan: Plan, args: &FanoutArgs, pb: &ProgressBar) -> Result<LargeRun> {
    let dir = TempDir::create(parent)?;
    let server_dir = dir.0.join("server");
    let devices_dir = dir.0.join("devices");
    std::fs::create_dir_all(&devices_dir)?;
    let setup = Instant::now();
    let store = SqliteStore::open(&server_dir)?;
    let hash = cheap_hash()?;
    let users: Vec<String> = (0..plan.members).map(|i| format!("fan-u{i}")).collect();
    futures_util::stream::iter(users.iter().map(|u| store.create_user(u, &hash, 0)))
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_collect::<Vec<bool>>()
        .await
        .context("create the accounts")?;
    let large_members = match plan.mode {
        Mode::Shared => SHARED_THRESHOLD,
        Mode::PerMember => tidemark_core::large::PER_MEMBER_MAX,
    };
    let config = ServerConfig {
        retention: None,
        limits: tidemark_server::limits::LimitsConfig::off(),
        group_policy: GroupPolicy::new(large_members).map_err(|e| anyhow::anyhow!("{e}"))?,
        ..ServerConfig::default()
    };
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await?;
    let url = server.url();
    let ws_url = format!("ws://{}/v1/ws", server.addr);
    let result = measure(&store, &url, &ws_url, &users, &devices_dir, plan, args, pb, setup).await;
    server.stop().await;
    let weak = Arc::downgrade(&store);
    drop(store);
    wait_store_closed(weak, &server_dir).await;
    result
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    store: &Arc<SqliteStore>,
    url: &str,
    ws_url: &str,
    users: &[String],
    devices_dir: &Path,
    plan: Plan,
    args: &FanoutArgs,
    pb: &ProgressBar,
    setup: Instant,
) -> Result<LargeRun> {
    let login = Http::new(url).login(&users[0], PASSWORD, "phone").await.context("log in the sender")?;
    let (sender, _sender_events) = WsConn::connect(ws_url, &login.access_token).await.context("connect the sender")?;
    let create = |kind: &str, members: Vec<String>| ConvCreateReq { kind: kind.into(), members, client_msg_id: None };
    let group: ConvCreateOk =
        sender.request(op::CONV_CREATE, &create("group", users[1..].to_vec())).await.context("create the group")?;
    let direct: ConvCreateOk =
        sender.request(op::CONV_CREATE, &create("direct", vec![users[1].clone()])).await.context("create direct")?;
    let (conv, direct) = (group.conv, direct.conv);
    let send = |conv: &str, tag: String, n: u64, t0: u64| SendReq {
        conv: conv.to_owned(),
        client_msg_id: tag,
        kind: KIND.into(),
        content: payload(n, t0),
        mentions: Vec::new(),
        mention_all: false,
    };

    // 1. The write probe: nobody online but the sender.
    let rows_before = store.rows_written();
    let mut head = 0;
    for n in 0..u64::from(args.probe_messages) {
        head = sender.send(&send(&conv, format!("probe-{n}"), n, 0)).await.context("probe send")?.msg_seq;
    }
    let drained = Instant::now();
    while store.outbox_stats().await.context("outbox stats")?.backlog > 0 {
        ensure!(drained.elapsed() < RUN_TIMEOUT, "the outbox did not drain after the probe");
        tokio::time::sleep(DRAIN_POLL).await;
    }
    let rows_per_message = (store.rows_written() - rows_before) as f64 / f64::from(args.probe_messages.max(1));

    // 2. The online receivers, caught up with the probe.
    let mut clients = Vec::new();
    for u in &users[1..=plan.online as usize] {
        let c = Client::open(client_config(url, u, devices_dir, args.limit));
        clients.push(c.with_context(|| format!("open the client of {u}"))?);
    }
    let result: Result<LargeRun> = async {
        for c in &clients {
            c.start().await?;
        }
        try_join_all(clients.iter().map(|c| c.wait_state(ConnState::Ready, SETUP_TIMEOUT)))
            .await
            .context("receivers ready")?;
        try_join_all(clients.iter().map(|c| {
            let conv = &conv;
            c.wait_for(SETUP_TIMEOUT, move || async move {
                Ok(c.conversation(conv).await?.is_some_and(|s| s.contiguous_msg_seq >= head))
            })
        }))
        .await
        .context("receivers hold the probe")?;
        let setup_secs = setup.elapsed().as_secs_f64();

        // 3. The measured sends, each followed by a direct one.
        let messages = u64::from(args.messages);
        let last = head + messages;
        let epoch = Instant::now();
        let tasks: Vec<_> = clients
            .iter()
            .map(|c| tokio::spawn(observe(c.subscribe(), conv.clone(), head, last, epoch, pb.clone())))
            .collect();
        let rows_before = store.rows_written();
        let (mut group_send, mut direct_send) = (latency_hist()?, latency_hist()?);
        let mut t0_of: HashMap<u64, u64> = HashMap::new();
        for n in 0..messages {
            let t0 = since(epoch);
            let ok = sender.send(&send(&conv, format!("fan-{n}"), n, t0)).await.with_context(|| format!("send {n}"))?;
            record(&mut group_send, t0, since(epoch));
            ensure!(ok.msg_seq == head + n + 1, "message {n} at msg_seq {}, not {}", ok.msg_seq, head + n + 1);
            t0_of.insert(ok.msg_seq, t0);
            let t1 = since(epoch);
            sender.send(&send(&direct, format!("direct-{n}"), n, t1)).await.with_context(|| format!("direct {n}"))?;
            record(&mut direct_send, t1, since(epoch));
        }
        let seen = tokio::time::timeout(RUN_TIMEOUT, try_join_all(tasks)).await.context("receivers timed out")??;
        while store.outbox_stats().await.context("outbox stats")?.backlog > 0 {
            tokio::time::sleep(DRAIN_POLL).await;
        }
        let rows_online = (store.rows_written() - rows_before) as f64 / messages.max(1) as f64;
        let (mut deliveries, mut last_hist) = (latency_hist()?, latency_hist()?);
        let mut last_at: HashMap<u64, u64> = HashMap::new();
        for (c, seen) in clients.iter().zip(seen) {
            let seen = seen?;
            let held = c.messages(&conv).await?.iter().filter(|m| m.kind == KIND).count() as u64;
            let want = u64::from(args.probe_messages) + messages;
            ensure!(held == want, "a receiver holds {held} of {want} messages");
            for (seq, at) in seen {
                record(&mut deliveries, t0_of[&seq], at);
                let slot = last_at.entry(seq).or_insert(at);
                *slot = (*slot).max(at);
            }
        }
        for (seq, at) in &last_at {
            record(&mut last_hist, t0_of[seq], *at);
        }

        // 4. One offline member comes online on an empty database.
        let late = &users[plan.online as usize + 1];
        let c = Client::open(client_config(url, late, devices_dir, args.limit)).context("open the late client")?;
        let watch = tokio::spawn(observe(c.subscribe(), conv.clone(), 0, last, epoch, ProgressBar::hidden()));
        let started = Instant::now();
        c.start().await?;
        let caught = tokio::time::timeout(RUN_TIMEOUT, watch).await.context("catch-up timed out")?;
        let catch_up = started.elapsed();
        let held = c.messages(&conv).await?.iter().filter(|m| m.kind == KIND).count() as u64;
        c.stop().await;
        caught??;
        let want = u64::from(args.probe_messages) + messages;
        ensure!(held == want, "the late device holds {held} of {want} messages");

        Ok(LargeRun {
            members: plan.members,
            mode: plan.mode,
            online: plan.online,
            probe_messages: args.probe_messages,
            messages: args.messages,
            rows_per_message,
            rows_per_message_online: rows_online,
            send_p50_ms: ms(&group_send, 0.5),
            send_p99_ms: ms(&group_send, 0.99),
            direct_send_p50_ms: ms(&direct_send, 0.5),
            direct_send_p99_ms: ms(&direct_send, 0.99),
            last_p50_ms: ms(&last_hist, 0.5),
            last_p99_ms: ms(&last_hist, 0.99),
            delivery_p50_ms: ms(&deliveries, 0.5),
            delivery_p99_ms: ms(&deliveries, 0.99),
            catch_up_ms: catch_up.as_secs_f64() * 1000.0,
            catch_up_messages: held,
            setup_secs,
        })
    }
    .await;
    join_all(clients.iter().map(|c| c.stop())).await;
    drop(sender);
    result
}

#[derive(Debug, Clone, Serialize)]
struct RoundRun {
    round: u32,
    tidemark: LargeRun,
    /// The bare broadcast to `tidemark.online` receivers, in the same round.
    baseline: Run,
}

fn plans(args: &FanoutArgs) -> Vec<Plan> {
    let mut out = Vec::new();
    for &members in &args.large_sizes {
        let online = ((f64::from(members - 1) * args.online_fraction).round() as u32).clamp(1, members - 2);
        if u64::from(members) <= tidemark_core::large::PER_MEMBER_MAX {
            out.push(Plan { members, mode: Mode::PerMember, online });
        }
        out.push(Plan { members, mode: Mode::Shared, online });
    }
    out
}

pub async fn run(mut args: FanoutArgs) -> Result<()> {
    for &m in &args.large_sizes {
        ensure!(m >= 3, "a large-group run needs at least 3 members (a sender, an online and an offline one)");
    }
    ensure!((0.0..=1.0).contains(&args.online_fraction), "--online-fraction must be within 0..=1");
    if args.out == Path::new("bench-results/fanout.json") {
        args.out = "bench-results/fanout-large.json".into();
    }
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let plans = plans(&args);
    let per_round: u64 = plans.iter().map(|p| 2 * u64::from(p.online) * u64::from(args.messages)).sum();
    let pb = bar(per_round * u64::from(args.rounds), "deliveries");
    let mut runs: Vec<RoundRun> = Vec::new();
    for round in 1..=args.rounds {
        let mut baselines: HashMap<u32, Run> = HashMap::new();
        for plan in &plans {
            pb.set_message(format!("round {round}: {} {}, {} online", plan.mode.name(), plan.members, plan.online));
            let tidemark = tidemark_run(&parent, *plan, &args, &pb).await?;
            let baseline = match baselines.get(&plan.online) {
                Some(b) => {
                    pb.inc(u64::from(plan.online) * u64::from(args.messages));
                    b.clone()
                }
                None => {
                    pb.set_message(format!("round {round}: baseline, {} receivers", plan.online));
                    let b = baseline_run(&parent, &Shape::group(plan.online + 1, &args), &pb).await?;
                    baselines.insert(plan.online, b.clone());
                    b
                }
            };
            runs.push(RoundRun { round, tidemark, baseline });
        }
    }
    pb.finish_and_clear();

    println!(
        "tidemark bench fanout --large: one sender, {} probe messages (nobody online) then {} measured messages \
         per group (closed loop, each followed by a direct send), {:.0}% of the members online as SDK clients with \
         their own local SQLite (WAL, synchronous=FULL), the rest accounts only; delivery = the receiving device's \
         local COMMIT (CursorMoved); last = until the last online device committed the message; baseline = bare \
         broadcast to as many receivers; medians of {} rounds\n",
        args.probe_messages,
        args.messages,
        args.online_fraction * 100.0,
        args.rounds
    );
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    for plan in &plans {
        let mine: Vec<&RoundRun> =
            runs.iter().filter(|r| r.tidemark.members == plan.members && r.tidemark.mode == plan.mode).collect();
        let m = |f: &dyn Fn(&RoundRun) -> f64| median(mine.iter().map(|r| f(r)).collect());
        let t = |f: &dyn Fn(&LargeRun) -> f64| m(&|r| f(&r.tidemark));
        let send_ratio = m(&|r| r.tidemark.send_p50_ms / r.tidemark.direct_send_p50_ms.max(f64::MIN_POSITIVE));
        let last_ratio = m(&|r| r.tidemark.last_p99_ms / r.baseline.last_p99_ms.max(f64::MIN_POSITIVE));
        rows.push(vec![
            format!("{} {}", plan.mode.name(), plan.members),
            format!("{}", plan.online),
            format!("{:.1}", t(&|r| r.rows_per_message)),
            format!("{:.1}", t(&|r| r.rows_per_message_online)),
            format!("{:.2}/{:.2}", t(&|r| r.send_p50_ms), t(&|r| r.send_p99_ms)),
            format!("{:.2}/{:.2}", t(&|r| r.direct_send_p50_ms), t(&|r| r.direct_send_p99_ms)),
            format!("{send_ratio:.2}x"),
            format!("{:.1}/{:.1}", t(&|r| r.last_p50_ms), t(&|r| r.last_p99_ms)),
            format!("{:.1}/{:.1}", m(&|r| r.baseline.last_p50_ms), m(&|r| r.baseline.last_p99_ms)),
            format!("{last_ratio:.1}x"),
            format!("{:.0} ({})", t(&|r| r.catch_up_ms), mine.first().map_or(0, |r| r.tidemark.catch_up_messages)),
        ]);
        summary.push(serde_json::json!({
            "members": plan.members, "mode": plan.mode, "online": plan.online, "rounds": mine.len(),
            "rows_per_message": t(&|r| r.rows_per_message),
            "rows_per_message_online": t(&|r| r.rows_per_message_online),
            "send_p50_ms": t(&|r| r.send_p50_ms), "send_p99_ms": t(&|r| r.send_p99_ms),
            "direct_send_p50_ms": t(&|r| r.direct_send_p50_ms), "direct_send_p99_ms": t(&|r| r.direct_send_p99_ms),
            "send_over_direct_p50": send_ratio,
            "last_p50_ms": t(&|r| r.last_p50_ms), "last_p99_ms": t(&|r| r.last_p99_ms),
            "baseline_last_p50_ms": m(&|r| r.baseline.last_p50_ms),
            "baseline_last_p99_ms": m(&|r| r.baseline.last_p99_ms),
            "last_p99_over_baseline": last_ratio,
            "delivery_p50_ms": t(&|r| r.delivery_p50_ms), "delivery_p99_ms": t(&|r| r.delivery_p99_ms),
            "catch_up_ms": t(&|r| r.catch_up_ms),
            "setup_secs": t(&|r| r.setup_secs),
        }));
    }
    print_table(
        &[
            "run (median of rounds)",
            "online",
            "rows/msg",
            "rows/msg online",
            "send p50/p99 ms",
            "direct p50/p99 ms",
            "send/direct p50",
            "last commit p50/p99 ms",
            "baseline last p50/p99 ms",
            "last p99/baseline",
            "catch-up ms (msgs)",
        ],
        &rows,
    );
    println!(
        "\nrows/msg: rows the server's writer changed per message in the probe (nobody online); rows/msg online: \
         the same during the measured sends, the online devices' ACKs and marker clears included; goals: rows/msg \
         flat in shared mode, send/direct p50 <= 1.5x at 10,000 members, last p99/baseline <= 4x"
    );
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "fanout-large",
        "note": "shared mode: server threshold 2 (shared from creation); per-member: threshold 1000; online \
                 receivers are tidemark_client::Client with their own local SQLite, time stamp at \
                 Change::CursorMoved of the group (after the local COMMIT of the page or the conv.sync pull); \
                 offline members are accounts and memberships only; rows = SQLite total_changes of the server \
                 writer's committed transactions; baseline = fanout.rs's bare broadcast to as many receivers",
        "messages": args.messages, "probe_messages": args.probe_messages, "limit": args.limit,
        "online_fraction": args.online_fraction, "rounds": args.rounds,
        "summary": summary,
        "runs": runs,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}
