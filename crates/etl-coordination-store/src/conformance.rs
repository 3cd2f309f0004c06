//! The backend conformance suite (S5): one behaviour-named case per function, generic over the
//! backend. A backend's test file instantiates every case as its own test with
//! [`conformance_tests!`](crate::conformance_tests), so failures show by name.
//!
//! TTL cases wait for expiry by watching for the expiry event (with a generous timeout), never
//! by sleeping and hoping. The one case that sleeps (`cas_refreshes_the_ttl`) measures TTL
//! arithmetic with half-second margins; backends may expire 0-250 ms late, never early.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;

use crate::{DeleteCause, Key, Prefix, Store, StoreError, WatchEvent, WatchStream};

const TTL: Duration = Duration::from_secs(1);
const EXPIRY_TIMEOUT: Duration = Duration::from_secs(15);

fn key(s: &str) -> Key {
    Key::new(s).expect("valid test key")
}

fn val(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// Reads watch events until `pred` accepts one, failing after `timeout`.
pub async fn next_matching(
    watch: &mut WatchStream,
    timeout: Duration,
    mut pred: impl FnMut(&WatchEvent) -> bool,
) -> WatchEvent {
    let fut = async {
        while let Some(ev) = watch.next().await {
            let ev = ev.expect("watch failed");
            if pred(&ev) {
                return ev;
            }
        }
        panic!("watch ended");
    };
    tokio::time::timeout(timeout, fut).await.expect("timed out waiting for a watch event")
}

async fn wait_expired<S: Store>(store: &S, watch: &mut WatchStream, k: &Key) {
    let ev =
        next_matching(watch, EXPIRY_TIMEOUT, |e| matches!(e, WatchEvent::Delete { key, .. } if key == k))
            .await;
    let WatchEvent::Delete { cause, .. } = ev else { unreachable!() };
    assert_eq!(cause, DeleteCause::Expired, "expected an expiry of {k}");
    assert_eq!(store.get(k).await.unwrap(), None, "an expired key must read as absent");
}

async fn snapshot_done(watch: &mut WatchStream) {
    next_matching(watch, EXPIRY_TIMEOUT, |e| *e == WatchEvent::SnapshotComplete).await;
}

/// A second create of a live key fails with AlreadyExists and leaves the value alone.
pub async fn create_is_exclusive<S: Store>(store: S) {
    let k = key("c.x");
    let rev = store.create(&k, val("a"), None).await.unwrap();
    let err = store.create(&k, val("b"), None).await.unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists(ref e) if *e == k), "{err:?}");
    let e = store.get(&k).await.unwrap().unwrap();
    assert_eq!((e.value, e.revision), (val("a"), rev));
}

/// A deleted key can be created again.
pub async fn create_after_delete_succeeds<S: Store>(store: S) {
    let k = key("c.x");
    let rev = store.create(&k, val("a"), None).await.unwrap();
    store.delete(&k, rev).await.unwrap();
    assert_eq!(store.get(&k).await.unwrap(), None);
    let rev2 = store.create(&k, val("b"), None).await.unwrap();
    assert!(rev2 > rev, "revisions increase per key");
    assert_eq!(store.get(&k).await.unwrap().unwrap().value, val("b"));
}

/// An expired key can be created again, and the new key carries its own TTL: it expires too
/// (the NATS trap: a re-create that silently drops the TTL makes a lease immortal).
pub async fn create_after_ttl_expiry_succeeds_and_carries_its_ttl<S: Store>(store: S) {
    let k = key("lease.x");
    let mut w = store.watch(&Prefix::new("lease.").unwrap()).await.unwrap();
    snapshot_done(&mut w).await;
    store.create(&k, val("a"), Some(TTL)).await.unwrap();
    wait_expired(&store, &mut w, &k).await;
    store.create(&k, val("b"), Some(TTL)).await.unwrap();
    assert_eq!(store.get(&k).await.unwrap().unwrap().value, val("b"));
    wait_expired(&store, &mut w, &k).await;
}

