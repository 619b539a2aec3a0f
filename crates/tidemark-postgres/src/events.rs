//! Writer-side transactions for conversation events (send, group creation,
//! membership, recall, edit, reaction) and per-user events (read, settings,
//! delete-for-me, delivery, unread rebuild).
//!
//! Each function runs inside the writer's open transaction and savepoint;
//! an `Err` rolls back everything it wrote. The checks and their order are
//! the SQLite backend's, so the same situation gives the same error.
//!
//! Locks (see the crate docs for the full order): a conversation event
//! locks its conversation row before it checks rights or state, so the
//! checks see every change committed before it, from any writer; a per-user
//! event locks the user's head row before touching the user's other rows.
//! This module knows no pool, no queue and no read path.

use tidemark_store::*;

use crate::db::{self, big, col, exec, query, query_opt, scalar, seq, seq_opt, Conn};

/// Most members a group may have (the fan-out is per member).
pub const GROUP_MEMBERS_MAX: usize = 1000;
/// Most message ids in one `delivery.ack`.
pub const DELIVERY_IDS_MAX: usize = 500;

type R<T> = StoreResult<T>;

/// The earlier event with this idempotency key, if any: `(message_id,
/// conv, msg_seq, created_at_ms)`. An idempotency key names one operation:
/// reusing it in another conversation or for another kind of event is
/// refused (`Invalid`). `kinds` empty means "a user message".
pub(crate) async fn existing_event_of(
    c: &Conn,
    sender: &str,
    client_msg_id: &str,
    conv: &str,
    kinds: &[&str],
) -> R<Option<(String, String, u64, i64)>> {
    let row = query_opt(
        c,
        "SELECT message_id, conv_id, msg_seq, created_at, kind FROM messages WHERE sender = $1 AND client_msg_id = $2",
        &[&sender, &client_msg_id],
    )
    .await?;
    let Some(r) = row else { return Ok(None) };
    let (event_conv, kind): (String, String) = (col(&r, 1)?, col(&r, 4)?);
    let same_kind = if kinds.is_empty() { !is_control_kind(&kind) } else { kinds.contains(&kind.as_str()) };
    if event_conv != conv || !same_kind {
        return Err(StoreError::Invalid(format!(
            "client_msg_id {client_msg_id} was already used for another operation"
        )));
    }
    Ok(Some((col(&r, 0)?, event_conv, seq(&r, 2)?, col(&r, 3)?)))
}

pub(crate) async fn is_active_member(c: &Conn, conv: &str, user: &str) -> R<bool> {
    Ok(scalar::<i64>(
        c,
        "SELECT period_id FROM membership_periods WHERE conv_id = $1 AND user_id = $2 AND leave_seq IS NULL LIMIT 1",
        &[&conv, &user],
    )
    .await?
    .is_some())
}

/// The user's periods in a conversation cover `seq`.
pub(crate) async fn sees(c: &Conn, conv: &str, user: &str, at: u64) -> R<bool> {
    Ok(scalar::<i64>(
        c,
        "SELECT period_id FROM membership_periods WHERE conv_id = $1 AND user_id = $2
         AND join_seq <= $3 AND (leave_seq IS NULL OR leave_seq >= $3) LIMIT 1",
        &[&conv, &user, &big(at)],
    )
    .await?
    .is_some())
}

/// Locks the conversation row until COMMIT: the linearisation point of
/// every conversation event. Returns `(kind, owner)`, or `None` if there is
/// no such conversation.
pub(crate) async fn lock_conversation(c: &Conn, conv: &str) -> R<Option<(String, Option<String>)>> {
    let row = query_opt(c, "SELECT kind, owner FROM conversations WHERE conv_id = $1 FOR UPDATE", &[&conv]).await?;
    row.map(|r| Ok((col(&r, 0)?, col(&r, 1)?))).transpose()
}

/// Locks the user's head row until COMMIT (creating it at 0 if absent):
/// the first lock of every per-user event, as in fan-out, so per-user
/// writers never take the user's rows in opposite orders.
pub(crate) async fn lock_user(c: &Conn, user: &str) -> R<()> {
    exec(
        c,
        "INSERT INTO user_heads AS h (user_id, high_watermark) VALUES ($1, 0)
         ON CONFLICT (user_id) DO UPDATE SET high_watermark = h.high_watermark",
        &[&user],
    )
    .await?;
    Ok(())
}

