//! One chaos run: a server on a fixed SQLite directory, the proxy in front
//! of it, users with several SDK devices each talking through the proxy in
//! direct conversations, and a seeded schedule of faults on top of the
//! proxy's: server restarts, clients stopped and reopened on their local
//! store, clients killed at a crash point by the SDK's fault hook.
//!
//! The server runs in-process ([`ServerMode::InProcess`], the CI run): a
//! "kill" is [`RunningServer::stop`] followed by a new [`Server::start`] on
//! the same data directory and address, a graceful stop and not a crash.
//! With [`ServerMode::Binary`] it is the real `tidemark serve`, SIGKILLed
//! and started again on the same directory and address. This module owns
//! the run's timeline and collects the facts; [`crate::check`] judges them.
//!
//! Every random choice of the scenario comes from one generator seeded
//! with the run's seed; the proxy derives its own from the same seed. What
//! the seed cannot fix is timing (and the SDK's own jitter), so a replay
//! takes the same decisions but may interleave them differently.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tidemark_client::{
    Change, Client, ClientConfig, ConnState, Conversation, Exit, FaultAction, FaultHook, FaultPoint, Http, OutboxState,
    SyncPosition,
};
use tidemark_server::{RunningServer, Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tokio::task::JoinHandle;

use crate::check::{self, Accepted, DeviceView, Sent};
use crate::proxy::{FaultConfig, FaultKind, Proxy};

const ADMIN: &str = "chaos-admin";
const PASSWORD: &str = "chaos-password";
/// Setup steps (ready, create a conversation) give up after this long.
const SETUP_WAIT: Duration = Duration::from_secs(15);
/// Attempts at a setup call that may hit a not-yet-ready connection.
const SETUP_ATTEMPTS_MAX: u32 = 20;
/// How often the settle phase polls every device.
const SETTLE_POLL: Duration = Duration::from_millis(200);
/// Consecutive quiet polls that end the settle phase.
const SETTLE_QUIET_POLLS: u32 = 3;
/// Violations recorded while running, per device, before the rest are
/// only counted (a broken cursor would otherwise flood the report).
const LIVE_VIOLATIONS_MAX: usize = 50;

/// Everything a run needs; [`ChaosConfig::short`] is the CI run.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub seed: u64,
    pub users: usize,
    pub devices_per_user: usize,
    pub messages: usize,
    pub server_restarts: usize,
    /// Clients stopped cleanly and reopened on their local store.
    pub client_reopens: usize,
    /// Clients armed to die at a crash point (the hook fires when the
    /// client next reaches that point).
    pub client_aborts: usize,
    /// Pause between two sends, drawn from `0..=send_gap_ms_max`.
    pub send_gap_ms_max: u64,
    pub faults: FaultConfig,
    pub server: ServerMode,
    /// The SDK's request timeout: short, so a dropped frame costs little.
    pub request_timeout: Duration,
    /// The settle phase gives up after this long (the checker then reports
    /// whatever did not arrive).
    pub settle_max: Duration,
}

impl ChaosConfig {
    /// The CI run: a few seconds on two cores.
    pub fn short(seed: u64) -> ChaosConfig {
        ChaosConfig {
            seed,
            users: 3,
            devices_per_user: 2,
            messages: 60,
            server_restarts: 1,
            client_reopens: 2,
            client_aborts: 2,
            send_gap_ms_max: 30,
            faults: FaultConfig::default(),
            server: ServerMode::InProcess,
            request_timeout: Duration::from_secs(1),
            settle_max: Duration::from_secs(20),
        }
    }

    /// A longer run scaled on the number of messages.
    pub fn long(seed: u64, messages: usize) -> ChaosConfig {
        let scale = messages / 60;
        ChaosConfig {
            messages,
            server_restarts: scale.clamp(1, 50),
            client_reopens: (scale * 2).clamp(2, 100),
            client_aborts: (scale * 2).clamp(2, 100),
            settle_max: Duration::from_secs(60),
            ..ChaosConfig::short(seed)
        }
    }
}

