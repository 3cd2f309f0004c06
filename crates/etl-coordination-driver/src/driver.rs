//! The driver task: the core's actions executed with tokio.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::defaults;
use etl_coordination_core::{
    Action, Bucket, CommitOutcome, Config, ConfigError, Epoch, Event, FatalError, Incarnation, Input,
    InstanceId, OpId, Outcome, Plan, SplitId, StopReason, StoreError, StoreResult, Timestamp, WatchEvent,
    WatchId, Worker,
};
use etl_coordination_metrics::{Metrics, WriteOutcome};
use etl_coordination_store::{Store, execute};
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::lane::{Lane, Lanes, Stop};

/// Enumerates a source's work as splits. Runs only on the fleet's leader (P4).
pub trait Planner: Send + Sync + 'static {
    /// Identifies the planner and its configuration (source kind, input location, split
    /// sizing): every replica of a job must report the same value, or it is refused at startup
    /// with both fingerprints in the error (P2).
    fn fingerprint(&self) -> String;

    /// Lists the work. Split ids must be deterministic (re-planning the same input yields the
    /// same ids) and unique.
    fn plan(&self) -> impl Future<Output = Result<Plan, PlanError>> + Send;
}

/// A planner failure; the leader retries after a heartbeat interval.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

/// What a stalled job (quarantined splits, P13) means for the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnStall {
    /// [`DriverHandle::outcome`] returns [`DriverError::Stalled`] (the default).
    #[default]
    Fatal,
    /// The outcome is [`JobOutcome::Stalled`], logged as a warning.
    Warn,
}

/// Tuning knobs (SPEC section 7) and driver settings.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// The job's name, used as the `coordination_job` metric label.
    pub job: String,
    /// Stable identity (e.g. the pod name with dots substituted); `None`: random.
    pub instance_id: Option<InstanceId>,
    /// Lease TTL: takeover latency after an ungraceful death. Whole seconds, at least 1 s.
    pub lease_duration: Duration,
    /// Splits (and lanes) held at once.
    pub max_in_flight: u32,
    /// Failing tenancies before a split is quarantined.
    pub max_attempts: u32,
    /// How often the leader re-runs an open plan.
    pub replan_interval: Duration,
    /// How long lanes get to commit when draining.
    pub drain_timeout: Duration,
    /// Stalled jobs: fatal or warn.
    pub on_stall: OnStall,
    /// Timeout of one store request; a timed-out write is treated as in doubt.
    pub op_timeout: Duration,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            job: "default".into(),
            instance_id: None,
            lease_duration: defaults::LEASE_DURATION,
            max_in_flight: defaults::MAX_IN_FLIGHT,
            max_attempts: defaults::MAX_ATTEMPTS,
            replan_interval: defaults::REPLAN_INTERVAL,
            drain_timeout: defaults::DRAIN_TIMEOUT,
            on_stall: OnStall::Fatal,
            op_timeout: Duration::from_secs(5),
        }
    }
}

/// The two key spaces of a job (NATS: two buckets).
#[derive(Clone, Debug)]
pub struct JobStores<S> {
    /// Durable records.
    pub state: S,
    /// TTL'd leases.
    pub lease: S,
}

/// How the job ended for this worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobOutcome {
    /// Every split is Done.
    Complete,
    /// Some splits are quarantined (with [`OnStall::Warn`]).
    Stalled {
        /// Quarantined splits and their last errors.
        quarantined: Vec<(SplitId, Option<String>)>,
    },
    /// This worker left on request before the job ended.
    Drained,
}

