//! The `tidemark` command: `serve`, `user add`, `bench`, `demo` and `chat`.

mod admin;
mod bench;
mod chat;
mod demo;

use std::io::{BufRead, IsTerminal};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use tidemark_server::bus::HintBusConfig;
use tidemark_server::limits;
use tidemark_server::{Server, ServerConfig};
use tidemark_sqlite::SqliteStore;
use tidemark_store::Store;

#[derive(Parser)]
#[command(
    name = "tidemark",
    version,
    about = "Instant messaging that never loses, duplicates or misorders a message",
    after_help = "Logs go to stderr; RUST_LOG sets their level and filter (default info), e.g. \
                  RUST_LOG=debug or RUST_LOG=tidemark_server=debug,warn."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct StoreArgs {
    /// Data directory of the embedded SQLite store.
    #[arg(long, default_value = "./data")]
    data: PathBuf,
    /// PostgreSQL URL (cluster mode), e.g. postgres://user@host:5432/db;
    /// replaces --data. Every node of a cluster names the same database.
    /// Give a URL with a password through TIDEMARK_DATABASE (or use
    /// ~/.pgpass), not on the command line, where `ps` shows it.
    #[arg(long, env = "TIDEMARK_DATABASE", hide_env_values = true)]
    database: Option<String>,
    /// PostgreSQL schema holding the tables (created if absent); default:
    /// the server's search_path (normally `public`).
    #[arg(long, requires = "database")]
    database_schema: Option<String>,
    /// Writer connections for conversation events, each owning a hash
    /// partition of the conversations (one writer per conversation).
    #[arg(long, requires = "database", default_value_t = tidemark_postgres::CONV_WRITERS_DEFAULT as u16,
          value_parser = clap::value_parser!(u16).range(1..=tidemark_postgres::CONV_WRITERS_MAX as i64))]
    database_conv_writers: u16,
}

