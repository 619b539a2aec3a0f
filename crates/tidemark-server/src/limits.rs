//! Rate limits and the password-hash bound (P1, P3; seed §9.4, §15.4, §17.1).
//!
//! Every operation belongs to one [`OpClass`]; each class has a quota per
//! device, per user and (before authentication) per source address, kept
//! in GCRA limiters (`governor`). A request over a quota is refused with
//! `RATE_LIMITED` and `retry_after_ms` *before* it reaches the store, so a
//! limited request changes nothing: a throttled sync or ACK moves no cursor
//! and a throttled send is not accepted. Logins are bounded twice: a named
//! number of password hashes run at once (Argon2 costs ~19 MiB each), and
//! failed logins grow a delay per account and address
//! (`tidemark_core::throttle`). Checks from an address that keeps failing
//! wait for a hash in a lane of their own that holds at most one place in
//! the hash queue (`tidemark_core::throttle::HashLane`), so a guesser with
//! many addresses delays an honest login by a bounded number of hashes. Limiter state is swept periodically, so its
//! memory is bounded by the keys active within a sweep period.
//!
//! A hostile client is bounded before its requests are parsed (issue 15):
//! every WebSocket has a budget of frames (its own GCRA limiter, and one
//! per source address across its connections) checked before a frame is
//! parsed or its token looked at; a connection over it is not read until
//! its budget refills (TCP backpressure makes the sender wait), so it costs
//! at most the budget's frames a second, however fast it writes. Every
//! HTTP request (WebSocket upgrades included) passes a per-address budget
//! before its body or token is read. An address whose connections were
//! closed for ignoring their waits is refused at connect for a period that
//! grows with each close (`tidemark_core::throttle::ReconnectPenalty`), so
//! reconnecting does not reset what ignoring waits costs. An address holds
//! at most a named number of TCP connections at once (WebSockets included:
//! a socket keeps its place through the upgrade, [`AddressConns`]); past
//! it a few connections at a time are read only to be answered
//! `RATE_LIMITED`, and the rest are closed at the accept, before a task or
//! a buffer is spent on them (`tidemark_core::throttle::address_connection`).
//!
//! This module knows no operation's semantics and no storage.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tidemark_core::throttle::{
    address_connection, hash_lane, AddressConnection, HashLane, LoginBackoff, ReconnectPenalty, RECONNECT_PENALTY,
    SUSPECT_AFTER_FAILURES,
};
use tidemark_proto::{op, ErrorCode};
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::error::ApiError;

/// What an operation costs the server, for its quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Sends and every other write of a conversation fact (recall, edit,
    /// react, delete-for-me).
    Send,
    /// Pulls of the user log and their ACKs, snapshots, reads, deliveries.
    Sync,
    /// `history`, `conv.sync`, `conv.list`: reads of conversation logs.
    Read,
    /// Creating conversations and changing membership or settings.
    Change,
    /// Typing and presence (issue 18): cheap, but a third of a chat
    /// server's requests; never stored, so limited per device on their own.
    Ephemeral,
    /// Cheap operations that are never limited (`ping`, `device.revoke`:
    /// revoking a device must work while it floods).
    Free,
}

impl OpClass {
    /// The class of operation `name` (unknown names are refused elsewhere;
    /// they cost like a read).
    pub fn of(name: &str) -> OpClass {
        match name {
            op::SEND | op::RECALL | op::EDIT | op::REACT | op::MESSAGE_DELETE => OpClass::Send,
            op::SYNC
            | op::ACK
            | op::READ
            | op::DELIVERY_ACK
            | op::SNAPSHOT_BEGIN
            | op::SNAPSHOT_PAGE
            | op::SNAPSHOT_ACK
            | op::DIRTY_CLEAR
            | op::CLIENT_STATS => OpClass::Sync,
            op::HISTORY
            | op::CONV_SYNC
            | op::CONV_LIST
            | op::CONV_MEMBERS
            | op::CONV_RECEIPTS
            | op::DELIVERY_RECEIPTS
            | op::DEVICE_LIST
            | op::PUSH_LIST => OpClass::Read,
            op::CONV_CREATE
            | op::CONV_ADD
            | op::CONV_REMOVE
            | op::CONV_LEAVE
            | op::CONV_SETTINGS
            | op::PRIVACY_SET
            | op::ACCOUNT_PASSWORD
            | op::PUSH_REGISTER
            | op::PUSH_REMOVE => OpClass::Change,
            op::TYPING | op::PRESENCE_SET => OpClass::Ephemeral,
            op::PING | op::DEVICE_REVOKE => OpClass::Free,
            _ => OpClass::Read,
        }
    }
}

/// A sustained rate and the burst allowed above it: one request is
/// replenished every `cell`, up to `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub cell: Duration,
    pub burst: u32,
}

impl Rate {
    /// `per_second` requests a second (at least one).
    pub const fn new(per_second: u32, burst: u32) -> Rate {
        let per_second = if per_second == 0 { 1 } else { per_second };
        Rate { cell: Duration::from_nanos(1_000_000_000 / per_second as u64), burst }
    }

    /// One request every `cell` (slower than one a second, for example).
    pub const fn every(cell: Duration, burst: u32) -> Rate {
        Rate { cell, burst }
    }

    /// The sustained rate, rounded down to whole requests a second.
    pub fn per_second(self) -> u32 {
        (Duration::from_secs(1).as_nanos() / self.cell.as_nanos().max(1)) as u32
    }

    fn quota(self) -> Quota {
        let burst = NonZeroU32::new(self.burst.max(1)).expect("non-zero");
        Quota::with_period(self.cell.max(Duration::from_nanos(1))).expect("a non-zero period").allow_burst(burst)
    }
}

