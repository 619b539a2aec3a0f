//! Reads: a small pool of read-only connections used from blocking tasks.
//! Each read sees the last committed state; readers never block the writer.
//!
//! Every `LIMIT` here is written `LIMIT ?n + 0`, not `LIMIT ?n`: SQLite's
//! planner reads the value bound to a bare `LIMIT ?n` and marks the prepared
//! statement stale whenever that parameter is bound again, so a cached
//! statement was compiled anew on every execution (a tenth of the server's
//! CPU in `bench reconnect`). An expression is not looked into; the plans
//! are the same (*tests::cached_reads_are_not_compiled_again*).

use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};

use rusqlite::types::Value;
use rusqlite::vtab::array::Array;
use rusqlite::{params, Connection, OptionalExtension};
use tidemark_core::convsync::{ConvSnapshot, ConvSyncRefusal};
use tidemark_core::cursor::{DeviceCursor, DeviceState, RecoveryInfo, UserLog};
use tidemark_core::page::{decide_page, PageQuery, SyncFacts};
use tidemark_store::*;

use crate::internal;

/// Read jobs one reader thread takes off the queue at once and runs in one
/// read transaction. In WAL mode a connection throws its whole page cache
/// away (`pager_reset`) when it starts a read transaction after any commit:
/// in a resume storm, where ACKs commit between nearly every two reads,
/// each read copied every page it touched into a freshly allocated cache
/// again (`pread`, the cache's allocations and the page faults under them:
/// a sixth of the server's CPU in issue 19's storm profile). Jobs that
/// queued together share one snapshot and one warm cache instead. Each job
/// was queued before the batch's snapshot was taken (its first statement,
/// after the queue was drained), so it sees every commit that preceded it;
/// the bound keeps a batch's snapshot (which holds back the checkpoint) and
/// the wait of its last job short.
pub const READ_BATCH_MAX: usize = 8;

/// The reader threads' name (one per read-only connection).
const READER_THREAD: &str = "tidemark-sqlite-reader";

/// One read: runs on a reader thread with its connection, inside its
/// batch's read transaction unless it runs `alone`.
struct Job {
    run: Box<dyn FnOnce(&Connection) + Send>,
    /// Runs alone: a read that streams and waits on its consumer
    /// ([`ReadPool::read_alone`]) would hold up every job batched with it.
    alone: bool,
}

/// The read-only connections, each owned by a thread of its own that takes
/// reads off one queue, [`READ_BATCH_MAX`] at a time when they queue
/// together. A read that panics is answered `INTERNAL` and its thread goes
/// on; a read whose caller is gone before it starts is skipped; a read
/// transaction left open by a read is ended after its batch. Dropping the
/// pool ends the threads once the queue is empty.
pub(crate) struct ReadPool {
    jobs: std::sync::mpsc::Sender<Job>,
}

impl ReadPool {
    pub(crate) fn new(conns: Vec<Connection>) -> ReadPool {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for conn in conns {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name(READER_THREAD.into())
                .spawn(move || reader(conn, &queue))
                .expect("spawn a reader thread");
        }
        ReadPool { jobs }
    }

    /// Runs `f` on a read connection off the async threads, batched with
    /// the reads that queued with it.
    pub(crate) async fn read_store<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        self.submit(f, false).await
    }

    /// As [`ReadPool::read_store`], in a read transaction of its own: for a
    /// read that runs long or waits on its consumer.
    pub(crate) async fn read_alone<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        self.submit(f, true).await
    }

    pub(crate) async fn read<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        self.read_store(move |c| f(c).map_err(internal)).await
    }

    async fn submit<T, F>(&self, f: F, alone: bool) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let run = Box::new(move |c: &Connection| {
            if tx.is_closed() {
                return; // the caller gave up before the read began
            }
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(c)))
                .unwrap_or_else(|_| Err(StoreError::Internal("read task panicked".into())));
            let _ = tx.send(result);
        });
        self.jobs.send(Job { run, alone }).map_err(|_| StoreError::Unavailable("read pool closed".into()))?;
        rx.await.map_err(|_| StoreError::Internal("read task ended without an answer".into()))?
    }
}

