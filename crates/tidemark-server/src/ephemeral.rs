//! The ephemeral lane (issue 18): typing and presence, delivered to the
//! connections allowed to see them and never written to any sync log.
//!
//! What is decided (who sees what, when a change is worth a frame, when
//! typing expires) is `tidemark_core::ephemeral`; this module keeps the
//! live state of one node and delivers:
//!
//! - **Per receiver, bounded and coalesced.** Every connection has slots,
//!   one per `(conversation, typer)` for typing and one per user for
//!   presence. A new frame replaces the one waiting in its slot; a frame
//!   for a new key when the connection already holds
//!   [`EphemeralConfig::typing_slots_max`] (or `presence_slots_max`) waiting
//!   frames is dropped. Nothing queues without bound, and ephemeral frames
//!   never count toward the reply queue or its slow-consumer kick.
//! - **Shed first.** The connection's writer sends waiting ephemeral frames
//!   only when its reply queue is empty, after replies and hints: while
//!   replies wait, ephemeral frames wait too and coalesce in their slots;
//!   a typing start whose timeout passed while it waited is dropped.
//! - **Typing** is forwarded to the other current members of the
//!   conversation (a store read per forwarded request, rate-limited per
//!   device by [`crate::limits`]); renewals coalesce
//!   (`core::ephemeral::typing_step`), and the node that took the start
//!   sends the stop itself when the timeout passes without a renewal
//!   ([`Lane::sweep`]), bounded by [`EphemeralConfig::typing_held_max`].
//! - **Presence** is per connection (`online` on connect, `online`/`idle`
//!   by `presence.set`, gone on close); what others see is the most present
//!   connection of the user on this node, `offline` for a hidden user. A
//!   frame goes out only when that changes (heartbeats say nothing),
//!   to the users sharing an open conversation (the audience, read from the
//!   store for each announcement, which coalescing makes rare, so a
//!   conversation created since the user connected counts; a read that
//!   fails for a moment, as when a resume storm exhausts PostgreSQL's read
//!   pool, is made again a few times, `core::ephemeral::presence_read_retry`,
//!   while the connection or the close it announces still stands). Every new
//!   connection also asks
//!   its audience for their presence: each receiver that is online or idle,
//!   and not hidden, answers with one presence frame to the new user.
//! - **Across nodes** every signal is published once on the hint bus
//!   ([`tidemark_proto::BusHint`] with its `ephemeral` field), its
//!   recipients in chunks of [`BUS_RECIPIENTS_MAX`]; each node delivers to
//!   its own connections of the recipients. A node that hears that a user
//!   went `offline` while it still holds a connection of that user announces
//!   the user's presence again, so a user connected to two nodes does not
//!   stay shown offline when one of them closes; between nodes otherwise the
//!   last announcement wins. The store read such an announcement sets off
//!   (the user's privacy, again) runs on a task of its own, never on the
//!   bus subscriber, so what follows on the bus (kicks included) does not
//!   wait on the store.
//! - **Serialised once.** A signal's frame is serialised once into an
//!   [`Outgoing`] (the frame and its JSON text, shared bytes) that every
//!   receiving connection's slot holds by reference; a user's own presence
//!   frame, which each new connection of its audience is answered with, is
//!   kept until what it says changes. The connection's writer drains what
//!   waits and flushes once (`gateway::ws`).
//! - **Batched for connections that opt in** (`presence_batch`, issue 19):
//!   such a connection's waiting presence entries go out as one
//!   `presence.batch` frame per wake of its writer (split only by the
//!   frame bounds, `core::ephemeral::presence_batches`), spliced from each
//!   entry's text serialised once; the answers of a new connection's
//!   audience are put in its slots under one lock, bounded by the audience
//!   rather than [`EphemeralConfig::presence_slots_max`], so they leave in
//!   one frame. Other connections get one `presence` frame per entry, as
//!   before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::ws::Utf8Bytes;
use tidemark_core::ephemeral::{self as rules, Presence, Typing};
use tidemark_proto::{
    presence_batch_text, presence_fields, server_frame, BusEphemeral, BusHint, PresenceFrame, ServerFrame, TypingFrame,
    FRAME_BYTES_MAX, PRESENCE_BATCH_ENTRY_OVERHEAD, PRESENCE_BATCH_FRAME_OVERHEAD,
};
use tidemark_store::Store;
use tokio::sync::{mpsc, watch, Notify};

use crate::error::{ApiError, ApiResult};
use crate::metrics as m;

/// Recipients named by one bus payload; a longer list is split.
pub const BUS_RECIPIENTS_MAX: usize = 256;
/// Largest ephemeral bus payload accepted, in bytes (a full chunk of
/// recipients of the longest user names, and the frame).
pub const BUS_EPHEMERAL_PAYLOAD_BYTES_MAX: usize = 32 * 1024;
/// Ephemeral payloads waiting for the bus publisher; beyond, dropped.
pub const BUS_EPHEMERAL_QUEUE_MAX: usize = 4096;

