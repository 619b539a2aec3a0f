//! Privacy switches, the presence audience and receipts shown to others
//! (issue 18): the SQL only. What is shown to whom is decided by
//! `tidemark_core::ephemeral` on the facts read here.

use std::collections::HashMap;

use tidemark_core::ephemeral::{self, DeliveryFacts, MemberRead};
use tidemark_store::*;

use crate::db::{col, exec, query, query_opt, scalar, seq, Conn};

type R<T> = StoreResult<T>;

pub(crate) async fn privacy(c: &Conn, user: &str) -> R<Privacy> {
    let row = query_opt(
        c,
        "SELECT hide_presence, private_receipts, push_preview FROM user_privacy WHERE user_id = $1",
        &[&user],
    )
    .await?;
    row.as_ref().map_or(Ok(Privacy::default()), privacy_row)
}

fn privacy_row(r: &tokio_postgres::Row) -> R<Privacy> {
    Ok(Privacy {
        hide_presence: col(r, 0)?,
        private_receipts: col(r, 1)?,
        push_preview: crate::push::preview_col(r, 2)?,
    })
}

/// The switches and their version (0: never changed), as the snapshot
/// view reads them.
pub(crate) async fn privacy_versioned(c: &Conn, user: &str) -> R<(Privacy, u64)> {
    let row = query_opt(
        c,
        "SELECT hide_presence, private_receipts, push_preview, version FROM user_privacy WHERE user_id = $1",
        &[&user],
    )
    .await?;
    match row {
        None => Ok((Privacy::default(), 0)),
        Some(r) => Ok((privacy_row(&r)?, seq(&r, 3)?)),
    }
}

/// A change of the switches is written with its `privacy` user event in
/// the user's own log (one transaction, the user's head locked first like
/// every user-side write); a no-op writes neither.
pub(crate) async fn set_privacy(
    c: &Conn,
    user: &str,
    update: ephemeral::PrivacyUpdate,
    now_ms: i64,
) -> R<(Privacy, Option<u64>)> {
    let known: Option<i32> = scalar(c, "SELECT 1 FROM users WHERE user_id = $1", &[&user]).await?;
    if known.is_none() {
        return Err(StoreError::NotFound(format!("user {user}")));
    }
    crate::events::lock_user(c, user).await?;
    // The row lock orders concurrent updates of one user's switches.
    let row = query_opt(
        c,
        "SELECT hide_presence, private_receipts, push_preview, version FROM user_privacy WHERE user_id = $1 FOR UPDATE",
        &[&user],
    )
    .await?;
    let (now, version) = match row {
        None => (Privacy::default(), 0),
        Some(r) => (privacy_row(&r)?, seq(&r, 3)?),
    };
    let Some(next) = ephemeral::privacy_after(now, update) else {
        return Ok((now, None));
    };
    let version = version + 1;
    let v = version as i64;
    exec(
        c,
        "INSERT INTO user_privacy (user_id, hide_presence, private_receipts, push_preview, updated_at, version)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (user_id) DO UPDATE SET hide_presence = excluded.hide_presence,
             private_receipts = excluded.private_receipts, push_preview = excluded.push_preview,
             updated_at = excluded.updated_at, version = excluded.version",
        &[&user, &next.hide_presence, &next.private_receipts, &next.push_preview.as_str(), &now_ms, &v],
    )
    .await?;
    let data = tidemark_proto::content::PrivacyData::of(next, version);
    use tidemark_proto::content::Payload;
    let written = crate::events::append_user_event(
        c,
        user,
        EVENT_PRIVACY,
        "",
        None,
        &ephemeral::privacy_event_id(version),
        &data.to_json(),
        now_ms,
    )
    .await?;
    Ok((next, written))
}

pub(crate) async fn presence_audience(c: &Conn, user: &str, limit: u32) -> R<Vec<String>> {
    let limit = i64::from(limit);
    let rows = query(
        c,
        "SELECT DISTINCT o.user_id FROM membership_periods m
         JOIN membership_periods o ON o.conv_id = m.conv_id AND o.leave_seq IS NULL AND o.user_id <> $1
         WHERE m.user_id = $1 AND m.leave_seq IS NULL
         ORDER BY o.user_id LIMIT $2",
        &[&user, &limit],
    )
    .await?;
    rows.iter().map(|r| col::<String>(r, 0)).collect()
}