/// A reader thread: takes the jobs that queued together (at most
/// [`READ_BATCH_MAX`]; a job that runs alone ends the batch and runs next)
/// and runs them in one read transaction.
fn reader(conn: Connection, queue: &Mutex<std::sync::mpsc::Receiver<Job>>) {
    let mut next: Option<Job> = None;
    let mut batch = Vec::with_capacity(READ_BATCH_MAX);
    loop {
        {
            let queue = queue.lock().unwrap_or_else(PoisonError::into_inner);
            let first = match next.take() {
                Some(job) => job,
                None => match queue.recv() {
                    Ok(job) => job,
                    Err(_) => return, // the pool is gone
                },
            };
            let alone = first.alone;
            batch.push(first);
            while !alone && batch.len() < READ_BATCH_MAX {
                match queue.try_recv() {
                    Ok(job) if job.alone => {
                        next = Some(job);
                        break;
                    }
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
        }
        run_batch(&conn, &mut batch);
    }
}

fn run_batch(c: &Connection, batch: &mut Vec<Job>) {
    // One job runs as it would alone (its statements are their own
    // snapshots, or it opens one); several share one.
    if batch.len() > 1 {
        let _ = exec(c, "BEGIN");
    }
    for job in batch.drain(..) {
        (job.run)(c);
    }
    // The batch's snapshot, or one a read left open (it panicked between
    // BEGIN and COMMIT).
    end_snapshot(c);
}

fn exec(c: &Connection, sql: &str) -> rusqlite::Result<usize> {
    c.prepare_cached(sql)?.execute([])
}

/// Runs `f` in one read transaction (one snapshot of every statement it
/// makes): the batch's when the pool opened one, else its own.
pub(crate) fn in_snapshot<T>(c: &Connection, f: impl FnOnce() -> StoreResult<T>) -> StoreResult<T> {
    if !c.is_autocommit() {
        return f();
    }
    exec(c, "BEGIN").map_err(internal)?;
    let result = f();
    end_snapshot(c);
    result
}

/// Ends the connection's read transaction, if it has one. Read-only:
/// nothing to keep, and a ROLLBACK cannot leave it open.
fn end_snapshot(c: &Connection) {
    if !c.is_autocommit() {
        let _ = exec(c, "ROLLBACK");
    }
}

/// The columns of a sync page's facts, read by [`facts_at`].
/// The last column says whether the user has a shared group (G2), off the
/// partial index `user_convs_shared`: the batch's last page reads the dirty
/// markers only then.
const FACTS_COLS: &str = "d.sync_generation, d.acked_sync_seq, d.state, h.high_watermark, h.trimmed_upto,
     s.session_id, s.resume_from, s.high_watermark, s.expires_at,
     EXISTS (SELECT 1 FROM user_convs g WHERE g.user_id = d.user_id AND g.shared = 1)";
/// Columns of [`FACTS_COLS`].
const FACTS_WIDTH: usize = 10;
/// The device, its user's head and its open recovery session (at most one:
/// `recovery_one_active`), all by primary or unique key.
const FACTS_FROM: &str = "devices d
     LEFT JOIN user_heads h ON h.user_id = d.user_id
     LEFT JOIN recovery_sessions s ON s.user_id = d.user_id AND s.device_id = d.device_id AND s.state = 'ACTIVE'";

/// The facts as read, before the device state is checked, and whether the
/// user has a shared group.
type FactsRow = (i64, i64, String, UserLog, Option<RecoveryInfo>, bool);

fn facts_at(r: &rusqlite::Row) -> rusqlite::Result<FactsRow> {
    let session = match r.get::<_, Option<String>>(5)? {
        None => None,
        Some(session_id) => Some(RecoveryInfo {
            session_id,
            resume_from: r.get::<_, i64>(6)? as u64,
            high_watermark: r.get::<_, i64>(7)? as u64,
            expires_at_ms: r.get(8)?,
        }),
    };
    let log = UserLog {
        high_watermark: r.get::<_, Option<i64>>(3)?.unwrap_or(0) as u64,
        trimmed_upto: r.get::<_, Option<i64>>(4)?.unwrap_or(0) as u64,
    };
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, log, session, r.get(9)?))
}

fn to_facts((generation, acked, state, log, session, shared): FactsRow) -> StoreResult<(SyncFacts, bool)> {
    let state = DeviceState::parse(&state).ok_or_else(|| StoreError::Internal(format!("bad device state {state}")))?;
    let device = DeviceCursor { generation: generation as u64, acked_sync_seq: acked as u64, state };
    Ok((SyncFacts { device, log, session }, shared))
}

/// The facts a sync page is decided from, in one statement: the device's
/// cursor, the user's log bounds, the device's open recovery session.
pub(crate) fn sync_facts(c: &Connection, user: &str, device: &str) -> StoreResult<Option<SyncFacts>> {
    Ok(facts_and_shared(c, user, device)?.map(|(facts, _)| facts))
}

/// [`sync_facts`] and whether the user has a shared group, in one statement.
fn facts_and_shared(c: &Connection, user: &str, device: &str) -> StoreResult<Option<(SyncFacts, bool)>> {
    let sql = format!("SELECT {FACTS_COLS} FROM {FACTS_FROM} WHERE d.user_id = ?1 AND d.device_id = ?2");
    let row = c
        .prepare_cached(&sql)
        .map_err(internal)?
        .query_row(params![user, device], facts_at)
        .optional()
        .map_err(internal)?;
    row.map(to_facts).transpose()
}

/// A sync page from one snapshot (D2, D6, L2). One statement is one
/// snapshot in SQLite, so the page is first read as one statement: the
/// facts joined with the range the decision most often names (a next
/// page's own range; for a first page, the replay from the device's ACK to
/// the head). If the core's decision on those facts names that range (or
/// none) and no message of it has reactions to read, that is the page.
/// Otherwise (a recovery's range, a rebuild from 0 after a reset, reactions)
/// the facts, the decision and the range are read again in one read
/// transaction ([`sync_page_in_transaction`]).
pub(crate) fn sync_page(
    c: &Connection,
    user: &str,
    device: &str,
    query: &PageQuery,
    limit: u32,
) -> StoreResult<Option<SyncRead>> {
    let mut stmt = c.prepare_cached(page_sql(query)).map_err(internal)?;
    let mut rows = match query {
        PageQuery::Next { position, high_watermark, .. } => {
            stmt.query(params![user, device, *position as i64, *high_watermark as i64, limit])
        }
        PageQuery::First { .. } => stmt.query(params![user, device, limit]),
    }
    .map_err(internal)?;
    // Every row repeats the facts: they are read from the first one only.
    let mut facts = None;
    let mut events = Vec::with_capacity(limit.min(tidemark_proto::SYNC_LIMIT_MAX) as usize);
    while let Some(r) = rows.next().map_err(internal)? {
        if facts.is_none() {
            facts = Some(facts_at(r).map_err(internal)?);
        }
        if r.get::<_, Option<i64>>(FACTS_WIDTH).map_err(internal)?.is_some() {
            events.push(event_at(r, FACTS_WIDTH).map_err(internal)?);
        }
    }
    drop(rows);
    let Some((facts, shared_groups)) = facts.map(to_facts).transpose()? else {
        return Ok(None);
    };
    let decision = decide_page(&facts, query);
    let read = match query {
        PageQuery::Next { position, high_watermark, .. } => (*position, *high_watermark),
        PageQuery::First { .. } => (facts.device.acked_sync_seq, facts.log.high_watermark),
    };
    match decision.range(&facts) {
        None => Ok(Some(SyncRead { facts, decision, events: Vec::new(), shared_groups })),
        Some(range) if range == read && !events.iter().any(has_reactions) => {
            let events = render_events(c, events, range.0, range.1)?;
            Ok(Some(SyncRead { facts, decision, events, shared_groups }))
        }
        Some(_) => sync_page_in_transaction(c, user, device, query, limit),
    }
}

