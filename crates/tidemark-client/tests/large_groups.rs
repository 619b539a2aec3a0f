//! Large groups end to end (G2, G3, K2): a real server with a low
//! large-group threshold and SDK devices on it. A group crossing the
//! threshold while its members' devices are online, offline, mid-batch and
//! rebuilt from a snapshot: every device ends with every message once, in
//! `msg_seq` order, within its user's periods; the markers clear only after
//! the pull; with no fan-out (so no marker and no hint) opening the
//! conversation still brings every message (the slow path).

mod common;

use std::time::Duration;

use common::*;
use tidemark_client::{Change, Client};
use tidemark_core::large::GroupPolicy;
use tidemark_server::ServerConfig;

/// Threshold 3: the fourth member switches a group to shared mode.
fn config() -> ServerConfig {
    let mut c = ServerConfig {
        group_policy: GroupPolicy::new(3).unwrap(),
        retention_every: Duration::from_secs(3600),
        snapshot_messages_per_conv: 3,
        ..ServerConfig::default()
    };
    c.retention.as_mut().expect("retention on by default").keep_events_younger_than_ms = 0;
    c
}

/// The user messages a device holds in `conv`: `(msg_seq, text)`.
async fn held(client: &Client, conv: &str) -> Vec<(u64, String)> {
    client
        .messages(conv)
        .await
        .unwrap()
        .iter()
        .map(|m| (m.msg_seq, m.content["text"].as_str().unwrap_or_default().to_owned()))
        .collect()
}

/// Waits until `client` holds exactly `want` in `conv`, then checks it
/// stays exact (no duplicate, nothing out of order: `messages` is keyed by
/// `msg_seq`, so a duplicate would show as a second id at another seq).
async fn wait_exact(client: &Client, conv: &str, want: &[(u64, String)]) {
    let ok = client.wait_for(WAIT, || async { Ok(held(client, conv).await == want) }).await;
    if ok.is_err() {
        panic!("{}: held {:?}, want {want:?}", client.config().device_id, held(client, conv).await);
    }
}

