//! What every measurement runs: a source of splits with a fixed cost per record, a sink that
//! counts, a log of lane openings, and a store wrapper that counts operations per worker and
//! logs its acknowledged lease writes. Workers are in-process [`Pipeline`]s, each with a NATS
//! connection of its own, so what the store sees is what separate pods would make it see.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use etl_coordination_core::records::keys;
use etl_coordination_driver::{
    AcquisitionReason, CommitCadence, DriverConfig, DriverHandle, InstanceId, JobName, JobStores, LaneInfo,
    NatsConfig, NextRecord, Pipeline, Plan, PlanError, PlanKind, PlannedSplit, Planner, Sink, SinkError,
    SinkWriter, Source, SourceError, SplitId, SplitReader,
};
use etl_coordination_store::layers::{Call, CallOutcome, Counts, Observed, Op, StoreObserver};
use tokio::time::Instant;

/// A lane opened: when, by which worker, which split, why.
#[derive(Clone, Debug)]
pub struct Opened {
    pub at: Instant,
    pub worker: String,
    pub split: String,
    pub reason: Option<AcquisitionReason>,
}

/// Every lane opening of a run, in order, the distinct splits opened, and every lane that read
/// its split to the end (which worker's, when).
#[derive(Clone, Default)]
pub struct Log(
    Arc<Mutex<Vec<Opened>>>,
    Arc<Mutex<std::collections::BTreeSet<String>>>,
    Arc<Mutex<Vec<(String, Instant)>>>,
);

impl Log {
    /// When each worker's lanes read their splits to the end.
    pub fn ends(&self) -> Vec<(String, Instant)> {
        self.2.lock().unwrap().clone()
    }

    /// How many distinct splits were opened at least once.
    pub fn distinct(&self) -> usize {
        self.1.lock().unwrap().len()
    }

    pub fn all(&self) -> Vec<Opened> {
        self.0.lock().unwrap().clone()
    }

    /// Who opened each split last (its current holder while lanes run for ever).
    pub fn holders(&self) -> BTreeMap<String, String> {
        self.0.lock().unwrap().iter().map(|o| (o.split.clone(), o.worker.clone())).collect()
    }

