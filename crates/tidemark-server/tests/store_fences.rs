//! An operator's command run straight on the store by another process
//! (`tidemark user logout`, `tidemark device revoke`, with `--data`) reaches
//! a running single node: the write moves the store's `fences_version`, the
//! node's fence check (every `FENCE_REFRESH_EVERY`) sees it, reloads the
//! fences and kicks the ended connections.

mod common;

use std::time::Duration;

use common::*;
use tidemark_client::ServerEvent;
use tidemark_server::ServerConfig;
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

/// The next `kicked` reason on `device`'s socket, waiting at most `within`.
async fn kicked(device: &mut Device, within: Duration) -> Option<String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, device.events.recv()).await {
            Ok(Some(ServerEvent::Kicked { reason })) => return Some(reason),
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return None,
        }
    }
}

#[tokio::test]
async fn ends_written_on_the_store_by_another_process_reach_a_running_single_node() {
    let ts = TestServer::start_with(ServerConfig::default()).await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let mut phone = ts.device("ann", "phone").await;
    let mut laptop = ts.device("ben", "laptop").await;
    // Another process's store on the same files, as `tidemark user … --data`.
    let other = SqliteStore::open(ts.dir.path()).unwrap();
    let now = tidemark_server::util::now_ms();
    assert!(other.end_sessions("ann", Some("phone"), now + 1).await.unwrap());
    assert!(other.revoke_device("ben", "laptop", now).await.unwrap());
    // Within a few fence periods (bounded, not a sleep that hopes).
    let bound = Duration::from_secs(15);
    assert_eq!(kicked(&mut phone, bound).await.as_deref(), Some("logged_out"));
    assert_eq!(kicked(&mut laptop, bound).await.as_deref(), Some("device_revoked"));
    assert!(ts.running().state.fences.is_revoked("ben", "laptop"));
    ts.stop().await;
}

/// A frame the store refuses because the device opened a newer connection
/// this node never registered (P2) ends its connection at once, `kicked`
/// `superseded`. The newer epoch is committed here by another process's
/// store on the same files, as another node would: a single node reloads
/// no connection epochs, so nothing but the refusal ends the connection.
#[tokio::test]
async fn a_frame_the_store_refuses_as_superseded_ends_its_connection_at_once() {
    let ts = TestServer::start_with(ServerConfig::default()).await;
    for u in ["ann", "ben"] {
        ts.user(u).await;
    }
    let mut phone = ts.device("ann", "phone").await;
    let laptop = ts.device("ben", "laptop").await;
    let conv = phone.ws.conv_create_direct("ben").await.unwrap().conv;
    let other = SqliteStore::open(ts.dir.path()).unwrap();
    other.open_connection("ann", "phone").await.unwrap();
    drop(other);

    let late = phone.ws.send(&send_req(&conv, "late")).await;
    assert!(late.is_err(), "a send of the superseded connection was answered: {late:?}");
    assert_eq!(kicked(&mut phone, Duration::from_secs(5)).await.as_deref(), Some("superseded"));
    // Nothing of it is in the store: ben's first message takes the first
    // msg_seq after the creation, and the late key is still new.
    let first = laptop.send(&conv, "after").await;
    let again = ts.device("ann", "tablet").await.send(&conv, "late").await;
    assert!(!again.duplicate, "the refused send's idempotency key was taken");
    assert_eq!(again.msg_seq, first.msg_seq + 1, "the refused send took a msg_seq");
    ts.stop().await;
}
