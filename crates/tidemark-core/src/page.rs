//! One sync page (D2, D5, D6, L2): what the facts read with the page say
//! about it.
//!
//! A backend reads the device's cursor, the user's log bounds and the
//! device's recovery session in one read snapshot, calls [`decide_page`],
//! and reads the range [`PageDecision::range`] names in the same snapshot.
//! So the trim check and the read it guards see the same log: a page is
//! either whole or not served (never a partial page), and the caller acts
//! on the decision (a compare-and-set for the outcomes that write).

use crate::cursor::{
    decide_resume_with, ClientPosition, DeviceCursor, DeviceState, RecoveryInfo, RecoveryPolicy, Resume, UserLog,
};
use crate::{Generation, SyncSeq};

/// What a page is decided from, read in one snapshot with the page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncFacts {
    pub device: DeviceCursor,
    pub log: UserLog,
    /// The device's open recovery session, if any.
    pub session: Option<RecoveryInfo>,
}

/// The page asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageQuery {
    /// The first page of a batch: the resume rule decides where it starts.
    First { client: ClientPosition, policy: RecoveryPolicy, now_ms: i64 },
    /// A later page of a batch: the batch token's generation, watermark
    /// and recovery session, and the position its signed cursor names.
    Next {
        generation: Generation,
        position: SyncSeq,
        high_watermark: SyncSeq,
        recovery_session: Option<String>,
        now_ms: i64,
    },
}

/// The outcome of a later page of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextPage {
    /// Serve `(after, upto]`.
    Serve { after: SyncSeq, upto: SyncSeq },
    /// `DEVICE_REVOKED`.
    Revoked,
    /// The batch belongs to another generation: `STALE_GENERATION`.
    StaleGeneration { current: Generation },
    /// The device must rebuild: `RESET_REQUIRED` at this generation.
    ResetRequired { generation: Generation },
    /// The rest of the batch is no longer all in the log (trimmed, or its
    /// recovery session expired and stopped fencing it): bump the
    /// generation (CAS from the facts' cursor), set `RESETTING`, answer
    /// `RESET_REQUIRED`. Never a partial page (D6, L2).
    Reset,
}

/// What to do with a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageDecision {
    /// The first page of a batch: the resume rule's answer (D5, D6).
    First(Resume),
    /// A later page.
    Next(NextPage),
}

/// Decides a page from facts read in one snapshot.
pub fn decide_page(facts: &SyncFacts, query: &PageQuery) -> PageDecision {
    match query {
        PageQuery::First { client, policy, now_ms } => PageDecision::First(decide_resume_with(
            facts.device,
            *client,
            facts.log,
            facts.session.as_ref(),
            *policy,
            *now_ms,
        )),
        PageQuery::Next { generation, position, high_watermark, recovery_session, now_ms } => PageDecision::Next(
            decide_next(facts, *generation, *position, *high_watermark, recovery_session.as_deref(), *now_ms),
        ),
    }
}

fn decide_next(
    facts: &SyncFacts,
    generation: Generation,
    position: SyncSeq,
    high_watermark: SyncSeq,
    token_session: Option<&str>,
    now_ms: i64,
) -> NextPage {
    let d = facts.device;
    match d.state {
        DeviceState::Revoked => NextPage::Revoked,
        _ if d.generation != generation => NextPage::StaleGeneration { current: d.generation },
        DeviceState::Resetting | DeviceState::New => NextPage::ResetRequired { generation: d.generation },
        DeviceState::Active | DeviceState::Recovering => {
            let session_over = d.state == DeviceState::Recovering
                && !facts
                    .session
                    .as_ref()
                    .is_some_and(|s| Some(s.session_id.as_str()) == token_session && now_ms < s.expires_at_ms);
            if position < facts.log.trimmed_upto || session_over {
                NextPage::Reset
            } else {
                NextPage::Serve { after: position, upto: high_watermark }
            }
        }
    }
}

