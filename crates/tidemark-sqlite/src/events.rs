//! Writer-side transactions for conversation events (membership, recall,
//! edit, reaction) and per-user events (read, settings, delete-for-me).
//! Each function runs inside the writer's open transaction and savepoint;
//! an `Err` rolls back everything it wrote.

use rusqlite::{params, Connection, OptionalExtension};
use tidemark_store::*;

use crate::internal;

/// Most members a group may have (the fan-out is per member).
pub const GROUP_MEMBERS_MAX: usize = 1000;
/// Most message ids in one `delivery.ack`.
pub const DELIVERY_IDS_MAX: usize = 500;

type R<T> = StoreResult<T>;

fn q<T: rusqlite::types::FromSql>(c: &Connection, sql: &str, p: impl rusqlite::Params) -> R<Option<T>> {
    c.prepare_cached(sql).map_err(internal)?.query_row(p, |r| r.get(0)).optional().map_err(internal)
}

fn exec(c: &Connection, sql: &str, p: impl rusqlite::Params) -> R<usize> {
    c.prepare_cached(sql).map_err(internal)?.execute(p).map_err(internal)
}

/// The earlier event with this idempotency key, if any: its id, conv,
/// msg_seq and time. An idempotency key names one operation: reusing it in
/// another conversation or for another kind of event is refused. `kinds`
/// empty means "a user message".
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
            let same_kind = if kinds.is_empty() { !is_control_kind(&kind) } else { kinds.contains(&kind.as_str()) };
            if event_conv != conv || !same_kind {
                return Err(StoreError::Invalid(format!(
                    "client_msg_id {client_msg_id} was already used for another operation"
                )));
            }
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

