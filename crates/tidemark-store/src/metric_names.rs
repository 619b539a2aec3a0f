//! Metric families: the [`Metric`] handle every family is recorded through
//! (its name and its stage, so every series carries the `stage` label of
//! seed §18.1 and no call site can forget it), the families the storage
//! backends record themselves, and those the SDK's devices report
//! (`client.stats`: gaps only a device sees) (the server's `metrics` module describes and
//! pre-registers them, so an operator sees a zero rather than a missing
//! family). Prometheus conventions: counters end in `_total`, units come
//! last in a name.

/// The `stage` label values: the rows of seed §18.1 (and the gateway and
/// ephemeral lane, which the table does not name).
pub mod stage {
    pub const ACCEPT: &str = "accept";
    pub const OUTBOX: &str = "outbox";
    pub const FANOUT: &str = "fanout";
    pub const SYNC_LOG: &str = "sync_log";
    pub const DEVICE_SYNC: &str = "device_sync";
    pub const GAP: &str = "gap";
    pub const PUSH: &str = "push";
    pub const STORAGE: &str = "storage";
    pub const INVARIANT: &str = "invariant";
    pub const GATEWAY: &str = "gateway";
    pub const EPHEMERAL: &str = "ephemeral";
    /// Every value, in the order of seed §18.1 (the dashboard's rows).
    pub const ALL: &[&str] =
        &[ACCEPT, OUTBOX, FANOUT, SYNC_LOG, DEVICE_SYNC, GAP, PUSH, STORAGE, INVARIANT, GATEWAY, EPHEMERAL];
}

/// One metric family: its name and the stage its series are labelled with.
/// Recording goes through these methods, which add `stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    pub name: &'static str,
    pub stage: &'static str,
}

impl Metric {
    pub const fn new(name: &'static str, stage: &'static str) -> Metric {
        Metric { name, stage }
    }

    /// Adds `n` to a counter.
    pub fn add(&self, n: u64) {
        metrics::counter!(self.name, "stage" => self.stage).increment(n);
    }

    pub fn inc(&self) {
        self.add(1);
    }

    /// Adds `n` to the series of a counter with one more label.
    pub fn add_by(&self, label: &'static str, value: &'static str, n: u64) {
        metrics::counter!(self.name, "stage" => self.stage, label => value).increment(n);
    }

    /// Sets a counter to a total kept elsewhere (the store's own counters).
    pub fn absolute(&self, total: u64) {
        metrics::counter!(self.name, "stage" => self.stage).absolute(total);
    }

    pub fn set(&self, v: f64) {
        metrics::gauge!(self.name, "stage" => self.stage).set(v);
    }

    pub fn set_by(&self, label: &'static str, value: &'static str, v: f64) {
        metrics::gauge!(self.name, "stage" => self.stage, label => value).set(v);
    }

    /// Moves a gauge by `d` (up or down).
    pub fn shift(&self, d: f64) {
        metrics::gauge!(self.name, "stage" => self.stage).increment(d);
    }

    pub fn record(&self, v: f64) {
        metrics::histogram!(self.name, "stage" => self.stage).record(v);
    }

    pub fn record_by(&self, label: &'static str, value: &'static str, v: f64) {
        metrics::histogram!(self.name, "stage" => self.stage, label => value).record(v);
    }
}

