//! Web Push: RFC 8030 delivery, RFC 8291 message encryption, RFC 8292 VAPID.
//!
//! The payload is encrypted for the browser's subscription keys (`p256dh`,
//! `auth`) with a fresh ephemeral P-256 key and salt per message, as one
//! `aes128gcm` record (RFC 8188); the push service sees only ciphertext.
//! The request is signed with the operator's VAPID key: an ES256 JWT whose
//! audience is the push service's origin, valid for [`VAPID_TOKEN_TTL_SECS`].

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes128Gcm, Nonce};
use async_trait::async_trait;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use hkdf::Hkdf;
use p256::ecdsa::signature::Signer;
use p256::ecdsa::{Signature, SigningKey};
use p256::elliptic_curve::sec1::ToEncodedPoint;
use p256::{FieldBytes, PublicKey, SecretKey};
use sha2::Sha256;

use crate::{classify_response, http_client, Outcome, Platform, Provider, PushPayload, Target};

/// Lifetime of a VAPID JWT (RFC 8292 §2: at most 24 hours).
pub const VAPID_TOKEN_TTL_SECS: i64 = 12 * 3600;
/// How long the push service keeps an undelivered message (`TTL` header).
pub const MESSAGE_TTL_SECS: u32 = 24 * 3600;
/// Record size announced in the `aes128gcm` header (one record carries the
/// whole payload, which is far smaller).
pub const RECORD_SIZE: u32 = 4096;

/// Why a message cannot be encrypted for a subscription.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncryptError {
    #[error("the subscription's p256dh key is not a P-256 public key")]
    BadPublicKey,
    #[error("the subscription's auth secret is not 16 bytes")]
    BadAuthSecret,
    #[error("the payload does not fit one record")]
    TooLarge,
}

/// The operator's VAPID key pair.
#[derive(Clone)]
pub struct VapidKey {
    secret: SecretKey,
    /// `sub` claim: a `mailto:` or `https:` contact for the push service.
    subject: String,
}

impl std::fmt::Debug for VapidKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VapidKey").field("public", &self.public_key_base64url()).finish_non_exhaustive()
    }
}

fn random_secret() -> SecretKey {
    loop {
        let bytes: [u8; 32] = rand::random();
        // Almost every 32-byte string is a valid scalar; retry the rest.
        if let Ok(secret) = SecretKey::from_bytes(&FieldBytes::from(bytes)) {
            return secret;
        }
    }
}

fn uncompressed(public: &PublicKey) -> Vec<u8> {
    public.to_encoded_point(false).as_bytes().to_vec()
}

impl VapidKey {
    pub fn generate(subject: impl Into<String>) -> VapidKey {
        VapidKey { secret: random_secret(), subject: subject.into() }
    }

    /// A key from its 32-byte private scalar, base64url (as web-push tools
    /// print it).
    pub fn from_base64url(private: &str, subject: impl Into<String>) -> Option<VapidKey> {
        let bytes = B64.decode(private.trim()).ok()?;
        let bytes: [u8; 32] = bytes.try_into().ok()?;
        let secret = SecretKey::from_bytes(&FieldBytes::from(bytes)).ok()?;
        Some(VapidKey { secret, subject: subject.into() })
    }

    pub fn private_key_base64url(&self) -> String {
        B64.encode(self.secret.to_bytes())
    }

    /// The application server key a browser subscribes with.
    pub fn public_key_base64url(&self) -> String {
        B64.encode(uncompressed(&self.secret.public_key()))
    }

