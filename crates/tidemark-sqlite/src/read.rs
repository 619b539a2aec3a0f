//! Reads: a small pool of read-only connections used from blocking tasks.
//! Each read sees the last committed state; readers never block the writer.

use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension};
use tidemark_store::*;
use tokio::sync::Semaphore;

use crate::internal;

pub(crate) struct ReadPool {
    pub(crate) conns: Mutex<Vec<Connection>>,
    pub(crate) permits: Semaphore,
}

impl ReadPool {
    /// Runs `f` on a pooled read connection off the async threads.
    pub(crate) async fn read_store<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        let _permit = self.permits.acquire().await.map_err(|_| StoreError::Unavailable("read pool closed".into()))?;
        let conn = self.conns.lock().expect("read pool lock").pop().expect("a permit guarantees a connection");
        let (conn, result) = tokio::task::spawn_blocking(move || {
            let r = f(&conn);
            (conn, r)
        })
        .await
        .map_err(|e| StoreError::Internal(format!("read task: {e}")))?;
        self.conns.lock().expect("read pool lock").push(conn);
        result
    }

    pub(crate) async fn read<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        self.read_store(move |c| f(c).map_err(internal)).await
    }
}

pub(crate) fn conversation(c: &Connection, conv: &str) -> StoreResult<Option<Conversation>> {
    let row = c
        .prepare_cached("SELECT kind, head FROM conversations WHERE conv_id = ?1")
        .map_err(internal)?
        .query_row(params![conv], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .optional()
        .map_err(internal)?;
    let Some((kind, head)) = row else {
        return Ok(None);
    };
    let mut stmt = c
        .prepare_cached(
            "SELECT user_id FROM membership_periods WHERE conv_id = ?1 AND leave_seq IS NULL ORDER BY user_id",
        )
        .map_err(internal)?;
    let members = stmt
        .query_map(params![conv], |r| r.get(0))
        .map_err(internal)?
        .collect::<Result<Vec<String>, _>>()
        .map_err(internal)?;
    Ok(Some(Conversation { conv: conv.into(), kind, members, head: head as u64 }))
}

pub(crate) fn list_conversations(c: &Connection, user: &str) -> StoreResult<Vec<ConvState>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT uc.conv_id, c.kind, uc.last_msg_seq, uc.read_seq, uc.unread
             FROM user_convs uc JOIN conversations c ON c.conv_id = uc.conv_id
             WHERE uc.user_id = ?1 ORDER BY uc.last_msg_seq DESC, uc.conv_id",
        )
        .map_err(internal)?;
    let rows = stmt
        .query_map(params![user], |r| {
            Ok(ConvState {
                conv: r.get(0)?,
                kind: r.get(1)?,
                last_msg_seq: r.get::<_, i64>(2)? as u64,
                read_seq: r.get::<_, i64>(3)? as u64,
                unread: r.get::<_, i64>(4)? as u64,
            })
        })
        .map_err(internal)?;
    rows.collect::<Result<Vec<_>, _>>().map_err(internal)
}

pub(crate) fn pending_outbox(c: &Connection, limit: u32) -> StoreResult<Vec<OutboxItem>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT outbox_id, kind, source_event_id, conv_id, msg_seq, actor, created_at
             FROM outbox ORDER BY outbox_id LIMIT ?1",
        )
        .map_err(internal)?;
    let rows = stmt
        .query_map(params![limit], |r| {
            Ok(OutboxItem {
                outbox_id: r.get(0)?,
                kind: r.get(1)?,
                source_event_id: r.get(2)?,
                conv: r.get(3)?,
                msg_seq: r.get::<_, i64>(4)? as u64,
                actor: r.get(5)?,
                created_at_ms: r.get(6)?,
            })
        })
        .map_err(internal)?;
    rows.collect::<Result<Vec<_>, _>>().map_err(internal)
}

pub(crate) fn user_events(
    c: &Connection,
    user: &str,
    after: u64,
    upto: u64,
    limit: u32,
) -> StoreResult<Vec<StoredEvent>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT e.sync_seq, e.kind, e.conv_id, e.msg_seq,
                    m.message_id, m.msg_seq, m.kind, m.state, m.sender, m.content, m.created_at
             FROM user_events e LEFT JOIN messages m ON m.message_id = e.message_id
             WHERE e.user_id = ?1 AND e.sync_seq > ?2 AND e.sync_seq <= ?3
             ORDER BY e.sync_seq LIMIT ?4",
        )
        .map_err(internal)?;
    let rows = stmt
        .query_map(params![user, after as i64, upto as i64, limit], |r| {
            let conv: String = r.get(2)?;
            let message = match r.get::<_, Option<String>>(4)? {
                None => None,
                Some(message_id) => Some(StoredMessage {
                    message_id,
                    conv: conv.clone(),
                    msg_seq: r.get::<_, i64>(5)? as u64,
                    kind: r.get(6)?,
                    state: r.get(7)?,
                    sender: r.get(8)?,
                    content: r.get(9)?,
                    created_at_ms: r.get(10)?,
                }),
            };
            Ok(StoredEvent {
                sync_seq: r.get::<_, i64>(0)? as u64,
                kind: r.get(1)?,
                conv,
                msg_seq: r.get::<_, Option<i64>>(3)?.map(|v| v as u64),
                message,
            })
        })
        .map_err(internal)?;
    let events = rows.collect::<Result<Vec<_>, _>>().map_err(internal)?;
    // Assert on our side of the storage boundary: a page is ascending and
    // inside the requested range.
    let mut prev = after;
    for e in &events {
        assert!(e.sync_seq > prev && e.sync_seq <= upto, "user log page out of order or range");
        prev = e.sync_seq;
    }
    Ok(events)
}
