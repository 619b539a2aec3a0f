//! What a run found, printable as its summary.

use std::collections::BTreeMap;
use std::fmt;

use crate::check::{self};

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
    /// Shared groups: pulls committed then cleared, and clears that
    /// succeeded (change streams).
    pub group_pulls: u64,
    pub group_clears: u64,
    /// Groups that crossed the large-group threshold during the run and
    /// switched (their `conv.mode` right after the crossing join).
    pub switched_mid_run: usize,
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
        writeln!(
            f,
            "  large groups: {} in shared mode ({} switched mid-run); {} group messages verified above their switch (read by conv.sync); {} pulls cleared on the devices ({} clears succeeded)",
            self.check.shared_groups, self.switched_mid_run, self.check.shared_verified, self.group_pulls, self.group_clears
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
