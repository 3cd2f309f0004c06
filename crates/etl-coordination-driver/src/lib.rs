//! Runs the etl-coordination protocol against any [`Store`](etl_coordination_store::Store) with
//! tokio.
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

mod config;
mod handle;
mod lane;
mod outcome;
mod pipeline;
mod planner;
mod stores;
mod task;

pub use config::{DEFAULT_LANE_STALL_TIMEOUT, DriverConfig, OnLaneStall, OnStall};
pub use etl_coordination_core::{
    AcquisitionReason, CommitOutcome, Epoch, InstanceId, JobName, Plan, PlanKind, PlannedSplit, SplitId,
    StopReason, Tuning,
};
pub use handle::{CoordinationDriver, DriverHandle};
pub use lane::{Lane, Lanes, Stop};
pub use outcome::{DriverError, JobOutcome, JobState};
pub use pipeline::{
    CommitCadence, LaneInfo, NextRecord, Pipeline, Sink, SinkError, Source, SourceError, SplitReader,
};
pub use planner::{PlanError, Planner};
pub use stores::{AnyStore, JobStores};
pub use tokio_util::sync::CancellationToken;
