//! Signed tokens: access tokens (P1), batch tokens (D3) and page cursors.
//!
//! A token is `base64url(claims) "." base64url(hmac_sha256(key, claims))`.
//! Each kind signs with its own key derived from the server secret, so a
//! batch token can never pass as an access token or the other way round.
//! Claims are a `|`-separated text that starts with the kind; identifiers
//! never contain `|` (see [`crate::ids`]). Expiry is checked against a `now`
//! the caller passes in: this module reads no clock.

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::{Generation, SyncSeq};

type HmacSha256 = Hmac<Sha256>;

/// Why a token was refused. The gateway maps all of these to
/// `UNAUTHENTICATED` (access) or `TOKEN_INVALID` (batch, page cursor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("token is malformed")]
    Malformed,
    #[error("token signature does not match")]
    BadSignature,
    #[error("token has expired")]
    Expired,
    #[error("token belongs to another user or device")]
    Foreign,
}

/// Keys for every token kind, derived from one server secret.
#[derive(Clone)]
pub struct TokenKeys {
    access: [u8; 32],
    batch: [u8; 32],
    cursor: [u8; 32],
    snapshot: [u8; 32],
    audit: [u8; 32],
    log: [u8; 32],
}

impl std::fmt::Debug for TokenKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKeys(..)")
    }
}

fn derive(secret: &[u8], label: &str) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(secret).expect("hmac takes any key length");
    mac.update(label.as_bytes());
    mac.finalize().into_bytes().into()
}

fn sign(key: &[u8; 32], claims: &str) -> String {
    let mut mac = HmacSha256::new_from_slice(key).expect("hmac takes any key length");
    mac.update(claims.as_bytes());
    format!("{}.{}", B64.encode(claims), B64.encode(mac.finalize().into_bytes()))
}

fn open(key: &[u8; 32], token: &str) -> Result<String, TokenError> {
    let (claims_b64, mac_b64) = token.split_once('.').ok_or(TokenError::Malformed)?;
    let claims = B64.decode(claims_b64).map_err(|_| TokenError::Malformed)?;
    let tag = B64.decode(mac_b64).map_err(|_| TokenError::Malformed)?;
    let mut mac = HmacSha256::new_from_slice(key).expect("hmac takes any key length");
    mac.update(&claims);
    mac.verify_slice(&tag).map_err(|_| TokenError::BadSignature)?;
    String::from_utf8(claims).map_err(|_| TokenError::Malformed)
}

fn field<T: std::str::FromStr>(parts: &[&str], i: usize) -> Result<T, TokenError> {
    parts.get(i).ok_or(TokenError::Malformed)?.parse().map_err(|_| TokenError::Malformed)
}

/// Claims of an access token: the only source of the caller's identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessClaims {
    pub user: String,
    pub device: String,
    pub expires_at_ms: i64,
}

/// Claims of a snapshot token (D7): the snapshot, its owner, the
/// generation it was built for, its base and its manifest digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotClaims {
    pub snapshot_id: String,
    pub user: String,
    pub device: String,
    pub generation: Generation,
    pub base_sync_seq: SyncSeq,
    pub manifest_digest: String,
    pub expires_at_ms: i64,
}

/// Claims of a batch token (D3): everything an ACK or a next page must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchClaims {
    pub user: String,
    pub device: String,
    pub generation: Generation,
    pub resume_from: SyncSeq,
    pub high_watermark: SyncSeq,
    pub expires_at_ms: i64,
    /// The recovery session this batch replays, if any (D6).
    pub recovery_session: Option<String>,
}

impl TokenKeys {
    pub fn from_secret(secret: &[u8]) -> TokenKeys {
        assert!(secret.len() >= 16, "token secret must have at least 16 bytes");
        TokenKeys {
            access: derive(secret, "tidemark/access/v1"),
            batch: derive(secret, "tidemark/batch/v1"),
            cursor: derive(secret, "tidemark/cursor/v1"),
            snapshot: derive(secret, "tidemark/snapshot/v1"),
            audit: derive(secret, "tidemark/audit/v1"),
            log: derive(secret, "tidemark/log/v1"),
        }
    }

