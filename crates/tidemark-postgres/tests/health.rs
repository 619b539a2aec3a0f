//! `Store::health` on PostgreSQL: a COMMIT that fails for real (a deferred
//! constraint trigger raises at COMMIT) marks the writer unhealthy until a
//! later transaction commits. The database comes from
//! `TIDEMARK_TEST_PG_URL`; the test works in its own schema, dropped at the
//! end. Without the variable the test says so and returns.

use tidemark_postgres::{PgConfig, PgStore};
use tidemark_store::{Store, StoreError};

const URL_VAR: &str = "TIDEMARK_TEST_PG_URL";

/// The raw connection to the test's schema, which it drops at the end.
struct DropSchema(tokio_postgres::Client, String);

impl DropSchema {
    async fn drop_now(self) {
        self.0.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.1)).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_marks_the_writer_unhealthy_until_one_commits() {
    let Ok(url) = std::env::var(URL_VAR) else {
        eprintln!("skipping: {URL_VAR} is not set (e.g. {URL_VAR}=postgres://root@127.0.0.1:5432/test)");
        return;
    };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let schema = format!("t_health_{}_{nanos}", std::process::id());
    let store = PgStore::open(PgConfig { schema: Some(schema.clone()), ..PgConfig::new(url.clone()) }).await.unwrap();
    let mut cfg: tokio_postgres::Config = url.parse().unwrap();
    cfg.options(format!("-c search_path={schema}"));
    let (raw, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let cleanup = DropSchema(raw, schema);

    assert!(store.create_user("alice", "hash", 0).await.unwrap());
    assert_eq!(store.health().write_failure, None);

    cleanup
        .0
        .batch_execute(
            "CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$;
             CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON users
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_at_commit();",
        )
        .await
        .unwrap();
    let refused = store.create_user("bob", "hash", 0).await;
    assert!(matches!(refused, Err(StoreError::Unavailable(_))), "{refused:?}");
    let failure = store.health().write_failure;
    assert!(failure.as_deref().is_some_and(|f| f.contains("commit")), "{failure:?}");

    cleanup.0.batch_execute("DROP TRIGGER refuse_at_commit ON users").await.unwrap();
    assert!(store.create_user("bob", "hash", 0).await.unwrap(), "bob was rolled back, so he is created now");
    assert_eq!(store.health().write_failure, None);
    cleanup.drop_now().await;
}
