//! The rules of the ephemeral lane and of receipts shown to others (issue
//! 18): typing and presence, which never enter a sync log, and the read and
//! delivery positions other members may see.
//!
//! Typing says "user U is typing in conversation C" for at most a bounded
//! time; presence says whether a user is online, idle or offline. Both are
//! hints for the app's view: losing one costs nothing but what is shown.
//! What decides who sees them, when a change is worth a frame (coalescing)
//! and when one expires is here; the server's `ephemeral` module keeps the
//! live state and delivers. Read receipts to others are the members' `read_seq`
//! (R2) minus the members who made theirs private; delivery receipts (R1)
//! are shown to the sender of a message in a direct conversation only.

use crate::kinds::CONV_DIRECT;
use crate::push::Preview;
use crate::{MsgSeq, Refusal};

/// `typing.timeout_ms` when the request names none.
pub const TYPING_TIMEOUT_DEFAULT_MS: u64 = 5_000;
/// The shortest typing a request may ask for.
pub const TYPING_TIMEOUT_MIN_MS: u64 = 100;
/// The longest typing the server keeps without a renewal (the server-side
/// bound; a longer request is cut to it).
pub const TYPING_TIMEOUT_MAX_MS: u64 = 30_000;
/// A renewed "typing" within this long of the last one forwarded is not
/// forwarded again, unless it would expire before the renewal's end
/// (receivers already show it).
pub const TYPING_RENEW_MIN_MS: u64 = 1_000;
/// Users whose presence one change reaches at most (the users sharing a
/// current conversation with the subject, sorted; beyond it they learn it
/// on their own next connection).
pub const PRESENCE_AUDIENCE_MAX: u32 = 10_000;
/// Entries one `presence.batch` frame carries at most (a whole audience:
/// the answer to a new connection fits one frame unless its bytes do not).
pub const PRESENCE_BATCH_ENTRIES_MAX: usize = PRESENCE_AUDIENCE_MAX as usize;
/// Members one `conv.receipts` reply lists at most.
pub const RECEIPTS_MEMBERS_MAX: usize = 1_000;

/// The timeout a typing start gets: the request's, or the default, within
/// [`TYPING_TIMEOUT_MIN_MS`]..=`max_ms`.
pub fn typing_timeout(requested_ms: Option<u64>, max_ms: u64) -> u64 {
    let max = max_ms.max(TYPING_TIMEOUT_MIN_MS);
    requested_ms.unwrap_or(TYPING_TIMEOUT_DEFAULT_MS).clamp(TYPING_TIMEOUT_MIN_MS, max)
}

/// Who a typing signal of `sender` in a conversation goes to: the other
/// current members. `members` is `None` when there is no such
/// conversation; a sender without an open period may not type there.
pub fn typing_recipients(conv: &str, members: Option<&[String]>, sender: &str) -> Result<Vec<String>, Refusal> {
    let members = members.ok_or_else(|| Refusal::NotFound(format!("conversation {conv}")))?;
    if !members.iter().any(|m| m == sender) {
        return Err(Refusal::NotMember);
    }
    Ok(members.iter().filter(|m| *m != sender).cloned().collect())
}

/// A typing signal the server holds for one `(conversation, user)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Typing {
    /// When the last "typing" was forwarded to the receivers.
    pub forwarded_at_ms: i64,
    /// When receivers stop showing it (the server sends a stop then).
    pub expires_at_ms: i64,
}

/// What one typing request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypingStep {
    /// The entry held afterwards (`None`: not typing).
    pub held: Option<Typing>,
    /// Whether receivers get a frame for this request.
    pub forward: bool,
}

/// A typing start (`start`) or stop at `now_ms`, given the entry held
/// (`live`, already expired ones count as none). A start is forwarded when
/// nothing was live, or the last forward is [`TYPING_RENEW_MIN_MS`] old, or
/// it ends later than what receivers hold by more than that; a stop is
/// forwarded only when something was live (a stop after an expiry says
/// nothing new).
pub fn typing_step(live: Option<Typing>, start: bool, now_ms: i64, timeout_ms: u64) -> TypingStep {
    let live = live.filter(|t| t.expires_at_ms > now_ms);
    if !start {
        return TypingStep { held: None, forward: live.is_some() };
    }
    let expires_at_ms = now_ms + timeout_ms as i64;
    let renew = TYPING_RENEW_MIN_MS as i64;
    match live {
        Some(t) if now_ms - t.forwarded_at_ms < renew && expires_at_ms - t.expires_at_ms < renew => {
            TypingStep { held: Some(Typing { expires_at_ms: t.expires_at_ms.max(expires_at_ms), ..t }), forward: false }
        }
        _ => TypingStep { held: Some(Typing { forwarded_at_ms: now_ms, expires_at_ms }), forward: true },
    }
}