    /// The audit log's name for a user or device id: a keyed hash (HMAC
    /// under this server's secret, 128 bits in hex), so the log names no one
    /// to a reader without the secret, yet one id always has one name and
    /// an operator finds a user's entries by hashing the user's name.
    pub fn audit_id(&self, id: &str) -> String {
        let mut mac = HmacSha256::new_from_slice(&self.audit).expect("hmac takes any key length");
        mac.update(id.as_bytes());
        mac.finalize().into_bytes()[..16].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The one name a log line gives a user or a device id (O2, seed
    /// §18.2 `user_id_hash`, `device_id_hash`): HMAC-SHA256 under a key
    /// derived from this deployment's token secret, 64 bits in hex. Keyed,
    /// so a reader of the logs cannot confirm a guessed name by hashing it
    /// (a plain or salted-in-the-open hash falls to a dictionary of user
    /// names); stable across restarts and across the nodes of one cluster,
    /// which share the secret, so one device's lines join up everywhere; an
    /// operator with the secret finds a user's lines by hashing the name.
    /// Its key differs from the audit log's, so the two cannot be joined
    /// by a reader of one of them.
    pub fn log_id(&self, id: &str) -> String {
        let mut mac = HmacSha256::new_from_slice(&self.log).expect("hmac takes any key length");
        mac.update(id.as_bytes());
        mac.finalize().into_bytes()[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn sign_access(&self, c: &AccessClaims) -> String {
        sign(&self.access, &format!("a|{}|{}|{}", c.user, c.device, c.expires_at_ms))
    }

    pub fn verify_access(&self, token: &str, now_ms: i64) -> Result<AccessClaims, TokenError> {
        let claims = open(&self.access, token)?;
        let parts: Vec<&str> = claims.split('|').collect();
        if parts.len() != 4 || parts[0] != "a" {
            return Err(TokenError::Malformed);
        }
        let c = AccessClaims { user: parts[1].into(), device: parts[2].into(), expires_at_ms: field(&parts, 3)? };
        if now_ms >= c.expires_at_ms {
            return Err(TokenError::Expired);
        }
        Ok(c)
    }

    pub fn sign_batch(&self, c: &BatchClaims) -> String {
        let claims = format!(
            "b|{}|{}|{}|{}|{}|{}|{}",
            c.user,
            c.device,
            c.generation,
            c.resume_from,
            c.high_watermark,
            c.expires_at_ms,
            c.recovery_session.as_deref().unwrap_or("")
        );
        sign(&self.batch, &claims)
    }

    /// Verifies signature, owner and expiry. Generation and watermark are
    /// checked by the caller against the device row and the ACK.
    pub fn verify_batch(&self, token: &str, user: &str, device: &str, now_ms: i64) -> Result<BatchClaims, TokenError> {
        let claims = open(&self.batch, token)?;
        let parts: Vec<&str> = claims.split('|').collect();
        if parts.len() != 8 || parts[0] != "b" {
            return Err(TokenError::Malformed);
        }
        let c = BatchClaims {
            user: parts[1].into(),
            device: parts[2].into(),
            generation: field(&parts, 3)?,
            resume_from: field(&parts, 4)?,
            high_watermark: field(&parts, 5)?,
            expires_at_ms: field(&parts, 6)?,
            recovery_session: Some(parts[7]).filter(|s| !s.is_empty()).map(str::to_owned),
        };
        if c.resume_from > c.high_watermark {
            return Err(TokenError::Malformed);
        }
        if c.user != user || c.device != device {
            return Err(TokenError::Foreign);
        }
        if now_ms >= c.expires_at_ms {
            return Err(TokenError::Expired);
        }
        Ok(c)
    }

    pub fn sign_snapshot(&self, c: &SnapshotClaims) -> String {
        let claims = format!(
            "s|{}|{}|{}|{}|{}|{}|{}",
            c.snapshot_id, c.user, c.device, c.generation, c.base_sync_seq, c.manifest_digest, c.expires_at_ms
        );
        sign(&self.snapshot, &claims)
    }

    /// Verifies signature, owner and expiry of a snapshot token.
    pub fn verify_snapshot(
        &self,
        token: &str,
        user: &str,
        device: &str,
        now_ms: i64,
    ) -> Result<SnapshotClaims, TokenError> {
        let claims = open(&self.snapshot, token)?;
        let parts: Vec<&str> = claims.split('|').collect();
        if parts.len() != 8 || parts[0] != "s" {
            return Err(TokenError::Malformed);
        }
        let c = SnapshotClaims {
            snapshot_id: parts[1].into(),
            user: parts[2].into(),
            device: parts[3].into(),
            generation: field(&parts, 4)?,
            base_sync_seq: field(&parts, 5)?,
            manifest_digest: parts[6].into(),
            expires_at_ms: field(&parts, 7)?,
        };
        if c.user != user || c.device != device {
            return Err(TokenError::Foreign);
        }
        if now_ms >= c.expires_at_ms {
            return Err(TokenError::Expired);
        }
        Ok(c)
    }

    /// An opaque page cursor bound to one batch token: a client can neither
    /// forge a position nor carry a cursor over to another batch.
    pub fn sign_cursor(&self, batch_token: &str, position: SyncSeq) -> String {
        sign(&self.cursor, &format!("p|{}|{}", token_tag(batch_token), position))
    }

    /// Returns the position of a cursor issued for `batch_token`, checked to
    /// lie inside the batch `[resume_from, high_watermark)`.
    pub fn verify_cursor(&self, cursor: &str, batch_token: &str, batch: &BatchClaims) -> Result<SyncSeq, TokenError> {
        let claims = open(&self.cursor, cursor)?;
        let parts: Vec<&str> = claims.split('|').collect();
        if parts.len() != 3 || parts[0] != "p" {
            return Err(TokenError::Malformed);
        }
        if parts[1] != token_tag(batch_token) {
            return Err(TokenError::Foreign);
        }
        let position: SyncSeq = field(&parts, 2)?;
        if position < batch.resume_from || position >= batch.high_watermark {
            return Err(TokenError::Malformed);
        }
        Ok(position)
    }
}

/// A short, stable tag of a token, for binding cursors and for logs (a log
/// carries this tag, never the token).
pub fn token_tag(token: &str) -> String {
    use sha2::Digest;
    let digest = Sha256::digest(token.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_ids_are_stable_keyed_and_not_the_audit_ids() {
        let k = keys();
        assert_eq!(k.log_id("alice"), k.log_id("alice"));
        assert_eq!(k.log_id("alice").len(), 16);
        assert_ne!(k.log_id("alice"), k.log_id("bob"));
        assert!(!k.audit_id("alice").starts_with(&k.log_id("alice")), "a separate key");
        let other = TokenKeys::from_secret(b"another deployment secret");
        assert_ne!(k.log_id("alice"), other.log_id("alice"), "keyed: not reproducible without the secret");
        use sha2::Digest;
        let plain: String = Sha256::digest(b"alice")[..8].iter().map(|b| format!("{b:02x}")).collect();
        assert_ne!(k.log_id("alice"), plain, "not a plain hash of the name");
    }

    #[test]
    fn audit_ids_are_stable_keyed_and_distinct() {
        let k = keys();
        assert_eq!(k.audit_id("alice"), k.audit_id("alice"));
        assert_eq!(k.audit_id("alice").len(), 32);
        assert_ne!(k.audit_id("alice"), k.audit_id("bob"));
        let other = TokenKeys::from_secret(b"another secret of 32 bytes......");
        assert_ne!(k.audit_id("alice"), other.audit_id("alice"), "another server's names differ");
        assert!(!k.audit_id("alice").contains("alice"));
    }

    fn keys() -> TokenKeys {
        TokenKeys::from_secret(b"0123456789abcdef0123456789abcdef")
    }

    fn batch() -> BatchClaims {
        BatchClaims {
            user: "bob".into(),
            device: "phone".into(),
            generation: 5,
            resume_from: 10,
            high_watermark: 20,
            expires_at_ms: 1_000,
            recovery_session: None,
        }
    }

    #[test]
    fn batch_token_round_trip_and_refusals() {
        let k = keys();
        let t = k.sign_batch(&batch());
        assert_eq!(k.verify_batch(&t, "bob", "phone", 999), Ok(batch()));
        assert_eq!(k.verify_batch(&t, "bob", "phone", 1_000), Err(TokenError::Expired));
        assert_eq!(k.verify_batch(&t, "bob", "desktop", 0), Err(TokenError::Foreign));
        assert_eq!(k.verify_batch(&t, "eve", "phone", 0), Err(TokenError::Foreign));
        // Forged claims with the original signature.
        let (_, mac) = t.split_once('.').unwrap();
        let forged = format!("{}.{}", B64.encode("b|bob|phone|5|10|99|1000|"), mac);
        assert_eq!(k.verify_batch(&forged, "bob", "phone", 0), Err(TokenError::BadSignature));
        // Another server's secret.
        let other = TokenKeys::from_secret(b"another-secret-of-32-bytes......");
        assert_eq!(other.verify_batch(&t, "bob", "phone", 0), Err(TokenError::BadSignature));
        assert_eq!(k.verify_batch("garbage", "bob", "phone", 0), Err(TokenError::Malformed));
    }

    #[test]
    fn snapshot_tokens_bind_owner_and_expiry() {
        let k = keys();
        let c = SnapshotClaims {
            snapshot_id: "s1".into(),
            user: "bob".into(),
            device: "phone".into(),
            generation: 6,
            base_sync_seq: 40,
            manifest_digest: "abcd".into(),
            expires_at_ms: 100,
        };
        let t = k.sign_snapshot(&c);
        assert_eq!(k.verify_snapshot(&t, "bob", "phone", 99), Ok(c));
        assert_eq!(k.verify_snapshot(&t, "bob", "desk", 99), Err(TokenError::Foreign));
        assert_eq!(k.verify_snapshot(&t, "bob", "phone", 100), Err(TokenError::Expired));
        let batch = k.sign_batch(&batch());
        assert_eq!(k.verify_snapshot(&batch, "bob", "phone", 0), Err(TokenError::BadSignature));
    }

    #[test]
    fn kinds_do_not_cross() {
        let k = keys();
        let access = k.sign_access(&AccessClaims { user: "bob".into(), device: "phone".into(), expires_at_ms: 50 });
        assert_eq!(k.verify_batch(&access, "bob", "phone", 0), Err(TokenError::BadSignature));
        let b = k.sign_batch(&batch());
        assert_eq!(k.verify_access(&b, 0), Err(TokenError::BadSignature));
        assert_eq!(k.verify_access(&access, 49).unwrap().device, "phone");
        assert_eq!(k.verify_access(&access, 50), Err(TokenError::Expired));
    }

    #[test]
    fn cursors_bind_to_their_batch_and_range() {
        let k = keys();
        let t = k.sign_batch(&batch());
        let c = k.sign_cursor(&t, 15);
        assert_eq!(k.verify_cursor(&c, &t, &batch()), Ok(15));
        let other = k.sign_batch(&BatchClaims { high_watermark: 30, ..batch() });
        assert_eq!(k.verify_cursor(&c, &other, &batch()), Err(TokenError::Foreign));
        let past_end = k.sign_cursor(&t, 20);
        assert_eq!(k.verify_cursor(&past_end, &t, &batch()), Err(TokenError::Malformed));
    }
}
