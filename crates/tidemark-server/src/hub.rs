//! The hub: which devices are connected right now, and the hints they get.
//!
//! A hint says only "your log reached this high watermark" (D8). Each
//! connection has one hint slot holding the highest watermark not yet sent;
//! many fan-outs before the connection's writer wakes become one frame with
//! the latest value (coalescing), so hints never queue up without bound and
//! can never overflow a connection. Losing one is harmless: clients sync on
//! connect and periodically, and [`Hub::rehint_sweep`] repeats the hint to a
//! device whose ACK lags its user's watermark for longer than a bound.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;

/// One authenticated connection, as the hub sees it.
#[derive(Debug)]
pub struct ConnEntry {
    pub user: String,
    pub device: String,
    /// The device's connection epoch, from the store (`open_connection`):
    /// a newer connection of the device, on any node, has a higher one (P2).
    pub epoch: u64,
    /// When the access token the connection authenticated with was issued
    /// (ms): an operator's end of sessions after it ends the connection.
    pub token_issued_at_ms: i64,
    /// Highest watermark to hint; 0 when nothing is pending.
    pending_hint: AtomicU64,
    /// Highest watermark hinted so far.
    hinted: AtomicU64,
    rehint: AtomicBool,
    /// The device's ACK as last seen by this server.
    acked: AtomicU64,
    /// Since when the ACK has been behind the user's watermark (0: not
    /// behind), for the online-lag metric in seconds.
    behind_since_ms: AtomicI64,
    last_hint_at_ms: AtomicI64,
    /// Large groups (G2): per group, the latest marker `(target, version)`
    /// not yet sent. One slot per group the user is in, so bounded by the
    /// user's memberships; many moves before the writer wakes are one frame.
    conv_hints: Mutex<HashMap<String, (u64, u64)>>,
    /// Woken when a hint is pending.
    pub wake: Notify,
    /// Set once when the hub decides to end this connection.
    kick: OnceLock<&'static str>,
    /// Woken once by the kick, one per waiter: the connection's reader
    /// loop and its writer. A `Notify` keeps the wake for a waiter not
    /// waiting yet (a kick before the loops start is not missed); two of
    /// them cost 80 bytes where a `watch` channel cost about 450 (its
    /// eight `Notify`s), per idle connection (issue 19).
    pub kicked_reader: Notify,
    pub kicked_writer: Notify,
}

impl ConnEntry {
    /// The hint to send now, if any: `(watermark, is_rehint)`.
    pub fn take_hint(&self) -> Option<(u64, bool)> {
        let hw = self.pending_hint.swap(0, Ordering::AcqRel);
        let rehint = self.rehint.swap(false, Ordering::AcqRel);
        if hw == 0 {
            return None;
        }
        let before = self.hinted.fetch_max(hw, Ordering::AcqRel);
        (hw > before || rehint).then_some((hw, rehint))
    }

    /// The large-group hints to send now: `(conv, target, version)`.
    pub fn take_conv_hints(&self) -> Vec<(String, u64, u64)> {
        let mut slots = self.conv_hints.lock().expect("conv hint lock");
        slots.drain().map(|(conv, (target, version))| (conv, target, version)).collect()
    }

    /// The highest user watermark hinted on this connection so far.
    pub fn hinted(&self) -> u64 {
        self.hinted.load(Ordering::Acquire)
    }

    fn hint_conv(&self, conv: &str, target: u64, version: u64) {
        {
            let mut slots = self.conv_hints.lock().expect("conv hint lock");
            let slot = slots.entry(conv.to_owned()).or_insert((0, 0));
            *slot = (slot.0.max(target), slot.1.max(version));
        }
        self.wake.notify_one();
    }

    /// The kick reason, once the hub decided to end this connection.
    pub fn kicked(&self) -> Option<&'static str> {
        self.kick.get().copied()
    }

    /// Ends the connection; the first reason wins, and wakes its reader
    /// and writer once.
    pub fn kick(&self, reason: &'static str) {
        if self.kick.set(reason).is_ok() {
            self.kicked_reader.notify_one();
            self.kicked_writer.notify_one();
        }
    }

    /// Queues a hint; returns whether it merged into one already waiting
    /// (coalesced).
    fn hint(&self, hw: u64, rehint: bool, now_ms: i64) -> bool {
        let waiting = self.pending_hint.fetch_max(hw, Ordering::AcqRel);
        if rehint {
            self.rehint.store(true, Ordering::Release);
        }
        if self.acked.load(Ordering::Acquire) < hw {
            let _ = self.behind_since_ms.compare_exchange(0, now_ms, Ordering::AcqRel, Ordering::Acquire);
        }
        self.last_hint_at_ms.store(now_ms, Ordering::Release);
        self.wake.notify_one();
        waiting != 0
    }
}

