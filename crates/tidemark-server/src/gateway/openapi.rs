//! `GET /v1/openapi.json`: an OpenAPI 3.1 description of the HTTP surface.
//! Request and reply shapes are spelled out in `docs/protocol.md`; this
//! document lists every path and operation with its fields.

use axum::Json;
use serde_json::{json, Value};

fn object(fields: &[&str]) -> Value {
    let props: serde_json::Map<String, Value> = fields.iter().map(|f| ((*f).to_string(), json!({}))).collect();
    json!({"type": "object", "properties": props})
}

fn rpc(summary: &str, request: &[&str], reply: &[&str]) -> Value {
    secured(summary, "bearer", request, reply)
}

/// `scheme` is `bearer` (a device access token), `admin` (the admin token)
/// or empty (no authentication).
fn secured(summary: &str, scheme: &str, request: &[&str], reply: &[&str]) -> Value {
    let security = if scheme.is_empty() { json!([]) } else { json!([{ scheme: [] }]) };
    json!({"post": {
        "summary": summary,
        "security": security,
        "requestBody": {"content": {"application/json": {"schema": object(request)}}},
        "responses": {
            "200": {"description": "`<op>.ok`", "content": {"application/json": {"schema": object(reply)}}},
            "default": {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        }
    }})
}

pub async fn document() -> Json<Value> {
    Json(json!({
        "openapi": "3.1.0",
        "info": {"title": "Tidemark", "version": env!("CARGO_PKG_VERSION")},
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "device access token from /v1/login"},
                "admin": {"type": "http", "scheme": "bearer", "description": "TIDEMARK_ADMIN_TOKEN"}
            },
            "schemas": {"Error": object(&["t", "rid", "code", "message", "retry_after_ms", "sync_generation"])}
        },
        "paths": {
            "/v1/admin/users": secured("Create a user (admin token)", "admin", &["user", "password"], &["user", "created"]),
            "/v1/login": secured("Log a device in", "", &["user", "password", "device_id", "device_name"],
                &["user", "device_id", "access_token", "expires_in", "refresh_token"]),
            "/v1/refresh": secured("Rotate a refresh token", "", &["refresh_token"],
                &["user", "device_id", "access_token", "expires_in", "refresh_token"]),
            "/v1/rpc/send": rpc("Send a message (S1-S4)", &["conv", "client_msg_id", "kind", "content"],
                &["message_id", "conv", "msg_seq", "created_at", "duplicate"]),
            "/v1/rpc/sync": rpc("Pull a page of the user sync log (D1-D5)",
                &["sync_generation", "local_applied_sync_seq", "limit", "batch_token", "cursor"],
                &["sync_generation", "resume_from", "batch_high_watermark", "server_acked_sync_seq", "events",
                  "next_cursor", "has_more", "batch_token"]),
            "/v1/rpc/ack": rpc("Cumulative sync ACK (D4)", &["batch_token", "sync_seq"], &["acked_sync_seq", "sync_generation"]),
            "/v1/rpc/conv.create": rpc("Create a conversation (G1)", &["kind", "members", "client_msg_id"], &["conv", "kind", "members", "created"]),
            "/v1/rpc/snapshot.begin": rpc("Build a snapshot at a frozen base (D7)", &[],
                &["snapshot_id", "snapshot_token", "sync_generation", "base_sync_seq", "manifest_digest", "pages"]),
            "/v1/rpc/snapshot.page": rpc("One page of a snapshot (D7)", &["snapshot_token", "page"], &["page", "pages", "items"]),
            "/v1/rpc/snapshot.ack": rpc("Install a snapshot: the cursor moves to its base (D7)", &["snapshot_token"],
                &["acked_sync_seq", "sync_generation"]),
            "/v1/rpc/conv.list": rpc("List conversations with unread (R2)", &[], &["conversations"]),
            "/v1/rpc/device.revoke": rpc("Revoke a device (P5)", &["device_id"], &["device_id", "revoked"]),
            "/v1/rpc/ping": rpc("Liveness of the caller's session", &[], &[]),
            "/v1/rpc/conv.add": rpc("Add a member to a group (G1)", &["conv", "user", "client_msg_id"], &["conv", "msg_seq"]),
            "/v1/rpc/conv.remove": rpc("Remove a member (owner only, G1)", &["conv", "user", "client_msg_id"], &["conv", "msg_seq"]),
            "/v1/rpc/conv.leave": rpc("Leave a group (G1)", &["conv", "client_msg_id"], &["conv", "msg_seq"]),
            "/v1/rpc/conv.sync": rpc("Per-conversation incremental sync (C1-C2)", &["conv", "after", "limit", "epoch"],
                &["conv", "epoch", "min_seq", "head", "next_after", "has_more", "trimmed", "events"]),
            "/v1/rpc/history": rpc("History backwards by before_seq (C3)", &["conv", "before_seq", "limit"],
                &["messages", "next_cursor", "has_more"]),
            "/v1/rpc/recall": rpc("Recall a message (E1)", &["conv", "message_id", "client_msg_id"], &["msg_seq", "version"]),
            "/v1/rpc/edit": rpc("Edit a message (E2)", &["conv", "message_id", "content", "base_version", "client_msg_id"],
                &["msg_seq", "version"]),
            "/v1/rpc/react": rpc("Add or remove a reaction (E2)", &["conv", "message_id", "reaction", "op", "client_msg_id"],
                &["msg_seq", "version", "changed"]),
            "/v1/rpc/conv.settings": rpc("Mute or pin for the caller (E3)", &["conv", "muted", "pinned"], &["conv", "muted", "pinned"]),
            "/v1/rpc/read": rpc("Move the read cursor (R1-R3)", &["conv", "read_to_seq"], &["conv", "read_seq", "unread"]),
            "/v1/rpc/delivery.ack": rpc("Record per-device delivery (R1)", &["message_ids"], &["recorded"]),
            "/v1/rpc/message.delete": rpc("Delete a message for the caller only (E3)", &["conv", "message_id"], &["conv", "message_id"]),
            "/v1/admin/conv/epoch": secured("Bump a conversation's epoch (admin token)", "admin", &["conv"], &["conv", "epoch"]),
            "/v1/admin/unread/rebuild": secured("Rebuild unread counts from the facts (admin token)", "admin", &[], &["rows_checked", "drifted"]),
            "/v1/ws": {"get": {"summary": "WebSocket upgrade; frames as in docs/protocol.md",
                "responses": {"101": {"description": "switching protocols"}}}},
            "/healthz": {"get": {"responses": {"200": {"description": "ok"}}}},
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text format"}}}}
        }
    }))
}
