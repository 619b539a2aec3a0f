//! The run's devices: one SDK client at a time on a device's local store
//! (through the proxy), its crash plan at the SDK's crash points, and the
//! log its change stream writes, with the live checks of a reset and of
//! cursors that must not move back within a generation.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tidemark_client::{
    Change, Client, ClientConfig, Conversation, Exit, FaultAction, FaultHook, FaultPoint, SyncPosition,
};
use tokio::task::JoinHandle;

use super::config::PASSWORD;
use crate::check::Accepted;

/// Violations recorded while running, per device, before the rest are
/// only counted (a broken cursor would otherwise flood the report).
pub(super) const LIVE_VIOLATIONS_MAX: usize = 50;

/// Where the SDK's fault hook kills a client (or, for
/// [`CrashAt::CorruptPage`], damages the first item of a snapshot page).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CrashAt {
    BeforeCommit,
    AfterCommit,
    BeforeSend,
    AfterSendOk,
    SnapshotBegun,
    SnapshotPage,
    SnapshotBeforeCommit,
    SnapshotAfterCommit,
    CorruptPage,
}

impl CrashAt {
    /// The points any client reaches: armed by the timeline.
    pub(super) const ROUTINE: [CrashAt; 4] =
        [CrashAt::BeforeCommit, CrashAt::AfterCommit, CrashAt::BeforeSend, CrashAt::AfterSendOk];
    /// The points of a snapshot install: armed at fall-off reopens.
    pub(super) const SNAPSHOT: [CrashAt; 5] = [
        CrashAt::SnapshotBegun,
        CrashAt::SnapshotPage,
        CrashAt::SnapshotBeforeCommit,
        CrashAt::SnapshotAfterCommit,
        CrashAt::CorruptPage,
    ];

    pub(super) fn matches(self, p: &FaultPoint) -> bool {
        matches!(
            (self, p),
            (CrashAt::BeforeCommit, FaultPoint::BeforeCommit { .. })
                | (CrashAt::AfterCommit, FaultPoint::AfterCommit { .. })
                | (CrashAt::BeforeSend, FaultPoint::BeforeSend { .. })
                | (CrashAt::AfterSendOk, FaultPoint::AfterSendOk { .. })
                | (CrashAt::SnapshotBegun, FaultPoint::SnapshotBegun { .. })
                | (CrashAt::SnapshotPage | CrashAt::CorruptPage, FaultPoint::SnapshotPageFetched { .. })
                | (CrashAt::SnapshotBeforeCommit, FaultPoint::SnapshotBeforeCommit { .. })
                | (CrashAt::SnapshotAfterCommit, FaultPoint::SnapshotAfterCommit { .. })
        )
    }

    pub(super) fn action(self) -> FaultAction {
        match self {
            CrashAt::CorruptPage => FaultAction::Corrupt,
            _ => FaultAction::Abort,
        }
    }
}

/// A stopped device the server's store showed fallen off the retained log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FellOff {
    /// The device's server cursor then: generation and ACK.
    pub(super) generation: u64,
    pub(super) acked: u64,
    /// The user's trim point then, above `acked`.
    pub(super) trimmed_upto: u64,
}

