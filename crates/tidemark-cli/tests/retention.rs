//! The retention flags of `tidemark serve` (L1, L2) with the real binary: a
//! device that stays away past `--device-inactive-secs` stops holding its
//! user's log; the pass (`--retention-every-ms`) trims behind the device
//! that kept syncing, and the one that returns is told `RESET_REQUIRED`
//! and rebuilds from a snapshot carrying `--snapshot-messages-per-conv`
//! messages. `--keep-all-logs` turns the pass off.

use std::time::Duration;

use tidemark_client::proto::{ErrorCode, SendReq, SnapshotBeginOk, SyncReq};
use tidemark_client::{ClientError, Http};

const ADMIN: &str = "retention-admin";

mod common;

use common::{pull_from, spawn_serve, Position};

/// Ann sends `n` messages to Ben; Ben's `fast` device pulls them, from
/// where it left off.
async fn traffic(http: &Http, ann: &str, fast: (&str, &mut Position), conv: &str, from: usize, n: usize) {
    for i in from..from + n {
        let req = SendReq {
            conv: conv.into(),
            client_msg_id: format!("k{i}"),
            kind: "text".into(),
            content: serde_json::json!({"i": i}),
            mentions: Vec::new(),
            mention_all: false,
        };
        let _: serde_json::Value = http.rpc(ann, "send", &req).await.unwrap();
    }
    let (token, pos) = fast;
    assert_eq!(pull_from(http, token, pos, n, Duration::from_secs(10), 100).await.len(), n);
}

/// The code of a refused first sync from `applied` at generation 1.
async fn first_sync_code(http: &Http, token: &str, applied: u64) -> Option<ErrorCode> {
    let req = SyncReq { sync_generation: Some(1), local_applied_sync_seq: Some(applied), ..Default::default() };
    match http.rpc::<_, serde_json::Value>(token, "sync", &req).await {
        Ok(_) => None,
        Err(ClientError::Server(e)) => Some(e.code),
        Err(e) => panic!("{e:?}"),
    }
}

async fn run(extra: &[&str]) -> (Http, Option<ErrorCode>, tempfile::TempDir, common::ServerProc) {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["--data".to_owned(), dir.path().display().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let server = spawn_serve(&args, ADMIN);
    let http = Http::new(&server.url);
    for u in ["ann", "ben"] {
        http.create_user(ADMIN, u, "pw").await.unwrap();
    }
    let ann = http.login("ann", "pw", "phone").await.unwrap().access_token;
    let fast = http.login("ben", "pw", "fast").await.unwrap().access_token;
    let slow = http.login("ben", "pw", "slow").await.unwrap().access_token;
    let conv: serde_json::Value =
        http.rpc(&ann, "conv.create", &serde_json::json!({"kind": "direct", "members": ["ben"]})).await.unwrap();
    let conv = conv["conv"].as_str().unwrap().to_owned();
    let mut fast_pos = Position::default();
    traffic(&http, &ann, (&fast, &mut fast_pos), &conv, 0, 5).await;
    // slow syncs once, to the head, then goes away.
    let mut slow_pos = Position::default();
    assert_eq!(pull_from(&http, &slow, &mut slow_pos, 5, Duration::from_secs(10), 100).await.len(), 5);
    assert_eq!(slow_pos.applied, fast_pos.applied);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    traffic(&http, &ann, (&fast, &mut fast_pos), &conv, 5, 10).await;
    // Traffic goes on for 2.4 s and fast keeps up (a device counts as
    // active while its ACK moves): the older entries leave the keep window
    // while fast holds the fence at the head and slow holds nothing.
    for i in 15..23 {
        traffic(&http, &ann, (&fast, &mut fast_pos), &conv, i, 1).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let code = first_sync_code(&http, &slow, slow_pos.applied).await;
    (http, code, dir, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_away_past_the_flags_windows_rebuilds_from_a_snapshot() {
    let flags = [
        // A second of keep window: nothing is trimmed before slow's first
        // sync, which follows fast's by milliseconds (a device that never
        // synced does not hold the fence).
        "--log-keep-secs",
        "1",
        "--device-inactive-secs",
        "1",
        "--retention-every-ms",
        "100",
        "--snapshot-messages-per-conv",
        "3",
    ];
    let (http, code, _dir, _server) = run(&flags).await;
    assert_eq!(code, Some(ErrorCode::ResetRequired), "the log the slow device needs was trimmed");
    let slow = http.login("ben", "pw", "slow").await.unwrap().access_token;
    let begin: SnapshotBeginOk = http.rpc(&slow, "snapshot.begin", &serde_json::json!({})).await.unwrap();
    let page: tidemark_client::proto::SnapshotPageOk = http
        .rpc(&slow, "snapshot.page", &serde_json::json!({"snapshot_token": begin.snapshot_token, "page": 0}))
        .await
        .unwrap();
    let messages = page.items.iter().filter(|i| i["type"] == "message").count();
    assert_eq!(messages, 3, "--snapshot-messages-per-conv bounds the snapshot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_all_logs_never_trims() {
    let flags = ["--keep-all-logs", "--retention-every-ms", "100"];
    let (_http, code, _dir, _server) = run(&flags).await;
    assert_eq!(code, None, "nothing was trimmed: the slow device replays");
}
