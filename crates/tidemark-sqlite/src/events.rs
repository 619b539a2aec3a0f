//! Writer-side transactions for conversation events (membership, recall,
//! edit, reaction) and per-user events (read, settings, delete-for-me).
//! Each function runs inside the writer's open transaction and savepoint;
//! an `Err` rolls back everything it wrote. Each loads the facts its rule
//! needs (mostly in one statement), lets the rule in `tidemark-core` decide
//! and writes what it decided; stored payloads are `tidemark_proto::content`.

use std::rc::Rc;

use rusqlite::types::Value;
use rusqlite::vtab::array::Array;
use rusqlite::{params, Connection, OptionalExtension};
use tidemark_core::control::{self, ControlDecision, Target};
use tidemark_core::large::{self, ClearDecision, MarkerFacts};
use tidemark_core::membership::{self, MembershipDecision, MembershipFacts};
use tidemark_core::projection::{self, Settings};
use tidemark_proto::content::{self, Payload};
use tidemark_store::*;

use crate::internal;

type R<T> = StoreResult<T>;

fn q<T: rusqlite::types::FromSql>(c: &Connection, sql: &str, p: impl rusqlite::Params) -> R<Option<T>> {
    c.prepare_cached(sql).map_err(internal)?.query_row(p, |r| r.get(0)).optional().map_err(internal)
}

fn exec(c: &Connection, sql: &str, p: impl rusqlite::Params) -> R<usize> {
    c.prepare_cached(sql).map_err(internal)?.execute(p).map_err(internal)
}

/// The earlier event with this idempotency key, if any: its id, conv,
/// msg_seq and time, once `control::check_replay` found it the same
/// operation (`kinds` empty means "a user message").
pub(crate) fn existing_event_of(
    c: &Connection,
    sender: &str,
    client_msg_id: &str,
    conv: &str,
    kinds: &[&str],
) -> R<Option<(String, String, u64, i64)>> {
    let row: Option<(String, String, u64, i64, String)> = c
        .prepare_cached(
            "SELECT message_id, conv_id, msg_seq, created_at, kind FROM messages WHERE sender = ?1 AND client_msg_id = ?2",
        )
        .map_err(internal)?
        .query_row(params![sender, client_msg_id], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64, r.get(3)?, r.get(4)?))
        })
        .optional()
        .map_err(internal)?;
    match row {
        None => Ok(None),
        Some((id, event_conv, seq, at, kind)) => {
            control::check_replay((&event_conv, &kind), conv, kinds, client_msg_id)?;
            Ok(Some((id, event_conv, seq, at)))
        }
    }
}

pub(crate) fn is_active_member(c: &Connection, conv: &str, user: &str) -> R<bool> {
    Ok(q::<i64>(
        c,
        "SELECT period_id FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2 AND leave_seq IS NULL",
        params![conv, user],
    )?
    .is_some())
}

/// A new conversation event: the next contiguous msg_seq, the fact and its
/// outbox record (S2, S3). The caller has checked rights.
#[allow(clippy::too_many_arguments)]
pub(crate) fn append_conv_event(
    c: &Connection,
    cmd: &ConvEventCmd,
    kind: &str,
    content: &str,
    target_id: Option<&str>,
    quote_id: Option<&str>,
    state: &str,
) -> R<u64> {
    let head: Option<i64> =
        q(c, "UPDATE conversations SET head = head + 1 WHERE conv_id = ?1 RETURNING head", params![cmd.conv])?;
    let Some(seq) = head else {
        return Err(StoreError::NotFound(format!("conversation {}", cmd.conv)));
    };
    exec(
        c,
        "INSERT INTO messages (message_id, conv_id, msg_seq, sender, sender_device, client_msg_id, kind, content, state,
                               version, target_id, quote_id, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, 1, ?10, ?11, ?12)",
        params![
            cmd.event_id,
            cmd.conv,
            seq,
            cmd.actor,
            cmd.actor_device,
            cmd.client_msg_id,
            kind,
            content,
            state,
            target_id,
            quote_id,
            cmd.now_ms
        ],
    )?;
    exec(
        c,
        "INSERT INTO outbox (kind, source_event_id, conv_id, msg_seq, actor, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![event_kind_of(kind), cmd.event_id, cmd.conv, seq, cmd.actor, cmd.now_ms],
    )?;
    Ok(seq as u64)
}

