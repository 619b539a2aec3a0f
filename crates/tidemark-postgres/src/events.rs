//! Writer-side transactions for conversation events (send, group creation,
//! membership, recall, edit, reaction) and per-user events (read, settings,
//! delete-for-me, delivery, unread rebuild).
//!
//! Each function runs inside the writer's open transaction and savepoint;
//! an `Err` rolls back everything it wrote. Each loads the facts its rule
//! needs, lets the rule in `tidemark-core` decide and writes what it
//! decided, so the same situation gives the same answer as in SQLite.
//!
//! Locks (see the crate docs for the full order): a conversation event
//! locks its conversation row before it checks rights or state, so the
//! checks see every change committed before it, from any writer; a per-user
//! event locks the user's head row before touching the user's other rows.
//! This module knows no pool, no queue and no read path.

use tidemark_core::control::{self, ControlDecision, Target};
use tidemark_core::kinds::CONTROL_KINDS;
use tidemark_core::large::{self, ClearDecision, MarkerFacts};
use tidemark_core::membership::{self, MembershipDecision, MembershipFacts};
use tidemark_core::mention;
use tidemark_core::projection::{self, Settings};
use tidemark_proto::content::{self, Payload};
use tidemark_store::*;

use crate::db::{self, big, col, exec, query, query_opt, scalar, seq, seq_opt, Conn};
use crate::writer::{Decided, Param};

type R<T> = StoreResult<T>;

/// The earlier event with this idempotency key, if any: `(message_id,
/// conv, msg_seq, created_at_ms)`, once `control::check_replay` found it the
/// same operation (`kinds` empty means "a user message").
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
    control::check_replay((&event_conv, &kind), conv, kinds, client_msg_id)?;
    Ok(Some((col(&r, 0)?, event_conv, seq(&r, 2)?, col(&r, 3)?)))
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

/// One send (S1–S3) in one statement, `tidemark_send_on` (schema steps 2,
/// 11, 14 and 17: one plpgsql function, no nested call):
/// the original on a retry, else the membership check at the
/// conversation's linearisation point, the quote check and the next
/// `msg_seq` with the message and its outbox record. One statement, so
/// the writer pipelines the sends of a batch (`Writer::write_statement`).
/// The parameters are [`send_params`]; [`decide_send`] reads the outcome.
/// Behind the frame's epoch fence (step 14).
pub(crate) const SEND_SQL: &str =
    "SELECT * FROM tidemark_send_on($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)";

/// A send whose kind `control::check_send_kind` refuses: the original on
/// a retry of its key, else that refusal. Writes nothing.
pub(crate) async fn reserved_send(c: &Conn, cmd: &SendCmd) -> R<Accepted> {
    if let Some((message_id, conv, msg_seq, created_at_ms)) =
        existing_event_of(c, &cmd.sender, &cmd.client_msg_id, &cmd.conv, &[]).await?
    {
        return Ok(Accepted { message_id, conv, msg_seq, created_at_ms, duplicate: true });
    }
    control::check_send_kind(&cmd.kind)?;
    Err(StoreError::Internal(format!("kind {} is not reserved", cmd.kind)))
}

/// The parameters of [`SEND_SQL`] for `cmd`.
pub(crate) fn send_params(cmd: &SendCmd) -> Vec<Param> {
    let control_kinds: Vec<String> = CONTROL_KINDS.iter().map(|k| (*k).to_owned()).collect();
    vec![
        Box::new(cmd.conv.clone()),
        Box::new(cmd.message_id.clone()),
        Box::new(cmd.sender.clone()),
        Box::new(cmd.sender_device.clone()),
        Box::new(cmd.client_msg_id.clone()),
        Box::new(cmd.kind.clone()),
        Box::new(cmd.content.clone()),
        Box::new(STATE_NORMAL),
        Box::new(cmd.quote_id.clone()),
        Box::new(cmd.now_ms),
        Box::new(event_kind_of(&cmd.kind)),
        Box::new(control_kinds),
        Box::new((!cmd.mentions.is_empty()).then(|| cmd.mentions.clone())),
        Box::new(cmd.mention_all),
        Box::new(mention::MENTION_ALL_MEMBERS_MAX as i64),
        Box::new(cmd.connection_epoch.map(big)),
    ]
}

