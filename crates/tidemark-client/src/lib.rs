//! A Tidemark client connection: HTTP for accounts and single calls, and a
//! WebSocket that multiplexes requests by `rid` and surfaces the server's
//! `hint` and `kicked` frames.
//!
//! This is the transport layer only. It keeps no local state and makes no
//! sync decisions: it will not ACK, retry or resync by itself. The local
//! store and the sync state machine build on it.

mod http;
mod ws;

pub use http::Http;
pub use tidemark_proto as proto;
pub use ws::{ServerEvent, WsConn};

use tidemark_proto::{ErrorCode, ErrorFrame};

#[derive(Debug, Clone, thiserror::Error)]
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

/// Decodes an `<op>.ok` reply or an `error` frame.
pub(crate) fn decode_reply<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> ClientResult<T> {
    if v.get("t").and_then(|t| t.as_str()) == Some("error") {
        let frame: ErrorFrame = serde_json::from_value(v).map_err(|e| ClientError::Decode(e.to_string()))?;
        return Err(ClientError::Server(frame));
    }
    serde_json::from_value(v).map_err(|e| ClientError::Decode(e.to_string()))
}
