//! Runs the etl-coordination protocol against any [`Store`] with tokio.
//!
//! [`CoordinationDriver::start`] spawns one task that owns a protocol
//! [`Worker`](etl_coordination_core::Worker): it executes the worker's store requests
//! concurrently (each with a timeout that turns into an in-doubt outcome), keeps its watches
//! open (re-opening them with backoff after any error), fires its timers, runs the
//! [`Planner`] when it leads, and hands [`Lane`]s to the embedding source through [`Lanes`].
//! The source processes each lane's split, commits progress, and finishes, fails or stops it.
//! [`DriverHandle`] drains and reports the job's outcome.
//!
//! What it does not do: read or write records (the source does), or decide anything about
//! ownership (the core does, by CAS).

mod driver;
mod lane;

pub use driver::{
    CoordinationDriver, DriverConfig, DriverError, DriverHandle, JobOutcome, JobStores, OnStall, PlanError,
    Planner,
};
pub use etl_coordination_core::{
    AcquisitionReason, CommitOutcome, Epoch, InstanceId, Plan, PlanKind, PlannedSplit, SplitId, StopReason,
};
pub use lane::{Lane, Lanes, Stop};