// Parsed once per process: the size of `Serve`'s flags costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the server.
    #[command(after_help = "The admin token (enables /v1/admin/*) comes from TIDEMARK_ADMIN_TOKEN or \
                            --admin-token-file, never from the command line. RUST_LOG sets the log \
                            level (default info).")]
    Serve {
        /// Address to listen on (HTTP and WebSocket); port 0 picks a free
        /// one, printed on stdout as `tidemark listening on ADDR`.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        #[command(flatten)]
        store: StoreArgs,
        /// NATS URL for cross-node hints (cluster mode), e.g.
        /// nats://127.0.0.1:4222; without it hints stay in this process.
        #[arg(long)]
        nats: Option<String>,
        /// NATS subject prefix shared by the nodes of one cluster; a hint
        /// for user U goes to `<prefix>.U`.
        #[arg(long, default_value = tidemark_server::bus::HINT_SUBJECT_PREFIX_DEFAULT, requires = "nats")]
        nats_prefix: String,
        /// Read the admin token from the first line of this file (instead
        /// of TIDEMARK_ADMIN_TOKEN); without either the admin endpoints
        /// are disabled.
        #[arg(long)]
        admin_token_file: Option<PathBuf>,
        /// Access token lifetime, seconds.
        #[arg(long, default_value_t = 900)]
        access_ttl_secs: u64,
        /// Message history older than this many days expires; by default
        /// history is kept forever.
        #[arg(long)]
        history_keep_days: Option<u32>,
        /// User sync log retention: entries younger than this many seconds
        /// are never trimmed, even behind every device's cursor.
        #[arg(long, default_value_t = 7 * 24 * 3600)]
        log_keep_secs: u64,
        /// A device whose server cursor has not moved for this many seconds
        /// stops holding the user's log back; when it returns behind the
        /// trim point it rebuilds from a snapshot.
        #[arg(long, default_value_t = 30 * 24 * 3600)]
        device_inactive_secs: u64,
        /// How often the retention pass runs, milliseconds.
        #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(10..))]
        retention_every_ms: u64,
        /// Run the reconciliation job (repairs on) every this many
        /// seconds; 0 (the default): only on demand, by POST
        /// /v1/admin/reconcile or `tidemark admin reconcile`.
        #[arg(long, default_value_t = 0)]
        reconcile_every_secs: u64,
        /// Fan-out lag (age of the oldest outbox item the relay claims) at
        /// which the node counts as behind: hints are only merged,
        /// retention and scheduled reconciliation wait, typing and presence
        /// are refused with RATE_LIMITED (seed §9.4).
        #[arg(long, default_value_t = tidemark_core::degrade::LOAD_BOUNDS_DEFAULT.behind_ms)]
        load_behind_ms: u64,
        /// Fan-out lag at which the node counts as overloaded: offline push
        /// waits too.
        #[arg(long, default_value_t = tidemark_core::degrade::LOAD_BOUNDS_DEFAULT.overloaded_ms)]
        load_overloaded_ms: u64,
        /// Keep every user-log entry (no retention pass at all).
        #[arg(long, conflicts_with_all = ["log_keep_secs", "device_inactive_secs"])]
        keep_all_logs: bool,
        /// Lifetime of a snapshot, and of its retention fence, seconds.
        #[arg(long, default_value_t = 30 * 60)]
        snapshot_ttl_secs: u64,
        /// Latest messages per conversation a snapshot carries.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        snapshot_messages_per_conv: u32,
        /// The longest first sync batch a device replays: a new, rebuilding
        /// or lagging device whose batch would hold more events installs a
        /// snapshot instead.
        #[arg(long, default_value_t = tidemark_core::cursor::REPLAY_EVENTS_MAX)]
        replay_max_events: u64,
        /// `/metrics` reads the store's gauges (a scan of every user head
        /// and device) at most every this many seconds; 0: every scrape.
        #[arg(long, default_value_t = tidemark_server::config::GAUGES_EVERY_DEFAULT.as_secs())]
        gauges_every_secs: u64,
        /// Most WebSocket connections this node holds at once; further
        /// upgrades are refused with UNAVAILABLE and a retry hint.
        #[arg(long, default_value_t = tidemark_server::config::WS_CONNECTIONS_MAX_DEFAULT)]
        ws_connections_max: usize,
        /// A group with more active members than this reads a shared log
        /// with dirty markers instead of per-member fan-out (large groups;
        /// one-way; at most 1000, the per-member cap).
        #[arg(long, default_value_t = tidemark_core::large::LARGE_GROUP_MEMBERS_DEFAULT,
              value_parser = clap::value_parser!(u64).range(0..=tidemark_core::large::PER_MEMBER_MAX))]
        large_group_members: u64,
        /// Most WebSocket connections one user holds on this node; one more
        /// (from a device not already connected) is refused with
        /// RATE_LIMITED and a retry hint.
        #[arg(long, default_value_t = tidemark_server::config::WS_CONNECTIONS_PER_USER_MAX_DEFAULT)]
        ws_connections_per_user_max: usize,
        /// Audit log entries (logins, refreshes, revocations, password
        /// changes, operator actions) older than this many days are deleted.
        #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u32).range(1..))]
        audit_keep_days: u32,
        #[command(flatten)]
        limits: LimitArgs,
        #[command(flatten)]
        timeouts: Box<TimeoutArgs>,
        #[command(flatten)]
        push: Box<PushArgs>,
        /// Fault drill: accept messages but never fan them out.
        #[arg(long, hide = true)]
        hold_fanout: bool,
        /// Fault drill: never reload the fences from the store (with a
        /// bus that hears nothing, only the store's per-frame epoch fence
        /// stops a superseded connection).
        #[arg(long, hide = true)]
        hold_fence_refresh: bool,
        /// Log line format on stderr: `text` for a person, `json` for one
        /// JSON object per line (seed §18.2 fields, hashed ids). The stage
        /// trace of each message is logged at debug level on the target
        /// `tidemark::trace` (RUST_LOG=info,tidemark::trace=debug).
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
    },
    /// Manage users.
    #[command(after_help = "These act on the store directly (--data or --database), a running server \
                            included: logins and refresh tokens see the change at once; a running \
                            server refuses the access tokens it ends when it next starts, so prefer \
                            POST /v1/admin/logout and /v1/admin/deactivate on a live server.")]
    User {
        #[command(subcommand)]
        command: UserCommand,
    },
    /// Manage a user's devices.
    Device {
        #[command(subcommand)]
        command: DeviceCommand,
    },
    /// Operator maintenance on the store (--data or --database).
    Admin {
        #[command(subcommand)]
        command: AdminCommand,
    },
    /// Benchmarks; each prints a table and writes JSON.
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
    /// Play the multi-device sync story on an in-process server and check
    /// its invariants (exit code 1 if one fails).
    Demo,
    /// Chat interactively as one device of a user (the SDK with its local store).
    Chat(chat::ChatArgs),
}

