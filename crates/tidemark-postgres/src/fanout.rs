//! The fan-out transaction (F2–F4, R3): outbox items become user events.
//!
//! It runs in three steps inside one writer request:
//!
//! 1. resolve every item's recipients from the membership periods covering
//!    its `msg_seq` (F4), plus, for a recall, whoever could see the original
//!    (E1). Reads only: the periods covering a committed `msg_seq` never
//!    change (a later leave closes a period at a higher seq, a later join
//!    opens one above), so no conversation lock is needed;
//! 2. lock the head row of every recipient in `user_id` order, so two
//!    fan-outs (on two nodes) touching the same users queue up instead of
//!    deadlocking;
//! 3. per item and recipient, skip what the log already holds (F3), else
//!    append the event at `head + 1` and move the projections in the same
//!    statement; then remove the outbox row.
//!
//! The idempotency key `UNIQUE (user_id, source_event_id, period_id)` is the
//! last line of defence: if two writers ever delivered the same item at
//! once, the second fails on it and rolls back instead of exposing a
//! duplicate. This module knows nothing about the queue or the readers.

use std::collections::BTreeMap;

use tidemark_core::large::{self, Route};
use tidemark_core::membership::{control_recipients, recipients_at, Period, Recipients};
use tidemark_core::SyncSeq;
use tidemark_core::{mention, projection};
use tidemark_store::*;

use crate::db::{big, col, exec, query, query_one, seq, seq_opt, Conn};
use crate::events;

type R<T> = StoreResult<T>;

async fn periods_covering(c: &Conn, conv: &str, at: u64) -> R<Vec<Period>> {
    let rows = query(
        c,
        "SELECT period_id, user_id, join_seq, leave_seq FROM membership_periods
         WHERE conv_id = $1 AND join_seq <= $2 AND (leave_seq IS NULL OR leave_seq >= $2)",
        &[&conv, &big(at)],
    )
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Period { period_id: col(r, 0)?, user: col(r, 1)?, join_seq: seq(r, 2)?, leave_seq: seq_opt(r, 3)? })
        })
        .collect()
}

/// The recipients of one item (F4, E1, G2): the periods covering its
/// `msg_seq` and, for a control event, those covering its target's, as
/// `control_recipients` combines them; in a shared group, as
/// `large::route` decides (nobody, or the subject of a membership change).
pub(crate) async fn resolve(c: &Conn, item: &OutboxItem) -> R<(Recipients, Route, FannedOut, Mentions)> {
    let source = query_one(
        c,
        "SELECT s.kind, t.msg_seq, cv.mode, cv.shared_from, cv.kind, s.mentions, s.mention_all FROM messages s
         JOIN conversations cv ON cv.conv_id = s.conv_id
         LEFT JOIN messages t ON t.conv_id = s.conv_id AND t.message_id = s.target_id
         WHERE s.conv_id = $1 AND s.message_id = $2",
        &[&item.conv, &item.source_event_id],
    )
    .await?;
    let kind: String = col(&source, 0)?;
    let target_seq = seq_opt(&source, 1)?;
    let mode: String = col(&source, 2)?;
    let route = large::route(&mode, seq_opt(&source, 3)?, item.msg_seq, &kind);
    let conv_kind: String = col(&source, 4)?;
    let mentions =
        Mentions { named: col::<Option<Vec<String>>>(&source, 5)?.unwrap_or_default(), all: col(&source, 6)? };
    let mut seen = FannedOut {
        source_event_id: item.source_event_id.clone(),
        class: large::fanout_class(&conv_kind, route),
        ..Default::default()
    };
    let periods = match route {
        Route::Shared => return Ok((Recipients::default(), route, seen, mentions)),
        Route::PerMember => periods_covering(c, &item.conv, item.msg_seq).await?,
        // The period the change opened or closed at this msg_seq.
        Route::Subject => periods_covering(c, &item.conv, item.msg_seq)
            .await?
            .into_iter()
            .filter(|p| p.join_seq == item.msg_seq || p.leave_seq == Some(item.msg_seq))
            .collect(),
    };
    seen.period_miss = large::period_miss(route, periods.len());
    let at_event = recipients_at(&periods, item.msg_seq);
    let holders = match target_seq {
        Some(t) => Some(recipients_at(&periods_covering(c, &item.conv, t).await?, t)),
        None => None,
    };
    Ok((control_recipients(at_event, holders, &kind), route, seen, mentions))
}

/// What a fanned-out message mentions (issue 18), as stored with it.
#[derive(Debug, Default)]
pub(crate) struct Mentions {
    named: Vec<String>,
    all: bool,
}

