//! The SQLite schema. Every table states its key layout and the invariant
//! its constraints hold; the PostgreSQL backend mirrors the same keys so
//! conversation data shards by `conv_id` and user data by `user_id` (X2).
//!
//! # Migrations
//!
//! The schema is an ordered list of numbered steps, [`MIGRATIONS`]; step 1
//! is the schema as first released with numbered migrations. [`migrate`]
//! runs at open on the writer's connection, in one `BEGIN IMMEDIATE`
//! transaction (so a second process opening the file waits): it records
//! every applied step in `schema_migrations`, applies the steps above the
//! highest recorded one in order, and refuses with
//! [`StoreError::SchemaTooNew`] a database whose recorded version is above
//! [`SCHEMA_VERSION`]. A released step is never edited; a change is a new
//! step.
//!
//! Before numbered migrations, open ran [`SCHEMA`] every time and stamped
//! `meta.schema_version` = 2 (an older numbering, never checked). Step 1 is
//! that same SQL, all `IF NOT EXISTS`, so on such a database it changes
//! nothing; the runner records it and removes the old stamp, so the only
//! version on record is the one in `schema_migrations`.

use rusqlite::{params, Connection};
use tidemark_store::{StoreError, StoreResult};

use crate::internal;

/// One numbered schema change. Released steps are never edited.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// 1, 2, 3…: contiguous, in order.
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every step, in order. This backend numbers its own steps, independently
/// of PostgreSQL's.
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "initial schema", sql: SCHEMA },
    Migration { version: 2, name: "durable connection epochs", sql: CONNECTION_EPOCH },
    Migration { version: 3, name: "large groups: shared mode and dirty markers", sql: LARGE_GROUPS },
    Migration { version: 4, name: "user privacy switches", sql: USER_PRIVACY },
    Migration { version: 5, name: "refresh token families", sql: REFRESH_FAMILIES },
    Migration { version: 6, name: "session ends and deactivation", sql: SESSION_ENDS },
    Migration { version: 7, name: "audit log", sql: AUDIT_LOG },
    Migration { version: 8, name: "deleted users", sql: DELETED_USERS },
    Migration { version: 9, name: "offline push targets", sql: PUSH_TARGETS },
    Migration { version: 10, name: "mentions", sql: MENTIONS },
    Migration { version: 11, name: "push preview preferences", sql: PUSH_PREVIEW_PREFERENCES },
    Migration { version: 12, name: "privacy switch versions", sql: PRIVACY_VERSIONS },
];

/// Step 12 (issue 18): the switches' version, moved by each change, so a
/// change is one `privacy` user event (`privacy:<version>`) in the user's
/// own log, and a device applies only a newer one. 0: never changed.
pub const PRIVACY_VERSIONS: &str = r#"
ALTER TABLE user_privacy ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
UPDATE user_privacy SET version = 1;
"#;

/// Step 11 (P4, issue 20): the user's push preview preference and the
/// user's preference per conversation, beside `hide_presence` and `muted`.
/// `full` (the default) narrows nothing; the most private of the device's
/// level and these two is what a notification says
/// (`tidemark_core::push::effective_preview`).
pub const PUSH_PREVIEW_PREFERENCES: &str = r#"
ALTER TABLE user_privacy ADD COLUMN push_preview TEXT NOT NULL DEFAULT 'full'
    CHECK (push_preview IN ('none','conversation','full'));
ALTER TABLE user_convs ADD COLUMN push_preview TEXT NOT NULL DEFAULT 'full'
    CHECK (push_preview IN ('none','conversation','full'));
"#;

/// Step 10 (issue 18): a message's mentions are facts of the message
/// (`mentions`, a JSON array of user ids, NULL when it names nobody;
/// `mention_all`, everyone), so every count is rebuilt from them; each
/// conversation row of `user_convs` keeps `mentions`, the unread messages
/// that mention its user, moved with `unread` by the fan-out and the
/// recounts (`events::COUNT_MENTIONS`).
pub const MENTIONS: &str = r#"
ALTER TABLE messages ADD COLUMN mentions TEXT;
ALTER TABLE messages ADD COLUMN mention_all INTEGER NOT NULL DEFAULT 0;
ALTER TABLE user_convs ADD COLUMN mentions INTEGER NOT NULL DEFAULT 0;
"#;

