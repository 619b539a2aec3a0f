//! The PostgreSQL schema: numbered migration steps applied in order at open.
//!
//! The tables and constraints mirror the SQLite backend's (`tidemark-sqlite`
//! `schema.rs`) one for one, so both backends enforce the same invariants
//! with the same keys. What differs is the key *order*, chosen so the schema
//! can be sharded later without a redesign (X2):
//!
//! - conversation-owned rows (`conversations`, `membership_periods`,
//!   `messages`, `reactions`, `outbox`) lead their primary key with
//!   `conv_id`;
//! - user-owned rows (`devices`, `user_heads`, `user_events`, `user_convs`,
//!   `user_deleted`, `deliveries`, `fanout_quarantine`,
//!   `recovery_sessions`) lead with `user_id`;
//! - the only transaction that reads one side and writes the other is the
//!   fan-out, which consumes the outbox (the hand-over point between them).
//!
//! A few constraints are global today and would become lookup tables keyed
//! by their own column on a sharded cluster (in Citus terms: reference or
//! separately distributed tables): `messages.message_id` (unique across
//! conversations), `messages (sender, client_msg_id)` (the send idempotency
//! key, S1), `conversations.direct_key` (one conversation per pair, G1),
//! `refresh_tokens.token_hash`, `users.user_id`, and `snapshots` /
//! `snapshot_items`, which the store API finds by `snapshot_id` alone (a
//! sharded layout would encode the user in the id or keep a lookup).
//!
//! # Migrations
//!
//! The schema is an ordered list of numbered steps, [`MIGRATIONS`]; step 1
//! is the schema as first released. [`migrate`] runs at open, in one
//! transaction under a transaction-scoped advisory lock per PostgreSQL
//! schema (so nodes opening one database at once apply each step once):
//! it records every applied step in `schema_migrations`, applies the steps
//! above the highest recorded one in order, and refuses (with
//! [`StoreError::SchemaTooNew`]) a database whose recorded version is above
//! [`SCHEMA_VERSION`], the last step this build knows. A step is never
//! edited once released; a change is a new step. `meta.schema_version`
//! mirrors the latest applied step, because builds from before numbered
//! migrations check that key (and refuse anything above 1).
//!
//! This module knows the SQL of the tables only; the transactions that use
//! them live in `events`, `read` and the crate root.

use deadpool_postgres::ClientWrapper;
use tidemark_store::{StoreError, StoreResult};

use crate::db;

/// One numbered schema change. Released steps are never edited.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// 1, 2, 3…: contiguous, in order.
    pub version: i64,
    pub name: &'static str,
    /// Run with the simple query protocol, inside the migration transaction.
    pub sql: &'static str,
}

/// Every step, in order. This backend numbers its own steps, independently
/// of SQLite's.
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "initial schema", sql: SCHEMA },
    Migration { version: 2, name: "send in one statement", sql: SEND_FUNCTION },
    Migration { version: 3, name: "durable connection epochs", sql: CONNECTION_EPOCH },
    Migration { version: 4, name: "large groups: shared mode and dirty markers", sql: LARGE_GROUPS },
    Migration { version: 5, name: "user privacy switches", sql: USER_PRIVACY },
    Migration { version: 6, name: "refresh token families", sql: REFRESH_FAMILIES },
    Migration { version: 7, name: "session ends and deactivation", sql: SESSION_ENDS },
    Migration { version: 8, name: "audit log", sql: AUDIT_LOG },
    Migration { version: 9, name: "deleted users", sql: DELETED_USERS },
    Migration { version: 10, name: "offline push targets", sql: PUSH_TARGETS },
    Migration { version: 11, name: "mentions", sql: MENTIONS },
    Migration { version: 12, name: "push preview preferences", sql: PUSH_PREVIEW_PREFERENCES },
    Migration { version: 13, name: "privacy switch versions", sql: PRIVACY_VERSIONS },
    Migration { version: 14, name: "per-frame connection epoch fence", sql: FRAME_FENCE },
    Migration { version: 15, name: "ACK in one statement", sql: ACK_FUNCTION },
    Migration { version: 16, name: "read in one statement", sql: READ_FUNCTION },
    Migration { version: 17, name: "send without a nested call", sql: SEND_INLINE },
];

/// Step 16 (R1, R3, issue 14): `tidemark_read`, a `read` in one statement,
/// so the user writer pipelines the reads of a group commit
/// (`Writer::write_statement`) instead of awaiting 13 statements
/// each. In the order of the multi-statement read (`events::mark_read`):
/// it locks the user's head (the first lock of every per-user write),
/// reads the user's row of the conversation, the head and the device's
/// newest `connection_epoch` (refusing an older frame, `superseded`, before
/// anything is written: `tidemark_core::session::frame_superseded`),
/// moves the read cursor where `tidemark_core::projection::read_target`
/// says, recounts unread and mentions from the facts (the counts of
/// `events::COUNT_UNREAD` and `COUNT_MENTIONS`) and appends the `read`
/// user event under its key (`projection::read_event_id`) with its data
/// (`content::ReadData`) unless that key is already in the log. It returns
/// the facts it decided on and what it wrote; the caller
/// (`events::decide_read_row`) decides again with core's rule
/// and the proto's data shape and undoes the request, answering
/// `Internal`, were they ever to disagree: the rules live in core and the
/// wire shape in proto, this is their transcription, keep them the same.
/// A shared large group (`conversations.mode = 'shared'`), whose unread
/// above the switch is counted from the log through core's marker rules,
/// is answered `shared` with nothing written beyond the head lock: the
/// caller runs the multi-statement read for it.
pub const READ_FUNCTION: &str = r#"
CREATE FUNCTION tidemark_read(
    p_user TEXT, p_conv TEXT, p_read_to BIGINT, p_device TEXT, p_epoch BIGINT, p_now BIGINT,
    OUT o_status TEXT, OUT o_newest BIGINT, OUT o_read_seq BIGINT, OUT o_head BIGINT, OUT o_target BIGINT,
    OUT o_unread BIGINT, OUT o_mentions BIGINT, OUT o_source TEXT, OUT o_data TEXT, OUT o_sync_seq BIGINT)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_mode TEXT;
    v_member BOOLEAN;
