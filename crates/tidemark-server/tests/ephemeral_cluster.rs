//! The ephemeral lane across two nodes (issue 18): two servers in this
//! process on one PostgreSQL database (a fresh schema, dropped at the end)
//! and one NATS server (a subject prefix of its own). Typing and presence
//! of a user connected to node A reach a user connected to node B over the
//! hint bus, typing's expiry stop too, and a user still connected to B is
//! announced again when A says it went offline.
//!
//! The services come from `TIDEMARK_TEST_PG_URL` and
//! `TIDEMARK_TEST_NATS_URL`; the test skips, saying so, only when one is
//! unset.

mod common;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_client::proto::PresenceFrame;
use tidemark_client::{Http, ServerEvent, WsConn};
use tidemark_postgres::{PgConfig, PgStore};
use tidemark_server::config::HintBusConfig;
use tidemark_server::{RunningServer, Server, ServerConfig};
use tokio::sync::mpsc;

const ADMIN: &str = "cluster-admin";
const PASSWORD: &str = "correct horse";
const ARRIVES_WITHIN: Duration = Duration::from_secs(10);

fn services() -> Option<(String, String)> {
    let mut urls = Vec::new();
    for var in ["TIDEMARK_TEST_PG_URL", "TIDEMARK_TEST_NATS_URL"] {
        match std::env::var(var) {
            Ok(url) if !url.is_empty() => urls.push(url),
            _ => {
                println!("SKIPPED ephemeral_cluster: {var} is not set");
                return None;
            }
        }
    }
    Some((urls[0].clone(), urls[1].clone()))
}

async fn node(pg: &str, schema: &str, nats: &str, prefix: &str) -> RunningServer {
    let store = PgStore::open(PgConfig { schema: Some(schema.into()), ..PgConfig::new(pg) }).await.unwrap();
    let config = ServerConfig {
        admin_token: Some(ADMIN.into()),
        hint_bus: HintBusConfig::Nats { url: nats.into(), subject_prefix: prefix.into() },
        ..ServerConfig::default()
    };
    Server::start("127.0.0.1:0", store as Arc<dyn tidemark_store::Store>, config).await.unwrap()
}

/// A schema and a NATS subject prefix of this test's own.
fn unique(tag: &str) -> (String, String) {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let id = std::process::id();
    (format!("t_{tag}_{id}_{nanos}"), format!("test.{tag}{id}x{nanos}"))
}

/// Creates ann and ben through `server`.
async fn ann_and_ben(server: &RunningServer) {
    let http = Http::new(&server.url());
    for u in ["ann", "ben"] {
        assert!(http.create_user(ADMIN, u, PASSWORD).await.unwrap().created);
    }
}

