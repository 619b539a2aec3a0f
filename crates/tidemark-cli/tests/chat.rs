//! `tidemark chat` as a person would use it: two real chat processes (the
//! SDK with its local store) against a real server; what one types, the
//! other prints; `/status` shows the device's cursor.

use std::process::Stdio;
use std::time::Duration;

use tidemark_server::{Server, ServerConfig};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

const ADMIN: &str = "chat-admin";

fn chat(url: &str, user: &str, dir: &std::path::Path, to: Option<&str>) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(["chat", "--server", url, "--user", user, "--device", "cli", "--db"])
        .arg(dir.join(format!("{user}.db")))
        .env("TIDEMARK_PASSWORD", "pw")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    if let Some(peer) = to {
        cmd.args(["--to", peer]);
    }
    cmd.spawn().expect("spawn tidemark chat")
}

async fn expect_line(lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>, needle: &str) -> String {
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains(needle) {
                return line;
            }
        }
        panic!("chat ended before printing {needle:?}");
    })
    .await;
    found.unwrap_or_else(|_| panic!("no line with {needle:?} within 20 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_chats_talk_and_show_their_cursor() {
    let dir = tempfile::tempdir().unwrap();
    let store = tidemark_sqlite::SqliteStore::open(&dir.path().join("server")).unwrap();
    let config = ServerConfig { admin_token: Some(ADMIN.into()), ..Default::default() };
    let server = Server::start("127.0.0.1:0", store, config).await.unwrap();
    let url = server.url();
    let http = tidemark_client::Http::new(&url);
    for u in ["ann", "ben"] {
        http.create_user(ADMIN, u, "pw").await.unwrap();
    }
    let mut ben = chat(&url, "ben", dir.path(), None);
    let mut ben_out = BufReader::new(ben.stdout.take().unwrap()).lines();
    expect_line(&mut ben_out, "[status]").await;
    let mut ann = chat(&url, "ann", dir.path(), Some("ben"));
    let mut ann_in = ann.stdin.take().unwrap();
    let mut ann_out = BufReader::new(ann.stdout.take().unwrap()).lines();
    expect_line(&mut ann_out, "[chat] talking to ben").await;
    ann_in.write_all(b"hello ben\n").await.unwrap();
    ann_in.write_all(b"second line\n").await.unwrap();
    let first = expect_line(&mut ben_out, "hello ben").await;
    assert!(first.contains("#1] ann: hello ben"), "{first}");
    let second = expect_line(&mut ben_out, "second line").await;
    assert!(second.contains("#2] ann: second line"), "{second}");
    let mut ben_in = ben.stdin.take().unwrap();
    ben_in.write_all(b"/status\n").await.unwrap();
    let status = expect_line(&mut ben_out, "applied sync_seq").await;
    assert!(status.contains("applied sync_seq 2"), "ben's device applied both events: {status}");
    ben_in.write_all(b"/list\n").await.unwrap();
    expect_line(&mut ben_out, "[list]").await;
    ann_in.write_all(b"/quit\n").await.unwrap();
    ben_in.write_all(b"/quit\n").await.unwrap();
    assert!(ann.wait().await.unwrap().success());
    assert!(ben.wait().await.unwrap().success());
    server.stop().await;
}
