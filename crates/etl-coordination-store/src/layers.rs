//! Store layers: a [`Store`] wrapped in another that adds one concern and is a `Store` itself,
//! so drivers, benchmarks and tests stack the same code instead of each writing its own.
//!
//! - [`Timeout`]: a budget per request; a write without an answer within it is
//!   [`StoreError::Indeterminate`] (it may still land), a read is [`StoreError::Unavailable`].
//! - [`Observed`]: every call reported to a [`StoreObserver`] (the driver's metrics, a
//!   benchmark's log of acknowledged writes) with its duration and outcome.
//! - [`Counting`]: an `Observed` store whose observer counts the calls of each kind.
//!
//! ```
//! # use std::time::Duration;
//! use etl_coordination_memory::MemoryStore;
//! use etl_coordination_store::layers::{Observed, Op, Timeout};
//! use etl_coordination_store::{Prefix, Store};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = Observed::counting(Timeout::new(MemoryStore::new(), Duration::from_secs(5)));
//! store.list(&Prefix::all()).await.unwrap();
//! assert_eq!(store.counts().get(Op::List), 1);
//! # }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::{Entry, Key, Prefix, Revision, Store, StoreError, WatchStream};

/// The six primitives, as a layer reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Op {
    /// `create`.
    Create,
    /// `compare_and_swap`.
    Cas,
    /// `delete`.
    Delete,
    /// `get`.
    Get,
    /// `watch` (opening it; its events are not calls).
    Watch,
    /// `list`.
    List,
}

impl Op {
    /// The name metrics and logs use (`StoreRequest::op_name` for the five a core request
    /// makes).
    pub fn name(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Cas => "cas",
            Op::Delete => "delete",
            Op::Get => "get",
            Op::Watch => "watch",
            Op::List => "list",
        }
    }

    /// Whether it writes (its outcome may be in doubt).
    pub fn is_write(self) -> bool {
        matches!(self, Op::Create | Op::Cas | Op::Delete)
    }
}

/// How a call ended, as a layer reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallOutcome {
    /// It succeeded.
    Ok,
    /// A write's condition failed: the key exists, or its revision moved.
    Conflict,
    /// Any other error (unavailable, in doubt, invalid, fatal).
    Failed,
    /// The caller dropped the call before it ended (a [`Timeout`] above it ran out): whether a
    /// write landed is unknown.
    Cancelled,
}

impl CallOutcome {
    fn of<T>(result: &Result<T, StoreError>) -> CallOutcome {
        match result {
            Ok(_) => CallOutcome::Ok,
            Err(StoreError::AlreadyExists(_) | StoreError::RevisionMismatch(_)) => CallOutcome::Conflict,
            Err(_) => CallOutcome::Failed,
        }
    }
}

/// One call, as an [`Observed`] store reports it.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Call<'a> {
    /// Which primitive.
    pub op: Op,
    /// The key of a point operation (`None` for `watch` and `list`).
    pub key: Option<&'a Key>,
    /// From the call to its answer (the whole budget when a [`Timeout`] below cut it).
    pub elapsed: Duration,
    /// How it ended.
    pub outcome: CallOutcome,
}

/// Told of every call an [`Observed`] store makes, after it ends.
pub trait StoreObserver: Send + Sync + 'static {
    /// One call ended.
    fn observe(&self, call: &Call<'_>);
}

impl<O: StoreObserver> StoreObserver for Arc<O> {
    fn observe(&self, call: &Call<'_>) {
        (**self).observe(call)
    }
}

/// A store whose requests each get a time budget (S2: an unanswered write is in doubt, never a
/// failure). Watches are not timed: a watch lives until it fails.
#[derive(Clone, Debug)]
pub struct Timeout<S> {
    inner: S,
    budget: Duration,
}

impl<S: Store> Timeout<S> {
    /// `inner` with `budget` per request.
    pub fn new(inner: S, budget: Duration) -> Self {
        Timeout { inner, budget }
    }

    /// The store below.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    async fn bounded<T>(
        &self,
        write: bool,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.budget, fut).await {
            Ok(r) => r,
            Err(_) if write => Err(StoreError::Indeterminate(format!("no answer within {:?}", self.budget))),
            Err(_) => Err(StoreError::Unavailable(format!("no answer within {:?}", self.budget))),
        }
    }
}

impl<S: Store> Store for Timeout<S> {
    async fn create(&self, key: &Key, value: Bytes, ttl: Option<Duration>) -> Result<Revision, StoreError> {
        self.bounded(true, self.inner.create(key, value, ttl)).await
    }