/// The bounds of the lane; every one has a name.
#[derive(Debug, Clone)]
pub struct EphemeralConfig {
    /// The longest typing held without a renewal (server-side bound).
    pub typing_timeout_max: Duration,
    /// How often expired typing is looked for (and stopped).
    pub typing_sweep_every: Duration,
    /// Typing signals this node holds for their expiry at once; past it a
    /// start is still forwarded but not stopped by the server (receivers
    /// stop showing it after its `timeout_ms` anyway).
    pub typing_held_max: usize,
    /// Waiting typing frames per connection (distinct conversation, typer).
    pub typing_slots_max: usize,
    /// Waiting presence frames per connection (distinct users).
    pub presence_slots_max: usize,
    /// Users one presence change reaches at most.
    pub audience_max: u32,
}

impl Default for EphemeralConfig {
    fn default() -> Self {
        EphemeralConfig {
            typing_timeout_max: Duration::from_millis(rules::TYPING_TIMEOUT_MAX_MS),
            typing_sweep_every: Duration::from_millis(250),
            typing_held_max: 100_000,
            typing_slots_max: 64,
            presence_slots_max: 512,
            audience_max: rules::PRESENCE_AUDIENCE_MAX,
        }
    }
}

/// An ephemeral frame serialised once for every connection it reaches:
/// the frame (its slot key, the bus payload) and its JSON text, whose bytes
/// every receiver's writer sends without copying (a `presence.batch`
/// splices a presence frame's fields from them, `proto::presence_fields`).
#[derive(Debug, PartialEq)]
pub struct Outgoing {
    pub frame: ServerFrame,
    pub text: Utf8Bytes,
}

impl Outgoing {
    pub fn new(frame: ServerFrame) -> Arc<Outgoing> {
        let text = serde_json::to_string(&frame).expect("server frames serialize").into();
        Arc::new(Outgoing { frame, text })
    }

    /// The metric label of the frame's kind.
    pub fn kind(&self) -> &'static str {
        if matches!(self.frame, ServerFrame::Typing(_)) {
            "typing"
        } else {
            "presence"
        }
    }
}

/// A frame waiting in a connection's slot.
#[derive(Debug, Clone)]
struct Waiting {
    frame: Arc<Outgoing>,
    /// A typing start stops mattering at this time (`None`: never).
    stale_at_ms: Option<i64>,
}

#[derive(Debug, Default)]
struct Slots {
    typing: HashMap<(String, String), Waiting>,
    presence: HashMap<String, Waiting>,
}

impl Slots {
    /// Puts a presence frame in its user's slot (replacing what waits
    /// there); `false` when it is a new user and `max` slots are taken.
    fn put_presence(&mut self, user: String, waiting: Waiting, max: usize) -> bool {
        if self.presence.len() >= max && !self.presence.contains_key(&user) {
            return false;
        }
        self.presence.insert(user, waiting);
        true
    }
}

/// A frame as a connection's writer sends it: its text, the `kind` label
/// of `tidemark_ephemeral_frames_sent_total`, and the presence entries it
/// carries inside a `presence.batch` (0 otherwise).
#[derive(Debug)]
pub struct Written {
    pub kind: &'static str,
    pub text: Utf8Bytes,
    pub batched: usize,
}

/// One connection as the lane sees it.
#[derive(Debug)]
pub struct EphConn {
    pub user: String,
    pub device: String,
    pub epoch: u64,
    /// The connection takes `presence.batch` frames (it opted in).
    pub batch: bool,
    presence: Mutex<Presence>,
    slots: Mutex<Slots>,
    /// Woken when a frame waits.
    pub wake: Notify,
}

impl EphConn {
    /// Puts `frame` in its slot (replacing what waits there); `false` when
    /// it was dropped because the slots are full.
    fn offer(&self, frame: Arc<Outgoing>, stale_at_ms: Option<i64>, config: &EphemeralConfig) -> bool {
        let mut slots = self.slots.lock().expect("slots lock");
        let waiting = Waiting { frame, stale_at_ms };
        let stored = match &waiting.frame.frame {
            ServerFrame::Typing(t) => {
                let key = (t.conv.clone(), t.user.clone());
                if slots.typing.len() >= config.typing_slots_max && !slots.typing.contains_key(&key) {
                    false
                } else {
                    slots.typing.insert(key, waiting);
                    true
                }
            }
            ServerFrame::Presence(p) => {
                let user = p.user.clone();
                slots.put_presence(user, waiting, config.presence_slots_max)
            }
            ServerFrame::Hint(_) | ServerFrame::Kicked(_) | ServerFrame::PresenceBatch(_) => false,
        };
        drop(slots);
        if stored {
            self.wake.notify_one();
        } else {
            m::EPHEMERAL_DROPPED.add_by("reason", "slots_full", 1);
        }
        stored
    }

