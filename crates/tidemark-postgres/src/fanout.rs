//! The fan-out transaction (F2–F4, R3): outbox items become user events.
//!
//! It runs in a fixed number of round trips inside one writer request,
//! whatever the number of items and recipients (issue 14):
//!
//! 1. resolve every item's recipients from the membership periods covering
//!    its `msg_seq` (F4), plus, for a recall, whoever could see the original
//!    (E1): one statement reads every item's source row, one reads the
//!    periods of every (conversation, `msg_seq`) the batch asks about
//!    (`unnest` of arrays). Reads only: the periods covering a committed
//!    `msg_seq` never change (a later leave closes a period at a higher
//!    seq, a later join opens one above), so no conversation lock is
//!    needed;
//! 2. lock the head row of every recipient in `user_id` order, so two
//!    fan-outs (on two nodes) touching the same users queue up instead of
//!    deadlocking (two statements);
//! 3. one statement finds what the logs already hold (F3); one statement
//!    appends every remaining (item, recipient) event at its user's next
//!    `sync_seq`, in item order, so each user's events keep `msg_seq`
//!    order, and moves the projections as a statement per delivery in
//!    that order would ([`DELIVER`]); one statement recounts what the
//!    deliveries asked for (the sender's own event, a recall) per (user,
//!    conversation) from the facts ([`RECOUNT`], so the order does not
//!    matter); then one statement removes the batch's outbox rows.
//!
//! So a batch costs at most 8 statements, one round trip each, whatever its items and
//! recipients (plus a quarantine insert per quarantined delivery and one
//! marker publication per shared group it moved, when there are any).
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

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::db::{self, big, col, exec, query, query_one, seq, seq_opt, Conn};
use crate::events;
use crate::writer::BoxFut;

type R<T> = StoreResult<T>;

/// The periods of `conv` covering `at`, for every `(conv, at)` of `asks`
/// (index-aligned), in one statement.
async fn periods_covering(c: &Conn, asks: &[(String, u64)]) -> R<Vec<Vec<Period>>> {
    let mut out: Vec<Vec<Period>> = asks.iter().map(|_| Vec::new()).collect();
    if asks.is_empty() {
        return Ok(out);
    }
    let convs: Vec<&str> = asks.iter().map(|(c, _)| c.as_str()).collect();
    let ats: Vec<i64> = asks.iter().map(|(_, at)| big(*at)).collect();
    let rows = query(
        c,
        "SELECT q.i, p.period_id, p.user_id, p.join_seq, p.leave_seq
         FROM unnest($1::text[], $2::bigint[]) WITH ORDINALITY AS q(conv, at, i)
         JOIN membership_periods p ON p.conv_id = q.conv AND p.join_seq <= q.at
                                  AND (p.leave_seq IS NULL OR p.leave_seq >= q.at)
         ORDER BY q.i, p.period_id",
        &[&convs, &ats],
    )
    .await?;
    for r in &rows {
        let i = seq(r, 0)? as usize;
        let slot = out.get_mut(i.wrapping_sub(1)).ok_or_else(|| StoreError::Internal(format!("period ask {i}")))?;
        slot.push(Period { period_id: col(r, 1)?, user: col(r, 2)?, join_seq: seq(r, 3)?, leave_seq: seq_opt(r, 4)? });
    }
    Ok(out)
}

/// One item's source facts, as [`resolve`] reads them.
struct Source {
    kind: String,
    target_seq: Option<u64>,
    route: Route,
    seen: FannedOut,
    mentions: Mentions,
}

