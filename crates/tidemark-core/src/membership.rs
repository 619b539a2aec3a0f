//! Membership periods (G1, F4): who may see the message at a given `msg_seq`.
//!
//! A period `[join_seq, leave_seq]` (closed; `leave_seq` open while active)
//! belongs to one user in one conversation and gets a fresh id per join.
//! Fan-out resolves recipients from the periods that cover a message's
//! `msg_seq`, never from the current member list, so a fan-out delayed past a
//! leave still delivers the pre-leave messages and never a later one.

use crate::MsgSeq;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
