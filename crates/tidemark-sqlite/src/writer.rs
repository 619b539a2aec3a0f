//! The single writer: one thread owns the only read-write connection and
//! group-commits every write request that queued up while the previous
//! transaction was committing (many requests, one transaction, one fsync),
//! and those that queue while the batch runs, for at most
//! [`LATE_JOIN_WITHIN`].
//!
//! Each request runs inside its own SAVEPOINT, so a request that fails (for
//! example a send to a conversation the sender left) rolls back alone and
//! the rest of the batch commits. Requests on the resume path whose
//! failures come before their first change ([`Writer::write_unguarded`]:
//! opening a connection, an ACK; and an accepted send,
//! [`Writer::write_announcing_unguarded`]) skip the savepoint; if
//! one fails after changing a row anyway, the whole batch is rolled back
//! and every request of it answered `UNAVAILABLE` (a retry is safe), so a
//! partial request never commits. Replies are sent only after COMMIT
//! returned: a caller never hears "ok" for something that is not durable.
//!
//! A batch one of whose requests appended to the outbox
//! ([`Writer::write_announcing`]) runs the [`Epilogue`], when one is set,
//! after its requests and before its COMMIT: the fused fan-out of issue 19
//! (`SqliteStore::fuse_fanout`), so a message's accept and its fan-out cost
//! one commit. It runs in a SAVEPOINT of its own; if it fails, it alone is
//! rolled back and the requests commit.
//!
//! A transaction that cannot begin or commit (a full disk, an I/O error)
//! marks the writer unhealthy until a later one commits
//! ([`Writer::health`], which `/healthz` reports). A panic inside the
//! writer thread is a broken invariant: it aborts the process (release
//! builds abort on any panic; this holds in debug builds and tests too)
//! rather than leave a store whose every write answers `UNAVAILABLE`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rusqlite::Connection;
use tidemark_store::metric_names as names;
use tidemark_store::{StoreError, StoreHealth, StoreResult, WriteFailure};
use tokio::sync::{mpsc, oneshot};

/// Most requests in one transaction.
pub const WRITE_BATCH_MAX: usize = 1024;
/// Most requests waiting for the writer; senders wait (backpressure) beyond.
pub const WRITE_QUEUE_MAX: usize = 8192;
/// How long a batch keeps taking requests that queued while its first ones
/// ran ("late joiners", which then share its commit) before it commits.
pub const LATE_JOIN_WITHIN: std::time::Duration = std::time::Duration::from_millis(5);
/// A passive WAL checkpoint runs after this many commits.
pub const CHECKPOINT_EVERY_COMMITS: u64 = 64;
/// A WAL file larger than this after a commit is checkpointed at once and
/// truncated. Commit counts alone do not bound it: one group fan-out
/// transaction writes thousands of scattered pages (~13 MB), so 512 commits
/// between checkpoints let `bench reconnect` with 3 000 devices grow the
/// WAL to 1.8 GB, and a restart after SIGKILL recovered it for seconds.
/// Under steady reads a passive checkpoint may also never get to reset the
/// log (SQLite's "checkpoint starvation"). TRUNCATE waits for the readers
/// (they are short; the busy timeout bounds the wait) and empties the file.
pub const WAL_TRUNCATE_BYTES: u64 = 64 * 1024 * 1024;
/// How long a truncating checkpoint waits for the readers before it gives
/// up for this commit (`busy`): sync pages are short, but a snapshot build
/// reads its whole view in one read transaction (D7), and the writer must
/// not stall behind it for the connection's whole busy timeout.
pub const WAL_TRUNCATE_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The writer thread's name; a panic on it aborts the process.
const WRITER_THREAD: &str = "tidemark-sqlite-writer";

/// Makes a panic on the writer thread abort the process at the panic,
/// before it unwinds: unwinding would drop the queued requests' reply
/// channels, their callers would answer `UNAVAILABLE`, and the process
/// would run on without a writer. Installed once, after the hook already
/// in place (which still prints the panic).
fn abort_on_writer_panic() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            if std::thread::current().name() == Some(WRITER_THREAD) {
                std::process::abort();
            }
        }));
    });
}

