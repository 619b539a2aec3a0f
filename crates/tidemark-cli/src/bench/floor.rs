//! `bench ingest`'s floor: the rows the storage design writes for one
//! message, in plain SQL on the server's own schema
//! (`tidemark_sqlite::schema::migrate`), on one thread, in transactions of
//! the server's requests per commit, with the server's pragmas. No network,
//! no JSON, no checks, no reads beyond the conversation's head: what is left
//! of a message once the protocol's work is taken away, which no server on
//! this design can beat. Its rate divided by the baseline's says how much of
//! the gap to the plain-insert baseline is the storage design (the accept's
//! message and outbox rows, a user-log event and a conversation row per
//! recipient (F2), the outbox row deleted, a head per user per batch), and
//! the server's rate divided by the floor's what the server spends beyond
//! it.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Result};
use rand::Rng;
use rusqlite::{params, TransactionBehavior};

use super::{commit_db, hex_id, in_fresh_dir, unix_ms, Commits, InsertRun, Topology, Traffic};

/// Runs the floor in a fresh database under `dir` (removed afterwards).
pub(super) fn floor_rate(dir: &Path, topo: &Topology, round: u32, messages: u64, batch: u64) -> Result<InsertRun> {
    in_fresh_dir(dir, |dir| floor_in(dir, topo, round, messages, batch))
}