BEGIN
    -- events::lock_user
    INSERT INTO user_heads AS h (user_id, high_watermark) VALUES (p_user, 0)
    ON CONFLICT (user_id) DO UPDATE SET high_watermark = h.high_watermark;
    SELECT uc.read_seq, c.head, uc.unread, uc.mentions, c.mode
      INTO o_read_seq, o_head, o_unread, o_mentions, v_mode
      FROM user_convs uc JOIN conversations c ON c.conv_id = uc.conv_id
     WHERE uc.user_id = p_user AND uc.conv_id = p_conv;
    v_member := FOUND;
    IF p_epoch IS NOT NULL THEN
        o_newest := COALESCE((SELECT d.connection_epoch FROM devices d
                               WHERE d.user_id = p_user AND d.device_id = p_device), 0);
        -- tidemark_core::session::frame_superseded
        IF o_newest > p_epoch THEN
            o_status := 'superseded';
            RETURN;
        END IF;
    END IF;
    IF NOT v_member THEN
        o_status := CASE WHEN EXISTS (SELECT 1 FROM conversations WHERE conv_id = p_conv)
                         THEN 'not_member' ELSE 'not_found' END;
        RETURN;
    END IF;
    IF v_mode = 'shared' THEN
        o_status := 'shared';
        RETURN;
    END IF;
    o_status := 'ok';
    -- tidemark_core::projection::read_target
    IF LEAST(p_read_to, o_head) <= o_read_seq THEN
        RETURN;
    END IF;
    o_target := LEAST(p_read_to, o_head);
    UPDATE user_convs SET read_seq = o_target WHERE user_id = p_user AND conv_id = p_conv;
    -- events::COUNT_UNREAD and COUNT_MENTIONS above the new cursor.
    SELECT COUNT(*), COUNT(*) FILTER (WHERE m.mention_all OR p_user = ANY (m.mentions))
      INTO o_unread, o_mentions
      FROM messages m JOIN user_convs uc ON uc.user_id = p_user AND uc.conv_id = m.conv_id
     WHERE m.conv_id = p_conv AND m.msg_seq > o_target AND m.msg_seq <= uc.last_msg_seq
       AND m.sender <> p_user AND m.state <> 'recalled'
       AND m.kind NOT IN ('conv.created', 'member.join', 'member.leave', 'recall', 'edit', 'reaction')
       AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = p_user
                   AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))
       AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = p_user AND d.message_id = m.message_id);
    UPDATE user_convs SET unread = o_unread, mentions = o_mentions WHERE user_id = p_user AND conv_id = p_conv;
    -- projection::read_event_id and content::ReadData
    o_source := 'read:' || p_conv || ':' || o_target;
    o_data := '{"read_seq":' || o_target || ',"unread":' || o_unread || '}';
    -- events::append_user_event, in the per-user scope (period 0)
    IF EXISTS (SELECT 1 FROM user_events WHERE user_id = p_user AND source_event_id = o_source AND period_id = 0) THEN
        RETURN;
    END IF;
    INSERT INTO user_heads AS h (user_id, high_watermark) VALUES (p_user, 1)
    ON CONFLICT (user_id) DO UPDATE SET high_watermark = h.high_watermark + 1
    RETURNING high_watermark INTO o_sync_seq;
    INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id,
                             data, created_at)
    VALUES (p_user, o_sync_seq, 'read', p_conv, o_target, NULL, o_source, 0, o_data, p_now);
END
$fn$;
"#;

/// Step 13 (issue 18): the switches' version, moved by each change, so a
/// change is one `privacy` user event (`privacy:<version>`) in the user's
/// own log, and a device applies only a newer one. 0: never changed.
pub const PRIVACY_VERSIONS: &str = r#"
ALTER TABLE user_privacy ADD COLUMN version BIGINT NOT NULL DEFAULT 0;
UPDATE user_privacy SET version = 1;
"#;

/// Step 15 (D4, D6, issue 14): `tidemark_ack`, a cumulative ACK in one
/// statement, so the writer pipelines the ACKs of a group commit with its
/// sends (`Writer::write_statement`). It implements the table of
/// `tidemark_core::cursor::decide_ack_with`, row for row, on the device row
/// it locks (`FOR UPDATE`, the lock the multi-statement ACK took) and the
/// device's open recovery session, and writes what
/// `tidemark_core::cursor::cursor_after_ack` makes of the decision. It
/// returns the facts it decided on and its decision; the caller
/// (`lifecycle::decide_ack_row`) runs core's rule on those facts and undoes
/// the request, answering `Internal`, were they ever to disagree: the rule
/// lives in core, this is its transcription, keep them the same. Behind the
/// frame's epoch fence of step 14 (`superseded`: nothing written).
pub const ACK_FUNCTION: &str = r#"
CREATE FUNCTION tidemark_ack(
    p_user TEXT, p_device TEXT, p_generation BIGINT, p_token_session TEXT, p_seq BIGINT, p_now BIGINT,
    p_epoch BIGINT,
    OUT o_status TEXT, OUT o_generation BIGINT, OUT o_acked BIGINT, OUT o_state TEXT, OUT o_epoch BIGINT,
    OUT o_session_id TEXT, OUT o_resume_from BIGINT, OUT o_session_hw BIGINT, OUT o_session_expires BIGINT,
    OUT o_decision TEXT, OUT o_to BIGINT)
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    SELECT d.sync_generation, d.acked_sync_seq, d.state, d.connection_epoch
      INTO o_generation, o_acked, o_state, o_epoch
      FROM devices d WHERE d.user_id = p_user AND d.device_id = p_device FOR UPDATE;
    IF NOT FOUND THEN
        o_status := 'no_device';
        RETURN;
    END IF;
    -- tidemark_core::session::frame_superseded
    IF p_epoch IS NOT NULL AND o_epoch > p_epoch THEN
        o_status := 'superseded';
        RETURN;
    END IF;
    o_status := 'ok';
    -- tidemark_core::cursor::decide_ack_with, in its order.
    IF o_state = 'REVOKED' THEN
        o_decision := 'revoked';
        RETURN;
    END IF;
    IF p_generation <> o_generation THEN
        o_decision := 'stale_generation';
        RETURN;
    END IF;
    IF o_state IN ('RESETTING', 'NEW') THEN
        o_decision := 'resetting';
        RETURN;
    END IF;
    IF o_state = 'RECOVERING' THEN
        SELECT r.session_id, r.resume_from, r.high_watermark, r.expires_at
          INTO o_session_id, o_resume_from, o_session_hw, o_session_expires
          FROM recovery_sessions r WHERE r.user_id = p_user AND r.device_id = p_device AND r.state = 'ACTIVE';
        IF NOT FOUND OR o_session_id IS DISTINCT FROM p_token_session THEN
            o_decision := 'unchanged';
            RETURN;
        END IF;
        IF p_now >= o_session_expires THEN
            o_decision := 'recovery_expired';
            UPDATE recovery_sessions SET state = 'EXPIRED'
             WHERE user_id = p_user AND device_id = p_device AND state = 'ACTIVE';
            UPDATE devices SET sync_generation = o_generation + 1, state = 'RESETTING',
                   row_version = row_version + 1, updated_at = p_now
             WHERE user_id = p_user AND device_id = p_device;
            RETURN;
        END IF;
        IF p_seq = o_session_hw THEN
            o_decision := 'complete_recovery';
            o_to := GREATEST(o_session_hw, o_acked);
            UPDATE recovery_sessions SET state = 'COMPLETED'
             WHERE user_id = p_user AND session_id = o_session_id AND state = 'ACTIVE';
            IF NOT FOUND THEN
                RAISE EXCEPTION 'the live recovery session % did not complete once', o_session_id;
            END IF;
            UPDATE devices SET acked_sync_seq = o_to, state = 'ACTIVE',
                   row_version = row_version + 1, updated_at = p_now
             WHERE user_id = p_user AND device_id = p_device;
            RETURN;
        END IF;
        o_decision := 'unchanged';
        RETURN;
    END IF;
    IF p_seq > o_acked THEN
        o_decision := 'advance';
        o_to := p_seq;
        UPDATE devices SET acked_sync_seq = p_seq, row_version = row_version + 1, updated_at = p_now
         WHERE user_id = p_user AND device_id = p_device;
    ELSE
        o_decision := 'unchanged';
    END IF;