/// Every quota, named. Defaults are generous for a person on several
/// devices and tight for a script: a person types far below 20 messages a
/// second; a reconnecting device pulls a few pages and ACKs each.
#[derive(Debug, Clone)]
pub struct LimitsConfig {
    /// Off: nothing is limited (benchmarks of the store's own speed).
    pub enabled: bool,
    pub send_per_device: Rate,
    pub send_per_user: Rate,
    pub sync_per_device: Rate,
    pub read_per_device: Rate,
    pub change_per_user: Rate,
    /// `typing` and `presence.set` per device.
    pub ephemeral_per_device: Rate,
    /// Login and refresh attempts per source address.
    pub login_per_address: Rate,
    /// WebSocket upgrades per source address.
    pub connect_per_address: Rate,
    /// Frames one WebSocket may send (any kind but close), checked before
    /// a frame is parsed; past it the connection is not read until the
    /// budget refills.
    pub frames_per_connection: Rate,
    /// The same, across every WebSocket of one source address.
    pub frames_per_address: Rate,
    /// HTTP requests (WebSocket upgrades included) per source address,
    /// checked before the body or the token is read.
    pub requests_per_address: Rate,
    /// How long an address is refused after its connections were closed
    /// for ignoring their waits.
    pub reconnect_penalty: ReconnectPenalty,
    /// TCP connections one source address (IPv6: its /64) holds open at
    /// once, WebSockets included ([`AddressConns`]).
    pub connections_per_address_max: usize,
    /// Connections past that cap read at once, per address, only to answer
    /// their first request `RATE_LIMITED`; the rest are closed at the accept.
    pub connection_refusals_per_address_max: usize,
    /// Password hashes (login, password change, user creation) running at
    /// once, and how long a login waits for one before `RATE_LIMITED`.
    pub password_hashes_concurrent_max: usize,
    pub password_hash_wait: Duration,
    /// Failed logins of one account from one address: the guesser's budget.
    pub login_backoff_per_address: LoginBackoff,
    /// Failed logins of one account from anywhere: a short cap, so an
    /// attacker can delay the real user by at most that, never lock them out.
    pub login_backoff_per_account: LoginBackoff,
    /// Failure counts forget a key this long after its last failure.
    pub login_failures_forget_after: Duration,
    /// Failure keys kept at most (the oldest are forgotten first).
    pub login_failure_keys_max: usize,
    /// Failed logins from one address (any account) within the forget
    /// window before its checks wait in the suspect lane.
    pub login_suspect_after_failures: u32,
}

pub const SEND_PER_DEVICE_DEFAULT: Rate = Rate::new(50, 200);
pub const SEND_PER_USER_DEFAULT: Rate = Rate::new(100, 400);
pub const SYNC_PER_DEVICE_DEFAULT: Rate = Rate::new(100, 500);
pub const READ_PER_DEVICE_DEFAULT: Rate = Rate::new(50, 200);
pub const CHANGE_PER_USER_DEFAULT: Rate = Rate::new(20, 100);
/// A typist renews every few seconds and a client reports idle/online on
/// transitions: 5 a second with a burst of 20 is far above both.
pub const EPHEMERAL_PER_DEVICE_DEFAULT: Rate = Rate::new(5, 20);
/// Per address, so a NAT or a proxy's many users share it: generous.
pub const LOGIN_PER_ADDRESS_DEFAULT: Rate = Rate::new(20, 200);
pub const CONNECT_PER_ADDRESS_DEFAULT: Rate = Rate::new(100, 2000);
/// Frames per WebSocket: above the sum of one device's operation quotas
/// (225/s, bursts 1 020 together), so a client within its quotas is never
/// held back by it; a flooder is read at this rate at most.
pub const FRAMES_PER_CONNECTION_DEFAULT: Rate = Rate::new(250, 1_000);
/// Frames per source address across its WebSockets: a NAT of a few
/// hundred people chatting stays far below it (a person sends a frame or
/// two a second); one attacking address is parsed at most this fast.
pub const FRAMES_PER_ADDRESS_DEFAULT: Rate = Rate::new(1_000, 4_000);
/// HTTP requests per source address, any route under `/v1`.
pub const REQUESTS_PER_ADDRESS_DEFAULT: Rate = Rate::new(500, 2_000);
/// TCP connections one source address holds at once, WebSockets included:
/// a NAT of a few hundred people (a WebSocket each, an HTTP request now and
/// then) stays below it; one address holds at most this many descriptors
/// and, as idle WebSockets (~16 KiB each, `tidemark bench connections`),
/// about 8 MiB.
pub const CONNECTIONS_PER_ADDRESS_MAX_DEFAULT: usize = 512;
/// Connections over an address's cap being answered `RATE_LIMITED` at once;
/// the address's further connections are closed at the accept unanswered.
pub const CONNECTION_REFUSALS_PER_ADDRESS_MAX: usize = 8;
/// `retry_after_ms` of a request refused for its address's connection cap
/// (a slot frees when one of its connections ends: an HTTP one within its
/// idle timeout).
pub const CONNECTIONS_PER_ADDRESS_RETRY_AFTER_MS: u64 = 1_000;
/// The shortest pause of a WebSocket over its frame budget: a connection
/// waiting for the next cell would otherwise wake once per cell (every
/// millisecond at 1 000/s) and race its address's other connections for it.
pub const FRAME_PAUSE_MIN: Duration = Duration::from_millis(20);
/// Addresses whose closes for ignored waits are remembered at most (the
/// stalest are forgotten first).
pub const PENALTY_KEYS_MAX: usize = 100_000;
/// How often idle limiter keys are forgotten.
pub const LIMITS_SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Two hashes at once: one per core of the reference machine, ~38 MiB.
pub const PASSWORD_HASHES_CONCURRENT_MAX: usize = 2;
pub const PASSWORD_HASH_WAIT: Duration = Duration::from_secs(2);
/// The wait a login refused for want of a hash permit is told to take.
pub const PASSWORD_HASH_RETRY_AFTER_MS: u64 = 1_000;
pub const LOGIN_BACKOFF_PER_ADDRESS: LoginBackoff =
    LoginBackoff { free_failures: 5, first_delay_ms: 1_000, max_delay_ms: 15 * 60 * 1_000 };
pub const LOGIN_BACKOFF_PER_ACCOUNT: LoginBackoff =
    LoginBackoff { free_failures: 20, first_delay_ms: 1_000, max_delay_ms: 30_000 };
pub const LOGIN_FAILURES_FORGET_AFTER: Duration = Duration::from_secs(30 * 60);
pub const LOGIN_FAILURE_KEYS_MAX: usize = 100_000;

impl LimitsConfig {
    /// Nothing limited: for benchmarks of the store's own speed.
    pub fn off() -> LimitsConfig {
        LimitsConfig { enabled: false, ..LimitsConfig::default() }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            enabled: true,
            send_per_device: SEND_PER_DEVICE_DEFAULT,
            send_per_user: SEND_PER_USER_DEFAULT,
            sync_per_device: SYNC_PER_DEVICE_DEFAULT,
            read_per_device: READ_PER_DEVICE_DEFAULT,
            change_per_user: CHANGE_PER_USER_DEFAULT,
            ephemeral_per_device: EPHEMERAL_PER_DEVICE_DEFAULT,
            login_per_address: LOGIN_PER_ADDRESS_DEFAULT,
            connect_per_address: CONNECT_PER_ADDRESS_DEFAULT,
            frames_per_connection: FRAMES_PER_CONNECTION_DEFAULT,
            frames_per_address: FRAMES_PER_ADDRESS_DEFAULT,
            requests_per_address: REQUESTS_PER_ADDRESS_DEFAULT,
            reconnect_penalty: RECONNECT_PENALTY,
            connections_per_address_max: CONNECTIONS_PER_ADDRESS_MAX_DEFAULT,
            connection_refusals_per_address_max: CONNECTION_REFUSALS_PER_ADDRESS_MAX,
            password_hashes_concurrent_max: PASSWORD_HASHES_CONCURRENT_MAX,
            password_hash_wait: PASSWORD_HASH_WAIT,
            login_backoff_per_address: LOGIN_BACKOFF_PER_ADDRESS,
            login_backoff_per_account: LOGIN_BACKOFF_PER_ACCOUNT,
            login_failures_forget_after: LOGIN_FAILURES_FORGET_AFTER,
            login_failure_keys_max: LOGIN_FAILURE_KEYS_MAX,
            login_suspect_after_failures: SUSPECT_AFTER_FAILURES,
        }
    }
}

