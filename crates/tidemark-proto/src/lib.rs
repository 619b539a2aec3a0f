//! The Tidemark wire protocol: every JSON shape that crosses the network.
//!
//! This crate owns the names fixed by `shared/spec/PROTOCOL.md` (operation
//! names, field names, error codes) and is the only crate that derives
//! `Serialize`/`Deserialize` for wire types. It knows nothing about storage,
//! sockets or the domain rules; the server and client convert explicitly.
//!
//! A WebSocket frame is one JSON object with `"t"` (operation) and `"rid"`
//! (request id) beside the operation's own fields; over HTTP the same body
//! travels without `t`/`rid`. [`split_frame`] and [`reply_frame`] do that
//! framing so that both transports share one handler per operation.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

pub mod content;
pub mod ephemeral;
pub mod error;
#[cfg(feature = "openapi")]
pub mod openapi;
pub mod push;
pub mod whole;
pub use ephemeral::*;
pub use error::{ErrorCode, ErrorFrame};

/// Largest WebSocket frame or HTTP body the server accepts, in bytes.
pub const FRAME_BYTES_MAX: usize = 256 * 1024;
/// Largest serialized message `content`, in bytes.
pub const CONTENT_BYTES_MAX: usize = 64 * 1024;
/// Longest `conv` or `message_id` a request may name, in bytes.
pub const ID_BYTES_MAX: usize = 64;
/// The identifier bounds the domain validates (`tidemark_core::ids`):
/// user names, device ids, `client_msg_id`s and message kinds, in bytes.
/// The bound of one `client.stats` report's counts (`tidemark_core::client_stats`).
pub use tidemark_core::client_stats::{
    CLIENT_STATS_COUNT_MAX, CLIENT_STATS_DURATIONS_MAX, CLIENT_STATS_DURATION_MS_MAX,
};
pub use tidemark_core::ids::{CLIENT_MSG_ID_BYTES_MAX, DEVICE_ID_BYTES_MAX, KIND_BYTES_MAX, USER_BYTES_MAX};
pub use tidemark_core::mention::{MENTIONS_MAX, MENTION_ALL_MEMBERS_MAX};
/// Longest reaction, in bytes.
pub const REACTION_BYTES_MAX: usize = 32;
/// Longest accepted password, in bytes (argon2 cost is bounded by input).
pub const PASSWORD_BYTES_MAX: usize = 1024;
/// A device name longer than this many characters is cut to it.
pub const DEVICE_NAME_CHARS_MAX: usize = 128;
/// Default and largest page of a `sync` call.
pub const SYNC_LIMIT_DEFAULT: u32 = 100;
pub const SYNC_LIMIT_MAX: u32 = 1000;
/// A sync page stops adding events once their contents reach this many
/// bytes (it always carries at least one), so a reply stays a bounded frame.
pub const SYNC_PAGE_BYTES_MAX: usize = 1024 * 1024;
/// Default and largest page of a paged `conv.list` (one that sends `limit`
/// or `after`; one that sends neither gets every conversation at once).
pub const CONV_LIST_LIMIT_DEFAULT: u32 = 200;
pub const CONV_LIST_LIMIT_MAX: u32 = 1000;
/// Default and largest page of `conv.sync`.
pub const CONV_SYNC_LIMIT_DEFAULT: u32 = 50;
pub const CONV_SYNC_LIMIT_MAX: u32 = 200;
/// Default and largest page of `history` (seed 003 caps pages at 50).
pub const HISTORY_LIMIT_DEFAULT: u32 = 20;
pub const HISTORY_LIMIT_MAX: u32 = 50;
/// Default and largest page of `conv.members` (a group may have up to
/// `tidemark_core::membership::GROUP_MEMBERS_MAX` members).
pub const CONV_MEMBERS_LIMIT_DEFAULT: u32 = 100;
pub const CONV_MEMBERS_LIMIT_MAX: u32 = 500;

/// Operation names, exactly as the contract spells them.
pub mod op {
    pub const AUTH: &str = "auth";
    pub const SEND: &str = "send";
    pub const SYNC: &str = "sync";
    pub const ACK: &str = "ack";
    pub const CONV_CREATE: &str = "conv.create";
    pub const CONV_LIST: &str = "conv.list";
    pub const DEVICE_REVOKE: &str = "device.revoke";
    pub const PING: &str = "ping";
    pub const CONV_ADD: &str = "conv.add";
    pub const CONV_REMOVE: &str = "conv.remove";
    pub const CONV_LEAVE: &str = "conv.leave";
    pub const CONV_SYNC: &str = "conv.sync";
    pub const HISTORY: &str = "history";
    pub const RECALL: &str = "recall";
    pub const EDIT: &str = "edit";
    pub const REACT: &str = "react";
    pub const CONV_SETTINGS: &str = "conv.settings";
    pub const READ: &str = "read";
    pub const DELIVERY_ACK: &str = "delivery.ack";
    pub const SNAPSHOT_BEGIN: &str = "snapshot.begin";
    pub const SNAPSHOT_PAGE: &str = "snapshot.page";
    pub const SNAPSHOT_ACK: &str = "snapshot.ack";
    /// Tidemark extension: delete a message for the caller only (E3).
    pub const MESSAGE_DELETE: &str = "message.delete";
    /// Clear a large group's dirty marker (G2).
    pub const DIRTY_CLEAR: &str = "dirty.clear";
    /// Tidemark extensions of the ephemeral lane and receipts (issue 18).
    pub const TYPING: &str = "typing";
    pub const PRESENCE_SET: &str = "presence.set";
    pub const PRIVACY_SET: &str = "privacy.set";
    pub const CONV_RECEIPTS: &str = "conv.receipts";
    pub const DELIVERY_RECEIPTS: &str = "delivery.receipts";
    /// The caller's devices (P5).
    pub const DEVICE_LIST: &str = "device.list";
    /// Change the caller's password (P1).
    pub const ACCOUNT_PASSWORD: &str = "account.password";
    /// Offline push targets of the caller's devices (P4, issue 20).
    pub const PUSH_REGISTER: &str = "push.register";
    pub const PUSH_LIST: &str = "push.list";
    pub const PUSH_REMOVE: &str = "push.remove";
    /// Tidemark extension: a conversation's current members, paged (G1).
    pub const CONV_MEMBERS: &str = "conv.members";
    /// Tidemark extension: a device reports the gaps only it sees (O1).
    pub const CLIENT_STATS: &str = "client.stats";
    /// Every operation this server implements, for docs and OpenAPI.
    pub const ALL: &[&str] = &[
        SEND,
        SYNC,
        ACK,
        CONV_CREATE,
        CONV_LIST,
        CONV_ADD,
        CONV_REMOVE,
        CONV_LEAVE,
        CONV_MEMBERS,
        CONV_SYNC,
        HISTORY,
        RECALL,
        EDIT,
        REACT,
        CONV_SETTINGS,
        READ,
        DELIVERY_ACK,
        MESSAGE_DELETE,
        DIRTY_CLEAR,
        SNAPSHOT_BEGIN,
        SNAPSHOT_PAGE,
        SNAPSHOT_ACK,
        DEVICE_REVOKE,
        DEVICE_LIST,
        ACCOUNT_PASSWORD,
        PING,
        TYPING,
        PRESENCE_SET,
        PRIVACY_SET,
        CONV_RECEIPTS,
        DELIVERY_RECEIPTS,
        CLIENT_STATS,
        PUSH_REGISTER,
        PUSH_LIST,
        PUSH_REMOVE,
    ];
}

