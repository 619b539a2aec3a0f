//! Reconciliation (O3): the facts `tidemark_core::reconcile` judges, read
//! in one `REPEATABLE READ READ ONLY` snapshot per chunk on a reader (never
//! on a writer), and the two repairs, each a short writer request. SQL
//! only: the job is `tidemark_store::reconcile`.

use std::collections::BTreeSet;

use tidemark_core::kinds::event_kind_of;
use tidemark_core::reconcile::{ConvFacts, DeviceAck, EventFacts, UnreadFacts, UserFacts};
use tidemark_store::*;

use crate::db::{big, col, exec, query, query_one, query_opt, scalar, seq, seq_opt, Conn};
use crate::{events, fanout};

type R<T> = StoreResult<T>;

/// Whether `user`'s log must still hold its event of the message at
/// `msg_seq` in `conv`: not a deleted user's, and either never trimmed or
/// holding a conversation event of `conv` below it (a conversation's
/// events enter a log in `msg_seq` order, so the message's came later and
/// is above the trim point).
const MUST_HOLD: &str = "SELECT NOT EXISTS (SELECT 1 FROM users u WHERE u.user_id = $1 AND u.deleted_at IS NOT NULL)
     AND (COALESCE((SELECT trimmed_upto FROM user_heads WHERE user_id = $1), 0) = 0
          OR EXISTS (SELECT 1 FROM user_events e WHERE e.user_id = $1 AND e.conv_id = $2 AND e.period_id <> 0
                     AND e.msg_seq < $3))";

pub(crate) async fn messages(c: &Conn, after: MessageCursor, limit: u32) -> R<MessageChunk> {
    let (after_conv, after_seq) = after.unwrap_or_default();
    let rows = query(
        c,
        "SELECT conv_id, msg_seq, message_id, sender, kind FROM messages
         WHERE (conv_id, msg_seq) > ($1, $2) ORDER BY conv_id, msg_seq LIMIT $3",
        &[&after_conv, &big(after_seq), &i64::from(limit)],
    )
    .await?;
    let mut chunk = MessageChunk::default();
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else { return Ok(chunk) };
    let (first_conv, last_conv): (String, String) = (col(first, 0)?, col(last, 0)?);
    if rows.len() as u32 == limit {
        chunk.next = Some((last_conv.clone(), seq(last, 1)?));
    }
    let pending: BTreeSet<String> = query(
        c,
        "SELECT source_event_id FROM outbox WHERE conv_id >= $1 AND conv_id <= $2",
        &[&first_conv, &last_conv],
    )
    .await?
    .iter()
    .map(|r| col(r, 0))
    .collect::<R<_>>()?;
    let mut entered = BTreeSet::new();
    for r in &rows {
        let conv: String = col(r, 0)?;
        if conv != after_conv {
            entered.insert(conv);
        }
    }
    for conv in entered {
        let r = query_one(
            c,
            "SELECT c.head, COALESCE((SELECT MAX(msg_seq) FROM messages m WHERE m.conv_id = c.conv_id), 0)
             FROM conversations c WHERE c.conv_id = $1",
            &[&conv],
        )
        .await?;
        chunk.convs.push(ConvFacts { conv, head: seq(&r, 0)?, max_msg_seq: seq(&r, 1)? });
    }
    for r in &rows {
        let (conv, msg_seq, message_id, sender, kind): (String, u64, String, String, String) =
            (col(r, 0)?, seq(r, 1)?, col(r, 2)?, col(r, 3)?, col(r, 4)?);
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
            facts.recipients = fanout::resolve(c, std::slice::from_ref(&item))
                .await?
                .pop()
                .ok_or_else(|| StoreError::Internal("resolve answered no item".into()))?
                .0;
            facts.sender_covered = scalar(
                c,
                "SELECT EXISTS (SELECT 1 FROM membership_periods WHERE conv_id = $1 AND user_id = $2
                 AND join_seq <= $3 AND (leave_seq IS NULL OR leave_seq >= $3))",
                &[&conv, &sender, &big(msg_seq)],
            )
            .await?
            .unwrap_or(false);
            for (user, period) in &facts.recipients.deliver {
                let held: bool = scalar(
                    c,
                    "SELECT EXISTS (SELECT 1 FROM user_events WHERE user_id = $1 AND source_event_id = $2
                     AND period_id = $3)",
                    &[user, &message_id, period],
                )
                .await?
                .unwrap_or(false);
                if !held && scalar::<bool>(c, MUST_HOLD, &[user, &conv, &big(msg_seq)]).await?.unwrap_or(false) {
                    facts.missing.push((user.clone(), *period));
                }
            }
            facts.quarantine_recorded = query(
                c,
                "SELECT user_id FROM fanout_quarantine WHERE source_event_id = $1 ORDER BY user_id",
                &[&message_id],
            )
            .await?
            .iter()
            .map(|r| col(r, 0))
            .collect::<R<_>>()?;
        }
        chunk.messages.push(facts);
    }
    Ok(chunk)
}

