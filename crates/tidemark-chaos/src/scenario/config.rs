//! What a run is given: its size, its faults, the server it runs against
//! and the server's retention, with the CI run ([`ChaosConfig::short`]) and
//! long runs ([`ChaosConfig::long`]).

use std::path::PathBuf;
use std::time::Duration;

use tidemark_server::ServerConfig;

use crate::proxy::FaultConfig;

/// The admin token and every user's password on the run's server.
pub(super) const ADMIN: &str = "chaos-admin";
pub(super) const PASSWORD: &str = "chaos-password";

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
    /// Group conversations created at setup, in three shapes by number
    /// ([`GroupShape::of`]): `k % 3 == 0` starts with every user, above
    /// [`ChaosConfig::large_group_members`], so it is shared from its
    /// creation; `k % 3 == 1` starts with its owner and one other user and
    /// its first membership steps add members until it crosses the
    /// threshold (it switches to shared mode mid-run, G3); `k % 3 == 2`
    /// starts with its owner and one other user and never grows above the
    /// threshold (per-member mode throughout; an add that would cross is
    /// not made). The two-member shapes let an add be a first join, not
    /// only a rejoin. With fewer than three users every group starts with
    /// every user.
    pub groups: usize,
    /// The server's large-group threshold (`GroupPolicy::large_members`,
    /// `tidemark serve --large-group-members`): a group with more active
    /// members than this is in shared mode (G2). Low, so a run of a few
    /// users has groups in both modes and one that switches.
    pub large_group_members: u64,
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
    /// The in-process server's configuration, with the large-group
    /// threshold `large_group_members`.
    pub(super) fn server_config(&self, large_group_members: u64) -> anyhow::Result<ServerConfig> {
        let group_policy = tidemark_core::large::GroupPolicy::new(large_group_members)
            .map_err(|e| anyhow::anyhow!("large-group threshold: {e}"))?;
        let mut config = ServerConfig {
            admin_token: Some(ADMIN.into()),
            group_policy,
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
        Ok(config)
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
            groups: 3,
            large_group_members: 2,
            membership_changes: 10,
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

/// How a group starts and grows, by its number `k` ([`ChaosConfig::groups`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupShape {
    /// Every user from creation, above the threshold: shared from its
    /// `conv.created` (its `conv.mode` is `msg_seq` 2).
    Shared,
    /// Owner and one other user; its first membership steps are adds until
    /// it is above the threshold: the switch comes right after the join
    /// that crossed it.
    Crossing,
    /// Owner and one other user, never above the threshold.
    PerMember,
}

impl GroupShape {
    pub fn of(k: usize, users: usize) -> GroupShape {
        match k % 3 {
            _ if users < 3 => GroupShape::Shared,
            0 => GroupShape::Shared,
            1 => GroupShape::Crossing,
            _ => GroupShape::PerMember,
        }
    }
}

/// How the run hosts its server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerMode {
    /// [`Server::start`](tidemark_server::Server::start) in this process; a restart is a graceful stop and
    /// a start on the same directory and address.
    InProcess,
    /// The real `tidemark serve` binary at this path; a restart is SIGKILL
    /// and a start on the same directory and address.
    Binary(PathBuf),
}
