//! `tidemark-chaos`: the long chaos run from the command line. Prints the
//! seed first, then the summary; exits non-zero if any violation was found.

use std::path::PathBuf;

use clap::Parser;
use tidemark_chaos::{parse_seed, random_seed, run, ChaosConfig, ServerMode, SEED_ENV};

#[derive(Parser, Debug)]
#[command(about = "Seeded chaos run of Tidemark clients through a fault-injecting proxy")]
struct Args {
    /// Seed of every random choice (decimal or 0x hex); random if absent.
    #[arg(long, env = SEED_ENV, value_parser = seed)]
    seed: Option<u64>,
    /// Messages to send.
    #[arg(long, env = "TIDEMARK_CHAOS_MESSAGES", default_value_t = 5000)]
    messages: usize,
    #[arg(long, default_value_t = 3)]
    users: usize,
    #[arg(long, default_value_t = 2)]
    devices: usize,
    /// The `tidemark` binary to run as the server (SIGKILLed on restarts).
    /// Default: `tidemark` next to this binary (target/<profile>/), if
    /// built; otherwise the server runs in-process.
    #[arg(long, env = "TIDEMARK_CHAOS_SERVER_BIN")]
    server_bin: Option<PathBuf>,
    /// Run the server in-process (graceful restarts) even if the binary
    /// exists.
    #[arg(long, conflicts_with = "server_bin")]
    in_process: bool,
}

/// The server to run, as the flags and the build directory say.
fn server_mode(args: &Args) -> ServerMode {
    if args.in_process {
        return ServerMode::InProcess;
    }
    let sibling = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join("tidemark")));
    match args.server_bin.clone().or(sibling.filter(|p| p.is_file())) {
        Some(bin) => ServerMode::Binary(bin),
        None => ServerMode::InProcess,
    }
}

fn seed(s: &str) -> Result<u64, String> {
    parse_seed(s).ok_or_else(|| format!("not a seed: {s}"))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(random_seed);
    println!("tidemark chaos: seed {seed}");
    let config = ChaosConfig {
        users: args.users,
        devices_per_user: args.devices,
        server: server_mode(&args),
        // One below the users: a group of every user is shared, a group
        // of two grows across the threshold (with three users or more).
        large_group_members: (args.users as u64).saturating_sub(1).max(1),
        ..ChaosConfig::long(seed, args.messages)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = runtime.block_on(run(config))?;
    print!("{report}");
    if !report.ok() {
        std::process::exit(1);
    }
    Ok(())
}