/// Takes the conversation's next `msg_seq`: `UPDATE ... head + 1 RETURNING
/// head` takes (or re-takes) the conversation's row lock and holds it until
/// COMMIT, so no other writer assigns `head + 2` before this one is
/// committed or rolled back (S2). `NotFound` if there is no such
/// conversation. An `Err` later in the request rolls the increment back with
/// its savepoint, so a refused event leaves no hole.
async fn next_seq(c: &Conn, conv: &str) -> R<u64> {
    let head: Option<i64> =
        scalar(c, "UPDATE conversations SET head = head + 1 WHERE conv_id = $1 RETURNING head", &[&conv]).await?;
    let Some(at) = head else {
        return Err(StoreError::NotFound(format!("conversation {conv}")));
    };
    u64::try_from(at).map_err(|_| StoreError::Internal(format!("negative head {at}")))
}

/// Inserts the event at `at` and its outbox record, in one statement.
#[allow(clippy::too_many_arguments)]
async fn insert_event(
    c: &Conn,
    cmd: &ConvEventCmd,
    at: u64,
    kind: &str,
    content: &str,
    target_id: Option<&str>,
    quote_id: Option<&str>,
    state: &str,
) -> R<()> {
    // The idempotency key was checked before; a conflict here means another
    // writer committed the same key since. Nothing is written, the request
    // rolls back, and the caller's retry finds that event.
    let written = exec(
        c,
        "WITH m AS (
             INSERT INTO messages (conv_id, msg_seq, message_id, sender, sender_device, client_msg_id, kind, content,
                                   state, version, target_id, quote_id, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 1, $10, $11, $12)
             ON CONFLICT (sender, client_msg_id) DO NOTHING
             RETURNING conv_id, msg_seq, message_id, sender, created_at)
         INSERT INTO outbox (conv_id, kind, source_event_id, msg_seq, actor, created_at)
         SELECT conv_id, $13, message_id, msg_seq, sender, created_at FROM m",
        &[
            &cmd.conv,
            &big(at),
            &cmd.event_id,
            &cmd.actor,
            &cmd.actor_device,
            &cmd.client_msg_id,
            &kind,
            &content,
            &state,
            &target_id,
            &quote_id,
            &cmd.now_ms,
            &event_kind_of(kind),
        ],
    )
    .await?;
    if written != 1 {
        return Err(StoreError::Unavailable(format!(
            "client_msg_id {} was committed concurrently; retry",
            cmd.client_msg_id
        )));
    }
    Ok(())
}

/// A new conversation event: the next contiguous msg_seq, the fact and its
/// outbox record (S2, S3). The caller has checked rights.
pub(crate) async fn append_conv_event(
    c: &Conn,
    cmd: &ConvEventCmd,
    kind: &str,
    content: &str,
    target_id: Option<&str>,
    state: &str,
) -> R<u64> {
    let at = next_seq(c, &cmd.conv).await?;
    insert_event(c, cmd, at, kind, content, target_id, None, state).await?;
    Ok(at)
}

