//! What the tasks the driver task spawns report back to it.

use etl_coordination_core::{OpId, Plan, StoreResult, WatchEvent, WatchId};

/// Reports of the tasks the driver task spawned.
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
    /// The worker's report was written (or not): `crate::work`.
    Reported(StoreResult),
}
