//! The transport's request table (`ws.rs`): a request made on a connection
//! that has ended fails with `Closed` at once. It used to be registered
//! after the reader's last sweep of the table and then wait for a reply no
//! reader would ever route (for as long as the caller's own timeout).

mod common;

use common::*;
use tidemark_client::{ClientError, ServerEvent, WsConn};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_a_connection_the_server_closed_fails_at_once() {
    let h = Harness::start().await;
    h.user("alice").await;
    let login = h.http.login("alice", PASSWORD, "alice-phone").await.unwrap();
    let ws_url = format!("{}/v1/ws", h.url.replacen("http://", "ws://", 1));
    let (first, mut events) = WsConn::connect(&ws_url, &login.access_token).await.unwrap();
    first.conv_list().await.expect("a request on the live connection is answered");

    // A second connection of the same device supersedes the first: the
    // server kicks it and closes it, and its reader ends.
    let (_second, _second_events) = WsConn::connect(&ws_url, &login.access_token).await.unwrap();
    loop {
        match tokio::time::timeout(WAIT, events.recv()).await {
            Ok(Some(ServerEvent::Closed)) => break,
            Ok(Some(_)) => continue,
            other => panic!("the superseded connection never closed: {other:?}"),
        }
    }

    // The writer task still runs (it ends on its next failed write), so the
    // frame is accepted into its queue; the reply can never come.
    let reply = tokio::time::timeout(WAIT, first.conv_list())
        .await
        .expect("a request on a closed connection must not wait for a reply");
    assert_eq!(reply.unwrap_err(), ClientError::Closed);
    // And so does every later one.
    assert_eq!(first.conv_list().await.unwrap_err(), ClientError::Closed);
}