/// Server-initiated frame types.
pub mod server_frame {
    pub const HINT: &str = "hint";
    pub const KICKED: &str = "kicked";
    /// Ephemeral frames (issue 18): never in a sync log, shed first.
    pub const TYPING: &str = "typing";
    pub const PRESENCE: &str = "presence";
    /// Several `presence` entries in one frame, to a connection that opted
    /// in ([`crate::AuthReq::presence_batch`], [`crate::WsQuery`]).
    pub const PRESENCE_BATCH: &str = "presence.batch";
}

/// A client frame split into its operation, request id and body.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub t: String,
    pub rid: Option<String>,
    pub body: Value,
}

/// Splits a WebSocket text frame into `t`, `rid` and the remaining body.
/// A frame that is not a JSON object with a string `t` is `BAD_REQUEST`;
/// the `rid`, when it could be read, is returned so the error can echo it.
pub fn split_frame(text: &str) -> Result<Frame, (Option<String>, String)> {
    let value: Value = serde_json::from_str(text).map_err(|e| (None, format!("malformed JSON: {e}")))?;
    let Value::Object(mut map) = value else {
        return Err((None, "frame must be a JSON object".into()));
    };
    let rid = match map.remove("rid") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(_) => return Err((None, "rid must be a string".into())),
    };
    let t = match map.remove("t") {
        Some(Value::String(t)) => t,
        _ => return Err((rid, "missing operation \"t\"".into())),
    };
    Ok(Frame { t, rid, body: Value::Object(map) })
}

/// Builds the reply frame `{"t": "<op>.ok", "rid": .., ...reply}`.
pub fn reply_frame(op: &str, rid: Option<&str>, reply: Value) -> Value {
    let mut map = match reply {
        Value::Object(map) => map,
        Value::Null => Map::new(),
        other => {
            let mut m = Map::new();
            m.insert("value".into(), other);
            m
        }
    };
    map.insert("t".into(), Value::String(format!("{op}.ok")));
    if let Some(rid) = rid {
        map.insert("rid".into(), Value::String(rid.to_owned()));
    }
    Value::Object(map)
}

/// [`reply_frame`] on a reply already serialized: the reply's text is
/// spliced in verbatim (JSON text stored by the server goes to the wire
/// without being parsed and re-serialised), `t` and `rid` first.
pub fn reply_frame_text(op: &str, rid: Option<&str>, reply: &RawValue) -> String {
    let body = reply.get().trim();
    let mut out = String::with_capacity(body.len() + op.len() + rid.map_or(0, str::len) + 24);
    out.push_str("{\"t\":");
    out.push_str(&Value::String(format!("{op}.ok")).to_string());
    if let Some(rid) = rid {
        out.push_str(",\"rid\":");
        out.push_str(&Value::String(rid.to_owned()).to_string());
    }
    match body.strip_prefix('{').and_then(|b| b.strip_suffix('}')).map(str::trim) {
        Some("") => {}
        Some(fields) => {
            out.push(',');
            out.push_str(fields);
        }
        None if body == "null" => {}
        None => {
            out.push_str(",\"value\":");
            out.push_str(body);
        }
    }
    out.push('}');
    out
}

/// JSON text as the server stored it, put on the wire verbatim (never
/// parsed into a [`Value`] and serialised again): the `C` of the server's
/// [`SyncOk`], [`UserEvent`] and [`Envelope`]. Readers use the default,
/// `Value`; both have the same JSON.
pub type RawJson = Box<RawValue>;

// ---------------------------------------------------------------- accounts

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminUserReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::user))]
    pub user: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::password))]
    pub password: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminUserOk {
    pub user: String,
    pub created: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LoginReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::user))]
    pub user: String,
    pub password: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::device_id))]
    pub device_id: String,
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::device_name))]
    pub device_name: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LoginOk {
    pub user: String,
    pub device_id: String,
    pub access_token: String,
    /// Seconds until `access_token` expires.
    pub expires_in: u64,
    pub refresh_token: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RefreshReq {
    pub refresh_token: String,
}

/// First WebSocket frame when the upgrade carried no `Authorization` header.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuthReq {
    pub token: String,
    /// `true`: this connection takes `presence.batch` frames (its
    /// waiting presence entries in one frame per wake, the answer of its
    /// audience in one frame). Absent or `false`: one `presence` frame
    /// per entry, as before (docs/protocol.md §4.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_batch: Option<bool>,
}

/// The query of the WebSocket upgrade, `GET /v1/ws?presence_batch=true`:
/// the way a client authenticating with the `Authorization` header (which
/// sends no `auth` frame) opts in to `presence.batch` frames, as
/// [`AuthReq::presence_batch`] does for the first-frame way. Unknown
/// parameters are ignored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WsQuery {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_batch: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuthOk {
    pub user: String,
    pub device_id: String,
    /// Increases with every new connection on this server process; a newer
    /// connection of the same device supersedes the older one (P2).
    pub connection_epoch: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeviceRevokeReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::device_id))]
    pub device_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeviceRevokeOk {
    pub device_id: String,
    /// False when the device was already revoked.
    pub revoked: bool,
}