/// CAS against an old revision fails and leaves the value alone.
pub async fn cas_rejects_a_stale_revision<S: Store>(store: S) {
    let k = key("c.x");
    let r1 = store.create(&k, val("a"), None).await.unwrap();
    let r2 = store.compare_and_swap(&k, r1, val("b"), None).await.unwrap();
    assert!(r2 > r1);
    let err = store.compare_and_swap(&k, r1, val("c"), None).await.unwrap_err();
    assert!(matches!(err, StoreError::RevisionMismatch(_)), "{err:?}");
    assert_eq!(store.get(&k).await.unwrap().unwrap().value, val("b"));
}

/// CAS on a key that does not exist (never created, or deleted) is a mismatch.
pub async fn cas_on_a_missing_key_is_a_mismatch<S: Store>(store: S) {
    let k = key("c.x");
    let err = store.compare_and_swap(&k, crate::Revision(1), val("a"), None).await.unwrap_err();
    assert!(matches!(err, StoreError::RevisionMismatch(_)), "{err:?}");
    let rev = store.create(&k, val("a"), None).await.unwrap();
    store.delete(&k, rev).await.unwrap();
    let err = store.compare_and_swap(&k, rev, val("b"), None).await.unwrap_err();
    assert!(matches!(err, StoreError::RevisionMismatch(_)), "{err:?}");
    assert_eq!(store.get(&k).await.unwrap(), None);
}