/// Completes one request once the batch's commit outcome is known.
type Completer = Box<dyn FnOnce(Option<StoreError>) + Send>;
/// What one request did inside the open transaction.
struct Ran {
    complete: Completer,
    /// It failed after changing rows it cannot undo alone: the batch must
    /// be rolled back.
    poisoned: bool,
    /// It appended to the outbox ([`Writer::write_announcing`]): the
    /// batch runs the [`Epilogue`].
    announced: bool,
}
/// One write request: runs inside the open transaction.
type Job = Box<dyn FnOnce(&Connection) -> Ran + Send>;

/// Work a batch does in its own transaction after its requests when one of
/// them announced an outbox append: the fused fan-out (issue 19,
/// `SqliteStore::fuse_fanout`). What it returns runs once the batch has
/// committed, before any request of it is answered; nothing runs if the
/// batch rolls back. It guards its own changes (a SAVEPOINT): should it
/// fail, the requests still commit.
pub type Epilogue = Box<dyn FnMut(&Connection) -> Option<AfterCommit> + Send>;
/// The part of an [`Epilogue`] that waits for the commit.
pub type AfterCommit = Box<dyn FnOnce() + Send>;
type EpilogueSlot = Arc<std::sync::Mutex<Option<Epilogue>>>;

#[derive(Debug, Default)]
pub struct WriterStats {
    pub commits: AtomicU64,
    pub writes: AtomicU64,
    pub checkpoints: AtomicU64,
    /// Rows inserted, updated or deleted by committed transactions
    /// (SQLite's `total_changes`, trigger programs included).
    pub rows: AtomicU64,
}

#[derive(Clone)]
pub struct Writer {
    jobs: mpsc::Sender<Job>,
    pub stats: Arc<WriterStats>,
    failure: Arc<WriteFailure>,
    epilogue: EpilogueSlot,
}

impl Writer {
    /// Starts the writer thread; it ends when every `Writer` clone is gone.
    pub fn start(conn: Connection) -> (Writer, std::thread::JoinHandle<()>) {
        Writer::start_joining_within(conn, LATE_JOIN_WITHIN)
    }

    /// [`Writer::start`] with another bound on late joiners than
    /// [`LATE_JOIN_WITHIN`] (tests take it out of the clock's hands).
    fn start_joining_within(conn: Connection, late_join: std::time::Duration) -> (Writer, std::thread::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel::<Job>(WRITE_QUEUE_MAX);
        let stats = Arc::new(WriterStats::default());
        let failure = Arc::new(WriteFailure::default());
        let epilogue = EpilogueSlot::default();
        let (thread_stats, thread_failure, thread_epilogue) = (stats.clone(), failure.clone(), epilogue.clone());
        abort_on_writer_panic();
        let handle = std::thread::Builder::new()
            .name(WRITER_THREAD.into())
            .spawn(move || run(conn, rx, late_join, &thread_stats, &thread_failure, &thread_epilogue))
            .expect("spawn writer thread");
        (Writer { jobs: tx, stats, failure, epilogue }, handle)
    }

    /// Sets (or, with `None`, removes) the work every batch with an
    /// announced outbox append does before its COMMIT; from the next batch
    /// on.
    pub fn set_epilogue(&self, epilogue: Option<Epilogue>) {
        *self.epilogue.lock().unwrap_or_else(|p| p.into_inner()) = epilogue;
    }

    /// Whether writes commit: the last transaction's failure, if none has
    /// committed since, or a stopped writer.
    pub fn health(&self) -> StoreHealth {
        let write_failure = match self.failure.get() {
            Some(why) => Some(why),
            None if self.jobs.is_closed() => Some("store writer stopped".into()),
            None => None,
        };
        StoreHealth { write_failure }
    }