/// The online devices' lag behind their users' watermarks, as this hub
/// knows them (`/metrics` samples it at scrape time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LagSample {
    /// Connections whose device's ACK is below its user's watermark.
    pub lagging: u64,
    /// The largest `watermark - acked`, in events.
    pub events_max: u64,
    /// The longest time an ACK has stayed behind, in milliseconds.
    pub behind_ms_max: i64,
}

/// The connections of one user and the user's latest known watermark.
#[derive(Debug, Default)]
struct UserConns {
    high_watermark: u64,
    conns: Vec<Arc<ConnEntry>>,
}

/// Only users with a live connection have an entry, so the hub's memory is
/// bounded by the number of connections.
#[derive(Debug, Default)]
pub struct Hub {
    users: Mutex<HashMap<String, UserConns>>,
}

impl Hub {
    /// Registers a connection of connection epoch `epoch`; a connection of
    /// the same device with a lower epoch is kicked as superseded (P2), and
    /// so is this one if one with a higher epoch is already here (two
    /// connections raced). `acked` and `user_hw` seed the lag check;
    /// `token_issued_at_ms` is when its access token was issued.
    pub fn register(
        &self,
        user: &str,
        device: &str,
        epoch: u64,
        token_issued_at_ms: i64,
        acked: u64,
        user_hw: u64,
    ) -> Arc<ConnEntry> {
        let entry = Arc::new(ConnEntry {
            user: user.into(),
            device: device.into(),
            epoch,
            token_issued_at_ms,
            pending_hint: AtomicU64::new(0),
            hinted: AtomicU64::new(0),
            rehint: AtomicBool::new(false),
            acked: AtomicU64::new(acked),
            behind_since_ms: AtomicI64::new(0),
            last_hint_at_ms: AtomicI64::new(crate::util::now_ms()),
            conv_hints: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            kick: OnceLock::new(),
            kicked_reader: Notify::new(),
            kicked_writer: Notify::new(),
        });
        let mut users = self.users.lock().expect("hub lock");
        let u = users.entry(user.to_owned()).or_default();
        u.high_watermark = u.high_watermark.max(user_hw);
        if acked < u.high_watermark {
            entry.behind_since_ms.store(crate::util::now_ms(), Ordering::Release);
        }
        for other in u.conns.iter().filter(|c| c.device == device) {
            let older = if other.epoch < epoch { other } else { &entry };
            older.kick(tidemark_proto::reason::SUPERSEDED);
        }
        if entry.kicked().is_none() {
            u.conns.retain(|c| c.device != device);
        }
        u.conns.push(entry.clone());
        crate::metrics::WS_CONNECTIONS.shift(1.0);
        entry
    }

    pub fn unregister(&self, entry: &Arc<ConnEntry>) {
        let mut users = self.users.lock().expect("hub lock");
        if let Some(u) = users.get_mut(&entry.user) {
            u.conns.retain(|c| !Arc::ptr_eq(c, entry));
            if u.conns.is_empty() {
                users.remove(&entry.user);
            }
        }
        crate::metrics::WS_CONNECTIONS.shift(-1.0);
    }

    /// A fan-out committed: the user's log now reaches `hw`.
    pub fn notify_user(&self, user: &str, hw: u64) {
        let now = crate::util::now_ms();
        let mut users = self.users.lock().expect("hub lock");
        let Some(u) = users.get_mut(user) else { return };
        u.high_watermark = u.high_watermark.max(hw);
        let mut coalesced = 0;
        for c in &u.conns {
            coalesced += u64::from(c.hint(hw, false, now));
        }
        if coalesced > 0 {
            crate::metrics::HINTS_COALESCED.add(coalesced);
        }
    }

    /// A large group moved (G2): queues its marker on the connections of
    /// `members` here, walking whichever of the members and the connected
    /// users is smaller. Returns how many connections were hinted.
    pub fn notify_conv(&self, members: &HashSet<String>, conv: &str, target: u64, version: u64) -> usize {
        let users = self.users.lock().expect("hub lock");
        let mut n = 0;
        let mut hint = |u: &UserConns| {
            for c in &u.conns {
                c.hint_conv(conv, target, version);
                n += 1;
            }
        };
        if members.len() <= users.len() {
            for m in members {
                if let Some(u) = users.get(m) {
                    hint(u);
                }
            }
        } else {
            for (user, u) in users.iter() {
                if members.contains(user) {
                    hint(u);
                }
            }
        }
        n
    }

