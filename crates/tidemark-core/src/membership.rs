//! Membership periods (G1, F4): who may see the message at a given `msg_seq`.
//!
//! A period `[join_seq, leave_seq]` (closed; `leave_seq` open while active)
//! belongs to one user in one conversation and gets a fresh id per join.
//! Fan-out resolves recipients from the periods that cover a message's
//! `msg_seq`, never from the current member list, so a fan-out delayed past a
//! leave still delivers the pre-leave messages and never a later one.

use std::collections::HashSet;

use crate::kinds::{CONV_GROUP, KIND_CREATED, KIND_RECALL};
use crate::{MsgSeq, Refusal};

/// Most members a group may have. Above the large-group threshold a group
/// is in shared mode (`crate::large`), so this bounds a shared log's
/// readers, not a fan-out.
pub const GROUP_MEMBERS_MAX: usize = 100_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Period {
    pub period_id: i64,
    pub user: String,
    pub join_seq: MsgSeq,
    pub leave_seq: Option<MsgSeq>,
}

impl Period {
    pub fn covers(&self, seq: MsgSeq) -> bool {
        self.join_seq <= seq && self.leave_seq.is_none_or(|leave| seq <= leave)
    }
}

/// The recipients of one message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recipients {
    /// `(user, period_id)`: exactly one covering period per user.
    pub deliver: Vec<(String, i64)>,
    /// Users hit by two or more periods: an integrity error. Quarantined and
    /// reported, never delivered twice and never guessed.
    pub quarantined: Vec<String>,
}

/// Resolves recipients of the message at `seq` from `periods` (any order).
pub fn recipients_at(periods: &[Period], seq: MsgSeq) -> Recipients {
    let mut hits: Vec<&Period> = periods.iter().filter(|p| p.covers(seq)).collect();
    hits.sort_by(|a, b| a.user.cmp(&b.user).then(a.period_id.cmp(&b.period_id)));
    let mut out = Recipients::default();
    let mut i = 0;
    while i < hits.len() {
        let mut j = i + 1;
        while j < hits.len() && hits[j].user == hits[i].user {
            j += 1;
        }
        if j - i == 1 {
            out.deliver.push((hits[i].user.clone(), hits[i].period_id));
        } else {
            out.quarantined.push(hits[i].user.clone());
        }
        i = j;
    }
    out
}

/// A control event concerns a message (its target, at `target_seq`):
/// only who could see that message gets it. `at_event` are the recipients
/// covering the event itself, `holders` those covering the target. Edits and
/// reactions go to current holders (periods covering both the event and the
/// target); a recall also reaches holders who left since, so tombstones
/// outlive every holder of the content (E1). An event without a target
/// (a message, a membership change) goes to `at_event` as it is. `kind` is
/// the conversation event's kind.
pub fn control_recipients(mut at_event: Recipients, holders: Option<Recipients>, kind: &str) -> Recipients {
    let Some(holders) = holders else { return at_event };
    let recall = kind == KIND_RECALL;
    let held = |u: &String| holders.deliver.iter().any(|(h, _)| h == u) || holders.quarantined.contains(u);
    at_event.deliver.retain(|(u, _)| held(u));
    if recall {
        for (user, period) in holders.deliver {
            let known = at_event.deliver.iter().any(|(u, _)| *u == user) || at_event.quarantined.contains(&user);
            if !known {
                at_event.deliver.push((user, period));
            }
        }
    }
    at_event
}

/// A membership change, ordered by the conversation's writer (G1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MembershipChange {
    Add,
    Remove,
    Leave,
}

impl MembershipChange {
    /// The `op` of the stored `member.join` / `member.leave` payload.
    pub fn verb(self) -> &'static str {
        match self {
            MembershipChange::Add => "add",
            MembershipChange::Remove => "remove",
            MembershipChange::Leave => "leave",
        }
    }
}

/// A retried `create_group`: the earlier event with the same idempotency
/// key, as `(conv, kind)`. Returns the group the first attempt created, or
/// `None` when the key is new; a key used for anything else is refused.
pub fn replayed_group(earlier: Option<(String, String)>, client_msg_id: &str) -> Result<Option<String>, Refusal> {
    match earlier {
        None => Ok(None),
        Some((conv, kind)) if kind == KIND_CREATED => Ok(Some(conv)),
        Some(_) => Err(Refusal::Invalid(format!("client_msg_id {client_msg_id} was already used"))),
    }
}