/// The one statement of [`sync_page`]: the facts, and the entries of the
/// range read with them, at most `limit` rows in `sync_seq` order off the
/// `(user_id, sync_seq)` key (no sort, however long the range). Built once
/// per kind of page (it is the statement cache's key on every page).
fn page_sql(query: &PageQuery) -> &'static str {
    static NEXT: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| build_page_sql("e.sync_seq > ?3 AND e.sync_seq <= ?4", "LIMIT ?5 + 0"));
    static FIRST: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        build_page_sql("e.sync_seq > d.acked_sync_seq AND e.sync_seq <= h.high_watermark", "LIMIT ?3 + 0")
    });
    match query {
        PageQuery::Next { .. } => &NEXT,
        PageQuery::First { .. } => &FIRST,
    }
}

fn build_page_sql(range: &str, tail: &str) -> String {
    format!(
        "SELECT {FACTS_COLS}, {EVENT_COLS}, {MSG_COLS}, {DECORATION_COLS}
         FROM {FACTS_FROM}
         LEFT JOIN user_events e ON e.user_id = d.user_id AND {range}
         {EVENT_JOINS}
         WHERE d.user_id = ?1 AND d.device_id = ?2
         ORDER BY e.sync_seq {tail}"
    )
}

/// [`sync_page`] as a read transaction of several statements: the facts,
/// the core's decision on them, and the range it names.
fn sync_page_in_transaction(
    c: &Connection,
    user: &str,
    device: &str,
    query: &PageQuery,
    limit: u32,
) -> StoreResult<Option<SyncRead>> {
    in_snapshot(c, || {
        let Some((facts, shared_groups)) = facts_and_shared(c, user, device)? else {
            return Ok(None);
        };
        let decision = decide_page(&facts, query);
        let events = match decision.range(&facts) {
            Some((after, upto)) => user_events(c, user, after, upto, limit)?,
            None => Vec::new(),
        };
        Ok(Some(SyncRead { facts, decision, events, shared_groups }))
    })
}

pub(crate) fn conversation(c: &Connection, conv: &str) -> StoreResult<Option<Conversation>> {
    let row = c
        .prepare_cached("SELECT kind, head FROM conversations WHERE conv_id = ?1")
        .map_err(internal)?
        .query_row(params![conv], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .optional()
        .map_err(internal)?;
    let Some((kind, head)) = row else {
        return Ok(None);
    };
    let mut stmt = c
        .prepare_cached(
            "SELECT user_id FROM membership_periods WHERE conv_id = ?1 AND leave_seq IS NULL ORDER BY user_id",
        )
        .map_err(internal)?;
    let members = stmt
        .query_map(params![conv], |r| r.get(0))
        .map_err(internal)?
        .collect::<Result<Vec<String>, _>>()
        .map_err(internal)?;
    Ok(Some(Conversation { conv: conv.into(), kind, members, head: head as u64 }))
}

/// The conversation list's columns: the projection, then what a shared
/// group's marker and unread are computed from (G2).
const LIST_COLS: &str = "uc.conv_id, c.kind, uc.last_msg_seq, uc.read_seq, uc.unread, uc.muted, uc.pinned, uc.active,
        c.mode, c.shared_from, COALESCE(mk.target, 0), COALESCE(mk.version, 0),
        CASE WHEN uc.active THEN NULL ELSE (SELECT MAX(p.leave_seq) FROM membership_periods p
             WHERE p.conv_id = uc.conv_id AND p.user_id = uc.user_id) END,
        COALESCE((SELECT dm.cleared_seq FROM device_markers dm WHERE dm.user_id = uc.user_id
             AND dm.device_id = ?2 AND dm.conv_id = uc.conv_id), 0), uc.mentions, uc.push_preview";

/// Which rows of a user's list [`conv_rows`] reads.
pub(crate) enum Rows<'a> {
    All,
    Shared,
    One(&'a str),
    /// Up to `limit` rows after `after`, in `conv_id` order (the key).
    Page {
        after: &'a str,
        limit: u32,
    },
}

/// The rows of `user`'s list, markers evaluated for `device`.
pub(crate) fn conv_rows(
    c: &Connection,
    user: &str,
    device: Option<&str>,
    which: Rows<'_>,
) -> StoreResult<Vec<ConvState>> {
    // The dirty list of the sync path reads markers only: no unread count.
    let count_unread = !matches!(which, Rows::Shared);
    let (filter, conv, limit) = match which {
        Rows::All => ("", None, None),
        Rows::Shared => ("AND uc.shared = 1", None, None),
        Rows::One(conv) => ("AND uc.conv_id = ?3", Some(conv), None),
        Rows::Page { after, limit } => {
            ("AND uc.conv_id > ?3 ORDER BY uc.conv_id LIMIT ?4 + 0", Some(after), Some(limit))
        }
    };
    let sql = format!(
        "SELECT {LIST_COLS} FROM user_convs uc JOIN conversations c ON c.conv_id = uc.conv_id
         LEFT JOIN conv_markers mk ON mk.conv_id = uc.conv_id
         WHERE uc.user_id = ?1 {filter}"
    );
    let mut stmt = c.prepare_cached(&sql).map_err(internal)?;
    let map = |r: &rusqlite::Row<'_>| {
        let state = ConvState {
            conv: r.get(0)?,
            kind: r.get(1)?,
            last_msg_seq: r.get::<_, i64>(2)? as u64,
            read_seq: r.get::<_, i64>(3)? as u64,
            unread: r.get::<_, i64>(4)? as u64,
            mentions: r.get::<_, i64>(14)? as u64,
            muted: r.get(5)?,
            pinned: r.get(6)?,
            active: r.get(7)?,
            mode: r.get(8)?,
            marker: None,
            unread_capped: false,
            push_preview: crate::push::preview_col(r, 15)?,
        };
        let shared_from = r.get::<_, Option<i64>>(9)?.map(|v| v as u64);
        let facts = tidemark_core::large::MarkerFacts {
            published_target: r.get::<_, i64>(10)? as u64,
            version: r.get::<_, i64>(11)? as u64,
            left_at: r.get::<_, Option<i64>>(12)?.map(|v| v as u64),
            cleared_seq: r.get::<_, i64>(13)? as u64,
        };
        Ok((state, shared_from, facts))
    };
    let rows = match (conv, limit) {
        (Some(conv), Some(limit)) => stmt.query_map(params![user, device, conv, limit], map),
        (Some(conv), None) => stmt.query_map(params![user, device, conv], map),
        (None, _) => stmt.query_map(params![user, device], map),
    }
    .map_err(internal)?
    .collect::<Result<Vec<_>, _>>()
    .map_err(internal)?;
    let mut out = Vec::with_capacity(rows.len());
    for (state, shared_from, facts) in rows {
        let (tidemark_core::large::MODE_SHARED, Some(from)) = (state.mode.as_str(), shared_from) else {
            out.push(state);
            continue;
        };
        let marker = tidemark_core::large::marker(&facts);
        // Unread above the switch is counted from the log on read (exact
        // up to the cap, so it cannot drift); the marker alone needs none.
        // Mentions above the switch likewise (issue 18): rows are written
        // for nobody, "everyone" is the message's one flag.
        let (counted, mentioned) =
            match (count_unread, tidemark_core::large::unread_window(state.read_seq, from, marker.target)) {
                (true, Some((above, upto))) => (
                    shared_unread_above(c, user, &state.conv, above, upto, false)?,
                    shared_unread_above(c, user, &state.conv, above, upto, true)?,
                ),
                _ => (0, 0),
            };
        out.push(state.shared(marker, counted, mentioned));
    }
    Ok(out)
}

