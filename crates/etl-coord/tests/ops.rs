//! `status` and `requeue` against a store a real job ran on (in-process, memory store).

use std::time::Duration;

use etl_coord::ops;
use etl_coord::sink::JsonlSink;
use etl_coord::sources::{AnySource, Faults, Faulty};
use etl_coordination_driver::{
    DriverConfig, InstanceId, JobName, JobOutcome, JobStores, OnStall, Pipeline, SplitId,
};
use etl_coordination_memory::MemoryStore;
use etl_coordination_store::Store;
use etl_coordination_store::layers::{Counting, Observed, Op};

#[tokio::test]
async fn status_shows_a_quarantined_split_and_requeue_returns_it_to_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.txt"), "ok 1\nok 2\n").unwrap();
    std::fs::write(dir.path().join("b.txt"), "ok 3\nBROKEN\n").unwrap();
    let source = AnySource::open(&format!("files:{}", dir.path().display()), 10, 1, false).unwrap();
    let stores = JobStores::memory(JobName::new("ops").unwrap());
    let mut config = DriverConfig::default();
    config.instance_id = Some(InstanceId::new("w1").unwrap());
    config.tuning.lease_duration = Duration::from_secs(2);
    config.tuning.max_attempts = 2;
    config.tuning.claim_backoff = Duration::from_secs(1);
    config.on_stall = OnStall::Warn;
    let faults = Faults { unprocessable_marker: Some("BROKEN".into()), ..Faults::default() };
    let handle = Pipeline::new(stores.clone(), Faulty { source, faults }, JsonlSink::discard())
        .config(config)
        .start()
        .unwrap();
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
    let table = ops::render(&status, ops::Output::Table);
    assert!(
        table.contains("1 done") && table.contains("1 quarantined") && table.contains("(50.0% complete)"),
        "{table}"
    );

    // Only quarantined splits can be requeued.
    let done = status.splits.iter().find(|s| s.state == "Done").unwrap();
    let err = ops::requeue(&stores, &SplitId::new(done.id.clone()).unwrap()).await.unwrap_err();
    assert!(err.to_string().contains("not Quarantined"), "{err}");
    // The bulk requeue lists what it would do; a filter that matches nothing lists nothing.
    let none = ops::plan_requeue(&stores, Some("no such error")).await.unwrap();
    assert!(none.splits.is_empty() && none.not_matching == 1);
    let plan = ops::plan_requeue(&stores, Some("b.txt:2")).await.unwrap();
    assert_eq!(plan.splits.iter().map(|s| s.0.clone()).collect::<Vec<_>>(), vec![bad.clone()]);
    let report = ops::apply_requeue(&stores, &plan).await.unwrap();
    assert_eq!(report, ops::RequeueReport { requeued: vec![bad.clone()], changed: vec![] });
    // The same listing again, as if someone had requeued it between the listing and the
    // write: left alone, reported as changed.
    let report = ops::apply_requeue(&stores, &plan).await.unwrap();
    assert_eq!(report, ops::RequeueReport { requeued: vec![], changed: vec![bad.clone()] });
    let after = ops::status(&stores).await.unwrap();
    let split = after.splits.iter().find(|s| s.id == bad.as_str()).unwrap();
    assert_eq!((split.state.as_str(), split.attempts, split.owner.clone()), ("Unleased", 0, None));
    assert!(ops::plan_requeue(&stores, None).await.unwrap().splits.is_empty(), "nothing quarantined now");
}

