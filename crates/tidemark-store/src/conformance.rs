//! The conformance suite every backend must pass: the same checks, the same
//! meaning, whatever the database. A backend's tests call [`run_all`] and
//! [`run_rules`] (or each check) with a fresh, empty store. Checks panic with a message that
//! names the broken requirement.

use std::sync::Arc;

use tidemark_core::cursor::{AckDecision, DeviceCursor, DeviceState};

use crate::*;

const T0: i64 = 1_700_000_000_000;

async fn users(store: &dyn Store, names: &[&str]) {
    for n in names {
        assert!(store.create_user(n, "phc-not-checked-here", T0).await.unwrap(), "create user {n}");
    }
}

fn send(sender: &str, conv: &str, cmid: &str) -> SendCmd {
    SendCmd {
        sender: sender.into(),
        sender_device: "d1".into(),
        conv: conv.into(),
        client_msg_id: cmid.into(),
        kind: "text".into(),
        content: format!("{{\"text\":\"{cmid}\"}}"),
        message_id: format!("m-{sender}-{cmid}"),
        quote_id: None,
        mentions: Vec::new(),
        mention_all: false,
        connection_epoch: None,
        now_ms: T0,
    }
}

/// A send mentioning `mentions` (and everyone with `all`).
fn mention(sender: &str, conv: &str, cmid: &str, mentions: &[&str], all: bool) -> SendCmd {
    SendCmd { mentions: mentions.iter().map(|m| m.to_string()).collect(), mention_all: all, ..send(sender, conv, cmid) }
}