/// What the rules of `tidemark-core` make of `tidemark_send`'s row: the
/// statement only gathered the facts at the right moment (and wrote
/// nothing unless it accepted); the decisions are core's, as in SQLite.
/// The statement's own refusal of a quote is cross-checked against
/// `control::check_quote`: were they ever to disagree, the send is undone
/// and answered `Internal`, never committed against core's rule.
pub(crate) fn decide_send(cmd: &SendCmd, rows: &[tokio_postgres::Row]) -> Decided<Accepted> {
    let decided = (|| -> R<Decided<Accepted>> {
        let [r] = rows else {
            return Err(StoreError::Internal(format!("tidemark_send returned {} rows", rows.len())));
        };
        let status: String = col(r, 0)?;
        let quote = |r: &tokio_postgres::Row| -> R<Option<(String, bool)>> {
            let kind: Option<String> = col(r, 6)?;
            let sees: Option<bool> = col(r, 7)?;
            Ok(kind.map(|k| (k, sees.unwrap_or(false))))
        };
        Ok(match status.as_str() {
            "dup" => {
                let (event_conv, kind): (String, String) = (col(r, 2)?, col(r, 5)?);
                control::check_replay((&event_conv, &kind), &cmd.conv, &[], &cmd.client_msg_id)?;
                Decided::Answer(Ok(Accepted {
                    message_id: col(r, 1)?,
                    conv: event_conv,
                    msg_seq: seq(r, 3)?,
                    created_at_ms: col(r, 4)?,
                    duplicate: true,
                }))
            }
            "superseded" => {
                let newest = seq(r, 3)?;
                if !tidemark_core::session::frame_superseded(cmd.connection_epoch, newest) {
                    return Err(StoreError::Internal(format!(
                        "tidemark_send_on refused epoch {:?} under {newest}, which frame_superseded accepts",
                        cmd.connection_epoch
                    )));
                }
                Decided::Answer(Err(StoreError::Superseded(newest)))
            }
            "no_conv" => Decided::Answer(Err(control::not_member(&cmd.conv, false).into())),
            "not_member" => Decided::Answer(Err(StoreError::NotMember)),
            "mention_all" => {
                mention::check_mention_all(true, &mention_facts(r)?, &cmd.sender)?;
                Decided::Answer(Err(StoreError::Internal(
                    "tidemark_send refused a mention of everyone, which check_mention_all accepts".into(),
                )))
            }
            "quote" => {
                let quoted = cmd.quote_id.as_deref().unwrap_or_default();
                let facts = quote(r)?;
                control::check_quote(quoted, facts.as_ref().map(|(k, sees)| (k.as_str(), *sees)))?;
                Decided::Answer(Err(StoreError::Internal(format!(
                    "tidemark_send refused quote {quoted}, which check_quote accepts"
                ))))
            }
            "ok" => {
                if let Some(quoted) = &cmd.quote_id {
                    let facts = quote(r)?;
                    if let Err(e) = control::check_quote(quoted, facts.as_ref().map(|(k, sees)| (k.as_str(), *sees))) {
                        return Ok(Decided::Undo(StoreError::Internal(format!(
                            "tidemark_send accepted quote {quoted}, which check_quote refuses: {e}"
                        ))));
                    }
                }
                if cmd.mention_all {
                    if let Err(e) = mention::check_mention_all(true, &mention_facts(r)?, &cmd.sender) {
                        return Ok(Decided::Undo(StoreError::Internal(format!(
                            "tidemark_send accepted a mention of everyone, which check_mention_all refuses: {e}"
                        ))));
                    }
                }
                Decided::Answer(Ok(cmd.accepted(seq(r, 3)?)))
            }
            other => Decided::Answer(Err(StoreError::Internal(format!("tidemark_send status {other}")))),
        })
    })();
    match decided {
        Ok(d) => d,
        // A refusal read from the facts: the statement wrote nothing.
        Err(e) => Decided::Answer(Err(e)),
    }
}

/// The facts of the "everyone" permission `tidemark_send` read.
fn mention_facts(r: &tokio_postgres::Row) -> R<mention::MentionAllFacts> {
    Ok(mention::MentionAllFacts {
        kind: col(r, 8)?,
        owner: col(r, 9)?,
        active_members: col::<Option<i64>>(r, 10)?.unwrap_or(0) as u64,
    })
}

/// The users among `users` that have an account.
pub(crate) async fn known_users(c: &Conn, users: &[String]) -> R<Vec<String>> {
    let rows = query(c, "SELECT user_id FROM users WHERE user_id = ANY($1)", &[&users]).await?;
    rows.iter().map(|r| col::<String>(r, 0)).collect()
}

pub(crate) async fn create_group(
    c: &Conn,
    cmd: &ConvEventCmd,
    members: &[String],
    policy: GroupPolicy,
) -> R<(String, u64)> {
    // A retried create finds the group its first attempt made.
    let earlier = query_opt(
        c,
        "SELECT conv_id, kind FROM messages WHERE sender = $1 AND client_msg_id = $2",
        &[&cmd.actor, &cmd.client_msg_id],
    )
    .await?
    .map(|r| Ok::<_, StoreError>((col(&r, 0)?, col(&r, 1)?)))
    .transpose()?;
    if let Some(conv) = membership::replayed_group(earlier, &cmd.client_msg_id)? {
        return Ok((conv, 1));
    }
    let all = membership::group_members(&cmd.actor, members)?;
    membership::all_known(&all, &known_users(c, &all).await?)?;
    exec(
        c,
        "INSERT INTO conversations (conv_id, kind, direct_key, head, epoch, owner, created_at)
         VALUES ($1, $2, NULL, 0, 1, $3, $4)",
        &[&cmd.conv, &CONV_GROUP, &cmd.actor, &cmd.now_ms],
    )
    .await?;
    let content = content::GroupCreated { owner: &cmd.actor, members: &all }.to_json();
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
    // A group created large switches at once: the conv.created and the
    // switch are fanned out to every member (they learn of the group and
    // of its mode), everything after is read from the conversation log.
    if policy.mode_for_new_group(all.len() as u64) == large::MODE_SHARED {
        switch_to_shared(c, cmd, all.len() as u64).await?;
    }
    exec(
        c,
        "UPDATE conversations SET members_seq = $2, active_members = $3 WHERE conv_id = $1",
        &[&cmd.conv, &big(at), &(all.len() as i64)],
    )
    .await?;
    Ok((cmd.conv.clone(), at))
}