#[tokio::test]
async fn status_reads_a_fixed_number_of_requests_and_flags_an_undecodable_record_without_failing() {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..40 {
        std::fs::write(dir.path().join(format!("f{i:02}.txt")), format!("line {i}\n")).unwrap();
    }
    // One split per file: 40 splits.
    let source = AnySource::open(&format!("files:{}", dir.path().display()), 1, 1, false).unwrap();
    let stores = JobStores::new(
        JobName::new("many").unwrap(),
        Observed::counting(MemoryStore::new()),
        Observed::counting(MemoryStore::new()),
    );
    let mut config = DriverConfig::default();
    config.tuning.lease_duration = Duration::from_secs(2);
    let handle = Pipeline::new(stores.clone(), source, JsonlSink::discard()).config(config).start().unwrap();
    assert!(matches!(handle.outcome().await.unwrap(), JobOutcome::Complete));
    let reads = |s: &JobStores<Counting<MemoryStore>>| {
        let n = |c: &Counting<MemoryStore>| c.counts().get(Op::Get) + c.counts().get(Op::List);
        n(&s.state) + n(&s.lease)
    };
    let before = reads(&stores);
    let st = ops::status(&stores).await.unwrap();
    let used = reads(&stores) - before;
    assert_eq!(st.splits.len(), 40);
    assert!(used <= 7, "status made {used} requests for 40 splits (one listing per kind of record)");
    assert_eq!(st.summary.percent_complete, 100.0);
    let progress = st.splits[0].progress.as_deref().unwrap();
    assert!(
        progress.contains("line=") && !progress.contains('{'),
        "progress in the source's terms: {progress}"
    );

    // Another program overwrites one split record: status still shows the job, and flags it.
    let victim = etl_coordination_core::records::keys::split(&SplitId::new(st.splits[3].id.clone()).unwrap());
    let e = stores.state.inner().get(&victim).await.unwrap().unwrap();
    stores
        .state
        .inner()
        .compare_and_swap(&victim, e.revision, bytes::Bytes::from_static(&[255, 0, 1, 2]), None)
        .await
        .unwrap();
    let st = ops::status(&stores).await.unwrap();
    assert_eq!((st.summary.done, st.summary.undecodable), (39, 1), "{:?}", st.summary);
    let flagged = &st.undecodable[0];
    assert_eq!(flagged.key, victim.to_string());
    assert!(flagged.error.contains("format 255") && flagged.error.contains("runbook"), "{}", flagged.error);
    let table = ops::render(&st, ops::Output::Table);
    assert!(table.contains(&format!("UNDECODABLE {victim}")) && table.contains("1 undecodable"), "{table}");
    // --state keeps the summary whole and shows only what was asked for.
    let mut only = st.clone();
    ops::filter(&mut only, &["undecodable".to_owned()]);
    assert_eq!(only.splits.len(), 1);
    assert_eq!(only.summary.total, 40);

    // The repair: a reset rewrites it from the start, under an epoch above any it had.
    let victim_id = SplitId::new(st.splits[3].id.clone()).unwrap();
    // Another program also left bytes without a TTL at the split's lease key: they would keep
    // every claim out, and go with the reset.
    stores.lease.inner().create(&victim, bytes::Bytes::from_static(&[255, 9]), None).await.unwrap();
    let plan = ops::plan_reset(&stores, &victim_id).await.unwrap();
    assert!(plan.current.starts_with("undecodable (record format 255"), "{}", plan.current);
    assert!(plan.current.contains("lease undecodable"), "{}", plan.current);
    // Written only over what was read: a change in between refuses the write.
    let stale = ops::plan_reset(&stores, &victim_id).await.unwrap();
    ops::apply_reset(&stores, &plan).await.unwrap();
    let err = ops::apply_reset(&stores, &stale).await.unwrap_err();
    assert!(format!("{err:#}").contains("changed while resetting it; run the command again"), "{err:#}");
    let st = ops::status(&stores).await.unwrap();
    let reset = st.splits.iter().find(|x| x.id == victim_id.as_str()).unwrap();
    assert_eq!((reset.state.as_str(), reset.attempts, reset.progress.as_deref()), ("Unleased", 0, None));
    // Above every epoch the split had: at least the revision of the value it replaced.
    let e = stores.state.inner().get(&victim).await.unwrap().unwrap();
    assert!(reset.epoch >= e.revision.0 - 1 && reset.epoch > 1, "{reset:?} at revision {:?}", e.revision);
    assert!(st.undecodable.is_empty());
    assert!(
        stores.lease.inner().get(&victim).await.unwrap().is_none(),
        "the undecodable lease value is gone"
    );
    // A split nobody planned cannot be reset; a record deleted by hand shows as missing.
    let err = ops::plan_reset(&stores, &SplitId::new("nope").unwrap()).await.unwrap_err();
    assert!(err.to_string().contains("no descriptor"), "{err}");
    let gone = etl_coordination_core::records::keys::split(&SplitId::new(st.splits[5].id.clone()).unwrap());
    let e = stores.state.inner().get(&gone).await.unwrap().unwrap();
    stores.state.inner().delete(&gone, e.revision).await.unwrap();
    let st = ops::status(&stores).await.unwrap();
    assert_eq!((st.summary.total, st.summary.missing), (40, 1), "{:?}", st.summary);
    assert!(ops::render(&st, ops::Output::Table).contains("1 missing"));
    // ... and a reset recreates it.
    let plan = ops::plan_reset(&stores, &SplitId::new(st.splits[5].id.clone()).unwrap()).await.unwrap();
    assert_eq!(plan.current, "missing");
    ops::apply_reset(&stores, &plan).await.unwrap();
    let st = ops::status(&stores).await.unwrap();
    assert_eq!(st.summary.missing, 0);
    // Its history is unknown: the epoch is raised above the revision its create got, which is
    // above every revision the key ever had.
    let e = stores.state.inner().get(&gone).await.unwrap().unwrap();
    let rec: etl_coordination_core::records::SplitRecord =
        etl_coordination_core::records::decode(&e.value).unwrap();
    assert!(rec.epoch.0 + 1 == e.revision.0 && rec.progress.is_none(), "{rec:?} at {:?}", e.revision);
}

