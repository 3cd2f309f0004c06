//! What the driver suites share: a test planner, a source that records every emission in an
//! oracle (no loss, who emitted what), and a monitor of committed progress (I1).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::Prefix;
use etl_coordination_core::records::{self, SplitRecord};
use etl_coordination_driver::*;
use etl_coordination_memory::{MemoryStore, Store};
use futures_util::StreamExt;

/// Latest progress per key, and the regressions seen.
pub type Progress = (BTreeMap<String, u64>, Vec<String>);

#[derive(Clone, Default)]
pub struct ProgressMonitor(pub Arc<Mutex<Progress>>);

impl ProgressMonitor {
    pub fn spawn(stores: &JobStores<MemoryStore>) -> Self {
        let m = ProgressMonitor::default();
        let state = stores.state.clone();
        let inner = m.clone();
        tokio::spawn(async move {
            let mut w = state.watch(&Prefix::new("split.").unwrap()).await.unwrap();
            while let Some(Ok(ev)) = w.next().await {
                if let etl_coordination_core::WatchEvent::Put(e) = ev {
                    let rec: SplitRecord = records::decode(&e.value).unwrap();
                    let p = rec.progress.as_ref().map_or(0, decode);
                    let mut g = inner.0.lock().unwrap();
                    let prev = g.0.insert(e.key.to_string(), p).unwrap_or(0);
                    if p < prev {
                        g.1.push(format!("{}: progress regressed {prev} -> {p}", e.key));
                    }
                }
            }
        });
        m
    }

    pub fn assert_monotonic(&self) {
        let g = self.0.lock().unwrap();
        assert!(g.1.is_empty(), "I1 violated: {:?}", g.1);
        assert!(!g.0.is_empty(), "the monitor saw no commits");
    }
}

/// Splits `s00..` each with `records` records; the descriptor is the record count.
#[derive(Clone)]
pub struct TestPlanner {
    pub splits: usize,
    pub records: u64,
    pub fingerprint: String,
}

impl Planner for TestPlanner {
    fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        let descriptor = Bytes::copy_from_slice(&self.records.to_le_bytes());
        let split = |i: usize| {
            PlannedSplit::new(SplitId::new(format!("s{i:02}")).unwrap(), descriptor.clone(), 100 + i as u64)
        };
        Ok(Plan::new(PlanKind::Final, (0..self.splits).map(split).collect()))
    }
}

pub fn planner(splits: usize, records: u64) -> TestPlanner {
    TestPlanner { splits, records, fingerprint: "test-planner/v1".into() }
}

/// Every emitted record, per split: (record index, epoch, worker, when), and every commit
/// outcome per worker.
#[derive(Clone, Default)]
pub struct Oracle(pub Arc<Mutex<Emissions>>, pub Arc<Mutex<Vec<(String, CommitOutcome)>>>);

/// Per split: (record index, epoch, worker, when).
pub type Emissions = BTreeMap<SplitId, Vec<(u64, Epoch, String, tokio::time::Instant)>>;

impl Oracle {
    pub fn emit(&self, split: &SplitId, record: u64, epoch: Epoch, worker: &str) {
        let now = tokio::time::Instant::now();
        self.0.lock().unwrap().entry(split.clone()).or_default().push((
            record,
            epoch,
            worker.to_owned(),
            now,
        ));
    }

    pub fn committed(&self, worker: &str, outcome: CommitOutcome) {
        self.1.lock().unwrap().push((worker.to_owned(), outcome));
    }

    pub fn outcomes_of(&self, worker: &str) -> Vec<CommitOutcome> {
        self.1.lock().unwrap().iter().filter(|(w, _)| w == worker).map(|(_, o)| *o).collect()
    }

    /// First emission by `worker` of any split, if any.
    pub fn first_emit_by(&self, worker: &str) -> Option<tokio::time::Instant> {
        let map = self.0.lock().unwrap();
        map.values().flat_map(|v| v.iter()).filter(|r| r.2 == worker).map(|r| r.3).min()
    }

    /// Asserts no loss: every record of every split emitted at least once.
    pub fn assert_complete(&self, splits: usize, records: u64) {
        let map = self.0.lock().unwrap();
        for i in 0..splits {
            let id = SplitId::new(format!("s{i:02}")).unwrap();
            let seen: std::collections::BTreeSet<u64> =
                map.get(&id).map(|v| v.iter().map(|r| r.0).collect()).unwrap_or_default();
            let missing: Vec<u64> = (0..records).filter(|r| !seen.contains(r)).collect();
            assert!(missing.is_empty(), "split {id}: records {missing:?} never emitted");
        }
    }