/// A user's presence, as shown to others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Presence {
    Offline,
    Idle,
    Online,
}

impl Presence {
    pub fn as_str(self) -> &'static str {
        match self {
            Presence::Offline => "offline",
            Presence::Idle => "idle",
            Presence::Online => "online",
        }
    }

    pub fn parse(s: &str) -> Option<Presence> {
        match s {
            "offline" => Some(Presence::Offline),
            "idle" => Some(Presence::Idle),
            "online" => Some(Presence::Online),
            _ => None,
        }
    }
}

/// The presence others see: the most present of the user's connected
/// devices (online over idle), offline with none, and always offline for a
/// user who hides it.
pub fn effective_presence(devices: impl IntoIterator<Item = Presence>, hidden: bool) -> Presence {
    if hidden {
        return Presence::Offline;
    }
    devices.into_iter().max().unwrap_or(Presence::Offline)
}

/// Coalescing: a presence frame goes out only when the effective state
/// differs from the one last announced (`None`: nothing announced since
/// the user connected, which others hold as offline). Heartbeats that
/// repeat the state, and a second device joining an online user, say
/// nothing.
pub fn presence_changed(announced: Option<Presence>, now: Presence) -> bool {
    announced.unwrap_or(Presence::Offline) != now
}

/// Reads of a user's presence facts (privacy switch, audience) one
/// announcement makes at most, the first included, while the store answers
/// a temporary failure (a read pool exhausted by a resume storm on
/// PostgreSQL): without them a connect whose facts could not be read was
/// never announced, and a close never said offline.
pub const PRESENCE_READ_ATTEMPTS_MAX: u32 = 6;
/// The wait before the first read again; doubled after each failure.
pub const PRESENCE_READ_RETRY_BASE_MS: u64 = 250;
/// The longest wait between two reads.
pub const PRESENCE_READ_RETRY_MAX_MS: u64 = 4_000;

/// After the `failed`-th failed read of an announcement's facts in a row
/// (1 after the first): how long to wait before reading again, or `None`
/// to give up, when the failure is not `temporary` or
/// [`PRESENCE_READ_ATTEMPTS_MAX`] reads were made. The waits double from
/// [`PRESENCE_READ_RETRY_BASE_MS`] up to [`PRESENCE_READ_RETRY_MAX_MS`]
/// (250, 500, 1 000, 2 000, 4 000 ms: 7.75 s in all, plus the reads' own
/// waits).
pub fn presence_read_retry(failed: u32, temporary: bool) -> Option<u64> {
    if !temporary || failed == 0 || failed >= PRESENCE_READ_ATTEMPTS_MAX {
        return None;
    }
    Some(PRESENCE_READ_RETRY_BASE_MS.saturating_mul(1 << (failed - 1).min(32)).min(PRESENCE_READ_RETRY_MAX_MS))
}

/// Whether a connection's waiting presence entries go out as one
/// `presence.batch` frame (per wake of its writer) rather than one
/// `presence` frame each: only on a connection that opted in (old clients
/// are unchanged), and only when more than one entry waits (a lone entry
/// is the single frame, the same bytes every receiver shares).
pub fn presence_batched(opted_in: bool, entries: usize) -> bool {
    opted_in && entries > 1
}

/// Splits presence entries, in order, into `presence.batch` frames: each
/// frame holds at most `entries_max` entries and its JSON text at most
/// `bytes_max` bytes, counted as `overhead` (the frame's own text around
/// the list) plus each entry's `entry_bytes` plus one comma between two
/// entries. An entry that alone is over the bound goes alone (nothing is
/// dropped here; entries are bounded where they are built). Returns the
/// ranges of `entry_bytes` each frame takes, covering it without gaps.
pub fn presence_batches(
    entry_bytes: &[usize],
    overhead: usize,
    bytes_max: usize,
    entries_max: usize,
) -> Vec<std::ops::Range<usize>> {
    let entries_max = entries_max.max(1);
    let mut frames = Vec::new();
    let (mut start, mut bytes) = (0, overhead);
    for (i, &len) in entry_bytes.iter().enumerate() {
        let comma = usize::from(i > start);
        if i > start && (i - start >= entries_max || bytes + comma + len > bytes_max) {
            frames.push(start..i);
            (start, bytes) = (i, overhead + len);
        } else {
            bytes += comma + len;
        }
    }
    if start < entry_bytes.len() {
        frames.push(start..entry_bytes.len());
    }
    frames
}

