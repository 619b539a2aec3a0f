//! Crash safety of K1 with the fault hook: the client is killed (its engine
//! stops dead, its socket dropped, its open transaction rolled back) at a
//! point of the sync, then started again on the same local database.
//!
//! - killed before the local commit: no ACK was sent, and the same batch is
//!   fetched again and applied;
//! - killed between the commit and the ACK: the same batch comes again, is
//!   applied idempotently (skipped, nothing doubled), and is ACKed.

mod common;

use std::collections::HashSet;

use common::*;
use tidemark_client::{Change, Client, Exit, FaultPoint, SyncPosition};

/// Bob's phone syncs once (so it has local state: a generation), goes
/// offline, and Alice sends three messages to Bob; returns the conversation
/// once Bob's log holds all three.
async fn three_messages(h: &Harness) -> String {
    h.user("alice").await;
    h.user("bob").await;
    let phone = h.ready("bob", "phone").await;
    assert_eq!(phone.position().await.unwrap().generation, Some(1));
    phone.stop().await;
    drop(phone);
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    for text in ["one", "two", "three"] {
        send_ok(&alice, &conv, text).await;
    }
    h.wait_log("bob", 3).await;
    alice.stop().await;
    conv
}

/// Starts a client on Bob's phone whose hook kills it at the first `when`;
/// returns how it ended.
async fn crash_at(h: &Harness, when: impl Fn(&FaultPoint) -> bool + Send + Sync + 'static) -> Exit {
    let mut config = h.config("bob", "phone");
    config.fault = Some(abort_once(when));
    let client = Client::open(config).unwrap();
    client.start().await.unwrap();
    let exit = tokio::time::timeout(WAIT, client.closed()).await.expect("the hook fired");
    drop(client);
    exit
}

/// Restarts Bob's phone without a fault; returns it and the changes it
/// emitted until it held the three messages and the server had its ACK.
async fn restart_and_catch_up(h: &Harness, conv: &str) -> (Client, Vec<Change>) {
    let client = Client::open(h.config("bob", "phone")).unwrap();
    let mut changes = client.subscribe();
    client.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::Acked { acked_sync_seq: 3, .. })).await;
    wait_messages(&client, conv, 3).await;
    assert_eq!(h.server_ack("bob", "phone").await, (1, 3));
    (client, seen)
}

/// `(resume_from, first_sync_seq, last_sync_seq, applied, skipped)` of a page.
type PageSummary = (u64, Option<u64>, Option<u64>, usize, usize);

fn pages(changes: &[Change]) -> Vec<PageSummary> {
    changes
        .iter()
        .filter_map(|c| match c {
            Change::PageApplied(p) => Some((p.resume_from, p.first_sync_seq, p.last_sync_seq, p.applied, p.skipped)),
            _ => None,
        })
        .collect()
}

