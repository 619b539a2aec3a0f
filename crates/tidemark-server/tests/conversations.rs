//! Conversations (issue 4): groups and membership periods (G1, F4),
//! conv.sync (C1–C2), history (C3–C4), recall/edit/react (E1–E2), per-user
//! events (E3) and read state (R1–R3), over real sockets and SQLite.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tidemark_client::proto::{ConvSyncOk, HistoryOk, SendReq};
use tidemark_client::WsConn;
use tidemark_server::ServerConfig;

async fn call(ws: &WsConn, op: &str, body: Value) -> Value {
    let v = ws.request_value(op, body).await.unwrap();
    assert_ne!(v["t"], "error", "{op} refused: {v}");
    v
}

async fn refused(ws: &WsConn, op: &str, body: Value) -> String {
    let v = ws.request_value(op, body).await.unwrap();
    assert_eq!(v["t"], "error", "{op} should be refused: {v}");
    v["code"].as_str().unwrap().to_owned()
}

async fn group(ws: &WsConn, members: &[&str]) -> String {
    call(ws, "conv.create", json!({"kind": "group", "members": members})).await["conv"].as_str().unwrap().to_owned()
}

async fn say(ws: &WsConn, conv: &str, text: &str) -> Value {
    call(ws, "send", json!({"conv": conv, "client_msg_id": text, "content": {"text": text}})).await
}

/// Runs every pending outbox item through the store's fan-out, as the
/// relay would; used with `hold_fanout` to delay fan-out on purpose.
async fn fan_out_now(ts: &TestServer) {
    let store = &ts.running().state.store;
    loop {
        let items = store.pending_outbox(100).await.unwrap();
        if items.is_empty() {
            return;
        }
        store.fan_out(items, 0).await.unwrap();
    }
}

/// All conversation events of `conv` the user's log holds: (msg_seq, kind, text).
fn conv_log(d: &Device, conv: &str) -> Vec<(u64, String, String)> {
    d.log
        .iter()
        .filter(|e| e.conv == conv && e.message.is_some())
        .map(|e| {
            let m = e.message.as_ref().unwrap();
            (m.msg_seq, m.kind.clone(), m.content["text"].as_str().unwrap_or("").to_owned())
        })
        .collect()
}

async fn conv_sync_all(ws: &WsConn, conv: &str, after: u64, limit: u32) -> (Vec<u64>, u64) {
    let mut after = after;
    let mut seqs = Vec::new();
    loop {
        let page: ConvSyncOk =
            ws.request("conv.sync", &json!({"conv": conv, "after": after, "limit": limit})).await.unwrap();
        seqs.extend(page.events.iter().map(|e| e.msg_seq));
        assert!(page.next_after >= after, "the cursor never moves back");
        after = page.next_after;
        if !page.has_more {
            return (seqs, after);
        }
    }
}

/// G1 + S2: a removal racing sends: the writer orders them; every send
/// before the leave event is delivered to the removed member, none after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_change_racing_messages_is_ordered_by_the_writer() {
    let ts = TestServer::start().await;
    for u in ["own", "cat", "dan"] {
        ts.user(u).await;
    }
    let own = ts.device("own", "phone").await;
    let mut cat = ts.device("cat", "phone").await;
    let mut dan = ts.device("dan", "phone").await;
    let conv = group(&own.ws, &["cat", "dan"]).await;
    let sender = {
        let (ws, conv) = (cat.ws.clone(), conv.clone());
        tokio::spawn(async move {
            let mut results = Vec::new();
            for i in 0..40 {
                let v = ws
                    .request_value(
                        "send",
                        json!({"conv": conv, "client_msg_id": format!("c{i}"), "content": {"text": format!("c{i}")}}),
                    )
                    .await
                    .unwrap();
                results.push(v);
            }
            results
        })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    let leave_seq =
        call(&own.ws, "conv.remove", json!({"conv": conv, "user": "cat"})).await["msg_seq"].as_u64().unwrap();
    let results = sender.await.unwrap();
    let accepted: Vec<u64> =
        results.iter().filter(|r| r["t"] == "send.ok").map(|r| r["msg_seq"].as_u64().unwrap()).collect();
    for r in &results {
        assert!(r["t"] == "send.ok" || r["code"] == "NOT_MEMBER", "{r}");
    }
    assert!(accepted.iter().all(|&s| s < leave_seq), "nothing of cat's is accepted after the leave");
    let total = leave_seq; // conv.created .. leave, contiguous
    dan.sync_until(total as usize, 16).await;
    cat.sync_until(total as usize, 16).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    cat.sync_batch(16).await;
    let cat_seqs: Vec<u64> = conv_log(&cat, &conv).iter().map(|e| e.0).collect();
    assert_eq!(cat_seqs, (1..=leave_seq).collect::<Vec<_>>(), "cat gets everything up to its leave, inclusive");
    say(&own.ws, &conv, "after").await;
    dan.sync_until(total as usize + 1, 16).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    cat.sync_batch(16).await;
    assert_eq!(conv_log(&cat, &conv).len(), leave_seq as usize, "and nothing after it");
    // A forged cursor past the leave reaches nothing after it (C3).
    let h: HistoryOk = cat.ws.request("history", &json!({"conv": conv, "before_seq": 1000, "limit": 5})).await.unwrap();
    assert_eq!(h.messages[0].msg_seq, leave_seq);
    ts.stop().await;
}