/// The recipients of every item (F4, E1, G2), index-aligned: the periods
/// covering its `msg_seq` and, for a control event, those covering its
/// target's, as `control_recipients` combines them; in a shared group, as
/// `large::route` decides (nobody, or the subject of a membership change).
/// Two statements for the whole batch.
pub(crate) async fn resolve(c: &Conn, items: &[OutboxItem]) -> R<Vec<(Recipients, Route, FannedOut, Mentions)>> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let convs: Vec<&str> = items.iter().map(|i| i.conv.as_str()).collect();
    let ids: Vec<&str> = items.iter().map(|i| i.source_event_id.as_str()).collect();
    let rows = query(
        c,
        "SELECT q.i, s.kind, t.msg_seq, cv.mode, cv.shared_from, cv.kind, s.mentions, s.mention_all
         FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS q(conv, id, i)
         JOIN messages s ON s.conv_id = q.conv AND s.message_id = q.id
         JOIN conversations cv ON cv.conv_id = s.conv_id
         LEFT JOIN messages t ON t.conv_id = s.conv_id AND t.message_id = s.target_id",
        &[&convs, &ids],
    )
    .await?;
    let mut sources: Vec<Option<Source>> = items.iter().map(|_| None).collect();
    for r in &rows {
        let i = seq(r, 0)? as usize;
        let item = items.get(i.wrapping_sub(1)).ok_or_else(|| StoreError::Internal(format!("source row {i}")))?;
        let kind: String = col(r, 1)?;
        let mode: String = col(r, 3)?;
        let route = large::route(&mode, seq_opt(r, 4)?, item.msg_seq, &kind);
        let conv_kind: String = col(r, 5)?;
        let seen = FannedOut {
            source_event_id: item.source_event_id.clone(),
            class: large::fanout_class(&conv_kind, route),
            ..Default::default()
        };
        let mentions = Mentions { named: col::<Option<Vec<String>>>(r, 6)?.unwrap_or_default(), all: col(r, 7)? };
        sources[i - 1] = Some(Source { kind, target_seq: seq_opt(r, 2)?, route, seen, mentions });
    }
    // The periods each item asks about: at its msg_seq (unless shared) and
    // at its target's.
    let mut asks: Vec<(String, u64)> = Vec::new();
    let mut slots: Vec<(Option<usize>, Option<usize>)> = Vec::with_capacity(items.len());
    for (item, source) in items.iter().zip(&sources) {
        let source = source.as_ref().ok_or_else(|| {
            StoreError::Internal(format!("outbox item {} has no source event {}", item.outbox_id, item.source_event_id))
        })?;
        if source.route == Route::Shared {
            slots.push((None, None));
            continue;
        }
        asks.push((item.conv.clone(), item.msg_seq));
        let at = asks.len() - 1;
        let target = source.target_seq.map(|t| {
            asks.push((item.conv.clone(), t));
            asks.len() - 1
        });
        slots.push((Some(at), target));
    }
    let mut periods = periods_covering(c, &asks).await?;
    let mut out = Vec::with_capacity(items.len());
    for ((item, source), (at, target)) in items.iter().zip(sources).zip(slots) {
        let Source { kind, target_seq, route, mut seen, mentions } = source.expect("checked above");
        let Some(at) = at else {
            out.push((Recipients::default(), route, seen, mentions));
            continue;
        };
        let covering = std::mem::take(&mut periods[at]);
        let covering: Vec<Period> = match route {
            // The period the change opened or closed at this msg_seq.
            Route::Subject => covering
                .into_iter()
                .filter(|p| p.join_seq == item.msg_seq || p.leave_seq == Some(item.msg_seq))
                .collect(),
            _ => covering,
        };
        seen.period_miss = large::period_miss(route, covering.len());
        let at_event = recipients_at(&covering, item.msg_seq);
        let holders = match (target, target_seq) {
            (Some(k), Some(t)) => Some(recipients_at(&std::mem::take(&mut periods[k]), t)),
            _ => None,
        };
        out.push((control_recipients(at_event, holders, &kind), route, seen, mentions));
    }
    Ok(out)
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

