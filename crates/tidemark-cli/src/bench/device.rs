//! What the benchmark scenarios share about their users and devices: the
//! bench users' password and its cheap hash, the progress bar, and
//! [`Device`], a bare WebSocket that syncs the way the SDK does.

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use tidemark_client::proto::{SyncReq, UserEvent};
use tidemark_client::{policy, ClientError, WsConn};

/// Every bench user's password.
pub(super) const PASSWORD: &str = "bench-password";

/// A password hash with the cheapest Argon2 parameters, computed once and
/// stored for every bench user: logins verify with the parameters in the
/// hash, so setting up hundreds of devices does not cost seconds of Argon2.
/// Setup only; nothing measured logs in.
pub(super) fn cheap_hash() -> Result<String> {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let params = argon2::Params::new(8, 1, 1, None).map_err(|e| anyhow::anyhow!("{e}"))?;
    let argon = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let salt = SaltString::from_b64("YmVuY2hzYWx0YmVuY2g").map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(argon.hash_password(PASSWORD.as_bytes(), &salt).map_err(|e| anyhow::anyhow!("{e}"))?.to_string())
}

pub(super) fn bar(len: u64, unit: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} {{msg:<30}} [{{bar:30}}] {{pos}}/{{len}} {unit}  {{per_sec}}  eta {{eta}}"
        ))
        .expect("static template")
        .progress_chars("=> "),
    );
    pb
}

/// Most runs of one sync or ACK a [`Device`] makes while the server answers
/// it "retry later" (`UNAVAILABLE`, `RATE_LIMITED`).
const RETRY_ATTEMPTS_MAX: u32 = 20;

/// A device's sync position and its connection, synced the way the SDK
/// does: a batch from its first page to `has_more: false`, each page ACKed,
/// and a request the server answers "retry later" run again after the wait
/// the SDK's policy gives it (`policy::action_for`, `Backoff::delay_after`).
pub(super) struct Device {
    pub ws: WsConn,
    pub generation: Option<u64>,
    pub applied: u64,
    pub pages: u64,
    pub acks: u64,
    /// Requests run again after a "retry later" answer.
    pub retries: u64,
}

impl Device {
    pub(super) fn new(ws: WsConn) -> Device {
        Device::at(ws, None, 0)
    }

    /// A device that already applied its log up to `applied` under
    /// `generation`.
    pub(super) fn at(ws: WsConn, generation: Option<u64>, applied: u64) -> Device {
        Device { ws, generation, applied, pages: 0, acks: 0, retries: 0 }
    }

    /// Runs `request` until it is answered other than "retry later", or
    /// [`RETRY_ATTEMPTS_MAX`] runs.
    async fn retrying<T, F, Fut>(&mut self, op: policy::Op, mut request: F) -> Result<T, ClientError>
    where
        F: FnMut(WsConn) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let backoff = policy::Backoff::default();
        let mut attempt = 0;
        loop {
            match request(self.ws.clone()).await {
                Err(e) if attempt + 1 < RETRY_ATTEMPTS_MAX => match policy::action_for(op, &e) {
                    policy::Action::Retry { retry_after } => {
                        let wait = backoff.delay_after(retry_after, attempt, rand::random());
                        tokio::time::sleep(wait).await;
                        attempt += 1;
                        self.retries += 1;
                    }
                    _ => return Err(e),
                },
                other => return other,
            }
        }
    }

    /// One sync batch; `on_event` sees every event not applied before.
    pub(super) async fn catch_up(&mut self, limit: u32, mut on_event: impl FnMut(&UserEvent)) -> Result<()> {
        let first = SyncReq {
            sync_generation: self.generation,
            local_applied_sync_seq: Some(self.applied),
            limit: Some(limit),
            ..SyncReq::default()
        };
        let first = &first;
        let mut page =
            self.retrying(policy::Op::Sync, |ws| async move { ws.sync(first).await }).await.context("sync")?;
        let token = page.batch_token.clone();
        let mut acked = page.resume_from;
        if self.generation != Some(page.sync_generation) {
            self.applied = page.resume_from;
        }
        self.generation = Some(page.sync_generation);
        loop {
            self.pages += 1;
            let mut top = acked;
            for ev in &page.events {
                if ev.sync_seq > self.applied {
                    on_event(ev);
                }
                top = top.max(ev.sync_seq);
            }
            let ack_to = if page.has_more { top } else { page.batch_high_watermark.max(top) };
            if ack_to > acked {
                let token = &token;
                self.retrying(policy::Op::Ack, |ws| async move { ws.ack(token, ack_to).await }).await.context("ack")?;
                self.acks += 1;
                acked = ack_to;
            }
            self.applied = self.applied.max(acked);
            if !page.has_more {
                return Ok(());
            }
            let next = SyncReq {
                batch_token: Some(token.clone()),
                cursor: page.next_cursor.clone(),
                limit: Some(limit),
                ..SyncReq::default()
            };
            let next = &next;
            page = self
                .retrying(policy::Op::Sync, |ws| async move { ws.sync(next).await })
                .await
                .context("sync next page")?;
        }
    }
}