pub(crate) async fn users(c: &Conn, after: Option<String>, limit: u32) -> R<UserChunk> {
    let rows = query(
        c,
        "SELECT u.user_id, COALESCE(h.high_watermark, 0) FROM users u
         LEFT JOIN user_heads h ON h.user_id = u.user_id
         WHERE u.user_id > $1 ORDER BY u.user_id LIMIT $2",
        &[&after.unwrap_or_default(), &i64::from(limit)],
    )
    .await?;
    let mut chunk = UserChunk::default();
    if rows.len() as u32 == limit {
        chunk.next = rows.last().map(|r| col(r, 0)).transpose()?;
    }
    for r in &rows {
        let (user, hw): (String, u64) = (col(r, 0)?, seq(r, 1)?);
        let devices = query(
            c,
            "SELECT device_id, acked_sync_seq FROM devices WHERE user_id = $1 AND state <> 'REVOKED' ORDER BY device_id",
            &[&user],
        )
        .await?
        .iter()
        .map(|r| Ok(DeviceAck { device: col(r, 0)?, acked: seq(r, 1)? }))
        .collect::<R<Vec<_>>>()?;
        let mut unread = Vec::new();
        for row in query(
            c,
            "SELECT conv_id, read_seq, unread, mentions FROM user_convs WHERE user_id = $1 ORDER BY conv_id",
            &[&user],
        )
        .await?
        {
            let conv: String = col(&row, 0)?;
            let fact = events::count_unread(c, &user, &conv, seq(&row, 1)?).await?;
            let mentions_fact = events::count_mentions(c, &user, &conv, seq(&row, 1)?).await?;
            unread.push(UnreadFacts {
                conv,
                stored: seq(&row, 2)?,
                fact,
                mentions_stored: seq(&row, 3)?,
                mentions_fact,
            });
        }
        let suspect_events = query(
            c,
            "SELECT e.sync_seq, e.conv_id, e.message_id, e.msg_seq, e.period_id, m.message_id IS NOT NULL,
                    e.period_id = 0 OR p.period_id IS NOT NULL
             FROM user_events e
             LEFT JOIN messages m ON m.message_id = e.message_id
             LEFT JOIN membership_periods p
               ON p.period_id = e.period_id AND p.user_id = e.user_id AND p.conv_id = e.conv_id
             WHERE e.user_id = $1
               AND ((e.message_id IS NOT NULL AND m.message_id IS NULL)
                    OR (e.period_id <> 0 AND p.period_id IS NULL))
             ORDER BY e.sync_seq",
            &[&user],
        )
        .await?
        .iter()
        .map(|r| {
            Ok(EventFacts {
                sync_seq: seq(r, 0)?,
                conv: col(r, 1)?,
                message_id: col(r, 2)?,
                msg_seq: seq_opt(r, 3)?,
                period_id: col(r, 4)?,
                message_exists: col(r, 5)?,
                period_owned: col(r, 6)?,
            })
        })
        .collect::<R<Vec<_>>>()?;
        chunk.users.push(UserFacts { user, high_watermark: hw, devices, unread, suspect_events });
    }
    Ok(chunk)
}

/// The writer side of `Store::requeue_fanout` (on the conversation's
/// writer: the outbox row is conversation data).
pub(crate) async fn requeue_fanout(c: &Conn, conv: &str, message_id: &str, now_ms: i64) -> R<bool> {
    let pending: bool = scalar(
        c,
        "SELECT EXISTS (SELECT 1 FROM outbox WHERE conv_id = $1 AND source_event_id = $2)",
        &[&conv, &message_id],
    )
    .await?
    .unwrap_or(false);
    if pending {
        return Ok(false);
    }
    let Some(row) = query_opt(
        c,
        "SELECT kind, msg_seq, sender FROM messages WHERE conv_id = $1 AND message_id = $2",
        &[&conv, &message_id],
    )
    .await?
    else {
        return Err(StoreError::NotFound(format!("message {message_id}")));
    };
    let (kind, msg_seq, sender): (String, i64, String) = (col(&row, 0)?, col(&row, 1)?, col(&row, 2)?);
    exec(
        c,
        "INSERT INTO outbox (conv_id, kind, source_event_id, msg_seq, actor, created_at) VALUES ($1, $2, $3, $4, $5, $6)",
        &[&conv, &event_kind_of(&kind), &message_id, &msg_seq, &sender, &now_ms],
    )
    .await?;
    Ok(true)
}

/// The writer side of `Store::recount_unread` (on the user-side writer).
pub(crate) async fn recount_unread(c: &Conn, user: &str, conv: &str) -> R<Option<Recounted>> {
    let Some(row) = query_opt(
        c,
        "SELECT unread, mentions FROM user_convs WHERE user_id = $1 AND conv_id = $2 FOR UPDATE",
        &[&user, &conv],
    )
    .await?
    else {
        return Ok(None);
    };
    let before = (seq(&row, 0)?, seq(&row, 1)?);
    let after = events::recount_unread(c, user, conv).await?;
    Ok(Some(Recounted { before, after }))
}

pub(crate) async fn quarantine(c: &Conn, after: Option<(String, String)>, limit: u32) -> R<Vec<QuarantineRecord>> {
    let (source, user) = after.unwrap_or_default();
    query(
        c,
        "SELECT source_event_id, user_id, conv_id, msg_seq, reason, created_at FROM fanout_quarantine
         WHERE (source_event_id, user_id) > ($1, $2) ORDER BY source_event_id, user_id LIMIT $3",
        &[&source, &user, &i64::from(limit)],
    )
    .await?
    .iter()
    .map(|r| {
        Ok(QuarantineRecord {
            source_event_id: col(r, 0)?,
            user: col(r, 1)?,
            conv: col(r, 2)?,
            msg_seq: seq(r, 3)?,
            reason: col(r, 4)?,
            created_at_ms: col(r, 5)?,
        })
    })
    .collect()
}
