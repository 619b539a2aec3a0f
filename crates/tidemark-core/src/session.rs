//! Which access tokens still open a session (P1, P5), pure.
//!
//! An access token is signed and lives until it expires; an operator can
//! end sessions before that. Each end is a moment: a forced logout of one
//! device, or of every device of a user, refuses the tokens issued at or
//! before it (a later login gets a later token, which works); deactivating
//! an account refuses every token of it, whenever issued.

/// What ends the sessions of one device: the fences of its user and its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fence {
    pub user_deactivated: bool,
    /// Sessions of every device of the user issued at or before this end.
    pub user_ended_at_ms: i64,
    /// Sessions of this device issued at or before this end.
    pub device_ended_at_ms: i64,
}

/// Whether a token issued at `issued_at_ms` still opens a session.
pub fn alive(issued_at_ms: i64, fence: Fence) -> bool {
    !fence.user_deactivated && issued_at_ms > fence.user_ended_at_ms && issued_at_ms > fence.device_ended_at_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(issued_at_ms: i64, fence: Fence, expect: bool) {
        assert_eq!(alive(issued_at_ms, fence), expect, "issued at {issued_at_ms}, {fence:?}");
    }

    #[test]
    fn a_logout_ends_the_tokens_issued_until_then_and_deactivation_ends_all() {
        let none = Fence::default();
        check(10, none, true);
        check(10, Fence { device_ended_at_ms: 10, ..none }, false);
        check(11, Fence { device_ended_at_ms: 10, ..none }, true);
        check(9, Fence { user_ended_at_ms: 10, ..none }, false);
        check(11, Fence { user_ended_at_ms: 10, device_ended_at_ms: 5, ..none }, true);
        check(11, Fence { user_ended_at_ms: 5, device_ended_at_ms: 12, ..none }, false);
        check(1_000, Fence { user_deactivated: true, ..none }, false);
    }
}
