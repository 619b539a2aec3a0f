//! The fall-off steps: clients stopped until their cursor fell below their
//! user's retained log, reopened (some with a snapshot fault armed) so they
//! must rebuild from a snapshot.

use std::time::Duration;

use super::config::ChaosConfig;
use super::device::{CrashAt, Device};
use super::report::Report;
use super::server::{ServerSlot, Standing};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Mixed into the seed for the snapshot-fault generator.
pub(super) const SNAPSHOT_FAULT_SEED: u64 = 0x736e_6170_7368_6f74;
/// Scenario steps a fall-off stop lasts when the server's store has no
/// cursor for the device (it never logged in): it cannot fall off.
pub(super) const FALLOFF_UNKNOWN_STEPS: usize = 20;

/// A client stopped by a fall-off step.
pub(super) struct Stop {
    pub(super) device: usize,
    pub(super) step: usize,
    /// Reopened then even if it did not fall off.
    pub(super) deadline: tokio::time::Instant,
}

/// The fall-off steps: clients stopped until their cursor fell below their
/// user's retained log, and the generator of the snapshot faults armed
/// when they are reopened.
pub(super) struct Falloffs {
    pub(super) stopped: Vec<Stop>,
    pub(super) rng: StdRng,
    pub(super) wait_max: Duration,
    pub(super) fault_percent: u32,
}

impl Falloffs {
    pub(super) fn new(cfg: &ChaosConfig) -> Falloffs {
        Falloffs {
            stopped: Vec::new(),
            rng: StdRng::seed_from_u64(cfg.seed ^ SNAPSHOT_FAULT_SEED),
            wait_max: cfg.falloff_wait_max,
            fault_percent: cfg.snapshot_fault_percent,
        }
    }

    /// Stops `hint`, or the next device after it that may be stopped: one
    /// whose user has another device and none stopped, so that another
    /// device of the user keeps ACKing and moves the retention fence (a
    /// user with no device holding the fence keeps the whole log).
    pub(super) async fn stop(&mut self, hint: usize, step: usize, devices: &mut [Device], report: &mut Report) {
        let n = devices.len();
        let may_stop = |d: usize| {
            let user = &devices[d].user;
            let mine = devices.iter().filter(|o| o.user == *user);
            mine.clone().count() > 1 && mine.clone().all(Device::is_open)
        };
        let Some(d) = (0..n).map(|k| (hint + k) % n).find(|d| may_stop(*d)) else {
            report.notes.push(format!("fall-off step at step {step} skipped: no user with two devices running"));
            return;
        };
        devices[d].close().await;
        self.stopped.push(Stop { device: d, step, deadline: tokio::time::Instant::now() + self.wait_max });
        report.falloff_stops += 1;
    }

    /// Reopens every stopped client whose server cursor fell below its
    /// user's trim point (recorded with the device, maybe with a snapshot
    /// fault armed), and those that cannot or did not: one stopped in a
    /// state that holds no fence at once, others at the deadline;
    /// [`FALLOFF_UNKNOWN_STEPS`] steps, or the end of the sends (`step`
    /// `None`), when the server's store has no cursor for it.
    pub(super) async fn reopen(
        &mut self,
        step: Option<usize>,
        server: &ServerSlot,
        devices: &mut [Device],
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let mut k = 0;
        while k < self.stopped.len() {
            let (device, stopped_at, deadline) = {
                let s = &self.stopped[k];
                (s.device, s.step, s.deadline)
            };
            let dev = &mut devices[device];
            let standing = server.standing(&dev.user, &dev.id).await?;
            let fell = standing.as_ref().and_then(Standing::fell_off);
            let due = match (&standing, step) {
                // Stopped mid-rebuild (`RESETTING`): it holds no fence and
                // cannot fall off; it rebuilds once reopened anyway.
                (Some(s), _) => !s.fencing || tokio::time::Instant::now() >= deadline,
                (None, Some(step)) => step >= stopped_at + FALLOFF_UNKNOWN_STEPS,
                (None, None) => true,
            };
            if fell.is_none() && !due {
                k += 1;
                continue;
            }
            self.stopped.remove(k);
            match fell {
                Some(f) => {
                    report.fell_off += 1;
                    dev.log.lock().expect("log lock").fall_off(f);
                    if self.rng.random_range(0..100) < self.fault_percent {
                        let at = CrashAt::SNAPSHOT[self.rng.random_range(0..CrashAt::SNAPSHOT.len())];
                        let mut plan = dev.crash.lock().expect("crash plan lock");
                        if plan.is_none() {
                            *plan = Some(at);
                            report.snapshot_faults_armed += 1;
                        }
                    }
                }
                None => {
                    report.falloff_timeouts += 1;
                    if let Some(s) = standing {
                        let why = if s.fencing {
                            format!("after {:?}", self.wait_max)
                        } else {
                            "at once (it holds no retention fence)".to_owned()
                        };
                        report.notes.push(format!(
                            "{}: stopped at step {stopped_at}, reopened {why} without falling off: {s:?}",
                            dev.name()
                        ));
                    }
                }
            }
            dev.open().await?;
        }
        Ok(())
    }
}
