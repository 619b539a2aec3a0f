//! One chaos run: a server on a fixed SQLite directory, the proxy in front
//! of it, users with several SDK devices each talking through the proxy in
//! direct conversations and in group conversations whose membership
//! changes during the run, and a seeded schedule of faults on top of the
//! proxy's: server restarts, clients stopped and reopened on their local
//! store, clients killed at a crash point by the SDK's fault hook.
//!
//! Groups are created, and their membership changed, over each user's own
//! authenticated HTTP connection straight to the server (`Http::rpc`, not
//! through the proxy: the SDK has no call for them, and these operations
//! are the scenario's ground truth, not what is under test). Each group's
//! owner (its creator) stays in it; during the send phase, seeded steps
//! make the owner remove a member, a member add a non-member (back: a new
//! period), and a member leave. Every change is recorded with the `msg_seq`
//! of its `member.join`/`member.leave` event from the server's reply, and
//! the step it was made at. Sends go on from members throughout (a send
//! racing a removal may still be refused `NOT_MEMBER`), and a few go on
//! from non-members on purpose; a refusal is an outcome the checker judges,
//! not an accepted message.
//!
//! Large groups (G2, G3). The server runs with a low large-group threshold
//! ([`ChaosConfig::large_group_members`], two for the CI run): one group
//! starts with every user, above it (shared from its creation), one starts
//! with two users and its first membership steps add until it is above it
//! (the switch comes mid-run, with sends before and after; the timeline
//! schedules those adds by mid-run), and one never grows above it
//! (per-member throughout). Above a switch a device gets the group's
//! messages by `conv.sync` pulls after a dirty marker, not from sync pages:
//! the change streams are relied on for accepted sends, resets and
//! snapshots only (a pull's cursor move and its `GroupPulled` are counted,
//! not needed), and the settle phase waits until each device holds each
//! shared group up to the head its user may read (in-process: its marker
//! clean too). After settling, each group's `conv.mode` is read from its
//! conversation log (the owner's `history`) for the checker, and checked
//! where G3 puts it.
//!
//! Snapshots (D7, L1–L2). The server runs with a user-log retention of
//! about a second ([`Retention`]: keep window, inactivity window, a pass
//! every 100 ms) and small, short-lived snapshots (a few events per
//! conversation, 5 s; in-process, a few items per page too). Seeded fall-off steps stop a client whose
//! user has another device running, let traffic and retention passes go on
//! until the server's store shows the user's trim point above the stopped
//! device's ACK (its cursor fell off the retained log), then reopen it
//! while faults continue: its first sync must get `RESET_REQUIRED`, and
//! the SDK rebuilds from a snapshot. Some of those rebuilds are armed with
//! a snapshot fault (a crash after `snapshot.begin`, after a page, before
//! or after the install's commit, or a corrupt page). Devices that lag
//! under faults may fall off on their own too; every reset is judged the
//! same way. While running, the change stream and polls of the local store
//! check that a reset is a generation change (`RESET_REQUIRED` above the
//! generation the device last synced at, a snapshot installed above it)
//! and that within a generation nothing moves back; a fallen-off device
//! must not apply any page before its snapshot (L2). After settling, each
//! device's events at or below `history_to` that it does not hold are
//! fetched with `history` over the user's control connection, for the
//! checker.
//!
//! The server runs in-process ([`ServerMode::InProcess`], the CI run): a
//! "kill" is [`RunningServer::stop`](tidemark_server::RunningServer::stop)
//! followed by a new [`Server::start`](tidemark_server::Server::start) on
//! the same data directory and address, a graceful stop and not a crash;
//! the server's store is read through its own API. With
//! [`ServerMode::Binary`] it is the real `tidemark serve`, SIGKILLed and
//! started again on the same directory and address, with the same
//! retention passed as flags ([`Retention::serve_args`]: the windows and
//! the snapshot lifetime in whole seconds, rounded up); its store (the
//! device's cursor, the user's head and trim point) is read from a
//! read-only SQLite connection to its database file, beside the live
//! server (WAL allows a reader in another process). `tidemark serve` has
//! no flag for the snapshot's page size, so the binary's snapshots have
//! its default pages (200 items: a snapshot is usually one page). This
//! module owns the run's timeline and collects the facts; [`crate::check`]
//! judges them.
//!
//! Submodules, one cluster each: `config` (what a run is given), `device`
//! (one device's client, crash plan and change log with its live checks),
//! `server` (the restartable server and what is read of its store),
//! `groups` (control connections and membership changes), `falloff` (the
//! fall-off steps), `report` (the summary). This module owns the timeline:
//! setup, the send phase, the settle phase and the collection of facts.
//!
//! Every random choice of the scenario comes from generators seeded with
//! the run's seed (one for the timeline and the sends, one for membership
//! changes, one for snapshot faults); the proxy derives its own from the
//! same seed. What the seed cannot fix is timing (and the SDK's own
//! jitter), so a replay takes the same decisions but may interleave them
//! differently, and whether a lagging device falls off on its own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tidemark_client::{ConnState, Exit, Http, OutboxState};
use tidemark_server::ServerConfig;

