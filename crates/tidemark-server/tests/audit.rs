//! The durable audit log (P1): device registrations, logins (failed and not), refreshes, a
//! refresh token's reuse, a revocation, password changes, a forced logout,
//! a deactivation and a user's creation each leave one entry with the
//! right actor, event, hashed user and device, source address and time;
//! the admin query filters by user and time range; nothing secret is
//! stored; old entries are deleted by the retention pass.

mod common;

use std::time::Duration;

use common::{TestServer, ADMIN, PASSWORD};
use serde_json::{json, Value};
use tidemark_client::proto::{AdminAuditReq, AuditEntryOut};
use tidemark_server::ServerConfig;
use tidemark_store::{AuditEntry, Store};

async fn entries(ts: &TestServer, user: Option<&str>) -> Vec<AuditEntryOut> {
    let req = AdminAuditReq { user: user.map(str::to_owned), ..Default::default() };
    ts.http.admin_audit(ADMIN, &req).await.unwrap().entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_account_event_is_audited_with_its_actor_and_nothing_secret() {
    let ts = TestServer::start().await;
    let started = tidemark_server::util::now_ms();
    ts.user("alice").await;
    ts.user("bob").await;
    assert!(ts.http.login("Alice", "wrong password", "phone").await.is_err());
    let phone = ts.device("alice", "phone").await;
    let laptop = ts.http.login("alice", PASSWORD, "laptop").await.unwrap();
    let r2 = ts.http.refresh(&laptop.refresh_token).await.unwrap();
    assert!(ts.http.refresh(&laptop.refresh_token).await.is_err(), "reused");
    let wrong = json!({"old_password": "nope", "new_password": "n2"});
    assert!(phone.ws.request::<_, Value>("account.password", &wrong).await.is_err());
    let right = json!({"old_password": PASSWORD, "new_password": "n2"});
    phone.ws.request::<_, Value>("account.password", &right).await.unwrap();
    phone.ws.request_value("device.revoke", json!({"device_id": "laptop"})).await.unwrap();
    ts.http.admin_logout(ADMIN, "alice", Some("phone")).await.unwrap();
    ts.http.admin_deactivate(ADMIN, "alice").await.unwrap();
    ts.http.login("bob", PASSWORD, "tab").await.unwrap();

    let store = &ts.running().state.store;
    let keys = &ts.running().state.keys;
    let (alice, phone_h, laptop_h) = (keys.audit_id("alice"), keys.audit_id("phone"), keys.audit_id("laptop"));
    let seen: Vec<(String, String, Option<String>, bool)> = entries(&ts, Some("ALICE"))
        .await
        .into_iter()
        .map(|e| {
            assert_eq!(e.user_hash, alice);
            assert!(e.at_ms >= started, "{e:?}");
            (e.event, e.actor, e.device_hash, e.address.is_some())
        })
        .collect();
    let d = |h: &str| Some(h.to_owned());
    assert_eq!(
        seen,
        vec![
            ("user_created".into(), "admin".into(), None, true),
            ("login_failed".into(), "anonymous".into(), d(&phone_h), true),
            ("device_registered".into(), "self".into(), d(&phone_h), true),
            ("login".into(), "self".into(), d(&phone_h), true),
            ("device_registered".into(), "self".into(), d(&laptop_h), true),
            ("login".into(), "self".into(), d(&laptop_h), true),
            ("refresh".into(), "self".into(), d(&laptop_h), true),
            ("refresh_reused".into(), "anonymous".into(), d(&laptop_h), true),
            ("password_change_failed".into(), "self".into(), d(&phone_h), false),
            ("password_changed".into(), "self".into(), d(&phone_h), false),
            ("device_revoked".into(), "self".into(), d(&laptop_h), false),
            ("logged_out".into(), "admin".into(), d(&phone_h), true),
            ("deactivated".into(), "admin".into(), None, true),
        ]
    );
    // Bob's entries are apart; a time range cuts the list.
    let bob: Vec<String> = entries(&ts, Some("bob")).await.into_iter().map(|e| e.event).collect();
    assert_eq!(bob, vec!["user_created", "device_registered", "login"]);
    let all = entries(&ts, None).await;
    assert_eq!(all.len(), 13 + 3, "alice's and bob's");
    let mid = all[6].at_ms;
    let req = AdminAuditReq { user: Some("alice".into()), from_ms: Some(mid), to_ms: Some(mid + 1), limit: Some(50) };
    let cut = ts.http.admin_audit(ADMIN, &req).await.unwrap().entries;
    assert!(!cut.is_empty() && cut.iter().all(|e| e.at_ms == mid));
    let limited = AdminAuditReq { limit: Some(2), ..Default::default() };
    assert_eq!(ts.http.admin_audit(ADMIN, &limited).await.unwrap().entries, all[..2].to_vec());

    // Nothing secret, and no name in clear, is stored.
    let raw = format!("{:?}", store.audit_log(None, 0, i64::MAX, 1000).await.unwrap());
    for secret in [PASSWORD, "n2", "wrong password", &phone.token, &laptop.refresh_token, &r2.refresh_token] {
        assert!(!raw.contains(secret), "the audit log holds a secret");
    }
    for name in ["alice", "bob", "phone", "laptop"] {
        assert!(!raw.contains(&format!("\"{name}\"")), "the audit log names {name} in clear");
    }
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_older_than_the_retention_are_deleted() {
    let mut ts =
        TestServer::start_with(ServerConfig { audit_keep: Duration::from_secs(3600), ..Default::default() }).await;
    let store = ts.running().state.store.clone();
    let now = tidemark_server::util::now_ms();
    let old = |at_ms: i64| AuditEntry {
        at_ms,
        event: "login".into(),
        actor: "self".into(),
        user_hash: "h".into(),
        device_hash: None,
        address: None,
    };
    store.append_audit(&old(now - 7_200_000)).await.unwrap();
    store.append_audit(&old(now - 60_000)).await.unwrap();
    drop(store);
    ts.server.take().unwrap().stop().await;
    // A server that starts trims at once.
    let reopened = tidemark_sqlite::SqliteStore::open(ts.dir.path()).unwrap();
    let config = ServerConfig { audit_keep: Duration::from_secs(3600), ..Default::default() };
    let server = tidemark_server::Server::start("127.0.0.1:0", reopened.clone(), config).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = reopened.audit_log(None, 0, i64::MAX, 10).await.unwrap();
        if left.len() == 1 {
            assert_eq!(left[0].at_ms, now - 60_000, "the younger entry stays");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the old entry was never trimmed: {left:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.stop().await;
}
