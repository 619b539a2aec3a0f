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

/// Whether a frame that came on the connection `frame_epoch` of a device
/// may still act, the device's newest connection being `device_epoch`
/// (P2, issue 14). A WebSocket frame carries its connection's epoch and is
/// refused once a newer connection of the device opened on any node,
/// whether or not this node has heard of it yet; an HTTP request belongs
/// to no connection (`None`) and is fenced by its token only (`alive`).
/// Both backends implement this comparison inside the statement that
/// already reads the device row (SQLite `lifecycle::ack`,
/// `events::connection_fence`; PostgreSQL `tidemark_send_on`,
/// `tidemark_ack`, `tidemark_read`); keep them the same.
pub fn frame_superseded(frame_epoch: Option<u64>, device_epoch: u64) -> bool {
    frame_epoch.is_some_and(|e| e < device_epoch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_of_an_older_connection_is_superseded_and_http_never_is() {
        for (frame, device, expect) in [
            (None, 0, false),
            (None, 9, false),
            (Some(0), 0, false),
            (Some(3), 3, false),
            (Some(4), 3, false),
            (Some(2), 3, true),
            (Some(0), 1, true),
        ] {
            assert_eq!(frame_superseded(frame, device), expect, "frame {frame:?}, device {device}");
        }
    }

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
