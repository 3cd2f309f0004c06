//! [`Lane`]: one split held by this worker, as the embedding source sees it, and the messages
//! a lane sends to the driver task ([`LaneMsg`]).

use bytes::Bytes;
use etl_coordination_core::{AcquisitionReason, CommitOutcome, DataSide, Epoch, SplitId, StopReason};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// What a lane tells the driver task; each maps to one input of the core.
#[derive(Debug)]
pub(crate) enum LaneMsg {
    /// `Input::Commit` (`finish`: `Input::Finish`), answered through `reply`. `flushed_at`,
    /// `read_at`: the lane's last flush and successful read, for the breaker's evidence
    /// (`None`: the embedder's lane does not say; then the commit is the flush).
    Commit {
        split: SplitId,
        epoch: Epoch,
        progress: Bytes,
        finish: bool,
        flushed_at: Option<Instant>,
        read_at: Option<Instant>,
        reply: oneshot::Sender<CommitOutcome>,
    },
    /// `Input::Fail`; `outage`: a transient failure of that side, waited out since then past
    /// the retry budget (the breaker weighs it).
    Fail {
        split: SplitId,
        epoch: Epoch,
        error: String,
        unprocessable: bool,
        outage: Option<(DataSide, Instant)>,
    },
    /// `Input::LaneStopped`.
    Stopped { split: SplitId, epoch: Epoch },
    /// This release cannot read the split's committed progress: the worker drains and ends
    /// with [`crate::DriverError::IncompatibleProgress`]; the lane waits for its stop.
    Incompatible { split: SplitId, epoch: Epoch, error: String },
    /// `Input::Quarantine`: the lane gives the split up.
    GiveUp { split: SplitId, epoch: Epoch, error: String },
    /// A bad record was skipped (for the metrics only).
    Skipped,
    /// Work done since the lane's last report, and where its split stands (for the work
    /// metrics and the worker's report only: `Lane::worked`).
    Worked { split: SplitId, epoch: Epoch, records: u64, position: Option<u64> },
}

/// Why and by when a lane must stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stop {
    /// Fenced (lost the split), starved (lease not renewed in time) or draining.
    pub reason: StopReason,
    /// Draining only: commit before this instant, then call [`Lane::stopped`].
    pub deadline: Option<Instant>,
}

/// A split this worker holds, handed to the source to process.
///
/// Process records from [`Lane::resume_from`], [`commit`](Lane::commit) progress as you go,
/// and end the lane with exactly one of [`finish`](Lane::finish), [`fail`](Lane::fail),
/// [`unprocessable`](Lane::unprocessable) or (after a drain stop) [`stopped`](Lane::stopped).
/// Watch [`revoked`](Lane::revoked): when it fires with `Fenced` or `Starved`, stop at once
/// (the split is no longer safely yours). Dropping a lane without ending it counts as a
/// failure (one attempt), except after a stop signal.
#[derive(Debug)]
pub struct Lane {
    pub(crate) split: SplitId,
    pub(crate) epoch: Epoch,
    pub(crate) descriptor: Bytes,
    pub(crate) weight: u64,
    pub(crate) progress: Option<Bytes>,
    pub(crate) reason: Option<AcquisitionReason>,
    pub(crate) tx: mpsc::UnboundedSender<LaneMsg>,
    pub(crate) stop: watch::Receiver<Option<Stop>>,
    pub(crate) ended: bool,
    /// The answer to a commit whose future was dropped before it came.
    pub(crate) in_flight: Option<oneshot::Receiver<CommitOutcome>>,
    /// The last successful read from the source and the last flush of the sink (the pipeline
    /// sets them).
    pub(crate) read_at: Option<Instant>,
    pub(crate) flushed_at: Option<Instant>,
    /// The outage that ends this lane: the side and when it began (the pipeline sets it
    /// when a transient failure outlives the budget).
    pub(crate) outage: Option<(DataSide, Instant)>,
}

