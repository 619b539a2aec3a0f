//! Two devices of one user through the SDK (D1, K1, R1–R2): what one sends
//! appears on the other, both end with the same conversation, each device's
//! ACK moves only its own cursor, no ACK marks anything read, and a read on
//! one device moves the user's read position on both.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_on_one_device_appears_on_the_other_and_acks_stay_per_device() {
    let h = Harness::start().await;
    h.user("alice").await;
    h.user("bob").await;
    let alice = h.ready("alice", "phone").await;
    let phone = h.ready("bob", "phone").await;
    let desktop = h.ready("bob", "desktop").await;
    let conv = alice.create_direct("bob").await.unwrap();

    // The phone sends; the desktop (and Alice) receive it.
    let (seq, _) = send_ok(&phone, &conv, "sent from the phone").await;
    assert_eq!(seq, 1);
    let on_desktop = wait_messages(&desktop, &conv, 1).await;
    assert_eq!(
        view(&on_desktop),
        vec![(1, on_desktop[0].message_id.clone(), "bob".into(), "sent from the phone".into())]
    );
    wait_messages(&alice, &conv, 1).await;
    // The sender's own device gets its message through the log too, and
    // both devices ACK their own cursor.
    h.wait_server_ack("bob", "phone", 1).await;
    h.wait_server_ack("bob", "desktop", 1).await;

    // The desktop goes away; the phone's ACKs do not move it.
    desktop.stop().await;
    send_ok(&phone, &conv, "phone 2").await;
    send_ok(&alice, &conv, "alice 3").await;
    wait_messages(&phone, &conv, 3).await;
    h.wait_server_ack("bob", "phone", 3).await;
    assert_eq!(h.server_ack("bob", "desktop").await.1, 1, "the phone's ACK moved the desktop's cursor");

    // The phone goes away; the desktop catches up, and its ACK does not
    // move the phone's.
    phone.stop().await;
    send_ok(&alice, &conv, "alice 4").await;
    h.wait_log("bob", 4).await;
    desktop.start().await.unwrap();
    wait_messages(&desktop, &conv, 4).await;
    h.wait_server_ack("bob", "desktop", 4).await;
    assert_eq!(h.server_ack("bob", "phone").await.1, 3, "the desktop's ACK moved the phone's cursor");

    // Back together, both devices hold the same conversation.
    phone.start().await.unwrap();
    let on_phone = wait_messages(&phone, &conv, 4).await;
    let on_desktop = desktop.messages(&conv).await.unwrap();
    assert_eq!(view(&on_phone), view(&on_desktop));
    assert_eq!(on_phone.iter().map(|m| m.msg_seq).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    for c in [&phone, &desktop] {
        let summary = c.conversation(&conv).await.unwrap().unwrap();
        assert_eq!((summary.contiguous_msg_seq, summary.last_msg_seq), (4, 4));
        // Bob's read state is not a device ACK (R1): Alice's message after
        // Bob's last one is unread on both devices, whatever they ACKed.
        assert_eq!((summary.read_seq, summary.unread), (2, 2));
    }
    let server_view = phone.server_conversations().await.unwrap();
    assert_eq!((server_view[0].read_seq, server_view[0].unread), (2, 2), "local unread agrees with the server");

    // The read position is the user's (R2): read on the phone, it moves on
    // the desktop too, through the `read` event of Bob's log.
    phone.mark_read(&conv, 4).await.unwrap();
    for c in [&phone, &desktop] {
        c.wait_for(WAIT, || async { Ok(c.conversation(&conv).await?.is_some_and(|s| s.read_seq == 4)) })
            .await
            .unwrap_or_else(|e| panic!("{}: read position never reached 4: {e}", c.config().device_id));
        assert_eq!(c.conversation(&conv).await.unwrap().unwrap().unread, 0);
    }
    let server_view = desktop.server_conversations().await.unwrap();
    assert_eq!((server_view[0].read_seq, server_view[0].unread), (4, 0));

    for c in [alice, phone, desktop] {
        c.stop().await;
    }
}
