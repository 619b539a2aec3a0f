//! Prometheus metrics. Names carry their unit and stage (O1); labels carry
//! codes and results, never user ids or message content (O2). Conventions:
//! counters end in `_total`, units come last (`_seconds`, `_requests`),
//! histograms have buckets in their own unit, and every family has a HELP
//! line and exists from start-up (registered at zero), so a zero and a
//! missing family can be told apart. `tests/metrics.rs` lints the exposition.
//!
//! The recorder is process-global (the `metrics` facade is), installed once;
//! several servers in one test process share it.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tidemark_core::cursor::AckDecision;
use tidemark_proto::ErrorCode;
use tidemark_store::metric_names as store;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Bucket bounds of every histogram measured in seconds.
const SECONDS_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Installs the recorder if none is installed yet and returns its handle.
/// Every family is described (HELP) and registered here, at start.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(SECONDS_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(store::COMMIT_BATCH_REQUESTS.name.to_owned()),
                        store::COMMIT_BATCH_BUCKETS,
                    )
                })
                .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_events".to_owned()), EVENTS_BUCKETS))
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(store::SDK_REPAIRS_PENDING.name.to_owned()),
                        store::SDK_REPAIRS_PENDING_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(store::SDK_GAP_REPAIR_SECONDS.name.to_owned()),
                        store::SDK_GAP_REPAIR_BUCKETS,
                    )
                })
                .expect("static buckets are valid")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed by an embedding
            // program; metrics then go there and this handle renders empty.
            let _ = metrics::set_global_recorder(recorder);
            register_all();
            handle
        })
        .clone()
}

/// The kind of a family, and the label values it is registered with.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Counter,
    /// A counter with one label besides `stage`; registered at zero for
    /// every value the function lists.
    CounterBy(&'static str, fn() -> Vec<&'static str>),
    Gauge,
    GaugeBy(&'static str, fn() -> Vec<&'static str>),
    Histogram,
    HistogramBy(&'static str, fn() -> Vec<&'static str>),
}

/// One metric family: its name and stage, kind and HELP text.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub metric: Metric,
    pub kind: Kind,
    pub help: &'static str,
}

impl Family {
    pub fn name(&self) -> &'static str {
        self.metric.name
    }
}

const fn family(metric: Metric, kind: Kind, help: &'static str) -> Family {
    Family { metric, kind, help }
}

pub use store::{stage, Metric};

