//! The checker: given what the scenario sent, what the server accepted or
//! refused, every membership change with the `msg_seq` the server gave it,
//! and what every device holds after the run settled, it lists every
//! violation of the sync guarantees, message by message. It is pure: no IO,
//! no clock, no client; the scenario collects the facts and hands them over.
//!
//! Membership periods come from the facts alone ([`periods`]): a direct
//! conversation's two users and a group's creation members hold a period
//! from `msg_seq` 1, each `conv.add` opens a new one at its `member.join`
//! event and each `conv.remove`/`conv.leave` closes the open one at its
//! `member.leave` event, both ends inclusive ([`Period::covers`], G1).
//!
//! Globally:
//! - every queued send was accepted, or refused `NOT_MEMBER` in a group
//!   its sender was out of at some point from the moment it was queued;
//!   an accepted send lies inside one of its sender's periods (G1);
//! - no two events share a `msg_seq`, and every `msg_seq` of a
//!   conversation up to its last known one is accounted for by an accepted
//!   send or a membership event (S2: a refused send leaves no hole).
//!
//! Per device, for every conversation its user ever had a period in:
//! - every accepted message and every membership event whose `msg_seq` lies
//!   inside one of the user's periods is present exactly once, at that
//!   `msg_seq` (messages with the `message_id` the server gave their
//!   sender: S1, S2);
//! - every one outside all of the user's periods is absent (G1, F4);
//! - events are in strictly increasing `msg_seq` with no hole inside a
//!   period above `history_to` (a snapshot's history is not a hole, the gap
//!   between two periods is not either), and the conversation's contiguous
//!   cursor reaches its last event (K2);
//! - the conversation is `active` exactly when the user's last period is
//!   open;
//! - nothing is held that nobody sent, or from a conversation the user never
//!   had a period in.
//!
//! Snapshots (D7). A device rebuilt from a snapshot holds, per
//! conversation, the latest `snapshot_events_per_conv` events of the user's
//! view at the snapshot's base, and sets `history_to` right below the first
//! of them; everything after the base comes by sync. So, per conversation
//! with `history_to` > 0:
//! - the device installed a snapshot (nothing else sets `history_to`);
//! - `history_to + 1` is an event of the user's view (the snapshot's first),
//!   and if any event of the view lies at or below `history_to`, the
//!   snapshot was full: at least `snapshot_events_per_conv` events of the
//!   view lie above it, and exactly that many are held above it without a
//!   `sync_seq` (installed by the snapshot, not delivered by the log; never
//!   more than that many in any case);
//! - above `history_to` the rules above hold unchanged: every event of the
//!   user's periods once, in order, at its `msg_seq`, nothing outside them;
//! - an event of the user's periods at or below `history_to` may be absent
//!   locally only because it is history: `history` (fetched by the scenario
//!   below `history_to + 1`) must serve it exactly once, as accepted; and
//!   `history` serves nothing outside the user's periods (G1), nothing
//!   above the boundary, newest first.
//!
//! Cursor monotonicity is checked while the run goes (see
//! [`crate::scenario`]), since only the change stream sees every move.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use tidemark_client::{Conversation, Message};

/// One message the scenario queued.
#[derive(Debug, Clone)]
pub struct Sent {
    /// Unique per run; carried in the content as `tag`.
    pub tag: String,
    pub conv: String,
    pub user: String,
    pub device: String,
    pub client_msg_id: String,
    /// The scenario step it was queued at (the index of the send phase's
    /// loop): after every membership change of that step, before those of
    /// later steps.
    pub step: usize,
}

/// What the server answered for a send (`send.ok`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub msg_seq: u64,
    pub message_id: String,
}

/// What one device holds locally once the run settled.
#[derive(Debug, Clone)]
pub struct DeviceView {
    pub user: String,
    pub device: String,
    pub conversations: Vec<Conversation>,
    /// Every event of each conversation of `conversations`, in the order
    /// the SDK returns them.
    pub events: BTreeMap<String, Vec<Message>>,
    /// Snapshots the device installed during the run; `None` when its
    /// change stream lagged and the count may be short.
    pub snapshots_installed: Option<u64>,
    /// For each conversation with `history_to` > 0: what `history` serves
    /// the user below `history_to + 1`, newest first, or its refusal.
    pub history: BTreeMap<String, Result<Vec<Message>, String>>,
}

/// A group membership operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemberOp {
    /// `conv.add`: a `member.join` event opens a new period at its `msg_seq`.
    Add,
    /// `conv.remove` (by the owner): a `member.leave` event closes the
    /// target's open period at its `msg_seq`.
    Remove,
    /// `conv.leave` (by the target): as a removal.
    Leave,
}

impl MemberOp {
    pub const ALL: [MemberOp; 3] = [MemberOp::Add, MemberOp::Remove, MemberOp::Leave];

    /// The wire op.
    pub fn op(self) -> &'static str {
        match self {
            MemberOp::Add => "conv.add",
            MemberOp::Remove => "conv.remove",
            MemberOp::Leave => "conv.leave",
        }
    }

    /// The kind of the conversation event it makes (docs/protocol.md §3.4.1).
    pub fn event_kind(self) -> &'static str {
        match self {
            MemberOp::Add => "member.join",
            MemberOp::Remove | MemberOp::Leave => "member.leave",
        }
    }
}

/// A membership change the server made: the `msg_seq` is its reply's, the
/// position of its `member.join`/`member.leave` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipChange {
    pub conv: String,
    pub op: MemberOp,
    /// The user who joined or is out.
    pub user: String,
    /// The caller.
    pub by: String,
    pub msg_seq: u64,
    /// The scenario step it was made at, before that step's send.
    pub step: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvKind {
    Direct,
    Group,
}

/// What the scenario knows of one conversation.
#[derive(Debug, Clone)]
pub struct ConvFacts {
    pub kind: ConvKind,
    /// Members from `msg_seq` 1: both users of a direct conversation; the
    /// creator and the listed members of a group, whose `conv.created`
    /// event is `msg_seq` 1 (docs/protocol.md §3.5).
    pub members: Vec<String>,
    /// A group's membership changes, any order.
    pub changes: Vec<MembershipChange>,
    /// A group in shared mode (G2, G3): the `msg_seq` of its `conv.mode`
    /// event in the conversation log. Every event up to it is delivered by
    /// the members' sync logs, every one above it is read with `conv.sync`
    /// (so it is held without a `sync_seq`). `None`: per-member throughout.
    pub shared_from: Option<u64>,
}

/// One membership period `[join, leave]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub join: u64,
    /// `None` while open.
    pub leave: Option<u64>,
}