/// One device of the caller, as `device.list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeviceInfo {
    pub device_id: String,
    pub name: String,
    /// When the device first logged in (ms since the epoch).
    pub created_at: i64,
    /// Its last login or cursor move (ms since the epoch).
    pub last_seen_at: i64,
    /// `NEW`, `ACTIVE`, `RESETTING`, `RECOVERING` or `REVOKED`.
    pub state: String,
    /// True for the device that asked.
    pub current: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeviceListOk {
    pub devices: Vec<DeviceInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AccountPasswordReq {
    pub old_password: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::password))]
    pub new_password: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AccountPasswordOk {
    /// The refresh tokens of the caller's other devices were deleted.
    pub other_devices_logged_out: bool,
}

/// `POST /v1/admin/logout`: end the sessions of a user, or of one device.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminLogoutReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::user))]
    pub user: String,
    /// Only this device; absent: every device of the user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminLogoutOk {
    pub user: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
}

/// `POST /v1/admin/deactivate`: end every session of a user for good.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminDeactivateReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::user))]
    pub user: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminDeactivateOk {
    pub user: String,
    /// False when the account was deactivated already.
    pub deactivated: bool,
}

/// `POST /v1/admin/delete`: delete a user (its devices, log and cursors).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminDeleteReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::user))]
    pub user: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminDeleteOk {
    pub user: String,
    /// False when the account was deleted already.
    pub deleted: bool,
}

/// Entries one `POST /v1/admin/audit` returns by default, and at most.
pub const AUDIT_LIMIT_DEFAULT: u32 = 100;
pub const AUDIT_LIMIT_MAX: u32 = 1000;

/// `POST /v1/admin/audit`: audit entries by user and time range.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminAuditReq {
    /// Only this user's entries (the name, hashed by the server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// From this time on (ms since the epoch, inclusive); default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_ms: Option<i64>,
    /// Before this time (exclusive); default: no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_ms: Option<i64>,
    /// 1..=1000, default 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// One audit log entry: ids are keyed hashes; never a secret or a body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditEntryOut {
    pub at_ms: i64,
    pub event: String,
    pub actor: String,
    pub user_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminAuditOk {
    /// Oldest first; when `limit` entries came back, ask again from the
    /// last one's `at_ms` for more.
    pub entries: Vec<AuditEntryOut>,
}

// ---------------------------------------------------------- conversations

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvCreateReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv_kind))]
    pub kind: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::users))]
    pub members: Vec<String>,
    /// Groups: an optional idempotency key; a retry returns the same group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::client_msg_id))]
    pub client_msg_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvCreateOk {
    pub conv: String,
    pub kind: String,
    pub members: Vec<String>,
    /// False when the direct pair already had its conversation.
    pub created: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvSummary {
    pub conv: String,
    pub kind: String,
    pub last_msg_seq: u64,
    pub read_seq: u64,
    pub unread: u64,
    /// Unread messages that mention the caller (by name or everyone),
    /// apart from `unread` (issue 18); `read` clears them up to its
    /// `read_to_seq`. Shared mode: counted up to the same cap as unread.
    #[serde(default)]
    pub mentions: u64,
    pub muted: bool,
    pub pinned: bool,
    /// False once the caller left or was removed (history stays readable).
    pub active: bool,
    /// `per_member` or `shared` (large groups, G2). Absent means
    /// `per_member` (servers before large groups).
    #[serde(default = "per_member", skip_serializing_if = "is_per_member")]
    pub mode: String,
    /// Shared mode: the caller's marker. `dirty_target_msg_seq` only grows
    /// (the highest `msg_seq` the caller may read that is published),
    /// `dirty_version` only increments; `dirty` says whether this device
    /// has cleared up to the target. Pull `conv.sync` from the device's own
    /// `last_msg_seq`, then `dirty.clear` with the version read here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_target_msg_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_version: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty: Option<bool>,
    /// Shared mode: `unread` reached its cap (999) and reads as it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub unread_capped: bool,
    /// The caller's push preview preference for this conversation (P4,
    /// `conv.settings`); absent means `full`, the default, which narrows
    /// nothing.
    #[serde(default = "preview_full", skip_serializing_if = "is_preview_full")]
    pub push_preview: push::PreviewLevel,
}

fn preview_full() -> push::PreviewLevel {
    push::PreviewLevel::Full
}

fn is_preview_full(level: &push::PreviewLevel) -> bool {
    *level == push::PreviewLevel::Full
}

fn per_member() -> String {
    "per_member".into()
}

impl Default for ConvSummary {
    /// An empty per-member conversation row (a base for struct updates).
    fn default() -> Self {
        ConvSummary {
            conv: String::new(),
            kind: String::new(),
            last_msg_seq: 0,
            read_seq: 0,
            unread: 0,
            mentions: 0,
            muted: false,
            pinned: false,
            active: true,
            mode: per_member(),
            dirty_target_msg_seq: None,
            dirty_version: None,
            dirty: None,
            unread_capped: false,
            push_preview: push::PreviewLevel::Full,
        }
    }
}

fn is_per_member(mode: &str) -> bool {
    mode == "per_member"
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A shared group's marker, as `sync` (its last page) and hints carry it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DirtyMarker {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    pub dirty_target_msg_seq: u64,
    pub dirty_version: u64,
}

/// `dirty.clear` (G2): after pulling `conv` up to at least the marker's
/// target and saving `last_msg_seq` locally, clear with the version read.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DirtyClearReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[serde(deserialize_with = "whole::int")]
    pub dirty_version: u64,
    #[serde(deserialize_with = "whole::int")]
    pub last_msg_seq: u64,
}

/// `cleared: false`: the version moved or `last_msg_seq` is below the
/// target; the marker stays dirty: pull again from `last_msg_seq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DirtyClearOk {
    pub conv: String,
    pub cleared: bool,
    /// The marker as it now is.
    pub dirty_target_msg_seq: u64,
    pub dirty_version: u64,
}