// ---------------------------------------------------------------- accept
pub const SENDS_ACCEPTED: Metric = Metric::new("tidemark_sends_accepted_total", stage::ACCEPT);
/// Idempotency hits: a send answered with its earlier message.
pub const SENDS_DUPLICATE: Metric = Metric::new("tidemark_sends_duplicate_total", stage::ACCEPT);
/// Sends refused, by code (a failed transaction is `INTERNAL` or `UNAVAILABLE`).
pub const SENDS_REFUSED: Metric = Metric::new("tidemark_sends_refused_total", stage::ACCEPT);
/// From a send reaching the server to its answer (the store's commit of
/// message and outbox record included), whatever the outcome.
pub const ACCEPT_LATENCY: Metric = Metric::new("tidemark_accept_latency_seconds", stage::ACCEPT);
// ---------------------------------------------------------------- outbox
pub const OUTBOX_BACKLOG: Metric = Metric::new("tidemark_outbox_backlog", stage::OUTBOX);
pub const OUTBOX_OLDEST_AGE: Metric = Metric::new("tidemark_outbox_oldest_age_seconds", stage::OUTBOX);
// ---------------------------------------------------------------- fan-out
/// From acceptance to the user events committed, by conversation kind.
pub const FANOUT_LAG: Metric = Metric::new("tidemark_fanout_lag_seconds", stage::FANOUT);
/// Recipients per fanned-out item, by conversation kind.
pub const FANOUT_AMPLIFICATION: Metric = Metric::new("tidemark_fanout_amplification_events", stage::FANOUT);
pub const FANOUT_EVENTS: Metric = Metric::new("tidemark_fanout_events_total", stage::FANOUT);
pub const FANOUT_DUPLICATES: Metric = Metric::new("tidemark_fanout_duplicates_total", stage::FANOUT);
/// Multi-hits: one user hit by two membership periods of one event.
pub const FANOUT_QUARANTINED: Metric = Metric::new("tidemark_fanout_quarantined_total", stage::FANOUT);
/// Items no membership period covers (`core::large::period_miss`).
pub const FANOUT_PERIOD_MISSES: Metric = Metric::new("tidemark_fanout_period_misses_total", stage::FANOUT);
// ---------------------------------------------------------------- sync log
pub const SYNC_LOG_HEAD_MAX: Metric = Metric::new("tidemark_sync_log_head_max", stage::SYNC_LOG);
pub const SYNC_LOG_RETAINED_MAX: Metric = Metric::new("tidemark_sync_log_retained_events_max", stage::SYNC_LOG);
pub const SYNC_LOG_CURSOR_LAG_MAX: Metric = Metric::new("tidemark_sync_log_cursor_lag_events_max", stage::SYNC_LOG);
pub const SYNC_LOG_BELOW_TRIM: Metric = Metric::new("tidemark_sync_log_devices_below_trim", stage::SYNC_LOG);
/// One `Store::sync_page` read (cursor, bounds, session, events).
pub const SYNC_PAGE_LATENCY: Metric = Metric::new("tidemark_sync_page_latency_seconds", stage::SYNC_LOG);
// ---------------------------------------------------------------- device sync
pub const SYNC_PAGES: Metric = Metric::new("tidemark_sync_pages_total", stage::DEVICE_SYNC);
/// Events per page served (the batch size of seed §18.1).
pub const SYNC_PAGE_EVENTS: Metric = Metric::new("tidemark_sync_page_events", stage::DEVICE_SYNC);
pub const ACKS: Metric = Metric::new("tidemark_acks_total", stage::DEVICE_SYNC);
pub const GENERATION_BUMPS: Metric = Metric::new("tidemark_generation_bumps_total", stage::DEVICE_SYNC);
/// A page or an ACK under a generation that is no longer the device's.
pub const GENERATION_CONFLICTS: Metric = Metric::new("tidemark_generation_conflicts_total", stage::DEVICE_SYNC);
/// Online devices (connected to this node): the largest lag behind the
/// user's watermark, in events and in seconds, and how many lag at all.
pub const ONLINE_LAG_EVENTS_MAX: Metric = Metric::new("tidemark_online_device_lag_events_max", stage::DEVICE_SYNC);
pub const ONLINE_LAG_SECONDS_MAX: Metric = Metric::new("tidemark_online_device_lag_seconds_max", stage::DEVICE_SYNC);
pub const ONLINE_LAGGING: Metric = Metric::new("tidemark_online_devices_lagging", stage::DEVICE_SYNC);
/// Live recovery sessions by kind (`replay`: D6; `snapshot`: D7 rebuilds
/// building or ready) and the age of the oldest.
pub const RECOVERY_SESSIONS: Metric = Metric::new("tidemark_recovery_sessions", stage::DEVICE_SYNC);
pub const RECOVERY_OLDEST_AGE: Metric = Metric::new("tidemark_recovery_session_oldest_age_seconds", stage::DEVICE_SYNC);
pub const SNAPSHOTS: Metric = Metric::new("tidemark_snapshots_total", stage::DEVICE_SYNC);
// ---------------------------------------------------------------- push (hints)
pub const HINTS: Metric = Metric::new("tidemark_hints_sent_total", stage::PUSH);
/// Hints merged into one already waiting on the connection (D8).
pub const HINTS_COALESCED: Metric = Metric::new("tidemark_hints_coalesced_total", stage::PUSH);
pub const HINTS_REHINTED: Metric = Metric::new("tidemark_hints_rehinted_total", stage::PUSH);
pub const HINTS_BUS_PUBLISHED: Metric = Metric::new("tidemark_hints_bus_published_total", stage::PUSH);
pub const HINTS_BUS_RECEIVED: Metric = Metric::new("tidemark_hints_bus_received_total", stage::PUSH);
pub const HINTS_BUS_DROPPED: Metric = Metric::new("tidemark_hints_bus_dropped_total", stage::PUSH);
/// Sends forwarded to their conversation's owner node and answered by it
/// (issue 14, `route`).
pub const ROUTE_FORWARDED: Metric = Metric::new("tidemark_route_forwarded_total", stage::ACCEPT);
/// Sends this node wrote itself although another node owns the
/// conversation, by reason (`route::fallback`).
pub const ROUTE_FALLBACKS: Metric = Metric::new("tidemark_route_forward_fallbacks_total", stage::ACCEPT);
/// Forwarded sends this node wrote for other nodes.
pub const ROUTE_SERVED: Metric = Metric::new("tidemark_route_served_total", stage::ACCEPT);
/// Live nodes this node routes among, itself included.
pub const ROUTE_NODES: Metric = Metric::new("tidemark_route_nodes", stage::ACCEPT);
pub const HINTS_GROUP: Metric = Metric::new("tidemark_hints_group_queued_total", stage::PUSH);
pub const MARKERS_PUBLISHED: Metric = Metric::new("tidemark_group_markers_published_total", stage::PUSH);
pub const MARKER_CLEARS: Metric = Metric::new("tidemark_group_marker_clears_total", stage::PUSH);
// ---------------------------------------------------------------- invariants
/// Broken or attempted-broken invariants the server caught, by invariant
/// ([`INVARIANTS`]). A broken invariant that stops the process is logged
/// (`stage=invariant`) by the panic hook instead: no scrape would see it.
pub const INVARIANT_VIOLATIONS: Metric = Metric::new("tidemark_invariant_violations_total", stage::INVARIANT);
/// Values of the `invariant` label of [`INVARIANT_VIOLATIONS`].
pub const INVARIANTS: &[&str] = &[
    // An ACK above the watermark its batch token was issued with (D4).
    "ack_beyond_watermark",
    // An ACK or page under an older generation (D4, D5).
    "stale_generation",
    // One user hit by two membership periods of one event (F4; quarantined).
    "period_overlap",
    // An event no membership period covers (F4).
    "period_miss",
];
// ---------------------------------------------------------------- gateway
pub const SLOW_CONSUMERS: Metric = Metric::new("tidemark_slow_consumer_disconnects_total", stage::GATEWAY);
/// WebSocket connections closed for sending on while told to wait.
pub const WAITS_IGNORED_CLOSED: Metric = Metric::new("tidemark_waits_ignored_disconnects_total", stage::GATEWAY);
pub const WS_CONNECTIONS: Metric = Metric::new("tidemark_ws_connections", stage::GATEWAY);
/// Times a WebSocket's reading was paused for its frame budget, by whose
/// budget ran out (`connection`, `address`).
pub const FRAME_BUDGET_PAUSES: Metric = Metric::new("tidemark_frame_budget_pauses_total", stage::GATEWAY);
/// HTTP requests (upgrades included) refused for their source address
/// before they were read, by reason (`penalty`: closed for ignoring waits;
/// `requests`: over the address's request budget; `connections`: on a
/// connection over the address's connection cap, answered and closed;
/// `connections_closed`: connections over the cap closed at the accept,
/// unread and unanswered).
pub const ADDRESS_REFUSALS: Metric = Metric::new("tidemark_address_refusals_total", stage::GATEWAY);
/// This node's load level (0 normal, 1 behind, 2 overloaded), from the
/// fan-out lag of the relay's last claim (seed §9.4).
pub const LOAD_LEVEL: Metric = Metric::new("tidemark_load_level", stage::FANOUT);
/// Rounds of work the degradation order held back, by kind of work.
pub const DEGRADED: Metric = Metric::new("tidemark_degraded_total", stage::FANOUT);
/// Changes of the load level, by the level entered.
pub const LOAD_CHANGES: Metric = Metric::new("tidemark_load_level_changes_total", stage::FANOUT);
/// Values of the `level` label of [`LOAD_CHANGES`].
pub const LOAD_LEVELS: &[&str] = &["normal", "behind", "overloaded"];
/// Values of the `work` label of [`DEGRADED`].
pub const DEGRADED_WORK: &[&str] = &["push", "derived", "ephemeral"];
/// Password checks waiting for a hash, by lane (clean, suspect: from an
/// address that keeps failing), sampled at scrape.
pub const PASSWORD_CHECKS_WAITING: Metric = Metric::new("tidemark_password_checks_waiting", stage::GATEWAY);
/// Values of the `lane` label of [`PASSWORD_CHECKS_WAITING`].
pub const HASH_LANES: &[&str] = &["clean", "suspect"];
pub const REFUSALS: Metric = Metric::new("tidemark_refusals_total", stage::GATEWAY);
// ---------------------------------------------------------------- storage
pub const TRIMMED_EVENTS: Metric = Metric::new("tidemark_retention_trimmed_events_total", stage::STORAGE);
/// Write requests carried by the store's committed transactions, read from
/// the store's own counters at scrape time.
pub const STORE_WRITE_REQUESTS: Metric = Metric::new("tidemark_store_write_requests_total", stage::STORAGE);
/// SQL statements the store's connections ran (reads and writes).
pub const STORE_STATEMENTS: Metric = Metric::new("tidemark_store_statements_total", stage::STORAGE);
/// Of those, statements on read connections (SQLite only).
pub const STORE_READ_STATEMENTS: Metric = Metric::new("tidemark_store_read_statements_total", stage::STORAGE);
// ---------------------------------------------------------------- ephemeral lane
/// Ephemeral frames (typing, presence) written to connections, by kind.
pub const EPHEMERAL_SENT: Metric = Metric::new("tidemark_ephemeral_frames_sent_total", stage::EPHEMERAL);
/// Presence entries written inside `presence.batch` frames (each one
/// `presence` frame a connection that did not opt in would have got).
pub const EPHEMERAL_PRESENCE_BATCHED: Metric =
    Metric::new("tidemark_ephemeral_presence_batched_total", stage::EPHEMERAL);
