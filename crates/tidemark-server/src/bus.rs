//! The hint bus: how "user U's log reached high watermark W" reaches the
//! hubs of every node, not just the one whose relay committed the fan-out.
//!
//! The relay hints its own [`Hub`] directly and then
//! [`HintBus::publish`]es the same pair. With [`HintBusConfig::Local`] (one
//! node, the default) publishing does nothing. With [`HintBusConfig::Nats`]
//! each node holds its own NATS connection (with `no_echo`, so it never hears
//! itself), publishes on `<prefix>.<user token>` (a subject per user) and
//! subscribes to `<prefix>.>`; what it hears goes to its hub's
//! `notify_user`, which hints the local connections of that user and raises
//! the user's watermark in the hub, so the re-hint sweep also covers a device
//! connected here whose log grew through another node.
//!
//! The same subjects carry fences (`BusHint::kick`, P2/P5): a revocation
//! or a newer connection of a device, which the node that committed it
//! publishes with [`HintBus::publish_kick`] and every node applies to its
//! connections at once ([`Fences::apply`]). Losing one costs a bounded
//! delay, not a fence: each node also reloads the fences from the store
//! (`fence::run_refresh`).
//!
//! Everything here is a hint (D8): a publish that cannot be queued is
//! dropped and counted, a message lost by NATS or a node's disconnection
//! costs latency only, because devices sync from their durable cursor on
//! connect and the re-hint sweep repeats hints to lagging devices. The bus
//! knows no store and no wire protocol; its payload is its own.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tidemark_proto::{reason, BusConv, BusHint, BusKick};
use tidemark_store::ConvMoved;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub use crate::config::HintBusConfig;
use crate::ephemeral::Lane;
use crate::fence::Fences;
use crate::groups::GroupHints;
use crate::hub::Hub;
use crate::metrics as m;

/// Hints waiting for the publisher task; beyond this they are dropped
/// (counted in `tidemark_hints_bus_dropped_total`).
pub const HINT_PUBLISH_QUEUE_MAX: usize = 4096;
/// Longest wait for the first connection to NATS at start-up.
pub const NATS_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest hint payload accepted from the bus, in bytes.
pub const HINT_PAYLOAD_BYTES_MAX: usize = 512;
/// The default subject prefix; a hint for user `u` goes to `tidemark.hint.u`.
pub const HINT_SUBJECT_PREFIX_DEFAULT: &str = "tidemark.hint";

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("invalid NATS subject prefix {0:?}")]
    Prefix(String),
    #[error("connect to NATS at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("subscribe to {subject}: {reason}")]
    Subscribe { subject: String, reason: String },
}

/// The publishing side, held in [`AppState`](crate::state::AppState).
#[derive(Debug, Default)]
pub struct HintBus {
    /// `None` for the local bus.
    tx: Option<mpsc::Sender<BusHint>>,
    /// The ephemeral lane's payloads (issue 18), `None` for the local bus.
    ephemeral: Option<mpsc::Sender<BusHint>>,
}

impl HintBus {
    /// Queues `(user, hw)` for the other nodes; never waits.
    pub fn publish(&self, user: &str, hw: u64) {
        self.queue(BusHint { user: user.to_owned(), high_watermark: hw, conv: None, kick: None, ephemeral: None });
    }

    /// Queues a large group's published marker for the other nodes (G2).
    pub fn publish_conv(&self, moved: &ConvMoved) {
        self.queue(BusHint {
            user: String::new(),
            high_watermark: 0,
            conv: Some(BusConv {
                conv: moved.conv.clone(),
                target: moved.target,
                version: moved.version,
                members_seq: moved.members_seq,
            }),
            kick: None,
            ephemeral: None,
        });
    }

    /// Queues a fence of `user`'s `device` for the other nodes (a `kicked`
    /// reason and, for `superseded`, the newest connection epoch); never
    /// waits. Published only after the store committed the fence.
    pub fn publish_kick(&self, user: &str, device: &str, reason: &str, connection_epoch: u64) {
        let kick = BusKick { device: device.to_owned(), reason: reason.to_owned(), connection_epoch, ended_at_ms: 0 };
        self.queue(BusHint { user: user.to_owned(), high_watermark: 0, conv: None, kick: Some(kick), ephemeral: None });
    }

