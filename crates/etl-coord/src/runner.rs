//! The lane loop every source reuses: read records from where the split's committed progress
//! says, emit them to the sink, commit progress every few records (flushing the sink first),
//! obey stop signals, and finish, fail or stop the lane.

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use etl_coordination_driver::{CommitOutcome, Lane, StopReason};
use tracing::{debug, warn};

use crate::sink::{JsonlSink, SinkLine};

/// One record read from a split.
#[derive(Clone, Debug)]
pub struct Record {
    /// Unique key within the whole input.
    pub key: String,
    /// The record's content (a line, a row rendered as text).
    pub content: String,
    /// The split's progress once this record is emitted.
    pub progress: Bytes,
}

/// Reads one split from its committed progress.
pub trait SplitReader: Send {
    /// The next record, or `None` at the end of the split.
    fn next(&mut self) -> impl Future<Output = anyhow::Result<Option<Record>>> + Send;
    /// The progress that marks the split finished.
    fn final_progress(&self) -> Bytes;
}

/// Behaviour of the lane loop, including the fault options used by tests.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// This worker's instance id (written to the sink).
    pub instance: String,
    /// Commit after this many records...
    pub commit_every: u64,
    /// ...or after this long, whichever comes first.
    pub commit_interval: Duration,
    /// Sleep per record (tests and demos).
    pub record_delay: Duration,
    /// Reaching a record containing this text aborts the process, like a crash.
    pub poison_marker: Option<String>,
    /// Reaching a record containing this text reports the split unprocessable.
    pub unprocessable_marker: Option<String>,
    /// Reading a record containing this text never returns, like a read on a connection that
    /// never answers: only a stop signal ends the lane.
    pub hang_marker: Option<String>,
    /// Incremented per emitted record (progress displays).
    pub counter: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            instance: String::new(),
            commit_every: 500,
            commit_interval: Duration::from_secs(1),
            record_delay: Duration::ZERO,
            poison_marker: None,
            unprocessable_marker: None,
            hang_marker: None,
            counter: None,
        }
    }
}

/// How a lane ended, for the caller's bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneEnd {
    /// The split is Done.
    Finished,
    /// Stopped on a drain after the final commit.
    Stopped,
    /// Lost or starved: stopped at once.
    Revoked,
    /// Reported failed or unprocessable.
    Failed,
}

/// Runs one lane to its end, inside a `lane` span carrying the split and the epoch (so every
/// line a lane logs says which tenancy it is about). Returns the number of records emitted and
/// how it ended.
pub async fn run_lane<R: SplitReader>(
    lane: Lane,
    reader: R,
    sink: JsonlSink,
    opts: RunOptions,
) -> (u64, LaneEnd) {
    use tracing::Instrument;
    let span = tracing::info_span!("lane", split = %lane.split(), epoch = lane.epoch().0);
    let (emitted, end) = lane_loop(lane, reader, sink, opts).instrument(span.clone()).await;
    span.in_scope(|| tracing::info!(emitted, end = ?end, "lane ended"));
    (emitted, end)
}

