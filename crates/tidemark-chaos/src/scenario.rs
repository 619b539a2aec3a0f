//! One chaos run: a server on a fixed SQLite directory, the proxy in front
//! of it, users with several SDK devices each talking through the proxy in
//! direct conversations and in group conversations whose membership
//! changes during the run, and a seeded schedule of faults on top of the
//! proxy's: server restarts, clients stopped and reopened on their local
//! store, clients killed at a crash point by the SDK's fault hook.
//!
//! Groups are created, and their membership changed, over each user's own
//! authenticated HTTP connection straight to the server (`Http::rpc`, not
//! through the proxy: the SDK has no call for them, and these operations
//! are the scenario's ground truth, not what is under test). Each group's
//! owner (its creator) stays in it; during the send phase, seeded steps
//! make the owner remove a member, a member add a non-member (back: a new
//! period), and a member leave. Every change is recorded with the `msg_seq`
//! of its `member.join`/`member.leave` event from the server's reply, and
//! the step it was made at. Sends go on from members throughout (a send
//! racing a removal may still be refused `NOT_MEMBER`), and a few go on
//! from non-members on purpose; a refusal is an outcome the checker judges,
//! not an accepted message.
//!
//! Snapshots (D7, L1–L2). The server runs with a user-log retention of
//! about a second ([`Retention`]: keep window, inactivity window, a pass
//! every 100 ms) and small, short-lived snapshots (a few events per
//! conversation, 5 s; in-process, a few items per page too). Seeded fall-off steps stop a client whose
//! user has another device running, let traffic and retention passes go on
//! until the server's store shows the user's trim point above the stopped
//! device's ACK (its cursor fell off the retained log), then reopen it
//! while faults continue: its first sync must get `RESET_REQUIRED`, and
//! the SDK rebuilds from a snapshot. Some of those rebuilds are armed with
//! a snapshot fault (a crash after `snapshot.begin`, after a page, before
//! or after the install's commit, or a corrupt page). Devices that lag
//! under faults may fall off on their own too; every reset is judged the
//! same way. While running, the change stream and polls of the local store
//! check that a reset is a generation change (`RESET_REQUIRED` above the
//! generation the device last synced at, a snapshot installed above it)
//! and that within a generation nothing moves back; a fallen-off device
//! must not apply any page before its snapshot (L2). After settling, each
//! device's events at or below `history_to` that it does not hold are
//! fetched with `history` over the user's control connection, for the
//! checker.
//!
//! The server runs in-process ([`ServerMode::InProcess`], the CI run): a
//! "kill" is [`RunningServer::stop`] followed by a new [`Server::start`] on
//! the same data directory and address, a graceful stop and not a crash;
//! the server's store is read through its own API. With
//! [`ServerMode::Binary`] it is the real `tidemark serve`, SIGKILLed and
//! started again on the same directory and address, with the same
//! retention passed as flags ([`Retention::serve_args`]: the windows and
//! the snapshot lifetime in whole seconds, rounded up); its store (the
//! device's cursor, the user's head and trim point) is read from a
//! read-only SQLite connection to its database file, beside the live
//! server (WAL allows a reader in another process). `tidemark serve` has
//! no flag for the snapshot's page size, so the binary's snapshots have
//! its default pages (200 items: a snapshot is usually one page). This
//! module owns the run's timeline and collects the facts; [`crate::check`]
//! judges them.
//!
//! Every random choice of the scenario comes from generators seeded with
//! the run's seed (one for the timeline and the sends, one for membership
//! changes, one for snapshot faults); the proxy derives its own from the
//! same seed. What the seed cannot fix is timing (and the SDK's own
//! jitter), so a replay takes the same decisions but may interleave them
//! differently, and whether a lagging device falls off on its own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tidemark_client::proto::{
    op, ConvCreateOk, ConvCreateReq, ConvMemberOk, ConvMemberReq, Envelope, ErrorCode, ErrorFrame, HistoryOk,
    HistoryReq,
};
use tidemark_client::{
    Change, Client, ClientConfig, ClientError, ConnState, Conversation, Exit, FaultAction, FaultHook, FaultPoint, Http,
    Message, OutboxState, SyncPosition,
};
use tidemark_server::{RunningServer, Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tokio::task::JoinHandle;

use crate::check::{self, Accepted, ConvFacts, ConvKind, DeviceView, MemberOp, MembershipChange, Sent};
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
/// The device id of each user's control connection (group operations,
/// straight to the server); it never syncs.
const CONTROL_DEVICE: &str = "chaos-ctl";
/// Attempts at one control call (transport failures, server restarts).
const CONTROL_ATTEMPTS_MAX: u32 = 50;
/// One control request gives up after this long (and is retried).
const CONTROL_WAIT: Duration = Duration::from_secs(5);
/// The first membership steps of each group, so that even a short run
/// removes a member, adds one back (a new period) and has one leave;
/// later steps pick any feasible operation.
const MEMBERSHIP_CYCLE: [MemberOp; 4] = [MemberOp::Remove, MemberOp::Add, MemberOp::Leave, MemberOp::Add];
/// Mixed into the seed for the membership generator.
const MEMBERSHIP_SEED: u64 = 0x6d65_6d62_6572_7321;
/// Mixed into the seed for the snapshot-fault generator.
const SNAPSHOT_FAULT_SEED: u64 = 0x736e_6170_7368_6f74;
/// How often stopped devices are looked at once the sends are over.
const FALLOFF_POLL: Duration = Duration::from_millis(50);
/// Scenario steps a fall-off stop lasts when the server's store has no
/// cursor for the device (it never logged in): it cannot fall off.
const FALLOFF_UNKNOWN_STEPS: usize = 20;
/// A read of the binary server's store waits this long for a lock.
const STORE_READ_BUSY: Duration = Duration::from_secs(2);

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
    /// Group conversations created at setup. Even-numbered ones start with
    /// every user, odd ones with their owner and one other user (so an add
    /// may be a first join, not only a rejoin).
    pub groups: usize,
    /// Membership changes (remove, add, leave) during the send phase.
    pub membership_changes: usize,
    /// Percent of sends a user makes to a group they are not in (refused
    /// `NOT_MEMBER`, unless added back before the server sees the send).
    pub stray_send_percent: u32,
    /// Fall-off steps: a client stopped until its cursor fell below the
    /// user's retained log, then reopened (a snapshot rebuild follows).
    pub falloffs: usize,
    /// A stopped client is reopened after this long even if it did not
    /// fall off (noted).
    pub falloff_wait_max: Duration,
    /// Percent of fall-off reopens armed with a snapshot fault.
    pub snapshot_fault_percent: u32,
    /// The server's retention and snapshot shape.
    pub retention: Retention,
    pub faults: FaultConfig,
    pub server: ServerMode,
    /// The SDK's request timeout: short, so a dropped frame costs little.
    pub request_timeout: Duration,
    /// The settle phase gives up after this long (the checker then reports
    /// whatever did not arrive).
    pub settle_max: Duration,
}

