//! Scale-out for broker-less sources: the one crate to depend on.
//!
//! Identical replicas of a pipeline share the work of a source that has no broker (an
//! object-store backfill, a database range scan, a file tail) through a small key-value store:
//! an elected leader plans the work as splits, workers lease them up to a fair share, dead
//! workers' splits are taken over from committed progress, every commit is fenced by an epoch
//! so a zombie never regresses progress, poison splits are quarantined, and every replica sees
//! the job complete. At-least-once, never loss.
//!
//! Implement a [`Source`] (its [`Planner`], and reading one split from its progress) and a
//! [`Sink`] (a [`SinkWriter`] per lane that writes and flushes durably); a [`Pipeline`] runs
//! the rest. This crate re-exports the pipeline API at its root (everything of
//! `etl-coordination-driver`), and the parts behind it as modules:
//!
//! | module | what | feature |
//! |---|---|---|
//! | [`core`] | the protocol as a pure state machine (drive it from a runtime of your own) | always |
//! | [`store`] | the `Store` trait a backend implements, and its conformance suite | always |
//! | [`memory`] | the in-memory store (one process; the executable specification) | always |
//! | [`metrics`] | the `etl_coordination_*` metric families; `install_prometheus` | `prometheus` for the exposition |
//! | `nats` | the NATS JetStream KV backend; [`JobStores::nats`] | `nats` |
//! | `sources` | ready-made sources: files (local, or object stores with `cloud`), SQLite | `files`, `cloud`, `sqlite` |
//! | `runner` | `runner::main`: a worker with `etl-coord worker`'s flags, signals, admin server, exit codes and logs | `runner` |
//!
//! ```
//! use etl_coordination::prelude::*;
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
//! #     async fn next(&mut self) -> NextRecord<u64, u64> { self.0 += 1; Ok((self.0 <= 10).then_some((self.0, self.0))) }
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
//! // With the `nats` feature, `JobStores::nats(&NatsConfig::new(url), &job).await?` shares the
//! // job between processes.
//! let stores = JobStores::memory(JobName::new("numbers").unwrap());
//! let outcome = Pipeline::new(stores, Numbers, Discard).run_until(std::future::pending()).await?;
//! assert_eq!(outcome, JobOutcome::Complete);
//! # Ok(()) }
//! ```

pub use etl_coordination_driver::*;
pub use {
    etl_coordination_core as core, etl_coordination_memory as memory, etl_coordination_metrics as metrics,
    etl_coordination_store as store,
};

/// The NATS JetStream KV backend (feature `nats`).
#[cfg(feature = "nats")]
pub use etl_coordination_nats as nats;

/// A worker with the command's operational behaviour (feature `runner`).
#[cfg(feature = "runner")]
pub use etl_coordination_runner as runner;

/// Ready-made sources (features `files`, `cloud`, `parquet`, `sqlite`, `postgres`).
#[cfg(any(feature = "files", feature = "sqlite", feature = "postgres"))]
pub use etl_coordination_sources as sources;
