//! The durable audit log (P1, seed §17.1): account and device events, with
//! the user and device as keyed hashes (`TokenKeys::audit_id`), the source
//! address and the time, written through the store before the reply; its
//! retention pass; the operator's query (`POST /v1/admin/audit`). Never a
//! password, a token or a message body. A failed write is logged and does
//! not fail the request it records (the event already happened).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tidemark_store::AuditEntry;
use tokio::sync::watch;

use crate::state::AppState;
use crate::util::now_ms;

/// How often the retention pass deletes old entries.
pub const AUDIT_TRIM_EVERY: Duration = Duration::from_secs(3600);

/// Records one event concerning `user` (and `device`).
pub async fn record(
    state: &AppState,
    event: &str,
    actor: &str,
    user: &str,
    device: Option<&str>,
    address: Option<IpAddr>,
) {
    let entry = AuditEntry {
        at_ms: now_ms(),
        event: event.to_owned(),
        actor: actor.to_owned(),
        user_hash: state.keys.audit_id(user),
        device_hash: device.map(|d| state.keys.audit_id(d)),
        address: address.map(|a| a.to_string()),
    };
    if let Err(e) = state.store.append_audit(&entry).await {
        tracing::error!(event, error = %e, "audit entry not written");
    }
}

/// Deletes entries older than [`crate::ServerConfig::audit_keep`], at start
/// and every [`AUDIT_TRIM_EVERY`].
pub async fn run_retention(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let keep = state.config.audit_keep.as_millis().min(i64::MAX as u128) as i64;
        let before = tidemark_core::audit::keep_from(now_ms(), keep);
        match state.store.trim_audit(before).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, "audit log trimmed"),
            Err(e) => tracing::warn!(error = %e, "audit log trim failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(AUDIT_TRIM_EVERY) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
    }
}
