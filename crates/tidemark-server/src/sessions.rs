//! Ended sessions, fenced in memory so no request of theirs runs: the
//! moments an operator logged a user or a device out (or a password change
//! logged the other devices out), and the deactivated accounts (the rule is
//! `tidemark_core::session::alive`). Loaded from the store at start,
//! updated by the admin endpoints and by [`crate::fence`] on every node of
//! a cluster: an end crosses the hint bus, and each node reloads the ends
//! from the store every `fence::FENCE_REFRESH_EVERY` as the bound when a bus
//! message is lost. The refresh tokens, deleted in the store, are refused
//! by every node at once.

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

    /// Ends the sessions of `device` (or of every device of `user`) issued
    /// up to `at_ms`; returns whether that moved the fence (false when an
    /// end as late was known).
    pub fn end(&self, user: &str, device: Option<&str>, at_ms: i64) -> bool {
        let mut users = self.users.write().expect("sessions lock");
        let u = users.entry(user.to_owned()).or_default();
        let end = match device {
            Some(d) => u.devices.entry(d.to_owned()).or_insert(0),
            None => &mut u.ended_at_ms,
        };
        let moved = at_ms > *end;
        *end = (*end).max(at_ms);
        moved
    }

    /// Returns whether the user was not known as deactivated yet.
    pub fn deactivate(&self, user: &str) -> bool {
        let mut users = self.users.write().expect("sessions lock");
        !std::mem::replace(&mut users.entry(user.to_owned()).or_default().deactivated, true)
    }

    pub fn is_deactivated(&self, user: &str) -> bool {
        self.users.read().expect("sessions lock").get(user).is_some_and(|u| u.deactivated)
    }

    /// Takes back a deactivation fenced before the store said there is no
    /// such user (so a user created later under the name is not fenced).
    pub fn undo_deactivate(&self, user: &str) {
        if let Some(u) = self.users.write().expect("sessions lock").get_mut(user) {
            u.deactivated = false;
        }
    }
}