    /// The answers of a new connection's audience (presence frames), put
    /// in their slots under one lock so the writer takes them in one wake.
    /// A connection that takes `presence.batch` holds up to the audience
    /// bound for them (they leave in one frame); others keep
    /// [`EphemeralConfig::presence_slots_max`].
    fn offer_answers(&self, frames: &[Arc<Outgoing>], config: &EphemeralConfig) {
        let max = if self.batch {
            config.presence_slots_max.max(config.audience_max as usize)
        } else {
            config.presence_slots_max
        };
        let (mut stored, mut dropped) = (0u64, 0u64);
        {
            let mut slots = self.slots.lock().expect("slots lock");
            for frame in frames {
                let ServerFrame::Presence(p) = &frame.frame else { continue };
                let waiting = Waiting { frame: frame.clone(), stale_at_ms: None };
                if slots.put_presence(p.user.clone(), waiting, max) {
                    stored += 1;
                } else {
                    dropped += 1;
                }
            }
        }
        if stored > 0 {
            self.wake.notify_one();
        }
        if dropped > 0 {
            m::EPHEMERAL_DROPPED.add_by("reason", "slots_full", dropped);
        }
    }

    /// Whether frames wait.
    pub fn pending(&self) -> bool {
        let slots = self.slots.lock().expect("slots lock");
        !slots.typing.is_empty() || !slots.presence.is_empty()
    }

    /// Empties the slots: the frames to send now, presence first; typing
    /// starts gone stale while waiting are dropped.
    /// The slots' maps are taken whole, so an emptied connection holds no
    /// table (a storm's grown one included) while it idles (issue 19).
    pub fn take(&self, now_ms: i64) -> Vec<Arc<Outgoing>> {
        let Slots { typing, presence } = std::mem::take(&mut *self.slots.lock().expect("slots lock"));
        let mut out: Vec<Arc<Outgoing>> = presence.into_values().map(|w| w.frame).collect();
        for w in typing.into_values() {
            if w.stale_at_ms.is_some_and(|at| at <= now_ms) {
                m::EPHEMERAL_DROPPED.add_by("reason", "expired", 1);
            } else {
                out.push(w.frame);
            }
        }
        out
    }

    /// Empties the slots ([`EphConn::take`]) into the frames to write: on a
    /// connection that takes `presence.batch`, the presence entries in as
    /// few batch frames as the frame bounds allow (one, short of 256 KiB of
    /// entries; `core::ephemeral::presence_batched`, `presence_batches`),
    /// then typing; otherwise one frame each.
    pub fn take_written(&self, now_ms: i64) -> Vec<Written> {
        let frames = self.take(now_ms);
        let single = |o: &Arc<Outgoing>| Written { kind: o.kind(), text: o.text.clone(), batched: 0 };
        // Presence comes first; its frames' fields are the entries.
        let entries: Vec<&str> = frames.iter().map_while(|o| presence_fields(o.text.as_str())).collect();
        if !rules::presence_batched(self.batch, entries.len()) {
            return frames.iter().map(single).collect();
        }
        let lens: Vec<usize> = entries.iter().map(|e| e.len() + PRESENCE_BATCH_ENTRY_OVERHEAD).collect();
        let batches = rules::presence_batches(
            &lens,
            PRESENCE_BATCH_FRAME_OVERHEAD,
            FRAME_BYTES_MAX,
            rules::PRESENCE_BATCH_ENTRIES_MAX,
        );
        let mut out: Vec<Written> = batches
            .into_iter()
            .map(|r| Written {
                kind: server_frame::PRESENCE_BATCH,
                batched: r.len(),
                text: presence_batch_text(entries[r].iter().copied()).into(),
            })
            .collect();
        out.extend(frames[entries.len()..].iter().map(single));
        out
    }
}

/// The local view of one user with connections on this node.
#[derive(Debug, Default)]
struct UserLocal {
    conns: Vec<Arc<EphConn>>,
    hidden: bool,
    /// What others were last told (`None`: nothing since connecting).
    announced: Option<Presence>,
    /// Last time a connection of the user was opened or set `online`.
    last_active_ms: i64,
    /// The last presence frame built for the user, reused while it says
    /// the same (each new connection of the audience is answered with it).
    shown: Option<Arc<Outgoing>>,
}

impl UserLocal {
    fn effective(&self) -> Presence {
        let devices = self.conns.iter().map(|c| *c.presence.lock().expect("presence lock"));
        rules::effective_presence(devices, self.hidden)
    }

    fn frame(&mut self, user: &str, state: Presence) -> Arc<Outgoing> {
        let last_seen = (state != Presence::Online && !self.hidden).then_some(self.last_active_ms);
        let frame = PresenceFrame { user: user.into(), state: state.as_str().into(), last_seen };
        match &self.shown {
            Some(o) if matches!(&o.frame, ServerFrame::Presence(p) if *p == frame) => o.clone(),
            _ => {
                let o = Outgoing::new(ServerFrame::Presence(frame));
                self.shown = Some(o.clone());
                o
            }
        }
    }
}

/// A signal to deliver: the frame (or none, for a probe), to whom, and
/// whether the receivers answer with their own presence.
#[derive(Debug, Clone)]
struct Signal {
    from: String,
    to: Vec<String>,
    frame: Option<Arc<Outgoing>>,
    answer: bool,
}

/// A typing signal held for its expiry, with the receivers of its stop.
#[derive(Debug)]
struct Held {
    typing: Typing,
    to: Vec<String>,
}