/// Messages from others in `conv` in `(above, upto]` the user may see and
/// has not read, recalled or deleted for themselves, counted up to
/// `large::UNREAD_COUNT_MAX + 1`; with `mentioned`, only those that mention
/// the user (issue 18).
pub(crate) fn shared_unread_above(
    c: &Connection,
    user: &str,
    conv: &str,
    above: u64,
    upto: u64,
    mentioned: bool,
) -> StoreResult<u64> {
    let control = tidemark_core::kinds::CONTROL_KINDS.iter().map(|k| format!("'{k}'")).collect::<Vec<_>>().join(", ");
    let mention = if mentioned { crate::events::MENTIONED.replace("?1", "?2") } else { "1".into() };
    let sql = format!(
        "SELECT COUNT(*) FROM (SELECT 1 FROM messages m
         WHERE m.conv_id = ?1 AND m.msg_seq > ?3 AND m.msg_seq <= ?4 AND m.sender <> ?2
           AND m.kind NOT IN ({control}) AND m.state <> '{STATE_RECALLED}'
           AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = ?2 AND d.message_id = m.message_id)
           AND {VISIBLE} AND {mention} LIMIT ?5 + 0)"
    );
    let n: i64 = c
        .prepare_cached(&sql)
        .map_err(internal)?
        .query_row(
            params![conv, user, above as i64, upto as i64, tidemark_core::large::UNREAD_COUNT_MAX as i64 + 1],
            |r| r.get(0),
        )
        .map_err(internal)?;
    Ok(n as u64)
}

pub(crate) fn list_conversations(c: &Connection, user: &str, device: Option<&str>) -> StoreResult<Vec<ConvState>> {
    let mut rows = conv_rows(c, user, device, Rows::All)?;
    rows.sort_by(|a, b| b.pinned.cmp(&a.pinned).then(b.last_msg_seq.cmp(&a.last_msg_seq)).then(a.conv.cmp(&b.conv)));
    Ok(rows)
}

/// Up to `limit` of the user's conversations after `after`, by `conv_id`.
pub(crate) fn conversations_after(
    c: &Connection,
    user: &str,
    device: Option<&str>,
    after: &str,
    limit: u32,
) -> StoreResult<Vec<ConvState>> {
    conv_rows(c, user, device, Rows::Page { after, limit })
}

/// The shared groups whose marker is dirty for `device` (G2).
pub(crate) fn dirty_markers(c: &Connection, user: &str, device: &str) -> StoreResult<Vec<DeviceMarker>> {
    Ok(conv_rows(c, user, Some(device), Rows::Shared)?
        .into_iter()
        .filter_map(|s| s.marker.filter(|m| m.dirty).map(|marker| DeviceMarker { conv: s.conv, marker }))
        .collect())
}

/// The active members of `conv` and the msg_seq of its last membership
/// change, in one read transaction.
pub(crate) fn active_members(c: &Connection, conv: &str) -> StoreResult<(u64, Vec<String>)> {
    in_snapshot(c, || {
        let seq: i64 = c
            .prepare_cached("SELECT members_seq FROM conversations WHERE conv_id = ?1")
            .map_err(internal)?
            .query_row(params![conv], |r| r.get(0))
            .optional()
            .map_err(internal)?
            .ok_or_else(|| StoreError::NotFound(format!("conversation {conv}")))?;
        let mut stmt = c
            .prepare_cached("SELECT user_id FROM membership_periods WHERE conv_id = ?1 AND leave_seq IS NULL")
            .map_err(internal)?;
        let users = stmt
            .query_map(params![conv], |r| r.get(0))
            .map_err(internal)?
            .collect::<Result<Vec<String>, _>>()
            .map_err(internal)?;
        Ok((seq as u64, users))
    })
}

