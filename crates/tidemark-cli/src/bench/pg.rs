//! `bench ingest --database postgres://…`: the same closed-loop WebSocket
//! senders against an in-process server on the PostgreSQL store, beside a
//! baseline measured in the same run on the same database: as many
//! concurrent tokio-postgres clients as senders, each inserting the same
//! rows into a table shaped like `messages`, one plain INSERT (one
//! transaction, one commit) at a time.
//!
//! Each round runs in a fresh PostgreSQL schema (`search_path` set on every
//! connection), dropped at the end of the round, also on error.
//!
//! WAL flushes come from `pg_stat_wal.wal_sync` (the number of times WAL was
//! fsynced: with `synchronous_commit=on` a commit returns after its WAL is
//! flushed, and one flush covers every commit that waited for it, so this is
//! the group-commit figure). `wal_write` counts `write()` calls, which the
//! WAL writer also makes in the background, so it says less about
//! durability; it is used only if `wal_sync` did not move (a
//! `wal_sync_method` of `open_sync`/`open_datasync` syncs inside the write).
//! The view is cluster-wide: other sessions on the same cluster during a
//! phase are counted too. Backends publish their counters when idle at most
//! once a second, and always at exit, so every phase ends by closing its
//! connections and waiting for their backends to exit; the server's setup
//! (users, logins, conversations) is pushed out before the send phase by a
//! write after a pause.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use futures_util::future::BoxFuture;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use rand::Rng;
use serde::Serialize;
use tidemark_postgres::{PgConfig, PgStore};
use tidemark_server::{Server, ServerConfig};
use tidemark_store::Store;
use tokio_postgres::Client;

use super::proc::{clock_ticks_per_s, cpu_ticks};
use super::stores::{connect, Schemas};

use super::{
    client_msg_id, content, drive, hex_id, init_logs, median, print_table, ratio, unix_ms, IngestArgs, ServerRound,
    Targets, Topology, LATENCY_MAX_US,
};

/// Longer than PostgreSQL's shortest interval between two publications of a
/// backend's counters (`PGSTAT_MIN_INTERVAL`, 1 s).
const STATS_SETTLE: Duration = Duration::from_millis(1_100);
/// Longest wait for a phase's backends to exit.
const BACKEND_EXIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often connections are counted during a phase.
const CONN_SAMPLE_EVERY: Duration = Duration::from_millis(20);

const NOTE: &str = "Baseline = as many concurrent tokio-postgres clients as senders, each inserting its sender's \
rows into a table shaped like `messages` (same keys) with one plain INSERT per transaction, in the same run, \
alternating with the server round by round, same database. msgs per WAL flush = messages / delta of \
pg_stat_wal.wal_sync over the phase (server: send phase and fan-out drain, fan-out commits included); \
pg_stat_wal is cluster-wide, so other sessions during a phase count too. Connections = peak backends with the \
phase's application_name. Summary values are medians of the rounds.";

#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Wal {
    records: i64,
    bytes: i64,
    write: i64,
    sync: i64,
}

impl Wal {
    fn delta(self, before: Wal) -> Wal {
        Wal {
            records: self.records - before.records,
            bytes: self.bytes - before.bytes,
            write: self.write - before.write,
            sync: self.sync - before.sync,
        }
    }