fn floor_in(dir: &Path, topo: &Topology, round: u32, messages: u64, batch: u64) -> Result<InsertRun> {
    // The server's writer connection's pragmas (tidemark-sqlite `configure`
    // and `SqliteStore::open`).
    let mut conn = commit_db(&dir.join("floor.db"))?;
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    conn.set_prepared_statement_cache_capacity(tidemark_sqlite::STATEMENT_CACHE_CAPACITY);
    tidemark_sqlite::schema::migrate(&conn).map_err(|e| anyhow::anyhow!("schema: {e}"))?;

    let mut rng = rand::rng();
    let now = unix_ms();
    let conv_ids: Vec<String> = topo.convs.iter().map(|_| hex_id("c", &mut rng)).collect();
    {
        let tx = conn.transaction()?;
        for id in &conv_ids {
            tx.execute(
                "INSERT INTO conversations (conv_id, kind, head, epoch, created_at) VALUES (?1, 'direct', 0, 1, ?2)",
                params![id, now],
            )?;
        }
        tx.commit()?;
    }
    let data: Vec<Traffic> = topo.traffic(round, messages).collect();

    let mut commits = Commits::default();
    let mut heads: BTreeMap<usize, i64> = BTreeMap::new();
    let start = Instant::now();
    for chunk in data.chunks(batch as usize) {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let now = unix_ms();
        // The accepts: the conversation's next msg_seq, the message, its
        // outbox row.
        let mut accepted = Vec::with_capacity(chunk.len());
        for m in chunk {
            let id = tidemark_core::ids::message_id(now, rng.random());
            let seq: i64 = tx
                .prepare_cached("UPDATE conversations SET head = head + 1 WHERE conv_id = ?1 RETURNING head")?
                .query_row(params![conv_ids[m.conv]], |r| r.get(0))?;
            tx.prepare_cached(
                "INSERT INTO messages (message_id, conv_id, msg_seq, sender, sender_device, client_msg_id, kind, content,
                                       state, version, target_id, quote_id, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'text', ?7, 'normal', 1, NULL, NULL, ?8)",
            )?
            .execute(params![
                id,
                conv_ids[m.conv],
                seq,
                topo.users[m.user],
                Topology::device(m.index),
                m.client_msg_id,
                m.content,
                now
            ])?;
            let outbox_id: i64 = tx
                .prepare_cached(
                    "INSERT INTO outbox (kind, source_event_id, conv_id, msg_seq, actor, created_at)
                     VALUES ('message', ?1, ?2, ?3, ?4, ?5) RETURNING outbox_id",
                )?
                .query_row(params![id, conv_ids[m.conv], seq, topo.users[m.user], now], |r| r.get(0))?;
            accepted.push((m, id, seq, outbox_id));
        }
        // The fan-out in the same transaction (the fused fan-out): per
        // recipient its next sync_seq, the event and the conversation row;
        // the outbox row deleted; each head written once.
        let mut advanced: BTreeMap<usize, i64> = BTreeMap::new();
        for (m, id, seq, outbox_id) in &accepted {
            let (a, b) = topo.convs[m.conv];
            for user in [a, b] {
                let next = advanced.get(&user).or(heads.get(&user)).copied().unwrap_or(0) + 1;
                advanced.insert(user, next);
                tx.prepare_cached(
                    "INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id,
                                              period_id, created_at)
                     VALUES (?1, ?2, 'message', ?3, ?4, ?5, ?5, ?6, ?7)
                     ON CONFLICT (user_id, source_event_id, period_id) DO NOTHING",
                )?
                .execute(params![
                    topo.users[user],
                    next,
                    conv_ids[m.conv],
                    seq,
                    id,
                    user as i64 + 1,
                    now
                ])?;
                let own = user == m.user;
                tx.prepare_cached(
                    "INSERT INTO user_convs (user_id, conv_id, last_msg_seq, read_seq, unread)
                     VALUES (?1, ?2, ?3, CASE WHEN ?4 THEN ?3 ELSE 0 END, CASE WHEN ?4 THEN 0 ELSE 1 END)
                     ON CONFLICT(user_id, conv_id) DO UPDATE SET
                        last_msg_seq = MAX(last_msg_seq, ?3),
                        read_seq = CASE WHEN ?4 THEN MAX(read_seq, ?3) ELSE read_seq END,
                        unread = unread + CASE WHEN NOT ?4 AND ?3 > read_seq AND ?3 > last_msg_seq THEN 1 ELSE 0 END",
                )?
                .execute(params![topo.users[user], conv_ids[m.conv], seq, own])?;
            }
            tx.prepare_cached("DELETE FROM outbox WHERE outbox_id = ?1")?.execute(params![outbox_id])?;
        }
        for (user, head) in advanced {
            tx.prepare_cached(
                "INSERT INTO user_heads (user_id, high_watermark) VALUES (?1, ?2)
                 ON CONFLICT(user_id) DO UPDATE SET high_watermark = excluded.high_watermark",
            )?
            .execute(params![topo.users[user], head])?;
            heads.insert(user, head);
        }
        tx.commit()?;
        commits.committed(&conn)?;
    }
    let run = commits.run(messages, batch, start.elapsed().as_secs_f64());
    let events: i64 = conn.query_row("SELECT COUNT(*) FROM user_events", [], |r| r.get(0))?;
    ensure!(events as u64 == 2 * messages, "floor wrote {events} events for {messages} messages");
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::Connection;

    /// The floor writes what a server would for the same traffic: every
    /// message with contiguous msg_seq per conversation, two events per
    /// message with contiguous sync_seq per user and heads that match, an
    /// empty outbox; and its SQL still fits the server's schema.
    #[test]
    fn the_floor_writes_a_servers_rows_on_the_servers_schema() {
        let dir = super::super::TempDir::create(&std::env::temp_dir()).unwrap();
        let topo = Topology::new(6, 3);
        let run = floor_in(&dir.0, &topo, 1, 60, 7).unwrap();
        assert_eq!((run.rows, run.commits), (60, 9));
        let c = Connection::open(dir.0.join("floor.db")).unwrap();
        let one = |sql: &str| c.query_row(sql, [], |r| r.get::<_, i64>(0)).unwrap();
        assert_eq!(one("SELECT COUNT(*) FROM messages"), 60);
        assert_eq!(one("SELECT COUNT(*) FROM outbox"), 0);
        assert_eq!(one("SELECT SUM(head) FROM conversations"), 60);
        assert_eq!(
            one("SELECT COUNT(*) FROM (SELECT conv_id FROM messages GROUP BY conv_id HAVING MAX(msg_seq) <> COUNT(*))"),
            0
        );
        assert_eq!(one("SELECT COUNT(*) FROM user_events"), 120);
        assert_eq!(
            one("SELECT COUNT(*) FROM user_heads h WHERE h.high_watermark <>
                 (SELECT COUNT(*) FROM user_events e WHERE e.user_id = h.user_id)"),
            0
        );
        assert_eq!(one("SELECT SUM(high_watermark) FROM user_heads"), 120);
        assert_eq!(one("SELECT SUM(unread) FROM user_convs"), 60, "each message is unread for its one peer");
    }
}
