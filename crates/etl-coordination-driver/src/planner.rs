//! [`Planner`]: the source's enumeration of its work, run only on the leader (P4).

use std::future::Future;

use etl_coordination_core::{Plan, SplitId};

/// Enumerates a source's work as splits. Runs only on the fleet's leader (P4).
pub trait Planner: Send + Sync + 'static {
    /// Identifies the planner and its configuration (source kind, input location, split
    /// sizing): every replica of a job must report the same value, or it is refused at startup
    /// with both fingerprints in the error (P2).
    fn fingerprint(&self) -> String;

    /// Lists the work. Split ids must be deterministic (re-planning the same input yields the
    /// same ids) and unique.
    fn plan(&self) -> impl Future<Output = Result<Plan, PlanError>> + Send;

    /// Lists the work knowing which splits the published plan already has (an open plan's
    /// earlier rounds; empty for the first). What the driver calls; by default [`Planner::plan`].
    /// A planner of a growing input can start where the published splits end (their ids can
    /// carry what it needs, e.g. a range's bounds), instead of enumerating everything again.
    fn replan(&self, published: &[SplitId]) -> impl Future<Output = Result<Plan, PlanError>> + Send {
        let _ = published;
        self.plan()
    }
}

/// A planner failure; the leader retries after a heartbeat interval.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);
