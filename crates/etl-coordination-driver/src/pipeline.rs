//! [`Pipeline`]: a coordinated worker whose lane loop the library owns.
//!
//! The embedding code implements a [`Source`] (its [`Planner`], and reading one split from its
//! resume point as records, each with the split's progress once it is written) and a [`Sink`]
//! (writing records, and a durable flush). The pipeline runs a [`CoordinationDriver`] and a lane
//! per split it holds: it writes each record to the sink, commits the progress every
//! [`CommitCadence::records`] records or [`CommitCadence::interval`] (flushing the sink first,
//! so committed progress is never ahead of the sink: at-least-once survives a crash anywhere),
//! stops a lane at once when its split is lost (every read is raced against the stop signal,
//! and [`LaneInfo::cancelled`] fires), lets lanes commit and stop when draining, finishes a
//! split at its end, and reports a source's error as a failure (one attempt) or as
//! unprocessable. [`Pipeline::run_until`] returns the job's outcome.
//!
//! Progress is typed ([`Source::Progress`], any serde type); it is stored as JSON, so
//! `etl-coord status` shows it as `key=value` pairs whatever the source.
//!
//! For full control (a lane loop of your own), use [`CoordinationDriver::start`] and its
//! [`Lanes`](crate::Lanes) instead.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::{CommitOutcome, InstanceId, Plan, SplitId, StopReason};
use etl_coordination_store::Store;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::config::DriverConfig;
use crate::handle::{CoordinationDriver, DriverHandle};
use crate::lane::{Lane, Stop};
use crate::outcome::{DriverError, JobOutcome};
use crate::planner::{PlanError, Planner};
use crate::stores::JobStores;

use crate::contract::{CommitCadence, LaneInfo, Sink, SinkError, Source, SourceError, SplitReader};

/// A coordinated worker whose lanes the library runs: see the module documentation, and the
/// crate's for an example.
pub struct Pipeline<St, So, Si> {
    stores: JobStores<St>,
    source: Arc<So>,
    sink: Arc<Si>,
    config: DriverConfig,
    cadence: CommitCadence,
}

impl<St, So, Si> std::fmt::Debug for Pipeline<St, So, Si> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("job", &self.stores.job)
            .field("config", &self.config)
            .field("cadence", &self.cadence)
            .finish_non_exhaustive()
    }
}

impl<St: Store, So: Source, Si: Sink<So::Record>> Pipeline<St, So, Si> {
    /// A pipeline of `source` into `sink`, coordinated through `stores`, with the default
    /// [`DriverConfig`] and [`CommitCadence`].
    pub fn new(stores: JobStores<St>, source: So, sink: Si) -> Self {
        Pipeline {
            stores,
            source: Arc::new(source),
            sink: Arc::new(sink),
            config: DriverConfig::default(),
            cadence: CommitCadence::default(),
        }
    }

    /// The worker's settings (instance id, tuning, what a stall means, ...).
    pub fn config(mut self, config: DriverConfig) -> Self {
        self.config = config;
        self
    }

    /// When lanes commit their progress.
    pub fn commit_every(mut self, cadence: CommitCadence) -> Self {
        self.cadence = cadence;
        self
    }

    /// Starts the worker and its lanes on the current tokio runtime; the handle drains, kills
    /// or waits for it.
    pub fn start(self) -> Result<DriverHandle, DriverError> {
        self.spawn().map(|(handle, _lanes)| handle)
    }

