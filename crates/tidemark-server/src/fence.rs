//! Fences that hold on every node of a cluster (P2, P5): a revoked device
//! is refused and disconnected everywhere, a newer connection of a device
//! ends the older ones wherever they are, and an operator's end of
//! sessions (a logout of a device or of a user, a deactivation, a deletion,
//! the other devices after a password change) refuses the ended sessions'
//! tokens and disconnects them on every node.
//!
//! The store is the truth: `devices.state = 'REVOKED'`, the device's
//! `connection_epoch`, the recorded session ends and deactivations
//! ([`tidemark_store::Store::session_fences`]), committed before anything
//! is announced. The node
//! where a fence happens applies it at once and announces it on the hint
//! bus ([`crate::bus::HintBus::publish_kick`]); every node applies what it
//! hears at once. A bus message can be lost (it is fire-and-forget), so in
//! cluster mode [`run_refresh`] reloads the fences from the store every
//! [`FENCE_REFRESH_EVERY`]: the revoked devices (every request checks that
//! set, [`Fences::is_revoked`]) and the connection epochs of the devices
//! connected here. The bound: a revoked device is refused by, and a
//! superseded connection ends on, every node within the bus's latency, and
//! never later than one refresh period plus the reload's own time after
//! the fence committed, whatever the bus lost. The same holds for session
//! ends: a reload reads the recorded ends and deactivations (only when the
//! store's `fences_version`, moved by every fence write, changed), and a
//! connection whose token was issued before an end it had not heard of is
//! kicked then. Meanwhile a frame that
//! arrives on a connection the hub already kicked is dropped unread
//! (`gateway::ws`), so once a node knows, nothing of the old connection
//! runs there.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tidemark_proto::reason;
use tokio::sync::watch;

use crate::hub::Hub;
use crate::sessions::Sessions;
use crate::state::AppState;

/// How often a cluster node reloads the fences from the store: the bound
/// on a fence whose bus message was lost.
pub const FENCE_REFRESH_EVERY: Duration = Duration::from_secs(1);

/// The revoked devices and ended sessions this node knows of, and the hub
/// whose connections the fences end.
#[derive(Debug)]
pub struct Fences {
    revoked: RwLock<HashSet<(String, String)>>,
    sessions: Arc<Sessions>,
    hub: Arc<Hub>,
}

impl Fences {
    pub fn new(hub: Arc<Hub>, sessions: Arc<Sessions>, revoked: impl IntoIterator<Item = (String, String)>) -> Fences {
        Fences { revoked: RwLock::new(revoked.into_iter().collect()), sessions, hub }
    }

    pub fn is_revoked(&self, user: &str, device: &str) -> bool {
        self.revoked.read().expect("revoked lock").contains(&(user.to_owned(), device.to_owned()))
    }

    /// The device is revoked: refuse its requests and end its connections
    /// here. Returns whether this node did not know it yet.
    pub fn revoke(&self, user: &str, device: &str) -> bool {
        let new = self.revoked.write().expect("revoked lock").insert((user.to_owned(), device.to_owned()));
        self.hub.kick_device(user, device, reason::DEVICE_REVOKED);
        new
    }

    /// A connection of the device with `epoch` opened (on any node): the
    /// older ones here end.
    pub fn supersede(&self, user: &str, device: &str, epoch: u64) {
        self.hub.supersede(user, device, epoch);
    }

    /// The sessions of `device` (or of every device of `user`) issued up to
    /// `at_ms` ended: refuse their tokens and end their connections here
    /// (`logged_out`). Returns whether this node did not know it yet.
    pub fn end_sessions(&self, user: &str, device: Option<&str>, at_ms: i64) -> bool {
        let new = self.sessions.end(user, device, at_ms);
        self.kick_ended(user, reason::LOGGED_OUT);
        new
    }

    /// The account is deactivated: refuse its tokens and end its connections
    /// here (`account_deactivated`). Returns whether this node did not know it.
    pub fn deactivate(&self, user: &str) -> bool {
        let new = self.sessions.deactivate(user);
        self.kick_ended(user, reason::ACCOUNT_DEACTIVATED);
        new
    }

    /// Ends the connections of `user` here whose session no longer opens.
    fn kick_ended(&self, user: &str, why: &'static str) {
        self.hub.kick_ended(user, why, |device, issued_at_ms| self.sessions.alive(user, device, issued_at_ms));
    }

