//! The store conformance suite against the PostgreSQL backend (membership,
//! recall/edit/react, snapshots, group commit and refusals inside a batch
//! run there, once for both backends), the checks the SQLite backend runs
//! beside it (reopen, quarantine), checks that only make sense with several
//! writers on one database,
//! and a differential run: one scripted scenario over every store operation
//! against both backends, every result compared.
//!
//! The database comes from `TIDEMARK_TEST_PG_URL`; each store gets its own
//! PostgreSQL schema (`t_<pid>_<n>_<nanos>`), dropped when the test ends,
//! pass or fail. Without the variable each test says so and returns.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tidemark_core::cursor::{DeviceCursor, DeviceState, RecoveryInfo};
use tidemark_postgres::{PgConfig, PgStore};
use tidemark_sqlite::SqliteStore;
use tidemark_store::*;

const URL_VAR: &str = "TIDEMARK_TEST_PG_URL";

/// The database URL, or `None` (with the reason on stdout) when unset.
fn pg_url(test: &str) -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) => {
            assert!(!url.is_empty(), "{URL_VAR} is set but empty");
            Some(url)
        }
        Err(std::env::VarError::NotPresent) => {
            println!("SKIPPED {test}: {URL_VAR} is not set (e.g. {URL_VAR}=postgres://root@127.0.0.1:5432/test)");
            None
        }
        Err(e) => panic!("{URL_VAR}: {e}"),
    }
}

/// Schemas created by one test; dropped when it ends, even by a panic.
struct Schemas {
    url: String,
    names: Mutex<Vec<String>>,
}

static SCHEMA_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Schemas {
    fn new(url: String) -> Schemas {
        Schemas { url, names: Mutex::new(Vec::new()) }
    }

    fn fresh_name(&self) -> String {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let n = SCHEMA_COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("t_{}_{n}_{nanos}", std::process::id());
        self.names.lock().unwrap().push(name.clone());
        name
    }

    fn config(&self, schema: &str) -> PgConfig {
        PgConfig { schema: Some(schema.to_owned()), ..PgConfig::new(self.url.clone()) }
    }

    /// [`Schemas::config`] whose sessions carry `schema` as their
    /// `application_name`, so [`lock_waiters`] counts only this store's.
    fn named_config(&self, schema: &str) -> PgConfig {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        PgConfig { url: format!("{}{sep}application_name={schema}", self.url), ..self.config(schema) }
    }

    /// A store on a new, empty schema.
    async fn fresh(&self) -> Arc<PgStore> {
        let name = self.fresh_name();
        PgStore::open(self.config(&name)).await.unwrap()
    }

    /// A plain connection with `search_path` on `schema`, for inspecting or
    /// corrupting what a store wrote.
    async fn raw(&self, schema: &str) -> tokio_postgres::Client {
        let mut cfg: tokio_postgres::Config = self.url.parse().unwrap();
        cfg.options(format!("-c search_path={schema}"));
        let (client, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }
}

impl Drop for Schemas {
    fn drop(&mut self) {
        let names = std::mem::take(&mut *self.names.lock().unwrap_or_else(|e| e.into_inner()));
        if names.is_empty() {
            return;
        }
        let url = self.url.clone();
        // Drop runs inside (or after) the test's runtime: use a thread with
        // its own runtime so this works from async code and while unwinding.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                for name in names {
                    if let Err(e) = client.batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE")).await {
                        eprintln!("could not drop schema {name}: {e}");
                    }
                }
            })
        })
        .join();
        if dropped.is_err() {
            eprintln!("could not drop the test schemas");
        }
    }
}

/// The sessions named `app` waiting on a lock. `raw` may be inside the
/// transaction that holds it, and PostgreSQL keeps one snapshot of
/// `pg_stat_activity` per transaction, so each look clears it first.
async fn lock_waiters(raw: &tokio_postgres::Client, app: &str) -> i64 {
    raw.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
    raw.query_one(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
        &[&app],
    )
    .await
    .unwrap()
    .get(0)
}

/// Polls [`lock_waiters`] until `ready` holds of it; panics after 10 s.
async fn until_lock_waiters(raw: &tokio_postgres::Client, app: &str, what: &str, ready: impl Fn(i64) -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let waiting = lock_waiters(raw, app).await;
        if ready(waiting) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what} ({waiting} waiting)");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

fn send_cmd(sender: &str, conv: &str, cmid: &str) -> SendCmd {
    SendCmd {
        sender: sender.into(),
        sender_device: "d".into(),
        conv: conv.into(),
        client_msg_id: cmid.into(),
        kind: "text".into(),
        content: format!("{{\"text\":\"{cmid}\"}}"),
        message_id: format!("m-{sender}-{cmid}"),
        quote_id: None,
        mentions: Vec::new(),
        mention_all: false,
        connection_epoch: None,
        now_ms: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_passes_the_conformance_suite() {
    let Some(url) = pg_url("postgres_passes_the_conformance_suite") else { return };
    let schemas = Schemas::new(url);
    conformance::run_all(|| async { schemas.fresh().await as Arc<dyn Store> }).await;
}

/// The same suites with the conversations partitioned over three writer
/// connections per store (`PgConfig::conv_writers`): every rule holds when
/// a store's conversation events commit on several connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_partitioned_writers_passes_the_suites() {
    let Some(url) = pg_url("postgres_with_partitioned_writers_passes_the_suites") else { return };
    let schemas = Schemas::new(url);
    let fresh = || async {
        let name = schemas.fresh_name();
        PgStore::open(PgConfig { conv_writers: 3, ..schemas.config(&name) }).await.unwrap() as Arc<dyn Store>
    };
    conformance::run_all(fresh).await;
    conformance::run_rules(fresh).await;
}

/// Membership, recall/edit/react, snapshot installability, group commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_passes_the_rule_checks() {
    let Some(url) = pg_url("postgres_passes_the_rule_checks") else { return };
    let schemas = Schemas::new(url);
    conformance::run_rules(|| async { schemas.fresh().await as Arc<dyn Store> }).await;
}

/// The shared check, reopening the same schema: opening again runs the
/// schema creation again, which must change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_sends_and_outbox_survive_reopen() {
    let Some(url) = pg_url("accepted_sends_and_outbox_survive_reopen") else { return };
    let schemas = Schemas::new(url);
    let config = schemas.config(&schemas.fresh_name());
    let config = &config;
    conformance::accepted_sends_and_outbox_survive_reopen(|| async move {
        PgStore::open(config.clone()).await.unwrap() as Arc<dyn Store>
    })
    .await;
}

/// F4 (the shared check): the corruption goes through a plain connection
/// on the store's schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_periods_are_quarantined() {
    let Some(url) = pg_url("overlapping_periods_are_quarantined") else { return };
    let schemas = Schemas::new(url);
    let store = schemas.fresh().await;
    let raw = schemas.raw(store.schema().unwrap()).await;
    let raw = &raw;
    conformance::overlapping_periods_are_quarantined(
        &*store,
        move || async move {
            raw.batch_execute(
                "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES ('g1', 'b', 0, NULL)",
            )
            .await
            .unwrap();
        },
        move || async move {
            raw.query_one("SELECT COUNT(*) FROM fanout_quarantine WHERE user_id = 'b'", &[]).await.unwrap().get(0)
        },
    )
    .await;
}