/// `conv.add`, `conv.remove` (`user` required) and `conv.leave`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvMemberReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::user))]
    pub user: Option<String>,
    /// Optional idempotency key; a retry returns the original event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::client_msg_id))]
    pub client_msg_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvMemberOk {
    pub conv: String,
    /// The membership event's position in the conversation.
    pub msg_seq: u64,
}

/// `client.stats`: the gaps a device saw that the server cannot (K5
/// repairs): counts since the device's last accepted report, and the
/// repairs waiting now. Each is clamped to `CLIENT_STATS_COUNT_MAX`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClientStatsReq {
    /// Conversations queued for repair since the last report.
    #[serde(default, deserialize_with = "whole::int")]
    pub gaps_detected: u64,
    /// Repairs completed since the last report.
    #[serde(default, deserialize_with = "whole::int")]
    pub gaps_repaired: u64,
    /// Repairs waiting on the device now.
    #[serde(default, deserialize_with = "whole::int")]
    pub repairs_pending: u64,
    /// How long each repair-queue repair (K5) completed since the last
    /// report took, from queueing to repair, in ms. At most
    /// `CLIENT_STATS_DURATIONS_MAX` count, each clamped to
    /// `CLIENT_STATS_DURATION_MS_MAX`. Absent from older clients.
    #[serde(default, deserialize_with = "whole::ints", skip_serializing_if = "Vec::is_empty")]
    pub repair_ms: Vec<u64>,
    /// The same for holes in a conversation's `msg_seq` (its cursor left
    /// with a missing run) that closed since the last report: from the
    /// write that opened the hole to the one that closed it, in ms.
    #[serde(default, deserialize_with = "whole::ints", skip_serializing_if = "Vec::is_empty")]
    pub hole_ms: Vec<u64>,
}

/// The report as the server counted it (after clamping).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClientStatsOk {
    pub gaps_detected: u64,
    pub gaps_repaired: u64,
    pub repairs_pending: u64,
    /// Repair durations recorded (both kinds, after capping); 0 from a
    /// server that predates them.
    #[serde(default)]
    pub durations_recorded: u64,
}

/// `conv.members`: one page of a conversation's current members, by user
/// id; a current member only may ask.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvMembersReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    /// The page starts after this user id (the previous page's
    /// `next_after`); the first page omits it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::user))]
    pub after: Option<String>,
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv_members_limit))]
    pub limit: Option<u32>,
}

/// One current member and the `msg_seq` their membership period opened at
/// (the group's creation for its first members, else their `member.join`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvMember {
    pub user: String,
    pub joined_seq: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvMembersOk {
    pub conv: String,
    /// The group's owner (who may remove members); null for a direct
    /// conversation.
    pub owner: Option<String>,
    /// The `msg_seq` of the last membership change: a reader paging a list
    /// that changed between two pages sees it move, and starts again.
    pub members_seq: u64,
    /// By user id, at most `limit`.
    pub members: Vec<ConvMember>,
    /// `after` of the next page; null when `has_more` is false.
    pub next_after: Option<String>,
    pub has_more: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvSyncReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[serde(default, deserialize_with = "whole::int")]
    pub after: u64,
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv_sync_limit))]
    pub limit: Option<u32>,
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvSyncOk {
    pub conv: String,
    pub epoch: u64,
    pub min_seq: u64,
    pub head: u64,
    pub next_after: u64,
    pub has_more: bool,
    pub trimmed: bool,
    pub events: Vec<Envelope>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HistoryReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    pub before_seq: Option<u64>,
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::history_limit))]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HistoryOk {
    /// Newest first.
    pub messages: Vec<Envelope>,
    /// `before_seq` of the next (older) page; null when `has_more` is false.
    pub next_cursor: Option<u64>,
    pub has_more: bool,
    /// Tidemark extension (L3): the lowest `msg_seq` the server retains.
    #[serde(default)]
    pub history_start: u64,
    /// Tidemark extension (L3): the page stops at the retention boundary:
    /// older history inside the caller's view existed and was removed.
    #[serde(default)]
    pub trimmed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RecallReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::message_id))]
    pub message_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::client_msg_id))]
    pub client_msg_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RecallOk {
    /// The recall event's `msg_seq`.
    pub msg_seq: u64,
    pub version: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EditReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::message_id))]
    pub message_id: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::object))]
    pub content: Value,
    #[serde(deserialize_with = "whole::int")]
    pub base_version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::client_msg_id))]
    pub client_msg_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EditOk {
    pub msg_seq: u64,
    pub version: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReactReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::message_id))]
    pub message_id: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::reaction))]
    pub reaction: String,
    /// `add` or `remove`.
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::react_op))]
    pub op: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::client_msg_id))]
    pub client_msg_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReactOk {
    /// The reaction event's `msg_seq` (0 when a remove changed nothing).
    pub msg_seq: u64,
    pub version: u64,
    /// False when the reaction was already in the requested state.
    pub changed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvSettingsReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub muted: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<bool>,
    /// What an offline push of this conversation may say (P4): the most
    /// private of this, the user's preference (`privacy.set`) and the
    /// device's level wins. Default `full`, which narrows nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push_preview: Option<push::PreviewLevel>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvSettingsOk {
    pub conv: String,
    pub muted: bool,
    pub pinned: bool,
    pub push_preview: push::PreviewLevel,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReadReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[serde(deserialize_with = "whole::int")]
    pub read_to_seq: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReadOk {
    pub conv: String,
    pub read_seq: u64,
    pub unread: u64,
    /// Mentions left above `read_seq` (issue 18).
    #[serde(default)]
    pub mentions: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryAckReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::message_ids))]
    pub message_ids: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryAckOk {
    /// How many (message, device) deliveries were new.
    pub recorded: u64,
}

/// `message.delete.ok`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MessageDeleteOk {
    pub conv: String,
    pub message_id: String,
}

