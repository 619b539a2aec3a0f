//! The per-conversation contiguous cursor and its pending buffer (K2).
//!
//! A conversation's `msg_seq` is contiguous and committed in order (S2), so a
//! client can tell a gap from the end of the log: holding 5 and 7 means 6
//! exists somewhere. [`ConvCursor`] moves only over a contiguous run: an
//! event at `cursor + 1` advances it (and drains whatever the pending buffer
//! holds just above), an event further ahead is buffered and reported as a
//! gap, and an event at or below the cursor is a duplicate. The position is
//! what the client asks the server to continue *after*, so it must never
//! pass a `msg_seq` the client does not hold: that message would never be
//! asked for again.
//!
//! [`Policy::MaxSeen`] (`cursor = max(cursor, seq)`) exists only as the
//! negative control of the tests: it behaves like the contiguous rule while
//! events arrive in order, and loses a message for good when they do not.
//!
//! This module owns the rule and nothing else. It is pure: no IO, no clock,
//! no async, and it does not know where events come from (a sync page, a
//! send reply, a future push path) or how they are stored; the local store
//! feeds it and persists its position.

use std::collections::BTreeSet;
use std::ops::RangeInclusive;

/// Out-of-order `msg_seq`s buffered per conversation. Past this bound an
/// event is not buffered ([`Offer::Overflow`]) and the cursor stays where it
/// is, so the event is fetched again later; nothing is skipped.
pub const PENDING_MAX: usize = 4096;

/// How the cursor moves when an event arrives ahead of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Only over a contiguous run; events above a gap wait in the buffer.
    Contiguous,
    /// `cursor = max(cursor, seq)`: jumps gaps. Negative control only.
    MaxSeen,
}

/// What one offered `msg_seq` did to the cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offer {
    /// At or below the cursor: already held; store it idempotently.
    Duplicate,
    /// The cursor moved from `from` to `to`: every `msg_seq` in
    /// `from + 1 ..= to` is now held (the offered one and any drained from
    /// the pending buffer).
    Advanced { from: u64, to: u64 },
    /// Buffered above a gap: `missing` is the first run the client lacks.
    /// The caller should sync; the cursor did not move.
    Buffered { missing: RangeInclusive<u64> },
    /// The pending buffer is full: the event was not buffered and the cursor
    /// did not move. It will be fetched again.
    Overflow,
}

/// What one cursor write did to the conversation's hole, for the gap
/// counts a device reports (`client.stats`, O1): a hole opens when a
/// conversation with none is left with [`ConvCursor::missing`], and is
/// repaired when its cursor is contiguous again. A hole that widens or
/// stays open is the same gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoleStep {
    /// No hole before, one now: one gap detected.
    Opened,
    /// A hole before, none now: one gap repaired.
    Closed,
    /// No change: still none, or the same gap still open.
    Same,
}

/// [`HoleStep`] from whether the conversation had a hole before this
/// write and whether its cursor has one now.
pub fn hole_step(was_open: bool, open_now: bool) -> HoleStep {
    match (was_open, open_now) {
        (false, true) => HoleStep::Opened,
        (true, false) => HoleStep::Closed,
        _ => HoleStep::Same,
    }
}

/// One conversation's cursor and pending buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvCursor {
    policy: Policy,
    position: u64,
    pending: BTreeSet<u64>,
}

impl ConvCursor {
    /// A cursor at `position` with an empty buffer.
    pub fn new(policy: Policy, position: u64) -> ConvCursor {
        ConvCursor { policy, position, pending: BTreeSet::new() }
    }

    /// Rebuilds a cursor from persisted state: the position and the
    /// `msg_seq`s held above it. Those that are already contiguous advance
    /// the position at once.
    pub fn restore(policy: Policy, position: u64, held_above: impl IntoIterator<Item = u64>) -> ConvCursor {
        let mut cursor = ConvCursor::new(policy, position);
        for seq in held_above {
            cursor.offer(seq);
        }
        cursor
    }

