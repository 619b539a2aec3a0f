//! `tidemark chat` as a person would use it: real chat processes (the SDK
//! with its local store) against a real server; what one types, the other
//! prints; `/status` shows the device's cursor; mistakes are reported on
//! the line and the session goes on; groups, recall, edit and react; a chat
//! started while the server is down queues in the outbox and delivers once
//! the server is back.

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
        .env("TIDEMARK_PASSWORD", "pw");
    spawn(cmd, to)
}

fn spawn(mut cmd: Command, to: Option<&str>) -> Child {
    cmd.env("RUST_LOG", "warn").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).kill_on_drop(true);
    if let Some(peer) = to {
        cmd.args(["--to", peer]);
    }
    cmd.spawn().expect("spawn tidemark chat")
}

type Out = tokio::io::Lines<BufReader<tokio::process::ChildStdout>>;

/// A running chat: its stdin and stdout.
struct Session {
    child: Child,
    input: tokio::process::ChildStdin,
    out: Out,
}

impl Session {
    fn new(mut child: Child) -> Session {
        let input = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        Session { child, input, out }
    }

    async fn type_line(&mut self, line: &str) {
        self.input.write_all(format!("{line}\n").as_bytes()).await.unwrap();
    }

    async fn expect(&mut self, needle: &str) -> String {
        expect_line(&mut self.out, needle).await
    }

    /// Waits until a line with each of `needles` was printed, in any order
    /// (a chat prints its conversations in the order it lists them);
    /// returns the lines in the needles' order.
    async fn expect_all(&mut self, needles: &[&str]) -> Vec<String> {
        let mut found: Vec<Option<String>> = vec![None; needles.len()];
        let mut skipped = Vec::new();
        let done = tokio::time::timeout(LINE_WAIT, async {
            while found.iter().any(Option::is_none) {
                let Some(line) = self.out.next_line().await.unwrap() else { return false };
                match needles.iter().position(|n| line.contains(n)) {
                    Some(i) if found[i].is_none() => found[i] = Some(line),
                    _ => skipped.push(line),
                }
            }
            true
        })
        .await;
        match done {
            Ok(true) => found.into_iter().map(Option::unwrap).collect(),
            Ok(false) => panic!("chat ended before printing all of {needles:?}; it printed {skipped:#?}"),
            Err(_) => panic!("not all of {needles:?} within {LINE_WAIT:?}; found {found:?}, skipped {skipped:#?}"),
        }
    }

    /// Types `line`, then `/status`, and returns what was printed between.
    async fn run(&mut self, line: &str) -> Vec<String> {
        self.type_line(line).await;
        self.type_line("/status").await;
        let mut printed = Vec::new();
        let done = tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(l) = self.out.next_line().await.unwrap() {
                if l.contains("applied sync_seq") {
                    return;
                }
                printed.push(l);
            }
            panic!("chat ended after {line:?}: {printed:?}");
        })
        .await;
        done.unwrap_or_else(|_| panic!("no /status line after {line:?}"));
        printed
    }

    async fn quit(mut self) {
        self.type_line("/quit").await;
        let status = tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await.unwrap().unwrap();
        assert!(status.success(), "chat exited with {status}");
    }
}

/// How long a chat may take to print an expected line.
const LINE_WAIT: Duration = Duration::from_secs(20);

async fn expect_line(lines: &mut Out, needle: &str) -> String {
    let mut skipped = Vec::new();
    let found = tokio::time::timeout(LINE_WAIT, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains(needle) {
                return Some(line);
            }
            skipped.push(line);
        }
        None
    })
    .await;
    match found {
        Ok(Some(line)) => line,
        Ok(None) => panic!("chat ended before printing {needle:?}; it printed {skipped:#?}"),
        Err(_) => panic!("no line with {needle:?} within {LINE_WAIT:?}; it printed {skipped:#?}"),
    }
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

