//! The simulated world: workers (each a real core on its own clock), the event loop, the
//! planner, scenario probes and the report. The store model is in `net`, the fault injector in
//! `faults`, the lanes in `lanes`, the checkers in `check`.

mod faults;
mod lanes;
mod net;
mod operator;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::records::{self, PlanHead, PlanStatus, keys};
use etl_coordination_core::{
    AcquisitionReason, Action, Bucket, Config, Epoch, Event, FatalError, Incarnation, Input, InstanceId,
    OpId, Outcome, Owner, Plan, PlanKind, PlannedSplit, SplitId, StopReason, StoreRequest, Timestamp,
    WatchId, Worker,
};
use etl_coordination_memory::MemoryKv;

use crate::check::Checker;
use crate::clock::Clock;
use crate::options::{Options, Report, Scenario};
use crate::rng::Rng;
use lanes::Lane;
use net::{History, Link, Sent, Stuck, Sub};

/// A run that needs more events than this is livelocked.
const MAX_EVENTS: u64 = 6_000_000;

pub(crate) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub(crate) fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

/// Runs one simulation.
pub fn run(seed: u64, opts: &Options) -> Report {
    let mut w = World::new(seed, opts.clone());
    w.run();
    w.finish()
}

/// How the answer to a store request is delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The result, this long after the request is applied.
    After(Duration),
    /// The worker already got (or will get) an in-doubt or unavailable answer at its timeout.
    Dropped,
}

#[derive(Debug)]
pub(crate) enum Ev {
    ToWorker {
        slot: usize,
        life: u32,
        input: Input,
    },
    Tick {
        slot: usize,
        life: u32,
    },
    StoreApply {
        slot: usize,
        life: u32,
        op: OpId,
        bucket: Bucket,
        request: StoreRequest,
        writer: Owner,
        answer: Answer,
        /// When the sender's op timeout runs out (an answer after it is never delivered).
        deadline: Timestamp,
    },
    /// A stuck stream leader regains its quorum or steps down (see `net::Stuck`).
    StreamRecovered {
        bucket: Bucket,
    },
    OpenWatch {
        slot: usize,
        life: u32,
        watch: WatchId,
    },
    LaneStep {
        slot: usize,
        life: u32,
        split: SplitId,
        epoch: Epoch,
    },
    ExpiryTick,
    Erase {
        key: etl_coordination_core::Key,
        revision: etl_coordination_core::Revision,
    },
    FaultTick,
    Restart {
        slot: usize,
    },
    Crash {
        slot: usize,
        life: u32,
    },
    Resume {
        slot: usize,
    },
    EndSafety,
    Probe,
    BalanceProbe,
    /// The operator resets a split whose record another program overwrote.
    OperatorReset {
        split: SplitId,
    },
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
pub(crate) enum Status {
    Running,
    Paused,
    Crashed { restart: bool },
    Finished,
}

pub(crate) struct Slot {
    pub instance: InstanceId,
    pub life: u32,
    pub owner: Owner,
    pub core: Option<Worker>,
    pub status: Status,
    pub inbox: Vec<Ev>,
    pub tick_at: Option<Timestamp>,
    /// The source's lanes, by split and epoch (a stopped lane may still finish its record).
    pub lanes: BTreeMap<(SplitId, Epoch), Lane>,
    /// Lanes the core considers running (started and not stopped), with their epochs.
    pub core_lanes: BTreeMap<SplitId, Epoch>,
    /// The id to restart with (a crash may switch to a new id).
    pub restart_as: Option<InstanceId>,
    /// Asked to drain (scale-down): no longer counts as a live worker for fault decisions.
    pub draining: bool,
    pub outcome: Option<Outcome>,
    /// The job's end as this (staying) worker last reported it; the operator clears it when
    /// it requeues (and waits for a new report).
    pub ended: Option<Outcome>,
    /// The end this worker last declared (checked then): leaving with it later, after a drain,
    /// is the same declaration, not a new one.
    pub declared: Option<Outcome>,
    pub clock: Clock,
    pub link: Link,
    pub max_in_flight: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Poison {
    None,
    Crash(u64),
    Unprocessable(u64),
}

pub(crate) struct SplitSpec {
    pub id: SplitId,
    pub weight: u64,
    pub total: u64,
    pub poison: Poison,
    pub discovered_at: Timestamp,
}

pub(crate) struct World {
    pub opts: Options,
    pub rng: Rng,
    pub now: Timestamp,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    pub state: MemoryKv,
    pub lease: MemoryKv,
    pub history: [History; 2],
    pub subs: Vec<Sub>,
    pub slots: Vec<Slot>,
    pub splits: Vec<SplitSpec>,
    pub split_index: BTreeMap<SplitId, usize>,
    pub checker: Checker,
    pub report: Report,
    pub faults_on: bool,
    pub outage_until: Timestamp,
    open_until: Timestamp,
    next_instance: u32,
    pub safety_over: bool,
    released_at: BTreeMap<SplitId, Timestamp>,
    hash: u64,
    pub trace: bool,
    balance_window_closed: bool,
    /// Successful Final listings per plan term (P4: one listing per Final plan per term).
    final_listings: BTreeMap<u64, u32>,
    /// Random runs: consecutive balance probes with an imbalance that did not shrink.
    imbalance: (u32, u32),
    /// Lease-bucket revisions written by requests whose writer got no answer (in doubt).
    pub unacked_lease_writes: std::collections::BTreeSet<etl_coordination_core::Revision>,
    /// Per bucket: a stream leader that lost its quorum, with the writes it holds.
    pub stuck: [Option<Stuck>; 2],
    /// Reads a lagging replica answered (by slot, life and op, not delivered yet), with the
    /// keys it called absent although the store has them.
    pub stale_answers: BTreeMap<(usize, u32, OpId), Vec<etl_coordination_core::Key>>,
    /// The keys the answer being delivered calls absent wrongly: a fence of their split decided
    /// on it is one the core cannot avoid (it cannot tell that "absent" from an expiry).
    stale_absent: Vec<etl_coordination_core::Key>,
    /// Splits whose record another program overwrote, not reset yet.
    pub corrupted: BTreeSet<SplitId>,
    /// The operator requeued the quarantined splits (once per run).
    pub requeued: bool,
    /// The operator fixed the cause of the poison splits.
    pub healed: bool,
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
            rng,
            now: Timestamp::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            state: MemoryKv::with_explicit_expiry(),
            lease: MemoryKv::with_explicit_expiry(),
            history: Default::default(),
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
            final_listings: BTreeMap::new(),
            imbalance: (0, 0),
            unacked_lease_writes: Default::default(),
            stuck: Default::default(),
            stale_answers: Default::default(),
            stale_absent: Vec::new(),
            corrupted: BTreeSet::new(),
            requeued: false,
            healed: false,
        }
    }