/// The server's user-log retention (docs/protocol.md §3.25) and snapshot
/// shape (§3.21) for the run: short enough that a client stopped for about
/// a second falls off the retained log once its user's other device moved
/// on. In-process it is the server's configuration; the binary gets it as
/// flags ([`Retention::serve_args`]), but for the page size, which has no
/// flag (the binary keeps its default).
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// `RetentionPolicy::keep_events_younger_than_ms`: log entries younger
    /// than this are never trimmed (it also spares a running device that
    /// is only a little late).
    pub keep_events_ms: i64,
    /// `RetentionPolicy::device_inactive_after_ms`: a device whose server
    /// cursor did not move for this long stops holding the fence.
    pub device_inactive_ms: i64,
    /// `ServerConfig::retention_every`: how often the pass runs.
    pub every: Duration,
    /// `ServerConfig::snapshot_messages_per_conv`: small, so a snapshot
    /// leaves the older events of a conversation as history (`history_to`).
    pub snapshot_events_per_conv: u32,
    /// `ServerConfig::snapshot_page_items`: small, so a snapshot has pages
    /// (in-process only: `tidemark serve` has no flag for it).
    pub snapshot_page_items: usize,
    /// `ServerConfig::snapshot_ttl`: short, because a snapshot that will
    /// never be installed (its `snapshot.begin` reply was lost and the
    /// device began another) still fences its user's log until it expires
    /// (docs/protocol.md §3.21, §3.25); with the default 30 minutes, one
    /// lost reply would keep that user from falling off for the rest of
    /// the run. An install that outlives it is refused and begins anew.
    pub snapshot_ttl: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            keep_events_ms: 1000,
            device_inactive_ms: 1000,
            every: Duration::from_millis(100),
            snapshot_events_per_conv: 4,
            snapshot_page_items: 7,
            snapshot_ttl: Duration::from_secs(5),
        }
    }
}

impl Retention {
    /// The in-process server's configuration.
    fn server_config(&self) -> ServerConfig {
        let mut config = ServerConfig {
            admin_token: Some(ADMIN.into()),
            retention_every: self.every,
            snapshot_messages_per_conv: self.snapshot_events_per_conv,
            snapshot_page_items: self.snapshot_page_items,
            snapshot_ttl: self.snapshot_ttl,
            ..ServerConfig::default()
        };
        if let Some(policy) = config.retention.as_mut() {
            policy.keep_events_younger_than_ms = self.keep_events_ms;
            policy.device_inactive_after_ms = self.device_inactive_ms;
        }
        config
    }

    /// The same retention as `tidemark serve` flags. The windows and the
    /// snapshot lifetime are whole seconds there: rounded up, so never
    /// shorter (the default 1000 ms windows and 5 s lifetime are exact).
    /// The page size has no flag.
    pub fn serve_args(&self) -> Vec<String> {
        let ms_to_secs = |ms: u128| ms.div_ceil(1000);
        let keep = ms_to_secs(u128::try_from(self.keep_events_ms.max(0)).unwrap_or(0));
        let inactive = ms_to_secs(u128::try_from(self.device_inactive_ms.max(0)).unwrap_or(0));
        let ttl = ms_to_secs(self.snapshot_ttl.as_millis());
        // `--retention-every-ms` takes 10 at least.
        let every = self.every.as_millis().max(10);
        vec![
            "--log-keep-secs".into(),
            keep.to_string(),
            "--device-inactive-secs".into(),
            inactive.to_string(),
            "--retention-every-ms".into(),
            every.to_string(),
            "--snapshot-ttl-secs".into(),
            ttl.to_string(),
            "--snapshot-messages-per-conv".into(),
            self.snapshot_events_per_conv.to_string(),
        ]
    }
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
            groups: 2,
            membership_changes: 8,
            stray_send_percent: 5,
            falloffs: 2,
            falloff_wait_max: Duration::from_secs(5),
            snapshot_fault_percent: 50,
            retention: Retention::default(),
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
            membership_changes: (scale * 4).clamp(8, 400),
            falloffs: scale.clamp(2, 50),
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
    /// Membership changes the server made, by operation.
    pub membership: BTreeMap<&'static str, usize>,
    /// Sends queued on purpose by a user out of the group.
    pub stray_sends: usize,
    /// `RESET_REQUIRED` answers the devices got (change stream).
    pub resets: u64,
    /// Snapshots installed locally (change stream).
    pub snapshots_installed: u64,
    /// Snapshot install attempts that failed (refused, interrupted, corrupt).
    pub snapshot_failures: u64,
    /// Fall-off steps: clients stopped.
    pub falloff_stops: usize,
    /// Of those, reopened once the server's store showed their ACK below
    /// the user's trim point.
    pub fell_off: usize,
    /// Of those, reopened without having fallen off (deadline, or binary).
    pub falloff_timeouts: usize,
    /// Snapshot faults armed at fall-off reopens, crashes they caused and
    /// corrupt pages they made (digest mismatches).
    pub snapshot_faults_armed: usize,
    pub snapshot_aborts_fired: usize,
    pub digest_mismatches: u64,
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
            self.check.history_only
        )?;
        writeln!(
            f,
            "  snapshots: {} resets seen, {} snapshots installed on {} devices, {} install attempts failed; fall-offs: {} clients stopped, {} fell off the retained log, {} reopened without; snapshot faults: {} armed, {} crashes, {} corrupt pages",
            self.resets,
            self.snapshots_installed,
            self.check.rebuilt_devices,
            self.snapshot_failures,
            self.falloff_stops,
            self.fell_off,
            self.falloff_timeouts,
            self.snapshot_faults_armed,
            self.snapshot_aborts_fired,
            self.digest_mismatches
        )?;
        writeln!(
            f,
            "  after snapshots: {} messages verified on rebuilt devices ({} held from a snapshot, the rest synced after it); {} history-only events below {} history boundaries, each served once by `history`",
            self.check.verified_after_snapshot,
            self.check.from_snapshot,
            self.check.history_only,
            self.check.history_boundaries
        )?;
        let ops: Vec<String> = self.membership.iter().map(|(k, n)| format!("{k} {n}")).collect();
        writeln!(
            f,
            "  groups: {} groups, {} membership changes ({}); {} group messages accepted, {} sends refused NOT_MEMBER ({} queued by non-members on purpose)",
            self.check.groups,
            self.check.membership_changes,
            ops.join(", "),
            self.check.group_accepted,
            self.check.refused_not_member,
            self.stray_sends
        )?;
        writeln!(
            f,
            "  periods: {} group messages and {} membership events verified inside periods, {} out-of-period events confirmed absent",
            self.check.group_verified, self.check.membership_events_verified, self.check.out_of_period_absent
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

/// Where the SDK's fault hook kills a client (or, for
/// [`CrashAt::CorruptPage`], damages the first item of a snapshot page).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CrashAt {
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
    const ROUTINE: [CrashAt; 4] =
        [CrashAt::BeforeCommit, CrashAt::AfterCommit, CrashAt::BeforeSend, CrashAt::AfterSendOk];
    /// The points of a snapshot install: armed at fall-off reopens.
    const SNAPSHOT: [CrashAt; 5] = [
        CrashAt::SnapshotBegun,
        CrashAt::SnapshotPage,
        CrashAt::SnapshotBeforeCommit,
        CrashAt::SnapshotAfterCommit,
        CrashAt::CorruptPage,
    ];

    fn matches(self, p: &FaultPoint) -> bool {
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

    fn action(self) -> FaultAction {
        match self {
            CrashAt::CorruptPage => FaultAction::Corrupt,
            _ => FaultAction::Abort,
        }
    }
}

/// A stopped device the server's store showed fallen off the retained log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FellOff {
    /// The device's server cursor then: generation and ACK.
    generation: u64,
    acked: u64,
    /// The user's trim point then, above `acked`.
    trimmed_upto: u64,
}

