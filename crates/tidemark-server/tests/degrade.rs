//! The degradation order under load (seed §9.4, P3; `tidemark_core::degrade`):
//! while the node is behind, sends are accepted and syncs answered, typing
//! and presence are refused with `RATE_LIMITED` and `retry_after_ms`, and
//! the retention pass waits; once the relay catches up everything runs
//! again. The level comes from the relay's own claims: a backlog older than
//! the bound, left by a node that did not fan out, makes its successor
//! overloaded while it claims full batches, and normal once drained.

mod common;

use std::time::Duration;

use common::exposition::{scrape, scrape_url};
use common::*;
use serde_json::json;
use tidemark_client::proto::ErrorCode;
use tidemark_core::degrade::{Load, LoadBounds};
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

#[tokio::test]
async fn behind_the_node_keeps_facts_and_pulls_and_sheds_typing_and_derived_work() {
    let config = ServerConfig {
        // The relay holds: nothing resets the level the test sets.
        hold_fanout: true,
        retention_every: Duration::from_millis(20),
        ..ServerConfig::default()
    };
    let ts = TestServer::start_with(config).await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let mut ann = ts.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let state = &ts.running().state;

    assert_eq!(state.load.observe(Some(u64::MAX), true), Load::Overloaded);
    // Facts and pulls run.
    let sent = ann.send(&conv, "under-load").await;
    assert!(sent.msg_seq >= 1);
    ann.sync_page(50).await.expect("a sync is answered while overloaded");
    // Typing and presence are the first shed, with a wait to obey.
    for (op, body) in [("typing", json!({"conv": conv, "typing": true})), ("presence.set", json!({"state": "idle"}))] {
        let refused = ann.ws.request_value(op, body).await.unwrap();
        assert_eq!(refused["t"], "error", "{op}: {refused}");
        assert_eq!(refused["code"], ErrorCode::RateLimited.as_str(), "{op}");
        assert_eq!(refused["retry_after_ms"], tidemark_server::degrade::SHED_RETRY_AFTER_MS, "{op}");
    }
    // The retention pass (every 20 ms) waits: bounded polling until a
    // skipped round is counted.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let e = scrape(&ts).await;
        assert_eq!(e.value("tidemark_load_level", &[]), 2.0);
        if e.value("tidemark_degraded_total", &[("work", "derived")]) >= 1.0 {
            assert!(e.value("tidemark_degraded_total", &[("work", "ephemeral")]) >= 2.0, "{}", e.text);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no retention round was held back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Caught up: everything runs again.
    assert_eq!(state.load.observe(None, false), Load::Normal);
    let ok = ann.ws.request_value("typing", json!({"conv": conv, "typing": true})).await.unwrap();
    assert_eq!(ok["t"], "typing.ok", "{ok}");
    assert_eq!(scrape(&ts).await.value("tidemark_load_level", &[]), 0.0);
    ts.stop().await;
}

#[tokio::test]
async fn a_backlog_older_than_the_bound_overloads_the_relay_until_it_is_drained() {
    // A node that accepted but never fanned out leaves a backlog.
    let held = TestServer::start_with(ServerConfig { hold_fanout: true, ..ServerConfig::default() }).await;
    for u in ["ann", "ben"] {
        held.user(u).await;
    }
    let ann = held.device("ann", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for i in 0..20 {
        ann.send(&conv, &format!("m{i}")).await;
    }
    drop(ann);
    let mut held = held;
    let dir = std::mem::replace(&mut held.dir, tempfile::tempdir().unwrap());
    held.stop().await;
    // Its successor counts 50 ms of lag as overloaded; the backlog is older
    // (bounded polling on the clock, not a sleep that hopes).
    let bound_ms = 50;
    let oldest = std::time::SystemTime::now();
    while oldest.elapsed().unwrap() < Duration::from_millis(bound_ms + 10) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let store = SqliteStore::open(dir.path()).unwrap();
    let config = ServerConfig {
        load_bounds: LoadBounds { behind_ms: bound_ms, overloaded_ms: bound_ms },
        // Claims of 5 of the 20: full ones, so the backlog is seen.
        relay_batch_max: 5,
        ..ServerConfig::default()
    };
    let next = Server::start("127.0.0.1:0", store.clone(), config).await.unwrap();
    // Bounded polling until the relay drained the backlog.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let hw = store.user_high_watermark("ben").await.unwrap();
        let events = store.read_user_events("ben", 0, hw, 1000).await.unwrap();
        if events.iter().filter(|e| e.message.is_some()).count() >= 20 && next.state.load.load() == Load::Normal {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the backlog was not drained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e = scrape_url(&next.url()).await;
    assert!(e.value("tidemark_load_level_changes_total", &[("level", "overloaded")]) >= 1.0, "{}", e.text);
    assert!(e.value("tidemark_load_level_changes_total", &[("level", "normal")]) >= 1.0, "{}", e.text);
    next.stop().await;
}
