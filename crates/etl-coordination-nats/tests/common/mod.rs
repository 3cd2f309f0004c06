//! Shared by the cluster suites: a state-bucket store of a job on a cluster node.

use std::time::Duration;

use etl_coordination_core::JobName;
use etl_coordination_nats::{NatsConfig, NatsStore, connect};

/// The job's state bucket (replicas 3) through the node at `url`, retried while the cluster
/// settles (a just-started cluster answers "temporarily unavailable" for a moment).
pub async fn state_store(url: &str, job: &JobName, op_timeout: Duration) -> NatsStore {
    let mut cfg = NatsConfig::new(url.to_owned());
    cfg.replicas = 3;
    cfg.op_timeout = op_timeout;
    let mut last = None;
    for _ in 0..40 {
        match connect(&cfg, job).await {
            Ok(j) => return j.state,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("cannot connect to {url}: {last:?}")
}
