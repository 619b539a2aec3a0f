//! What a device reports of the gaps only it can see (issue 16, O1): the
//! conversations its store could not apply and queued for repair (K5),
//! the repairs it completed, and those still waiting. The server cannot
//! check them; it bounds each report so one device cannot move a metric
//! by more than [`CLIENT_STATS_COUNT_MAX`] at a time. A report also
//! carries how long each completed repair took, from detection to repair
//! (a repair-queue repair, or a hole in a conversation's `msg_seq` that
//! closed): at most [`CLIENT_STATS_DURATIONS_MAX`] samples of each kind
//! count per report, each clamped to [`CLIENT_STATS_DURATION_MS_MAX`].

/// Largest count one `client.stats` report adds to a counter, and the
/// largest pending count it records; a larger value is clamped to it.
pub const CLIENT_STATS_COUNT_MAX: u64 = 10_000;

/// Largest number of repair durations of one kind one report records;
/// the rest of a longer list is ignored (the SDK never sends more).
pub const CLIENT_STATS_DURATIONS_MAX: usize = 64;

/// Largest repair duration one sample records, in ms (a week); a longer
/// one is clamped to it.
pub const CLIENT_STATS_DURATION_MS_MAX: u64 = 7 * 24 * 60 * 60 * 1000;

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

/// The repair durations of one kind a report records: the first
/// [`CLIENT_STATS_DURATIONS_MAX`], each clamped to
/// [`CLIENT_STATS_DURATION_MS_MAX`].
pub fn clamp_durations(durations_ms: &[u64]) -> Vec<u64> {
    durations_ms.iter().take(CLIENT_STATS_DURATIONS_MAX).map(|d| (*d).min(CLIENT_STATS_DURATION_MS_MAX)).collect()
}

/// How long a gap detected at `detected_at_ms` took to repair at `now_ms`
/// (wall clocks of one device): zero if the clock went back, never more
/// than [`CLIENT_STATS_DURATION_MS_MAX`].
pub fn repair_duration_ms(detected_at_ms: i64, now_ms: i64) -> u64 {
    (now_ms.saturating_sub(detected_at_ms).max(0) as u64).min(CLIENT_STATS_DURATION_MS_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_capped_in_number_and_clamped_in_length() {
        const D: u64 = CLIENT_STATS_DURATION_MS_MAX;
        const N: usize = CLIENT_STATS_DURATIONS_MAX;
        let cases: &[(Vec<u64>, Vec<u64>)] = &[
            (vec![], vec![]),
            (vec![0, 5, 1500], vec![0, 5, 1500]),
            (vec![D, D + 1, u64::MAX], vec![D, D, D]),
            (vec![7; N + 10], vec![7; N]),
            ((0..N as u64 + 1).collect(), (0..N as u64).collect()),
        ];
        for (input, expect) in cases {
            assert_eq!(&clamp_durations(input), expect, "{input:?}");
        }
    }

    #[test]
    fn a_duration_is_never_negative_nor_unbounded() {
        let cases: &[(i64, i64, u64)] = &[
            (1_000, 1_000, 0),
            (1_000, 3_500, 2_500),
            (5_000, 1_000, 0),
            (0, i64::MAX, CLIENT_STATS_DURATION_MS_MAX),
            (i64::MIN, i64::MAX, CLIENT_STATS_DURATION_MS_MAX),
        ];
        for &(at, now, expect) in cases {
            assert_eq!(repair_duration_ms(at, now), expect, "{at} -> {now}");
        }
    }

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
