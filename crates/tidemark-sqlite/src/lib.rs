//! The embedded SQLite backend of [`tidemark_store::Store`] (X1).
//!
//! Layout: one writer thread owns the read-write connection and
//! group-commits every write ([`writer`]); a small pool of read-only
//! connections, one thread each, serves reads concurrently (WAL lets
//! readers see the last committed state while the writer works), the reads
//! that queue together in one read transaction (`read::READ_BATCH_MAX`).
//! Because one writer serialises every write, `msg_seq` and `sync_seq`
//! assignment are naturally contiguous and committed in order.
//!
//! Durability: `journal_mode=WAL` with `synchronous=FULL`. Each commit
//! appends to the WAL and fsyncs it before COMMIT returns, so a reply that
//! followed a commit survives a process crash *and* a power loss. (With
//! `NORMAL`, a power loss could drop the last commits, which would break the
//! promise of `send.ok`.) Fsyncs per commit: one; a passive checkpoint every
//! [`writer::CHECKPOINT_EVERY_COMMITS`] commits (or once the WAL file passes
//! [`writer::WAL_TRUNCATE_BYTES`]) adds two.

mod events;
mod lifecycle;
mod push;
mod read;
mod receipts;
mod reconcile;
pub mod schema;
pub mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rusqlite::trace::{TraceEvent, TraceEventCodes};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tidemark_core::control;
use tidemark_core::cursor::{self, CasDecision, DeviceCursor, DeviceState};
use tidemark_core::large::{self, Route};
use tidemark_core::membership::{control_recipients, recipients_at, Period};
use tidemark_core::page::{PageQuery, SyncFacts};
use tidemark_core::{mention, projection};
use tidemark_core::{MsgSeq, SyncSeq};
use tidemark_proto::content::{self, Payload};
use tidemark_store::*;

use read::ReadPool;
use writer::Writer;

/// Read-only connections in the pool.
pub const READERS_MAX: usize = 4;
/// The database file name inside the data directory.
pub const DB_FILE: &str = "tidemark.db";
/// How long a connection waits on a lock before `SQLITE_BUSY`.
pub(crate) const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

pub(crate) fn internal(e: rusqlite::Error) -> StoreError {
    StoreError::Internal(format!("sqlite: {e}"))
}

pub struct SqliteStore {
    /// `GroupPolicy::large_members`, set by [`Store::set_group_policy`].
    large_members: AtomicU64,
    writer: Writer,
    readers: ReadPool,
    path: PathBuf,
    writer_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.path).finish()
    }
}

/// Statements run by this process's SQLite store connections (see
/// [`StoreStats::statements`]): counted by SQLite's own trace hook at the
/// start of every statement, so nothing in this crate can run one unseen.
static STATEMENTS_WRITE: AtomicU64 = AtomicU64::new(0);
static STATEMENTS_READ: AtomicU64 = AtomicU64::new(0);

/// `SQLITE_TRACE_STMT` also fires at the start of each trigger program,
/// with the trigger's name as a `-- ` comment: those are not statements.
fn is_statement(ev: &TraceEvent<'_>) -> bool {
    matches!(ev, TraceEvent::Stmt(_, sql) if !sql.starts_with("--"))
}

fn count_write(ev: TraceEvent<'_>) {
    if is_statement(&ev) {
        STATEMENTS_WRITE.fetch_add(1, Ordering::Relaxed);
    }
}

fn count_read(ev: TraceEvent<'_>) {
    if is_statement(&ev) {
        STATEMENTS_READ.fetch_add(1, Ordering::Relaxed);
    }
}

/// Prepared statements each connection keeps (`prepare_cached`). rusqlite's
/// default is 16, fewer than the distinct statements one send and its fused
/// fan-out run on the writer: the LRU evicted them in turn and the writer
/// spent about a fifth of its CPU re-parsing SQL (issue 19's ingest
/// profile, docs/benchmarks.md). The crate has about 110 `prepare_cached`
/// call sites, so with 256 none is evicted.
pub const STATEMENT_CACHE_CAPACITY: usize = 256;

fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE_CAPACITY);
    // `rarray(?)`: a page's message ids as one parameter (read::decorate).
    rusqlite::vtab::array::load_module(conn)?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "cache_size", -16_000)?;
    Ok(())
}

impl SqliteStore {
    fn group_policy(&self) -> GroupPolicy {
        GroupPolicy { large_members: self.large_members.load(Ordering::Relaxed) }
    }

    /// Opens (creating if needed) the store in `data_dir` and applies the
    /// schema migrations it lacks (`schema::migrate`); a database migrated
    /// by a newer build is refused with [`StoreError::SchemaTooNew`].
    /// Rows the writer's committed transactions inserted, updated or
    /// deleted since the store opened (`bench fanout --large` divides it by
    /// the messages sent). Not in `StoreStats`: a SQLite measure.
    pub fn rows_written(&self) -> u64 {
        self.writer.stats.rows.load(Ordering::Relaxed)
    }

    pub fn open(data_dir: &Path) -> StoreResult<Arc<SqliteStore>> {
        std::fs::create_dir_all(data_dir)
            .map_err(|e| StoreError::Unavailable(format!("create {}: {e}", data_dir.display())))?;
        let path = data_dir.join(DB_FILE);
        let conn = Connection::open(&path).map_err(internal)?;
        conn.trace_v2(TraceEventCodes::SQLITE_TRACE_STMT, Some(count_write));
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0)).map_err(internal)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Internal(format!("journal_mode is {mode}, want wal")));
        }
        configure(&conn).map_err(internal)?;
        // Checkpoints are run and counted by the writer itself.
        conn.pragma_update(None, "wal_autocheckpoint", 0).map_err(internal)?;
        // The writer's statement journals (a request's SAVEPOINT, the fused
        // fan-out's) stay in memory: by default one that passes 64 KiB
        // spills to a temporary file, and a fused fan-out touching more
        // pages than that opened, wrote and closed a file in every batch,
        // a fifth of the writer's CPU in issue 19's profile. A journal holds
        // the pages one savepoint touched (at most what one transaction
        // writes: ~13 MB for a big group's fan-out, `WAL_TRUNCATE_BYTES`),
        // released when it ends. Readers keep the default.
        conn.pragma_update(None, "temp_store", "MEMORY").map_err(internal)?;
        schema::migrate(&conn)?;
        // Start with an empty log: a WAL left by a crash was just recovered
        // (replayed into memory), so fold it into the database file now
        // rather than carry it, and its recovery cost, into the next crash.
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).map_err(internal)?;
        let mut readers = Vec::with_capacity(READERS_MAX);
        for _ in 0..READERS_MAX {
            let r =
                Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
                    .map_err(internal)?;
            r.trace_v2(TraceEventCodes::SQLITE_TRACE_STMT, Some(count_read));
            configure(&r).map_err(internal)?;
            readers.push(r);
        }
        let (writer, handle) = Writer::start(conn);
        Ok(Arc::new(SqliteStore {
            large_members: AtomicU64::new(GroupPolicy::default().large_members),
            writer,
            readers: ReadPool::new(readers),
            path,
            writer_thread: Mutex::new(Some(handle)),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        // The writer thread ends once its channel closes; the channel closes
        // when `self.writer` is dropped right after this function.
        let _ = self.writer_thread.lock().map(|mut h| h.take());
    }
}

pub(crate) fn cursor_from_row(generation: i64, acked: i64, state: &str) -> StoreResult<DeviceCursor> {
    let state = DeviceState::parse(state).ok_or_else(|| StoreError::Internal(format!("bad device state {state}")))?;
    Ok(DeviceCursor { generation: generation as u64, acked_sync_seq: acked as u64, state })
}

pub(crate) fn read_device(conn: &Connection, user: &str, device: &str) -> StoreResult<Option<DeviceRecord>> {
    conn.prepare_cached(
        "SELECT name, sync_generation, acked_sync_seq, state FROM devices WHERE user_id = ?1 AND device_id = ?2",
    )
    .map_err(internal)?
    .query_row(params![user, device], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?, r.get::<_, String>(3)?))
    })
    .optional()
    .map_err(internal)?
    .map(|(name, g, a, s)| {
        Ok(DeviceRecord { user: user.into(), device: device.into(), name, cursor: cursor_from_row(g, a, &s)? })
    })
    .transpose()
}

