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
use crate::transient::{Side, Transient, Wait};

use crate::config::OnBadRecord;
use crate::contract::{
    BadRecord, CommitCadence, DeadLetters, LaneInfo, Sink, SinkError, SinkWriter, Source, SourceError,
    SplitReader,
};
use crate::outputs::{LaneOutputs, Outputs};

/// A coordinated worker whose lanes the library runs: see the module documentation, and the
/// crate's for an example.
pub struct Pipeline<St, So, Si> {
    stores: JobStores<St>,
    source: Arc<So>,
    sink: Arc<Si>,
    dead_letters: Option<Arc<dyn DeadLetters>>,
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
            dead_letters: None,
            config: DriverConfig::default(),
            cadence: CommitCadence::default(),
        }
    }

    /// The worker's settings (instance id, tuning, what a stall means, ...).
    pub fn config(mut self, config: DriverConfig) -> Self {
        self.config = config;
        self
    }

    /// Where bad records go under [`OnBadRecord::Skip`] (required by it): each with its split,
    /// position and error. Flushed with the sink, before every commit.
    pub fn dead_letters(mut self, dead_letters: impl DeadLetters) -> Self {
        self.dead_letters = Some(Arc::new(dead_letters));
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
        let budget = self.config.transient_retry_budget;
        let on_bad = self.config.on_bad_record;
        if matches!(on_bad, OnBadRecord::Skip { .. }) && self.dead_letters.is_none() {
            return Err(DriverError::Config(etl_coordination_core::ConfigError {
                field: "on_bad_record",
                value: format!("{on_bad:?}"),
                rule: "Skip needs a dead-letter sink to keep the skipped records: Pipeline::dead_letters",
            }));
        }
        let (handle, mut lanes) = CoordinationDriver::start(self.stores, self.source.clone(), self.config)?;
        let sink = Arc::new(Outputs { sink: self.sink, dead: self.dead_letters, on_bad });
        let (source, cadence) = (self.source, self.cadence);
        let instance = handle.instance_id().clone();
        let running = tokio::spawn(async move {
            let mut running = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    lane = lanes.next() => match lane {
                        Some(lane) => {
                            running.spawn(run_lane(lane, source.clone(), sink.clone(), cadence, instance.clone(), budget));
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
    outputs: Arc<Outputs<Si>>,
    cadence: CommitCadence,
    instance: InstanceId,
    budget: Duration,
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
        let (emitted, end) = lane_loop(lane, &info, &*source, &*outputs, cadence, budget).await;
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
        // On-bad-record quarantine (a skipping lane does not get here with one).
        e @ SourceError::BadRecord(_) => lane.unprocessable(e.to_string()),
        SourceError::Failed(why) | SourceError::Transient(why) => lane.fail(why),
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

/// The state of a lane between reads: what was written since the last commit.
struct Written<P> {
    /// Records emitted by this lane.
    emitted: u64,
    /// The progress after the last record written (`None`: none yet), encoded when committed.
    last: Option<P>,
    /// Records written since the last commit.
    pending: u64,
    /// Whether `last` is ahead of the last commit (records written, or an empty batch read).
    dirty: bool,
    /// Bad records this lane skipped into the dead-letter sink.
    skipped: u32,
    /// Of those, the ones after the last record written: a reader opened again (after a
    /// transient failure) reads them again, and they are not counted twice.
    skipped_since_last: u32,
    last_commit: Instant,
    /// Where the split stands at `last`, in its weight's unit ([`SplitReader::position`]).
    position: Option<u64>,
    /// `emitted` when the lane last reported its work ([`Lane::worked`]).
    reported: u64,
}

impl<P: Serialize> Written<P> {
    /// The progress to commit: the last written, encoded.
    fn progress(&self) -> Bytes {
        encode(self.last.as_ref().expect("written"))
    }

    /// The progress written and not committed, if any.
    fn uncommitted(&self) -> Option<Bytes> {
        self.dirty.then(|| self.progress())
    }

    /// What was written is committed.
    fn committed(&mut self) {
        (self.pending, self.dirty, self.last_commit) = (0, false, Instant::now());
    }

    /// Reports the records written since the last report and where the split stands.
    fn report(&mut self, lane: &Lane) {
        lane.worked(self.emitted - self.reported, self.position);
        self.reported = self.emitted;
    }
}

/// Runs a lane: opens its sink writer, reads its split from the resume point, writes each
/// batch to the writer, commits on the cadence, and ends as the split, the stop signal or an
/// error says. A transient error of the source or the sink is waited out in place (see
/// [`Transient`]): the reader is opened again at the record after the last one written (a
/// failed write's records are read again), and a flush is tried again. The writer is closed
/// when the lane ends in order (finished, or released on a drain), and dropped otherwise.
async fn lane_loop<So: Source, Si: Sink<So::Record>>(
    mut lane: Lane,
    info: &LaneInfo,
    source: &So,
    outputs: &Outputs<Si>,
    cadence: CommitCadence,
    budget: Duration,
) -> (u64, LaneEnd) {
    // A committed progress this release cannot read ends the lane before any sink is opened.
    if let Some(b) = lane.resume_from().filter(|b| b.as_ref() != NO_PROGRESS)
        && let Err(e) = serde_json::from_slice::<So::Progress>(b)
    {
        let text = String::from_utf8_lossy(b);
        let shown: String = text.chars().take(200).collect();
        let cut = if shown.len() < text.len() { " ..." } else { "" };
        lane.incompatible_progress(format!("{e}; the progress reads {shown}{cut}")).await;
        return (0, LaneEnd::Stopped);
    }
    let mut retry = Transient::new(budget);
    let writer = loop {
        let opened = tokio::select! {
            biased;
            stop = lane.revoked() => return (0, stop_now(lane, stop)),
            r = outputs.sink.open(info) => r,
        };
        match opened {
            Ok(writer) => {
                retry.recovered(Side::Sink);
                break writer;
            }
            Err(e) if e.is_transient() => {
                match retry
                    .wait_out(&mut lane, Side::Sink, "opening the sink writer", e.message().to_owned())
                    .await
                {
                    Wait::Again => {}
                    Wait::Stop(stop) => return (0, stop_now(lane, stop)),
                    Wait::Spent(why) => return (0, sink_failed(lane, SinkError::new(why))),
                }
            }
            Err(e) => return (0, sink_failed(lane, e)),
        }
    };
    let mut out = LaneOutputs::new(writer);
    let (emitted, end) = read_lane(lane, info, source, outputs, &mut out, cadence, retry).await;
    if matches!(end, LaneEnd::Finished | LaneEnd::Stopped)
        && let Err(e) = out.writer.close().await
    {
        warn!(error = %e, "closing the sink writer failed (after the lane's last commit)");
    }
    (emitted, end)
}

/// [`lane_loop`] once the writer is open.
async fn read_lane<So: Source, Si: Sink<So::Record>>(
    mut lane: Lane,
    info: &LaneInfo,
    source: &So,
    outputs: &Outputs<Si>,
    out: &mut LaneOutputs<So::Record, Si::Writer>,
    cadence: CommitCadence,
    mut retry: Transient,
) -> (u64, LaneEnd) {
    let resume = lane.resume_from().cloned();
    let mut w = Written {
        emitted: 0,
        last: None,
        pending: 0,
        dirty: false,
        skipped: 0,
        skipped_since_last: 0,
        last_commit: Instant::now(),
        position: None,
        reported: 0,
    };
    loop {
        let at = w.last.as_ref().map(encode).or_else(|| resume.clone());
        let opened = tokio::select! {
            biased;
            stop = lane.revoked() => return (w.emitted, stop_lane(lane, out, w.uncommitted(), stop).await),
            r = open_at(source, info, at.as_ref()) => r,
        };
        let reader = match opened {
            Ok(r) => {
                lane.read_at = Some(Instant::now());
                // Where a resumed lane starts, as the base of what it reports (what an earlier
                // tenancy read is not this one's work).
                if w.position.is_none()
                    && let Some(p) = at.as_ref().and_then(|b| serde_json::from_slice::<So::Progress>(b).ok())
                {
                    w.position = r.position(&p);
                    lane.worked(0, w.position);
                }
                r
            }
            Err(e) if e.is_transient() => {
                match retry.wait_out(&mut lane, Side::Source, "opening the split", e.to_string()).await {
                    Wait::Again => continue,
                    Wait::Stop(stop) => {
                        return (w.emitted, stop_lane(lane, out, w.uncommitted(), stop).await);
                    }
                    Wait::Spent(why) => return (w.emitted, report(lane, SourceError::Failed(why))),
                }
            }
            Err(e) => return (w.emitted, report(lane, e)),
        };
        let mut read = Read { lane: &mut lane, info, outputs, out, cadence, retry: &mut retry, w: &mut w };
        match read.split::<So>(reader, resume.as_ref()).await {
            // A transient failure was waited out: open again where the lane is (the bad records
            // after the last one written are met again).
            ReadEnd::Reopen => {
                w.skipped -= w.skipped_since_last;
                w.skipped_since_last = 0;
                continue;
            }
            ReadEnd::Stop(stop) => return (w.emitted, stop_lane(lane, out, w.uncommitted(), stop).await),
            ReadEnd::Source(e) => return (w.emitted, report(lane, e)),
            ReadEnd::Sink(e) => return (w.emitted, sink_failed(lane, e)),
            ReadEnd::Commit(end) => return (w.emitted, end.apply(lane)),
            ReadEnd::Finished(progress) => return (w.emitted, finish(lane, progress).await),
            ReadEnd::GiveUp(why) => {
                // What was skipped is kept before the split is given up.
                if let Err(e) = flush_retrying(&mut lane, out, &mut retry).await {
                    let e = match e {
                        FlushEnd::Failed(e) => e.to_string(),
                        FlushEnd::Stop(_) => "the lane was stopped".into(),
                    };
                    warn!(error = %e, "flushing the dead-letter sink before giving the split up failed");
                }
                warn!(error = %why, "too many bad records: giving the split up");
                lane.give_up(why);
                return (w.emitted, LaneEnd::Failed);
            }
        }
    }
}

/// Opens the reader at `at` (the progress of the record before, as committed or written).
async fn open_at<So: Source>(
    source: &So,
    info: &LaneInfo,
    at: Option<&Bytes>,
) -> Result<So::Reader, SourceError> {
    let from = match at {
        None => None,
        Some(b) if b.as_ref() == NO_PROGRESS => None,
        Some(b) => match serde_json::from_slice::<So::Progress>(b) {
            Ok(p) => Some(p),
            // The committed progress was checked when the lane started (one another release
            // wrote drains the worker, `Lane::incompatible_progress`); the lane's own progress
            // fails here only if the source's progress does not survive its own JSON.
            Err(e) => {
                let why = format!("this source's progress does not decode from its own JSON: {e}");
                return Err(SourceError::Unprocessable(why));
            }
        },
    };
    source.open(info, from).await
}

/// How reading with one reader ended.
enum ReadEnd {
    /// A transient failure was waited out: open the reader again.
    Reopen,
    /// The lane was told to stop.
    Stop(Stop),
    /// The source failed (for good, or past the transient budget).
    Source(SourceError),
    /// The sink failed (for good, or past the transient budget).
    Sink(SinkError),
    /// A commit ended the lane.
    Commit(CommitEnd),
    /// The split ended: finish it with this progress.
    Finished(Bytes),
    /// Too many bad records: give the split up (quarantined at once).
    GiveUp(String),
}

/// What reading with one reader works with: the lane, its writers and what it wrote.
struct Read<'a, Si: Sink<R>, R: Send + 'static, P> {
    lane: &'a mut Lane,
    info: &'a LaneInfo,
    outputs: &'a Outputs<Si>,
    out: &'a mut LaneOutputs<R, Si::Writer>,
    cadence: CommitCadence,
    retry: &'a mut Transient,
    w: &'a mut Written<P>,
}

impl<Si: Sink<R>, R: Send + 'static, P: Serialize> Read<'_, Si, R, P> {
    /// Reads with `reader` until the split ends, the lane stops, a failure ends it, or a
    /// transient failure calls for a new reader.
    async fn split<So>(&mut self, mut reader: So::Reader, resume: Option<&Bytes>) -> ReadEnd
    where
        So: Source<Record = R, Progress = P>,
    {
        loop {
            // One read. While it waits, the time cadence commits what was written: the read's
            // future is kept (not dropped and started again), so a reader that is not
            // cancel-safe loses nothing. It is dropped only when the lane stops, with the reader.
            let next = {
                let read = reader.next_batch();
                tokio::pin!(read);
                loop {
                    tokio::select! {
                        biased;
                        stop = self.lane.revoked() => return ReadEnd::Stop(stop),
                        () = tokio::time::sleep_until(self.w.last_commit + self.cadence.interval), if self.w.dirty => {
                            match self.commit().await {
                                Ok(()) => {}
                                Err(end) => return end,
                            }
                        }
                        r = &mut read => break r,
                    }
                }
            };
            if next.is_ok() {
                // The source answers again: its outage (if it had one) is over.
                self.retry.recovered(Side::Source);
            }
            if next.is_ok() || matches!(next, Err(SourceError::BadRecord(_))) {
                // The breaker hears at the next commit that the source answered (evidence for
                // other lanes' outages).
                self.lane.read_at = Some(Instant::now());
            }
            match next {
                Err(e) if e.is_transient() => {
                    return match self
                        .retry
                        .wait_out(self.lane, Side::Source, "reading the split", e.to_string())
                        .await
                    {
                        Wait::Again => ReadEnd::Reopen,
                        Wait::Stop(stop) => ReadEnd::Stop(stop),
                        Wait::Spent(why) => ReadEnd::Source(SourceError::Failed(why)),
                    };
                }
                Err(SourceError::BadRecord(bad))
                    if matches!(self.outputs.on_bad, OnBadRecord::Skip { .. }) =>
                {
                    match self.skip(bad).await {
                        Some(end) => return end,
                        None => continue,
                    }
                }
                Err(e) => return ReadEnd::Source(e),
                Ok(None) => {
                    return match flush_retrying(self.lane, self.out, self.retry).await {
                        Ok(()) => {
                            self.w.report(self.lane);
                            ReadEnd::Finished(
                                self.w
                                    .last
                                    .as_ref()
                                    .map(encode)
                                    .or(resume.cloned())
                                    .unwrap_or(Bytes::from_static(NO_PROGRESS)),
                            )
                        }
                        Err(FlushEnd::Stop(stop)) => ReadEnd::Stop(stop),
                        Err(FlushEnd::Failed(e)) => ReadEnd::Sink(e),
                    };
                }
                Ok(Some((records, progress))) => {
                    let n = records.len() as u64;
                    if n > 0 {
                        match self.out.writer.write_batch(records).await {
                            Ok(()) => self.retry.recovered(Side::Sink),
                            // Not taken: the records are read again from a new reader.
                            Err(e) if e.is_transient() => {
                                return match self
                                    .retry
                                    .wait_out(
                                        self.lane,
                                        Side::Sink,
                                        "writing to the sink",
                                        e.message().to_owned(),
                                    )
                                    .await
                                {
                                    Wait::Again => ReadEnd::Reopen,
                                    Wait::Stop(stop) => ReadEnd::Stop(stop),
                                    Wait::Spent(why) => ReadEnd::Sink(SinkError::new(why)),
                                };
                            }
                            Err(e) => return ReadEnd::Sink(e),
                        }
                        self.w.skipped_since_last = 0;
                    }
                    self.w.emitted += n;
                    self.w.pending += n;
                    self.w.dirty = true;
                    self.w.position = reader.position(&progress);
                    self.w.last = Some(progress);
                    if self.w.pending >= self.cadence.records
                        || self.w.last_commit.elapsed() >= self.cadence.interval
                    {
                        // Commit before going on: a lane never runs more than one commit
                        // interval ahead of its durable progress, so a store outage bounds both
                        // the replay and what a zombie (a lane that lost its split without
                        // hearing of it) emits twice.
                        if let Err(end) = self.commit().await {
                            return end;
                        }
                    }
                }
            }
        }
    }

    /// Flushes and commits what was written; `Err` ends the reading.
    async fn commit(&mut self) -> Result<(), ReadEnd> {
        match flush_and_commit(self.lane, self.out, self.retry, self.w.progress()).await {
            Ok(true) => {
                self.w.committed();
                self.w.report(self.lane);
                Ok(())
            }
            // A stop came: the next round sees it.
            Ok(false) => Ok(()),
            Err(end) => Err(ReadEnd::Commit(end)),
        }
    }

    /// On-bad-record skip: keeps `bad` in the dead-letter sink and goes on reading (`None`), or
    /// says how reading ends: the cap is passed (the split is given up), the dead-letter sink
    /// failed, or its outage was waited out (the reader is opened again, and meets the record
    /// again).
    async fn skip(&mut self, bad: BadRecord) -> Option<ReadEnd> {
        let OnBadRecord::Skip { max_per_split } = self.outputs.on_bad else { unreachable!("skipping") };
        if self.w.skipped >= max_per_split {
            let kept = if max_per_split > 0 { "; those skipped are in the dead-letter sink" } else { "" };
            return Some(ReadEnd::GiveUp(format!(
                "more than {max_per_split} bad records in one tenancy (the last at {}: {}){kept}: fix the input, \
                 then requeue the split",
                bad.position, bad.error
            )));
        }
        let letters = self.outputs.dead.as_deref().expect("checked when the pipeline started");
        match self.out.dead_letter(letters, self.info, &bad).await {
            Ok(()) => {
                self.retry.recovered(Side::Sink);
                self.w.skipped += 1;
                self.w.skipped_since_last += 1;
                self.lane.skipped();
                warn!(position = %bad.position, error = %bad.error, "bad record skipped into the dead-letter sink");
                None
            }
            Err(e) if e.is_transient() => Some(
                match self
                    .retry
                    .wait_out(
                        self.lane,
                        Side::Sink,
                        "writing to the dead-letter sink",
                        e.message().to_owned(),
                    )
                    .await
                {
                    Wait::Again => ReadEnd::Reopen,
                    Wait::Stop(stop) => ReadEnd::Stop(stop),
                    Wait::Spent(why) => ReadEnd::Sink(SinkError::new(why)),
                },
            ),
            Err(e) => Some(ReadEnd::Sink(SinkError::new(format!("dead-letter sink: {}", e.message())))),
        }
    }
}

/// A lane told to stop: a draining one commits what it wrote first (its split is released).
async fn stop_lane<R: Send + 'static, W: SinkWriter<R>>(
    mut lane: Lane,
    out: &mut LaneOutputs<R, W>,
    uncommitted: Option<Bytes>,
    stop: Stop,
) -> LaneEnd {
    if stop.reason == StopReason::Draining
        && let Some(progress) = uncommitted
    {
        drain_commit(&mut lane, out.flush(), progress, stop).await;
    }
    stop_now(lane, stop)
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

/// Why [`flush_retrying`] did not flush.
enum FlushEnd {
    /// The lane was told to stop while waiting out a transient failure.
    Stop(Stop),
    /// A permanent failure, or a transient one past the budget.
    Failed(SinkError),
}

/// Flushes the lane's writers, waiting out transient failures.
async fn flush_retrying<R: Send + 'static, W: SinkWriter<R>>(
    lane: &mut Lane,
    out: &mut LaneOutputs<R, W>,
    retry: &mut Transient,
) -> Result<(), FlushEnd> {
    loop {
        match out.flush().await {
            Ok(()) => {
                retry.recovered(Side::Sink);
                lane.flushed_at = Some(Instant::now());
                return Ok(());
            }
            Err(e) if e.is_transient() => {
                match retry.wait_out(lane, Side::Sink, "flushing the sink", e.message().to_owned()).await {
                    Wait::Again => {}
                    Wait::Stop(stop) => return Err(FlushEnd::Stop(stop)),
                    Wait::Spent(why) => return Err(FlushEnd::Failed(SinkError::new(why))),
                }
            }
            Err(e) => return Err(FlushEnd::Failed(e)),
        }
    }
}

/// Flushes the lane's writers (waiting out transient failures), then commits `progress` (never
/// ahead of the sink), trying again while the store cannot take it. `Ok(true)`: durable;
/// `Ok(false)`: a stop came while the sink or the store could not take it (the progress stays
/// uncommitted); `Err`: the lane must end.
async fn flush_and_commit<R: Send + 'static, W: SinkWriter<R>>(
    lane: &mut Lane,
    out: &mut LaneOutputs<R, W>,
    retry: &mut Transient,
    progress: Bytes,
) -> Result<bool, CommitEnd> {
    match flush_retrying(lane, out, retry).await {
        Ok(()) => {}
        Err(FlushEnd::Stop(_)) => return Ok(false),
        Err(FlushEnd::Failed(e)) => return Err(CommitEnd::Sink(e)),
    }
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
    lane.flushed_at = Some(Instant::now());
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