/// The outcome of a run, printable as the summary.
#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    /// `in-process (graceful restarts)` or `binary (SIGKILL restarts)`.
    pub server: &'static str,
    pub faults: Vec<(&'static str, u64)>,
    pub frames: u64,
    pub websockets: u64,
    pub server_restarts: usize,
    pub client_reopens: usize,
    pub client_aborts_armed: usize,
    pub client_aborts_fired: usize,
    pub messages_sent: usize,
    pub messages_accepted: usize,
    pub duplicate_accepts: usize,
    pub check: check::Outcome,
    pub cursor_moves_checked: u64,
    pub settled: bool,
    pub notes: Vec<String>,
    /// Violations seen while running (cursor moves) plus the checker's.
    pub violations: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "summary of seed {} (server {})", self.seed, self.server)?;
        let faults: Vec<String> = self.faults.iter().map(|(k, n)| format!("{k} {n}")).collect();
        writeln!(
            f,
            "  proxy: {} frames over {} websockets; faults: {}",
            self.frames,
            self.websockets,
            faults.join(", ")
        )?;
        writeln!(
            f,
            "  scenario: {} server restarts, {} client reopens, {} client crashes ({} armed)",
            self.server_restarts, self.client_reopens, self.client_aborts_fired, self.client_aborts_armed
        )?;
        writeln!(
            f,
            "  messages: {} sent, {} accepted ({} accepted again as duplicates), {} verified on {} devices ({} history-only)",
            self.messages_sent,
            self.messages_accepted,
            self.duplicate_accepts,
            self.check.verified,
            self.check.devices,
            self.check.history_skipped
        )?;
        writeln!(f, "  cursor moves checked: {}; settled: {}", self.cursor_moves_checked, self.settled)?;
        for n in &self.notes {
            writeln!(f, "  note: {n}")?;
        }
        if self.violations.is_empty() {
            writeln!(f, "  result: OK")
        } else {
            writeln!(f, "  result: {} VIOLATIONS", self.violations.len())?;
            for v in &self.violations {
                writeln!(f, "    {v}")?;
            }
            Ok(())
        }
    }
}

/// Where the SDK's fault hook kills a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CrashAt {
    BeforeCommit,
    AfterCommit,
    BeforeSend,
    AfterSendOk,
}

impl CrashAt {
    const ALL: [CrashAt; 4] = [CrashAt::BeforeCommit, CrashAt::AfterCommit, CrashAt::BeforeSend, CrashAt::AfterSendOk];

    fn matches(self, p: &FaultPoint) -> bool {
        matches!(
            (self, p),
            (CrashAt::BeforeCommit, FaultPoint::BeforeCommit { .. })
                | (CrashAt::AfterCommit, FaultPoint::AfterCommit { .. })
                | (CrashAt::BeforeSend, FaultPoint::BeforeSend { .. })
                | (CrashAt::AfterSendOk, FaultPoint::AfterSendOk { .. })
        )
    }
}

/// What the change stream of one device showed, across all the client
/// instances opened on its local store.
#[derive(Default)]
struct DeviceLog {
    accepted: HashMap<String, Accepted>,
    duplicates: usize,
    failed: Vec<String>,
    /// `(generation, applied_sync_seq)` of the last page.
    applied: Option<(u64, u64)>,
    /// `(generation, acked_sync_seq)` of the last confirmed ACK.
    acked: Option<(u64, u64)>,
    /// Conversation → contiguous cursor.
    cursors: HashMap<String, u64>,
    moves_checked: u64,
    exited: Option<Exit>,
    aborts: usize,
    lagged: u64,
    resets: u64,
    /// Cursor notifications that arrived after a later move's.
    reordered: u64,
    /// Polled from the local store: `(generation, applied, acked)`.
    durable_position: Option<(u64, u64, u64)>,
    /// Polled from the local store: conversation → contiguous cursor.
    durable_cursors: HashMap<String, u64>,
    violations: Vec<String>,
    violations_dropped: u64,
}