/// Offline push (P4): the providers devices may register with. Secrets
/// come from files, never from the command line.
#[derive(clap::Args)]
struct PushArgs {
    /// The operator's webhook receiver (platform `webhook`); needs
    /// --push-webhook-secret-file.
    #[arg(long, requires = "push_webhook_secret_file")]
    push_webhook_url: Option<String>,
    /// The HMAC key of the webhook's signatures: the file's first line.
    #[arg(long, requires = "push_webhook_url")]
    push_webhook_secret_file: Option<PathBuf>,
    /// Web Push (platform `webpush`): the VAPID private key, base64url of
    /// the 32-byte P-256 scalar, first line of the file.
    #[arg(long, requires = "push_vapid_subject")]
    push_vapid_key_file: Option<PathBuf>,
    /// The VAPID `sub` claim, e.g. mailto:ops@example.org.
    #[arg(long, requires = "push_vapid_key_file")]
    push_vapid_subject: Option<String>,
    /// A Matrix push gateway such as Sygnal (platform `gateway`), its base URL.
    #[arg(long)]
    push_gateway_url: Option<String>,
    /// The key push tokens are sealed with at rest (AES-256-GCM): 32 bytes
    /// or 64 hex digits. Without it the key is derived from the server
    /// secret, which lives in the same database.
    #[arg(long)]
    push_token_key_file: Option<PathBuf>,
    /// Events of one device within this many milliseconds of the first are
    /// coalesced into one notification.
    #[arg(long, default_value_t = tidemark_core::push::PUSH_WINDOW_MS_DEFAULT as u64, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    push_window_ms: u64,
    /// Events older than this many seconds are not pushed.
    #[arg(long, default_value_t = (tidemark_core::push::PUSH_EXPIRY_MS_DEFAULT / 1000) as u64, value_parser = clap::value_parser!(u64).range(1..))]
    push_expiry_secs: u64,
    /// How often the push worker looks for due pushes, milliseconds.
    #[arg(long, default_value_t = millis(tidemark_server::push::PUSH_POLL_DEFAULT), value_parser = clap::value_parser!(u64).range(10..))]
    push_poll_ms: u64,
    /// How long a node's claim on a device's pushes lasts, milliseconds: a
    /// node that dies holding one frees it after this.
    #[arg(long, default_value_t = millis(tidemark_server::push::PUSH_LEASE_DEFAULT), value_parser = clap::value_parser!(u64).range(100..))]
    push_lease_ms: u64,
}

fn first_line(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let line = text.lines().next().unwrap_or("").trim().to_owned();
    if line.is_empty() {
        bail!("{} is empty", path.display());
    }
    Ok(line)
}

impl PushArgs {
    fn config(&self) -> Result<tidemark_server::push::PushConfig> {
        use std::sync::Arc;
        let mut providers: Vec<Arc<dyn tidemark_push::Provider>> = Vec::new();
        if let (Some(url), Some(file)) = (&self.push_webhook_url, &self.push_webhook_secret_file) {
            providers.push(Arc::new(tidemark_push::webhook::Webhook::new(url.clone(), first_line(file)?.into_bytes())));
        }
        if let (Some(file), Some(subject)) = (&self.push_vapid_key_file, &self.push_vapid_subject) {
            let key = tidemark_push::webpush::VapidKey::from_base64url(&first_line(file)?, subject.clone())
                .with_context(|| format!("{} does not hold a VAPID private key", file.display()))?;
            providers.push(Arc::new(tidemark_push::webpush::WebPush::new(key)));
        }
        if let Some(url) = &self.push_gateway_url {
            providers.push(Arc::new(tidemark_push::gateway::Gateway::new(url)));
        }
        let token_key = match &self.push_token_key_file {
            Some(file) => {
                let bytes = std::fs::read(file).with_context(|| format!("read {}", file.display()))?;
                Some(tidemark_push::seal::TokenSealer::key_from_file_bytes(&bytes).map_err(anyhow::Error::msg)?)
            }
            None => None,
        };
        let defaults = tidemark_server::push::PushConfig::default();
        Ok(tidemark_server::push::PushConfig {
            providers,
            token_key,
            policy: tidemark_core::push::PushPolicy {
                window_ms: self.push_window_ms as i64,
                expiry_ms: secs_to_ms(self.push_expiry_secs),
                ..defaults.policy
            },
            poll: std::time::Duration::from_millis(self.push_poll_ms),
            lease: std::time::Duration::from_millis(self.push_lease_ms),
            ..defaults
        })
    }
}