/// Why the driver could not run or finish.
#[derive(Clone, Debug, thiserror::Error)]
pub enum DriverError {
    /// A configuration value is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The protocol stopped with a fatal condition (divergence, duplicate id, store setup).
    #[error(transparent)]
    Fatal(#[from] FatalError),
    /// The job stalled on quarantined splits ([`OnStall::Fatal`]).
    #[error("the job stalled: {} split(s) quarantined after max_attempts failing tenancies: {}; fix the cause, then requeue them", quarantined.len(), describe(quarantined))]
    Stalled {
        /// Quarantined splits and their last errors.
        quarantined: Vec<(SplitId, Option<String>)>,
    },
    /// The worker was killed on request ([`DriverHandle::kill`]).
    #[error("killed")]
    Killed,
    /// The driver task ended without an outcome (it panicked or the runtime shut down).
    #[error("the coordination driver stopped without an outcome")]
    Gone,
}

fn describe(q: &[(SplitId, Option<String>)]) -> String {
    q.iter()
        .map(|(id, e)| format!("{id} ({})", e.as_deref().unwrap_or("no error recorded")))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Messages into the driver task.
#[derive(Debug)]
pub(crate) enum Msg {
    StoreDone {
        op: OpId,
        result: StoreResult,
    },
    Watch {
        watch: WatchId,
        generation: u64,
        event: WatchEvent,
    },
    WatchFailed {
        watch: WatchId,
        generation: u64,
        error: String,
    },
    PlanReady {
        request: u64,
        result: Result<Plan, String>,
    },
    Commit {
        split: SplitId,
        epoch: Epoch,
        progress: Bytes,
        terminal: bool,
        reply: oneshot::Sender<CommitOutcome>,
    },
    Fail {
        split: SplitId,
        epoch: Epoch,
        error: String,
        unprocessable: bool,
    },
    LaneStopped {
        split: SplitId,
        epoch: Epoch,
    },
    Drain,
    Kill,
    Freeze(Duration),
}

/// Controls a running driver.
#[derive(Clone, Debug)]
pub struct DriverHandle {
    tx: mpsc::UnboundedSender<Msg>,
    outcome: watch::Receiver<Option<Result<JobOutcome, DriverError>>>,
    instance_id: InstanceId,
}

impl DriverHandle {
    /// Starts a graceful shutdown (P10): lanes get `drain_timeout` to commit, splits are
    /// released, presence is removed; no attempts are consumed.
    pub fn drain(&self) {
        let _ = self.tx.send(Msg::Drain);
    }

    /// Stops the worker at once without releasing anything, as a crash would: its leases
    /// expire and peers take over. For tests and chaos experiments.
    pub fn kill(&self) {
        let _ = self.tx.send(Msg::Kill);
    }

    /// Freezes the worker's coordination for `duration`, as a stop-the-world pause would
    /// (SIGSTOP, a long GC): no renewals, no watch events, no timers. For tests and chaos.
    pub fn freeze(&self, duration: Duration) {
        let _ = self.tx.send(Msg::Freeze(duration));
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
        let mut cfg = Config::new(instance_id.clone(), Incarnation(random_u64()), planner.fingerprint());
        cfg.lease_duration = config.lease_duration;
        cfg.max_in_flight = config.max_in_flight;
        cfg.max_attempts = config.max_attempts;
        cfg.replan_interval = config.replan_interval;
        cfg.drain_timeout = config.drain_timeout;
        cfg.validate()?;
        if config.op_timeout.is_zero() {
            return Err(
                ConfigError { field: "op_timeout", value: "0s".into(), rule: "must be positive" }.into()
            );
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let (lanes_tx, lanes_rx) = mpsc::unbounded_channel();
        let (outcome_tx, outcome_rx) = watch::channel(None);
        info!(instance = %instance_id, incarnation = %format!("{:x}", cfg.incarnation.0), "coordination worker starting");
        let task = Task {
            worker: Worker::new(cfg),
            state: Arc::new(stores.state),
            lease: Arc::new(stores.lease),
            planner: Arc::new(planner),
            tx: tx.clone(),
            rx,
            lanes: lanes_tx,
            outcome: outcome_tx,
            on_stall: config.on_stall,
            op_timeout: config.op_timeout,
            origin: Instant::now(),
            watches: BTreeMap::new(),
            stops: BTreeMap::new(),
            waiters: BTreeMap::new(),
            done: false,
            metrics: Metrics::new(config.job.clone(), instance_id.to_string()),
        };
        tokio::spawn(task.run());
        Ok((DriverHandle { tx, outcome: outcome_rx, instance_id }, Lanes { rx: lanes_rx }))
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

struct WatchTask {
    generation: u64,
    failures: u32,
    handle: Option<JoinHandle<()>>,
}

struct Task<S, P> {
    worker: Worker,
    state: Arc<S>,
    lease: Arc<S>,
    planner: Arc<P>,
    tx: mpsc::UnboundedSender<Msg>,
    rx: mpsc::UnboundedReceiver<Msg>,
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
}

impl<S: Store, P: Planner> Task<S, P> {
    fn now(&self) -> Timestamp {
        Timestamp::from_micros(u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX))
    }

    fn instant(&self, t: Timestamp) -> Instant {
        self.origin + t.since_origin()
    }

    async fn run(mut self) {
        self.handle(Input::Start);
        while !self.done {
            let deadline = self.worker.next_deadline().map(|t| self.instant(t));
            let input = tokio::select! {
                msg = self.rx.recv() => match msg {
                    Some(Msg::Freeze(d)) => {
                        warn!(?d, "frozen");
                        // Block the whole loop, timers included, like a stopped process.
                        tokio::time::sleep(d).await;
                        continue;
                    }
                    Some(msg) => match self.on_msg(msg) {
                        Some(input) => input,
                        None => continue,
                    },
                    None => break,
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
            Msg::Commit { split, epoch, progress, terminal, reply } => {
                if self.waiters.contains_key(&(split.clone(), epoch)) {
                    let _ = reply.send(CommitOutcome::Retryable);
                    return None;
                }
                self.waiters.insert((split.clone(), epoch), reply);
                if terminal {
                    Input::Finish { split, epoch, progress }
                } else {
                    Input::Commit { split, epoch, progress }
                }
            }
            Msg::Fail { split, epoch, error, unprocessable } => {
                warn!(%split, %epoch, %error, unprocessable, "source reported the split failed");
                Input::Fail { split, epoch, error, unprocessable }
            }
            Msg::LaneStopped { split, epoch } => Input::LaneStopped { split, epoch },
            Msg::Drain => {
                info!("draining: committing, releasing splits and leaving");
                Input::Drain
            }
            Msg::Kill => {
                warn!("killed: leaving without releasing anything");
                self.finish(Err(DriverError::Killed));
                return None;
            }
            Msg::Freeze(_) => return None,
        })
    }

    fn handle(&mut self, input: Input) {
        let now = self.now();
        let actions = self.worker.handle(now, input);
        for action in actions {
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
                tokio::spawn(async move {
                    let result = planner.plan().await.map_err(|e| e.0);
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
                    tx: self.tx.clone(),
                    stop: stop_rx,
                    ended: false,
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
        // Back off after consecutive failures so a store outage is not hammered.
        let backoff = match entry.failures {
            0 => Duration::ZERO,
            n => (Duration::from_millis(100) * 2u32.saturating_pow(n.min(6))).min(Duration::from_secs(5)),
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
        Event::Released { split } => debug!(%split, "split released"),
        Event::Finished { split } => debug!(%split, "split done"),
        Event::Gauges { owned, live_workers, quarantined } => {
            debug!(owned, live_workers, quarantined, "gauges")
        }
        Event::Undecodable { key, error } => warn!(%key, %error, "ignored an undecodable record"),
    }
}
