//! The audit log's vocabulary and retention (P1, seed §17.1), pure.
//!
//! Each entry records one account or device event: what happened, who did
//! it, whose account and device it concerns (as keyed hashes,
//! `token::TokenKeys::audit_id`), the source address and the time. Never a
//! password, a token or a message body.

/// Events, as stored.
pub mod event {
    /// A login with a `device_id` the user never used: the device is new.
    pub const DEVICE_REGISTERED: &str = "device_registered";
    pub const LOGIN: &str = "login";
    pub const LOGIN_FAILED: &str = "login_failed";
    pub const REFRESH: &str = "refresh";
    /// A rotated refresh token came back: its family was revoked.
    pub const REFRESH_REUSED: &str = "refresh_reused";
    pub const DEVICE_REVOKED: &str = "device_revoked";
    pub const PASSWORD_CHANGED: &str = "password_changed";
    pub const PASSWORD_CHANGE_FAILED: &str = "password_change_failed";
    pub const LOGGED_OUT: &str = "logged_out";
    pub const DEACTIVATED: &str = "deactivated";
    pub const DELETED: &str = "deleted";
    pub const USER_CREATED: &str = "user_created";
}

/// Who acted.
pub mod actor {
    /// The account's own device (or someone presenting its credentials).
    pub const SELF: &str = "self";
    /// An operator, through an admin endpoint or the CLI.
    pub const ADMIN: &str = "admin";
    /// Someone not (yet) authenticated: a login or refresh attempt.
    pub const ANONYMOUS: &str = "anonymous";
}

/// The oldest time an entry is kept at `now_ms` when entries live
/// `keep_ms`: older ones are deleted by the retention pass.
pub fn keep_from(now_ms: i64, keep_ms: i64) -> i64 {
    now_ms.saturating_sub(keep_ms.max(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_kept_for_their_period() {
        fn check(now_ms: i64, keep_ms: i64, expect: i64) {
            assert_eq!(keep_from(now_ms, keep_ms), expect, "{now_ms} keeping {keep_ms}");
        }
        check(1_000, 100, 900);
        check(1_000, 0, 1_000);
        check(1_000, -5, 1_000);
        check(i64::MIN + 1, 10, i64::MIN);
    }
}
