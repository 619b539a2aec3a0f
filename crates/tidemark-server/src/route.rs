//! Cross-node routing of sends (issue 14, seed 000 §4.2 "fixed routing to
//! one writer per conversation"): in cluster mode each conversation has
//! one owner among the live nodes (`tidemark_core::route`: its partition,
//! then rendezvous hashing over the live set), and a node that receives a
//! send for a conversation it does not own forwards it to the owner over
//! the NATS connection of the hint bus (request/reply on the owner's
//! subject) and relays the owner's answer. So one node's writer batches
//! carry a conversation's sends, and nodes stop queueing on (and, before
//! the writer's lock order, deadlocking over) the same conversation rows.
//!
//! Routing is for throughput only. When the owner does not answer within
//! [`FORWARD_TIMEOUT`], has no subscriber (killed: NATS answers "no
//! responders" at once), is too busy ([`FORWARD_SERVE_MAX`]), or this node
//! has [`FORWARD_IN_FLIGHT_MAX`] forwards waiting, this node writes the
//! send itself. Correctness holds either way: the row lock keeps `msg_seq`
//! contiguous whoever writes, and the command keeps its ids, so a local
//! write after a lost answer finds the owner's message by `(sender,
//! client_msg_id)` (S1) and answers it as a duplicate.
//!
//! **Liveness.** Nodes learn each other from heartbeats on the bus
//! ([`BusNode`], every [`NODE_HEARTBEAT_EVERY`]); a node is live while it
//! was heard within [`NODE_LIVE_FOR`]. The bus rather than a heartbeat row
//! in PostgreSQL: a forward needs the bus anyway, so a node the bus cannot
//! reach is exactly one not to route to, and the database, which is the
//! cluster's bottleneck, pays nothing for it. Two nodes may disagree on the
//! live set for up to `NODE_LIVE_FOR` (a node joining, leaving or killed);
//! each then routes by its own view, and a forwarded send is always
//! written by the node that receives it (never forwarded again), so there
//! is no loop. A node alone, or without the bus, writes everything itself.
//!
//! Only sends are routed: they are the hot path. Other conversation events
//! (recall, edit, react, membership) are rare and stay where they arrive.
//! The forwarding node has checked the request's fences (revocation, ended
//! sessions) and its limits before it forwards, as for a local send; the
//! owner checks revocation again before it writes.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tidemark_proto::{BusNode, BusRefusal, BusSend, BusSendReply, SendOk, CONTENT_BYTES_MAX, ID_BYTES_MAX};
use tidemark_store::SendCmd;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::error::ApiError;
use crate::metrics as m;
use crate::state::AppState;

/// How often a node announces itself on the bus.
pub const NODE_HEARTBEAT_EVERY: Duration = Duration::from_millis(500);
/// How long a node counts as live after its last heartbeat: three
/// heartbeats, so one lost message does not move its partitions. Also the
/// longest two nodes' views of the live set differ.
pub const NODE_LIVE_FOR: Duration = Duration::from_millis(1_500);
/// Longest wait for the owner's answer before this node writes the send
/// itself.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(1);
/// Most forwards of this node waiting for an answer at once; beyond, sends
/// are written here.
pub const FORWARD_IN_FLIGHT_MAX: usize = 1_024;
/// Most forwarded sends a node writes for other nodes at once; beyond, it
/// answers "not taken" and the forwarding node writes the send.
pub const FORWARD_SERVE_MAX: usize = 1_024;
/// Largest forwarded send accepted from the bus, in bytes: a content at
/// its bound plus the ids, escaped.
pub const FORWARD_PAYLOAD_BYTES_MAX: usize = 2 * CONTENT_BYTES_MAX + 4_096;
/// Largest heartbeat accepted from the bus, in bytes.
const HEARTBEAT_BYTES_MAX: usize = 256;

/// The `reason` label values of `tidemark_route_forward_fallbacks_total`.
pub mod fallback {
    /// The owner did not answer within [`super::FORWARD_TIMEOUT`].
    pub const TIMEOUT: &str = "timeout";
    /// Nobody listens on the owner's subject (it stopped or was killed).
    pub const NO_RESPONDERS: &str = "no_responders";
    /// The request could not be sent, or the answer was unreadable.
    pub const BUS_ERROR: &str = "bus_error";
    /// [`super::FORWARD_IN_FLIGHT_MAX`] forwards were waiting here.
    pub const BUSY: &str = "busy";
    /// The owner did not take it ([`super::FORWARD_SERVE_MAX`]).
    pub const NOT_TAKEN: &str = "not_taken";
    pub const ALL: &[&str] = &[TIMEOUT, NO_RESPONDERS, BUS_ERROR, BUSY, NOT_TAKEN];
}

