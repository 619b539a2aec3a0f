//! K5 against a real server: one conversation whose event cannot be
//! applied goes into the local repair queue in the page's own transaction,
//! the rest of the account is stored and ACKed, the repair is retried with
//! backoff through `conv.sync` until it succeeds, and at the end nothing is
//! missing and nothing is twice. The device reports what it detected and
//! repaired with `client.stats`, and the server's `gap` metrics show it.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use common::*;
use tidemark_client::{Change, Client, ConnState, FaultAction, FaultPoint};
use tidemark_server::ServerConfig;

fn texts(msgs: &[tidemark_client::Message]) -> Vec<(u64, String)> {
    msgs.iter().map(|m| (m.msg_seq, m.content["text"].as_str().unwrap_or_default().to_owned())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_that_cannot_be_applied_is_repaired_and_the_account_syncs_on() {
    let h = Harness::start().await;
    for u in ["alice", "bob", "carol"] {
        h.user(u).await;
    }
    let alice = h.ready("alice", "phone").await;
    let carol = h.ready("carol", "phone").await;
    let broken = alice.create_direct("bob").await.unwrap();
    let healthy = carol.create_direct("bob").await.unwrap();
    for i in 1..=3 {
        send_ok(&alice, &broken, &format!("a{i}")).await;
    }
    for i in 1..=2 {
        send_ok(&carol, &healthy, &format!("c{i}")).await;
    }
    h.wait_log("bob", 5).await;

    // Bob's phone: its store refuses alice's second message, and the first
    // two repair attempts fail as if the server could not serve it yet.
    let refuse = Arc::new(AtomicBool::new(true));
    let repair_attempts = Arc::new(AtomicU32::new(0));
    let mut config = h.config("bob", "phone");
    let (r, a, conv) = (refuse.clone(), repair_attempts.clone(), broken.clone());
    config.fault = Some(Arc::new(move |p: &FaultPoint| match p {
        FaultPoint::ApplyEvent { conv: c, msg_seq: 2 } if *c == conv && r.load(Ordering::SeqCst) => FaultAction::Fail,
        FaultPoint::BeforeRepair { conv: c } if *c == conv && a.fetch_add(1, Ordering::SeqCst) < 2 => FaultAction::Fail,
        _ => FaultAction::Continue,
    }));
    let phone = Client::open(config).unwrap();
    let mut changes = phone.subscribe();
    phone.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::RepairQueued { .. })).await;
    assert!(
        seen.iter().any(|c| matches!(c, Change::RepairQueued { conv, from_msg_seq: 2 } if *conv == broken)),
        "{seen:?}"
    );
    refuse.store(false, Ordering::SeqCst);

    // The rest of the account went on: carol's conversation is whole, and
    // the ACK passed the broken event, whose place the repair record holds.
    assert_eq!(texts(&wait_messages(&phone, &healthy, 2).await), vec![(1, "c1".into()), (2, "c2".into())]);
    h.wait_server_ack("bob", "phone", 5).await;

    // Attempts fail twice, each followed by a growing wait, then succeed.
    let seen = collect_until(&mut changes, |c| matches!(c, Change::Repaired { .. })).await;
    let failures: Vec<(u32, u64)> = seen
        .iter()
        .filter_map(|c| match c {
            Change::RepairFailed { attempts, retry_in_ms, .. } => Some((*attempts, *retry_in_ms)),
            _ => None,
        })
        .collect();
    assert_eq!(failures.iter().map(|f| f.0).collect::<Vec<_>>(), vec![1, 2], "{seen:?}");
    assert!(failures[1].1 > failures[0].1, "the wait grows: {failures:?}");
    assert_eq!(repair_attempts.load(Ordering::SeqCst), 3);

    let summary = phone.conversation(&broken).await.unwrap().unwrap();
    assert!(!summary.needs_repair);
    assert_eq!(summary.contiguous_msg_seq, 3);
    assert_eq!(
        texts(&phone.messages(&broken).await.unwrap()),
        vec![(1, "a1".into()), (2, "a2".into()), (3, "a3".into())],
        "nothing missing, nothing twice"
    );
    assert!(phone.conversations().await.unwrap().iter().all(|c| !c.needs_repair));
    // Later traffic flows as usual.
    send_ok(&alice, &broken, "a4").await;
    assert_eq!(wait_messages(&phone, &broken, 4).await.len(), 4);
    phone.wait_state(ConnState::Ready, WAIT).await.unwrap();
}

