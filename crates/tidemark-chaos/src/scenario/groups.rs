//! The groups: each user's control connection straight to the server (no
//! proxy, no faults), the groups it creates (in the three shapes of
//! [`GroupShape`]: shared from creation, crossing the large-group
//! threshold mid-run, per-member throughout) and every membership change,
//! with the `msg_seq` of its event, for the checker; and, once the run
//! settled, where each group's `conv.mode` switch lies in its conversation
//! log (G3), checked against where the threshold puts it.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tidemark_client::proto::{
    op, ConvCreateOk, ConvCreateReq, ConvListOk, ConvMemberOk, ConvMemberReq, Envelope, ErrorCode, ErrorFrame,
    HistoryOk, HistoryReq,
};
use tidemark_client::{ClientError, Http, Message};

use tidemark_core::kinds::KIND_MODE;

use super::config::{ChaosConfig, GroupShape, PASSWORD};
use super::report::Report;
use super::server::SharedHead;
use crate::check::{ConvFacts, ConvKind, MemberOp, MembershipChange};

/// The device id of each user's control connection (group operations,
/// straight to the server); it never syncs.
pub(super) const CONTROL_DEVICE: &str = "chaos-ctl";
/// Attempts at one control call (transport failures, server restarts).
pub(super) const CONTROL_ATTEMPTS_MAX: u32 = 50;
/// One control request gives up after this long (and is retried).
pub(super) const CONTROL_WAIT: Duration = Duration::from_secs(5);
/// The first membership steps of each group, so that even a short run
/// removes a member, adds one back (a new period) and has one leave;
/// later steps pick any feasible operation.
pub(super) const MEMBERSHIP_CYCLE: [MemberOp; 4] = [MemberOp::Remove, MemberOp::Add, MemberOp::Leave, MemberOp::Add];
/// `before_seq` that reads a conversation's log from its end: above any
/// `msg_seq`, and an exact JSON integer.
pub(super) const LOG_END: u64 = (1 << 53) - 1;
/// Mixed into the seed for the membership generator.
pub(super) const MEMBERSHIP_SEED: u64 = 0x6d65_6d62_6572_7321;

/// One user's own authenticated connection straight to the server (not
/// through the proxy, no faults), for the group operations the SDK has no
/// call for. It logs in as its own device, which never syncs.
pub(super) struct Control {
    pub(super) http: Http,
    pub(super) user: String,
    pub(super) token: Option<String>,
}

impl Control {
    pub(super) fn new(url: &str, user: &str) -> Control {
        Control { http: Http::new(url), user: user.to_owned(), token: None }
    }