/// Runs every check, each on its own fresh store from `fresh`.
pub async fn run_all<F, Fut>(fresh: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Arc<dyn Store>>,
{
    direct_pair_maps_to_one_conversation(&*fresh().await).await;
    send_is_idempotent(&*fresh().await).await;
    concurrent_sends_get_contiguous_seqs(fresh().await).await;
    refused_send_leaves_no_hole(&*fresh().await).await;
    refusals_inside_one_group_commit_roll_back_alone(fresh().await).await;
    fan_out_is_idempotent_and_projects_once(&*fresh().await).await;
    one_batch_counts_as_its_deliveries_one_by_one(&*fresh().await).await;
    fan_out_next_claims_in_outbox_order(fresh().await).await;
    user_log_pages_are_ranges(&*fresh().await).await;
    ack_is_a_monotonic_cas_per_device(&*fresh().await).await;
    cursor_cas_refuses_a_stale_expectation(&*fresh().await).await;
    installing_a_snapshot_expires_the_devices_other_snapshots(&*fresh().await).await;
    snapshot_views_come_in_chunks_at_their_base(&*fresh().await).await;
    conversation_pages_follow_the_key(&*fresh().await).await;
    refresh_tokens_are_used_once(&*fresh().await).await;
    revocation_is_durable(&*fresh().await).await;
    history_retention_moves_the_boundary(&*fresh().await).await;
    sync_pages_read_their_facts_and_events_together(&*fresh().await).await;
    connection_epochs_are_per_device_and_durable(&*fresh().await).await;
    frames_of_a_superseded_connection_change_nothing(&*fresh().await).await;
    devices_list_and_sessions_end_durably(&*fresh().await).await;
    fences_version_moves_with_every_fence(&*fresh().await).await;
    audit_log_is_queried_by_user_and_time_and_trimmed(&*fresh().await).await;
    deleting_a_user_removes_its_devices_log_and_cursors_and_keeps_a_tombstone(&*fresh().await).await;
    gauges_sample_what_the_store_holds(&*fresh().await).await;
    push_targets_and_owed_claims(&*fresh().await).await;
    push_claims_are_exclusive_under_concurrency(fresh().await).await;
    push_preview_preferences_are_stored_and_claimed(&*fresh().await).await;
}

/// Runs the checks of the rules `tidemark-core` decides for every backend
/// (membership, recall/edit/react and their recipients and payloads,
/// snapshot installability) and of group commit, each on its own fresh
/// store; a backend's tests run it beside [`run_all`].
pub async fn run_rules<F, Fut>(fresh: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Arc<dyn Store>>,
{
    membership_rules(&*fresh().await).await;
    member_lists_page_by_user_for_current_members(&*fresh().await).await;
    recall_edit_react_rules(&*fresh().await).await;
    snapshot_installability(&*fresh().await).await;
    group_commit_batches_concurrent_writes(fresh().await).await;
    privacy_audience_and_receipts(&*fresh().await).await;
    privacy_changes_are_user_events_once_per_change(&*fresh().await).await;
    large_group_rules(&*fresh().await).await;
    large_group_created_shared(&*fresh().await).await;
    mentions_in_shared_groups_are_counted_from_the_log(&*fresh().await).await;
}

/// P2, P5 (`server::fence`): every write that records a fence moves
/// `fences_version`, in its own transaction; other writes and refusals
/// leave it where it was, so a node's periodic check reloads only on a
/// change.
pub async fn fences_version_moves_with_every_fence(store: &dyn Store) {
    users(store, &["ann", "ben", "cat"]).await;
    store.login_device("ann", "phone", "Phone", T0).await.unwrap();
    store.login_device("ann", "laptop", "Laptop", T0).await.unwrap();
    let v0 = store.fences_version().await.unwrap();
    let (conv, _) = store.create_direct("ann", "ben", "d1", T0).await.unwrap();
    store.accept_send(send("ann", &conv, "m1")).await.unwrap();
    drain(store).await;
    assert_eq!(store.fences_version().await.unwrap(), v0, "a send, a fan-out and a login are no fence");
    let mut last = v0;
    let mut moved = |what: &str, v: u64| {
        assert!(v > last, "{what} moves fences_version: {v} after {last}");
        last = v;
    };
    assert!(store.revoke_device("ann", "laptop", T0).await.unwrap());
    moved("a revocation", store.fences_version().await.unwrap());
    assert!(store.end_sessions("ann", Some("phone"), T0 + 1).await.unwrap());
    moved("a device's end of sessions", store.fences_version().await.unwrap());
    assert!(store.end_sessions("ben", None, T0 + 2).await.unwrap());
    moved("a user's end of sessions", store.fences_version().await.unwrap());
    assert!(store.deactivate_user("cat", T0 + 3).await.unwrap());
    moved("a deactivation", store.fences_version().await.unwrap());
    assert!(store.delete_user("ben", T0 + 4).await.unwrap());
    moved("a deletion", store.fences_version().await.unwrap());
    // Refusals and repeats that change nothing leave it.
    assert!(store.revoke_device("zed", "x", T0).await.is_err());
    assert!(!store.revoke_device("ann", "laptop", T0).await.unwrap());
    assert!(!store.deactivate_user("cat", T0 + 5).await.unwrap());
    assert_eq!(store.fences_version().await.unwrap(), last, "nothing recorded, nothing moved");
}

/// Drains the outbox through the fan-out claim, as the relay does.
async fn drain(store: &dyn Store) -> Vec<ConvMoved> {
    let mut moved = Vec::new();
    loop {
        let claimed = store.fan_out_next(100, T0).await.unwrap();
        if claimed.items.is_empty() {
            return moved;
        }
        moved.extend(claimed.report.convs);
    }
}

fn state_of(list: Vec<ConvState>, conv: &str) -> ConvState {
    list.into_iter().find(|s| s.conv == conv).unwrap_or_else(|| panic!("{conv} not listed"))
}

/// G2, G3 (`core::large`): a group crossing the threshold switches at a
/// msg_seq; events up to the switch are in members' logs, later ones only
/// in the conversation log; markers publish once per batch, a clear is a
/// version CAS after the pull; unread carries across the switch; membership
/// changes above the switch reach their subject's log alone.
pub async fn large_group_rules(store: &dyn Store) {
    use MembershipChange::{Add, Leave};
    store.set_group_policy(GroupPolicy::new(3).unwrap());
    users(store, &["a", "b", "c", "d", "e"]).await;
    store.create_group(ev("g", "a", "create"), vec!["b".into(), "c".into()]).await.unwrap(); // 1
    assert_eq!(state_of(store.list_conversations("b", None).await.unwrap(), "g").mode, "per_member");
    store.accept_send(send("a", "g", "m2")).await.unwrap(); // 2
    drain(store).await;
    let b_hw = store.user_high_watermark("b").await.unwrap();
    store.login_device("b", "phone", "Phone", T0).await.unwrap();
    let shared_groups = || async {
        let first = tidemark_core::page::PageQuery::First {
            client: tidemark_core::cursor::ClientPosition { generation: None, local_applied_sync_seq: Some(0) },
            policy: tidemark_core::cursor::RecoveryPolicy::NO_RECOVERY,
            now_ms: T0,
        };
        store.sync_page("b", "phone", first, 1).await.unwrap().unwrap().shared_groups
    };
    assert!(!shared_groups().await, "G2: no shared group, no dirty markers to read at a batch's end");
    // The fourth member crosses the threshold: join at 3, switch at 4.
    assert_eq!(store.change_membership(ev("g", "a", "add-d"), "d", Add).await, Ok(3));
    assert_eq!(
        store.change_membership(ev("g", "a", "add-d"), "d", Add).await,
        Ok(3),
        "a retry writes no second switch"
    );
    assert_eq!(store.conversation("g").await.unwrap().unwrap().head, 4);
    let moved = drain(store).await;
    assert!(moved.is_empty(), "the join and the switch are fanned out per member: {moved:?}");
    let b_events = store.read_user_events("b", b_hw, 1_000_000, 10).await.unwrap();
    let kinds: Vec<(&str, Option<u64>)> = b_events.iter().map(|e| (e.kind.as_str(), e.msg_seq)).collect();
    assert_eq!(kinds, vec![(EVENT_MEMBERSHIP, Some(3)), (EVENT_MODE, Some(4))], "the switch is in every member's log");
    let hw_after_switch = store.user_high_watermark("b").await.unwrap();
    assert!(shared_groups().await, "G2: the page's snapshot finds the shared group");

    // Above the switch: nothing per member; one marker publication.
    for i in 0..5 {
        store.accept_send(send("a", "g", &format!("s{i}"))).await.unwrap(); // 5..=9
    }
    let moved = drain(store).await;
    assert_eq!(moved.len(), 1, "one publication per group per batch: {moved:?}");
    assert_eq!((moved[0].target, moved[0].version), (9, 1));
    assert_eq!(store.user_high_watermark("b").await.unwrap(), hw_after_switch, "G2: no user event per message");
    let b = state_of(store.list_conversations("b", Some("phone")).await.unwrap(), "g");
    assert_eq!(b.mode, "shared");
    assert_eq!(b.marker, Some(Marker { target: 9, version: 1, dirty: true }));
    assert_eq!(b.last_msg_seq, 9);
    assert_eq!(b.unread, 6, "unread carries over the switch: m2 below it, s0..s4 above");
    assert_eq!(state_of(store.list_conversations("a", None).await.unwrap(), "g").unread, 0, "own messages");
    let dirty = store.dirty_markers("b", "phone").await.unwrap();
    assert_eq!(dirty, vec![DeviceMarker { conv: "g".into(), marker: Marker { target: 9, version: 1, dirty: true } }]);

    // The seed's race: read (9, v1), a message lands, clear with v1 fails.
    store.accept_send(send("a", "g", "s5")).await.unwrap(); // 10
    let moved = drain(store).await;
    assert_eq!((moved[0].target, moved[0].version), (10, 2));
    let stale = store.clear_marker("b", "phone", "g", 1, 9).await.unwrap();
    assert_eq!(stale, (false, Marker { target: 10, version: 2, dirty: true }));
    assert_eq!(store.dirty_markers("b", "phone").await.unwrap().len(), 1, "the marker stays dirty");
    // The right version without the pull is refused too; then caught up.
    assert!(!store.clear_marker("b", "phone", "g", 2, 9).await.unwrap().0);
    let done = store.clear_marker("b", "phone", "g", 2, 10).await.unwrap();
    assert_eq!(done, (true, Marker { target: 10, version: 2, dirty: false }));
    assert!(store.dirty_markers("b", "phone").await.unwrap().is_empty());
    assert_eq!(store.dirty_markers("b", "laptop").await.unwrap().len(), 1, "each device clears for itself");
    // A clear never moves read, nor read the marker.
    let b = state_of(store.list_conversations("b", Some("phone")).await.unwrap(), "g");
    assert_eq!((b.read_seq, b.unread), (0, 7));
    let read = store.mark_read("b", "g", 8, T0).await.unwrap();
    assert_eq!((read.read_seq, read.unread), (8, 2), "read inside the shared range, counted from the log");
    assert!(store.dirty_markers("b", "phone").await.unwrap().is_empty(), "read does not dirty the marker");

    // conv.sync serves the shared range inside the member's period.
    let page = store.conv_sync("d", "g", 4, 50, None).await.unwrap();
    let seqs: Vec<u64> = page.events.iter().map(|m| m.msg_seq).collect();
    assert_eq!(seqs, vec![5, 6, 7, 8, 9, 10]);

    // A join above the switch reaches only its subject's log; a leave caps
    // the leaver's marker at the leave.
    let e_hw = store.user_high_watermark("e").await.unwrap();
    let b_hw = store.user_high_watermark("b").await.unwrap();
    assert_eq!(store.change_membership(ev("g", "a", "add-e"), "e", Add).await, Ok(11));
    assert_eq!(store.change_membership(ev("g", "c", "lv-c"), "c", Leave).await, Ok(12));
    store.accept_send(send("a", "g", "s6")).await.unwrap(); // 13
    let moved = drain(store).await;
    assert_eq!((moved[0].target, moved[0].version), (13, 3));
    assert_eq!(store.user_high_watermark("b").await.unwrap(), b_hw, "others read membership from the conversation log");
    let e_events = store.read_user_events("e", e_hw, 1_000_000, 10).await.unwrap();
    assert_eq!(e_events.iter().map(|e| e.msg_seq).collect::<Vec<_>>(), vec![Some(11)], "the subject learns");
    let e = state_of(store.list_conversations("e", None).await.unwrap(), "g");
    assert_eq!((e.mode.as_str(), e.marker.map(|m| m.target)), ("shared", Some(13)));
    let c = state_of(store.list_conversations("c", Some("c1")).await.unwrap(), "g");
    assert_eq!((c.active, c.marker.map(|m| m.target)), (false, Some(12)), "a leaver's marker stops at the leave");
    assert!(store.clear_marker("c", "c1", "g", 3, 12).await.unwrap().0);
    assert_eq!(store.active_members("g").await.unwrap().0, 12, "members_seq is the last membership change");
    let mut members = store.active_members("g").await.unwrap().1;
    members.sort();
    assert_eq!(members, vec!["a", "b", "d", "e"]);
    assert_eq!(store.clear_marker("zz", "p", "g", 1, 1).await, Err(StoreError::NotMember));
    let (direct, _) = store.create_direct("a", "b", "d1", T0).await.unwrap();
    assert_eq!(
        store.clear_marker("a", "p", &direct, 1, 1).await,
        Err(invalid(&format!("conversation {direct} is not in shared mode")))
    );
}

/// G3: a group created above the threshold is shared from its first event.
pub async fn large_group_created_shared(store: &dyn Store) {
    store.set_group_policy(GroupPolicy::new(2).unwrap());
    users(store, &["a", "b", "c"]).await;
    store.create_group(ev("big", "a", "create"), vec!["b".into(), "c".into()]).await.unwrap();
    assert!(drain(store).await.is_empty(), "conv.created and the switch are fanned out per member");
    let events = store.read_user_events("c", 0, 10, 10).await.unwrap();
    let kinds: Vec<(&str, Option<u64>)> = events.iter().map(|e| (e.kind.as_str(), e.msg_seq)).collect();
    assert_eq!(kinds, vec![(EVENT_MEMBERSHIP, Some(1)), (EVENT_MODE, Some(2))]);
    store.accept_send(send("b", "big", "x")).await.unwrap();
    let moved = drain(store).await;
    assert_eq!(moved.iter().map(|m| (m.conv.as_str(), m.target)).collect::<Vec<_>>(), vec![("big", 3)]);
    assert_eq!(store.user_high_watermark("c").await.unwrap(), 2);
    let c = state_of(store.list_conversations("c", None).await.unwrap(), "big");
    assert_eq!((c.mode.as_str(), c.unread, c.last_msg_seq), ("shared", 1, 3));
}

/// Issue 18 (`core::mention`), R3: a mention count moves once per event
/// in the fan-out (a retried send, a redelivery and an edit move nothing),
/// never for the sender; "everyone" is the owner's in a group above
/// `MENTION_ALL_MEMBERS_MAX`; `read` clears mentions only up to
/// `read_to_seq`; the unread rebuild recounts them from the facts. `raw`
/// runs SQL on the store's database to plant the drift.
pub async fn mentions_count_once_clear_to_read_and_rebuild<X, XF>(store: &dyn Store, raw: X)
where
    X: Fn(&'static str) -> XF,
    XF: std::future::Future<Output = ()>,
{
    use tidemark_core::mention::MENTION_ALL_MEMBERS_MAX;
    users(store, &["a", "b", "c"]).await;
    store.create_group(ev("g", "a", "create"), vec!["b".into(), "c".into()]).await.unwrap(); // 1
    let first = store.accept_send(mention("a", "g", "m1", &["b"], false)).await.unwrap(); // 2
    let retry = store.accept_send(mention("a", "g", "m1", &["b"], false)).await.unwrap();
    assert!(retry.duplicate && retry.msg_seq == first.msg_seq, "S1: a retried send is the same message");
    store.accept_send(mention("b", "g", "m2", &[], true)).await.unwrap(); // 3
    store.accept_send(send("a", "g", "m3")).await.unwrap(); // 4
    store.accept_send(mention("a", "g", "m4", &["b", "c", "nobody"], false)).await.unwrap(); // 5
    let items = store.pending_outbox(100).await.unwrap();
    store.fan_out(items.clone(), T0).await.unwrap();
    let again = store.fan_out(items, T0).await.unwrap();
    assert_eq!(again.events_written, 0, "F3: a redelivery writes nothing");
    let counts = |list: Vec<ConvState>| {
        let s = state_of(list, "g");
        (s.unread, s.mentions)
    };
    // b's own m2 moved b's read cursor past m1: only m4 is left.
    assert_eq!(counts(store.list_conversations("b", None).await.unwrap()), (2, 1), "b: m4 mentions b");
    assert_eq!(counts(store.list_conversations("c", None).await.unwrap()), (4, 2), "c: everyone (m2) and m4");
    assert_eq!(counts(store.list_conversations("a", None).await.unwrap()), (0, 0), "a read past m2 by sending");
    let events = store.read_user_events("b", 0, 10, 10).await.unwrap();
    let m1 = events.iter().find_map(|e| e.message.as_ref().filter(|m| m.msg_seq == 2)).expect("m1 delivered");
    assert_eq!((m1.mentions.clone(), m1.mention_all), (vec!["b".to_string()], false), "stored as facts");
    // An edit is a new event, but not a new mention.
    store.edit(ev("g", "a", "edit1"), &first.message_id, "{\"text\":\"m1'\"}", 1).await.unwrap(); // 6
    drain(store).await;
    assert_eq!(counts(store.list_conversations("c", None).await.unwrap()), (4, 2), "an edit does not recount");

    // `read` clears only what it covers.
    let read = store.mark_read("c", "g", 3, T0).await.unwrap();
    assert_eq!((read.read_seq, read.unread, read.mentions), (3, 2, 1), "m4 stays a mention above read_to_seq");
    assert_eq!(counts(store.list_conversations("c", None).await.unwrap()), (2, 1));
    let read = store.mark_read("b", "g", 4, T0).await.unwrap();
    assert_eq!((read.unread, read.mentions), (1, 1), "m3 read, m4 not");

    // The rebuild recounts mentions from the facts.
    raw("UPDATE user_convs SET mentions = 9 WHERE user_id = 'c' AND conv_id = 'g'").await;
    let rebuilt = crate::reconcile::rebuild_unread(store, 1).await.unwrap();
    assert_eq!(rebuilt.drifted, 1, "{rebuilt:?}");
    assert_eq!(counts(store.list_conversations("c", None).await.unwrap()), (2, 1), "rebuilt from facts");
    assert_eq!(crate::reconcile::rebuild_unread(store, 1).await.unwrap().drifted, 0, "repaired once");

    // Everyone in a group above MENTION_ALL_MEMBERS_MAX: the owner's only.
    let many: Vec<String> = (0..=MENTION_ALL_MEMBERS_MAX).map(|i| format!("u{i:02}")).collect();
    for u in &many {
        store.create_user(u, "phc-not-checked-here", T0).await.unwrap();
    }
    let mut members = many.clone();
    members.push("b".into());
    store.create_group(ev("big", "a", "create-big"), members).await.unwrap(); // 1
    let refused = store.accept_send(mention("b", "big", "all-b", &[], true)).await;
    assert!(matches!(refused, Err(StoreError::Forbidden(_))), "{refused:?}");
    let ok = store.accept_send(mention("a", "big", "all-a", &[], true)).await.unwrap();
    assert_eq!(ok.msg_seq, 2, "S2: the refusal left no hole");
    drain(store).await;
    assert_eq!(state_of(store.list_conversations("u00", None).await.unwrap(), "big").mentions, 1);
}

/// Issue 18, G2: a shared group writes no row per member for a mention;
/// its mentions above the switch are counted from the log on read, as its
/// unread is, and `read` clears them up to `read_to_seq`.
pub async fn mentions_in_shared_groups_are_counted_from_the_log(store: &dyn Store) {
    store.set_group_policy(GroupPolicy::new(2).unwrap());
    users(store, &["a", "b", "c"]).await;
    store.create_group(ev("big", "a", "create"), vec!["b".into(), "c".into()]).await.unwrap(); // 1, switch 2
    store.accept_send(mention("a", "big", "x", &["b"], false)).await.unwrap(); // 3
    store.accept_send(mention("a", "big", "y", &[], true)).await.unwrap(); // 4
    store.accept_send(send("a", "big", "z")).await.unwrap(); // 5
    drain(store).await;
    let row = |u: &'static str| async move { state_of(store.list_conversations(u, None).await.unwrap(), "big") };
    let b = row("b").await;
    assert_eq!((b.mode.as_str(), b.unread, b.mentions), ("shared", 3, 2));
    assert_eq!((row("c").await.unread, row("c").await.mentions), (3, 1), "everyone, without a row each");
    assert_eq!(row("a").await.mentions, 0, "never the sender");
    let read = store.mark_read("b", "big", 3, T0).await.unwrap();
    assert_eq!((read.unread, read.mentions), (2, 1));
}

/// G1: one conversation per direct pair, whatever the order.
pub async fn direct_pair_maps_to_one_conversation(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    let (c1, created1) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    let (c2, created2) = store.create_direct("b", "a", "c2", T0).await.unwrap();
    assert!(created1 && !created2, "G1: the second create finds the first");
    assert_eq!(c1, c2, "G1: a direct pair maps to one conversation");
    assert!(matches!(store.create_direct("a", "nobody", "c3", T0).await, Err(StoreError::NotFound(_))));
    let conv = store.conversation(&c1).await.unwrap().unwrap();
    assert_eq!(conv.members, vec!["a".to_string(), "b".to_string()]);
}

/// S1: a retry returns the original message, never a second one.
pub async fn send_is_idempotent(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    let first = store.accept_send(send("a", &conv, "x")).await.unwrap();
    let mut retry = send("a", &conv, "x");
    retry.message_id = "another-id".into();
    let second = store.accept_send(retry).await.unwrap();
    assert!(!first.duplicate && second.duplicate, "S1: the retry is flagged duplicate");
    assert_eq!((first.message_id, first.msg_seq), (second.message_id, second.msg_seq), "S1: same id and seq");
    assert_eq!(store.conversation(&conv).await.unwrap().unwrap().head, 1, "S1: one message");
    assert_eq!(store.outbox_stats().await.unwrap().backlog, 1, "S3: one outbox record");
}

/// S2: concurrent sends get 1..=n with no hole and no repeat.
pub async fn concurrent_sends_get_contiguous_seqs(store: Arc<dyn Store>) {
    users(&*store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    let n = 200u64;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (store, conv) = (store.clone(), conv.clone());
        let sender = if i % 2 == 0 { "a" } else { "b" };
        tasks.spawn(async move { store.accept_send(send(sender, &conv, &format!("k{i}"))).await.unwrap().msg_seq });
    }
    let mut seqs: Vec<u64> = tasks.join_all().await;
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=n).collect::<Vec<_>>(), "S2: contiguous msg_seq");
}

/// S2/S3: a refused send (not a member, unknown conversation) consumes no
/// msg_seq and writes no outbox record.
pub async fn refused_send_leaves_no_hole(store: &dyn Store) {
    users(store, &["a", "b", "c"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    assert_eq!(store.accept_send(send("a", &conv, "1")).await.unwrap().msg_seq, 1);
    assert_eq!(store.accept_send(send("c", &conv, "2")).await, Err(StoreError::NotMember));
    assert!(matches!(store.accept_send(send("a", "no-such-conv", "3")).await, Err(StoreError::NotFound(_))));
    assert_eq!(store.accept_send(send("b", &conv, "4")).await.unwrap().msg_seq, 2, "S2: no hole after a refusal");
    assert_eq!(store.outbox_stats().await.unwrap().backlog, 2);
}

/// S2/S3 under group commit: sends queued together land in the same
/// transactions, refusals (not a member, unknown conversation, an id reused
/// for another conversation) interleaved with accepted sends and
/// duplicates. Each refusal rolls back alone: the accepted sends keep
/// contiguous msg_seqs, each has exactly one outbox record, duplicates get
/// the first answer.
pub async fn refusals_inside_one_group_commit_roll_back_alone(store: Arc<dyn Store>) {
    users(&*store, &["a", "b", "c"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    let (other, _) = store.create_direct("a", "c", "c2", T0).await.unwrap();
    store.accept_send(send("a", &other, "used")).await.unwrap();
    let n = 120u64;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (store, conv) = (store.clone(), conv.clone());
        tasks.spawn(async move {
            let cmd = match i % 6 {
                0 => send("c", &conv, &format!("x{i}")),
                1 => send("a", "no-such-conv", &format!("x{i}")),
                2 => send("a", &conv, "used"),
                3 => send("b", &conv, "dup"),
                _ => send("a", &conv, &format!("k{i}")),
            };
            (i % 6, store.accept_send(cmd).await)
        });
    }
    let mut seqs = Vec::new();
    let mut dup_seqs = std::collections::BTreeSet::new();
    for (kind, r) in tasks.join_all().await {
        match (kind, r) {
            (0, r) => assert_eq!(r, Err(StoreError::NotMember)),
            (1, r) => assert!(matches!(r, Err(StoreError::NotFound(_))), "{r:?}"),
            (2, r) => assert!(matches!(r, Err(StoreError::Conflict(_))), "{r:?}"),
            (3, r) => {
                let ok = r.unwrap();
                dup_seqs.insert(ok.msg_seq);
                if !ok.duplicate {
                    seqs.push(ok.msg_seq);
                }
            }
            (_, r) => seqs.push(r.unwrap().msg_seq),
        }
    }
    seqs.sort_unstable();
    assert_eq!(dup_seqs.len(), 1, "S1: every duplicate gets the first answer");
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "S2: no hole after refusals in a batch");
    assert_eq!(seqs.len() as u64, n / 6 * 2 + 1);
    let backlog = store.outbox_stats().await.unwrap().backlog;
    assert_eq!(backlog, seqs.len() as u64 + 1, "S3: one outbox record per accepted send, none for a refusal");
    let head = store.conversation(&conv).await.unwrap().unwrap().head;
    assert_eq!(head, seqs.len() as u64, "S2: the head is the last accepted send");
}

/// Group commit: concurrent requests share transactions (one per request
/// would mean group commit is not working), and their msg_seqs are 1..=n.
pub async fn group_commit_batches_concurrent_writes(store: Arc<dyn Store>) {
    users(&*store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    let before = store.stats();
    let n = 400u64;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (store, conv) = (store.clone(), conv.clone());
        tasks.spawn(async move { store.accept_send(send("a", &conv, &format!("{i}"))).await.unwrap().msg_seq });
    }
    let mut seqs = tasks.join_all().await;
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=n).collect::<Vec<_>>(), "S2: contiguous msg_seq");
    let after = store.stats();
    let commits = after.commits - before.commits;
    assert_eq!(after.writes - before.writes, n, "every request is counted once");
    assert!(commits < n / 2, "{commits} commits for {n} concurrent sends");
}

fn ev(conv: &str, actor: &str, id: &str) -> ConvEventCmd {
    ConvEventCmd {
        conv: conv.into(),
        actor: actor.into(),
        actor_device: "d1".into(),
        event_id: id.into(),
        client_msg_id: id.into(),
        now_ms: T0,
    }
}

fn invalid(m: &str) -> StoreError {
    StoreError::Invalid(m.into())
}

fn not_found(m: &str) -> StoreError {
    StoreError::NotFound(m.into())
}

/// S3, durability: accepted sends and their outbox records, and the server
/// secret, survive closing and reopening the store; reopening changes
/// nothing. `open` opens the same database each time.
pub async fn accepted_sends_and_outbox_survive_reopen<F, Fut>(open: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Arc<dyn Store>>,
{
    let secret = {
        let store = open().await;
        users(&*store, &["a", "b"]).await;
        let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
        for i in 0..5 {
            store.accept_send(send("a", &conv, &format!("{i}"))).await.unwrap();
        }
        store.server_secret().await.unwrap()
    };
    let store = open().await;
    let pending = store.pending_outbox(100).await.unwrap();
    assert_eq!(pending.iter().map(|i| i.msg_seq).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
    assert_eq!(store.server_secret().await.unwrap(), secret, "the secret is created once and kept");
    assert_eq!(secret.len(), 32);
}

/// F4: a message that hits two membership periods of one user is an
/// integrity error: quarantined, counted, never delivered twice (or once by
/// a guess); the other members still get it. `corrupt` is the backend's
/// way to write, behind the store's back, a second open period for `b` in
/// `g1` (`join_seq` 0); `quarantined` counts `b`'s quarantine rows.
pub async fn overlapping_periods_are_quarantined<C, CF, Q, QF>(store: &dyn Store, corrupt: C, quarantined: Q)
where
    C: FnOnce() -> CF,
    CF: std::future::Future<Output = ()>,
    Q: FnOnce() -> QF,
    QF: std::future::Future<Output = i64>,
{
    users(store, &["a", "b", "c"]).await;
    store.create_group(ev("g1", "a", "e1"), vec!["b".into(), "c".into()]).await.unwrap();
    corrupt().await;
    store.accept_send(SendCmd { message_id: "m1".into(), ..send("a", "g1", "m") }).await.unwrap();
    let report = store.fan_out(store.pending_outbox(10).await.unwrap(), T0).await.unwrap();
    assert_eq!(report.quarantined, 2, "b is quarantined for both events (created, m1)");
    assert_eq!(quarantined().await, 2);
    assert_eq!(store.user_high_watermark("b").await.unwrap(), 0, "nothing delivered to b");
    assert_eq!(store.user_high_watermark("c").await.unwrap(), 2, "c gets both");
}

/// G1 (`core::membership`): group creation and its retry, who may add,
/// remove or let leave whom, and what a membership change answers, the
/// same errors from every backend.
/// `conv.members` (`core::membership::members_page`): the current members
/// by user id with the `msg_seq` of their join, paged by `after` with the
/// last page saying so; a member who left or was removed is not listed; a
/// former member and a stranger are refused `NotMember`, an unknown
/// conversation `NotFound`; `members_seq` moves with each change.
pub async fn member_lists_page_by_user_for_current_members(store: &dyn Store) {
    use MembershipChange::{Add, Leave, Remove};
    users(store, &["own", "b", "c", "d", "e", "out"]).await;
    store.create_group(ev("g", "own", "create"), vec!["c".into(), "b".into()]).await.unwrap(); // 1
    store.accept_send(send("own", "g", "m1")).await.unwrap(); // 2
    store.change_membership(ev("g", "own", "add-e"), "e", Add).await.unwrap(); // 3
    store.change_membership(ev("g", "b", "add-d"), "d", Add).await.unwrap(); // 4
    let page = |u: &'static str, after: Option<&'static str>, limit| async move {
        store.conv_members(u, "g", after.map(str::to_owned), limit).await
    };
    let whole = page("c", None, 100).await.unwrap();
    let listed = |p: &MembersPage| p.members.iter().map(|(u, s)| (u.clone(), *s)).collect::<Vec<_>>();
    let all: Vec<(String, u64)> =
        [("b", 1), ("c", 1), ("d", 4), ("e", 3), ("own", 1)].iter().map(|(u, s)| (u.to_string(), *s)).collect();
    assert_eq!(listed(&whole), all, "by user id, each with its join");
    assert_eq!((whole.members_seq, whole.owner.as_deref(), whole.has_more), (4, Some("own"), false));
    // Paged two at a time: every member once, the last page says so.
    let first = page("c", None, 2).await.unwrap();
    assert_eq!((listed(&first), first.has_more), (all[..2].to_vec(), true));
    let second = page("c", Some("c"), 2).await.unwrap();
    assert_eq!((listed(&second), second.has_more), (all[2..4].to_vec(), true));
    let last = page("c", Some("e"), 2).await.unwrap();
    assert_eq!((listed(&last), last.has_more), (all[4..].to_vec(), false));
    let past = page("c", Some("zz"), 2).await.unwrap();
    assert!(past.members.is_empty() && !past.has_more, "past the last member: an empty last page");
    // Who leaves or is removed is no longer listed, and may no longer ask.
    store.change_membership(ev("g", "d", "leave-d"), "d", Leave).await.unwrap(); // 5
    store.change_membership(ev("g", "own", "rm-b"), "b", Remove).await.unwrap(); // 6
    let now = page("own", None, 100).await.unwrap();
    assert_eq!(listed(&now), vec![("c".to_string(), 1), ("e".to_string(), 3), ("own".to_string(), 1)]);
    assert_eq!(now.members_seq, 6, "members_seq follows the changes");
    assert_eq!(page("d", None, 100).await, Err(StoreError::NotMember), "a departed member");
    assert_eq!(page("b", None, 100).await, Err(StoreError::NotMember), "a removed member");
    assert_eq!(page("out", None, 100).await, Err(StoreError::NotMember), "a stranger");
    assert!(matches!(store.conv_members("own", "nope", None, 10).await, Err(StoreError::NotFound(_))));
    // A rejoined member is listed once, with the join of the open period.
    store.change_membership(ev("g", "c", "add-d2"), "d", Add).await.unwrap(); // 7
    let again = page("d", None, 100).await.unwrap();
    assert!(again.members.contains(&("d".to_string(), 7)), "{:?}", again.members);
    assert_eq!(again.members.iter().filter(|(u, _)| u == "d").count(), 1);
    // A direct conversation lists its pair, without an owner.
    let (direct, _) = store.create_direct("b", "c", "dm", T0).await.unwrap();
    let pair = store.conv_members("b", &direct, None, 10).await.unwrap();
    assert_eq!(pair.members.iter().map(|(u, _)| u.as_str()).collect::<Vec<_>>(), vec!["b", "c"]);
    assert_eq!(pair.owner, None);
    assert_eq!(store.conv_members("e", &direct, None, 10).await, Err(StoreError::NotMember));
}

pub async fn membership_rules(store: &dyn Store) {
    use MembershipChange::{Add, Leave, Remove};
    users(store, &["own", "m", "x", "out"]).await;
    let created = store.create_group(ev("g1", "own", "create"), vec!["m".into(), "m".into(), "own".into()]).await;
    assert_eq!(created, Ok(("g1".to_string(), 1)));
    let retry = store.create_group(ev("g-other", "own", "create"), vec![]).await;
    assert_eq!(retry, Ok(("g1".to_string(), 1)), "a retried create finds the first group");
    let unknown = store.create_group(ev("g2", "own", "create2"), vec!["x".into(), "zz".into()]).await;
    assert_eq!(unknown, Err(not_found(tidemark_core::membership::NO_SUCH_USER)));
    assert_eq!(store.conversation("g2").await.unwrap(), None, "a refused create leaves nothing");
    assert_eq!(store.conversation("g1").await.unwrap().unwrap().members, vec!["m".to_string(), "own".to_string()]);
    assert_eq!(store.accept_send(send("own", "g1", "k")).await.unwrap().msg_seq, 2);
    let reused = store.create_group(ev("g3", "own", "k"), vec![]).await;
    assert_eq!(reused, Err(invalid("client_msg_id k was already used")));

    let change = |actor: &str, id: &str, target: &str, c: MembershipChange| {
        let cmd = ev("g1", actor, id);
        let target = target.to_owned();
        async move { store.change_membership(cmd, &target, c).await }
    };
    assert_eq!(change("m", "add-x", "x", Add).await, Ok(3), "any member adds");
    assert_eq!(change("m", "add-x", "x", Add).await, Ok(3), "a retry answers the first join");
    assert_eq!(change("own", "add-x2", "x", Add).await, Ok(3), "adding a member answers its join");
    assert_eq!(change("own", "add-zz", "zz", Add).await, Err(not_found(tidemark_core::membership::NO_SUCH_USER)));
    assert_eq!(change("out", "add-out", "out", Add).await, Err(StoreError::NotMember), "only members add");
    assert_eq!(
        change("m", "rm-x", "x", Remove).await,
        Err(StoreError::Forbidden("only the group owner removes members".into()))
    );
    assert_eq!(change("m", "lv-x", "x", Leave).await, Err(invalid("leave applies to the caller")));
    assert_eq!(
        change("own", "k", "x", Remove).await,
        Err(StoreError::Conflict("client_msg_id k was already used for another operation".into()))
    );
    assert_eq!(change("x", "lv-x2", "x", Leave).await, Ok(4), "a member leaves");
    assert_eq!(change("x", "lv-x3", "x", Leave).await, Err(StoreError::NotMember), "a leaver is no member");
    assert_eq!(change("own", "rm-x", "x", Remove).await, Err(not_found("x is not a member")));
    assert_eq!(store.accept_send(send("x", "g1", "x1")).await, Err(StoreError::NotMember));
    assert_eq!(change("own", "rm-m", "m", Remove).await, Ok(5), "the owner removes");
    assert_eq!(store.accept_send(send("m", "g1", "m1")).await, Err(StoreError::NotMember));
    assert_eq!(change("own", "add-m", "m", Add).await, Ok(6), "a rejoin is a new join");
    assert_eq!(store.conversation("g1").await.unwrap().unwrap().members, vec!["m".to_string(), "own".to_string()]);
    assert_eq!(store.conversation("g1").await.unwrap().unwrap().head, 6, "refusals take no msg_seq");

    let (direct, _) = store.create_direct("own", "m", "d1", T0).await.unwrap();
    let cmd = ev(&direct, "own", "add-d");
    let fixed = store.change_membership(cmd, "x", Add).await;
    assert_eq!(fixed, Err(invalid("a direct conversation has fixed members")));
    let nowhere = store.change_membership(ev("nope", "own", "add-n"), "x", Add).await;
    assert_eq!(nowhere, Err(not_found("conversation nope")));
}

/// E1–E2, F4 (`core::control`, `core::membership::control_recipients`,
/// `tidemark_proto::content`): who may recall, edit and react, the version
/// CAS, what a retry answers, who receives each control event, and the
/// stored payloads, byte for byte the same from every backend.
pub async fn recall_edit_react_rules(store: &dyn Store) {
    users(store, &["a", "b", "c", "d"]).await;
    store.create_group(ev("g1", "a", "create"), vec!["b".into(), "d".into()]).await.unwrap();
    let m1 = store.accept_send(send("a", "g1", "1")).await.unwrap().message_id;
    let out = |msg_seq, version, changed| Ok(ControlOutcome { msg_seq, version, changed });
    let new = "{\"text\":\"new\"}";
    assert_eq!(store.edit(ev("g1", "a", "e1"), &m1, new, 1).await, out(3, 2, true));
    assert_eq!(store.edit(ev("g1", "a", "e1"), &m1, new, 1).await, out(3, 2, false), "a retry answers the edit");
    assert_eq!(store.edit(ev("g1", "a", "e2"), &m1, new, 1).await, Err(StoreError::VersionConflict(2)), "E2: CAS");
    let other = store.edit(ev("g1", "b", "e3"), &m1, new, 2).await;
    assert_eq!(other, Err(StoreError::Forbidden("only the sender edits a message".into())));
    assert_eq!(store.edit(ev("g1", "a", "e4"), "m-zz", new, 1).await, Err(not_found("message m-zz")));
    assert_eq!(store.edit(ev("g1", "a", "e5"), "e1", new, 1).await, Err(not_found("message e1")), "no control target");
    store.change_membership(ev("g1", "a", "add-c"), "c", MembershipChange::Add).await.unwrap();
    assert_eq!(store.react(ev("g1", "b", "r1"), &m1, "+1", true).await, out(5, 3, true));
    assert_eq!(store.react(ev("g1", "b", "r2"), &m1, "+1", true).await, out(5, 3, false), "already there");
    assert_eq!(store.react(ev("g1", "b", "r3"), &m1, "heart", false).await, out(0, 3, false), "nothing to remove");
    let newcomer = store.react(ev("g1", "c", "r4"), &m1, "+1", true).await;
    assert_eq!(newcomer, Err(StoreError::NotMember), "a newcomer does not see older messages");
    let reused = store.react(ev("g1", "a", "e1"), &m1, "+1", true).await;
    assert_eq!(reused, Err(StoreError::Conflict("client_msg_id e1 was already used for another operation".into())));
    store.change_membership(ev("g1", "d", "lv-d"), "d", MembershipChange::Leave).await.unwrap();
    let by_other = store.recall(ev("g1", "b", "rc0"), &m1).await;
    assert_eq!(by_other, Err(StoreError::Forbidden("only the sender recalls a message".into())));
    assert_eq!(store.recall(ev("g1", "a", "rc1"), &m1).await, out(7, 4, true));
    assert_eq!(store.recall(ev("g1", "a", "rc1"), &m1).await, out(7, 4, false), "a retry answers the recall");
    assert_eq!(store.recall(ev("g1", "a", "rc2"), &m1).await, out(7, 4, false), "a second recall answers the first");
    let edit = store.edit(ev("g1", "a", "e6"), &m1, new, 4).await;
    assert_eq!(edit, Err(invalid("a recalled message cannot be edited")));
    let react = store.react(ev("g1", "b", "r5"), &m1, "x", true).await;
    assert_eq!(react, Err(invalid("a recalled message takes no reactions")));

    // Who receives what: the leaver d still gets the recall of a message
    // it held (E1); the newcomer c gets neither the reaction nor the recall
    // of a message it never saw, but d's leave.
    store.fan_out(store.pending_outbox(100).await.unwrap(), T0).await.unwrap();
    let seqs = |user: &'static str| async move {
        let log = store.read_user_events(user, 0, 100, 100).await.unwrap();
        log.iter().filter_map(|e| e.msg_seq).collect::<Vec<_>>()
    };
    assert_eq!(seqs("b").await, vec![1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(seqs("d").await, vec![1, 2, 3, 4, 5, 6, 7], "E1: the recall reaches a former holder");
    assert_eq!(seqs("c").await, vec![4, 6], "F4: control events reach only who saw their target");

    // The stored payloads (tidemark_proto::content), as every reader gets them.
    let page = store.conv_sync("b", "g1", 0, 100, None).await.unwrap();
    let contents: Vec<(&str, &str)> = page.events.iter().map(|m| (m.kind.as_str(), m.content.as_str())).collect();
    let target = format!("\"target_message_id\":\"{m1}\",\"target_msg_seq\":2");
    let want = [
        (KIND_CREATED, "{\"owner\":\"a\",\"members\":[\"a\",\"b\",\"d\"]}".to_string()),
        ("text", "{}".to_string()),
        (KIND_EDIT, format!("{{{target},\"version\":2,\"recalled\":true}}")),
        (KIND_JOIN, "{\"user\":\"c\",\"by\":\"a\",\"op\":\"add\"}".to_string()),
        (KIND_REACTION, format!("{{{target},\"reaction\":\"+1\",\"op\":\"add\",\"user\":\"b\",\"version\":3}}")),
        (KIND_LEAVE, "{\"user\":\"d\",\"by\":\"d\",\"op\":\"leave\"}".to_string()),
        (KIND_RECALL, format!("{{{target}}}")),
    ];
    let want: Vec<(&str, &str)> = want.iter().map(|(k, c)| (*k, c.as_str())).collect();
    assert_eq!(contents, want, "E1: the recall wiped the message and its edits");
    assert_eq!(page.events[1].state, STATE_RECALLED);
}

/// D7 (`core::snapshot`): a snapshot starts only for a device resetting at
/// that generation, serves pages only while `READY`, and installs only for
/// its own device, unexpired, under the same generation, once.
pub async fn snapshot_installability(store: &dyn Store) {
    users(store, &["b"]).await;
    let phone = store.login_device("b", "phone", "Phone", T0).await.unwrap();
    store.login_device("b", "desk", "Desk", T0).await.unwrap();
    let resetting = DeviceCursor { generation: 2, acked_sync_seq: 0, state: DeviceState::Resetting };
    assert!(store.cas_device_cursor("b", "phone", phone.cursor, resetting, T0).await.unwrap().0);
    let expires = T0 + 1_000;
    let wrong_gen = store.begin_snapshot("b", "phone", 3, "s0", 4, expires, T0).await;
    assert_eq!(wrong_gen, Err(StoreError::Conflict("device is RESETTING at generation 2, not resetting at 3".into())));
    let not_resetting = store.begin_snapshot("b", "desk", 1, "s0", 4, expires, T0).await;
    assert_eq!(not_resetting, Err(StoreError::Conflict("device is NEW at generation 1, not resetting at 1".into())));
    let (base, view) = store.begin_snapshot("b", "phone", 2, "s1", 4, expires, T0).await.unwrap();
    assert_eq!((base, view.len()), (0, 0));
    assert_eq!(store.snapshot_page("s1", 0).await, Ok(None), "a building snapshot serves no page");
    assert_eq!(store.ack_snapshot("b", "phone", "s1", T0).await, Ok((false, resetting)), "not ready yet");
    let pages = vec![vec!["i0".to_string(), "i1".to_string()], vec!["i2".to_string()]];
    store.finish_snapshot("s1", "digest", pages.clone()).await.unwrap();
    assert_eq!(store.snapshot_page("s1", 1).await, Ok(Some(pages[1].clone())));
    assert_eq!(store.snapshot_page("s1", 2).await, Ok(None), "past the last page");
    assert_eq!(store.ack_snapshot("b", "desk", "s1", T0).await, Err(not_found("snapshot s1")), "another device's");
    assert_eq!(store.ack_snapshot("b", "phone", "s9", T0).await, Err(not_found("snapshot s9")));
    assert_eq!(store.ack_snapshot("b", "phone", "s1", expires).await, Ok((false, resetting)), "expired");
    let active = DeviceCursor { generation: 2, acked_sync_seq: base, state: DeviceState::Active };
    assert_eq!(store.ack_snapshot("b", "phone", "s1", expires - 1).await, Ok((true, active)));
    assert_eq!(store.ack_snapshot("b", "phone", "s1", T0).await, Ok((false, active)), "installs once");
    assert_eq!(store.snapshot("s1").await.unwrap().unwrap().state, SNAPSHOT_INSTALLED);
    assert_eq!(store.snapshot_page("s1", 0).await, Ok(None), "an installed snapshot serves no page");
}

/// D7, issue 16 item 5: a snapshot view comes from one read snapshot, its
/// base first, then the conversations in `conv.list` order in chunks of the
/// size asked; the writer records the snapshot only at a base the log still
/// holds, and stores it a page per request until it is sealed.
pub async fn snapshot_views_come_in_chunks_at_their_base(store: &dyn Store) {
    users(store, &["a", "b", "c", "d"]).await;
    for (peer, id) in [("b", "c1"), ("c", "c2"), ("d", "c3")] {
        store.create_direct("a", peer, id, T0).await.unwrap();
    }
    let rec = store.login_device("a", "phone", "Phone", T0).await.unwrap();
    let resetting = DeviceCursor { generation: 2, acked_sync_seq: 0, state: DeviceState::Resetting };
    assert!(store.cas_device_cursor("a", "phone", rec.cursor, resetting, T0).await.unwrap().0);
    let (tx, mut rx) = tokio::sync::mpsc::channel(8);
    store.read_snapshot_view("a", "phone", 4, 2, tx).await.unwrap();
    let mut parts = Vec::new();
    while let Some(part) = rx.recv().await {
        parts.push(match part {
            SnapshotViewPart::Base(log) => vec![format!("base {}", log.high_watermark)],
            SnapshotViewPart::Privacy { version, .. } => vec![format!("privacy {version}")],
            SnapshotViewPart::Convs(convs) => convs.into_iter().map(|c| c.state.conv).collect(),
        });
    }
    let want: Vec<Vec<&str>> = vec![vec!["base 0"], vec!["privacy 0"], vec!["c1", "c2"], vec!["c3"]];
    assert_eq!(parts, want, "D7: the base, the switches, then chunks of two in list order");
    // A reader whose receiver is gone stops without an error.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    drop(rx);
    assert_eq!(store.read_snapshot_view("a", "phone", 4, 1, tx).await, Ok(()));

    let open = |base, generation| store.open_snapshot("a", "phone", generation, "s1", base, T0 + 1_000, T0);
    assert_eq!(
        open(1, 2).await,
        Err(StoreError::Conflict("the log moved past the snapshot's base 1 (trimmed to 0, head 0); retry".into()))
    );
    assert_eq!(
        open(0, 3).await,
        Err(StoreError::Conflict("device is RESETTING at generation 2, not resetting at 3".into()))
    );
    open(0, 2).await.unwrap();
    let not_building = Err(StoreError::Conflict("snapshot s1 is not building".into()));
    store.add_snapshot_page("s1", 0, vec!["i0".into(), "i1".into()]).await.unwrap();
    store.add_snapshot_page("s1", 1, vec!["i2".into()]).await.unwrap();
    assert_eq!(store.snapshot_page("s1", 0).await, Ok(None), "a building snapshot serves no page");
    store.seal_snapshot("s1", "digest", 2).await.unwrap();
    assert_eq!(store.add_snapshot_page("s1", 2, vec!["late".into()]).await, not_building, "READY never changes");
    assert_eq!(store.seal_snapshot("s1", "digest", 3).await, not_building);
    let meta = store.snapshot("s1").await.unwrap().unwrap();
    assert_eq!((meta.state.as_str(), meta.pages, meta.base_sync_seq), (SNAPSHOT_READY, 2, 0));
    assert_eq!(store.snapshot_page("s1", 0).await, Ok(Some(vec!["i0".to_string(), "i1".to_string()])));
    assert_eq!(store.snapshot_page("s1", 1).await, Ok(Some(vec!["i2".to_string()])));
}

/// `conv.list` pages (issue 19): keyset pages over `conv`, each row as
/// the whole list has it, so following `after` lists every conversation
/// once, a conversation created meanwhile above the cursor included.
pub async fn conversation_pages_follow_the_key(store: &dyn Store) {
    users(store, &["a", "b", "c", "d", "e"]).await;
    for (peer, id) in [("c", "c2"), ("b", "c1"), ("d", "c3")] {
        store.create_direct("a", peer, id, T0).await.unwrap();
    }
    store.accept_send(send("b", "c1", "x")).await.unwrap();
    while !store.fan_out_next(16, T0).await.unwrap().items.is_empty() {}
    let page = |after: &'static str, limit| async move {
        store.conversations_after("a", Some("phone"), after, limit).await.unwrap()
    };
    let ids = |rows: &[ConvState]| rows.iter().map(|r| r.conv.clone()).collect::<Vec<_>>();
    let first = page("", 2).await;
    assert_eq!(ids(&first), ["c1", "c2"], "by conv, not by list order");
    let whole = store.list_conversations("a", Some("phone")).await.unwrap();
    assert_eq!(ids(&whole), ["c1", "c2", "c3"]);
    assert_eq!(first[0], whole[0], "a page's row is the list's row");
    assert_eq!(first[0].last_msg_seq, 1);
    store.create_direct("a", "e", "c4", T0).await.unwrap();
    assert_eq!(ids(&page("c2", 2).await), ["c3", "c4"], "created behind the cursor: still listed");
    assert_eq!(ids(&page("c4", 2).await), Vec::<String>::new());
    assert_eq!(ids(&page("c0", 1).await), ["c1"], "after need not be a conversation");
}

/// F2, F3, R3: one event per recipient, contiguous sync_seq, a redelivered
/// item changes nothing, unread moves once.
pub async fn fan_out_is_idempotent_and_projects_once(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    for i in 0..3 {
        store.accept_send(send("a", &conv, &format!("{i}"))).await.unwrap();
    }
    let items = store.pending_outbox(100).await.unwrap();
    assert_eq!(items.len(), 3);
    let report = store.fan_out(items.clone(), T0).await.unwrap();
    assert_eq!(report.events_written, 6, "F2: one event per recipient, sender included");
    assert_eq!(report.users, vec![("a".to_string(), 3), ("b".to_string(), 3)]);
    assert_eq!(store.outbox_stats().await.unwrap().backlog, 0, "F1: consumed items leave the outbox");
    // The relay crashed after the commit and delivers the same items again.
    let again = store.fan_out(items.clone(), T0).await.unwrap();
    assert_eq!((again.events_written, again.duplicates_skipped), (0, 6), "F3: redelivery writes nothing");
    assert_eq!(store.user_high_watermark("b").await.unwrap(), 3);
    let list = store.list_conversations("b", None).await.unwrap();
    assert_eq!((list[0].last_msg_seq, list[0].unread), (3, 3), "R3: unread moved once per event");
    let own = store.list_conversations("a", None).await.unwrap();
    assert_eq!((own[0].unread, own[0].read_seq), (0, 3), "own messages are not unread");
    let events = store.read_user_events("b", 0, 3, 10).await.unwrap();
    let seqs: Vec<u64> = events.iter().map(|e| e.sync_seq).collect();
    assert_eq!(seqs, vec![1, 2, 3], "F2: contiguous sync_seq");
    let msg_seqs: Vec<Option<u64>> = events.iter().map(|e| e.msg_seq).collect();
    assert_eq!(msg_seqs, vec![Some(1), Some(2), Some(3)]);
    assert_eq!(events[0].message.as_ref().unwrap().content, "{\"text\":\"0\"}");
    // The redelivered items and a new one in one batch: the duplicates
    // take no sync_seq, the new event the next one of each log.
    store.accept_send(send("a", &conv, "3")).await.unwrap();
    let mut mixed = items;
    mixed.extend(store.pending_outbox(100).await.unwrap());
    assert_eq!(mixed.len(), 4);
    let report = store.fan_out(mixed, T0).await.unwrap();
    assert_eq!((report.events_written, report.duplicates_skipped), (2, 6), "F3: only the new item writes");
    assert_eq!(report.users, vec![("a".to_string(), 4), ("b".to_string(), 4)], "F2: the next sync_seq, no hole");
    let seqs: Vec<u64> = store.read_user_events("b", 0, 4, 10).await.unwrap().iter().map(|e| e.sync_seq).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4], "F2: contiguous sync_seq across a redelivery");
}

/// R3, issue 18: a fan-out batch that delivers many events to one user's
/// row of a conversation moves it as one delivery after another would:
/// a read cursor moved ahead of the fan-out (`read` caps at the head, not
/// at what was delivered) counts nothing it covers, a message the user
/// deleted for themselves first counts nothing, the user's own events move
/// the read cursor, and unread and mentions count the rest once.
pub async fn one_batch_counts_as_its_deliveries_one_by_one(store: &dyn Store) {
    users(store, &["a", "b", "c"]).await;
    store.create_group(ev("g", "a", "create"), vec!["b".into(), "c".into()]).await.unwrap(); // 1
    for m in ["m1", "m2", "m3"] {
        store.accept_send(send("a", "g", m)).await.unwrap(); // 2, 3, 4
    }
    let read = store.mark_read("c", "g", 4, T0).await.unwrap();
    assert_eq!(read.read_seq, 4, "R1: read caps at the head, delivered or not");
    store.accept_send(mention("a", "g", "m4", &["c"], false)).await.unwrap(); // 5
    let m5 = store.accept_send(mention("b", "g", "m5", &["c"], false)).await.unwrap(); // 6
    store.accept_send(mention("b", "g", "m6", &["c"], false)).await.unwrap(); // 7
    store.delete_for_me("c", "g", &m5.message_id, T0).await.unwrap();
    let items = store.pending_outbox(100).await.unwrap();
    assert_eq!(items.len(), 7);
    let report = store.fan_out(items, T0).await.unwrap();
    assert_eq!(report.events_written, 21, "F2: every item to every member, in one batch");
    let row = |user: &'static str| async move {
        let s = state_of(store.list_conversations(user, None).await.unwrap(), "g");
        (s.last_msg_seq, s.read_seq, s.unread, s.mentions)
    };
    assert_eq!(row("c").await, (7, 4, 2, 2), "c: m4 and m6 above the read cursor; m5 deleted; both mention c");
    assert_eq!(row("b").await, (7, 7, 0, 0), "b: its own m6 is the newest");
    assert_eq!(row("a").await, (7, 5, 2, 0), "a: read to its own m4, m5 and m6 above");
    store.accept_send(send("a", "g", "m7")).await.unwrap(); // 8
    drain(store).await;
    assert_eq!(row("c").await, (8, 4, 3, 2), "the next batch counts on from there");
    let seqs: Vec<u64> = store.read_user_events("c", 0, 8, 10).await.unwrap().iter().map(|e| e.sync_seq).collect();
    assert_eq!(seqs.len(), 8, "F2: one event per item");
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "F2: contiguous sync_seq {seqs:?}");
}

