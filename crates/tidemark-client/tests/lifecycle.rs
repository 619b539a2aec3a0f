//! The client's defined actions for the contract's refusals and kicks
//! (docs/protocol.md §4.2, §5, §7), against a real server: token expiry →
//! refresh and reconnect; revocation → stop and wipe; a restored backup →
//! a recovery batch (D6) or RESET_REQUIRED and a snapshot rebuild (D5, D7);
//! a new device after a trim → a snapshot (tests/snapshot.rs has the rest
//! of D7); a second instance →
//! superseded; and a gap in a conversation → the cursor waits, a sync fills
//! it (K2).

mod common;

use std::time::Duration;

use common::*;
use tidemark_client::proto::{DeviceRevokeOk, DeviceRevokeReq};
use tidemark_client::{Change, Client, ConnState, Exit};
use tidemark_server::ServerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_access_token_is_refreshed_and_the_client_reconnects() {
    let config = ServerConfig { access_token_ttl: Duration::from_secs(1), ..ServerConfig::default() };
    let h = Harness::start_with(config).await;
    h.user("alice").await;
    h.user("bob").await;
    let bob = h.ready("bob", "phone").await;
    let mut changes = bob.subscribe();
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    // Outlive the first token: the server kicks (token_expired), the client
    // refreshes (the refresh token rotates) and reconnects.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    send_ok(&alice, &conv, "after expiry").await;
    wait_messages(&bob, &conv, 1).await;
    let seen = drain(&mut changes);
    assert!(seen.contains(&Change::Kicked { reason: "token_expired".into() }), "{seen:?}");
    assert!(!seen.iter().any(|c| matches!(c, Change::Exited(_))), "the client kept running: {seen:?}");
    alice.stop().await;
    assert_eq!(bob.stop().await, Exit::Stopped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_device_stops_and_deletes_its_local_data() {
    let h = Harness::start().await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    send_ok(&alice, &conv, "hello").await;
    let phone = h.ready("bob", "phone").await;
    wait_messages(&phone, &conv, 1).await;

    let laptop = h.http.login("bob", PASSWORD, "laptop").await.unwrap();
    let req = DeviceRevokeReq { device_id: "phone".into() };
    let ok: DeviceRevokeOk = h.http.rpc(&laptop.access_token, "device.revoke", &req).await.unwrap();
    assert!(ok.revoked);

    assert_eq!(tokio::time::timeout(WAIT, phone.closed()).await.unwrap(), Exit::Revoked);
    assert!(phone.conversations().await.unwrap().is_empty(), "local data deleted");
    assert_eq!(phone.position().await.unwrap().generation, None);
    // Started again, it cannot log in (DEVICE_REVOKED) and stops again.
    phone.start().await.unwrap();
    assert_eq!(tokio::time::timeout(WAIT, phone.closed()).await.unwrap(), Exit::Revoked);
    alice.stop().await;
}

/// Bob's phone applies and ACKs 4 events, then its store is restored to a
/// backup taken at 2 (local 2 < the server's ACK 4). Returns the phone,
/// opened on the restored store but not started, and the conversation.
async fn restored_backup(h: &Harness, sync_page_limit: u32) -> (Client, String) {
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    send_ok(&alice, &conv, "one").await;
    send_ok(&alice, &conv, "two").await;
    h.wait_log("bob", 2).await;
    let phone = h.ready("bob", "phone").await;
    wait_messages(&phone, &conv, 2).await;
    h.wait_server_ack("bob", "phone", 2).await;
    phone.stop().await;
    drop(phone); // closes the database: the backup is one file
    let db = h.config("bob", "phone").db_path;
    let backup = h.dir.path().join("backup.db");
    std::fs::copy(&db, &backup).unwrap();

    send_ok(&alice, &conv, "three").await;
    send_ok(&alice, &conv, "four").await;
    h.wait_log("bob", 4).await;
    let phone = h.ready("bob", "phone").await;
    wait_messages(&phone, &conv, 4).await;
    h.wait_server_ack("bob", "phone", 4).await;
    phone.stop().await;
    drop(phone);
    alice.stop().await;
    std::fs::copy(&backup, &db).unwrap();
    for ext in ["db-wal", "db-shm"] {
        let _ = std::fs::remove_file(db.with_extension(ext));
    }
    let mut config = h.config("bob", "phone");
    config.sync_page_limit = sync_page_limit;
    let phone = Client::open(config).unwrap();
    assert_eq!(phone.position().await.unwrap().applied_sync_seq, 2);
    (phone, conv)
}

/// D6 (docs/protocol.md §3.2 "Recovery sessions", §3.3): a device a little
/// behind its ACK gets a batch from its own position under a bumped
/// generation. The client adopts the generation (nothing is skipped) and
/// applies 3 and 4, one page each. The intermediate ACK of 3 changes
/// nothing and its reply carries the old, higher ACK 4; the final ACK of
/// exactly the watermark, with the batch's token, completes the recovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_backup_a_little_behind_recovers_from_its_own_position() {
    let h = Harness::start().await;
    let (phone, conv) = restored_backup(&h, 1).await;
    let mut changes = phone.subscribe();
    phone.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::Acked { sync_seq: 4, .. })).await;
    let pages: Vec<_> = seen
        .iter()
        .filter_map(|c| match c {
            Change::PageApplied(p) => Some((p.sync_generation, p.resume_from, p.first_sync_seq, p.applied)),
            _ => None,
        })
        .collect();
    assert_eq!(pages, vec![(2, 2, Some(3), 1), (2, 2, Some(4), 1)], "one batch from the device's own position");
    let acks: Vec<_> = seen
        .iter()
        .filter_map(|c| match c {
            Change::Acked { sync_seq, acked_sync_seq, generation } => Some((*sync_seq, *acked_sync_seq, *generation)),
            _ => None,
        })
        .collect();
    assert_eq!(acks, vec![(3, 4, 2), (4, 4, 2)], "the intermediate ACK answers the old, higher ACK");
    assert!(!seen.iter().any(|c| matches!(c, Change::Reset { .. })), "no rebuild: {seen:?}");
    let msgs = wait_messages(&phone, &conv, 4).await;
    assert_eq!(msgs.iter().map(|m| m.msg_seq).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    let device = h.server().state.store.device("bob", "phone").await.unwrap().unwrap();
    assert_eq!(device.cursor.state.as_str(), "ACTIVE", "the final ACK completed the recovery");
    assert_eq!(h.server_ack("bob", "phone").await, (2, 4));
    assert_eq!(phone.position().await.unwrap().generation, Some(2));
    // Recovered: the next sync is an ordinary one under generation 2.
    phone.sync_now();
    phone.wait_state(ConnState::Ready, WAIT).await.unwrap();
    phone.stop().await;
}

