//! The shared state: everything a request handler or background worker may
//! use, built once by [`crate::server::Server::start`] and passed
//! explicitly (no globals). It sits below every module that uses it, so no
//! import circles through the wiring.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use metrics_exporter_prometheus::PrometheusHandle;
use tidemark_core::token::TokenKeys;
use tidemark_store::Store;
use tokio::sync::{watch, Notify};

use crate::bus::HintBus;
use crate::config::ServerConfig;
use crate::hub::Hub;

/// Everything a request handler may use, passed explicitly (no globals).
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub keys: TokenKeys,
    pub config: ServerConfig,
    pub hub: Arc<Hub>,
    /// Carries this node's hints to the other nodes' hubs.
    pub bus: HintBus,
    /// Where this node's sends are written: here, or forwarded to their
    /// conversation's owner node (cluster mode, issue 14).
    pub router: crate::route::Router,
    /// Wakes the outbox relay after a send commits (a hint: it also polls).
    pub relay_wake: Notify,
    /// Wakes the push worker after a fan-out committed (a hint: it polls).
    pub push_wake: Notify,
    /// Seals and opens provider tokens at rest (P4).
    pub push_sealer: tidemark_push::seal::TokenSealer,
    /// Revoked devices, fenced in memory so no request of theirs runs, and
    /// the cluster-wide fences (`fence`).
    pub fences: Arc<crate::fence::Fences>,
    pub metrics: PrometheusHandle,
    pub shutdown: watch::Receiver<bool>,
    /// This node's WebSocket connections, at most
    /// [`ServerConfig::ws_connections_max`].
    pub ws_slots: Arc<ConnSlots>,
    /// Rate limits and the password-hash bound.
    pub limits: crate::limits::Limits,
    /// Large-group hints (G2): the member cache and the hub.
    pub groups: Arc<crate::groups::GroupHints>,
    /// Typing and presence of this node's connections (issue 18).
    pub lane: Arc<crate::ephemeral::Lane>,
    /// Sessions ended by an operator, and deactivated accounts.
    pub sessions: Arc<crate::sessions::Sessions>,
    /// This node's WebSocket connections per user, at most
    /// [`ServerConfig::ws_connections_per_user_max`].
    pub ws_user_slots: Arc<UserConnSlots>,
    /// The load level the relay last observed, and the degradation order
    /// applied to it (seed §9.4).
    pub load: crate::degrade::LoadState,
    /// The store's gauges as last read and when: `/metrics` reads them
    /// again only once they are [`ServerConfig::gauges_every`] old, so the
    /// aggregates over every user head and device cost one scan per period
    /// whatever the scrape rate (concurrent scrapes share one read).
    pub gauges: tokio::sync::Mutex<Option<(std::time::Instant, tidemark_store::StoreGauges)>>,
    /// Snapshot builds running at once, at most
    /// [`ServerConfig::snapshot_builds_max`]: each holds one of the store's
    /// read connections for its whole view, and sync pages need the rest.
    pub snapshot_builds: tokio::sync::Semaphore,
}

impl AppState {
    /// The store's gauges, read at most once per `gauges_every`; `None`
    /// when the store did not answer and nothing was read before.
    pub async fn sampled_gauges(&self, now_ms: i64) -> Option<tidemark_store::StoreGauges> {
        let mut last = self.gauges.lock().await;
        if let Some((at, g)) = *last {
            if at.elapsed() < self.config.gauges_every {
                return Some(g);
            }
        }
        match self.store.gauges(now_ms).await {
            Ok(g) => {
                *last = Some((std::time::Instant::now(), g));
                Some(g)
            }
            Err(_) => last.map(|(_, g)| g),
        }
    }

    /// A user's log now reaches `hw`: hints this node's connections and
    /// the other nodes' (through the bus).
    pub fn hint_user(&self, user: &str, hw: u64) {
        self.hub.notify_user(user, hw);
        self.bus.publish(user, hw);
        crate::trace_stage!(stage = "push", trace_id = "", user_hash = %self.log_id(user), sync_seq = hw,
            result = "hinted", "hint queued");
    }

    /// The name a log line gives a user or device id: the keyed hash of
    /// `TokenKeys::log_id`, the one home of that rule.
    pub fn log_id(&self, id: &str) -> String {
        self.keys.log_id(id)
    }

