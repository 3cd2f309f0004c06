//! The simulated world: workers, lanes, the store model, the fault injector and the event loop.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::records::{self, PlanHead, SplitRecord, keys};
use etl_coordination_core::{
    AcquisitionReason, Action, Bucket, CommitOutcome, Config, Epoch, Event, FatalError, Incarnation, Input,
    InstanceId, OpId, Outcome, Owner, Plan, PlanKind, PlannedSplit, SplitId, StopReason, StoreError,
    StoreReply, StoreRequest, StoreResult, Timestamp, Tuning, WatchEvent, WatchId, Worker,
};
use etl_coordination_memory::MemoryKv;

use crate::check::{Checker, Violation, progress_of};
use crate::rng::Rng;

/// What a run sets out to show.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// Random faults in a safety phase, then a fault-free liveness phase.
    Random,
    /// One worker, then scale-up to three: converges to +-1 and steals stop (I7, T4).
    Balance,
    /// One of two workers drains: its splits are picked up without a lease wait (P10, I8).
    DrainPickup,
    /// A second live process with the same instance id: fatal, no ping-pong (P3).
    DuplicateId,
}

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct Options {
    /// What to run.
    pub scenario: Scenario,
    /// Workers at start.
    pub initial_workers: usize,
    /// Upper bound for scale-up.
    pub max_workers: usize,
    /// Splits in the full plan.
    pub splits: usize,
    /// Records per split are drawn from `1..=max_records`.
    pub max_records: u64,
    /// Every split has exactly `max_records` records.
    pub uniform_records: bool,
    /// Virtual milliseconds between two records of a lane.
    pub step_ms: u64,
    /// Lease duration in whole seconds.
    pub lease_secs: u64,
    /// Knob.
    pub max_in_flight: u32,
    /// Knob.
    pub max_attempts: u32,
    /// Records between two commits of a lane.
    pub commit_every: u64,
    /// Inject faults in the safety phase.
    pub faults: bool,
    /// Length of the safety phase.
    pub safety: Duration,
    /// How long the liveness phase may take before I8 is declared violated.
    pub liveness_limit: Duration,
    /// Start with an open plan that grows, then turns final.
    pub open_plan: bool,
    /// Splits whose processing crashes the owner every time.
    pub poison_crash: usize,
    /// Splits the source reports unprocessable every time.
    pub poison_unprocessable: usize,
}

impl Options {
    /// The randomized options the sweep uses for `seed`.
    pub fn for_seed(seed: u64) -> Self {
        let mut r = Rng::new(seed ^ 0x5eed);
        let splits = r.range(1, 24) as usize;
        Options {
            scenario: Scenario::Random,
            initial_workers: r.range(1, 4) as usize,
            max_workers: 6,
            splits,
            max_records: r.range(20, 600),
            uniform_records: false,
            step_ms: r.range(5, 40),
            lease_secs: r.range(2, 5),
            max_in_flight: r.range(1, 6) as u32,
            max_attempts: r.range(2, 5) as u32,
            commit_every: r.range(1, 12),
            faults: true,
            safety: Duration::from_secs(r.range(10, 40)),
            liveness_limit: Duration::from_secs(900),
            open_plan: r.chance(0.3),
            poison_crash: if r.chance(0.2) { 1 } else { 0 },
            poison_unprocessable: if r.chance(0.2) { 1 } else { 0 },
        }
    }

