//! The Tidemark domain core: the rules every other crate trusts.
//!
//! It owns the sequence, cursor, resume, ACK, token and membership rules of
//! the design (seed 000 §4–§8, REQUIREMENTS S/F/D/G). It is pure: no IO, no
//! async, no clock reads and no randomness; time and secrets come in as
//! arguments. It does not know about serde, SQL or sockets. Storage backends
//! call [`cursor::decide_ack`] and friends *inside* their transactions so the
//! decision and the write are one atomic step, and the rule itself is the
//! same for every backend.

pub mod convsync;
pub mod cursor;
pub mod ids;
pub mod membership;
pub mod page;
pub mod token;

/// A per-conversation message sequence number (`msg_seq`), starting at 1.
pub type MsgSeq = u64;
/// A per-user sync log position (`sync_seq`), starting at 1; 0 means "before
/// the first event".
pub type SyncSeq = u64;
/// A device's `sync_generation`, starting at 1.
pub type Generation = u64;