    /// A large group's marker was published here: hint its members on this
    /// node and on the others.
    pub async fn hint_conv(&self, moved: &tidemark_store::ConvMoved) {
        self.groups.deliver(moved).await;
        self.bus.publish_conv(moved);
    }

    /// Whether the access token of `ctx` still opens a session: not logged
    /// out by an operator since it was issued, its account not deactivated.
    pub fn session_alive(&self, user: &str, device: &str, expires_at_ms: i64) -> bool {
        self.sessions.alive(user, device, self.token_issued_at_ms(expires_at_ms))
    }

    /// When an access token that expires at `expires_at_ms` was issued.
    pub fn token_issued_at_ms(&self, expires_at_ms: i64) -> i64 {
        expires_at_ms - self.config.access_token_ttl.as_millis() as i64
    }

    pub fn is_revoked(&self, user: &str, device: &str) -> bool {
        self.fences.is_revoked(user, device)
    }
}

/// Counts a node's live WebSocket connections against a cap. A slot is
/// taken at the upgrade and given back when its [`ConnSlot`] drops (the
/// connection ended, or its upgrade never completed).
#[derive(Debug)]
pub struct ConnSlots {
    live: AtomicUsize,
    max: usize,
}

impl ConnSlots {
    pub fn new(max: usize) -> Arc<ConnSlots> {
        Arc::new(ConnSlots { live: AtomicUsize::new(0), max })
    }

    /// A slot, or `None` when `max` connections are live.
    pub fn try_take(self: &Arc<Self>) -> Option<ConnSlot> {
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.max).then_some(n + 1))
            .ok()
            .map(|_| ConnSlot(self.clone()))
    }

    pub fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

/// One live connection's slot; dropping it frees the slot.
#[derive(Debug)]
pub struct ConnSlot(Arc<ConnSlots>);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts a node's live WebSocket connections per user and device against
/// the per-user cap (the rule is `tidemark_core::throttle::admits_connection`).
/// Only users with a live connection have an entry; a user's devices are a
/// short list (at most the cap), not a table, for idle memory (issue 19).
#[derive(Debug)]
pub struct UserConnSlots {
    live: Mutex<HashMap<String, Vec<(String, usize)>>>,
    max: usize,
}

impl UserConnSlots {
    pub fn new(max: usize) -> Arc<UserConnSlots> {
        Arc::new(UserConnSlots { live: Mutex::new(HashMap::new()), max })
    }

    /// A slot for one connection of `device`, or `None` when the user holds
    /// its most connections on this node.
    pub fn try_take(self: &Arc<Self>, user: &str, device: &str) -> Option<UserConnSlot> {
        let mut live = self.live.lock().expect("user slots lock");
        let devices = live.entry(user.to_owned()).or_insert_with(|| Vec::with_capacity(1));
        let user_live = devices.iter().map(|(_, n)| n).sum();
        let at = devices.iter().position(|(d, _)| d == device);
        let device_live = at.map_or(0, |i| devices[i].1);
        if !tidemark_core::throttle::admits_connection(user_live, device_live, self.max) {
            if devices.is_empty() {
                live.remove(user);
            }
            return None;
        }
        match at {
            Some(i) => devices[i].1 += 1,
            None => devices.push((device.to_owned(), 1)),
        }
        Some(UserConnSlot { slots: self.clone(), user: user.to_owned(), device: device.to_owned() })
    }

    /// Live connections of `user` on this node.
    pub fn live(&self, user: &str) -> usize {
        self.live.lock().expect("user slots lock").get(user).map_or(0, |d| d.iter().map(|(_, n)| n).sum())
    }
}

/// One connection's place under its user's cap; dropping it frees it.
#[derive(Debug)]
pub struct UserConnSlot {
    slots: Arc<UserConnSlots>,
    user: String,
    device: String,
}

impl Drop for UserConnSlot {
    fn drop(&mut self) {
        let mut live = self.slots.live.lock().expect("user slots lock");
        if let Some(devices) = live.get_mut(&self.user) {
            if let Some(i) = devices.iter().position(|(d, _)| *d == self.device) {
                devices[i].1 -= 1;
                if devices[i].1 == 0 {
                    devices.swap_remove(i);
                }
            }
            if devices.is_empty() {
                live.remove(&self.user);
            }
        }
    }
}
