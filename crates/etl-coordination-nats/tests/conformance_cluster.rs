//! The store conformance suite against a 3-node NATS cluster with buckets of 3 replicas: every
//! case on the lease bucket, every case without a TTL on the state bucket.
//!
//! Needs `NATS_CLUSTER_URL` (comma-separated node URLs; `cargo xtask ci` starts the cluster).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etl_coordination_core::JobName;
use etl_coordination_nats::{NatsConfig, NatsStore, connect};

static NEXT: AtomicU64 = AtomicU64::new(0);

async fn fresh_job() -> etl_coordination_nats::NatsJob {
    let url = std::env::var("NATS_CLUSTER_URL")
        .expect("NATS_CLUSTER_URL is not set: run `cargo xtask ci`, which starts a 3-node cluster");
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let job = JobName::new(format!("clu{}x{n}", std::process::id())).unwrap();
    let mut cfg = NatsConfig::new(url);
    cfg.replicas = 3;
    cfg.limit_marker_ttl = Duration::from_secs(20);
    // A freshly started cluster elects its JetStream meta leader within seconds: wait for it
    // (bounded) before failing.
    let mut last = None;
    for _ in 0..40 {
        match connect(&cfg, &job).await {
            Ok(j) => return j,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("the NATS cluster did not become ready: {last:?}")
}

async fn fresh_store() -> NatsStore {
    fresh_job().await.lease
}

/// The state bucket (3 replicas, no TTLs): every case without expiry.
mod state {
    use super::*;

    async fn fresh_state_store() -> NatsStore {
        fresh_job().await.state
    }

    etl_coordination_store::conformance_tests!(
        durable: #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fresh_state_store
    );
}

etl_coordination_store::conformance_tests!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    fresh_store
);

/// Workers of a new job starting at once on different nodes: one creates the buckets while the
/// others' creates fail and their opens may not see the new stream yet, and their first writes
/// may reach a node before the stream's subject interest did (the server answers "no
/// responders"). Connecting must succeed, and a write may fail only retryably, never with a
/// fatal "bucket is gone" (a Deployment's pods all start together).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_starting_together_on_different_nodes_never_fail_fatally() {
    use etl_coordination_store::Store;
    let urls = std::env::var("NATS_CLUSTER_URL")
        .expect("NATS_CLUSTER_URL is not set: run `cargo xtask ci`, which starts a 3-node cluster");
    let nodes: Vec<String> = urls.split(',').map(str::to_owned).collect();
    assert_eq!(nodes.len(), 3, "{urls}");
    fresh_store().await; // the cluster is up and has a meta leader
    for round in 0..5 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let job = JobName::new(format!("race{}x{n}", std::process::id())).unwrap();
        // Four workers per node, all at once.
        let tasks: Vec<_> = nodes
            .iter()
            .cycle()
            .take(12)
            .enumerate()
            .map(|(i, url)| {
                let (url, job) = (url.clone(), job.clone());
                tokio::spawn(async move {
                    let mut cfg = NatsConfig::new(url);
                    cfg.replicas = 3;
                    cfg.limit_marker_ttl = Duration::from_secs(20);
                    let j = connect(&cfg, &job).await.map_err(Stage::Connect)?;
                    let k = etl_coordination_core::Key::new(format!("w{i}")).unwrap();
                    let v = bytes::Bytes::from_static(b"v");
                    j.lease.create(&k, v, Some(Duration::from_secs(20))).await.map_err(Stage::Write)
                })
            })
            .collect();
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => {}
                Err(Stage::Connect(e)) => panic!("round {round}: connecting failed: {e:?}"),
                Err(Stage::Write(e)) => assert!(!e.is_fatal() && e.is_retryable(), "round {round}: {e:?}"),
            }
        }
    }
}

/// Where a racing worker failed.
#[derive(Debug)]
enum Stage {
    Connect(etl_coordination_core::StoreError),
    Write(etl_coordination_core::StoreError),
}