    /// Starts the worker, and a task that runs its lanes and ends when the last one has.
    fn spawn(self) -> Result<(DriverHandle, tokio::task::JoinHandle<()>), DriverError> {
        let (handle, mut lanes) = CoordinationDriver::start(self.stores, self.source.clone(), self.config)?;
        let (source, sink, cadence) = (self.source, self.sink, self.cadence);
        let instance = handle.instance_id().clone();
        let running = tokio::spawn(async move {
            let mut running = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    lane = lanes.next() => match lane {
                        Some(lane) => {
                            running.spawn(run_lane(lane, source.clone(), sink.clone(), cadence, instance.clone()));
                        }
                        None => break,
                    },
                    Some(ended) = running.join_next(), if !running.is_empty() => log_panic(ended),
                }
            }
            while let Some(ended) = running.join_next().await {
                log_panic(ended);
            }
        });
        Ok((handle, running))
    }

    /// Runs the worker until the job ends for it, or until `shutdown` resolves (then it drains:
    /// lanes commit and stop, splits are released, no attempt is consumed). Returns the outcome
    /// once every lane has ended, so the sink can be closed as soon as it returns.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<JobOutcome, DriverError> {
        let (handle, lanes) = self.spawn()?;
        let outcome = tokio::select! {
            outcome = handle.outcome() => outcome,
            () = shutdown => {
                handle.drain();
                handle.outcome().await
            }
        };
        let _ = lanes.await;
        outcome
    }
}

/// A lane task that panicked is a bug of the source or the sink: said once, loudly. (Its
/// split was reported failed when the lane was dropped.)
fn log_panic(ended: Result<(), tokio::task::JoinError>) {
    if let Err(e) = ended
        && e.is_panic()
    {
        warn!(error = %e, "a lane panicked; its split counts a failed attempt");
    }
}

impl<P: Planner> Planner for Arc<P> {
    fn fingerprint(&self) -> String {
        (**self).fingerprint()
    }

    fn plan(&self) -> impl Future<Output = Result<Plan, PlanError>> + Send {
        (**self).plan()
    }

    fn replan(&self, published: &[SplitId]) -> impl Future<Output = Result<Plan, PlanError>> + Send {
        (**self).replan(published)
    }
}

/// How a lane ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LaneEnd {
    /// The split is Done.
    Finished,
    /// Stopped on a drain (after its last commit).
    Stopped,
    /// Lost or starved: stopped at once.
    Revoked,
    /// Reported failed or unprocessable.
    Failed,
}

/// Runs one lane to its end inside a `lane{split, epoch}` span.
async fn run_lane<So: Source, Si: Sink<So::Record>>(
    lane: Lane,
    source: Arc<So>,
    sink: Arc<Si>,
    cadence: CommitCadence,
    instance: InstanceId,
) {
    let span = info_span!("lane", split = %lane.split(), epoch = lane.epoch().0);
    let info = LaneInfo {
        split: lane.split().clone(),
        epoch: lane.epoch(),
        instance,
        descriptor: lane.descriptor().clone(),
        weight: lane.weight(),
        reason: lane.reason(),
        cancelled: CancellationToken::new(),
    };
    // The token fires the moment a stop is given, whatever the lane is doing (writing,
    // flushing, committing), and when the lane ends, however it ends.
    let _cancel_on_end = info.cancelled.clone().drop_guard();
    let mut stop = lane.stop.clone();
    let cancel = info.cancelled.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.wait_for(Option::is_some) => {}
            () = cancel.cancelled() => {}
        }
        cancel.cancel();
    });
    async move {
        let (emitted, end) = lane_loop(lane, &info, &*source, &*sink, cadence).await;
        info!(emitted, end = ?end, "lane ended");
    }
    .instrument(span)
    .await
}

/// Ends the lane as the source's error says.
fn report(lane: Lane, e: SourceError) -> LaneEnd {
    warn!(error = %e, "reading the split failed");
    match e {
        SourceError::Unprocessable(why) => lane.unprocessable(why),
        SourceError::Failed(why) => lane.fail(why),
    }
    LaneEnd::Failed
}

/// Ends the lane after its sink failed: a failure of the split (one attempt), unless the lane
/// was told to stop meanwhile (a sink that gives up when [`LaneInfo::cancelled`] fires is not
/// the split's fault): then it stops, and what was not committed replays.
fn sink_failed(lane: Lane, e: SinkError) -> LaneEnd {
    match lane.stop_requested() {
        Some(stop) => {
            debug!(error = %e, "the sink gave up on a stopping lane");
            stop_now(lane, stop)
        }
        None => {
            warn!(error = %e, "the sink failed");
            lane.fail(e.to_string());
            LaneEnd::Failed
        }
    }
}

