//! Large groups (G2, G3): a shared conversation log, a level-triggered
//! dirty marker per member, and the one-way switch from per-member fan-out.
//!
//! A group is in one of two modes. In *per-member* mode every conversation
//! event is fanned out into each member's sync log (F4). In *shared* mode
//! the events above the switch live only in the conversation log; members'
//! devices read them with `conv.sync` from their own saved `last_msg_seq`,
//! within their membership periods (G1), and learn that there is something
//! to read from a *marker*:
//!
//! - the conversation keeps one published `(target, version)`: the outbox
//!   relay raises `target` to the highest `msg_seq` it processed and bumps
//!   `version` once per relay batch that moved the conversation, so marker
//!   writes cost one row per batch, whatever the message rate and the
//!   member count;
//! - a member's marker is that pair, its target capped at the member's last
//!   visible `msg_seq` once the member left ([`marker`]);
//! - each device records what it cleared: a marker is dirty for a device
//!   while the device's cleared position is below the target; a clear is a
//!   CAS on the version the device observed and succeeds only when the
//!   device's saved `last_msg_seq` reaches the target ([`decide_clear`]).
//!
//! The switch is a conversation event at a `msg_seq` (`conv.mode`), the last
//! event fanned out per member: a device holds every event up to it from
//! its sync log and reads every later one from the conversation log, so
//! nothing is missed or served twice (G3). It is one-way: a group never
//! returns to per-member mode (that would need a per-member backfill of the
//! shared range); the threshold only decides when a group leaves it.

use crate::kinds::{KIND_JOIN, KIND_LEAVE};
use crate::{MsgSeq, Refusal};

/// The two modes of a group (a direct conversation is always per member).
pub const MODE_PER_MEMBER: &str = "per_member";
pub const MODE_SHARED: &str = "shared";

/// Most members a group in per-member mode may have: the cap of the
/// threshold (`tidemark serve --large-group-members`).
pub const PER_MEMBER_MAX: u64 = 1000;
/// The default threshold: a group with more active members than this is in
/// shared mode.
pub const LARGE_GROUP_MEMBERS_DEFAULT: u64 = 500;
/// Unread in shared mode is counted from the conversation log on read,
/// exactly up to this many; above it the count reads as this value and the
/// summary says `unread_capped` (seed §10.3's controlled approximation).
pub const UNREAD_COUNT_MAX: u64 = 999;

/// When a group leaves per-member mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPolicy {
    /// A group with more active members than this is in shared mode.
    pub large_members: u64,
}

impl Default for GroupPolicy {
    fn default() -> Self {
        GroupPolicy { large_members: LARGE_GROUP_MEMBERS_DEFAULT }
    }
}

impl GroupPolicy {
    /// A policy with the threshold checked against [`PER_MEMBER_MAX`].
    pub fn new(large_members: u64) -> Result<GroupPolicy, Refusal> {
        if large_members > PER_MEMBER_MAX {
            return Err(Refusal::Invalid(format!(
                "the large-group threshold is at most {PER_MEMBER_MAX} members (per-member fan-out)"
            )));
        }
        Ok(GroupPolicy { large_members })
    }

    /// The mode a new group of `members` starts in.
    pub fn mode_for_new_group(&self, members: u64) -> &'static str {
        if members > self.large_members {
            MODE_SHARED
        } else {
            MODE_PER_MEMBER
        }
    }

    /// G3: a group in `mode` with `active_members` after a join switches to
    /// shared mode now.
    pub fn switches(&self, mode: &str, active_members: u64) -> bool {
        mode == MODE_PER_MEMBER && active_members > self.large_members
    }
}

/// How the fan-out treats one conversation event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Into each recipient's sync log (per-member mode, and the switch).
    PerMember,
    /// Only the subject of a membership change gets a sync-log entry (so
    /// the conversation appears in, or leaves, their list); everyone reads
    /// the event from the conversation log. The marker moves.
    Subject,
    /// Conversation log only; the marker moves.
    Shared,
}

/// How the event at `msg_seq` of `kind` is routed in a conversation in
/// `mode` that switched at `shared_from` (the switch event's `msg_seq`).
pub fn route(mode: &str, shared_from: Option<MsgSeq>, msg_seq: MsgSeq, kind: &str) -> Route {
    match (mode, shared_from) {
        (MODE_SHARED, Some(from)) if msg_seq > from => {
            if kind == KIND_JOIN || kind == KIND_LEAVE {
                Route::Subject
            } else {
                Route::Shared
            }
        }
        _ => Route::PerMember,
    }
}

/// Values of the `conv_kind` label of the fan-out metrics (seed §18.1:
/// amplification per conversation kind), see [`fanout_class`].
pub const FANOUT_CLASSES: &[&str] = &["direct", "group", "large"];

