//! Error codes of the contract and the `error` frame that carries them.

use serde::{Deserialize, Serialize};

/// Every code a Tidemark server may answer with. The string forms are fixed
/// by the contract; new codes may be added, none renamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    BadRequest,
    Unauthenticated,
    Forbidden,
    NotMember,
    NotFound,
    ResetRequired,
    StaleGeneration,
    DeviceRevoked,
    TokenInvalid,
    AckBeyondWatermark,
    CursorAhead,
    EpochChanged,
    Conflict,
    RateLimited,
    Unavailable,
    Internal,
}

impl ErrorCode {
    pub const ALL: &'static [ErrorCode] = &[
        ErrorCode::BadRequest,
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::NotMember,
        ErrorCode::NotFound,
        ErrorCode::ResetRequired,
        ErrorCode::StaleGeneration,
        ErrorCode::DeviceRevoked,
        ErrorCode::TokenInvalid,
        ErrorCode::AckBeyondWatermark,
        ErrorCode::CursorAhead,
        ErrorCode::EpochChanged,
        ErrorCode::Conflict,
        ErrorCode::RateLimited,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "BAD_REQUEST",
            ErrorCode::Unauthenticated => "UNAUTHENTICATED",
            ErrorCode::Forbidden => "FORBIDDEN",
            ErrorCode::NotMember => "NOT_MEMBER",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::ResetRequired => "RESET_REQUIRED",
            ErrorCode::StaleGeneration => "STALE_GENERATION",
            ErrorCode::DeviceRevoked => "DEVICE_REVOKED",
            ErrorCode::TokenInvalid => "TOKEN_INVALID",
            ErrorCode::AckBeyondWatermark => "ACK_BEYOND_WATERMARK",
            ErrorCode::CursorAhead => "CURSOR_AHEAD",
            ErrorCode::EpochChanged => "EPOCH_CHANGED",
            ErrorCode::Conflict => "CONFLICT",
            ErrorCode::RateLimited => "RATE_LIMITED",
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::Internal => "INTERNAL",
        }
    }

    pub fn parse(s: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.iter().copied().find(|c| c.as_str() == s)
    }

    /// HTTP status used by `POST /v1/rpc/<op>` for this code.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest | ErrorCode::AckBeyondWatermark => 400,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::Forbidden | ErrorCode::NotMember | ErrorCode::DeviceRevoked => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::ResetRequired
            | ErrorCode::StaleGeneration
            | ErrorCode::TokenInvalid
            | ErrorCode::EpochChanged
            | ErrorCode::CursorAhead
            | ErrorCode::Conflict => 409,
            ErrorCode::RateLimited => 429,
            ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }

    /// Every HTTP status some code maps to, ascending.
    pub fn http_statuses() -> Vec<u16> {
        let mut statuses: Vec<u16> = ErrorCode::ALL.iter().map(|c| c.http_status()).collect();
        statuses.sort_unstable();
        statuses.dedup();
        statuses
    }

    /// The codes answered with HTTP `status`.
    pub fn for_status(status: u16) -> Vec<ErrorCode> {
        ErrorCode::ALL.iter().copied().filter(|c| c.http_status() == status).collect()
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `{"t":"error","rid":..,"code":..,"message":..,"retry_after_ms":..}`.
/// `sync_generation` is a Tidemark extension carried by `RESET_REQUIRED` and
/// `STALE_GENERATION` so the client learns the generation to use next.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorFrame {
    pub t: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rid: Option<String>,
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_generation: Option<u64>,
}

impl ErrorFrame {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorFrame {
            t: "error".into(),
            rid: None,
            code,
            message: message.into(),
            retry_after_ms: None,
            sync_generation: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_through_their_wire_names() {
        for &c in ErrorCode::ALL {
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.as_str()));
            assert_eq!(ErrorCode::parse(c.as_str()), Some(c));
        }
    }
}