/// F1, F3: the relay's claim takes the oldest items up to its limit, fans
/// them out in the same transaction and leaves the rest; concurrent claims
/// (one store here; several nodes in the cluster tests) deliver every item
/// once and keep each log in `msg_seq` order.
pub async fn fan_out_next_claims_in_outbox_order(store: Arc<dyn Store>) {
    users(&*store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    let empty = store.fan_out_next(10, T0).await.unwrap();
    assert!(empty.items.is_empty() && empty.report == FanoutReport::default(), "nothing pending, nothing claimed");
    for i in 0..5 {
        store.accept_send(send("a", &conv, &format!("{i}"))).await.unwrap();
    }
    let first = store.fan_out_next(2, T0).await.unwrap();
    assert_eq!(first.items.iter().map(|i| i.msg_seq).collect::<Vec<_>>(), vec![1, 2], "oldest first, bounded");
    assert_eq!((first.report.items_done, first.report.events_written), (2, 4));
    assert_eq!(store.outbox_stats().await.unwrap().backlog, 3, "the rest stays pending");
    for i in 5..20 {
        store.accept_send(send("a", &conv, &format!("{i}"))).await.unwrap();
    }
    let mut claims = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let store = store.clone();
        claims.spawn(async move {
            let mut done = 0;
            loop {
                let claimed = store.fan_out_next(3, T0).await.unwrap();
                if claimed.items.is_empty() {
                    return done;
                }
                done += claimed.report.items_done;
            }
        });
    }
    let done: u64 = claims.join_all().await.into_iter().sum();
    assert_eq!(done, 18, "F1: every remaining item claimed once");
    assert_eq!(store.outbox_stats().await.unwrap().backlog, 0);
    let events = store.read_user_events("b", 0, 100, 100).await.unwrap();
    let msg_seqs: Vec<u64> = events.iter().filter_map(|e| e.msg_seq).collect();
    assert_eq!(msg_seqs, (1..=20).collect::<Vec<_>>(), "F3: once each, in msg_seq order");
}