/// The class a fan-out item is measured under: `direct`, `group` (a group
/// event written per member) or `large` (a shared group's event, written to
/// the conversation log and at most its subject's log), from the
/// conversation's kind and the item's route.
pub fn fanout_class(conv_kind: &str, route: Route) -> &'static str {
    match (conv_kind, route) {
        (_, Route::Shared | Route::Subject) => "large",
        (crate::kinds::CONV_DIRECT, Route::PerMember) => "direct",
        (_, Route::PerMember) => "group",
    }
}

/// A period miss (seed §18.1): an item routed to members whose `msg_seq`
/// no membership period covers. The writer only accepts an event from a
/// member, so its own period always covers it; a miss means the periods
/// and the conversation log disagree (an integrity error, counted, never
/// delivered to anyone chosen by the current member list).
pub fn period_miss(route: Route, periods_covering: usize) -> bool {
    route != Route::Shared && periods_covering == 0
}

/// A member's marker as served (`conv.list`, sync, hints).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker {
    /// Only grows: the highest `msg_seq` the member may read that the
    /// relay published.
    pub target: MsgSeq,
    /// Only increments.
    pub version: u64,
    /// The asking device has not cleared up to `target`.
    pub dirty: bool,
}

/// What a marker is computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkerFacts {
    /// The conversation's published target and version.
    pub published_target: MsgSeq,
    pub version: u64,
    /// The member's last visible `msg_seq` once no period is open (the
    /// `leave_seq` of the last period); `None` while a member.
    pub left_at: Option<MsgSeq>,
    /// What the device cleared up to (0 if never).
    pub cleared_seq: MsgSeq,
}

/// G2: the member's marker for one device.
pub fn marker(f: &MarkerFacts) -> Marker {
    let target = f.left_at.map_or(f.published_target, |left| left.min(f.published_target));
    Marker { target, version: f.version, dirty: f.cleared_seq < target }
}

/// What `dirty.clear` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearDecision {
    /// Record `cleared_seq` (the target) for the device: the marker is clean.
    Cleared { cleared_seq: MsgSeq },
    /// The version moved since the device read it, or the device's
    /// `last_msg_seq` does not reach the target: nothing is written and the
    /// marker stays dirty (seed §10.3: never clear before the pull).
    Stale,
}

/// G2: the clear CAS. `observed_version` is what the device read with the
/// marker, `last_msg_seq` what it saved locally after its pull.
pub fn decide_clear(f: &MarkerFacts, observed_version: u64, last_msg_seq: MsgSeq) -> ClearDecision {
    let m = marker(f);
    if observed_version != m.version || last_msg_seq < m.target {
        return ClearDecision::Stale;
    }
    ClearDecision::Cleared { cleared_seq: m.target.max(f.cleared_seq) }
}

/// The marker after a relay batch whose highest event is `max_seq`: the
/// target only grows, the version increments once.
pub fn publish(target: MsgSeq, version: u64, max_seq: MsgSeq) -> (MsgSeq, u64) {
    (target.max(max_seq), version + 1)
}

/// R3 in shared mode: where the unread count above the switch is read
/// from the log, `(above, upto]`: above the read cursor and the switch
/// (below it the projection counts), up to the member's marker target.
/// `None` when the window is empty (nothing to count).
pub fn unread_window(read_seq: MsgSeq, shared_from: MsgSeq, target: MsgSeq) -> Option<(MsgSeq, MsgSeq)> {
    let above = read_seq.max(shared_from);
    (target > above).then_some((above, target))
}