/// Puts `conv` in shared mode from `from` (the switch event's msg_seq) on,
/// and flags every member's row so the sync path finds it.
async fn set_shared(c: &Conn, conv: &str, from: u64) -> R<()> {
    exec(
        c,
        "UPDATE conversations SET mode = $2, shared_from = $3 WHERE conv_id = $1",
        &[&conv, &large::MODE_SHARED, &big(from)],
    )
    .await?;
    exec(
        c,
        "UPDATE user_convs SET shared = TRUE WHERE conv_id = $1
         AND user_id IN (SELECT user_id FROM membership_periods WHERE conv_id = $1)",
        &[&conv],
    )
    .await?;
    Ok(())
}

/// G3: a join took the group over the threshold: the switch event, at the
/// next msg_seq, by the writer that ordered the join (the conversation row
/// is locked). Its idempotency key is derived from the join's, so a
/// retried join finds the join and writes nothing more.
async fn switch_to_shared(c: &Conn, cmd: &ConvEventCmd, members: u64) -> R<u64> {
    let switch = ConvEventCmd {
        event_id: format!("{}.mode", cmd.event_id),
        client_msg_id: format!("{}.mode", cmd.client_msg_id),
        ..cmd.clone()
    };
    let content = content::ModeChanged { mode: large::MODE_SHARED, members }.to_json();
    let at = append_conv_event(c, &switch, KIND_MODE, &content, None, STATE_NORMAL).await?;
    set_shared(c, &cmd.conv, at).await?;
    tracing::info!(conv = %cmd.conv, msg_seq = at, members, "group switched to shared mode");
    Ok(at)
}

/// What a membership change decides on: the conversation row, locked
/// first (`None`: no such conversation), then the periods and the target's
/// account in one statement.
async fn membership_facts(c: &Conn, conv: &str, actor: &str, target: &str) -> R<Option<MembershipFacts>> {
    let Some((kind, owner)) = lock_conversation(c, conv).await? else { return Ok(None) };
    let r = db::query_one(
        c,
        "SELECT EXISTS (SELECT 1 FROM membership_periods WHERE conv_id = $1 AND user_id = $2 AND leave_seq IS NULL),
                EXISTS (SELECT 1 FROM users WHERE user_id = $3),
                (SELECT join_seq FROM membership_periods WHERE conv_id = $1 AND user_id = $3 AND leave_seq IS NULL
                 LIMIT 1),
                (SELECT active_members FROM conversations WHERE conv_id = $1)",
        &[&conv, &actor, &target],
    )
    .await?;
    Ok(Some(MembershipFacts {
        kind,
        owner,
        actor_active: col(&r, 0)?,
        target_known: col(&r, 1)?,
        target_open_join: seq_opt(&r, 2)?,
        active_members: seq(&r, 3)?,
    }))
}