async fn lane_loop<R: SplitReader>(
    mut lane: Lane,
    mut reader: R,
    sink: JsonlSink,
    opts: RunOptions,
) -> (u64, LaneEnd) {
    let split = lane.split().to_string();
    let epoch = lane.epoch().0;
    let mut emitted = 0u64;
    let mut uncommitted: Option<Bytes> = None;
    let mut since = 0u64;
    let mut last_commit = Instant::now();
    loop {
        if let Some(stop) = lane.stop_requested() {
            if stop.reason != StopReason::Draining {
                debug!(%split, ?stop, "lane revoked");
                return (emitted, LaneEnd::Revoked);
            }
            if let Some(p) = uncommitted.take() {
                // Never commit ahead of the sink: if it cannot flush, the tail stays uncommitted
                // and replays.
                match sink.flush() {
                    Ok(()) => {
                        let _ = lane.commit(p).await;
                    }
                    Err(e) => {
                        warn!(%split, error = %e, "the sink failed to flush while draining; the uncommitted tail replays")
                    }
                }
            }
            lane.stopped();
            return (emitted, LaneEnd::Stopped);
        }
        // A read that never answers (a hung connection) must not outlive a stop signal: the
        // lane stall check may have released the split, or the worker be draining.
        let next = async {
            let r = reader.next().await;
            if let (Some(m), Ok(Some(rec))) = (&opts.hang_marker, &r)
                && rec.content.contains(m.as_str())
            {
                debug!(%split, record = %rec.key, "the read hangs on this record (test fault)");
                std::future::pending::<()>().await;
            }
            r
        };
        let read = tokio::select! {
            r = next => r,
            _ = lane.revoked() => continue,
        };
        let record = match read {
            Ok(r) => r,
            Err(e) => {
                warn!(%split, error = %e, "reading the split failed");
                lane.fail(format!("{e:#}"));
                return (emitted, LaneEnd::Failed);
            }
        };
        let Some(record) = record else {
            if let Err(e) = sink.flush() {
                lane.fail(format!("sink: {e}"));
                return (emitted, LaneEnd::Failed);
            }
            let mut lane_opt = Some(lane);
            let mut delays = retry_delays();
            loop {
                let l = lane_opt.take().expect("lane");
                match l.finish(reader.final_progress()).await {
                    Ok(()) => return (emitted, LaneEnd::Finished),
                    Err((_, CommitOutcome::Lost)) => return (emitted, LaneEnd::Revoked),
                    Err((l, _)) => {
                        if l.stop_requested().is_some_and(|s| s.reason != StopReason::Draining) {
                            return (emitted, LaneEnd::Revoked);
                        }
                        lane_opt = Some(l);
                        tokio::time::sleep(delays.next().unwrap_or(MAX_RETRY_DELAY)).await;
                    }
                }
            }
        };
        if opts.poison_marker.as_deref().is_some_and(|m| record.content.contains(m)) {
            // Like a crash: no commit, no release. The lease expires and a peer retries.
            eprintln!("poison record {} reached: aborting the process", record.key);
            std::process::abort();
        }
        if opts.unprocessable_marker.as_deref().is_some_and(|m| record.content.contains(m)) {
            lane.unprocessable(format!("record {} cannot be processed", record.key));
            return (emitted, LaneEnd::Failed);
        }
        if !opts.record_delay.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(opts.record_delay) => {}
                _ = lane.revoked() => continue,
            }
        }
        let line = SinkLine {
            split: split.clone(),
            record: record.key,
            epoch,
            instance: opts.instance.clone(),
            at_ms: crate::sink::unix_ms(),
        };
        if let Err(e) = sink.write(&line) {
            lane.fail(format!("sink: {e}"));
            return (emitted, LaneEnd::Failed);
        }
        emitted += 1;
        since += 1;
        if let Some(c) = &opts.counter {
            c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        uncommitted = Some(record.progress);
        if since >= opts.commit_every || last_commit.elapsed() >= opts.commit_interval {
            if let Err(e) = sink.flush() {
                lane.fail(format!("sink: {e}"));
                return (emitted, LaneEnd::Failed);
            }
            // Commit before going on: a lane never runs more than one commit interval ahead of
            // its durable progress, so a store outage bounds both the replay and what a zombie
            // (a lane that lost its split without hearing of it) emits twice.
            let mut delays = retry_delays();
            loop {
                let p = uncommitted.clone().expect("progress");
                match lane.commit(p).await {
                    CommitOutcome::Ok => {
                        uncommitted = None;
                        since = 0;
                        last_commit = Instant::now();
                        break;
                    }
                    CommitOutcome::Lost => return (emitted, LaneEnd::Revoked),
                    CommitOutcome::Retryable => {
                        tokio::select! {
                            () = tokio::time::sleep(delays.next().unwrap_or(MAX_RETRY_DELAY)) => {}
                            _ = lane.revoked() => break,
                        }
                    }
                }
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