type Keyed<K> = RateLimiter<K, DefaultKeyedStateStore<K>, DefaultClock>;

/// Failed logins of one key: how many in a row, and when the last was.
#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    last_ms: i64,
}

/// The limiter state of one server.
pub struct Limits {
    config: LimitsConfig,
    send_device: Keyed<(String, String)>,
    send_user: Keyed<String>,
    sync_device: Keyed<(String, String)>,
    read_device: Keyed<(String, String)>,
    change_user: Keyed<String>,
    ephemeral_device: Keyed<(String, String)>,
    login_address: Keyed<IpAddr>,
    connect_address: Keyed<IpAddr>,
    frames_address: Keyed<IpAddr>,
    requests_address: Keyed<IpAddr>,
    /// Closes for ignored waits of each address: count and last close.
    penalties: Mutex<HashMap<IpAddr, Failures>>,
    /// Open TCP connections of each address (the listener's).
    conns: Arc<AddressConns>,
    hashes: Semaphore,
    /// Held by the one suspect check that may wait in `hashes`' queue.
    suspect_gate: Semaphore,
    /// Checks waiting for a hash now, by lane (clean, suspect).
    waiting: [AtomicUsize; 2],
    /// Password hashes running now, and the most that ever ran at once.
    hashing: AtomicUsize,
    hashing_peak: AtomicUsize,
    /// Jobs for the hashing threads (see [`Limits::hash`]).
    hash_jobs: std::sync::mpsc::Sender<HashJob>,
    failures_by_address: Mutex<HashMap<(String, IpAddr), Failures>>,
    failures_by_account: Mutex<HashMap<String, Failures>>,
    /// Failed logins from one address, any account: its hash lane.
    failures_by_ip: Mutex<HashMap<IpAddr, Failures>>,
}

/// IPv6 clients are limited by their /64 (one subscriber's block), so an
/// attacker cannot get a fresh quota per address of its block.
pub fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

pub fn rate_limited(retry_after_ms: u64, what: &str) -> ApiError {
    ApiError {
        retry_after_ms: Some(retry_after_ms.max(1)),
        ..ApiError::new(ErrorCode::RateLimited, format!("{what}: slow down"))
    }
}

fn check<K: std::hash::Hash + Eq + Clone>(limiter: &Keyed<K>, key: &K, what: &str) -> Result<(), ApiError> {
    limiter.check_key(key).map_err(|not_until| {
        let wait = not_until.wait_time_from(limiter.clock().now());
        rate_limited(wait.as_millis() as u64, what)
    })
}

impl Limits {
    pub fn new(config: LimitsConfig) -> Limits {
        Limits {
            send_device: RateLimiter::keyed(config.send_per_device.quota()),
            send_user: RateLimiter::keyed(config.send_per_user.quota()),
            sync_device: RateLimiter::keyed(config.sync_per_device.quota()),
            read_device: RateLimiter::keyed(config.read_per_device.quota()),
            change_user: RateLimiter::keyed(config.change_per_user.quota()),
            ephemeral_device: RateLimiter::keyed(config.ephemeral_per_device.quota()),
            login_address: RateLimiter::keyed(config.login_per_address.quota()),
            connect_address: RateLimiter::keyed(config.connect_per_address.quota()),
            frames_address: RateLimiter::keyed(config.frames_per_address.quota()),
            requests_address: RateLimiter::keyed(config.requests_per_address.quota()),
            penalties: Mutex::new(HashMap::new()),
            conns: Arc::new(AddressConns {
                live: Mutex::new(HashMap::new()),
                max: config.connections_per_address_max,
                answered_max: config.connection_refusals_per_address_max,
                enabled: config.enabled,
            }),
            hashes: Semaphore::new(config.password_hashes_concurrent_max.max(1)),
            suspect_gate: Semaphore::new(1),
            waiting: [AtomicUsize::new(0), AtomicUsize::new(0)],
            hashing: AtomicUsize::new(0),
            hashing_peak: AtomicUsize::new(0),
            hash_jobs: spawn_hash_threads(config.password_hashes_concurrent_max.max(1)),
            failures_by_address: Mutex::new(HashMap::new()),
            failures_by_account: Mutex::new(HashMap::new()),
            failures_by_ip: Mutex::new(HashMap::new()),
            config,
        }
    }

    /// Admits one operation of `user`'s `device`, or says how long to wait.
    pub fn admit_op(&self, name: &str, user: &str, device: &str) -> Result<(), ApiError> {
        if !self.config.enabled {
            return Ok(());
        }
        let device_key = || (user.to_owned(), device.to_owned());
        match OpClass::of(name) {
            OpClass::Send => {
                check(&self.send_device, &device_key(), "sends of this device")?;
                check(&self.send_user, &user.to_owned(), "sends of this user")
            }
            OpClass::Sync => check(&self.sync_device, &device_key(), "syncs of this device"),
            OpClass::Read => check(&self.read_device, &device_key(), "reads of this device"),
            OpClass::Change => check(&self.change_user, &user.to_owned(), "conversation changes of this user"),
            OpClass::Ephemeral => check(&self.ephemeral_device, &device_key(), "typing and presence of this device"),
            OpClass::Free => Ok(()),
        }
    }

    /// Admits a login or refresh attempt from `ip`.
    pub fn admit_login_attempt(&self, ip: IpAddr) -> Result<(), ApiError> {
        if !self.config.enabled {
            return Ok(());
        }
        check(&self.login_address, &address_key(ip), "logins from this address")
    }

    /// Admits a WebSocket upgrade from `ip`.
    pub fn admit_connect(&self, ip: IpAddr) -> Result<(), ApiError> {
        if !self.config.enabled {
            return Ok(());
        }
        check(&self.connect_address, &address_key(ip), "connections from this address")
    }

    /// A new WebSocket's frame budget, its own and its address's.
    pub fn frame_budget(&self, ip: IpAddr) -> FrameBudget {
        FrameBudget { own: RateLimiter::direct(self.config.frames_per_connection.quota()), address: address_key(ip) }
    }

