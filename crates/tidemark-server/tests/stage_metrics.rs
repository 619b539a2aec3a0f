//! O1 stage metrics read after known traffic: the online devices' lag
//! and the recovery sessions' age (seed §18.1 "device sync"), in their own
//! test binary so that their traffic never shares the process-global
//! recorder with `metrics.rs`' exact counts, whatever the test runner.

mod common;

use common::exposition::{scrape, wait_for};
use common::*;

/// O1, seed §18.1 "device sync": a connected device that stops ACKing
/// shows in the online lag gauges with exactly its lag in events and a
/// lag in seconds that grows with the wall clock; its ACK ends it. A
/// recovery session shows with its age while it is open, and is gone once
/// its final ACK lands. An ACK above its batch's watermark is counted as a
/// caught invariant violation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_stops_acking_shows_its_lag_and_a_recovery_session_its_age() {
    let ts = TestServer::start().await;
    ts.user("ann").await;
    ts.user("ben").await;
    let mut ann = ts.device("ann", "phone").await;
    let mut ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    ann.send(&conv, "m1").await;
    ann.send(&conv, "m2").await;
    ben.sync_until(2, 10).await;
    ann.sync_until(2, 10).await;
    let fresh = scrape(&ts).await;
    assert_eq!(fresh.value("tidemark_online_devices_lagging", &[]), 0.0, "both caught up");

    // ben stops ACKing; ann sends 3 more and keeps up herself.
    let stopped = std::time::Instant::now();
    for cmid in ["m3", "m4", "m5"] {
        ann.send(&conv, cmid).await;
    }
    ann.sync_until(5, 10).await;
    let lagging = wait_for(&ts, |e| {
        e.value("tidemark_online_device_lag_events_max", &[]) == 3.0
            && e.value("tidemark_online_device_lag_seconds_max", &[]) >= 0.2
    })
    .await;
    assert_eq!(lagging.value("tidemark_online_devices_lagging", &[]), 1.0, "only ben");
    let seconds = lagging.value("tidemark_online_device_lag_seconds_max", &[]);
    assert!(seconds <= stopped.elapsed().as_secs_f64(), "{seconds} s: longer than ben has been behind");
    assert_eq!(lagging.value("tidemark_sync_log_cursor_lag_events_max", &[]), 3.0, "the store's cursor agrees");
    // ben ACKs: no lag left.
    ben.sync_until(5, 10).await;
    let caught_up = scrape(&ts).await;
    assert_eq!(caught_up.value("tidemark_online_device_lag_events_max", &[]), 0.0);
    assert_eq!(caught_up.value("tidemark_online_device_lag_seconds_max", &[]), 0.0);
    assert_eq!(caught_up.value("tidemark_online_devices_lagging", &[]), 0.0);
    assert_eq!(caught_up.value("tidemark_recovery_sessions", &[("kind", "replay")]), 0.0);

    // ben's phone restores a backup holding 2 events: a recovery session
    // replays (2, 5].
    ben.log.truncate(2);
    ben.applied = 2;
    let opened = std::time::Instant::now();
    let first = ben.sync_page(10).await.unwrap();
    assert_eq!((first.resume_from, first.batch_high_watermark), (2, 5));
    let open =
        wait_for(&ts, |e| e.value("tidemark_recovery_session_oldest_age_seconds", &[("kind", "replay")]) >= 0.2).await;
    assert_eq!(open.value("tidemark_recovery_sessions", &[("kind", "replay")]), 1.0);
    let age = open.value("tidemark_recovery_session_oldest_age_seconds", &[("kind", "replay")]);
    assert!(age <= opened.elapsed().as_secs_f64(), "{age} s: older than the session");
    assert_eq!(open.value("tidemark_recovery_sessions", &[("kind", "snapshot")]), 0.0);
    assert_eq!(open.value("tidemark_generation_bumps_total", &[]), 1.0, "the session's new generation");

    // An ACK above the batch watermark is refused and counted.
    assert_eq!(code(ben.ws.ack(&first.batch_token, 9).await), tidemark_client::proto::ErrorCode::AckBeyondWatermark);
    for e in first.events.clone() {
        ben.apply(e);
    }
    ben.ws.ack(&first.batch_token, 5).await.unwrap();
    let done = scrape(&ts).await;
    assert_eq!(done.value("tidemark_recovery_sessions", &[("kind", "replay")]), 0.0, "completed by its final ACK");
    assert_eq!(done.value("tidemark_recovery_session_oldest_age_seconds", &[("kind", "replay")]), 0.0);
    assert_eq!(done.value("tidemark_acks_total", &[("result", "recovery_completed")]), 1.0);
    assert_eq!(done.value("tidemark_invariant_violations_total", &[("invariant", "ack_beyond_watermark")]), 1.0);
    assert_eq!(done.value("tidemark_invariant_violations_total", &[("invariant", "stale_generation")]), 0.0);
    assert!(done.value("tidemark_hints_sent_total", &[]) >= 1.0);
    ts.stop().await;
}
