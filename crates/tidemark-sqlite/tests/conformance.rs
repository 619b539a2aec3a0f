//! The store conformance suite against the SQLite backend (membership,
//! recall/edit/react, snapshots, group commit and the rest run there, once
//! for both backends), plus checks that need this backend's file: reopen
//! after a restart, a corrupted membership history, migrations.

use std::sync::{Arc, Mutex};

use tidemark_sqlite::SqliteStore;
use tidemark_store::{conformance, Store};

/// Temp dirs live until the end of the test.
fn fresh_store(dirs: &Mutex<Vec<tempfile::TempDir>>) -> Arc<dyn Store> {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    dirs.lock().unwrap().push(dir);
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_passes_the_conformance_suite() {
    let dirs = Mutex::new(Vec::new());
    conformance::run_all(|| async { fresh_store(&dirs) }).await;
}

/// Membership, recall/edit/react, snapshot installability, group commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_passes_the_rule_checks() {
    let dirs = Mutex::new(Vec::new());
    conformance::run_rules(|| async { fresh_store(&dirs) }).await;
}

/// The shared check, reopening the same data directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_sends_and_outbox_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    conformance::accepted_sends_and_outbox_survive_reopen(|| async move {
        SqliteStore::open(path).unwrap() as Arc<dyn Store>
    })
    .await;
}

/// F4 (the shared check): the corruption goes through a second connection
/// to the database file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_periods_are_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let raw = rusqlite::Connection::open(dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
    raw.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    let raw = &raw;
    conformance::overlapping_periods_are_quarantined(
        &*store,
        move || async move {
            raw.execute(
                "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES ('g1', 'b', 0, NULL)",
                [],
            )
            .unwrap();
        },
        move || async move {
            raw.query_row("SELECT COUNT(*) FROM fanout_quarantine WHERE user_id = 'b'", [], |r| r.get(0)).unwrap()
        },
    )
    .await;
}

