//! `/metrics` read as Prometheus reads it: the exposition is parsed by a
//! Prometheus text-format parser and linted against the naming and typing
//! conventions (HELP and TYPE on every family, counters `_total`, units in
//! names, histogram buckets in their unit, no family under two names);
//! every family exists before any traffic; values after known traffic are
//! exactly what that traffic implies.
//!
//! The recorder is process-global: the other test in this binary sends
//! nothing and scrapes nothing, so the values read here come from the first
//! test's traffic alone under any test runner (`stage_metrics.rs` holds the
//! stage tests with traffic of their own).

mod common;

use std::collections::BTreeSet;

use common::exposition::scrape;
use common::*;
use tidemark_server::ServerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_prometheus_conventions_and_count_known_traffic() {
    let ts = TestServer::start().await;

    // Before any traffic: every family the server declares is there, at zero.
    let fresh = scrape(&ts).await;
    assert_eq!(fresh.lint(), Vec::<String>::new(), "lint of a fresh server");
    let types = fresh.types();
    let declared: BTreeSet<&str> = tidemark_server::metrics::FAMILIES.iter().map(|f| f.name()).collect();
    let exposed: BTreeSet<&str> = types.keys().map(String::as_str).collect();
    assert_eq!(
        declared.difference(&exposed).collect::<Vec<_>>(),
        Vec::<&&str>::new(),
        "declared families missing before first use"
    );
    assert_eq!(fresh.value("tidemark_sends_accepted_total", &[]), 0.0);
    assert_eq!(fresh.value("tidemark_refusals_total", &[("code", "NOT_MEMBER")]), 0.0);
    assert_eq!(fresh.value("tidemark_acks_total", &[("result", "advanced")]), 0.0);

    // Known traffic: 3 sends, 1 retry and 1 refused send, one refused login,
    // one batch ACKed.
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for cmid in ["m1", "m2", "m3", "m1"] {
        ann.send(&conv, cmid).await;
    }
    let refused = code(ann.ws.send(&send_req("no-such-conv", "m4")).await);
    assert_eq!(
        code(ts.http.login("ann", "wrong password", "tablet").await),
        tidemark_client::proto::ErrorCode::Unauthenticated
    );
    let mut ben = ts.device("ben", "phone").await;
    ben.sync_until(3, 10).await;
    let acked = ben.log.len();
    assert_eq!(acked, 3);

    let after = scrape(&ts).await;
    assert_eq!(after.lint(), Vec::<String>::new(), "lint after traffic");
    assert_eq!(after.value("tidemark_sends_accepted_total", &[]), 3.0);
    assert_eq!(after.value("tidemark_sends_duplicate_total", &[]), 1.0);
    assert_eq!(after.value("tidemark_refusals_total", &[("code", "UNAUTHENTICATED")]), 1.0);
    assert!(after.value("tidemark_acks_total", &[("result", "advanced")]) >= 1.0);
    assert!(after.value("tidemark_sync_pages_total", &[]) >= 1.0);
    // Fan-out wrote each message to both members' logs (sender included).
    assert_eq!(after.value("tidemark_fanout_events_total", &[]), 6.0);
    assert_eq!(after.value("tidemark_ws_connections", &[]), 2.0);
    assert!(after.value("tidemark_store_commits_total", &[]) >= 1.0);
    assert!(after.value("tidemark_store_statements_total", &[]) > fresh.value("tidemark_store_statements_total", &[]));
    assert!(after.value("tidemark_store_commit_batch_requests", &[]) >= 1.0);
    // Stage metrics (O1, seed §18.1). Accept: every send is timed, the
    // retry and the refused one included; one was refused.
    assert_eq!(after.value("tidemark_accept_latency_seconds", &[]), 5.0);
    assert_eq!(after.value("tidemark_sends_refused_total", &[("code", refused.as_str())]), 1.0);
    assert_eq!(after.value("tidemark_sends_refused_total", &[("code", "INTERNAL")]), 0.0);
    // Fan-out: 3 direct items (the messages), each to 2 recipients; none
    // in a group; no period missed or hit twice.
    let direct = [("conv_kind", "direct")];
    assert_eq!(after.value("tidemark_fanout_lag_seconds", &direct), 3.0);
    assert_eq!(after.value("tidemark_fanout_amplification_events", &direct), 3.0);
    assert_eq!(after.sum("tidemark_fanout_amplification_events", &direct), 6.0);
    assert_eq!(after.value("tidemark_fanout_amplification_events", &[("conv_kind", "group")]), 0.0);
    assert_eq!(after.value("tidemark_fanout_period_misses_total", &[]), 0.0);
    assert_eq!(after.value("tidemark_invariant_violations_total", &[("invariant", "period_overlap")]), 0.0);
    // Sync log: both users' logs hold the 3 messages; ann's phone never
    // ACKed (3 behind), ben ACKed everything.
    assert_eq!(after.value("tidemark_sync_log_head_max", &[]), 3.0);
    assert_eq!(after.value("tidemark_sync_log_cursor_lag_events_max", &[]), 3.0);
    assert_eq!(after.value("tidemark_sync_log_devices_below_trim", &[]), 0.0);
    assert_eq!(after.value("tidemark_outbox_backlog", &[]), 0.0);
    // Pages: every page timed and sized; their events add up to what ben
    // applied (the first page holds them all, the limit being 10).
    let pages = after.value("tidemark_sync_pages_total", &[]);
    assert_eq!(after.value("tidemark_sync_page_events", &[]), pages);
    assert_eq!(after.sum("tidemark_sync_page_events", &[]), 3.0);
    assert!(after.value("tidemark_sync_page_latency_seconds", &[]) >= pages);
    ts.stop().await;
}

