//! Reads: a pool of connections used for every read path, and the read
//! paths themselves.
//!
//! A read that takes more than one statement (`conv.sync`, `history`, a
//! user-log page with its messages, a conversation with its members) runs
//! in one `REPEATABLE READ READ ONLY` transaction, so every statement sees
//! the same snapshot (C1); a single-statement read needs none. A sync page
//! reads its facts (device, log bounds, recovery session) and its events
//! in one such transaction, so its trim check and its read agree. Readers
//! never take locks and never wait for the writer. Messages are rendered
//! per reader (deleted-for-me, quote state, reactions) in three set-based
//! statements per page rather than three per message; a user-log page
//! reads the first two as columns of its range read and the reactions
//! only of messages that have any. This module never writes.

use deadpool_postgres::{Object, Pool};
use tidemark_core::convsync::{ConvSnapshot, ConvSyncRefusal};
use tidemark_core::cursor::{DeviceCursor, DeviceState, RecoveryInfo, UserLog};
use tidemark_core::page::{decide_page, PageQuery, SyncFacts};
use tidemark_store::*;
use tokio_postgres::Row;

use crate::db::{self, big, col, query, query_opt, scalar, seq, seq_opt, Conn};
use crate::writer::BoxFut;

type R<T> = StoreResult<T>;

/// Starts a snapshot transaction.
const BEGIN_SNAPSHOT: &str = "START TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY";

pub(crate) struct ReadPool {
    pub(crate) pool: Pool,
}

/// A pooled connection inside a snapshot transaction. If it is dropped
/// before the transaction ended (the caller's future was cancelled, or a
/// read panicked), the connection is detached from the pool and closed, so
/// no one ever gets a connection with a transaction left open.
struct Snapshot {
    conn: Option<Object>,
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            drop(Object::take(conn));
        }
    }
}

impl ReadPool {
    async fn get(&self) -> R<Object> {
        self.pool.get().await.map_err(db::pool_error)
    }

    /// Runs one statement-level read (its own snapshot).
    pub(crate) async fn read<T, F>(&self, f: F) -> R<T>
    where
        F: for<'c> FnOnce(&'c Conn) -> BoxFut<'c, R<T>>,
    {
        let conn = self.get().await?;
        f(&conn).await
    }

    /// Runs `f` in one `REPEATABLE READ READ ONLY` transaction, in two
    /// round trips fewer than its statements and the transaction control
    /// would take one by one (issue 14): `START TRANSACTION` is pipelined
    /// with `f`'s first statement (both are queued on the connection, in
    /// that order, before either answer is awaited), and the `ROLLBACK` is
    /// queued and not awaited ([`db::send_only`]): the connection's next
    /// user queues behind it, so it starts outside any transaction.
    pub(crate) async fn snapshot<T, F>(&self, f: F) -> R<T>
    where
        F: for<'c> FnOnce(&'c Conn) -> BoxFut<'c, R<T>>,
    {
        let mut guard = Snapshot { conn: Some(self.get().await?) };
        let conn = guard.conn.as_ref().ok_or_else(|| StoreError::Internal("snapshot without connection".into()))?;
        // `join!` polls in order: the transaction's start is sent first.
        let (begun, result) = tokio::join!(db::batch(conn, BEGIN_SNAPSHOT), f(conn));
        // Statements that ran without the transaction answer nothing.
        begun.map_err(db::error)?;
        // A read-only transaction has nothing to keep: end it either way.
        // If the ROLLBACK cannot even be queued the connection is gone; the
        // guard then drops it rather than give it back.
        db::send_only(conn, "ROLLBACK").map_err(db::error)?;
        // The transaction is over once the ROLLBACK runs, before anything
        // its next user sends: hand the connection back to the pool.
        drop(guard.conn.take());
        result
    }
}

pub(crate) async fn conversation(c: &Conn, conv: &str) -> R<Option<Conversation>> {
    let Some(row) = query_opt(c, "SELECT kind, head FROM conversations WHERE conv_id = $1", &[&conv]).await? else {
        return Ok(None);
    };
    let (kind, head) = (col(&row, 0)?, seq(&row, 1)?);
    let rows = query(
        c,
        "SELECT user_id FROM membership_periods WHERE conv_id = $1 AND leave_seq IS NULL ORDER BY user_id",
        &[&conv],
    )
    .await?;
    let members = rows.iter().map(|r| col(r, 0)).collect::<R<Vec<String>>>()?;
    Ok(Some(Conversation { conv: conv.into(), kind, members, head }))
}

