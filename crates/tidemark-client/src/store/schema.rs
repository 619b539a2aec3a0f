//! The local schema: every table of the device's store (documented in the
//! store's module header), the columns added since its first release and
//! the migration that adds them, and the kind and state names the SQL
//! shares with the code.

use rusqlite::Connection;

use super::StoreResult;

/// Envelope kinds of control events (docs/protocol.md §3.4.1): they take a
/// `msg_seq` but are not user content and never count as unread.
pub const CONTROL_KINDS: &[&str] =
    &["conv.created", "member.join", "member.leave", "recall", "edit", "reaction", "conv.mode"];
/// The same list as an SQL tuple (checked against [`CONTROL_KINDS`] by a test).
pub(super) const CONTROL_KINDS_SQL: &str =
    "('conv.created', 'member.join', 'member.leave', 'recall', 'edit', 'reaction', 'conv.mode')";

pub const STATE_NORMAL: &str = "normal";
pub const STATE_EDITED: &str = "edited";
pub const STATE_RECALLED: &str = "recalled";
pub const STATE_DELETED: &str = "deleted";

/// Back to the switches of a user who never changed them (a reset, a wipe,
/// a snapshot install before its `privacy` item).
pub(super) const PRIVACY_RESET_SQL: &str =
    "UPDATE privacy SET hide_presence = 0, private_receipts = 0, push_preview = 'full', version = 0;";

pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS device (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    user TEXT NOT NULL,
    device_id TEXT NOT NULL,
    sync_generation INTEGER,
    applied_sync_seq INTEGER NOT NULL DEFAULT 0,
    acked_sync_seq INTEGER NOT NULL DEFAULT 0,
    refresh_token TEXT
);
CREATE TABLE IF NOT EXISTS conversations (
    conv TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    contiguous_msg_seq INTEGER NOT NULL DEFAULT 0,
    last_msg_seq INTEGER NOT NULL DEFAULT 0,
    read_seq INTEGER NOT NULL DEFAULT 0,
    unread INTEGER NOT NULL DEFAULT 0,
    muted INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,
    settings_version INTEGER NOT NULL DEFAULT 0,
    updated_sync_seq INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS messages (
    conv TEXT NOT NULL,
    msg_seq INTEGER NOT NULL,
    message_id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    sender TEXT NOT NULL,
    content TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    version INTEGER NOT NULL DEFAULT 1,
    reactions TEXT NOT NULL DEFAULT '{}',
    sync_seq INTEGER,
    PRIMARY KEY (conv, msg_seq)
);
CREATE TABLE IF NOT EXISTS control_events (
    sync_seq INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    conv TEXT NOT NULL,
    msg_seq INTEGER,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    client_msg_id TEXT NOT NULL UNIQUE,
    op TEXT NOT NULL,
    conv TEXT NOT NULL,
    kind TEXT NOT NULL,
    content TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    message_id TEXT,
    msg_seq INTEGER,
    duplicate INTEGER,
    error TEXT
);
CREATE INDEX IF NOT EXISTS outbox_by_state ON outbox (state, id);
CREATE TABLE IF NOT EXISTS repairs (
    conv TEXT PRIMARY KEY,
    from_msg_seq INTEGER NOT NULL,
    sync_seq INTEGER NOT NULL,
    reason TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL DEFAULT 0,
    last_error TEXT
);
-- The device's gap counts (K5) for `client.stats`: conversations queued
-- for repair and repairs completed, and how many of each the server has
-- been told; one row, moved in the transactions that queue and complete
-- a repair.
CREATE TABLE IF NOT EXISTS gap_stats (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    detected INTEGER NOT NULL DEFAULT 0,
    repaired INTEGER NOT NULL DEFAULT 0,
    reported_detected INTEGER NOT NULL DEFAULT 0,
    reported_repaired INTEGER NOT NULL DEFAULT 0
);
INSERT OR IGNORE INTO gap_stats (id) VALUES (1);
-- How long each repaired gap took (O1), until the server takes a
-- `client.stats` report of it: `kind` `repair` (the repair queue) or
-- `hole` (a conversation cursor's missing run), `ms` from detection to
-- repair. Rows leave once reported; at most `GAP_DURATIONS_KEPT_MAX`.
CREATE TABLE IF NOT EXISTS gap_durations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL CHECK (kind IN ('repair', 'hole')),
    ms INTEGER NOT NULL
);
-- The user's privacy switches (issue 18), one row, as the last `privacy`
-- user event or snapshot item set them; `version` 0: never changed (the
-- defaults). Only a higher version replaces them.
CREATE TABLE IF NOT EXISTS privacy (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    hide_presence INTEGER NOT NULL DEFAULT 0,
    private_receipts INTEGER NOT NULL DEFAULT 0,
    push_preview TEXT NOT NULL DEFAULT 'full',
    version INTEGER NOT NULL DEFAULT 0
);
INSERT OR IGNORE INTO privacy (id) VALUES (1);
CREATE TABLE IF NOT EXISTS snapshot_install (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    snapshot_id TEXT NOT NULL,
    token TEXT NOT NULL,
    generation INTEGER NOT NULL,
    base_sync_seq INTEGER NOT NULL,
    manifest_digest TEXT NOT NULL,
    pages INTEGER NOT NULL,
    installed INTEGER NOT NULL DEFAULT 0
);
";

/// Columns added to `conversations` after the first release of the schema;
/// [`LocalStore::open`] adds the missing ones to an older database.
const CONVERSATION_COLUMNS: &[(&str, &str)] = &[
    ("history_to", "INTEGER NOT NULL DEFAULT 0"),
    ("unread_below", "INTEGER NOT NULL DEFAULT 0"),
    ("active", "INTEGER NOT NULL DEFAULT 1"),
    // `per_member` or `shared` (a large group, G2).
    ("mode", "TEXT NOT NULL DEFAULT 'per_member'"),
    // The user's push preview preference for it (P4): `none`,
    // `conversation` or `full` (the default).
    ("push_preview", "TEXT NOT NULL DEFAULT 'full'"),
    // When its cursor was left with a hole (wall ms), NULL while it has
    // none: the hole's detection, for `client.stats` (O1).
    ("hole_since_ms", "INTEGER"),
    // The summary's bookkeeping (`apply::refresh_summary`): `unread` and
    // `mentions` count every held message up to `counted_upto`;
    // `summary_dirty` says a held message at or below it, or the read
    // position, changed since (set by [`SUMMARY_TRIGGERS`]), so the next
    // refresh counts the whole conversation again; `summary_rev` moves
    // with each refresh, telling its own writes from everyone else's.
    ("counted_upto", "INTEGER NOT NULL DEFAULT 0"),
    ("summary_dirty", "INTEGER NOT NULL DEFAULT 1"),
    ("summary_rev", "INTEGER NOT NULL DEFAULT 0"),
];

/// Marks a conversation's summary for a whole recount
/// (`summary_dirty`) whenever something it was counted from changes other
/// than by appending messages above `counted_upto`: a message inserted at
/// or below it (a gap filled, a history page), a held message whose state,
/// kind, sender, place or mentions change (a recall, a delete for me, an
/// edit, a repair), a message removed, and a read position or count
/// written by anything but the refresh itself (a `read` event, a local
/// read, a snapshot's counts). Storage-level, so every path that writes
/// those rows is covered, including paths added later.
const SUMMARY_TRIGGERS: &str = "
CREATE TRIGGER IF NOT EXISTS summary_message_inserted AFTER INSERT ON messages
WHEN NEW.msg_seq <= (SELECT counted_upto FROM conversations WHERE conv = NEW.conv)
BEGIN
    UPDATE conversations SET summary_dirty = 1 WHERE conv = NEW.conv;
END;
CREATE TRIGGER IF NOT EXISTS summary_message_changed AFTER UPDATE ON messages
WHEN OLD.state IS NOT NEW.state OR OLD.kind IS NOT NEW.kind OR OLD.sender IS NOT NEW.sender
  OR OLD.conv IS NOT NEW.conv OR OLD.msg_seq IS NOT NEW.msg_seq
  OR OLD.mentions IS NOT NEW.mentions OR OLD.mention_all IS NOT NEW.mention_all
BEGIN
    UPDATE conversations SET summary_dirty = 1 WHERE conv IN (OLD.conv, NEW.conv);
END;
CREATE TRIGGER IF NOT EXISTS summary_message_removed AFTER DELETE ON messages
WHEN EXISTS (SELECT 1 FROM conversations WHERE conv = OLD.conv AND summary_dirty = 0)
BEGIN
    UPDATE conversations SET summary_dirty = 1 WHERE conv = OLD.conv;
END;
CREATE TRIGGER IF NOT EXISTS summary_position_written
AFTER UPDATE OF read_seq, unread, mentions, history_to, unread_below, mentions_below ON conversations
WHEN NEW.summary_rev = OLD.summary_rev AND (OLD.read_seq IS NOT NEW.read_seq OR OLD.unread IS NOT NEW.unread
  OR OLD.mentions IS NOT NEW.mentions OR OLD.history_to IS NOT NEW.history_to
  OR OLD.unread_below IS NOT NEW.unread_below OR OLD.mentions_below IS NOT NEW.mentions_below)
BEGIN
    UPDATE conversations SET summary_dirty = 1 WHERE conv = NEW.conv;
END;
";

/// Gap-timing columns of other tables (O1): when a repair was queued
/// (0 for a record older than the column: its duration is unknown).
const GAP_COLUMNS: &[(&str, &str, &str)] = &[("repairs", "queued_at_ms", "INTEGER NOT NULL DEFAULT 0")];

/// Mention columns (issue 18), added to every table they live in: a
/// message's `mentions` (a JSON array of user ids, NULL when none) and
/// `mention_all`, kept on the message and on a queued send; a
/// conversation's `mentions` (unread messages mentioning the user) and
/// `mentions_below` (those below `history_to`, from a snapshot).
const MENTION_COLUMNS: &[(&str, &str, &str)] = &[
    ("messages", "mentions", "TEXT"),
    ("messages", "mention_all", "INTEGER NOT NULL DEFAULT 0"),
    ("outbox", "mentions", "TEXT"),
    ("outbox", "mention_all", "INTEGER NOT NULL DEFAULT 0"),
    ("conversations", "mentions", "INTEGER NOT NULL DEFAULT 0"),
    ("conversations", "mentions_below", "INTEGER NOT NULL DEFAULT 0"),
];

/// Adds the columns of [`CONVERSATION_COLUMNS`], [`MENTION_COLUMNS`] and
/// [`GAP_COLUMNS`] that an older database lacks, then [`SUMMARY_TRIGGERS`]
/// (an older database's conversations start dirty: counted again once).
pub(super) fn migrate(conn: &Connection) -> StoreResult<()> {
    let added =
        CONVERSATION_COLUMNS.iter().map(|(n, d)| ("conversations", *n, *d)).chain(MENTION_COLUMNS.iter().copied());
    let added = added.chain(GAP_COLUMNS.iter().copied());
    for (table, name, decl) in added {
        let have: bool = conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2)",
            rusqlite::params![table, name],
            |r| r.get(0),
        )?;
        if !have {
            conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {name} {decl}"))?;
        }
    }
    conn.execute_batch(SUMMARY_TRIGGERS)?;
    Ok(())
}