/// Accepts one send (S1–S3): the original on a retry, else the membership
/// check at the conversation's linearisation point and the next `msg_seq`.
pub(crate) async fn accept_send(c: &Conn, cmd: &SendCmd) -> R<Accepted> {
    if let Some((message_id, conv, msg_seq, created_at_ms)) =
        existing_event_of(c, &cmd.sender, &cmd.client_msg_id, &cmd.conv, &[]).await?
    {
        return Ok(Accepted { message_id, conv, msg_seq, created_at_ms, duplicate: true });
    }
    if is_control_kind(&cmd.kind) {
        return Err(StoreError::Invalid(format!("kind {} is reserved for control events", cmd.kind)));
    }
    // The msg_seq is taken first: its row lock orders this send against
    // membership changes from any writer (G1), and the checks below read
    // what was committed before it. A refusal rolls the increment back.
    let msg_seq = next_seq(c, &cmd.conv).await?;
    if !is_active_member(c, &cmd.conv, &cmd.sender).await? {
        return Err(StoreError::NotMember);
    }
    if let Some(quoted) = &cmd.quote_id {
        let row = query_opt(
            c,
            "SELECT msg_seq, kind FROM messages WHERE conv_id = $1 AND message_id = $2",
            &[&cmd.conv, quoted],
        )
        .await?;
        let ok = match row {
            Some(r) => {
                let kind: String = col(&r, 1)?;
                !is_control_kind(&kind) && sees(c, &cmd.conv, &cmd.sender, seq(&r, 0)?).await?
            }
            None => false,
        };
        if !ok {
            return Err(StoreError::Invalid(format!("quoted message {quoted} is not in this conversation")));
        }
    }
    let event = ConvEventCmd {
        conv: cmd.conv.clone(),
        actor: cmd.sender.clone(),
        actor_device: cmd.sender_device.clone(),
        event_id: cmd.message_id.clone(),
        client_msg_id: cmd.client_msg_id.clone(),
        now_ms: cmd.now_ms,
    };
    insert_event(c, &event, msg_seq, &cmd.kind, &cmd.content, None, cmd.quote_id.as_deref(), STATE_NORMAL).await?;
    Ok(Accepted {
        message_id: cmd.message_id.clone(),
        conv: cmd.conv.clone(),
        msg_seq,
        created_at_ms: cmd.now_ms,
        duplicate: false,
    })
}

pub(crate) fn json_str(s: &str) -> String {
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

pub(crate) async fn user_exists(c: &Conn, user: &str) -> R<bool> {
    Ok(scalar::<i32>(c, "SELECT 1 FROM users WHERE user_id = $1", &[&user]).await?.is_some())
}

/// The first of `users` (in the given order) that has no account.
async fn first_unknown_user<'u>(c: &Conn, users: &'u [String]) -> R<Option<&'u String>> {
    let rows = query(c, "SELECT user_id FROM users WHERE user_id = ANY($1)", &[&users]).await?;
    let known = rows.iter().map(|r| col::<String>(r, 0)).collect::<R<std::collections::HashSet<String>>>()?;
    Ok(users.iter().find(|u| !known.contains(*u)))
}

pub(crate) async fn create_group(c: &Conn, cmd: &ConvEventCmd, members: &[String]) -> R<(String, u64)> {
    // A retried create finds the group its first attempt made.
    let earlier = query_opt(
        c,
        "SELECT conv_id, kind FROM messages WHERE sender = $1 AND client_msg_id = $2",
        &[&cmd.actor, &cmd.client_msg_id],
    )
    .await?;
    if let Some(r) = earlier {
        let (conv, kind): (String, String) = (col(&r, 0)?, col(&r, 1)?);
        if kind == KIND_CREATED {
            return Ok((conv, 1));
        }
        return Err(StoreError::Invalid(format!("client_msg_id {} was already used", cmd.client_msg_id)));
    }
    let mut all: Vec<String> = members.to_vec();
    all.push(cmd.actor.clone());
    all.sort();
    all.dedup();
    if all.len() > GROUP_MEMBERS_MAX {
        return Err(StoreError::Invalid(format!("a group has at most {GROUP_MEMBERS_MAX} members")));
    }
    if let Some(u) = first_unknown_user(c, &all).await? {
        return Err(StoreError::NotFound(format!("user {u}")));
    }
    exec(
        c,
        "INSERT INTO conversations (conv_id, kind, direct_key, head, epoch, owner, created_at)
         VALUES ($1, $2, NULL, 0, 1, $3, $4)",
        &[&cmd.conv, &CONV_GROUP, &cmd.actor, &cmd.now_ms],
    )
    .await?;
    let list = all.iter().map(|u| json_str(u)).collect::<Vec<_>>().join(",");
    let content = format!("{{\"owner\":{},\"members\":[{list}]}}", json_str(&cmd.actor));
    let at = append_conv_event(c, cmd, KIND_CREATED, &content, None, STATE_NORMAL).await?;
    exec(
        c,
        "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq)
         SELECT $1, u, $3, NULL FROM unnest($2::text[]) WITH ORDINALITY AS t(u, n) ORDER BY n",
        &[&cmd.conv, &all, &big(at)],
    )
    .await?;
    exec(
        c,
        "INSERT INTO user_convs (user_id, conv_id) SELECT u, $1 FROM unnest($2::text[]) AS t(u) ON CONFLICT DO NOTHING",
        &[&cmd.conv, &all],
    )
    .await?;
    Ok((cmd.conv.clone(), at))
}

