//! `examples/terminal.rs`, the small terminal app on the public SDK API,
//! as a person uses it: two real processes (each its own SDK client and
//! local store) against a real server on 127.0.0.1, driven through stdin
//! and read through stdout. They register, open a direct conversation,
//! talk live, list conversations, and one keeps typing while the server is
//! down: the line waits in the outbox and arrives once the server is back.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use tidemark_server::ServerConfig;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

const LINE_WAIT: Duration = Duration::from_secs(20);

/// The example binary, which cargo builds with the tests (`cargo test` and
/// `cargo nextest` build every example of the package) next to `deps/`.
fn terminal_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let debug = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps/<test>");
    let bin = debug.join("examples").join(format!("terminal{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: cargo builds examples with the tests (cargo build --examples)",
        bin.display()
    );
    bin
}

struct Terminal {
    child: Child,
    input: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
    seen: Vec<String>,
}

impl Terminal {
    fn start(h: &Harness, user: &str) -> Terminal {
        let db = h.dir.path().join(format!("{user}-terminal.db"));
        let mut child = Command::new(terminal_binary())
            .args([h.url.as_str(), user, "terminal"])
            .arg(db)
            .env("TIDEMARK_PASSWORD", PASSWORD)
            .env("TIDEMARK_ADMIN_TOKEN", ADMIN)
            .env_remove("RUST_LOG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the terminal example");
        let input = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        Terminal { child, input, out, seen: Vec::new() }
    }

    async fn type_line(&mut self, line: &str) {
        self.input.write_all(format!("{line}\n").as_bytes()).await.unwrap();
    }

    /// Reads lines until one contains `needle`; returns it.
    async fn expect(&mut self, needle: &str) -> String {
        let found = tokio::time::timeout(LINE_WAIT, async {
            while let Some(line) = self.out.next_line().await.unwrap() {
                self.seen.push(line.clone());
                if line.contains(needle) {
                    return Some(line);
                }
            }
            None
        })
        .await;
        match found {
            Ok(Some(line)) => line,
            Ok(None) => panic!("the terminal ended before printing {needle:?}; it printed {:#?}", self.seen),
            Err(_) => panic!("no {needle:?} within {LINE_WAIT:?}; it printed {:#?}", self.seen),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_terminal_app_registers_talks_live_and_queues_while_the_server_is_down() {
    let mut h = Harness::start().await;
    let mut alice = Terminal::start(&h, "alice");
    let mut bob = Terminal::start(&h, "bob");
    alice.expect("registered alice").await;
    bob.expect("registered bob").await;
    alice.expect("[state] ready").await;
    bob.expect("[state] ready").await;

    // A line with no open conversation is refused and the session goes on.
    alice.type_line("hello?").await;
    alice.expect("[error] open a conversation first").await;
    alice.type_line("/to bob").await;
    let conv = alice.expect("opened ").await.trim_start_matches("opened ").to_owned();
    alice.type_line("hello bob").await;
    alice.expect("queued").await;
    alice.expect("sent #1").await;
    bob.expect(&format!("[{conv}] #1 alice: hello bob")).await;

    bob.type_line("/list").await;
    bob.expect(&format!("conv {conv} direct unread=1 last=hello bob")).await;
    bob.type_line(&format!("/open {conv}")).await;
    bob.expect(&format!("opened {conv}")).await;
    bob.type_line("hi alice").await;
    bob.expect("sent #2").await;
    alice.expect(&format!("[{conv}] #2 bob: hi alice")).await;

    // The server goes down: Alice keeps typing; the line waits in her outbox.
    h.stop_server().await;
    alice.expect("[state] offline").await;
    alice.type_line("are you still there?").await;
    alice.expect("queued").await;
    alice.type_line("/status").await;
    alice.expect("pending=1").await;
    h.restart_server(ServerConfig::default()).await;
    alice.expect("sent #3").await;
    bob.expect(&format!("[{conv}] #3 alice: are you still there?")).await;

    alice.type_line("/quit").await;
    bob.type_line("/quit").await;
    for t in [&mut alice, &mut bob] {
        let status = tokio::time::timeout(LINE_WAIT, t.child.wait()).await.expect("quits").unwrap();
        assert!(status.success(), "{status}");
    }
}
