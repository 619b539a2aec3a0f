//! D7 in the SDK, against a real server: a device offline past the
//! retention window gets RESET_REQUIRED and rebuilds from a snapshot
//! (begin, every page, digest, one local transaction, then `snapshot.ack`),
//! reporting progress, then syncs on from the base; crashes at every step
//! of the install and a corrupt transfer leave the old state and the server
//! cursor as they were, and a retry finishes the job.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tidemark_client::{Change, Client, ConnState, Exit, FaultAction, FaultPoint, SyncPosition};
use tidemark_server::ServerConfig;

/// Retention with no keep window and a 200 ms inactivity window, run by hand
/// (`trim`); snapshots of 3 items per page carrying the latest 5 events of a
/// conversation.
fn config() -> ServerConfig {
    let mut c = ServerConfig {
        retention_every: Duration::from_secs(3600),
        snapshot_page_items: 3,
        snapshot_messages_per_conv: 5,
        ..ServerConfig::default()
    };
    let policy = c.retention.as_mut().expect("retention on by default");
    policy.keep_events_younger_than_ms = 0;
    policy.device_inactive_after_ms = 200;
    c
}

async fn trim(h: &Harness, user: &str) -> u64 {
    let state = &h.server().state;
    let policy = state.config.retention.expect("retention configured");
    state.store.trim_user_logs(policy, tidemark_server::util::now_ms() + 1).await.unwrap();
    state.store.user_log(user).await.unwrap().trimmed_upto
}

struct Offline {
    alice: Client,
    laptop: Client,
    conv: String,
    /// The phone's local position when it went offline.
    before: SyncPosition,
}

/// Bob's phone applies and ACKs 3 messages and goes offline (stopped and
/// closed). Alice sends 5 more, Bob reads up to 6 on his laptop, which
/// keeps up; the inactivity window passes and the log is trimmed past the
/// phone's ACK.
async fn offline_past_retention(h: &Harness) -> Offline {
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    for i in 1..=3 {
        send_ok(&alice, &conv, &format!("m{i}")).await;
    }
    let phone = h.ready("bob", "phone").await;
    wait_messages(&phone, &conv, 3).await;
    h.wait_server_ack("bob", "phone", 3).await;
    let before = phone.position().await.unwrap();
    phone.stop().await;
    drop(phone);
    let laptop = h.ready("bob", "laptop").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 4..=8 {
        send_ok(&alice, &conv, &format!("m{i}")).await;
    }
    laptop.mark_read(&conv, 6).await.unwrap();
    h.wait_log("bob", 9).await;
    h.wait_server_ack("bob", "laptop", 9).await;
    assert_eq!(trim(h, "bob").await, 9, "the inactive phone no longer holds the fence");
    Offline { alice, laptop, conv, before }
}

/// What a device shows: the summary and the messages above `history_to`.
async fn shown(c: &Client, conv: &str, history_to: u64) -> (u64, u64, u64, bool, Vec<(u64, String, String, String)>) {
    let s = c.conversation(conv).await.unwrap().expect("conversation held");
    let msgs: Vec<_> = c.messages(conv).await.unwrap().into_iter().filter(|m| m.msg_seq > history_to).collect();
    (s.last_msg_seq, s.read_seq, s.unread, s.muted, view(&msgs))
}

