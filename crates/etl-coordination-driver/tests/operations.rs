//! What an operator sees and does, through the driver against the memory store on paused
//! (virtual) tokio time: a lane that stalls, a record nobody can decode, and a worker that stays
//! after the job's end and takes up requeued work.

mod common;

use std::sync::OnceLock;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use etl_coordination_core::records::{self, LeaseRecord, SplitRecord, keys};
use etl_coordination_core::{Entry, Key, Prefix, Revision, StoreError};
use etl_coordination_driver::*;
use etl_coordination_memory::{MemoryStore, Store};
use etl_coordination_metrics::PrometheusHandle;
use etl_coordination_store::WatchStream;

/// One Prometheus recorder for the whole test binary; each test uses its own job name, so its
/// series are its own.
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| etl_coordination_metrics::install_prometheus().expect("one recorder"))
}

/// Fresh stores of `job`, with the recorder installed before anything records.
fn job_stores(job: &str) -> JobStores<MemoryStore> {
    let _ = prometheus();
    stores_of(job)
}

/// The value of one series of `job`'s worker `instance` (`extra` = further labels, e.g.
/// `,state="done"`).
fn metric(job: &str, instance: &str, family: &str, extra: &str) -> f64 {
    let text = prometheus().render();
    let series =
        format!(r#"{family}{{coordination_job="{job}",coordination_instance="{instance}"{extra}}} "#);
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
        .parse()
        .unwrap()
}

/// `f` within 10 minutes of (virtual) time: a state that never comes fails the test instead of
/// hanging it.
async fn within<T, E: std::fmt::Debug>(f: impl std::future::Future<Output = Result<T, E>>) -> T {
    tokio::time::timeout(Duration::from_secs(600), f).await.expect("in time").expect("the driver runs")
}

/// The worker's outcome, within 10 minutes of (virtual) time.
async fn outcome(h: &DriverHandle) -> Result<JobOutcome, DriverError> {
    tokio::time::timeout(Duration::from_secs(600), h.outcome()).await.expect("an outcome in time")
}

async fn record(stores: &JobStores<MemoryStore>, split: &str) -> (etl_coordination_core::Revision, Bytes) {
    let e = stores.state.get(&keys::split(&SplitId::new(split).unwrap())).await.unwrap().expect("a record");
    (e.revision, e.value)
}

/// When a record of `split` was first emitted, and by which tenancy (epoch).
fn first_emit_of(oracle: &Oracle, split: &str) -> Option<(tokio::time::Instant, Epoch)> {
    let map = oracle.0.lock().unwrap();
    map.get(&SplitId::new(split).unwrap())?.iter().map(|r| (r.3, r.1)).min()
}

#[tokio::test(start_paused = true)]
async fn a_stalled_lane_is_reported_and_kept_with_warn() {
    let stores = job_stores("stall-warn");
    let oracle = Oracle::default();
    let mut src = source(&oracle);
    src.hang = Some(("s01", 1));
    let mut cfg = config("a");
    cfg.lane_stall_timeout = Some(Duration::from_secs(20));
    let a = start(&stores, "a", planner(3, 20), src.clone(), cfg);
    tokio::time::sleep(Duration::from_secs(19)).await;
    assert_eq!(
        metric("stall-warn", "a", "etl_coordination_lanes_stalled", ""),
        0.0,
        "not before the timeout"
    );
    tokio::time::sleep(Duration::from_secs(41)).await;
    assert_eq!(metric("stall-warn", "a", "etl_coordination_lanes_stalled", ""), 1.0);
    assert_eq!(metric("stall-warn", "a", "etl_coordination_lane_stalls_total", ""), 1.0);
    // Reported, not released: the lane still holds the split, the job waits for it.
    assert!(src.hung.lock().unwrap().is_empty(), "the lane was not stopped");
    assert_eq!(*a.job_state().borrow(), JobState::Running);
    let (_, value) = record(&stores, "s01").await;
    let rec: SplitRecord = records::decode(&value).unwrap();
    assert_eq!((rec.epoch, rec.attempts), (Epoch(1), 0), "still the first tenancy");
    // A drain stops it like any lane; the gauge goes back to 0.
    a.drain();
    assert_eq!(outcome(&a).await.unwrap(), JobOutcome::Drained);
    assert_eq!(src.hung.lock().unwrap()[0].reason, StopReason::Draining);
    assert_eq!(metric("stall-warn", "a", "etl_coordination_lanes_stalled", ""), 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_stalled_lane_is_stopped_with_release_and_its_split_retried_from_committed_progress() {
    let stores = job_stores("stall-release");
    let oracle = Oracle::default();
    let mut src = source(&oracle);
    src.hang = Some(("s01", 1));
    let mut cfg = config("a");
    cfg.lane_stall_timeout = Some(Duration::from_secs(20));
    cfg.on_lane_stall = OnLaneStall::Release;
    cfg.tuning.claim_backoff = Duration::from_secs(5);
    let t0 = tokio::time::Instant::now();
    let a = start(&stores, "a", planner(3, 20), src.clone(), cfg);
    assert_eq!(outcome(&a).await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(3, 20);
    // The hung lane was told to stop at once (it no longer owns the split) ...
    let stops = src.hung.lock().unwrap().clone();
    assert_eq!(stops.iter().map(|s| s.reason).collect::<Vec<_>>(), vec![StopReason::Fenced]);
    // ... after the timeout, and the split was processed again by a new tenancy once its claim
    // backoff (5 s after the failure, P12) had passed.
    let (retried, epoch) = first_emit_of(&oracle, "s01").expect("s01 retried");
    assert_eq!(epoch, Epoch(2), "the hung tenancy emitted nothing; the next one did it all");
    assert!(retried - t0 >= Duration::from_secs(25), "retried after {:?}", retried - t0);
    assert!(retried - t0 < Duration::from_secs(30), "retried after {:?}", retried - t0);
    assert_eq!(metric("stall-release", "a", "etl_coordination_lane_stalls_total", ""), 1.0);
    assert_eq!(metric("stall-release", "a", "etl_coordination_lanes_stalled", ""), 0.0);
}

#[tokio::test(start_paused = true)]
async fn released_stalls_consume_attempts_so_a_split_that_always_hangs_is_quarantined() {
    let stores = job_stores("stall-poison");
    let oracle = Oracle::default();
    let mut src = source(&oracle);
    src.hang = Some(("s01", u32::MAX));
    let mut cfg = config("a");
    cfg.lane_stall_timeout = Some(Duration::from_secs(10));
    cfg.on_lane_stall = OnLaneStall::Release;
    cfg.on_stall = OnStall::Warn;
    let a = start(&stores, "a", planner(2, 20), src.clone(), cfg);
    let JobOutcome::Stalled { quarantined } = outcome(&a).await.unwrap() else { panic!("a stall") };
    assert_eq!(quarantined.len(), 1);
    assert_eq!(quarantined[0].0.as_str(), "s01");
    let error = quarantined[0].1.clone().unwrap_or_default();
    assert!(error.contains("lane stalled: no progress committed for 10s"), "{error}");
    assert_eq!(src.hung.lock().unwrap().len(), 3, "max_attempts (3) tenancies hung, each released");
}

#[tokio::test(start_paused = true)]
async fn a_record_nobody_can_decode_blocks_the_job_until_an_operator_resets_it() {
    let stores = job_stores("undecodable");
    let oracle = Oracle::default();
    let src = source(&oracle);
    let a = start(&stores, "a", planner(3, 100), src, config("a"));
    let mut state = a.job_state();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Another program (or a newer release) overwrites s01's record.
    let (rev, _) = record(&stores, "s01").await;
    let key = keys::split(&SplitId::new("s01").unwrap());
    let corrupt =
        stores.state.compare_and_swap(&key, rev, Bytes::from_static(b"\xffjunk"), None).await.unwrap();
    within(state.wait_for(|s| matches!(s, JobState::Blocked { undecodable: 1, missing: 0 }))).await;
    assert_eq!(metric("undecodable", "a", "etl_coordination_job_state", r#",state="blocked""#), 1.0);
    assert_eq!(metric("undecodable", "a", "etl_coordination_records_undecodable", r#",bucket="state""#), 1.0);
    // The rest of the job goes on; the job cannot complete.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(metric("undecodable", "a", "etl_coordination_splits", r#",state="done""#), 2.0);
    assert_eq!(metric("undecodable", "a", "etl_coordination_splits", r#",state="undecodable""#), 1.0);
    assert!(matches!(*state.borrow(), JobState::Blocked { .. }));
    // The operator's reset: the split starts over, the job completes with nothing lost.
    let lease =
        stores.lease.get(&key).await.unwrap().and_then(|e| records::decode::<LeaseRecord>(&e.value).ok());
    let reset = SplitRecord::reset(Some((corrupt, None)), lease.map(|l| l.epoch));
    stores.state.compare_and_swap(&key, corrupt, records::encode(&reset), None).await.unwrap();
    assert_eq!(outcome(&a).await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(3, 100);
    assert_eq!(metric("undecodable", "a", "etl_coordination_records_undecodable", r#",bucket="state""#), 0.0);
    assert_eq!(metric("undecodable", "a", "etl_coordination_job_state", r#",state="complete""#), 1.0);
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_stays_after_a_stall_takes_up_the_requeued_split_and_completes() {
    let stores = job_stores("stay");
    let oracle = Oracle::default();
    let mut src = source(&oracle);
    src.poison = Some("s01");
    let mut cfg = config("a");
    cfg.tuning.max_attempts = 1;
    cfg.on_stall = OnStall::Warn;
    cfg.stay_after_end = true;
    let a = start(&stores, "a", planner(3, 20), src.clone(), cfg);
    let mut state = a.job_state();
    within(state.wait_for(|s| matches!(s, JobState::Stalled { .. }))).await;
    assert_eq!(metric("stay", "a", "etl_coordination_job_state", r#",state="stalled""#), 1.0);
    // It stays: no outcome while nobody drains it.
    assert!(tokio::time::timeout(Duration::from_secs(60), a.outcome()).await.is_err());
    // The operator fixes the cause and requeues the split.
    src.fixed.store(true, Ordering::SeqCst);
    let (rev, value) = record(&stores, "s01").await;
    let rec: SplitRecord = records::decode(&value).unwrap();
    let key = keys::split(&SplitId::new("s01").unwrap());
    stores.state.compare_and_swap(&key, rev, records::encode(&rec.requeued()), None).await.unwrap();
    within(state.wait_for(|s| *s == JobState::Complete)).await;
    oracle.assert_complete(3, 20);
    // Drained, it reports the job's end as its outcome.
    a.drain();
    assert_eq!(outcome(&a).await.unwrap(), JobOutcome::Complete);
}

#[tokio::test(start_paused = true)]
async fn a_fatal_stall_ends_a_worker_that_would_stay_after_the_end() {
    let stores = job_stores("stay-fatal");
    let oracle = Oracle::default();
    let mut src = source(&oracle);
    src.poison = Some("s01");
    let mut cfg = config("a");
    cfg.tuning.max_attempts = 1;
    cfg.stay_after_end = true;
    let a = start(&stores, "a", planner(2, 20), src, cfg);
    let err = outcome(&a).await.unwrap_err();
    assert!(matches!(err, DriverError::Stalled { .. }), "{err}");
}

#[test]
fn a_lane_stall_timeout_under_a_second_is_refused_naming_the_field() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut cfg = config("a");
        for t in [Duration::ZERO, Duration::from_millis(500)] {
            cfg.lane_stall_timeout = Some(t);
            let err = CoordinationDriver::start(fresh_stores(), planner(1, 1), cfg.clone())
                .unwrap_err()
                .to_string();
            assert!(err.contains("lane_stall_timeout") && err.contains("at least 1s"), "{err}");
        }
    });
}

#[tokio::test(start_paused = true)]
async fn a_reset_of_a_split_in_work_fences_its_holder_and_the_split_starts_over() {
    let stores = job_stores("reset-owned");
    let oracle = Oracle::default();
    let a = start(&stores, "a", planner(2, 200), source(&oracle), config("a"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let key = keys::split(&SplitId::new("s01").unwrap());
    let (rev, value) = record(&stores, "s01").await;
    let before: SplitRecord = records::decode(&value).unwrap();
    assert_eq!(before.state, etl_coordination_core::records::SplitState::Owned);
    assert!(before.progress.is_some(), "the holder committed progress: {before:?}");
    // The operator's reset while the lane runs.
    let lease =
        stores.lease.get(&key).await.unwrap().and_then(|e| records::decode::<LeaseRecord>(&e.value).ok());
    let reset = SplitRecord::reset(Some((rev, Some(&before))), lease.map(|l| l.epoch));
    stores.state.compare_and_swap(&key, rev, records::encode(&reset), None).await.unwrap();
    assert_eq!(outcome(&a).await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(2, 200);
    // The holder stopped (nothing it emitted after the reset was committed) and a new tenancy
    // under a higher epoch processed the split again from its first record.
    let map = oracle.0.lock().unwrap();
    let s01 = &map[&SplitId::new("s01").unwrap()];
    assert!(
        s01.iter().any(|(record, epoch, _, _)| *record == 0 && *epoch > reset.epoch),
        "record 0 emitted again by a tenancy after the reset"
    );
    assert!(s01.iter().all(|(_, epoch, _, _)| *epoch == before.epoch || *epoch > reset.epoch));
}

/// A store whose every request is answered after `delay` (a slow or far-away server), with a
/// request budget of its own (`budget`), as the NATS backend has.
#[derive(Clone)]
struct Slow {
    inner: MemoryStore,
    delay: Duration,
    budget: Duration,
}

impl Store for Slow {
    async fn create(&self, key: &Key, value: Bytes, ttl: Option<Duration>) -> Result<Revision, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.create(key, value, ttl).await
    }
    async fn compare_and_swap(
        &self,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.compare_and_swap(key, expected, value, ttl).await
    }
    async fn delete(&self, key: &Key, expected: Revision) -> Result<(), StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.delete(key, expected).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.get(key).await
    }
    async fn watch(&self, prefix: &Prefix) -> Result<WatchStream, StoreError> {
        self.inner.watch(prefix).await
    }
    async fn list(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.list(prefix).await
    }
    fn op_timeout(&self) -> Option<Duration> {
        Some(self.budget)
    }
}

fn slow_stores(job: &str, delay: Duration, budget: Duration) -> JobStores<Slow> {
    let s = job_stores(job);
    let slow = |inner| Slow { inner, delay, budget };
    JobStores::new(s.job.clone(), slow(s.state), slow(s.lease))
}

/// A worker on a store answering every request after 6 s, with a lease long enough for it.
fn slow_worker(stores: JobStores<Slow>, op_timeout: Option<Duration>, oracle: &Oracle) -> DriverHandle {
    let mut cfg = config("a");
    cfg.tuning.lease_duration = Duration::from_secs(60);
    cfg.op_timeout = op_timeout;
    let (handle, lanes) = CoordinationDriver::start(stores, planner(2, 20), cfg).expect("valid config");
    source(oracle).spawn(lanes, "a".into());
    handle
}

#[tokio::test(start_paused = true)]
async fn requests_are_timed_out_at_the_stores_own_budget_even_above_five_seconds() {
    // The store gives each request 30 s (NatsConfig::op_timeout, `--nats-op-timeout 30s`) and
    // answers every one after 6 s: the worker waits for the answers (a 5 s cap of the driver's
    // own would time every request out, and the job would never start).
    let oracle = Oracle::default();
    let stores = slow_stores("slow-store-budget", Duration::from_secs(6), Duration::from_secs(30));
    let a = slow_worker(stores, None, &oracle);
    assert_eq!(outcome(&a).await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(2, 20);
}

#[tokio::test(start_paused = true)]
async fn a_configured_op_timeout_overrides_the_stores_budget() {
    // The same store, the driver configured to give up after 2 s: no request is ever answered
    // in time, so nothing is claimed (every write in doubt, every read unavailable).
    let oracle = Oracle::default();
    let stores = slow_stores("slow-store-override", Duration::from_secs(6), Duration::from_secs(30));
    let a = slow_worker(stores, Some(Duration::from_secs(2)), &oracle);
    assert!(tokio::time::timeout(Duration::from_secs(120), a.outcome()).await.is_err(), "no outcome");
    assert_eq!(oracle.first_emit_by("a"), None);
    a.kill();
}

#[tokio::test(start_paused = true)]
async fn a_store_budget_under_five_seconds_does_not_cut_the_drivers_wait_below_five() {
    // A store that bounds each of its round trips by 2 s may need several for one request
    // (a NATS listing, a create): here every request takes 3 s, and the driver waits up to its
    // 5 s default, as it did before stores had a budget of their own.
    let oracle = Oracle::default();
    let stores = slow_stores("slow-store-short-budget", Duration::from_secs(3), Duration::from_secs(2));
    let a = slow_worker(stores, None, &oracle);
    assert_eq!(outcome(&a).await.unwrap(), JobOutcome::Complete);
    oracle.assert_complete(2, 20);
}

#[test]
fn a_zero_op_timeout_is_refused_naming_the_field() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut cfg = config("a");
        cfg.op_timeout = Some(Duration::ZERO);
        let err = CoordinationDriver::start(fresh_stores(), planner(1, 1), cfg).unwrap_err().to_string();
        assert!(err.contains("op_timeout") && err.contains("positive"), "{err}");
    });
}