/// Appends every delivery of a batch to its user's log and moves the
/// users' projections, in one statement, as `projection::delivery`
/// decided; returns `(i, sync_seq)` for the `i`-th delivery (1-based, in
/// the order given). The parameters are arrays, index-aligned: user, kind,
/// conversation, `msg_seq`, source event, period, then the time, then the
/// flags `own`, `counts_unread` and `mentioned` (`$8`–`$10`).
///
/// It does what one statement per delivery did, in the given order
/// (deliveries in item order, so each user's events keep `msg_seq` order):
/// a user's deliveries take the `sync_seq`s above the head one by one (the
/// heads are locked and exist: `lock_heads`); every event moves
/// `last_msg_seq`; the user's own event moves the read cursor (R3); unread
/// moves only for a message from someone else above the read cursor and
/// above `last_msg_seq` as they stood just before that delivery (what the
/// row counts already: a late delivery, such as a fan-out re-enqueued by
/// reconciliation, was counted when the row moved past it) that the user
/// did not delete for themselves, except that the delivery which creates a
/// `user_convs` row counts as the row's first fact. Mentions move with
/// unread where `mention::counts` said so (issue 18). "As they stood just
/// before" is the row before the statement (`uc`) raised by the batch's
/// earlier deliveries to the same row (the windows over `i`), so the
/// counts are the sequential ones, and each `user_convs` row is written
/// once (an upsert may not touch a row twice).
///
/// One statement against one per delivery: `bench ingest --database` read
/// 26.6 µs of executor per delivery statement (two per direct message) in
/// `pg_stat_statements`, each with its own bind and portal.
const DELIVER: &str = "WITH d AS (
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::bigint[],
                              $8::bool[], $9::bool[], $10::bool[])
             WITH ORDINALITY AS d(user_id, kind, conv_id, msg_seq, source_event_id, period_id, own, counts, mentioned, i)),
     n AS (SELECT user_id, COUNT(*) AS n FROM d GROUP BY user_id),
     h AS (
         UPDATE user_heads uh SET high_watermark = uh.high_watermark + n.n FROM n WHERE uh.user_id = n.user_id
         RETURNING uh.user_id, uh.high_watermark - n.n AS base),
     s AS (
         SELECT d.*, h.base + ROW_NUMBER() OVER (PARTITION BY d.user_id ORDER BY d.i) AS sync_seq
         FROM d JOIN h ON h.user_id = d.user_id),
     e AS (
         INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id,
                                  created_at)
         SELECT user_id, sync_seq, kind, conv_id, msg_seq, source_event_id, source_event_id, period_id, $7 FROM s),
     b AS (
         SELECT d.user_id, d.conv_id, d.msg_seq, d.own, d.counts, d.mentioned,
                uc.user_id IS NULL AND ROW_NUMBER() OVER w = 1 AS creates,
                d.msg_seq > GREATEST(COALESCE(uc.read_seq, 0), COALESCE(MAX(d.msg_seq) FILTER (WHERE d.own) OVER before, 0))
                AND d.msg_seq > GREATEST(COALESCE(uc.last_msg_seq, 0), COALESCE(MAX(d.msg_seq) OVER before, 0))
                AND NOT EXISTS (SELECT 1 FROM user_deleted x WHERE x.user_id = d.user_id
                                AND x.message_id = d.source_event_id) AS above
         FROM d LEFT JOIN user_convs uc ON uc.user_id = d.user_id AND uc.conv_id = d.conv_id
         WINDOW w AS (PARTITION BY d.user_id, d.conv_id ORDER BY d.i),
                before AS (w ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)),
     p AS (
         INSERT INTO user_convs AS uc (user_id, conv_id, last_msg_seq, read_seq, unread, mentions)
         SELECT user_id, conv_id, MAX(msg_seq), COALESCE(MAX(msg_seq) FILTER (WHERE own), 0),
                COUNT(*) FILTER (WHERE counts AND (creates OR above)),
                COUNT(*) FILTER (WHERE mentioned AND (creates OR above))
         FROM b GROUP BY user_id, conv_id
         ON CONFLICT (user_id, conv_id) DO UPDATE SET
             last_msg_seq = GREATEST(uc.last_msg_seq, excluded.last_msg_seq),
             read_seq = GREATEST(uc.read_seq, excluded.read_seq),
             unread = uc.unread + excluded.unread,
             mentions = uc.mentions + excluded.mentions)
     SELECT i, sync_seq FROM s";

/// Recounts the unread and mentions of every (user, conversation) of
/// `$1`/`$2` (index-aligned arrays) from the facts, in one statement
/// (`events::recount_unread`'s counts, [`events::COUNT_UNREAD`] and
/// [`events::COUNT_MENTIONS`], at each row's own `read_seq`).
static RECOUNT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let at_row =
        |count: &str| count.replace("$1", "u0.user_id").replace("$2", "u0.conv_id").replace("$3", "u0.read_seq");
    format!(
        "UPDATE user_convs u0 SET unread = ({}), mentions = ({})
         FROM unnest($1::text[], $2::text[]) AS q(u, c) WHERE u0.user_id = q.u AND u0.conv_id = q.c",
        at_row(events::COUNT_UNREAD),
        at_row(&events::COUNT_MENTIONS),
    )
});

