//! The Tidemark client: a transport ([`WsConn`], [`Http`]) and, on top of
//! it, the SDK an app holds per device ([`Client`]).
//!
//! The SDK keeps a local SQLite store (K1), a persistent outbox for sends,
//! recalls and reads (K3) and a contiguous cursor per conversation (K2);
//! it applies control events by version and recalls as placeholders (E1,
//! E2) and follows the user's read position across devices (R2). It runs
//! one engine task per client: a connection state machine with backoff and
//! jitter that syncs on connect, on hints and periodically, one sync at a
//! time (K4).
//! Every sync page is applied in one local transaction, and the ACK is sent
//! only after it commits; a lost ACK is repaired by the next sync, which
//! replays from the server's ACK and skips what is already applied.
//!
//! A device the server cannot resume (`RESET_REQUIRED`: offline past the
//! retention window, a new device after the log was trimmed, a restore too
//! far behind, an expired recovery) rebuilds from a **snapshot** (D7,
//! docs/protocol.md §3.21–§3.24), always, even while the log is whole:
//! `snapshot.begin` (recorded locally), every `snapshot.page`, the manifest
//! digest checked ([`manifest_digest`]), then **one** local transaction
//! replaces the synced state (conversations with the server's summaries,
//! the latest events of each, generation, `applied_sync_seq` = the base)
//! and keeps the outbox; only after that commit goes `snapshot.ack`, and
//! incremental sync continues from the base. Until the commit the old local
//! state stays readable and the server cursor does not move; a crash, a
//! refused page or a digest mismatch leaves both as they were, and the next
//! round fetches the same snapshot again (or begins a new one). An install
//! that committed but was not acked is acked first thing, before any sync.
//! The app follows it through [`Change::Reset`], [`Change::SnapshotStarted`],
//! [`Change::SnapshotPage`] (page i of n), [`Change::SnapshotInstalled`],
//! [`Change::Acked`] and, on trouble, [`Change::SnapshotFailed`].
//!
//! After a snapshot a conversation holds only its latest events: its cursor
//! stands at its `last_msg_seq`, and [`Conversation::history_to`] marks the
//! older `msg_seq`s as history to fetch on demand, never a gap.
//!
//! A recovery batch (D6: a restored store a little behind its ACK) is
//! applied like any batch; its intermediate ACKs get the old, higher ACK
//! back, and the final ACK of exactly the batch's watermark, with its
//! token, completes it.
//!
//! Module map:
//! - [`client`]: the app-facing API (open, start, send, recall, mark read,
//!   read the local store, subscribe to changes);
//! - `types`: what the client and the engine share (configuration,
//!   connection states, changes, errors);
//! - `engine`: the state machine, sync rounds and the outbox pump, and the
//!   report of the device's repair counts to the server (`client.stats`);
//! - [`store`]: the local SQLite schema and its transactions (sync pages,
//!   snapshot installs, the outbox);
//! - [`cursor`]: the pure contiguous cursor with its pending buffer;
//! - [`policy`]: pure decisions (backoff, sync gate, refusal → action);
//! - `http`, `ws`: the transport. It keeps no state and makes no sync
//!   decision: it never ACKs, retries or resyncs by itself.
//!
//! # Examples, one per area
//!
//! Each is a whole program in `examples/`, shown here as it is. The test
//! *tests/examples.rs* runs every one against a real server on 127.0.0.1,
//! with the checks each makes of what it shows; against your own server
//! (whose admin token makes the examples' accounts):
//!
//! ```sh
//! TIDEMARK_ADMIN_TOKEN=change-me cargo run -p tidemark-client --example send_and_receive -- http://127.0.0.1:8080
//! ```
//!
//! `examples/terminal.rs` is a small but complete terminal chat on this
//! API alone (log in or register, list, open, send, live receive, typing
//! on while offline), driven as a process by *tests/terminal.rs*. Apps in
//! other languages use the UniFFI bindings of `tidemark-ffi`.
//!
//! ## Send and receive
//!
//! One [`Client`] per device; [`Client::send`] is durable in the outbox when
//! it returns; the receiving device commits each sync page locally before
//! it ACKs, and the change stream ([`Client::subscribe`]) says what moved.
//!
//! ```no_run
#![doc = include_str!("../examples/send_and_receive.rs")]
//! ```
//!
//! ## Two devices of one user
//!
//! Each device has its own cursor and ACK in the user's sync log; a read is
//! the user's, not the device's (R2).
//!
//! ```no_run
#![doc = include_str!("../examples/two_devices.rs")]
//! ```
//!
//! ## History paging
//!
//! [`Client::history`]: local first, then the server, stored locally;
//! `history_to` below a snapshot's first message is history, never a gap.
//!
//! ```no_run
#![doc = include_str!("../examples/history.rs")]
//! ```
//!
//! ## Groups
//!
//! [`Client::create_group`], [`Client::add_member`],
//! [`Client::remove_member`], [`Client::leave`], and the member list
//! [`Client::members`], paged; a member reads from their join to their
//! leave (G1).
//!
//! ```no_run
#![doc = include_str!("../examples/groups.rs")]
//! ```
//!
//! ## Offline and resume
//!
//! Sends, recalls and reads queue in the outbox with no connection and
//! leave in order; a device reopened on its database resumes from its own
//! position.
//!
//! ```no_run
#![doc = include_str!("../examples/offline.rs")]
//! ```