/// F4: a fan-out delayed past a leave still delivers the pre-leave messages
/// to the leaver (from the periods covering each msg_seq, not the member
/// list) and never a later one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_fan_out_after_a_leave_uses_the_periods() {
    let ts = TestServer::start_with(ServerConfig { hold_fanout: true, ..Default::default() }).await;
    for u in ["own", "cat"] {
        ts.user(u).await;
    }
    let own = ts.device("own", "phone").await;
    let mut cat = ts.device("cat", "phone").await;
    let conv = group(&own.ws, &["cat"]).await;
    say(&own.ws, &conv, "before-1").await;
    say(&own.ws, &conv, "before-2").await;
    call(&cat.ws, "conv.leave", json!({"conv": conv})).await;
    say(&own.ws, &conv, "after").await;
    // Only now does fan-out run, after the leave committed.
    fan_out_now(&ts).await;
    cat.sync_until(4, 10).await;
    let log = conv_log(&cat, &conv);
    let kinds: Vec<&str> = log.iter().map(|e| e.1.as_str()).collect();
    assert_eq!(kinds, vec!["conv.created", "text", "text", "member.leave"]);
    assert!(log.iter().all(|e| e.2 != "after"));
    ts.stop().await;
}

/// G1: rejoining opens a new period; the gap between the periods is
/// invisible everywhere, and a redelivered old event is not delivered
/// again under the new period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejoin_periods_are_independent_and_the_gap_is_invisible() {
    let ts = TestServer::start_with(ServerConfig { hold_fanout: true, ..Default::default() }).await;
    for u in ["own", "cat"] {
        ts.user(u).await;
    }
    let own = ts.device("own", "phone").await;
    let mut cat = ts.device("cat", "phone").await;
    let conv = group(&own.ws, &["cat"]).await;
    say(&own.ws, &conv, "p1").await; // 2
    fan_out_now(&ts).await;
    let old_items_redelivered = {
        // Keep a copy of an outbox item already consumed, to redeliver later.
        say(&own.ws, &conv, "p1-b").await; // 3
        let items = ts.running().state.store.pending_outbox(10).await.unwrap();
        fan_out_now(&ts).await;
        items
    };
    call(&own.ws, "conv.remove", json!({"conv": conv, "user": "cat"})).await; // 4
    say(&own.ws, &conv, "gap-1").await; // 5
    say(&own.ws, &conv, "gap-2").await; // 6
    call(&own.ws, "conv.add", json!({"conv": conv, "user": "cat"})).await; // 7
    say(&own.ws, &conv, "p2").await; // 8
    fan_out_now(&ts).await;
    // The old event arrives again (a relay retry) after the rejoin.
    let again = ts.running().state.store.fan_out(old_items_redelivered, 0).await.unwrap();
    assert_eq!(again.events_written, 0, "an old event is not delivered again under the new period");
    cat.sync_until(6, 10).await;
    let seqs: Vec<u64> = conv_log(&cat, &conv).iter().map(|e| e.0).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4, 7, 8], "the gap 5..6 is invisible");
    let (synced, next_after) = conv_sync_all(&cat.ws, &conv, 0, 2).await;
    assert_eq!(synced, vec![1, 2, 3, 4, 7, 8]);
    assert_eq!(next_after, 8);
    let h: HistoryOk = cat.ws.request("history", &json!({"conv": conv, "before_seq": 7, "limit": 10})).await.unwrap();
    let hs: Vec<u64> = h.messages.iter().map(|m| m.msg_seq).collect();
    assert_eq!(hs, vec![4, 3, 2, 1], "a forged before_seq inside the gap reaches nothing in it");
    ts.stop().await;
}