/// A user's privacy switches (durable, per user).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Privacy {
    /// Others see this user as offline, and no presence frame of theirs
    /// goes out.
    pub hide_presence: bool,
    /// Others do not see this user's read position (`conv.receipts`); the
    /// user's own devices still sync it (R2).
    pub private_receipts: bool,
    /// The user's own offline push preview preference (P4): it narrows
    /// what every device and conversation allows (`push::effective_preview`).
    pub push_preview: Preview,
}

impl Default for Privacy {
    /// A user who never set a switch: everything shown, and the push
    /// preview left to the devices and conversations.
    fn default() -> Privacy {
        Privacy { hide_presence: false, private_receipts: false, push_preview: Preview::PREFERENCE_DEFAULT }
    }
}

/// One update of the switches: `None` keeps one as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrivacyUpdate {
    pub hide_presence: Option<bool>,
    pub private_receipts: Option<bool>,
    pub push_preview: Option<Preview>,
}

/// The switches after an update; `None` when nothing changes (nothing is
/// written).
pub fn privacy_after(now: Privacy, u: PrivacyUpdate) -> Option<Privacy> {
    let next = Privacy {
        hide_presence: u.hide_presence.unwrap_or(now.hide_presence),
        private_receipts: u.private_receipts.unwrap_or(now.private_receipts),
        push_preview: u.push_preview.unwrap_or(now.push_preview),
    };
    (next != now).then_some(next)
}

/// The idempotency key of a `privacy` user event: one per version of the
/// switches (`user_privacy.version`, moved by each change; a no-op set
/// writes nothing).
pub fn privacy_event_id(version: u64) -> String {
    format!("privacy:{version}")
}

/// A current member's read position, as a backend reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberRead {
    pub user: String,
    pub read_seq: MsgSeq,
    pub private_receipts: bool,
}

/// What `conv.receipts` shows the caller.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Receipts {
    /// `(user, read_seq)` of the members shown, by user.
    pub members: Vec<(String, MsgSeq)>,
    /// Current members whose receipts are private (not listed).
    pub hidden: u64,
    /// With `at`: how many of the members shown, the caller excluded, have
    /// read `at`.
    pub read_count: Option<u64>,
    /// More members were shown than one reply lists.
    pub truncated: bool,
}

/// R2 to others: the read positions of a conversation's current members
/// (`members`, an open period each; a removed or departed member is not
/// among them) as `caller` may see them. The caller must be a current
/// member; members with private receipts are counted, not listed (the
/// caller always sees their own). `exists` is whether the conversation
/// exists.
pub fn visible_receipts(
    conv: &str,
    exists: bool,
    caller: &str,
    mut members: Vec<MemberRead>,
    at: Option<MsgSeq>,
) -> Result<Receipts, Refusal> {
    if !members.iter().any(|m| m.user == caller) {
        return Err(if exists { Refusal::NotMember } else { Refusal::NotFound(format!("conversation {conv}")) });
    }
    members.sort_by(|a, b| a.user.cmp(&b.user));
    let (shown, hidden): (Vec<_>, Vec<_>) = members.into_iter().partition(|m| m.user == caller || !m.private_receipts);
    let read_count = at.map(|at| shown.iter().filter(|m| m.user != caller && m.read_seq >= at).count() as u64);
    let truncated = shown.len() > RECEIPTS_MEMBERS_MAX;
    let members = shown.into_iter().take(RECEIPTS_MEMBERS_MAX).map(|m| (m.user, m.read_seq)).collect();
    Ok(Receipts { members, hidden: hidden.len() as u64, read_count, truncated })
}