pub(crate) async fn change_membership(
    c: &Conn,
    cmd: &ConvEventCmd,
    target: &str,
    change: MembershipChange,
    policy: GroupPolicy,
) -> R<u64> {
    if let Some((_, _, at, _)) =
        existing_event_of(c, &cmd.actor, &cmd.client_msg_id, &cmd.conv, &[KIND_JOIN, KIND_LEAVE]).await?
    {
        return Ok(at);
    }
    let facts = membership_facts(c, &cmd.conv, &cmd.actor, target).await?;
    let decision = membership::decide_membership(&cmd.conv, facts.as_ref(), &cmd.actor, target, change)?;
    let event_kind = match decision {
        MembershipDecision::AlreadyMember { join_seq } => return Ok(join_seq),
        MembershipDecision::Join => KIND_JOIN,
        MembershipDecision::Leave => KIND_LEAVE,
    };
    let content = content::MemberChanged { user: target, by: &cmd.actor, op: change.verb() }.to_json();
    let at = append_conv_event(c, cmd, event_kind, &content, None, STATE_NORMAL).await?;
    if decision == MembershipDecision::Join {
        // A new period per join: the old ones keep their own range (G1).
        exec(
            c,
            "INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES ($1, $2, $3, NULL)",
            &[&cmd.conv, &target, &big(at)],
        )
        .await?;
        let mode: String =
            col(&db::query_one(c, "SELECT mode FROM conversations WHERE conv_id = $1", &[&cmd.conv]).await?, 0)?;
        let shared = mode == large::MODE_SHARED;
        exec(
            c,
            "INSERT INTO user_convs (user_id, conv_id, shared) VALUES ($1, $2, $3)
             ON CONFLICT (user_id, conv_id) DO UPDATE SET active = TRUE, shared = excluded.shared",
            &[&target, &cmd.conv, &shared],
        )
        .await?;
        exec(
            c,
            "UPDATE conversations SET members_seq = $2, active_members = active_members + 1 WHERE conv_id = $1",
            &[&cmd.conv, &big(at)],
        )
        .await?;
        let members = facts.as_ref().map_or(0, |f| f.active_members) + 1;
        if policy.switches(&mode, members) {
            switch_to_shared(c, cmd, members).await?;
        }
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
        exec(
            c,
            "UPDATE conversations SET members_seq = $2, active_members = active_members - 1 WHERE conv_id = $1",
            &[&cmd.conv, &big(at)],
        )
        .await?;
    }
    Ok(at)
}

/// `dirty.clear` (G2): loads the marker's facts for the device, lets
/// `large::decide_clear` decide, and records a clear. A publication
/// racing it is harmless: dirtiness is measured against the target, so a
/// clear recorded at an older target leaves the marker dirty.
pub(crate) async fn clear_marker(
    c: &Conn,
    user: &str,
    device: &str,
    conv: &str,
    observed_version: u64,
    last_msg_seq: u64,
) -> R<(bool, Marker)> {
    let row = query_opt(
        c,
        "SELECT cv.mode, COALESCE(mk.target, 0), COALESCE(mk.version, 0),
                EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = cv.conv_id AND p.user_id = $2
                        AND p.leave_seq IS NULL),
                (SELECT MAX(p.leave_seq) FROM membership_periods p WHERE p.conv_id = cv.conv_id AND p.user_id = $2),
                COALESCE((SELECT dm.cleared_seq FROM device_markers dm WHERE dm.user_id = $2 AND dm.device_id = $3
                          AND dm.conv_id = cv.conv_id), 0)
         FROM conversations cv LEFT JOIN conv_markers mk ON mk.conv_id = cv.conv_id WHERE cv.conv_id = $1",
        &[&conv, &user, &device],
    )
    .await?;
    let Some(r) = row else { return Err(StoreError::NotFound(format!("conversation {conv}"))) };
    let (mode, active, last_leave): (String, bool, Option<u64>) = (col(&r, 0)?, col(&r, 3)?, seq_opt(&r, 4)?);
    if !active && last_leave.is_none() {
        return Err(StoreError::NotMember);
    }
    if mode != large::MODE_SHARED {
        return Err(StoreError::Invalid(format!("conversation {conv} is not in shared mode")));
    }
    let facts = MarkerFacts {
        published_target: seq(&r, 1)?,
        version: seq(&r, 2)?,
        left_at: if active { None } else { last_leave },
        cleared_seq: seq(&r, 5)?,
    };
    match large::decide_clear(&facts, observed_version, last_msg_seq) {
        ClearDecision::Stale => Ok((false, large::marker(&facts))),
        ClearDecision::Cleared { cleared_seq } => {
            exec(
                c,
                "INSERT INTO device_markers (user_id, device_id, conv_id, cleared_seq, cleared_version)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (user_id, device_id, conv_id) DO UPDATE SET
                    cleared_seq = GREATEST(device_markers.cleared_seq, excluded.cleared_seq),
                    cleared_version = excluded.cleared_version",
                &[&user, &device, &conv, &big(cleared_seq), &big(observed_version)],
            )
            .await?;
            Ok((true, large::marker(&MarkerFacts { cleared_seq, ..facts })))
        }
    }
}

/// The target of a control event by `actor` (a reaction's current state
/// when `reaction` is given), in one statement; `None` if `conv` has no
/// such message.
async fn load_target(c: &Conn, conv: &str, message_id: &str, actor: &str, reaction: Option<&str>) -> R<Option<Target>> {
    let row = query_opt(
        c,
        "SELECT m.kind, m.msg_seq, m.sender, m.state, m.version, m.recall_seq,
                EXISTS (SELECT 1 FROM membership_periods p
                        WHERE p.conv_id = m.conv_id AND p.user_id = $3 AND p.leave_seq IS NULL),
                EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = $3
                        AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR p.leave_seq >= m.msg_seq)),
                (SELECT r.event_seq FROM reactions r WHERE r.conv_id = m.conv_id AND r.message_id = m.message_id
                 AND r.user_id = $3 AND r.reaction = $4)
         FROM messages m WHERE m.conv_id = $1 AND m.message_id = $2",
        &[&conv, &message_id, &actor, &reaction],
    )
    .await?;
    row.map(|r| {
        Ok(Target {
            kind: col(&r, 0)?,
            msg_seq: seq(&r, 1)?,
            sender: col(&r, 2)?,
            state: col(&r, 3)?,
            version: seq(&r, 4)?,
            recall_seq: seq_opt(&r, 5)?,
            actor_active: col(&r, 6)?,
            actor_sees: col(&r, 7)?,
            actor_reaction: seq_opt(&r, 8)?,
        })
    })
    .transpose()
}

