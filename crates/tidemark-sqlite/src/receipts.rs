//! Privacy switches, the presence audience and receipts shown to others
//! (issue 18): the SQL only. What is shown to whom is decided by
//! `tidemark_core::ephemeral` on the facts read here.

use std::rc::Rc;

use rusqlite::types::Value;
use rusqlite::vtab::array::Array;
use rusqlite::{params, Connection, OptionalExtension};
use tidemark_core::ephemeral::{self, DeliveryFacts, MemberRead};
use tidemark_store::*;

use crate::internal;

type R<T> = StoreResult<T>;

pub(crate) fn privacy(c: &Connection, user: &str) -> R<Privacy> {
    c.prepare_cached("SELECT hide_presence, private_receipts, push_preview FROM user_privacy WHERE user_id = ?1")
        .map_err(internal)?
        .query_row(params![user], |r| {
            Ok(Privacy {
                hide_presence: r.get(0)?,
                private_receipts: r.get(1)?,
                push_preview: crate::push::preview_col(r, 2)?,
            })
        })
        .optional()
        .map_err(internal)
        .map(Option::unwrap_or_default)
}

/// The switches and their version (0: never changed), as the snapshot
/// view reads them.
pub(crate) fn privacy_versioned(c: &Connection, user: &str) -> R<(Privacy, u64)> {
    let version: Option<i64> = c
        .prepare_cached("SELECT version FROM user_privacy WHERE user_id = ?1")
        .map_err(internal)?
        .query_row(params![user], |r| r.get(0))
        .optional()
        .map_err(internal)?;
    Ok((privacy(c, user)?, version.unwrap_or(0) as u64))
}

/// A change of the switches is written with its `privacy` user event in
/// the user's own log (one writer transaction); a no-op writes neither.
pub(crate) fn set_privacy(
    c: &Connection,
    user: &str,
    update: ephemeral::PrivacyUpdate,
    now_ms: i64,
) -> R<(Privacy, Option<u64>)> {
    let known: Option<i64> = c
        .prepare_cached("SELECT 1 FROM users WHERE user_id = ?1")
        .map_err(internal)?
        .query_row(params![user], |r| r.get(0))
        .optional()
        .map_err(internal)?;
    if known.is_none() {
        return Err(StoreError::NotFound(format!("user {user}")));
    }
    let (now, version) = privacy_versioned(c, user)?;
    let Some(next) = ephemeral::privacy_after(now, update) else {
        return Ok((now, None));
    };
    let version = version + 1;
    c.prepare_cached(
        "INSERT INTO user_privacy (user_id, hide_presence, private_receipts, push_preview, updated_at, version)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT(user_id) DO UPDATE SET hide_presence = excluded.hide_presence,
             private_receipts = excluded.private_receipts, push_preview = excluded.push_preview,
             updated_at = excluded.updated_at, version = excluded.version",
    )
    .map_err(internal)?
    .execute(params![
        user,
        next.hide_presence,
        next.private_receipts,
        next.push_preview.as_str(),
        now_ms,
        version as i64
    ])
    .map_err(internal)?;
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
    )?;
    Ok((next, written))
}

pub(crate) fn presence_audience(c: &Connection, user: &str, limit: u32) -> R<Vec<String>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT DISTINCT o.user_id FROM membership_periods m
             JOIN membership_periods o ON o.conv_id = m.conv_id AND o.leave_seq IS NULL AND o.user_id <> ?1
             WHERE m.user_id = ?1 AND m.leave_seq IS NULL
             ORDER BY o.user_id LIMIT ?2 + 0",
        )
        .map_err(internal)?;
    let rows = stmt.query_map(params![user, limit], |r| r.get(0)).map_err(internal)?;
    rows.collect::<Result<_, _>>().map_err(internal)
}