/// The body of an operation that takes no fields (`conv.list`, `ping`,
/// `snapshot.begin`) and the reply of `ping`: `{}`. Unknown fields are
/// ignored, like everywhere else.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Empty {}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MessageDeleteReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::message_id))]
    pub message_id: String,
}

/// `snapshot.begin` (D7): no request fields.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotBeginOk {
    pub snapshot_id: String,
    pub snapshot_token: String,
    /// The generation the snapshot belongs to; sync with it afterwards.
    pub sync_generation: u64,
    /// The frozen `sync_seq` the snapshot reflects; after `snapshot.ack`
    /// the device's cursor is here and incremental sync continues from it.
    pub base_sync_seq: u64,
    /// Hex SHA-256 over every item of every page, in order, each as
    /// canonical JSON (keys sorted, no whitespace) followed by `\n`.
    pub manifest_digest: String,
    pub pages: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotPageReq {
    pub snapshot_token: String,
    #[serde(deserialize_with = "whole::int")]
    pub page: u32,
}

/// One item of a snapshot page: a conversation summary, or one message of
/// the conversation named by the last `conv` item before it, or the user's
/// privacy switches at the base (issue 18; the first item, present once
/// the user has ever changed them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SnapshotItem {
    Conv(ConvSummary),
    Message { message: Envelope },
    Privacy(PrivacySnapshot),
}

/// The user's privacy switches in a snapshot, as the last `privacy` user
/// event at or below the base set them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PrivacySnapshot {
    pub hide_presence: bool,
    pub private_receipts: bool,
    pub push_preview: push::PreviewLevel,
    /// The switches' version (moved by each change).
    pub version: u64,
}

/// One page of a snapshot: items `{"type":"conv",…}` (a conversation
/// summary) each followed by its `{"type":"message","message":{…}}` items.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotPageOk {
    pub page: u32,
    pub pages: u32,
    /// [`SnapshotItem`]s, kept as JSON values so the client hashes exactly
    /// what was sent (and skips item types it does not know).
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<SnapshotItem>))]
    pub items: Vec<Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotAckReq {
    pub snapshot_token: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotAckOk {
    pub acked_sync_seq: u64,
    pub sync_generation: u64,
}

/// The canonical form of a snapshot item, as hashed
/// into the manifest digest (serde_json sorts object keys).
pub fn canonical_item(item: &Value) -> String {
    serde_json::to_string(item).expect("a JSON value serializes")
}

/// Admin: bump a conversation's epoch.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminEpochReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminEpochOk {
    pub conv: String,
    pub epoch: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminUnreadOk {
    pub rows_checked: u64,
    pub drifted: u64,
}

/// `POST /v1/admin/reconcile` (O3): one reconciliation run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminReconcileReq {
    /// Find and report only; repair nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// What a reconciliation run checked, found and repaired.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminReconcileOk {
    pub dry_run: bool,
    pub messages_checked: u64,
    pub convs_checked: u64,
    pub users_checked: u64,
    pub unread_rows_checked: u64,
    /// Bounded read chunks the run went through.
    pub chunks: u64,
    pub found: u64,
    /// Findings whose repair was applied and changed something.
    pub repaired: u64,
    /// Findings with no safe repair: for a person.
    pub reported: u64,
    /// Counts per relation that found something.
    pub relations: Vec<ReconcileRelation>,
    /// The first findings (at most 1000).
    pub findings: Vec<ReconcileFinding>,
    /// Findings beyond the list, counted only.
    pub findings_left_off: u64,
    /// Fan-out items quarantined for overlapping membership periods (the
    /// first 1000), never delivered to that user.
    pub quarantine: Vec<QuarantineEntry>,
    pub quarantine_total: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReconcileRelation {
    /// `fanout`, `periods`, `event_source`, `ack_head`, `conv_head`, `unread`.
    pub relation: String,
    pub found: u64,
    pub repaired: u64,
    pub reported: u64,
}

/// One broken relation; absent fields do not apply to it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReconcileFinding {
    pub relation: String,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub msg_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period_id: Option<i64>,
    /// What is stored (an unread count, an ACK, a head).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored: Option<u64>,
    /// What the facts say it should be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fact: Option<u64>,
    /// `requeue` or `recount`; absent: for a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repair: Option<String>,
    pub repaired: bool,
}

/// One quarantine record (F4).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QuarantineEntry {
    pub source_event_id: String,
    pub user: String,
    pub conv: String,
    pub msg_seq: u64,
    pub reason: String,
    pub created_at_ms: i64,
}

/// `conv.list`. With neither field: every conversation, in list order
/// (pinned first, then most recent `last_msg_seq`, then `conv`), as before
/// paging existed. With `limit` or `after`: one page of at most `limit`
/// conversations in `conv` order, those after `after`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvListReq {
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv_list_limit))]
    pub limit: Option<u32>,
    /// The `next_after` of the previous page (a conversation id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub after: Option<String>,
}

impl ConvListReq {
    /// Whether the caller asked for a page.
    pub fn paged(&self) -> bool {
        self.limit.is_some() || self.after.is_some()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConvListOk {
    pub conversations: Vec<ConvSummary>,
    /// Paged replies only: whether conversations follow this page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub has_more: Option<bool>,
    /// Paged replies with `has_more` only: the `after` of the next page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<String>,
}

// ------------------------------------------------------------------ send

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SendReq {
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::conv))]
    pub conv: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::client_msg_id))]
    pub client_msg_id: String,
    #[serde(default = "default_kind")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::kind))]
    pub kind: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::object))]
    pub content: Value,
    /// Users this message mentions (issue 18), at most
    /// `tidemark_core::mention::MENTIONS_MAX`; each mentioned member's
    /// `mentions` count grows apart from unread. The sender is left out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::mentions))]
    pub mentions: Vec<String>,
    /// Mentions every member: allowed in a direct conversation, for the
    /// group's owner, or in a group of at most
    /// `tidemark_core::mention::MENTION_ALL_MEMBERS_MAX` members
    /// (`FORBIDDEN` otherwise).
    #[serde(default, skip_serializing_if = "is_false")]
    pub mention_all: bool,
}

fn default_kind() -> String {
    "text".into()
}