/// E1: a device offline during the send and the recall never sees the
/// original content: its sync, conv.sync and history all carry the
/// placeholder; an online device gets the recall event after the original.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recall_reaches_an_offline_device_before_the_original() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let mut desk = ts.device("ben", "desk").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let secret = say(&ann.ws, &conv, "secret").await;
    let id = secret["message_id"].as_str().unwrap().to_owned();
    desk.sync_until(1, 10).await;
    assert_eq!(desk.log[0].message.as_ref().unwrap().content["text"], "secret");
    let r = call(&ann.ws, "recall", json!({"conv": conv, "message_id": id, "client_msg_id": "rc-1"})).await;
    assert_eq!(r["msg_seq"], 2);
    let again = call(&ann.ws, "recall", json!({"conv": conv, "message_id": id, "client_msg_id": "rc-1"})).await;
    assert_eq!(again["msg_seq"], 2, "a retried recall is the same event");
    assert_eq!(refused(&desk.ws, "recall", json!({"conv": conv, "message_id": id})).await, "FORBIDDEN");
    desk.sync_until(2, 10).await;
    let recall = desk.log[1].clone();
    assert_eq!(recall.kind, "recall");
    assert_eq!(recall.message.as_ref().unwrap().content["target_message_id"], id.as_str());

    // The phone was offline the whole time.
    let mut phone = ts.device("ben", "phone").await;
    phone.sync_until(2, 10).await;
    let first = phone.log[0].message.as_ref().unwrap();
    assert_eq!((first.state.as_str(), &first.content), ("recalled", &json!({})), "the original never reaches it");
    let wire = serde_json::to_string(&phone.log).unwrap();
    assert!(!wire.contains("secret"), "no path serves the recalled content");
    let sync: ConvSyncOk = phone.ws.request("conv.sync", &json!({"conv": conv, "after": 0})).await.unwrap();
    assert_eq!(sync.events[0].state, "recalled");
    let h: HistoryOk = phone.ws.request("history", &json!({"conv": conv})).await.unwrap();
    assert!(!serde_json::to_string(&h).unwrap().contains("secret"));
    assert_eq!(h.messages.last().unwrap().msg_seq, 1, "the recalled message keeps its place");
    ts.stop().await;
}

/// R3: a message racing an unread clear stays unread: whichever of the
/// clear and the fan-out comes second, only what read_to_seq covers is
/// cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_clear_racing_a_new_message_keeps_it_unread() {
    let ts = TestServer::start_with(ServerConfig { hold_fanout: true, ..Default::default() }).await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for i in 1..=5 {
        say(&ann.ws, &conv, &format!("m{i}")).await;
    }
    fan_out_now(&ts).await;
    let unread = |v: Value| v["conversations"][0]["unread"].as_u64().unwrap();
    assert_eq!(unread(call(&ben.ws, "conv.list", json!({})).await), 5);
    // Message 6 is accepted but not fanned out when ben clears up to 5.
    say(&ann.ws, &conv, "m6").await;
    let r = call(&ben.ws, "read", json!({"conv": conv, "read_to_seq": 5})).await;
    assert_eq!((r["read_seq"].as_u64(), r["unread"].as_u64()), (Some(5), Some(0)));
    fan_out_now(&ts).await;
    assert_eq!(unread(call(&ben.ws, "conv.list", json!({})).await), 1, "m6 raced the clear and stays unread");
    // The other order: message 7 fanned out first, then a clear up to 6.
    say(&ann.ws, &conv, "m7").await;
    fan_out_now(&ts).await;
    let r = call(&ben.ws, "read", json!({"conv": conv, "read_to_seq": 6})).await;
    assert_eq!(r["unread"], 1, "m7 is above read_to_seq");
    // A clear that covers a message not yet fanned out: it never counts.
    say(&ann.ws, &conv, "m8").await;
    call(&ben.ws, "read", json!({"conv": conv, "read_to_seq": 8})).await;
    fan_out_now(&ts).await;
    assert_eq!(unread(call(&ben.ws, "conv.list", json!({})).await), 0);
    // Reads never move back.
    let r = call(&ben.ws, "read", json!({"conv": conv, "read_to_seq": 2})).await;
    assert_eq!(r["read_seq"], 8);
    ts.stop().await;
}