/// The users among `users` that have an account.
pub(crate) fn known_users(c: &Connection, users: &[String]) -> R<Vec<String>> {
    let ids: Array = Rc::new(users.iter().cloned().map(Value::from).collect());
    let mut stmt = c.prepare_cached("SELECT user_id FROM users WHERE user_id IN rarray(?1)").map_err(internal)?;
    let rows = stmt.query_map(params![ids], |r| r.get(0)).map_err(internal)?;
    rows.collect::<Result<_, _>>().map_err(internal)
}

pub(crate) fn create_group(
    c: &Connection,
    cmd: &ConvEventCmd,
    members: &[String],
    policy: GroupPolicy,
) -> R<(String, u64)> {
    // A retried create finds the group its first attempt made.
    let earlier: Option<(String, String)> = c
        .prepare_cached("SELECT conv_id, kind FROM messages WHERE sender = ?1 AND client_msg_id = ?2")
        .map_err(internal)?
        .query_row(params![cmd.actor, cmd.client_msg_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .map_err(internal)?;
    if let Some(conv) = membership::replayed_group(earlier, &cmd.client_msg_id)? {
        return Ok((conv, 1));
    }
    let all = membership::group_members(&cmd.actor, members)?;
    membership::all_known(&all, &known_users(c, &all)?)?;
    exec(
        c,
        "INSERT INTO conversations (conv_id, kind, direct_key, head, epoch, owner, created_at) VALUES (?1, ?2, NULL, 0, 1, ?3, ?4)",
        params![cmd.conv, CONV_GROUP, cmd.actor, cmd.now_ms],
    )?;
    let content = content::GroupCreated { owner: &cmd.actor, members: &all }.to_json();
    let seq = append_conv_event(c, cmd, KIND_CREATED, &content, None, None, STATE_NORMAL)?;
    for u in &all {
        exec(
            c,
            "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES (?1, ?2, ?3, NULL)",
            params![cmd.conv, u, seq as i64],
        )?;
        exec(
            c,
            "INSERT INTO user_convs (user_id, conv_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
            params![u, cmd.conv],
        )?;
    }
    // A group created large switches at once: the conv.created and the
    // switch are fanned out to every member (they learn of the group and
    // of its mode), everything after is read from the conversation log.
    if policy.mode_for_new_group(all.len() as u64) == large::MODE_SHARED {
        switch_to_shared(c, cmd, all.len() as u64)?;
    }
    exec(
        c,
        "UPDATE conversations SET members_seq = ?2, active_members = ?3 WHERE conv_id = ?1",
        params![cmd.conv, seq as i64, all.len() as i64],
    )?;
    Ok((cmd.conv.clone(), seq))
}

/// Puts `conv` in shared mode from `from` (the switch event's msg_seq) on,
/// and flags every member's row so the sync path finds it.
fn set_shared(c: &Connection, conv: &str, from: u64) -> R<()> {
    exec(
        c,
        "UPDATE conversations SET mode = ?2, shared_from = ?3 WHERE conv_id = ?1",
        params![conv, large::MODE_SHARED, from as i64],
    )?;
    exec(
        c,
        "UPDATE user_convs SET shared = 1 WHERE conv_id = ?1
         AND user_id IN (SELECT user_id FROM membership_periods WHERE conv_id = ?1)",
        params![conv],
    )?;
    Ok(())
}

/// G3: a join took the group over the threshold: the switch event, at the
/// next msg_seq, by the writer that ordered the join. Its idempotency key
/// is derived from the join's, so a retried join finds the join and
/// writes nothing more.
fn switch_to_shared(c: &Connection, cmd: &ConvEventCmd, members: u64) -> R<u64> {
    let switch = ConvEventCmd {
        event_id: format!("{}.mode", cmd.event_id),
        client_msg_id: format!("{}.mode", cmd.client_msg_id),
        ..cmd.clone()
    };
    let content = content::ModeChanged { mode: large::MODE_SHARED, members }.to_json();
    let seq = append_conv_event(c, &switch, KIND_MODE, &content, None, None, STATE_NORMAL)?;
    set_shared(c, &cmd.conv, seq)?;
    tracing::info!(conv = %cmd.conv, msg_seq = seq, members, "group switched to shared mode");
    Ok(seq)
}

/// What a membership change decides on, in one statement (`None`: no
/// such conversation).
fn membership_facts(c: &Connection, conv: &str, actor: &str, target: &str) -> R<Option<MembershipFacts>> {
    c.prepare_cached(
        "SELECT c.kind, c.owner,
                EXISTS (SELECT 1 FROM membership_periods WHERE conv_id = c.conv_id AND user_id = ?2 AND leave_seq IS NULL),
                EXISTS (SELECT 1 FROM users WHERE user_id = ?3),
                (SELECT join_seq FROM membership_periods WHERE conv_id = c.conv_id AND user_id = ?3 AND leave_seq IS NULL),
                c.active_members
         FROM conversations c WHERE c.conv_id = ?1",
    )
    .map_err(internal)?
    .query_row(params![conv, actor, target], |r| {
        Ok(MembershipFacts {
            kind: r.get(0)?,
            owner: r.get(1)?,
            actor_active: r.get(2)?,
            target_known: r.get(3)?,
            target_open_join: r.get::<_, Option<i64>>(4)?.map(|v| v as u64),
            active_members: r.get::<_, i64>(5)? as u64,
        })
    })
    .optional()
    .map_err(internal)
}

pub(crate) fn change_membership(
    c: &Connection,
    cmd: &ConvEventCmd,
    target: &str,
    change: MembershipChange,
    policy: GroupPolicy,
) -> R<u64> {
    if let Some((_, _, seq, _)) =
        existing_event_of(c, &cmd.actor, &cmd.client_msg_id, &cmd.conv, &[KIND_JOIN, KIND_LEAVE])?
    {
        return Ok(seq);
    }
    let facts = membership_facts(c, &cmd.conv, &cmd.actor, target)?;
    let decision = membership::decide_membership(&cmd.conv, facts.as_ref(), &cmd.actor, target, change)?;
    let event_kind = match decision {
        MembershipDecision::AlreadyMember { join_seq } => return Ok(join_seq),
        MembershipDecision::Join => KIND_JOIN,
        MembershipDecision::Leave => KIND_LEAVE,
    };
    let content = content::MemberChanged { user: target, by: &cmd.actor, op: change.verb() }.to_json();
    let seq = append_conv_event(c, cmd, event_kind, &content, None, None, STATE_NORMAL)?;
    if decision == MembershipDecision::Join {
        // A new period per join: the old ones keep their own range (G1).
        exec(
            c,
            "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES (?1, ?2, ?3, NULL)",
            params![cmd.conv, target, seq as i64],
        )?;
        let mode: String = q(c, "SELECT mode FROM conversations WHERE conv_id = ?1", params![cmd.conv])?
            .unwrap_or_else(|| large::MODE_PER_MEMBER.to_owned());
        let shared = mode == large::MODE_SHARED;
        exec(
            c,
            "INSERT INTO user_convs (user_id, conv_id, shared) VALUES (?1, ?2, ?3)
             ON CONFLICT(user_id, conv_id) DO UPDATE SET active = 1, shared = excluded.shared",
            params![target, cmd.conv, shared],
        )?;
        let members = facts.as_ref().map_or(0, |f| f.active_members) + 1;
        exec(
            c,
            "UPDATE conversations SET members_seq = ?2, active_members = active_members + 1 WHERE conv_id = ?1",
            params![cmd.conv, seq as i64],
        )?;
        if policy.switches(&mode, members) {
            switch_to_shared(c, cmd, members)?;
        }
    } else {
        // The leave event is the period's last visible seq: the leaver's
        // devices learn of it; nothing after it is theirs (G1).
        let n = exec(
            c,
            "UPDATE membership_periods SET leave_seq = ?3 WHERE conv_id = ?1 AND user_id = ?2 AND leave_seq IS NULL",
            params![cmd.conv, target, seq as i64],
        )?;
        assert_eq!(n, 1, "exactly one open period per member");
        exec(c, "UPDATE user_convs SET active = 0 WHERE user_id = ?1 AND conv_id = ?2", params![target, cmd.conv])?;
        exec(
            c,
            "UPDATE conversations SET members_seq = ?2, active_members = active_members - 1 WHERE conv_id = ?1",
            params![cmd.conv, seq as i64],
        )?;
    }
    Ok(seq)
}

/// The target of a control event by `actor` (a reaction's current state
/// when `reaction` is given), in one statement; `None` if `conv` has no
/// such message.
fn load_target(c: &Connection, conv: &str, message_id: &str, actor: &str, reaction: Option<&str>) -> R<Option<Target>> {
    c.prepare_cached(
        "SELECT m.kind, m.msg_seq, m.sender, m.state, m.version, m.recall_seq,
                EXISTS (SELECT 1 FROM membership_periods p
                        WHERE p.conv_id = m.conv_id AND p.user_id = ?3 AND p.leave_seq IS NULL),
                EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = ?3
                        AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR p.leave_seq >= m.msg_seq)),
                (SELECT event_seq FROM reactions r WHERE r.message_id = m.message_id AND r.user_id = ?3 AND r.reaction = ?4)
         FROM messages m WHERE m.message_id = ?2 AND m.conv_id = ?1",
    )
    .map_err(internal)?
    .query_row(params![conv, message_id, actor, reaction], |r| {
        Ok(Target {
            kind: r.get(0)?,
            msg_seq: r.get::<_, i64>(1)? as u64,
            sender: r.get(2)?,
            state: r.get(3)?,
            version: r.get::<_, i64>(4)? as u64,
            recall_seq: r.get::<_, Option<i64>>(5)?.map(|v| v as u64),
            actor_active: r.get(6)?,
            actor_sees: r.get(7)?,
            actor_reaction: r.get::<_, Option<i64>>(8)?.map(|v| v as u64),
        })
    })
    .optional()
    .map_err(internal)
}