/// One `conv.members` page: the conversation, the caller's open period and
/// up to `limit + 1` current members above `after`, in one read
/// transaction (the key `UNIQUE (conv_id, user_id, join_seq)` serves the
/// range), decided by `core::membership::members_page`.
pub(crate) fn conv_members(
    c: &Connection,
    user: &str,
    conv: &str,
    after: Option<&str>,
    limit: u32,
) -> StoreResult<MembersPage> {
    in_snapshot(c, || {
        let head = c
            .prepare_cached("SELECT members_seq, owner FROM conversations WHERE conv_id = ?1")
            .map_err(internal)?
            .query_row(params![conv], |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, Option<String>>(1)?)))
            .optional()
            .map_err(internal)?;
        let caller_active = c
            .prepare_cached(
                "SELECT 1 FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2 AND leave_seq IS NULL LIMIT 1",
            )
            .map_err(internal)?
            .query_row(params![conv, user], |_| Ok(()))
            .optional()
            .map_err(internal)?
            .is_some();
        let mut stmt = c
            .prepare_cached(
                "SELECT user_id, join_seq FROM membership_periods
                 WHERE conv_id = ?1 AND leave_seq IS NULL AND user_id > ?2 ORDER BY user_id LIMIT ?3",
            )
            .map_err(internal)?;
        let rows = stmt
            .query_map(params![conv, after.unwrap_or(""), i64::from(limit) + 1], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64))
            })
            .map_err(internal)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(internal)?;
        let facts = tidemark_core::membership::MembersFacts { conv: head, caller_active, rows };
        Ok(tidemark_core::membership::members_page(conv, facts, limit as usize)?)
    })
}

pub(crate) fn pending_outbox(c: &Connection, limit: u32) -> StoreResult<Vec<OutboxItem>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT outbox_id, kind, source_event_id, conv_id, msg_seq, actor, created_at
             FROM outbox ORDER BY outbox_id LIMIT ?1 + 0",
        )
        .map_err(internal)?;
    let rows = stmt
        .query_map(params![limit], |r| {
            Ok(OutboxItem {
                outbox_id: r.get(0)?,
                kind: r.get(1)?,
                source_event_id: r.get(2)?,
                conv: r.get(3)?,
                msg_seq: r.get::<_, i64>(4)? as u64,
                actor: r.get(5)?,
                created_at_ms: r.get(6)?,
            })
        })
        .map_err(internal)?;
    rows.collect::<Result<Vec<_>, _>>().map_err(internal)
}

/// Columns of a message row, in the order [`message_at`] reads them.
pub(crate) const MSG_COLS: &str = "m.message_id, m.conv_id, m.msg_seq, m.kind, m.state, m.sender, m.content,
     m.created_at, m.version, m.quote_id, m.mentions, m.mention_all";
/// How many columns [`MSG_COLS`] has.
const MSG_COLS_N: usize = 12;

/// Reads a message from `MSG_COLS` starting at column `at`; the quote id
/// comes back beside it for [`decorate`].
pub(crate) fn message_at(r: &rusqlite::Row, at: usize) -> rusqlite::Result<(StoredMessage, Option<String>)> {
    Ok((
        StoredMessage {
            message_id: r.get(at)?,
            conv: r.get(at + 1)?,
            msg_seq: r.get::<_, i64>(at + 2)? as u64,
            kind: r.get(at + 3)?,
            state: r.get(at + 4)?,
            sender: r.get(at + 5)?,
            content: r.get(at + 6)?,
            created_at_ms: r.get(at + 7)?,
            version: r.get::<_, i64>(at + 8)? as u64,
            quote: None,
            reactions: Vec::new(),
            mentions: match r.get::<_, Option<String>>(at + 10)? {
                None => Vec::new(),
                Some(s) => tidemark_proto::content::parse_mentions(&s).map_err(|e| {
                    rusqlite::Error::FromSqlConversionFailure(at + 10, rusqlite::types::Type::Text, e.into())
                })?,
            },
            mention_all: r.get(at + 11)?,
        },
        r.get(at + 9)?,
    ))
}