END
$fn$;
"#;

/// `tidemark_send_on`'s signature and its epoch fence (steps 14 and 17),
/// up to the send itself. One text for both steps.
macro_rules! send_on_fence {
    () => {
        r#"(
    p_conv TEXT, p_message_id TEXT, p_sender TEXT, p_sender_device TEXT, p_client_msg_id TEXT,
    p_kind TEXT, p_content TEXT, p_state TEXT, p_quote_id TEXT, p_now BIGINT, p_outbox_kind TEXT,
    p_control_kinds TEXT[], p_mentions TEXT[], p_mention_all BOOLEAN, p_mention_all_members_max BIGINT,
    p_epoch BIGINT,
    OUT o_status TEXT, OUT o_message_id TEXT, OUT o_conv_id TEXT, OUT o_msg_seq BIGINT, OUT o_created_at BIGINT,
    OUT o_kind TEXT, OUT o_quote_kind TEXT, OUT o_quote_sees BOOLEAN,
    OUT o_conv_kind TEXT, OUT o_owner TEXT, OUT o_members BIGINT)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_newest BIGINT;
BEGIN
    IF p_epoch IS NOT NULL THEN
        SELECT d.connection_epoch INTO v_newest FROM devices d
         WHERE d.user_id = p_sender AND d.device_id = p_sender_device;
        -- tidemark_core::session::frame_superseded
        IF COALESCE(v_newest, 0) > p_epoch THEN
            o_status := 'superseded';
            o_msg_seq := v_newest;
            RETURN;
        END IF;
    END IF;
"#
    };
}

/// Step 14 (P2, issue 14): `tidemark_send_on`, the send of step 11 behind
/// the frame's epoch fence, still one statement. With `p_epoch` (the
/// WebSocket connection the send came on; NULL over HTTP: any epoch) older
/// than the device's newest `connection_epoch`, it answers `superseded`
/// with that epoch in `o_msg_seq` and writes nothing; the caller lets
/// `tidemark_core::session::frame_superseded` decide and cross-checks. The
/// device row is read without a lock: a send that read the older epoch is
/// ordered before the newer connection opened (its bump was not yet
/// committed), so only frames that arrive after the supersession are
/// refused, which is what P2 asks; and the conversation side takes no
/// user-side lock (the lock order of `lib.rs`).
pub const FRAME_FENCE: &str = concat!(
    r#"
CREATE FUNCTION tidemark_send_on"#,
    send_on_fence!(),
    r#"    SELECT * INTO o_status, o_message_id, o_conv_id, o_msg_seq, o_created_at, o_kind, o_quote_kind, o_quote_sees,
                  o_conv_kind, o_owner, o_members
      FROM tidemark_send(p_conv, p_message_id, p_sender, p_sender_device, p_client_msg_id, p_kind, p_content,
                         p_state, p_quote_id, p_now, p_outbox_kind, p_control_kinds, p_mentions, p_mention_all,
                         p_mention_all_members_max);
END
$fn$;
"#
);

/// Step 12 (P4, issue 20): the user's push preview preference and the
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

/// Step 10 (P4, issue 20): one offline push target per device, keyed like
/// `devices` (a user table, distributed by `user_id`). The token is sealed
/// by the server (AES-GCM) and found again by its hash; `pushed_through`
/// is the `sync_seq` up to which the device's log is settled for push
/// (only grows), so what a device owes is derived from the committed log,
/// never queued. `next_at` holds a coalescing window or a backoff;
/// `claim_seq`/`claim_until` are the lease of the node working on it,
/// taken with `FOR UPDATE SKIP LOCKED` so two nodes never push one device
/// at once. Deleted with the device's revocation and the user's
/// deactivation or deletion.
pub const PUSH_TARGETS: &str = r#"
CREATE TABLE IF NOT EXISTS push_targets (
    user_id         TEXT NOT NULL,
    device_id       TEXT NOT NULL,
    platform        TEXT NOT NULL,
    token_sealed    BYTEA NOT NULL,
    token_hash      TEXT NOT NULL,
    token_last4     TEXT NOT NULL,
    app_id          TEXT NOT NULL,
    p256dh          TEXT,
    auth            TEXT,
    preview         TEXT NOT NULL CHECK (preview IN ('none','conversation','full')),
    pushed_through  BIGINT NOT NULL,
    next_at         BIGINT NOT NULL DEFAULT 0,
    attempts        INTEGER NOT NULL DEFAULT 0,
    claim_seq       BIGINT NOT NULL DEFAULT 0,
    claim_until     BIGINT NOT NULL DEFAULT 0,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL,
    PRIMARY KEY (user_id, device_id)
);
CREATE INDEX IF NOT EXISTS push_targets_due ON push_targets (next_at);
"#;