/// [`privacy`] and [`presence_audience`] in one statement (one snapshot):
/// a tagged row of switches (NULLs when never set), then the audience.
pub(crate) async fn presence_facts(c: &Conn, user: &str, limit: u32) -> R<(Privacy, Vec<String>)> {
    let limit = i64::from(limit);
    let rows = query(
        c,
        "SELECT 0, p.hide_presence, p.private_receipts, NULL::text, p.push_preview
         FROM (SELECT 1) x LEFT JOIN user_privacy p ON p.user_id = $1
         UNION ALL
         SELECT 1, NULL, NULL, a.user_id, NULL FROM (
             SELECT DISTINCT o.user_id FROM membership_periods m
             JOIN membership_periods o ON o.conv_id = m.conv_id AND o.leave_seq IS NULL AND o.user_id <> $1
             WHERE m.user_id = $1 AND m.leave_seq IS NULL
             ORDER BY o.user_id LIMIT $2) a",
        &[&user, &limit],
    )
    .await?;
    let mut privacy = Privacy::default();
    let mut audience = Vec::new();
    for r in &rows {
        if col::<i32>(r, 0)? == 0 {
            privacy = Privacy {
                hide_presence: col::<Option<bool>>(r, 1)?.unwrap_or(false),
                private_receipts: col::<Option<bool>>(r, 2)?.unwrap_or(false),
                push_preview: match col::<Option<String>>(r, 4)? {
                    None => Preview::PREFERENCE_DEFAULT,
                    Some(s) => {
                        Preview::parse(&s).ok_or_else(|| StoreError::Internal("an unknown push preview".into()))?
                    }
                },
            };
        } else {
            audience.push(col::<String>(r, 3)?);
        }
    }
    // Sorted as `presence_audience` answers, whatever order the arms of
    // the UNION come out in.
    audience.sort_unstable();
    Ok((privacy, audience))
}

async fn conversation_kind(c: &Conn, conv: &str) -> R<Option<String>> {
    scalar(c, "SELECT kind FROM conversations WHERE conv_id = $1", &[&conv]).await
}

pub(crate) async fn conv_receipts(c: &Conn, user: &str, conv: &str, at: Option<u64>) -> R<Receipts> {
    // One statement, so the members, their positions and their switches
    // are one snapshot.
    let rows = query(
        c,
        "SELECT mp.user_id, COALESCE(uc.read_seq, 0), COALESCE(p.private_receipts, FALSE)
         FROM membership_periods mp
         LEFT JOIN user_convs uc ON uc.user_id = mp.user_id AND uc.conv_id = mp.conv_id
         LEFT JOIN user_privacy p ON p.user_id = mp.user_id
         WHERE mp.conv_id = $1 AND mp.leave_seq IS NULL ORDER BY mp.user_id",
        &[&conv],
    )
    .await?;
    let members = rows
        .iter()
        .map(|r| Ok(MemberRead { user: col(r, 0)?, read_seq: seq(r, 1)?, private_receipts: col(r, 2)? }))
        .collect::<R<Vec<_>>>()?;
    // Whether the conversation exists matters only for a refusal.
    let exists = members.iter().any(|m| m.user == user) || conversation_kind(c, conv).await?.is_some();
    Ok(ephemeral::visible_receipts(conv, exists, user, members, at)?)
}

pub(crate) async fn delivery_receipts(
    c: &Conn,
    user: &str,
    conv: &str,
    ids: &[String],
) -> R<Vec<(String, Option<i64>)>> {
    tidemark_core::projection::check_delivery_ids(ids.len())?;
    let kind = conversation_kind(c, conv).await?;
    let caller_member: Option<i32> =
        scalar(c, "SELECT 1 FROM membership_periods WHERE conv_id = $1 AND user_id = $2 LIMIT 1", &[&conv, &user])
            .await?;
    let rows = query(
        c,
        "SELECT m.message_id, m.sender,
                (SELECT MIN(d.delivered_at) FROM membership_periods p
                 JOIN deliveries d ON d.user_id = p.user_id AND d.message_id = m.message_id
                 WHERE p.conv_id = m.conv_id AND p.user_id <> m.sender)
         FROM messages m WHERE m.conv_id = $1 AND m.message_id = ANY($2)",
        &[&conv, &ids],
    )
    .await?;
    let mut found: HashMap<String, (String, Option<i64>)> = HashMap::new();
    for r in &rows {
        found.insert(col(r, 0)?, (col(r, 1)?, col(r, 2)?));
    }
    let senders: Vec<(String, Option<String>)> =
        ids.iter().map(|id| (id.clone(), found.get(id).map(|(s, _)| s.clone()))).collect();
    let facts = DeliveryFacts { kind: kind.as_deref(), caller_member: caller_member.is_some(), senders: &senders };
    ephemeral::check_delivery_receipts(conv, user, &facts)?;
    Ok(ids.iter().map(|id| (id.clone(), found.get(id).and_then(|(_, at)| *at))).collect())
}
