//! Retention (L1–L3): how far a user's log may be trimmed, and where a
//! conversation's history boundary moves. Backends read the fences in
//! their write transaction and delete what these allow.

use crate::{MsgSeq, SyncSeq};

/// What fences one user's log, as read by the retention pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fences {
    pub high_watermark: SyncSeq,
    pub trimmed_upto: SyncSeq,
    /// The lowest ACK of the user's valid devices (`ACTIVE` or
    /// `RECOVERING`, moved within the inactivity window); `None` without one.
    pub device: Option<SyncSeq>,
    /// The lowest `resume_from` of a live recovery session.
    pub recovery: Option<SyncSeq>,
    /// The lowest base of a live snapshot.
    pub snapshot: Option<SyncSeq>,
    /// The newest event older than the keep window; `None` when every
    /// event is younger.
    pub aged: Option<SyncSeq>,
    /// The user was deleted: no device will ever read its log again.
    pub deleted: bool,
}

/// L1: the new trim point of a user's log, or `None` to leave it. Never
/// past the lowest fence, nor past what is old enough, nor the head; a user
/// without any valid device keeps the log (a device may still log in and
/// get a snapshot; trimming would only save space). A deleted user's log
/// is trimmed to its head: what still reaches it is read by no one.
pub fn trim_to(f: Fences) -> Option<SyncSeq> {
    if f.deleted {
        return (f.high_watermark > f.trimmed_upto).then_some(f.high_watermark);
    }
    let device = f.device?;
    let fence = [Some(device), f.recovery, f.snapshot, Some(f.aged.unwrap_or(0)), Some(f.high_watermark)]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(0);
    (fence > f.trimmed_upto).then_some(fence)
}

/// L3: a conversation's new history boundary (`min_seq`): the first
/// message younger than the cutoff, or past the head when none is; `None`
/// when the boundary does not move up.
pub fn history_boundary(head: MsgSeq, min_seq: MsgSeq, first_young: Option<MsgSeq>) -> Option<MsgSeq> {
    let boundary = first_young.unwrap_or(head + 1);
    (boundary > min_seq).then_some(boundary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trim_rules() {
        fn check(input: Fences, expect: Option<u64>) {
            assert_eq!(trim_to(input), expect, "{input:?}");
        }
        let f = Fences { high_watermark: 100, trimmed_upto: 10, device: Some(60), aged: Some(90), ..Fences::default() };
        check(f, Some(60));
        check(Fences { device: None, ..f }, None);
        check(Fences { recovery: Some(30), ..f }, Some(30));
        check(Fences { snapshot: Some(20), recovery: Some(30), ..f }, Some(20));
        check(Fences { aged: Some(50), ..f }, Some(50));
        check(Fences { aged: None, ..f }, None);
        check(Fences { device: Some(500), aged: Some(500), ..f }, Some(100));
        check(Fences { device: Some(10), ..f }, None);
        check(Fences { snapshot: Some(5), ..f }, None);
        // A deleted user: to the head, whatever else (nothing reads it).
        check(Fences { deleted: true, device: None, aged: None, ..f }, Some(100));
        check(Fences { deleted: true, trimmed_upto: 100, ..f }, None);
    }

    #[test]
    fn history_rules() {
        fn check(input: (u64, u64, Option<u64>), expect: Option<u64>) {
            assert_eq!(history_boundary(input.0, input.1, input.2), expect, "{input:?}");
        }
        check((10, 1, Some(4)), Some(4));
        check((10, 1, None), Some(11));
        check((10, 4, Some(4)), None);
        check((10, 11, None), None);
        check((0, 1, None), None);
    }
}