use crate::check::{self, Accepted, ConvFacts, ConvKind, DeviceView, Sent};
use crate::proxy::{FaultKind, Proxy};

mod config;
mod device;
mod falloff;
mod groups;
mod report;
mod server;

pub use config::{ChaosConfig, GroupShape, Retention, ServerMode};
use config::{ADMIN, PASSWORD};
use device::{CrashAt, Device};
use falloff::Falloffs;
use groups::Groups;
pub use report::Report;
use server::ServerSlot;

/// Setup steps (ready, create a conversation) give up after this long.
const SETUP_WAIT: Duration = Duration::from_secs(15);
/// Attempts at a setup call that may hit a not-yet-ready connection.
const SETUP_ATTEMPTS_MAX: u32 = 20;
/// How often the settle phase polls every device.
const SETTLE_POLL: Duration = Duration::from_millis(200);
/// Consecutive quiet polls that end the settle phase.
const SETTLE_QUIET_POLLS: u32 = 3;
/// How often stopped devices are looked at once the sends are over.
const FALLOFF_POLL: Duration = Duration::from_millis(50);

/// What happens before message `at` is sent. `Membership` is one change
/// in that group; which one is decided then ([`Groups::change`]).
/// `FallOff` stops `device`, or the next one that may be stopped
/// ([`Falloffs::stop`]).
#[derive(Debug, Clone, Copy)]
enum Event {
    RestartServer { down: Duration },
    ReopenClient { device: usize },
    ArmCrash { device: usize, at: CrashAt },
    Membership { group: usize },
    FallOff { device: usize },
}

fn schedule(cfg: &ChaosConfig, devices: usize, rng: &mut StdRng) -> Vec<(usize, Event)> {
    let mut events = Vec::new();
    let span = cfg.messages.max(1);
    for _ in 0..cfg.server_restarts {
        let down = Duration::from_millis(rng.random_range(50..=400));
        events.push((rng.random_range(span / 5..=span * 4 / 5), Event::RestartServer { down }));
    }
    for _ in 0..cfg.client_reopens {
        events.push((rng.random_range(0..span), Event::ReopenClient { device: rng.random_range(0..devices) }));
    }
    for _ in 0..cfg.client_aborts {
        let at = CrashAt::ROUTINE[rng.random_range(0..CrashAt::ROUTINE.len())];
        events.push((rng.random_range(0..span), Event::ArmCrash { device: rng.random_range(0..devices), at }));
    }
    if cfg.groups > 0 {
        for _ in 0..cfg.membership_changes {
            let group = rng.random_range(0..cfg.groups);
            events.push((rng.random_range(1..span.max(2)), Event::Membership { group }));
        }
        // A crossing group gets the adds that take it above the threshold
        // (its first steps are adds) by mid-run whatever the draws above:
        // it switches with messages before and after.
        let adds = (cfg.large_group_members + 1).saturating_sub(2) as usize;
        for group in (0..cfg.groups).filter(|k| GroupShape::of(*k, cfg.users) == GroupShape::Crossing) {
            for _ in 0..adds {
                events.push((rng.random_range(span / 5..=span / 2), Event::Membership { group }));
            }
        }
    }
    // Early enough (some 40 steps before the end) that traffic goes on
    // while the client is stopped, so its user's other device moves the
    // fence past it, and after it rebuilt.
    let last_stop = span.saturating_sub(40).clamp(span / 3, span * 3 / 4);
    for _ in 0..cfg.falloffs {
        let device = rng.random_range(0..devices);
        events.push((rng.random_range(span / 20..=last_stop), Event::FallOff { device }));
    }
    events.sort_by_key(|(i, _)| *i);
    events
}