async fn server_with(dir: &std::path::Path, users: &[&str]) -> tidemark_server::RunningServer {
    let store = tidemark_sqlite::SqliteStore::open(&dir.join("server")).unwrap();
    let config = ServerConfig { admin_token: Some(ADMIN.into()), ..Default::default() };
    let server = Server::start("127.0.0.1:0", store, config).await.unwrap();
    let http = tidemark_client::Http::new(&server.url());
    for u in users {
        http.create_user(ADMIN, u, "pw").await.unwrap();
    }
    server
}

/// Mistakes print an `[error]` line and the session goes on; `/help`
/// describes every command; edit, react, recall, history, groups (create,
/// add, leave) between two chats. Ben's password comes from a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_survives_mistakes_and_drives_messages_and_groups() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), &["ann", "ben", "cat"]).await;
    let url = server.url();
    let mut ann = Session::new(chat(&url, "ann", dir.path(), None));
    ann.expect("(connected)").await;
    let pw_file = dir.path().join("ben.pw");
    std::fs::write(&pw_file, "pw\n").unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(["chat", "--server", &url, "--user", "ben", "--device", "cli", "--password-file"])
        .arg(&pw_file)
        .arg("--db")
        .arg(dir.path().join("ben.db"))
        .env_remove("TIDEMARK_PASSWORD");
    let mut ben = Session::new(spawn(cmd, None));
    ben.expect("(connected)").await;

    // Mistakes: reported on the line, the session kept.
    let printed = ann.run("/to nosuchuser").await;
    assert!(printed.iter().any(|l| l.starts_with("[error]") && l.contains("NOT_FOUND")), "{printed:?}");
    let printed = ann.run("hello?").await;
    assert!(printed.iter().any(|l| l.starts_with("[error] no conversation open")), "{printed:?}");
    let printed = ann.run("/bogus").await;
    assert!(printed.iter().any(|l| l.starts_with("[error]") && l.contains("/help")), "{printed:?}");
    let help = ann.run("/help").await;
    for cmd in ["/group", "/add", "/leave", "/recall", "/edit", "/react", "/history"] {
        let line = help.iter().find(|l| l.contains(cmd)).unwrap_or_else(|| panic!("/help lacks {cmd}: {help:?}"));
        assert!(line.split_whitespace().count() > 3, "/help describes {cmd}: {line}");
    }

    // Messages: send, edit, react, recall; both sides see each, as text.
    ann.type_line("/to ben").await;
    ann.expect("[chat] talking to ben").await;
    ann.type_line("lunch at 1?").await;
    let line = ben.expect("lunch at 1?").await;
    assert!(line.ends_with("#1] ann: lunch at 1?"), "{line}");
    let conv = line.trim_start_matches('[').split(' ').next().unwrap().to_owned();
    ben.type_line(&format!("/open {conv}")).await;
    ben.expect("[chat] talking in").await;
    let printed = ben.run("/recall 1").await;
    assert!(printed.iter().any(|l| l.contains("only its sender can recall")), "{printed:?}");
    ann.type_line("/edit 1 lunch at 2?").await;
    ben.expect("ann edited #1: lunch at 2?").await;
    ben.type_line("/react 1 👍").await;
    ann.expect("ben reacted 👍 to #1").await;
    let history = ann.run("/history").await;
    assert!(history.iter().any(|l| l.ends_with("#1] ann: lunch at 2? (edited)  [👍 1]")), "{history:?}");
    assert!(!history.iter().any(|l| l.contains('{')), "history is text, not JSON: {history:?}");
    ann.type_line("/recall 1").await;
    ben.expect("ann recalled #1").await;
    let history = ben.run("/history").await;
    assert!(history.iter().any(|l| l.ends_with("#1] ann: (recalled)")), "{history:?}");
    assert!(!history.iter().any(|l| l.contains("lunch")), "the recalled text is gone: {history:?}");

    // Groups: create, the member sees it, add, leave.
    ann.type_line("/group ben").await;
    let line = ann.expect("[chat] group ").await;
    let group = line.split(' ').nth(2).unwrap().to_owned();
    ann.type_line("hi group").await;
    ben.expect(&format!("new group conversation {group}")).await;
    ben.expect("ann created the group: ann, ben").await;
    ben.expect("ann: hi group").await;
    ann.type_line("/add cat").await;
    ben.expect("ann added cat").await;
    ben.type_line(&format!("/open {group}")).await;
    ben.expect("[chat] talking in").await;
    ben.type_line("/leave").await;
    ann.expect("ben left").await;
    let printed = ben.run("/add cat").await;
    assert!(printed.iter().any(|l| l.starts_with("[error]") && l.contains("NOT_MEMBER")), "{printed:?}");

    ann.quit().await;
    ben.quit().await;
    server.stop().await;
}