/// This node's routing: its id, and in cluster mode the bus and the nodes
/// it heard.
pub struct Router {
    me: String,
    bus: Option<RouteBus>,
}

struct RouteBus {
    client: async_nats::Client,
    /// `<hint prefix>_route`: a sibling of the hint subjects, so the hint
    /// subscription (`<hint prefix>.>`) never sees routing traffic.
    prefix: String,
    /// Other nodes and when each was last heard.
    heard: Mutex<HashMap<String, Instant>>,
    in_flight: Semaphore,
}

/// What [`Router::forward_send`] did.
pub enum Forwarded {
    /// The owner answered; relay this.
    Answer(Result<SendOk, ApiError>),
    /// Write here: this node owns the conversation, no owner is known, or
    /// the forward fell back (counted).
    Local,
}

impl Router {
    /// A single node's router: everything is written here.
    pub fn local() -> Router {
        Router { me: crate::util::new_id("n"), bus: None }
    }

    /// A cluster node's router on the hint bus's NATS connection and
    /// subject prefix. Nothing is routed until [`Router::start`] runs.
    pub fn on_bus(client: async_nats::Client, hint_prefix: &str) -> Router {
        let bus = RouteBus {
            client,
            prefix: format!("{hint_prefix}_route"),
            heard: Mutex::new(HashMap::new()),
            in_flight: Semaphore::new(FORWARD_IN_FLIGHT_MAX),
        };
        Router { me: crate::util::new_id("n"), bus: Some(bus) }
    }

    /// This node's id on the bus (a fresh one per process).
    pub fn node_id(&self) -> &str {
        &self.me
    }

    /// The live nodes this node knows, itself included, sorted.
    pub fn live_nodes(&self) -> Vec<String> {
        let mut nodes = vec![self.me.clone()];
        if let Some(bus) = &self.bus {
            let heard = bus.heard.lock().expect("route table lock");
            nodes.extend(heard.iter().filter(|(_, at)| at.elapsed() < NODE_LIVE_FOR).map(|(n, _)| n.clone()));
        }
        nodes.sort();
        nodes
    }

    /// The owner `conv` is forwarded to from here, if not this node.
    pub fn owner_of(&self, conv: &str) -> Option<String> {
        self.bus.as_ref()?;
        let nodes = self.live_nodes();
        let refs: Vec<&str> = nodes.iter().map(String::as_str).collect();
        match tidemark_core::route::route(conv, &self.me, &refs) {
            tidemark_core::route::Route::Forward(owner) => Some(owner.to_owned()),
            tidemark_core::route::Route::Local => None,
        }
    }

    /// Forwards `cmd` to its conversation's owner, if another node owns
    /// it, and returns the owner's answer; [`Forwarded::Local`] when this
    /// node should write it. The request is queued on the NATS connection
    /// on the first poll (so a connection's sends keep their order per
    /// conversation, as in the writer queue).
    pub async fn forward_send(&self, cmd: &SendCmd) -> Forwarded {
        let Some(bus) = &self.bus else { return Forwarded::Local };
        let Some(owner) = self.owner_of(&cmd.conv) else { return Forwarded::Local };
        let Ok(_permit) = bus.in_flight.try_acquire() else { return fell_back(fallback::BUSY) };
        let payload = serde_json::to_vec(&bus_send(cmd)).expect("a forwarded send serializes");
        let subject = format!("{}.fwd.{owner}", bus.prefix);
        let answer = match tokio::time::timeout(FORWARD_TIMEOUT, bus.client.request(subject, payload.into())).await {
            Err(_) => return fell_back(fallback::TIMEOUT),
            Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                return fell_back(fallback::NO_RESPONDERS)
            }
            Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::TimedOut => return fell_back(fallback::TIMEOUT),
            Ok(Err(_)) => return fell_back(fallback::BUS_ERROR),
            Ok(Ok(message)) => message,
        };
        match serde_json::from_slice::<BusSendReply>(&answer.payload) {
            Ok(BusSendReply { ok: Some(ok), .. }) => {
                m::ROUTE_FORWARDED.inc();
                Forwarded::Answer(Ok(ok))
            }
            Ok(BusSendReply { error: Some(e), .. }) => {
                m::ROUTE_FORWARDED.inc();
                let mut refusal = ApiError::new(e.code, e.message);
                refusal.retry_after_ms = e.retry_after_ms;
                Forwarded::Answer(Err(refusal))
            }
            Ok(BusSendReply { ok: None, error: None }) => fell_back(fallback::NOT_TAKEN),
            Err(_) => fell_back(fallback::BUS_ERROR),
        }
    }

    /// Subscribes to this node's forward subject and to the heartbeats,
    /// then starts announcing this node; all stop on `shutdown`. Nothing
    /// to do on a single node.
    pub async fn start(
        state: Arc<AppState>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Vec<JoinHandle<()>>, async_nats::SubscribeError> {
        let Some(bus) = &state.router.bus else { return Ok(Vec::new()) };
        let me = state.router.me.clone();
        let forwards = bus.client.subscribe(format!("{}.fwd.{me}", bus.prefix)).await?;
        let beats = bus.client.subscribe(format!("{}.node.*", bus.prefix)).await?;
        // Subscribed before this node is announced: once another node
        // hears it, forwards to it find a listener.
        let _ = tokio::time::timeout(crate::bus::NATS_CONNECT_TIMEOUT, bus.client.flush()).await;
        tracing::info!(node = %me, "routing sends by conversation owner");
        Ok(vec![
            tokio::spawn(serve_forwards(state.clone(), forwards, shutdown.clone())),
            tokio::spawn(hear_nodes(state.clone(), beats, shutdown.clone())),
            tokio::spawn(announce(state, shutdown)),
        ])
    }
}