/// Ephemeral frames dropped before reaching a connection, by reason.
pub const EPHEMERAL_DROPPED: Metric = Metric::new("tidemark_ephemeral_dropped_total", stage::EPHEMERAL);
/// Ephemeral signals published to and received from the other nodes.
pub const EPHEMERAL_BUS_PUBLISHED: Metric = Metric::new("tidemark_ephemeral_bus_published_total", stage::EPHEMERAL);
pub const EPHEMERAL_BUS_RECEIVED: Metric = Metric::new("tidemark_ephemeral_bus_received_total", stage::EPHEMERAL);
/// Another node's announcements of a local user whose privacy re-read was
/// already running: folded into one more read after it, not a read each.
pub const PRESENCE_REREADS_COALESCED: Metric =
    Metric::new("tidemark_presence_rereads_coalesced_total", stage::EPHEMERAL);
/// Failed reads of a user's presence facts (privacy, audience) by what
/// followed: read again after a wait, or given up (the announcement not
/// made; a privacy re-read after another node's announcement keeps the
/// switch last known).
pub const PRESENCE_READS_FAILED: Metric = Metric::new("tidemark_presence_reads_failed_total", stage::EPHEMERAL);
/// Values of the `outcome` label of [`PRESENCE_READS_FAILED`].
pub const PRESENCE_READ_OUTCOMES: &[&str] = &["retried", "gave_up"];
/// Values of the `kind` label of [`EPHEMERAL_SENT`].
pub const EPHEMERAL_KINDS: &[&str] = &["typing", "presence", tidemark_proto::server_frame::PRESENCE_BATCH];
/// Values of the `reason` label of [`EPHEMERAL_DROPPED`].
pub const EPHEMERAL_DROP_REASONS: &[&str] = &["slots_full", "expired", "bus_queue_full", "typing_held_full"];