/// Seed 003's validation table for `history` (C3–C4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_validation_table() {
    let ts = TestServer::start().await;
    for u in ["own", "cat", "new"] {
        ts.user(u).await;
    }
    let own = ts.device("own", "phone").await;
    let cat = ts.device("cat", "phone").await;
    let conv = group(&own.ws, &["cat"]).await; // 1: conv.created
                                               // "Recalled first message": the first user message is recalled.
    let first = say(&own.ws, &conv, "first").await; // 2
    call(&own.ws, "recall", json!({"conv": conv, "message_id": first["message_id"]})).await; // 3
                                                                                             // Many messages in the same millisecond ("equal timestamps").
    let burst: Vec<_> = (0..20)
        .map(|i| {
            let ws = own.ws.clone();
            let conv = conv.clone();
            tokio::spawn(async move {
                ws.send(&SendReq {
                    conv,
                    client_msg_id: format!("b{i}"),
                    kind: "text".into(),
                    content: json!({"text": format!("b{i}")}),
                    mentions: Vec::new(),
                    mention_all: false,
                })
                .await
                .unwrap()
            })
        })
        .collect();
    for b in burst {
        b.await.unwrap();
    }
    // References: an expired file and an exhausted red packet stay as facts.
    let file = json!({"conv": conv, "client_msg_id": "f1", "kind": "file",
        "content": {"file_id": "file_981726", "file_name": "plan.xlsx", "file_size": 152617, "file_type": "xlsx"}});
    call(&own.ws, "send", file).await;
    call(
        &own.ws,
        "send",
        json!({"conv": conv, "client_msg_id": "rp1", "kind": "red_packet",
        "content": {"red_packet_id": "rp_1", "title": "Congrats"}}),
    )
    .await;
    assert_eq!(
        refused(
            &own.ws,
            "send",
            json!({"conv": conv, "client_msg_id": "f2", "kind": "file", "content": {"bytes": "AAAA"}})
        )
        .await,
        "BAD_REQUEST",
        "a file message is a reference, not a blob"
    );
    // "Recalled quoted message": cat quotes a message that is then recalled.
    let quoted = say(&own.ws, &conv, "quoted").await;
    let qid = quoted["message_id"].as_str().unwrap().to_owned();
    call(
        &cat.ws,
        "send",
        json!({"conv": conv, "client_msg_id": "q1",
        "content": {"text": "replying", "quote": {"message_id": qid, "summary": "quoted"}}}),
    )
    .await;
    call(&own.ws, "recall", json!({"conv": conv, "message_id": qid})).await;

    // Page through everything while new messages keep arriving: no
    // duplicates, no skips, the same cursor gives the same range.
    let mut seen = Vec::new();
    let mut before: Option<u64> = None;
    let mut writes = 0;
    loop {
        let req = json!({"conv": conv, "before_seq": before, "limit": 4});
        let page: HistoryOk = own.ws.request("history", &req).await.unwrap();
        let again: HistoryOk = own.ws.request("history", &req).await.unwrap();
        if before.is_some() {
            let a: Vec<u64> = page.messages.iter().map(|m| m.msg_seq).collect();
            let b: Vec<u64> = again.messages.iter().map(|m| m.msg_seq).collect();
            assert_eq!(a, b, "the same cursor returns the same range");
        }
        seen.extend(page.messages.iter().map(|m| m.msg_seq));
        if writes < 5 {
            say(&own.ws, &conv, &format!("live-{writes}")).await;
            writes += 1;
        }
        if !page.has_more {
            assert!(page.next_cursor.is_none(), "short last page: no cursor");
            assert!(page.messages.len() <= 4);
            break;
        }
        before = page.next_cursor;
    }
    let head = seen[0];
    assert_eq!(seen, (1..=head).rev().collect::<Vec<_>>(), "every message once, newest first, none skipped");

    let all: HistoryOk =
        own.ws.request("history", &json!({"conv": conv, "before_seq": head + 1, "limit": 50})).await.unwrap();
    let by_seq = |s: u64| all.messages.iter().find(|m| m.msg_seq == s).unwrap().clone();
    assert_eq!(
        (by_seq(2).state.as_str(), &by_seq(2).content),
        ("recalled", &json!({})),
        "recalled first keeps its place"
    );
    let file = all.messages.iter().find(|m| m.kind == "file").unwrap();
    assert_eq!(file.content["file_name"], "plan.xlsx", "an expired file keeps its history summary");
    assert!(all.messages.iter().any(|m| m.kind == "red_packet" && m.content["red_packet_id"] == "rp_1"));
    let reply = all.messages.iter().find(|m| m.content["text"] == "replying").unwrap();
    assert_eq!(reply.state, "normal", "the quoting message is still served");
    assert_eq!(
        reply.content["quote"],
        json!({"message_id": qid, "recalled": true}),
        "the quote no longer carries content"
    );

    // "New member blocked from earlier history": joins now, forges cursors.
    let newcomer = ts.device("new", "phone").await;
    let join_seq = call(&own.ws, "conv.add", json!({"conv": conv, "user": "new"})).await["msg_seq"].as_u64().unwrap();
    for before in [None, Some(join_seq), Some(2), Some(1)] {
        let h: HistoryOk = newcomer.ws.request("history", &json!({"conv": conv, "before_seq": before})).await.unwrap();
        assert!(h.messages.iter().all(|m| m.msg_seq >= join_seq), "before_seq {before:?} reached before the join");
    }
    assert_eq!(refused(&newcomer.ws, "history", json!({"conv": "g-none"})).await, "NOT_FOUND");
    ts.user("out").await;
    let outsider = ts.device("out", "phone").await;
    assert_eq!(refused(&outsider.ws, "history", json!({"conv": conv})).await, "NOT_MEMBER");
    assert_eq!(refused(&outsider.ws, "conv.sync", json!({"conv": conv})).await, "NOT_MEMBER");
    ts.stop().await;
}

