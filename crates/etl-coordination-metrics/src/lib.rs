//! The `etl_coordination_*` metric families (docs/METRICS.md) on the [`metrics`] facade, and
//! their Prometheus exposition.
//!
//! [`Metrics`] is a small typed handle: one per worker, carrying the `coordination_job` and
//! `coordination_instance` labels (not `job` and `instance`, which Prometheus sets on scrape),
//! so several workers in one process (the embedded default) stay apart in
//! one exporter. The protocol core never touches metrics; the driver records them from the
//! core's events and from its store calls. `install_prometheus` (feature `prometheus`) installs
//! a global recorder and returns the handle whose `render()` is the text exposition served at
//! `/metrics`; without it the families go to whatever recorder the process installed (none:
//! they cost nothing).
//!
//! The families, their labels and what to alert on are documented in `docs/METRICS.md`.
//!
//! ```
//! # #[cfg(feature = "prometheus")] {
//! use etl_coordination_metrics::{Metrics, install_prometheus};
//!
//! let exposition = install_prometheus()?; // once per process
//! let worker = Metrics::new("orders-backfill", "pod-0"); // every family appears, zeroed
//! worker.splits_owned(3);
//! let text = exposition.render(); // what `/metrics` serves
//! let owned = text
//!     .lines()
//!     .find(|l| l.starts_with("etl_coordination_splits_owned{") && l.contains(r#"coordination_instance="pod-0""#))
//!     .expect("the gauge is exported");
//! assert!(owned.ends_with(" 3"), "{owned}");
//! assert!(text.contains("etl_coordination_acquisitions_total{"), "counters start at zero");
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::Duration;

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
#[cfg(feature = "prometheus")]
pub use metrics_exporter_prometheus::PrometheusHandle;

/// Metric names, so dashboards, alerts and tests can refer to them.
pub mod names {
    /// Gauge: splits this worker holds.
    pub const SPLITS_OWNED: &str = "etl_coordination_splits_owned";
    /// Gauge: live workers in this worker's fleet view.
    pub const LIVE_WORKERS: &str = "etl_coordination_live_workers";
    /// Gauge: 1 while this worker leads, else 0.
    pub const LEADER: &str = "etl_coordination_leader";
    /// Counter: acquisitions by reason.
    pub const ACQUISITIONS_TOTAL: &str = "etl_coordination_acquisitions_total";
    /// Counter: lane revocations by reason.
    pub const REVOCATIONS_TOTAL: &str = "etl_coordination_revocations_total";
    /// Gauge: quarantined splits of the plan.
    pub const SPLITS_QUARANTINED: &str = "etl_coordination_splits_quarantined";
    /// Histogram: store round-trip time by operation.
    pub const STORE_OP_DURATION_SECONDS: &str = "etl_coordination_store_op_duration_seconds";
    /// Counter: store writes by outcome.
    pub const WRITES_TOTAL: &str = "etl_coordination_writes_total";
    /// Gauge: 1 for the state this worker's view of the job is in (`state` label), 0 for the
    /// others.
    pub const JOB_STATE: &str = "etl_coordination_job_state";
    /// Counter: planner calls that failed (an error, a panic, or no answer within the plan
    /// timeout); each is retried after a backoff.
    pub const PLAN_FAILURES_TOTAL: &str = "etl_coordination_plan_failures_total";

    /// Gauge: the plan's splits by the state of their records (`state` label), as this
    /// worker's view has them.
    pub const SPLITS: &str = "etl_coordination_splits";
    /// Gauge: keys of the job's buckets whose current value this worker cannot decode, by
    /// bucket (`bucket` label).
    pub const RECORDS_UNDECODABLE: &str = "etl_coordination_records_undecodable";
    /// Gauge: this worker's lanes that hold their lease but committed no progress for the lane
    /// stall timeout.
    pub const LANES_STALLED: &str = "etl_coordination_lanes_stalled";
    /// Counter: lanes found stalled (each counted once per stall).
    pub const LANE_STALLS_TOTAL: &str = "etl_coordination_lane_stalls_total";
    /// Counter: bad records this worker's lanes skipped into the dead-letter sink.
    pub const RECORDS_SKIPPED_TOTAL: &str = "etl_coordination_records_skipped_total";
    /// Gauge: 1 while this worker's breaker is open or probing (intake paused, failures of
    /// its cause not charged to splits).
    pub const BREAKER_OPEN: &str = "etl_coordination_breaker_open";
    /// Counter: times this worker's breaker opened (a failed probe counts again).
    pub const BREAKER_TRIPS_TOTAL: &str = "etl_coordination_breaker_trips_total";
    /// Counter: cooperative steals this worker asked for, by how they ended (`outcome` label).
    pub const STEALS_TOTAL: &str = "etl_coordination_steals_total";
    /// Counter: peers' requests for one of this worker's splits, by its answer (`answer` label).
    pub const STEAL_REQUESTS_TOTAL: &str = "etl_coordination_steal_requests_total";

