//! Mentions through the SDK against a real server (issue 18): a typed
//! send with mentions reaches the other members, whose local store counts
//! the mentions apart from unread, the change stream flags the applied
//! message that mentions the user, `mark_read` clears only what it covers,
//! and the server's `conv.list` agrees with the local count.

mod common;

use common::*;
use tidemark_client::{Change, Mentions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mentions_are_counted_locally_flagged_on_the_stream_and_cleared_up_to_the_read() {
    let h = Harness::start().await;
    for u in ["ann", "ben", "cat"] {
        h.user(u).await;
    }
    let ann = h.ready("ann", "phone").await;
    let ben = h.ready("ben", "phone").await;
    let cat = h.ready("cat", "phone").await;
    let g = ann.create_group(&["ben", "cat"]).await.unwrap().conv;
    let mut ben_changes = ben.subscribe();

    let named = Mentions { users: vec!["ben".into()], all: false };
    ann.send_mentioning(&g, "text", serde_json::json!({"text": "@ben hi"}), named).await.unwrap();
    ann.send(&g, serde_json::json!({"text": "plain"})).await.unwrap();
    let everyone = Mentions { users: Vec::new(), all: true };
    ann.send_mentioning(&g, "text", serde_json::json!({"text": "@all"}), everyone).await.unwrap();
    let held = wait_messages(&ben, &g, 3).await;
    let flagged: Vec<(u64, bool)> = held.iter().map(|m| (m.msg_seq, m.mention_all)).collect();
    assert_eq!(flagged, vec![(2, false), (3, false), (4, true)]);
    assert_eq!(held[0].mentions, vec!["ben".to_string()]);

    // The stream says which applied messages mention ben.
    let seen = collect_until(
        &mut ben_changes,
        |c| matches!(c, Change::PageApplied(p) if p.messages.iter().any(|m| m.msg_seq == 4)),
    )
    .await;
    let mentioned: Vec<u64> = seen
        .iter()
        .filter_map(|c| if let Change::PageApplied(p) = c { Some(p.messages.clone()) } else { None })
        .flatten()
        .filter(|m| m.mentioned)
        .map(|m| m.msg_seq)
        .collect();
    assert_eq!(mentioned, vec![2, 4], "{seen:?}");

    assert_eq!(local(&ben, &g).await, (3, 2));
    wait_messages(&cat, &g, 3).await;
    assert_eq!(local(&cat, &g).await, (3, 1), "cat is mentioned by everyone only");
    assert_eq!(local(&ann, &g).await, (0, 0), "never the sender");

    // A read up to the named mention leaves everyone's.
    ben.mark_read(&g, 3).await.unwrap();
    ben.wait_for(WAIT, || async { Ok(local(&ben, &g).await == (1, 1)) }).await.unwrap();
    let server = ben.server_conversations().await.unwrap().into_iter().find(|x| x.conv == g).unwrap();
    assert_eq!((server.unread, server.mentions), (1, 1), "the server agrees");
}

/// `(unread, mentions)` of `conv` in the local store.
async fn local(c: &tidemark_client::Client, conv: &str) -> (u64, u64) {
    let row = c.conversations().await.unwrap().into_iter().find(|x| x.conv == conv).unwrap();
    (row.unread, row.mentions)
}
