//! The group-committing writer: one task owns the store's only read-write
//! connection and runs every write request that queued up while the
//! previous transaction was committing in one transaction (many requests,
//! one COMMIT, one WAL flush).
//!
//! Each request runs inside its own SAVEPOINT, so a request that fails (a
//! send to a conversation the sender left, a deadlock victim) rolls back
//! alone and the rest of the batch commits. The savepoint costs no round
//! trip of its own: it is pipelined with the request's first statement,
//! and released by the next request's savepoint or the COMMIT. Replies are sent only after
//! COMMIT returned: a caller never hears "ok" for something that is not
//! durable.
//!
//! A request that PostgreSQL aborts as a deadlock victim (`40P01`) or a
//! serialisation failure (`40001`) -- possible when several writers (nodes)
//! share the database, since a batch holds the locks of all of its requests
//! until COMMIT -- rolled back alone to its savepoint and committed nothing.
//! [`Writer::write`] runs it again, up to [`WRITE_ATTEMPTS_MAX`] runs in all,
//! each in a later transaction (after the batch that held the other locks
//! committed), after a short randomised pause. Re-running a request is
//! exactly a client retry: sends and control events stay idempotent on
//! `(sender, client_msg_id)` (S1), fan-out on F3, ACKs go through
//! `decide_ack` again. A retried request re-enters the queue behind those
//! that arrived meanwhile, so it may commit after a later request of the same
//! connection (as a client's own retry would). Only the last attempt's error
//! reaches the caller; other `Unavailable` causes are not retried here.
//!
//! One writer per store is the design, as in the SQLite backend: requests
//! run in queue order and never wait on each other's locks. The SQL the
//! requests run is still safe with several writers on one database (other
//! nodes): sequences are assigned under row locks held until COMMIT (see
//! the crate docs for the lock order). This module knows nothing about the
//! requests themselves.
//!
//! A batch that gets no connection, cannot begin or cannot commit marks the
//! writer unhealthy until a later one commits ([`Writer::health`], which
//! `/healthz` reports). A panic inside the writer task aborts the process
//! (a broken invariant), in debug builds and tests as in release ones.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tidemark_store::metric_names as names;
use tidemark_store::{StoreError, StoreHealth, StoreResult, WriteFailure};
use tokio::sync::{mpsc, oneshot};

use crate::db::{self, Conn};

/// Most requests in one transaction. A request costs a few round trips to
/// the server, so the bound also caps how long the first request of a
/// batch waits for its reply (and how long the batch holds its row locks).
pub const WRITE_BATCH_MAX: usize = 256;
/// Most requests waiting for the writer; callers wait (backpressure) beyond.
pub const WRITE_QUEUE_MAX: usize = 8192;
/// Most runs of one request aborted by a deadlock or a serialisation failure
/// (the first run included); the last one's error reaches the caller.
pub const WRITE_ATTEMPTS_MAX: u32 = 3;
/// Pause before a run again: `attempt × this`, plus a random part up to this,
/// so two writers' retries do not meet in lockstep.
pub const WRITE_RETRY_PAUSE_MS: u64 = 10;
/// Pause after the writer could not get a connection or begin a transaction,
/// so a database outage does not turn into a busy loop.
pub const WRITER_RETRY_PAUSE_MS: u64 = 50;

tokio::task_local! {
    /// Set while the writer task runs; a panic inside it aborts the process.
    static IN_WRITER: ();
}

/// Makes a panic inside the writer task abort the process at the panic,
/// before it unwinds: unwinding would drop the queued requests' reply
/// channels, their callers would answer `UNAVAILABLE`, and the node would
/// run on without a writer. Installed once, after the hook already in place
/// (which still prints the panic).
fn abort_on_writer_panic() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            if IN_WRITER.try_with(|_| ()).is_ok() {
                std::process::abort();
            }
        }));
    });
}

/// A boxed future borrowing the connection.
pub(crate) type BoxFut<'c, T> = Pin<Box<dyn Future<Output = T> + Send + 'c>>;

/// Completes one request once the batch's commit outcome is known.
type Completer = Box<dyn FnOnce(Option<StoreError>) + Send>;

/// One queued write request.
trait Job: Send {
    /// Runs the request inside the open transaction, in its own savepoint.
    /// Returns how to complete it after COMMIT, and whether the transaction
    /// is still usable (false if the savepoint itself could not be handled).
    /// `after_savepoint`: an earlier request of this transaction left its
    /// savepoint open (see [`in_savepoint`]).
    fn run<'c>(self: Box<Self>, c: &'c Conn, after_savepoint: bool) -> BoxFut<'c, (Completer, bool)>;
    /// Answers the request without running it.
    fn fail(self: Box<Self>, e: StoreError);
}

struct Request<T, F> {
    f: F,
    reply: oneshot::Sender<StoreResult<T>>,
}