/// The lane of one node.
pub struct Lane {
    store: Arc<dyn Store>,
    config: EphemeralConfig,
    users: Mutex<HashMap<String, UserLocal>>,
    typing: Mutex<HashMap<(String, String), Held>>,
    /// `None` on a single node.
    bus: Option<mpsc::Sender<BusHint>>,
    /// The privacy re-reads other nodes' announcements set off, one running
    /// per local user at most.
    rereads: Mutex<Rereads>,
}

/// The privacy re-reads of local users that other nodes' announcements set
/// off ([`Lane::from_bus`]), at most one running per user: an announcement
/// that finds one running asks for one more read after it instead of a
/// read of its own (a storm of announcements about one user costs two
/// reads, not one each, and holds one read connection, not one each). The
/// read after the running one sees every switch the folded announcements
/// could have followed, and says again what this node sees if any of them
/// said offline. Bounded by the local users.
#[derive(Debug, Default)]
struct Rereads(HashMap<String, Option<bool>>);

impl Rereads {
    /// An announcement about `user` (`offline`: it said so). True: none
    /// runs, the caller starts one. False: the running one will read once
    /// more when it is done.
    fn asked(&mut self, user: &str, offline: bool) -> bool {
        match self.0.get_mut(user) {
            Some(again) => {
                *again = Some(again.unwrap_or(false) || offline);
                false
            }
            None => {
                self.0.insert(user.to_owned(), None);
                true
            }
        }
    }