/// The conversation list's columns: the projection, then what a shared
/// group's marker and unread are computed from (G2).
const LIST_COLS: &str = "uc.conv_id, c.kind, uc.last_msg_seq, uc.read_seq, uc.unread, uc.muted, uc.pinned, uc.active,
        c.mode, c.shared_from, COALESCE(mk.target, 0), COALESCE(mk.version, 0),
        CASE WHEN uc.active THEN NULL ELSE (SELECT MAX(p.leave_seq) FROM membership_periods p
             WHERE p.conv_id = uc.conv_id AND p.user_id = uc.user_id) END,
        COALESCE((SELECT dm.cleared_seq FROM device_markers dm WHERE dm.user_id = uc.user_id
             AND dm.device_id = $2 AND dm.conv_id = uc.conv_id), 0), uc.mentions, uc.push_preview";

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
pub(crate) async fn conv_rows(c: &Conn, user: &str, device: Option<&str>, which: Rows<'_>) -> R<Vec<ConvState>> {
    let from = "FROM user_convs uc JOIN conversations c ON c.conv_id = uc.conv_id
         LEFT JOIN conv_markers mk ON mk.conv_id = uc.conv_id WHERE uc.user_id = $1";
    let rows = match which {
        Rows::All => query(c, &format!("SELECT {LIST_COLS} {from}"), &[&user, &device]).await?,
        Rows::Shared => query(c, &format!("SELECT {LIST_COLS} {from} AND uc.shared"), &[&user, &device]).await?,
        Rows::One(conv) => {
            query(c, &format!("SELECT {LIST_COLS} {from} AND uc.conv_id = $3"), &[&user, &device, &conv]).await?
        }
        Rows::Page { after, limit } => {
            let sql = format!("SELECT {LIST_COLS} {from} AND uc.conv_id > $3 ORDER BY uc.conv_id LIMIT $4");
            query(c, &sql, &[&user, &device, &after, &i64::from(limit)]).await?
        }
    };
    // The dirty list of the sync path reads markers only: no unread count.
    let count_unread = !matches!(which, Rows::Shared);
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let state = ConvState {
            conv: col(r, 0)?,
            kind: col(r, 1)?,
            last_msg_seq: seq(r, 2)?,
            read_seq: seq(r, 3)?,
            unread: seq(r, 4)?,
            mentions: seq(r, 14)?,
            muted: col(r, 5)?,
            pinned: col(r, 6)?,
            active: col(r, 7)?,
            mode: col(r, 8)?,
            marker: None,
            unread_capped: false,
            push_preview: crate::push::preview_col(r, 15)?,
        };
        let (tidemark_core::large::MODE_SHARED, Some(from)) = (state.mode.as_str(), seq_opt(r, 9)?) else {
            out.push(state);
            continue;
        };
        let marker = tidemark_core::large::marker(&tidemark_core::large::MarkerFacts {
            published_target: seq(r, 10)?,
            version: seq(r, 11)?,
            left_at: seq_opt(r, 12)?,
            cleared_seq: seq(r, 13)?,
        });
        // Unread above the switch is counted from the log on read (exact
        // up to the cap, so it cannot drift); the marker alone needs none.
        // Mentions above the switch likewise (issue 18): rows are written
        // for nobody, "everyone" is the message's one flag.
        let (counted, mentioned) =
            match (count_unread, tidemark_core::large::unread_window(state.read_seq, from, marker.target)) {
                (true, Some((above, upto))) => (
                    shared_unread_above(c, user, &state.conv, above, upto, false).await?,
                    shared_unread_above(c, user, &state.conv, above, upto, true).await?,
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
pub(crate) async fn shared_unread_above(
    c: &Conn,
    user: &str,
    conv: &str,
    above: u64,
    upto: u64,
    mentioned: bool,
) -> R<u64> {
    let control = tidemark_core::kinds::CONTROL_KINDS.iter().map(|k| format!("'{k}'")).collect::<Vec<_>>().join(", ");
    let mention = if mentioned { crate::events::MENTIONED.replace("$1", "$2") } else { "TRUE".into() };
    let sql = format!(
        "SELECT COUNT(*) FROM (SELECT 1 FROM messages m
         WHERE m.conv_id = $1 AND m.msg_seq > $3 AND m.msg_seq <= $4 AND m.sender <> $2
           AND m.kind NOT IN ({control}) AND m.state <> '{STATE_RECALLED}'
           AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = $2 AND d.message_id = m.message_id)
           AND {VISIBLE} AND {mention} LIMIT $5) AS unread"
    );
    let row = db::query_one(
        c,
        &sql,
        &[&conv, &user, &big(above), &big(upto), &big(tidemark_core::large::UNREAD_COUNT_MAX + 1)],
    )
    .await?;
    seq(&row, 0)
}

pub(crate) async fn list_conversations(c: &Conn, user: &str, device: Option<&str>) -> R<Vec<ConvState>> {
    let mut rows = conv_rows(c, user, device, Rows::All).await?;
    rows.sort_by(|a, b| b.pinned.cmp(&a.pinned).then(b.last_msg_seq.cmp(&a.last_msg_seq)).then(a.conv.cmp(&b.conv)));
    Ok(rows)
}

/// The shared groups whose marker is dirty for `device` (G2).
pub(crate) async fn dirty_markers(c: &Conn, user: &str, device: &str) -> R<Vec<DeviceMarker>> {
    Ok(conv_rows(c, user, Some(device), Rows::Shared)
        .await?
        .into_iter()
        .filter_map(|s| s.marker.filter(|m| m.dirty).map(|marker| DeviceMarker { conv: s.conv, marker }))
        .collect())
}

/// The active members of `conv` and the msg_seq of its last membership
/// change; the caller runs it in one snapshot.
pub(crate) async fn active_members(c: &Conn, conv: &str) -> R<(u64, Vec<String>)> {
    let Some(row) = query_opt(c, "SELECT members_seq FROM conversations WHERE conv_id = $1", &[&conv]).await? else {
        return Err(StoreError::NotFound(format!("conversation {conv}")));
    };
    let users = query(c, "SELECT user_id FROM membership_periods WHERE conv_id = $1 AND leave_seq IS NULL", &[&conv])
        .await?
        .iter()
        .map(|r| col::<String>(r, 0))
        .collect::<R<Vec<_>>>()?;
    Ok((seq(&row, 0)?, users))
}

/// One `conv.members` page: the conversation, the caller's open period and
/// up to `limit + 1` current members above `after` (the key `UNIQUE
/// (conv_id, user_id, join_seq)` serves the range), decided by
/// `core::membership::members_page`; the caller runs it in one snapshot.
pub(crate) async fn conv_members(c: &Conn, user: &str, conv: &str, after: Option<&str>, limit: u32) -> R<MembersPage> {
    let head = match query_opt(c, "SELECT members_seq, owner FROM conversations WHERE conv_id = $1", &[&conv]).await? {
        Some(row) => Some((seq(&row, 0)?, col::<Option<String>>(&row, 1)?)),
        None => None,
    };
    let caller_active = query_opt(
        c,
        "SELECT 1 FROM membership_periods WHERE conv_id = $1 AND user_id = $2 AND leave_seq IS NULL LIMIT 1",
        &[&conv, &user],
    )
    .await?
    .is_some();
    let rows = query(
        c,
        "SELECT user_id, join_seq FROM membership_periods
         WHERE conv_id = $1 AND leave_seq IS NULL AND user_id > $2 ORDER BY user_id LIMIT $3",
        &[&conv, &after.unwrap_or(""), &(i64::from(limit) + 1)],
    )
    .await?
    .iter()
    .map(|r| Ok((col::<String>(r, 0)?, seq(r, 1)?)))
    .collect::<R<Vec<_>>>()?;
    let facts = tidemark_core::membership::MembersFacts { conv: head, caller_active, rows };
    Ok(tidemark_core::membership::members_page(conv, facts, limit as usize)?)
}

pub(crate) async fn pending_outbox(c: &Conn, limit: u32) -> R<Vec<OutboxItem>> {
    let rows = query(
        c,
        "SELECT outbox_id, kind, source_event_id, conv_id, msg_seq, actor, created_at
         FROM outbox ORDER BY outbox_id LIMIT $1",
        &[&i64::from(limit)],
    )
    .await?;
    rows.iter().map(outbox_item).collect()
}

/// One outbox row selected as `outbox_id, kind, source_event_id, conv_id,
/// msg_seq, actor, created_at`.
pub(crate) fn outbox_item(r: &Row) -> R<OutboxItem> {
    Ok(OutboxItem {
        outbox_id: col(r, 0)?,
        kind: col(r, 1)?,
        source_event_id: col(r, 2)?,
        conv: col(r, 3)?,
        msg_seq: seq(r, 4)?,
        actor: col(r, 5)?,
        created_at_ms: col(r, 6)?,
    })
}

pub(crate) async fn outbox_stats(c: &Conn) -> R<OutboxStats> {
    let row = db::query_one(c, "SELECT COUNT(*), MIN(created_at) FROM outbox", &[]).await?;
    Ok(OutboxStats { backlog: seq(&row, 0)?, oldest_created_at_ms: col(&row, 1)? })
}

/// `Store::gauges`: one statement of aggregates, at scrape time.
pub(crate) async fn gauges(c: &Conn, now_ms: i64) -> R<StoreGauges> {
    let r = db::query_one(
        c,
        "SELECT
     (SELECT COUNT(*) FROM outbox),
     (SELECT MIN(created_at) FROM outbox),
     (SELECT COALESCE(MAX(high_watermark), 0) FROM user_heads),
     (SELECT COALESCE(MAX(high_watermark - trimmed_upto), 0) FROM user_heads),
     (SELECT COALESCE(MAX(h.high_watermark - d.acked_sync_seq), 0) FROM devices d
        JOIN user_heads h ON h.user_id = d.user_id WHERE d.state <> 'REVOKED'),
     (SELECT COUNT(*) FROM devices d JOIN user_heads h ON h.user_id = d.user_id
        WHERE d.state <> 'REVOKED' AND d.acked_sync_seq < h.trimmed_upto),
     (SELECT COUNT(*) FROM recovery_sessions WHERE state = 'ACTIVE' AND expires_at > $1),
     (SELECT MIN(created_at) FROM recovery_sessions WHERE state = 'ACTIVE' AND expires_at > $1),
     (SELECT COUNT(*) FROM snapshots WHERE state IN ('BUILDING', 'READY') AND expires_at > $1),
     (SELECT MIN(created_at) FROM snapshots WHERE state IN ('BUILDING', 'READY') AND expires_at > $1),
     (SELECT COUNT(*) FROM push_targets t
        JOIN devices d ON d.user_id = t.user_id AND d.device_id = t.device_id
        JOIN user_heads h ON h.user_id = t.user_id
        WHERE d.state <> 'REVOKED' AND h.high_watermark > GREATEST(t.pushed_through, d.acked_sync_seq))",
        &[&now_ms],
    )
    .await?;
    // A difference is below zero only on drifted data (an ACK above its
    // head, which reconciliation reports); the gauge shows it as zero.
    let n = |i: usize| col::<i64>(&r, i).map(|v| v.max(0) as u64);
    Ok(StoreGauges {
        outbox: OutboxStats { backlog: n(0)?, oldest_created_at_ms: col(&r, 1)? },
        user_high_watermark_max: n(2)?,
        retained_events_max: n(3)?,
        cursor_lag_events_max: n(4)?,
        devices_below_trim: n(5)?,
        recovery_sessions: n(6)?,
        recovery_oldest_created_at_ms: col(&r, 7)?,
        snapshot_sessions: n(8)?,
        snapshot_oldest_created_at_ms: col(&r, 9)?,
        push_targets_owing: n(10)?,
    })
}

pub(crate) async fn user_high_watermark(c: &Conn, user: &str) -> R<u64> {
    let hw: Option<i64> = scalar(c, "SELECT high_watermark FROM user_heads WHERE user_id = $1", &[&user]).await?;
    Ok(hw.unwrap_or(0) as u64)
}

/// Columns of a message row, in the order [`message_at`] reads them.
pub(crate) const MSG_COLS: &str = "m.message_id, m.conv_id, m.msg_seq, m.kind, m.state, m.sender, m.content,
     m.created_at, m.version, m.quote_id, m.mentions, m.mention_all";
/// How many columns [`MSG_COLS`] has.
const MSG_COLS_N: usize = 12;

/// Reads a message from `MSG_COLS` starting at column `at`; the quote id
/// comes back beside it for [`decorate`].
pub(crate) fn message_at(r: &Row, at: usize) -> R<(StoredMessage, Option<String>)> {
    Ok((
        StoredMessage {
            message_id: col(r, at)?,
            conv: col(r, at + 1)?,
            msg_seq: seq(r, at + 2)?,
            kind: col(r, at + 3)?,
            state: col(r, at + 4)?,
            sender: col(r, at + 5)?,
            content: col(r, at + 6)?,
            created_at_ms: col(r, at + 7)?,
            version: seq(r, at + 8)?,
            quote: None,
            reactions: Vec::new(),
            mentions: col::<Option<Vec<String>>>(r, at + 10)?.unwrap_or_default(),
            mention_all: col(r, at + 11)?,
        },
        col(r, at + 9)?,
    ))
}

/// Renders messages for one reader: deleted-for-me becomes a placeholder,
/// a quote says whether its target was recalled, reactions are attached.
/// Recalled content is already wiped in storage.
pub(crate) async fn decorate(c: &Conn, reader: &str, msgs: &mut [(StoredMessage, Option<String>)]) -> R<()> {
    if msgs.is_empty() {
        return Ok(());
    }
    let mut d = Decorations::default();
    let ids: Vec<String> = msgs.iter().map(|(m, _)| m.message_id.clone()).collect();
    let rows =
        query(c, "SELECT message_id FROM user_deleted WHERE user_id = $1 AND message_id = ANY($2)", &[&reader, &ids])
            .await?;
    d.deleted = rows.iter().map(|r| col::<String>(r, 0)).collect::<R<_>>()?;

    let quoted: Vec<String> = msgs.iter().filter_map(|(_, q)| q.clone()).collect();
    if !quoted.is_empty() {
        let rows = query(c, "SELECT message_id, state FROM messages WHERE message_id = ANY($1)", &[&quoted]).await?;
        d.quote_states = rows.iter().map(|r| Ok((col(r, 0)?, col(r, 1)?))).collect::<R<_>>()?;
    }

    let convs: Vec<String> = msgs.iter().map(|(m, _)| m.conv.clone()).collect();
    add_reactions(c, &mut d, &convs, &ids).await?;
    d.apply(msgs);
    Ok(())
}

/// The reactions of the messages `(convs[i], ids[i])`, in one statement.
async fn add_reactions(c: &Conn, d: &mut Decorations, convs: &[String], ids: &[String]) -> R<()> {
    let rows = query(
        c,
        "SELECT message_id, reaction, user_id FROM reactions
         WHERE (conv_id, message_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))
         ORDER BY message_id, reaction, user_id",
        &[&convs, &ids],
    )
    .await?;
    for r in &rows {
        d.add_reaction(col(r, 0)?, col(r, 1)?, col(r, 2)?);
    }
    Ok(())
}