    /// The `Authorization` header for a request to `endpoint` at `now_secs`.
    pub fn authorization(&self, endpoint: &str, now_secs: i64) -> Option<String> {
        let audience = reqwest::Url::parse(endpoint).ok()?.origin().ascii_serialization();
        let header = B64.encode(br#"{"typ":"JWT","alg":"ES256"}"#);
        let claims = serde_json::json!({
            "aud": audience,
            "exp": now_secs + VAPID_TOKEN_TTL_SECS,
            "sub": self.subject,
        });
        let claims = B64.encode(serde_json::to_vec(&claims).expect("claims serialize"));
        let signing_input = format!("{header}.{claims}");
        let signature: Signature = SigningKey::from(&self.secret).sign(signing_input.as_bytes());
        let jwt = format!("{signing_input}.{}", B64.encode(signature.to_bytes()));
        Some(format!("vapid t={jwt}, k={}", self.public_key_base64url()))
    }
}

/// Encrypts `plaintext` for a subscription (RFC 8291 §3, one RFC 8188
/// record), with a fresh ephemeral key and salt.
pub fn encrypt(p256dh: &str, auth: &str, plaintext: &[u8]) -> Result<Vec<u8>, EncryptError> {
    encrypt_with(p256dh, auth, plaintext, &random_secret(), rand::random())
}

fn hkdf_expand(prk: &Hkdf<Sha256>, info: &[u8], out: &mut [u8]) {
    prk.expand(info, out).expect("HKDF output lengths here are far below the limit");
}

fn encrypt_with(
    p256dh: &str,
    auth: &str,
    plaintext: &[u8],
    ephemeral: &SecretKey,
    salt: [u8; 16],
) -> Result<Vec<u8>, EncryptError> {
    let ua_public_bytes = B64.decode(p256dh.trim()).map_err(|_| EncryptError::BadPublicKey)?;
    let ua_public = PublicKey::from_sec1_bytes(&ua_public_bytes).map_err(|_| EncryptError::BadPublicKey)?;
    let ua_public_bytes = uncompressed(&ua_public);
    let auth_secret = B64.decode(auth.trim()).map_err(|_| EncryptError::BadAuthSecret)?;
    if auth_secret.len() != 16 {
        return Err(EncryptError::BadAuthSecret);
    }
    // One record: the plaintext, the last-record delimiter, the 16-byte tag.
    if plaintext.len() + 1 + 16 > RECORD_SIZE as usize {
        return Err(EncryptError::TooLarge);
    }
    let as_public_bytes = uncompressed(&ephemeral.public_key());
    let shared = p256::ecdh::diffie_hellman(ephemeral.to_nonzero_scalar(), ua_public.as_affine());

    // RFC 8291 §3.3–3.4: IKM from the ECDH secret under the auth secret.
    let mut key_info = Vec::with_capacity(14 + 65 + 65);
    key_info.extend_from_slice(b"WebPush: info\0");
    key_info.extend_from_slice(&ua_public_bytes);
    key_info.extend_from_slice(&as_public_bytes);
    let mut ikm = [0u8; 32];
    hkdf_expand(&Hkdf::<Sha256>::new(Some(&auth_secret), shared.raw_secret_bytes()), &key_info, &mut ikm);

    // RFC 8188 §2.2–2.3: content key and nonce from the salt.
    let prk = Hkdf::<Sha256>::new(Some(&salt), &ikm);
    let mut cek = [0u8; 16];
    let mut nonce = [0u8; 12];
    hkdf_expand(&prk, b"Content-Encoding: aes128gcm\0", &mut cek);
    hkdf_expand(&prk, b"Content-Encoding: nonce\0", &mut nonce);

    let mut record = Vec::with_capacity(plaintext.len() + 1);
    record.extend_from_slice(plaintext);
    record.push(0x02);
    let cipher = Aes128Gcm::new_from_slice(&cek).expect("a 16-byte key");
    let sealed = cipher.encrypt(Nonce::from_slice(&nonce), record.as_slice()).expect("AES-GCM seals any length here");

    let mut body = Vec::with_capacity(16 + 4 + 1 + 65 + sealed.len());
    body.extend_from_slice(&salt);
    body.extend_from_slice(&RECORD_SIZE.to_be_bytes());
    body.push(as_public_bytes.len() as u8);
    body.extend_from_slice(&as_public_bytes);
    body.extend_from_slice(&sealed);
    Ok(body)
}

pub struct WebPush {
    vapid: VapidKey,
    client: reqwest::Client,
}

impl WebPush {
    pub fn new(vapid: VapidKey) -> WebPush {
        WebPush { vapid, client: http_client() }
    }
}

fn now_secs() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

#[async_trait]
impl Provider for WebPush {
    fn platform(&self) -> Platform {
        Platform::WebPush
    }

