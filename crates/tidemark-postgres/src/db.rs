//! Statement helpers shared by the writer and the readers: cached prepared
//! statements, typed column reads and the mapping of PostgreSQL errors to
//! the store's neutral kinds.
//!
//! Every statement goes through the connection's statement cache, so after
//! the first use a statement costs one round trip (Bind/Execute), not two.
//! This module knows no table and no domain rule.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use deadpool_postgres::ClientWrapper;
use tidemark_store::{StoreError, StoreResult};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{FromSql, ToSql};
use tokio_postgres::Row;

/// A pooled connection (the writer's or a reader's).
pub(crate) type Conn = ClientWrapper;
/// Statement parameters.
pub(crate) type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// Maps a driver error to a neutral kind. Lost connections, timeouts,
/// deadlock victims and serialisation failures are `Unavailable` (the
/// caller may retry: nothing was committed for it); everything else the
/// database refuses is a bug or a broken invariant, `Internal`, as in the
/// SQLite backend (a unique violation there is `Internal` too).
pub(crate) fn error(e: tokio_postgres::Error) -> StoreError {
    const RETRYABLE: [SqlState; 6] = [
        SqlState::T_R_DEADLOCK_DETECTED,
        SqlState::T_R_SERIALIZATION_FAILURE,
        SqlState::QUERY_CANCELED,
        SqlState::LOCK_NOT_AVAILABLE,
        SqlState::ADMIN_SHUTDOWN,
        SqlState::TOO_MANY_CONNECTIONS,
    ];
    if let Some(db) = e.as_db_error() {
        let retryable = RETRYABLE.contains(db.code()) || db.code().code().starts_with("08");
        let message = db_message(db.code().code(), db.message());
        return if retryable { StoreError::Unavailable(message) } else { StoreError::Internal(message) };
    }
    let io = std::error::Error::source(&e).is_some_and(|s| s.is::<std::io::Error>());
    if e.is_closed() || io {
        StoreError::Unavailable(format!("postgres connection: {e}"))
    } else {
        StoreError::Internal(format!("postgres: {e}"))
    }
}

/// The text of an error the server raised: `postgres: <SQLSTATE>: <message>`
/// ([`is_lock_conflict`] reads the SQLSTATE back).
fn db_message(code: &str, message: &str) -> String {
    format!("postgres: {code}: {message}")
}

/// SQLSTATEs of a statement the server aborted only because of concurrent
/// transactions (deadlock victim, serialisation failure): the request that
/// ran it rolled back to its savepoint, and running it again in a later
/// transaction is exactly what a client retry would do.
const LOCK_CONFLICT_STATES: [&str; 2] = ["40P01", "40001"];

/// Whether `e` is a request's own deadlock or serialisation failure (made by
/// [`error`]), which the writer runs again (see `writer::WRITE_ATTEMPTS_MAX`).
pub(crate) fn is_lock_conflict(e: &StoreError) -> bool {
    match e {
        StoreError::Unavailable(m) => LOCK_CONFLICT_STATES
            .iter()
            .any(|code| m.strip_prefix("postgres: ").is_some_and(|rest| rest.starts_with(&format!("{code}: ")))),
        _ => false,
    }
}

/// A connection could not be had from a pool in time.
pub(crate) fn pool_error(e: deadpool_postgres::PoolError) -> StoreError {
    StoreError::Unavailable(format!("postgres pool: {e}"))
}

/// Statements this process's PostgreSQL store connections ran (see
/// `StoreStats::statements`): every statement goes through the helpers
/// of this module, or through `batch_execute`, counted at its call site.
pub(crate) static STATEMENTS: AtomicU64 = AtomicU64::new(0);

pub(crate) fn counted() {
    STATEMENTS.fetch_add(1, Ordering::Relaxed);
}

/// Runs a batch of statements (transaction control), counted as one.
pub(crate) async fn batch(c: &Conn, sql: &str) -> Result<(), tokio_postgres::Error> {
    counted();
    c.batch_execute(sql).await
}

/// Queues a batch of statements (transaction control) on the connection
/// and returns without awaiting its answer, counted as one. The statements
/// run before anything sent on the connection after them, whose answers
/// come after theirs; an error they raise is not seen (a read-only
/// transaction's `ROLLBACK` is the use). Fails only if the connection is
/// closed and nothing could be queued.
pub(crate) fn send_only(c: &Conn, sql: &str) -> Result<(), tokio_postgres::Error> {
    counted();
    let mut sent = std::pin::pin!(c.batch_execute(sql));
    // The driver sends on a request's first poll; the answer, dropped
    // unread with the future, is read and discarded by its connection task.
    match sent.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(result) => result,
        std::task::Poll::Pending => Ok(()),
    }
}