async fn wait_same(phone: &Client, laptop: &Client, conv: &str, history_to: u64) {
    let target = shown(laptop, conv, history_to).await;
    phone
        .wait_for(WAIT, || async { Ok(shown(phone, conv, history_to).await == target) })
        .await
        .unwrap_or_else(|e| panic!("never converged with {target:?}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_offline_past_retention_installs_a_snapshot_then_syncs_on() {
    let h = Harness::start_with(config()).await;
    let o = offline_past_retention(&h).await;
    let phone = Client::open(h.config("bob", "phone")).unwrap();
    // Queued offline: the outbox survives the rebuild.
    let queued = phone.send(&o.conv, serde_json::json!({"text": "from the phone"})).await.unwrap();
    let mut changes = phone.subscribe();
    phone.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::SnapshotInstalled { .. })).await;
    assert!(seen.iter().any(|c| matches!(c, Change::Reset { generation: Some(2) })), "{seen:?}");
    let started: Vec<_> = seen
        .iter()
        .filter_map(|c| match c {
            Change::SnapshotStarted { generation, base_sync_seq, pages, resumed } => {
                Some((*generation, *base_sync_seq, *pages, *resumed))
            }
            _ => None,
        })
        .collect();
    let (generation, base, pages, _) = started[0];
    assert_eq!((generation, pages), (2, 2), "1 conversation + 5 events in pages of 3");
    assert!(base >= 9);
    let progress: Vec<_> = seen
        .iter()
        .filter_map(|c| match c {
            Change::SnapshotPage { fetched, pages, .. } => Some((*fetched, *pages)),
            _ => None,
        })
        .collect();
    assert_eq!(progress, vec![(1, 2), (2, 2)], "progress for every page");
    let seen = collect_until(&mut changes, |c| matches!(c, Change::Acked { .. })).await;
    assert!(
        matches!(seen.last(), Some(Change::Acked { sync_seq, generation: 2, .. }) if *sync_seq == base),
        "{seen:?}"
    );
    phone.wait_state(ConnState::Ready, WAIT).await.unwrap();

    // The cursor rule: the snapshot held the latest 5 events (4..=8, or
    // 5..=9 when the queued send was accepted before snapshot.begin); those
    // below are history, not a gap, and the cursor stands at the last one.
    let summary = phone.conversation(&o.conv).await.unwrap().unwrap();
    let seqs: Vec<u64> = phone.messages(&o.conv).await.unwrap().iter().map(|m| m.msg_seq).collect();
    let history_to = summary.history_to;
    assert!(history_to >= 3, "the old rows 1..=3 were replaced: {seqs:?}");
    assert_eq!(seqs.first(), Some(&(history_to + 1)), "{seqs:?}");
    assert!(!summary.has_gap());
    assert!(summary.contiguous_msg_seq >= 8);

    // The queued send went out; then later traffic arrives by sync.
    phone
        .wait_for(WAIT, || async {
            Ok(phone.outbox_entry(&queued.client_msg_id).await?.is_some_and(|e| e.msg_seq.is_some()))
        })
        .await
        .unwrap();
    send_ok(&o.alice, &o.conv, "after").await;
    wait_messages(&o.laptop, &o.conv, 10).await;
    wait_same(&phone, &o.laptop, &o.conv, history_to).await;
    let summary = phone.conversation(&o.conv).await.unwrap().unwrap();
    assert_eq!((summary.contiguous_msg_seq, summary.last_msg_seq, summary.history_to), (10, 10, history_to));
    // Incremental sync ACKs past the base, under the snapshot's generation.
    h.wait_server_ack("bob", "phone", base + 1).await;
    assert_eq!(h.server_ack("bob", "phone").await.0, 2);
    o.alice.stop().await;
    o.laptop.stop().await;
    phone.stop().await;
}

