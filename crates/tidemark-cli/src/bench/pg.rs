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
    drive, hex_id, init_logs, median, print_table, ratio, unix_ms, IngestArgs, ServerRound, Targets, Topology,
    LATENCY_MAX_US,
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
phase's application_name. Summary values are medians of the rounds. Floor = the baseline's clients, each message \
one statement (one transaction) writing on the server's own tables the rows the storage design writes for it: the \
conversation's head, the message, its outbox row, and for both members the head, a user-log event and the \
conversation row; floor / baseline bounds what a server on this design reaches of the baseline when it commits each \
message alone.";

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
    /// The storage design's floor (`floor_phase`), the baseline's clients.
    floor: BaselineRun,
    floor_pg: PgPhase,
    ratio_server_baseline: f64,
    /// The floor's messages/s over the baseline's rows/s.
    ratio_floor_baseline: f64,
    /// The server's messages/s over the floor's.
    ratio_server_floor: f64,
    /// The floor on [`FLOOR_WRITERS`] connections in transactions of the
    /// server's requests per commit.
    floor_writers: Vec<FloorWriters>,
}

/// The floor's statements on `writers` connections, each owning the
/// conversations `conv mod writers` (as the server's conversation writers
/// own hash partitions), in transactions of `batch` messages sent together.
#[derive(Debug, Clone, Serialize)]
struct FloorWriters {
    writers: usize,
    batch: usize,
    run: BaselineRun,
    pg: PgPhase,
    ratio_baseline: f64,
}

/// The writer counts the floor runs with: one, as the server's default
/// conversation writer, and one per core of this machine's two.
const FLOOR_WRITERS: [usize; 2] = [1, 2];

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
    floor_msgs_per_s: f64,
    floor_p50_ms: f64,
    floor_p99_ms: f64,
    floor_msgs_per_wal_flush: f64,
    ratio_floor_baseline: f64,
    ratio_server_floor: f64,
    /// Per entry of [`FLOOR_WRITERS`], medians of the rounds.
    floor_writers: Vec<FloorWritersSummary>,
}

