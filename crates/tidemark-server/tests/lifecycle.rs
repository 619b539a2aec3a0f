//! Device recovery and reset (issue 5): generation fencing (D5), snapshots
//! (D7) and user-log retention (L1–L2), over real sockets and SQLite.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use tidemark_client::proto::ErrorCode;
use tidemark_server::ServerConfig;
use tidemark_store::RetentionPolicy;

async fn say(d: &Device, conv: &str, text: &str) {
    d.ws.request_value("send", json!({"conv": conv, "client_msg_id": text, "content": {"text": text}})).await.unwrap();
}

/// D5: a generation-5 batch token ACKed after the device moved to
/// generation 6 is refused, and the cursor does not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_generation_ack_is_refused_after_a_reset() {
    let ts = TestServer::start().await;
    let (ann, mut ben, conv) = ts.ann_and_ben().await;
    // Walk ben's phone to generation 5: each snapshot install is a reset.
    ben.sync_page(10).await.unwrap();
    for _ in 0..4 {
        ben.install_snapshot(false).await.unwrap();
    }
    assert_eq!(ben.generation, Some(5));
    for i in 0..3 {
        say(&ann, &conv, &format!("m{i}")).await;
    }
    ben.sync_until(3, 10).await;
    let old = ben.sync_page(10).await.unwrap();
    assert_eq!(old.sync_generation, 5);
    // The device resets again (say, a restore): generation 6.
    ben.install_snapshot(false).await.unwrap();
    assert_eq!(ben.generation, Some(6));
    let before = ts.running().state.store.device("ben", "phone").await.unwrap().unwrap().cursor;
    assert_eq!(code(ben.ws.ack(&old.batch_token, 3).await), ErrorCode::StaleGeneration);
    let after = ts.running().state.store.device("ben", "phone").await.unwrap().unwrap().cursor;
    assert_eq!(before, after, "the stale ACK changed nothing");
    ts.stop().await;
}

/// D7: a snapshot built while several conversations keep receiving
/// messages reflects exactly its base; everything after arrives by
/// incremental sync; nothing missing, nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_under_writes_is_exact_and_incremental_sync_completes_it() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben", "cat"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let cat = ts.device("cat", "phone").await;
    let mut reference = ts.device("ben", "desk").await;
    let c1 = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let c2 = cat.ws.conv_create_direct("ben").await.unwrap().conv;
    let g: serde_json::Value =
        ann.ws.request_value("conv.create", json!({"kind": "group", "members": ["ben", "cat"]})).await.unwrap();
    let c3 = g["conv"].as_str().unwrap().to_owned();
    for i in 0..10 {
        say(&ann, &c1, &format!("a{i}")).await;
        say(&cat, &c2, &format!("c{i}")).await;
    }
    let writers: Vec<_> =
        [(ann.ws.clone(), c1.clone(), "x"), (cat.ws.clone(), c2.clone(), "y"), (ann.ws.clone(), c3.clone(), "z")]
            .into_iter()
            .map(|(ws, conv, p)| {
                tokio::spawn(async move {
                    for i in 0..40 {
                        ws.request_value(
                            "send",
                            json!({"conv": conv, "client_msg_id": format!("{p}{i}"), "content": {"text": "w"}}),
                        )
                        .await
                        .unwrap();
                    }
                })
            })
            .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut phone = ts.device("ben", "phone").await;
    phone.sync_page(10).await.unwrap();
    let base = phone.install_snapshot(false).await.unwrap();
    let snapshot_view: Vec<(String, u64)> = phone.snapshot.iter().map(|m| (m.conv.clone(), m.msg_seq)).collect();
    for w in writers {
        w.await.unwrap();
    }
    // The reference device holds the whole log: the snapshot must equal
    // exactly the messages whose user events are at or below the base.
    let total = 1 + 20 + 120; // group created + 20 direct + 120 written
    reference.sync_until(total, 50).await;
    let mut at_base: Vec<(String, u64)> =
        reference.log.iter().filter(|e| e.sync_seq <= base).map(|e| (e.conv.clone(), e.msg_seq.unwrap())).collect();
    at_base.sort();
    let mut snap_sorted = snapshot_view.clone();
    snap_sorted.sort();
    assert_eq!(snap_sorted, at_base, "the manifest reflects exactly the base");
    // Incremental sync from the base completes the view.
    phone.sync_until(total - at_base.len(), 50).await;
    for conv in [&c1, &c2, &c3] {
        let mut count = 0;
        let seqs: Vec<u64> = phone.view(conv).keys().copied().collect();
        let want: Vec<u64> = reference.view(conv).keys().copied().collect();
        assert_eq!(seqs, want, "nothing missing in {conv}");
        count += phone.snapshot.iter().filter(|m| &m.conv == conv).count();
        count += phone.log.iter().filter(|e| &e.conv == conv).count();
        assert_eq!(count, want.len(), "nothing twice in {conv}");
    }
    ts.stop().await;
}

