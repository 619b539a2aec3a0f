//! Receipts shown to others on a real server (issue 18): a member reads and
//! the others see the new position (R2); with private receipts they do
//! not, while the member's own devices still get the `read` event; a
//! member who left is not shown. Delivery receipts (R1) come back to the
//! sender of a direct conversation's message once the peer's device
//! recorded it.

mod common;

use common::{code, TestServer};
use serde_json::{json, Value};
use tidemark_client::proto::{ConvReceiptsOk, DeliveryReceiptsOk, ErrorCode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_see_each_others_read_positions_unless_private() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben", "cat", "dan"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let mut ben = ts.device("ben", "phone").await;
    let cat = ts.device("cat", "phone").await;
    let dan = ts.device("dan", "phone").await;
    let g: Value =
        ann.ws.request_value("conv.create", json!({"kind": "group", "members": ["ben", "cat"]})).await.unwrap();
    let g = g["conv"].as_str().unwrap().to_owned();
    for i in 0..3 {
        ann.send(&g, &format!("m{i}")).await;
    }
    ben.sync_until(4, 100).await;
    let receipts = |d: &common::Device, at: Option<u64>| {
        let body = json!({"conv": g, "msg_seq": at});
        let ws = d.ws.clone();
        async move { ws.request::<_, ConvReceiptsOk>("conv.receipts", &body).await }
    };
    let read_seq = |r: &ConvReceiptsOk, u: &str| r.members.iter().find(|m| m.user == u).map(|m| m.read_seq);

    let before = receipts(&ann, Some(4)).await.unwrap();
    assert_eq!(read_seq(&before, "ben"), Some(0));
    assert_eq!(before.read_count, Some(0));
    let read: Value = ben.ws.request_value("read", json!({"conv": g, "read_to_seq": 4})).await.unwrap();
    assert_eq!(read["read_seq"], 4);
    let after = receipts(&ann, Some(4)).await.unwrap();
    assert_eq!(read_seq(&after, "ben"), Some(4), "the others see ben's new position");
    assert_eq!(after.read_count, Some(1));

    // Private: hidden from others, counted, still ben's own.
    let p: Value = ben.ws.request_value("privacy.set", json!({"private_receipts": true})).await.unwrap();
    assert_eq!(p["private_receipts"], true);
    ben.ws.request_value("read", json!({"conv": g, "read_to_seq": 4})).await.unwrap();
    let hidden = receipts(&cat, Some(4)).await.unwrap();
    assert_eq!(read_seq(&hidden, "ben"), None, "private receipts are not shown");
    // Of the members shown to cat, ann read 4 (her own messages move her
    // read position); ben read it too, but is not counted.
    assert_eq!((hidden.hidden, hidden.read_count), (1, Some(1)));
    assert_eq!(read_seq(&receipts(&ben, None).await.unwrap(), "ben"), Some(4), "ben still sees his own");
    let before_sync = ben.log.len();
    ben.sync_batch(100).await;
    assert!(
        ben.log[before_sync..].iter().any(|e| e.kind == "read" && e.conv == g),
        "the user's own devices still sync the read position (R2)"
    );
    ben.ws.request_value("privacy.set", json!({"private_receipts": false})).await.unwrap();

    // A member who leaves is no longer shown, nor may they ask.
    let left: Value = ben.ws.request_value("conv.leave", json!({"conv": g})).await.unwrap();
    assert_eq!(left["t"], "conv.leave.ok", "{left}");
    let gone = receipts(&ann, None).await.unwrap();
    assert_eq!(read_seq(&gone, "ben"), None, "a departed member's position is not shown");
    assert_eq!(gone.hidden, 0);
    assert_eq!(code(receipts(&ben, None).await), ErrorCode::NotMember);
    assert_eq!(code(receipts(&dan, None).await), ErrorCode::NotMember);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sender_reads_delivery_receipts_of_a_direct_conversation() {
    let ts = TestServer::start().await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let ann = ts.device("ann", "phone").await;
    let mut ben = ts.device("ben", "phone").await;
    let c = ann.ws.conv_create_direct("ben").await.unwrap().conv;
    let m1 = ann.send(&c, "m1").await.message_id;
    let m2 = ann.send(&c, "m2").await.message_id;
    let theirs = ben.send(&c, "m3").await.message_id;
    ben.sync_until(3, 100).await;
    let ask = |ids: Vec<String>| {
        let ws = ann.ws.clone();
        let body = json!({"conv": c, "message_ids": ids});
        async move { ws.request::<_, DeliveryReceiptsOk>("delivery.receipts", &body).await }
    };
    let none = ask(vec![m1.clone(), m2.clone()]).await.unwrap();
    assert!(none.receipts.iter().all(|r| r.delivered_at.is_none()), "{none:?}");
    let ack: Value = ben.ws.request_value("delivery.ack", json!({"message_ids": [m1]})).await.unwrap();
    assert_eq!(ack["recorded"], 1);
    let some = ask(vec![m1.clone(), m2.clone()]).await.unwrap();
    assert_eq!(some.receipts[0].message_id, m1);
    assert!(some.receipts[0].delivered_at.is_some(), "R1: delivered to ben's device");
    assert!(some.receipts[1].delivered_at.is_none(), "m2 was not acknowledged");
    assert_eq!(code(ask(vec![theirs]).await), ErrorCode::Forbidden, "only the sender reads them");
    assert_eq!(code(ask(vec!["mnope".into()]).await), ErrorCode::NotFound);
    ts.stop().await;
}