/// A control event's facts and its decision: a retry of an earlier run
/// (`control::decide_retry`, without the lock, as it writes nothing), else
/// `decide` on the target read under the conversation's lock. `Ok` is what
/// to write (the target and its new version), `Err` the answer without a
/// write.
async fn decide_control(
    c: &Conn,
    cmd: &ConvEventCmd,
    message_id: &str,
    kind: &str,
    reaction: Option<&str>,
    decide: impl FnOnce(Option<&Target>) -> Result<ControlDecision, tidemark_core::Refusal>,
) -> R<Result<(Target, u64), ControlOutcome>> {
    let earlier = existing_event_of(c, &cmd.actor, &cmd.client_msg_id, &cmd.conv, &[kind]).await?;
    if earlier.is_none() {
        lock_conversation(c, &cmd.conv).await?;
    }
    let t = load_target(c, &cmd.conv, message_id, &cmd.actor, reaction).await?;
    let decision = match earlier {
        Some((_, _, at, _)) => control::decide_retry(at, t.as_ref(), message_id)?,
        None => decide(t.as_ref())?,
    };
    Ok(control::plan(t, decision))
}

pub(crate) async fn recall(c: &Conn, cmd: &ConvEventCmd, message_id: &str) -> R<ControlOutcome> {
    let planned =
        decide_control(c, cmd, message_id, KIND_RECALL, None, |t| control::decide_recall(t, &cmd.actor, message_id))
            .await?;
    let (t, version) = match planned {
        Ok(write) => write,
        Err(done) => return Ok(done),
    };
    let content = content::Recalled { target_message_id: message_id, target_msg_seq: t.msg_seq }.to_json();
    let at = append_conv_event(c, cmd, KIND_RECALL, &content, Some(message_id), STATE_NORMAL).await?;
    // The original content is gone for good: no path can serve it again.
    exec(
        c,
        "UPDATE messages SET state = $3, content = '{}', version = $5, recall_seq = $4
         WHERE conv_id = $1 AND message_id = $2",
        &[&cmd.conv, &message_id, &STATE_RECALLED, &big(at), &big(version)],
    )
    .await?;
    exec(c, "DELETE FROM reactions WHERE conv_id = $1 AND message_id = $2", &[&cmd.conv, &message_id]).await?;
    // Earlier edit events carried the content too: keep them as events,
    // without the content (`content::Edited::recalled`).
    let edits = query(
        c,
        "SELECT message_id, content FROM messages WHERE conv_id = $1 AND target_id = $2 AND kind = $3",
        &[&cmd.conv, &message_id, &KIND_EDIT],
    )
    .await?;
    for r in &edits {
        let (edit_id, stored): (String, String) = (col(r, 0)?, col(r, 1)?);
        let wiped =
            content::Edited::recalled(&stored).map_err(|e| StoreError::Internal(format!("edit {edit_id}: {e}")))?;
        exec(
            c,
            "UPDATE messages SET content = $3 WHERE conv_id = $1 AND message_id = $2",
            &[&cmd.conv, &edit_id, &wiped],
        )
        .await?;
    }
    Ok(ControlOutcome { msg_seq: at, version, changed: true })
}

pub(crate) async fn edit(
    c: &Conn,
    cmd: &ConvEventCmd,
    message_id: &str,
    content: &str,
    base_version: u64,
) -> R<ControlOutcome> {
    let planned = decide_control(c, cmd, message_id, KIND_EDIT, None, |t| {
        control::decide_edit(t, &cmd.actor, message_id, base_version)
    })
    .await?;
    let (t, version) = match planned {
        Ok(write) => write,
        Err(done) => return Ok(done),
    };
    let event = content::Edited::new(message_id, t.msg_seq, version, content)
        .map_err(|e| StoreError::Invalid(e.to_string()))?
        .to_json();
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
    let planned = decide_control(c, cmd, message_id, KIND_REACTION, Some(reaction), |t| {
        control::decide_react(t, message_id, add)
    })
    .await?;
    let (t, version) = match planned {
        Ok(write) => write,
        Err(done) => return Ok(done),
    };
    let event = content::Reacted::new(message_id, t.msg_seq, reaction, add, &cmd.actor, version).to_json();
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
/// `tidemark_read` (schema step 16) counts the same in its own SQL: a
/// change here is a new schema step replacing that function (the
/// conformance suite compares both with SQLite read by read).
pub(crate) const COUNT_UNREAD: &str = "SELECT COUNT(*) FROM messages m JOIN user_convs uc
       ON uc.user_id = $1 AND uc.conv_id = m.conv_id
     WHERE m.conv_id = $2 AND m.msg_seq > $3 AND m.msg_seq <= uc.last_msg_seq
       AND m.sender <> $1 AND m.state <> 'recalled'
       AND m.kind NOT IN ('conv.created', 'member.join', 'member.leave', 'recall', 'edit', 'reaction')
       AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = $1
                   AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))
       AND NOT EXISTS (SELECT 1 FROM user_deleted d WHERE d.user_id = $1 AND d.message_id = m.message_id)";

