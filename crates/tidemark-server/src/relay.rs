//! The outbox relay (F1) and the re-hint sweep (D8).
//!
//! The relay reads the outbox in commit order and hands batches to the
//! store's fan-out transaction; only after that commits does it hint the
//! recipients. It starts by draining whatever a previous process left in the
//! outbox, so a crash between accepting a message and fanning it out loses
//! nothing. Redelivery is harmless: fan-out is idempotent (F3).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::metrics as m;
use crate::server::AppState;
use crate::util::now_ms;

/// Pause after a failed fan-out before trying again.
const RELAY_RETRY_BACKOFF: Duration = Duration::from_millis(200);

pub async fn run(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    if state.config.hold_fanout {
        tracing::warn!("fan-out held by configuration: accepted messages stay in the outbox");
        crate::util::stopped(&mut shutdown).await;
        return;
    }
    loop {
        match drain(&state).await {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(error = %e, "fan-out failed; will retry");
                tokio::time::sleep(RELAY_RETRY_BACKOFF).await;
                continue;
            }
        }
        tokio::select! {
            _ = state.relay_wake.notified() => {}
            _ = tokio::time::sleep(state.config.relay_poll) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
    }
}

/// Fans out everything in the outbox, batch by batch.
async fn drain(state: &AppState) -> Result<(), tidemark_store::StoreError> {
    loop {
        let items = state.store.pending_outbox(state.config.relay_batch_max).await?;
        if items.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let created: Vec<i64> = items.iter().map(|i| i.created_at_ms).collect();
        let report = state.store.fan_out(items, now).await?;
        let committed = now_ms();
        for c in created {
            metrics::histogram!(m::FANOUT_LAG).record((committed - c).max(0) as f64 / 1000.0);
        }
        metrics::counter!(m::FANOUT_EVENTS).increment(report.events_written);
        metrics::counter!(m::FANOUT_DUPLICATES).increment(report.duplicates_skipped);
        metrics::counter!(m::FANOUT_QUARANTINED).increment(report.quarantined);
        for (user, hw) in &report.users {
            state.hub.notify_user(user, *hw);
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
        state.hub.rehint_sweep(now_ms(), state.config.rehint_after.as_millis() as i64);
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
        match state.store.trim_user_logs(policy, now_ms()).await {
            Ok(r) if r.events_deleted > 0 || r.snapshots_expired > 0 => {
                metrics::counter!(m::TRIMMED_EVENTS).increment(r.events_deleted);
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