    pub fn workers_of(&self, split: &str) -> Vec<String> {
        let map = self.0.lock().unwrap();
        let mut w: Vec<String> = map
            .get(&SplitId::new(split).unwrap())
            .map(|v| v.iter().map(|r| r.2.clone()).collect())
            .unwrap_or_default();
        w.dedup();
        w
    }
}

#[derive(Clone)]
pub struct Source {
    pub oracle: Oracle,
    pub record_delay: Duration,
    pub commit_every: u64,
    /// This split's lanes report it failed (until `fixed` is set).
    pub poison: Option<&'static str>,
    /// The cause of the poison is fixed: the split processes normally.
    pub fixed: Arc<AtomicBool>,
    /// This split's first N lanes hang at their start (a read that never answers) until they
    /// are told to stop; the stops they got are in `hung`.
    pub hang: Option<(&'static str, u32)>,
    pub hung: Arc<Mutex<Vec<Stop>>>,
    hangs: Arc<AtomicU32>,
}

pub fn progress(n: u64) -> Bytes {
    Bytes::copy_from_slice(&n.to_le_bytes())
}

pub fn decode(b: &Bytes) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap())
}

impl Source {
    pub fn spawn(self, mut lanes: Lanes, worker: String) {
        tokio::spawn(async move {
            while let Some(lane) = lanes.next().await {
                tokio::spawn(self.clone().process(lane, worker.clone()));
            }
        });
    }

    pub async fn process(self, mut lane: Lane, worker: String) {
        if let Some((split, times)) = self.hang
            && split == lane.split().as_str()
            && self.hangs.fetch_add(1, Ordering::SeqCst) < times
        {
            let stop = lane.revoked().await;
            self.hung.lock().unwrap().push(stop);
            if stop.reason == StopReason::Draining {
                lane.stopped();
            }
            return;
        }
        let total = decode(lane.descriptor());
        let mut next = lane.resume_from().map_or(0, decode);
        let mut since = 0;
        loop {
            if let Some(stop) = lane.stop_requested() {
                if stop.reason == StopReason::Draining {
                    if since > 0 {
                        let _ = lane.commit(progress(next)).await;
                    }
                    lane.stopped();
                }
                return;
            }
            if next == total {
                match lane.finish(progress(total)).await {
                    Ok(()) => return,
                    Err((l, CommitOutcome::Retryable)) => {
                        lane = l;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                    Err(_) => return,
                }
            }
            if self.poison == Some(lane.split().as_str()) && !self.fixed.load(Ordering::SeqCst) {
                lane.fail(format!("record {next} is corrupt"));
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(self.record_delay) => {}
                _ = lane.revoked() => continue,
            }
            self.oracle.emit(lane.split(), next, lane.epoch(), &worker);
            next += 1;
            since += 1;
            if since >= self.commit_every {
                let outcome = lane.commit(progress(next)).await;
                self.oracle.committed(&worker, outcome);
                match outcome {
                    CommitOutcome::Ok => since = 0,
                    CommitOutcome::Lost => return,
                    CommitOutcome::Retryable => {}
                }
            }
        }
    }
}

pub fn config(id: &str) -> DriverConfig {
    let mut config = DriverConfig::default();
    config.instance_id = Some(InstanceId::new(id).unwrap());
    config.tuning.lease_duration = Duration::from_secs(3);
    config.tuning.max_in_flight = 4;
    config.tuning.max_attempts = 3;
    config.tuning.drain_timeout = Duration::from_secs(2);
    config
}

pub fn fresh_stores() -> JobStores<MemoryStore> {
    stores_of("test")
}

/// Fresh stores of job `job` (the `coordination_job` metric label).
pub fn stores_of(job: &str) -> JobStores<MemoryStore> {
    // Logs of the driver, shown for failing tests (RUST_LOG=debug for more).
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    JobStores::memory(JobName::new(job).unwrap())
}

pub fn source(oracle: &Oracle) -> Source {
    Source {
        oracle: oracle.clone(),
        record_delay: Duration::from_millis(10),
        commit_every: 10,
        poison: None,
        fixed: Arc::default(),
        hang: None,
        hung: Arc::default(),
        hangs: Arc::default(),
    }
}

pub fn start(
    stores: &JobStores<MemoryStore>,
    id: &str,
    p: TestPlanner,
    src: Source,
    cfg: DriverConfig,
) -> DriverHandle {
    let (handle, lanes) = CoordinationDriver::start(stores.clone(), p, cfg).expect("valid config");
    src.spawn(lanes, id.to_owned());
    handle
}
