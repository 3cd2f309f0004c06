//! In-memory backend of etl-coordination: the executable specification of store semantics.
//!
//! [`MemoryKv`] is the synchronous semantics (every call takes `now`); [`MemoryStore`] wraps it
//! as an async [`Store`] whose clock is tokio's (so a test with paused tokio time runs it on
//! virtual time) and pushes TTL expiries to watchers from a background task (S3). It passes the
//! whole conformance suite, and it is the embedded default for one process running several
//! workers (`MemoryStore` is cheap to clone; clones share the data).
//!
//! What it is not: durable or shared between processes.
//!
//! `MemoryKv` takes the time with every call, so what a TTL does is plain to see:
//!
//! ```
//! use etl_coordination_memory::MemoryKv;
//! use etl_coordination_store::{DeleteCause, Key, Timestamp, WatchEvent};
//! use std::time::Duration;
//!
//! let mut kv = MemoryKv::new();
//! let lease = Key::new("split.s1").expect("a valid key");
//! let t0 = Timestamp::ZERO;
//! let revision = kv.create(t0, &lease, "w1".into(), Some(Duration::from_secs(3))).expect("free");
//! // A heartbeat: a compare-and-swap over the revision the holder last wrote renews the TTL.
//! kv.compare_and_swap(t0 + Duration::from_secs(2), &lease, revision, "w1".into(), Some(Duration::from_secs(3)))
//!     .expect("still held");
//! assert!(kv.get(t0 + Duration::from_secs(4), &lease).is_some()); // renewed at 2 s: lives until 5 s
//! assert!(kv.get(t0 + Duration::from_secs(5), &lease).is_none()); // expired
//! // Watchers are told why it went: expiry, not a delete.
//! let expired = kv.take_events().into_iter().any(|e| {
//!     matches!(e, WatchEvent::Delete { cause: DeleteCause::Expired, .. })
//! });
//! assert!(expired);
//! ```

mod kv;
mod store;

pub use kv::MemoryKv;
pub use store::MemoryStore;

pub use etl_coordination_store::Store;
