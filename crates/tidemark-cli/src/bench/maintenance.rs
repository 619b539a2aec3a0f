//! `bench maintenance` (issue 16): a send's latency while maintenance runs
//! (the retention pass, the unread rebuild and a reconciliation run with
//! repairs, one after another in a loop) on a store with a large
//! population, beside a quiet phase of the same run on the same store. The
//! quiet phase is the baseline; phases alternate over rounds and the
//! summary reports the medians of each phase's p99 and their ratio.
//!
//! The population (users, direct conversations with a few messages each,
//! their periods, logs, unread rows and devices) is written with bulk SQL
//! straight into the SQLite file before the store opens it, so it takes
//! seconds, not a send per row. Sends go through `Store::accept_send` from
//! closed-loop senders (the writer is the critical path of a send), with a
//! relay task fanning the outbox out as the server's does. The store is the
//! embedded SQLite one.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use hdrhistogram::Histogram;
use rusqlite::params;
use serde::Serialize;
use serde_json::json;
use tidemark_sqlite::SqliteStore;
use tidemark_store::{reconcile, RetentionPolicy, SendCmd, Store};

use super::{init_logs, print_table, unix_ms, TempDir, LATENCY_MAX_US};

#[derive(clap::Args, Debug, Clone)]
pub struct MaintenanceArgs {
    /// Users in the population (pairs of them share a direct conversation).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(2..=10_000_000))]
    pub users: u32,
    /// Messages per direct conversation (each in both users' logs).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub messages_per_conv: u32,
    /// Concurrent closed-loop senders during each phase.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub senders: u32,
    /// Seconds of each phase.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Rounds of (quiet, maintenance).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    #[arg(long, default_value = "bench-results/maintenance.json")]
    pub out: PathBuf,
    /// Where the temporary store goes (on the disk to measure: fsync cost).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The goal: a send's p99 during maintenance within this factor of its p99
/// in the quiet phase of the same run.
pub const P99_RATIO_GOAL: f64 = 2.0;

#[derive(Debug, Serialize)]
struct Phase {
    round: u32,
    maintenance: bool,
    seconds: f64,
    sends: u64,
    send_p50_ms: f64,
    send_p99_ms: f64,
    send_max_ms: f64,
    /// Maintenance passes completed in the phase (retention, rebuild,
    /// reconciliation; the last one may be cut by the phase's end).
    retention_passes: u64,
    unread_rebuilds: u64,
    reconcile_runs: u64,
    /// Longest complete pass of each kind in this phase: about how long
    /// the writer was held by the one-transaction versions of them.
    retention_pass_max_ms: f64,
    unread_rebuild_max_ms: f64,
    reconcile_run_max_ms: f64,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Old enough that retention may trim it.
const OLD_MS: i64 = 1_000_000;

/// Writes the population in one transaction before the store opens it.
fn populate(path: &std::path::Path, users: u32, per_conv: u32, now_ms: i64) -> Result<()> {
    let mut c = rusqlite::Connection::open(path)?;
    c.pragma_update(None, "journal_mode", "WAL")?;
    c.pragma_update(None, "synchronous", "OFF")?;
    let tx = c.transaction()?;
    {
        let mut user = tx.prepare("INSERT INTO users (user_id, password_hash, created_at) VALUES (?1, 'x', ?2)")?;
        let mut device = tx.prepare(
            "INSERT INTO devices (user_id, device_id, name, sync_generation, acked_sync_seq, state, row_version,
                                  created_at, updated_at)
             VALUES (?1, 'd1', 'bench', 1, ?2, 'ACTIVE', 1, ?3, ?3)",
        )?;
        let mut head = tx.prepare("INSERT INTO user_heads (user_id, high_watermark) VALUES (?1, ?2)")?;
        let mut conv = tx.prepare(
            "INSERT INTO conversations (conv_id, kind, direct_key, head, epoch, owner, created_at, active_members)
             VALUES (?1, 'direct', ?1, ?2, 1, NULL, ?3, 2)",
        )?;
        let mut period = tx.prepare(
            "INSERT INTO membership_periods (period_id, conv_id, user_id, join_seq, leave_seq) VALUES (?1, ?2, ?3, 1, NULL)",
        )?;
        let mut uc = tx.prepare(
            "INSERT INTO user_convs (user_id, conv_id, last_msg_seq, read_seq, unread) VALUES (?1, ?2, ?3, 0, ?4)",
        )?;
        let mut msg = tx.prepare(
            "INSERT INTO messages (message_id, conv_id, msg_seq, sender, sender_device, client_msg_id, kind, content,
                                   state, created_at)
             VALUES (?1, ?2, ?3, ?4, 'd1', ?1, 'text', '{\"text\":\"bench\"}', 'normal', ?5)",
        )?;
        let mut event = tx.prepare(
            "INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id,
                                      created_at)
             VALUES (?1, ?2, 'message', ?3, ?4, ?5, ?5, ?6, ?7)",
        )?;
        let per = i64::from(per_conv);
        for pair in 0..users / 2 {
            let (a, b) = (format!("u{:07}", 2 * pair), format!("u{:07}", 2 * pair + 1));
            let id = format!("c{pair:07}");
            conv.execute(params![id, per, now_ms])?;
            for (k, u) in [&a, &b].into_iter().enumerate() {
                user.execute(params![u, now_ms])?;
                device.execute(params![u, per, now_ms])?;
                head.execute(params![u, per])?;
                period.execute(params![i64::from(pair) * 2 + k as i64 + 1, id, u])?;
                // Each gets the other's messages as unread: half of them.
                uc.execute(params![u, id, per, per / 2 + if k == 0 { 0 } else { per % 2 }])?;
            }
            for seq in 1..=per {
                let sender = if seq % 2 == 1 { &a } else { &b };
                let mid = format!("{id}-{seq}");
                msg.execute(params![mid, id, seq, sender, OLD_MS])?;
                for (k, u) in [&a, &b].into_iter().enumerate() {
                    event.execute(params![u, seq, id, seq, mid, i64::from(pair) * 2 + k as i64 + 1, OLD_MS])?;
                }
            }
        }
    }
    tx.commit()?;
    Ok(())
}

