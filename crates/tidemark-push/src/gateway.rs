//! The Matrix push gateway API (`POST /_matrix/push/v1/notify`), as Sygnal
//! serves it: the operator runs Sygnal with its APNs and FCM credentials,
//! and Tidemark hands it notifications for the devices' push keys.
//!
//! Privacy (seed §17.3): with [`PreviewLevel::None`] the notification
//! carries only counts and the `event_id_only` format, so the gateway and
//! the platform's servers learn that something is new and nothing else;
//! the conversation id goes as `room_id` only at `Conversation` or above,
//! and sender and text only at `Full`. The gateway answers 200 with the
//! push keys it `rejected` (dead tokens); other statuses are classified as
//! for any HTTP provider.

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::{classify_response, http_client, Outcome, Platform, Provider, PushPayload, Target};

/// The API path under the gateway's base URL.
pub const NOTIFY_PATH: &str = "/_matrix/push/v1/notify";

pub struct Gateway {
    notify_url: String,
    client: reqwest::Client,
}

impl Gateway {
    /// A provider for the gateway at `base_url` (e.g. `http://sygnal:5000`).
    pub fn new(base_url: &str) -> Gateway {
        Gateway { notify_url: format!("{}{NOTIFY_PATH}", base_url.trim_end_matches('/')), client: http_client() }
    }
}

/// The request body for one device.
pub fn notify_body(target: &Target, payload: &PushPayload) -> Value {
    let full = payload.preview.is_some();
    let mut notification = json!({
        "id": payload.notification_id,
        "counts": {"unread": payload.count},
        "prio": "high",
        "devices": [{
            "app_id": target.app_id,
            "pushkey": target.token,
            "pushkey_ts": 0,
            "data": if full { json!({}) } else { json!({"format": "event_id_only"}) },
        }],
    });
    if let Some(conv) = &payload.conv {
        notification["room_id"] = json!(conv);
    }
    if let Some(preview) = &payload.preview {
        notification["type"] = json!("m.room.message");
        notification["sender"] = json!(preview.sender);
        notification["content"] = json!({"msgtype": "m.text", "body": preview.text});
    }
    json!({ "notification": notification })
}

#[derive(Deserialize)]
struct NotifyReply {
    #[serde(default)]
    rejected: Vec<String>,
}

#[async_trait]
impl Provider for Gateway {
    fn platform(&self) -> Platform {
        Platform::Gateway
    }

    async fn deliver(&self, target: &Target, payload: &PushPayload) -> Outcome {
        let sent = self.client.post(&self.notify_url).json(&notify_body(target, payload)).send().await;
        let response = match sent {
            Ok(r) if r.status().as_u16() == 200 => r,
            other => return classify_response(other).await,
        };
        match response.json::<NotifyReply>().await {
            Ok(reply) if reply.rejected.iter().any(|k| k == &target.token) => Outcome::TokenRejected,
            Ok(_) => Outcome::Accepted,
            // A 200 whose body is not the API's: a gateway fault.
            Err(_) => Outcome::Failed { retryable: true, reason: "gateway answered an unreadable body".into() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PreviewLevel, PushPreview};

    fn target() -> Target {
        Target { platform: Platform::Gateway, token: "pk1".into(), app_id: "im.app".into(), p256dh: None, auth: None }
    }

    #[test]
    fn the_body_says_no_more_than_the_payload() {
        let preview = Some(PushPreview { sender: "ann".into(), text: "hi".into() });
        let bare = PushPayload::new("n1".into(), 2, PreviewLevel::None, "c1", preview.clone());
        let body = notify_body(&target(), &bare);
        assert_eq!(
            body,
            json!({"notification": {"id": "n1", "counts": {"unread": 2}, "prio": "high", "devices": [
                {"app_id": "im.app", "pushkey": "pk1", "pushkey_ts": 0, "data": {"format": "event_id_only"}}]}})
        );
        let conv = notify_body(
            &target(),
            &PushPayload::new("n1".into(), 2, PreviewLevel::Conversation, "c1", preview.clone()),
        );
        assert_eq!(conv["notification"]["room_id"], "c1");
        assert!(conv["notification"].get("content").is_none());
        let full = notify_body(&target(), &PushPayload::new("n1".into(), 2, PreviewLevel::Full, "c1", preview));
        assert_eq!(full["notification"]["content"]["body"], "hi");
        assert_eq!(full["notification"]["sender"], "ann");
    }
}