/// A message mentions user `$1` (issue 18): by name or everyone. Who it
/// counts for beyond that is [`COUNT_UNREAD`]'s, as `mention::counts` says.
pub(crate) const MENTIONED: &str = "(m.mention_all OR $1 = ANY (m.mentions))";

/// Mentions from the facts (issue 18): the unread messages of
/// [`COUNT_UNREAD`] that mention the user.
pub(crate) static COUNT_MENTIONS: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{COUNT_UNREAD} AND {MENTIONED}"));

pub(crate) async fn count_unread(c: &Conn, user: &str, conv: &str, read_seq: u64) -> R<u64> {
    let n: i64 = scalar(c, COUNT_UNREAD, &[&user, &conv, &big(read_seq)]).await?.unwrap_or(0);
    Ok(n as u64)
}

pub(crate) async fn count_mentions(c: &Conn, user: &str, conv: &str, read_seq: u64) -> R<u64> {
    let n: i64 = scalar(c, &COUNT_MENTIONS, &[&user, &conv, &big(read_seq)]).await?.unwrap_or(0);
    Ok(n as u64)
}

/// Recounts the user's unread and mentions in `conv` from the facts and
/// stores them; `(unread, mentions)`.
pub(crate) async fn recount_unread(c: &Conn, user: &str, conv: &str) -> R<(u64, u64)> {
    let read_seq: i64 =
        scalar(c, "SELECT read_seq FROM user_convs WHERE user_id = $1 AND conv_id = $2", &[&user, &conv])
            .await?
            .unwrap_or(0);
    let unread = count_unread(c, user, conv, read_seq as u64).await?;
    let mentions = count_mentions(c, user, conv, read_seq as u64).await?;
    exec(
        c,
        "UPDATE user_convs SET unread = $3, mentions = $4 WHERE user_id = $1 AND conv_id = $2",
        &[&user, &conv, &big(unread), &big(mentions)],
    )
    .await?;
    Ok((unread, mentions))
}

pub(crate) async fn mark_read(
    c: &Conn,
    user: &str,
    conv: &str,
    read_to_seq: u64,
    on: Option<(&str, u64)>,
    now_ms: i64,
) -> R<ReadOutcome> {
    lock_user(c, user).await?;
    // The device's newest connection is read by the same statement (P2).
    let (device, epoch) = (on.map_or("", |(d, _)| d), on.map(|(_, e)| e));
    let row = query_opt(
        c,
        "SELECT uc.read_seq, c.head, uc.unread, uc.mentions,
                COALESCE((SELECT d.connection_epoch FROM devices d WHERE d.user_id = $1 AND d.device_id = $3), 0)
         FROM user_convs uc
         JOIN conversations c ON c.conv_id = uc.conv_id
         WHERE uc.user_id = $1 AND uc.conv_id = $2",
        &[&user, &conv, &device],
    )
    .await?;
    let Some(row) = row else {
        if let Some(epoch) = epoch {
            let newest: i64 = scalar(
                c,
                "SELECT connection_epoch FROM devices WHERE user_id = $1 AND device_id = $2",
                &[&user, &device],
            )
            .await?
            .unwrap_or(0);
            if tidemark_core::session::frame_superseded(Some(epoch), newest.max(0) as u64) {
                return Err(StoreError::Superseded(newest as u64));
            }
        }
        return Err(not_found_or_not_member(c, conv).await?);
    };
    let newest = seq(&row, 4)?;
    if tidemark_core::session::frame_superseded(epoch, newest) {
        return Err(StoreError::Superseded(newest));
    }
    let (read_seq, head) = (seq(&row, 0)?, seq(&row, 1)?);
    let Some(target) = projection::read_target(read_to_seq, head, read_seq) else {
        let (unread, mentions) =
            conv_state(c, user, conv).await?.map_or((seq(&row, 2)?, seq(&row, 3)?), |s| (s.unread, s.mentions));
        return Ok(ReadOutcome { read_seq, unread, mentions, written: None });
    };
    exec(c, "UPDATE user_convs SET read_seq = $3 WHERE user_id = $1 AND conv_id = $2", &[&user, &conv, &big(target)])
        .await?;
    // Mentions clear with unread, only up to the new read cursor: the
    // recount keeps those above it (issue 18).
    let (mut unread, mut mentions) = recount_unread(c, user, conv).await?;
    // A shared group's unread above the switch is counted from the log.
    if let Some(state) = conv_state(c, user, conv).await? {
        if state.mode == large::MODE_SHARED {
            (unread, mentions) = (state.unread, state.mentions);
        }
    }
    let data = content::ReadData { read_seq: target, unread }.to_json();
    let source = projection::read_event_id(conv, target);
    let written = append_user_event(c, user, EVENT_READ, conv, Some(target), &source, &data, now_ms).await?;
    Ok(ReadOutcome { read_seq: target, unread, mentions, written })
}