/// Values of the `kind` label of [`RECOVERY_SESSIONS`] and [`RECOVERY_OLDEST_AGE`].
pub const RECOVERY_KINDS: &[&str] = &["replay", "snapshot"];

/// Bucket bounds of the histograms counted in events (amplification, page size).
pub const EVENTS_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0];

/// Offline push (P4). "Accepted" is the provider's word: it took the
/// notification; nothing here says a device received it.
pub const PUSH_OWED: Metric = Metric::new("tidemark_push_notifications_owed_total", stage::PUSH);
pub const PUSH_ATTEMPTS: Metric = Metric::new("tidemark_push_attempts_total", stage::PUSH);
pub const PUSH_RESULTS: Metric = Metric::new("tidemark_push_results_total", stage::PUSH);
pub const PUSH_COALESCED: Metric = Metric::new("tidemark_push_coalesced_events_total", stage::PUSH);
pub const PUSH_EXPIRED: Metric = Metric::new("tidemark_push_expired_events_total", stage::PUSH);
pub const PUSH_GIVEN_UP: Metric = Metric::new("tidemark_push_given_up_total", stage::PUSH);
pub const PUSH_TARGETS_REMOVED: Metric = Metric::new("tidemark_push_targets_removed_total", stage::PUSH);
pub const PUSH_LATENCY: Metric = Metric::new("tidemark_push_accept_latency_seconds", stage::PUSH);
pub const PUSH_TARGETS_OWING: Metric = Metric::new("tidemark_push_targets_owing", stage::PUSH);
/// Values of the `result` label of [`PUSH_RESULTS`] (`tidemark_push::Outcome::label`).
pub const PUSH_RESULT_LABELS: &[&str] = &["accepted", "token_rejected", "throttled", "failed_retryable", "failed"];

/// Values of the `result` label of [`ACKS`]: every [`AckDecision`] (see
/// [`ack_result`]) and the refusal of an ACK above its batch's watermark.
pub const ACK_RESULTS: &[&str] = &[
    "advanced",
    "unchanged",
    "stale_generation",
    "resetting",
    "revoked",
    "recovery_completed",
    "recovery_expired",
    "beyond_watermark",
];

/// Values of the `outcome` label of [`SNAPSHOTS`].
pub const SNAPSHOT_OUTCOMES: &[&str] = &["built", "installed"];

/// Values of the `op` label of [`GENERATION_CONFLICTS`].
pub const GENERATION_CONFLICT_OPS: &[&str] = &["page", "ack"];