/// Step 9 (P4, issue 20): one offline push target per device, keyed like
/// `devices` (a user table). The token is sealed by the server (AES-GCM)
/// and found again by its hash; `pushed_through` is the `sync_seq` up to
/// which the device's log is settled for push (only grows), so what a
/// device owes is its user's events above `max(acked, pushed_through)`,
/// derived from the committed log, never queued. `next_at` holds a
/// coalescing window or a backoff; `claim_seq`/`claim_until` are the lease
/// of the node working on it. Deleted with the device's revocation and the
/// user's deactivation or deletion.
pub const PUSH_TARGETS: &str = r#"
CREATE TABLE push_targets (
    user_id         TEXT NOT NULL,
    device_id       TEXT NOT NULL,
    platform        TEXT NOT NULL,
    token_sealed    BLOB NOT NULL,
    token_hash      TEXT NOT NULL,
    token_last4     TEXT NOT NULL,
    app_id          TEXT NOT NULL,
    p256dh          TEXT,
    auth            TEXT,
    preview         TEXT NOT NULL CHECK (preview IN ('none','conversation','full')),
    pushed_through  INTEGER NOT NULL,
    next_at         INTEGER NOT NULL DEFAULT 0,
    attempts        INTEGER NOT NULL DEFAULT 0,
    claim_seq       INTEGER NOT NULL DEFAULT 0,
    claim_until     INTEGER NOT NULL DEFAULT 0,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (user_id, device_id)
) WITHOUT ROWID;
CREATE INDEX push_targets_due ON push_targets (next_at);
"#;

/// Step 2: each device's newest WebSocket connection (P2), moved by
/// `Store::open_connection`; a frame of an older one is dropped.
pub const CONNECTION_EPOCH: &str = "ALTER TABLE devices ADD COLUMN connection_epoch INTEGER NOT NULL DEFAULT 0;";

/// Step 8: a deleted user's row stays as a tombstone (`deleted_at` set,
/// deactivated too), so its name, the author of its messages, is never
/// given to another account; its devices, log and cursors are gone.
pub const DELETED_USERS: &str = r#"
ALTER TABLE users ADD COLUMN deleted_at INTEGER;
"#;

/// Step 7: the durable audit log (`tidemark_core::audit`), one row per
/// account or device event, ids as keyed hashes, never a secret; found by
/// user hash and time, trimmed by time (the retention of `tidemark serve
/// --audit-keep-days`).
pub const AUDIT_LOG: &str = r#"
CREATE TABLE IF NOT EXISTS audit_log (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    at           INTEGER NOT NULL,
    event        TEXT NOT NULL,
    actor        TEXT NOT NULL,
    user_hash    TEXT NOT NULL,
    device_hash  TEXT,
    address      TEXT
);
CREATE INDEX IF NOT EXISTS audit_log_by_user ON audit_log (user_hash, at);
CREATE INDEX IF NOT EXISTS audit_log_by_time ON audit_log (at);
"#;

/// Step 6: an operator ends sessions (`tidemark_core::session`). A user's
/// or a device's `sessions_ended_at` refuses the access tokens issued at
/// or before it (0: none ended); `deactivated_at` set: the account no
/// longer logs in and none of its tokens work.
pub const SESSION_ENDS: &str = r#"
ALTER TABLE users ADD COLUMN deactivated_at INTEGER;
ALTER TABLE users ADD COLUMN sessions_ended_at INTEGER NOT NULL DEFAULT 0;
ALTER TABLE devices ADD COLUMN sessions_ended_at INTEGER NOT NULL DEFAULT 0;
"#;

