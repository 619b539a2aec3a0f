//! Small helpers: the wall clock and random ids. The domain core takes
//! both as arguments; this is where the server reads them.

use rand::Rng;

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// A random id: `prefix` followed by 20 lowercase hex digits (80 bits).
pub fn new_id(prefix: &str) -> String {
    let bytes: [u8; 10] = rand::rng().random();
    let mut s = String::with_capacity(prefix.len() + 20);
    s.push_str(prefix);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// A new message or conversation-event id, minted at `now_ms`
/// (`tidemark_core::ids::message_id`: time-ordered, 80 random bits).
pub fn new_message_id(now_ms: i64) -> String {
    tidemark_core::ids::message_id(now_ms, rand::rng().random())
}

/// A random secret of 32 bytes, URL-safe base64.
pub fn new_secret() -> String {
    use base64::Engine;
    let bytes: [u8; 32] = rand::rng().random();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// SHA-256 in hex, for refresh tokens at rest.
pub fn sha256_hex(s: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Resolves once the shutdown flag is set (or its sender is gone).
pub async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}