/// Runs the scenario and the checker; `Err` only when the run could not be
/// set up (a violation is in the report, not an error).
pub async fn run(cfg: ChaosConfig) -> anyhow::Result<Report> {
    if cfg.users < 2 || cfg.devices_per_user < 1 {
        bail!("need at least two users with one device each");
    }
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let dir = tempfile::tempdir().context("temporary directory")?;
    let mut server =
        ServerSlot::boot(cfg.server.clone(), cfg.retention, cfg.large_group_members, dir.path().join("server")).await?;
    let proxy = Proxy::start(server.addr, cfg.faults, cfg.seed).await.context("start the proxy")?;
    let users: Vec<String> = (0..cfg.users).map(|u| format!("u{u}")).collect();
    let mut devices = open_devices(&cfg, &server, &proxy, &users, dir.path()).await?;
    let members = create_conversations(&users, &devices).await?;
    let mut groups = Groups::create(&cfg, &server.url(), &users).await?;
    let mut report = new_report(&cfg);
    let mut falloffs = Falloffs::new(&cfg);

    proxy.set_faults(true);
    let mut world = World { server: &mut server, devices: &mut devices, groups: &mut groups, falloffs: &mut falloffs };
    let sent = send_phase(&cfg, &users, &members, &mut rng, &mut world, &mut report).await?;
    // Stopped clients wait, faults still on, until they fell off (or their
    // deadline passed).
    loop {
        reopen_dead(&mut devices, &mut report).await?;
        falloffs.reopen(None, &server, &mut devices, &mut report).await?;
        if falloffs.stopped.is_empty() {
            break;
        }
        for d in &devices {
            d.poll().await;
        }
        tokio::time::sleep(FALLOFF_POLL).await;
    }

    // Settle: faults off, nobody crashes, everyone connected and syncing.
    proxy.set_faults(false);
    server.start().await?;
    for d in &devices {
        *d.crash.lock().expect("crash plan lock") = None;
    }
    reopen_dead(&mut devices, &mut report).await?;
    report.settled = settle(&cfg, &server, &mut devices, &mut groups, &mut report).await?;
    groups.read_switches(&mut report).await?;

    let (accepted, refused) = outcomes(&devices, &sent, &mut report).await;
    let mut views = Vec::with_capacity(devices.len());
    for d in &devices {
        views.push(view(d, &mut groups).await?);
    }
    let mut convs: BTreeMap<String, ConvFacts> = members
        .iter()
        .map(|(c, m)| {
            (
                c.clone(),
                ConvFacts { kind: ConvKind::Direct, members: m.clone(), changes: Vec::new(), shared_from: None },
            )
        })
        .collect();
    convs.extend(groups.facts());
    let outcome = check::check(&check::Facts {
        convs: &convs,
        sent: &sent,
        accepted: &accepted,
        refused: &refused,
        views: &views,
        snapshot_events_per_conv: server.snapshot_events_per_conv(),
    });

    report.messages_sent = sent.len();
    report.messages_accepted = sent.iter().filter(|s| accepted.contains_key(&s.client_msg_id)).count();
    tally_devices(&devices, &mut report).await?;
    if !report.settled {
        report.notes.push(format!("did not settle within {:?}", cfg.settle_max));
    }
    report.violations.extend(outcome.violations.iter().cloned());
    report.check = outcome;
    let stats = proxy.stats();
    report.faults = FaultKind::ALL.iter().map(|k| (k.name(), stats.faults(*k))).collect();
    report.frames = stats.frames.load(std::sync::atomic::Ordering::Relaxed);
    report.websockets = stats.websockets.load(std::sync::atomic::Ordering::Relaxed);

    for d in devices.iter_mut() {
        d.close().await;
    }
    proxy.stop().await;
    server.kill().await;
    Ok(report)
}

/// Creates the users, then every device's client (through the proxy, on
/// its own local store in `dir`), and waits until each is ready.
async fn open_devices(
    cfg: &ChaosConfig,
    server: &ServerSlot,
    proxy: &Proxy,
    users: &[String],
    dir: &std::path::Path,
) -> anyhow::Result<Vec<Device>> {
    let admin = Http::new(&server.url());
    for u in users {
        admin.create_user(ADMIN, u, PASSWORD).await.with_context(|| format!("create {u}"))?;
    }
    let mut devices: Vec<Device> = Vec::new();
    for u in users {
        for d in 0..cfg.devices_per_user {
            let db = dir.join(format!("{u}-d{d}.db"));
            devices.push(Device::new(u, &format!("d{d}"), &proxy.url(), db, cfg.request_timeout));
        }
    }
    for d in devices.iter_mut() {
        d.open().await?;
    }
    for d in &devices {
        d.client().wait_state(ConnState::Ready, SETUP_WAIT).await.with_context(|| format!("{} ready", d.name()))?;
    }
    Ok(devices)
}