/// A chat started while its server is down says it is offline, queues what
/// is typed in the SDK's outbox instead of exiting, and delivers it once
/// the server is back (the conversation was opened in an earlier session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_started_offline_queues_and_delivers_later() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), &["ann", "ben", "cat"]).await;
    let addr = server.addr;
    let url = server.url();
    let mut ann = Session::new(chat(&url, "ann", dir.path(), Some("ben")));
    ann.expect("[chat] talking to ben").await;
    ann.quit().await;
    server.stop().await;

    let mut ann = Session::new(chat(&url, "ann", dir.path(), None));
    ann.expect("[status] offline").await;
    ann.type_line("/to ben").await;
    ann.expect("(offline: lines queue in the outbox)").await;
    ann.type_line("written while the server was down").await;
    ann.expect("[chat] queued in the outbox").await;
    // Cat never talked to Ben: no conversation id offline, so her line is
    // held and queued once the conversation opens.
    let mut cat = Session::new(chat(&url, "cat", dir.path(), Some("ben")));
    cat.expect("opens once connected").await;
    cat.type_line("cat was here").await;
    cat.expect("[chat] held until the conversation with ben opens").await;

    let store = tidemark_sqlite::SqliteStore::open(&dir.path().join("server")).unwrap();
    let config = ServerConfig { admin_token: Some(ADMIN.into()), ..Default::default() };
    let server = Server::start(&addr.to_string(), store, config).await.unwrap();
    ann.expect("(connected)").await;
    let mut ben = Session::new(chat(&url, "ben", dir.path(), None));
    cat.expect("[chat] 1 held line(s) queued in the outbox").await;
    // Two conversations, printed in the order Ben's chat lists them.
    let lines = ben.expect_all(&["written while the server was down", "cat was here"]).await;
    assert!(lines[0].ends_with("#1] ann: written while the server was down"), "{lines:?}");
    assert!(lines[1].ends_with("#1] cat: cat was here"), "{lines:?}");
    cat.quit().await;
    ann.quit().await;
    ben.quit().await;
    server.stop().await;
}

/// The ephemeral lane and read marks in the chat (issue 18): a peer's
/// presence and typing are printed, `/away` shows the user idle to the
/// peer, and `/seen` prints the members' read positions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_shows_presence_typing_and_read_marks() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), &["ann", "ben"]).await;
    let url = server.url();
    let mut ann = Session::new(chat(&url, "ann", dir.path(), Some("ben")));
    ann.expect("[chat] talking to ben").await;
    let mut ben = Session::new(chat(&url, "ben", dir.path(), Some("ann")));
    ben.expect("[chat] talking to ann").await;
    ann.expect("[presence] ben is online").await;
    ann.type_line("/typing").await;
    ben.expect("[typing] ann is typing in").await;
    ben.type_line("/away").await;
    ben.expect("[presence] others see you idle").await;
    ann.expect("[presence] ben is idle").await;
    ann.type_line("hello").await;
    ben.expect("ann: hello").await;
    ben.type_line("/read").await;
    ben.expect("[chat] read up to #1").await;
    // The read goes through ben's outbox: ask until the server has it.
    let deadline = tokio::time::Instant::now() + LINE_WAIT;
    loop {
        ann.type_line("/seen").await;
        let seen = ann.expect("[seen]").await;
        if seen.contains("ben #1") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "ben's read mark never showed: {seen}");
    }
    ann.quit().await;
    ben.quit().await;
    server.stop().await;
}