pub async fn run(args: MaintenanceArgs) -> Result<()> {
    init_logs();
    let users = args.users & !1;
    let root = TempDir::create(&args.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let data = root.0.join("server");
    // The store creates the schema; the population goes in behind it.
    drop(SqliteStore::open(&data).context("create store")?);
    let t = Instant::now();
    let db = data.join(tidemark_sqlite::DB_FILE);
    let populate_at = unix_ms();
    tokio::task::spawn_blocking(move || populate(&db, users, args.messages_per_conv, populate_at)).await??;
    println!("population: {users} users, {} conversations, written in {:.1} s", users / 2, t.elapsed().as_secs_f64());
    let store = SqliteStore::open(&data).context("open store")?;
    let store: Arc<dyn Store> = store;
    let mut phases = Vec::new();
    for round in 0..args.rounds {
        for maintenance in [false, true] {
            phases.push(phase(&args, &store, users, round, maintenance).await?);
        }
    }
    let rows: Vec<Vec<String>> = phases
        .iter()
        .map(|p| {
            vec![
                p.round.to_string(),
                if p.maintenance { "maintenance" } else { "quiet" }.to_string(),
                p.sends.to_string(),
                format!("{:.2}", p.send_p50_ms),
                format!("{:.2}", p.send_p99_ms),
                format!("{:.2}", p.send_max_ms),
                format!("{}/{}/{}", p.retention_passes, p.unread_rebuilds, p.reconcile_runs),
                format!("{:.0}/{:.0}/{:.0}", p.retention_pass_max_ms, p.unread_rebuild_max_ms, p.reconcile_run_max_ms),
            ]
        })
        .collect();
    print_table(
        &["round", "phase", "sends", "p50 ms", "p99 ms", "max ms", "passes ret/unr/rec", "pass max ms ret/unr/rec"],
        &rows,
    );
    let p99 = |m: bool| median(phases.iter().filter(|p| p.maintenance == m).map(|p| p.send_p99_ms).collect());
    let (quiet, busy) = (p99(false), p99(true));
    let ratio = busy / quiet.max(0.001);
    println!(
        "send p99 (median of {} rounds): quiet {quiet:.2} ms, maintenance {busy:.2} ms: {ratio:.2}x (goal: within \
         {P99_RATIO_GOAL}x)",
        args.rounds
    );
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let report = json!({
        "users": users, "conversations": users / 2, "messages_per_conv": args.messages_per_conv,
        "senders": args.senders, "seconds": args.seconds, "rounds": args.rounds,
        "chunks": {
            "retention_users": tidemark_store::RETENTION_USERS_PER_CHUNK,
            "retention_events": tidemark_store::RETENTION_EVENTS_PER_CHUNK,
            "retention_convs": tidemark_store::RETENTION_CONVS_PER_CHUNK,
            "reconcile_messages": reconcile::MESSAGES_PER_CHUNK,
            "reconcile_users": reconcile::USERS_PER_CHUNK,
        },
        "phases": phases,
        "send_p99_quiet_ms": quiet, "send_p99_maintenance_ms": busy,
        "send_p99_ratio": ratio, "send_p99_ratio_goal": P99_RATIO_GOAL,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

async fn phase(
    args: &MaintenanceArgs,
    store: &Arc<dyn Store>,
    users: u32,
    round: u32,
    maintenance: bool,
) -> Result<Phase> {
    let stop = Arc::new(AtomicBool::new(false));
    // The relay: fans the senders' items out as the server's does.
    let relay = {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match store.fan_out_next(256, unix_ms()).await {
                    Ok(c) if c.items.is_empty() => tokio::time::sleep(Duration::from_millis(2)).await,
                    Ok(_) => {}
                    Err(e) => return Err(anyhow::Error::from(e)),
                }
            }
            Ok(())
        })
    };
    let maint = maintenance.then(|| {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            // Everything old is trimmable; devices stay valid.
            let policy = RetentionPolicy {
                keep_events_younger_than_ms: 0,
                device_inactive_after_ms: 24 * 3600 * 1000,
                history_keep_ms: None,
            };
            let mut counts = [0u64; 3];
            let mut max_ms = [0f64; 3];
            let cfg = reconcile::ReconcileConfig::default();
            'outer: while !stop.load(Ordering::Relaxed) {
                for (i, kind) in ["retention", "rebuild", "reconcile"].into_iter().enumerate() {
                    if stop.load(Ordering::Relaxed) {
                        break 'outer;
                    }
                    let t = Instant::now();
                    let pass = async {
                        match kind {
                            "retention" => store.trim_user_logs(policy, unix_ms()).await.map(|_| ()),
                            "rebuild" => {
                                reconcile::rebuild_unread(&*store, reconcile::USERS_PER_CHUNK).await.map(|_| ())
                            }
                            _ => reconcile::run(&*store, &cfg, unix_ms()).await.map(|_| ()),
                        }
                    };
                    // A pass cut by the phase's end is not counted.
                    let stopped = async {
                        while !stop.load(Ordering::Relaxed) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    };
                    tokio::select! {
                        r = pass => r?,
                        _ = stopped => break 'outer,
                    }
                    counts[i] += 1;
                    max_ms[i] = max_ms[i].max(t.elapsed().as_secs_f64() * 1000.0);
                }
            }
            Ok::<_, anyhow::Error>((counts, max_ms))
        })
    });
    let started = Instant::now();
    let until = started + Duration::from_secs(args.seconds);
    let mut senders = Vec::new();
    for s in 0..args.senders {
        let store = store.clone();
        // Sender s writes in conversation s (spread over the population).
        let pair = (s as u64 * 7919 % u64::from(users / 2)) as u32;
        let (sender, conv) = (format!("u{:07}", 2 * pair), format!("c{pair:07}"));
        senders.push(tokio::spawn(async move {
            let mut h = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
            let mut n = 0u64;
            while Instant::now() < until {
                let id = format!("b-{round}-{maintenance}-{s}-{n}");
                let cmd = SendCmd {
                    sender: sender.clone(),
                    sender_device: "d1".into(),
                    conv: conv.clone(),
                    client_msg_id: id.clone(),
                    kind: "text".into(),
                    content: "{\"text\":\"probe\"}".into(),
                    message_id: id,
                    quote_id: None,
                    mentions: Vec::new(),
                    mention_all: false,
                    connection_epoch: None,
                    now_ms: unix_ms(),
                };
                let t = Instant::now();
                store.accept_send(cmd).await?;
                h.record(t.elapsed().as_micros().max(1) as u64)?;
                n += 1;
            }
            Ok::<_, anyhow::Error>(h)
        }));
    }
    let mut all = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
    for s in senders {
        all.add(s.await??)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (counts, max_ms) = match maint {
        Some(m) => m.await??,
        None => ([0; 3], [0.0; 3]),
    };
    relay.await??;
    ensure!(!all.is_empty(), "nothing was sent");
    Ok(Phase {
        round,
        maintenance,
        seconds,
        sends: all.len(),
        send_p50_ms: ms(all.value_at_quantile(0.5)),
        send_p99_ms: ms(all.value_at_quantile(0.99)),
        send_max_ms: ms(all.max()),
        retention_passes: counts[0],
        unread_rebuilds: counts[1],
        reconcile_runs: counts[2],
        retention_pass_max_ms: max_ms[0],
        unread_rebuild_max_ms: max_ms[1],
        reconcile_run_max_ms: max_ms[2],
    })
}
