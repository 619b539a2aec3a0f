//! The failed-login policy (P1, seed §17.1 risk controls), pure.
//!
//! A password guesser is slowed by growing delays, never by a lockout an
//! attacker could impose on the real user: after `free_failures`
//! consecutive failures, the next attempt must wait `first_delay_ms`,
//! doubling with each further failure, up to `max_delay_ms`. A success
//! forgets the failures. The server keeps one such count per account and
//! source address (the guesser's own budget, with a long cap) and one per
//! account across addresses (a short cap: at worst the real user waits that
//! long once, and logs in).

/// How the delay after failed logins grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginBackoff {
    /// Consecutive failures allowed before any delay.
    pub free_failures: u32,
    /// The delay after the first failure past the free ones.
    pub first_delay_ms: u64,
    /// The delay never grows past this.
    pub max_delay_ms: u64,
}

impl LoginBackoff {
    /// The shortest wait, after `failures` consecutive failures, before the
    /// next attempt is heard (0: at once).
    pub fn delay_ms(&self, failures: u32) -> u64 {
        let Some(over) = failures.checked_sub(self.free_failures) else { return 0 };
        if over == 0 {
            return 0;
        }
        let doublings = (over - 1).min(63);
        self.first_delay_ms.saturating_mul(1u64 << doublings).min(self.max_delay_ms)
    }

    /// The wait still owed at `now_ms` by a key with `failures` consecutive
    /// failures, the last at `last_failure_ms`.
    pub fn wait_ms(&self, failures: u32, last_failure_ms: i64, now_ms: i64) -> u64 {
        let until = last_failure_ms.saturating_add(self.delay_ms(failures) as i64);
        (until - now_ms).max(0) as u64
    }
}

/// The queue a password check waits in for a hash (issue 15, seed §9.4).
///
/// Hashes are the login path's scarce resource (a named few run at once),
/// so an attacker with many addresses can fill their queue. Checks from an
/// address with no recent failed logins wait in the `Clean` lane; checks
/// from an address that failed `suspect_after` times or more within the
/// failure window wait in the `Suspect` lane, which may hold at most one
/// check in the hash queue at a time: an honest login waits behind the
/// hashes running, at most one suspect check and the clean checks before
/// it, however many addresses guess. A suspect check still runs when the
/// clean lane leaves room, so a person behind a guesser's NAT is slowed,
/// never locked out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashLane {
    Clean,
    Suspect,
}

/// Failed logins from one address within the failure window before its
/// password checks wait in the suspect lane. One: the lane costs nothing
/// while hashes are free, and `bench flood` (64 guessing addresses) showed
/// every free failure per address is a hash the guessers take ahead of
/// honest logins (12 s under the flood: 47 honest logins of 49 quiet with
/// one, 13 with three, 5 with no lane).
pub const SUSPECT_AFTER_FAILURES: u32 = 1;

/// The lane of a password check from an address with `recent_failures`
/// failed logins within the failure window.
pub fn hash_lane(recent_failures: u32, suspect_after: u32) -> HashLane {
    if recent_failures >= suspect_after.max(1) {
        HashLane::Suspect
    } else {
        HashLane::Clean
    }
}

/// Whether a user with `user_live` live WebSocket connections, `device_live`
/// of them by the connecting device, may open one more under the per-user
/// cap `max`. A device that is already connected may always reconnect:
/// the newer connection supersedes its older one (P2), so the user's count
/// does not grow, and a device whose old connection is half-open is not
/// locked out until the heartbeat ends it.
pub fn admits_connection(user_live: usize, device_live: usize, max: usize) -> bool {
    device_live > 0 || user_live < max
}

/// What the listener does with a TCP connection just accepted from an
/// address (its /64 for IPv6) that already holds `served` connections being
/// served (WebSockets included: a socket keeps its place through the
/// upgrade) and `answering` connections kept only to answer a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressConnection {
    /// Under the cap: served like any connection.
    Serve,
    /// Over the cap: its first request (an upgrade included) is answered
    /// `RATE_LIMITED` with `retry_after_ms` and the connection is closed, so
    /// a client that reads its replies learns when to come back.
    Refuse,
    /// Over the cap with the address's refusals already being answered:
    /// closed at once, before any task or buffer is spent on it.
    Close,
}

/// The rule for one more connection of an address: served while it holds
/// fewer than `max`; past that, at most `answered_max` at a time are read
/// only to be refused; the rest are closed at the accept. A flood of
/// connections from one address so costs the node at most `max` served
/// connections, `answered_max` refusals in progress and an accept and a
/// close per further attempt.
pub fn address_connection(served: usize, answering: usize, max: usize, answered_max: usize) -> AddressConnection {
    if served < max {
        AddressConnection::Serve
    } else if answering < answered_max {
        AddressConnection::Refuse
    } else {
        AddressConnection::Close
    }
}

/// Requests a connection may send while told to wait (`RATE_LIMITED`,
/// before its `retry_after_ms` passed) before the server closes it: a
/// client that obeys the wait never gets near it; one that ignores it
/// costs the node a refusal per request, which this bounds.
pub const IGNORED_WAITS_MAX: u32 = 100;

