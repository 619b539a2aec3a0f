//! Server configuration: every bound and lifetime has a name here.

use std::time::Duration;

/// Default cap on one node's WebSocket connections: an idle connection
/// costs ~15 KiB (`tidemark bench connections`), so this many hold about
/// 1.5 GiB, and each holds a file descriptor.
pub const WS_CONNECTIONS_MAX_DEFAULT: usize = 100_000;
/// `retry_after_ms` of the refusal a full node answers an upgrade with.
pub const WS_FULL_RETRY_AFTER_MS: u64 = 1_000;
/// Default cap on one user's WebSocket connections on one node: far above
/// the devices a person uses at once, far below what a script opening
/// sockets in a loop would hold.
pub const WS_CONNECTIONS_PER_USER_MAX_DEFAULT: usize = 20;
/// `retry_after_ms` of the refusal a user at its cap gets: a slot frees
/// only when one of its connections ends.
pub const WS_USER_FULL_RETRY_AFTER_MS: u64 = 5_000;
/// How long audit log entries are kept.
/// Snapshot builds running at once on a node (`snapshot_builds_max`).
pub const SNAPSHOT_BUILDS_MAX_DEFAULT: usize = 2;
/// How often `tidemark serve` lets `/metrics` read the store's gauges: at
/// 100,000 users each read scans every user head and device, so a
/// deployment scrapes as often as it likes and pays one scan per period.
pub const GAUGES_EVERY_DEFAULT: Duration = Duration::from_secs(10);
pub const AUDIT_KEEP_DEFAULT: Duration = Duration::from_secs(90 * 24 * 3600);
/// Time a WebSocket has from its upgrade to authenticate (`auth` frame).
pub const WS_AUTH_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// HTTP timeouts, so a slow or silent client cannot hold a connection (and
/// its file descriptor) for long. Each ends the connection (after an error
/// reply when a request had begun); none applies to a WebSocket once upgraded (its own heartbeat
/// and auth timeout do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpTimeouts {
    /// A request's head (request line and headers) must be complete this
    /// long after the server starts waiting for it: from the accept, or on
    /// a keep-alive connection from the previous response. Past it the
    /// connection is closed without a response (hyper's
    /// `header_read_timeout`).
    pub header: Duration,
    /// Longest pause between two chunks of a request body; past it the
    /// body cannot be read, the request fails with 400 `BAD_REQUEST` and
    /// the connection is closed (`tower_http::timeout::RequestBodyTimeoutLayer`).
    pub body: Duration,
    /// Longest whole request, from its head to its response, body read
    /// included (a body trickled faster than [`HttpTimeouts::body`] still
    /// ends here): 408, connection closed (`tower_http::timeout::TimeoutLayer`).
    pub request: Duration,
    /// A connection with no request in progress that receives nothing for
    /// this long is closed: an idle keep-alive connection, or one that
    /// never sends a byte.
    pub idle: Duration,
}

pub const HTTP_HEADER_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
pub const HTTP_BODY_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
pub const HTTP_REQUEST_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
pub const HTTP_IDLE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);