/// The facts a sync page is decided from, in one statement: the device's
/// cursor, the user's log bounds, the device's open recovery session.
pub(crate) async fn sync_facts(c: &Conn, user: &str, device: &str) -> R<Option<SyncFacts>> {
    Ok(facts_and_shared(c, user, device).await?.map(|(facts, _)| facts))
}

/// [`sync_facts`] and whether the user has a shared group (G2), in one
/// statement: the batch's last page reads the dirty markers only then.
async fn facts_and_shared(c: &Conn, user: &str, device: &str) -> R<Option<(SyncFacts, bool)>> {
    let row = query_opt(
        c,
        "SELECT d.sync_generation, d.acked_sync_seq, d.state, h.high_watermark, h.trimmed_upto,
                s.session_id, s.resume_from, s.high_watermark, s.expires_at,
                EXISTS (SELECT 1 FROM user_convs g WHERE g.user_id = d.user_id AND g.shared)
         FROM devices d
         LEFT JOIN user_heads h ON h.user_id = d.user_id
         LEFT JOIN recovery_sessions s ON s.user_id = d.user_id AND s.device_id = d.device_id AND s.state = 'ACTIVE'
         WHERE d.user_id = $1 AND d.device_id = $2",
        &[&user, &device],
    )
    .await?;
    let Some(r) = row else { return Ok(None) };
    let state: String = col(&r, 2)?;
    let state = DeviceState::parse(&state).ok_or_else(|| StoreError::Internal(format!("bad device state {state}")))?;
    let device = DeviceCursor { generation: seq(&r, 0)?, acked_sync_seq: seq(&r, 1)?, state };
    let log = UserLog { high_watermark: seq_opt(&r, 3)?.unwrap_or(0), trimmed_upto: seq_opt(&r, 4)?.unwrap_or(0) };
    let session = match col::<Option<String>>(&r, 5)? {
        None => None,
        Some(session_id) => Some(RecoveryInfo {
            session_id,
            resume_from: seq(&r, 6)?,
            high_watermark: seq(&r, 7)?,
            expires_at_ms: col(&r, 8)?,
        }),
    };
    Ok(Some((SyncFacts { device, log, session }, col(&r, 9)?)))
}