    async fn compare_and_swap(
        &self,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        self.bounded(true, self.inner.compare_and_swap(key, expected, value, ttl)).await
    }

    async fn delete(&self, key: &Key, expected: Revision) -> Result<(), StoreError> {
        self.bounded(true, self.inner.delete(key, expected)).await
    }

    async fn get(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        self.bounded(false, self.inner.get(key)).await
    }

    async fn watch(&self, prefix: &Prefix) -> Result<WatchStream, StoreError> {
        self.inner.watch(prefix).await
    }

    async fn list(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        self.bounded(false, self.inner.list(prefix)).await
    }

    fn op_timeout(&self) -> Option<Duration> {
        Some(self.budget)
    }
}

/// A store that reports every call to an observer.
#[derive(Clone, Debug)]
pub struct Observed<S, O> {
    inner: S,
    observer: O,
}

impl<S: Store, O: StoreObserver> Observed<S, O> {
    /// `inner`, reporting to `observer`.
    pub fn new(inner: S, observer: O) -> Self {
        Observed { inner, observer }
    }

    /// The store below.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The observer.
    pub fn observer(&self) -> &O {
        &self.observer
    }

    async fn report<T>(
        &self,
        op: Op,
        key: Option<&Key>,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let mut guard = Unended { observer: &self.observer, op, key, started: Instant::now(), ended: false };
        let result = fut.await;
        guard.ended = true;
        let call = Call { op, key, elapsed: guard.started.elapsed(), outcome: CallOutcome::of(&result) };
        self.observer.observe(&call);
        result
    }
}

impl<S: Store, O: StoreObserver> Store for Observed<S, O> {
    async fn create(&self, key: &Key, value: Bytes, ttl: Option<Duration>) -> Result<Revision, StoreError> {
        self.report(Op::Create, Some(key), self.inner.create(key, value, ttl)).await
    }

    async fn compare_and_swap(
        &self,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        self.report(Op::Cas, Some(key), self.inner.compare_and_swap(key, expected, value, ttl)).await
    }

    async fn delete(&self, key: &Key, expected: Revision) -> Result<(), StoreError> {
        self.report(Op::Delete, Some(key), self.inner.delete(key, expected)).await
    }

    async fn get(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        self.report(Op::Get, Some(key), self.inner.get(key)).await
    }

    async fn watch(&self, prefix: &Prefix) -> Result<WatchStream, StoreError> {
        self.report(Op::Watch, None, self.inner.watch(prefix)).await
    }

    async fn list(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        self.report(Op::List, None, self.inner.list(prefix)).await
    }

    fn op_timeout(&self) -> Option<Duration> {
        self.inner.op_timeout()
    }
}

/// A call in progress: reported as [`CallOutcome::Cancelled`] if it is dropped before it ends,
/// so an observer sees every call it was asked to make.
struct Unended<'a, O: StoreObserver> {
    observer: &'a O,
    op: Op,
    key: Option<&'a Key>,
    started: Instant,
    ended: bool,
}

impl<O: StoreObserver> Drop for Unended<'_, O> {
    fn drop(&mut self) {
        if !self.ended {
            let call = Call {
                op: self.op,
                key: self.key,
                elapsed: self.started.elapsed(),
                outcome: CallOutcome::Cancelled,
            };
            self.observer.observe(&call);
        }
    }
}

/// Calls of each kind, counted (an observer; shared between clones through its `Arc`).
#[derive(Debug, Default)]
pub struct Counts {
    calls: [AtomicU64; 6],
}

impl Counts {
    /// How many calls of `op` were made.
    pub fn get(&self, op: Op) -> u64 {
        self.calls[op as usize].load(Ordering::Relaxed)
    }

    /// How many calls were made in all.
    pub fn total(&self) -> u64 {
        self.calls.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// How many writes (create, CAS, delete) were made.
    pub fn writes(&self) -> u64 {
        [Op::Create, Op::Cas, Op::Delete].into_iter().map(|op| self.get(op)).sum()
    }
}

impl StoreObserver for Counts {
    fn observe(&self, call: &Call<'_>) {
        self.calls[call.op as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// A store that counts its calls of each kind (benchmarks, tests).
pub type Counting<S> = Observed<S, Arc<Counts>>;

impl<S: Store> Observed<S, Arc<Counts>> {
    /// `inner`, counting its calls (clones share the counts).
    pub fn counting(inner: S) -> Self {
        Observed::new(inner, Arc::new(Counts::default()))
    }

    /// The counts so far.
    pub fn counts(&self) -> &Counts {
        &self.observer
    }
}
