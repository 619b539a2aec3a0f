//! Device cursors (D1, D4, D5): where each device may resume and how its
//! cumulative ACK moves.
//!
//! Every backend reads the device row, calls one of these functions and
//! writes what it returns, all in one transaction. The functions never look
//! at another device's row: one device's progress never moves another's (D1).

use crate::{Generation, SyncSeq};

/// Lifecycle of a device's sync cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceState {
    /// Logged in, never synced: no batch token was ever issued to it.
    New,
    /// Incremental sync from `acked_sync_seq`.
    Active,
    /// Its generation was bumped; it must rebuild before syncing again.
    Resetting,
    /// Its generation was bumped for a recovery session (D6): it replays a
    /// frozen range and completes only by ACKing that range's end.
    Recovering,
    /// Revoked (P5): every sync, ACK and read is refused.
    Revoked,
}

impl DeviceState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceState::New => "NEW",
            DeviceState::Active => "ACTIVE",
            DeviceState::Resetting => "RESETTING",
            DeviceState::Recovering => "RECOVERING",
            DeviceState::Revoked => "REVOKED",
        }
    }

    pub fn parse(s: &str) -> Option<DeviceState> {
        Some(match s {
            "NEW" => DeviceState::New,
            "ACTIVE" => DeviceState::Active,
            "RESETTING" => DeviceState::Resetting,
            "RECOVERING" => DeviceState::Recovering,
            "REVOKED" => DeviceState::Revoked,
            _ => return None,
        })
    }
}

/// The server's durable record of one device's sync progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCursor {
    pub generation: Generation,
    pub acked_sync_seq: SyncSeq,
    pub state: DeviceState,
}

/// What the client says about itself on the first page of a sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClientPosition {
    /// Omitted by a device with no local state.
    pub generation: Option<Generation>,
    pub local_applied_sync_seq: Option<SyncSeq>,
}

/// Where a sync batch starts, decided from the server's cursor only; the
/// client's claims can make the server replay more, never less (D5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Replay `(from, high watermark]` under `generation`.
    Replay { generation: Generation, from: SyncSeq },
    /// A never-synced device while the user's log is retained from its
    /// start: set state `ACTIVE` at `generation` (CAS from `NEW`), then
    /// replay the whole log. Once the log was trimmed, a new device gets a
    /// snapshot instead (D7).
    Activate { generation: Generation },
    /// The device is `RESETTING` at `generation`, the client has wiped its
    /// local state and the log is retained from its start: set `ACTIVE` with
    /// ACK 0 (CAS on generation and state), then replay the whole log. Once
    /// the log was trimmed, only a snapshot (D7) rebuilds a device.
    Rebuild { generation: Generation },
    /// Bump the generation (CAS from `expected`), set `RESETTING`, answer
    /// `RESET_REQUIRED` with the new generation.
    Reset { expected: Generation },
    /// Already resetting: answer `RESET_REQUIRED` with this generation.
    StillResetting { generation: Generation },
    /// Answer `DEVICE_REVOKED`.
    Revoked,
    /// The local store is a little behind the server ACK (a restored
    /// backup) and the log still holds the gap: bump the generation (CAS
    /// from `expected`), state `RECOVERING`, and open a durable recovery
    /// session replaying `(from, high watermark]` (D6).
    Recover { expected: Generation, from: SyncSeq },
    /// A recovery session is open for this generation: replay its frozen
    /// range again (the client reconnected mid-recovery).
    ContinueRecovery { generation: Generation },
}

/// A live recovery session, as the resume and ACK rules see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryInfo {
    pub session_id: String,
    pub resume_from: SyncSeq,
    pub high_watermark: SyncSeq,
    pub expires_at_ms: i64,
}

/// The default of [`RecoveryPolicy::max_replay`]: a first batch longer
/// than this is a snapshot instead. A snapshot of a big account costs about
/// its conversations times `snapshot_messages_per_conv` items whatever the
/// log holds, a replay one event per event; 10,000 events is a snapshot of
/// 100 busy conversations.
pub const REPLAY_EVENTS_MAX: SyncSeq = 10_000;

/// Bounds of recovery sessions and replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecoveryPolicy {
    /// "A little behind": at most this many events between the local
    /// position and the server ACK; more than that gets a snapshot.
    pub max_gap: SyncSeq,
    /// The longest batch a first page starts (`H` minus where it starts):
    /// a new device, a rebuilding one, an active one or a recovery that
    /// would replay more than this is reset and installs a snapshot
    /// (D7, seed §7.5 and §11.3: never replay a whole big log).
    pub max_replay: SyncSeq,
}