pub(crate) async fn change_membership(c: &Conn, cmd: &ConvEventCmd, target: &str, change: MembershipChange) -> R<u64> {
    if let Some((_, _, at, _)) =
        existing_event_of(c, &cmd.actor, &cmd.client_msg_id, &cmd.conv, &[KIND_JOIN, KIND_LEAVE]).await?
    {
        return Ok(at);
    }
    let Some((kind, owner)) = lock_conversation(c, &cmd.conv).await? else {
        return Err(StoreError::NotFound(format!("conversation {}", cmd.conv)));
    };
    if kind != CONV_GROUP {
        return Err(StoreError::Invalid("a direct conversation has fixed members".into()));
    }
    if !is_active_member(c, &cmd.conv, &cmd.actor).await? {
        return Err(StoreError::NotMember);
    }
    let target_active = is_active_member(c, &cmd.conv, target).await?;
    let (event_kind, verb) = match change {
        MembershipChange::Add => {
            if !user_exists(c, target).await? {
                return Err(StoreError::NotFound(format!("user {target}")));
            }
            if target_active {
                // Already a member: nothing to do; the open period's join.
                let join: Option<i64> = scalar(
                    c,
                    "SELECT join_seq FROM membership_periods WHERE conv_id = $1 AND user_id = $2 AND leave_seq IS NULL
                     LIMIT 1",
                    &[&cmd.conv, &target],
                )
                .await?;
                let join = join.ok_or_else(|| StoreError::Internal("an active member has an open period".into()))?;
                return Ok(join as u64);
            }
            let members: i64 = scalar(
                c,
                "SELECT COUNT(*) FROM membership_periods WHERE conv_id = $1 AND leave_seq IS NULL",
                &[&cmd.conv],
            )
            .await?
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
    let at = append_conv_event(c, cmd, event_kind, &content, None, STATE_NORMAL).await?;
    if event_kind == KIND_JOIN {
        // A new period per join: the old ones keep their own range (G1).
        exec(
            c,
            "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES ($1, $2, $3, NULL)",
            &[&cmd.conv, &target, &big(at)],
        )
        .await?;
        exec(
            c,
            "INSERT INTO user_convs (user_id, conv_id) VALUES ($1, $2)
             ON CONFLICT (user_id, conv_id) DO UPDATE SET active = TRUE",
            &[&target, &cmd.conv],
        )
        .await?;
    } else {
        // The leave event is the period's last visible seq: the leaver's
        // devices learn of it; nothing after it is theirs (G1).
        let n = exec(
            c,
            "UPDATE membership_periods SET leave_seq = $3 WHERE conv_id = $1 AND user_id = $2 AND leave_seq IS NULL",
            &[&cmd.conv, &target, &big(at)],
        )
        .await?;
        assert_eq!(n, 1, "exactly one open period per member");
        exec(c, "UPDATE user_convs SET active = FALSE WHERE user_id = $1 AND conv_id = $2", &[&target, &cmd.conv])
            .await?;
    }
    Ok(at)
}

struct Target {
    msg_seq: u64,
    sender: String,
    state: String,
    version: u64,
    recall_seq: Option<u64>,
}

/// A user message of `conv` (never a control event), or `NotFound`.
async fn load_target(c: &Conn, conv: &str, message_id: &str) -> R<Target> {
    let row = query_opt(
        c,
        "SELECT msg_seq, sender, kind, state, version, recall_seq FROM messages WHERE conv_id = $1 AND message_id = $2",
        &[&conv, &message_id],
    )
    .await?;
    if let Some(r) = row {
        let kind: String = col(&r, 2)?;
        if !is_control_kind(&kind) {
            return Ok(Target {
                msg_seq: seq(&r, 0)?,
                sender: col(&r, 1)?,
                state: col(&r, 3)?,
                version: seq(&r, 4)?,
                recall_seq: seq_opt(&r, 5)?,
            });
        }
    }
    Err(StoreError::NotFound(format!("message {message_id}")))
}

async fn retry_outcome(c: &Conn, cmd: &ConvEventCmd, message_id: &str, kind: &str) -> R<Option<ControlOutcome>> {
    let Some((_, _, at, _)) = existing_event_of(c, &cmd.actor, &cmd.client_msg_id, &cmd.conv, &[kind]).await? else {
        return Ok(None);
    };
    let t = load_target(c, &cmd.conv, message_id).await?;
    Ok(Some(ControlOutcome { msg_seq: at, version: t.version, changed: false }))
}

pub(crate) async fn recall(c: &Conn, cmd: &ConvEventCmd, message_id: &str) -> R<ControlOutcome> {
    if let Some(done) = retry_outcome(c, cmd, message_id, KIND_RECALL).await? {
        return Ok(done);
    }
    lock_conversation(c, &cmd.conv).await?;
    let t = load_target(c, &cmd.conv, message_id).await?;
    if t.sender != cmd.actor {
        return Err(StoreError::Forbidden("only the sender recalls a message".into()));
    }
    if !is_active_member(c, &cmd.conv, &cmd.actor).await? {
        return Err(StoreError::NotMember);
    }
    if let Some(at) = t.recall_seq {
        return Ok(ControlOutcome { msg_seq: at, version: t.version, changed: false });
    }
    let content = format!("{{\"target_message_id\":{},\"target_msg_seq\":{}}}", json_str(message_id), t.msg_seq);
    let at = append_conv_event(c, cmd, KIND_RECALL, &content, Some(message_id), STATE_NORMAL).await?;
    // The original content is gone for good: no path can serve it again.
    exec(
        c,
        "UPDATE messages SET state = $3, content = '{}', version = version + 1, recall_seq = $4
         WHERE conv_id = $1 AND message_id = $2",
        &[&cmd.conv, &message_id, &STATE_RECALLED, &big(at)],
    )
    .await?;
    exec(c, "DELETE FROM reactions WHERE conv_id = $1 AND message_id = $2", &[&cmd.conv, &message_id]).await?;
    // Earlier edit events carried the content too: keep them as events,
    // without the content. Their payload is the one `edit` writes, minified
    // with `content` last, so cutting it at `,"content":` and appending
    // `"recalled":true` gives the very text SQLite's
    // `json_set(json_remove(content, '$.content'), '$.recalled', true)` does.
    exec(c, RECALL_EDITS, &[&cmd.conv, &message_id, &KIND_EDIT]).await?;
    Ok(ControlOutcome { msg_seq: at, version: t.version + 1, changed: true })
}

/// Wipes the content of the edit events of a recalled message.
const RECALL_EDITS: &str = "UPDATE messages
     SET content = left(content, strpos(content, ',\"content\":') - 1) || ',\"recalled\":true}'
     WHERE conv_id = $1 AND target_id = $2 AND kind = $3 AND strpos(content, ',\"content\":') > 0";

pub(crate) async fn edit(
    c: &Conn,
    cmd: &ConvEventCmd,
    message_id: &str,
    content: &str,
    base_version: u64,
) -> R<ControlOutcome> {
    if let Some(done) = retry_outcome(c, cmd, message_id, KIND_EDIT).await? {
        return Ok(done);
    }
    lock_conversation(c, &cmd.conv).await?;
    let t = load_target(c, &cmd.conv, message_id).await?;
    if t.sender != cmd.actor {
        return Err(StoreError::Forbidden("only the sender edits a message".into()));
    }
    if !is_active_member(c, &cmd.conv, &cmd.actor).await? {
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
    let at = append_conv_event(c, cmd, KIND_EDIT, &event, Some(message_id), STATE_NORMAL).await?;
    exec(
        c,
        "UPDATE messages SET content = $3, state = $4, version = $5 WHERE conv_id = $1 AND message_id = $2",
        &[&cmd.conv, &message_id, &content, &STATE_EDITED, &big(version)],
    )
    .await?;
    Ok(ControlOutcome { msg_seq: at, version, changed: true })
}

pub(crate) async fn react(
    c: &Conn,
    cmd: &ConvEventCmd,
    message_id: &str,
    reaction: &str,
    add: bool,
) -> R<ControlOutcome> {
    if let Some(done) = retry_outcome(c, cmd, message_id, KIND_REACTION).await? {
        return Ok(done);
    }
    lock_conversation(c, &cmd.conv).await?;
    let t = load_target(c, &cmd.conv, message_id).await?;
    if !is_active_member(c, &cmd.conv, &cmd.actor).await? || !sees(c, &cmd.conv, &cmd.actor, t.msg_seq).await? {
        return Err(StoreError::NotMember);
    }
    if t.state == STATE_RECALLED {
        return Err(StoreError::Invalid("a recalled message takes no reactions".into()));
    }
    let current: Option<i64> = scalar(
        c,
        "SELECT event_seq FROM reactions WHERE conv_id = $1 AND message_id = $2 AND user_id = $3 AND reaction = $4",
        &[&cmd.conv, &message_id, &cmd.actor, &reaction],
    )
    .await?;
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
    let at = append_conv_event(c, cmd, KIND_REACTION, &event, Some(message_id), STATE_NORMAL).await?;
    if add {
        exec(
            c,
            "INSERT INTO reactions (conv_id, message_id, user_id, reaction, event_seq) VALUES ($1, $2, $3, $4, $5)",
            &[&cmd.conv, &message_id, &cmd.actor, &reaction, &big(at)],
        )
        .await?;
    } else {
        exec(
            c,
            "DELETE FROM reactions WHERE conv_id = $1 AND message_id = $2 AND user_id = $3 AND reaction = $4",
            &[&cmd.conv, &message_id, &cmd.actor, &reaction],
        )
        .await?;
    }
    exec(
        c,
        "UPDATE messages SET version = $3 WHERE conv_id = $1 AND message_id = $2",
        &[&cmd.conv, &message_id, &big(version)],
    )
    .await?;
    Ok(ControlOutcome { msg_seq: at, version, changed: true })
}

// ------------------------------------------------------- per-user events

/// Appends a per-user event to `user`'s log, idempotent on its source id.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn append_user_event(
    c: &Conn,
    user: &str,
    kind: &str,
    conv: &str,
    msg_seq: Option<u64>,
    source_event_id: &str,
    data: &str,
    now_ms: i64,
) -> R<Option<u64>> {
    let seen: Option<i64> = scalar(
        c,
        "SELECT sync_seq FROM user_events WHERE user_id = $1 AND source_event_id = $2 AND period_id = $3",
        &[&user, &source_event_id, &USER_SCOPE_PERIOD],
    )
    .await?;
    if seen.is_some() {
        return Ok(None);
    }
    let row = db::query_one(
        c,
        "WITH h AS (
             INSERT INTO user_heads AS h (user_id, high_watermark) VALUES ($1, 1)
             ON CONFLICT (user_id) DO UPDATE SET high_watermark = h.high_watermark + 1
             RETURNING high_watermark)
         INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id,
                                  data, created_at)
         SELECT $1, h.high_watermark, $2, $3, $4, NULL, $5, $6, $7, $8 FROM h
         RETURNING sync_seq",
        &[&user, &kind, &conv, &msg_seq.map(big), &source_event_id, &USER_SCOPE_PERIOD, &data, &now_ms],
    )
    .await?;
    Ok(Some(seq(&row, 0)?))
}

