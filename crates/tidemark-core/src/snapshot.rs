//! Snapshots (D7): when one may start, which page it serves, and when one
//! installs. A backend reads the snapshot row and the device row in its
//! write transaction, calls these and writes what they decide.

use crate::cursor::{DeviceCursor, DeviceState, UserLog};
use crate::kinds::SNAPSHOT_READY;
use crate::{Generation, Refusal, SyncSeq};

/// A snapshot's record, as the rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot<'a> {
    pub user: &'a str,
    pub device: &'a str,
    pub generation: Generation,
    pub base_sync_seq: SyncSeq,
    /// `BUILDING`, `READY`, `INSTALLED` or `EXPIRED`.
    pub state: &'a str,
    pub pages: u32,
    pub expires_at_ms: i64,
}

/// A snapshot starts only for a device `RESETTING` at `generation`.
pub fn check_begin(cursor: DeviceCursor, generation: Generation) -> Result<(), Refusal> {
    if cursor.state != DeviceState::Resetting || cursor.generation != generation {
        return Err(Refusal::Conflict(format!(
            "device is {} at generation {}, not resetting at {generation}",
            cursor.state.as_str(),
            cursor.generation
        )));
    }
    Ok(())
}

/// A view read at `base` (the head of the read snapshot it came from)
/// starts a snapshot only if the log, as the writer sees it when it
/// records the snapshot, still holds everything after `base`: retention may
/// have trimmed past it between the read and the record, and a snapshot
/// whose incremental sync could never start would only reset again.
pub fn check_base(base: SyncSeq, log: UserLog) -> Result<(), Refusal> {
    if base < log.trimmed_upto || base > log.high_watermark {
        return Err(Refusal::Conflict(format!(
            "the log moved past the snapshot's base {base} (trimmed to {}, head {}); retry",
            log.trimmed_upto, log.high_watermark
        )));
    }
    Ok(())
}

/// Only a `READY` snapshot serves pages, each below its page count: an
/// installed one has no items left.
pub fn serves_page(s: &Snapshot<'_>, page: u32) -> bool {
    s.state == SNAPSHOT_READY && page < s.pages
}

/// What `snapshot.ack` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Install {
    /// Write this cursor (`ACTIVE` at the snapshot's base and generation),
    /// mark the snapshot `INSTALLED` and expire the device's other live
    /// snapshots.
    Install(DeviceCursor),
    /// Nothing is written: not ready, expired, or the device moved on.
    Refuse,
}

/// D7: a snapshot installs only for its own device, while it is `READY`
/// and unexpired and the device is still `RESETTING` at its generation.
/// Another user's or device's snapshot does not exist for the caller.
pub fn decide_install(
    s: &Snapshot<'_>,
    snapshot_id: &str,
    user: &str,
    device: &str,
    cursor: DeviceCursor,
    now_ms: i64,
) -> Result<Install, Refusal> {
    if s.user != user || s.device != device {
        return Err(Refusal::NotFound(format!("snapshot {snapshot_id}")));
    }
    let installable = s.state == SNAPSHOT_READY
        && cursor.state == DeviceState::Resetting
        && cursor.generation == s.generation
        && now_ms < s.expires_at_ms;
    Ok(if installable {
        Install::Install(DeviceCursor {
            generation: s.generation,
            acked_sync_seq: s.base_sync_seq,
            state: DeviceState::Active,
        })
    } else {
        Install::Refuse
    })
}

/// Whether a snapshot carries a `privacy` item (issue 18): once the user
/// changed the switches (`version` > 0). A user who never did holds the
/// defaults, which a device installing a snapshot starts from anyway, so
/// such a snapshot is item for item what it was before the item existed.
pub fn carries_privacy(version: u64) -> bool {
    version > 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_changed_switches_are_a_snapshot_item() {
        for (version, carried) in [(0, false), (1, true), (7, true)] {
            assert_eq!(super::carries_privacy(version), carried, "{version}");
        }
    }

    use super::*;
    use crate::kinds::{SNAPSHOT_BUILDING, SNAPSHOT_INSTALLED};

    const READY: Snapshot<'static> = Snapshot {
        user: "b",
        device: "phone",
        generation: 2,
        base_sync_seq: 40,
        state: SNAPSHOT_READY,
        pages: 3,
        expires_at_ms: 1_000,
    };

    fn cursor(generation: u64, state: DeviceState) -> DeviceCursor {
        DeviceCursor { generation, acked_sync_seq: 5, state }
    }

    #[test]
    fn install_rules() {
        fn check(input: (Snapshot<'static>, &str, DeviceCursor, i64), expect: Result<Install, Refusal>) {
            let (s, device, c, now) = input;
            assert_eq!(decide_install(&s, "s1", "b", device, c, now), expect, "{input:?}");
        }
        let resetting = cursor(2, DeviceState::Resetting);
        let installed =
            Install::Install(DeviceCursor { generation: 2, acked_sync_seq: 40, state: DeviceState::Active });
        check((READY, "phone", resetting, 999), Ok(installed));
        check((READY, "phone", resetting, 1_000), Ok(Install::Refuse));
        check((READY, "desk", resetting, 0), Err(Refusal::NotFound("snapshot s1".into())));
        check((Snapshot { user: "c", ..READY }, "phone", resetting, 0), Err(Refusal::NotFound("snapshot s1".into())));
        check((Snapshot { state: SNAPSHOT_BUILDING, ..READY }, "phone", resetting, 0), Ok(Install::Refuse));
        check((Snapshot { state: SNAPSHOT_INSTALLED, ..READY }, "phone", resetting, 0), Ok(Install::Refuse));
        check((Snapshot { state: "EXPIRED", ..READY }, "phone", resetting, 0), Ok(Install::Refuse));
        check((READY, "phone", cursor(3, DeviceState::Resetting), 0), Ok(Install::Refuse));
        check((READY, "phone", cursor(2, DeviceState::Active), 0), Ok(Install::Refuse));
        check((READY, "phone", cursor(2, DeviceState::Revoked), 0), Ok(Install::Refuse));
    }

    #[test]
    fn begin_and_page_rules() {
        fn check(input: (DeviceCursor, u64), expect: Result<(), Refusal>) {
            assert_eq!(check_begin(input.0, input.1), expect, "{input:?}");
        }
        check((cursor(2, DeviceState::Resetting), 2), Ok(()));
        check(
            (cursor(2, DeviceState::Resetting), 3),
            Err(Refusal::Conflict("device is RESETTING at generation 2, not resetting at 3".into())),
        );
        check(
            (cursor(2, DeviceState::Active), 2),
            Err(Refusal::Conflict("device is ACTIVE at generation 2, not resetting at 2".into())),
        );
        assert!(serves_page(&READY, 0) && serves_page(&READY, 2));
        assert!(!serves_page(&READY, 3));
        assert!(!serves_page(&Snapshot { state: SNAPSHOT_BUILDING, ..READY }, 0));
        assert!(!serves_page(&Snapshot { state: SNAPSHOT_INSTALLED, ..READY }, 0));
        let log = UserLog { high_watermark: 50, trimmed_upto: 20 };
        assert_eq!(check_base(20, log), Ok(()), "at the trim point: the sync after it starts there");
        assert_eq!(check_base(50, log), Ok(()));
        let moved = |b| {
            Err(Refusal::Conflict(format!(
                "the log moved past the snapshot's base {b} (trimmed to 20, head 50); retry"
            )))
        };
        assert_eq!(check_base(19, log), moved(19), "trimmed between the read and the record");
        assert_eq!(check_base(51, log), moved(51));
    }
}