impl RecoveryPolicy {
    /// No recovery sessions, replays up to [`REPLAY_EVENTS_MAX`].
    pub const NO_RECOVERY: RecoveryPolicy = RecoveryPolicy { max_gap: 0, max_replay: REPLAY_EVENTS_MAX };

    /// Whether a batch `(from, head]` is short enough to replay.
    pub fn replays(&self, from: SyncSeq, head: SyncSeq) -> bool {
        head.saturating_sub(from) <= self.max_replay
    }
}

/// The user's log as the resume rule needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserLog {
    /// The committed sync head.
    pub high_watermark: SyncSeq,
    /// Events at or below this were trimmed (L1); 0 when nothing was.
    pub trimmed_upto: SyncSeq,
}

/// D5: chooses the start of a sync batch.
///
/// A client that claims to have applied beyond the user's head has a
/// corrupt store and is reset; a device whose ACK fell below the trimmed
/// part of the log cannot replay and is reset too (L2, D7); so is one whose
/// batch would replay more than [`REPLAY_EVENTS_MAX`] events.
pub fn decide_resume(cursor: DeviceCursor, client: ClientPosition, log: UserLog) -> Resume {
    decide_resume_with(cursor, client, log, None, RecoveryPolicy::NO_RECOVERY, 0)
}

/// D5–D6: the resume rule with recovery sessions. `session` is the
/// device's open recovery session, if any; `now_ms` decides its expiry.
pub fn decide_resume_with(
    cursor: DeviceCursor,
    client: ClientPosition,
    log: UserLog,
    session: Option<&RecoveryInfo>,
    policy: RecoveryPolicy,
    now_ms: i64,
) -> Resume {
    let local = client.local_applied_sync_seq.unwrap_or(0);
    // The whole log is there and short enough to replay from its start.
    let whole_log = log.trimmed_upto == 0 && policy.replays(0, log.high_watermark);
    if cursor.state == DeviceState::Recovering {
        let live = session.is_some_and(|s| now_ms < s.expires_at_ms);
        return if live && client.generation == Some(cursor.generation) {
            Resume::ContinueRecovery { generation: cursor.generation }
        } else {
            // Expired, or the client lost the recovery generation: a
            // snapshot reset, never a partial replay (D6).
            Resume::Reset { expected: cursor.generation }
        };
    }
    match cursor.state {
        DeviceState::Recovering => unreachable!("handled above"),
        DeviceState::Revoked => Resume::Revoked,
        DeviceState::New => match client.generation {
            None if local == 0 && whole_log => Resume::Activate { generation: cursor.generation },
            _ => Resume::Reset { expected: cursor.generation },
        },
        DeviceState::Resetting => {
            if client.generation == Some(cursor.generation) && local == 0 && whole_log {
                Resume::Rebuild { generation: cursor.generation }
            } else {
                Resume::StillResetting { generation: cursor.generation }
            }
        }
        DeviceState::Active => {
            let same_generation = client.generation == Some(cursor.generation);
            let plausible = local >= cursor.acked_sync_seq && local <= log.high_watermark;
            let retained =
                cursor.acked_sync_seq >= log.trimmed_upto && policy.replays(cursor.acked_sync_seq, log.high_watermark);
            let behind = local < cursor.acked_sync_seq;
            let recoverable = same_generation
                && behind
                && cursor.acked_sync_seq - local <= policy.max_gap
                && local >= log.trimmed_upto
                && policy.replays(local, log.high_watermark);
            if same_generation && plausible && retained {
                Resume::Replay { generation: cursor.generation, from: cursor.acked_sync_seq }
            } else if recoverable {
                Resume::Recover { expected: cursor.generation, from: local }
            } else {
                Resume::Reset { expected: cursor.generation }
            }
        }
    }
}

/// The result of a cumulative ACK (D4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckDecision {
    /// Write `acked_sync_seq = to`.
    Advance { to: SyncSeq },
    /// An older or equal ACK: return the current value, write nothing.
    Unchanged { acked: SyncSeq },
    /// The token's generation is not the device's: `STALE_GENERATION`.
    StaleGeneration { current: Generation },
    /// `RESET_REQUIRED`.
    Resetting { current: Generation },
    /// `DEVICE_REVOKED`.
    Revoked,
    /// The final ACK of a live recovery session: set `ACTIVE` with
    /// `acked_sync_seq = to` and complete the session (D6).
    CompleteRecovery { to: SyncSeq },
    /// The recovery session expired: reset (bump, `RESETTING`).
    RecoveryExpired { current: Generation },
}