/// Renders messages for one reader: deleted-for-me becomes a placeholder,
/// a quote says whether its target was recalled, reactions are attached.
/// Recalled content is already wiped in storage.
pub(crate) fn decorate(c: &Connection, reader: &str, msgs: &mut [(StoredMessage, Option<String>)]) -> StoreResult<()> {
    if msgs.is_empty() {
        return Ok(());
    }
    // Three reads for the whole page, not three per message: the ids go in
    // as one `rarray` parameter (loaded on every connection, see `configure`).
    let mut d = Decorations::default();
    let ids: Array = Rc::new(msgs.iter().map(|(m, _)| Value::from(m.message_id.clone())).collect());
    d.deleted = c
        .prepare_cached("SELECT message_id FROM user_deleted WHERE user_id = ?1 AND message_id IN rarray(?2)")
        .map_err(internal)?
        .query_map(params![reader, ids], |r| r.get(0))
        .map_err(internal)?
        .collect::<rusqlite::Result<_>>()
        .map_err(internal)?;

    let quoted: Array = Rc::new(msgs.iter().filter_map(|(_, q)| q.clone().map(Value::from)).collect());
    if !quoted.is_empty() {
        d.quote_states = c
            .prepare_cached("SELECT message_id, state FROM messages WHERE message_id IN rarray(?1)")
            .map_err(internal)?
            .query_map(params![quoted], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(internal)?
            .collect::<rusqlite::Result<_>>()
            .map_err(internal)?;
    }

    add_reactions(c, &mut d, ids)?;
    d.apply(msgs);
    Ok(())
}

/// The reactions of the messages `ids`, in one statement.
fn add_reactions(c: &Connection, d: &mut Decorations, ids: Array) -> StoreResult<()> {
    let mut stmt = c
        .prepare_cached(
            "SELECT message_id, reaction, user_id FROM reactions WHERE message_id IN rarray(?1)
             ORDER BY message_id, reaction, user_id",
        )
        .map_err(internal)?;
    let rows = stmt.query_map(params![ids], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).map_err(internal)?;
    for row in rows {
        let (id, reaction, user) = row.map_err(internal)?;
        d.add_reaction(id, reaction, user);
    }
    Ok(())
}

/// The columns of a user-log entry, read by [`event_at`] (its message's
/// [`MSG_COLS`] follow).
const EVENT_COLS: &str = "e.sync_seq, e.kind, e.conv_id, e.msg_seq, e.data";
/// The message of an entry, and the message that one quotes.
const EVENT_JOINS: &str = "LEFT JOIN messages m ON m.message_id = e.message_id
     LEFT JOIN messages q ON q.message_id = m.quote_id";
/// What rendering needs besides the message, read as columns of the same
/// statement after [`EVENT_COLS`] and [`MSG_COLS`]: whether the reader (`?1`) deleted the
/// message for itself, the state of the message it quotes, whether it has
/// reactions. So a page is one statement (plus one for the reactions of
/// the messages that have any), not one plus three batched rendering reads.
const DECORATION_COLS: &str =
    "EXISTS (SELECT 1 FROM user_deleted x WHERE x.user_id = ?1 AND x.message_id = m.message_id),
     q.state, EXISTS (SELECT 1 FROM reactions r WHERE r.message_id = m.message_id)";

/// A user-log entry and, for a conversation event, its message (with its
/// quote id) and the decoration columns: deleted, quote state, reacted.
type EventRow = (StoredEvent, Option<((StoredMessage, Option<String>), bool, Option<String>, bool)>);

/// Reads [`EVENT_COLS`], [`MSG_COLS`] and [`DECORATION_COLS`] starting at
/// column `at`.
fn event_at(r: &rusqlite::Row, at: usize) -> rusqlite::Result<EventRow> {
    let message = match r.get::<_, Option<String>>(at + 5)? {
        None => None,
        Some(_) => {
            let d = at + 5 + MSG_COLS_N;
            Some((message_at(r, at + 5)?, r.get(d)?, r.get(d + 1)?, r.get(d + 2)?))
        }
    };
    let event = StoredEvent {
        sync_seq: r.get::<_, i64>(at)? as u64,
        kind: r.get(at + 1)?,
        conv: r.get(at + 2)?,
        msg_seq: r.get::<_, Option<i64>>(at + 3)?.map(|v| v as u64),
        message: None,
        data: r.get(at + 4)?,
    };
    Ok((event, message))
}

fn has_reactions(row: &EventRow) -> bool {
    row.1.as_ref().is_some_and(|m| m.3)
}

/// Renders a page's entries for their reader (the decoration columns were
/// read for it; the reactions of the messages that have any are read here) and checks it is the range asked for.
fn render_events(c: &Connection, rows: Vec<EventRow>, after: u64, upto: u64) -> StoreResult<Vec<StoredEvent>> {
    let mut events = Vec::with_capacity(rows.len());
    let mut messages = Vec::new();
    let mut d = Decorations::default();
    let mut reacted = Vec::new();
    for (e, m) in rows {
        if let Some((m, deleted, quote_state, has_reactions)) = m {
            let id = &m.0.message_id;
            if deleted {
                d.deleted.insert(id.clone());
            }
            if let (Some(q), Some(state)) = (&m.1, quote_state) {
                d.quote_states.insert(q.clone(), state);
            }
            if has_reactions {
                reacted.push(Value::from(id.clone()));
            }
            messages.push((events.len(), m));
        }
        events.push(e);
    }
    if !reacted.is_empty() {
        add_reactions(c, &mut d, Rc::new(reacted))?;
    }
    let (at, mut rendered): (Vec<usize>, Vec<_>) = messages.into_iter().unzip();
    d.apply(&mut rendered);
    for (i, (m, _)) in at.into_iter().zip(rendered) {
        events[i].message = Some(m);
    }
    // Assert on our side of the storage boundary: a page is ascending and
    // inside the requested range.
    let mut prev = after;
    for e in &events {
        assert!(e.sync_seq > prev && e.sync_seq <= upto, "user log page out of order or range");
        prev = e.sync_seq;
    }
    Ok(events)
}

pub(crate) fn user_events(
    c: &Connection,
    user: &str,
    after: u64,
    upto: u64,
    limit: u32,
) -> StoreResult<Vec<StoredEvent>> {
    let sql = format!(
        "SELECT {EVENT_COLS}, {MSG_COLS}, {DECORATION_COLS}
         FROM user_events e {EVENT_JOINS}
         WHERE e.user_id = ?1 AND e.sync_seq > ?2 AND e.sync_seq <= ?3
         ORDER BY e.sync_seq LIMIT ?4 + 0"
    );
    let mut stmt = c.prepare_cached(&sql).map_err(internal)?;
    let rows = stmt
        .query_map(params![user, after as i64, upto as i64, limit], |r| event_at(r, 0))
        .map_err(internal)?
        .collect::<rusqlite::Result<Vec<_>>>()
        .map_err(internal)?;
    render_events(c, rows, after, upto)
}

/// The reader's membership periods cover `m.msg_seq` (G1).
/// A control event is visible only to who could see its target too, so a
/// newcomer never reads an edit of a message from before its join.
pub(crate) const VISIBLE: &str =
    "EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = ?2
     AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))
     AND (m.target_id IS NULL OR EXISTS (SELECT 1 FROM messages t JOIN membership_periods p2
          ON p2.conv_id = t.conv_id AND p2.user_id = ?2 AND p2.join_seq <= t.msg_seq
             AND (p2.leave_seq IS NULL OR t.msg_seq <= p2.leave_seq)
          WHERE t.message_id = m.target_id))";