    /// Admits one more frame read from a WebSocket, or says how long to stop
    /// reading it (at least [`FRAME_PAUSE_MIN`]) and whose budget ran out.
    /// Checked before the frame is parsed.
    pub fn admit_frame(&self, budget: &FrameBudget) -> Result<(), FramePause> {
        if !self.config.enabled {
            return Ok(());
        }
        let pause = |wait: Duration, scope| FramePause { wait: wait.max(FRAME_PAUSE_MIN), scope };
        budget
            .own
            .check()
            .map_err(|not_until| pause(not_until.wait_time_from(budget.own.clock().now()), FrameScope::Connection))?;
        self.frames_address.check_key(&budget.address).map_err(|not_until| {
            pause(not_until.wait_time_from(self.frames_address.clock().now()), FrameScope::Address)
        })
    }

    /// The open TCP connections per address, for the listener.
    pub fn address_conns(&self) -> Arc<AddressConns> {
        self.conns.clone()
    }

    /// Admits an HTTP request (a WebSocket upgrade included) from `ip`
    /// before its body or token is read: refused when its connection is
    /// over its address's connection cap (`over_cap`, set by the listener),
    /// while the address serves its period for ignored waits, or over its
    /// request budget.
    pub fn admit_request(&self, ip: IpAddr, over_cap: bool, now_ms: i64) -> Result<(), AddressRefusal> {
        if !self.config.enabled {
            return Ok(());
        }
        if over_cap {
            let e = rate_limited(CONNECTIONS_PER_ADDRESS_RETRY_AFTER_MS, "connections from this address");
            return Err(AddressRefusal { error: e, reason: AddressRefusalReason::Connections });
        }
        let ip = address_key(ip);
        let owed = self
            .penalties
            .lock()
            .expect("limits lock")
            .get(&ip)
            .map_or(0, |f| self.config.reconnect_penalty.wait_ms(f.count, f.last_ms, now_ms));
        if owed > 0 {
            let e = rate_limited(owed, "this address kept sending while told to wait");
            return Err(AddressRefusal { error: e, reason: AddressRefusalReason::Penalty });
        }
        check(&self.requests_address, &ip, "requests from this address")
            .map_err(|error| AddressRefusal { error, reason: AddressRefusalReason::Requests })
    }

    /// Records that a connection from `ip` was closed for ignoring its
    /// waits at `now_ms`; returns the period the address is now refused for.
    pub fn closed_for_ignored_waits(&self, ip: IpAddr, now_ms: i64) -> u64 {
        if !self.config.enabled {
            return 0;
        }
        let ip = address_key(ip);
        let policy = self.config.reconnect_penalty;
        let mut map = self.penalties.lock().expect("limits lock");
        if !map.contains_key(&ip) && map.len() >= PENALTY_KEYS_MAX {
            map.retain(|_, f| !policy.forgotten(f.last_ms, now_ms));
            if map.len() >= PENALTY_KEYS_MAX {
                if let Some(stalest) = map.iter().min_by_key(|(_, f)| f.last_ms).map(|(k, _)| *k) {
                    map.remove(&stalest);
                }
            }
        }
        let entry = map.entry(ip).or_insert(Failures { count: 0, last_ms: now_ms });
        entry.count = policy.closes_after(entry.count, entry.last_ms, now_ms);
        entry.last_ms = now_ms;
        policy.period_ms(entry.count)
    }

    /// Refuses a login of `account` from `ip` while its failed-login delay
    /// runs (checked before any password is hashed).
    pub fn admit_login(&self, account: &str, ip: IpAddr, now_ms: i64) -> Result<(), ApiError> {
        if !self.config.enabled {
            return Ok(());
        }
        let ip = address_key(ip);
        let by_address = self.failures_by_address.lock().expect("limits lock");
        let by_account = self.failures_by_account.lock().expect("limits lock");
        let wait_address = by_address
            .get(&(account.to_owned(), ip))
            .map_or(0, |f| self.config.login_backoff_per_address.wait_ms(f.count, f.last_ms, now_ms));
        let wait_account = by_account
            .get(account)
            .map_or(0, |f| self.config.login_backoff_per_account.wait_ms(f.count, f.last_ms, now_ms));
        match wait_address.max(wait_account) {
            0 => Ok(()),
            wait => Err(rate_limited(wait, "failed logins of this account")),
        }
    }

    /// Records the outcome of a login of `account` from `ip`.
    pub fn login_outcome(&self, account: &str, ip: IpAddr, succeeded: bool, now_ms: i64) {
        let ip = address_key(ip);
        let mut by_address = self.failures_by_address.lock().expect("limits lock");
        let mut by_account = self.failures_by_account.lock().expect("limits lock");
        let forget_ms = self.config.login_failures_forget_after.as_millis() as i64;
        let max = self.config.login_failure_keys_max.max(1);
        if !succeeded {
            // Not forgotten on a success: a guesser holding one account of
            // its own must not clear its address's record with it.
            bump(&mut self.failures_by_ip.lock().expect("limits lock"), ip, now_ms, forget_ms, max);
        }
        if succeeded {
            by_address.remove(&(account.to_owned(), ip));
            by_account.remove(account);
            return;
        }
        bump(&mut by_address, (account.to_owned(), ip), now_ms, forget_ms, max);
        bump(&mut by_account, account.to_owned(), now_ms, forget_ms, max);
    }

    /// The hash lane of a login from `ip` at `now_ms`: suspect once the
    /// address failed the configured number of times within the window.
    pub fn login_lane(&self, ip: IpAddr, now_ms: i64) -> HashLane {
        if !self.config.enabled {
            return HashLane::Clean;
        }
        let forget_ms = self.config.login_failures_forget_after.as_millis() as i64;
        let recent = self
            .failures_by_ip
            .lock()
            .expect("limits lock")
            .get(&address_key(ip))
            .filter(|f| now_ms - f.last_ms < forget_ms)
            .map_or(0, |f| f.count);
        hash_lane(recent, self.config.login_suspect_after_failures)
    }