/// The `result` label of an ACK the store decided.
pub fn ack_result(decision: &AckDecision) -> &'static str {
    match decision {
        AckDecision::Advance { .. } => "advanced",
        AckDecision::Unchanged { .. } => "unchanged",
        AckDecision::StaleGeneration { .. } => "stale_generation",
        AckDecision::Resetting { .. } => "resetting",
        AckDecision::Revoked => "revoked",
        AckDecision::CompleteRecovery { .. } => "recovery_completed",
        AckDecision::RecoveryExpired { .. } => "recovery_expired",
    }
}

/// Counts a caught invariant violation (one of [`INVARIANTS`]).
pub fn invariant_violation(invariant: &'static str) {
    debug_assert!(INVARIANTS.contains(&invariant), "{invariant} is not declared");
    INVARIANT_VIOLATIONS.add_by("invariant", invariant, 1);
}

fn codes() -> Vec<&'static str> {
    ErrorCode::ALL.iter().map(|c| c.as_str()).collect()
}

fn conv_kinds() -> Vec<&'static str> {
    tidemark_core::large::FANOUT_CLASSES.to_vec()
}

/// Every family, in exposition order. Labelled families list their labels'
/// values so that each series exists from start-up.
pub const FAMILIES: &[Family] = &[
    family(SENDS_ACCEPTED, Kind::Counter, "Messages accepted (new, committed with their outbox record)."),
    family(SENDS_DUPLICATE, Kind::Counter, "Sends answered with an earlier message (same sender and client_msg_id)."),
    family(
        SENDS_REFUSED,
        Kind::CounterBy("code", codes),
        "Sends refused, by error code (INTERNAL, UNAVAILABLE: the transaction failed).",
    ),
    family(
        ACCEPT_LATENCY,
        Kind::Histogram,
        "From a send reaching the server to its answer, store commit included, in seconds.",
    ),
    family(OUTBOX_BACKLOG, Kind::Gauge, "Outbox records not yet fanned out."),
    family(OUTBOX_OLDEST_AGE, Kind::Gauge, "Age of the oldest outbox record, in seconds."),
    family(
        FANOUT_LAG,
        Kind::HistogramBy("conv_kind", conv_kinds),
        "Time from acceptance to the user events being committed, in seconds, by conversation kind.",
    ),
    family(
        FANOUT_AMPLIFICATION,
        Kind::HistogramBy("conv_kind", conv_kinds),
        "Recipients of each fanned-out event (user events it costs), by conversation kind.",
    ),
    family(FANOUT_EVENTS, Kind::Counter, "User events written by fan-out."),
    family(FANOUT_DUPLICATES, Kind::Counter, "Fan-out deliveries skipped because the user already had the event."),
    family(
        FANOUT_QUARANTINED,
        Kind::Counter,
        "Fan-out multi-hits quarantined: two membership periods of one user (integrity error).",
    ),
    family(FANOUT_PERIOD_MISSES, Kind::Counter, "Fan-out items no membership period covers (integrity error)."),
    family(
        store::FANOUT_FUSED_ITEMS,
        Kind::Counter,
        "Outbox items fanned out in the commit of the writes that appended them (SQLite's fused fan-out).",
    ),
    family(
        store::FANOUT_FUSED_FAILURES,
        Kind::Counter,
        "Fused fan-outs that failed and rolled back alone (their writes committed; the relay fans the items out).",
    ),
    family(
        SYNC_LOG_HEAD_MAX,
        Kind::Gauge,
        "The highest committed user high watermark (a sync_seq), sampled at scrape.",
    ),
    family(SYNC_LOG_RETAINED_MAX, Kind::Gauge, "The longest retained user log (head minus trim point), in events."),
    family(
        SYNC_LOG_CURSOR_LAG_MAX,
        Kind::Gauge,
        "The device cursor furthest behind its user's head (devices not revoked), in events.",
    ),
    family(
        SYNC_LOG_BELOW_TRIM,
        Kind::Gauge,
        "Devices whose ACK is below their user's trim point (their next sync resets).",
    ),
    family(SYNC_PAGE_LATENCY, Kind::Histogram, "One sync page read from the store (one snapshot), in seconds."),
    family(SYNC_PAGES, Kind::Counter, "Sync pages served."),
    family(SYNC_PAGE_EVENTS, Kind::Histogram, "Events per sync page served."),
    family(ACKS, Kind::CounterBy("result", || ACK_RESULTS.to_vec()), "Sync ACKs, by result."),
    family(GENERATION_BUMPS, Kind::Counter, "Device generations bumped (resets and recovery sessions)."),
    family(
        GENERATION_CONFLICTS,
        Kind::CounterBy("op", || GENERATION_CONFLICT_OPS.to_vec()),
        "Pages and ACKs refused STALE_GENERATION (an older generation than the device's), by operation.",
    ),
    family(
        ONLINE_LAG_EVENTS_MAX,
        Kind::Gauge,
        "Connected devices: the largest ACK lag behind the user's watermark, in events.",
    ),
    family(
        ONLINE_LAG_SECONDS_MAX,
        Kind::Gauge,
        "Connected devices: the longest time an ACK has stayed behind the user's watermark, in seconds.",
    ),
    family(ONLINE_LAGGING, Kind::Gauge, "Connected devices whose ACK is behind their user's watermark."),
    family(
        RECOVERY_SESSIONS,
        Kind::GaugeBy("kind", || RECOVERY_KINDS.to_vec()),
        "Live recovery sessions: replay (D6) and snapshot rebuilds (D7), sampled at scrape.",
    ),
    family(
        RECOVERY_OLDEST_AGE,
        Kind::GaugeBy("kind", || RECOVERY_KINDS.to_vec()),
        "Age of the oldest live recovery session, by kind, in seconds (0: none).",
    ),
    family(
        SNAPSHOTS,
        Kind::CounterBy("outcome", || SNAPSHOT_OUTCOMES.to_vec()),
        "Snapshots, by outcome (built, installed).",
    ),
    family(HINTS, Kind::Counter, "Hint frames sent to connected devices."),
    family(HINTS_COALESCED, Kind::Counter, "Hints merged into a hint already waiting on its connection (coalesced)."),
    family(HINTS_REHINTED, Kind::Counter, "Hints repeated to connected devices whose ACK lags (re-hint sweep)."),
    family(HINTS_BUS_PUBLISHED, Kind::Counter, "Hints published to the other nodes (NATS hint bus)."),
    family(HINTS_BUS_RECEIVED, Kind::Counter, "Hints received from the other nodes (NATS hint bus)."),
    family(HINTS_BUS_DROPPED, Kind::Counter, "Hints not published: queue full or NATS error (only latency is lost)."),
    family(ROUTE_FORWARDED, Kind::Counter, "Sends forwarded to their conversation's owner node and answered by it."),
    family(
        ROUTE_FALLBACKS,
        Kind::CounterBy("reason", || crate::route::fallback::ALL.to_vec()),
        "Sends written here although another node owns the conversation (owner silent, gone or busy), by reason.",
    ),
    family(ROUTE_SERVED, Kind::Counter, "Forwarded sends this node wrote for other nodes."),
    family(ROUTE_NODES, Kind::Gauge, "Live nodes this node routes sends among, itself included (0 without the bus)."),
    family(HINTS_GROUP, Kind::Counter, "Large-group hints queued on connections (coalesced per connection and group)."),
    family(MARKERS_PUBLISHED, Kind::Counter, "Large-group marker publications (one per group per relay batch)."),
    family(
        MARKER_CLEARS,
        Kind::CounterBy("outcome", || vec!["cleared", "stale"]),
        "dirty.clear calls, by outcome (cleared, stale: the marker stays dirty).",
    ),
    family(
        INVARIANT_VIOLATIONS,
        Kind::CounterBy("invariant", || INVARIANTS.to_vec()),
        "Invariant violations caught (refused or quarantined), by invariant.",
    ),
    family(SLOW_CONSUMERS, Kind::Counter, "WebSocket connections closed because their send queue filled."),
    family(
        WAITS_IGNORED_CLOSED,
        Kind::Counter,
        "WebSocket connections closed for sending on while told to wait (RATE_LIMITED).",
    ),
    family(WS_CONNECTIONS, Kind::Gauge, "Open authenticated WebSocket connections."),
    family(
        FRAME_BUDGET_PAUSES,
        Kind::CounterBy("scope", || crate::limits::FRAME_SCOPES.to_vec()),
        "WebSocket reads paused for a frame budget, by whose budget ran out (connection, address).",
    ),
    family(
        ADDRESS_REFUSALS,
        Kind::CounterBy("reason", || crate::limits::ADDRESS_REFUSAL_REASONS.to_vec()),
        "HTTP requests and connections refused for their address before being read (penalty: closed for ignoring waits; requests: over budget; connections: over the connection cap, answered; connections_closed: over it, closed at the accept).",
    ),
    family(LOAD_LEVEL, Kind::Gauge, "Load level from the fan-out lag: 0 normal, 1 behind, 2 overloaded (seed 9.4)."),
    family(
        LOAD_CHANGES,
        Kind::CounterBy("level", || LOAD_LEVELS.to_vec()),
        "Changes of the load level, by the level entered (normal, behind, overloaded).",
    ),
    family(
        DEGRADED,
        Kind::CounterBy("work", || DEGRADED_WORK.to_vec()),
        "Rounds of work held back by the degradation order, by work (push, derived, ephemeral).",
    ),
    family(
        PASSWORD_CHECKS_WAITING,
        Kind::GaugeBy("lane", || HASH_LANES.to_vec()),
        "Password checks waiting for a hash, by lane (suspect: from an address that keeps failing).",
    ),
    family(REFUSALS, Kind::CounterBy("code", codes), "Requests refused, by error code."),
    family(TRIMMED_EVENTS, Kind::Counter, "User-log events removed by retention."),
    family(
        EPHEMERAL_SENT,
        Kind::CounterBy("kind", || EPHEMERAL_KINDS.to_vec()),
        "Ephemeral frames (typing, presence, presence.batch) written to connections, by kind.",
    ),
    family(
        EPHEMERAL_PRESENCE_BATCHED,
        Kind::Counter,
        "Presence entries written inside presence.batch frames (to connections that opted in).",
    ),
    family(
        EPHEMERAL_DROPPED,
        Kind::CounterBy("reason", || EPHEMERAL_DROP_REASONS.to_vec()),
        "Ephemeral frames dropped (shed) before reaching a connection, by reason.",
    ),
    family(
        PRESENCE_READS_FAILED,
        Kind::CounterBy("outcome", || PRESENCE_READ_OUTCOMES.to_vec()),
        "Failed reads of a user's presence facts, by what followed: read again after a wait (retried) or given up (gave_up: the announcement not made, or a privacy re-read's switch kept as last known).",
    ),
    family(EPHEMERAL_BUS_PUBLISHED, Kind::Counter, "Ephemeral signals published to the other nodes (NATS)."),
    family(EPHEMERAL_BUS_RECEIVED, Kind::Counter, "Ephemeral signals received from the other nodes (NATS)."),
    family(
        PRESENCE_REREADS_COALESCED,
        Kind::Counter,
        "Other nodes' announcements of a local user that found the user's privacy re-read running and were folded into one more read after it.",
    ),
    family(
        store::SDK_GAPS_DETECTED,
        Kind::Counter,
        "Gaps devices detected (conversations queued for repair, K5, and holes opened in a conversation's msg_seq), as reported by the SDK (client.stats).",
    ),
    family(
        store::SDK_GAPS_REPAIRED,
        Kind::Counter,
        "Gaps devices repaired (repairs completed, holes closed), as reported by the SDK (client.stats).",
    ),
    family(
        store::SDK_REPAIRS_PENDING,
        Kind::Histogram,
        "Repairs waiting on a device at each of its client.stats reports, in conversations.",
    ),
    family(
        store::SDK_GAP_REPAIR_SECONDS,
        Kind::HistogramBy("kind", || store::SDK_GAP_KINDS.to_vec()),
        "Time from a gap's detection to its repair on a device, by kind (repair queue or cursor hole), as reported by the SDK (client.stats), in seconds.",
    ),
    family(store::COMMITS, Kind::Counter, "Store write transactions committed."),
    family(
        store::COMMIT_BATCH_REQUESTS,
        Kind::Histogram,
        "Write requests per committed store transaction (group commit), in requests.",
    ),
    family(STORE_WRITE_REQUESTS, Kind::Counter, "Write requests carried by committed store transactions."),
    family(STORE_STATEMENTS, Kind::Counter, "SQL statements the store's connections ran (reads and writes)."),
    family(STORE_READ_STATEMENTS, Kind::Counter, "Of those, statements on read connections (SQLite only)."),
    family(store::CHECKPOINTS, Kind::Counter, "SQLite WAL checkpoints (two fsyncs each)."),
    family(
        store::WAL_TRUNCATIONS,
        Kind::CounterBy("done", || store::WAL_TRUNCATION_RESULTS.to_vec()),
        "Truncating SQLite WAL checkpoints, by whether readers let them finish.",
    ),
    family(
        store::CONFLICT_RETRIES,
        Kind::CounterBy("writer", || store::WRITERS.to_vec()),
        "PostgreSQL write requests re-run after a lock conflict, by writer (user: user-head conflicts).",
    ),
    family(
        store::CONFLICT_GIVE_UPS,
        Kind::CounterBy("writer", || store::WRITERS.to_vec()),
        "PostgreSQL write requests given up after repeated conflicts, by writer.",
    ),
    family(PUSH_OWED, Kind::Counter, "Offline push notifications due (one per coalesced range of a device)."),
    family(PUSH_ATTEMPTS, Kind::Counter, "Requests made to push providers."),
    family(
        PUSH_RESULTS,
        Kind::CounterBy("result", || PUSH_RESULT_LABELS.to_vec()),
        "Push provider answers, by result (accepted means the provider took it, not that a device has it).",
    ),
    family(PUSH_COALESCED, Kind::Counter, "Events folded into a push notification beside its first."),
    family(PUSH_EXPIRED, Kind::Counter, "Events not pushed because they were older than the push expiry."),
    family(PUSH_GIVEN_UP, Kind::Counter, "Push notifications given up (refused, retries exhausted, or unsendable)."),
    family(PUSH_TARGETS_REMOVED, Kind::Counter, "Push targets removed because their provider rejected the token."),
    family(
        PUSH_TARGETS_OWING,
        Kind::Gauge,
        "Push targets whose device's log holds events above its push position and ACK (devices, not notifications).",
    ),
    family(
        PUSH_LATENCY,
        Kind::Histogram,
        "Time from the fan-out commit of a push's first event to the provider's accept, in seconds.",
    ),
];

