//! Mentions (issue 18): what a send may mention, who may mention everyone,
//! and which recipient a mention counts for. Pure: the backends read the
//! facts (the conversation's kind, owner and active members at the send's
//! linearisation point; the stored message's mentions at fan-out) and
//! write what these decide, in the transactions that write the message and
//! the fan-out.
//!
//! A message stores its mentions as facts (`messages.mentions`, the named
//! users, and `messages.mention_all`), so every count can be rebuilt from
//! them. A recipient's mention count per conversation moves with unread
//! (R3): the fan-out adds one for a message that counts as unread for the
//! recipient and [`counts`] for them; `read` clears it up to `read_to_seq`
//! only (a recount of the mentions above the new read cursor); the unread
//! rebuild and reconciliation recount it from the same facts. A shared
//! (large) group writes nothing per member (G2): its mentions above the
//! switch are counted from the conversation log on read, as its unread is,
//! and "everyone" there is the message's one flag, never a row per member.

use crate::kinds::CONV_GROUP;
use crate::{ids, Refusal};

/// Most users one message names in `mentions`.
pub const MENTIONS_MAX: usize = 50;

/// "Everyone" (`mention_all`) is allowed in a group of at most this many
/// active members, whoever sends it; in a larger group only its owner
/// (creator) may mention everyone. A direct conversation always allows it.
pub const MENTION_ALL_MEMBERS_MAX: u64 = 20;

/// What the "everyone" permission reads at the send's linearisation point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MentionAllFacts {
    /// The conversation's kind (`direct`, `group`).
    pub kind: String,
    /// The group's owner (its creator); `None` for a direct conversation.
    pub owner: Option<String>,
    /// Members with an open period.
    pub active_members: u64,
}

/// The mention-all permission: a direct conversation, the group's owner,
/// or a group of at most [`MENTION_ALL_MEMBERS_MAX`] active members.
pub fn may_mention_all(facts: &MentionAllFacts, sender: &str) -> bool {
    facts.kind != CONV_GROUP
        || facts.owner.as_deref() == Some(sender)
        || facts.active_members <= MENTION_ALL_MEMBERS_MAX
}

/// Refuses a `mention_all` the sender may not make (`FORBIDDEN`).
pub fn check_mention_all(mention_all: bool, facts: &MentionAllFacts, sender: &str) -> Result<(), Refusal> {
    if mention_all && !may_mention_all(facts, sender) {
        return Err(Refusal::Forbidden(format!(
            "only the group owner mentions everyone in a group of more than {MENTION_ALL_MEMBERS_MAX} members"
        )));
    }
    Ok(())
}

/// The mentions a send stores: at most [`MENTIONS_MAX`] valid user ids,
/// in their one folded form (`ids::canonical_user`), sorted, each once, the sender left out (a mention of oneself never
/// counts). Users who are not members are kept: they count for nobody.
pub fn normalize(mentions: &[String], sender: &str) -> Result<Vec<String>, Refusal> {
    if mentions.len() > MENTIONS_MAX {
        return Err(Refusal::Invalid(format!("at most {MENTIONS_MAX} mentions")));
    }
    let mut out = Vec::with_capacity(mentions.len());
    for m in mentions {
        let m = ids::canonical_user(m).map_err(Refusal::Invalid)?;
        if m != sender {
            out.push(m);
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Whether a delivered message mentions `recipient`: never the sender,
/// only a user it names or everyone when it mentions everyone. The
/// fan-out asks this only for recipients inside their period (F4) and
/// counts it only where the message counts as unread (R3).
pub fn counts(recipient: &str, sender: &str, mentions: &[String], mention_all: bool) -> bool {
    recipient != sender && (mention_all || mentions.iter().any(|m| m == recipient))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn mention_all_permission() {
        fn check(input: (&str, Option<&str>, u64, &str), expect: bool) {
            let facts =
                MentionAllFacts { kind: input.0.into(), owner: input.1.map(Into::into), active_members: input.2 };
            assert_eq!(may_mention_all(&facts, input.3), expect, "{input:?}");
            assert_eq!(check_mention_all(true, &facts, input.3).is_ok(), expect, "{input:?}");
            assert_eq!(check_mention_all(false, &facts, input.3), Ok(()), "{input:?}");
        }
        check(("direct", None, 2, "a"), true);
        check(("group", Some("own"), MENTION_ALL_MEMBERS_MAX, "a"), true);
        check(("group", Some("own"), MENTION_ALL_MEMBERS_MAX + 1, "a"), false);
        check(("group", Some("own"), MENTION_ALL_MEMBERS_MAX + 1, "own"), true);
        check(("group", None, MENTION_ALL_MEMBERS_MAX + 1, "a"), false);
        check(("group", Some("own"), 5000, "own"), true);
    }

    #[test]
    fn normalize_rules() {
        fn check(input: (&[&str], &str), expect: Result<Vec<String>, ()>) {
            assert_eq!(normalize(&s(input.0), input.1).map_err(|_| ()), expect, "{input:?}");
        }
        check((&[], "a"), Ok(vec![]));
        check((&["c", "B", "c", "a"], "a"), Ok(s(&["b", "c"])));
        check((&["a"], "a"), Ok(vec![]));
        check((&[""], "a"), Err(()));
        let many: Vec<String> = (0..=MENTIONS_MAX).map(|i| format!("u{i}")).collect();
        assert!(normalize(&many[..MENTIONS_MAX], "a").is_ok());
        assert_eq!(normalize(&many, "a"), Err(Refusal::Invalid(format!("at most {MENTIONS_MAX} mentions"))));
    }

    #[test]
    fn who_a_mention_counts_for() {
        fn check(input: (&str, &[&str], bool), expect: bool) {
            assert_eq!(counts(input.0, "snd", &s(input.1), input.2), expect, "{input:?}");
        }
        check(("b", &["b"], false), true);
        check(("c", &["b"], false), false);
        check(("c", &[], true), true);
        check(("snd", &["snd"], true), false);
        check(("b", &[], false), false);
    }
}
