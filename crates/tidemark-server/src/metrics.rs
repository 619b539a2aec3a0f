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
                        Matcher::Full(store::COMMIT_BATCH_REQUESTS.to_owned()),
                        store::COMMIT_BATCH_BUCKETS,
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
    /// A counter with one label; registered at zero for every value the
    /// function lists.
    CounterBy(&'static str, fn() -> Vec<&'static str>),
    Gauge,
    Histogram,
}

/// One metric family: its name, kind and HELP text.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
}

const fn family(name: &'static str, kind: Kind, help: &'static str) -> Family {
    Family { name, kind, help }
}

pub const SENDS_ACCEPTED: &str = "tidemark_sends_accepted_total";
pub const SENDS_DUPLICATE: &str = "tidemark_sends_duplicate_total";
pub const OUTBOX_BACKLOG: &str = "tidemark_outbox_backlog";
pub const OUTBOX_OLDEST_AGE: &str = "tidemark_outbox_oldest_age_seconds";
pub const FANOUT_LAG: &str = "tidemark_fanout_lag_seconds";
pub const FANOUT_EVENTS: &str = "tidemark_fanout_events_total";
pub const FANOUT_DUPLICATES: &str = "tidemark_fanout_duplicates_total";
pub const FANOUT_QUARANTINED: &str = "tidemark_fanout_quarantined_total";
pub const SYNC_PAGES: &str = "tidemark_sync_pages_total";
pub const ACKS: &str = "tidemark_acks_total";
pub const REFUSALS: &str = "tidemark_refusals_total";
pub const GENERATION_BUMPS: &str = "tidemark_generation_bumps_total";
pub const HINTS: &str = "tidemark_hints_sent_total";
pub const HINTS_BUS_PUBLISHED: &str = "tidemark_hints_bus_published_total";
pub const HINTS_BUS_RECEIVED: &str = "tidemark_hints_bus_received_total";
pub const HINTS_BUS_DROPPED: &str = "tidemark_hints_bus_dropped_total";
pub const HINTS_GROUP: &str = "tidemark_hints_group_queued_total";
pub const MARKERS_PUBLISHED: &str = "tidemark_group_markers_published_total";
pub const MARKER_CLEARS: &str = "tidemark_group_marker_clears_total";
pub const SLOW_CONSUMERS: &str = "tidemark_slow_consumer_disconnects_total";
pub const TRIMMED_EVENTS: &str = "tidemark_retention_trimmed_events_total";
pub const SNAPSHOTS: &str = "tidemark_snapshots_total";
pub const WS_CONNECTIONS: &str = "tidemark_ws_connections";
/// Ephemeral frames (typing, presence) written to connections, by kind.
pub const EPHEMERAL_SENT: &str = "tidemark_ephemeral_frames_sent_total";
/// Ephemeral frames dropped before reaching a connection, by reason.
pub const EPHEMERAL_DROPPED: &str = "tidemark_ephemeral_dropped_total";
/// Ephemeral signals published to and received from the other nodes.
pub const EPHEMERAL_BUS_PUBLISHED: &str = "tidemark_ephemeral_bus_published_total";
pub const EPHEMERAL_BUS_RECEIVED: &str = "tidemark_ephemeral_bus_received_total";
/// Values of the `kind` label of [`EPHEMERAL_SENT`].
pub const EPHEMERAL_KINDS: &[&str] = &["typing", "presence"];
/// Values of the `reason` label of [`EPHEMERAL_DROPPED`].
pub const EPHEMERAL_DROP_REASONS: &[&str] = &["slots_full", "expired", "bus_queue_full", "typing_held_full"];
/// Offline push (P4). "Accepted" is the provider's word: it took the
/// notification; nothing here says a device received it.
pub const PUSH_OWED: &str = "tidemark_push_notifications_owed_total";
pub const PUSH_ATTEMPTS: &str = "tidemark_push_attempts_total";
pub const PUSH_RESULTS: &str = "tidemark_push_results_total";
pub const PUSH_COALESCED: &str = "tidemark_push_coalesced_events_total";
pub const PUSH_EXPIRED: &str = "tidemark_push_expired_events_total";
pub const PUSH_GIVEN_UP: &str = "tidemark_push_given_up_total";
pub const PUSH_TARGETS_REMOVED: &str = "tidemark_push_targets_removed_total";
pub const PUSH_LATENCY: &str = "tidemark_push_accept_latency_seconds";
/// Values of the `result` label of [`PUSH_RESULTS`] (`tidemark_push::Outcome::label`).
pub const PUSH_RESULT_LABELS: &[&str] = &["accepted", "token_rejected", "throttled", "failed_retryable", "failed"];
/// Write requests carried by the store's committed transactions, read from
/// the store's own counters at scrape time.
pub const STORE_WRITE_REQUESTS: &str = "tidemark_store_write_requests_total";
/// SQL statements the store's connections ran (reads and writes).
pub const STORE_STATEMENTS: &str = "tidemark_store_statements_total";
/// Of those, statements on read connections (SQLite only).
pub const STORE_READ_STATEMENTS: &str = "tidemark_store_read_statements_total";

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