/// A control event's facts and its decision: a retry of an earlier run
/// (`control::decide_retry`), else `decide` on the target. `Ok` is what to
/// write (the target and its new version), `Err` the answer without a write.
fn decide_control(
    c: &Connection,
    cmd: &ConvEventCmd,
    message_id: &str,
    kind: &str,
    reaction: Option<&str>,
    decide: impl FnOnce(Option<&Target>) -> Result<ControlDecision, tidemark_core::Refusal>,
) -> R<Result<(Target, u64), ControlOutcome>> {
    let earlier = existing_event_of(c, &cmd.actor, &cmd.client_msg_id, &cmd.conv, &[kind])?;
    let t = load_target(c, &cmd.conv, message_id, &cmd.actor, reaction)?;
    let decision = match earlier {
        Some((_, _, seq, _)) => control::decide_retry(seq, t.as_ref(), message_id)?,
        None => decide(t.as_ref())?,
    };
    Ok(control::plan(t, decision))
}

pub(crate) fn recall(c: &Connection, cmd: &ConvEventCmd, message_id: &str) -> R<ControlOutcome> {
    let planned =
        decide_control(c, cmd, message_id, KIND_RECALL, None, |t| control::decide_recall(t, &cmd.actor, message_id))?;
    let (t, version) = match planned {
        Ok(write) => write,
        Err(done) => return Ok(done),
    };
    let content = content::Recalled { target_message_id: message_id, target_msg_seq: t.msg_seq }.to_json();
    let seq = append_conv_event(c, cmd, KIND_RECALL, &content, Some(message_id), None, STATE_NORMAL)?;
    // The original content is gone for good: no path can serve it again.
    exec(
        c,
        "UPDATE messages SET state = ?2, content = '{}', version = ?4, recall_seq = ?3 WHERE message_id = ?1",
        params![message_id, STATE_RECALLED, seq as i64, version as i64],
    )?;
    exec(c, "DELETE FROM reactions WHERE message_id = ?1", params![message_id])?;
    // Earlier edit events carried the content too: keep them as events,
    // without the content (`content::Edited::recalled`).
    let edits: Vec<(String, String)> = {
        let mut stmt = c
            .prepare_cached(
                "SELECT message_id, content FROM messages WHERE conv_id = ?1 AND target_id = ?2 AND kind = ?3",
            )
            .map_err(internal)?;
        let rows = stmt
            .query_map(params![cmd.conv, message_id, KIND_EDIT], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(internal)?;
        rows.collect::<Result<_, _>>().map_err(internal)?
    };
    for (edit_id, stored) in edits {
        let wiped =
            content::Edited::recalled(&stored).map_err(|e| StoreError::Internal(format!("edit {edit_id}: {e}")))?;
        exec(c, "UPDATE messages SET content = ?2 WHERE message_id = ?1", params![edit_id, wiped])?;
    }
    Ok(ControlOutcome { msg_seq: seq, version, changed: true })
}

pub(crate) fn edit(
    c: &Connection,
    cmd: &ConvEventCmd,
    message_id: &str,
    content: &str,
    base_version: u64,
) -> R<ControlOutcome> {
    let planned = decide_control(c, cmd, message_id, KIND_EDIT, None, |t| {
        control::decide_edit(t, &cmd.actor, message_id, base_version)
    })?;
    let (t, version) = match planned {
        Ok(write) => write,
        Err(done) => return Ok(done),
    };
    let event = content::Edited::new(message_id, t.msg_seq, version, content)
        .map_err(|e| StoreError::Invalid(e.to_string()))?
        .to_json();
    let seq = append_conv_event(c, cmd, KIND_EDIT, &event, Some(message_id), None, STATE_NORMAL)?;
    exec(
        c,
        "UPDATE messages SET content = ?2, state = ?3, version = ?4 WHERE message_id = ?1",
        params![message_id, content, STATE_EDITED, version as i64],
    )?;
    Ok(ControlOutcome { msg_seq: seq, version, changed: true })
}

pub(crate) fn react(
    c: &Connection,
    cmd: &ConvEventCmd,
    message_id: &str,
    reaction: &str,
    add: bool,
) -> R<ControlOutcome> {
    let planned = decide_control(c, cmd, message_id, KIND_REACTION, Some(reaction), |t| {
        control::decide_react(t, message_id, add)
    })?;
    let (t, version) = match planned {
        Ok(write) => write,
        Err(done) => return Ok(done),
    };
    let event = content::Reacted::new(message_id, t.msg_seq, reaction, add, &cmd.actor, version).to_json();
    let seq = append_conv_event(c, cmd, KIND_REACTION, &event, Some(message_id), None, STATE_NORMAL)?;
    if add {
        exec(
            c,
            "INSERT INTO reactions (message_id, user_id, reaction, event_seq) VALUES (?1, ?2, ?3, ?4)",
            params![message_id, cmd.actor, reaction, seq as i64],
        )?;
    } else {
        exec(
            c,
            "DELETE FROM reactions WHERE message_id = ?1 AND user_id = ?2 AND reaction = ?3",
            params![message_id, cmd.actor, reaction],
        )?;
    }
    exec(c, "UPDATE messages SET version = ?2 WHERE message_id = ?1", params![message_id, version as i64])?;
    Ok(ControlOutcome { msg_seq: seq, version, changed: true })
}

// ------------------------------------------------------- per-user events

/// Appends a per-user event to `user`'s log, idempotent on its source id.
#[allow(clippy::too_many_arguments)]
pub(crate) fn append_user_event(
    c: &Connection,
    user: &str,
    kind: &str,
    conv: &str,
    msg_seq: Option<u64>,
    source_event_id: &str,
    data: &str,
    now_ms: i64,
) -> R<Option<u64>> {
    let seen: Option<i64> = q(
        c,
        "SELECT sync_seq FROM user_events WHERE user_id = ?1 AND source_event_id = ?2 AND period_id = ?3",
        params![user, source_event_id, USER_SCOPE_PERIOD],
    )?;
    if seen.is_some() {
        return Ok(None);
    }
    let seq: i64 = q(
        c,
        "INSERT INTO user_heads (user_id, high_watermark) VALUES (?1, 1)
         ON CONFLICT(user_id) DO UPDATE SET high_watermark = high_watermark + 1 RETURNING high_watermark",
        params![user],
    )?
    .expect("RETURNING yields a row");
    exec(
        c,
        "INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id, data, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, NULL, ?6, ?7, ?8, ?9)",
        params![user, seq, kind, conv, msg_seq.map(|v| v as i64), source_event_id, USER_SCOPE_PERIOD, data, now_ms],
    )?;
    Ok(Some(seq as u64))
}

/// Unread from the facts (R3): user messages of the conversation above the
/// read cursor and at or below what fan-out delivered to the user
/// (`last_msg_seq`; fan-out runs in commit order), inside the user's
/// periods, from others, neither recalled nor deleted for the user. Only
/// conversation facts count, never the user log, which retention trims; so
/// a message racing a clear is counted once, by whichever comes second.
pub(crate) const COUNT_UNREAD: &str = "SELECT COUNT(*) FROM messages m JOIN user_convs uc
       ON uc.user_id = ?1 AND uc.conv_id = m.conv_id
     WHERE m.conv_id = ?2 AND m.msg_seq > ?3 AND m.msg_seq <= uc.last_msg_seq
       AND m.sender != ?1 AND m.state != 'recalled'
       AND m.kind NOT IN ('conv.created', 'member.join', 'member.leave', 'recall', 'edit', 'reaction')
       AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = ?1
                   AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))
       AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = ?1 AND d.message_id = m.message_id)";

