//! The offline push worker (P4): wakes phones that have no live connection.
//!
//! What a device owes is never queued: it is its user's committed log above
//! `max(acked, pushed_through)` (`Store::claim_pushes`), so a crash loses
//! nothing (the next claim, here or on another node, finds the same range)
//! and nothing grows while a provider is down: each target is one row with
//! a position, a wait and a failure count. The worker claims due targets
//! (a numbered lease in the store, so two nodes never push one device at
//! once), lets `tidemark_core::push::decide` judge the range (who counts,
//! the coalescing window, expiry; a device connected to this node is not
//! pushed), asks the device's provider, and writes what
//! `tidemark_core::push::after_answer` decided. An accepted push is not a
//! delivery: the device still syncs by cursor.
//!
//! It sits below facts, pulls and hints: it runs in its own task, only on
//! its poll or after a fan-out, at most `inflight_max` provider requests at
//! once and `claim_batch_max` targets per claim; it never holds a send. A
//! node killed between a provider's accept and the store's record pushes
//! that range again after its lease (at least once), with the same
//! `notification_id`, so a receiver can drop the repeat.
//!
//! Logs carry user, device and token hashes, never a token or a payload.

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tidemark_core::push::{self as rules, AfterAnswer, PushDecision, PushFacts, PushPolicy};
use tidemark_proto::push::{preview_text, PreviewLevel, PushPayload, PushPreview};
use tidemark_push::seal::{device_aad, TokenSealer};
use tidemark_push::{Outcome, Platform, Provider, Target};
use tidemark_store::{OwedPushes, PushStep};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::metrics as m;
use crate::state::AppState;
use crate::util::now_ms;

/// How often the worker looks for due pushes without a wake-up.
pub const PUSH_POLL_DEFAULT: Duration = Duration::from_millis(500);
/// How long a claim lasts; a node that dies holding one frees it after
/// this. Longer than a provider request may take.
pub const PUSH_LEASE_DEFAULT: Duration = Duration::from_secs(30);
/// Targets claimed per store call.
pub const PUSH_CLAIM_BATCH_MAX: u32 = 64;
/// Provider requests in flight at once on one node.
pub const PUSH_INFLIGHT_MAX: usize = 32;

/// Offline push settings. No provider: nothing is pushed and
/// `push.register` refuses every platform.
#[derive(Clone)]
pub struct PushConfig {
    pub providers: Vec<Arc<dyn Provider>>,
    /// The key tokens are sealed with; `None`: derived from the server
    /// secret (see `tidemark_push::seal`).
    pub token_key: Option<[u8; tidemark_push::seal::SEAL_KEY_BYTES]>,
    pub policy: PushPolicy,
    pub poll: Duration,
    pub lease: Duration,
    pub claim_batch_max: u32,
    pub inflight_max: usize,
}

impl Default for PushConfig {
    fn default() -> PushConfig {
        PushConfig {
            providers: Vec::new(),
            token_key: None,
            policy: PushPolicy::default(),
            poll: PUSH_POLL_DEFAULT,
            lease: PUSH_LEASE_DEFAULT,
            claim_batch_max: PUSH_CLAIM_BATCH_MAX,
            inflight_max: PUSH_INFLIGHT_MAX,
        }
    }
}

impl std::fmt::Debug for PushConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let platforms: Vec<&str> = self.providers.iter().map(|p| p.platform().as_str()).collect();
        f.debug_struct("PushConfig")
            .field("providers", &platforms)
            .field("token_key", &self.token_key.map(|_| "<file>"))
            .field("policy", &self.policy)
            .field("poll", &self.poll)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl PushConfig {
    pub fn provider(&self, platform: &str) -> Option<&Arc<dyn Provider>> {
        self.providers.iter().find(|p| p.platform().as_str() == platform)
    }
}

/// The sealer of this server's tokens.
pub fn sealer(config: &PushConfig, server_secret: &[u8]) -> TokenSealer {
    match &config.token_key {
        Some(key) => TokenSealer::from_key(key),
        None => {
            if !config.providers.is_empty() {
                tracing::warn!(
                    "push tokens are sealed with a key derived from the server secret, which is stored in the \
                     same database; give --push-token-key-file to encrypt them at rest"
                );
            }
            TokenSealer::derived(server_secret)
        }
    }
}