impl Lane {
    /// A lane for a tenancy the core started, and the sender that stops it.
    pub(crate) fn new(
        split: SplitId,
        epoch: Epoch,
        descriptor: Bytes,
        weight: u64,
        progress: Option<Bytes>,
        reason: Option<AcquisitionReason>,
        tx: mpsc::UnboundedSender<LaneMsg>,
    ) -> (Lane, watch::Sender<Option<Stop>>) {
        let (stop_tx, stop) = watch::channel(None);
        let lane = Lane {
            split,
            epoch,
            descriptor,
            weight,
            progress,
            reason,
            tx,
            stop,
            ended: false,
            in_flight: None,
            read_at: None,
            flushed_at: None,
            outage: None,
        };
        (lane, stop_tx)
    }

    /// The split's id.
    pub fn split(&self) -> &SplitId {
        &self.split
    }

    /// The fencing token of this tenancy: hand it to sinks that can fence writes too.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The planner's descriptor of the split.
    pub fn descriptor(&self) -> &Bytes {
        &self.descriptor
    }

    /// The planner's weight of the split.
    pub fn weight(&self) -> u64 {
        self.weight
    }

    /// The last committed progress; `None` means start from the beginning.
    pub fn resume_from(&self) -> Option<&Bytes> {
        self.progress.as_ref()
    }

    /// Why this worker acquired the split; `None` when a starved lane resumes.
    pub fn reason(&self) -> Option<AcquisitionReason> {
        self.reason
    }

    /// The stop signal, if one was given.
    pub fn stop_requested(&self) -> Option<Stop> {
        *self.stop.borrow()
    }

    /// Resolves when the lane must stop.
    pub async fn revoked(&mut self) -> Stop {
        loop {
            if let Some(stop) = *self.stop.borrow_and_update() {
                return stop;
            }
            if self.stop.changed().await.is_err() {
                // The driver is gone: nothing is fenced any more.
                return Stop { reason: StopReason::Fenced, deadline: None };
            }
        }
    }

    /// Sends a commit or finish and waits for its answer. One commit per lane is in flight at a
    /// time: if an earlier commit's future was dropped before its answer came, that answer is
    /// awaited first (the core answers a second concurrent commit `Retryable`, and the answer
    /// could not be told apart from the first's).
    async fn request(
        &mut self,
        make: impl FnOnce(SplitId, Epoch, oneshot::Sender<CommitOutcome>) -> LaneMsg,
    ) -> CommitOutcome {
        if let Some(earlier) = self.in_flight.take() {
            let _ = earlier.await;
        }
        let (tx, rx) = oneshot::channel();
        if self.tx.send(make(self.split.clone(), self.epoch, tx)).is_err() {
            return CommitOutcome::Lost;
        }
        let answer = self.in_flight.insert(rx);
        let outcome = answer.await.unwrap_or(CommitOutcome::Lost);
        self.in_flight = None;
        outcome
    }

    /// Sends a commit (or the finishing one) with the times the breaker weighs.
    async fn send_commit(&mut self, progress: Bytes, finish: bool) -> CommitOutcome {
        let (read_at, flushed_at) = (self.read_at, self.flushed_at);
        self.request(|split, epoch, reply| LaneMsg::Commit {
            split,
            epoch,
            progress,
            finish,
            flushed_at,
            read_at,
            reply,
        })
        .await
    }

    /// Commits progress (P8): `Ok` once durable, `Lost` if the split is no longer ours (stop
    /// at once; nothing was written), `Retryable` if nothing was written for now (store
    /// unavailable): keep the progress and commit again later.
    pub async fn commit(&mut self, progress: Bytes) -> CommitOutcome {
        let outcome = self.send_commit(progress, false).await;
        if outcome == CommitOutcome::Lost {
            self.ended = true;
        }
        outcome
    }

    /// Commits the final progress and marks the split Done. On `Retryable`, the lane is handed
    /// back so the source can try again.
    pub async fn finish(mut self, progress: Bytes) -> Result<(), (Lane, CommitOutcome)> {
        let outcome = self.send_commit(progress, true).await;
        match outcome {
            CommitOutcome::Ok => {
                self.ended = true;
                Ok(())
            }
            CommitOutcome::Lost => {
                self.ended = true;
                Err((self, outcome))
            }
            CommitOutcome::Retryable => Err((self, outcome)),
        }
    }

