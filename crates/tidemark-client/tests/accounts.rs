//! The SDK's account calls against a real server: `devices()` lists the
//! user's devices with this one marked, `change_password()` takes the old
//! password and the other devices can no longer refresh, and a client whose
//! account an operator deactivates is kicked and ends logged out (its
//! password no longer logs in).

mod common;

use common::*;
use tidemark_client::{Change, Exit};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_password_change_and_deactivation_through_the_sdk() {
    let h = Harness::start().await;
    h.user("alice").await;
    let phone = h.ready("alice", "phone").await;
    let laptop = h.http.login("alice", PASSWORD, "laptop").await.unwrap();

    let devices = phone.devices().await.unwrap();
    let seen: Vec<(&str, bool)> = devices.iter().map(|d| (d.device_id.as_str(), d.current)).collect();
    assert_eq!(seen, vec![("laptop", false), ("phone", true)]);
    assert_eq!(devices[1].state, "ACTIVE", "a ready client has synced");

    assert!(phone.change_password("not it", "new secret").await.is_err());
    phone.change_password(PASSWORD, "new secret").await.unwrap();
    assert!(h.http.refresh(&laptop.refresh_token).await.is_err(), "the laptop cannot refresh");
    assert!(h.http.login("alice", PASSWORD, "laptop").await.is_err());
    h.http.login("alice", "new secret", "laptop").await.unwrap();

    let mut changes = phone.subscribe();
    h.http.admin_deactivate(ADMIN, "alice").await.unwrap();
    let exit = tokio::time::timeout(WAIT, phone.closed()).await.expect("the client ends");
    assert!(matches!(exit, Exit::LoggedOut(_)), "{exit:?}");
    let seen = drain(&mut changes);
    assert!(seen.contains(&Change::Kicked { reason: "account_deactivated".into() }), "{seen:?}");
}