/// Unread from the facts: user-content events in the user's own log above
/// the read cursor, from others, neither recalled nor deleted for the user
/// (R3). Only what fan-out already delivered counts, so a message racing a
/// clear is counted exactly once, by whichever comes second.
/// Unread from the facts (R3): user messages above the read cursor and at
/// or below what fan-out delivered (`last_msg_seq`), inside the user's
/// periods, from others, neither recalled nor deleted for the user. Only
/// conversation facts count, never the user log, which retention trims.
pub(crate) const COUNT_UNREAD: &str = "SELECT COUNT(*) FROM messages m JOIN user_convs uc
       ON uc.user_id = $1 AND uc.conv_id = m.conv_id
     WHERE m.conv_id = $2 AND m.msg_seq > $3 AND m.msg_seq <= uc.last_msg_seq
       AND m.sender <> $1 AND m.state <> 'recalled'
       AND m.kind NOT IN ('conv.created', 'member.join', 'member.leave', 'recall', 'edit', 'reaction')
       AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = $1
                   AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))
       AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = $1 AND d.message_id = m.message_id)";

pub(crate) async fn count_unread(c: &Conn, user: &str, conv: &str, read_seq: u64) -> R<u64> {
    let n: i64 = scalar(c, COUNT_UNREAD, &[&user, &conv, &big(read_seq)]).await?.unwrap_or(0);
    Ok(n as u64)
}