    /// Gauge: the published plan's total weight (the planner's unit: bytes, rows), as this
    /// worker's view has it.
    pub const WORK_PLANNED: &str = "etl_coordination_work_planned";
    /// Gauge: the weight of the plan's Done splits, as this worker's view has it.
    pub const WORK_DONE: &str = "etl_coordination_work_done";
    /// Counter: weight this worker's lanes processed (committed positions within splits, and
    /// the rest of each split they finished).
    pub const WORK_PROCESSED_TOTAL: &str = "etl_coordination_work_processed_total";
    /// Counter: records this worker's lanes wrote to the sink (counted at each commit and at a
    /// split's end).
    pub const RECORDS_WRITTEN_TOTAL: &str = "etl_coordination_records_written_total";

    /// Every family.
    pub const ALL: [&str; 23] = [
        SPLITS_OWNED,
        LIVE_WORKERS,
        LEADER,
        ACQUISITIONS_TOTAL,
        REVOCATIONS_TOTAL,
        SPLITS_QUARANTINED,
        STORE_OP_DURATION_SECONDS,
        WRITES_TOTAL,
        JOB_STATE,
        PLAN_FAILURES_TOTAL,
        SPLITS,
        RECORDS_UNDECODABLE,
        LANES_STALLED,
        LANE_STALLS_TOTAL,
        RECORDS_SKIPPED_TOTAL,
        BREAKER_OPEN,
        BREAKER_TRIPS_TOTAL,
        STEALS_TOTAL,
        STEAL_REQUESTS_TOTAL,
        WORK_PLANNED,
        WORK_DONE,
        WORK_PROCESSED_TOTAL,
        RECORDS_WRITTEN_TOTAL,
    ];
}

/// Acquisition reasons (label values of `acquisitions_total`).
pub const ACQUISITION_REASONS: [&str; 5] = ["create", "released", "expired", "reclaimed", "stolen"];
/// How cooperative steals ended (label values of `steals_total`): `handed_over` (the owner
/// committed and released: nothing read twice), `forced` (taken over at the deadline: the
/// owner's uncommitted tail replays), `withdrawn` (no longer helped), `refused` (the owner's own
/// load said no).
pub const STEAL_OUTCOMES: [&str; 4] = ["handed_over", "forced", "withdrawn", "refused"];
/// How this worker answered peers' steal requests (label values of `steal_requests_total`):
/// `honoured` (the lane was told to commit and hand the split over) or `refused` (by this
/// worker's own load the move would not help, or the tenancy asked for was over).
pub const STEAL_ANSWERS: [&str; 2] = ["honoured", "refused"];
/// Revocation reasons (label values of `revocations_total`).
pub const REVOCATION_REASONS: [&str; 2] = ["fenced", "starved"];
/// Write outcomes (label values of `writes_total`).
pub const WRITE_OUTCOMES: [&str; 3] = ["ok", "conflict", "error"];
/// Store operations (label values of `store_op_duration_seconds`).
pub const STORE_OPS: [&str; 6] = ["create", "cas", "delete", "get", "list", "watch"];
/// Job states (label values of `job_state`): `running` while splits remain, `blocked` while
/// records the worker cannot decode keep the job from completing, then how it ended:
/// `complete` (every split Done), `stalled` (quarantined splits block completion), `drained`
/// (this worker left on request), `failed` (a fatal condition stopped it). A worker that stays
/// after the end (`--on-complete wait`) goes back to `running` when work is requeued.
pub const JOB_STATES: [&str; 6] = ["running", "blocked", "complete", "stalled", "drained", "failed"];
/// Split states (label values of `splits`).
pub const SPLIT_STATES: [&str; 6] = ["unleased", "owned", "done", "quarantined", "undecodable", "missing"];
/// The job's buckets (label values of `records_undecodable`).
pub const BUCKETS: [&str; 2] = ["state", "lease"];