/// The body of a send after its fences (`tidemark_send` of step 11, and
/// `tidemark_send_on` since step 17): the idempotency check, the
/// conversation's row lock, the membership, quote and mention checks,
/// `msg_seq`, the message and its outbox row. One text for both steps.
macro_rules! send_body {
    () => {
        r#"    SELECT m.message_id, m.conv_id, m.msg_seq, m.created_at, m.kind
      INTO o_message_id, o_conv_id, o_msg_seq, o_created_at, o_kind
      FROM messages m WHERE m.sender = p_sender AND m.client_msg_id = p_client_msg_id;
    IF FOUND THEN
        o_status := 'dup';
        RETURN;
    END IF;
    SELECT c.kind, c.owner INTO o_conv_kind, o_owner FROM conversations c WHERE c.conv_id = p_conv FOR UPDATE;
    IF NOT FOUND THEN
        o_status := 'no_conv';
        RETURN;
    END IF;
    PERFORM 1 FROM membership_periods p WHERE p.conv_id = p_conv AND p.user_id = p_sender AND p.leave_seq IS NULL;
    IF NOT FOUND THEN
        o_status := 'not_member';
        RETURN;
    END IF;
    IF p_quote_id IS NOT NULL THEN
        SELECT q.kind, EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = q.conv_id AND p.user_id = p_sender
                                 AND p.join_seq <= q.msg_seq AND (p.leave_seq IS NULL OR p.leave_seq >= q.msg_seq))
          INTO o_quote_kind, o_quote_sees
          FROM messages q WHERE q.conv_id = p_conv AND q.message_id = p_quote_id;
        IF NOT FOUND OR o_quote_kind = ANY (p_control_kinds) OR NOT o_quote_sees THEN
            o_status := 'quote';
            RETURN;
        END IF;
    END IF;
    IF p_mention_all THEN
        SELECT COUNT(*) INTO o_members FROM membership_periods p WHERE p.conv_id = p_conv AND p.leave_seq IS NULL;
        IF o_conv_kind = 'group' AND o_owner IS DISTINCT FROM p_sender AND o_members > p_mention_all_members_max THEN
            o_status := 'mention_all';
            RETURN;
        END IF;
    END IF;
    UPDATE conversations c SET head = c.head + 1 WHERE c.conv_id = p_conv RETURNING c.head INTO o_msg_seq;
    INSERT INTO messages (conv_id, msg_seq, message_id, sender, sender_device, client_msg_id, kind, content,
                          state, version, target_id, quote_id, created_at, mentions, mention_all)
    VALUES (p_conv, o_msg_seq, p_message_id, p_sender, p_sender_device, p_client_msg_id, p_kind, p_content,
            p_state, 1, NULL, p_quote_id, p_now, p_mentions, p_mention_all)
    ON CONFLICT (sender, client_msg_id) DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'client_msg_id % was committed concurrently', p_client_msg_id
            USING ERRCODE = 'serialization_failure';
    END IF;
    INSERT INTO outbox (conv_id, kind, source_event_id, msg_seq, actor, created_at)
    VALUES (p_conv, p_outbox_kind, p_message_id, o_msg_seq, p_sender, p_now);
    o_status := 'ok';
    o_message_id := p_message_id;
    o_conv_id := p_conv;
    o_created_at := p_now;
    o_kind := p_kind;
"#
    };
}

/// Step 11 (issue 18): a message's mentions are facts of the message
/// (`mentions`, the user ids it names, NULL when none; `mention_all`,
/// everyone), so every count is rebuilt from them; each `user_convs` row
/// keeps `mentions`, the unread messages that mention its user, moved with
/// `unread` by the fan-out and the recounts (`events::COUNT_MENTIONS`).
/// `tidemark_send` (step 2) is replaced by one that also stores them and
/// reads, for a mention of everyone, the facts `mention::check_mention_all`
/// judges (`mention_all`: refused when that rule would refuse them; the
/// facts come back so the caller lets core decide and cross-checks, as for
/// a quote). The function's result changes, so it is dropped and created.
pub const MENTIONS: &str = concat!(
    r#"
ALTER TABLE messages ADD COLUMN mentions TEXT[];
ALTER TABLE messages ADD COLUMN mention_all BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE user_convs ADD COLUMN mentions BIGINT NOT NULL DEFAULT 0;
DROP FUNCTION tidemark_send(TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, BIGINT, TEXT, TEXT[]);
CREATE FUNCTION tidemark_send(
    p_conv TEXT, p_message_id TEXT, p_sender TEXT, p_sender_device TEXT, p_client_msg_id TEXT,
    p_kind TEXT, p_content TEXT, p_state TEXT, p_quote_id TEXT, p_now BIGINT, p_outbox_kind TEXT,
    p_control_kinds TEXT[], p_mentions TEXT[], p_mention_all BOOLEAN, p_mention_all_members_max BIGINT,
    OUT o_status TEXT, OUT o_message_id TEXT, OUT o_conv_id TEXT, OUT o_msg_seq BIGINT, OUT o_created_at BIGINT,
    OUT o_kind TEXT, OUT o_quote_kind TEXT, OUT o_quote_sees BOOLEAN,
    OUT o_conv_kind TEXT, OUT o_owner TEXT, OUT o_members BIGINT)
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
"#,
    send_body!(),
    r#"END
$fn$;
"#
);

/// Step 17 (issue 14): `tidemark_send_on` runs the send's body itself
/// instead of calling `tidemark_send` from it, and `tidemark_send` goes
/// (nothing else calls it). The nested call cost a statement's executor
/// set-up and a composite row per send: `pg_stat_statements` in `bench
/// ingest --database` read 62.9 µs per `tidemark_send_on` against 49.8 for
/// the `tidemark_send` inside it. Same arguments, same answers: the epoch
/// fence of step 14, then the body of step 11 (`send_body!`).
pub const SEND_INLINE: &str = concat!(
    r#"
CREATE OR REPLACE FUNCTION tidemark_send_on"#,
    send_on_fence!(),
    send_body!(),
    r#"END
$fn$;
DROP FUNCTION tidemark_send(TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, BIGINT, TEXT, TEXT[], TEXT[],
                            BOOLEAN, BIGINT);
"#
);

/// Step 3: each device's newest WebSocket connection (P2), moved by
/// `Store::open_connection` on whichever node the device connects to; and
/// an index of the revoked devices, which every node of a cluster reloads
/// periodically (`Store::revoked_devices`) as the fallback of the bus's
/// revocation kicks.
pub const CONNECTION_EPOCH: &str = r#"
ALTER TABLE devices ADD COLUMN IF NOT EXISTS connection_epoch BIGINT NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS devices_revoked ON devices (user_id, device_id) WHERE state = 'REVOKED';
"#;

/// Step 9: a deleted user's row stays as a tombstone (`deleted_at` set,
/// deactivated too), so its name, the author of its messages, is never
/// given to another account; its devices, log and cursors are gone.
pub const DELETED_USERS: &str = r#"
ALTER TABLE users ADD COLUMN IF NOT EXISTS deleted_at BIGINT;
"#;

