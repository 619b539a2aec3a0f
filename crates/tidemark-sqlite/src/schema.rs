//! The SQLite schema. Every table states its key layout and the invariant
//! its constraints hold; the PostgreSQL backend mirrors the same keys so
//! conversation data shards by `conv_id` and user data by `user_id` (X2).

/// Bumped when the schema changes; stored in `meta.schema_version`.
pub const SCHEMA_VERSION: i64 = 1;

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
    state            TEXT NOT NULL CHECK (state IN ('NEW','ACTIVE','RESETTING','REVOKED')),
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
    epoch       INTEGER NOT NULL DEFAULT 1,
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

-- Message facts, keyed by conversation order. UNIQUE(sender, client_msg_id)
-- is the idempotency key of send (S1).
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
    created_at     INTEGER NOT NULL,
    UNIQUE (conv_id, msg_seq),
    UNIQUE (sender, client_msg_id)
);

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
    high_watermark  INTEGER NOT NULL
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
    period_id        INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    PRIMARY KEY (user_id, sync_seq),
    UNIQUE (user_id, source_event_id, period_id)
) WITHOUT ROWID;

-- Per-user conversation projection (list, unread), moved only inside the
-- fan-out transaction that wrote the user event (R3).
CREATE TABLE IF NOT EXISTS user_convs (
    user_id       TEXT NOT NULL,
    conv_id       TEXT NOT NULL,
    last_msg_seq  INTEGER NOT NULL DEFAULT 0,
    read_seq      INTEGER NOT NULL DEFAULT 0,
    unread        INTEGER NOT NULL DEFAULT 0,
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
