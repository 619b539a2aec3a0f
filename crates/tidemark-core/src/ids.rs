//! Validation of identifiers that come from outside (user names, device ids,
//! client message ids). Bounds are named so every layer agrees on them.

// The bounds are part of the wire contract: `tidemark-proto` re-exports
// them, so the server, the SDK and the OpenAPI document use these values.
/// Longest user name, in bytes.
pub const USER_BYTES_MAX: usize = 64;
/// Longest device id, in bytes.
pub const DEVICE_ID_BYTES_MAX: usize = 128;
/// Longest `client_msg_id`, in bytes.
pub const CLIENT_MSG_ID_BYTES_MAX: usize = 128;
/// Longest message `kind`, in bytes.
pub const KIND_BYTES_MAX: usize = 32;

fn is_id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '@')
}

fn check(what: &str, s: &str, max: usize) -> Result<(), String> {
    if s.is_empty() || s.len() > max {
        return Err(format!("{what} must be 1..={max} bytes"));
    }
    if !s.chars().all(is_id_char) {
        return Err(format!("{what} may contain only ASCII letters, digits and _ - . @"));
    }
    Ok(())
}

pub fn check_user(s: &str) -> Result<(), String> {
    check("user", s, USER_BYTES_MAX)
}

/// The one form of a user name, which is the account's id: a valid name
/// with its ASCII letters lower-cased (every allowed character is ASCII,
/// so this is the whole case folding). Every name that comes from outside
/// (account creation, login, the users a request names) is folded first,
/// so `Alice` and `alice` are one account.
pub fn canonical_user(s: &str) -> Result<String, String> {
    check_user(s)?;
    Ok(s.to_ascii_lowercase())
}

/// The accounts a name from outside may mean, in the order to look them
/// up: its one form, then (only when it differs) the name exactly as
/// written, which is a *legacy* account's id: accounts created before
/// names were folded keep the name they were created with and log in by
/// it, exactly as written. The exact form is taken only when no account
/// has the folded name, so a legacy `Alice` never shadows an `alice`.
/// New accounts always get the folded form ([`canonical_user`]).
pub fn user_lookups(s: &str) -> Result<(String, Option<String>), String> {
    let folded = canonical_user(s)?;
    let legacy = (folded != s).then(|| s.to_owned());
    Ok((folded, legacy))
}

/// Which account a name means, given whether an account exists under its
/// one form and under the exact legacy form ([`user_lookups`]).
pub fn resolve_user(folded: String, legacy: Option<String>, folded_exists: bool, legacy_exists: bool) -> String {
    match legacy {
        Some(exact) if !folded_exists && legacy_exists => exact,
        _ => folded,
    }
}

pub fn check_device_id(s: &str) -> Result<(), String> {
    check("device_id", s, DEVICE_ID_BYTES_MAX)
}

pub fn check_client_msg_id(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > CLIENT_MSG_ID_BYTES_MAX || s.chars().any(char::is_control) {
        return Err(format!("client_msg_id must be 1..={CLIENT_MSG_ID_BYTES_MAX} bytes without control characters"));
    }
    Ok(())
}

pub fn check_kind(s: &str) -> Result<(), String> {
    check("kind", s, KIND_BYTES_MAX)
}

/// The key that maps a direct pair to its single conversation, whatever the
/// order in which the two users are named.
pub fn direct_key(a: &str, b: &str) -> String {
    if a <= b {
        format!("{a}|{b}")
    } else {
        format!("{b}|{a}")
    }
}

/// Bits of a message id's clock part: milliseconds since the Unix epoch,
/// modulo 2^48 (wraps in the year 10889).
pub const MESSAGE_ID_CLOCK_BITS: u32 = 48;