/// Step 8: the durable audit log (`tidemark_core::audit`), one row per
/// account or device event, ids as keyed hashes, never a secret; found by
/// user hash and time, trimmed by time (the retention of `tidemark serve
/// --audit-keep-days`).
pub const AUDIT_LOG: &str = r#"
CREATE TABLE IF NOT EXISTS audit_log (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at           BIGINT NOT NULL,
    event        TEXT COLLATE "C" NOT NULL,
    actor        TEXT COLLATE "C" NOT NULL,
    user_hash    TEXT COLLATE "C" NOT NULL,
    device_hash  TEXT COLLATE "C",
    address      TEXT COLLATE "C"
);
CREATE INDEX IF NOT EXISTS audit_log_by_user ON audit_log (user_hash, at);
CREATE INDEX IF NOT EXISTS audit_log_by_time ON audit_log (at);
"#;

/// Step 7: an operator ends sessions (`tidemark_core::session`). A user's
/// or a device's `sessions_ended_at` refuses the access tokens issued at
/// or before it (0: none ended); `deactivated_at` set: the account no
/// longer logs in and none of its tokens work.
pub const SESSION_ENDS: &str = r#"
ALTER TABLE users ADD COLUMN IF NOT EXISTS deactivated_at BIGINT;
ALTER TABLE users ADD COLUMN IF NOT EXISTS sessions_ended_at BIGINT NOT NULL DEFAULT 0;
ALTER TABLE devices ADD COLUMN IF NOT EXISTS sessions_ended_at BIGINT NOT NULL DEFAULT 0;
"#;

/// Step 6: refresh-token reuse detection (`tidemark_core::refresh`). A
/// token keeps its row once used (`used_at` set) until it expires, so a
/// replay is recognised; `family` is the chain of rotations from one
/// login. A token stored before this step is a family of its own. (On a
/// sharded database `refresh_tokens` stays a table looked up by its own
/// key; `family` is read only with a token's row or to revoke it.)
pub const REFRESH_FAMILIES: &str = r#"
ALTER TABLE refresh_tokens ADD COLUMN IF NOT EXISTS family TEXT COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE refresh_tokens ADD COLUMN IF NOT EXISTS used_at BIGINT;
UPDATE refresh_tokens SET family = token_hash WHERE family = '';
CREATE INDEX IF NOT EXISTS refresh_tokens_by_family ON refresh_tokens (family);
"#;

/// The last step this build knows: the version of a database it opened.
pub const SCHEMA_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The record of applied steps (created before step 1, outside the steps).
const MIGRATIONS_TABLE_SQL: &str = r#"
CREATE TABLE IF NOT EXISTS schema_migrations (
    version     BIGINT PRIMARY KEY,
    name        TEXT COLLATE "C" NOT NULL,
    applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
)"#;

/// Step 5 (issue 18): a user's privacy switches, keyed by user (a user
/// table, distributed by `user_id`). No row means both off. Presence itself
/// is never stored: it lives in the nodes' memory only.
pub const USER_PRIVACY: &str = r#"
CREATE TABLE user_privacy (
    user_id           TEXT COLLATE "C" PRIMARY KEY,
    -- Others see the user offline; no presence frame of theirs goes out.
    hide_presence     BOOLEAN NOT NULL DEFAULT FALSE,
    -- Others do not see the user's read positions (conv.receipts).
    private_receipts  BOOLEAN NOT NULL DEFAULT FALSE,
    updated_at        BIGINT NOT NULL
);
"#;

/// Step 1, the schema as first released (before numbered migrations it
/// was run at every open, hence `IF NOT EXISTS` throughout: on a database
/// created by such a build it changes nothing and is simply recorded).
/// Numbers are `BIGINT` (Rust `i64`; sequences are `u64` on the Rust side and never exceed `i64::MAX`), flags are `BOOLEAN`, ids
/// and JSON payloads are `TEXT COLLATE "C"`: ids compare and sort bytewise,
/// as in SQLite and in Rust, whatever the database's default collation.
pub const SCHEMA: &str = r#"
-- Server-wide values: the token secret, the schema version.
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT COLLATE "C" PRIMARY KEY,
    value BYTEA NOT NULL
);

-- Accounts. Passwords are argon2 PHC strings, never plain text.
CREATE TABLE IF NOT EXISTS users (
    user_id       TEXT COLLATE "C" PRIMARY KEY,
    password_hash TEXT COLLATE "C" NOT NULL,
    created_at    BIGINT NOT NULL
);

-- One row per (user, device): the device's identity and its sync cursor
-- (D1). The cursor moves only by compare-and-set on the row locked with
-- SELECT ... FOR UPDATE: ACKs only forward within a generation, a reset
-- bumps sync_generation first (D4, D5).
CREATE TABLE IF NOT EXISTS devices (
    user_id          TEXT COLLATE "C" NOT NULL,
    device_id        TEXT COLLATE "C" NOT NULL,
    name             TEXT COLLATE "C" NOT NULL,
    sync_generation  BIGINT NOT NULL,
    acked_sync_seq   BIGINT NOT NULL,
    state            TEXT COLLATE "C" NOT NULL CHECK (state IN ('NEW','ACTIVE','RESETTING','RECOVERING','REVOKED')),
    row_version      BIGINT NOT NULL,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    PRIMARY KEY (user_id, device_id)
);