/// A session of its own that opens a transaction and locks `user_privacy`
/// in `schema`: every read of it waits until the session says `COMMIT`.
async fn lock_user_privacy(pg: &str, schema: &str) -> tokio_postgres::Client {
    let (locker, conn) = tokio_postgres::connect(pg, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    locker.batch_execute(&format!("BEGIN; LOCK TABLE {schema}.user_privacy IN ACCESS EXCLUSIVE MODE")).await.unwrap();
    locker
}

/// The sessions (pids) waiting on a lock `lock` holds, of every node or,
/// with `app`, only those whose `application_name` it is. `lock` is inside
/// the transaction that holds the lock, and PostgreSQL keeps one snapshot
/// of `pg_stat_activity` per transaction, so each look clears it first;
/// otherwise a poll would see the sessions as they were at its first look.
async fn waiting_on(lock: &tokio_postgres::Client, app: Option<&str>) -> Vec<i32> {
    waiting_with(lock, app, None).await
}

/// [`waiting_on`], counting only the sessions whose statement starts with
/// `query` when it is given.
async fn waiting_with(lock: &tokio_postgres::Client, app: Option<&str>, query: Option<&str>) -> Vec<i32> {
    lock.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
    let rows = lock
        .query(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'
             AND pg_blocking_pids(pid) @> ARRAY[pg_backend_pid()] AND ($1::text IS NULL OR application_name = $1)
             AND ($2::text IS NULL OR starts_with(query, $2))",
            &[&app, &query],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// The statement of a user's privacy read (`Store::privacy` on PostgreSQL),
/// which a re-read after another node's announcement runs.
const PRIVACY_READ: &str = "SELECT hide_presence, private_receipts, push_preview FROM user_privacy WHERE user_id";

async fn drop_schema(pg: &str, schema: &str) {
    let (client, conn) = tokio_postgres::connect(pg, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await.unwrap();
}

async fn connect(server: &RunningServer, user: &str, device: &str) -> (WsConn, mpsc::Receiver<ServerEvent>) {
    let login = Http::new(&server.url()).login(user, PASSWORD, device).await.unwrap();
    let (ws, events) = WsConn::connect(&format!("ws://{}/v1/ws", server.addr), &login.access_token).await.unwrap();
    ws.request_value("ping", json!({})).await.unwrap();
    (ws, events)
}

/// Ephemeral events until one matches (included); panics after the bound.
async fn until(
    events: &mut mpsc::Receiver<ServerEvent>,
    what: &str,
    f: impl Fn(&ServerEvent) -> bool,
) -> Vec<ServerEvent> {
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    let mut seen = Vec::new();
    loop {
        let ev = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap_or_else(|_| panic!("no {what} within {ARRIVES_WITHIN:?}; saw {seen:?}"))
            .unwrap_or_else(|| panic!("connection ended waiting for {what}"));
        let done = f(&ev);
        if !matches!(ev, ServerEvent::Hint { .. }) {
            seen.push(ev);
        }
        if done {
            return seen;
        }
    }
}

fn presence(ev: &ServerEvent, user: &str, state: &str) -> bool {
    matches!(ev, ServerEvent::Presence(PresenceFrame { user: u, state: s, .. }) if u == user && s == state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typing_and_presence_cross_nodes_over_the_hint_bus() {
    let Some((pg, nats)) = services() else { return };
    let (schema, prefix) = unique("eph");
    let a = node(&pg, &schema, &nats, &prefix).await;
    let b = node(&pg, &schema, &nats, &prefix).await;
    ann_and_ben(&a).await;
    let (ben, mut ben_events) = connect(&b, "ben", "phone").await;
    let conv = ben.conv_create_direct("ann").await.unwrap().conv;

    // ann connects to node A: ben, on B, sees her online; ann hears ben's
    // answer, which B sent over the bus.
    let (ann, mut ann_events) = connect(&a, "ann", "phone").await;
    until(&mut ben_events, "ann online from node A", |e| presence(e, "ann", "online")).await;
    until(&mut ann_events, "ben's answer from node B", |e| presence(e, "ben", "online")).await;

    // Typing through A reaches B, and A's sweep stops it on B too.
    let ok = ann.request_value("typing", json!({"conv": conv, "typing": true, "timeout_ms": 300})).await.unwrap();
    assert_eq!(ok["t"], "typing.ok", "{ok}");
    let typing =
        |on: bool| move |e: &ServerEvent| matches!(e, ServerEvent::Typing(t) if t.user == "ann" && t.typing == on);
    until(&mut ben_events, "ann typing across nodes", typing(true)).await;
    until(&mut ben_events, "ann's typing to expire across nodes", typing(false)).await;

    // ann also on B, then A's connection closes: A says offline, B says
    // online again, so ben ends up seeing her online.
    let (_ann_b, _ann_b_events) = connect(&b, "ann", "desk").await;
    // B announces its own connection of ann first (B had announced nothing).
    until(&mut ben_events, "ann online from node B", |e| presence(e, "ann", "online")).await;
    ann.close().await;
    // A's "offline" and B's answer to it may coalesce in ben's slot; what
    // must arrive is B's "online" after the close (without it ben would be
    // left with A's "offline" and this wait would fail).
    until(&mut ben_events, "ann shown again by node B", |e| presence(e, "ann", "online")).await;
    let _: Value = ben.request_value("ping", json!({})).await.unwrap();

    a.stop().await;
    b.stop().await;
    drop_schema(&pg, &schema).await;
}

/// A connect whose presence facts PostgreSQL cannot read for a moment is
/// still announced: the read is made again after a wait
/// (`core::ephemeral::presence_read_retry`). In a resume storm the read pool
/// runs dry and such reads fail `Unavailable`; before the retry, the user was
/// then never shown online (issue 14). The failure here is a real one: the
/// test holds `user_privacy` locked and cancels the reads waiting on it
/// (`QUERY_CANCELED`, which the store answers `Unavailable`) until the node
/// counts a presence read to make again, then lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_whose_presence_read_fails_for_a_moment_is_still_announced() {
    let Some((pg, nats)) = services() else { return };
    let (schema, prefix) = unique("ephr");
    let a = node(&pg, &schema, &nats, &prefix).await;
    ann_and_ben(&a).await;
    let (ben, mut ben_events) = connect(&a, "ben", "phone").await;
    ben.conv_create_direct("ann").await.unwrap();
    let login = Http::new(&a.url()).login("ann", PASSWORD, "phone").await.unwrap();

    let lock = lock_user_privacy(&pg, &schema).await;
    let (_ann, mut ann_events) = WsConn::connect(&format!("ws://{}/v1/ws", a.addr), &login.access_token).await.unwrap();

    // Bounded polling: every read waiting on the lock is cancelled (it
    // fails) until the node counts a presence read it will make again.
    // (A read can wait while its statement is still being prepared, when
    // `pg_stat_activity` does not show its text yet: hence no filter on it;
    // another read of `user_privacy` cancelled on the way is retried by its
    // own caller.)
    let retried = || async {
        let e = common::exposition::scrape_url(&a.url()).await;
        e.value("tidemark_presence_reads_failed_total", &[("outcome", "retried")])
    };
    common::eventually("a presence read failed and was made again", ARRIVES_WITHIN, || async {
        if retried().await >= 1.0 {
            return true;
        }
        for pid in waiting_on(&lock, None).await {
            lock.execute("SELECT pg_cancel_backend($1)", &[&pid]).await.unwrap();
        }
        false
    })
    .await;
    lock.batch_execute("COMMIT").await.unwrap();

    // Read again after its wait: ben sees ann online and ann hears ben.
    until(&mut ben_events, "ann online after a failed presence read", |e| presence(e, "ann", "online")).await;
    until(&mut ann_events, "ben's answer after a failed presence read", |e| presence(e, "ben", "online")).await;

    a.stop().await;
    drop_schema(&pg, &schema).await;
}

/// What arrives on the bus behind a presence announcement does not wait on
/// the store read that announcement sets off. When node A announces a user
/// also connected to node B, B reads the user's privacy again; that read
/// runs off B's bus subscriber, so a typing signal published right after
/// reaches B's connections while the read is still held up (here by a lock
/// on `user_privacy`; in a storm by a read pool run dry, up to its 5 s
/// wait). Before, the subscriber awaited the read, and everything behind
/// it on the bus (kicks included) waited too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bus_does_not_wait_on_the_privacy_read_an_announcement_sets_off() {
    let Some((pg, nats)) = services() else { return };
    let (schema, prefix) = unique("ephb");
    let a = node(&pg, &schema, &nats, &prefix).await;
    let b = node(&pg, &schema, &nats, &prefix).await;
    ann_and_ben(&a).await;
    let (ben, mut ben_events) = connect(&b, "ben", "phone").await;
    let conv = ben.conv_create_direct("ann").await.unwrap().conv;
    let (ann_a, _ann_a_events) = connect(&a, "ann", "phone").await;
    let (_ann_b, _ann_b_events) = connect(&b, "ann", "desk").await;
    until(&mut ben_events, "ann online", |e| presence(e, "ann", "online")).await;

    let lock = lock_user_privacy(&pg, &schema).await;
    // A announces ann idle (its one connection of her); B hears it about a
    // user it holds, and reads her privacy: that read waits on the lock.
    let ok = ann_a.request_value("presence.set", json!({"state": "idle"})).await.unwrap();
    assert_eq!(ok["t"], "presence.set.ok", "{ok}");
    let waits = || async { !waiting_on(&lock, None).await.is_empty() };
    common::eventually("a privacy read waited on the lock", ARRIVES_WITHIN, waits).await;
    // Typing published by A after the announcement reaches ben on B while
    // the read still waits (the lock is held until after it arrives).
    let ok = ann_a.request_value("typing", json!({"conv": conv, "typing": true})).await.unwrap();
    assert_eq!(ok["t"], "typing.ok", "{ok}");
    until(
        &mut ben_events,
        "ann typing while B's privacy read waits",
        |e| matches!(e, ServerEvent::Typing(t) if t.user == "ann" && t.typing),
    )
    .await;
    assert!(waits().await, "the read was still waiting");
    lock.batch_execute("COMMIT").await.unwrap();

    a.stop().await;
    b.stop().await;
    drop_schema(&pg, &schema).await;
}

/// Announcements of a user by another node while this node's re-read of
/// her privacy waits fold into it: one re-read per user at a time, then one
/// more for everything announced meanwhile, not one read each (each held a
/// read connection: in a storm of announcements about the users a node
/// holds, a pool's worth of reads could wait at once). Here B's read of
/// ann's privacy waits on a lock of `user_privacy` while node A announces
/// her six times (each seen by ben on B, so B has heard it): one read
/// waits, five announcements were folded. Once the lock goes, B still
/// follows A: A saying ann offline makes B show her online again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcements_while_a_privacy_read_waits_fold_into_one_more_read() {
    let Some((pg, nats)) = services() else { return };
    let (schema, prefix) = unique("ephf");
    let a = node(&pg, &schema, &nats, &prefix).await;
    // B's sessions carry a name of their own, so only B's reads are counted
    // (A re-reads ann's privacy too when B announces her, before the lock).
    let b_name = format!("{schema}_b");
    let sep = if pg.contains('?') { '&' } else { '?' };
    let b = node(&format!("{pg}{sep}application_name={b_name}"), &schema, &nats, &prefix).await;
    ann_and_ben(&a).await;
    let (ben, mut ben_events) = connect(&b, "ben", "phone").await;
    ben.conv_create_direct("ann").await.unwrap();
    let (ann_a, _ann_a_events) = connect(&a, "ann", "phone").await;
    let (_ann_b, _ann_b_events) = connect(&b, "ann", "desk").await;
    until(&mut ben_events, "ann online", |e| presence(e, "ann", "online")).await;

    let lock = lock_user_privacy(&pg, &schema).await;
    // Only the privacy re-reads count: under load, B's own reads for the
    // connections opened above (their presence facts join `user_privacy`)
    // can still be running when the lock is taken, and wait on it too.
    let waiting_now = || async { waiting_with(&lock, Some(&b_name), Some(PRIVACY_READ)).await.len() };
    for state in ["idle", "online", "idle", "online", "idle", "online"] {
        let ok = ann_a.request_value("presence.set", json!({"state": state})).await.unwrap();
        assert_eq!(ok["t"], "presence.set.ok", "{ok}");
        until(&mut ben_events, "A's announcement on B", |e| presence(e, "ann", state)).await;
    }
    common::eventually("B's privacy read waited on the lock", ARRIVES_WITHIN, || async { waiting_now().await > 0 })
        .await;
    assert_eq!(waiting_now().await, 1, "one re-read of ann's privacy waits on B, not one per announcement");
    let folded = common::exposition::scrape_url(&b.url()).await.value("tidemark_presence_rereads_coalesced_total", &[]);
    assert_eq!(folded, 5.0, "the five announcements after the first were folded into the waiting read");
    lock.batch_execute("COMMIT").await.unwrap();

    // The folded announcements were read once more after the lock went;
    // then nothing runs for ann, and the next announcement starts afresh.
    ann_a.close().await;
    until(&mut ben_events, "A's offline on B", |e| presence(e, "ann", "offline")).await;
    until(&mut ben_events, "ann shown again by node B", |e| presence(e, "ann", "online")).await;

    a.stop().await;
    b.stop().await;
    drop_schema(&pg, &schema).await;
}