/// D7: a corrupt page (digest mismatch) or an install aborted midway never
/// moves the cursor; a retry of the same snapshot succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_or_interrupted_install_never_moves_the_cursor() {
    let ts = TestServer::start_with(ServerConfig { snapshot_page_items: 3, ..Default::default() }).await;
    let (ann, mut ben, conv) = ts.ann_and_ben().await;
    for i in 0..10 {
        say(&ann, &conv, &format!("m{i}")).await;
    }
    ben.sync_until(10, 4).await;
    let store = ts.running().state.store.clone();
    let acked = store.device("ben", "phone").await.unwrap().unwrap().cursor;
    // Corrupt transfer: the digest check fails and nothing is ACKed.
    assert_eq!(ben.install_snapshot(true).await, Err("manifest digest mismatch".into()));
    let mid = store.device("ben", "phone").await.unwrap().unwrap().cursor;
    assert_eq!((mid.acked_sync_seq, mid.generation), (acked.acked_sync_seq, acked.generation + 1), "bumped, not moved");
    // Interrupted: begin and one page, then the app dies.
    let begin: tidemark_client::proto::SnapshotBeginOk = ben.ws.request("snapshot.begin", &json!({})).await.unwrap();
    assert!(begin.pages > 1);
    let _: serde_json::Value =
        ben.ws.request("snapshot.page", &json!({"snapshot_token": begin.snapshot_token, "page": 0})).await.unwrap();
    let still = store.device("ben", "phone").await.unwrap().unwrap().cursor;
    assert_eq!(still.acked_sync_seq, acked.acked_sync_seq, "no ACK, no move");
    assert_eq!(code(ben.sync_page(5).await), ErrorCode::ResetRequired, "it must finish a snapshot first");
    assert_eq!(
        code(
            ben.ws
                .request::<_, serde_json::Value>(
                    "snapshot.page",
                    &json!({"snapshot_token": begin.snapshot_token, "page": 99})
                )
                .await
        ),
        ErrorCode::BadRequest
    );
    // The same immutable snapshot can be fetched again and installed.
    let mut items = Vec::new();
    for page in 0..begin.pages {
        let p: tidemark_client::proto::SnapshotPageOk = ben
            .ws
            .request("snapshot.page", &json!({"snapshot_token": begin.snapshot_token, "page": page}))
            .await
            .unwrap();
        items.extend(p.items);
    }
    assert_eq!(tidemark_server::ops::snapshot::manifest_digest(&items), begin.manifest_digest);
    let ack: serde_json::Value =
        ben.ws.request("snapshot.ack", &json!({"snapshot_token": begin.snapshot_token})).await.unwrap();
    assert_eq!(ack["acked_sync_seq"], begin.base_sync_seq);
    let again: serde_json::Value =
        ben.ws.request("snapshot.ack", &json!({"snapshot_token": begin.snapshot_token})).await.unwrap();
    assert_eq!(again["acked_sync_seq"], begin.base_sync_seq, "a retried ACK gets the same answer");
    ts.stop().await;
}