fn fell_back(reason: &'static str) -> Forwarded {
    m::ROUTE_FALLBACKS.add_by("reason", reason, 1);
    Forwarded::Local
}

fn bus_send(cmd: &SendCmd) -> BusSend {
    BusSend {
        sender: cmd.sender.clone(),
        sender_device: cmd.sender_device.clone(),
        conv: cmd.conv.clone(),
        client_msg_id: cmd.client_msg_id.clone(),
        kind: cmd.kind.clone(),
        content: cmd.content.clone(),
        message_id: cmd.message_id.clone(),
        quote_id: cmd.quote_id.clone(),
        mentions: cmd.mentions.clone(),
        mention_all: cmd.mention_all,
        now_ms: cmd.now_ms,
        connection_epoch: cmd.connection_epoch,
    }
}

/// The command of a forwarded send, within the bounds the forwarding node
/// checked (a peer is trusted to have validated it, not to be bug-free).
fn send_cmd(s: BusSend) -> Option<SendCmd> {
    use tidemark_core::ids;
    let id_ok = |id: &str| !id.is_empty() && id.len() <= ID_BYTES_MAX;
    let sound = id_ok(&s.conv)
        && id_ok(&s.message_id)
        && s.quote_id.as_deref().is_none_or(id_ok)
        && ids::check_user(&s.sender).is_ok()
        && ids::check_device_id(&s.sender_device).is_ok()
        && ids::check_client_msg_id(&s.client_msg_id).is_ok()
        && ids::check_kind(&s.kind).is_ok()
        && s.content.len() <= CONTENT_BYTES_MAX
        && s.mentions.len() <= tidemark_core::mention::MENTIONS_MAX;
    sound.then_some(SendCmd {
        sender: s.sender,
        sender_device: s.sender_device,
        conv: s.conv,
        client_msg_id: s.client_msg_id,
        kind: s.kind,
        content: s.content,
        message_id: s.message_id,
        quote_id: s.quote_id,
        mentions: s.mentions,
        mention_all: s.mention_all,
        now_ms: s.now_ms,
        connection_epoch: s.connection_epoch,
    })
}

/// Writes the sends other nodes forward here and answers each on its
/// reply subject. Each request is polled once before it is spawned, so
/// forwarded sends enter the writer queue in the order they arrived.
async fn serve_forwards(state: Arc<AppState>, mut sub: async_nats::Subscriber, mut shutdown: watch::Receiver<bool>) {
    let Some(bus) = &state.router.bus else { return };
    let serving = Arc::new(Semaphore::new(FORWARD_SERVE_MAX));
    loop {
        let message = tokio::select! {
            next = sub.next() => match next {
                Some(message) => message,
                None => {
                    tracing::warn!("forward subscription ended; this node's conversations are written where sends arrive");
                    return;
                }
            },
            _ = crate::util::stopped(&mut shutdown) => {
                let _ = sub.unsubscribe().await;
                return;
            }
        };
        let Some(reply) = message.reply.clone() else { continue };
        let cmd = (message.payload.len() <= FORWARD_PAYLOAD_BYTES_MAX)
            .then(|| serde_json::from_slice::<BusSend>(&message.payload).ok())
            .flatten()
            .and_then(send_cmd);
        let client = bus.client.clone();
        let (Some(cmd), Ok(permit)) = (cmd, serving.clone().try_acquire_owned()) else {
            // Malformed, or too many at once: "not taken", written there.
            answer(&client, reply, &BusSendReply { ok: None, error: None }).await;
            continue;
        };
        let state = state.clone();
        let mut work = Box::pin(async move {
            let result = if state.is_revoked(&cmd.sender, &cmd.sender_device) {
                Err(ApiError::device_revoked())
            } else {
                crate::ops::send::write(&state, cmd).await
            };
            m::ROUTE_SERVED.inc();
            drop(permit);
            let answer_of = match result {
                Ok(ok) => BusSendReply { ok: Some(ok), error: None },
                Err(e) => BusSendReply {
                    ok: None,
                    error: Some(BusRefusal { code: e.code, message: e.message, retry_after_ms: e.retry_after_ms }),
                },
            };
            answer(&client, reply, &answer_of).await;
        });
        // The first poll queues the write in the store's writer.
        if std::future::poll_fn(|cx| std::task::Poll::Ready(work.as_mut().poll(cx))).await.is_pending() {
            tokio::spawn(work);
        }
    }
}

