//! What a worker reports of its job: metrics from the core's events, the job state (running,
//! blocked, complete, stalled) with its gauge and its log line, and the final metrics.

use etl_coordination_core::Event;
use etl_coordination_metrics::{Metrics, WriteOutcome};
use etl_coordination_store::layers::{Call, CallOutcome, Op, StoreObserver};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::outcome::{DriverError, JobOutcome, JobState};

/// The job as this worker reports it.
pub(crate) struct JobReport {
    pub(crate) metrics: Metrics,
    job_state: watch::Sender<JobState>,
    /// How the job ended, while the worker stays after the end (`stay_after_end`).
    pub(crate) ended: Option<JobState>,
    /// State-bucket keys the core reports it cannot decode, and plan splits without a record:
    /// either keeps the job from completing (`JobState::Blocked`).
    blocking: (u32, u32),
    /// The `job_state` label last recorded.
    state_label: &'static str,
}

impl JobReport {
    pub(crate) fn new(metrics: Metrics, job_state: watch::Sender<JobState>) -> Self {
        JobReport { metrics, job_state, ended: None, blocking: (0, 0), state_label: "running" }
    }

    /// Records a core event in the metrics (and the job state, when what blocks it changed).
    pub(crate) fn record(&mut self, e: &Event) {
        match e {
            Event::Acquired { reason, .. } => self.metrics.acquisition(reason.label()),
            Event::Handover { outcome, .. } => self.metrics.steal(outcome.label()),
            Event::StealAsked { honoured, .. } => self.metrics.steal_request(*honoured),
            Event::Revoked { reason, .. } => {
                if let Some(label) = reason.revocation_label() {
                    self.metrics.revocation(label);
                }
            }
            Event::Leadership { leader, .. } => self.metrics.leader(*leader),
            Event::PlanFailed { .. } => self.metrics.plan_failure(),
            Event::Gauges { owned, live_workers, splits, undecodable_state, undecodable_lease } => {
                self.metrics.splits_owned(*owned);
                self.metrics.live_workers(*live_workers);
                self.metrics.splits_quarantined(splits.quarantined);
                self.metrics.splits([
                    splits.unleased,
                    splits.owned,
                    splits.done,
                    splits.quarantined,
                    splits.undecodable,
                    splits.missing,
                ]);
                self.metrics.work(splits.weight_planned, splits.weight_done);
                self.metrics.records_undecodable("state", *undecodable_state);
                self.metrics.records_undecodable("lease", *undecodable_lease);
                let blocking = (*undecodable_state, splits.missing);
                if self.blocking != blocking {
                    self.blocking = blocking;
                    self.publish_state();
                }
            }
            _ => {}
        }
    }

    /// Publishes the job state (and its `job_state` gauge) from what is known: the end while
    /// staying after it, else running, or blocked while split records cannot be decoded or are
    /// missing.
    pub(crate) fn publish_state(&mut self) {
        let (undecodable, missing) = self.blocking;
        let state = match &self.ended {
            Some(end) => end.clone(),
            None if undecodable + missing > 0 => JobState::Blocked { undecodable, missing },
            None => JobState::Running,
        };
        let label = match state {
            JobState::Running => "running",
            JobState::Blocked { .. } => "blocked",
            JobState::Complete => "complete",
            JobState::Stalled { .. } => "stalled",
        };
        if label != self.state_label {
            if label == "blocked" {
                warn!(
                    undecodable,
                    missing,
                    "the job is blocked: records that cannot be decoded or are missing keep it from completing (see `etl-coord status`; `etl-coord requeue --reset` rewrites a split)"
                );
            }
            self.state_label = label;
            self.metrics.job_state(label);
        }
        self.job_state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
    }

    /// The worker stops with `result`: its gauges fall to zero and the job state says how it
    /// ended.
    pub(crate) fn finished(&mut self, result: &Result<JobOutcome, DriverError>) {
        self.metrics.splits_owned(0);
        self.metrics.leader(false);
        self.metrics.lanes_stalled(0);
        self.publish_state();
        self.metrics.job_state(match result {
            Ok(JobOutcome::Complete) => "complete",
            Ok(JobOutcome::Stalled { .. }) | Err(DriverError::Stalled { .. }) => "stalled",
            Ok(JobOutcome::Drained) => "drained",
            Err(_) => "failed",
        });
    }
}