    /// Calls `op` until the server answers it: transport failures, a
    /// restarting server and an expired token are retried (every call the
    /// scenario makes carries a `client_msg_id`, so a retry returns the
    /// original event). `Ok(Err(..))` is a contract refusal.
    pub(super) async fn call(
        &mut self,
        op: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<Result<serde_json::Value, ErrorFrame>> {
        let mut last = String::new();
        for attempt in 0..CONTROL_ATTEMPTS_MAX {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let token = match &self.token {
                Some(t) => t.clone(),
                None => match tokio::time::timeout(CONTROL_WAIT, self.http.login(&self.user, PASSWORD, CONTROL_DEVICE))
                    .await
                {
                    Ok(Ok(ok)) => {
                        self.token = Some(ok.access_token.clone());
                        ok.access_token
                    }
                    Ok(Err(e)) => {
                        last = format!("login: {e}");
                        continue;
                    }
                    Err(_) => {
                        last = "login timed out".into();
                        continue;
                    }
                },
            };
            match tokio::time::timeout(CONTROL_WAIT, self.http.rpc::<_, serde_json::Value>(&token, op, &body)).await {
                Ok(Ok(v)) => return Ok(Ok(v)),
                Ok(Err(ClientError::Server(f))) => match f.code {
                    ErrorCode::Unauthenticated | ErrorCode::TokenInvalid => {
                        self.token = None;
                        last = format!("{} ({})", f.code, f.message);
                    }
                    ErrorCode::Unavailable | ErrorCode::RateLimited | ErrorCode::Internal => {
                        last = format!("{} ({})", f.code, f.message);
                    }
                    _ => return Ok(Err(f)),
                },
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "timed out".into(),
            }
        }
        bail!("{} {op}: gave up after {CONTROL_ATTEMPTS_MAX} attempts: {last}", self.user)
    }
}

impl Control {
    /// Every event `history` serves this user in `conv` below `before_seq`,
    /// newest first, page after page; `Err` holds a refusal.
    pub(super) async fn history(
        &mut self,
        conv: &str,
        before_seq: u64,
    ) -> anyhow::Result<Result<Vec<Message>, String>> {
        let mut out = Vec::new();
        let mut before = before_seq;
        loop {
            let req = HistoryReq {
                conv: conv.to_owned(),
                before_seq: Some(before),
                limit: Some(tidemark_client::proto::HISTORY_LIMIT_MAX),
            };
            let ok: HistoryOk = match self.call(op::HISTORY, serde_json::to_value(&req)?).await? {
                Ok(reply) => serde_json::from_value(reply).context("history.ok")?,
                Err(f) => return Ok(Err(format!("{} ({})", f.code, f.message))),
            };
            out.extend(ok.messages.into_iter().map(message_of));
            match (ok.has_more, ok.next_cursor) {
                (true, Some(next)) if next < before => before = next,
                (true, next) => return Ok(Err(format!("has_more with next_cursor {next:?} below {before}"))),
                (false, _) => return Ok(Ok(out)),
            }
        }
    }
}

/// A served envelope as the checker reads events (no `sync_seq`: no log
/// entry delivered it).
pub(super) fn message_of(e: Envelope) -> Message {
    Message {
        conv: e.conv,
        msg_seq: e.msg_seq,
        message_id: e.message_id,
        kind: e.kind,
        state: e.state,
        sender: e.sender,
        content: e.content,
        created_at: e.created_at,
        version: e.version,
        reactions: serde_json::to_value(&e.reactions).unwrap_or_default(),
        sync_seq: None,
        mentions: e.mentions,
        mention_all: e.mention_all,
    }
}

/// One group as the scenario made it.
pub(super) struct GroupState {
    pub(super) conv: String,
    /// The creator: the only user who may remove members. The scenario
    /// never removes the owner and never makes it leave.
    pub(super) owner: String,
    /// Members at creation (a period from `msg_seq` 1).
    pub(super) initial: Vec<String>,
    /// Current members, as the server's answers say.
    pub(super) members: BTreeSet<String>,
    /// Membership changes made so far.
    pub(super) steps: usize,
    pub(super) shape: GroupShape,
    /// [`GroupShape::Crossing`]: the `msg_seq` of the `member.join` that
    /// took the group above the threshold (the switch must follow it).
    pub(super) crossed_at: Option<u64>,
    /// The step from which [`MEMBERSHIP_CYCLE`] is followed (after the
    /// adds that made a crossing group cross).
    pub(super) cycle_from: usize,
    /// The `msg_seq` of the group's `conv.mode` event in its conversation
    /// log, read once the run settled ([`Groups::read_switches`]).
    pub(super) switch: Option<u64>,
}

/// The groups, their control connections and every change made.
pub(super) struct Groups {
    pub(super) users: Vec<String>,
    pub(super) control: HashMap<String, Control>,
    pub(super) groups: Vec<GroupState>,
    pub(super) changes: Vec<MembershipChange>,
    pub(super) rng: StdRng,
    /// The server's large-group threshold.
    pub(super) large: u64,
}

impl Groups {
    /// Creates `cfg.groups` groups over the owners' control connections.
    pub(super) async fn create(cfg: &ChaosConfig, url: &str, users: &[String]) -> anyhow::Result<Groups> {
        let control = users.iter().map(|u| (u.clone(), Control::new(url, u))).collect();
        let rng = StdRng::seed_from_u64(cfg.seed ^ MEMBERSHIP_SEED);
        let mut g = Groups {
            users: users.to_vec(),
            control,
            groups: Vec::new(),
            changes: Vec::new(),
            rng,
            large: cfg.large_group_members,
        };
        for k in 0..cfg.groups {
            let owner = users[k % users.len()].clone();
            let shape = GroupShape::of(k, users.len());
            let others: Vec<String> = match shape {
                GroupShape::Shared => users.iter().filter(|u| **u != owner).cloned().collect(),
                GroupShape::Crossing | GroupShape::PerMember => vec![users[(k + 1) % users.len()].clone()],
            };
            let req = ConvCreateReq {
                kind: "group".into(),
                members: others,
                client_msg_id: Some(format!("chaos-group-{k}")),
            };
            let body = serde_json::to_value(&req)?;
            let reply =
                g.control.get_mut(&owner).expect("a control connection per user").call(op::CONV_CREATE, body).await?;
            let reply = reply.map_err(|f| anyhow::anyhow!("{owner} creates group {k}: {} ({})", f.code, f.message))?;
            let ok: ConvCreateOk = serde_json::from_value(reply).context("conv.create.ok")?;
            g.groups.push(GroupState {
                conv: ok.conv,
                owner,
                initial: ok.members.clone(),
                members: ok.members.into_iter().collect(),
                steps: 0,
                shape,
                crossed_at: None,
                cycle_from: 0,
                switch: None,
            });
        }
        Ok(g)
    }

