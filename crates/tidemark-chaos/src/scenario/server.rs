//! The run's server, in-process or the real binary, restartable on the
//! same directory and address, and what the scenario reads of its store (a
//! device's cursor beside its user's trim point), through the store's API
//! or a read-only connection to the binary's database file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::config::{Retention, ServerMode, ADMIN};
use super::device::FellOff;
use anyhow::Context;
use tidemark_server::{RunningServer, Server};
use tidemark_sqlite::SqliteStore;

/// A read of the binary server's store waits this long for a lock.
pub(super) const STORE_READ_BUSY: Duration = Duration::from_secs(2);

/// A server process of [`ServerMode::Binary`]. Killed on drop, so a failed
/// run leaves nothing behind.
pub(super) struct Process {
    pub(super) child: std::process::Child,
    /// Held open so the server never writes into a closed pipe.
    pub(super) _stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(super) enum Running {
    InProcess(RunningServer),
    Binary(Process),
}

/// The server, restartable on its directory and address.
pub(super) struct ServerSlot {
    pub(super) mode: ServerMode,
    pub(super) retention: Retention,
    /// The large-group threshold (`--large-group-members`).
    pub(super) large_group_members: u64,
    pub(super) dir: PathBuf,
    pub(super) addr: SocketAddr,
    pub(super) running: Option<Running>,
}

/// A shared group as the server serves it to one user (and device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SharedHead {
    pub(super) conv: String,
    /// The `msg_seq` the user may read up to.
    pub(super) last_msg_seq: u64,
    /// The device's marker is dirty; `None` when not known (read over the
    /// user's control connection, not for the device).
    pub(super) dirty: Option<bool>,
}

/// A device's server cursor next to its user's trim point.
#[derive(Debug, Clone)]
pub(super) struct Standing {
    /// The device's state on the server.
    pub(super) state: String,
    /// `ACTIVE` or `RECOVERING`: the device's ACK held the fence while it
    /// was active (other states never hold it, docs/protocol.md §3.25).
    pub(super) fencing: bool,
    pub(super) generation: u64,
    pub(super) acked: u64,
    pub(super) trimmed_upto: u64,
}

impl Standing {
    /// L2: the device's ACK is below the trim point, so what it has not
    /// ACKed is gone and its next first page must be `RESET_REQUIRED`.
    pub(super) fn fell_off(&self) -> Option<FellOff> {
        (self.fencing && self.acked < self.trimmed_upto).then_some(FellOff {
            generation: self.generation,
            acked: self.acked,
            trimmed_upto: self.trimmed_upto,
        })
    }
}

impl ServerSlot {
    pub(super) async fn boot(
        mode: ServerMode,
        retention: Retention,
        large_group_members: u64,
        dir: PathBuf,
    ) -> anyhow::Result<ServerSlot> {
        let (running, addr) = boot(&mode, &retention, large_group_members, &dir, "127.0.0.1:0").await?;
        Ok(ServerSlot { mode, retention, large_group_members, dir, addr, running: Some(running) })
    }

    /// Events per conversation a snapshot carries, as this server is
    /// configured (the binary gets it as `--snapshot-messages-per-conv`).
    pub(super) fn snapshot_events_per_conv(&self) -> u64 {
        u64::from(self.retention.snapshot_events_per_conv)
    }

    /// The device's server cursor and its user's trim point while the
    /// server runs: from its store in-process, from a read-only connection
    /// to the binary's database file ([`read_store`]). `None` while the
    /// server is down, or when it has no cursor for the device.
    pub(super) async fn standing(&self, user: &str, device: &str) -> anyhow::Result<Option<Standing>> {
        let (state, generation, acked, trimmed_upto) = match &self.running {
            None => return Ok(None),
            Some(Running::InProcess(s)) => {
                let store = &s.state.store;
                let log = store.user_log(user).await.map_err(|e| anyhow::anyhow!("{e}"))?;
                let Some(d) = store.device(user, device).await.map_err(|e| anyhow::anyhow!("{e}"))? else {
                    return Ok(None);
                };
                (d.cursor.state.as_str().to_owned(), d.cursor.generation, d.cursor.acked_sync_seq, log.trimmed_upto)
            }
            Some(Running::Binary(_)) => {
                let Some(read) = read_store(self.db_file(), user, Some(device)).await? else { return Ok(None) };
                let Some((state, generation, acked)) = read.device else { return Ok(None) };
                (state, generation, acked, read.trimmed_upto)
            }
        };
        Ok(Some(Standing {
            fencing: state == "ACTIVE" || state == "RECOVERING",
            state,
            generation,
            acked,
            trimmed_upto,
        }))
    }

    /// The binary server's database file.
    pub(super) fn db_file(&self) -> PathBuf {
        self.dir.join(tidemark_sqlite::DB_FILE)
    }

    pub(super) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The user's head on the server while it runs (in-process from its
    /// store, from the binary's database file read-only).
    pub(super) async fn head(&self, user: &str) -> anyhow::Result<Option<u64>> {
        match &self.running {
            Some(Running::InProcess(s)) => {
                Ok(Some(s.state.store.user_high_watermark(user).await.map_err(|e| anyhow::anyhow!("{e}"))?))
            }
            Some(Running::Binary(_)) => Ok(read_store(self.db_file(), user, None).await?.map(|r| r.high_watermark)),
            None => Ok(None),
        }
    }

