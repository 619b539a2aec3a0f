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