/// Recounts the user's unread in `conv` from the facts and stores it.
pub(crate) async fn recount_unread(c: &Conn, user: &str, conv: &str) -> R<u64> {
    let read_seq: i64 =
        scalar(c, "SELECT read_seq FROM user_convs WHERE user_id = $1 AND conv_id = $2", &[&user, &conv])
            .await?
            .unwrap_or(0);
    let unread = count_unread(c, user, conv, read_seq as u64).await?;
    exec(c, "UPDATE user_convs SET unread = $3 WHERE user_id = $1 AND conv_id = $2", &[&user, &conv, &big(unread)])
        .await?;
    Ok(unread)
}

pub(crate) async fn mark_read(c: &Conn, user: &str, conv: &str, read_to_seq: u64, now_ms: i64) -> R<ReadOutcome> {
    lock_user(c, user).await?;
    let row = query_opt(
        c,
        "SELECT uc.read_seq, c.head, uc.unread FROM user_convs uc JOIN conversations c ON c.conv_id = uc.conv_id
         WHERE uc.user_id = $1 AND uc.conv_id = $2",
        &[&user, &conv],
    )
    .await?;
    let Some(row) = row else { return Err(not_found_or_not_member(c, conv).await?) };
    let (read_seq, head) = (seq(&row, 0)?, seq(&row, 1)?);
    let target = read_to_seq.min(head);
    if target <= read_seq {
        return Ok(ReadOutcome { read_seq, unread: seq(&row, 2)?, written: None });
    }
    exec(c, "UPDATE user_convs SET read_seq = $3 WHERE user_id = $1 AND conv_id = $2", &[&user, &conv, &big(target)])
        .await?;
    let unread = recount_unread(c, user, conv).await?;
    let data = format!("{{\"read_seq\":{target},\"unread\":{unread}}}");
    let written =
        append_user_event(c, user, EVENT_READ, conv, Some(target), &format!("read:{conv}:{target}"), &data, now_ms)
            .await?;
    Ok(ReadOutcome { read_seq: target, unread, written })
}

