//! A stream leader cut off from its followers, as the simulator models it (`Stuck` in the
//! simulator's store): it takes a write it cannot commit; while that write is pending, reads
//! through it show the committed state, and a second write to the same key is refused although
//! the revision it expects is the one a read shows. The core must not take that refusal as a
//! loss (P8: a write not landed yet is still in doubt), and the backend must not report a key
//! as existing when nothing is there: a create refused this way is `Unavailable`.
//!
//! Needs `NATS_SERVER_BIN` (`cargo xtask ci` provisions it); the test starts its own cluster.

use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::{JobName, Key, StoreError};
use etl_coordination_nats::NatsStore;
use etl_coordination_store::Store;
use etl_coordination_testkit::{Leaders, NatsCluster};

mod common;

const OP_TIMEOUT: Duration = Duration::from_millis(500);

async fn state_store(url: &str, job: &JobName) -> NatsStore {
    common::state_store(url, job, OP_TIMEOUT).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_without_its_quorum_refuses_a_second_write_to_a_key_with_one_pending() {
    let cluster = NatsCluster::start(3);
    let job = JobName::new("pending").unwrap();
    let stream = "KV_etl_coordination_pending_state";
    let first = state_store(&cluster.nodes[0].url(), &job).await;
    let leader = cluster.stream_leader(stream).expect("the stream has a leader");
    let store = state_store(&cluster.nodes[leader].url(), &job).await;
    drop(first);
    let key = Key::new("k").unwrap();
    let rev = store.create(&key, Bytes::from_static(b"v0"), None).await.unwrap();

    // The leader loses its followers: its clients still reach it, it cannot commit. (Leadership
    // can still move right after the bucket is created: make sure the node we cut leads.)
    cluster.make_leader(stream, leader);
    cluster.cut_node(leader);
    let pending = store.compare_and_swap(&key, rev, Bytes::from_static(b"v1"), None).await;
    assert!(
        matches!(pending, Err(StoreError::Indeterminate(_))),
        "the write through the cut-off leader: {pending:?}"
    );

    // The write is in process at the leader: the committed state is unchanged, and a retry
    // against the revision it shows is refused (nobody else wrote).
    let retry = store.compare_and_swap(&key, rev, Bytes::from_static(b"v1"), None).await;
    let read = store.get(&key).await;
    assert!(matches!(retry, Err(StoreError::RevisionMismatch(_))), "retry: {retry:?}");
    match read {
        // A read through the stuck leader shows what is committed (or fails, deciding nothing).
        Ok(Some(e)) => assert_eq!(e.revision, rev, "a pending write is visible before it commits"),
        Ok(None) => panic!("the key vanished"),
        Err(e) => assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}"),
    }

    // A create of a fresh key: pending, then refused every time with nothing live to report.
    let fresh = Key::new("fresh").unwrap();
    let first_create = store.create(&fresh, Bytes::from_static(b"a"), None).await;
    assert!(matches!(first_create, Err(StoreError::Indeterminate(_))), "{first_create:?}");
    let second_create = store.create(&fresh, Bytes::from_static(b"a"), None).await;
    assert!(
        matches!(second_create, Err(StoreError::Unavailable(_))),
        "a create refused while another is pending must say nothing was written: {second_create:?}"
    );
    cluster.heal_node(leader);
}