/// The user's periods in a conversation cover `seq`.
pub(crate) fn sees(c: &Connection, conv: &str, user: &str, seq: u64) -> R<bool> {
    Ok(q::<i64>(
        c,
        "SELECT period_id FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2
         AND join_seq <= ?3 AND (leave_seq IS NULL OR leave_seq >= ?3) LIMIT 1",
        params![conv, user, seq as i64],
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

fn json_str(s: &str) -> String {
    // Identifiers are validated ASCII without quotes or backslashes, but
    // escape anyway: this string lands inside stored JSON.
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn user_exists(c: &Connection, user: &str) -> R<bool> {
    Ok(q::<i64>(c, "SELECT 1 FROM users WHERE user_id = ?1", params![user])?.is_some())
}

pub(crate) fn create_group(c: &Connection, cmd: &ConvEventCmd, members: &[String]) -> R<(String, u64)> {
    // A retried create finds the group its first attempt made.
    let earlier: Option<(String, String)> = c
        .prepare_cached("SELECT conv_id, kind FROM messages WHERE sender = ?1 AND client_msg_id = ?2")
        .map_err(internal)?
        .query_row(params![cmd.actor, cmd.client_msg_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .map_err(internal)?;
    match earlier {
        Some((conv, kind)) if kind == KIND_CREATED => return Ok((conv, 1)),
        Some(_) => return Err(StoreError::Invalid(format!("client_msg_id {} was already used", cmd.client_msg_id))),
        None => {}
    }
    let mut all: Vec<String> = members.to_vec();
    all.push(cmd.actor.clone());
    all.sort();
    all.dedup();
    if all.len() > GROUP_MEMBERS_MAX {
        return Err(StoreError::Invalid(format!("a group has at most {GROUP_MEMBERS_MAX} members")));
    }
    for u in &all {
        if !user_exists(c, u)? {
            return Err(StoreError::NotFound(format!("user {u}")));
        }
    }
    exec(
        c,
        "INSERT INTO conversations (conv_id, kind, direct_key, head, epoch, owner, created_at) VALUES (?1, ?2, NULL, 0, 1, ?3, ?4)",
        params![cmd.conv, CONV_GROUP, cmd.actor, cmd.now_ms],
    )?;
    let list = all.iter().map(|u| json_str(u)).collect::<Vec<_>>().join(",");
    let content = format!("{{\"owner\":{},\"members\":[{list}]}}", json_str(&cmd.actor));
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
    Ok((cmd.conv.clone(), seq))
}

fn conv_kind_owner(c: &Connection, conv: &str) -> R<(String, Option<String>)> {
    c.prepare_cached("SELECT kind, owner FROM conversations WHERE conv_id = ?1")
        .map_err(internal)?
        .query_row(params![conv], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .map_err(internal)?
        .ok_or_else(|| StoreError::NotFound(format!("conversation {conv}")))
}

pub(crate) fn change_membership(c: &Connection, cmd: &ConvEventCmd, target: &str, change: MembershipChange) -> R<u64> {
    if let Some((_, _, seq, _)) =
        existing_event_of(c, &cmd.actor, &cmd.client_msg_id, &cmd.conv, &[KIND_JOIN, KIND_LEAVE])?
    {
        return Ok(seq);
    }
    let (kind, owner) = conv_kind_owner(c, &cmd.conv)?;
    if kind != CONV_GROUP {
        return Err(StoreError::Invalid("a direct conversation has fixed members".into()));
    }
    if !is_active_member(c, &cmd.conv, &cmd.actor)? {
        return Err(StoreError::NotMember);
    }
    let target_active = is_active_member(c, &cmd.conv, target)?;
    let (event_kind, verb) = match change {
        MembershipChange::Add => {
            if !user_exists(c, target)? {
                return Err(StoreError::NotFound(format!("user {target}")));
            }
            if target_active {
                // Already a member: nothing to do; the open period's join.
                let join: i64 = q(
                    c,
                    "SELECT join_seq FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2 AND leave_seq IS NULL",
                    params![cmd.conv, target],
                )?
                .expect("an active member has an open period");
                return Ok(join as u64);
            }
            let members: i64 = q(
                c,
                "SELECT COUNT(*) FROM membership_periods WHERE conv_id = ?1 AND leave_seq IS NULL",
                params![cmd.conv],
            )?
            .unwrap_or(0);
            if members as usize >= GROUP_MEMBERS_MAX {
                return Err(StoreError::Invalid(format!("a group has at most {GROUP_MEMBERS_MAX} members")));
            }
            (KIND_JOIN, "add")
        }
        MembershipChange::Remove | MembershipChange::Leave => {
            if change == MembershipChange::Leave && target != cmd.actor {
                return Err(StoreError::Invalid("leave applies to the caller".into()));
            }
            if change == MembershipChange::Remove && owner.as_deref() != Some(cmd.actor.as_str()) {
                return Err(StoreError::Forbidden("only the group owner removes members".into()));
            }
            if !target_active {
                return Err(StoreError::NotFound(format!("{target} is not a member")));
            }
            (KIND_LEAVE, if change == MembershipChange::Leave { "leave" } else { "remove" })
        }
    };
    let content = format!("{{\"user\":{},\"by\":{},\"op\":\"{verb}\"}}", json_str(target), json_str(&cmd.actor));
    let seq = append_conv_event(c, cmd, event_kind, &content, None, None, STATE_NORMAL)?;
    if event_kind == KIND_JOIN {
        // A new period per join: the old ones keep their own range (G1).
        exec(
            c,
            "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES (?1, ?2, ?3, NULL)",
            params![cmd.conv, target, seq as i64],
        )?;
        exec(
            c,
            "INSERT INTO user_convs (user_id, conv_id) VALUES (?1, ?2) ON CONFLICT(user_id, conv_id) DO UPDATE SET active = 1",
            params![target, cmd.conv],
        )?;
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
    }
    Ok(seq)
}

struct Target {
    conv: String,
    msg_seq: u64,
    sender: String,
    kind: String,
    state: String,
    version: u64,
    recall_seq: Option<u64>,
}

fn load_target(c: &Connection, conv: &str, message_id: &str) -> R<Target> {
    let t = c
        .prepare_cached(
            "SELECT conv_id, msg_seq, sender, kind, state, version, recall_seq FROM messages WHERE message_id = ?1",
        )
        .map_err(internal)?
        .query_row(params![message_id], |r| {
            Ok(Target {
                conv: r.get(0)?,
                msg_seq: r.get::<_, i64>(1)? as u64,
                sender: r.get(2)?,
                kind: r.get(3)?,
                state: r.get(4)?,
                version: r.get::<_, i64>(5)? as u64,
                recall_seq: r.get::<_, Option<i64>>(6)?.map(|v| v as u64),
            })
        })
        .optional()
        .map_err(internal)?;
    match t {
        Some(t) if t.conv == conv && !is_control_kind(&t.kind) => Ok(t),
        _ => Err(StoreError::NotFound(format!("message {message_id}"))),
    }
}

fn retry_outcome(c: &Connection, cmd: &ConvEventCmd, message_id: &str, kind: &str) -> R<Option<ControlOutcome>> {
    let Some((_, _, seq, _)) = existing_event_of(c, &cmd.actor, &cmd.client_msg_id, &cmd.conv, &[kind])? else {
        return Ok(None);
    };
    let t = load_target(c, &cmd.conv, message_id)?;
    Ok(Some(ControlOutcome { msg_seq: seq, version: t.version, changed: false }))
}

pub(crate) fn recall(c: &Connection, cmd: &ConvEventCmd, message_id: &str) -> R<ControlOutcome> {
    if let Some(done) = retry_outcome(c, cmd, message_id, KIND_RECALL)? {
        return Ok(done);
    }
    let t = load_target(c, &cmd.conv, message_id)?;
    if t.sender != cmd.actor {
        return Err(StoreError::Forbidden("only the sender recalls a message".into()));
    }
    if !is_active_member(c, &cmd.conv, &cmd.actor)? {
        return Err(StoreError::NotMember);
    }
    if let Some(seq) = t.recall_seq {
        return Ok(ControlOutcome { msg_seq: seq, version: t.version, changed: false });
    }
    let content = format!("{{\"target_message_id\":{},\"target_msg_seq\":{}}}", json_str(message_id), t.msg_seq);
    let seq = append_conv_event(c, cmd, KIND_RECALL, &content, Some(message_id), None, STATE_NORMAL)?;
    // The original content is gone for good: no path can serve it again.
    exec(
        c,
        "UPDATE messages SET state = ?2, content = '{}', version = version + 1, recall_seq = ?3 WHERE message_id = ?1",
        params![message_id, STATE_RECALLED, seq as i64],
    )?;
    exec(c, "DELETE FROM reactions WHERE message_id = ?1", params![message_id])?;
    // Earlier edit events carried the content too: keep them as events,
    // without the content.
    exec(
        c,
        "UPDATE messages SET content = json_set(json_remove(content, '$.content'), '$.recalled', json('true'))
         WHERE target_id = ?1 AND kind = ?2",
        params![message_id, KIND_EDIT],
    )?;
    Ok(ControlOutcome { msg_seq: seq, version: t.version + 1, changed: true })
}

pub(crate) fn edit(
    c: &Connection,
    cmd: &ConvEventCmd,
    message_id: &str,
    content: &str,
    base_version: u64,
) -> R<ControlOutcome> {
    if let Some(done) = retry_outcome(c, cmd, message_id, KIND_EDIT)? {
        return Ok(done);
    }
    let t = load_target(c, &cmd.conv, message_id)?;
    if t.sender != cmd.actor {
        return Err(StoreError::Forbidden("only the sender edits a message".into()));
    }
    if !is_active_member(c, &cmd.conv, &cmd.actor)? {
        return Err(StoreError::NotMember);
    }
    if t.state == STATE_RECALLED {
        return Err(StoreError::Invalid("a recalled message cannot be edited".into()));
    }
    if base_version != t.version {
        return Err(StoreError::VersionConflict(t.version));
    }
    let version = t.version + 1;
    let event = format!(
        "{{\"target_message_id\":{},\"target_msg_seq\":{},\"version\":{version},\"content\":{content}}}",
        json_str(message_id),
        t.msg_seq
    );
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
    if let Some(done) = retry_outcome(c, cmd, message_id, KIND_REACTION)? {
        return Ok(done);
    }
    let t = load_target(c, &cmd.conv, message_id)?;
    if !is_active_member(c, &cmd.conv, &cmd.actor)? || !sees(c, &cmd.conv, &cmd.actor, t.msg_seq)? {
        return Err(StoreError::NotMember);
    }
    if t.state == STATE_RECALLED {
        return Err(StoreError::Invalid("a recalled message takes no reactions".into()));
    }
    let current: Option<i64> = q(
        c,
        "SELECT event_seq FROM reactions WHERE message_id = ?1 AND user_id = ?2 AND reaction = ?3",
        params![message_id, cmd.actor, reaction],
    )?;
    if current.is_some() == add {
        // Already in the requested state: idempotent, nothing new.
        return Ok(ControlOutcome { msg_seq: current.unwrap_or(0) as u64, version: t.version, changed: false });
    }
    let version = t.version + 1;
    let event = format!(
        "{{\"target_message_id\":{},\"target_msg_seq\":{},\"reaction\":{},\"op\":\"{}\",\"user\":{},\"version\":{version}}}",
        json_str(message_id),
        t.msg_seq,
        json_str(reaction),
        if add { "add" } else { "remove" },
        json_str(&cmd.actor)
    );
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

pub(crate) fn count_unread(c: &Connection, user: &str, conv: &str, read_seq: u64) -> R<u64> {
    let n: i64 = q(c, COUNT_UNREAD, params![user, conv, read_seq as i64])?.unwrap_or(0);
    Ok(n as u64)
}

fn recount(c: &Connection, user: &str, conv: &str) -> R<u64> {
    let read_seq: i64 =
        q(c, "SELECT read_seq FROM user_convs WHERE user_id = ?1 AND conv_id = ?2", params![user, conv])?.unwrap_or(0);
    let unread = count_unread(c, user, conv, read_seq as u64)?;
    exec(
        c,
        "UPDATE user_convs SET unread = ?3 WHERE user_id = ?1 AND conv_id = ?2",
        params![user, conv, unread as i64],
    )?;
    Ok(unread)
}

pub(crate) fn recount_unread(c: &Connection, user: &str, conv: &str) -> R<u64> {
    recount(c, user, conv)
}

pub(crate) fn mark_read(c: &Connection, user: &str, conv: &str, read_to_seq: u64, now_ms: i64) -> R<ReadOutcome> {
    let row: Option<(i64, i64)> = c
        .prepare_cached(
            "SELECT uc.read_seq, c.head FROM user_convs uc JOIN conversations c ON c.conv_id = uc.conv_id
             WHERE uc.user_id = ?1 AND uc.conv_id = ?2",
        )
        .map_err(internal)?
        .query_row(params![user, conv], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .map_err(internal)?;
    let Some((read_seq, head)) = row else { return Err(not_found_or_not_member(c, conv)?) };
    let target = read_to_seq.min(head as u64);
    if target <= read_seq as u64 {
        let unread: i64 =
            q(c, "SELECT unread FROM user_convs WHERE user_id = ?1 AND conv_id = ?2", params![user, conv])?
                .unwrap_or(0);
        return Ok(ReadOutcome { read_seq: read_seq as u64, unread: unread as u64, written: None });
    }
    exec(
        c,
        "UPDATE user_convs SET read_seq = ?3 WHERE user_id = ?1 AND conv_id = ?2",
        params![user, conv, target as i64],
    )?;
    let unread = recount(c, user, conv)?;
    let data = format!("{{\"read_seq\":{target},\"unread\":{unread}}}");
    let written =
        append_user_event(c, user, EVENT_READ, conv, Some(target), &format!("read:{conv}:{target}"), &data, now_ms)?;
    Ok(ReadOutcome { read_seq: target, unread, written })
}

pub(crate) fn update_settings(
    c: &Connection,
    user: &str,
    conv: &str,
    muted: Option<bool>,
    pinned: Option<bool>,
    now_ms: i64,
) -> R<(bool, bool, u64, Option<u64>)> {
    let row: Option<(bool, bool, i64)> = c
        .prepare_cached("SELECT muted, pinned, settings_version FROM user_convs WHERE user_id = ?1 AND conv_id = ?2")
        .map_err(internal)?
        .query_row(params![user, conv], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()
        .map_err(internal)?;
    let Some((m0, p0, v0)) = row else { return Err(not_found_or_not_member(c, conv)?) };
    let (m1, p1) = (muted.unwrap_or(m0), pinned.unwrap_or(p0));
    if (m1, p1) == (m0, p0) {
        return Ok((m0, p0, v0 as u64, None));
    }
    let v1 = v0 + 1;
    exec(
        c,
        "UPDATE user_convs SET muted = ?3, pinned = ?4, settings_version = ?5 WHERE user_id = ?1 AND conv_id = ?2",
        params![user, conv, m1, p1, v1],
    )?;
    let data = format!("{{\"muted\":{m1},\"pinned\":{p1},\"version\":{v1}}}");
    let written =
        append_user_event(c, user, EVENT_SETTINGS, conv, None, &format!("settings:{conv}:{v1}"), &data, now_ms)?;
    Ok((m1, p1, v1 as u64, written))
}

pub(crate) fn delete_for_me(c: &Connection, user: &str, conv: &str, message_id: &str, now_ms: i64) -> R<Option<u64>> {
    let t = load_target(c, conv, message_id)?;
    if !sees(c, conv, user, t.msg_seq)? {
        return Err(StoreError::NotFound(format!("message {message_id}")));
    }
    let n =
        exec(c, "INSERT OR IGNORE INTO user_deleted (user_id, message_id) VALUES (?1, ?2)", params![user, message_id])?;
    if n == 1 {
        recount(c, user, conv)?;
    }
    let data = format!("{{\"message_id\":{},\"msg_seq\":{}}}", json_str(message_id), t.msg_seq);
    append_user_event(c, user, EVENT_DELETE, conv, Some(t.msg_seq), &format!("delete:{message_id}"), &data, now_ms)
}

pub(crate) fn record_delivery(c: &Connection, user: &str, device: &str, ids: &[String], now_ms: i64) -> R<u64> {
    if ids.len() > DELIVERY_IDS_MAX {
        return Err(StoreError::Invalid(format!("at most {DELIVERY_IDS_MAX} message ids")));
    }
    let mut added = 0;
    for id in ids {
        // Only messages fan-out delivered to the user count: inside the
        // user's periods and at or below its last_msg_seq (conversation
        // facts, not the user log, which retention trims).
        let delivered: Option<i64> = q(
            c,
            "SELECT 1 FROM messages m JOIN user_convs uc ON uc.user_id = ?1 AND uc.conv_id = m.conv_id
             WHERE m.message_id = ?2 AND m.msg_seq <= uc.last_msg_seq
               AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = ?1
                           AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))",
            params![user, id],
        )?;
        if delivered.is_none() {
            return Err(StoreError::NotFound(format!("message {id}")));
        }
        added += exec(
            c,
            "INSERT OR IGNORE INTO deliveries (message_id, user_id, device_id, delivered_at) VALUES (?1, ?2, ?3, ?4)",
            params![id, user, device, now_ms],
        )? as u64;
    }
    Ok(added)
}

pub(crate) fn rebuild_unread(c: &Connection) -> R<UnreadRebuild> {
    let rows: Vec<(String, String, i64, i64)> = {
        let mut stmt = c.prepare("SELECT user_id, conv_id, read_seq, unread FROM user_convs").map_err(internal)?;
        let it = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))).map_err(internal)?;
        it.collect::<Result<_, _>>().map_err(internal)?
    };
    let mut report = UnreadRebuild::default();
    for (user, conv, read_seq, unread) in rows {
        report.rows_checked += 1;
        let fact = count_unread(c, &user, &conv, read_seq as u64)?;
        if fact != unread as u64 {
            report.drifted += 1;
            tracing::warn!(user = %user, conv = %conv, stored = unread, fact, "unread drift repaired");
            exec(
                c,
                "UPDATE user_convs SET unread = ?3 WHERE user_id = ?1 AND conv_id = ?2",
                params![user, conv, fact as i64],
            )?;
        }
    }
    Ok(report)
}

fn not_found_or_not_member(c: &Connection, conv: &str) -> R<StoreError> {
    let exists: Option<i64> = q(c, "SELECT 1 FROM conversations WHERE conv_id = ?1", params![conv])?;
    Ok(match exists {
        None => StoreError::NotFound(format!("conversation {conv}")),
        Some(_) => StoreError::NotMember,
    })
}
