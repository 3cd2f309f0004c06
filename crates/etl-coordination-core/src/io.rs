//! What goes into the core ([`Input`]) and what comes out ([`Action`]). Reading [`Action`] tells
//! every side effect the protocol can cause.

use bytes::Bytes;

use crate::ids::{Epoch, InstanceId, OpId, SplitId};
use crate::plan::Plan;
use crate::store::{Bucket, Prefix, StoreRequest, StoreResult, WatchEvent};
use crate::time::Timestamp;

/// The watches a worker keeps open.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[non_exhaustive]
pub enum WatchId {
    /// Lease bucket, every key: leader, presence, split leases.
    Leases,
    /// State bucket, `plan.`: the plan head.
    Plan,
    /// State bucket, `split.`: split records.
    Splits,
}

impl WatchId {
    /// All watches, in the order they are opened.
    pub const ALL: [WatchId; 3] = [WatchId::Leases, WatchId::Plan, WatchId::Splits];

    /// The bucket this watch reads.
    pub fn bucket(self) -> Bucket {
        match self {
            WatchId::Leases => Bucket::Lease,
            WatchId::Plan | WatchId::Splits => Bucket::State,
        }
    }

    /// The prefix this watch reads.
    pub fn prefix(self) -> Prefix {
        match self {
            WatchId::Leases => Prefix::all(),
            WatchId::Plan => crate::records::keys::plan_prefix(),
            WatchId::Splits => crate::records::keys::split_prefix(),
        }
    }
}

/// Inputs to [`crate::Worker::handle`].
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Input {
    /// Begin startup (P2, P3).
    Start,
    /// A deadline from [`crate::Worker::next_deadline`] passed (extra ticks are harmless).
    Tick,
    /// The result of an [`Action::Store`].
    StoreResult {
        /// The op id from the action.
        op: OpId,
        /// Its result.
        result: StoreResult,
    },
    /// An event of a watch opened by [`Action::Watch`].
    Watch {
        /// Which watch.
        watch: WatchId,
        /// The event.
        event: WatchEvent,
    },
    /// A watch failed; the embedding layer must not poll it again. The core re-opens it with
    /// a new [`Action::Watch`] and resyncs from its snapshot.
    WatchFailed {
        /// Which watch.
        watch: WatchId,
    },
    /// The planner's answer to [`Action::Plan`].
    PlanReady {
        /// The request id from the action.
        request: u64,
        /// The plan, or the planner's error message.
        result: Result<Plan, String>,
    },
    /// A lane asks to commit progress (P8). Answered by [`Action::CommitDone`].
    Commit {
        /// The split.
        split: SplitId,
        /// The lane's epoch (commits from an older lane of the same split are refused).
        epoch: Epoch,
        /// Progress to record.
        progress: Bytes,
    },
    /// A lane reached the end of its split: terminal commit (P8). Answered by
    /// [`Action::CommitDone`].
    Finish {
        /// The split.
        split: SplitId,
        /// The lane's epoch.
        epoch: Epoch,
        /// Final progress.
        progress: Bytes,
    },
    /// A lane reports its split failed or unprocessable; consumes one attempt (P12).
    Fail {
        /// The split.
        split: SplitId,
        /// The lane's epoch.
        epoch: Epoch,
        /// Error to record as the split's last error.
        error: String,
        /// `true` if the source says the split can never be processed.
        unprocessable: bool,
    },
    /// A lane gives up on its split for good (P12): the split is quarantined now, its
    /// remaining attempts spent at once, whatever the tenancy committed (the embedding layer's
    /// cap on bad records skipped in one tenancy). Its progress is kept for a requeue.
    Quarantine {
        /// The split.
        split: SplitId,
        /// The lane's epoch.
        epoch: Epoch,
        /// Error to record as the split's last error.
        error: String,
    },
    /// A lane's tenancy ends without blame (P10, P12): the split is released as by a drain,
    /// no attempt consumed (the embedding layer's breaker: the failure was the worker's or
    /// its sink's, not the split's). The lane has stopped.
    Release {
        /// The split.
        split: SplitId,
        /// The lane's epoch.
        epoch: Epoch,
    },
    /// Caps how many splits this worker holds: it claims (and steals) no more than `limit`
    /// splits in all; `None` lifts the cap. Splits already held are kept. The embedding
    /// layer's breaker pauses intake with it (`Some(0)`, or one more than it holds to probe).
    Intake {
        /// The most splits to hold.
        limit: Option<u32>,
    },
    /// A lane acknowledged an [`Action::StopLane`] (after its last commit).
    LaneStopped {
        /// The split.
        split: SplitId,
        /// The lane's epoch.
        epoch: Epoch,
    },
    /// Graceful shutdown (P10): commit, release, leave.
    Drain,
}