pub fn platform_of(name: &str) -> Option<Platform> {
    [Platform::Webhook, Platform::WebPush, Platform::Gateway].into_iter().find(|p| p.as_str() == name)
}

/// A short hash of an id for logs.
fn id_hash(s: &str) -> String {
    tidemark_push::token_hash(s)
}

pub async fn run(state: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    let config = state.config.push.clone();
    if config.providers.is_empty() {
        return crate::util::stopped(&mut shutdown).await;
    }
    let inflight = Arc::new(Semaphore::new(config.inflight_max.max(1)));
    let mut work = JoinSet::new();
    loop {
        while work.try_join_next().is_some() {}
        let room = inflight.available_permits().min(config.claim_batch_max as usize) as u32;
        let mut full = false;
        // Offline push waits while the node is overloaded (§9.4): what is
        // owed is derived from committed facts and claimed again later.
        let allowed = state.load.runs(tidemark_core::degrade::Work::Push);
        if allowed && room > 0 && state.store.health().write_failure.is_none() {
            let lease_ms = config.lease.as_millis() as i64;
            match state.store.claim_pushes(now_ms(), lease_ms, room, rules::PUSH_EVENTS_SCAN_MAX).await {
                Ok(claimed) => {
                    full = claimed.len() as u32 == room;
                    for owed in claimed {
                        let permit = inflight.clone().acquire_owned().await.expect("the semaphore is never closed");
                        let state = state.clone();
                        work.spawn(async move {
                            handle(&state, owed).await;
                            drop(permit);
                        });
                    }
                }
                Err(e) => tracing::warn!(error = %e, "push claim failed; will retry"),
            }
        }
        if full {
            continue;
        }
        tokio::select! {
            _ = state.push_wake.notified() => {}
            _ = tokio::time::sleep(config.poll) => {}
            _ = crate::util::stopped(&mut shutdown) => break,
        }
    }
    // Requests in flight are dropped: their claims lapse and the next
    // claim (after a restart, or on another node) pushes the same range.
    work.shutdown().await;
}

/// One claimed target: decide, push, record.
async fn handle(state: &AppState, owed: OwedPushes) {
    let config = &state.config.push;
    let policy = &config.policy;
    let t = &owed.target;
    let now = now_ms();
    let connected = state.hub.is_connected(&t.user, &t.device);
    let facts = PushFacts {
        user: &t.user,
        events: &owed.events,
        connected,
        device_preview: PreviewLevel::parse(&t.preview).unwrap_or_default().into(),
        user_preview: owed.user_preview,
        now_ms: now,
    };
    let step = match rules::decide(facts, policy) {
        PushDecision::Skip { through, expired } => {
            m::PUSH_EXPIRED.add(u64::from(expired));
            PushStep::Advance { through }
        }
        PushDecision::Wait { at_ms } => PushStep::Wait { at_ms },
        PushDecision::Send { through, count, conv, newest, first_at_ms, expired, preview } => {
            m::PUSH_EXPIRED.add(u64::from(expired));
            m::PUSH_OWED.inc();
            m::PUSH_COALESCED.add(u64::from(count.saturating_sub(1)));
            match send(state, &owed, Notification { through, count, conv: &conv, newest, level: preview.into() }).await
            {
                Sent::Answer(answer) => {
                    if answer == Outcome::Accepted {
                        let latency = (now_ms() - first_at_ms).max(0) as f64 / 1000.0;
                        m::PUSH_LATENCY.record(latency);
                    }
                    let answer = core_answer(&answer);
                    match rules::after_answer(answer, through, owed.attempts, now_ms(), policy) {
                        AfterAnswer::Advance { through, gave_up } => {
                            if gave_up {
                                m::PUSH_GIVEN_UP.inc();
                            }
                            PushStep::Advance { through }
                        }
                        AfterAnswer::Retry { at_ms, attempts } => PushStep::Retry { at_ms, attempts },
                        AfterAnswer::Remove => return remove_dead(state, &owed).await,
                    }
                }
                Sent::Unsendable => {
                    m::PUSH_GIVEN_UP.inc();
                    PushStep::Advance { through }
                }
            }
        }
    };
    if let Err(e) = state.store.finish_push(&t.user, &t.device, owed.claim, step, now_ms()).await {
        // The lease lapses and the range is claimed again.
        tracing::warn!(error = %e, user = %id_hash(&t.user), device = %id_hash(&t.device), "push record failed");
    }
}