/// Outcome of one store write, for `writes_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WriteOutcome {
    /// Applied.
    Ok,
    /// The fence said no (revision mismatch, already exists): fencing working as designed.
    Conflict,
    /// Failed or in doubt (timeout, unavailable).
    Error,
}

impl WriteOutcome {
    fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Conflict => "conflict",
            Self::Error => "error",
        }
    }
}

/// Describes every family (help text and unit) to the installed recorder.
pub fn describe() {
    describe_gauge!(names::SPLITS_OWNED, Unit::Count, "Splits this worker holds (its lanes).");
    describe_gauge!(
        names::LIVE_WORKERS,
        Unit::Count,
        "Live workers in this worker's fleet view (presence keys)."
    );
    describe_gauge!(names::LEADER, "1 while this worker holds the leader lease and plans, else 0.");
    describe_counter!(
        names::ACQUISITIONS_TOTAL,
        Unit::Count,
        "Split acquisitions by reason: create, released, expired, reclaimed, stolen."
    );
    describe_counter!(
        names::REVOCATIONS_TOTAL,
        Unit::Count,
        "Lanes stopped because ownership was lost (fenced) or could not be renewed in time (starved)."
    );
    describe_gauge!(
        names::SPLITS_QUARANTINED,
        Unit::Count,
        "Splits of the plan parked after max_attempts failing tenancies."
    );
    describe_histogram!(
        names::STORE_OP_DURATION_SECONDS,
        Unit::Seconds,
        "Round-trip time of coordination store operations."
    );
    describe_counter!(
        names::WRITES_TOTAL,
        Unit::Count,
        "Coordination store writes by outcome; conflict is fencing working as designed."
    );
    describe_counter!(
        names::PLAN_FAILURES_TOTAL,
        Unit::Count,
        "Planner calls on the leader that failed, panicked or timed out; each is retried after a backoff."
    );
    describe_gauge!(
        names::JOB_STATE,
        "1 for this worker's job state (running, blocked, complete, stalled, drained, failed), else 0."
    );
    describe_gauge!(
        names::SPLITS,
        Unit::Count,
        "Splits of the published plan by record state (unleased, owned, done, quarantined, undecodable, missing), as this worker sees them."
    );
    describe_gauge!(
        names::RECORDS_UNDECODABLE,
        Unit::Count,
        "Keys of the job's buckets (state, lease) whose value this worker cannot decode; one in the state bucket blocks completion."
    );
    describe_gauge!(
        names::LANES_STALLED,
        Unit::Count,
        "Lanes of this worker that hold their lease but committed no progress for the lane stall timeout."
    );
    describe_counter!(
        names::LANE_STALLS_TOTAL,
        Unit::Count,
        "Lanes found stalled (no committed progress for the lane stall timeout while holding the lease)."
    );
    describe_counter!(
        names::RECORDS_SKIPPED_TOTAL,
        Unit::Count,
        "Bad records skipped into the dead-letter sink (on-bad-record skip)."
    );
    describe_gauge!(
        names::BREAKER_OPEN,
        Unit::Count,
        "1 while this worker's breaker is open or probing: distinct splits failed with one cause, intake is paused and that cause is not charged to splits."
    );
    describe_counter!(names::BREAKER_TRIPS_TOTAL, Unit::Count, "Times this worker's breaker opened.");
    describe_counter!(
        names::STEALS_TOTAL,
        Unit::Count,
        "Cooperative steals this worker asked for, by outcome: handed_over, forced, withdrawn, refused."
    );
    describe_gauge!(
        names::WORK_PLANNED,
        "The published plan's total weight (the planner's unit: bytes, rows), as this worker sees it."
    );
    describe_gauge!(
        names::WORK_DONE,
        "The weight of the plan's Done splits, as this worker sees it; with work_planned, the job's progress by work."
    );
    describe_counter!(
        names::WORK_PROCESSED_TOTAL,
        "Weight this worker's lanes processed (positions within splits, and the rest of each split finished); its rate is the job's pace."
    );
    describe_counter!(
        names::RECORDS_WRITTEN_TOTAL,
        Unit::Count,
        "Records this worker's lanes wrote to the sink, counted at commits and at a split's end."
    );
    describe_counter!(
        names::STEAL_REQUESTS_TOTAL,
        Unit::Count,
        "Peers' requests for one of this worker's splits, by answer: honoured, refused."
    );
}

/// Typed metric handles of one worker.
#[derive(Clone, Debug)]
pub struct Metrics {
    job: String,
    instance: String,
}