    /// Runs `f` inside the next group-committed transaction and returns its
    /// result once that transaction is durable.
    pub async fn write<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        self.submit(move |conn| (in_savepoint(conn, f), false), false).await
    }

    /// [`Writer::write`] for a request that appends to the outbox when it
    /// succeeds (an accepted send, a conversation event): its batch runs
    /// the [`Epilogue`], if one is set, before committing.
    pub async fn write_announcing<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        self.submit(move |conn| (in_savepoint(conn, f), false), true).await
    }

    /// [`Writer::write`] without the request's SAVEPOINT (two statements
    /// fewer), for requests that fail, if at all, before their first
    /// change: they read, decide, then write. Should one fail after a
    /// change nonetheless (an I/O error between two statements), nothing
    /// of its batch commits: the batch is rolled back and every request of
    /// it answered `UNAVAILABLE`, as when a COMMIT fails.
    pub async fn write_unguarded<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        self.submit(move |conn| unguarded(conn, f), false).await
    }

    /// [`Writer::write_announcing`] without the request's SAVEPOINT, on the
    /// terms of [`Writer::write_unguarded`]: an accepted send, whose checks
    /// (fence, idempotency, membership, quote, mentions) all come before
    /// its first change (*conformance::refusals_inside_one_group_commit_roll_back_alone*).
    /// The savepoint was two statements and a copy into the statement
    /// journal of every page the send first touched (2.3% of the writer's
    /// samples in issue 19's ingest profile, 0.4% without it).
    pub async fn write_announcing_unguarded<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        self.submit(move |conn| unguarded(conn, f), true).await
    }

    /// Queues `f`; `announces`: a success of it appended to the outbox.
    async fn submit<T, F>(&self, f: F, announces: bool) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> (StoreResult<T>, bool) + Send + 'static,
    {
        let (tx, rx) = oneshot::channel::<StoreResult<T>>();
        let job: Job = Box::new(move |conn: &Connection| {
            let (result, poisoned) = f(conn);
            let announced = announces && result.is_ok();
            let complete: Completer = Box::new(move |commit_error: Option<StoreError>| {
                let _ = tx.send(match commit_error {
                    Some(e) => Err(e),
                    None => result,
                });
            });
            Ran { complete, poisoned, announced }
        });
        self.jobs.send(job).await.map_err(|_| StoreError::Unavailable("store writer stopped".into()))?;
        rx.await.map_err(|_| StoreError::Unavailable("store writer stopped".into()))?
    }
}

/// Runs `f` with no savepoint; it poisons its batch if it failed after a
/// change.
fn unguarded<T>(conn: &Connection, f: impl FnOnce(&Connection) -> StoreResult<T>) -> (StoreResult<T>, bool) {
    let before = conn.total_changes();
    let result = f(conn);
    let poisoned = result.is_err() && conn.total_changes() != before;
    (result, poisoned)
}

fn exec_cached(conn: &Connection, sql: &str) -> StoreResult<()> {
    conn.prepare_cached(sql).and_then(|mut s| s.execute([])).map(|_| ()).map_err(crate::internal)
}

/// Runs `f` in a SAVEPOINT: if it fails, its changes alone are undone.
pub(crate) fn in_savepoint<T>(conn: &Connection, f: impl FnOnce(&Connection) -> StoreResult<T>) -> StoreResult<T> {
    // Cached statements: these run twice per request on the hot path.
    exec_cached(conn, "SAVEPOINT job")?;
    let result = f(conn);
    if result.is_err() {
        exec_cached(conn, "ROLLBACK TO job")?;
    }
    exec_cached(conn, "RELEASE job")?;
    result
}