/// Step 5: refresh-token reuse detection (`tidemark_core::refresh`). A
/// token keeps its row once used (`used_at` set) until it expires, so a
/// replay is recognised; `family` is the chain of rotations from one
/// login. A token stored before this step is a family of its own.
pub const REFRESH_FAMILIES: &str = r#"
ALTER TABLE refresh_tokens ADD COLUMN family TEXT NOT NULL DEFAULT '';
ALTER TABLE refresh_tokens ADD COLUMN used_at INTEGER;
UPDATE refresh_tokens SET family = token_hash WHERE family = '';
CREATE INDEX IF NOT EXISTS refresh_tokens_by_family ON refresh_tokens (family);
"#;

/// The last step this build knows: the version of a database it opened.
pub const SCHEMA_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The record of applied steps (created before step 1, outside the steps).
const MIGRATIONS_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS schema_migrations (
    version     INTEGER PRIMARY KEY,
    name        TEXT NOT NULL,
    applied_at  INTEGER NOT NULL
)";

/// Brings the database to [`SCHEMA_VERSION`] in one transaction and returns
/// the version it found before; a failed step leaves nothing behind.
/// Public for `bench ingest`'s floor, which writes a message's rows in
/// plain SQL on this same schema.
pub fn migrate(conn: &Connection) -> StoreResult<i64> {
    conn.execute_batch("BEGIN IMMEDIATE").map_err(internal)?;
    let result = (|| {
        conn.execute_batch(MIGRATIONS_TABLE_SQL).map_err(internal)?;
        let applied: i64 = conn
            .query_row("SELECT COALESCE(MAX(version), 0) FROM schema_migrations", [], |r| r.get(0))
            .map_err(internal)?;
        if applied > SCHEMA_VERSION {
            return Err(StoreError::SchemaTooNew { found: applied, known: SCHEMA_VERSION });
        }
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        for step in MIGRATIONS.iter().filter(|m| m.version > applied) {
            conn.execute_batch(step.sql).map_err(internal)?;
            conn.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?1, ?2, ?3)",
                params![step.version, step.name, now_ms],
            )
            .map_err(internal)?;
            tracing::info!(version = step.version, name = step.name, "applied schema migration");
        }
        if applied == 0 {
            // The stamp of builds before numbered migrations (see the module
            // docs); `meta` exists from step 1 on.
            conn.execute("DELETE FROM meta WHERE key = 'schema_version'", []).map_err(internal)?;
        }
        Ok(applied)
    })();
    match result {
        Ok(found) => conn.execute_batch("COMMIT").map_err(internal).map(|()| found),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}

/// Step 1, the schema as first released with numbered migrations (run at
/// every open before, hence `IF NOT EXISTS` throughout).
pub const SCHEMA: &str = r#"
-- Server-wide values: the token secret, the schema version.
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value BLOB NOT NULL
);

-- Accounts. Passwords are argon2 PHC strings, never plain text.
CREATE TABLE IF NOT EXISTS users (
    user_id       TEXT PRIMARY KEY,
    password_hash TEXT NOT NULL,
    created_at    INTEGER NOT NULL
);

-- One row per (user, device): the device's identity and its sync cursor
-- (D1). The cursor moves only by compare-and-set: ACKs only forward within a
-- generation, a reset bumps sync_generation first (D4, D5).
CREATE TABLE IF NOT EXISTS devices (
    user_id          TEXT NOT NULL,
    device_id        TEXT NOT NULL,
    name             TEXT NOT NULL,
    sync_generation  INTEGER NOT NULL,
    acked_sync_seq   INTEGER NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('NEW','ACTIVE','RESETTING','RECOVERING','REVOKED')),
    row_version      INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    PRIMARY KEY (user_id, device_id)
) WITHOUT ROWID;