    pub fn on_ack(&self, user: &str, device: &str, acked: u64) {
        let users = self.users.lock().expect("hub lock");
        let Some(u) = users.get(user) else { return };
        for c in u.conns.iter().filter(|c| c.device == device) {
            let now_acked = c.acked.fetch_max(acked, Ordering::AcqRel).max(acked);
            if now_acked >= u.high_watermark {
                c.behind_since_ms.store(0, Ordering::Release);
            }
        }
    }

    /// The online devices' lag at `now_ms`: one walk over the connections
    /// under the hub's lock, memory only.
    pub fn lag(&self, now_ms: i64) -> LagSample {
        let users = self.users.lock().expect("hub lock");
        let mut sample = LagSample::default();
        for u in users.values() {
            for c in &u.conns {
                let behind = u.high_watermark.saturating_sub(c.acked.load(Ordering::Acquire));
                if behind == 0 {
                    continue;
                }
                sample.lagging += 1;
                sample.events_max = sample.events_max.max(behind);
                let since = c.behind_since_ms.load(Ordering::Acquire);
                if since > 0 {
                    sample.behind_ms_max = sample.behind_ms_max.max(now_ms - since);
                }
            }
        }
        sample
    }

    /// Ends every connection of a device (revocation, P5).
    pub fn kick_device(&self, user: &str, device: &str, reason: &'static str) {
        let users = self.users.lock().expect("hub lock");
        for c in users.get(user).into_iter().flat_map(|u| &u.conns).filter(|c| c.device == device) {
            c.kick(reason);
        }
    }

    /// Ends, with `reason`, each connection of `user` whose session `alive`
    /// (given the device and the token's issue time) no longer opens;
    /// returns how many.
    pub fn kick_ended(&self, user: &str, reason: &'static str, alive: impl Fn(&str, i64) -> bool) -> usize {
        let users = self.users.lock().expect("hub lock");
        let mut n = 0;
        for c in users.get(user).into_iter().flat_map(|u| &u.conns) {
            if !alive(&c.device, c.token_issued_at_ms) {
                c.kick(reason);
                n += 1;
            }
        }
        n
    }

    /// A connection of the device with epoch `epoch` opened on another
    /// node: this node's older ones end as superseded (P2).
    pub fn supersede(&self, user: &str, device: &str, epoch: u64) {
        let users = self.users.lock().expect("hub lock");
        let conns = users.get(user).into_iter().flat_map(|u| &u.conns);
        for c in conns.filter(|c| c.device == device && c.epoch < epoch) {
            c.kick(tidemark_proto::reason::SUPERSEDED);
        }
    }

    /// Whether the device has a live WebSocket on this node (P4: such a
    /// device gets hints, not pushes).
    pub fn is_connected(&self, user: &str, device: &str) -> bool {
        let users = self.users.lock().expect("hub lock");
        users.get(user).is_some_and(|u| u.conns.iter().any(|c| c.device == device && c.kicked().is_none()))
    }

    /// The devices connected here, each once.
    pub fn devices(&self) -> Vec<(String, String)> {
        let users = self.users.lock().expect("hub lock");
        let mut out: Vec<(String, String)> =
            users.values().flat_map(|u| &u.conns).map(|c| (c.user.clone(), c.device.clone())).collect();
        out.sort();
        out.dedup();
        out
    }

    /// Re-hints every connected device whose ACK is below its user's
    /// watermark and that was not hinted for `after_ms` (D8). Returns how
    /// many connections were re-hinted.
    pub fn rehint_sweep(&self, now_ms: i64, after_ms: i64) -> usize {
        let users = self.users.lock().expect("hub lock");
        let mut n = 0;
        for u in users.values() {
            let hw = u.high_watermark;
            for c in &u.conns {
                let lagging = c.acked.load(Ordering::Acquire) < hw;
                let quiet = now_ms - c.last_hint_at_ms.load(Ordering::Acquire) >= after_ms;
                if lagging && quiet {
                    c.hint(hw, true, now_ms);
                    n += 1;
                }
            }
        }
        crate::metrics::HINTS_REHINTED.add(n as u64);
        n
    }