/// `send.ok` states only that the message was accepted (S4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SendOk {
    pub message_id: String,
    pub conv: String,
    pub msg_seq: u64,
    /// Server time of acceptance, milliseconds since the Unix epoch.
    pub created_at: i64,
    /// True when this `client_msg_id` had already been accepted.
    pub duplicate: bool,
}

// ------------------------------------------------------------------ sync

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SyncReq {
    /// Omitted by a device with no local state.
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    pub sync_generation: Option<u64>,
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    pub local_applied_sync_seq: Option<u64>,
    #[serde(default, deserialize_with = "whole::opt", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::sync_limit))]
    pub limit: Option<u32>,
    /// Next pages: the token of the first page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_token: Option<String>,
    /// Next pages: `next_cursor` of the previous page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
}

/// A sync page. `C` is how JSON payloads are held: `Value` for readers,
/// [`RawJson`] where the server splices stored text in verbatim.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(bound(deserialize = "C: Deserialize<'de>"))]
pub struct SyncOk<C = Value> {
    pub sync_generation: u64,
    pub resume_from: u64,
    pub batch_high_watermark: u64,
    pub server_acked_sync_seq: u64,
    pub events: Vec<UserEvent<C>>,
    pub next_cursor: Option<String>,
    pub has_more: bool,
    pub batch_token: String,
    /// On the page that ends a batch (`has_more: false`): the caller's
    /// large groups whose marker is dirty for this device (G2).
    #[serde(default = "Vec::new", skip_serializing_if = "Vec::is_empty")]
    pub dirty: Vec<DirtyMarker>,
}

/// One entry of a user's sync log (`C`: see [`SyncOk`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(bound(deserialize = "C: Deserialize<'de>"))]
pub struct UserEvent<C = Value> {
    pub sync_seq: u64,
    /// `message`, `membership`, `recall`, `edit`, `reaction` (conversation
    /// events, with `message`), `read`, `settings`, `delete`, `privacy`
    /// (per-user events, with `data`). Clients skip kinds they do not know.
    pub kind: String,
    /// The conversation concerned; empty for `privacy`.
    pub conv: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub msg_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Envelope<C>>,
    /// The payload of per-user events (`read`, `settings`, `delete`, `privacy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::object))]
    pub data: Option<C>,
}

/// The unified message envelope (C4; `C`: see [`SyncOk`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(bound(deserialize = "C: Deserialize<'de>"))]
pub struct Envelope<C = Value> {
    pub message_id: String,
    pub conv: String,
    pub msg_seq: u64,
    pub kind: String,
    /// `normal`, `edited`, `recalled` (content is `{}`), or `deleted` (the
    /// reader deleted it for themselves; content is `{}`).
    pub state: String,
    pub sender: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::object))]
    pub content: C,
    pub created_at: i64,
    /// Bumped by every edit, reaction and recall: apply an event only if
    /// its version is higher than the one you hold (E2).
    #[serde(default)]
    pub version: u64,
    /// Reactions by kind, with the users who reacted.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub reactions: std::collections::BTreeMap<String, Vec<String>>,
    /// The users the message mentions, as stored (issue 18).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mentions: Vec<String>,
    /// The message mentions every member.
    #[serde(default, skip_serializing_if = "is_false")]
    pub mention_all: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AckReq {
    pub batch_token: String,
    #[serde(deserialize_with = "whole::int")]
    pub sync_seq: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AckOk {
    /// The device's cursor after this ACK (never lower than before it).
    pub acked_sync_seq: u64,
    pub sync_generation: u64,
}

// --------------------------------------------------------- server frames

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Hint {
    pub user_sync_high_watermark: u64,
    pub reason: String,
    /// Reason `conv_moved`: a large group the user is in moved (G2); its
    /// marker follows. Coalesced per connection and group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_target_msg_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_version: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Kicked {
    pub reason: String,
}

impl Hint {
    /// A hint of the user's log alone.
    pub fn user(user_sync_high_watermark: u64, reason: &str) -> Hint {
        Hint {
            user_sync_high_watermark,
            reason: reason.into(),
            conv: None,
            dirty_target_msg_seq: None,
            dirty_version: None,
        }
    }
}

/// A frame the server sends without a request (no `rid`), tagged by `t`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "t")]
pub enum ServerFrame {
    /// The user's log grew to `user_sync_high_watermark`: sync (D8).
    #[serde(rename = "hint")]
    Hint(Hint),
    /// The server ends the connection; the close frame follows.
    #[serde(rename = "kicked")]
    Kicked(Kicked),
    /// A member of a conversation started or stopped typing (ephemeral).
    #[serde(rename = "typing")]
    Typing(TypingFrame),
    /// A user sharing a conversation changed presence (ephemeral).
    #[serde(rename = "presence")]
    Presence(PresenceFrame),
    /// Several presence entries, applied in order as one `presence` frame
    /// each (ephemeral; only to a connection that opted in).
    #[serde(rename = "presence.batch")]
    PresenceBatch(PresenceBatchFrame),
}

/// The hint bus payload between nodes (cluster mode): a user's log grew to
/// `high_watermark` on the node that published it, or (with `kick`) a
/// fence every node applies to its connections of one of the user's
/// devices. `kick` was added later: absent, the payload is a plain hint,
/// as every earlier build sends; a build that does not know it reads a
/// kick as a hint of watermark 0, which changes nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BusHint {
    pub user: String,
    /// 0 in a kick, a large group's marker or an ephemeral signal.
    pub high_watermark: u64,
    /// A large group moved (G2): `user` is empty, the marker and the
    /// `msg_seq` of its last membership change (`members_seq`, which keys
    /// each node's member cache) follow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv: Option<BusConv>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kick: Option<BusKick>,
    /// A typing or presence signal of `user` (issue 18). Absent on a plain
    /// hint; a node that does not know the field reads the payload as a
    /// hint of watermark 0, which hints nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral: Option<BusEphemeral>,
}