    pub(crate) fn schedule(&mut self, after: Duration, ev: Ev) {
        self.schedule_at(self.now + after, ev);
    }

    pub(crate) fn schedule_at(&mut self, at: Timestamp, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled { at: at.max(self.now), seq: self.seq, ev }));
    }

    fn mix(&mut self, x: u64) {
        self.hash ^= x;
        self.hash = self.hash.wrapping_mul(0x0100_0000_01b3);
    }

    pub(crate) fn fault(&mut self, kind: &'static str) {
        *self.report.faults.entry(kind).or_default() += 1;
    }

    pub(crate) fn new_instance_id(&mut self) -> InstanceId {
        self.next_instance += 1;
        InstanceId::new(format!("w{}", self.next_instance)).expect("valid id")
    }

    pub(crate) fn add_worker(&mut self, instance: InstanceId) -> usize {
        let max_in_flight = if self.opts.mixed_capacity {
            self.rng.range(1, self.opts.max_in_flight as u64) as u32
        } else {
            self.opts.max_in_flight
        };
        self.slots.push(Slot {
            instance: instance.clone(),
            life: 0,
            owner: Owner { instance, incarnation: Incarnation(0) },
            core: None,
            status: Status::Crashed { restart: true },
            inbox: Vec::new(),
            tick_at: None,
            lanes: BTreeMap::new(),
            core_lanes: BTreeMap::new(),
            restart_as: None,
            outcome: None,
            ended: None,
            declared: None,
            draining: false,
            clock: Clock::new(0, 0),
            link: Link::default(),
            max_in_flight,
        });
        let slot = self.slots.len() - 1;
        self.start_worker(slot);
        slot
    }

    pub(crate) fn start_worker(&mut self, slot: usize) {
        let incarnation = Incarnation(self.rng.next_u64());
        let drift = self.opts.clock_drift_ppm as i64;
        let drift_ppm = if drift == 0 { 0 } else { self.rng.range(0, 2 * drift as u64) as i64 - drift };
        let offset = self.rng.range(0, 1_000_000_000);
        let s = &mut self.slots[slot];
        if let Some(id) = s.restart_as.take() {
            s.instance = id;
        }
        s.life += 1;
        s.owner = Owner { instance: s.instance.clone(), incarnation };
        // A new process: a monotonic clock with an origin and a rate of its own.
        s.clock = Clock::new(offset, drift_ppm);
        if drift_ppm != 0 {
            *self.report.faults.entry("clock_drifting").or_default() += 1; // (self.fault: `s` is borrowed)
        }
        s.link = Link::default();
        let mut cfg = Config::new(s.instance.clone(), incarnation, "sim-planner-v1");
        let t = &mut cfg.tuning;
        t.lease_duration = Duration::from_secs(self.opts.lease_secs);
        t.max_in_flight = s.max_in_flight;
        t.max_attempts = self.opts.max_attempts;
        t.replan_interval = Duration::from_secs(2);
        t.drain_timeout = self.opts.drain_timeout;
        t.plan_timeout = Duration::from_secs(5);
        cfg.stay_after_end = self.opts.stay_after_end;
        cfg.validate().expect("sim config is valid");
        s.core = Some(Worker::new(cfg));
        s.status = Status::Running;
        s.draining = false;
        s.ended = None;
        s.declared = None;
        s.tick_at = None;
        s.inbox.clear();
        s.lanes.clear();
        s.core_lanes.clear();
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
            // What this run's world is like (counted once per run).
            if self.opts.splits > records::MANIFEST_CHUNK_LEN {
                self.fault("plan_of_several_manifest_chunks");
            }
            if self.opts.mixed_capacity {
                self.fault("mixed_max_in_flight");
            }
            if self.opts.op_timeout > Duration::from_secs(self.opts.lease_secs) {
                self.fault("op_timeout_beyond_lease");
            }
            if self.opts.stay_after_end {
                self.fault("workers_stay_after_end");
            }
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
        if self.checker.violation.is_none() && self.safety_over && self.all_done() {
            self.settle();
        }
    }

    fn all_done(&self) -> bool {
        self.slots.iter().all(|s| matches!(s.status, Status::Finished | Status::Crashed { restart: false }))
    }

    /// After every worker finished: let what is still in flight land, then check that finished
    /// workers left no lease, presence or leader key behind.
    fn settle(&mut self) {
        while let Some(Reverse(s)) = self.queue.pop() {
            if let Ev::StoreApply { .. } | Ev::Erase { .. } = s.ev {
                self.now = s.at;
                self.dispatch(s.ev);
            }
        }
        let now = self.now;
        let left = self.lease.list(now, &etl_coordination_core::Prefix::all());
        for e in left {
            if self.unacked_lease_writes.contains(&e.revision) {
                // Its writer never learned it landed (the answer was in doubt and a read may
                // have come from a lagging replica): the TTL removes it.
                continue;
            }
            let written_at = self.history[1].get(&e.key).and_then(|v| v.back()).map_or(now, |(t, _)| *t);
            self.checker.on_leftover_key(now, &e, written_at);
        }
    }

    pub(crate) fn dispatch(&mut self, ev: Ev) {
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
            Ev::StoreApply { slot, life, op, bucket, request, writer, answer, deadline } => {
                self.store_apply(Sent {
                    slot,
                    life,
                    op,
                    bucket,
                    request,
                    writer,
                    answer,
                    deadline,
                    accepted_origin: None,
                })
            }
            Ev::StreamRecovered { bucket } => self.recover_stream(bucket),
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
                self.expiry_tick();
                self.schedule(ms(250), Ev::ExpiryTick);
            }
            Ev::Erase { key, revision } => self.erase(key, revision),
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
            Ev::BalanceProbe => self.balance_probe(),
            Ev::OperatorReset { split } => self.operator_reset(split),
        }
    }

    // ----- workers -----

    pub(crate) fn deliver(&mut self, slot: usize, input: Input) {
        let now = self.slots[slot].clock.local(self.now);
        let Some(core) = self.slots[slot].core.as_mut() else { return };
        if core.is_stopped() {
            return;
        }
        let life = self.slots[slot].life;
        self.stale_absent = match &input {
            Input::StoreResult { op, .. } => {
                self.stale_answers.remove(&(slot, life, *op)).unwrap_or_default()
            }
            _ => Vec::new(),
        };
        let core = self.slots[slot].core.as_mut().expect("checked above");
        let actions = core.handle(now, input);
        let deadline = core.next_deadline();
        self.mix(actions.len() as u64);
        for a in actions {
            self.act(slot, a);
            if self.slots[slot].core.is_none() {
                return; // crashed while acting (poison)
            }
        }
        self.check_running_lanes(slot);
        let s = &mut self.slots[slot];
        if let Some(d) = deadline {
            let at = s.clock.global(d).max(self.now);
            if s.tick_at.is_none_or(|t| t != at) {
                s.tick_at = Some(at);
                let life = s.life;
                self.schedule_at(at, Ev::Tick { slot, life });
            }
        }
    }

    /// P11: after every input, no lane the core keeps running may be past the TTL of the lease
    /// writes that landed for it (the store's time).
    fn check_running_lanes(&mut self, slot: usize) {
        let owner = self.slots[slot].owner.clone();
        let lanes: Vec<(SplitId, Epoch)> =
            self.slots[slot].core_lanes.iter().map(|(s, e)| (s.clone(), *e)).collect();
        for (split, epoch) in lanes {
            self.checker.lane_running(self.now, &split, epoch, &owner);
        }
    }

    fn act(&mut self, slot: usize, action: Action) {
        let life = self.slots[slot].life;
        if self.trace {
            eprintln!("{:>12}   {} -> {:?}", self.now.0, self.slots[slot].owner, action);
        }
        match action {
            Action::Store { op, bucket, request } => self.send_request(slot, op, bucket, request),
            Action::Watch { watch } => {
                let lat = us(self.rng.range(100, 1500));
                self.schedule(lat, Ev::OpenWatch { slot, life, watch });
            }
            Action::Plan { request } => self.run_planner(slot, request),
            Action::StartLane { split, epoch, descriptor, progress, .. } => {
                self.slots[slot].core_lanes.insert(split.clone(), epoch);
                self.start_lane(slot, split, epoch, descriptor, progress)
            }
            Action::StopLane { split, epoch, reason, deadline } => {
                // A draining lane with a deadline still runs (and is checked) until it
                // acknowledges the stop; any other stop is at once.
                let at_once = reason != StopReason::Draining || deadline.is_none();
                if at_once && self.slots[slot].core_lanes.get(&split) == Some(&epoch) {
                    self.slots[slot].core_lanes.remove(&split);
                }
                self.stop_lane(slot, split, epoch, reason, at_once)
            }
            Action::CommitDone { split, epoch, outcome } => self.commit_done(slot, split, epoch, outcome),
            Action::Event(e) => self.on_event(slot, e),
            Action::Finished(outcome) => {
                let who = self.slots[slot].owner.clone();
                if self.opts.stay_after_end && !self.slots[slot].draining {
                    let msg =
                        format!("{who} left with {outcome:?} although it stays after the end until drained");
                    self.checker.fail(self.now, "P13", msg);
                }
                self.declared(slot, &outcome);
                // Cleanup is checked for workers that left with the store reachable (faults over,
                // held requests landed): one cut off from it gives up after its drain deadline
                // and a lease, and its keys expire instead.
                if self.safety_over && self.now >= self.settled_at() {
                    self.checker.finished.insert(who, self.now);
                }
                let s = &mut self.slots[slot];
                s.status = Status::Finished;
                s.outcome = Some(outcome);
                s.lanes.clear();
                s.core_lanes.clear();
                self.operator_after_end();
            }
            Action::Fatal(e) => {
                let msg = e.to_string();
                let expected = self.opts.scenario == Scenario::DuplicateId
                    && matches!(e, FatalError::DuplicateInstance { .. });
                if !expected {
                    let who = self.slots[slot].owner.clone();
                    self.checker.fail(
                        self.now,
                        "fatal",
                        format!("{who} stopped with an unexpected fatal error: {msg}"),
                    );
                }
                self.report.fatal.push(msg);
                let s = &mut self.slots[slot];
                s.status = Status::Finished;
                s.lanes.clear();
                s.core_lanes.clear();
                self.subs.retain(|x| x.slot != slot);
            }
        }
    }

    /// A worker declared the job's end (leaving with it, or staying after it): I6 against the
    /// store, one outcome across workers, and no Complete while a poison split is unfixed.
    fn declared(&mut self, slot: usize, outcome: &Outcome) {
        let who = self.slots[slot].owner.clone();
        let (complete, stalled) = (*outcome == Outcome::Complete, matches!(outcome, Outcome::Stalled { .. }));
        if !(complete || stalled) || self.slots[slot].declared.as_ref() == Some(outcome) {
            return;
        }
        self.slots[slot].declared = Some(outcome.clone());
        self.checker.on_outcome(self.now, &who, complete, stalled, &mut self.state);
        let name = if complete { "complete" } else { "stalled" };
        if self.report.outcome != "none" && self.report.outcome != name {
            let msg = format!("{who} declared {name} but another worker declared {}", self.report.outcome);
            self.checker.fail(self.now, "I6", msg);
        }
        self.report.outcome = name;
        let poison = self.opts.poison_crash + self.opts.poison_unprocessable > 0;
        if poison && complete && !self.healed {
            self.checker.fail(
                self.now,
                "P12",
                format!("{who} declared Complete although a poison split exists"),
            );
        }
    }

    fn on_event(&mut self, slot: usize, e: Event) {
        match e {
            Event::JobEnded { outcome } => {
                self.declared(slot, &outcome);
                self.slots[slot].ended = Some(outcome);
                self.operator_after_end();
            }
            Event::JobReopened => {
                self.slots[slot].ended = None;
                self.slots[slot].declared = None;
            }
            Event::Acquired { split, reason, epoch } => {
                *self.report.acquisitions.entry(reason.label()).or_default() += 1;
                let who = self.slots[slot].owner.clone();
                self.checker.on_acquired(self.now, &split, epoch, reason, &who);
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
            Event::Revoked { split, reason: StopReason::Fenced } => {
                let (now, who) = (self.now, self.slots[slot].owner.clone());
                let record =
                    self.state.get(now, &keys::split(&split)).and_then(|e| records::decode(&e.value).ok());
                let lease =
                    self.lease.get(now, &keys::split(&split)).and_then(|e| records::decode(&e.value).ok());
                // Excused: another owner's write waits at a stuck leader (it may land), or the
                // answer being handled is a lagging replica's "absent" for this split's record
                // or lease (it looks like an expiry; only reads through the leader tell).
                let waiting = self.foreign_write_waiting(&split, &who)
                    || self.stale_absent.contains(&keys::split(&split));
                self.checker.on_fenced(now, &split, &who, record.as_ref(), lease.as_ref(), waiting);
            }
            Event::Quarantined { .. } => self.report.quarantined += 1,
            Event::Released { split } if self.opts.scenario == Scenario::DrainPickup => {
                self.released_at.insert(split, self.now);
            }
            _ => {}
        }
    }

    // ----- the planner -----

    /// The planner: lists the splits discovered so far (Open until every split is discovered,
    /// then Final). With planner faults it errs, hangs or panics (the driver reports a panic
    /// as an error).
    fn run_planner(&mut self, slot: usize, request: u64) {
        let life = self.slots[slot].life;
        let head = self.current_head();
        if let Some(h) = &head
            && h.status == PlanStatus::Published
            && h.manifest.is_some_and(|m| m.kind == PlanKind::Final)
        {
            let who = self.slots[slot].owner.clone();
            self.checker.fail(
                self.now,
                "P4",
                format!("{who} ran the planner although a Final plan is published (one listing per plan)"),
            );
        }
        if self.faults_on && self.opts.planner_faults {
            match self.rng.range(0, 99) {
                0..=9 => {
                    self.fault("planner_error");
                    let input =
                        Input::PlanReady { request, result: Err("listing failed: connection reset".into()) };
                    let delay = ms(self.rng.range(1, 300));
                    return self.schedule(delay, Ev::ToWorker { slot, life, input });
                }
                10..=14 => {
                    self.fault("planner_hang");
                    return;
                }
                15..=19 => {
                    self.fault("planner_panic");
                    let input = Input::PlanReady {
                        request,
                        result: Err("the planner panicked: index out of bounds".into()),
                    };
                    let delay = ms(self.rng.range(1, 50));
                    return self.schedule(delay, Ev::ToWorker { slot, life, input });
                }
                _ => {}
            }
        }
        let plan = self.plan();
        if plan.kind == PlanKind::Final
            && let Some(h) = head
        {
            let n = self.final_listings.entry(h.term).or_default();
            *n += 1;
            if *n > 1 {
                let msg = format!(
                    "a Final plan was listed {n} times in term {} (one listing per Final plan per term)",
                    h.term
                );
                self.checker.fail(self.now, "P4", msg);
            }
        }
        let delay = ms(self.rng.range(1, 40));
        self.schedule(
            delay,
            Ev::ToWorker { slot, life, input: Input::PlanReady { request, result: Ok(plan) } },
        );
        if self.faults_on && self.rng.chance(0.1) {
            // Leader death mid-plan.
            let when = ms(self.rng.range(0, 60));
            self.fault("leader_killed_mid_plan");
            self.schedule(when, Ev::Crash { slot, life });
        }
    }

    fn current_head(&mut self) -> Option<PlanHead> {
        let now = self.now;
        self.state.get(now, &keys::plan_head()).and_then(|e| records::decode::<PlanHead>(&e.value).ok())
    }

    fn plan(&self) -> Plan {
        let open = self.now < self.open_until;
        let splits = self
            .splits
            .iter()
            .filter(|s| !open || s.discovered_at <= self.now)
            .map(|s| {
                PlannedSplit::new(s.id.clone(), Bytes::copy_from_slice(&s.total.to_le_bytes()), s.weight)
            })
            .collect();
        Plan::new(if open { PlanKind::Open } else { PlanKind::Final }, splits)
    }

    // ----- phases and probes -----

    fn end_safety(&mut self) {
        self.safety_over = true;
        self.faults_on = false;
        self.outage_until = self.now;
        for bucket in [Bucket::State, Bucket::Lease] {
            self.recover_stream(bucket);
        }
        for slot in 0..self.slots.len() {
            self.slots[slot].link.heal(self.now);
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
        if self.opts.scenario == Scenario::Random {
            // Requests held by stalled links during the safety phase land up to two op
            // timeouts later; balance is judged once they have.
            let at = self.settled_at();
            self.schedule_at(at, Ev::BalanceProbe);
        }
        self.operator_after_end();
    }

    /// When the faults of the safety phase no longer act: held requests have landed (two op
    /// timeouts) and a worker that began leaving under them has finished (drain deadline and a
    /// lease).
    fn settled_at(&self) -> Timestamp {
        let lease = Duration::from_secs(self.opts.lease_secs);
        Timestamp::ZERO + self.opts.safety + self.opts.op_timeout * 2 + lease * 2 + Duration::from_secs(2)
    }

    /// I7 in random runs: once faults stop, an imbalance of two or more between live workers
    /// with spare capacity must shrink within a few heartbeats (steals converge, P9).
    fn balance_probe(&mut self) {
        let hb = Duration::from_secs(self.opts.lease_secs) / 3;
        let mut counts = Vec::new();
        for s in &self.slots {
            if s.status != Status::Running || s.draining {
                continue;
            }
            if let Some(c) = &s.core
                && !c.is_stopped()
            {
                counts.push((c.held().count() as u32, s.max_in_flight));
            }
        }
        let spare: Vec<u32> = counts.iter().filter(|(h, cap)| h < cap).map(|(h, _)| *h).collect();
        let max = counts.iter().map(|(h, _)| *h).max().unwrap_or(0);
        let min = spare.iter().copied().min().unwrap_or(max);
        let gap = max.saturating_sub(min);
        if gap >= 2 {
            let (n, last) = self.imbalance;
            self.imbalance = if gap >= last { (n + 1, gap) } else { (1, gap) };
            *self.checker.checks.entry("I7").or_default() += 1;
            if self.imbalance.0 >= 12 {
                let msg = format!(
                    "owned counts {counts:?} kept a gap of {gap} for 12 heartbeats after the faults stopped"
                );
                self.checker.fail(self.now, "I7", msg);
            }
        } else {
            self.imbalance = (0, 0);
        }
        if !self.all_done() {
            self.schedule(hb, Ev::BalanceProbe);
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
            let msg = format!(
                "{n} steals after the faults stopped, for {} splits: ownership oscillates",
                self.splits.len()
            );
            self.checker.fail(self.now, "I7", msg);
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
        self.report
    }
}