    /// The highest `msg_seq` such that every `msg_seq` up to it is held (for
    /// the contiguous policy); the point to continue a sync *after*.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Buffered `msg_seq`s above the cursor, ascending.
    pub fn pending(&self) -> impl Iterator<Item = u64> + '_ {
        self.pending.iter().copied()
    }

    /// The first run of `msg_seq`s missing below a buffered one, if any.
    pub fn missing(&self) -> Option<RangeInclusive<u64>> {
        let first = *self.pending.first()?;
        Some(self.position + 1..=first - 1)
    }

    /// The server declared every `msg_seq` up to `position` outside this
    /// client's view (its membership period starts above it, §3.4.2): they
    /// are not a gap. Moves there (never back) and drains what follows.
    /// Returns the move, if any.
    pub fn start_at(&mut self, position: u64) -> Option<Offer> {
        if position <= self.position {
            return None;
        }
        let from = self.position;
        self.position = position;
        self.pending.retain(|&s| s > position);
        while self.pending.remove(&(self.position + 1)) {
            self.position += 1;
        }
        Some(Offer::Advanced { from, to: self.position })
    }

    /// Offers one event's `msg_seq` (from any source, any order, possibly
    /// again).
    pub fn offer(&mut self, seq: u64) -> Offer {
        if seq <= self.position {
            return Offer::Duplicate;
        }
        match self.policy {
            Policy::MaxSeen => {
                let from = self.position;
                self.position = seq;
                self.pending.retain(|&s| s > seq);
                Offer::Advanced { from, to: seq }
            }
            Policy::Contiguous if seq == self.position + 1 => {
                let from = self.position;
                self.position = seq;
                while self.pending.remove(&(self.position + 1)) {
                    self.position += 1;
                }
                Offer::Advanced { from, to: self.position }
            }
            Policy::Contiguous => {
                if !self.pending.contains(&seq) && self.pending.len() >= PENDING_MAX {
                    return Offer::Overflow;
                }
                self.pending.insert(seq);
                let missing = self.missing().expect("the buffer holds at least the offered seq");
                Offer::Buffered { missing }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(policy: Policy, offers: &[u64], expect: &[Offer], position: u64) {
        let mut c = ConvCursor::new(policy, 0);
        let got: Vec<Offer> = offers.iter().map(|&s| c.offer(s)).collect();
        assert_eq!(got, expect, "offers {offers:?}");
        assert_eq!(c.position(), position);
    }

    #[test]
    fn contiguous_buffers_above_a_gap_and_drains_when_it_fills() {
        use Offer::*;
        check(
            Policy::Contiguous,
            &[1, 3, 4, 3, 1, 2, 5],
            &[
                Advanced { from: 0, to: 1 },
                Buffered { missing: 2..=2 },
                Buffered { missing: 2..=2 },
                Buffered { missing: 2..=2 },
                Duplicate,
                Advanced { from: 1, to: 4 },
                Advanced { from: 4, to: 5 },
            ],
            5,
        );
    }

    #[test]
    fn a_hole_counts_once_when_it_opens_and_once_when_it_closes() {
        let cases = [
            (false, false, HoleStep::Same),
            (false, true, HoleStep::Opened),
            (true, true, HoleStep::Same),
            (true, false, HoleStep::Closed),
        ];
        for (was, now, expect) in cases {
            assert_eq!(hole_step(was, now), expect, "{was} -> {now}");
        }
        // Through the cursor: 3 opens the hole, 4 widens nothing new, 2
        // closes it.
        let mut c = ConvCursor::new(Policy::Contiguous, 1);
        let mut steps = Vec::new();
        for s in [3, 4, 2, 5] {
            let was = c.missing().is_some();
            c.offer(s);
            steps.push(hole_step(was, c.missing().is_some()));
        }
        assert_eq!(steps, [HoleStep::Opened, HoleStep::Same, HoleStep::Closed, HoleStep::Same]);
    }

    #[test]
    fn max_seen_jumps_the_gap() {
        use Offer::*;
        check(Policy::MaxSeen, &[2, 1, 3], &[Advanced { from: 0, to: 2 }, Duplicate, Advanced { from: 2, to: 3 }], 3);
    }

    #[test]
    fn restore_drains_what_is_already_contiguous() {
        let c = ConvCursor::restore(Policy::Contiguous, 3, [4, 5, 7]);
        assert_eq!(c.position(), 5);
        assert_eq!(c.missing(), Some(6..=6));
        assert_eq!(c.pending().collect::<Vec<_>>(), vec![7]);
    }

    #[test]
    fn a_period_start_is_not_a_gap() {
        let mut c = ConvCursor::new(Policy::Contiguous, 0);
        assert!(matches!(c.offer(9), Offer::Buffered { .. }));
        assert_eq!(c.start_at(7), Some(Offer::Advanced { from: 0, to: 7 }));
        assert_eq!(c.offer(8), Offer::Advanced { from: 7, to: 9 });
        assert_eq!(c.start_at(3), None, "never back");
    }

    #[test]
    fn a_full_buffer_refuses_without_moving() {
        let mut c = ConvCursor::new(Policy::Contiguous, 0);
        for s in 0..PENDING_MAX as u64 {
            assert!(matches!(c.offer(s + 2), Offer::Buffered { .. }));
        }
        assert_eq!(c.offer(PENDING_MAX as u64 + 5), Offer::Overflow);
        assert!(matches!(c.offer(2), Offer::Buffered { .. }), "an already buffered seq is not an overflow");
        assert_eq!(c.offer(1), Offer::Advanced { from: 0, to: PENDING_MAX as u64 + 1 });
    }
}
