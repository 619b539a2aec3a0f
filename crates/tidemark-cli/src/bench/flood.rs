//! `bench flood`: what a hostile client costs everyone else (issue 15).
//! Three processes, so the honest figures measure the server and not the
//! bench's own runtime: `tidemark serve` (a child, its default limits), the
//! attacker (a child: this binary's hidden `bench flood-attack`, its whole
//! attack on one thread, so it never takes more than one core), and the
//! honest user in this process. The honest user logs in from its own
//! address (127.0.0.2) every `--login-every-ms` and sends in a direct
//! conversation every `--send-every-ms`, through four phases of the same
//! run:
//!
//! - `quiet`: the honest user alone (the baseline);
//! - `login flood`: `--attackers` clients, each from its own loopback
//!   address (127.0.1.x, so the per-address quota alone does not stop
//!   them), post wrong passwords in a closed loop for a few real accounts
//!   and for names that do not exist;
//! - `send flood`: one attacking account on one address of its own
//!   (127.0.2.1) sends in `--attackers` concurrent closed loops, each on its
//!   own device's WebSocket, ignoring `retry_after_ms` (the account holds
//!   at most 20 connections, `--ws-connections-per-user-max`; the other
//!   loops' upgrades are refused), and a second account writes sends
//!   without waiting for any reply on `--pipelined` more WebSockets; a
//!   loop whose connection is closed (`kicked` `waits_ignored`, counted as
//!   closed) reconnects at once and goes on (counted as reconnects; an
//!   upgrade refused with `RATE_LIMITED` counts as a connect refused, and
//!   is retried at once);
//! - `connection flood`: one address (127.0.3.1) keeps `--connections` TCP
//!   connections open that send nothing, opening another as soon as the
//!   server closes one (counted as closed: at once, or by a timeout).
//!
//! `--no-hostile-limits` lifts the frame and request budgets per
//! connection and address, the reconnect penalty and the connection cap
//! per address (the server before them) for a same-machine comparison.
//!
//! Measured per phase: the honest login's latency (until it succeeds,
//! waits told by `RATE_LIMITED` included) and send latency, p50 and p99;
//! the server's peak RSS (sampled every 20 ms) and its CPU, and the
//! attacker's CPU (from /proc); and the attack's answers (accepted,
//! refused, `RATE_LIMITED`; the refusals answered a second, upgrades
//! refused included; connections the server closed). Ratios are attack /
//! quiet. The run then checks the bound of docs/protocol.md §1.6 (what one
//! address can cost an honest user) and prints whether it held.