/// One delivery of a batch: an item's event for one recipient, with the
/// projection flags `projection::delivery` and `mention::counts` decided.
struct Delivery<'a> {
    plan: usize,
    user: &'a str,
    item: &'a OutboxItem,
    period_id: &'a i64,
    d: projection::Delivery,
    mentioned: bool,
}

/// Writes `deliveries` ([`DELIVER`], one statement); their new
/// `sync_seq`s, index-aligned.
async fn deliver(c: &Conn, deliveries: &[Delivery<'_>], now_ms: i64) -> R<Vec<SyncSeq>> {
    if deliveries.is_empty() {
        return Ok(Vec::new());
    }
    let users: Vec<&str> = deliveries.iter().map(|x| x.user).collect();
    let kinds: Vec<&str> = deliveries.iter().map(|x| x.item.kind.as_str()).collect();
    let convs: Vec<&str> = deliveries.iter().map(|x| x.item.conv.as_str()).collect();
    let msg_seqs: Vec<i64> = deliveries.iter().map(|x| big(x.item.msg_seq)).collect();
    let sources: Vec<&str> = deliveries.iter().map(|x| x.item.source_event_id.as_str()).collect();
    let periods: Vec<i64> = deliveries.iter().map(|x| *x.period_id).collect();
    let own: Vec<bool> = deliveries.iter().map(|x| x.d.own).collect();
    let counts: Vec<bool> = deliveries.iter().map(|x| x.d.counts_unread).collect();
    let mentioned: Vec<bool> = deliveries.iter().map(|x| x.mentioned).collect();
    let rows =
        query(c, DELIVER, &[&users, &kinds, &convs, &msg_seqs, &sources, &periods, &now_ms, &own, &counts, &mentioned])
            .await?;
    let mut out: Vec<Option<SyncSeq>> = vec![None; deliveries.len()];
    for r in &rows {
        let i = seq(r, 0)? as usize;
        let slot = out.get_mut(i.wrapping_sub(1)).ok_or_else(|| StoreError::Internal(format!("delivery row {i}")))?;
        *slot = Some(seq(r, 1)?);
    }
    out.into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| StoreError::Internal(format!("delivery {} returned no sync_seq", i + 1))))
        .collect()
}