/// A sync page: the facts, the core's decision on them, and the range it
/// names. The caller runs it in one snapshot (D2, D6, L2).
pub(crate) async fn sync_page(
    c: &Conn,
    user: &str,
    device: &str,
    query: &PageQuery,
    limit: u32,
) -> R<Option<SyncRead>> {
    let Some((facts, shared_groups)) = facts_and_shared(c, user, device).await? else {
        return Ok(None);
    };
    let decision = decide_page(&facts, query);
    let events = match decision.range(&facts) {
        Some((after, upto)) => user_events(c, user, after, upto, limit).await?,
        None => Vec::new(),
    };
    Ok(Some(SyncRead { facts, decision, events, shared_groups }))
}

/// The columns [`user_events`] reads after the event's and the message's:
/// whether the reader deleted the message for itself, the state of the
/// message it quotes, whether it has reactions. So a page is one statement
/// (plus one for the reactions of the messages that have any).
const DECORATION_COLS: &str =
    "EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = $1 AND d.message_id = m.message_id),
     q.state, EXISTS (SELECT 1 FROM reactions r WHERE r.conv_id = m.conv_id AND r.message_id = m.message_id)";

pub(crate) async fn user_events(c: &Conn, user: &str, after: u64, upto: u64, limit: u32) -> R<Vec<StoredEvent>> {
    let sql = format!(
        "SELECT e.sync_seq, e.kind, e.conv_id, e.msg_seq, e.data, {MSG_COLS}, {DECORATION_COLS}
         FROM user_events e LEFT JOIN messages m ON m.conv_id = e.conv_id AND m.message_id = e.message_id
         LEFT JOIN messages q ON q.message_id = m.quote_id
         WHERE e.user_id = $1 AND e.sync_seq > $2 AND e.sync_seq <= $3
         ORDER BY e.sync_seq LIMIT $4"
    );
    let rows = query(c, &sql, &[&user, &big(after), &big(upto), &i64::from(limit)]).await?;
    let mut events = Vec::with_capacity(rows.len());
    let mut messages = Vec::new();
    let mut d = Decorations::default();
    let (mut reacted_convs, mut reacted) = (Vec::new(), Vec::new());
    for r in &rows {
        let event = StoredEvent {
            sync_seq: seq(r, 0)?,
            kind: col(r, 1)?,
            conv: col(r, 2)?,
            msg_seq: seq_opt(r, 3)?,
            message: None,
            data: col(r, 4)?,
        };
        if col::<Option<String>>(r, 5)?.is_some() {
            let m = message_at(r, 5)?;
            let at = 5 + MSG_COLS_N;
            if col::<bool>(r, at)? {
                d.deleted.insert(m.0.message_id.clone());
            }
            if let (Some(q), Some(state)) = (&m.1, col::<Option<String>>(r, at + 1)?) {
                d.quote_states.insert(q.clone(), state);
            }
            if col::<bool>(r, at + 2)? {
                reacted_convs.push(m.0.conv.clone());
                reacted.push(m.0.message_id.clone());
            }
            messages.push((events.len(), m));
        }
        events.push(event);
    }
    if !reacted.is_empty() {
        add_reactions(c, &mut d, &reacted_convs, &reacted).await?;
    }
    let (slots, mut rendered): (Vec<usize>, Vec<_>) = messages.into_iter().unzip();
    d.apply(&mut rendered);
    for (slot, (m, _)) in slots.into_iter().zip(rendered) {
        events[slot].message = Some(m);
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

/// The reader's membership periods cover `m.msg_seq` (G1). A control event
/// is visible only to who could see its target too, so a newcomer never
/// reads an edit of a message from before its join.
pub(crate) const VISIBLE: &str =
    "EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = $2
     AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))
     AND (m.target_id IS NULL OR EXISTS (SELECT 1 FROM messages t JOIN membership_periods p2
          ON p2.conv_id = t.conv_id AND p2.user_id = $2 AND p2.join_seq <= t.msg_seq
             AND (p2.leave_seq IS NULL OR t.msg_seq <= p2.leave_seq)
          WHERE t.conv_id = m.conv_id AND t.message_id = m.target_id))";