/// [`FloorWriters`] as the summary reports it: medians of the rounds.
#[derive(Debug, Clone, Serialize)]
struct FloorWritersSummary {
    writers: usize,
    msgs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    msgs_per_wal_flush: f64,
    batch: f64,
    ratio_baseline: f64,
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
                 baseline {:.0} rows/s, p50 {:.2} ms, p99 {:.2} ms, {:.1} rows/WAL flush, {} conns; floor {:.0} msgs/s, writers {}",
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
                r.floor.rows_per_s,
                r.floor_writers.iter().map(|w| format!("{}: {:.0} msgs/s", w.writers, w.run.rows_per_s)).collect::<Vec<_>>().join(", "),
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
        floor_msgs_per_s: m(&|r| r.floor.rows_per_s),
        floor_p50_ms: m(&|r| r.floor.p50_ms),
        floor_p99_ms: m(&|r| r.floor.p99_ms),
        floor_msgs_per_wal_flush: m(&|r| r.floor_pg.msgs_per_wal_flush),
        ratio_floor_baseline: m(&|r| r.ratio_floor_baseline),
        ratio_server_floor: m(&|r| r.ratio_server_floor),
        floor_writers: FLOOR_WRITERS
            .iter()
            .enumerate()
            .map(|(k, &writers)| {
                let w = |f: &dyn Fn(&FloorWriters) -> f64| m(&|r| f(&r.floor_writers[k]));
                FloorWritersSummary {
                    writers,
                    msgs_per_s: w(&|x| x.run.rows_per_s),
                    p50_ms: w(&|x| x.run.p50_ms),
                    p99_ms: w(&|x| x.run.p99_ms),
                    msgs_per_wal_flush: w(&|x| x.pg.msgs_per_wal_flush),
                    batch: w(&|x| x.batch as f64),
                    ratio_baseline: w(&|x| x.ratio_baseline),
                }
            })
            .collect(),
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
    pb.set_message(format!("{tag}: floor"));
    let (floor, floor_pg) = floor_phase(url, admin, topo, schema, (round, server.messages), None).await?;
    let batch = (server.requests_per_commit.round() as usize).max(1);
    let mut floor_writers = Vec::with_capacity(FLOOR_WRITERS.len());
    for writers in FLOOR_WRITERS {
        pb.set_message(format!("{tag}: floor, {writers} writer(s)"));
        let (run, pg) = floor_phase(url, admin, topo, schema, (round, server.messages), Some((batch, writers))).await?;
        let ratio_baseline = ratio(run.rows_per_s, baseline.rows_per_s);
        floor_writers.push(FloorWriters { writers, batch, run, pg, ratio_baseline });
    }
    Ok(PgRound {
        round,
        schema: schema.to_owned(),
        ratio_server_baseline: ratio(server.msgs_per_s, baseline.rows_per_s),
        ratio_floor_baseline: ratio(floor.rows_per_s, baseline.rows_per_s),
        ratio_server_floor: ratio(server.msgs_per_s, floor.rows_per_s),
        floor,
        floor_pg,
        floor_writers,
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

/// A parameter of a timed client's statement: a value, or minted when the
/// statement runs (as the server mints them, when the row is written).
enum Arg {
    Text(String),
    Int(i64),
    /// The time, ms.
    Now,
    /// A message id (time-ordered: `tidemark_core::ids::message_id`).
    MessageId,
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
    let mut rng = rand::rng();
    let conv_ids: Vec<String> = topo.convs.iter().map(|_| hex_id("c", &mut rng)).collect();
    let mut heads = vec![0i64; conv_ids.len()];
    let mut work: Vec<Vec<Vec<Arg>>> = (0..topo.senders.len()).map(|_| Vec::new()).collect();
    for t in topo.traffic(round, rows) {
        heads[t.conv] += 1;
        work[t.index].push(vec![
            Arg::Text(conv_ids[t.conv].clone()),
            Arg::Int(heads[t.conv]),
            Arg::MessageId,
            Arg::Text(topo.users[t.user].clone()),
            Arg::Text(t.client_msg_id),
            Arg::Text(t.content),
            Arg::Now,
        ]);
    }
    let sql =
        "INSERT INTO baseline_messages (conv_id, msg_seq, message_id, sender, client_msg_id, kind, content, created_at)
               VALUES ($1, $2, $3, $4, $5, 'text', $6, $7)";
    timed_clients(url, admin, &format!("{schema}_base"), schema, (sql, 1), work).await
}

/// The floor on PostgreSQL: the same clients as the baseline, each message
/// one statement in its own transaction that writes the rows the storage
/// design writes for it on the server's own tables (the round's schema):
/// the conversation's head advanced, the message, its outbox row, and for
/// both members of the direct conversation the head, a user-log event and
/// the conversation row. Less than the server does (no idempotency lookup,
/// no membership check, no outbox delete, no second transaction for the
/// fan-out, no reads), so `floor / baseline` bounds what a server on this
/// design reaches of the baseline when it commits each message alone; the
/// server's group commits can go past it only by sharing commits.
///
/// With `writers` = `(batch, n)`, the same statements run on `n`
/// connections instead, each owning the conversations `conv mod n`, in
/// transactions of `batch` messages sent together (pipelined), in the
/// senders' interleaved order: the server's conversation writers and their
/// group commits with nothing else, the fan-out in the same transaction.
async fn floor_phase(
    url: &str,
    admin: &Client,
    topo: &Topology,
    schema: &str,
    (round, rows): (u32, u64),
    writers: Option<(usize, usize)>,
) -> Result<(BaselineRun, PgPhase)> {
    // Users and conversations of their own, beside the server phase's.
    let tag = match writers {
        None => "floor".to_owned(),
        Some((_, n)) => format!("floor{n}w"),
    };
    let user = |u: usize| format!("{tag}-{}", topo.users[u]);
    let mut rng = rand::rng();
    let conv_ids: Vec<String> = topo.convs.iter().map(|_| hex_id("c", &mut rng)).collect();
    for id in &conv_ids {
        admin
            .execute(
                &format!(
                    "INSERT INTO {schema}.conversations (conv_id, kind, head, epoch, created_at) VALUES ($1, 'direct', 0, 1, $2)"
                ),
                &[id, &unix_ms()],
            )
            .await
            .context("create the floor's conversations")?;
    }
    let clients = writers.map_or(topo.senders.len(), |(_, n)| n);
    let mut work: Vec<Vec<Vec<Arg>>> = (0..clients).map(|_| Vec::new()).collect();
    for t in topo.traffic(round, rows) {
        let (a, b) = topo.convs[t.conv];
        let client = writers.map_or(t.index, |(_, n)| t.conv % n);
        let peer = if t.user == a { b } else { a };
        work[client].push(vec![
            Arg::Text(conv_ids[t.conv].clone()),
            Arg::MessageId,
            Arg::Text(user(t.user)),
            Arg::Text(Topology::device(t.index)),
            Arg::Text(t.client_msg_id),
            Arg::Text(t.content),
            Arg::Now,
            Arg::Text(user(peer)),
        ]);
    }
    // The heads are advanced after the conversation's row lock is taken
    // (`h` reads `c`), so the two senders of a conversation queue on it and
    // never lock the two heads in opposite orders.
    let sql = "WITH c AS (UPDATE conversations SET head = head + 1 WHERE conv_id = $1 RETURNING head),
         m AS (INSERT INTO messages (conv_id, msg_seq, message_id, sender, sender_device, client_msg_id, kind,
                                     content, state, version, created_at)
               SELECT $1, c.head, $2, $3, $4, $5, 'text', $6, 'normal', 1, $7 FROM c RETURNING msg_seq),
         o AS (INSERT INTO outbox (conv_id, kind, source_event_id, msg_seq, actor, created_at)
               SELECT $1, 'message', $2, m.msg_seq, $3, $7 FROM m),
         h AS (INSERT INTO user_heads (user_id, high_watermark)
               SELECT x, 1 FROM c, unnest(ARRAY[$3::text, $8::text]) AS x
               ON CONFLICT (user_id) DO UPDATE SET high_watermark = user_heads.high_watermark + 1
               RETURNING user_id, high_watermark),
         e AS (INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id,
                                        period_id, created_at)
               SELECT h.user_id, h.high_watermark, 'message', $1, m.msg_seq, $2, $2, 0, $7 FROM h, m),
         u AS (INSERT INTO user_convs (user_id, conv_id, last_msg_seq, read_seq, unread)
               SELECT h.user_id, $1, m.msg_seq, CASE WHEN h.user_id = $3 THEN m.msg_seq ELSE 0 END,
                      CASE WHEN h.user_id = $3 THEN 0 ELSE 1 END FROM h, m
               ON CONFLICT (user_id, conv_id) DO UPDATE SET
                  last_msg_seq = GREATEST(user_convs.last_msg_seq, excluded.last_msg_seq),
                  read_seq = GREATEST(user_convs.read_seq, excluded.read_seq),
                  unread = user_convs.unread + excluded.unread)
         SELECT m.msg_seq FROM m";
    let run = timed_clients(
        url,
        admin,
        &format!("{schema}_{tag}"),
        schema,
        (sql, writers.map_or(1, |(batch, _)| batch)),
        work,
    )
    .await?;
    // Every message and both its events were written.
    let floor_users: Vec<String> = (0..topo.users.len()).map(user).collect();
    let events: i64 = admin
        .query_one(&format!("SELECT COUNT(*) FROM {schema}.user_events WHERE user_id = ANY($1)"), &[&floor_users])
        .await?
        .get(0);
    ensure!(events as u64 == 2 * run.0.rows, "the floor wrote {events} events for {} messages", run.0.rows);
    Ok(run)
}

/// One tokio-postgres client per entry of `work`, connected as `app` with
/// `schema` first on its path, each running `sql` once per argument list
/// of its entry, in order, all started together: one statement (one
/// transaction) at a time with `per_tx` 1, else `per_tx` statements per
/// transaction, sent together (pipelined). With the WAL flushes and
/// connections of the phase; a statement's latency is its transaction's.
async fn timed_clients(
    url: &str,
    admin: &Client,
    app: &str,
    schema: &str,
    (sql, per_tx): (&'static str, usize),
    work: Vec<Vec<Vec<Arg>>>,
) -> Result<(BaselineRun, PgPhase)> {
    let n = work.len();
    let client_url =
        with_param(&with_param(url, "application_name", app), "options", &format!("-c%20search_path%3D{schema}"));
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(connect(&client_url).await?);
    }
    let peak = backends(admin, app).await?;
    let wal_before = wal(admin).await?;
    let barrier = Arc::new(tokio::sync::Barrier::new(n + 1));
    let total: u64 = work.iter().map(|w| w.len() as u64).sum();
    let mut tasks = Vec::with_capacity(n);
    for (client, rows) in clients.into_iter().zip(work) {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = client;
            let stmt = client.prepare(sql).await?;
            let mut hist = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
            barrier.wait().await;
            for chunk in rows.chunks(per_tx.max(1)) {
                let t = Instant::now();
                let now = unix_ms();
                let ids: Vec<String> =
                    chunk.iter().map(|_| tidemark_core::ids::message_id(now, rand::rng().random())).collect();
                let params: Vec<Vec<&(dyn tokio_postgres::types::ToSql + Sync)>> = chunk
                    .iter()
                    .zip(&ids)
                    .map(|(args, id)| {
                        args.iter()
                            .map(|a| -> &(dyn tokio_postgres::types::ToSql + Sync) {
                                match a {
                                    Arg::Text(s) => s,
                                    Arg::Int(i) => i,
                                    Arg::Now => &now,
                                    Arg::MessageId => id,
                                }
                            })
                            .collect()
                    })
                    .collect();
                if per_tx <= 1 {
                    client.execute(&stmt, &params[0]).await?;
                } else {
                    let tx = client.transaction().await?;
                    futures_util::future::try_join_all(params.iter().map(|p| tx.execute(&stmt, p))).await?;
                    tx.commit().await?;
                }
                let us = t.elapsed().as_micros() as u64;
                for _ in chunk {
                    hist.saturating_record(us);
                }
            }
            anyhow::Ok(hist)
        }));
    }
    let start = Instant::now();
    barrier.wait().await;
    let mut latency = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
    let mut first_error = None;
    for task in tasks {
        match task.await.context("timed client")? {
            Ok(h) => latency.add(&h)?,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // The clients are gone with their tasks: their backends exit.
    wait_backends_gone(admin, app).await?;
    let delta = wal(admin).await?.delta(wal_before);
    if let Some(e) = first_error {
        return Err(e);
    }
    let ms = |us: u64| us as f64 / 1000.0;
    let run = BaselineRun {
        rows: total,
        clients: n as u32,
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
    let line = |name: &str, fixed: [String; 3], f: &dyn Fn(&FloorWritersSummary) -> String| {
        let mut row = vec![name.to_owned()];
        row.extend(fixed);
        row.extend(s.floor_writers.iter().map(f));
        row
    };
    let rows = vec![
        line("msgs/s", [f0(s.msgs_per_s), f0(s.baseline_rows_per_s), f0(s.floor_msgs_per_s)], &|w| f0(w.msgs_per_s)),
        line("latency p50 (ms)", [f2(s.p50_ms), f2(s.baseline_p50_ms), f2(s.floor_p50_ms)], &|w| f2(w.p50_ms)),
        line("latency p99 (ms)", [f2(s.p99_ms), f2(s.baseline_p99_ms), f2(s.floor_p99_ms)], &|w| f2(w.p99_ms)),
        line(
            "msgs per WAL flush",
            [f1(s.msgs_per_wal_flush), f1(s.baseline_rows_per_wal_flush), f1(s.floor_msgs_per_wal_flush)],
            &|w| f1(w.msgs_per_wal_flush),
        ),
        line("requests per commit", [f1(s.requests_per_commit), "1.0".into(), "1.0".into()], &|w| f1(w.batch)),
        line("÷ baseline", [f2(s.ratio_server_baseline), "1.00".into(), f2(s.ratio_floor_baseline)], &|w| {
            f2(w.ratio_baseline)
        }),
    ];
    let names: Vec<String> = s.floor_writers.iter().map(|w| format!("floor, {} writer(s)", w.writers)).collect();
    let mut header = vec!["median of rounds", "server", "baseline", "floor"];
    header.extend(names.iter().map(String::as_str));
    print_table(&header, &rows);
    println!("server / floor: {}", f2(s.ratio_server_floor));
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
    println!(
        "      floor = the baseline's clients, each message one statement writing the rows the design writes for it"
    );
    println!("      on the server's tables (message, outbox row, both members' heads, events and conversation rows);");
    println!(
        "      floor, n writers = the same statements on n connections, each owning conv mod n, in transactions of"
    );
    println!("      the server's requests per commit, pipelined.");
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

    /// The floor's statement still fits the server's tables and writes what
    /// a server would, in both shapes: contiguous `msg_seq` per
    /// conversation, heads that match the events, two events and one
    /// unread per message. Needs PostgreSQL (`TIDEMARK_TEST_PG_URL`).
    #[tokio::test]
    async fn the_floor_writes_a_servers_rows_on_the_servers_tables() {
        let url = match std::env::var("TIDEMARK_TEST_PG_URL") {
            Ok(url) if !url.is_empty() => url,
            Ok(_) => panic!("TIDEMARK_TEST_PG_URL is set but empty"),
            Err(_) => {
                println!(
                    "SKIPPED the_floor_writes_a_servers_rows_on_the_servers_tables: TIDEMARK_TEST_PG_URL is not set"
                );
                return;
            }
        };
        let schemas = Schemas::connect(&url).await.unwrap();
        let admin = schemas.admin();
        let url = &url;
        schemas
            .run("floortest", |schema| async move {
                let config = PgConfig { schema: Some(schema.clone()), ..PgConfig::new(url.clone()) };
                drop(PgStore::open(config).await?);
                let topo = Topology::new(6, 3);
                for (writers, tag) in [(None, "floor"), (Some((7, 2)), "floor2w")] {
                    let (run, _) = floor_phase(url, admin, &topo, &schema, (1, 60), writers).await?;
                    assert_eq!(run.rows, 60);
                    let one = |sql: String| async move {
                        let n: i64 = admin.query_one(&sql, &[]).await.unwrap().get(0);
                        n
                    };
                    let mine = format!("user_id LIKE '{tag}-%'");
                    assert_eq!(one(format!("SELECT COUNT(*) FROM {schema}.user_events WHERE {mine}")).await, 120);
                    assert_eq!(
                        one(format!(
                            "SELECT COALESCE(SUM(high_watermark), 0)::BIGINT FROM {schema}.user_heads WHERE {mine}"
                        ))
                        .await,
                        120
                    );
                    assert_eq!(
                        one(format!(
                            "SELECT COUNT(*) FROM {schema}.user_heads h WHERE {mine} AND h.high_watermark <>
                             (SELECT COUNT(*) FROM {schema}.user_events e WHERE e.user_id = h.user_id)"
                        ))
                        .await,
                        0
                    );
                    assert_eq!(
                        one(format!("SELECT COALESCE(SUM(unread), 0)::BIGINT FROM {schema}.user_convs WHERE {mine}"))
                            .await,
                        60
                    );
                    assert_eq!(
                        one(format!(
                            "SELECT COUNT(*) FROM (SELECT m.conv_id FROM {schema}.messages m
                             WHERE m.sender LIKE '{tag}-%' GROUP BY m.conv_id HAVING MAX(m.msg_seq) <> COUNT(*)) x"
                        ))
                        .await,
                        0
                    );
                }
                Ok(())
            })
            .await
            .unwrap();
    }

    #[test]
    fn wal_flushes_prefer_sync() {
        assert_eq!(Wal { sync: 3, write: 9, ..Wal::default() }.flushes(), (3, "wal_sync"));
        assert_eq!(Wal { sync: 0, write: 9, ..Wal::default() }.flushes(), (9, "wal_write"));
    }
}
