//! The driver task: one tokio task owns the protocol core, turns messages (store answers,
//! watch events, the planner, lanes, control) into inputs, and executes the core's actions.
//! It never blocks on a store call: each request runs in its own task and reports back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etl_coordination_core::{
    Action, Bucket, CommitOutcome, Config, Epoch, Event, Input, OpId, Outcome, Plan, SplitId, StopReason,
    StoreError, StoreResult, Timestamp, WatchEvent, WatchId, Worker,
};
use etl_coordination_metrics::{Metrics, WriteOutcome};
use etl_coordination_store::{Store, execute};
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, trace, warn};

use crate::config::{DEFAULT_OP_TIMEOUT, DriverConfig, OnLaneStall, OnStall};
use crate::lane::{Lane, LaneMsg, Lanes, Stop};
use crate::outcome::{DriverError, JobOutcome, JobState, describe};
use crate::planner::Planner;
use crate::stores::JobStores;

/// Control messages from the [`DriverHandle`](crate::DriverHandle).
#[derive(Debug)]
pub(crate) enum Control {
    Drain,
    Kill,
    Freeze(Duration),
}

/// Reports of the tasks the driver task spawned.
#[derive(Debug)]
enum Msg {
    StoreDone { op: OpId, result: StoreResult },
    Watch { watch: WatchId, generation: u64, event: WatchEvent },
    WatchFailed { watch: WatchId, generation: u64, error: String },
    PlanReady { request: u64, result: Result<Plan, String> },
}

struct WatchTask {
    generation: u64,
    failures: u32,
    handle: Option<JoinHandle<()>>,
}

/// A lane the source runs: how to stop it, and when it last made progress.
struct LaneEntry {
    epoch: Epoch,
    stop: watch::Sender<Option<Stop>>,
    /// The lane's start or its last successful commit.
    progress_at: Instant,
    /// Reported stalled (no progress for the lane stall timeout), until its next commit.
    stalled: bool,
    /// Told to drain: it commits and stops on its own deadline; no stall check.
    draining: bool,
    /// Its finish (terminal commit) is in flight.
    finishing: bool,
}

impl LaneEntry {
    /// Whether the stall check watches it: not reported yet, not draining, not finishing.
    fn watched(&self) -> bool {
        !self.stalled && !self.draining && !self.finishing
    }
}

