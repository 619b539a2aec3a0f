//! The reconciliation job (O3, seed 000 §18.3) over any [`Store`]: it walks
//! the conversation side in chunks of messages and the user side in chunks
//! of users, lets `tidemark_core::reconcile` name what each chunk's facts
//! break, applies the repairs it names (each idempotent, each its own short
//! writer request) and reports the rest. The reads run on the stores' read
//! connections, never in the writer; a chunk is bounded
//! ([`MESSAGES_PER_CHUNK`], [`USERS_PER_CHUNK`]), so the writer serves other
//! writes between any two repairs. It knows no SQL: the backends load the
//! facts.
//!
//! Run twice, it repairs nothing the second time: a re-enqueued item is
//! pending (so its message is not drift) or has run (so the logs hold it),
//! and a recounted row equals its recount.

use std::collections::{BTreeMap, BTreeSet};

use tidemark_core::reconcile::{check_conv, check_message, check_user, Finding, Repair};

use crate::{OutboxItem, QuarantineRecord, Store, StoreResult, UnreadRebuild};

/// Messages per conversation-side chunk (one read snapshot each).
pub const MESSAGES_PER_CHUNK: u32 = 500;
/// Users per user-side chunk (one read snapshot each).
pub const USERS_PER_CHUNK: u32 = 200;
/// Quarantine records read per request.
pub const QUARANTINE_PER_CHUNK: u32 = 500;
/// Findings (and quarantine records) a report lists; beyond, only counted.
pub const FINDINGS_MAX: usize = 1000;

/// What a run checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every relation.
    All,
    /// Unread counts only (the unread rebuild).
    Unread,
}

/// How a run goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcileConfig {
    /// Apply the repairs `core::reconcile` names (else only report them).
    pub repair: bool,
    pub scope: Scope,
    pub messages_per_chunk: u32,
    pub users_per_chunk: u32,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        ReconcileConfig {
            repair: true,
            scope: Scope::All,
            messages_per_chunk: MESSAGES_PER_CHUNK,
            users_per_chunk: USERS_PER_CHUNK,
        }
    }
}

/// One finding and what the run did with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub finding: Finding,
    /// The repair was applied and changed something.
    pub repaired: bool,
}

/// Counts for one relation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelationCounts {
    pub found: u64,
    /// Repairs applied that changed something.
    pub repaired: u64,
    /// For a person: no safe repair.
    pub reported: u64,
}

/// What one run found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub messages_checked: u64,
    pub convs_checked: u64,
    pub users_checked: u64,
    /// Conversation rows whose unread was checked.
    pub unread_rows_checked: u64,
    pub chunks: u64,
    pub by_relation: BTreeMap<&'static str, RelationCounts>,
    /// The first [`FINDINGS_MAX`] findings.
    pub findings: Vec<Found>,
    pub findings_left_off: u64,
    /// Every quarantine record (overlapping membership periods, F4), the
    /// first [`FINDINGS_MAX`].
    pub quarantine: Vec<QuarantineRecord>,
    pub quarantine_total: u64,
}

impl ReconcileReport {
    pub fn found(&self) -> u64 {
        self.by_relation.values().map(|c| c.found).sum()
    }
    pub fn repaired(&self) -> u64 {
        self.by_relation.values().map(|c| c.repaired).sum()
    }
    pub fn reported(&self) -> u64 {
        self.by_relation.values().map(|c| c.reported).sum()
    }

    fn record(&mut self, finding: Finding, repaired: bool) {
        let counts = self.by_relation.entry(finding.relation).or_default();
        counts.found += 1;
        counts.repaired += u64::from(repaired);
        counts.reported += u64::from(finding.repair.is_none());
        if self.findings.len() < FINDINGS_MAX {
            self.findings.push(Found { finding, repaired });
        } else {
            self.findings_left_off += 1;
        }
    }
}

/// Applies one repair; `true` when it changed something.
async fn apply(store: &dyn Store, repair: &Repair, now_ms: i64) -> StoreResult<bool> {
    match repair {
        Repair::Requeue { conv, message_id } => store.requeue_fanout(conv, message_id, now_ms).await,
        Repair::Recount { user, conv } => Ok(store.recount_unread(user, conv).await?.is_some_and(|r| r.changed())),
    }
}

