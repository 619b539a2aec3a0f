//! Per-conversation incremental sync (C1–C2, seed 002): where a page
//! starts, when a request is refused, and where the client's cursor may
//! move after the page.
//!
//! The backend reads `head`, `min_seq` and `epoch` in the same read
//! snapshot as the events and calls these functions; they never look at
//! the events themselves.

use crate::MsgSeq;

/// Why a `conv.sync` request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvSyncRefusal {
    /// `after > head`: the client's cursor does not exist here (C2).
    CursorAhead { head: MsgSeq },
    /// The client's epoch is not the conversation's (C2).
    EpochChanged { epoch: u64 },
}

/// The conversation as seen by one read snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvSnapshot {
    pub head: MsgSeq,
    /// The lowest `msg_seq` still retained.
    pub min_seq: MsgSeq,
    pub epoch: u64,
}

/// Checks a request against the snapshot; returns `trimmed` (the start of
/// the requested range was removed by retention) when it may proceed.
pub fn check(snapshot: ConvSnapshot, after: MsgSeq, client_epoch: Option<u64>) -> Result<bool, ConvSyncRefusal> {
    if let Some(e) = client_epoch {
        if e != snapshot.epoch {
            return Err(ConvSyncRefusal::EpochChanged { epoch: snapshot.epoch });
        }
    }
    if after > snapshot.head {
        return Err(ConvSyncRefusal::CursorAhead { head: snapshot.head });
    }
    Ok(after + 1 < snapshot.min_seq)
}

/// `next_after` (seed 002 §3): on a page with more to come, the last
/// returned `msg_seq`; on the last page, `max(after, head)`, so ranges the
/// caller may not see (after a leave, before a join) are skipped instead of
/// being scanned again on every sync.
pub fn next_after(after: MsgSeq, head: MsgSeq, has_more: bool, last_returned: Option<MsgSeq>) -> MsgSeq {
    match (has_more, last_returned) {
        (true, Some(last)) => {
            assert!(last > after && last <= head, "a page lies inside (after, head]");
            last
        }
        (true, None) => unreachable!("a page with more to come returned events"),
        (false, _) => after.max(head),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SNAP: ConvSnapshot = ConvSnapshot { head: 70, min_seq: 1, epoch: 2 };

    #[test]
    fn refusals() {
        assert_eq!(check(SNAP, 71, None), Err(ConvSyncRefusal::CursorAhead { head: 70 }));
        assert_eq!(check(SNAP, 10, Some(1)), Err(ConvSyncRefusal::EpochChanged { epoch: 2 }));
        assert_eq!(check(SNAP, 70, Some(2)), Ok(false));
        let trimmed = ConvSnapshot { min_seq: 30, ..SNAP };
        assert_eq!(check(trimmed, 10, None), Ok(true));
        assert_eq!(check(trimmed, 29, None), Ok(false));
    }

    #[test]
    fn next_after_skips_invisible_tail() {
        // Left at 64, the conversation went on to 70: the last page ends at 64
        // but the cursor moves to 70.
        assert_eq!(next_after(60, 70, false, Some(64)), 70);
        assert_eq!(next_after(60, 70, true, Some(62)), 62);
        assert_eq!(next_after(70, 70, false, None), 70);
    }
}