/// L1–L2: the trim never passes the slowest valid device's ACK or a live
/// snapshot's base; a device offline past the window stops holding it and,
/// on return, gets RESET_REQUIRED, a snapshot and full convergence, never
/// an empty "nothing new"; a new device after a trim gets a snapshot too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_respects_fences_and_long_offline_devices_resync() {
    let ts = TestServer::start_with(ServerConfig { retention: None, ..Default::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let mut slow = ts.device("ben", "slow").await;
    let mut fast = ts.device("ben", "fast").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for i in 0..5 {
        say(&ann, &conv, &format!("a{i}")).await;
    }
    slow.sync_until(5, 10).await;
    for i in 5..20 {
        say(&ann, &conv, &format!("a{i}")).await;
    }
    fast.sync_until(20, 10).await;
    let store = ts.running().state.store.clone();
    let keep_all_devices =
        RetentionPolicy { keep_events_younger_than_ms: 0, device_inactive_after_ms: 3_600_000, history_keep_ms: None };
    let now = || tidemark_server::util::now_ms() + 1;
    store.trim_user_logs(keep_all_devices, now()).await.unwrap();
    assert_eq!(store.user_log("ben").await.unwrap().trimmed_upto, 5, "the slowest valid ACK is the fence");
    slow.sync_batch(10).await; // still replays: nothing it needs is gone
    assert_eq!(slow.log.len(), 20);

    // slow goes offline; the window passes; more traffic; fast keeps up.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 20..30 {
        say(&ann, &conv, &format!("a{i}")).await;
    }
    fast.sync_until(30, 10).await;
    let short_window =
        RetentionPolicy { keep_events_younger_than_ms: 0, device_inactive_after_ms: 200, history_keep_ms: None };
    store.trim_user_logs(short_window, now()).await.unwrap();
    assert_eq!(store.user_log("ben").await.unwrap().trimmed_upto, 30, "the inactive device no longer holds the fence");

    // slow returns: not an empty page, a reset.
    assert_eq!(code(slow.sync_page(10).await), ErrorCode::ResetRequired);
    slow.install_snapshot(false).await.unwrap();
    say(&ann, &conv, "after").await;
    slow.sync_until(1, 10).await;
    fast.sync_until(31, 10).await;
    assert_eq!(slow.view(&conv), fast.view(&conv), "full convergence");

    // A live snapshot's base fences the trim: tablet starts one and stalls.
    let mut tablet = ts.device("ben", "tablet").await;
    assert_eq!(code(tablet.sync_page(10).await), ErrorCode::ResetRequired, "a new device after a trim gets a snapshot");
    let begin: tidemark_client::proto::SnapshotBeginOk = tablet.ws.request("snapshot.begin", &json!({})).await.unwrap();
    for i in 0..5 {
        say(&ann, &conv, &format!("b{i}")).await;
    }
    fast.sync_until(36, 10).await;
    slow.sync_until(6, 10).await;
    store.trim_user_logs(short_window, now()).await.unwrap();
    assert_eq!(
        store.user_log("ben").await.unwrap().trimmed_upto,
        begin.base_sync_seq,
        "never past a live snapshot base"
    );
    let _: serde_json::Value =
        tablet.ws.request("snapshot.ack", &json!({"snapshot_token": begin.snapshot_token})).await.unwrap();
    tablet.generation = Some(begin.sync_generation);
    tablet.applied = begin.base_sync_seq;
    tablet.sync_until(5, 10).await;
    ts.stop().await;
}

