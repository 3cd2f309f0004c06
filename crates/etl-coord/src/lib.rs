//! `etl-coord`: the coordinated pipeline as a command, and the example sources that double as
//! templates for custom sources (see `docs/CUSTOM_SOURCES.md`).
//!
//! - [`sources::files`]: an object-store backfill (local directory by default) bin-packed by
//!   bytes into splits; records are lines; progress is (object, byte offset, line).
//! - [`sink::JsonlSink`]: a JSON Lines sink, one line per emitted record.
//! - [`runner`]: the generic lane loop (emit, commit, stop, finish) every source reuses.
//! - [`demo`]: several in-process workers on the memory store over a generated dataset.

pub mod demo;
pub mod ops;
pub mod runner;
pub mod sink;
pub mod sources;