/// Connection timeouts, so slow or silent clients cannot hold connections.
#[derive(clap::Args)]
struct TimeoutArgs {
    /// An HTTP request head must be complete this many milliseconds after
    /// the server starts waiting for it (the accept, or the previous
    /// response on a keep-alive connection); else the connection is closed.
    #[arg(long, default_value_t = millis(tidemark_server::config::HTTP_HEADER_TIMEOUT_DEFAULT), value_parser = clap::value_parser!(u64).range(1..))]
    http_header_timeout_ms: u64,
    /// Longest pause between two chunks of an HTTP request body, milliseconds.
    #[arg(long, default_value_t = millis(tidemark_server::config::HTTP_BODY_TIMEOUT_DEFAULT), value_parser = clap::value_parser!(u64).range(1..))]
    http_body_timeout_ms: u64,
    /// Longest whole HTTP request (body included), milliseconds; past it 408.
    #[arg(long, default_value_t = millis(tidemark_server::config::HTTP_REQUEST_TIMEOUT_DEFAULT), value_parser = clap::value_parser!(u64).range(1..))]
    http_request_timeout_ms: u64,
    /// An HTTP connection with no request in progress that receives
    /// nothing for this many milliseconds is closed (idle keep-alive).
    #[arg(long, default_value_t = millis(tidemark_server::config::HTTP_IDLE_TIMEOUT_DEFAULT), value_parser = clap::value_parser!(u64).range(1..))]
    http_idle_timeout_ms: u64,
    /// Milliseconds a WebSocket opened without a bearer header has to send
    /// its `auth` frame.
    #[arg(long, default_value_t = millis(tidemark_server::config::WS_AUTH_TIMEOUT_DEFAULT), value_parser = clap::value_parser!(u64).range(1..))]
    ws_auth_timeout_ms: u64,
}

const fn millis(d: std::time::Duration) -> u64 {
    d.as_millis() as u64
}

impl TimeoutArgs {
    fn http(&self) -> tidemark_server::config::HttpTimeouts {
        use std::time::Duration;
        tidemark_server::config::HttpTimeouts {
            header: Duration::from_millis(self.http_header_timeout_ms),
            body: Duration::from_millis(self.http_body_timeout_ms),
            request: Duration::from_millis(self.http_request_timeout_ms),
            idle: Duration::from_millis(self.http_idle_timeout_ms),
        }
    }
}

