//! 200 concurrent logins with wrong passwords (P1, issue 15): password
//! hashes run at most `PASSWORD_HASHES_CONCURRENT_MAX` at once, so the
//! server's memory stays bounded (Argon2 costs ~19 MiB a hash; unbounded,
//! 200 at once took a server to gigabytes), and an honest login still
//! succeeds once it waits as it is told.
//!
//! Its own test binary: the memory bound is read from this process's peak
//! resident size (`VmHWM`), which the server shares.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tidemark_client::proto::ErrorCode;
use tidemark_client::ClientError;
use tidemark_server::limits::PASSWORD_HASHES_CONCURRENT_MAX;

/// The peak resident size this flood may reach, in KiB: two hashes at a
/// time and the test's own server and clients.
const PEAK_RSS_KIB_MAX: u64 = 320 * 1024;

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/self/status");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_flood_runs_bounded_hashes_and_an_honest_login_gets_through() {
    let ts = TestServer::start().await;
    ts.user("ann").await;
    let before = peak_rss_kib();
    let url = ts.running().url();
    let mut flood = tokio::task::JoinSet::new();
    for i in 0..200 {
        let http = tidemark_client::Http::new(&url);
        // An attacker without an account: every name is unknown, and costs
        // the server a hash like a known one.
        flood.spawn(async move { http.login(&format!("nobody{i}"), "guess", "dev").await.map(|_| ()) });
    }
    let mut refused = (0, 0);
    while let Some(r) = flood.join_next().await {
        match r.unwrap() {
            Err(ClientError::Server(f)) if f.code == ErrorCode::Unauthenticated => refused.0 += 1,
            Err(ClientError::Server(f)) if f.code == ErrorCode::RateLimited => {
                assert!(f.retry_after_ms.is_some());
                refused.1 += 1;
            }
            other => panic!("a wrong password got {other:?}"),
        }
    }
    assert_eq!(refused.0 + refused.1, 200);
    let peak = ts.running().state.limits.password_hashes_peak();
    assert!(peak <= PASSWORD_HASHES_CONCURRENT_MAX, "{peak} hashes ran at once");
    assert!(peak >= 1);
    let after = peak_rss_kib();
    assert!(after <= PEAK_RSS_KIB_MAX, "peak RSS {after} KiB (before the flood {before} KiB)");

    // The honest user, waiting as told whenever it is limited.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match ts.http.login("ann", PASSWORD, "phone").await {
            Ok(ok) => {
                assert_eq!(ok.user, "ann");
                break;
            }
            Err(ClientError::Server(f)) if f.code == ErrorCode::RateLimited && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(f.retry_after_ms.unwrap_or(100))).await;
            }
            Err(e) => panic!("the honest login failed: {e}"),
        }
    }
    ts.stop().await;
}