/// The members of a new group: the creator and `members`, sorted, each
/// once; at most [`GROUP_MEMBERS_MAX`].
pub fn group_members(owner: &str, members: &[String]) -> Result<Vec<String>, Refusal> {
    let mut all: Vec<String> = members.to_vec();
    all.push(owner.to_owned());
    all.sort();
    all.dedup();
    if all.len() > GROUP_MEMBERS_MAX {
        return Err(too_many_members());
    }
    Ok(all)
}

fn too_many_members() -> Refusal {
    Refusal::Invalid(format!("a group has at most {GROUP_MEMBERS_MAX} members"))
}

/// A direct conversation is between two distinct users.
pub fn check_direct(a: &str, b: &str) -> Result<(), Refusal> {
    if a == b {
        return Err(Refusal::Invalid("a direct conversation needs two distinct users".into()));
    }
    Ok(())
}

/// The refusal for a user named in a request who has no account. It names
/// no one: the reply is the same whichever of several named users is
/// missing, so it says nothing beyond "not every name is an account".
pub const NO_SUCH_USER: &str = "no such user";

/// Every one of `users` has an account (`known` are those that do); else
/// `NotFound` with [`NO_SUCH_USER`].
pub fn all_known(users: &[String], known: &[String]) -> Result<(), Refusal> {
    let known: HashSet<&str> = known.iter().map(String::as_str).collect();
    match users.iter().find(|u| !known.contains(u.as_str())) {
        Some(_) => Err(Refusal::NotFound(NO_SUCH_USER.into())),
        None => Ok(()),
    }
}

/// What a membership change reads before it decides, at the
/// conversation's linearisation point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipFacts {
    /// The conversation's kind (`direct`, `group`).
    pub kind: String,
    pub owner: Option<String>,
    /// The actor has an open period.
    pub actor_active: bool,
    /// The target has an account.
    pub target_known: bool,
    /// The `join_seq` of the target's open period, if it has one.
    pub target_open_join: Option<MsgSeq>,
    /// Members with an open period.
    pub active_members: u64,
}

/// What a membership change does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MembershipDecision {
    /// The target already is a member: nothing is written; the answer is
    /// the open period's `join_seq`.
    AlreadyMember { join_seq: MsgSeq },
    /// A `member.join` event; a new period opens at its `msg_seq`.
    Join,
    /// A `member.leave` event; the target's open period closes at its
    /// `msg_seq` (inclusive).
    Leave,
}

/// G1: who may add, remove or let leave whom. `facts` is `None` when the
/// conversation does not exist. The checks run in a fixed order, so every
/// backend answers the same situation with the same refusal.
pub fn decide_membership(
    conv: &str,
    facts: Option<&MembershipFacts>,
    actor: &str,
    target: &str,
    change: MembershipChange,
) -> Result<MembershipDecision, Refusal> {
    let Some(f) = facts else { return Err(Refusal::NotFound(format!("conversation {conv}"))) };
    if f.kind != CONV_GROUP {
        return Err(Refusal::Invalid("a direct conversation has fixed members".into()));
    }
    if !f.actor_active {
        return Err(Refusal::NotMember);
    }
    match change {
        MembershipChange::Add => {
            if !f.target_known {
                return Err(Refusal::NotFound(NO_SUCH_USER.into()));
            }
            if let Some(join_seq) = f.target_open_join {
                return Ok(MembershipDecision::AlreadyMember { join_seq });
            }
            if f.active_members as usize >= GROUP_MEMBERS_MAX {
                return Err(too_many_members());
            }
            Ok(MembershipDecision::Join)
        }
        MembershipChange::Remove | MembershipChange::Leave => {
            if change == MembershipChange::Leave && target != actor {
                return Err(Refusal::Invalid("leave applies to the caller".into()));
            }
            if change == MembershipChange::Remove && f.owner.as_deref() != Some(actor) {
                return Err(Refusal::Forbidden("only the group owner removes members".into()));
            }
            if f.target_open_join.is_none() {
                return Err(Refusal::NotFound(format!("{target} is not a member")));
            }
            Ok(MembershipDecision::Leave)
        }
    }
}

