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

use crate::config::{DriverConfig, JobStores, OnStall};
use crate::lane::{Lane, LaneMsg, Lanes, Stop};
use crate::outcome::{DriverError, JobOutcome, describe};
use crate::planner::Planner;

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
    on_stall: OnStall,
    op_timeout: Duration,
    origin: Instant,
    watches: BTreeMap<WatchId, WatchTask>,
    stops: BTreeMap<SplitId, (Epoch, watch::Sender<Option<Stop>>)>,
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
    ) -> (Self, mpsc::UnboundedSender<Control>, Lanes) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (control_tx, control) = mpsc::unbounded_channel();
        let (lane_tx, lane_rx) = mpsc::unbounded_channel();
        let (lanes_tx, lanes_rx) = mpsc::unbounded_channel();
        let metrics = Metrics::new(config.job.clone(), cfg.instance_id.to_string());
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
            on_stall: config.on_stall,
            op_timeout: config.op_timeout,
            origin: Instant::now(),
            watches: BTreeMap::new(),
            stops: BTreeMap::new(),
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
                Input::Finish { split, epoch, progress }
            }
            LaneMsg::Fail { split, epoch, error, unprocessable } => {
                warn!(%split, %epoch, %error, unprocessable, "source reported the split failed");
                Input::Fail { split, epoch, error, unprocessable }
            }
            LaneMsg::Stopped { split, epoch } => Input::LaneStopped { split, epoch },
        }
    }

    fn wait_for_commit(&mut self, split: &SplitId, epoch: Epoch, reply: oneshot::Sender<CommitOutcome>) {
        let earlier = self.waiters.insert((split.clone(), epoch), reply);
        debug_assert!(earlier.is_none(), "a lane sent a second commit while one was in flight");
    }

    fn handle(&mut self, input: Input) {
        let now = self.now();
        trace!(?now, ?input, "core input");
        let actions = self.worker.handle(now, input);
        for action in actions {
            trace!(?action, "core action");
            self.act(action);
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
                let call = tokio::spawn(async move { planner.plan().await });
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
                self.stops.insert(split.clone(), (epoch, stop_tx));
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
                if let Some((e, tx)) = self.stops.get(&split)
                    && *e == epoch
                {
                    let _ = tx.send(Some(Stop { reason, deadline }));
                }
                if reason != StopReason::Draining {
                    self.stops.remove(&split);
                }
            }
            Action::CommitDone { split, epoch, outcome } => {
                if let Some(reply) = self.waiters.remove(&(split, epoch)) {
                    let _ = reply.send(outcome);
                }
            }
            Action::Event(e) => {
                self.record(&e);
                log_event(&e);
            }
            Action::Finished(outcome) => {
                let result = match outcome {
                    Outcome::Complete => {
                        info!("job complete: every split is done");
                        Ok(JobOutcome::Complete)
                    }
                    Outcome::Stalled { quarantined } => {
                        warn!(splits = %describe(&quarantined), "job stalled on quarantined splits");
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

    fn record(&self, e: &Event) {
        match e {
            Event::Acquired { reason, .. } => self.metrics.acquisition(reason.label()),
            Event::Revoked { reason, .. } => {
                if let Some(label) = reason.revocation_label() {
                    self.metrics.revocation(label);
                }
            }
            Event::Leadership { leader, .. } => self.metrics.leader(*leader),
            Event::PlanFailed { .. } => self.metrics.plan_failure(),
            Event::Gauges { owned, live_workers, quarantined } => {
                self.metrics.splits_owned(*owned);
                self.metrics.live_workers(*live_workers);
                self.metrics.splits_quarantined(*quarantined);
            }
            _ => {}
        }
    }

    fn finish(&mut self, result: Result<JobOutcome, DriverError>) {
        self.metrics.splits_owned(0);
        self.metrics.leader(false);
        self.metrics.job_state(match &result {
            Ok(JobOutcome::Complete) => "complete",
            Ok(JobOutcome::Stalled { .. }) | Err(DriverError::Stalled { .. }) => "stalled",
            Ok(JobOutcome::Drained) => "drained",
            Err(_) => "failed",
        });
        self.done = true;
        for (_, (_, tx)) in std::mem::take(&mut self.stops) {
            let _ = tx.send(Some(Stop { reason: StopReason::Fenced, deadline: None }));
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
        Event::Gauges { owned, live_workers, quarantined } => {
            debug!(owned, live_workers, quarantined, "gauges")
        }
        Event::Undecodable { key, error } => warn!(%key, %error, "ignored an undecodable record"),
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
