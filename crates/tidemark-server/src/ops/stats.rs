//! `client.stats` (O1, issue 16): a device reports the gaps only it can
//! see, the conversations its store queued for repair (K5), the repairs it
//! completed and those waiting, and how long each repair took (repair
//! queue and cursor holes). The server cannot check them and stores
//! nothing: each report is clamped (`tidemark_core::client_stats`) and
//! added to the `gap` stage's metrics.

use tidemark_core::client_stats::{clamp_durations, clamp_report, GapReport};
use tidemark_proto::{ClientStatsOk, ClientStatsReq};
use tidemark_store::metric_names as names;

use crate::error::ApiResult;

pub fn report(req: ClientStatsReq) -> ApiResult<ClientStatsOk> {
    let r = clamp_report(GapReport {
        gaps_detected: req.gaps_detected,
        gaps_repaired: req.gaps_repaired,
        repairs_pending: req.repairs_pending,
    });
    names::SDK_GAPS_DETECTED.add(r.gaps_detected);
    names::SDK_GAPS_REPAIRED.add(r.gaps_repaired);
    names::SDK_REPAIRS_PENDING.record(r.repairs_pending as f64);
    let mut durations_recorded = 0;
    for (kind, list) in [("repair", &req.repair_ms), ("hole", &req.hole_ms)] {
        for ms in clamp_durations(list) {
            names::SDK_GAP_REPAIR_SECONDS.record_by("kind", kind, ms as f64 / 1000.0);
            durations_recorded += 1;
        }
    }
    Ok(ClientStatsOk {
        durations_recorded,
        gaps_detected: r.gaps_detected,
        gaps_repaired: r.gaps_repaired,
        repairs_pending: r.repairs_pending,
    })
}