/// Progress as stored in the split record.
fn encode<P: Serialize>(p: &P) -> Bytes {
    Bytes::from(serde_json::to_vec(p).expect("progress serializes"))
}

/// The progress a split that had no record ends with (JSON, like every progress).
const NO_PROGRESS: &[u8] = b"null";

async fn lane_loop<So: Source, Si: Sink<So::Record>>(
    mut lane: Lane,
    info: &LaneInfo,
    source: &So,
    sink: &Si,
    cadence: CommitCadence,
) -> (u64, LaneEnd) {
    let resume = lane.resume_from().cloned();
    let from = match &resume {
        None => None,
        Some(b) if b.as_ref() == NO_PROGRESS => None,
        Some(b) => match serde_json::from_slice::<So::Progress>(b) {
            Ok(p) => Some(p),
            Err(e) => {
                let why = format!("the committed progress does not decode as this source's progress: {e}");
                return (0, report(lane, SourceError::Unprocessable(why)));
            }
        },
    };
    let opened = tokio::select! {
        biased;
        stop = lane.revoked() => Err(stop),
        r = source.open(info, from) => Ok(r),
    };
    let mut reader = match opened {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return (0, report(lane, e)),
        Err(stop) => return (0, stop_now(lane, stop)),
    };
    let mut emitted = 0u64;
    // The progress after the last record written, and how many records were written since the
    // last commit (0: `last` is committed, or there is none).
    let mut last: Option<Bytes> = None;
    let mut pending = 0u64;
    let mut last_commit = Instant::now();
    loop {
        // One read. While it waits, the time cadence commits what was written: the read's future
        // is kept (not dropped and started again), so a reader that is not cancel-safe loses
        // nothing. It is dropped only when the lane stops, with the reader.
        let read = reader.next();
        tokio::pin!(read);
        let next = loop {
            tokio::select! {
                biased;
                stop = lane.revoked() => break Err(stop),
                () = tokio::time::sleep_until(last_commit + cadence.interval), if pending > 0 => {
                    match flush_and_commit(&mut lane, sink.flush(), last.clone().expect("written")).await {
                        Ok(true) => (pending, last_commit) = (0, Instant::now()),
                        // A stop came: the next round sees it.
                        Ok(false) => {}
                        Err(end) => return (emitted, end.apply(lane)),
                    }
                }
                r = &mut read => break Ok(r),
            }
        };
        let next = match next {
            Ok(next) => next,
            Err(stop) => {
                if stop.reason == StopReason::Draining && pending > 0 {
                    drain_commit(&mut lane, sink.flush(), last.clone().expect("written"), stop).await;
                }
                return (emitted, stop_now(lane, stop));
            }
        };
        match next {
            Err(e) => return (emitted, report(lane, e)),
            Ok(None) => {
                if let Err(e) = sink.flush().await {
                    return (emitted, sink_failed(lane, e));
                }
                let end = last.or(resume).unwrap_or(Bytes::from_static(NO_PROGRESS));
                return (emitted, finish(lane, end).await);
            }
            Ok(Some((record, progress))) => {
                if let Err(e) = sink.write(info, record).await {
                    return (emitted, sink_failed(lane, e));
                }
                emitted += 1;
                pending += 1;
                last = Some(encode(&progress));
                if pending >= cadence.records || last_commit.elapsed() >= cadence.interval {
                    // Commit before going on: a lane never runs more than one commit interval
                    // ahead of its durable progress, so a store outage bounds both the replay
                    // and what a zombie (a lane that lost its split without hearing of it) emits
                    // twice.
                    match flush_and_commit(&mut lane, sink.flush(), last.clone().expect("written")).await {
                        Ok(true) => (pending, last_commit) = (0, Instant::now()),
                        Ok(false) => {}
                        Err(end) => return (emitted, end.apply(lane)),
                    }
                }
            }
        }
    }
}