/// A CAS with a TTL replaces the previous TTL: a heartbeated key outlives its first TTL.
pub async fn cas_refreshes_the_ttl<S: Store>(store: S) {
    let k = key("lease.x");
    let ttl = Duration::from_secs(2);
    let mut w = store.watch(&Prefix::new("lease.").unwrap()).await.unwrap();
    snapshot_done(&mut w).await;
    let r1 = store.create(&k, val("a"), Some(ttl)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    store.compare_and_swap(&k, r1, val("b"), Some(ttl)).await.unwrap();
    // 2.5 s after the create: past the first TTL, 1.5 s into the second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let e = store.get(&k).await.unwrap().expect("a renewed key must outlive its first ttl");
    assert_eq!(e.value, val("b"));
    wait_expired(&store, &mut w, &k).await;
}

/// A guarded delete with a stale revision fails; with the current one it succeeds.
pub async fn guarded_delete_needs_the_current_revision<S: Store>(store: S) {
    let k = key("c.x");
    let r1 = store.create(&k, val("a"), None).await.unwrap();
    let r2 = store.compare_and_swap(&k, r1, val("b"), None).await.unwrap();
    let err = store.delete(&k, r1).await.unwrap_err();
    assert!(matches!(err, StoreError::RevisionMismatch(_)), "{err:?}");
    assert!(store.get(&k).await.unwrap().is_some());
    store.delete(&k, r2).await.unwrap();
    assert_eq!(store.get(&k).await.unwrap(), None);
    let err = store.delete(&k, r2).await.unwrap_err();
    assert!(matches!(err, StoreError::RevisionMismatch(_)), "deleting an absent key: {err:?}");
}

/// TTL expiry shows in a watch as a delete (pushed, S3) and makes `get` return none.
pub async fn ttl_expiry_shows_as_delete_in_watch_and_none_in_get<S: Store>(store: S) {
    let k = key("lease.x");
    let mut w = store.watch(&Prefix::new("lease.").unwrap()).await.unwrap();
    snapshot_done(&mut w).await;
    let rev = store.create(&k, val("a"), Some(TTL)).await.unwrap();
    let ev = next_matching(&mut w, EXPIRY_TIMEOUT, |e| matches!(e, WatchEvent::Delete { .. })).await;
    let WatchEvent::Delete { key: dk, revision, cause } = ev else { unreachable!() };
    assert_eq!((dk, cause), (k.clone(), DeleteCause::Expired));
    assert!(revision > rev, "an expiry is a new revision");
    assert_eq!(store.get(&k).await.unwrap(), None);
    assert!(store.list(&Prefix::new("lease.").unwrap()).await.unwrap().is_empty());
}

/// `list` returns only live keys under the prefix, in key order.
pub async fn list_is_prefix_scoped_and_skips_deleted_and_expired<S: Store>(store: S) {
    let p = Prefix::new("a.").unwrap();
    let mut w = store.watch(&p).await.unwrap();
    snapshot_done(&mut w).await;
    store.create(&key("a.2"), val("2"), None).await.unwrap();
    store.create(&key("a.1"), val("1"), None).await.unwrap();
    store.create(&key("ab.1"), val("x"), None).await.unwrap();
    store.create(&key("b.1"), val("x"), None).await.unwrap();
    let r = store.create(&key("a.3"), val("3"), None).await.unwrap();
    store.delete(&key("a.3"), r).await.unwrap();
    store.create(&key("a.4"), val("4"), Some(TTL)).await.unwrap();
    wait_expired(&store, &mut w, &key("a.4")).await;
    let listed: Vec<String> =
        store.list(&p).await.unwrap().into_iter().map(|e| e.key.as_str().to_owned()).collect();
    assert_eq!(listed, ["a.1", "a.2"]);
    let all = store.list(&Prefix::all()).await.unwrap();
    assert_eq!(all.len(), 4);
}

/// `list` of a bucket without TTLs: only live keys under the prefix, in key order.
pub async fn list_is_prefix_scoped_and_skips_deleted<S: Store>(store: S) {
    store.create(&key("a.2"), val("2"), None).await.unwrap();
    store.create(&key("a.1"), val("1"), None).await.unwrap();
    store.create(&key("ab.1"), val("x"), None).await.unwrap();
    let r = store.create(&key("a.3"), val("3"), None).await.unwrap();
    store.delete(&key("a.3"), r).await.unwrap();
    let p = Prefix::new("a.").unwrap();
    let listed: Vec<String> =
        store.list(&p).await.unwrap().into_iter().map(|e| e.key.as_str().to_owned()).collect();
    assert_eq!(listed, ["a.1", "a.2"]);
    assert_eq!(store.list(&Prefix::all()).await.unwrap().len(), 3);
}

/// A watch delivers the current values, then SnapshotComplete, then changes in revision order.
pub async fn watch_delivers_snapshot_then_changes_in_revision_order<S: Store>(store: S) {
    let r1 = store.create(&key("w.1"), val("1"), None).await.unwrap();
    store.create(&key("x.1"), val("other prefix"), None).await.unwrap();
    let mut w = store.watch(&Prefix::new("w.").unwrap()).await.unwrap();
    let first = next_matching(&mut w, EXPIRY_TIMEOUT, |_| true).await;
    assert!(matches!(first, WatchEvent::Put(ref e) if e.key == key("w.1") && e.revision == r1), "{first:?}");
    let second = next_matching(&mut w, EXPIRY_TIMEOUT, |_| true).await;
    assert_eq!(second, WatchEvent::SnapshotComplete);
    let r2 = store.compare_and_swap(&key("w.1"), r1, val("1b"), None).await.unwrap();
    let r3 = store.create(&key("w.2"), val("2"), None).await.unwrap();
    store.create(&key("x.2"), val("other prefix"), None).await.unwrap();
    store.delete(&key("w.2"), r3).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        seen.push(next_matching(&mut w, EXPIRY_TIMEOUT, |_| true).await);
    }
    assert!(matches!(&seen[0], WatchEvent::Put(e) if e.key == key("w.1") && e.revision == r2), "{seen:?}");
    assert!(matches!(&seen[1], WatchEvent::Put(e) if e.key == key("w.2") && e.revision == r3), "{seen:?}");
    assert!(
        matches!(&seen[2], WatchEvent::Delete { key: k, revision, cause: DeleteCause::Deleted } if *k == key("w.2") && *revision > r3),
        "{seen:?}"
    );
}