/// Rate limits: a request over a quota is refused with RATE_LIMITED and
/// `retry_after_ms`, and changes nothing.
#[derive(clap::Args)]
struct LimitArgs {
    /// Turn every rate limit off (benchmarks of the store's own speed).
    #[arg(long)]
    no_rate_limits: bool,
    /// Sends (and recalls, edits, reactions) per second per device.
    #[arg(long, default_value_t = limits::SEND_PER_DEVICE_DEFAULT.per_second())]
    send_per_sec: u32,
    /// Sends a device may make in a burst above that rate.
    #[arg(long, default_value_t = limits::SEND_PER_DEVICE_DEFAULT.burst)]
    send_burst: u32,
    /// Sync pages and ACKs per second per device.
    #[arg(long, default_value_t = limits::SYNC_PER_DEVICE_DEFAULT.per_second())]
    sync_per_sec: u32,
    /// Sync pages and ACKs a device may make in a burst.
    #[arg(long, default_value_t = limits::SYNC_PER_DEVICE_DEFAULT.burst)]
    sync_burst: u32,
    /// Login and refresh attempts per second per source address.
    #[arg(long, default_value_t = limits::LOGIN_PER_ADDRESS_DEFAULT.per_second())]
    login_per_sec: u32,
    /// Login and refresh attempts an address may make in a burst.
    #[arg(long, default_value_t = limits::LOGIN_PER_ADDRESS_DEFAULT.burst)]
    login_burst: u32,
    /// Password hashes running at once (about 19 MiB of memory each); a
    /// login that waits longer than 2 s for one gets RATE_LIMITED.
    #[arg(long, default_value_t = limits::PASSWORD_HASHES_CONCURRENT_MAX)]
    password_hashes_max: usize,
    /// Frames per second one WebSocket is read at, at most (checked before
    /// a frame is parsed; past it the server stops reading the socket).
    #[arg(long, default_value_t = limits::FRAMES_PER_CONNECTION_DEFAULT.per_second())]
    frames_per_sec: u32,
    /// Frames one WebSocket may send in a burst above that rate.
    #[arg(long, default_value_t = limits::FRAMES_PER_CONNECTION_DEFAULT.burst)]
    frames_burst: u32,
    /// Frames per second across every WebSocket of one source address.
    #[arg(long, default_value_t = limits::FRAMES_PER_ADDRESS_DEFAULT.per_second())]
    address_frames_per_sec: u32,
    /// Frames an address's WebSockets may send in a burst above that rate.
    #[arg(long, default_value_t = limits::FRAMES_PER_ADDRESS_DEFAULT.burst)]
    address_frames_burst: u32,
    /// HTTP requests (WebSocket upgrades included) per second per source
    /// address, refused with RATE_LIMITED before they are read.
    #[arg(long, default_value_t = limits::REQUESTS_PER_ADDRESS_DEFAULT.per_second())]
    address_requests_per_sec: u32,
    /// HTTP requests an address may make in a burst above that rate.
    #[arg(long, default_value_t = limits::REQUESTS_PER_ADDRESS_DEFAULT.burst)]
    address_requests_burst: u32,
    /// How long an address is refused after a connection of it was closed
    /// for ignoring its waits (doubling with each further close).
    #[arg(long, default_value_t = tidemark_core::throttle::RECONNECT_PENALTY.first_ms)]
    reconnect_penalty_ms: u64,
    /// The longest such refusal.
    #[arg(long, default_value_t = tidemark_core::throttle::RECONNECT_PENALTY.max_ms)]
    reconnect_penalty_max_ms: u64,
    /// TCP connections one source address (IPv6: its /64) holds open at
    /// once, WebSockets included; past it a few are answered RATE_LIMITED
    /// and the rest are closed at the accept.
    #[arg(long, default_value_t = limits::CONNECTIONS_PER_ADDRESS_MAX_DEFAULT)]
    connections_per_address: usize,
    /// Failed logins from one address (any account) within the failure
    /// window before its password checks wait in the suspect lane, behind
    /// every clean login.
    #[arg(long, default_value_t = tidemark_core::throttle::SUSPECT_AFTER_FAILURES)]
    login_suspect_after_failures: u32,
}

impl LimitArgs {
    fn config(&self) -> limits::LimitsConfig {
        limits::LimitsConfig {
            enabled: !self.no_rate_limits,
            send_per_device: limits::Rate::new(self.send_per_sec, self.send_burst),
            sync_per_device: limits::Rate::new(self.sync_per_sec, self.sync_burst),
            login_per_address: limits::Rate::new(self.login_per_sec, self.login_burst),
            password_hashes_concurrent_max: self.password_hashes_max,
            frames_per_connection: limits::Rate::new(self.frames_per_sec, self.frames_burst),
            frames_per_address: limits::Rate::new(self.address_frames_per_sec, self.address_frames_burst),
            requests_per_address: limits::Rate::new(self.address_requests_per_sec, self.address_requests_burst),
            reconnect_penalty: tidemark_core::throttle::ReconnectPenalty {
                first_ms: self.reconnect_penalty_ms,
                max_ms: self.reconnect_penalty_max_ms.max(self.reconnect_penalty_ms),
                ..tidemark_core::throttle::RECONNECT_PENALTY
            },
            connections_per_address_max: self.connections_per_address,
            login_suspect_after_failures: self.login_suspect_after_failures,
            ..limits::LimitsConfig::default()
        }
    }
}