    /// A small fault-free configuration for a named scenario.
    pub fn scenario(scenario: Scenario) -> Self {
        let base = Options {
            scenario,
            initial_workers: 2,
            max_workers: 3,
            splits: 12,
            max_records: 40,
            uniform_records: true,
            step_ms: 10,
            lease_secs: 3,
            max_in_flight: 8,
            max_attempts: 4,
            commit_every: 5,
            faults: false,
            safety: Duration::ZERO,
            liveness_limit: Duration::from_secs(900),
            open_plan: false,
            poison_crash: 0,
            poison_unprocessable: 0,
        };
        match scenario {
            Scenario::Random => base,
            // 13 splits over 3 workers: fair share 5, so balance is 5/4/4, the case where a
            // steal rule without the +2 margin oscillates.
            Scenario::Balance => Options { initial_workers: 1, splits: 13, max_records: 6000, ..base },
            Scenario::DrainPickup => Options { splits: 4, max_in_flight: 4, max_records: 600, ..base },
            Scenario::DuplicateId => Options { max_records: 800, ..base },
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Events processed.
    pub events: u64,
    /// Virtual time at the end.
    pub virtual_time: Duration,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// Invariant checks executed, by rule.
    pub checks: BTreeMap<&'static str, u64>,
    /// Acquisitions by reason.
    pub acquisitions: BTreeMap<&'static str, u64>,
    /// `complete`, `stalled`, or `none`.
    pub outcome: &'static str,
    /// Records in the input.
    pub records_total: u64,
    /// Records emitted, replays included.
    pub records_emitted: u64,
    /// Steals after the last fault (liveness phase).
    pub steals_after_faults: u64,
    /// Splits planted as poison (crash or unprocessable).
    pub poison_splits: usize,
    /// Splits quarantined at the end.
    pub quarantined: usize,
    /// Fatal errors reported by workers.
    pub fatal: Vec<String>,
    /// Balance scenario: steals until the convergence probe (T4).
    pub steals_to_converge: u64,
    /// Balance scenario: splits owned per worker after convergence.
    pub owned_after_convergence: Vec<u32>,
    /// Drain scenario: slowest release-to-pickup, in milliseconds.
    pub max_pickup_ms: Option<f64>,
    /// A hash over the whole event sequence: equal seeds give equal hashes.
    pub trace_hash: u64,
    /// The first broken invariant, if any.
    pub violation: Option<Violation>,
}

#[derive(Debug)]
enum Ev {
    ToWorker { slot: usize, life: u32, input: Input },
    Tick { slot: usize, life: u32 },
    StoreOp { slot: usize, life: u32, op: OpId, bucket: Bucket, request: StoreRequest, fate: Fate },
    OpenWatch { slot: usize, life: u32, watch: WatchId },
    LaneStep { slot: usize, life: u32, split: SplitId, epoch: Epoch },
    ExpiryTick,
    FaultTick,
    Restart { slot: usize },
    Crash { slot: usize, life: u32 },
    Resume { slot: usize },
    EndSafety,
    Probe,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Normal,
    LostRequest,
    LostResponse,
}

struct Scheduled {
    at: Timestamp,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Running,
    Paused,
    Crashed { restart: bool },
    Finished,
}

struct Lane {
    epoch: Epoch,
    next: u64,
    total: u64,
    since_commit: u64,
    committing: bool,
    draining: bool,
}

struct Slot {
    instance: InstanceId,
    life: u32,
    owner: Owner,
    core: Option<Worker>,
    status: Status,
    inbox: Vec<Ev>,
    tick_at: Option<Timestamp>,
    lanes: BTreeMap<SplitId, Lane>,
    /// The id to restart with (a crash may switch to a new id).
    restart_as: Option<InstanceId>,
    /// Asked to drain (scale-down): no longer counts as a live worker for fault decisions.
    draining: bool,
    outcome: Option<Outcome>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Poison {
    None,
    Crash(u64),
    Unprocessable(u64),
}

struct SplitSpec {
    id: SplitId,
    weight: u64,
    total: u64,
    poison: Poison,
    discovered_at: Timestamp,
}

struct Sub {
    slot: usize,
    life: u32,
    watch: WatchId,
    last_at: Timestamp,
}

struct World {
    opts: Options,
    seed: u64,
    rng: Rng,
    now: Timestamp,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    state: MemoryKv,
    lease: MemoryKv,
    subs: Vec<Sub>,
    slots: Vec<Slot>,
    splits: Vec<SplitSpec>,
    split_index: BTreeMap<SplitId, usize>,
    checker: Checker,
    report: Report,
    faults_on: bool,
    outage_until: Timestamp,
    open_until: Timestamp,
    next_instance: u32,
    safety_over: bool,
    released_at: BTreeMap<SplitId, Timestamp>,
    hash: u64,
    trace: bool,
    balance_window_closed: bool,
}

/// A run that needs more events than this is livelocked.
const MAX_EVENTS: u64 = 3_000_000;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

/// Runs one simulation.
pub fn run(seed: u64, opts: &Options) -> Report {
    let mut w = World::new(seed, opts.clone());
    w.run();
    w.finish()
}

impl World {
    fn new(seed: u64, opts: Options) -> Self {
        let mut rng = Rng::new(seed);
        let mut splits = Vec::new();
        let open_until = if opts.open_plan {
            Timestamp::ZERO + Duration::from_secs(rng.range(3, 15))
        } else {
            Timestamp::ZERO
        };
        for i in 0..opts.splits {
            let total = if opts.uniform_records {
                opts.max_records.max(1)
            } else {
                rng.range(1, opts.max_records.max(1))
            };
            let poison = if i < opts.poison_crash {
                Poison::Crash(rng.range(0, total - 1))
            } else if i < opts.poison_crash + opts.poison_unprocessable {
                Poison::Unprocessable(rng.range(0, total - 1))
            } else {
                Poison::None
            };
            let discovered_at =
                if opts.open_plan && i > 0 { Timestamp(rng.range(0, open_until.0)) } else { Timestamp::ZERO };
            splits.push(SplitSpec {
                id: SplitId::new(format!("s{i:04}")).expect("valid id"),
                weight: rng.range(1, 1000),
                total,
                poison,
                discovered_at,
            });
        }
        let totals = splits.iter().map(|s| (s.id.clone(), s.total)).collect();
        let split_index = splits.iter().enumerate().map(|(i, s)| (s.id.clone(), i)).collect();
        let checker = Checker::new(opts.max_attempts, &totals, opts.commit_every * 2 + 2);
        let report = Report {
            seed,
            records_total: splits.iter().map(|s| s.total).sum(),
            outcome: "none",
            poison_splits: opts.poison_crash + opts.poison_unprocessable,
            ..Report::default()
        };
        World {
            faults_on: opts.faults,
            opts,
            seed,
            rng,
            now: Timestamp::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            state: MemoryKv::new(),
            lease: MemoryKv::new(),
            subs: Vec::new(),
            slots: Vec::new(),
            splits,
            split_index,
            checker,
            report,
            outage_until: Timestamp::ZERO,
            open_until,
            next_instance: 0,
            safety_over: false,
            released_at: BTreeMap::new(),
            hash: 0xcbf2_9ce4_8422_2325,
            trace: std::env::var_os("SIM_TRACE").is_some(),
            balance_window_closed: false,
        }
    }

    fn schedule(&mut self, after: Duration, ev: Ev) {
        self.schedule_at(self.now + after, ev);
    }

    fn schedule_at(&mut self, at: Timestamp, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled { at: at.max(self.now), seq: self.seq, ev }));
    }

    fn mix(&mut self, x: u64) {
        self.hash ^= x;
        self.hash = self.hash.wrapping_mul(0x0100_0000_01b3);
    }

    fn fault(&mut self, kind: &'static str) {
        *self.report.faults.entry(kind).or_default() += 1;
    }

    fn new_instance_id(&mut self) -> InstanceId {
        self.next_instance += 1;
        InstanceId::new(format!("w{}", self.next_instance)).expect("valid id")
    }

    fn add_worker(&mut self, instance: InstanceId) -> usize {
        self.slots.push(Slot {
            instance: instance.clone(),
            life: 0,
            owner: Owner { instance, incarnation: Incarnation(0) },
            core: None,
            status: Status::Crashed { restart: true },
            inbox: Vec::new(),
            tick_at: None,
            lanes: BTreeMap::new(),
            restart_as: None,
            outcome: None,
            draining: false,
        });
        let slot = self.slots.len() - 1;
        self.start_worker(slot);
        slot
    }

    fn start_worker(&mut self, slot: usize) {
        let incarnation = Incarnation(self.rng.next_u64());
        let s = &mut self.slots[slot];
        if let Some(id) = s.restart_as.take() {
            s.instance = id;
        }
        s.life += 1;
        s.owner = Owner { instance: s.instance.clone(), incarnation };
        let mut cfg = Config::new(s.instance.clone(), incarnation, "sim-planner-v1");
        cfg.tuning = Tuning {
            lease_duration: Duration::from_secs(self.opts.lease_secs),
            max_in_flight: self.opts.max_in_flight,
            max_attempts: self.opts.max_attempts,
            replan_interval: Duration::from_secs(2),
            drain_timeout: Duration::from_secs(2),
        };
        cfg.validate().expect("sim config is valid");
        s.core = Some(Worker::new(cfg));
        s.status = Status::Running;
        s.draining = false;
        s.tick_at = None;
        s.inbox.clear();
        s.lanes.clear();
        self.deliver(slot, Input::Start);
    }

    fn run(&mut self) {
        match self.opts.scenario {
            Scenario::DuplicateId => {
                let id = self.new_instance_id();
                self.add_worker(id.clone());
                let other = self.new_instance_id();
                self.add_worker(other);
                // The twin starts once the first one is established.
                self.schedule(Duration::from_secs(2), Ev::Probe);
            }
            _ => {
                for _ in 0..self.opts.initial_workers {
                    let id = self.new_instance_id();
                    self.add_worker(id);
                }
            }
        }
        self.schedule(ms(250), Ev::ExpiryTick);
        if self.opts.faults {
            let first = ms(self.rng.range(300, 2000));
            self.schedule(first, Ev::FaultTick);
        }
        self.schedule_at(Timestamp::ZERO + self.opts.safety, Ev::EndSafety);
        if matches!(self.opts.scenario, Scenario::Balance | Scenario::DrainPickup) {
            self.schedule(Duration::from_secs(3), Ev::Probe);
        }
        let limit = Timestamp::ZERO + self.opts.safety + self.opts.liveness_limit;
        while let Some(Reverse(s)) = self.queue.pop() {
            if self.checker.violation.is_some() {
                break;
            }
            if s.at > limit {
                let open: Vec<String> = self
                    .slots
                    .iter()
                    .filter(|s| {
                        matches!(
                            s.status,
                            Status::Running | Status::Paused | Status::Crashed { restart: true }
                        )
                    })
                    .map(|s| s.instance.to_string())
                    .collect();
                self.checker.fail(
                    self.now,
                    "I8",
                    format!("no outcome within the liveness bound; still running: {open:?}"),
                );
                break;
            }
            self.now = s.at;
            self.report.events += 1;
            if self.report.events > MAX_EVENTS {
                self.checker.fail(
                    self.now,
                    "I8",
                    format!("event storm: more than {MAX_EVENTS} events (a livelock)"),
                );
                break;
            }
            if self.trace {
                eprintln!("{:>12} {:?}", self.now.0, s.ev);
            }
            self.mix(s.at.0);
            self.mix(s.seq);
            self.dispatch(s.ev);
            if self.safety_over && self.all_done() {
                break;
            }
        }
    }

    fn all_done(&self) -> bool {
        self.slots.iter().all(|s| matches!(s.status, Status::Finished | Status::Crashed { restart: false }))
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::ToWorker { slot, life, input } => {
                if self.slots[slot].life != life {
                    return;
                }
                if self.slots[slot].status == Status::Paused {
                    return self.slots[slot].inbox.push(Ev::ToWorker { slot, life, input });
                }
                self.deliver(slot, input);
            }
            Ev::Tick { slot, life } => {
                let s = &self.slots[slot];
                if s.life != life || s.tick_at != Some(self.now) {
                    return;
                }
                if s.status == Status::Paused {
                    return self.slots[slot].inbox.push(Ev::Tick { slot, life });
                }
                self.slots[slot].tick_at = None;
                self.deliver(slot, Input::Tick);
            }
            Ev::StoreOp { slot, life, op, bucket, request, fate } => {
                self.store_op(slot, life, op, bucket, request, fate)
            }
            Ev::OpenWatch { slot, life, watch } => self.open_watch(slot, life, watch),
            Ev::LaneStep { slot, life, split, epoch } => {
                if self.slots[slot].life != life {
                    return;
                }
                if self.slots[slot].status == Status::Paused {
                    return self.slots[slot].inbox.push(Ev::LaneStep { slot, life, split, epoch });
                }
                self.lane_step(slot, split, epoch);
            }
            Ev::ExpiryTick => {
                // NATS's expiry timer fires every 250 ms: expiries are 0-250 ms late, never early.
                self.state.expire(self.now);
                self.lease.expire(self.now);
                self.distribute(Bucket::State);
                self.distribute(Bucket::Lease);
                self.schedule(ms(250), Ev::ExpiryTick);
            }
            Ev::FaultTick => {
                if self.faults_on {
                    self.inject_fault();
                    let next = ms(self.rng.range(300, 3000));
                    self.schedule(next, Ev::FaultTick);
                }
            }
            Ev::Restart { slot } => {
                if matches!(self.slots[slot].status, Status::Crashed { restart: true }) {
                    self.start_worker(slot);
                }
            }
            Ev::Resume { slot } => self.resume(slot),
            Ev::Crash { slot, life } => {
                if self.slots[slot].life == life && self.faults_on {
                    self.crash(slot, true);
                }
            }
            Ev::EndSafety => self.end_safety(),
            Ev::Probe => self.probe(),
        }
    }