/// The store metrics of a worker, as an observer of its stores: the latency of every request a
/// core makes and the outcome of every write (opening a watch is not a request).
pub(crate) struct StoreMetrics(pub(crate) Metrics);

impl StoreObserver for StoreMetrics {
    fn observe(&self, call: &Call<'_>) {
        if call.op == Op::Watch {
            return;
        }
        self.0.store_op(call.op.name(), call.elapsed);
        if call.op.is_write() {
            self.0.write(match call.outcome {
                CallOutcome::Ok => WriteOutcome::Ok,
                CallOutcome::Conflict => WriteOutcome::Conflict,
                _ => WriteOutcome::Error,
            });
        }
    }
}

/// Logs a core event at its level, with its context.
pub(crate) fn log_event(e: &Event) {
    match e {
        Event::Acquired { split, reason, epoch } => {
            info!(%split, reason = reason.label(), %epoch, "split acquired")
        }
        Event::Revoked { split, reason } => warn!(%split, ?reason, "lane revoked"),
        Event::Steal { split, victim, weight, loads: (theirs, ours) } => info!(
            %split,
            %victim,
            weight,
            victim_load = %theirs,
            own_load = %ours,
            "stealing a split to balance load (P9)"
        ),
        Event::Handover { split, victim, from, to, outcome } => info!(
            %split,
            %victim,
            from_epoch = %from,
            to_epoch = to.map(|e| e.to_string()).unwrap_or_default(),
            outcome = outcome.label(),
            "steal ended"
        ),
        Event::StealAsked { split, thief, honoured: true } => {
            info!(%split, %thief, "a peer asked for this split: committing and handing it over")
        }
        Event::StealAsked { split, thief, honoured: false } => {
            debug!(%split, %thief, "a peer asked for this split: refused (the move would not lower the imbalance, or the tenancy asked for is over)")
        }
        Event::Leadership { leader, term } => info!(leader, term, "leadership changed"),
        Event::PlanPublished { term, version, splits } => info!(term, version, splits, "plan published"),
        Event::PlanFailed { error } => warn!(%error, "planner failed; retrying"),
        Event::Quarantined { split, attempts, last_error } => {
            warn!(%split, attempts, last_error = last_error.as_deref().unwrap_or(""), "split quarantined")
        }
        Event::Failed { split, attempts, error, retry_in } => warn!(
            %split,
            attempts,
            error = error.as_deref().unwrap_or(""),
            retry_in = ?retry_in,
            "split failed; it is claimed again once its backoff has passed"
        ),
        Event::Released { split } => info!(%split, "split released"),
        Event::Finished { split } => info!(%split, "split done"),
        Event::Gauges { owned, live_workers, splits, undecodable_state, undecodable_lease } => {
            debug!(owned, live_workers, ?splits, undecodable_state, undecodable_lease, "gauges")
        }
        Event::Undecodable { key, error } => warn!(
            %key,
            %error,
            "a value in the job's buckets cannot be decoded; it is ignored (a split record so written blocks the job until `etl-coord requeue --reset`)"
        ),
        Event::JobMaxAttempts { job, configured } => warn!(
            job_max_attempts = job,
            configured_max_attempts = configured,
            "max_attempts in effect is now {job}, the job's (recorded in its meta; this worker was configured \
             with {configured}, which only seeds a new job); `etl-coord job set-max-attempts` changes it"
        ),
        Event::JobEnded { .. } | Event::JobReopened => {}
        // Events are informational and grow; one this driver does not know is still visible.
        other => debug!(event = ?other, "event"),
    }
}

#[cfg(test)]
mod tests {
    use etl_coordination_core::{AcquisitionReason, HandoverOutcome, StopReason};
    use etl_coordination_metrics::{ACQUISITION_REASONS, REVOCATION_REASONS, STEAL_OUTCOMES};

    /// The metrics crate does not depend on the protocol, so its label lists are tied to the
    /// core's enums here, where both meet: a new reason cannot miss its counter.
    #[test]
    fn metric_label_values_are_the_cores_reasons() {
        assert_eq!(AcquisitionReason::ALL.map(|r| r.label()), ACQUISITION_REASONS);
        assert_eq!(HandoverOutcome::ALL.map(|o| o.label()), STEAL_OUTCOMES);
        let revocations: Vec<&str> = StopReason::ALL.iter().filter_map(|r| r.revocation_label()).collect();
        assert_eq!(revocations, REVOCATION_REASONS);
    }
}