    /// The flush count: `wal_sync`, or `wal_write` if no sync was counted.
    fn flushes(self) -> (i64, &'static str) {
        if self.sync > 0 {
            (self.sync, "wal_sync")
        } else {
            (self.write, "wal_write")
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct PgPhase {
    wal: Wal,
    wal_flushes: i64,
    wal_counter: &'static str,
    msgs_per_wal_flush: f64,
    connections_peak: u64,
}

#[derive(Debug, Clone, Serialize)]
struct BaselineRun {
    rows: u64,
    clients: u32,
    secs: f64,
    rows_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Where the time of a `--nodes` phase went: the nodes' PostgreSQL
/// backends sampled every [`WAIT_SAMPLE_EVERY`] (`pg_stat_activity`: an
/// active backend's wait event, `CPU` when it waits on none; `idle in
/// transaction`: the backend waits for its node's next statement; `idle`:
/// no transaction), and the CPU the nodes and those backends used, from
/// `/proc` (clock ticks of 1/100 s), over the send phase and the drain.
#[derive(Debug, Clone, Serialize, Default)]
struct LimitEvidence {
    samples: u64,
    /// Share of backend samples per state, largest first.
    waits: Vec<(String, f64)>,
    wall_s: f64,
    node_cpu_s: f64,
    backend_cpu_s: f64,
    /// The machine's load average (1 min) at the end of the phase.
    load_1m: f64,
}

/// How often the `--nodes` phase samples `pg_stat_activity`.
const WAIT_SAMPLE_EVERY: Duration = Duration::from_millis(25);

/// Samples `app`'s backends until stopped: their states and wait events,
/// and each backend's CPU when first seen.
struct WaitSampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Sampled>,
}

/// What a [`WaitSampler`] saw: samples, backend states counted, and each
/// backend's CPU ticks when first seen.
type Sampled = (u64, std::collections::BTreeMap<String, u64>, std::collections::BTreeMap<u32, u64>);

/// What the `--nodes` phase starts its measurement with.
type PhaseStart = (Wal, ConnSampler, WaitSampler, u64, Instant);

impl WaitSampler {
    fn start(url: String, app: String) -> WaitSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let (mut samples, mut waits, mut first_ticks) =
                (0, std::collections::BTreeMap::new(), std::collections::BTreeMap::new());
            let Ok(admin) = connect(&url).await else { return (samples, waits, first_ticks) };
            while !s.load(Ordering::Relaxed) {
                let rows = admin
                    .query(
                        "SELECT pid, state, wait_event_type, wait_event FROM pg_stat_activity WHERE application_name = $1",
                        &[&app],
                    )
                    .await;
                if let Ok(rows) = rows {
                    samples += 1;
                    for r in rows {
                        let pid: i32 = r.get(0);
                        let state: Option<String> = r.get(1);
                        let (kind, event): (Option<String>, Option<String>) = (r.get(2), r.get(3));
                        let key = match (state.as_deref(), kind, event) {
                            (Some("active"), Some(k), Some(e)) => format!("active {k}:{e}"),
                            (Some("active"), _, _) => "active CPU".to_owned(),
                            (Some(other), _, _) => other.to_owned(),
                            (None, _, _) => "unknown".to_owned(),
                        };
                        *waits.entry(key).or_insert(0u64) += 1;
                        if let Ok(pid) = u32::try_from(pid) {
                            if let std::collections::btree_map::Entry::Vacant(v) = first_ticks.entry(pid) {
                                if let Some(t) = cpu_ticks(pid) {
                                    v.insert(t);
                                }
                            }
                        }
                    }
                }
                tokio::time::sleep(WAIT_SAMPLE_EVERY).await;
            }
            (samples, waits, first_ticks)
        });
        WaitSampler { stop, task }
    }