/// A connection's record of refusals it did not wait out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Strikes {
    /// Refusals in a row that arrived before the previous one's wait ended.
    pub ignored: u32,
    /// Until when the last refusal told the client to wait (ms).
    pub wait_until_ms: i64,
}

impl Strikes {
    /// Records a `RATE_LIMITED` answer at `now_ms` telling the client to
    /// wait `retry_after_ms`; returns whether the connection has now ignored
    /// more than `max` waits in a row and is to be closed. A request that
    /// arrives after the previous wait ended starts the count again.
    pub fn refused(&mut self, now_ms: i64, retry_after_ms: u64, max: u32) -> bool {
        self.ignored = if now_ms < self.wait_until_ms { self.ignored.saturating_add(1) } else { 0 };
        self.wait_until_ms = now_ms.saturating_add(retry_after_ms.min(i64::MAX as u64) as i64);
        self.ignored > max
    }
}

/// How long an address is refused at connect after its connections were
/// closed for ignoring their waits (`kicked` `waits_ignored`, issue 15).
///
/// A connection's [`Strikes`] start from nothing, so an attacker that
/// reconnects at once after each close would get a fresh count every time;
/// the address keeps a count of such closes instead. After the `n`-th close
/// in a row, every upgrade and HTTP request from the address is refused
/// with `RATE_LIMITED` for `first_ms`, doubling with each further close,
/// up to `max_ms`. A close more than `forget_after_ms` after the previous
/// one starts the count again. A client that waits as told is never closed,
/// so never meets it; a person behind the attacker's NAT waits the period
/// once per close, never longer than `max_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectPenalty {
    /// The refusal after the first close.
    pub first_ms: u64,
    /// The refusal never grows past this.
    pub max_ms: u64,
    /// Closes this far apart are not counted together.
    pub forget_after_ms: u64,
}

/// One second after the first close, doubling to five minutes; forgotten
/// after half an hour without a close.
pub const RECONNECT_PENALTY: ReconnectPenalty =
    ReconnectPenalty { first_ms: 1_000, max_ms: 5 * 60 * 1_000, forget_after_ms: 30 * 60 * 1_000 };

impl ReconnectPenalty {
    /// The refusal period after `closes` closes in a row (0: none).
    pub fn period_ms(&self, closes: u32) -> u64 {
        if closes == 0 {
            return 0;
        }
        let doublings = (closes - 1).min(63);
        self.first_ms.saturating_mul(1u64 << doublings).min(self.max_ms)
    }

    /// The count after one more close at `now_ms`, given `closes` so far,
    /// the last at `last_close_ms`.
    pub fn closes_after(&self, closes: u32, last_close_ms: i64, now_ms: i64) -> u32 {
        if self.forgotten(last_close_ms, now_ms) {
            1
        } else {
            closes.saturating_add(1)
        }
    }

    /// The refusal still owed at `now_ms` by an address with `closes`
    /// closes in a row, the last at `last_close_ms` (0: admit).
    pub fn wait_ms(&self, closes: u32, last_close_ms: i64, now_ms: i64) -> u64 {
        let until = last_close_ms.saturating_add(self.period_ms(closes).min(i64::MAX as u64) as i64);
        (until - now_ms).max(0) as u64
    }

