//! The typed error every operation returns, mapped to a wire code.

use tidemark_proto::{ErrorCode, ErrorFrame};
use tidemark_store::StoreError;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub retry_after_ms: Option<u64>,
    pub sync_generation: Option<u64>,
    /// The store refused a frame of an older connection of the device
    /// (`StoreError::Superseded`, P2): the device's newest connection
    /// epoch. Not on the wire; the WebSocket gateway ends the connection
    /// on it (`gateway::ws`).
    pub superseded_by: Option<u64>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), retry_after_ms: None, sync_generation: None, superseded_by: None }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::BadRequest, message)
    }

    /// `DEVICE_REVOKED` (P5): the same refusal wherever the device shows up.
    pub fn device_revoked() -> ApiError {
        ApiError::new(ErrorCode::DeviceRevoked, "this device was revoked")
    }

    /// `RESET_REQUIRED` with the generation to rebuild under (D5).
    pub fn reset_required(generation: u64) -> ApiError {
        ApiError::new(ErrorCode::ResetRequired, "the device must rebuild its local state").with_generation(generation)
    }

    /// `STALE_GENERATION` with the device's current generation (D4).
    pub fn stale_generation(current: u64) -> ApiError {
        ApiError::new(ErrorCode::StaleGeneration, "the token belongs to an older sync_generation")
            .with_generation(current)
    }

    pub fn with_generation(mut self, generation: u64) -> ApiError {
        self.sync_generation = Some(generation);
        self
    }

    pub fn into_frame(self, rid: Option<String>) -> ErrorFrame {
        crate::metrics::refusal(self.code);
        ErrorFrame {
            t: "error".into(),
            rid,
            code: self.code,
            message: self.message,
            retry_after_ms: self.retry_after_ms,
            sync_generation: self.sync_generation,
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        match e {
            StoreError::NotFound(what) => ApiError::new(ErrorCode::NotFound, what),
            StoreError::NotMember => ApiError::new(ErrorCode::NotMember, "not a member of this conversation"),
            StoreError::Invalid(m) => ApiError::bad_request(m),
            StoreError::Conflict(m) => ApiError::new(ErrorCode::Conflict, m),
            StoreError::Unavailable(m) => {
                tracing::warn!(error = %m, "store unavailable");
                ApiError {
                    retry_after_ms: Some(200),
                    ..ApiError::new(ErrorCode::Unavailable, "temporarily unavailable")
                }
            }
            StoreError::Forbidden(m) => ApiError::new(ErrorCode::Forbidden, m),
            // A frame of a connection the device has replaced (P2): nothing
            // changed; the connection is being closed `superseded`.
            StoreError::Superseded(newest) => ApiError {
                superseded_by: Some(newest),
                ..ApiError::new(
                    ErrorCode::Unavailable,
                    "this connection was superseded by a newer one of the device; nothing was done",
                )
            },
            StoreError::CursorAhead(head) => {
                ApiError::new(ErrorCode::CursorAhead, format!("after is beyond the conversation head {head}"))
            }
            StoreError::EpochChanged(epoch) => ApiError::new(
                ErrorCode::EpochChanged,
                format!("the conversation epoch is now {epoch}; resync it from 0"),
            ),
            StoreError::VersionConflict(v) => {
                ApiError::new(ErrorCode::Conflict, format!("base_version is stale; the message is at version {v}"))
            }
            too_new @ StoreError::SchemaTooNew { .. } => {
                // Refused at open, before any request; kept total here.
                let id = crate::util::new_id("err_");
                tracing::error!(error_id = %id, error = %too_new, "store schema too new");
                ApiError::new(ErrorCode::Internal, format!("internal error {id}"))
            }
            StoreError::Internal(m) => {
                let id = crate::util::new_id("err_");
                tracing::error!(error_id = %id, error = %m, "internal store error");
                ApiError::new(ErrorCode::Internal, format!("internal error {id}"))
            }
        }
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