fn acks(changes: &[Change]) -> Vec<u64> {
    changes.iter().filter_map(|c| if let Change::Acked { sync_seq, .. } = c { Some(*sync_seq) } else { None }).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_commit_no_ack_is_sent_and_the_batch_is_fetched_again() {
    let h = Harness::start().await;
    let conv = three_messages(&h).await;

    let exit = crash_at(&h, |p| matches!(p, FaultPoint::BeforeCommit { .. })).await;
    assert_eq!(exit, Exit::Aborted(FaultPoint::BeforeCommit { first_sync_seq: 1, last_sync_seq: 3 }));
    // Nothing was committed locally, and the server saw no ACK.
    let local = Client::open(h.config("bob", "phone")).unwrap();
    assert_eq!(local.position().await.unwrap(), SyncPosition { generation: Some(1), ..SyncPosition::default() });
    assert!(local.messages(&conv).await.unwrap().is_empty());
    drop(local);
    assert_eq!(h.server_ack("bob", "phone").await, (1, 0), "an ACK left before the commit");

    // The same batch (from sync_seq 1) is fetched again, applied, ACKed.
    let (client, changes) = restart_and_catch_up(&h, &conv).await;
    assert_eq!(pages(&changes), vec![(0, Some(1), Some(3), 3, 0)]);
    assert_eq!(acks(&changes), vec![3]);
    let texts: Vec<String> = view(&client.messages(&conv).await.unwrap()).into_iter().map(|v| v.3).collect();
    assert_eq!(texts, ["one", "two", "three"]);
    assert_eq!(client.position().await.unwrap().applied_sync_seq, 3);
    client.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_commit_and_ack_the_batch_reapplies_idempotently_and_is_acked() {
    let h = Harness::start().await;
    let conv = three_messages(&h).await;

    let exit = crash_at(&h, |p| matches!(p, FaultPoint::AfterCommit { .. })).await;
    assert_eq!(exit, Exit::Aborted(FaultPoint::AfterCommit { applied_sync_seq: 3 }));
    // Committed locally, never ACKed: the ACK is what the crash lost.
    let local = Client::open(h.config("bob", "phone")).unwrap();
    let pos = local.position().await.unwrap();
    assert_eq!((pos.generation, pos.applied_sync_seq, pos.acked_sync_seq), (Some(1), 3, 0));
    assert_eq!(local.messages(&conv).await.unwrap().len(), 3);
    drop(local);
    assert_eq!(h.server_ack("bob", "phone").await, (1, 0));

    // The server replays from its ACK (0); the client skips what it holds
    // and ACKs the batch.
    let (client, changes) = restart_and_catch_up(&h, &conv).await;
    assert_eq!(pages(&changes), vec![(0, None, None, 0, 3)], "the replayed batch is skipped, not re-applied");
    assert_eq!(acks(&changes), vec![3]);
    let msgs = client.messages(&conv).await.unwrap();
    assert_eq!(msgs.len(), 3);
    let ids: HashSet<&str> = msgs.iter().map(|m| m.message_id.as_str()).collect();
    assert_eq!(ids.len(), 3, "no message stored twice");
    let pos = client.position().await.unwrap();
    assert_eq!((pos.applied_sync_seq, pos.acked_sync_seq), (3, 3));
    client.stop().await;
}

/// An `ack.ok` lost after the server committed the ACK: the next batch
/// resumes at the server's ACK with nothing to ACK again, and the device
/// still learns the server's ACK (from `sync.ok.server_acked_sync_seq`)
/// instead of keeping a local ACK behind it for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_whose_reply_was_lost_is_learned_from_the_next_sync() {
    let h = Harness::start().await;
    let conv = three_messages(&h).await;
    let exit = crash_at(&h, |p| matches!(p, FaultPoint::AfterCommit { .. })).await;
    assert_eq!(exit, Exit::Aborted(FaultPoint::AfterCommit { applied_sync_seq: 3 }));
    // The ACK reaches the server, its reply never reaches the client: the
    // same device ACKs over HTTP while the client is down.
    let login = h.http.login("bob", PASSWORD, "phone").await.unwrap();
    let req = serde_json::json!({ "sync_generation": 1, "local_applied_sync_seq": 3 });
    let page: tidemark_client::proto::SyncOk = h.http.rpc(&login.access_token, "sync", &req).await.unwrap();
    let ack = serde_json::json!({ "batch_token": page.batch_token, "sync_seq": 3 });
    let _: serde_json::Value = h.http.rpc(&login.access_token, "ack", &ack).await.unwrap();
    assert_eq!(h.server_ack("bob", "phone").await, (1, 3));

    let client = Client::open(h.config("bob", "phone")).unwrap();
    assert_eq!(client.position().await.unwrap().acked_sync_seq, 0, "the client never saw the ack.ok");
    let mut changes = client.subscribe();
    client.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::Acked { acked_sync_seq: 3, .. })).await;
    assert_eq!(acks(&seen), vec![3]);
    let pos = client.position().await.unwrap();
    assert_eq!((pos.generation, pos.applied_sync_seq, pos.acked_sync_seq), (Some(1), 3, 3));
    assert_eq!(client.messages(&conv).await.unwrap().len(), 3);
    client.stop().await;
}