/// D2: reads are exactly the half-open range, ascending, bounded.
pub async fn user_log_pages_are_ranges(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    for i in 0..10 {
        store.accept_send(send("a", &conv, &format!("{i}"))).await.unwrap();
    }
    store.fan_out(store.pending_outbox(100).await.unwrap(), T0).await.unwrap();
    let page = store.read_user_events("b", 3, 7, 100).await.unwrap();
    assert_eq!(page.iter().map(|e| e.sync_seq).collect::<Vec<_>>(), vec![4, 5, 6, 7]);
    let page = store.read_user_events("b", 3, 10, 2).await.unwrap();
    assert_eq!(page.iter().map(|e| e.sync_seq).collect::<Vec<_>>(), vec![4, 5]);
    assert!(store.read_user_events("b", 10, 10, 5).await.unwrap().is_empty());
}

/// D1, D4: ACKs move one device only, forward only, in its generation only.
pub async fn ack_is_a_monotonic_cas_per_device(store: &dyn Store) {
    users(store, &["b"]).await;
    let phone = store.login_device("b", "phone", "Phone", T0).await.unwrap();
    store.login_device("b", "desk", "Desk", T0).await.unwrap();
    let active = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::Active };
    assert!(store.cas_device_cursor("b", "phone", phone.cursor, active, T0).await.unwrap().0);
    let r = store.ack("b", "phone", 1, None, 9, T0).await.unwrap();
    assert_eq!(r.decision, AckDecision::Advance { to: 9 });
    let r = store.ack("b", "phone", 1, None, 4, T0).await.unwrap();
    assert_eq!((r.decision, r.cursor.acked_sync_seq), (AckDecision::Unchanged { acked: 9 }, 9), "D4: never back");
    let r = store.ack("b", "phone", 0, None, 12, T0).await.unwrap();
    assert_eq!(r.decision, AckDecision::StaleGeneration { current: 1 }, "D4: older generation refused");
    assert_eq!(store.device("b", "phone").await.unwrap().unwrap().cursor.acked_sync_seq, 9);
    let desk = store.device("b", "desk").await.unwrap().unwrap();
    assert_eq!((desk.cursor.acked_sync_seq, desk.cursor.state), (0, DeviceState::New), "D1: other device untouched");
    let r = store.ack("b", "desk", 1, None, 3, T0).await.unwrap();
    assert_eq!(r.decision, AckDecision::Resetting { current: 1 }, "a never-synced device cannot ACK");
}

/// D5: a CAS with a stale expectation changes nothing.
pub async fn cursor_cas_refuses_a_stale_expectation(store: &dyn Store) {
    users(store, &["b"]).await;
    let rec = store.login_device("b", "phone", "Phone", T0).await.unwrap();
    let bumped = DeviceCursor { generation: 2, acked_sync_seq: 0, state: DeviceState::Resetting };
    assert!(store.cas_device_cursor("b", "phone", rec.cursor, bumped, T0).await.unwrap().0);
    let other = DeviceCursor { generation: 3, acked_sync_seq: 0, state: DeviceState::Resetting };
    let (won, now) = store.cas_device_cursor("b", "phone", rec.cursor, other, T0).await.unwrap();
    assert!(!won, "the expectation is stale");
    assert_eq!(now, bumped);
}

