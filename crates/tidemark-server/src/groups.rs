//! Hints for large groups (G2): which connected users of this node are in a
//! shared group that moved.
//!
//! A shared group's messages write nothing per member, so the relay cannot
//! hint users from its fan-out report; it gets the group's published marker
//! instead ([`tidemark_store::ConvMoved`]) and this module resolves who is
//! in the group from a per-node cache of active members, keyed by the
//! group's `members_seq` (the `msg_seq` of its last membership change): a
//! marker carrying another `members_seq` reloads the members from the
//! store, so a join or leave on any node is seen by every node's next hint.
//! The hub then intersects the members with its live connections, walking
//! the smaller set, and each connection keeps one slot per group with the
//! latest marker (coalescing, as for user hints). A lost hint costs only
//! latency: the marker stays dirty and the next sync or `conv.list` shows
//! it (level-triggered).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tidemark_store::{ConvMoved, Store};

use crate::hub::Hub;

/// Groups whose members one node caches; past it the cache starts over
/// (a reload costs one read per group).
pub const GROUP_CACHE_MAX: usize = 4096;

#[derive(Debug)]
struct Members {
    members_seq: u64,
    users: Arc<HashSet<String>>,
}

pub struct GroupHints {
    store: Arc<dyn Store>,
    hub: Arc<Hub>,
    cache: Mutex<HashMap<String, Members>>,
}

impl GroupHints {
    pub fn new(store: Arc<dyn Store>, hub: Arc<Hub>) -> GroupHints {
        GroupHints { store, hub, cache: Mutex::new(HashMap::new()) }
    }

    fn cached(&self, conv: &str, members_seq: u64) -> Option<Arc<HashSet<String>>> {
        let cache = self.cache.lock().expect("group cache lock");
        cache.get(conv).filter(|m| m.members_seq >= members_seq).map(|m| m.users.clone())
    }

    /// Hints the connected members of `moved.conv` on this node.
    pub async fn deliver(&self, moved: &ConvMoved) {
        let users = match self.cached(&moved.conv, moved.members_seq) {
            Some(users) => users,
            None => match self.store.active_members(&moved.conv).await {
                Ok((members_seq, users)) => {
                    let users = Arc::new(users.into_iter().collect::<HashSet<_>>());
                    let mut cache = self.cache.lock().expect("group cache lock");
                    if cache.len() >= GROUP_CACHE_MAX {
                        cache.clear();
                    }
                    cache.insert(moved.conv.clone(), Members { members_seq, users: users.clone() });
                    users
                }
                Err(e) => {
                    // The marker stays dirty; the members' next sync shows it.
                    tracing::warn!(conv = %moved.conv, error = %e, "group members not loaded; hint skipped");
                    return;
                }
            },
        };
        let n = self.hub.notify_conv(&users, &moved.conv, moved.target, moved.version);
        crate::metrics::HINTS_GROUP.add(n as u64);
    }
}