/// Kills the phone at the first point `at` matches, checks what the crash
/// left, then restarts it without a hook and checks it converges.
async fn crash_and_retry(at: fn(&FaultPoint) -> bool, committed: bool) {
    let h = Harness::start_with(config()).await;
    let o = offline_past_retention(&h).await;
    let old = h.server_ack("bob", "phone").await;
    let mut cfg = h.config("bob", "phone");
    cfg.fault = Some(abort_once(at));
    let phone = Client::open(cfg).unwrap();
    phone.start().await.unwrap();
    let exit = tokio::time::timeout(WAIT, phone.closed()).await.unwrap();
    assert!(matches!(exit, Exit::Aborted(ref p) if at(p)), "{exit:?}");
    drop(phone);

    let phone = Client::open(h.config("bob", "phone")).unwrap();
    let (generation, acked) = h.server_ack("bob", "phone").await;
    assert_eq!(acked, old.1, "the server cursor did not move");
    assert_eq!(generation, old.0 + 1, "only the reset's bump");
    let position = phone.position().await.unwrap();
    if committed {
        assert_eq!(position.generation, Some(2), "the install committed");
        assert!(position.applied_sync_seq >= 9);
        assert_eq!(phone.conversation(&o.conv).await.unwrap().unwrap().history_to, 3);
    } else {
        assert_eq!(position, o.before, "the old local state is intact");
        let texts: Vec<String> = view(&phone.messages(&o.conv).await.unwrap()).into_iter().map(|v| v.3).collect();
        assert_eq!(texts, vec!["m1", "m2", "m3"]);
    }

    let mut changes = phone.subscribe();
    phone.start().await.unwrap();
    phone.wait_state(ConnState::Ready, WAIT).await.unwrap();
    let seen = drain(&mut changes);
    let resumed = seen.iter().find_map(|c| match c {
        Change::SnapshotStarted { resumed, .. } => Some(*resumed),
        _ => None,
    });
    if committed {
        assert_eq!(resumed, None, "nothing to fetch again, only the ack: {seen:?}");
        assert!(seen.iter().any(|c| matches!(c, Change::Acked { generation: 2, .. })), "{seen:?}");
    } else {
        assert!(resumed.is_some(), "{seen:?}");
    }
    let (generation, acked) = h.server_ack("bob", "phone").await;
    assert_eq!(generation, 2);
    assert!(acked >= 9);
    send_ok(&o.alice, &o.conv, "after").await;
    wait_messages(&o.laptop, &o.conv, 9).await;
    wait_same(&phone, &o.laptop, &o.conv, 3).await;
    o.alice.stop().await;
    o.laptop.stop().await;
    phone.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_snapshot_begin_the_retry_installs() {
    crash_and_retry(|p| matches!(p, FaultPoint::SnapshotBegun { .. }), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_first_page_the_retry_installs() {
    crash_and_retry(|p| matches!(p, FaultPoint::SnapshotPageFetched { page: 0, .. }), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_local_commit_the_old_state_stays_and_the_retry_installs() {
    crash_and_retry(|p| matches!(p, FaultPoint::SnapshotBeforeCommit { .. }), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_local_commit_the_retry_acks_first() {
    crash_and_retry(|p| matches!(p, FaultPoint::SnapshotAfterCommit { .. }), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_transfer_installs_nothing_until_a_clean_one() {
    let h = Harness::start_with(config()).await;
    let o = offline_past_retention(&h).await;
    let old = h.server_ack("bob", "phone").await;
    let corrupt = Arc::new(AtomicBool::new(true));
    let mut cfg = h.config("bob", "phone");
    let c = corrupt.clone();
    cfg.fault = Some(Arc::new(move |p: &FaultPoint| match p {
        FaultPoint::SnapshotPageFetched { page: 1, .. } if c.load(Ordering::SeqCst) => FaultAction::Corrupt,
        _ => FaultAction::Continue,
    }));
    let phone = Client::open(cfg).unwrap();
    let mut changes = phone.subscribe();
    phone.start().await.unwrap();
    // The same snapshot is fetched again once, then a new one is begun.
    for _ in 0..3 {
        collect_until(
            &mut changes,
            |c| matches!(c, Change::SnapshotFailed { reason, .. } if reason.contains("digest")),
        )
        .await;
    }
    assert_eq!(phone.position().await.unwrap(), o.before, "nothing installed");
    let texts: Vec<String> = view(&phone.messages(&o.conv).await.unwrap()).into_iter().map(|v| v.3).collect();
    assert_eq!(texts, vec!["m1", "m2", "m3"]);
    let now = h.server_ack("bob", "phone").await;
    assert_eq!((now.0, now.1), (old.0 + 1, old.1), "nothing acked");
    corrupt.store(false, Ordering::SeqCst);
    collect_until(&mut changes, |c| matches!(c, Change::SnapshotInstalled { .. })).await;
    phone.wait_state(ConnState::Ready, WAIT).await.unwrap();
    wait_same(&phone, &o.laptop, &o.conv, 3).await;
    assert_eq!(h.server_ack("bob", "phone").await.0, 2);
    o.alice.stop().await;
    o.laptop.stop().await;
    phone.stop().await;
}