/// Runs `sql` once per parameter list, pipelined: every statement is sent
/// before the first answer is awaited, so the whole list costs one round
/// trip (one statement each in the counters). Answers in order; the first
/// failure is the error (the caller's transaction is then aborted).
async fn pipelined(c: &Conn, sql: &str, params: &[Vec<&(dyn ToSql + Sync)>]) -> R<Vec<Vec<Row>>> {
    if params.is_empty() {
        return Ok(Vec::new());
    }
    let stmt = c.prepare_cached(sql).await.map_err(db::error)?;
    let stmt = &stmt;
    let futures: Vec<BoxFut<'_, Result<Vec<Row>, tokio_postgres::Error>>> = params
        .iter()
        .map(|p| {
            db::counted();
            Box::pin(async move { c.query(stmt, p).await }) as BoxFut<'_, _>
        })
        .collect();
    crate::writer::in_order(futures).await.into_iter().map(|r| r.map_err(db::error)).collect()
}

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
    for (item, (recipients, route, mut seen, mentions)) in items.iter().zip(resolve(c, items).await?) {
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
    // What the logs already hold of these items (F3), in one statement.
    let mut asked: Vec<(String, String)> = plans
        .iter()
        .zip(items)
        .flat_map(|((r, _, _), item)| r.deliver.iter().map(|(u, _)| (u.clone(), item.source_event_id.clone())))
        .collect();
    asked.sort();
    asked.dedup();
    let mut held: std::collections::HashSet<(String, String, i64)> = std::collections::HashSet::new();
    if !asked.is_empty() {
        let (us, ss): (Vec<&str>, Vec<&str>) = asked.iter().map(|(u, s)| (u.as_str(), s.as_str())).unzip();
        let rows = query(
            c,
            "SELECT e.user_id, e.source_event_id, e.period_id FROM unnest($1::text[], $2::text[]) AS q(u, s)
             JOIN user_events e ON e.user_id = q.u AND e.source_event_id = q.s",
            &[&us, &ss],
        )
        .await?;
        for r in &rows {
            held.insert((col(r, 0)?, col(r, 1)?, col(r, 2)?));
        }
    }

    // Every delivery of the batch, in item order; and the quarantined.
    let mut deliveries: Vec<Delivery<'_>> = Vec::new();
    let mut quarantined: Vec<(&str, &OutboxItem)> = Vec::new();
    for (k, (item, (recipients, _, mentions))) in items.iter().zip(&plans).enumerate() {
        for user in &recipients.quarantined {
            quarantined.push((user.as_str(), item));
        }
        for (user, period_id) in &recipients.deliver {
            // Held by the log, or by an earlier item of this batch (the
            // same event queued twice).
            if !held.insert((user.clone(), item.source_event_id.clone(), *period_id)) {
                report.duplicates_skipped += 1;
                continue;
            }
            // Projections commit with the event: once per (user, event).
            let d = projection::delivery(&item.kind, user, &item.actor);
            let mentioned = d.counts_unread && mention::counts(user, &item.actor, &mentions.named, mentions.all);
            deliveries.push(Delivery { plan: k, user, item, period_id, d, mentioned });
        }
    }
    if !quarantined.is_empty() {
        let msg_seqs: Vec<i64> = quarantined.iter().map(|(_, item)| big(item.msg_seq)).collect();
        let params: Vec<Vec<&(dyn ToSql + Sync)>> = quarantined
            .iter()
            .zip(&msg_seqs)
            .map(|((user, item), msg_seq)| {
                vec![user as &(dyn ToSql + Sync), &item.source_event_id, &item.conv, msg_seq, &now_ms]
            })
            .collect();
        pipelined(
            c,
            "INSERT INTO fanout_quarantine (user_id, source_event_id, conv_id, msg_seq, reason, created_at)
             VALUES ($1, $2, $3, $4, 'overlapping_membership_periods', $5)
             ON CONFLICT DO NOTHING",
            &params,
        )
        .await?;
        for (_, item) in &quarantined {
            report.quarantined += 1;
            tracing::error!(source_event_id = %item.source_event_id, conv = %item.conv, msg_seq = item.msg_seq,
                "fan-out hit two membership periods of one user; quarantined");
        }
    }
    let delivered = deliver(c, &deliveries, now_ms).await?;
    let mut touched: BTreeMap<String, SyncSeq> = BTreeMap::new();
    let mut recounts: Vec<(&str, &str)> = Vec::new();
    let mut per_plan: Vec<Vec<(String, SyncSeq)>> = plans.iter().map(|_| Vec::new()).collect();
    for (x, sync_seq) in deliveries.iter().zip(delivered) {
        if x.d.recount && !recounts.contains(&(x.user, x.item.conv.as_str())) {
            recounts.push((x.user, x.item.conv.as_str()));
        }
        report.events_written += 1;
        touched.insert(x.user.to_owned(), sync_seq);
        per_plan[x.plan].push((x.user.to_owned(), sync_seq));
    }
    if !recounts.is_empty() {
        let (us, cs): (Vec<&str>, Vec<&str>) = recounts.iter().copied().unzip();
        exec(c, &RECOUNT, &[&us, &cs]).await?;
    }
    let (convs, ids): (Vec<&str>, Vec<i64>) = items.iter().map(|i| (i.conv.as_str(), i.outbox_id)).unzip();
    if !items.is_empty() {
        exec(
            c,
            "DELETE FROM outbox o USING unnest($1::text[], $2::bigint[]) AS q(conv, id)
             WHERE o.conv_id = q.conv AND o.outbox_id = q.id",
            &[&convs, &ids],
        )
        .await?;
    }
    drop(recounts);
    drop(deliveries);
    report.items_done = items.len() as u64;
    report.items = plans
        .into_iter()
        .zip(per_plan)
        .map(|((_, mut seen, _), delivered)| {
            seen.deliveries = delivered;
            seen
        })
        .collect();
    for (conv, max_seq) in moved {
        report.convs.push(publish_marker(c, &conv, max_seq).await?);
    }
    report.users = touched.into_iter().collect();
    Ok(report)
}
