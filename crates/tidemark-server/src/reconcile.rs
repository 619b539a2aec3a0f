//! Reconciliation (O3) in the server: the scheduled run (every
//! `ServerConfig::reconcile_every`, off by default), and the wire shape of
//! a run's report (`AdminReconcileOk`) for `POST /v1/admin/reconcile` and
//! `tidemark admin reconcile`. The job itself, chunk by chunk, is
//! `tidemark_store::reconcile`; what is broken and what is safe to repair
//! is `tidemark_core::reconcile`.

use std::sync::Arc;

use tidemark_core::reconcile::Repair;
use tidemark_proto::{AdminReconcileOk, QuarantineEntry, ReconcileFinding, ReconcileRelation};
use tidemark_store::reconcile::{self, ReconcileConfig, ReconcileReport};
use tokio::sync::watch;

use crate::state::AppState;
use crate::util::now_ms;

/// The reply of one run.
pub fn reply(r: &ReconcileReport, dry_run: bool) -> AdminReconcileOk {
    AdminReconcileOk {
        dry_run,
        messages_checked: r.messages_checked,
        convs_checked: r.convs_checked,
        users_checked: r.users_checked,
        unread_rows_checked: r.unread_rows_checked,
        chunks: r.chunks,
        found: r.found(),
        repaired: r.repaired(),
        reported: r.reported(),
        relations: r
            .by_relation
            .iter()
            .map(|(relation, c)| ReconcileRelation {
                relation: (*relation).into(),
                found: c.found,
                repaired: c.repaired,
                reported: c.reported,
            })
            .collect(),
        findings: r
            .findings
            .iter()
            .map(|f| {
                let x = &f.finding;
                ReconcileFinding {
                    relation: x.relation.into(),
                    reason: x.reason.into(),
                    conv: x.conv.clone(),
                    user: x.user.clone(),
                    device_id: x.device.clone(),
                    message_id: x.message_id.clone(),
                    msg_seq: x.msg_seq,
                    sync_seq: x.sync_seq,
                    period_id: x.period_id,
                    stored: x.stored,
                    fact: x.fact,
                    repair: x.repair.as_ref().map(|r| match r {
                        Repair::Requeue { .. } => "requeue".to_string(),
                        Repair::Recount { .. } => "recount".to_string(),
                    }),
                    repaired: f.repaired,
                }
            })
            .collect(),
        findings_left_off: r.findings_left_off,
        quarantine: r
            .quarantine
            .iter()
            .map(|q| QuarantineEntry {
                source_event_id: q.source_event_id.clone(),
                user: q.user.clone(),
                conv: q.conv.clone(),
                msg_seq: q.msg_seq,
                reason: q.reason.clone(),
                created_at_ms: q.created_at_ms,
            })
            .collect(),
        quarantine_total: r.quarantine_total,
    }
}

/// One run with repairs on (or a dry run), as the endpoint and the CLI
/// start it.
pub async fn run_once(
    store: &dyn tidemark_store::Store,
    dry_run: bool,
) -> tidemark_store::StoreResult<AdminReconcileOk> {
    let cfg = ReconcileConfig { repair: !dry_run, ..ReconcileConfig::default() };
    let report = reconcile::run(store, &cfg, now_ms()).await?;
    tracing::info!(
        messages = report.messages_checked,
        users = report.users_checked,
        found = report.found(),
        repaired = report.repaired(),
        reported = report.reported(),
        quarantined = report.quarantine_total,
        dry_run,
        "reconciliation run"
    );
    Ok(reply(&report, dry_run))
}

/// The scheduled run, every `reconcile_every` (none: never).
pub async fn run_scheduled(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    let Some(every) = state.config.reconcile_every else {
        return crate::util::stopped(&mut shutdown).await;
    };
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
        if !state.load.runs(tidemark_core::degrade::Work::Derived) {
            continue;
        }
        // The run reads in chunks on read connections and repairs through
        // short writer requests; shutdown waits for the chunk in progress.
        tokio::select! {
            r = run_once(&*state.store, false) => {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "reconciliation run failed");
                }
            }
            _ = crate::util::stopped(&mut shutdown) => return,
        }
    }
}