-- Refresh tokens by SHA-256 of their secret; used once (rotation).
CREATE TABLE IF NOT EXISTS refresh_tokens (
    token_hash  TEXT PRIMARY KEY,
    user_id     TEXT NOT NULL,
    device_id   TEXT NOT NULL,
    expires_at  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS refresh_tokens_by_device ON refresh_tokens (user_id, device_id);

-- Conversations. `head` is the highest committed msg_seq: it is advanced in
-- the same transaction that inserts the message, by the single writer, so a
-- visible n+1 implies a visible n (S2). A direct pair has one row, found by
-- its `direct_key` (G1).
CREATE TABLE IF NOT EXISTS conversations (
    conv_id     TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,
    direct_key  TEXT UNIQUE,
    head        INTEGER NOT NULL DEFAULT 0,
    -- The lowest msg_seq still retained (C2 `trimmed`); 1 until trimming.
    min_seq     INTEGER NOT NULL DEFAULT 1,
    -- Bumped by any operation that rewrites the log (C2 EPOCH_CHANGED).
    epoch       INTEGER NOT NULL DEFAULT 1,
    -- Group owner (may remove members); NULL for direct conversations.
    owner       TEXT,
    created_at  INTEGER NOT NULL
);

-- Membership periods [join_seq, leave_seq] (closed; leave_seq NULL while
-- active), a new period_id per join (G1). Fan-out reads the periods that
-- cover a message's msg_seq, never the current member list (F4).
CREATE TABLE IF NOT EXISTS membership_periods (
    period_id  INTEGER PRIMARY KEY,
    conv_id    TEXT NOT NULL,
    user_id    TEXT NOT NULL,
    join_seq   INTEGER NOT NULL,
    leave_seq  INTEGER,
    UNIQUE (conv_id, user_id, join_seq)
);
CREATE INDEX IF NOT EXISTS membership_by_user ON membership_periods (user_id, conv_id);

-- Conversation events, keyed by conversation order: user messages and the
-- control events that take a msg_seq too (conv.created, member.join,
-- member.leave, recall, edit, reaction). UNIQUE(sender, client_msg_id) is the
-- idempotency key of every one of them (S1). A recall wipes the target's
-- content for good and records the recall's seq (E1); edits and reactions
-- bump `version` (E2).
CREATE TABLE IF NOT EXISTS messages (
    message_id     TEXT PRIMARY KEY,
    conv_id        TEXT NOT NULL,
    msg_seq        INTEGER NOT NULL,
    sender         TEXT NOT NULL,
    sender_device  TEXT NOT NULL,
    client_msg_id  TEXT NOT NULL,
    kind           TEXT NOT NULL,
    content        TEXT NOT NULL,
    state          TEXT NOT NULL,
    version        INTEGER NOT NULL DEFAULT 1,
    -- The message a control event acts on.
    target_id      TEXT,
    -- The message this one quotes (same conversation).
    quote_id       TEXT,
    -- msg_seq of the recall event, once recalled.
    recall_seq     INTEGER,
    created_at     INTEGER NOT NULL,
    UNIQUE (conv_id, msg_seq),
    UNIQUE (sender, client_msg_id)
);

-- Reactions by user (E2); the message's version moves with each change.
CREATE TABLE IF NOT EXISTS reactions (
    message_id  TEXT NOT NULL,
    user_id     TEXT NOT NULL,
    reaction    TEXT NOT NULL,
    event_seq   INTEGER NOT NULL,
    PRIMARY KEY (message_id, user_id, reaction)
) WITHOUT ROWID;

-- Messages a user deleted for themselves only (E3).
CREATE TABLE IF NOT EXISTS user_deleted (
    user_id     TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    PRIMARY KEY (user_id, message_id)
) WITHOUT ROWID;

-- Per-device delivery (R1): distinct from the sync ACK and from read.
CREATE TABLE IF NOT EXISTS deliveries (
    message_id    TEXT NOT NULL,
    user_id       TEXT NOT NULL,
    device_id     TEXT NOT NULL,
    delivered_at  INTEGER NOT NULL,
    PRIMARY KEY (message_id, user_id, device_id)
) WITHOUT ROWID;

-- The transactional outbox: written with the fact it announces (S3), removed
-- by the fan-out transaction that consumed it (F1). Survives restarts.
CREATE TABLE IF NOT EXISTS outbox (
    outbox_id        INTEGER PRIMARY KEY AUTOINCREMENT,
    kind             TEXT NOT NULL,
    source_event_id  TEXT NOT NULL,
    conv_id          TEXT NOT NULL,
    msg_seq          INTEGER NOT NULL,
    actor            TEXT NOT NULL,
    created_at       INTEGER NOT NULL
);

-- Per-user sync head. Advanced in the same transaction as the events it
-- numbers, so it is also the committed high watermark (F2).
CREATE TABLE IF NOT EXISTS user_heads (
    user_id         TEXT PRIMARY KEY,
    high_watermark  INTEGER NOT NULL,
    -- Events at or below this were trimmed (L1); only snapshots reach them.
    trimmed_upto    INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

-- Recovery sessions (D6): a frozen (resume_from, high_watermark] replay for
-- a device whose local store fell a little behind its ACK. At most one
-- ACTIVE per device; it fences retention from resume_from until it
-- completes (by its own CAS on the final ACK) or expires.
CREATE TABLE IF NOT EXISTS recovery_sessions (
    session_id      TEXT PRIMARY KEY,
    user_id         TEXT NOT NULL,
    device_id       TEXT NOT NULL,
    generation      INTEGER NOT NULL,
    resume_from     INTEGER NOT NULL,
    high_watermark  INTEGER NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('ACTIVE','COMPLETED','EXPIRED')),
    created_at      INTEGER NOT NULL,
    expires_at      INTEGER NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS recovery_one_active ON recovery_sessions (user_id, device_id) WHERE state = 'ACTIVE';

-- Snapshots (D7): a frozen base, BUILDING until its pages are stored, then
-- READY and immutable, INSTALLED once the device acknowledged it. BUILDING
-- and READY bases fence retention until they expire.
CREATE TABLE IF NOT EXISTS snapshots (
    snapshot_id      TEXT PRIMARY KEY,
    user_id          TEXT NOT NULL,
    device_id        TEXT NOT NULL,
    generation       INTEGER NOT NULL,
    base_sync_seq    INTEGER NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('BUILDING','READY','INSTALLED','EXPIRED')),
    manifest_digest  TEXT NOT NULL DEFAULT '',
    pages            INTEGER NOT NULL DEFAULT 0,
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS snapshots_by_user ON snapshots (user_id, state);

CREATE TABLE IF NOT EXISTS snapshot_items (
    snapshot_id  TEXT NOT NULL,
    page         INTEGER NOT NULL,
    idx          INTEGER NOT NULL,
    item         TEXT NOT NULL,
    PRIMARY KEY (snapshot_id, page, idx)
) WITHOUT ROWID;

-- The user sync log, keyed (user_id, sync_seq) for range reads (D2);
-- UNIQUE(user_id, source_event_id, period_id) makes fan-out idempotent (F3).
CREATE TABLE IF NOT EXISTS user_events (
    user_id          TEXT NOT NULL,
    sync_seq         INTEGER NOT NULL,
    kind             TEXT NOT NULL,
    conv_id          TEXT NOT NULL,
    msg_seq          INTEGER,
    message_id       TEXT,
    source_event_id  TEXT NOT NULL,
    -- The membership period that admitted it; 0 for per-user events.
    period_id        INTEGER NOT NULL,
    -- Payload of per-user events (read, settings, delete), JSON.
    data             TEXT,
    created_at       INTEGER NOT NULL,
    PRIMARY KEY (user_id, sync_seq),
    UNIQUE (user_id, source_event_id, period_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS user_events_by_conv ON user_events (user_id, conv_id, msg_seq);

-- Per-user conversation projection (list, unread), moved only inside the
-- fan-out transaction that wrote the user event (R3).
CREATE TABLE IF NOT EXISTS user_convs (
    user_id       TEXT NOT NULL,
    conv_id       TEXT NOT NULL,
    last_msg_seq  INTEGER NOT NULL DEFAULT 0,
    read_seq      INTEGER NOT NULL DEFAULT 0,
    unread        INTEGER NOT NULL DEFAULT 0,
    muted         INTEGER NOT NULL DEFAULT 0,
    pinned        INTEGER NOT NULL DEFAULT 0,
    settings_version INTEGER NOT NULL DEFAULT 0,
    -- 0 once the user left or was removed.
    active        INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (user_id, conv_id)
) WITHOUT ROWID;

-- Fan-out items that hit two membership periods of one user (F4): never
-- delivered, kept for repair and reported as an integrity error.
CREATE TABLE IF NOT EXISTS fanout_quarantine (
    source_event_id  TEXT NOT NULL,
    user_id          TEXT NOT NULL,
    conv_id          TEXT NOT NULL,
    msg_seq          INTEGER NOT NULL,
    reason           TEXT NOT NULL,
    created_at       INTEGER NOT NULL,
    PRIMARY KEY (source_event_id, user_id)
);
"#;

/// Step 3, large groups (G2, G3).
pub const LARGE_GROUPS: &str = r#"
-- A group's mode: 'per_member' (every event fanned out into each member's
-- log) or 'shared' (events above `shared_from`, the switch event's
-- msg_seq, live only in the conversation log). One-way. `members_seq` is
-- the msg_seq of the last membership change (it keys the servers' caches
-- of who is in the group).
ALTER TABLE conversations ADD COLUMN mode TEXT NOT NULL DEFAULT 'per_member';
ALTER TABLE conversations ADD COLUMN shared_from INTEGER;
ALTER TABLE conversations ADD COLUMN members_seq INTEGER NOT NULL DEFAULT 0;
-- Open membership periods, kept by the writer with each join and leave, so
-- a join into a 100,000-member group does not count them (G1's size cap
-- and G3's threshold read it).
ALTER TABLE conversations ADD COLUMN active_members INTEGER NOT NULL DEFAULT 0;
UPDATE conversations SET active_members =
    (SELECT COUNT(*) FROM membership_periods p WHERE p.conv_id = conversations.conv_id AND p.leave_seq IS NULL);

-- A shared group's published marker, one row per group, written by the
-- fan-out only: `target` only grows, `version` only increments, once per
-- relay batch that moved the group. Apart from `conversations` so the
-- fan-out never takes the row a send locks (PostgreSQL keeps the same
-- layout).
CREATE TABLE conv_markers (
    conv_id  TEXT PRIMARY KEY,
    target   INTEGER NOT NULL,
    version  INTEGER NOT NULL
) WITHOUT ROWID;

-- 1 for the user's rows of groups in shared mode: the sync path finds a
-- user's shared groups without reading the rest.
ALTER TABLE user_convs ADD COLUMN shared INTEGER NOT NULL DEFAULT 0;
CREATE INDEX user_convs_shared ON user_convs (user_id) WHERE shared = 1;

-- What each device cleared of a shared group's marker (G2): the marker is
-- dirty for the device while `cleared_seq` is below its target; written
-- only by a successful `dirty.clear` CAS, never by a message.
CREATE TABLE device_markers (
    user_id          TEXT NOT NULL,
    device_id        TEXT NOT NULL,
    conv_id          TEXT NOT NULL,
    cleared_seq      INTEGER NOT NULL,
    cleared_version  INTEGER NOT NULL,
    PRIMARY KEY (user_id, device_id, conv_id)
) WITHOUT ROWID;
"#;

/// Step 4 (issue 18): a user's privacy switches, keyed by user (a user
/// table, sharded with the user's data). No row means both off. Presence
/// itself is never stored: it lives in the nodes' memory only.
pub const USER_PRIVACY: &str = r#"
CREATE TABLE user_privacy (
    user_id           TEXT PRIMARY KEY,
    -- Others see the user offline; no presence frame of theirs goes out.
    hide_presence     INTEGER NOT NULL DEFAULT 0,
    -- Others do not see the user's read positions (conv.receipts).
    private_receipts  INTEGER NOT NULL DEFAULT 0,
    updated_at        INTEGER NOT NULL
) WITHOUT ROWID;
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_one_by_one_from_one() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version, i as i64 + 1, "step {} is out of order", m.name);
        }
        assert_eq!(SCHEMA_VERSION, MIGRATIONS.len() as i64);
    }
}