pub(crate) fn write_cursor(
    conn: &Connection,
    user: &str,
    device: &str,
    c: DeviceCursor,
    now_ms: i64,
) -> StoreResult<()> {
    let n = conn
        .prepare_cached(
            "UPDATE devices SET sync_generation = ?3, acked_sync_seq = ?4, state = ?5,
                    row_version = row_version + 1, updated_at = ?6
             WHERE user_id = ?1 AND device_id = ?2",
        )
        .map_err(internal)?
        .execute(params![user, device, c.generation as i64, c.acked_sync_seq as i64, c.state.as_str(), now_ms])
        .map_err(internal)?;
    if n != 1 {
        return Err(StoreError::NotFound(format!("device {device}")));
    }
    Ok(())
}

fn accept_send_tx(conn: &Connection, cmd: &SendCmd) -> StoreResult<Accepted> {
    // A frame of a superseded connection changes nothing, not even by
    // answering a retry as a duplicate (P2).
    events::connection_fence(conn, &cmd.sender, &cmd.sender_device, cmd.connection_epoch)?;
    if let Some((message_id, conv, msg_seq, created_at_ms)) =
        events::existing_event_of(conn, &cmd.sender, &cmd.client_msg_id, &cmd.conv, &[])?
    {
        return Ok(Accepted { message_id, conv, msg_seq, created_at_ms, duplicate: true });
    }
    control::check_send_kind(&cmd.kind)?;
    // The membership check runs here, at the conversation's linearisation
    // point, so a send racing a removal is ordered by the writer (G1).
    if !events::is_active_member(conn, &cmd.conv, &cmd.sender)? {
        return Err(events::not_found_or_not_member(conn, &cmd.conv)?);
    }
    if let Some(quoted) = &cmd.quote_id {
        let row: Option<(String, bool)> = conn
            .prepare_cached(
                "SELECT m.kind, EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id
                        AND p.user_id = ?3 AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR p.leave_seq >= m.msg_seq))
                 FROM messages m WHERE m.message_id = ?1 AND m.conv_id = ?2",
            )
            .map_err(internal)?
            .query_row(params![quoted, cmd.conv, cmd.sender], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()
            .map_err(internal)?;
        control::check_quote(quoted, row.as_ref().map(|(kind, sees)| (kind.as_str(), *sees)))?;
    }
    if cmd.mention_all {
        let facts = conn
            .prepare_cached(
                "SELECT c.kind, c.owner, (SELECT COUNT(*) FROM membership_periods p
                        WHERE p.conv_id = c.conv_id AND p.leave_seq IS NULL)
                 FROM conversations c WHERE c.conv_id = ?1",
            )
            .map_err(internal)?
            .query_row(params![cmd.conv], |r| {
                Ok(mention::MentionAllFacts {
                    kind: r.get(0)?,
                    owner: r.get(1)?,
                    active_members: r.get::<_, i64>(2)? as u64,
                })
            })
            .map_err(internal)?;
        mention::check_mention_all(true, &facts, &cmd.sender)?;
    }
    let msg_seq = events::append_conv_event(
        conn,
        &cmd.as_event(),
        &cmd.kind,
        &cmd.content,
        None,
        cmd.quote_id.as_deref(),
        STATE_NORMAL,
    )?;
    if cmd.mention_all || !cmd.mentions.is_empty() {
        let mentions = (!cmd.mentions.is_empty()).then(|| content::Mentions(&cmd.mentions).to_json());
        conn.prepare_cached("UPDATE messages SET mentions = ?2, mention_all = ?3 WHERE message_id = ?1")
            .map_err(internal)?
            .execute(params![cmd.message_id, mentions, cmd.mention_all])
            .map_err(internal)?;
    }
    Ok(cmd.accepted(msg_seq))
}

fn periods_covering(conn: &Connection, conv: &str, seq: u64) -> StoreResult<Vec<Period>> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT period_id, user_id, join_seq, leave_seq FROM membership_periods
             WHERE conv_id = ?1 AND join_seq <= ?2 AND (leave_seq IS NULL OR leave_seq >= ?2)",
        )
        .map_err(internal)?;
    let rows = stmt
        .query_map(params![conv, seq as i64], |r| {
            Ok(Period {
                period_id: r.get(0)?,
                user: r.get(1)?,
                join_seq: r.get::<_, i64>(2)? as u64,
                leave_seq: r.get::<_, Option<i64>>(3)?.map(|v| v as u64),
            })
        })
        .map_err(internal)?;
    rows.collect::<Result<Vec<_>, _>>().map_err(internal)
}

/// The recipients of one outbox item (F4, E1, G2): the periods covering
/// its `msg_seq` and, for a control event, those covering its target's, as
/// `control_recipients` combines them; in a shared group, as
/// `large::route` decides (nobody, or the subject of a membership change).
/// The route comes back beside them.
/// The recipients of one item and what its metrics need: the item's
/// `FannedOut` with its class and period miss (recipients not yet set).
fn resolve(
    conn: &Connection,
    item: &OutboxItem,
) -> StoreResult<(tidemark_core::membership::Recipients, Route, FannedOut, Mentions)> {
    let (kind, target_seq, mode, shared_from, conv_kind, mentions, mention_all): (
        String,
        Option<i64>,
        String,
        Option<i64>,
        String,
        Option<String>,
        bool,
    ) = conn
        .prepare_cached(
            "SELECT s.kind, t.msg_seq, c.mode, c.shared_from, c.kind, s.mentions, s.mention_all FROM messages s
             JOIN conversations c ON c.conv_id = s.conv_id
             LEFT JOIN messages t ON t.conv_id = s.conv_id AND t.message_id = s.target_id
             WHERE s.message_id = ?1",
        )
        .map_err(internal)?
        .query_row(params![item.source_event_id], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?))
        })
        .map_err(internal)?;
    let mentions = Mentions { named: parse_mentions(mentions.as_deref())?, all: mention_all };
    let route = large::route(&mode, shared_from.map(|v| v as u64), item.msg_seq, &kind);
    let mut seen = FannedOut {
        source_event_id: item.source_event_id.clone(),
        class: large::fanout_class(&conv_kind, route),
        ..Default::default()
    };
    let periods = match route {
        Route::Shared => return Ok((Default::default(), route, seen, mentions)),
        Route::PerMember => periods_covering(conn, &item.conv, item.msg_seq)?,
        // The period the change opened or closed at this msg_seq.
        Route::Subject => periods_covering(conn, &item.conv, item.msg_seq)?
            .into_iter()
            .filter(|p| p.join_seq == item.msg_seq || p.leave_seq == Some(item.msg_seq))
            .collect(),
    };
    seen.period_miss = large::period_miss(route, periods.len());
    let at_event = recipients_at(&periods, item.msg_seq);
    let holders = match target_seq.map(|t| t as u64) {
        Some(t) => Some(recipients_at(&periods_covering(conn, &item.conv, t)?, t)),
        None => None,
    };
    Ok((control_recipients(at_event, holders, &kind), route, seen, mentions))
}

/// What a fanned-out message mentions (issue 18), as stored with it.
#[derive(Debug, Default)]
struct Mentions {
    named: Vec<String>,
    all: bool,
}

/// The stored `messages.mentions` (a JSON array, or NULL).
pub(crate) fn parse_mentions(stored: Option<&str>) -> StoreResult<Vec<String>> {
    stored.map_or(Ok(Vec::new()), |s| content::parse_mentions(s).map_err(StoreError::Internal))
}

/// Claims up to `limit` pending outbox items, oldest first, and fans them
/// out while `admit` takes them ([`fan_out_tx`]): the relay's claim
/// ([`Store::fan_out_next`], which admits all) and the fused fan-out's
/// ([`fused_fan_out`]). The claim is the read, inside the single writer's
/// transaction.
fn claim_tx(
    conn: &Connection,
    limit: u32,
    now_ms: i64,
    admit: impl FnMut(u64, u64) -> bool,
) -> StoreResult<ClaimedFanout> {
    let mut items = read::pending_outbox(conn, limit)?;
    if items.is_empty() {
        return Ok(ClaimedFanout::default());
    }
    let report = fan_out_tx(conn, &items, now_ms, admit)?;
    items.truncate(report.items.len());
    Ok(ClaimedFanout { items, report })
}