impl Metrics {
    /// Handles labelled with the job and this worker's instance id. Zeroes every series so
    /// that dashboards and alerts see each family from the start.
    pub fn new(job: impl Into<String>, instance: impl Into<String>) -> Self {
        let m = Metrics { job: job.into(), instance: instance.into() };
        m.splits_owned(0);
        m.leader(false);
        m.splits_quarantined(0);
        m.job_state("running");
        m.splits([0; 6]);
        m.work(0, 0);
        m.worked(0, 0);
        for bucket in BUCKETS {
            m.records_undecodable(bucket, 0);
        }
        m.lanes_stalled(0);
        counter!(names::LANE_STALLS_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone()).increment(0);
        counter!(names::RECORDS_SKIPPED_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone()).increment(0);
        counter!(names::BREAKER_TRIPS_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone()).increment(0);
        m.breaker_open(false);
        for reason in ACQUISITION_REASONS {
            counter!(names::ACQUISITIONS_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone(), "reason" => reason).increment(0);
        }
        for outcome in STEAL_OUTCOMES {
            counter!(names::STEALS_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone(), "outcome" => outcome).increment(0);
        }
        for answer in STEAL_ANSWERS {
            counter!(names::STEAL_REQUESTS_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone(), "answer" => answer).increment(0);
        }
        for reason in REVOCATION_REASONS {
            counter!(names::REVOCATIONS_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone(), "reason" => reason).increment(0);
        }
        for outcome in WRITE_OUTCOMES {
            counter!(names::WRITES_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone(), "outcome" => outcome).increment(0);
        }
        counter!(names::PLAN_FAILURES_TOTAL, "coordination_job" => m.job.clone(), "coordination_instance" => m.instance.clone()).increment(0);
        m
    }

    /// `splits_owned`.
    pub fn splits_owned(&self, n: u32) {
        gauge!(names::SPLITS_OWNED, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).set(n as f64);
    }

    /// `live_workers`.
    pub fn live_workers(&self, n: u32) {
        gauge!(names::LIVE_WORKERS, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).set(n as f64);
    }

    /// `leader`.
    pub fn leader(&self, leading: bool) {
        gauge!(names::LEADER, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone())
            .set(if leading { 1.0 } else { 0.0 });
    }

    /// `acquisitions_total{reason}`.
    pub fn acquisition(&self, reason: &'static str) {
        counter!(names::ACQUISITIONS_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "reason" => reason).increment(1);
    }

    /// `steals_total{outcome}`.
    pub fn steal(&self, outcome: &'static str) {
        counter!(names::STEALS_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "outcome" => outcome).increment(1);
    }

    /// `steal_requests_total{answer}`.
    pub fn steal_request(&self, honoured: bool) {
        let answer = if honoured { "honoured" } else { "refused" };
        counter!(names::STEAL_REQUESTS_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "answer" => answer).increment(1);
    }

    /// `revocations_total{reason}`.
    pub fn revocation(&self, reason: &'static str) {
        counter!(names::REVOCATIONS_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "reason" => reason).increment(1);
    }

    /// `splits_quarantined`.
    pub fn splits_quarantined(&self, n: u32) {
        gauge!(names::SPLITS_QUARANTINED, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).set(n as f64);
    }

    /// `store_op_duration_seconds{op}`.
    pub fn store_op(&self, op: &'static str, took: Duration) {
        histogram!(names::STORE_OP_DURATION_SECONDS, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "op" => op)
            .record(took.as_secs_f64());
    }

    /// `job_state{state}`: `state` (one of [`JOB_STATES`]) to 1, the others to 0.
    pub fn job_state(&self, state: &'static str) {
        debug_assert!(JOB_STATES.contains(&state), "unknown job state {state}");
        for s in JOB_STATES {
            gauge!(names::JOB_STATE, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "state" => s)
                .set(if s == state { 1.0 } else { 0.0 });
        }
    }

    /// `plan_failures_total`.
    pub fn plan_failure(&self) {
        counter!(names::PLAN_FAILURES_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).increment(1);
    }

    /// `splits{state}`: counts in the order of [`SPLIT_STATES`].
    pub fn splits(&self, counts: [u32; 6]) {
        for (state, n) in SPLIT_STATES.into_iter().zip(counts) {
            gauge!(names::SPLITS, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "state" => state)
                .set(f64::from(n));
        }
    }

    /// `work_planned` and `work_done`: the plan's weight and that of its Done splits.
    pub fn work(&self, planned: u64, done: u64) {
        gauge!(names::WORK_PLANNED, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).set(planned as f64);
        gauge!(names::WORK_DONE, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).set(done as f64);
    }

