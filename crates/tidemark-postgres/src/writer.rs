//! The group-committing writer: one task owns one read-write connection
//! and runs every write request that queued up while the previous
//! transaction was committing in one transaction (many requests, one
//! COMMIT, one WAL flush). A store runs a few of them (the conversation
//! writers and the fan-out writer, see the crate docs).
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
//! A request of one statement ([`Writer::write_statement`]; a send, see
//! `events::SEND_SQL`) is pipelined with the one-statement requests beside
//! it in the batch: their statements go out back to back behind one
//! savepoint, costing one round trip for the run ([`run_pipelined`]).
//!
//! Within one writer, requests run in queue order and never wait on each
//! other's locks. The SQL the requests run is safe with several writers on
//! one database (this store's others, other nodes): sequences are assigned under row locks held until COMMIT (see
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
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::db::{self, Conn};

/// Most requests in one transaction. A request costs up to a few round
/// trips to the server (a run of one-statement requests one for the run),
/// so the bound also caps how long the first request of a
/// batch waits for its reply (and how long the batch holds its row locks).
pub const WRITE_BATCH_MAX: usize = 256;
/// Most requests waiting for the writer; callers wait (backpressure) beyond.
pub const WRITE_QUEUE_MAX: usize = 8192;
/// Most runs of one request aborted by a deadlock or a serialisation failure
/// (the first run included); the last one's error reaches the caller.
pub const WRITE_ATTEMPTS_MAX: u32 = 5;
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
pub type BoxFut<'c, T> = Pin<Box<dyn Future<Output = T> + Send + 'c>>;

/// Completes one request once the batch's commit outcome is known.
type Completer = Box<dyn FnOnce(Option<StoreError>) + Send>;

/// One queued write request: a transaction body of any number of
/// statements, run alone in its savepoint, or one statement that is
/// pipelined with its neighbours (see [`run_pipelined`]).
enum Queued {
    Body(Box<dyn Job>),
    Statement(Box<dyn PipedJob>),
}

/// A queued request with its place in the batch's lock order.
struct Entry {
    /// The conversation whose row the request locks first, if it is a
    /// conversation event (see [`order_batch`]).
    conv: Option<Arc<str>>,
    job: Queued,
}

/// Puts a batch in the order that takes conversation row locks in one
/// global order, so no two batches (of this store's writers or of other
/// nodes) can wait on each other in a cycle over conversation rows: the
/// requests of a conversation first, in `conv_id` byte order (the same
/// order on every node), then every request that locks no conversation
/// row (user-side and account writes, whose locks come after the
/// conversation side in the crate's lock order). The sort is stable:
/// requests on one conversation, and the unkeyed ones, keep their queue
/// order. Every request of a batch is in flight at once (none is answered
/// before COMMIT), so any order between requests on different rows is one
/// their callers could have seen.
fn order_batch(batch: &mut [Entry]) {
    batch.sort_by(|a, b| match (&a.conv, &b.conv) {
        (Some(x), Some(y)) => x.as_bytes().cmp(y.as_bytes()),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    });
}

impl Queued {
    fn fail(self, e: StoreError) {
        match self {
            Queued::Body(job) => job.fail(e),
            Queued::Statement(job) => job.fail(e),
        }
    }
}

/// An owned statement parameter, so a request can run again.
pub(crate) type Param = Box<dyn ToSql + Sync + Send>;

/// What a one-statement request decided from the rows its statement
/// returned.
pub(crate) enum Decided<T> {
    /// The answer; whatever the statement wrote stands.
    Answer(StoreResult<T>),
    /// A refusal found after the statement wrote: its writes must not
    /// commit, and the caller hears this error.
    Undo(StoreError),
}

/// A queued one-statement request.
trait PipedJob: Send {
    fn sql(&self) -> &'static str;
    fn params(&self) -> Vec<&(dyn ToSql + Sync)>;
    /// Decides from the statement's rows and keeps the answer; `false` if
    /// the statement's writes must be undone (the answer is then an error).
    fn decide(&mut self, rows: &[Row]) -> bool;
    /// Keeps `e` as the answer: the request's statement failed.
    fn refuse(&mut self, e: StoreError);
    /// Completes the request with the kept answer once the commit outcome
    /// is known.
    fn completer(self: Box<Self>) -> Completer;
    /// Answers the request without running it.
    fn fail(self: Box<Self>, e: StoreError);
}

