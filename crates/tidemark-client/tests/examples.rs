//! The crate's examples (`examples/*.rs`, shown in the crate docs) run
//! here against a real server on 127.0.0.1, each on its own: the same
//! code a developer runs with `cargo run --example`, including the checks
//! each makes of what it shows.

mod common;

#[allow(dead_code)]
#[path = "../examples/groups.rs"]
mod groups;
#[allow(dead_code)]
#[path = "../examples/history.rs"]
mod history;
#[allow(dead_code)]
#[path = "../examples/offline.rs"]
mod offline;
#[allow(dead_code)]
#[path = "../examples/send_and_receive.rs"]
mod send_and_receive;
#[allow(dead_code)]
#[path = "../examples/two_devices.rs"]
mod two_devices;

use common::*;
use tidemark_server::ServerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_send_and_receive() {
    let h = Harness::start().await;
    send_and_receive::run(&h.url, ADMIN, h.dir.path()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_two_devices() {
    let h = Harness::start().await;
    two_devices::run(&h.url, ADMIN, h.dir.path()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_groups() {
    let h = Harness::start().await;
    groups::run(&h.url, ADMIN, h.dir.path()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_offline() {
    let h = Harness::start().await;
    offline::run(&h.url, ADMIN, h.dir.path()).await.unwrap();
}

/// On a server whose snapshots carry 3 messages a conversation the tablet
/// may start from one (if a retention pass trimmed Bob's log first) and
/// then fetch the older pages from the server; either way it must page
/// through every message once, newest first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_history() {
    let mut config = ServerConfig {
        retention_every: std::time::Duration::from_millis(20),
        snapshot_messages_per_conv: 3,
        ..ServerConfig::default()
    };
    config.retention.as_mut().expect("retention on by default").keep_events_younger_than_ms = 0;
    let h = Harness::start_with(config).await;
    let paged = history::run(&h.url, ADMIN, h.dir.path()).await.unwrap();
    println!("{paged:?}");
}