/// A key deleted while a watch's snapshot is being sent is reported deleted, whether the
/// delete comes before `SnapshotComplete` or after it: a store that sends its snapshot while
/// changes go on (NATS) must not drop the deletes of that window (issue 32: every resync
/// reopens the watches, and at a large plan the window is long).
pub async fn watch_reports_a_delete_made_while_its_snapshot_is_sent<S: Store>(store: S) {
    let k = key("d.0000");
    let r = store.create(&k, val("first"), None).await.unwrap();
    // Enough after it (16 MB) that the snapshot is still being sent when the delete lands.
    let filler = Bytes::from(vec![b'x'; 16 * 1024]);
    for i in 1..1_000 {
        store.create(&key(&format!("d.{i:04}")), filler.clone(), None).await.unwrap();
    }
    let mut w = store.watch(&Prefix::new("d.").unwrap()).await.unwrap();
    store.delete(&k, r).await.unwrap();
    let deleted =
        next_matching(&mut w, EXPIRY_TIMEOUT, |e| matches!(e, WatchEvent::Delete { key: d, .. } if *d == k))
            .await;
    let WatchEvent::Delete { revision, cause, .. } = deleted else { unreachable!() };
    assert!(revision > r && cause == DeleteCause::Deleted, "{revision:?} {cause:?}");
    assert_eq!(store.get(&k).await.unwrap(), None);
}

/// A watch on a prefix with no keys still signals that its (empty) snapshot is complete.
pub async fn watch_of_an_empty_prefix_signals_snapshot_complete<S: Store>(store: S) {
    let mut w = store.watch(&Prefix::new("empty.").unwrap()).await.unwrap();
    let first = next_matching(&mut w, EXPIRY_TIMEOUT, |_| true).await;
    assert_eq!(first, WatchEvent::SnapshotComplete);
}

