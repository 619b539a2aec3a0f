//! Offline push (P4): who is pushed, what is coalesced, what expired, and
//! what a provider's answer does next. Pure: the backends read the facts
//! (the device's position, the events of its user's log above it, each with
//! its sender and the user's `muted` setting), the server asks the
//! provider, and both write what these functions decided.
//!
//! A device owes a push for the events of its user's committed sync log
//! above `max(acked, pushed_through)`: the log already holds only what the
//! user may see (membership periods, F4), so nothing outside a period is
//! ever pushed. An event counts when it is a message (`kinds::EVENT_MESSAGE`)
//! from someone else in a conversation the user has not muted (a message
//! that mentions the user, by name or everyone, overrides the mute, issue
//! 18), and is not older than the expiry. The counting events of one device coalesce into
//! one notification, sent once the oldest of them waited the window; a
//! device with a live connection is not pushed (it has the hint and ACKs).
//!
//! What a notification may say ([`Preview`]) is set in three places: the
//! device's level (registered with its target), the user's own preference
//! and the user's preference for the conversation. The most private of the
//! three wins ([`effective_preview`]): a preference can only narrow what the
//! others allow. The user's and the conversation's preferences default to
//! [`Preview::Full`], which narrows nothing.

use crate::kinds;

/// Events folded together into one notification wait at most this long.
pub const PUSH_WINDOW_MS_DEFAULT: i64 = 2_000;
/// An event older than this (since its fan-out committed) is not pushed.
pub const PUSH_EXPIRY_MS_DEFAULT: i64 = 6 * 60 * 60 * 1000;
/// Events of one device read per decision; a larger backlog is pushed in
/// several notifications, each bounded.
pub const PUSH_EVENTS_SCAN_MAX: u32 = 256;
/// The first retry after a retryable failure waits this long, doubling.
pub const PUSH_BACKOFF_BASE_MS: i64 = 1_000;
/// The longest wait between retries (throttling hints included).
pub const PUSH_BACKOFF_MAX_MS: i64 = 5 * 60 * 1000;
/// Retryable failures in a row after which a notification is given up.
pub const PUSH_ATTEMPTS_MAX: u32 = 6;

/// How much a notification may say, from least to most (the wire's
/// `tidemark_proto::push::PreviewLevel`, whose names these are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Preview {
    /// A count and nothing else.
    None,
    /// Also which conversation.
    Conversation,
    /// Also who sent the newest message and the start of its text.
    Full,
}

impl Preview {
    pub const ALL: [Preview; 3] = [Preview::None, Preview::Conversation, Preview::Full];
    /// A device's level when it registers none: the most private.
    pub const DEVICE_DEFAULT: Preview = Preview::None;
    /// A user's and a conversation's preference when never set: it narrows
    /// nothing, so the device's level alone decides.
    pub const PREFERENCE_DEFAULT: Preview = Preview::Full;

    pub fn as_str(self) -> &'static str {
        match self {
            Preview::None => "none",
            Preview::Conversation => "conversation",
            Preview::Full => "full",
        }
    }

    pub fn parse(s: &str) -> Option<Preview> {
        Preview::ALL.into_iter().find(|l| l.as_str() == s)
    }
}

/// What one notification may say: the most private of the device's level,
/// the user's preference and the user's preference for the conversation
/// the notification names (its newest counting message's).
pub fn effective_preview(device: Preview, user: Preview, conv: Preview) -> Preview {
    device.min(user).min(conv)
}

/// The knobs of the rules, from the server's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushPolicy {
    pub window_ms: i64,
    pub expiry_ms: i64,
    pub backoff_base_ms: i64,
    pub backoff_max_ms: i64,
    pub attempts_max: u32,
}

impl Default for PushPolicy {
    fn default() -> PushPolicy {
        PushPolicy {
            window_ms: PUSH_WINDOW_MS_DEFAULT,
            expiry_ms: PUSH_EXPIRY_MS_DEFAULT,
            backoff_base_ms: PUSH_BACKOFF_BASE_MS,
            backoff_max_ms: PUSH_BACKOFF_MAX_MS,
            attempts_max: PUSH_ATTEMPTS_MAX,
        }
    }
}

/// One event of the user's log above the device's position, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwedEvent {
    pub sync_seq: u64,
    /// The user-log kind (`kinds::EVENT_*`).
    pub kind: String,
    pub conv: String,
    /// The message's sender, for conversation events.
    pub sender: Option<String>,
    /// The user's `muted` setting of `conv` when read.
    pub muted: bool,
    /// The message mentions the user (`mention::counts`): pushed even
    /// when muted.
    pub mentioned: bool,
    /// The user's preview preference for `conv` when read.
    pub preview: Preview,
    /// When the fan-out that wrote it committed.
    pub created_at_ms: i64,
}

