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
//! Both yield [`Line`]s: a key unique within the input and the record as text.
//!
//! What this crate does not do: coordinate (the driver does), or write anywhere (sinks are the
//! embedding code's).

#[cfg(feature = "files")]
pub mod files;
#[cfg(feature = "sqlite")]
pub mod sqlite;

use serde::{Deserialize, Serialize};

/// One record of the shipped sources: a line of a file, a row of a table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// Unique within the whole input: `path:line` for files, `table:id` for rows.
    pub key: String,
    /// The record as text (a line without its end, a row's columns separated by tabs).
    pub content: String,
}
