//! The store conformance suite against a 3-node NATS cluster with buckets of 3 replicas.
//!
//! Needs `NATS_CLUSTER_URL` (comma-separated node URLs; `cargo xtask ci` starts the cluster).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etl_coordination_core::JobName;
use etl_coordination_nats::{NatsConfig, NatsStore, connect};

static NEXT: AtomicU64 = AtomicU64::new(0);

async fn fresh_store() -> NatsStore {
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
            Ok(j) => return j.lease,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("the NATS cluster did not become ready: {last:?}")
}

etl_coordination_store::conformance_tests!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    fresh_store
);