    /// `work_processed_total` and `records_written_total`: `weight` and `records` more.
    pub fn worked(&self, weight: u64, records: u64) {
        counter!(names::WORK_PROCESSED_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).increment(weight);
        counter!(names::RECORDS_WRITTEN_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).increment(records);
    }

    /// `records_undecodable{bucket}` (one of [`BUCKETS`]).
    pub fn records_undecodable(&self, bucket: &'static str, n: u32) {
        debug_assert!(BUCKETS.contains(&bucket), "unknown bucket {bucket}");
        gauge!(names::RECORDS_UNDECODABLE, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "bucket" => bucket).set(f64::from(n));
    }

    /// `lanes_stalled`.
    pub fn lanes_stalled(&self, n: u32) {
        gauge!(names::LANES_STALLED, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).set(f64::from(n));
    }

    /// `lane_stalls_total`.
    pub fn lane_stall(&self) {
        counter!(names::LANE_STALLS_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).increment(1);
    }

    /// `records_skipped_total`.
    pub fn record_skipped(&self) {
        counter!(names::RECORDS_SKIPPED_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).increment(1);
    }

    /// `breaker_open`.
    pub fn breaker_open(&self, open: bool) {
        gauge!(names::BREAKER_OPEN, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).set(if open { 1.0 } else { 0.0 });
    }

    /// `breaker_trips_total`.
    pub fn breaker_trip(&self) {
        counter!(names::BREAKER_TRIPS_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone()).increment(1);
    }

    /// `writes_total{outcome}`.
    pub fn write(&self, outcome: WriteOutcome) {
        counter!(names::WRITES_TOTAL, "coordination_job" => self.job.clone(), "coordination_instance" => self.instance.clone(), "outcome" => outcome.label()).increment(1);
    }
}

/// The Prometheus recorder could not be installed.
#[cfg(feature = "prometheus")]
#[derive(Debug, thiserror::Error)]
#[error("cannot install the Prometheus metrics recorder: {0} (is another metrics recorder installed?)")]
pub struct InstallError(String);

/// How often the recorder's upkeep runs: it folds recorded histogram samples into their
/// buckets, which otherwise pile up until something renders (a worker nobody scrapes would
/// grow for as long as it runs).
pub const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Installs a global Prometheus recorder (store-op latencies as histograms with buckets from
/// 100 µs to 10 s), describes every family, and starts the recorder's upkeep (a thread running
/// it every [`UPKEEP_INTERVAL`]). Call once per process.
#[cfg(feature = "prometheus")]
pub fn install_prometheus() -> Result<PrometheusHandle, InstallError> {
    let buckets = [
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(names::STORE_OP_DURATION_SECONDS.into()),
            &buckets,
        )
        .map_err(|e| InstallError(e.to_string()))?
        .install_recorder()
        .map_err(|e| InstallError(e.to_string()))?;
    describe();
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_INTERVAL);
                upkeep.run_upkeep();
            }
        })
        .map_err(|e| InstallError(format!("starting the metrics upkeep thread: {e}")))?;
    Ok(handle)
}