/// The facts one `conv.members` page is decided on, read in one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembersFacts {
    /// `(members_seq, owner)` of the conversation; `None` when it does not
    /// exist.
    pub conv: Option<(MsgSeq, Option<String>)>,
    /// Whether the caller has an open period in it.
    pub caller_active: bool,
    /// The current members above the page's `after`, by user id, each with
    /// the `join_seq` of their open period: up to `limit + 1` rows, the
    /// extra one saying that more follow.
    pub rows: Vec<(String, MsgSeq)>,
}

/// One page of a conversation's current members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembersPage {
    /// The `msg_seq` of the conversation's last membership change: a
    /// reader paging a moving list sees it change between pages.
    pub members_seq: MsgSeq,
    /// The group's owner; `None` for a direct conversation.
    pub owner: Option<String>,
    /// `(user, join_seq)`, by user id, at most `limit`.
    pub members: Vec<(String, MsgSeq)>,
    pub has_more: bool,
}

/// Who may read a conversation's member list (`conv.members`): a current
/// member only; `NotFound` when the conversation does not exist, otherwise
/// `NotMember` (a departed member included). `facts.rows` holds at most
/// `limit + 1` rows; the page keeps `limit` of them.
pub fn members_page(conv: &str, facts: MembersFacts, limit: usize) -> Result<MembersPage, Refusal> {
    let Some((members_seq, owner)) = facts.conv else {
        return Err(Refusal::NotFound(format!("conversation {conv}")));
    };
    if !facts.caller_active {
        return Err(Refusal::NotMember);
    }
    let mut members = facts.rows;
    let has_more = members.len() > limit;
    members.truncate(limit);
    Ok(MembersPage { members_seq, owner, members, has_more })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::{KIND_EDIT, KIND_REACTION};

    fn p(id: i64, user: &str, join: u64, leave: Option<u64>) -> Period {
        Period { period_id: id, user: user.into(), join_seq: join, leave_seq: leave }
    }

    #[test]
    fn covers_is_closed_on_both_ends() {
        let period = p(1, "a", 5, Some(9));
        assert!(!period.covers(4));
        assert!(period.covers(5));
        assert!(period.covers(9));
        assert!(!period.covers(10));
        assert!(p(2, "a", 5, None).covers(1_000_000));
    }

    #[test]
    fn rejoin_periods_are_independent_and_overlap_is_quarantined() {
        let periods = vec![p(1, "a", 1, Some(10)), p(2, "a", 20, None), p(3, "b", 1, None)];
        assert_eq!(recipients_at(&periods, 15).deliver, vec![("b".to_string(), 3)]);
        assert_eq!(recipients_at(&periods, 20).deliver, vec![("a".to_string(), 2), ("b".to_string(), 3)]);
        let overlapping = vec![p(1, "a", 1, None), p(2, "a", 3, None)];
        let r = recipients_at(&overlapping, 4);
        assert!(r.deliver.is_empty());
        assert_eq!(r.quarantined, vec!["a".to_string()]);
    }

    fn r(deliver: &[(&str, i64)], quarantined: &[&str]) -> Recipients {
        Recipients {
            deliver: deliver.iter().map(|(u, p)| (u.to_string(), *p)).collect(),
            quarantined: quarantined.iter().map(|u| u.to_string()).collect(),
        }
    }

    #[test]
    fn control_events_reach_the_targets_holders() {
        fn check(input: (Recipients, Option<Recipients>, &str), expect: Recipients) {
            let (at, holders, kind) = input.clone();
            assert_eq!(control_recipients(at, holders, kind), expect, "{input:?}");
        }
        let at = r(&[("a", 1), ("b", 2), ("new", 5)], &[]);
        let holders = r(&[("a", 1), ("b", 2), ("gone", 3)], &[]);
        // No target: everyone covering the event.
        check((at.clone(), None, "text"), at.clone());
        // Edit or reaction: current holders only (the newcomer never saw it).
        check((at.clone(), Some(holders.clone()), KIND_EDIT), r(&[("a", 1), ("b", 2)], &[]));
        check((at.clone(), Some(holders.clone()), KIND_REACTION), r(&[("a", 1), ("b", 2)], &[]));
        // Recall: the holders who left since get the tombstone too.
        check((at.clone(), Some(holders.clone()), KIND_RECALL), r(&[("a", 1), ("b", 2), ("gone", 3)], &[]));
        // A user quarantined at the event is never added back by a recall.
        check((r(&[("a", 1)], &["gone"]), Some(holders), KIND_RECALL), r(&[("a", 1), ("b", 2)], &["gone"]));
        // A holder quarantined at the target still counts as a holder.
        check((r(&[("a", 1)], &[]), Some(r(&[], &["a"])), KIND_EDIT), r(&[("a", 1)], &[]));
    }

    #[test]
    fn group_creation_rules() {
        fn check(input: (&str, &[&str]), expect: Result<Vec<&str>, Refusal>) {
            let members: Vec<String> = input.1.iter().map(|m| m.to_string()).collect();
            let want = expect.map(|v| v.into_iter().map(String::from).collect::<Vec<_>>());
            assert_eq!(group_members(input.0, &members), want, "{input:?}");
        }
        check(("a", &["c", "b"]), Ok(vec!["a", "b", "c"]));
        check(("a", &["a", "b", "b"]), Ok(vec!["a", "b"]));
        check(("a", &[]), Ok(vec!["a"]));
        let many: Vec<String> = (0..GROUP_MEMBERS_MAX).map(|i| format!("u{i:06}")).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        check(
            ("a", &refs[..GROUP_MEMBERS_MAX - 1]),
            Ok(std::iter::once("a").chain(refs[..GROUP_MEMBERS_MAX - 1].iter().copied()).collect()),
        );
        check(("a", &refs), Err(Refusal::Invalid(format!("a group has at most {GROUP_MEMBERS_MAX} members"))));
    }

    #[test]
    fn group_creation_retries_and_unknown_users() {
        fn check(input: (Option<(&str, &str)>, &str), expect: Result<Option<&str>, Refusal>) {
            let earlier = input.0.map(|(c, k)| (c.to_string(), k.to_string()));
            assert_eq!(replayed_group(earlier, input.1), expect.map(|c| c.map(String::from)), "{input:?}");
        }
        check((None, "k"), Ok(None));
        check((Some(("g1", KIND_CREATED)), "k"), Ok(Some("g1")));
        check((Some(("g1", "text")), "k"), Err(Refusal::Invalid("client_msg_id k was already used".into())));
        let s = |v: &[&str]| v.iter().map(|u| u.to_string()).collect::<Vec<_>>();
        assert_eq!(all_known(&s(&["a", "b"]), &s(&["b", "a"])), Ok(()));
        assert_eq!(all_known(&s(&["a", "x", "y"]), &s(&["a"])), Err(Refusal::NotFound(NO_SUCH_USER.into())));
        assert_eq!(check_direct("a", "b"), Ok(()));
        assert_eq!(
            check_direct("a", "a"),
            Err(Refusal::Invalid("a direct conversation needs two distinct users".into()))
        );
    }

    #[test]
    fn membership_change_rules() {
        use MembershipChange::*;
        fn check(
            input: (Option<MembershipFacts>, &str, &str, MembershipChange),
            expect: Result<MembershipDecision, Refusal>,
        ) {
            let (facts, actor, target, change) = &input;
            assert_eq!(decide_membership("g", facts.as_ref(), actor, target, *change), expect, "{input:?}");
        }
        let group = MembershipFacts {
            kind: CONV_GROUP.into(),
            owner: Some("own".into()),
            actor_active: true,
            target_known: true,
            target_open_join: None,
            active_members: 3,
        };
        let member = MembershipFacts { target_open_join: Some(4), ..group.clone() };
        check((None, "own", "x", Add), Err(Refusal::NotFound("conversation g".into())));
        let direct = MembershipFacts { kind: "direct".into(), owner: None, ..group.clone() };
        check((Some(direct), "own", "x", Add), Err(Refusal::Invalid("a direct conversation has fixed members".into())));
        let outsider = MembershipFacts { actor_active: false, ..group.clone() };
        check((Some(outsider.clone()), "x", "x", Add), Err(Refusal::NotMember));
        check((Some(outsider), "x", "x", Leave), Err(Refusal::NotMember));
        // Add: any member adds; an unknown user, a member, a full group.
        check((Some(group.clone()), "m", "x", Add), Ok(MembershipDecision::Join));
        let unknown = MembershipFacts { target_known: false, ..group.clone() };
        check((Some(unknown), "m", "zz", Add), Err(Refusal::NotFound(NO_SUCH_USER.into())));
        check((Some(member.clone()), "m", "x", Add), Ok(MembershipDecision::AlreadyMember { join_seq: 4 }));
        let full = MembershipFacts { active_members: GROUP_MEMBERS_MAX as u64, ..group.clone() };
        check(
            (Some(full.clone()), "m", "x", Add),
            Err(Refusal::Invalid(format!("a group has at most {GROUP_MEMBERS_MAX} members"))),
        );
        let almost = MembershipFacts { active_members: GROUP_MEMBERS_MAX as u64 - 1, ..group.clone() };
        check((Some(almost), "m", "x", Add), Ok(MembershipDecision::Join));
        // A full group still answers an add of a member with its join.
        let full_member = MembershipFacts { target_open_join: Some(2), ..full };
        check((Some(full_member), "m", "x", Add), Ok(MembershipDecision::AlreadyMember { join_seq: 2 }));
        // Leave applies to the caller; remove is the owner's.
        check((Some(member.clone()), "x", "x", Leave), Ok(MembershipDecision::Leave));
        check((Some(member.clone()), "m", "x", Leave), Err(Refusal::Invalid("leave applies to the caller".into())));
        check((Some(member.clone()), "own", "x", Remove), Ok(MembershipDecision::Leave));
        check(
            (Some(member.clone()), "m", "x", Remove),
            Err(Refusal::Forbidden("only the group owner removes members".into())),
        );
        let ownerless = MembershipFacts { owner: None, ..member.clone() };
        check(
            (Some(ownerless), "own", "x", Remove),
            Err(Refusal::Forbidden("only the group owner removes members".into())),
        );
        check((Some(group.clone()), "own", "x", Remove), Err(Refusal::NotFound("x is not a member".into())));
        check((Some(group), "x", "x", Leave), Err(Refusal::NotFound("x is not a member".into())));
        assert_eq!((Add.verb(), Remove.verb(), Leave.verb()), ("add", "remove", "leave"));
    }

    #[test]
    fn member_lists_are_read_by_current_members_in_pages() {
        /// `(members_seq and owner, caller active, rows read, limit)`.
        type Input<'a> = (Option<(u64, Option<&'a str>)>, bool, &'a [(&'a str, u64)], usize);
        fn check(input: Input<'_>, expect: Result<MembersPage, Refusal>) {
            let (conv, caller_active, rows, limit) = input;
            let facts = MembersFacts {
                conv: conv.map(|(seq, owner)| (seq, owner.map(str::to_owned))),
                caller_active,
                rows: rows.iter().map(|(u, s)| (u.to_string(), *s)).collect(),
            };
            assert_eq!(members_page("g", facts, limit), expect, "{input:?}");
        }
        let page = |seq, owner: Option<&str>, members: &[(&str, u64)], has_more| {
            Ok(MembersPage {
                members_seq: seq,
                owner: owner.map(str::to_owned),
                members: members.iter().map(|(u, s)| (u.to_string(), *s)).collect(),
                has_more,
            })
        };
        check((None, false, &[], 10), Err(Refusal::NotFound("conversation g".into())));
        check((None, true, &[], 10), Err(Refusal::NotFound("conversation g".into())));
        check((Some((4, Some("a"))), false, &[("a", 1)], 10), Err(Refusal::NotMember));
        check(
            (Some((4, Some("a"))), true, &[("a", 1), ("b", 4)], 10),
            page(4, Some("a"), &[("a", 1), ("b", 4)], false),
        );
        check((Some((4, Some("a"))), true, &[("a", 1), ("b", 4)], 2), page(4, Some("a"), &[("a", 1), ("b", 4)], false));
        check(
            (Some((4, Some("a"))), true, &[("a", 1), ("b", 4), ("c", 1)], 2),
            page(4, Some("a"), &[("a", 1), ("b", 4)], true),
        );
        // A page past the last member is empty, not a refusal.
        check((Some((1, None)), true, &[], 5), page(1, None, &[], false));
    }
}