impl DeviceLog {
    /// Checks a poll of the local store against the previous one: within a
    /// generation, neither the applied position, the ACK nor any
    /// conversation's contiguous cursor moves back.
    fn durable(&mut self, pos: SyncPosition, convs: &[Conversation]) {
        let now = (pos.generation.unwrap_or(0), pos.applied_sync_seq, pos.acked_sync_seq);
        self.moves_checked += 1;
        if let Some(before) = self.durable_position {
            if now.0 < before.0 {
                self.violation(format!("local generation moved back: {before:?} → {now:?}"));
            } else if now.0 == before.0 && (now.1 < before.1 || now.2 < before.2) {
                self.violation(format!("local (generation, applied, acked) moved back: {before:?} → {now:?}"));
            }
        }
        if self.durable_position.is_some_and(|b| b.0 != now.0) {
            self.durable_cursors.clear();
        }
        self.durable_position = Some(now);
        for c in convs {
            self.moves_checked += 1;
            let last = self.durable_cursors.insert(c.conv.clone(), c.contiguous_msg_seq).unwrap_or(0);
            if c.contiguous_msg_seq < last {
                self.violation(format!(
                    "{} local contiguous cursor moved back: {last} → {}",
                    c.conv, c.contiguous_msg_seq
                ));
            }
        }
    }

    fn violation(&mut self, v: String) {
        if self.violations.len() < LIVE_VIOLATIONS_MAX {
            self.violations.push(v);
        } else {
            self.violations_dropped += 1;
        }
    }

    /// A position may only move forward within one generation.
    fn forward(&mut self, what: &str, last: Option<(u64, u64)>, now: (u64, u64)) -> Option<(u64, u64)> {
        self.moves_checked += 1;
        match last {
            Some((g, s)) if g == now.0 && now.1 < s => {
                self.violation(format!("{what} moved back from {s} to {} in generation {g}", now.1));
                last
            }
            Some((g, _)) if now.0 < g => {
                self.violation(format!("{what} generation moved back from {g} to {}", now.0));
                last
            }
            _ => Some(now),
        }
    }

    fn record(&mut self, change: Change) {
        match change {
            Change::PageApplied(p) => {
                self.applied = self.forward("applied_sync_seq", self.applied, (p.sync_generation, p.applied_sync_seq));
            }
            Change::Acked { acked_sync_seq, generation, .. } => {
                self.acked = self.forward("acked_sync_seq", self.acked, (generation, acked_sync_seq));
            }
            Change::CursorMoved(m) => {
                self.moves_checked += 1;
                let last = self.cursors.get(&m.conv).copied().unwrap_or(0);
                if m.to < m.from {
                    self.violation(format!("{} cursor moved back: {} → {}", m.conv, m.from, m.to));
                } else if m.from < last {
                    // The sync round and the outbox pump commit in turn but
                    // notify after their commits, so their notifications may
                    // cross; the durable cursor is checked by polling.
                    self.reordered += 1;
                }
                self.cursors.insert(m.conv, last.max(m.to));
            }
            Change::OutboxAccepted { client_msg_id, msg_seq, message_id, duplicate, .. } => {
                let Some(message_id) = message_id else { return };
                if duplicate {
                    self.duplicates += 1;
                }
                let now = Accepted { msg_seq, message_id };
                match self.accepted.get(&client_msg_id) {
                    Some(before) if *before != now => self
                        .violation(format!("{client_msg_id} accepted twice differently: {before:?} then {now:?} (S1)")),
                    _ => {
                        self.accepted.insert(client_msg_id, now);
                    }
                }
            }
            Change::OutboxFailed { client_msg_id, error, .. } => self.failed.push(format!("{client_msg_id}: {error}")),
            Change::Reset { .. } | Change::SnapshotInstalled { .. } => {
                // A rebuild legitimately restarts the per-conversation
                // cursors from the snapshot.
                self.resets += 1;
                self.cursors.clear();
                self.durable_cursors.clear();
            }
            Change::Lagged { missed } => self.lagged += missed,
            Change::Exited(exit) => {
                if matches!(exit, Exit::Aborted(_)) {
                    self.aborts += 1;
                }
                self.exited = Some(exit);
            }
            _ => {}
        }
    }
}