/// D6: a device a little behind its ACK gets a recovery session that keeps
/// every event it needs through a concurrent trim and completes only by its
/// own final ACK; an expired session turns into a snapshot, never a partial
/// page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_session_fences_trim_and_expires_into_a_snapshot() {
    let config = ServerConfig { retention: None, recovery_ttl: Duration::from_millis(400), ..Default::default() };
    let ts = TestServer::start_with(config).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let mut phone = ts.device("ben", "phone").await;
    let mut fast = ts.device("ben", "fast").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for i in 0..20 {
        say(&ann, &conv, &format!("a{i}")).await;
    }
    phone.sync_until(20, 10).await;
    fast.sync_until(20, 10).await;
    let store = ts.running().state.store.clone();
    let everything =
        RetentionPolicy { keep_events_younger_than_ms: 0, device_inactive_after_ms: 3_600_000, history_keep_ms: None };
    let now = || tidemark_server::util::now_ms() + 1;

    // Restore a backup holding 12 events: the server ACK is 20.
    phone.log.truncate(12);
    phone.applied = 12;
    let g0 = phone.generation.unwrap();
    let first = phone.sync_page(3).await.unwrap();
    assert_eq!((first.sync_generation, first.resume_from, first.batch_high_watermark), (g0 + 1, 12, 20));
    assert_eq!(store.device("ben", "phone").await.unwrap().unwrap().cursor.state.as_str(), "RECOVERING");
    // A trim runs meanwhile: the session fences everything after 12.
    store.trim_user_logs(everything, now()).await.unwrap();
    assert_eq!(store.user_log("ben").await.unwrap().trimmed_upto, 12);
    let token = first.batch_token.clone();
    let mut page = first;
    loop {
        for e in page.events.clone() {
            phone.apply(e);
        }
        if !page.has_more {
            break;
        }
        let next = tidemark_client::proto::SyncReq {
            batch_token: Some(token.clone()),
            cursor: page.next_cursor.clone(),
            limit: Some(3),
            ..Default::default()
        };
        page = phone.ws.sync(&next).await.unwrap();
    }
    assert_eq!(phone.applied, 20, "every needed event was there");
    // Intermediate ACKs do not complete the session; the final one does.
    assert_eq!(phone.ws.ack(&token, 15).await.unwrap().acked_sync_seq, 20);
    assert_eq!(store.device("ben", "phone").await.unwrap().unwrap().cursor.state.as_str(), "RECOVERING");
    let done = phone.ws.ack(&token, 20).await.unwrap();
    assert_eq!((done.acked_sync_seq, done.sync_generation), (20, g0 + 1));
    assert_eq!(store.device("ben", "phone").await.unwrap().unwrap().cursor.state.as_str(), "ACTIVE");
    let ids: Vec<u64> = phone.log.iter().map(|e| e.sync_seq).collect();
    assert_eq!(ids, (1..=20).collect::<Vec<_>>(), "nothing lost, nothing twice");

    // Again, but the session expires before the device finishes.
    for i in 20..25 {
        say(&ann, &conv, &format!("a{i}")).await;
    }
    phone.sync_until(25, 10).await;
    fast.sync_until(25, 10).await;
    phone.log.truncate(18);
    phone.applied = 18;
    let first = phone.sync_page(2).await.unwrap();
    assert_eq!(first.resume_from, 18);
    tokio::time::sleep(Duration::from_millis(500)).await;
    store.trim_user_logs(everything, now()).await.unwrap();
    assert!(store.user_log("ben").await.unwrap().trimmed_upto > 18, "an expired session fences nothing");
    let next = tidemark_client::proto::SyncReq {
        batch_token: Some(first.batch_token.clone()),
        cursor: first.next_cursor.clone(),
        limit: Some(2),
        ..Default::default()
    };
    assert_eq!(code(phone.ws.sync(&next).await), ErrorCode::ResetRequired, "a reset, never a partial page");
    phone.install_snapshot(false).await.unwrap();
    say(&ann, &conv, "after").await;
    phone.sync_until(1, 10).await;
    fast.sync_until(26, 10).await;
    assert_eq!(phone.view(&conv), fast.view(&conv), "full convergence");
    ts.stop().await;
}