/// L1: once a device installs a snapshot, its other live snapshots (one
/// whose `snapshot.begin` reply was lost) can never be installed, and stop
/// fencing retention at once; another device's snapshot is untouched.
pub async fn installing_a_snapshot_expires_the_devices_other_snapshots(store: &dyn Store) {
    users(store, &["b"]).await;
    let resetting = DeviceCursor { generation: 2, acked_sync_seq: 0, state: DeviceState::Resetting };
    for device in ["phone", "desk"] {
        let rec = store.login_device("b", device, device, T0).await.unwrap();
        assert!(store.cas_device_cursor("b", device, rec.cursor, resetting, T0).await.unwrap().0);
    }
    let later = T0 + 3_600_000;
    for (device, id) in [("phone", "lost"), ("desk", "other-device"), ("phone", "second")] {
        store.begin_snapshot("b", device, 2, id, 4, later, T0).await.unwrap();
        store.finish_snapshot(id, "digest", vec![]).await.unwrap();
    }
    let (installed, cursor) = store.ack_snapshot("b", "phone", "second", T0).await.unwrap();
    assert!(installed);
    assert_eq!(cursor.state, DeviceState::Active);
    let state = |id: &'static str| async move { store.snapshot(id).await.unwrap().unwrap().state };
    assert_eq!(state("second").await, "INSTALLED");
    assert_eq!(state("lost").await, "EXPIRED", "L1: the abandoned snapshot stops fencing");
    assert_eq!(state("other-device").await, "READY", "another device's snapshot is its own");
    assert!(!store.ack_snapshot("b", "phone", "lost", T0).await.unwrap().0, "an expired snapshot never installs");
}

/// P1: refresh tokens rotate once; a token presented again revokes its
/// whole family (the successor included) and no other family; an expired
/// one is refused and forgotten; expired tokens of a device are forgotten
/// when it gets a new one.
pub async fn refresh_tokens_are_used_once(store: &dyn Store) {
    users(store, &["b"]).await;
    let rec = |family: &str, expires_at_ms: i64| RefreshRecord {
        user: "b".into(),
        device: "phone".into(),
        expires_at_ms,
        family: family.into(),
    };
    let far = T0 + 1_000;
    store.put_refresh_token("h1", &rec("f1", far), T0).await.unwrap();
    store.put_refresh_token("other", &rec("f2", far), T0).await.unwrap();
    assert_eq!(store.use_refresh_token("h1", T0).await.unwrap(), RefreshUse::Rotated(rec("f1", far)));
    store.put_refresh_token("h2", &rec("f1", far), T0).await.unwrap();
    // The replay of h1 revokes f1: h2 is gone too; f2 is untouched.
    assert_eq!(store.use_refresh_token("h1", T0).await.unwrap(), RefreshUse::FamilyRevoked(rec("f1", far)));
    assert_eq!(store.use_refresh_token("h2", T0).await.unwrap(), RefreshUse::Unknown);
    assert_eq!(store.use_refresh_token("h1", T0).await.unwrap(), RefreshUse::Unknown);
    assert_eq!(store.use_refresh_token("other", T0).await.unwrap(), RefreshUse::Rotated(rec("f2", far)));
    // Expired: refused once, then unknown.
    store.put_refresh_token("old", &rec("f3", T0 + 1), T0).await.unwrap();
    assert_eq!(store.use_refresh_token("old", T0 + 1).await.unwrap(), RefreshUse::Expired(rec("f3", T0 + 1)));
    assert_eq!(store.use_refresh_token("old", T0 + 1).await.unwrap(), RefreshUse::Unknown);
    // A used token is remembered until it expires; a new token of the
    // device then forgets it.
    store.put_refresh_token("h4", &rec("f4", T0 + 10), T0).await.unwrap();
    assert!(matches!(store.use_refresh_token("h4", T0).await.unwrap(), RefreshUse::Rotated(_)));
    store.put_refresh_token("h5", &rec("f4", far), T0 + 10).await.unwrap();
    assert_eq!(store.use_refresh_token("h4", T0 + 11).await.unwrap(), RefreshUse::Unknown);
    assert_eq!(store.use_refresh_token("h5", T0 + 11).await.unwrap(), RefreshUse::Rotated(rec("f4", far)));
}

/// P1, P5: the device list; a password change drops the other devices'
/// refresh tokens; a forced logout of a device or a user records its end
/// and drops their tokens; deactivation stops logins, drops every token
/// and is reported once; `session_fences` reads back every end.
pub async fn devices_list_and_sessions_end_durably(store: &dyn Store) {
    users(store, &["b", "c"]).await;
    store.login_device("b", "phone", "Phone", T0).await.unwrap();
    store.login_device("b", "laptop", "Laptop", T0 + 1).await.unwrap();
    store.login_device("c", "phone", "Phone", T0).await.unwrap();
    store.revoke_device("b", "laptop", T0 + 2).await.unwrap();
    let listed: Vec<(String, String, i64, DeviceState)> = store
        .list_devices("b")
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.device, d.name, d.created_at_ms, d.state))
        .collect();
    assert_eq!(
        listed,
        vec![
            ("laptop".into(), "Laptop".into(), T0 + 1, DeviceState::Revoked),
            ("phone".into(), "Phone".into(), T0, DeviceState::New)
        ]
    );
    assert!(store.list_devices("nobody").await.unwrap().is_empty());

    let token = |user: &str, device: &str, family: &str| RefreshRecord {
        user: user.into(),
        device: device.into(),
        expires_at_ms: T0 + 1_000,
        family: family.into(),
    };
    let live = |h: &'static str| async move {
        matches!(store.use_refresh_token(h, T0).await.unwrap(), RefreshUse::Rotated(_))
    };
    store.put_refresh_token("b-phone", &token("b", "phone", "f1"), T0).await.unwrap();
    store.put_refresh_token("b-tab", &token("b", "tab", "f2"), T0).await.unwrap();
    assert!(store.change_password("b", "new-phc", "phone").await.unwrap());
    assert!(!store.change_password("nobody", "x", "phone").await.unwrap());
    assert_eq!(store.password_hash("b").await.unwrap().as_deref(), Some("new-phc"));
    assert!(!live("b-tab").await, "another device's token is gone");
    assert!(live("b-phone").await, "the changing device keeps its token");

    store.put_refresh_token("c-phone", &token("c", "phone", "f3"), T0).await.unwrap();
    store.put_refresh_token("b-phone-2", &token("b", "phone", "f4"), T0).await.unwrap();
    assert!(store.end_sessions("b", Some("phone"), T0 + 10).await.unwrap());
    assert!(!store.end_sessions("b", Some("none"), T0 + 10).await.unwrap());
    assert!(!store.end_sessions("nobody", None, T0 + 10).await.unwrap());
    assert!(!live("b-phone-2").await);
    assert!(store.end_sessions("b", None, T0 + 20).await.unwrap());
    assert!(store.end_sessions("b", None, T0 + 15).await.unwrap(), "an earlier end moves nothing back");

    assert!(store.deactivate_user("c", T0 + 30).await.unwrap());
    assert!(!store.deactivate_user("c", T0 + 31).await.unwrap());
    assert_eq!(store.deactivate_user("nobody", T0).await, Err(StoreError::NotFound("no such user".into())));
    assert_eq!(store.password_hash("c").await.unwrap(), None, "a deactivated account does not log in");
    assert!(!live("c-phone").await);

    let fences = store.session_fences().await.unwrap();
    assert_eq!(fences.deactivated, vec!["c".to_string()]);
    let mut users_ended = fences.users_ended.clone();
    users_ended.sort();
    assert_eq!(users_ended, vec![("b".to_string(), T0 + 20), ("c".to_string(), T0 + 30)]);
    assert_eq!(fences.devices_ended, vec![("b".to_string(), "phone".to_string(), T0 + 10)]);
}

/// P1: audit entries come back by user and time range, oldest first, up
/// to a limit; trimming deletes the older ones only. Users are listed by
/// name with their deactivation.
pub async fn audit_log_is_queried_by_user_and_time_and_trimmed(store: &dyn Store) {
    let entry = |at_ms: i64, event: &str, user_hash: &str, device: Option<&str>| AuditEntry {
        at_ms,
        event: event.into(),
        actor: "self".into(),
        user_hash: user_hash.into(),
        device_hash: device.map(str::to_owned),
        address: device.map(|_| "127.0.0.1".to_owned()),
    };
    let all = [
        entry(T0, "login", "hb", Some("hp")),
        entry(T0 + 1, "login_failed", "hc", None),
        entry(T0 + 1, "refresh", "hb", Some("hp")),
        entry(T0 + 5, "logged_out", "hb", None),
    ];
    for e in &all {
        store.append_audit(e).await.unwrap();
    }
    assert_eq!(store.audit_log(None, T0, T0 + 10, 100).await.unwrap(), all.to_vec());
    assert_eq!(
        store.audit_log(Some("hb"), T0, T0 + 10, 100).await.unwrap(),
        vec![all[0].clone(), all[2].clone(), all[3].clone()]
    );
    assert_eq!(store.audit_log(Some("hb"), T0 + 1, T0 + 5, 100).await.unwrap(), vec![all[2].clone()]);
    assert_eq!(store.audit_log(None, T0, T0 + 10, 2).await.unwrap(), all[..2].to_vec());
    assert!(store.audit_log(Some("nobody"), T0, T0 + 10, 100).await.unwrap().is_empty());
    assert_eq!(store.trim_audit(T0 + 1).await.unwrap(), 1);
    assert_eq!(store.audit_log(None, 0, i64::MAX, 100).await.unwrap(), all[1..].to_vec());

    users(store, &["b", "a"]).await;
    store.deactivate_user("b", T0 + 9).await.unwrap();
    let listed: Vec<(String, Option<i64>)> =
        store.list_users().await.unwrap().into_iter().map(|u| (u.user, u.deactivated_at_ms)).collect();
    assert_eq!(listed, vec![("a".to_string(), None), ("b".to_string(), Some(T0 + 9))]);
}

/// P5: deleting a user removes its devices (cursors), refresh tokens and
/// log (the trim point moves to the head, which stays), deactivates it,
/// keeps its row so the name is never reused, and touches no other user;
/// a second delete reports it was done.
pub async fn deleting_a_user_removes_its_devices_log_and_cursors_and_keeps_a_tombstone(store: &dyn Store) {
    users(store, &["b", "c"]).await;
    store.login_device("b", "phone", "Phone", T0).await.unwrap();
    store.login_device("c", "phone", "Phone", T0).await.unwrap();
    let (conv, _) = store.create_direct("b", "c", "dbc", T0).await.unwrap();
    for user in ["b", "c"] {
        store
            .update_settings(user, &conv, SettingsUpdate { muted: Some(true), ..SettingsUpdate::default() }, T0)
            .await
            .unwrap();
    }
    let rec = RefreshRecord { user: "b".into(), device: "phone".into(), expires_at_ms: T0 + 1_000, family: "f".into() };
    store.put_refresh_token("hb", &rec, T0).await.unwrap();
    let head = store.user_log("b").await.unwrap().high_watermark;
    assert!(head >= 1);

    assert!(store.delete_user("b", T0 + 5).await.unwrap());
    assert!(!store.delete_user("b", T0 + 6).await.unwrap(), "deleted already");
    assert_eq!(store.delete_user("nobody", T0).await, Err(StoreError::NotFound("no such user".into())));
    assert!(store.list_devices("b").await.unwrap().is_empty());
    assert_eq!(store.device("b", "phone").await.unwrap(), None);
    assert_eq!(store.use_refresh_token("hb", T0).await.unwrap(), RefreshUse::Unknown);
    assert!(store.read_user_events("b", 0, head, 100).await.unwrap().is_empty(), "the log is gone");
    let log = store.user_log("b").await.unwrap();
    assert_eq!((log.high_watermark, log.trimmed_upto), (head, head), "no sync_seq is reused");
    assert_eq!(store.password_hash("b").await.unwrap(), None);
    assert!(!store.create_user("b", "phc", T0 + 7).await.unwrap(), "the name is never given again");
    let b = store.list_users().await.unwrap().into_iter().find(|u| u.user == "b").unwrap();
    assert_eq!((b.deactivated_at_ms, b.deleted_at_ms), (Some(T0 + 5), Some(T0 + 5)));
    assert_eq!(store.session_fences().await.unwrap().deactivated, vec!["b".to_string()]);
    // An event that still reaches the deleted user's log (its membership
    // stays) is trimmed by the next retention pass, however young.
    store
        .update_settings("b", &conv, SettingsUpdate { pinned: Some(true), ..SettingsUpdate::default() }, T0 + 8)
        .await
        .unwrap();
    let grown = store.user_log("b").await.unwrap().high_watermark;
    assert_eq!(grown, head + 1);
    let keep_all_young = RetentionPolicy {
        keep_events_younger_than_ms: 1_000_000,
        device_inactive_after_ms: 1_000_000,
        history_keep_ms: None,
    };
    store.trim_user_logs(keep_all_young, T0 + 9).await.unwrap();
    assert_eq!(store.user_log("b").await.unwrap().trimmed_upto, grown);
    assert!(store.read_user_events("b", 0, grown, 100).await.unwrap().is_empty());
    // The other user keeps everything, the conversation included.
    assert_eq!(store.list_devices("c").await.unwrap().len(), 1);
    assert_eq!(store.read_user_events("c", 0, 100, 100).await.unwrap().len(), 1);
    assert!(store.conversation(&conv).await.unwrap().is_some());
}

/// P5: revocation sticks, survives re-login, and drops refresh tokens.
pub async fn revocation_is_durable(store: &dyn Store) {
    users(store, &["b"]).await;
    store.login_device("b", "phone", "Phone", T0).await.unwrap();
    let rec = RefreshRecord { user: "b".into(), device: "phone".into(), expires_at_ms: T0 + 1, family: "f".into() };
    store.put_refresh_token("h1", &rec, T0).await.unwrap();
    assert!(store.revoke_device("b", "phone", T0).await.unwrap());
    assert!(!store.revoke_device("b", "phone", T0).await.unwrap());
    assert_eq!(store.use_refresh_token("h1", T0).await.unwrap(), RefreshUse::Unknown);
    let again = store.login_device("b", "phone", "Phone", T0).await.unwrap();
    assert_eq!(again.cursor.state, DeviceState::Revoked);
    assert_eq!(store.revoked_devices().await.unwrap(), vec![("b".to_string(), "phone".to_string())]);
    let r = store.ack("b", "phone", 1, None, 1, T0).await.unwrap();
    assert_eq!(r.decision, AckDecision::Revoked);
}

/// L3: history retention moves `min_seq` up, expires contents below it,
/// keeps recall tombstones, and `history` says the page stops there.
pub async fn history_retention_moves_the_boundary(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    let m1 = store.accept_send(send("a", &conv, "1")).await.unwrap();
    store.accept_send(send("a", &conv, "2")).await.unwrap();
    let cmd = ConvEventCmd {
        conv: conv.clone(),
        actor: "a".into(),
        actor_device: "d1".into(),
        event_id: "r1".into(),
        client_msg_id: "r1".into(),
        now_ms: T0,
    };
    store.recall(cmd, &m1.message_id).await.unwrap();
    store.fan_out(store.pending_outbox(10).await.unwrap(), T0).await.unwrap();
    let keep = RetentionPolicy {
        keep_events_younger_than_ms: i64::MAX / 4,
        device_inactive_after_ms: 1,
        history_keep_ms: None,
    };
    let r = store.trim_user_logs(keep, T0 + 1_000).await.unwrap();
    assert_eq!(r.conversations_trimmed, 0, "L3: no history policy, no trim");
    let expire = RetentionPolicy { history_keep_ms: Some(500), ..keep };
    let r = store.trim_user_logs(expire, T0 + 1_000).await.unwrap();
    assert_eq!(
        (r.conversations_trimmed, r.messages_expired),
        (1, 1),
        "L3: only message 2 expires; the recall pair stays"
    );
    let h = store.history("b", &conv, None, 10).await.unwrap();
    assert!(h.messages.is_empty() && h.trimmed && !h.has_more, "L3: the page says it stops at retention");
    assert_eq!(h.history_start, 4);
    let page = store.conv_sync("b", &conv, 0, 10, None).await.unwrap();
    assert!(page.trimmed && page.min_seq == 4 && page.events.is_empty());
    let log = store.read_user_events("b", 0, 10, 10).await.unwrap();
    let states: Vec<&str> = log.iter().map(|e| e.message.as_ref().unwrap().state.as_str()).collect();
    assert_eq!(states, vec![STATE_RECALLED, STATE_EXPIRED, "normal"], "L3: tombstones outlive the window");
}

