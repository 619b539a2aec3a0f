//! The client's decisions that need no IO: reconnect backoff, the "one sync
//! in flight, sync again once" gate (K4), and what the client does for every
//! refusal and kick of the contract (docs/protocol.md §4.2, §5, §7).
//!
//! Pure: no clock, no random number, no socket. Randomness comes in as an
//! argument so the engine and the tests share one rule. The engine owns the
//! effects (sleeping, wiping, reconnecting); this module only names them.

use std::time::Duration;

use tidemark_proto::{reason, ErrorCode};

use crate::ClientError;

/// Exponential backoff with full jitter: attempt `n` waits a uniform random
/// time in `[0, min(cap, base * 2^n)]`, so clients that lost the same server
/// at the same moment do not come back at the same moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

/// Doublings after which the ceiling stops growing (2^16 × base is far past
/// any sensible cap); keeps the arithmetic in range.
const BACKOFF_DOUBLINGS_MAX: u32 = 16;

impl Default for Backoff {
    fn default() -> Self {
        Backoff { base: Duration::from_millis(250), cap: Duration::from_secs(30) }
    }
}

impl Backoff {
    /// The ceiling of attempt `attempt` (0-based).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.min(BACKOFF_DOUBLINGS_MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The wait before attempt `attempt`, drawn with `random` (any u64).
    pub fn delay(&self, attempt: u32, random: u64) -> Duration {
        let ceiling_ms = self.ceiling(attempt).as_millis() as u64;
        Duration::from_millis(random % (ceiling_ms + 1))
    }

    /// The wait before retrying after a refusal that named its own
    /// `retry_after_ms`: never shorter than the server asked, plus jitter.
    pub fn delay_after(&self, retry_after: Option<Duration>, attempt: u32, random: u64) -> Duration {
        retry_after.unwrap_or_default() + self.delay(attempt, random)
    }
}

/// At most one sync in flight; a reason to sync that arrives while one runs
/// only sets "sync again", so N hints cause at most two syncs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncGate {
    running: bool,
    again: bool,
}

impl SyncGate {
    /// A reason to sync arrived (connect, hint, timer, gap). Returns whether
    /// a sync must start now; the gate then counts it as running.
    pub fn request(&mut self) -> bool {
        if self.running {
            self.again = true;
            return false;
        }
        self.running = true;
        true
    }

    /// The running sync ended. Returns whether another must start now (a
    /// request arrived meanwhile); the gate then counts it as running.
    pub fn finish(&mut self) -> bool {
        assert!(self.running, "finish without a running sync");
        if self.again {
            self.again = false;
            return true;
        }
        self.running = false;
        false
    }

    /// The running sync was abandoned (it will be retried by a timer):
    /// forget it and any pending request.
    pub fn abandon(&mut self) {
        *self = SyncGate::default();
    }

    pub fn is_running(&self) -> bool {
        self.running
    }
}

/// The request a refusal answered; the same code can mean different things
/// for different requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A `sync` page (first or next).
    Sync,
    Ack,
    Send,
    /// `conv.create`, `conv.list` and other calls the app makes.
    Call,
    /// Login, refresh or the WebSocket upgrade.
    Connect,
}

/// What the client does about a failed request or a kick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `RESET_REQUIRED`: wipe the local synced state (keep the outbox),
    /// adopt `generation`, sync again from 0.
    Reset { generation: Option<u64> },
    /// Drop the current batch and start a new one with a first page; the
    /// server's resume rule decides where it starts.
    RestartBatch,
    /// Transient: retry the same request after at least `retry_after`, with
    /// backoff and jitter; the connection stays.
    Retry { retry_after: Option<Duration> },
    /// The access token is not good: refresh it (or log in again) and
    /// reconnect.
    Reauthenticate,
    /// The connection is gone or unusable: reconnect with backoff.
    Reconnect,
    /// The device was revoked: stop, delete tokens and local data.
    Revoked,
    /// Another instance took this device over: stop, do not reconnect.
    Superseded,
    /// This request can never succeed as it is (a send to a conversation the
    /// user is not in, a malformed call): fail it and go on with the next.
    Reject,
}

/// The action for `err`, answered to `op`. Every contract code has one.
pub fn action_for(op: Op, err: &ClientError) -> Action {
    let frame = match err {
        ClientError::Server(frame) => frame,
        ClientError::Transport(_) | ClientError::Closed => return Action::Reconnect,
        // A reply we cannot read: the server and this client disagree about
        // the protocol. Dropping the connection and starting over is the
        // only move that cannot apply half-understood data.
        ClientError::Decode(_) => return Action::Reconnect,
    };
    let retry_after = frame.retry_after_ms.map(Duration::from_millis);
    match frame.code {
        ErrorCode::ResetRequired => Action::Reset { generation: frame.sync_generation },
        ErrorCode::StaleGeneration | ErrorCode::TokenInvalid | ErrorCode::AckBeyondWatermark => match op {
            Op::Sync | Op::Ack => Action::RestartBatch,
            _ => Action::Reject,
        },
        ErrorCode::RateLimited | ErrorCode::Unavailable | ErrorCode::Internal => Action::Retry { retry_after },
        ErrorCode::Unauthenticated => Action::Reauthenticate,
        ErrorCode::DeviceRevoked => Action::Revoked,
        // "The device record no longer exists" on ACK: log in again.
        ErrorCode::NotFound if op == Op::Ack || op == Op::Sync => Action::Reauthenticate,
        ErrorCode::BadRequest
        | ErrorCode::Forbidden
        | ErrorCode::NotMember
        | ErrorCode::NotFound
        | ErrorCode::CursorAhead
        | ErrorCode::EpochChanged
        | ErrorCode::Conflict => match op {
            Op::Send | Op::Call => Action::Reject,
            // A sync or ACK the server calls malformed is a client bug or a
            // protocol mismatch; starting a fresh batch is safe, and the
            // engine's restart bound turns a persistent one into a backoff.
            Op::Sync | Op::Ack => Action::RestartBatch,
            Op::Connect => Action::Reauthenticate,
        },
    }
}