/// [`privacy`] and [`presence_audience`] in one statement (one snapshot):
/// a tagged row of switches (NULLs when never set), then the audience.
pub(crate) fn presence_facts(c: &Connection, user: &str, limit: u32) -> R<(Privacy, Vec<String>)> {
    let mut stmt = c
        .prepare_cached(
            "SELECT 0, p.hide_presence, p.private_receipts, p.push_preview
             FROM (SELECT 1) LEFT JOIN user_privacy p ON p.user_id = ?1
             UNION ALL
             SELECT 1, NULL, NULL, a.user_id FROM (
                 SELECT DISTINCT o.user_id FROM membership_periods m
                 JOIN membership_periods o ON o.conv_id = m.conv_id AND o.leave_seq IS NULL AND o.user_id <> ?1
                 WHERE m.user_id = ?1 AND m.leave_seq IS NULL
                 ORDER BY o.user_id LIMIT ?2 + 0) a",
        )
        .map_err(internal)?;
    let rows = stmt
        .query_map(params![user, limit], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, Option<bool>>(1)?, r.get::<_, Option<bool>>(2)?, r.get(3)?))
        })
        .map_err(internal)?;
    let mut privacy = Privacy::default();
    let mut audience = Vec::new();
    for row in rows {
        match row.map_err(internal)? {
            (0, hide, private, preview) => {
                privacy = Privacy {
                    hide_presence: hide.unwrap_or(false),
                    private_receipts: private.unwrap_or(false),
                    push_preview: preview
                        .as_deref()
                        .map_or(Some(Preview::PREFERENCE_DEFAULT), Preview::parse)
                        .ok_or_else(|| StoreError::Internal("an unknown push preview".into()))?,
                }
            }
            (_, _, _, Some(u)) => audience.push(u),
            (_, _, _, None) => return Err(StoreError::Internal("an audience row without a user".into())),
        }
    }
    // Sorted as `presence_audience` answers, whatever order the compound
    // statement's arms come out in.
    audience.sort_unstable();
    Ok((privacy, audience))
}

fn conversation_kind(c: &Connection, conv: &str) -> R<Option<String>> {
    c.prepare_cached("SELECT kind FROM conversations WHERE conv_id = ?1")
        .map_err(internal)?
        .query_row(params![conv], |r| r.get(0))
        .optional()
        .map_err(internal)
}

pub(crate) fn conv_receipts(c: &Connection, user: &str, conv: &str, at: Option<u64>) -> R<Receipts> {
    // One statement, so the members, their positions and their switches
    // are one snapshot.
    let members: Vec<MemberRead> = {
        let mut stmt = c
            .prepare_cached(
                "SELECT mp.user_id, COALESCE(uc.read_seq, 0), COALESCE(p.private_receipts, 0)
                 FROM membership_periods mp
                 LEFT JOIN user_convs uc ON uc.user_id = mp.user_id AND uc.conv_id = mp.conv_id
                 LEFT JOIN user_privacy p ON p.user_id = mp.user_id
                 WHERE mp.conv_id = ?1 AND mp.leave_seq IS NULL ORDER BY mp.user_id",
            )
            .map_err(internal)?;
        let rows = stmt
            .query_map(params![conv], |r| {
                Ok(MemberRead { user: r.get(0)?, read_seq: r.get::<_, i64>(1)? as u64, private_receipts: r.get(2)? })
            })
            .map_err(internal)?;
        rows.collect::<Result<_, _>>().map_err(internal)?
    };
    // Whether the conversation exists matters only for a refusal.
    let exists = members.iter().any(|m| m.user == user) || conversation_kind(c, conv)?.is_some();
    Ok(ephemeral::visible_receipts(conv, exists, user, members, at)?)
}

pub(crate) fn delivery_receipts(
    c: &Connection,
    user: &str,
    conv: &str,
    ids: &[String],
) -> R<Vec<(String, Option<i64>)>> {
    tidemark_core::projection::check_delivery_ids(ids.len())?;
    let kind = conversation_kind(c, conv)?;
    let caller_member: Option<i64> = c
        .prepare_cached("SELECT 1 FROM membership_periods WHERE conv_id = ?1 AND user_id = ?2 LIMIT 1")
        .map_err(internal)?
        .query_row(params![conv, user], |r| r.get(0))
        .optional()
        .map_err(internal)?;
    let list: Array = Rc::new(ids.iter().cloned().map(Value::from).collect());
    let found: std::collections::HashMap<String, (String, Option<i64>)> = {
        let mut stmt = c
            .prepare_cached(
                "SELECT m.message_id, m.sender,
                        (SELECT MIN(d.delivered_at) FROM membership_periods p
                         JOIN deliveries d ON d.user_id = p.user_id AND d.message_id = m.message_id
                         WHERE p.conv_id = m.conv_id AND p.user_id <> m.sender)
                 FROM messages m WHERE m.conv_id = ?1 AND m.message_id IN rarray(?2)",
            )
            .map_err(internal)?;
        let rows =
            stmt.query_map(params![conv, list], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?)))).map_err(internal)?;
        rows.collect::<Result<_, _>>().map_err(internal)?
    };
    let senders: Vec<(String, Option<String>)> =
        ids.iter().map(|id| (id.clone(), found.get(id).map(|(s, _)| s.clone()))).collect();
    let facts = DeliveryFacts { kind: kind.as_deref(), caller_member: caller_member.is_some(), senders: &senders };
    ephemeral::check_delivery_receipts(conv, user, &facts)?;
    Ok(ids.iter().map(|id| (id.clone(), found.get(id).and_then(|(_, at)| *at))).collect())
}