/// A message mentions user `?1` (issue 18): by name or everyone. Who it
/// counts for beyond that (never the sender, only inside a period, only
/// while unread) is [`COUNT_UNREAD`]'s, as `mention::counts` says.
pub(crate) const MENTIONED: &str =
    "(m.mention_all = 1 OR EXISTS (SELECT 1 FROM json_each(m.mentions) j WHERE j.value = ?1))";

/// Mentions from the facts (issue 18): the unread messages of
/// [`COUNT_UNREAD`] that mention the user.
pub(crate) static COUNT_MENTIONS: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{COUNT_UNREAD} AND {MENTIONED}"));

pub(crate) fn count_unread(c: &Connection, user: &str, conv: &str, read_seq: u64) -> R<u64> {
    let n: i64 = q(c, COUNT_UNREAD, params![user, conv, read_seq as i64])?.unwrap_or(0);
    Ok(n as u64)
}

pub(crate) fn count_mentions(c: &Connection, user: &str, conv: &str, read_seq: u64) -> R<u64> {
    let n: i64 = q(c, &COUNT_MENTIONS, params![user, conv, read_seq as i64])?.unwrap_or(0);
    Ok(n as u64)
}

/// Recounts a row's unread and mentions from the facts (R3); `(unread,
/// mentions)` after it.
fn recount(c: &Connection, user: &str, conv: &str) -> R<(u64, u64)> {
    let read_seq: i64 =
        q(c, "SELECT read_seq FROM user_convs WHERE user_id = ?1 AND conv_id = ?2", params![user, conv])?.unwrap_or(0);
    let unread = count_unread(c, user, conv, read_seq as u64)?;
    let mentions = count_mentions(c, user, conv, read_seq as u64)?;
    exec(
        c,
        "UPDATE user_convs SET unread = ?3, mentions = ?4 WHERE user_id = ?1 AND conv_id = ?2",
        params![user, conv, unread as i64, mentions as i64],
    )?;
    Ok((unread, mentions))
}

