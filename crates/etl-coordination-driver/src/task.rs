//! The driver task: one tokio task owns the protocol core, turns messages (store answers,
//! watch events, the planner, lanes, control) into inputs, and executes the core's actions.
//! It never blocks on a store call: each request runs in its own task and reports back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etl_coordination_core::records::{self, keys};
use etl_coordination_core::{
    Action, Breaker, BreakerState, BreakerVerdict, Bucket, CommitOutcome, Config, Epoch, Event, Incarnation,
    Input, InstanceId, Outage, Outcome, Revision, SplitId, StopReason, StoreError, StoreReply, StoreRequest,
    Timestamp, Worker,
};
use etl_coordination_metrics::Metrics;
use etl_coordination_store::layers::{Observed, Timeout};
use etl_coordination_store::{Store, execute};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{debug, error, info, trace, warn};

use crate::config::{DEFAULT_OP_TIMEOUT, DriverConfig, OnLaneStall, OnStall};
use crate::lane::{Lane, LaneMsg, Lanes, Stop};
use crate::lane_table::{LaneEntry, LaneTable};
use crate::msg::Msg;
use crate::outcome::{DriverError, JobOutcome, JobState, describe};
use crate::planner::Planner;
use crate::report::{JobReport, StoreMetrics, log_event};
use crate::stores::JobStores;
use crate::watches::Watches;
use crate::work::Work;

/// How long a worker that ends spends retiring its report at most.
const RETIRE_WITHIN: Duration = Duration::from_secs(1);

/// Control messages from the [`DriverHandle`](crate::DriverHandle).
#[derive(Debug)]
pub(crate) enum Control {
    Drain,
    Kill,
    Freeze(Duration),
}

/// A bucket as the task uses it: each request bounded by the worker's budget and recorded in
/// its metrics.
type Layered<S> = Observed<Timeout<S>, StoreMetrics>;

pub(crate) struct Task<S, P> {
    worker: Worker,
    state: Arc<Layered<S>>,
    lease: Arc<Layered<S>>,
    planner: Arc<P>,
    tx: mpsc::UnboundedSender<Msg>,
    rx: mpsc::UnboundedReceiver<Msg>,
    control: mpsc::UnboundedReceiver<Control>,
    lane_tx: mpsc::UnboundedSender<LaneMsg>,
    lane_rx: mpsc::UnboundedReceiver<LaneMsg>,
    lanes: mpsc::UnboundedSender<Lane>,
    outcome: watch::Sender<Option<Result<JobOutcome, DriverError>>>,
    on_stall: OnStall,
    lane_stall_timeout: Option<Duration>,
    on_lane_stall: OnLaneStall,
    origin: Instant,
    watches: Watches,
    /// The lanes handed out and not ended.
    running: LaneTable,
    /// Metrics and the job state.
    report: JobReport,
    /// Inputs raised while executing actions, handled after them.
    deferred: Vec<Input>,
    waiters: BTreeMap<(SplitId, Epoch), oneshot::Sender<CommitOutcome>>,
    done: bool,
    /// The planner call in flight: a new call (after a timeout) aborts the one it replaces.
    planning: Option<tokio::task::AbortHandle>,
    /// Failures of distinct splits with one cause: the worker's, not the splits'.
    breaker: Breaker,
    /// A split whose committed progress this release cannot read: the worker drains and ends
    /// with [`DriverError::IncompatibleProgress`] (the first such split is reported).
    incompatible: Option<(SplitId, String)>,
    /// What the lanes did, reported in `report.{instance}` and the work metrics.
    work: Work,
    reporter: Reporter,
    /// The worker's outcome, published once its report is retired.
    result: Option<Result<JobOutcome, DriverError>>,
}

/// Writes the worker's [`WorkReport`](records::WorkReport) every heartbeat interval, with the
/// lease's TTL: a create, then compare-and-swaps on its revision (a read first when a report
/// of an earlier process of this id is still there). A failed write waits for the next round.
struct Reporter {
    instance: InstanceId,
    incarnation: Incarnation,
    ttl: Duration,
    every: Duration,
    next: Instant,
    /// The revision of our report, once written or read.
    rev: Option<Revision>,
    /// A create found a report there: read its revision next.
    taken: bool,
    in_flight: bool,
}