    /// `user`'s control connection.
    pub(super) fn control(&mut self, user: &str) -> &mut Control {
        self.control.get_mut(user).expect("a control connection per user")
    }

    /// The groups `user` is in now, and those they are not in.
    pub(super) fn of(&self, user: &str) -> (Vec<&str>, Vec<&str>) {
        let (inside, outside): (Vec<&GroupState>, Vec<&GroupState>) =
            self.groups.iter().partition(|g| g.members.contains(user));
        (inside.iter().map(|g| g.conv.as_str()).collect(), outside.iter().map(|g| g.conv.as_str()).collect())
    }

    /// One seeded membership step in group `g` at scenario step `step`:
    /// a crossing group adds until it is above the threshold; then (and in
    /// the other shapes from the start) the group's first steps follow
    /// [`MEMBERSHIP_CYCLE`], later ones any feasible operation; a
    /// per-member group is never grown above the threshold. Targets and
    /// callers are drawn among who may.
    pub(super) async fn change(&mut self, g: usize, step: usize, report: &mut Report) -> anyhow::Result<()> {
        let group = &self.groups[g];
        let outsiders: Vec<String> = self.users.iter().filter(|u| !group.members.contains(*u)).cloned().collect();
        let removable: Vec<String> = group.members.iter().filter(|u| **u != group.owner).cloned().collect();
        let may_grow = group.shape != GroupShape::PerMember || (group.members.len() as u64) < self.large;
        let feasible = |op: &MemberOp| match op {
            MemberOp::Add => !outsiders.is_empty() && may_grow,
            MemberOp::Remove | MemberOp::Leave => !removable.is_empty(),
        };
        let crossing = group.shape == GroupShape::Crossing && group.crossed_at.is_none();
        let op = match MEMBERSHIP_CYCLE.get(group.steps.saturating_sub(group.cycle_from)) {
            _ if crossing && feasible(&MemberOp::Add) => MemberOp::Add,
            Some(op) if feasible(op) => *op,
            _ => {
                let ops: Vec<MemberOp> = MemberOp::ALL.into_iter().filter(feasible).collect();
                let Some(op) = ops.get(self.rng.random_range(0..ops.len().max(1))) else {
                    return Ok(());
                };
                *op
            }
        };
        let members: Vec<&String> = group.members.iter().collect();
        let (target, by) = match op {
            MemberOp::Add => (
                outsiders[self.rng.random_range(0..outsiders.len())].clone(),
                members[self.rng.random_range(0..members.len())].clone(),
            ),
            MemberOp::Remove => (removable[self.rng.random_range(0..removable.len())].clone(), group.owner.clone()),
            MemberOp::Leave => {
                let t = removable[self.rng.random_range(0..removable.len())].clone();
                (t.clone(), t)
            }
        };
        let req = ConvMemberReq {
            conv: group.conv.clone(),
            user: (op != MemberOp::Leave).then(|| target.clone()),
            client_msg_id: Some(format!("chaos-member-{g}-{}", group.steps)),
        };
        let conv = group.conv.clone();
        let body = serde_json::to_value(&req)?;
        let control = self.control.get_mut(&by).expect("a control connection per user");
        match control.call(op.op(), body).await? {
            Ok(reply) => {
                let ok: ConvMemberOk = serde_json::from_value(reply).with_context(|| format!("{} reply", op.op()))?;
                let group = &mut self.groups[g];
                group.steps += 1;
                if op == MemberOp::Add {
                    group.members.insert(target.clone());
                } else {
                    group.members.remove(&target);
                }
                if crossing && group.members.len() as u64 > self.large {
                    group.crossed_at = Some(ok.msg_seq);
                    group.cycle_from = group.steps;
                }
                *report.membership.entry(op.op()).or_default() += 1;
                self.changes.push(MembershipChange { conv, op, user: target, by, msg_seq: ok.msg_seq, step });
            }
            // Every change the scenario asks for is allowed by the
            // contract (docs/protocol.md §3.7–§3.9): a refusal is a bug.
            Err(f) => report.violations.push(format!(
                "{by}: {} {target} in {conv} at step {step} refused: {} ({})",
                op.op(),
                f.code,
                f.message
            )),
        }
        Ok(())
    }

