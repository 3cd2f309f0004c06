//! The store abstraction of etl-coordination: the [`Store`] trait with exactly the six
//! primitives of S1 of docs/PROTOCOL.md, the classified [`StoreError`] (S2), key validation, and (feature
//! `conformance`) the conformance suite every backend must pass (S5).
//!
//! The vocabulary types (keys, entries, watch events, errors) live in
//! `etl-coordination-core` so that the pure protocol can speak about store results without
//! depending on this crate; they are re-exported here.
//!
//! What this crate does not do: implement a backend (see `etl-coordination-memory` and
//! `etl-coordination-nats`) or decide anything about ownership.
//!
//! Every write is fenced by a revision: a create succeeds only where nothing lives, a
//! compare-and-swap only over the revision the writer last saw. This is all the protocol's
//! safety rests on:
//!
//! ```
//! use etl_coordination_store::{Key, Revision, Store, StoreError};
//! use std::time::Duration;
//!
//! /// Takes `key` if it is free, or over `seen` (the revision its holder last wrote).
//! async fn take<S: Store>(store: &S, key: &Key, seen: Option<Revision>) -> Result<Revision, StoreError> {
//!     let ttl = Some(Duration::from_secs(30)); // gone 30 s after the last write unless renewed
//!     match seen {
//!         None => store.create(key, "mine".into(), ttl).await,
//!         Some(revision) => store.compare_and_swap(key, revision, "mine".into(), ttl).await,
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), StoreError> {
//! let store = etl_coordination_memory::MemoryStore::new();
//! let key = Key::new("split.s1").expect("a valid key");
//! let first = take(&store, &key, None).await?;
//! let second = take(&store, &key, Some(first)).await?;
//! // A writer still holding the first revision is fenced off:
//! let stale = take(&store, &key, Some(first)).await.unwrap_err();
//! assert!(matches!(stale, StoreError::RevisionMismatch(_)));
//! assert_eq!(store.get(&key).await?.expect("live").revision, second);
//! # Ok(()) }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures_core::Stream;

pub use etl_coordination_core::{
    Bucket, DeleteCause, Entry, Key, KeyError, Prefix, StoreError, StoreReply, StoreRequest, StoreResult,
    WatchEvent,
};
pub use etl_coordination_core::{Revision, Timestamp};

#[cfg(feature = "conformance")]
pub mod conformance;
pub mod layers;

/// The largest value a backend must accept (NATS's default message limit is 1 MiB; leave room
/// for headers).
pub const MAX_VALUE_LEN: usize = 512 * 1024;

/// A watch: the current values under the prefix, then [`WatchEvent::SnapshotComplete`], then
/// every change in revision order. After an `Err` the stream is finished: open a new watch and
/// resync from its snapshot.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, StoreError>> + Send>>;

/// A key-value store with TTLs and compare-and-swap: the only thing the protocol needs (S1).
///
/// Implementations must be the same store semantics as `etl-coordination-memory` (the
/// executable specification) and pass the conformance suite.
pub trait Store: Send + Sync + 'static {
    /// Create-if-absent. A key that was deleted or expired is absent; the new key carries
    /// `ttl` (S3). Fails with [`StoreError::AlreadyExists`] if a live value exists.
    fn create(
        &self,
        key: &Key,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> impl Future<Output = Result<Revision, StoreError>> + Send;

    /// Update expecting `expected` to be the current revision; the new value carries `ttl`
    /// (replacing any previous TTL; `None` makes it permanent). Fails with
    /// [`StoreError::RevisionMismatch`] on a stale revision or a missing key.
    fn compare_and_swap(
        &self,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> impl Future<Output = Result<Revision, StoreError>> + Send;

    /// Delete guarded by the expected current revision.
    fn delete(&self, key: &Key, expected: Revision) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Point read: `None` if absent, deleted or expired.
    fn get(&self, key: &Key) -> impl Future<Output = Result<Option<Entry>, StoreError>> + Send;

    /// Prefix watch with an initial snapshot and a snapshot-complete signal: the current value
    /// of every live key under `prefix`, then [`WatchEvent::SnapshotComplete`], then every change
    /// in revision order. A store whose snapshot is sent while changes go on (NATS) may also
    /// deliver deletes before `SnapshotComplete` (of a key deleted while the snapshot was being
    /// sent, or an older tombstone); a caller applies every event by revision.
    fn watch(&self, prefix: &Prefix) -> impl Future<Output = Result<WatchStream, StoreError>> + Send;

    /// Every live entry under the prefix, in key order.
    fn list(&self, prefix: &Prefix) -> impl Future<Output = Result<Vec<Entry>, StoreError>> + Send;

    /// The time budget this store already gives each request, if it has one (the NATS backend:
    /// `NatsConfig::op_timeout`). A driver times requests out at this budget unless configured
    /// otherwise, so one setting governs a worker's requests end to end. Default: none.
    fn op_timeout(&self) -> Option<Duration> {
        None
    }
}

/// A [`WatchStream`] fed by a channel: backends push events from their own task (or under
/// their lock) and the caller polls the receiving end.
pub fn channel_watch(
    rx: tokio::sync::mpsc::UnboundedReceiver<Result<WatchEvent, StoreError>>,
) -> WatchStream {
    struct ChannelWatch(tokio::sync::mpsc::UnboundedReceiver<Result<WatchEvent, StoreError>>);
    impl Stream for ChannelWatch {
        type Item = Result<WatchEvent, StoreError>;
        fn poll_next(
            mut self: Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            self.0.poll_recv(cx)
        }
    }
    Box::pin(ChannelWatch(rx))
}

/// Executes one request of the protocol core against a store.
pub async fn execute<S: Store + ?Sized>(store: &S, request: StoreRequest) -> StoreResult {
    match request {
        StoreRequest::Create { key, value, ttl } => {
            store.create(&key, value, ttl).await.map(StoreReply::Written)
        }
        StoreRequest::CompareAndSwap { key, expected, value, ttl } => {
            store.compare_and_swap(&key, expected, value, ttl).await.map(StoreReply::Written)
        }
        StoreRequest::Delete { key, expected } => {
            store.delete(&key, expected).await.map(|()| StoreReply::Deleted)
        }
        StoreRequest::Get { key } => store.get(&key).await.map(StoreReply::Value),
        StoreRequest::List { prefix } => store.list(&prefix).await.map(StoreReply::Entries),
    }
}

/// Checks a TTL against the rules every backend shares: whole seconds, at least one second
/// (NATS per-message TTLs are whole seconds; sub-second values are rejected by the server).
pub fn validate_ttl(ttl: Option<Duration>) -> Result<(), StoreError> {
    match ttl {
        Some(t) if t < Duration::from_secs(1) || t.subsec_nanos() != 0 => Err(StoreError::InvalidValue(
            format!("ttl {t:?} is not a whole number of seconds of at least 1s"),
        )),
        _ => Ok(()),
    }
}

/// Checks a value's size against [`MAX_VALUE_LEN`].
pub fn validate_value(value: &Bytes) -> Result<(), StoreError> {
    if value.len() > MAX_VALUE_LEN {
        return Err(StoreError::InvalidValue(format!(
            "value of {} bytes exceeds the {MAX_VALUE_LEN}-byte limit",
            value.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_must_be_whole_seconds() {
        assert!(validate_ttl(None).is_ok());
        assert!(validate_ttl(Some(Duration::from_secs(1))).is_ok());
        for bad in [Duration::ZERO, Duration::from_millis(500), Duration::from_millis(1500)] {
            let e = validate_ttl(Some(bad)).unwrap_err();
            assert!(e.to_string().contains("whole number of seconds"), "{e}");
            assert!(!e.is_retryable());
        }
    }

    #[test]
    fn errors_are_classified() {
        assert!(StoreError::Unavailable("down".into()).is_retryable());
        assert!(StoreError::Indeterminate("timeout".into()).is_retryable());
        assert!(!StoreError::RevisionMismatch(Key::new("k").unwrap()).is_retryable());
        assert!(StoreError::Setup("server too old".into()).is_fatal());
    }
}