impl Period {
    /// The visibility rule (G1, F4; docs/protocol.md §3.4.2): a period
    /// covers `seq` iff `join <= seq <= leave`, **both ends inclusive**, an
    /// open period having no upper end. So the joiner sees its own
    /// `member.join` event and everything after it, nothing before it (a
    /// rejoin opens a new period and the gap between periods stays
    /// invisible); the leaver sees its own `member.leave` event and nothing
    /// after it. This is the server's rule in every path:
    /// `tidemark_core::membership::Period::covers` (fan-out through
    /// `recipients_at`), `periods_covering` in tidemark-sqlite's `lib.rs`
    /// (fan-out's period query), `read::VISIBLE` (sync, history,
    /// snapshots) and `events::change_membership`, which inserts the period
    /// at the join event's `msg_seq` and sets `leave_seq` to the leave
    /// event's `msg_seq`.
    pub fn covers(&self, seq: u64) -> bool {
        self.join <= seq && self.leave.is_none_or(|leave| seq <= leave)
    }
}

/// Every user's periods in one conversation, in `msg_seq` order, derived
/// from its facts; `Err` when the changes contradict each other (a join of
/// a current member, a leave of a non-member, two changes at one
/// `msg_seq`, a change at `msg_seq` 1).
pub fn periods(conv: &ConvFacts) -> Result<BTreeMap<String, Vec<Period>>, String> {
    let mut out: BTreeMap<String, Vec<Period>> = BTreeMap::new();
    for m in &conv.members {
        out.insert(m.clone(), vec![Period { join: 1, leave: None }]);
    }
    let mut changes: Vec<&MembershipChange> = conv.changes.iter().collect();
    changes.sort_by_key(|c| c.msg_seq);
    let mut last_seq = 1;
    for c in changes {
        if c.msg_seq <= last_seq {
            return Err(format!("{} {} at msg_seq {}, not after msg_seq {last_seq}", c.op.op(), c.user, c.msg_seq));
        }
        last_seq = c.msg_seq;
        let ps = out.entry(c.user.clone()).or_default();
        let open = ps.last_mut().filter(|p| p.leave.is_none());
        match (c.op, open) {
            (MemberOp::Add, None) => ps.push(Period { join: c.msg_seq, leave: None }),
            (MemberOp::Add, Some(p)) => {
                return Err(format!("{} added at msg_seq {} while a member since {}", c.user, c.msg_seq, p.join))
            }
            (_, Some(p)) => p.leave = Some(c.msg_seq),
            (op, None) => return Err(format!("{} {} at msg_seq {} while not a member", op.op(), c.user, c.msg_seq)),
        }
    }
    Ok(out)
}

/// Was `user` out of the conversation at some point from `step` on (at the
/// end of `step`'s membership changes, or after a later removal or leave)?
/// A send queued at `step` may then be refused `NOT_MEMBER`: the server
/// decides at its own linearisation point, which the scenario cannot see.
fn out_at_or_after(conv: &ConvFacts, user: &str, step: usize) -> bool {
    let mut mine: Vec<&MembershipChange> = conv.changes.iter().filter(|c| c.user == user).collect();
    mine.sort_by_key(|c| (c.step, c.msg_seq));
    let mut member = conv.members.iter().any(|m| m == user);
    for c in mine {
        if c.step <= step {
            member = c.op == MemberOp::Add;
        } else if c.op != MemberOp::Add {
            return true;
        }
    }
    !member
}

/// What the checker found.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    /// (device, message) pairs found exactly right, every conversation.
    pub verified: u64,
    /// (device, event) pairs of the user's periods at or below the device's
    /// `history_to`, not held (left as history by a snapshot) and served
    /// exactly once by `history`.
    pub history_only: u64,
    /// Conversations held from a snapshot's boundary (`history_to` > 0).
    pub history_boundaries: u64,
    /// Devices that installed a snapshot.
    pub rebuilt_devices: usize,
    /// (device, message) pairs found exactly right on rebuilt devices (a
    /// part of `verified`)...
    pub verified_after_snapshot: u64,
    /// ...of which held without a `sync_seq`: installed by the snapshot.
    pub from_snapshot: u64,
    pub devices: usize,
    pub groups: usize,
    pub membership_changes: usize,
    /// Sends accepted in a group.
    pub group_accepted: u64,
    /// Group sends refused `NOT_MEMBER`, rightly: the sender was out at
    /// some point after queueing them.
    pub refused_not_member: u64,
    /// (device, group message) pairs inside the user's periods found
    /// exactly right (a part of `verified`).
    pub group_verified: u64,
    /// (device, `conv.created`/`member.join`/`member.leave`/`conv.mode`
    /// event) pairs inside the user's periods found exactly once.
    pub membership_events_verified: u64,
    /// Groups in shared mode at the end (a `conv.mode` in their log).
    pub shared_groups: usize,
    /// (device, group message above its group's switch) pairs found
    /// exactly right: delivered by `conv.sync` pulls (a part of
    /// `group_verified`).
    pub shared_verified: u64,
    /// (device, group event) pairs outside every period of the device's
    /// user, confirmed absent (users never in the group included).
    pub out_of_period_absent: u64,
    pub violations: Vec<String>,
}

/// The facts of a run, as the checker needs them.
pub struct Facts<'a> {
    /// Every conversation the scenario made.
    pub convs: &'a BTreeMap<String, ConvFacts>,
    pub sent: &'a [Sent],
    /// `client_msg_id` → the server's answer; a sent message missing here
    /// was never accepted.
    pub accepted: &'a HashMap<String, Accepted>,
    /// `client_msg_id` → why the sender's outbox gave up on it (the
    /// server's refusal, as the SDK words it).
    pub refused: &'a HashMap<String, String>,
    pub views: &'a [DeviceView],
    /// Events per conversation a snapshot carries
    /// (`ServerConfig::snapshot_messages_per_conv`).
    pub snapshot_events_per_conv: u64,
}

/// The kind of a group's switch to shared mode (docs/protocol.md §3.26).
pub const KIND_MODE: &str = "conv.mode";

/// An event the checker expects at one `msg_seq` of a conversation.
#[derive(Debug, Clone, Copy)]
enum Expect<'a> {
    Message(&'a Sent, &'a Accepted),
    /// `conv.created` or `conv.mode` (no user), `member.join` or
    /// `member.leave` of `user`.
    Control {
        kind: &'static str,
        user: Option<&'a str>,
    },
}

impl fmt::Display for Expect<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expect::Message(s, _) => write!(f, "{}", s.tag),
            Expect::Control { kind, user: Some(u) } => write!(f, "{kind} of {u}"),
            Expect::Control { kind, user: None } => write!(f, "{kind}"),
        }
    }
}

/// Conversation → its users' periods (empty when the facts contradict
/// each other: that is reported, and nothing is judged against them).
type AllPeriods = BTreeMap<String, BTreeMap<String, Vec<Period>>>;

/// Conversation → `msg_seq` → the event expected there.
type Expected<'a> = BTreeMap<&'a str, BTreeMap<u64, Expect<'a>>>;

/// Expects `e` at `conv`'s `seq`; two events at one `msg_seq` break S2.
fn place<'a>(expected: &mut Expected<'a>, out: &mut Outcome, conv: &'a str, seq: u64, e: Expect<'a>) {
    if let Some(other) = expected.entry(conv).or_default().insert(seq, e) {
        out.violations.push(format!("{other} and {e} are both at {conv} msg_seq {seq} (S2)"));
    }
}

