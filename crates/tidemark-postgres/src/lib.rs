//! The PostgreSQL backend of [`tidemark_store::Store`] (X2): the same
//! operations, the same errors and the same invariants as the embedded SQLite
//! backend, on a database that several server nodes can share.
//!
//! # Layout
//!
//! - [`writer`]: one task owns the store's read-write connection and
//!   group-commits every write: the requests queued while the previous
//!   transaction committed run in one `READ COMMITTED` transaction, each in
//!   its own SAVEPOINT, and are answered only after COMMIT (one WAL flush
//!   per batch). A second writer, on its own connection, runs the user
//!   side: the relay's fan-out (`fan_out_next`, `fan_out`) and the writes
//!   that lock a user's head first, so sends never queue behind fan-out;
//!   the writers are several writers on one database, as nodes are.
//!   [`Store::stats`] counts commits and the requests they carried (both
//!   writers); PostgreSQL checkpoints on its own, so `checkpoints` is 0.
//! - `read`: a pool of connections for reads. Multi-statement reads
//!   (`conv.sync`, `history`, user-log pages, a conversation and its
//!   members) run in one `REPEATABLE READ READ ONLY` transaction, i.e. one
//!   snapshot; single-statement reads run alone.
//! - `events`, `fanout` and `lifecycle` (recovery sessions, ACKs,
//!   snapshots, retention): the write transactions, deciding through the
//!   same `tidemark-core` rules as the SQLite backend; [`schema`]: tables
//!   and key layout; `db`: statement helpers and error mapping.
//!
//! # Sequences and locks
//!
//! Requests of one writer never contend with each other, and the SQL is
//! written to stay correct with several writers on one database (the
//! store's conversation writers and its fan-out writer, and several nodes),
//! because every sequence is assigned under a row lock held
//! until COMMIT:
//!
//! - `msg_seq`: `UPDATE conversations SET head = head + 1 ... RETURNING head`.
//!   A second writer blocks on the row until the first commits, so `n+1` is
//!   never visible before `n` (S2). Every conversation event locks the
//!   conversation row *before* checking membership, rights or versions, so
//!   its checks see every change committed before it (G1, E2).
//! - `sync_seq`: `user_heads.high_watermark + 1 RETURNING`, same pattern
//!   (F2); fan-out idempotency is `UNIQUE (user_id, source_event_id,
//!   period_id)` (F3).
//! - device cursors: `SELECT ... FOR UPDATE`, then `decide_ack` or the CAS
//!   comparison, then the write, all in the writer's transaction (D4, D5).
//!   An ACK does all of it in one statement, `tidemark_ack` (schema step
//!   15, the table of `decide_ack_with` in PL/pgSQL, cross-checked against
//!   core by `lifecycle::decide_ack_row`), pipelined like a send.
//! - read cursors: a `read` locks the user's head, moves `read_seq` where
//!   `projection::read_target` says, recounts and appends its `read` event
//!   in one statement, `tidemark_read` (schema step 16, cross-checked
//!   against core and the proto by `events::decide_read_row`), pipelined
//!   on the user writer; a shared large group's read runs as
//!   `events::mark_read`, statement by statement.
//! - connection epochs (P2): a frame of a WebSocket connection carries its
//!   epoch; the send (`tidemark_send_on`), the ACK (with its `FOR UPDATE`
//!   of the device) and the read (with its `user_convs` read) compare it
//!   with `devices.connection_epoch` in a statement they run anyway and
//!   refuse an older one (`StoreError::Superseded`) before writing. The
//!   send reads the device row without a lock: a send that saw the older
//!   epoch is ordered before the newer connection's commit.
//!
//! Lock order inside one request:
//!
//! 1. conversation side: the conversation row, then that conversation's
//!    rows (`membership_periods`, `messages`, `reactions`, `outbox`); a
//!    conversation event touches user data only through
//!    `user_convs (target, conv)` on a membership change, never a user head;
//! 2. user side: user head rows in `user_id` order (fan-out locks all of its
//!    recipients' heads up front; read, settings, delete-for-me, recovery
//!    and snapshot start lock their user's head first; retention visits
//!    users in `user_id` order), then that user's device row, then the
//!    user's other rows (`user_events`, `user_convs`, `user_deleted`,
//!    `recovery_sessions`, `snapshots`, `fanout_quarantine`). An ACK or a
//!    cursor CAS locks only the device row (`FOR UPDATE`); installing a
//!    snapshot locks the snapshot row, then the device row. Retention
//!    expires stale snapshots before it visits the heads: no request waits
//!    for an existing snapshot row while holding a head.
//!
//! The relay's claim (`fanout::claim`, in [`Store::fan_out_next`]) takes its
//! outbox rows `FOR UPDATE SKIP LOCKED` and a per-conversation advisory lock
//! with `pg_try_advisory_xact_lock`: it never waits, so it adds no edge to
//! a lock cycle; both locks last until the claim's COMMIT or rollback.
//!
//! Fan-out reads the conversation side without locks (the periods covering
//! a committed `msg_seq` never change) and deletes its outbox rows last; a
//! batch costs a fixed number of round trips whatever its size (arrays with
//! `unnest`, its deliveries and recounts pipelined; `fanout`).
//!
//! A batch holds the locks of all of its requests until its COMMIT, so the
//! writer runs a batch in lock order (`writer::order_batch`): the
//! conversation events first, by `conv_id` (byte order, the same on every
//! node; a conversation's own requests in queue order), then the requests
//! that lock no conversation row. Two batches therefore take conversation
//! rows in one global order and cannot wait on each other in a cycle over
//! them, however many writers and nodes send to the same conversations
//! (*conformance::batches_naming_the_same_conversations_in_opposite_orders_never_deadlock*).
//! Cycles over user-side rows (two fan-outs, a read and a fan-out, a
//! membership change's `user_convs` row) are still possible; PostgreSQL's
//! deadlock detector then aborts one statement, whose request alone rolls
//! back to its savepoint, while the rest of its batch commits; the writer
//! runs that request again in a later transaction, up to
//! [`writer::WRITE_ATTEMPTS_MAX`] runs, before answering `Unavailable`
//! (retryable). [`PgStore::conflict_retries`] counts the runs again.
//!
//! # Bounds
//!
//! [`writer::WRITE_QUEUE_MAX`], [`writer::WRITE_BATCH_MAX`],
//! [`READ_CONNECTIONS_MAX`], [`PRESENCE_READ_CONNECTIONS_MAX`], [`POOL_WAIT_TIMEOUT_MS`],
//! [`CONNECT_TIMEOUT_MS`], [`STATEMENT_TIMEOUT_MS`] and
//! [`IDLE_IN_TRANSACTION_TIMEOUT_MS`]; the last two are set on every
//! connection, so a stuck statement or a leaked transaction cannot hold
//! locks forever.
//!
//! This crate knows no wire format and no server; it takes no TLS (connect
//! over a trusted network or a local socket).

mod db;
mod events;
mod fanout;
mod lifecycle;
mod push;
mod read;
mod receipts;
mod reconcile;
pub mod schema;
pub mod writer;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tidemark_core::cursor::{decide_cas, CasDecision, DeviceCursor, DeviceState, RecoveryInfo, UserLog};
use tidemark_core::page::{PageQuery, SyncFacts};
use tidemark_core::SyncSeq;
use tidemark_store::*;

use db::{big, col, exec, query, query_opt, scalar, seq, seq_opt, Conn};
use read::ReadPool;
use writer::Writer;

