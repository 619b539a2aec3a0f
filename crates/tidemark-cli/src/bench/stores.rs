//! Where a bench's server keeps its data: the embedded SQLite store in a
//! directory, or a PostgreSQL schema of its own (`--database`, issue 14).
//! [`Schemas`] names a fresh schema per round (or per run) and drops it
//! when the body is done, also on error; [`StoreAt`] opens the store there
//! in this process or names it to a `tidemark serve` child.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use rand::Rng;
use tidemark_postgres::{PgConfig, PgStore};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;
use tokio_postgres::{Client, NoTls};

/// The store a bench's server runs on.
#[derive(Debug, Clone)]
pub(super) enum StoreAt {
    /// The embedded store in this directory.
    Dir(PathBuf),
    /// The PostgreSQL store at `url`, its tables in `schema`.
    Postgres { url: String, schema: String },
}

impl StoreAt {
    /// Opens the store (creating its tables) in this process.
    pub(super) async fn open(&self) -> Result<Arc<dyn Store>> {
        Ok(match self {
            StoreAt::Dir(dir) => {
                SqliteStore::open(dir).with_context(|| format!("open store in {}", dir.display()))? as Arc<dyn Store>
            }
            StoreAt::Postgres { url, schema } => {
                let config = PgConfig { schema: Some(schema.clone()), ..PgConfig::new(url.clone()) };
                PgStore::open(config).await.context("open the PostgreSQL store")? as Arc<dyn Store>
            }
        })
    }

    /// Drops this process's last handle on `store` and waits until it let
    /// go of its files (SQLite: another process opens them next).
    pub(super) async fn close(&self, store: Arc<dyn Store>) {
        let weak = Arc::downgrade(&store);
        drop(store);
        if let StoreAt::Dir(dir) = self {
            super::wait_store_closed(weak, dir).await;
        }
    }

    /// The flags that put `tidemark serve` on this store.
    pub(super) fn serve_args(&self) -> Vec<String> {
        match self {
            StoreAt::Dir(dir) => vec!["--data".into(), dir.display().to_string()],
            StoreAt::Postgres { url, schema } => {
                vec!["--database".into(), url.clone(), "--database-schema".into(), schema.clone()]
            }
        }
    }

    /// `sqlite` or `postgres`, for the printed tables and the JSON.
    pub(super) fn backend(&self) -> &'static str {
        match self {
            StoreAt::Dir(_) => "sqlite",
            StoreAt::Postgres { .. } => "postgres",
        }
    }
}

/// Fresh PostgreSQL schemas for a bench run on `--database`, each named
/// after this process, a random run id and a label, and dropped after use.
pub(super) struct Schemas {
    url: String,
    admin: Client,
    run_id: u32,
}

impl Schemas {
    pub(super) async fn connect(url: &str) -> Result<Schemas> {
        let scheme = url.split(':').next().unwrap_or("");
        ensure!(matches!(scheme, "postgres" | "postgresql"), "--database wants a postgres:// URL");
        Ok(Schemas { url: url.to_owned(), admin: connect(url).await?, run_id: rand::rng().random() })
    }

    /// A connection for the bench's own reads (settings, counters).
    pub(super) fn admin(&self) -> &Client {
        &self.admin
    }

    /// Runs `body` on a fresh schema labelled `label` (plain lower-case
    /// letters, digits and `_`), then drops the schema, whatever happened.
    pub(super) async fn run<T, F, Fut>(&self, label: &str, body: F) -> Result<T>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let schema = format!("tidemark_bench_{}_{:08x}_{label}", std::process::id(), self.run_id);
        ensure!(tidemark_postgres::schema::valid_schema_name(&schema), "bad schema label {label:?}");
        let result = body(schema.clone()).await;
        if let Err(e) = self.admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await {
            eprintln!("warning: could not drop schema {schema}: {e}");
        }
        result
    }

    /// The store of `schema` on this database.
    pub(super) fn at(&self, schema: &str) -> StoreAt {
        StoreAt::Postgres { url: self.url.clone(), schema: schema.to_owned() }
    }
}

/// A plain connection, its driver on the runtime.
pub(super) async fn connect(url: &str) -> Result<Client> {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.context("connect to PostgreSQL")?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}