/// Concurrent read-CAS increments never lose an update.
pub async fn concurrent_cas_increments_are_exact<S: Store>(store: S) {
    const TASKS: u64 = 8;
    const EACH: u64 = 25;
    let store = Arc::new(store);
    let k = key("counter");
    store.create(&k, val("0"), None).await.unwrap();
    let mut handles = Vec::new();
    for _ in 0..TASKS {
        let store = store.clone();
        let k = k.clone();
        handles.push(tokio::spawn(async move {
            let mut done = 0;
            while done < EACH {
                let e = store.get(&k).await.unwrap().unwrap();
                let n: u64 = std::str::from_utf8(&e.value).unwrap().parse().unwrap();
                match store.compare_and_swap(&k, e.revision, val(&(n + 1).to_string()), None).await {
                    Ok(_) => done += 1,
                    Err(StoreError::RevisionMismatch(_)) => {}
                    Err(other) => panic!("unexpected error: {other}"),
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let e = store.get(&k).await.unwrap().unwrap();
    assert_eq!(std::str::from_utf8(&e.value).unwrap(), (TASKS * EACH).to_string());
}

/// After a TTL'd key expires, concurrent creates have exactly one winner.
pub async fn concurrent_create_after_expiry_has_exactly_one_winner<S: Store>(store: S) {
    let store = Arc::new(store);
    let k = key("lease.x");
    let mut w = store.watch(&Prefix::new("lease.").unwrap()).await.unwrap();
    snapshot_done(&mut w).await;
    store.create(&k, val("old"), Some(TTL)).await.unwrap();
    wait_expired(&*store, &mut w, &k).await;
    let mut handles = Vec::new();
    for i in 0..16 {
        let store = store.clone();
        let k = k.clone();
        handles.push(tokio::spawn(async move { store.create(&k, val(&i.to_string()), Some(TTL)).await }));
    }
    let mut winners = 0;
    for h in handles {
        match h.await.unwrap() {
            Ok(_) => winners += 1,
            Err(StoreError::AlreadyExists(_)) => {}
            Err(other) => panic!("unexpected error: {other}"),
        }
    }
    assert_eq!(winners, 1);
}

/// TTLs that are not whole seconds of at least 1 s are rejected with InvalidValue, and so are
/// oversized values; nothing is written.
pub async fn invalid_ttls_and_oversized_values_are_rejected<S: Store>(store: S) {
    let k = key("c.x");
    for ttl in [Duration::ZERO, Duration::from_millis(500), Duration::from_millis(1500)] {
        let err = store.create(&k, val("a"), Some(ttl)).await.unwrap_err();
        assert!(matches!(err, StoreError::InvalidValue(_)), "{ttl:?}: {err:?}");
    }
    let big = Bytes::from(vec![0u8; crate::MAX_VALUE_LEN + 1]);
    let err = store.create(&k, big, None).await.unwrap_err();
    assert!(matches!(err, StoreError::InvalidValue(_)), "{err:?}");
    assert_eq!(store.get(&k).await.unwrap(), None);
}

/// Instantiates every conformance case as its own test.
///
/// ```ignore
/// etl_coordination_store::conformance_tests!(#[tokio::test(start_paused = true)] fresh_store);
/// ```
/// where `fresh_store` is an `async fn() -> impl Store` giving an empty store per test.
/// `conformance_tests!(durable: ...)` instantiates the cases that need no TTL, for a bucket
/// that keeps its keys (a job's state bucket).
#[macro_export]
macro_rules! conformance_tests {
    ($(#[$attr:meta])* $factory:path) => {
        $crate::conformance_tests!(@cases [$(#[$attr])*] $factory;
            create_is_exclusive,
            create_after_delete_succeeds,
            create_after_ttl_expiry_succeeds_and_carries_its_ttl,
            cas_rejects_a_stale_revision,
            cas_on_a_missing_key_is_a_mismatch,
            cas_refreshes_the_ttl,
            guarded_delete_needs_the_current_revision,
            ttl_expiry_shows_as_delete_in_watch_and_none_in_get,
            list_is_prefix_scoped_and_skips_deleted_and_expired,
            list_is_prefix_scoped_and_skips_deleted,
            watch_delivers_snapshot_then_changes_in_revision_order,
            watch_of_an_empty_prefix_signals_snapshot_complete,
            watch_reports_a_delete_made_while_its_snapshot_is_sent,
            concurrent_cas_increments_are_exact,
            concurrent_create_after_expiry_has_exactly_one_winner,
            invalid_ttls_and_oversized_values_are_rejected,
        );
    };
    // A bucket that keeps its keys (no TTLs: a job's state bucket): every case without expiry.
    (durable: $(#[$attr:meta])* $factory:path) => {
        $crate::conformance_tests!(@cases [$(#[$attr])*] $factory;
            create_is_exclusive,
            create_after_delete_succeeds,
            cas_rejects_a_stale_revision,
            cas_on_a_missing_key_is_a_mismatch,
            guarded_delete_needs_the_current_revision,
            list_is_prefix_scoped_and_skips_deleted,
            watch_delivers_snapshot_then_changes_in_revision_order,
            watch_of_an_empty_prefix_signals_snapshot_complete,
            watch_reports_a_delete_made_while_its_snapshot_is_sent,
            concurrent_cas_increments_are_exact,
            invalid_ttls_and_oversized_values_are_rejected,
        );
    };
    (@cases $attrs:tt $factory:path; $($case:ident),* $(,)?) => {
        $( $crate::conformance_tests!(@one $attrs $factory; $case); )*
    };
    (@one [$($attr:tt)*] $factory:path; $case:ident) => {
        $($attr)*
        async fn $case() {
            $crate::conformance::$case($factory().await).await;
        }
    };
}