    /// Applies a fence heard on the bus; an unknown reason is ignored (a
    /// newer build's fence this one does not know).
    pub fn apply(&self, user: &str, kick: &tidemark_proto::BusKick) {
        match kick.reason.as_str() {
            reason::DEVICE_REVOKED => {
                self.revoke(user, &kick.device);
            }
            reason::SUPERSEDED => self.supersede(user, &kick.device, kick.connection_epoch),
            reason::LOGGED_OUT => {
                let device = (!kick.device.is_empty()).then_some(kick.device.as_str());
                self.end_sessions(user, device, kick.ended_at_ms);
            }
            reason::ACCOUNT_DEACTIVATED => {
                self.deactivate(user);
            }
            other => tracing::debug!(reason = other, "unknown fence on the bus ignored"),
        }
    }
}

/// Reloads the fences from the store every [`FENCE_REFRESH_EVERY`] (cluster
/// mode), the fallback of the bus: a fence lost on the bus holds here one
/// period later. A failed reload is retried at the next period.
/// Reloads the fences every [`FENCE_REFRESH_EVERY`]. `cluster`: also the
/// connection epochs and ACKs of the devices connected here, which only
/// another node can move. On one node the loop still runs, so an
/// operator's `tidemark user …`/`tidemark device …` command, written
/// straight to the store by another process, reaches the running server
/// within the period too.
pub async fn run_refresh(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>, cluster: bool) {
    let mut seen = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(FENCE_REFRESH_EVERY) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
        if let Err(e) = refresh_once(&state, &mut seen, cluster).await {
            tracing::warn!(error = %e, "fence reload failed; retrying next period");
        }
    }
}

/// One reload: the revoked devices and the session ends, then the epochs
/// and committed ACKs of the devices connected here.
/// One reload. The revoked devices and the recorded session ends are read
/// only when [`tidemark_store::Store::fences_version`] moved since `seen`
/// (a point read otherwise); `seen` is updated after they were applied.
pub async fn refresh_once(state: &AppState, seen: &mut Option<u64>, cluster: bool) -> tidemark_store::StoreResult<()> {
    let version = state.store.fences_version().await?;
    if *seen != Some(version) {
        reload_fences(state).await?;
        *seen = Some(version);
    }
    if cluster {
        refresh_connected(state).await?;
    }
    Ok(())
}

async fn reload_fences(state: &AppState) -> tidemark_store::StoreResult<()> {
    for (user, device) in state.store.revoked_devices().await? {
        if !state.fences.is_revoked(&user, &device) && state.fences.revoke(&user, &device) {
            tracing::info!(user_hash = %state.log_id(&user), device_hash = %state.log_id(&device), "revocation learnt from the store");
        }
    }
    let ends = state.store.session_fences().await?;
    for user in ends.deactivated {
        if !state.sessions.is_deactivated(&user) && state.fences.deactivate(&user) {
            tracing::info!(user_hash = %state.log_id(&user), "deactivation learnt from the store");
        }
    }
    for (user, at_ms) in ends.users_ended {
        if state.sessions.end(&user, None, at_ms) {
            state.fences.end_sessions(&user, None, at_ms);
            tracing::info!(user_hash = %state.log_id(&user), "end of sessions learnt from the store");
        }
    }
    for (user, device, at_ms) in ends.devices_ended {
        if state.sessions.end(&user, Some(&device), at_ms) {
            state.fences.end_sessions(&user, Some(&device), at_ms);
            tracing::info!(
                user_hash = %state.log_id(&user),
                device_hash = %state.log_id(&device),
                "end of a device's sessions learnt from the store"
            );
        }
    }
    Ok(())
}

/// The connection epochs and committed ACKs of the devices connected here.
async fn refresh_connected(state: &AppState) -> tidemark_store::StoreResult<()> {
    let connected = state.hub.devices();
    if connected.is_empty() {
        return Ok(());
    }
    for fence in state.store.device_fences(&connected).await? {
        if fence.revoked {
            state.fences.revoke(&fence.user, &fence.device);
        }
        state.fences.supersede(&fence.user, &fence.device, fence.connection_epoch);
        // An ACK taken by another node: the re-hint sweep measures the
        // device's lag from the store's cursor, not only from ACKs seen here.
        state.hub.on_ack(&fence.user, &fence.device, fence.acked_sync_seq);
    }
    Ok(())
}
