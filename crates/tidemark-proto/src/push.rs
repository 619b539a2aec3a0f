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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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

impl PreviewLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            PreviewLevel::None => "none",
            PreviewLevel::Conversation => "conversation",
            PreviewLevel::Full => "full",
        }
    }

    pub fn parse(s: &str) -> Option<PreviewLevel> {
        [PreviewLevel::None, PreviewLevel::Conversation, PreviewLevel::Full].into_iter().find(|l| l.as_str() == s)
    }
}

/// The domain's name of the same level (`tidemark_core::push::Preview`).
impl From<PreviewLevel> for tidemark_core::push::Preview {
    fn from(l: PreviewLevel) -> tidemark_core::push::Preview {
        use tidemark_core::push::Preview;
        match l {
            PreviewLevel::None => Preview::None,
            PreviewLevel::Conversation => Preview::Conversation,
            PreviewLevel::Full => Preview::Full,
        }
    }
}

impl From<tidemark_core::push::Preview> for PreviewLevel {
    fn from(p: tidemark_core::push::Preview) -> PreviewLevel {
        use tidemark_core::push::Preview;
        match p {
            Preview::None => PreviewLevel::None,
            Preview::Conversation => PreviewLevel::Conversation,
            Preview::Full => PreviewLevel::Full,
        }
    }
}

/// The providers a push target names (`push.register`'s `platform`).
pub mod platform {
    /// The operator's signed HTTPS webhook.
    pub const WEBHOOK: &str = "webhook";
    /// Web Push (RFC 8030/8291/8292): `token` is the subscription endpoint.
    pub const WEBPUSH: &str = "webpush";
    /// A Matrix push gateway (Sygnal): `token` is the APNs/FCM push key.
    pub const GATEWAY: &str = "gateway";
    pub const ALL: &[&str] = &[WEBHOOK, WEBPUSH, GATEWAY];
}

/// Longest `token` (a Web Push endpoint URL, an APNs/FCM token), in bytes.
pub const PUSH_TOKEN_BYTES_MAX: usize = 2_048;
/// Longest `app_id`, in bytes.
pub const PUSH_APP_ID_BYTES_MAX: usize = 128;
/// Longest `p256dh` or `auth` (base64url), in bytes.
pub const PUSH_KEY_BYTES_MAX: usize = 128;

/// `push.register`: set (or replace) the calling device's push target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PushRegisterReq {
    /// `webhook`, `webpush` or `gateway` ([`platform`]).
    pub platform: String,
    /// The provider's address of the device; never shown again in full.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 2048))]
    pub token: String,
    /// The app the token belongs to (the gateway's `app_id`).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(max_length = 128))]
    pub app_id: String,
    /// Web Push only: the subscription's keys, base64url.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(max_length = 128))]
    pub p256dh: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(max_length = 128))]
    pub auth: Option<String>,
    /// What a notification may say (default `none`).
    #[serde(default)]
    pub preview: PreviewLevel,
}

impl PushRegisterReq {
    /// The shape checks of the contract (bounds, the platform's fields).
    pub fn check(&self) -> Result<(), String> {
        if !platform::ALL.contains(&self.platform.as_str()) {
            return Err(format!("platform must be one of {:?}", platform::ALL));
        }
        if self.token.is_empty() || self.token.len() > PUSH_TOKEN_BYTES_MAX {
            return Err(format!("token must be 1 to {PUSH_TOKEN_BYTES_MAX} bytes"));
        }
        if self.token.chars().any(char::is_control) {
            return Err("token holds a control character".into());
        }
        if self.app_id.len() > PUSH_APP_ID_BYTES_MAX || self.app_id.chars().any(char::is_control) {
            return Err(format!("app_id must be at most {PUSH_APP_ID_BYTES_MAX} bytes, no control characters"));
        }
        let key_ok = |k: &Option<String>| {
            k.as_deref().is_some_and(|k| {
                !k.is_empty()
                    && k.len() <= PUSH_KEY_BYTES_MAX
                    && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'=')
            })
        };
        if self.platform == platform::WEBPUSH {
            if !(self.token.starts_with("https://") || self.token.starts_with("http://")) {
                return Err("a webpush token is the subscription's endpoint URL".into());
            }
            if !key_ok(&self.p256dh) || !key_ok(&self.auth) {
                return Err(format!("webpush needs p256dh and auth, base64url, at most {PUSH_KEY_BYTES_MAX} bytes"));
            }
        } else if self.p256dh.is_some() || self.auth.is_some() {
            return Err("p256dh and auth belong to webpush only".into());
        }
        Ok(())
    }
}

/// A device's push target as shown back: never the token, only a hash of
/// it and its last four characters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PushTargetInfo {
    pub device_id: String,
    pub platform: String,
    /// A short SHA-256 of the token (hex), as logs show it.
    pub token_hash: String,
    pub token_last4: String,
    pub app_id: String,
    pub preview: PreviewLevel,
    /// Milliseconds since the epoch.
    pub created_at: i64,
    pub updated_at: i64,
    /// True for the device that asked.
    pub current: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PushRegisterOk {
    pub target: PushTargetInfo,
    /// False when the device had a target, now replaced.
    pub created: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PushListOk {
    pub targets: Vec<PushTargetInfo>,
}

/// `push.remove`: the calling device's target, or another of the caller's
/// devices'.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PushRemoveReq {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::openapi::device_id))]
    pub device_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PushRemoveOk {
    pub device_id: String,
    /// False when the device had no target.
    pub removed: bool,
}

/// The text a preview shows of a stored message's content: its `text`
/// field when it is a string, else nothing.
pub fn preview_text(content: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(content).ok()?;
    v.get("text")?.as_str().map(str::to_owned)
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