impl<T, F> Job for Request<T, F>
where
    T: Send + 'static,
    F: for<'c> FnOnce(&'c Conn) -> BoxFut<'c, StoreResult<T>> + Send + 'static,
{
    fn run<'c>(self: Box<Self>, c: &'c Conn, after_savepoint: bool) -> BoxFut<'c, (Completer, bool)> {
        Box::pin(async move {
            let Request { f, reply } = *self;
            let (result, healthy) = in_savepoint(c, f, after_savepoint).await;
            let complete: Completer = Box::new(move |commit_error: Option<StoreError>| {
                let _ = reply.send(match commit_error {
                    Some(e) => Err(e),
                    None => result,
                });
            });
            (complete, healthy)
        })
    }

    fn fail(self: Box<Self>, e: StoreError) {
        let _ = self.reply.send(Err(e));
    }
}

/// Counters of the writer's durability work.
#[derive(Debug, Default)]
pub struct WriterStats {
    pub commits: AtomicU64,
    pub writes: AtomicU64,
    /// Requests run again after a deadlock or serialisation failure.
    pub conflict_retries: AtomicU64,
    /// Requests that still failed so on their last allowed run.
    pub conflict_give_ups: AtomicU64,
}

#[derive(Clone)]
pub(crate) struct Writer {
    jobs: mpsc::Sender<Box<dyn Job>>,
    pub(crate) stats: Arc<WriterStats>,
    failure: Arc<WriteFailure>,
}

impl Writer {
    /// Starts the writer task on `pool` (a pool of one connection). The task
    /// ends once every `Writer` clone is gone and the queue is drained.
    pub(crate) fn start(pool: Pool) -> (Writer, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel::<Box<dyn Job>>(WRITE_QUEUE_MAX);
        let stats = Arc::new(WriterStats::default());
        let failure = Arc::new(WriteFailure::default());
        abort_on_writer_panic();
        let handle = tokio::spawn(IN_WRITER.scope((), run(pool, rx, stats.clone(), failure.clone())));
        (Writer { jobs: tx, stats, failure }, handle)
    }

    /// Whether writes commit: the last batch's failure, if none has
    /// committed since, or a stopped writer.
    pub(crate) fn health(&self) -> StoreHealth {
        let write_failure = match self.failure.get() {
            Some(why) => Some(why),
            None if self.jobs.is_closed() => Some("store writer stopped".into()),
            None => None,
        };
        StoreHealth { write_failure }
    }

    /// Runs `f` inside the next group-committed transaction and returns its
    /// result once that transaction is durable; runs it again (a fresh
    /// clone, in a later transaction) if it was aborted by a deadlock or a
    /// serialisation failure, up to [`WRITE_ATTEMPTS_MAX`] runs.
    pub(crate) async fn write<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c Conn) -> BoxFut<'c, StoreResult<T>> + Clone + Send + 'static,
    {
        let mut attempt = 1;
        loop {
            let result = self.write_once(f.clone()).await;
            match result {
                Err(e) if db::is_lock_conflict(&e) => {
                    if attempt >= WRITE_ATTEMPTS_MAX {
                        self.stats.conflict_give_ups.fetch_add(1, Ordering::Relaxed);
                        metrics::counter!(names::CONFLICT_GIVE_UPS).increment(1);
                        tracing::warn!(error = %e, attempts = attempt, "store request aborted by lock conflicts");
                        return Err(e);
                    }
                    self.stats.conflict_retries.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!(names::CONFLICT_RETRIES).increment(1);
                    tracing::debug!(error = %e, attempt, "store request aborted by a lock conflict; retrying");
                    let jitter = rand::random_range(0..=WRITE_RETRY_PAUSE_MS);
                    tokio::time::sleep(Duration::from_millis(WRITE_RETRY_PAUSE_MS * u64::from(attempt) + jitter)).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// One run of `f` in the next batch.
    async fn write_once<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c Conn) -> BoxFut<'c, StoreResult<T>> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel::<StoreResult<T>>();
        let job: Box<dyn Job> = Box::new(Request { f, reply });
        self.jobs.send(job).await.map_err(|_| StoreError::Unavailable("store writer stopped".into()))?;
        rx.await.map_err(|_| StoreError::Unavailable("store writer stopped".into()))?
    }
}

/// Runs one request in a savepoint; an `Err` rolls back what it wrote.
///
/// Two round trips are saved per request. The savepoint is opened in the
/// same pipeline as the request's first statement (tokio-postgres sends
/// requests in the order they are first polled, and the server runs them
/// in that order: the `SAVEPOINT` is polled first, see [`both`]). And a
/// request that succeeded leaves its savepoint open: the next request's
/// `RELEASE SAVEPOINT job; SAVEPOINT job` or the batch's `COMMIT` releases
/// it. `after_savepoint` says whether an earlier request of this
/// transaction left one open. A failed request is rolled back to its
/// savepoint at once, before anything else runs.
async fn in_savepoint<T, F>(c: &Conn, f: F, after_savepoint: bool) -> (StoreResult<T>, bool)
where
    F: for<'c> FnOnce(&'c Conn) -> BoxFut<'c, StoreResult<T>>,
{
    let begin = if after_savepoint { "RELEASE SAVEPOINT job; SAVEPOINT job" } else { "SAVEPOINT job" };
    let (opened, result) = both(db::batch(c, begin), f(c)).await;
    if let Err(e) = opened {
        // Nothing of the request can have run outside a savepoint: its
        // statements queued behind the failed one failed too.
        return (Err(db::error(e)), false);
    }
    if result.is_err() {
        if let Err(e) = db::batch(c, "ROLLBACK TO SAVEPOINT job").await {
            return (Err(db::error(e)), false);
        }
    }
    (result, true)
}