/// A `read` in one statement, `tidemark_read` (schema step 16); the
/// parameters are [`read_params`], [`decide_read_row`] reads the outcome.
pub(crate) const READ_SQL: &str = "SELECT * FROM tidemark_read($1, $2, $3, $4, $5, $6)";

/// One `read`, as [`READ_SQL`] takes it and [`decide_read_row`] judges it.
#[derive(Debug, Clone)]
pub(crate) struct ReadCmd {
    pub user: String,
    pub conv: String,
    pub read_to_seq: u64,
    /// The WebSocket connection it came on: `(device, connection_epoch)`.
    pub on: Option<(String, u64)>,
    pub now_ms: i64,
}

/// The parameters of [`READ_SQL`] for `cmd`.
pub(crate) fn read_params(cmd: &ReadCmd) -> Vec<Param> {
    let (device, epoch) = match &cmd.on {
        Some((d, e)) => (d.clone(), Some(big(*e))),
        None => (String::new(), None),
    };
    vec![
        Box::new(cmd.user.clone()),
        Box::new(cmd.conv.clone()),
        Box::new(big(cmd.read_to_seq)),
        Box::new(device),
        Box::new(epoch),
        Box::new(cmd.now_ms),
    ]
}

/// What `tidemark_read` answered: the read, or a shared large group, which
/// the multi-statement [`mark_read`] serves (its unread above the switch
/// follows core's marker rules).
#[derive(Debug)]
pub(crate) enum ReadRow {
    Done(ReadOutcome),
    Shared,
}

/// What `tidemark_core` and `tidemark_proto` make of `tidemark_read`'s row:
/// core's rules decide again on the facts the statement read (the epoch
/// fence, `projection::read_target` on the cursor and the head), and the
/// event's key and data must be what core and the proto build for that
/// decision; a disagreement undoes the request and answers `Internal`,
/// never committed against them.
pub(crate) fn decide_read_row(cmd: &ReadCmd, rows: &[tokio_postgres::Row]) -> Decided<ReadRow> {
    let decided = (|| -> R<Decided<ReadRow>> {
        let [r] = rows else {
            return Err(StoreError::Internal(format!("tidemark_read returned {} rows", rows.len())));
        };
        let status: String = col(r, 0)?;
        let epoch = cmd.on.as_ref().map(|(_, e)| *e);
        match status.as_str() {
            "superseded" => {
                let newest = seq(r, 1)?;
                if !tidemark_core::session::frame_superseded(epoch, newest) {
                    return Err(StoreError::Internal(format!(
                        "tidemark_read refused epoch {epoch:?} under {newest}, which frame_superseded accepts"
                    )));
                }
                return Ok(Decided::Answer(Err(StoreError::Superseded(newest))));
            }
            "not_member" => return Ok(Decided::Answer(Err(control::not_member(&cmd.conv, true).into()))),
            "not_found" => return Ok(Decided::Answer(Err(control::not_member(&cmd.conv, false).into()))),
            "shared" => return Ok(Decided::Answer(Ok(ReadRow::Shared))),
            "ok" => {}
            other => return Err(StoreError::Internal(format!("tidemark_read status {other}"))),
        }
        let (read_seq, head) = (seq(r, 2)?, seq(r, 3)?);
        let (unread, mentions) = (seq(r, 5)?, seq(r, 6)?);
        let target: Option<i64> = col(r, 4)?;
        let decided = projection::read_target(cmd.read_to_seq, head, read_seq);
        if decided.map(big) != target {
            return Ok(Decided::Undo(StoreError::Internal(format!(
                "tidemark_read moved the read cursor to {target:?} where read_target decides {decided:?}"
            ))));
        }
        let Some(target) = decided else {
            return Ok(Decided::Answer(Ok(ReadRow::Done(ReadOutcome { read_seq, unread, mentions, written: None }))));
        };
        let (source, data): (String, String) = (col(r, 7)?, col(r, 8)?);
        let (want_source, want_data) =
            (projection::read_event_id(&cmd.conv, target), content::ReadData { read_seq: target, unread }.to_json());
        if (source.as_str(), data.as_str()) != (want_source.as_str(), want_data.as_str()) {
            return Ok(Decided::Undo(StoreError::Internal(format!(
                "tidemark_read wrote event {source} {data} where core and the proto build {want_source} {want_data}"
            ))));
        }
        let written = seq_opt(r, 9)?;
        Ok(Decided::Answer(Ok(ReadRow::Done(ReadOutcome { read_seq: target, unread, mentions, written }))))
    })();
    match decided {
        Ok(d) => d,
        // A row this build cannot read: whatever the statement wrote must
        // not commit.
        Err(e) => Decided::Undo(e),
    }
}