    /// Queues an end of sessions for the other nodes: `logged_out` of one
    /// device (or, without one, of every device of `user`) at `ended_at_ms`,
    /// or `account_deactivated`. Published only after the store committed it.
    pub fn publish_session_end(&self, user: &str, device: Option<&str>, reason: &str, ended_at_ms: i64) {
        let device = device.unwrap_or_default().to_owned();
        let kick = BusKick { device, reason: reason.to_owned(), connection_epoch: 0, ended_at_ms };
        self.queue(BusHint { user: user.to_owned(), high_watermark: 0, conv: None, kick: Some(kick), ephemeral: None });
    }

    /// Where the ephemeral lane queues its payloads for the other nodes.
    pub fn ephemeral_sender(&self) -> Option<mpsc::Sender<BusHint>> {
        self.ephemeral.clone()
    }

    fn queue(&self, hint: BusHint) {
        let Some(tx) = &self.tx else { return };
        if tx.try_send(hint).is_err() {
            m::HINTS_BUS_DROPPED.inc();
        }
    }
}

/// Who takes what a node hears on the bus: user hints (the hub), fences,
/// large-group markers and the ephemeral lane.
pub struct Receivers {
    pub hub: Arc<Hub>,
    pub fences: Arc<Fences>,
    pub groups: Arc<GroupHints>,
    pub lane: Arc<Lane>,
}

/// A connected NATS bus not yet running: [`connect`] happens before the
/// server's state exists, [`Pending::spawn`] after.
pub struct Pending {
    client: async_nats::Client,
    subscriber: async_nats::Subscriber,
    prefix: String,
    rx: mpsc::Receiver<BusHint>,
    ephemeral_rx: mpsc::Receiver<BusHint>,
}

fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix
            .split('.')
            .all(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-')))
}

/// The subject token for a user: the id itself when it is one token (user
/// ids may contain `.`, which separates tokens), else `x` and its hex.
pub fn user_token(user: &str) -> String {
    if !user.is_empty() && user.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '@')) {
        user.to_owned()
    } else {
        let mut token = String::with_capacity(1 + 2 * user.len());
        token.push('x');
        for b in user.bytes() {
            token.push_str(&format!("{b:02x}"));
        }
        token
    }
}

/// The subject of a hint: `<prefix>.<user token>` for a user, and
/// `<prefix>._conv.<token>` (two tokens, so never a user's) for a group.
fn subject_of(prefix: &str, hint: &BusHint) -> String {
    match &hint.conv {
        Some(c) => format!("{prefix}._conv.{}", user_token(&c.conv)),
        None => format!("{prefix}.{}", user_token(&hint.user)),
    }
}

fn encode(hint: &BusHint) -> Vec<u8> {
    serde_json::to_vec(hint).expect("a bus hint serializes")
}

fn decode(payload: &[u8]) -> Option<BusHint> {
    if payload.len() > crate::ephemeral::BUS_EPHEMERAL_PAYLOAD_BYTES_MAX {
        return None;
    }
    let hint: BusHint = serde_json::from_slice(payload).ok()?;
    // Only the ephemeral lane's payloads (issue 18) may exceed a hint's size.
    match &hint.ephemeral {
        Some(eph) if eph.to.len() > crate::ephemeral::BUS_RECIPIENTS_MAX => return None,
        None if payload.len() > HINT_PAYLOAD_BYTES_MAX => return None,
        _ => {}
    }
    if let Some(c) = &hint.conv {
        // A large group's marker names no user.
        if c.conv.is_empty() || c.conv.len() > tidemark_proto::ID_BYTES_MAX || hint.kick.is_some() {
            return None;
        }
        return Some(hint);
    }
    tidemark_core::ids::check_user(&hint.user).ok()?;
    if let Some(kick) = &hint.kick {
        // An end of every session of the user names no device.
        let whole_user = matches!(kick.reason.as_str(), reason::LOGGED_OUT | reason::ACCOUNT_DEACTIVATED);
        if !(whole_user && kick.device.is_empty()) {
            tidemark_core::ids::check_device_id(&kick.device).ok()?;
        }
    }
    Some(hint)
}

