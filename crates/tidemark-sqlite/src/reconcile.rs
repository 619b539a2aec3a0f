//! Reconciliation (O3): the facts `tidemark_core::reconcile` judges, read
//! on a read connection in one read transaction per chunk (never in the
//! writer), and the two repairs, each a short writer request. SQL only: the
//! job is `tidemark_store::reconcile`.

use std::collections::BTreeSet;

use rusqlite::{params, Connection, OptionalExtension};
use tidemark_core::kinds::event_kind_of;
use tidemark_core::reconcile::{ConvFacts, DeviceAck, EventFacts, UnreadFacts, UserFacts};
use tidemark_store::*;

use crate::{events, internal};

type R<T> = StoreResult<T>;

/// Runs `f` in one read transaction: the chunk's facts come from one
/// snapshot.
fn in_snapshot<T>(c: &Connection, f: impl FnOnce(&Connection) -> R<T>) -> R<T> {
    c.execute_batch("BEGIN").map_err(internal)?;
    let result = f(c);
    let _ = c.execute_batch("COMMIT");
    result
}

fn one<T: rusqlite::types::FromSql>(c: &Connection, sql: &str, p: impl rusqlite::Params) -> R<T> {
    c.prepare_cached(sql).map_err(internal)?.query_row(p, |r| r.get(0)).map_err(internal)
}

/// Whether `user`'s log must still hold its event of the message at
/// `msg_seq` in `conv`: not a deleted user's, and either never trimmed or
/// holding a conversation event of `conv` below it (a conversation's
/// events enter a log in `msg_seq` order, so the message's came later and
/// is above the trim point).
const MUST_HOLD: &str = "SELECT NOT EXISTS (SELECT 1 FROM users u WHERE u.user_id = ?1 AND u.deleted_at IS NOT NULL)
     AND (COALESCE((SELECT trimmed_upto FROM user_heads WHERE user_id = ?1), 0) = 0
          OR EXISTS (SELECT 1 FROM user_events e WHERE e.user_id = ?1 AND e.conv_id = ?2 AND e.period_id <> 0
                     AND e.msg_seq < ?3))";

pub(crate) fn messages(c: &Connection, after: MessageCursor, limit: u32) -> R<MessageChunk> {
    in_snapshot(c, |c| messages_in(c, after, limit))
}

fn messages_in(c: &Connection, after: MessageCursor, limit: u32) -> R<MessageChunk> {
    let (after_conv, after_seq) = after.unwrap_or_default();
    let rows: Vec<(String, i64, String, String, String)> = {
        let mut stmt = c
            .prepare_cached(
                "SELECT conv_id, msg_seq, message_id, sender, kind FROM messages
                 WHERE (conv_id, msg_seq) > (?1, ?2) ORDER BY conv_id, msg_seq LIMIT ?3",
            )
            .map_err(internal)?;
        let it = stmt
            .query_map(params![after_conv, after_seq as i64, limit], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .map_err(internal)?;
        it.collect::<Result<_, _>>().map_err(internal)?
    };
    let mut chunk = MessageChunk::default();
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else { return Ok(chunk) };
    if rows.len() as u32 == limit {
        chunk.next = Some((last.0.clone(), last.1 as u64));
    }
    // Pending items of the chunk's conversations, read before the logs: an
    // item done after this read has its events committed with its removal.
    let pending: BTreeSet<String> = {
        let mut stmt = c
            .prepare_cached("SELECT source_event_id FROM outbox WHERE conv_id >= ?1 AND conv_id <= ?2")
            .map_err(internal)?;
        let it = stmt.query_map(params![first.0, last.0], |r| r.get(0)).map_err(internal)?;
        it.collect::<Result<_, _>>().map_err(internal)?
    };
    let entered: BTreeSet<&String> = rows.iter().map(|r| &r.0).filter(|conv| **conv != after_conv).collect();
    for conv in entered {
        let (head, max): (i64, i64) = c
            .prepare_cached(
                "SELECT c.head, COALESCE((SELECT MAX(msg_seq) FROM messages m WHERE m.conv_id = c.conv_id), 0)
                 FROM conversations c WHERE c.conv_id = ?1",
            )
            .map_err(internal)?
            .query_row(params![conv], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(internal)?;
        chunk.convs.push(ConvFacts { conv: conv.clone(), head: head as u64, max_msg_seq: max as u64 });
    }
    for (conv, seq, message_id, sender, kind) in rows {
        let msg_seq = seq as u64;
        let pending = pending.contains(&message_id);
        let (mut facts, item) = tidemark_store::reconcile::message_facts(
            conv.clone(),
            msg_seq,
            message_id.clone(),
            sender.clone(),
            kind,
            pending,
        );
        if let Some(item) = item {
            facts.recipients = crate::resolve(c, &item)?.0;
            facts.sender_covered = one(
                c,
                "SELECT EXISTS (SELECT 1 FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2
                 AND join_seq <= ?3 AND (leave_seq IS NULL OR leave_seq >= ?3))",
                params![conv, sender, seq],
            )?;
            for (user, period) in &facts.recipients.deliver {
                let held: bool = one(
                    c,
                    "SELECT EXISTS (SELECT 1 FROM user_events WHERE user_id = ?1 AND source_event_id = ?2
                     AND period_id = ?3)",
                    params![user, message_id, period],
                )?;
                if !held && one::<bool>(c, MUST_HOLD, params![user, conv, seq])? {
                    facts.missing.push((user.clone(), *period));
                }
            }
            let mut stmt = c
                .prepare_cached("SELECT user_id FROM fanout_quarantine WHERE source_event_id = ?1 ORDER BY user_id")
                .map_err(internal)?;
            let it = stmt.query_map(params![message_id], |r| r.get(0)).map_err(internal)?;
            facts.quarantine_recorded = it.collect::<Result<_, _>>().map_err(internal)?;
        }
        chunk.messages.push(facts);
    }
    Ok(chunk)
}

