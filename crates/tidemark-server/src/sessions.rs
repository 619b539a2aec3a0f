//! Ended sessions, fenced in memory so no request of theirs runs: the
//! moments an operator logged a user or a device out, and the deactivated
//! accounts (the rule is `tidemark_core::session::alive`). Loaded from the
//! store at start, updated by the admin endpoints. Like the revoked-device
//! fence, another node of a cluster learns of an end only at its restart
//! (until revocations cross the hint bus); the refresh tokens, deleted in
//! the store, are refused by every node at once.

use std::collections::HashMap;
use std::sync::RwLock;

use tidemark_core::session::{alive, Fence};
use tidemark_store::SessionFences;

#[derive(Debug, Default)]
struct UserEnds {
    deactivated: bool,
    ended_at_ms: i64,
    devices: HashMap<String, i64>,
}

/// Only users with an end or a deactivation have an entry.
#[derive(Debug, Default)]
pub struct Sessions {
    users: RwLock<HashMap<String, UserEnds>>,
}

impl Sessions {
    pub fn from_store(f: SessionFences) -> Sessions {
        let s = Sessions::default();
        for user in f.deactivated {
            s.deactivate(&user);
        }
        for (user, at) in f.users_ended {
            s.end(&user, None, at);
        }
        for (user, device, at) in f.devices_ended {
            s.end(&user, Some(&device), at);
        }
        s
    }

    /// Whether a token of `user`/`device` issued at `issued_at_ms` still
    /// opens a session.
    pub fn alive(&self, user: &str, device: &str, issued_at_ms: i64) -> bool {
        let users = self.users.read().expect("sessions lock");
        let Some(u) = users.get(user) else { return true };
        let fence = Fence {
            user_deactivated: u.deactivated,
            user_ended_at_ms: u.ended_at_ms,
            device_ended_at_ms: u.devices.get(device).copied().unwrap_or(0),
        };
        alive(issued_at_ms, fence)
    }

    pub fn end(&self, user: &str, device: Option<&str>, at_ms: i64) {
        let mut users = self.users.write().expect("sessions lock");
        let u = users.entry(user.to_owned()).or_default();
        match device {
            Some(d) => {
                let e = u.devices.entry(d.to_owned()).or_insert(0);
                *e = (*e).max(at_ms);
            }
            None => u.ended_at_ms = u.ended_at_ms.max(at_ms),
        }
    }

    pub fn deactivate(&self, user: &str) {
        self.users.write().expect("sessions lock").entry(user.to_owned()).or_default().deactivated = true;
    }

    /// Takes back a deactivation fenced before the store said there is no
    /// such user (so a user created later under the name is not fenced).
    pub fn undo_deactivate(&self, user: &str) {
        if let Some(u) = self.users.write().expect("sessions lock").get_mut(user) {
            u.deactivated = false;
        }
    }
}
