//! HTTP timeouts against the real `tidemark serve`: 300 silent, idle or
//! trickling connections are each closed by the timeout meant for them
//! (`--http-idle-timeout-ms`, `--http-header-timeout-ms`,
//! `--http-body-timeout-ms`, `--http-request-timeout-ms`), and with a file
//! limit lower than the connections, `/healthz` still answers and every
//! connection still ends.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const IDLE: Duration = Duration::from_millis(1000);
const HEADER: Duration = Duration::from_millis(4500);
const BODY: Duration = Duration::from_millis(1000);
const REQUEST: Duration = Duration::from_millis(4500);
/// The trickling clients send a few bytes this often: well inside the idle
/// and body timeouts, so only the header or request timeout can end them.
const TRICKLE_EVERY: Duration = Duration::from_millis(200);
/// How late after its timeout a close may be seen on a loaded machine;
/// below HEADER - IDLE and REQUEST - BODY, so a connection the shorter
/// timeout failed to end (and the longer one ended) is seen.
const SLACK: Duration = Duration::from_millis(2500);
const CONNECTIONS: usize = 300;

struct Serve {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `tidemark serve` with the short timeouts above and, when given, at most
/// `files` open file descriptors (set in the child only).
fn serve(files: Option<u64>) -> Serve {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let ms = |d: Duration| d.as_millis().to_string();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path())
        .args(["--http-idle-timeout-ms", &ms(IDLE)])
        .args(["--http-header-timeout-ms", &ms(HEADER)])
        .args(["--http-body-timeout-ms", &ms(BODY)])
        .args(["--http-request-timeout-ms", &ms(REQUEST)])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(files) = files {
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between
        // fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let lim = libc::rlimit { rlim_cur: files, rlim_max: files };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().expect("spawn tidemark serve");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("tidemark listening on ").expect("the server started").to_owned();
    Serve { child, addr, _dir: dir }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Connects and sends nothing.
    Silent,
    /// One whole request, its response read, then silence.
    KeepAliveIdle,
    /// A request line, then a header line every TRICKLE_EVERY, never done.
    HeaderTrickle,
    /// A whole head announcing 1000 bytes of body, 6 bytes, then nothing.
    BodyStall,
    /// The same head, then 6 bytes every TRICKLE_EVERY.
    BodyTrickle,
}

const KINDS: [Kind; 5] = [Kind::Silent, Kind::KeepAliveIdle, Kind::HeaderTrickle, Kind::BodyStall, Kind::BodyTrickle];

impl Kind {
    /// The timeout that must end this connection.
    fn timeout(self) -> Duration {
        match self {
            Kind::Silent | Kind::KeepAliveIdle => IDLE,
            Kind::HeaderTrickle => HEADER,
            Kind::BodyStall => BODY,
            Kind::BodyTrickle => REQUEST,
        }
    }

    /// The status of the response sent before the close, if any.
    fn status(self) -> Option<&'static str> {
        match self {
            Kind::BodyStall => Some("400"),
            Kind::BodyTrickle => Some("408"),
            _ => None,
        }
    }
}

const BODY_HEAD: &str =
    "POST /v1/login HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n";

/// What one connection saw: how long after its connect (or, for the
/// keep-alive one, after it sent its request) the server closed it, and the
/// status line of the response it got before the close.
#[derive(Debug)]
struct Closed {
    kind: Kind,
    after: Duration,
    status: Option<String>,
}