/// The fused fan-out (issue 19, [`Store::fuse_fanout`]): the writer's
/// [`writer::Epilogue`] for batches that appended to the outbox. It claims
/// as the relay does, as far as `tidemark_core::fuse::admits` allows, in a
/// SAVEPOINT: if it fails it alone rolls back, the batch's requests commit
/// and its items stay in the outbox for the relay. After the commit the
/// claim goes to the relay, which hints it as one of its own.
fn fused_fan_out(
    conn: &Connection,
    limit: u32,
    to_relay: &tokio::sync::mpsc::UnboundedSender<ClaimedFanout>,
) -> Option<writer::AfterCommit> {
    if to_relay.is_closed() {
        // The relay stopped: whatever is pending waits for the next one.
        return None;
    }
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    match writer::in_savepoint(conn, |c| claim_tx(c, limit, now_ms, tidemark_core::fuse::admits)) {
        Ok(claimed) if claimed.items.is_empty() => None,
        Ok(claimed) => {
            let to_relay = to_relay.clone();
            Some(Box::new(move || {
                tidemark_store::metric_names::FANOUT_FUSED_ITEMS.add(claimed.items.len() as u64);
                // A relay gone since cannot hint these; what it would have
                // hinted is committed, and devices find it on their next sync.
                let _ = to_relay.send(claimed);
            }))
        }
        Err(e) => {
            tidemark_store::metric_names::FANOUT_FUSED_FAILURES.inc();
            tracing::warn!(error = %e, "fused fan-out failed and rolled back alone; the relay will fan out");
            None
        }
    }
}

/// A user's head inside one [`fan_out_tx`]: as stored, and as advanced.
struct Head {
    stored: u64,
    next: u64,
}

/// Fans `items` out in order (F3, F4), stopping before the first item that
/// `admit(recipients of the items admitted so far, its recipients)` refuses;
/// the report covers the items fanned out.
fn fan_out_tx(
    conn: &Connection,
    items: &[OutboxItem],
    now_ms: i64,
    mut admit: impl FnMut(u64, u64) -> bool,
) -> StoreResult<FanoutReport> {
    let mut report = FanoutReport::default();
    // Shared groups this batch moved, with their highest msg_seq: one
    // marker publication each, whatever the number of items (G2).
    let mut moved: std::collections::BTreeMap<String, u64> = Default::default();
    let mut admitted = 0u64;
    // The heads of the users this batch delivers to: read once, advanced
    // here, written once at the end (a user the batch's items reach k
    // times costs two head statements, not k); those that advanced are the
    // report's users. Nothing else in this transaction reads or writes a
    // head meanwhile.
    let mut heads: std::collections::BTreeMap<String, Head> = Default::default();
    for item in items {
        let (recipients, route, mut fanned, mentions) = resolve(conn, item)?;
        fanned.recipients = recipients.deliver.len() as u64;
        if !admit(admitted, fanned.recipients) {
            break;
        }
        admitted += fanned.recipients;
        if route != Route::PerMember {
            let seq = moved.entry(item.conv.clone()).or_default();
            *seq = (*seq).max(item.msg_seq);
        }
        for user in &recipients.quarantined {
            conn.prepare_cached(
                "INSERT OR IGNORE INTO fanout_quarantine (source_event_id, user_id, conv_id, msg_seq, reason, created_at)
                 VALUES (?1, ?2, ?3, ?4, 'overlapping_membership_periods', ?5)",
            )
            .map_err(internal)?
            .execute(params![item.source_event_id, user, item.conv, item.msg_seq as i64, now_ms])
            .map_err(internal)?;
            report.quarantined += 1;
            tracing::error!(source_event_id = %item.source_event_id, conv = %item.conv, msg_seq = item.msg_seq,
                "fan-out hit two membership periods of one user; quarantined");
        }
        for (user, period_id) in &recipients.deliver {
            let head = match heads.get_mut(user) {
                Some(head) => head,
                None => {
                    let stored = lifecycle::high_watermark(conn, user)?;
                    heads.entry(user.clone()).or_insert(Head { stored, next: stored })
                }
            };
            let sync_seq = head.next + 1;
            // The key (user, source event, period) makes the fan-out
            // idempotent (F3): an event the log already holds (a fan-out
            // re-enqueued by reconciliation) writes nothing and takes no
            // sync_seq. Any other conflict (a sync_seq taken twice) is a
            // broken invariant and fails the transaction.
            let written = conn
                .prepare_cached(
                    "INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7, ?8)
                     ON CONFLICT (user_id, source_event_id, period_id) DO NOTHING",
                )
                .map_err(internal)?
                .execute(params![user, sync_seq as i64, item.kind, item.conv, item.msg_seq as i64, item.source_event_id, period_id, now_ms])
                .map_err(internal)?;
            if written == 0 {
                report.duplicates_skipped += 1;
                continue;
            }
            head.next = sync_seq;
            // Projections commit with the event: once per (user, event), as
            // `projection::delivery` decides; a message the user already
            // deleted for themselves never counts, nor one at or below
            // `last_msg_seq` (old values on the right of SET): the row
            // counted it when it moved past it, so a late delivery (a
            // fan-out re-enqueued by reconciliation) counts no second time.
            // A mention moves with unread, under the same conditions, when
            // `mention::counts` says it counts for this recipient (issue 18).
            let d = projection::delivery(&item.kind, user, &item.actor);
            let mentioned = d.counts_unread && mention::counts(user, &item.actor, &mentions.named, mentions.all);
            conn.prepare_cached(
                "INSERT INTO user_convs (user_id, conv_id, last_msg_seq, read_seq, unread, mentions)
                 VALUES (?1, ?2, ?3, CASE WHEN ?4 THEN ?3 ELSE 0 END, CASE WHEN ?5 THEN 1 ELSE 0 END,
                         CASE WHEN ?7 THEN 1 ELSE 0 END)
                 ON CONFLICT(user_id, conv_id) DO UPDATE SET
                    last_msg_seq = MAX(last_msg_seq, ?3),
                    read_seq = CASE WHEN ?4 THEN MAX(read_seq, ?3) ELSE read_seq END,
                    unread = unread + CASE WHEN ?5 AND ?3 > read_seq AND ?3 > last_msg_seq
                        AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = ?1 AND d.message_id = ?6)
                        THEN 1 ELSE 0 END,
                    mentions = mentions + CASE WHEN ?7 AND ?3 > read_seq AND ?3 > last_msg_seq
                        AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = ?1 AND d.message_id = ?6)
                        THEN 1 ELSE 0 END",
            )
            .map_err(internal)?
            .execute(params![
                user,
                item.conv,
                item.msg_seq as i64,
                d.own,
                d.counts_unread,
                item.source_event_id,
                mentioned
            ])
            .map_err(internal)?;
            if d.recount {
                events::recount_unread(conn, user, &item.conv)?;
            }
            report.events_written += 1;
            fanned.deliveries.push((user.clone(), sync_seq));
        }
        report.items.push(fanned);
        conn.prepare_cached("DELETE FROM outbox WHERE outbox_id = ?1")
            .map_err(internal)?
            .execute(params![item.outbox_id])
            .map_err(internal)?;
        report.items_done += 1;
    }
    let advanced: Vec<(String, SyncSeq)> =
        heads.into_iter().filter(|(_, h)| h.next != h.stored).map(|(user, h)| (user, h.next)).collect();
    for (user, next) in &advanced {
        conn.prepare_cached(
            "INSERT INTO user_heads (user_id, high_watermark) VALUES (?1, ?2)
             ON CONFLICT(user_id) DO UPDATE SET high_watermark = excluded.high_watermark",
        )
        .map_err(internal)?
        .execute(params![user, *next as i64])
        .map_err(internal)?;
    }
    for (conv, max_seq) in moved {
        let (was_target, was_version): (i64, i64) = conn
            .prepare_cached("SELECT target, version FROM conv_markers WHERE conv_id = ?1")
            .map_err(internal)?
            .query_row(params![conv], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()
            .map_err(internal)?
            .unwrap_or((0, 0));
        let (target, version) = large::publish(was_target as u64, was_version as u64, max_seq);
        conn.prepare_cached(
            "INSERT INTO conv_markers (conv_id, target, version) VALUES (?1, ?2, ?3)
             ON CONFLICT(conv_id) DO UPDATE SET target = excluded.target, version = excluded.version",
        )
        .map_err(internal)?
        .execute(params![conv, target as i64, version as i64])
        .map_err(internal)?;
        let members_seq: i64 = conn
            .prepare_cached("SELECT members_seq FROM conversations WHERE conv_id = ?1")
            .map_err(internal)?
            .query_row(params![conv], |r| r.get(0))
            .map_err(internal)?;
        report.convs.push(ConvMoved { conv, target, version, members_seq: members_seq as u64 });
    }
    report.users = advanced;
    Ok(report)
}

