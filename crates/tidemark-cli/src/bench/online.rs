//! `bench online`: the online latency of one direct conversation (issue
//! 19). One user's device sends at a steady open-loop rate; the other
//! user's device is a real SDK `Client` with its own local store (WAL,
//! `synchronous=FULL`) syncing on hints. The latency of a message is from
//! the sender starting its `send` to the receiving device having committed
//! it locally, measured by `bench fanout`'s machinery (`fanout.rs`: the
//! same server, receivers and read-back) with a group of two made a direct
//! conversation and the closed-loop sender made an open loop
//! ([`Pace::Open`]): send `n` starts `n / rate` seconds after the first,
//! whatever the answers, so a slow answer delays no later send. A direct
//! conversation's creation writes no event, so the receiving device learns
//! of it with the first message (whose latency carries that first contact).
//!
//! The baseline of the same round is `bench fanout`'s bare
//! tokio-tungstenite broadcast to one client committing each batch of
//! frames to its own local SQLite (WAL, `synchronous=FULL`), driven by the
//! same open loop.
//!
//! Per rate it reports p50, p99, p99/p50 and max for Tidemark and the
//! baseline, per round and as medians over rounds; the goal is a steady
//! p99 of at most 2x the p50 at 20 and at 200 msgs/s, so the spread over
//! rounds (the largest per-round p99/p50) is printed beside the median.

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use serde::Serialize;

use super::device::bar;
use super::fanout::{baseline_run, tidemark_run, Pace, Run, Shape, DIRECT};
use super::{init_logs, median, print_table};

/// The goal: p99 at most this many times the p50, at every rate.
const SPREAD_GOAL: f64 = 2.0;
/// Highest rate the flag takes, messages per second.
const RATE_MAX: u32 = 10_000;