/// Runs one connection of `kind` until the server closes it (or `give_up`).
async fn one(addr: String, kind: Kind, give_up: Duration) -> Closed {
    // Before the connect: the server's clocks start at its accept, which
    // may come before this task sees the connect return.
    let mut start = Instant::now();
    let mut tcp = TcpStream::connect(&addr).await.expect("connect");
    match kind {
        Kind::Silent => {}
        Kind::KeepAliveIdle => {
            // The idle period starts at the response, after this.
            start = Instant::now();
            tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            // The response is small: read until its body's closing brace.
            while !got.ends_with(b"}") {
                let n = tcp.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before the response");
                got.extend_from_slice(&buf[..n]);
            }
            assert!(got.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
        }
        Kind::HeaderTrickle => tcp.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap(),
        Kind::BodyStall | Kind::BodyTrickle => tcp.write_all(format!("{BODY_HEAD}{{\"a\":").as_bytes()).await.unwrap(),
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let mut trickle = tokio::time::interval(TRICKLE_EVERY);
    trickle.tick().await;
    let deadline = start + give_up;
    let mut n = 0u32;
    loop {
        tokio::select! {
            r = tcp.read(&mut buf) => match r {
                Ok(0) | Err(_) => break,
                Ok(k) => got.extend_from_slice(&buf[..k]),
            },
            _ = trickle.tick(), if matches!(kind, Kind::HeaderTrickle | Kind::BodyTrickle) => {
                n += 1;
                let bytes = if kind == Kind::HeaderTrickle { format!("X-T{n}: y\r\n") } else { "\"aaa\",".to_owned() };
                if tcp.write_all(bytes.as_bytes()).await.is_err() {
                    break;
                }
            }
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    let status = (!got.is_empty()).then(|| String::from_utf8_lossy(&got[9..12.min(got.len())]).into_owned());
    Closed { kind, after: start.elapsed(), status }
}

/// `GET /healthz` on a new connection; `None` unless it answers 200 within `within`.
async fn healthz(addr: &str, within: Duration) -> Option<()> {
    tokio::time::timeout(within, async {
        let mut tcp = TcpStream::connect(addr).await.ok()?;
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").await.ok()?;
        let mut got = Vec::new();
        tcp.read_to_end(&mut got).await.ok()?;
        got.starts_with(b"HTTP/1.1 200").then_some(())
    })
    .await
    .ok()
    .flatten()
}

fn flood(addr: &str, give_up: Duration) -> Vec<tokio::task::JoinHandle<Closed>> {
    (0..CONNECTIONS).map(|i| tokio::spawn(one(addr.to_owned(), KINDS[i % KINDS.len()], give_up))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_slow_or_silent_connection_is_closed_by_its_own_timeout() {
    let server = serve(None);
    let longest = HEADER.max(REQUEST) + SLACK;
    let tasks = flood(&server.addr, longest * 2);
    // The server answers while they are all open.
    assert!(healthz(&server.addr, Duration::from_secs(5)).await.is_some(), "/healthz did not answer");
    let mut seen = Vec::new();
    for t in tasks {
        seen.push(t.await.unwrap());
    }
    for c in &seen {
        let timeout = c.kind.timeout();
        // Never before its own timeout (so no other, shorter one ended it),
        // and soon after it.
        assert!(c.after >= timeout, "{c:?}: closed before its {timeout:?} timeout");
        assert!(c.after <= timeout + SLACK, "{c:?}: still open {:?} after its {timeout:?} timeout", c.after);
        assert_eq!(c.status.as_deref(), c.kind.status(), "{c:?}");
    }
    assert!(healthz(&server.addr, Duration::from_secs(5)).await.is_some(), "/healthz did not answer afterwards");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fewer_file_descriptors_than_connections_the_server_still_answers_and_closes_them_all() {
    // 256 descriptors (a few dozen taken by the store and the runtime): the
    // 300 connections cannot all be accepted at once; the rest wait in the
    // listen queue until timeouts free descriptors.
    let server = serve(Some(256));
    let longest = HEADER.max(REQUEST) + SLACK;
    let started = Instant::now();
    let tasks = flood(&server.addr, longest * 4);
    // Wait until every connection is established (queued or accepted).
    tokio::task::yield_now().await;
    let answered = {
        let deadline = Instant::now() + longest * 2;
        loop {
            if healthz(&server.addr, Duration::from_secs(2)).await.is_some() {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
        }
    };
    assert!(answered, "/healthz never answered while the flood held the descriptors");
    let mut seen = Vec::new();
    for t in tasks {
        seen.push(t.await.unwrap());
    }
    // A connection waits in the queue for at most the longest timeout of
    // the ones before it, then gets its own.
    let bound = longest * 2 + SLACK;
    for c in &seen {
        assert!(c.after <= bound, "{c:?}: still open after {bound:?}");
    }
    let all_within = started.elapsed();
    assert!(healthz(&server.addr, Duration::from_secs(5)).await.is_some(), "/healthz did not answer afterwards");
    eprintln!("300 connections against 256 descriptors: all closed within {all_within:?}");
}