/// Refreshes the gauges sampled at scrape time: the store's aggregates
/// (one read statement) and the online devices' lag from this node's hub
/// (memory only). Nothing here runs per request.
/// A store that did not answer leaves its gauges at their last values.
pub fn sample(store: Option<&tidemark_store::StoreGauges>, lag: &crate::hub::LagSample, now_ms: i64) {
    ONLINE_LAG_EVENTS_MAX.set(lag.events_max as f64);
    ONLINE_LAG_SECONDS_MAX.set(lag.behind_ms_max as f64 / 1000.0);
    ONLINE_LAGGING.set(lag.lagging as f64);
    let Some(g) = store else { return };
    let age = |created: Option<i64>| created.map(|c| (now_ms - c).max(0) as f64 / 1000.0).unwrap_or(0.0);
    OUTBOX_BACKLOG.set(g.outbox.backlog as f64);
    OUTBOX_OLDEST_AGE.set(age(g.outbox.oldest_created_at_ms));
    SYNC_LOG_HEAD_MAX.set(g.user_high_watermark_max as f64);
    SYNC_LOG_RETAINED_MAX.set(g.retained_events_max as f64);
    SYNC_LOG_CURSOR_LAG_MAX.set(g.cursor_lag_events_max as f64);
    SYNC_LOG_BELOW_TRIM.set(g.devices_below_trim as f64);
    RECOVERY_SESSIONS.set_by("kind", "replay", g.recovery_sessions as f64);
    RECOVERY_SESSIONS.set_by("kind", "snapshot", g.snapshot_sessions as f64);
    RECOVERY_OLDEST_AGE.set_by("kind", "replay", age(g.recovery_oldest_created_at_ms));
    RECOVERY_OLDEST_AGE.set_by("kind", "snapshot", age(g.snapshot_oldest_created_at_ms));
    PUSH_TARGETS_OWING.set(g.push_targets_owing as f64);
}