    /// The running re-read of `user` is done: `Some(offline)` to read once
    /// more (asked while it ran; `offline` if any of those said offline),
    /// `None` when nothing was asked meanwhile (the user's entry is gone).
    fn done(&mut self, user: &str) -> Option<bool> {
        let again = self.0.get_mut(user).and_then(Option::take);
        if again.is_none() {
            self.0.remove(user);
        }
        again
    }
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Lane {
    pub fn new(store: Arc<dyn Store>, config: EphemeralConfig, bus: Option<mpsc::Sender<BusHint>>) -> Lane {
        Lane { store, config, users: Mutex::default(), typing: Mutex::default(), bus, rereads: Mutex::default() }
    }

    pub fn config(&self) -> &EphemeralConfig {
        &self.config
    }

    // ------------------------------------------------------- connections

    /// Registers a new connection, online (`batch`: it takes
    /// `presence.batch` frames). [`Lane::connected`] announces it.
    pub fn attach(&self, user: &str, device: &str, epoch: u64, batch: bool) -> Arc<EphConn> {
        let conn = Arc::new(EphConn {
            user: user.into(),
            device: device.into(),
            epoch,
            batch,
            presence: Mutex::new(Presence::Online),
            slots: Mutex::default(),
            wake: Notify::new(),
        });
        let mut users = self.users.lock().expect("lane lock");
        let u = users.entry(user.to_owned()).or_default();
        u.conns.push(conn.clone());
        u.last_active_ms = crate::util::now_ms();
        conn
    }

    /// After [`Lane::attach`]: reads the user's privacy and audience, then
    /// announces the user if that changes what others see, and asks the
    /// audience for their presence.
    pub async fn connected(&self, conn: &EphConn) {
        let user = &conn.user;
        let attached = || {
            let users = self.users.lock().expect("lane lock");
            users.get(user).is_some_and(|u| u.conns.iter().any(|c| std::ptr::eq(Arc::as_ptr(c), conn)))
        };
        // One statement: a storm of connects reads each user's facts once.
        let read = || self.store.presence_facts(user, self.config.audience_max);
        let Some((privacy, audience)) = self.read_facts(user, "facts", attached, read).await else { return };
        let signal = {
            let mut users = self.users.lock().expect("lane lock");
            let Some(u) = users.get_mut(user) else { return };
            u.hidden = privacy.hide_presence;
            let state = u.effective();
            let frame = rules::presence_changed(u.announced, state).then(|| u.frame(user, state));
            if frame.is_some() {
                u.announced = Some(state);
            }
            Signal { from: user.clone(), to: audience, frame, answer: true }
        };
        self.deliver(signal);
    }

    /// A connection closed: the user's presence is recomputed from the
    /// connections left here (offline with none) and announced if changed.
    pub async fn detach(&self, conn: &Arc<EphConn>) {
        let gone = {
            let mut users = self.users.lock().expect("lane lock");
            let Some(u) = users.get_mut(&conn.user) else { return };
            u.conns.retain(|c| !Arc::ptr_eq(c, conn));
            if !u.conns.is_empty() {
                None
            } else {
                let u = users.remove(&conn.user).expect("held above");
                let was_shown = u.announced.unwrap_or(Presence::Offline) != Presence::Offline;
                Some(was_shown.then(|| {
                    let last_seen = (!u.hidden).then(crate::util::now_ms);
                    let frame =
                        PresenceFrame { user: conn.user.clone(), state: Presence::Offline.as_str().into(), last_seen };
                    Outgoing::new(ServerFrame::Presence(frame))
                }))
            }
        };
        match gone {
            // Other connections remain: what they show now, if it changed.
            None => self.announce(&conn.user, None, false).await,
            Some(Some(offline)) => {
                // Said unless the user connected here again meanwhile (that
                // connection announces itself).
                if let Some(to) = self.audience(&conn.user, || !self.is_local(&conn.user)).await {
                    self.deliver(Signal { from: conn.user.clone(), to, frame: Some(offline), answer: false });
                }
            }
            Some(None) => {}
        }
    }

    /// Whether `user` has a connection on this node.
    fn is_local(&self, user: &str) -> bool {
        self.users.lock().expect("lane lock").contains_key(user)
    }

    /// Reads a presence fact of `user` (`what` names it in the log): again
    /// after a temporary failure, while `wanted` still holds after the wait
    /// (`core::ephemeral::presence_read_retry`: a resume storm on
    /// PostgreSQL can exhaust the read pool for seconds, and an
    /// announcement given up on the first failure left the user unshown,
    /// or shown online after closing); `None` when the read is given up.
    async fn read_facts<T, F, Fut>(&self, user: &str, what: &str, wanted: impl Fn() -> bool, read: F) -> Option<T>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = tidemark_store::StoreResult<T>>,
    {
        let mut failed = 0;
        loop {
            let e = match read().await {
                Ok(v) => return Some(v),
                Err(e) => e,
            };
            failed += 1;
            let temporary = matches!(e, tidemark_store::StoreError::Unavailable(_));
            let Some(wait_ms) = rules::presence_read_retry(failed, temporary) else {
                m::PRESENCE_READS_FAILED.add_by("outcome", "gave_up", 1);
                tracing::warn!(%user, what, failed, error = %e, "presence fact not read; given up");
                return None;
            };
            m::PRESENCE_READS_FAILED.add_by("outcome", "retried", 1);
            tracing::debug!(%user, what, failed, wait_ms, error = %e, "presence not read; reading again");
            tokio::time::sleep(Duration::from_millis(wait_ms)).await;
            if !wanted() {
                return None;
            }
        }
    }

    /// Who sees `user`'s presence now (read at every announcement, which
    /// coalescing makes rare, so a conversation created or left since the
    /// user connected counts at once), read again after a temporary failure
    /// while `wanted` holds; `None` when the store cannot say.
    async fn audience(&self, user: &str, wanted: impl Fn() -> bool) -> Option<Vec<String>> {
        let read = || self.store.presence_audience(user, self.config.audience_max);
        self.read_facts(user, "audience", wanted, read).await
    }

    /// Announces what others see of local `user` now if it differs from
    /// what they were last told, or, with `force`, if it is not offline.
    /// The state is read after the audience, so of two racing calls the
    /// last one delivered carries the latest state. `hidden` sets the
    /// privacy switch first when it is known anew.
    async fn announce(&self, user: &str, hidden: Option<bool>, force: bool) {
        if let Some(h) = hidden {
            if let Some(u) = self.users.lock().expect("lane lock").get_mut(user) {
                u.hidden = h;
            }
        }
        let Some(to) = self.audience(user, || self.is_local(user)).await else { return };
        let frame = {
            let mut users = self.users.lock().expect("lane lock");
            let Some(u) = users.get_mut(user) else { return };
            let state = u.effective();
            let forced = force && state != Presence::Offline;
            if !forced && !rules::presence_changed(u.announced, state) {
                return;
            }
            u.announced = Some(state);
            u.frame(user, state)
        };
        self.deliver(Signal { from: user.into(), to, frame: Some(frame), answer: false });
    }

    // ---------------------------------------------------------- presence

    /// `presence.set` of `user`'s `device`, which must hold a WebSocket on
    /// this node. Returns what others now see and whether the user hides.
    pub async fn set_presence(&self, user: &str, device: &str, state: Presence) -> ApiResult<(Presence, bool)> {
        let now = crate::util::now_ms();
        let (shown, hidden, changed) = {
            let mut users = self.users.lock().expect("lane lock");
            let u = users.get_mut(user).filter(|u| u.conns.iter().any(|c| c.device == device)).ok_or_else(|| {
                ApiError::bad_request("presence.set needs a WebSocket connection of this device on this server")
            })?;
            for c in u.conns.iter().filter(|c| c.device == device) {
                *c.presence.lock().expect("presence lock") = state;
            }
            if state == Presence::Online {
                u.last_active_ms = now;
            }
            let shown = u.effective();
            (shown, u.hidden, rules::presence_changed(u.announced, shown))
        };
        if changed {
            self.announce(user, None, false).await;
        }
        Ok((shown, hidden))
    }

    /// The user's privacy changed (`privacy.set` committed): hiding says
    /// `offline` to the audience, showing again says the current state.
    pub async fn privacy_changed(&self, user: &str, privacy: tidemark_store::Privacy) {
        self.announce(user, Some(privacy.hide_presence), false).await;
    }

    // ------------------------------------------------------------ typing

    /// `typing` of `user` in `conv`: to the other current members, with
    /// renewals coalesced; returns the timeout applied (0 for a stop).
    pub async fn typing(&self, user: &str, conv: &str, start: bool, timeout_ms: Option<u64>) -> ApiResult<u64> {
        let conversation = self.store.conversation(conv).await?;
        let members = conversation.as_ref().map(|c| c.members.as_slice());
        let to = rules::typing_recipients(conv, members, user).map_err(tidemark_store::StoreError::from)?;
        let max_ms = self.config.typing_timeout_max.as_millis() as u64;
        let timeout = if start { rules::typing_timeout(timeout_ms, max_ms) } else { 0 };
        let now = crate::util::now_ms();
        let forward = {
            let mut held = self.typing.lock().expect("typing lock");
            let key = (conv.to_owned(), user.to_owned());
            let step = rules::typing_step(held.get(&key).map(|h| h.typing), start, now, timeout);
            match step.held {
                Some(typing) if held.len() < self.config.typing_held_max || held.contains_key(&key) => {
                    held.insert(key, Held { typing, to: to.clone() });
                }
                Some(_) => {
                    m::EPHEMERAL_DROPPED.add_by("reason", "typing_held_full", 1);
                }
                None => {
                    held.remove(&key);
                }
            }
            step.forward
        };
        if forward {
            let frame = Outgoing::new(ServerFrame::Typing(TypingFrame {
                conv: conv.into(),
                user: user.into(),
                typing: start,
                timeout_ms: timeout,
            }));
            self.deliver(Signal { from: user.into(), to, frame: Some(frame), answer: false });
        }
        Ok(timeout)
    }

    /// Stops every held typing whose timeout passed; returns how many.
    pub fn sweep(&self, now_ms: i64) -> usize {
        let expired: Vec<((String, String), Held)> = {
            let mut held = self.typing.lock().expect("typing lock");
            let keys: Vec<_> =
                held.iter().filter(|(_, h)| h.typing.expires_at_ms <= now_ms).map(|(k, _)| k.clone()).collect();
            keys.into_iter().filter_map(|k| held.remove_entry(&k)).collect()
        };
        let n = expired.len();
        for ((conv, user), h) in expired {
            let frame = Outgoing::new(ServerFrame::Typing(TypingFrame {
                conv,
                user: user.clone(),
                typing: false,
                timeout_ms: 0,
            }));
            self.deliver(Signal { from: user, to: h.to, frame: Some(frame), answer: false });
        }
        n
    }

    /// Runs [`Lane::sweep`] every `typing_sweep_every` until shutdown.
    pub async fn run_sweep(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut every = tokio::time::interval(self.config.typing_sweep_every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = crate::util::stopped(&mut shutdown) => return,
            }
            self.sweep(crate::util::now_ms());
        }
    }