/// What the change stream of one device showed, across all the client
/// instances opened on its local store.
#[derive(Default)]
pub(super) struct DeviceLog {
    pub(super) accepted: HashMap<String, Accepted>,
    pub(super) duplicates: usize,
    /// `client_msg_id` → why the outbox gave up on it.
    pub(super) failed: HashMap<String, String>,
    /// `(generation, applied_sync_seq)` of the last page or installed
    /// snapshot.
    pub(super) applied: Option<(u64, u64)>,
    /// `(generation, acked_sync_seq)` of the last confirmed ACK.
    pub(super) acked: Option<(u64, u64)>,
    /// The highest generation the server confirmed this device synced at
    /// (a page served, an ACK or a snapshot ACK answered): a
    /// `RESET_REQUIRED` and a snapshot install must come above it.
    pub(super) synced_generation: Option<u64>,
    /// Conversation → contiguous cursor, as the change stream reported it
    /// since the last snapshot install.
    pub(super) cursors: HashMap<String, u64>,
    pub(super) moves_checked: u64,
    pub(super) exited: Option<Exit>,
    pub(super) aborts: usize,
    /// Crashes at a snapshot install's fault points.
    pub(super) snapshot_aborts: usize,
    pub(super) lagged: u64,
    pub(super) resets: u64,
    pub(super) snapshots_installed: u64,
    pub(super) snapshot_failures: u64,
    pub(super) digest_mismatches: u64,
    /// Why the last snapshot install attempt failed (for the notes).
    pub(super) last_snapshot_failure: Option<String>,
    /// Set when the scenario reopened this device fallen off the retained
    /// log; cleared by its next snapshot install. No page may apply
    /// meanwhile (L2).
    pub(super) awaiting_snapshot: Option<FellOff>,
    /// Every fall-off, with the local generation at the end of the run
    /// checked above its generation.
    pub(super) fell_off: Vec<FellOff>,
    /// Cursor notifications that arrived after a later move's.
    pub(super) reordered: u64,
    /// Shared groups (G2): `conv.sync` pulls the SDK committed and then
    /// cleared (`Change::GroupPulled`), and of those, clears that
    /// succeeded. The messages themselves are judged from the local store:
    /// a pull's cursor move is a `Change::CursorMoved` like a page's.
    pub(super) group_pulls: u64,
    pub(super) group_clears: u64,
    /// Polled from the local store: `(generation, applied, acked)`.
    pub(super) durable_position: Option<(u64, u64, u64)>,
    /// Polled from the local store: conversation → contiguous cursor, in
    /// the generation of `durable_position`.
    pub(super) durable_cursors: HashMap<String, u64>,
    pub(super) violations: Vec<String>,
    pub(super) violations_dropped: u64,
}