    /// A permit to hash one password in the clean lane (see
    /// [`Limits::password_hash_permit_in`]).
    pub async fn password_hash_permit(&self) -> Result<HashPermit<'_>, ApiError> {
        self.password_hash_permit_in(HashLane::Clean).await
    }

    /// A permit to hash one password, waiting at most the configured time.
    /// A suspect check first takes the suspect lane's one place in the hash
    /// queue, so at most one suspect check is ever queued ahead of a clean
    /// one; it gives the place back once it holds its hash permit.
    pub async fn password_hash_permit_in(&self, lane: HashLane) -> Result<HashPermit<'_>, ApiError> {
        let waiting = &self.waiting[lane as usize];
        waiting.fetch_add(1, Ordering::SeqCst);
        let acquire = async {
            let _place = match lane {
                HashLane::Clean => None,
                HashLane::Suspect => Some(self.suspect_gate.acquire().await?),
            };
            self.hashes.acquire().await
        };
        let got = tokio::time::timeout(self.config.password_hash_wait, acquire).await;
        waiting.fetch_sub(1, Ordering::SeqCst);
        match got {
            Ok(Ok(permit)) => {
                let now = self.hashing.fetch_add(1, Ordering::SeqCst) + 1;
                self.hashing_peak.fetch_max(now, Ordering::SeqCst);
                Ok(HashPermit { _permit: permit, hashing: &self.hashing })
            }
            Ok(Err(_)) => Err(ApiError::new(ErrorCode::Unavailable, "shutting down")),
            Err(_) => Err(rate_limited(PASSWORD_HASH_RETRY_AFTER_MS, "password checks")),
        }
    }

    /// Password checks waiting for a hash now, in `lane`.
    pub fn hashes_waiting(&self, lane: HashLane) -> usize {
        self.waiting[lane as usize].load(Ordering::SeqCst)
    }

    /// Runs one password hash (or verification) in the clean lane (see
    /// [`Limits::hash_in`]).
    pub async fn hash<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
        self.hash_in(HashLane::Clean, job).await
    }

    /// Runs one password hash (or verification) on the hashing threads,
    /// after waiting for a permit in `lane` as
    /// [`Limits::password_hash_permit_in`] does. The threads are as many as
    /// the permits and live as long as the server, so each reuses its own
    /// ~19 MiB of Argon2 memory: the memory hashing holds is bounded by the
    /// permits, and does not grow with the blocking pool's threads (each of
    /// which would keep its own arena).
    pub async fn hash_in<T: Send + 'static>(
        &self,
        lane: HashLane,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = self.password_hash_permit_in(lane).await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = self.hash_jobs.send(Box::new(move || {
            let _ = tx.send(job());
        }));
        if sent.is_err() {
            return Err(ApiError::new(ErrorCode::Internal, "the hashing threads are gone"));
        }
        let out = rx.await.map_err(|_| ApiError::new(ErrorCode::Internal, "a hashing thread stopped"));
        drop(permit);
        out
    }

    /// The most password hashes that ever ran at once on this server.
    pub fn password_hashes_peak(&self) -> usize {
        self.hashing_peak.load(Ordering::SeqCst)
    }

    /// Forgets limiter keys whose quota is whole again and failure counts
    /// past their forget window, so memory follows the active keys.
    pub fn sweep(&self, now_ms: i64) {
        for l in [&self.send_device, &self.sync_device, &self.read_device, &self.ephemeral_device] {
            l.retain_recent();
            l.shrink_to_fit();
        }
        for l in [&self.send_user, &self.change_user] {
            l.retain_recent();
            l.shrink_to_fit();
        }
        for l in [&self.login_address, &self.connect_address, &self.frames_address, &self.requests_address] {
            l.retain_recent();
            l.shrink_to_fit();
        }
        let policy = self.config.reconnect_penalty;
        self.penalties.lock().expect("limits lock").retain(|_, f| !policy.forgotten(f.last_ms, now_ms));
        let forget_ms = self.config.login_failures_forget_after.as_millis() as i64;
        self.failures_by_address.lock().expect("limits lock").retain(|_, f| now_ms - f.last_ms < forget_ms);
        self.failures_by_account.lock().expect("limits lock").retain(|_, f| now_ms - f.last_ms < forget_ms);
        self.failures_by_ip.lock().expect("limits lock").retain(|_, f| now_ms - f.last_ms < forget_ms);
    }

    /// Keys held across every limiter (for tests and a gauge).
    pub fn keys(&self) -> usize {
        self.send_device.len()
            + self.sync_device.len()
            + self.read_device.len()
            + self.ephemeral_device.len()
            + self.send_user.len()
            + self.change_user.len()
            + self.login_address.len()
            + self.connect_address.len()
            + self.frames_address.len()
            + self.requests_address.len()
            + self.penalties.lock().expect("limits lock").len()
            + self.failures_by_address.lock().expect("limits lock").len()
            + self.failures_by_account.lock().expect("limits lock").len()
            + self.failures_by_ip.lock().expect("limits lock").len()
    }
}

/// One WebSocket's frame budget: its own limiter (a few dozen bytes, gone
/// with the connection) and the key of its address's.
pub struct FrameBudget {
    own: DefaultDirectRateLimiter,
    address: IpAddr,
}

/// Counts each source address's open TCP connections against
/// [`LimitsConfig::connections_per_address_max`] (IPv6 by /64). The listener
/// takes a place at the accept and the connection's socket holds it until
/// it closes, through a WebSocket upgrade (the place rides in the socket
/// hyper hands over). Only addresses with an open connection have an entry.
#[derive(Debug)]
pub struct AddressConns {
    live: Mutex<HashMap<IpAddr, Held>>,
    max: usize,
    answered_max: usize,
    enabled: bool,
}

/// An address's connections: being served, and being refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub served: usize,
    pub answering: usize,
}

/// What to do with a connection just accepted.
#[derive(Debug)]
pub enum Accepted {
    /// Serve it; the place is given back when the slot drops.
    Serve(AddressSlot),
    /// Answer its first request `RATE_LIMITED`, then close it.
    Refuse(AddressSlot),
    /// Close it now.
    Close,
}

impl AddressConns {
    /// A place for one more connection from `ip`, or the refusal
    /// (`tidemark_core::throttle::address_connection`). With limits off,
    /// every connection is served and nothing is counted.
    pub fn accept(self: &Arc<Self>, ip: IpAddr) -> Accepted {
        if !self.enabled {
            return Accepted::Serve(AddressSlot { conns: None, ip, refusing: false });
        }
        let ip = address_key(ip);
        let mut live = self.live.lock().expect("address connections lock");
        let held = live.entry(ip).or_default();
        let what = address_connection(held.served, held.answering, self.max, self.answered_max);
        let slot = |refusing| AddressSlot { conns: Some(self.clone()), ip, refusing };
        match what {
            AddressConnection::Serve => {
                held.served += 1;
                Accepted::Serve(slot(false))
            }
            AddressConnection::Refuse => {
                held.answering += 1;
                Accepted::Refuse(slot(true))
            }
            AddressConnection::Close => {
                if *held == Held::default() {
                    live.remove(&ip);
                }
                Accepted::Close
            }
        }
    }

    /// The connections `ip`'s address holds now.
    pub fn held(&self, ip: IpAddr) -> Held {
        self.live.lock().expect("address connections lock").get(&address_key(ip)).copied().unwrap_or_default()
    }

    /// Addresses holding a connection now.
    pub fn addresses(&self) -> usize {
        self.live.lock().expect("address connections lock").len()
    }
}

/// One TCP connection's place under its address's cap; dropping it (the
/// socket closed) gives the place back.
#[derive(Debug)]
pub struct AddressSlot {
    conns: Option<Arc<AddressConns>>,
    ip: IpAddr,
    refusing: bool,
}

