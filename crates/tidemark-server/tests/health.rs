//! `/healthz` tells whether the store's writes commit. A real I/O failure:
//! with `RLIMIT_FSIZE` at 0 the process may not write to any file, so the
//! WAL append at COMMIT fails (EFBIG), as on a full disk. The limit is per
//! process, so this file is its own test binary with one test.

mod common;

use common::{TestServer, ADMIN, PASSWORD};
use tidemark_client::proto::ErrorCode;

/// Sets `RLIMIT_FSIZE` for the process and restores the old limit on drop
/// (also when an assertion fails, so the harness can still write).
struct FileSizeLimit(libc::rlimit);

impl FileSizeLimit {
    fn set(bytes: u64) -> FileSizeLimit {
        // SAFETY: plain libc calls on valid, owned structs. SIGXFSZ is
        // ignored so a write past the limit fails with EFBIG instead of
        // killing the process.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let mut old = std::mem::zeroed::<libc::rlimit>();
            assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut old), 0);
            let new = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: old.rlim_max };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &new), 0);
            FileSizeLimit(old)
        }
    }
}

impl Drop for FileSizeLimit {
    fn drop(&mut self) {
        // SAFETY: restores the limit read in `set`.
        unsafe {
            libc::setrlimit(libc::RLIMIT_FSIZE, &self.0);
        }
    }
}

async fn healthz(ts: &TestServer) -> (u16, serde_json::Value) {
    let resp = reqwest::get(format!("{}/healthz", ts.running().url())).await.unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_unavailable_while_the_writer_cannot_commit() {
    let ts = TestServer::start().await;
    ts.user("alice").await;
    assert_eq!(healthz(&ts).await.0, 200);

    let limit = FileSizeLimit::set(0);
    let refused = ts.http.create_user(ADMIN, "bob", PASSWORD).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::Unavailable), "{refused:?}");
    let (status, body) = healthz(&ts).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "unavailable");
    assert!(body["error"].as_str().is_some_and(|e| e.contains("commit")), "{body}");

    // The disk has room again: the next write commits (bob was rolled back,
    // so he is created now) and the node is healthy.
    drop(limit);
    assert!(ts.http.create_user(ADMIN, "bob", PASSWORD).await.unwrap().created);
    let (status, body) = healthz(&ts).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "ok");
}
