//! [`JobStores`]: a job's two key spaces and its name, with one-line constructors per backend,
//! and [`AnyStore`], for choosing the backend at run time.

use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::{Entry, JobName, Key, Prefix, Revision, StoreError};
use etl_coordination_memory::MemoryStore;
use etl_coordination_store::{Store, WatchStream};

/// The two key spaces of a job (NATS: two buckets) and the job's name.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use etl_coordination_driver::{JobName, JobStores};
/// let stores = JobStores::memory(JobName::new("orders").unwrap());
/// assert_eq!(stores.job.as_str(), "orders");
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct JobStores<S> {
    /// The job's name (the `coordination_job` metric label; NATS buckets are named after it).
    pub job: JobName,
    /// Durable records.
    pub state: S,
    /// TTL'd leases.
    pub lease: S,
}

impl<S: Store> JobStores<S> {
    /// A job's stores from two stores of a backend of your own. The two must be distinct key
    /// spaces: one store used for both would mix the job's records with its leases.
    pub fn new(job: JobName, state: S, lease: S) -> Self {
        JobStores { job, state, lease }
    }
}

impl JobStores<MemoryStore> {
    /// In-process stores: a standalone worker, tests, several workers in one process. Nothing
    /// is shared with other processes. Clones share the same stores. Call it within a tokio
    /// runtime (the stores expire leases on a task of their own).
    pub fn memory(job: JobName) -> Self {
        JobStores { job, state: MemoryStore::new(), lease: MemoryStore::new() }
    }
}

#[cfg(feature = "nats")]
impl JobStores<etl_coordination_nats::NatsStore> {
    /// The job's two buckets on NATS JetStream (created if missing and allowed), after the
    /// server checks (version, JetStream, bucket configuration).
    pub async fn nats(config: &etl_coordination_nats::NatsConfig, job: &JobName) -> Result<Self, StoreError> {
        let buckets = etl_coordination_nats::connect(config, job).await?;
        Ok(JobStores { job: job.clone(), state: buckets.state, lease: buckets.lease })
    }
}

impl<S: Into<AnyStore>> JobStores<S> {
    /// The same stores behind [`AnyStore`], so that code choosing the backend at run time has
    /// one type to work with.
    pub fn into_any(self) -> JobStores<AnyStore> {
        JobStores { job: self.job, state: self.state.into(), lease: self.lease.into() }
    }
}

/// A store of any of the shipped backends, chosen at run time (the [`Store`] trait is not
/// object-safe: its methods return futures).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum AnyStore {
    /// [`MemoryStore`].
    Memory(MemoryStore),
    /// [`NatsStore`](etl_coordination_nats::NatsStore) (feature `nats`).
    #[cfg(feature = "nats")]
    Nats(Box<etl_coordination_nats::NatsStore>),
}

impl From<MemoryStore> for AnyStore {
    fn from(s: MemoryStore) -> Self {
        AnyStore::Memory(s)
    }
}

#[cfg(feature = "nats")]
impl From<etl_coordination_nats::NatsStore> for AnyStore {
    fn from(s: etl_coordination_nats::NatsStore) -> Self {
        AnyStore::Nats(Box::new(s))
    }
}

/// `$body` with `$s` bound to the store inside, whichever backend it is.
macro_rules! each {
    ($store:expr, $s:ident => $body:expr) => {
        match $store {
            AnyStore::Memory($s) => $body,
            #[cfg(feature = "nats")]
            AnyStore::Nats($s) => $body,
        }
    };
}

impl Store for AnyStore {
    async fn create(&self, key: &Key, value: Bytes, ttl: Option<Duration>) -> Result<Revision, StoreError> {
        each!(self, s => s.create(key, value, ttl).await)
    }

    async fn compare_and_swap(
        &self,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        each!(self, s => s.compare_and_swap(key, expected, value, ttl).await)
    }

    async fn delete(&self, key: &Key, expected: Revision) -> Result<(), StoreError> {
        each!(self, s => s.delete(key, expected).await)
    }

    async fn get(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        each!(self, s => s.get(key).await)
    }

    async fn watch(&self, prefix: &Prefix) -> Result<WatchStream, StoreError> {
        each!(self, s => s.watch(prefix).await)
    }

    async fn list(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        each!(self, s => s.list(prefix).await)
    }

    fn op_timeout(&self) -> Option<Duration> {
        each!(self, s => s.op_timeout())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn any_store_is_the_store_inside() {
        let stores = JobStores::memory(JobName::new("j").unwrap()).into_any();
        let key = Key::new("k").unwrap();
        let rev = stores.state.create(&key, Bytes::from_static(b"v"), None).await.unwrap();
        assert_eq!(stores.state.get(&key).await.unwrap().unwrap().revision, rev);
        assert!(stores.lease.get(&key).await.unwrap().is_none(), "two key spaces");
    }
}