/// D2, D5, L2: a sync page's facts, decision and events come back together;
/// the range is the decision's, rendered for the reader (deleted-for-me,
/// reactions), and a trimmed range is a reset, never a partial page.
pub async fn sync_pages_read_their_facts_and_events_together(store: &dyn Store) {
    use tidemark_core::cursor::{ClientPosition, RecoveryPolicy, Resume};
    use tidemark_core::page::{NextPage, PageDecision, PageQuery};
    users(store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    for i in 0..10 {
        store.accept_send(send("a", &conv, &format!("{i}"))).await.unwrap();
    }
    store.fan_out(store.pending_outbox(100).await.unwrap(), T0).await.unwrap();
    assert_eq!(store.sync_facts("b", "phone").await.unwrap(), None, "an unknown device has no facts");
    let first = |generation, local| PageQuery::First {
        client: ClientPosition { generation, local_applied_sync_seq: Some(local) },
        policy: RecoveryPolicy::NO_RECOVERY,
        now_ms: T0,
    };
    assert!(store.sync_page("b", "phone", first(None, 0), 4).await.unwrap().is_none());
    let phone = store.login_device("b", "phone", "Phone", T0).await.unwrap();
    let hw = store.user_high_watermark("b").await.unwrap();
    assert!(hw >= 10);
    let read = store.sync_page("b", "phone", first(None, 0), 4).await.unwrap().unwrap();
    assert_eq!(read.facts.device, phone.cursor);
    assert_eq!(read.facts.log.high_watermark, hw);
    assert_eq!(Some(read.facts.clone()), store.sync_facts("b", "phone").await.unwrap());
    assert_eq!(read.decision, PageDecision::First(Resume::Activate { generation: phone.cursor.generation }));
    assert_eq!(read.events.iter().map(|e| e.sync_seq).collect::<Vec<_>>(), vec![1, 2, 3, 4], "D2: (0, hw], bounded");

    let active = DeviceCursor { generation: phone.cursor.generation, acked_sync_seq: 0, state: DeviceState::Active };
    assert!(store.cas_device_cursor("b", "phone", phone.cursor, active, T0).await.unwrap().0);
    store.ack("b", "phone", active.generation, None, 6, T0).await.unwrap();
    // Rendering for the reader, from the same read.
    let last = read.events.last().unwrap().message.clone().unwrap();
    store.delete_for_me("b", &conv, &last.message_id, T0).await.unwrap();
    let cmd = ConvEventCmd {
        conv: conv.clone(),
        actor: "a".into(),
        actor_device: "d1".into(),
        event_id: "e-react".into(),
        client_msg_id: "react".into(),
        now_ms: T0,
    };
    let liked = "m-a-7";
    store.react(cmd, liked, "+1", true).await.unwrap();
    let read = store.sync_page("b", "phone", first(Some(active.generation), 6), 100).await.unwrap().unwrap();
    assert_eq!(read.decision, PageDecision::First(Resume::Replay { generation: active.generation, from: 6 }));
    assert_eq!(read.events.first().map(|e| e.sync_seq), Some(7), "D5: from the server's ACK");
    let m = read.events.iter().filter_map(|e| e.message.as_ref()).find(|m| m.message_id == liked).unwrap();
    assert_eq!(m.reactions, vec![("+1".to_owned(), vec!["a".to_owned()])], "reactions come with the page");
    let next = |position| PageQuery::Next {
        generation: active.generation,
        position,
        high_watermark: hw,
        recovery_session: None,
        now_ms: T0,
    };
    let read = store.sync_page("b", "phone", next(3), 1).await.unwrap().unwrap();
    assert_eq!(read.decision, PageDecision::Next(NextPage::Serve { after: 3, upto: hw }));
    let m = read.events[0].message.as_ref().unwrap();
    assert_eq!((m.state.as_str(), m.content.as_str()), (STATE_DELETED, "{}"), "deleted for this reader");

    let policy =
        RetentionPolicy { keep_events_younger_than_ms: 0, device_inactive_after_ms: 1_000_000, history_keep_ms: None };
    store.trim_user_logs(policy, T0 + 1_000).await.unwrap();
    let trimmed = store.sync_facts("b", "phone").await.unwrap().unwrap().log.trimmed_upto;
    assert_eq!(trimmed, 6, "L1: trimmed up to the device's ACK");
    let read = store.sync_page("b", "phone", next(3), 100).await.unwrap().unwrap();
    assert_eq!(
        (read.decision, read.events.len()),
        (PageDecision::Next(NextPage::Reset), 0),
        "L2: never a partial page"
    );
    let read = store.sync_page("b", "phone", next(6), 100).await.unwrap().unwrap();
    assert_eq!(read.events.first().map(|e| e.sync_seq), Some(7));
}

/// P2, P5: each connection of a device gets the next epoch of that device
/// (another device's connections do not move it), and the fences read back
/// what was committed: the newest epoch and the revocation.
pub async fn connection_epochs_are_per_device_and_durable(store: &dyn Store) {
    users(store, &["b"]).await;
    store.login_device("b", "phone", "Phone", T0).await.unwrap();
    store.login_device("b", "desk", "Desk", T0).await.unwrap();
    let pair = |d: &str| ("b".to_string(), d.to_string());
    let fences = store.device_fences(&[pair("phone"), pair("desk"), pair("gone")]).await.unwrap();
    assert!(fences.iter().all(|f| f.connection_epoch == 0 && !f.revoked), "P2: no connection yet: {fences:?}");
    assert_eq!(fences.len(), 2, "an unknown device has no fences");
    let epoch = |d: &'static str| async move { store.open_connection("b", d).await.unwrap().connection_epoch };
    assert_eq!(epoch("phone").await, 1);
    assert_eq!(epoch("desk").await, 1, "P2: epochs are per device");
    assert_eq!(epoch("phone").await, 2);
    assert!(matches!(store.open_connection("b", "gone").await, Err(StoreError::NotFound(_))));
    // A re-login keeps the epoch: it numbers connections, not logins.
    let phone = store.login_device("b", "phone", "Phone", T0 + 1).await.unwrap();
    let active = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::Active };
    assert!(store.cas_device_cursor("b", "phone", phone.cursor, active, T0).await.unwrap().0);
    store.ack("b", "phone", 1, None, 7, T0).await.unwrap();
    assert!(store.revoke_device("b", "desk", T0).await.unwrap());
    let mut fences = store.device_fences(&[pair("phone"), pair("desk")]).await.unwrap();
    fences.sort_by(|a, b| a.device.cmp(&b.device));
    let seen: Vec<(&str, u64, bool, u64)> =
        fences.iter().map(|f| (f.device.as_str(), f.connection_epoch, f.revoked, f.acked_sync_seq)).collect();
    assert_eq!(seen, vec![("desk", 1, true, 0), ("phone", 2, false, 7)], "P2/P5/D8: the fences as committed");
    // Opening a connection reads the device's ACK and the user's head with
    // the epoch it commits (what the hub registers it with).
    users(store, &["c"]).await;
    let (conv, _) = store.create_direct("b", "c", "c-open", T0).await.unwrap();
    store.accept_send(send("c", &conv, "o1")).await.unwrap();
    store.fan_out(store.pending_outbox(100).await.unwrap(), T0).await.unwrap();
    let head = store.user_high_watermark("b").await.unwrap();
    assert!(head > 0);
    let opened = store.open_connection("b", "phone").await.unwrap();
    assert_eq!(opened, OpenedConnection { connection_epoch: 3, acked_sync_seq: 7, high_watermark: head });
}

/// Issue 18: a change of the privacy switches is one `privacy` event in the
/// user's own log, written with the switches (its data the switches after
/// it and their version, its key the version); a no-op set writes no event
/// and moves nothing; a snapshot view carries the switches at its base.
pub async fn privacy_changes_are_user_events_once_per_change(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    let set = |hide: Option<bool>, private: Option<bool>| PrivacyUpdate {
        hide_presence: hide,
        private_receipts: private,
        ..PrivacyUpdate::default()
    };
    let log = |u: &'static str| async move { store.read_user_events(u, 0, 1_000, 100).await.unwrap() };
    let data = |e: &StoredEvent| e.data.clone().unwrap_or_default();

    let (hidden, first) = store.update_privacy("a", set(Some(true), None), T0).await.unwrap();
    assert_eq!(hidden, Privacy { hide_presence: true, ..Privacy::default() });
    assert_eq!(first.written, Some(1), "the change is the user's next log position");
    let events = log("a").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0].kind.as_str(), events[0].conv.as_str(), events[0].msg_seq), (EVENT_PRIVACY, "", None));
    assert_eq!(
        data(&events[0]),
        r#"{"hide_presence":true,"private_receipts":false,"push_preview":"full","version":1}"#
    );
    assert_eq!(store.user_log("a").await.unwrap().high_watermark, 1);

    // The same switches again: nothing written, the head stays.
    let (same, noop) = store.update_privacy("a", set(Some(true), Some(false)), T0 + 1).await.unwrap();
    assert_eq!((same, noop.written), (hidden, None), "a no-op set writes no event");
    assert_eq!(store.set_privacy("a", PrivacyUpdate::default(), T0 + 2).await.unwrap(), hidden);
    assert_eq!(log("a").await.len(), 1, "still one event");
    assert_eq!(store.user_log("a").await.unwrap().high_watermark, 1);

    // A second change is a second event, at the next version; another
    // user's log is untouched.
    let (both, second) = store.update_privacy("a", set(None, Some(true)), T0 + 3).await.unwrap();
    assert_eq!(both, Privacy { hide_presence: true, private_receipts: true, ..Privacy::default() });
    assert_eq!(second.written, Some(2));
    let events = log("a").await;
    assert_eq!(events.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(), [EVENT_PRIVACY, EVENT_PRIVACY]);
    assert_eq!(data(&events[1]), r#"{"hide_presence":true,"private_receipts":true,"push_preview":"full","version":2}"#);
    assert!(log("b").await.is_empty(), "only the user's own log");

    // The snapshot view carries the switches at its base.
    let rec = store.login_device("a", "tablet", "Tablet", T0).await.unwrap();
    let resetting =
        DeviceCursor { generation: rec.cursor.generation + 1, acked_sync_seq: 0, state: DeviceState::Resetting };
    assert!(store.cas_device_cursor("a", "tablet", rec.cursor, resetting, T0).await.unwrap().0);
    let (tx, mut rx) = tokio::sync::mpsc::channel(8);
    store.read_snapshot_view("a", "tablet", 4, 10, tx).await.unwrap();
    let mut seen = None;
    while let Some(part) = rx.recv().await {
        if let SnapshotViewPart::Privacy { privacy, version } = part {
            seen = Some((privacy, version));
        }
    }
    assert_eq!(seen, Some((both, 2)), "the view's switches are the last change's");
}

/// P2 (issue 14): a send, an ACK or a read that came on an older
/// connection of the device than its newest is refused `Superseded` by the
/// store itself and changes nothing: no `msg_seq`, no idempotency key, no
/// cursor; the newest connection and HTTP (no epoch) go on.
pub async fn frames_of_a_superseded_connection_change_nothing(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    let a = store.login_device("a", "d1", "Phone", T0).await.unwrap();
    store.login_device("b", "p", "Phone", T0).await.unwrap();
    let (conv, _) = store.create_direct("a", "b", "c-fence", T0).await.unwrap();
    for (user, device) in [("a", "d1"), ("b", "p")] {
        assert_eq!(store.open_connection(user, device).await.unwrap().connection_epoch, 1);
        assert_eq!(store.open_connection(user, device).await.unwrap().connection_epoch, 2);
    }
    let on = |epoch: Option<u64>, cmid: &str| SendCmd { connection_epoch: epoch, ..send("a", &conv, cmid) };
    let late = store.accept_send(on(Some(1), "late")).await;
    assert_eq!(late, Err(StoreError::Superseded(2)), "P2: a send of the older connection");
    assert_eq!(store.conversation(&conv).await.unwrap().unwrap().head, 0, "it took no msg_seq");
    let sent = store.accept_send(on(Some(2), "late")).await.unwrap();
    assert_eq!((sent.msg_seq, sent.duplicate), (1, false), "the key is new: the late frame left nothing");
    let retry = store.accept_send(on(None, "late")).await.unwrap();
    assert!(retry.duplicate && retry.msg_seq == 1, "HTTP carries no epoch: {retry:?}");
    assert_eq!(
        store.accept_send(on(Some(1), "late")).await,
        Err(StoreError::Superseded(2)),
        "refused before the idempotency lookup too"
    );
    store.fan_out(store.pending_outbox(100).await.unwrap(), T0).await.unwrap();

    // ACK: the cursor does not move on the older connection.
    let active = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::Active };
    assert!(store.cas_device_cursor("a", "d1", a.cursor, active, T0).await.unwrap().0);
    let head = store.user_high_watermark("a").await.unwrap();
    assert!(head > 0);
    let late = store.ack_on(Some(1), "a", "d1", 1, None, head, T0).await;
    assert_eq!(late, Err(StoreError::Superseded(2)), "P2: an ACK of the older connection");
    assert_eq!(store.device("a", "d1").await.unwrap().unwrap().cursor, active, "the cursor did not move");
    let acked = store.ack_on(Some(2), "a", "d1", 1, None, head, T0).await.unwrap();
    assert_eq!(acked.cursor.acked_sync_seq, head, "the newest connection ACKs");

    // Read: the read cursor and the unread count stay.
    let unread = |s: Vec<ConvState>| s.into_iter().find(|s| s.conv == conv).map(|s| (s.read_seq, s.unread));
    let late = store.mark_read_on("b", &conv, 1, Some(("p", 1)), T0).await;
    assert_eq!(late, Err(StoreError::Superseded(2)), "P2: a read of the older connection");
    assert_eq!(unread(store.list_conversations("b", None).await.unwrap()), Some((0, 1)), "nothing was read");
    let head_b = store.user_high_watermark("b").await.unwrap();
    let late = store.mark_read_on("b", "c-none", 1, Some(("p", 1)), T0).await;
    assert_eq!(late, Err(StoreError::Superseded(2)), "refused before the membership check too");
    assert_eq!(store.user_high_watermark("b").await.unwrap(), head_b, "no read event was written");
    let read = store.mark_read_on("b", &conv, 1, Some(("p", 2)), T0).await.unwrap();
    assert_eq!((read.read_seq, read.unread), (1, 0), "the newest connection reads");
    assert_eq!(unread(store.list_conversations("b", None).await.unwrap()), Some((1, 0)));
}

