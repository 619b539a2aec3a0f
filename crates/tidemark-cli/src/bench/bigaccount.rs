//! `bench bigaccount` (issue 19): how long a new device of a big account
//! takes to be ready. The big account's log holds 10^6 events across 1,000
//! direct conversations, never trimmed; the rows are written straight into
//! a fresh store's file (what the fan-out would have written), as `bench
//! depth` does. A new SDK device (its own local SQLite store) logs in
//! through the real server and socket and is timed until `Ready`: its first
//! page gets `RESET_REQUIRED` (the batch would be longer than
//! `--replay-max-events`) and it installs a snapshot. Beside it, in the same
//! run on the same disk: the same kind of device on a small account (the
//! baseline, a replay of its short log), and optionally the big account with
//! the bound lifted, which is what a new device did before (a replay of the
//! whole log from 0).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rusqlite::params;
use serde::Serialize;
use tidemark_client::{Client, ClientConfig, ConnState};
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

use super::device::{cheap_hash, PASSWORD};
use super::{median, print_table, TempDir};

#[derive(clap::Args, Debug, Clone)]
pub struct BigAccountArgs {
    /// Events in the big account's log.
    #[arg(long, default_value_t = 1_000_000)]
    pub events: u64,
    /// Conversations they are spread over.
    #[arg(long, default_value_t = 1_000)]
    pub convs: u64,
    /// Events of the small account (the baseline), over 10 conversations.
    #[arg(long, default_value_t = 1_000)]
    pub small: u64,
    /// New devices timed per account (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Also time one new device of the big account replaying the whole log
    /// (the bound lifted: the behaviour before issue 19).
    #[arg(long)]
    pub with_replay: bool,
    #[arg(long, default_value = "bench-results/bigaccount.json")]
    pub out: std::path::PathBuf,
    /// Where the temporary stores go (must be a real disk).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
struct Timed {
    account: String,
    events: u64,
    convs: u64,
    path: &'static str,
    ready_secs_median: f64,
    ready_secs: Vec<f64>,
}

const ADMIN: &str = "bench-bigaccount-admin";

/// `events` messages of `user`'s conversations `convs` (round robin, each
/// from its peer) and the matching user events, in transactions of 50,000
/// rows, with the conversations' heads, the user's projections and head.
fn populate(dir: &Path, user: &str, convs: &[String], events: u64) -> Result<()> {
    let mut db = rusqlite::Connection::open(dir.join(tidemark_sqlite::DB_FILE))?;
    db.busy_timeout(Duration::from_secs(10))?;
    let mut periods = Vec::with_capacity(convs.len());
    for conv in convs {
        let p: i64 = db.query_row(
            "SELECT period_id FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2",
            params![conv, user],
            |r| r.get(0),
        )?;
        periods.push(p);
    }
    let n = convs.len() as u64;
    let mut written = 0u64;
    while written < events {
        let tx = db.transaction()?;
        {
            let mut msg = tx.prepare_cached(
                "INSERT INTO messages (message_id, conv_id, msg_seq, sender, sender_device, client_msg_id, kind, content, state, created_at)
                 VALUES (?1, ?2, ?3, 'peer', 'd', ?1, 'text', '{\"text\":\"a chat line of ordinary length\"}', 'normal', 0)",
            )?;
            let mut ev = tx.prepare_cached(
                "INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id, created_at)
                 VALUES (?1, ?2, 'message', ?3, ?4, ?5, ?5, ?6, 0)",
            )?;
            let end = (written + 50_000).min(events);
            for seq in written + 1..=end {
                let i = ((seq - 1) % n) as usize;
                let msg_seq = (seq - 1) / n + 1;
                let id = format!("m-{user}-{seq:012}");
                msg.execute(params![id, convs[i], msg_seq as i64])?;
                ev.execute(params![user, seq as i64, convs[i], msg_seq as i64, id, periods[i]])?;
            }
            written = end;
        }
        tx.commit()?;
    }
    let tx = db.transaction()?;
    for (i, conv) in convs.iter().enumerate() {
        let head = events / n + u64::from((i as u64) < events % n);
        tx.execute("UPDATE conversations SET head = ?2 WHERE conv_id = ?1", params![conv, head as i64])?;
        tx.execute(
            "UPDATE user_convs SET last_msg_seq = ?3, unread = ?3 WHERE user_id = ?1 AND conv_id = ?2",
            params![user, conv, head as i64],
        )?;
    }
    tx.execute(
        "INSERT INTO user_heads (user_id, high_watermark) VALUES (?1, ?2)
         ON CONFLICT(user_id) DO UPDATE SET high_watermark = excluded.high_watermark",
        params![user, events as i64],
    )?;
    tx.commit()?;
    Ok(())
}

/// A user with `convs` direct conversations, each with its own peer.
async fn account(store: &SqliteStore, user: &str, convs: u64, hash: &str) -> Result<Vec<String>> {
    store.create_user(user, hash, 0).await?;
    let mut ids = Vec::with_capacity(convs as usize);
    for i in 0..convs {
        let peer = format!("{user}-peer{i:05}");
        store.create_user(&peer, hash, 0).await?;
        let (conv, _) = store.create_direct(user, &peer, &format!("c-{user}-{i:05}"), 0).await?;
        ids.push(conv);
    }
    Ok(ids)
}

/// A new SDK device of `user`, from login to `Ready`, in seconds.
async fn new_device(url: &str, dir: &Path, user: &str, device: &str, convs: u64) -> Result<f64> {
    let db = dir.join(format!("{user}-{device}.db"));
    let mut config = ClientConfig::new(url, user, device, &db).with_password(PASSWORD);
    config.sync_page_limit = tidemark_client::proto::SYNC_LIMIT_MAX;
    config.request_timeout = Duration::from_secs(120);
    let t = Instant::now();
    let client = Client::open(config)?;
    client.start().await?;
    client.wait_state(ConnState::Ready, Duration::from_secs(1800)).await.context("device never ready")?;
    let secs = t.elapsed().as_secs_f64();
    let held = client.conversations().await?.len() as u64;
    anyhow::ensure!(held == convs, "{user}/{device} holds {held} conversations, not {convs}");
    client.stop().await;
    Ok(secs)
}

async fn timed(
    store: &Arc<SqliteStore>,
    dir: &Path,
    (user, events, convs): (&str, u64, u64),
    replay_max_events: u64,
    rounds: u32,
    path: &'static str,
) -> Result<Timed> {
    let config = ServerConfig {
        admin_token: Some(ADMIN.into()),
        retention: None,
        replay_max_events,
        limits: tidemark_server::limits::LimitsConfig::off(),
        ..ServerConfig::default()
    };
    let server = Server::start("127.0.0.1:0", store.clone() as Arc<dyn Store>, config).await?;
    let mut secs = Vec::new();
    for r in 0..rounds {
        let s = new_device(&server.url(), dir, user, &format!("{path}-{r}"), convs).await?;
        eprintln!("  {user} ({events} events, {convs} convs) {path}: ready in {s:.2} s");
        secs.push(s);
    }
    server.stop().await;
    Ok(Timed { account: user.into(), events, convs, path, ready_secs_median: median(secs.clone()), ready_secs: secs })
}

pub async fn run(args: BigAccountArgs) -> Result<()> {
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = TempDir::create(&parent)?;
    let store = SqliteStore::open(&dir.0)?;
    let hash = cheap_hash()?;
    let built = Instant::now();
    let big = account(&store, "big", args.convs, &hash).await?;
    let small = account(&store, "small", 10, &hash).await?;
    {
        let path = dir.0.clone();
        let (events, small_events) = (args.events, args.small);
        tokio::task::spawn_blocking(move || {
            populate(&path, "big", &big, events)?;
            populate(&path, "small", &small, small_events)
        })
        .await??;
    }
    let build_secs = built.elapsed().as_secs_f64();
    eprintln!("built {} events over {} conversations in {build_secs:.1} s", args.events, args.convs);
    let bound = tidemark_core::cursor::REPLAY_EVENTS_MAX;
    let mut runs = vec![
        timed(&store, &dir.0, ("small", args.small, 10), bound, args.rounds, "replay").await?,
        timed(&store, &dir.0, ("big", args.events, args.convs), bound, args.rounds, "snapshot").await?,
    ];
    if args.with_replay {
        runs.push(timed(&store, &dir.0, ("big", args.events, args.convs), u64::MAX, 1, "replay (unbounded)").await?);
    }
    let baseline = runs[0].ready_secs_median;
    println!(
        "tidemark bench bigaccount: a new SDK device until ready, same run, same disk (replay bound {bound} events)\n"
    );
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.account.clone(),
                format!("{}", r.events),
                format!("{}", r.convs),
                r.path.to_string(),
                format!("{}", r.ready_secs.len()),
                format!("{:.2}", r.ready_secs_median),
                format!("{:.1}", r.ready_secs_median / baseline.max(f64::MIN_POSITIVE)),
            ]
        })
        .collect();
    print_table(&["account", "events", "convs", "path", "rounds", "ready s (median)", "× small"], &rows);
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "bigaccount",
        "note": "a new SDK device until Ready; the small account is the baseline measured in the same run on the same disk",
        "replay_max_events": bound, "build_secs": build_secs, "runs": runs,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
