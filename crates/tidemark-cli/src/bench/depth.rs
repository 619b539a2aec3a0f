//! `bench depth`: how long a sync page takes when the user's log holds
//! 10^3 events versus 10^6. Both logs are built in the same run on the same
//! disk (rows written straight into a fresh store's file, which is what the
//! fan-out would have written), then a device whose cursor sits near the
//! head pulls a page through the real server and socket, many times. The
//! short log is the baseline; the ratio should stay near 1 because a page
//! is an index range read.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use rusqlite::params;
use serde::Serialize;
use tidemark_client::proto::SyncReq;
use tidemark_client::{Http, WsConn};
use tidemark_core::cursor::{DeviceCursor, DeviceState};
use tidemark_server::{Server, ServerConfig};

use super::stores::{Schemas, StoreAt};
use super::{median, print_table, TempDir};

#[derive(clap::Args, Debug, Clone)]
pub struct DepthArgs {
    /// Events in the short (baseline) log.
    #[arg(long, default_value_t = 1_000)]
    pub small: u64,
    /// Events in the deep log.
    #[arg(long, default_value_t = 1_000_000)]
    pub large: u64,
    /// Pages measured per log.
    #[arg(long, default_value_t = 300)]
    pub pages: u32,
    /// Events per page.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    #[arg(long, default_value = "bench-results/depth.json")]
    pub out: std::path::PathBuf,
    /// Where the temporary stores go (must be a real disk).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Run the server on the PostgreSQL store at this URL instead, each
    /// log in a fresh schema (dropped afterwards), its rows written by
    /// `INSERT … SELECT generate_series`.
    #[arg(long, value_name = "postgres://…")]
    pub database: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
struct DepthRun {
    events: u64,
    build_secs: f64,
    page_p50_ms: f64,
    page_p99_ms: f64,
    page_mean_ms: f64,
}

const ADMIN: &str = "bench-depth-admin";
const PASSWORD: &str = "bench-password";

/// Writes `events` messages and the matching user events for `bob` into a
/// fresh store's file, in transactions of 50,000 rows.
fn populate(dir: &Path, conv: &str, events: u64) -> Result<()> {
    let mut db = rusqlite::Connection::open(dir.join(tidemark_sqlite::DB_FILE))?;
    db.busy_timeout(std::time::Duration::from_secs(10))?;
    let mut written = 0u64;
    while written < events {
        let tx = db.transaction()?;
        {
            let mut msg = tx.prepare_cached(
                "INSERT INTO messages (message_id, conv_id, msg_seq, sender, sender_device, client_msg_id, kind, content, state, created_at)
                 VALUES (?1, ?2, ?3, 'alice', 'd', ?1, 'text', '{\"text\":\"a chat line of ordinary length\"}', 'normal', 0)",
            )?;
            let mut ev = tx.prepare_cached(
                "INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id, created_at)
                 VALUES ('bob', ?1, 'message', ?2, ?1, ?3, ?3, 1, 0)",
            )?;
            let end = (written + 50_000).min(events);
            for seq in written + 1..=end {
                let id = format!("m{seq:012}");
                msg.execute(params![id, conv, seq as i64])?;
                ev.execute(params![seq as i64, conv, id])?;
            }
            written = end;
        }
        tx.execute("UPDATE conversations SET head = ?2 WHERE conv_id = ?1", params![conv, written as i64])?;
        tx.execute(
            "INSERT INTO user_heads (user_id, high_watermark) VALUES ('bob', ?1)
             ON CONFLICT(user_id) DO UPDATE SET high_watermark = excluded.high_watermark",
            params![written as i64],
        )?;
        tx.commit()?;
    }
    Ok(())
}

/// Writes `events` messages and the matching user events for `bob` into
/// the PostgreSQL schema `schema`, each table in one statement.
async fn populate_pg(admin: &tokio_postgres::Client, schema: &str, conv: &str, events: u64) -> Result<()> {
    let n = events as i64;
    let id = "'m' || lpad(g::text, 12, '0')";
    admin
        .execute(
            &format!(
                "INSERT INTO {schema}.messages (message_id, conv_id, msg_seq, sender, sender_device, client_msg_id, kind,
                                               content, state, created_at)
                 SELECT {id}, $1, g, 'alice', 'd', {id}, 'text', '{{\"text\":\"a chat line of ordinary length\"}}',
                        'normal', 0
                 FROM generate_series(1, $2::bigint) AS g"
            ),
            &[&conv, &n],
        )
        .await
        .context("write the messages")?;
    admin
        .execute(
            &format!(
                "INSERT INTO {schema}.user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id,
                                                  period_id, created_at)
                 SELECT 'bob', g, 'message', $1, g, {id}, {id}, 1, 0 FROM generate_series(1, $2::bigint) AS g"
            ),
            &[&conv, &n],
        )
        .await
        .context("write the user events")?;
    admin.execute(&format!("UPDATE {schema}.conversations SET head = $2 WHERE conv_id = $1"), &[&conv, &n]).await?;
    admin
        .execute(
            &format!(
                "INSERT INTO {schema}.user_heads (user_id, high_watermark) VALUES ('bob', $1)
                 ON CONFLICT (user_id) DO UPDATE SET high_watermark = excluded.high_watermark"
            ),
            &[&n],
        )
        .await?;
    // Vacuumed, with fresh statistics, as a long-lived log is: the pages are
    // not measured beside autovacuum's first pass over the new rows, nor
    // setting their hint bits. VACUUM runs outside a transaction, one
    // table per statement.
    for table in ["messages", "user_events"] {
        admin.batch_execute(&format!("VACUUM (ANALYZE) {schema}.{table}")).await?;
    }
    Ok(())
}