-- Refresh tokens by SHA-256 of their secret; used once (rotation).
CREATE TABLE IF NOT EXISTS refresh_tokens (
    token_hash  TEXT COLLATE "C" PRIMARY KEY,
    user_id     TEXT COLLATE "C" NOT NULL,
    device_id   TEXT COLLATE "C" NOT NULL,
    expires_at  BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS refresh_tokens_by_device ON refresh_tokens (user_id, device_id);

-- Conversations. `head` is the highest committed msg_seq. It is advanced by
-- `UPDATE ... SET head = head + 1 RETURNING head` in the transaction that
-- inserts the event; the row lock that UPDATE takes is held until COMMIT,
-- so whoever assigns n+1 waits until n is committed or rolled back, and a
-- visible n+1 implies a visible n (S2), across writers and nodes. The same
-- row lock is the conversation's linearisation point for membership checks
-- (G1). A direct pair has one row, found by its `direct_key`.
CREATE TABLE IF NOT EXISTS conversations (
    conv_id     TEXT COLLATE "C" PRIMARY KEY,
    kind        TEXT COLLATE "C" NOT NULL,
    direct_key  TEXT COLLATE "C" UNIQUE,
    head        BIGINT NOT NULL DEFAULT 0,
    -- The lowest msg_seq still retained (C2 `trimmed`); 1 until trimming.
    min_seq     BIGINT NOT NULL DEFAULT 1,
    -- Bumped by any operation that rewrites the log (C2 EPOCH_CHANGED).
    epoch       BIGINT NOT NULL DEFAULT 1,
    -- Group owner (may remove members); NULL for direct conversations.
    owner       TEXT COLLATE "C",
    created_at  BIGINT NOT NULL
);

-- Membership periods [join_seq, leave_seq] (closed; leave_seq NULL while
-- active), a new period_id per join (G1). Fan-out reads the periods that
-- cover a message's msg_seq, never the current member list (F4). Period
-- ids start at 1: 0 is USER_SCOPE_PERIOD, the scope of per-user events.
CREATE TABLE IF NOT EXISTS membership_periods (
    conv_id    TEXT COLLATE "C" NOT NULL,
    period_id  BIGINT GENERATED ALWAYS AS IDENTITY (START WITH 1),
    user_id    TEXT COLLATE "C" NOT NULL,
    join_seq   BIGINT NOT NULL,
    leave_seq  BIGINT,
    PRIMARY KEY (conv_id, period_id),
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
    conv_id        TEXT COLLATE "C" NOT NULL,
    msg_seq        BIGINT NOT NULL,
    message_id     TEXT COLLATE "C" NOT NULL UNIQUE,
    sender         TEXT COLLATE "C" NOT NULL,
    sender_device  TEXT COLLATE "C" NOT NULL,
    client_msg_id  TEXT COLLATE "C" NOT NULL,
    kind           TEXT COLLATE "C" NOT NULL,
    content        TEXT COLLATE "C" NOT NULL,
    state          TEXT COLLATE "C" NOT NULL,
    version        BIGINT NOT NULL DEFAULT 1,
    -- The message a control event acts on.
    target_id      TEXT COLLATE "C",
    -- The message this one quotes (same conversation).
    quote_id       TEXT COLLATE "C",
    -- msg_seq of the recall event, once recalled.
    recall_seq     BIGINT,
    created_at     BIGINT NOT NULL,
    PRIMARY KEY (conv_id, msg_seq),
    UNIQUE (sender, client_msg_id)
);

-- Reactions by user (E2); the message's version moves with each change.
-- Led by conv_id so they live beside their message.
CREATE TABLE IF NOT EXISTS reactions (
    conv_id     TEXT COLLATE "C" NOT NULL,
    message_id  TEXT COLLATE "C" NOT NULL,
    user_id     TEXT COLLATE "C" NOT NULL,
    reaction    TEXT COLLATE "C" NOT NULL,
    event_seq   BIGINT NOT NULL,
    PRIMARY KEY (conv_id, message_id, user_id, reaction)
);

-- Messages a user deleted for themselves only (E3).
CREATE TABLE IF NOT EXISTS user_deleted (
    user_id     TEXT COLLATE "C" NOT NULL,
    message_id  TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (user_id, message_id)
);

-- Per-device delivery (R1): distinct from the sync ACK and from read.
-- Recorded by the user's own device, so it is user data.
CREATE TABLE IF NOT EXISTS deliveries (
    user_id       TEXT COLLATE "C" NOT NULL,
    message_id    TEXT COLLATE "C" NOT NULL,
    device_id     TEXT COLLATE "C" NOT NULL,
    delivered_at  BIGINT NOT NULL,
    PRIMARY KEY (user_id, message_id, device_id)
);

-- The transactional outbox: written with the fact it announces (S3), removed
-- by the fan-out transaction that consumed it (F1). Survives restarts.
-- `outbox_id` orders items; with one writer per database it is also commit
-- order.
CREATE TABLE IF NOT EXISTS outbox (
    conv_id          TEXT COLLATE "C" NOT NULL,
    outbox_id        BIGINT GENERATED ALWAYS AS IDENTITY,
    kind             TEXT COLLATE "C" NOT NULL,
    source_event_id  TEXT COLLATE "C" NOT NULL,
    msg_seq          BIGINT NOT NULL,
    actor            TEXT COLLATE "C" NOT NULL,
    created_at       BIGINT NOT NULL,
    PRIMARY KEY (conv_id, outbox_id)
);
CREATE UNIQUE INDEX IF NOT EXISTS outbox_in_order ON outbox (outbox_id);

-- Per-user sync head. Advanced with `... high_watermark + 1 RETURNING` in
-- the same transaction as the events it numbers; the row lock serialises
-- concurrent fan-outs to one user, so the head is also the committed high
-- watermark and no two writers share a sync_seq (F2).
CREATE TABLE IF NOT EXISTS user_heads (
    user_id         TEXT COLLATE "C" PRIMARY KEY,
    high_watermark  BIGINT NOT NULL,
    -- Events at or below this were trimmed (L1); only snapshots reach them.
    trimmed_upto    BIGINT NOT NULL DEFAULT 0
);

-- Recovery sessions (D6): a frozen (resume_from, high_watermark] replay for
-- a device whose local store fell a little behind its ACK. At most one
-- ACTIVE per device; it fences retention from resume_from until it
-- completes (by its own CAS on the final ACK) or expires.
CREATE TABLE IF NOT EXISTS recovery_sessions (
    user_id         TEXT COLLATE "C" NOT NULL,
    session_id      TEXT COLLATE "C" NOT NULL,
    device_id       TEXT COLLATE "C" NOT NULL,
    generation      BIGINT NOT NULL,
    resume_from     BIGINT NOT NULL,
    high_watermark  BIGINT NOT NULL,
    state           TEXT COLLATE "C" NOT NULL CHECK (state IN ('ACTIVE','COMPLETED','EXPIRED')),
    created_at      BIGINT NOT NULL,
    expires_at      BIGINT NOT NULL,
    PRIMARY KEY (user_id, session_id)
);
CREATE UNIQUE INDEX IF NOT EXISTS recovery_one_active ON recovery_sessions (user_id, device_id) WHERE state = 'ACTIVE';

-- Snapshots (D7): a frozen base, BUILDING until its pages are stored, then
-- READY and immutable, INSTALLED once the device acknowledged it. BUILDING
-- and READY bases fence retention until they expire. The store API finds a
-- snapshot by its id alone, so the id is the key (see the module docs).
CREATE TABLE IF NOT EXISTS snapshots (
    snapshot_id      TEXT COLLATE "C" PRIMARY KEY,
    user_id          TEXT COLLATE "C" NOT NULL,
    device_id        TEXT COLLATE "C" NOT NULL,
    generation       BIGINT NOT NULL,
    base_sync_seq    BIGINT NOT NULL,
    state            TEXT COLLATE "C" NOT NULL CHECK (state IN ('BUILDING','READY','INSTALLED','EXPIRED')),
    manifest_digest  TEXT COLLATE "C" NOT NULL DEFAULT '',
    pages            BIGINT NOT NULL DEFAULT 0,
    created_at       BIGINT NOT NULL,
    expires_at       BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS snapshots_by_user ON snapshots (user_id, state);

CREATE TABLE IF NOT EXISTS snapshot_items (
    snapshot_id  TEXT COLLATE "C" NOT NULL,
    page         BIGINT NOT NULL,
    idx          BIGINT NOT NULL,
    item         TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (snapshot_id, page, idx)
);

-- The user sync log, keyed (user_id, sync_seq) for range reads (D2);
-- UNIQUE(user_id, source_event_id, period_id) makes fan-out idempotent (F3).
CREATE TABLE IF NOT EXISTS user_events (
    user_id          TEXT COLLATE "C" NOT NULL,
    sync_seq         BIGINT NOT NULL,
    kind             TEXT COLLATE "C" NOT NULL,
    conv_id          TEXT COLLATE "C" NOT NULL,
    msg_seq          BIGINT,
    message_id       TEXT COLLATE "C",
    source_event_id  TEXT COLLATE "C" NOT NULL,
    -- The membership period that admitted it; 0 for per-user events.
    period_id        BIGINT NOT NULL,
    -- Payload of per-user events (read, settings, delete), JSON.
    data             TEXT COLLATE "C",
    created_at       BIGINT NOT NULL,
    PRIMARY KEY (user_id, sync_seq),
    UNIQUE (user_id, source_event_id, period_id)
);
CREATE INDEX IF NOT EXISTS user_events_by_conv ON user_events (user_id, conv_id, msg_seq);
CREATE INDEX IF NOT EXISTS user_events_by_message ON user_events (user_id, message_id);

-- Per-user conversation projection (list, unread), moved only inside the
-- fan-out transaction that wrote the user event (R3).
CREATE TABLE IF NOT EXISTS user_convs (
    user_id           TEXT COLLATE "C" NOT NULL,
    conv_id           TEXT COLLATE "C" NOT NULL,
    last_msg_seq      BIGINT NOT NULL DEFAULT 0,
    read_seq          BIGINT NOT NULL DEFAULT 0,
    unread            BIGINT NOT NULL DEFAULT 0,
    muted             BOOLEAN NOT NULL DEFAULT FALSE,
    pinned            BOOLEAN NOT NULL DEFAULT FALSE,
    settings_version  BIGINT NOT NULL DEFAULT 0,
    -- FALSE once the user left or was removed.
    active            BOOLEAN NOT NULL DEFAULT TRUE,
    PRIMARY KEY (user_id, conv_id)
);

-- Fan-out items that hit two membership periods of one user (F4): never
-- delivered, kept for repair and reported as an integrity error.
CREATE TABLE IF NOT EXISTS fanout_quarantine (
    user_id          TEXT COLLATE "C" NOT NULL,
    source_event_id  TEXT COLLATE "C" NOT NULL,
    conv_id          TEXT COLLATE "C" NOT NULL,
    msg_seq          BIGINT NOT NULL,
    reason           TEXT COLLATE "C" NOT NULL,
    created_at       BIGINT NOT NULL,
    PRIMARY KEY (user_id, source_event_id)
);
"#;

/// Step 2: `tidemark_send`, a send in one statement, so a send is one round
/// trip and the writer can pipeline the sends of one group commit
/// (`events::accept_send`). It does what the multi-statement send did, in
/// the same order, inside the caller's transaction: the idempotency lookup
/// (`dup`: the earlier event, for `control::check_replay` to judge), the
/// conversation row lock (`no_conv`), the membership check at that
/// linearisation point (`not_member`; every statement of a volatile
/// PL/pgSQL function takes a fresh snapshot under READ COMMITTED, so it sees
/// every change committed before the lock was granted, G1), the quote's
/// facts (`quote`: refused when `control::check_quote` would refuse them;
/// the facts come back so the caller lets core decide and cross-checks),
/// then `head + 1` under the lock (S2) and the message with its outbox
/// record (S3). A refusal writes nothing, so it needs no savepoint. An
/// idempotency key committed by another writer since the lookup raises a
/// serialisation failure (40001): the request rolls back and the writer
/// runs it again, when the lookup finds it (S1).
pub const SEND_FUNCTION: &str = r#"
CREATE OR REPLACE FUNCTION tidemark_send(
    p_conv TEXT, p_message_id TEXT, p_sender TEXT, p_sender_device TEXT, p_client_msg_id TEXT,
    p_kind TEXT, p_content TEXT, p_state TEXT, p_quote_id TEXT, p_now BIGINT, p_outbox_kind TEXT,
    p_control_kinds TEXT[],
    OUT o_status TEXT, OUT o_message_id TEXT, OUT o_conv_id TEXT, OUT o_msg_seq BIGINT, OUT o_created_at BIGINT,
    OUT o_kind TEXT, OUT o_quote_kind TEXT, OUT o_quote_sees BOOLEAN)
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    SELECT m.message_id, m.conv_id, m.msg_seq, m.created_at, m.kind
      INTO o_message_id, o_conv_id, o_msg_seq, o_created_at, o_kind
      FROM messages m WHERE m.sender = p_sender AND m.client_msg_id = p_client_msg_id;
    IF FOUND THEN
        o_status := 'dup';
        RETURN;
    END IF;
    PERFORM 1 FROM conversations c WHERE c.conv_id = p_conv FOR UPDATE;
    IF NOT FOUND THEN
        o_status := 'no_conv';
        RETURN;
    END IF;
    PERFORM 1 FROM membership_periods p WHERE p.conv_id = p_conv AND p.user_id = p_sender AND p.leave_seq IS NULL;
    IF NOT FOUND THEN
        o_status := 'not_member';
        RETURN;
    END IF;
    IF p_quote_id IS NOT NULL THEN
        SELECT q.kind, EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = q.conv_id AND p.user_id = p_sender
                                 AND p.join_seq <= q.msg_seq AND (p.leave_seq IS NULL OR p.leave_seq >= q.msg_seq))
          INTO o_quote_kind, o_quote_sees
          FROM messages q WHERE q.conv_id = p_conv AND q.message_id = p_quote_id;
        IF NOT FOUND OR o_quote_kind = ANY (p_control_kinds) OR NOT o_quote_sees THEN
            o_status := 'quote';
            RETURN;
        END IF;
    END IF;
    UPDATE conversations c SET head = c.head + 1 WHERE c.conv_id = p_conv RETURNING c.head INTO o_msg_seq;
    INSERT INTO messages (conv_id, msg_seq, message_id, sender, sender_device, client_msg_id, kind, content,
                          state, version, target_id, quote_id, created_at)
    VALUES (p_conv, o_msg_seq, p_message_id, p_sender, p_sender_device, p_client_msg_id, p_kind, p_content,
            p_state, 1, NULL, p_quote_id, p_now)
    ON CONFLICT (sender, client_msg_id) DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'client_msg_id % was committed concurrently', p_client_msg_id
            USING ERRCODE = 'serialization_failure';
    END IF;
    INSERT INTO outbox (conv_id, kind, source_event_id, msg_seq, actor, created_at)
    VALUES (p_conv, p_outbox_kind, p_message_id, o_msg_seq, p_sender, p_now);
    o_status := 'ok';
    o_message_id := p_message_id;
    o_conv_id := p_conv;
    o_created_at := p_now;
    o_kind := p_kind;
END
$fn$;
"#;

/// Longest schema name accepted (PostgreSQL truncates identifiers at 63).
pub const SCHEMA_NAME_MAX: usize = 63;

/// A schema name is used unquoted in `search_path` and DDL, so only plain
/// lower-case identifiers are accepted.
pub fn valid_schema_name(name: &str) -> bool {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    first_ok
        && name.len() <= SCHEMA_NAME_MAX
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// Brings the database to [`SCHEMA_VERSION`] (creating the PostgreSQL
/// schema `namespace` first, if one is named) and returns the version it
/// found before. One transaction under an advisory lock: concurrent opens
/// wait for each other, and a failed step leaves nothing behind.
pub(crate) async fn migrate(c: &ClientWrapper, namespace: Option<&str>) -> StoreResult<i64> {
    let lock_key = format!("tidemark.schema.{}", namespace.unwrap_or("public"));
    db::batch(c, "BEGIN").await.map_err(db::error)?;
    let result = async {
        db::exec(c, "SELECT pg_advisory_xact_lock(hashtext($1))", &[&lock_key]).await?;
        if let Some(ns) = namespace {
            assert!(valid_schema_name(ns), "schema name checked at open");
            db::batch(c, &format!("CREATE SCHEMA IF NOT EXISTS {ns}")).await.map_err(db::error)?;
        }
        db::batch(c, MIGRATIONS_TABLE_SQL).await.map_err(db::error)?;
        let applied: i64 =
            db::col(&db::query_one(c, "SELECT COALESCE(MAX(version), 0) FROM schema_migrations", &[]).await?, 0)?;
        // A database from before numbered migrations has only this stamp.
        let legacy = legacy_stamp(c).await?;
        let found = applied.max(legacy.unwrap_or(0));
        if found > SCHEMA_VERSION {
            return Err(StoreError::SchemaTooNew { found, known: SCHEMA_VERSION });
        }
        for step in MIGRATIONS.iter().filter(|m| m.version > applied) {
            db::batch(c, step.sql).await.map_err(db::error)?;
            db::exec(c, "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", &[&step.version, &step.name])
                .await?;
            tracing::info!(version = step.version, name = step.name, "applied schema migration");
        }
        if legacy != Some(SCHEMA_VERSION) {
            db::exec(
                c,
                "INSERT INTO meta (key, value) VALUES ('schema_version', convert_to($1::text, 'UTF8'))
                 ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                &[&SCHEMA_VERSION.to_string()],
            )
            .await?;
        }
        Ok(applied)
    }
    .await;
    match result {
        Ok(found) => db::batch(c, "COMMIT").await.map_err(db::error).map(|()| found),
        Err(e) => {
            let _ = db::batch(c, "ROLLBACK").await;
            Err(e)
        }
    }
}

/// `meta.schema_version`, if the `meta` table and the key exist.
async fn legacy_stamp(c: &ClientWrapper) -> StoreResult<Option<i64>> {
    let exists: bool = db::col(&db::query_one(c, "SELECT to_regclass('meta') IS NOT NULL", &[]).await?, 0)?;
    if !exists {
        return Ok(None);
    }
    let stored: Option<String> =
        db::scalar(c, "SELECT convert_from(value, 'UTF8') FROM meta WHERE key = 'schema_version'", &[]).await?;
    stored
        .map(|v| {
            v.parse::<i64>().map_err(|_| StoreError::Internal(format!("meta.schema_version is not a number: {v:?}")))
        })
        .transpose()
}

/// Step 4, large groups (G2, G3); the same layout as SQLite's step 3.
pub const LARGE_GROUPS: &str = r#"
-- A group's mode: 'per_member' or 'shared' (events above `shared_from`,
-- the switch event's msg_seq, live only in the conversation log). One-way.
-- `members_seq`: msg_seq of the last membership change (the servers'
-- member caches compare it).
ALTER TABLE conversations ADD COLUMN mode TEXT NOT NULL DEFAULT 'per_member';
ALTER TABLE conversations ADD COLUMN shared_from BIGINT;
ALTER TABLE conversations ADD COLUMN members_seq BIGINT NOT NULL DEFAULT 0;
-- Open membership periods, kept by the writer with each join and leave
-- (the size cap and the threshold read it instead of counting).
ALTER TABLE conversations ADD COLUMN active_members BIGINT NOT NULL DEFAULT 0;
UPDATE conversations SET active_members =
    (SELECT COUNT(*) FROM membership_periods p WHERE p.conv_id = conversations.conv_id AND p.leave_seq IS NULL);

-- A shared group's published marker, written by the fan-out only (target
-- only grows, version only increments, once per relay batch). Its own row,
-- so the fan-out never takes the conversations row a send locks.
CREATE TABLE conv_markers (
    conv_id  TEXT COLLATE "C" PRIMARY KEY,
    target   BIGINT NOT NULL,
    version  BIGINT NOT NULL
);

-- TRUE on the user's rows of shared groups: the sync path finds them alone.
ALTER TABLE user_convs ADD COLUMN shared BOOLEAN NOT NULL DEFAULT FALSE;
CREATE INDEX user_convs_shared ON user_convs (user_id) WHERE shared;

-- What each device cleared of a shared group's marker (G2); written only
-- by a successful dirty.clear CAS.
CREATE TABLE device_markers (
    user_id          TEXT COLLATE "C" NOT NULL,
    device_id        TEXT COLLATE "C" NOT NULL,
    conv_id          TEXT COLLATE "C" NOT NULL,
    cleared_seq      BIGINT NOT NULL,
    cleared_version  BIGINT NOT NULL,
    PRIMARY KEY (user_id, device_id, conv_id)
);
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
