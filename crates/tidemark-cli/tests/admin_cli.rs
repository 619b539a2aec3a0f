//! `tidemark user …` and `tidemark device …` against a data directory:
//! list users and devices, revoke a device, end a device's sessions,
//! deactivate and delete a user, read the audit log; a server started on the
//! directory afterwards refuses what they ended.

mod common;

use std::process::{Command, Stdio};

use common::spawn_serve;
use serde_json::{json, Value};
use tidemark_client::proto::ErrorCode;
use tidemark_client::Http;

const ADMIN: &str = "cli-admin-token";
const PASSWORD: &str = "correct horse";

/// Runs `tidemark ARGS… --data DIR` and returns its stdout (it must succeed).
fn tidemark(dir: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args(args)
        .arg("--data")
        .arg(dir)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "tidemark {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn code<T: std::fmt::Debug>(r: Result<T, tidemark_client::ClientError>) -> ErrorCode {
    r.expect_err("a refusal").code().expect("a server refusal")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_lists_revokes_logs_out_deactivates_and_reads_the_audit_log() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let (phone, bob_tab) = {
        let server = spawn_serve(&["--data", &data], ADMIN);
        let http = Http::new(&server.url);
        http.create_user(ADMIN, "alice", PASSWORD).await.unwrap();
        http.create_user(ADMIN, "bob", PASSWORD).await.unwrap();
        let phone = http.login("alice", PASSWORD, "phone").await.unwrap();
        http.login("alice", PASSWORD, "laptop").await.unwrap();
        let bob_tab = http.login("bob", PASSWORD, "tab").await.unwrap();
        (phone, bob_tab)
        // The server is killed here.
    };

    let users = tidemark(dir.path(), &["user", "list"]);
    let names: Vec<(&str, &str)> =
        users.lines().map(|l| l.split('\t').collect::<Vec<_>>()).map(|f| (f[0], f[2])).collect();
    assert_eq!(names, vec![("alice", "active"), ("bob", "active")]);
    let devices = tidemark(dir.path(), &["device", "list", "ALICE"]);
    let listed: Vec<(&str, &str)> =
        devices.lines().map(|l| l.split('\t').collect::<Vec<_>>()).map(|f| (f[0], f[1])).collect();
    assert_eq!(listed, vec![("laptop", "NEW"), ("phone", "NEW")]);

    assert!(tidemark(dir.path(), &["device", "revoke", "alice", "laptop"]).contains("revoked"));
    tidemark(dir.path(), &["user", "logout", "alice", "--device", "phone"]);
    assert!(tidemark(dir.path(), &["user", "deactivate", "bob"]).contains("deactivated bob"));
    let users = tidemark(dir.path(), &["user", "list"]);
    assert!(users.lines().any(|l| l.starts_with("bob\t") && l.contains("deactivated")), "{users}");

    let audit = tidemark(dir.path(), &["user", "audit", "alice"]);
    let events: Vec<(&str, &str)> =
        audit.lines().map(|l| l.split('\t').collect::<Vec<_>>()).map(|f| (f[1], f[2])).collect();
    assert_eq!(
        events,
        vec![
            ("user_created", "admin"),
            ("device_registered", "self"),
            ("login", "self"),
            ("device_registered", "self"),
            ("login", "self"),
            ("device_revoked", "admin"),
            ("logged_out", "admin")
        ]
    );
    assert!(!audit.contains("alice") && !audit.contains(PASSWORD), "{audit}");
    assert_eq!(tidemark(dir.path(), &["user", "audit", "--limit", "1"]).lines().count(), 1);
    assert!(tidemark(dir.path(), &["user", "delete", "bob"]).contains("deleted bob"));
    assert!(tidemark(dir.path(), &["device", "list", "bob"]).is_empty(), "bob's devices are gone");
    let users = tidemark(dir.path(), &["user", "list"]);
    assert!(users.lines().any(|l| l.starts_with("bob\t") && l.contains("deleted")), "{users}");

    // A server started on the directory refuses what the operator ended.
    let server = spawn_serve(&["--data", &data], ADMIN);
    let http = Http::new(&server.url);
    let ping = |token: String| {
        let http = http.clone();
        async move { http.rpc::<_, Value>(&token, "ping", &json!({})).await }
    };
    assert_eq!(code(ping(phone.access_token.clone()).await), ErrorCode::Unauthenticated, "the phone was logged out");
    assert_eq!(code(http.refresh(&phone.refresh_token).await), ErrorCode::Unauthenticated);
    assert_eq!(code(http.login("alice", PASSWORD, "laptop").await), ErrorCode::DeviceRevoked);
    assert_eq!(code(ping(bob_tab.access_token.clone()).await), ErrorCode::Unauthenticated, "bob was deactivated");
    assert_eq!(code(http.login("bob", PASSWORD, "tab").await), ErrorCode::Unauthenticated);
    let again = http.login("alice", PASSWORD, "phone").await.expect("the logged-out device logs in again");
    ping(again.access_token).await.unwrap();
}

/// `tidemark admin reconcile` (O3) on a data directory: a dry run reports
/// a corrupted unread count, a run repairs it, the next finds nothing; the
/// report is the endpoint's JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_reconcile_reports_then_repairs_once() {
    use tidemark_store::Store;
    let dir = tempfile::tempdir().unwrap();
    {
        let store = tidemark_sqlite::SqliteStore::open(dir.path()).unwrap();
        for u in ["alice", "bob"] {
            store.create_user(u, "phc-not-used", 0).await.unwrap();
        }
        let (conv, _) = store.create_direct("alice", "bob", "c1", 0).await.unwrap();
        store
            .accept_send(tidemark_store::SendCmd {
                sender: "alice".into(),
                sender_device: "d".into(),
                conv,
                client_msg_id: "k1".into(),
                kind: "text".into(),
                content: "{\"text\":\"hi\"}".into(),
                message_id: "m1".into(),
                quote_id: None,
                mentions: Vec::new(),
                mention_all: false,
                connection_epoch: None,
                now_ms: 0,
            })
            .await
            .unwrap();
        while !store.fan_out_next(10, 0).await.unwrap().items.is_empty() {}
    }
    let db = rusqlite::Connection::open(dir.path().join(tidemark_sqlite::DB_FILE)).unwrap();
    db.execute("UPDATE user_convs SET unread = 5 WHERE user_id = 'bob'", []).unwrap();
    let run = |args: &[&str]| -> Value { serde_json::from_str(&tidemark(dir.path(), args)).unwrap() };
    let dry = run(&["admin", "reconcile", "--dry-run"]);
    assert_eq!(
        (&dry["found"], &dry["repaired"], &dry["findings"][0]["reason"]),
        (&json!(1), &json!(0), &json!("unread_drift"))
    );
    let unread =
        || db.query_row("SELECT unread FROM user_convs WHERE user_id = 'bob'", [], |r| r.get::<_, i64>(0)).unwrap();
    assert_eq!(unread(), 5, "a dry run changes nothing");
    let fixed = run(&["admin", "reconcile"]);
    assert_eq!((&fixed["found"], &fixed["repaired"], &fixed["messages_checked"]), (&json!(1), &json!(1), &json!(1)));
    assert_eq!(unread(), 1);
    assert_eq!(run(&["admin", "reconcile"])["found"], 0);
}