    // ----- workers -----

    fn deliver(&mut self, slot: usize, input: Input) {
        let now = self.now;
        let Some(core) = self.slots[slot].core.as_mut() else { return };
        if core.is_stopped() {
            return;
        }
        let actions = core.handle(now, input);
        let deadline = core.next_deadline();
        self.mix(actions.len() as u64);
        for a in actions {
            self.act(slot, a);
            if self.slots[slot].core.is_none() {
                return; // crashed while acting (poison)
            }
        }
        let s = &mut self.slots[slot];
        if let Some(d) = deadline
            && s.tick_at.is_none_or(|t| t != d)
        {
            s.tick_at = Some(d.max(now));
            let life = s.life;
            self.schedule_at(d.max(now), Ev::Tick { slot, life });
        }
    }

    fn act(&mut self, slot: usize, action: Action) {
        let life = self.slots[slot].life;
        if self.trace {
            eprintln!("{:>12}   {} -> {:?}", self.now.0, self.slots[slot].owner, action);
        }
        match action {
            Action::Store { op, bucket, request } => {
                let fate = if self.faults_on && self.rng.chance(0.01) {
                    if self.rng.chance(0.5) { Fate::LostRequest } else { Fate::LostResponse }
                } else {
                    Fate::Normal
                };
                let lat = us(self.rng.range(100, 1500));
                self.schedule(lat, Ev::StoreOp { slot, life, op, bucket, request, fate });
            }
            Action::Watch { watch } => {
                let lat = us(self.rng.range(100, 1500));
                self.schedule(lat, Ev::OpenWatch { slot, life, watch });
            }
            Action::Plan { request } => {
                let plan = self.plan();
                let delay = ms(self.rng.range(1, 40));
                self.schedule(
                    delay,
                    Ev::ToWorker { slot, life, input: Input::PlanReady { request, result: Ok(plan) } },
                );
                if self.faults_on && self.rng.chance(0.25) {
                    // Leader death mid-plan.
                    let when = ms(self.rng.range(0, 60));
                    self.fault("leader_killed_mid_plan");
                    self.schedule(when, Ev::Crash { slot, life });
                }
            }
            Action::StartLane { split, epoch, descriptor, progress, .. } => {
                self.start_lane(slot, split, epoch, descriptor, progress)
            }
            Action::StopLane { split, epoch, reason, .. } => self.stop_lane(slot, split, epoch, reason),
            Action::CommitDone { split, epoch, outcome } => self.commit_done(slot, split, epoch, outcome),
            Action::Event(e) => self.on_event(slot, e),
            Action::Finished(outcome) => {
                let who = self.slots[slot].owner.clone();
                let (complete, stalled) =
                    (outcome == Outcome::Complete, matches!(outcome, Outcome::Stalled { .. }));
                if complete || stalled {
                    self.checker.on_outcome(self.now, &who, complete, stalled, &mut self.state);
                    let name = if complete { "complete" } else { "stalled" };
                    if self.report.outcome != "none" && self.report.outcome != name {
                        self.checker.fail(
                            self.now,
                            "I6",
                            format!(
                                "{who} declared {name} but another worker declared {}",
                                self.report.outcome
                            ),
                        );
                    }
                    self.report.outcome = name;
                    let poison = self.opts.poison_crash + self.opts.poison_unprocessable > 0;
                    if poison && complete {
                        self.checker.fail(
                            self.now,
                            "P12",
                            format!("{who} declared Complete although a poison split exists"),
                        );
                    }
                }
                let s = &mut self.slots[slot];
                s.status = Status::Finished;
                s.outcome = Some(outcome);
                s.lanes.clear();
            }
            Action::Fatal(e) => {
                let msg = e.to_string();
                let expected = self.opts.scenario == Scenario::DuplicateId
                    && matches!(e, FatalError::DuplicateInstance { .. });
                if !expected {
                    self.checker.fail(
                        self.now,
                        "fatal",
                        format!("{} stopped with an unexpected fatal error: {msg}", self.slots[slot].owner),
                    );
                }
                self.report.fatal.push(msg);
                let s = &mut self.slots[slot];
                s.status = Status::Finished;
                s.lanes.clear();
                self.subs.retain(|x| x.slot != slot);
            }
        }
    }