/// Unread in shared mode: `counted` messages from others above the read
/// cursor (counted up to [`UNREAD_COUNT_MAX`] + 1), as `(unread, capped)`.
pub fn shared_unread(counted: u64) -> (u64, bool) {
    if counted > UNREAD_COUNT_MAX {
        (UNREAD_COUNT_MAX, true)
    } else {
        (counted, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::{KIND_CREATED, KIND_RECALL};

    #[test]
    fn fanout_classes_and_period_misses() {
        let cases = [
            ("direct", Route::PerMember, "direct"),
            ("group", Route::PerMember, "group"),
            ("group", Route::Subject, "large"),
            ("group", Route::Shared, "large"),
        ];
        for (kind, route, class) in cases {
            assert_eq!(fanout_class(kind, route), class, "{kind} {route:?}");
            assert!(FANOUT_CLASSES.contains(&class));
        }
        assert!(period_miss(Route::PerMember, 0));
        assert!(period_miss(Route::Subject, 0));
        assert!(!period_miss(Route::PerMember, 2));
        assert!(!period_miss(Route::Shared, 0), "a shared event has no per-member recipients by design");
    }

    fn facts(target: u64, version: u64, left_at: Option<u64>, cleared: u64) -> MarkerFacts {
        MarkerFacts { published_target: target, version, left_at, cleared_seq: cleared }
    }

    fn check_marker(f: MarkerFacts, expect: (u64, bool)) {
        let m = marker(&f);
        assert_eq!((m.target, m.dirty), expect, "{f:?}");
        assert_eq!(m.version, f.version);
    }

    #[test]
    fn a_marker_is_dirty_until_the_device_cleared_its_target() {
        check_marker(facts(0, 0, None, 0), (0, false));
        check_marker(facts(10, 3, None, 0), (10, true));
        check_marker(facts(10, 3, None, 9), (10, true));
        check_marker(facts(10, 3, None, 10), (10, false));
        // A member who left sees up to their leave, whatever moves after.
        check_marker(facts(50, 9, Some(20), 0), (20, true));
        check_marker(facts(50, 9, Some(20), 20), (20, false));
        check_marker(facts(15, 9, Some(20), 15), (15, false));
    }

    fn check_clear(f: MarkerFacts, observed: u64, last: u64, expect: ClearDecision) {
        assert_eq!(decide_clear(&f, observed, last), expect, "{f:?} observed {observed} last {last}");
    }

    #[test]
    fn a_clear_is_a_version_cas_after_the_pull() {
        use ClearDecision::*;
        // The seed's race: read (10, v3), a message moves it to (11, v4),
        // the clear with v3 fails and the marker stays dirty.
        check_clear(facts(11, 4, None, 0), 3, 10, Stale);
        assert!(marker(&facts(11, 4, None, 0)).dirty);
        // Caught up and observed the new version: cleared.
        check_clear(facts(11, 4, None, 0), 4, 11, Cleared { cleared_seq: 11 });
        // The right version but not pulled far enough: never cleared first.
        check_clear(facts(11, 4, None, 0), 4, 10, Stale);
        // Pulled past the published target (the log moved on): clears at
        // the target, which stays what the device confirmed.
        check_clear(facts(11, 4, None, 0), 4, 30, Cleared { cleared_seq: 11 });
        // A member who left clears at the leave.
        check_clear(facts(50, 9, Some(20), 0), 9, 20, Cleared { cleared_seq: 20 });
        // The cleared position never goes back.
        check_clear(facts(11, 4, Some(5), 8), 4, 8, Cleared { cleared_seq: 8 });
    }

    #[test]
    fn publishing_only_raises_the_target_and_bumps_the_version() {
        assert_eq!(publish(10, 3, 12), (12, 4));
        assert_eq!(publish(10, 3, 7), (10, 4));
        assert_eq!(publish(0, 0, 1), (1, 1));
    }

    #[test]
    fn the_switch_is_one_way_above_the_threshold() {
        let p = GroupPolicy::new(3).unwrap();
        assert_eq!(p.mode_for_new_group(3), MODE_PER_MEMBER);
        assert_eq!(p.mode_for_new_group(4), MODE_SHARED);
        assert!(!p.switches(MODE_PER_MEMBER, 3));
        assert!(p.switches(MODE_PER_MEMBER, 4));
        assert!(!p.switches(MODE_SHARED, 4));
        assert!(!p.switches(MODE_SHARED, 1));
        assert!(GroupPolicy::new(PER_MEMBER_MAX).is_ok());
        assert!(GroupPolicy::new(PER_MEMBER_MAX + 1).is_err());
    }

    fn check_route(mode: &str, from: Option<u64>, seq: u64, kind: &str, expect: Route) {
        assert_eq!(route(mode, from, seq, kind), expect, "{mode} {from:?} {seq} {kind}");
    }

    #[test]
    fn events_above_the_switch_stay_in_the_conversation_log() {
        check_route(MODE_PER_MEMBER, None, 5, "text", Route::PerMember);
        // The switch event itself and everything before it: per member.
        check_route(MODE_SHARED, Some(7), 5, "text", Route::PerMember);
        check_route(MODE_SHARED, Some(7), 7, crate::kinds::KIND_MODE, Route::PerMember);
        check_route(MODE_SHARED, Some(7), 8, "text", Route::Shared);
        check_route(MODE_SHARED, Some(7), 9, KIND_RECALL, Route::Shared);
        check_route(MODE_SHARED, Some(7), 9, KIND_JOIN, Route::Subject);
        check_route(MODE_SHARED, Some(7), 9, KIND_LEAVE, Route::Subject);
        // A group created shared: its conv.created is the switch.
        check_route(MODE_SHARED, Some(1), 1, KIND_CREATED, Route::PerMember);
    }

    #[test]
    fn unread_is_counted_above_the_read_cursor_and_the_switch_up_to_the_target() {
        assert_eq!(unread_window(0, 4, 9), Some((4, 9)), "below the switch the projection counts");
        assert_eq!(unread_window(6, 4, 9), Some((6, 9)));
        assert_eq!(unread_window(9, 4, 9), None, "all read");
        assert_eq!(unread_window(0, 4, 4), None, "nothing above the switch yet");
    }

    #[test]
    fn shared_unread_is_exact_up_to_its_cap() {
        assert_eq!(shared_unread(0), (0, false));
        assert_eq!(shared_unread(UNREAD_COUNT_MAX), (UNREAD_COUNT_MAX, false));
        assert_eq!(shared_unread(UNREAD_COUNT_MAX + 1), (UNREAD_COUNT_MAX, true));
    }
}