/// Builds the bus for `config`: the local bus, or a NATS connection with its
/// subscription in place (flushed, so hints published after this returns
/// reach this node).
pub async fn connect(config: &HintBusConfig) -> Result<(HintBus, Option<Pending>), BusError> {
    let HintBusConfig::Nats { url, subject_prefix } = config else {
        return Ok((HintBus::default(), None));
    };
    if !valid_prefix(subject_prefix) {
        return Err(BusError::Prefix(subject_prefix.clone()));
    }
    let connect_err = |reason: String| BusError::Connect { url: url.clone(), reason };
    let options = async_nats::ConnectOptions::new().no_echo().name("tidemark").connection_timeout(NATS_CONNECT_TIMEOUT);
    let client = tokio::time::timeout(NATS_CONNECT_TIMEOUT, options.connect(url.as_str()))
        .await
        .map_err(|_| connect_err("timed out".into()))?
        .map_err(|e| connect_err(e.to_string()))?;
    let subject = format!("{subject_prefix}.>");
    let subscribe_err = |reason: String| BusError::Subscribe { subject: subject.clone(), reason };
    let subscriber = client.subscribe(subject.clone()).await.map_err(|e| subscribe_err(e.to_string()))?;
    tokio::time::timeout(NATS_CONNECT_TIMEOUT, client.flush())
        .await
        .map_err(|_| subscribe_err("flush timed out".into()))?
        .map_err(|e| subscribe_err(e.to_string()))?;
    let (tx, rx) = mpsc::channel(HINT_PUBLISH_QUEUE_MAX);
    let (ephemeral, ephemeral_rx) = mpsc::channel(crate::ephemeral::BUS_EPHEMERAL_QUEUE_MAX);
    tracing::info!(%url, prefix = %subject_prefix, "hint bus on NATS");
    let pending = Pending { client, subscriber, prefix: subject_prefix.clone(), rx, ephemeral_rx };
    Ok((HintBus { tx: Some(tx), ephemeral: Some(ephemeral) }, Some(pending)))
}

impl Pending {
    /// The NATS connection and subject prefix the routing of sends shares
    /// (`route`).
    pub fn route_bus(&self) -> (async_nats::Client, &str) {
        (self.client.clone(), &self.prefix)
    }

    /// Starts the publishers (hints, ephemeral signals) and the
    /// subscriber; all stop on `shutdown`.
    pub fn spawn(self, to: Receivers, shutdown: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
        let Pending { client, subscriber, prefix, rx, ephemeral_rx } = self;
        let ephemeral =
            tokio::spawn(publish_ephemeral_loop(client.clone(), prefix.clone(), ephemeral_rx, shutdown.clone()));
        let publisher = tokio::spawn(publish_loop(client, prefix, rx, shutdown.clone()));
        let listener = tokio::spawn(subscribe_loop(subscriber, to, shutdown));
        vec![publisher, ephemeral, listener]
    }
}

async fn publish_loop(
    client: async_nats::Client,
    prefix: String,
    mut rx: mpsc::Receiver<BusHint>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let hint = tokio::select! {
            next = rx.recv() => match next {
                Some(hint) => hint,
                None => return,
            },
            _ = crate::util::stopped(&mut shutdown) => return,
        };
        let subject = subject_of(&prefix, &hint);
        // The client buffers while reconnecting; an error here is a hint
        // lost, which the re-hint sweep and client syncs cover.
        match client.publish(subject.clone(), encode(&hint).into()).await {
            Ok(()) => m::HINTS_BUS_PUBLISHED.add(1),
            Err(e) => {
                m::HINTS_BUS_DROPPED.inc();
                tracing::debug!(%subject, error = %e, "hint not published");
            }
        }
    }
}

/// Publishes the ephemeral lane's payloads; an error loses one signal.
async fn publish_ephemeral_loop(
    client: async_nats::Client,
    prefix: String,
    mut rx: mpsc::Receiver<BusHint>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let hint = tokio::select! {
            next = rx.recv() => match next {
                Some(hint) => hint,
                None => return,
            },
            _ = crate::util::stopped(&mut shutdown) => return,
        };
        let subject = format!("{prefix}.{}", user_token(&hint.user));
        let payload = serde_json::to_vec(&hint).expect("a bus payload serializes");
        match client.publish(subject, payload.into()).await {
            Ok(()) => m::EPHEMERAL_BUS_PUBLISHED.add(1),
            Err(e) => {
                m::EPHEMERAL_DROPPED.add_by("reason", "bus_queue_full", 1);
                tracing::debug!(error = %e, "ephemeral signal not published");
            }
        }
    }
}