/// The action for a `kicked` frame (docs/protocol.md §4.2).
pub fn action_for_kick(kick_reason: &str) -> Action {
    match kick_reason {
        reason::SUPERSEDED => Action::Superseded,
        reason::DEVICE_REVOKED => Action::Revoked,
        reason::TOKEN_EXPIRED => Action::Reauthenticate,
        // The refresh token is gone as well: reauthenticating ends in a
        // logged-out client, without a reconnect that would be refused.
        reason::LOGGED_OUT | reason::ACCOUNT_DEACTIVATED => Action::Reauthenticate,
        // slow_consumer, shutdown and reasons added later.
        _ => Action::Reconnect,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_proto::ErrorFrame;

    fn refusal(code: ErrorCode) -> ClientError {
        ClientError::Server(ErrorFrame {
            retry_after_ms: Some(300),
            sync_generation: Some(4),
            ..ErrorFrame::new(code, "test")
        })
    }

    #[test]
    fn backoff_grows_to_its_cap_with_full_jitter() {
        let b = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(1) };
        assert_eq!(b.ceiling(0), Duration::from_millis(100));
        assert_eq!(b.ceiling(3), Duration::from_millis(800));
        assert_eq!(b.ceiling(4), Duration::from_secs(1));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
        assert_eq!(b.delay(3, 0), Duration::ZERO, "full jitter reaches zero");
        assert_eq!(b.delay(3, 800), Duration::from_millis(800), "and the ceiling");
        for r in [1u64, 77, 12345, u64::MAX] {
            assert!(b.delay(10, r) <= Duration::from_secs(1));
        }
        let after = b.delay_after(Some(Duration::from_millis(500)), 0, 0);
        assert_eq!(after, Duration::from_millis(500), "never sooner than retry_after");
    }

    #[test]
    fn n_requests_during_a_sync_cause_one_more_sync() {
        let mut gate = SyncGate::default();
        let mut started = 0;
        if gate.request() {
            started += 1;
        }
        for _ in 0..50 {
            if gate.request() {
                started += 1;
            }
        }
        while gate.finish() {
            started += 1;
        }
        assert_eq!(started, 2, "one sync plus one 'sync again'");
        assert!(!gate.is_running());
        assert!(gate.request(), "idle again: the next request starts at once");
    }

    #[test]
    fn every_contract_refusal_has_the_documented_action() {
        use Action::*;
        let table: &[(Op, ErrorCode, Action)] = &[
            (Op::Sync, ErrorCode::ResetRequired, Reset { generation: Some(4) }),
            (Op::Ack, ErrorCode::ResetRequired, Reset { generation: Some(4) }),
            (Op::Sync, ErrorCode::StaleGeneration, RestartBatch),
            (Op::Ack, ErrorCode::StaleGeneration, RestartBatch),
            (Op::Sync, ErrorCode::TokenInvalid, RestartBatch),
            (Op::Ack, ErrorCode::TokenInvalid, RestartBatch),
            (Op::Send, ErrorCode::RateLimited, Retry { retry_after: Some(Duration::from_millis(300)) }),
            (Op::Sync, ErrorCode::Unavailable, Retry { retry_after: Some(Duration::from_millis(300)) }),
            (Op::Sync, ErrorCode::Unauthenticated, Reauthenticate),
            (Op::Connect, ErrorCode::Unauthenticated, Reauthenticate),
            (Op::Send, ErrorCode::DeviceRevoked, Revoked),
            (Op::Connect, ErrorCode::DeviceRevoked, Revoked),
            (Op::Send, ErrorCode::NotMember, Reject),
            (Op::Send, ErrorCode::NotFound, Reject),
            (Op::Send, ErrorCode::BadRequest, Reject),
            (Op::Ack, ErrorCode::NotFound, Reauthenticate),
        ];
        for &(op, code, expect) in table {
            assert_eq!(action_for(op, &refusal(code)), expect, "{op:?} {code}");
        }
        // No code is left without a decision, whatever the request.
        for &code in ErrorCode::ALL {
            for op in [Op::Sync, Op::Ack, Op::Send, Op::Call, Op::Connect] {
                let _ = action_for(op, &refusal(code));
            }
        }
        assert_eq!(action_for(Op::Sync, &ClientError::Closed), Reconnect);
    }

    #[test]
    fn kicks_map_to_the_documented_actions() {
        assert_eq!(action_for_kick(reason::SUPERSEDED), Action::Superseded);
        assert_eq!(action_for_kick(reason::DEVICE_REVOKED), Action::Revoked);
        assert_eq!(action_for_kick(reason::TOKEN_EXPIRED), Action::Reauthenticate);
        assert_eq!(action_for_kick(reason::LOGGED_OUT), Action::Reauthenticate);
        assert_eq!(action_for_kick(reason::ACCOUNT_DEACTIVATED), Action::Reauthenticate);
        assert_eq!(action_for_kick(reason::SLOW_CONSUMER), Action::Reconnect);
        assert_eq!(action_for_kick(reason::SHUTDOWN), Action::Reconnect);
        assert_eq!(action_for_kick("something-new"), Action::Reconnect);
    }
}
