//! The degradation order under overload (seed §9.4, P3), pure.
//!
//! When events pile up, what the server keeps doing comes in a fixed order:
//! first the facts (accepting and committing messages) and the proof of
//! their propagation (fan-out), then the devices' own pulls (`sync`,
//! `conv.sync`, `history`), then online hints (merged: one waiting hint per
//! connection already holds only the highest watermark), then offline push,
//! then the derived work (retention, reconciliation), and first to go the
//! ephemeral lane (typing and presence, never stored). Never is the accept and pull path starved to keep a
//! per-message hint or push.
//!
//! The load is read from the fan-out's own lag: the age of the oldest
//! outbox item the relay's last claim took, when that claim was full (it
//! left more behind it). A relay that keeps up claims items a few
//! milliseconds old, and a claim that is not full reached the end of the
//! outbox, so it is catching up whatever the age of what it took (a slow
//! wake-up on a busy machine is not a backlog); one that falls behind
//! claims full batches of older items.
//! [`Load::of`] turns that age into a level and [`action`] says, per kind of
//! [`Work`], whether it runs, is merged, waits or is shed at that level.

/// How far behind the fan-out is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Load {
    /// The relay keeps up.
    Normal,
    /// The oldest item claimed was older than the "behind" bound: hints
    /// are only merged, derived work waits, typing and presence are shed.
    Behind,
    /// Older than the "overloaded" bound: offline push waits too.
    Overloaded,
}

/// The lag bounds of the levels, in milliseconds of fan-out lag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadBounds {
    pub behind_ms: u64,
    pub overloaded_ms: u64,
}

/// A second of fan-out lag is already visible to a user watching two
/// devices; five mean the relay is not catching up on its own.
pub const LOAD_BOUNDS_DEFAULT: LoadBounds = LoadBounds { behind_ms: 1_000, overloaded_ms: 5_000 };

impl Load {
    /// The level of a relay whose last claim's oldest item was
    /// `fanout_lag_ms` old (`None`: the claim found the outbox empty) and
    /// which was `full` (as many items as it asked for).
    pub fn of(fanout_lag_ms: Option<u64>, full: bool, bounds: LoadBounds) -> Load {
        match fanout_lag_ms {
            Some(lag) if full && lag >= bounds.overloaded_ms.max(bounds.behind_ms) => Load::Overloaded,
            Some(lag) if full && lag >= bounds.behind_ms => Load::Behind,
            _ => Load::Normal,
        }
    }

    /// The level as a gauge value (0, 1, 2).
    pub fn level(self) -> u8 {
        self as u8
    }
}

/// The kinds of work, in the order they are kept (first kept last shed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Work {
    /// Accepting sends and conversation changes, and fanning them out.
    Facts,
    /// `sync`, `ack`, `conv.sync`, `history`, snapshots: a device's own pull.
    Pulls,
    /// Hints to connected devices, and the re-hint sweep.
    Hints,
    /// Offline push notifications.
    Push,
    /// Retention passes and scheduled reconciliation.
    Derived,
    /// Typing and presence.
    Ephemeral,
}

impl Work {
    pub const ALL: [Work; 6] = [Work::Facts, Work::Pulls, Work::Hints, Work::Push, Work::Derived, Work::Ephemeral];

    /// The name used in logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Work::Facts => "facts",
            Work::Pulls => "pulls",
            Work::Hints => "hints",
            Work::Push => "push",
            Work::Derived => "derived",
            Work::Ephemeral => "ephemeral",
        }
    }
}

/// What happens to one kind of work at one load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Run,
    /// Runs, but only merged: a hint already waiting absorbs the next, and
    /// the re-hint sweep (a repeat of hints already sent) pauses.
    Merge,
    /// Deferred to a later pass; nothing is lost (it is derived from
    /// committed facts and runs again once the load falls).
    Wait,
    /// Dropped: only for what is never stored (typing, presence).
    Shed,
}

/// The degradation table.
pub fn action(work: Work, load: Load) -> Action {
    use Action::*;
    match (work, load) {
        (Work::Facts | Work::Pulls, _) => Run,
        (Work::Hints, Load::Normal) => Run,
        (Work::Hints, _) => Merge,
        (Work::Push, Load::Overloaded) => Wait,
        (Work::Push, _) => Run,
        (Work::Derived, Load::Normal) => Run,
        (Work::Derived, _) => Wait,
        (Work::Ephemeral, Load::Normal) => Run,
        (Work::Ephemeral, _) => Shed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_follows_the_fanout_lag() {
        let b = LoadBounds { behind_ms: 1_000, overloaded_ms: 5_000 };
        let cases: &[(Option<u64>, bool, Load)] = &[
            // oldest item's lag, claim full, level
            (None, false, Load::Normal),
            (Some(0), true, Load::Normal),
            (Some(999), true, Load::Normal),
            (Some(1_000), true, Load::Behind),
            (Some(4_999), true, Load::Behind),
            (Some(5_000), true, Load::Overloaded),
            (Some(u64::MAX), true, Load::Overloaded),
            // A claim that reached the end of the outbox is catching up.
            (Some(1_000), false, Load::Normal),
            (Some(u64::MAX), false, Load::Normal),
        ];
        for &(lag, full, load) in cases {
            assert_eq!(Load::of(lag, full, b), load, "lag {lag:?}, full {full}");
        }
        // Bounds given the wrong way round never skip a level's meaning.
        let odd = LoadBounds { behind_ms: 5_000, overloaded_ms: 1_000 };
        assert_eq!(Load::of(Some(2_000), true, odd), Load::Normal);
        assert_eq!(Load::of(Some(5_000), true, odd), Load::Overloaded);
    }

    #[test]
    fn facts_and_pulls_always_run_and_the_rest_degrades_in_the_seed_order() {
        use Action::*;
        let table: &[(Work, [Action; 3])] = &[
            // work: Normal, Behind, Overloaded
            (Work::Facts, [Run, Run, Run]),
            (Work::Pulls, [Run, Run, Run]),
            (Work::Hints, [Run, Merge, Merge]),
            (Work::Push, [Run, Run, Wait]),
            (Work::Derived, [Run, Wait, Wait]),
            (Work::Ephemeral, [Run, Shed, Shed]),
        ];
        for (work, row) in table {
            for (load, want) in [Load::Normal, Load::Behind, Load::Overloaded].into_iter().zip(row) {
                assert_eq!(action(*work, load), *want, "{} at {load:?}", work.name());
            }
        }
        // Monotone: a kind later in the order never runs where an earlier
        // one is held back (merged hints still go out), and no kind
        // recovers as the load grows.
        let rank = |a: Action| match a {
            Run | Merge => 0,
            Wait => 1,
            Shed => 2,
        };
        for load in [Load::Normal, Load::Behind, Load::Overloaded] {
            for pair in Work::ALL.windows(2) {
                let (a, b) = (action(pair[0], load), action(pair[1], load));
                assert!(rank(a) <= rank(b), "{} {a:?} vs {} {b:?} at {load:?}", pair[0].name(), pair[1].name());
            }
        }
        for work in Work::ALL {
            let ranks: Vec<u8> =
                [Load::Normal, Load::Behind, Load::Overloaded].iter().map(|l| rank(action(work, *l))).collect();
            assert!(ranks.windows(2).all(|w| w[0] <= w[1]), "{} recovers under load: {ranks:?}", work.name());
        }
    }
}