/// Default number of conversation writers per store. One: with two per
/// store (measured while head-locking writes still shared the first
/// writer), two stores hammering the same rows deadlocked about twice as
/// often (41 against 20 re-runs in
/// `two_writers_hammering_the_same_rows_retry_deadlocks`) and one request
/// used up its [`writer::WRITE_ATTEMPTS_MAX`] runs, and `bench ingest`
/// showed no gain on 2 cores (docs/benchmarks.md); not measured again
/// since those writes moved to the user-side writer.
pub const CONV_WRITERS_DEFAULT: usize = 1;
/// Most conversation writers per store.
pub const CONV_WRITERS_MAX: usize = 16;
/// Default number of read connections per store.
pub const READ_CONNECTIONS_MAX: usize = 8;
/// Default number of presence's own read connections per store: the
/// privacy switches and audience a presence announcement reads
/// (`Store::privacy`, `presence_audience`, `presence_facts`) wait among
/// these and never take the read pool's, so a storm of announcements
/// (every device of a resume storm announces itself) cannot hold up the
/// sync, history and cursor reads the devices catch up with.
pub const PRESENCE_READ_CONNECTIONS_MAX: usize = 2;
/// Longest wait for a pooled connection before a request fails `Unavailable`.
pub const POOL_WAIT_TIMEOUT_MS: u64 = 5_000;
/// Longest wait for a new connection to the server.
pub const CONNECT_TIMEOUT_MS: u64 = 5_000;
/// Longest run of one statement, lock waits included (`statement_timeout`).
pub const STATEMENT_TIMEOUT_MS: u64 = 30_000;
/// Longest idle time inside an open transaction before the server ends the
/// session (`idle_in_transaction_session_timeout`).
pub const IDLE_IN_TRANSACTION_TIMEOUT_MS: u64 = 30_000;

/// How to reach the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgConfig {
    /// A libpq-style URL or key-value string, e.g.
    /// `postgres://user@127.0.0.1:5432/tidemark` (`application_name`
    /// defaults to `tidemark`).
    pub url: String,
    /// The PostgreSQL schema (namespace) holding the tables, created if
    /// absent and put first on every connection's `search_path`; `None`
    /// uses the server's default `search_path` (normally `public`). Plain
    /// lower-case identifiers only (see [`schema::valid_schema_name`]).
    pub schema: Option<String>,
    /// Read connections in the pool.
    pub read_connections_max: usize,
    /// Read connections of presence's own pool
    /// ([`PRESENCE_READ_CONNECTIONS_MAX`]).
    pub presence_read_connections_max: usize,
    /// Writer connections for conversation events, each owning a hash
    /// partition of the conversations (1..=[`CONV_WRITERS_MAX`]).
    pub conv_writers: usize,
}

impl PgConfig {
    pub fn new(url: impl Into<String>) -> PgConfig {
        PgConfig {
            url: url.into(),
            schema: None,
            read_connections_max: READ_CONNECTIONS_MAX,
            presence_read_connections_max: PRESENCE_READ_CONNECTIONS_MAX,
            conv_writers: CONV_WRITERS_DEFAULT,
        }
    }
}

pub struct PgStore {
    /// `GroupPolicy::large_members`, set by [`Store::set_group_policy`].
    large_members: std::sync::atomic::AtomicU64,
    /// The conversation writers, [`PgConfig::conv_writers`] of them: a
    /// conversation's events always go to `writers[conv_partition(conv)]`
    /// (one writer per conversation, so its sends keep their queue order);
    /// `writers[0]` also takes every other write (user side, accounts).
    /// Between writers the row locks keep sequences contiguous, as between
    /// nodes.
    writers: Vec<Writer>,
    /// The user-side writer: fan-out (`fan_out_next`, `fan_out`) and every
    /// write that locks a user's head first (read, settings,
    /// delete-for-me, recovery, snapshot start, retention, unread rebuild)
    /// commit on this connection, so a send never queues behind a fan-out
    /// transaction of many statements, and head locks of one store are
    /// taken by one writer (no lock cycle between this store's writers over
    /// heads). Its SQL is the one several nodes already run side by side
    /// (claims `SKIP LOCKED`, heads locked in `user_id` order, lock
    /// conflicts retried).
    user_writer: Writer,
    readers: ReadPool,
    /// Presence's reads ([`PRESENCE_READ_CONNECTIONS_MAX`]).
    presence_readers: ReadPool,
    schema: Option<String>,
    /// The writer tasks end once their `Writer` (each queue's only sender)
    /// is dropped with the store, after answering what was queued.
    writer_task: Mutex<Option<Vec<tokio::task::JoinHandle<()>>>>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").field("schema", &self.schema).finish()
    }
}

fn pool(pg: tokio_postgres::Config, size: usize) -> StoreResult<Pool> {
    let manager =
        Manager::from_config(pg, tokio_postgres::NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
    let wait = Some(Duration::from_millis(POOL_WAIT_TIMEOUT_MS));
    Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(wait)
        .create_timeout(Some(Duration::from_millis(CONNECT_TIMEOUT_MS)))
        .recycle_timeout(wait)
        .build()
        .map_err(|e| StoreError::Internal(format!("postgres pool: {e}")))
}

impl PgStore {
    fn group_policy(&self) -> GroupPolicy {
        GroupPolicy { large_members: self.large_members.load(std::sync::atomic::Ordering::Relaxed) }
    }

    /// Connects, applies the schema migrations this database lacks
    /// (`schema::migrate`; a database migrated by a newer build is refused
    /// with [`StoreError::SchemaTooNew`]) and starts the writer task. Must be called inside a Tokio runtime.
    pub async fn open(config: PgConfig) -> StoreResult<Arc<PgStore>> {
        if let Some(ns) = &config.schema {
            if !schema::valid_schema_name(ns) {
                return Err(StoreError::Invalid(format!("schema name {ns:?} is not a plain lower-case identifier")));
            }
        }
        if !(1..=CONV_WRITERS_MAX).contains(&config.conv_writers) {
            return Err(StoreError::Invalid(format!("conv_writers must be 1..={CONV_WRITERS_MAX}")));
        }
        if config.read_connections_max == 0 || config.presence_read_connections_max == 0 {
            return Err(StoreError::Invalid(
                "read_connections_max and presence_read_connections_max must be at least 1".into(),
            ));
        }
        let mut pg: tokio_postgres::Config =
            config.url.parse().map_err(|e| StoreError::Invalid(format!("postgres url: {e}")))?;
        let mut options = pg.get_options().map(|o| format!("{o} ")).unwrap_or_default();
        if let Some(ns) = &config.schema {
            options.push_str(&format!("-c search_path={ns} "));
        }
        options.push_str(&format!(
            "-c statement_timeout={STATEMENT_TIMEOUT_MS} -c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT_MS}"
        ));
        pg.options(options);
        if pg.get_application_name().is_none() {
            pg.application_name("tidemark");
        }
        pg.connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS));

        // The writer's pool holds its one connection; the schema is migrated
        // on it before the writer starts.
        let writer_pool = pool(pg.clone(), 1)?;
        {
            let conn = writer_pool.get().await.map_err(db::pool_error)?;
            schema::migrate(&conn, config.schema.as_deref()).await?;
        }
        let fanout_pool = pool(pg.clone(), 1)?;
        let mut writers = Vec::with_capacity(config.conv_writers);
        let mut tasks = Vec::with_capacity(config.conv_writers + 1);
        let (writer, task) = Writer::start(writer_pool, "conv");
        writers.push(writer);
        tasks.push(task);
        for _ in 1..config.conv_writers {
            let (writer, task) = Writer::start(pool(pg.clone(), 1)?, "conv");
            writers.push(writer);
            tasks.push(task);
        }
        let presence_readers = ReadPool { pool: pool(pg.clone(), config.presence_read_connections_max)? };
        let readers = ReadPool { pool: pool(pg, config.read_connections_max)? };
        let (user_writer, fanout_task) = Writer::start(fanout_pool, "user");
        tasks.push(fanout_task);
        Ok(Arc::new(PgStore {
            large_members: std::sync::atomic::AtomicU64::new(GroupPolicy::default().large_members),
            writers,
            user_writer,
            readers,
            presence_readers,
            schema: config.schema,
            writer_task: Mutex::new(Some(tasks)),
        }))
    }

    /// Requests this store's writer ran again after a deadlock or a
    /// serialisation failure, and requests that failed so on their last
    /// allowed run (answered `Unavailable`).
    pub fn conflict_retries(&self) -> (u64, u64) {
        let sum = |f: fn(&writer::WriterStats) -> u64| self.all_writers().map(|w| f(&w.stats)).sum::<u64>();
        (sum(|s| s.conflict_retries.load(Ordering::Relaxed)), sum(|s| s.conflict_give_ups.load(Ordering::Relaxed)))
    }

    /// The writer of user-side and other writes (and of conversation
    /// partition 0).
    fn writer(&self) -> &Writer {
        &self.writers[0]
    }

    /// The writer that owns `conv` (a stable hash of its id).
    fn conv_writer(&self, conv: &str) -> &Writer {
        &self.writers[conv_partition(conv, self.writers.len())]
    }

    fn all_writers(&self) -> impl Iterator<Item = &Writer> {
        self.writers.iter().chain(std::iter::once(&self.user_writer))
    }

    /// The PostgreSQL schema holding this store's tables, if one was named.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        // Nothing to await here: the writer task ends on its own once the
        // queue closes, right after this (see `writer_task`).
        let _ = self.writer_task.lock().map(|mut h| h.take());
    }
}