    pub fn connections(&self) -> usize {
        self.users.lock().expect("hub lock").values().map(|u| u.conns.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_coalesce_to_the_latest_watermark() {
        let hub = Hub::default();
        let c = hub.register("bob", "phone", 1, 0, 0, 0);
        for hw in 1..=50 {
            hub.notify_user("bob", hw);
        }
        assert_eq!(c.take_hint(), Some((50, false)));
        assert_eq!(c.take_hint(), None);
        hub.notify_user("bob", 40);
        assert_eq!(c.take_hint(), None, "an older watermark is not hinted again");
    }

    #[test]
    fn lag_is_measured_from_the_watermark_and_ends_with_the_ack() {
        let hub = Hub::default();
        let phone = hub.register("bob", "phone", 1, 0, 3, 3);
        let desk = hub.register("bob", "desk", 1, 0, 3, 3);
        assert_eq!(hub.lag(0), LagSample::default(), "both caught up");
        let t = crate::util::now_ms();
        hub.notify_user("bob", 8);
        let later = hub.lag(t + 60_000);
        assert_eq!((later.lagging, later.events_max), (2, 5));
        assert!((60_000..=60_000 + (crate::util::now_ms() - t)).contains(&later.behind_ms_max), "{later:?}");
        hub.on_ack("bob", "desk", 8);
        assert_eq!((hub.lag(t).lagging, hub.lag(t).events_max), (1, 5), "the desk caught up, the phone did not");
        hub.on_ack("bob", "phone", 6);
        assert_eq!(hub.lag(t).events_max, 2, "still behind, since the first hint");
        hub.on_ack("bob", "phone", 8);
        assert_eq!(hub.lag(t + 60_000), LagSample::default());
        drop((phone, desk));
    }

    #[test]
    fn group_hints_reach_connected_members_once_per_group() {
        let hub = Hub::default();
        let bob = hub.register("bob", "phone", 1, 0, 0, 0);
        let carol = hub.register("carol", "laptop", 1, 0, 0, 0);
        let members: HashSet<String> = ["bob", "dave"].iter().map(|s| s.to_string()).collect();
        for v in 1..=20 {
            assert_eq!(hub.notify_conv(&members, "g", 100 + v, v), 1);
        }
        // Walking the connected users instead (more members than users).
        let many: HashSet<String> = (0..10).map(|i| format!("u{i}")).chain(["bob".to_string()]).collect();
        assert_eq!(hub.notify_conv(&many, "h", 5, 1), 1);
        let mut got = bob.take_conv_hints();
        got.sort();
        assert_eq!(got, vec![("g".to_string(), 120, 20), ("h".to_string(), 5, 1)]);
        assert!(bob.take_conv_hints().is_empty());
        assert!(carol.take_conv_hints().is_empty());
    }

    #[test]
    fn lagging_device_is_rehinted_and_a_newer_connection_supersedes() {
        let hub = Hub::default();
        let c = hub.register("bob", "phone", 1, 0, 0, 0);
        hub.notify_user("bob", 7);
        assert_eq!(c.take_hint(), Some((7, false)));
        let now = crate::util::now_ms();
        assert_eq!(hub.rehint_sweep(now, 60_000), 0, "too soon");
        assert_eq!(hub.rehint_sweep(now + 60_000, 60_000), 1);
        assert_eq!(c.take_hint(), Some((7, true)));
        hub.on_ack("bob", "phone", 7);
        assert_eq!(hub.rehint_sweep(now + 120_000, 60_000), 0, "caught up");
        let newer = hub.register("bob", "phone", 2, 0, 7, 7);
        assert_eq!(c.kicked(), Some(tidemark_proto::reason::SUPERSEDED));
        assert_eq!(newer.kicked(), None);
        assert_eq!(hub.connections(), 1);
        hub.unregister(&c);
        hub.unregister(&newer);
        assert!(hub.users.lock().unwrap().is_empty(), "no memory kept for users without connections");
    }

    #[test]
    fn the_highest_connection_epoch_of_a_device_wins_wherever_it_opened() {
        let hub = Hub::default();
        let late = hub.register("bob", "phone", 5, 0, 0, 0);
        let raced = hub.register("bob", "phone", 4, 0, 0, 0);
        assert_eq!(raced.kicked(), Some(tidemark_proto::reason::SUPERSEDED), "an older epoch registering late loses");
        assert_eq!(late.kicked(), None);
        let desk = hub.register("bob", "desk", 1, 0, 0, 0);
        hub.supersede("bob", "phone", 5);
        assert_eq!(late.kicked(), None, "the same epoch is not superseded");
        hub.supersede("bob", "phone", 6);
        assert_eq!(late.kicked(), Some(tidemark_proto::reason::SUPERSEDED), "a newer epoch on another node");
        assert_eq!(desk.kicked(), None, "other devices are not touched");
        assert_eq!(hub.devices(), vec![("bob".into(), "desk".into()), ("bob".into(), "phone".into())]);
    }
}