/// Write transactions committed (counter).
pub const COMMITS: Metric = Metric::new("tidemark_store_commits_total", stage::STORAGE);
/// Write requests per committed transaction (histogram, in requests).
pub const COMMIT_BATCH_REQUESTS: Metric = Metric::new("tidemark_store_commit_batch_requests", stage::STORAGE);
/// Bucket bounds of [`COMMIT_BATCH_REQUESTS`], in requests.
pub const COMMIT_BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
/// WAL checkpoints run by the SQLite writer (counter; two fsyncs each).
pub const CHECKPOINTS: Metric = Metric::new("tidemark_store_checkpoints_total", stage::STORAGE);
/// Truncating WAL checkpoints, by whether they finished (`done` = yes|busy).
pub const WAL_TRUNCATIONS: Metric = Metric::new("tidemark_store_wal_truncations_total", stage::STORAGE);
/// Values of the `done` label of [`WAL_TRUNCATIONS`].
pub const WAL_TRUNCATION_RESULTS: &[&str] = &["yes", "busy"];
/// Outbox items fanned out in the commit of the writes that appended them
/// (the fused fan-out, SQLite; issue 19), not by a relay claim (counter).
pub const FANOUT_FUSED_ITEMS: Metric = Metric::new("tidemark_fanout_fused_items_total", stage::FANOUT);
/// Fused fan-outs that failed and rolled back alone, leaving their items to
/// the relay while the writes they followed committed (counter).
pub const FANOUT_FUSED_FAILURES: Metric = Metric::new("tidemark_fanout_fused_failures_total", stage::FANOUT);
/// PostgreSQL requests re-run after a serialization conflict or deadlock
/// (counter), by `writer`: `conv` (a conversation writer) or `user` (the
/// user-side writer, where every user head is locked and advanced: its
/// retries are the head conflicts of seed §18.1). SQLite has one writer
/// and no conflict, so its series stay at zero.
pub const CONFLICT_RETRIES: Metric = Metric::new("tidemark_store_conflict_retries_total", stage::STORAGE);
/// PostgreSQL requests given up after repeated conflicts (counter), by `writer`.
pub const CONFLICT_GIVE_UPS: Metric = Metric::new("tidemark_store_conflict_give_ups_total", stage::STORAGE);
/// Values of the `writer` label of [`CONFLICT_RETRIES`] and [`CONFLICT_GIVE_UPS`].
pub const WRITERS: &[&str] = &["conv", "user"];

/// Gaps devices detected: conversations queued for repair (K5: an event
/// their store could not apply) and holes opened in a conversation's
/// `msg_seq` (its cursor left with a missing run), as the SDK reports them with `client.stats` (counter; each
/// report clamped to `tidemark_core::client_stats::CLIENT_STATS_COUNT_MAX`).
pub const SDK_GAPS_DETECTED: Metric = Metric::new("tidemark_sdk_gaps_detected_total", stage::GAP);
/// Gaps devices repaired (a queued conversation fetched and applied, a hole
/// closed), as reported (counter).
pub const SDK_GAPS_REPAIRED: Metric = Metric::new("tidemark_sdk_gaps_repaired_total", stage::GAP);
/// Repairs waiting on a device at each report (histogram, in
/// conversations; a report with none waiting records 0).
pub const SDK_REPAIRS_PENDING: Metric = Metric::new("tidemark_sdk_repairs_pending_conversations", stage::GAP);
/// Bucket bounds of [`SDK_REPAIRS_PENDING`], in conversations.
pub const SDK_REPAIRS_PENDING_BUCKETS: &[f64] = &[0.0, 1.0, 2.0, 5.0, 10.0, 50.0, 100.0, 1000.0, 10000.0];
/// How long devices took to repair a gap, from detection to repair, as
/// reported (histogram, in seconds), by `kind`: `repair` (the repair
/// queue, K5) or `hole` (a conversation cursor's missing run). Each report
/// records at most `tidemark_core::client_stats::CLIENT_STATS_DURATIONS_MAX`
/// samples of a kind, each clamped to `CLIENT_STATS_DURATION_MS_MAX`.
pub const SDK_GAP_REPAIR_SECONDS: Metric = Metric::new("tidemark_sdk_gap_repair_seconds", stage::GAP);
/// Values of the `kind` label of [`SDK_GAP_REPAIR_SECONDS`].
pub const SDK_GAP_KINDS: &[&str] = &["repair", "hole"];
/// Bucket bounds of [`SDK_GAP_REPAIR_SECONDS`], in seconds (up to a day;
/// the clamp is a week).
pub const SDK_GAP_REPAIR_BUCKETS: &[f64] =
    &[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0, 86400.0];