impl AddressSlot {
    /// Whether the connection is over the cap, kept only to be refused.
    pub fn refusing(&self) -> bool {
        self.refusing
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let Some(conns) = &self.conns else { return };
        let mut live = conns.live.lock().expect("address connections lock");
        if let Some(held) = live.get_mut(&self.ip) {
            if self.refusing {
                held.answering = held.answering.saturating_sub(1);
            } else {
                held.served = held.served.saturating_sub(1);
            }
            if *held == Held::default() {
                live.remove(&self.ip);
            }
        }
    }
}

/// Marks a request that arrived on a connection over its address's cap
/// (a request extension set by the listener).
#[derive(Debug, Clone, Copy)]
pub struct OverConnectionCap;

/// Whose frame budget ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameScope {
    Connection,
    Address,
}

impl FrameScope {
    pub fn as_str(self) -> &'static str {
        match self {
            FrameScope::Connection => "connection",
            FrameScope::Address => "address",
        }
    }
}

/// Values of the `scope` label of the frame-budget pauses.
pub const FRAME_SCOPES: &[&str] = &["connection", "address"];

/// A WebSocket over its frame budget: read nothing more from it for `wait`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FramePause {
    pub wait: Duration,
    pub scope: FrameScope,
}

/// Why a request was refused for its address before it was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressRefusalReason {
    /// The address serves its period after closes for ignored waits.
    Penalty,
    /// The address is over its request budget.
    Requests,
    /// The request came on a connection over the address's connection
    /// cap (answered, then the connection closes).
    Connections,
    /// A connection over the cap closed at the accept, unanswered (counted
    /// by the listener; no request was read).
    ConnectionsClosed,
}

impl AddressRefusalReason {
    pub fn as_str(self) -> &'static str {
        match self {
            AddressRefusalReason::Penalty => "penalty",
            AddressRefusalReason::Requests => "requests",
            AddressRefusalReason::Connections => "connections",
            AddressRefusalReason::ConnectionsClosed => "connections_closed",
        }
    }
}

/// Values of the `reason` label of the address refusals.
pub const ADDRESS_REFUSAL_REASONS: &[&str] = &["penalty", "requests", "connections", "connections_closed"];

/// A request refused for its address (`RATE_LIMITED`, `retry_after_ms`).
#[derive(Debug)]
pub struct AddressRefusal {
    pub error: ApiError,
    pub reason: AddressRefusalReason,
}

type HashJob = Box<dyn FnOnce() + Send>;

/// Allocations of this size or more are mapped from the OS and given back
/// when freed (glibc's `M_MMAP_THRESHOLD`).
pub const MMAP_THRESHOLD_BYTES: i32 = 1024 * 1024;

/// Makes large allocations go back to the OS when freed. Each Argon2 hash
/// allocates ~19 MiB; glibc raises its mmap threshold after the first such
/// block is freed and keeps the later ones on its heaps, so a burst of
/// logins left the process holding hundreds of MiB (5.2 GB idle after a
/// flood, issue 15). A fixed threshold keeps them mapped: a login flood
/// costs at most its concurrent hashes, and that memory is returned. Once
/// per process; a no-op off glibc.
pub fn return_large_allocations_to_the_os() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes an allocator tunable; it is called
        // once, before the server allocates the blocks it affects.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
        }
    });
}

/// `n` threads that run hash jobs until every sender is gone.
fn spawn_hash_threads(n: usize) -> std::sync::mpsc::Sender<HashJob> {
    let (tx, rx) = std::sync::mpsc::channel::<HashJob>();
    let rx = std::sync::Arc::new(Mutex::new(rx));
    for i in 0..n {
        let rx = rx.clone();
        std::thread::Builder::new()
            .name(format!("tidemark-hash-{i}"))
            .spawn(move || loop {
                let job = match rx.lock().expect("hash queue lock").recv() {
                    Ok(job) => job,
                    Err(_) => return,
                };
                job();
            })
            .expect("spawn a hashing thread");
    }
    tx
}

/// The right to run one password hash; dropping it lets the next one run.
#[derive(Debug)]
pub struct HashPermit<'a> {
    _permit: SemaphorePermit<'a>,
    hashing: &'a AtomicUsize,
}