/// Why an event of the range is not pushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotCounted {
    /// Not a message (a read, a setting, a membership change, …).
    Kind,
    /// The user's own message (from any of their devices).
    Own,
    /// The conversation is muted and the message does not mention the user.
    Muted,
    /// Older than the expiry.
    Expired,
}

/// Whether `e` counts for `user` at `now_ms`, and why not.
pub fn counts(user: &str, e: &OwedEvent, now_ms: i64, policy: &PushPolicy) -> Result<(), NotCounted> {
    if e.kind != kinds::EVENT_MESSAGE {
        return Err(NotCounted::Kind);
    }
    if e.sender.as_deref() == Some(user) {
        return Err(NotCounted::Own);
    }
    if e.muted && !e.mentioned {
        return Err(NotCounted::Muted);
    }
    if now_ms - e.created_at_ms > policy.expiry_ms {
        return Err(NotCounted::Expired);
    }
    Ok(())
}

/// The facts of one device's owed range.
#[derive(Debug, Clone, Copy)]
pub struct PushFacts<'a> {
    pub user: &'a str,
    /// The events above `max(acked, pushed_through)`, ascending, at most
    /// [`PUSH_EVENTS_SCAN_MAX`].
    pub events: &'a [OwedEvent],
    /// The device has a live connection (it gets hints and ACKs).
    pub connected: bool,
    /// The device's registered level and the user's own preference.
    pub device_preview: Preview,
    pub user_preview: Preview,
    pub now_ms: i64,
}

/// What to do with a device's owed range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushDecision {
    /// Nothing to push: the position moves to `through` (every event up to
    /// it is settled); `expired` counting events were too old.
    Skip { through: u64, expired: u32 },
    /// Look again at `at_ms` (the window is still open, or the device is
    /// connected); the position does not move.
    Wait { at_ms: i64 },
    /// One notification for `count` events through `through`; `conv` and
    /// `newest` are the newest counting event's conversation and position
    /// (the preview's source); `first_at_ms` when the oldest was committed;
    /// `preview` what the notification may say ([`effective_preview`]).
    Send { through: u64, count: u32, conv: String, newest: u64, first_at_ms: i64, expired: u32, preview: Preview },
}

/// Decides one device's owed range (P4).
pub fn decide(facts: PushFacts<'_>, policy: &PushPolicy) -> PushDecision {
    let Some(last) = facts.events.last() else {
        return PushDecision::Skip { through: 0, expired: 0 };
    };
    if facts.connected {
        return PushDecision::Wait { at_ms: facts.now_ms + policy.window_ms };
    }
    let mut expired = 0;
    let mut counting = facts.events.iter().filter(|e| match counts(facts.user, e, facts.now_ms, policy) {
        Ok(()) => true,
        Err(NotCounted::Expired) => {
            expired += 1;
            false
        }
        Err(_) => false,
    });
    let Some(first) = counting.next() else {
        return PushDecision::Skip { through: last.sync_seq, expired };
    };
    let (mut count, mut newest) = (1u32, first);
    for e in counting {
        count += 1;
        newest = e;
    }
    let due = first.created_at_ms + policy.window_ms;
    if facts.now_ms < due {
        return PushDecision::Wait { at_ms: due };
    }
    PushDecision::Send {
        through: last.sync_seq,
        count,
        conv: newest.conv.clone(),
        newest: newest.sync_seq,
        first_at_ms: first.created_at_ms,
        expired,
        preview: effective_preview(facts.device_preview, facts.user_preview, newest.preview),
    }
}

/// A provider's answer, as the rules need it (the providers' own type
/// lives in `tidemark-push`, which the core does not know).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderAnswer {
    Accepted,
    TokenRejected,
    Throttled { retry_after_ms: u64 },
    Failed { retryable: bool },
}

/// What a provider's answer does to the device's push state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterAnswer {
    /// Settled (accepted, or given up): the position moves to `through`,
    /// the failure count resets.
    Advance { through: u64, gave_up: bool },
    /// Try the same range again no sooner than `at_ms`, with `attempts`
    /// failures on record; the position does not move.
    Retry { at_ms: i64, attempts: u32 },
    /// The token is dead: remove the target.
    Remove,
}