impl Default for HttpTimeouts {
    fn default() -> Self {
        HttpTimeouts {
            header: HTTP_HEADER_TIMEOUT_DEFAULT,
            body: HTTP_BODY_TIMEOUT_DEFAULT,
            request: HTTP_REQUEST_TIMEOUT_DEFAULT,
            idle: HTTP_IDLE_TIMEOUT_DEFAULT,
        }
    }
}

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
    /// WebSocket connections one node holds at once; an upgrade past it is
    /// refused with `UNAVAILABLE` (HTTP 503, `retry_after_ms`
    /// [`WS_FULL_RETRY_AFTER_MS`]) so the device backs off and may reach
    /// another node.
    pub ws_connections_max: usize,
    /// WebSocket connections one user holds on one node; one more (of a
    /// device not yet connected) is refused with `RATE_LIMITED`
    /// (`retry_after_ms` [`WS_USER_FULL_RETRY_AFTER_MS`]).
    pub ws_connections_per_user_max: usize,
    /// Time a WebSocket opened without a bearer header has to send `auth`.
    pub ws_auth_timeout: Duration,
    /// HTTP header, body, request and idle timeouts.
    pub http_timeouts: HttpTimeouts,
    /// Audit log entries older than this are deleted.
    pub audit_keep: Duration,
    /// Rate limits per device, user and source address (P3).
    pub limits: crate::limits::LimitsConfig,
    /// Outbox items fanned out per transaction.
    pub relay_batch_max: u32,
    /// The relay also polls the outbox this often (wake-ups are hints).
    pub relay_poll: Duration,
    /// A connected device whose ACK lags its user's high watermark this
    /// long gets the hint again (D8).
    pub rehint_after: Duration,
    /// WebSocket ping period; a connection silent for three periods is closed.
    pub ws_ping: Duration,
    /// Recovery sessions (D6): the largest gap between a device's local
    /// position and its server ACK that is replayed rather than rebuilt by
    /// a snapshot, and how long a session lives (and fences retention).
    pub recovery_max_gap: u64,
    pub recovery_ttl: Duration,
    /// The longest first batch a device replays (`core::cursor`
    /// `RecoveryPolicy::max_replay`): a new, rebuilding or lagging device
    /// whose batch would hold more events is reset and installs a snapshot.
    pub replay_max_events: u64,
    /// Lifetime of a snapshot (and of its retention fence).
    pub snapshot_ttl: Duration,
    /// Latest messages per conversation a snapshot carries (older ones
    /// come from `history`).
    pub snapshot_messages_per_conv: u32,
    /// Items per snapshot page (each page is one writer request).
    pub snapshot_page_items: usize,
    /// `/metrics` reads the store's gauges (aggregates over every user head
    /// and device) at most this often, serving the last read in between;
    /// zero: at every scrape. `tidemark serve` defaults to
    /// [`GAUGES_EVERY_DEFAULT`]; the embedded default is zero so a test's
    /// scrape sees the traffic before it.
    pub gauges_every: Duration,
    /// Snapshot builds at once on this node; more wait for a slot. Each
    /// reads its view on one read connection for as long as it runs
    /// (SQLite has `READERS_MAX` = 4), so sync pages keep the others.
    pub snapshot_builds_max: usize,
    /// Conversations a snapshot build reads per chunk of its view.
    pub snapshot_convs_per_chunk: usize,
    /// User-log retention (L1–L2); `None` keeps every event.
    pub retention: Option<tidemark_store::RetentionPolicy>,
    /// How often the retention pass runs.
    pub retention_every: Duration,
    /// How often the reconciliation job (O3) runs with repairs on; `None`
    /// (the default): only on demand (`POST /v1/admin/reconcile`,
    /// `tidemark admin reconcile`), since a run reads every message and
    /// every user.
    pub reconcile_every: Option<Duration>,
    /// Test hook: accept sends but never fan out (the outbox keeps them).
    /// Used to prove that a crash before fan-out loses nothing.
    pub hold_fanout: bool,
    /// Test hook: never reload the fences from the store (no
    /// `fence::run_refresh`). With a bus that hears nothing, the node never
    /// learns that another node superseded a connection, so only the
    /// store's per-frame epoch fence (P2) stops that connection's frames.
    pub hold_fence_refresh: bool,
    /// How hints reach the other nodes: in-process only (one node), or NATS.
    pub hint_bus: HintBusConfig,
    /// When a group leaves per-member fan-out for the shared log (G3).
    pub group_policy: tidemark_core::large::GroupPolicy,
    /// Bounds of the ephemeral lane: typing and presence (issue 18).
    pub ephemeral: crate::ephemeral::EphemeralConfig,
    /// Offline push (P4): providers, the token key and the rules' knobs.
    pub push: crate::push::PushConfig,
    /// The fan-out lag at which the node counts as behind or overloaded,
    /// and so degrades in the order of seed §9.4 (`tidemark_core::degrade`).
    pub load_bounds: tidemark_core::degrade::LoadBounds,
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
            ws_connections_max: WS_CONNECTIONS_MAX_DEFAULT,
            ws_connections_per_user_max: WS_CONNECTIONS_PER_USER_MAX_DEFAULT,
            ws_auth_timeout: WS_AUTH_TIMEOUT_DEFAULT,
            http_timeouts: HttpTimeouts::default(),
            audit_keep: AUDIT_KEEP_DEFAULT,
            limits: crate::limits::LimitsConfig::default(),
            relay_batch_max: 512,
            relay_poll: Duration::from_secs(1),
            rehint_after: Duration::from_secs(5),
            ws_ping: Duration::from_secs(20),
            recovery_max_gap: 1000,
            recovery_ttl: Duration::from_secs(10 * 60),
            replay_max_events: tidemark_core::cursor::REPLAY_EVENTS_MAX,
            snapshot_ttl: Duration::from_secs(30 * 60),
            snapshot_messages_per_conv: 100,
            snapshot_page_items: 200,
            snapshot_convs_per_chunk: tidemark_store::SNAPSHOT_CONVS_PER_CHUNK,
            gauges_every: Duration::ZERO,
            snapshot_builds_max: SNAPSHOT_BUILDS_MAX_DEFAULT,
            retention: Some(tidemark_store::RetentionPolicy {
                keep_events_younger_than_ms: 7 * 24 * 3600 * 1000,
                device_inactive_after_ms: 30 * 24 * 3600 * 1000,
                history_keep_ms: None,
            }),
            retention_every: Duration::from_secs(60),
            reconcile_every: None,
            hold_fanout: false,
            hold_fence_refresh: false,
            hint_bus: HintBusConfig::Local,
            group_policy: tidemark_core::large::GroupPolicy::default(),
            ephemeral: crate::ephemeral::EphemeralConfig::default(),
            push: crate::push::PushConfig::default(),
            load_bounds: tidemark_core::degrade::LOAD_BOUNDS_DEFAULT,
        }
    }
}

/// Which bus a node uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum HintBusConfig {
    /// One node: hints stay in this process.
    #[default]
    Local,
    /// Several nodes: hints cross over NATS.
    Nats {
        /// e.g. `nats://127.0.0.1:4222`.
        url: String,
        /// Subject prefix shared by every node of one cluster (dot-separated
        /// tokens of ASCII letters, digits, `_` and `-`).
        subject_prefix: String,
    },
}