/// One device: its config (through the proxy), its current client, the
/// task recording its changes, and its crash plan.
struct Device {
    user: String,
    id: String,
    config: ClientConfig,
    client: Option<Client>,
    recorder: Option<JoinHandle<()>>,
    log: Arc<Mutex<DeviceLog>>,
    crash: Arc<Mutex<Option<CrashAt>>>,
}

impl Device {
    fn new(user: &str, id: &str, url: &str, db: PathBuf, timeout: Duration) -> Device {
        let crash: Arc<Mutex<Option<CrashAt>>> = Arc::default();
        let plan = crash.clone();
        let hook: FaultHook = Arc::new(move |p: &FaultPoint| {
            let mut plan = plan.lock().expect("crash plan lock");
            match *plan {
                Some(at) if at.matches(p) => {
                    *plan = None;
                    FaultAction::Abort
                }
                _ => FaultAction::Continue,
            }
        });
        let mut config = ClientConfig::new(url, user, id, db).with_password(PASSWORD);
        config.backoff =
            tidemark_client::policy::Backoff { base: Duration::from_millis(20), cap: Duration::from_millis(300) };
        config.periodic_sync = Duration::from_secs(1);
        config.request_timeout = timeout;
        config.fault = Some(hook);
        Device {
            user: user.to_owned(),
            id: id.to_owned(),
            config,
            client: None,
            recorder: None,
            log: Arc::default(),
            crash,
        }
    }

    fn name(&self) -> String {
        format!("{}/{}", self.user, self.id)
    }

    /// Opens a client on the local store, subscribes, starts it.
    async fn open(&mut self) -> anyhow::Result<()> {
        let client = Client::open(self.config.clone()).with_context(|| format!("open {}", self.name()))?;
        let mut changes = client.subscribe();
        let log = self.log.clone();
        log.lock().expect("log lock").exited = None;
        self.recorder = Some(tokio::spawn(async move {
            while let Some(change) = changes.recv().await {
                log.lock().expect("log lock").record(change);
            }
        }));
        client.start().await.with_context(|| format!("start {}", self.name()))?;
        self.client = Some(client);
        Ok(())
    }

    /// Stops the client (a no-op wait if it already died) and its recorder.
    async fn close(&mut self) {
        if let Some(client) = self.client.take() {
            client.stop().await;
        }
        // The change stream ends once the client is gone.
        if let Some(recorder) = self.recorder.take() {
            let _ = recorder.await;
        }
    }

    fn client(&self) -> &Client {
        self.client.as_ref().expect("device open")
    }

    /// Reads the local position and cursors and checks they only moved
    /// forward. A client killed at a crash point reads nothing more.
    async fn poll(&self) {
        let Some(client) = &self.client else { return };
        let (Ok(pos), Ok(convs)) = (client.position().await, client.conversations().await) else { return };
        self.log.lock().expect("log lock").durable(pos, &convs);
    }

    fn exited(&self) -> bool {
        self.log.lock().expect("log lock").exited.is_some()
    }
}

/// How the run hosts its server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerMode {
    /// [`Server::start`] in this process; a restart is a graceful stop and
    /// a start on the same directory and address.
    InProcess,
    /// The real `tidemark serve` binary at this path; a restart is SIGKILL
    /// and a start on the same directory and address.
    Binary(PathBuf),
}