/// What the change stream of one device showed, across all the client
/// instances opened on its local store.
#[derive(Default)]
struct DeviceLog {
    accepted: HashMap<String, Accepted>,
    duplicates: usize,
    /// `client_msg_id` → why the outbox gave up on it.
    failed: HashMap<String, String>,
    /// `(generation, applied_sync_seq)` of the last page or installed
    /// snapshot.
    applied: Option<(u64, u64)>,
    /// `(generation, acked_sync_seq)` of the last confirmed ACK.
    acked: Option<(u64, u64)>,
    /// The highest generation the server confirmed this device synced at
    /// (a page served, an ACK or a snapshot ACK answered): a
    /// `RESET_REQUIRED` and a snapshot install must come above it.
    synced_generation: Option<u64>,
    /// Conversation → contiguous cursor, as the change stream reported it
    /// since the last snapshot install.
    cursors: HashMap<String, u64>,
    moves_checked: u64,
    exited: Option<Exit>,
    aborts: usize,
    /// Crashes at a snapshot install's fault points.
    snapshot_aborts: usize,
    lagged: u64,
    resets: u64,
    snapshots_installed: u64,
    snapshot_failures: u64,
    digest_mismatches: u64,
    /// Why the last snapshot install attempt failed (for the notes).
    last_snapshot_failure: Option<String>,
    /// Set when the scenario reopened this device fallen off the retained
    /// log; cleared by its next snapshot install. No page may apply
    /// meanwhile (L2).
    awaiting_snapshot: Option<FellOff>,
    /// Every fall-off, with the local generation at the end of the run
    /// checked above its generation.
    fell_off: Vec<FellOff>,
    /// Cursor notifications that arrived after a later move's.
    reordered: u64,
    /// Polled from the local store: `(generation, applied, acked)`.
    durable_position: Option<(u64, u64, u64)>,
    /// Polled from the local store: conversation → contiguous cursor, in
    /// the generation of `durable_position`.
    durable_cursors: HashMap<String, u64>,
    violations: Vec<String>,
    violations_dropped: u64,
}

impl DeviceLog {
    /// Checks a poll of the local store against the previous one: the
    /// generation never moves back, and within a generation neither the
    /// applied position, the ACK nor any conversation's contiguous cursor
    /// moves back. Only a new generation (a reset, made visible by the
    /// snapshot install that stores it) starts the cursors over.
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
                    "{} local contiguous cursor moved back in generation {}: {last} → {}",
                    c.conv, now.0, c.contiguous_msg_seq
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

    /// The server confirmed the device at `generation`.
    fn synced_at(&mut self, generation: u64) {
        self.synced_generation = self.synced_generation.max(Some(generation));
    }

    /// The scenario reopens this device, fallen off the retained log.
    fn fall_off(&mut self, f: FellOff) {
        self.awaiting_snapshot = Some(f);
        self.fell_off.push(f);
    }