pub(crate) fn cursor_from_row(generation: i64, acked: i64, state: &str) -> StoreResult<DeviceCursor> {
    let state = DeviceState::parse(state).ok_or_else(|| StoreError::Internal(format!("bad device state {state}")))?;
    Ok(DeviceCursor { generation: generation as u64, acked_sync_seq: acked as u64, state })
}

const DEVICE_SQL: &str =
    "SELECT name, sync_generation, acked_sync_seq, state FROM devices WHERE user_id = $1 AND device_id = $2";
pub(crate) const DEVICE_FOR_UPDATE_SQL: &str = "SELECT name, sync_generation, acked_sync_seq, state FROM devices
     WHERE user_id = $1 AND device_id = $2 FOR UPDATE";

/// Reads a device; `sql` is [`DEVICE_SQL`] or, inside the writer, the
/// locking [`DEVICE_FOR_UPDATE_SQL`].
pub(crate) async fn read_device(c: &Conn, sql: &str, user: &str, device: &str) -> StoreResult<Option<DeviceRecord>> {
    let Some(r) = query_opt(c, sql, &[&user, &device]).await? else { return Ok(None) };
    let state: String = col(&r, 3)?;
    Ok(Some(DeviceRecord {
        user: user.into(),
        device: device.into(),
        name: col(&r, 0)?,
        cursor: cursor_from_row(col(&r, 1)?, col(&r, 2)?, &state)?,
    }))
}

pub(crate) async fn write_cursor(
    c: &Conn,
    user: &str,
    device: &str,
    cur: DeviceCursor,
    now_ms: i64,
) -> StoreResult<()> {
    let n = exec(
        c,
        "UPDATE devices SET sync_generation = $3, acked_sync_seq = $4, state = $5,
                row_version = row_version + 1, updated_at = $6
         WHERE user_id = $1 AND device_id = $2",
        &[&user, &device, &big(cur.generation), &big(cur.acked_sync_seq), &cur.state.as_str(), &now_ms],
    )
    .await?;
    if n != 1 {
        return Err(StoreError::NotFound(format!("device {device}")));
    }
    Ok(())
}

async fn create_direct_tx(
    c: &Conn,
    a: &str,
    b: &str,
    conv_id: &str,
    key: &str,
    now_ms: i64,
) -> StoreResult<(String, bool)> {
    let existing = "SELECT conv_id FROM conversations WHERE direct_key = $1";
    if let Some(found) = scalar::<String>(c, existing, &[&key]).await? {
        return Ok((found, false));
    }
    let pair = [a.to_owned(), b.to_owned()];
    tidemark_core::membership::all_known(&pair, &events::known_users(c, &pair).await?)?;
    // Another writer may create the same pair meanwhile: the insert then
    // waits for it and yields to its row instead of failing.
    let created = exec(
        c,
        "INSERT INTO conversations (conv_id, kind, direct_key, head, epoch, owner, created_at, active_members)
         VALUES ($1, $2, $3, 0, 1, NULL, $4, 2) ON CONFLICT (direct_key) DO NOTHING",
        &[&conv_id, &CONV_DIRECT, &key, &now_ms],
    )
    .await?;
    if created == 0 {
        let found = scalar::<String>(c, existing, &[&key]).await?;
        return found.map(|f| (f, false)).ok_or_else(|| StoreError::Internal("direct conversation vanished".into()));
    }
    for u in [a, b] {
        // Both members see the conversation from its first message.
        exec(
            c,
            "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES ($1, $2, 1, NULL)",
            &[&conv_id, &u],
        )
        .await?;
        exec(c, "INSERT INTO user_convs (user_id, conv_id) VALUES ($1, $2) ON CONFLICT DO NOTHING", &[&u, &conv_id])
            .await?;
    }
    Ok((conv_id.to_owned(), true))
}

/// 32 bytes from the operating system's generator.
fn rand_secret() -> StoreResult<[u8; 32]> {
    use rand::TryRngCore;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.try_fill_bytes(&mut bytes).map_err(|e| StoreError::Unavailable(format!("os rng: {e}")))?;
    Ok(bytes)
}