/// Every family, in exposition order. Labelled families list their labels'
/// values so that each series exists from start-up.
pub const FAMILIES: &[Family] = &[
    family(SENDS_ACCEPTED, Kind::Counter, "Messages accepted (new, committed with their outbox record)."),
    family(SENDS_DUPLICATE, Kind::Counter, "Sends answered with an earlier message (same sender and client_msg_id)."),
    family(OUTBOX_BACKLOG, Kind::Gauge, "Outbox records not yet fanned out."),
    family(OUTBOX_OLDEST_AGE, Kind::Gauge, "Age of the oldest outbox record, in seconds."),
    family(FANOUT_LAG, Kind::Histogram, "Time from acceptance to the user events being committed, in seconds."),
    family(FANOUT_EVENTS, Kind::Counter, "User events written by fan-out."),
    family(FANOUT_DUPLICATES, Kind::Counter, "Fan-out deliveries skipped because the user already had the event."),
    family(
        FANOUT_QUARANTINED,
        Kind::Counter,
        "Fan-out items quarantined: two membership periods of one user (integrity error).",
    ),
    family(SYNC_PAGES, Kind::Counter, "Sync pages served."),
    family(ACKS, Kind::CounterBy("result", || ACK_RESULTS.to_vec()), "Sync ACKs, by result."),
    family(
        REFUSALS,
        Kind::CounterBy("code", || ErrorCode::ALL.iter().map(|c| c.as_str()).collect()),
        "Requests refused, by error code.",
    ),
    family(GENERATION_BUMPS, Kind::Counter, "Device generations bumped (resets and recovery sessions)."),
    family(HINTS, Kind::Counter, "Hint frames sent to connected devices."),
    family(HINTS_BUS_PUBLISHED, Kind::Counter, "Hints published to the other nodes (NATS hint bus)."),
    family(HINTS_BUS_RECEIVED, Kind::Counter, "Hints received from the other nodes (NATS hint bus)."),
    family(HINTS_BUS_DROPPED, Kind::Counter, "Hints not published: queue full or NATS error (only latency is lost)."),
    family(HINTS_GROUP, Kind::Counter, "Large-group hints queued on connections (coalesced per connection and group)."),
    family(MARKERS_PUBLISHED, Kind::Counter, "Large-group marker publications (one per group per relay batch)."),
    family(
        MARKER_CLEARS,
        Kind::CounterBy("outcome", || vec!["cleared", "stale"]),
        "dirty.clear calls, by outcome (cleared, stale: the marker stays dirty).",
    ),
    family(SLOW_CONSUMERS, Kind::Counter, "WebSocket connections closed because their send queue filled."),
    family(TRIMMED_EVENTS, Kind::Counter, "User-log events removed by retention."),
    family(
        SNAPSHOTS,
        Kind::CounterBy("outcome", || SNAPSHOT_OUTCOMES.to_vec()),
        "Snapshots, by outcome (built, installed).",
    ),
    family(WS_CONNECTIONS, Kind::Gauge, "Open authenticated WebSocket connections."),
    family(
        EPHEMERAL_SENT,
        Kind::CounterBy("kind", || EPHEMERAL_KINDS.to_vec()),
        "Ephemeral frames (typing, presence) written to connections, by kind.",
    ),
    family(
        EPHEMERAL_DROPPED,
        Kind::CounterBy("reason", || EPHEMERAL_DROP_REASONS.to_vec()),
        "Ephemeral frames dropped (shed) before reaching a connection, by reason.",
    ),
    family(EPHEMERAL_BUS_PUBLISHED, Kind::Counter, "Ephemeral signals published to the other nodes (NATS)."),
    family(EPHEMERAL_BUS_RECEIVED, Kind::Counter, "Ephemeral signals received from the other nodes (NATS)."),
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
    family(store::CONFLICT_RETRIES, Kind::Counter, "PostgreSQL write requests re-run after a serialization conflict."),
    family(store::CONFLICT_GIVE_UPS, Kind::Counter, "PostgreSQL write requests given up after repeated conflicts."),
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
        PUSH_LATENCY,
        Kind::Histogram,
        "Time from the fan-out commit of a push's first event to the provider's accept, in seconds.",
    ),
];

fn register_all() {
    for f in FAMILIES {
        match f.kind {
            Kind::Counter => {
                metrics::describe_counter!(f.name, f.help);
                metrics::counter!(f.name).increment(0);
            }
            Kind::CounterBy(label, values) => {
                metrics::describe_counter!(f.name, f.help);
                for value in values() {
                    metrics::counter!(f.name, label => value).increment(0);
                }
            }
            Kind::Gauge => {
                metrics::describe_gauge!(f.name, f.help);
                metrics::gauge!(f.name).increment(0.0);
            }
            Kind::Histogram => {
                metrics::describe_histogram!(f.name, f.help);
                // A handle registers the family; it renders with zero counts.
                let _ = metrics::histogram!(f.name);
            }
        }
    }
}

pub fn refusal(code: ErrorCode) {
    metrics::counter!(REFUSALS, "code" => code.as_str()).increment(1);
}
