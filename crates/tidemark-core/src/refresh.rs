//! Refresh-token rotation with reuse detection (P1, seed §17.1), pure.
//!
//! Every refresh token belongs to a *family*: the chain of tokens that
//! started at one login, each replacing the one before it. Using a live
//! token rotates it: it is kept, marked used, and its successor joins the
//! family. A used token presented again means two parties hold the chain
//! (a stolen token, or a client that replayed one): the whole family is
//! revoked, the successor included, so whoever holds it must log in again.
//! Used tokens are remembered until their own expiry, then forgotten like
//! expired live ones; past that a replay is only an unknown token.

/// The stored state of the token presented, if one is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Never used; valid until `expires_at_ms`.
    Live { expires_at_ms: i64 },
    /// Already rotated into a successor.
    Used,
}

/// What a refresh does with the token presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No such token: refuse, change nothing.
    Unknown,
    /// Live but expired: delete it and refuse.
    Expired,
    /// Live: mark it used and issue its successor in the same family.
    Rotate,
    /// Used already: revoke every token of its family and refuse.
    RevokeFamily,
}

pub fn decide(stored: Option<Stored>, now_ms: i64) -> Verdict {
    match stored {
        None => Verdict::Unknown,
        Some(Stored::Used) => Verdict::RevokeFamily,
        Some(Stored::Live { expires_at_ms }) if expires_at_ms <= now_ms => Verdict::Expired,
        Some(Stored::Live { .. }) => Verdict::Rotate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(stored: Option<Stored>, now_ms: i64, expect: Verdict) {
        assert_eq!(decide(stored, now_ms), expect, "{stored:?} at {now_ms}");
    }

    #[test]
    fn a_live_token_rotates_and_a_used_one_revokes_its_family() {
        check(None, 10, Verdict::Unknown);
        check(Some(Stored::Live { expires_at_ms: 11 }), 10, Verdict::Rotate);
        check(Some(Stored::Live { expires_at_ms: 10 }), 10, Verdict::Expired);
        check(Some(Stored::Live { expires_at_ms: 9 }), 10, Verdict::Expired);
        check(Some(Stored::Used), 10, Verdict::RevokeFamily);
    }
}