    /// Stops; the evidence, with the backends' CPU since first seen.
    async fn finish(self, wall: Duration, node_cpu_ticks: u64) -> LimitEvidence {
        self.stop.store(true, Ordering::Relaxed);
        let (samples, waits, first) = self.task.await.unwrap_or_default();
        let total: u64 = waits.values().sum();
        let mut waits: Vec<(String, f64)> =
            waits.into_iter().map(|(k, n)| (k, ratio(n as f64, total as f64))).collect();
        waits.sort_by(|a, b| b.1.total_cmp(&a.1));
        let backend_ticks: u64 =
            first.iter().filter_map(|(pid, t0)| cpu_ticks(*pid).map(|t| t.saturating_sub(*t0))).sum();
        let load_1m = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next().and_then(|v| v.parse().ok()))
            .unwrap_or(0.0);
        LimitEvidence {
            samples,
            waits,
            wall_s: wall.as_secs_f64(),
            node_cpu_s: node_cpu_ticks as f64 / clock_ticks_per_s(),
            backend_cpu_s: backend_ticks as f64 / clock_ticks_per_s(),
            load_1m,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct PgRound {
    round: u32,
    schema: String,
    /// `--nodes`: the nodes run.
    nodes: Option<u16>,
    server: ServerRound,
    server_pg: PgPhase,
    /// `--nodes`: where the server phase's time went.
    limits: Option<LimitEvidence>,
    baseline: BaselineRun,
    baseline_pg: PgPhase,
    ratio_server_baseline: f64,
}

#[derive(Debug, Clone, Serialize)]
struct PgSummary {
    msgs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    msgs_per_wal_flush: f64,
    requests_per_commit: f64,
    connections_peak: f64,
    baseline_rows_per_s: f64,
    baseline_p50_ms: f64,
    baseline_p99_ms: f64,
    baseline_rows_per_wal_flush: f64,
    baseline_connections_peak: f64,
    ratio_server_baseline: f64,
}

#[derive(Debug, Serialize)]
struct PgParams {
    senders: u32,
    messages_per_sender: u32,
    conversations_active: u32,
    rounds: u32,
    messages_per_round: u64,
    server_version: String,
    synchronous_commit: String,
    wal_sync_method: String,
    cpus: usize,
}

#[derive(Debug, Serialize)]
struct PgReport {
    bench: &'static str,
    note: &'static str,
    unix_time_ms: i64,
    params: PgParams,
    medians: PgSummary,
    rounds: Vec<PgRound>,
}

/// `url` with one more connection parameter, URL or key-value form.
fn with_param(url: &str, key: &str, value: &str) -> String {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}{key}={value}")
    } else {
        format!("{url} {key}={value}")
    }
}

async fn wal(admin: &Client) -> Result<Wal> {
    let r = admin
        .query_one("SELECT wal_records, wal_bytes::bigint, wal_write, wal_sync FROM pg_stat_wal", &[])
        .await
        .context("read pg_stat_wal")?;
    Ok(Wal { records: r.get(0), bytes: r.get(1), write: r.get(2), sync: r.get(3) })
}

async fn backends(admin: &Client, app: &str) -> Result<u64> {
    let n: i64 = admin
        .query_one("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1", &[&app])
        .await
        .context("read pg_stat_activity")?
        .get(0);
    Ok(n as u64)
}

/// Waits until no backend of `app` is left (their counters are then
/// published), then a little more for the last ones to land.
async fn wait_backends_gone(admin: &Client, app: &str) -> Result<()> {
    let deadline = Instant::now() + BACKEND_EXIT_TIMEOUT;
    while backends(admin, app).await? > 0 {
        ensure!(Instant::now() < deadline, "backends of {app} still running {BACKEND_EXIT_TIMEOUT:?} after close");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    Ok(())
}

/// Counts `app`'s backends every [`CONN_SAMPLE_EVERY`] until stopped.
struct ConnSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl ConnSampler {
    fn start(url: String, app: String) -> ConnSampler {
        let (peak, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (p, s) = (peak.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let Ok(admin) = connect(&url).await else { return };
            while !s.load(Ordering::Relaxed) {
                if let Ok(n) = backends(&admin, &app).await {
                    p.fetch_max(n, Ordering::Relaxed);
                }
                tokio::time::sleep(CONN_SAMPLE_EVERY).await;
            }
        });
        ConnSampler { peak, stop, task }
    }

    async fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        self.peak.load(Ordering::Relaxed)
    }
}

fn phase(wal: Wal, messages: u64, connections_peak: u64) -> PgPhase {
    let (flushes, counter) = wal.flushes();
    PgPhase {
        wal,
        wal_flushes: flushes,
        wal_counter: counter,
        msgs_per_wal_flush: ratio(messages as f64, flushes as f64),
        connections_peak,
    }
}