/// An empty report naming the run's seed and server.
fn new_report(cfg: &ChaosConfig) -> Report {
    let server_kind = match cfg.server {
        ServerMode::InProcess => "in-process, graceful restarts",
        ServerMode::Binary(_) => "tidemark binary, SIGKILL restarts",
    };
    let mut report = Report { seed: cfg.seed, server: server_kind, ..Report::default() };
    if matches!(cfg.server, ServerMode::Binary(_)) {
        report.notes.push(format!(
            "tidemark serve {} --large-group-members {}; snapshot pages: the binary's default {} items (no flag)",
            cfg.retention.serve_args().join(" "),
            cfg.large_group_members,
            ServerConfig::default().snapshot_page_items
        ));
    }
    report
}

/// The send phase, faults on: before each message the timeline's events
/// due by then (membership changes, restarts, crashes, fall-off stops),
/// dead clients reopened, stopped ones reopened once fallen off; then one
/// message from a random open device, into a direct conversation or a
/// group its user is in (now and then, on purpose, one the user is out
/// of). The timeline's remaining events follow the last message.
async fn send_phase(
    cfg: &ChaosConfig,
    users: &[String],
    members: &BTreeMap<String, Vec<String>>,
    rng: &mut StdRng,
    w: &mut World<'_>,
    report: &mut Report,
) -> anyhow::Result<Vec<Sent>> {
    let directs_of: HashMap<&str, Vec<&str>> = users
        .iter()
        .map(|u| {
            let convs = members.iter().filter(|(_, m)| m.contains(u)).map(|(c, _)| c.as_str()).collect();
            (u.as_str(), convs)
        })
        .collect();
    let events = schedule(cfg, w.devices.len(), rng);
    let mut next_event = 0;
    let mut sent: Vec<Sent> = Vec::with_capacity(cfg.messages);
    for i in 0..cfg.messages {
        while next_event < events.len() && events[next_event].0 <= i {
            apply(events[next_event].1, i, w, report).await?;
            next_event += 1;
        }
        reopen_dead(w.devices, report).await?;
        w.falloffs.reopen(Some(i), w.server, w.devices, report).await?;
        for d in w.devices.iter() {
            d.poll().await;
        }
        // Any device but a stopped one sends.
        let open: Vec<usize> = (0..w.devices.len()).filter(|d| w.devices[*d].is_open()).collect();
        let d = open[rng.random_range(0..open.len())];
        // A direct conversation or a group the user is in now; now and then
        // on purpose a group the user is out of.
        let (inside, outside) = w.groups.of(&w.devices[d].user);
        let stray = !outside.is_empty() && rng.random_range(0..100) < cfg.stray_send_percent;
        let conv = if stray {
            outside[rng.random_range(0..outside.len())].to_owned()
        } else {
            let mut convs = directs_of[w.devices[d].user.as_str()].clone();
            convs.extend(inside);
            convs[rng.random_range(0..convs.len())].to_owned()
        };
        let tag = format!("m{i}");
        let content = serde_json::json!({ "text": format!("chaos {tag}"), "tag": tag });
        let dev = &w.devices[d];
        let entry = match dev.client().send(&conv, content).await {
            Ok(entry) => entry,
            // The client died at a crash point between the check and the
            // send: nothing was queued; this message is simply not sent.
            Err(tidemark_client::SdkError::Store(tidemark_client::StoreError::Aborted(_))) => continue,
            Err(e) => bail!("{} send {tag}: {e}", dev.name()),
        };
        sent.push(Sent {
            tag,
            conv,
            user: dev.user.clone(),
            device: dev.id.clone(),
            client_msg_id: entry.client_msg_id,
            step: i,
        });
        report.stray_sends += usize::from(stray);
        let gap = rng.random_range(0..=cfg.send_gap_ms_max);
        tokio::time::sleep(Duration::from_millis(gap)).await;
    }
    while next_event < events.len() {
        apply(events[next_event].1, cfg.messages, w, report).await?;
        next_event += 1;
    }
    Ok(sent)
}