pub(crate) fn recount_unread(c: &Connection, user: &str, conv: &str) -> R<(u64, u64)> {
    recount(c, user, conv)
}

pub(crate) fn mark_read(
    c: &Connection,
    user: &str,
    conv: &str,
    read_to_seq: u64,
    on: Option<(&str, u64)>,
    now_ms: i64,
) -> R<ReadOutcome> {
    // The device's newest connection is read by the same statement (P2).
    let (device, epoch) = (on.map_or("", |(d, _)| d), on.map(|(_, e)| e));
    let row: Option<(i64, i64, i64)> = c
        .prepare_cached(
            "SELECT uc.read_seq, c.head,
                    COALESCE((SELECT d.connection_epoch FROM devices d WHERE d.user_id = ?1 AND d.device_id = ?3), 0)
             FROM user_convs uc JOIN conversations c ON c.conv_id = uc.conv_id
             WHERE uc.user_id = ?1 AND uc.conv_id = ?2",
        )
        .map_err(internal)?
        .query_row(params![user, conv, device], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()
        .map_err(internal)?;
    if let Some((_, _, newest)) = row {
        if tidemark_core::session::frame_superseded(epoch, newest.max(0) as u64) {
            return Err(StoreError::Superseded(newest.max(0) as u64));
        }
    } else if let Some(epoch) = epoch {
        connection_fence(c, user, device, Some(epoch))?;
    }
    let Some((read_seq, head, _)) = row else { return Err(not_found_or_not_member(c, conv)?) };
    let Some(target) = projection::read_target(read_to_seq, head as u64, read_seq as u64) else {
        let (unread, mentions) = crate::read::conv_rows(c, user, None, crate::read::Rows::One(conv))?
            .pop()
            .map_or((0, 0), |s| (s.unread, s.mentions));
        return Ok(ReadOutcome { read_seq: read_seq as u64, unread, mentions, written: None });
    };
    exec(
        c,
        "UPDATE user_convs SET read_seq = ?3 WHERE user_id = ?1 AND conv_id = ?2",
        params![user, conv, target as i64],
    )?;
    // Mentions clear with unread, only up to the new read cursor: the
    // recount keeps those above it (issue 18).
    let (mut unread, mut mentions) = recount(c, user, conv)?;
    // A shared group's unread above the switch is counted from the log.
    if let Some(state) = crate::read::conv_rows(c, user, None, crate::read::Rows::One(conv))?.pop() {
        if state.mode == large::MODE_SHARED {
            (unread, mentions) = (state.unread, state.mentions);
        }
    }
    let data = content::ReadData { read_seq: target, unread }.to_json();
    let source = projection::read_event_id(conv, target);
    let written = append_user_event(c, user, EVENT_READ, conv, Some(target), &source, &data, now_ms)?;
    Ok(ReadOutcome { read_seq: target, unread, mentions, written })
}

/// The epoch fence of a frame (P2, `tidemark_core::session::frame_superseded`)
/// where no statement of the request reads the device row already: one
/// indexed read, only for a frame of a WebSocket connection.
pub(crate) fn connection_fence(c: &Connection, user: &str, device: &str, epoch: Option<u64>) -> R<()> {
    if epoch.is_none() {
        return Ok(());
    }
    let newest: i64 = c
        .prepare_cached("SELECT connection_epoch FROM devices WHERE user_id = ?1 AND device_id = ?2")
        .map_err(internal)?
        .query_row(params![user, device], |r| r.get(0))
        .optional()
        .map_err(internal)?
        .unwrap_or(0);
    let newest = newest.max(0) as u64;
    if tidemark_core::session::frame_superseded(epoch, newest) {
        return Err(StoreError::Superseded(newest));
    }
    Ok(())
}

pub(crate) fn update_settings(
    c: &Connection,
    user: &str,
    conv: &str,
    update: projection::SettingsUpdate,
    now_ms: i64,
) -> R<Option<u64>> {
    let row: Option<Settings> = c
        .prepare_cached(
            "SELECT muted, pinned, push_preview, settings_version FROM user_convs WHERE user_id = ?1 AND conv_id = ?2",
        )
        .map_err(internal)?
        .query_row(params![user, conv], |r| {
            Ok(Settings {
                muted: r.get(0)?,
                pinned: r.get(1)?,
                push_preview: crate::push::preview_col(r, 2)?,
                version: r.get::<_, i64>(3)? as u64,
            })
        })
        .optional()
        .map_err(internal)?;
    let Some(now) = row else { return Err(not_found_or_not_member(c, conv)?) };
    let Some(next) = projection::settings_after(now, update) else {
        return Ok(None);
    };
    exec(
        c,
        "UPDATE user_convs SET muted = ?3, pinned = ?4, push_preview = ?5, settings_version = ?6
         WHERE user_id = ?1 AND conv_id = ?2",
        params![user, conv, next.muted, next.pinned, next.push_preview.as_str(), next.version as i64],
    )?;
    let data = content::SettingsData {
        muted: next.muted,
        pinned: next.pinned,
        push_preview: next.push_preview.into(),
        version: next.version,
    }
    .to_json();
    let source = projection::settings_event_id(conv, next.version);
    append_user_event(c, user, EVENT_SETTINGS, conv, None, &source, &data, now_ms)
}

pub(crate) fn delete_for_me(c: &Connection, user: &str, conv: &str, message_id: &str, now_ms: i64) -> R<Option<u64>> {
    let msg_seq = control::decide_delete_for_me(load_target(c, conv, message_id, user, None)?.as_ref(), message_id)?;
    let n =
        exec(c, "INSERT OR IGNORE INTO user_deleted (user_id, message_id) VALUES (?1, ?2)", params![user, message_id])?;
    if n == 1 {
        recount(c, user, conv)?;
    }
    let data = content::DeletedData { message_id, msg_seq }.to_json();
    append_user_event(
        c,
        user,
        EVENT_DELETE,
        conv,
        Some(msg_seq),
        &projection::delete_event_id(message_id),
        &data,
        now_ms,
    )
}

pub(crate) fn record_delivery(c: &Connection, user: &str, device: &str, ids: &[String], now_ms: i64) -> R<u64> {
    projection::check_delivery_ids(ids.len())?;
    // Only messages fan-out delivered to the user count: inside the user's
    // periods and at or below its last_msg_seq (conversation facts, not the
    // user log, which retention trims).
    let delivered: Vec<String> = {
        let list: Array = Rc::new(ids.iter().cloned().map(Value::from).collect());
        let mut stmt = c
            .prepare_cached(
                "SELECT m.message_id FROM messages m JOIN user_convs uc ON uc.user_id = ?1 AND uc.conv_id = m.conv_id
                 WHERE m.message_id IN rarray(?2) AND m.msg_seq <= uc.last_msg_seq
                   AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = ?1
                               AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))",
            )
            .map_err(internal)?;
        let rows = stmt.query_map(params![user, list], |r| r.get(0)).map_err(internal)?;
        rows.collect::<Result<_, _>>().map_err(internal)?
    };
    projection::check_delivered(ids, &delivered)?;
    let mut added = 0;
    for id in ids {
        added += exec(
            c,
            "INSERT OR IGNORE INTO deliveries (message_id, user_id, device_id, delivered_at) VALUES (?1, ?2, ?3, ?4)",
            params![id, user, device, now_ms],
        )? as u64;
    }
    Ok(added)
}

