//! Server configuration: every bound and lifetime has a name here.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Enables `POST /v1/admin/users` when set.
    pub admin_token: Option<String>,
    pub access_token_ttl: Duration,
    pub refresh_token_ttl: Duration,
    /// Lifetime of a sync batch token; an ACK after it must re-sync.
    pub batch_token_ttl: Duration,
    /// Largest WebSocket frame or HTTP body, in bytes.
    pub frame_bytes_max: usize,
    /// Frames queued for one WebSocket; a client that lets it fill is
    /// disconnected (it resyncs from its cursor, nothing is skipped).
    pub ws_send_queue_max: usize,
    /// Requests of one WebSocket being processed at once.
    pub ws_inflight_max: usize,
    /// Outbox items fanned out per transaction.
    pub relay_batch_max: u32,
    /// The relay also polls the outbox this often (wake-ups are hints).
    pub relay_poll: Duration,
    /// A connected device whose ACK lags its user's high watermark this
    /// long gets the hint again (D8).
    pub rehint_after: Duration,
    /// WebSocket ping period; a connection silent for three periods is closed.
    pub ws_ping: Duration,
    /// Test hook: accept sends but never fan out (the outbox keeps them).
    /// Used to prove that a crash before fan-out loses nothing.
    pub hold_fanout: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            admin_token: None,
            access_token_ttl: Duration::from_secs(15 * 60),
            refresh_token_ttl: Duration::from_secs(30 * 24 * 3600),
            batch_token_ttl: Duration::from_secs(10 * 60),
            frame_bytes_max: tidemark_proto::FRAME_BYTES_MAX,
            ws_send_queue_max: 256,
            ws_inflight_max: 64,
            relay_batch_max: 512,
            relay_poll: Duration::from_secs(1),
            rehint_after: Duration::from_secs(5),
            ws_ping: Duration::from_secs(20),
            hold_fanout: false,
        }
    }
}