/// D4: a monotonic compare-and-set. The caller has already checked the
/// token's signature, owner, expiry and that `seq <= batch_high_watermark`.
pub fn decide_ack(cursor: DeviceCursor, token_generation: Generation, seq: SyncSeq) -> AckDecision {
    decide_ack_with(cursor, token_generation, None, None, seq, 0)
}

/// D4 and D6: the ACK rule with recovery sessions. `token_session` is the
/// recovery session bound into the batch token, `session` the device's open
/// one. During recovery only the session's own final ACK moves the cursor.
pub fn decide_ack_with(
    cursor: DeviceCursor,
    token_generation: Generation,
    token_session: Option<&str>,
    session: Option<&RecoveryInfo>,
    seq: SyncSeq,
    now_ms: i64,
) -> AckDecision {
    match cursor.state {
        DeviceState::Revoked => return AckDecision::Revoked,
        _ if token_generation != cursor.generation => {
            return AckDecision::StaleGeneration { current: cursor.generation };
        }
        DeviceState::Resetting | DeviceState::New => {
            return AckDecision::Resetting { current: cursor.generation };
        }
        DeviceState::Recovering => {
            let Some(s) = session.filter(|s| Some(s.session_id.as_str()) == token_session) else {
                return AckDecision::Unchanged { acked: cursor.acked_sync_seq };
            };
            if now_ms >= s.expires_at_ms {
                return AckDecision::RecoveryExpired { current: cursor.generation };
            }
            return if seq == s.high_watermark {
                AckDecision::CompleteRecovery { to: s.high_watermark.max(cursor.acked_sync_seq) }
            } else {
                AckDecision::Unchanged { acked: cursor.acked_sync_seq }
            };
        }
        DeviceState::Active => {}
    }
    if seq > cursor.acked_sync_seq {
        AckDecision::Advance { to: seq }
    } else {
        AckDecision::Unchanged { acked: cursor.acked_sync_seq }
    }
}

/// What a compare-and-set on a device cursor does (D5, D6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasDecision {
    /// The cursor is no longer what the caller expected: nothing is
    /// written; the answer is the current cursor.
    Refuse { current: DeviceCursor },
    /// Write `new`. `ends_recovery`: the generation moved, so any recovery
    /// session of the old one is over and no longer fences retention.
    Write { new: DeviceCursor, ends_recovery: bool },
}

/// D5: replace the cursor with `new` only if it still equals `expected`.
/// A generation never goes back: asking for that is a caller bug.
pub fn decide_cas(current: DeviceCursor, expected: DeviceCursor, new: DeviceCursor) -> CasDecision {
    if current != expected {
        return CasDecision::Refuse { current };
    }
    assert!(new.generation >= expected.generation, "a generation never goes back");
    CasDecision::Write { new, ends_recovery: new.generation != expected.generation }
}

/// D6: opening a recovery session is a CAS from `expected` to the next
/// generation in `RECOVERING` (same ACK); any older session ends.
pub fn decide_begin_recovery(current: DeviceCursor, expected: DeviceCursor) -> CasDecision {
    if current != expected {
        return CasDecision::Refuse { current };
    }
    let new = DeviceCursor { generation: current.generation + 1, state: DeviceState::Recovering, ..current };
    CasDecision::Write { new, ends_recovery: true }
}

/// D4, D6: the cursor an ACK decision writes, or `None` when it writes
/// none. Completing a recovery also completes its session; an expired one
/// also expires its session.
pub fn cursor_after_ack(cursor: DeviceCursor, decision: AckDecision) -> Option<DeviceCursor> {
    match decision {
        AckDecision::Advance { to } => {
            assert!(to > cursor.acked_sync_seq, "an ACK only moves forward");
            Some(DeviceCursor { acked_sync_seq: to, ..cursor })
        }
        AckDecision::CompleteRecovery { to } => {
            Some(DeviceCursor { acked_sync_seq: to, state: DeviceState::Active, ..cursor })
        }
        AckDecision::RecoveryExpired { .. } => {
            Some(DeviceCursor { generation: cursor.generation + 1, state: DeviceState::Resetting, ..cursor })
        }
        AckDecision::Unchanged { .. }
        | AckDecision::StaleGeneration { .. }
        | AckDecision::Resetting { .. }
        | AckDecision::Revoked => None,
    }
}