/// A passive checkpoint, and a truncating one if the WAL file is longer
/// than [`WAL_TRUNCATE_BYTES`]. Each is counted as a checkpoint (two fsyncs).
fn checkpoint(conn: &Connection, wal: &std::path::Path, stats: &WriterStats) {
    match conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
        Ok(()) => {
            stats.checkpoints.fetch_add(1, Ordering::Relaxed);
            names::CHECKPOINTS.inc();
        }
        Err(e) => tracing::warn!(error = %e, "passive checkpoint failed"),
    }
    if wal_bytes(wal) <= WAL_TRUNCATE_BYTES {
        return;
    }
    // Columns: busy (1 if readers kept it from finishing), frames, copied.
    let _ = conn.busy_timeout(WAL_TRUNCATE_WAIT);
    let truncated = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get::<_, i64>(0));
    let _ = conn.busy_timeout(crate::BUSY_TIMEOUT);
    match truncated {
        Ok(busy) => {
            stats.checkpoints.fetch_add(1, Ordering::Relaxed);
            names::CHECKPOINTS.inc();
            let done = if busy == 0 { "yes" } else { "busy" };
            names::WAL_TRUNCATIONS.add_by("done", done, 1);
        }
        Err(e) => tracing::warn!(error = %e, "truncating checkpoint failed"),
    }
}

fn wal_bytes(wal: &std::path::Path) -> u64 {
    std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0)
}