/// The large-group part of a [`BusHint`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BusConv {
    pub conv: String,
    pub target: u64,
    pub version: u64,
    pub members_seq: u64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// A fence carried by the hint bus (P2, P5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BusKick {
    /// The device; empty for a fence of the whole user (`logged_out`
    /// without a device, `account_deactivated`).
    pub device: String,
    /// A `kicked` reason: `device_revoked` (end every connection of the
    /// device and refuse its requests), `superseded` (end its
    /// connections older than `connection_epoch`), `logged_out` (end the
    /// sessions of the device, or of every device of the user, issued up
    /// to `ended_at_ms`) or `account_deactivated` (end all of the user's
    /// sessions and refuse every later one).
    pub reason: String,
    /// The device's newest connection epoch (`superseded`); 0 otherwise.
    #[serde(default)]
    pub connection_epoch: u64,
    /// When the sessions ended (`logged_out`), ms since the epoch; 0 (and
    /// left out of the payload, as older nodes send it) otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ended_at_ms: i64,
}

/// A node's heartbeat on the route subjects (issue 14): every node of a
/// cluster publishes its id periodically, and each node routes
/// conversations among the nodes it heard recently
/// (`tidemark_core::route`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BusNode {
    pub node: String,
}

/// A send forwarded over the bus to the node that owns its conversation
/// (issue 14), as the receiving node validated it: the store command's
/// fields, ids and time included, so the owner writes exactly what the
/// receiving node would have written (and a fallback write of the same
/// command after a lost answer finds it by `(sender, client_msg_id)`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BusSend {
    pub sender: String,
    pub sender_device: String,
    pub conv: String,
    pub client_msg_id: String,
    pub kind: String,
    /// The content, serialized as stored.
    pub content: String,
    pub message_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quote_id: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mentions: Vec<String>,
    #[serde(default)]
    pub mention_all: bool,
    pub now_ms: i64,
    /// The epoch of the WebSocket connection the send came on (absent:
    /// HTTP, any epoch); the owner's store refuses it when the device has
    /// a newer connection (P2), as the forwarding node's store would.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_epoch: Option<u64>,
}

/// The owner's answer to a [`BusSend`]: the `send.ok` it committed, or its
/// refusal; neither when it did not take the request (too busy), and the
/// forwarding node then writes it itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BusSendReply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ok: Option<SendOk>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<BusRefusal>,
}

/// A refusal carried back over the bus, relayed to the client as is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BusRefusal {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

/// `GET /healthz` while the store answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HealthOk {
    /// `ok`.
    pub status: String,
    /// Outbox records not yet fanned out.
    pub outbox_backlog: u64,
}

/// `GET /healthz` (503) while the store does not answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HealthUnavailable {
    /// `unavailable`.
    pub status: String,
    pub error: String,
}