#[async_trait]
impl Store for SqliteStore {
    async fn server_secret(&self) -> StoreResult<Vec<u8>> {
        if let Some(secret) = self
            .readers
            .read(|c| c.query_row("SELECT value FROM meta WHERE key = 'token_secret'", [], |r| r.get(0)).optional())
            .await?
        {
            return Ok(secret);
        }
        let fresh: [u8; 32] = rand_secret();
        self.writer
            .write(move |c| {
                c.execute(
                    "INSERT INTO meta (key, value) VALUES ('token_secret', ?1) ON CONFLICT(key) DO NOTHING",
                    params![fresh.to_vec()],
                )
                .map_err(internal)?;
                c.query_row("SELECT value FROM meta WHERE key = 'token_secret'", [], |r| r.get(0)).map_err(internal)
            })
            .await
    }

    async fn create_user(&self, user: &str, password_hash: &str, now_ms: i64) -> StoreResult<bool> {
        let (user, hash) = (user.to_owned(), password_hash.to_owned());
        self.writer
            .write(move |c| {
                let n = c
                    .execute(
                        "INSERT INTO users (user_id, password_hash, created_at) VALUES (?1, ?2, ?3)
                         ON CONFLICT(user_id) DO NOTHING",
                        params![user, hash, now_ms],
                    )
                    .map_err(internal)?;
                Ok(n == 1)
            })
            .await
    }

    async fn password_hash(&self, user: &str) -> StoreResult<Option<String>> {
        let user = user.to_owned();
        self.readers
            .read(move |c| {
                c.query_row(
                    "SELECT password_hash FROM users WHERE user_id = ?1 AND deactivated_at IS NULL",
                    params![user],
                    |r| r.get(0),
                )
                .optional()
            })
            .await
    }

    async fn login_device(&self, user: &str, device: &str, name: &str, now_ms: i64) -> StoreResult<DeviceRecord> {
        let (user, device, name) = (user.to_owned(), device.to_owned(), name.to_owned());
        self.writer
            .write(move |c| {
                c.execute(
                    "INSERT INTO devices (user_id, device_id, name, sync_generation, acked_sync_seq, state, row_version, created_at, updated_at)
                     VALUES (?1, ?2, ?3, 1, 0, 'NEW', 1, ?4, ?4)
                     ON CONFLICT(user_id, device_id) DO UPDATE SET name = excluded.name, updated_at = excluded.updated_at",
                    params![user, device, name, now_ms],
                )
                .map_err(internal)?;
                read_device(c, &user, &device)?.ok_or_else(|| StoreError::Internal("device vanished".into()))
            })
            .await
    }