/// S2 across writers: two stores on one database (two nodes) sending to the
/// same conversation at once still get `1..=n`, each seq once; then both
/// fan out the same items at once and every event exists once (F2, F3).
/// S1 across writers, on the path where both runs of one send passed the
/// idempotency lookup before either committed: both wait on the
/// conversation's row lock (held here by a plain transaction), the first
/// commits, the second's insert finds the key taken and raises a
/// serialisation failure, and its writer runs it again, which finds the
/// original. One message, one duplicate answer, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_send_racing_on_two_writers_is_one_message() {
    let Some(url) = pg_url("the_same_send_racing_on_two_writers_is_one_message") else { return };
    let schemas = Schemas::new(url);
    let name = schemas.fresh_name();
    // Its own application_name, so the wait below counts only its sends.
    let config = schemas.named_config(&name);
    let one = PgStore::open(config.clone()).await.unwrap();
    let two = PgStore::open(config).await.unwrap();
    for u in ["a", "b"] {
        one.create_user(u, "x", 0).await.unwrap();
    }
    let (conv, _) = one.create_direct("a", "b", "c1", 0).await.unwrap();
    let raw = schemas.raw(&name).await;
    raw.batch_execute(&format!("BEGIN; SELECT head FROM conversations WHERE conv_id = '{conv}' FOR UPDATE"))
        .await
        .unwrap();
    let first = tokio::spawn({
        let (one, conv) = (one.clone(), conv.clone());
        async move { one.accept_send(send_cmd("a", &conv, "k")).await }
    });
    let second = tokio::spawn({
        let (two, conv) = (two.clone(), conv.clone());
        async move { two.accept_send(SendCmd { message_id: "another-id".into(), ..send_cmd("a", &conv, "k") }).await }
    });
    // Both past the lookup and waiting for the row lock.
    until_lock_waiters(&raw, &name, "the two sends never both waited on the row lock", |n| n == 2).await;
    raw.batch_execute("COMMIT").await.unwrap();
    let (a, b) = (first.await.unwrap().unwrap(), second.await.unwrap().unwrap());
    assert_eq!((&a.message_id, a.msg_seq), (&b.message_id, b.msg_seq), "S1: one message");
    assert!(a.duplicate != b.duplicate, "S1: one original, one duplicate: {a:?} {b:?}");
    assert_eq!(one.conversation(&conv).await.unwrap().unwrap().head, 1, "S2: the refused insert left no hole");
    let retries = one.conflict_retries().0 + two.conflict_retries().0;
    assert_eq!(retries, 1, "the loser ran again once, after its serialisation failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_on_one_database_keep_sequences_contiguous() {
    let Some(url) = pg_url("two_writers_on_one_database_keep_sequences_contiguous") else { return };
    let schemas = Schemas::new(url);
    let name = schemas.fresh_name();
    let one = PgStore::open(schemas.config(&name)).await.unwrap();
    let two = PgStore::open(schemas.config(&name)).await.unwrap();
    for u in ["a", "b"] {
        one.create_user(u, "x", 0).await.unwrap();
    }
    let (conv, _) = one.create_direct("a", "b", "c1", 0).await.unwrap();
    let n = 200u64;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let store = if i % 2 == 0 { one.clone() } else { two.clone() };
        let conv = conv.clone();
        tasks.spawn(async move { store.accept_send(send_cmd("a", &conv, &format!("k{i}"))).await.unwrap().msg_seq });
    }
    let mut seqs = tasks.join_all().await;
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=n).collect::<Vec<_>>(), "S2: contiguous msg_seq across writers");

    let items = one.pending_outbox(1000).await.unwrap();
    assert_eq!(items.len() as u64, n);
    let (r1, r2) = tokio::join!(one.fan_out(items.clone(), 0), two.fan_out(items, 0));
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    assert_eq!(r1.events_written + r2.events_written, 2 * n, "F3: each event written once");
    assert_eq!(r1.duplicates_skipped + r2.duplicates_skipped, 2 * n);
    for user in ["a", "b"] {
        assert_eq!(two.user_high_watermark(user).await.unwrap(), n);
        let seqs: Vec<u64> =
            two.read_user_events(user, 0, n, 1000).await.unwrap().iter().map(|e| e.msg_seq.unwrap()).collect();
        assert_eq!(seqs, (1..=n).collect::<Vec<_>>(), "F2: one event per message, in order");
    }
}

// ------------------------------------------------------------ differential

/// Errors whose message names the backend compare by kind only.
fn norm<T: std::fmt::Debug>(r: &StoreResult<T>) -> String {
    match r {
        Err(StoreError::Internal(_)) => "Err(Internal)".into(),
        Err(StoreError::Unavailable(_)) => "Err(Unavailable)".into(),
        other => format!("{other:?}"),
    }
}

/// Runs `$call` with `$s` bound to each backend, asserts both results are
/// the same, and returns SQLite's.
macro_rules! same {
    ($sq:expr, $pg:expr, $label:expr, |$s:ident| $call:expr) => {{
        let a = {
            let $s: &dyn Store = &*$sq;
            $call.await
        };
        let b = {
            let $s: &dyn Store = &*$pg;
            $call.await
        };
        assert_eq!(norm(&a), norm(&b), "{}: sqlite (left) vs postgres (right)", $label);
        a
    }};
}

/// [`same!`] for a step whose result the scenario does not use.
macro_rules! check {
    ($($t:tt)*) => {{
        let _ = same!($($t)*);
    }};
}

fn ev(conv: &str, actor: &str, id: &str) -> ConvEventCmd {
    ConvEventCmd {
        conv: conv.into(),
        actor: actor.into(),
        actor_device: "d".into(),
        event_id: id.into(),
        client_msg_id: id.into(),
        now_ms: 10,
    }
}

