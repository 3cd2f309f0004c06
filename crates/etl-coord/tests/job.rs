//! `etl-coord job`: a job's `max_attempts` changed while it exists, and a job started by the
//! previous protocol moved to this release's with its progress kept (in-process, memory store).

use std::time::Duration;

use bytes::Bytes;
use etl_coord::job::{self, MaxAttemptsChange, Migration};
use etl_coord::ops;
use etl_coord::sink::JsonlSink;
use etl_coord::sources::{AnySource, Faults, Faulty};
use etl_coordination_core::Prefix;
use etl_coordination_core::records::{self, Meta, SplitRecord, keys};
use etl_coordination_driver::{
    DriverConfig, DriverError, InstanceId, JobName, JobOutcome, JobStores, Pipeline,
};
use etl_coordination_memory::MemoryStore;
use etl_coordination_store::Store;

fn config(instance: &str) -> DriverConfig {
    let mut c = DriverConfig::default();
    c.instance_id = Some(InstanceId::new(instance).unwrap());
    c.tuning.lease_duration = Duration::from_secs(1);
    c
}

async fn meta(stores: &JobStores<MemoryStore>) -> Meta {
    records::decode(&stores.state.get(&keys::meta()).await.unwrap().unwrap().value).unwrap()
}

/// Rewrites every record of the job's state bucket as protocol 1 wrote it: format byte 1, and
/// split records without their last field (`progressed`, a one-byte bool in bincode, added by
/// format 2); `meta` names protocol 1.
async fn as_written_by_protocol_1(stores: &JobStores<MemoryStore>) {
    let old_meta = Meta { protocol_version: 1, ..meta(stores).await };
    let e = stores.state.get(&keys::meta()).await.unwrap().unwrap();
    stores.state.compare_and_swap(&keys::meta(), e.revision, records::encode(&old_meta), None).await.unwrap();
    for e in stores.state.list(&Prefix::all()).await.unwrap() {
        let mut old = e.value.to_vec();
        old[0] = 1;
        if keys::parse_split(&e.key).is_some() {
            assert!(matches!(old.pop(), Some(0 | 1)), "a split record ends with its progressed flag");
        }
        stores.state.compare_and_swap(&e.key, e.revision, Bytes::from(old), None).await.unwrap();
    }
}