enum Sent {
    Answer(Outcome),
    /// No provider for the platform, or the token does not open (the key
    /// changed): nothing can be sent, the range is given up.
    Unsendable,
}

/// What one notification says, as `tidemark_core::push::decide` settled it.
struct Notification<'a> {
    through: u64,
    count: u32,
    conv: &'a str,
    newest: u64,
    /// The effective level: the most private of the device's, the user's
    /// and the conversation's.
    level: PreviewLevel,
}

async fn send(state: &AppState, owed: &OwedPushes, n: Notification<'_>) -> Sent {
    let Notification { through, count, conv, newest, level } = n;
    let t = &owed.target;
    let Some(provider) = state.config.push.provider(&t.platform) else {
        tracing::warn!(platform = %t.platform, token = %t.token_hash, "no provider for a push target's platform");
        return Sent::Unsendable;
    };
    let Some(token) = state.push_sealer.open(&t.token_sealed, &device_aad(&t.user, &t.device)) else {
        tracing::warn!(token = %t.token_hash, "a push token does not open with this server's key");
        return Sent::Unsendable;
    };
    let preview = if level >= PreviewLevel::Full {
        owed.events.iter().zip(&owed.contents).find(|(e, _)| e.sync_seq == newest).and_then(|(e, content)| {
            let text = preview_text(content.as_deref()?)?;
            Some(PushPreview { sender: e.sender.clone()?, text })
        })
    } else {
        None
    };
    let payload = PushPayload::new(notification_id(&t.user, &t.device, through), count, level, conv, preview);
    let target = Target {
        platform: provider.platform(),
        token,
        app_id: t.app_id.clone(),
        p256dh: t.p256dh.clone(),
        auth: t.auth.clone(),
    };
    m::PUSH_ATTEMPTS.inc();
    let outcome = provider.deliver(&target, &payload).await;
    m::PUSH_RESULTS.add_by("result", outcome.label(), 1);
    match &outcome {
        Outcome::Failed { reason, .. } => {
            tracing::info!(token = %t.token_hash, result = outcome.label(), %reason, count, "push answered")
        }
        _ => tracing::debug!(token = %t.token_hash, result = outcome.label(), count, "push answered"),
    }
    Sent::Answer(outcome)
}

/// The provider says the token is dead: the target goes, unless the device
/// registered another token meanwhile (then the range is tried again).
async fn remove_dead(state: &AppState, owed: &OwedPushes) {
    let t = &owed.target;
    match state.store.remove_push_target(&t.user, &t.device, Some(&t.token_hash)).await {
        Ok(true) => {
            m::PUSH_TARGETS_REMOVED.inc();
            tracing::info!(device = %id_hash(&t.device), token = %t.token_hash, "push token rejected: target removed");
        }
        Ok(false) => {
            let again = PushStep::Wait { at_ms: now_ms() };
            if let Err(e) = state.store.finish_push(&t.user, &t.device, owed.claim, again, now_ms()).await {
                tracing::warn!(error = %e, token = %t.token_hash, "push record failed");
            }
        }
        Err(e) => tracing::warn!(error = %e, token = %t.token_hash, "removing a rejected push token failed"),
    }
}

fn core_answer(o: &Outcome) -> rules::ProviderAnswer {
    match o {
        Outcome::Accepted => rules::ProviderAnswer::Accepted,
        Outcome::TokenRejected => rules::ProviderAnswer::TokenRejected,
        Outcome::Throttled { retry_after_ms } => rules::ProviderAnswer::Throttled { retry_after_ms: *retry_after_ms },
        Outcome::Failed { retryable, .. } => rules::ProviderAnswer::Failed { retryable: *retryable },
    }
}

/// Stable for one device's range: a retried push carries the same id.
pub fn notification_id(user: &str, device: &str, through: u64) -> String {
    let mut h = Sha256::new();
    h.update(user.as_bytes());
    h.update([0]);
    h.update(device.as_bytes());
    h.update([0]);
    h.update(through.to_be_bytes());
    h.finalize()[..12].iter().map(|b| format!("{b:02x}")).collect()
}