use std::io::{BufRead, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tidemark_client::proto::{ErrorCode, SendReq};
use tidemark_client::{ClientError, Http, WsConn};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

use super::proc::{rss_kib, spawn_server_logging, ChildGuard};
use super::{print_table, unix_ms, TempDir, LATENCY_MAX_US};

#[derive(clap::Args, Debug, Clone)]
pub struct FloodArgs {
    /// Seconds of each phase (quiet, login flood, send flood, connection
    /// flood). 15 s gives the honest sender about 300 samples a phase: at
    /// 5 s its p99 is nearly its maximum, and the bound's p99 lines flip
    /// with one slow send.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Concurrent attacking clients (login flood: one loopback address
    /// each; send flood: concurrent send loops of one device).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=250))]
    pub attackers: u32,
    /// The honest user logs in this often.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(10..))]
    pub login_every_ms: u64,
    /// The honest user sends this often (the default stays well inside the
    /// per-device send quota, so the honest user is never limited itself).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..))]
    pub send_every_ms: u64,
    /// Failed logins from an address before its password checks wait in
    /// the suspect lane (the server's default; a huge value puts every
    /// check in one lane, the behaviour before the lanes, for a same-run
    /// comparison).
    #[arg(long, default_value_t = tidemark_core::throttle::SUSPECT_AFTER_FAILURES)]
    pub suspect_after_failures: u32,
    /// WebSockets of the send flood that write sends without waiting for
    /// replies (besides the `--attackers` closed loops).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub pipelined: u32,
    /// TCP connections the connection flood keeps open from its one
    /// address (each sends nothing; a closed one is opened again at once).
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub connections: u32,
    /// Lift the frame budgets, the per-address request budget, the
    /// reconnect penalty and the per-address connection cap (the server
    /// before them), to compare.
    #[arg(long)]
    pub no_hostile_limits: bool,
    /// The node's sustained write rate (messages a second) the bound
    /// assumes when it charges the writes a flood gets accepted to the
    /// honest send: the lowest `bench ingest` figure on the reference
    /// machine (docs/benchmarks.md).
    #[arg(long, default_value_t = INGEST_FLOOR_MSGS_PER_SEC)]
    pub ingest_floor: u32,
    /// Pin the attacker's process to this CPU (it runs on one thread
    /// anyway, so it never takes more than one core; pinned, it also
    /// always shares the same one).
    #[arg(long)]
    pub attacker_cpu: Option<usize>,
    #[arg(long, default_value = "bench-results/flood.json")]
    pub out: PathBuf,
    /// Where the temporary store goes.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The attacker's process (`bench flood-attack`, started by `bench flood`).
#[derive(clap::Args, Debug, Clone)]
pub struct AttackArgs {
    /// The plan `bench flood` wrote: the server, tokens, conversations.
    #[arg(long)]
    pub plan: PathBuf,
    #[arg(long, value_enum)]
    pub kind: AttackKind,
    /// Run on this CPU only.
    #[arg(long)]
    pub cpu: Option<usize>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttackKind {
    Login,
    Send,
    Connections,
}

/// What the attacker's process needs, from `bench flood`.
#[derive(Debug, Serialize, Deserialize)]
struct Plan {
    url: String,
    ws_url: String,
    attackers: u32,
    connections: u32,
    attacker_tokens: Vec<String>,
    pipe_tokens: Vec<String>,
    attacker_conv: String,
    piper_conv: String,
}

const HONEST: &str = "honest";
const HONEST_PASSWORD: &str = "honest password";
/// Real accounts the login flood guesses at (besides unknown names).
const VICTIMS: usize = 8;
/// The honest user's source address; the attackers' are 127.0.1.x.
const HONEST_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// The pipelined writers' account (its own, so the per-user connection
/// cap, which the closed loops' account already fills, does not keep them
/// out).
const PIPER: &str = "piper";
/// The send flood's one address.
const SEND_ATTACK_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 2, 1);
/// The connection flood's one address.
const CONNECTION_ATTACK_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 3, 1);
/// A connection of the connection flood closed within this long of its
/// connect was closed at once (over the cap), not by a timeout.
const CLOSED_AT_ONCE: Duration = Duration::from_millis(100);
/// Longest wait for the attacker's process to report after its phase.
const ATTACKER_REPORT_TIMEOUT: Duration = Duration::from_secs(20);
/// The write rate the bound assumes by default (`--ingest-floor`): below
/// every single-node `bench ingest` figure on the 2-core reference machine
/// (docs/benchmarks.md: 3 539–5 446 msgs/s in release, 1 888 with three
/// routed nodes on the same two cores).
const INGEST_FLOOR_MSGS_PER_SEC: u32 = 2_000;
/// Memory the bound allows the server per connection an address holds
/// (an idle WebSocket costs ~16 KiB, `bench connections`; a silent HTTP
/// connection its read buffer and task).
const CONNECTION_BOUND_KIB: f64 = 32.0;
/// The phases, in order; the first is the baseline.
const PHASES: [(&str, Option<AttackKind>); 4] = [
    ("quiet", None),
    ("login flood", Some(AttackKind::Login)),
    ("send flood", Some(AttackKind::Send)),
    ("connection flood", Some(AttackKind::Connections)),
];

#[derive(Debug, Serialize)]
struct Phase {
    phase: &'static str,
    seconds: f64,
    logins: u64,
    login_p50_ms: f64,
    login_p99_ms: f64,
    login_limited_waits: u64,
    sends: u64,
    send_p50_ms: f64,
    send_p99_ms: f64,
    /// The server process's peak resident set during the phase.
    peak_rss_mib: f64,
    /// CPU the server and the attacker used during the phase, in cores
    /// (CPU seconds per second).
    server_cpu_cores: f64,
    attacker_cpu_cores: f64,
    attack_requests_per_sec: f64,
    attack_accepted: u64,
    attack_refused: u64,
    attack_rate_limited: u64,
    /// Connections the attacker opened again after the server closed one.
    attack_reconnects: u64,
    /// Refusals the server answered a second: `RATE_LIMITED` and other
    /// error replies, and refused upgrades.
    attack_refusals_per_sec: f64,
    /// The attacker's connections the server closed, and its upgrades it
    /// refused (`RATE_LIMITED`).
    attack_closed: u64,
    attack_connects_refused: u64,
    /// Connections the server closed within `CLOSED_AT_ONCE` of their
    /// connect, a second (the connection flood).
    attack_closed_at_once_per_sec: f64,
}

/// What the attacker's process reports when its phase ends.
#[derive(Debug, Default, Serialize, Deserialize)]
struct AttackReport {
    requests: u64,
    accepted: u64,
    refused: u64,
    limited: u64,
    reconnects: u64,
    closed: u64,
    connects_refused: u64,
    closed_at_once: u64,
    cpu_secs: f64,
}

#[derive(Default)]
struct AttackCounts {
    requests: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    limited: AtomicU64,
    reconnects: AtomicU64,
    closed: AtomicU64,
    connects_refused: AtomicU64,
    closed_at_once: AtomicU64,
}

impl AttackCounts {
    /// Counts one connection attempt: refused (`Err(true)`: told to wait,
    /// `RATE_LIMITED`), failed otherwise, or open (a reconnect after the
    /// first); the connection when it opened.
    fn connected<T>(&self, first: &mut bool, attempt: Result<T, bool>) -> Option<T> {
        match attempt {
            Ok(conn) => {
                if !std::mem::take(first) {
                    self.reconnects.fetch_add(1, Ordering::Relaxed);
                }
                Some(conn)
            }
            Err(true) => {
                self.connects_refused.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(false) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    fn report(&self, cpu_secs: f64) -> AttackReport {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        AttackReport {
            requests: get(&self.requests),
            accepted: get(&self.accepted),
            refused: get(&self.refused),
            limited: get(&self.limited),
            reconnects: get(&self.reconnects),
            closed: get(&self.closed),
            connects_refused: get(&self.connects_refused),
            closed_at_once: get(&self.closed_at_once),
            cpu_secs,
        }
    }
}

/// A text `send` of `text` into `conv`.
fn text_send(conv: &str, client_msg_id: String, text: &str) -> SendReq {
    SendReq {
        conv: conv.to_owned(),
        client_msg_id,
        kind: "text".into(),
        content: json!({"text": text}),
        mentions: Vec::new(),
        mention_all: false,
    }
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// The `serve` flags that lift the hostile-client limits (the server
/// before them): frame and request budgets, reconnect penalty, the
/// per-address connection cap.
fn no_hostile_limit_flags() -> Vec<String> {
    let max = u32::MAX.to_string();
    let mut flags = Vec::new();
    for flag in [
        "--frames-per-sec",
        "--frames-burst",
        "--address-frames-per-sec",
        "--address-frames-burst",
        "--address-requests-per-sec",
        "--address-requests-burst",
    ] {
        flags.extend([flag.to_owned(), max.clone()]);
    }
    flags.extend(["--reconnect-penalty-ms".into(), "0".into(), "--reconnect-penalty-max-ms".into(), "0".into()]);
    flags.extend(["--connections-per-address".into(), usize::MAX.to_string()]);
    flags
}

/// The attacker's process: runs its attack on one thread until its stdin
/// ends, then prints its report as one JSON line.
pub async fn attack(args: AttackArgs) -> Result<()> {
    let plan: Plan = serde_json::from_slice(&std::fs::read(&args.plan)?)?;
    if let Some(cpu) = args.cpu {
        pin_to_cpu(cpu)?;
    }
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    // One thread, one single-threaded runtime: the attack takes at most one
    // core, whatever it does.
    std::thread::Builder::new().name("flood-attack".into()).spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
        let result = match runtime {
            Ok(rt) => rt.block_on(run_attack(plan, args.kind)),
            Err(e) => Err(e.into()),
        };
        let _ = done_tx.send(result);
    })?;
    let report = done_rx.await.context("the attack thread ended")??;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&report)?)?;
    out.flush()?;
    Ok(())
}

/// Pins the calling thread, and so the attack's thread it starts next
/// (threads inherit their creator's affinity), to `cpu`.
fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes within
    // it (cpu is checked against its size); sched_setaffinity(0, ...)
    // applies to the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        ensure!(cpu < libc::CPU_SETSIZE as usize, "no CPU {cpu}");
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error()).context("sched_setaffinity");
        }
    }
    Ok(())
}