/// Reasons carried by `hint` and `kicked`.
pub mod reason {
    pub const NEW_EVENT: &str = "new_event";
    /// A large group moved: pull it (G2).
    pub const CONV_MOVED: &str = "conv_moved";
    pub const LAGGING_ACK: &str = "lagging_ack";
    pub const SUPERSEDED: &str = "superseded";
    pub const SLOW_CONSUMER: &str = "slow_consumer";
    pub const DEVICE_REVOKED: &str = "device_revoked";
    pub const SHUTDOWN: &str = "shutdown";
    /// The access token of the connection expired: refresh and reconnect.
    pub const TOKEN_EXPIRED: &str = "token_expired";
    /// An operator ended the device's (or its user's) sessions: log in again.
    pub const LOGGED_OUT: &str = "logged_out";
    /// An operator deactivated the account: nothing more is accepted.
    pub const ACCOUNT_DEACTIVATED: &str = "account_deactivated";
    /// The connection kept sending while told to wait (`RATE_LIMITED`
    /// before its `retry_after_ms` passed), more than
    /// `tidemark_core::throttle::IGNORED_WAITS_MAX` times in a row.
    pub const WAITS_IGNORED: &str = "waits_ignored";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_frame_keeps_rid_on_missing_op() {
        let err = split_frame(r#"{"rid":"r1","x":1}"#).unwrap_err();
        assert_eq!(err.0.as_deref(), Some("r1"));
        let err = split_frame("not json").unwrap_err();
        assert_eq!(err.0, None);
        let f = split_frame(r#"{"t":"send","rid":"r2","conv":"c"}"#).unwrap();
        assert_eq!(f.t, "send");
        assert_eq!(f.rid.as_deref(), Some("r2"));
        assert_eq!(f.body, serde_json::json!({"conv":"c"}));
    }

    #[test]
    fn reply_frame_sets_t_and_rid() {
        let v = reply_frame("ack", Some("r9"), serde_json::json!({"acked_sync_seq": 3}));
        assert_eq!(v, serde_json::json!({"t":"ack.ok","rid":"r9","acked_sync_seq":3}));
    }

    /// The typed server frames, snapshot items and bus payload keep the wire
    /// shapes the hand-built JSON had (docs/protocol.md §3.22, §4).
    #[test]
    fn typed_frames_keep_their_wire_shape() {
        let hint = ServerFrame::Hint(Hint::user(7, reason::NEW_EVENT));
        let v = serde_json::to_value(&hint).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"t": server_frame::HINT, "user_sync_high_watermark": 7, "reason": "new_event"})
        );
        assert_eq!(serde_json::from_value::<ServerFrame>(v).unwrap(), hint);
        let kicked = ServerFrame::Kicked(Kicked { reason: reason::SUPERSEDED.into() });
        let v = serde_json::to_value(&kicked).unwrap();
        assert_eq!(v, serde_json::json!({"t": server_frame::KICKED, "reason": "superseded"}));
        assert!(serde_json::from_str::<ServerFrame>(r#"{"t":"future","x":1}"#).is_err());

        let conv = ConvSummary {
            conv: "c1".into(),
            kind: "direct".into(),
            last_msg_seq: 3,
            read_seq: 1,
            unread: 2,
            muted: false,
            pinned: true,
            active: true,
            ..ConvSummary::default()
        };
        let item = serde_json::to_value(SnapshotItem::Conv(conv)).unwrap();
        assert_eq!(
            canonical_item(&item),
            r#"{"active":true,"conv":"c1","kind":"direct","last_msg_seq":3,"mentions":0,"muted":false,"pinned":true,"read_seq":1,"type":"conv","unread":2}"#
        );
        let message = serde_json::json!({"message_id": "m1", "conv": "c1", "msg_seq": 1, "kind": "text",
            "state": "normal", "sender": "ann", "content": {"text": "hi"}, "created_at": 5, "version": 1});
        let env: Envelope = serde_json::from_value(message.clone()).unwrap();
        let item = serde_json::to_value(SnapshotItem::Message { message: env }).unwrap();
        assert_eq!(item, serde_json::json!({"type": "message", "message": message}));

        let bus = serde_json::to_string(&BusHint {
            user: "ann".into(),
            high_watermark: 9,
            kick: None,
            conv: None,
            ephemeral: None,
        })
        .unwrap();
        assert_eq!(bus, r#"{"user":"ann","high_watermark":9}"#, "a plain hint is what earlier builds send");
        let kick =
            BusKick { device: "phone".into(), reason: reason::SUPERSEDED.into(), connection_epoch: 4, ended_at_ms: 0 };
        let bus = serde_json::to_value(BusHint {
            user: "ann".into(),
            high_watermark: 0,
            kick: Some(kick),
            conv: None,
            ephemeral: None,
        })
        .unwrap();
        assert_eq!(
            bus,
            serde_json::json!({"user": "ann", "high_watermark": 0,
                "kick": {"device": "phone", "reason": "superseded", "connection_epoch": 4}})
        );
        let old: BusHint = serde_json::from_str(r#"{"user":"ann","high_watermark":9}"#).unwrap();
        assert_eq!(old.ephemeral, None, "a hint of an older node stays readable");
        let typing =
            ServerFrame::Typing(TypingFrame { conv: "c1".into(), user: "ann".into(), typing: true, timeout_ms: 5 });
        let v = serde_json::to_value(&typing).unwrap();
        assert_eq!(v, serde_json::json!({"t": "typing", "conv": "c1", "user": "ann", "typing": true, "timeout_ms": 5}));
        let presence =
            ServerFrame::Presence(PresenceFrame { user: "ann".into(), state: "offline".into(), last_seen: Some(3) });
        let v = serde_json::to_value(&presence).unwrap();
        assert_eq!(v, serde_json::json!({"t": "presence", "user": "ann", "state": "offline", "last_seen": 3}));
        let eph = BusHint {
            user: "ann".into(),
            high_watermark: 0,
            conv: None,
            kick: None,
            ephemeral: Some(BusEphemeral { to: vec!["ben".into()], frame: Some(presence), answer: true }),
        };
        let text = serde_json::to_string(&eph).unwrap();
        assert_eq!(serde_json::from_str::<BusHint>(&text).unwrap(), eph);
        let ok = MessageDeleteOk { conv: "c1".into(), message_id: "m1".into() };
        assert_eq!(serde_json::to_value(ok).unwrap(), serde_json::json!({"conv": "c1", "message_id": "m1"}));
        assert_eq!(serde_json::to_string(&Empty {}).unwrap(), "{}");
    }

    #[test]
    fn reply_frame_text_is_reply_frame_spliced() {
        let cases = [
            (Some("r9"), serde_json::json!({"acked_sync_seq": 3, "x": {"y": [1, "two"]}})),
            (None, serde_json::json!({"acked_sync_seq": 3})),
            (Some("r\"1"), serde_json::json!({})),
            (Some("r2"), Value::Null),
            (Some("r3"), serde_json::json!([1, 2])),
        ];
        for (rid, reply) in cases {
            let raw = serde_json::value::to_raw_value(&reply).unwrap();
            let text = reply_frame_text("ack", rid, &raw);
            let parsed: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(parsed, reply_frame("ack", rid, reply.clone()), "{text}");
        }
    }

    /// Stored JSON spliced in verbatim is the same JSON the parsed shape
    /// gives, and readers parse it back into the default shape.
    #[test]
    fn raw_and_parsed_events_are_the_same_json() {
        fn env<C>(content: C) -> Envelope<C> {
            Envelope {
                message_id: "m1".into(),
                conv: "c1".into(),
                msg_seq: 7,
                kind: "text".into(),
                state: "normal".into(),
                sender: "ann".into(),
                content,
                created_at: 5,
                version: 2,
                reactions: [("+1".to_owned(), vec!["ben".to_owned()])].into(),
                mentions: vec!["ben".into()],
                mention_all: false,
            }
        }
        fn ev<C>(message: Option<Envelope<C>>, data: Option<C>) -> UserEvent<C> {
            UserEvent { sync_seq: 3, kind: "message".into(), conv: "c1".into(), msg_seq: Some(7), message, data }
        }
        fn page<C>(events: Vec<UserEvent<C>>) -> SyncOk<C> {
            SyncOk {
                sync_generation: 1,
                resume_from: 0,
                batch_high_watermark: 9,
                server_acked_sync_seq: 0,
                events,
                next_cursor: None,
                has_more: false,
                batch_token: "b".into(),
                dirty: Vec::new(),
            }
        }
        let content = r#"{"text":"hi \u00e9","quote":{"message_id":"m0"},"n":[1,2.5,null]}"#;
        let raw = RawValue::from_string(content.to_owned()).unwrap();
        let data = RawValue::from_string(r#"{"read_seq":3}"#.to_owned()).unwrap();
        let raw_page: SyncOk<RawJson> = page(vec![ev(Some(env(raw)), None), ev(None, Some(data))]);
        let parsed: Value = serde_json::from_str(content).unwrap();
        let value_page: SyncOk =
            page(vec![ev(Some(env(parsed)), None), ev(None, Some(serde_json::json!({"read_seq": 3})))]);
        let raw_text = serde_json::to_string(&raw_page).unwrap();
        assert!(raw_text.contains(content), "the stored text is spliced in verbatim: {raw_text}");
        assert_eq!(serde_json::from_str::<Value>(&raw_text).unwrap(), serde_json::to_value(&value_page).unwrap());
        let back: SyncOk = serde_json::from_str(&raw_text).unwrap();
        assert_eq!(back.events, value_page.events);
    }

    #[test]
    fn sync_req_omits_absent_fields() {
        let v = serde_json::to_value(SyncReq { limit: Some(5), ..Default::default() }).unwrap();
        assert_eq!(v, serde_json::json!({"limit":5}));
    }
}