    // ---------------------------------------------------------- delivery

    /// Delivers to this node's connections of the recipients and publishes
    /// the signal for the other nodes.
    fn deliver(&self, signal: Signal) {
        self.publish(&signal);
        self.deliver_local(&signal);
    }

    /// Offers the frame to the local connections of the recipients; with
    /// `answer`, each recipient visible here answers with its presence,
    /// offered to the sender's local connections under the same lock and
    /// published for the other nodes.
    fn deliver_local(&self, signal: &Signal) {
        let stale_at = match signal.frame.as_deref().map(|o| &o.frame) {
            Some(ServerFrame::Typing(t)) if t.typing => Some(crate::util::now_ms() + t.timeout_ms as i64),
            _ => None,
        };
        let mut answers = Vec::new();
        {
            let mut users = self.users.lock().expect("lane lock");
            for r in &signal.to {
                let Some(u) = users.get_mut(r) else { continue };
                if let Some(frame) = &signal.frame {
                    for c in &u.conns {
                        c.offer(frame.clone(), stale_at, &self.config);
                    }
                }
                if signal.answer {
                    let state = u.effective();
                    if state != Presence::Offline {
                        answers.push(Signal {
                            from: r.clone(),
                            to: vec![signal.from.clone()],
                            frame: Some(u.frame(r, state)),
                            answer: false,
                        });
                    }
                }
            }
            if let Some(asker) = users.get(&signal.from).filter(|_| !answers.is_empty()) {
                let frames: Vec<Arc<Outgoing>> =
                    answers.iter().map(|a| a.frame.clone().expect("answers carry a frame")).collect();
                for c in &asker.conns {
                    c.offer_answers(&frames, &self.config);
                }
            }
        }
        for a in &answers {
            self.publish(a);
        }
    }

    fn publish(&self, signal: &Signal) {
        let Some(bus) = &self.bus else { return };
        for to in signal.to.chunks(BUS_RECIPIENTS_MAX) {
            let hint = BusHint {
                user: signal.from.clone(),
                high_watermark: 0,
                conv: None,
                kick: None,
                ephemeral: Some(BusEphemeral {
                    to: to.to_vec(),
                    frame: signal.frame.as_ref().map(|o| o.frame.clone()),
                    answer: signal.answer,
                }),
            };
            if bus.try_send(hint).is_err() {
                m::EPHEMERAL_DROPPED.add_by("reason", "bus_queue_full", 1);
            }
        }
    }

