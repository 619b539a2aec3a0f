//! The fused fan-out on the embedded store (issue 19): a message's accept
//! and its fan-out commit together, so its hint leaves after one commit
//! instead of two; a fused fan-out that fails rolls back alone, the sends
//! stay accepted and the relay delivers them.

mod common;

use std::time::Duration;

use common::exposition::scrape;
use common::*;

/// Messages each test sends.
const SENDS: u64 = 12;

/// How long a condition the relay brings about may take.
const RELAY_WITHIN: Duration = Duration::from_secs(20);

/// N sends one after another, the relay idle between them, cost N write
/// commits: each fan-out commits with its accept (two commits a message
/// before, the accept's and the relay's). The peer's log holds each message
/// as soon as its `send.ok` arrives, with nothing left in the outbox.
///
/// The first send's item is fanned out by the fused claim: the relay has
/// not been woken yet (its poll is an hour here). Each accepted send then
/// wakes the relay, whose claim may join the next send's batch and take
/// that item inside the same transaction, ahead of the fused claim (one
/// clean-clone CI run counted 11 items fused of 12): the same commit
/// either way, so the later items are counted by commits, not by path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sends_fan_out_commits_with_its_accept() {
    let ts = TestServer::start_with(tidemark_server::ServerConfig {
        relay_poll: Duration::from_secs(3600),
        ..Default::default()
    })
    .await;
    let (ann, _ben, conv) = ts.ann_and_ben().await;
    let store = ts.running().state.store.clone();
    let before = store.stats();
    let fused_before = scrape(&ts).await.value("tidemark_fanout_fused_items_total", &[]);
    for i in 0..SENDS {
        let ok = ann.send(&conv, &format!("m{i}")).await;
        assert_eq!(ok.msg_seq, i + 1);
        // Read at once: the send's answer followed the commit that fanned
        // it out.
        assert_eq!(store.user_high_watermark("ben").await.unwrap(), i + 1, "ben's log holds message {i}");
        assert_eq!(store.user_high_watermark("ann").await.unwrap(), i + 1, "ann's log holds message {i}");
        if i == 0 {
            let fused = scrape(&ts).await.value("tidemark_fanout_fused_items_total", &[]) - fused_before;
            assert_eq!(fused, 1.0, "the first send's item was fanned out by the fused claim");
        }
    }
    let after = store.stats();
    assert_eq!(after.commits - before.commits, SENDS, "one commit per message, its fan-out included");
    assert_eq!(store.outbox_stats().await.unwrap().backlog, 0);
    // Ben's log holds the messages in order.
    let events = store.read_user_events("ben", 0, SENDS, 100).await.unwrap();
    let seqs: Vec<Option<u64>> = events.iter().map(|e| e.msg_seq).collect();
    assert_eq!(seqs, (1..=SENDS).map(Some).collect::<Vec<_>>());
    ts.stop().await;
}

/// A fused fan-out that fails (here a trigger refusing every user event,
/// installed through a second connection to the database file) rolls back
/// alone: every send is accepted and stays in the outbox; once the fault is
/// gone the relay fans them out, in order, and the peer is hinted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fused_fan_out_leaves_the_sends_accepted_for_the_relay() {
    let ts = TestServer::start().await;
    let (ann, mut ben, conv) = ts.ann_and_ben().await;
    let store = ts.running().state.store.clone();
    let raw = rusqlite::Connection::open(ts.dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
    raw.busy_timeout(Duration::from_secs(5)).unwrap();
    raw.execute_batch(
        "CREATE TRIGGER refuse_user_events BEFORE INSERT ON user_events
         BEGIN SELECT RAISE(ABORT, 'injected fan-out fault'); END",
    )
    .unwrap();
    let failures_before = scrape(&ts).await.value("tidemark_fanout_fused_failures_total", &[]);
    for i in 0..SENDS {
        let ok = ann.send(&conv, &format!("m{i}")).await;
        assert_eq!(ok.msg_seq, i + 1, "accepted although its fan-out failed");
    }
    assert_eq!(store.outbox_stats().await.unwrap().backlog, SENDS, "every send waits in the outbox");
    assert_eq!(store.user_high_watermark("ben").await.unwrap(), 0, "nothing fanned out");
    let failures = scrape(&ts).await.value("tidemark_fanout_fused_failures_total", &[]) - failures_before;
    assert!(failures >= 1.0, "the fused fan-out failed and said so");
    raw.execute_batch("DROP TRIGGER refuse_user_events").unwrap();
    // The relay retries after its backoff and delivers everything.
    eventually("the relay fanned the sends out", RELAY_WITHIN, || async {
        store.outbox_stats().await.unwrap().backlog == 0 && store.user_high_watermark("ben").await.unwrap() == SENDS
    })
    .await;
    // Ben is hinted up to the last one (hints may come merged or apart).
    let mut hinted = 0;
    while hinted < SENDS {
        hinted = ben.next_hint(Duration::from_secs(10)).await.expect("ben is hinted");
    }
    ben.sync_until(SENDS as usize, 100).await;
    let seqs: Vec<u64> = ben.conv_messages(&conv).iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (1..=SENDS).collect::<Vec<_>>(), "in order, each once");
    ts.stop().await;
}