impl PageDecision {
    /// The range `(after, upto]` to read with the facts: the page itself
    /// when the decision serves one from this snapshot, or after the
    /// decision's compare-and-set wins (a recovery opened, a device
    /// activated or rebuilt: the batch's watermark is the facts' head, so
    /// the page is already exact). `None` when no page is served.
    pub fn range(&self, facts: &SyncFacts) -> Option<(SyncSeq, SyncSeq)> {
        let head = facts.log.high_watermark;
        match *self {
            PageDecision::First(Resume::Replay { from, .. }) | PageDecision::First(Resume::Recover { from, .. }) => {
                Some((from, head))
            }
            PageDecision::First(Resume::Activate { .. }) | PageDecision::First(Resume::Rebuild { .. }) => {
                Some((0, head))
            }
            PageDecision::First(Resume::ContinueRecovery { .. }) => {
                facts.session.as_ref().map(|s| (s.resume_from, s.high_watermark))
            }
            PageDecision::First(Resume::Reset { .. } | Resume::StillResetting { .. } | Resume::Revoked) => None,
            PageDecision::Next(NextPage::Serve { after, upto }) => Some((after, upto)),
            PageDecision::Next(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_000;

    fn cursor(state: DeviceState, generation: u64, acked: u64) -> DeviceCursor {
        DeviceCursor { generation, acked_sync_seq: acked, state }
    }

    fn facts(device: DeviceCursor, head: u64, trimmed: u64, session: Option<RecoveryInfo>) -> SyncFacts {
        SyncFacts { device, log: UserLog { high_watermark: head, trimmed_upto: trimmed }, session }
    }

    fn session(id: &str, from: u64, hw: u64, expires: i64) -> Option<RecoveryInfo> {
        Some(RecoveryInfo { session_id: id.into(), resume_from: from, high_watermark: hw, expires_at_ms: expires })
    }

    fn first(generation: Option<u64>, local: u64) -> PageQuery {
        PageQuery::First {
            client: ClientPosition { generation, local_applied_sync_seq: Some(local) },
            policy: RecoveryPolicy { max_gap: 10, max_replay: 100 },
            now_ms: NOW,
        }
    }

    fn next(generation: u64, position: u64, hw: u64, session: Option<&str>) -> PageQuery {
        PageQuery::Next {
            generation,
            position,
            high_watermark: hw,
            recovery_session: session.map(str::to_owned),
            now_ms: NOW,
        }
    }

    /// One rule, one helper: the decision and the range it reads.
    fn check(input: (SyncFacts, PageQuery), expect: (PageDecision, Option<(u64, u64)>)) {
        let (facts, query) = input;
        let decision = decide_page(&facts, &query);
        assert_eq!((decision, decision.range(&facts)), expect, "facts {facts:?}, query {query:?}");
    }

    #[test]
    fn page_rules() {
        use DeviceState::*;
        use NextPage as N;
        use PageDecision::{First as F, Next as X};
        let active = cursor(Active, 3, 40);
        let recovering = cursor(Recovering, 4, 40);
        let cases = [
            // First pages: the resume rule, and the range it reads.
            (
                (facts(active, 90, 0, None), first(Some(3), 40)),
                (F(Resume::Replay { generation: 3, from: 40 }), Some((40, 90))),
            ),
            (
                (facts(active, 90, 40, None), first(Some(3), 40)),
                (F(Resume::Replay { generation: 3, from: 40 }), Some((40, 90))),
            ),
            // The ACK fell below the trimmed part: reset, no page at all.
            ((facts(active, 90, 41, None), first(Some(3), 40)), (F(Resume::Reset { expected: 3 }), None)),
            (
                (facts(active, 90, 0, None), first(Some(3), 35)),
                (F(Resume::Recover { expected: 3, from: 35 }), Some((35, 90))),
            ),
            (
                (facts(cursor(New, 1, 0), 90, 0, None), first(None, 0)),
                (F(Resume::Activate { generation: 1 }), Some((0, 90))),
            ),
            (
                (facts(cursor(Resetting, 2, 0), 90, 0, None), first(Some(2), 0)),
                (F(Resume::Rebuild { generation: 2 }), Some((0, 90))),
            ),
            (
                (facts(cursor(Resetting, 2, 0), 90, 5, None), first(Some(2), 0)),
                (F(Resume::StillResetting { generation: 2 }), None),
            ),
            // A first batch above `max_replay` (100): a snapshot, no page.
            ((facts(cursor(New, 1, 0), 101, 0, None), first(None, 0)), (F(Resume::Reset { expected: 1 }), None)),
            (
                (facts(cursor(Resetting, 2, 0), 101, 0, None), first(Some(2), 0)),
                (F(Resume::StillResetting { generation: 2 }), None),
            ),
            ((facts(active, 141, 0, None), first(Some(3), 40)), (F(Resume::Reset { expected: 3 }), None)),
            (
                (facts(recovering, 90, 0, session("r1", 35, 80, NOW + 1)), first(Some(4), 35)),
                (F(Resume::ContinueRecovery { generation: 4 }), Some((35, 80))),
            ),
            (
                (facts(recovering, 90, 0, session("r1", 35, 80, NOW)), first(Some(4), 35)),
                (F(Resume::Reset { expected: 4 }), None),
            ),
            ((facts(cursor(Revoked, 3, 40), 90, 0, None), first(Some(3), 40)), (F(Resume::Revoked), None)),
            // Next pages: the token's range, or why not.
            (
                (facts(active, 95, 0, None), next(3, 60, 90, None)),
                (X(N::Serve { after: 60, upto: 90 }), Some((60, 90))),
            ),
            (
                (facts(active, 95, 60, None), next(3, 60, 90, None)),
                (X(N::Serve { after: 60, upto: 90 }), Some((60, 90))),
            ),
            // Never a partial page: the rest of the batch was trimmed.
            ((facts(active, 95, 61, None), next(3, 60, 90, None)), (X(N::Reset), None)),
            ((facts(active, 95, 0, None), next(2, 60, 90, None)), (X(N::StaleGeneration { current: 3 }), None)),
            (
                (facts(cursor(Resetting, 3, 40), 95, 0, None), next(3, 60, 90, None)),
                (X(N::ResetRequired { generation: 3 }), None),
            ),
            (
                (facts(cursor(New, 3, 0), 95, 0, None), next(3, 60, 90, None)),
                (X(N::ResetRequired { generation: 3 }), None),
            ),
            ((facts(cursor(Revoked, 3, 40), 95, 0, None), next(2, 60, 90, None)), (X(N::Revoked), None)),
            (
                (facts(recovering, 95, 0, session("r1", 35, 80, NOW + 1)), next(4, 50, 80, Some("r1"))),
                (X(N::Serve { after: 50, upto: 80 }), Some((50, 80))),
            ),
            // The session expired, is another one, or is gone: reset.
            ((facts(recovering, 95, 0, session("r1", 35, 80, NOW)), next(4, 50, 80, Some("r1"))), (X(N::Reset), None)),
            (
                (facts(recovering, 95, 0, session("r2", 35, 80, NOW + 1)), next(4, 50, 80, Some("r1"))),
                (X(N::Reset), None),
            ),
            ((facts(recovering, 95, 0, None), next(4, 50, 80, Some("r1"))), (X(N::Reset), None)),
        ];
        for (input, expect) in cases {
            check(input, expect);
        }
    }
}