/// Checks every device against what was accepted and who was a member when.
pub fn check(facts: &Facts<'_>) -> Outcome {
    let mut out = Outcome { devices: facts.views.len(), ..Outcome::default() };
    out.groups = facts.convs.values().filter(|c| c.kind == ConvKind::Group).count();
    out.membership_changes = facts.convs.values().map(|c| c.changes.len()).sum();
    let mut all: AllPeriods = BTreeMap::new();
    for (conv, cf) in facts.convs {
        let ps = periods(cf).unwrap_or_else(|e| {
            out.violations.push(format!("membership of {conv} is inconsistent: {e} (G1)"));
            BTreeMap::new()
        });
        all.insert(conv.clone(), ps);
    }
    let covered = |conv: &str, user: &str, seq: u64| {
        all.get(conv).and_then(|ps| ps.get(user)).is_some_and(|ps| ps.iter().any(|p| p.covers(seq)))
    };
    // conv → msg_seq → the event, from the senders' and the scenario's side.
    let mut expected: Expected<'_> = BTreeMap::new();
    let mut tags: HashMap<&str, (&Sent, &Accepted)> = HashMap::new();
    for (conv, cf) in facts.convs.iter().filter(|(_, c)| c.kind == ConvKind::Group) {
        place(&mut expected, &mut out, conv, 1, Expect::Control { kind: "conv.created", user: None });
        for c in &cf.changes {
            let e = Expect::Control { kind: c.op.event_kind(), user: Some(&c.user) };
            place(&mut expected, &mut out, conv, c.msg_seq, e);
        }
        if let Some(from) = cf.shared_from {
            out.shared_groups += 1;
            place(&mut expected, &mut out, conv, from, Expect::Control { kind: KIND_MODE, user: None });
        }
    }
    for s in facts.sent {
        let conv = facts.convs.get(&s.conv);
        let group = conv.is_some_and(|c| c.kind == ConvKind::Group);
        let Some(a) = facts.accepted.get(&s.client_msg_id) else {
            match facts.refused.get(&s.client_msg_id) {
                None => out.violations.push(format!("{} ({}/{}): queued but never accepted", s.tag, s.user, s.device)),
                Some(why) if group && why.contains("NOT_MEMBER") => {
                    if conv.is_some_and(|c| out_at_or_after(c, &s.user, s.step)) {
                        out.refused_not_member += 1;
                    } else {
                        out.violations.push(format!(
                            "{} ({}/{}) refused NOT_MEMBER in {}, but its sender was a member from step {} on: {why}",
                            s.tag, s.user, s.device, s.conv, s.step
                        ));
                    }
                }
                Some(why) => out.violations.push(format!(
                    "{} ({}/{}) in {}: outbox entry failed for good: {why}",
                    s.tag, s.user, s.device, s.conv
                )),
            }
            continue;
        };
        if facts.refused.contains_key(&s.client_msg_id) {
            out.violations.push(format!("{} ({}/{}) both accepted and refused", s.tag, s.user, s.device));
        }
        if !covered(&s.conv, &s.user, a.msg_seq) {
            out.violations.push(format!(
                "{} accepted from {} at {} msg_seq {}, outside the sender's periods {:?} (G1)",
                s.tag,
                s.user,
                s.conv,
                a.msg_seq,
                all.get(&s.conv).and_then(|ps| ps.get(&s.user))
            ));
        }
        if group {
            out.group_accepted += 1;
        }
        place(&mut expected, &mut out, &s.conv, a.msg_seq, Expect::Message(s, a));
        tags.insert(s.tag.as_str(), (s, a));
    }
    // A conversation's msg_seq is contiguous and a refused send leaves no
    // hole (S2): every position up to the last one is somebody's event.
    for (conv, by_seq) in &expected {
        let mut want = 1;
        for &seq in by_seq.keys() {
            if seq > want {
                out.violations.push(format!(
                    "{conv} msg_seq {want}..={} accounted for by no accepted send and no membership change (S2)",
                    seq - 1
                ));
            }
            want = seq + 1;
        }
    }
    for view in facts.views {
        check_device(facts, &all, view, &expected, &tags, &mut out);
    }
    out
}

fn check_device(
    facts: &Facts<'_>,
    all: &AllPeriods,
    view: &DeviceView,
    expected: &Expected<'_>,
    tags: &HashMap<&str, (&Sent, &Accepted)>,
    out: &mut Outcome,
) {
    let who = format!("{}/{}", view.user, view.device);
    let rebuilt = match view.snapshots_installed {
        Some(n) => n > 0,
        None => view.conversations.iter().any(|c| c.history_to > 0),
    };
    out.rebuilt_devices += usize::from(rebuilt);
    let user_periods = |conv: &str| all.get(conv).and_then(|ps| ps.get(&view.user)).filter(|ps| !ps.is_empty());
    for conv in &view.conversations {
        if user_periods(&conv.conv).is_none() {
            out.violations.push(format!("{who}: holds conversation {} it never was a member of", conv.conv));
        }
    }
    for (conv, cf) in facts.convs {
        let group = cf.kind == ConvKind::Group;
        let want = expected.get(conv.as_str());
        let summary = view.conversations.iter().find(|c| c.conv == *conv);
        let Some(mine) = user_periods(conv) else {
            // Never a member: the whole conversation is outside (the
            // device holding it at all is reported above).
            if group && summary.is_none() {
                out.out_of_period_absent += want.map_or(0, |w| w.len() as u64);
            }
            continue;
        };
        let Some(summary) = summary else {
            if want.is_some_and(|w| w.keys().any(|s| mine.iter().any(|p| p.covers(*s)))) {
                out.violations.push(format!("{who}: conversation {conv} missing"));
            }
            continue;
        };
        let events = view.events.get(conv).map(Vec::as_slice).unwrap_or_default();
        check_order(&who, summary, events, mine, out);
        let open = mine.last().is_some_and(|p| p.leave.is_none());
        if summary.active != open {
            out.violations
                .push(format!("{who}: {conv} is active={} but the user's periods are {mine:?} (G1)", summary.active));
        }
        let ctx =
            ConvCtx { who: &who, summary, group, mine, periods: &all[conv], rebuilt, shared_from: cf.shared_from };
        check_boundary(&ctx, events, want, facts.snapshot_events_per_conv, view.snapshots_installed, out);
        let served = check_history(&ctx, view.history.get(conv.as_str()), want, out);
        check_events(&ctx, events, want, tags, &served, out);
    }
}

