//! [`CoordinationDriver::start`] and the [`DriverHandle`] that controls a running driver.

use std::time::Duration;

use etl_coordination_core::{Incarnation, InstanceId};
use etl_coordination_store::Store;
use tokio::sync::{mpsc, watch};
use tracing::info;

use crate::config::DriverConfig;
use crate::lane::Lanes;
use crate::outcome::{DriverError, JobOutcome, JobState};
use crate::planner::Planner;
use crate::stores::JobStores;
use crate::task::{Control, Task};

/// Controls a running driver.
#[derive(Clone, Debug)]
pub struct DriverHandle {
    tx: mpsc::UnboundedSender<Control>,
    outcome: watch::Receiver<Option<Result<JobOutcome, DriverError>>>,
    state: watch::Receiver<JobState>,
    instance_id: InstanceId,
}

impl DriverHandle {
    /// Starts a graceful shutdown (P10): lanes get `drain_timeout` to commit, splits are
    /// released, presence is removed; no attempts are consumed.
    pub fn drain(&self) {
        let _ = self.tx.send(Control::Drain);
    }

    /// Stops the worker at once without releasing anything, as a crash would: its leases
    /// expire and peers take over. For tests and chaos experiments.
    pub fn kill(&self) {
        let _ = self.tx.send(Control::Kill);
    }

    /// Freezes the worker's coordination for `duration`, as a stop-the-world pause would
    /// (SIGSTOP, a long GC): no renewals, no watch events, no timers. For tests and chaos.
    pub fn freeze(&self, duration: Duration) {
        let _ = self.tx.send(Control::Freeze(duration));
    }

    /// Waits for the job's outcome for this worker.
    pub async fn outcome(&self) -> Result<JobOutcome, DriverError> {
        let mut rx = self.outcome.clone();
        loop {
            if let Some(result) = rx.borrow_and_update().clone() {
                return result;
            }
            if rx.changed().await.is_err() {
                return rx.borrow().clone().unwrap_or(Err(DriverError::Gone));
            }
        }
    }

    /// The job as this worker sees it, updated as it changes: running (or blocked by records
    /// it cannot decode), then complete or stalled. With
    /// [`DriverConfig::stay_after_end`](crate::DriverConfig::stay_after_end) it goes back to
    /// running when work is requeued; watch it with `changed()`.
    pub fn job_state(&self) -> watch::Receiver<JobState> {
        self.state.clone()
    }

    /// This worker's instance id.
    pub fn instance_id(&self) -> &InstanceId {
        &self.instance_id
    }
}

/// Entry point: see the crate documentation.
#[derive(Debug)]
pub struct CoordinationDriver;

impl CoordinationDriver {
    /// Validates the configuration and spawns the driver on the current tokio runtime.
    pub fn start<S: Store, P: Planner>(
        stores: JobStores<S>,
        planner: P,
        config: DriverConfig,
    ) -> Result<(DriverHandle, Lanes), DriverError> {
        let instance_id = match config.instance_id.clone() {
            Some(id) => id,
            None => InstanceId::new(format!("w-{:016x}", random_u64())).expect("generated ids are valid"),
        };
        let cfg = config.core(instance_id.clone(), Incarnation(random_u64()), planner.fingerprint())?;
        let (outcome_tx, outcome_rx) = watch::channel(None);
        let (state_tx, state_rx) = watch::channel(JobState::Running);
        info!(instance = %instance_id, incarnation = %format!("{:x}", cfg.incarnation.0), "coordination worker starting");
        let (task, tx, lanes) = Task::new(cfg, stores, planner, &config, outcome_tx, state_tx);
        tokio::spawn(task.run());
        Ok((DriverHandle { tx, outcome: outcome_rx, state: state_rx, instance_id }, lanes))
    }
}

/// Randomness for ids and incarnations (the core owns none).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