/// L3: message history retention is explicit: once history older than the
/// window expires, `history` says the page stops at the retention boundary
/// (`trimmed`, `history_start`) instead of returning an empty page as if
/// nothing had been said, `conv.sync` reports `trimmed` from an old cursor,
/// and recall tombstones outlive the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_retention_says_so_and_tombstones_outlive_it() {
    let ts = TestServer::start_with(ServerConfig { retention: None, ..Default::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for i in 0..3 {
        say(&ann, &conv, &format!("old-{i}")).await;
    }
    let recalled = ann
        .ws
        .request_value("send", json!({"conv": conv, "client_msg_id": "gone", "content": {"text": "gone"}}))
        .await
        .unwrap();
    let recalled_id = recalled["message_id"].as_str().unwrap().to_owned();
    ann.ws.request_value("recall", json!({"conv": conv, "message_id": recalled_id})).await.unwrap(); // 5
    let before: tidemark_client::proto::HistoryOk = ben.ws.request("history", &json!({"conv": conv})).await.unwrap();
    assert_eq!((before.history_start, before.trimmed), (1, false), "nothing expired yet");

    // Everything said so far falls out of the window.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let store = ts.running().state.store.clone();
    let policy = RetentionPolicy {
        keep_events_younger_than_ms: i64::MAX / 4,
        device_inactive_after_ms: 3_600_000,
        history_keep_ms: Some(10),
    };
    let report = store.trim_user_logs(policy, tidemark_server::util::now_ms()).await.unwrap();
    assert_eq!(report.conversations_trimmed, 1);
    assert_eq!(report.messages_expired, 3, "the recalled message and the recall event are tombstones and stay");
    say(&ann, &conv, "new").await; // 6

    let h: tidemark_client::proto::HistoryOk = ben.ws.request("history", &json!({"conv": conv})).await.unwrap();
    assert_eq!(h.messages.iter().map(|m| m.msg_seq).collect::<Vec<_>>(), vec![6]);
    assert!(h.trimmed && !h.has_more && h.history_start == 6, "the boundary is stated: {h:?}");
    let beyond: tidemark_client::proto::HistoryOk =
        ben.ws.request("history", &json!({"conv": conv, "before_seq": 3})).await.unwrap();
    assert!(beyond.messages.is_empty() && beyond.trimmed, "a query beyond retention says so");
    let sync: tidemark_client::proto::ConvSyncOk =
        ben.ws.request("conv.sync", &json!({"conv": conv, "after": 0})).await.unwrap();
    assert!(sync.trimmed && sync.min_seq == 6, "conv.sync from an old cursor says so too");
    // Tombstones outlive the window: the recalled message keeps its state.
    let mut phone = ts.device("ben", "tablet").await;
    phone.sync_until(6, 10).await;
    let states: Vec<(u64, String)> = phone
        .log
        .iter()
        .map(|e| {
            let m = e.message.as_ref().unwrap();
            (m.msg_seq, m.state.clone())
        })
        .collect();
    assert_eq!(states[3], (4, "recalled".to_string()));
    assert_eq!(states[0], (1, "expired".to_string()));
    assert!(!serde_json::to_string(&phone.log).unwrap().contains("old-0"), "expired content is gone");
    ts.stop().await;
}

/// L1 with a lost `snapshot.begin` reply: the device begins a second
/// snapshot and installs it; the first, never installable now, stops
/// fencing the user's log at once instead of until its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_snapshot_stops_fencing_once_its_device_installs_another() {
    let ts = TestServer::start_with(ServerConfig { retention: None, ..Default::default() }).await;
    ts.user("ann").await;
    ts.user("ben").await;
    let ann = ts.device("ann", "phone").await;
    let mut fast = ts.device("ben", "fast").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for i in 0..10 {
        say(&ann, &conv, &format!("a{i}")).await;
    }
    fast.sync_until(10, 10).await;
    let store = ts.running().state.store.clone();
    let policy =
        RetentionPolicy { keep_events_younger_than_ms: 0, device_inactive_after_ms: 3_600_000, history_keep_ms: None };
    let now = || tidemark_server::util::now_ms() + 1;
    store.trim_user_logs(policy, now()).await.unwrap();
    assert_eq!(store.user_log("ben").await.unwrap().trimmed_upto, 10);

    let mut tablet = ts.device("ben", "tablet").await;
    assert_eq!(code(tablet.sync_page(10).await), ErrorCode::ResetRequired);
    // The first begin's reply is "lost": the tablet never sees it.
    let lost: tidemark_client::proto::SnapshotBeginOk = tablet.ws.request("snapshot.begin", &json!({})).await.unwrap();
    for i in 10..15 {
        say(&ann, &conv, &format!("a{i}")).await;
    }
    fast.sync_until(15, 10).await;
    store.trim_user_logs(policy, now()).await.unwrap();
    assert_eq!(store.user_log("ben").await.unwrap().trimmed_upto, lost.base_sync_seq, "a live snapshot fences");
    // The tablet begins again and installs the second snapshot.
    let base = tablet.install_snapshot(false).await.unwrap();
    assert!(base > lost.base_sync_seq, "the second snapshot is newer ({base} vs {})", lost.base_sync_seq);
    store.trim_user_logs(policy, now()).await.unwrap();
    assert_eq!(
        store.user_log("ben").await.unwrap().trimmed_upto,
        base,
        "the abandoned snapshot no longer holds the log back"
    );
    assert_eq!(store.snapshot(&lost.snapshot_id).await.unwrap().unwrap().state, "EXPIRED");
    ts.stop().await;
}