impl Drop for HashPermit<'_> {
    fn drop(&mut self) {
        self.hashing.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts one more failure for `key`, keeping the map within `max` keys:
/// expired keys go first, then the stalest.
fn bump<K: std::hash::Hash + Eq + Clone>(
    map: &mut HashMap<K, Failures>,
    key: K,
    now_ms: i64,
    forget_ms: i64,
    max: usize,
) {
    if !map.contains_key(&key) && map.len() >= max {
        map.retain(|_, f| now_ms - f.last_ms < forget_ms);
        if map.len() >= max {
            if let Some(stalest) = map.iter().min_by_key(|(_, f)| f.last_ms).map(|(k, _)| k.clone()) {
                map.remove(&stalest);
            }
        }
    }
    let entry = map.entry(key).or_insert(Failures { count: 0, last_ms: now_ms });
    if now_ms - entry.last_ms >= forget_ms {
        entry.count = 0;
    }
    entry.count = entry.count.saturating_add(1);
    entry.last_ms = now_ms;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn every_operation_has_a_class() {
        let cases: &[(&str, OpClass)] = &[
            (op::SEND, OpClass::Send),
            (op::RECALL, OpClass::Send),
            (op::SYNC, OpClass::Sync),
            (op::ACK, OpClass::Sync),
            (op::DIRTY_CLEAR, OpClass::Sync),
            (op::CLIENT_STATS, OpClass::Sync),
            (op::HISTORY, OpClass::Read),
            (op::CONV_SYNC, OpClass::Read),
            (op::CONV_MEMBERS, OpClass::Read),
            (op::CONV_CREATE, OpClass::Change),
            (op::CONV_LEAVE, OpClass::Change),
            (op::PING, OpClass::Free),
            (op::DEVICE_REVOKE, OpClass::Free),
        ];
        for (name, class) in cases {
            assert_eq!(OpClass::of(name), *class, "{name}");
        }
    }

    #[test]
    fn a_device_over_its_send_quota_is_told_when_to_retry_and_others_are_not_affected() {
        // One send a minute after the burst: no refill while the test runs.
        let cell = Duration::from_secs(60);
        let limits = Limits::new(LimitsConfig { send_per_device: Rate::every(cell, 3), ..Default::default() });
        for _ in 0..3 {
            limits.admit_op(op::SEND, "ann", "phone").unwrap();
        }
        let refused = limits.admit_op(op::SEND, "ann", "phone").unwrap_err();
        assert_eq!(refused.code, ErrorCode::RateLimited);
        let wait = refused.retry_after_ms.unwrap();
        assert!((1..=cell.as_millis() as u64).contains(&wait), "retry_after_ms {wait}");
        // Another device, another user, and another class go on.
        limits.admit_op(op::SEND, "ann", "laptop").unwrap();
        limits.admit_op(op::SEND, "ben", "phone").unwrap();
        limits.admit_op(op::SYNC, "ann", "phone").unwrap();
        limits.admit_op(op::DEVICE_REVOKE, "ann", "phone").unwrap();
    }

    #[test]
    fn a_frame_budget_holds_a_connection_and_its_address_and_says_how_long_to_stop_reading() {
        // Nothing refills while the test runs.
        let cell = Duration::from_secs(60);
        let limits = Limits::new(LimitsConfig {
            frames_per_connection: Rate::every(cell, 3),
            frames_per_address: Rate::every(cell, 5),
            ..Default::default()
        });
        let first = limits.frame_budget(ip("10.0.0.1"));
        for _ in 0..3 {
            limits.admit_frame(&first).unwrap();
        }
        let pause = limits.admit_frame(&first).unwrap_err();
        assert_eq!(pause.scope, FrameScope::Connection);
        assert!((FRAME_PAUSE_MIN..=cell).contains(&pause.wait), "{pause:?}");
        // A second connection of the address has a budget of its own, but
        // shares the address's: two frames of it are left.
        let second = limits.frame_budget(ip("10.0.0.1"));
        limits.admit_frame(&second).unwrap();
        limits.admit_frame(&second).unwrap();
        assert_eq!(limits.admit_frame(&second).unwrap_err().scope, FrameScope::Address);
        // Reconnecting does not reset the address's budget; another address
        // is not affected.
        assert_eq!(limits.admit_frame(&limits.frame_budget(ip("10.0.0.1"))).unwrap_err().scope, FrameScope::Address);
        limits.admit_frame(&limits.frame_budget(ip("10.0.0.2"))).unwrap();
        // Off: nothing is held back.
        let off = Limits::new(LimitsConfig { frames_per_connection: Rate::every(cell, 1), ..LimitsConfig::off() });
        let budget = off.frame_budget(ip("10.0.0.1"));
        for _ in 0..10 {
            off.admit_frame(&budget).unwrap();
        }
    }

    #[test]
    fn an_address_closed_for_ignoring_waits_is_refused_for_its_period_then_admitted() {
        let limits = Limits::new(LimitsConfig::default());
        let (a, b) = (ip("10.0.0.1"), ip("10.0.0.2"));
        limits.admit_request(a, false, 1_000).unwrap();
        assert_eq!(limits.closed_for_ignored_waits(a, 1_000), RECONNECT_PENALTY.first_ms);
        let refused = limits.admit_request(a, false, 1_400).unwrap_err();
        assert_eq!(refused.reason, AddressRefusalReason::Penalty);
        assert_eq!(refused.error.code, ErrorCode::RateLimited);
        assert_eq!(refused.error.retry_after_ms, Some(600));
        limits.admit_request(b, false, 1_400).unwrap();
        limits.admit_request(a, false, 2_000).unwrap();
        // Closed again: the period doubles.
        assert_eq!(limits.closed_for_ignored_waits(a, 2_000), 2 * RECONNECT_PENALTY.first_ms);
        assert_eq!(limits.admit_request(a, false, 3_999).unwrap_err().error.retry_after_ms, Some(1));
        limits.admit_request(a, false, 4_000).unwrap();
        // A quiet address is forgotten: its next close starts again.
        let later = 2_000 + RECONNECT_PENALTY.forget_after_ms as i64;
        limits.sweep(later);
        assert_eq!(limits.penalties.lock().unwrap().len(), 0);
        assert_eq!(limits.closed_for_ignored_waits(a, later), RECONNECT_PENALTY.first_ms);
    }

    #[test]
    fn an_address_holds_its_cap_of_connections_and_a_closed_one_gives_its_place_back() {
        let limits = Limits::new(LimitsConfig {
            connections_per_address_max: 2,
            connection_refusals_per_address_max: 1,
            ..Default::default()
        });
        let conns = limits.address_conns();
        let (a, a_same_64, b) = (ip("2001:db8:1:2::1"), ip("2001:db8:1:2::9"), ip("10.0.0.2"));
        let Accepted::Serve(first) = conns.accept(a) else { panic!("the first is served") };
        let Accepted::Serve(second) = conns.accept(a_same_64) else { panic!("the second is served") };
        // The /64 is full: one refusal is answered, the next closed at once.
        let Accepted::Refuse(refusing) = conns.accept(a) else { panic!("one over the cap is answered") };
        assert!(refusing.refusing());
        assert!(matches!(conns.accept(a), Accepted::Close));
        assert_eq!(conns.held(a), Held { served: 2, answering: 1 });
        // Another address is not affected.
        let Accepted::Serve(other) = conns.accept(b) else { panic!("another address is served") };
        // The refusal ends: another can be answered; a served one ends: one
        // more is served.
        drop(refusing);
        assert!(matches!(conns.accept(a), Accepted::Refuse(_)));
        drop(first);
        assert!(matches!(conns.accept(a), Accepted::Serve(_)));
        assert_eq!(conns.held(a), Held { served: 1, answering: 0 }, "dropped slots gave their places back");
        drop(other);
        drop(second);
        assert_eq!(conns.addresses(), 0, "an address with nothing open is forgotten");
        // Limits off: nothing counted, nothing refused.
        let off = Limits::new(LimitsConfig { connections_per_address_max: 0, ..LimitsConfig::off() });
        let held: Vec<_> = (0..10).map(|_| off.address_conns().accept(a)).collect();
        assert!(held.iter().all(|h| matches!(h, Accepted::Serve(_))));
        assert_eq!(off.address_conns().addresses(), 0);
    }

    #[test]
    fn a_request_on_a_connection_over_the_cap_is_rate_limited_before_anything_else() {
        let limits = Limits::new(LimitsConfig::default());
        let refused = limits.admit_request(ip("10.0.0.1"), true, 0).unwrap_err();
        assert_eq!(refused.reason, AddressRefusalReason::Connections);
        assert_eq!(refused.error.code, ErrorCode::RateLimited);
        assert_eq!(refused.error.retry_after_ms, Some(CONNECTIONS_PER_ADDRESS_RETRY_AFTER_MS));
        limits.admit_request(ip("10.0.0.1"), false, 0).unwrap();
    }

    #[test]
    fn requests_from_an_address_over_its_budget_are_refused_before_they_are_read() {
        let limits = Limits::new(LimitsConfig {
            requests_per_address: Rate::every(Duration::from_secs(60), 2),
            ..Default::default()
        });
        let a = ip("10.0.0.1");
        limits.admit_request(a, false, 0).unwrap();
        limits.admit_request(a, false, 0).unwrap();
        let refused = limits.admit_request(a, false, 0).unwrap_err();
        assert_eq!(refused.reason, AddressRefusalReason::Requests);
        assert!(refused.error.retry_after_ms.is_some_and(|w| w > 0));
        limits.admit_request(ip("10.0.0.2"), false, 0).unwrap();
    }

    #[test]
    fn a_disabled_configuration_limits_nothing() {
        let limits =
            Limits::new(LimitsConfig { enabled: false, send_per_device: Rate::new(1, 1), ..Default::default() });
        for _ in 0..100 {
            limits.admit_op(op::SEND, "ann", "phone").unwrap();
        }
    }

    #[test]
    fn ipv6_addresses_share_their_slash_64() {
        assert_eq!(address_key(ip("2001:db8:1:2:aaaa::1")), address_key(ip("2001:db8:1:2:bbbb::9")));
        assert_ne!(address_key(ip("2001:db8:1:2::1")), address_key(ip("2001:db8:1:3::1")));
        assert_eq!(address_key(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
    }

    #[test]
    fn failed_logins_grow_a_delay_that_a_success_clears() {
        let limits = Limits::new(LimitsConfig::default());
        let (a, b) = (ip("127.0.0.2"), ip("127.0.0.3"));
        for i in 0..5 {
            limits.admit_login("ann", a, 1_000 + i).unwrap();
            limits.login_outcome("ann", a, false, 1_000 + i);
        }
        limits.admit_login("ann", a, 2_000).unwrap();
        limits.login_outcome("ann", a, false, 2_000);
        let refused = limits.admit_login("ann", a, 2_100).unwrap_err();
        assert_eq!(refused.code, ErrorCode::RateLimited);
        assert_eq!(refused.retry_after_ms, Some(900));
        // The same account from another address is not delayed yet (the
        // account-wide count allows 20), and the delay runs out.
        limits.admit_login("ann", b, 2_100).unwrap();
        limits.admit_login("ann", a, 3_000).unwrap();
        // A success forgets the failures.
        limits.login_outcome("ann", a, true, 3_000);
        limits.admit_login("ann", a, 3_000).unwrap();
    }

    #[test]
    fn an_attacker_on_many_addresses_delays_the_account_by_the_short_cap_only() {
        let limits = Limits::new(LimitsConfig::default());
        for i in 0..200u32 {
            let attacker = IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i));
            limits.login_outcome("ann", attacker, false, 10_000);
        }
        let refused = limits.admit_login("ann", ip("127.0.0.9"), 10_000).unwrap_err();
        assert!(refused.retry_after_ms.unwrap() <= LOGIN_BACKOFF_PER_ACCOUNT.max_delay_ms);
        limits.admit_login("ann", ip("127.0.0.9"), 10_000 + 30_000).unwrap();
    }

    #[test]
    fn failure_keys_stay_within_their_bound_and_sweeps_forget_them() {
        let limits = Limits::new(LimitsConfig { login_failure_keys_max: 10, ..Default::default() });
        for i in 0..100u32 {
            limits.login_outcome(&format!("user{i}"), ip("127.0.0.2"), false, i as i64);
        }
        assert!(limits.failures_by_address.lock().unwrap().len() <= 10);
        assert!(limits.failures_by_account.lock().unwrap().len() <= 10);
        limits.sweep(100 + LOGIN_FAILURES_FORGET_AFTER.as_millis() as i64);
        assert_eq!(limits.failures_by_address.lock().unwrap().len(), 0);
    }

    #[tokio::test]
    async fn an_honest_login_waits_behind_at_most_one_suspect_check_however_many_guessers_queue() {
        let limits = Arc::new(Limits::new(LimitsConfig {
            password_hashes_concurrent_max: 1,
            password_hash_wait: Duration::from_secs(600),
            ..Default::default()
        }));
        // Five guessing addresses, each past its failures; one honest.
        let guessers: Vec<IpAddr> = (1..=5).map(|i| ip(&format!("127.0.1.{i}"))).collect();
        for g in &guessers {
            for t in 0..SUSPECT_AFTER_FAILURES as i64 {
                limits.login_outcome("ann", *g, false, 1_000 + t);
            }
            assert_eq!(limits.login_lane(*g, 2_000), HashLane::Suspect);
        }
        let honest = ip("127.0.0.2");
        assert_eq!(limits.login_lane(honest, 2_000), HashLane::Clean);
        // The window forgets a guesser; a success does not wash it.
        limits.login_outcome("mine", guessers[1], true, 1_500);
        assert_eq!(limits.login_lane(guessers[1], 2_000), HashLane::Suspect);
        let forgotten = 2_000 + LOGIN_FAILURES_FORGET_AFTER.as_millis() as i64;
        assert_eq!(limits.login_lane(guessers[0], forgotten), HashLane::Clean);

        // The one hash is busy; every guesser queues, then the honest login.
        let busy = limits.password_hash_permit().await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        let check = |who: String, lane: HashLane| {
            let (limits, order) = (limits.clone(), order.clone());
            tokio::spawn(async move {
                let permit = limits.password_hash_permit_in(lane).await.unwrap();
                order.lock().unwrap().push(who);
                drop(permit);
            })
        };
        for (i, g) in guessers.iter().enumerate() {
            tasks.push(check(format!("guess{i}"), limits.login_lane(*g, 2_000)));
        }
        wait_until(|| limits.hashes_waiting(HashLane::Suspect) == guessers.len()).await;
        tasks.push(check("honest".into(), limits.login_lane(honest, 2_000)));
        wait_until(|| limits.hashes_waiting(HashLane::Clean) == 1).await;
        drop(busy);
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        let at = order.iter().position(|w| w == "honest").unwrap();
        assert!(at <= 1, "the honest check ran after {at} suspect checks: {order:?}");
        assert_eq!(order.len(), guessers.len() + 1, "every suspect check still ran: {order:?}");
    }

    /// Polls `cond`, yielding to the runtime, for at most ten thousand turns.
    async fn wait_until(cond: impl Fn() -> bool) {
        for _ in 0..10_000 {
            if cond() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("condition not reached");
    }

    #[tokio::test]
    async fn password_hashes_are_bounded_and_the_excess_is_refused_after_its_wait() {
        let limits = Limits::new(LimitsConfig {
            password_hashes_concurrent_max: 2,
            password_hash_wait: Duration::from_millis(50),
            ..Default::default()
        });
        let p1 = limits.password_hash_permit().await.unwrap();
        let _p2 = limits.password_hash_permit().await.unwrap();
        let refused = limits.password_hash_permit().await.unwrap_err();
        assert_eq!(refused.code, ErrorCode::RateLimited);
        drop(p1);
        let _permit = limits.password_hash_permit().await.unwrap();
    }
}