async fn run_attack(plan: Plan, kind: AttackKind) -> Result<AttackReport> {
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(AttackCounts::default());
    let cpu_before = super::proc::cpu_secs("self")?;
    let mut attack = Vec::new();
    match kind {
        AttackKind::Login => {
            for i in 0..plan.attackers {
                let client = client_from(Ipv4Addr::new(127, 0, 1, 1 + i as u8))?;
                attack.push(tokio::spawn(login_loop(
                    i as usize,
                    client,
                    plan.url.clone(),
                    stop.clone(),
                    counts.clone(),
                )));
            }
        }
        AttackKind::Send => {
            for (t, token) in plan.attacker_tokens.iter().enumerate() {
                let (token, ws_url, conv) = (token.clone(), plan.ws_url.clone(), plan.attacker_conv.clone());
                attack.push(tokio::spawn(send_loop(t, token, ws_url, conv, stop.clone(), counts.clone())));
            }
            for (t, token) in plan.pipe_tokens.iter().enumerate() {
                let (token, ws_url, conv) = (token.clone(), plan.ws_url.clone(), plan.piper_conv.clone());
                attack.push(tokio::spawn(pipelined(t, token, ws_url, conv, stop.clone(), counts.clone())));
            }
        }
        AttackKind::Connections => {
            let addr: std::net::SocketAddr =
                plan.url.trim_start_matches("http://").parse().context("the server's address")?;
            for _ in 0..plan.connections {
                attack.push(tokio::spawn(connection_loop(addr, stop.clone(), counts.clone())));
            }
        }
    }
    // Until the bench closes our stdin.
    let mut stdin = tokio::io::stdin();
    let mut sink = Vec::new();
    let _ = tokio::io::AsyncReadExt::read_to_end(&mut stdin, &mut sink).await;
    stop.store(true, Ordering::Relaxed);
    for mut t in attack {
        // A pipelined writer may be blocked on a socket the server reads
        // no more of; a held connection waits for a close.
        if tokio::time::timeout(Duration::from_secs(2), &mut t).await.is_err() {
            t.abort();
        }
    }
    Ok(counts.report(super::proc::cpu_secs("self")? - cpu_before))
}

/// A client whose requests leave from `address`.
fn client_from(address: Ipv4Addr) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder().local_address(IpAddr::V4(address)).build()?)
}