/// Publishes the marker of a shared group this batch moved up to
/// `max_seq` (`large::publish`), in `conv_markers`, never in the
/// `conversations` row a send locks.
async fn publish_marker(c: &Conn, conv: &str, max_seq: u64) -> R<ConvMoved> {
    let was = query(c, "SELECT target, version FROM conv_markers WHERE conv_id = $1 FOR UPDATE", &[&conv]).await?;
    let (was_target, was_version) = match was.first() {
        Some(r) => (seq(r, 0)?, seq(r, 1)?),
        None => (0, 0),
    };
    let (target, version) = large::publish(was_target, was_version, max_seq);
    exec(
        c,
        "INSERT INTO conv_markers (conv_id, target, version) VALUES ($1, $2, $3)
         ON CONFLICT (conv_id) DO UPDATE SET target = excluded.target, version = excluded.version",
        &[&conv, &big(target), &big(version)],
    )
    .await?;
    let row = query_one(c, "SELECT members_seq FROM conversations WHERE conv_id = $1", &[&conv]).await?;
    Ok(ConvMoved { conv: conv.to_owned(), target, version, members_seq: seq(&row, 0)? })
}

/// Locks the head rows of `users` in `user_id` order, creating missing ones
/// at 0 (step 2).
async fn lock_heads(c: &Conn, users: &[String]) -> R<()> {
    if users.is_empty() {
        return Ok(());
    }
    exec(
        c,
        "INSERT INTO user_heads (user_id, high_watermark)
         SELECT u, 0 FROM unnest($1::text[]) AS t(u) ORDER BY u COLLATE \"C\"
         ON CONFLICT (user_id) DO NOTHING",
        &[&users],
    )
    .await?;
    query(c, "SELECT user_id FROM user_heads WHERE user_id = ANY($1) ORDER BY user_id FOR UPDATE", &[&users]).await?;
    Ok(())
}

/// Appends one conversation event to one user's log and moves the user's
/// projection, in one statement, as `projection::delivery` decided; returns
/// the new `sync_seq`. Every event moves `last_msg_seq`; unread moves only
/// for a message from someone else above the read cursor and above
/// `last_msg_seq` (what the row counts already: a late delivery, such as a
/// fan-out re-enqueued by reconciliation, was counted when the row moved
/// past it) that the user did not delete for themselves; the user's own
/// event moves the read cursor (R3). Mentions move with unread, under the
/// same conditions, where `mention::counts` said so (`$10`, issue 18).
const DELIVER: &str = "WITH h AS (
         INSERT INTO user_heads AS h (user_id, high_watermark) VALUES ($1, 1)
         ON CONFLICT (user_id) DO UPDATE SET high_watermark = h.high_watermark + 1
         RETURNING high_watermark),
     e AS (
         INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id,
                                  created_at)
         SELECT $1, h.high_watermark, $2, $3, $4, $5, $5, $6, $7 FROM h
         RETURNING sync_seq),
     p AS (
         INSERT INTO user_convs AS uc (user_id, conv_id, last_msg_seq, read_seq, unread, mentions)
         VALUES ($1, $3, $4, CASE WHEN $8 THEN $4 ELSE 0 END, CASE WHEN $9 THEN 1 ELSE 0 END,
                 CASE WHEN $10 THEN 1 ELSE 0 END)
         ON CONFLICT (user_id, conv_id) DO UPDATE SET
             last_msg_seq = GREATEST(uc.last_msg_seq, $4),
             read_seq = CASE WHEN $8 THEN GREATEST(uc.read_seq, $4) ELSE uc.read_seq END,
             unread = uc.unread + CASE WHEN $9 AND $4 > uc.read_seq AND $4 > uc.last_msg_seq
                 AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = $1 AND d.message_id = $5)
                 THEN 1 ELSE 0 END,
             mentions = uc.mentions + CASE WHEN $10 AND $4 > uc.read_seq AND $4 > uc.last_msg_seq
                 AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = $1 AND d.message_id = $5)
                 THEN 1 ELSE 0 END)
     SELECT sync_seq FROM e";