/// An idle server commits nothing: the relay's poll of an empty outbox is
/// not a commit (it writes no WAL frame and costs no fsync).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_server_counts_no_commits() {
    let config =
        tidemark_server::ServerConfig { relay_poll: std::time::Duration::from_millis(10), ..Default::default() };
    let ts = TestServer::start_with(config).await;
    let before = ts.running().state.store.stats();
    // Let the relay poll the empty outbox many times: wait until the writer
    // has run at least 20 of its (empty) transactions.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while ts.running().state.store.stats().statements < before.statements + 40 {
        assert!(tokio::time::Instant::now() < deadline, "the relay never polled");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(ts.running().state.store.stats().commits, before.commits, "empty polls counted as commits");
    ts.stop().await;
}

/// Issue 16/19: `/metrics` reads the store's gauges (a scan of every user
/// head and device) at most once per `gauges_every`: a scrape inside the
/// period serves the last read, one after it reads again. (With the
/// embedded default of zero, the test above sees each scrape's traffic.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_gauges_are_read_at_most_once_per_period() {
    let ts = TestServer::start_with(ServerConfig {
        gauges_every: std::time::Duration::from_secs(3600),
        ..ServerConfig::default()
    })
    .await;
    ts.user("ann").await;
    ts.user("ben").await;
    let first = scrape(&ts).await;
    assert_eq!(first.value("tidemark_sync_log_head_max", &[]), 0.0);
    let ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    ann.send(&conv, "m1").await;
    let store = ts.running().state.store.clone();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while store.user_high_watermark("ben").await.unwrap() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never fanned out");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let cached = scrape(&ts).await;
    assert_eq!(cached.value("tidemark_sync_log_head_max", &[]), 0.0, "inside the period: the last read");
    assert!(cached.value("tidemark_sends_accepted_total", &[]) >= 1.0, "counters are not sampled");
    // The period over (the cache says when it read), the next scrape reads.
    *ts.running().state.gauges.lock().await = None;
    let fresh = scrape(&ts).await;
    assert_eq!(fresh.value("tidemark_sync_log_head_max", &[]), 1.0);
    ts.stop().await;
}