#[test]
fn progress_renders_as_text_never_as_raw_bytes() {
    assert_eq!(ops::render_progress(br#"{"object":2,"offset":10,"line":3}"#), "line=3 object=2 offset=10");
    assert_eq!(ops::render_progress(b"row 42"), "row 42");
    let binary = ops::render_progress(&[0, 1, 2, 255]);
    assert!(binary.starts_with("0x000102ff") && binary.contains("4 bytes"), "{binary}");
    assert!(!binary.contains('\0'));
}

#[tokio::test]
async fn status_shows_progress_by_work_and_a_time_left_that_the_job_keeps() {
    // A job of known size: 6 files of 50 lines, one lane reading 50 lines a second at most
    // (20 ms a line): about 6 s of work, a sixth of it per file.
    let dir = tempfile::tempdir().unwrap();
    for f in 0..6 {
        let text: String = (0..50).map(|i| format!("file {f} line {i:02}\n")).collect();
        std::fs::write(dir.path().join(format!("f{f}.txt")), text).unwrap();
    }
    let source = AnySource::open(&format!("files:{}", dir.path().display()), 1, 1, false).unwrap();
    let stores = JobStores::memory(JobName::new("eta").unwrap());
    let mut config = DriverConfig::default();
    config.instance_id = Some(InstanceId::new("w1").unwrap());
    config.tuning.lease_duration = Duration::from_secs(3);
    config.tuning.max_in_flight = 1;
    let faults = Faults { record_delay: Duration::from_millis(20), ..Faults::default() };
    // An earlier process of w1 left its report (until its TTL): the worker takes the key over.
    use etl_coordination_core::records::{self, WorkReport, keys};
    let stale = |records_per_sec: f64| WorkReport {
        incarnation: etl_coordination_core::Incarnation(1),
        records: 0,
        weight: 0,
        records_per_sec,
        weight_per_sec: 1e9,
        positions: vec![],
    };
    let w1 = InstanceId::new("w1").unwrap();
    stores
        .lease
        .create(&keys::report(&w1), records::encode(&stale(1e9)), Some(Duration::from_secs(60)))
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let handle = Pipeline::new(stores.clone(), Faulty { source, faults }, JsonlSink::discard())
        .config(config)
        .commit_every(etl_coordination_driver::CommitCadence::new(5, Duration::from_millis(100)))
        .start()
        .unwrap();
    // Asked until the worker has reported its pace (every heartbeat interval, a second here:
    // the first report has no rate, the next a second's) and a split in progress, with at
    // least two files left.
    let (asked, st) = loop {
        let st = ops::status(&stores).await.unwrap();
        let reading = st.splits.iter().any(|x| x.state == "Owned" && x.position.is_some_and(|p| p > 0));
        let w = &st.summary.work;
        if reading && w.records_per_sec >= 20.0 && w.eta_secs.is_some_and(|e| e > 0) && st.summary.done < 4 {
            break (tokio::time::Instant::now(), st);
        }
        assert!(started.elapsed() < Duration::from_secs(30), "no estimate while the job ran: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let w = &st.summary.work;
    let planned: u64 =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    assert_eq!(w.planned, planned, "the files' bytes");
    assert!(w.done > 0 && w.done < planned && w.remaining == planned - w.done, "{w:?}");
    // A split being read counts its bytes read, never past its weight.
    let owned = st.splits.iter().find(|x| x.state == "Owned").unwrap();
    assert!(owned.position.unwrap() <= owned.weight, "{owned:?}");
    assert!(ops::render(&st, ops::Output::Table).contains("work: "), "the summary line");
    // The pace is the lane's: at most 50 lines a second, and not far below.
    assert!((10.0..=55.0).contains(&w.records_per_sec), "{w:?}");
    let eta = Duration::from_secs(w.eta_secs.unwrap());
    assert!(matches!(handle.outcome().await.unwrap(), JobOutcome::Complete));
    let took = asked.elapsed();
    assert!(
        eta <= took * 3 + Duration::from_secs(2) && took <= eta * 3 + Duration::from_secs(2),
        "estimated {eta:?} left, the job took {took:?} more"
    );
    let end = ops::status(&stores).await.unwrap();
    let w = &end.summary.work;
    assert_eq!((w.done, w.remaining, w.eta_secs, w.percent_done), (planned, 0, Some(0), 100.0));
    // The worker deleted its report when it ended; one of a process that is not live (no
    // presence of its incarnation) counts for nothing.
    let reports = stores.lease.list(&keys::report_prefix()).await.unwrap();
    assert!(reports.is_empty(), "{reports:?}");
    stores.lease.create(&keys::report(&w1), records::encode(&stale(1e9)), None).await.unwrap();
    let ghost = ops::status(&stores).await.unwrap();
    assert_eq!((ghost.summary.work.records_per_sec, ghost.summary.work.weight_per_sec), (0.0, 0.0));
}
