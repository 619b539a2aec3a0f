//! Names of the metric families the storage backends record themselves
//! (the server's `metrics` module describes and pre-registers them, so an
//! operator sees a zero rather than a missing family). Prometheus
//! conventions: counters end in `_total`, units come last in a name.

/// Write transactions committed (counter).
pub const COMMITS: &str = "tidemark_store_commits_total";
/// Write requests per committed transaction (histogram, in requests).
pub const COMMIT_BATCH_REQUESTS: &str = "tidemark_store_commit_batch_requests";
/// Bucket bounds of [`COMMIT_BATCH_REQUESTS`], in requests.
pub const COMMIT_BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
/// WAL checkpoints run by the SQLite writer (counter; two fsyncs each).
pub const CHECKPOINTS: &str = "tidemark_store_checkpoints_total";
/// Truncating WAL checkpoints, by whether they finished (`done` = yes|busy).
pub const WAL_TRUNCATIONS: &str = "tidemark_store_wal_truncations_total";
/// Values of the `done` label of [`WAL_TRUNCATIONS`].
pub const WAL_TRUNCATION_RESULTS: &[&str] = &["yes", "busy"];
/// PostgreSQL requests re-run after a serialization conflict (counter).
pub const CONFLICT_RETRIES: &str = "tidemark_store_conflict_retries_total";
/// PostgreSQL requests given up after repeated conflicts (counter).
pub const CONFLICT_GIVE_UPS: &str = "tidemark_store_conflict_give_ups_total";