#[async_trait]
impl Store for PgStore {
    async fn server_secret(&self) -> StoreResult<Vec<u8>> {
        const SECRET_SQL: &str = "SELECT value FROM meta WHERE key = 'token_secret'";
        if let Some(secret) = self.readers.read(|c| Box::pin(scalar::<Vec<u8>>(c, SECRET_SQL, &[]))).await? {
            return Ok(secret);
        }
        let fresh = rand_secret()?.to_vec();
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    // The first node to commit wins; every node reads its value.
                    exec(
                        c,
                        "INSERT INTO meta (key, value) VALUES ('token_secret', $1) ON CONFLICT (key) DO NOTHING",
                        &[&fresh],
                    )
                    .await?;
                    scalar::<Vec<u8>>(c, SECRET_SQL, &[])
                        .await?
                        .ok_or_else(|| StoreError::Internal("token secret vanished".into()))
                })
            })
            .await
    }

    async fn create_user(&self, user: &str, password_hash: &str, now_ms: i64) -> StoreResult<bool> {
        let (user, hash) = (user.to_owned(), password_hash.to_owned());
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    let n = exec(
                        c,
                        "INSERT INTO users (user_id, password_hash, created_at) VALUES ($1, $2, $3)
                         ON CONFLICT (user_id) DO NOTHING",
                        &[&user, &hash, &now_ms],
                    )
                    .await?;
                    Ok(n == 1)
                })
            })
            .await
    }

    async fn password_hash(&self, user: &str) -> StoreResult<Option<String>> {
        let user = user.to_owned();
        self.readers
            .read(move |c| {
                Box::pin(async move {
                    scalar(c, "SELECT password_hash FROM users WHERE user_id = $1 AND deactivated_at IS NULL", &[&user])
                        .await
                })
            })
            .await
    }

    async fn login_device(&self, user: &str, device: &str, name: &str, now_ms: i64) -> StoreResult<DeviceRecord> {
        let (user, device, name) = (user.to_owned(), device.to_owned(), name.to_owned());
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    exec(
                        c,
                        "INSERT INTO devices (user_id, device_id, name, sync_generation, acked_sync_seq, state, row_version,
                                              created_at, updated_at)
                         VALUES ($1, $2, $3, 1, 0, 'NEW', 1, $4, $4)
                         ON CONFLICT (user_id, device_id) DO UPDATE SET name = EXCLUDED.name, updated_at = EXCLUDED.updated_at",
                        &[&user, &device, &name, &now_ms],
                    )
                    .await?;
                    read_device(c, DEVICE_SQL, &user, &device)
                        .await?
                        .ok_or_else(|| StoreError::Internal("device vanished".into()))
                })
            })
            .await
    }

    async fn device(&self, user: &str, device: &str) -> StoreResult<Option<DeviceRecord>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers.read(move |c| Box::pin(async move { read_device(c, DEVICE_SQL, &user, &device).await })).await
    }

    async fn revoke_device(&self, user: &str, device: &str, now_ms: i64) -> StoreResult<bool> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    let Some(rec) = read_device(c, DEVICE_FOR_UPDATE_SQL, &user, &device).await? else {
                        return Err(StoreError::NotFound(format!("device {device}")));
                    };
                    exec(c, "DELETE FROM refresh_tokens WHERE user_id = $1 AND device_id = $2", &[&user, &device])
                        .await?;
                    exec(c, "DELETE FROM push_targets WHERE user_id = $1 AND device_id = $2", &[&user, &device])
                        .await?;
                    let Some(revoked) = tidemark_core::cursor::revoked(rec.cursor) else { return Ok(false) };
                    write_cursor(c, &user, &device, revoked, now_ms).await?;
                    bump_fences_version(c).await?;
                    Ok(true)
                })
            })
            .await
    }

    async fn revoked_devices(&self) -> StoreResult<Vec<(String, String)>> {
        self.readers
            .read(|c| {
                Box::pin(async move {
                    let rows = query(
                        c,
                        "SELECT user_id, device_id FROM devices WHERE state = 'REVOKED' ORDER BY user_id, device_id",
                        &[],
                    )
                    .await?;
                    rows.iter().map(|r| Ok((col(r, 0)?, col(r, 1)?))).collect()
                })
            })
            .await
    }

    async fn put_refresh_token(&self, token_hash: &str, rec: &RefreshRecord, now_ms: i64) -> StoreResult<()> {
        let (hash, rec) = (token_hash.to_owned(), rec.clone());
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    exec(
                        c,
                        "DELETE FROM refresh_tokens WHERE user_id = $1 AND device_id = $2 AND expires_at <= $3",
                        &[&rec.user, &rec.device, &now_ms],
                    )
                    .await?;
                    exec(
                        c,
                        "INSERT INTO refresh_tokens (token_hash, user_id, device_id, expires_at, family) \
                         VALUES ($1, $2, $3, $4, $5)",
                        &[&hash, &rec.user, &rec.device, &rec.expires_at_ms, &rec.family],
                    )
                    .await?;
                    Ok(())
                })
            })
            .await
    }

    async fn create_direct(&self, a: &str, b: &str, conv_id: &str, now_ms: i64) -> StoreResult<(String, bool)> {
        tidemark_core::membership::check_direct(a, b)?;
        let (a, b, conv_id) = (a.to_owned(), b.to_owned(), conv_id.to_owned());
        let key = tidemark_core::ids::direct_key(&a, &b);
        self.writer()
            .write(move |c| Box::pin(async move { create_direct_tx(c, &a, &b, &conv_id, &key, now_ms).await }))
            .await
    }

    async fn conversation(&self, conv: &str) -> StoreResult<Option<Conversation>> {
        let conv = conv.to_owned();
        self.readers.snapshot(move |c| Box::pin(async move { read::conversation(c, &conv).await })).await
    }

    async fn list_conversations(&self, user: &str, device: Option<&str>) -> StoreResult<Vec<ConvState>> {
        let (user, device) = (user.to_owned(), device.map(str::to_owned));
        self.readers
            .snapshot(move |c| Box::pin(async move { read::list_conversations(c, &user, device.as_deref()).await }))
            .await
    }

    async fn conversations_after(
        &self,
        user: &str,
        device: Option<&str>,
        after: &str,
        limit: u32,
    ) -> StoreResult<Vec<ConvState>> {
        let (user, device, after) = (user.to_owned(), device.map(str::to_owned), after.to_owned());
        self.readers
            .snapshot(move |c| {
                Box::pin(async move {
                    read::conv_rows(c, &user, device.as_deref(), read::Rows::Page { after: &after, limit }).await
                })
            })
            .await
    }

    async fn create_group(&self, cmd: ConvEventCmd, members: Vec<String>) -> StoreResult<(String, u64)> {
        let policy = self.group_policy();
        self.conv_writer(&cmd.conv)
            .write_conv(cmd.conv.clone(), move |c| {
                Box::pin(async move { events::create_group(c, &cmd, &members, policy).await })
            })
            .await
    }

    async fn change_membership(&self, cmd: ConvEventCmd, target: &str, change: MembershipChange) -> StoreResult<u64> {
        let (target, policy) = (target.to_owned(), self.group_policy());
        self.conv_writer(&cmd.conv)
            .write_conv(cmd.conv.clone(), move |c| {
                Box::pin(async move { events::change_membership(c, &cmd, &target, change, policy).await })
            })
            .await
    }

    async fn bump_epoch(&self, conv: &str) -> StoreResult<u64> {
        let conv = conv.to_owned();
        self.conv_writer(&conv)
            .write_conv(conv.clone(), move |c| {
                Box::pin(async move {
                    let row = query_opt(
                        c,
                        "UPDATE conversations SET epoch = epoch + 1 WHERE conv_id = $1 RETURNING epoch",
                        &[&conv],
                    )
                    .await?;
                    match row {
                        Some(r) => seq(&r, 0),
                        None => Err(StoreError::NotFound(format!("conversation {conv}"))),
                    }
                })
            })
            .await
    }

    async fn recall(&self, cmd: ConvEventCmd, message_id: &str) -> StoreResult<ControlOutcome> {
        let id = message_id.to_owned();
        self.conv_writer(&cmd.conv)
            .write_conv(cmd.conv.clone(), move |c| Box::pin(async move { events::recall(c, &cmd, &id).await }))
            .await
    }

    async fn edit(
        &self,
        cmd: ConvEventCmd,
        message_id: &str,
        content: &str,
        base_version: u64,
    ) -> StoreResult<ControlOutcome> {
        let (id, content) = (message_id.to_owned(), content.to_owned());
        self.conv_writer(&cmd.conv)
            .write_conv(cmd.conv.clone(), move |c| {
                Box::pin(async move { events::edit(c, &cmd, &id, &content, base_version).await })
            })
            .await
    }

    async fn react(
        &self,
        cmd: ConvEventCmd,
        message_id: &str,
        reaction: &str,
        add: bool,
    ) -> StoreResult<ControlOutcome> {
        let (id, reaction) = (message_id.to_owned(), reaction.to_owned());
        self.conv_writer(&cmd.conv)
            .write_conv(cmd.conv.clone(), move |c| {
                Box::pin(async move { events::react(c, &cmd, &id, &reaction, add).await })
            })
            .await
    }

    async fn mark_read_on(
        &self,
        user: &str,
        conv: &str,
        read_to_seq: u64,
        on: Option<(&str, u64)>,
        now_ms: i64,
    ) -> StoreResult<ReadOutcome> {
        let cmd = events::ReadCmd {
            user: user.to_owned(),
            conv: conv.to_owned(),
            read_to_seq,
            on: on.map(|(d, e)| (d.to_owned(), e)),
            now_ms,
        };
        let params = events::read_params(&cmd);
        let cmd = Arc::new(cmd);
        // One statement, pipelined with the other one-statement requests of
        // the user writer's group commit; it locks no conversation row.
        let decide = {
            let cmd = cmd.clone();
            move |rows: &[tokio_postgres::Row]| events::decide_read_row(&cmd, rows)
        };
        match self.user_writer.write_statement(None, events::READ_SQL, params, decide).await? {
            events::ReadRow::Done(outcome) => Ok(outcome),
            // A shared large group: the read of several statements, whose
            // unread above the switch follows core's marker rules.
            events::ReadRow::Shared => {
                self.user_writer
                    .write(move |c| {
                        Box::pin(async move {
                            let on = cmd.on.as_ref().map(|(d, e)| (d.as_str(), *e));
                            events::mark_read(c, &cmd.user, &cmd.conv, cmd.read_to_seq, on, cmd.now_ms).await
                        })
                    })
                    .await
            }
        }
    }

    async fn update_settings(
        &self,
        user: &str,
        conv: &str,
        update: SettingsUpdate,
        now_ms: i64,
    ) -> StoreResult<(ConvState, UserEventOutcome)> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.user_writer
            .write(move |c| Box::pin(async move { events::update_settings(c, &user, &conv, update, now_ms).await }))
            .await
    }

    async fn delete_for_me(
        &self,
        user: &str,
        conv: &str,
        message_id: &str,
        now_ms: i64,
    ) -> StoreResult<UserEventOutcome> {
        let (user, conv, id) = (user.to_owned(), conv.to_owned(), message_id.to_owned());
        let written = self
            .writer()
            .write(move |c| Box::pin(async move { events::delete_for_me(c, &user, &conv, &id, now_ms).await }))
            .await?;
        Ok(UserEventOutcome { written })
    }

    async fn record_delivery(
        &self,
        user: &str,
        device: &str,
        message_ids: Vec<String>,
        now_ms: i64,
    ) -> StoreResult<u64> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.user_writer
            .write(move |c| {
                Box::pin(async move { events::record_delivery(c, &user, &device, &message_ids, now_ms).await })
            })
            .await
    }

    async fn reconcile_messages(&self, after: MessageCursor, limit: u32) -> StoreResult<MessageChunk> {
        self.readers.snapshot(move |c| Box::pin(reconcile::messages(c, after, limit))).await
    }

    async fn reconcile_users(&self, after: Option<String>, limit: u32) -> StoreResult<UserChunk> {
        self.readers.snapshot(move |c| Box::pin(reconcile::users(c, after, limit))).await
    }

    async fn requeue_fanout(&self, conv: &str, message_id: &str, now_ms: i64) -> StoreResult<bool> {
        let (conv, id) = (conv.to_owned(), message_id.to_owned());
        self.conv_writer(&conv.clone())
            .write_conv(conv.clone(), move |c| {
                Box::pin(async move { reconcile::requeue_fanout(c, &conv, &id, now_ms).await })
            })
            .await
    }

    async fn recount_unread(&self, user: &str, conv: &str) -> StoreResult<Option<Recounted>> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.user_writer.write(move |c| Box::pin(async move { reconcile::recount_unread(c, &user, &conv).await })).await
    }

    async fn quarantine(&self, after: Option<(String, String)>, limit: u32) -> StoreResult<Vec<QuarantineRecord>> {
        self.readers.read(move |c| Box::pin(reconcile::quarantine(c, after, limit))).await
    }

    async fn conv_sync(
        &self,
        user: &str,
        conv: &str,
        after: u64,
        limit: u32,
        epoch: Option<u64>,
    ) -> StoreResult<ConvSyncPage> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers
            .snapshot(move |c| Box::pin(async move { read::conv_sync(c, &user, &conv, after, limit, epoch).await }))
            .await
    }

    async fn history(&self, user: &str, conv: &str, before_seq: Option<u64>, limit: u32) -> StoreResult<HistoryPage> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers
            .snapshot(move |c| Box::pin(async move { read::history(c, &user, &conv, before_seq, limit).await }))
            .await
    }

    async fn accept_send(&self, cmd: SendCmd) -> StoreResult<Accepted> {
        if tidemark_core::control::check_send_kind(&cmd.kind).is_err() {
            // A reserved kind is refused, after the idempotency lookup as
            // ever (a retry of a stored message still finds it); the
            // statement below is for the sends that may write.
            return self
                .conv_writer(&cmd.conv)
                .write_conv(cmd.conv.clone(), move |c| Box::pin(async move { events::reserved_send(c, &cmd).await }))
                .await;
        }
        let params = events::send_params(&cmd);
        let cmd = Arc::new(cmd);
        let conv = cmd.conv.clone();
        self.conv_writer(&conv)
            .write_statement(Some(&conv), events::SEND_SQL, params, move |rows| events::decide_send(&cmd, rows))
            .await
    }

    async fn pending_outbox(&self, limit: u32) -> StoreResult<Vec<OutboxItem>> {
        self.readers.read(move |c| Box::pin(read::pending_outbox(c, limit))).await
    }

    async fn outbox_stats(&self) -> StoreResult<OutboxStats> {
        self.readers.read(|c| Box::pin(read::outbox_stats(c))).await
    }

    async fn gauges(&self, now_ms: i64) -> StoreResult<StoreGauges> {
        self.readers.read(move |c| Box::pin(async move { read::gauges(c, now_ms).await })).await
    }

    async fn fan_out(&self, items: Vec<OutboxItem>, now_ms: i64) -> StoreResult<FanoutReport> {
        self.user_writer.write(move |c| Box::pin(async move { fanout::fan_out(c, &items, now_ms).await })).await
    }

    async fn fan_out_next(&self, limit: u32, now_ms: i64) -> StoreResult<ClaimedFanout> {
        self.user_writer
            .write(move |c| {
                Box::pin(async move {
                    let items = fanout::claim(c, limit).await?;
                    if items.is_empty() {
                        return Ok(ClaimedFanout::default());
                    }
                    let report = fanout::fan_out(c, &items, now_ms).await?;
                    Ok(ClaimedFanout { items, report })
                })
            })
            .await
    }

    async fn user_high_watermark(&self, user: &str) -> StoreResult<SyncSeq> {
        let user = user.to_owned();
        self.readers.read(move |c| Box::pin(async move { read::user_high_watermark(c, &user).await })).await
    }

    async fn read_user_events(
        &self,
        user: &str,
        after: SyncSeq,
        upto: SyncSeq,
        limit: u32,
    ) -> StoreResult<Vec<StoredEvent>> {
        let user = user.to_owned();
        self.readers
            .snapshot(move |c| Box::pin(async move { read::user_events(c, &user, after, upto, limit).await }))
            .await
    }

    async fn cas_device_cursor(
        &self,
        user: &str,
        device: &str,
        expected: DeviceCursor,
        new: DeviceCursor,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    let Some(rec) = read_device(c, DEVICE_FOR_UPDATE_SQL, &user, &device).await? else {
                        return Err(StoreError::NotFound(format!("device {device}")));
                    };
                    let (new, ends_recovery) = match decide_cas(rec.cursor, expected, new) {
                        CasDecision::Refuse { current } => return Ok((false, current)),
                        CasDecision::Write { new, ends_recovery } => (new, ends_recovery),
                    };
                    write_cursor(c, &user, &device, new, now_ms).await?;
                    if ends_recovery {
                        // A new generation ends any recovery session of the
                        // old one: it no longer fences retention.
                        crate::db::exec(
                            c,
                            "UPDATE recovery_sessions SET state = 'EXPIRED'
                             WHERE user_id = $1 AND device_id = $2 AND state = 'ACTIVE'",
                            &[&user, &device],
                        )
                        .await?;
                    }
                    Ok((true, new))
                })
            })
            .await
    }

    async fn ack_on(
        &self,
        connection_epoch: Option<u64>,
        user: &str,
        device: &str,
        generation: u64,
        token_session: Option<&str>,
        seq: SyncSeq,
        now_ms: i64,
    ) -> StoreResult<AckResult> {
        let cmd = lifecycle::AckCmd {
            connection_epoch,
            user: user.to_owned(),
            device: device.to_owned(),
            generation,
            token_session: token_session.map(str::to_owned),
            seq,
            now_ms,
        };
        let params = lifecycle::ack_params(&cmd);
        let cmd = Arc::new(cmd);
        // One statement, pipelined with the other one-statement requests of
        // its group commit (sends, other ACKs).
        self.writer()
            .write_statement(None, lifecycle::ACK_SQL, params, move |rows| lifecycle::decide_ack_row(&cmd, rows))
            .await
    }

    async fn begin_recovery(
        &self,
        user: &str,
        device: &str,
        expected: DeviceCursor,
        session: RecoveryInfo,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.user_writer
            .write(move |c| {
                Box::pin(async move { lifecycle::begin_recovery(c, &user, &device, expected, &session, now_ms).await })
            })
            .await
    }

    async fn sync_page(&self, user: &str, device: &str, query: PageQuery, limit: u32) -> StoreResult<Option<SyncRead>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers
            .snapshot(move |c| Box::pin(async move { read::sync_page(c, &user, &device, &query, limit).await }))
            .await
    }

    async fn sync_facts(&self, user: &str, device: &str) -> StoreResult<Option<SyncFacts>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers.read(move |c| Box::pin(async move { read::sync_facts(c, &user, &device).await })).await
    }

    async fn recovery_session(&self, user: &str, device: &str) -> StoreResult<Option<RecoveryInfo>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers.read(move |c| Box::pin(async move { lifecycle::recovery_session(c, &user, &device).await })).await
    }

    async fn user_log(&self, user: &str) -> StoreResult<UserLog> {
        let user = user.to_owned();
        self.readers.read(move |c| Box::pin(async move { lifecycle::user_log(c, &user).await })).await
    }

    async fn read_snapshot_view(
        &self,
        user: &str,
        device: &str,
        messages_per_conv: u32,
        convs_per_chunk: usize,
        out: tokio::sync::mpsc::Sender<SnapshotViewPart>,
    ) -> StoreResult<()> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.readers
            .snapshot(move |c| {
                Box::pin(async move {
                    lifecycle::read_snapshot_view(c, &user, &device, messages_per_conv, convs_per_chunk, &out).await
                })
            })
            .await
    }

    async fn open_snapshot(
        &self,
        user: &str,
        device: &str,
        generation: u64,
        snapshot_id: &str,
        base: SyncSeq,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> StoreResult<()> {
        let (user, device, id) = (user.to_owned(), device.to_owned(), snapshot_id.to_owned());
        self.user_writer
            .write(move |c| {
                Box::pin(async move {
                    lifecycle::open_snapshot(c, &user, &device, generation, &id, base, expires_at_ms, now_ms).await
                })
            })
            .await
    }

    async fn add_snapshot_page(&self, snapshot_id: &str, page: u32, items: Vec<String>) -> StoreResult<()> {
        let id = snapshot_id.to_owned();
        self.writer()
            .write(move |c| Box::pin(async move { lifecycle::add_snapshot_page(c, &id, page, &items).await }))
            .await
    }

    async fn seal_snapshot(&self, snapshot_id: &str, manifest_digest: &str, pages: u32) -> StoreResult<()> {
        let (id, digest) = (snapshot_id.to_owned(), manifest_digest.to_owned());
        self.writer()
            .write(move |c| Box::pin(async move { lifecycle::seal_snapshot(c, &id, &digest, pages).await }))
            .await
    }

    async fn snapshot(&self, snapshot_id: &str) -> StoreResult<Option<SnapshotMeta>> {
        let id = snapshot_id.to_owned();
        self.readers.read(move |c| Box::pin(async move { lifecycle::snapshot(c, &id).await })).await
    }

    async fn snapshot_page(&self, snapshot_id: &str, page: u32) -> StoreResult<Option<Vec<String>>> {
        let id = snapshot_id.to_owned();
        self.readers.snapshot(move |c| Box::pin(async move { lifecycle::snapshot_page(c, &id, page).await })).await
    }

    async fn ack_snapshot(
        &self,
        user: &str,
        device: &str,
        snapshot_id: &str,
        now_ms: i64,
    ) -> StoreResult<(bool, DeviceCursor)> {
        let (user, device, id) = (user.to_owned(), device.to_owned(), snapshot_id.to_owned());
        self.writer()
            .write(move |c| Box::pin(async move { lifecycle::ack_snapshot(c, &user, &device, &id, now_ms).await }))
            .await
    }

    async fn trim_step(
        &self,
        policy: RetentionPolicy,
        now_ms: i64,
        step: TrimStep,
    ) -> StoreResult<(TrimReport, Option<String>)> {
        self.user_writer
            .write(move |c| Box::pin(async move { lifecycle::trim_step(c, policy, now_ms, step).await }))
            .await
    }

    fn set_group_policy(&self, policy: GroupPolicy) {
        self.large_members.store(policy.large_members, std::sync::atomic::Ordering::Relaxed);
    }

    async fn clear_marker(
        &self,
        user: &str,
        device: &str,
        conv: &str,
        observed_version: u64,
        last_msg_seq: u64,
    ) -> StoreResult<(bool, Marker)> {
        let (user, device, conv) = (user.to_owned(), device.to_owned(), conv.to_owned());
        self.writer()
            .write(move |c| {
                Box::pin(
                    async move { events::clear_marker(c, &user, &device, &conv, observed_version, last_msg_seq).await },
                )
            })
            .await
    }

    async fn open_connection(&self, user: &str, device: &str) -> StoreResult<OpenedConnection> {
        let (user, device) = (user.to_owned(), device.to_owned());
        // One statement: pipelined with the sends of its batch.
        let params: Vec<writer::Param> = vec![Box::new(user), Box::new(device.clone())];
        self.writer()
            .write_statement(
                None,
                "UPDATE devices SET connection_epoch = connection_epoch + 1
                 WHERE user_id = $1 AND device_id = $2
                 RETURNING connection_epoch, acked_sync_seq,
                           (SELECT high_watermark FROM user_heads WHERE user_id = $1)",
                params,
                move |rows| {
                    writer::Decided::Answer(match rows.first() {
                        Some(r) => (|| {
                            Ok(OpenedConnection {
                                connection_epoch: seq(r, 0)?,
                                acked_sync_seq: seq(r, 1)?,
                                high_watermark: seq_opt(r, 2)?.unwrap_or(0),
                            })
                        })(),
                        None => Err(StoreError::NotFound(format!("device {device}"))),
                    })
                },
            )
            .await
    }

    async fn device_fences(&self, devices: &[(String, String)]) -> StoreResult<Vec<DeviceFence>> {
        let (users, ids): (Vec<String>, Vec<String>) = devices.iter().cloned().unzip();
        self.readers
            .read(move |c| {
                Box::pin(async move {
                    let rows = query(
                        c,
                        "SELECT d.user_id, d.device_id, d.connection_epoch, d.state = 'REVOKED', d.acked_sync_seq
                         FROM unnest($1::text[], $2::text[]) AS t(u, d0)
                         JOIN devices d ON d.user_id = t.u AND d.device_id = t.d0",
                        &[&users, &ids],
                    )
                    .await?;
                    rows.iter()
                        .map(|r| {
                            Ok(DeviceFence {
                                user: col(r, 0)?,
                                device: col(r, 1)?,
                                connection_epoch: seq(r, 2)?,
                                revoked: col(r, 3)?,
                                acked_sync_seq: seq(r, 4)?,
                            })
                        })
                        .collect()
                })
            })
            .await
    }

    async fn dirty_markers(&self, user: &str, device: &str) -> StoreResult<Vec<DeviceMarker>> {
        let (user, device) = (user.to_owned(), device.to_owned());
        // One statement: its own snapshot.
        self.readers.read(move |c| Box::pin(async move { read::dirty_markers(c, &user, &device).await })).await
    }

    async fn active_members(&self, conv: &str) -> StoreResult<(u64, Vec<String>)> {
        let conv = conv.to_owned();
        self.readers.snapshot(move |c| Box::pin(async move { read::active_members(c, &conv).await })).await
    }

    async fn conv_members(
        &self,
        user: &str,
        conv: &str,
        after: Option<String>,
        limit: u32,
    ) -> StoreResult<MembersPage> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers
            .snapshot(move |c| {
                Box::pin(async move { read::conv_members(c, &user, &conv, after.as_deref(), limit).await })
            })
            .await
    }

    async fn privacy(&self, user: &str) -> StoreResult<Privacy> {
        let user = user.to_owned();
        self.presence_readers.read(move |c| Box::pin(async move { receipts::privacy(c, &user).await })).await
    }

    async fn update_privacy(
        &self,
        user: &str,
        update: PrivacyUpdate,
        now_ms: i64,
    ) -> StoreResult<(Privacy, UserEventOutcome)> {
        let user = user.to_owned();
        // A user-side write: it locks and advances the user's head.
        let (privacy, written) = self
            .user_writer
            .write(move |c| Box::pin(async move { receipts::set_privacy(c, &user, update, now_ms).await }))
            .await?;
        Ok((privacy, UserEventOutcome { written }))
    }

    async fn presence_audience(&self, user: &str, limit: u32) -> StoreResult<Vec<String>> {
        let user = user.to_owned();
        self.presence_readers
            .read(move |c| Box::pin(async move { receipts::presence_audience(c, &user, limit).await }))
            .await
    }

    async fn presence_facts(&self, user: &str, limit: u32) -> StoreResult<(Privacy, Vec<String>)> {
        let user = user.to_owned();
        self.presence_readers
            .read(move |c| Box::pin(async move { receipts::presence_facts(c, &user, limit).await }))
            .await
    }

    async fn conv_receipts(&self, user: &str, conv: &str, at: Option<u64>) -> StoreResult<Receipts> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers
            .snapshot(move |c| Box::pin(async move { receipts::conv_receipts(c, &user, &conv, at).await }))
            .await
    }

    async fn delivery_receipts(
        &self,
        user: &str,
        conv: &str,
        message_ids: Vec<String>,
    ) -> StoreResult<Vec<(String, Option<i64>)>> {
        let (user, conv) = (user.to_owned(), conv.to_owned());
        self.readers
            .snapshot(move |c| {
                Box::pin(async move { receipts::delivery_receipts(c, &user, &conv, &message_ids).await })
            })
            .await
    }

    async fn use_refresh_token(&self, token_hash: &str, now_ms: i64) -> StoreResult<RefreshUse> {
        use tidemark_core::refresh::{decide, Stored, Verdict};
        let hash = token_hash.to_owned();
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    // FOR UPDATE: two nodes presenting the same token
                    // concurrently decide one after the other.
                    let row = query_opt(
                        c,
                        "SELECT user_id, device_id, expires_at, family, used_at FROM refresh_tokens \
                         WHERE token_hash = $1 FOR UPDATE",
                        &[&hash],
                    )
                    .await?;
                    let row = row
                        .map(|r| {
                            let rec = RefreshRecord {
                                user: col(&r, 0)?,
                                device: col(&r, 1)?,
                                expires_at_ms: col(&r, 2)?,
                                family: col(&r, 3)?,
                            };
                            Ok::<_, StoreError>((rec, col::<Option<i64>>(&r, 4)?))
                        })
                        .transpose()?;
                    let stored = row.as_ref().map(|(rec, used_at)| match used_at {
                        Some(_) => Stored::Used,
                        None => Stored::Live { expires_at_ms: rec.expires_at_ms },
                    });
                    Ok(match (decide(stored, now_ms), row) {
                        (Verdict::Rotate, Some((rec, _))) => {
                            exec(c, "UPDATE refresh_tokens SET used_at = $2 WHERE token_hash = $1", &[&hash, &now_ms])
                                .await?;
                            RefreshUse::Rotated(rec)
                        }
                        (Verdict::Expired, Some((rec, _))) => {
                            exec(c, "DELETE FROM refresh_tokens WHERE token_hash = $1", &[&hash]).await?;
                            RefreshUse::Expired(rec)
                        }
                        (Verdict::RevokeFamily, Some((rec, _))) => {
                            exec(c, "DELETE FROM refresh_tokens WHERE family = $1", &[&rec.family]).await?;
                            RefreshUse::FamilyRevoked(rec)
                        }
                        _ => RefreshUse::Unknown,
                    })
                })
            })
            .await
    }

    async fn list_devices(&self, user: &str) -> StoreResult<Vec<DeviceInfo>> {
        let user = user.to_owned();
        self.readers
            .read(move |c| {
                Box::pin(async move {
                    let rows = query(
                        c,
                        "SELECT device_id, name, created_at, updated_at, state FROM devices \
                         WHERE user_id = $1 ORDER BY device_id",
                        &[&user],
                    )
                    .await?;
                    rows.iter()
                        .map(|r| {
                            let state: String = col(r, 4)?;
                            let state = DeviceState::parse(&state)
                                .ok_or_else(|| StoreError::Internal(format!("bad device state {state}")))?;
                            Ok(DeviceInfo {
                                device: col(r, 0)?,
                                name: col(r, 1)?,
                                created_at_ms: col(r, 2)?,
                                last_seen_ms: col(r, 3)?,
                                state,
                            })
                        })
                        .collect()
                })
            })
            .await
    }

    async fn change_password(&self, user: &str, password_hash: &str, keep_device: &str) -> StoreResult<bool> {
        let (user, hash, keep) = (user.to_owned(), password_hash.to_owned(), keep_device.to_owned());
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    let n = exec(c, "UPDATE users SET password_hash = $2 WHERE user_id = $1", &[&user, &hash]).await?;
                    if n == 0 {
                        return Ok(false);
                    }
                    exec(c, "DELETE FROM refresh_tokens WHERE user_id = $1 AND device_id <> $2", &[&user, &keep])
                        .await?;
                    Ok(true)
                })
            })
            .await
    }

    async fn end_sessions(&self, user: &str, device: Option<&str>, now_ms: i64) -> StoreResult<bool> {
        let (user, device) = (user.to_owned(), device.map(str::to_owned));
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    let n = match &device {
                        Some(d) => {
                            exec(
                                c,
                                "UPDATE devices SET sessions_ended_at = GREATEST(sessions_ended_at, $3) \
                                 WHERE user_id = $1 AND device_id = $2",
                                &[&user, d, &now_ms],
                            )
                            .await?
                        }
                        None => exec(
                            c,
                            "UPDATE users SET sessions_ended_at = GREATEST(sessions_ended_at, $2) WHERE user_id = $1",
                            &[&user, &now_ms],
                        )
                        .await?,
                    };
                    if n == 0 {
                        return Ok(false);
                    }
                    exec(
                        c,
                        "DELETE FROM refresh_tokens WHERE user_id = $1 AND ($2::TEXT IS NULL OR device_id = $2)",
                        &[&user, &device],
                    )
                    .await?;
                    bump_fences_version(c).await?;
                    Ok(true)
                })
            })
            .await
    }

    async fn deactivate_user(&self, user: &str, now_ms: i64) -> StoreResult<bool> {
        let user = user.to_owned();
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    let row = query_opt(c, "SELECT deactivated_at FROM users WHERE user_id = $1 FOR UPDATE", &[&user])
                        .await?;
                    let Some(row) = row else { return Err(StoreError::NotFound("no such user".into())) };
                    let deactivated: Option<i64> = col(&row, 0)?;
                    exec(c, "DELETE FROM refresh_tokens WHERE user_id = $1", &[&user]).await?;
                    exec(c, "DELETE FROM push_targets WHERE user_id = $1", &[&user]).await?;
                    if deactivated.is_some() {
                        return Ok(false);
                    }
                    exec(
                        c,
                        "UPDATE users SET deactivated_at = $2, sessions_ended_at = GREATEST(sessions_ended_at, $2) \
                         WHERE user_id = $1",
                        &[&user, &now_ms],
                    )
                    .await?;
                    bump_fences_version(c).await?;
                    Ok(true)
                })
            })
            .await
    }

    async fn fences_version(&self) -> StoreResult<u64> {
        self.readers
            .read(|c| {
                Box::pin(async move {
                    let row = query_opt(
                        c,
                        "SELECT convert_from(value, 'UTF8')::BIGINT FROM meta WHERE key = 'fences_version'",
                        &[],
                    )
                    .await?;
                    let v: i64 = match row {
                        Some(r) => col(&r, 0)?,
                        None => 0,
                    };
                    Ok(v.max(0) as u64)
                })
            })
            .await
    }

    async fn session_fences(&self) -> StoreResult<SessionFences> {
        self.readers
            .read(|c| {
                Box::pin(async move {
                    let mut fences = SessionFences::default();
                    let users = query(
                        c,
                        "SELECT user_id, deactivated_at IS NOT NULL, sessions_ended_at FROM users \
                         WHERE deactivated_at IS NOT NULL OR sessions_ended_at > 0",
                        &[],
                    )
                    .await?;
                    for r in &users {
                        let (user, deactivated, ended): (String, bool, i64) = (col(r, 0)?, col(r, 1)?, col(r, 2)?);
                        if deactivated {
                            fences.deactivated.push(user.clone());
                        }
                        if ended > 0 {
                            fences.users_ended.push((user, ended));
                        }
                    }
                    let devices = query(
                        c,
                        "SELECT user_id, device_id, sessions_ended_at FROM devices WHERE sessions_ended_at > 0",
                        &[],
                    )
                    .await?;
                    for r in &devices {
                        fences.devices_ended.push((col(r, 0)?, col(r, 1)?, col(r, 2)?));
                    }
                    Ok(fences)
                })
            })
            .await
    }

    async fn append_audit(&self, entry: &AuditEntry) -> StoreResult<()> {
        let e = entry.clone();
        self.writer()
            .write(move |c| {
                Box::pin(async move {
                    exec(
                        c,
                        "INSERT INTO audit_log (at, event, actor, user_hash, device_hash, address) \
                         VALUES ($1, $2, $3, $4, $5, $6)",
                        &[&e.at_ms, &e.event, &e.actor, &e.user_hash, &e.device_hash, &e.address],
                    )
                    .await?;
                    Ok(())
                })
            })
            .await
    }

    async fn audit_log(
        &self,
        user_hash: Option<&str>,
        from_ms: i64,
        to_ms: i64,
        limit: u32,
    ) -> StoreResult<Vec<AuditEntry>> {
        let user_hash = user_hash.map(str::to_owned);
        let limit = i64::from(limit);
        self.readers
            .read(move |c| {
                Box::pin(async move {
                    let rows = query(
                        c,
                        "SELECT at, event, actor, user_hash, device_hash, address FROM audit_log \
                         WHERE ($1::TEXT IS NULL OR user_hash = $1) AND at >= $2 AND at < $3 \
                         ORDER BY at, id LIMIT $4",
                        &[&user_hash, &from_ms, &to_ms, &limit],
                    )
                    .await?;
                    rows.iter()
                        .map(|r| {
                            Ok(AuditEntry {
                                at_ms: col(r, 0)?,
                                event: col(r, 1)?,
                                actor: col(r, 2)?,
                                user_hash: col(r, 3)?,
                                device_hash: col(r, 4)?,
                                address: col(r, 5)?,
                            })
                        })
                        .collect()
                })
            })
            .await
    }

    async fn trim_audit(&self, before_ms: i64) -> StoreResult<u64> {
        self.writer()
            .write(move |c| {
                Box::pin(async move { exec(c, "DELETE FROM audit_log WHERE at < $1", &[&before_ms]).await })
            })
            .await
    }

    async fn list_users(&self) -> StoreResult<Vec<UserInfo>> {
        self.readers
            .read(|c| {
                Box::pin(async move {
                    let rows = query(
                        c,
                        "SELECT user_id, created_at, deactivated_at, deleted_at FROM users ORDER BY user_id",
                        &[],
                    )
                    .await?;
                    rows.iter()
                        .map(|r| {
                            Ok(UserInfo {
                                user: col(r, 0)?,
                                created_at_ms: col(r, 1)?,
                                deactivated_at_ms: col(r, 2)?,
                                deleted_at_ms: col(r, 3)?,
                            })
                        })
                        .collect()
                })
            })
            .await
    }

    async fn delete_user(&self, user: &str, now_ms: i64) -> StoreResult<bool> {
        let user = user.to_owned();
        self.user_writer
            .write(move |c| {
                Box::pin(async move {
                    let row =
                        query_opt(c, "SELECT deleted_at FROM users WHERE user_id = $1 FOR UPDATE", &[&user]).await?;
                    let Some(row) = row else { return Err(StoreError::NotFound("no such user".into())) };
                    let deleted: Option<i64> = col(&row, 0)?;
                    if deleted.is_some() {
                        return Ok(false);
                    }
                    exec(
                        c,
                        "UPDATE users SET deleted_at = $2, deactivated_at = COALESCE(deactivated_at, $2), \
                         sessions_ended_at = GREATEST(sessions_ended_at, $2) WHERE user_id = $1",
                        &[&user, &now_ms],
                    )
                    .await?;
                    bump_fences_version(c).await?;
                    exec(
                        c,
                        "DELETE FROM snapshot_items WHERE snapshot_id IN \
                         (SELECT snapshot_id FROM snapshots WHERE user_id = $1)",
                        &[&user],
                    )
                    .await?;
                    for table in [
                        "snapshots",
                        "recovery_sessions",
                        "refresh_tokens",
                        "deliveries",
                        "user_deleted",
                        "devices",
                        "push_targets",
                    ] {
                        exec(c, &format!("DELETE FROM {table} WHERE user_id = $1"), &[&user]).await?;
                    }
                    // The head's row lock, held to COMMIT, orders this with
                    // any fan-out appending to the log.
                    exec(c, "UPDATE user_heads SET trimmed_upto = high_watermark WHERE user_id = $1", &[&user]).await?;
                    exec(c, "DELETE FROM user_events WHERE user_id = $1", &[&user]).await?;
                    Ok(true)
                })
            })
            .await
    }

    fn stats(&self) -> StoreStats {
        let sum = |f: fn(&writer::WriterStats) -> u64| self.all_writers().map(|w| f(&w.stats)).sum::<u64>();
        StoreStats {
            commits: sum(|s| s.commits.load(Ordering::Relaxed)),
            writes: sum(|s| s.writes.load(Ordering::Relaxed)),
            checkpoints: 0,
            statements: db::STATEMENTS.load(Ordering::Relaxed),
            read_statements: None,
        }
    }

    fn health(&self) -> tidemark_store::StoreHealth {
        self.all_writers().map(Writer::health).find(|h| h.write_failure.is_some()).unwrap_or_default()
    }

    async fn put_push_target(&self, target: PushTarget, now_ms: i64) -> StoreResult<bool> {
        self.writer().write(move |c| Box::pin(async move { push::put_target(c, &target, now_ms).await })).await
    }

    async fn push_targets(&self, user: &str) -> StoreResult<Vec<PushTarget>> {
        let user = user.to_owned();
        self.readers.read(move |c| Box::pin(async move { push::targets(c, &user).await })).await
    }

    async fn remove_push_target(&self, user: &str, device: &str, token_hash: Option<&str>) -> StoreResult<bool> {
        let (user, device, hash) = (user.to_owned(), device.to_owned(), token_hash.map(str::to_owned));
        self.writer()
            .write(move |c| Box::pin(async move { push::remove_target(c, &user, &device, hash.as_deref()).await }))
            .await
    }

    async fn claim_pushes(
        &self,
        now_ms: i64,
        lease_ms: i64,
        limit: u32,
        scan_max: u32,
    ) -> StoreResult<Vec<OwedPushes>> {
        self.writer()
            .write(move |c| Box::pin(async move { push::claim(c, now_ms, lease_ms, limit, scan_max).await }))
            .await
    }

    async fn finish_push(
        &self,
        user: &str,
        device: &str,
        claim: i64,
        step: PushStep,
        now_ms: i64,
    ) -> StoreResult<bool> {
        let (user, device) = (user.to_owned(), device.to_owned());
        self.writer()
            .write(move |c| Box::pin(async move { push::finish(c, &user, &device, claim, step, now_ms).await }))
            .await
    }
}