struct Piped<T, D> {
    sql: &'static str,
    params: Arc<Vec<Param>>,
    decide: D,
    answer: Option<StoreResult<T>>,
    reply: oneshot::Sender<StoreResult<T>>,
}

impl<T, D> PipedJob for Piped<T, D>
where
    T: Send + 'static,
    D: Fn(&[Row]) -> Decided<T> + Send + 'static,
{
    fn sql(&self) -> &'static str {
        self.sql
    }

    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.params.iter().map(|p| p.as_ref() as &(dyn ToSql + Sync)).collect()
    }

    fn decide(&mut self, rows: &[Row]) -> bool {
        let (answer, keep) = match (self.decide)(rows) {
            Decided::Answer(answer) => (answer, true),
            Decided::Undo(e) => (Err(e), false),
        };
        self.answer = Some(answer);
        keep
    }

    fn refuse(&mut self, e: StoreError) {
        self.answer = Some(Err(e));
    }

    fn completer(self: Box<Self>) -> Completer {
        let Piped { answer, reply, .. } = *self;
        let answer = answer.unwrap_or_else(|| Err(StoreError::Internal("a pipelined request was never run".into())));
        Box::new(move |commit_error: Option<StoreError>| {
            let _ = reply.send(match commit_error {
                Some(e) => Err(e),
                None => answer,
            });
        })
    }

    fn fail(self: Box<Self>, e: StoreError) {
        let _ = self.reply.send(Err(e));
    }
}

/// One queued write request of many statements.
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
    jobs: mpsc::Sender<Entry>,
    /// The `writer` label of its conflict metrics: `conv` or `user`
    /// (`metric_names::WRITERS`).
    role: &'static str,
    pub(crate) stats: Arc<WriterStats>,
    failure: Arc<WriteFailure>,
}

impl Writer {
    /// Starts the writer task on `pool` (a pool of one connection). The task
    /// ends once every `Writer` clone is gone and the queue is drained.
    pub(crate) fn start(pool: Pool, role: &'static str) -> (Writer, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel::<Entry>(WRITE_QUEUE_MAX);
        let stats = Arc::new(WriterStats::default());
        let failure = Arc::new(WriteFailure::default());
        abort_on_writer_panic();
        let handle = tokio::spawn(IN_WRITER.scope((), run(pool, rx, stats.clone(), failure.clone())));
        (Writer { jobs: tx, role, stats, failure }, handle)
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
        self.retrying(None, |reply| Queued::Body(Box::new(Request { f: f.clone(), reply }))).await
    }

    /// [`Writer::write`] for a request that locks `conv`'s row first (a
    /// conversation event): it runs in its batch's conversation lock order
    /// (see [`order_batch`]).
    pub(crate) async fn write_conv<T, F>(&self, conv: String, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c Conn) -> BoxFut<'c, StoreResult<T>> + Clone + Send + 'static,
    {
        let conv: Arc<str> = conv.into();
        self.retrying(Some(conv), |reply| Queued::Body(Box::new(Request { f: f.clone(), reply }))).await
    }

    /// Runs one statement (`sql` with `params`) in the next group-committed
    /// transaction, pipelined with the other one-statement requests beside
    /// it in the queue, and answers what `decide` makes of its rows once
    /// that transaction is durable. `decide` may run more than once (the
    /// statement runs again when a neighbour in its pipeline failed); only
    /// its last answer counts. Retried on lock conflicts as [`Writer::write`].
    /// The statement must refuse without an error (by what it returns) or
    /// leave the transaction usable only through its savepoint.
    /// `conv`: the conversation whose row the statement locks first, if any
    /// (see [`order_batch`]).
    pub(crate) async fn write_statement<T, D>(
        &self,
        conv: Option<&str>,
        sql: &'static str,
        params: Vec<Param>,
        decide: D,
    ) -> StoreResult<T>
    where
        T: Send + 'static,
        D: Fn(&[Row]) -> Decided<T> + Clone + Send + 'static,
    {
        let params = Arc::new(params);
        self.retrying(conv.map(Arc::from), |reply| {
            Queued::Statement(Box::new(Piped {
                sql,
                params: params.clone(),
                decide: decide.clone(),
                answer: None,
                reply,
            }))
        })
        .await
    }

