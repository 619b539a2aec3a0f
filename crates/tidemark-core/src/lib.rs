//! The Tidemark domain core: the rules every other crate trusts.
//!
//! It owns the sequence, cursor, resume, ACK, token, membership, control
//! event (recall, edit, react), projection, snapshot and retention rules of
//! the design (seed 000 §4–§8, REQUIREMENTS S/F/D/G/E/R/L). It is pure: no IO, no
//! async, no clock reads and no randomness; time and secrets come in as
//! arguments. It does not know about serde, SQL or sockets. Storage backends
//! load the facts a rule needs, call [`cursor::decide_ack`] and friends
//! *inside* their transactions and write what they decided, so the decision
//! and the write are one atomic step, and the rule itself is the same for
//! every backend.

pub mod audit;
pub mod client_stats;
pub mod control;
pub mod convsync;
pub mod cursor;
pub mod degrade;
pub mod ephemeral;
pub mod fuse;
pub mod ids;
pub mod kinds;
pub mod large;
pub mod membership;
pub mod mention;
pub mod page;
pub mod projection;
pub mod push;
pub mod reconcile;
pub mod refresh;
pub mod retention;
pub mod route;
pub mod session;
pub mod snapshot;
pub mod throttle;
pub mod token;

/// A per-conversation message sequence number (`msg_seq`), starting at 1.
pub type MsgSeq = u64;
/// A per-user sync log position (`sync_seq`), starting at 1; 0 means "before
/// the first event".
pub type SyncSeq = u64;
/// A device's `sync_generation`, starting at 1.
pub type Generation = u64;

/// Why a rule refuses a request. The kinds are the store's neutral error
/// kinds (`tidemark_store::StoreError` converts from this one to one), so a
/// backend answers whatever the rule decided with `?`, and both backends
/// answer the same situation with the same error and message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("not a member of this conversation")]
    NotMember,
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("forbidden: {0}")]
    Forbidden(String),
    #[error("conflict: {0}")]
    Conflict(String),
    /// A stale `base_version` (E2); carries the current version.
    #[error("version is now {0}")]
    VersionConflict(u64),
}
