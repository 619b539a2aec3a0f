//! What an offline push carries to a provider (P4, seed §9.3, §17.3).
//!
//! A push is a wake-up, never a copy of the log: the device that wakes
//! syncs from its cursor. By default the payload says only that there is
//! something new and how many events; the conversation id and a preview
//! travel only when the user's preference allows them. "Accepted" by a
//! provider is not delivery (seed §8.1): nothing here is called delivered.

use serde::{Deserialize, Serialize};

/// Version of [`PushPayload`]; receivers ignore fields they do not know.
pub const PUSH_PAYLOAD_VERSION: u32 = 1;
/// Largest preview text, in bytes (cut at a character boundary).
pub const PUSH_PREVIEW_BYTES_MAX: usize = 200;
/// Largest encoded payload: Web Push services need accept no more than
/// 4096 bytes of ciphertext (RFC 8030 §7.2), which leaves this much JSON.
pub const PUSH_PAYLOAD_BYTES_MAX: usize = 3_000;

/// How much a notification may say, from least to most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PreviewLevel {
    /// "Something new": a count and nothing else (the default).
    #[default]
    None,
    /// Also which conversation.
    Conversation,
    /// Also who sent it and the start of its text.
    Full,
}

/// The sender and the start of the newest message, when allowed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushPreview {
    pub sender: String,
    pub text: String,
}

/// The JSON a webhook receives, and the plaintext of a Web Push message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushPayload {
    pub v: u32,
    /// Stable per notification: a retried delivery carries the same id, so
    /// a receiver can drop the repeat.
    pub notification_id: String,
    /// Events coalesced into this notification.
    pub count: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview: Option<PushPreview>,
}

impl PushPayload {
    /// A payload saying no more than `level` allows.
    pub fn new(
        notification_id: String,
        count: u32,
        level: PreviewLevel,
        conv: &str,
        preview: Option<PushPreview>,
    ) -> PushPayload {
        PushPayload {
            v: PUSH_PAYLOAD_VERSION,
            notification_id,
            count,
            conv: (level >= PreviewLevel::Conversation).then(|| conv.to_owned()),
            preview: preview
                .filter(|_| level >= PreviewLevel::Full)
                .map(|p| PushPreview { text: cut(&p.text, PUSH_PREVIEW_BYTES_MAX).to_owned(), sender: p.sender }),
        }
    }
}

/// The longest prefix of `s` of at most `max` bytes ending on a character.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(level: PreviewLevel, expect: serde_json::Value) {
        let preview = Some(PushPreview { sender: "ann".into(), text: "lunch at 1?".into() });
        let p = PushPayload::new("n1".into(), 3, level, "c1", preview);
        assert_eq!(serde_json::to_value(&p).unwrap(), expect, "{level:?}");
    }

    #[test]
    fn a_payload_says_no_more_than_its_level() {
        check(PreviewLevel::None, serde_json::json!({"v": 1, "notification_id": "n1", "count": 3}));
        check(
            PreviewLevel::Conversation,
            serde_json::json!({"v": 1, "notification_id": "n1", "count": 3, "conv": "c1"}),
        );
        check(
            PreviewLevel::Full,
            serde_json::json!({"v": 1, "notification_id": "n1", "count": 3, "conv": "c1",
                               "preview": {"sender": "ann", "text": "lunch at 1?"}}),
        );
    }

    #[test]
    fn previews_are_cut_on_a_character_boundary() {
        let text = "é".repeat(PUSH_PREVIEW_BYTES_MAX);
        let preview = Some(PushPreview { sender: "ann".into(), text });
        let p = PushPayload::new("n".into(), 1, PreviewLevel::Full, "c", preview);
        let cut = p.preview.unwrap().text;
        assert!(cut.len() <= PUSH_PREVIEW_BYTES_MAX && cut.len() >= PUSH_PREVIEW_BYTES_MAX - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
