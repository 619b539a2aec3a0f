//! One canonical form for user names (ASCII case-folded): `Alice` cannot
//! be registered beside `alice`, a login in any case reaches the one
//! account, a conversation with `BOB` is the one with `bob`; and a
//! conversation with a user who has no account is refused without naming
//! them, the same way whichever name is missing. An account created before
//! names were folded (a *legacy* `Dora`, written straight to the store
//! here) keeps its exact name: it logs in by it, others reach it by it, and
//! an operator can end its sessions by it.

mod common;

use common::{code, TestServer, ADMIN, PASSWORD};
use serde_json::{json, Value};
use tidemark_client::proto::ErrorCode;
use tidemark_client::{ClientError, WsConn};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_differing_only_in_case_are_one_account() {
    let ts = TestServer::start().await;
    ts.user("alice").await;
    let again = ts.http.create_user(ADMIN, "Alice", "another password").await.unwrap();
    assert!(!again.created, "Alice beside alice");
    assert_eq!(again.user, "alice", "the reply names the account in its one form");
    let upper = ts.http.create_user(ADMIN, "CAROL", PASSWORD).await.unwrap();
    assert!(upper.created);
    assert_eq!(upper.user, "carol");

    // Any case logs in to the one account, whose id is the folded name.
    for name in ["alice", "Alice", "ALICE"] {
        let ok = ts.http.login(name, PASSWORD, "phone").await.unwrap();
        assert_eq!(ok.user, "alice", "login as {name}");
    }
    assert_eq!(code(ts.http.login("Alice", "another password", "phone").await), ErrorCode::Unauthenticated);
    assert_eq!(ts.http.login("carol", PASSWORD, "phone").await.unwrap().user, "carol");

    // A direct conversation named in any case is the same conversation.
    ts.user("bob").await;
    let alice = ts.device("ALICE", "laptop").await;
    let lower = alice.ws.conv_create_direct("bob").await.unwrap();
    let upper = alice.ws.conv_create_direct("BoB").await.unwrap();
    assert_eq!(lower.conv, upper.conv);
    assert!(!upper.created);
    assert_eq!(upper.members, vec!["alice".to_owned(), "bob".to_owned()]);
    // Naming yourself in another case is still yourself.
    let refused = alice.ws.request::<_, Value>("conv.create", &json!({"kind": "direct", "members": ["Alice"]})).await;
    assert_eq!(code(refused), ErrorCode::BadRequest);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_with_an_unknown_user_is_refused_without_naming_anyone() {
    let ts = TestServer::start().await;
    ts.user("alice").await;
    ts.user("bob").await;
    let alice = ts.device("alice", "phone").await;
    let mut refusals = Vec::new();
    for (kind, members) in [
        ("direct", vec!["zed-unknown"]),
        ("direct", vec!["yvonne-unknown"]),
        ("group", vec!["bob", "zed-unknown"]),
        ("group", vec!["yvonne-unknown", "bob"]),
    ] {
        let body = json!({"kind": kind, "members": members, "client_msg_id": format!("g-{}", refusals.len())});
        match alice.ws.request::<_, Value>("conv.create", &body).await {
            Err(ClientError::Server(frame)) => {
                assert_eq!(frame.code, ErrorCode::NotFound);
                let message = frame.message.to_ascii_lowercase();
                assert!(!message.contains("zed") && !message.contains("yvonne"), "{message:?} names the user");
                refusals.push(frame.message);
            }
            other => panic!("{kind} with {members:?}: {other:?}"),
        }
    }
    refusals.dedup();
    assert_eq!(refusals.len(), 1, "every refusal reads the same: {refusals:?}");
    // Adding an unknown user to a group is refused the same way.
    let group = alice
        .ws
        .request_value("conv.create", json!({"kind": "group", "members": ["bob"], "client_msg_id": "g-ok"}))
        .await
        .unwrap();
    let add = alice
        .ws
        .request::<_, Value>(
            "conv.add",
            &json!({"conv": group["conv"], "user": "zed-unknown", "client_msg_id": "add-1"}),
        )
        .await;
    match add {
        Err(ClientError::Server(frame)) => {
            assert_eq!(frame.code, ErrorCode::NotFound);
            assert_eq!(frame.message, refusals[0]);
        }
        other => panic!("conv.add of an unknown user: {other:?}"),
    }
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_legacy_account_with_upper_case_keeps_its_exact_name() {
    let ts = TestServer::start().await;
    ts.user("bob").await;
    let store = ts.running().state.store.clone();
    let hash = tidemark_server::accounts::hash_password(PASSWORD).unwrap();
    // Created before folding: the store keeps a name as it is given.
    assert!(store.create_user("Dora", &hash, 0).await.unwrap());
    // Both, created before folding: the folded one is what `Eve` means.
    assert!(store.create_user("Eve", &hash, 0).await.unwrap());
    ts.user("eve").await;

    let dora = ts.http.login("Dora", PASSWORD, "phone").await.expect("the legacy account logs in by its name");
    assert_eq!(dora.user, "Dora");
    assert_eq!(code(ts.http.login("dora", PASSWORD, "phone").await), ErrorCode::Unauthenticated, "no dora account");
    assert_eq!(ts.http.login("EVE", PASSWORD, "phone").await.unwrap().user, "eve", "the folded account wins");

    // Bob reaches Dora by her exact name; a folded `dora` is nobody.
    let bob = ts.device("bob", "laptop").await;
    let direct = bob.ws.conv_create_direct("Dora").await.unwrap();
    assert_eq!(direct.members, vec!["Dora".to_owned(), "bob".to_owned()]);
    assert_eq!(code(bob.ws.conv_create_direct("dora").await.map(|_| ())), ErrorCode::NotFound);
    let (ws, _events) = WsConn::connect(&ts.ws_url(), &dora.access_token).await.unwrap();
    let list: Value = ws.request("conv.list", &json!({})).await.unwrap();
    assert_eq!(list["conversations"][0]["conv"], direct.conv.as_str(), "Dora sees the conversation");

    // An operator ends her sessions by her name: her token is refused.
    ts.http.admin_logout(ADMIN, "Dora", None).await.expect("the legacy name is found");
    assert_eq!(
        code(ts.http.rpc::<_, Value>(&dora.access_token, "conv.list", &json!({})).await),
        ErrorCode::Unauthenticated
    );
    ts.stop().await;
}
