//! Reads that decide something must not go backwards: on a 3-node cluster with buckets of 3
//! replicas, a get right after an acknowledged write returns that write, through a connection
//! to any node, also while a follower is down or lagging behind (where a read may also fail:
//! "unavailable" decides nothing in the core, an older answer would). With direct gets (what
//! async-nats uses by default) the healthy phase alone fails: docs/NATS.md measured about one
//! read in forty answered by a replica that had not applied the write yet.
//!
//! Needs `NATS_SERVER_BIN` (`cargo xtask ci` provisions it); the test starts its own cluster.

use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::{JobName, Key, Revision, StoreError};
use etl_coordination_nats::NatsStore;
use etl_coordination_store::Store;
use etl_coordination_testkit::{Leaders, NatsCluster};

mod common;

const OP_TIMEOUT: Duration = Duration::from_secs(1);

async fn state_store(url: &str, job: &JobName) -> NatsStore {
    common::state_store(url, job, OP_TIMEOUT).await
}

/// Which reads may fail (answer "unavailable", which decides nothing) instead of answering.
#[derive(Clone, Copy, PartialEq)]
enum MayFail {
    Never,
    /// Any read, now and then: a node cut off from the leader, and a cluster that lost a node
    /// re-elects its JetStream meta leader (if it was the lost one) and answers "temporarily
    /// unavailable" meanwhile.
    Any,
}

/// Writes `rounds` new values and reads each back at once through every reader; returns how
/// many reads through each node failed (allowed only as `may_fail` says). A read that returns an older revision
/// fails the test.
async fn write_then_read(
    rounds: usize,
    writer: &NatsStore,
    readers: &[(usize, &NatsStore)],
    may_fail: MayFail,
    key: &Key,
    rev: &mut Revision,
    phase: &str,
) -> [usize; 3] {
    let mut failed = [0; 3];
    for round in 0..rounds {
        let value = Bytes::from(format!("{phase}-{round}"));
        *rev = writer.compare_and_swap(key, *rev, value.clone(), None).await.expect("write acknowledged");
        for (node, r) in readers {
            match r.get(key).await {
                Ok(Some(e)) => assert_eq!(
                    (e.revision, &e.value),
                    (*rev, &value),
                    "{phase}, round {round}: read through node {node} went backwards"
                ),
                Ok(None) => panic!("{phase}, round {round}: read through node {node} found nothing"),
                Err(e) if may_fail == MayFail::Any => {
                    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
                    failed[*node] += 1;
                }
                Err(e) => panic!("{phase}, round {round}: read through node {node} failed: {e:?}"),
            }
        }
    }
    failed
}

/// Writes until one write is acknowledged and read back through every reader (at most 30 s):
/// after a node is lost, the remaining two need a moment (the healed follower catching up, a
/// meta leader elected again if the lost node was it, routes re-established) before they
/// acknowledge and answer again. How long that takes depends on the machine's load; what the
/// phase after it measures is the cluster carrying on once it has.
async fn settle(writer: &NatsStore, readers: &[(usize, &NatsStore)], key: &Key, rev: &mut Revision) {
    let t = tokio::time::Instant::now();
    loop {
        match writer.compare_and_swap(key, *rev, Bytes::from_static(b"settle"), None).await {
            Ok(r) => {
                *rev = r;
                let mut answered = true;
                for (node, reader) in readers {
                    match reader.get(key).await {
                        Ok(Some(e)) => {
                            assert_eq!(e.revision, r, "settling: a read through node {node} went backwards")
                        }
                        Ok(None) => panic!("settling: a read through node {node} found nothing"),
                        Err(_) => answered = false,
                    }
                }
                if answered {
                    return;
                }
                assert!(t.elapsed() < Duration::from_secs(30), "reads did not answer again within 30 s");
            }
            Err(e) => {
                assert!(t.elapsed() < Duration::from_secs(30), "no write acknowledged: {e:?}");
                // An unanswered write may have landed: continue from what the leader has.
                if let Ok(Some(current)) = writer.get(key).await {
                    *rev = current.revision;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_an_acknowledged_write_returns_it_also_with_a_follower_down_or_lagging() {
    let mut cluster = NatsCluster::start(3);
    let job = JobName::new("reads").unwrap();
    let first = state_store(&cluster.nodes[0].url(), &job).await;
    let leader = cluster.stream_leader("KV_etl_coordination_reads_state").expect("the stream has a leader");
    let follower = (leader + 1) % 3;
    let other = (leader + 2) % 3;
    let mut stores = Vec::new();
    for i in 0..3 {
        stores.push(state_store(&cluster.nodes[i].url(), &job).await);
    }
    drop(first);
    let key = Key::new("k").unwrap();
    let mut rev = stores[leader].create(&key, Bytes::from_static(b"v0"), None).await.unwrap();
    let all: Vec<(usize, &NatsStore)> = stores.iter().enumerate().collect();

    // Healthy: every node returns the write.
    write_then_read(300, &stores[leader], &all, MayFail::Never, &key, &mut rev, "healthy").await;

    // A follower lags (its route links stalled): the leader and the other follower are a
    // quorum, so writes are acknowledged; reads through the lagging node reach the leader or
    // fail (the route is stalled), but never answer from the stale replica. A read through the
    // other nodes may be refused for a moment too ("JetStream system temporarily unavailable",
    // seen in CI when the stalled node held the meta leadership): unavailable, never stale.
    cluster.stall_node(follower);
    let failed = write_then_read(10, &stores[leader], &all, MayFail::Any, &key, &mut rev, "lagging").await;
    assert!(
        failed[follower] > 0,
        "reads through the stalled follower reached the leader: it was not cut off"
    );
    cluster.heal_node(follower);
    println!(
        "lagging follower: {failed:?} of 10 reads per node failed (node {follower} stalled), none went backwards"
    );

    // A follower is down: the other two carry on, and reads through them return every write.
    cluster.nodes[other].kill();
    let up: Vec<(usize, &NatsStore)> = all.iter().copied().filter(|(i, _)| *i != other).collect();
    settle(&stores[leader], &up, &key, &mut rev).await;
    let failed: usize =
        write_then_read(200, &stores[leader], &up, MayFail::Any, &key, &mut rev, "follower down")
            .await
            .iter()
            .sum();
    assert!(failed <= 20, "{failed} of 400 reads with a follower down failed");
    println!("follower down: {failed} of 400 reads unavailable, none went backwards");
    cluster.nodes[other].restart();
}