/// Issue 18: privacy switches are durable and written only on a change;
/// presence reaches the users sharing an open conversation; read receipts
/// show current members minus private ones (R2), a departed member is not
/// shown; delivery receipts (R1) are the sender's, in direct conversations.
pub async fn privacy_audience_and_receipts(store: &dyn Store) {
    users(store, &["a", "b", "c", "d", "e"]).await;
    assert_eq!(store.privacy("a").await.unwrap(), Privacy::default(), "switches start off");
    let hidden = store
        .set_privacy("a", PrivacyUpdate { hide_presence: Some(true), ..PrivacyUpdate::default() }, T0)
        .await
        .unwrap();
    assert_eq!(hidden, Privacy { hide_presence: true, ..Privacy::default() });
    assert_eq!(store.set_privacy("a", PrivacyUpdate::default(), T0).await.unwrap(), hidden, "no change keeps them");
    assert_eq!(store.privacy("a").await.unwrap(), hidden, "switches are durable");
    store.set_privacy("a", PrivacyUpdate { hide_presence: Some(false), ..PrivacyUpdate::default() }, T0).await.unwrap();
    assert!(matches!(
        store.set_privacy("nobody", PrivacyUpdate { hide_presence: Some(true), ..PrivacyUpdate::default() }, T0).await,
        Err(StoreError::NotFound(_))
    ));

    let (direct, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    store.create_group(ev("g1", "a", "e1"), vec!["c".into(), "d".into()]).await.unwrap();
    let audience = |u: &'static str| async move { store.presence_audience(u, 100).await.unwrap() };
    assert_eq!(audience("a").await, vec!["b", "c", "d"], "everyone sharing a conversation, sorted, once");
    assert_eq!(audience("c").await, vec!["a", "d"]);
    assert_eq!(audience("e").await, Vec::<String>::new());
    assert_eq!(store.presence_audience("a", 2).await.unwrap(), vec!["b", "c"], "bounded by the limit");
    // The connect path's one read: the same switches and audience.
    store
        .set_privacy(
            "c",
            PrivacyUpdate { hide_presence: Some(true), private_receipts: Some(true), ..PrivacyUpdate::default() },
            T0,
        )
        .await
        .unwrap();
    for (u, limit) in [("a", 100), ("a", 2), ("c", 100), ("e", 100), ("nobody", 100)] {
        let facts = store.presence_facts(u, limit).await.unwrap();
        let apart = (store.privacy(u).await.unwrap(), store.presence_audience(u, limit).await.unwrap());
        assert_eq!(facts, apart, "presence_facts({u}, {limit})");
    }
    store
        .set_privacy(
            "c",
            PrivacyUpdate { hide_presence: Some(false), private_receipts: Some(false), ..PrivacyUpdate::default() },
            T0,
        )
        .await
        .unwrap();

    for i in 0..3 {
        store.accept_send(send("a", "g1", &format!("g{i}"))).await.unwrap();
    }
    let m1 = store.accept_send(send("a", &direct, "d1")).await.unwrap();
    let m2 = store.accept_send(send("b", &direct, "d2")).await.unwrap();
    while !store.fan_out_next(100, T0).await.unwrap().items.is_empty() {}
    store.mark_read("c", "g1", 3, T0).await.unwrap();
    store.mark_read("d", "g1", 2, T0).await.unwrap();
    let seen = store.conv_receipts("a", "g1", Some(3)).await.unwrap();
    let a_read = seen.members.iter().find(|(u, _)| u == "a").map(|(_, s)| *s).unwrap();
    assert_eq!(seen.members, vec![("a".into(), a_read), ("c".into(), 3), ("d".into(), 2)], "R2 to others");
    assert_eq!((seen.hidden, seen.read_count, seen.truncated), (0, Some(1), false));
    store
        .set_privacy("d", PrivacyUpdate { private_receipts: Some(true), ..PrivacyUpdate::default() }, T0)
        .await
        .unwrap();
    let seen = store.conv_receipts("c", "g1", None).await.unwrap();
    assert_eq!(seen.members.iter().map(|(u, _)| u.as_str()).collect::<Vec<_>>(), vec!["a", "c"], "d is private");
    assert_eq!(seen.hidden, 1);
    let own = store.conv_receipts("d", "g1", None).await.unwrap();
    assert!(own.members.contains(&("d".into(), 2)), "a private member still sees their own position");
    store.change_membership(ev("g1", "c", "leave-c"), "c", MembershipChange::Leave).await.unwrap();
    let seen = store.conv_receipts("a", "g1", None).await.unwrap();
    assert!(!seen.members.iter().any(|(u, _)| u == "c"), "a departed member's position is not shown");
    assert_eq!(store.conv_receipts("c", "g1", None).await, Err(StoreError::NotMember), "nor to them");
    assert_eq!(store.conv_receipts("e", "g1", None).await, Err(StoreError::NotMember));
    assert!(matches!(store.conv_receipts("a", "nope", None).await, Err(StoreError::NotFound(_))));

    let ids = vec![m1.message_id.clone()];
    assert_eq!(store.delivery_receipts("a", &direct, ids.clone()).await.unwrap(), vec![(m1.message_id.clone(), None)]);
    store.record_delivery("a", "d1", ids.clone(), T0).await.unwrap();
    assert_eq!(
        store.delivery_receipts("a", &direct, ids.clone()).await.unwrap(),
        vec![(m1.message_id.clone(), None)],
        "the sender's own devices are not a delivery"
    );
    store.record_delivery("b", "phone", ids.clone(), T0 + 5).await.unwrap();
    store.record_delivery("b", "desk", ids.clone(), T0 + 9).await.unwrap();
    assert_eq!(
        store.delivery_receipts("a", &direct, ids.clone()).await.unwrap(),
        vec![(m1.message_id.clone(), Some(T0 + 5))],
        "R1: the first delivery to the peer"
    );
    let theirs = store.delivery_receipts("a", &direct, vec![m2.message_id.clone()]).await;
    assert!(matches!(theirs, Err(StoreError::Forbidden(_))), "only the sender reads them: {theirs:?}");
    let group = store.delivery_receipts("a", "g1", vec![]).await;
    assert!(matches!(group, Err(StoreError::Forbidden(_))), "direct conversations only: {group:?}");
    assert!(matches!(store.delivery_receipts("a", &direct, vec!["m-none".into()]).await, Err(StoreError::NotFound(_))));
    assert_eq!(store.delivery_receipts("c", &direct, vec![]).await, Err(StoreError::NotMember));
}

/// O1 (`Store::gauges`): the scrape-time sample counts exactly what the
/// store holds: the outbox, the highest user head, the cursor furthest
/// behind, devices below the trim point, live recovery sessions and
/// snapshots with the age of the oldest, each ending when it expires.
pub async fn gauges_sample_what_the_store_holds(store: &dyn Store) {
    assert_eq!(store.gauges(T0).await.unwrap(), StoreGauges::default(), "an empty store samples zeros");
    users(store, &["a", "b"]).await;
    let (conv, _) = store.create_direct("a", "b", "c1", T0).await.unwrap();
    for i in 0..4 {
        store.accept_send(send("a", &conv, &format!("{i}"))).await.unwrap();
    }
    let g = store.gauges(T0).await.unwrap();
    assert_eq!(g.outbox, store.outbox_stats().await.unwrap());
    assert_eq!(g.outbox.backlog, 4);
    assert_eq!(g.user_high_watermark_max, 0, "nothing fanned out yet");
    drain(store).await;
    let phone = store.login_device("b", "phone", "Phone", T0).await.unwrap();
    store.login_device("b", "desk", "Desk", T0).await.unwrap();
    let active = DeviceCursor { generation: 1, acked_sync_seq: 0, state: DeviceState::Active };
    assert!(store.cas_device_cursor("b", "phone", phone.cursor, active, T0).await.unwrap().0);
    store.ack("b", "phone", 1, None, 3, T0).await.unwrap();
    let g = store.gauges(T0).await.unwrap();
    assert_eq!(g.outbox.backlog, 0);
    assert_eq!(g.user_high_watermark_max, 4, "each user's log holds the 4 messages");
    assert_eq!(g.retained_events_max, 4, "nothing trimmed");
    assert_eq!(g.cursor_lag_events_max, 4, "the desk never ACKed: 4 behind (the phone is 1 behind)");
    assert_eq!(g.devices_below_trim, 0);
    assert!(store.revoke_device("b", "desk", T0).await.unwrap());
    assert_eq!(store.gauges(T0).await.unwrap().cursor_lag_events_max, 1, "a revoked device holds nothing back");

    // A recovery session opened at T0 + 10, live until T0 + 1_000.
    let cursor = store.device("b", "phone").await.unwrap().unwrap().cursor;
    let session = tidemark_core::cursor::RecoveryInfo {
        session_id: "r1".into(),
        resume_from: 1,
        high_watermark: 4,
        expires_at_ms: T0 + 1_000,
    };
    assert!(store.begin_recovery("b", "phone", cursor, session, T0 + 10).await.unwrap().0);
    let g = store.gauges(T0 + 20).await.unwrap();
    assert_eq!((g.recovery_sessions, g.recovery_oldest_created_at_ms), (1, Some(T0 + 10)));
    assert_eq!((g.snapshot_sessions, g.snapshot_oldest_created_at_ms), (0, None));
    let g = store.gauges(T0 + 1_000).await.unwrap();
    assert_eq!((g.recovery_sessions, g.recovery_oldest_created_at_ms), (0, None), "an expired session is not live");

    // A snapshot started at T0 + 30 for the phone, reset meanwhile.
    let cursor = store.device("b", "phone").await.unwrap().unwrap().cursor;
    let resetting = DeviceCursor { generation: cursor.generation + 1, state: DeviceState::Resetting, ..cursor };
    assert!(store.cas_device_cursor("b", "phone", cursor, resetting, T0 + 30).await.unwrap().0);
    store.begin_snapshot("b", "phone", resetting.generation, "s1", 4, T0 + 2_000, T0 + 30).await.unwrap();
    let g = store.gauges(T0 + 40).await.unwrap();
    assert_eq!((g.snapshot_sessions, g.snapshot_oldest_created_at_ms), (1, Some(T0 + 30)));
    assert_eq!(store.gauges(T0 + 2_000).await.unwrap().snapshot_sessions, 0, "an expired snapshot is not live");

    // Retention trims a's log to the ACK of its one active device; a's
    // other device, quiet since T0 and ACKed at 1, is left below it.
    for (device, acked, at) in [("a1", 4, T0 + 3_000), ("a2", 1, T0)] {
        let rec = store.login_device("a", device, device, at).await.unwrap();
        assert!(store.cas_device_cursor("a", device, rec.cursor, active, at).await.unwrap().0);
        store.ack("a", device, 1, None, acked, at).await.unwrap();
    }
    let window =
        RetentionPolicy { keep_events_younger_than_ms: 0, device_inactive_after_ms: 1_000, history_keep_ms: None };
    store.trim_user_logs(window, T0 + 3_000).await.unwrap();
    assert_eq!(store.user_log("a").await.unwrap().trimmed_upto, 4);
    let g = store.gauges(T0 + 3_000).await.unwrap();
    assert_eq!(g.retained_events_max, 4, "b's log, with no active device, keeps its 4 events");
    assert_eq!(g.devices_below_trim, 1, "a2");
    assert_eq!(g.cursor_lag_events_max, 3, "a2 is 3 behind a's head");
}

/// O3 (`core::reconcile`, `tidemark_store::reconcile`): drift planted
/// behind the store's back is found relation by relation; the repairable
/// (a user event deleted, an outbox item removed before it ran, an unread
/// count corrupted) is repaired exactly once over two runs, the rest (an
/// ACK above the head, overlapping periods, an event whose message does
/// not exist, a conversation head off its messages) is reported and left
/// as it is. `raw` runs one statement on the backend's database, `count`
/// one `SELECT COUNT(*)`; both SQL texts are plain enough for either.
pub async fn reconciliation_repairs_once_and_reports_the_rest<X, XF, N, NF>(store: &dyn Store, raw: X, count: N)
where
    X: Fn(&'static str) -> XF,
    XF: std::future::Future<Output = ()>,
    N: Fn(&'static str) -> NF,
    NF: std::future::Future<Output = i64>,
{
    use crate::reconcile::{run, ReconcileConfig, ReconcileReport};
    use tidemark_core::reconcile::{reason, relation};

    users(store, &["a", "b", "c"]).await;
    store.login_device("a", "d1", "phone", T0).await.unwrap();
    store.create_group(ev("g1", "a", "e1"), vec!["b".into(), "c".into()]).await.unwrap();
    store.create_group(ev("g2", "a", "e2"), vec!["b".into()]).await.unwrap();
    store.accept_send(SendCmd { message_id: "m1".into(), ..send("a", "g1", "c1") }).await.unwrap();
    store.accept_send(SendCmd { message_id: "m2".into(), ..send("b", "g1", "c2") }).await.unwrap();
    drain(store).await;
    // A clean store: nothing found.
    let cfg = ReconcileConfig { messages_per_chunk: 2, users_per_chunk: 1, ..ReconcileConfig::default() };
    let clean = run(store, &cfg, T0).await.unwrap();
    assert_eq!((clean.found(), clean.messages_checked, clean.users_checked), (0, 4, 3), "{clean:?}");

    // The drift.
    // c has no message of its own in g1, so nothing moves its read cursor
    // past m1: the re-delivery must not count m1 a second time.
    raw("DELETE FROM user_events WHERE user_id = 'c' AND source_event_id = 'm1'").await;
    store.accept_send(SendCmd { message_id: "m3".into(), ..send("a", "g1", "c3") }).await.unwrap();
    raw("DELETE FROM outbox WHERE source_event_id = 'm3'").await;
    raw("UPDATE user_convs SET unread = 7 WHERE user_id = 'c' AND conv_id = 'g1'").await;
    raw("UPDATE devices SET acked_sync_seq = 999 WHERE user_id = 'a' AND device_id = 'd1'").await;
    raw("INSERT INTO membership_periods (conv_id, user_id, join_seq, leave_seq) VALUES ('g2', 'b', 0, NULL)").await;
    store.accept_send(SendCmd { message_id: "m4".into(), ..send("a", "g2", "c4") }).await.unwrap();
    drain(store).await;
    raw("DELETE FROM user_events WHERE user_id = 'a' AND source_event_id = 'm4'").await;
    raw("INSERT INTO user_events (user_id, sync_seq, kind, conv_id, msg_seq, message_id, source_event_id, period_id,
                                  data, created_at)
         VALUES ('c', 1000, 'message', 'g1', 50, 'ghost', 'ghost', 0, NULL, 0)")
    .await;
    raw("UPDATE conversations SET head = head + 5 WHERE conv_id = 'g2'").await;

    fn summary(r: &ReconcileReport) -> Vec<(&'static str, &'static str, String, String, bool, bool)> {
        let mut v: Vec<_> = r
            .findings
            .iter()
            .map(|f| {
                let x = &f.finding;
                let subject = x.message_id.clone().or(x.conv.clone()).unwrap_or_default();
                (x.relation, x.reason, x.user.clone().unwrap_or_default(), subject, x.repair.is_some(), f.repaired)
            })
            .collect();
        v.sort();
        v
    }
    let reported =
        |rel, why, user: &str, subject: &str| (rel, why, user.to_string(), subject.to_string(), false, false);
    let left_alone = vec![
        reported(relation::ACK_HEAD, reason::ACK_ABOVE_HEAD, "a", ""),
        reported(relation::CONV_HEAD, reason::HEAD_MISMATCH, "", "g2"),
        reported(relation::EVENT_SOURCE, reason::MESSAGE_MISSING, "c", "ghost"),
        reported(relation::FANOUT, reason::MISSING_UNSAFE, "a", "m4"),
        reported(relation::PERIODS, reason::OVERLAP_QUARANTINED, "b", "m4"),
        // g2's creation reached b before the overlap was planted.
        reported(relation::PERIODS, reason::OVERLAP_UNRECORDED, "b", "e2"),
    ];
    let repairable = |done: bool| {
        vec![
            (relation::FANOUT, reason::OUTBOX_ITEM_MISSING, "a".to_string(), "m3".to_string(), true, done),
            (relation::FANOUT, reason::OUTBOX_ITEM_MISSING, "b".to_string(), "m3".to_string(), true, done),
            (relation::FANOUT, reason::OUTBOX_ITEM_MISSING, "c".to_string(), "m3".to_string(), true, done),
            (relation::FANOUT, reason::USER_EVENT_MISSING, "c".to_string(), "m1".to_string(), true, done),
            (relation::UNREAD, reason::UNREAD_DRIFT, "c".to_string(), "g1".to_string(), true, done),
        ]
    };
    let expect = |done: bool| {
        let mut v = left_alone.clone();
        v.extend(repairable(done));
        v.sort();
        v
    };

    // A dry run finds everything and changes nothing.
    let dry = run(store, &ReconcileConfig { repair: false, ..cfg }, T0).await.unwrap();
    assert_eq!(summary(&dry), expect(false), "{dry:?}");
    assert_eq!(store.pending_outbox(10).await.unwrap().len(), 0, "a dry run re-enqueues nothing");
    assert_eq!(count("SELECT COUNT(*) FROM user_convs WHERE user_id = 'c' AND conv_id = 'g1' AND unread = 7").await, 1);

    // The first run repairs each repairable finding once: one item per
    // message, however many logs lack it.
    let first = run(store, &cfg, T0).await.unwrap();
    assert_eq!(summary(&first), expect(true), "{first:?}");
    assert_eq!((first.repaired(), first.reported()), (5, 6));
    let requeued: Vec<String> =
        store.pending_outbox(10).await.unwrap().into_iter().map(|i| i.source_event_id).collect();
    assert_eq!(requeued, vec!["m1".to_string(), "m3".into()], "one item per message missing from a log");
    assert_eq!(first.quarantine.len(), 1, "the quarantine report: {first:?}");
    assert_eq!(
        (first.quarantine[0].source_event_id.as_str(), first.quarantine[0].user.as_str()),
        ("m4", "b"),
        "overlapping periods go to a person"
    );
    // Between runs the relay runs (or not: a pending item is not drift).
    let pending = run(store, &cfg, T0).await.unwrap();
    assert_eq!(
        summary(&pending),
        {
            let mut v = left_alone.clone();
            v.sort();
            v
        },
        "{pending:?}"
    );
    drain(store).await;
    let second = run(store, &cfg, T0).await.unwrap();
    assert_eq!(
        summary(&second),
        {
            let mut v = left_alone.clone();
            v.sort();
            v
        },
        "nothing left to repair: {second:?}"
    );
    assert_eq!(second.repaired(), 0);
    assert_eq!(store.pending_outbox(10).await.unwrap().len(), 0);

    // Repaired exactly once: each log holds each message once.
    assert_eq!(count("SELECT COUNT(*) FROM user_events WHERE source_event_id = 'm1'").await, 3);
    assert_eq!(count("SELECT COUNT(*) FROM user_events WHERE source_event_id = 'm3'").await, 3);
    assert_eq!(count("SELECT COUNT(*) FROM user_events WHERE user_id = 'c' AND source_event_id = 'm1'").await, 1);
    let c_g1 = state_of(store.list_conversations("c", None).await.unwrap(), "g1");
    assert_eq!(c_g1.unread, 3, "c's unread: m1 and m2 recounted, m3 delivered late, m1 again not counted twice");
    // And the rest untouched.
    assert_eq!(store.device("a", "d1").await.unwrap().unwrap().cursor.acked_sync_seq, 999);
    assert_eq!(count("SELECT COUNT(*) FROM user_events WHERE source_event_id = 'm4'").await, 0);
    assert_eq!(count("SELECT COUNT(*) FROM user_events WHERE source_event_id = 'ghost'").await, 1);
    assert_eq!(count("SELECT COUNT(*) FROM conversations WHERE conv_id = 'g2' AND head = 7").await, 1);

    // The unread rebuild is the same job on one relation.
    raw("UPDATE user_convs SET unread = 9 WHERE user_id = 'b' AND conv_id = 'g1'").await;
    let rebuilt = crate::reconcile::rebuild_unread(store, 1).await.unwrap();
    assert_eq!(rebuilt, UnreadRebuild { rows_checked: 5, drifted: 1 });
    assert_eq!(crate::reconcile::rebuild_unread(store, 2).await.unwrap().drifted, 0);
}

fn push_target(user: &str, device: &str, token: &str, preview: &str) -> PushTarget {
    PushTarget {
        user: user.into(),
        device: device.into(),
        platform: "webhook".into(),
        token_sealed: format!("sealed:{token}").into_bytes(),
        token_hash: format!("h-{token}"),
        token_last4: token[token.len().saturating_sub(4)..].into(),
        app_id: "app".into(),
        p256dh: None,
        auth: None,
        preview: preview.into(),
        created_at_ms: T0,
        updated_at_ms: T0,
    }
}

const PUSH_LEASE_MS: i64 = 1_000;

/// P4: push targets are one per device, registered only for a live device,
/// removed by hash, by revocation and by deactivation; what a device owes
/// is its log above `max(acked, pushed_through)`, a new target starting at
/// the head; a claim is a lease with a number, a lost claim writes nothing,
/// and `pushed_through` only grows.
pub async fn push_targets_and_owed_claims(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    store.login_device("a", "d1", "A", T0).await.unwrap();
    store.login_device("b", "phone", "Phone", T0).await.unwrap();
    store.login_device("b", "tab", "Tab", T0).await.unwrap();
    store.create_direct("a", "b", "c1", T0).await.unwrap();
    store.accept_send(send("a", "c1", "before")).await.unwrap();
    drain(store).await;
    let head_before = store.user_high_watermark("b").await.unwrap();

    assert_eq!(store.put_push_target(push_target("b", "phone", "tok-1111", "none"), T0).await, Ok(true));
    assert_eq!(store.put_push_target(push_target("b", "phone", "tok-2222", "none"), T0 + 1).await, Ok(false));
    assert!(matches!(
        store.put_push_target(push_target("b", "nope", "tok-3333", "none"), T0).await,
        Err(StoreError::NotFound(_))
    ));
    let listed = store.push_targets("b").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].token_hash.as_str(), listed[0].token_last4.as_str(), listed[0].updated_at_ms),
        ("h-tok-2222", "2222", T0 + 1),
        "a registration replaces the device's target"
    );
    assert_eq!(listed[0].token_sealed, b"sealed:tok-2222");
    let claim = |at: i64| store.claim_pushes(at, PUSH_LEASE_MS, 10, 256);
    assert!(claim(T0).await.unwrap().is_empty(), "P4: nothing committed before the registration is owed");
    let owing = || async { store.gauges(T0).await.unwrap().push_targets_owing };
    assert_eq!(owing().await, 0, "the gauge agrees: no target owes");

    store.accept_send(send("a", "c1", "m1")).await.unwrap();
    store.accept_send(send("a", "c1", "m2")).await.unwrap();
    drain(store).await;
    assert_eq!(owing().await, 1, "one target owes two events");
    let claimed = claim(T0).await.unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    let owed = &claimed[0];
    assert_eq!((owed.target.device.as_str(), owed.attempts), ("phone", 0));
    let seen: Vec<(u64, &str, Option<&str>, bool)> =
        owed.events.iter().map(|e| (e.sync_seq, e.kind.as_str(), e.sender.as_deref(), e.muted)).collect();
    assert_eq!(
        seen,
        vec![(head_before + 1, EVENT_MESSAGE, Some("a"), false), (head_before + 2, EVENT_MESSAGE, Some("a"), false)],
        "the owed range is the log above the position, with senders"
    );
    assert!(owed.contents.iter().all(Option::is_none), "no content without a full preview");
    assert!(claim(T0).await.unwrap().is_empty(), "a claimed target is leased");
    assert_eq!(store.finish_push("b", "phone", owed.claim + 1, PushStep::Advance { through: 99 }, T0).await, Ok(false));
    let through = head_before + 2;
    assert_eq!(store.finish_push("b", "phone", owed.claim, PushStep::Advance { through }, T0).await, Ok(true));
    assert_eq!(
        store.finish_push("b", "phone", owed.claim, PushStep::Advance { through }, T0).await,
        Ok(false),
        "a claim ends once"
    );
    assert!(claim(T0).await.unwrap().is_empty(), "nothing is owed twice");
    assert_eq!(owing().await, 0, "settled: the gauge goes back");

    // Muting writes a settings event; the next message carries the mute.
    store
        .update_settings("b", "c1", SettingsUpdate { muted: Some(true), ..SettingsUpdate::default() }, T0)
        .await
        .unwrap();
    store.accept_send(send("a", "c1", "m3")).await.unwrap();
    drain(store).await;
    let owed = claim(T0).await.unwrap().pop().expect("owed again");
    let last = owed.events.last().unwrap();
    assert_eq!((last.kind.as_str(), last.muted), (EVENT_MESSAGE, true), "{:?}", owed.events);
    assert_eq!(owed.events[0].kind, EVENT_SETTINGS);
    // A retry waits and keeps its failures; the range is the same.
    let retry = PushStep::Retry { at_ms: T0 + 5_000, attempts: 2 };
    assert_eq!(store.finish_push("b", "phone", owed.claim, retry, T0).await, Ok(true));
    assert!(claim(T0 + 4_999).await.unwrap().is_empty(), "a retry is not due before its time");
    let again = claim(T0 + 5_000).await.unwrap().pop().expect("due again");
    assert_eq!((again.attempts, again.events.len()), (2, owed.events.len()));
    assert!(again.claim > owed.claim, "each claim has a new number");
    // A lease that ran out is claimed again; the old claim is lost.
    let taken = claim(T0 + 5_000 + PUSH_LEASE_MS).await.unwrap().pop().expect("lease ran out");
    let wait = PushStep::Wait { at_ms: T0 };
    assert_eq!(store.finish_push("b", "phone", again.claim, wait, T0).await, Ok(false), "a lost claim writes nothing");
    // An Advance never moves the position back.
    assert_eq!(store.finish_push("b", "phone", taken.claim, PushStep::Advance { through: 1 }, T0).await, Ok(true));
    assert_eq!(claim(T0 + 9_000).await.unwrap().len(), 1, "still owed: the position did not move forward");

    // A full preview brings the stored content.
    store.put_push_target(push_target("b", "tab", "tok-4444", "full"), T0).await.unwrap();
    store.accept_send(send("a", "c1", "m4")).await.unwrap();
    drain(store).await;
    let mut claimed = claim(T0 + 20_000).await.unwrap();
    claimed.sort_by(|x, y| x.target.device.cmp(&y.target.device));
    let tab = claimed.iter().find(|o| o.target.device == "tab").expect("tab owes m4");
    assert_eq!(tab.contents, vec![Some("{\"text\":\"m4\"}".to_string())]);

    // Removal by hash only removes that token; revocation and deactivation
    // remove the rest.
    assert_eq!(store.remove_push_target("b", "phone", Some("h-old")).await, Ok(false));
    assert_eq!(store.remove_push_target("b", "phone", Some("h-tok-2222")).await, Ok(true));
    assert_eq!(store.remove_push_target("b", "phone", None).await, Ok(false));
    store.put_push_target(push_target("b", "phone", "tok-5555", "none"), T0).await.unwrap();
    store.revoke_device("b", "phone", T0).await.unwrap();
    let left: Vec<String> = store.push_targets("b").await.unwrap().into_iter().map(|t| t.device).collect();
    assert_eq!(left, vec!["tab".to_string()], "P5: a revoked device loses its target");
    assert!(matches!(
        store.put_push_target(push_target("b", "phone", "tok-6666", "none"), T0).await,
        Err(StoreError::NotFound(_))
    ));
    store.deactivate_user("b", T0).await.unwrap();
    assert!(store.push_targets("b").await.unwrap().is_empty(), "a deactivated user has no push target");
}