    /// Reads each group's conversation log (everything `history` serves
    /// its owner, a member from `msg_seq` 1 to the end) for its
    /// `conv.mode` events, records the switch, and reports a switch that
    /// is not where G3 puts it: `msg_seq` 2 for a group created above the
    /// threshold, right after the join that crossed it for a crossing
    /// group, none for a group never above it; never two.
    pub(super) async fn read_switches(&mut self, report: &mut Report) -> anyhow::Result<()> {
        for g in 0..self.groups.len() {
            let (conv, owner) = (self.groups[g].conv.clone(), self.groups[g].owner.clone());
            let log = match self.control(&owner).history(&conv, LOG_END).await? {
                Ok(log) => log,
                Err(why) => {
                    report.violations.push(format!("{owner}: `history` of {conv} refused: {why}"));
                    continue;
                }
            };
            let switches: Vec<u64> = log.iter().filter(|m| m.kind == KIND_MODE).map(|m| m.msg_seq).collect();
            let group = &mut self.groups[g];
            let expected = match group.shape {
                GroupShape::Shared => (group.initial.len() as u64 > self.large).then_some(2),
                GroupShape::Crossing => group.crossed_at.map(|j| j + 1),
                GroupShape::PerMember => None,
            };
            group.switch = switches.iter().min().copied();
            if group.shape == GroupShape::Crossing && group.switch.is_some() {
                report.switched_mid_run += 1;
            }
            if switches.len() > 1 || group.switch != expected {
                report.violations.push(format!(
                    "{conv} ({:?}, threshold {}): conv.mode at msg_seq {switches:?} in its log, expected at {expected:?} (G3)",
                    group.shape, self.large
                ));
            }
        }
        Ok(())
    }

    /// `user`'s shared groups and the head they may read in each, from
    /// `conv.list` over the control connection (no device's marker).
    pub(super) async fn shared_heads(&mut self, user: &str) -> anyhow::Result<Vec<SharedHead>> {
        let reply = self.control(user).call(op::CONV_LIST, serde_json::json!({})).await?;
        let reply = reply.map_err(|f| anyhow::anyhow!("{user} conv.list: {} ({})", f.code, f.message))?;
        let ok: ConvListOk = serde_json::from_value(reply).context("conv.list.ok")?;
        Ok(ok
            .conversations
            .into_iter()
            .filter(|c| c.mode == tidemark_core::large::MODE_SHARED)
            .map(|c| SharedHead { conv: c.conv, last_msg_seq: c.last_msg_seq, dirty: None })
            .collect())
    }

    /// Every group's facts for the checker.
    pub(super) fn facts(&self) -> Vec<(String, ConvFacts)> {
        self.groups
            .iter()
            .map(|g| {
                let changes = self.changes.iter().filter(|c| c.conv == g.conv).cloned().collect();
                let facts =
                    ConvFacts { kind: ConvKind::Group, members: g.initial.clone(), changes, shared_from: g.switch };
                (g.conv.clone(), facts)
            })
            .collect()
    }
}