    fn on_event(&mut self, slot: usize, e: Event) {
        match e {
            Event::Acquired { split, reason, .. } => {
                *self.report.acquisitions.entry(reason.label()).or_default() += 1;
                let balance_window =
                    !self.report.owned_after_convergence.is_empty() && !self.balance_window_closed;
                if reason == AcquisitionReason::Stolen
                    && ((self.opts.scenario == Scenario::Random && self.safety_over) || balance_window)
                {
                    self.report.steals_after_faults += 1;
                }
                if let Some(t) = self.released_at.remove(&split) {
                    let ms = self.now.saturating_since(t).as_secs_f64() * 1000.0;
                    let m = self.report.max_pickup_ms.get_or_insert(0.0);
                    *m = m.max(ms);
                }
            }
            Event::Quarantined { .. } => self.report.quarantined += 1,
            Event::Released { split } if self.opts.scenario == Scenario::DrainPickup => {
                self.released_at.insert(split, self.now);
            }
            _ => {}
        }
        let _ = slot;
    }

    fn plan(&self) -> Plan {
        let open = self.now < self.open_until;
        let splits = self
            .splits
            .iter()
            .filter(|s| !open || s.discovered_at <= self.now)
            .map(|s| PlannedSplit {
                id: s.id.clone(),
                descriptor: Bytes::copy_from_slice(&s.total.to_le_bytes()),
                weight: s.weight,
            })
            .collect();
        Plan { kind: if open { PlanKind::Open } else { PlanKind::Final }, splits }
    }