/// Runs two futures on this task, always polling `first` before `second`,
/// so a request `first` sends on its first poll reaches the connection
/// before any `second` sends (a join with a rotating start would not
/// promise that).
async fn both<A: Future, B: Future>(first: A, second: B) -> (A::Output, B::Output) {
    let (mut first, mut second) = (std::pin::pin!(first), std::pin::pin!(second));
    let (mut a, mut b) = (None, None);
    std::future::poll_fn(|cx| {
        if a.is_none() {
            if let std::task::Poll::Ready(out) = first.as_mut().poll(cx) {
                a = Some(out);
            }
        }
        if b.is_none() {
            if let std::task::Poll::Ready(out) = second.as_mut().poll(cx) {
                b = Some(out);
            }
        }
        if a.is_some() && b.is_some() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    (a.expect("polled to completion"), b.expect("polled to completion"))
}

/// Commits the open transaction. The `SELECT 1` first is a guard: PostgreSQL
/// answers COMMIT on a transaction in the aborted state with a rollback and
/// no error, so a failed statement that slipped through would otherwise be
/// reported as committed. In the aborted state `SELECT 1` fails and the rest
/// of the string is skipped.
const COMMIT_SQL: &str = "SELECT 1; COMMIT";

async fn run(pool: Pool, mut rx: mpsc::Receiver<Box<dyn Job>>, stats: Arc<WriterStats>, failure: Arc<WriteFailure>) {
    let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(WRITE_BATCH_MAX);
    let pause = Duration::from_millis(WRITER_RETRY_PAUSE_MS);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < WRITE_BATCH_MAX {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let size = batch.len() as u64;
        // The pool holds the single writer connection; it hands back a fresh
        // one if the previous one died.
        let conn = match pool.get().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::error!(error = %e, "store writer has no connection");
                failure.set(Some(format!("no connection: {e}")));
                fail_all(&mut batch, db::pool_error(e));
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        if let Err(e) = db::batch(&conn, "BEGIN ISOLATION LEVEL READ COMMITTED").await {
            tracing::error!(error = %e, "store writer could not begin a transaction");
            failure.set(Some(format!("begin: {e}")));
            fail_all(&mut batch, db::error(e));
            drop(conn);
            tokio::time::sleep(pause).await;
            continue;
        }
        let mut completers: Vec<Completer> = Vec::with_capacity(batch.len());
        let mut broken: Option<StoreError> = None;
        for (i, job) in batch.drain(..).enumerate() {
            if let Some(e) = &broken {
                job.fail(e.clone());
                continue;
            }
            let (complete, healthy) = job.run(&conn, i > 0).await;
            completers.push(complete);
            if !healthy {
                broken = Some(StoreError::Unavailable("store transaction broken; batch rolled back".into()));
            }
        }
        let commit_error = match broken {
            Some(e) => {
                let _ = db::batch(&conn, "ROLLBACK").await;
                tracing::error!(error = %e, "store batch rolled back");
                Some(e)
            }
            None => match db::batch(&conn, COMMIT_SQL).await {
                Ok(()) => None,
                Err(e) => {
                    let _ = db::batch(&conn, "ROLLBACK").await;
                    tracing::error!(error = %e, "store commit failed; batch rolled back");
                    Some(StoreError::Unavailable(format!("commit: {e}")))
                }
            },
        };
        drop(conn);
        failure.set(commit_error.as_ref().map(|e| e.to_string()));
        if commit_error.is_none() {
            stats.commits.fetch_add(1, Ordering::Relaxed);
            stats.writes.fetch_add(size, Ordering::Relaxed);
            metrics::counter!(names::COMMITS).increment(1);
            metrics::histogram!(names::COMMIT_BATCH_REQUESTS).record(size as f64);
        }
        for complete in completers {
            complete(commit_error.clone());
        }
    }
}

fn fail_all(batch: &mut Vec<Box<dyn Job>>, e: StoreError) {
    for job in batch.drain(..) {
        job.fail(e.clone());
    }
}