    fn record(&mut self, change: Change) {
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

    /// Open (not stopped by a fall-off step).
    fn is_open(&self) -> bool {
        self.client.is_some()
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
    retention: Retention,
    dir: PathBuf,
    addr: SocketAddr,
    running: Option<Running>,
}

/// A device's server cursor next to its user's trim point.
#[derive(Debug, Clone)]
struct Standing {
    /// The device's state on the server.
    state: String,
    /// `ACTIVE` or `RECOVERING`: the device's ACK held the fence while it
    /// was active (other states never hold it, docs/protocol.md §3.25).
    fencing: bool,
    generation: u64,
    acked: u64,
    trimmed_upto: u64,
}

impl Standing {
    /// L2: the device's ACK is below the trim point, so what it has not
    /// ACKed is gone and its next first page must be `RESET_REQUIRED`.
    fn fell_off(&self) -> Option<FellOff> {
        (self.fencing && self.acked < self.trimmed_upto).then_some(FellOff {
            generation: self.generation,
            acked: self.acked,
            trimmed_upto: self.trimmed_upto,
        })
    }
}

impl ServerSlot {
    async fn boot(mode: ServerMode, retention: Retention, dir: PathBuf) -> anyhow::Result<ServerSlot> {
        let (running, addr) = boot(&mode, &retention, &dir, "127.0.0.1:0").await?;
        Ok(ServerSlot { mode, retention, dir, addr, running: Some(running) })
    }

    /// Events per conversation a snapshot carries, as this server is
    /// configured (the binary gets it as `--snapshot-messages-per-conv`).
    fn snapshot_events_per_conv(&self) -> u64 {
        u64::from(self.retention.snapshot_events_per_conv)
    }

    /// The device's server cursor and its user's trim point while the
    /// server runs: from its store in-process, from a read-only connection
    /// to the binary's database file ([`read_store`]). `None` while the
    /// server is down, or when it has no cursor for the device.
    async fn standing(&self, user: &str, device: &str) -> anyhow::Result<Option<Standing>> {
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
    fn db_file(&self) -> PathBuf {
        self.dir.join(tidemark_sqlite::DB_FILE)
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The user's head on the server while it runs (in-process from its
    /// store, from the binary's database file read-only).
    async fn head(&self, user: &str) -> anyhow::Result<Option<u64>> {
        match &self.running {
            Some(Running::InProcess(s)) => {
                Ok(Some(s.state.store.user_high_watermark(user).await.map_err(|e| anyhow::anyhow!("{e}"))?))
            }
            Some(Running::Binary(_)) => Ok(read_store(self.db_file(), user, None).await?.map(|r| r.high_watermark)),
            None => Ok(None),
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
            let (running, _) = boot(&self.mode, &self.retention, &self.dir, &self.addr.to_string()).await?;
            self.running = Some(running);
        }
        Ok(())
    }
}

async fn boot(
    mode: &ServerMode,
    retention: &Retention,
    dir: &std::path::Path,
    listen: &str,
) -> anyhow::Result<(Running, SocketAddr)> {
    match mode {
        ServerMode::InProcess => {
            let store = SqliteStore::open(dir).context("open the server store")?;
            let config = retention.server_config();
            let s = Server::start(listen, store, config).await.context("start the server")?;
            let addr = s.addr;
            Ok((Running::InProcess(s), addr))
        }
        ServerMode::Binary(bin) => {
            let (bin, dir, listen, retention) = (bin.clone(), dir.to_owned(), listen.to_owned(), *retention);
            tokio::task::spawn_blocking(move || spawn_binary(&bin, &dir, &listen, &retention)).await?
        }
    }
}

/// What [`read_store`] reads of one user on the binary server.
struct StoreRead {
    high_watermark: u64,
    trimmed_upto: u64,
    /// The device's state, generation and ACK, when asked for one and it
    /// has a cursor.
    device: Option<(String, u64, u64)>,
}

/// Reads the user's head and trim point (`user_heads`) and the device's
/// cursor (`devices`), the columns the store's own `user_log` and `device`
/// read, from the live binary server's database file, in one read
/// transaction over a read-only connection of this process. Not through
/// `SqliteStore::open`, which migrates, checkpoints and starts a writer:
/// this connection writes nothing (WAL lets it read beside the server's
/// writer, which it never blocks). `None` if the file is not there yet.
async fn read_store(db: PathBuf, user: &str, device: Option<&str>) -> anyhow::Result<Option<StoreRead>> {
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
fn spawn_binary(
    bin: &std::path::Path,
    dir: &std::path::Path,
    listen: &str,
    retention: &Retention,
) -> anyhow::Result<(Running, SocketAddr)> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(bin)
        .args(["serve", "--listen", listen, "--data"])
        .arg(dir)
        .args(retention.serve_args())
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

/// One user's own authenticated connection straight to the server (not
/// through the proxy, no faults), for the group operations the SDK has no
/// call for. It logs in as its own device, which never syncs.
struct Control {
    http: Http,
    user: String,
    token: Option<String>,
}

impl Control {
    fn new(url: &str, user: &str) -> Control {
        Control { http: Http::new(url), user: user.to_owned(), token: None }
    }

    /// Calls `op` until the server answers it: transport failures, a
    /// restarting server and an expired token are retried (every call the
    /// scenario makes carries a `client_msg_id`, so a retry returns the
    /// original event). `Ok(Err(..))` is a contract refusal.
    async fn call(
        &mut self,
        op: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<Result<serde_json::Value, ErrorFrame>> {
        let mut last = String::new();
        for attempt in 0..CONTROL_ATTEMPTS_MAX {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let token = match &self.token {
                Some(t) => t.clone(),
                None => match tokio::time::timeout(CONTROL_WAIT, self.http.login(&self.user, PASSWORD, CONTROL_DEVICE))
                    .await
                {
                    Ok(Ok(ok)) => {
                        self.token = Some(ok.access_token.clone());
                        ok.access_token
                    }
                    Ok(Err(e)) => {
                        last = format!("login: {e}");
                        continue;
                    }
                    Err(_) => {
                        last = "login timed out".into();
                        continue;
                    }
                },
            };
            match tokio::time::timeout(CONTROL_WAIT, self.http.rpc::<_, serde_json::Value>(&token, op, &body)).await {
                Ok(Ok(v)) => return Ok(Ok(v)),
                Ok(Err(ClientError::Server(f))) => match f.code {
                    ErrorCode::Unauthenticated | ErrorCode::TokenInvalid => {
                        self.token = None;
                        last = format!("{} ({})", f.code, f.message);
                    }
                    ErrorCode::Unavailable | ErrorCode::RateLimited | ErrorCode::Internal => {
                        last = format!("{} ({})", f.code, f.message);
                    }
                    _ => return Ok(Err(f)),
                },
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "timed out".into(),
            }
        }
        bail!("{} {op}: gave up after {CONTROL_ATTEMPTS_MAX} attempts: {last}", self.user)
    }
}

impl Control {
    /// Every event `history` serves this user in `conv` below `before_seq`,
    /// newest first, page after page; `Err` holds a refusal.
    async fn history(&mut self, conv: &str, before_seq: u64) -> anyhow::Result<Result<Vec<Message>, String>> {
        let mut out = Vec::new();
        let mut before = before_seq;
        loop {
            let req = HistoryReq {
                conv: conv.to_owned(),
                before_seq: Some(before),
                limit: Some(tidemark_client::proto::HISTORY_LIMIT_MAX),
            };
            let ok: HistoryOk = match self.call(op::HISTORY, serde_json::to_value(&req)?).await? {
                Ok(reply) => serde_json::from_value(reply).context("history.ok")?,
                Err(f) => return Ok(Err(format!("{} ({})", f.code, f.message))),
            };
            out.extend(ok.messages.into_iter().map(message_of));
            match (ok.has_more, ok.next_cursor) {
                (true, Some(next)) if next < before => before = next,
                (true, next) => return Ok(Err(format!("has_more with next_cursor {next:?} below {before}"))),
                (false, _) => return Ok(Ok(out)),
            }
        }
    }
}

/// A served envelope as the checker reads events (no `sync_seq`: no log
/// entry delivered it).
fn message_of(e: Envelope) -> Message {
    Message {
        conv: e.conv,
        msg_seq: e.msg_seq,
        message_id: e.message_id,
        kind: e.kind,
        state: e.state,
        sender: e.sender,
        content: e.content,
        created_at: e.created_at,
        version: e.version,
        reactions: serde_json::to_value(&e.reactions).unwrap_or_default(),
        sync_seq: None,
    }
}

/// One group as the scenario made it.
struct GroupState {
    conv: String,
    /// The creator: the only user who may remove members. The scenario
    /// never removes the owner and never makes it leave.
    owner: String,
    /// Members at creation (a period from `msg_seq` 1).
    initial: Vec<String>,
    /// Current members, as the server's answers say.
    members: BTreeSet<String>,
    /// Membership changes made so far.
    steps: usize,
}

/// The groups, their control connections and every change made.
struct Groups {
    users: Vec<String>,
    control: HashMap<String, Control>,
    groups: Vec<GroupState>,
    changes: Vec<MembershipChange>,
    rng: StdRng,
}

impl Groups {
    /// Creates `cfg.groups` groups over the owners' control connections.
    async fn create(cfg: &ChaosConfig, url: &str, users: &[String]) -> anyhow::Result<Groups> {
        let control = users.iter().map(|u| (u.clone(), Control::new(url, u))).collect();
        let rng = StdRng::seed_from_u64(cfg.seed ^ MEMBERSHIP_SEED);
        let mut g = Groups { users: users.to_vec(), control, groups: Vec::new(), changes: Vec::new(), rng };
        for k in 0..cfg.groups {
            let owner = users[k % users.len()].clone();
            let others: Vec<String> = if k % 2 == 0 || users.len() < 3 {
                users.iter().filter(|u| **u != owner).cloned().collect()
            } else {
                vec![users[(k + 1) % users.len()].clone()]
            };
            let req = ConvCreateReq {
                kind: "group".into(),
                members: others,
                client_msg_id: Some(format!("chaos-group-{k}")),
            };
            let body = serde_json::to_value(&req)?;
            let reply =
                g.control.get_mut(&owner).expect("a control connection per user").call(op::CONV_CREATE, body).await?;
            let reply = reply.map_err(|f| anyhow::anyhow!("{owner} creates group {k}: {} ({})", f.code, f.message))?;
            let ok: ConvCreateOk = serde_json::from_value(reply).context("conv.create.ok")?;
            g.groups.push(GroupState {
                conv: ok.conv,
                owner,
                initial: ok.members.clone(),
                members: ok.members.into_iter().collect(),
                steps: 0,
            });
        }
        Ok(g)
    }

    /// `user`'s control connection.
    fn control(&mut self, user: &str) -> &mut Control {
        self.control.get_mut(user).expect("a control connection per user")
    }

    /// The groups `user` is in now, and those they are not in.
    fn of(&self, user: &str) -> (Vec<&str>, Vec<&str>) {
        let (inside, outside): (Vec<&GroupState>, Vec<&GroupState>) =
            self.groups.iter().partition(|g| g.members.contains(user));
        (inside.iter().map(|g| g.conv.as_str()).collect(), outside.iter().map(|g| g.conv.as_str()).collect())
    }

    /// One seeded membership step in group `g` at scenario step `step`:
    /// the group's first steps follow [`MEMBERSHIP_CYCLE`], later ones any
    /// feasible operation; targets and callers are drawn among who may.
    async fn change(&mut self, g: usize, step: usize, report: &mut Report) -> anyhow::Result<()> {
        let group = &self.groups[g];
        let outsiders: Vec<String> = self.users.iter().filter(|u| !group.members.contains(*u)).cloned().collect();
        let removable: Vec<String> = group.members.iter().filter(|u| **u != group.owner).cloned().collect();
        let feasible = |op: &MemberOp| match op {
            MemberOp::Add => !outsiders.is_empty(),
            MemberOp::Remove | MemberOp::Leave => !removable.is_empty(),
        };
        let op = match MEMBERSHIP_CYCLE.get(group.steps) {
            Some(op) if feasible(op) => *op,
            _ => {
                let ops: Vec<MemberOp> = MemberOp::ALL.into_iter().filter(feasible).collect();
                let Some(op) = ops.get(self.rng.random_range(0..ops.len().max(1))) else {
                    return Ok(());
                };
                *op
            }
        };
        let members: Vec<&String> = group.members.iter().collect();
        let (target, by) = match op {
            MemberOp::Add => (
                outsiders[self.rng.random_range(0..outsiders.len())].clone(),
                members[self.rng.random_range(0..members.len())].clone(),
            ),
            MemberOp::Remove => (removable[self.rng.random_range(0..removable.len())].clone(), group.owner.clone()),
            MemberOp::Leave => {
                let t = removable[self.rng.random_range(0..removable.len())].clone();
                (t.clone(), t)
            }
        };
        let req = ConvMemberReq {
            conv: group.conv.clone(),
            user: (op != MemberOp::Leave).then(|| target.clone()),
            client_msg_id: Some(format!("chaos-member-{g}-{}", group.steps)),
        };
        let conv = group.conv.clone();
        let body = serde_json::to_value(&req)?;
        let control = self.control.get_mut(&by).expect("a control connection per user");
        match control.call(op.op(), body).await? {
            Ok(reply) => {
                let ok: ConvMemberOk = serde_json::from_value(reply).with_context(|| format!("{} reply", op.op()))?;
                let group = &mut self.groups[g];
                group.steps += 1;
                if op == MemberOp::Add {
                    group.members.insert(target.clone());
                } else {
                    group.members.remove(&target);
                }
                *report.membership.entry(op.op()).or_default() += 1;
                self.changes.push(MembershipChange { conv, op, user: target, by, msg_seq: ok.msg_seq, step });
            }
            // Every change the scenario asks for is allowed by the
            // contract (docs/protocol.md §3.7–§3.9): a refusal is a bug.
            Err(f) => report.violations.push(format!(
                "{by}: {} {target} in {conv} at step {step} refused: {} ({})",
                op.op(),
                f.code,
                f.message
            )),
        }
        Ok(())
    }

    /// Every group's facts for the checker.
    fn facts(&self) -> Vec<(String, ConvFacts)> {
        self.groups
            .iter()
            .map(|g| {
                let changes = self.changes.iter().filter(|c| c.conv == g.conv).cloned().collect();
                (g.conv.clone(), ConvFacts { kind: ConvKind::Group, members: g.initial.clone(), changes })
            })
            .collect()
    }
}

/// What happens before message `at` is sent. `Membership` is one change
/// in that group; which one is decided then ([`Groups::change`]).
/// `FallOff` stops `device`, or the next one that may be stopped
/// ([`Falloffs::stop`]).
#[derive(Debug, Clone, Copy)]
enum Event {
    RestartServer { down: Duration },
    ReopenClient { device: usize },
    ArmCrash { device: usize, at: CrashAt },
    Membership { group: usize },
    FallOff { device: usize },
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
        let at = CrashAt::ROUTINE[rng.random_range(0..CrashAt::ROUTINE.len())];
        events.push((rng.random_range(0..span), Event::ArmCrash { device: rng.random_range(0..devices), at }));
    }
    if cfg.groups > 0 {
        for _ in 0..cfg.membership_changes {
            let group = rng.random_range(0..cfg.groups);
            events.push((rng.random_range(1..span.max(2)), Event::Membership { group }));
        }
    }
    // Early enough (some 40 steps before the end) that traffic goes on
    // while the client is stopped, so its user's other device moves the
    // fence past it, and after it rebuilt.
    let last_stop = span.saturating_sub(40).clamp(span / 3, span * 3 / 4);
    for _ in 0..cfg.falloffs {
        let device = rng.random_range(0..devices);
        events.push((rng.random_range(span / 20..=last_stop), Event::FallOff { device }));
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
    let mut server = ServerSlot::boot(cfg.server.clone(), cfg.retention, dir.path().join("server")).await?;
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
    let directs_of: HashMap<&str, Vec<&str>> = users
        .iter()
        .map(|u| {
            let convs = members.iter().filter(|(_, m)| m.contains(u)).map(|(c, _)| c.as_str()).collect();
            (u.as_str(), convs)
        })
        .collect();
    let mut groups = Groups::create(&cfg, &server.url(), &users).await?;

    let server_kind = match cfg.server {
        ServerMode::InProcess => "in-process, graceful restarts",
        ServerMode::Binary(_) => "tidemark binary, SIGKILL restarts",
    };
    let mut report = Report { seed: cfg.seed, server: server_kind, ..Report::default() };
    if matches!(cfg.server, ServerMode::Binary(_)) {
        report.notes.push(format!(
            "tidemark serve {}; snapshot pages: the binary's default {} items (no flag)",
            cfg.retention.serve_args().join(" "),
            ServerConfig::default().snapshot_page_items
        ));
    }
    let events = schedule(&cfg, devices.len(), &mut rng);
    let mut next_event = 0;
    let mut sent: Vec<Sent> = Vec::with_capacity(cfg.messages);
    let mut falloffs = Falloffs::new(&cfg);
    proxy.set_faults(true);
    for i in 0..cfg.messages {
        while next_event < events.len() && events[next_event].0 <= i {
            let mut world =
                World { server: &mut server, devices: &mut devices, groups: &mut groups, falloffs: &mut falloffs };
            apply(events[next_event].1, i, &mut world, &mut report).await?;
            next_event += 1;
        }
        reopen_dead(&mut devices, &mut report).await?;
        falloffs.reopen(Some(i), &server, &mut devices, &mut report).await?;
        for d in &devices {
            d.poll().await;
        }
        // Any device but a stopped one sends.
        let open: Vec<usize> = (0..devices.len()).filter(|d| devices[*d].is_open()).collect();
        let d = open[rng.random_range(0..open.len())];
        // A direct conversation or a group the user is in now; now and then
        // on purpose a group the user is out of.
        let (inside, outside) = groups.of(&devices[d].user);
        let stray = !outside.is_empty() && rng.random_range(0..100) < cfg.stray_send_percent;
        let conv = if stray {
            outside[rng.random_range(0..outside.len())].to_owned()
        } else {
            let mut convs = directs_of[devices[d].user.as_str()].clone();
            convs.extend(inside);
            convs[rng.random_range(0..convs.len())].to_owned()
        };
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
            step: i,
        });
        report.stray_sends += usize::from(stray);
        let gap = rng.random_range(0..=cfg.send_gap_ms_max);
        tokio::time::sleep(Duration::from_millis(gap)).await;
    }
    while next_event < events.len() {
        let mut world =
            World { server: &mut server, devices: &mut devices, groups: &mut groups, falloffs: &mut falloffs };
        apply(events[next_event].1, cfg.messages, &mut world, &mut report).await?;
        next_event += 1;
    }
    // Stopped clients wait, faults still on, until they fell off (or their
    // deadline passed).
    loop {
        reopen_dead(&mut devices, &mut report).await?;
        falloffs.reopen(None, &server, &mut devices, &mut report).await?;
        if falloffs.stopped.is_empty() {
            break;
        }
        for d in &devices {
            d.poll().await;
        }
        tokio::time::sleep(FALLOFF_POLL).await;
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
    let mut refused: HashMap<String, String> = HashMap::new();
    let mut views = Vec::with_capacity(devices.len());
    for d in &devices {
        let log = d.log.lock().expect("log lock");
        accepted.extend(log.accepted.iter().map(|(k, v)| (k.clone(), v.clone())));
        refused.extend(log.failed.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    for s in &sent {
        // The outbox is the sender's durable record: fill in what the
        // change stream missed (a lagged subscriber).
        if accepted.contains_key(&s.client_msg_id) || refused.contains_key(&s.client_msg_id) {
            continue;
        }
        let dev = devices.iter().find(|d| d.user == s.user && d.id == s.device).expect("sender device");
        if let Ok(Some(e)) = dev.client().outbox_entry(&s.client_msg_id).await {
            match (e.state, e.msg_seq, e.message_id, e.error) {
                (OutboxState::Accepted, Some(seq), Some(id), _) => {
                    accepted.insert(s.client_msg_id.clone(), Accepted { msg_seq: seq, message_id: id });
                }
                (OutboxState::Failed, _, _, error) => {
                    refused.insert(s.client_msg_id.clone(), error.unwrap_or_default());
                }
                _ => {}
            }
        }
    }
    let queued: BTreeSet<&str> = sent.iter().map(|s| s.client_msg_id.as_str()).collect();
    for (id, why) in &refused {
        if !queued.contains(id.as_str()) {
            report
                .violations
                .push(format!("outbox entry {id} failed for good, and the scenario never queued it: {why}"));
        }
    }
    for d in &devices {
        views.push(view(d, &mut groups).await?);
    }
    let mut convs: BTreeMap<String, ConvFacts> = members
        .iter()
        .map(|(c, m)| (c.clone(), ConvFacts { kind: ConvKind::Direct, members: m.clone(), changes: Vec::new() }))
        .collect();
    convs.extend(groups.facts());
    let outcome = check::check(&check::Facts {
        convs: &convs,
        sent: &sent,
        accepted: &accepted,
        refused: &refused,
        views: &views,
        snapshot_events_per_conv: server.snapshot_events_per_conv(),
    });

    report.messages_sent = sent.len();
    report.messages_accepted = sent.iter().filter(|s| accepted.contains_key(&s.client_msg_id)).count();
    for d in &devices {
        let generation = d.client().position().await?.generation.unwrap_or(0);
        let log = d.log.lock().expect("log lock");
        report.duplicate_accepts += log.duplicates;
        report.client_aborts_fired += log.aborts;
        report.snapshot_aborts_fired += log.snapshot_aborts;
        report.resets += log.resets;
        report.snapshots_installed += log.snapshots_installed;
        report.snapshot_failures += log.snapshot_failures;
        report.digest_mismatches += log.digest_mismatches;
        report.cursor_moves_checked += log.moves_checked;
        // L2 and D5 for every device that fell off: a snapshot followed,
        // under a generation above the one it fell off at.
        if let Some(f) = log.awaiting_snapshot.filter(|_| log.lagged == 0) {
            report.violations.push(format!(
                "{}: fell off the retained log ({f:?}) and installed no snapshot since (L2, D7)",
                d.name()
            ));
        }
        if let Some(f) = log.fell_off.iter().find(|f| generation <= f.generation) {
            report.violations.push(format!(
                "{}: fell off the retained log at generation {} ({f:?}) and ends at generation {generation}: a reset is a generation change (D5)",
                d.name(),
                f.generation
            ));
        }
        report.violations.extend(log.violations.iter().map(|v| format!("{}: {v}", d.name())));
        if log.violations_dropped > 0 {
            report.violations.push(format!("{}: {} more live violations", d.name(), log.violations_dropped));
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

/// What the timeline's events act on.
struct World<'a> {
    server: &'a mut ServerSlot,
    devices: &'a mut [Device],
    groups: &'a mut Groups,
    falloffs: &'a mut Falloffs,
}

/// Applies one timeline event at scenario step `step`.
async fn apply(event: Event, step: usize, w: &mut World<'_>, report: &mut Report) -> anyhow::Result<()> {
    match event {
        Event::RestartServer { down } => {
            w.server.kill().await;
            tokio::time::sleep(down).await;
            w.server.start().await?;
            report.server_restarts += 1;
        }
        Event::ReopenClient { device } => {
            let d = &mut w.devices[device];
            // A stopped client is reopened by its fall-off step only.
            if d.is_open() {
                d.close().await;
                d.open().await?;
                report.client_reopens += 1;
            }
        }
        Event::ArmCrash { device, at } => {
            *w.devices[device].crash.lock().expect("crash plan lock") = Some(at);
            report.client_aborts_armed += 1;
        }
        Event::Membership { group } => w.groups.change(group, step, report).await?,
        Event::FallOff { device } => w.falloffs.stop(device, step, w.devices, report).await,
    }
    Ok(())
}

/// A client stopped by a fall-off step.
struct Stop {
    device: usize,
    step: usize,
    /// Reopened then even if it did not fall off.
    deadline: tokio::time::Instant,
}

/// The fall-off steps: clients stopped until their cursor fell below their
/// user's retained log, and the generator of the snapshot faults armed
/// when they are reopened.
struct Falloffs {
    stopped: Vec<Stop>,
    rng: StdRng,
    wait_max: Duration,
    fault_percent: u32,
}

impl Falloffs {
    fn new(cfg: &ChaosConfig) -> Falloffs {
        Falloffs {
            stopped: Vec::new(),
            rng: StdRng::seed_from_u64(cfg.seed ^ SNAPSHOT_FAULT_SEED),
            wait_max: cfg.falloff_wait_max,
            fault_percent: cfg.snapshot_fault_percent,
        }
    }

    /// Stops `hint`, or the next device after it that may be stopped: one
    /// whose user has another device and none stopped, so that another
    /// device of the user keeps ACKing and moves the retention fence (a
    /// user with no device holding the fence keeps the whole log).
    async fn stop(&mut self, hint: usize, step: usize, devices: &mut [Device], report: &mut Report) {
        let n = devices.len();
        let may_stop = |d: usize| {
            let user = &devices[d].user;
            let mine = devices.iter().filter(|o| o.user == *user);
            mine.clone().count() > 1 && mine.clone().all(Device::is_open)
        };
        let Some(d) = (0..n).map(|k| (hint + k) % n).find(|d| may_stop(*d)) else {
            report.notes.push(format!("fall-off step at step {step} skipped: no user with two devices running"));
            return;
        };
        devices[d].close().await;
        self.stopped.push(Stop { device: d, step, deadline: tokio::time::Instant::now() + self.wait_max });
        report.falloff_stops += 1;
    }

    /// Reopens every stopped client whose server cursor fell below its
    /// user's trim point (recorded with the device, maybe with a snapshot
    /// fault armed), and those that cannot or did not: one stopped in a
    /// state that holds no fence at once, others at the deadline;
    /// [`FALLOFF_UNKNOWN_STEPS`] steps, or the end of the sends (`step`
    /// `None`), when the server's store has no cursor for it.
    async fn reopen(
        &mut self,
        step: Option<usize>,
        server: &ServerSlot,
        devices: &mut [Device],
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let mut k = 0;
        while k < self.stopped.len() {
            let (device, stopped_at, deadline) = {
                let s = &self.stopped[k];
                (s.device, s.step, s.deadline)
            };
            let dev = &mut devices[device];
            let standing = server.standing(&dev.user, &dev.id).await?;
            let fell = standing.as_ref().and_then(Standing::fell_off);
            let due = match (&standing, step) {
                // Stopped mid-rebuild (`RESETTING`): it holds no fence and
                // cannot fall off; it rebuilds once reopened anyway.
                (Some(s), _) => !s.fencing || tokio::time::Instant::now() >= deadline,
                (None, Some(step)) => step >= stopped_at + FALLOFF_UNKNOWN_STEPS,
                (None, None) => true,
            };
            if fell.is_none() && !due {
                k += 1;
                continue;
            }
            self.stopped.remove(k);
            match fell {
                Some(f) => {
                    report.fell_off += 1;
                    dev.log.lock().expect("log lock").fall_off(f);
                    if self.rng.random_range(0..100) < self.fault_percent {
                        let at = CrashAt::SNAPSHOT[self.rng.random_range(0..CrashAt::SNAPSHOT.len())];
                        let mut plan = dev.crash.lock().expect("crash plan lock");
                        if plan.is_none() {
                            *plan = Some(at);
                            report.snapshot_faults_armed += 1;
                        }
                    }
                }
                None => {
                    report.falloff_timeouts += 1;
                    if let Some(s) = standing {
                        let why = if s.fencing {
                            format!("after {:?}", self.wait_max)
                        } else {
                            "at once (it holds no retention fence)".to_owned()
                        };
                        report.notes.push(format!(
                            "{}: stopped at step {stopped_at}, reopened {why} without falling off: {s:?}",
                            dev.name()
                        ));
                    }
                }
            }
            dev.open().await?;
        }
        Ok(())
    }
}

/// Reopens every client that died (at a crash point, or otherwise; an exit
/// other than a crash is noted). A stopped client is not dead.
async fn reopen_dead(devices: &mut [Device], report: &mut Report) -> anyhow::Result<()> {
    for d in devices.iter_mut() {
        if !d.is_open() || !d.exited() {
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
/// user's head, applied and ACKed (the server's ACK when its store is at
/// hand, else the local one), for a few polls in a row. Notes what keeps a
/// device from it if the wait gives up.
async fn settle(
    cfg: &ChaosConfig,
    server: &ServerSlot,
    devices: &mut [Device],
    report: &mut Report,
) -> anyhow::Result<bool> {
    let deadline = tokio::time::Instant::now() + cfg.settle_max;
    let mut quiet = 0;
    let mut last_heads: Vec<(u64, u64)> = Vec::new();
    // Why each device is not there yet, at the last poll.
    let mut behind: Vec<String> = Vec::new();
    // Devices at the head whose local ACK is behind the server's.
    let mut stale_acks: Vec<String> = Vec::new();
    while tokio::time::Instant::now() < deadline {
        reopen_dead(devices, report).await?;
        // Each device's (applied, acked); in-process, the user's head too.
        let mut heads = Vec::with_capacity(devices.len());
        let mut done = true;
        behind.clear();
        stale_acks.clear();
        for d in devices.iter() {
            d.poll().await;
            let client = d.client();
            client.sync_now();
            let pos = client.position().await?;
            let head = server.head(&d.user).await?.unwrap_or(pos.applied_sync_seq);
            heads.push((head, pos.applied_sync_seq));
            let standing = server.standing(&d.user, &d.id).await?;
            let pending = client.outbox().await?.iter().filter(|e| e.state == OutboxState::Pending).count();
            // The server's cursor is the ACK (D4). The SDK records an ACK
            // only from an `ack.ok`, not from the `server_acked_sync_seq` of
            // a later `sync.ok`: after a lost `ack.ok`, its local ACK stays
            // behind until a new event is ACKed. That is noted, not waited
            // for.
            let acked = match &standing {
                Some(s) => s.state == "ACTIVE" && Some(s.generation) == pos.generation && s.acked == head,
                None => pos.acked_sync_seq == head,
            };
            if acked && pos.acked_sync_seq != head {
                stale_acks.push(format!(
                    "{}: local ACK {} behind the server's {head} (generation {:?}): the SDK never learns an ACK whose ack.ok was lost",
                    d.name(),
                    pos.acked_sync_seq,
                    pos.generation
                ));
            }
            if pending > 0 || pos.applied_sync_seq != head || !acked {
                done = false;
                let log = d.log.lock().expect("log lock");
                behind.push(format!(
                    "{}: {pos:?}, head {head}, server cursor {standing:?}, {pending} pending outbox entries, {:?}; {} resets, {} snapshots installed, {} failed (last: {:?})",
                    d.name(),
                    client.state(),
                    log.resets,
                    log.snapshots_installed,
                    log.snapshot_failures,
                    log.last_snapshot_failure
                ));
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
            report.notes.append(&mut stale_acks);
            return Ok(true);
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
    report.notes.extend(behind.into_iter().map(|b| format!("not settled: {b}")));
    Ok(false)
}

/// What `d` holds, and for each conversation it holds from a snapshot's
/// boundary on, what `history` serves its user below that boundary.
async fn view(d: &Device, groups: &mut Groups) -> anyhow::Result<DeviceView> {
    let client = d.client();
    let conversations = client.conversations().await?;
    let mut events = BTreeMap::new();
    let mut history = BTreeMap::new();
    for c in &conversations {
        events.insert(c.conv.clone(), client.events(&c.conv).await?);
        if c.history_to > 0 {
            let served = groups.control(&d.user).history(&c.conv, c.history_to + 1).await?;
            history.insert(c.conv.clone(), served);
        }
    }
    let snapshots_installed = {
        let log = d.log.lock().expect("log lock");
        (log.lagged == 0).then_some(log.snapshots_installed)
    };
    Ok(DeviceView { user: d.user.clone(), device: d.id.clone(), conversations, events, snapshots_installed, history })
}

#[cfg(test)]
mod tests {
    //! Negative controls of the live checks: a reset must be a generation
    //! change, and nothing moves back within a generation.

    use super::*;
    use tidemark_client::PageReport;

    fn page(generation: u64, applied_sync_seq: u64) -> Change {
        Change::PageApplied(PageReport {
            sync_generation: generation,
            applied: 1,
            applied_sync_seq,
            ..PageReport::default()
        })
    }

    fn acked(generation: u64, acked_sync_seq: u64) -> Change {
        Change::Acked { sync_seq: acked_sync_seq, acked_sync_seq, generation }
    }

    fn installed(generation: u64, base_sync_seq: u64) -> Change {
        Change::SnapshotInstalled { generation, base_sync_seq, conversations: 1, messages: 1 }
    }

    fn conv(contiguous: u64) -> Conversation {
        crate::check::tests::direct_conv("c", contiguous)
    }

    fn pos(generation: u64, applied: u64, acked: u64) -> SyncPosition {
        SyncPosition { generation: Some(generation), applied_sync_seq: applied, acked_sync_seq: acked }
    }

    /// The log after `changes`, starting synced at generation 2, ACK 10.
    fn after(changes: Vec<Change>) -> DeviceLog {
        let mut log = DeviceLog::default();
        for c in [page(2, 10), acked(2, 10)].into_iter().chain(changes) {
            log.record(c);
        }
        log
    }

    #[test]
    fn a_reset_is_a_generation_change() {
        // The ordinary path: RESET_REQUIRED above, a snapshot at it, sync on.
        let log = after(vec![Change::Reset { generation: Some(3) }, installed(3, 12), acked(3, 12), page(3, 14)]);
        assert_eq!(log.violations, Vec::<String>::new());
        // A second install in one generation (the first one's ack refused),
        // at a base no lower, is fine too.
        let log = after(vec![Change::Reset { generation: Some(3) }, installed(3, 12), installed(3, 13)]);
        assert_eq!(log.violations, Vec::<String>::new());

        let log = after(vec![Change::Reset { generation: Some(2) }]);
        assert!(
            log.violations[0].contains("RESET_REQUIRED at generation 2, not above generation 2"),
            "{:?}",
            log.violations
        );
        let log = after(vec![Change::Reset { generation: None }]);
        assert!(log.violations[0].contains("without a sync_generation"), "{:?}", log.violations);
        let log = after(vec![installed(2, 12)]);
        assert!(log.violations[0].contains("snapshot installed at generation 2"), "{:?}", log.violations);
        let log = after(vec![Change::Reset { generation: Some(3) }, installed(3, 12), installed(3, 11)]);
        assert!(log.violations[0].contains("moved back from 12 to 11 in generation 3"), "{:?}", log.violations);
    }

    #[test]
    fn a_fallen_off_device_applies_no_page_before_its_snapshot() {
        let f = FellOff { generation: 2, acked: 10, trimmed_upto: 15 };
        let mut log = after(vec![]);
        log.fall_off(f);
        log.record(Change::Reset { generation: Some(3) });
        log.record(installed(3, 20));
        log.record(page(3, 22));
        assert_eq!(log.violations, Vec::<String>::new());
        assert_eq!(log.awaiting_snapshot, None);

        let mut log = after(vec![]);
        log.fall_off(f);
        log.record(page(2, 12));
        assert!(log.violations[0].contains("after falling off the retained log"), "{:?}", log.violations);
    }

    #[test]
    fn durable_cursors_move_back_only_with_a_new_generation() {
        let mut log = DeviceLog::default();
        log.durable(pos(2, 10, 10), &[conv(7)]);
        // A reset notification alone does not license a move back: the
        // generation in the store must change.
        log.record(Change::Reset { generation: Some(3) });
        log.durable(pos(2, 10, 10), &[conv(5)]);
        assert!(log.violations[0].contains("cursor moved back in generation 2: 7 → 5"), "{:?}", log.violations);

        let mut log = DeviceLog::default();
        log.durable(pos(2, 10, 10), &[conv(7)]);
        log.durable(pos(3, 8, 0), &[conv(5)]);
        log.durable(pos(3, 8, 8), &[conv(6)]);
        assert_eq!(log.violations, Vec::<String>::new());
        log.durable(pos(3, 7, 8), &[conv(6)]);
        log.durable(pos(2, 9, 9), &[conv(6)]);
        assert!(log.violations[0].contains("moved back"), "{:?}", log.violations);
        assert!(log.violations[1].contains("generation moved back"), "{:?}", log.violations);
    }

    #[test]
    fn the_binary_gets_the_retention_in_whole_seconds_rounded_up() {
        let args = Retention::default().serve_args().join(" ");
        assert_eq!(
            args,
            "--log-keep-secs 1 --device-inactive-secs 1 --retention-every-ms 100 --snapshot-ttl-secs 5 --snapshot-messages-per-conv 4"
        );
        let odd = Retention {
            keep_events_ms: 1500,
            device_inactive_ms: 1,
            every: Duration::from_millis(3),
            snapshot_ttl: Duration::from_millis(2001),
            ..Retention::default()
        };
        let args = odd.serve_args().join(" ");
        assert_eq!(
            args,
            "--log-keep-secs 2 --device-inactive-secs 1 --retention-every-ms 10 --snapshot-ttl-secs 3 --snapshot-messages-per-conv 4"
        );
    }
}