/// The user's row of `conv` in the conversation list, as `list_conversations`
/// renders it.
pub(crate) async fn conv_state(c: &Conn, user: &str, conv: &str) -> R<Option<ConvState>> {
    let row = query_opt(
        c,
        "SELECT uc.conv_id, c.kind, uc.last_msg_seq, uc.read_seq, uc.unread, uc.muted, uc.pinned, uc.active
         FROM user_convs uc JOIN conversations c ON c.conv_id = uc.conv_id
         WHERE uc.user_id = $1 AND uc.conv_id = $2",
        &[&user, &conv],
    )
    .await?;
    row.map(|r| crate::read::conv_state_at(&r)).transpose()
}

pub(crate) async fn update_settings(
    c: &Conn,
    user: &str,
    conv: &str,
    muted: Option<bool>,
    pinned: Option<bool>,
    now_ms: i64,
) -> R<(ConvState, UserEventOutcome)> {
    lock_user(c, user).await?;
    let row = query_opt(
        c,
        "SELECT muted, pinned, settings_version FROM user_convs WHERE user_id = $1 AND conv_id = $2",
        &[&user, &conv],
    )
    .await?;
    let Some(row) = row else { return Err(not_found_or_not_member(c, conv).await?) };
    let (m0, p0, v0): (bool, bool, i64) = (col(&row, 0)?, col(&row, 1)?, col(&row, 2)?);
    let (m1, p1) = (muted.unwrap_or(m0), pinned.unwrap_or(p0));
    let written = if (m1, p1) == (m0, p0) {
        None
    } else {
        let v1 = v0 + 1;
        exec(
            c,
            "UPDATE user_convs SET muted = $3, pinned = $4, settings_version = $5 WHERE user_id = $1 AND conv_id = $2",
            &[&user, &conv, &m1, &p1, &v1],
        )
        .await?;
        let data = format!("{{\"muted\":{m1},\"pinned\":{p1},\"version\":{v1}}}");
        append_user_event(c, user, EVENT_SETTINGS, conv, None, &format!("settings:{conv}:{v1}"), &data, now_ms).await?
    };
    let state = conv_state(c, user, conv).await?.ok_or(StoreError::NotMember)?;
    Ok((state, UserEventOutcome { written }))
}