/// Strictly increasing `msg_seq` (history held below `history_to`
/// included), no hole inside one of the user's periods above `history_to`,
/// contiguous cursor at the last event.
fn check_order(who: &str, summary: &Conversation, events: &[Message], mine: &[Period], out: &mut Outcome) {
    let conv = &summary.conv;
    let mut want = summary.history_to + 1;
    let mut last: Option<u64> = None;
    for e in events {
        if let Some(l) = last.filter(|l| e.msg_seq <= *l) {
            out.violations.push(format!("{who}: {conv} msg_seq {} out of order or twice (after {l})", e.msg_seq));
            continue;
        }
        last = Some(e.msg_seq);
        if e.msg_seq <= summary.history_to {
            // History: whatever of it is held, in order; absence is judged
            // event by event against `history`.
            continue;
        }
        // Only what the user's periods cover can be a hole: the gap before
        // a join (or between two periods) is outside the user's view.
        for p in mine {
            let lo = want.max(p.join);
            let hi = (e.msg_seq - 1).min(p.leave.unwrap_or(u64::MAX));
            if lo <= hi {
                out.violations.push(format!("{who}: {conv} hole at msg_seq {lo}..={hi}"));
            }
        }
        want = e.msg_seq + 1;
    }
    if summary.contiguous_msg_seq != summary.last_msg_seq {
        out.violations.push(format!(
            "{who}: {conv} contiguous cursor {} below last msg_seq {} after settling",
            summary.contiguous_msg_seq, summary.last_msg_seq
        ));
    }
}

/// One device's conversation, as [`check_events`] judges it.
struct ConvCtx<'a> {
    who: &'a str,
    summary: &'a Conversation,
    group: bool,
    /// The device's user's periods.
    mine: &'a [Period],
    /// Every user's periods in the conversation.
    periods: &'a BTreeMap<String, Vec<Period>>,
    /// The device installed a snapshot during the run.
    rebuilt: bool,
    /// The group's switch to shared mode, if any.
    shared_from: Option<u64>,
}

/// The events of the user's view in `want`, ascending.
fn visible(ctx: &ConvCtx<'_>, want: Option<&BTreeMap<u64, Expect<'_>>>) -> Vec<u64> {
    want.into_iter().flat_map(|w| w.keys().copied()).filter(|s| ctx.mine.iter().any(|p| p.covers(*s))).collect()
}

/// A snapshot's boundary (D7, docs/protocol.md §3.21): only a snapshot
/// sets `history_to`, right below the first event it carries, and it
/// carries the latest `per_conv` events of the user's view, so it leaves
/// history behind only when it carries that many. What it carried is what
/// is held above the boundary without a `sync_seq`: no log entry delivered
/// it, while once the run settled every later event came through the log.
fn check_boundary(
    ctx: &ConvCtx<'_>,
    events: &[Message],
    want: Option<&BTreeMap<u64, Expect<'_>>>,
    per_conv: u64,
    snapshots: Option<u64>,
    out: &mut Outcome,
) {
    let (who, conv, h) = (ctx.who, &ctx.summary.conv, ctx.summary.history_to);
    if h == 0 {
        return;
    }
    out.history_boundaries += 1;
    if snapshots == Some(0) {
        out.violations.push(format!(
            "{who}: {conv} history_to {h}, but the device installed no snapshot: only a snapshot leaves history (D7)"
        ));
    }
    let seen = visible(ctx, want);
    if per_conv > 0 && !seen.contains(&(h + 1)) {
        out.violations.push(format!(
            "{who}: {conv} history_to {h}, but msg_seq {} is no event of the user's view: a snapshot's boundary lies right below the first event it carries (D7)",
            h + 1
        ));
    }
    let below = seen.iter().filter(|s| **s <= h).count() as u64;
    let above = seen.len() as u64 - below;
    if below > 0 && above < per_conv {
        out.violations.push(format!(
            "{who}: {conv} leaves {below} events of the user's view as history at or below history_to {h} with only {above} above it: a snapshot carries the latest {per_conv} (D7)"
        ));
    }
    // Above a shared group's switch every event is held without a
    // `sync_seq` (pulled by `conv.sync`, or carried by the snapshot): only
    // at or below it does the absence of one say "from the snapshot". So
    // there the count is bounded: what is surely carried is at most
    // `per_conv`, and with what may be carried at least `per_conv`.
    let pulled = |e: &&Message| ctx.shared_from.is_some_and(|from| e.msg_seq > from);
    let unlogged: Vec<&Message> = events.iter().filter(|e| e.msg_seq > h && e.sync_seq.is_none()).collect();
    let maybe = unlogged.iter().filter(|e| pulled(e)).count() as u64;
    let carried = unlogged.len() as u64 - maybe;
    if carried > per_conv || (below > 0 && carried + maybe < per_conv) {
        out.violations.push(format!(
            "{who}: {conv} holds {carried} events from its snapshot above history_to {h}, with {below} events of the user's view at or below it: a snapshot carries the latest {per_conv} (D7)"
        ));
    }
}

/// What `history` serves below the boundary: newest first, nothing above
/// `history_to`, nothing outside the user's periods (G1), each event the
/// one expected at its `msg_seq`. Returns how often each `msg_seq` was
/// rightly served.
fn check_history(
    ctx: &ConvCtx<'_>,
    served: Option<&Result<Vec<Message>, String>>,
    want: Option<&BTreeMap<u64, Expect<'_>>>,
    out: &mut Outcome,
) -> BTreeMap<u64, usize> {
    let (who, conv, h) = (ctx.who, &ctx.summary.conv, ctx.summary.history_to);
    let mut at: BTreeMap<u64, usize> = BTreeMap::new();
    let served = match served {
        None => return at,
        Some(Err(why)) => {
            out.violations.push(format!("{who}: {conv} `history` below {} refused: {why}", h + 1));
            return at;
        }
        Some(Ok(served)) => served,
    };
    let mut last: Option<u64> = None;
    for e in served {
        if let Some(l) = last.filter(|l| e.msg_seq >= *l) {
            out.violations
                .push(format!("{who}: {conv} `history` serves msg_seq {} after {l}, not newest first", e.msg_seq));
        }
        last = Some(e.msg_seq);
        if e.msg_seq > h {
            out.violations.push(format!("{who}: {conv} `history` below {} serves msg_seq {}", h + 1, e.msg_seq));
            continue;
        }
        if !ctx.mine.iter().any(|p| p.covers(e.msg_seq)) {
            out.violations.push(format!(
                "{who}: {conv} `history` serves a {} at msg_seq {} outside the user's periods {:?} (G1)",
                e.kind, e.msg_seq, ctx.mine
            ));
            continue;
        }
        let right = match want.and_then(|w| w.get(&e.msg_seq)) {
            Some(Expect::Message(s, acc)) => {
                e.message_id == acc.message_id && e.content.get("tag").and_then(|t| t.as_str()) == Some(s.tag.as_str())
            }
            Some(Expect::Control { kind, user }) => {
                e.kind == *kind && e.content.get("user").and_then(|u| u.as_str()) == *user
            }
            None => false,
        };
        if !right {
            let there = want.and_then(|w| w.get(&e.msg_seq)).map_or("nothing".to_owned(), |x| x.to_string());
            out.violations.push(format!(
                "{who}: {conv} `history` serves a {} ({}, {}) at msg_seq {}, where {there} is",
                e.kind, e.message_id, e.content, e.msg_seq
            ));
            continue;
        }
        *at.entry(e.msg_seq).or_default() += 1;
    }
    at
}