fn texts(range: &[(u64, &str)]) -> Vec<(u64, String)> {
    range.iter().map(|(s, t)| (*s, t.to_string())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_crossing_the_threshold_loses_and_repeats_nothing_on_any_device() {
    let h = Harness::start_with(config()).await;
    for u in ["ann", "ben", "cat", "dan", "eve"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let ben = h.ready("ben", "phone").await;
    // ben's laptop pages two events at a time, so the switch lands inside
    // one of its batches.
    let mut small = h.config("ben", "laptop");
    small.sync_page_limit = 2;
    let ben_laptop = Client::open(small).unwrap();
    ben_laptop.start().await.unwrap();
    let g = ann.create_group(&["ben", "cat"]).await.unwrap().conv; // 1
    let mut expect: Vec<(u64, &str)> = Vec::new();
    for t in ["p1", "p2"] {
        let (seq, _) = send_ok(&ann, &g, t).await; // 2, 3
        expect.push((seq, t));
    }
    // cat is offline across the switch.
    wait_exact(&ben, &g, &texts(&expect)).await;

    assert_eq!(ann.add_member(&g, "dan").await.unwrap(), 4); // join 4, switch 5
    for t in ["s1", "s2", "s3"] {
        let (seq, _) = send_ok(&ann, &g, t).await; // 6, 7, 8
        expect.push((seq, t));
    }
    let (seq, _) = send_ok(&ben, &g, "s4").await; // 9, from a member
    expect.push((seq, "s4"));
    assert_eq!(expect.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 3, 6, 7, 8, 9]);
    let want = texts(&expect);
    wait_exact(&ben, &g, &want).await;
    wait_exact(&ben_laptop, &g, &want).await;
    wait_exact(&ann, &g, &want).await;
    assert!(ben.conversation(&g).await.unwrap().unwrap().shared, "the switch event set the mode");

    // Nothing per member per message above the switch: ben's log holds the
    // group's events up to the switch and nothing after.
    let ben_log = h.server().state.store.user_high_watermark("ben").await.unwrap();
    let cat = h.ready("cat", "tablet").await;
    wait_exact(&cat, &g, &want).await;
    let dan = h.ready("dan", "phone").await;
    // dan joined at 4: p1 and p2 are outside his view.
    wait_exact(&dan, &g, &want[2..]).await;
    assert_eq!(h.server().state.store.user_high_watermark("ben").await.unwrap(), ben_log);

    // Markers end clean on every device once it holds the target.
    for (user, device) in [("ben", "phone"), ("ben", "laptop"), ("cat", "tablet"), ("dan", "phone")] {
        let store = &h.server().state.store;
        let deadline = tokio::time::Instant::now() + WAIT;
        while !store.dirty_markers(user, device).await.unwrap().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "{user}/{device} never cleared");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    // Unread carries over the switch and is not reset: ben never read, the
    // server counts p1, p2, s1..s3 (s4 is his own).
    let list = ben.server_conversations().await.unwrap();
    let row = list.iter().find(|c| c.conv == g).unwrap();
    assert_eq!((row.mode.as_str(), row.unread, row.dirty), ("shared", 5, Some(false)), "{row:?}");

    // A device rebuilt from a snapshot after the switch: the log is trimmed
    // behind every ACK, so ben's new tablet starts from a snapshot that
    // lists the shared group at its target.
    for (device, acked) in [("phone", ben_log), ("laptop", ben_log)] {
        h.wait_server_ack("ben", device, acked).await;
    }
    let state = &h.server().state;
    let policy = state.config.retention.unwrap();
    state.store.trim_user_logs(policy, tidemark_server::util::now_ms() + 1).await.unwrap();
    assert!(state.store.user_log("ben").await.unwrap().trimmed_upto > 0);
    let tablet = h.ready("ben", "tablet").await;
    let (seq, _) = send_ok(&ann, &g, "after").await; // 10
    expect.push((seq, "after"));
    // The snapshot carries the latest 3 messages; the rest is history.
    let tail = texts(&expect[expect.len() - 4..]);
    wait_exact(&tablet, &g, &tail).await;
    let conv = tablet.conversation(&g).await.unwrap().unwrap();
    assert!(conv.shared && conv.contiguous_msg_seq == 10, "{conv:?}");
    let mut older = tablet.history(&g, Some(conv.history_to + 1), 50).await.unwrap().messages;
    older.reverse();
    let mut all: Vec<(u64, String)> = older
        .iter()
        .filter(|m| m.kind == "text")
        .map(|m| (m.msg_seq, m.content["text"].as_str().unwrap_or_default().to_owned()))
        .collect();
    all.extend(tail);
    assert_eq!(all, texts(&expect), "history and the snapshot together: every message once, in order");
    for c in [ann, ben, ben_laptop, cat, dan, tablet] {
        c.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_a_large_group_brings_every_message_with_no_marker_and_no_hint() {
    // Created large (threshold 3, four members), then messages accepted but
    // never fanned out: no marker is published and no hint is sent.
    let h = Harness::start_with(config()).await;
    for u in ["ann", "ben", "cat", "dan"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let g = ann.create_group(&["ben", "cat", "dan"]).await.unwrap().conv; // 1, switch 2
    let ben = h.ready("ben", "phone").await;
    ben.wait_for(WAIT, || async { Ok(ben.conversation(&g).await?.is_some_and(|c| c.shared)) }).await.unwrap();
    let mut h = h;
    ben.stop().await;
    h.restart_server(ServerConfig { hold_fanout: true, ..config() }).await;
    let ann = h.ready("ann", "laptop").await;
    let mut want = Vec::new();
    for t in ["q1", "q2", "q3"] {
        let (seq, _) = send_ok(&ann, &g, t).await;
        want.push((seq, t.to_string()));
    }
    // Ready: connected and one sync round done.
    let ben = h.ready("ben", "phone").await;
    let mut changes = ben.subscribe();
    assert!(held(&ben, &g).await.is_empty(), "nothing reached ben by the log, a marker or a hint");
    assert!(h.server().state.store.dirty_markers("ben", "phone").await.unwrap().is_empty());
    let opened = ben.open_conversation(&g).await.unwrap();
    assert_eq!(held(&ben, &g).await, want, "the slow path read the authoritative head");
    assert_eq!(opened.contiguous_msg_seq, 5);
    assert!(!drain(&mut changes).iter().any(|c| matches!(c, Change::Hint { reason, .. } if reason == "conv_moved")));
    ann.stop().await;
    ben.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_racing_messages_in_a_large_group_is_ordered_by_the_writer() {
    let h = Harness::start_with(config()).await;
    for u in ["ann", "ben", "cat", "dan"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let cat = h.ready("cat", "phone").await;
    let g = ann.create_group(&["ben", "cat", "dan"]).await.unwrap().conv;
    cat.wait_for(WAIT, || async { Ok(cat.conversation(&g).await?.is_some_and(|c| c.shared)) }).await.unwrap();
    // ann sends while cat leaves: the writer orders them; cat's view ends
    // exactly at its leave, whatever the interleaving.
    let sends = async {
        let mut seqs = Vec::new();
        for i in 0..10 {
            seqs.push((send_ok(&ann, &g, &format!("r{i}")).await.0, format!("r{i}")));
        }
        seqs
    };
    let (seqs, leave) = tokio::join!(sends, cat.leave(&g));
    let leave = leave.unwrap();
    let want: Vec<(u64, String)> = seqs.iter().filter(|(s, _)| *s < leave).cloned().collect();
    wait_exact(&cat, &g, &want).await;
    cat.wait_for(WAIT, || async { Ok(cat.conversation(&g).await?.is_some_and(|c| !c.active)) }).await.unwrap();
    let all = seqs.clone();
    let dan = h.ready("dan", "phone").await;
    wait_exact(&dan, &g, &all).await;
    // And a pull after the leave brings nothing past it.
    cat.open_conversation(&g).await.unwrap();
    assert_eq!(held(&cat, &g).await, want);
    for c in [ann, cat, dan] {
        c.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_mid_snapshot_at_the_switch_ends_with_every_message_once() {
    use tidemark_client::{Exit, FaultPoint};
    let h = Harness::start_with(config()).await;
    for u in ["ann", "ben", "cat", "dan"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let ben = h.ready("ben", "phone").await;
    let g = ann.create_group(&["ben", "cat"]).await.unwrap().conv; // 1, per member
    let mut expect: Vec<(u64, &str)> = Vec::new();
    for t in ["p1", "p2", "p3", "p4"] {
        expect.push((send_ok(&ann, &g, t).await.0, t)); // 2..=5
    }
    wait_exact(&ben, &g, &texts(&expect)).await;
    let log = h.server().state.store.user_high_watermark("ben").await.unwrap();
    h.wait_server_ack("ben", "phone", log).await;
    let state = &h.server().state;
    state.store.trim_user_logs(state.config.retention.unwrap(), tidemark_server::util::now_ms() + 1).await.unwrap();

    // ben's tablet fetches a snapshot built before the switch and is killed
    // before installing it.
    let mut cfg = h.config("ben", "tablet");
    cfg.fault = Some(abort_once(|p| matches!(p, FaultPoint::SnapshotBeforeCommit { .. })));
    let tablet = Client::open(cfg).unwrap();
    tablet.start().await.unwrap();
    let exit = tokio::time::timeout(WAIT, tablet.closed()).await.unwrap();
    assert!(matches!(exit, Exit::Aborted(FaultPoint::SnapshotBeforeCommit { .. })), "{exit:?}");
    drop(tablet);

    // Meanwhile the group switches and moves on.
    assert_eq!(ann.add_member(&g, "dan").await.unwrap(), 6); // join 6, switch 7
    for t in ["s1", "s2"] {
        expect.push((send_ok(&ann, &g, t).await.0, t)); // 8, 9
    }
    // The tablet finishes the pending install (the pre-switch snapshot),
    // then syncs on from its base: the switch from its log, the rest by
    // the marker.
    let tablet = h.ready("ben", "tablet").await;
    let conv = tablet.conversation(&g).await.unwrap().unwrap();
    let tail = texts(&expect[expect.len() - 5..]);
    wait_exact(&tablet, &g, &tail).await;
    let conv_now = tablet.conversation(&g).await.unwrap().unwrap();
    assert!(conv_now.shared, "{conv_now:?}");
    assert_eq!(conv.history_to, 2, "the snapshot carried the latest 3 of p1..p4");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !h.server().state.store.dirty_markers("ben", "tablet").await.unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the tablet never cleared its marker");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for c in [ann, ben, tablet] {
        c.stop().await;
    }
}