async fn conv_snapshot(c: &Conn, conv: &str, user: &str) -> R<ConvSnapshot> {
    let row = query_opt(c, "SELECT head, min_seq, epoch FROM conversations WHERE conv_id = $1", &[&conv]).await?;
    let Some(row) = row else {
        return Err(StoreError::NotFound(format!("conversation {conv}")));
    };
    let ever: Option<i32> =
        scalar(c, "SELECT 1 FROM membership_periods WHERE conv_id = $1 AND user_id = $2 LIMIT 1", &[&conv, &user])
            .await?;
    if ever.is_none() {
        return Err(StoreError::NotMember);
    }
    Ok(ConvSnapshot { head: seq(&row, 0)?, min_seq: seq(&row, 1)?, epoch: seq(&row, 2)? })
}

/// `conv.sync` (C1–C2): the caller runs it in one snapshot, so head,
/// min_seq, epoch, periods and events agree.
pub(crate) async fn conv_sync(
    c: &Conn,
    user: &str,
    conv: &str,
    after: u64,
    limit: u32,
    epoch: Option<u64>,
) -> R<ConvSyncPage> {
    let snap = conv_snapshot(c, conv, user).await?;
    let trimmed = tidemark_core::convsync::check(snap, after, epoch).map_err(|r| match r {
        ConvSyncRefusal::CursorAhead { head } => StoreError::CursorAhead(head),
        ConvSyncRefusal::EpochChanged { epoch } => StoreError::EpochChanged(epoch),
    })?;
    let from = after.max(snap.min_seq.saturating_sub(1));
    let sql = format!(
        "SELECT {MSG_COLS} FROM messages m
         WHERE m.conv_id = $1 AND m.msg_seq > $3 AND m.msg_seq <= $4 AND {VISIBLE}
         ORDER BY m.msg_seq LIMIT $5"
    );
    let rows = query(c, &sql, &[&conv, &user, &big(from), &big(snap.head), &(i64::from(limit) + 1)]).await?;
    let mut page = rows.iter().map(|r| message_at(r, 0)).collect::<R<Vec<_>>>()?;
    let has_more = page.len() > limit as usize;
    page.truncate(limit as usize);
    decorate(c, user, &mut page).await?;
    let last = page.last().map(|(m, _)| m.msg_seq);
    let next_after = tidemark_core::convsync::next_after(after, snap.head, has_more, last);
    Ok(ConvSyncPage {
        epoch: snap.epoch,
        min_seq: snap.min_seq,
        head: snap.head,
        next_after,
        has_more,
        trimmed,
        events: page.into_iter().map(|(m, _)| m).collect(),
    })
}