/// P5: revoking writes `REVOKED` (generation and ACK kept), once; `None`
/// when the device already is revoked.
pub fn revoked(cursor: DeviceCursor) -> Option<DeviceCursor> {
    (cursor.state != DeviceState::Revoked).then_some(DeviceCursor { state: DeviceState::Revoked, ..cursor })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn active(generation: u64, acked: u64) -> DeviceCursor {
        DeviceCursor { generation, acked_sync_seq: acked, state: DeviceState::Active }
    }

    fn pos(generation: Option<u64>, local: Option<u64>) -> ClientPosition {
        ClientPosition { generation, local_applied_sync_seq: local }
    }

    /// One table for D5; each row is (cursor, client, head, expected).
    #[test]
    fn resume_rules() {
        let new = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::New };
        let resetting = DeviceCursor { generation: 4, acked_sync_seq: 7, state: DeviceState::Resetting };
        let revoked = DeviceCursor { generation: 2, acked_sync_seq: 7, state: DeviceState::Revoked };
        let cases = [
            (new, pos(None, None), 10, Resume::Activate { generation: 1 }),
            (new, pos(Some(3), Some(5)), 10, Resume::Reset { expected: 1 }),
            (active(2, 5), pos(Some(2), Some(5)), 10, Resume::Replay { generation: 2, from: 5 }),
            // A lost ACK: local ahead of the server ACK replays from the ACK.
            (active(2, 5), pos(Some(2), Some(8)), 10, Resume::Replay { generation: 2, from: 5 }),
            // Local behind the ACK (restored backup): bump first.
            (active(2, 5), pos(Some(2), Some(4)), 10, Resume::Reset { expected: 2 }),
            // Generation missing or mismatched: bump first.
            (active(2, 5), pos(None, Some(5)), 10, Resume::Reset { expected: 2 }),
            (active(2, 5), pos(Some(1), Some(5)), 10, Resume::Reset { expected: 2 }),
            // Claims beyond anything the server ever wrote: corrupt, reset.
            (active(2, 5), pos(Some(2), Some(11)), 10, Resume::Reset { expected: 2 }),
            (resetting, pos(Some(4), Some(0)), 10, Resume::Rebuild { generation: 4 }),
            (resetting, pos(Some(4), Some(3)), 10, Resume::StillResetting { generation: 4 }),
            (resetting, pos(Some(3), Some(0)), 10, Resume::StillResetting { generation: 4 }),
            (revoked, pos(Some(2), Some(7)), 10, Resume::Revoked),
        ];
        for (i, (cursor, client, head, want)) in cases.into_iter().enumerate() {
            let log = UserLog { high_watermark: head, trimmed_upto: 0 };
            assert_eq!(decide_resume(cursor, client, log), want, "row {i}");
        }
    }

    /// L2, D7: once the log was trimmed, nobody replays what is gone.
    #[test]
    fn trimmed_log_forces_snapshots() {
        let log = UserLog { high_watermark: 50, trimmed_upto: 20 };
        let new = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::New };
        assert_eq!(decide_resume(new, pos(None, None), log), Resume::Reset { expected: 1 }, "a new device");
        // Offline past the window: its ACK is below the trimmed part.
        assert_eq!(decide_resume(active(3, 10), pos(Some(3), Some(10)), log), Resume::Reset { expected: 3 });
        assert_eq!(
            decide_resume(active(3, 20), pos(Some(3), Some(20)), log),
            Resume::Replay { generation: 3, from: 20 }
        );
        let resetting = DeviceCursor { generation: 4, acked_sync_seq: 0, state: DeviceState::Resetting };
        assert_eq!(decide_resume(resetting, pos(Some(4), Some(0)), log), Resume::StillResetting { generation: 4 });
    }

    /// D7, seed §7.5: a first batch longer than `max_replay` is a snapshot,
    /// whoever asks; at the bound it is still a replay. Each row is
    /// (cursor, client, head, trimmed, expected) under `max_gap` 20 and
    /// `max_replay` 100.
    #[test]
    fn long_replays_become_snapshots() {
        let policy = RecoveryPolicy { max_gap: 20, max_replay: 100 };
        let new = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::New };
        let resetting = DeviceCursor { generation: 4, acked_sync_seq: 0, state: DeviceState::Resetting };
        let cases = [
            // A new device of a small account replays its whole log...
            (new, pos(None, None), 100, 0, Resume::Activate { generation: 1 }),
            // ...of a big one, a snapshot (today: a replay from 0).
            (new, pos(None, None), 101, 0, Resume::Reset { expected: 1 }),
            (new, pos(None, None), 1_000_000, 0, Resume::Reset { expected: 1 }),
            (resetting, pos(Some(4), Some(0)), 100, 0, Resume::Rebuild { generation: 4 }),
            (resetting, pos(Some(4), Some(0)), 101, 0, Resume::StillResetting { generation: 4 }),
            // An active device 100 behind replays; 101 behind resets.
            (active(2, 50), pos(Some(2), Some(50)), 150, 0, Resume::Replay { generation: 2, from: 50 }),
            (active(2, 50), pos(Some(2), Some(50)), 151, 0, Resume::Reset { expected: 2 }),
            (active(2, 50), pos(Some(2), Some(60)), 151, 10, Resume::Reset { expected: 2 }),
            // A recovery replays from the local position: that is the batch.
            (active(2, 50), pos(Some(2), Some(40)), 140, 0, Resume::Recover { expected: 2, from: 40 }),
            (active(2, 50), pos(Some(2), Some(40)), 141, 0, Resume::Reset { expected: 2 }),
        ];
        for (i, (cursor, client, head, trimmed, want)) in cases.into_iter().enumerate() {
            let log = UserLog { high_watermark: head, trimmed_upto: trimmed };
            assert_eq!(decide_resume_with(cursor, client, log, None, policy, 0), want, "row {i}");
        }
        assert!(policy.replays(0, 100) && !policy.replays(0, 101) && policy.replays(200, 100));
        // The plain rule bounds replays by the named default.
        let log = UserLog { high_watermark: REPLAY_EVENTS_MAX + 1, trimmed_upto: 0 };
        assert_eq!(decide_resume(new, pos(None, None), log), Resume::Reset { expected: 1 });
        let log = UserLog { high_watermark: REPLAY_EVENTS_MAX, trimmed_upto: 0 };
        assert_eq!(decide_resume(new, pos(None, None), log), Resume::Activate { generation: 1 });
    }

    #[test]
    fn ack_rules() {
        assert_eq!(decide_ack(active(3, 5), 3, 9), AckDecision::Advance { to: 9 });
        assert_eq!(decide_ack(active(3, 9), 3, 5), AckDecision::Unchanged { acked: 9 });
        assert_eq!(decide_ack(active(3, 9), 3, 9), AckDecision::Unchanged { acked: 9 });
        assert_eq!(decide_ack(active(3, 5), 2, 9), AckDecision::StaleGeneration { current: 3 });
        let resetting = DeviceCursor { generation: 3, acked_sync_seq: 5, state: DeviceState::Resetting };
        assert_eq!(decide_ack(resetting, 3, 9), AckDecision::Resetting { current: 3 });
        assert_eq!(decide_ack(resetting, 2, 9), AckDecision::StaleGeneration { current: 3 });
        let revoked = DeviceCursor { generation: 3, acked_sync_seq: 5, state: DeviceState::Revoked };
        assert_eq!(decide_ack(revoked, 3, 9), AckDecision::Revoked);
    }

    #[test]
    fn recovery_rules() {
        let log = UserLog { high_watermark: 100, trimmed_upto: 10 };
        let policy = RecoveryPolicy { max_gap: 20, max_replay: REPLAY_EVENTS_MAX };
        let recover = |local| decide_resume_with(active(3, 50), pos(Some(3), Some(local)), log, None, policy, 0);
        assert_eq!(recover(40), Resume::Recover { expected: 3, from: 40 }, "a little behind");
        assert_eq!(recover(29), Resume::Reset { expected: 3 }, "too far behind");
        let trimmed = UserLog { trimmed_upto: 45, ..log };
        assert_eq!(
            decide_resume_with(active(3, 50), pos(Some(3), Some(40)), trimmed, None, policy, 0),
            Resume::Reset { expected: 3 },
            "the gap is no longer in the log"
        );
        let recovering = DeviceCursor { generation: 4, acked_sync_seq: 50, state: DeviceState::Recovering };
        let s = RecoveryInfo { session_id: "r1".into(), resume_from: 40, high_watermark: 60, expires_at_ms: 1_000 };
        let go = |now| decide_resume_with(recovering, pos(Some(4), Some(45)), log, Some(&s), policy, now);
        assert_eq!(go(999), Resume::ContinueRecovery { generation: 4 });
        assert_eq!(go(1_000), Resume::Reset { expected: 4 }, "expired: snapshot");
        let ack = |tok: Option<&str>, seq, now| decide_ack_with(recovering, 4, tok, Some(&s), seq, now);
        assert_eq!(ack(Some("r1"), 60, 0), AckDecision::CompleteRecovery { to: 60 });
        assert_eq!(ack(Some("r1"), 55, 0), AckDecision::Unchanged { acked: 50 }, "only the final ACK completes");
        assert_eq!(ack(None, 60, 0), AckDecision::Unchanged { acked: 50 }, "a token without the session");
        assert_eq!(ack(Some("r0"), 60, 0), AckDecision::Unchanged { acked: 50 });
        assert_eq!(ack(Some("r1"), 60, 1_000), AckDecision::RecoveryExpired { current: 4 });
        assert_eq!(
            decide_ack_with(recovering, 3, Some("r1"), Some(&s), 60, 0),
            AckDecision::StaleGeneration { current: 4 }
        );
    }

    proptest::proptest! {
        /// Whatever order ACKs arrive in, the cursor only moves forward and
        /// ends at the maximum ACKed value.
        #[test]
        fn acks_in_any_order_never_move_back(acks in proptest::collection::vec(0u64..1000, 1..50)) {
            let mut cursor = active(1, 0);
            for &a in &acks {
                let before = cursor.acked_sync_seq;
                match decide_ack(cursor, 1, a) {
                    AckDecision::Advance { to } => cursor.acked_sync_seq = to,
                    AckDecision::Unchanged { acked } => proptest::prop_assert_eq!(acked, before),
                    other => proptest::prop_assert!(false, "unexpected {:?}", other),
                }
                proptest::prop_assert!(cursor.acked_sync_seq >= before);
            }
            proptest::prop_assert_eq!(cursor.acked_sync_seq, *acks.iter().max().unwrap());
        }
    }

    #[test]
    fn cas_rules() {
        fn check(input: (DeviceCursor, DeviceCursor, DeviceCursor), expect: CasDecision) {
            assert_eq!(decide_cas(input.0, input.1, input.2), expect, "{input:?}");
        }
        let new = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::New };
        let bumped = DeviceCursor { generation: 2, acked_sync_seq: 0, state: DeviceState::Resetting };
        check((new, new, active(1, 0)), CasDecision::Write { new: active(1, 0), ends_recovery: false });
        check((new, new, bumped), CasDecision::Write { new: bumped, ends_recovery: true });
        check((bumped, new, active(1, 0)), CasDecision::Refuse { current: bumped });
        check((active(1, 4), active(1, 3), active(1, 5)), CasDecision::Refuse { current: active(1, 4) });
    }

    #[test]
    fn begin_recovery_rules() {
        fn check(input: (DeviceCursor, DeviceCursor), expect: CasDecision) {
            assert_eq!(decide_begin_recovery(input.0, input.1), expect, "{input:?}");
        }
        let recovering = DeviceCursor { generation: 3, acked_sync_seq: 9, state: DeviceState::Recovering };
        check((active(2, 9), active(2, 9)), CasDecision::Write { new: recovering, ends_recovery: true });
        check((active(2, 9), active(2, 8)), CasDecision::Refuse { current: active(2, 9) });
        check((recovering, active(2, 9)), CasDecision::Refuse { current: recovering });
    }

    #[test]
    fn cursor_after_ack_rules() {
        fn check(input: (DeviceCursor, AckDecision), expect: Option<DeviceCursor>) {
            assert_eq!(cursor_after_ack(input.0, input.1), expect, "{input:?}");
        }
        let recovering = DeviceCursor { generation: 3, acked_sync_seq: 9, state: DeviceState::Recovering };
        check((active(2, 5), AckDecision::Advance { to: 9 }), Some(active(2, 9)));
        check((recovering, AckDecision::CompleteRecovery { to: 12 }), Some(active(3, 12)));
        let reset = DeviceCursor { generation: 4, acked_sync_seq: 9, state: DeviceState::Resetting };
        check((recovering, AckDecision::RecoveryExpired { current: 3 }), Some(reset));
        check((active(2, 5), AckDecision::Unchanged { acked: 5 }), None);
        check((active(2, 5), AckDecision::StaleGeneration { current: 2 }), None);
        check((reset, AckDecision::Resetting { current: 4 }), None);
        check((active(2, 5), AckDecision::Revoked), None);
        let revoked_cursor = DeviceCursor { state: DeviceState::Revoked, ..active(2, 5) };
        assert_eq!(revoked(active(2, 5)), Some(revoked_cursor));
        assert_eq!(revoked(revoked_cursor), None);
    }
}