#[derive(clap::Args, Debug, Clone)]
pub struct OnlineArgs {
    /// Send rates, messages per second (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![20u32, 200])]
    pub rates: Vec<u32>,
    /// Seconds each rate sends for (rate x seconds messages per run).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=600))]
    pub seconds: u32,
    /// Rounds; each runs every rate on both sides (alternating which goes
    /// first). Medians and the spread over rounds are reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Events per sync page (and most frames a baseline client commits at
    /// once).
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    #[arg(long, default_value = "bench-results/online.json")]
    pub out: PathBuf,
    /// Where the temporary stores go (must be a real disk).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The figures of one side of one run.
#[derive(Debug, Clone, Serialize)]
struct Side {
    p50_ms: f64,
    p99_ms: f64,
    /// p99 / p50: the goal is at most [`SPREAD_GOAL`].
    p99_over_p50: f64,
    max_ms: f64,
    run: Run,
}

impl Side {
    fn of(run: Run) -> Side {
        Side {
            p50_ms: run.p50_ms,
            p99_ms: run.p99_ms,
            p99_over_p50: run.p99_ms / run.p50_ms.max(f64::MIN_POSITIVE),
            max_ms: run.max_ms,
            run,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct RoundRun {
    round: u32,
    rate: u32,
    messages: u32,
    tidemark: Side,
    baseline: Side,
}

/// Medians over rounds, and the worst round's spread.
#[derive(Debug, Clone, Serialize)]
struct Medians {
    p50_ms: f64,
    p99_ms: f64,
    p99_over_p50: f64,
    max_ms: f64,
    /// The largest per-round p99/p50 (the goal holds in every round only
    /// if this is at most [`SPREAD_GOAL`]).
    worst_p99_over_p50: f64,
    /// The lowest and highest per-round p99.
    p99_range_ms: (f64, f64),
}

fn medians(sides: &[&Side]) -> Medians {
    let m = |f: &dyn Fn(&Side) -> f64| median(sides.iter().map(|s| f(s)).collect());
    let p99s = sides.iter().map(|s| s.p99_ms);
    Medians {
        p50_ms: m(&|s| s.p50_ms),
        p99_ms: m(&|s| s.p99_ms),
        p99_over_p50: m(&|s| s.p99_over_p50),
        max_ms: m(&|s| s.max_ms),
        worst_p99_over_p50: sides.iter().map(|s| s.p99_over_p50).fold(0.0, f64::max),
        p99_range_ms: (p99s.clone().fold(f64::INFINITY, f64::min), p99s.fold(0.0, f64::max)),
    }
}

#[derive(Debug, Clone, Serialize)]
struct RateSummary {
    rate: u32,
    messages: u32,
    rounds: u32,
    tidemark: Medians,
    baseline: Medians,
    /// Whether Tidemark's median p99/p50 meets the goal.
    goal_met: bool,
}

pub async fn run(args: OnlineArgs) -> Result<()> {
    init_logs();
    ensure!(!args.rates.is_empty(), "--rates needs at least one rate");
    for &r in &args.rates {
        ensure!((1..=RATE_MAX).contains(&r), "a rate must be 1..={RATE_MAX} messages per second");
    }
    ensure!(
        (1..=tidemark_client::proto::SYNC_LIMIT_MAX).contains(&args.limit),
        "--limit must be 1..={}",
        tidemark_client::proto::SYNC_LIMIT_MAX
    );
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let shape = |rate: u32| Shape {
        members: 2,
        messages: rate * args.seconds,
        limit: args.limit,
        pace: Pace::Open { per_sec: f64::from(rate) },
        conv_kind: DIRECT,
    };
    let per_round: u64 = args.rates.iter().map(|&r| 2 * u64::from(shape(r).messages)).sum();
    let pb = bar(per_round * u64::from(args.rounds), "deliveries");
    let mut runs: Vec<RoundRun> = Vec::new();
    for round in 1..=args.rounds {
        for &rate in &args.rates {
            let shape = shape(rate);
            // Alternate which side goes first, as `bench fanout` does.
            let tidemark_first = round % 2 == 1;
            let (mut tidemark, mut baseline) = (None, None);
            for side in 0..2 {
                if (side == 0) == tidemark_first {
                    pb.set_message(format!("round {round}: tidemark, {rate} msgs/s"));
                    tidemark = Some(tidemark_run(&parent, None, "", &shape, &pb).await?);
                } else {
                    pb.set_message(format!("round {round}: baseline, {rate} msgs/s"));
                    baseline = Some(baseline_run(&parent, &shape, &pb).await?);
                }
            }
            runs.push(RoundRun {
                round,
                rate,
                messages: shape.messages,
                tidemark: Side::of(tidemark.context("tidemark run")?),
                baseline: Side::of(baseline.context("baseline run")?),
            });
        }
    }
    pb.finish_and_clear();
    let summaries: Vec<RateSummary> = args
        .rates
        .iter()
        .map(|&rate| {
            let of_rate: Vec<&RoundRun> = runs.iter().filter(|r| r.rate == rate).collect();
            let tidemark = medians(&of_rate.iter().map(|r| &r.tidemark).collect::<Vec<_>>());
            RateSummary {
                rate,
                messages: shape(rate).messages,
                rounds: of_rate.len() as u32,
                goal_met: tidemark.p99_over_p50 <= SPREAD_GOAL,
                tidemark,
                baseline: medians(&of_rate.iter().map(|r| &r.baseline).collect::<Vec<_>>()),
            }
        })
        .collect();

    println!(
        "tidemark bench online: one direct conversation, the sender's device sends at a steady open-loop rate for \
         {} s per rate; the receiving device is an SDK client with its own local SQLite store (WAL, \
         synchronous=FULL) syncing on hints; baseline = bare tokio-tungstenite broadcast to one client committing \
         to its own local SQLite; latency = send start -> receiving device's local COMMIT; medians of {} rounds \
         (goal: p99/p50 <= {SPREAD_GOAL})\n",
        args.seconds, args.rounds
    );
    let mut rows = Vec::new();
    for s in &summaries {
        for (name, m) in [("tidemark", &s.tidemark), ("baseline", &s.baseline)] {
            rows.push(vec![
                format!("{name} ({} msgs/s)", s.rate),
                format!("{}", s.messages),
                format!("{:.2}", m.p50_ms),
                format!("{:.2}", m.p99_ms),
                format!("{:.2}", m.p99_over_p50),
                format!("{:.2}", m.worst_p99_over_p50),
                format!("{:.2}-{:.2}", m.p99_range_ms.0, m.p99_range_ms.1),
                format!("{:.2}", m.max_ms),
            ]);
        }
    }
    print_table(
        &[
            "run (median of rounds)",
            "messages",
            "p50 ms",
            "p99 ms",
            "p99/p50",
            "worst p99/p50",
            "p99 range ms",
            "max ms",
        ],
        &rows,
    );
    println!();
    let mut rows = Vec::new();
    for r in &runs {
        for (name, x) in [("tidemark", &r.tidemark), ("baseline", &r.baseline)] {
            rows.push(vec![
                format!("{name} ({} msgs/s)", r.rate),
                format!("{}", r.round),
                format!("{:.2}", x.p50_ms),
                format!("{:.2}", x.p99_ms),
                format!("{:.2}", x.p99_over_p50),
                format!("{:.2}", x.max_ms),
                format!("{:.2}", x.run.commits_per_delivery),
            ]);
        }
    }
    print_table(&["per round", "round", "p50 ms", "p99 ms", "p99/p50", "max ms", "commits/delivery"], &rows);
    for s in &summaries {
        println!(
            "{} msgs/s: tidemark p99/p50 {:.2} (median), worst round {:.2}: goal {}",
            s.rate,
            s.tidemark.p99_over_p50,
            s.tidemark.worst_p99_over_p50,
            if s.goal_met { "met" } else { "NOT met" }
        );
    }
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let json = serde_json::json!({
        "scenario": "online",
        "note": "one direct conversation; open-loop sender at each rate (send n starts n/rate s after the first); \
                 the receiving device is tidemark_client::Client with its own local SQLite (WAL, synchronous=FULL), \
                 time stamp at Change::PageApplied; baseline = bare tokio-tungstenite broadcast in the same process \
                 to one client committing the frames received together in one transaction, same open loop; latency \
                 from send start to the receiving device's local COMMIT; summaries are medians over rounds",
        "seconds": args.seconds, "limit": args.limit, "rounds": args.rounds, "spread_goal": SPREAD_GOAL,
        "summary": summaries,
        "runs": runs,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}