    /// Splits per current holder.
    pub fn load(&self) -> BTreeMap<String, usize> {
        let mut load = BTreeMap::new();
        for w in self.holders().into_values() {
            *load.entry(w).or_default() += 1;
        }
        load
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Every (split, record) a tracked run emitted, and how many emissions repeated one.
pub type Seen = Arc<Mutex<(std::collections::HashSet<(String, u64)>, u64)>>;

/// `splits` splits of `records` records; each record costs `cost` of waiting (an I/O-bound
/// source: every system compared gets the same cost model, see [`WorkReader`]).
#[derive(Clone)]
pub struct Work {
    pub splits: usize,
    pub records: u64,
    pub cost: Duration,
    pub log: Log,
    /// Lane time and records of every lane that read its split to the end.
    pub paced: Arc<Mutex<(Duration, u64)>>,
    /// When the last record of any split was read (the data's makespan ends there).
    pub last_record: Arc<Mutex<Option<Instant>>>,
    /// Every (split, record) emitted, when tracked (see [`Work::tracked`]).
    pub seen: Option<Seen>,
    /// Each split's weight (plan order), when skewed (see [`Work::weighted`]); 1 each otherwise.
    pub weights: Option<Arc<Vec<u64>>>,
    /// Whether the plan reports `weights` to the planner's consumers (else weight 1 each: the
    /// balance a planner that reports no weight gets, by split count).
    pub report_weights: bool,
    /// When set, lane openings are only counted here instead of logged (see [`Work::light`]).
    pub openings: Option<Arc<Mutex<Openings>>>,
}

/// A worker's lane openings, counted without keeping them: how many, and the wall clock
/// (milliseconds since the Unix epoch) of the first; how many were a split's first claim
/// (`Create`: once per split, whoever makes it), and the last of those.
#[derive(Clone, Copy, Debug, Default)]
pub struct Openings {
    pub count: u64,
    pub first_ms: u64,
    pub creates: u64,
    pub last_create_ms: u64,
}

/// Milliseconds since the Unix epoch (comparable between processes on one machine).
pub use etl_coord::sink::unix_ms;

impl Work {
    pub fn new(splits: usize, records: u64, cost: Duration) -> Work {
        Work {
            splits,
            records,
            cost,
            log: Log::default(),
            paced: Arc::default(),
            last_record: Arc::default(),
            seen: None,
            weights: None,
            report_weights: false,
            openings: None,
        }
    }

    /// The same work counting its lane openings instead of logging each (a log entry per split
    /// would weigh on the memory T6 measures per worker process).
    pub fn light(mut self) -> Work {
        self.openings = Some(Arc::default());
        self
    }

    /// The same work with split `i` weighing `weights[i]`, reported in the plan when `report` (a
    /// planner that knows sizes) or not (every split weighs 1 to the protocol: balance by count).
    pub fn weighted(mut self, weights: Vec<u64>, report: bool) -> Work {
        assert_eq!(weights.len(), self.splits, "a weight per split");
        self.weights = Some(Arc::new(weights));
        self.report_weights = report;
        self
    }

    /// The true weight of each split, by id (1 each when the work is not skewed).
    pub fn weight_of(&self) -> BTreeMap<String, u64> {
        let ids = self.ids();
        match &self.weights {
            Some(w) => ids.into_iter().zip(w.iter().copied()).collect(),
            None => ids.into_iter().map(|id| (id, 1)).collect(),
        }
    }

    /// The same work, remembering every record emitted, so a run can tell records emitted twice
    /// from records never emitted (a count alone lets one hide the other).
    pub fn tracked(mut self) -> Work {
        self.seen = Some(Arc::default());
        self
    }

    /// A sink (ours or a peer's) emitted `record` of `split`.
    pub fn emitted(&self, split: &str, record: u64) {
        if let Some(seen) = &self.seen {
            let mut seen = seen.lock().unwrap();
            if !seen.0.insert((split.to_owned(), record)) {
                seen.1 += 1;
            }
        }
    }

    /// Distinct records emitted so far (tracked work only).
    pub fn distinct_emitted(&self) -> u64 {
        self.seen.as_ref().map_or(0, |s| s.lock().unwrap().0.len() as u64)
    }

    /// Emissions of a record emitted before (tracked work only): exact while lanes write, as
    /// they are counted under the lock that records first emissions.
    pub fn repeats(&self) -> u64 {
        self.seen.as_ref().map_or(0, |s| s.lock().unwrap().1)
    }

    /// The split ids of this work, in plan order.
    pub fn ids(&self) -> Vec<String> {
        (0..self.splits).map(|i| format!("s{i:06}")).collect()
    }

    /// Opens a lane on `split` for `worker` from record `from` (logged as every system's lane
    /// openings are): what our [`Source`] does, and what the peers call directly.
    pub fn reader(
        &self,
        worker: &str,
        split: &str,
        reason: Option<AcquisitionReason>,
        from: u64,
    ) -> WorkReader {
        let at = Instant::now();
        if let Some(openings) = &self.openings {
            let mut o = openings.lock().unwrap();
            let now = unix_ms();
            if o.count == 0 {
                o.first_ms = now;
            }
            o.count += 1;
            if reason == Some(AcquisitionReason::Create) {
                o.creates += 1;
                o.last_create_ms = now;
            }
        } else {
            self.log.1.lock().unwrap().insert(split.to_owned());
            self.log.0.lock().unwrap().push(Opened {
                at,
                worker: worker.to_owned(),
                split: split.to_owned(),
                reason,
            });
        }
        WorkReader {
            worker: worker.to_owned(),
            ends: self.log.2.clone(),
            next: from,
            start: from,
            total: self.records,
            cost: self.cost,
            opened: at,
            due: at,
            paced: self.paced.clone(),
            last_record: self.last_record.clone(),
        }
    }

    /// Seconds from `t0` to the last record read, if any.
    pub fn makespan_since(&self, t0: Instant) -> f64 {
        self.last_record.lock().unwrap().map_or(f64::NAN, |t| (t - t0).as_secs_f64())
    }

    /// Where the makespan since `t0` went, for workers of `lanes_per_worker` lanes (see
    /// [`Breakdown`]).
    pub fn breakdown(&self, t0: Instant, lanes_per_worker: usize) -> Breakdown {
        Breakdown::of(t0, &self.log.all(), &self.log.ends(), lanes_per_worker, self.ideal_lane_time())
    }

    /// The time one lane needs for its share of the work if lanes share it perfectly, times the
    /// number of lanes: the work itself, in lane-seconds.
    fn ideal_lane_time(&self) -> f64 {
        self.splits as f64 * self.records as f64 * self.cost.as_secs_f64()
    }

    /// The measured time per record of lanes that ran to the end (the cost model as each
    /// system experienced it, overheads inside the lane included), in milliseconds.
    pub fn measured_cost_ms(&self) -> f64 {
        let (time, records) = *self.paced.lock().unwrap();
        if records == 0 { f64::NAN } else { time.as_secs_f64() * 1e3 / records as f64 }
    }
}

impl Planner for Work {
    fn fingerprint(&self) -> String {
        format!("bench/v1 splits={} records={}", self.splits, self.records)
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        let weights = self.weight_of();
        let splits = self
            .ids()
            .into_iter()
            .map(|id| {
                let weight = if self.report_weights { weights[&id] } else { 1 };
                let id = SplitId::new(id).expect("valid id");
                PlannedSplit::new(id, Bytes::copy_from_slice(&self.records.to_le_bytes()), weight)
            })
            .collect();
        Ok(Plan::new(PlanKind::Final, splits))
    }
}

/// Reads a split of [`Work`]: record `k` after the lane opened is due `k x cost` later (an
/// absolute schedule: timer rounding does not add up, and every system gets the same pace; a
/// lane that was held up catches up at once, as a source with data waiting would).
pub struct WorkReader {
    worker: String,
    ends: Arc<Mutex<Vec<(String, Instant)>>>,
    next: u64,
    start: u64,
    total: u64,
    cost: Duration,
    opened: Instant,
    due: Instant,
    paced: Arc<Mutex<(Duration, u64)>>,
    last_record: Arc<Mutex<Option<Instant>>>,
}

impl Source for Work {
    type Record = u64;
    type Progress = u64;
    type Reader = WorkReader;

    async fn open(&self, lane: &LaneInfo, from: Option<u64>) -> Result<WorkReader, SourceError> {
        let total = u64::from_le_bytes(
            lane.descriptor().as_ref().try_into().map_err(|_| SourceError::unprocessable("descriptor"))?,
        );
        debug_assert_eq!(total, self.records);
        Ok(self.reader(&lane.instance().to_string(), lane.split().as_str(), lane.reason(), from.unwrap_or(0)))
    }
}

impl WorkReader {
    /// The next record, or `None` at the end of the split.
    pub async fn read(&mut self) -> Option<u64> {
        if self.next >= self.total {
            return None;
        }
        if !self.cost.is_zero() {
            self.due += self.cost;
            tokio::time::sleep_until(self.due).await;
            if self.next + 1 == self.total {
                let now = Instant::now();
                *self.last_record.lock().unwrap() = Some(now);
                self.ends.lock().unwrap().push((self.worker.clone(), now));
                let mut p = self.paced.lock().unwrap();
                p.0 += self.opened.elapsed();
                p.1 += self.total - self.start;
            }
        }
        self.next += 1;
        Some(self.next - 1)
    }

    /// The record a restart would resume from.
    pub fn position(&self) -> u64 {
        self.next
    }
}

impl SplitReader for WorkReader {
    type Record = u64;
    type Progress = u64;

    async fn next(&mut self) -> NextRecord<u64, u64> {
        Ok(self.read().await.map(|r| (r, r + 1)))
    }
}

/// Counts records; nothing to make durable.
#[derive(Clone, Default)]
pub struct Count(pub Arc<AtomicU64>, pub Option<Work>);

impl Sink<u64> for Count {
    type Writer = CountWriter;

    async fn open(&self, lane: &LaneInfo) -> Result<CountWriter, SinkError> {
        Ok(CountWriter(self.clone(), lane.split().to_string()))
    }
}

/// One lane's writer of a [`Count`] sink: the sink, and the lane's split.
pub struct CountWriter(Count, String);

impl SinkWriter<u64> for CountWriter {
    async fn write(&mut self, record: u64) -> Result<(), SinkError> {
        self.0.0.fetch_add(1, Ordering::Relaxed);
        if let Some(work) = &self.0.1 {
            work.emitted(&self.1, record);
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// A snapshot of [`Ops`].
#[derive(Clone, Copy, Debug, Default)]
pub struct OpCounts {
    pub writes: u64,
    pub reads: u64,
    pub watches: u64,
}

/// Store operations of one worker, by kind (the store crate's counting layer).
pub type Ops = Counts;

impl OpCounts {
    /// What `ops` counted so far.
    pub fn of(ops: &Ops) -> OpCounts {
        OpCounts {
            writes: ops.writes(),
            reads: ops.get(Op::Get) + ops.get(Op::List),
            watches: ops.get(Op::Watch),
        }
    }
}

impl std::ops::Sub for OpCounts {
    type Output = OpCounts;
    fn sub(self, o: OpCounts) -> OpCounts {
        OpCounts {
            writes: self.writes - o.writes,
            reads: self.reads - o.reads,
            watches: self.watches - o.watches,
        }
    }
}

/// Acknowledged writes to split leases, as the writing worker saw them: (when the store
/// answered, split, `true` for a claim or renewal, `false` for a release).
pub type LeaseAcks = Arc<Mutex<Vec<(Instant, String, bool)>>>;

/// What a benchmark worker's stores report: every call counted, and on the lease bucket when
/// split-lease writes were acknowledged.
pub struct BenchObserver {
    ops: Arc<Ops>,
    acks: Option<LeaseAcks>,
}

impl StoreObserver for BenchObserver {
    fn observe(&self, call: &Call<'_>) {
        self.ops.observe(call);
        if let (Some(acks), CallOutcome::Ok, Some(split)) =
            (&self.acks, call.outcome, call.key.and_then(keys::parse_split))
            && call.op.is_write()
        {
            acks.lock().unwrap().push((Instant::now(), split.to_string(), call.op != Op::Delete));
        }
    }
}

/// One benchmark job on one NATS deployment.
#[derive(Clone)]
pub struct Job {
    pub nats: NatsConfig,
    pub name: JobName,
    pub work: Work,
    pub lease: Duration,
    pub max_in_flight: u32,
    pub cadence: CommitCadence,
    /// `Tuning::handover_timeout`: 0 takes steals over at once (10 s is the default; each
    /// measurement sets it).
    pub handover: Duration,
}

/// A running worker of a [`Job`].
pub struct Worker {
    pub handle: DriverHandle,
    pub ops: Arc<Ops>,
    pub records: Count,
    /// Its acknowledged split-lease writes.
    pub acks: LeaseAcks,
}

static JOBS: AtomicU64 = AtomicU64::new(0);

impl Job {
    /// A fresh job (its own buckets) on `url`.
    pub fn new(url: &str, replicas: usize, what: &str, work: Work) -> Job {
        let n = JOBS.fetch_add(1, Ordering::Relaxed);
        let name = JobName::new(format!("bench-{what}-{}-{n}", std::process::id())).expect("valid job name");
        Job::named(url, replicas, name, work)
    }

    /// The job `name` on `url` (another process's, for a worker in a process of its own).
    pub fn named(url: &str, replicas: usize, name: JobName, work: Work) -> Job {
        let mut nats = NatsConfig::new(url);
        nats.replicas = replicas;
        Job {
            nats,
            name,
            work,
            lease: Duration::from_secs(3),
            max_in_flight: 8,
            cadence: CommitCadence::new(1_000, Duration::from_secs(1)),
            handover: etl_coordination_core::defaults::HANDOVER_TIMEOUT,
        }
    }

    pub async fn start(&self, id: &str) -> Result<Worker> {
        let stores = JobStores::nats(&self.nats, &self.name).await.context("connecting to NATS")?;
        let ops = Arc::new(Ops::default());
        let acks = LeaseAcks::default();
        let counted = |inner, acks| Observed::new(inner, BenchObserver { ops: ops.clone(), acks });
        let stores = JobStores::new(
            self.name.clone(),
            counted(stores.state, None),
            counted(stores.lease, Some(acks.clone())),
        );
        let mut config = DriverConfig::default();
        config.instance_id = Some(InstanceId::new(id)?);
        config.tuning.lease_duration = self.lease;
        config.tuning.max_in_flight = self.max_in_flight;
        config.tuning.handover_timeout = self.handover;
        config.tuning.drain_timeout = Duration::from_secs(5);
        let records = Count(Arc::default(), self.work.seen.is_some().then(|| self.work.clone()));
        let handle = Pipeline::new(stores, self.work.clone(), records.clone())
            .config(config)
            .commit_every(self.cadence)
            .start()?;
        Ok(Worker { handle, ops, records, acks })
    }
}

/// Waits (polling every 5 ms) until `done` holds; fails after `limit`.
pub async fn until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() > deadline {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Waits until every split of the job has a holder and no lane opened for `quiet` (a fleet
/// whose steals have stopped).
pub async fn until_quiet(log: &Log, splits: usize, quiet: Duration) -> Result<()> {
    until_settled("a fleet that stopped moving splits", Duration::from_secs(180), log, quiet, |log| {
        log.distinct() >= splits
    })
    .await
}

/// Waits until the current holders of the job's splits are `want` (worker -> splits), and no
/// lane opened for `quiet`.
pub async fn until_balanced(log: &Log, want: &BTreeMap<String, usize>, quiet: Duration) -> Result<()> {
    until_settled("a balanced fleet", Duration::from_secs(120), log, quiet, |log| &log.load() == want).await
}

/// Waits (at most `limit`) until `ready` holds and no lane opened for `quiet` since it began to.
async fn until_settled(
    what: &str,
    limit: Duration,
    log: &Log,
    quiet: Duration,
    ready: impl Fn(&Log) -> bool,
) -> Result<()> {
    let mut stable_since: Option<(Instant, usize)> = None;
    until(what, limit, || {
        let n = log.len();
        if !ready(log) {
            stable_since = None;
            return false;
        }
        match stable_since {
            Some((t, m)) if m == n => t.elapsed() >= quiet,
            _ => {
                stable_since = Some((Instant::now(), n));
                false
            }
        }
    })
    .await
}

/// Where a run's makespan went, from its lane openings and ends (every system reads through
/// [`WorkReader`], so every system gets the same accounting). Times in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Breakdown {
    /// From the start (before any set-up) to the first lane opened: connecting, buckets,
    /// election and plan publication (ours); creating and filling the table (PostgreSQL).
    pub setup: f64,
    /// From the first lane opened to the last of the fleet's lanes opened for the first time.
    pub ramp: f64,
    /// Mean time from a lane reading its split to the end to the same worker opening its next
    /// lane (release, claim or poll, descriptor read), over the hand-offs.
    pub gap_mean: f64,
    /// The hand-offs' time, summed and spread over the fleet's lanes (makespan seconds).
    pub gaps: f64,
    /// The longest hand-off: one stall on a lane of an evenly loaded fleet is the makespan's.
    pub gap_max: f64,
    /// Lane openings beyond one per split: splits moved mid-way (a steal, a takeover), each
    /// re-read from its last commit.
    pub moved: usize,
    /// From the first lane that ran out of work for good to the last record read.
    pub tail: f64,
    /// The work itself spread over the fleet's lanes: the makespan of a perfect fleet that
    /// needs no set-up.
    pub ideal: f64,
}

impl Breakdown {
    fn of(
        t0: Instant,
        opened: &[Opened],
        ends: &[(String, Instant)],
        per_worker: usize,
        work: f64,
    ) -> Breakdown {
        let secs = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
        let workers: std::collections::BTreeSet<&str> = opened.iter().map(|o| o.worker.as_str()).collect();
        let lanes = workers.len() * per_worker;
        let mut opens: Vec<Instant> = opened.iter().map(|o| o.at).collect();
        opens.sort();
        let first = opens.first().copied().unwrap_or(t0);
        let ramp = opens.get(lanes.saturating_sub(1)).map_or(f64::NAN, |at| secs(first, *at));
        // Each worker's lanes as slots reused in order: its k-th end frees the slot its
        // (k + lanes)-th opening takes. An end no later opening takes is a slot idle for good.
        let (mut handoffs, mut gap_total, mut gap_max, mut idle_from) =
            (0usize, 0.0, 0.0f64, None::<Instant>);
        for w in &workers {
            let mut o: Vec<Instant> = opened.iter().filter(|x| x.worker == *w).map(|x| x.at).collect();
            let mut e: Vec<Instant> = ends.iter().filter(|x| x.0 == *w).map(|x| x.1).collect();
            o.sort();
            e.sort();
            for (k, end) in e.iter().enumerate() {
                match o.get(k + per_worker) {
                    Some(next) => {
                        handoffs += 1;
                        gap_total += secs(*end, *next);
                        gap_max = gap_max.max(secs(*end, *next));
                    }
                    None => idle_from = Some(idle_from.map_or(*end, |i| i.min(*end))),
                }
            }
        }
        let last = ends.iter().map(|e| e.1).max().unwrap_or(first);
        Breakdown {
            setup: secs(t0, first),
            ramp,
            gap_mean: if handoffs == 0 { f64::NAN } else { gap_total / handoffs as f64 },
            gaps: gap_total / lanes.max(1) as f64,
            gap_max,
            moved: opened.len()
                - opened.iter().map(|o| o.split.as_str()).collect::<std::collections::BTreeSet<_>>().len(),
            tail: idle_from.map_or(f64::NAN, |i| secs(i, last)),
            ideal: work / lanes.max(1) as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breakdown_accounts_for_set_up_hand_offs_and_the_tail() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let open = |ms, worker: &str, split: &str| Opened {
            at: at(ms),
            worker: worker.into(),
            split: split.into(),
            reason: None,
        };
        // Two workers of one lane each: a opens s0 at 1 s and s2 after a 100 ms hand-off; b opens
        // s1 at 1.5 s and, with nothing left, idles from 3 s while a reads on to 4.1 s.
        let opened = [open(1000, "a", "s0"), open(1500, "b", "s1"), open(2100, "a", "s2")];
        let ends = [("a".to_owned(), at(2000)), ("b".to_owned(), at(3000)), ("a".to_owned(), at(4100))];
        let b = Breakdown::of(t0, &opened, &ends, 1, 3.0);
        let close = |x: f64, y: f64| (x - y).abs() < 1e-9;
        assert!(close(b.setup, 1.0) && close(b.ramp, 0.5), "{b:?}");
        assert!(close(b.gap_mean, 0.1) && close(b.gaps, 0.05) && close(b.gap_max, 0.1), "{b:?}");
        assert_eq!(b.moved, 0, "every split opened once");
        // The first lane idle for good is b's, from 3 s (a's last end frees no slot either, but
        // later); the last record is at 4.1 s.
        assert!(close(b.tail, 1.1) && close(b.ideal, 1.5), "{b:?}");
        // s1 stolen by a at 2.5 s: opened twice, one split moved.
        let stolen = [open(1000, "a", "s0"), open(1500, "b", "s1"), open(2500, "a", "s1")];
        assert_eq!(Breakdown::of(t0, &stolen, &ends, 1, 3.0).moved, 1);
    }
}