/// The applied steps, in order, and their `applied_at`.
fn applied_steps(dir: &std::path::Path) -> Vec<(i64, i64)> {
    let conn = rusqlite::Connection::open(dir.join(tidemark_sqlite::DB_FILE)).unwrap();
    let mut stmt = conn.prepare("SELECT version, applied_at FROM schema_migrations ORDER BY version").unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().map(Result::unwrap).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_apply_once_and_a_newer_database_is_refused() {
    use tidemark_sqlite::schema::{MIGRATIONS, SCHEMA_VERSION};
    use tidemark_store::StoreError;

    let dir = tempfile::tempdir().unwrap();
    drop(SqliteStore::open(dir.path()).unwrap());
    let first = applied_steps(dir.path());
    let versions: Vec<i64> = first.iter().map(|(v, _)| *v).collect();
    assert_eq!(versions, MIGRATIONS.iter().map(|m| m.version).collect::<Vec<_>>());
    assert_eq!(*versions.last().unwrap(), SCHEMA_VERSION);

    // Reopening applies nothing: the record is unchanged, data survives.
    {
        let store = SqliteStore::open(dir.path()).unwrap();
        assert!(store.create_user("a", "x", 0).await.unwrap());
    }
    assert_eq!(applied_steps(dir.path()), first);
    {
        let store = SqliteStore::open(dir.path()).unwrap();
        assert!(!store.create_user("a", "x", 0).await.unwrap(), "the user survived the reopen");
    }

    // A database stamped by a newer build is refused, and left untouched.
    let future = SCHEMA_VERSION + 1;
    {
        let conn = rusqlite::Connection::open(dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
        conn.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?1, 'future', 0)", [future])
            .unwrap();
    }
    match SqliteStore::open(dir.path()) {
        Err(StoreError::SchemaTooNew { found, known }) => assert_eq!((found, known), (future, SCHEMA_VERSION)),
        other => panic!("want SchemaTooNew, got {other:?}"),
    }
    assert_eq!(applied_steps(dir.path()).len(), first.len() + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_from_before_numbered_migrations_is_adopted_as_step_one() {
    use tidemark_sqlite::schema::{SCHEMA, SCHEMA_VERSION};

    let dir = tempfile::tempdir().unwrap();
    {
        // What open did before: the schema, and the old stamp.
        let conn = rusqlite::Connection::open(dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
        conn.execute_batch(SCHEMA).unwrap();
        conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', 2)", []).unwrap();
        conn.execute("INSERT INTO users (user_id, password_hash, created_at) VALUES ('a', 'x', 0)", []).unwrap();
    }
    let store = SqliteStore::open(dir.path()).unwrap();
    assert!(!store.create_user("a", "x", 0).await.unwrap(), "existing rows are kept");
    drop(store);
    assert_eq!(applied_steps(dir.path()).last().unwrap().0, SCHEMA_VERSION);
    let conn = rusqlite::Connection::open(dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
    let stamps: i64 =
        conn.query_row("SELECT COUNT(*) FROM meta WHERE key = 'schema_version'", [], |r| r.get(0)).unwrap();
    assert_eq!(stamps, 0, "the old stamp is gone");
}

/// O3 (the shared check): the drift is planted through a second
/// connection to the database file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_repairs_once_and_reports_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let raw = rusqlite::Connection::open(dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
    raw.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    let raw = &raw;
    conformance::reconciliation_repairs_once_and_reports_the_rest(
        &*store,
        move |sql| async move {
            raw.execute(sql, []).unwrap();
        },
        move |sql| async move { raw.query_row(sql, [], |r| r.get(0)).unwrap() },
    )
    .await;
}

/// Issue 18 (the shared check): the mention drift is planted through a
/// second connection to the database file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mentions_count_once_clear_to_read_and_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let raw = rusqlite::Connection::open(dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
    raw.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    let raw = &raw;
    conformance::mentions_count_once_clear_to_read_and_rebuild(&*store, move |sql| async move {
        raw.execute(sql, []).unwrap();
    })
    .await;
}

/// The fused fan-out (issue 19) stops at the first outbox item
/// `tidemark_core::fuse::admits` refuses, a per-member group of more than
/// `FUSED_EVENTS_MAX` members: that item and every later one, a direct
/// message included, stay in the outbox for the relay, which claims them in
/// outbox order; once the outbox is clear, a direct message fans out in its
/// own accept's commit again and its claim reaches the receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_groups_fan_out_stays_on_the_relay_in_outbox_order() {
    use tidemark_core::fuse::FUSED_EVENTS_MAX;
    use tidemark_store::{ConvEventCmd, SendCmd};
    const T0: i64 = 1_700_000_000_000;
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let mut fused = store.fuse_fanout(512).expect("SQLite fuses");
    let others: Vec<String> = (0..FUSED_EVENTS_MAX).map(|i| format!("u{i}")).collect();
    let names: Vec<&str> = ["a", "b"].into_iter().chain(others.iter().map(String::as_str)).collect();
    // Created concurrently: the writer commits them in a few batches.
    let mut creating = tokio::task::JoinSet::new();
    for n in names {
        let (store, n) = (store.clone(), n.to_owned());
        creating.spawn(async move { store.create_user(&n, "phc", T0).await.unwrap() });
    }
    while let Some(created) = creating.join_next().await {
        assert!(created.unwrap());
    }
    let (direct, _) = store.create_direct("a", "b", "d-ab", T0).await.unwrap();
    let send = |cmid: &str| SendCmd {
        sender: "a".into(),
        sender_device: "d1".into(),
        conv: direct.clone(),
        client_msg_id: cmid.into(),
        kind: "text".into(),
        content: "{\"text\":\"hi\"}".into(),
        message_id: format!("m-{cmid}"),
        quote_id: None,
        mentions: Vec::new(),
        mention_all: false,
        connection_epoch: None,
        now_ms: T0,
    };
    let cmd = ConvEventCmd {
        conv: "g-big".into(),
        actor: "a".into(),
        actor_device: "d1".into(),
        event_id: "g-create".into(),
        client_msg_id: "g-create".into(),
        now_ms: T0,
    };
    // a and every other: FUSED_EVENTS_MAX + 1 recipients.
    store.create_group(cmd, others.clone()).await.unwrap();
    let group_items = store.outbox_stats().await.unwrap().backlog;
    assert!(group_items >= 1, "the group's creation is the relay's");
    store.accept_send(send("after-group")).await.unwrap();
    assert_eq!(store.outbox_stats().await.unwrap().backlog, group_items + 1, "the later direct message waits too");
    assert_eq!(store.user_high_watermark("b").await.unwrap(), 0);
    assert!(fused.try_recv().is_err(), "nothing fused");
    // The relay's claim takes the outbox in order: the group, then b's message.
    let claimed = store.fan_out_next(512, T0).await.unwrap();
    assert_eq!(claimed.items.len() as u64, group_items + 1);
    assert!(claimed.items.windows(2).all(|w| w[0].outbox_id < w[1].outbox_id));
    assert_eq!(claimed.items.last().unwrap().conv, direct);
    assert_eq!(store.user_high_watermark("b").await.unwrap(), 1);
    // With the outbox clear, the next direct message fuses.
    let a_before = store.user_high_watermark("a").await.unwrap();
    store.accept_send(send("fused")).await.unwrap();
    assert_eq!(store.user_high_watermark("b").await.unwrap(), 2, "fanned out with its accept");
    let claim = fused.try_recv().expect("the fused claim reached the receiver");
    assert_eq!(claim.items.len(), 1);
    assert_eq!(claim.report.users, vec![("a".to_owned(), a_before + 1), ("b".to_owned(), 2)]);
    assert_eq!(store.outbox_stats().await.unwrap().backlog, 0);
    // Once the receiver is gone, nothing fuses.
    drop(fused);
    store.accept_send(send("unfused")).await.unwrap();
    assert_eq!(store.outbox_stats().await.unwrap().backlog, 1, "left for the relay");
}