    // ----- lanes -----

    fn current_record(&mut self, id: &SplitId) -> Option<SplitRecord> {
        self.state.get(self.now, &keys::split(id)).and_then(|e| records::decode::<SplitRecord>(&e.value).ok())
    }

    fn start_lane(
        &mut self,
        slot: usize,
        split: SplitId,
        epoch: Epoch,
        descriptor: Bytes,
        progress: Option<Bytes>,
    ) {
        let total = u64::from_le_bytes(descriptor[..8].try_into().expect("sim descriptor"));
        let others: Vec<Epoch> = self
            .slots
            .iter()
            .filter(|s| matches!(s.status, Status::Running | Status::Paused))
            .filter_map(|s| s.lanes.get(&split).map(|l| l.epoch))
            .collect();
        let current = self.current_record(&split);
        self.checker.on_lane_start(self.now, &split, epoch, &others, current.as_ref());
        let next = progress_of(&progress);
        self.slots[slot].lanes.insert(
            split.clone(),
            Lane { epoch, next, total, since_commit: 0, committing: false, draining: false },
        );
        let life = self.slots[slot].life;
        let step = ms(self.opts.step_ms);
        self.schedule(step, Ev::LaneStep { slot, life, split, epoch });
    }

    fn lane_step(&mut self, slot: usize, split: SplitId, epoch: Epoch) {
        let Some(lane) = self.slots[slot].lanes.get(&split) else { return };
        if lane.epoch != epoch || lane.committing || lane.draining {
            return;
        }
        let (next, total) = (lane.next, lane.total);
        if next >= total {
            self.slots[slot].lanes.get_mut(&split).expect("lane").committing = true;
            return self.deliver(
                slot,
                Input::Finish { split, epoch, progress: Bytes::copy_from_slice(&total.to_le_bytes()) },
            );
        }
        let spec = &self.splits[self.split_index[&split]];
        match spec.poison {
            Poison::Crash(at) if at == next => {
                self.fault("poison_crash");
                // A crash is a fault: steals that rebalance after it are not oscillation (I7).
                if self.opts.scenario == Scenario::Random {
                    self.report.steals_after_faults = 0;
                }
                return self.crash(slot, true);
            }
            Poison::Unprocessable(at) if at == next => {
                self.slots[slot].lanes.remove(&split);
                self.checker.failed.insert((split.clone(), epoch));
                let error = format!("record {next} of {split} cannot be parsed");
                return self.deliver(slot, Input::Fail { split, epoch, error, unprocessable: true });
            }
            _ => {}
        }
        let owner = self.slots[slot].owner.clone();
        let current = self.current_record(&split);
        self.checker.on_emit(self.now, &split, next, epoch, &owner, current.as_ref());
        self.report.records_emitted += 1;
        let lane = self.slots[slot].lanes.get_mut(&split).expect("lane");
        lane.next += 1;
        lane.since_commit += 1;
        if lane.next >= lane.total {
            lane.committing = true;
            let total = lane.total;
            return self.deliver(
                slot,
                Input::Finish { split, epoch, progress: Bytes::copy_from_slice(&total.to_le_bytes()) },
            );
        }
        if lane.since_commit >= self.opts.commit_every {
            lane.committing = true;
            let p = lane.next;
            return self.deliver(
                slot,
                Input::Commit { split, epoch, progress: Bytes::copy_from_slice(&p.to_le_bytes()) },
            );
        }
        let life = self.slots[slot].life;
        self.schedule(ms(self.opts.step_ms), Ev::LaneStep { slot, life, split, epoch });
    }

