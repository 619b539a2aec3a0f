//! Each provider against a real HTTP receiver on 127.0.0.1 standing in for
//! the provider's endpoint: what it sends, and how each answer is read.
//!
//! The Web Push request is checked by libraries Tidemark did not write
//! (Python's `http_ece` decrypts it, `py_vapid` verifies the VAPID
//! signature: tests/webpush_check.py). That check needs them installed;
//! `.ci/run` installs them and sets `TIDEMARK_TEST_WEBPUSH_PYTHON=1`, and
//! the test fails loudly if it is set and they are missing. Unset, the
//! test says it skipped the interop half on stdout.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD as B64};
use base64::Engine;
use p256::elliptic_curve::sec1::ToEncodedPoint;
use tidemark_push::gateway::Gateway;
use tidemark_push::webhook::{verify_signature, Webhook, SIGNATURE_HEADER, TOKEN_HEADER};
use tidemark_push::webpush::{VapidKey, WebPush};
use tidemark_push::{Outcome, Platform, PreviewLevel, Provider, PushPayload, PushPreview, Target};

#[derive(Debug, Clone)]
struct Captured {
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

/// One canned answer: status, headers, body.
type Reply = (u16, Vec<(&'static str, &'static str)>, &'static str);

#[derive(Clone, Default)]
struct Receiver {
    requests: Arc<Mutex<Vec<Captured>>>,
    replies: Arc<Mutex<VecDeque<Reply>>>,
}

impl Receiver {
    /// Serves on 127.0.0.1:0; answers each request with the next queued
    /// reply (200 when none is queued). Returns the base URL.
    async fn start(&self) -> String {
        let me = self.clone();
        let app = Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let me = me.clone();
            async move {
                me.requests.lock().unwrap().push(Captured { path: uri.path().to_owned(), headers, body });
                let (status, headers, body) = me.replies.lock().unwrap().pop_front().unwrap_or((200, vec![], ""));
                let mut response: Response = (StatusCode::from_u16(status).unwrap(), body.to_owned()).into_response();
                for (k, v) in headers {
                    response.headers_mut().insert(k, v.parse().unwrap());
                }
                response
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        url
    }

    fn reply(&self, reply: Reply) {
        self.replies.lock().unwrap().push_back(reply);
    }

    fn taken(&self) -> Vec<Captured> {
        std::mem::take(&mut *self.requests.lock().unwrap())
    }
}

fn payload(level: PreviewLevel) -> PushPayload {
    let preview = Some(PushPreview { sender: "ann".into(), text: "lunch at 1?".into() });
    PushPayload::new("n-42".into(), 3, level, "c-7", preview)
}

fn target(platform: Platform, token: &str) -> Target {
    Target { platform, token: token.into(), app_id: "im.tidemark.test".into(), p256dh: None, auth: None }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

#[tokio::test]
async fn the_webhook_is_signed_and_its_answers_are_classified() {
    let receiver = Receiver::default();
    let base = receiver.start().await;
    let hook = Webhook::new(format!("{base}/push"), b"shared-secret".to_vec());
    let device = target(Platform::Webhook, "device-token-1");

    assert_eq!(hook.deliver(&device, &payload(PreviewLevel::None)).await, Outcome::Accepted);
    let [req] = receiver.taken().try_into().unwrap();
    assert_eq!(req.path, "/push");
    assert_eq!(req.headers[TOKEN_HEADER], "device-token-1");
    let signature = req.headers[SIGNATURE_HEADER].to_str().unwrap();
    verify_signature(b"shared-secret", signature, &req.body, now_ms()).expect("the receiver can verify it");
    assert!(verify_signature(b"another-secret", signature, &req.body, now_ms()).is_err());
    // The default level says only that something is new.
    let sent: serde_json::Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(sent, serde_json::json!({"v": 1, "notification_id": "n-42", "count": 3}));

    receiver.reply((410, vec![], "gone"));
    assert_eq!(hook.deliver(&device, &payload(PreviewLevel::None)).await, Outcome::TokenRejected);
    receiver.reply((429, vec![("retry-after", "3")], ""));
    assert_eq!(hook.deliver(&device, &payload(PreviewLevel::None)).await, Outcome::Throttled { retry_after_ms: 3_000 });
    receiver.reply((500, vec![], ""));
    assert!(matches!(
        hook.deliver(&device, &payload(PreviewLevel::None)).await,
        Outcome::Failed { retryable: true, .. }
    ));
    // Nobody listening: a transport failure, retryable, with no URL in it.
    let closed = Webhook::new("http://127.0.0.1:9/push", b"k".to_vec());
    match closed.deliver(&device, &payload(PreviewLevel::None)).await {
        Outcome::Failed { retryable: true, reason } => assert!(!reason.contains("127.0.0.1"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn the_gateway_speaks_the_matrix_push_api_and_reports_rejected_keys() {
    let receiver = Receiver::default();
    let base = receiver.start().await;
    let gateway = Gateway::new(&base);

    receiver.reply((200, vec![("content-type", "application/json")], r#"{"rejected":[]}"#));
    assert_eq!(
        gateway.deliver(&target(Platform::Gateway, "pk-live"), &payload(PreviewLevel::None)).await,
        Outcome::Accepted
    );
    let [req] = receiver.taken().try_into().unwrap();
    assert_eq!(req.path, "/_matrix/push/v1/notify");
    let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(body["notification"]["devices"][0]["pushkey"], "pk-live");
    assert_eq!(body["notification"]["devices"][0]["data"]["format"], "event_id_only");
    assert!(body["notification"].get("content").is_none() && body["notification"].get("room_id").is_none());

    receiver.reply((200, vec![("content-type", "application/json")], r#"{"rejected":["pk-dead"]}"#));
    assert_eq!(
        gateway.deliver(&target(Platform::Gateway, "pk-dead"), &payload(PreviewLevel::Full)).await,
        Outcome::TokenRejected
    );
    receiver.reply((429, vec![("retry-after", "5")], ""));
    assert_eq!(
        gateway.deliver(&target(Platform::Gateway, "pk-live"), &payload(PreviewLevel::None)).await,
        Outcome::Throttled { retry_after_ms: 5_000 }
    );
    receiver.reply((200, vec![], "not json"));
    assert!(matches!(
        gateway.deliver(&target(Platform::Gateway, "pk-live"), &payload(PreviewLevel::None)).await,
        Outcome::Failed { retryable: true, .. }
    ));
}

/// A browser's subscription keys: the private half stays in the test so
/// the independent checker can decrypt.
fn browser_keys() -> (String, String, String) {
    let secret = loop {
        if let Ok(s) = p256::SecretKey::from_bytes(&p256::FieldBytes::from(rand::random::<[u8; 32]>())) {
            break s;
        }
    };
    let public = B64.encode(secret.public_key().to_encoded_point(false).as_bytes());
    let auth = B64.encode(rand::random::<[u8; 16]>());
    (B64.encode(secret.to_bytes()), public, auth)
}

#[tokio::test]
async fn web_push_is_encrypted_for_the_browser_and_signed_with_vapid() {
    let receiver = Receiver::default();
    let base = receiver.start().await;
    let endpoint = format!("{base}/wpush/v2/sub-123");
    let vapid = VapidKey::generate("mailto:ops@tidemark.test");
    let push = WebPush::new(vapid.clone());
    let (ua_private, p256dh, auth) = browser_keys();
    let device = Target { p256dh: Some(p256dh), auth: Some(auth.clone()), ..target(Platform::WebPush, &endpoint) };

    receiver.reply((201, vec![], ""));
    assert_eq!(push.deliver(&device, &payload(PreviewLevel::Full)).await, Outcome::Accepted);
    let [req] = receiver.taken().try_into().unwrap();
    assert_eq!(req.path, "/wpush/v2/sub-123");
    assert_eq!(req.headers["content-encoding"], "aes128gcm");
    assert!(req.headers.contains_key("ttl"));
    let plaintext = serde_json::to_vec(&payload(PreviewLevel::Full)).unwrap();
    assert!(!req.body.windows(8).any(|w| w == b"lunch at"), "the push service sees only ciphertext");
    assert!(req.body.len() > plaintext.len());

    // A subscription the push service says is gone, and one whose keys are
    // not keys, are both dead tokens.
    receiver.reply((410, vec![], ""));
    assert_eq!(push.deliver(&device, &payload(PreviewLevel::None)).await, Outcome::TokenRejected);
    let broken = Target { p256dh: Some("AAAA".into()), ..device.clone() };
    assert_eq!(push.deliver(&broken, &payload(PreviewLevel::None)).await, Outcome::TokenRejected);

    // The interop half: decrypt and verify with independent libraries.
    if std::env::var_os("TIDEMARK_TEST_WEBPUSH_PYTHON").is_none() {
        println!("SKIPPED the Web Push interop check: TIDEMARK_TEST_WEBPUSH_PYTHON is unset (.ci/run sets it)");
        return;
    }
    let input = serde_json::json!({
        "body": STANDARD.encode(&req.body),
        "ua_private": ua_private,
        "auth": auth,
        "authorization": req.headers["authorization"].to_str().unwrap(),
        "endpoint": endpoint,
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/webpush_check.py");
    let mut child = std::process::Command::new("python3")
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(input.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the independent check failed: {}", String::from_utf8_lossy(&out.stderr));
    let checked: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(checked["plaintext"].as_str().unwrap().as_bytes(), plaintext.as_slice());
    assert_eq!(checked["claims"]["aud"], base);
    assert_eq!(checked["claims"]["sub"], "mailto:ops@tidemark.test");
}