    /// A signal another node published (`from` is the hint's user), run by
    /// the bus subscriber task. It reads nothing from the store on that
    /// task: the privacy re-read below runs on a task of its own, so the
    /// kicks and hints behind this signal on the bus never wait on a store
    /// read (a read pool run dry holds a read for up to its 5 s wait, and
    /// it is read again after a failure); at most one such task runs per
    /// user ([`Rereads`]).
    pub fn from_bus(self: &Arc<Self>, from: String, eph: BusEphemeral) {
        m::EPHEMERAL_BUS_RECEIVED.inc();
        let about_sender = match &eph.frame {
            Some(ServerFrame::Presence(p)) if p.user == from => Some(p.state == Presence::Offline.as_str()),
            _ => None,
        };
        // Only this node's connections: the other nodes heard it too
        // (answers are delivered everywhere).
        let frame = eph.frame.map(Outgoing::new);
        self.deliver_local(&Signal { from: from.clone(), to: eph.to, frame, answer: eph.answer });
        // Another node announced `from`, who is connected here too: its
        // privacy switch may have changed there, so it is read again. If it
        // said offline, this node says again what it sees, so a user still
        // connected here is not left shown offline.
        let Some(offline) = about_sender else { return };
        if !self.is_local(&from) {
            return;
        }
        if !self.rereads.lock().expect("lane lock").asked(&from, offline) {
            m::PRESENCE_REREADS_COALESCED.inc();
            return;
        }
        let lane = Arc::clone(self);
        tokio::spawn(async move {
            let mut offline = offline;
            loop {
                lane.announced_elsewhere(&from, offline).await;
                match lane.rereads.lock().expect("lane lock").done(&from) {
                    Some(again) => offline = again,
                    None => break,
                }
            }
        });
    }