    fn stop_lane(&mut self, slot: usize, split: SplitId, epoch: Epoch, reason: StopReason) {
        let Some(lane) = self.slots[slot].lanes.get_mut(&split) else { return };
        if lane.epoch != epoch {
            return;
        }
        match reason {
            StopReason::Draining => {
                if lane.draining {
                    return;
                }
                lane.draining = true;
                if lane.committing {
                    return; // acknowledged when the commit resolves
                }
                if lane.since_commit > 0 {
                    lane.committing = true;
                    let p = lane.next;
                    self.deliver(
                        slot,
                        Input::Commit { split, epoch, progress: Bytes::copy_from_slice(&p.to_le_bytes()) },
                    );
                } else {
                    self.slots[slot].lanes.remove(&split);
                    self.deliver(slot, Input::LaneStopped { split, epoch });
                }
            }
            StopReason::Fenced | StopReason::Starved => {
                self.slots[slot].lanes.remove(&split);
            }
        }
    }

    fn commit_done(&mut self, slot: usize, split: SplitId, epoch: Epoch, outcome: CommitOutcome) {
        let life = self.slots[slot].life;
        let Some(lane) = self.slots[slot].lanes.get_mut(&split) else { return };
        if lane.epoch != epoch {
            return;
        }
        lane.committing = false;
        match outcome {
            CommitOutcome::Ok => {
                lane.since_commit = 0;
                if lane.next >= lane.total && !lane.draining {
                    self.slots[slot].lanes.remove(&split);
                } else if lane.draining {
                    self.slots[slot].lanes.remove(&split);
                    self.deliver(slot, Input::LaneStopped { split, epoch });
                } else {
                    self.schedule(ms(self.opts.step_ms), Ev::LaneStep { slot, life, split, epoch });
                }
            }
            CommitOutcome::Lost => {
                self.slots[slot].lanes.remove(&split);
            }
            CommitOutcome::Retryable => {
                if lane.draining {
                    self.slots[slot].lanes.remove(&split);
                    self.deliver(slot, Input::LaneStopped { split, epoch });
                } else {
                    self.schedule(ms(self.opts.step_ms.max(50)), Ev::LaneStep { slot, life, split, epoch });
                }
            }
        }
    }

    // ----- the store -----

    fn kv(&mut self, bucket: Bucket) -> &mut MemoryKv {
        match bucket {
            Bucket::State => &mut self.state,
            Bucket::Lease => &mut self.lease,
        }
    }

    fn respond(&mut self, slot: usize, life: u32, op: OpId, result: StoreResult, after: Duration) {
        self.schedule(after, Ev::ToWorker { slot, life, input: Input::StoreResult { op, result } });
    }

    fn op_timeout(&self) -> Duration {
        ms(500)
    }

    fn store_op(
        &mut self,
        slot: usize,
        life: u32,
        op: OpId,
        bucket: Bucket,
        request: StoreRequest,
        fate: Fate,
    ) {
        if self.now < self.outage_until {
            let indeterminate = self.rng.chance(0.5);
            let (result, after) = if indeterminate {
                (Err(StoreError::Indeterminate("request timed out".into())), self.op_timeout())
            } else {
                (Err(StoreError::Unavailable("connection refused".into())), us(self.rng.range(100, 1000)))
            };
            return self.respond(slot, life, op, result, after);
        }
        if fate == Fate::LostRequest {
            let t = self.op_timeout();
            return self.respond(
                slot,
                life,
                op,
                Err(StoreError::Indeterminate("request timed out".into())),
                t,
            );
        }
        let writer = self.slots[slot].owner.clone();
        let result = self.apply(&writer, bucket, request);
        self.distribute(Bucket::State);
        self.distribute(Bucket::Lease);
        if fate == Fate::LostResponse {
            let t = self.op_timeout();
            return self.respond(slot, life, op, Err(StoreError::Indeterminate("response lost".into())), t);
        }
        let lat = us(self.rng.range(100, 1500));
        self.respond(slot, life, op, result, lat);
    }

    fn apply(&mut self, writer: &Owner, bucket: Bucket, request: StoreRequest) -> StoreResult {
        let now = self.now;
        let split_key = match &request {
            StoreRequest::Create { key, .. }
            | StoreRequest::CompareAndSwap { key, .. }
            | StoreRequest::Delete { key, .. } => Some(key.clone()),
            _ => None,
        };
        let old = split_key.as_ref().and_then(|k| self.kv(bucket).get(now, k));
        // NATS trap: a renewal landing within ~10 ms of the old revision's expiry can be acked
        // and then erased by that expiry.
        let erase = bucket == Bucket::Lease
            && self.faults_on
            && matches!(request, StoreRequest::CompareAndSwap { .. })
            && split_key
                .as_ref()
                .and_then(|k| self.lease.expires_at(k))
                .is_some_and(|t| t.saturating_since(now) <= ms(10))
            && self.rng.chance(0.5);
        let result = self.kv(bucket).execute(now, request);
        if let (Ok(StoreReply::Written(_)), Some(key)) = (&result, &split_key) {
            if bucket == Bucket::State {
                let new = self.state.get(now, key).expect("just written");
                if let Some(id) = keys::parse_split(key) {
                    let old = old.as_ref().and_then(|e| records::decode::<SplitRecord>(&e.value).ok());
                    let new = records::decode::<SplitRecord>(&new.value)
                        .expect("protocol writes decodable records");
                    self.checker.on_split_write(now, writer, &id, old.as_ref(), &new);
                } else if *key == keys::plan_head() {
                    let old = old.as_ref().and_then(|e| records::decode::<PlanHead>(&e.value).ok());
                    let new = records::decode::<PlanHead>(&new.value).expect("decodable head");
                    self.checker.on_head_write(now, writer, old.as_ref(), &new, &mut self.state);
                }
            } else if erase {
                self.fault("renewal_erased_by_expiry");
                self.lease.erase_as_expired(key);
            }
        }
        result
    }

