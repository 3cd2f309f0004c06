//! In-memory backend of etl-coordination: the executable specification of store semantics.
//!
//! [`MemoryKv`] is the synchronous semantics (every call takes `now`); [`MemoryStore`] wraps it
//! as an async [`Store`] whose clock is tokio's (so a test with paused tokio time runs it on
//! virtual time) and pushes TTL expiries to watchers from a background task (S3). It passes the
//! whole conformance suite, and it is the embedded default for one process running several
//! workers (`MemoryStore` is cheap to clone; clones share the data).
//!
//! What it is not: durable or shared between processes.

mod kv;
mod store;

pub use kv::MemoryKv;
pub use store::MemoryStore;

pub use etl_coordination_store::Store;
