//! The failure modes of docs/SCALING.md, failure modes that can happen inside one process, run through the
//! driver against the memory store on paused (virtual) tokio time.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use etl_coordination_driver::*;

#[tokio::test(start_paused = true)]
async fn two_workers_complete_a_job_with_no_loss() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let a = start(&stores, "a", planner(6, 50), source(&oracle), config("a"));
    let b = start(&stores, "b", planner(6, 50), source(&oracle), config("b"));
    assert_eq!(a.outcome().await.unwrap(), JobOutcome::Complete);
    assert_eq!(b.outcome().await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(6, 50);
}

#[tokio::test(start_paused = true)]
async fn a_killed_worker_is_taken_over_after_the_lease_and_resumes_from_committed_progress() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let monitor = ProgressMonitor::spawn(&stores);
    let a = start(&stores, "a", planner(2, 400), source(&oracle), config("a"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b = start(&stores, "b", planner(2, 400), source(&oracle), config("b"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t0 = tokio::time::Instant::now();
    assert!(oracle.first_emit_by("a").is_some());
    a.kill();
    assert!(matches!(a.outcome().await, Err(DriverError::Killed)));
    assert_eq!(b.outcome().await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(2, 400);
    // a's splits moved to b: both names appear on the split a started.
    // Whatever a held moved to b, and only after a's lease ran out (3 s after its last renewal,
    // so at least 2 s after the kill).
    let map = oracle.0.lock().unwrap();
    let mut moved = 0;
    for v in map.values() {
        let Some(last_a) = v.iter().filter(|r| r.2 == "a").map(|r| r.3).max() else { continue };
        if last_a + Duration::from_millis(50) < t0 {
            continue; // moved to b earlier (stolen), not by the kill
        }
        let first_b =
            v.iter().filter(|r| r.2 == "b" && r.3 > last_a).map(|r| r.3).min().expect("b took over");
        assert!(
            first_b.duration_since(t0) >= Duration::from_secs(2),
            "taken over {:?} after the kill",
            first_b.duration_since(t0)
        );
        assert!(
            first_b.duration_since(t0) <= Duration::from_secs(4),
            "taken over {:?} after the kill",
            first_b.duration_since(t0)
        );
        moved += 1;
    }
    assert!(moved >= 1, "a held something when it was killed");
    monitor.assert_monotonic();
}

#[tokio::test(start_paused = true)]
async fn a_drained_worker_hands_its_splits_over_at_once_without_consuming_attempts() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let mut one = config("a");
    one.tuning.max_attempts = 1; // any consumed attempt would quarantine: the job could not complete
    let monitor = ProgressMonitor::spawn(&stores);
    let a = start(&stores, "a", planner(4, 300), source(&oracle), one.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut cb = one;
    cb.instance_id = Some(InstanceId::new("b").unwrap());
    let b = start(&stores, "b", planner(4, 300), source(&oracle), cb);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let drained_at = tokio::time::Instant::now();
    a.drain();
    assert_eq!(a.outcome().await.unwrap(), JobOutcome::Drained);
    assert_eq!(b.outcome().await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(4, 300);
    monitor.assert_monotonic();
    // Picked up without a lease wait (3 s): b resumes a's splits within milliseconds.
    let map = oracle.0.lock().unwrap();
    let mut handed_over = 0;
    for (split, v) in map.iter() {
        let Some(last_a) = v.iter().filter(|r| r.2 == "a").map(|r| r.3).max() else { continue };
        if last_a + Duration::from_millis(50) < drained_at {
            continue; // moved to b earlier (stolen), not by the drain
        }
        handed_over += 1;
        if let Some(first_b) = v.iter().filter(|r| r.2 == "b" && r.3 >= drained_at).map(|r| r.3).min() {
            assert!(
                first_b.duration_since(last_a) < Duration::from_millis(500),
                "{split}: picked up {:?} after a's last record; drain at +{:?}",
                first_b.duration_since(last_a),
                last_a.duration_since(drained_at)
            );
        }
    }
    assert!(handed_over >= 1, "a held splits when it drained");
}

#[tokio::test(start_paused = true)]
async fn a_frozen_zombie_loses_its_commit_after_a_takeover_and_nothing_regresses() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let monitor = ProgressMonitor::spawn(&stores);
    let a = start(&stores, "a", planner(1, 600), source(&oracle), config("a"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = start(&stores, "b", planner(1, 600), source(&oracle), config("b"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    // a holds s00; freeze it past its lease: b takes over, then a wakes up.
    a.freeze(Duration::from_secs(5));
    assert_eq!(b.outcome().await.unwrap(), JobOutcome::Complete);
    assert_eq!(a.outcome().await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(1, 600);
    monitor.assert_monotonic();
    let workers = oracle.workers_of("s00");
    assert!(workers.contains(&"b".to_owned()), "b took over: {workers:?}");
    // The zombie's first commit after waking up was fenced: nothing written, lane stopped.
    assert!(oracle.outcomes_of("a").contains(&CommitOutcome::Lost), "{:?}", oracle.outcomes_of("a"));
}

#[tokio::test(start_paused = true)]
async fn a_poison_split_is_quarantined_at_the_cap_and_the_job_stalls() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let mut src = source(&oracle);
    src.poison = Some("s01");
    let a = start(&stores, "a", planner(3, 20), src.clone(), config("a"));
    let err = a.outcome().await.unwrap_err();
    let DriverError::Stalled { quarantined } = &err else { panic!("{err}") };
    assert_eq!(quarantined.len(), 1);
    assert_eq!(quarantined[0].0.as_str(), "s01");
    assert!(quarantined[0].1.as_deref().unwrap().contains("corrupt"));
    assert!(err.to_string().contains("requeue"), "the error says what to do: {err}");
    // With on_stall = warn the same job is a warning, not an error.
    let other = fresh_stores();
    let mut warn = config("w");
    warn.on_stall = OnStall::Warn;
    let w = start(&other, "w", planner(3, 20), src, warn);
    assert!(matches!(w.outcome().await.unwrap(), JobOutcome::Stalled { .. }));
}

#[tokio::test(start_paused = true)]
async fn scale_up_spreads_the_work_across_new_workers() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let a = start(&stores, "a", planner(8, 1000), source(&oracle), config("a"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b = start(&stores, "b", planner(8, 1000), source(&oracle), config("b"));
    let c = start(&stores, "c", planner(8, 1000), source(&oracle), config("c"));
    for h in [&a, &b, &c] {
        assert_eq!(h.outcome().await.unwrap(), JobOutcome::Complete);
    }
    oracle.assert_complete(8, 1000);
    let map = oracle.0.lock().unwrap();
    let mut by_worker: BTreeMap<String, usize> = BTreeMap::new();
    for v in map.values() {
        for r in v {
            *by_worker.entry(r.2.clone()).or_default() += 1;
        }
    }
    assert!(by_worker.len() == 3 && by_worker.values().all(|n| *n >= 1000), "work spread: {by_worker:?}");
}

#[tokio::test(start_paused = true)]
async fn a_second_live_process_with_the_same_instance_id_is_fatal() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let a = start(&stores, "a", planner(2, 2000), source(&oracle), config("a"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let twin = start(&stores, "a", planner(2, 2000), source(&oracle), config("a"));
    let err = twin.outcome().await.unwrap_err();
    assert!(err.to_string().contains("duplicate instance id a"), "{err}");
    assert_eq!(a.outcome().await.unwrap(), JobOutcome::Complete, "the original keeps running");
}

#[tokio::test(start_paused = true)]
async fn a_worker_with_another_planner_fingerprint_is_refused_naming_both() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let a = start(&stores, "a", planner(2, 50), source(&oracle), config("a"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut other = planner(2, 50);
    other.fingerprint = "test-planner/v2".into();
    let b = start(&stores, "b", other, source(&oracle), config("b"));
    let err = b.outcome().await.unwrap_err().to_string();
    assert!(err.contains("test-planner/v1") && err.contains("test-planner/v2"), "{err}");
    assert_eq!(a.outcome().await.unwrap(), JobOutcome::Complete);
}

#[tokio::test(start_paused = true)]
async fn invalid_knobs_are_rejected_naming_the_field() {
    let mut c = config("a");
    c.tuning.lease_duration = Duration::from_millis(2500);
    let err = CoordinationDriver::start(fresh_stores(), planner(1, 1), c).unwrap_err().to_string();
    assert!(err.contains("lease_duration"), "{err}");
    let mut c = config("a");
    c.tuning.max_in_flight = 0;
    let err = CoordinationDriver::start(fresh_stores(), planner(1, 1), c).unwrap_err().to_string();
    assert!(err.contains("max_in_flight"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_commit_whose_future_was_dropped_does_not_fail_the_next_one() {
    let stores = fresh_stores();
    let (handle, mut lanes) =
        CoordinationDriver::start(stores.clone(), planner(1, 10), config("a")).expect("valid config");
    let mut lane = lanes.next().await.expect("a lane");
    // The first commit is sent, then its future is dropped before the answer comes (a source
    // that gave up waiting). The next commit must wait for that answer, not collide with it.
    let cancelled = tokio::time::timeout(Duration::ZERO, lane.commit(progress(3))).await;
    assert!(cancelled.is_err(), "the first commit was still in flight");
    assert_eq!(lane.commit(progress(5)).await, CommitOutcome::Ok);
    lane.finish(progress(10)).await.expect("finished");
    assert_eq!(handle.outcome().await.unwrap(), JobOutcome::Complete);
}

/// Panics on its first call, never answers its second, then plans like `inner`.
#[derive(Clone)]
struct FlakyPlanner {
    inner: TestPlanner,
    calls: Arc<std::sync::atomic::AtomicU32>,
    /// Set when the hung call is dropped (aborted).
    hung_dropped: Arc<std::sync::atomic::AtomicBool>,
}

struct SetOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Planner for FlakyPlanner {
    fn fingerprint(&self) -> String {
        self.inner.fingerprint()
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        match self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => panic!("planner bug: listing page token missing"),
            1 => {
                let _guard = SetOnDrop(self.hung_dropped.clone());
                std::future::pending().await
            }
            _ => self.inner.plan().await,
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_planner_that_panics_or_hangs_is_retried_with_backoff_and_the_job_completes() {
    let stores = fresh_stores();
    let oracle = Oracle::default();
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let hung_dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flaky =
        FlakyPlanner { inner: planner(3, 20), calls: calls.clone(), hung_dropped: hung_dropped.clone() };
    let mut cfg = config("a");
    cfg.tuning.plan_timeout = Duration::from_secs(5);
    let t0 = tokio::time::Instant::now();
    let (handle, lanes) = CoordinationDriver::start(stores.clone(), flaky, cfg).expect("valid config");
    source(&oracle).spawn(lanes, "a".to_owned());
    assert_eq!(handle.outcome().await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(3, 20);
    // The panic was caught at once (not waited out), the hang timed out after plan_timeout,
    // each followed by a backoff (one heartbeat, then two).
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 3);
    let first_emit = oracle.first_emit_by("a").expect("records emitted");
    let waited = first_emit - t0;
    assert!(waited >= Duration::from_secs(5 + 1 + 2), "planning succeeded after {waited:?}");
    assert!(waited < Duration::from_secs(5 + 1 + 2 + 3), "planning succeeded after {waited:?}");
    assert!(hung_dropped.load(std::sync::atomic::Ordering::SeqCst), "the hung call was aborted, not leaked");
}
