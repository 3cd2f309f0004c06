//! `status` and `requeue` against a store a real job ran on (in-process, memory store).

use std::time::Duration;

use etl_coord::ops;
use etl_coord::runner::{RunOptions, run_lane};
use etl_coord::sink::JsonlSink;
use etl_coord::sources::AnySource;
use etl_coordination_driver::{
    CoordinationDriver, DriverConfig, InstanceId, JobOutcome, JobStores, OnStall, SplitId, Tuning,
};
use etl_coordination_memory::MemoryStore;

#[tokio::test]
async fn status_shows_a_quarantined_split_and_requeue_returns_it_to_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.txt"), "ok 1\nok 2\n").unwrap();
    std::fs::write(dir.path().join("b.txt"), "ok 3\nBROKEN\n").unwrap();
    let source = AnySource::open(&format!("files:{}", dir.path().display()), 10, 1).unwrap();
    let stores = JobStores { state: MemoryStore::new(), lease: MemoryStore::new() };
    let config = DriverConfig {
        job: "ops".into(),
        instance_id: Some(InstanceId::new("w1").unwrap()),
        tuning: Tuning { lease_duration: Duration::from_secs(2), max_attempts: 2, ..Tuning::default() },
        on_stall: OnStall::Warn,
        ..DriverConfig::default()
    };
    let (handle, mut lanes) = CoordinationDriver::start(stores.clone(), source.clone(), config).unwrap();
    tokio::spawn(async move {
        while let Some(lane) = lanes.next().await {
            let reader = source.reader(lane.descriptor(), lane.resume_from()).unwrap();
            let opts = RunOptions {
                instance: "w1".into(),
                unprocessable_marker: Some("BROKEN".into()),
                ..RunOptions::default()
            };
            tokio::spawn(run_lane(lane, reader, JsonlSink::discard(), opts));
        }
    });
    let JobOutcome::Stalled { quarantined } = handle.outcome().await.unwrap() else {
        panic!("expected a stall")
    };
    assert_eq!(quarantined.len(), 1);
    let bad = quarantined[0].0.clone();

    let status = ops::status(&stores).await.unwrap();
    assert_eq!(status.plan.as_ref().unwrap().split_count, 2);
    let split = status.splits.iter().find(|s| s.id == bad.as_str()).unwrap();
    assert_eq!((split.state.as_str(), split.attempts), ("Quarantined", 2));
    assert!(split.last_error.as_deref().unwrap().contains("b.txt:2"), "{split:?}");
    let table = ops::render(&status);
    assert!(table.contains("1 done") && table.contains("1 quarantined"), "{table}");

    // Only quarantined splits can be requeued.
    let done = status.splits.iter().find(|s| s.state == "Done").unwrap();
    let err = ops::requeue(&stores, &SplitId::new(done.id.clone()).unwrap()).await.unwrap_err();
    assert!(err.to_string().contains("not Quarantined"), "{err}");
    ops::requeue(&stores, &bad).await.unwrap();
    let after = ops::status(&stores).await.unwrap();
    let split = after.splits.iter().find(|s| s.id == bad.as_str()).unwrap();
    assert_eq!((split.state.as_str(), split.attempts, split.owner.clone()), ("Unleased", 0, None));
}