/// Claims up to `limit` pending outbox items for this transaction, oldest
/// first, skipping what another transaction (another node's relay) holds.
///
/// Two locks, both held until COMMIT and released by a rollback or a dead
/// session, so a node killed mid-fan-out leaves its items to the next claim:
///
/// - the item rows, `FOR UPDATE SKIP LOCKED`: no two claims take one item;
/// - a transaction-scoped advisory lock per conversation (keyed by the
///   schema and the conversation id), taken in the `WHERE` clause so a
///   conversation another claim is working on is skipped whole. Without it,
///   a second node could take a conversation's newer items while the first
///   still fans out its older ones, and a user's log could hold them out of
///   `msg_seq` order. A hash collision only serialises two conversations.
///
/// The scan walks `outbox_in_order` and stops at `limit`, so only the
/// conversations of the rows it returns (and of rows skipped as locked)
/// stay locked.
pub(crate) async fn claim(c: &Conn, limit: u32) -> R<Vec<OutboxItem>> {
    let rows = query(
        c,
        "SELECT outbox_id, kind, source_event_id, conv_id, msg_seq, actor, created_at FROM outbox
         WHERE pg_try_advisory_xact_lock(hashtext(current_schema()), hashtext(conv_id))
         ORDER BY outbox_id LIMIT $1
         FOR UPDATE SKIP LOCKED",
        &[&i64::from(limit)],
    )
    .await?;
    rows.iter().map(crate::read::outbox_item).collect()
}

pub(crate) async fn fan_out(c: &Conn, items: &[OutboxItem], now_ms: i64) -> R<FanoutReport> {
    let mut plans = Vec::with_capacity(items.len());
    // Shared groups this batch moved, with their highest msg_seq: one
    // marker publication each, whatever the number of items (G2).
    let mut moved: BTreeMap<String, u64> = BTreeMap::new();
    for item in items {
        let (recipients, route, mut seen, mentions) = resolve(c, item).await?;
        if route != Route::PerMember {
            let seq = moved.entry(item.conv.clone()).or_default();
            *seq = (*seq).max(item.msg_seq);
        }
        seen.recipients = recipients.deliver.len() as u64;
        plans.push((recipients, seen, mentions));
    }
    let mut users: Vec<String> = plans.iter().flat_map(|(r, _, _)| r.deliver.iter().map(|(u, _)| u.clone())).collect();
    users.sort();
    users.dedup();
    lock_heads(c, &users).await?;

    let mut report = FanoutReport::default();
    let mut touched: BTreeMap<String, SyncSeq> = BTreeMap::new();
    for (item, (recipients, mut seen, mentions)) in items.iter().zip(plans) {
        for user in &recipients.quarantined {
            exec(
                c,
                "INSERT INTO fanout_quarantine (user_id, source_event_id, conv_id, msg_seq, reason, created_at)
                 VALUES ($1, $2, $3, $4, 'overlapping_membership_periods', $5)
                 ON CONFLICT DO NOTHING",
                &[&user, &item.source_event_id, &item.conv, &big(item.msg_seq), &now_ms],
            )
            .await?;
            report.quarantined += 1;
            tracing::error!(source_event_id = %item.source_event_id, conv = %item.conv, msg_seq = item.msg_seq,
                "fan-out hit two membership periods of one user; quarantined");
        }
        let targets: Vec<String> = recipients.deliver.iter().map(|(u, _)| u.clone()).collect();
        let held = if targets.is_empty() {
            Vec::new()
        } else {
            let rows = query(
                c,
                "SELECT user_id, period_id FROM user_events WHERE user_id = ANY($1) AND source_event_id = $2",
                &[&targets, &item.source_event_id],
            )
            .await?;
            rows.iter().map(|r| Ok((col::<String>(r, 0)?, col::<i64>(r, 1)?))).collect::<R<Vec<_>>>()?
        };
        for (user, period_id) in &recipients.deliver {
            if held.iter().any(|(u, p)| u == user && p == period_id) {
                report.duplicates_skipped += 1;
                continue;
            }
            // Projections commit with the event: once per (user, event).
            let d = projection::delivery(&item.kind, user, &item.actor);
            let mentioned = d.counts_unread && mention::counts(user, &item.actor, &mentions.named, mentions.all);
            let row = query_one(
                c,
                DELIVER,
                &[
                    &user,
                    &item.kind,
                    &item.conv,
                    &big(item.msg_seq),
                    &item.source_event_id,
                    period_id,
                    &now_ms,
                    &d.own,
                    &d.counts_unread,
                    &mentioned,
                ],
            )
            .await?;
            let sync_seq = seq(&row, 0)?;
            if d.recount {
                events::recount_unread(c, user, &item.conv).await?;
            }
            report.events_written += 1;
            touched.insert(user.clone(), sync_seq);
            seen.deliveries.push((user.clone(), sync_seq));
        }
        report.items.push(seen);
        exec(c, "DELETE FROM outbox WHERE conv_id = $1 AND outbox_id = $2", &[&item.conv, &item.outbox_id]).await?;
        report.items_done += 1;
    }
    for (conv, max_seq) in moved {
        report.convs.push(publish_marker(c, &conv, max_seq).await?);
    }
    report.users = touched.into_iter().collect();
    Ok(report)
}
