//! The store layers: a budget that makes an unanswered write in doubt and an unanswered read
//! unavailable, and observers that see every call with its outcome.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_memory::MemoryStore;
use etl_coordination_store::layers::{Call, CallOutcome, Observed, Op, StoreObserver, Timeout};
use etl_coordination_store::{Entry, Key, Prefix, Revision, Store, StoreError, WatchStream};

/// A store that answers after `delay` (on tokio's paused clock in these tests).
struct Slow {
    inner: MemoryStore,
    delay: Duration,
}

impl Store for Slow {
    async fn create(&self, key: &Key, value: Bytes, ttl: Option<Duration>) -> Result<Revision, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.create(key, value, ttl).await
    }
    async fn compare_and_swap(
        &self,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.compare_and_swap(key, expected, value, ttl).await
    }
    async fn delete(&self, key: &Key, expected: Revision) -> Result<(), StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.delete(key, expected).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.get(key).await
    }
    async fn watch(&self, prefix: &Prefix) -> Result<WatchStream, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.watch(prefix).await
    }
    async fn list(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.list(prefix).await
    }
}

fn key(s: &str) -> Key {
    Key::new(s).unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_request_past_its_budget_is_in_doubt_if_it_writes_and_unavailable_if_it_reads() {
    let store = Timeout::new(
        Slow { inner: MemoryStore::new(), delay: Duration::from_secs(3) },
        Duration::from_secs(2),
    );
    assert_eq!(store.op_timeout(), Some(Duration::from_secs(2)));
    let k = key("a");
    let e = store.create(&k, Bytes::from_static(b"1"), None).await.unwrap_err();
    assert!(matches!(e, StoreError::Indeterminate(_)), "{e:?}");
    let e = store.compare_and_swap(&k, Revision(1), Bytes::from_static(b"2"), None).await.unwrap_err();
    assert!(matches!(e, StoreError::Indeterminate(_)), "{e:?}");
    let e = store.delete(&k, Revision(1)).await.unwrap_err();
    assert!(matches!(e, StoreError::Indeterminate(_)), "{e:?}");
    let e = store.get(&k).await.unwrap_err();
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
    let e = store.list(&Prefix::all()).await.unwrap_err();
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
    // A watch is not timed: it opens however long that takes.
    assert!(store.watch(&Prefix::all()).await.is_ok());
    // Within the budget, answers pass through unchanged.
    let fast = Timeout::new(
        Slow { inner: MemoryStore::new(), delay: Duration::from_secs(1) },
        Duration::from_secs(2),
    );
    let rev = fast.create(&k, Bytes::from_static(b"1"), None).await.unwrap();
    assert_eq!(fast.get(&k).await.unwrap().map(|e| e.revision), Some(rev));
    let e = fast.create(&k, Bytes::from_static(b"1"), None).await.unwrap_err();
    assert!(matches!(e, StoreError::AlreadyExists(_)), "{e:?}");
}

/// One observed call: its op, key, outcome and duration.
type Seen = (Op, Option<String>, CallOutcome, Duration);

#[derive(Default)]
struct Log(Mutex<Vec<Seen>>);

impl StoreObserver for Log {
    fn observe(&self, call: &Call<'_>) {
        let key = call.key.map(|k| k.to_string());
        self.0.lock().unwrap().push((call.op, key, call.outcome, call.elapsed));
    }
}

#[tokio::test(start_paused = true)]
async fn an_observer_sees_every_call_with_its_key_outcome_and_duration() {
    let log = Arc::new(Log::default());
    let slow = Slow { inner: MemoryStore::new(), delay: Duration::from_millis(300) };
    let store = Observed::new(Timeout::new(slow, Duration::from_secs(1)), log.clone());
    let k = key("a");
    let rev = store.create(&k, Bytes::from_static(b"1"), None).await.unwrap();
    store.create(&k, Bytes::from_static(b"1"), None).await.unwrap_err();
    store.compare_and_swap(&k, rev, Bytes::from_static(b"2"), None).await.unwrap();
    store.get(&k).await.unwrap();
    store.list(&Prefix::all()).await.unwrap();
    drop(store.watch(&Prefix::all()).await.unwrap());
    store.delete(&k, rev).await.unwrap_err();
    let seen = log.0.lock().unwrap().clone();
    let short: Vec<(Op, Option<&str>, CallOutcome)> =
        seen.iter().map(|(op, k, o, _)| (*op, k.as_deref(), *o)).collect();
    assert_eq!(
        short,
        [
            (Op::Create, Some("a"), CallOutcome::Ok),
            (Op::Create, Some("a"), CallOutcome::Conflict),
            (Op::Cas, Some("a"), CallOutcome::Ok),
            (Op::Get, Some("a"), CallOutcome::Ok),
            (Op::List, None, CallOutcome::Ok),
            (Op::Watch, None, CallOutcome::Ok),
            (Op::Delete, Some("a"), CallOutcome::Conflict),
        ]
    );
    assert!(seen.iter().all(|(_, _, _, d)| *d == Duration::from_millis(300)), "{seen:?}");
    assert_eq!(Op::Cas.name(), "cas");
    assert!(Op::Delete.is_write() && !Op::List.is_write());
}

#[tokio::test(start_paused = true)]
async fn a_counting_store_counts_each_kind_and_its_clones_share_the_counts() {
    let store = Observed::counting(MemoryStore::new());
    let clone = store.clone();
    let k = key("a");
    let rev = store.create(&k, Bytes::from_static(b"1"), None).await.unwrap();
    clone.get(&k).await.unwrap();
    clone.get(&k).await.unwrap();
    store.delete(&k, rev).await.unwrap();
    store.list(&Prefix::all()).await.unwrap();
    let c = clone.counts();
    assert_eq!((c.get(Op::Create), c.get(Op::Get), c.get(Op::Delete), c.get(Op::List)), (1, 2, 1, 1));
    assert_eq!((c.writes(), c.total()), (2, 5));
}

#[tokio::test(start_paused = true)]
async fn a_call_cut_short_by_a_timeout_above_is_observed_as_cancelled() {
    let log = Arc::new(Log::default());
    let slow = Slow { inner: MemoryStore::new(), delay: Duration::from_secs(3) };
    let store = Timeout::new(Observed::new(slow, log.clone()), Duration::from_secs(1));
    store.create(&key("a"), Bytes::from_static(b"1"), None).await.unwrap_err();
    let seen = log.0.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        (seen[0].0, seen[0].2, seen[0].3),
        (Op::Create, CallOutcome::Cancelled, Duration::from_secs(1))
    );
}
