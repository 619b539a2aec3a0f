//! Prometheus metrics. Names carry their unit and stage (O1); labels carry
//! codes and results, never user ids or message content (O2).
//!
//! The recorder is process-global (the `metrics` facade is), installed once;
//! several servers in one test process share it.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tidemark_proto::ErrorCode;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the recorder if none is installed yet and returns its handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(&[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
                .expect("static buckets are valid")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed by an embedding
            // program; metrics then go there and this handle renders empty.
            let _ = metrics::set_global_recorder(recorder);
            describe();
            handle
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(SENDS_ACCEPTED, "Messages accepted (new, committed with their outbox record).");
    describe_counter!(SENDS_DUPLICATE, "Sends answered with an earlier message (same sender and client_msg_id).");
    describe_gauge!(OUTBOX_BACKLOG, "Outbox records not yet fanned out.");
    describe_gauge!(OUTBOX_OLDEST_AGE, "Age of the oldest outbox record, seconds.");
    describe_histogram!(FANOUT_LAG, "Time from acceptance to the user events being committed, seconds.");
    describe_counter!(FANOUT_EVENTS, "User events written by fan-out.");
    describe_counter!(FANOUT_DUPLICATES, "Fan-out deliveries skipped because the user already had the event.");
    describe_counter!(
        FANOUT_QUARANTINED,
        "Fan-out items quarantined: two membership periods of one user (integrity error)."
    );
    describe_counter!(SYNC_PAGES, "Sync pages served.");
    describe_counter!(ACKS, "Sync ACKs by result.");
    describe_counter!(REFUSALS, "Requests refused, by error code.");
    describe_counter!(GENERATION_BUMPS, "Device generations bumped (resets).");
    describe_counter!(HINTS, "Hint frames sent to connected devices.");
    describe_counter!(HINTS_BUS_PUBLISHED, "Hints published to the other nodes (NATS hint bus).");
    describe_counter!(HINTS_BUS_RECEIVED, "Hints received from the other nodes (NATS hint bus).");
    describe_counter!(HINTS_BUS_DROPPED, "Hints not published: queue full or NATS error (only latency is lost).");
    describe_counter!(SLOW_CONSUMERS, "WebSocket connections closed because their send queue filled.");
    describe_counter!(TRIMMED_EVENTS, "User-log events removed by retention.");
    describe_counter!(SNAPSHOTS, "Snapshots by outcome (built, installed).");
    describe_gauge!(WS_CONNECTIONS, "Open authenticated WebSocket connections.");
    describe_gauge!(STORE_COMMITS, "Store write transactions committed since start.");
    describe_gauge!(STORE_WRITES, "Store write requests carried by those transactions.");
    describe_gauge!(STORE_STATEMENTS, "SQL statements the store's connections ran since start (reads and writes).");
    describe_gauge!(STORE_READ_STATEMENTS, "Of those, statements on read connections (SQLite only).");
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
pub const SLOW_CONSUMERS: &str = "tidemark_slow_consumer_disconnects_total";
pub const TRIMMED_EVENTS: &str = "tidemark_retention_trimmed_events_total";
pub const SNAPSHOTS: &str = "tidemark_snapshots_total";
pub const WS_CONNECTIONS: &str = "tidemark_ws_connections";
pub const STORE_COMMITS: &str = "tidemark_store_commits";
pub const STORE_WRITES: &str = "tidemark_store_writes";
pub const STORE_STATEMENTS: &str = "tidemark_store_statements";
pub const STORE_READ_STATEMENTS: &str = "tidemark_store_read_statements";

pub fn refusal(code: ErrorCode) {
    metrics::counter!(REFUSALS, "code" => code.as_str()).increment(1);
}