pub(super) async fn ingest(args: IngestArgs, url: &str) -> Result<()> {
    init_logs();
    let schemas = Schemas::connect(url).await?;
    let topo = Arc::new(Topology::new(args.senders as usize, args.conversations as usize));
    let per_round = u64::from(args.senders) * u64::from(args.messages());
    let admin = schemas.admin();
    let setting = |name: &'static str| async move {
        let v: String = admin.query_one(&format!("SHOW {name}"), &[]).await?.get(0);
        anyhow::Ok(v)
    };
    let params = PgParams {
        senders: args.senders,
        messages_per_sender: args.messages(),
        conversations_active: topo.convs.len() as u32,
        rounds: args.rounds,
        messages_per_round: per_round,
        server_version: setting("server_version").await?,
        synchronous_commit: setting("synchronous_commit").await?,
        wal_sync_method: setting("wal_sync_method").await?,
        cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    };

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
        // A fresh schema per round, dropped whatever happened.
        let (args, topo, pb, tag) = (&args, &topo, &pb, &tag);
        let r = schemas
            .run(&format!("r{round}"), |schema| async move {
                pg_round(args, url, admin, topo, &schema, round, pb, tag).await
            })
            .await?;
        pb.suspend(|| {
            eprintln!(
                "{tag}: {:.0} msgs/s, p50 {:.2} ms, p99 {:.2} ms, {:.1} msgs/WAL flush, {} conns; \
                 baseline {:.0} rows/s, p50 {:.2} ms, p99 {:.2} ms, {:.1} rows/WAL flush, {} conns",
                r.server.msgs_per_s,
                r.server.p50_ms,
                r.server.p99_ms,
                r.server_pg.msgs_per_wal_flush,
                r.server_pg.connections_peak,
                r.baseline.rows_per_s,
                r.baseline.p50_ms,
                r.baseline.p99_ms,
                r.baseline_pg.msgs_per_wal_flush,
                r.baseline_pg.connections_peak,
            )
        });
        rounds.push(r);
    }
    pb.finish_and_clear();

    let m = |f: &dyn Fn(&PgRound) -> f64| median(rounds.iter().map(f).collect());
    let medians = PgSummary {
        msgs_per_s: m(&|r| r.server.msgs_per_s),
        p50_ms: m(&|r| r.server.p50_ms),
        p99_ms: m(&|r| r.server.p99_ms),
        msgs_per_wal_flush: m(&|r| r.server_pg.msgs_per_wal_flush),
        requests_per_commit: m(&|r| r.server.requests_per_commit),
        connections_peak: m(&|r| r.server_pg.connections_peak as f64),
        baseline_rows_per_s: m(&|r| r.baseline.rows_per_s),
        baseline_p50_ms: m(&|r| r.baseline.p50_ms),
        baseline_p99_ms: m(&|r| r.baseline.p99_ms),
        baseline_rows_per_wal_flush: m(&|r| r.baseline_pg.msgs_per_wal_flush),
        baseline_connections_peak: m(&|r| r.baseline_pg.connections_peak as f64),
        ratio_server_baseline: m(&|r| r.ratio_server_baseline),
    };
    print_pg_report(&params, &medians, &rounds);

    let report = PgReport { bench: "ingest-postgres", note: NOTE, unix_time_ms: unix_ms(), params, medians, rounds };
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(&args.out, json + "\n").with_context(|| format!("write {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn pg_round(
    args: &IngestArgs,
    url: &str,
    admin: &Client,
    topo: &Arc<Topology>,
    schema: &str,
    round: u32,
    pb: &ProgressBar,
    tag: &str,
) -> Result<PgRound> {
    pb.set_message(format!("{tag}: server setup"));
    let (server, server_pg, limits) = match args.nodes {
        None => {
            let (server, server_pg) = server_phase(args, url, admin, topo, schema, round, pb, tag).await?;
            (server, server_pg, None)
        }
        Some(n) => {
            let (server, server_pg, limits) = nodes_phase(args, url, admin, topo, schema, round, pb, tag, n).await?;
            (server, server_pg, Some(limits))
        }
    };
    pb.set_message(format!("{tag}: baseline"));
    let (baseline, baseline_pg) = baseline_phase(url, admin, topo, schema, round, server.messages).await?;
    Ok(PgRound {
        round,
        schema: schema.to_owned(),
        ratio_server_baseline: ratio(server.msgs_per_s, baseline.rows_per_s),
        nodes: args.nodes,
        server,
        server_pg,
        limits,
        baseline,
        baseline_pg,
    })
}

#[allow(clippy::too_many_arguments)]
async fn server_phase(
    args: &IngestArgs,
    url: &str,
    admin: &Client,
    topo: &Topology,
    schema: &str,
    round: u32,
    pb: &ProgressBar,
    tag: &str,
) -> Result<(ServerRound, PgPhase)> {
    let app = format!("{schema}_srv");
    let config = PgConfig {
        schema: Some(schema.to_owned()),
        conv_writers: usize::from(args.conv_writers),
        ..PgConfig::new(with_param(url, "application_name", &app))
    };
    let store = PgStore::open(config).await.context("open the PostgreSQL store")?;
    let admin_token = format!("bench-{:032x}", rand::rng().random::<u128>());
    let config = ServerConfig {
        admin_token: Some(admin_token.clone()),
        limits: tidemark_server::limits::LimitsConfig::off(),
        ..ServerConfig::default()
    };
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await.context("start server")?;

    // Before the send phase: let the setup's counters be published (a write
    // after a pause makes the writer's backend publish), then read the WAL
    // counters and start counting connections.
    let before: Arc<Mutex<Option<(Wal, ConnSampler)>>> = Arc::new(Mutex::new(None));
    let admin_url = url.to_owned();
    let hook = {
        let (store, before, app) = (store.clone(), before.clone(), app.clone());
        move || -> BoxFuture<'static, Result<()>> {
            let (store, before, app, admin_url) = (store.clone(), before.clone(), app.clone(), admin_url.clone());
            Box::pin(async move {
                tokio::time::sleep(STATS_SETTLE).await;
                store.create_user("bench-stats-flush", "x", 0).await.context("flush write")?;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let probe = connect(&admin_url).await?;
                let w = wal(&probe).await?;
                let sampler = ConnSampler::start(admin_url, app);
                *before.lock().expect("not poisoned") = Some((w, sampler));
                Ok(())
            })
        }
    };
    let result = drive(args, topo, &Targets::one(&server, &*store), &admin_token, round, pb, tag, Some(&hook)).await;
    server.stop().await;
    drop(hook);
    drop(store);
    let taken = before.lock().expect("not poisoned").take();
    let (wal_before, sampler) = match (result.as_ref(), taken) {
        (Ok(_), Some(t)) => t,
        (_, taken) => {
            if let Some((_, s)) = taken {
                s.finish().await;
            }
            return Err(result.err().unwrap_or_else(|| anyhow::anyhow!("the send phase never started")));
        }
    };
    let peak = sampler.finish().await;
    wait_backends_gone(admin, &app).await?;
    let delta = wal(admin).await?.delta(wal_before);
    let server = result?;
    let messages = server.messages;
    Ok((server, phase(delta, messages, peak)))
}