/// D5 with recovery sessions off: the restored store is behind the server's
/// ACK, so the server bumps the generation and answers RESET_REQUIRED; the
/// client rebuilds from a snapshot (always, even while the log is whole).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_backup_is_reset_and_rebuilt_when_it_cannot_recover() {
    let h = Harness::start_with(ServerConfig { recovery_max_gap: 0, ..ServerConfig::default() }).await;
    let (phone, conv) = restored_backup(&h, 100).await;
    let mut changes = phone.subscribe();
    phone.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::Acked { acked_sync_seq: 4, .. })).await;
    assert!(seen.contains(&Change::Reset { generation: Some(2) }), "{seen:?}");
    let msgs = wait_messages(&phone, &conv, 4).await;
    assert_eq!(msgs.iter().map(|m| m.msg_seq).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    assert_eq!(h.server_ack("bob", "phone").await, (2, 4), "rebuilt under the new generation");
    assert_eq!(phone.position().await.unwrap().generation, Some(2));
    phone.stop().await;
}

/// D7: once the user's log is trimmed, a new device can only be built from
/// a snapshot: its first page gets RESET_REQUIRED, it installs one, then
/// syncs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_device_after_a_trim_installs_a_snapshot() {
    let mut config = ServerConfig { retention_every: Duration::from_millis(50), ..ServerConfig::default() };
    if let Some(policy) = config.retention.as_mut() {
        policy.keep_events_younger_than_ms = 0;
    }
    let h = Harness::start_with(config).await;
    h.user("alice").await;
    h.user("bob").await;
    let phone = h.ready("alice", "phone").await;
    let conv = phone.create_direct("bob").await.unwrap();
    send_ok(&phone, &conv, "one").await;
    h.wait_server_ack("alice", "phone", 1).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.server().state.store.user_log("alice").await.unwrap().trimmed_upto == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the log was never trimmed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tablet = Client::open(h.config("alice", "tablet")).unwrap();
    let mut changes = tablet.subscribe();
    tablet.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::SnapshotInstalled { .. })).await;
    assert!(seen.iter().any(|c| matches!(c, Change::Reset { .. })), "{seen:?}");
    tablet.wait_state(ConnState::Ready, WAIT).await.unwrap();
    assert_eq!(view(&tablet.messages(&conv).await.unwrap())[0].3, "one");
    send_ok(&phone, &conv, "two").await;
    let msgs = wait_messages(&tablet, &conv, 2).await;
    assert_eq!(msgs[1].content["text"], "two", "incremental sync after the install");
    assert!(msgs[1].sync_seq.is_some() && msgs[0].sync_seq.is_none(), "log vs snapshot");
    tablet.stop().await;
    phone.stop().await;
}