/// The conversation partition of `conv` among `n` writers: FNV-1a of the
/// id (`tidemark_core::route::conv_hash`, the hash the cluster routes by),
/// stable across runs and builds (no random seed), so one conversation
/// always has one writer.
fn conv_partition(conv: &str, n: usize) -> usize {
    (tidemark_core::route::conv_hash(conv) % n as u64) as usize
}

/// Moves `meta.fences_version` (see `Store::fences_version`), inside the
/// transaction that records a fence. Fences are rare operator and device
/// actions, so the one row they share is not a hot spot.
async fn bump_fences_version(c: &Conn) -> StoreResult<()> {
    exec(
        c,
        "INSERT INTO meta (key, value) VALUES ('fences_version', convert_to('1', 'UTF8')) \
         ON CONFLICT (key) DO UPDATE SET \
         value = convert_to((convert_from(meta.value, 'UTF8')::BIGINT + 1)::TEXT, 'UTF8')",
        &[],
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn conversations_spread_over_the_writers_and_stay_put() {
        let mut counts = [0usize; 3];
        for i in 0..3000 {
            let conv = format!("c{i}");
            let p = super::conv_partition(&conv, 3);
            assert_eq!(p, super::conv_partition(&conv, 3), "one conversation, one writer");
            counts[p] += 1;
        }
        assert!(counts.iter().all(|&n| n > 800), "{counts:?}");
        assert_eq!(super::conv_partition("any", 1), 0);
    }
}