impl<S: Store, P: Planner> Task<S, P> {
    /// The task, the sender of its control messages and the lanes it hands out.
    pub(crate) fn new(
        cfg: Config,
        stores: JobStores<S>,
        planner: P,
        config: &DriverConfig,
        outcome: watch::Sender<Option<Result<JobOutcome, DriverError>>>,
        state: watch::Sender<JobState>,
    ) -> (Self, mpsc::UnboundedSender<Control>, Lanes) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (control_tx, control) = mpsc::unbounded_channel();
        let (lane_tx, lane_rx) = mpsc::unbounded_channel();
        let (lanes_tx, lanes_rx) = mpsc::unbounded_channel();
        let metrics = Metrics::new(stores.job.to_string(), cfg.instance_id.to_string());
        // One budget per worker: the configured one, else the store's own (never under the
        // default: a store that bounds each round trip may need several for one list or create).
        let op_timeout = config.op_timeout.unwrap_or_else(|| {
            stores.state.op_timeout().map_or(DEFAULT_OP_TIMEOUT, |b| b.max(DEFAULT_OP_TIMEOUT))
        });
        let reporter = Reporter {
            instance: cfg.instance_id.clone(),
            incarnation: cfg.incarnation,
            ttl: cfg.tuning.lease_duration,
            every: cfg.tuning.heartbeat_interval(),
            next: Instant::now() + cfg.tuning.heartbeat_interval(),
            rev: None,
            taken: false,
            in_flight: false,
        };
        let task = Task {
            worker: Worker::new(cfg),
            state: Arc::new(Observed::new(
                Timeout::new(stores.state, op_timeout),
                StoreMetrics(metrics.clone()),
            )),
            lease: Arc::new(Observed::new(
                Timeout::new(stores.lease, op_timeout),
                StoreMetrics(metrics.clone()),
            )),
            planner: Arc::new(planner),
            tx,
            rx,
            control,
            lane_tx,
            lane_rx,
            lanes: lanes_tx,
            outcome,
            on_stall: config.on_stall,
            lane_stall_timeout: config.lane_stall_timeout,
            on_lane_stall: config.on_lane_stall,
            origin: Instant::now(),
            watches: Watches::default(),
            running: LaneTable::default(),
            report: JobReport::new(metrics, state),
            incompatible: None,
            work: Work::default(),
            reporter,
            result: None,
            deferred: Vec::new(),
            waiters: BTreeMap::new(),
            done: false,
            planning: None,
            breaker: Breaker::new(config.breaker_threshold, config.breaker_window),
        };
        (task, control_tx, Lanes { rx: lanes_rx })
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_micros(u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX))
    }

    fn instant(&self, t: Timestamp) -> Instant {
        self.origin + t.since_origin()
    }

    /// `i` on the core's clock.
    fn stamp(&self, i: Instant) -> Timestamp {
        let micros = i.saturating_duration_since(self.origin).as_micros();
        Timestamp::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
    }

    pub(crate) async fn run(mut self) {
        self.handle(Input::Start);
        // Without handles nobody can drain any more, but the worker goes on to its outcome.
        let mut controlled = true;
        while !self.done {
            let deadline = self.worker.next_deadline().map(|t| self.instant(t));
            let stall_check = self.next_stall_check();
            let breaker_probe = self.breaker.probe_at().map(|t| self.instant(t));
            let input = tokio::select! {
                msg = self.control.recv(), if controlled => match msg {
                    Some(Control::Freeze(d)) => {
                        warn!(?d, "frozen");
                        // Block the whole loop, timers included, like a stopped process.
                        tokio::time::sleep(d).await;
                        continue;
                    }
                    Some(Control::Drain) => {
                        info!("draining: committing, releasing splits and leaving");
                        Input::Drain
                    }
                    Some(Control::Kill) => {
                        warn!("killed: leaving without releasing anything");
                        self.finish(Err(DriverError::Killed));
                        continue;
                    }
                    None => {
                        controlled = false;
                        continue;
                    }
                },
                msg = self.rx.recv() => match msg.and_then(|m| self.on_msg(m)) {
                    Some(input) => input,
                    None => continue,
                },
                msg = self.lane_rx.recv() => match msg.and_then(|m| self.on_lane(m)) {
                    Some(input) => input,
                    None => continue,
                },
                () = sleep_until(deadline) => Input::Tick,
                () = sleep_until(stall_check) => {
                    self.check_stalls();
                    continue;
                }
                () = sleep_until(breaker_probe) => self.breaker_probe(),
                () = tokio::time::sleep_until(self.reporter.next) => {
                    self.write_report();
                    continue;
                }
            };
            self.handle(input);
        }
        self.watches.abort_all();
        self.retire_report().await;
        if let Some(result) = self.result.take() {
            let _ = self.outcome.send(Some(result));
        }
        if self.outcome.borrow().is_none() {
            let _ = self.outcome.send(Some(Err(DriverError::Gone)));
        }
    }

    fn on_msg(&mut self, msg: Msg) -> Option<Input> {
        Some(match msg {
            Msg::StoreDone { op, result } => Input::StoreResult { op, result },
            Msg::Watch { watch, generation, event } => {
                self.watches.event(watch, generation, &event)?;
                Input::Watch { watch, event }
            }
            Msg::WatchFailed { watch, generation, error } => {
                self.watches.failed(watch, generation, &error)?;
                Input::WatchFailed { watch }
            }
            Msg::PlanReady { request, result } => Input::PlanReady { request, result },
            Msg::Reported(result) => {
                self.reported(result);
                return None;
            }
        })
    }

    /// Writes the worker's report (one write in flight at a time).
    fn write_report(&mut self) {
        let r = &mut self.reporter;
        r.next = Instant::now() + r.every;
        if r.in_flight {
            return;
        }
        let report = self.work.report(Instant::now(), r.incarnation);
        let key = keys::report(&r.instance);
        let value = records::encode(&report);
        let request = match (r.rev, r.taken) {
            (Some(expected), _) => StoreRequest::CompareAndSwap { key, expected, value, ttl: Some(r.ttl) },
            (None, true) => StoreRequest::Get { key },
            (None, false) => StoreRequest::Create { key, value, ttl: Some(r.ttl) },
        };
        r.in_flight = true;
        let store = self.lease.clone();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let result = execute(&*store, request).await;
            let _ = tx.send(Msg::Reported(result));
        });
    }

    /// A report write's (or read's) answer: the revision to swap next time.
    fn reported(&mut self, result: etl_coordination_core::StoreResult) {
        let r = &mut self.reporter;
        r.in_flight = false;
        match result {
            Ok(StoreReply::Written(rev)) => (r.rev, r.taken) = (Some(rev), false),
            Ok(StoreReply::Value(Some(entry))) => (r.rev, r.taken) = (Some(entry.revision), false),
            Ok(_) => (r.rev, r.taken) = (None, false),
            // Nothing was written: the same request next round.
            Err(e @ StoreError::Unavailable(_)) => {
                trace!(error = %e, "the worker's report was not written; next round")
            }
            // A report is there (an earlier process's, or ours from a write whose answer was
            // lost): read its revision next round.
            Err(e) => {
                trace!(error = %e, "writing the worker's report failed; reading it next round");
                (r.rev, r.taken) = (None, true);
            }
        }
    }

    /// A lane's message as the core's input; a commit's answer is routed back by
    /// `Action::CommitDone` (a lane has at most one commit in flight, see `Lane::commit`).
    fn on_lane(&mut self, msg: LaneMsg) -> Option<Input> {
        Some(match msg {
            LaneMsg::Commit { split, epoch, progress, finish, flushed_at, read_at, reply } => {
                self.wait_for_commit(&split, epoch, reply);
                self.breaker_answered(&split, flushed_at, read_at);
                if !finish {
                    return Some(Input::Commit { split, epoch, progress });
                }
                if let Some(l) = self.running.get(&split, epoch) {
                    l.finishing = true;
                }
                Input::Finish { split, epoch, progress }
            }
            LaneMsg::Fail { split, epoch, error, unprocessable, outage } => {
                self.lane_ended(&split, epoch);
                let verdict = if unprocessable {
                    BreakerVerdict::Charge { tripped: false }
                } else {
                    let outage = outage.map(|(side, since)| Outage { side, since: self.stamp(since) });
                    self.breaker.on_failure(self.now(), &split, &error, outage)
                };
                match verdict {
                    BreakerVerdict::Charge { tripped } => {
                        if tripped {
                            self.breaker_tripped(&error);
                        }
                        warn!(%split, %epoch, %error, unprocessable, "source reported the split failed");
                        Input::Fail { split, epoch, error, unprocessable }
                    }
                    BreakerVerdict::Release { tripped } => {
                        if tripped {
                            self.breaker_tripped(&error);
                        } else {
                            info!(%split, %epoch, %error, "failed like the others while the breaker is open: released without charge");
                        }
                        Input::Release { split, epoch }
                    }
                }
            }
            LaneMsg::Stopped { split, epoch } => {
                self.lane_ended(&split, epoch);
                Input::LaneStopped { split, epoch }
            }
            LaneMsg::Incompatible { split, epoch, error } => {
                // A lane that already lost its split: another tenancy decides.
                self.running.get(&split, epoch)?;
                error!(
                    %split,
                    %error,
                    "this release cannot read the split's committed progress (written by another release \
                     of the source): draining, nothing charged to the split; roll back to the release that wrote it"
                );
                if self.incompatible.is_none() {
                    self.incompatible = Some((split, error));
                }
                Input::Drain
            }
            LaneMsg::GiveUp { split, epoch, error } => {
                warn!(%split, %epoch, %error, "the lane gave the split up: quarantining it");
                self.lane_ended(&split, epoch);
                Input::Quarantine { split, epoch, error }
            }
            LaneMsg::Skipped => {
                self.report.metrics.record_skipped();
                return None;
            }
            LaneMsg::Worked { split, epoch, records, position } => {
                let (weight, records) = self.work.worked(&split, epoch, records, position);
                self.report.metrics.worked(weight, records);
                return None;
            }
        })
    }

    /// A lane flushed its outputs and commits: they answer again (a probing breaker closes);
    /// `flushed_at`, `read_at`: its last flush and read (`None`: an embedder's lane; its commit
    /// is taken as the flush).
    fn breaker_answered(&mut self, split: &SplitId, flushed_at: Option<Instant>, read_at: Option<Instant>) {
        let flushed_at = flushed_at.map_or_else(|| self.now(), |i| self.stamp(i));
        let read_at = read_at.map(|i| self.stamp(i));
        if self.breaker.on_commit(split, flushed_at, read_at) {
            info!(%split, "breaker closed: a lane flushed its sink and commits; intake resumes");
            self.report.metrics.breaker_open(false);
            self.deferred.push(Input::Intake { limit: None });
        }
    }

    /// The breaker opened (or a probe failed): pause intake, say so.
    fn breaker_tripped(&mut self, error: &str) {
        let wait = match self.breaker.state() {
            BreakerState::Open { wait, .. } => *wait,
            _ => Duration::ZERO,
        };
        warn!(
            %error,
            cause = %etl_coordination_core::failure_cause(error),
            probe_in = ?wait,
            "breaker open: splits on this worker fail with one cause (several of them, or one that no other lane got through since its outage began), so the cause is the worker's or its sink's as far as it can tell, not theirs; their failures are not charged, intake is paused, and one split will be tried again after the wait"
        );
        self.report.metrics.breaker_open(true);
        self.report.metrics.breaker_trip();
        self.deferred.push(Input::Intake { limit: Some(0) });
    }

    /// An open breaker's wait is over: take one split more than the worker holds, to probe.
    fn breaker_probe(&mut self) -> Input {
        self.breaker.probe();
        let held = u32::try_from(self.worker.held().count()).unwrap_or(u32::MAX);
        info!(held, "breaker probing: taking one more split to see whether the sink answers");
        Input::Intake { limit: Some(held.saturating_add(1)) }
    }

    /// The lane of `split` at `epoch` ended: forget it (and its stall).
    fn lane_ended(&mut self, split: &SplitId, epoch: Epoch) {
        self.work.ended(split, epoch);
        if self.running.end(split, epoch).is_some_and(|l| l.stalled) {
            self.report.metrics.lanes_stalled(self.running.stalled());
        }
    }

    /// When the next lane becomes stalled, if it makes no progress meanwhile.
    fn next_stall_check(&self) -> Option<Instant> {
        self.running.next_stall_check(self.lane_stall_timeout?)
    }

    /// Lanes with no committed progress for the lane stall timeout while holding their lease: a
    /// warning, the gauge and the counter, and with `OnLaneStall::Release` the lane is stopped
    /// and its tenancy ended as failed (a peer retries from the committed progress).
    fn check_stalls(&mut self) {
        let Some(timeout) = self.lane_stall_timeout else { return };
        let now = Instant::now();
        let due = self.running.stalled_by(timeout, now);
        for (split, epoch) in due {
            // Handling one release runs the core, which may stop, restart or end other lanes
            // (or the worker): each lane is looked up again.
            if self.done || !self.running.get(&split, epoch).is_some_and(|l| l.watched()) {
                continue;
            }
            self.report.metrics.lane_stall();
            match self.on_lane_stall {
                OnLaneStall::Warn => {
                    warn!(%split, %epoch, "lane stalled: it holds the lease but committed no progress for {timeout:?}; the source may be stuck");
                    self.running.get(&split, epoch).expect("looked up").stalled = true;
                }
                OnLaneStall::Release => {
                    warn!(%split, %epoch, "lane stalled: no progress committed for {timeout:?}; stopping it and releasing the split as failed");
                    self.work.ended(&split, epoch);
                    let l = self.running.end(&split, epoch).expect("looked up");
                    let _ = l.stop.send(Some(Stop { reason: StopReason::Fenced, deadline: None }));
                    let error = format!(
                        "lane stalled: no progress committed for {timeout:?}; released by the lane stall check"
                    );
                    self.handle(Input::Fail { split, epoch, error, unprocessable: false });
                }
            }
        }
        if !self.done {
            self.report.metrics.lanes_stalled(self.running.stalled());
        }
    }

    fn wait_for_commit(&mut self, split: &SplitId, epoch: Epoch, reply: oneshot::Sender<CommitOutcome>) {
        let earlier = self.waiters.insert((split.clone(), epoch), reply);
        debug_assert!(earlier.is_none(), "a lane sent a second commit while one was in flight");
    }

    fn handle(&mut self, input: Input) {
        let mut next = Some(input);
        while let Some(input) = next {
            let now = self.now();
            trace!(?now, ?input, "core input");
            let actions = self.worker.handle(now, input);
            for action in actions {
                trace!(?action, "core action");
                self.act(action);
            }
            next = if self.deferred.is_empty() { None } else { Some(self.deferred.remove(0)) };
        }
    }

    fn store(&self, bucket: Bucket) -> Arc<Layered<S>> {
        match bucket {
            Bucket::State => self.state.clone(),
            Bucket::Lease => self.lease.clone(),
        }
    }

    /// Carries out one action of the core.
    fn act(&mut self, action: Action) {
        match action {
            Action::Store { op, bucket, request } => {
                let store = self.store(bucket);
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    let result = execute(&*store, request).await;
                    let _ = tx.send(Msg::StoreDone { op, result });
                });
            }
            Action::Watch { watch } => {
                let store = self.store(watch.bucket());
                self.watches.open(watch, store, self.tx.clone());
            }
            Action::Plan { request } => self.run_planner(request),
            Action::StartLane { split, epoch, descriptor, weight, progress, reason } => {
                self.work.started(split.clone(), epoch, weight, progress.is_none());
                self.start_lane(Lane::new(
                    split,
                    epoch,
                    descriptor,
                    weight,
                    progress,
                    reason,
                    self.lane_tx.clone(),
                ))
            }
            Action::StopLane { split, epoch, reason, deadline } => {
                self.stop_lane(split, epoch, reason, deadline)
            }
            Action::CommitDone { split, epoch, outcome } => self.commit_done(split, epoch, outcome),
            Action::Event(Event::JobEnded { outcome }) => self.job_ended(outcome),
            Action::Event(Event::JobReopened) => {
                info!("work came back (a split was requeued or reset): the job runs again");
                self.report.ended = None;
                self.report.publish_state();
            }
            Action::Event(e) => {
                self.report.record(&e);
                log_event(&e);
            }
            Action::Finished(outcome) => {
                let result = self.outcome_of(outcome);
                self.finish(result);
            }
            Action::Fatal(e) => {
                error!(error = %e, "coordination stopped on a fatal condition");
                self.finish(Err(DriverError::Fatal(e)));
            }
        }
    }

    /// Runs the planner in a task of its own, so that a panic in it becomes a planner failure
    /// (retried with backoff) instead of a silent hang until `plan_timeout`; a call that timed
    /// out is aborted when the next one starts.
    fn run_planner(&mut self, request: u64) {
        let planner = self.planner.clone();
        let tx = self.tx.clone();
        let published: Vec<SplitId> = self.worker.published().cloned().collect();
        let call = tokio::spawn(async move { planner.replan(&published).await });
        if let Some(previous) = self.planning.replace(call.abort_handle()) {
            previous.abort();
        }
        tokio::spawn(async move {
            let result = match call.await {
                Ok(result) => result.map_err(|e| e.0),
                Err(e) if e.is_panic() => {
                    Err(format!("the planner panicked: {}", panic_text(e.into_panic())))
                }
                Err(e) => Err(format!("the planner task was cancelled: {e}")),
            };
            let _ = tx.send(Msg::PlanReady { request, result });
        });
    }

    /// Hands a lane to the source, and enters it in the lane table.
    fn start_lane(&mut self, (lane, stop): (Lane, watch::Sender<Option<Stop>>)) {
        let entry = LaneEntry::new(lane.epoch, stop);
        if self.running.insert(lane.split.clone(), entry).is_some_and(|old| old.stalled) {
            self.report.metrics.lanes_stalled(self.running.stalled());
        }
        let _ = self.lanes.send(lane);
    }

    /// Tells a lane to stop; it is forgotten at once unless it drains (it ends on its own).
    fn stop_lane(&mut self, split: SplitId, epoch: Epoch, reason: StopReason, deadline: Option<Timestamp>) {
        let deadline = deadline.map(|t| self.instant(t));
        if let Some(l) = self.running.get(&split, epoch) {
            let _ = l.stop.send(Some(Stop { reason, deadline }));
            l.draining = reason == StopReason::Draining;
        }
        if reason != StopReason::Draining {
            self.lane_ended(&split, epoch);
        }
    }

    /// A commit's outcome: the lane table learns of the progress (or the end), and the lane
    /// waiting for it is answered.
    fn commit_done(&mut self, split: SplitId, epoch: Epoch, outcome: CommitOutcome) {
        if let Some(l) = self.running.get(&split, epoch) {
            match outcome {
                CommitOutcome::Ok if l.finishing => {
                    let rest = self.work.finished(&split, epoch);
                    self.report.metrics.worked(rest, 0);
                    self.lane_ended(&split, epoch);
                }
                CommitOutcome::Ok => {
                    l.progress_at = Instant::now();
                    if std::mem::take(&mut l.stalled) {
                        info!(%split, %epoch, "stalled lane committed progress again");
                        self.report.metrics.lanes_stalled(self.running.stalled());
                    }
                }
                CommitOutcome::Retryable => l.finishing = false,
                CommitOutcome::Lost => self.lane_ended(&split, epoch),
            }
        }
        if let Some(reply) = self.waiters.remove(&(split, epoch)) {
            let _ = reply.send(outcome);
        }
    }

    /// What the worker's end means to its embedder (a stall is an error unless `OnStall::Warn`).
    fn outcome_of(&mut self, outcome: Outcome) -> Result<JobOutcome, DriverError> {
        if let Some((split, error)) = self.incompatible.take() {
            return Err(DriverError::IncompatibleProgress { split, error });
        }
        match outcome {
            Outcome::Complete => {
                if self.report.ended.is_none() {
                    info!("job complete: every split is done");
                }
                self.report.ended = Some(JobState::Complete);
                Ok(JobOutcome::Complete)
            }
            Outcome::Stalled { quarantined } => {
                if self.report.ended.is_none() {
                    warn!(splits = %describe(&quarantined), "job stalled on quarantined splits");
                }
                self.report.ended = Some(JobState::Stalled { quarantined: quarantined.clone() });
                match self.on_stall {
                    OnStall::Fatal => Err(DriverError::Stalled { quarantined }),
                    OnStall::Warn => Ok(JobOutcome::Stalled { quarantined }),
                }
            }
            Outcome::Drained => {
                info!("drained");
                Ok(JobOutcome::Drained)
            }
        }
    }

    /// The job ended while this worker stays after the end (`stay_after_end`): report it; a
    /// stall that is fatal drains the worker after all. The state (and its gauge) is published
    /// before the line is logged, so whoever reads the line finds the metric agreeing with it.
    fn job_ended(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::Complete => {
                self.report.ended = Some(JobState::Complete);
                self.report.publish_state();
                info!(
                    "job complete: every split is done; staying after the end for requeued work until drained"
                );
            }
            Outcome::Stalled { quarantined } => {
                let fatal = self.on_stall == OnStall::Fatal;
                if fatal {
                    // The core leaves with the stall as its outcome, which is fatal then.
                    self.deferred.push(Input::Drain);
                }
                let splits = describe(&quarantined);
                self.report.ended = Some(JobState::Stalled { quarantined });
                self.report.publish_state();
                if fatal {
                    warn!(splits = %splits, "job stalled on quarantined splits");
                } else {
                    warn!(
                        splits = %splits,
                        "job stalled on quarantined splits; staying after the end for requeued work until drained"
                    );
                }
            }
            Outcome::Drained => self.report.publish_state(),
        }
    }

    fn finish(&mut self, result: Result<JobOutcome, DriverError>) {
        self.report.finished(&result);
        self.done = true;
        for (_, l) in self.running.take_all() {
            let _ = l.stop.send(Some(Stop { reason: StopReason::Fenced, deadline: None }));
        }
        for (_, reply) in std::mem::take(&mut self.waiters) {
            let _ = reply.send(CommitOutcome::Lost);
        }
        self.result = Some(result);
    }

    /// A worker that ends deletes its report (a crash's, or a kill's, expires with its TTL):
    /// after the answer of a write in flight, if one is. All of it within a second: the
    /// report's TTL removes it anyway, and the worker's outcome waits for this.
    async fn retire_report(&mut self) {
        if matches!(self.result, Some(Err(DriverError::Killed))) {
            return;
        }
        let deadline = Instant::now() + self.reporter.every.min(RETIRE_WITHIN);
        while self.reporter.in_flight {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(Msg::Reported(result))) => self.reported(result),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        if let Some(expected) = self.reporter.rev {
            let key = keys::report(&self.reporter.instance);
            match tokio::time::timeout_at(
                deadline,
                execute(&*self.lease, StoreRequest::Delete { key, expected }),
            )
            .await
            {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    debug!(error = %e, "deleting the worker's report failed: it expires with its TTL")
                }
                Err(_) => debug!("no answer deleting the worker's report: it expires with its TTL"),
            }
        }
    }
}

/// The message of a caught panic (a `&str` or `String` payload, as `panic!` makes).
fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