/// How a cooperative steal ended (P9; the `outcome` label of `steals_total`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[non_exhaustive]
pub enum HandoverOutcome {
    /// The owner committed and released the split; the thief claimed it: nothing is read twice.
    HandedOver,
    /// The owner did not release it by the deadline: the thief took it over (the owner's
    /// uncommitted tail is read again).
    Forced,
    /// The thief withdrew: the move no longer helped, or the split was gone.
    Withdrawn,
    /// The owner refused (by its own load the move would not help, or the tenancy asked for is
    /// over, or the thief is not live).
    Refused,
}

impl HandoverOutcome {
    /// Every outcome, in the order of the metric's label values.
    pub const ALL: [HandoverOutcome; 4] = [Self::HandedOver, Self::Forced, Self::Withdrawn, Self::Refused];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::HandedOver => "handed_over",
            Self::Forced => "forced",
            Self::Withdrawn => "withdrawn",
            Self::Refused => "refused",
        }
    }
}

/// Why a worker acquired a split (P6; the `reason` label of `acquisitions_total`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[non_exhaustive]
pub enum AcquisitionReason {
    /// First tenancy.
    Create,
    /// The previous owner released it gracefully (or reported it failed).
    Released,
    /// The previous owner's lease expired.
    Expired,
    /// Same instance id, new incarnation (P3).
    Reclaimed,
    /// Taken from the most-loaded peer (P9).
    Stolen,
}

impl AcquisitionReason {
    /// Every reason, in the order of the metric's label values.
    pub const ALL: [AcquisitionReason; 5] =
        [Self::Create, Self::Released, Self::Expired, Self::Reclaimed, Self::Stolen];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Released => "released",
            Self::Expired => "expired",
            Self::Reclaimed => "reclaimed",
            Self::Stolen => "stolen",
        }
    }
}

/// Why a lane must stop.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum StopReason {
    /// The lease or record moved to someone else (renewal lost, watch showed it, commit lost).
    Fenced,
    /// No successful renewal for a lease duration (P11); the lane may be restarted if the lease
    /// turns out to be still ours.
    Starved,
    /// The worker is draining: commit, then acknowledge with [`Input::LaneStopped`].
    Draining,
}

impl StopReason {
    /// Every reason.
    pub const ALL: [StopReason; 3] = [Self::Fenced, Self::Starved, Self::Draining];

    /// The `reason` label of `revocations_total`, for revocations.
    pub fn revocation_label(self) -> Option<&'static str> {
        match self {
            Self::Fenced => Some("fenced"),
            Self::Starved => Some("starved"),
            Self::Draining => None,
        }
    }
}

/// The answer to a lane's commit or finish.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CommitOutcome {
    /// Durable.
    Ok,
    /// The split is no longer ours: nothing was written; the lane must stop.
    Lost,
    /// Nothing was written (store unavailable); try again later.
    Retryable,
}

/// How a job ended for this worker.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// A Final plan with every split Done (P13).
    Complete,
    /// Every split Done or Quarantined, at least one Quarantined (P13).
    Stalled {
        /// The quarantined splits with their last errors.
        quarantined: Vec<(SplitId, Option<String>)>,
    },
    /// Left on request (drain) before the job ended.
    Drained,
}

/// A condition the worker cannot continue from; the message says what to do.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FatalError {
    /// P2: `meta` names another planner fingerprint than this worker's.
    #[error(
        "configuration divergence: the job was created with {stored}, this worker has {local}; \
             every replica of a job must run the same planner (or use another job name)"
    )]
    ConfigDivergence {
        /// What `meta` holds.
        stored: String,
        /// What this worker has.
        local: String,
    },
    /// P2: `meta` names another protocol version than this release's.
    #[error("{}", protocol_advice(*.stored, *.local))]
    ProtocolMismatch {
        /// The job's protocol version (in `meta`).
        stored: u32,
        /// This release's ([`crate::records::PROTOCOL_VERSION`]).
        local: u32,
    },
    /// P3: another live process uses this instance id.
    #[error(
        "duplicate instance id {instance}: another live process (incarnation {other:x}) holds it; \
             give every replica a unique instance id (e.g. the pod name)"
    )]
    DuplicateInstance {
        /// The shared id.
        instance: String,
        /// The other process's incarnation.
        other: u64,
    },
    /// A store error that needs operator action.
    #[error("store: {0}")]
    Store(String),
    /// `meta` exists but cannot be decoded.
    #[error("unreadable meta record: {0}; the job was written by an incompatible release")]
    CorruptMeta(String),
}