    async fn device(&self, user: &str, device: &str) -> StoreResult<Option<DeviceRecord>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers.read_store(move |c| read_device(c, &user, &device)).await
    }

    async fn revoke_device(&self, user: &str, device: &str, now_ms: i64) -> StoreResult<bool> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.writer
            .write(move |c| {
                let Some(rec) = read_device(c, &user, &device)? else {
                    return Err(StoreError::NotFound(format!("device {device}")));
                };
                c.execute("DELETE FROM refresh_tokens WHERE user_id = ?1 AND device_id = ?2", params![user, device])
                    .map_err(internal)?;
                c.execute("DELETE FROM push_targets WHERE user_id = ?1 AND device_id = ?2", params![user, device])
                    .map_err(internal)?;
                let Some(revoked) = cursor::revoked(rec.cursor) else { return Ok(false) };
                write_cursor(c, &user, &device, revoked, now_ms)?;
                bump_fences_version(c)?;
                Ok(true)
            })
            .await
    }

    async fn revoked_devices(&self) -> StoreResult<Vec<(String, String)>> {
        self.readers
            .read(|c| {
                let mut stmt = c.prepare("SELECT user_id, device_id FROM devices WHERE state = 'REVOKED'")?;
                let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
                rows.collect()
            })
            .await
    }

    async fn put_refresh_token(&self, token_hash: &str, rec: &RefreshRecord, now_ms: i64) -> StoreResult<()> {
        let (hash, rec) = (token_hash.to_owned(), rec.clone());
        self.writer
            .write(move |c| {
                c.execute(
                    "DELETE FROM refresh_tokens WHERE user_id = ?1 AND device_id = ?2 AND expires_at <= ?3",
                    params![rec.user, rec.device, now_ms],
                )
                .map_err(internal)?;
                c.execute(
                    "INSERT INTO refresh_tokens (token_hash, user_id, device_id, expires_at, family) \
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![hash, rec.user, rec.device, rec.expires_at_ms, rec.family],
                )
                .map_err(internal)?;
                Ok(())
            })
            .await
    }

    async fn create_direct(&self, a: &str, b: &str, conv_id: &str, now_ms: i64) -> StoreResult<(String, bool)> {
        tidemark_core::membership::check_direct(a, b)?;
        let (a, b, conv_id) = (a.to_owned(), b.to_owned(), conv_id.to_owned());
        let key = tidemark_core::ids::direct_key(&a, &b);
        self.writer
            .write(move |c| {
                if let Some(existing) = c
                    .query_row("SELECT conv_id FROM conversations WHERE direct_key = ?1", params![key], |r| r.get(0))
                    .optional()
                    .map_err(internal)?
                {
                    return Ok((existing, false));
                }
                let pair = [a.clone(), b.clone()];
                tidemark_core::membership::all_known(&pair, &events::known_users(c, &pair)?)?;
                c.execute(
                    "INSERT INTO conversations (conv_id, kind, direct_key, head, epoch, owner, created_at, active_members)
                     VALUES (?1, ?2, ?3, 0, 1, NULL, ?4, 2)",
                    params![conv_id, CONV_DIRECT, key, now_ms],
                )
                .map_err(internal)?;
                for u in [&a, &b] {
                    // Both members see the conversation from its first message.
                    c.execute(
                        "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES (?1, ?2, 1, NULL)",
                        params![conv_id, u],
                    )
                    .map_err(internal)?;
                    c.execute(
                        "INSERT INTO user_convs (user_id, conv_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                        params![u, conv_id],
                    )
                    .map_err(internal)?;
                }
                Ok((conv_id, true))
            })
            .await
    }

    async fn conversation(&self, conv: &str) -> StoreResult<Option<Conversation>> {
        let conv = conv.to_owned();
        self.readers.read_store(move |c| read::conversation(c, &conv)).await
    }

    async fn list_conversations(&self, user: &str, device: Option<&str>) -> StoreResult<Vec<ConvState>> {
        let (user, device) = (user.to_owned(), device.map(str::to_owned));
        self.readers.read_store(move |c| read::list_conversations(c, &user, device.as_deref())).await
    }

    async fn conversations_after(
        &self,
        user: &str,
        device: Option<&str>,
        after: &str,
        limit: u32,
    ) -> StoreResult<Vec<ConvState>> {
        let (user, device, after) = (user.to_owned(), device.map(str::to_owned), after.to_owned());
        self.readers.read_store(move |c| read::conversations_after(c, &user, device.as_deref(), &after, limit)).await
    }

    async fn create_group(&self, cmd: ConvEventCmd, members: Vec<String>) -> StoreResult<(String, u64)> {
        let policy = self.group_policy();
        self.writer.write_announcing(move |c| events::create_group(c, &cmd, &members, policy)).await
    }

    async fn change_membership(&self, cmd: ConvEventCmd, target: &str, change: MembershipChange) -> StoreResult<u64> {
        let (target, policy) = (target.to_owned(), self.group_policy());
        self.writer.write_announcing(move |c| events::change_membership(c, &cmd, &target, change, policy)).await
    }

    async fn bump_epoch(&self, conv: &str) -> StoreResult<u64> {
        let conv = conv.to_owned();
        self.writer
            .write(move |c| {
                c.query_row(
                    "UPDATE conversations SET epoch = epoch + 1 WHERE conv_id = ?1 RETURNING epoch",
                    params![conv],
                    |r| r.get::<_, i64>(0),
                )
                .optional()
                .map_err(internal)?
                .map(|e| e as u64)
                .ok_or_else(|| StoreError::NotFound(format!("conversation {conv}")))
            })
            .await
    }

    async fn recall(&self, cmd: ConvEventCmd, message_id: &str) -> StoreResult<ControlOutcome> {
        let id = message_id.to_owned();
        self.writer.write_announcing(move |c| events::recall(c, &cmd, &id)).await
    }

    async fn edit(
        &self,
        cmd: ConvEventCmd,
        message_id: &str,
        content: &str,
        base_version: u64,
    ) -> StoreResult<ControlOutcome> {
        let (id, content) = (message_id.to_owned(), content.to_owned());
        self.writer.write_announcing(move |c| events::edit(c, &cmd, &id, &content, base_version)).await
    }

    async fn react(
        &self,
        cmd: ConvEventCmd,
        message_id: &str,
        reaction: &str,
        add: bool,
    ) -> StoreResult<ControlOutcome> {
        let (id, reaction) = (message_id.to_owned(), reaction.to_owned());
        self.writer.write_announcing(move |c| events::react(c, &cmd, &id, &reaction, add)).await
    }

    async fn mark_read_on(
        &self,
        user: &str,
        conv: &str,
        read_to_seq: u64,
        on: Option<(&str, u64)>,
        now_ms: i64,
    ) -> StoreResult<ReadOutcome> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        let on = on.map(|(d, e)| (d.to_owned(), e));
        self.writer
            .write(move |c| {
                events::mark_read(c, &user, &conv, read_to_seq, on.as_ref().map(|(d, e)| (d.as_str(), *e)), now_ms)
            })
            .await
    }

    async fn update_settings(
        &self,
        user: &str,
        conv: &str,
        update: SettingsUpdate,
        now_ms: i64,
    ) -> StoreResult<(ConvState, UserEventOutcome)> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        let written = self
            .writer
            .write({
                let (user, conv) = (user.clone(), conv.clone());
                move |c| events::update_settings(c, &user, &conv, update, now_ms)
            })
            .await?;
        let state = self
            .list_conversations(&user, None)
            .await?
            .into_iter()
            .find(|s| s.conv == conv)
            .ok_or(StoreError::NotMember)?;
        Ok((state, UserEventOutcome { written }))
    }

    async fn delete_for_me(
        &self,
        user: &str,
        conv: &str,
        message_id: &str,
        now_ms: i64,
    ) -> StoreResult<UserEventOutcome> {
        let (user, conv, id) = (user.to_owned(), conv.to_owned(), message_id.to_owned());
        let written = self.writer.write(move |c| events::delete_for_me(c, &user, &conv, &id, now_ms)).await?;
        Ok(UserEventOutcome { written })
    }

    async fn record_delivery(
        &self,
        user: &str,
        device: &str,
        message_ids: Vec<String>,
        now_ms: i64,
    ) -> StoreResult<u64> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.writer.write(move |c| events::record_delivery(c, &user, &device, &message_ids, now_ms)).await
    }

    async fn reconcile_messages(&self, after: MessageCursor, limit: u32) -> StoreResult<MessageChunk> {
        self.readers.read_store(move |c| reconcile::messages(c, after, limit)).await
    }

    async fn reconcile_users(&self, after: Option<String>, limit: u32) -> StoreResult<UserChunk> {
        self.readers.read_store(move |c| reconcile::users(c, after, limit)).await
    }

    async fn requeue_fanout(&self, conv: &str, message_id: &str, now_ms: i64) -> StoreResult<bool> {
        let (conv, id) = (conv.to_owned(), message_id.to_owned());
        self.writer.write(move |c| reconcile::requeue_fanout(c, &conv, &id, now_ms)).await
    }

    async fn recount_unread(&self, user: &str, conv: &str) -> StoreResult<Option<Recounted>> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.writer.write(move |c| reconcile::recount_unread(c, &user, &conv)).await
    }

    async fn quarantine(&self, after: Option<(String, String)>, limit: u32) -> StoreResult<Vec<QuarantineRecord>> {
        self.readers.read_store(move |c| reconcile::quarantine(c, after, limit)).await
    }

    async fn conv_sync(
        &self,
        user: &str,
        conv: &str,
        after: u64,
        limit: u32,
        epoch: Option<u64>,
    ) -> StoreResult<ConvSyncPage> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers.read_store(move |c| read::conv_sync(c, &user, &conv, after, limit, epoch)).await
    }

    async fn history(&self, user: &str, conv: &str, before_seq: Option<u64>, limit: u32) -> StoreResult<HistoryPage> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers.read_store(move |c| read::history(c, &user, &conv, before_seq, limit)).await
    }

    async fn user_log(&self, user: &str) -> StoreResult<tidemark_core::cursor::UserLog> {
        let user = user.to_owned();
        self.readers.read_store(move |c| lifecycle::user_log(c, &user)).await
    }

    async fn read_snapshot_view(
        &self,
        user: &str,
        device: &str,
        messages_per_conv: u32,
        convs_per_chunk: usize,
        out: tokio::sync::mpsc::Sender<SnapshotViewPart>,
    ) -> StoreResult<()> {
        let (user, device) = (user.to_owned(), device.to_owned());
        // It waits on its consumer: batched, it would hold up its batch.
        self.readers
            .read_alone(move |c| {
                lifecycle::read_snapshot_view(c, &user, &device, messages_per_conv, convs_per_chunk, &out)
            })
            .await
    }

    async fn open_snapshot(
        &self,
        user: &str,
        device: &str,
        generation: u64,
        snapshot_id: &str,
        base: SyncSeq,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> StoreResult<()> {
        let (user, device, id) = (user.to_owned(), device.to_owned(), snapshot_id.to_owned());
        self.writer
            .write(move |c| lifecycle::open_snapshot(c, &user, &device, generation, &id, base, expires_at_ms, now_ms))
            .await
    }

    async fn add_snapshot_page(&self, snapshot_id: &str, page: u32, items: Vec<String>) -> StoreResult<()> {
        let id = snapshot_id.to_owned();
        self.writer.write(move |c| lifecycle::add_snapshot_page(c, &id, page, &items)).await
    }

    async fn seal_snapshot(&self, snapshot_id: &str, manifest_digest: &str, pages: u32) -> StoreResult<()> {
        let (id, digest) = (snapshot_id.to_owned(), manifest_digest.to_owned());
        self.writer.write(move |c| lifecycle::seal_snapshot(c, &id, &digest, pages)).await
    }

    async fn snapshot(&self, snapshot_id: &str) -> StoreResult<Option<SnapshotMeta>> {
        let id = snapshot_id.to_owned();
        self.readers.read_store(move |c| lifecycle::snapshot(c, &id)).await
    }

    async fn snapshot_page(&self, snapshot_id: &str, page: u32) -> StoreResult<Option<Vec<String>>> {
        let id = snapshot_id.to_owned();
        self.readers.read_store(move |c| lifecycle::snapshot_page(c, &id, page)).await
    }

    async fn ack_snapshot(
        &self,
        user: &str,
        device: &str,
        snapshot_id: &str,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)> {
        let (user, device, id) = (user.to_owned(), device.to_owned(), snapshot_id.to_owned());
        self.writer.write(move |c| lifecycle::ack_snapshot(c, &user, &device, &id, now_ms)).await
    }

    async fn trim_step(
        &self,
        policy: RetentionPolicy,
        now_ms: i64,
        step: TrimStep,
    ) -> StoreResult<(TrimReport, Option<String>)> {
        self.writer.write(move |c| lifecycle::trim_step(c, policy, now_ms, step)).await
    }

    async fn accept_send(&self, cmd: SendCmd) -> StoreResult<Accepted> {
        // Unguarded: every check of a send comes before its first change.
        self.writer.write_announcing_unguarded(move |c| accept_send_tx(c, &cmd)).await
    }

    async fn pending_outbox(&self, limit: u32) -> StoreResult<Vec<OutboxItem>> {
        self.readers.read_store(move |c| read::pending_outbox(c, limit)).await
    }

    async fn outbox_stats(&self) -> StoreResult<OutboxStats> {
        self.readers
            .read(|c| {
                c.query_row("SELECT COUNT(*), MIN(created_at) FROM outbox", [], |r| {
                    Ok(OutboxStats { backlog: r.get::<_, i64>(0)? as u64, oldest_created_at_ms: r.get(1)? })
                })
            })
            .await
    }

    async fn gauges(&self, now_ms: i64) -> StoreResult<StoreGauges> {
        self.readers
            .read(move |c| {
                c.query_row(
                    "SELECT
     (SELECT COUNT(*) FROM outbox),
     (SELECT MIN(created_at) FROM outbox),
     (SELECT COALESCE(MAX(high_watermark), 0) FROM user_heads),
     (SELECT COALESCE(MAX(high_watermark - trimmed_upto), 0) FROM user_heads),
     (SELECT COALESCE(MAX(h.high_watermark - d.acked_sync_seq), 0) FROM devices d
        JOIN user_heads h ON h.user_id = d.user_id WHERE d.state <> 'REVOKED'),
     (SELECT COUNT(*) FROM devices d JOIN user_heads h ON h.user_id = d.user_id
        WHERE d.state <> 'REVOKED' AND d.acked_sync_seq < h.trimmed_upto),
     (SELECT COUNT(*) FROM recovery_sessions WHERE state = 'ACTIVE' AND expires_at > ?1),
     (SELECT MIN(created_at) FROM recovery_sessions WHERE state = 'ACTIVE' AND expires_at > ?1),
     (SELECT COUNT(*) FROM snapshots WHERE state IN ('BUILDING', 'READY') AND expires_at > ?1),
     (SELECT MIN(created_at) FROM snapshots WHERE state IN ('BUILDING', 'READY') AND expires_at > ?1),
     (SELECT COUNT(*) FROM push_targets t
        JOIN devices d ON d.user_id = t.user_id AND d.device_id = t.device_id
        JOIN user_heads h ON h.user_id = t.user_id
        WHERE d.state <> 'REVOKED' AND h.high_watermark > MAX(t.pushed_through, d.acked_sync_seq))",
                    params![now_ms],
                    |r| {
                        let n = |i: usize| r.get::<_, i64>(i).map(|v| v.max(0) as u64);
                        Ok(StoreGauges {
                            outbox: OutboxStats { backlog: n(0)?, oldest_created_at_ms: r.get(1)? },
                            user_high_watermark_max: n(2)?,
                            retained_events_max: n(3)?,
                            cursor_lag_events_max: n(4)?,
                            devices_below_trim: n(5)?,
                            recovery_sessions: n(6)?,
                            recovery_oldest_created_at_ms: r.get(7)?,
                            snapshot_sessions: n(8)?,
                            snapshot_oldest_created_at_ms: r.get(9)?,
                            push_targets_owing: n(10)?,
                        })
                    },
                )
            })
            .await
    }

    async fn fan_out(&self, items: Vec<OutboxItem>, now_ms: i64) -> StoreResult<FanoutReport> {
        self.writer.write(move |c| fan_out_tx(c, &items, now_ms, |_, _| true)).await
    }

    async fn fan_out_next(&self, limit: u32, now_ms: i64) -> StoreResult<ClaimedFanout> {
        // One writer per database: reading the outbox inside the writer's
        // transaction is the whole claim.
        self.writer.write(move |c| claim_tx(c, limit, now_ms, |_, _| true)).await
    }

    fn fuse_fanout(&self, limit: u32) -> Option<tokio::sync::mpsc::UnboundedReceiver<ClaimedFanout>> {
        let (to_relay, from_writer) = tokio::sync::mpsc::unbounded_channel();
        self.writer.set_epilogue(Some(Box::new(move |c| fused_fan_out(c, limit, &to_relay))));
        Some(from_writer)
    }

    async fn user_high_watermark(&self, user: &str) -> StoreResult<SyncSeq> {
        let user = user.to_owned();
        self.readers
            .read(move |c| {
                c.query_row("SELECT high_watermark FROM user_heads WHERE user_id = ?1", params![user], |r| {
                    r.get::<_, i64>(0)
                })
                .optional()
                .map(|v| v.unwrap_or(0) as u64)
            })
            .await
    }

    async fn read_user_events(
        &self,
        user: &str,
        after: SyncSeq,
        upto: SyncSeq,
        limit: u32,
    ) -> StoreResult<Vec<StoredEvent>> {
        let user = user.to_owned();
        self.readers.read_store(move |c| read::user_events(c, &user, after, upto, limit)).await
    }

    async fn sync_page(&self, user: &str, device: &str, query: PageQuery, limit: u32) -> StoreResult<Option<SyncRead>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers.read_store(move |c| read::sync_page(c, &user, &device, &query, limit)).await
    }

    async fn sync_facts(&self, user: &str, device: &str) -> StoreResult<Option<SyncFacts>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers.read_store(move |c| read::sync_facts(c, &user, &device)).await
    }

    async fn cas_device_cursor(
        &self,
        user: &str,
        device: &str,
        expected: DeviceCursor,
        new: DeviceCursor,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.writer
            .write(move |c| {
                let Some(rec) = read_device(c, &user, &device)? else {
                    return Err(StoreError::NotFound(format!("device {device}")));
                };
                let (new, ends_recovery) = match cursor::decide_cas(rec.cursor, expected, new) {
                    CasDecision::Refuse { current } => return Ok((false, current)),
                    CasDecision::Write { new, ends_recovery } => (new, ends_recovery),
                };
                write_cursor(c, &user, &device, new, now_ms)?;
                if ends_recovery {
                    // A new generation ends any recovery session of the old
                    // one: it no longer fences retention.
                    c.execute(
                        "UPDATE recovery_sessions SET state = 'EXPIRED' WHERE user_id = ?1 AND device_id = ?2 AND state = 'ACTIVE'",
                        params![user, device],
                    )
                    .map_err(internal)?;
                }
                Ok((true, new))
            })
            .await
    }

    async fn ack_on(
        &self,
        connection_epoch: Option<u64>,
        user: &str,
        device: &str,
        generation: u64,
        token_session: Option<&str>,
        seq: SyncSeq,
        now_ms: i64,
    ) -> StoreResult<AckResult> {
        let (user, device, session) = (user.to_owned(), device.to_owned(), token_session.map(str::to_owned));
        // Its reads and decision come before its first change: no savepoint.
        self.writer
            .write_unguarded(move |c| {
                lifecycle::ack(c, connection_epoch, &user, &device, generation, session.as_deref(), seq, now_ms)
            })
            .await
    }

    async fn begin_recovery(
        &self,
        user: &str,
        device: &str,
        expected: DeviceCursor,
        session: tidemark_core::cursor::RecoveryInfo,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.writer.write(move |c| lifecycle::begin_recovery(c, &user, &device, expected, &session, now_ms)).await
    }

    async fn recovery_session(
        &self,
        user: &str,
        device: &str,
    ) -> StoreResult<Option<tidemark_core::cursor::RecoveryInfo>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers.read_store(move |c| lifecycle::recovery_session(c, &user, &device)).await
    }

    fn set_group_policy(&self, policy: GroupPolicy) {
        self.large_members.store(policy.large_members, Ordering::Relaxed);
    }

    async fn clear_marker(
        &self,
        user: &str,
        device: &str,
        conv: &str,
        observed_version: u64,
        last_msg_seq: MsgSeq,
    ) -> StoreResult<(bool, Marker)> {
        let (user, device, conv) = (user.to_owned(), device.to_owned(), conv.to_owned());
        self.writer.write(move |c| events::clear_marker(c, &user, &device, &conv, observed_version, last_msg_seq)).await
    }

    async fn dirty_markers(&self, user: &str, device: &str) -> StoreResult<Vec<DeviceMarker>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers.read_store(move |c| read::dirty_markers(c, &user, &device)).await
    }

    async fn active_members(&self, conv: &str) -> StoreResult<(MsgSeq, Vec<String>)> {
        let conv = conv.to_owned();
        self.readers.read_store(move |c| read::active_members(c, &conv)).await
    }

    async fn conv_members(
        &self,
        user: &str,
        conv: &str,
        after: Option<String>,
        limit: u32,
    ) -> StoreResult<MembersPage> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers.read_store(move |c| read::conv_members(c, &user, &conv, after.as_deref(), limit)).await
    }

    async fn open_connection(&self, user: &str, device: &str) -> StoreResult<OpenedConnection> {
        let (user, device) = (user.to_owned(), device.to_owned());
        // One statement, without a savepoint: nothing to undo if it fails.
        self.writer
            .write_unguarded(move |c| {
                let row: Option<(i64, i64, Option<i64>)> = c
                    .prepare_cached(
                        "UPDATE devices SET connection_epoch = connection_epoch + 1
                         WHERE user_id = ?1 AND device_id = ?2
                         RETURNING connection_epoch, acked_sync_seq,
                                   (SELECT high_watermark FROM user_heads WHERE user_id = ?1)",
                    )
                    .map_err(internal)?
                    .query_row(params![user, device], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .optional()
                    .map_err(internal)?;
                let (epoch, acked, head) = row.ok_or_else(|| StoreError::NotFound(format!("device {device}")))?;
                let connection_epoch = u64::try_from(epoch)
                    .map_err(|_| StoreError::Internal(format!("negative connection epoch {epoch}")))?;
                Ok(OpenedConnection {
                    connection_epoch,
                    acked_sync_seq: acked.max(0) as u64,
                    high_watermark: head.unwrap_or(0).max(0) as u64,
                })
            })
            .await
    }

    async fn device_fences(&self, devices: &[(String, String)]) -> StoreResult<Vec<DeviceFence>> {
        let devices = devices.to_vec();
        self.readers
            .read(move |c| {
                let mut stmt = c.prepare_cached(
                    "SELECT connection_epoch, state = 'REVOKED', acked_sync_seq FROM devices
                     WHERE user_id = ?1 AND device_id = ?2",
                )?;
                let mut out = Vec::with_capacity(devices.len());
                for (user, device) in devices {
                    let row: Option<(i64, bool, i64)> =
                        stmt.query_row(params![user, device], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional()?;
                    if let Some((epoch, revoked, acked)) = row {
                        let (connection_epoch, acked_sync_seq) = (epoch.max(0) as u64, acked.max(0) as u64);
                        out.push(DeviceFence { user, device, connection_epoch, revoked, acked_sync_seq });
                    }
                }
                Ok(out)
            })
            .await
    }

    fn stats(&self) -> StoreStats {
        let s = &self.writer.stats;
        StoreStats {
            commits: s.commits.load(Ordering::Relaxed),
            writes: s.writes.load(Ordering::Relaxed),
            checkpoints: s.checkpoints.load(Ordering::Relaxed),
            statements: STATEMENTS_WRITE.load(Ordering::Relaxed) + STATEMENTS_READ.load(Ordering::Relaxed),
            read_statements: Some(STATEMENTS_READ.load(Ordering::Relaxed)),
        }
    }

    fn health(&self) -> tidemark_store::StoreHealth {
        self.writer.health()
    }

    async fn privacy(&self, user: &str) -> StoreResult<Privacy> {
        let user = user.to_owned();
        self.readers.read_store(move |c| receipts::privacy(c, &user)).await
    }

    async fn update_privacy(
        &self,
        user: &str,
        update: PrivacyUpdate,
        now_ms: i64,
    ) -> StoreResult<(Privacy, UserEventOutcome)> {
        let user = user.to_owned();
        let (privacy, written) = self.writer.write(move |c| receipts::set_privacy(c, &user, update, now_ms)).await?;
        Ok((privacy, UserEventOutcome { written }))
    }

    async fn presence_audience(&self, user: &str, limit: u32) -> StoreResult<Vec<String>> {
        let user = user.to_owned();
        self.readers.read_store(move |c| receipts::presence_audience(c, &user, limit)).await
    }

    async fn presence_facts(&self, user: &str, limit: u32) -> StoreResult<(Privacy, Vec<String>)> {
        let user = user.to_owned();
        self.readers.read_store(move |c| receipts::presence_facts(c, &user, limit)).await
    }

    async fn conv_receipts(&self, user: &str, conv: &str, at: Option<u64>) -> StoreResult<Receipts> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers.read_store(move |c| receipts::conv_receipts(c, &user, &conv, at)).await
    }

    async fn delivery_receipts(
        &self,
        user: &str,
        conv: &str,
        message_ids: Vec<String>,
    ) -> StoreResult<Vec<(String, Option<i64>)>> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers.read_store(move |c| receipts::delivery_receipts(c, &user, &conv, &message_ids)).await
    }

    async fn use_refresh_token(&self, token_hash: &str, now_ms: i64) -> StoreResult<RefreshUse> {
        use tidemark_core::refresh::{decide, Stored, Verdict};
        let hash = token_hash.to_owned();
        self.writer
            .write(move |c| {
                let row = c
                    .query_row(
                        "SELECT user_id, device_id, expires_at, family, used_at FROM refresh_tokens WHERE token_hash = ?1",
                        params![hash],
                        |r| {
                            let rec = RefreshRecord {
                                user: r.get(0)?,
                                device: r.get(1)?,
                                expires_at_ms: r.get(2)?,
                                family: r.get(3)?,
                            };
                            Ok((rec, r.get::<_, Option<i64>>(4)?))
                        },
                    )
                    .optional()
                    .map_err(internal)?;
                let stored = row.as_ref().map(|(rec, used_at)| match used_at {
                    Some(_) => Stored::Used,
                    None => Stored::Live { expires_at_ms: rec.expires_at_ms },
                });
                Ok(match (decide(stored, now_ms), row) {
                    (Verdict::Rotate, Some((rec, _))) => {
                        c.execute("UPDATE refresh_tokens SET used_at = ?2 WHERE token_hash = ?1", params![hash, now_ms])
                            .map_err(internal)?;
                        RefreshUse::Rotated(rec)
                    }
                    (Verdict::Expired, Some((rec, _))) => {
                        c.execute("DELETE FROM refresh_tokens WHERE token_hash = ?1", params![hash]).map_err(internal)?;
                        RefreshUse::Expired(rec)
                    }
                    (Verdict::RevokeFamily, Some((rec, _))) => {
                        c.execute("DELETE FROM refresh_tokens WHERE family = ?1", params![rec.family])
                            .map_err(internal)?;
                        RefreshUse::FamilyRevoked(rec)
                    }
                    _ => RefreshUse::Unknown,
                })
            })
            .await
    }

    async fn list_devices(&self, user: &str) -> StoreResult<Vec<DeviceInfo>> {
        let user = user.to_owned();
        self.readers
            .read_store(move |c| {
                let mut stmt = c
                    .prepare_cached(
                        "SELECT device_id, name, created_at, updated_at, state FROM devices \
                         WHERE user_id = ?1 ORDER BY device_id",
                    )
                    .map_err(internal)?;
                let rows = stmt
                    .query_map(params![user], |r| {
                        Ok((r.get::<_, String>(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get::<_, String>(4)?))
                    })
                    .map_err(internal)?;
                rows.map(|row| {
                    let (device, name, created_at_ms, last_seen_ms, state) = row.map_err(internal)?;
                    let state = DeviceState::parse(&state)
                        .ok_or_else(|| StoreError::Internal(format!("bad device state {state}")))?;
                    Ok(DeviceInfo { device, name, created_at_ms, last_seen_ms, state })
                })
                .collect()
            })
            .await
    }

    async fn change_password(&self, user: &str, password_hash: &str, keep_device: &str) -> StoreResult<bool> {
        let (user, hash, keep) = (user.to_owned(), password_hash.to_owned(), keep_device.to_owned());
        self.writer
            .write(move |c| {
                let n = c
                    .execute("UPDATE users SET password_hash = ?2 WHERE user_id = ?1", params![user, hash])
                    .map_err(internal)?;
                if n == 0 {
                    return Ok(false);
                }
                c.execute("DELETE FROM refresh_tokens WHERE user_id = ?1 AND device_id <> ?2", params![user, keep])
                    .map_err(internal)?;
                Ok(true)
            })
            .await
    }

    async fn end_sessions(&self, user: &str, device: Option<&str>, now_ms: i64) -> StoreResult<bool> {
        let (user, device) = (user.to_owned(), device.map(str::to_owned));
        self.writer
            .write(move |c| {
                let n = match &device {
                    Some(d) => c.execute(
                        "UPDATE devices SET sessions_ended_at = MAX(sessions_ended_at, ?3) \
                         WHERE user_id = ?1 AND device_id = ?2",
                        params![user, d, now_ms],
                    ),
                    None => c.execute(
                        "UPDATE users SET sessions_ended_at = MAX(sessions_ended_at, ?2) WHERE user_id = ?1",
                        params![user, now_ms],
                    ),
                }
                .map_err(internal)?;
                if n == 0 {
                    return Ok(false);
                }
                c.execute(
                    "DELETE FROM refresh_tokens WHERE user_id = ?1 AND (?2 IS NULL OR device_id = ?2)",
                    params![user, device],
                )
                .map_err(internal)?;
                bump_fences_version(c)?;
                Ok(true)
            })
            .await
    }

    async fn deactivate_user(&self, user: &str, now_ms: i64) -> StoreResult<bool> {
        let user = user.to_owned();
        self.writer
            .write(move |c| {
                let deactivated: Option<Option<i64>> = c
                    .query_row("SELECT deactivated_at FROM users WHERE user_id = ?1", params![user], |r| r.get(0))
                    .optional()
                    .map_err(internal)?;
                let Some(deactivated) = deactivated else { return Err(StoreError::NotFound("no such user".into())) };
                c.execute("DELETE FROM refresh_tokens WHERE user_id = ?1", params![user]).map_err(internal)?;
                c.execute("DELETE FROM push_targets WHERE user_id = ?1", params![user]).map_err(internal)?;
                if deactivated.is_some() {
                    return Ok(false);
                }
                c.execute(
                    "UPDATE users SET deactivated_at = ?2, sessions_ended_at = MAX(sessions_ended_at, ?2) WHERE user_id = ?1",
                    params![user, now_ms],
                )
                .map_err(internal)?;
                bump_fences_version(c)?;
                Ok(true)
            })
            .await
    }

    async fn fences_version(&self) -> StoreResult<u64> {
        self.readers
            .read_store(|c| {
                let v: Option<i64> = c
                    .query_row("SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'fences_version'", [], |r| r.get(0))
                    .optional()
                    .map_err(internal)?;
                Ok(v.unwrap_or(0).max(0) as u64)
            })
            .await
    }

    async fn session_fences(&self) -> StoreResult<SessionFences> {
        self.readers
            .read_store(|c| {
                let mut fences = SessionFences::default();
                let mut users = c
                    .prepare_cached(
                        "SELECT user_id, deactivated_at IS NOT NULL, sessions_ended_at FROM users \
                         WHERE deactivated_at IS NOT NULL OR sessions_ended_at > 0",
                    )
                    .map_err(internal)?;
                let rows = users
                    .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, bool>(1)?, r.get::<_, i64>(2)?)))
                    .map_err(internal)?;
                for row in rows {
                    let (user, deactivated, ended) = row.map_err(internal)?;
                    if deactivated {
                        fences.deactivated.push(user.clone());
                    }
                    if ended > 0 {
                        fences.users_ended.push((user, ended));
                    }
                }
                let mut devices = c
                    .prepare_cached(
                        "SELECT user_id, device_id, sessions_ended_at FROM devices WHERE sessions_ended_at > 0",
                    )
                    .map_err(internal)?;
                let rows = devices.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).map_err(internal)?;
                for row in rows {
                    fences.devices_ended.push(row.map_err(internal)?);
                }
                Ok(fences)
            })
            .await
    }

    async fn append_audit(&self, entry: &AuditEntry) -> StoreResult<()> {
        let e = entry.clone();
        self.writer
            .write(move |c| {
                c.prepare_cached(
                    "INSERT INTO audit_log (at, event, actor, user_hash, device_hash, address) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )
                .map_err(internal)?
                .execute(params![e.at_ms, e.event, e.actor, e.user_hash, e.device_hash, e.address])
                .map_err(internal)?;
                Ok(())
            })
            .await
    }

    async fn audit_log(
        &self,
        user_hash: Option<&str>,
        from_ms: i64,
        to_ms: i64,
        limit: u32,
    ) -> StoreResult<Vec<AuditEntry>> {
        let user_hash = user_hash.map(str::to_owned);
        self.readers
            .read_store(move |c| {
                let mut stmt = c
                    .prepare_cached(
                        "SELECT at, event, actor, user_hash, device_hash, address FROM audit_log \
                         WHERE (?1 IS NULL OR user_hash = ?1) AND at >= ?2 AND at < ?3 ORDER BY at, id LIMIT ?4 + 0",
                    )
                    .map_err(internal)?;
                let rows = stmt
                    .query_map(params![user_hash, from_ms, to_ms, limit], |r| {
                        Ok(AuditEntry {
                            at_ms: r.get(0)?,
                            event: r.get(1)?,
                            actor: r.get(2)?,
                            user_hash: r.get(3)?,
                            device_hash: r.get(4)?,
                            address: r.get(5)?,
                        })
                    })
                    .map_err(internal)?;
                rows.map(|r| r.map_err(internal)).collect()
            })
            .await
    }

    async fn trim_audit(&self, before_ms: i64) -> StoreResult<u64> {
        self.writer
            .write(move |c| {
                let n = c.execute("DELETE FROM audit_log WHERE at < ?1", params![before_ms]).map_err(internal)?;
                Ok(n as u64)
            })
            .await
    }

    async fn list_users(&self) -> StoreResult<Vec<UserInfo>> {
        self.readers
            .read_store(|c| {
                let mut stmt = c
                    .prepare_cached(
                        "SELECT user_id, created_at, deactivated_at, deleted_at FROM users ORDER BY user_id",
                    )
                    .map_err(internal)?;
                let rows = stmt
                    .query_map([], |r| {
                        Ok(UserInfo {
                            user: r.get(0)?,
                            created_at_ms: r.get(1)?,
                            deactivated_at_ms: r.get(2)?,
                            deleted_at_ms: r.get(3)?,
                        })
                    })
                    .map_err(internal)?;
                rows.map(|r| r.map_err(internal)).collect()
            })
            .await
    }

    async fn delete_user(&self, user: &str, now_ms: i64) -> StoreResult<bool> {
        let user = user.to_owned();
        self.writer
            .write(move |c| {
                let deleted: Option<Option<i64>> = c
                    .query_row("SELECT deleted_at FROM users WHERE user_id = ?1", params![user], |r| r.get(0))
                    .optional()
                    .map_err(internal)?;
                let Some(deleted) = deleted else { return Err(StoreError::NotFound("no such user".into())) };
                if deleted.is_some() {
                    return Ok(false);
                }
                c.execute(
                    "UPDATE users SET deleted_at = ?2, deactivated_at = COALESCE(deactivated_at, ?2), \
                     sessions_ended_at = MAX(sessions_ended_at, ?2) WHERE user_id = ?1",
                    params![user, now_ms],
                )
                .map_err(internal)?;
                bump_fences_version(c)?;
                c.execute(
                    "DELETE FROM snapshot_items WHERE snapshot_id IN (SELECT snapshot_id FROM snapshots WHERE user_id = ?1)",
                    params![user],
                )
                .map_err(internal)?;
                for table in
                    ["snapshots", "recovery_sessions", "refresh_tokens", "deliveries", "user_deleted", "devices", "push_targets"]
                {
                    c.execute(&format!("DELETE FROM {table} WHERE user_id = ?1"), params![user]).map_err(internal)?;
                }
                c.execute("UPDATE user_heads SET trimmed_upto = high_watermark WHERE user_id = ?1", params![user])
                    .map_err(internal)?;
                c.execute("DELETE FROM user_events WHERE user_id = ?1", params![user]).map_err(internal)?;
                Ok(true)
            })
            .await
    }

    async fn put_push_target(&self, target: PushTarget, now_ms: i64) -> StoreResult<bool> {
        self.writer.write(move |c| push::put_target(c, &target, now_ms)).await
    }

    async fn push_targets(&self, user: &str) -> StoreResult<Vec<PushTarget>> {
        let user = user.to_owned();
        self.readers.read_store(move |c| push::targets(c, &user)).await
    }

    async fn remove_push_target(&self, user: &str, device: &str, token_hash: Option<&str>) -> StoreResult<bool> {
        let (user, device, hash) = (user.to_owned(), device.to_owned(), token_hash.map(str::to_owned));
        self.writer.write(move |c| push::remove_target(c, &user, &device, hash.as_deref())).await
    }

    async fn claim_pushes(
        &self,
        now_ms: i64,
        lease_ms: i64,
        limit: u32,
        scan_max: u32,
    ) -> StoreResult<Vec<OwedPushes>> {
        self.writer.write(move |c| push::claim(c, now_ms, lease_ms, limit, scan_max)).await
    }

    async fn finish_push(
        &self,
        user: &str,
        device: &str,
        claim: i64,
        step: PushStep,
        now_ms: i64,
    ) -> StoreResult<bool> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.writer.write(move |c| push::finish(c, &user, &device, claim, step, now_ms)).await
    }
}

