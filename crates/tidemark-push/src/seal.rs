//! Provider tokens at rest (seed §17.3): sealed with AES-256-GCM under a
//! key the operator keeps outside the database (`tidemark serve
//! --push-token-key-file`), bound to their device by the associated data,
//! so a sealed token copied to another device's row does not open. Without
//! a key file the key is derived from the server secret with HKDF; that
//! secret lives in the same database, so this only keeps tokens out of
//! plain sight (dumps, logs), which the operator is told at start.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use hkdf::Hkdf;
use sha2::Sha256;

/// Bytes of a key file's key (raw, or 64 hex digits).
pub const SEAL_KEY_BYTES: usize = 32;
const NONCE_BYTES: usize = 12;
/// Version byte in front of every sealed token.
const SEALED_V1: u8 = 1;

pub struct TokenSealer {
    cipher: Aes256Gcm,
}

impl std::fmt::Debug for TokenSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenSealer")
    }
}

impl TokenSealer {
    pub fn from_key(key: &[u8; SEAL_KEY_BYTES]) -> TokenSealer {
        TokenSealer { cipher: Aes256Gcm::new(key.into()) }
    }

    /// The key derived from the server secret (no key file given).
    pub fn derived(server_secret: &[u8]) -> TokenSealer {
        let mut key = [0u8; SEAL_KEY_BYTES];
        Hkdf::<Sha256>::new(None, server_secret)
            .expand(b"tidemark push token seal v1", &mut key)
            .expect("32 bytes is a valid HKDF-SHA256 length");
        TokenSealer::from_key(&key)
    }

    /// A key file's content: 32 raw bytes, or 64 hex digits (whitespace
    /// around them ignored).
    pub fn key_from_file_bytes(bytes: &[u8]) -> Result<[u8; SEAL_KEY_BYTES], String> {
        if let Ok(raw) = <[u8; SEAL_KEY_BYTES]>::try_from(bytes) {
            return Ok(raw);
        }
        let text = std::str::from_utf8(bytes).map_err(|_| "the key file is neither 32 bytes nor hex".to_string())?;
        let hex = text.trim();
        if hex.len() != 2 * SEAL_KEY_BYTES || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("the key file must hold 32 bytes or 64 hex digits".into());
        }
        let mut key = [0u8; SEAL_KEY_BYTES];
        for (i, k) in key.iter_mut().enumerate() {
            *k = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("checked hex");
        }
        Ok(key)
    }

    /// Seals `token` for the device named by `aad` (a fresh nonce each time).
    pub fn seal(&self, token: &str, aad: &[u8]) -> Vec<u8> {
        let nonce: [u8; NONCE_BYTES] = rand::random();
        let ciphertext = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: token.as_bytes(), aad })
            .expect("AES-GCM encrypts any token of the contract's size");
        let mut out = Vec::with_capacity(1 + NONCE_BYTES + ciphertext.len());
        out.push(SEALED_V1);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ciphertext);
        out
    }

    /// The token, or `None` if it was sealed under another key or for
    /// another device, or was altered.
    pub fn open(&self, sealed: &[u8], aad: &[u8]) -> Option<String> {
        let (&version, rest) = sealed.split_first()?;
        if version != SEALED_V1 || rest.len() < NONCE_BYTES {
            return None;
        }
        let (nonce, ciphertext) = rest.split_at(NONCE_BYTES);
        let plain = self.cipher.decrypt(Nonce::from_slice(nonce), Payload { msg: ciphertext, aad }).ok()?;
        String::from_utf8(plain).ok()
    }
}

/// The associated data binding a sealed token to its device.
pub fn device_aad(user: &str, device: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(user.len() + device.len() + 1);
    aad.extend_from_slice(user.as_bytes());
    aad.push(0);
    aad.extend_from_slice(device.as_bytes());
    aad
}

/// The last four characters of a token, as shown back to its owner.
pub fn last4(token: &str) -> String {
    let n = token.chars().count();
    token.chars().skip(n.saturating_sub(4)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_token_opens_only_with_its_key_and_device() {
        let s = TokenSealer::from_key(&[7; 32]);
        let aad = device_aad("bob", "phone");
        let sealed = s.seal("apns-token-123", &aad);
        assert!(!sealed.windows(5).any(|w| w == b"token"), "the token is not in clear");
        assert_eq!(s.open(&sealed, &aad).as_deref(), Some("apns-token-123"));
        assert_eq!(s.open(&sealed, &device_aad("bob", "tab")), None, "bound to its device");
        assert_eq!(TokenSealer::from_key(&[8; 32]).open(&sealed, &aad), None, "another key");
        let mut altered = sealed.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert_eq!(s.open(&altered, &aad), None);
        assert_ne!(s.seal("apns-token-123", &aad), sealed, "a fresh nonce each time");
        let d = TokenSealer::derived(b"secret");
        assert_eq!(d.open(&d.seal("x", &aad), &aad).as_deref(), Some("x"));
    }

    #[test]
    fn key_files_hold_raw_or_hex_keys() {
        assert_eq!(TokenSealer::key_from_file_bytes(&[1; 32]), Ok([1; 32]));
        let hex = format!("{}\n", "0a".repeat(32));
        assert_eq!(TokenSealer::key_from_file_bytes(hex.as_bytes()), Ok([10; 32]));
        assert!(TokenSealer::key_from_file_bytes(b"short").is_err());
        assert_eq!(last4("abcdef"), "cdef");
        assert_eq!(last4("ab"), "ab");
    }
}