pub(crate) async fn query(c: &Conn, sql: &str, params: Params<'_>) -> StoreResult<Vec<Row>> {
    let stmt = c.prepare_cached(sql).await.map_err(error)?;
    counted();
    c.query(&stmt, params).await.map_err(error)
}

pub(crate) async fn query_opt(c: &Conn, sql: &str, params: Params<'_>) -> StoreResult<Option<Row>> {
    let stmt = c.prepare_cached(sql).await.map_err(error)?;
    counted();
    c.query_opt(&stmt, params).await.map_err(error)
}

pub(crate) async fn query_one(c: &Conn, sql: &str, params: Params<'_>) -> StoreResult<Row> {
    let stmt = c.prepare_cached(sql).await.map_err(error)?;
    counted();
    c.query_one(&stmt, params).await.map_err(error)
}

/// Runs a statement; returns the number of rows it changed.
pub(crate) async fn exec(c: &Conn, sql: &str, params: Params<'_>) -> StoreResult<u64> {
    let stmt = c.prepare_cached(sql).await.map_err(error)?;
    counted();
    c.execute(&stmt, params).await.map_err(error)
}

/// The first column of the first row, if any.
pub(crate) async fn scalar<T>(c: &Conn, sql: &str, params: Params<'_>) -> StoreResult<Option<T>>
where
    T: for<'r> FromSql<'r>,
{
    match query_opt(c, sql, params).await? {
        None => Ok(None),
        Some(row) => col(&row, 0).map(Some),
    }
}

/// A typed column; a type mismatch is a bug, reported as `Internal`
/// instead of the driver's panic.
pub(crate) fn col<'r, T: FromSql<'r>>(row: &'r Row, idx: usize) -> StoreResult<T> {
    row.try_get(idx).map_err(|e| StoreError::Internal(format!("postgres column {idx}: {e}")))
}

/// A stored sequence number or version (`BIGINT`, never negative).
pub(crate) fn seq(row: &Row, idx: usize) -> StoreResult<u64> {
    let v: i64 = col(row, idx)?;
    u64::try_from(v).map_err(|_| StoreError::Internal(format!("negative sequence {v} in column {idx}")))
}

/// A nullable sequence number.
pub(crate) fn seq_opt(row: &Row, idx: usize) -> StoreResult<Option<u64>> {
    let v: Option<i64> = col(row, idx)?;
    v.map(|v| u64::try_from(v).map_err(|_| StoreError::Internal(format!("negative sequence {v} in column {idx}"))))
        .transpose()
}

/// A Rust sequence number as a `BIGINT` parameter, saturating: stored
/// values never exceed `i64::MAX`, so a larger bound from a client (say a
/// `before_seq` of `u64::MAX`) means the same as `i64::MAX`.
pub(crate) fn big(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// What the crate's unit tests on a real PostgreSQL share: the server
/// from `TIDEMARK_TEST_PG_URL` (without it a test says so and returns),
/// and a plain connection beside the store's.
#[cfg(test)]
pub(crate) mod testing {
    const URL_VAR: &str = "TIDEMARK_TEST_PG_URL";

    /// The test server's URL, or `None` after saying why the test skips.
    pub(crate) fn url_or_skip() -> Option<String> {
        let url = std::env::var(URL_VAR).ok();
        if url.is_none() {
            eprintln!("skipping: {URL_VAR} is not set (e.g. {URL_VAR}=postgres://root@127.0.0.1:5432/test)");
        }
        url
    }

    /// A connection of its own, driven by a spawned task.
    pub(crate) async fn connect(cfg: &tokio_postgres::Config) -> tokio_postgres::Client {
        let (client, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_deadlocks_and_serialisation_failures_are_lock_conflicts() {
        let unavailable = |code: &str| StoreError::Unavailable(db_message(code, "x"));
        assert!(is_lock_conflict(&unavailable(SqlState::T_R_DEADLOCK_DETECTED.code())));
        assert!(is_lock_conflict(&unavailable(SqlState::T_R_SERIALIZATION_FAILURE.code())));
        for other in [SqlState::QUERY_CANCELED, SqlState::LOCK_NOT_AVAILABLE, SqlState::ADMIN_SHUTDOWN] {
            assert!(!is_lock_conflict(&unavailable(other.code())), "{}", other.code());
        }
        assert!(!is_lock_conflict(&StoreError::Internal(db_message("40P01", "x"))));
        assert!(!is_lock_conflict(&StoreError::Unavailable("commit: 40P01".into())));
    }
}