/// The facts `delivery.receipts` is decided on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryFacts<'a> {
    /// The conversation's kind; `None` when it does not exist.
    pub kind: Option<&'a str>,
    /// Whether the caller ever had a period in it.
    pub caller_member: bool,
    /// Each asked id and the sender of the conversation event it names
    /// (`None`: no message with that id in this conversation).
    pub senders: &'a [(String, Option<String>)],
}

/// R1 to the sender: delivery receipts are read back for direct
/// conversations only, by the caller for their own messages only.
pub fn check_delivery_receipts(conv: &str, caller: &str, facts: &DeliveryFacts<'_>) -> Result<(), Refusal> {
    let Some(kind) = facts.kind else {
        return Err(Refusal::NotFound(format!("conversation {conv}")));
    };
    if !facts.caller_member {
        return Err(Refusal::NotMember);
    }
    if kind != CONV_DIRECT {
        return Err(Refusal::Forbidden("delivery receipts are shown for direct conversations only".into()));
    }
    for (id, sender) in facts.senders {
        match sender {
            None => return Err(Refusal::NotFound(format!("message {id}"))),
            Some(s) if s != caller => {
                return Err(Refusal::Forbidden(format!("only the sender reads the delivery of {id}")))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presence_reads_are_retried_with_doubling_waits_only_while_temporary() {
        let cases: &[(u32, bool, Option<u64>)] = &[
            (0, true, None),
            (1, true, Some(250)),
            (2, true, Some(500)),
            (3, true, Some(1_000)),
            (4, true, Some(2_000)),
            (5, true, Some(4_000)),
            (6, true, None),
            (40, true, None),
            (1, false, None),
            (3, false, None),
        ];
        for &(failed, temporary, expect) in cases {
            assert_eq!(presence_read_retry(failed, temporary), expect, "failed {failed}, temporary {temporary}");
        }
        let total: u64 = (1..PRESENCE_READ_ATTEMPTS_MAX).filter_map(|n| presence_read_retry(n, true)).sum();
        assert_eq!(total, 7_750, "the waits the doc comment states");
    }

    #[test]
    fn typing_timeouts_are_bounded() {
        fn check(input: (Option<u64>, u64), expect: u64) {
            assert_eq!(typing_timeout(input.0, input.1), expect, "{input:?}");
        }
        check((None, TYPING_TIMEOUT_MAX_MS), TYPING_TIMEOUT_DEFAULT_MS);
        check((Some(1), TYPING_TIMEOUT_MAX_MS), TYPING_TIMEOUT_MIN_MS);
        check((Some(u64::MAX), TYPING_TIMEOUT_MAX_MS), TYPING_TIMEOUT_MAX_MS);
        check((Some(2_000), 1_000), 1_000);
        check((Some(2_000), 0), TYPING_TIMEOUT_MIN_MS);
    }

    #[test]
    fn typing_goes_to_the_other_current_members() {
        fn check(input: (Option<&[&str]>, &str), expect: Result<Vec<&str>, Refusal>) {
            let members: Option<Vec<String>> = input.0.map(|m| m.iter().map(|s| s.to_string()).collect());
            let got = typing_recipients("c1", members.as_deref(), input.1);
            let expect = expect.map(|v| v.into_iter().map(String::from).collect::<Vec<_>>());
            assert_eq!(got, expect, "{input:?}");
        }
        check((Some(&["a", "b", "c"]), "b"), Ok(vec!["a", "c"]));
        check((Some(&["a"]), "a"), Ok(vec![]));
        check((Some(&["a", "c"]), "b"), Err(Refusal::NotMember));
        check((None, "b"), Err(Refusal::NotFound("conversation c1".into())));
    }

    #[test]
    fn typing_renewals_coalesce_and_stops_follow_a_live_start() {
        fn check(input: (Option<Typing>, bool, i64, u64), expect: TypingStep) {
            assert_eq!(typing_step(input.0, input.1, input.2, input.3), expect, "{input:?}");
        }
        let held = |f, e| Some(Typing { forwarded_at_ms: f, expires_at_ms: e });
        check((None, true, 100, 5_000), TypingStep { held: held(100, 5_100), forward: true });
        // A renewal 500 ms later: receivers already show it; the end moves.
        check((held(100, 5_100), true, 600, 5_000), TypingStep { held: held(100, 5_600), forward: false });
        // A second later it is forwarded again.
        check((held(100, 5_100), true, 1_100, 5_000), TypingStep { held: held(1_100, 6_100), forward: true });
        // A renewal asking for much longer is forwarded at once.
        check((held(100, 5_100), true, 200, 30_000), TypingStep { held: held(200, 30_200), forward: true });
        // After the expiry a start is new again.
        check((held(100, 5_100), true, 5_100, 5_000), TypingStep { held: held(5_100, 10_100), forward: true });
        check((held(100, 5_100), false, 200, 5_000), TypingStep { held: None, forward: true });
        check((held(100, 5_100), false, 5_200, 5_000), TypingStep { held: None, forward: false });
        check((None, false, 200, 5_000), TypingStep { held: None, forward: false });
    }

    #[test]
    fn presence_is_the_most_present_device_and_changes_alone_are_announced() {
        use Presence::*;
        fn check(input: (&[Presence], bool), expect: Presence) {
            assert_eq!(effective_presence(input.0.iter().copied(), input.1), expect, "{input:?}");
        }
        check((&[], false), Offline);
        check((&[Idle], false), Idle);
        check((&[Idle, Online, Idle], false), Online);
        check((&[Online], true), Offline);
        assert!(presence_changed(None, Online));
        assert!(!presence_changed(None, Offline), "never announced is offline already");
        assert!(!presence_changed(Some(Online), Online), "a heartbeat says nothing");
        assert!(presence_changed(Some(Online), Idle));
        assert!(presence_changed(Some(Idle), Offline));
        for p in [Offline, Idle, Online] {
            assert_eq!(Presence::parse(p.as_str()), Some(p));
        }
        assert_eq!(Presence::parse("away"), None);
    }

    #[test]
    fn presence_is_batched_only_when_opted_in_and_more_than_one_waits() {
        fn check(input: (bool, usize), expect: bool) {
            assert_eq!(presence_batched(input.0, input.1), expect, "{input:?}");
        }
        check((false, 0), false);
        check((false, 99), false);
        check((true, 0), false);
        check((true, 1), false);
        check((true, 2), true);
        check((true, PRESENCE_BATCH_ENTRIES_MAX + 1), true);
    }

    #[test]
    fn presence_batches_split_by_entries_and_bytes() {
        /// `expect`: each frame's entries as `(start, end)`.
        fn check(input: (&[usize], usize, usize, usize), expect: &[(usize, usize)]) {
            let got: Vec<(usize, usize)> =
                presence_batches(input.0, input.1, input.2, input.3).into_iter().map(|r| (r.start, r.end)).collect();
            assert_eq!(got, expect, "{input:?}");
        }
        check((&[], 10, 100, 5), &[]);
        check((&[5], 10, 100, 5), &[(0, 1)]);
        // 10 + 5 + 1 + 5 = 21 fits 21 exactly; one more byte does not.
        check((&[5, 5], 10, 21, 5), &[(0, 2)]);
        check((&[5, 5], 10, 20, 5), &[(0, 1), (1, 2)]);
        check((&[5, 5, 5, 5, 5], 10, 1000, 2), &[(0, 2), (2, 4), (4, 5)]);
        // An entry over the bound alone still goes, alone.
        check((&[3, 50, 3], 10, 20, 5), &[(0, 1), (1, 2), (2, 3)]);
        check((&[4, 4, 4, 4], 0, 9, 5), &[(0, 2), (2, 4)]);
        // A bound of no entries still moves one entry a frame.
        check((&[4, 4, 4], 0, 100, 0), &[(0, 1), (1, 2), (2, 3)]);
        // Every entry is covered once, in order, and every frame within
        // the bounds unless it is one entry.
        let lens: Vec<usize> = (0..PRESENCE_BATCH_ENTRIES_MAX * 2 + 7).map(|i| 30 + i % 40).collect();
        let frames = presence_batches(&lens, 40, 64 * 1024, PRESENCE_BATCH_ENTRIES_MAX);
        let mut next = 0;
        for f in &frames {
            assert_eq!(f.start, next);
            next = f.end;
            let bytes = 40 + lens[f.clone()].iter().sum::<usize>() + f.len() - 1;
            assert!(f.len() <= PRESENCE_BATCH_ENTRIES_MAX && bytes <= 64 * 1024, "{f:?}: {bytes}");
        }
        assert_eq!(next, lens.len());
    }

    #[test]
    fn privacy_updates_write_only_changes() {
        let off = Privacy::default();
        let hidden = Privacy { hide_presence: true, ..off };
        let u = |hide_presence, private_receipts, push_preview| PrivacyUpdate {
            hide_presence,
            private_receipts,
            push_preview,
        };
        assert_eq!(privacy_after(off, u(Some(true), None, None)), Some(hidden));
        assert_eq!(privacy_after(hidden, u(Some(true), Some(false), Some(Preview::Full))), None);
        assert_eq!(
            privacy_after(hidden, u(None, Some(true), None)),
            Some(Privacy { hide_presence: true, private_receipts: true, push_preview: Preview::Full })
        );
        assert_eq!(
            privacy_after(off, u(None, None, Some(Preview::None))),
            Some(Privacy { push_preview: Preview::None, ..off })
        );
        assert_eq!(privacy_after(off, u(None, None, None)), None);
    }

    #[test]
    fn receipts_show_members_minus_private_ones() {
        fn m(user: &str, read_seq: MsgSeq, private_receipts: bool) -> MemberRead {
            MemberRead { user: user.into(), read_seq, private_receipts }
        }
        fn check(input: (bool, &str, Vec<MemberRead>, Option<MsgSeq>), expect: Result<Receipts, Refusal>) {
            let got = visible_receipts("c1", input.0, input.1, input.2.clone(), input.3);
            assert_eq!(got, expect, "{input:?}");
        }
        let shown = |v: &[(&str, MsgSeq)]| v.iter().map(|(u, s)| (u.to_string(), *s)).collect::<Vec<_>>();
        check(
            (true, "a", vec![m("c", 3, false), m("a", 1, true), m("b", 5, true)], Some(3)),
            Ok(Receipts { members: shown(&[("a", 1), ("c", 3)]), hidden: 1, read_count: Some(1), truncated: false }),
        );
        check(
            (true, "b", vec![m("a", 4, false), m("b", 5, false)], None),
            Ok(Receipts { members: shown(&[("a", 4), ("b", 5)]), hidden: 0, read_count: None, truncated: false }),
        );
        check((true, "x", vec![m("a", 4, false)], None), Err(Refusal::NotMember));
        check((false, "x", vec![], None), Err(Refusal::NotFound("conversation c1".into())));
        let many: Vec<MemberRead> = (0..RECEIPTS_MEMBERS_MAX + 1).map(|i| m(&format!("u{i:05}"), 1, false)).collect();
        let got = visible_receipts("c1", true, "u00000", many, Some(1)).unwrap();
        assert!(got.truncated && got.members.len() == RECEIPTS_MEMBERS_MAX);
        assert_eq!(got.read_count, Some(RECEIPTS_MEMBERS_MAX as u64), "counts cover every member shown");
    }

    #[test]
    fn delivery_receipts_are_the_senders_in_direct_conversations() {
        type Input<'a> = (Option<&'a str>, bool, &'a [(&'a str, Option<&'a str>)]);
        fn check(input: Input<'_>, expect: Result<(), Refusal>) {
            let senders: Vec<(String, Option<String>)> =
                input.2.iter().map(|(i, s)| (i.to_string(), s.map(String::from))).collect();
            let facts = DeliveryFacts { kind: input.0, caller_member: input.1, senders: &senders };
            assert_eq!(check_delivery_receipts("c1", "a", &facts), expect, "{input:?}");
        }
        let group = crate::kinds::CONV_GROUP;
        check((Some(CONV_DIRECT), true, &[("m1", Some("a")), ("m2", Some("a"))]), Ok(()));
        check((Some(CONV_DIRECT), true, &[]), Ok(()));
        check((None, false, &[]), Err(Refusal::NotFound("conversation c1".into())));
        check((Some(CONV_DIRECT), false, &[("m1", Some("b"))]), Err(Refusal::NotMember));
        check(
            (Some(group), true, &[("m1", Some("a"))]),
            Err(Refusal::Forbidden("delivery receipts are shown for direct conversations only".into())),
        );
        check(
            (Some(CONV_DIRECT), true, &[("m1", Some("a")), ("m2", Some("b"))]),
            Err(Refusal::Forbidden("only the sender reads the delivery of m2".into())),
        );
        check((Some(CONV_DIRECT), true, &[("m3", None)]), Err(Refusal::NotFound("message m3".into())));
    }
}
