//! The signed webhook: a JSON POST of the [`PushPayload`] to the operator's
//! receiver, which forwards it to wherever its devices listen.
//!
//! The request carries `Tidemark-Signature: t=<unix ms>,v1=<hex>` where the
//! hex is HMAC-SHA256 under the shared secret of `"<t>." + body`, and the
//! device's token in `Tidemark-Push-Token`. A receiver checks the MAC and
//! that `t` is recent ([`verify_signature`]), which defeats forgery and
//! replay of an old request.

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::{classify_response, http_client, Outcome, Platform, Provider, PushPayload, Target};

/// Header carrying the timestamp and MAC.
pub const SIGNATURE_HEADER: &str = "tidemark-signature";
/// Header carrying the device's token at the receiver.
pub const TOKEN_HEADER: &str = "tidemark-push-token";
/// A receiver should refuse signatures older (or newer) than this.
pub const SIGNATURE_TOLERANCE_MS: i64 = 5 * 60 * 1000;

type HmacSha256 = Hmac<Sha256>;

pub struct Webhook {
    url: String,
    secret: Vec<u8>,
    client: reqwest::Client,
}

impl Webhook {
    /// A provider posting to `url`, signing with `secret`.
    pub fn new(url: impl Into<String>, secret: impl Into<Vec<u8>>) -> Webhook {
        Webhook { url: url.into(), secret: secret.into(), client: http_client() }
    }
}

/// The signature header's value for `body` at `t_ms`.
pub fn sign(secret: &[u8], t_ms: i64, body: &[u8]) -> String {
    format!("t={t_ms},v1={}", hex(&mac(secret, t_ms, body)))
}

fn mac(secret: &[u8], t_ms: i64, body: &[u8]) -> Vec<u8> {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(t_ms.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.finalize().into_bytes().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Why a receiver refuses a signature.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("malformed signature header")]
    Malformed,
    #[error("signature timestamp outside the tolerance")]
    Stale,
    #[error("signature does not match")]
    Mismatch,
}

/// Checks a signature header as a receiver must: well formed, recent, and
/// the MAC matches (compared in constant time).
pub fn verify_signature(secret: &[u8], header: &str, body: &[u8], now_ms: i64) -> Result<(), SignatureError> {
    let mut t = None;
    let mut v1 = None;
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", value)) => t = value.parse::<i64>().ok(),
            Some(("v1", value)) => v1 = Some(value),
            _ => {}
        }
    }
    let (Some(t), Some(v1)) = (t, v1) else { return Err(SignatureError::Malformed) };
    if (now_ms - t).abs() > SIGNATURE_TOLERANCE_MS {
        return Err(SignatureError::Stale);
    }
    let given = (0..v1.len())
        .step_by(2)
        .map(|i| v1.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect::<Option<Vec<u8>>>()
        .ok_or(SignatureError::Malformed)?;
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.verify_slice(&given).map_err(|_| SignatureError::Mismatch)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

#[async_trait]
impl Provider for Webhook {
    fn platform(&self) -> Platform {
        Platform::Webhook
    }

    async fn deliver(&self, target: &Target, payload: &PushPayload) -> Outcome {
        let body = serde_json::to_vec(payload).expect("a payload serializes");
        let request = self
            .client
            .post(&self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(SIGNATURE_HEADER, sign(&self.secret, now_ms(), &body))
            .header(TOKEN_HEADER, &target.token)
            .body(body);
        classify_response(request.send().await).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_and_tampering_is_caught() {
        let body = br#"{"v":1}"#;
        let header = sign(b"k", 1_000_000, body);
        assert_eq!(verify_signature(b"k", &header, body, 1_000_000), Ok(()));
        assert_eq!(verify_signature(b"k", &header, body, 1_000_000 + SIGNATURE_TOLERANCE_MS), Ok(()));
        assert_eq!(verify_signature(b"other", &header, body, 1_000_000), Err(SignatureError::Mismatch));
        assert_eq!(verify_signature(b"k", &header, br#"{"v":2}"#, 1_000_000), Err(SignatureError::Mismatch));
        assert_eq!(
            verify_signature(b"k", &header, body, 1_000_001 + SIGNATURE_TOLERANCE_MS),
            Err(SignatureError::Stale)
        );
        assert_eq!(verify_signature(b"k", "v1=00", body, 0), Err(SignatureError::Malformed));
        assert_eq!(verify_signature(b"k", "t=0,v1=zz", body, 0), Err(SignatureError::Malformed));
        // The timestamp is under the MAC: moving it breaks the signature.
        let moved = header.replace("t=1000000", "t=1000001");
        assert_eq!(verify_signature(b"k", &moved, body, 1_000_000), Err(SignatureError::Mismatch));
    }
}
