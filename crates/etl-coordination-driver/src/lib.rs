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
//!
//! Most embedders use [`Pipeline`] instead: implement a [`Source`] (plan the work as splits,
//! read one split from its committed progress) and a [`Sink`] (a [`SinkWriter`] per lane that
//! writes, and flushes durably), and the
//! library runs the lanes (commit cadence, flush before every commit, revocation, drain,
//! failures). With the source and sink below (hidden here: `examples/custom_source.rs` in the
//! repository is a whole one), the glue is two lines; `JobStores::nats(&config, &job).await?`
//! in place of `JobStores::memory(..)` shares the job between processes (everything it names
//! is in the [`prelude`]):
//!
//! ```
//! # use etl_coordination_driver::prelude::*;
//! # #[derive(Clone)] struct Numbers;
//! # impl Planner for Numbers {
//! #     fn fingerprint(&self) -> String { "numbers/v1".into() }
//! #     async fn plan(&self) -> Result<Plan, PlanError> {
//! #         let split = |i: u64| PlannedSplit::new(SplitId::new(format!("s{i}")).unwrap(), i.to_string(), 1);
//! #         Ok(Plan::new(PlanKind::Final, (0..3).map(split).collect()))
//! #     }
//! # }
//! # struct Reader(u64);
//! # impl SplitReader for Reader {
//! #     type Record = u64; type Progress = u64;
//! #     async fn next(&mut self) -> Result<Option<(u64, u64)>, SourceError> {
//! #         self.0 += 1; Ok((self.0 <= 10).then_some((self.0, self.0)))
//! #     }
//! # }
//! # impl Source for Numbers {
//! #     type Record = u64; type Progress = u64; type Reader = Reader;
//! #     async fn open(&self, _: &LaneInfo, from: Option<u64>) -> Result<Reader, SourceError> { Ok(Reader(from.unwrap_or(0))) }
//! # }
//! # struct Discard;
//! # impl Sink<u64> for Discard {
//! #     type Writer = Discard;
//! #     async fn open(&self, _: &LaneInfo) -> Result<Discard, SinkError> { Ok(Discard) }
//! # }
//! # impl SinkWriter<u64> for Discard {
//! #     async fn write(&mut self, _: u64) -> Result<(), SinkError> { Ok(()) }
//! #     async fn flush(&mut self) -> Result<(), SinkError> { Ok(()) }
//! # }
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), DriverError> {
//! let stores = JobStores::memory(JobName::new("numbers").unwrap());
//! let outcome = Pipeline::new(stores, Numbers, Discard).run_until(std::future::pending()).await?;
//! assert_eq!(outcome, JobOutcome::Complete);
//! # Ok(()) }
//! ```

mod config;
mod contract;
mod handle;
mod lane;
mod lane_table;
mod msg;
mod outcome;
mod outputs;
mod pipeline;
mod planner;
mod report;
mod stores;
mod task;
mod transient;
mod watches;
mod work;

pub use config::{
    DEFAULT_BREAKER_THRESHOLD, DEFAULT_BREAKER_WINDOW, DEFAULT_LANE_STALL_TIMEOUT,
    DEFAULT_MAX_BAD_RECORDS_PER_SPLIT, DEFAULT_OP_TIMEOUT, DEFAULT_TRANSIENT_RETRY_BUDGET, DriverConfig,
    OnBadRecord, OnLaneStall, OnStall,
};
pub use contract::{
    BadRecord, BoxFuture, CommitCadence, DeadLetterWriter, DeadLetters, LaneInfo, NextBatch, NextRecord,
    Sink, SinkError, SinkWriter, Source, SourceError, SplitReader, is_transient_io,
};
pub use etl_coordination_core::records::MAX_DESCRIPTOR_LEN;
pub use etl_coordination_core::{
    AcquisitionReason, CommitOutcome, Epoch, InstanceId, JobName, Plan, PlanKind, PlannedSplit, SplitId,
    StopReason, Tuning,
};
pub use etl_coordination_memory::MemoryStore;
#[cfg(feature = "nats")]
pub use etl_coordination_nats::{NatsAuth, NatsConfig, NatsStore};
pub use handle::{CoordinationDriver, DriverHandle};
pub use lane::{Lane, Lanes, Stop};
pub use outcome::{DriverError, JobOutcome, JobState};
pub use pipeline::Pipeline;
pub use planner::error_chain;
pub use planner::{PlanError, Planner};
pub use stores::{AnyStore, JobStores};
pub use tokio_util::sync::CancellationToken;

/// What an embedder of a [`Pipeline`] names: `use etl_coordination_driver::prelude::*;`. Each
/// item is documented once, at the crate root.
pub mod prelude {
    pub use crate::{
        CommitCadence, DriverConfig, DriverError, JobName, JobOutcome, JobStores, LaneInfo, NextBatch,
        NextRecord, Pipeline, Plan, PlanError, PlanKind, PlannedSplit, Planner, Sink, SinkError, SinkWriter,
        Source, SourceError, SplitId, SplitReader,
    };
}