/// P4: the user's and the conversation's push preview preferences default
/// to `full` (narrowing nothing), are stored by `privacy.set` and
/// `conv.settings` (a settings event carrying the conversation's), come
/// back with every owed claim, and keep the content out of a claim unless
/// the device, the user and the conversation all allow `full`.
pub async fn push_preview_preferences_are_stored_and_claimed(store: &dyn Store) {
    users(store, &["a", "b"]).await;
    store.login_device("b", "tab", "Tab", T0).await.unwrap();
    store.create_direct("a", "b", "c1", T0).await.unwrap();
    drain(store).await;
    assert_eq!(store.privacy("b").await.unwrap().push_preview, Preview::Full, "never set: narrows nothing");
    let row = state_of(store.list_conversations("b", None).await.unwrap(), "c1");
    assert_eq!(row.push_preview, Preview::Full);

    let set = |p| PrivacyUpdate { push_preview: Some(p), ..PrivacyUpdate::default() };
    let got = store.set_privacy("b", set(Preview::Conversation), T0).await.unwrap();
    assert_eq!((got.push_preview, got.hide_presence), (Preview::Conversation, false));
    assert_eq!(store.privacy("b").await.unwrap(), got, "stored");
    assert_eq!(store.presence_facts("b", 10).await.unwrap().0, got, "the one-statement read agrees");

    let quiet = SettingsUpdate { push_preview: Some(Preview::None), ..SettingsUpdate::default() };
    let (row, outcome) = store.update_settings("b", "c1", quiet, T0).await.unwrap();
    assert_eq!((row.push_preview, row.muted), (Preview::None, false));
    assert!(outcome.written.is_some(), "E3: a preference change is a settings event");
    let (_, again) = store.update_settings("b", "c1", quiet, T0).await.unwrap();
    assert_eq!(again.written, None, "no change writes nothing");
    let head = store.user_high_watermark("b").await.unwrap();
    let events = store.read_user_events("b", head - 1, head, 1).await.unwrap();
    let data = events.last().and_then(|e| e.data.clone()).unwrap_or_default();
    assert!(data.contains("\"push_preview\":\"none\""), "the settings event carries it: {data}");

    store.put_push_target(push_target("b", "tab", "tok-7777", "full"), T0).await.unwrap();
    store.accept_send(send("a", "c1", "quiet")).await.unwrap();
    drain(store).await;
    let owed = store.claim_pushes(T0, PUSH_LEASE_MS, 10, 256).await.unwrap().pop().expect("owed");
    assert_eq!(owed.user_preview, Preview::Conversation);
    let seen: Vec<(&str, Preview)> = owed.events.iter().map(|e| (e.conv.as_str(), e.preview)).collect();
    assert_eq!(seen, vec![("c1", Preview::None)]);
    assert_eq!(owed.contents, vec![None], "no content: the user allows only the conversation");
    let through = owed.events.last().unwrap().sync_seq;
    store.finish_push("b", "tab", owed.claim, PushStep::Advance { through }, T0).await.unwrap();

    // Everyone allows full in c1 again: the content comes with the claim.
    store.set_privacy("b", set(Preview::Full), T0).await.unwrap();
    let open = SettingsUpdate { push_preview: Some(Preview::Full), ..SettingsUpdate::default() };
    store.update_settings("b", "c1", open, T0).await.unwrap();
    store.accept_send(send("a", "c1", "open")).await.unwrap();
    drain(store).await;
    let owed = store.claim_pushes(T0, PUSH_LEASE_MS, 10, 256).await.unwrap().pop().expect("owed");
    assert_eq!(owed.user_preview, Preview::Full);
    let last = owed.events.last().unwrap();
    assert_eq!((last.kind.as_str(), last.preview), (EVENT_MESSAGE, Preview::Full));
    assert_eq!(owed.contents.last().cloned().flatten().as_deref(), Some("{\"text\":\"open\"}"));
}

/// P4 in cluster mode: concurrent claims never hand one target out twice.
pub async fn push_claims_are_exclusive_under_concurrency(store: Arc<dyn Store>) {
    users(&*store, &["a", "b"]).await;
    store.login_device("a", "d1", "A", T0).await.unwrap();
    let devices: Vec<String> = (0..8).map(|i| format!("dev{i}")).collect();
    for d in &devices {
        store.login_device("b", d, "D", T0).await.unwrap();
        store.put_push_target(push_target("b", d, &format!("tok-{d}"), "none"), T0).await.unwrap();
    }
    store.create_direct("a", "b", "c1", T0).await.unwrap();
    store.accept_send(send("a", "c1", "m1")).await.unwrap();
    drain(&*store).await;
    let claims = (0..4).map(|_| {
        let store = store.clone();
        tokio::spawn(async move { store.claim_pushes(T0, PUSH_LEASE_MS, 3, 10).await.unwrap() })
    });
    let mut got = Vec::new();
    for c in claims {
        got.extend(c.await.unwrap().into_iter().map(|o| o.target.device));
    }
    got.sort();
    assert_eq!(got, devices, "every target claimed exactly once");
}