/// Every store operation, through one scenario, on both backends: same
/// results, same errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_matches_sqlite_operation_by_operation() {
    let Some(url) = pg_url("postgres_matches_sqlite_operation_by_operation") else { return };
    let schemas = Schemas::new(url);
    let pg = schemas.fresh().await;
    let dir = tempfile::tempdir().unwrap();
    let sq = SqliteStore::open(dir.path()).unwrap();

    // Accounts and devices.
    for u in ["a", "b", "c", "d", "e"] {
        check!(sq, pg, "create_user", |s| s.create_user(u, "hash", 1));
    }
    check!(sq, pg, "create_user again", |s| s.create_user("a", "other", 1));
    check!(sq, pg, "password_hash", |s| s.password_hash("a"));
    check!(sq, pg, "password_hash unknown", |s| s.password_hash("zz"));
    for u in ["a", "b", "c", "d", "e"] {
        check!(sq, pg, "login_device", |s| s.login_device(u, "phone", "Phone", 2));
    }
    check!(sq, pg, "login_device rename", |s| s.login_device("a", "phone", "Phone 2", 3));
    check!(sq, pg, "device", |s| s.device("a", "phone"));
    check!(sq, pg, "device unknown", |s| s.device("a", "none"));
    let rec = RefreshRecord { user: "a".into(), device: "phone".into(), expires_at_ms: 99, family: "f1".into() };
    check!(sq, pg, "put_refresh_token", |s| s.put_refresh_token("h1", &rec, 3));
    check!(sq, pg, "use_refresh_token", |s| s.use_refresh_token("h1", 4));
    check!(sq, pg, "use_refresh_token twice", |s| s.use_refresh_token("h1", 4));
    check!(sq, pg, "use_refresh_token revoked", |s| s.use_refresh_token("h1", 4));
    check!(sq, pg, "revoke unknown", |s| s.revoke_device("a", "none", 4));

    // Direct conversations.
    check!(sq, pg, "create_direct", |s| s.create_direct("a", "b", "dab", 5));
    check!(sq, pg, "create_direct reversed", |s| s.create_direct("b", "a", "dba", 5));
    check!(sq, pg, "create_direct self", |s| s.create_direct("a", "a", "daa", 5));
    check!(sq, pg, "create_direct unknown", |s| s.create_direct("a", "zz", "daz", 5));
    check!(sq, pg, "conversation", |s| s.conversation("dab"));
    check!(sq, pg, "conversation unknown", |s| s.conversation("nope"));

    // Groups and membership.
    check!(sq, pg, "create_group", |s| s.create_group(ev("g1", "a", "g1-create"), vec!["c".into(), "b".into()]));
    check!(sq, pg, "create_group retry", |s| s.create_group(ev("g1", "a", "g1-create"), vec![]));
    check!(sq, pg, "create_group unknown member", |s| s.create_group(ev("g2", "a", "g2-create"), vec!["zz".into()]));
    check!(sq, pg, "create_group", |s| s.create_group(ev("g3", "b", "g3-create"), vec!["c".into()]));

    // Sends.
    for i in 0..4 {
        check!(sq, pg, "send a", |s| s.accept_send(send_cmd("a", "g1", &format!("a{i}"))));
    }
    check!(sq, pg, "send b", |s| s.accept_send(send_cmd("b", "g1", "b0")));
    check!(sq, pg, "send retry", |s| s.accept_send(send_cmd("b", "g1", "b0")));
    check!(sq, pg, "send key reused elsewhere", |s| s.accept_send(send_cmd("b", "dab", "b0")));
    check!(sq, pg, "send not member", |s| s.accept_send(send_cmd("d", "g1", "d0")));
    check!(sq, pg, "send unknown conv", |s| s.accept_send(send_cmd("a", "nope", "a9")));
    let mut control = send_cmd("a", "g1", "ctl");
    control.kind = KIND_RECALL.into();
    check!(sq, pg, "send control kind", |s| s.accept_send(control.clone()));
    let mut quoting = send_cmd("c", "g1", "c0");
    quoting.quote_id = Some("m-a-a1".into());
    check!(sq, pg, "send quoting", |s| s.accept_send(quoting.clone()));
    let mut bad_quote = send_cmd("c", "g1", "c1");
    bad_quote.quote_id = Some("m-a-zz".into());
    check!(sq, pg, "send bad quote", |s| s.accept_send(bad_quote.clone()));
    for i in 0..3 {
        check!(sq, pg, "send direct", |s| s.accept_send(send_cmd("b", "dab", &format!("db{i}"))));
    }

    check!(sq, pg, "add d", |s| s.change_membership(ev("g1", "a", "add-d"), "d", MembershipChange::Add));
    check!(sq, pg, "add d retry", |s| s.change_membership(ev("g1", "a", "add-d"), "d", MembershipChange::Add));
    check!(sq, pg, "add d again", |s| s.change_membership(ev("g1", "a", "add-d2"), "d", MembershipChange::Add));
    check!(sq, pg, "add unknown", |s| s.change_membership(ev("g1", "a", "add-zz"), "zz", MembershipChange::Add));
    check!(sq, pg, "add by non-member", |s| s.change_membership(ev("g1", "e", "add-x"), "e", MembershipChange::Add));
    check!(sq, pg, "add in direct", |s| s.change_membership(ev("dab", "a", "add-dab"), "c", MembershipChange::Add));
    check!(sq, pg, "remove by non-owner", |s| s.change_membership(
        ev("g1", "b", "rm-c"),
        "c",
        MembershipChange::Remove
    ));
    check!(sq, pg, "leave for another", |s| s.change_membership(ev("g1", "b", "lv-c"), "c", MembershipChange::Leave));
    check!(sq, pg, "send after join", |s| s.accept_send(send_cmd("d", "g1", "d1")));
    check!(sq, pg, "remove c", |s| s.change_membership(ev("g1", "a", "rm-c2"), "c", MembershipChange::Remove));
    check!(sq, pg, "remove c again", |s| s.change_membership(ev("g1", "a", "rm-c3"), "c", MembershipChange::Remove));
    check!(sq, pg, "send after removal", |s| s.accept_send(send_cmd("c", "g1", "c2")));
    check!(sq, pg, "send a", |s| s.accept_send(send_cmd("a", "g1", "a4")));
    check!(sq, pg, "unknown conv membership", |s| s.change_membership(
        ev("nope", "a", "x1"),
        "b",
        MembershipChange::Add
    ));

    // Fan-out of everything so far.
    let items = same!(sq, pg, "pending_outbox", |s| s.pending_outbox(1000)).unwrap();
    check!(sq, pg, "outbox_stats", |s| s.outbox_stats());
    // Outbox ids are backend-assigned; fan each backend its own items.
    let pg_items = pg.pending_outbox(1000).await.unwrap();
    let a = sq.fan_out(items.clone(), 20).await;
    let b = pg.fan_out(pg_items.clone(), 20).await;
    assert_eq!(norm(&a), norm(&b), "fan_out");
    let a = sq.fan_out(items, 20).await;
    let b = pg.fan_out(pg_items, 20).await;
    assert_eq!(norm(&a), norm(&b), "fan_out again");

    // Edits, reactions, recall.
    check!(sq, pg, "edit", |s| s.edit(ev("g1", "a", "ed1"), "m-a-a1", "{\"text\":\"new\"}", 1));
    check!(sq, pg, "edit retry", |s| s.edit(ev("g1", "a", "ed1"), "m-a-a1", "{\"text\":\"new\"}", 1));
    check!(sq, pg, "edit stale", |s| s.edit(ev("g1", "a", "ed2"), "m-a-a1", "{\"text\":\"x\"}", 1));
    check!(sq, pg, "edit by other", |s| s.edit(ev("g1", "b", "ed3"), "m-a-a1", "{\"text\":\"x\"}", 2));
    check!(sq, pg, "edit unknown", |s| s.edit(ev("g1", "a", "ed4"), "m-a-zz", "{\"text\":\"x\"}", 1));
    check!(sq, pg, "edit control event", |s| s.edit(ev("g1", "a", "ed5"), "g1-create", "{}", 1));
    check!(sq, pg, "react", |s| s.react(ev("g1", "b", "r1"), "m-a-a1", "+1", true));
    check!(sq, pg, "react other", |s| s.react(ev("g1", "a", "r2"), "m-a-a1", "+1", true));
    check!(sq, pg, "react again", |s| s.react(ev("g1", "b", "r3"), "m-a-a1", "+1", true));
    check!(sq, pg, "react remove missing", |s| s.react(ev("g1", "b", "r4"), "m-a-a1", "heart", false));
    check!(sq, pg, "react by newcomer on older", |s| s.react(ev("g1", "d", "r5"), "m-a-a1", "+1", true));
    check!(sq, pg, "react by newcomer", |s| s.react(ev("g1", "d", "r6"), "m-a-a4", "ok", true));
    check!(sq, pg, "react remove", |s| s.react(ev("g1", "a", "r7"), "m-a-a1", "+1", false));
    check!(sq, pg, "key reused for another kind", |s| s.react(ev("g1", "a", "ed1"), "m-a-a1", "+1", true));
    check!(sq, pg, "recall by other", |s| s.recall(ev("g1", "b", "rc0"), "m-a-a1"));
    let recalled = same!(sq, pg, "recall", |s| s.recall(ev("g1", "a", "rc1"), "m-a-a1")).unwrap();
    assert!(recalled.changed, "the scenario recalls a message");
    check!(sq, pg, "recall retry", |s| s.recall(ev("g1", "a", "rc1"), "m-a-a1"));
    check!(sq, pg, "recall again", |s| s.recall(ev("g1", "a", "rc2"), "m-a-a1"));
    check!(sq, pg, "edit recalled", |s| s.edit(ev("g1", "a", "ed6"), "m-a-a1", "{}", 3));
    check!(sq, pg, "react recalled", |s| s.react(ev("g1", "b", "r8"), "m-a-a1", "x", true));
    check!(sq, pg, "recall by leaver", |s| s.recall(ev("g1", "c", "rc3"), "m-c-c0"));
    check!(sq, pg, "bump_epoch", |s| s.bump_epoch("dab"));
    check!(sq, pg, "bump_epoch unknown", |s| s.bump_epoch("nope"));

    let items = sq.pending_outbox(1000).await.unwrap();
    let pg_items = pg.pending_outbox(1000).await.unwrap();
    assert_eq!(norm(&sq.fan_out(items, 30).await), norm(&pg.fan_out(pg_items, 30).await), "fan_out control events");

    // Per-user events.
    check!(sq, pg, "mark_read", |s| s.mark_read("b", "g1", 4, 40));
    check!(sq, pg, "mark_read back", |s| s.mark_read("b", "g1", 2, 40));
    check!(sq, pg, "mark_read past head", |s| s.mark_read("d", "g1", 1000, 40));
    check!(sq, pg, "mark_read unknown conv", |s| s.mark_read("b", "nope", 1, 40));
    check!(sq, pg, "mark_read not member", |s| s.mark_read("e", "g1", 1, 40));
    check!(sq, pg, "settings", |s| s.update_settings(
        "b",
        "g1",
        SettingsUpdate { muted: Some(true), ..SettingsUpdate::default() },
        41
    ));
    check!(sq, pg, "settings same", |s| s.update_settings(
        "b",
        "g1",
        SettingsUpdate { muted: Some(true), pinned: Some(false), ..SettingsUpdate::default() },
        41
    ));
    check!(sq, pg, "settings pin", |s| s.update_settings(
        "b",
        "dab",
        SettingsUpdate { pinned: Some(true), ..SettingsUpdate::default() },
        41
    ));
    check!(sq, pg, "settings unknown", |s| s.update_settings(
        "b",
        "nope",
        SettingsUpdate { pinned: Some(true), ..SettingsUpdate::default() },
        41
    ));
    check!(sq, pg, "settings not member", |s| s.update_settings(
        "e",
        "g1",
        SettingsUpdate { pinned: Some(true), ..SettingsUpdate::default() },
        41
    ));
    check!(sq, pg, "delete_for_me", |s| s.delete_for_me("b", "g1", "m-a-a2", 42));
    check!(sq, pg, "delete_for_me again", |s| s.delete_for_me("b", "g1", "m-a-a2", 42));
    check!(sq, pg, "delete_for_me unseen", |s| s.delete_for_me("d", "g1", "m-a-a0", 42));
    check!(sq, pg, "delete_for_me unknown", |s| s.delete_for_me("b", "g1", "m-a-zz", 42));
    check!(sq, pg, "delivery", |s| s.record_delivery("b", "phone", vec!["m-a-a0".into(), "m-a-a0".into()], 43));
    check!(sq, pg, "delivery again", |s| s.record_delivery("b", "phone", vec!["m-a-a0".into(), "m-a-a3".into()], 43));
    check!(sq, pg, "delivery unknown", |s| s.record_delivery("b", "phone", vec!["m-a-a3".into(), "zz".into()], 43));
    let too_many: Vec<String> = (0..501).map(|i| format!("x{i}")).collect();
    check!(sq, pg, "delivery too many", |s| s.record_delivery("b", "phone", too_many.clone(), 43));
    let rebuilt = same!(sq, pg, "rebuild_unread", |s| reconcile::rebuild_unread(s, 3)).unwrap();
    assert!(rebuilt.rows_checked >= 8);
    let cfg = reconcile::ReconcileConfig { messages_per_chunk: 3, users_per_chunk: 2, ..Default::default() };
    let report = same!(sq, pg, "reconcile", |s| reconcile::run(s, &cfg, 50)).unwrap();
    assert!(report.messages_checked >= 8, "{report:?}");
    let items = sq.pending_outbox(1000).await.unwrap();
    let pg_items = pg.pending_outbox(1000).await.unwrap();
    assert_eq!(norm(&sq.fan_out(items, 50).await), norm(&pg.fan_out(pg_items, 50).await), "fan_out after reads");
    check!(sq, pg, "send after delete", |s| s.accept_send(send_cmd("a", "g1", "a5")));
    let items = sq.pending_outbox(1000).await.unwrap();
    let pg_items = pg.pending_outbox(1000).await.unwrap();
    assert_eq!(norm(&sq.fan_out(items, 51).await), norm(&pg.fan_out(pg_items, 51).await), "fan_out last");

    // Reads, for every user.
    for u in ["a", "b", "c", "d", "e"] {
        check!(sq, pg, "list_conversations", |s| s.list_conversations(u, None));
        check!(sq, pg, "user_high_watermark", |s| s.user_high_watermark(u));
        check!(sq, pg, "user_log", |s| s.user_log(u));
        check!(sq, pg, "read_user_events", |s| s.read_user_events(u, 0, 1000, 1000));
        check!(sq, pg, "read_user_events page", |s| s.read_user_events(u, 2, 7, 3));
        for conv in ["g1", "g3", "dab", "nope"] {
            check!(sq, pg, "conv_sync", |s| s.conv_sync(u, conv, 0, 100, None));
            check!(sq, pg, "conv_sync paged", |s| s.conv_sync(u, conv, 2, 3, Some(1)));
            check!(sq, pg, "conv_sync ahead", |s| s.conv_sync(u, conv, 500, 3, None));
            check!(sq, pg, "conv_sync epoch", |s| s.conv_sync(u, conv, 0, 3, Some(7)));
            check!(sq, pg, "history", |s| s.history(u, conv, None, 100));
            check!(sq, pg, "history paged", |s| s.history(u, conv, Some(9), 2));
            check!(sq, pg, "history huge cursor", |s| s.history(u, conv, Some(1 << 40), 2));
        }
    }
    check!(sq, pg, "conversation g1", |s| s.conversation("g1"));
    // The scenario reached the states it is about: an edited and recalled
    // message, reactions, a quote, a deletion, unread counts.
    let page = sq.conv_sync("b", "g1", 0, 100, None).await.unwrap();
    let states: Vec<&str> = page.events.iter().map(|m| m.state.as_str()).collect();
    assert!(states.contains(&STATE_RECALLED) && states.contains(&STATE_DELETED), "{states:?}");
    assert!(page.events.iter().any(|m| m.quote.is_some()));
    assert!(page.events.iter().any(|m| !m.reactions.is_empty()));
    assert!(page.events.iter().any(|m| m.kind == KIND_EDIT && m.content.contains("\"recalled\":true")));
    assert!(sq.list_conversations("c", None).await.unwrap().iter().any(|s| s.unread > 0));

    // Device cursors, ACKs and recovery sessions.
    let new = sq.device("b", "phone").await.unwrap().unwrap().cursor;
    let active = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::Active };
    check!(sq, pg, "cas", |s| s.cas_device_cursor("b", "phone", new, active, 60));
    check!(sq, pg, "cas stale", |s| s.cas_device_cursor("b", "phone", new, active, 60));
    check!(sq, pg, "cas unknown", |s| s.cas_device_cursor("b", "none", new, active, 60));
    check!(sq, pg, "ack", |s| s.ack("b", "phone", 1, None, 5, 61));
    check!(sq, pg, "ack back", |s| s.ack("b", "phone", 1, None, 3, 61));
    check!(sq, pg, "ack stale gen", |s| s.ack("b", "phone", 0, None, 9, 61));
    check!(sq, pg, "ack unknown", |s| s.ack("b", "none", 1, None, 9, 61));
    let expected = DeviceCursor { generation: 1, acked_sync_seq: 5, state: DeviceState::Active };
    let session = RecoveryInfo { session_id: "rs1".into(), resume_from: 2, high_watermark: 8, expires_at_ms: 1_000 };
    check!(sq, pg, "begin_recovery", |s| s.begin_recovery("b", "phone", expected, session.clone(), 62));
    check!(sq, pg, "begin_recovery stale", |s| s.begin_recovery("b", "phone", expected, session.clone(), 62));
    check!(sq, pg, "recovery_session", |s| s.recovery_session("b", "phone"));
    check!(sq, pg, "ack during recovery", |s| s.ack("b", "phone", 2, Some("rs1"), 7, 63));
    check!(sq, pg, "ack wrong session", |s| s.ack("b", "phone", 2, Some("rs0"), 8, 63));
    check!(sq, pg, "ack completes recovery", |s| s.ack("b", "phone", 2, Some("rs1"), 8, 63));
    check!(sq, pg, "recovery_session after", |s| s.recovery_session("b", "phone"));
    let expected = DeviceCursor { generation: 2, acked_sync_seq: 8, state: DeviceState::Active };
    let session = RecoveryInfo { session_id: "rs2".into(), resume_from: 6, high_watermark: 9, expires_at_ms: 100 };
    check!(sq, pg, "begin_recovery 2", |s| s.begin_recovery("b", "phone", expected, session.clone(), 64));
    check!(sq, pg, "ack expired recovery", |s| s.ack("b", "phone", 3, Some("rs2"), 9, 100));
    let r = same!(sq, pg, "device after expiry", |s| s.device("b", "phone")).unwrap().unwrap();
    assert_eq!(r.cursor.state, DeviceState::Resetting);

    // Snapshots.
    let g = r.cursor.generation;
    check!(sq, pg, "begin_snapshot wrong gen", |s| s.begin_snapshot("b", "phone", g + 1, "s0", 3, 500, 70));
    let view = same!(sq, pg, "begin_snapshot", |s| s.begin_snapshot("b", "phone", g, "s1", 3, 500, 70)).unwrap();
    assert!(!view.1.is_empty());
    check!(sq, pg, "snapshot building", |s| s.snapshot("s1"));
    check!(sq, pg, "snapshot_page building", |s| s.snapshot_page("s1", 0));
    let pages = vec![vec!["i0".to_string(), "i1".to_string()], vec!["i2".to_string()], vec![]];
    check!(sq, pg, "finish_snapshot", |s| s.finish_snapshot("s1", "digest", pages.clone()));
    check!(sq, pg, "finish_snapshot twice", |s| s.finish_snapshot("s1", "digest", pages.clone()));
    check!(sq, pg, "snapshot ready", |s| s.snapshot("s1"));
    for p in 0..4 {
        check!(sq, pg, "snapshot_page", |s| s.snapshot_page("s1", p));
    }
    check!(sq, pg, "ack_snapshot other device", |s| s.ack_snapshot("c", "phone", "s1", 71));
    check!(sq, pg, "ack_snapshot unknown", |s| s.ack_snapshot("b", "phone", "s9", 71));
    check!(sq, pg, "ack_snapshot", |s| s.ack_snapshot("b", "phone", "s1", 71));
    check!(sq, pg, "ack_snapshot twice", |s| s.ack_snapshot("b", "phone", "s1", 71));
    check!(sq, pg, "snapshot installed", |s| s.snapshot("s1"));
    check!(sq, pg, "snapshot_page installed", |s| s.snapshot_page("s1", 0));

    // Retention.
    for u in ["a", "c", "d"] {
        let cur = sq.device(u, "phone").await.unwrap().unwrap().cursor;
        let hw = sq.user_high_watermark(u).await.unwrap();
        let to = DeviceCursor { generation: 1, acked_sync_seq: hw / 2, state: DeviceState::Active };
        check!(sq, pg, "cas for trim", |s| s.cas_device_cursor(u, "phone", cur, to, 80));
    }
    let policy =
        RetentionPolicy { keep_events_younger_than_ms: 5, device_inactive_after_ms: 1_000, history_keep_ms: None };
    let trim = same!(sq, pg, "trim", |s| s.trim_user_logs(policy, 90)).unwrap();
    assert!(trim.users_trimmed > 0 && trim.events_deleted > 0, "the scenario trims: {trim:?}");
    check!(sq, pg, "trim again", |s| s.trim_user_logs(policy, 90));
    for u in ["a", "b", "c", "d", "e"] {
        check!(sq, pg, "user_log after trim", |s| s.user_log(u));
        check!(sq, pg, "read_user_events after trim", |s| s.read_user_events(u, 0, 1000, 1000));
    }

    // Revocation last: it ends the device.
    check!(sq, pg, "revoke", |s| s.revoke_device("a", "phone", 95));
    check!(sq, pg, "revoke again", |s| s.revoke_device("a", "phone", 95));
    check!(sq, pg, "revoked_devices", |s| s.revoked_devices());
    check!(sq, pg, "ack revoked", |s| s.ack("a", "phone", 1, None, 1, 96));
    check!(sq, pg, "outbox_stats end", |s| s.outbox_stats());
    let (a, b) = (sq.stats(), pg.stats());
    assert_eq!(b.checkpoints, 0);
    assert!(a.writes > 0 && b.writes > 0);
}