/// Seed 002 §8 for `conv.sync`: paging under writes reaches the head with
/// nothing repeated or skipped; CURSOR_AHEAD; EPOCH_CHANGED after an admin
/// epoch bump; and the negative control: offset paging duplicates rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conv_sync_validation_table() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let ben = ts.device("ben", "phone").await;
    let conv = group(&ann.ws, &["ben"]).await;
    for i in 0..30 {
        say(&ann.ws, &conv, &format!("pre-{i}")).await;
    }
    let writer = {
        let (ws, conv) = (ann.ws.clone(), conv.clone());
        tokio::spawn(async move {
            for i in 0..60 {
                ws.request_value(
                    "send",
                    json!({"conv": conv, "client_msg_id": format!("w{i}"), "content": {"text": "w"}}),
                )
                .await
                .unwrap();
            }
        })
    };
    let mut after = 0;
    let mut got: Vec<u64> = Vec::new();
    let mut epoch;
    loop {
        let page: ConvSyncOk =
            ben.ws.request("conv.sync", &json!({"conv": conv, "after": after, "limit": 7})).await.unwrap();
        epoch = Some(page.epoch);
        for e in &page.events {
            assert!(e.msg_seq > after && e.msg_seq <= page.head);
            got.push(e.msg_seq);
        }
        after = page.next_after;
        if !page.has_more && writer.is_finished() && after == 91 {
            break;
        }
        if !page.has_more {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    writer.await.unwrap();
    assert_eq!(got, (1..=91).collect::<Vec<_>>(), "paging under writes: no duplicate, no skip, up to the head");

    assert_eq!(refused(&ben.ws, "conv.sync", json!({"conv": conv, "after": 92})).await, "CURSOR_AHEAD");
    let admin = reqwest::Client::new();
    let bumped: Value = admin
        .post(format!("{}/v1/admin/conv/epoch", ts.running().url()))
        .bearer_auth(ADMIN)
        .json(&json!({"conv": conv}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(bumped["epoch"], epoch.unwrap() + 1);
    assert_eq!(
        refused(&ben.ws, "conv.sync", json!({"conv": conv, "after": 10, "epoch": epoch})).await,
        "EPOCH_CHANGED"
    );
    let fresh: ConvSyncOk =
        ben.ws.request("conv.sync", &json!({"conv": conv, "after": 0, "epoch": bumped["epoch"]})).await.unwrap();
    assert_eq!((fresh.events[0].msg_seq, fresh.trimmed), (1, false));

    // Negative control: OFFSET paging newest-first while rows are inserted
    // between pages returns some rows twice.
    let db = rusqlite::Connection::open_with_flags(
        ts.dir.path().join(tidemark_sqlite::DB_FILE),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let mut offset_rows: Vec<i64> = Vec::new();
    for page in 0..3 {
        let mut stmt = db
            .prepare("SELECT msg_seq FROM messages WHERE conv_id = ?1 ORDER BY msg_seq DESC LIMIT 10 OFFSET ?2")
            .unwrap();
        let rows: Vec<i64> =
            stmt.query_map(rusqlite::params![conv, page * 10], |r| r.get(0)).unwrap().map(|r| r.unwrap()).collect();
        offset_rows.extend(rows);
        for i in 0..3 {
            say(&ann.ws, &conv, &format!("ins-{page}-{i}")).await;
        }
    }
    let dups = offset_rows.len() - offset_rows.iter().collect::<std::collections::BTreeSet<_>>().len();
    assert!(dups >= 3, "offset paging under inserts repeats rows ({dups} repeated)");
    ts.stop().await;
}

/// E2: edits and reactions are versioned and idempotent; a stale
/// base_version is a CONFLICT; every event carries the version it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_and_reactions_are_versioned() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let mut ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let m = say(&ann.ws, &conv, "draft").await;
    let id = m["message_id"].as_str().unwrap().to_owned();
    let e1 = call(
        &ann.ws,
        "edit",
        json!({"conv": conv, "message_id": id, "content": {"text": "final"}, "base_version": 1, "client_msg_id": "e1"}),
    )
    .await;
    assert_eq!(e1["version"], 2);
    let retry = call(
        &ann.ws,
        "edit",
        json!({"conv": conv, "message_id": id, "content": {"text": "final"}, "base_version": 1, "client_msg_id": "e1"}),
    )
    .await;
    assert_eq!(
        (retry["msg_seq"].clone(), retry["version"].clone()),
        (e1["msg_seq"].clone(), json!(2)),
        "a retried edit is the same event"
    );
    assert_eq!(
        refused(&ann.ws, "edit", json!({"conv": conv, "message_id": id, "content": {"text": "x"}, "base_version": 1}))
            .await,
        "CONFLICT"
    );
    assert_eq!(
        refused(&ben.ws, "edit", json!({"conv": conv, "message_id": id, "content": {"text": "x"}, "base_version": 2}))
            .await,
        "FORBIDDEN"
    );
    let r1 = call(&ben.ws, "react", json!({"conv": conv, "message_id": id, "reaction": "👍", "op": "add"})).await;
    assert_eq!((r1["version"].as_u64(), r1["changed"].as_bool()), (Some(3), Some(true)));
    let r2 = call(&ben.ws, "react", json!({"conv": conv, "message_id": id, "reaction": "👍", "op": "add"})).await;
    assert_eq!(
        (r2["version"].as_u64(), r2["changed"].as_bool(), r2["msg_seq"].clone()),
        (Some(3), Some(false), r1["msg_seq"].clone())
    );
    assert_eq!(
        refused(&ben.ws, "react", json!({"conv": conv, "message_id": id, "reaction": "👍", "op": "toggle"})).await,
        "BAD_REQUEST"
    );
    ben.sync_until(3, 10).await;
    let versions: Vec<(String, u64)> = ben
        .log
        .iter()
        .map(|e| (e.kind.clone(), e.message.as_ref().unwrap().content["version"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(versions[1..], [("edit".to_string(), 2), ("reaction".to_string(), 3)]);
    // The original's envelope is read at sync time: already at the latest
    // version, so the older edit event (version 2) must not override it.
    let original = ben.log[0].message.as_ref().unwrap();
    assert_eq!((original.version, original.state.as_str()), (3, "edited"));
    assert_eq!(original.content["text"], "final");
    assert_eq!(original.reactions.get("👍"), Some(&vec!["ben".to_string()]));
    ts.stop().await;
}

/// E3 and R1–R2: settings, delete-for-me and the read cursor are user
/// events for that user's devices only; the read cursor reaches the other
/// device; sync ACKs, delivery and read stay separate facts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_user_events_reach_only_that_users_devices() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let mut ann = ts.device("ann", "phone").await;
    let mut phone = ts.device("ben", "phone").await;
    let mut laptop = ts.device("ben", "laptop").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let m1 = say(&ann.ws, &conv, "one").await;
    say(&ann.ws, &conv, "two").await;
    phone.sync_until(2, 10).await;
    laptop.sync_until(2, 10).await;
    let store = &ts.running().state.store;
    let laptop_ack = store.device("ben", "laptop").await.unwrap().unwrap().cursor.acked_sync_seq;

    let r = call(&phone.ws, "read", json!({"conv": conv, "read_to_seq": 2})).await;
    assert_eq!((r["read_seq"].as_u64(), r["unread"].as_u64()), (Some(2), Some(0)));
    call(&phone.ws, "conv.settings", json!({"conv": conv, "muted": true, "pinned": true})).await;
    call(&phone.ws, "message.delete", json!({"conv": conv, "message_id": m1["message_id"]})).await;
    let delivered = call(&phone.ws, "delivery.ack", json!({"message_ids": [m1["message_id"]]})).await;
    assert_eq!(delivered["recorded"], 1);
    assert_eq!(refused(&phone.ws, "delivery.ack", json!({"message_ids": ["m-not-mine"]})).await, "NOT_FOUND");

    laptop.sync_until(5, 10).await;
    let kinds: Vec<&str> = laptop.log[2..].iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, vec!["read", "settings", "delete"], "the other device learns all three");
    assert_eq!(laptop.log[2].data.as_ref().unwrap()["read_seq"], 2);
    assert_eq!(laptop.log[3].data.as_ref().unwrap()["muted"], true);
    let list = call(&laptop.ws, "conv.list", json!({})).await;
    assert_eq!(list["conversations"][0]["read_seq"], 2, "the read cursor is the user's, not the device's");
    assert_eq!(list["conversations"][0]["pinned"], true);
    // None of it moved a device cursor (R1) ...
    assert_eq!(store.device("ben", "laptop").await.unwrap().unwrap().cursor.acked_sync_seq, laptop_ack.max(5));
    // ... nor reached ann.
    tokio::time::sleep(Duration::from_millis(200)).await;
    ann.sync_batch(10).await;
    assert!(ann.log.iter().all(|e| e.kind == "message"), "ann sees no per-user event of ben");
    let h: HistoryOk = phone.ws.request("history", &json!({"conv": conv})).await.unwrap();
    assert_eq!(h.messages.last().unwrap().state, "deleted", "deleted for ben");
    let h: HistoryOk = ann.ws.request("history", &json!({"conv": conv})).await.unwrap();
    assert_eq!(h.messages.last().unwrap().content["text"], "one", "still there for ann");
    ts.stop().await;
}

/// R3: unread counts can be rebuilt from the facts; the rebuild reports
/// the drift it repaired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_rebuild_reports_and_repairs_drift() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let mut ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    for i in 0..3 {
        say(&ann.ws, &conv, &format!("{i}")).await;
    }
    ben.sync_until(3, 10).await;
    let rebuild = || async {
        reqwest::Client::new()
            .post(format!("{}/v1/admin/unread/rebuild", ts.running().url()))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };
    assert_eq!(rebuild().await["drifted"], 0, "the materialised counts match the facts");
    // Corrupt one projection behind the server's back.
    let db = rusqlite::Connection::open(ts.dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    db.execute("UPDATE user_convs SET unread = 42 WHERE user_id = 'ben'", []).unwrap();
    let report = rebuild().await;
    assert_eq!(report["drifted"], 1);
    let list = call(&ben.ws, "conv.list", json!({})).await;
    assert_eq!(list["conversations"][0]["unread"], 3, "repaired from the facts");
    ts.stop().await;
}

/// O3 on a live server: `POST /v1/admin/reconcile` finds a user event lost
/// behind the server's back and an ACK set above the head; a dry run
/// changes nothing, a run re-enqueues the lost fan-out (the relay delivers
/// it again, once) and leaves the ACK to a person; a second run repairs
/// nothing. Without the admin token it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_endpoint_repairs_a_lost_event_once_and_reports_an_ack_above_the_head() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let mut ben = ts.device("ben", "phone").await;
    let conv = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(say(&ann.ws, &conv, &format!("{i}")).await["message_id"].as_str().unwrap().to_owned());
    }
    ben.sync_until(3, 10).await;
    let reconcile = |token: &'static str, body: Value| {
        let url = format!("{}/v1/admin/reconcile", ts.running().url());
        async move { reqwest::Client::new().post(url).bearer_auth(token).json(&body).send().await.unwrap() }
    };
    let refused = reconcile("not-the-token", json!({})).await;
    assert_eq!(refused.status(), 401);
    let clean: Value = reconcile(ADMIN, json!({})).await.json().await.unwrap();
    assert_eq!((clean["found"].as_u64(), clean["messages_checked"].as_u64()), (Some(0), Some(3)), "{clean}");

    let db = rusqlite::Connection::open(ts.dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    db.execute("DELETE FROM user_events WHERE user_id = 'ben' AND message_id = ?1", [&ids[1]]).unwrap();
    db.execute("UPDATE devices SET acked_sync_seq = 500 WHERE user_id = 'ann'", []).unwrap();
    let dry: Value = reconcile(ADMIN, json!({"dry_run": true})).await.json().await.unwrap();
    assert_eq!(
        (dry["found"].as_u64(), dry["repaired"].as_u64(), dry["reported"].as_u64()),
        (Some(2), Some(0), Some(1))
    );
    let run: Value = reconcile(ADMIN, json!({})).await.json().await.unwrap();
    assert_eq!(
        (run["found"].as_u64(), run["repaired"].as_u64(), run["reported"].as_u64()),
        (Some(2), Some(1), Some(1))
    );
    let findings = run["findings"].as_array().unwrap();
    let lost = findings.iter().find(|f| f["relation"] == "fanout").unwrap();
    assert_eq!(
        (&lost["user"], &lost["message_id"], &lost["repair"]),
        (&json!("ben"), &json!(ids[1]), &json!("requeue"))
    );
    let ack = findings.iter().find(|f| f["relation"] == "ack_head").unwrap();
    assert_eq!((&ack["user"], &ack["stored"], &ack["repaired"]), (&json!("ann"), &json!(500), &json!(false)));
    // The relay delivers the re-enqueued item: ben's log holds it again.
    ben.sync_until(4, 10).await;
    assert_eq!(
        ben.log[3].message.as_ref().map(|m| m.message_id.as_str()),
        Some(ids[1].as_str()),
        "the lost message, again"
    );
    let count = |sql: &str| db.query_row(sql, [], |r| r.get::<_, i64>(0)).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while count("SELECT COUNT(*) FROM outbox") > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the relay never ran the re-enqueued item");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let again: Value = reconcile(ADMIN, json!({})).await.json().await.unwrap();
    assert_eq!((again["found"].as_u64(), again["repaired"].as_u64()), (Some(1), Some(0)), "{again}");
    assert_eq!(count("SELECT COUNT(*) FROM user_events WHERE user_id = 'ben' AND period_id <> 0"), 3);
    assert_eq!(count("SELECT acked_sync_seq FROM devices WHERE user_id = 'ann'"), 500, "left to a person");
    ts.stop().await;
}

/// Visibility of control events and idempotency keys: a newcomer never
/// receives an edit of a message from before its join; a recall also wipes
/// the content that earlier edit events carried; an own reply clears the
/// unread below it; an idempotency key names one operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_events_follow_the_targets_visibility() {
    let ts = TestServer::start().await;
    for u in ["own", "cat", "new"] {
        ts.user(u).await;
    }
    let own = ts.device("own", "phone").await;
    let mut cat = ts.device("cat", "phone").await;
    let mut newcomer = ts.device("new", "phone").await;
    let created =
        call(&own.ws, "conv.create", json!({"kind": "group", "members": ["cat"], "client_msg_id": "g-1"})).await;
    let retried =
        call(&own.ws, "conv.create", json!({"kind": "group", "members": ["cat"], "client_msg_id": "g-1"})).await;
    assert_eq!(created["conv"], retried["conv"], "a retried create is the same group");
    let conv = created["conv"].as_str().unwrap().to_owned();
    let m = say(&own.ws, &conv, "draft").await; // 2
    let id = m["message_id"].as_str().unwrap().to_owned();
    let join = call(&own.ws, "conv.add", json!({"conv": conv, "user": "new"})).await["msg_seq"].as_u64().unwrap(); // 3
    let again = call(&own.ws, "conv.add", json!({"conv": conv, "user": "new"})).await["msg_seq"].as_u64().unwrap();
    assert_eq!(join, again, "adding a member twice changes nothing");
    call(
        &own.ws,
        "edit",
        json!({"conv": conv, "message_id": id, "content": {"text": "EDITED-SECRET"}, "base_version": 1}),
    )
    .await; // 4
    say(&own.ws, &conv, "for-all").await; // 5
    newcomer.sync_until(2, 10).await; // join + for-all
    tokio::time::sleep(Duration::from_millis(150)).await;
    newcomer.sync_batch(10).await;
    let seen: Vec<u64> = conv_log(&newcomer, &conv).iter().map(|e| e.0).collect();
    assert_eq!(seen, vec![3, 5], "no edit of a message from before the join");
    let (synced, _) = conv_sync_all(&newcomer.ws, &conv, 0, 10).await;
    assert_eq!(synced, vec![3, 5]);
    let h: HistoryOk = newcomer.ws.request("history", &json!({"conv": conv})).await.unwrap();
    assert!(!serde_json::to_string(&h).unwrap().contains("EDITED-SECRET"));

    // The recall wipes the edit event's content too, on every path.
    call(&own.ws, "recall", json!({"conv": conv, "message_id": id})).await; // 6
    cat.sync_until(6, 10).await;
    assert!(!serde_json::to_string(&cat.log).unwrap().contains("EDITED-SECRET") || cat.log.len() < 6);
    let mut fresh = ts.device("cat", "tablet").await;
    fresh.sync_until(6, 10).await;
    assert!(
        !serde_json::to_string(&fresh.log).unwrap().contains("EDITED-SECRET"),
        "no path serves edited text of a recalled message"
    );
    let (all, _) = conv_sync_all(&cat.ws, &conv, 0, 10).await;
    assert_eq!(all, vec![1, 2, 3, 4, 5, 6]);
    let page: ConvSyncOk = cat.ws.request("conv.sync", &json!({"conv": conv, "after": 0})).await.unwrap();
    assert!(!serde_json::to_string(&page).unwrap().contains("EDITED-SECRET"));

    // An own reply marks what it answers as read.
    let unread = |v: Value| {
        v["conversations"].as_array().unwrap().iter().find(|c| c["conv"] == conv.as_str()).unwrap()["unread"].clone()
    };
    assert_eq!(unread(call(&cat.ws, "conv.list", json!({})).await), 1, "for-all is unread (the recalled one is not)");
    say(&cat.ws, &conv, "reply").await;
    cat.sync_until(7, 10).await;
    assert_eq!(unread(call(&cat.ws, "conv.list", json!({})).await), 0);
    assert_eq!(call(&cat.ws, "read", json!({"conv": conv, "read_to_seq": 1})).await["unread"], 0);

    // One idempotency key, one operation: a taken key is a conflict.
    assert_eq!(
        refused(&own.ws, "recall", json!({"conv": conv, "message_id": id, "client_msg_id": "for-all"})).await,
        "CONFLICT"
    );
    let other = own.ws.conv_create_direct("cat").await.unwrap().conv;
    assert_eq!(
        refused(&own.ws, "send", json!({"conv": other, "client_msg_id": "for-all", "content": {"text": "x"}})).await,
        "CONFLICT"
    );
    assert_eq!(refused(&cat.ws, "read", json!({"conv": "g-nope", "read_to_seq": 1})).await, "NOT_FOUND");
    ts.stop().await;
}