async fn subscribe_loop(mut subscriber: async_nats::Subscriber, to: Receivers, mut shutdown: watch::Receiver<bool>) {
    let Receivers { hub, fences, groups, lane } = to;
    loop {
        let message = tokio::select! {
            next = subscriber.next() => match next {
                Some(message) => message,
                None => {
                    tracing::warn!("hint bus subscription ended; cross-node hints stop until restart");
                    return;
                }
            },
            _ = crate::util::stopped(&mut shutdown) => {
                let _ = subscriber.unsubscribe().await;
                return;
            }
        };
        match decode(&message.payload) {
            Some(BusHint { user, ephemeral: Some(eph), .. }) => lane.from_bus(user, eph),
            Some(BusHint { conv: Some(c), .. }) => {
                m::HINTS_BUS_RECEIVED.inc();
                let moved =
                    ConvMoved { conv: c.conv, target: c.target, version: c.version, members_seq: c.members_seq };
                groups.deliver(&moved).await;
            }
            Some(BusHint { user, kick: Some(kick), .. }) => fences.apply(&user, &kick),
            Some(BusHint { user, high_watermark, kick: None, .. }) => {
                m::HINTS_BUS_RECEIVED.inc();
                hub.notify_user(&user, high_watermark);
            }
            None => tracing::warn!(subject = %message.subject, "malformed hint on the bus ignored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_bad_ones_are_refused() {
        for (user, hw) in [("bob", 7), ("a.b@c", u64::MAX)] {
            let hint = BusHint { user: user.to_owned(), high_watermark: hw, conv: None, kick: None, ephemeral: None };
            assert_eq!(decode(&encode(&hint)), Some(hint));
        }
        let kick = BusKick { device: "phone".into(), reason: "superseded".into(), connection_epoch: 3, ended_at_ms: 0 };
        let hint = BusHint { user: "bob".into(), high_watermark: 0, conv: None, kick: Some(kick), ephemeral: None };
        assert_eq!(decode(&encode(&hint)), Some(hint));
        // A large group's marker (G2): no user, its own subject.
        let hint = BusHint {
            user: String::new(),
            high_watermark: 0,
            conv: Some(BusConv { conv: "g1".into(), target: 9, version: 4, members_seq: 3 }),
            kick: None,
            ephemeral: None,
        };
        assert_eq!(decode(&encode(&hint)), Some(hint.clone()));
        assert_eq!(subject_of("p", &hint), "p._conv.g1");
        let bus = HintBus::default();
        bus.publish_conv(&ConvMoved { conv: "g1".into(), target: 9, version: 4, members_seq: 3 });
        assert_eq!(
            decode(br#"{"user":"bob","high_watermark":0,"kick":{"device":"","reason":"superseded"}}"#),
            None,
            "a kick names a valid device"
        );
        assert_eq!(decode(b"{\"user\":\"bob\"}"), None);
        assert_eq!(decode(b"{\"user\":\"b b\",\"high_watermark\":1}"), None);
        assert_eq!(decode(b"not json"), None);
        let eph = r#"{"user":"ann","high_watermark":0,"ephemeral":{"to":["ben"],"answer":true}}"#;
        let probe = tidemark_proto::BusEphemeral { to: vec!["ben".into()], frame: None, answer: true };
        assert_eq!(decode(eph.as_bytes()).and_then(|h| h.ephemeral), Some(probe), "an ephemeral payload is not a hint");
    }

    #[test]
    fn user_tokens_are_one_subject_token() {
        assert_eq!(user_token("bob-1@x"), "bob-1@x");
        assert_eq!(user_token("a.b"), "x612e62");
        assert!(valid_prefix("tidemark.hint") && valid_prefix("t_1.hint"));
        assert!(!valid_prefix("") && !valid_prefix("a..b") && !valid_prefix("a.>") && !valid_prefix("a b"));
    }

    #[test]
    fn session_ends_round_trip_with_or_without_a_device() {
        let ends = [
            ("phone", reason::LOGGED_OUT, 1_700_000_000_000),
            ("", reason::LOGGED_OUT, 1_700_000_000_000),
            ("", reason::ACCOUNT_DEACTIVATED, 0),
        ];
        for (device, why, ended_at_ms) in ends {
            let kick = BusKick { device: device.into(), reason: why.into(), connection_epoch: 0, ended_at_ms };
            let hint = BusHint { user: "bob".into(), high_watermark: 0, conv: None, kick: Some(kick), ephemeral: None };
            assert_eq!(decode(&encode(&hint)), Some(hint), "{why} {device:?}");
        }
        // Only a whole-user end may name no device.
        let kick =
            BusKick { device: String::new(), reason: reason::SUPERSEDED.into(), connection_epoch: 2, ended_at_ms: 0 };
        let hint = BusHint { user: "bob".into(), high_watermark: 0, conv: None, kick: Some(kick), ephemeral: None };
        assert_eq!(decode(&encode(&hint)), None);
    }
}