fn check_events(
    ctx: &ConvCtx<'_>,
    events: &[Message],
    want: Option<&BTreeMap<u64, Expect<'_>>>,
    tags: &HashMap<&str, (&Sent, &Accepted)>,
    served: &BTreeMap<u64, usize>,
    out: &mut Outcome,
) {
    let (who, conv) = (ctx.who, &ctx.summary.conv);
    let mut held: HashMap<&str, Vec<&Message>> = HashMap::new();
    let mut held_control: BTreeMap<u64, Vec<&Message>> = BTreeMap::new();
    for e in events {
        if e.is_control() {
            match want.and_then(|w| w.get(&e.msg_seq)) {
                Some(Expect::Control { kind, user })
                    if e.kind == *kind && e.content.get("user").and_then(|u| u.as_str()) == *user =>
                {
                    held_control.entry(e.msg_seq).or_default().push(e);
                }
                Some(other) => out.violations.push(format!(
                    "{who}: {conv} holds a {} ({}) at msg_seq {}, where {other} is",
                    e.kind, e.content, e.msg_seq
                )),
                None => out.violations.push(format!(
                    "{who}: {conv} holds a {} ({}) at msg_seq {} that nobody made",
                    e.kind, e.content, e.msg_seq
                )),
            }
            continue;
        }
        let sender_in = ctx.periods.get(&e.sender).is_some_and(|ps| ps.iter().any(|p| p.covers(e.msg_seq)));
        if !sender_in {
            out.violations.push(format!("{who}: {conv} msg_seq {} from non-member {}", e.msg_seq, e.sender));
        }
        let Some(tag) = e.content.get("tag").and_then(|t| t.as_str()) else {
            // A recalled message loses its content; the scenario recalls
            // nothing, so this is a message nobody sent.
            out.violations.push(format!("{who}: {conv} msg_seq {} has no tag (state {})", e.msg_seq, e.state));
            continue;
        };
        match tags.get(tag) {
            Some((s, _)) if s.conv != *conv => {
                out.violations.push(format!("{who}: {tag} of {} shows up in {conv}", s.conv));
            }
            Some(_) => held.entry(tag).or_default().push(e),
            None => out.violations.push(format!("{who}: {conv} holds {tag}, which was never accepted")),
        }
    }
    for (&seq, exp) in want.into_iter().flatten() {
        let copies: &[&Message] = match exp {
            Expect::Message(s, _) => held.get(s.tag.as_str()).map(Vec::as_slice).unwrap_or_default(),
            Expect::Control { .. } => held_control.get(&seq).map(Vec::as_slice).unwrap_or_default(),
        };
        if !ctx.mine.iter().any(|p| p.covers(seq)) {
            // Outside every period of this user: must be absent (G1).
            if copies.is_empty() {
                if ctx.group {
                    out.out_of_period_absent += 1;
                }
            } else {
                out.violations.push(format!(
                    "{who}: {conv} holds {exp} (msg_seq {seq}) from outside its periods {:?} (G1)",
                    ctx.mine
                ));
            }
            continue;
        }
        if seq <= ctx.summary.history_to && copies.is_empty() {
            // History, not a loss, only if `history` serves it (once).
            match served.get(&seq).copied().unwrap_or(0) {
                1 => out.history_only += 1,
                0 => out.violations.push(format!(
                    "{who}: {conv} lost {exp} (msg_seq {seq}): at or below history_to {}, not held and not served by `history`",
                    ctx.summary.history_to
                )),
                n => out.violations.push(format!(
                    "{who}: {conv} {exp} (msg_seq {seq}) is history here, and `history` serves it {n} times"
                )),
            }
            continue;
        }
        match (exp, copies) {
            (_, []) => out.violations.push(format!("{who}: {conv} lost {exp} (msg_seq {seq})")),
            (Expect::Control { .. }, [_]) => out.membership_events_verified += 1,
            (Expect::Message(_, acc), [m]) if m.msg_seq == acc.msg_seq && m.message_id == acc.message_id => {
                out.verified += 1;
                let shared = ctx.shared_from.is_some_and(|from| seq > from);
                if ctx.group {
                    out.group_verified += 1;
                    out.shared_verified += u64::from(shared);
                }
                if ctx.rebuilt {
                    out.verified_after_snapshot += 1;
                    out.from_snapshot += u64::from(m.sync_seq.is_none() && !shared);
                }
            }
            (Expect::Message(_, acc), [m]) => out.violations.push(format!(
                "{who}: {conv} {exp} held at msg_seq {} id {}, accepted at {} id {}",
                m.msg_seq, m.message_id, acc.msg_seq, acc.message_id
            )),
            (_, many) => out.violations.push(format!(
                "{who}: {conv} {exp} held {} times at msg_seqs {:?}",
                many.len(),
                many.iter().map(|m| m.msg_seq).collect::<Vec<_>>()
            )),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Negative controls: a checker that never fails proves nothing.

    use super::*;

    fn msg(conv: &str, seq: u64, tag: &str) -> Message {
        Message {
            conv: conv.into(),
            msg_seq: seq,
            message_id: format!("id-{tag}"),
            kind: "text".into(),
            state: "normal".into(),
            sender: "b".into(),
            content: serde_json::json!({ "tag": tag }),
            created_at: 0,
            version: 1,
            reactions: serde_json::json!({}),
            sync_seq: Some(seq),
            mentions: Vec::new(),
            mention_all: false,
        }
    }

    fn control(conv: &str, seq: u64, kind: &str, user: Option<&str>) -> Message {
        Message {
            kind: kind.into(),
            message_id: format!("ev-{seq}"),
            content: match user {
                Some(u) => serde_json::json!({ "user": u, "by": "b", "op": "x" }),
                None => serde_json::json!({ "owner": "b", "members": ["a", "b"] }),
            },
            ..msg(conv, seq, "")
        }
    }

    fn summary(conv: &str, events: &[Message]) -> Conversation {
        direct_conv(conv, events.iter().map(|e| e.msg_seq).max().unwrap_or(0))
    }

    /// An active direct conversation whose cursor and last message are at
    /// `last` (also the scenario's tests' fixture).
    pub(crate) fn direct_conv(conv: &str, last: u64) -> Conversation {
        Conversation {
            conv: conv.into(),
            kind: "direct".into(),
            shared: false,
            contiguous_msg_seq: last,
            history_to: 0,
            last_msg_seq: last,
            read_seq: 0,
            unread: 0,
            mentions: 0,
            muted: false,
            pinned: false,
            active: true,
            push_preview: "full".into(),
            needs_repair: false,
            last_message: None,
        }
    }

    fn sent(tag: &str, conv: &str, user: &str, step: usize) -> Sent {
        Sent {
            tag: tag.into(),
            conv: conv.into(),
            user: user.into(),
            device: "d0".into(),
            client_msg_id: format!("c{tag}"),
            step,
        }
    }

    fn view(held: &[(&str, Vec<Message>)]) -> DeviceView {
        DeviceView {
            user: "a".into(),
            device: "d0".into(),
            conversations: held.iter().map(|(c, e)| summary(c, e)).collect(),
            events: held.iter().map(|(c, e)| (c.to_string(), e.clone())).collect(),
            snapshots_installed: Some(0),
            history: BTreeMap::new(),
        }
    }

    /// Runs the checker on a device of `a` holding `held` (conversation →
    /// events), in direct conversation `c` (members `a`, `b`) where `b`
    /// sent m1..m3, accepted at msg_seq 1..3; returns its violations.
    fn check_held(held: &[(&str, Vec<Message>)]) -> Vec<String> {
        let convs: BTreeMap<String, ConvFacts> = [(
            "c".to_owned(),
            ConvFacts {
                kind: ConvKind::Direct,
                members: vec!["a".into(), "b".into()],
                changes: vec![],
                shared_from: None,
            },
        )]
        .into();
        let sent: Vec<Sent> = (1..=3).map(|i| sent(&format!("m{i}"), "c", "b", 0)).collect();
        let accepted: HashMap<String, Accepted> =
            (1..=3).map(|i| (format!("cm{i}"), Accepted { msg_seq: i, message_id: format!("id-m{i}") })).collect();
        let facts = Facts {
            convs: &convs,
            sent: &sent,
            accepted: &accepted,
            refused: &HashMap::new(),
            views: &[view(held)],
            snapshot_events_per_conv: 3,
        };
        check(&facts).violations
    }

    /// A device of `a` rebuilt from a snapshot (3 events per conversation)
    /// holding `held` of direct conversation `c`, where `b` sent m1..m6 at
    /// msg_seq 1..6, with `history_to`, what `history` serves below it, and
    /// the snapshots its change stream counted.
    fn check_rebuilt(
        held: Vec<Message>,
        history_to: u64,
        served: Result<Vec<Message>, String>,
        snapshots: Option<u64>,
    ) -> Outcome {
        let convs: BTreeMap<String, ConvFacts> = [(
            "c".to_owned(),
            ConvFacts {
                kind: ConvKind::Direct,
                members: vec!["a".into(), "b".into()],
                changes: vec![],
                shared_from: None,
            },
        )]
        .into();
        let sent: Vec<Sent> = (1..=6).map(|i| sent(&format!("m{i}"), "c", "b", 0)).collect();
        let accepted: HashMap<String, Accepted> =
            (1..=6).map(|i| (format!("cm{i}"), Accepted { msg_seq: i, message_id: format!("id-m{i}") })).collect();
        let mut v = view(&[("c", held)]);
        v.conversations[0].history_to = history_to;
        v.snapshots_installed = snapshots;
        v.history.insert("c".into(), served);
        let facts = Facts {
            convs: &convs,
            sent: &sent,
            accepted: &accepted,
            refused: &HashMap::new(),
            views: &[v],
            snapshot_events_per_conv: 3,
        };
        check(&facts)
    }

    /// An event installed by a snapshot: no log entry delivered it.
    fn snap(conv: &str, seq: u64, tag: &str) -> Message {
        Message { sync_seq: None, ..msg(conv, seq, tag) }
    }

    /// What `history` serves, newest first.
    fn served(seqs: &[u64]) -> Result<Vec<Message>, String> {
        Ok(seqs.iter().map(|s| snap("c", *s, &format!("m{s}"))).collect())
    }

    fn has(out: &Outcome, what: &str) -> bool {
        out.violations.iter().any(|v| v.contains(what))
    }

    #[test]
    fn a_rebuilt_device_is_checked_against_its_boundary_and_history() {
        // The snapshot's base had m1..m5: it carried m3..m5 (history_to 2);
        // m6 came by sync after it.
        let tail = || vec![snap("c", 3, "m3"), snap("c", 4, "m4"), snap("c", 5, "m5"), msg("c", 6, "m6")];
        let out = check_rebuilt(tail(), 2, served(&[2, 1]), Some(1));
        assert_eq!(out.violations, Vec::<String>::new());
        assert_eq!((out.history_only, out.history_boundaries, out.rebuilt_devices), (2, 1, 1));
        assert_eq!((out.verified, out.verified_after_snapshot, out.from_snapshot), (4, 4, 3));

        let out = check_rebuilt(tail(), 2, served(&[2, 1]), Some(0));
        assert!(has(&out, "installed no snapshot"), "{out:?}");

        // A boundary above what a snapshot of 3 events leaves.
        let out = check_rebuilt(vec![snap("c", 5, "m5"), msg("c", 6, "m6")], 4, served(&[4, 3, 2, 1]), Some(1));
        assert!(has(&out, "with only 2 above it"), "{out:?}");
        // A boundary one too high with traffic after the snapshot: enough
        // events above it, but the snapshot's own are one short.
        let mut late = vec![snap("c", 2, "m2"), snap("c", 3, "m3"), snap("c", 4, "m4"), msg("c", 5, "m5")];
        late.push(msg("c", 6, "m6"));
        let out = check_rebuilt(late, 2, served(&[1]), Some(1));
        assert!(has(&out, "holds 2 events from its snapshot above history_to 2, with 2 events"), "{out:?}");

        // A boundary not right below the first event held: a hole.
        let out = check_rebuilt(tail()[1..].to_vec(), 2, served(&[2, 1]), Some(1));
        assert!(has(&out, "hole at msg_seq 3..=3") && has(&out, "lost m3 (msg_seq 3)"), "{out:?}");

        // History that does not serve an event, serves it twice, serves
        // above the boundary, serves another event, or refuses.
        let out = check_rebuilt(tail(), 2, served(&[2]), Some(1));
        assert!(has(&out, "lost m1 (msg_seq 1): at or below history_to 2"), "{out:?}");
        let out = check_rebuilt(tail(), 2, served(&[2, 1, 1]), Some(1));
        assert!(has(&out, "serves it 2 times") && has(&out, "not newest first"), "{out:?}");
        let out = check_rebuilt(tail(), 2, served(&[3, 2, 1]), Some(1));
        assert!(has(&out, "below 3 serves msg_seq 3"), "{out:?}");
        let out = check_rebuilt(tail(), 2, Ok(vec![snap("c", 2, "m2"), snap("c", 1, "m9")]), Some(1));
        assert!(has(&out, "at msg_seq 1, where m1 is") && has(&out, "lost m1"), "{out:?}");
        let out = check_rebuilt(tail(), 2, Err("NOT_MEMBER (x)".into()), Some(1));
        assert!(has(&out, "`history` below 3 refused: NOT_MEMBER"), "{out:?}");

        // History held below the boundary is still held once, in order.
        let mut twice = vec![snap("c", 1, "m1"), snap("c", 1, "m1")];
        twice.extend(tail());
        let out = check_rebuilt(twice, 2, served(&[2, 1]), Some(1));
        assert!(has(&out, "msg_seq 1 out of order or twice") && has(&out, "m1 held 2 times"), "{out:?}");
    }

    #[test]
    fn the_checker_flags_every_kind_of_damage() {
        let good = || vec![msg("c", 1, "m1"), msg("c", 2, "m2"), msg("c", 3, "m3")];
        assert_eq!(check_held(&[("c", good())]), Vec::<String>::new());

        let mut lost = good();
        lost.remove(1);
        let v = check_held(&[("c", lost)]);
        assert!(v.iter().any(|v| v.contains("hole at msg_seq 2")), "{v:?}");
        assert!(v.iter().any(|v| v.contains("lost m2")), "{v:?}");

        let mut twice = good();
        twice.push(msg("c", 4, "m3"));
        let v = check_held(&[("c", twice)]);
        assert!(v.iter().any(|v| v.contains("m3 held 2 times")), "{v:?}");

        let mut swapped = good();
        swapped.swap(1, 2);
        let v = check_held(&[("c", swapped)]);
        assert!(v.iter().any(|v| v.contains("out of order")), "{v:?}");

        let mut moved = good();
        moved[2] = msg("c", 3, "m3");
        moved[2].message_id = "id-other".into();
        let v = check_held(&[("c", moved)]);
        assert!(v.iter().any(|v| v.contains("accepted at 3 id id-m3")), "{v:?}");

        let v = check_held(&[("c", good()), ("elsewhere", vec![msg("elsewhere", 1, "x")])]);
        assert!(v.iter().any(|v| v.contains("never was a member of")), "{v:?}");

        let mut stranger = good();
        stranger[0].sender = "z".into();
        let v = check_held(&[("c", stranger)]);
        assert!(v.iter().any(|v| v.contains("non-member z")), "{v:?}");
    }

    /// Group `g` owned by `b`, created with `a` and `b`:
    ///
    /// | msg_seq | event                      | step |
    /// |---------|----------------------------|------|
    /// | 1       | conv.created               | -    |
    /// | 2       | m1 (b)                     | 0    |
    /// | 3       | member.leave a (b removes) | 1    |
    /// | 4       | m2 (b)                     | 2    |
    /// | 5       | member.join a (b adds)     | 3    |
    /// | 6       | m3 (b)                     | 4    |
    /// | 7       | m4 (a)                     | 5    |
    ///
    /// `a` queued m5 at step 2 (out of the group: refused `NOT_MEMBER`).
    /// So `a` has the periods [1, 3] and [5, ∞): m2 is outside.
    struct Group {
        convs: BTreeMap<String, ConvFacts>,
        sent: Vec<Sent>,
        accepted: HashMap<String, Accepted>,
        refused: HashMap<String, String>,
    }

    impl Group {
        fn new() -> Group {
            let change = |op, seq, step| MembershipChange {
                conv: "g".into(),
                op,
                user: "a".into(),
                by: "b".into(),
                msg_seq: seq,
                step,
            };
            let g = ConvFacts {
                kind: ConvKind::Group,
                members: vec!["a".into(), "b".into()],
                changes: vec![change(MemberOp::Remove, 3, 1), change(MemberOp::Add, 5, 3)],
                shared_from: None,
            };
            let sent = vec![
                sent("m1", "g", "b", 0),
                sent("m2", "g", "b", 2),
                sent("m3", "g", "b", 4),
                sent("m4", "g", "a", 5),
                sent("m5", "g", "a", 2),
            ];
            let accepted = [("m1", 2), ("m2", 4), ("m3", 6), ("m4", 7)]
                .into_iter()
                .map(|(t, s)| (format!("c{t}"), Accepted { msg_seq: s, message_id: format!("id-{t}") }))
                .collect();
            let refused = [("cm5".to_owned(), "server refused: NOT_MEMBER (not a member)".to_owned())].into();
            Group { convs: [("g".to_owned(), g)].into(), sent, accepted, refused }
        }

        /// What a device of `a` must hold.
        fn good() -> Vec<Message> {
            let mut m4 = msg("g", 7, "m4");
            m4.sender = "a".into();
            vec![
                control("g", 1, "conv.created", None),
                msg("g", 2, "m1"),
                control("g", 3, "member.leave", Some("a")),
                control("g", 5, "member.join", Some("a")),
                msg("g", 6, "m3"),
                m4,
            ]
        }

        fn check(&self, events: Vec<Message>) -> Outcome {
            self.check_view(view(&[("g", events)]))
        }

        fn check_view(&self, view: DeviceView) -> Outcome {
            let facts = Facts {
                convs: &self.convs,
                sent: &self.sent,
                accepted: &self.accepted,
                refused: &self.refused,
                views: &[view],
                snapshot_events_per_conv: 3,
            };
            check(&facts)
        }
    }

    #[test]
    fn periods_are_closed_on_both_ends_and_a_rejoin_opens_a_new_one() {
        let g = Group::new();
        let ps = periods(&g.convs["g"]).unwrap();
        assert_eq!(ps["a"], vec![Period { join: 1, leave: Some(3) }, Period { join: 5, leave: None }]);
        assert_eq!(ps["b"], vec![Period { join: 1, leave: None }]);
        let covered: Vec<u64> = (1..=7).filter(|s| ps["a"].iter().any(|p| p.covers(*s))).collect();
        assert_eq!(covered, vec![1, 2, 3, 5, 6, 7], "the leave and the join events are inside, the gap is not");

        let mut bad = g.convs["g"].clone();
        bad.changes.push(MembershipChange { op: MemberOp::Add, msg_seq: 8, ..bad.changes[1].clone() });
        assert!(periods(&bad).unwrap_err().contains("while a member"));
    }

    #[test]
    fn a_group_device_is_checked_period_by_period() {
        let g = Group::new();
        let out = g.check(Group::good());
        assert_eq!(out.violations, Vec::<String>::new());
        assert_eq!(out.group_verified, 3, "m1, m3, m4");
        assert_eq!(out.membership_events_verified, 3, "created, leave, join");
        assert_eq!(out.out_of_period_absent, 1, "m2");
        assert_eq!(out.refused_not_member, 1, "m5");
        assert_eq!(out.group_accepted, 4);
    }

    #[test]
    fn a_message_from_outside_the_period_is_flagged() {
        let g = Group::new();
        let mut leaked = Group::good();
        leaked.insert(3, msg("g", 4, "m2"));
        let out = g.check(leaked);
        assert!(out.violations.iter().any(|v| v.contains("holds m2 (msg_seq 4) from outside its periods")), "{out:?}");
        assert_eq!(out.out_of_period_absent, 0);

        // A membership event of the gap is outside too.
        let mut g2 = Group::new();
        let other = MembershipChange {
            user: "c".into(),
            op: MemberOp::Add,
            msg_seq: 4,
            step: 2,
            ..g.convs["g"].changes[0].clone()
        };
        g2.convs.get_mut("g").unwrap().changes.push(other);
        g2.accepted.get_mut("cm2").unwrap().msg_seq = 8;
        let mut leaked = Group::good();
        leaked.insert(3, control("g", 4, "member.join", Some("c")));
        let out = g2.check(leaked);
        assert!(out.violations.iter().any(|v| v.contains("member.join of c (msg_seq 4) from outside")), "{out:?}");
    }

    #[test]
    fn periods_hold_after_a_snapshot_and_in_history() {
        // `a` rebuilt after m4: the latest 3 events of its view (5, 6, 7)
        // are held, history_to 4; history serves 3, 2, 1 and never m2 at 4.
        let g = Group::new();
        let mut v =
            view(&[("g", Group::good()[3..].iter().map(|m| Message { sync_seq: None, ..m.clone() }).collect())]);
        v.conversations[0].history_to = 4;
        v.snapshots_installed = Some(1);
        let history =
            vec![control("g", 3, "member.leave", Some("a")), msg("g", 2, "m1"), control("g", 1, "conv.created", None)];
        v.history.insert("g".into(), Ok(history.clone()));
        let out = g.check_view(v.clone());
        assert_eq!(out.violations, Vec::<String>::new());
        assert_eq!((out.history_only, out.group_verified, out.out_of_period_absent), (3, 2, 1));
        assert_eq!(out.membership_events_verified, 1, "the join, held");

        let mut leaked = v.clone();
        let mut h = history.clone();
        h.insert(0, msg("g", 4, "m2"));
        leaked.history.insert("g".into(), Ok(h));
        let out = g.check_view(leaked);
        assert!(has(&out, "serves a text at msg_seq 4 outside the user's periods"), "{out:?}");

        // The boundary inside the gap is right below the join: fine; one
        // inside the period above the join is not.
        let mut high = v;
        high.conversations[0].history_to = 5;
        let out = g.check_view(high);
        assert!(has(&out, "with only 2 above it"), "{out:?}");
    }

    /// Group `g` of `a` and `b`, created shared: conv.created at 1, its
    /// switch at 2, then m1..m5 from `b` at 3..=7, read by `conv.sync`
    /// (held without a `sync_seq`).
    fn shared_group() -> (Group, Vec<Message>) {
        let g = ConvFacts {
            kind: ConvKind::Group,
            members: vec!["a".into(), "b".into()],
            changes: vec![],
            shared_from: Some(2),
        };
        let tags = ["m1", "m2", "m3", "m4", "m5"];
        let sent = tags.iter().enumerate().map(|(i, t)| sent(t, "g", "b", i)).collect();
        let accepted = tags
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("c{t}"), Accepted { msg_seq: i as u64 + 3, message_id: format!("id-{t}") }))
            .collect();
        let group = Group { convs: [("g".to_owned(), g)].into(), sent, accepted, refused: HashMap::new() };
        let mut held = vec![control("g", 1, "conv.created", None), control("g", 2, KIND_MODE, None)];
        held[1].content = serde_json::json!({ "mode": "shared", "members": 2 });
        held.extend(tags.iter().enumerate().map(|(i, t)| Message { sync_seq: None, ..msg("g", i as u64 + 3, t) }));
        (group, held)
    }

    #[test]
    fn a_shared_group_is_checked_against_its_log_with_its_switch() {
        let (g, held) = shared_group();
        let out = g.check(held.clone());
        assert_eq!(out.violations, Vec::<String>::new());
        assert_eq!((out.shared_groups, out.shared_verified, out.group_verified), (1, 5, 5));
        assert_eq!(out.membership_events_verified, 2, "created, the switch");

        // The switch is an event of the log: missing it is a loss.
        let mut lost = held.clone();
        lost.remove(1);
        let out = g.check(lost);
        assert!(has(&out, "lost conv.mode (msg_seq 2)"), "{out:?}");
        // A pull applied twice at another msg_seq, or one missed.
        let mut twice = held.clone();
        twice.push(Message { msg_seq: 8, ..held[6].clone() });
        assert!(has(&g.check(twice), "m5 held 2 times"));
        let mut hole = held.clone();
        hole.remove(4);
        let out = g.check(hole);
        assert!(has(&out, "lost m3 (msg_seq 5)") && has(&out, "hole at msg_seq 5..=5"), "{out:?}");
        // Without the switch in the facts, nobody made that conv.mode.
        let mut unknown = Group { convs: g.convs.clone(), ..shared_group().0 };
        unknown.convs.get_mut("g").unwrap().shared_from = None;
        assert!(has(&unknown.check(held.clone()), "that nobody made"));

        // Rebuilt from a snapshot of 3 (m1..m3, history_to 2), then m4
        // and m5 pulled: above the switch none has a sync_seq, and that
        // does not make all five "carried by the snapshot".
        let mut v = view(&[("g", held[2..].to_vec())]);
        v.conversations[0].history_to = 2;
        v.snapshots_installed = Some(1);
        v.history.insert("g".into(), Ok(held[..2].iter().rev().cloned().collect()));
        let out = g.check_view(v.clone());
        assert_eq!(out.violations, Vec::<String>::new());
        assert_eq!((out.history_only, out.shared_verified, out.from_snapshot), (2, 5, 0));
        // Per-member, the same holdings say the snapshot carried five.
        let mut per_member = Group { convs: g.convs.clone(), ..shared_group().0 };
        per_member.convs.get_mut("g").unwrap().shared_from = None;
        assert!(has(&per_member.check_view(v), "holds 5 events from its snapshot"), "sanity: the bound is real");
    }

    #[test]
    fn a_message_missing_inside_a_later_period_is_flagged() {
        let g = Group::new();
        let mut lost = Group::good();
        lost.retain(|e| e.msg_seq != 6);
        let out = g.check(lost);
        assert!(out.violations.iter().any(|v| v.contains("lost m3 (msg_seq 6)")), "{out:?}");
        assert!(out.violations.iter().any(|v| v.contains("hole at msg_seq 6..=6")), "{out:?}");

        // Missing the rejoin event itself: the period's first msg_seq.
        let mut lost = Group::good();
        lost.retain(|e| e.msg_seq != 5);
        let out = g.check(lost);
        assert!(out.violations.iter().any(|v| v.contains("lost member.join of a (msg_seq 5)")), "{out:?}");
        assert!(out.violations.iter().any(|v| v.contains("hole at msg_seq 5..=5")), "{out:?}");
    }

    #[test]
    fn wrong_membership_outcomes_are_flagged() {
        // A refusal while the sender was a member throughout.
        let mut g = Group::new();
        g.accepted.remove("cm3");
        g.refused.insert("cm3".into(), "server refused: NOT_MEMBER (x)".into());
        let out = g.check(Group::good());
        assert!(out.violations.iter().any(|v| v.contains("m3 (b/d0) refused NOT_MEMBER")), "{out:?}");

        // A send accepted inside the sender's gap.
        let mut g = Group::new();
        g.refused.clear();
        g.accepted.insert("cm5".into(), Accepted { msg_seq: 8, message_id: "id-m5".into() });
        g.convs.get_mut("g").unwrap().changes[1].msg_seq = 9;
        let out = g.check(Group::good());
        assert!(out.violations.iter().any(|v| v.contains("m5 accepted from a at g msg_seq 8, outside")), "{out:?}");

        // A device that still calls the group active after a leave.
        let mut g = Group::new();
        g.convs.get_mut("g").unwrap().changes.pop();
        let mut events = Group::good();
        events.truncate(3);
        g.sent.truncate(2);
        let out = g.check(events);
        assert!(out.violations.iter().any(|v| v.contains("is active=true")), "{out:?}");
    }
}