#[cfg(all(test, feature = "prometheus"))]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_exposed_with_its_labels_and_type() {
        let handle = install_prometheus().expect("first install");
        let m = Metrics::new("backfill", "pod-1");
        m.splits_owned(3);
        m.live_workers(2);
        m.leader(true);
        m.acquisition("stolen");
        m.revocation("starved");
        m.splits_quarantined(1);
        m.store_op("cas", Duration::from_micros(300));
        m.write(WriteOutcome::Conflict);
        m.job_state("stalled");
        m.plan_failure();
        m.splits([3, 2, 40, 1, 1, 0]);
        m.records_undecodable("state", 1);
        m.lanes_stalled(1);
        m.lane_stall();
        m.record_skipped();
        m.breaker_open(true);
        m.breaker_trip();
        m.steal("handed_over");
        m.steal_request(true);
        m.work(3000, 1200);
        m.worked(700, 35);
        m.worked(100, 5);
        let text = handle.render();
        for family in names::ALL {
            assert!(text.contains(&format!("# HELP {family}")), "{family} has help text:\n{text}");
        }
        let expect = [
            "# TYPE etl_coordination_splits_owned gauge",
            "# TYPE etl_coordination_acquisitions_total counter",
            "# TYPE etl_coordination_store_op_duration_seconds histogram",
            r#"etl_coordination_splits_owned{coordination_job="backfill",coordination_instance="pod-1"} 3"#,
            r#"etl_coordination_live_workers{coordination_job="backfill",coordination_instance="pod-1"} 2"#,
            r#"etl_coordination_leader{coordination_job="backfill",coordination_instance="pod-1"} 1"#,
            r#"etl_coordination_acquisitions_total{coordination_job="backfill",coordination_instance="pod-1",reason="stolen"} 1"#,
            r#"etl_coordination_acquisitions_total{coordination_job="backfill",coordination_instance="pod-1",reason="create"} 0"#,
            r#"etl_coordination_revocations_total{coordination_job="backfill",coordination_instance="pod-1",reason="starved"} 1"#,
            r#"etl_coordination_splits_quarantined{coordination_job="backfill",coordination_instance="pod-1"} 1"#,
            r#"etl_coordination_writes_total{coordination_job="backfill",coordination_instance="pod-1",outcome="conflict"} 1"#,
            r#"etl_coordination_store_op_duration_seconds_bucket{coordination_job="backfill",coordination_instance="pod-1",op="cas",le="0.0005"} 1"#,
            r#"etl_coordination_job_state{coordination_job="backfill",coordination_instance="pod-1",state="stalled"} 1"#,
            r#"etl_coordination_job_state{coordination_job="backfill",coordination_instance="pod-1",state="running"} 0"#,
            r#"etl_coordination_plan_failures_total{coordination_job="backfill",coordination_instance="pod-1"} 1"#,
            r#"etl_coordination_splits{coordination_job="backfill",coordination_instance="pod-1",state="done"} 40"#,
            r#"etl_coordination_splits{coordination_job="backfill",coordination_instance="pod-1",state="undecodable"} 1"#,
            r#"etl_coordination_splits{coordination_job="backfill",coordination_instance="pod-1",state="unleased"} 3"#,
            r#"etl_coordination_records_undecodable{coordination_job="backfill",coordination_instance="pod-1",bucket="state"} 1"#,
            r#"etl_coordination_records_undecodable{coordination_job="backfill",coordination_instance="pod-1",bucket="lease"} 0"#,
            r#"etl_coordination_splits{coordination_job="backfill",coordination_instance="pod-1",state="missing"} 0"#,
            r#"etl_coordination_lanes_stalled{coordination_job="backfill",coordination_instance="pod-1"} 1"#,
            r#"etl_coordination_lane_stalls_total{coordination_job="backfill",coordination_instance="pod-1"} 1"#,
            r#"etl_coordination_records_skipped_total{coordination_job="backfill",coordination_instance="pod-1"} 1"#,
            r#"etl_coordination_breaker_open{coordination_job="backfill",coordination_instance="pod-1"} 1"#,
            r#"etl_coordination_breaker_trips_total{coordination_job="backfill",coordination_instance="pod-1"} 1"#,
            r#"etl_coordination_steals_total{coordination_job="backfill",coordination_instance="pod-1",outcome="handed_over"} 1"#,
            r#"etl_coordination_steals_total{coordination_job="backfill",coordination_instance="pod-1",outcome="forced"} 0"#,
            r#"etl_coordination_steal_requests_total{coordination_job="backfill",coordination_instance="pod-1",answer="honoured"} 1"#,
            r#"etl_coordination_steal_requests_total{coordination_job="backfill",coordination_instance="pod-1",answer="refused"} 0"#,
            r#"etl_coordination_work_planned{coordination_job="backfill",coordination_instance="pod-1"} 3000"#,
            r#"etl_coordination_work_done{coordination_job="backfill",coordination_instance="pod-1"} 1200"#,
            r#"etl_coordination_work_processed_total{coordination_job="backfill",coordination_instance="pod-1"} 800"#,
            r#"etl_coordination_records_written_total{coordination_job="backfill",coordination_instance="pod-1"} 40"#,
        ];
        for line in expect {
            assert!(text.contains(line), "missing {line:?} in:\n{text}");
        }
        // No label Prometheus sets itself on scrape (it would rename ours `exported_*`).
        for series in text.lines().filter(|l| !l.starts_with('#')) {
            let labels = series.split_once('{').and_then(|(_, r)| r.split_once('}')).map_or("", |(l, _)| l);
            for name in labels.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, _)| k) {
                assert!(
                    !["job", "instance"].contains(&name),
                    "{name} collides with a target label: {series}"
                );
            }
        }
        assert!(install_prometheus().is_err(), "a second install is refused with an error");
    }
}
