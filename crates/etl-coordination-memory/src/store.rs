//! [`MemoryStore`]: [`MemoryKv`] behind a mutex, with watchers and a TTL expiry task.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::{Entry, Key, Prefix, Revision, StoreError, Timestamp, WatchEvent};
use etl_coordination_store::{Store, WatchStream};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use crate::MemoryKv;

struct Watcher {
    prefix: Prefix,
    tx: mpsc::UnboundedSender<Result<WatchEvent, StoreError>>,
}

struct Inner {
    kv: MemoryKv,
    watchers: Vec<Watcher>,
}

struct Shared {
    inner: Mutex<Inner>,
    origin: Instant,
    /// Wakes the expiry task when a write may have moved the next expiry earlier.
    wake: Arc<Notify>,
}

/// An in-memory store. Clones share the same data. Must be created inside a tokio runtime
/// (it spawns its expiry task there); time is tokio time, so paused-time tests are virtual.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store. Panics outside a tokio runtime.
    pub fn new() -> Self {
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner { kv: MemoryKv::new(), watchers: Vec::new() }),
            origin: Instant::now(),
            wake: Arc::new(Notify::new()),
        });
        tokio::spawn(expiry_task(Arc::downgrade(&shared), shared.wake.clone()));
        MemoryStore { shared }
    }

    fn with<T>(&self, f: impl FnOnce(&mut MemoryKv, Timestamp) -> T) -> T {
        let now = self.shared.now();
        let mut inner = self.shared.inner.lock().expect("memory store lock");
        let out = f(&mut inner.kv, now);
        inner.publish();
        drop(inner);
        self.shared.wake.notify_one();
        out
    }
}

impl Shared {
    fn now(&self) -> Timestamp {
        Timestamp::from_micros(u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX))
    }

    fn instant(&self, t: Timestamp) -> Instant {
        self.origin + t.since_origin()
    }
}

impl Inner {
    /// Delivers pending events to every watcher whose prefix matches; drops closed watchers.
    fn publish(&mut self) {
        let events = self.kv.take_events();
        if events.is_empty() {
            return;
        }
        self.watchers.retain(|w| !w.tx.is_closed());
        for ev in events {
            let key = match &ev {
                WatchEvent::Put(e) => &e.key,
                WatchEvent::Delete { key, .. } => key,
                WatchEvent::SnapshotComplete => continue,
            };
            for w in &self.watchers {
                if w.prefix.matches(key) {
                    let _ = w.tx.send(Ok(ev.clone()));
                }
            }
        }
    }
}

/// Expires keys when their TTL runs out and pushes the expiry to watchers, so expiry is seen
/// promptly without anyone polling (S3). Holds only a weak reference: dropping the last store
/// handle wakes it (see `Drop for Shared`) and it ends.
async fn expiry_task(shared: Weak<Shared>, wake: Arc<Notify>) {
    loop {
        let deadline = {
            let Some(s) = shared.upgrade() else { return };
            let mut inner = s.inner.lock().expect("memory store lock");
            let now = s.now();
            inner.kv.expire(now);
            inner.publish();
            inner.kv.next_expiry().map(|t| s.instant(t))
        };
        let notified = wake.notified();
        match deadline {
            Some(d) => {
                tokio::select! {
                    () = tokio::time::sleep_until(d) => {}
                    () = notified => {}
                }
            }
            None => notified.await,
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

impl Store for MemoryStore {
    async fn create(&self, key: &Key, value: Bytes, ttl: Option<Duration>) -> Result<Revision, StoreError> {
        self.with(|kv, now| kv.create(now, key, value, ttl))
    }

    async fn compare_and_swap(
        &self,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        self.with(|kv, now| kv.compare_and_swap(now, key, expected, value, ttl))
    }

    async fn delete(&self, key: &Key, expected: Revision) -> Result<(), StoreError> {
        self.with(|kv, now| kv.delete(now, key, expected))
    }

    async fn get(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        Ok(self.with(|kv, now| kv.get(now, key)))
    }

    async fn watch(&self, prefix: &Prefix) -> Result<WatchStream, StoreError> {
        let now = self.shared.now();
        let (tx, rx) = mpsc::unbounded_channel();
        let mut inner = self.shared.inner.lock().expect("memory store lock");
        // Deliver what is pending first so the snapshot and the change feed do not overlap.
        inner.publish();
        for entry in inner.kv.list(now, prefix) {
            let _ = tx.send(Ok(WatchEvent::Put(entry)));
        }
        inner.publish();
        let _ = tx.send(Ok(WatchEvent::SnapshotComplete));
        inner.watchers.push(Watcher { prefix: prefix.clone(), tx });
        Ok(etl_coordination_store::channel_watch(rx))
    }

    async fn list(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        Ok(self.with(|kv, now| kv.list(now, prefix)))
    }
}