/// The user's row of `conv` in the conversation list, as `list_conversations`
/// renders it.
pub(crate) async fn conv_state(c: &Conn, user: &str, conv: &str) -> R<Option<ConvState>> {
    Ok(crate::read::conv_rows(c, user, None, crate::read::Rows::One(conv)).await?.pop())
}

pub(crate) async fn update_settings(
    c: &Conn,
    user: &str,
    conv: &str,
    update: projection::SettingsUpdate,
    now_ms: i64,
) -> R<(ConvState, UserEventOutcome)> {
    lock_user(c, user).await?;
    let row = query_opt(
        c,
        "SELECT muted, pinned, settings_version, push_preview FROM user_convs WHERE user_id = $1 AND conv_id = $2",
        &[&user, &conv],
    )
    .await?;
    let Some(row) = row else { return Err(not_found_or_not_member(c, conv).await?) };
    let now = Settings {
        muted: col(&row, 0)?,
        pinned: col(&row, 1)?,
        push_preview: crate::push::preview_col(&row, 3)?,
        version: seq(&row, 2)?,
    };
    let written = match projection::settings_after(now, update) {
        None => None,
        Some(next) => {
            exec(
                c,
                "UPDATE user_convs SET muted = $3, pinned = $4, push_preview = $5, settings_version = $6
                 WHERE user_id = $1 AND conv_id = $2",
                &[&user, &conv, &next.muted, &next.pinned, &next.push_preview.as_str(), &big(next.version)],
            )
            .await?;
            let data = content::SettingsData {
                muted: next.muted,
                pinned: next.pinned,
                push_preview: next.push_preview.into(),
                version: next.version,
            };
            let source = projection::settings_event_id(conv, next.version);
            append_user_event(c, user, EVENT_SETTINGS, conv, None, &source, &data.to_json(), now_ms).await?
        }
    };
    let state = conv_state(c, user, conv).await?.ok_or(StoreError::NotMember)?;
    Ok((state, UserEventOutcome { written }))
}

pub(crate) async fn delete_for_me(c: &Conn, user: &str, conv: &str, message_id: &str, now_ms: i64) -> R<Option<u64>> {
    lock_user(c, user).await?;
    let t = load_target(c, conv, message_id, user, None).await?;
    let msg_seq = control::decide_delete_for_me(t.as_ref(), message_id)?;
    let n = exec(
        c,
        "INSERT INTO user_deleted (user_id, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        &[&user, &message_id],
    )
    .await?;
    if n == 1 {
        recount_unread(c, user, conv).await?;
    }
    let data = content::DeletedData { message_id, msg_seq }.to_json();
    let source = projection::delete_event_id(message_id);
    append_user_event(c, user, EVENT_DELETE, conv, Some(msg_seq), &source, &data, now_ms).await
}

pub(crate) async fn record_delivery(c: &Conn, user: &str, device: &str, ids: &[String], now_ms: i64) -> R<u64> {
    projection::check_delivery_ids(ids.len())?;
    // Only messages fan-out delivered to the user count: inside the user's
    // periods and at or below its last_msg_seq.
    let rows = query(
        c,
        "SELECT m.message_id FROM messages m JOIN user_convs uc ON uc.user_id = $1 AND uc.conv_id = m.conv_id
         WHERE m.message_id = ANY($2) AND m.msg_seq <= uc.last_msg_seq
           AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = m.conv_id AND p.user_id = $1
                       AND p.join_seq <= m.msg_seq AND (p.leave_seq IS NULL OR m.msg_seq <= p.leave_seq))",
        &[&user, &ids],
    )
    .await?;
    let delivered = rows.iter().map(|r| col::<String>(r, 0)).collect::<R<Vec<String>>>()?;
    projection::check_delivered(ids, &delivered)?;
    exec(
        c,
        "INSERT INTO deliveries (user_id, message_id, device_id, delivered_at)
         SELECT $1, id, $3, $4 FROM unnest($2::text[]) WITH ORDINALITY AS t(id, n) ORDER BY n
         ON CONFLICT DO NOTHING",
        &[&user, &ids, &device, &now_ms],
    )
    .await
}

/// `NotFound` for a conversation that does not exist, else `NotMember`.
async fn not_found_or_not_member(c: &Conn, conv: &str) -> R<StoreError> {
    let exists: Option<i32> = scalar(c, "SELECT 1 FROM conversations WHERE conv_id = $1", &[&conv]).await?;
    Ok(control::not_member(conv, exists.is_some()).into())
}