impl DeviceLog {
    /// Checks a poll of the local store against the previous one: the
    /// generation never moves back, and within a generation neither the
    /// applied position, the ACK nor any conversation's contiguous cursor
    /// moves back. Only a new generation (a reset, made visible by the
    /// snapshot install that stores it) starts the cursors over.
    pub(super) fn durable(&mut self, pos: SyncPosition, convs: &[Conversation]) {
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
                    "{} local contiguous cursor moved back in generation {}: {last} → {}",
                    c.conv, now.0, c.contiguous_msg_seq
                ));
            }
        }
    }

    pub(super) fn violation(&mut self, v: String) {
        if self.violations.len() < LIVE_VIOLATIONS_MAX {
            self.violations.push(v);
        } else {
            self.violations_dropped += 1;
        }
    }

    /// A position may only move forward within one generation.
    pub(super) fn forward(&mut self, what: &str, last: Option<(u64, u64)>, now: (u64, u64)) -> Option<(u64, u64)> {
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

    /// The server confirmed the device at `generation`.
    pub(super) fn synced_at(&mut self, generation: u64) {
        self.synced_generation = self.synced_generation.max(Some(generation));
    }

    /// The scenario reopens this device, fallen off the retained log.
    pub(super) fn fall_off(&mut self, f: FellOff) {
        self.awaiting_snapshot = Some(f);
        self.fell_off.push(f);
    }

    pub(super) fn record(&mut self, change: Change) {
        match change {
            Change::PageApplied(p) => {
                if let Some(f) = self.awaiting_snapshot {
                    self.violation(format!(
                        "applied a page (generation {}, resume_from {}, {} events) after falling off the retained log (ACK {} below trim point {}) and before any snapshot: the first sync must answer RESET_REQUIRED (L2)",
                        p.sync_generation, p.resume_from, p.applied + p.skipped, f.acked, f.trimmed_upto
                    ));
                }
                self.applied = self.forward("applied_sync_seq", self.applied, (p.sync_generation, p.applied_sync_seq));
                self.synced_at(p.sync_generation);
            }
            Change::Acked { acked_sync_seq, generation, .. } => {
                self.acked = self.forward("acked_sync_seq", self.acked, (generation, acked_sync_seq));
                self.synced_at(generation);
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
            Change::OutboxFailed { client_msg_id, error, .. } => {
                self.failed.insert(client_msg_id, error);
            }
            Change::Reset { generation } => {
                // D5: the server bumps the generation before it answers
                // RESET_REQUIRED, so the error names a generation above
                // every one it confirmed this device at.
                self.resets += 1;
                self.moves_checked += 1;
                match (generation, self.synced_generation) {
                    (None, _) => self.violation("RESET_REQUIRED without a sync_generation".into()),
                    (Some(g), Some(synced)) if g <= synced => self.violation(format!(
                        "RESET_REQUIRED at generation {g}, not above generation {synced} the device synced at (D5)"
                    )),
                    _ => {}
                }
            }
            Change::SnapshotInstalled { generation, base_sync_seq, .. } => {
                // The install replaces the local state under the snapshot's
                // generation: a reset is a generation change. Within that
                // generation, a second install (the first one's ack was
                // refused) stands at a base no lower.
                self.snapshots_installed += 1;
                self.moves_checked += 1;
                if let Some(synced) = self.synced_generation.filter(|s| generation <= *s) {
                    self.violation(format!(
                        "snapshot installed at generation {generation}, not above generation {synced} the device synced at (D7)"
                    ));
                }
                self.applied =
                    self.forward("applied_sync_seq (snapshot base)", self.applied, (generation, base_sync_seq));
                self.awaiting_snapshot = None;
                self.cursors.clear();
            }
            Change::SnapshotFailed { reason, .. } => {
                self.snapshot_failures += 1;
                if reason.contains("digest mismatch") {
                    self.digest_mismatches += 1;
                }
                self.last_snapshot_failure = Some(reason);
            }
            Change::GroupPulled { cleared, .. } => {
                self.group_pulls += 1;
                self.group_clears += u64::from(cleared);
            }
            Change::Lagged { missed } => self.lagged += missed,
            Change::Exited(exit) => {
                if let Exit::Aborted(point) = &exit {
                    if CrashAt::SNAPSHOT.iter().any(|at| at.matches(point)) {
                        self.snapshot_aborts += 1;
                    } else {
                        self.aborts += 1;
                    }
                }
                self.exited = Some(exit);
            }
            _ => {}
        }
    }
}

/// One device: its config (through the proxy), its current client, the
/// task recording its changes, and its crash plan.
pub(super) struct Device {
    pub(super) user: String,
    pub(super) id: String,
    pub(super) config: ClientConfig,
    pub(super) client: Option<Client>,
    pub(super) recorder: Option<JoinHandle<()>>,
    pub(super) log: Arc<Mutex<DeviceLog>>,
    pub(super) crash: Arc<Mutex<Option<CrashAt>>>,
}

impl Device {
    pub(super) fn new(user: &str, id: &str, url: &str, db: PathBuf, timeout: Duration) -> Device {
        let crash: Arc<Mutex<Option<CrashAt>>> = Arc::default();
        let plan = crash.clone();
        let hook: FaultHook = Arc::new(move |p: &FaultPoint| {
            let mut plan = plan.lock().expect("crash plan lock");
            match *plan {
                Some(at) if at.matches(p) => {
                    *plan = None;
                    at.action()
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

    pub(super) fn name(&self) -> String {
        format!("{}/{}", self.user, self.id)
    }

    /// Opens a client on the local store, subscribes, starts it.
    pub(super) async fn open(&mut self) -> anyhow::Result<()> {
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
    pub(super) async fn close(&mut self) {
        if let Some(client) = self.client.take() {
            client.stop().await;
        }
        // The change stream ends once the client is gone.
        if let Some(recorder) = self.recorder.take() {
            let _ = recorder.await;
        }
    }

    pub(super) fn client(&self) -> &Client {
        self.client.as_ref().expect("device open")
    }

    /// Open (not stopped by a fall-off step).
    pub(super) fn is_open(&self) -> bool {
        self.client.is_some()
    }

    /// Reads the local position and cursors and checks they only moved
    /// forward. A client killed at a crash point reads nothing more.
    pub(super) async fn poll(&self) {
        let Some(client) = &self.client else { return };
        let (Ok(pos), Ok(convs)) = (client.position().await, client.conversations().await) else { return };
        self.log.lock().expect("log lock").durable(pos, &convs);
    }

    pub(super) fn exited(&self) -> bool {
        self.log.lock().expect("log lock").exited.is_some()
    }
}