    /// The user's shared groups as the server serves them to `device`
    /// (G2): `(conv, last_msg_seq, dirty)`, the head the user may read
    /// (the marker's target, capped at a leave) and whether the device's
    /// marker is dirty. In-process only (from its store); `None` for the
    /// binary or while the server is down.
    pub(super) async fn shared_groups(&self, user: &str, device: &str) -> anyhow::Result<Option<Vec<SharedHead>>> {
        let Some(Running::InProcess(s)) = &self.running else { return Ok(None) };
        let convs = s.state.store.list_conversations(user, Some(device)).await.map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Some(
            convs
                .into_iter()
                .filter_map(|c| {
                    let m = c.marker?;
                    Some(SharedHead { conv: c.conv, last_msg_seq: c.last_msg_seq, dirty: Some(m.dirty) })
                })
                .collect(),
        ))
    }

    /// Stops the server: gracefully in-process, SIGKILL for the binary.
    pub(super) async fn kill(&mut self) {
        match self.running.take() {
            Some(Running::InProcess(s)) => s.stop().await,
            Some(Running::Binary(p)) => {
                // Drop sends SIGKILL and reaps the process (blocking, brief).
                let _ = tokio::task::spawn_blocking(move || drop(p)).await;
            }
            None => {}
        }
    }

    pub(super) async fn start(&mut self) -> anyhow::Result<()> {
        if self.running.is_none() {
            let (running, _) =
                boot(&self.mode, &self.retention, self.large_group_members, &self.dir, &self.addr.to_string()).await?;
            self.running = Some(running);
        }
        Ok(())
    }
}

pub(super) async fn boot(
    mode: &ServerMode,
    retention: &Retention,
    large_group_members: u64,
    dir: &std::path::Path,
    listen: &str,
) -> anyhow::Result<(Running, SocketAddr)> {
    match mode {
        ServerMode::InProcess => {
            let store = SqliteStore::open(dir).context("open the server store")?;
            let config = retention.server_config(large_group_members)?;
            let s = Server::start(listen, store, config).await.context("start the server")?;
            let addr = s.addr;
            Ok((Running::InProcess(s), addr))
        }
        ServerMode::Binary(bin) => {
            let (bin, dir, listen, retention) = (bin.clone(), dir.to_owned(), listen.to_owned(), *retention);
            tokio::task::spawn_blocking(move || spawn_binary(&bin, &dir, &listen, &retention, large_group_members))
                .await?
        }
    }
}

/// What [`read_store`] reads of one user on the binary server.
pub(super) struct StoreRead {
    pub(super) high_watermark: u64,
    pub(super) trimmed_upto: u64,
    /// The device's state, generation and ACK, when asked for one and it
    /// has a cursor.
    pub(super) device: Option<(String, u64, u64)>,
}

/// Reads the user's head and trim point (`user_heads`) and the device's
/// cursor (`devices`), the columns the store's own `user_log` and `device`
/// read, from the live binary server's database file, in one read
/// transaction over a read-only connection of this process. Not through
/// `SqliteStore::open`, which migrates, checkpoints and starts a writer:
/// this connection writes nothing (WAL lets it read beside the server's
/// writer, which it never blocks). `None` if the file is not there yet.
pub(super) async fn read_store(db: PathBuf, user: &str, device: Option<&str>) -> anyhow::Result<Option<StoreRead>> {
    use rusqlite::{params, OpenFlags, OptionalExtension};
    let (user, device) = (user.to_owned(), device.map(str::to_owned));
    tokio::task::spawn_blocking(move || -> anyhow::Result<Option<StoreRead>> {
        if !db.is_file() {
            return Ok(None);
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let c = rusqlite::Connection::open_with_flags(&db, flags)
            .with_context(|| format!("open {} read-only", db.display()))?;
        c.busy_timeout(STORE_READ_BUSY)?;
        let tx = c.unchecked_transaction()?;
        let (high_watermark, trimmed_upto) = tx
            .query_row("SELECT high_watermark, trimmed_upto FROM user_heads WHERE user_id = ?1", params![user], |r| {
                Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64))
            })
            .optional()
            .context("read user_heads")?
            .unwrap_or((0, 0));
        let device = match device {
            None => None,
            Some(device) => tx
                .query_row(
                    "SELECT state, sync_generation, acked_sync_seq FROM devices WHERE user_id = ?1 AND device_id = ?2",
                    params![user, device],
                    |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64, r.get::<_, i64>(2)? as u64)),
                )
                .optional()
                .context("read devices")?,
        };
        tx.finish()?;
        Ok(Some(StoreRead { high_watermark, trimmed_upto, device }))
    })
    .await?
}

/// Starts `tidemark serve` with the run's retention and reads its
/// "listening on" line.
pub(super) fn spawn_binary(
    bin: &std::path::Path,
    dir: &std::path::Path,
    listen: &str,
    retention: &Retention,
    large_group_members: u64,
) -> anyhow::Result<(Running, SocketAddr)> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(bin)
        .args(["serve", "--listen", listen, "--data"])
        .arg(dir)
        .args(retention.serve_args())
        .args(["--large-group-members".to_owned(), large_group_members.to_string()])
        .env("TIDEMARK_ADMIN_TOKEN", ADMIN)
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("spawn {}", bin.display()))?;
    let stdout = child.stdout.take().context("server stdout")?;
    let mut process = Process { child, _stdout: std::io::BufReader::new(stdout) };
    let mut line = String::new();
    process._stdout.read_line(&mut line).context("read the listening line")?;
    let addr = line
        .trim()
        .strip_prefix("tidemark listening on ")
        .with_context(|| format!("unexpected first line {line:?}"))?
        .parse()
        .context("listening address")?;
    Ok((Running::Binary(process), addr))
}