    /// Whether a count whose last close was at `last_close_ms` is forgotten
    /// at `now_ms`.
    pub fn forgotten(&self, last_close_ms: i64, now_ms: i64) -> bool {
        now_ms.saturating_sub(last_close_ms) >= self.forget_after_ms.min(i64::MAX as u64) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_over_its_connection_cap_is_refused_then_closed_at_the_accept() {
        use AddressConnection::*;
        let cases: &[(usize, usize, usize, usize, AddressConnection)] = &[
            // served, answering, max, answered max, what
            (0, 0, 3, 2, Serve),
            (2, 0, 3, 2, Serve),
            (2, 2, 3, 2, Serve),
            (3, 0, 3, 2, Refuse),
            (3, 1, 3, 2, Refuse),
            (3, 2, 3, 2, Close),
            (9, 9, 3, 2, Close),
            (3, 0, 3, 0, Close),
            (0, 0, 0, 1, Refuse),
        ];
        for &(served, answering, max, answered_max, what) in cases {
            assert_eq!(
                address_connection(served, answering, max, answered_max),
                what,
                "{served} served, {answering} answering, cap {max}, answered at most {answered_max}"
            );
        }
    }

    #[test]
    fn a_connection_that_ignores_its_waits_is_closed_and_one_that_waits_never() {
        // (now, retry_after) refusals in order -> closed after the last?
        type Case<'a> = (&'a str, &'a [(i64, u64)], u32, bool);
        let cases: [Case; 5] = [
            ("one refusal", &[(0, 100)], 2, false),
            ("three inside the waits, max 2", &[(0, 100), (10, 100), (20, 100), (30, 100)], 2, true),
            ("two inside, max 2", &[(0, 100), (10, 100), (20, 100)], 2, false),
            ("each after the previous wait", &[(0, 100), (100, 100), (200, 100), (300, 100)], 0, false),
            ("a wait kept resets the count", &[(0, 100), (10, 100), (20, 100), (500, 100), (510, 100)], 2, false),
        ];
        for (what, refusals, max, expect) in cases {
            let mut s = Strikes::default();
            let mut closed = false;
            for &(now, wait) in refusals {
                closed = s.refused(now, wait, max);
            }
            assert_eq!(closed, expect, "{what}: {s:?}");
        }
    }

    #[test]
    fn a_user_connects_up_to_the_cap_and_a_connected_device_always_reconnects() {
        fn check(user_live: usize, device_live: usize, max: usize, expect: bool) {
            assert_eq!(
                admits_connection(user_live, device_live, max),
                expect,
                "{user_live} live, {device_live} of the device, cap {max}"
            );
        }
        check(0, 0, 3, true);
        check(2, 0, 3, true);
        check(3, 0, 3, false);
        check(4, 0, 3, false);
        check(3, 1, 3, true);
        check(0, 0, 0, false);
    }

    #[test]
    fn an_address_that_keeps_failing_waits_in_the_suspect_lane() {
        let cases: &[(u32, u32, HashLane)] = &[
            // recent failures, suspect after, lane
            (0, 3, HashLane::Clean),
            (2, 3, HashLane::Clean),
            (3, 3, HashLane::Suspect),
            (1_000, 3, HashLane::Suspect),
            (0, 0, HashLane::Clean),
            (1, 0, HashLane::Suspect),
        ];
        for &(failures, after, lane) in cases {
            assert_eq!(hash_lane(failures, after), lane, "{failures} failures, suspect after {after}");
        }
    }

    const POLICY: LoginBackoff = LoginBackoff { free_failures: 5, first_delay_ms: 1_000, max_delay_ms: 30_000 };

    fn check(failures: u32, expect_delay_ms: u64) {
        assert_eq!(POLICY.delay_ms(failures), expect_delay_ms, "delay after {failures} failures");
    }

    #[test]
    fn delays_start_after_the_free_failures_and_double_up_to_the_cap() {
        check(0, 0);
        check(4, 0);
        check(5, 0);
        check(6, 1_000);
        check(7, 2_000);
        check(8, 4_000);
        check(10, 16_000);
        check(11, 30_000);
        check(1_000, 30_000);
        check(u32::MAX, 30_000);
    }

    #[test]
    fn the_wait_runs_from_the_last_failure() {
        let cases: &[(u32, i64, i64, u64)] = &[
            // failures, last failure at, now, wait owed
            (6, 10_000, 10_000, 1_000),
            (6, 10_000, 10_400, 600),
            (6, 10_000, 11_000, 0),
            (6, 10_000, 99_000, 0),
            (3, 10_000, 10_000, 0),
            (11, 0, 29_999, 1),
        ];
        for &(failures, last, now, expect) in cases {
            assert_eq!(POLICY.wait_ms(failures, last, now), expect, "{failures} failures, last {last}, now {now}");
        }
    }
    const PENALTY: ReconnectPenalty = ReconnectPenalty { first_ms: 1_000, max_ms: 60_000, forget_after_ms: 600_000 };

    #[test]
    fn an_address_closed_for_ignored_waits_is_refused_for_a_period_that_doubles_up_to_the_cap() {
        let cases: &[(u32, u64)] = &[
            // closes in a row, period
            (0, 0),
            (1, 1_000),
            (2, 2_000),
            (3, 4_000),
            (6, 32_000),
            (7, 60_000),
            (1_000, 60_000),
            (u32::MAX, 60_000),
        ];
        for &(closes, period) in cases {
            assert_eq!(PENALTY.period_ms(closes), period, "period after {closes} closes");
        }
    }

    #[test]
    fn the_refusal_runs_from_the_last_close_and_a_quiet_address_is_forgotten() {
        let waits: &[(u32, i64, i64, u64)] = &[
            // closes, last close at, now, wait owed
            (1, 10_000, 10_000, 1_000),
            (1, 10_000, 10_999, 1),
            (1, 10_000, 11_000, 0),
            (3, 10_000, 12_500, 1_500),
            (0, 10_000, 10_000, 0),
            (7, 0, 70_000, 0),
        ];
        for &(closes, last, now, expect) in waits {
            assert_eq!(PENALTY.wait_ms(closes, last, now), expect, "{closes} closes, last {last}, now {now}");
        }
        let counts: &[(u32, i64, i64, u32)] = &[
            // closes so far, last close at, this close at, count after it
            (0, 0, 0, 1),
            (1, 10_000, 12_000, 2),
            (5, 10_000, 10_000 + 599_999, 6),
            (5, 10_000, 10_000 + 600_000, 1),
            (u32::MAX, 0, 1, u32::MAX),
        ];
        for &(closes, last, now, expect) in counts {
            assert_eq!(PENALTY.closes_after(closes, last, now), expect, "{closes} closes, last {last}, now {now}");
        }
    }
}