    fn distribute(&mut self, bucket: Bucket) {
        let events = self.kv(bucket).take_events();
        for ev in events {
            if bucket == Bucket::Lease {
                self.checker.on_lease_event(&ev);
            }
            let Some(key) = ev.key().cloned() else { continue };
            for i in 0..self.subs.len() {
                let sub = &self.subs[i];
                if sub.watch.bucket() != bucket || !sub.watch.prefix().matches(&key) {
                    continue;
                }
                let mut delay = us(self.rng.range(200, 3000));
                if self.faults_on && self.rng.chance(0.01) {
                    delay += ms(self.rng.range(50, 500));
                }
                let at = (self.now + delay).max(Timestamp(self.subs[i].last_at.0 + 1));
                self.subs[i].last_at = at;
                let (slot, life, watch) = (self.subs[i].slot, self.subs[i].life, self.subs[i].watch);
                self.schedule_at(
                    at,
                    Ev::ToWorker { slot, life, input: Input::Watch { watch, event: ev.clone() } },
                );
            }
        }
    }

    fn open_watch(&mut self, slot: usize, life: u32, watch: WatchId) {
        if self.slots[slot].life != life {
            return;
        }
        self.subs.retain(|s| !(s.slot == slot && s.watch == watch));
        if self.now < self.outage_until {
            return self.schedule(ms(300), Ev::ToWorker { slot, life, input: Input::WatchFailed { watch } });
        }
        let now = self.now;
        let entries = self.kv(watch.bucket()).list(now, &watch.prefix());
        let mut at = self.now;
        for e in entries {
            at = at + us(self.rng.range(1, 50));
            self.schedule_at(
                at,
                Ev::ToWorker { slot, life, input: Input::Watch { watch, event: WatchEvent::Put(e) } },
            );
        }
        at = at + us(1);
        self.schedule_at(
            at,
            Ev::ToWorker { slot, life, input: Input::Watch { watch, event: WatchEvent::SnapshotComplete } },
        );
        self.subs.push(Sub { slot, life, watch, last_at: at });
    }

    // ----- faults -----