/// Moves the requests already queued into `batch` until it holds `room`.
fn take_queued(rx: &mut mpsc::Receiver<Job>, batch: &mut Vec<Job>, room: usize) {
    while batch.len() < room {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
}

fn run(
    conn: Connection,
    mut rx: mpsc::Receiver<Job>,
    late_join: std::time::Duration,
    stats: &WriterStats,
    failure: &WriteFailure,
    epilogue: &std::sync::Mutex<Option<Epilogue>>,
) {
    let wal = std::path::PathBuf::from(format!("{}-wal", conn.path().unwrap_or_default()));
    let mut since_checkpoint = 0u64;
    let mut batch: Vec<Job> = Vec::with_capacity(WRITE_BATCH_MAX);
    while let Some(first) = rx.blocking_recv() {
        batch.push(first);
        take_queued(&mut rx, &mut batch, WRITE_BATCH_MAX);
        let changes_before = conn.total_changes();
        if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
            // Nothing ran. Dropping a job drops its reply channel, so each
            // caller gets `Unavailable` and may retry; pause rather than spin.
            tracing::error!(error = %e, "store writer could not begin a transaction");
            failure.set(Some(format!("begin: {e}")));
            batch.clear();
            std::thread::sleep(std::time::Duration::from_millis(50));
            continue;
        }
        let (mut poisoned, mut announced) = (false, false);
        let mut completers: Vec<Completer> = Vec::with_capacity(batch.len());
        let mut size = 0u64;
        let began = std::time::Instant::now();
        loop {
            size += batch.len() as u64;
            completers.extend(batch.drain(..).map(|job| {
                let ran = job(&conn);
                poisoned |= ran.poisoned;
                announced |= ran.announced;
                ran.complete
            }));
            // Late joiners: requests that queued while these ran join the
            // open transaction and share its commit, rather than wait for
            // a commit of their own (fewer fsyncs per request, and they are
            // answered sooner). Bounded by the batch's size and by how long
            // its first request has been running.
            if poisoned || began.elapsed() >= late_join {
                break;
            }
            take_queued(&mut rx, &mut batch, WRITE_BATCH_MAX - size as usize);
            if batch.is_empty() {
                break;
            }
        }
        let after_commit = match announced && !poisoned {
            true => epilogue.lock().unwrap_or_else(|p| p.into_inner()).as_mut().and_then(|e| e(&conn)),
            false => None,
        };
        let commit_error = if poisoned {
            // An unguarded request failed after a change: none of the batch
            // commits (see `Writer::write_unguarded`).
            let _ = conn.execute_batch("ROLLBACK");
            tracing::error!("a request failed after writing without a savepoint; batch rolled back");
            Some(StoreError::Unavailable("a request of the batch failed after writing; retry".into()))
        } else {
            match conn.execute_batch("COMMIT") {
                Ok(()) => None,
                Err(e) => {
                    let _ = conn.execute_batch("ROLLBACK");
                    tracing::error!(error = %e, "store commit failed; batch rolled back");
                    Some(StoreError::Unavailable(format!("commit: {e}")))
                }
            }
        };
        failure.set(commit_error.as_ref().map(|e| e.to_string()));
        if let (None, Some(after)) = (&commit_error, after_commit) {
            after();
        }
        // A transaction that changed no row (the relay's poll of an empty
        // outbox) writes no WAL frame and costs no fsync: it is not counted.
        if commit_error.is_none() && conn.total_changes() != changes_before {
            stats.rows.fetch_add(conn.total_changes().saturating_sub(changes_before), Ordering::Relaxed);
            stats.commits.fetch_add(1, Ordering::Relaxed);
            stats.writes.fetch_add(size, Ordering::Relaxed);
            names::COMMITS.inc();
            names::COMMIT_BATCH_REQUESTS.record(size as f64);
            since_checkpoint += 1;
        }
        for complete in completers {
            complete(commit_error.clone());
        }
        // One stat(2) per commit: the WAL's size bounds it, not the count.
        if since_checkpoint >= CHECKPOINT_EVERY_COMMITS || wal_bytes(&wal) > WAL_TRUNCATE_BYTES {
            since_checkpoint = 0;
            checkpoint(&conn, &wal, stats);
        }
    }
    // Every sender is gone: fold the WAL back so the database file is whole.
    let _ = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child process whose writer panics.
    const CHILD_ENV: &str = "TIDEMARK_TEST_WRITER_PANIC_CHILD";
    /// SIGABRT on Linux and the BSDs, what `std::process::abort` raises.
    const SIGABRT: i32 = 6;

    /// Requests that queue while a batch runs join it and share its commit
    /// (late joiners), within the bound; with a zero bound they wait for
    /// the next commit.
    #[test]
    fn requests_queued_while_a_batch_runs_join_its_commit_within_the_bound() {
        for (bound, commits) in [(std::time::Duration::from_secs(3600), 1), (std::time::Duration::ZERO, 2)] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("db");
            Connection::open(&path).unwrap().execute_batch("CREATE TABLE t (k TEXT PRIMARY KEY)").unwrap();
            let (writer, _thread) = Writer::start_joining_within(Connection::open(&path).unwrap(), bound);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            fn insert(k: &'static str) -> impl FnOnce(&Connection) -> StoreResult<()> + Send + 'static {
                move |c: &Connection| {
                    c.execute("INSERT INTO t (k) VALUES (?1)", [k]).map(|_| ()).map_err(crate::internal)
                }
            }
            // The first request holds its batch open until two more are
            // queued behind it.
            let (started, running) = std::sync::mpsc::channel::<()>();
            let (open, wait) = std::sync::mpsc::channel::<()>();
            let first = rt.spawn({
                let writer = writer.clone();
                async move {
                    writer
                        .write(move |c| {
                            started.send(()).unwrap();
                            wait.recv().unwrap();
                            insert("a")(c)
                        })
                        .await
                }
            });
            let queued = |w: &Writer| WRITE_QUEUE_MAX - w.jobs.capacity();
            let (b, c, ()) = rt.block_on(async {
                // On the current-thread runtime `first` runs once this
                // awaits; the writer thread then starts its batch.
                tokio::task::yield_now().await;
                running.recv_timeout(std::time::Duration::from_secs(60)).expect("the first request runs");
                tokio::join!(writer.write(insert("b")), writer.write(insert("c")), async {
                    while queued(&writer) < 2 {
                        tokio::task::yield_now().await;
                    }
                    open.send(()).unwrap();
                })
            });
            rt.block_on(first).unwrap().unwrap();
            assert!(b.is_ok() && c.is_ok(), "{b:?} {c:?}");
            assert_eq!(writer.stats.commits.load(Ordering::Relaxed), commits, "bound {bound:?}");
            assert_eq!(writer.stats.writes.load(Ordering::Relaxed), 3);
        }
    }

    /// An unguarded request (no savepoint) that fails before any change
    /// leaves its batch to commit; one that fails after a change takes the
    /// whole batch down with it, so no partial request ever commits.
    #[test]
    fn an_unguarded_request_failing_after_a_change_rolls_its_batch_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let setup = Connection::open(&path).unwrap();
        setup.execute_batch("CREATE TABLE t (k TEXT PRIMARY KEY)").unwrap();
        drop(setup);
        let (writer, _thread) = Writer::start(Connection::open(&path).unwrap());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        fn insert(k: &'static str) -> impl FnOnce(&Connection) -> StoreResult<()> + Send + 'static {
            move |c: &Connection| c.execute("INSERT INTO t (k) VALUES (?1)", [k]).map(|_| ()).map_err(crate::internal)
        }
        // A job that holds the writer until the others are queued behind
        // it, so those land in one batch.
        let gate = || {
            let (open, wait) = std::sync::mpsc::channel::<()>();
            let hold = writer.write(move |_| -> StoreResult<()> {
                let _ = wait.recv();
                Ok(())
            });
            (hold, async move { open.send(()).unwrap() })
        };
        let (hold, release) = gate();
        let (_, kept, refused, other, ()) = rt.block_on(async {
            tokio::join!(
                hold,
                writer.write(insert("a")),
                writer
                    .write_unguarded(|_| -> StoreResult<()> { Err(StoreError::NotFound("before any change".into())) }),
                writer.write_unguarded(insert("b")),
                release,
            )
        });
        assert!(kept.is_ok() && other.is_ok(), "{kept:?} {other:?}");
        assert!(matches!(refused, Err(StoreError::NotFound(_))));
        let (hold, release) = gate();
        let (_, guarded, poisoned, ()) = rt.block_on(async {
            tokio::join!(
                hold,
                writer.write(insert("c")),
                writer.write_unguarded(|c: &Connection| -> StoreResult<()> {
                    insert("d")(c)?;
                    Err(StoreError::Internal("after a change".into()))
                }),
                release,
            )
        });
        assert!(matches!(guarded, Err(StoreError::Unavailable(_))), "the whole batch is refused: {guarded:?}");
        assert!(matches!(poisoned, Err(StoreError::Unavailable(_))), "{poisoned:?}");
        let check = Connection::open(&path).unwrap();
        let mut stmt = check.prepare("SELECT k FROM t ORDER BY k").unwrap();
        let keys: Vec<String> = stmt.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect();
        assert_eq!(keys, vec!["a", "b"], "nothing of the poisoned batch committed");
        // The writer goes on.
        rt.block_on(writer.write_unguarded(insert("e"))).unwrap();
    }

    /// A panic inside a write request must end the process, not just the
    /// writer thread (after which every write would answer `UNAVAILABLE`).
    /// The test runs itself again as a child that panics its writer, and
    /// checks the child died of `abort`.
    #[test]
    fn a_panic_in_the_writer_aborts_the_process() {
        if std::env::var_os(CHILD_ENV).is_some() {
            let dir = tempfile::tempdir().unwrap();
            let (writer, _thread) = Writer::start(Connection::open(dir.path().join("db")).unwrap());
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let after = rt.block_on(async {
                let _ = writer.write(|_| -> StoreResult<()> { panic!("injected writer panic") }).await;
                writer.write(|_| Ok(())).await
            });
            // Reached only if the process outlived the writer's panic.
            println!("the writer's panic did not abort: next write {after:?}");
            std::process::exit(0);
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "writer::tests::a_panic_in_the_writer_aborts_the_process", "--nocapture"])
            .env(CHILD_ENV, "1")
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(SIGABRT),
            "child ended with {:?}; stdout: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("injected writer panic"));
    }
}