/// Publishes a forward's answer on its reply subject. A lost answer makes
/// the forwarding node write the send itself, which finds this one by its
/// key.
async fn answer(client: &async_nats::Client, reply: async_nats::Subject, a: &BusSendReply) {
    let payload = serde_json::to_vec(a).expect("a forward answer serializes");
    let _ = client.publish(reply, payload.into()).await;
}

/// Records the heartbeats of the other nodes.
async fn hear_nodes(state: Arc<AppState>, mut sub: async_nats::Subscriber, mut shutdown: watch::Receiver<bool>) {
    let Some(bus) = &state.router.bus else { return };
    loop {
        let message = tokio::select! {
            next = sub.next() => match next {
                Some(message) => message,
                None => return,
            },
            _ = crate::util::stopped(&mut shutdown) => return,
        };
        if message.payload.len() > HEARTBEAT_BYTES_MAX {
            continue;
        }
        let Ok(BusNode { node }) = serde_json::from_slice::<BusNode>(&message.payload) else { continue };
        if node == state.router.me || node.is_empty() || !node.chars().all(|c| c.is_ascii_alphanumeric()) {
            continue;
        }
        let mut heard = bus.heard.lock().expect("route table lock");
        heard.insert(node, Instant::now());
        // Forget nodes long gone, so the table follows the cluster.
        heard.retain(|_, at| at.elapsed() < 10 * NODE_LIVE_FOR);
    }
}

/// Announces this node every [`NODE_HEARTBEAT_EVERY`], and samples the
/// live set it knows (`tidemark_route_nodes`).
async fn announce(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    let Some(bus) = &state.router.bus else { return };
    let me = state.router.me.clone();
    let subject = format!("{}.node.{me}", bus.prefix);
    let payload = serde_json::to_vec(&BusNode { node: me }).expect("a heartbeat serializes");
    loop {
        // A lost heartbeat is covered by the next ones (NODE_LIVE_FOR).
        let _ = bus.client.publish(subject.clone(), payload.clone().into()).await;
        m::ROUTE_NODES.set(state.router.live_nodes().len() as f64);
        tokio::select! {
            _ = tokio::time::sleep(NODE_HEARTBEAT_EVERY) => {}
            _ = crate::util::stopped(&mut shutdown) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd() -> SendCmd {
        SendCmd {
            sender: "ann".into(),
            sender_device: "phone".into(),
            conv: "c1".into(),
            client_msg_id: "k1".into(),
            kind: "text".into(),
            content: r#"{"text":"hi"}"#.into(),
            message_id: "m1".into(),
            quote_id: Some("m0".into()),
            mentions: vec!["ben".into()],
            mention_all: false,
            now_ms: 7,
            connection_epoch: Some(3),
        }
    }

    #[test]
    fn a_forwarded_send_is_the_same_command_and_bad_ones_are_not_taken() {
        let text = serde_json::to_vec(&bus_send(&cmd())).unwrap();
        let back = send_cmd(serde_json::from_slice(&text).unwrap()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{:?}", cmd()), "ids and time cross unchanged");
        for spoil in [
            |s: &mut BusSend| s.conv.clear(),
            |s: &mut BusSend| s.sender = "a b".into(),
            |s: &mut BusSend| s.client_msg_id.clear(),
            |s: &mut BusSend| s.content = "x".repeat(CONTENT_BYTES_MAX + 1),
            |s: &mut BusSend| s.quote_id = Some(String::new()),
        ] {
            let mut s = bus_send(&cmd());
            spoil(&mut s);
            assert!(send_cmd(s).is_none());
        }
    }

    #[test]
    fn a_single_node_writes_everything_itself() {
        let router = Router::local();
        assert_eq!(router.live_nodes(), vec![router.node_id().to_owned()]);
        assert_eq!(router.owner_of("c1"), None);
    }
}