/// Things that happened, for metrics and logs (the core never touches either).
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Event {
    /// A split was acquired (P6).
    Acquired {
        /// The split.
        split: SplitId,
        /// Why.
        reason: AcquisitionReason,
        /// The new epoch.
        epoch: Epoch,
    },
    /// This worker starts a steal (P9): at most one per heartbeat cycle.
    Steal {
        /// The split it takes.
        split: SplitId,
        /// The peer holding it.
        victim: InstanceId,
        /// The split's planned weight.
        weight: u64,
        /// The victim's load and the thief's, as the thief's view shows them (P9).
        loads: (u128, u128),
    },
    /// A steal this worker asked for (P9) ended: the split was handed over, taken over at the
    /// deadline, or the request was withdrawn or refused.
    Handover {
        /// The split asked for.
        split: SplitId,
        /// Its owner.
        victim: InstanceId,
        /// The owner's tenancy asked to end.
        from: Epoch,
        /// This worker's tenancy, when it got the split.
        to: Option<Epoch>,
        /// How it ended.
        outcome: HandoverOutcome,
    },
    /// A peer asked this worker for a split (P9): `honoured`, its lane stops at a safe point,
    /// commits and the split is released to the peer; else the request was refused (the split
    /// is no longer this tenancy's, or the move would not lower the imbalance).
    StealAsked {
        /// The split.
        split: SplitId,
        /// The peer asking.
        thief: InstanceId,
        /// Whether the split is being handed over.
        honoured: bool,
    },
    /// A lane was revoked (fenced or starved).
    Revoked {
        /// The split.
        split: SplitId,
        /// Why.
        reason: StopReason,
    },
    /// This worker gained or lost leadership.
    Leadership {
        /// Whether it now leads.
        leader: bool,
        /// The term.
        term: u64,
    },
    /// A plan was published by this worker.
    PlanPublished {
        /// Term.
        term: u64,
        /// Version.
        version: u64,
        /// Splits in the manifest.
        splits: u64,
    },
    /// The planner failed; it will be retried.
    PlanFailed {
        /// The planner's error.
        error: String,
    },
    /// A split was quarantined by this worker (P12).
    Quarantined {
        /// The split.
        split: SplitId,
        /// Attempts consumed.
        attempts: u32,
        /// The last error.
        last_error: Option<String>,
    },
    /// A tenancy of this worker failed and its split went back to the queue (P12); it is claimed
    /// again once its backoff has passed.
    Failed {
        /// The split.
        split: SplitId,
        /// Attempts charged so far (the split is quarantined at `max_attempts`).
        attempts: u32,
        /// The error recorded.
        error: Option<String>,
        /// How long every worker waits, from when it sees the failure, before claiming it.
        retry_in: std::time::Duration,
    },
    /// A split was released gracefully.
    Released {
        /// The split.
        split: SplitId,
    },
    /// A split's terminal commit landed.
    Finished {
        /// The split.
        split: SplitId,
    },
    /// Gauges changed.
    Gauges {
        /// Splits this worker holds.
        owned: u32,
        /// Live workers in the fleet view.
        live_workers: u32,
        /// The published manifest's splits by state, as this worker's view has them.
        splits: SplitCounts,
        /// Keys of the state bucket whose current value this worker cannot decode: a split
        /// record, the plan head or a manifest chunk so written keeps the job from completing
        /// until it is rewritten (`etl-coord requeue --reset` for a split record).
        undecodable_state: u32,
        /// Keys of the lease bucket whose current value this worker cannot decode (a lease, a
        /// presence, the leader key): gone when it expires or is deleted.
        undecodable_lease: u32,
    },
    /// A value could not be decoded: the worker ignores it (a split record so read can be
    /// neither claimed nor completed). Reported once per key and value.
    Undecodable {
        /// The key.
        key: String,
        /// The decoder's message.
        error: String,
    },
    /// The job ended (P13) and this worker stays ([`crate::Config::stay_after_end`]): it
    /// keeps its presence and watches and takes up splits that come back (an operator's
    /// requeue). Reported again if the outcome changes.
    JobEnded {
        /// Complete or Stalled.
        outcome: Outcome,
    },
    /// After [`Event::JobEnded`]: a split is no longer terminal (requeued or reset), so the job
    /// runs again.
    JobReopened,
    /// The `max_attempts` in effect changed: at join, to the job's value where it differs from
    /// this worker's configuration; later, to a value an operator set (`etl-coord job
    /// set-max-attempts`). It is a setting of the job; the flag only seeds a new job.
    JobMaxAttempts {
        /// The job's value, in effect.
        job: u32,
        /// This worker's configured value, ignored.
        configured: u32,
    },
}