/// `conv.list` pages (issue 19): with `limit`/`after` one page in `conv`
/// order with `has_more` and `next_after`; following them lists every
/// conversation once; a request with no paging field gets the whole list
/// in list order and no paging field back, as before paging existed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conv_list_pages_by_conv_and_an_unpaged_request_gets_everything() {
    let ts = TestServer::start().await;
    ts.user("ann").await;
    let peers = ["pa", "pb", "pc", "pd", "pe"];
    for p in peers {
        ts.user(p).await;
    }
    let ann = ts.device("ann", "phone").await;
    for p in peers {
        ann.ws.conv_create_direct(p).await.unwrap();
    }
    let whole = call(&ann.ws, "conv.list", json!({})).await;
    assert!(whole.get("has_more").is_none() && whole.get("next_after").is_none(), "{whole}");
    let mut listed: Vec<String> =
        whole["conversations"].as_array().unwrap().iter().map(|c| c["conv"].as_str().unwrap().to_owned()).collect();
    assert_eq!(listed.len(), 5);
    let mut paged = Vec::new();
    let mut after = Value::Null;
    let mut pages = 0;
    loop {
        let mut req = json!({"limit": 2});
        if !after.is_null() {
            req["after"] = after.clone();
        }
        let page = call(&ann.ws, "conv.list", req).await;
        pages += 1;
        let convs = page["conversations"].as_array().unwrap();
        assert!(convs.len() <= 2, "{page}");
        paged.extend(convs.iter().map(|c| c["conv"].as_str().unwrap().to_owned()));
        if page["has_more"] == false {
            assert!(page.get("next_after").is_none(), "{page}");
            break;
        }
        assert_eq!(page["next_after"], convs.last().unwrap()["conv"], "next_after is the page's last conv");
        after = page["next_after"].clone();
    }
    assert_eq!(pages, 3);
    let mut sorted = paged.clone();
    sorted.sort();
    assert_eq!(paged, sorted, "pages come in conv order");
    listed.sort();
    assert_eq!(paged, listed, "every conversation once");
    for bad in [json!({"limit": 0}), json!({"limit": tidemark_proto::CONV_LIST_LIMIT_MAX + 1})] {
        assert!(refused(&ann.ws, "conv.list", bad).await.contains("BAD_REQUEST"));
    }
    ts.stop().await;
}
