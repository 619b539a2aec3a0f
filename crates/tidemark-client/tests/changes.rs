//! The change stream is in commit order (issue 17): every change that
//! reports a local commit is emitted under the store lock right after that
//! commit. Two devices of one user send concurrently into one conversation
//! while the other user's device receives: on each stream, every entry is
//! queued before it is accepted, and each conversation's cursor moves as
//! one chain (`from` is where the previous move ended), never back and
//! never with a hole, whichever engine task committed it.

mod common;

use std::collections::{BTreeMap, HashSet};

use common::*;
use tidemark_client::{Change, Changes};

/// Checks one device's stream; returns how far each conversation's cursor
/// got.
fn check_stream(who: &str, seen: &[Change]) -> BTreeMap<String, u64> {
    let mut queued = HashSet::new();
    let mut cursor: BTreeMap<String, u64> = BTreeMap::new();
    for c in seen {
        match c {
            Change::OutboxQueued { client_msg_id, .. } => {
                queued.insert(client_msg_id.clone());
            }
            Change::OutboxAccepted { client_msg_id, .. } => {
                assert!(queued.contains(client_msg_id), "{who}: {client_msg_id} accepted before it was queued");
            }
            Change::CursorMoved(m) => {
                let at = cursor.entry(m.conv.clone()).or_insert(m.from);
                assert_eq!(m.from, *at, "{who}: {} moved from {} after a move to {at}: {seen:?}", m.conv, m.from);
                assert!(m.to > m.from, "{who}: a move must go forward: {m:?}");
                *at = m.to;
            }
            Change::Lagged { missed } => panic!("{who}: lagged by {missed}; the test reads too slowly"),
            _ => {}
        }
    }
    cursor
}

const EACH: u64 = 30;

async fn burst(c: &tidemark_client::Client, conv: &str, tag: &str) {
    for i in 0..EACH {
        c.send(conv, serde_json::json!({ "text": format!("{tag}{i}") })).await.unwrap();
    }
}

async fn until_cursor(changes: &mut Changes, conv: &str, to: u64) -> Vec<Change> {
    collect_until(changes, |c| matches!(c, Change::CursorMoved(m) if m.conv == conv && m.to >= to)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_arrive_in_commit_order_across_devices_and_tasks() {
    let h = Harness::start().await;
    h.user("ann").await;
    h.user("ben").await;
    let phone = h.ready("ann", "phone").await;
    let laptop = h.ready("ann", "laptop").await;
    let ben = h.ready("ben", "phone").await;
    let conv = phone.create_direct("ben").await.unwrap();
    let (mut on_phone, mut on_laptop, mut on_ben) = (phone.subscribe(), laptop.subscribe(), ben.subscribe());
    tokio::join!(burst(&phone, &conv, "p"), burst(&laptop, &conv, "l"));
    let total = 2 * EACH;
    let seen_ben = until_cursor(&mut on_ben, &conv, total).await;
    let seen_phone = until_cursor(&mut on_phone, &conv, total).await;
    let seen_laptop = until_cursor(&mut on_laptop, &conv, total).await;
    for (who, seen) in [("ben", &seen_ben), ("ann/phone", &seen_phone), ("ann/laptop", &seen_laptop)] {
        assert_eq!(check_stream(who, seen).get(&conv), Some(&total), "{who}");
    }
    for c in [phone, laptop, ben] {
        c.stop().await;
    }
}