#[tokio::test]
async fn a_job_of_the_previous_protocol_is_refused_then_migrated_and_finished_from_its_progress() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.txt"), "a1\na2\n").unwrap();
    std::fs::write(dir.path().join("b.txt"), "b1\nb2\nHANG\nb3\n").unwrap();
    let spec = format!("files:{}", dir.path().display());
    let sink_dir = tempfile::tempdir().unwrap();
    let out = sink_dir.path().join("out.jsonl");
    let stores = JobStores::memory(JobName::new("moved").unwrap());

    // The old release's run: a.txt done, b.txt read up to HANG, then the fleet drained.
    let source = AnySource::open(&spec, 1, 1, false).unwrap();
    let faults = Faults { hang_marker: Some("HANG".into()), ..Faults::default() };
    let sink = JsonlSink::open(&out).unwrap();
    let handle =
        Pipeline::new(stores.clone(), Faulty { source, faults }, sink).config(config("old")).start().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let st = ops::status(&stores).await.unwrap();
        if st.summary.done == 1 && st.splits.iter().any(|s| s.progress.is_some() && s.state != "Done") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the old run never got this far: {st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.drain();
    assert!(matches!(handle.outcome().await.unwrap(), JobOutcome::Drained));
    // A drain deletes its keys; what a dead worker left would expire within a lease.
    assert!(stores.lease.list(&Prefix::all()).await.unwrap().is_empty(), "a drained worker leaves no lease");
    as_written_by_protocol_1(&stores).await;

    // This release refuses the job, saying how to move it.
    let source = AnySource::open(&spec, 1, 1, false).unwrap();
    let refused = Pipeline::new(stores.clone(), source.clone(), JsonlSink::discard())
        .config(config("new"))
        .start()
        .unwrap()
        .outcome()
        .await;
    let Err(DriverError::Fatal(e)) = refused else { panic!("expected a refusal, got {refused:?}") };
    assert!(e.to_string().contains("protocol 1") && e.to_string().contains("etl-coord job migrate"), "{e}");
    assert!(stores.lease.list(&Prefix::all()).await.unwrap().is_empty(), "the refused worker left nothing");

    // Settings are changed by the release that runs the job.
    let err = job::set_max_attempts(&stores, 5).await.unwrap_err().to_string();
    assert!(err.contains("runs protocol 1") && err.contains("job migrate"), "{err}");

    // A worker of the old release is still up: the migration refuses and changes nothing.
    let presence = keys::worker(&InstanceId::new("old-2").unwrap());
    let rev = stores.lease.create(&presence, Bytes::from_static(b"x"), None).await.unwrap();
    let before = stores.state.list(&Prefix::all()).await.unwrap();
    let err = job::migrate(&stores).await.unwrap_err().to_string();
    assert!(err.contains("worker.old-2") && err.contains("nothing was changed"), "{err}");
    assert_eq!(stores.state.list(&Prefix::all()).await.unwrap(), before);
    stores.lease.delete(&presence, rev).await.unwrap();

    // A record it cannot convert (another program's key) refuses it before anything is written.
    let junk = etl_coordination_core::Key::new("junk").unwrap();
    let junk_rev = stores.state.create(&junk, Bytes::from_static(&[1, 0]), None).await.unwrap();
    let err = job::migrate(&stores).await.unwrap_err().to_string();
    assert!(err.contains("junk") && err.contains("nothing was changed"), "{err}");
    assert_eq!(stores.state.list(&Prefix::all()).await.unwrap().len(), before.len() + 1);
    stores.state.delete(&junk, junk_rev).await.unwrap();
    assert_eq!(stores.state.list(&Prefix::all()).await.unwrap(), before, "nothing converted");

    // A migration cut short after converting the split records: the rerun finishes it.
    let mut by_hand = 0;
    for e in stores.state.list(&keys::split_prefix()).await.unwrap() {
        let value = records::migrate_state_value(&e.key, &e.value).unwrap().unwrap();
        stores.state.compare_and_swap(&e.key, e.revision, value, None).await.unwrap();
        by_hand += 1;
    }
    let moved = job::migrate(&stores).await.unwrap();
    let Migration::Moved { from: 1, to, rewritten, kept } = moved else { panic!("{moved:?}") };
    assert_eq!((to, rewritten + kept, kept), (records::PROTOCOL_VERSION, before.len(), by_hand));
    assert_eq!(meta(&stores).await.protocol_version, records::PROTOCOL_VERSION);
    assert_eq!(job::migrate(&stores).await.unwrap(), Migration::AlreadyCurrent, "run again: nothing to do");
    // An old worker started during the migration wrote a record of the old format after it:
    // a rerun on the current job converts it.
    let e = stores.state.list(&keys::split_prefix()).await.unwrap().remove(0);
    let mut old = e.value.to_vec();
    old[0] = 1;
    old.pop();
    stores.state.compare_and_swap(&e.key, e.revision, Bytes::from(old), None).await.unwrap();
    let fixed = job::migrate(&stores).await.unwrap();
    let current = records::PROTOCOL_VERSION;
    assert!(
        matches!(fixed, Migration::Moved { from, to, rewritten: 1, .. } if from == current && to == current),
        "{fixed:?}"
    );
    let st = ops::status(&stores).await.unwrap();
    assert!(st.undecodable.is_empty(), "{:?}", st.undecodable);
    let progress: Vec<_> = st.splits.iter().map(|s| (s.state.clone(), s.progress.is_some())).collect();
    assert_eq!(progress.iter().filter(|(state, p)| state == "Done" && *p).count(), 1, "{progress:?}");

    // This release finishes it from the committed progress: every line once (the drain
    // committed what it flushed), a.txt not read again.
    let sink = JsonlSink::open(&out).unwrap();
    let outcome =
        Pipeline::new(stores.clone(), source, sink).config(config("new")).start().unwrap().outcome().await;
    assert!(matches!(outcome.unwrap(), JobOutcome::Complete));
    let written = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<&str> = written.lines().collect();
    assert_eq!(lines.len(), 6, "{written}");
    for want in ["a.txt:1", "a.txt:2", "b.txt:1", "b.txt:2", "b.txt:3", "b.txt:4"] {
        let seen = lines.iter().filter(|l| l.contains(&format!("\"record\":\"{want}\""))).count();
        assert_eq!(seen, 1, "{want} in {written}");
    }
    // a.txt and b.txt:1-2 were written by the old run, the rest by the new one.
    assert!(lines[..4].iter().all(|l| l.contains("\"instance\":\"old\"")), "{written}");
    assert!(lines[4..].iter().all(|l| l.contains("\"instance\":\"new\"")), "{written}");
    let rec: SplitRecord =
        records::decode(&stores.state.list(&keys::split_prefix()).await.unwrap()[0].value).unwrap();
    assert_eq!(rec.state, records::SplitState::Done);
}

#[tokio::test]
async fn max_attempts_is_changed_on_the_job_and_refused_out_of_range_or_on_a_job_never_started() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.txt"), "a1\n").unwrap();
    let source = AnySource::open(&format!("files:{}", dir.path().display()), 1, 1, false).unwrap();
    let stores = JobStores::memory(JobName::new("attempts").unwrap());
    let err = job::set_max_attempts(&stores, 5).await.unwrap_err().to_string();
    assert!(err.contains("job attempts has no meta record") && err.contains("--job"), "{err}");

    let mut c = config("w1");
    c.tuning.max_attempts = 2;
    let outcome = Pipeline::new(stores.clone(), source, JsonlSink::discard())
        .config(c)
        .start()
        .unwrap()
        .outcome()
        .await;
    assert!(matches!(outcome.unwrap(), JobOutcome::Complete));
    assert_eq!(meta(&stores).await.max_attempts, 2, "the first worker's value seeds the job");

    assert_eq!(job::set_max_attempts(&stores, 7).await.unwrap(), MaxAttemptsChange { before: 2, after: 7 });
    let now = meta(&stores).await;
    assert_eq!((now.max_attempts, now.protocol_version), (7, records::PROTOCOL_VERSION));
    assert_eq!(job::set_max_attempts(&stores, 7).await.unwrap(), MaxAttemptsChange { before: 7, after: 7 });
    for bad in [0, 1001] {
        let err = job::set_max_attempts(&stores, bad).await.unwrap_err().to_string();
        assert!(err.contains(&format!("max_attempts {bad} is out of range")), "{err}");
    }
    assert_eq!(meta(&stores).await.max_attempts, 7, "a refused value changes nothing");
}