// ------------------------------------------------------------- migrations

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_apply_once_and_a_newer_database_is_refused() {
    use tidemark_postgres::schema::{MIGRATIONS, SCHEMA_VERSION};
    let Some(url) = pg_url("migrations_apply_once_and_a_newer_database_is_refused") else { return };
    let schemas = Schemas::new(url);
    let name = schemas.fresh_name();
    const STEPS_SQL: &str = "SELECT version, applied_at::text FROM schema_migrations ORDER BY version";
    let steps =
        |rows: Vec<tokio_postgres::Row>| -> Vec<(i64, String)> { rows.iter().map(|r| (r.get(0), r.get(1))).collect() };

    let store = PgStore::open(schemas.config(&name)).await.unwrap();
    assert!(store.create_user("a", "x", 0).await.unwrap());
    drop(store);
    let raw = schemas.raw(&name).await;
    let first = steps(raw.query(STEPS_SQL, &[]).await.unwrap());
    let versions: Vec<i64> = first.iter().map(|(v, _)| *v).collect();
    assert_eq!(versions, MIGRATIONS.iter().map(|m| m.version).collect::<Vec<_>>());
    assert_eq!(*versions.last().unwrap(), SCHEMA_VERSION);
    let stamp: String = raw
        .query_one("SELECT convert_from(value, 'UTF8') FROM meta WHERE key = 'schema_version'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stamp, SCHEMA_VERSION.to_string(), "the stamp older builds check follows the steps");

    // Reopening applies nothing: the record is unchanged, data survives.
    let store = PgStore::open(schemas.config(&name)).await.unwrap();
    assert!(!store.create_user("a", "x", 0).await.unwrap(), "the user survived the reopen");
    drop(store);
    assert_eq!(steps(raw.query(STEPS_SQL, &[]).await.unwrap()), first);

    // A database stamped by a newer build is refused, and left untouched.
    let future = SCHEMA_VERSION + 1;
    raw.execute("INSERT INTO schema_migrations (version, name) VALUES ($1, 'future')", &[&future]).await.unwrap();
    match PgStore::open(schemas.config(&name)).await {
        Err(StoreError::SchemaTooNew { found, known }) => assert_eq!((found, known), (future, SCHEMA_VERSION)),
        other => panic!("want SchemaTooNew, got {other:?}"),
    }
    assert_eq!(steps(raw.query(STEPS_SQL, &[]).await.unwrap()).len(), first.len() + 1);

    // So is one whose only record is the stamp of a newer pre-migrations
    // build (a database without `schema_migrations`).
    let legacy = schemas.fresh_name();
    let raw2 = schemas.raw(&legacy).await;
    raw2.batch_execute(&format!(
        "CREATE SCHEMA {legacy}; CREATE TABLE meta (key TEXT PRIMARY KEY, value BYTEA NOT NULL);
         INSERT INTO meta VALUES ('schema_version', convert_to('{future}', 'UTF8'))"
    ))
    .await
    .unwrap();
    match PgStore::open(schemas.config(&legacy)).await {
        Err(StoreError::SchemaTooNew { found, .. }) => assert_eq!(found, future),
        other => panic!("want SchemaTooNew, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_opens_apply_each_step_once() {
    let Some(url) = pg_url("concurrent_opens_apply_each_step_once") else { return };
    let schemas = Schemas::new(url);
    let name = schemas.fresh_name();
    let opens = (0..4).map(|_| PgStore::open(schemas.config(&name)));
    for store in futures_join_all(opens).await {
        store.unwrap();
    }
    let raw = schemas.raw(&name).await;
    let n: i64 = raw.query_one("SELECT COUNT(*) FROM schema_migrations", &[]).await.unwrap().get(0);
    assert_eq!(n, tidemark_postgres::schema::MIGRATIONS.len() as i64);
}

/// Runs futures concurrently (without a `futures` dependency).
async fn futures_join_all<F>(futs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

// ------------------------------------------------- several writers, retries

/// Two stores (two writers, as two nodes) on one schema hammer the same
/// conversations and users at once: sends, fan-outs (which lock user heads)
/// and reads (which lock a user head, then fan-out events). Their batches
/// hold every request's locks until COMMIT, so they can deadlock; the
/// aborted request is run again by its writer (`WRITE_ATTEMPTS_MAX`).
///
/// A request that is the deadlock victim on every one of its runs is
/// answered `Unavailable` (retryable) and counted as a give-up; how often
/// that happens depends on the scheduler, so the test does not assert a
/// number. It asserts what holds on every run: each `Unavailable` is such a
/// counted give-up, the client's own retry (the same `client_msg_id`, as
/// the SDK does) lands it, and nothing is written twice or lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_hammering_the_same_rows_retry_deadlocks() {
    use tidemark_postgres::writer::WRITE_ATTEMPTS_MAX;
    let Some(url) = pg_url("two_writers_hammering_the_same_rows_retry_deadlocks") else { return };
    let schemas = Schemas::new(url);
    let name = schemas.fresh_name();
    // Deadlocks are found after `deadlock_timeout` (1 s by default); a
    // shorter one keeps the test short, and finds the same cycles.
    let sep = if schemas.url.contains('?') { '&' } else { '?' };
    let config =
        PgConfig { url: format!("{}{sep}options=-c%20deadlock_timeout%3D100", schemas.url), ..schemas.config(&name) };
    let stores = [PgStore::open(config.clone()).await.unwrap(), PgStore::open(config).await.unwrap()];
    let users = ["u0", "u1", "u2", "u3"];
    for u in users {
        stores[0].create_user(u, "x", 0).await.unwrap();
    }
    let mut convs = Vec::new();
    for (i, a) in users.iter().enumerate() {
        for b in &users[i + 1..] {
            let (conv, _) = stores[0].create_direct(a, b, &format!("c_{a}_{b}"), 0).await.unwrap();
            convs.push((conv, [a.to_string(), b.to_string()]));
        }
    }
    let convs = Arc::new(convs);
    const TASKS_PER_STORE: u64 = 8;
    const SENDS_PER_TASK: u64 = 30;
    const CLIENT_TRIES: u32 = 10;
    let mut tasks = tokio::task::JoinSet::new();
    for (s, store) in stores.iter().enumerate() {
        for t in 0..TASKS_PER_STORE {
            let (store, convs) = (store.clone(), convs.clone());
            tasks.spawn(async move {
                // A small LCG: the same spread on every run.
                let mut x = (s as u64 * 1_000 + t) * 2_654_435_761 + 1;
                let mut next = move |n: usize| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    ((x >> 33) as usize) % n
                };
                let mut unavailable = 0u64;
                let mut sent = 0u64;
                for i in 0..SENDS_PER_TASK {
                    let (conv, members) = &convs[next(convs.len())];
                    let sender = &members[next(2)];
                    let cmid = format!("s{s}t{t}i{i}");
                    let cmd = SendCmd { message_id: format!("m_{cmid}"), ..send_cmd(sender, conv, &cmid) };
                    // The client retries a send answered `Unavailable` with
                    // the same ids; a retry may find the first run committed
                    // only if it was answered otherwise, so never here.
                    let mut tries = 0;
                    let seq = loop {
                        tries += 1;
                        match store.accept_send(cmd.clone()).await {
                            Ok(a) => {
                                assert!(!a.duplicate, "an Unavailable send committed nothing");
                                sent += 1;
                                break a.msg_seq;
                            }
                            Err(StoreError::Unavailable(_)) if tries < CLIENT_TRIES => unavailable += 1,
                            Err(e) => panic!("send after {tries} tries: {e}"),
                        }
                    };
                    let other = &members[next(2)];
                    match store.mark_read(other, conv, seq, 0).await {
                        Ok(_) => {}
                        Err(StoreError::Unavailable(_)) => unavailable += 1,
                        Err(e) => panic!("read: {e}"),
                    }
                    if i % 3 == 0 {
                        match store.fan_out_next(8, 0).await {
                            Ok(_) => {}
                            Err(StoreError::Unavailable(_)) => unavailable += 1,
                            Err(e) => panic!("fan-out: {e}"),
                        }
                    }
                }
                (sent, unavailable)
            });
        }
    }
    let results = tasks.join_all().await;
    let sent: u64 = results.iter().map(|r| r.0).sum();
    let unavailable: u64 = results.iter().map(|r| r.1).sum();
    while !stores[1].fan_out_next(100, 0).await.unwrap().items.is_empty() {}
    let (retries, give_ups): (u64, u64) =
        stores.iter().map(|s| s.conflict_retries()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    eprintln!("conflict retries {retries}, give-ups {give_ups}, unavailable {unavailable} (attempts max {WRITE_ATTEMPTS_MAX})");
    assert_eq!(unavailable, give_ups, "every Unavailable is a request that used all of its runs");
    assert_eq!(sent, 2 * TASKS_PER_STORE * SENDS_PER_TASK);

    let raw = schemas.raw(&name).await;
    let one = |sql: &'static str| {
        let raw = &raw;
        async move { raw.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(one("SELECT COUNT(*) FROM messages").await as u64, sent, "S1: each send is one message");
    assert_eq!(
        one("SELECT COUNT(*) FROM conversations c WHERE c.head <> (SELECT COUNT(*) FROM messages m WHERE m.conv_id = c.conv_id)
                 OR c.head <> COALESCE((SELECT MAX(msg_seq) FROM messages m WHERE m.conv_id = c.conv_id), 0)")
        .await,
        0,
        "S2: every conversation's msg_seq is 1..=head"
    );
    assert_eq!(one("SELECT COUNT(*) FROM outbox").await, 0);
    assert_eq!(
        one("SELECT COUNT(*) FROM user_events e JOIN messages m ON m.message_id = e.source_event_id").await as u64,
        2 * sent,
        "F3: each message reaches each of its two members once"
    );
    assert_eq!(
        one("SELECT COUNT(*) FROM user_heads h WHERE h.high_watermark <> (SELECT COUNT(*) FROM user_events e WHERE e.user_id = h.user_id)").await,
        0,
        "F2: every user's log is 1..=head"
    );
}

/// Issue 14: a group-commit batch takes its conversation row locks in one
/// global order (`conv_id`), so two writers (two stores on one database, as
/// two nodes) whose batches name the same conversations in opposite orders
/// never deadlock. Each store sends waves of one message to each of the
/// same conversations, queued in ascending order on the first store and
/// descending on the second; each wave's requests share a batch, whose
/// locks it holds until COMMIT. Ran in queue order those batches form a
/// cycle on nearly every wave (the deadlock detector aborts one request,
/// which the writer runs again, counted by `conflict_retries`); in the
/// batch's lock order they only queue. Sends only: the user-side writer
/// stays idle, so any conflict counted is one between conversation writers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_naming_the_same_conversations_in_opposite_orders_never_deadlock() {
    let test = "batches_naming_the_same_conversations_in_opposite_orders_never_deadlock";
    let Some(url) = pg_url(test) else { return };
    let schemas = Schemas::new(url);
    let name = schemas.fresh_name();
    // A cycle is found after `deadlock_timeout` (1 s by default); a shorter
    // one keeps a failing run short.
    let sep = if schemas.url.contains('?') { '&' } else { '?' };
    let config =
        PgConfig { url: format!("{}{sep}options=-c%20deadlock_timeout%3D100", schemas.url), ..schemas.config(&name) };
    let stores = [PgStore::open(config.clone()).await.unwrap(), PgStore::open(config).await.unwrap()];
    const CONVS: usize = 8;
    const WAVES: usize = 25;
    stores[0].create_user("u0", "x", 0).await.unwrap();
    let mut convs = Vec::new();
    for i in 1..=CONVS {
        let peer = format!("u{i}");
        stores[0].create_user(&peer, "x", 0).await.unwrap();
        let (conv, _) = stores[0].create_direct("u0", &peer, &format!("c{i:02}"), 0).await.unwrap();
        convs.push(conv);
    }
    let convs = Arc::new(convs);
    let mut tasks = tokio::task::JoinSet::new();
    for (s, store) in stores.iter().enumerate() {
        let (store, convs) = (store.clone(), convs.clone());
        tasks.spawn(async move {
            for w in 0..WAVES {
                let mut order: Vec<&String> = convs.iter().collect();
                if s == 1 {
                    order.reverse();
                }
                let sends = order
                    .into_iter()
                    .map(|conv| {
                        let cmid = format!("s{s}w{w}{conv}");
                        store.accept_send(send_cmd("u0", conv, &cmid))
                    })
                    .collect();
                for answer in tidemark_postgres::writer::in_order(sends).await {
                    let accepted = answer.expect("a send between two writers");
                    assert!(!accepted.duplicate);
                }
            }
        });
    }
    tasks.join_all().await;
    let (retries, give_ups): (u64, u64) =
        stores.iter().map(|s| s.conflict_retries()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert_eq!((retries, give_ups), (0, 0), "no batch was a deadlock victim (conflict retries, give-ups)");

    let raw = schemas.raw(&name).await;
    let one = |sql: &'static str| {
        let raw = &raw;
        async move { raw.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(one("SELECT COUNT(*) FROM messages").await as usize, 2 * WAVES * CONVS, "S1: each send is one message");
    assert_eq!(
        one("SELECT COUNT(*) FROM conversations c WHERE c.head <> (SELECT COUNT(*) FROM messages m WHERE m.conv_id = c.conv_id)
                 OR c.head <> COALESCE((SELECT MAX(msg_seq) FROM messages m WHERE m.conv_id = c.conv_id), 0)")
        .await,
        0,
        "S2: every conversation's msg_seq is 1..=head"
    );
}

/// O3 (the shared check): the drift is planted through a plain connection
/// on the store's schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_repairs_once_and_reports_the_rest() {
    let Some(url) = pg_url("reconciliation_repairs_once_and_reports_the_rest") else { return };
    let schemas = Schemas::new(url);
    let store = schemas.fresh().await;
    let raw = schemas.raw(store.schema().unwrap()).await;
    let raw = &raw;
    conformance::reconciliation_repairs_once_and_reports_the_rest(
        &*store,
        move |sql| async move {
            raw.batch_execute(sql).await.unwrap();
        },
        move |sql| async move { raw.query_one(sql, &[]).await.unwrap().get(0) },
    )
    .await;
}

/// Issue 18 (the shared check): the mention drift is planted through a
/// plain connection on the store's schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mentions_count_once_clear_to_read_and_rebuild() {
    let Some(url) = pg_url("mentions_count_once_clear_to_read_and_rebuild") else { return };
    let schemas = Schemas::new(url);
    let store = schemas.fresh().await;
    let raw = schemas.raw(store.schema().unwrap()).await;
    let raw = &raw;
    conformance::mentions_count_once_clear_to_read_and_rebuild(&*store, move |sql| async move {
        raw.batch_execute(sql).await.unwrap();
    })
    .await;
}

/// P4 in cluster mode: two nodes (two stores, each its own writers and
/// transactions) claiming owed pushes at once never take one target twice,
/// and between them take every due one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_never_claim_one_push_target() {
    let Some(url) = pg_url("two_nodes_never_claim_one_push_target") else { return };
    let schemas = Schemas::new(url);
    let name = schemas.fresh_name();
    let one = PgStore::open(schemas.config(&name)).await.unwrap();
    let two = PgStore::open(schemas.config(&name)).await.unwrap();
    for u in ["a", "b"] {
        one.create_user(u, "x", 0).await.unwrap();
    }
    let devices: Vec<String> = (0..40).map(|i| format!("dev{i:02}")).collect();
    for d in &devices {
        one.login_device("b", d, "D", 0).await.unwrap();
        let target = tidemark_store::PushTarget {
            user: "b".into(),
            device: d.clone(),
            platform: "webhook".into(),
            token_sealed: vec![1, 2, 3],
            token_hash: format!("h-{d}"),
            token_last4: "last".into(),
            app_id: String::new(),
            p256dh: None,
            auth: None,
            preview: "none".into(),
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        one.put_push_target(target, 0).await.unwrap();
    }
    let (conv, _) = one.create_direct("a", "b", "c1", 0).await.unwrap();
    one.accept_send(send_cmd("a", &conv, "k1")).await.unwrap();
    while !one.fan_out_next(100, 0).await.unwrap().items.is_empty() {}
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..8 {
        let store = if i % 2 == 0 { one.clone() } else { two.clone() };
        tasks.spawn(async move {
            let mut got = Vec::new();
            loop {
                let claimed = store.claim_pushes(1_000, 60_000, 3, 10).await.unwrap();
                if claimed.is_empty() {
                    return got;
                }
                got.extend(claimed.into_iter().map(|o| o.target.device));
            }
        });
    }
    let mut got: Vec<String> = tasks.join_all().await.into_iter().flatten().collect();
    got.sort();
    assert_eq!(got, devices, "P4: every due target claimed exactly once across nodes");
}

/// Issue 14: a fan-out batch costs a fixed number of statements whatever
/// its size (`fanout` module docs). 16 messages to a group of 4 (every
/// member, the sender included, gets each event; the sender's own events
/// ask for one recount) cost 197 statements before issue 14 (about 12 per
/// message, each awaited), then 74 (9 fixed, 64 deliveries in one
/// pipeline, 1 recount), and now 11: the deliveries are one statement
/// (`DELIVER`), the recounts another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_batch_costs_fixed_statements() {
    let Some(url) = pg_url("a_fan_out_batch_costs_fixed_statements") else { return };
    let schemas = Schemas::new(url);
    let store = schemas.fresh().await;
    for u in ["a", "b", "c", "d"] {
        assert!(store.create_user(u, "h", 0).await.unwrap());
    }
    store.create_group(ev("g", "a", "g-create"), vec!["b".into(), "c".into(), "d".into()]).await.unwrap();
    store.fan_out(store.pending_outbox(100).await.unwrap(), 10).await.unwrap();
    for i in 0..16 {
        let mentions = if i % 2 == 0 { vec!["b".to_string()] } else { Vec::new() };
        store.accept_send(SendCmd { mentions, ..send_cmd("a", "g", &format!("m{i}")) }).await.unwrap();
    }
    let items = store.pending_outbox(100).await.unwrap();
    assert_eq!(items.len(), 16);
    let before = store.stats().statements;
    let report = store.fan_out(items, 10).await.unwrap();
    let spent = store.stats().statements - before;
    eprintln!("fan-out of 16 messages to a group of 4: {spent} statements, {} events", report.events_written);
    assert_eq!(report.events_written, 64);
    // The 9 fixed ones before (the transaction's, 2 to resolve, 2 head
    // locks, 1 for what the logs hold, 1 delete), then 1 for the 64
    // deliveries (one statement each before) and 1 for the recounts (the
    // sender's): whatever the number of deliveries.
    const FIXED: u64 = 11;
    assert!(spent <= FIXED, "a fan-out of 16 messages cost {spent} statements");
    // The mention counts are main's: 8 of b's 16 unread mention b.
    let b = store.list_conversations("b", None).await.unwrap();
    let g = b.iter().find(|s| s.conv == "g").unwrap();
    assert_eq!((g.unread, g.mentions), (16, 8));
    let a = store.list_conversations("a", None).await.unwrap();
    let g = a.iter().find(|s| s.conv == "g").unwrap();
    assert_eq!((g.unread, g.mentions, g.read_seq), (0, 0, 17), "the sender's own events: read, recounted");
}

/// A read is one statement on PostgreSQL (`tidemark_read`, schema step 16),
/// pipelined in the user writer's group commit: BEGIN, the savepoint sent
/// with it, the statement, COMMIT, whatever it writes (the cursor, the
/// recount of unread and mentions, the `read` event). The read of several
/// statements it replaced cost 13 here (head lock, the row, the cursor,
/// the recount's four, the list row, the event's check and insert, and the
/// transaction's own), awaited one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_costs_one_statement_in_its_group_commit() {
    let Some(url) = pg_url("a_read_costs_one_statement_in_its_group_commit") else { return };
    let schemas = Schemas::new(url);
    let store = schemas.fresh().await;
    for u in ["a", "b"] {
        assert!(store.create_user(u, "h", 0).await.unwrap());
    }
    let (conv, _) = store.create_direct("a", "b", "c", 0).await.unwrap();
    for i in 0..4 {
        let mentions = if i % 2 == 0 { vec!["a".to_string()] } else { Vec::new() };
        store.accept_send(SendCmd { mentions, ..send_cmd("b", &conv, &format!("m{i}")) }).await.unwrap();
    }
    store.fan_out(store.pending_outbox(100).await.unwrap(), 10).await.unwrap();
    let head = store.conversation(&conv).await.unwrap().unwrap().head;

    // Up to the second-last message: one unread left, a mention (the
    // last-but-one of four, mentioned at 0 and 2, is read).
    let before = store.stats().statements;
    let read = store.mark_read("a", &conv, head - 1, 7).await.unwrap();
    let spent = store.stats().statements - before;
    eprintln!("a read that moves the cursor: {spent} statements");
    assert!(spent <= 4, "a read cost {spent} statements");
    assert_eq!((read.read_seq, read.unread, read.mentions), (head - 1, 1, 0));
    let written = read.written.expect("the read event is written");
    let page = store.read_user_events("a", written - 1, written, 10).await.unwrap();
    let event = page.iter().find(|e| e.sync_seq == written).expect("the read event in a's log");
    assert_eq!(event.kind, "read");
    assert_eq!(event.data.as_deref(), Some(format!("{{\"read_seq\":{},\"unread\":1}}", head - 1).as_str()));

    // Not forward: nothing moves, nothing written, one statement again.
    let before = store.stats().statements;
    let again = store.mark_read("a", &conv, 1, 8).await.unwrap();
    let spent = store.stats().statements - before;
    assert!(spent <= 4, "a read that moves nothing cost {spent} statements");
    assert_eq!((again.read_seq, again.unread, again.mentions, again.written), (head - 1, 1, 0, None));
    // Refusals come from the same statement.
    assert!(matches!(store.mark_read("a", "nope", 1, 9).await, Err(StoreError::NotFound(_))));
    assert!(store.create_user("c", "h", 0).await.unwrap());
    assert!(matches!(store.mark_read("c", &conv, 1, 9).await, Err(StoreError::NotMember)));
}

/// P3 (pull before hints): presence reads wait among their own
/// connections: with every presence connection held (here one, waiting on
/// a lock of `user_privacy`), the reads devices catch up with (the user's
/// head and log here) are still answered, from the read pool. On one shared pool of the same size
/// they would wait for the held connection until the pool's wait ran out
/// and fail `Unavailable`: in a resume storm every connecting device's
/// announcement reads presence facts, and those reads took the read pool
/// from the sync pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_reads_do_not_take_the_read_pool() {
    let Some(url) = pg_url("presence_reads_do_not_take_the_read_pool") else { return };
    let schemas = Schemas::new(url);
    let name = schemas.fresh_name();
    let config = PgConfig { read_connections_max: 1, presence_read_connections_max: 1, ..schemas.named_config(&name) };
    let store = PgStore::open(config).await.unwrap();
    for u in ["a", "b"] {
        store.create_user(u, "x", 0).await.unwrap();
    }
    store.create_direct("a", "b", "c1", 0).await.unwrap();
    let raw = schemas.raw(&name).await;
    raw.batch_execute("BEGIN; LOCK TABLE user_privacy IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let held = tokio::spawn({
        let store = store.clone();
        async move { store.privacy("a").await }
    });
    until_lock_waiters(&raw, &name, "the presence read never waited on the lock", |n| n > 0).await;
    // The presence connection is held; the read pool still answers.
    let head = store.user_high_watermark("a").await.expect("the user's head, beside a held presence read");
    let events = store.read_user_events("a", 0, head, 10).await.expect("the user's log, beside a held presence read");
    assert_eq!(events.len() as u64, head, "the log up to the head");
    assert_eq!(lock_waiters(&raw, &name).await, 1, "the presence read was still waiting meanwhile");
    raw.batch_execute("COMMIT").await.unwrap();
    assert_eq!(held.await.unwrap().unwrap(), Privacy::default(), "and it is answered once the lock goes");
}