/// A new message id (also the id of a conversation event: member change,
/// recall, edit, reaction): `m`, then the creation time in milliseconds as
/// 12 hex digits ([`MESSAGE_ID_CLOCK_BITS`]), then 80 random bits as 20 hex
/// digits. Ids minted later sort after earlier ones (to the millisecond of
/// the minting node's clock), so the indexes keyed by a message id (the
/// message's key, each user log's idempotency key) grow at their right
/// edge: a group commit dirties a few pages there instead of one random
/// leaf page per message and per recipient (issue 19). Uniqueness rests on
/// the 80 random bits, as it did when the id was those bits alone; clients
/// treat the id as opaque (docs/protocol.md §1).
pub fn message_id(now_ms: i64, random: [u8; 10]) -> String {
    use std::fmt::Write;
    let clock = (now_ms.max(0) as u64) & ((1u64 << MESSAGE_ID_CLOCK_BITS) - 1);
    let mut s = String::with_capacity(1 + 12 + 20);
    s.push('m');
    let _ = write!(s, "{clock:012x}");
    for b in random {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names_fold_to_one_form() {
        fn check(input: &str, expect: Result<&str, ()>) {
            assert_eq!(canonical_user(input).map_err(|_| ()), expect.map(str::to_owned), "{input:?}");
        }
        check("alice", Ok("alice"));
        check("Alice", Ok("alice"));
        check("ALICE", Ok("alice"));
        check("Bob.Smith@Example-1_x", Ok("bob.smith@example-1_x"));
        check("", Err(()));
        check("Al ice", Err(()));
        check("\u{212a}elvin", Err(())); // the Kelvin sign is not a K: not ASCII, refused
        check(&"A".repeat(USER_BYTES_MAX), Ok(&"a".repeat(USER_BYTES_MAX)));
        check(&"A".repeat(USER_BYTES_MAX + 1), Err(()));
    }

    #[test]
    fn a_legacy_name_is_looked_up_exactly_and_only_when_the_folded_one_is_missing() {
        assert_eq!(user_lookups("alice"), Ok(("alice".into(), None)), "a folded name needs one lookup");
        assert_eq!(user_lookups("Alice"), Ok(("alice".into(), Some("Alice".into()))));
        assert!(user_lookups("Al ice").is_err());
        // (folded exists, legacy exists) -> the account meant
        let table = [
            ((false, false), "alice"), // nobody: the folded form (a new account, or an unknown name)
            ((true, false), "alice"),
            ((true, true), "alice"),  // both (created before folding): the folded one wins
            ((false, true), "Alice"), // only the legacy account
        ];
        for ((folded, legacy), expect) in table {
            let got = resolve_user("alice".into(), Some("Alice".into()), folded, legacy);
            assert_eq!(got, expect, "folded {folded}, legacy {legacy}");
        }
        assert_eq!(resolve_user("bob".into(), None, false, true), "bob", "no legacy form, no legacy account");
    }

    #[test]
    fn message_ids_sort_by_their_minting_time() {
        // (now_ms, random) -> id
        let table: [(i64, [u8; 10], &str); 5] = [
            (0, [0; 10], "m00000000000000000000000000000000"),
            (1_764_000_000_000, [0xab; 10], "m019ab697e800abababababababababab"),
            (1_764_000_000_001, [0; 10], "m019ab697e80100000000000000000000"),
            (-5, [1; 10], "m00000000000001010101010101010101"), // a clock before 1970 counts as 0
            ((1i64 << 48) + 7, [0; 10], "m00000000000700000000000000000000"), // wraps after 2^48 ms
        ];
        for (now, random, expect) in table {
            assert_eq!(message_id(now, random), expect, "{now}");
        }
        // Later (by a millisecond) sorts after, whatever the random part.
        let (a, b) = (message_id(1_764_000_000_000, [0xff; 10]), message_id(1_764_000_000_001, [0; 10]));
        assert!(a < b, "{a} < {b}");
        assert_eq!(a.len(), 33);
        assert!(a.len() <= 64, "within the wire's id bound");
    }

    #[test]
    fn ids() {
        assert!(check_user("alice").is_ok());
        assert!(check_user("").is_err());
        assert!(check_user("a|b").is_err());
        assert!(check_user(&"x".repeat(65)).is_err());
        assert!(check_device_id("phone-1").is_ok());
        assert!(check_client_msg_id("m 1").is_ok());
        assert!(check_client_msg_id("m\n1").is_err());
        assert_eq!(direct_key("b", "a"), direct_key("a", "b"));
    }
}