#[derive(Subcommand)]
enum UserCommand {
    /// Create a user; the password is read from the first line of stdin.
    Add {
        /// The user name: 1..=64 bytes of ASCII letters, digits, `_ - . @`,
        /// stored lower-cased (`Alice` and `alice` are one account).
        name: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// List every user: name, creation time, active or deactivated.
    List {
        #[command(flatten)]
        store: StoreArgs,
    },
    /// End every session of a user, or of one of its devices (a later login works).
    Logout {
        /// The user name.
        name: String,
        /// Only this device.
        #[arg(long)]
        device: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Deactivate a user: it no longer logs in and every session ends.
    Deactivate {
        /// The user name.
        name: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Delete a user: its devices, cursors, tokens and sync log are
    /// removed; the messages it sent stay in their conversations under its
    /// name, which is never given to another account.
    Delete {
        /// The user name.
        name: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Print audit log entries, oldest first (time, event, actor, user and
    /// device hashes, address).
    Audit {
        /// Only this user's entries.
        name: Option<String>,
        /// Only entries of the last this many seconds.
        #[arg(long)]
        since_secs: Option<u64>,
        /// At most this many entries.
        #[arg(long, default_value_t = tidemark_proto::AUDIT_LIMIT_DEFAULT,
              value_parser = clap::value_parser!(u32).range(1..=tidemark_proto::AUDIT_LIMIT_MAX as i64))]
        limit: u32,
        #[command(flatten)]
        store: StoreArgs,
    },
}

#[derive(Subcommand)]
enum DeviceCommand {
    /// List a user's devices: id, state, first login, last seen, name.
    List {
        /// The user name.
        user: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Revoke a user's device: it can never log in or sync again.
    Revoke {
        /// The user name.
        user: String,
        /// The device id.
        device: String,
        #[command(flatten)]
        store: StoreArgs,
    },
}

#[derive(Subcommand)]
enum AdminCommand {
    /// Reconcile the stored facts relation by relation (seed 000 §18.3):
    /// re-enqueue missing fan-outs and recount unread where that is safe,
    /// report the rest (overlapping or missing membership periods, ACKs
    /// above the head, events without their message, the quarantine).
    /// Prints the report as JSON (the reply of POST /v1/admin/reconcile).
    /// It runs on the store directly, in bounded chunks, beside a running
    /// server as well; needs no admin token.
    Reconcile {
        /// Find and report only; repair nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
}

async fn open_store(args: &StoreArgs) -> Result<Arc<dyn Store>> {
    let Some(url) = &args.database else {
        let store = SqliteStore::open(&args.data).with_context(|| format!("open store in {}", args.data.display()))?;
        return Ok(store);
    };
    let scheme = url.split(':').next().unwrap_or("");
    if !matches!(scheme, "postgres" | "postgresql") {
        bail!("--database {scheme}:… is not supported; use a postgres:// URL or the embedded store (--data)");
    }
    let config = tidemark_postgres::PgConfig {
        schema: args.database_schema.clone(),
        conv_writers: usize::from(args.database_conv_writers),
        ..tidemark_postgres::PgConfig::new(url.clone())
    };
    // The URL may carry a password: the error context does not repeat it.
    let store = tidemark_postgres::PgStore::open(config).await.context("open the PostgreSQL store")?;
    Ok(store)
}

/// The admin token's environment variable.
const ADMIN_TOKEN_ENV: &str = "TIDEMARK_ADMIN_TOKEN";

/// The admin token from `--admin-token-file` or TIDEMARK_ADMIN_TOKEN (an
/// empty one disables the admin endpoints, as an absent one does).
fn admin_token(file: Option<&std::path::Path>) -> Result<Option<String>> {
    let token = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
            text.lines().next().unwrap_or_default().to_owned()
        }
        None => std::env::var(ADMIN_TOKEN_ENV).unwrap_or_default(),
    };
    Ok(Some(token).filter(|t| !t.is_empty()))
}

/// How `serve` writes its log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Logs on stderr, filtered by RUST_LOG (else `default`).
fn init_logs(default: &str) {
    init_logs_as(default, LogFormat::Text)
}

fn init_logs_as(default: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        // Colour codes only for a person at a terminal, never in a log file.
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        // One object per line: timestamp, level, target and the event's
        // fields flattened to the top (`stage`, `trace_id`, ids, hashes).
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).with_span_list(false).init(),
    }
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve {
            listen,
            store,
            nats,
            nats_prefix,
            admin_token_file,
            access_ttl_secs,
            history_keep_days,
            log_keep_secs,
            device_inactive_secs,
            retention_every_ms,
            reconcile_every_secs,
            load_behind_ms,
            load_overloaded_ms,
            keep_all_logs,
            snapshot_ttl_secs,
            snapshot_messages_per_conv,
            replay_max_events,
            gauges_every_secs,
            ws_connections_max,
            large_group_members,
            ws_connections_per_user_max,
            audit_keep_days,
            limits,
            timeouts,
            push,
            hold_fanout,
            hold_fence_refresh,
            log_format,
        } => {
            init_logs_as("info", log_format);
            let push = push.config()?;
            let admin_token = admin_token(admin_token_file.as_deref())?;
            if nats.is_some() && store.database.is_none() {
                bail!("--nats joins a cluster, which needs the shared PostgreSQL store (--database)");
            }
            let store = open_store(&store).await?;
            let hint_bus = match nats {
                Some(url) => HintBusConfig::Nats { url, subject_prefix: nats_prefix },
                None => HintBusConfig::Local,
            };
            let defaults = ServerConfig::default();
            let config = ServerConfig {
                admin_token,
                access_token_ttl: std::time::Duration::from_secs(access_ttl_secs),
                retention: (!keep_all_logs).then(|| tidemark_store::RetentionPolicy {
                    keep_events_younger_than_ms: secs_to_ms(log_keep_secs),
                    device_inactive_after_ms: secs_to_ms(device_inactive_secs),
                    history_keep_ms: history_keep_days.map(|d| i64::from(d) * 24 * 3600 * 1000),
                }),
                retention_every: std::time::Duration::from_millis(retention_every_ms),
                reconcile_every: (reconcile_every_secs > 0)
                    .then(|| std::time::Duration::from_secs(reconcile_every_secs)),
                load_bounds: tidemark_core::degrade::LoadBounds {
                    behind_ms: load_behind_ms,
                    overloaded_ms: load_overloaded_ms,
                },
                snapshot_ttl: std::time::Duration::from_secs(snapshot_ttl_secs),
                snapshot_messages_per_conv,
                replay_max_events,
                gauges_every: std::time::Duration::from_secs(gauges_every_secs),
                hold_fanout,
                hold_fence_refresh,
                hint_bus,
                ws_connections_max,
                ws_connections_per_user_max,
                audit_keep: std::time::Duration::from_secs(u64::from(audit_keep_days) * 24 * 3600),
                limits: limits.config(),
                group_policy: tidemark_core::large::GroupPolicy { large_members: large_group_members },
                http_timeouts: timeouts.http(),
                ws_auth_timeout: std::time::Duration::from_millis(timeouts.ws_auth_timeout_ms),
                push,
                ..defaults
            };
            let server = Server::start(&listen, store, config).await?;
            // Scripts read this line to learn the bound address.
            println!("tidemark listening on {}", server.addr);
            wait_for_signal().await;
            tracing::info!("shutting down");
            server.stop().await;
            Ok(())
        }
        Command::User { command: UserCommand::Add { name, store } } => {
            let mut password = String::new();
            std::io::stdin().lock().read_line(&mut password).context("read password from stdin")?;
            let password = password.trim_end_matches(['\r', '\n']);
            if password.is_empty() {
                bail!("empty password: write it to stdin");
            }
            let name = tidemark_server::accounts::check_new_account(&name, password).map_err(anyhow::Error::msg)?;
            let hash = tidemark_server::accounts::hash_password(password).map_err(anyhow::Error::msg)?;
            let store = open_store(&store).await?;
            let now = tidemark_server::util::now_ms();
            if store.create_user(&name, &hash, now).await? {
                println!("created user {name}");
                Ok(())
            } else {
                bail!("user {name} already exists")
            }
        }
        Command::User { command } => admin::user(command).await,
        Command::Device { command } => admin::device(command).await,
        Command::Admin { command } => {
            init_logs("warn");
            admin::admin(command).await
        }
        Command::Bench { command } => bench::run(command).await,
        Command::Demo => {
            init_logs("warn");
            demo::run().await
        }
        Command::Chat(args) => {
            // Warnings only: the chat's own lines are on stdout.
            init_logs("warn");
            chat::run(args).await
        }
    }
}

/// Seconds from a flag as the store's milliseconds, saturating.
fn secs_to_ms(secs: u64) -> i64 {
    i64::try_from(secs.saturating_mul(1000)).unwrap_or(i64::MAX)
}