/// D7, issue 19: a new device of an account whose untrimmed log is longer
/// than `replay_max_events` gets RESET_REQUIRED and installs a snapshot
/// instead of replaying the log from 0; one that joins while the log is
/// short still replays it (the same server, the same account).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_device_of_a_big_account_installs_a_snapshot_instead_of_replaying() {
    let h = Harness::start_with(ServerConfig { replay_max_events: 5, ..ServerConfig::default() }).await;
    h.user("alice").await;
    h.user("bob").await;
    h.user("carol").await;
    let phone = h.ready("alice", "phone").await;
    let with_bob = phone.create_direct("bob").await.unwrap();
    let with_carol = phone.create_direct("carol").await.unwrap();
    send_ok(&phone, &with_bob, "b1").await;
    send_ok(&phone, &with_carol, "c1").await;
    h.wait_log("alice", 2).await;
    // A short log: replayed from 0, no reset.
    let laptop = Client::open(h.config("alice", "laptop")).unwrap();
    let mut laptop_changes = laptop.subscribe();
    laptop.start().await.unwrap();
    let seen = collect_until(&mut laptop_changes, |c| matches!(c, Change::Acked { acked_sync_seq: 2, .. })).await;
    assert!(!seen.iter().any(|c| matches!(c, Change::Reset { .. } | Change::SnapshotInstalled { .. })), "{seen:?}");
    assert_eq!(h.server().state.store.user_log("alice").await.unwrap().trimmed_upto, 0, "never trimmed");
    for i in 2..=4 {
        send_ok(&phone, &with_bob, &format!("b{i}")).await;
        send_ok(&phone, &with_carol, &format!("c{i}")).await;
    }
    h.wait_log("alice", 8).await;
    // Eight events, above the bound of five: a snapshot, on a whole log.
    let tablet = Client::open(h.config("alice", "tablet")).unwrap();
    let mut changes = tablet.subscribe();
    tablet.start().await.unwrap();
    let seen = collect_until(&mut changes, |c| matches!(c, Change::SnapshotInstalled { .. })).await;
    assert!(seen.iter().any(|c| matches!(c, Change::Reset { .. })), "{seen:?}");
    tablet.wait_state(ConnState::Ready, WAIT).await.unwrap();
    assert_eq!(h.server_ack("alice", "tablet").await, (2, 8), "installed at the base under a new generation");
    for conv in [&with_bob, &with_carol] {
        let msgs = tablet.messages(conv).await.unwrap();
        assert_eq!(msgs.len(), 4, "every message of {conv}");
        assert!(msgs.iter().all(|m| m.sync_seq.is_none()), "from the snapshot, not the log");
    }
    send_ok(&phone, &with_bob, "b5").await;
    let msgs = wait_messages(&tablet, &with_bob, 5).await;
    assert_eq!(msgs[4].content["text"], "b5", "incremental sync after the install");
    tablet.stop().await;
    laptop.stop().await;
    phone.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_of_the_device_supersedes_the_first_which_stays_down() {
    let h = Harness::start().await;
    h.user("bob").await;
    let first = h.ready("bob", "phone").await;
    let mut config = h.config("bob", "phone");
    config.db_path = h.dir.path().join("bob-phone-copy.db");
    let second = Client::open(config).unwrap();
    second.start().await.unwrap();
    assert_eq!(tokio::time::timeout(WAIT, first.closed()).await.unwrap(), Exit::Superseded);
    assert_eq!(first.state(), ConnState::Offline);
    second.wait_state(ConnState::Ready, WAIT).await.unwrap();
    second.stop().await;
}

/// K2 wired end to end: with fan-out held, Bob's own `send.ok` (msg_seq 2)
/// arrives while his log has not brought msg_seq 1. The message is kept
/// above the gap, the cursor stays at 0, and once fan-out resumes a sync
/// fills the gap and the cursor moves over both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_own_message_above_a_gap_waits_until_a_sync_fills_it() {
    let mut h = Harness::start_with(ServerConfig { hold_fanout: true, ..ServerConfig::default() }).await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let bob = h.ready("bob", "phone").await;
    let conv = alice.create_direct("bob").await.unwrap();
    send_ok(&alice, &conv, "one").await;
    let mut changes = bob.subscribe();
    assert_eq!(send_ok(&bob, &conv, "two").await, (2, false));

    let summary = bob.conversation(&conv).await.unwrap().unwrap();
    assert_eq!((summary.contiguous_msg_seq, summary.last_msg_seq), (0, 2), "the cursor does not jump the gap");
    assert!(summary.has_gap());
    let seen = drain(&mut changes);
    assert!(seen.iter().any(|c| matches!(c, Change::Gap(g) if g.missing_from == 1 && g.missing_to == 1)), "{seen:?}");

    // Fan-out resumes (the relay reloads the outbox at start); a hint or
    // the periodic check brings msg_seq 1 and the cursor moves over 1 and 2.
    h.restart_server(ServerConfig::default()).await;
    bob.wait_for(WAIT, || async { Ok(bob.conversation(&conv).await?.is_some_and(|c| c.contiguous_msg_seq == 2)) })
        .await
        .unwrap();
    let msgs = bob.messages(&conv).await.unwrap();
    assert_eq!(
        view(&msgs).into_iter().map(|v| (v.0, v.3)).collect::<Vec<_>>(),
        vec![(1, "one".into()), (2, "two".into())]
    );
    assert!(msgs.iter().all(|m| m.sync_seq.is_some()), "both now came through the log");
    let seen = drain(&mut changes);
    assert!(seen.iter().any(|c| matches!(c, Change::CursorMoved(m) if m.from == 0 && m.to == 2)), "{seen:?}");
    alice.stop().await;
    bob.stop().await;
}
