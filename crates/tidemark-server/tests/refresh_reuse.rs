//! Refresh-token reuse detection (P1): a refresh token replayed after its
//! rotation revokes its whole family, so the token that replaced it stops
//! working too; the same user's other logins (other families) keep theirs,
//! and a new login starts a new family.

mod common;

use common::{code, TestServer, PASSWORD};
use tidemark_client::proto::ErrorCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_refresh_token_revokes_its_family_and_only_that() {
    let ts = TestServer::start().await;
    ts.user("alice").await;
    let phone = ts.http.login("alice", PASSWORD, "phone").await.unwrap();
    let laptop = ts.http.login("alice", PASSWORD, "laptop").await.unwrap();

    let r1 = phone.refresh_token;
    let r2 = ts.http.refresh(&r1).await.unwrap().refresh_token;
    let r3 = ts.http.refresh(&r2).await.unwrap().refresh_token;
    // The thief replays r1, rotated long ago: refused, and the family dies.
    assert_eq!(code(ts.http.refresh(&r1).await), ErrorCode::Unauthenticated);
    assert_eq!(code(ts.http.refresh(&r3).await), ErrorCode::Unauthenticated, "the live successor is revoked");
    assert_eq!(code(ts.http.refresh(&r2).await), ErrorCode::Unauthenticated);

    // Another login of the same user is another family.
    let l2 = ts.http.refresh(&laptop.refresh_token).await.expect("the laptop's family is untouched");
    ts.http.refresh(&l2.refresh_token).await.unwrap();

    // The phone logs in again and gets a family that works.
    let again = ts.http.login("alice", PASSWORD, "phone").await.unwrap();
    let next = ts.http.refresh(&again.refresh_token).await.unwrap();
    assert_eq!((next.user.as_str(), next.device_id.as_str()), ("alice", "phone"));
    ts.stop().await;
}