/// One login; `Err(Some(wait))` when told to wait.
async fn login(
    client: &reqwest::Client,
    url: &str,
    user: &str,
    password: &str,
    device: &str,
) -> Result<Result<(), Option<u64>>> {
    let body = json!({"user": user, "password": password, "device_id": device});
    let resp = client.post(format!("{url}/v1/login")).json(&body).send().await?;
    if resp.status().is_success() {
        return Ok(Ok(()));
    }
    let v: serde_json::Value = resp.json().await.unwrap_or_default();
    Ok(Err(v["retry_after_ms"].as_u64()))
}

/// One guesser of the login flood: wrong passwords in a closed loop, half
/// at real accounts, half at names that do not exist (they cost the same
/// hash).
async fn login_loop(i: usize, client: reqwest::Client, url: String, stop: Arc<AtomicBool>, counts: Arc<AttackCounts>) {
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let user = if n.is_multiple_of(2) { format!("victim{}", (i + n) % VICTIMS) } else { format!("nobody{i}") };
        n += 1;
        counts.requests.fetch_add(1, Ordering::Relaxed);
        match login(&client, &url, &user, "wrong guess", "bot").await {
            Ok(Ok(())) => counts.accepted.fetch_add(1, Ordering::Relaxed),
            Ok(Err(Some(_))) => counts.limited.fetch_add(1, Ordering::Relaxed),
            Ok(Err(None)) | Err(_) => counts.refused.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// One closed loop of the send flood: sends on its device's WebSocket,
/// ignoring `retry_after_ms`, connecting again at once when closed or
/// refused.
async fn send_loop(
    t: usize,
    token: String,
    ws_url: String,
    conv: String,
    stop: Arc<AtomicBool>,
    counts: Arc<AttackCounts>,
) {
    let mut n = 0u64;
    let mut first = true;
    'connection: while !stop.load(Ordering::Relaxed) {
        counts.requests.fetch_add(1, Ordering::Relaxed);
        let from = IpAddr::V4(SEND_ATTACK_ADDRESS);
        let connected = WsConn::connect_from(&ws_url, &token, from).await.map_err(|e| match e {
            ClientError::Server(f) => f.code == ErrorCode::RateLimited,
            _ => false,
        });
        let Some((ws, _events)) = counts.connected(&mut first, connected) else { continue };
        while !stop.load(Ordering::Relaxed) {
            let req = text_send(&conv, format!("flood-{t}-{n}"), "flood");
            n += 1;
            counts.requests.fetch_add(1, Ordering::Relaxed);
            match ws.send(&req).await {
                Ok(_) => counts.accepted.fetch_add(1, Ordering::Relaxed),
                Err(ClientError::Server(f)) if f.code == ErrorCode::RateLimited => {
                    counts.limited.fetch_add(1, Ordering::Relaxed)
                }
                Err(ClientError::Server(_)) => counts.refused.fetch_add(1, Ordering::Relaxed),
                // Closed by the server: connect again.
                Err(_) => {
                    counts.closed.fetch_add(1, Ordering::Relaxed);
                    continue 'connection;
                }
            };
        }
    }
}

/// One place of the connection flood: a TCP connection from the attack
/// address that sends nothing and is held until the server closes it, then
/// opened again at once.
async fn connection_loop(server: std::net::SocketAddr, stop: Arc<AtomicBool>, counts: Arc<AttackCounts>) {
    use tokio::io::AsyncReadExt;
    while !stop.load(Ordering::Relaxed) {
        counts.requests.fetch_add(1, Ordering::Relaxed);
        let connected = async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(std::net::SocketAddr::new(IpAddr::V4(CONNECTION_ATTACK_ADDRESS), 0))?;
            socket.connect(server).await
        };
        let Ok(mut tcp) = connected.await else {
            counts.refused.fetch_add(1, Ordering::Relaxed);
            // Out of ports or descriptors: let the others run.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let opened = Instant::now();
        let mut buf = [0u8; 256];
        loop {
            tokio::select! {
                read = tcp.read(&mut buf) => match read {
                    Ok(0) | Err(_) => break,
                    Ok(_) => continue,
                },
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                }
            }
        }
        counts.closed.fetch_add(1, Ordering::Relaxed);
        if opened.elapsed() < CLOSED_AT_ONCE {
            counts.closed_at_once.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The bound of docs/protocol.md §1.6 checked on one flood phase against
/// the same run's quiet phase: what the attack got accepted stays within
/// its accounts' quotas; beyond that, the server spends no more CPU on it
/// than the attacker does; its connections cost at most their cap's
/// memory; an honest login waits behind at most the running hashes and
/// one suspect check; an honest send behind the writes the quotas let in
/// at once and the CPU the attack takes.
#[derive(Debug, Serialize)]
struct BoundCheck {
    phase: &'static str,
    /// Operations the attack got accepted, and the most its accounts'
    /// quotas allow in the phase.
    accepted: u64,
    accepted_max: u64,
    /// Server CPU above the quiet phase's, the attacker's, and what the
    /// bound allows (the attacker's, plus the hash permits for a login
    /// flood), in cores.
    server_cpu_over_quiet: f64,
    attacker_cpu: f64,
    cpu_allowed: f64,
    /// Server peak RSS above the quiet phase's, and what the connection
    /// cap allows (plus the password hashes, for a login flood).
    rss_over_quiet_mib: f64,
    rss_allowed_mib: f64,
    login_p99_ms: f64,
    login_p99_bound_ms: f64,
    send_p99_ms: f64,
    send_p99_bound_ms: f64,
    met: bool,
}

impl BoundCheck {
    fn of(args: &FloodArgs, quiet: &Phase, p: &Phase) -> BoundCheck {
        use tidemark_server::limits;
        let seconds = p.seconds;
        // The send flood's accounts: `attacker`, and `piper` when it writes.
        let accounts = match p.phase {
            "send flood" => 1 + u64::from(args.pipelined > 0),
            _ => 0,
        };
        let quota = limits::SEND_PER_USER_DEFAULT;
        let burst = accounts * u64::from(quota.burst);
        let accepted_max = burst + (accounts as f64 * f64::from(quota.per_second()) * seconds).ceil() as u64;
        let hashes = limits::PASSWORD_HASHES_CONCURRENT_MAX as f64;
        // Per address: its connections (cap and refusals in progress); a
        // login flood's addresses each hold one connection at a time, and
        // the hashes hold ~19 MiB each.
        let connections = match p.phase {
            "login flood" => f64::from(args.attackers),
            _ => (limits::CONNECTIONS_PER_ADDRESS_MAX_DEFAULT + limits::CONNECTION_REFUSALS_PER_ADDRESS_MAX) as f64,
        };
        let hash_mib = if p.phase == "login flood" { hashes * 19.0 } else { 0.0 };
        let rss_allowed_mib = connections * CONNECTION_BOUND_KIB / 1024.0 + hash_mib;
        let server_cpu_over_quiet = (p.server_cpu_cores - quiet.server_cpu_cores).max(0.0);
        // A login is about one hash: at most the running ones and one
        // suspect check ahead of it; a login flood's addresses each get
        // one clean guess first (their first failure), `attackers` hashes
        // spread over the permits once.
        let ahead = hashes + 1.0 + if p.phase == "login flood" { f64::from(args.attackers) / hashes } else { 0.0 };
        let login_p99_bound_ms = quiet.login_p99_ms + ahead * quiet.login_p50_ms;
        // The writes the quotas let in at once wait in the writer ahead of
        // an honest send; the attack's CPU on the server (the login flood's
        // hashes included) leaves the honest work that much less of the
        // cores, and so does the attacker's own here, on the same machine.
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
        let share = ((server_cpu_over_quiet + p.attacker_cpu_cores) / cores).min(0.9);
        let send_p99_bound_ms =
            quiet.send_p99_ms / (1.0 - share) + burst as f64 * 1000.0 / f64::from(args.ingest_floor);
        // Amplification: a hash is work the budgets admit (bounded by the
        // permits), so a login flood may take up to the permits' cores.
        let cpu_allowed = p.attacker_cpu_cores + if p.phase == "login flood" { hashes } else { 0.0 };
        let rss_over_quiet_mib = (p.peak_rss_mib - quiet.peak_rss_mib).max(0.0);
        let met = p.attack_accepted <= accepted_max
            && server_cpu_over_quiet <= cpu_allowed
            && rss_over_quiet_mib <= rss_allowed_mib
            && p.login_p99_ms <= login_p99_bound_ms
            && p.send_p99_ms <= send_p99_bound_ms;
        BoundCheck {
            phase: p.phase,
            accepted: p.attack_accepted,
            accepted_max,
            server_cpu_over_quiet,
            attacker_cpu: p.attacker_cpu_cores,
            cpu_allowed,
            rss_over_quiet_mib,
            rss_allowed_mib,
            login_p99_ms: p.login_p99_ms,
            login_p99_bound_ms,
            send_p99_ms: p.send_p99_ms,
            send_p99_bound_ms,
            met,
        }
    }
}

impl std::fmt::Display for BoundCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mark = |ok: bool| if ok { "ok" } else { "OVER" };
        write!(
            f,
            "bound, {}: accepted {} <= {} {}; server CPU over quiet {:.2} <= {:.2} cores (attacker {:.2}) {}; RSS over quiet {:.1} <= {:.1} MiB {}; login p99 {:.1} <= {:.1} ms {}; send p99 {:.2} <= {:.2} ms {}",
            self.phase,
            self.accepted,
            self.accepted_max,
            mark(self.accepted <= self.accepted_max),
            self.server_cpu_over_quiet,
            self.cpu_allowed,
            self.attacker_cpu,
            mark(self.server_cpu_over_quiet <= self.cpu_allowed),
            self.rss_over_quiet_mib,
            self.rss_allowed_mib,
            mark(self.rss_over_quiet_mib <= self.rss_allowed_mib),
            self.login_p99_ms,
            self.login_p99_bound_ms,
            mark(self.login_p99_ms <= self.login_p99_bound_ms),
            self.send_p99_ms,
            self.send_p99_bound_ms,
            mark(self.send_p99_ms <= self.send_p99_bound_ms),
        )
    }
}

/// The attacker's process for one phase: started, fed the plan, stopped
/// by closing its stdin.
struct Attacker {
    child: ChildGuard,
}

impl Attacker {
    fn start(plan: &Path, kind: AttackKind, cpu: Option<usize>) -> Result<Attacker> {
        let kind = match kind {
            AttackKind::Login => "login",
            AttackKind::Send => "send",
            AttackKind::Connections => "connections",
        };
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "flood-attack", "--kind", kind, "--plan"]).arg(plan);
        if let Some(cpu) = cpu {
            cmd.args(["--cpu", &cpu.to_string()]);
        }
        let child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("start the attacker's process")?;
        Ok(Attacker { child: ChildGuard(child) })
    }

    /// Stops the attack and reads its report.
    async fn stop(mut self) -> Result<AttackReport> {
        drop(self.child.0.stdin.take());
        let stdout = self.child.0.stdout.take().context("the attacker's stdout")?;
        let read = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout).read_line(&mut line).map(|_| line)
        });
        let line = tokio::time::timeout(ATTACKER_REPORT_TIMEOUT, read)
            .await
            .context("the attacker did not report in time")???;
        if line.trim().is_empty() {
            bail!("the attacker's process ended without a report");
        }
        Ok(serde_json::from_str(&line)?)
    }
}