fn conv_snapshot(c: &Connection, conv: &str, user: &str) -> StoreResult<ConvSnapshot> {
    let row: Option<(i64, i64, i64)> = c
        .prepare_cached("SELECT head, min_seq, epoch FROM conversations WHERE conv_id = ?1")
        .map_err(internal)?
        .query_row(params![conv], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()
        .map_err(internal)?;
    let Some((head, min_seq, epoch)) = row else {
        return Err(StoreError::NotFound(format!("conversation {conv}")));
    };
    let ever: Option<i64> = c
        .prepare_cached("SELECT 1 FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2 LIMIT 1")
        .map_err(internal)?
        .query_row(params![conv, user], |r| r.get(0))
        .optional()
        .map_err(internal)?;
    if ever.is_none() {
        return Err(StoreError::NotMember);
    }
    Ok(ConvSnapshot { head: head as u64, min_seq: min_seq as u64, epoch: epoch as u64 })
}

/// `conv.sync` in one read transaction: head, min_seq, epoch, periods and
/// events all come from the same snapshot (C1).
pub(crate) fn conv_sync(
    c: &Connection,
    user: &str,
    conv: &str,
    after: u64,
    limit: u32,
    epoch: Option<u64>,
) -> StoreResult<ConvSyncPage> {
    in_snapshot(c, || conv_sync_in_snapshot(c, user, conv, after, limit, epoch))
}

fn conv_sync_in_snapshot(
    c: &Connection,
    user: &str,
    conv: &str,
    after: u64,
    limit: u32,
    epoch: Option<u64>,
) -> StoreResult<ConvSyncPage> {
    let snap = conv_snapshot(c, conv, user)?;
    let trimmed = tidemark_core::convsync::check(snap, after, epoch).map_err(|r| match r {
        ConvSyncRefusal::CursorAhead { head } => StoreError::CursorAhead(head),
        ConvSyncRefusal::EpochChanged { epoch } => StoreError::EpochChanged(epoch),
    })?;
    let from = after.max(snap.min_seq.saturating_sub(1));
    let sql = format!(
        "SELECT {MSG_COLS} FROM messages m
         WHERE m.conv_id = ?1 AND m.msg_seq > ?3 AND m.msg_seq <= ?4 AND {VISIBLE}
         ORDER BY m.msg_seq LIMIT ?5 + 0"
    );
    let mut stmt = c.prepare_cached(&sql).map_err(internal)?;
    let mut rows: Vec<(StoredMessage, Option<String>)> = stmt
        .query_map(params![conv, user, from as i64, snap.head as i64, limit + 1], |r| message_at(r, 0))
        .map_err(internal)?
        .collect::<Result<_, _>>()
        .map_err(internal)?;
    let has_more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    decorate(c, user, &mut rows)?;
    let last = rows.last().map(|(m, _)| m.msg_seq);
    let next_after = tidemark_core::convsync::next_after(after, snap.head, has_more, last);
    Ok(ConvSyncPage {
        epoch: snap.epoch,
        min_seq: snap.min_seq,
        head: snap.head,
        next_after,
        has_more,
        trimmed,
        events: rows.into_iter().map(|(m, _)| m).collect(),
    })
}

/// `history`: newest first below `before_seq`, inside the reader's periods,
/// so a forged cursor reaches neither before a join nor after a leave (C3).
pub(crate) fn history(
    c: &Connection,
    user: &str,
    conv: &str,
    before: Option<u64>,
    limit: u32,
) -> StoreResult<HistoryPage> {
    in_snapshot(c, || {
        let snap = conv_snapshot(c, conv, user)?;
        // Nothing lies above the head: clamp, so a huge cursor cannot wrap.
        let below = before.unwrap_or(u64::MAX).min(snap.head + 1);
        let sql = format!(
            "SELECT {MSG_COLS} FROM messages m
             WHERE m.conv_id = ?1 AND m.msg_seq < ?3 AND m.msg_seq >= ?4 AND {VISIBLE}
             ORDER BY m.msg_seq DESC LIMIT ?5 + 0"
        );
        let mut stmt = c.prepare_cached(&sql).map_err(internal)?;
        let mut rows: Vec<(StoredMessage, Option<String>)> = stmt
            .query_map(params![conv, user, below as i64, snap.min_seq as i64, limit + 1], |r| message_at(r, 0))
            .map_err(internal)?
            .collect::<Result<_, _>>()
            .map_err(internal)?;
        let has_more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        decorate(c, user, &mut rows)?;
        let next_cursor = if has_more { rows.last().map(|(m, _)| m.msg_seq) } else { None };
        // The reader's view starts at its first join; history below the
        // retention boundary but inside that view was removed: say so (L3).
        let first_join: i64 = c
            .prepare_cached("SELECT MIN(join_seq) FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2")
            .map_err(internal)?
            .query_row(params![conv, user], |r| r.get::<_, Option<i64>>(0))
            .map_err(internal)?
            .unwrap_or(1);
        let trimmed = !has_more && snap.min_seq > (first_join.max(1) as u64);
        Ok(HistoryPage {
            messages: rows.into_iter().map(|(m, _)| m).collect(),
            next_cursor,
            has_more,
            history_start: snap.min_seq,
            trimmed,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> ReadPool {
        ReadPool::new((0..n).map(|_| Connection::open_in_memory().expect("in-memory database")).collect())
    }

    fn one(c: &Connection) -> StoreResult<i64> {
        c.query_row("SELECT 1", [], |r| r.get(0)).map_err(internal)
    }

    /// The one-statement page walks the user log's key in order and stops
    /// at the limit: no sort of the whole range, however far behind.
    #[test]
    fn the_page_statement_reads_the_log_in_key_order() {
        use tidemark_core::cursor::{ClientPosition, RecoveryPolicy};
        let dir = tempfile::tempdir().unwrap();
        let c = Connection::open(dir.path().join("t.db")).unwrap();
        crate::schema::migrate(&c).unwrap();
        let first =
            PageQuery::First { client: ClientPosition::default(), policy: RecoveryPolicy::NO_RECOVERY, now_ms: 0 };
        let next = PageQuery::Next { generation: 1, position: 0, high_watermark: 9, recovery_session: None, now_ms: 0 };
        for q in [first, next] {
            let mut stmt = c.prepare(&format!("EXPLAIN QUERY PLAN {}", page_sql(&q))).unwrap();
            let unbound = vec![Value::Null; stmt.parameter_count()];
            let plan: Vec<String> = stmt
                .query_map(rusqlite::params_from_iter(unbound), |r| r.get::<_, String>(3))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert!(!plan.iter().any(|p| p.contains("TEMP B-TREE")), "{q:?}: {plan:#?}");
            assert!(plan.iter().any(|p| p.contains("SEARCH e USING PRIMARY KEY")), "{q:?}: {plan:#?}");
        }
    }

    /// A cached statement runs again without being compiled again, whatever
    /// is bound to it (a bare `LIMIT ?` made every run a re-prepare).
    #[test]
    fn cached_reads_are_not_compiled_again() {
        use rusqlite::StatementStatus;
        use tidemark_core::cursor::{ClientPosition, RecoveryPolicy};
        let dir = tempfile::tempdir().unwrap();
        let c = Connection::open(dir.path().join("t.db")).unwrap();
        crate::schema::migrate(&c).unwrap();
        let first =
            PageQuery::First { client: ClientPosition::default(), policy: RecoveryPolicy::NO_RECOVERY, now_ms: 0 };
        let next = PageQuery::Next { generation: 1, position: 0, high_watermark: 9, recovery_session: None, now_ms: 0 };
        let user_events_sql = format!(
            "SELECT {EVENT_COLS}, {MSG_COLS}, {DECORATION_COLS} FROM user_events e {EVENT_JOINS}
             WHERE e.user_id = ?1 AND e.sync_seq > ?2 AND e.sync_seq <= ?3 ORDER BY e.sync_seq LIMIT ?4 + 0"
        );
        for sql in [page_sql(&first), page_sql(&next), user_events_sql.as_str()] {
            let mut stmt = c.prepare(sql).unwrap();
            for i in 0..4i64 {
                let mut vals = vec![Value::from(format!("u{i}")), Value::from(format!("d{i}"))];
                // The rest are positions and limits.
                vals.extend((vals.len()..stmt.parameter_count()).map(|k| Value::from(i + k as i64)));
                let mut rows = stmt.query(rusqlite::params_from_iter(vals)).unwrap();
                while rows.next().unwrap().is_some() {}
            }
            assert_eq!(stmt.get_status(StatementStatus::RePrepare), 0, "{sql}");
        }
    }

    #[tokio::test]
    async fn a_panicking_read_is_an_internal_error_and_its_reader_goes_on() {
        let pool = pool(2);
        // More panics than readers: a reader that died with its read would
        // leave the third read unanswered.
        for _ in 0..5 {
            let r = pool.read_store(|_| -> StoreResult<()> { panic!("a read breaks an invariant") }).await;
            assert!(matches!(r, Err(StoreError::Internal(_))), "a panicked read is an internal error: {r:?}");
        }
        assert_eq!(pool.read_store(one).await, Ok(1));
    }

    #[tokio::test]
    async fn a_read_that_panics_inside_its_transaction_leaves_none_open() {
        let pool = pool(1);
        let r = pool
            .read_store(|c| -> StoreResult<()> {
                c.execute_batch("BEGIN").map_err(internal)?;
                one(c)?;
                panic!("between BEGIN and COMMIT")
            })
            .await;
        assert!(r.is_err());
        let autocommit = pool.read_store(|c| Ok(c.is_autocommit())).await;
        assert_eq!(autocommit, Ok(true), "the connection came back outside any transaction");
    }

    /// A pool of one reader over a WAL database `t(x)`, its writer
    /// connection, and a read that holds the reader until released.
    struct Held {
        pool: Arc<ReadPool>,
        writer: Connection,
        release: std::sync::mpsc::Sender<()>,
        _dir: tempfile::TempDir,
    }

    async fn held() -> Held {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let writer = Connection::open(&path).unwrap();
        writer.query_row("PRAGMA journal_mode=WAL", [], |_| Ok(())).unwrap();
        writer.execute_batch("CREATE TABLE t(x INTEGER)").unwrap();
        let reader = Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        let pool = Arc::new(ReadPool::new(vec![reader]));
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        let p = pool.clone();
        tokio::spawn(async move {
            p.read_store(move |_| {
                started_tx.send(()).expect("test alive");
                let _ = release_rx.recv();
                Ok(())
            })
            .await
        });
        tokio::task::spawn_blocking(move || started_rx.recv_timeout(std::time::Duration::from_secs(30)))
            .await
            .unwrap()
            .expect("the holding read started");
        Held { pool, writer, release, _dir: dir }
    }

    /// Polls `read` once: a read is queued by its first poll (it then
    /// waits for its answer), so no scheduler wait is needed to know it is.
    async fn queue<F: std::future::Future + Unpin>(read: &mut F) {
        std::future::poll_fn(|cx| {
            assert!(std::pin::Pin::new(&mut *read).poll(cx).is_pending(), "the reader is held: the read waits");
            std::task::Poll::Ready(())
        })
        .await
    }

    /// What a read saw: whether it ran inside a transaction it did not
    /// open, and the rows of `t`.
    fn seen(c: &Connection) -> StoreResult<(bool, i64)> {
        let count = c.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).map_err(internal)?;
        Ok((!c.is_autocommit(), count))
    }

    /// Reads that queue together run in one read transaction, and each
    /// sees every commit made before it was asked for (an ACK, D4, before
    /// the sync page that follows it, D5): the batch's snapshot is taken
    /// after the queue is drained. A read that runs alone is not batched.
    #[tokio::test]
    async fn reads_that_queue_together_share_a_snapshot_taken_after_the_last_of_them() {
        let h = held().await;
        let mut early = Box::pin(h.pool.read_store(seen));
        queue(&mut early).await;
        h.writer.execute("INSERT INTO t VALUES (1)", []).unwrap();
        let mut late = Box::pin(h.pool.read_store(seen));
        queue(&mut late).await;
        let mut alone = Box::pin(h.pool.read_alone(seen));
        queue(&mut alone).await;
        h.release.send(()).unwrap();
        let (early, late, alone) = (early.await.unwrap(), late.await.unwrap(), alone.await.unwrap());
        assert_eq!(late, (true, 1), "the late read is batched and sees the commit made before it was asked");
        assert_eq!(early, (true, 1), "the early read shares the late one's snapshot");
        assert_eq!(alone, (false, 1), "a read that runs alone is in no batch");
    }

    /// A read whose caller is gone before it starts is not run, and the
    /// reader goes on with the next.
    #[tokio::test]
    async fn a_read_whose_caller_gave_up_is_skipped() {
        let h = held().await;
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = ran.clone();
        let mut cancelled = Box::pin(h.pool.read_store(move |c| {
            r.store(true, std::sync::atomic::Ordering::SeqCst);
            one(c)
        }));
        queue(&mut cancelled).await;
        // The caller gives up while its read waits behind the held one.
        drop(cancelled);
        h.release.send(()).unwrap();
        assert_eq!(h.pool.read_store(one).await, Ok(1));
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst), "the abandoned read did not run");
    }
}
