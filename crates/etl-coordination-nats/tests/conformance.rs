//! The store conformance suite against a real NATS server: every case on the lease bucket (TTLs,
//! markers), and every case without a TTL on the state bucket (history 1, no TTLs).
//!
//! Needs `NATS_URL` (`cargo xtask ci` starts a server and sets it). Each test gets a job (and
//! so buckets) of its own, so the suite runs in parallel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etl_coordination_core::JobName;
use etl_coordination_nats::{NatsConfig, NatsStore, connect};

static NEXT: AtomicU64 = AtomicU64::new(0);

fn url() -> String {
    std::env::var("NATS_URL").expect(
        "NATS_URL is not set: these tests need a NATS server >= 2.11 with JetStream \
         (`cargo xtask ci` provisions one; or run `nats-server -js` and set NATS_URL=nats://127.0.0.1:4222)",
    )
}

async fn fresh_job() -> etl_coordination_nats::NatsJob {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let job = JobName::new(format!(
        "conf{}x{n}x{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() % 100_000
    ))
    .unwrap();
    let mut cfg = NatsConfig::new(url());
    cfg.limit_marker_ttl = Duration::from_secs(20);
    connect(&cfg, &job).await.expect("connect to NATS")
}

async fn fresh_store() -> NatsStore {
    fresh_job().await.lease
}

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
