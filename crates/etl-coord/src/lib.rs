//! `etl-coord`: the coordinated pipeline as a command: a [`Pipeline`](etl_coordination_driver::Pipeline)
//! of the sources of `etl-coordination-sources` into a JSON Lines sink, and the operator's
//! commands.
//!
//! - [`sources`]: the files and SQLite sources chosen by `--source`, and test faults.
//! - [`sink::JsonlSink`]: a JSON Lines sink, one line per emitted record.
//! - [`ops`]: `status` and `requeue` over any store.
//! - [`job`]: a job's settings in its `meta`: `max_attempts`, and moving it to this release's
//!   protocol.
//! - [`demo`]: several in-process workers on the memory store over a generated dataset.

pub mod demo;
pub mod job;
pub mod ops;
pub mod sink;
pub mod sources;