    /// Reports that processing the split failed; consumes one attempt (P12).
    pub fn fail(mut self, error: impl Into<String>) {
        self.end_with_failure(error.into(), false);
    }

    /// Reports that the split can never be processed; consumes one attempt (P12).
    pub fn unprocessable(mut self, reason: impl Into<String>) {
        self.end_with_failure(reason.into(), true);
    }

    /// Gives the split up for good: it is quarantined at once, whatever this tenancy committed,
    /// its progress kept for a requeue (P12).
    pub fn give_up(mut self, error: impl Into<String>) {
        self.ended = true;
        let _ = self.tx.send(LaneMsg::GiveUp {
            split: self.split.clone(),
            epoch: self.epoch,
            error: error.into(),
        });
    }

    /// Reports work the lane made durable since its last report: `records` written and
    /// committed, and `position`, how much of the split lies before its committed progress in
    /// the unit of its [weight](Lane::weight) (`None`: the source cannot say). For the work
    /// metrics and `etl-coord status` (progress by work, rates, the ETA), never for the
    /// protocol: call it after a commit returns `Ok`, and before finishing (the rest of the
    /// split's weight is counted when the finish lands). The pipeline does; a lane driven by an
    /// embedder's own loop that never calls it is counted when its split finishes.
    pub fn worked(&self, records: u64, position: Option<u64>) {
        let _ =
            self.tx.send(LaneMsg::Worked { split: self.split.clone(), epoch: self.epoch, records, position });
    }

    /// Counts a bad record skipped (`etl_coordination_records_skipped_total`).
    pub(crate) fn skipped(&self) {
        let _ = self.tx.send(LaneMsg::Skipped);
    }

    fn end_with_failure(&mut self, error: String, unprocessable: bool) {
        self.ended = true;
        let _ = self.tx.send(LaneMsg::Fail {
            split: self.split.clone(),
            epoch: self.epoch,
            error,
            unprocessable,
            outage: if unprocessable { None } else { self.outage.take() },
        });
    }

    /// Reports that this release cannot read the split's committed progress (written by
    /// another release of the source): a release incompatibility, not a fault of the data. The
    /// split is charged nothing: the whole worker drains (every lane commits and releases its
    /// split, this one without committing) and ends with
    /// [`DriverError::IncompatibleProgress`](crate::DriverError::IncompatibleProgress), so that a
    /// rolling update of such a release stops at its first pod instead of burning the split's
    /// attempts. Resolves once the lane has stopped.
    pub async fn incompatible_progress(mut self, error: impl Into<String>) {
        let msg = LaneMsg::Incompatible { split: self.split.clone(), epoch: self.epoch, error: error.into() };
        if self.tx.send(msg).is_err() {
            self.ended = true;
            return;
        }
        // Dropped after the stop: a drain stop acknowledges (releases), any other ends quietly.
        self.revoked().await;
    }

    /// Acknowledges a stop (after the final commit when draining): the split is released.
    pub fn stopped(mut self) {
        self.ended = true;
        let _ = self.tx.send(LaneMsg::Stopped { split: self.split.clone(), epoch: self.epoch });
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        match *self.stop.borrow() {
            Some(Stop { reason: StopReason::Draining, .. }) => {
                let _ = self.tx.send(LaneMsg::Stopped { split: self.split.clone(), epoch: self.epoch });
            }
            Some(_) => {}
            None => {
                let _ = self.tx.send(LaneMsg::Fail {
                    split: self.split.clone(),
                    epoch: self.epoch,
                    error: "the source dropped the lane without finishing, failing or stopping it".into(),
                    unprocessable: false,
                    outage: None,
                });
            }
        }
    }
}

/// The lanes this worker is given, in order of acquisition.
#[derive(Debug)]
pub struct Lanes {
    pub(crate) rx: mpsc::UnboundedReceiver<Lane>,
}

impl Lanes {
    /// The next lane; `None` once the driver has stopped.
    pub async fn next(&mut self) -> Option<Lane> {
        self.rx.recv().await
    }
}

/// The lanes as a stream (`futures::StreamExt` and friends work on it).
impl futures_core::Stream for Lanes {
    type Item = Lane;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Lane>> {
        self.rx.poll_recv(cx)
    }
}
