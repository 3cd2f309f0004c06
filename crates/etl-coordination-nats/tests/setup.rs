//! Startup checks against real servers (P1).
//!
//! Needs `NATS_URL` (a server >= 2.11) and `NATS_OLD_URL` (a 2.10.x server); `cargo xtask ci`
//! starts both.

use std::time::{Duration, Instant};

use etl_coordination_core::{JobName, StoreError};
use etl_coordination_nats::{NatsConfig, connect};
use etl_coordination_testkit::{Leaders, NatsCluster, NatsServer};

fn env(name: &str) -> String {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is not set: run `cargo xtask ci`, which starts the NATS servers"))
}

#[tokio::test]
async fn a_server_older_than_2_11_is_refused_naming_its_version_and_the_fix() {
    let err =
        connect(&NatsConfig::new(env("NATS_OLD_URL")), &JobName::new("tooold").unwrap()).await.unwrap_err();
    let StoreError::Setup(msg) = &err else { panic!("expected a setup error, got {err:?}") };
    assert!(msg.contains("2.10."), "names the version found: {msg}");
    assert!(msg.contains("2.11") && msg.contains("upgrade"), "says what to do: {msg}");
    assert!(err.is_fatal());
}

#[tokio::test]
async fn buckets_are_created_with_ttls_on_the_lease_bucket_only() {
    let job = JobName::new(format!("setup{}", std::process::id())).unwrap();
    let j = connect(&NatsConfig::new(env("NATS_URL")), &job).await.unwrap();
    use etl_coordination_store::Store;
    let k = etl_coordination_core::Key::new("x").unwrap();
    // The lease bucket takes TTLs; the state bucket refuses them (no markers there).
    j.lease
        .create(&k, bytes::Bytes::from_static(b"v"), Some(std::time::Duration::from_secs(5)))
        .await
        .unwrap();
    let err = j
        .state
        .create(&k, bytes::Bytes::from_static(b"v"), Some(std::time::Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Setup(_) | StoreError::InvalidValue(_)), "{err:?}");
    // A second worker of the same job opens the same buckets.
    let again = connect(&NatsConfig::new(env("NATS_URL")), &job).await.unwrap();
    assert!(again.lease.get(&k).await.unwrap().is_some());
}

#[tokio::test]
async fn an_unreachable_server_is_reported_as_unavailable() {
    let mut cfg = NatsConfig::new("nats://127.0.0.1:1");
    cfg.op_timeout = std::time::Duration::from_millis(300);
    let err = connect(&cfg, &JobName::new("nowhere").unwrap()).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
}

#[tokio::test]
async fn a_deleted_bucket_is_fatal_and_says_what_was_lost() {
    use etl_coordination_store::Store;
    let job = JobName::new(format!("gone{}", std::process::id())).unwrap();
    let j = connect(&NatsConfig::new(env("NATS_URL")), &job).await.unwrap();
    let client = async_nats::connect(env("NATS_URL")).await.unwrap();
    async_nats::jetstream::new(client)
        .delete_stream(format!("KV_etl_coordination_{job}_lease"))
        .await
        .unwrap();
    let k = etl_coordination_core::Key::new("x").unwrap();
    let err = j.lease.create(&k, bytes::Bytes::from_static(b"v"), None).await.unwrap_err();
    let StoreError::Setup(msg) = &err else { panic!("expected a setup error, got {err:?}") };
    assert!(msg.contains("is gone") && msg.contains("plan and progress"), "{msg}");
    assert!(err.is_fatal());
}

#[tokio::test]
async fn a_server_without_jetstream_is_refused_at_once_saying_how_to_enable_it() {
    let server = NatsServer::start_without_jetstream();
    let t = Instant::now();
    let err = connect(&NatsConfig::new(server.url()), &JobName::new("nojs").unwrap()).await.unwrap_err();
    let StoreError::Setup(msg) = &err else { panic!("expected a setup error, got {err:?}") };
    assert!(msg.contains("-js") && msg.contains(&server.url()), "says where and what to do: {msg}");
    assert!(err.is_fatal());
    // Final, not retried as a server still starting would be (that waits 15 s).
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
}

/// A cluster electing its JetStream meta leader (pods starting together) answers "temporarily
/// unavailable" or late: setup waits for it instead of failing the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_without_a_jetstream_quorum_at_startup_is_waited_for() {
    let cluster = NatsCluster::start(3);
    cluster.cut_node(0);
    let t = Instant::now();
    while cluster.meta_leader_seen_by(0).is_some() {
        assert!(t.elapsed() < Duration::from_secs(30), "node 0 still sees a meta leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut cfg = NatsConfig::new(cluster.nodes[0].url());
    cfg.op_timeout = Duration::from_millis(500);
    let job = JobName::new(format!("quorum{}", std::process::id())).unwrap();
    let setup = tokio::spawn(async move { connect(&cfg, &job).await });
    // The fault's duration: node 0 has no quorum for 2 s of the setup, then it has.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!setup.is_finished(), "setup gave up while the cluster had no quorum: {:?}", setup.await);
    cluster.heal_node(0);
    let job = setup.await.unwrap().expect("setup succeeds once the cluster has a quorum");
    use etl_coordination_store::Store;
    let k = etl_coordination_core::Key::new("x").unwrap();
    job.state.create(&k, bytes::Bytes::from_static(b"v"), None).await.unwrap();
}