mod calls;
pub mod client;
pub mod cursor;
mod engine;
mod ephemeral;
mod http;
pub mod policy;
pub mod store;
mod types;
mod ws;

pub use calls::{HistoryPage, MembersPage};
pub use client::{Changes, Client};
pub use ephemeral::PresenceState;
pub use http::Http;
pub use store::{
    manifest_digest, Conversation, CursorMove, FaultAction, FaultPoint, Gap, Mentions, Message, OutboxEntry, OutboxOp,
    OutboxState, PageReport, PendingSnapshot, PrivacySwitches, SnapshotReport, StoreError, SyncPosition,
};
pub use tidemark_proto as proto;
pub use types::{Change, ClientConfig, ConnState, Exit, FaultHook, SdkError};
pub use ws::{ws_config, ServerEvent, WsConn, WsOptions, WS_READ_BUFFER_BYTES};

use tidemark_proto::{ErrorCode, ErrorFrame};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientError {
    /// The server refused the request with a contract error code.
    #[error("server refused: {} ({})", .0.code, .0.message)]
    Server(ErrorFrame),
    #[error("transport: {0}")]
    Transport(String),
    #[error("connection closed")]
    Closed,
    #[error("unexpected reply: {0}")]
    Decode(String),
}

impl ClientError {
    /// The contract code of a server refusal, if this is one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server(f) => Some(f.code),
            _ => None,
        }
    }
}

pub type ClientResult<T> = Result<T, ClientError>;

/// What is read of a frame before it is parsed whole: its type `t` and, on
/// replies only, its `rid`. Every other field is skipped without being
/// built, so a frame is parsed once into what it is (issue 19: a `Value`
/// tree built first was most of the SDK's allocation in a resume).
#[derive(serde::Deserialize)]
pub(crate) struct Peek<'a> {
    #[serde(borrow, default)]
    pub t: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    pub rid: Option<std::borrow::Cow<'a, str>>,
}

/// Decodes an `<op>.ok` reply or an `error` frame from the reply's text,
/// parsed once into `T` or the error frame.
pub(crate) fn decode_reply<T: serde::de::DeserializeOwned>(text: &str) -> ClientResult<T> {
    let decode = |e: serde_json::Error| ClientError::Decode(e.to_string());
    let peek: Peek = serde_json::from_str(text).map_err(decode)?;
    if peek.t.as_deref() == Some("error") {
        return Err(ClientError::Server(serde_json::from_str(text).map_err(decode)?));
    }
    serde_json::from_str(text).map_err(decode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_proto::AckOk;

    /// A reply decodes once into its type or into the server's typed error;
    /// a frame that is not JSON is a decode error, not a panic; the peek
    /// reads `t` and an escaped `rid` whatever else the frame holds.
    #[test]
    fn replies_decode_from_their_text_into_their_type_or_the_servers_error() {
        let ok: AckOk =
            decode_reply(r#"{"t":"ack.ok","rid":"r1","acked_sync_seq":7,"sync_generation":2,"extra":[{"x":1}]}"#)
                .unwrap();
        assert_eq!((ok.acked_sync_seq, ok.sync_generation), (7, 2));
        let err = decode_reply::<AckOk>(
            r#"{"t":"error","rid":"r2","code":"RATE_LIMITED","message":"slow down","retry_after_ms":250}"#,
        );
        match err {
            Err(ClientError::Server(f)) => {
                assert_eq!(
                    (f.code, f.retry_after_ms, f.rid.as_deref()),
                    (ErrorCode::RateLimited, Some(250), Some("r2"))
                )
            }
            other => panic!("expected the server's error, got {other:?}"),
        }
        assert!(matches!(decode_reply::<AckOk>("{not json"), Err(ClientError::Decode(_))));
        assert!(matches!(decode_reply::<AckOk>(r#"{"t":"ack.ok"}"#), Err(ClientError::Decode(_))));
        let peek: Peek =
            serde_json::from_str(r#"{"events":[{"t":"x","rid":"no"}],"rid":"r\"9","t":"sync.ok"}"#).unwrap();
        assert_eq!((peek.t.as_deref(), peek.rid.as_deref()), (Some("sync.ok"), Some("r\"9")));
        let hint: Peek = serde_json::from_str(r#"{"t":"hint","user_sync_high_watermark":3}"#).unwrap();
        assert_eq!((hint.t.as_deref(), hint.rid), (Some("hint"), None));
    }
}