/// Why `conv` has nothing for its caller (`control::not_member`).
pub(crate) fn not_found_or_not_member(c: &Connection, conv: &str) -> R<StoreError> {
    let exists: Option<i64> = q(c, "SELECT 1 FROM conversations WHERE conv_id = ?1", params![conv])?;
    Ok(control::not_member(conv, exists.is_some()).into())
}

/// `dirty.clear` (G2): loads the marker's facts for the device, lets
/// `large::decide_clear` decide, and records a clear.
pub(crate) fn clear_marker(
    c: &Connection,
    user: &str,
    device: &str,
    conv: &str,
    observed_version: u64,
    last_msg_seq: u64,
) -> R<(bool, Marker)> {
    type Row = (String, i64, i64, bool, Option<i64>, i64);
    let row: Option<Row> = c
        .prepare_cached(
            "SELECT c.mode, COALESCE(mk.target, 0), COALESCE(mk.version, 0),
                    EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = c.conv_id AND p.user_id = ?2
                            AND p.leave_seq IS NULL),
                    (SELECT MAX(p.leave_seq) FROM membership_periods p WHERE p.conv_id = c.conv_id AND p.user_id = ?2),
                    COALESCE((SELECT dm.cleared_seq FROM device_markers dm WHERE dm.user_id = ?2 AND dm.device_id = ?3
                              AND dm.conv_id = c.conv_id), 0)
             FROM conversations c LEFT JOIN conv_markers mk ON mk.conv_id = c.conv_id WHERE c.conv_id = ?1",
        )
        .map_err(internal)?
        .query_row(params![conv, user, device], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
        })
        .optional()
        .map_err(internal)?;
    let Some((mode, target, version, active, last_leave, cleared)) = row else {
        return Err(StoreError::NotFound(format!("conversation {conv}")));
    };
    if !active && last_leave.is_none() {
        return Err(StoreError::NotMember);
    }
    if mode != large::MODE_SHARED {
        return Err(StoreError::Invalid(format!("conversation {conv} is not in shared mode")));
    }
    let facts = MarkerFacts {
        published_target: target as u64,
        version: version as u64,
        left_at: if active { None } else { last_leave.map(|v| v as u64) },
        cleared_seq: cleared as u64,
    };
    match large::decide_clear(&facts, observed_version, last_msg_seq) {
        ClearDecision::Stale => Ok((false, large::marker(&facts))),
        ClearDecision::Cleared { cleared_seq } => {
            exec(
                c,
                "INSERT INTO device_markers (user_id, device_id, conv_id, cleared_seq, cleared_version)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT(user_id, device_id, conv_id) DO UPDATE SET
                    cleared_seq = MAX(cleared_seq, excluded.cleared_seq), cleared_version = excluded.cleared_version",
                params![user, device, conv, cleared_seq as i64, observed_version as i64],
            )?;
            Ok((true, large::marker(&MarkerFacts { cleared_seq, ..facts })))
        }
    }
}