/// Refreshes the gauges of this node's limiter (memory only).
pub fn sample_limits(limits: &crate::limits::Limits) {
    use tidemark_core::throttle::HashLane;
    PASSWORD_CHECKS_WAITING.set_by("lane", HASH_LANES[0], limits.hashes_waiting(HashLane::Clean) as f64);
    PASSWORD_CHECKS_WAITING.set_by("lane", HASH_LANES[1], limits.hashes_waiting(HashLane::Suspect) as f64);
}

fn register_all() {
    for f in FAMILIES {
        let (name, stage) = (f.metric.name, f.metric.stage);
        match f.kind {
            Kind::Counter => {
                metrics::describe_counter!(name, f.help);
                f.metric.add(0);
            }
            Kind::CounterBy(label, values) => {
                metrics::describe_counter!(name, f.help);
                for value in values() {
                    f.metric.add_by(label, value, 0);
                }
            }
            Kind::Gauge => {
                metrics::describe_gauge!(name, f.help);
                f.metric.shift(0.0);
            }
            Kind::GaugeBy(label, values) => {
                metrics::describe_gauge!(name, f.help);
                for value in values() {
                    metrics::gauge!(name, "stage" => stage, label => value).increment(0.0);
                }
            }
            Kind::Histogram => {
                metrics::describe_histogram!(name, f.help);
                // A handle registers the family; it renders with zero counts.
                let _ = metrics::histogram!(name, "stage" => stage);
            }
            Kind::HistogramBy(label, values) => {
                metrics::describe_histogram!(name, f.help);
                for value in values() {
                    let _ = metrics::histogram!(name, "stage" => stage, label => value);
                }
            }
        }
    }
}

pub fn refusal(code: ErrorCode) {
    REFUSALS.add_by("code", code.as_str(), 1);
}
