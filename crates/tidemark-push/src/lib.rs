//! Offline push providers (P4): one interface, three implementations.
//!
//! - [`webhook`]: a JSON POST to the operator's own HTTPS receiver, signed
//!   with HMAC-SHA256 so the receiver can verify where it came from;
//! - [`webpush`]: Web Push (RFC 8030) with the payload encrypted for the
//!   browser (RFC 8291, `aes128gcm`) and the sender identified by VAPID
//!   (RFC 8292), which browsers speak natively;
//! - [`gateway`]: the Matrix push gateway API (`/_matrix/push/v1/notify`)
//!   served by Sygnal, so APNs and FCM are reached through software built
//!   for them.
//!
//! A provider turns a [`PushPayload`] and a device's [`Target`] into one
//! HTTP request and classifies the answer ([`Outcome`]): accepted, token
//! rejected (the token must be removed), throttled (back off for the
//! provider's hint), or failed (retry within a bound). "Accepted" means the
//! provider took it, never that a device received it (seed §8.1).
//!
//! This crate decides nothing about who is pushed or when; it knows no
//! store. It never logs a payload or a token (only its hash).

use std::time::Duration;

use async_trait::async_trait;
use sha2::{Digest, Sha256};
pub use tidemark_proto::push::{PreviewLevel, PushPayload, PushPreview};

pub mod gateway;
pub mod seal;
pub mod webhook;
pub mod webpush;

/// Time allowed for one request to a provider.
pub const PROVIDER_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A throttled answer without a usable `Retry-After` waits this long.
pub const THROTTLED_RETRY_DEFAULT_MS: u64 = 30_000;
/// The longest `Retry-After` honoured (a larger one is cut to this).
pub const THROTTLED_RETRY_MAX_MS: u64 = 3_600_000;

/// Which provider a device registered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Platform {
    Webhook,
    WebPush,
    Gateway,
}

impl Platform {
    pub fn as_str(self) -> &'static str {
        match self {
            Platform::Webhook => "webhook",
            Platform::WebPush => "webpush",
            Platform::Gateway => "gateway",
        }
    }
}

/// A device's push registration, as a provider needs it.
#[derive(Clone, PartialEq, Eq)]
pub struct Target {
    pub platform: Platform,
    /// The provider's address of the device: a Web Push endpoint URL, a
    /// gateway push key (APNs/FCM token), or a webhook device token.
    pub token: String,
    /// The app the token belongs to (gateway `app_id`).
    pub app_id: String,
    /// Web Push only: the browser's `p256dh` public key and `auth` secret,
    /// base64url as the browser's `PushSubscription` gives them.
    pub p256dh: Option<String>,
    pub auth: Option<String>,
}

impl std::fmt::Debug for Target {
    // A provider token is sensitive (seed §17.3): only its hash is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("platform", &self.platform)
            .field("token_hash", &token_hash(&self.token))
            .field("app_id", &self.app_id)
            .finish_non_exhaustive()
    }
}

/// A short, stable hash of a token, for logs and metrics labels.
pub fn token_hash(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest[..6].iter().map(|b| format!("{b:02x}")).collect()
}

/// What a provider said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The provider took the notification (not: the device has it).
    Accepted,
    /// The token is dead (expired, unsubscribed, unknown): remove it.
    TokenRejected,
    /// Slow down: retry no sooner than this.
    Throttled { retry_after_ms: u64 },
    /// Anything else; `retryable` says whether a later try may succeed.
    Failed { retryable: bool, reason: String },
}

impl Outcome {
    /// The label used in metrics (`tidemark_push_results_total{result}`).
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::TokenRejected => "token_rejected",
            Outcome::Throttled { .. } => "throttled",
            Outcome::Failed { retryable: true, .. } => "failed_retryable",
            Outcome::Failed { retryable: false, .. } => "failed",
        }
    }
}

