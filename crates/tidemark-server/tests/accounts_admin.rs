//! Accounts and devices (P1, P5): `device.list`, `account.password` (the
//! other devices can no longer refresh), an operator's forced logout of a
//! device or of a user, and deactivation. Each end of a session kicks the
//! live sockets, refuses the ended access tokens over WebSocket and HTTP
//! and their refresh tokens, survives a restart, and (except deactivation)
//! lets a new login in.

mod common;

use std::time::Duration;

use common::{code, Device, TestServer, ADMIN, PASSWORD};
use serde_json::{json, Value};
use tidemark_client::proto::{reason, DeviceListOk, ErrorCode};
use tidemark_client::{ServerEvent, WsConn};
use tidemark_server::{Server, ServerConfig};

/// The reason of the kick `d` gets next (the socket then closes).
async fn kicked(d: &mut Device) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, d.events.recv()).await.expect("a kick in time") {
            Some(ServerEvent::Kicked { reason }) => return reason,
            Some(ServerEvent::Closed) | None => panic!("closed without a kick"),
            Some(_) => continue,
        }
    }
}

async fn rpc_code(ts: &TestServer, token: &str, op: &str) -> ErrorCode {
    code(ts.http.rpc::<_, Value>(token, op, &json!({})).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_list_and_a_password_change_that_logs_the_other_devices_out() {
    let ts = TestServer::start().await;
    ts.user("alice").await;
    let phone = ts.device("alice", "phone").await;
    let mut laptop = ts.device("alice", "laptop").await;
    ts.http.login("alice", PASSWORD, "old-tablet").await.unwrap();
    phone.ws.request_value("device.revoke", json!({"device_id": "old-tablet"})).await.unwrap();

    let list: DeviceListOk = phone.ws.request("device.list", &json!({})).await.unwrap();
    let seen: Vec<(&str, &str, bool)> =
        list.devices.iter().map(|d| (d.device_id.as_str(), d.state.as_str(), d.current)).collect();
    assert_eq!(seen, vec![("laptop", "NEW", false), ("old-tablet", "REVOKED", false), ("phone", "NEW", true)]);
    assert!(list.devices.iter().all(|d| d.created_at > 0 && d.last_seen_at >= d.created_at));
    assert_eq!(list.devices[2].name, "phone");

    // A wrong old password changes nothing.
    let wrong =
        phone.ws.request::<_, Value>("account.password", &json!({"old_password": "nope", "new_password": "n"})).await;
    assert_eq!(code(wrong), ErrorCode::Unauthenticated);
    ts.http.login("alice", PASSWORD, "probe").await.expect("the old password still logs in");

    let body = json!({"old_password": PASSWORD, "new_password": "a new one"});
    let ok: Value = phone.ws.request("account.password", &body).await.unwrap();
    assert_eq!(ok["other_devices_logged_out"], true);
    assert_eq!(code(ts.http.refresh(&laptop.refresh).await), ErrorCode::Unauthenticated, "the laptop cannot refresh");
    // The laptop's access token ends too: its socket is kicked, and the
    // token is refused, while the phone's goes on.
    assert_eq!(kicked(&mut laptop).await, reason::LOGGED_OUT);
    assert_eq!(rpc_code(&ts, &laptop.token, "conv.list").await, ErrorCode::Unauthenticated);
    let _: Value = ts.http.rpc(&phone.token, "conv.list", &json!({})).await.expect("the phone's token still works");
    ts.http.refresh(&phone.refresh).await.expect("the device that changed it keeps its session");
    assert_eq!(code(ts.http.login("alice", PASSWORD, "phone").await), ErrorCode::Unauthenticated);
    ts.http.login("alice", "a new one", "laptop").await.expect("the new password logs in");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_logout_ends_a_device_or_every_device_of_a_user_and_a_new_login_works() {
    let mut ts = TestServer::start().await;
    ts.user("alice").await;
    ts.user("bob").await;
    let phone = ts.device("alice", "phone").await;
    let mut laptop = ts.device("alice", "laptop").await;
    let bob = ts.device("bob", "phone").await;

    let ok = ts.http.admin_logout(ADMIN, "Alice", Some("laptop")).await.unwrap();
    assert_eq!((ok.user.as_str(), ok.device_id.as_deref()), ("alice", Some("laptop")));
    assert_eq!(kicked(&mut laptop).await, reason::LOGGED_OUT);
    assert_eq!(rpc_code(&ts, &laptop.token, "ping").await, ErrorCode::Unauthenticated);
    assert_eq!(code(WsConn::connect(&ts.ws_url(), &laptop.token).await.map(|_| ())), ErrorCode::Unauthenticated);
    assert_eq!(code(ts.http.refresh(&laptop.refresh).await), ErrorCode::Unauthenticated);
    // The phone and another user are untouched.
    phone.ws.request_value("ping", json!({})).await.unwrap();
    ts.http.rpc::<_, Value>(&phone.token, "ping", &json!({})).await.unwrap();
    // A new login of the laptop works.
    let again = ts.http.login("alice", PASSWORD, "laptop").await.unwrap();
    ts.http.rpc::<_, Value>(&again.access_token, "ping", &json!({})).await.unwrap();

    // Every device of alice: the phone's socket and tokens end too.
    let mut phone = phone;
    ts.http.admin_logout(ADMIN, "alice", None).await.unwrap();
    assert_eq!(kicked(&mut phone).await, reason::LOGGED_OUT);
    assert_eq!(rpc_code(&ts, &phone.token, "ping").await, ErrorCode::Unauthenticated);
    assert_eq!(rpc_code(&ts, &again.access_token, "ping").await, ErrorCode::Unauthenticated);
    bob.ws.request_value("ping", json!({})).await.unwrap();
    assert_eq!(code(ts.http.admin_logout(ADMIN, "nobody", None).await), ErrorCode::NotFound);
    assert_eq!(code(ts.http.admin_logout(ADMIN, "alice", Some("no-such-device")).await), ErrorCode::NotFound);

    // The ends are durable: after a restart the old tokens stay refused.
    ts.server.take().unwrap().stop().await;
    let store = tidemark_sqlite::SqliteStore::open(ts.dir.path()).unwrap();
    let config = ServerConfig { admin_token: Some(ADMIN.into()), ..ServerConfig::default() };
    ts.server = Some(Server::start("127.0.0.1:0", store, config).await.unwrap());
    ts.http = tidemark_client::Http::new(&ts.running().url());
    assert_eq!(rpc_code(&ts, &phone.token, "ping").await, ErrorCode::Unauthenticated);
    assert_eq!(rpc_code(&ts, &laptop.token, "ping").await, ErrorCode::Unauthenticated);
    ts.http.rpc::<_, Value>(&bob.token, "ping", &json!({})).await.expect("bob's token still works");
    let fresh = ts.http.login("alice", PASSWORD, "phone").await.unwrap();
    ts.http.rpc::<_, Value>(&fresh.access_token, "ping", &json!({})).await.unwrap();
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deactivated_user_is_kicked_and_nothing_of_it_is_accepted_after() {
    let ts = TestServer::start().await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut phone = ts.device("alice", "phone").await;
    let bob = ts.device("bob", "phone").await;
    let conv = bob.ws.conv_create_direct("alice").await.unwrap().conv;

    let ok = ts.http.admin_deactivate(ADMIN, "alice").await.unwrap();
    assert!(ok.deactivated);
    assert_eq!(kicked(&mut phone).await, reason::ACCOUNT_DEACTIVATED);
    assert_eq!(rpc_code(&ts, &phone.token, "ping").await, ErrorCode::Unauthenticated);
    assert_eq!(rpc_code(&ts, &phone.token, "sync").await, ErrorCode::Unauthenticated);
    assert_eq!(code(WsConn::connect(&ts.ws_url(), &phone.token).await.map(|_| ())), ErrorCode::Unauthenticated);
    assert_eq!(code(ts.http.refresh(&phone.refresh).await), ErrorCode::Unauthenticated);
    // It no longer logs in, refused exactly as a wrong password is.
    let refused = ts.http.login("alice", PASSWORD, "phone").await.unwrap_err();
    let wrong = ts.http.login("bob", "wrong", "phone").await.unwrap_err();
    assert_eq!(format!("{refused:?}"), format!("{wrong:?}"));
    assert!(!ts.http.admin_deactivate(ADMIN, "alice").await.unwrap().deactivated, "already deactivated");
    assert_eq!(code(ts.http.admin_deactivate(ADMIN, "nobody").await), ErrorCode::NotFound);
    // Bob's conversation with alice keeps its facts; bob goes on.
    bob.send(&conv, "after").await;
    ts.stop().await;
}

/// A refresh token that outlived a forced logout (stored by a refresh that
/// raced it) continues no session: the fence refuses it, and its device's
/// tokens are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_token_older_than_a_logout_continues_no_session() {
    let ts = TestServer::start().await;
    ts.user("alice").await;
    let phone = ts.http.login("alice", PASSWORD, "phone").await.unwrap();
    let state = &ts.running().state;
    let issued_at = tidemark_server::util::now_ms();
    ts.http.admin_logout(ADMIN, "alice", Some("phone")).await.unwrap();
    // The orphan: issued before the logout, stored after it.
    let orphan = "orphan-refresh-secret";
    let rec = tidemark_store::RefreshRecord {
        user: "alice".into(),
        device: "phone".into(),
        expires_at_ms: issued_at + state.config.refresh_token_ttl.as_millis() as i64,
        family: "f-orphan".into(),
    };
    let hash = tidemark_server::util::sha256_hex(orphan);
    state.store.put_refresh_token(&hash, &rec, tidemark_server::util::now_ms()).await.unwrap();
    assert_eq!(code(ts.http.refresh(orphan).await), ErrorCode::Unauthenticated);
    assert_eq!(code(ts.http.refresh(&phone.refresh_token).await), ErrorCode::Unauthenticated);
    // A login after the logout starts a session that refreshes.
    let again = ts.http.login("alice", PASSWORD, "phone").await.unwrap();
    ts.http.refresh(&again.refresh_token).await.expect("a session begun after the logout refreshes");
    ts.stop().await;
}

/// Deleting a user kicks it and refuses it everywhere, removes its devices
/// (cursors), tokens and log, keeps its name from being reused, and leaves
/// the messages it sent in their conversations under its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_user_loses_its_devices_and_log_and_its_messages_stay() {
    let ts = TestServer::start().await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.device("alice", "phone").await;
    let bob = ts.device("bob", "phone").await;
    let conv = alice.ws.conv_create_direct("bob").await.unwrap().conv;
    alice.send(&conv, "hello from alice").await;
    let store = ts.running().state.store.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while store.user_log("alice").await.unwrap().high_watermark == 0 {
        assert!(tokio::time::Instant::now() < deadline, "alice's send never reached her log");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let ok = ts.http.admin_delete(ADMIN, "Alice").await.unwrap();
    assert!(ok.deleted && ok.user == "alice");
    assert_eq!(kicked(&mut alice).await, reason::ACCOUNT_DEACTIVATED);
    assert_eq!(rpc_code(&ts, &alice.token, "ping").await, ErrorCode::Unauthenticated);
    assert_eq!(code(ts.http.refresh(&alice.refresh).await), ErrorCode::Unauthenticated);
    assert_eq!(code(ts.http.login("alice", PASSWORD, "phone").await), ErrorCode::Unauthenticated);
    assert!(!ts.http.create_user(ADMIN, "alice", "another").await.unwrap().created, "the name is not reused");
    assert!(!ts.http.admin_delete(ADMIN, "alice").await.unwrap().deleted, "deleted already");
    assert_eq!(code(ts.http.admin_delete(ADMIN, "nobody").await), ErrorCode::NotFound);
    assert!(store.list_devices("alice").await.unwrap().is_empty(), "devices and cursors gone");
    let log = store.user_log("alice").await.unwrap();
    assert!(store.read_user_events("alice", 0, log.high_watermark, 100).await.unwrap().is_empty(), "log gone");

    // Bob still reads alice's message, under her name.
    let history: Value = bob.ws.request("history", &json!({"conv": conv, "limit": 10})).await.unwrap();
    let messages = history["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0]["sender"], "alice");
    let query = tidemark_client::proto::AdminAuditReq { user: Some("alice".into()), ..Default::default() };
    let audit = ts.http.admin_audit(ADMIN, &query).await.unwrap().entries;
    assert!(audit.iter().any(|e| e.event == "deleted" && e.actor == "admin"), "{audit:?}");
    ts.stop().await;
}