/// The server's store, with real Argon2 hashes (a known account's guess
/// costs what a login costs), written before the server starts.
async fn create_accounts(dir: &Path) -> Result<()> {
    let store = SqliteStore::open(dir).context("open store")?;
    let honest_hash = tidemark_server::accounts::hash_password(HONEST_PASSWORD).map_err(anyhow::Error::msg)?;
    store.create_user(HONEST, &honest_hash, unix_ms()).await?;
    for n in ["peer", "attacker", PIPER] {
        store.create_user(n, &honest_hash, unix_ms()).await?;
    }
    for i in 0..VICTIMS {
        let hash =
            tidemark_server::accounts::hash_password(&format!("victim password {i}")).map_err(anyhow::Error::msg)?;
        store.create_user(&format!("victim{i}"), &hash, unix_ms()).await?;
    }
    let weak = Arc::downgrade(&store);
    drop(store);
    super::wait_store_closed(weak, dir).await;
    Ok(())
}

pub async fn run(args: FloodArgs) -> Result<()> {
    let root = TempDir::create(&args.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let data = root.0.join("server");
    std::fs::create_dir_all(&data)?;
    create_accounts(&data).await?;
    let mut serve: Vec<String> = ["serve", "--listen", "127.0.0.1:0", "--data"].map(String::from).to_vec();
    serve.push(data.display().to_string());
    serve.extend(["--login-suspect-after-failures".into(), args.suspect_after_failures.to_string()]);
    if args.no_hostile_limits {
        serve.extend(no_hostile_limit_flags());
    }
    let serve: Vec<&str> = serve.iter().map(String::as_str).collect();
    // Errors only: every refused guess is a warning line of the server.
    let (server, addr) = spawn_server_logging(&serve, "error").context("start tidemark serve")?;
    let phases = phases(&args, &server, addr, &root.0).await?;
    drop(server);
    let rows: Vec<Vec<String>> = phases
        .iter()
        .map(|p| {
            vec![
                p.phase.to_string(),
                format!("{:.1} / {:.1}", p.login_p50_ms, p.login_p99_ms),
                format!("{:.2} / {:.2}", p.send_p50_ms, p.send_p99_ms),
                format!("{:.0}", p.peak_rss_mib),
                format!("{:.2} / {:.2}", p.server_cpu_cores, p.attacker_cpu_cores),
                format!("{:.0}", p.attack_requests_per_sec),
                format!("{} / {} / {}", p.attack_accepted, p.attack_refused, p.attack_rate_limited),
                p.attack_reconnects.to_string(),
                format!("{:.0}", p.attack_refusals_per_sec),
                format!("{} / {} / {:.0}", p.attack_closed, p.attack_connects_refused, p.attack_closed_at_once_per_sec),
            ]
        })
        .collect();
    print_table(
        &[
            "phase",
            "honest login p50/p99 ms",
            "honest send p50/p99 ms",
            "server peak RSS MiB",
            "CPU cores server / attacker",
            "attack req/s",
            "attack ok/refused/limited",
            "attack reconnects",
            "refusals/s",
            "attack closed / connects refused / closed at once per s",
        ],
        &rows,
    );
    let quiet = &phases[0];
    let ratio = |a: f64, b: f64| a / b.max(0.001);
    let checks: Vec<BoundCheck> = phases[1..].iter().map(|p| BoundCheck::of(&args, quiet, p)).collect();
    for p in &phases[1..] {
        println!(
            "{} / quiet: login p99 {:.2}x, send p99 {:.2}x, server peak RSS {:.0} MiB (quiet {:.0}), server CPU {:.2} cores (quiet {:.2}) for the attacker's {:.2}; the attack's sends accepted {} of {}",
            p.phase,
            ratio(p.login_p99_ms, quiet.login_p99_ms),
            ratio(p.send_p99_ms, quiet.send_p99_ms),
            p.peak_rss_mib,
            quiet.peak_rss_mib,
            p.server_cpu_cores,
            quiet.server_cpu_cores,
            p.attacker_cpu_cores,
            p.attack_accepted,
            p.attack_accepted + p.attack_rate_limited + p.attack_refused
        );
    }
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut report = json!({
        "attackers": args.attackers, "pipelined": args.pipelined, "connections": args.connections,
        "hostile_limits": !args.no_hostile_limits, "attacker_cpu": args.attacker_cpu,
        "suspect_after_failures": args.suspect_after_failures, "login_every_ms": args.login_every_ms, "send_every_ms": args.send_every_ms,
        "phases": phases,
    });
    for c in &checks {
        println!("{c}");
    }
    let met = checks.iter().all(|c| c.met);
    println!(
        "bound of docs/protocol.md §1.6 (what one address costs an honest user): {}",
        if met { "met" } else { "NOT met" }
    );
    report["bound"] = json!({"met": met, "checks": checks});
    for p in &phases[1..] {
        let key = p.phase.replace(' ', "_");
        report[format!("{key}_login_p99_ratio")] = json!(ratio(p.login_p99_ms, quiet.login_p99_ms));
        report[format!("{key}_send_p99_ratio")] = json!(ratio(p.send_p99_ms, quiet.send_p99_ms));
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

async fn phases(args: &FloodArgs, server: &ChildGuard, addr: std::net::SocketAddr, dir: &Path) -> Result<Vec<Phase>> {
    let url = format!("http://{addr}");
    let ws_url = format!("ws://{addr}/v1/ws");
    let server_pid = server.pid().to_string();
    let http = Http::new(&url);
    let honest_login = http.login(HONEST, HONEST_PASSWORD, "laptop").await?;
    // From its own address, as the attackers are from theirs.
    let (honest_ws, _honest_events) =
        WsConn::connect_from(&ws_url, &honest_login.access_token, IpAddr::V4(HONEST_ADDRESS)).await?;
    let direct = honest_ws.conv_create_direct("peer").await?.conv;
    // The send flood's devices, one per loop, logged in before any phase.
    let mut attacker_tokens = Vec::new();
    for t in 0..args.attackers {
        attacker_tokens.push(http.login("attacker", HONEST_PASSWORD, &format!("bot{t}")).await?.access_token);
    }
    let mut pipe_tokens = Vec::new();
    for t in 0..args.pipelined {
        pipe_tokens.push(http.login(PIPER, HONEST_PASSWORD, &format!("pipe{t}")).await?.access_token);
    }
    let attacker_conv = {
        let (ws, _events) = WsConn::connect(&ws_url, &attacker_tokens[0]).await?;
        ws.conv_create_direct("peer").await?.conv
    };
    let piper_conv = match pipe_tokens.first() {
        Some(token) => WsConn::connect(&ws_url, token).await?.0.conv_create_direct("peer").await?.conv,
        None => String::new(),
    };
    let plan_path = dir.join("attack-plan.json");
    let plan = Plan {
        url: url.clone(),
        ws_url,
        attackers: args.attackers,
        connections: args.connections,
        attacker_tokens,
        pipe_tokens,
        attacker_conv,
        piper_conv,
    };
    std::fs::write(&plan_path, serde_json::to_vec(&plan)?)?;
    let honest_client = client_from(HONEST_ADDRESS)?;

    let mut out = Vec::new();
    for (phase, kind) in PHASES {
        let stop = Arc::new(AtomicBool::new(false));
        let attacker = kind.map(|k| Attacker::start(&plan_path, k, args.attacker_cpu)).transpose()?;
        // Peak RSS of the server while the phase runs.
        let peak = Arc::new(AtomicU64::new(0));
        let sampler = {
            let (peak, stop, pid) = (peak.clone(), stop.clone(), server.pid());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(kib) = rss_kib(pid) {
                        peak.fetch_max(kib, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        // The honest logins, on their own task, paced.
        let honest_logins = {
            let (client, url, stop) = (honest_client.clone(), url.clone(), stop.clone());
            let every = Duration::from_millis(args.login_every_ms);
            tokio::spawn(async move {
                let mut h = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3).expect("histogram bounds");
                let mut waits = 0u64;
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep_until(next.into()).await;
                    next += every;
                    let t = Instant::now();
                    loop {
                        match login(&client, &url, HONEST, HONEST_PASSWORD, "phone").await {
                            Ok(Ok(())) => break,
                            Ok(Err(Some(wait))) => {
                                waits += 1;
                                tokio::time::sleep(Duration::from_millis(wait)).await;
                            }
                            Ok(Err(None)) | Err(_) => return Err(anyhow::anyhow!("the honest login was refused")),
                        }
                    }
                    h.record((t.elapsed().as_micros() as u64).clamp(1, LATENCY_MAX_US)).expect("in bounds");
                }
                Ok((h, waits))
            })
        };
        let server_cpu_before = super::proc::cpu_secs(&server_pid)?;
        let started = Instant::now();
        let mut send_h = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)?;
        let mut n = 0u64;
        let mut next = Instant::now();
        let every = Duration::from_millis(args.send_every_ms);
        while started.elapsed() < Duration::from_secs(args.seconds) {
            tokio::time::sleep_until(next.into()).await;
            next += every;
            let req = text_send(&direct, format!("honest-{phase}-{n}"), "hello");
            let t = Instant::now();
            honest_ws.send(&req).await.context("the honest send")?;
            send_h.record((t.elapsed().as_micros() as u64).clamp(1, LATENCY_MAX_US))?;
            n += 1;
        }
        let seconds = started.elapsed().as_secs_f64();
        let server_cpu = super::proc::cpu_secs(&server_pid)? - server_cpu_before;
        stop.store(true, Ordering::Relaxed);
        let attack = match attacker {
            Some(a) => a.stop().await.with_context(|| format!("the attacker of phase {phase}"))?,
            None => AttackReport::default(),
        };
        let _ = sampler.await;
        let (login_h, waits) = honest_logins.await??;
        ensure!(n > 0 && !login_h.is_empty(), "the honest user did nothing in phase {phase}");
        out.push(Phase {
            phase,
            seconds,
            logins: login_h.len(),
            login_p50_ms: ms(login_h.value_at_quantile(0.5)),
            login_p99_ms: ms(login_h.value_at_quantile(0.99)),
            login_limited_waits: waits,
            sends: n,
            send_p50_ms: ms(send_h.value_at_quantile(0.5)),
            send_p99_ms: ms(send_h.value_at_quantile(0.99)),
            peak_rss_mib: peak.load(Ordering::Relaxed) as f64 / 1024.0,
            server_cpu_cores: server_cpu / seconds,
            attacker_cpu_cores: attack.cpu_secs / seconds,
            attack_requests_per_sec: attack.requests as f64 / seconds,
            attack_accepted: attack.accepted,
            attack_refused: attack.refused,
            attack_rate_limited: attack.limited,
            attack_reconnects: attack.reconnects,
            attack_refusals_per_sec: (attack.limited + attack.refused + attack.connects_refused) as f64 / seconds,
            attack_closed: attack.closed,
            attack_connects_refused: attack.connects_refused,
            attack_closed_at_once_per_sec: attack.closed_at_once as f64 / seconds,
        });
    }
    Ok(out)
}

/// One WebSocket of the send flood that writes sends as fast as its socket
/// takes them, never waiting for a reply, from the attack address; a
/// connection the server ends is opened again at once.
async fn pipelined(
    t: usize,
    token: String,
    ws_url: String,
    conv: String,
    stop: Arc<AtomicBool>,
    counts: Arc<AttackCounts>,
) {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let mut n = 0u64;
    let mut first = true;
    while !stop.load(Ordering::Relaxed) {
        counts.requests.fetch_add(1, Ordering::Relaxed);
        let Ok(mut request) = ws_url.as_str().into_client_request() else { return };
        let Ok(bearer) = format!("Bearer {token}").parse() else { return };
        request.headers_mut().insert("authorization", bearer);
        let connected = async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(std::net::SocketAddr::new(IpAddr::V4(SEND_ATTACK_ADDRESS), 0))?;
            let addr = request.uri().authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
            let peer =
                tokio::net::lookup_host(addr).await?.next().ok_or_else(|| std::io::Error::other("no address"))?;
            let tcp = socket.connect(peer).await?;
            tcp.set_nodelay(true)?;
            Ok::<_, std::io::Error>(tcp)
        };
        let Ok(tcp) = connected.await else {
            counts.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let upgraded = tokio_tungstenite::client_async(request, tcp).await.map_err(|e| match e {
            tokio_tungstenite::tungstenite::Error::Http(resp) => resp.status().as_u16() == 429,
            _ => false,
        });
        let Some((ws, _)) = counts.connected(&mut first, upgraded) else { continue };
        let (mut sink, mut stream) = ws.split();
        let reader = {
            let counts = counts.clone();
            async move {
                while let Some(Ok(msg)) = stream.next().await {
                    let Message::Text(text) = msg else { continue };
                    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    match (v["t"].as_str(), v["code"].as_str()) {
                        (Some("send"), _) => counts.accepted.fetch_add(1, Ordering::Relaxed),
                        (Some("error"), Some("RATE_LIMITED")) => counts.limited.fetch_add(1, Ordering::Relaxed),
                        (Some("error"), _) => counts.refused.fetch_add(1, Ordering::Relaxed),
                        _ => continue,
                    };
                }
            }
        };
        tokio::pin!(reader);
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let frame = json!({"t": "send", "rid": format!("p{t}-{n}"), "conv": conv,
                "client_msg_id": format!("pipe-{t}-{n}"), "kind": "text", "content": {"text": "flood"}});
            n += 1;
            tokio::select! {
                // The server ended the connection.
                _ = &mut reader => break,
                sent = sink.send(Message::Text(frame.to_string().into())) => if sent.is_err() { break },
            }
            counts.requests.fetch_add(1, Ordering::Relaxed);
        }
        counts.closed.fetch_add(1, Ordering::Relaxed);
    }
}