/// A server process of [`ServerMode::Binary`]. Killed on drop, so a failed
/// run leaves nothing behind.
struct Process {
    child: std::process::Child,
    /// Held open so the server never writes into a closed pipe.
    _stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

enum Running {
    InProcess(RunningServer),
    Binary(Process),
}

/// The server, restartable on its directory and address.
struct ServerSlot {
    mode: ServerMode,
    dir: PathBuf,
    addr: SocketAddr,
    running: Option<Running>,
}

impl ServerSlot {
    async fn boot(mode: ServerMode, dir: PathBuf) -> anyhow::Result<ServerSlot> {
        let (running, addr) = boot(&mode, &dir, "127.0.0.1:0").await?;
        Ok(ServerSlot { mode, dir, addr, running: Some(running) })
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The user's head on the server, when the server's store is at hand
    /// (in-process only).
    async fn head(&self, user: &str) -> anyhow::Result<Option<u64>> {
        match &self.running {
            Some(Running::InProcess(s)) => {
                Ok(Some(s.state.store.user_high_watermark(user).await.map_err(|e| anyhow::anyhow!("{e}"))?))
            }
            _ => Ok(None),
        }
    }

    /// Stops the server: gracefully in-process, SIGKILL for the binary.
    async fn kill(&mut self) {
        match self.running.take() {
            Some(Running::InProcess(s)) => s.stop().await,
            Some(Running::Binary(p)) => {
                // Drop sends SIGKILL and reaps the process (blocking, brief).
                let _ = tokio::task::spawn_blocking(move || drop(p)).await;
            }
            None => {}
        }
    }

    async fn start(&mut self) -> anyhow::Result<()> {
        if self.running.is_none() {
            let (running, _) = boot(&self.mode, &self.dir, &self.addr.to_string()).await?;
            self.running = Some(running);
        }
        Ok(())
    }
}

async fn boot(mode: &ServerMode, dir: &std::path::Path, listen: &str) -> anyhow::Result<(Running, SocketAddr)> {
    match mode {
        ServerMode::InProcess => {
            let store = SqliteStore::open(dir).context("open the server store")?;
            let config = ServerConfig { admin_token: Some(ADMIN.into()), ..ServerConfig::default() };
            let s = Server::start(listen, store, config).await.context("start the server")?;
            let addr = s.addr;
            Ok((Running::InProcess(s), addr))
        }
        ServerMode::Binary(bin) => {
            let (bin, dir, listen) = (bin.clone(), dir.to_owned(), listen.to_owned());
            tokio::task::spawn_blocking(move || spawn_binary(&bin, &dir, &listen)).await?
        }
    }
}

/// Starts `tidemark serve` and reads its "listening on" line.
fn spawn_binary(bin: &std::path::Path, dir: &std::path::Path, listen: &str) -> anyhow::Result<(Running, SocketAddr)> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(bin)
        .args(["serve", "--listen", listen, "--data"])
        .arg(dir)
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

/// What happens before message `at` is sent.
#[derive(Debug, Clone, Copy)]
enum Event {
    RestartServer { down: Duration },
    ReopenClient { device: usize },
    ArmCrash { device: usize, at: CrashAt },
}

fn schedule(cfg: &ChaosConfig, devices: usize, rng: &mut StdRng) -> Vec<(usize, Event)> {
    let mut events = Vec::new();
    let span = cfg.messages.max(1);
    for _ in 0..cfg.server_restarts {
        let down = Duration::from_millis(rng.random_range(50..=400));
        events.push((rng.random_range(span / 5..=span * 4 / 5), Event::RestartServer { down }));
    }
    for _ in 0..cfg.client_reopens {
        events.push((rng.random_range(0..span), Event::ReopenClient { device: rng.random_range(0..devices) }));
    }
    for _ in 0..cfg.client_aborts {
        let at = CrashAt::ALL[rng.random_range(0..CrashAt::ALL.len())];
        events.push((rng.random_range(0..span), Event::ArmCrash { device: rng.random_range(0..devices), at }));
    }
    events.sort_by_key(|(i, _)| *i);
    events
}

/// Runs the scenario and the checker; `Err` only when the run could not be
/// set up (a violation is in the report, not an error).
pub async fn run(cfg: ChaosConfig) -> anyhow::Result<Report> {
    if cfg.users < 2 || cfg.devices_per_user < 1 {
        bail!("need at least two users with one device each");
    }
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let dir = tempfile::tempdir().context("temporary directory")?;
    let mut server = ServerSlot::boot(cfg.server.clone(), dir.path().join("server")).await?;
    let admin = Http::new(&server.url());
    let proxy = Proxy::start(server.addr, cfg.faults, cfg.seed).await.context("start the proxy")?;
    let users: Vec<String> = (0..cfg.users).map(|u| format!("u{u}")).collect();
    for u in &users {
        admin.create_user(ADMIN, u, PASSWORD).await.with_context(|| format!("create {u}"))?;
    }
    let mut devices: Vec<Device> = Vec::new();
    for u in &users {
        for d in 0..cfg.devices_per_user {
            let db = dir.path().join(format!("{u}-d{d}.db"));
            devices.push(Device::new(u, &format!("d{d}"), &proxy.url(), db, cfg.request_timeout));
        }
    }
    for d in devices.iter_mut() {
        d.open().await?;
    }
    for d in &devices {
        d.client().wait_state(ConnState::Ready, SETUP_WAIT).await.with_context(|| format!("{} ready", d.name()))?;
    }
    let members = create_conversations(&users, &devices).await?;
    let convs_of: HashMap<&str, Vec<&str>> = users
        .iter()
        .map(|u| {
            let convs = members.iter().filter(|(_, m)| m.contains(u)).map(|(c, _)| c.as_str()).collect();
            (u.as_str(), convs)
        })
        .collect();

    let server_kind = match cfg.server {
        ServerMode::InProcess => "in-process, graceful restarts",
        ServerMode::Binary(_) => "tidemark binary, SIGKILL restarts",
    };
    let mut report = Report { seed: cfg.seed, server: server_kind, ..Report::default() };
    let events = schedule(&cfg, devices.len(), &mut rng);
    let mut next_event = 0;
    let mut sent: Vec<Sent> = Vec::with_capacity(cfg.messages);
    proxy.set_faults(true);
    for i in 0..cfg.messages {
        while next_event < events.len() && events[next_event].0 <= i {
            apply(events[next_event].1, &mut server, &mut devices, &mut report).await?;
            next_event += 1;
        }
        reopen_dead(&mut devices, &mut report).await?;
        for d in &devices {
            d.poll().await;
        }
        let d = rng.random_range(0..devices.len());
        let convs = &convs_of[devices[d].user.as_str()];
        let conv = convs[rng.random_range(0..convs.len())].to_owned();
        let tag = format!("m{i}");
        let content = serde_json::json!({ "text": format!("chaos {tag}"), "tag": tag });
        let dev = &devices[d];
        let entry = match dev.client().send(&conv, content).await {
            Ok(entry) => entry,
            // The client died at a crash point between the check and the
            // send: nothing was queued; this message is simply not sent.
            Err(tidemark_client::SdkError::Store(tidemark_client::StoreError::Aborted(_))) => continue,
            Err(e) => bail!("{} send {tag}: {e}", dev.name()),
        };
        sent.push(Sent {
            tag,
            conv,
            user: dev.user.clone(),
            device: dev.id.clone(),
            client_msg_id: entry.client_msg_id,
        });
        let gap = rng.random_range(0..=cfg.send_gap_ms_max);
        tokio::time::sleep(Duration::from_millis(gap)).await;
    }
    while next_event < events.len() {
        apply(events[next_event].1, &mut server, &mut devices, &mut report).await?;
        next_event += 1;
    }

    // Settle: faults off, nobody crashes, everyone connected and syncing.
    proxy.set_faults(false);
    server.start().await?;
    for d in &devices {
        *d.crash.lock().expect("crash plan lock") = None;
    }
    reopen_dead(&mut devices, &mut report).await?;
    report.settled = settle(&cfg, &server, &mut devices, &mut report).await?;

    let mut accepted: HashMap<String, Accepted> = HashMap::new();
    let mut views = Vec::with_capacity(devices.len());
    for d in &devices {
        let log = d.log.lock().expect("log lock");
        accepted.extend(log.accepted.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    for s in &sent {
        // The outbox is the sender's durable record: fill in what the
        // change stream missed (a lagged subscriber).
        if accepted.contains_key(&s.client_msg_id) {
            continue;
        }
        let dev = devices.iter().find(|d| d.user == s.user && d.id == s.device).expect("sender device");
        if let Ok(Some(e)) = dev.client().outbox_entry(&s.client_msg_id).await {
            if let (OutboxState::Accepted, Some(seq), Some(id)) = (e.state, e.msg_seq, e.message_id) {
                accepted.insert(s.client_msg_id.clone(), Accepted { msg_seq: seq, message_id: id });
            }
        }
    }
    for d in &devices {
        views.push(view(d).await?);
    }
    let outcome = check::check(&check::Facts { members: &members, sent: &sent, accepted: &accepted, views: &views });

    report.messages_sent = sent.len();
    report.messages_accepted = sent.iter().filter(|s| accepted.contains_key(&s.client_msg_id)).count();
    for d in &devices {
        let log = d.log.lock().expect("log lock");
        report.duplicate_accepts += log.duplicates;
        report.client_aborts_fired += log.aborts;
        report.cursor_moves_checked += log.moves_checked;
        report.violations.extend(log.violations.iter().map(|v| format!("{}: {v}", d.name())));
        if log.violations_dropped > 0 {
            report.violations.push(format!("{}: {} more live violations", d.name(), log.violations_dropped));
        }
        for f in &log.failed {
            report.violations.push(format!("{}: outbox entry failed for good: {f}", d.name()));
        }
        if log.lagged > 0 {
            report.notes.push(format!("{}: change stream lagged by {} (cursor checks partial)", d.name(), log.lagged));
        }
        if log.reordered > 0 {
            report.notes.push(format!(
                "{}: {} cursor notifications arrived after a later move's (Change order is not commit order)",
                d.name(),
                log.reordered
            ));
        }
        if log.resets > 0 {
            report.notes.push(format!("{}: {} reset/snapshot events", d.name(), log.resets));
        }
    }
    if !report.settled {
        report.notes.push(format!("did not settle within {:?}", cfg.settle_max));
    }
    report.violations.extend(outcome.violations.iter().cloned());
    report.check = outcome;
    let stats = proxy.stats();
    report.faults = FaultKind::ALL.iter().map(|k| (k.name(), stats.faults(*k))).collect();
    report.frames = stats.frames.load(std::sync::atomic::Ordering::Relaxed);
    report.websockets = stats.websockets.load(std::sync::atomic::Ordering::Relaxed);

    for d in devices.iter_mut() {
        d.close().await;
    }
    proxy.stop().await;
    server.kill().await;
    Ok(report)
}

/// Creates the direct conversation of every pair of users (faults off), and
/// makes every device know each of its user's conversations.
async fn create_conversations(users: &[String], devices: &[Device]) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let mut members = BTreeMap::new();
    for d in devices {
        for peer in users.iter().filter(|p| **p != d.user) {
            let conv = retry_create(d, peer).await?;
            let pair = {
                let mut p = vec![d.user.clone(), peer.clone()];
                p.sort();
                p
            };
            if let Some(before) = members.insert(conv.clone(), pair.clone()) {
                if before != pair {
                    bail!("conversation {conv} is both {before:?} and {pair:?}");
                }
            }
        }
    }
    let pairs = users.len() * (users.len() - 1) / 2;
    if members.len() != pairs {
        bail!("{} direct conversations for {pairs} pairs", members.len());
    }
    Ok(members)
}

async fn retry_create(d: &Device, peer: &str) -> anyhow::Result<String> {
    let mut last = None;
    for _ in 0..SETUP_ATTEMPTS_MAX {
        match d.client().create_direct(peer).await {
            Ok(conv) => return Ok(conv),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{} create_direct({peer}): {last:?}", d.name())
}

async fn apply(
    event: Event,
    server: &mut ServerSlot,
    devices: &mut [Device],
    report: &mut Report,
) -> anyhow::Result<()> {
    match event {
        Event::RestartServer { down } => {
            server.kill().await;
            tokio::time::sleep(down).await;
            server.start().await?;
            report.server_restarts += 1;
        }
        Event::ReopenClient { device } => {
            let d = &mut devices[device];
            d.close().await;
            d.open().await?;
            report.client_reopens += 1;
        }
        Event::ArmCrash { device, at } => {
            *devices[device].crash.lock().expect("crash plan lock") = Some(at);
            report.client_aborts_armed += 1;
        }
    }
    Ok(())
}

/// Reopens every client that died (at a crash point, or otherwise; an exit
/// other than a crash is noted).
async fn reopen_dead(devices: &mut [Device], report: &mut Report) -> anyhow::Result<()> {
    for d in devices.iter_mut() {
        if !d.exited() {
            continue;
        }
        let exit = d.log.lock().expect("log lock").exited.clone();
        if !matches!(exit, Some(Exit::Aborted(_))) {
            report.violations.push(format!("{}: client exited by itself: {exit:?}", d.name()));
        }
        d.close().await;
        d.open().await?;
    }
    Ok(())
}

/// Waits until every outbox is drained and every device stands at its
/// user's head, applied and ACKed, for a few polls in a row.
async fn settle(
    cfg: &ChaosConfig,
    server: &ServerSlot,
    devices: &mut [Device],
    report: &mut Report,
) -> anyhow::Result<bool> {
    let deadline = tokio::time::Instant::now() + cfg.settle_max;
    let mut quiet = 0;
    let mut last_heads: Vec<(u64, u64)> = Vec::new();
    while tokio::time::Instant::now() < deadline {
        reopen_dead(devices, report).await?;
        // Each device's (applied, acked); in-process, the user's head too.
        let mut heads = Vec::with_capacity(devices.len());
        let mut done = true;
        for d in devices.iter() {
            d.poll().await;
            let client = d.client();
            client.sync_now();
            let pos = client.position().await?;
            let head = server.head(&d.user).await?.unwrap_or(pos.applied_sync_seq);
            heads.push((head, pos.applied_sync_seq));
            let pending = client.outbox().await?.iter().any(|e| e.state == OutboxState::Pending);
            if pending || pos.applied_sync_seq != head || pos.acked_sync_seq != head {
                done = false;
            }
        }
        // Without the server's head, the devices of one user must agree.
        for (i, d) in devices.iter().enumerate() {
            let same_user = devices.iter().enumerate().filter(|(_, o)| o.user == d.user);
            if same_user.clone().any(|(j, _)| heads[j].1 != heads[i].1) {
                done = false;
            }
        }
        quiet = if done && heads == last_heads { quiet + 1 } else { 0 };
        last_heads = heads;
        if quiet >= SETTLE_QUIET_POLLS {
            return Ok(true);
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
    Ok(false)
}

async fn view(d: &Device) -> anyhow::Result<DeviceView> {
    let client = d.client();
    let conversations = client.conversations().await?;
    let mut events = BTreeMap::new();
    for c in &conversations {
        events.insert(c.conv.clone(), client.events(&c.conv).await?);
    }
    Ok(DeviceView { user: d.user.clone(), device: d.id.clone(), conversations, events })
}
