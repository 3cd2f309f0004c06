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

/// A job whose buckets are bounded fills them: its writes are refused with a fatal error naming
/// the bucket, the bound and how to raise it; a job beside it on the same server goes on.
#[tokio::test]
async fn a_job_that_fills_its_bounded_buckets_is_stopped_with_the_bound_and_others_go_on() {
    use bytes::Bytes;
    use etl_coordination_core::{Key, Revision};
    use etl_coordination_store::Store;
    let id = std::process::id();
    let full = JobName::new(format!("full{id}")).unwrap();
    let mut cfg = NatsConfig::new(env("NATS_URL"));
    cfg.state_max_bytes = Some(8 << 10);
    cfg.lease_max_bytes = Some(8 << 10);
    let j = connect(&cfg, &full).await.unwrap();
    let value = Bytes::from(vec![b'x'; 200]);
    let mut written = Vec::new();
    let err = loop {
        let k = Key::new(format!("split.{}", written.len())).unwrap();
        match j.state.create(&k, value.clone(), None).await {
            Ok(rev) => written.push((k, rev)),
            Err(e) => break e,
        }
        assert!(written.len() < 1000, "8 KiB took {} records of 200 bytes", written.len());
    };
    assert!(written.len() >= 10, "the bound is the bucket's, not smaller: {} records", written.len());
    let StoreError::Setup(msg) = &err else { panic!("expected a setup error, got {err:?}") };
    assert!(err.is_fatal());
    let bucket = format!("etl_coordination_full{id}_state");
    for what in
        [bucket.as_str(), "is full", "8192 bytes", &format!("nats-buckets --job full{id} --nats-max-bytes")]
    {
        assert!(msg.contains(what), "{what:?} in: {msg}");
    }
    // An update of a record at the bound is refused the same way (the new message is stored
    // before the old one goes); nothing was changed.
    let (k0, r0): (Key, Revision) = written[0].clone();
    let err = j.state.compare_and_swap(&k0, r0, value.clone(), None).await.unwrap_err();
    assert!(matches!(&err, StoreError::Setup(m) if m.contains("is full")), "{err:?}");
    assert_eq!(j.state.get(&k0).await.unwrap().unwrap().revision, r0);
    // The lease bucket's bound the same.
    let err = loop {
        let k = Key::new(format!("lease.{}", written.len())).unwrap();
        match j.lease.create(&k, value.clone(), Some(Duration::from_secs(60))).await {
            Ok(rev) => written.push((k, rev)),
            Err(e) => break e,
        }
        assert!(written.len() < 2000);
    };
    assert!(
        matches!(&err, StoreError::Setup(m) if m.contains(&format!("etl_coordination_full{id}_lease is full"))
            && m.contains("--nats-lease-max-bytes")),
        "{err:?}"
    );
    // Reopened without a bound, the buckets keep theirs.
    let again = connect(&NatsConfig::new(env("NATS_URL")), &full).await.unwrap();
    let err = again.state.create(&Key::new("split.again").unwrap(), value.clone(), None).await.unwrap_err();
    assert!(matches!(&err, StoreError::Setup(m) if m.contains("is full")), "{err:?}");
    // Another job on the same server is not affected.
    let other = connect(&NatsConfig::new(env("NATS_URL")), &JobName::new(format!("notfull{id}")).unwrap())
        .await
        .unwrap();
    for i in 0..100 {
        other.state.create(&Key::new(format!("split.{i}")).unwrap(), value.clone(), None).await.unwrap();
    }
}
