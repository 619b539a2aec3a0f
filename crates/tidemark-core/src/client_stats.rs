//! What a device reports of the gaps only it can see (issue 16, O1): the
//! conversations its store could not apply and queued for repair (K5),
//! the repairs it completed, and those still waiting. The server cannot
//! check them; it bounds each report so one device cannot move a metric
//! by more than [`CLIENT_STATS_COUNT_MAX`] at a time.

/// Largest count one `client.stats` report adds to a counter, and the
/// largest pending count it records; a larger value is clamped to it.
pub const CLIENT_STATS_COUNT_MAX: u64 = 10_000;

/// One device's report, as the metrics take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GapReport {
    /// Conversations queued for repair since the device's last report.
    pub gaps_detected: u64,
    /// Repairs completed since the last report.
    pub gaps_repaired: u64,
    /// Repairs waiting on the device now.
    pub repairs_pending: u64,
}

/// Clamps every field of `report` to [`CLIENT_STATS_COUNT_MAX`].
pub fn clamp_report(report: GapReport) -> GapReport {
    GapReport {
        gaps_detected: report.gaps_detected.min(CLIENT_STATS_COUNT_MAX),
        gaps_repaired: report.gaps_repaired.min(CLIENT_STATS_COUNT_MAX),
        repairs_pending: report.repairs_pending.min(CLIENT_STATS_COUNT_MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_clamped_field_by_field() {
        fn check(input: (u64, u64, u64), expect: (u64, u64, u64)) {
            let r = GapReport { gaps_detected: input.0, gaps_repaired: input.1, repairs_pending: input.2 };
            let got = clamp_report(r);
            assert_eq!((got.gaps_detected, got.gaps_repaired, got.repairs_pending), expect, "{input:?}");
        }
        const M: u64 = CLIENT_STATS_COUNT_MAX;
        check((0, 0, 0), (0, 0, 0));
        check((3, 1, 2), (3, 1, 2));
        check((M, M, M), (M, M, M));
        check((M + 1, 5, u64::MAX), (M, 5, M));
        check((u64::MAX, u64::MAX, 0), (M, M, 0));
    }
}