/// The rule after a provider answered for a range through `through`, the
/// device having `attempts` retryable failures in a row before this one.
pub fn after_answer(answer: ProviderAnswer, through: u64, attempts: u32, now_ms: i64, p: &PushPolicy) -> AfterAnswer {
    match answer {
        ProviderAnswer::Accepted => AfterAnswer::Advance { through, gave_up: false },
        ProviderAnswer::TokenRejected => AfterAnswer::Remove,
        // Throttling is the provider's pace, not a failure of this
        // notification: it is not counted, and the expiry bounds it.
        ProviderAnswer::Throttled { retry_after_ms } => AfterAnswer::Retry {
            at_ms: now_ms + (retry_after_ms.min(i64::MAX as u64) as i64).clamp(0, p.backoff_max_ms),
            attempts,
        },
        ProviderAnswer::Failed { retryable: false } => AfterAnswer::Advance { through, gave_up: true },
        ProviderAnswer::Failed { retryable: true } if attempts + 1 >= p.attempts_max => {
            AfterAnswer::Advance { through, gave_up: true }
        }
        ProviderAnswer::Failed { retryable: true } => {
            AfterAnswer::Retry { at_ms: now_ms + backoff_ms(attempts, p), attempts: attempts + 1 }
        }
    }
}

/// The wait after the `attempts`+1-th failure in a row: base · 2^attempts,
/// capped.
pub fn backoff_ms(attempts: u32, p: &PushPolicy) -> i64 {
    p.backoff_base_ms.saturating_mul(1i64 << attempts.min(30)).min(p.backoff_max_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_000_000;

    fn ev(seq: u64, kind: &str, sender: &str, muted: bool, age_ms: i64) -> OwedEvent {
        OwedEvent {
            sync_seq: seq,
            kind: kind.into(),
            conv: format!("c{seq}"),
            sender: (!sender.is_empty()).then(|| sender.into()),
            muted,
            mentioned: false,
            preview: Preview::PREFERENCE_DEFAULT,
            created_at_ms: NOW - age_ms,
        }
    }

    fn facts(events: &[OwedEvent], connected: bool) -> PushFacts<'_> {
        PushFacts {
            user: "bob",
            events,
            connected,
            device_preview: Preview::Full,
            user_preview: Preview::PREFERENCE_DEFAULT,
            now_ms: NOW,
        }
    }

    fn check(events: &[OwedEvent], connected: bool, expect: PushDecision) {
        let p = PushPolicy::default();
        let got = decide(facts(events, connected), &p);
        assert_eq!(got, expect, "{events:?} connected={connected}");
    }

    #[test]
    fn who_is_pushed_and_what_coalesces() {
        let m = kinds::EVENT_MESSAGE;
        let w = PUSH_WINDOW_MS_DEFAULT;
        // Nothing owed.
        check(&[], false, PushDecision::Skip { through: 0, expired: 0 });
        // A burst from others, the window elapsed: one notification, a count.
        let burst = [ev(4, m, "ann", false, w + 50), ev(5, m, "ann", false, w), ev(6, m, "cy", false, 10)];
        let send = PushDecision::Send {
            through: 6,
            count: 3,
            conv: "c6".into(),
            newest: 6,
            first_at_ms: NOW - w - 50,
            expired: 0,
            preview: Preview::Full,
        };
        check(&burst, false, send);
        // A connected device is not pushed: it has the hint.
        check(&burst, true, PushDecision::Wait { at_ms: NOW + w });
        // The window is still open: wait for its end (the oldest + window).
        check(
            &[ev(4, m, "ann", false, 10), ev(5, m, "ann", false, 5)],
            false,
            PushDecision::Wait { at_ms: NOW - 10 + w },
        );
        // The user's own messages (sent from another device) never count.
        check(&[ev(4, m, "bob", false, w + 1)], false, PushDecision::Skip { through: 4, expired: 0 });
        // Muted conversations never count; neither do non-messages.
        check(&[ev(4, m, "ann", true, w + 1)], false, PushDecision::Skip { through: 4, expired: 0 });
        // A mention overrides the mute (issue 18).
        let mention = OwedEvent { mentioned: true, ..ev(4, m, "ann", true, w + 1) };
        assert_eq!(counts("bob", &mention, NOW, &PushPolicy::default()), Ok(()));
        check(
            &[mention],
            false,
            PushDecision::Send {
                through: 4,
                count: 1,
                conv: "c4".into(),
                newest: 4,
                first_at_ms: NOW - w - 1,
                expired: 0,
                preview: Preview::Full,
            },
        );
        check(
            &[ev(4, kinds::EVENT_READ, "", false, w + 1), ev(5, kinds::EVENT_MEMBERSHIP, "ann", false, w + 1)],
            false,
            PushDecision::Skip { through: 5, expired: 0 },
        );
        // Mixed: only the counting ones are counted, the range settles whole.
        let mixed = [ev(4, m, "bob", false, w + 9), ev(5, m, "ann", false, w + 5), ev(6, m, "ann", true, 1)];
        let send = PushDecision::Send {
            through: 6,
            count: 1,
            conv: "c5".into(),
            newest: 5,
            first_at_ms: NOW - w - 5,
            expired: 0,
            preview: Preview::Full,
        };
        check(&mixed, false, send);
        // Expired events are not pushed and are counted as expired.
        let old = PUSH_EXPIRY_MS_DEFAULT + 1;
        check(&[ev(4, m, "ann", false, old)], false, PushDecision::Skip { through: 4, expired: 1 });
        let send = PushDecision::Send {
            through: 5,
            count: 1,
            conv: "c5".into(),
            newest: 5,
            first_at_ms: NOW - w,
            expired: 1,
            preview: Preview::Full,
        };
        check(&[ev(4, m, "ann", false, old), ev(5, m, "ann", false, w)], false, send);
    }

    #[test]
    fn the_most_private_preview_wins() {
        use Preview::*;
        // (device, user, conversation) → what the notification may say.
        let table = [
            ((Full, Full, Full), Full),
            ((Full, Full, Conversation), Conversation),
            ((Full, Full, None), None),
            ((Full, Conversation, Full), Conversation),
            ((Full, None, Full), None),
            ((Conversation, Full, Full), Conversation),
            ((None, Full, Full), None),
            ((Conversation, Full, None), None),
            ((Full, Conversation, None), None),
            ((None, None, None), None),
        ];
        for ((device, user, conv), expect) in table {
            assert_eq!(effective_preview(device, user, conv), expect, "{device:?} {user:?} {conv:?}");
        }
        // Never set, the preferences leave the device's level alone.
        for device in Preview::ALL {
            let got = effective_preview(device, Preview::PREFERENCE_DEFAULT, Preview::PREFERENCE_DEFAULT);
            assert_eq!(got, device);
        }
        for l in Preview::ALL {
            assert_eq!(Preview::parse(l.as_str()), Some(l));
        }
        assert_eq!(Preview::parse("FULL"), Option::None);
    }

    #[test]
    fn a_notification_says_what_its_newest_conversation_allows() {
        let m = kinds::EVENT_MESSAGE;
        let w = PUSH_WINDOW_MS_DEFAULT;
        let p = PushPolicy::default();
        let mut quiet = ev(5, m, "ann", false, w);
        quiet.preview = Preview::None;
        let open = ev(4, m, "ann", false, w + 1);
        let preview_of = |events: &[OwedEvent], device: Preview, user: Preview| {
            let f = PushFacts { device_preview: device, user_preview: user, ..facts(events, false) };
            match decide(f, &p) {
                PushDecision::Send { preview, .. } => preview,
                other => panic!("expected a send, got {other:?}"),
            }
        };
        // The newest counting message is in the quiet conversation.
        assert_eq!(preview_of(&[open.clone(), quiet.clone()], Preview::Full, Preview::Full), Preview::None);
        // The newest is in an open one: the device and the user decide.
        assert_eq!(preview_of(&[quiet.clone(), open.clone()], Preview::Full, Preview::Full), Preview::Full);
        assert_eq!(
            preview_of(&[quiet.clone(), open.clone()], Preview::Full, Preview::Conversation),
            Preview::Conversation
        );
        assert_eq!(preview_of(&[quiet, open], Preview::Conversation, Preview::Full), Preview::Conversation);
    }

    fn after(answer: ProviderAnswer, attempts: u32, expect: AfterAnswer) {
        let p = PushPolicy::default();
        assert_eq!(after_answer(answer, 9, attempts, NOW, &p), expect, "{answer:?} after {attempts}");
    }

    #[test]
    fn provider_answers_move_the_state() {
        use AfterAnswer::*;
        use ProviderAnswer::*;
        after(Accepted, 3, Advance { through: 9, gave_up: false });
        after(TokenRejected, 0, Remove);
        after(Throttled { retry_after_ms: 7_000 }, 2, Retry { at_ms: NOW + 7_000, attempts: 2 });
        after(Throttled { retry_after_ms: u64::MAX }, 0, Retry { at_ms: NOW + PUSH_BACKOFF_MAX_MS, attempts: 0 });
        after(Failed { retryable: true }, 0, Retry { at_ms: NOW + PUSH_BACKOFF_BASE_MS, attempts: 1 });
        after(Failed { retryable: true }, 2, Retry { at_ms: NOW + 4 * PUSH_BACKOFF_BASE_MS, attempts: 3 });
        after(Failed { retryable: true }, PUSH_ATTEMPTS_MAX - 1, Advance { through: 9, gave_up: true });
        after(Failed { retryable: false }, 0, Advance { through: 9, gave_up: true });
        let p = PushPolicy::default();
        assert_eq!(backoff_ms(40, &p), PUSH_BACKOFF_MAX_MS);
    }
}