pub(crate) fn users(c: &Connection, after: Option<String>, limit: u32) -> R<UserChunk> {
    in_snapshot(c, |c| users_in(c, after, limit))
}

fn users_in(c: &Connection, after: Option<String>, limit: u32) -> R<UserChunk> {
    let rows: Vec<(String, i64)> = {
        let mut stmt = c
            .prepare_cached(
                "SELECT u.user_id, COALESCE(h.high_watermark, 0) FROM users u
                 LEFT JOIN user_heads h ON h.user_id = u.user_id
                 WHERE u.user_id > ?1 ORDER BY u.user_id LIMIT ?2",
            )
            .map_err(internal)?;
        let it = stmt
            .query_map(params![after.unwrap_or_default(), limit], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(internal)?;
        it.collect::<Result<_, _>>().map_err(internal)?
    };
    let mut chunk = UserChunk::default();
    if rows.len() as u32 == limit {
        chunk.next = rows.last().map(|r| r.0.clone());
    }
    for (user, hw) in rows {
        let devices = {
            let mut stmt = c
                .prepare_cached(
                    "SELECT device_id, acked_sync_seq FROM devices WHERE user_id = ?1 AND state <> 'REVOKED'
                     ORDER BY device_id",
                )
                .map_err(internal)?;
            let it = stmt
                .query_map(params![user], |r| Ok(DeviceAck { device: r.get(0)?, acked: r.get::<_, i64>(1)? as u64 }))
                .map_err(internal)?;
            it.collect::<Result<Vec<_>, _>>().map_err(internal)?
        };
        let rows: Vec<(String, i64, i64, i64)> = {
            let mut stmt = c
                .prepare_cached(
                    "SELECT conv_id, read_seq, unread, mentions FROM user_convs WHERE user_id = ?1 ORDER BY conv_id",
                )
                .map_err(internal)?;
            let it = stmt
                .query_map(params![user], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .map_err(internal)?;
            it.collect::<Result<_, _>>().map_err(internal)?
        };
        let mut unread = Vec::with_capacity(rows.len());
        for (conv, read_seq, stored, mentions_stored) in rows {
            let fact = events::count_unread(c, &user, &conv, read_seq as u64)?;
            let mentions_fact = events::count_mentions(c, &user, &conv, read_seq as u64)?;
            unread.push(UnreadFacts {
                conv,
                stored: stored as u64,
                fact,
                mentions_stored: mentions_stored as u64,
                mentions_fact,
            });
        }
        let suspect_events = {
            let mut stmt = c
                .prepare_cached(
                    "SELECT e.sync_seq, e.conv_id, e.message_id, e.msg_seq, e.period_id, m.message_id IS NOT NULL,
                            e.period_id = 0 OR p.period_id IS NOT NULL
                     FROM user_events e
                     LEFT JOIN messages m ON m.message_id = e.message_id
                     LEFT JOIN membership_periods p
                       ON p.period_id = e.period_id AND p.user_id = e.user_id AND p.conv_id = e.conv_id
                     WHERE e.user_id = ?1
                       AND ((e.message_id IS NOT NULL AND m.message_id IS NULL)
                            OR (e.period_id <> 0 AND p.period_id IS NULL))
                     ORDER BY e.sync_seq",
                )
                .map_err(internal)?;
            let it = stmt
                .query_map(params![user], |r| {
                    Ok(EventFacts {
                        sync_seq: r.get::<_, i64>(0)? as u64,
                        conv: r.get(1)?,
                        message_id: r.get(2)?,
                        msg_seq: r.get::<_, Option<i64>>(3)?.map(|v| v as u64),
                        period_id: r.get(4)?,
                        message_exists: r.get(5)?,
                        period_owned: r.get(6)?,
                    })
                })
                .map_err(internal)?;
            it.collect::<Result<Vec<_>, _>>().map_err(internal)?
        };
        chunk.users.push(UserFacts { user, high_watermark: hw as u64, devices, unread, suspect_events });
    }
    Ok(chunk)
}

/// The writer side of `Store::requeue_fanout`.
pub(crate) fn requeue_fanout(c: &Connection, conv: &str, message_id: &str, now_ms: i64) -> R<bool> {
    let pending: bool = one(
        c,
        "SELECT EXISTS (SELECT 1 FROM outbox WHERE conv_id = ?1 AND source_event_id = ?2)",
        params![conv, message_id],
    )?;
    if pending {
        return Ok(false);
    }
    let row: Option<(String, i64, String)> = c
        .prepare_cached("SELECT kind, msg_seq, sender FROM messages WHERE conv_id = ?1 AND message_id = ?2")
        .map_err(internal)?
        .query_row(params![conv, message_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()
        .map_err(internal)?;
    let Some((kind, seq, sender)) = row else { return Err(StoreError::NotFound(format!("message {message_id}"))) };
    c.prepare_cached(
        "INSERT INTO outbox (kind, source_event_id, conv_id, msg_seq, actor, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )
    .map_err(internal)?
    .execute(params![event_kind_of(&kind), message_id, conv, seq, sender, now_ms])
    .map_err(internal)?;
    Ok(true)
}

/// The writer side of `Store::recount_unread`.
pub(crate) fn recount_unread(c: &Connection, user: &str, conv: &str) -> R<Option<Recounted>> {
    let stored: Option<(i64, i64)> = c
        .prepare_cached("SELECT unread, mentions FROM user_convs WHERE user_id = ?1 AND conv_id = ?2")
        .map_err(internal)?
        .query_row(params![user, conv], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .map_err(internal)?;
    let Some((unread, mentions)) = stored else { return Ok(None) };
    let after = events::recount_unread(c, user, conv)?;
    Ok(Some(Recounted { before: (unread as u64, mentions as u64), after }))
}

pub(crate) fn quarantine(c: &Connection, after: Option<(String, String)>, limit: u32) -> R<Vec<QuarantineRecord>> {
    let (source, user) = after.unwrap_or_default();
    let mut stmt = c
        .prepare_cached(
            "SELECT source_event_id, user_id, conv_id, msg_seq, reason, created_at FROM fanout_quarantine
             WHERE (source_event_id, user_id) > (?1, ?2) ORDER BY source_event_id, user_id LIMIT ?3",
        )
        .map_err(internal)?;
    let it = stmt
        .query_map(params![source, user, limit], |r| {
            Ok(QuarantineRecord {
                source_event_id: r.get(0)?,
                user: r.get(1)?,
                conv: r.get(2)?,
                msg_seq: r.get::<_, i64>(3)? as u64,
                reason: r.get(4)?,
                created_at_ms: r.get(5)?,
            })
        })
        .map_err(internal)?;
    it.collect::<Result<_, _>>().map_err(internal)
}