/// The server phase on `n` `tidemark serve` processes sharing the round's
/// schema, senders spread over them, with [`LimitEvidence`].
#[allow(clippy::too_many_arguments)]
async fn nodes_phase(
    args: &IngestArgs,
    url: &str,
    admin: &Client,
    topo: &Topology,
    schema: &str,
    round: u32,
    pb: &ProgressBar,
    tag: &str,
    n: u16,
) -> Result<(ServerRound, PgPhase, LimitEvidence)> {
    let app = format!("{schema}_srv");
    let node_url = with_param(url, "application_name", &app);
    let admin_token = format!("bench-{:032x}", rand::rng().random::<u128>());
    let token_file = std::env::temp_dir().join(format!("{schema}.admin-token"));
    std::fs::write(&token_file, &admin_token).context("write the admin token file")?;
    let conv_writers = args.conv_writers.to_string();
    let token_path = token_file.display().to_string();
    let mut nodes = Vec::with_capacity(usize::from(n));
    let prefix = format!("tidemark-bench.{schema}");
    for _ in 0..n {
        // The first node migrates the schema; the others find it done.
        let mut serve = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database",
            &node_url,
            "--database-schema",
            schema,
            "--database-conv-writers",
            &conv_writers,
            "--admin-token-file",
            &token_path,
            "--no-rate-limits",
        ];
        if let Some(nats) = &args.nats {
            serve.extend(["--nats", nats, "--nats-prefix", &prefix]);
        }
        let node = super::proc::spawn_server(&serve).context("start a tidemark serve node")?;
        nodes.push(node);
    }
    let _ = std::fs::remove_file(&token_file);
    let addrs: Vec<std::net::SocketAddr> = nodes.iter().map(|(_, a)| *a).collect();
    if args.nats.is_some() {
        // Routing starts once every node hears the others (issue 14).
        let deadline = Instant::now() + Duration::from_secs(30);
        for a in &addrs {
            while super::proc::scrape(*a, "tidemark_route_nodes").await? != f64::from(n) {
                anyhow::ensure!(Instant::now() < deadline, "node {a} never saw {n} live nodes on the bus");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let pids: Vec<u32> = nodes.iter().map(|(c, _)| c.pid()).collect();
    let node_ticks = move || pids.iter().filter_map(|p| cpu_ticks(*p)).sum::<u64>();
    let targets = Targets {
        addrs: addrs.clone(),
        counters: Box::new(|| {
            let addrs = addrs.clone();
            Box::pin(async move {
                let (mut commits, mut writes) = (0.0, 0.0);
                for a in addrs {
                    let v = super::proc::scrape_all(
                        a,
                        &["tidemark_store_commits_total", "tidemark_store_commit_batch_requests_sum"],
                    )
                    .await?;
                    commits += v[0];
                    writes += v[1];
                }
                Ok((commits as u64, writes as u64, 0))
            })
        }),
        backlog: Box::new(move || {
            Box::pin(async move {
                let n: i64 = admin.query_one(&format!("SELECT count(*) FROM {schema}.outbox"), &[]).await?.get(0);
                Ok(n as u64)
            })
        }),
    };

    let before: Arc<Mutex<Option<PhaseStart>>> = Arc::new(Mutex::new(None));
    let hook = {
        let (before, app, admin_url, http_url, token) =
            (before.clone(), app.clone(), url.to_owned(), format!("http://{}", targets.addrs[0]), admin_token.clone());
        let node_ticks = node_ticks.clone();
        move || -> BoxFuture<'static, Result<()>> {
            let (before, app, admin_url, http_url, token, node_ticks) =
                (before.clone(), app.clone(), admin_url.clone(), http_url.clone(), token.clone(), node_ticks.clone());
            Box::pin(async move {
                tokio::time::sleep(STATS_SETTLE).await;
                let http = tidemark_client::Http::new(&http_url);
                http.create_user(&token, "bench-stats-flush", super::PASSWORD).await.context("flush write")?;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let probe = connect(&admin_url).await?;
                let w = wal(&probe).await?;
                let conns = ConnSampler::start(admin_url.clone(), app.clone());
                let waits = WaitSampler::start(admin_url, app);
                *before.lock().expect("not poisoned") = Some((w, conns, waits, node_ticks(), Instant::now()));
                Ok(())
            })
        }
    };
    let result = drive(args, topo, &targets, &admin_token, round, pb, tag, Some(&hook)).await;
    if args.nats.is_some() {
        // Where the sends were written: forwarded to their owner, or here.
        let (mut forwarded, mut served) = (0.0, 0.0);
        for a in &targets.addrs {
            let v =
                super::proc::scrape_all(*a, &["tidemark_route_forwarded_total", "tidemark_route_served_total"]).await?;
            forwarded += v[0];
            served += v[1];
        }
        pb.println(format!("  routing: {forwarded} sends forwarded to their owner node, {served} written there"));
    }
    let taken = before.lock().expect("not poisoned").take();
    let evidence = match taken {
        Some((w, conns, waits, ticks0, t0)) => {
            let evidence = waits.finish(t0.elapsed(), node_ticks().saturating_sub(ticks0)).await;
            Some((w, conns, evidence))
        }
        None => None,
    };
    drop(targets);
    drop(nodes);
    let (wal_before, sampler, evidence) = match (result.as_ref(), evidence) {
        (Ok(_), Some(t)) => t,
        (_, taken) => {
            if let Some((_, s, _)) = taken {
                s.finish().await;
            }
            return Err(result.err().unwrap_or_else(|| anyhow::anyhow!("the send phase never started")));
        }
    };
    let peak = sampler.finish().await;
    wait_backends_gone(admin, &app).await?;
    let delta = wal(admin).await?.delta(wal_before);
    let server = result?;
    let messages = server.messages;
    Ok((server, phase(delta, messages, peak), evidence))
}

async fn baseline_phase(
    url: &str,
    admin: &Client,
    topo: &Topology,
    schema: &str,
    round: u32,
    rows: u64,
) -> Result<(BaselineRun, PgPhase)> {
    admin
        .batch_execute(&format!(
            "CREATE TABLE {schema}.baseline_messages (
                conv_id        TEXT COLLATE \"C\" NOT NULL,
                msg_seq        BIGINT NOT NULL,
                message_id     TEXT COLLATE \"C\" NOT NULL UNIQUE,
                sender         TEXT COLLATE \"C\" NOT NULL,
                client_msg_id  TEXT COLLATE \"C\" NOT NULL,
                kind           TEXT COLLATE \"C\" NOT NULL,
                content        TEXT COLLATE \"C\" NOT NULL,
                created_at     BIGINT NOT NULL,
                PRIMARY KEY (conv_id, msg_seq),
                UNIQUE (sender, client_msg_id)
            )"
        ))
        .await
        .context("create the baseline table")?;

    // The same rows as the server round: sender i's messages in order, in
    // its conversation, contiguous msg_seq per conversation.
    let senders = topo.senders.len();
    let per_sender = rows / senders as u64;
    let mut rng = rand::rng();
    let conv_ids: Vec<String> = topo.convs.iter().map(|_| hex_id("c", &mut rng)).collect();
    let mut heads = vec![0i64; conv_ids.len()];
    let mut work: Vec<Vec<[String; 4]>> = vec![Vec::new(); senders];
    let mut seqs: Vec<Vec<i64>> = vec![Vec::new(); senders];
    for n in 0..per_sender {
        for (i, &(user, conv)) in topo.senders.iter().enumerate() {
            heads[conv] += 1;
            seqs[i].push(heads[conv]);
            work[i].push([
                conv_ids[conv].clone(),
                topo.users[user].clone(),
                client_msg_id(round, i, n),
                content(n).to_string(),
            ]);
        }
    }

    let app = format!("{schema}_base");
    let client_url =
        with_param(&with_param(url, "application_name", &app), "options", &format!("-c%20search_path%3D{schema}"));
    let mut clients = Vec::with_capacity(senders);
    for _ in 0..senders {
        clients.push(connect(&client_url).await?);
    }
    let peak = backends(admin, &app).await?;
    let wal_before = wal(admin).await?;
    let barrier = Arc::new(tokio::sync::Barrier::new(senders + 1));
    let mut tasks = Vec::with_capacity(senders);
    for ((client, rows), seqs) in clients.into_iter().zip(work).zip(seqs) {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let stmt = client
                .prepare(
                    "INSERT INTO baseline_messages
                     (conv_id, msg_seq, message_id, sender, client_msg_id, kind, content, created_at)
                     VALUES ($1, $2, $3, $4, $5, 'text', $6, $7)",
                )
                .await?;
            let mut hist = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
            barrier.wait().await;
            for ([conv, sender, cmid, body], seq) in rows.iter().zip(seqs) {
                let t = Instant::now();
                // Minted as the server mints it, when the row is written
                // (time-ordered: tidemark_core::ids::message_id).
                let now = unix_ms();
                let id = tidemark_core::ids::message_id(now, rand::rng().random());
                client.execute(&stmt, &[conv, &seq, &id, sender, cmid, body, &now]).await?;
                hist.saturating_record(t.elapsed().as_micros() as u64);
            }
            anyhow::Ok(hist)
        }));
    }
    let start = Instant::now();
    barrier.wait().await;
    let mut latency = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
    let mut first_error = None;
    for task in tasks {
        match task.await.context("baseline client")? {
            Ok(h) => latency.add(&h)?,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // The clients are gone with their tasks: their backends exit.
    wait_backends_gone(admin, &app).await?;
    let delta = wal(admin).await?.delta(wal_before);
    if let Some(e) = first_error {
        return Err(e);
    }
    let total = per_sender * senders as u64;
    let ms = |us: u64| us as f64 / 1000.0;
    let run = BaselineRun {
        rows: total,
        clients: senders as u32,
        secs,
        rows_per_s: ratio(total as f64, secs),
        p50_ms: ms(latency.value_at_quantile(0.50)),
        p99_ms: ms(latency.value_at_quantile(0.99)),
    };
    Ok((run, phase(delta, total, peak)))
}

fn print_pg_report(p: &PgParams, s: &PgSummary, rounds: &[PgRound]) {
    let f0 = |x: f64| format!("{x:.0}");
    let f1 = |x: f64| format!("{x:.1}");
    let f2 = |x: f64| format!("{x:.2}");
    println!();
    println!(
        "tidemark bench ingest (PostgreSQL {}, synchronous_commit={}, wal_sync_method={}): {} senders x {} messages, \
         {} conversations, {} round(s)",
        p.server_version,
        p.synchronous_commit,
        p.wal_sync_method,
        p.senders,
        p.messages_per_sender,
        p.conversations_active,
        p.rounds
    );
    println!();
    let rows = vec![
        vec!["msgs/s".into(), f0(s.msgs_per_s), f0(s.baseline_rows_per_s), f2(s.ratio_server_baseline)],
        vec!["latency p50 (ms)".into(), f2(s.p50_ms), f2(s.baseline_p50_ms), String::new()],
        vec!["latency p99 (ms)".into(), f2(s.p99_ms), f2(s.baseline_p99_ms), String::new()],
        vec!["msgs per WAL flush".into(), f1(s.msgs_per_wal_flush), f1(s.baseline_rows_per_wal_flush), String::new()],
        vec!["connections (peak)".into(), f0(s.connections_peak), f0(s.baseline_connections_peak), String::new()],
        vec!["requests per commit".into(), f1(s.requests_per_commit), "1.0".into(), String::new()],
    ];
    print_table(&["median of rounds", "server", "baseline", "server/baseline"], &rows);
    println!();
    let per_round: Vec<Vec<String>> = rounds
        .iter()
        .map(|r| {
            vec![
                r.round.to_string(),
                f0(r.server.msgs_per_s),
                f2(r.server.p50_ms),
                f2(r.server.p99_ms),
                f1(r.server_pg.msgs_per_wal_flush),
                r.server_pg.connections_peak.to_string(),
                f0(r.baseline.rows_per_s),
                f2(r.baseline.p50_ms),
                f2(r.baseline.p99_ms),
                f1(r.baseline_pg.msgs_per_wal_flush),
                r.baseline_pg.connections_peak.to_string(),
                f2(r.ratio_server_baseline),
            ]
        })
        .collect();
    print_table(
        &[
            "round",
            "msgs/s",
            "p50 ms",
            "p99 ms",
            "msg/flush",
            "conns",
            "base r/s",
            "base p50",
            "base p99",
            "base r/flush",
            "base conns",
            "srv/base",
        ],
        &per_round,
    );
    println!();
    for r in rounds {
        let Some(l) = &r.limits else { continue };
        let waits: Vec<String> = l.waits.iter().take(6).map(|(k, f)| format!("{k} {:.0}%", f * 100.0)).collect();
        println!(
            "round {} on {} node(s): node CPU {:.1} s and backend CPU {:.1} s in {:.1} s (load {:.1}); backends: {}",
            r.round,
            r.nodes.unwrap_or(1),
            l.node_cpu_s,
            l.backend_cpu_s,
            l.wall_s,
            l.load_1m,
            waits.join(", ")
        );
    }
    println!();
    let counter = rounds.first().map(|r| r.server_pg.wal_counter).unwrap_or("wal_sync");
    println!("note: WAL flushes = delta of pg_stat_wal.{counter} (cluster-wide); the baseline runs in the same round,");
    println!("      same database, one plain INSERT per transaction per client; the server's figures include fan-out.");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_added_to_both_url_forms() {
        assert_eq!(with_param("postgres://u@h/db", "a", "b"), "postgres://u@h/db?a=b");
        assert_eq!(with_param("postgres://u@h/db?x=y", "a", "b"), "postgres://u@h/db?x=y&a=b");
        assert_eq!(with_param("host=h user=u", "a", "b"), "host=h user=u a=b");
    }

    #[test]
    fn wal_flushes_prefer_sync() {
        assert_eq!(Wal { sync: 3, write: 9, ..Wal::default() }.flushes(), (3, "wal_sync"));
        assert_eq!(Wal { sync: 0, write: 9, ..Wal::default() }.flushes(), (9, "wal_write"));
    }
}