/// The splits of the published manifest by the state of their records, as one worker's view
/// has them (the `etl_coordination_splits{state}` gauge).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub struct SplitCounts {
    /// Waiting for an owner.
    pub unleased: u32,
    /// Recorded as owned (the owner may be dead and its lease expiring).
    pub owned: u32,
    /// Done.
    pub done: u32,
    /// Quarantined after `max_attempts` failing tenancies.
    pub quarantined: u32,
    /// Whose record cannot be decoded.
    pub undecodable: u32,
    /// Listed by the manifest but without a record in the view (deleted by hand, or not seen
    /// yet): neither claimable nor terminal.
    pub missing: u32,
    /// The planned weight of the manifest's splits (the `etl_coordination_work_planned` gauge).
    pub weight_planned: u64,
    /// The planned weight of its Done splits (`etl_coordination_work_done`).
    pub weight_done: u64,
}

fn protocol_advice(stored: u32, local: u32) -> String {
    if stored < local {
        format!(
            "protocol mismatch: the job runs protocol {stored}, this release runs protocol {local}; \
             finish the job or stop every worker of the release that runs it (drain), then move it \
             with `etl-coord job migrate` of this release (docs/UPGRADES.md)"
        )
    } else {
        format!(
            "protocol mismatch: the job runs protocol {stored}, this release runs protocol {local} \
             (older); the job was moved to a newer protocol: run the release that moved it"
        )
    }
}

/// Outputs of [`crate::Worker::handle`].
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Action {
    /// Execute one store primitive and feed its result back as [`Input::StoreResult`]
    /// with the same op id. Requests may run concurrently; results may come back in any order.
    Store {
        /// Tag for the result.
        op: OpId,
        /// Which bucket.
        bucket: Bucket,
        /// The primitive.
        request: StoreRequest,
    },
    /// Open (or re-open, replacing the old one) a prefix watch; feed its events as
    /// [`Input::Watch`] and its failure as [`Input::WatchFailed`].
    Watch {
        /// Which watch (determines bucket and prefix).
        watch: WatchId,
    },
    /// Run the planner and answer with [`Input::PlanReady`] (only the leader asks, P4).
    Plan {
        /// Tag for the answer.
        request: u64,
    },
    /// Materialize a lane for a split this worker now holds.
    StartLane {
        /// The split.
        split: SplitId,
        /// The fencing token for this tenancy.
        epoch: Epoch,
        /// The planner's descriptor.
        descriptor: Bytes,
        /// The planner's weight.
        weight: u64,
        /// Resume from this committed progress (`None`: from the start).
        progress: Option<Bytes>,
        /// Why it was acquired; `None` when a starved lane resumes its own lease.
        reason: Option<AcquisitionReason>,
    },
    /// Stop a lane. For [`StopReason::Draining`] the lane may commit until `deadline` and then
    /// acknowledges with [`Input::LaneStopped`]; otherwise it stops at once without committing.
    StopLane {
        /// The split.
        split: SplitId,
        /// The lane's epoch.
        epoch: Epoch,
        /// Why.
        reason: StopReason,
        /// Drain deadline.
        deadline: Option<Timestamp>,
    },
    /// The answer to [`Input::Commit`] or [`Input::Finish`].
    CommitDone {
        /// The split.
        split: SplitId,
        /// The lane's epoch.
        epoch: Epoch,
        /// The outcome.
        outcome: CommitOutcome,
    },
    /// Something happened (metrics, logs).
    Event(Event),
    /// The worker is done: every key it owned is released or deleted. No further actions follow.
    Finished(Outcome),
    /// The worker cannot continue. No further actions follow.
    Fatal(FatalError),
}
