//! The outbox relay (F1) and the re-hint sweep (D8).
//!
//! The relay claims batches of the outbox, oldest first, and fans each out
//! in the claim's own transaction ([`Store::fan_out_next`]); only after that
//! commits does it hint the recipients, here and (through the hint bus) on
//! the other nodes. It starts by draining whatever a previous process left
//! in the outbox, so a crash between accepting a message and fanning it out
//! loses nothing. With several nodes on one database each relay claims what
//! the others do not hold, so they split the work; a node killed mid-claim
//! rolls back and its items are claimed again. Redelivery would still be
//! harmless: fan-out is idempotent (F3).
//!
//! On a store that fuses the fan-out with the accept
//! ([`Store::fuse_fanout`]: SQLite, issue 19), the writes that appended to
//! the outbox also fan out what they can in their own commit; those claims
//! reach the relay through a channel and it settles them ([`settle`]: load
//! level, metrics, hints, push, markers) exactly as its own. Whatever was
//! not fused (a big group's fan-out, a failed fused fan-out, items left by
//! a previous process) it still drains. `hold_fanout` takes no fused
//! claims, so the store fuses nothing.
//!
//! [`Store::fan_out_next`]: tidemark_store::Store::fan_out_next
//! [`Store::fuse_fanout`]: tidemark_store::Store::fuse_fanout

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::metrics as m;
use crate::state::AppState;
use crate::util::now_ms;

/// Pause after a failed fan-out before trying again (a shutdown ends it).
const RELAY_RETRY_BACKOFF: Duration = Duration::from_millis(200);
/// Batches one drain claims before the relay looks at its shutdown flag
/// again; a larger backlog is drained over several rounds with no pause in
/// between.
pub const RELAY_DRAIN_BATCHES_MAX: usize = 64;

/// How a drain ended.
#[derive(Debug, PartialEq, Eq)]
enum Drained {
    /// The outbox is empty: wait for a wake-up or the poll.
    Empty,
    /// [`RELAY_DRAIN_BATCHES_MAX`] batches were claimed (or shutdown was
    /// asked for) and there may be more: go on at once unless stopping.
    More,
}

pub async fn run(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    if state.config.hold_fanout {
        tracing::warn!("fan-out held by configuration: accepted messages stay in the outbox");
        crate::util::stopped(&mut shutdown).await;
        return;
    }
    // The fused claims are settled beside the drain (in this task, so a
    // panic in either is the relay's); the receiver is dropped when the
    // relay stops, which ends the store's fusing.
    match state.store.fuse_fanout(state.config.relay_batch_max) {
        Some(claims) => {
            tokio::join!(relay(state.clone(), shutdown.clone()), settle_fused(&state, claims, shutdown));
        }
        None => relay(state, shutdown).await,
    }
}

/// The relay's own claims: drains, then waits for a wake-up or the poll.
async fn relay(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    loop {
        match drain(&state, &shutdown).await {
            Ok(Drained::More) if !is_stopped(&shutdown) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "fan-out failed; will retry");
                tokio::select! {
                    _ = tokio::time::sleep(RELAY_RETRY_BACKOFF) => continue,
                    _ = crate::util::stopped(&mut shutdown) => return,
                }
            }
        }
        tokio::select! {
            _ = state.relay_wake.notified() => {}
            _ = tokio::time::sleep(state.config.relay_poll) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
    }
}

/// Whether shutdown was asked for (or its sender is gone), without waiting.
fn is_stopped(shutdown: &watch::Receiver<bool>) -> bool {
    *shutdown.borrow() || shutdown.has_changed().is_err()
}

/// Fans out the outbox, batch by batch, at most [`RELAY_DRAIN_BATCHES_MAX`]
/// batches, stopping early on shutdown.
async fn drain(state: &AppState, shutdown: &watch::Receiver<bool>) -> Result<Drained, tidemark_store::StoreError> {
    for _ in 0..RELAY_DRAIN_BATCHES_MAX {
        if is_stopped(shutdown) {
            return Ok(Drained::More);
        }
        let claimed = state.store.fan_out_next(state.config.relay_batch_max, now_ms()).await?;
        if !settle(state, claimed).await {
            return Ok(Drained::Empty);
        }
    }
    Ok(Drained::More)
}

/// Settles the fused claims ([`Store::fuse_fanout`]) as they commit, beside
/// the relay's own drain so a long drain delays no fused hint.
///
/// [`Store::fuse_fanout`]: tidemark_store::Store::fuse_fanout
async fn settle_fused(
    state: &AppState,
    mut claims: tokio::sync::mpsc::UnboundedReceiver<tidemark_store::ClaimedFanout>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            claimed = claims.recv() => match claimed {
                Some(claimed) => { settle(state, claimed).await; }
                None => return,
            },
            _ = crate::util::stopped(&mut shutdown) => return,
        }
    }
}