/// Why a lane ends after [`flush_and_commit`].
enum CommitEnd {
    /// The split is no longer ours: stop at once.
    Lost,
    /// The sink could not flush: nothing was committed.
    Sink(SinkError),
}

impl CommitEnd {
    fn apply(self, lane: Lane) -> LaneEnd {
        match self {
            CommitEnd::Lost => LaneEnd::Revoked,
            CommitEnd::Sink(e) => sink_failed(lane, e),
        }
    }
}

/// Flushes the sink, then commits `progress` (never ahead of the sink), trying again while the
/// store cannot take it. `Ok(true)`: durable; `Ok(false)`: a stop came while the store could
/// not take it (the progress stays uncommitted); `Err`: the lane must end.
async fn flush_and_commit(
    lane: &mut Lane,
    flush: impl Future<Output = Result<(), SinkError>>,
    progress: Bytes,
) -> Result<bool, CommitEnd> {
    flush.await.map_err(CommitEnd::Sink)?;
    let mut delays = retry_delays();
    loop {
        match lane.commit(progress.clone()).await {
            CommitOutcome::Ok => return Ok(true),
            CommitOutcome::Lost => return Err(CommitEnd::Lost),
            CommitOutcome::Retryable => {
                tokio::select! {
                    () = tokio::time::sleep(delays.next().unwrap_or(MAX_RETRY_DELAY)) => {}
                    _ = lane.revoked() => return Ok(false),
                }
            }
        }
    }
}

/// A draining lane's last commit: after `flush` succeeds, tried until the drain's deadline
/// while the store cannot take it (a short outage during a drain should not cost a replay).
/// Never ahead of the sink: if it cannot flush, the tail replays.
async fn drain_commit(
    lane: &mut Lane,
    flush: impl Future<Output = Result<(), SinkError>>,
    progress: Bytes,
    stop: Stop,
) {
    if let Err(e) = flush.await {
        warn!(error = %e, "the sink failed to flush while draining; the uncommitted tail replays");
        return;
    }
    let mut delays = retry_delays();
    loop {
        match lane.commit(progress.clone()).await {
            CommitOutcome::Ok | CommitOutcome::Lost => return,
            CommitOutcome::Retryable => {
                let wait = delays.next().unwrap_or(MAX_RETRY_DELAY);
                let draining = lane.stop_requested().is_some_and(|s| s.reason == StopReason::Draining);
                if !draining || stop.deadline.is_none_or(|d| Instant::now() + wait >= d) {
                    warn!(
                        "the store did not take the last commit before the drain deadline; the uncommitted tail replays"
                    );
                    return;
                }
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// A lane told to stop: acknowledged if draining (its split is released), dropped otherwise.
fn stop_now(lane: Lane, stop: Stop) -> LaneEnd {
    if stop.reason == StopReason::Draining {
        lane.stopped();
        LaneEnd::Stopped
    } else {
        debug!(reason = ?stop.reason, "lane revoked");
        LaneEnd::Revoked
    }
}

/// The terminal commit, tried again while the store cannot take it.
async fn finish(mut lane: Lane, progress: Bytes) -> LaneEnd {
    let mut delays = retry_delays();
    loop {
        match lane.finish(progress.clone()).await {
            Ok(()) => return LaneEnd::Finished,
            Err((_, CommitOutcome::Lost)) => return LaneEnd::Revoked,
            Err((l, _)) => {
                if l.stop_requested().is_some_and(|s| s.reason != StopReason::Draining) {
                    return LaneEnd::Revoked;
                }
                lane = l;
                tokio::time::sleep(delays.next().unwrap_or(MAX_RETRY_DELAY)).await;
            }
        }
    }
}

/// The longest wait between two tries of a commit the store could not take.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(2);

/// Waits between tries of a commit the store could not take (it is down or cut off): 100 ms
/// doubling up to [`MAX_RETRY_DELAY`], each plus a random extra of up to itself, so lanes that
/// lost the store together do not retry in lockstep.
fn retry_delays() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_factor(2.0)
        .with_max_delay(MAX_RETRY_DELAY)
        .with_jitter()
        .without_max_times()
        .build()
}
