//! This node's load level and the degradation order applied to it (seed
//! §9.4, P3). The rule is `tidemark_core::degrade`; this module holds the
//! level the relay last observed and counts what the order held back.
//!
//! The relay sets the level after every claim from the age of the oldest
//! outbox item it took, if the claim was full (one that is not full, or
//! empty, reached the end of the outbox: normal again). The workers ask
//! before each round: the re-hint sweep pauses while hints are only merged,
//! retention and scheduled reconciliation wait, the push worker waits when
//! overloaded, and typing and presence are refused with `RATE_LIMITED`.
//! Sends, syncs and the fan-out itself never ask: they always run.

use std::sync::atomic::{AtomicU8, Ordering};

use tidemark_core::degrade::{action, Action, Load, LoadBounds, Work};

use crate::metrics as m;

/// The `retry_after_ms` of typing and presence refused while the node is
/// behind: about one relay round under load.
pub const SHED_RETRY_AFTER_MS: u64 = 1_000;

/// The load level this node's relay last observed.
pub struct LoadState {
    level: AtomicU8,
    bounds: LoadBounds,
}

impl LoadState {
    pub fn new(bounds: LoadBounds) -> LoadState {
        LoadState { level: AtomicU8::new(Load::Normal.level()), bounds }
    }

    /// Records a claim whose oldest item was `fanout_lag_ms` old (`None`:
    /// nothing to claim), `full` if it took as many items as it asked for,
    /// and returns the new level.
    pub fn observe(&self, fanout_lag_ms: Option<u64>, full: bool) -> Load {
        let load = Load::of(fanout_lag_ms, full, self.bounds);
        let before = self.level.swap(load.level(), Ordering::Relaxed);
        if before != load.level() {
            m::LOAD_LEVEL.set(f64::from(load.level()));
            m::LOAD_CHANGES.add_by("level", m::LOAD_LEVELS[load.level() as usize], 1);
            tracing::info!(stage = "fanout", level = ?load, lag_ms = fanout_lag_ms, "load level changed");
        }
        load
    }

    pub fn load(&self) -> Load {
        match self.level.load(Ordering::Relaxed) {
            0 => Load::Normal,
            1 => Load::Behind,
            _ => Load::Overloaded,
        }
    }

    /// What `work` does now; a wait or a shed is counted by kind of work.
    pub fn action(&self, work: Work) -> Action {
        let a = action(work, self.load());
        if matches!(a, Action::Wait | Action::Shed) {
            m::DEGRADED.add_by("work", work.name(), 1);
        }
        a
    }

    /// Whether `work` may run a round now (it waits or is shed otherwise;
    /// merged work runs).
    pub fn runs(&self, work: Work) -> bool {
        matches!(self.action(work), Action::Run | Action::Merge)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_level_follows_the_last_claim_and_an_empty_outbox_is_normal_again() {
        let s = LoadState::new(LoadBounds { behind_ms: 100, overloaded_ms: 1_000 });
        assert_eq!(s.load(), Load::Normal);
        assert_eq!(s.observe(Some(150), false), Load::Normal, "not full: catching up");
        assert_eq!(s.observe(Some(150), true), Load::Behind);
        assert!(!s.runs(Work::Derived) && s.runs(Work::Push) && s.runs(Work::Facts));
        assert_eq!(s.action(Work::Hints), Action::Merge);
        assert_eq!(s.observe(Some(5_000), true), Load::Overloaded);
        assert!(!s.runs(Work::Push) && s.runs(Work::Pulls));
        assert_eq!(s.observe(None, false), Load::Normal);
        assert!(Work::ALL.iter().all(|w| s.runs(*w)));
    }
}