/// The same through a real local contradiction: a row planted at the next
/// `msg_seq` under another message id (a corrupt local store). The page is
/// not refused as a whole; the repair replaces the planted row with the
/// server's message, since the conversation log is the truth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_row_that_contradicts_the_server_is_repaired_from_the_conversation_log() {
    let h = Harness::start().await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    send_ok(&alice, &conv, "one").await;
    let phone = h.ready("bob", "phone").await;
    wait_messages(&phone, &conv, 1).await;
    phone.stop().await;
    drop(phone);
    {
        let db = rusqlite::Connection::open(h.config("bob", "phone").db_path).unwrap();
        db.execute(
            "INSERT INTO messages (conv, msg_seq, message_id, kind, state, sender, content, created_at)
             VALUES (?1, 2, 'planted', 'text', 'normal', 'mallory', '{\"text\":\"planted\"}', 0)",
            [&conv],
        )
        .unwrap();
    }
    send_ok(&alice, &conv, "two").await;
    send_ok(&alice, &conv, "three").await;
    const DETECTED: &str = "tidemark_sdk_gaps_detected_total";
    const REPAIRED: &str = "tidemark_sdk_gaps_repaired_total";
    const REPORTS: &str = "tidemark_sdk_repairs_pending_conversations_count";
    const TOOK: &str = "tidemark_sdk_gap_repair_seconds_count";
    let before = (h.metric(DETECTED, "").await, h.metric(REPAIRED, "").await, h.metric(REPORTS, "").await);
    let took_before = h.metric(TOOK, r#"kind="repair""#).await;
    let phone = Client::open(h.config("bob", "phone")).unwrap();
    let mut changes = phone.subscribe();
    phone.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::Repaired { .. })).await;
    assert!(seen.iter().any(|c| matches!(c, Change::RepairQueued { from_msg_seq: 2, .. })), "{seen:?}");
    // The device told the server: one gap detected, one repaired (the
    // server cannot see either), in a report of its own.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = (h.metric(DETECTED, "").await, h.metric(REPAIRED, "").await, h.metric(REPORTS, "").await);
        if now.0 >= before.0 + 1.0 && now.1 >= before.1 + 1.0 && now.2 > before.2 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the gap metrics never moved: {before:?} -> {now:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // And how long the repair took: one sample of kind `repair`.
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.metric(TOOK, r#"kind="repair""#).await < took_before + 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "no repair duration was reported");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        texts(&phone.messages(&conv).await.unwrap()),
        vec![(1, "one".into()), (2, "two".into()), (3, "three".into())]
    );
    assert!(!phone.conversation(&conv).await.unwrap().unwrap().needs_repair);
    h.wait_server_ack("bob", "phone", 3).await;
}

/// O1 for a hole in a conversation's `msg_seq` (K2): with fan-out held,
/// Bob's own `send.ok`s (msg_seq 2, then 3) land above msg_seq 1, which his
/// log has not brought: one hole, opened by the first and only widened by
/// the second. Once fan-out resumes, a sync fills it. The device reports
/// one gap detected, one repaired, and one duration sample of kind `hole`
/// covering the time the hole was open; the server's /metrics show
/// exactly that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hole_in_a_conversation_is_one_gap_detected_and_repaired_with_its_duration() {
    const DETECTED: &str = "tidemark_sdk_gaps_detected_total";
    const REPAIRED: &str = "tidemark_sdk_gaps_repaired_total";
    const TOOK: &str = "tidemark_sdk_gap_repair_seconds_count";
    const TOOK_SUM: &str = "tidemark_sdk_gap_repair_seconds_sum";
    const HOLE: &str = r#"kind="hole""#;
    let mut h = Harness::start_with(ServerConfig { hold_fanout: true, ..ServerConfig::default() }).await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let bob = h.ready("bob", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    let before = (h.metric(DETECTED, "").await, h.metric(REPAIRED, "").await, h.metric(TOOK, HOLE).await);
    let sum_before = h.metric(TOOK_SUM, HOLE).await;
    send_ok(&alice, &conv, "one").await;
    assert_eq!(send_ok(&bob, &conv, "two").await, (2, false));
    assert_eq!(send_ok(&bob, &conv, "three").await, (3, false));
    let summary = bob.conversation(&conv).await.unwrap().unwrap();
    assert_eq!((summary.contiguous_msg_seq, summary.last_msg_seq), (0, 3), "a hole at msg_seq 1");

    // The open hole is reported as detected (the server cannot see it).
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.metric(DETECTED, "").await < before.0 + 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "the open hole was never reported");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(h.metric(REPAIRED, "").await, before.1, "not repaired yet");

    // Fan-out resumes; a sync brings msg_seq 1 and the cursor is whole.
    h.restart_server(ServerConfig::default()).await;
    bob.wait_for(WAIT, || async { Ok(bob.conversation(&conv).await?.is_some_and(|c| c.contiguous_msg_seq == 3)) })
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = (h.metric(DETECTED, "").await, h.metric(REPAIRED, "").await, h.metric(TOOK, HOLE).await);
        if now.1 >= before.1 + 1.0 && now.2 >= before.2 + 1.0 {
            // One hole: widened by the second send, still one gap.
            assert_eq!(now, (before.0 + 1.0, before.1 + 1.0, before.2 + 1.0), "from {before:?}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the repaired hole was never reported: {before:?} -> {now:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // It was open across a server restart: its duration is not zero.
    assert!(h.metric(TOOK_SUM, HOLE).await > sum_before, "the sample records the time the hole was open");
    bob.stop().await;
    alice.stop().await;
}