fn rand_secret() -> [u8; 32] {
    // The secret is read from the OS RNG through SQLite's own generator so
    // this crate needs no RNG dependency.
    let conn = Connection::open_in_memory().expect("in-memory sqlite");
    let bytes: Vec<u8> = conn.query_row("SELECT randomblob(32)", [], |r| r.get(0)).expect("randomblob");
    bytes.try_into().expect("32 bytes")
}

/// Moves `meta.fences_version` (see `Store::fences_version`), inside the
/// transaction that records a fence.
fn bump_fences_version(c: &rusqlite::Connection) -> StoreResult<()> {
    c.execute(
        "INSERT INTO meta (key, value) VALUES ('fences_version', 1) \
         ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1",
        [],
    )
    .map_err(internal)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The writer's statement journals are kept in memory (issue 19: a
    /// fused fan-out's journal spilled to a temporary file every batch);
    /// the readers keep SQLite's default. `temp_store`: 0 default, 2 memory.
    #[tokio::test]
    async fn the_writers_statement_journals_stay_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let writer: i64 =
            store.writer.write(|c| c.query_row("PRAGMA temp_store", [], |r| r.get(0)).map_err(internal)).await.unwrap();
        assert_eq!(writer, 2, "the writer's temp_store is MEMORY");
        let reader: i64 = store
            .readers
            .read_store(|c| c.query_row("PRAGMA temp_store", [], |r| r.get(0)).map_err(internal))
            .await
            .unwrap();
        assert_eq!(reader, 0, "readers keep the default");
    }
}