/// One way of reaching devices.
#[async_trait]
pub trait Provider: Send + Sync {
    fn platform(&self) -> Platform;
    /// Sends one notification to one device and classifies the answer.
    async fn deliver(&self, target: &Target, payload: &PushPayload) -> Outcome;
}

/// The classification shared by providers that answer with plain HTTP
/// statuses (webhook, Web Push): 2xx accepted; 404 and 410 the token is
/// gone; 429 (and 503 with `Retry-After`) throttled; 413 and other 4xx
/// will not succeed on retry; 5xx and transport errors may.
pub fn classify_status(status: u16, retry_after: Option<&str>) -> Outcome {
    match status {
        200..=299 => Outcome::Accepted,
        404 | 410 => Outcome::TokenRejected,
        429 => Outcome::Throttled { retry_after_ms: retry_after_ms(retry_after) },
        503 if retry_after.is_some() => Outcome::Throttled { retry_after_ms: retry_after_ms(retry_after) },
        400..=499 => Outcome::Failed { retryable: false, reason: format!("provider answered {status}") },
        _ => Outcome::Failed { retryable: true, reason: format!("provider answered {status}") },
    }
}

/// `Retry-After` in delta-seconds (HTTP dates are not honoured: a provider
/// that sends one gets the default wait), bounded.
fn retry_after_ms(header: Option<&str>) -> u64 {
    header
        .and_then(|h| h.trim().parse::<u64>().ok())
        .map(|s| s.saturating_mul(1000))
        .unwrap_or(THROTTLED_RETRY_DEFAULT_MS)
        .min(THROTTLED_RETRY_MAX_MS)
}

/// A provider's HTTP answer, classified; transport errors are retryable.
pub(crate) async fn classify_response(result: reqwest::Result<reqwest::Response>) -> Outcome {
    match result {
        Ok(response) => {
            let retry_after =
                response.headers().get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).map(str::to_owned);
            classify_status(response.status().as_u16(), retry_after.as_deref())
        }
        Err(e) => Outcome::Failed { retryable: true, reason: format!("transport: {}", e.without_url()) },
    }
}

pub(crate) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(PROVIDER_REQUEST_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("a client with the default rustls configuration builds")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(status: u16, retry_after: Option<&str>, expect: Outcome) {
        assert_eq!(classify_status(status, retry_after), expect, "{status} {retry_after:?}");
    }

    #[test]
    fn provider_answers_are_classified() {
        check(200, None, Outcome::Accepted);
        check(201, None, Outcome::Accepted);
        check(404, None, Outcome::TokenRejected);
        check(410, None, Outcome::TokenRejected);
        check(429, Some("7"), Outcome::Throttled { retry_after_ms: 7_000 });
        check(429, None, Outcome::Throttled { retry_after_ms: THROTTLED_RETRY_DEFAULT_MS });
        check(
            429,
            Some("Wed, 21 Oct 2015 07:28:00 GMT"),
            Outcome::Throttled { retry_after_ms: THROTTLED_RETRY_DEFAULT_MS },
        );
        check(429, Some("999999999"), Outcome::Throttled { retry_after_ms: THROTTLED_RETRY_MAX_MS });
        check(503, Some("2"), Outcome::Throttled { retry_after_ms: 2_000 });
        check(503, None, Outcome::Failed { retryable: true, reason: "provider answered 503".into() });
        check(500, None, Outcome::Failed { retryable: true, reason: "provider answered 500".into() });
        check(413, None, Outcome::Failed { retryable: false, reason: "provider answered 413".into() });
        check(400, None, Outcome::Failed { retryable: false, reason: "provider answered 400".into() });
    }

    #[test]
    fn a_target_never_shows_its_token() {
        let t = Target {
            platform: Platform::Gateway,
            token: "secret-apns-token".into(),
            app_id: "app".into(),
            p256dh: None,
            auth: None,
        };
        let shown = format!("{t:?}");
        assert!(!shown.contains("secret-apns-token"), "{shown}");
        assert!(shown.contains(&token_hash("secret-apns-token")));
    }
}