    async fn deliver(&self, target: &Target, payload: &PushPayload) -> Outcome {
        let (Some(p256dh), Some(auth)) = (target.p256dh.as_deref(), target.auth.as_deref()) else {
            return Outcome::TokenRejected;
        };
        let plaintext = serde_json::to_vec(payload).expect("a payload serializes");
        let body = match encrypt(p256dh, auth, &plaintext) {
            Ok(body) => body,
            // A subscription whose keys are broken can never be pushed.
            Err(EncryptError::BadPublicKey | EncryptError::BadAuthSecret) => return Outcome::TokenRejected,
            Err(e @ EncryptError::TooLarge) => return Outcome::Failed { retryable: false, reason: e.to_string() },
        };
        let Some(authorization) = self.vapid.authorization(&target.token, now_secs()) else {
            return Outcome::TokenRejected;
        };
        let request = self
            .client
            .post(&target.token)
            .header(reqwest::header::AUTHORIZATION, authorization)
            .header(reqwest::header::CONTENT_ENCODING, "aes128gcm")
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .header("ttl", MESSAGE_TTL_SECS.to_string())
            .header("urgency", "normal")
            .body(body);
        classify_response(request.send().await).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 8291 §5 test vector: the same keys, salt and plaintext must give
    /// exactly the RFC's message.
    #[test]
    fn encryption_matches_the_rfc_8291_example() {
        let ua_public = "BCVxsr7N_eNgVRqvHtD0zTZsEc6-VV-JvLexhqUzORcxaOzi6-AYWXvTBHm4bjyPjs7Vd8pZGH6SRpkNtoIAiw4";
        let auth = "BTBZMqHH6r4Tts7J_aSIgg";
        let as_private = B64.decode("yfWPiYE-n46HLnH0KqZOF1fJJU3MYrct3AELtAQ-oRw").unwrap();
        let as_private = SecretKey::from_bytes(&FieldBytes::from(<[u8; 32]>::try_from(as_private).unwrap())).unwrap();
        let salt: [u8; 16] = B64.decode("DGv6ra1nlYgDCS1FRnbzlw").unwrap().try_into().unwrap();
        let body =
            encrypt_with(ua_public, auth, b"When I grow up, I want to be a watermelon", &as_private, salt).unwrap();
        let expect = "DGv6ra1nlYgDCS1FRnbzlwAAEABBBP4z9KsN6nGRTbVYI_c7VJSPQTBtkgcy27mlmlMoZIIgDll6e3vCYLocInmYWAmS6TlzAC8wEqKK6PBru3jl7A_yl95bQpu6cVPTpK4Mqgkf1CXztLVBSt2Ks3oZwbuwXPXLWyouBWLVWGNWQexSgSxsj_Qulcy4a-fN";
        assert_eq!(B64.encode(body), expect);
    }

    #[test]
    fn broken_subscription_keys_are_refused() {
        let auth = "BTBZMqHH6r4Tts7J_aSIgg";
        assert_eq!(encrypt("AAAA", auth, b"x"), Err(EncryptError::BadPublicKey));
        let ua = VapidKey::generate("mailto:ops@example.org").public_key_base64url();
        assert_eq!(encrypt(&ua, "AAAA", b"x"), Err(EncryptError::BadAuthSecret));
        assert_eq!(encrypt(&ua, auth, &vec![0u8; RECORD_SIZE as usize]), Err(EncryptError::TooLarge));
        assert!(encrypt(&ua, auth, b"x").is_ok());
    }

    #[test]
    fn a_vapid_key_round_trips_and_signs_for_the_endpoints_origin() {
        let key = VapidKey::generate("mailto:ops@example.org");
        let again = VapidKey::from_base64url(&key.private_key_base64url(), "mailto:ops@example.org").unwrap();
        assert_eq!(key.public_key_base64url(), again.public_key_base64url());
        let header = key.authorization("https://push.example.net:8443/wpush/abc?x=1", 1_000).unwrap();
        let jwt = header.strip_prefix("vapid t=").unwrap().split(',').next().unwrap();
        let claims: serde_json::Value =
            serde_json::from_slice(&B64.decode(jwt.split('.').nth(1).unwrap()).unwrap()).unwrap();
        assert_eq!(claims["aud"], "https://push.example.net:8443");
        assert_eq!(claims["exp"], 1_000 + VAPID_TOKEN_TTL_SECS);
        assert!(header.ends_with(&format!("k={}", key.public_key_base64url())));
    }
}
