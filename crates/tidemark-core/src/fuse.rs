//! The fused fan-out (issue 19): where one writer owns the database (the
//! embedded SQLite store), a batch of writes that appended to the outbox
//! also fans the pending outbox out in its own transaction, so a message's
//! accept and its fan-out cost one commit (one fsync) instead of two before
//! its hint can leave.
//!
//! The fused fan-out takes the outbox as the relay does, oldest first, and
//! stops at the first item this rule refuses; that item and every later one
//! stay in the outbox for the relay. Taking a prefix keeps the order the
//! relay keeps: a user's log receives a conversation's events in outbox
//! order whoever fans them out.
//!
//! The bound is on the user events the fused fan-out writes, since those are
//! what it adds to the commit of every request of the batch: the sends of a
//! direct conversation or a small group fuse, a big per-member group's
//! fan-out stays on the relay so it delays no unrelated send's answer.

/// Most user events a fused fan-out may write into the transaction of the
/// writes that fed it (about four statements each). A per-member group of
/// more members than this is always fanned out by the relay.
pub const FUSED_EVENTS_MAX: u64 = 256;

/// Whether the next outbox item, which delivers to `recipients` users, joins
/// a fused fan-out that has already written `events` user events. The first
/// refusal ends the fused fan-out (see the module).
pub fn admits(events: u64, recipients: u64) -> bool {
    events.saturating_add(recipients) <= FUSED_EVENTS_MAX
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_items_while_the_events_stay_within_the_bound() {
        // (events already written, the next item's recipients, admitted)
        let cases = [
            (0, 0, true),
            // A direct conversation's message: two recipients.
            (0, 2, true),
            (254, 2, true),
            (255, 2, false),
            // A group of exactly the bound, alone.
            (0, FUSED_EVENTS_MAX, true),
            // One member more: the relay's, even as the first item.
            (0, FUSED_EVENTS_MAX + 1, false),
            (FUSED_EVENTS_MAX, 0, true),
            (FUSED_EVENTS_MAX, 1, false),
            (u64::MAX, 1, false),
        ];
        for (events, recipients, want) in cases {
            assert_eq!(admits(events, recipients), want, "events {events}, recipients {recipients}");
        }
    }
}