/// Everything that follows a committed claim, the relay's own or a fused
/// one: the load level, the metrics and trace, the hints here and on the
/// other nodes, the push worker's wake and the markers. Returns whether the
/// claim held any item.
async fn settle(state: &AppState, claimed: tidemark_store::ClaimedFanout) -> bool {
    let committed = now_ms();
    // The load level (seed §9.4): the age of the oldest item of a full
    // claim.
    let oldest = claimed.items.iter().map(|i| i.created_at_ms).min();
    let full = claimed.items.len() >= state.config.relay_batch_max as usize;
    state.load.observe(oldest.map(|c| (committed - c).max(0) as u64), full);
    if claimed.items.is_empty() {
        return false;
    }
    let report = claimed.report;
    observe(state, &claimed.items, &report, committed);
    for (user, hw) in &report.users {
        state.hint_user(user, *hw);
    }
    if !report.users.is_empty() {
        state.push_wake.notify_one();
    }
    crate::metrics::MARKERS_PUBLISHED.add(report.convs.len() as u64);
    for moved in &report.convs {
        state.hint_conv(moved).await;
    }
    true
}

/// The metrics and the trace of one committed fan-out, from its report
/// (no store read): lag and amplification per conversation kind, the
/// integrity counters, and one trace line per item and per user event.
fn observe(state: &AppState, items: &[tidemark_store::OutboxItem], report: &tidemark_store::FanoutReport, now: i64) {
    m::FANOUT_EVENTS.add(report.events_written);
    m::FANOUT_DUPLICATES.add(report.duplicates_skipped);
    m::FANOUT_QUARANTINED.add(report.quarantined);
    if report.quarantined > 0 {
        m::INVARIANT_VIOLATIONS.add_by("invariant", "period_overlap", report.quarantined);
    }
    for (item, seen) in items.iter().zip(&report.items) {
        debug_assert_eq!(item.source_event_id, seen.source_event_id, "the report follows the outbox order");
        let lag_ms = (now - item.created_at_ms).max(0);
        m::FANOUT_LAG.record_by("conv_kind", seen.class, lag_ms as f64 / 1000.0);
        m::FANOUT_AMPLIFICATION.record_by("conv_kind", seen.class, seen.recipients as f64);
        if seen.period_miss {
            m::FANOUT_PERIOD_MISSES.inc();
            m::invariant_violation("period_miss");
            tracing::error!(stage = "fanout", trace_id = %item.source_event_id, conv = %item.conv,
                msg_seq = item.msg_seq, "no membership period covers this event; delivered to no one");
        }
        crate::trace_stage!(stage = "fanout", trace_id = %item.source_event_id, message_id = %item.source_event_id,
            conv = %item.conv, msg_seq = item.msg_seq, outbox_id = item.outbox_id, conv_kind = seen.class,
            recipients = seen.recipients, events = seen.deliveries.len(), lag_ms, result = "fanned_out",
            "outbox item fanned out");
        for (user, sync_seq) in &seen.deliveries {
            crate::trace_stage!(stage = "fanout", trace_id = %item.source_event_id,
                message_id = %item.source_event_id, user_hash = %state.log_id(user), sync_seq = *sync_seq,
                result = "delivered", "user event written");
        }
    }
}

pub async fn run_rehint(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    let every = (state.config.rehint_after / 2).max(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
        // Under load hints are only merged: repeating them waits (§9.4).
        if state.load.action(tidemark_core::degrade::Work::Hints) == tidemark_core::degrade::Action::Run {
            state.hub.rehint_sweep(now_ms(), state.config.rehint_after.as_millis() as i64);
        }
    }
}

/// The retention pass (L1–L2), every `retention_every`.
pub async fn run_retention(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    let Some(policy) = state.config.retention else {
        return crate::util::stopped(&mut shutdown).await;
    };
    loop {
        tokio::select! {
            _ = tokio::time::sleep(state.config.retention_every) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
        // Derived work waits while the fan-out is behind (§9.4); what it
        // would trim is still there at the next pass.
        if !state.load.runs(tidemark_core::degrade::Work::Derived) {
            continue;
        }
        match state.store.trim_user_logs(policy, now_ms()).await {
            Ok(r) if r.events_deleted > 0 || r.snapshots_expired > 0 => {
                m::TRIMMED_EVENTS.add(r.events_deleted);
                tracing::info!(
                    users = r.users_trimmed,
                    events = r.events_deleted,
                    snapshots_expired = r.snapshots_expired,
                    "retention pass"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "retention pass failed"),
        }
    }
}
