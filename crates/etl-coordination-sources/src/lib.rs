//! Coordinated sources for etl-coordination, ready to run in a
//! [`Pipeline`](etl_coordination_driver::Pipeline) (and templates for sources of your own).
//!
//! - [`files`] (feature `files`): the lines of the objects under a location: a local directory,
//!   or `s3://`, `gs://`, `az://` URLs (feature `cloud`). As a bounded backfill, objects are
//!   bin-packed by bytes into splits; in follow mode ([`files::FilesSource::follow`]), every
//!   object is a split of its own and new objects are picked up at every re-plan. Objects are
//!   streamed (memory stays flat whatever their size), `.gz` and `.zst` objects decompressed.
//! - [`sqlite`] (feature `sqlite`): the rows of a SQLite table, in balanced ranges of its
//!   integer `id` column; an open plan ([`sqlite::SqliteSource::follow`]) adds ranges for rows
//!   inserted past the last planned id.
//!
//! - [`parquet`] (feature `parquet`): the rows of Parquet files, row groups packed into splits,
//!   as JSON objects (or Arrow record batches with [`parquet::ParquetSource::batches`]).
//! - [`postgres`] (feature `postgres`): the rows of a PostgreSQL table in ranges of an integer
//!   key balanced by rows ([`keyrange`], shared with SQLite), as JSON objects (or rows of a type
//!   of your own with [`postgres::PostgresSource::typed`]).
//!
//! They yield [`Line`]s: a key unique within the input and the record as text.
//!
//! What this crate does not do: coordinate (the driver does), or write anywhere (sinks are the
//! embedding code's).
//!
//! Two workers sharing the lines of a directory (in one process here, on the in-memory store;
//! on NATS they would be two pods):
//!
//! ```
//! # #[cfg(feature = "files")] {
//! use etl_coordination_driver::prelude::*;
//! use etl_coordination_sources::{Line, files::FilesSource};
//! use std::sync::{Arc, Mutex};
//!
//! /// Collects what it is given, each lane through a clone of it; a real sink's writer buffers
//! /// its lane's records and makes them durable in `flush`.
//! #[derive(Clone, Default)]
//! struct Collect(Arc<Mutex<Vec<String>>>);
//! impl Sink<Line> for Collect {
//!     type Writer = Collect;
//!     async fn open(&self, _: &LaneInfo) -> Result<Collect, SinkError> {
//!         Ok(self.clone())
//!     }
//! }
//! impl SinkWriter<Line> for Collect {
//!     async fn write(&mut self, line: Line) -> Result<(), SinkError> {
//!         self.0.lock().unwrap().push(line.key);
//!         Ok(())
//!     }
//!     async fn flush(&mut self) -> Result<(), SinkError> {
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! for i in 0..10 {
//!     std::fs::write(dir.path().join(format!("part-{i}.txt")), "first\nsecond\n")?;
//! }
//! let stores = JobStores::memory(JobName::new("lines")?);
//! let source = FilesSource::open(dir.path().to_str().unwrap(), 16)?; // 16-byte splits: one file each
//! let sink = Collect::default();
//! let workers = ["a", "b"].map(|_| Pipeline::new(stores.clone(), source.clone(), sink.clone()).start());
//! for worker in workers {
//!     assert_eq!(worker?.outcome().await?, JobOutcome::Complete);
//! }
//! let mut keys = sink.0.lock().unwrap().clone();
//! keys.sort();
//! keys.dedup(); // at-least-once: a takeover may replay, never lose
//! assert_eq!(keys.len(), 20);
//! # Ok(()) }
//! # main().unwrap() }
//! ```

#[cfg(feature = "files")]
pub mod files;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub mod keyrange;
#[cfg(feature = "parquet")]
pub mod parquet;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

use serde::{Deserialize, Serialize};

/// One record of the shipped sources: a line of a file, a row of a table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// Unique within the whole input: `path:line` for files (`path@offset` in a byte range of
    /// a large object), `path:row` for Parquet, `table:key` for table rows.
    pub key: String,
    /// The record as text (a line without its end; a row as a JSON object).
    pub content: String,
}