/// What became of every queued message: accepted (with its `msg_seq`) or
/// refused for good, from the change streams and, for what a lagged
/// stream missed, the senders' outboxes. A refusal the scenario never
/// queued is a violation.
async fn outcomes(
    devices: &[Device],
    sent: &[Sent],
    report: &mut Report,
) -> (HashMap<String, Accepted>, HashMap<String, String>) {
    let mut accepted: HashMap<String, Accepted> = HashMap::new();
    let mut refused: HashMap<String, String> = HashMap::new();
    for d in devices {
        let log = d.log.lock().expect("log lock");
        accepted.extend(log.accepted.iter().map(|(k, v)| (k.clone(), v.clone())));
        refused.extend(log.failed.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    for s in sent {
        // The outbox is the sender's durable record: fill in what the
        // change stream missed (a lagged subscriber).
        if accepted.contains_key(&s.client_msg_id) || refused.contains_key(&s.client_msg_id) {
            continue;
        }
        let dev = devices.iter().find(|d| d.user == s.user && d.id == s.device).expect("sender device");
        if let Ok(Some(e)) = dev.client().outbox_entry(&s.client_msg_id).await {
            match (e.state, e.msg_seq, e.message_id, e.error) {
                (OutboxState::Accepted, Some(seq), Some(id), _) => {
                    accepted.insert(s.client_msg_id.clone(), Accepted { msg_seq: seq, message_id: id });
                }
                (OutboxState::Failed, _, _, error) => {
                    refused.insert(s.client_msg_id.clone(), error.unwrap_or_default());
                }
                _ => {}
            }
        }
    }
    let queued: BTreeSet<&str> = sent.iter().map(|s| s.client_msg_id.as_str()).collect();
    for (id, why) in &refused {
        if !queued.contains(id.as_str()) {
            report
                .violations
                .push(format!("outbox entry {id} failed for good, and the scenario never queued it: {why}"));
        }
    }
    (accepted, refused)
}

/// Adds what each device's change stream counted to the report, and the
/// live violations: a device that fell off and installed no snapshot
/// since (L2, D7), or ends at the generation it fell off at (D5).
async fn tally_devices(devices: &[Device], report: &mut Report) -> anyhow::Result<()> {
    for d in devices {
        let generation = d.client().position().await?.generation.unwrap_or(0);
        let log = d.log.lock().expect("log lock");
        report.duplicate_accepts += log.duplicates;
        report.client_aborts_fired += log.aborts;
        report.snapshot_aborts_fired += log.snapshot_aborts;
        report.resets += log.resets;
        report.snapshots_installed += log.snapshots_installed;
        report.snapshot_failures += log.snapshot_failures;
        report.digest_mismatches += log.digest_mismatches;
        report.cursor_moves_checked += log.moves_checked;
        report.group_pulls += log.group_pulls;
        report.group_clears += log.group_clears;
        // L2 and D5 for every device that fell off: a snapshot followed,
        // under a generation above the one it fell off at.
        if let Some(f) = log.awaiting_snapshot.filter(|_| log.lagged == 0) {
            report.violations.push(format!(
                "{}: fell off the retained log ({f:?}) and installed no snapshot since (L2, D7)",
                d.name()
            ));
        }
        if let Some(f) = log.fell_off.iter().find(|f| generation <= f.generation) {
            report.violations.push(format!(
                "{}: fell off the retained log at generation {} ({f:?}) and ends at generation {generation}: a reset is a generation change (D5)",
                d.name(),
                f.generation
            ));
        }
        report.violations.extend(log.violations.iter().map(|v| format!("{}: {v}", d.name())));
        if log.violations_dropped > 0 {
            report.violations.push(format!("{}: {} more live violations", d.name(), log.violations_dropped));
        }
        if log.lagged > 0 {
            report.notes.push(format!("{}: change stream lagged by {} (cursor checks partial)", d.name(), log.lagged));
        }
        if log.reordered > 0 {
            report.notes.push(format!(
                "{}: {} cursor notifications arrived after a later move's (Change order is not commit order)",
                d.name(),
                log.reordered
            ));
        }
    }
    Ok(())
}

/// Creates the direct conversation of every pair of users (faults off), and
/// makes every device know each of its user's conversations.
async fn create_conversations(users: &[String], devices: &[Device]) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let mut members = BTreeMap::new();
    for d in devices {
        for peer in users.iter().filter(|p| **p != d.user) {
            let conv = retry_create(d, peer).await?;
            let pair = {
                let mut p = vec![d.user.clone(), peer.clone()];
                p.sort();
                p
            };
            if let Some(before) = members.insert(conv.clone(), pair.clone()) {
                if before != pair {
                    bail!("conversation {conv} is both {before:?} and {pair:?}");
                }
            }
        }
    }
    let pairs = users.len() * (users.len() - 1) / 2;
    if members.len() != pairs {
        bail!("{} direct conversations for {pairs} pairs", members.len());
    }
    Ok(members)
}

async fn retry_create(d: &Device, peer: &str) -> anyhow::Result<String> {
    let mut last = None;
    for _ in 0..SETUP_ATTEMPTS_MAX {
        match d.client().create_direct(peer).await {
            Ok(conv) => return Ok(conv),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{} create_direct({peer}): {last:?}", d.name())
}

/// What the timeline's events act on.
struct World<'a> {
    server: &'a mut ServerSlot,
    devices: &'a mut [Device],
    groups: &'a mut Groups,
    falloffs: &'a mut Falloffs,
}

/// Applies one timeline event at scenario step `step`.
async fn apply(event: Event, step: usize, w: &mut World<'_>, report: &mut Report) -> anyhow::Result<()> {
    match event {
        Event::RestartServer { down } => {
            w.server.kill().await;
            tokio::time::sleep(down).await;
            w.server.start().await?;
            report.server_restarts += 1;
        }
        Event::ReopenClient { device } => {
            let d = &mut w.devices[device];
            // A stopped client is reopened by its fall-off step only.
            if d.is_open() {
                d.close().await;
                d.open().await?;
                report.client_reopens += 1;
            }
        }
        Event::ArmCrash { device, at } => {
            *w.devices[device].crash.lock().expect("crash plan lock") = Some(at);
            report.client_aborts_armed += 1;
        }
        Event::Membership { group } => w.groups.change(group, step, report).await?,
        Event::FallOff { device } => w.falloffs.stop(device, step, w.devices, report).await,
    }
    Ok(())
}

/// Reopens every client that died (at a crash point, or otherwise; an exit
/// other than a crash is noted). A stopped client is not dead.
async fn reopen_dead(devices: &mut [Device], report: &mut Report) -> anyhow::Result<()> {
    for d in devices.iter_mut() {
        if !d.is_open() || !d.exited() {
            continue;
        }
        let exit = d.log.lock().expect("log lock").exited.clone();
        if !matches!(exit, Some(Exit::Aborted(_))) {
            report.violations.push(format!("{}: client exited by itself: {exit:?}", d.name()));
        }
        d.close().await;
        d.open().await?;
    }
    Ok(())
}

/// A position and how far a device is there: `(head, applied)`, or a
/// shared group's `(readable head, held)`.
type Heads = (u64, u64);

/// Waits until every outbox is drained and every device stands at its
/// user's head, applied and ACKed (the server's ACK when its store is at
/// hand, else the local one), and holds each of its user's shared groups
/// up to the head the user may read there with its marker clean (the
/// marker in-process; over the control connection the head only), for a
/// few polls in a row. Notes what keeps a device from it if the wait gives
/// up.
async fn settle(
    cfg: &ChaosConfig,
    server: &ServerSlot,
    devices: &mut [Device],
    groups: &mut Groups,
    report: &mut Report,
) -> anyhow::Result<bool> {
    let deadline = tokio::time::Instant::now() + cfg.settle_max;
    let mut quiet = 0;
    let mut last_heads: (Vec<Heads>, Vec<Heads>) = (Vec::new(), Vec::new());
    // Why each device is not there yet, at the last poll.
    let mut behind: Vec<String> = Vec::new();
    // Devices at the head whose local ACK is behind the server's.
    let mut stale_acks: Vec<String> = Vec::new();
    while tokio::time::Instant::now() < deadline {
        reopen_dead(devices, report).await?;
        // Each device's (applied, acked); in-process, the user's head too.
        let mut heads = Vec::with_capacity(devices.len());
        // Each shared group's (readable head, held) per device.
        let mut shared_heads = Vec::new();
        let mut done = true;
        behind.clear();
        stale_acks.clear();
        for d in devices.iter() {
            d.poll().await;
            let client = d.client();
            client.sync_now();
            let pos = client.position().await?;
            let head = server.head(&d.user).await?.unwrap_or(pos.applied_sync_seq);
            heads.push((head, pos.applied_sync_seq));
            let standing = server.standing(&d.user, &d.id).await?;
            let pending = client.outbox().await?.iter().filter(|e| e.state == OutboxState::Pending).count();
            // The server's cursor is the ACK (D4). The SDK records an ACK
            // only from an `ack.ok`, not from the `server_acked_sync_seq` of
            // a later `sync.ok`: after a lost `ack.ok`, its local ACK stays
            // behind until a new event is ACKed. That is noted, not waited
            // for.
            let acked = match &standing {
                Some(s) => s.state == "ACTIVE" && Some(s.generation) == pos.generation && s.acked == head,
                None => pos.acked_sync_seq == head,
            };
            if acked && pos.acked_sync_seq != head {
                stale_acks.push(format!(
                    "{}: local ACK {} behind the server's {head} (generation {:?}): the SDK never learns an ACK whose ack.ok was lost",
                    d.name(),
                    pos.acked_sync_seq,
                    pos.generation
                ));
            }
            // G2: a shared group comes by `conv.sync` pulls, not by the
            // user's log: standing at the head says nothing about it.
            let shared = match server.shared_groups(&d.user, &d.id).await? {
                Some(shared) => shared,
                None => groups.shared_heads(&d.user).await?,
            };
            let local = client.conversations().await?;
            for g in &shared {
                let held = local.iter().find(|c| c.conv == g.conv).map_or(0, |c| c.contiguous_msg_seq);
                shared_heads.push((g.last_msg_seq, held));
                if held < g.last_msg_seq || g.dirty == Some(true) {
                    done = false;
                    behind.push(format!(
                        "{}: shared group {} held up to {held}, the user may read up to {} (marker dirty: {:?})",
                        d.name(),
                        g.conv,
                        g.last_msg_seq,
                        g.dirty
                    ));
                }
            }
            if pending > 0 || pos.applied_sync_seq != head || !acked {
                done = false;
                let log = d.log.lock().expect("log lock");
                behind.push(format!(
                    "{}: {pos:?}, head {head}, server cursor {standing:?}, {pending} pending outbox entries, {:?}; {} resets, {} snapshots installed, {} failed (last: {:?})",
                    d.name(),
                    client.state(),
                    log.resets,
                    log.snapshots_installed,
                    log.snapshot_failures,
                    log.last_snapshot_failure
                ));
            }
        }
        // Without the server's head, the devices of one user must agree.
        for (i, d) in devices.iter().enumerate() {
            let same_user = devices.iter().enumerate().filter(|(_, o)| o.user == d.user);
            if same_user.clone().any(|(j, _)| heads[j].1 != heads[i].1) {
                done = false;
            }
        }
        quiet = if done && (&heads, &shared_heads) == (&last_heads.0, &last_heads.1) { quiet + 1 } else { 0 };
        last_heads = (heads, shared_heads);
        if quiet >= SETTLE_QUIET_POLLS {
            report.notes.append(&mut stale_acks);
            return Ok(true);
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
    report.notes.extend(behind.into_iter().map(|b| format!("not settled: {b}")));
    Ok(false)
}

/// What `d` holds, and for each conversation it holds from a snapshot's
/// boundary on, what `history` serves its user below that boundary.
async fn view(d: &Device, groups: &mut Groups) -> anyhow::Result<DeviceView> {
    let client = d.client();
    let conversations = client.conversations().await?;
    let mut events = BTreeMap::new();
    let mut history = BTreeMap::new();
    for c in &conversations {
        events.insert(c.conv.clone(), client.events(&c.conv).await?);
        if c.history_to > 0 {
            let served = groups.control(&d.user).history(&c.conv, c.history_to + 1).await?;
            history.insert(c.conv.clone(), served);
        }
    }
    let snapshots_installed = {
        let log = d.log.lock().expect("log lock");
        (log.lagged == 0).then_some(log.snapshots_installed)
    };
    Ok(DeviceView { user: d.user.clone(), device: d.id.clone(), conversations, events, snapshots_installed, history })
}

#[cfg(test)]
mod tests {
    //! Negative controls of the live checks: a reset must be a generation
    //! change, and nothing moves back within a generation.

    use super::device::{DeviceLog, FellOff};
    use super::*;
    use tidemark_client::{Change, Conversation, PageReport, SyncPosition};

    fn page(generation: u64, applied_sync_seq: u64) -> Change {
        Change::PageApplied(PageReport {
            sync_generation: generation,
            applied: 1,
            applied_sync_seq,
            ..PageReport::default()
        })
    }

    fn acked(generation: u64, acked_sync_seq: u64) -> Change {
        Change::Acked { sync_seq: acked_sync_seq, acked_sync_seq, generation }
    }

    fn installed(generation: u64, base_sync_seq: u64) -> Change {
        Change::SnapshotInstalled { generation, base_sync_seq, conversations: 1, messages: 1 }
    }

    fn conv(contiguous: u64) -> Conversation {
        crate::check::tests::direct_conv("c", contiguous)
    }

    fn pos(generation: u64, applied: u64, acked: u64) -> SyncPosition {
        SyncPosition { generation: Some(generation), applied_sync_seq: applied, acked_sync_seq: acked }
    }

    /// The log after `changes`, starting synced at generation 2, ACK 10.
    fn after(changes: Vec<Change>) -> DeviceLog {
        let mut log = DeviceLog::default();
        for c in [page(2, 10), acked(2, 10)].into_iter().chain(changes) {
            log.record(c);
        }
        log
    }

    #[test]
    fn a_reset_is_a_generation_change() {
        // The ordinary path: RESET_REQUIRED above, a snapshot at it, sync on.
        let log = after(vec![Change::Reset { generation: Some(3) }, installed(3, 12), acked(3, 12), page(3, 14)]);
        assert_eq!(log.violations, Vec::<String>::new());
        // A second install in one generation (the first one's ack refused),
        // at a base no lower, is fine too.
        let log = after(vec![Change::Reset { generation: Some(3) }, installed(3, 12), installed(3, 13)]);
        assert_eq!(log.violations, Vec::<String>::new());

        let log = after(vec![Change::Reset { generation: Some(2) }]);
        assert!(
            log.violations[0].contains("RESET_REQUIRED at generation 2, not above generation 2"),
            "{:?}",
            log.violations
        );
        let log = after(vec![Change::Reset { generation: None }]);
        assert!(log.violations[0].contains("without a sync_generation"), "{:?}", log.violations);
        let log = after(vec![installed(2, 12)]);
        assert!(log.violations[0].contains("snapshot installed at generation 2"), "{:?}", log.violations);
        let log = after(vec![Change::Reset { generation: Some(3) }, installed(3, 12), installed(3, 11)]);
        assert!(log.violations[0].contains("moved back from 12 to 11 in generation 3"), "{:?}", log.violations);
    }

    #[test]
    fn a_fallen_off_device_applies_no_page_before_its_snapshot() {
        let f = FellOff { generation: 2, acked: 10, trimmed_upto: 15 };
        let mut log = after(vec![]);
        log.fall_off(f);
        log.record(Change::Reset { generation: Some(3) });
        log.record(installed(3, 20));
        log.record(page(3, 22));
        assert_eq!(log.violations, Vec::<String>::new());
        assert_eq!(log.awaiting_snapshot, None);

        let mut log = after(vec![]);
        log.fall_off(f);
        log.record(page(2, 12));
        assert!(log.violations[0].contains("after falling off the retained log"), "{:?}", log.violations);
    }

    #[test]
    fn durable_cursors_move_back_only_with_a_new_generation() {
        let mut log = DeviceLog::default();
        log.durable(pos(2, 10, 10), &[conv(7)]);
        // A reset notification alone does not license a move back: the
        // generation in the store must change.
        log.record(Change::Reset { generation: Some(3) });
        log.durable(pos(2, 10, 10), &[conv(5)]);
        assert!(log.violations[0].contains("cursor moved back in generation 2: 7 → 5"), "{:?}", log.violations);

        let mut log = DeviceLog::default();
        log.durable(pos(2, 10, 10), &[conv(7)]);
        log.durable(pos(3, 8, 0), &[conv(5)]);
        log.durable(pos(3, 8, 8), &[conv(6)]);
        assert_eq!(log.violations, Vec::<String>::new());
        log.durable(pos(3, 7, 8), &[conv(6)]);
        log.durable(pos(2, 9, 9), &[conv(6)]);
        assert!(log.violations[0].contains("moved back"), "{:?}", log.violations);
        assert!(log.violations[1].contains("generation moved back"), "{:?}", log.violations);
    }

    #[test]
    fn the_binary_gets_the_retention_in_whole_seconds_rounded_up() {
        let args = Retention::default().serve_args().join(" ");
        assert_eq!(
            args,
            "--log-keep-secs 1 --device-inactive-secs 1 --retention-every-ms 100 --snapshot-ttl-secs 5 --snapshot-messages-per-conv 4"
        );
        let odd = Retention {
            keep_events_ms: 1500,
            device_inactive_ms: 1,
            every: Duration::from_millis(3),
            snapshot_ttl: Duration::from_millis(2001),
            ..Retention::default()
        };
        let args = odd.serve_args().join(" ");
        assert_eq!(
            args,
            "--log-keep-secs 2 --device-inactive-secs 1 --retention-every-ms 10 --snapshot-ttl-secs 3 --snapshot-messages-per-conv 4"
        );
    }
}