pub(crate) struct Task<S, P> {
    worker: Worker,
    state: Arc<S>,
    lease: Arc<S>,
    planner: Arc<P>,
    tx: mpsc::UnboundedSender<Msg>,
    rx: mpsc::UnboundedReceiver<Msg>,
    control: mpsc::UnboundedReceiver<Control>,
    lane_tx: mpsc::UnboundedSender<LaneMsg>,
    lane_rx: mpsc::UnboundedReceiver<LaneMsg>,
    lanes: mpsc::UnboundedSender<Lane>,
    outcome: watch::Sender<Option<Result<JobOutcome, DriverError>>>,
    job_state: watch::Sender<JobState>,
    on_stall: OnStall,
    op_timeout: Duration,
    lane_stall_timeout: Option<Duration>,
    on_lane_stall: OnLaneStall,
    origin: Instant,
    watches: BTreeMap<WatchId, WatchTask>,
    /// The lanes handed out and not ended, by split.
    running: BTreeMap<SplitId, LaneEntry>,
    /// How the job ended, while the worker stays after the end (`stay_after_end`).
    ended: Option<JobState>,
    /// State-bucket keys the core reports it cannot decode, and plan splits without a record:
    /// either keeps the job from completing (`JobState::Blocked`).
    blocking: (u32, u32),
    /// The `job_state` label last recorded.
    state_label: &'static str,
    /// Inputs raised while executing actions, handled after them.
    deferred: Vec<Input>,
    waiters: BTreeMap<(SplitId, Epoch), oneshot::Sender<CommitOutcome>>,
    done: bool,
    metrics: Metrics,
    /// The planner call in flight: a new call (after a timeout) aborts the one it replaces.
    planning: Option<tokio::task::AbortHandle>,
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
        let task = Task {
            worker: Worker::new(cfg),
            state: Arc::new(stores.state),
            lease: Arc::new(stores.lease),
            planner: Arc::new(planner),
            tx,
            rx,
            control,
            lane_tx,
            lane_rx,
            lanes: lanes_tx,
            outcome,
            job_state: state,
            on_stall: config.on_stall,
            op_timeout,
            lane_stall_timeout: config.lane_stall_timeout,
            on_lane_stall: config.on_lane_stall,
            origin: Instant::now(),
            watches: BTreeMap::new(),
            running: BTreeMap::new(),
            ended: None,
            blocking: (0, 0),
            state_label: "running",
            deferred: Vec::new(),
            waiters: BTreeMap::new(),
            done: false,
            metrics,
            planning: None,
        };
        (task, control_tx, Lanes { rx: lanes_rx })
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_micros(u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX))
    }

    fn instant(&self, t: Timestamp) -> Instant {
        self.origin + t.since_origin()
    }

    pub(crate) async fn run(mut self) {
        self.handle(Input::Start);
        // Without handles nobody can drain any more, but the worker goes on to its outcome.
        let mut controlled = true;
        while !self.done {
            let deadline = self.worker.next_deadline().map(|t| self.instant(t));
            let stall_check = self.next_stall_check();
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
                msg = self.lane_rx.recv() => match msg {
                    Some(m) => self.on_lane(m),
                    None => continue,
                },
                () = sleep_until(deadline) => Input::Tick,
                () = sleep_until(stall_check) => {
                    self.check_stalls();
                    continue;
                }
            };
            self.handle(input);
        }
        for w in self.watches.values_mut() {
            if let Some(h) = w.handle.take() {
                h.abort();
            }
        }
        if self.outcome.borrow().is_none() {
            let _ = self.outcome.send(Some(Err(DriverError::Gone)));
        }
    }

    fn on_msg(&mut self, msg: Msg) -> Option<Input> {
        Some(match msg {
            Msg::StoreDone { op, result } => Input::StoreResult { op, result },
            Msg::Watch { watch, generation, event } => {
                let w = self.watches.get_mut(&watch)?;
                if w.generation != generation {
                    return None;
                }
                if event == WatchEvent::SnapshotComplete {
                    w.failures = 0;
                }
                Input::Watch { watch, event }
            }
            Msg::WatchFailed { watch, generation, error } => {
                let w = self.watches.get_mut(&watch)?;
                if w.generation != generation {
                    return None;
                }
                w.failures += 1;
                warn!(?watch, %error, failures = w.failures, "watch failed; reopening and resyncing");
                Input::WatchFailed { watch }
            }
            Msg::PlanReady { request, result } => Input::PlanReady { request, result },
        })
    }

    /// A lane's message as the core's input; a commit's answer is routed back by
    /// `Action::CommitDone` (a lane has at most one commit in flight, see `Lane::commit`).
    fn on_lane(&mut self, msg: LaneMsg) -> Input {
        match msg {
            LaneMsg::Commit { split, epoch, progress, reply } => {
                self.wait_for_commit(&split, epoch, reply);
                Input::Commit { split, epoch, progress }
            }
            LaneMsg::Finish { split, epoch, progress, reply } => {
                self.wait_for_commit(&split, epoch, reply);
                if let Some(l) = self.lane(&split, epoch) {
                    l.finishing = true;
                }
                Input::Finish { split, epoch, progress }
            }
            LaneMsg::Fail { split, epoch, error, unprocessable } => {
                warn!(%split, %epoch, %error, unprocessable, "source reported the split failed");
                self.lane_ended(&split, epoch);
                Input::Fail { split, epoch, error, unprocessable }
            }
            LaneMsg::Stopped { split, epoch } => {
                self.lane_ended(&split, epoch);
                Input::LaneStopped { split, epoch }
            }
        }
    }

    /// The running lane of `split` if it is at `epoch`.
    fn lane(&mut self, split: &SplitId, epoch: Epoch) -> Option<&mut LaneEntry> {
        self.running.get_mut(split).filter(|l| l.epoch == epoch)
    }

    /// The lane of `split` at `epoch` ended: forget it (and its stall).
    fn lane_ended(&mut self, split: &SplitId, epoch: Epoch) {
        if self.lane(split, epoch).is_some() {
            let l = self.running.remove(split).expect("running");
            if l.stalled {
                self.metrics.lanes_stalled(self.stalled_lanes());
            }
        }
    }

    fn stalled_lanes(&self) -> u32 {
        self.running.values().filter(|l| l.stalled).count() as u32
    }

    /// When the next lane becomes stalled, if it makes no progress meanwhile.
    fn next_stall_check(&self) -> Option<Instant> {
        let timeout = self.lane_stall_timeout?;
        self.running.values().filter(|l| l.watched()).map(|l| l.progress_at + timeout).min()
    }

    /// Lanes with no committed progress for the lane stall timeout while holding their lease: a
    /// warning, the gauge and the counter, and with `OnLaneStall::Release` the lane is stopped
    /// and its tenancy ended as failed (a peer retries from the committed progress).
    fn check_stalls(&mut self) {
        let Some(timeout) = self.lane_stall_timeout else { return };
        let now = Instant::now();
        let due: Vec<(SplitId, Epoch)> = self
            .running
            .iter()
            .filter(|(_, l)| l.watched() && l.progress_at + timeout <= now)
            .map(|(id, l)| (id.clone(), l.epoch))
            .collect();
        for (split, epoch) in due {
            // Handling one release runs the core, which may stop, restart or end other lanes
            // (or the worker): each lane is looked up again.
            if self.done || !self.lane(&split, epoch).is_some_and(|l| l.watched()) {
                continue;
            }
            self.metrics.lane_stall();
            match self.on_lane_stall {
                OnLaneStall::Warn => {
                    warn!(%split, %epoch, "lane stalled: it holds the lease but committed no progress for {timeout:?}; the source may be stuck");
                    self.lane(&split, epoch).expect("looked up").stalled = true;
                }
                OnLaneStall::Release => {
                    warn!(%split, %epoch, "lane stalled: no progress committed for {timeout:?}; stopping it and releasing the split as failed");
                    let l = self.running.remove(&split).expect("looked up");
                    let _ = l.stop.send(Some(Stop { reason: StopReason::Fenced, deadline: None }));
                    let error = format!(
                        "lane stalled: no progress committed for {timeout:?}; released by the lane stall check"
                    );
                    self.handle(Input::Fail { split, epoch, error, unprocessable: false });
                }
            }
        }
        if !self.done {
            self.metrics.lanes_stalled(self.stalled_lanes());
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

    fn store(&self, bucket: Bucket) -> Arc<S> {
        match bucket {
            Bucket::State => self.state.clone(),
            Bucket::Lease => self.lease.clone(),
        }
    }

    fn act(&mut self, action: Action) {
        match action {
            Action::Store { op, bucket, request } => {
                let store = self.store(bucket);
                let tx = self.tx.clone();
                let timeout = self.op_timeout;
                let write = request.is_write();
                let name = request.op_name();
                let metrics = self.metrics.clone();
                tokio::spawn(async move {
                    let started = Instant::now();
                    let result = match tokio::time::timeout(timeout, execute(&*store, request)).await {
                        Ok(r) => r,
                        Err(_) if write => {
                            Err(StoreError::Indeterminate(format!("no answer within {timeout:?}")))
                        }
                        Err(_) => Err(StoreError::Unavailable(format!("no answer within {timeout:?}"))),
                    };
                    metrics.store_op(name, started.elapsed());
                    if write {
                        metrics.write(match &result {
                            Ok(_) => WriteOutcome::Ok,
                            Err(StoreError::AlreadyExists(_) | StoreError::RevisionMismatch(_)) => {
                                WriteOutcome::Conflict
                            }
                            Err(_) => WriteOutcome::Error,
                        });
                    }
                    let _ = tx.send(Msg::StoreDone { op, result });
                });
            }
            Action::Watch { watch } => self.open_watch(watch),
            Action::Plan { request } => {
                let planner = self.planner.clone();
                let tx = self.tx.clone();
                // The planner runs in a task of its own so that a panic in it becomes a planner
                // failure (retried with backoff) instead of a silent hang until `plan_timeout`;
                // a call that timed out is aborted when the next one starts.
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
            Action::StartLane { split, epoch, descriptor, weight, progress, reason } => {
                let (stop_tx, stop_rx) = watch::channel(None);
                let entry = LaneEntry {
                    epoch,
                    stop: stop_tx,
                    progress_at: Instant::now(),
                    stalled: false,
                    draining: false,
                    finishing: false,
                };
                if self.running.insert(split.clone(), entry).is_some_and(|old| old.stalled) {
                    self.metrics.lanes_stalled(self.stalled_lanes());
                }
                let lane = Lane {
                    split,
                    epoch,
                    descriptor,
                    weight,
                    progress,
                    reason,
                    tx: self.lane_tx.clone(),
                    stop: stop_rx,
                    ended: false,
                    in_flight: None,
                };
                let _ = self.lanes.send(lane);
            }
            Action::StopLane { split, epoch, reason, deadline } => {
                let deadline = deadline.map(|t| self.instant(t));
                if let Some(l) = self.lane(&split, epoch) {
                    let _ = l.stop.send(Some(Stop { reason, deadline }));
                    l.draining = reason == StopReason::Draining;
                }
                if reason != StopReason::Draining {
                    self.lane_ended(&split, epoch);
                }
            }
            Action::CommitDone { split, epoch, outcome } => {
                if let Some(l) = self.lane(&split, epoch) {
                    match outcome {
                        CommitOutcome::Ok if l.finishing => self.lane_ended(&split, epoch),
                        CommitOutcome::Ok => {
                            l.progress_at = Instant::now();
                            if std::mem::take(&mut l.stalled) {
                                info!(%split, %epoch, "stalled lane committed progress again");
                                self.metrics.lanes_stalled(self.stalled_lanes());
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
            Action::Event(Event::JobEnded { outcome }) => self.job_ended(outcome),
            Action::Event(Event::JobReopened) => {
                info!("work came back (a split was requeued or reset): the job runs again");
                self.ended = None;
                self.publish_state();
            }
            Action::Event(e) => {
                self.record(&e);
                log_event(&e);
            }
            Action::Finished(outcome) => {
                let result = match outcome {
                    Outcome::Complete => {
                        if self.ended.is_none() {
                            info!("job complete: every split is done");
                        }
                        self.ended = Some(JobState::Complete);
                        Ok(JobOutcome::Complete)
                    }
                    Outcome::Stalled { quarantined } => {
                        if self.ended.is_none() {
                            warn!(splits = %describe(&quarantined), "job stalled on quarantined splits");
                        }
                        self.ended = Some(JobState::Stalled { quarantined: quarantined.clone() });
                        match self.on_stall {
                            OnStall::Fatal => Err(DriverError::Stalled { quarantined }),
                            OnStall::Warn => Ok(JobOutcome::Stalled { quarantined }),
                        }
                    }
                    Outcome::Drained => {
                        info!("drained");
                        Ok(JobOutcome::Drained)
                    }
                };
                self.finish(result);
            }
            Action::Fatal(e) => {
                error!(error = %e, "coordination stopped on a fatal condition");
                self.finish(Err(DriverError::Fatal(e)));
            }
        }
    }

    fn record(&mut self, e: &Event) {
        match e {
            Event::Acquired { reason, .. } => self.metrics.acquisition(reason.label()),
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

    /// The job ended while this worker stays after the end (`stay_after_end`): report it; a
    /// stall that is fatal drains the worker after all. The state (and its gauge) is published
    /// before the line is logged, so whoever reads the line finds the metric agreeing with it.
    fn job_ended(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::Complete => {
                self.ended = Some(JobState::Complete);
                self.publish_state();
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
                self.ended = Some(JobState::Stalled { quarantined });
                self.publish_state();
                if fatal {
                    warn!(splits = %splits, "job stalled on quarantined splits");
                } else {
                    warn!(
                        splits = %splits,
                        "job stalled on quarantined splits; staying after the end for requeued work until drained"
                    );
                }
            }
            Outcome::Drained => self.publish_state(),
        }
    }

    /// Publishes the job state (and its `job_state` gauge) from what is known: the end while
    /// staying after it, else running, or blocked while split records cannot be decoded or are
    /// missing.
    fn publish_state(&mut self) {
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

    fn finish(&mut self, result: Result<JobOutcome, DriverError>) {
        self.metrics.splits_owned(0);
        self.metrics.leader(false);
        self.metrics.lanes_stalled(0);
        self.publish_state();
        self.metrics.job_state(match &result {
            Ok(JobOutcome::Complete) => "complete",
            Ok(JobOutcome::Stalled { .. }) | Err(DriverError::Stalled { .. }) => "stalled",
            Ok(JobOutcome::Drained) => "drained",
            Err(_) => "failed",
        });
        self.done = true;
        for (_, l) in std::mem::take(&mut self.running) {
            let _ = l.stop.send(Some(Stop { reason: StopReason::Fenced, deadline: None }));
        }
        for (_, reply) in std::mem::take(&mut self.waiters) {
            let _ = reply.send(CommitOutcome::Lost);
        }
        let _ = self.outcome.send(Some(result));
    }

    fn open_watch(&mut self, watch: WatchId) {
        let store = self.store(watch.bucket());
        let entry =
            self.watches.entry(watch).or_insert(WatchTask { generation: 0, failures: 0, handle: None });
        entry.generation += 1;
        if let Some(h) = entry.handle.take() {
            h.abort();
        }
        let generation = entry.generation;
        // Back off after consecutive failures so a store outage is not hammered, with jitter so a
        // fleet that lost the store together does not come back in lockstep.
        let backoff = match entry.failures {
            0 => Duration::ZERO,
            n => watch_backoff().nth(n as usize - 1).unwrap_or(Duration::from_secs(5)),
        };
        let tx = self.tx.clone();
        entry.handle = Some(tokio::spawn(async move {
            if !backoff.is_zero() {
                tokio::time::sleep(backoff).await;
            }
            let mut stream = match store.watch(&watch.prefix()).await {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Msg::WatchFailed { watch, generation, error: e.to_string() });
                    return;
                }
            };
            loop {
                match stream.next().await {
                    Some(Ok(event)) => {
                        if tx.send(Msg::Watch { watch, generation, event }).is_err() {
                            return;
                        }
                    }
                    Some(Err(e)) => {
                        let _ = tx.send(Msg::WatchFailed { watch, generation, error: e.to_string() });
                        return;
                    }
                    None => {
                        let _ = tx.send(Msg::WatchFailed { watch, generation, error: "watch ended".into() });
                        return;
                    }
                }
            }
        }));
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

fn log_event(e: &Event) {
    match e {
        Event::Acquired { split, reason, epoch } => {
            info!(%split, reason = reason.label(), %epoch, "split acquired")
        }
        Event::Revoked { split, reason } => warn!(%split, ?reason, "lane revoked"),
        Event::Leadership { leader, term } => info!(leader, term, "leadership changed"),
        Event::PlanPublished { term, version, splits } => info!(term, version, splits, "plan published"),
        Event::PlanFailed { error } => warn!(%error, "planner failed; retrying"),
        Event::Quarantined { split, attempts, last_error } => {
            warn!(%split, attempts, last_error = last_error.as_deref().unwrap_or(""), "split quarantined")
        }
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
        Event::JobEnded { .. } | Event::JobReopened => {}
        // Events are informational and grow; one this driver does not know is still visible.
        other => debug!(event = ?other, "event"),
    }
}

/// Delays between attempts to reopen a failed watch: 200 ms doubling up to 5 s, each with a
/// random extra of up to itself (jitter).
fn watch_backoff() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_factor(2.0)
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}

#[cfg(test)]
mod tests {
    use etl_coordination_core::{AcquisitionReason, StopReason};
    use etl_coordination_metrics::{ACQUISITION_REASONS, REVOCATION_REASONS};

    /// The metrics crate does not depend on the protocol, so its label lists are tied to the
    /// core's enums here, where both meet: a new reason cannot miss its counter.
    #[test]
    fn metric_label_values_are_the_cores_reasons() {
        assert_eq!(AcquisitionReason::ALL.map(|r| r.label()), ACQUISITION_REASONS);
        let revocations: Vec<&str> = StopReason::ALL.iter().filter_map(|r| r.revocation_label()).collect();
        assert_eq!(revocations, REVOCATION_REASONS);
    }
}