/// D7, issues 16 (item 5) and 19: a user with more conversations than the
/// old bound of 10,000 still rebuilds a device from one snapshot, and the
/// build never holds the writer for all of it: the view is read beside the
/// writer and each page is stored by its own writer transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_with_more_than_ten_thousand_conversations_installs_a_snapshot_built_in_chunks() {
    const CONVS: usize = 10_001;
    let ts = TestServer::start().await;
    ts.user("ann").await;
    let store = ts.running().state.store.clone();
    // The peers and the direct conversations straight through the store,
    // 500 at a time (group commit makes that cheap).
    let all: Vec<usize> = (0..CONVS).collect();
    for chunk in all.chunks(500) {
        let mut tasks = tokio::task::JoinSet::new();
        for &i in chunk {
            let store = store.clone();
            tasks.spawn(async move {
                let peer = format!("p{i:05}");
                assert!(store.create_user(&peer, "not-a-password-hash", 0).await.unwrap());
                store.create_direct("ann", &peer, &format!("c{i:05}"), 0).await.unwrap();
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    }
    let mut ann = ts.device("ann", "tablet").await;
    let commits_before = store.stats().commits;
    let begin: tidemark_client::proto::SnapshotBeginOk = ann.ws.request("snapshot.begin", &json!({})).await.unwrap();
    let commits = store.stats().commits - commits_before;
    assert_eq!(begin.pages as usize, CONVS.div_ceil(200), "one item per conversation, 200 a page");
    assert!(
        commits > u64::from(begin.pages),
        "a page per writer transaction: {commits} commits, {} pages",
        begin.pages
    );
    let mut items = Vec::new();
    for page in 0..begin.pages {
        let p: tidemark_client::proto::SnapshotPageOk = ann
            .ws
            .request("snapshot.page", &json!({"snapshot_token": begin.snapshot_token, "page": page}))
            .await
            .unwrap();
        items.extend(p.items);
    }
    assert_eq!(tidemark_server::ops::snapshot::manifest_digest(&items), begin.manifest_digest);
    let convs: std::collections::BTreeSet<String> =
        items.iter().filter(|i| i["type"] == "conv").map(|i| i["conv"].as_str().unwrap().to_owned()).collect();
    assert_eq!(convs.len(), CONVS, "every conversation, once");
    let ack: serde_json::Value =
        ann.ws.request("snapshot.ack", &json!({"snapshot_token": begin.snapshot_token})).await.unwrap();
    assert_eq!(ack["acked_sync_seq"], begin.base_sync_seq);
    ann.generation = Some(begin.sync_generation);
    ann.applied = begin.base_sync_seq;
    let page = ann.sync_page(10).await.unwrap();
    assert_eq!(page.resume_from, begin.base_sync_seq, "incremental sync from the base");
    ts.stop().await;
}
