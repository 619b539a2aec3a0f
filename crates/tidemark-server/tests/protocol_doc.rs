//! docs/protocol.md lists the operations the server dispatches, no more and
//! no fewer: the `### 3.N` headings and the list that opens §3 equal
//! `tidemark_proto::op::ALL`; every one of them reaches `ops::dispatch` on a
//! real server (it never answers "unknown operation"), while the operations
//! §6 lists as not implemented, and `auth` over HTTP (§1.3), do.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{json, Value};
use tidemark_client::proto::op;

fn protocol_md() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/protocol.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The text of section `## N.` up to the next `## `.
fn section(doc: &str, n: u32) -> String {
    let start = doc.find(&format!("\n## {n}. ")).unwrap_or_else(|| panic!("no section {n}"));
    let rest = &doc[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3);
    rest[..end].to_owned()
}

/// Every `name` in backticks in `text`.
fn backticked(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

/// Operations with a heading of their own, `### 3.N \`op\` …`.
fn headings(ops: &str) -> BTreeSet<String> {
    ops.lines().filter_map(|l| l.strip_prefix("### 3.")).filter_map(|l| backticked(l).into_iter().next()).collect()
}

/// The operations named by §3's opening sentence, up to "§3.4 explains".
fn intro_list(ops: &str) -> Vec<String> {
    let start = ops.find("The server implements these operations:").expect("§3 opens with its operation list");
    let end = ops[start..].find("§3.4 explains").expect("the list ends before §3.4's mention") + start;
    backticked(&ops[start..end])
}

/// The operations of §6's table, `| \`op\` | requirement |`.
fn not_implemented(doc: &str) -> Vec<String> {
    section(doc, 6).lines().filter(|l| l.starts_with("| `")).filter_map(|l| backticked(l).into_iter().next()).collect()
}

fn all() -> BTreeSet<String> {
    let all: BTreeSet<String> = op::ALL.iter().map(|s| s.to_string()).collect();
    assert_eq!(all.len(), op::ALL.len(), "op::ALL names an operation twice");
    all
}

#[test]
fn the_documented_operations_are_the_dispatched_ones() {
    let doc = protocol_md();
    let ops = section(&doc, 3);
    let all = all();
    assert_eq!(headings(&ops), all, "the ### 3.N operation headings of docs/protocol.md vs op::ALL");
    let intro = intro_list(&ops);
    let intro_set: BTreeSet<String> = intro.iter().cloned().collect();
    assert_eq!(intro_set.len(), intro.len(), "§3's list names an operation twice: {intro:?}");
    assert_eq!(intro_set, all, "the list opening §3 of docs/protocol.md vs op::ALL");
    // §6's table may be empty (every contract operation implemented); what
    // it lists must not be dispatched.
    let missing = not_implemented(&doc);
    assert!(section(&doc, 6).contains("| operation | requirement |"), "§6 keeps its table");
    for name in &missing {
        assert!(!all.contains(name), "§6 says {name} is not implemented, but op::ALL has it");
    }
}

/// The reply of `POST /v1/rpc/<op>` with an empty object, as a fresh device.
async fn call(t: &common::TestServer, user: &str, n: usize, op: &str) -> Value {
    let login = t.http.login(user, common::PASSWORD, &format!("d{n}")).await.unwrap();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/rpc/{op}", t.http.base()))
        .bearer_auth(&login.access_token)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    resp.json().await.unwrap()
}

fn unknown(reply: &Value) -> bool {
    reply["t"] == "error" && reply["message"].as_str().is_some_and(|m| m.starts_with("unknown operation"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_operation_is_dispatched_and_no_other() {
    let t = common::TestServer::start().await;
    t.user("doc").await;
    let doc = protocol_md();
    let mut n = 0;
    for name in all() {
        n += 1;
        let reply = call(&t, "doc", n, &name).await;
        assert!(!unknown(&reply), "{name} is documented but the server does not dispatch it: {reply}");
    }
    for name in not_implemented(&doc).into_iter().chain(["auth".to_string()]) {
        n += 1;
        let reply = call(&t, "doc", n, &name).await;
        assert!(unknown(&reply), "{name} is documented as unknown over HTTP, yet it answered {reply}");
        assert_eq!(reply["code"], "BAD_REQUEST", "{reply}");
    }
    t.stop().await;
}
