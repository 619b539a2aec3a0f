//! The short chaos run, in CI: three users with two devices each, about 60
//! messages through the fault-injecting proxy in direct conversations and
//! three groups whose membership changes (removals, adds back, leaves) with
//! a large-group threshold of two: one shared from its creation, one that
//! crosses it mid-run and switches, one per-member throughout; one
//! server restart, client reopens and crashes, and clients stopped until
//! they fall off the retained user log (about a second of retention) and
//! rebuild from a snapshot while faults go on; every device checked message
//! by message, period by period in the groups, and against its snapshot's
//! history boundary.
//!
//! `TIDEMARK_CHAOS_SEED` replays a seed; `TIDEMARK_CHAOS_MESSAGES` makes it
//! a long run.

use tidemark_chaos::{run, seed_from_env, ChaosConfig};

/// The CI run's seed unless `TIDEMARK_CHAOS_SEED` says otherwise: fixed, so
/// a red CI run is a regression, not a new seed's luck.
const DEFAULT_SEED: u64 = 0x7de_0001;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_chaos_run_loses_duplicates_and_misorders_nothing() {
    let seed = seed_from_env(DEFAULT_SEED);
    println!("tidemark chaos: seed {seed}");
    let messages = std::env::var("TIDEMARK_CHAOS_MESSAGES").ok().and_then(|m| m.parse().ok());
    let config = match messages {
        Some(m) => ChaosConfig::long(seed, m),
        None => ChaosConfig::short(seed),
    };
    let started = std::time::Instant::now();
    let report = run(config).await.expect("the run sets up");
    print!("{report}");
    println!("  took {:?}", started.elapsed());
    assert!(report.ok(), "seed {seed}: {} violations (see the summary above)", report.violations.len());
    assert!(report.check.verified > 0, "nothing verified");
    assert!(report.faults.iter().map(|(_, n)| n).sum::<u64>() > 0, "no fault injected");
    for op in ["conv.add", "conv.remove", "conv.leave"] {
        assert!(report.membership.get(op).is_some_and(|n| *n > 0), "no {op} made: {:?}", report.membership);
    }
    assert!(report.check.group_verified > 0, "no group message verified");
    // Large groups (G2, G3): one shared from its creation, one crossing the
    // threshold mid-run, their messages read by conv.sync pulls.
    assert!(report.check.shared_groups >= 2, "{} groups in shared mode", report.check.shared_groups);
    assert!(report.switched_mid_run > 0, "no group switched to shared mode during the run");
    assert!(report.check.shared_verified > 0, "no message above a switch verified");
    assert!(report.group_pulls > 0, "no shared-group pull committed");
    assert!(report.check.out_of_period_absent > 0, "no out-of-period event checked absent");
    assert!(report.fell_off > 0, "no stopped client fell off the retained log");
    assert!(report.snapshots_installed > 0, "no snapshot installed");
    assert!(report.check.rebuilt_devices > 0 && report.check.verified_after_snapshot > 0, "no rebuilt device verified");
    assert!(report.check.history_only > 0, "no event left as history by a snapshot checked against `history`");
}