/// `history` (C3): newest first below `before_seq`, inside the reader's
/// periods, so a forged cursor reaches neither before a join nor after a
/// leave. The caller runs it in one snapshot.
pub(crate) async fn history(c: &Conn, user: &str, conv: &str, before: Option<u64>, limit: u32) -> R<HistoryPage> {
    let snap = conv_snapshot(c, conv, user).await?;
    let below = before.unwrap_or(snap.head + 1);
    let sql = format!(
        "SELECT {MSG_COLS} FROM messages m
         WHERE m.conv_id = $1 AND m.msg_seq < $3 AND m.msg_seq >= $4 AND {VISIBLE}
         ORDER BY m.msg_seq DESC LIMIT $5"
    );
    let rows = query(c, &sql, &[&conv, &user, &big(below), &big(snap.min_seq), &(i64::from(limit) + 1)]).await?;
    let mut page = rows.iter().map(|r| message_at(r, 0)).collect::<R<Vec<_>>>()?;
    let has_more = page.len() > limit as usize;
    page.truncate(limit as usize);
    decorate(c, user, &mut page).await?;
    let next_cursor = if has_more { page.last().map(|(m, _)| m.msg_seq) } else { None };
    // The reader's view starts at its first join; history below the
    // retention boundary but inside that view was removed: say so (L3).
    let first_join: Option<i64> = crate::db::scalar::<Option<i64>>(
        c,
        "SELECT MIN(join_seq) FROM membership_periods WHERE conv_id = $1 AND user_id = $2",
        &[&conv, &user],
    )
    .await?
    .flatten();
    let trimmed = !has_more && snap.min_seq > (first_join.unwrap_or(1).max(1) as u64);
    Ok(HistoryPage {
        messages: page.into_iter().map(|(m, _)| m).collect(),
        next_cursor,
        has_more,
        history_start: snap.min_seq,
        trimmed,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A snapshot's statements all run inside its transaction, though its
    /// start is pipelined with the first of them, and the connection's next
    /// user finds no transaction left, though the `ROLLBACK` was not
    /// awaited: on a pool of one connection, the snapshot's first statement
    /// already runs at `REPEATABLE READ`, a write committed between its two
    /// reads is invisible to the second, and the read after it sees the
    /// write at the default isolation.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_pipelines_its_start_and_leaves_no_transaction_behind() {
        let Some(url) = db::testing::url_or_skip() else { return };
        let cfg: tokio_postgres::Config = url.parse().unwrap();
        let raw = Arc::new(db::testing::connect(&cfg).await);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let table = format!("t_snapshot_{}_{nanos}", std::process::id());
        raw.batch_execute(&format!("CREATE TABLE {table} (v BIGINT); INSERT INTO {table} VALUES (1)")).await.unwrap();
        let readers = ReadPool { pool: crate::pool(cfg, 1).unwrap() };

        for round in 0..3i64 {
            let (t, writer) = (table.clone(), raw.clone());
            let (isolation, first, second) = readers
                .snapshot(move |c| {
                    Box::pin(async move {
                        let isolation: String =
                            scalar(c, "SELECT current_setting('transaction_isolation')", &[]).await?.unwrap();
                        let first: i64 = scalar(c, &format!("SELECT v FROM {t}"), &[]).await?.unwrap();
                        writer.batch_execute(&format!("UPDATE {t} SET v = v + 1")).await.unwrap();
                        let second: i64 = scalar(c, &format!("SELECT v FROM {t}"), &[]).await?.unwrap();
                        Ok((isolation, first, second))
                    })
                })
                .await
                .unwrap();
            assert_eq!(isolation, "repeatable read", "round {round}: the first statement ran outside the snapshot");
            assert_eq!((first, second), (1 + round, 1 + round), "round {round}: the snapshot saw a later commit");

            let t = table.clone();
            let (isolation, now) = readers
                .read(move |c| {
                    Box::pin(async move {
                        let row =
                            query_opt(c, &format!("SELECT current_setting('transaction_isolation'), v FROM {t}"), &[])
                                .await?
                                .unwrap();
                        Ok((col::<String>(&row, 0)?, col::<i64>(&row, 1)?))
                    })
                })
                .await
                .unwrap();
            assert_eq!(isolation, "read committed", "round {round}: the snapshot's transaction was left open");
            assert_eq!(now, 2 + round, "round {round}: the read after the snapshot missed the commit");
        }
        raw.batch_execute(&format!("DROP TABLE {table}")).await.unwrap();
    }
}