    fn live_slots(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| self.slots[i].status == Status::Running && !self.slots[i].draining)
            .collect()
    }

    fn crash(&mut self, slot: usize, restart: bool) {
        let s = &mut self.slots[slot];
        if !matches!(s.status, Status::Running | Status::Paused) {
            return;
        }
        self.checker.crashed.insert(s.owner.clone());
        s.core = None;
        s.lanes.clear();
        s.inbox.clear();
        s.tick_at = None;
        s.status = Status::Crashed { restart };
        s.life += 1;
        self.subs.retain(|x| x.slot != slot);
        if restart {
            let delay = ms(self.rng.range(200, self.opts.lease_secs * 2000));
            self.schedule(delay, Ev::Restart { slot });
        }
    }

    fn inject_fault(&mut self) {
        let live = self.live_slots();
        let roll = self.rng.range(0, 99);
        let lease = self.opts.lease_secs * 1000;
        match roll {
            0..=19 if !live.is_empty() => {
                let slot = live[self.rng.range(0, live.len() as u64 - 1) as usize];
                let r = self.rng.range(0, 9);
                if r < 7 {
                    self.fault("crash_restart_same_id");
                    self.crash(slot, true);
                } else if r < 9 || live.len() == 1 {
                    self.fault("crash_restart_new_id");
                    let id = self.new_instance_id();
                    self.slots[slot].restart_as = Some(id);
                    self.crash(slot, true);
                } else {
                    self.fault("crash_for_good");
                    self.crash(slot, false);
                }
            }
            20..=34 if !live.is_empty() => {
                let slot = live[self.rng.range(0, live.len() as u64 - 1) as usize];
                let (kind, dur) = if self.rng.chance(0.6) {
                    ("pause_longer_than_lease", ms(self.rng.range(lease * 12 / 10, lease * 3)))
                } else {
                    ("pause_short", ms(self.rng.range(50, lease / 2)))
                };
                self.fault(kind);
                self.slots[slot].status = Status::Paused;
                self.schedule(dur, Ev::Resume { slot });
            }
            35..=44 if self.now >= self.outage_until => {
                let (kind, dur) = if self.rng.chance(0.5) {
                    ("store_outage_short", ms(self.rng.range(100, lease / 2)))
                } else {
                    ("store_outage_long", ms(self.rng.range(lease * 12 / 10, lease * 5 / 2)))
                };
                self.fault(kind);
                self.outage_until = self.now + dur;
                // Every watch breaks with the connection.
                let subs = std::mem::take(&mut self.subs);
                for s in subs {
                    let d = ms(self.rng.range(1, 100));
                    self.schedule(
                        d,
                        Ev::ToWorker {
                            slot: s.slot,
                            life: s.life,
                            input: Input::WatchFailed { watch: s.watch },
                        },
                    );
                }
            }
            45..=59 if !self.subs.is_empty() => {
                self.fault("watch_dropped");
                let i = self.rng.range(0, self.subs.len() as u64 - 1) as usize;
                let s = self.subs.remove(i);
                let d = ms(self.rng.range(1, 50));
                self.schedule(
                    d,
                    Ev::ToWorker { slot: s.slot, life: s.life, input: Input::WatchFailed { watch: s.watch } },
                );
            }
            60..=72
                if self.slots.iter().filter(|s| s.status != Status::Finished).count()
                    < self.opts.max_workers =>
            {
                self.fault("scale_up");
                let id = self.new_instance_id();
                self.add_worker(id);
            }
            73..=82 if live.len() > 1 => {
                self.fault("scale_down_drain");
                let slot = live[self.rng.range(0, live.len() as u64 - 1) as usize];
                self.slots[slot].draining = true;
                self.deliver(slot, Input::Drain);
            }
            83..=92 => {
                let leader = live
                    .iter()
                    .copied()
                    .find(|&i| self.slots[i].core.as_ref().is_some_and(|c| c.is_leader()));
                if let Some(slot) = leader {
                    self.fault("leader_killed");
                    self.crash(slot, true);
                }
            }
            _ => {}
        }
    }

    fn resume(&mut self, slot: usize) {
        if self.slots[slot].status != Status::Paused {
            return;
        }
        self.slots[slot].status = Status::Running;
        let inbox = std::mem::take(&mut self.slots[slot].inbox);
        for ev in inbox {
            if self.slots[slot].status != Status::Running {
                break;
            }
            match ev {
                Ev::Tick { slot, life } => {
                    if self.slots[slot].life == life {
                        self.slots[slot].tick_at = None;
                        self.deliver(slot, Input::Tick);
                    }
                }
                other => self.dispatch(other),
            }
        }
        // Make sure the worker gets a tick for whatever is overdue.
        let life = self.slots[slot].life;
        self.slots[slot].tick_at = Some(self.now);
        self.schedule(Duration::ZERO, Ev::Tick { slot, life });
    }

    fn end_safety(&mut self) {
        self.safety_over = true;
        self.faults_on = false;
        self.outage_until = self.now;
        for slot in 0..self.slots.len() {
            if self.slots[slot].status == Status::Paused {
                self.resume(slot);
            }
        }
        let alive = self.slots.iter().any(|s| {
            matches!(s.status, Status::Running | Status::Paused | Status::Crashed { restart: true })
        });
        if !alive {
            let id = self.new_instance_id();
            self.add_worker(id);
        }
    }

    /// Scenario checkpoints.
    fn probe(&mut self) {
        match self.opts.scenario {
            Scenario::DuplicateId => {
                // A twin of the first worker, alive at the same time.
                let twin = self.slots[0].instance.clone();
                self.add_worker(twin);
            }
            Scenario::DrainPickup if self.now.0 == 3_000_000 => {
                self.deliver(0, Input::Drain);
            }
            Scenario::Balance => {
                if self.now.0 == 3_000_000 {
                    for _ in 0..2 {
                        let id = self.new_instance_id();
                        self.add_worker(id);
                    }
                    // Measure after convergence, then watch for further steals.
                    self.schedule(Duration::from_secs(20), Ev::Probe);
                } else if self.report.owned_after_convergence.is_empty() {
                    let owned: Vec<u32> = self
                        .slots
                        .iter()
                        .map(|s| s.core.as_ref().map_or(0, |c| c.held().count() as u32))
                        .collect();
                    let (min, max) =
                        (owned.iter().min().copied().unwrap_or(0), owned.iter().max().copied().unwrap_or(0));
                    if max - min > 1 {
                        self.checker.fail(
                            self.now,
                            "I7",
                            format!("owned counts {owned:?} differ by more than 1 after convergence"),
                        );
                    }
                    self.report.owned_after_convergence = owned;
                    self.report.steals_to_converge =
                        self.report.acquisitions.get("stolen").copied().unwrap_or(0);
                    self.report.steals_after_faults = 0;
                    self.schedule(Duration::from_secs(15), Ev::Probe);
                } else if !self.balance_window_closed {
                    self.balance_window_closed = true;
                    let n = self.report.steals_after_faults;
                    if n > 0 {
                        self.checker.fail(
                            self.now,
                            "I7",
                            format!("{n} steals after convergence: ownership oscillates"),
                        );
                    }
                }
            }
            _ => {}
        }
    }

    fn finish(mut self) -> Report {
        *self.checker.checks.entry("I7").or_default() += 1;
        *self.checker.checks.entry("I8").or_default() += 1;
        // I7 in random runs: once faults stop, every steal moves a split toward balance, so the
        // number of steals is bounded by the number of splits; more means ownership oscillates.
        if self.opts.scenario == Scenario::Random
            && self.report.steals_after_faults > self.splits.len() as u64
        {
            let n = self.report.steals_after_faults;
            self.checker.fail(
                self.now,
                "I7",
                format!(
                    "{n} steals after the faults stopped, for {} splits: ownership oscillates",
                    self.splits.len()
                ),
            );
        }
        if self.checker.violation.is_none()
            && self.report.outcome == "none"
            && self.opts.scenario == Scenario::Random
        {
            let states: Vec<String> = self
                .slots
                .iter()
                .map(|s| format!("{}: {:?} {:?}", s.instance, s.status, s.outcome))
                .collect();
            self.checker.fail(self.now, "I8", format!("the run ended without a job outcome: {states:?}"));
        }
        self.report.violation = self.checker.violation.take();
        self.report.checks = std::mem::take(&mut self.checker.checks);
        self.report.virtual_time = self.now.since_origin();
        self.report.trace_hash = self.hash;
        let _ = self.seed;
        self.report
    }
}
