//! How a job ends for one worker: [`JobOutcome`], or a [`DriverError`].

use etl_coordination_core::{ConfigError, FatalError, SplitId};

/// How the job ended for this worker.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobOutcome {
    /// Every split is Done.
    Complete,
    /// Some splits are quarantined (with [`OnStall::Warn`](crate::OnStall::Warn)).
    Stalled {
        /// Quarantined splits and their last errors.
        quarantined: Vec<(SplitId, Option<String>)>,
    },
    /// This worker left on request before the job ended.
    Drained,
}

/// The job as this worker sees it ([`DriverHandle::job_state`](crate::DriverHandle::job_state)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobState {
    /// Starting, or splits remain to be processed.
    Running,
    /// Running, but records keep the job from completing: values this worker cannot decode in
    /// the state bucket (another program or release wrote there), or split records that are
    /// missing. `etl-coord status` names them; `etl-coord requeue --reset` rewrites a split.
    Blocked {
        /// State-bucket keys whose value cannot be decoded.
        undecodable: u32,
        /// Splits of the plan without a record.
        missing: u32,
    },
    /// Every split is Done.
    Complete,
    /// Every split is Done or quarantined, some quarantined.
    Stalled {
        /// Quarantined splits and their last errors.
        quarantined: Vec<(SplitId, Option<String>)>,
    },
}

/// Why the driver could not run or finish.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// A configuration value is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The protocol stopped with a fatal condition (divergence, duplicate id, store setup).
    #[error(transparent)]
    Fatal(#[from] FatalError),
    /// The job stalled on quarantined splits ([`OnStall::Fatal`](crate::OnStall::Fatal)).
    #[error("the job stalled: {} split(s) quarantined after max_attempts failing tenancies: {}; fix the cause, then requeue them", quarantined.len(), describe(quarantined))]
    Stalled {
        /// Quarantined splits and their last errors.
        quarantined: Vec<(SplitId, Option<String>)>,
    },
    /// A split's committed progress does not decode as this source's progress: it was written
    /// by a release of the source whose progress this one cannot read. The worker drained
    /// (nothing charged to the split); the release that wrote it still can resume it.
    #[error(
        "split {split}: its committed progress cannot be read by this release ({error}); it was \
         written by another release of the source: roll back to the release that wrote it (a \
         release must read its predecessor's progress; docs/UPGRADES.md), or, if no release can \
         read it, start the split over with `etl-coord requeue --reset --split {split}`. Nothing \
         was charged to the split and this worker drained"
    )]
    IncompatibleProgress {
        /// The split.
        split: SplitId,
        /// Why its progress does not decode.
        error: String,
    },
    /// The worker was killed on request ([`DriverHandle::kill`](crate::DriverHandle::kill)).
    #[error("killed")]
    Killed,
    /// The driver task ended without an outcome (it panicked or the runtime shut down).
    #[error("the coordination driver stopped without an outcome")]
    Gone,
}

/// `id (last error), ...` for logs and errors.
pub(crate) fn describe(q: &[(SplitId, Option<String>)]) -> String {
    q.iter()
        .map(|(id, e)| format!("{id} ({})", e.as_deref().unwrap_or("no error recorded")))
        .collect::<Vec<_>>()
        .join(", ")
}
