//! JSON Schema pieces for the `openapi` feature: the bounded strings and
//! numbers of the wire, built from the named bounds of this crate so the
//! generated document and the server's checks cannot drift apart.
//!
//! Bounds of the contract are in UTF-8 bytes; JSON Schema's `maxLength`
//! counts characters. Identifiers are therefore described as ASCII (one
//! byte per character: every id the server issues is ASCII), and free text
//! as at most a quarter of its byte bound in characters (a character is at
//! most four bytes), so a string the schema admits is always one the server
//! admits.

use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::RefOr;

use crate::*;

/// Characters of user names, device ids and kinds (`tidemark-core::ids`).
pub const ID_CHARS: &str = "A-Za-z0-9_.@-";
/// Characters that are not control characters (Unicode `Cc`).
pub const NO_CONTROL_CHARS: &str = "^\\x00-\\x1f\\x7f-\\x9f";

fn string(min: usize, max: usize, pattern: String, description: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(min))
        .max_length(Some(max))
        .pattern(Some(pattern))
        .description(Some(description))
}

fn id(max: usize, description: &str) -> ObjectBuilder {
    string(1, max, format!("^[{ID_CHARS}]{{1,{max}}}$"), description)
}

/// A conversation id (`conv`): 1..=[`ID_BYTES_MAX`] bytes.
pub fn conv() -> RefOr<Schema> {
    id(ID_BYTES_MAX, "conversation id").into()
}

/// A message id: 1..=[`ID_BYTES_MAX`] bytes.
pub fn message_id() -> RefOr<Schema> {
    id(ID_BYTES_MAX, "message id").into()
}

pub fn message_ids() -> RefOr<Schema> {
    ArrayBuilder::new().items(message_id()).into()
}

/// A user name: 1..=[`USER_BYTES_MAX`] bytes of letters, digits, `_ - . @`.
pub fn user() -> RefOr<Schema> {
    id(USER_BYTES_MAX, "user name").into()
}

pub fn users() -> RefOr<Schema> {
    ArrayBuilder::new().items(user()).into()
}

/// The users a send mentions: at most `MENTIONS_MAX`.
pub fn mentions() -> RefOr<Schema> {
    ArrayBuilder::new().items(user()).max_items(Some(tidemark_core::mention::MENTIONS_MAX)).into()
}

/// A device id: 1..=[`DEVICE_ID_BYTES_MAX`] bytes of letters, digits, `_ - . @`.
pub fn device_id() -> RefOr<Schema> {
    id(DEVICE_ID_BYTES_MAX, "stable id of a device").into()
}

/// A message kind: 1..=[`KIND_BYTES_MAX`] bytes of letters, digits, `_ - . @`.
pub fn kind() -> RefOr<Schema> {
    id(KIND_BYTES_MAX, "message kind (`text`, `image`, `file`, `red_packet`, `card`, ...)")
        .default(Some("text".into()))
        .into()
}

/// An idempotency key: 1..=[`CLIENT_MSG_ID_BYTES_MAX`] bytes without control
/// characters (described as printable ASCII).
pub fn client_msg_id() -> RefOr<Schema> {
    let max = CLIENT_MSG_ID_BYTES_MAX;
    string(1, max, format!("^[ -~]{{1,{max}}}$"), "idempotency key, stable across retries").into()
}

/// A reaction: 1..=[`REACTION_BYTES_MAX`] bytes without control characters.
pub fn reaction() -> RefOr<Schema> {
    let max = REACTION_BYTES_MAX / 4;
    string(1, max, format!("^[{NO_CONTROL_CHARS}]{{1,{max}}}$"), "reaction, like an emoji").into()
}

/// A password: 1..=[`PASSWORD_BYTES_MAX`] bytes.
pub fn password() -> RefOr<Schema> {
    let max = PASSWORD_BYTES_MAX / 4;
    string(1, max, format!("^[\\s\\S]{{1,{max}}}$"), "password").into()
}

/// A device's display name; longer names are cut to
/// [`DEVICE_NAME_CHARS_MAX`] characters.
pub fn device_name() -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some(format!("display name, cut to {DEVICE_NAME_CHARS_MAX} characters")))
        .into()
}

fn one_of(values: &[&str], description: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(values.iter().copied()))
        .description(Some(description))
        .into()
}

/// `conv.create` kinds.
pub fn conv_kind() -> RefOr<Schema> {
    one_of(&["direct", "group"], "conversation kind")
}

/// `react` operations.
pub fn react_op() -> RefOr<Schema> {
    one_of(&["add", "remove"], "add or remove the reaction")
}

fn limit(default: u32, max: u32) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(utoipa::openapi::SchemaFormat::KnownFormat(utoipa::openapi::KnownFormat::Int32)))
        .minimum(Some(1))
        .maximum(Some(max))
        .default(Some(default.into()))
        .into()
}

pub fn sync_limit() -> RefOr<Schema> {
    limit(SYNC_LIMIT_DEFAULT, SYNC_LIMIT_MAX)
}

pub fn conv_list_limit() -> RefOr<Schema> {
    limit(CONV_LIST_LIMIT_DEFAULT, CONV_LIST_LIMIT_MAX)
}

pub fn conv_sync_limit() -> RefOr<Schema> {
    limit(CONV_SYNC_LIMIT_DEFAULT, CONV_SYNC_LIMIT_MAX)
}

pub fn conv_members_limit() -> RefOr<Schema> {
    limit(CONV_MEMBERS_LIMIT_DEFAULT, CONV_MEMBERS_LIMIT_MAX)
}

pub fn history_limit() -> RefOr<Schema> {
    limit(HISTORY_LIMIT_DEFAULT, HISTORY_LIMIT_MAX)
}

/// A JSON object of any shape (message content, per-user event data).
pub fn object() -> RefOr<Schema> {
    ObjectBuilder::new().schema_type(Type::Object).into()
}
