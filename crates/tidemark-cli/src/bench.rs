//! Benchmarks (placeholder replaced below).
use anyhow::Result;

#[derive(clap::Subcommand)]
pub enum BenchCommand {}

pub async fn run(command: BenchCommand) -> Result<()> {
    match command {}
}
