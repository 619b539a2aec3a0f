//! Tidemark's chaos checker: a seeded, replayable run of real SDK clients
//! against a real server through a fault-injecting proxy, followed by a
//! message-by-message check of every device.
//!
//! - [`proxy`]: the WebSocket proxy that drops, duplicates, delays, swaps
//!   frames and cuts connections, counting every fault by kind;
//! - [`scenario`]: the run (users, devices, direct conversations, groups
//!   whose members are removed, added back and leave, server restarts,
//!   client reopens and crashes at the SDK's crash points, clients stopped
//!   until they fall off the retained user log and rebuild from a snapshot)
//!   and the facts it collects, membership changes with their `msg_seq`
//!   included;
//! - [`check`]: the pure verdict over those facts, membership period by
//!   membership period in the groups, and against each rebuilt device's
//!   snapshot boundary and what `history` serves below it.
//!
//! One seed drives every random choice of the proxy and the scenario; it is
//! printed first so a failing run can be replayed with `--seed`.

pub mod check;
pub mod proxy;
pub mod scenario;

pub use scenario::{run, ChaosConfig, Report, ServerMode};

/// The environment variable that fixes the seed of a run.
pub const SEED_ENV: &str = "TIDEMARK_CHAOS_SEED";

/// The seed from [`SEED_ENV`] if set (decimal or `0x` hex), else `default`.
pub fn seed_from_env(default: u64) -> u64 {
    std::env::var(SEED_ENV).ok().and_then(|s| parse_seed(&s)).unwrap_or(default)
}

/// A seed drawn from the OS, for runs that should explore.
pub fn random_seed() -> u64 {
    rand::random()
}

pub fn parse_seed(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}