pub(crate) async fn delete_for_me(c: &Conn, user: &str, conv: &str, message_id: &str, now_ms: i64) -> R<Option<u64>> {
    lock_user(c, user).await?;
    let t = load_target(c, conv, message_id).await?;
    if !sees(c, conv, user, t.msg_seq).await? {
        return Err(StoreError::NotFound(format!("message {message_id}")));
    }
    let n = exec(
        c,
        "INSERT INTO user_deleted (user_id, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        &[&user, &message_id],
    )
    .await?;
    if n == 1 {
        recount_unread(c, user, conv).await?;
    }
    let data = format!("{{\"message_id\":{},\"msg_seq\":{}}}", json_str(message_id), t.msg_seq);
    append_user_event(c, user, EVENT_DELETE, conv, Some(t.msg_seq), &format!("delete:{message_id}"), &data, now_ms)
        .await
}

pub(crate) async fn record_delivery(c: &Conn, user: &str, device: &str, ids: &[String], now_ms: i64) -> R<u64> {
    if ids.len() > DELIVERY_IDS_MAX {
        return Err(StoreError::Invalid(format!("at most {DELIVERY_IDS_MAX} message ids")));
    }
    // Only messages the user's log actually delivered count; the first
    // unknown id (in request order) refuses the whole request.
    let rows = query(
        c,
        "SELECT m.message_id FROM messages m JOIN user_convs uc ON uc.user_id = $1 AND uc.conv_id = m.conv_id
         WHERE m.message_id = ANY($2) AND m.msg_seq <= uc.last_msg_seq
           AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = $1
                       AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))",
        &[&user, &ids],
    )
    .await?;
    let delivered = rows.iter().map(|r| col::<String>(r, 0)).collect::<R<std::collections::HashSet<String>>>()?;
    if let Some(id) = ids.iter().find(|id| !delivered.contains(*id)) {
        return Err(StoreError::NotFound(format!("message {id}")));
    }
    exec(
        c,
        "INSERT INTO deliveries (user_id, message_id, device_id, delivered_at)
         SELECT $1, id, $3, $4 FROM unnest($2::text[]) WITH ORDINALITY AS t(id, n) ORDER BY n
         ON CONFLICT DO NOTHING",
        &[&user, &ids, &device, &now_ms],
    )
    .await
}

pub(crate) async fn rebuild_unread(c: &Conn) -> R<UnreadRebuild> {
    let rows = query(
        c,
        "SELECT uc.user_id, uc.conv_id, uc.unread,
                (SELECT COUNT(*) FROM messages m
                 WHERE m.conv_id = uc.conv_id AND m.msg_seq > uc.read_seq AND m.msg_seq <= uc.last_msg_seq
                   AND m.sender <> uc.user_id AND m.state <> 'recalled'
                   AND m.kind NOT IN ('conv.created', 'member.join', 'member.leave', 'recall', 'edit', 'reaction')
                   AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = uc.user_id
                               AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))
                   AND NOT EXISTS (SELECT 1 FROM user_deleted d
                                   WHERE d.user_id = uc.user_id AND d.message_id = m.message_id))
         FROM user_convs uc ORDER BY uc.user_id, uc.conv_id",
        &[],
    )
    .await?;
    let mut report = UnreadRebuild::default();
    for row in rows {
        report.rows_checked += 1;
        let (user, conv, unread, fact): (String, String, i64, i64) =
            (col(&row, 0)?, col(&row, 1)?, col(&row, 2)?, col(&row, 3)?);
        if fact != unread {
            report.drifted += 1;
            tracing::warn!(user = %user, conv = %conv, stored = unread, fact, "unread drift repaired");
            exec(c, "UPDATE user_convs SET unread = $3 WHERE user_id = $1 AND conv_id = $2", &[&user, &conv, &fact])
                .await?;
        }
    }
    Ok(report)
}

/// `NotFound` for a conversation that does not exist, else `NotMember`.
async fn not_found_or_not_member(c: &Conn, conv: &str) -> R<StoreError> {
    let exists: Option<i32> = scalar(c, "SELECT 1 FROM conversations WHERE conv_id = $1", &[&conv]).await?;
    Ok(match exists {
        None => StoreError::NotFound(format!("conversation {conv}")),
        Some(_) => StoreError::NotMember,
    })
}