/// Records a chunk's findings, applying each distinct repair once (a
/// message missing from two logs is re-enqueued once).
async fn settle(
    store: &dyn Store,
    cfg: &ReconcileConfig,
    report: &mut ReconcileReport,
    findings: Vec<Finding>,
    now_ms: i64,
) -> StoreResult<()> {
    let mut done: BTreeMap<Repair, bool> = BTreeMap::new();
    for f in findings {
        let repaired = match (&f.repair, cfg.repair) {
            (Some(r), true) => match done.get(r) {
                Some(&changed) => changed,
                None => {
                    let changed = apply(store, r, now_ms).await?;
                    if changed {
                        tracing::warn!(relation = f.relation, reason = f.reason, repair = ?r, "reconciliation repaired");
                    }
                    done.insert(r.clone(), changed);
                    changed
                }
            },
            _ => {
                if f.repair.is_none() {
                    tracing::error!(relation = f.relation, reason = f.reason, conv = ?f.conv, user = ?f.user,
                        message_id = ?f.message_id, "reconciliation found drift it must not repair");
                }
                false
            }
        };
        report.record(f, repaired);
    }
    Ok(())
}

/// One full run: the conversation side, the user side, the quarantine.
pub async fn run(store: &dyn Store, cfg: &ReconcileConfig, now_ms: i64) -> StoreResult<ReconcileReport> {
    assert!(cfg.messages_per_chunk > 0 && cfg.users_per_chunk > 0, "reconciliation chunks must not be empty");
    let mut report = ReconcileReport::default();
    if cfg.scope == Scope::All {
        let mut after = None;
        let mut convs = BTreeSet::new();
        loop {
            let chunk = store.reconcile_messages(after, cfg.messages_per_chunk).await?;
            report.chunks += 1;
            report.messages_checked += chunk.messages.len() as u64;
            let mut findings = Vec::new();
            for c in &chunk.convs {
                convs.insert(c.conv.clone());
                findings.extend(check_conv(c));
            }
            for m in &chunk.messages {
                findings.extend(check_message(m));
            }
            settle(store, cfg, &mut report, findings, now_ms).await?;
            match chunk.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        report.convs_checked = convs.len() as u64;
    }
    let mut after = None;
    loop {
        let chunk = store.reconcile_users(after, cfg.users_per_chunk).await?;
        report.chunks += 1;
        report.users_checked += chunk.users.len() as u64;
        let mut findings = Vec::new();
        for u in &chunk.users {
            report.unread_rows_checked += u.unread.len() as u64;
            findings.extend(
                check_user(u)
                    .into_iter()
                    .filter(|f| cfg.scope == Scope::All || f.relation == tidemark_core::reconcile::relation::UNREAD),
            );
        }
        settle(store, cfg, &mut report, findings, now_ms).await?;
        match chunk.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    if cfg.scope == Scope::All {
        let mut after = None;
        loop {
            let page = store.quarantine(after, QUARANTINE_PER_CHUNK).await?;
            let full = page.len() as u32 == QUARANTINE_PER_CHUNK;
            after = page.last().map(|q| (q.source_event_id.clone(), q.user.clone()));
            report.quarantine_total += page.len() as u64;
            for q in page {
                if report.quarantine.len() < FINDINGS_MAX {
                    report.quarantine.push(q);
                }
            }
            if !full {
                break;
            }
        }
    }
    Ok(report)
}

/// The unread rebuild (R3): every row recounted, chunk by chunk, drift
/// repaired (`POST /v1/admin/unread/rebuild`).
pub async fn rebuild_unread(store: &dyn Store, users_per_chunk: u32) -> StoreResult<UnreadRebuild> {
    let cfg = ReconcileConfig { scope: Scope::Unread, users_per_chunk, ..ReconcileConfig::default() };
    let report = run(store, &cfg, 0).await?;
    Ok(UnreadRebuild { rows_checked: report.unread_rows_checked, drifted: report.found() })
}

/// The facts of one message row as a backend's message chunk reads it,
/// and, unless its own outbox item is still pending, the outbox item the
/// fan-out resolves its recipients from (the backends then add what their
/// SQL finds: recipients, the sender's period, missing deliveries).
pub fn message_facts(
    conv: String,
    msg_seq: u64,
    message_id: String,
    sender: String,
    kind: String,
    outbox_pending: bool,
) -> (tidemark_core::reconcile::MessageFacts, Option<OutboxItem>) {
    let item = (!outbox_pending).then(|| OutboxItem {
        outbox_id: 0,
        kind: tidemark_core::kinds::event_kind_of(&kind).into(),
        source_event_id: message_id.clone(),
        conv: conv.clone(),
        msg_seq,
        actor: sender.clone(),
        created_at_ms: 0,
    });
    let facts = tidemark_core::reconcile::MessageFacts {
        outbox_pending,
        conv,
        message_id,
        msg_seq,
        sender,
        kind,
        ..Default::default()
    };
    (facts, item)
}