/// One log of `events`: on a fresh embedded store, or on a fresh schema of
/// `schemas`' database.
async fn measure(parent: &Path, schemas: Option<&Schemas>, events: u64, args: &DepthArgs) -> Result<DepthRun> {
    match schemas {
        None => {
            let dir = TempDir::create(parent)?;
            measure_on(&StoreAt::Dir(dir.0.clone()), None, events, args).await
        }
        Some(s) => {
            s.run(&format!("e{events}"), |schema| async move {
                measure_on(&s.at(&schema), Some(s.admin()), events, args).await
            })
            .await
        }
    }
}

async fn measure_on(
    at: &StoreAt,
    admin: Option<&tokio_postgres::Client>,
    events: u64,
    args: &DepthArgs,
) -> Result<DepthRun> {
    let built = Instant::now();
    let store = at.open().await?;
    store
        .create_user("alice", &tidemark_server::accounts::hash_password(PASSWORD).map_err(anyhow::Error::msg)?, 0)
        .await?;
    store
        .create_user("bob", &tidemark_server::accounts::hash_password(PASSWORD).map_err(anyhow::Error::msg)?, 0)
        .await?;
    let (conv, _) = store.create_direct("alice", "bob", "c-depth", 0).await?;
    match (at, admin) {
        (StoreAt::Dir(dir), _) => {
            let (dir, conv) = (dir.clone(), conv.clone());
            tokio::task::spawn_blocking(move || populate(&dir, &conv, events)).await??;
        }
        (StoreAt::Postgres { schema, .. }, Some(admin)) => populate_pg(admin, schema, &conv, events).await?,
        (StoreAt::Postgres { .. }, None) => anyhow::bail!("no connection to write the PostgreSQL log with"),
    }
    let build_secs = built.elapsed().as_secs_f64();
    let config = ServerConfig {
        admin_token: Some(ADMIN.into()),
        retention: None,
        limits: tidemark_server::limits::LimitsConfig::off(),
        ..ServerConfig::default()
    };
    let server = Server::start("127.0.0.1:0", store.clone(), config).await?;
    let http = Http::new(&server.url());
    let login = http.login("bob", PASSWORD, "phone").await.context("login")?;
    // Put the device near the head, as a device that was online recently.
    let rec = store.device("bob", "phone").await?.context("device")?;
    let near_head = events.saturating_sub(args.limit as u64 / 2);
    let active = DeviceCursor { generation: 1, acked_sync_seq: near_head, state: DeviceState::Active };
    store.cas_device_cursor("bob", "phone", rec.cursor, active, 0).await?;
    let (ws, _events) = WsConn::connect(&format!("ws://{}/v1/ws", server.addr), &login.access_token).await?;
    let req = SyncReq {
        sync_generation: Some(1),
        local_applied_sync_seq: Some(near_head),
        limit: Some(args.limit),
        ..Default::default()
    };
    // Warm up the caches once, then measure.
    ws.sync(&req).await?;
    let mut ms = Vec::with_capacity(args.pages as usize);
    for _ in 0..args.pages {
        let t = Instant::now();
        let page = ws.sync(&req).await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(page.events.len() as u64 == events - near_head, "unexpected page size");
    }
    drop(ws);
    server.stop().await;
    at.close(store).await;
    let mean = ms.iter().sum::<f64>() / ms.len().max(1) as f64;
    let mut sorted = ms.clone();
    sorted.sort_by(f64::total_cmp);
    let p99 = sorted[((sorted.len() as f64 * 0.99) as usize).min(sorted.len() - 1)];
    Ok(DepthRun { events, build_secs, page_p50_ms: median(ms), page_p99_ms: p99, page_mean_ms: mean })
}

pub async fn run(args: DepthArgs) -> Result<()> {
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let schemas = match &args.database {
        Some(url) => Some(Schemas::connect(url).await?),
        None => None,
    };
    let backend = if schemas.is_some() { "postgres" } else { "sqlite" };
    eprintln!("building a log of {} events and one of {} events ({backend})…", args.small, args.large);
    let small = measure(&parent, schemas.as_ref(), args.small, &args).await?;
    let large = measure(&parent, schemas.as_ref(), args.large, &args).await?;
    let ratio = large.page_p50_ms / small.page_p50_ms.max(f64::MIN_POSITIVE);
    println!(
        "tidemark bench depth ({backend} store): {} pages of {} events near the head, same run, same disk\n",
        args.pages, args.limit
    );
    let row = |r: &DepthRun| {
        vec![
            format!("{}", r.events),
            format!("{:.1}", r.build_secs),
            format!("{:.3}", r.page_p50_ms),
            format!("{:.3}", r.page_p99_ms),
            format!("{:.3}", r.page_mean_ms),
        ]
    };
    print_table(&["events in log", "build s", "page p50 ms", "page p99 ms", "mean ms"], &[row(&small), row(&large)]);
    println!("\nratio deep/shallow page p50: {ratio:.2} (the shallow log is the baseline)");
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "depth",
        "store": backend,
        "note": "the shallow log is the baseline measured in the same run on the same disk",
        "pages": args.pages, "limit": args.limit,
        "shallow": small, "deep": large, "ratio_p50_deep_over_shallow": ratio,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