    /// Queues the request `make` builds until it is answered other than by
    /// a lock conflict, or [`WRITE_ATTEMPTS_MAX`] runs.
    async fn retrying<T>(
        &self,
        conv: Option<Arc<str>>,
        make: impl Fn(oneshot::Sender<StoreResult<T>>) -> Queued,
    ) -> StoreResult<T> {
        let mut attempt = 1;
        loop {
            let result = self.write_once(&conv, &make).await;
            match result {
                Err(e) if db::is_lock_conflict(&e) => {
                    if attempt >= WRITE_ATTEMPTS_MAX {
                        self.stats.conflict_give_ups.fetch_add(1, Ordering::Relaxed);
                        names::CONFLICT_GIVE_UPS.add_by("writer", self.role, 1);
                        tracing::warn!(error = %e, attempts = attempt, "store request aborted by lock conflicts");
                        return Err(e);
                    }
                    self.stats.conflict_retries.fetch_add(1, Ordering::Relaxed);
                    names::CONFLICT_RETRIES.add_by("writer", self.role, 1);
                    tracing::debug!(error = %e, attempt, "store request aborted by a lock conflict; retrying");
                    let jitter = rand::random_range(0..=WRITE_RETRY_PAUSE_MS);
                    tokio::time::sleep(Duration::from_millis(WRITE_RETRY_PAUSE_MS * u64::from(attempt) + jitter)).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// One run of a request in the next batch.
    async fn write_once<T>(
        &self,
        conv: &Option<Arc<str>>,
        make: &impl Fn(oneshot::Sender<StoreResult<T>>) -> Queued,
    ) -> StoreResult<T> {
        let (reply, rx) = oneshot::channel::<StoreResult<T>>();
        let entry = Entry { conv: conv.clone(), job: make(reply) };
        self.jobs.send(entry).await.map_err(|_| StoreError::Unavailable("store writer stopped".into()))?;
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

/// Runs consecutive one-statement requests as one pipeline: their
/// statements are sent back to back, in queue order, behind the run's
/// savepoint, and the server answers them in that order, so the whole run
/// costs one round trip instead of one per request (tokio-postgres sends a
/// request when its future is first polled; [`in_order`] polls them in
/// order). Returns whether the transaction is still usable; pushes one
/// completer per request.
///
/// The run shares one savepoint. A statement that fails (a deadlock
/// victim, say) aborts the transaction, and every statement after it fails
/// with it (25P02): the run rolls back to its savepoint, the first failed
/// request keeps its error, and the others run again. So does a request
/// whose `decide` refused after its statement wrote ([`Decided::Undo`]).
/// Each rerun removes at least one request, so a run of `n` ends within
/// `n` pipelines; a refusal by result (the statement wrote nothing, as
/// every refusal of `tidemark_send`) costs no rerun.
async fn run_pipelined(
    c: &Conn,
    mut run: Vec<Box<dyn PipedJob>>,
    after_savepoint: bool,
    completers: &mut Vec<Completer>,
) -> bool {
    // Prepared once per connection (cached), before the pipeline: a
    // statement prepared inside it would take a round trip of its own and
    // send its request out of order.
    let mut statements = Vec::with_capacity(run.len());
    let sqls: Vec<&'static str> = run.iter().map(|job| job.sql()).collect();
    for sql in sqls {
        match c.prepare_cached(sql).await {
            Ok(stmt) => statements.push(stmt),
            Err(e) => {
                let e = db::error(e);
                for mut job in run {
                    job.refuse(e.clone());
                    completers.push(job.completer());
                }
                return false;
            }
        }
    }
    let begin = if after_savepoint { "RELEASE SAVEPOINT job; SAVEPOINT job" } else { "SAVEPOINT job" };
    let mut opening = Some(begin);
    loop {
        if run.is_empty() {
            return true;
        }
        let params: Vec<Vec<&(dyn ToSql + Sync)>> = run.iter().map(|job| job.params()).collect();
        let mut results = {
            let mut futures: Vec<BoxFut<'_, Result<Vec<Row>, tokio_postgres::Error>>> =
                Vec::with_capacity(run.len() + 1);
            if let Some(sql) = opening {
                futures.push(Box::pin(async move { db::batch(c, sql).await.map(|()| Vec::new()) }));
            }
            for (stmt, params) in statements.iter().zip(&params) {
                db::counted();
                futures.push(Box::pin(async move { c.query(stmt, params).await }));
            }
            in_order(futures).await
        };
        drop(params);
        if opening.take().is_some() {
            if let Err(e) = results.remove(0) {
                // Nothing of the run can have run outside its savepoint.
                let e = db::error(e);
                for mut job in run {
                    job.refuse(e.clone());
                    completers.push(job.completer());
                }
                return false;
            }
        }
        // The first failure is the culprit; those after it only shared its
        // aborted transaction.
        let undo: Vec<usize> = match results.iter().position(Result::is_err) {
            Some(k) => {
                let Err(e) = results.swap_remove(k) else { unreachable!("an error at {k}") };
                run[k].refuse(db::error(e));
                vec![k]
            }
            None => run
                .iter_mut()
                .zip(&results)
                .enumerate()
                .filter_map(|(i, (job, rows))| {
                    let rows = rows.as_ref().expect("no error in this pipeline");
                    (!job.decide(rows)).then_some(i)
                })
                .collect(),
        };
        if undo.is_empty() {
            completers.extend(run.into_iter().map(|job| job.completer()));
            return true;
        }
        if let Err(e) = db::batch(c, "ROLLBACK TO SAVEPOINT job").await {
            let e = db::error(e);
            for mut job in run {
                job.refuse(e.clone());
                completers.push(job.completer());
            }
            return false;
        }
        for &i in undo.iter().rev() {
            completers.push(run.remove(i).completer());
            statements.remove(i);
        }
    }
}

/// Runs `futures` on this task to completion, polling each unfinished one
/// in index order on every wake-up, so what each sends on its first poll
/// reaches the connection in index order (a `join_all` of many futures
/// does not promise that order). Public for the tests that queue store
/// requests in a known order.
pub async fn in_order<'c, T>(futures: Vec<BoxFut<'c, T>>) -> Vec<T> {
    let mut futures: Vec<Option<BoxFut<'c, T>>> = futures.into_iter().map(Some).collect();
    let mut outputs: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if let Some(f) = future {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(out) => {
                        *output = Some(out);
                        *future = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(|o| o.expect("polled to completion")).collect()
}

/// Commits the open transaction. The `SELECT 1` first is a guard: PostgreSQL
/// answers COMMIT on a transaction in the aborted state with a rollback and
/// no error, so a failed statement that slipped through would otherwise be
/// reported as committed. In the aborted state `SELECT 1` fails and the rest
/// of the string is skipped.
const COMMIT_SQL: &str = "SELECT 1; COMMIT";

async fn run(pool: Pool, mut rx: mpsc::Receiver<Entry>, stats: Arc<WriterStats>, failure: Arc<WriteFailure>) {
    let mut batch: Vec<Entry> = Vec::with_capacity(WRITE_BATCH_MAX);
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
        order_batch(&mut batch);
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
        // Whether an earlier request (or run of statements) of this
        // transaction left its savepoint open.
        let mut after_savepoint = false;
        let mut queued = batch.drain(..).map(|entry| entry.job).peekable();
        while let Some(next) = queued.next() {
            if let Some(e) = &broken {
                next.fail(e.clone());
                continue;
            }
            let healthy = match next {
                Queued::Body(job) => {
                    let (complete, healthy) = job.run(&conn, after_savepoint).await;
                    completers.push(complete);
                    healthy
                }
                Queued::Statement(job) => {
                    // The run of one-statement requests that starts here.
                    let mut run = vec![job];
                    while let Some(Queued::Statement(_)) = queued.peek() {
                        let Some(Queued::Statement(job)) = queued.next() else { unreachable!("peeked") };
                        run.push(job);
                    }
                    run_pipelined(&conn, run, after_savepoint, &mut completers).await
                }
            };
            after_savepoint = true;
            if !healthy {
                broken = Some(StoreError::Unavailable("store transaction broken; batch rolled back".into()));
            }
        }
        drop(queued);
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
            names::COMMITS.inc();
            names::COMMIT_BATCH_REQUESTS.record(size as f64);
        }
        for complete in completers {
            complete(commit_error.clone());
        }
    }
}

fn fail_all(batch: &mut Vec<Entry>, e: StoreError) {
    for entry in batch.drain(..) {
        entry.job.fail(e.clone());
    }
}

#[cfg(test)]
mod tests {
    //! The pipeline's failure paths, on a real PostgreSQL
    //! (`TIDEMARK_TEST_PG_URL`; without it the test says so and returns).
    use super::*;

    /// Writes `v` into `t`, then fails on `v = 0` (division by zero, after
    /// the row is written): an error inside a pipeline.
    const WRITE_SQL: &str = "WITH w AS (INSERT INTO t (v) VALUES ($1) RETURNING v) SELECT 10 / v FROM w";

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_or_undone_statement_rolls_back_alone_inside_its_pipeline() {
        let Some(url) = crate::db::testing::url_or_skip() else { return };
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let schema = format!("t_pipeline_{}_{nanos}", std::process::id());
        let mut pg: tokio_postgres::Config = url.parse().unwrap();
        pg.options(format!("-c search_path={schema}"));
        let raw = crate::db::testing::connect(&pg).await;
        raw.batch_execute(&format!("CREATE SCHEMA {schema}; CREATE TABLE {schema}.t (v INT PRIMARY KEY)"))
            .await
            .unwrap();
        let (writer, _task) = Writer::start(crate::pool(pg, 1).unwrap(), "conv");

        // Hold the writer inside a batch until every request below queued
        // up, so they all run in the next batch, as one pipeline.
        let (started_tx, started) = oneshot::channel::<()>();
        let (release, release_rx) = oneshot::channel::<()>();
        let blocker = {
            let writer = writer.clone();
            let slot = Arc::new(std::sync::Mutex::new(Some((started_tx, release_rx))));
            tokio::spawn(async move {
                writer
                    .write(move |_c| {
                        let slot = slot.clone();
                        Box::pin(async move {
                            let (started, release) = slot.lock().unwrap().take().expect("runs once");
                            let _ = started.send(());
                            let _ = release.await;
                            Ok(())
                        })
                    })
                    .await
            })
        };
        started.await.unwrap();
        // 0 fails in SQL; 3 is written, then undone by its `decide`.
        let values = [1, 2, 0, 3, 4, 5];
        let mut requests = Vec::new();
        for v in values {
            let queue = writer.clone();
            requests.push(tokio::spawn(async move {
                queue
                    .write_statement(None, WRITE_SQL, vec![Box::new(v)], move |rows| {
                        let q: i32 = rows[0].get(0);
                        if v == 3 {
                            Decided::Undo(StoreError::Invalid("three is refused after writing".into()))
                        } else {
                            Decided::Answer(Ok(q))
                        }
                    })
                    .await
            }));
            // Queued in this order before the next one is spawned.
            let queued = WRITE_QUEUE_MAX - requests.len();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while writer.jobs.capacity() > queued && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert!(writer.jobs.capacity() <= queued, "request {v} never queued");
        }
        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        let mut answers = Vec::new();
        for r in requests {
            answers.push(r.await.unwrap());
        }
        assert_eq!(answers[0], Ok(10));
        assert_eq!(answers[1], Ok(5));
        assert!(matches!(&answers[2], Err(StoreError::Internal(m)) if m.contains("22012")), "{:?}", answers[2]);
        assert!(matches!(&answers[3], Err(StoreError::Invalid(_))), "{:?}", answers[3]);
        assert_eq!(answers[4], Ok(2));
        assert_eq!(answers[5], Ok(2));
        let stored: Vec<i32> =
            raw.query("SELECT v FROM t ORDER BY v", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        assert_eq!(stored, vec![1, 2, 4, 5], "the failed and the undone rows rolled back, the rest committed");
        assert_eq!(writer.stats.commits.load(Ordering::Relaxed), 2, "the blocker's batch, then one for all six");
        raw.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
    }
}