    /// After another node announced local user `from`: its privacy switch
    /// is read again (it may have changed there; read again after a
    /// temporary failure while the user is still local), and if that node
    /// said offline, this one says again what it sees, so a user still
    /// connected here is not left shown offline.
    async fn announced_elsewhere(&self, from: &str, offline: bool) {
        let read = || async { self.store.privacy(from).await.map(|p| p.hide_presence) };
        let hidden = self.read_facts(from, "privacy", || self.is_local(from), read).await;
        if offline {
            self.announce(from, hidden, true).await;
        } else if let (Some(h), Some(u)) = (hidden, self.users.lock().expect("lane lock").get_mut(from)) {
            u.hidden = h;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> EphConn {
        EphConn {
            user: "ben".into(),
            device: "phone".into(),
            epoch: 1,
            batch: false,
            presence: Mutex::new(Presence::Online),
            slots: Mutex::default(),
            wake: Notify::new(),
        }
    }

    fn typing(conv: &str, user: &str, on: bool) -> Arc<Outgoing> {
        Outgoing::new(ServerFrame::Typing(TypingFrame {
            conv: conv.into(),
            user: user.into(),
            typing: on,
            timeout_ms: 10,
        }))
    }

    fn presence(user: &str, state: &str) -> Arc<Outgoing> {
        Outgoing::new(ServerFrame::Presence(PresenceFrame { user: user.into(), state: state.into(), last_seen: None }))
    }

    /// Slots coalesce to the latest frame per key, drop new keys past the
    /// bound (existing keys still update), and drop typing gone stale while
    /// it waited; presence comes first.
    #[test]
    fn slots_are_bounded_coalesced_and_drop_stale_typing() {
        let config = EphemeralConfig { typing_slots_max: 2, presence_slots_max: 1, ..EphemeralConfig::default() };
        let c = conn();
        assert!(c.offer(typing("g1", "ann", true), Some(100), &config));
        assert!(c.offer(typing("g1", "ann", false), None, &config), "the same key replaces");
        assert!(c.offer(typing("g2", "ann", true), Some(100), &config));
        assert!(!c.offer(typing("g3", "ann", true), Some(100), &config), "a third key is shed");
        assert!(c.offer(typing("g2", "ann", true), Some(50), &config), "a held key still updates");
        assert!(c.offer(presence("ann", "idle"), None, &config));
        assert!(c.offer(presence("ann", "online"), None, &config));
        assert!(!c.offer(presence("cat", "online"), None, &config));
        assert!(c.pending());
        let frames = c.take(60);
        assert_eq!(frames[0], presence("ann", "online"), "presence first, the latest only");
        assert_eq!(&frames[1..], &[typing("g1", "ann", false)], "g2's start went stale at 50 while waiting");
        assert!(!c.pending() && c.take(60).is_empty());
        let slots = c.slots.lock().unwrap();
        assert_eq!((slots.presence.capacity(), slots.typing.capacity()), (0, 0), "emptied slots hold no table");
    }

    /// Announcements about one user while its re-read runs fold into one
    /// more read, which says again what this node sees if any of them said
    /// offline; users are independent; a finished user starts afresh.
    #[test]
    fn rereads_run_one_per_user_and_fold_what_comes_meanwhile() {
        let mut r = Rereads::default();
        assert!(r.asked("ann", false), "none runs: start one");
        assert!(r.asked("ben", true), "another user is independent");
        assert!(!r.asked("ann", false) && !r.asked("ann", true) && !r.asked("ann", false), "folded");
        assert_eq!(r.done("ann"), Some(true), "one more read, offline since one of them said so");
        assert!(!r.asked("ann", false), "still running: folded again");
        assert_eq!(r.done("ann"), Some(false), "one more, not offline");
        assert_eq!(r.done("ann"), None, "nothing asked meanwhile: done");
        assert!(r.asked("ann", false), "after it is done a new one starts");
        assert_eq!(r.done("ben"), None);
        assert_eq!(r.done("ann"), None);
        assert!(r.0.is_empty(), "no entry outlives its read");
    }

    /// A signal's frame is one serialisation shared by every slot it waits
    /// in; a user's presence frame is built again only when what it says
    /// changes.
    #[test]
    fn frames_are_serialised_once_and_a_users_frame_is_reused_until_it_changes() {
        let config = EphemeralConfig::default();
        let (a, b) = (conn(), conn());
        let frame = typing("g1", "ann", true);
        assert_eq!(frame.text.as_str(), serde_json::to_string(&frame.frame).unwrap());
        assert!(a.offer(frame.clone(), None, &config) && b.offer(frame.clone(), None, &config));
        let (ta, tb) = (a.take(0), b.take(0));
        assert!(Arc::ptr_eq(&ta[0], &frame) && Arc::ptr_eq(&tb[0], &frame), "no copy per connection");

        let mut u = UserLocal { last_active_ms: 7, ..UserLocal::default() };
        let online = u.frame("ann", Presence::Online);
        assert!(Arc::ptr_eq(&online, &u.frame("ann", Presence::Online)), "the same frame again");
        let idle = u.frame("ann", Presence::Idle);
        assert!(!Arc::ptr_eq(&online, &idle));
        let ServerFrame::Presence(p) = &idle.frame else { panic!("a presence frame") };
        assert_eq!((p.state.as_str(), p.last_seen), ("idle", Some(7)));
        u.last_active_ms = 9;
        let ServerFrame::Presence(p) = &u.frame("ann", Presence::Idle).frame else { panic!("a presence frame") };
        assert_eq!(p.last_seen, Some(9), "a new last_seen is a new frame");
        u.hidden = true;
        let ServerFrame::Presence(p) = &u.frame("ann", Presence::Idle).frame else { panic!("a presence frame") };
        assert_eq!(p.last_seen, None, "hidden users show no last_seen");
    }

    /// A connection that opted in gets its waiting presence entries as one
    /// `presence.batch` (typing after it, single), and one waiting entry as
    /// the single frame; one that did not gets a frame per entry.
    #[test]
    fn presence_waiting_at_a_wake_leaves_as_one_batch_where_opted_in() {
        let config = EphemeralConfig::default();
        let batch = EphConn { batch: true, ..conn() };
        let single = conn();
        let frames = [presence("ann", "online"), presence("cat", "idle"), presence("dan", "offline")];
        for c in [&batch, &single] {
            for f in &frames {
                assert!(c.offer(f.clone(), None, &config));
            }
            assert!(c.offer(typing("g1", "ann", true), None, &config));
        }
        let written = batch.take_written(0);
        assert_eq!(
            written.iter().map(|w| (w.kind, w.batched)).collect::<Vec<_>>(),
            [("presence.batch", 3), ("typing", 0)]
        );
        let ServerFrame::PresenceBatch(b) = serde_json::from_str(written[0].text.as_str()).unwrap() else {
            panic!("a batch: {}", written[0].text.as_str())
        };
        let mut got: Vec<_> = b.presence.into_iter().map(|p| (p.user, p.state)).collect();
        got.sort();
        assert_eq!(
            got,
            [("ann".into(), "online".into()), ("cat".into(), "idle".into()), ("dan".into(), "offline".into())]
        );
        let written = single.take_written(0);
        assert_eq!(written.iter().filter(|w| w.kind == "presence" && w.batched == 0).count(), 3);
        assert_eq!(written.len(), 4);

        assert!(batch.offer(presence("ann", "idle"), None, &config));
        let written = batch.take_written(0);
        assert_eq!(written.len(), 1);
        assert_eq!(written[0].text, presence("ann", "idle").text, "a lone entry is the single frame");
    }

    /// The answers of an audience go in under one lock: bounded by the
    /// audience on a connection that opted in, by the slots otherwise.
    #[test]
    fn answers_are_bounded_by_the_audience_where_opted_in() {
        let config = EphemeralConfig { presence_slots_max: 2, audience_max: 5, ..EphemeralConfig::default() };
        let answers: Vec<_> = (0..7).map(|i| presence(&format!("u{i}"), "online")).collect();
        let batch = EphConn { batch: true, ..conn() };
        batch.offer_answers(&answers, &config);
        let written = batch.take_written(0);
        assert_eq!(written.iter().map(|w| (w.kind, w.batched)).collect::<Vec<_>>(), [("presence.batch", 5)]);
        let single = conn();
        single.offer_answers(&answers, &config);
        assert_eq!(single.take_written(0).len(), 2);
    }

    #[test]
    fn hints_and_kicks_never_take_a_slot() {
        let c = conn();
        let hint = Outgoing::new(ServerFrame::Hint(tidemark_proto::Hint::user(1, "new_event")));
        assert!(!c.offer(hint, None, &EphemeralConfig::default()));
        assert!(!c.pending());
    }
}
